#!/usr/bin/env python3
"""Shard a `moec batch` job over a Ray cluster.

    python3 scripts/ray_batch.py --input prompts.jsonl --output results.jsonl \
        --shards 8 [--address auto] [--retries 3] -- schedules/cgopipe.sched --model ... --backend cuda

Splits the JSON-lines input into contiguous shards (each line keeps its id: a line without
one gets its line number in the whole input, the id `moec batch` would give it, so the
merged output equals one `moec batch` over the whole file), runs `moec batch` on each shard
as a Ray task (`num_gpus=1` when the moec arguments say `--backend cuda`), runs a failed
shard again (up to --retries times; `moec batch` resumes from the shard's own output, so
a retry redoes at most the batch in flight), and merges the shard outputs in input order
into --output (written to a temporary beside it and renamed, so it is whole or absent).

Shard inputs and outputs live in --workdir (default: OUTPUT.shards/) and are kept: running
the same command again after a crash of the driver resumes every shard. Each running
shard's moec process id is in WORKDIR/shard-K.pid while it runs (tests kill one there).

Without --address, `ray.init()` starts a local cluster of --num-cpus workers; with
`--address auto` (after `ray start --head` on this node, `ray start --address HEAD:6379`
on the others) or `--address ray://HOST:10001`, it joins that cluster. Every node needs
the moec binary at the same path (--moec) and the model's weights, and --workdir on a
shared file system.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run `moec batch` over shards of a JSON-lines input on Ray."
    )
    parser.add_argument("--input", required=True, help="JSON-lines prompts")
    parser.add_argument("--output", required=True, help="merged JSON-lines results")
    parser.add_argument("--shards", type=int, default=4, help="number of shards")
    parser.add_argument("--workdir", help="shard files (default: OUTPUT.shards)")
    parser.add_argument("--moec", default="moec", help="the moec binary")
    parser.add_argument("--address", help="Ray cluster address (default: a local cluster)")
    parser.add_argument(
        "--num-cpus", type=int, help="CPUs of the local cluster (default: all)"
    )
    parser.add_argument(
        "--cpus-per-shard", type=float, default=1.0, help="CPUs a shard task takes"
    )
    parser.add_argument(
        "--gpus-per-shard",
        type=float,
        help="GPUs a shard task takes (default: 1 with --backend cuda, else 0)",
    )
    parser.add_argument(
        "--retries", type=int, default=3, help="runs of a failed shard after its first"
    )
    parser.add_argument(
        "moec_args",
        nargs=argparse.REMAINDER,
        help="after `--`: SCHED and the flags of `moec batch` (not --input/--output)",
    )
    args = parser.parse_args(argv)
    if args.moec_args and args.moec_args[0] == "--":
        args.moec_args = args.moec_args[1:]
    if not args.moec_args:
        parser.error("give the schedule and moec flags after `--`")
    for flag in ("--input", "--output"):
        if any(a == flag or a.startswith(flag + "=") for a in args.moec_args):
            parser.error(f"{flag} is the script's; it gives each shard its own")
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    if args.retries < 0:
        parser.error("--retries must be at least 0")
    if args.gpus_per_shard is None:
        cuda = any(
            a == "--backend=cuda"
            or (a == "--backend" and i + 1 < len(args.moec_args) and args.moec_args[i + 1] == "cuda")
            for i, a in enumerate(args.moec_args)
        )
        args.gpus_per_shard = 1.0 if cuda else 0.0
    args.workdir = args.workdir or args.output + ".shards"
    return args


def write_atomic(path, lines):
    """Writes `lines` to a temporary beside `path`, syncs it and renames it into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def split(input_path, workdir, shards):
    """Splits the input into contiguous shard files (once: a later run reuses them) and
    gives their paths. Lines are read twice (count, then copy), never held all at once."""
    os.makedirs(workdir, exist_ok=True)
    paths = [os.path.join(workdir, f"shard-{k}.in.jsonl") for k in range(shards)]
    marker = os.path.join(workdir, "split.json")
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            done = json.load(f)
        if done.get("shards") != shards or done.get("input") != os.path.abspath(input_path):
            sys.exit(
                f"ray_batch: {workdir} holds a split of {done.get('input')} into "
                f"{done.get('shards')} shards; use another --workdir or remove it"
            )
        return paths
    with open(input_path, encoding="utf-8") as f:
        prompts = sum(1 for line in f if line.strip())
    per_shard = -(-prompts // shards) if prompts else 1
    outs = [open(p + ".part", "w", encoding="utf-8") for p in paths]
    try:
        seen = 0
        with open(input_path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"ray_batch: {input_path}:{line_no}: {e}")
                if isinstance(value, str):
                    value = {"id": line_no, "prompt": value}
                elif isinstance(value, dict) and value.get("id") is None:
                    value = dict(value, id=line_no)
                # Anything else is left for `moec batch` to refuse, naming the line.
                outs[min(seen // per_shard, shards - 1)].write(
                    json.dumps(value, ensure_ascii=False) + "\n"
                )
                seen += 1
    finally:
        for f in outs:
            f.flush()
            os.fsync(f.fileno())
            f.close()
    for p in paths:
        os.replace(p + ".part", p)
    write_atomic(
        marker,
        [json.dumps({"input": os.path.abspath(input_path), "shards": shards}) + "\n"],
    )
    return paths


def run_shard(moec, moec_args, shard_in, shard_out, pid_file):
    """One shard: `moec batch` on its input, appending to its output (resuming)."""
    cmd = [moec, "batch", *moec_args, "--input", shard_in, "--output", shard_out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(pid_file + ".part", "w", encoding="utf-8") as f:
        f.write(f"{proc.pid}\n")
    os.replace(pid_file + ".part", pid_file)
    out, err = proc.communicate()
    try:
        os.remove(pid_file)
    except FileNotFoundError:
        pass
    return {"returncode": proc.returncode, "stdout": out[-2000:], "stderr": err[-4000:]}


def merge(shard_ins, shard_outs, output):
    """Merges the shard outputs in input order: one shard's results are held at a time."""
    tmp = f"{output}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as merged:
            for shard_in, shard_out in zip(shard_ins, shard_outs):
                results = {}
                with open(shard_out, encoding="utf-8") as f:
                    for line in f:
                        results[json.dumps(json.loads(line)["id"])] = line
                with open(shard_in, encoding="utf-8") as f:
                    for line in f:
                        key = json.dumps(json.loads(line)["id"])
                        if key not in results:
                            raise SystemExit(f"ray_batch: {shard_out} has no result for id {key}")
                        merged.write(results[key])
            merged.flush()
            os.fsync(merged.fileno())
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv):
    args = parse_args(argv)
    import ray  # imported here so `--help` and argument errors work without Ray

    shard_ins = split(args.input, args.workdir, args.shards)
    shard_outs = [p.replace(".in.jsonl", ".out.jsonl") for p in shard_ins]
    pid_files = [p.replace(".in.jsonl", ".pid") for p in shard_ins]
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus)
    task = ray.remote(run_shard).options(
        num_cpus=args.cpus_per_shard, num_gpus=args.gpus_per_shard, max_retries=0
    )
    moec = os.path.abspath(args.moec) if os.path.sep in args.moec else args.moec

    def submit(k):
        return task.remote(moec, args.moec_args, shard_ins[k], shard_outs[k], pid_files[k])

    started = time.time()
    running = {submit(k): k for k in range(args.shards)}
    runs = {k: 1 for k in range(args.shards)}
    failed = []
    while running:
        ready, _ = ray.wait(list(running), num_returns=1)
        k = running.pop(ready[0])
        result = ray.get(ready[0])
        if result["returncode"] == 0:
            print(f"ray_batch: shard {k} done (run {runs[k]})", file=sys.stderr)
            continue
        print(
            f"ray_batch: shard {k} failed (exit {result['returncode']}, run {runs[k]}): "
            f"{result['stderr'].strip()[-500:]}",
            file=sys.stderr,
        )
        if runs[k] <= args.retries:
            runs[k] += 1
            running[submit(k)] = k
        else:
            failed.append(k)
    if failed:
        sys.exit(
            f"ray_batch: shards {failed} failed {args.retries + 1} times; their outputs in "
            f"{args.workdir} hold what finished, and running the command again resumes them"
        )
    merge(shard_ins, shard_outs, args.output)
    retried = sum(n - 1 for n in runs.values())
    print(
        f"ray_batch: {args.shards} shards ({retried} retried) merged into {args.output} "
        f"in {time.time() - started:.1f} s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
