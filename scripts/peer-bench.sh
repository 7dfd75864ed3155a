#!/usr/bin/env bash
# Peer comparison (issue 15): llama.cpp, Hugging Face transformers and moec on the same
# checkpoint and workload, on this machine, in one run; prints one table of generation
# throughput with each system's peak resident memory beside it.
#
# What it takes: nothing installed beyond python3 (with venv), a C/C++ compiler and cargo;
# everything else comes from PyPI with pip and is cached under $MOEC_PEER_CACHE
# (default ~/.cache/moec-peer), so a rerun only re-measures:
#   * a venv with cmake, ninja, torch, transformers, safetensors, numpy and gguf-py;
#   * the llama-cpp-python sdist from PyPI, whose vendored llama.cpp gives
#     `llama-batched-bench` (built here with cmake + ninja, -march=native) and
#     `convert_hf_to_gguf.py`;
#   * the checkpoint: the mid Mixtral shape (models/mixtral-mid.ron) written by
#     transformers' save_pretrained, bf16 safetensors + the repository's Mixtral tokenizer
#     (scripts/peer_bench_checkpoint.py), and its bf16 GGUF conversion.
#
# What it gives: for each batch B (default 1 16 64) and each system, B random prompts of
# 64 tokens, 32 new tokens each, greedy; generation throughput = B x 32 / (prefill + decode
# seconds), each system timed by its own clock around prefill + decode only (model load and
# start-up excluded; `wall` is the whole process); peak RSS from GNU time (`%M`). Every
# measurement is one process, so each RSS is that configuration's own. Raw results are
# appended to $MOEC_PEER_CACHE/results/<date>.jsonl.
#
# With --quant TYPE (a llama-quantize type, e.g. Q4_K_M; issue 29), llama.cpp and moec both
# run the GGUF that llama-quantize makes of the bf16 conversion (moec with --weights FILE),
# HF stays on the bf16 checkpoint, and the roofline counts the quantised file's bytes.
#
# Usage: scripts/peer-bench.sh [--batches "1 16 64"] [--threads 2]
#            [--schedules "baselines/resident baselines/sequential"] [--skip SYSTEM]...
#            [--quant Q4_K_M]
# Environment: MOEC_PEER_CACHE (cache folder), MOEC_PEER_JOBS (build jobs, default 2).
set -euo pipefail
# Each point's HRM replay on its own quick probe of the machine as it is now, never on
# one an earlier run kept (docs/cost-model.md, "The quick probe, kept for the runs that
# follow").
export MOEC_PROBE_MAX_AGE=0

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}
JOBS=${MOEC_PEER_JOBS:-2}
BATCHES="1 16 64"
THREADS=2
SCHEDULES="baselines/resident baselines/sequential"
PROMPT_LEN=64
GEN_LEN=32
SKIP=""
QUANT=""

# Pinned versions: the sdist fixes llama.cpp's source; the Python packages are the ones
# scripts/requirements-parity.txt pins (the parity fixtures were made with them).
LLAMA_CPP_PYTHON=0.3.36
PY_PACKAGES=(cmake==4.4.4 ninja==1.13.2 torch==2.15.0 transformers==5.23.0
  safetensors==0.8.0 numpy==2.4.6 huggingface_hub==2.4.0 sentencepiece==0.2.3)

while [ $# -gt 0 ]; do
  case "$1" in
    --batches) BATCHES=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --schedules) SCHEDULES=$2; shift 2 ;;
    --skip) SKIP="$SKIP $2"; shift 2 ;;
    --quant) QUANT=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "peer-bench: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "peer-bench: $*" >&2; }
