#!/usr/bin/env bash
# llama.cpp's CUDA build for the GPU machine (issue 44 point 6), made on a CPU-only machine:
# the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (the same sources as
# scripts/peer-bench.sh's CPU build), compiled for sm_90 (H100/H200) with nvcc, cudart and
# cuBLAS from NVIDIA's PyPI wheels (CUDA 13.0, the GPU machine's toolkit), no GPU needed.
#
# What it gives: $MOEC_LLAMA_CUDA_CACHE/dist (default ~/.cache/moec-llama-cuda/dist), stripped:
#   llama-batched-bench, libllama.so, libggml.so, libggml-base.so, libggml-cuda.so and the CPU
#   backends libggml-cpu-*.so, one per x86 generation (ggml loads the best one for the CPU it
#   runs on: the GPU machine's CPU is not this one).
# Choices, each because the machine that runs it differs from the one that builds it:
#   - cudart linked statically; cuBLAS dynamically (libcublas.so.13 is in the GPU machine's
#     /usr/local/cuda/lib64, and its wheel is 500+ MB);
#   - GGML_CUDA_NO_VMM: the wheels carry no libcuda.so stub to link the driver API against,
#     so ggml's memory pool uses cudaMalloc instead of virtual memory management;
#   - no NCCL (one GPU); flash attention kernels on (llama.cpp's default, `-fa auto`).
# Run the result with the dist folder and /usr/local/cuda/lib64 on LD_LIBRARY_PATH
# (scripts/gpu-bench.sh does: put dist/ beside the moec binary as llama.cpp/, or name it in
# GPU_BENCH_LLAMA_DIR).
#
# Time: about 530 compile steps; hours on 2 busy cores (it runs under nice 19 and resumes
# where it stopped when run again).
#
# Usage: scripts/build-llama-cuda.sh [--jobs 2]
set -euo pipefail

CACHE=${MOEC_LLAMA_CUDA_CACHE:-$HOME/.cache/moec-llama-cuda}
SDIST=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}/llama_cpp_python-0.3.36
JOBS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) JOBS=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "build-llama-cuda: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
log() { echo "build-llama-cuda: $*" >&2; }

SRC=$SDIST/vendor/llama.cpp
if [ ! -d "$SRC/ggml/src/ggml-cuda" ]; then
  log "no llama.cpp sources at $SRC: run scripts/peer-bench.sh once (it unpacks the sdist there)"
  exit 1
fi
mkdir -p "$CACHE"
cd "$CACHE"
if [ ! -x venv/bin/cmake ]; then
  log "making a venv with the CUDA 13.0 compiler, runtime and cuBLAS wheels, cmake and ninja"
  python3 -m venv venv
  # nvvm and crt pinned with nvcc: unpinned they resolve to a newer release whose PTX this
  # ptxas rejects ("Unsupported .version").
  venv/bin/pip install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.0.19 "nvidia-cuda-cccl==13.0.*" \
    cmake==4.4.4 ninja==1.13.2
fi
N=$(echo "$CACHE"/venv/lib/python3*/site-packages/nvidia/cu13)
# The wheels' layout lacks what a toolkit has and CMake looks for: lib64/, unversioned names.
ln -sfn lib "$N/lib64"
for lib in cublas cublasLt cudart; do ln -sf "lib$lib.so.13" "$N/lib/lib$lib.so"; done
export PATH=$CACHE/venv/bin:$N/bin:$PATH

if [ ! -f build/build.ninja ]; then
  cmake -S "$SRC" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER="$N/bin/nvcc" -DCUDAToolkit_ROOT="$N" \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF \
    -DCMAKE_CUDA_RUNTIME_LIBRARY=Static -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON \
    -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
fi
# ggml's target depends on every CPU variant (GGML_CPU_ALL_VARIANTS), so they build too.
nice -n 19 ninja -C build -j "$JOBS" llama-batched-bench ggml-cuda

rm -rf dist && mkdir dist
cp build/bin/llama-batched-bench dist/
for so in build/bin/libllama.so* build/bin/libggml.so* build/bin/libggml-base.so* build/bin/libggml-cuda.so*; do
  [ -e "$so" ] && cp -P "$so" dist/
done
cp build/bin/libggml-cpu-*.so dist/
find dist -type f -exec strip --strip-unneeded {} +
log "dist: $(du -sh dist | cut -f1) in $CACHE/dist:"
ls -la dist >&2
