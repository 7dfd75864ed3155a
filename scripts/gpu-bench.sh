#!/usr/bin/env bash
# One command for a GPU machine (H100/H200, issue 28 item 9): is moec's CUDA backend right,
# and how fast is it beside Hugging Face transformers on the same GPU? No network and no
# Rust toolchain needed: it takes a release binary built elsewhere.
#
#   scripts/gpu-bench.sh path/to/moec [OUT_DIR]
#
# Sections (GPU_BENCH_SECTIONS, default "probe tokens quant resident ncu sanitize hf offload
# serve", run
# in that order):
#   probe   `moec probe --backend cuda`: the host and moec's CUDA kernels and copies on this
#           device, written to OUT_DIR/probe.ron; the replays below predict on it (unless
#           GPU_BENCH_HW names another profile).
#   tokens  every schedule x every family's tiny card, `--backend cuda` against
#           `--backend cpu` on the same machine: greedy token ids equal or not, per pair.
#   resident  the synthetic mixtral-mid checkpoint (1.47 GiB bf16), prompts of 64 tokens,
#           32 new, at batch 1, 16 and 64 (GPU_BENCH_BATCHES): `gpu_resident`; tokens/s,
#           and the decode step measured against the HRM replay on the machine's profile.
#           GPU_BENCH_VARIANTS (default none): environment settings, each `NAME=VALUE` (e.g.
#           "MOEC_FLOAT_KERNELS=block MOEC_FLOAT_KERNELS=generic-rows
#           MOEC_FLOAT_KERNELS=staged-experts MOEC_Q8_KERNELS=generic
#           MOEC_CUDA_REPLAY_IO=host-functions",
#           the kernels and replay path an A/B keeps selectable), each run again at every batch
#           as `gpu_resident[NAME=VALUE]` (and `gpu_resident_q4k[...]` with section quant).
#   ncu     per-launch kernel times (`ncu --metrics gpu__time_duration.sum`) of `gpu_resident`
#           at each batch of GPU_BENCH_NCU_BATCHES (default "1 16 64"), 4 new tokens, on the mid
#           checkpoint and (with section quant) its quantised file: ncu-LABEL-bB.csv, and
#           ncu.txt with scripts/ncu_table.py's per-step tables (kernel time, not step time).
#   sanitize `compute-sanitizer` initcheck and racecheck on `gpu_resident` over mixtral-tiny
#           (bf16, and quantised by GPU_BENCH_SANITIZE_QUANT, default experts Q4_0 and the rest
#           Q8_0: the tiny card's rows are not whole K-quant blocks) with
#           MOEC_CUDA_POISON_SCRATCH=1, then
#           initcheck on each schedule of GPU_BENCH_SANITIZE_SCHEDULES (default "cgopipe
#           fiddler"): 2 prompts of 8 tokens, 3 new, each bounded by 60 s; sanitize.txt.
#   hf      transformers bf16 on the same checkpoint and workload: the whole model on the
#           GPU in each configuration of GPU_BENCH_HF_CONFIGS (default `all`: experts eager,
#           grouped_mm and batched_mm x attention sdpa and eager, then batched_mm/sdpa under
#           torch.compile; the table's ratio takes the best), and accelerate's offload with
#           the GPU capped at 600 MiB (when `python3 -c "import torch, transformers"` works).
#   copies  (not in the default list) where the capped schedules' copies go: ncu's time of
#           each `copy_runs` launch (KV-cache copies) of klotski and flexgen at the cap, batch
#           64, and vslpipe at the cap with 16 MiB packets beside the planner's: copies.txt.
#   offload every offload schedule at `--gpu-mem 600MB` (GPU_BENCH_OFFLOAD_BATCHES), then
#           uncapped (GPU_BENCH_UNCAPPED_BATCHES), each with the params `moec plan` picks
#           for that workload and budget (`--fit`).
#   serve   `moec serve --backend cuda` on the mid checkpoint under scripts/serve-bench.sh's
#           client (scripts/serve_bench_client.py: the `openai` package, which python3 must
#           import, e.g. from the folder GPU_BENCH_SERVE_PYTHONPATH names; without it the
#           section says so in serve.txt and runs nothing): for each schedule of
#           GPU_BENCH_SERVE_SCHEDULES (default baselines/gpu_resident, --set ubs=CLIENTS) and
#           each scenario of GPU_BENCH_SERVE_SCENARIOS (default "plain shared": prompts of 48
#           random words; the shared-prefix scenario, a system prompt of 1,000 tokens and user
#           turns of 16 words), GPU_BENCH_SERVE_CLIENTS (8) streaming clients, 32 requests of
#           32 tokens, greedy, after one warm-up request: output tok/s, TTFT and inter-token
#           p50/p99, one line each in serve.jsonl; the servers' logs in serve.txt.
#   full    real size (issue 44 point 6), run apart (GPU_BENCH_SECTIONS=full: tens of GB of
#           disk and minutes a model): each card of GPU_BENCH_FULL_MODELS (default
#           "mixtral-8x7b qwen3-30b-a3b") synthesised here as a llama.cpp Q4_K_M GGUF
#           (`moec synth --gguf --mix q4_k_m`, deleted after its runs), then each schedule of
#           GPU_BENCH_FULL_SCHEDULES (default the offload list) at each cap of
#           GPU_BENCH_FULL_CAPS (default "16GB 24GB") and batch of GPU_BENCH_FULL_BATCHES
#           (default the batches) with `--fit`, prompts of 64 tokens, 32 new, each bounded by
#           GPU_BENCH_FULL_RUN_TIMEOUT (default 300 s): rows of full.jsonl. Against it,
#           llama.cpp's CUDA build on the same file when a `llama-batched-bench` is found in
#           GPU_BENCH_LLAMA_DIR (default: the moec binary's folder, then its llama.cpp/ and
#           bin/; scripts/build-llama-cuda.sh makes it, run with its folder and
#           $CUDA_HOME/lib64 on LD_LIBRARY_PATH): `-ngl 99 --n-cpu-moe N -npp 64 -ntg 32 -npl <batches>`, N the fewest
#           layers whose experts stay on the CPU for the rest of the file plus
#           GPU_BENCH_LLAMA_RESERVE_MIB (default 1536: KV cache and compute buffers) to fit the
#           cap; its output in full.txt, its decode tok/s in full.jsonl. Without the binary,
#           or when it lists no CUDA device, full.txt and the summary say so and no ratio is
#           printed. full.txt also keeps the synthesis logs.
#   quant   quantised weights on the GPU: every schedule on each GGUF file named in
#           GPU_BENCH_GGUF (e.g. llama.cpp's Q4_K_M of the tiny Mixtral), `--backend cuda`
#           against `--backend cpu` (tokens.jsonl, family `gguf:FILE`); and the mid checkpoint
#           written by `moec quantize` (GPU_BENCH_QUANT, default experts and attention Q4_K,
#           head Q6_K) run by `gpu_resident` at each batch (`gpu_resident_q4k` rows, beside
#           the bf16 rows), with the CPU backend's tokens for the same file at the largest batch.
# It writes OUT_DIR (default $OUT, else ./gpu-bench-out): devices.txt, tokens.jsonl,
# serve.jsonl and serve.txt (section serve),
# full.jsonl and full.txt (section full),
# probe.txt and probe.ron, runs.jsonl (each mid run's `--json` report with its name, batch and exit status),
# hf.jsonl, summary.txt (the one table), traces.tar.gz (Chrome traces of a few runs),
# ncu.txt and ncu-*.csv (section ncu) and sanitize.txt (section sanitize).
# Each run is bounded by `timeout`; the whole script is meant to take under 6 minutes.
# Smaller dry runs (e.g. under the stand-in driver): GPU_BENCH_MODEL=mixtral-tiny
# GPU_BENCH_BATCHES=1 GPU_BENCH_FAMILIES=mixtral GPU_BENCH_PROBE_SIZES=tiny GPU_BENCH_PROBE_MIB=16.
set -u
moec=$(realpath "${1:?usage: gpu-bench.sh path/to/moec [OUT_DIR]}" 2> /dev/null)
if [ ! -x "$moec" ]; then
    echo "gpu-bench.sh: $1 is not an executable moec binary" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
