#!/usr/bin/env bash
# A real-GPU check of gpt-oss's MXFP4 experts kept packed (issue 29): a Hub-style gpt-oss
# folder with MXFP4 experts (`moec synth --model gpt-oss-tiny --mxfp4`, repacked at load
# into out-in ggml MXFP4 rows) through a few schedules with `--backend cuda` against
# `--backend cpu` on the same machine, under both quantised products (`int8`, the default:
# activations rounded through Q8_0 on both backends; `decoded`: f32 activations). Prints
# one line per run pair (token ids equal or not) and exits 1 when any pair differs.
#
#   scripts/gpu_check_gpt_oss_mxfp4.sh path/to/moec
#
# Needs only the binary and python3 (to read the JSON reports); about a minute on a GPU.
set -euo pipefail
moec=$(realpath "${1:?usage: gpu_check_gpt_oss_mxfp4.sh path/to/moec}")
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
"$moec" synth --model gpt-oss-tiny --mxfp4 --out "$work/gpt-oss-tiny-mxfp4" > /dev/null
tokens() { python3 -c 'import json,sys; print([o["token_ids"] for o in json.load(sys.stdin)["outputs"]])'; }
status=0
for product in int8 decoded; do
  for sched in baselines/gpu_resident cgopipe fiddler flexgen; do
    args=(run "schedules/$sched.sched" --weights "$work/gpt-oss-tiny-mxfp4" --hw t4 --json
          --gen-len 8 --prompt "The capital of France is" --prompt "Mixture of experts")
    cpu=$(MOEC_QUANT_PRODUCT=$product timeout 120 "$moec" "${args[@]}" | tokens)
    gpu=$(MOEC_QUANT_PRODUCT=$product timeout 120 "$moec" "${args[@]}" --backend cuda | tokens)
    if [ "$cpu" = "$gpu" ]; then same=equal; else same=DIFFER; status=1; fi
    printf '%-8s %-24s cuda vs cpu tokens %s  %s\n' "$product" "$sched" "$same" "$gpu"
  done
done
exit $status
