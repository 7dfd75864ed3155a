#!/usr/bin/env python3
"""Per-step kernel tables from `ncu --csv --metrics gpu__time_duration.sum` output.

    python3 scripts/ncu_table.py ncu.csv [--steps N]

ncu prints one row per kernel launch. A step of a moec decode starts with its `embed*`
kernel, so the launches between two of them are one step (the first is the prefill). For
each step: its launch count, the kernels' summed time and, per kernel name and launch
shape, the launches and microseconds, largest first. Kernel time only: what a CUDA graph
overlaps ncu serialises, and the gaps between kernels are not in it.
"""
import csv
import sys


def launches(path: str) -> list[tuple[str, float, str, str]]:
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    head = rows[0]
    name, value = head.index("Kernel Name"), head.index("Metric Value")
    grid, block = head.index("Grid Size"), head.index("Block Size")
    unit = head.index("Metric Unit")
    scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    out = []
    for r in rows[1:]:
        if len(r) != len(head):
            continue
        t = float(r[value].replace(",", "")) * scale.get(r[unit], 1e-3)
        out.append((r[name].split("(")[0], t, r[grid], r[block]))
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    steps_shown = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 3
    seq = launches(sys.argv[1])
    if not seq:
        print(f"{sys.argv[1]}: no ncu launch rows")
        return 1
    starts = [i for i, s in enumerate(seq) if s[0].startswith("embed")] or [0]
    print(f"{sys.argv[1]}: {len(seq)} launches, {sum(s[1] for s in seq):.0f} us of kernels")
    bounds = list(zip(starts, starts[1:] + [len(seq)]))
    for n, (a, b) in enumerate(bounds[:steps_shown]):
        step = seq[a:b]
        kind = "prefill (or first step)" if n == 0 else "step"
        print(f"-- {kind} at launch {a}: {b - a} launches, {sum(s[1] for s in step):.1f} us")
        agg: dict[tuple[str, str, str], list[float]] = {}
        for k, t, g, bl in step:
            c = agg.setdefault((k, g, bl), [0, 0.0])
            c[0] += 1
            c[1] += t
        for (k, g, bl), (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:16]:
            print(f"   {k[:34]:34s} grid {g:14s} block {bl:12s} x{int(c):3d} {t:8.1f} us ({t / c:.1f} each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
