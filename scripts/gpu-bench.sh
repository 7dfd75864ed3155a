#!/usr/bin/env bash
# One command for a GPU machine (H100/H200): tokens/s of moec's CUDA backend on a synthetic
# mixtral-mid checkpoint, for the GPU-resident baseline and the offload schedules, plus the
# stand-in-free facts (`moec devices`). No network, no Rust: it takes a release binary.
#
#   scripts/gpu-bench.sh path/to/moec [OUT_DIR]
#
# Writes OUT_DIR (default: $OUT, else ./gpu-bench-out) /devices.txt, /runs.jsonl (one
# `moec run --json` object per line, with the schedule, batch and exit status) and
# /summary.txt (schedule, batch, tokens/s). Each run is bounded by `timeout`; the whole
# script is meant to finish in under 6 minutes on an H100 or H200 (debug builds will not).
# The .sched files are read from the repository this script sits in.
set -u
moec=${1:?usage: gpu-bench.sh path/to/moec [OUT_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-${OUT:-$PWD/gpu-bench-out}}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
per_run=${GPU_BENCH_RUN_TIMEOUT:-40}
# A smaller card and fewer batches for a dry run of the script itself (e.g. under the
# stand-in driver: GPU_BENCH_MODEL=mixtral-tiny GPU_BENCH_BATCHES=1).
model=${GPU_BENCH_MODEL:-mixtral-mid}
batches=${GPU_BENCH_BATCHES:-1 16 64}
n_gpu=${GPU_BENCH_N_GPU:-64}

"$moec" devices > "$out/devices.txt" 2>&1
echo "moec devices: exit $?" >> "$out/devices.txt"

# Synthetic weights in seconds (1.47 GiB bf16), read by the runs below.
"$moec" synth --model "$model" --out "$work/mid" > "$out/synth.txt" 2>&1 || {
    echo "moec synth failed: see $out/synth.txt" >&2
    exit 1
}

: > "$out/runs.jsonl"
: > "$out/summary.txt"
# run NAME SCHED BATCH [--set ...]: BATCH prompts of the workload, 32 new tokens each.
run() {
    local name=$1 sched=$2 batch=$3
    shift 3
    local json
    json=$(timeout "$per_run" "$moec" run "$root/$sched" --weights "$work/mid" \
        --backend cuda --json --gen-len 32 \
        --workload "count=$batch,mean=64,max=64,min=64,gen=32,seed=1" "$@" 2> "$work/err")
    local rc=$?
    local tps
    tps=$(printf '%s' "$json" | python3 -c 'import json,sys
try:
    d = json.load(sys.stdin)
    print(d["stats"]["tokens_per_s"])
except Exception:
    print("?")' 2> /dev/null)
    python3 -c 'import json,sys
print(json.dumps({"name": sys.argv[1], "batch": int(sys.argv[2]), "exit": int(sys.argv[3]),
                  "stderr": open(sys.argv[4]).read()[-2000:], "report": sys.argv[5]}))' \
        "$name" "$batch" "$rc" "$work/err" "$json" >> "$out/runs.jsonl"
    printf '%-14s batch %3s  exit %3s  tokens/s %s\n' "$name" "$batch" "$rc" "$tps" \
        | tee -a "$out/summary.txt"
}

for b in $batches; do
    run gpu_resident schedules/baselines/gpu_resident.sched "$b" --set "ubs=$b"
    run fiddler_all schedules/fiddler.sched "$b" --set "n_gpu=$n_gpu" --set "ubs=$b"
done
run cgopipe schedules/cgopipe.sched 16 --set ubs=4 --set n_ub=4 --gpu-mem 600MB
run vslpipe schedules/vslpipe.sched 16 --set seqs=16 --set tok_pct=50 --gpu-mem 600MB
echo "results in $out"
