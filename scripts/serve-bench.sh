#!/usr/bin/env bash
# Serving load test (issue 32): `moec serve` and llama.cpp's `llama-server` on the same
# checkpoint, on this machine, in one run, each under the same bounded load of concurrent
# streaming clients (the `openai` Python package); prints one table of output tokens/s
# and p50/p99 time to first token and inter-token latency.
#
# What it takes: python3 (with venv), a C/C++ compiler and cargo; the rest comes from PyPI
# and is cached under $MOEC_SERVE_BENCH_CACHE (default ~/.cache/moec-serve-bench), so a
# rerun only re-measures:
#   * a venv with cmake, ninja, torch, transformers, safetensors, numpy, gguf-py and openai;
#   * llama.cpp from the llama-cpp-python sdist that scripts/peer-bench.sh uses (its
#     unpacked copy under $MOEC_PEER_CACHE is reused when there is one), `llama-server`
#     built with cmake + ninja, -march=native, no web UI and no network features;
#   * the checkpoint: the mid Mixtral shape (models/mixtral-mid.ron) written by
#     transformers (scripts/peer_bench_checkpoint.py, as peer-bench does), read by moec
#     as it is, and its bf16 GGUF made by that sdist's convert_hf_to_gguf.py for
#     llama-server.
#
# What it gives: for each system, a server started on 127.0.0.1 at a free port, one
# warm-up request, then --requests streaming completions (prompts of --prompt-words
# random words, --max-tokens tokens each, greedy) from --clients concurrent clients, then
# the server stopped (SIGTERM). Output tokens/s = completion tokens / (first request sent
# to last response done); TTFT = request sent to first text; inter-token latency per
# request = (last text - first text) / (tokens - 1). Raw lines are appended to
# $MOEC_SERVE_BENCH_CACHE/results/<date>.jsonl.
#
# Bounded: loopback only; a fixed number of requests; each system's load stops at
# --time-limit seconds (no request is sent after it); a server that does not answer
# /health within 300 s is stopped and counted as failed.
#
# Usage: scripts/serve-bench.sh [--clients 8] [--requests 32] [--prompt-words 48]
#            [--system-words 0] (a prefix of that many words shared by every request;
#            llama-server is asked to cache_prompt) [--system-tokens 0] (instead: a prefix
#            of as few of the same words as make at least that many tokens by the
#            checkpoint's tokenizer.json; the shared-prefix scenario is --system-tokens 1000
#            --prompt-words 16, a system prompt of 1,000 tokens and short user turns)
#            [--max-tokens 32] [--threads 2] [--time-limit 600]
#            [--schedules "vslpipe baselines/resident"] [--skip llama-server]
#            [--set NAME=VALUE]... (replaces the per-schedule params below for every schedule)
#            [--bf16-product "f32 bf16"] (each moec schedule once per listed product, run
#            with MOEC_BF16_PRODUCT set to it; default: $MOEC_BF16_PRODUCT, else f32; a
#            bf16 run is labelled "moec SCHED bf16")
#            [--prefill-budget N] (moec serve's --prefill-budget: the most prompt tokens
#            one pass prefills; default: moec's own)
# Environment: MOEC_SERVE_BENCH_CACHE, MOEC_PEER_CACHE, MOEC_SERVE_BENCH_JOBS (build jobs,
# default 2), MOEC_SERVE_BENCH_BIN (a moec binary to measure instead of building one),
# MOEC_BF16_PRODUCT (see --bf16-product; every other MOEC_* variable reaches moec as set).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_SERVE_BENCH_CACHE:-$HOME/.cache/moec-serve-bench}
PEER_CACHE=${MOEC_PEER_CACHE:-$HOME/.cache/moec-peer}
JOBS=${MOEC_SERVE_BENCH_JOBS:-2}
CLIENTS=8
REQUESTS=32
PROMPT_WORDS=48
SYSTEM_WORDS=0
SYSTEM_TOKENS=0
PREFILL_BUDGET=""
MAX_TOKENS=32
THREADS=2
TIME_LIMIT=600
SCHEDULES="vslpipe baselines/resident"
SKIP=""
USER_SETS=()
BF16_PRODUCTS=${MOEC_BF16_PRODUCT:-f32}

