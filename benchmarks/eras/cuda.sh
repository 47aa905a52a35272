#!/usr/bin/env bash
# On the device machine (NVIDIA H200), one call per release: build that llama-cpp-python release with CUDA (sm_90
# only, ~300 s on 16 cores) and record its CUDA dry runs over the eras grid (benchmarks/eras/record.py --gpu).
# Carry [".gpu/whl", ".gpu-era/llama-cpp-python-<release>.tgz"] (a stripped sdist, see README.md beside this file).
#   bash benchmarks/eras/cuda.sh 0.3.23        -> $OUT/eras-cuda-0.3.23.json, $OUT/build.log, $OUT/run.log
set -u
REL=$1
OUT=${OUT:-/tmp/era-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
SITE=/tmp/site-$REL
t0=$(date +%s)
if [ ! -d "$SITE/llama_cpp" ]; then
    mkdir -p /tmp/src && tar xzf ".gpu-era/llama-cpp-python-$REL.tgz" -C /tmp/src || exit 1
    ( cd "/tmp/src/llama_cpp_python-$REL" && \
      CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${BUILD_TIMEOUT:-470}" \
      python3 -m pip install --no-deps --no-build-isolation --no-compile --target "$SITE" . ) > "$OUT/build.log" 2>&1
    echo "build $REL: exit $? after $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/build.log"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu/whl/diskcache-*.whl  # llama_cpp imports it
fi
# one GPU unless GPUS says otherwise (on two, llama.cpp splits the layers: -sm layer)
CUDA_VISIBLE_DEVICES=${GPUS:-0} PYTHONPATH=/tmp/site:$(pwd) PYTHONUNBUFFERED=1 python3 benchmarks/eras/record.py "$REL" --site "$SITE" --gpu \
    --out "$OUT/eras-cuda${GPUS:+-x2}-$REL.json"
echo "done after $(( $(date +%s) - t0 )) s"
