#!/usr/bin/env bash
# GGUF fixtures made by llama.cpp's own tools (issue 29), and llama.cpp's greedy tokens on
# them. Takes: python3, g++, a moec binary (MOEC, default target/debug/moec). Uses the
# llama-cpp-python sdist from PyPI as scripts/peer-bench.sh does, cached under
# $MOEC_PEER_CACHE (default ~/.cache/moec-peer): a venv (q-venv) with cmake, ninja, numpy,
# torch, transformers, safetensors, sentencepiece and the sdist's gguf-py; llama-quantize
# built there (build-0.3.36, peer-bench's folder and flags); scripts/llama_greedy.cpp linked
# against its static libraries.
# Gives, in $OUT (default $MOEC_PEER_CACHE/gguf-fixtures): the synthetic checkpoint of
# tests/fixtures/gguf/mixtral-q4-tiny.ron (`moec synth`, seed 0), its f32 GGUF
# (convert_hf_to_gguf.py), its Q8_0, Q4_K_M, Q4_K_S and Q5_K_M GGUFs (llama-quantize), its Q4_0 and Q4_1
# GGUFs (llama-quantize --pure: every linear weight in the group-wise int4 format, the
# output matrix included, as `moec quantize --all q4_0` writes it), its pure-Q4_K_S,
# pure-Q5_K_S and pure-Q6_K GGUFs (llama-quantize --pure, as `moec quantize --all q4_k`
# etc. write them), and llama-<type>.json,
# llama.cpp's 16 greedy tokens after tests/fixtures/gguf/llama_greedy.json's prompt ids.
# Checks the GGUFs against tests/fixtures/gguf/SHA256SUMS.
# Then the other families, in $FAMILIES_OUT (default $MOEC_PEER_CACHE/gguf-fixtures-families):
# for tests/fixtures/gguf/{qwen3-moe,deepseek-v2,qwen2-moe,olmoe,dbrx}-q4-tiny.ron the same f32, Q8_0 and Q4_K_M
# GGUFs, llama-<family>-<type>.json after tests/fixtures/gguf/llama_greedy_families.json's
# prompt ids, and llama-<family>-<type>-deq.json, the same on the quantised files dequantised
# to f32 by llama-quantize --allow-requantize; and the Q8_0 Qwen3-MoE file split by llama-gguf-split (--split-max-tensors 16)
# into qwen3-moe-q4-Q8_0-split-0000{1..N}-of-0000N.gguf. Checked against SHA256SUMS-families
# (DBRX's, whose converter transposes each expert's w2 to out-in, against SHA256SUMS-dbrx).
# Then gpt-oss's f32, Q8_0, MXFP4, bf16, pure-Q8_0 and MXFP4_MOE files there, and the o200k
# tokenizer golden (see its section; SHA256SUMS-gpt-oss).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}
OUT=${OUT:-$CACHE/gguf-fixtures}
MOEC=${MOEC:-$REPO/target/debug/moec}
VER=0.3.36
PY=$CACHE/q-venv/bin/python
LLAMA=$CACHE/llama_cpp_python-$VER/vendor/llama.cpp
BUILD=$CACHE/build-$VER
mkdir -p "$CACHE" "$OUT"
if [ ! -x "$PY" ]; then
  python3 -m venv "$CACHE/q-venv"
  "$PY" -m pip install -q cmake ninja numpy torch transformers safetensors sentencepiece pyyaml requests
fi
if [ ! -d "$LLAMA" ]; then
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VER" -d "$CACHE/sdist"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$VER.tar.gz" -C "$CACHE"
fi
"$PY" -c "import gguf" 2>/dev/null || "$PY" -m pip install -q --no-deps "$LLAMA/gguf-py"
if [ ! -x "$BUILD/bin/llama-quantize" ] || [ ! -x "$BUILD/bin/llama-gguf-split" ]; then
  PATH=$CACHE/q-venv/bin:$PATH cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF > "$CACHE/build-configure.log"
  PATH=$CACHE/q-venv/bin:$PATH nice -n 15 ninja -C "$BUILD" -j 1 llama-quantize llama-gguf-split > "$CACHE/build-quantize.log"
