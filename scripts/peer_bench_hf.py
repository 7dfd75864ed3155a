#!/usr/bin/env python3
"""Hugging Face transformers' side of the peer benchmark (scripts/peer-bench.sh runs it).

What it takes: the checkpoint folder, a batch size, prompt and generation lengths, a
thread count.

What it gives: one JSON line on stdout, {"system", "batch", "generated_tokens",
"seconds", "tokens_per_s"}: B random prompts of exactly `--prompt-len` token ids (seeded),
generated greedily to exactly `--gen-len` new tokens each (`min_new_tokens` keeps an
early end-of-sequence from shortening the run), with the model in bf16 as
`from_pretrained` loads it. `seconds` is the wall time of the one `generate` call
(prefill plus decode), measured after a short warm-up generate so that one-time
initialisation is not charged; generation throughput = B x gen_len / seconds, the
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
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model.eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(args.seed)
    # Ids 3.. skip <unk>, <s>, </s>; every prompt has the same length, so no padding.
    ids = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=generator)
    mask = torch.ones_like(ids)
    options = dict(do_sample=False, pad_token_id=model.config.eos_token_id)

    with torch.inference_mode():
        model.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, **options)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.gen_len,
            min_new_tokens=args.gen_len,
            **options,
        )
        seconds = time.perf_counter() - start
    generated = int(out.shape[0]) * (int(out.shape[1]) - args.prompt_len)
    print(
        json.dumps(
            {
                "system": "hf",
                "batch": args.batch,
                "generated_tokens": generated,
                "seconds": seconds,
                "tokens_per_s": generated / seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
