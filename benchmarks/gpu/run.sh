#!/usr/bin/env bash
# On the device machine (NVIDIA H200), in one call: get llama-cpp-python 0.3.36 with CUDA for this GPU
# only, then run the phases of measure.py named as arguments ("dry", "load", "load:SHAPE,SHAPE",
# "budget", "study", "study:decode", "study:oom-study.toml" with STUDY_ARGS="--budget 26583MiB --margin 0";
# default "dry").
#
# llama-cpp-python with CUDA comes from /tmp/site when the machine is still warm from an earlier call,
# else it is built from the pinned sdist (sm_90 only, about 300 s on 16 cores; the build, 116 MB packed,
# is too big to come back through $OUT). Carry [".gpu"] (or [".gpu/whl"] on a warm machine):
# llama-cpp-python-src.tgz, whl/ (pydantic, gguf, optuna, ... for Python 3.12).
# Results: $OUT/<phase>.json, $OUT/run.log.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
REPO=$(pwd)
LOG="$OUT/run.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
if [ ! -d /tmp/site/pydantic ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
fi
t0=$(date +%s)
if [ -n "${NO_WHEEL:-}" ]; then
    echo "llama-cpp-python (CUDA): not built (NO_WHEEL: the phases probe with llama-server)"
elif [ -f /tmp/site/llama_cpp/lib/libggml-cuda.so ]; then
    echo "llama-cpp-python (CUDA): already built on this machine"
else
    mkdir -p /tmp/src && tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src || exit 1
    if [ -n "${TRACE_ALLOC:-}" ]; then  # ggml-alloc's AT_PRINTF on (debug log only): every allocation of a reserve
        sed -i 's|^#define AT_PRINTF(...)$|#define AT_PRINTF(...) GGML_LOG_DEBUG(__VA_ARGS__)|' \
            /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-alloc.c
    fi
    ( cd /tmp/src/llama_cpp_python-0.3.36 && \
      CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${BUILD_TIMEOUT:-450}" \
      python3 -m pip install --no-deps --no-build-isolation --no-compile --target /tmp/site . ) > "$OUT/build.log" 2>&1
    echo "llama-cpp-python (CUDA): build exit $? after $(( $(date +%s) - t0 )) s"
    tail -3 "$OUT/build.log"
fi
[ -n "${NO_WHEEL:-}" ] || python3 -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'gpu offload', llama_cpp.llama_supports_gpu_offload())" || exit 1
for arg in "${@:-dry}"; do
    phase=${arg%%:*}
    extra=()
    if [ "$arg" != "$phase" ]; then
        if [ "$phase" = study ]; then extra=(--studies "${arg#*:}"); else extra=(--shapes "${arg#*:}"); fi
    fi
    [ "$phase" = study ] && extra+=(--study-args "${STUDY_ARGS:-}")  # e.g. "--budget 26583MiB --margin 0"
    [ "$phase" = budget ] && extra+=(--cases "${BUDGET_CASES:-}")  # e.g. "drafter": only the cases naming it
    [ "$phase" = placement ] && extra+=(--gpus "${GPUS:-1}" --workers "${WORKERS:-8}")  # GPUS=2: the split-mode grid too
    [ "$phase" = experts ] && extra+=(--budget-mib "${BUDGET_MIB:-22000}")  # a 3090-sized GPU
    [ "$phase" = study ] && [ -n "${BUDGET_MIB:-}" ] && extra+=(--budget-mib "$BUDGET_MIB")  # held free meanwhile
    [ "$phase" = fitparams ] && extra+=(--repeats "${REPEATS:-1}")  # measured runs per prompt
    [ "$phase" = hostrss ] && extra+=(--budget-mib "${BUDGET_MIB:-22000}" --host-budget-mib "${HOST_BUDGET_MIB:-8192}")
    if [ "$phase" = fitparams ] || [ "$phase" = hostrss ]; then  # llama-fit-params and llama-server, pinned source
        [ "$phase" = fitparams ] && extra+=(--budget-mib "${BUDGET_MIB:-22000}")
        if [ ! -x /tmp/fitp/bin/llama-fit-params ]; then
            mkdir -p /tmp/src && [ -d /tmp/src/llama_cpp_python-0.3.36 ] || tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src
            ( cd /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B /tmp/fitp -DGGML_CUDA=on \
                -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
                -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
                -DCMAKE_RUNTIME_OUTPUT_DIRECTORY=/tmp/fitp/bin > "$OUT/fitp-build.log" 2>&1 && \
              cmake --build /tmp/fitp --target llama-fit-params llama-server -j "$(nproc)" >> "$OUT/fitp-build.log" 2>&1 )
            echo "llama-fit-params: build exit $?"
        fi
        export LLAMA_FIT_PARAMS=/tmp/fitp/bin/llama-fit-params LLAMA_SERVER=/tmp/fitp/bin/llama-server
    fi
    echo "=== phase $arg ($(date +%T))"
    if [ "$phase" = hostops ]; then  # hostops:dry,load,lora (TRACE=1: keep the traced cases' debug logs)
        parts=${arg#hostops}; parts=${parts#:}
        python3 benchmarks/gpu/hostops.py --out "$OUT" --parts "${parts:-dry,load,lora}"
        continue
    fi
    python3 benchmarks/gpu/measure.py --out "$OUT" --phase "$phase" "${extra[@]}"
done
python3 benchmarks/gpu/report.py "$OUT" | tee "$OUT/report.txt"
echo "=== done ($(date +%T)), $(( $(date +%s) - t0 )) s"
