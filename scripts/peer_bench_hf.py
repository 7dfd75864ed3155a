#!/usr/bin/env python3
"""Hugging Face transformers' side of the peer benchmark (scripts/peer-bench.sh runs it).

What it takes: the checkpoint folder, a batch size, prompt and generation lengths, a
thread count; `--device cuda` (and `--max-gpu-mem`) for the GPU side
(scripts/gpu-bench.sh).

What it gives: one JSON line on stdout, {"system", "batch", "generated_tokens",
"seconds", "tokens_per_s"}: B random prompts of exactly `--prompt-len` token ids (seeded),
generated greedily to exactly `--gen-len` new tokens each (`min_new_tokens` keeps an
early end-of-sequence from shortening the run), with the model in bf16 as
`from_pretrained` loads it. `seconds` is the wall time of the one `generate` call
(prefill plus decode), measured after a warm-up generate (on a GPU of the same batch and
prompts and length) so that one-time initialisation is not charged; generation throughput = B x gen_len / seconds, the
definition every column of the peer table uses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--batch",
        required=True,
        help="sequences per generate call; a comma list (1,16,64) runs each in turn on the "
        "one loaded model, a line each",
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: the whole model on the GPU (eager, bf16)",
    )
    parser.add_argument(
        "--max-gpu-mem",
        default=None,
        help="with --device cuda: accelerate's device_map='auto' offload with at most this "
        "much on GPU 0 (e.g. 600MiB), the rest in CPU memory",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="with --device cuda: a comma list of EXPERTS/ATTENTION[/compile] configurations "
        "run in turn on the one loaded model (e.g. grouped_mm/sdpa,batched_mm/sdpa/compile), "
        "a line each per batch; 'all' runs eager, grouped_mm and batched_mm experts with sdpa "
        "and eager attention, then the best-known compiled one. Default: the model's own.",
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    placement = {}
    system = "hf"
    if args.device == "cuda" and args.max_gpu_mem:
        placement = dict(device_map="auto", max_memory={0: args.max_gpu_mem, "cpu": "100GiB"})
        system = "hf-offload"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, **placement)
    if args.device == "cuda" and not args.max_gpu_mem:
        # Moved whole rather than with a device_map, so no accelerate hooks run per module.
        model = model.to("cuda")
    model.eval()
    # The inputs go where the first layers are (accelerate moves them on from there).
    first = "cuda" if args.device == "cuda" else "cpu"

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    vocab = model.config.vocab_size
    options = dict(do_sample=False, pad_token_id=model.config.eos_token_id)
    configs = [None]
    if args.configs == "all":
        configs = [
            f"{e}/{a}" for e in ("eager", "grouped_mm", "batched_mm") for a in ("sdpa", "eager")
        ] + ["batched_mm/sdpa/compile"]
    elif args.configs:
        configs = args.configs.split(",")
    forward = model.forward
    for config in configs:
        label = config or "default"
        if config:
            parts = config.split("/")
            try:
                model.set_experts_implementation(parts[0])
                model.set_attn_implementation(parts[1])
            except Exception as e:  # a configuration this transformers lacks: said, skipped
                print(json.dumps({"system": system, "config": label, "error": str(e)}), flush=True)
                continue
            model.forward = forward
            if len(parts) > 2 and parts[2] == "compile":
                model.forward = torch.compile(forward)
        try:
            run_batches(args, model, system, label, vocab, options, first, sync)
        except Exception as e:
            print(json.dumps({"system": system, "config": label, "error": str(e)}), flush=True)
    return 0


def run_batches(args, model, system, label, vocab, options, first, sync) -> None:
    import torch

    for batch in [int(b) for b in str(args.batch).split(",")]:
        generator = torch.Generator().manual_seed(args.seed)
        # Ids 3.. skip <unk>, <s>, </s>; every prompt has the same length, so no padding.
        ids = torch.randint(3, vocab, (batch, args.prompt_len), generator=generator).to(first)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            # On a GPU the warm-up runs the timed call's shapes, so one-time set-up (lazy
            # kernel loading per shape, allocator growth) is not charged to it; on the CPU a
            # short one, as this script always did (peer-bench.sh's figures stay comparable).
            # On the GPU the warm-up generates as many tokens as the timed call, so a compiled
            # forward has met every cache length before the clock starts.
            warm = (ids, mask) if args.device == "cuda" else (ids[:1, :8], mask[:1, :8])
            warm_new = args.gen_len if args.device == "cuda" else 2
            model.generate(warm[0], attention_mask=warm[1], max_new_tokens=warm_new, **options)
            sync()
            start = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.gen_len,
                min_new_tokens=args.gen_len,
                **options,
            )
            sync()
            seconds = time.perf_counter() - start
        generated = int(out.shape[0]) * (int(out.shape[1]) - args.prompt_len)
        print(
            json.dumps(
                {
                    "system": system,
                    "config": label,
                    "batch": batch,
                    "generated_tokens": generated,
                    "seconds": seconds,
                    "tokens_per_s": generated / seconds,
                    "experts_implementation": getattr(
                        model.config, "_experts_implementation", None
                    ),
                    "attn_implementation": getattr(model.config, "_attn_implementation", None),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
