#!/usr/bin/env bash
# DeepSeek-V3 GGUF fixtures and their references (issue 29): llama.cpp's own converter and
# llama-quantize on moec's synthetic checkpoint of tests/fixtures/gguf/deepseek-v3-q4-tiny.ron
# (noaux_tc sigmoid routing with its correction bias, routed scaling 2.5, top-k renormalised,
# MLA with split attn_k_b/attn_v_b), as f32, Q8_0 and Q4_K_M, into $FAMILIES_OUT (default
# $MOEC_PEER_CACHE/gguf-fixtures-families, beside the other families; sha256 checked against
# tests/fixtures/gguf/SHA256SUMS-deepseek-v3). Then writes
# tests/fixtures/gguf/deepseek_v3_references.json: Hugging Face transformers' first-step
# logits and 16 greedy tokens on the Hub folder (the independent reference moec's f32 GGUF is
# held to), and llama.cpp's 16 greedy tokens with f32 attention on each file
# (scripts/llama_greedy.cpp, LLAMA_GREEDY_ATTN=f32).
#
# Takes what scripts/gguf_fixtures.sh takes (its llama.cpp build, llama_greedy binary and
# venv under MOEC_PEER_CACHE) and a release moec.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}
OUT=${FIXTURES:-$CACHE/gguf-fixtures}
FOUT=${FAMILIES_OUT:-$CACHE/gguf-fixtures-families}
LLAMA=$CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp
BUILD=$CACHE/build-0.3.36
PY=$CACHE/venv/bin/python
(cd "$REPO" && cargo build --release -q --bin moec)
MOEC=$REPO/target/release/moec
mkdir -p "$FOUT"
rm -rf "$FOUT/deepseek-v3-q4-hf"
"$MOEC" synth --model "$REPO/tests/fixtures/gguf/deepseek-v3-q4-tiny.ron" --out "$FOUT/deepseek-v3-q4-hf"
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$FOUT/deepseek-v3-q4-hf" --outtype f32 \
  --outfile "$FOUT/deepseek-v3-q4-f32.gguf" > "$FOUT/convert-deepseek-v3.log" 2>&1
for t in Q8_0 Q4_K_M; do
  "$BUILD/bin/llama-quantize" "$FOUT/deepseek-v3-q4-f32.gguf" "$FOUT/deepseek-v3-q4-$t.gguf" "$t" \
    > "$FOUT/quantize-deepseek-v3-$t.log" 2>&1
done
(cd "$FOUT" && sha256sum -c "$REPO/tests/fixtures/gguf/SHA256SUMS-deepseek-v3")
# The Qwen3-MoE/DeepSeek-V2 fixtures' prompt (cl100k ids of "The capital of France is").
ids=$(python3 -c "import json; print(*json.load(open('$REPO/tests/fixtures/gguf/llama_greedy_families.json'))['deepseek-v2']['prompt_ids'])")
for t in f32 Q8_0 Q4_K_M; do
  # shellcheck disable=SC2086
  LLAMA_GREEDY_ATTN=f32 "$OUT/llama_greedy" "$FOUT/deepseek-v3-q4-$t.gguf" 16 $ids 2>/dev/null \
    > "$FOUT/llama-deepseek-v3-$t-attn-f32.json"
done
"$PY" - "$FOUT" "$REPO/tests/fixtures/gguf/deepseek_v3_references.json" $ids <<'PY'
import json, sys, torch
from transformers import AutoModelForCausalLM
fout, out, ids = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3:]]
model = AutoModelForCausalLM.from_pretrained(f"{fout}/deepseek-v3-q4-hf", dtype=torch.float32).eval()
x = torch.tensor([ids])
with torch.no_grad():
    logits = model(x).logits[0, -1]
    tokens = model.generate(x, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, len(ids):]
picked = sorted(set(torch.topk(logits, 32).indices.tolist()) | set(range(0, logits.numel(), 1000)))
doc = {
    "source": "scripts/gguf_deepseek_v3.sh: transformers 5.23.0 (f32) on the synthetic Hub folder; "
              "llama.cpp (llama-cpp-python 0.3.36 sdist) llama_greedy with LLAMA_GREEDY_ATTN=f32",
    "prompt_ids": ids,
    "hf": {"ids": picked, "logits": [round(float(logits[i]), 6) for i in picked],
           "tokens": tokens.tolist()},
    "llama_attn_f32": {t: json.load(open(f"{fout}/llama-deepseek-v3-{t}-attn-f32.json"))["tokens"]
                       for t in ["f32", "Q8_0", "Q4_K_M"]},
}
json.dump(doc, open(out, "w"), indent=1)
PY
echo "gguf_deepseek_v3: fixtures in $FOUT, references in tests/fixtures/gguf/deepseek_v3_references.json"
