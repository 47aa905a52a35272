#!/usr/bin/env bash
# On the device machine: llama-server of the pinned build with ggml-alloc's AT_PRINTF switched on (every allocation
# of the compute reserve: tensor, size, offset), on the full-size Qwen3.6-35B-A3B shape, for a placement ggfit gets
# wrong. Compare the sequence with ggfit's own (fitter.ggml.alloc's DynAllocator.alloc in the same order) to find the
# first allocation that differs.
#   bash benchmarks/gpu/alloc_trace.sh NAME LLAMA-SERVER-FLAGS...   (carry [".gpu"]; $OUT/NAME.log.gz)
# e.g. bash benchmarks/gpu/alloc_trace.sh ncm4 -c 32768 -b 2048 -ub 512 -fa on -np 4 --kv-unified -lm none --n-cpu-moe 4
# The build takes about 190 s on 32 cores; each server start about 2 minutes (the weights are read from the file).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$(pwd) PYTHONUNBUFFERED=1
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
t0=$(date +%s)
if [ ! -x /tmp/trc/bin/llama-server ]; then
  mkdir -p /tmp/src && [ -d /tmp/src/llama_cpp_python-0.3.36 ] || tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src
  L=/tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp
  sed -i 's|^#define AT_PRINTF(...)$|#define AT_PRINTF(...) GGML_LOG_DEBUG(__VA_ARGS__)|' $L/ggml/src/ggml-alloc.c
  ( cd $L && cmake -B /tmp/trc -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
      -DCMAKE_RUNTIME_OUTPUT_DIRECTORY=/tmp/trc/bin > "$OUT/build.log" 2>&1 && \
    cmake --build /tmp/trc --target llama-server -j "$(nproc)" >> "$OUT/build.log" 2>&1 )
  echo "build exit $? after $(( $(date +%s) - t0 )) s"
fi
S=${SHAPE:-qwen36-35b-a3b}
M=$(python3 -c "from tests.synth.shapes import build_shape, q4_k_m_types as q; print(build_shape('$S', tensor_types=q('$S')))")
name=$1; shift
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} /tmp/trc/bin/llama-server -m "$M" --port 18123 --host 127.0.0.1 -lv 5 \
    -fit off --no-repack "$@" > "$OUT/$name.log" 2>&1 &
pid=$!
for _ in $(seq 1 400); do
  grep -q "server is listening\|main: exiting\|error" "$OUT/$name.log" && break
  sleep 0.5
done
kill $pid; wait $pid 2>/dev/null
grep "compute buffer size" "$OUT/$name.log"
gzip -f "$OUT/$name.log"
echo "done after $(( $(date +%s) - t0 )) s"