skipped() { case " $SKIP " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

mkdir -p "$CACHE/results"
VENV=$CACHE/venv
PY=$VENV/bin/python
SRC=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON
LLAMA=$SRC/vendor/llama.cpp
BUILD=$CACHE/build-$LLAMA_CPP_PYTHON
BENCH=$BUILD/bin/llama-batched-bench
MODEL=$CACHE/mixtral-mid-hf
GGUF=$CACHE/mixtral-mid-bf16.gguf

# 1. The venv (a marker names the pins it was made with, so a changed pin reinstalls).
pins="${PY_PACKAGES[*]} gguf-py@$LLAMA_CPP_PYTHON"
if [ ! -f "$VENV/.pins" ] || [ "$(cat "$VENV/.pins")" != "$pins" ]; then
  log "creating the venv in $VENV (torch is a large download the first time)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "${PY_PACKAGES[@]}"
  NEED_GGUF_PY=1
else
  NEED_GGUF_PY=0
fi

# 2. llama.cpp from the llama-cpp-python sdist (pip download of the source distribution).
if [ ! -d "$LLAMA" ]; then
  log "fetching the llama-cpp-python $LLAMA_CPP_PYTHON sdist"
  mkdir -p "$CACHE/sdist"
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$CACHE/sdist"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$CACHE"
  NEED_GGUF_PY=1
fi
if [ "$NEED_GGUF_PY" = 1 ]; then
  "$PY" -m pip install -q "$LLAMA/gguf-py"
  echo "$pins" > "$VENV/.pins"
fi
if [ ! -x "$BENCH" ]; then
  log "building llama-batched-bench (cmake + ninja from the venv, $JOBS jobs; slow on 2 cores)"
  PATH=$VENV/bin:$PATH cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF > "$CACHE/build-configure.log"
  PATH=$VENV/bin:$PATH nice -n 10 ninja -C "$BUILD" -j "$JOBS" llama-batched-bench \
    > "$CACHE/build.log"
fi
if [ -n "$QUANT" ] && [ ! -x "$BUILD/bin/llama-quantize" ]; then
  log "building llama-quantize"
  PATH=$VENV/bin:$PATH nice -n 10 ninja -C "$BUILD" -j "$JOBS" llama-quantize \
    >> "$CACHE/build.log"
fi

# 3. The checkpoint, written by transformers, and its GGUF conversion.
"$PY" "$REPO/scripts/peer_bench_checkpoint.py" --out "$MODEL" \
  --tokenizer "$REPO/models/tokenizers/mixtral/tokenizer.json" >&2
if [ ! -f "$GGUF" ] || [ "$GGUF" -ot "$MODEL/.complete" ]; then
  log "converting the checkpoint to a bf16 GGUF with convert_hf_to_gguf.py"
  "$PY" "$LLAMA/convert_hf_to_gguf.py" "$MODEL" --outtype bf16 --outfile "$GGUF.tmp" \
    > "$CACHE/convert.log" 2>&1 || { tail -20 "$CACHE/convert.log" >&2; exit 1; }
  mv "$GGUF.tmp" "$GGUF"
fi
# What llama.cpp and moec run: the bf16 GGUF / the Hub folder, or both the quantised GGUF.
RUN_GGUF=$GGUF
MOEC_WEIGHTS=$MODEL
if [ -n "$QUANT" ]; then
  RUN_GGUF=$CACHE/mixtral-mid-$QUANT.gguf
  if [ ! -f "$RUN_GGUF" ] || [ "$RUN_GGUF" -ot "$GGUF" ]; then
    log "quantising the bf16 GGUF to $QUANT with llama-quantize"
    "$BUILD/bin/llama-quantize" "$GGUF" "$RUN_GGUF.tmp" "$QUANT" "$THREADS" \
      > "$CACHE/quantize-$QUANT.log" 2>&1 || { tail -20 "$CACHE/quantize-$QUANT.log" >&2; exit 1; }
    mv "$RUN_GGUF.tmp" "$RUN_GGUF"
  fi
  MOEC_WEIGHTS=$RUN_GGUF
fi
# The roofline's weight bytes: bf16's, scaled by the file run against the bf16 file.
WEIGHT_SCALE=$("$PY" -c 'import os, sys; print(os.path.getsize(sys.argv[1]) / os.path.getsize(sys.argv[2]))' "$RUN_GGUF" "$GGUF")

# 4. moec itself, release build.
log "building moec (cargo build --release)"
(cd "$REPO" && nice -n 10 cargo build --release -q --bin moec)
MOEC=$REPO/target/release/moec

# 5. The measurements. Each line of $RESULTS: one system at one batch.
RESULTS=$CACHE/results/$(date -u +%Y%m%dT%H%M%SZ).jsonl
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The machine's limits with $THREADS threads (streaming read bandwidth, f32 GEMM peak),
# measured before and after the systems run; the roofline uses the better of the two,
# the least disturbed by other jobs on these cores.
probe() {
  log "moec probe ($1)"
  "$MOEC" probe --threads "$THREADS" --json > "$TMP/probe.json"
  "$PY" -c 'import json, sys; m = json.load(open(sys.argv[1]))["measurements"]; print(json.dumps({"system": "probe", "when": sys.argv[2], "stream_read_bytes_per_s": m["stream_read_bytes_per_s"], "gemm_f32_flops": m["gemm_f32_flops"]}))' \
    "$TMP/probe.json" "$1" >> "$RESULTS"
}
probe before

# Runs "$@" under GNU time; appends {system, batch, peak_rss_kb, wall_seconds, ...} to
# $RESULTS, where the rest comes from the JSON line the parser ($1) makes of its stdout.
measure() {
  local system=$1 batch=$2 parser=$3; shift 3
  log "$system, batch $batch"
  if ! /usr/bin/time -f '%M %e' -o "$TMP/time" "$@" > "$TMP/out" 2> "$TMP/err"; then
    log "$system at batch $batch failed; its last lines:"; tail -5 "$TMP/err" >&2
    echo "{\"system\": \"$system\", \"batch\": $batch, \"failed\": true}" >> "$RESULTS"
    return 0
  fi
  read -r rss wall < "$TMP/time"
  "$PY" - "$system" "$batch" "$rss" "$wall" "$parser" "$TMP/out" >> "$RESULTS" <<'EOF'
import json, sys
system, batch, rss, wall, parser, path = sys.argv[1:]
text = open(path).read()
if parser == "llama":
    # --output-format jsonl: one object per configuration; t = prefill + decode seconds.
    row = [json.loads(l) for l in text.splitlines() if l.startswith("{")][-1]
    tokens, seconds = row["pl"] * row["tg"], row["t"]
elif parser == "moec":
    report = json.loads(text)["report"]
    tokens, seconds = report["generated_tokens"], report["seconds"]
else:
    row = json.loads(text.strip().splitlines()[-1])
    tokens, seconds = row["generated_tokens"], row["seconds"]
print(json.dumps({"system": system, "batch": int(batch), "generated_tokens": tokens,
                  "seconds": seconds, "tokens_per_s": tokens / seconds,
                  "peak_rss_kb": int(rss), "wall_seconds": float(wall)}))
EOF
}

for batch in $BATCHES; do
  if ! skipped llama.cpp; then
    measure llama.cpp "$batch" llama "$BENCH" -m "$RUN_GGUF" -c $((batch * (PROMPT_LEN + GEN_LEN))) \
      -b 2048 -ub 512 -npp $PROMPT_LEN -ntg $GEN_LEN -npl "$batch" -t "$THREADS" -tb "$THREADS" \
      --output-format jsonl
  fi
  if ! skipped hf; then
    measure hf "$batch" hf "$PY" "$REPO/scripts/peer_bench_hf.py" --model "$MODEL" \
      --batch "$batch" --prompt-len $PROMPT_LEN --gen-len $GEN_LEN --threads "$THREADS"
  fi
  for sched in $SCHEDULES; do
    skipped "$sched" && continue
    # One micro-batch (or batch group) holds the whole batch where the schedule lets it:
    # every expert's weights are then read once per step, as `resident` reads them.
    # FlexGen needs two GPU batches and VSLPipe runs two groups: each holds half.
    half=$(( batch / 2 > 0 ? batch / 2 : 1 ))
    case $sched in
      klotski) sets=(--set "bs=$batch" --set n_batch=1) ;;
      flexgen|baselines/flexgen_cpu_attn) sets=(--set "bs=$half" --set n_batch=2) ;;
      vslpipe) sets=(--set "seqs=$half") ;;
      moe_infinity) sets=(--set "bs=$batch") ;;
      *) sets=(--set "ubs=$batch" --set n_ub=1) ;;
    esac
    measure "moec $sched" "$batch" moec "$MOEC" run "$REPO/schedules/$sched.sched" \
      --weights "$MOEC_WEIGHTS" --threads "$THREADS" --gen-len $GEN_LEN \
      --workload "count=$batch,mean=$PROMPT_LEN,min=$PROMPT_LEN,max=$PROMPT_LEN,gen=$GEN_LEN,seed=$batch" \
      "${sets[@]}" --json
  done
