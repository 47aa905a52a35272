#!/usr/bin/env bash
# On the device (carry [".gpu"]): build the pinned llama.cpp's llama-bench with CUDA (sm_90), then benchmarks/gpu/speed.py
# over the cases named as arguments (see speed.py): $OUT/speed-<group>.json, $OUT/run.log. A warm machine keeps the
# build (/tmp/lb) for the next call.
set -u
OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
t0=$(date +%s)
if [ ! -x /tmp/lb/bin/llama-bench ]; then
  mkdir -p /tmp/src && { [ -d /tmp/src/llama_cpp_python-0.3.36 ] || tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src; }
  V=/tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp
  ( cmake -S $V -B /tmp/lb -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
      -DCMAKE_RUNTIME_OUTPUT_DIRECTORY=/tmp/lb/bin && timeout 420 cmake --build /tmp/lb --target llama-bench -j "$(nproc)" ) \
      > "$OUT/build.log" 2>&1
  echo "build exit $? after $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/build.log"
fi
PYTHONPATH=/tmp/site:$(pwd) PYTHONUNBUFFERED=1 python3 benchmarks/gpu/speed.py /tmp/lb/bin/llama-bench "$OUT" "$@"
echo "=== done after $(( $(date +%s) - t0 )) s"