fi
g++ -O2 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" "$REPO/scripts/llama_greedy.cpp" \
  "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" \
  "$BUILD/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -o "$OUT/llama_greedy"
rm -rf "$OUT/mixtral-q4-hf"
"$MOEC" synth --model "$REPO/tests/fixtures/gguf/mixtral-q4-tiny.ron" --out "$OUT/mixtral-q4-hf"
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$OUT/mixtral-q4-hf" --outtype f32 \
  --outfile "$OUT/mixtral-q4-f32.gguf" > "$OUT/convert.log" 2>&1
for t in Q8_0 Q4_K_M Q4_K_S Q5_K_M; do
  "$BUILD/bin/llama-quantize" "$OUT/mixtral-q4-f32.gguf" "$OUT/mixtral-q4-$t.gguf" "$t" > "$OUT/quantize-$t.log" 2>&1
done
for t in Q4_0 Q4_1; do
  "$BUILD/bin/llama-quantize" --pure "$OUT/mixtral-q4-f32.gguf" "$OUT/mixtral-q4-$t.gguf" "$t" > "$OUT/quantize-$t.log" 2>&1
done
# The K formats with --pure: every linear weight (the output matrix too) in the one format,
# what `moec quantize --all q4_k|q5_k|q6_k` writes.
for t in Q4_K_S Q5_K_S Q6_K; do
  "$BUILD/bin/llama-quantize" --pure "$OUT/mixtral-q4-f32.gguf" "$OUT/mixtral-q4-pure-$t.gguf" "$t" \
    > "$OUT/quantize-pure-$t.log" 2>&1
done
ids=$("$PY" -c "import json; print(*json.load(open('$REPO/tests/fixtures/gguf/llama_greedy.json'))['prompt_ids'])")
for t in f32 Q8_0 Q4_0 Q4_1 Q4_K_M Q4_K_S Q5_K_M pure-Q4_K_S pure-Q5_K_S pure-Q6_K; do
  # shellcheck disable=SC2086
  "$OUT/llama_greedy" "$OUT/mixtral-q4-$t.gguf" 16 $ids 2>/dev/null > "$OUT/llama-$t.json"
done
(cd "$OUT" && sha256sum -c "$REPO/tests/fixtures/gguf/SHA256SUMS")
echo "gguf-fixtures: written to $OUT"

FOUT=${FAMILIES_OUT:-$CACHE/gguf-fixtures-families}
mkdir -p "$FOUT"
for fam in qwen3-moe deepseek-v2 qwen2-moe olmoe dbrx; do
  rm -rf "$FOUT/$fam-q4-hf"
  "$MOEC" synth --model "$REPO/tests/fixtures/gguf/$fam-q4-tiny.ron" --out "$FOUT/$fam-q4-hf"
  "$PY" "$LLAMA/convert_hf_to_gguf.py" "$FOUT/$fam-q4-hf" --outtype f32 \
    --outfile "$FOUT/$fam-q4-f32.gguf" > "$FOUT/convert-$fam.log" 2>&1
  for t in Q8_0 Q4_K_M; do
    "$BUILD/bin/llama-quantize" "$FOUT/$fam-q4-f32.gguf" "$FOUT/$fam-q4-$t.gguf" "$t" \
      > "$FOUT/quantize-$fam-$t.log" 2>&1
  done
  ids=$("$PY" -c "import json; print(*json.load(open('$REPO/tests/fixtures/gguf/llama_greedy_families.json'))['$fam']['prompt_ids'])")
  for t in f32 Q8_0 Q4_K_M; do
    # shellcheck disable=SC2086
    "$OUT/llama_greedy" "$FOUT/$fam-q4-$t.gguf" 16 $ids 2>/dev/null > "$FOUT/llama-$fam-$t.json"
  done
  # llama.cpp on each quantised file dequantised to f32 (its own decoder, f32 products).
  for t in Q8_0 Q4_K_M; do
    "$BUILD/bin/llama-quantize" --allow-requantize "$FOUT/$fam-q4-$t.gguf" "$FOUT/$fam-q4-$t-deq.gguf" F32 \
      > "$FOUT/dequantize-$fam-$t.log" 2>&1
    # shellcheck disable=SC2086
    "$OUT/llama_greedy" "$FOUT/$fam-q4-$t-deq.gguf" 16 $ids 2>/dev/null > "$FOUT/llama-$fam-$t-deq.json"
    rm -f "$FOUT/$fam-q4-$t-deq.gguf"
  done
