#!/usr/bin/env python3
"""Write the peer benchmark's checkpoint: the mid Mixtral shape, saved by Hugging Face
transformers (scripts/peer-bench.sh runs this; see docs/performance.md).

What it takes: an output folder and the repository's Mixtral tokenizer.json; the packages
pinned in scripts/peer-bench.sh (torch, transformers, safetensors).

What it gives, in the output folder: config.json, generation_config.json, bf16 safetensors
and the tokenizer files, all written by `save_pretrained`, i.e. the Hub layout that
llama.cpp's convert_hf_to_gguf.py, transformers' from_pretrained and moec's `--weights`
all read. The shape is models/mixtral-mid.ron's (d 1024, ffn 3584, 8 layers, 16/4 heads
of 64, 8 experts top-2, vocab 32000, rope theta 1e6).

What it guarantees: the same weights for the same seed (torch.manual_seed before the
model is built; transformers' default init, std 0.02). The values are random: the
benchmark measures speed, so all that matters is that the three systems read the same
bytes. A folder that already holds a finished checkpoint (a `.complete` marker written
last) is left alone, so reruns are fast.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument("--tokenizer", required=True, help="the repository's tokenizer.json")
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args()

    marker = os.path.join(args.out, ".complete")
    if os.path.exists(marker):
        print(f"checkpoint: {args.out} (cached)")
        return 0
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    config = MixtralConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)

    # The tokenizer goes through transformers too, so tokenizer_config.json (which the
    # GGUF converter reads for the special tokens) is written beside tokenizer.json.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=args.tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.save_pretrained(args.out)

    params = sum(p.numel() for p in model.parameters())
    with open(marker, "w") as f:
        json.dump({"seed": args.seed, "parameters": params}, f)
    print(f"checkpoint: {args.out} ({params / 1e9:.2f} B parameters, bf16, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