done

probe after

# 6. The table, with a roofline per batch: each step (the prefill, then gen_len - 1 decode
# steps) takes at least max(bytes / bandwidth, FLOPs / peak) for the weights it must read
# (dense + lm_head + the experts its tokens route to, uniform routing assumed: a layer
# touches 8 (1 - (6/8)^tokens) experts on average) and the KV cache (f32 K and V).
"$PY" - "$RESULTS" "$PROMPT_LEN" "$GEN_LEN" "$THREADS" "$WEIGHT_SCALE" "${QUANT:-bf16}" <<'EOF'
import json, sys
prompt_len, gen_len, threads = map(int, sys.argv[2:5])
weight_scale, weights_name = float(sys.argv[5]), sys.argv[6]
rows = [json.loads(l) for l in open(sys.argv[1])]
probes = [r for r in rows if r["system"] == "probe"]
rows = [r for r in rows if r["system"] != "probe"]
bw = max(p["stream_read_bytes_per_s"] for p in probes)
peak = max(p["gemm_f32_flops"] for p in probes)

# The mid Mixtral shape (models/mixtral-mid.ron), bf16 weights.
d, ffn, layers, heads, kv_heads, head_dim, experts, top_k, vocab = 1024, 3584, 8, 16, 4, 64, 8, 2, 32000
dense = layers * (d * heads * head_dim * 2 + 2 * d * kv_heads * head_dim + d * experts)
expert = 3 * d * ffn
head = vocab * d

