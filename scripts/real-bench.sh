#!/usr/bin/env bash
# The real-size peer bench (issue 42, point 3): for each model, the card's checkpoint written
# once as a GGUF in the mix people download (`moec synth --gguf`, cached outside the
# repository), then llama.cpp (`llama-batched-bench`, same file, same threads) and moec
# (`baselines/resident`) on the same workloads, one process per engine and point:
#
#   prompt P + G new tokens at batch B, for each P:G:B of --points (default 512:128:1
#   512:128:8 512:128:32 8192:128:1), and with --long MODEL one 32768:16:1 point on it.
#
# A point whose prompt + new tokens pass the card's `max_positions` is run with the prompt
# cut to fit (OLMoE-1B-7B holds 4,096 positions), and the table says so.
#
# Recorded per engine and point (one JSON line each in $MOEC_REAL_CACHE/results.jsonl, with
# the run's tag, date, commit, CPU model and the load average before and after):
#   prefill and decode tokens/s over the batch (llama-batched-bench's S_PP and S_TG; moec's
#   report), time to first token from process start (the process's wall time less its
#   decode time: load, prefill and exit, measured the same way for both engines), peak RSS
#   (GNU time), and for moec the HRM replay of the decode step (measured / predicted).
# The table at the end covers this run's lines: each point's figures and moec / llama.cpp.
#
# moec's KV cache is f16 (`--kv-type f16`), as llama.cpp's is by default, unless --kv-type
# says otherwise; the type is recorded with each moec line. --host-mem SIZE gives moec's runs
# that host budget (`moec run --host-mem`, recorded) where a point needs more than the
# default share of 0.8 of the machine's memory (Qwen3-30B-A3B's 8,192-token prompt, whose
# budget is 20.59 GB of 20.22). --prefill-tokens N prefills at
# most N prompt tokens a pass over the batch (`moec run --prefill-chunk N/batch`, as
# llama.cpp's `-ub 512` does; default: each prompt whole), recorded too.
#
# Every model here fits this machine's memory, so no --host-mem budget forces an offload
# schedule; `baselines/resident` is moec's schedule for every point (scripts/disk-bench.sh
# measures the offload schedules on a model larger than memory).
#
# What it takes: a release build of moec (built with cargo unless --moec names one), GNU
# time at /usr/bin/time, python3, and llama.cpp's CPU binaries in $MOEC_LLAMA_BIN (default
# ~/.cache/moec-peer/build-0.3.36/bin, as scripts/peer-bench.sh builds them; without them
# llama.cpp is skipped and said so).
#
# Files are kept in the cache for the next run (each is 4-19 GB); at most two real-size
# files stay there: before writing a third, the oldest other one is deleted (said).
# --delete removes each model's file after its points.
#
# Usage: scripts/real-bench.sh [--models "olmoe-1b-7b:q4_k_m gpt-oss-20b:mxfp4_moe ..."]
#            [--points "512:128:1 8192:128:1"] [--long MODEL] [--engines "llama moec"]
#            [--moec PATH] [--threads 2] [--tag NAME] [--kv-type f16|f32] [--prefill-tokens N]
#            [--host-mem SIZE]
#            [--delete] [--synth-only]
#        scripts/real-bench.sh --table TAG     (print the table of an earlier run)
set -euo pipefail
# Each point's HRM replay on its own quick probe of the machine as it is now, never on
# one an earlier run kept (docs/cost-model.md, "The quick probe, kept for the runs that
# follow"): before each timed moec run an untimed short run of the same command (16-token
# prompt, 1 new token) takes a fresh probe (MOEC_PROBE_MAX_AGE=1: any kept one is older), which the timed run then
# reuses (its report says so, with the probe's age). So the timed run's time to first
# token is what a user's run pays once moec has probed the machine: the probe's seconds
# (about 7 on 2 cores) are not in it, where until session 24 they were.
#
# Both engines start from a warm page cache: the file is read once (cat) before each timed
# run when it fits in the memory available, so the engine that runs first does not pay
# the disk for both (recorded as "warm" with each line; a DeepSeek-V2-Lite llama.cpp run
# right after `moec synth` measured 0.59 tok/s decode on a cold cache where a warm one gave
# 10.38).

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MOEC_REAL_CACHE:-$HOME/.cache/moec-real}
LLAMA_BIN=${MOEC_LLAMA_BIN:-$HOME/.cache/moec-peer/build-0.3.36/bin}
# DeepSeek-V2-Lite in Q6_K: its Q4_K_M needs Q5_0 (llama-quantize's fallback for rows that
# are not whole Q4_K blocks), which moec does not write (docs/performance.md).
MODELS="olmoe-1b-7b:q4_k_m gpt-oss-20b:mxfp4_moe deepseek-v2-lite:q6_k qwen3-30b-a3b:q4_k_m"
POINTS="512:128:1 512:128:8 512:128:32 8192:128:1"
LONG=""
ENGINES="llama moec"
MOEC=""
THREADS=2
KV_TYPE=f16
PREFILL_TOKENS=0
HOST_MEM=""
TAG=$(date -u +%Y%m%dT%H%M%SZ)
DELETE=0
SYNTH_ONLY=0
TABLE=""