# Pinned versions: the sdist fixes llama.cpp's source (peer-bench's); the Python packages
# are peer-bench's pins, plus the openai client the serve tests use.
LLAMA_CPP_PYTHON=0.3.36
PY_PACKAGES=(cmake==4.4.4 ninja==1.13.2 torch==2.15.0 transformers==5.23.0
  safetensors==0.8.0 numpy==2.4.6 sentencepiece==0.2.3 openai==2.8.0)

while [ $# -gt 0 ]; do
  case "$1" in
    --clients) CLIENTS=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --prompt-words) PROMPT_WORDS=$2; shift 2 ;;
    --system-words) SYSTEM_WORDS=$2; shift 2 ;;
    --system-tokens) SYSTEM_TOKENS=$2; shift 2 ;;
    --prefill-budget) PREFILL_BUDGET=$2; shift 2 ;;
    --max-tokens) MAX_TOKENS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --time-limit) TIME_LIMIT=$2; shift 2 ;;
    --schedules) SCHEDULES=$2; shift 2 ;;
    --skip) SKIP="$SKIP $2"; shift 2 ;;
    --set) USER_SETS+=(--set "$2"); shift 2 ;;
    --bf16-product) BF16_PRODUCTS=$2; shift 2 ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
    *) echo "serve-bench: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "serve-bench: $*" >&2; }
for product in $BF16_PRODUCTS; do
  case $product in
    f32|bf16) ;;
    *) echo "serve-bench: --bf16-product takes f32 and/or bf16, not $product" >&2; exit 2 ;;
  esac
done
if [ "$SYSTEM_TOKENS" -gt 0 ] && [ "$SYSTEM_WORDS" -gt 0 ]; then
  echo "serve-bench: give --system-words or --system-tokens, not both" >&2; exit 2
