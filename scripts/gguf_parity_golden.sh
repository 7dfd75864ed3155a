#!/usr/bin/env bash
# llama.cpp's own two attention precisions on the GGUF parity fixtures, checked in as
# tests/fixtures/gguf/llama_attn_f32.json for tests/model_checkpoint/gguf_parity.rs.
#
# llama.cpp's CPU attention is flash attention on f16 K and V (Q rounded to f16, V summed
# in an f16 accumulator); moec's attention is f32. LLAMA_GREEDY_ATTN=f32 runs
# scripts/llama_greedy.cpp with an f32 KV cache and flash attention off, the arithmetic
# moec implements. For each fixture type this writes: llama.cpp's 16 greedy tokens in
# that mode, the largest first-step logit difference between its two modes over the whole
# vocabulary (llama.cpp's own spread, which bounds moec against the default mode), and the
# first-step logits of both modes at the default mode's 32 largest ids and every 1000th id.
#
# Takes: the fixtures of scripts/gguf_fixtures.sh (FIXTURES, default
# ~/.cache/moec-peer/gguf-fixtures, checked against tests/fixtures/gguf/SHA256SUMS) and its
# llama.cpp build (build-0.3.36 under MOEC_PEER_CACHE). Writes only the JSON (and a
# scratch folder it removes).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}
FIXTURES=${FIXTURES:-$CACHE/gguf-fixtures}
LLAMA=$CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp
BUILD=$CACHE/build-0.3.36
(cd "$FIXTURES" && sha256sum --quiet -c "$REPO/tests/fixtures/gguf/SHA256SUMS")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
g++ -O2 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" "$REPO/scripts/llama_greedy.cpp" \
  "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" \
  "$BUILD/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -o "$TMP/llama_greedy"
ids=$(python3 -c "import json; print(*json.load(open('$REPO/tests/fixtures/gguf/llama_greedy.json'))['prompt_ids'])")
for t in f32 Q8_0 Q4_0 Q4_1 Q4_K_M; do
  # shellcheck disable=SC2086
  "$TMP/llama_greedy" "$FIXTURES/mixtral-q4-$t.gguf" 16 $ids 2>/dev/null > "$TMP/default-$t.json"
  # shellcheck disable=SC2086
  LLAMA_GREEDY_ATTN=f32 "$TMP/llama_greedy" "$FIXTURES/mixtral-q4-$t.gguf" 16 $ids 2>/dev/null \
    > "$TMP/attn_f32-$t.json"
done
python3 - "$TMP" "$REPO/tests/fixtures/gguf/llama_attn_f32.json" <<'PY'
import json, sys
tmp, out = sys.argv[1], sys.argv[2]
doc = {
    "source": "scripts/gguf_parity_golden.sh: llama.cpp (llama-cpp-python 0.3.36 sdist) "
              "llama_greedy, 1 thread, default attention and LLAMA_GREEDY_ATTN=f32",
    "types": {},
}
for t in ["f32", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M"]:
    d = json.load(open(f"{tmp}/default-{t}.json"))
    f = json.load(open(f"{tmp}/attn_f32-{t}.json"))
    a, b = d["first_logits"], f["first_logits"]
    top = sorted(range(len(a)), key=lambda i: -a[i])[:32]
    ids = sorted(set(top) | set(range(0, len(a), 1000)))
    doc["types"][t] = {
        "greedy": f["tokens"],
        "greedy_default": d["tokens"],
        "spread": max(abs(x - y) for x, y in zip(a, b)),
        "ids": ids,
        "logits_default": [a[i] for i in ids],
        "logits_attn_f32": [b[i] for i in ids],
    }
with open(out, "w") as fh:
    json.dump(doc, fh, indent=1)
    fh.write("\n")
PY
echo "gguf_parity_golden: wrote tests/fixtures/gguf/llama_attn_f32.json"

# The same for the other families' fixtures (scripts/gguf_fixtures.sh's
# gguf-fixtures-families, checked against SHA256SUMS-families): llama.cpp's f32-attention
# run of each, against the default run the fixture folder already holds.
FAMILIES=${FAMILY_FIXTURES:-$CACHE/gguf-fixtures-families}
(cd "$FAMILIES" && sha256sum --quiet -c "$REPO/tests/fixtures/gguf/SHA256SUMS-families")
(cd "$FAMILIES" && sha256sum --quiet -c "$REPO/tests/fixtures/gguf/SHA256SUMS-gpt-oss")
(cd "$FAMILIES" && sha256sum --quiet -c "$REPO/tests/fixtures/gguf/SHA256SUMS-dbrx")
# Each family's fixture types (gpt-oss: its converter keeps the experts MXFP4).
types_of() { if [ "$1" = gpt-oss ]; then echo f32 Q8_0 MXFP4; else echo f32 Q8_0 Q4_K_M; fi; }
for fam in qwen3-moe deepseek-v2 qwen2-moe olmoe gpt-oss dbrx; do
  ids=$(python3 -c "import json; print(*json.load(open('$REPO/tests/fixtures/gguf/llama_greedy_families.json'))['$fam']['prompt_ids'])")
  for t in $(types_of "$fam"); do
    # shellcheck disable=SC2086
    LLAMA_GREEDY_ATTN=f32 "$TMP/llama_greedy" "$FAMILIES/$fam-q4-$t.gguf" 16 $ids 2>/dev/null \
      > "$TMP/$fam-$t.json"
  done
done
python3 - "$TMP" "$FAMILIES" "$REPO/tests/fixtures/gguf/llama_attn_f32_families.json" <<'PY'
import json, sys
tmp, fixtures, out = sys.argv[1:4]
doc = {"source": "scripts/gguf_parity_golden.sh (families): llama.cpp (llama-cpp-python 0.3.36 "
                 "sdist) llama_greedy, default attention (fixtures' llama-FAMILY-TYPE.json) "
                 "and LLAMA_GREEDY_ATTN=f32",
       "families": {}}
for fam in ["qwen3-moe", "deepseek-v2", "qwen2-moe", "olmoe", "gpt-oss", "dbrx"]:
    doc["families"][fam] = {}
    for t in ["f32", "Q8_0", "MXFP4"] if fam == "gpt-oss" else ["f32", "Q8_0", "Q4_K_M"]:
        f = json.load(open(f"{tmp}/{fam}-{t}.json"))
        d = json.load(open(f"{fixtures}/llama-{fam}-{t}.json"))
        a, b = d["first_logits"], f["first_logits"]
        top = sorted(range(len(a)), key=lambda i: -a[i])[:32]
        ids = sorted(set(top) | set(range(0, len(a), 1000)))
        doc["families"][fam][t] = {
            "tokens_attn_f32": f["tokens"],
            "spread": max(abs(x - y) for x, y in zip(a, b)),
            "ids": ids,
            "logits_attn_f32": [b[i] for i in ids],
            "logits_default": [a[i] for i in ids],
        }
json.dump(doc, open(out, "w"), indent=None, separators=(",", ":"))
PY
echo "gguf_parity_golden: wrote tests/fixtures/gguf/llama_attn_f32_families.json"
