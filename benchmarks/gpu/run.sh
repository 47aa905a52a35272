#!/usr/bin/env bash
# One call on the device machine (NVIDIA H200): build llama-cpp-python 0.3.36 with CUDA for this GPU
# only, then compare ggfit's CUDA prediction with llama.cpp's CUDA dry run on full-size model shapes.
# Needs, carried in .gpu/ (ignored by git): llama-cpp-python-src.tgz (the pinned sdist, stripped of
# models/docs/tests) and whl/ (pydantic, pydantic-core, annotated-types, typing-inspection, gguf,
# diskcache for Python 3.12). Results: $OUT/gpu-memory.json, $OUT/report.txt, $OUT/build.log.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
REPO=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$REPO
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
mkdir -p /tmp/src && tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src
t0=$(date +%s)
( cd /tmp/src/llama_cpp_python-0.3.36 && \
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${BUILD_TIMEOUT:-450}" \
  python3 -m pip install --no-deps --no-build-isolation --no-compile --target /tmp/site . ) > "$OUT/build.log" 2>&1
echo "build exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
python3 -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.llama_supports_gpu_offload())" 2>&1 | tee -a "$OUT/build.log"
timeout "${MEASURE_TIMEOUT:-240}" python3 benchmarks/gpu/measure.py --out "$OUT" 2>&1 | tee "$OUT/measure.log" | tail -60
