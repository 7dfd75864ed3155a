#!/usr/bin/env bash
# Remakes tests/fixtures/quant/kquant-golden.bin: ggml's own Q4_K, Q5_K, Q6_K and Q5_0 bytes
# (what llama-quantize writes, no importance matrix) for scripts/kquant_golden.c's matrix,
# which src/quant/encode.rs's tests compare moec's encoder with byte for byte.
# Takes: g++ and the ggml that scripts/gguf_fixtures.sh builds under $MOEC_PEER_CACHE
# (default ~/.cache/moec-peer; build-0.3.36 and the llama-cpp-python 0.3.36 sdist).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}
LLAMA=$CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp
BUILD=$CACHE/build-0.3.36
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
gcc -O2 -std=gnu11 -c -I"$LLAMA/ggml/include" "$REPO/scripts/kquant_golden.c" -o "$TMP/golden.o"
g++ "$TMP/golden.o" "$BUILD/ggml/src/libggml-base.a" -fopenmp -lpthread -lm -o "$TMP/golden"
mkdir -p "$REPO/tests/fixtures/quant"
"$TMP/golden" > "$REPO/tests/fixtures/quant/kquant-golden.bin"
sha256sum "$REPO/tests/fixtures/quant/kquant-golden.bin"
