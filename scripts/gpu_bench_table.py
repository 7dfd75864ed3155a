#!/usr/bin/env python3
"""The one table scripts/gpu-bench.sh prints from what it wrote.

Takes the output folder (tokens.jsonl, runs.jsonl, hf.jsonl, devices.txt) and the seconds
the script took; prints: the token comparison (CUDA against CPU per family and schedule),
tokens/s per run beside Hugging Face transformers on the same GPU with the ratios the issue
asks for, the decode step measured against the HRM replay, and the decode step's largest
ops of the GPU-resident baseline (measured and predicted), which is where time goes.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict


def lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def generation_tps(report: dict) -> float | None:
    """Tokens/s over prefill and decode, without the `setup` step (the weights' first copy
    onto the GPU, what model loading is to transformers, whose timing leaves it out too)."""
    pred = report.get("predicted") or {}
    total = pred.get("run_measured_seconds")
    if not total:
        return None
    setup = sum(k["measured_seconds"] for k in pred.get("steps_by_kind", [])
                if k["kind"] == "setup")
    return report["stats"]["generated_tokens"] / max(total - setup, 1e-9)


def decode_kind(pred: dict) -> dict | None:
    for k in pred.get("steps_by_kind", []):
        if k["kind"] == pred.get("decode_step_which", "decode"):
            return k
    return None


def main() -> int:
    out, seconds = sys.argv[1], sys.argv[2]
    dev = open(os.path.join(out, "devices.txt")).read().splitlines()
    print(f"gpu-bench: {dev[0] if dev else '?'}; {dev[1] if len(dev) > 1 else ''}; {seconds} s")

    tokens = lines(os.path.join(out, "tokens.jsonl"))
    if tokens:
        verdicts = defaultdict(int)
        for t in tokens:
            verdicts[t["verdict"]] += 1
        print("\n(a) tokens, --backend cuda against --backend cpu (tiny cards and GGUF files, 4 "
              "prompts, 8 new):")
        print("    " + ", ".join(f"{v}: {n}" for v, n in sorted(verdicts.items())))
        by_family = defaultdict(lambda: defaultdict(int))
        for t in tokens:
            by_family[t["family"]][t["verdict"]] += 1
        for fam, v in by_family.items():
            print(f"    {fam:12} " + ", ".join(f"{k} {n}" for k, n in sorted(v.items())))
        for t in tokens:
            if t["verdict"] != "same":
                why = (t["cuda_stderr"] or t["cpu_stderr"]).strip().splitlines()
                print(f"    {t['family']:12} {t['schedule']:18} {t['verdict']}: "
                      f"{why[-1][:150] if why else ''}")

    for name in ("quantize.txt", "quant-tokens.txt"):
        path = os.path.join(out, name)
        if os.path.exists(path):
            print(f"\n{name}:")
            for line in open(path).read().splitlines()[-6:]:
                print("    " + line)

    runs = lines(os.path.join(out, "runs.jsonl"))
    hf = lines(os.path.join(out, "hf.jsonl"))
    # HF's figure per placement and batch is the best of the configurations it ran
    # (experts and attention implementations, compiled or not), so no ratio rests on a weak one.
    hf_tps = {}
    for h in hf:
        if h.get("failed") or h.get("error") or h.get("tokens_per_s") is None:
            continue
        key = (h.get("system"), h.get("batch"))
        hf_tps[key] = max(hf_tps.get(key, 0.0), h["tokens_per_s"])
    if runs:
        print("\n(b) mixtral-mid, prompt 64, gen 32, tokens/s (decode step ms measured/predicted "
              "= ratio; params the planner picked):")
        print("    tok/s: over the whole run; gen tok/s: without the setup step (weights' first "
              "copy to the GPU), as HF's timing leaves out loading")
        print(f"    {'schedule':14} {'gpu':6} {'batch':>5} {'tok/s':>8} {'gen tok/s':>9} "
              f"{'decode ms':>10} {'pred ms':>8} {'ratio':>6}  params / error")
        for r in runs:
            rep = r.get("report")
            cap = "all" if r["cap"] == "-" else r["cap"]
            if r["exit"] != 0 or not rep:
                err = r["stderr"].strip().splitlines()
                why = next((e for e in err if e.startswith("error")), err[-1] if err else "")
                print(f"    {r['name']:14} {cap:6} {r['batch']:5} {'exit ' + str(r['exit']):>8}"
                      f" {'':>9} {'':>10} {'':>8} {'':>6}  {why[:140]}")
                continue
            pred = rep.get("predicted") or {}
            meas = pred.get("decode_step_measured_seconds")
            p = pred.get("decode_step_seconds")
            ratio = f"{meas / p:6.2f}" if meas and p else "     ?"
            fitted = rep.get("fitted_params") or {}
            params = " ".join(f"{k}={v}" for k, v in fitted.items())
            print(f"    {r['name']:14} {cap:6} {r['batch']:5} "
                  f"{rep['stats']['tokens_per_s']:8.1f} {generation_tps(rep) or 0:9.1f} "
                  f"{(meas or 0) * 1e3:10.2f} "
                  f"{(p or 0) * 1e3:8.2f} {ratio}  {params[:80]}")
        for h in hf:
            if h.get("error"):
                print(f"    {h['system']:14} {'':6} {'':5} {'error':>8} {'':9} {'':10} {'':8} "
                      f"{'':6}  {h.get('config', '')}: {h['error'][:100]}")
            elif h.get("failed"):
                print(f"    {h['system']:14} {'':6} {h['batch']:5} {'failed':>8}")
            else:
                cap = "600MiB" if h["system"] == "hf-offload" else "all"
                impl = (f"experts {h.get('experts_implementation')}, attention "
                        f"{h.get('attn_implementation')}") if h.get("experts_implementation") else ""
                if h.get("config") not in (None, "default"):
                    impl = f"config {h['config']}" + (f" ({impl})" if impl else "")
                print(f"    {h['system']:14} {cap:6} {h['batch']:5} {'':8} "
                      f"{h['tokens_per_s']:9.1f} {'':10} {'':8} {'':6}  {impl}")

        print("\n    ratios of gen tok/s, HF at its best configuration (issue 44's acceptance: "
              "gpu_resident >= 3x HF at 1, 16 and 64):")
        ok = [r for r in runs if r["exit"] == 0 and r.get("report")]
        for b in sorted({r["batch"] for r in runs}):
            res = [generation_tps(r["report"]) for r in ok
                   if r["name"] == "gpu_resident" and r["batch"] == b]
            capped = [(generation_tps(r["report"]), r["name"]) for r in ok
                      if r["cap"] != "-" and r["batch"] == b]
            line = f"    batch {b:3}:"
            if res and hf_tps.get(("hf", b)):
                line += f" gpu_resident/HF = {res[0] / hf_tps[('hf', b)]:.2f}x;"
            if capped and hf_tps.get(("hf-offload", b)):
                best = max(capped)
                line += (f" best capped ({best[1]}) / HF offload = "
                         f"{best[0] / hf_tps[('hf-offload', b)]:.2f}x")
            print(line)

        for b in sorted({r["batch"] for r in ok if r["name"] == "gpu_resident_q4k"}):
            tps = {r["name"]: generation_tps(r["report"]) for r in ok if r["batch"] == b}
            if tps.get("gpu_resident_q4k") and tps.get("gpu_resident"):
                print(f"    batch {b:3}: gpu_resident quantised / bf16 = "
                      f"{tps['gpu_resident_q4k'] / tps['gpu_resident']:.2f}x")

        print("\n    gpu_resident decode step by op (ms per step, measured / predicted):")
        for r in ok:
            if not r["name"].startswith("gpu_resident"):
                continue
            k = decode_kind(r["report"]["predicted"])
            if not k:
                continue
            steps = max(k.get("steps", 1), 1)
            ops = sorted(k["ops"], key=lambda o: -o["measured_seconds"])[:6]
            cells = ", ".join(
                f"{o['op']} {o['measured_seconds'] / steps * 1e3:.2f}/"
                f"{o['predicted_seconds'] / steps * 1e3:.2f}" for o in ops)
            print(f"    {r['name']:16} batch {r['batch']:3}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