out=${2:-${OUT:-$PWD/gpu-bench-out}}
mkdir -p "$out"
out=$(realpath "$out")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sections=${GPU_BENCH_SECTIONS:-probe tokens quant resident ncu sanitize hf offload serve}
per_run=${GPU_BENCH_RUN_TIMEOUT:-40}
jobs=${GPU_BENCH_JOBS:-8}
model=${GPU_BENCH_MODEL:-mixtral-mid}
batches=${GPU_BENCH_BATCHES:-1 16 64}
cap=${GPU_BENCH_CAP:-600MB}
families=${GPU_BENCH_FAMILIES:-mixtral dbrx qwen3-moe olmoe qwen2-moe gpt-oss deepseek-v2 deepseek-v3}
offload=${GPU_BENCH_SCHEDULES:-cgopipe vslpipe klotski flexgen fiddler moe_infinity}
# The replay's profile: the device's own (moec probe) when one is given, else the named one.
hw=${GPU_BENCH_HW:-}
if [ -z "$hw" ]; then
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null)" in
        *H100*) hw=h100 ;;
        *) hw=h200 ;;
    esac
fi
has() { case " $sections " in *" $1 "*) return 0 ;; esac; return 1; }
started=$(date +%s)

# --- probe: this machine's profile, for the replays ------------------------------------
if has probe; then
    if timeout "${GPU_BENCH_PROBE_TIMEOUT:-300}" "$moec" probe --backend cuda --name "probed-$hw" --size-mib "${GPU_BENCH_PROBE_MIB:-1024}" \
        --gpu-sizes "${GPU_BENCH_PROBE_SIZES:-full}" \
        --out "$out/probe.ron" > "$out/probe.txt" 2>&1; then
        [ -n "${GPU_BENCH_HW:-}" ] || hw=$out/probe.ron
    else
        echo "moec probe --backend cuda failed (exit $?); the replays use the profile $hw" >> "$out/probe.txt"
    fi
