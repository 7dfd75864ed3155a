#!/usr/bin/env bash
# This machine as a held-out row (issue 17, item 5): every schedule in schedules/ that runs
# on the mid card on the CPU backend, at batch 1, 16 and 64, prefill and decode, measured
# against the HRM replay of the same steps; prints one Markdown table (docs/reproduce.md).
#
# What it does: builds moec in release, probes this machine once (`moec probe`: streaming
# bandwidth, memcpy, GEMM, moec's own kernels by op kind and rows, the runtime's dispatch
# costs; micro-benchmarks only, nothing fitted to a run) into $OUT/this-machine.ron, then
# runs every (schedule, batch) N times (`--runs`, default 3) with
# `moec run --hw $OUT/this-machine.ron --json`: B synthetic prompts of 16 tokens, G
# generated (`--gen`, default 8: 7 decode steps per run), greedy, 2 threads, the synthetic
# mixtral-mid checkpoint (generated into the cache on first use). A schedule with
# micro-batches runs two of B/2 (one of 1 at batch 1; FlexGen needs two, so at batch 1 its
# second is empty); resident, Fiddler and MoE-Infinity run one of B. In each run the
# decode step is the mean of the run's decode steps, prefill its one prefill step (VSLPipe
# has no prefill step: its prefill column is the mean of its mixed steps, the run's `step`
# kind, prompts and decodes together). A cell shows the median over its N runs of the
# measured ms, the predicted ms and the measured / predicted ratio (each median taken on
# its own), and the range of the N ratios: a single batch-1 run moves by ~15% from one run
# to the next. Raw JSON goes to $OUT/<schedule>-<batch>-<run>.json; the probed profile to
# $OUT/this-machine.ron. Before each run the checkpoint is read once into the page cache
# (see `warm` below).
#
# Usage: scripts/replay-table.sh [--batches "1 16 64"] [--schedules "cgopipe ..."]
#            [--runs 3] [--gen 8] [--threads 2] [--out DIR] [--no-build]
# Environment: QUIET=/work/quiet.sh (or any wrapper) runs the probe and each `moec run`
# through it.
set -euo pipefail
# Each point's HRM replay on its own quick probe of the machine as it is now, never on
# one an earlier run kept (docs/cost-model.md, "The quick probe, kept for the runs that
# follow").
export MOEC_PROBE_MAX_AGE=0

REPO=$(cd "$(dirname "$0")/.." && pwd)
BATCHES="1 16 64"
THREADS=2
RUNS=3
GEN=8
OUT=${TMPDIR:-/tmp}/moec-replay-table
BUILD=1
SCHEDULES="baselines/resident baselines/sequential cgopipe baselines/moe_lightning_s2 flexgen baselines/flexgen_cpu_attn klotski vslpipe fiddler moe_infinity"

while [ $# -gt 0 ]; do
    case "$1" in
        --batches) BATCHES=$2; shift 2 ;;
        --schedules) SCHEDULES=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --runs) RUNS=$2; shift 2 ;;
        --gen) GEN=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        *) echo "replay-table.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

case "$RUNS$GEN" in *[!0-9]*) echo "replay-table.sh: --runs and --gen take whole numbers" >&2; exit 2 ;; esac
[ "$RUNS" -ge 1 ] && [ "$GEN" -ge 2 ] || { echo "replay-table.sh: needs --runs >= 1 and --gen >= 2 (a decode step)" >&2; exit 2; }
command -v jq >/dev/null || { echo "replay-table.sh: needs jq" >&2; exit 1; }
cd "$REPO"
if [ "$BUILD" = 1 ]; then
    cargo build --release --bin moec >&2
fi
MOEC="$REPO/target/release/moec"
mkdir -p "$OUT"
PROFILE="$OUT/this-machine.ron"
${QUIET:-} "$MOEC" probe --threads "$THREADS" --size-mib 256 --out "$PROFILE" >&2

# The checkpoint's folder (one untimed run generates it on first use; its JSON names the
# tokenizer beside the weights). Each timed run starts with the weights in the page cache:
# the profile models weights in DRAM, and an OS that pages out cold file pages between runs
# (this machine runs a DAMON `pageout` kdamond) would otherwise make a run's first step read
# them back from disk, a level no profile holds.
"$MOEC" run schedules/cgopipe.sched --model mixtral-mid --gen-len 2 --prompt warm-up \
    --hw "$PROFILE" --json > "$OUT/warm-up.json"
