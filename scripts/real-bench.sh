#!/usr/bin/env bash
# Real-size synthetic GGUFs (issue 42, point 1 and its measurements): for each model, write
# the card's checkpoint straight into a GGUF with `moec synth --gguf` in the mix people
# download, timed, with its file size and peak RSS (GNU time); then, when llama.cpp is built,
# `llama-batched-bench` on the same file (does it load, how fast), and for the models named
# in --moec-run, moec's `resident` schedule on it (time to first token and peak RSS).
#
# What it takes: a release build of moec (built here with cargo unless --moec names one),
# GNU time at /usr/bin/time, and optionally llama.cpp's binaries in $MOEC_LLAMA_BIN (e.g.
# ~/.cache/moec-peer/build-0.3.36/bin, as scripts/peer-bench.sh builds them).
# What it gives: one JSON line per measurement appended to $MOEC_REAL_CACHE/results.jsonl
# and a table on stdout. Files are written under $MOEC_REAL_CACHE (default
# ~/.cache/moec-real), outside the repository; each is deleted after its measurements
# unless --keep names its model, so at most one real-size file is on disk at a time (they
# are 11-19 GB).
#
# Not yet here (issue 42, point 3): the prompt 512/8192/32768 runs, moec's offload
# schedules and the HRM replay ratio.
#
# Usage: scripts/real-bench.sh [--models "qwen3-30b-a3b:q4_k_m gpt-oss-20b:mxfp4_moe ..."]
#            [--keep MODEL] [--moec-run MODEL] [--moec PATH] [--threads 2]
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_REAL_CACHE:-$HOME/.cache/moec-real}
# DeepSeek-V2-Lite in Q6_K: its Q4_K_M needs Q5_0 (llama-quantize's fallback for rows that
# are not whole Q4_K blocks), which moec does not write (docs/performance.md).
MODELS="qwen3-30b-a3b:q4_k_m gpt-oss-20b:mxfp4_moe deepseek-v2-lite:q6_k olmoe-1b-7b:q4_k_m"
KEEP=""
MOEC_RUN=""
MOEC=""
THREADS=2

while [ $# -gt 0 ]; do
  case "$1" in
    --models) MODELS=$2; shift 2 ;;
    --keep) KEEP="$KEEP $2"; shift 2 ;;
    --moec-run) MOEC_RUN="$MOEC_RUN $2"; shift 2 ;;
    --moec) MOEC=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "real-bench: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "real-bench: $*" >&2; }
listed() { case " $2 " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if [ -z "$MOEC" ]; then
  (cd "$REPO" && nice -n 10 cargo build --release --bin moec >&2)
  MOEC=${CARGO_TARGET_DIR:-$REPO/target}/release/moec
fi
mkdir -p "$CACHE"
RESULTS=$CACHE/results.jsonl
COMMIT=$(git -C "$REPO" rev-parse --short HEAD)
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
# Other processes' CPU share while we run: the machine is quiet only when this is ~0.
busy() { awk '{print $1}' /proc/loadavg; }

# Peak RSS (kB) and wall seconds from a GNU time -v log.
peak_kb() { awk -F': ' '/Maximum resident set size/ {print $2}' "$1"; }
wall_s() {
  awk -F': ' '/Elapsed \(wall clock\)/ {print $2}' "$1" |
    awk -F: '{ if (NF == 3) print $1*3600 + $2*60 + $3; else print $1*60 + $2 }'
}

printf '%-18s %-10s %10s %9s %10s %s\n' model mix "size GB" "time s" "RSS MB" "llama.cpp"
for entry in $MODELS; do
  model=${entry%%:*}
  mix=${entry#*:}
  file=$CACHE/$model-$mix.gguf
  load_before=$(busy)
  if [ ! -f "$file" ]; then
    log "$model: writing $file"
    /usr/bin/time -v -o "$CACHE/time-synth.log" \
      "$MOEC" synth --model "$model" --gguf --mix "$mix" --out "$file" > "$CACHE/synth-$model.log"
    cat "$CACHE/synth-$model.log" >&2
    synth_s=$(wall_s "$CACHE/time-synth.log")
    synth_kb=$(peak_kb "$CACHE/time-synth.log")
  else
    log "$model: $file is already there (kept from an earlier run): not timed again"
    synth_s=null
    synth_kb=null
  fi
  size=$(stat -c %s "$file")
  llama=skipped
  llama_line=null
  if [ -n "${MOEC_LLAMA_BIN:-}" ] && [ -x "$MOEC_LLAMA_BIN/llama-batched-bench" ]; then
    if nice -n 5 "$MOEC_LLAMA_BIN/llama-batched-bench" -m "$file" -c 256 -npp 16 -ntg 4 -npl 1 \
      -t "$THREADS" > "$CACHE/llama-$model.log" 2>&1; then
      # The result row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
      row=$(grep -E '^\|\s+16 \|' "$CACHE/llama-$model.log" | tail -1)
      pp=$(echo "$row" | awk -F'|' '{gsub(/ /,"",$7); print $7}')
      tg=$(echo "$row" | awk -F'|' '{gsub(/ /,"",$9); print $9}')
      llama="loads: pp16 $pp t/s, tg $tg t/s"
      llama_line="{\"loads\":true,\"pp_tok_s\":${pp:-null},\"tg_tok_s\":${tg:-null}}"
    else
      llama="FAILED (see $CACHE/llama-$model.log)"
      llama_line="{\"loads\":false}"
    fi
  fi
  moec_line=null
  if listed "$model" "$MOEC_RUN"; then
    /usr/bin/time -v -o "$CACHE/time-run.log" "$MOEC" run "$REPO/schedules/baselines/resident.sched" \
      --weights "$file" --prompt "The quick brown fox jumps over the lazy dog" --gen-len 4 \
      > "$CACHE/moec-run-$model.log" 2>&1 || log "$model: moec run failed (see $CACHE/moec-run-$model.log)"
    moec_line="{\"wall_s\":$(wall_s "$CACHE/time-run.log"),\"peak_rss_kb\":$(peak_kb "$CACHE/time-run.log")}"
  fi
  printf '%-18s %-10s %10.2f %9s %10s %s\n' "$model" "$mix" "$(awk -v s="$size" 'BEGIN {print s / 1e9}')" \
    "$synth_s" "$([ "$synth_kb" = null ] && echo - || echo $((synth_kb / 1024)))" "$llama"
  echo "{\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$COMMIT\",\"cpu\":\"$CPU\",\"load_before\":$load_before,\"load_after\":$(busy),\"model\":\"$model\",\"mix\":\"$mix\",\"file_bytes\":$size,\"synth_s\":$synth_s,\"synth_peak_rss_kb\":$synth_kb,\"llama_cpp\":$llama_line,\"moec_run\":$moec_line}" >> "$RESULTS"
  if ! listed "$model" "$KEEP"; then
    rm -f "$file"
  fi
done
log "results appended to $RESULTS"