fi

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$moec" devices 2>&1
    echo "moec devices: exit $?"
} > "$out/devices.txt"

# --- (a) tokens: CUDA against CPU on every tiny card (and each GGUF file) ---------------
if has tokens || has quant; then
    mkdir -p "$work/tok"
    token_jobs() { # LABEL WEIGHTS-FLAG: every schedule on both backends
        for s in "$root"/schedules/*.sched "$root"/schedules/baselines/*.sched; do
            for b in cpu cuda; do echo "$1 $2 $s $(basename "$s" .sched) $b"; done
        done
    }
    {
        if has tokens; then
            for f in $families; do token_jobs "$f" "--model=$f-tiny"; done
        fi
        if has quant; then
            for g in ${GPU_BENCH_GGUF:-}; do
                token_jobs "gguf:$(basename "$g" .gguf)" "--weights=$(realpath "$g")"
            done
        fi
    } > "$work/tok/jobs"
    # Four prompts of 12 tokens, 8 new: every step kind, a few decode steps, in a second.
    # shellcheck disable=SC2016
    xargs -P "$jobs" -L 1 sh -c '
        timeout '"$per_run"' "$0" run "$3" "$2" --backend "$5" --json --threads 2 \
            --gen-len 8 --workload count=4,mean=12,max=12,min=12,gen=8,seed=3 \
            > "'"$work"'/tok/$1__$4__$5.json" 2> "'"$work"'/tok/$1__$4__$5.err"
        echo $? > "'"$work"'/tok/$1__$4__$5.rc"' "$moec" < "$work/tok/jobs"
    python3 - "$work/tok" "$out/tokens.jsonl" <<'EOF'
import json, os, sys
d, dest = sys.argv[1], sys.argv[2]
rows = []
for line in open(os.path.join(d, "jobs")):
    fam, _, _, name, backend = line.split()
    if backend != "cuda":
        continue
    def load(b):
        base = os.path.join(d, f"{fam}__{name}__{b}")
        rc = int(open(base + ".rc").read().strip() or 1)
        err = open(base + ".err").read()[-600:]
        try:
            rep = json.load(open(base + ".json"))
            ids = [o["token_ids"] for o in rep["outputs"]]
        except Exception:
            ids = None
        return rc, err, ids
    crc, cerr, cids = load("cpu")
    grc, gerr, gids = load("cuda")
    if crc != 0:
        verdict = "cpu timed out" if crc in (124, 137) else "cpu failed"
    elif grc != 0:
        verdict = ("cuda timed out" if grc in (124, 137) else
                   "cuda refused" if "support" in gerr else "cuda failed")
    else:
        verdict = "same" if cids == gids else "DIFFERENT"
    rows.append({"family": fam, "schedule": name, "verdict": verdict,
                 "cpu_exit": crc, "cuda_exit": grc, "cuda_stderr": gerr if grc else "",
                 "cpu_stderr": cerr if crc else "", "cpu": cids, "cuda": gids})
with open(dest, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
EOF
fi

# --- (b) mixtral-mid on moec -------------------------------------------------------------
if has resident || has offload || has hf || has quant || has serve || has ncu || has copies; then
    "$moec" synth --model "$model" --out "$work/mid" > "$out/synth.txt" 2>&1 || {
        echo "moec synth failed: see $out/synth.txt" >&2
        exit 1
    }
    # Read it once so the first run does not pay the disk.
    cat "$work"/mid/*.safetensors > /dev/null
fi
: > "$out/runs.jsonl"
mkdir -p "$out/traces.d"
# run NAME SCHED BATCH CAP [args...]: BATCH prompts of 64 tokens, 32 new; CAP "-" = none.
run() {
    local name=$1 sched=$2 batch=$3 cap=$4
    shift 4
    local capargs=() trace=()
    [ "$cap" != "-" ] && capargs=(--gpu-mem "$cap")
    case " ${GPU_BENCH_TRACE:-gpu_resident:16:- fiddler:16:- cgopipe:16:$cap} " in
        *" $name:$batch:$cap "*) trace=(--trace "$out/traces.d/$name-$batch-${cap/-/all}.json") ;;
    esac
    local t0 t1
    t0=$(date +%s.%N)
    env ${run_env:+"$run_env"} timeout "${run_timeout:-$per_run}" "$moec" run "$root/$sched" --weights "${run_weights:-$work/mid}" --backend cuda \
        --json --hw "$hw" --gen-len 32 \
        --workload "count=$batch,mean=64,max=64,min=64,gen=32,seed=1" \
        "${capargs[@]}" "${trace[@]}" "$@" > "$work/report" 2> "$work/err"
    local rc=$?
    t1=$(date +%s.%N)
    python3 - "$name" "$batch" "$cap" "$rc" "$work/err" "$work/report" "$t0" "$t1" \
        >> "${runs_file:-$out/runs.jsonl}" <<'EOF'
import json, sys
name, batch, cap, rc, err, rep, t0, t1 = sys.argv[1:]
try:
    report = json.load(open(rep))
except Exception:
    report = None
print(json.dumps({"name": name, "batch": int(batch), "cap": cap, "exit": int(rc),
                  "wall_s": float(t1) - float(t0),
                  "stderr": open(err).read()[-3000:], "report": report}))
EOF
}
if has resident; then
    for b in $batches; do
        run gpu_resident schedules/baselines/gpu_resident.sched "$b" - --set "ubs=$b"
        for v in ${GPU_BENCH_VARIANTS:-}; do
            run_env=$v run "gpu_resident[$v]" schedules/baselines/gpu_resident.sched "$b" - --set "ubs=$b"
        done
    done
fi

# --- (b') the mid checkpoint quantised by moec, resident on the GPU ---------------------------
if has quant; then
    if timeout 300 "$moec" quantize --weights "$work/mid" --out "$work/mid-q.gguf" \
        --weight-format "${GPU_BENCH_QUANT:-experts=q4_k,attention=q4_k,head=q6_k}" \
        > "$out/quantize.txt" 2>&1; then
        last=
        for b in $batches; do
            run_weights=$work/mid-q.gguf run gpu_resident_q4k schedules/baselines/gpu_resident.sched "$b" - --set "ubs=$b"
            for v in ${GPU_BENCH_VARIANTS:-}; do
                run_env=$v run_weights=$work/mid-q.gguf run "gpu_resident_q4k[$v]" \
                    schedules/baselines/gpu_resident.sched "$b" - --set "ubs=$b"
            done
            last=$b
        done
        # The same file on the CPU backend (all cores), for its tokens at the largest batch
        # (GPU_BENCH_QUANT_CPU=0 leaves it out, e.g. for a baseline binary's timings only).
        [ "${GPU_BENCH_QUANT_CPU:-1}" = 1 ] && timeout 120 "$moec" run "$root/schedules/baselines/resident.sched" --weights "$work/mid-q.gguf" \
            --json --gen-len 32 --set "ubs=$last" --set n_ub=1 \
            --workload "count=$last,mean=64,max=64,min=64,gen=32,seed=1" > "$work/cpu-q.json" 2> "$out/cpu-q.err"
        python3 - "$work/cpu-q.json" "$out/runs.jsonl" "$last" > "$out/quant-tokens.txt" <<'EOF'
import json, sys
cpu_path, runs_path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    cpu = [o["token_ids"] for o in json.load(open(cpu_path))["outputs"]]
except Exception as e:
    print(f"mid quantised, batch {batch}: the CPU run gave no report ({e})")
    sys.exit(0)
for line in open(runs_path):
    r = json.loads(line)
    if r["name"] == "gpu_resident_q4k" and r["batch"] == batch and r.get("report"):
        gpu = [o["token_ids"] for o in r["report"]["outputs"]]
        same = sum(a == b for x, y in zip(cpu, gpu) for a, b in zip(x, y))
        total = sum(len(x) for x in cpu)
        seqs = sum(x == y for x, y in zip(cpu, gpu))
        first = sorted(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                       for x, y in zip(cpu, gpu))
        print(f"mid quantised, batch {batch}: cuda gpu_resident vs cpu resident: "
              f"{same}/{total} token positions equal, {seqs}/{len(cpu)} sequences identical; "
              f"first differing position per sequence (sorted, {len(cpu[0]) if cpu else 0} = none): {first}")
        break
else:
    print(f"mid quantised, batch {batch}: no CUDA report to compare")
EOF
    else
        echo "moec quantize failed (exit $?): see quantize.txt" > "$out/quant-tokens.txt"
    fi
fi

# --- (b'') where a step's kernel time goes, and the sanitizers ------------------------------
if has ncu; then
    : > "$out/ncu.txt"
    if ! command -v ncu > /dev/null; then
        echo "ncu: NOT RUN: no ncu on PATH" > "$out/ncu.txt"
    else
        for w in mid mid-q.gguf; do
            [ -e "$work/$w" ] || continue
            label=${w%.gguf}
            for b in ${GPU_BENCH_NCU_BATCHES:-1 16 64}; do
                timeout "${GPU_BENCH_NCU_TIMEOUT:-60}" ncu --clock-control none --metrics gpu__time_duration.sum \
                    --csv --launch-count 1500 "$moec" run "$root/schedules/baselines/gpu_resident.sched" \
                    --weights "$work/$w" --backend cuda --hw "$hw" --gen-len 4 --set "ubs=$b" \
                    --workload "count=$b,mean=64,max=64,min=64,gen=4,seed=1" \
                    > "$out/ncu-$label-b$b.csv" 2> "$work/ncu.err"
                echo "== $label batch $b: ncu exit $?" >> "$out/ncu.txt"
                python3 "$root/scripts/ncu_table.py" "$out/ncu-$label-b$b.csv" --steps 3 >> "$out/ncu.txt" 2>&1
            done
        done
    fi
fi
if has sanitize; then
    : > "$out/sanitize.txt"
    if ! command -v compute-sanitizer > /dev/null; then
        echo "sanitize: NOT RUN: no compute-sanitizer on PATH" > "$out/sanitize.txt"
    else
        "$moec" synth --model mixtral-tiny --out "$work/tiny" > /dev/null 2>&1
        "$moec" quantize --weights "$work/tiny" --out "$work/tiny-q.gguf" \
            --weight-format "${GPU_BENCH_SANITIZE_QUANT:-experts=q4_0,attention=q8_0,head=q8_0}" > /dev/null 2>&1
        sanitize() { # TOOL WEIGHTS SCHEDULE
            MOEC_CUDA_POISON_SCRATCH=1 timeout 60 compute-sanitizer --tool "$1" --print-limit 3 \
                --show-backtrace device "$moec" run "$root/$3" --weights "$2" --backend cuda --hw "$hw" \
                --gen-len 3 --workload count=2,mean=8,max=8,min=8,gen=3,seed=1 > "$work/san.txt" 2>&1
            local rc=$?
            {
                echo "== $1 $(basename "$2") $3: exit $rc"
                grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Uninitialized|hazard|Invalid|Program hit' "$work/san.txt" | head -12
            } >> "$out/sanitize.txt"
        }
        for t in initcheck racecheck; do
            sanitize "$t" "$work/tiny" schedules/baselines/gpu_resident.sched
            [ -e "$work/tiny-q.gguf" ] && sanitize "$t" "$work/tiny-q.gguf" schedules/baselines/gpu_resident.sched
        done
        for sch in ${GPU_BENCH_SANITIZE_SCHEDULES:-cgopipe fiddler}; do
            sanitize initcheck "$work/tiny" "schedules/$sch.sched"
        done
    fi
fi

# --- (c) Hugging Face transformers on the same GPU -----------------------------------------
: > "$out/hf.jsonl"
if has hf && python3 -c "import torch, transformers" 2> /dev/null; then
    blist=$(echo $batches | tr ' ' ',')
    # One process per placement: the model loads once and runs every batch.
    timeout "${GPU_BENCH_HF_TIMEOUT:-400}" python3 "$root/scripts/peer_bench_hf.py" --model "$work/mid" --batch "$blist" \
        --prompt-len 64 --gen-len 32 --threads 16 --device cuda --configs "${GPU_BENCH_HF_CONFIGS:-all}" \
        >> "$out/hf.jsonl" 2>> "$out/hf.err" || echo "hf: exit $?" >> "$out/hf.err"
    timeout 150 python3 "$root/scripts/peer_bench_hf.py" --model "$work/mid" --batch "$blist" \
        --prompt-len 64 --gen-len 32 --threads 16 --device cuda --max-gpu-mem 600MiB \
        >> "$out/hf.jsonl" 2>> "$out/hf.err" || echo "hf-offload: exit $?" >> "$out/hf.err"
elif has hf; then
    echo "hf: skipped (python3 cannot import torch and transformers)" > "$out/hf.err"
fi

# --- (d) the offload schedules, uncapped and capped ------------------------------------------
if has offload; then
    for b in ${GPU_BENCH_OFFLOAD_BATCHES:-$batches}; do
        for s in $offload; do
            run "$s" "schedules/$s.sched" "$b" "$cap" --fit
        done
    done
    for b in ${GPU_BENCH_UNCAPPED_BATCHES:-$batches}; do
        for s in $offload; do
            run "$s" "schedules/$s.sched" "$b" - --fit
        done
    done
fi

# --- (d') where the capped schedules' copies go (session 19: issue 44's copy misses) ---------
# The 2026-11-30 call measured klotski's and flexgen's KV-cache copies 4-10x and vslpipe's
# activation copies 16x above the replay. copies.txt says which of three causes it is:
# the `copy_runs` kernel's own time per launch (ncu, the KV copies of klotski and flexgen
# through the mapped pinned arena) against the run's per-op copy time; vslpipe with the
# data mover's packets at 16 MiB against the planner's (a small activation copy queued
# behind a packet on the copy engine shrinks with the packet); and the runs' counts.
if has copies; then
    : > "$out/copies.txt"
    if command -v ncu > /dev/null; then
        for s in klotski flexgen; do
            timeout "${GPU_BENCH_NCU_TIMEOUT:-60}" ncu --clock-control none --metrics gpu__time_duration.sum \
                --csv --kernel-name copy_runs --launch-count 400 "$moec" run "$root/schedules/$s.sched" \
                --weights "$work/mid" --backend cuda --hw "$hw" --gen-len 8 --gpu-mem "$cap" --fit \
                --workload "count=64,mean=64,max=64,min=64,gen=8,seed=1" \
                > "$out/ncu-copies-$s.csv" 2> "$work/ncu.err"
            echo "== $s at $cap, batch 64, 8 new: ncu copy_runs exit $?" >> "$out/copies.txt"
            python3 - "$root/scripts" "$out/ncu-copies-$s.csv" >> "$out/copies.txt" <<'PYEOF'
import sys
sys.path.insert(0, sys.argv[1])
from ncu_table import launches
us = sorted(t for n, t, _, _ in launches(sys.argv[2]) if n == "copy_runs")
grids = sorted({g for n, _, g, _ in launches(sys.argv[2]) if n == "copy_runs"})
if us:
    print(f"copy_runs launches {len(us)}: median {us[len(us)//2]:.1f} us, max {us[-1]:.1f} us, "
          f"sum {sum(us)/1e3:.2f} ms; grids {grids[:8]}")
else:
    print("copy_runs: no launch measured")
PYEOF
        done
    else
        echo "ncu: NOT RUN: no ncu on PATH" >> "$out/copies.txt"
    fi
    for pk in 16 -; do
        if [ "$pk" = - ]; then
            run vslpipe "schedules/vslpipe.sched" 64 "$cap" --fit
        else
            run "vslpipe[packet_mb=$pk]" "schedules/vslpipe.sched" 64 "$cap" --fit --set "packet_mb=$pk"
        fi
    done
    python3 - "$out/runs.jsonl" >> "$out/copies.txt" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if not r["name"].startswith("vslpipe") or not r.get("report"):
        continue
    rep = r["report"]
    ops = {o["op"]: o for o in rep.get("predicted", {}).get("ops", [])}
    a = ops.get("copy activations pinned->gpu", {})
    g = [x for x in rep["report"].get("graphs", [])]
    print(f"{r['name']} batch {r['batch']}: {rep['stats']['tokens_per_s']:.0f} tok/s; activation copies "
          f"pinned->gpu {a.get('runs')} runs, {a.get('measured_seconds', 0):.3f} s measured / "
          f"{a.get('predicted_seconds', 0):.3f} s predicted; params {rep.get('fitted_params')}; graphs {g}")
PYEOF
fi

# --- (e) real size: Q4_K_M GGUFs synthesised here, capped schedules, llama.cpp's CUDA offload --
if has full; then
    full_models=${GPU_BENCH_FULL_MODELS:-mixtral-8x7b qwen3-30b-a3b}
    full_caps=${GPU_BENCH_FULL_CAPS:-16GB 24GB}
    full_batches=${GPU_BENCH_FULL_BATCHES:-$batches}
    llama_dir=${GPU_BENCH_LLAMA_DIR:-$(dirname "$moec")}
    llama=
    for d in "$llama_dir" "$llama_dir/llama.cpp" "$llama_dir/bin"; do
        if [ -x "$d/llama-batched-bench" ]; then
            llama=$d/llama-batched-bench
            break
        fi
    done
    # scripts/build-llama-cuda.sh's build is shared libraries (ggml picks its CPU backend for
    # this machine's CPU) with cuBLAS from the machine's toolkit: both on the loader path.
    llama_run() {
        LD_LIBRARY_PATH="$(dirname "$llama"):${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$llama" "$@"
    }
    : > "$out/full.jsonl"
    {
        echo "full-size section, $(date -u +%FT%TZ): models $full_models; caps $full_caps; batches $full_batches"
        if [ -z "$llama" ]; then
            echo "llama.cpp: ABSENT: no llama-batched-bench in $llama_dir, $llama_dir/llama.cpp or" \
                "$llama_dir/bin; no llama.cpp CUDA figure is measured and no ratio against it is printed"
        elif ! llama_run --list-devices 2>&1 | grep -qi cuda; then
            echo "llama.cpp: $llama lists no CUDA device (not a CUDA build, or no GPU); not run:"
            llama_run --list-devices 2>&1 | tail -5
            llama=
        else
            echo "llama.cpp: $llama"
            llama_run --list-devices 2>&1 | tail -5
        fi
    } > "$out/full.txt"
    mkdir -p "$work/full"
    for m in $full_models; do
        gguf=$work/full/$m-Q4_K_M.gguf
        t0=$(date +%s)
        if ! timeout "${GPU_BENCH_SYNTH_TIMEOUT:-1200}" "$moec" synth --model "$m" --gguf --mix q4_k_m \
            --out "$gguf" >> "$out/full.txt" 2>&1; then
            echo "$m: moec synth --gguf --mix q4_k_m failed or timed out; no runs" >> "$out/full.txt"
            rm -f "$gguf"
            continue
        fi
        echo "$m: synthesised $(du -h "$gguf" | cut -f1) in $(($(date +%s) - t0)) s" >> "$out/full.txt"
        cat "$gguf" > /dev/null
        for c in $full_caps; do
            for b in $full_batches; do
                for sch in ${GPU_BENCH_FULL_SCHEDULES:-$offload}; do
                    runs_file=$out/full.jsonl run_weights=$gguf run_timeout=${GPU_BENCH_FULL_RUN_TIMEOUT:-300} \
                        run "$m:$sch" "schedules/$sch.sched" "$b" "$c" --fit
                done
            done
            [ -n "$llama" ] || continue
            # The fewest layers whose experts llama.cpp keeps on the CPU (--n-cpu-moe counts
            # from the first layer) for the rest of the file and the reserve to fit the cap.
            read -r ncmoe est moe_layers < <(python3 "$root/scripts/gpu_bench_table.py" --n-cpu-moe \
                "$gguf" "$c" "${GPU_BENCH_LLAMA_RESERVE_MIB:-1536}")
            echo "$m at $c: llama.cpp --n-cpu-moe ${ncmoe:-?} of ${moe_layers:-?} MoE layers" \
                "(estimated ${est:-?} GB on the GPU besides the reserve)" >> "$out/full.txt"
            [ -n "${ncmoe:-}" ] || continue
            npl=$(echo "$full_batches" | tr ' ' ',')
            timeout "${GPU_BENCH_LLAMA_TIMEOUT:-600}" env LD_LIBRARY_PATH="$(dirname "$llama"):${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$llama" -m "$gguf" -ngl 99 --n-cpu-moe "$ncmoe" \
                -c 8192 -b 2048 -ub 512 -npp 64 -ntg 32 -npl "$npl" > "$work/llama.txt" 2>&1
            echo "llama-batched-bench exit $?" >> "$work/llama.txt"
            tail -40 "$work/llama.txt" >> "$out/full.txt"
            python3 "$root/scripts/gpu_bench_table.py" --llama-rows "$work/llama.txt" "$m" "$c" "$ncmoe" \
                >> "$out/full.jsonl"
        done
        rm -f "$gguf"
    done
fi

# --- (f) moec serve --backend cuda under the serve bench's client ---------------------------
if has serve; then
    : > "$out/serve.jsonl"
    serve_path=${GPU_BENCH_SERVE_PYTHONPATH:-}${PYTHONPATH:+:$PYTHONPATH}
    clients=${GPU_BENCH_SERVE_CLIENTS:-8}
    {
        echo "serve section, $(date -u +%FT%TZ): schedules ${GPU_BENCH_SERVE_SCHEDULES:-baselines/gpu_resident};" \
            "scenarios ${GPU_BENCH_SERVE_SCENARIOS:-plain shared}; $clients clients"
    } > "$out/serve.txt"
    if ! PYTHONPATH=$serve_path python3 -c "import openai, tokenizers" 2>> "$out/serve.txt"; then
        echo "serve: NOT RUN: python3 cannot import openai and tokenizers (the serve bench's" \
            "client); name the folder that holds them in GPU_BENCH_SERVE_PYTHONPATH" >> "$out/serve.txt"
    else
        for scenario in ${GPU_BENCH_SERVE_SCENARIOS:-plain shared}; do
            case $scenario in
                plain) words=(--prompt-words 48); max_prompt=160 ;;
                shared) words=(--system-tokens 1000 --prompt-words 16
                    --tokenizer "$work/mid/tokenizer.json"); max_prompt=1100 ;;
                *) echo "serve: unknown scenario $scenario (plain, shared)" >> "$out/serve.txt"; continue ;;
            esac
            for sched in ${GPU_BENCH_SERVE_SCHEDULES:-baselines/gpu_resident}; do
                port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
                label="moec $sched cuda $scenario"
                echo "== $label: port $port" >> "$out/serve.txt"
                "$moec" serve "$root/schedules/$sched.sched" --weights "$work/mid" --backend cuda \
                    --host 127.0.0.1 --port "$port" --max-batch "$clients" --max-prompt "$max_prompt" \
                    --max-tokens 32 --set "ubs=$clients" --set n_ub=1 \
                    > /dev/null 2> "$work/serve.err" &
                server=$!
                healthy=0
                for _ in $(seq "$((${GPU_BENCH_SERVE_START_TIMEOUT:-180} * 5))"); do
                    kill -0 "$server" 2> /dev/null || break
                    if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
                        "http://127.0.0.1:$port/health" 2> /dev/null; then
                        healthy=1
                        break
                    fi
                    sleep 0.2
                done
                if [ "$healthy" = 1 ]; then
                    PYTHONPATH=$serve_path timeout "${GPU_BENCH_SERVE_TIMEOUT:-150}" python3 \
                        "$root/scripts/serve_bench_client.py" --base-url "http://127.0.0.1:$port/v1" \
                        --model mixtral-mid --clients "$clients" --requests "${GPU_BENCH_SERVE_REQUESTS:-32}" \
                        "${words[@]}" --max-tokens 32 --time-limit "${GPU_BENCH_SERVE_TIME_LIMIT:-120}" \
                        --label "$label" > "$work/serve.out" 2>> "$out/serve.txt"
                    echo "client exit $?" >> "$out/serve.txt"
                    tail -1 "$work/serve.out" >> "$out/serve.jsonl"
                else
                    echo "{\"system\": \"$label\", \"failed\": true}" >> "$out/serve.jsonl"
                    echo "the server did not answer /health" >> "$out/serve.txt"
                fi
                kill -TERM "$server" 2> /dev/null
                for _ in $(seq 300); do kill -0 "$server" 2> /dev/null || break; sleep 0.1; done
                kill -KILL "$server" 2> /dev/null
                wait "$server" 2> /dev/null
                tail -20 "$work/serve.err" >> "$out/serve.txt"
            done
        done
    fi
fi

if compgen -G "$out/traces.d/*.json" > /dev/null; then
    tar -C "$out/traces.d" -czf "$out/traces.tar.gz" .
fi
rm -rf "$out/traces.d"
python3 "$root/scripts/gpu_bench_table.py" "$out" "$(($(date +%s) - started))" \
    | tee "$out/summary.txt"
