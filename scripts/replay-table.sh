#!/usr/bin/env bash
# This machine as a held-out row (issue 17, item 5): every schedule in schedules/ that runs
# on the mid card on the CPU backend, at batch 1, 16 and 64, prefill and decode, measured
# against the HRM replay of the same steps; prints one Markdown table (docs/reproduce.md).
#
# What it does: builds moec in release, probes this machine once (`moec probe`: streaming
# bandwidth, memcpy, GEMM, moec's own kernels by op kind and rows, the runtime's dispatch
# costs; micro-benchmarks only, nothing fitted to a run) into $OUT/this-machine.ron, then
# runs every (schedule, batch) once with `moec run --hw $OUT/this-machine.ron --json`:
# B synthetic prompts of 16 tokens, 4 generated, greedy, 2 threads, the synthetic
# mixtral-mid checkpoint (generated into the cache on first use). A schedule with
# micro-batches runs two of B/2 (one of 1 at batch 1; FlexGen needs two, so at batch 1 its
# second is empty); resident, Fiddler and MoE-Infinity run one of B. Each cell is one run:
# the decode step is the mean of the run's decode steps, prefill its one prefill step
# (VSLPipe has no prefill step: its prefill column is the mean of its mixed steps, the
# run's `step` kind, prompts and decodes together). Raw JSON goes to
# $OUT/<schedule>-<batch>.json; the probed profile to $OUT/this-machine.ron.
#
# Usage: scripts/replay-table.sh [--batches "1 16 64"] [--schedules "cgopipe ..."]
#            [--threads 2] [--out DIR] [--no-build]
# Environment: QUIET=/work/quiet.sh (or any wrapper) runs each `moec run` through it.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BATCHES="1 16 64"
THREADS=2
OUT=${TMPDIR:-/tmp}/moec-replay-table
BUILD=1
SCHEDULES="baselines/resident baselines/sequential cgopipe baselines/moe_lightning_s2 flexgen baselines/flexgen_cpu_attn klotski vslpipe fiddler moe_infinity"

while [ $# -gt 0 ]; do
    case "$1" in
        --batches) BATCHES=$2; shift 2 ;;
        --schedules) SCHEDULES=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        *) echo "replay-table.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

command -v jq >/dev/null || { echo "replay-table.sh: needs jq" >&2; exit 1; }
cd "$REPO"
if [ "$BUILD" = 1 ]; then
    cargo build --release --bin moec >&2
fi
MOEC="$REPO/target/release/moec"
mkdir -p "$OUT"
PROFILE="$OUT/this-machine.ron"
${QUIET:-} "$MOEC" probe --threads "$THREADS" --size-mib 256 --out "$PROFILE" >&2

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

ms() { jq -r "$1 // empty | . * 1000 | (. * 10 | round) / 10" "$2"; }
ratio() { jq -r "if ($1 // 0) > 0 and ($2 // 0) > 0 then ($1 / $2 * 100 | round) / 100 else \"-\" end" "$3"; }

echo "| schedule | batch | params | decode step measured / predicted (ms) | ratio | prefill measured / predicted (ms) | ratio |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for s in $SCHEDULES; do
    for b in $BATCHES; do
        json="$OUT/$(echo "$s" | tr / _)-$b.json"
        # shellcheck disable=SC2046
        if ! ${QUIET:-} "$MOEC" run "schedules/$s.sched" --model mixtral-mid \
            --workload "count=$b,mean=16,max=16,gen=4" $(params "$s" "$b") \
            --threads "$THREADS" --hw "$PROFILE" --json > "$json" 2> "$json.err"; then
            echo "| $s | $b | $(params "$s" "$b" | sed 's/--set //g') | failed: $(head -c 120 "$json.err" | tr '\n' ' ') | | | |"
            continue
        fi
        dm=$(ms '.predicted.decode_step_measured_seconds' "$json")
        dp=$(ms '.predicted.decode_step_seconds' "$json")
        dr=$(ratio '.predicted.decode_step_measured_seconds' '.predicted.decode_step_seconds' "$json")
        kind=prefill
        if [ "$s" = vslpipe ]; then kind=step; fi
        sel="(.predicted.steps_by_kind // [] | map(select(.kind == \"$kind\")) | first)"
        pm=$(ms "($sel | .measured_seconds / .steps)" "$json")
        pp=$(ms "($sel | .predicted_seconds / .steps)" "$json")
        pr=$(ratio "$sel.measured_seconds" "$sel.predicted_seconds" "$json")
        echo "| $s | $b | $(params "$s" "$b" | sed 's/--set //g') | $dm / $dp | $dr | $pm / $pp | $pr |"
    done
done