done
rm -f "$FOUT"/qwen3-moe-q4-Q8_0-split-*.gguf
"$BUILD/bin/llama-gguf-split" --split --split-max-tensors 16 "$FOUT/qwen3-moe-q4-Q8_0.gguf" \
  "$FOUT/qwen3-moe-q4-Q8_0-split" > "$FOUT/split.log" 2>&1
(cd "$FOUT" && sha256sum -c "$REPO/tests/fixtures/gguf/SHA256SUMS-families")
(cd "$FOUT" && sha256sum -c "$REPO/tests/fixtures/gguf/SHA256SUMS-dbrx")
echo "gguf-fixtures: families written to $FOUT"

# gpt-oss (tests/fixtures/gguf/gpt-oss-q4-tiny.ron), in $FOUT: the converter keeps gpt-oss's
# MXFP4 experts as MXFP4 whatever --outtype says, so the files are: f32 from the bf16
# checkpoint (`moec synth`), and from the MXFP4 one (`moec synth --mxfp4`, as the Hub ships
# gpt-oss) MXFP4 experts beside f32 (`--outtype f32`, gpt-oss-q4-MXFP4.gguf) or Q8_0
# (`--outtype q8_0`, gpt-oss-q4-Q8_0.gguf) other weights. llama-gpt-oss-<type>.json and
# -deq.json as for the families above. Checked against SHA256SUMS-gpt-oss.
rm -rf "$FOUT/gpt-oss-q4-hf" "$FOUT/gpt-oss-q4-hf-bf16"
"$MOEC" synth --model "$REPO/tests/fixtures/gguf/gpt-oss-q4-tiny.ron" --mxfp4 --out "$FOUT/gpt-oss-q4-hf"
"$MOEC" synth --model "$REPO/tests/fixtures/gguf/gpt-oss-q4-tiny.ron" --out "$FOUT/gpt-oss-q4-hf-bf16"
# The folder names become `general.name` (`Gpt Oss Q4 Hf`, ...), part of the checked bytes.
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$FOUT/gpt-oss-q4-hf-bf16" --outtype f32 \
  --outfile "$FOUT/gpt-oss-q4-f32.gguf" > "$FOUT/convert-gpt-oss-f32.log" 2>&1
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$FOUT/gpt-oss-q4-hf" --outtype f32 \
  --outfile "$FOUT/gpt-oss-q4-MXFP4.gguf" > "$FOUT/convert-gpt-oss-MXFP4.log" 2>&1
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$FOUT/gpt-oss-q4-hf" --outtype q8_0 \
  --outfile "$FOUT/gpt-oss-q4-Q8_0.gguf" > "$FOUT/convert-gpt-oss-Q8_0.log" 2>&1
# What `moec quantize` of those folders is compared with (tests/cli_generate.rs): the
# MXFP4 folder converted with `--outtype bf16` (the MXFP4 experts kept, the rest bf16:
# gpt-oss-q4-bf16.gguf); llama-quantize of the f32 file: `--pure Q8_0` and `MXFP4_MOE`
# (experts quantised to MXFP4 by ggml, the rest Q8_0); and `MXFP4_MOE` of the converter's
# MXFP4 file (its MXFP4 experts copied, the rest Q8_0: gpt-oss-q4-hub-MXFP4_MOE.gguf).
"$PY" "$LLAMA/convert_hf_to_gguf.py" "$FOUT/gpt-oss-q4-hf" --outtype bf16 \
  --outfile "$FOUT/gpt-oss-q4-bf16.gguf" > "$FOUT/convert-gpt-oss-bf16.log" 2>&1
