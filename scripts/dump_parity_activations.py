#!/usr/bin/env python3
"""Dump transformers' intermediate activations for one parity fixture prompt (bisecting aid).

What it takes: a fixture folder written by make_parity_fixtures.py (config.json,
model.safetensors, expected.json) and a case index. Same numerics as the fixture: bf16
weights widened to f32, f32 compute, eager attention.

What it gives: JSON on stdout with, for the prefill of that case's prompt, per layer:
the residual stream entering the layer, the attention output (after o_proj/out_proj, before
the residual add), the router logits, the selected experts and their renormalised weights,
the MoE output, and the residual stream leaving the layer; then the final-norm output and the
logits. Each is given for the positions asked for (default: the last prompt position), so a
mismatch in moec's oracle can be located to the first tensor that differs.

Run:  /work/pyenv/venv/bin/python scripts/dump_parity_activations.py tests/fixtures/parity/dbrx 0 [--positions all]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import DbrxForCausalLM, MixtralForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("fixture", type=Path)
    parser.add_argument("case", type=int)
    parser.add_argument("--positions", default="last", help="'last', 'all' or comma-separated indices")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(1)
    expected = json.loads((args.fixture / "expected.json").read_text())
    family = expected["family"]
    prompt = expected["cases"][args.case]["prompt_ids"]
    model_class = MixtralForCausalLM if family == "mixtral" else DbrxForCausalLM
    model = model_class.from_pretrained(
        args.fixture, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    if args.positions == "last":
        positions = [len(prompt) - 1]
    elif args.positions == "all":
        positions = list(range(len(prompt)))
    else:
        positions = [int(p) for p in args.positions.split(",")]

    records: dict[str, object] = {}

    def take(tensor: torch.Tensor) -> list:
        # [batch, seq, ...] or [seq, ...] (router logits are flattened over batch*seq).
        rows = tensor[0] if tensor.dim() == 3 else tensor
        return rows[positions].tolist()

    def keep(name: str, pick=lambda out: out):
        def hook(_module, inputs, output):
            records[name] = take(pick(output))

        return hook

    def keep_input(name: str):
        def hook(_module, inputs):
            records[name] = take(inputs[0])

        return hook

    handles = []
    if family == "mixtral":
        top_k = model.config.num_experts_per_tok
        layers = model.model.layers
        for idx, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(keep_input(f"layer{idx}.input")))
            handles.append(layer.self_attn.register_forward_hook(keep(f"layer{idx}.attn_out", lambda o: o[0])))
            handles.append(layer.mlp.gate.register_forward_hook(keep(f"layer{idx}.router_logits", lambda o: o[0])))
            handles.append(layer.mlp.register_forward_hook(keep(f"layer{idx}.moe_out")))
            handles.append(layer.register_forward_hook(keep(f"layer{idx}.output", lambda o: o[0] if isinstance(o, tuple) else o)))
        handles.append(model.model.norm.register_forward_hook(keep("final_norm")))
    else:
        top_k = model.config.ffn_config.moe_top_k
        layers = model.transformer.blocks
        for idx, block in enumerate(layers):
            attn = block.norm_attn_norm.attn
            handles.append(block.register_forward_pre_hook(keep_input(f"layer{idx}.input")))
            handles.append(attn.Wqkv.register_forward_hook(keep(f"layer{idx}.qkv_before_clip")))
            handles.append(attn.register_forward_hook(keep(f"layer{idx}.attn_out", lambda o: o[0])))
            handles.append(block.ffn.router.register_forward_hook(keep(f"layer{idx}.router_logits")))
            handles.append(block.ffn.register_forward_hook(keep(f"layer{idx}.moe_out")))
            handles.append(block.register_forward_hook(keep(f"layer{idx}.output", lambda o: o[0] if isinstance(o, tuple) else o)))
        handles.append(model.transformer.norm_f.register_forward_hook(keep("final_norm")))

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits
    for handle in handles:
        handle.remove()
    records["logits"] = logits[0, positions].tolist()

    # Routing decisions, recomputed from the recorded logits the way each model does it.
    for idx in range(len(layers)):
        router_logits = torch.tensor(records[f"layer{idx}.router_logits"])
        probs = torch.softmax(router_logits, dim=-1)
        weights, experts = torch.topk(probs, top_k, dim=-1)
        records[f"layer{idx}.experts"] = experts.tolist()
        records[f"layer{idx}.expert_weights"] = (weights / weights.sum(-1, keepdim=True)).tolist()

    json.dump({"family": family, "case": args.case, "positions": positions, "activations": records}, fp=sys.stdout)
    print()


if __name__ == "__main__":
    main()
