#!/usr/bin/env python3
"""The one table scripts/gpu-bench.sh prints from what it wrote.

Takes the output folder (tokens.jsonl, runs.jsonl, hf.jsonl, full.jsonl, devices.txt) and
the seconds the script took; prints: the token comparison (CUDA against CPU per family and
schedule), tokens/s per run beside Hugging Face transformers on the same GPU with the ratios
the issue asks for, the decode step measured against the HRM replay, the decode step's
largest ops of the GPU-resident baseline (measured and predicted), which is where time
goes, and the full-size section against llama.cpp's CUDA offload.

Two helpers of the full-size section, called by the script:
  --n-cpu-moe FILE.gguf CAP RESERVE_MIB   prints "N GB LAYERS": the fewest layers whose
      experts (blk.L.ffn_{gate,up,down}_exps) llama.cpp must keep on the CPU, from the first
      layer as --n-cpu-moe counts, for the rest of the file plus the reserve to fit CAP
      (e.g. 24GB); the GB left on the GPU; the MoE layers.
  --llama-rows OUTPUT MODEL CAP N         llama-batched-bench's table as full.jsonl rows.
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


def n_cpu_moe(path: str, cap: str, reserve_mib: int) -> str:
    """See the module doc: tensor sizes from the GGUF header (offsets apart)."""
    import re
    import struct

    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9,
             "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
    match = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]*)", cap)
    if not match or match.group(2).upper() not in units:
        raise SystemExit(f"--n-cpu-moe: cap {cap!r} is not a size like 24GB")
    cap_bytes = float(match.group(1)) * units[match.group(2).upper()]
    f = open(path, "rb")

    def u32() -> int:
        return struct.unpack("<I", f.read(4))[0]

    def u64() -> int:
        return struct.unpack("<Q", f.read(8))[0]

    def string() -> str:
        return f.read(u64()).decode("utf-8", "replace")

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(t: int) -> None:
        if t == 8:
            string()
        elif t == 9:
            et, n = u32(), u64()
            for _ in range(n):
                skip(et)
        else:
            f.read(sizes[t])

    if f.read(4) != b"GGUF":
        raise SystemExit(f"--n-cpu-moe: {path} is not a GGUF file")
    u32()
    n_tensors, n_kv = u64(), u64()
    align = 32
    for _ in range(n_kv):
        key, t = string(), u32()
        if key == "general.alignment" and t == 4:
            align = u32()
        else:
            skip(t)
    offsets = []
    for _ in range(n_tensors):
        name = string()
        for _ in range(u32()):
            u64()
        u32()
        offsets.append((u64(), name))
    data = (f.tell() + align - 1) // align * align
    end = f.seek(0, 2) - data
    offsets.sort()
    experts: dict[int, int] = {}
    total = 0
    for i, (off, name) in enumerate(offsets):
        size = (offsets[i + 1][0] if i + 1 < len(offsets) else end) - off
        total += size
        m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps", name)
        if m:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + size
    budget = cap_bytes - reserve_mib * 1024**2
    on_gpu, n = total, 0
    for layer in sorted(experts):
        if on_gpu <= budget:
            break
        on_gpu -= experts[layer]
        n += 1
    return f"{n} {on_gpu / 1e9:.2f} {len(experts)}"


def llama_rows(path: str, model: str, cap: str, ncmoe: str) -> list[dict]:
    """llama-batched-bench's table rows: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
    S_TG t/s | T s | S t/s |."""
    rows = []
    for line in open(path, errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0].isdigit() and cells[2].isdigit():
            try:
                rows.append({"name": f"{model}:llama.cpp", "batch": int(cells[2]), "cap": cap,
                             "n_cpu_moe": int(ncmoe), "decode_tok_s": float(cells[7]),
                             "prefill_tok_s": float(cells[5])})
            except ValueError:
                pass
    return rows


def full_size(out: str) -> None:
    """Section (e): each model's best moec schedule per cap and batch against llama.cpp."""
    rows = lines(os.path.join(out, "full.jsonl"))
    note = os.path.join(out, "full.txt")
    if not rows and not os.path.exists(note):
        return
    print("\n(e) full size, Q4_K_M synthesised on this machine, prompt 64, gen 32 (gen tok/s; "
          "issue 44: best schedule >= 1.0x llama.cpp at batch 1, >= 2x at 16 and 64, 24GB):")
    if os.path.exists(note):
        for line in open(note).read().splitlines():
            if line.startswith(("llama.cpp:", "full-size")) or "synthesised" in line \
                    or "--n-cpu-moe" in line or "failed" in line:
                print("    " + line[:160])
    best: dict[tuple, tuple] = {}
    llama: dict[tuple, float] = {}
    for r in rows:
        model, _, what = r["name"].partition(":")
        key = (model, r["cap"], r["batch"])
        if what == "llama.cpp":
            llama[key] = r["decode_tok_s"]
            continue
        rep = r.get("report")
        tps = generation_tps(rep) if r.get("exit") == 0 and rep else None
        if tps is None:
            err = r.get("stderr", "").strip().splitlines()
            why = "timed out" if r.get("exit") in (124, 137) else f"exit {r.get('exit')}"
            print(f"    {r['name']:28} {r['cap']:6} {r['batch']:5} {why}: "
                  f"{(err[-1] if err else '')[:100]}")
            continue
        print(f"    {r['name']:28} {r['cap']:6} {r['batch']:5} {tps:9.1f}")
        if tps > best.get(key, (0.0, ""))[0]:
            best[key] = (tps, what)
    for key in sorted(set(best) | set(llama)):
        model, cap, batch = key
        line = f"    {model:16} {cap:6} batch {batch:3}:"
        if key in best:
            line += f" best moec {best[key][1]} {best[key][0]:.1f} tok/s;"
        if key in llama:
            line += f" llama.cpp decode {llama[key]:.1f} tok/s;"
        if key in best and key in llama and llama[key] > 0:
            line += f" ratio {best[key][0] / llama[key]:.2f}x (moec over the whole generation, " \
                    "llama.cpp its decode phase)"
        print(line)


def serve(out: str) -> None:
    """Section serve: `moec serve --backend cuda` under the serve bench's client."""
    rows = lines(os.path.join(out, "serve.jsonl"))
    if not rows:
        if os.path.exists(os.path.join(out, "serve.txt")):
            print("\n(f) moec serve --backend cuda: no result (see serve.txt)")
        return
    print("\n(f) moec serve --backend cuda, streaming clients, 32 tokens a request, greedy "
          "(serve.jsonl; plain: prompts of 48 words; shared: a 1,000-token system prompt + 16 words)")
    print("    system | requests | prompt tokens | output tok/s | TTFT p50/p99 s | inter-token p50/p99 ms")
    for r in rows:
        if r.get("failed") or "output_tokens_per_s" not in r:
            print(f"    {r.get('system', '?')} | failed")
            continue
        itl = lambda k: f"{r[k] * 1e3:.1f}" if r.get(k) is not None else "-"
        print(f"    {r['system']} | {r['requests_done']}/{r['requests_asked']} | "
              f"{r['mean_prompt_tokens']:.1f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} | {itl('itl_p50_s')}/{itl('itl_p99_s')}")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--n-cpu-moe":
        print(n_cpu_moe(sys.argv[2], sys.argv[3], int(sys.argv[4])))
        return 0
    if len(sys.argv) == 6 and sys.argv[1] == "--llama-rows":
        for row in llama_rows(*sys.argv[2:]):
            print(json.dumps(row))
        return 0
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
    full_size(out)
    serve(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