"$BUILD/bin/llama-quantize" --pure "$FOUT/gpt-oss-q4-f32.gguf" "$FOUT/gpt-oss-q4-pure-Q8_0.gguf" Q8_0 \
  > "$FOUT/quantize-gpt-oss-pure-Q8_0.log" 2>&1
"$BUILD/bin/llama-quantize" "$FOUT/gpt-oss-q4-f32.gguf" "$FOUT/gpt-oss-q4-MXFP4_MOE.gguf" MXFP4_MOE \
  > "$FOUT/quantize-gpt-oss-MXFP4_MOE.log" 2>&1
"$BUILD/bin/llama-quantize" --allow-requantize "$FOUT/gpt-oss-q4-MXFP4.gguf" \
  "$FOUT/gpt-oss-q4-hub-MXFP4_MOE.gguf" MXFP4_MOE > "$FOUT/quantize-gpt-oss-hub-MXFP4_MOE.log" 2>&1
rm -rf "$FOUT/gpt-oss-q4-hf" "$FOUT/gpt-oss-q4-hf-bf16"
ids=$("$PY" -c "import json; print(*json.load(open('$REPO/tests/fixtures/gguf/llama_greedy_families.json'))['gpt-oss']['prompt_ids'])")
for t in f32 Q8_0 MXFP4 bf16 pure-Q8_0 MXFP4_MOE hub-MXFP4_MOE; do
  # shellcheck disable=SC2086
  "$OUT/llama_greedy" "$FOUT/gpt-oss-q4-$t.gguf" 16 $ids 2>/dev/null > "$FOUT/llama-gpt-oss-$t.json"
done
for t in Q8_0 MXFP4; do
  "$BUILD/bin/llama-quantize" --allow-requantize "$FOUT/gpt-oss-q4-$t.gguf" "$FOUT/gpt-oss-q4-$t-deq.gguf" F32 \
    > "$FOUT/dequantize-gpt-oss-$t.log" 2>&1
  # shellcheck disable=SC2086
  "$OUT/llama_greedy" "$FOUT/gpt-oss-q4-$t-deq.gguf" 16 $ids 2>/dev/null > "$FOUT/llama-gpt-oss-$t-deq.json"
  rm -f "$FOUT/gpt-oss-q4-$t-deq.gguf"
done
# llama.cpp's o200k (`gpt-4o`) pre-tokenizer over the tiny gpt-oss's cl100k vocabulary (no
# o200k vocabulary offline): gpt-oss-o200k-vocab.gguf and llama-o200k-tokens.json
# (scripts/o200k_golden.py), llama.cpp's ids for tests/fixtures/gguf/o200k_texts.json.
g++ -O1 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" "$REPO/scripts/llama_tokenize.cpp" \
  "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" \
  "$BUILD/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -o "$OUT/llama_tokenize"
"$PY" "$REPO/scripts/o200k_golden.py" "$OUT/llama_tokenize" "$FOUT/gpt-oss-q4-f32.gguf" \
  "$REPO/tests/fixtures/gguf/o200k_texts.json" "$FOUT/gpt-oss-o200k-vocab.gguf" \
  "$FOUT/llama-o200k-tokens.json" 2> "$FOUT/o200k-golden.log"
(cd "$FOUT" && sha256sum -c "$REPO/tests/fixtures/gguf/SHA256SUMS-gpt-oss")
echo "gguf-fixtures: gpt-oss written to $FOUT"

