#!/usr/bin/env bash
# Bigger than RAM (issue 43, point 5): moec's disk schedules against llama.cpp's default mmap
# on the same model file, on this machine, at batch 1 and 16 (prompt 128 + 32 new tokens,
# 2 threads), the page cache dropped before each run; records tokens/s, bytes read from
# disk, peak RSS and moec's HRM replay.
#
# What it takes (nothing is synthesised or downloaded here: the lead provides the files):
#   --model NAME=CARD:PATH[:FORMATS]
#                       a model file or checkpoint folder moec runs (`--weights PATH`), the
#                       card `moec plan` plans it as, and its weight formats for the planner
#                       (`--weight-format`; a `.gguf` file is planned from its own header), e.g.
#                       mixtral-q4km=mixtral-8x7b:/data/Mixtral-8x7B-Q4_K_M.gguf:experts=q4_k,attention=q4_k;
#                       repeatable
#   --host-mem BYTES    the host budget moec's runs are held to (default 16GB)
#   --moec PATH         a release build of moec (default: built here with cargo)
#   --threads N         threads for both engines (default 2)
#   $MOEC_LLAMA_BIN     llama.cpp's binaries (llama-batched-bench), e.g. as
#                       scripts/peer-bench.sh builds them; without it llama.cpp is skipped
#   $MOEC_LLAMA_REPACK  1 to keep llama.cpp's default weight repacking. By default the bench
#                       passes --no-repack: repacking copies every Q4_K/Q6_K tensor into
#                       anonymous memory at load (a 3.9 GiB OLMoE Q4_K_M file: 7.3 GB peak RSS
#                       with it, 4.2 GB without), so a model bigger than RAM would not run
#                       from its mmap at all
#   root, to drop the page cache (echo 3 > /proc/sys/vm/drop_caches); otherwise the runs
#   are made anyway and each result line says the cache was not dropped
# What it gives: `moec probe`'s disk figures of the models' drive (the profile the replay
# and `moec plan` use), then one JSON line per (model, engine, batch) appended to
# $MOEC_DISK_CACHE/results.jsonl (default ~/.cache/moec-disk) and a table on stdout. moec
# runs the schedule `moec plan` picks among schedules/moe_infinity_disk.sched and
# schedules/flexgen_disk.sched for the budget (its printed `moec run` line), with
# --host-mem; its run report gives the bytes read from disk and the bandwidth achieved.
#
# Usage: scripts/disk-bench.sh --model NAME=CARD:PATH[:FORMATS] [--model ...] [--host-mem 16GB]
#            [--moec PATH] [--threads 2]
set -euo pipefail
# Each point's HRM replay on its own quick probe of the machine as it is now, never on
# one an earlier run kept (docs/cost-model.md, "The quick probe, kept for the runs that
# follow").
export MOEC_PROBE_MAX_AGE=0

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_DISK_CACHE:-$HOME/.cache/moec-disk}
MODELS=()
HOST_MEM=16GB
MOEC=""
THREADS=2

while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODELS+=("$2"); shift 2 ;;
    --host-mem) HOST_MEM=$2; shift 2 ;;
    --moec) MOEC=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#MODELS[@]} -gt 0 ] || { echo "no --model NAME=CARD:PATH given (see --help)" >&2; exit 2; }
[ -x /usr/bin/time ] || { echo "GNU time is needed at /usr/bin/time" >&2; exit 2; }
mkdir -p "$CACHE"
RESULTS=$CACHE/results.jsonl
log() { echo "disk-bench: $*" >&2; }

if [ -z "$MOEC" ]; then
  (cd "$REPO" && cargo build --release --bin moec >&2)
  MOEC=${CARGO_TARGET_DIR:-$REPO/target}/release/moec
fi
COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)