fi
skipped() { case " $SKIP " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

mkdir -p "$CACHE/results"
VENV=$CACHE/venv
PY=$VENV/bin/python
if [ -d "$PEER_CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" ]; then
  SRC=$PEER_CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON
else
  SRC=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON
fi
LLAMA=$SRC/vendor/llama.cpp
BUILD=$CACHE/build-server-$LLAMA_CPP_PYTHON
SERVER=$BUILD/bin/llama-server
MODEL=$CACHE/mixtral-mid-hf
GGUF=$CACHE/mixtral-mid-bf16.gguf

# 1. The venv (a marker names the pins it was made with, so a changed pin reinstalls).
pins="${PY_PACKAGES[*]} gguf-py@$LLAMA_CPP_PYTHON"
NEED_GGUF_PY=0
if [ ! -f "$VENV/.pins" ] || [ "$(cat "$VENV/.pins")" != "$pins" ]; then
  log "creating the venv in $VENV (torch is a large download the first time)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "${PY_PACKAGES[@]}"
  NEED_GGUF_PY=1
fi

# 2. llama.cpp from the llama-cpp-python sdist, and llama-server.
if [ ! -d "$LLAMA" ]; then
  log "fetching the llama-cpp-python $LLAMA_CPP_PYTHON sdist"
  mkdir -p "$CACHE/sdist"
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$CACHE/sdist"
  tar -xzf "$CACHE/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$CACHE"
fi
if [ "$NEED_GGUF_PY" = 1 ]; then
  "$PY" -m pip install -q "$LLAMA/gguf-py"
  echo "$pins" > "$VENV/.pins"
fi
if ! skipped llama-server && [ ! -x "$SERVER" ]; then
  log "building llama-server (cmake + ninja from the venv, $JOBS jobs; slow on 2 cores)"
  # No web UI (the prebuilt one would be downloaded), no OpenSSL: a loopback bench
  # needs neither.
  PATH=$VENV/bin:$PATH cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF > "$CACHE/build-configure.log"
  PATH=$VENV/bin:$PATH nice -n 10 ninja -C "$BUILD" -j "$JOBS" llama-server > "$CACHE/build.log"
fi

# 3. The checkpoint, written by transformers, and its GGUF conversion.
"$PY" "$REPO/scripts/peer_bench_checkpoint.py" --out "$MODEL" \
  --tokenizer "$REPO/models/tokenizers/mixtral/tokenizer.json" >&2
if ! skipped llama-server && { [ ! -f "$GGUF" ] || [ "$GGUF" -ot "$MODEL/.complete" ]; }; then
  log "converting the checkpoint to a bf16 GGUF with convert_hf_to_gguf.py"
  "$PY" "$LLAMA/convert_hf_to_gguf.py" "$MODEL" --outtype bf16 --outfile "$GGUF.tmp" \
    > "$CACHE/convert.log" 2>&1 || { tail -20 "$CACHE/convert.log" >&2; exit 1; }
  mv "$GGUF.tmp" "$GGUF"
fi

# 4. moec itself, release build (or the binary $MOEC_SERVE_BENCH_BIN names).
if [ -n "${MOEC_SERVE_BENCH_BIN:-}" ]; then
  MOEC=$MOEC_SERVE_BENCH_BIN
else
  log "building moec (cargo build --release)"
  (cd "$REPO" && nice -n 10 cargo build --release -q --bin moec)
  MOEC=$REPO/target/release/moec
fi

# 5. The measurements: one server at a time, each its own process.
RESULTS=$CACHE/results/$(date -u +%Y%m%dT%H%M%SZ).jsonl
TMP=$(mktemp -d)
SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    # A server that ignores SIGTERM for 30 s is killed.
    for _ in $(seq 300); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap 'stop_server; rm -rf "$TMP"' EXIT

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# Waits for http://127.0.0.1:$1/health to answer 200 (300 s at most, or until the server
# exits).
wait_healthy() {
  for _ in $(seq 1500); do
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
      "http://127.0.0.1:$1/health" 2>/dev/null; then
      return 0
    fi
    sleep 0.2
  done
  return 1
}

# Starts "$@" as the server on port $2, loads it, appends its line to $RESULTS.
measure() {
  local system=$1 port=$2 model_name=$3; shift 3
  log "$system: starting on 127.0.0.1:$port"
  "$@" > "$TMP/server.out" 2> "$TMP/server.err" &
  SERVER_PID=$!
  if ! wait_healthy "$port"; then
    log "$system did not become healthy; its last lines:"; tail -5 "$TMP/server.err" >&2
    echo "{\"system\": \"$system\", \"failed\": true}" >> "$RESULTS"
    stop_server
    return 0
  fi
  log "$system: $REQUESTS requests from $CLIENTS clients"
  if ! "$PY" "$REPO/scripts/serve_bench_client.py" --base-url "http://127.0.0.1:$port/v1" \
    --model "$model_name" --clients "$CLIENTS" --requests "$REQUESTS" \
    --prompt-words "$PROMPT_WORDS" --system-words "$SYSTEM_WORDS" \
    --system-tokens "$SYSTEM_TOKENS" --tokenizer "$MODEL/tokenizer.json" \
    --max-tokens "$MAX_TOKENS" --time-limit "$TIME_LIMIT" \
    --label "$system" > "$TMP/client.out"; then
    log "$system: some requests failed (see the line's counts)"
  fi
  # The server's resident set after the load (VmHWM: its peak).
  local rss
  rss=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status" 2>/dev/null || echo 0)
  stop_server
  "$PY" -c 'import json, sys; r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); r["peak_rss_kb"] = int(sys.argv[2] or 0); print(json.dumps(r))' \
    "$TMP/client.out" "$rss" >> "$RESULTS"
}

# Each slot of llama-server holds a prompt and its completion: --ctx-size is the slots'
# total (these words run about one token each, up to 1.3 for other text; three times
# that leaves room; a --system-tokens prefix is that many tokens and a few more).
PROMPT_TOKENS=$(((SYSTEM_WORDS + PROMPT_WORDS) * 3 + SYSTEM_TOKENS + SYSTEM_TOKENS / 16))
CTX=$((CLIENTS * (PROMPT_TOKENS + MAX_TOKENS + 16)))
MAX_PROMPT=$PROMPT_TOKENS
MOEC_EXTRA=()
[ -z "$PREFILL_BUDGET" ] || MOEC_EXTRA=(--prefill-budget "$PREFILL_BUDGET")
if ! skipped llama-server; then
  port=$(free_port)
  measure llama-server "$port" mixtral-mid "$SERVER" -m "$GGUF" --host 127.0.0.1 \
    --port "$port" -t "$THREADS" -tb "$THREADS" -c "$CTX" -np "$CLIENTS" -b 2048 -ub 512 \
    --no-webui
fi
for sched in $SCHEDULES; do
  skipped "$sched" && continue
  # The plan holds --clients sequences at once: one micro-batch (or group) where the
  # schedule lets it, as peer-bench sets them.
  half=$(( CLIENTS / 2 > 0 ? CLIENTS / 2 : 1 ))
  case $sched in
    klotski) sets=(--set "bs=$CLIENTS" --set n_batch=1) ;;
    flexgen|baselines/flexgen_cpu_attn) sets=(--set "bs=$half" --set n_batch=2) ;;
    vslpipe) sets=(--set "seqs=$half") ;;
    moe_infinity) sets=(--set "bs=$CLIENTS") ;;
    *) sets=(--set "ubs=$CLIENTS" --set n_ub=1) ;;
  esac
  if [ ${#USER_SETS[@]} -gt 0 ]; then sets=("${USER_SETS[@]}"); fi
  for product in $BF16_PRODUCTS; do
    label="moec $sched"
    [ "$product" = f32 ] || label="$label $product"
    port=$(free_port)
    measure "$label" "$port" mixtral-mid env MOEC_BF16_PRODUCT="$product" "$MOEC" serve \
      "$REPO/schedules/$sched.sched" --weights "$MODEL" --threads "$THREADS" \
      --host 127.0.0.1 --port "$port" --max-batch "$CLIENTS" --max-prompt "$MAX_PROMPT" \
      --max-tokens "$MAX_TOKENS" "${sets[@]}" ${MOEC_EXTRA[@]+"${MOEC_EXTRA[@]}"}
  done
done

# 6. The table.
"$PY" - "$RESULTS" "$CLIENTS" "$PROMPT_WORDS" "$MAX_TOKENS" "$THREADS" "$SYSTEM_WORDS" \
  "$SYSTEM_TOKENS" <<'EOF'
import json, sys
path, clients, words, max_tokens, threads, system, system_tokens = sys.argv[1], *map(int, sys.argv[2:])
rows = [json.loads(l) for l in open(path)]
shared = f" after a shared prefix of {system} words" if system else ""
counted = next((r["system_tokens"] for r in rows if r.get("system_tokens")), None)
if system_tokens:
    shared = f" after a shared prefix of {counted or system_tokens} tokens"
print(f"\n{clients} concurrent streaming clients, prompts of {words} random words{shared}, "
      f"{max_tokens} tokens each, greedy, {threads} threads; 127.0.0.1")
print("| system | requests | prompt tokens (mean) | output tok/s | TTFT p50 / p99 (s) | inter-token p50 / p99 (ms) | peak RSS |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    if r.get("failed") or "output_tokens_per_s" not in r:
        print(f"| {r['system']} | failed | | | | | |")
        continue
    itl = lambda k: f"{r[k] * 1e3:.1f}" if r[k] is not None else "-"
    print(f"| {r['system']} | {r['requests_done']}/{r['requests_asked']}"
          f"{' (time limit)' if r['timed_out'] else ''} | {r['mean_prompt_tokens']:.1f} | "
          f"{r['output_tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
          f"{itl('itl_p50_s')} / {itl('itl_p99_s')} | {r['peak_rss_kb'] / 1024:.0f} MiB |")
peer = next((r for r in rows if r["system"] == "llama-server" and "output_tokens_per_s" in r), None)
if peer:
    for r in rows:
        if r["system"].startswith("moec") and "output_tokens_per_s" in r:
            print(f"  {r['system']} / llama-server output tok/s = "
                  f"{r['output_tokens_per_s'] / peer['output_tokens_per_s']:.2f}")
print(f"\nraw results: {path}")
EOF