# The repository's recipes (tests/fixtures/gguf/recipes/, README.md there): for each file the
# tests need on a clean clone, llama.cpp's header with the key/value pairs moec writes alike
# referenced, and the `moec synth` + `moec quantize` run whose tensors are llama.cpp's
# (scripts/gguf_recipe.py checks the rebuilt bytes here; tests/gguf_common/mod.rs rebuilds
# them and checks SHA256SUMS*). RECIPES=0 skips this step.
if [ "${RECIPES:-1}" != 0 ]; then
  RECIPES_DIR=$REPO/tests/fixtures/gguf/recipes
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  # recipe FOLDER FILE RON MXFP4 QUANTIZE-FLAGS...: FOLDER is gguf-fixtures ($OUT's files)
  # or gguf-fixtures-families ($FOUT's), FILE llama.cpp's file there, RON the card moec
  # synthesises (MXFP4 1: --mxfp4), the flags what makes moec quantize write its tensors.
  recipe() {
    local folder=$1 file=$2 ron=$3 mxfp4=$4 src llama=$OUT
    shift 4
    [ "$folder" = gguf-fixtures ] || llama=$FOUT
    local hf=$WORK/${ron%.ron}$([ "$mxfp4" = 1 ] && echo -mxfp4)
    if [ ! -d "$hf" ]; then
      "$MOEC" synth --model "$REPO/tests/fixtures/gguf/$ron" $([ "$mxfp4" = 1 ] && echo --mxfp4) --out "$hf"
    fi
    rm -f "$WORK/moec-$file"
    "$MOEC" quantize --weights "$hf" --out "$WORK/moec-$file" "$@" > /dev/null
    src=$("$PY" -c 'import json, sys; print(json.dumps({"synth": sys.argv[1], "mxfp4": sys.argv[2] == "1", "quantize": sys.argv[3:]}))' "$ron" "$mxfp4" "$@")
    mkdir -p "$RECIPES_DIR/$folder"
    "$PY" "$REPO/scripts/gguf_recipe.py" "$llama/$file" "$WORK/moec-$file" "$src" \
      "$RECIPES_DIR/$folder/${file%.gguf}.json"
    rm -f "$WORK/moec-$file"
  }
  rm -rf "$RECIPES_DIR/gguf-fixtures" "$RECIPES_DIR/gguf-fixtures-families"
  # Mixtral: the five files gguf_parity compares (f32, Q8_0, Q4_0, Q4_1, Q4_K_M).
  recipe gguf-fixtures mixtral-q4-f32.gguf mixtral-q4-tiny.ron 0 --all f32
  for t in q8_0 q4_0 q4_1; do
    recipe gguf-fixtures "mixtral-q4-${t^^}.gguf" mixtral-q4-tiny.ron 0 --all "$t"
  done
  recipe gguf-fixtures mixtral-q4-Q4_K_M.gguf mixtral-q4-tiny.ron 0 --mix q4_k_m
  # The families issue 41 names: f32, Q8_0 and Q4_K_M (gpt-oss: f32, Q8_0, MXFP4).
  for fam in qwen3-moe deepseek-v2 dbrx; do
    recipe gguf-fixtures-families "$fam-q4-f32.gguf" "$fam-q4-tiny.ron" 0 --all f32
    recipe gguf-fixtures-families "$fam-q4-Q8_0.gguf" "$fam-q4-tiny.ron" 0 --all q8_0
    recipe gguf-fixtures-families "$fam-q4-Q4_K_M.gguf" "$fam-q4-tiny.ron" 0 --mix q4_k_m
  done
  recipe gguf-fixtures-families gpt-oss-q4-f32.gguf gpt-oss-q4-tiny.ron 0 --all f32
  recipe gguf-fixtures-families gpt-oss-q4-Q8_0.gguf gpt-oss-q4-tiny.ron 1 \
    --weight-format experts=mxfp4,attention=q8_0,embedding=q8_0,head=q8_0
  recipe gguf-fixtures-families gpt-oss-q4-MXFP4.gguf gpt-oss-q4-tiny.ron 1 \
    --weight-format experts=mxfp4,attention=f32,embedding=f32,head=f32
  # The split Qwen3-MoE Q8_0 file's parts, from the whole file (a_split_gguf_reads_as_the_whole_file).
  for part in "$FOUT"/qwen3-moe-q4-Q8_0-split-*.gguf; do
    part=$(basename "$part")
    "$PY" "$REPO/scripts/gguf_recipe.py" "$FOUT/$part" "$FOUT/qwen3-moe-q4-Q8_0.gguf" \
      '{"file": "qwen3-moe-q4-Q8_0.gguf"}' "$RECIPES_DIR/gguf-fixtures-families/${part%.gguf}.json"
  done
  du -sh "$RECIPES_DIR"
  echo "gguf-fixtures: recipes written to $RECIPES_DIR"
fi
