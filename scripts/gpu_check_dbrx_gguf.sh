#!/usr/bin/env bash
# A real-GPU check of DBRX GGUFs (issue 29): the tiny DBRX of
# tests/fixtures/gguf/dbrx-q4-tiny.ron (`moec synth`) written as llama.cpp's Q4_K_M by
# `moec quantize --mix q4_k_m` (byte for byte what convert_hf_to_gguf.py + llama-quantize
# write, `cargo test --test cli_generate quantize_writes_every_family`: Q8_0 fused attn_qkv,
# Q5_K attn_output, Q4_K/Q6_K experts whose down projections are out-in), through a few
# schedules with `--backend cuda` against `--backend cpu` on the same machine. Prints one
# line per schedule (token ids equal or not) and exits 1 when any pair differs.
#
#   scripts/gpu_check_dbrx_gguf.sh path/to/moec
#
# Needs only the binary and python3 (to read the JSON reports); about a minute on a GPU.
set -euo pipefail
moec=$(realpath "${1:?usage: gpu_check_dbrx_gguf.sh path/to/moec}")
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"
"$moec" synth --model tests/fixtures/gguf/dbrx-q4-tiny.ron --out "$work/dbrx-hf" > /dev/null
"$moec" quantize --weights "$work/dbrx-hf" --out "$work/dbrx-Q4_K_M.gguf" --mix q4_k_m > /dev/null
tokens() { python3 -c 'import json,sys; print([o["token_ids"] for o in json.load(sys.stdin)["outputs"]])'; }
status=0
for sched in baselines/gpu_resident cgopipe fiddler flexgen; do
  args=(run "schedules/$sched.sched" --weights "$work/dbrx-Q4_K_M.gguf" --hw t4 --json
        --gen-len 8 --prompt "The capital of France is" --prompt "Mixture of experts")
  cpu=$(timeout 120 "$moec" "${args[@]}" | tokens)
  gpu=$(timeout 120 "$moec" "${args[@]}" --backend cuda | tokens)
  if [ "$cpu" = "$gpu" ]; then same=equal; else same=DIFFER; status=1; fi
  printf '%-24s cuda vs cpu tokens %s  %s\n' "$sched" "$same" "$gpu"
done
exit $status
