#!/usr/bin/env python3
"""Golden values for moec's block decoders (src/quant/), from gguf-py.

gguf-py (llama.cpp's own Python package, `gguf.quants.dequantize`) is an implementation
of the GGUF block formats independent of moec's. This writes a few blocks of each format
moec decodes, with random codes and scale bytes and chosen f16 super-block scales, and
the f32 weights gguf-py decodes them to, as tests/fixtures/quant/blocks.json (bytes as
hex, weights as the hex of their f32 bits, so the comparison is exact).

Usage: python3 scripts/quant_golden.py   (needs numpy and gguf-py; scripts/gguf_fixtures.sh
makes a venv with both from PyPI and the llama-cpp-python sdist)
"""
import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/quant/blocks.json"
rng = np.random.default_rng(29)

# Byte offsets of each format's f16 fields, set to finite values so no weight is NaN.
FORMATS = {
    "Q8_0": (T.Q8_0, 34, [0]),
    "Q4_K": (T.Q4_K, 144, [0, 2]),
    "Q5_K": (T.Q5_K, 176, [0, 2]),
    "Q6_K": (T.Q6_K, 210, [208]),
    # Appended after the first four so their blocks (drawn first) stay as they were.
    "Q4_0": (T.Q4_0, 18, [0]),
    "Q4_1": (T.Q4_1, 20, [0, 2]),
    # MXFP4's scale is an e8m0 byte: every value 0..255 is drawn (subnormal to 2^127).
    "MXFP4": (T.MXFP4, 17, []),
    # Appended last, so the blocks drawn before it stay as they were.
    "Q5_0": (T.Q5_0, 22, [0]),
}

cases = []
for name, (qtype, block_bytes, f16_fields) in FORMATS.items():
    blocks = rng.integers(0, 256, size=(3, block_bytes), dtype=np.uint8)
    for b in blocks:
        for at in f16_fields:
            value = np.float16(rng.uniform(-0.05, 0.05))
            b[at : at + 2] = np.frombuffer(value.tobytes(), dtype=np.uint8)
    raw = blocks.reshape(-1)
    values = dequantize(raw, qtype).astype(np.float32).reshape(-1)
    cases.append(
        {
            "format": name,
            "bytes": raw.tobytes().hex(),
            "weights_f32_bits": values.view(np.uint32).byteswap().tobytes().hex(),
        }
    )

OUT.write_text(json.dumps({"source": "gguf-py gguf.quants.dequantize", "cases": cases}, indent=1) + "\n")
print(f"wrote {OUT}")
