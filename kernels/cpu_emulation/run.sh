#!/bin/sh
# Checks the math of kernels/*.cu without a GPU: builds the CPU emulation (g++ >= 12,
# C++20, ucontext fibers) and compares every kernel with torch references, without and with a sliding
# window. Needs a Python with numpy and torch: PYTHON=/path/to/python (default python3).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for f in "$here"/../*.cu; do
    # Dynamic shared memory has no host equivalent: point it at the shim's array.
    sed 's/extern __shared__ float q_group\[\];/float* q_group = dyn_smem;/' "$f" > "$work/$(basename "$f")"
done
cp "$here/shim.h" "$here/harness.cpp" "$here"/../*.cuh "$work/"
g++ -std=c++20 -O1 -pthread -ffp-contract=off -I"$work" "$work/harness.cpp" -o "$work/harness"
mkdir -p "$work/data"
for window in 0 20; do
    "${PYTHON:-python3}" "$here/check.py" "$work/harness" "$work/data" "$window"
done