while [ $# -gt 0 ]; do
  case "$1" in
    --models) MODELS=$2; shift 2 ;;
    --points) POINTS=$2; shift 2 ;;
    --long) LONG=$2; shift 2 ;;
    --engines) ENGINES=$2; shift 2 ;;
    --moec) MOEC=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --kv-type) KV_TYPE=$2; shift 2 ;;
    --prefill-tokens) PREFILL_TOKENS=$2; shift 2 ;;
    --host-mem) HOST_MEM=$2; shift 2 ;;
    --delete) DELETE=1; shift ;;
    --synth-only) SYNTH_ONLY=1; shift ;;
    --table) TABLE=$2; shift 2 ;;
    -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
    *) echo "real-bench: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "real-bench: $*" >&2; }
listed() { case " $2 " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
mkdir -p "$CACHE"
RESULTS=$CACHE/results.jsonl

# The table of one run's lines: each point's figures per engine, then moec / llama.cpp.
table() {
  python3 - "$RESULTS" "$1" <<'EOF'
import json, sys
path, tag = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(path) if l.strip()]
rows = [r for r in rows if r.get("tag") == tag and r.get("kind") == "point"]
if not rows:
    sys.exit(f"real-bench: no points of run {tag} in {path}")
def f(v, fmt):
    return "-" if v is None else fmt % v
first = rows[0]
print(f"run {tag}: commit {first['commit']}, {first['cpu']}, {first['threads']} threads; "
      f"load average {min(r['load_before'] for r in rows):.2f}-{max(r['load_after'] for r in rows):.2f}")
print()
print("| model | prompt + new x batch | engine | prefill tok/s | decode tok/s | TTFT from start s | peak RSS GB | replay (decode step measured / predicted) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    point = f"{r['prompt']} + {r['gen']} x {r['batch']}" + (" (cut to fit)" if r.get("cut") else "")
    replay = "-"
    if r.get("step_measured_s") and r.get("step_predicted_s"):
        replay = "%.1f / %.1f ms (%.2fx)" % (1e3 * r["step_measured_s"], 1e3 * r["step_predicted_s"],
                                             r["step_measured_s"] / r["step_predicted_s"])
    status = "" if r.get("ok") else " (FAILED)"
    engine = r["engine"] + (f" (KV {r['kv_type']})" if r.get("kv_type") else "") + (
        f" (chunks of {r['prefill_chunk']})" if r.get("prefill_chunk") else "") + (
        f" (--host-mem {r['host_mem']})" if r.get("host_mem") else "")
    print(f"| {r['model']} | {point} | {engine}{status} | {f(r.get('prefill_tok_s'), '%.1f')} | "
          f"{f(r.get('decode_tok_s'), '%.2f')} | {f(r.get('ttft_s'), '%.1f')} | "
          f"{f(r['peak_rss_kb'] / 1e6 if r.get('peak_rss_kb') else None, '%.2f')} | {replay} |")
print()
print("| model | prompt + new x batch | decode moec / llama.cpp | prefill | TTFT | peak RSS |")
print("| --- | --- | --- | --- | --- | --- |")
by = {}
for r in rows:
    by.setdefault((r["model"], r["prompt"], r["gen"], r["batch"]), {})[r["engine"]] = r
def ratio(m, l, key):
    a, b = m.get(key), l.get(key)
    return "-" if not a or not b else "%.2fx" % (a / b)
for (model, p, g, b), e in by.items():
    m, l = e.get("moec"), e.get("llama.cpp")
    if not m or not l or not m.get("ok") or not l.get("ok"):
        continue
    print(f"| {model} | {p} + {g} x {b} | {ratio(m, l, 'decode_tok_s')} | {ratio(m, l, 'prefill_tok_s')} | "
          f"{ratio(m, l, 'ttft_s')} | {ratio(m, l, 'peak_rss_kb')} |")
EOF
}

if [ -n "$TABLE" ]; then
  table "$TABLE"
  exit 0
fi

if [ -z "$MOEC" ]; then
  (cd "$REPO" && nice -n 10 cargo build --release --bin moec >&2)
  MOEC=${CARGO_TARGET_DIR:-$REPO/target}/release/moec
fi
COMMIT=$(git -C "$REPO" rev-parse --short HEAD)
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
busy() { awk '{print $1}' /proc/loadavg; }
# Reads the file into the page cache when it fits in 90% of the memory available; prints
# true or false (what the record says).
warm_file() {
  local avail_kb size_kb
  avail_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
  size_kb=$(( $(stat -c %s "$file") / 1024 ))
  if [ "$size_kb" -lt $(( avail_kb * 9 / 10 )) ]; then
    cat "$file" > /dev/null
    echo true
  else
    log "$file ($size_kb kB) does not fit in 90% of the $avail_kb kB available: runs start cold"
    echo false
  fi
}
# Peak RSS (kB) and wall seconds from a GNU time -v log.
peak_kb() { awk -F': ' '/Maximum resident set size/ {print $2}' "$1"; }
wall_s() {
  awk -F': ' '/Elapsed \(wall clock\)/ {n = split($2, t, ":"); s = 0; for (i = 1; i <= n; i++) s = s * 60 + t[i]; print s}' "$1"
}
have_llama=0
if listed llama "$ENGINES"; then
  if [ -x "$LLAMA_BIN/llama-batched-bench" ]; then
    have_llama=1
  else
    log "llama.cpp: no llama-batched-bench in $LLAMA_BIN (set MOEC_LLAMA_BIN; scripts/peer-bench.sh builds it): llama.cpp SKIPPED"
  fi
fi
log "run $TAG: commit $COMMIT, $CPU, $THREADS threads; results in $RESULTS"

# Writes the model's file if it is not cached; keeps at most two real-size files.
ensure_file() {
  local model=$1 mix=$2 file=$3
  if [ -f "$file" ]; then
    log "$model: $file is cached (written by an earlier run): not timed again"
    return
  fi
  mapfile -t others < <(ls -t "$CACHE"/*.gguf 2>/dev/null | grep -vx "$file" || true)
  while [ "${#others[@]}" -ge 2 ]; do
    log "keeping at most two real-size files: deleting the oldest, ${others[-1]}"
    rm -f "${others[-1]}"
    unset 'others[-1]'
  done
  log "$model: writing $file"
  local load=$(busy)
  /usr/bin/time -v -o "$CACHE/time-synth.log" \
    "$MOEC" synth --model "$model" --gguf --mix "$mix" --out "$file" > "$CACHE/synth-$model.log"
  cat "$CACHE/synth-$model.log" >&2
  echo "{\"tag\":\"$TAG\",\"kind\":\"synth\",\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$COMMIT\",\"cpu\":\"$CPU\",\"load_before\":$load,\"load_after\":$(busy),\"model\":\"$model\",\"mix\":\"$mix\",\"file_bytes\":$(stat -c %s "$file"),\"synth_s\":$(wall_s "$CACHE/time-synth.log"),\"synth_peak_rss_kb\":$(peak_kb "$CACHE/time-synth.log")}" >> "$RESULTS"
}

# One JSON line for one engine at one point.
record() {
  local engine=$1 ok=$2 fields=$3
  echo "{\"tag\":\"$TAG\",\"kind\":\"point\",\"date\":\"$(date -u +%FT%TZ)\",\"commit\":\"$COMMIT\",\"cpu\":\"$CPU\",\"threads\":$THREADS,\"load_before\":$load,\"load_after\":$(busy),\"model\":\"$model\",\"mix\":\"$mix\",\"prompt\":$prompt,\"gen\":$gen,\"batch\":$batch,\"cut\":$cut,\"engine\":\"$engine\",\"ok\":$ok,$fields}" >> "$RESULTS"
}

run_llama() {
  local out=$CACHE/llama-$model-$prompt-$gen-$batch.log
  local warm
  warm=$(warm_file)
  load=$(busy)
  if /usr/bin/time -v -o "$CACHE/time-llama.log" "$LLAMA_BIN/llama-batched-bench" -m "$file" \
      -c $((batch * (prompt + gen))) -npp "$prompt" -ntg "$gen" -npl "$batch" \
      -t "$THREADS" -tb "$THREADS" -b 2048 -ub 512 > "$out" 2>&1; then
    # The result row: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    local pre dec ttg
    read -r pre dec ttg < <(awk -F'|' '/^\|/ && $2 ~ /[0-9]/ {gsub(/ /, ""); p = $7; d = $9; t = $8} END {if (d > 0) print p, d, t; else print "null null null"}' "$out")
    local wall=$(wall_s "$CACHE/time-llama.log")
    local ttft=null
    [ "$ttg" != null ] && ttft=$(awk -v w="$wall" -v t="$ttg" 'BEGIN {print w - t}')
    record llama.cpp true "\"warm\":$warm,\"prefill_tok_s\":$pre,\"decode_tok_s\":$dec,\"ttft_s\":$ttft,\"wall_s\":$wall,\"peak_rss_kb\":$(peak_kb "$CACHE/time-llama.log")"
    log "$model $prompt+$gen x$batch llama.cpp: prefill $pre, decode $dec tok/s"
  else
    record llama.cpp false "\"log\":\"$out\""
    log "$model $prompt+$gen x$batch: llama-batched-bench failed (see $out)"
  fi
}

run_moec() {
  local out=$CACHE/moec-$model-$prompt-$gen-$batch.json
  local chunk=() chunk_json=null host=() host_json=null
  if [ -n "$HOST_MEM" ]; then
    host=(--host-mem "$HOST_MEM")
    host_json="\"$HOST_MEM\""
  fi
  if [ "$PREFILL_TOKENS" -gt 0 ]; then
    chunk_json=$(( PREFILL_TOKENS / batch > 0 ? PREFILL_TOKENS / batch : 1 ))
    chunk=(--prefill-chunk "$chunk_json")
  fi
  # The untimed short run that takes this point's probe (and reads the file once).
  MOEC_PROBE_MAX_AGE=1 "$MOEC" run "$REPO/schedules/baselines/resident.sched" \
      --weights "$file" --threads "$THREADS" --kv-type "$KV_TYPE" "${host[@]}" --set ubs=1 --set n_ub=1 \
      --workload "count=1,mean=16,min=16,max=16,gen=1" > /dev/null 2> "$out.probe.err" \
    || log "$model: the probe's short run failed (see $out.probe.err); the timed run probes"
  local warm
  warm=$(warm_file)
  load=$(busy)
  if /usr/bin/time -v -o "$CACHE/time-moec.log" "$MOEC" run "$REPO/schedules/baselines/resident.sched" \
      --weights "$file" --threads "$THREADS" --kv-type "$KV_TYPE" "${chunk[@]}" "${host[@]}" --set ubs="$batch" --set n_ub=1 \
      --workload "count=$batch,mean=$prompt,min=$prompt,max=$prompt,gen=$gen" --json \
      > "$out" 2> "$out.err"; then
    local wall=$(wall_s "$CACHE/time-moec.log")
    local fields
    fields=$(python3 - "$out" "$wall" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
wall = float(sys.argv[2])
p, pr = r["report"], r.get("predicted") or {}
decode_s = p["decode_steps"] * p["decode_step_seconds"]
print(json.dumps({
    "prefill_tok_s": p["prefill_tokens_per_s"],
    "decode_tok_s": p["decode_tokens_per_s"],
    "ttft_s": wall - decode_s,
    "wall_s": wall,
    "step_measured_s": pr.get("decode_step_measured_seconds"),
    "step_predicted_s": pr.get("decode_step_seconds"),
})[1:-1])
EOF
    )
    record moec true "\"warm\":$warm,$fields,\"kv_type\":\"$KV_TYPE\",\"prefill_chunk\":$chunk_json,\"host_mem\":$host_json,\"peak_rss_kb\":$(peak_kb "$CACHE/time-moec.log")"
    log "$model $prompt+$gen x$batch moec: $fields"
  else
    record moec false "\"log\":\"$out.err\""
    log "$model $prompt+$gen x$batch: moec run failed (see $out.err)"
  fi
}

for entry in $MODELS; do
  model=${entry%%:*}
  mix=${entry#*:}
  file=$CACHE/$model-$mix.gguf
  ensure_file "$model" "$mix" "$file"
  [ "$SYNTH_ONLY" = 1 ] && continue
  positions=$(awk -F'[:,]' '/^ *max_positions:/ {gsub(/ /, "", $2); print $2; exit}' "$REPO/models/$model.ron")
  points=$POINTS
  [ "$LONG" = "$model" ] && points="$points 32768:16:1"
  for point in $points; do
    IFS=: read -r prompt gen batch <<< "$point"
    cut=false
    if [ $((prompt + gen)) -gt "$positions" ]; then
      prompt=$((positions - gen))
      cut=true
      log "$model holds $positions positions: prompt $point cut to $prompt"
    fi
    [ "$have_llama" = 1 ] && run_llama
    listed moec "$ENGINES" && run_moec
  done
  if [ "$DELETE" = 1 ]; then
    rm -f "$file"
  fi
done
[ "$SYNTH_ONLY" = 1 ] || table "$TAG"
log "results appended to $RESULTS (tag $TAG)"