CHECKPOINT=$(python3 -c 'import json, os, sys; print(os.path.dirname(json.load(open(sys.argv[1]))["tokenizer"]))' "$OUT/warm-up.json")
warm() {
    cat "$CHECKPOINT"/*.safetensors > /dev/null
}

# The schedule params for batch $2: two micro-batches of half the batch, one at batch 1.
params() {
    local s=$1 b=$2 half=$(( $2 / 2 )) n=2
    if [ "$b" -lt 2 ]; then half=1; n=1; fi
    case "$s" in
        baselines/resident) echo "--set ubs=$b --set n_ub=1" ;;
        fiddler) echo "--set ubs=$b --set n_ub=1" ;;
        moe_infinity) echo "--set bs=$b" ;;
        vslpipe) echo "--set seqs=$half" ;;
        flexgen|baselines/flexgen_cpu_attn) echo "--set bs=$half --set n_batch=2" ;;
        klotski) echo "--set bs=$half --set n_batch=$n" ;;
        *) echo "--set ubs=$half --set n_ub=$n" ;;
    esac
}


# One run's four figures (decode measured, predicted; prefill measured, predicted; in
# seconds per step), tab-separated, "-" where the run has no such step.
figures() {
    local kind=prefill
    if [ "$1" = vslpipe ]; then kind=step; fi
    jq -r --arg kind "$kind" '
        (.predicted.steps_by_kind // [] | map(select(.kind == $kind)) | first) as $p
        | [.predicted.decode_step_measured_seconds, .predicted.decode_step_seconds,
           (if $p then $p.measured_seconds / $p.steps else null end),
           (if $p then $p.predicted_seconds / $p.steps else null end)]
        | map(if . == null then "-" else tostring end) | @tsv' "$2"
}

# Medians over the runs' figure lines on stdin: "measured / predicted (ms) | ratio |
# ratio range" for decode, then for prefill (a median of an even count is the mean of
# the middle two).
cells() {
    awk -F '\t' '
        function median(a, n,    i, j, t) {
            for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
            return n % 2 ? a[(n+1)/2] : (a[n/2] + a[n/2+1]) / 2
        }
        { for (c = 0; c < 2; c++) if ($(2*c+1) != "-" && $(2*c+2) != "-" && $(2*c+2) > 0) {
              n[c]++; m[c, n[c]] = $(2*c+1); p[c, n[c]] = $(2*c+2); r[c, n[c]] = $(2*c+1) / $(2*c+2) } }
        END {
            out = ""
            for (c = 0; c < 2; c++) {
                if (!n[c]) { out = out " - | - | - |"; continue }
                delete a; for (i = 1; i <= n[c]; i++) a[i] = m[c, i]; mm = median(a, n[c])
                delete a; for (i = 1; i <= n[c]; i++) a[i] = p[c, i]; pm = median(a, n[c])
                delete a; for (i = 1; i <= n[c]; i++) a[i] = r[c, i]; rm = median(a, n[c])
                out = out sprintf(" %.1f / %.1f | %.2f | %.2f-%.2f |", mm * 1000, pm * 1000, rm, a[1], a[n[c]])
            }
            print out
        }'
}

echo "Median of $RUNS runs per cell ($GEN generated tokens each); ratio = measured / predicted, range = the runs' lowest and highest ratio."
echo
echo "| schedule | batch | params | decode step measured / predicted (ms) | ratio | range | prefill measured / predicted (ms) | ratio | range |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for s in $SCHEDULES; do
    for b in $BATCHES; do
        shown=$(params "$s" "$b" | sed 's/--set //g')
        lines=""
        failure=""
        for run in $(seq 1 "$RUNS"); do
            json="$OUT/$(echo "$s" | tr / _)-$b-$run.json"
            warm
            # shellcheck disable=SC2046
            if ! ${QUIET:-} "$MOEC" run "schedules/$s.sched" --model mixtral-mid \
                --workload "count=$b,mean=16,max=16,gen=$GEN" $(params "$s" "$b") \
                --threads "$THREADS" --hw "$PROFILE" --json > "$json" 2> "$json.err"; then
                failure=$(head -c 120 "$json.err" | tr '\n' ' ')
                break
            fi
            lines="$lines$(figures "$s" "$json")"$'\n'
        done
        if [ -n "$failure" ]; then
            echo "| $s | $b | $shown | failed: $failure | | | | | |"
            continue
        fi
        echo "| $s | $b | $shown |$(printf '%s' "$lines" | cells)"
    done
done
