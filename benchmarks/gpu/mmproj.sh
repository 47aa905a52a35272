#!/usr/bin/env bash
# On the device (carry [".gpu"]): build the pinned llama.cpp's libmtmd with CUDA (sm_90, about 225 s on 16 cores), the
# tests/mtmd/mtmd_mem.cpp oracle against it, then benchmarks/gpu/mmproj.py: $OUT/gpu-mmproj-h200.json.
set -u
OUT=${OUT:-/tmp/o}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/gguf-*.whl || exit 1
mkdir -p /tmp/src && tar xzf .gpu/llama-cpp-python-src.tgz -C /tmp/src || exit 1
V=/tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp
t0=$(date +%s)
( cmake -S $V -B /tmp/mt -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF && timeout 400 cmake --build /tmp/mt --target mtmd -j "$(nproc)" ) > "$OUT/build.log" 2>&1
echo "build exit $? after $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/build.log"
L=""; for d in $(find /tmp/mt -name 'lib*.so' -printf '%h\n' | sort -u); do L="$L -L$d -Wl,-rpath,$d"; done
g++ -O1 -rdynamic -o /tmp/mtmd_mem tests/mtmd/mtmd_mem.cpp -I$V/ggml/include -I$V/include -I$V/tools/mtmd $L \
    -lmtmd -lggml-base -lggml -lllama -ldl || exit 1
PYTHONPATH=/tmp/site:$(pwd) python3 benchmarks/gpu/mmproj.py /tmp/mtmd_mem "$OUT/gpu-mmproj-h200.json"
echo "=== done after $(( $(date +%s) - t0 )) s"