def step(tokens, seqs, ctx):
    touched = experts * (1 - (1 - top_k / experts) ** tokens)
    weight_bytes = 2 * weight_scale * (dense + layers * touched * expert + head)
    kv_bytes = seqs * layers * ctx * 2 * kv_heads * head_dim * 4
    flops = 2 * tokens * (dense + layers * top_k * expert) + 2 * seqs * head
    return max((weight_bytes + kv_bytes) / bw, flops / peak)

def roofline(b):
    t = step(b * prompt_len, b, prompt_len)
    t += sum(step(b, b, prompt_len + i) for i in range(1, gen_len))
    return b * gen_len / t

systems = list(dict.fromkeys(r["system"] for r in rows))
batches = sorted({r["batch"] for r in rows})
cell = {(r["system"], r["batch"]): r for r in rows}
def tps(s, b):
    r = cell.get((s, b))
    return r["tokens_per_s"] if r and not r.get("failed") else None
def fmt(s, b):
    r = cell.get((s, b))
    if r is None: return "-"
    if r.get("failed"): return "failed"
    return f"{r['tokens_per_s']:.1f} ({r['peak_rss_kb'] / 1024:.0f} MiB)"
print(f"\nweights: {weights_name} for llama.cpp and moec (HF: bf16); {weight_scale:.3f} of the bf16 file's bytes")
print(f"B prompts of {prompt_len} tokens, {gen_len} new tokens each, greedy, {threads} threads; "
      f"tok/s = B x {gen_len} / (prefill + decode s), peak RSS in brackets")
print(f"roofline: streaming read {bw / 1e9:.2f} GB/s, f32 GEMM peak {peak / 1e9:.1f} GFLOP/s (moec probe, better of before/after)")
print("| batch | " + " | ".join(systems) + " | roofline |")
print("| --- " * (len(systems) + 2) + "|")
for b in batches:
    print(f"| {b} | " + " | ".join(fmt(s, b) for s in systems) + f" | {roofline(b):.1f} |")
print("\nratios (same run):")
for s in [s for s in systems if s.startswith("moec")]:
    for b in batches:
        if not tps(s, b): continue
        parts = [f"/ {peer} = {tps(s, b) / tps(peer, b):.2f}" for peer in ("llama.cpp", "hf") if tps(peer, b)]
        parts.append(f"/ roofline = {tps(s, b) / roofline(b):.2f}")
        if s != "moec baselines/resident" and tps("moec baselines/resident", b):
            parts.append(f"/ resident = {tps(s, b) / tps('moec baselines/resident', b):.2f}")
        print(f"  {s} batch {b}: " + "; ".join(parts))
print("\nprocess wall seconds (load + run):")
for b in batches:
    print(f"  batch {b}: " + ", ".join(
        f"{s} {cell[(s, b)]['wall_seconds']:.1f}" for s in systems
        if (s, b) in cell and not cell[(s, b)].get("failed")))
print(f"\nraw results: {sys.argv[1]}")
EOF