drop_cache() {
  sync
  if [ "$(id -u)" = 0 ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
    echo true
  else
    log "cannot drop the page cache (not root): this run may read from memory"
    echo false
  fi
}
peak_kb() { awk -F': ' '/Maximum resident set size/ {print $2}' "$1"; }
wall_s() {
  awk -F': ' '/Elapsed \(wall clock\)/ {n = split($2, t, ":"); s = 0; for (i = 1; i <= n; i++) s = s * 60 + t[i]; print s}' "$1"
}

# Decode and prefill tokens/s are over the whole batch (llama-batched-bench's S_TG and S_PP);
# overall is the batch's generated tokens over prefill + decode seconds, for both engines.
printf '%-22s %-8s %5s %9s %9s %9s %24s %12s %10s\n' model engine batch decode prefill overall disk peak_RSS_MB replay
for entry in "${MODELS[@]}"; do
  name=${entry%%=*}
  rest=${entry#*=}
  card=${rest%%:*}
  rest=${rest#*:}
  path=${rest%%:*}
  formats=""
  [ "$rest" != "$path" ] && formats=${rest#*:}
  [ -e "$path" ] || { log "$name: $path does not exist, skipped"; continue; }
  dir=$(dirname "$(realpath "$path")")
  profile=$CACHE/probe-$name.ron
  # The drive the model is on, measured with direct reads (256 MiB temporary file there).
  "$MOEC" probe --threads "$THREADS" --disk-dir "$dir" --disk-mib 256 -o "$profile" \
    > "$CACHE/probe-$name.log" 2>&1 || { log "$name: moec probe failed (see $CACHE/probe-$name.log)"; continue; }
  for batch in 1 16; do
    workload="count=$batch,mean=128,max=128,min=128,gen=32"
    # moec: the planner's pick among the disk schedules for this budget and profile.
    best=""
    best_tps=0
    for sched in moe_infinity_disk flexgen_disk; do
      out=$CACHE/plan-$name-$sched-$batch.log
      # A GGUF file is planned from its header (every tensor's own format: a Q4_K_M mix
      # keeps some experts in Q6_K, which `--weight-format` cannot say); a folder from its
      # card and formats.
      if [ "${path%.gguf}" != "$path" ]; then
        plan_model=(--model "$path")
      else
        plan_model=(--model "$card")
        [ -n "$formats" ] && plan_model+=(--weight-format "$formats")
      fi
      if "$MOEC" plan "$REPO/schedules/$sched.sched" "${plan_model[@]}" --hw "$profile" \
          --host-mem "$HOST_MEM" --workload "$workload" > "$out" 2>&1; then
        # The best row's predicted decode tokens/s (rank 1: `1 PARAMS.. gen decode gpu pinned host`).
        tps=$(awk '$1 == "1" && NF >= 6 {print $(NF - 3); exit}' "$out")
        if [ -n "$tps" ] && awk -v a="$tps" -v b="$best_tps" 'BEGIN {exit !(a > b)}'; then
          best=$sched
          best_tps=$tps
        fi
      else
        log "$name: moec plan $sched failed (see $out)"
      fi
    done
    if [ -n "$best" ]; then
      # The planner's `moec run` line: its --set values (the schedule's params).
      run_line=$(grep -m1 '^  *moec run ' "$CACHE/plan-$name-$best-$batch.log" || true)
      sets=$(echo "$run_line" | grep -o -- '--set [^ ]*' | tr '\n' ' ' || true)
      dropped=$(drop_cache)
      log=$CACHE/moec-$name-$batch.log
      # shellcheck disable=SC2086
      if /usr/bin/time -v -o "$CACHE/time-moec.log" "$MOEC" run "$REPO/schedules/$best.sched" \
          --model "$card" --weights "$path" --workload "$workload" --threads "$THREADS" --hw "$profile" \
          --host-mem "$HOST_MEM" $sets --json > "$log" 2> "$log.err"; then
        # `--json`: tokens/s overall (prefill + decode), the disk totals, the HRM replay.
        # `report`: decode and prefill tokens/s over the batch; `stats`: overall.
        read -r dec pre tps < <(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); p=r['report']; print('%.3f %.3f %.3f' % (p['decode_tokens_per_s'], p['prefill_tokens_per_s'], r['stats']['tokens_per_s']))" "$log" 2>/dev/null || echo "null null null")
        disk=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])).get('disk') or {}; print('%.2f GB at %.2f GB/s' % (d.get('bytes', 0) / 1e9, d.get('bandwidth_bytes_per_s', 0) / 1e9))" "$log" 2>/dev/null || echo "?")
        replay=$(python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1])).get('predicted')))" "$log" 2>/dev/null || echo null)
        rss=$(peak_kb "$CACHE/time-moec.log")
        printf '%-22s %-8s %5s %9s %9s %9s %24s %12s %10s\n' "$name" "moec" "$batch" "$dec" "$pre" "$tps" "$disk" "$((rss / 1024))" "$([ "$replay" = null ] && echo - || echo json)"
        echo "{\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$COMMIT\",\"model\":\"$name\",\"engine\":\"moec\",\"schedule\":\"$best\",\"sets\":\"$sets\",\"batch\":$batch,\"cache_dropped\":$dropped,\"decode_tokens_per_s\":$dec,\"prefill_tokens_per_s\":$pre,\"tokens_per_s\":$tps,\"disk\":\"$disk\",\"peak_rss_kb\":$rss,\"wall_s\":$(wall_s "$CACHE/time-moec.log"),\"host_mem\":\"$HOST_MEM\",\"predicted\":$replay}" >> "$RESULTS"
      else
        log "$name: moec run failed at batch $batch (see $log.err)"
      fi
    fi
    # llama.cpp on the same file, its default mmap.
    if [ -n "${MOEC_LLAMA_BIN:-}" ] && [ -x "$MOEC_LLAMA_BIN/llama-batched-bench" ] && [ -f "$path" ]; then
      dropped=$(drop_cache)
      out=$CACHE/llama-$name-$batch.log
      if /usr/bin/time -v -o "$CACHE/time-llama.log" "$MOEC_LLAMA_BIN/llama-batched-bench" -m "$path" \
          -c $((160 * batch)) -npp 128 -ntg 32 -npl "$batch" -t "$THREADS" \
          $([ "${MOEC_LLAMA_REPACK:-0}" = 1 ] || echo --no-repack) > "$out" 2>&1; then
        # The table's last row: S_PP t/s (prefill), S_TG t/s (decode), T s (both); overall
        # as moec counts it, B x 32 generated tokens over T.
        read -r pre dec tps < <(awk -F'|' -v b="$batch" '/^\|/ && $2 ~ /[0-9]/ {gsub(/ /, ""); p = $7; d = $9; t = $10} END {if (t > 0) printf "%s %s %.3f\n", p, d, b * 32 / t; else print "null null null"}' "$out")
        rss=$(peak_kb "$CACHE/time-llama.log")
        printf '%-22s %-8s %5s %9s %9s %9s %24s %12s %10s\n' "$name" "llama" "$batch" "$dec" "$pre" "$tps" "-" "$((rss / 1024))" "-"
        echo "{\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$COMMIT\",\"model\":\"$name\",\"engine\":\"llama.cpp\",\"batch\":$batch,\"cache_dropped\":$dropped,\"decode_tokens_per_s\":$dec,\"prefill_tokens_per_s\":$pre,\"tokens_per_s\":$tps,\"peak_rss_kb\":$rss,\"wall_s\":$(wall_s "$CACHE/time-llama.log")}" >> "$RESULTS"
      else
        log "$name: llama-batched-bench failed at batch $batch (see $out)"
      fi
    fi
  done
done
log "results appended to $RESULTS"
