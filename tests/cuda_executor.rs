//! The CUDA executor end to end: every schedule in `schedules/` (baselines too) on every
//! family's tiny card (Mixtral, DBRX, Qwen3-MoE, OLMoE, Qwen2-MoE, gpt-oss, DeepSeek-V2,
//! DeepSeek-V3) through `moec run --backend cuda` gives the CPU backend's greedy tokens with
//! logits within 1e-2, and a plan with one cross-stream wait dropped fails or changes its
//! tokens. The new families' cards run every schedule too (not a subset): a schedule takes
//! about 2 s through the stand-in in a debug build against one CPU run of the card per
//! generation length (2 new tokens, 4 for the schedules whose decode steps replay a CUDA
//! graph, and for gpt-oss), and the eight cards are eight tests that run in parallel, each
//! running two schedules at a time.
//! gpt-oss's prompt plus generated tokens pass its 8-token sliding window, so the windowed
//! layers' decode attention is exercised.
//!
//! No machine of this project has a GPU, so the runs load the stand-in driver (standin/, a
//! test tool built by `cargo test --workspace`) in place of libcuda, libcublas and libnvrtc:
//! a child `moec` with a directory of symlinks to it first on `LD_LIBRARY_PATH`. The
//! stand-in runs each CUDA stream on its own thread and each kernel from its own `.cu`
//! source compiled for the CPU, so this is the backend's whole code path (cudarc, streams,
//! events, kernels, cuBLAS calls) minus the silicon. Where a real driver and device are
//! present the same comparison also runs against them; where not, the output says it was
//! skipped and why.

#[path = "gguf_common/mod.rs"]
mod gguf_common;
#[path = "lossy_common/mod.rs"]
mod lossy_common;
#[path = "schedules_common/mod.rs"]
mod schedules_common;
#[path = "standin_common/mod.rs"]
mod standin_common;

use moec::runtime::cuda::detect::detect;
use standin_common::{loader_path, standin_cache, standin_dir};
use std::path::{Path, PathBuf};

use std::process::{Command, Output};

const PROMPTS: [&str; 2] = ["Mixture of experts", "The capital of France is"];

/// Where a run's CUDA libraries come from.
#[derive(Clone, Copy)]
enum Driver<'a> {
    /// No CUDA: the CPU backend.
    Cpu,
    /// The stand-in first on the loader path (with an optional copy delay in ms).
    Standin(&'a Path, u32),
    /// The stand-in with every piece of CUDA scratch filled with NaN before its task gets
    /// it (`MOEC_CUDA_POISON_SCRATCH`).
    Poisoned(&'a Path),
    /// Whatever the machine has (a real driver).
    Machine,
}

/// `moec run SCHED --model CARD --json --gen-len 4 --hw t4 --dump-logits FILE [extra]`
/// (`--weights CARD` for a `.gguf` path; `--gen-len` from `extra` when it has one); gives
/// the process output and the logits file.
fn run(
    cache: &Path,
    schedule: &str,
    card: &str,
    driver: Driver<'_>,
    extra: &[&str],
) -> (Output, PathBuf) {
    let logits = tempfile::NamedTempFile::new()
        .expect("temp file")
        .into_temp_path()
        .keep()
        .expect("keep");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_moec"));
    // A `.gguf` file is a checkpoint (`--weights`), anything else a card.
    let model = if card.ends_with(".gguf") {
        "--weights"
    } else {
        "--model"
    };
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache)
        .args(["run", schedule, model, card, "--json"]);
    if !extra.contains(&"--gen-len") {
        cmd.args(["--gen-len", "4"]);
    }
    cmd
        // Tokens and logits only: a paper profile spares each run the quick probe of this
        // machine behind the report's replay (about 2 s in the test build, 120 runs here).
        .args(["--hw", "hardware/t4.ron"])
        .arg("--dump-logits")
        .arg(&logits);
    for p in PROMPTS {
        cmd.args(["--prompt", p]);
    }
    cmd.args(extra);
    match driver {
        Driver::Cpu => {}
        Driver::Standin(dir, delay) => {
            cmd.args(["--backend", "cuda"])
                .env("LD_LIBRARY_PATH", loader_path(dir))
                .env("MOEC_STANDIN_CACHE", standin_cache())
                .env("MOEC_STANDIN_COPY_DELAY_MS", delay.to_string());
        }
        Driver::Poisoned(dir) => {
            cmd.args(["--backend", "cuda"])
                .env("LD_LIBRARY_PATH", loader_path(dir))
                .env("MOEC_STANDIN_CACHE", standin_cache())
                .env("MOEC_CUDA_POISON_SCRATCH", "1");
        }
        Driver::Machine => {
            cmd.args(["--backend", "cuda"]);
        }
    }
    (cmd.output().expect("moec runs"), logits)
}

fn token_ids(out: &Output, what: &str) -> Vec<Vec<u32>> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_str(stdout.trim()).expect("--json output");
    doc["outputs"]
        .as_array()
        .expect("outputs")
        .iter()
        .map(|o| {
            o["token_ids"]
                .as_array()
                .expect("token_ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect()
        })
        .collect()
}

fn logits(path: &Path) -> Vec<Vec<f32>> {
    let text = std::fs::read_to_string(path).expect("logits file");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("logits JSON");
    doc["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|row| {
            row.as_array()
                .map(|r| {
                    r.iter()
                        .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

/// Every schedule on `card`: CPU and CUDA (stand-in) tokens equal, logits close.
fn every_schedule_matches_the_cpu_on(card: &str) {
    every_schedule_matches_the_cpu_with(card, &[]);
}

/// [`every_schedule_matches_the_cpu_on`] with `extra` flags on both runs.
fn every_schedule_matches_the_cpu_with(card: &str, extra: &[&str]) {
    schedules_match_the_cpu_with(card, extra, |_| true);
}

/// The schedules whose decode steps the CUDA backend can capture into a CUDA graph and
/// replay on the tiny cards (measured on mixtral-tiny and deepseek-v3-tiny at 4 new tokens
/// without `--dump-logits`: a plain step, a captured one, a replayed one; every other
/// schedule ran all its decode steps plainly). The sweep keeps 4 new tokens for them and
/// asserts that the last decode step replayed a graph, on every card (with
/// `--dump-logits`, whose logits read-back no longer stops the replay:
/// decode_steps_replay_with_dumped_logits_equal_to_plain_steps), so the dumped logits the
/// sweep compares with the CPU's are a replayed step's;
/// decode_steps_replay_a_captured_cuda_graph_with_the_cpu_tokens pins the graphs.
const GRAPH_SCHEDULES: [&str; 2] = ["baselines/gpu_resident", "flexgen"];

/// [`every_schedule_matches_the_cpu_with`] over the schedules whose name `keep` accepts.
///
/// The CPU side is one run of `baselines/resident` per generation length: every schedule
/// gives the oracle's tokens on the CPU backend (tests/runtime_invariance.rs: every
/// schedule on every tiny card and on the Mixtral and DBRX Q4_K_M files), and the CPU
/// schedules' logits differ from each other only by summation order (~1e-6), far inside
/// the bounds below; one reference instead of one per schedule halves the runs of this, the
/// suite's slowest binary.
///
/// Without a `--gen-len` in `extra`, a schedule in [`GRAPH_SCHEDULES`] generates 4 tokens
/// and every other 2 (the prefill and one decode step, which runs the same launches as any
/// later plain step): each stand-in run costs about 1 s of start and prefill plus about
/// 0.3 s a decode step on mixtral-tiny, so this saves about a quarter of the sweep.
fn schedules_match_the_cpu_with(card: &str, extra: &[&str], keep: impl Fn(&str) -> bool) {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let real = detect();
    let mut rows = Vec::new();
    let reference = schedules_common::schedule_files()
        .into_iter()
        .find(|(name, _)| name == "baselines/resident")
        .map(|(_, path)| path.to_string_lossy().into_owned())
        .expect("schedules/baselines/resident.sched");
    // Each schedule's arguments: 4 new tokens for a graph schedule, else 2, unless `extra`
    // sets them.
    let sweep: Vec<(String, String, Vec<&str>)> = schedules_common::schedule_files()
        .into_iter()
        .filter(|(name, _)| keep(name))
        .map(|(name, path)| {
            let graphs = GRAPH_SCHEDULES.contains(&name.as_str());
            let mut args = extra.to_vec();
            if !extra.contains(&"--gen-len") {
                args.extend(["--gen-len", if graphs { "4" } else { "2" }]);
            }
            (name, path.to_string_lossy().into_owned(), args)
        })
        .collect();
    // CPU tokens and last-step logits per generation length (the dumped logits are the
    // last step's, so each length needs its own reference run).
    let mut references = std::collections::BTreeMap::new();
    for (_, _, args) in &sweep {
        references.entry(args.clone()).or_insert_with(|| {
            let (cpu, cpu_logits) = run(cache.path(), &reference, card, Driver::Cpu, args);
            let want = token_ids(&cpu, &format!("{reference} on {card} {args:?}, CPU"));
            let want_logits = logits(&cpu_logits);
            let _ = std::fs::remove_file(cpu_logits);
            (want, want_logits)
        });
    }
    // The stand-in runs are independent processes: two at a time, so the sweep keeps both
    // of CI's cores busy when it is the last test still running (the suite's time on 2
    // cores is bounded); each result is checked below in schedule order, as before.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let worker = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some((_, schedule, args)) = sweep.get(i) else {
                return done;
            };
            let (cuda, cuda_logits) = run(
                cache.path(),
                schedule,
                card,
                Driver::Standin(dir.path(), 0),
                args,
            );
            // A failed run wrote no logits: its output is reported below (`token_ids`
            // shows its stderr) rather than a worker's panic on an empty file.
            let got_logits = if cuda.status.success() {
                logits(&cuda_logits)
            } else {
                Vec::new()
            };
            let _ = std::fs::remove_file(cuda_logits);
            done.push((i, cuda, got_logits));
        }
    };
    let mut results: Vec<_> = std::thread::scope(|scope| {
        let workers = [scope.spawn(worker), scope.spawn(worker)];
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a sweep worker panicked"))
            .collect()
    });
    results.sort_by_key(|(i, _, _)| *i);
    for (i, cuda, got_logits) in results {
        let (name, schedule, args) = &sweep[i];
        let (want, want_logits) = &references[args];
        let graphs = GRAPH_SCHEDULES.contains(&name.as_str());
        let got = token_ids(&cuda, &format!("{schedule} on {card}, CUDA (stand-in)"));
        let diff = max_diff(want_logits, &got_logits);
        let doc: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&cuda.stdout).trim()).expect("--json");
        let (replayed, captured, plain, why) = graph_counts(&doc, "decode");
        rows.push(format!(
            "{name:28} {card:13} {args:?} tokens equal: {:5}  max |logit diff| {diff:.2e}  \
             decode graphs: {replayed} replayed, {captured} captured, {plain} plain",
            *want == got
        ));
        // 4 tokens of a graph schedule: 3 decode steps, plain, captured, replayed, with the
        // dumped logits (the last, replayed step's) compared below; so every family's card
        // checks a replayed step against the CPU (all 8 did when this was written).
        let gen_len = args
            .iter()
            .position(|a| *a == "--gen-len")
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse::<u32>().ok());
        if graphs && gen_len == Some(4) {
            assert_eq!(
                (replayed, captured, plain),
                (1, 1, 1),
                "{schedule} on {card}: decode graphs {why}"
            );
        }
        assert_eq!(
            got, *want,
            "{schedule} on {card}: CUDA (stand-in) tokens differ from the CPU's"
        );
        // Float weights: both backends multiply the same f32 values in other orders, and
        // the logits agree to 1e-2. Quantised weights under the 8-bit product: an
        // activation within an f32 rounding of a code boundary takes the next code on one
        // backend (a step of the block's amax / 127), which moves the logits of this tiny
        // model by up to ~0.1 (measured 0.096); tokens must still be equal.
        let bound = if card.ends_with(".gguf") { 0.25 } else { 1e-2 };
        assert!(
            diff < bound,
            "{schedule} on {card}: logits differ by {diff}"
        );
        if real.missing().is_none() {
            let (gpu, _) = run(cache.path(), schedule, card, Driver::Machine, args);
            assert_eq!(
                token_ids(&gpu, &format!("{schedule} on {card}, real GPU")),
                *want,
                "{schedule} on {card}: real GPU"
            );
        }
    }
    println!("{}", rows.join("\n"));
    match real.missing() {
        Some(why) => println!("SKIPPED the real-GPU runs of these schedules: {why}"),
        None => println!("also ran every schedule on the real GPU: tokens equal"),
    }
}

/// llama.cpp's Q4_K_M tiny Mixtral (`scripts/gguf_fixtures.sh`: Q4_K attention, experts and
/// embedding, Q6_K `ffn_down`/`attn_v` on layer 1, a Q6_K lm_head, f32 norms and router)
/// through every schedule, with each backend's default product: the CUDA kernels quantise
/// activations once to ggml's 8-bit formats (`q8_quantize`, the CPU's codes) and take
/// integer products up to 16 rows (`linear_gemv_q8`, `moe_grouped_gemv_q8`; `dequant_f32`
/// and cuBLAS on `q8_roundtrip`'s values for the prompt's head and any product past 16 rows;
/// `embed_quant`), the CPU backend's 8-bit block arithmetic, and give the CPU backend's
/// tokens; 2 new tokens
/// per prompt keep the 10 schedules' 20 runs cheap. Skipped, saying so, without the
/// fixture.
#[test]
fn every_schedule_on_a_q4_k_m_gguf_through_the_cuda_backend_gives_the_cpu_tokens() {
    let Some(dir) = gguf_common::fixtures() else {
        println!(
            "q4_k_m gguf on cuda: SKIPPED: no mixtral-q4-Q4_K_M.gguf (run \
             scripts/gguf_fixtures.sh, or set MOEC_GGUF_FIXTURES)"
        );
        return;
    };
    let path = dir.join("mixtral-q4-Q4_K_M.gguf");
    every_schedule_matches_the_cpu_with(&path.to_string_lossy(), &["--gen-len", "2"]);
}

/// llama.cpp's Q4_K_M tiny DeepSeek-V2 (`scripts/gguf_fixtures.sh`: Q4_K `attn_k_b` and
/// `attn_v_b`, which the CUDA backend multiplies as stored through `mla_head_linear`,
/// decoding the blocks in the kernel, and the CPU through its quantised product) gives the
/// CPU backend's tokens, both with their default 8-bit product (the device rounds each
/// head's activations through `q8_roundtrip` first, as the Mixtral file above); 2 new
/// tokens per prompt. Three schedules cover where the
/// split halves run and how their bytes travel (every op on the GPU from copies made once;
/// CPU attention with paged weights; CPU experts) at a quarter of every schedule's cost
/// (all 11 agreed, logits within 1.1e-5, when this was written). Skipped, saying so,
/// without the fixture.
#[test]
fn schedules_on_a_deepseek_v2_q4_k_m_gguf_through_the_cuda_backend_give_the_cpu_tokens() {
    three_schedules_on_a_family_gguf("deepseek-v2-q4-Q4_K_M.gguf");
}

/// llama.cpp's Q4_K_M tiny DBRX (`scripts/gguf_fixtures.sh`: Q8_0 fused `attn_qkv` clamped
/// after the product, LayerNorm without bias, Q4_K/Q6_K experts whose down projections are
/// out-in as the converter transposes them) gives the CPU backend's tokens through three
/// schedules, both with their default 8-bit product; 2 new tokens per prompt. Skipped,
/// saying so, without the fixture.
#[test]
fn schedules_on_a_dbrx_q4_k_m_gguf_through_the_cuda_backend_give_the_cpu_tokens() {
    three_schedules_on_a_family_gguf("dbrx-q4-Q4_K_M.gguf");
}

/// The family fixture `file` (`scripts/gguf_fixtures.sh`) through three schedules (every op
/// on the GPU from copies made once; CPU attention with paged weights; CPU experts) on both
/// backends, 2 new tokens per prompt: tokens equal. Skipped, saying so, without the file.
fn three_schedules_on_a_family_gguf(file: &str) {
    let Some(dir) = gguf_common::family_fixtures().filter(|d| d.join(file).is_file()) else {
        println!(
            "{file} on cuda: SKIPPED: no {file} (run scripts/gguf_fixtures.sh, or set \
             MOEC_GGUF_FAMILY_FIXTURES)"
        );
        return;
    };
    let path = dir.join(file);
    schedules_match_the_cpu_with(&path.to_string_lossy(), &["--gen-len", "2"], |name| {
        ["baselines/gpu_resident", "cgopipe", "fiddler"].contains(&name)
    });
}

/// llama.cpp's tiny gpt-oss with the converter's MXFP4 experts (`scripts/gguf_fixtures.sh`:
/// `ffn_gate_exps`/`ffn_up_exps` interleaved back into one out-in MXFP4 `gate_up` per expert
/// at load, out-in MXFP4 `down`, f32 attention, sinks and biases) gives the CPU backend's
/// tokens, both with their default 8-bit product: the grouped expert kernels decode the
/// MXFP4 rows inside their products after `q8_roundtrip` rounds the activations through
/// Q8_0, as the CPU multiplies them. The experts of a Hub gpt-oss folder read the same way
/// (its `_blocks` / `_scales` repacked into these rows). Three schedules: every op on the
/// GPU, CPU attention with paged weights, CPU experts; 2 new tokens per prompt. Skipped,
/// saying so, without the fixture.
#[test]
fn schedules_on_a_gpt_oss_mxfp4_gguf_through_the_cuda_backend_give_the_cpu_tokens() {
    three_schedules_on_a_family_gguf("gpt-oss-q4-MXFP4.gguf");
}

/// No kernel reads scratch its task did not write (issue 44, point 7: `compute-sanitizer
/// --tool initcheck` flagged such reads on an H200, in `q8_roundtrip` and
/// `clamped_swiglu` over rows past the routed ones, fixed by live-row counts, and in the
/// bf16 head's `sum_halves`). Under `MOEC_CUDA_POISON_SCRATCH` every piece of scratch is
/// filled with NaN before its task gets it, however often the workspace was reused (the
/// stand-in fills only fresh allocations so), so a read of a word its task never wrote
/// changes the results: the poisoned run must give the unpoisoned run's tokens and logits
/// bit for bit (both CUDA on the stand-in, which is deterministic; the CPU comparison is
/// the other tests'). Runs the bf16 head (`split_bf16`, the GEMM, `sum_halves` over the 32k
/// vocabulary of mixtral-tiny), the fused gate and the normalising q|k|v launch, gpt-oss's
/// clamped SwiGLU with live rows, and (with the fixture) Q4_K_M's integer products and Q6_K
/// head, through `gpu_resident` (recorded decode steps) and `sequential` (the fused
/// `post_attn`). What it cannot see: a read whose value is dropped afterwards (a row past
/// the live count that nothing consumes), which initcheck reports and NaN does not show.
/// `cards` and, when the fixture is there, the Q4_K_M GGUF's path; else a line saying
/// `what` skipped it.
fn with_q4_k_m_fixture(cards: Vec<&str>, what: &str) -> Vec<String> {
    let mut cards: Vec<String> = cards.into_iter().map(str::to_string).collect();
    match gguf_common::fixtures() {
        Some(f) => cards.push(
            f.join("mixtral-q4-Q4_K_M.gguf")
                .to_string_lossy()
                .into_owned(),
        ),
        None => println!("{what}: the Q4_K_M fixture SKIPPED (run scripts/gguf_fixtures.sh)"),
    }
    cards
}

/// One `gpu scratch on <stream>: peak X B a task (task), arena Y B, budgeted Z B (task)`
/// clause of a run report: (stream, peak, arena, budgeted).
fn scratch_clauses(text: &str) -> Vec<(String, u64, u64, u64)> {
    let number = |s: &str, after: &str| -> Option<u64> {
        let at = s.find(after)? + after.len();
        s[at..].split(' ').next()?.parse().ok()
    };
    text.split("; gpu scratch on ")
        .skip(1)
        .filter_map(|clause| {
            let (stream, rest) = clause.split_once(": peak ")?;
            let peak = rest.split(' ').next()?.parse().ok()?;
            Some((
                stream.to_string(),
                peak,
                number(rest, "arena ")?,
                number(rest, "budgeted ")?,
            ))
        })
        .collect()
}

/// Bound over measured peak a stream's budgeted scratch may be at most, when its largest
/// task runs at the workload's shape (the longest prompt of the plan's): the rules take
/// the larger side where the run decides (the routing, the split into sequences), so
/// they stay above the peak, but not by more than this.
const SCRATCH_BOUND_FACTOR: f64 = 4.0;

/// Every device task of a run takes at most its stream's budgeted scratch
/// (`runtime::cuda::scratch`, the bound `moec check` counts and the backend reserves each
/// stream's workspace at), and the bound is within [`SCRATCH_BOUND_FACTOR`] of the
/// measured peak: on the stand-in, gpu_resident (one compute stream) over two 300-token
/// prompts in one micro-batch (600 prefill tokens: the bf16 GEMMs' pairs, the
/// host-grouped experts past 1,024 routed entries at top-2, attention's scores) and two
/// decode steps, on mixtral-tiny, DeepSeek-V2-tiny (MLA's scores, its dense first layer,
/// a shared expert) and, with the fixture, the Q4_K_M GGUF (integer products, quantised
/// weights decoded whole past 16 rows); and fiddler (a compute stream beside copy
/// streams) on mixtral-tiny. The run report says so per stream, and never `BUDGET
/// VIOLATION`. About 80 s a run through the stand-in in a debug build.
#[test]
fn every_task_takes_at_most_its_streams_budgeted_scratch() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let cards = with_q4_k_m_fixture(vec!["mixtral-tiny", "deepseek-v2-tiny"], "budgeted scratch");
    let mut runs: Vec<(&str, &str)> = cards
        .iter()
        .map(|c| (c.as_str(), "schedules/baselines/gpu_resident.sched"))
        .collect();
    runs.push(("mixtral-tiny", "schedules/fiddler.sched"));
    for (card, schedule) in runs {
        let model = if card.ends_with(".gguf") {
            "--weights"
        } else {
            "--model"
        };
        let out = Command::new(env!("CARGO_BIN_EXE_moec"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("MOEC_CACHE_DIR", cache.path())
            .args(["run", schedule, model, card, "--json", "--backend", "cuda"])
            // Both prompts in one micro-batch: the plan's shapes are the run's.
            .args(["--workload", "count=2,mean=300,min=300,max=300,gen=3"])
            .args(["--set", "ubs=2"])
            .args(["--hw", "hardware/t4.ron"])
            .env("LD_LIBRARY_PATH", loader_path(dir.path()))
            .env("MOEC_STANDIN_CACHE", standin_cache())
            .output()
            .expect("moec runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{schedule} on {card}: {stdout}\n{stderr}"
        );
        let clauses = scratch_clauses(&stdout);
        assert!(
            !clauses.is_empty(),
            "{schedule} on {card}: no scratch clause: {stdout}"
        );
        assert!(
            !stdout.contains("BUDGET VIOLATION"),
            "{schedule} on {card}: {stdout}"
        );
        for (stream, peak, arena, budgeted) in clauses {
            println!(
                "{schedule} on {card}: {stream}: peak {peak} B, arena {arena} B, \
                     budgeted {budgeted} B ({:.2}x)",
                budgeted as f64 / peak.max(1) as f64
            );
            assert!(peak <= budgeted, "{schedule} on {card}, {stream}: {stdout}");
            // Reserved at the bound, never grown.
            assert_eq!(
                arena,
                budgeted.next_multiple_of(256),
                "{schedule} on {card}, {stream}"
            );
            if peak > 0 {
                assert!(
                    budgeted as f64 <= SCRATCH_BOUND_FACTOR * peak as f64,
                    "{schedule} on {card}, {stream}: budgeted {budgeted} B is more than \
                         {SCRATCH_BOUND_FACTOR}x the peak {peak} B"
                );
            }
        }
    }
}

#[test]
fn no_kernel_reads_scratch_its_task_did_not_write() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let cards = with_q4_k_m_fixture(vec!["mixtral-tiny", "gpt-oss-tiny"], "poisoned scratch");
    for card in &cards {
        // `sequential` streams every layer through one slot: its scratch reuse differs from
        // `gpu_resident`'s, but its kernels are the same, so one card is enough for it
        // (the suite's time on 2 cores is bounded).
        let schedules: &[&str] = if card == "mixtral-tiny" {
            &[
                "schedules/baselines/gpu_resident.sched",
                "schedules/baselines/sequential.sched",
            ]
        } else {
            &["schedules/baselines/gpu_resident.sched"]
        };
        for &schedule in schedules {
            let extra = ["--gen-len", "3"];
            let clean = Driver::Standin(dir.path(), 0);
            let (plain, plain_logits) = run(cache.path(), schedule, card, clean, &extra);
            let poisoned = Driver::Poisoned(dir.path());
            let (cuda, cuda_logits) = run(cache.path(), schedule, card, poisoned, &extra);
            let want = token_ids(&plain, &format!("{schedule} on {card}, CUDA"));
            let got = token_ids(&cuda, &format!("{schedule} on {card}, poisoned scratch"));
            let (a, b) = (logits(&plain_logits), logits(&cuda_logits));
            let finite = !b.is_empty() && b.iter().flatten().all(|v| v.is_finite());
            let same = a.len() == b.len()
                && a.iter().zip(&b).all(|(x, y)| {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
                });
            println!(
                "{schedule} on {card}, poisoned scratch: logits finite {finite}, tokens and \
                 logits those of the unpoisoned run: {}",
                same && got == want
            );
            assert!(
                finite,
                "{schedule} on {card}: a kernel read poisoned scratch (NaN logits)"
            );
            assert_eq!(
                got, want,
                "{schedule} on {card}: poisoned scratch changed the tokens"
            );
            assert!(
                same,
                "{schedule} on {card}: poisoned scratch changed the logits"
            );
            for f in [plain_logits, cuda_logits] {
                let _ = std::fs::remove_file(f);
            }
        }
    }
}

#[test]
fn every_schedule_on_mixtral_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("mixtral-tiny");
}

#[test]
fn every_schedule_on_dbrx_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("dbrx-tiny");
}

/// Qwen3-MoE: per-head q/k RMSNorm.
#[test]
fn every_schedule_on_qwen3_moe_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("qwen3-moe-tiny");
}

/// OLMoE: q/k RMSNorm over the whole projections.
#[test]
fn every_schedule_on_olmoe_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("olmoe-tiny");
}

/// Qwen2-MoE: q/k/v biases and the sigmoid-gated shared expert in `gate` and `combine`.
#[test]
fn every_schedule_on_qwen2_moe_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("qwen2-moe-tiny");
}

/// gpt-oss: attention sinks, sliding window on even layers, q/k/v/o, router and expert
/// biases, top-k-then-softmax routing, clamped SwiGLU, YaRN rotary tables.
#[test]
fn every_schedule_on_gpt_oss_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    // 4 new tokens on every schedule, as before the sweep shortened the others: the longer
    // prompt plus them pass the 8-token window (2 were not checked to).
    every_schedule_matches_the_cpu_with("gpt-oss-tiny", &["--gen-len", "4"]);
}

/// DeepSeek-V2: multi-head latent attention (no query rank), group-limited greedy softmax
/// routing, two shared experts, a leading dense layer, YaRN.
#[test]
fn every_schedule_on_deepseek_v2_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("deepseek-v2-tiny");
}

/// DeepSeek-V3: MLA with the query rank, sigmoid routing with the correction bias over
/// groups, renormalised and scaled, two shared experts, a leading dense layer, YaRN.
#[test]
fn every_schedule_on_deepseek_v3_tiny_through_the_cuda_backend_gives_the_cpu_tokens() {
    every_schedule_matches_the_cpu_on("deepseek-v3-tiny");
}

/// Dropping one cross-stream event (event 6 of each step of `baselines/sequential`: a
/// host-to-device copy that compute must wait for) makes the stand-in run fail or change
/// its tokens: its streams really run concurrently. The stand-in delays every
/// host-to-device copy by 30 ms, so the missing wait shows every time, not by chance; the
/// same run with the wait kept gives the CPU's tokens under the same delay. 2 new tokens
/// (the prefill and one decode step): the delays are most of these runs' time (measured
/// 13 s a run against 22 s at 4 tokens), and the dropped wait already zeroes the second
/// prompt's tokens from the prefill on.
#[test]
fn a_dropped_cross_stream_event_fails_the_run_or_changes_its_tokens() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/baselines/sequential.sched";
    let two = ["--gen-len", "2"];
    let (cpu, _) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, &two);
    let want = token_ids(&cpu, "CPU");
    // The two stand-in runs side by side: each spends most of its time asleep in the
    // copy delays, so together they take about the time of one.
    let ((kept, _), (dropped, _)) = std::thread::scope(|scope| {
        let kept = scope.spawn(|| {
            run(
                cache.path(),
                schedule,
                "mixtral-tiny",
                Driver::Standin(dir.path(), 30),
                &two,
            )
        });
        let dropped = run(
            cache.path(),
            schedule,
            "mixtral-tiny",
            Driver::Standin(dir.path(), 30),
            &["--test-drop-event", "6", "--gen-len", "2"],
        );
        (kept.join().expect("the kept run's thread"), dropped)
    });
    assert_eq!(token_ids(&kept, "stand-in, every event kept"), want);
    if dropped.status.success() {
        let got = token_ids(&dropped, "stand-in, event 6 dropped");
        println!("event 6 dropped: tokens {got:?} (CPU: {want:?})");
        assert_ne!(
            got, want,
            "the run without the wait gave the right tokens: streams did not race"
        );
    } else {
        println!(
            "event 6 dropped: the run failed: {}",
            String::from_utf8_lossy(&dropped.stderr).trim()
        );
    }
}

/// Issue 45: lookahead gating on the CUDA path. `pregated.sched` runs `pregate` (layer
/// l + 1's norm and router into device scratch), reads its routing back and prefetches
/// the experts it selected on their own stream while the on-demand fetches run on
/// another (copies delayed 2 ms by the stand-in): the tokens equal the CPU's, and the
/// report measured the prediction.
#[test]
fn lookahead_gated_prefetch_matches_the_cpu_on_the_device_path() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/pregated.sched";
    let (cpu, _) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, &[]);
    let (cuda, _) = run(
        cache.path(),
        schedule,
        "mixtral-tiny",
        Driver::Standin(dir.path(), 2),
        &[],
    );
    let want = token_ids(&cpu, "pregated, CPU");
    let got = token_ids(&cuda, "pregated, CUDA (stand-in)");
    assert_eq!(got, want, "pregated: CUDA (stand-in) tokens differ");
    let doc: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&cuda.stdout).trim()).expect("json");
    let lookahead = doc["predictions"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["predictor"] == "lookahead"))
        .unwrap_or_else(|| panic!("no lookahead prediction: {}", doc["predictions"]));
    assert!(
        lookahead["hits"].as_u64().is_some_and(|h| h > 0),
        "{lookahead}"
    );
}

/// The residency and routing-score guards on the CUDA path
/// (`tests/fixtures/guards/resident_score.sched`: a cache hit from its slot, a miss with a
/// large weight through a staging slot, one with a small weight on the CPU), with copies
/// delayed 2 ms by the stand-in so prefetches are in flight while guards are decided: the
/// tokens equal the CPU's with the largest and the summed weight and a 2-slot cache, and
/// the cache both hit and missed.
#[test]
fn residency_and_score_guards_match_the_cpu_on_the_device_path() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "tests/fixtures/guards/resident_score.sched";
    for extra in [
        &[][..],
        &["--set", "sum=1", "--set", "thr=0.6", "--set", "n_cache=2"][..],
    ] {
        let (cpu, _) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, extra);
        let (cuda, _) = run(
            cache.path(),
            schedule,
            "mixtral-tiny",
            Driver::Standin(dir.path(), 2),
            extra,
        );
        let want = token_ids(&cpu, &format!("{extra:?}, CPU"));
        let got = token_ids(&cuda, &format!("{extra:?}, CUDA (stand-in)"));
        assert_eq!(got, want, "{extra:?}: CUDA (stand-in) tokens differ");
        let doc: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&cuda.stdout).trim()).expect("json");
        let total = &doc["caches"][0]["total"];
        assert!(
            total["hits"].as_u64().is_some_and(|h| h > 0)
                && total["misses"].as_u64().is_some_and(|m| m > 0),
            "{extra:?}: {total}"
        );
    }
}

/// MoE-Infinity's expert cache on the CUDA path: with the fewest slots the checker accepts,
/// aggressive prefetching (every expert of the next 3 layers) and slow copies (the
/// stand-in delays each by 2 ms), fetches, prefetches and reads of one slot run on three
/// streams at once; the fences must keep every slot's copies and reads in order, so the
/// tokens equal the CPU's for every eviction policy, and the cache really misses.
#[test]
fn the_expert_cache_keeps_slots_consistent_across_device_streams() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/moe_infinity.sched";
    for policy in ["0", "1", "2"] {
        let sets = [
            "--set",
            "n_cache=2",
            "--set",
            "lookahead=3",
            "--set",
            "n_pf=8",
            "--set",
        ];
        let policy_set = format!("policy={policy}");
        let mut extra: Vec<&str> = sets.to_vec();
        extra.push(&policy_set);
        let (cpu, _) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, &extra);
        let (cuda, _) = run(
            cache.path(),
            schedule,
            "mixtral-tiny",
            Driver::Standin(dir.path(), 2),
            &extra,
        );
        let want = token_ids(&cpu, &format!("policy {policy}, CPU"));
        let got = token_ids(&cuda, &format!("policy {policy}, CUDA (stand-in)"));
        assert_eq!(got, want, "policy {policy}: CUDA (stand-in) tokens differ");
        let doc: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&cuda.stdout).trim()).expect("json");
        let misses = doc["caches"][0]["total"]["misses"]
            .as_u64()
            .expect("misses");
        let evictions = doc["caches"][0]["total"]["evictions"]
            .as_u64()
            .expect("evictions");
        assert!(
            misses > 2 && evictions > 0,
            "policy {policy}: {}",
            doc["caches"]
        );
    }
    // Hits on prefetched experts still in flight: 8 prefetches of 20 ms each queue on the
    // prefetch stream while the next layer's fetches find them resident; a hit must wait
    // for the copy that fills its slot.
    let extra = [
        "--set",
        "n_cache=8",
        "--set",
        "lookahead=1",
        "--set",
        "n_pf=8",
    ];
    let (cpu, _) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, &extra);
    let (cuda, _) = run(
        cache.path(),
        schedule,
        "mixtral-tiny",
        Driver::Standin(dir.path(), 20),
        &extra,
    );
    let want = token_ids(&cpu, "prefetch hits, CPU");
    let got = token_ids(&cuda, "prefetch hits, CUDA (stand-in)");
    assert_eq!(got, want, "prefetch hits: CUDA (stand-in) tokens differ");
    let doc: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&cuda.stdout).trim()).expect("json");
    let used = doc["caches"][0]["total"]["prefetch_used"]
        .as_u64()
        .expect("used");
    assert!(used > 0, "no prefetched expert was hit: {}", doc["caches"]);
}

/// A counted run's tokens, the stand-in's counters (name -> count) and its `--json`.
type Counted = (
    Vec<Vec<u32>>,
    std::collections::BTreeMap<String, u64>,
    serde_json::Value,
);

/// The stand-in's call counters of one `moec run --backend cuda` (`MOEC_STANDIN_COUNTERS`)
/// on mixtral-tiny (or the `--weights` in `extra`), with `env` set: entry point or
/// `launch:<kernel>` -> calls; with its tokens and `--json` document.
fn counted_run(
    cache: &Path,
    dir: &Path,
    schedule: &str,
    prompts: &[&str],
    gen_len: u32,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Counted {
    let counters = tempfile::NamedTempFile::new().expect("temp file");
    // mixtral-tiny unless `extra` names a checkpoint (`--weights`) or a model.
    let model: &[&str] = if extra.contains(&"--weights") || extra.contains(&"--model") {
        &[]
    } else {
        &["--model", "mixtral-tiny"]
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_moec"));
    cmd.envs(env.iter().copied());
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache)
        .args(["run", schedule, "--json"])
        .args(model)
        .args(["--gen-len", &gen_len.to_string(), "--hw", "hardware/t4.ron"])
        .args(["--backend", "cuda"])
        .args(extra)
        .env("LD_LIBRARY_PATH", loader_path(dir))
        .env("MOEC_STANDIN_CACHE", standin_cache())
        .env("MOEC_STANDIN_COUNTERS", counters.path());
    for p in prompts {
        cmd.args(["--prompt", p]);
    }
    let out = cmd.output().expect("moec runs");
    let tokens = token_ids(&out, &format!("{schedule} (counted)"));
    let doc: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("--json");
    let text = std::fs::read_to_string(counters.path()).expect("counters file");
    let counts = text
        .lines()
        .filter_map(|l| {
            let (name, n) = l.rsplit_once(' ')?;
            Some((name.to_string(), n.parse().ok()?))
        })
        .collect();
    (tokens, counts, doc)
}

/// The run report's graph counts of one step kind: (replayed, captured, plain, reasons).
fn graph_counts(doc: &serde_json::Value, step: &str) -> (u64, u64, u64, String) {
    let row = doc["report"]["graphs"]
        .as_array()
        .expect("report.graphs")
        .iter()
        .find(|g| g["step"] == step)
        .cloned()
        .unwrap_or_default();
    let n = |k: &str| row[k].as_u64().unwrap_or(0);
    (
        n("replayed"),
        n("captured"),
        n("plain"),
        row["plain_reasons"].to_string(),
    )
}

fn calls(counts: &std::collections::BTreeMap<String, u64>, name: &str) -> u64 {
    counts.get(name).copied().unwrap_or(0)
}

/// MoE on the device, counted by the stand-in: on a schedule without routing guards the
/// `experts` op (`baselines/gpu_resident`: gate, experts over every expert, combine) and
/// the fused `post_attn` (`baselines/sequential`) group tokens per expert on the GPU and
/// run each projection as one grouped launch over every expert's segment. So per (layer,
/// micro-batch) they cost a fixed number of launches whatever the routing (`moe_group`
/// once, then `moe_grouped_gemv` twice: gate+up+SwiGLU and down; no per-expert `gather_rows` /
/// `scatter_weighted` / cuBLAS GEMM), and a decode step synchronises with the host only
/// for `sample` (once per micro-batch) and at its end (once per device stream): no routing
/// read-back, which would add one per (layer, micro-batch). Two prompt sets route
/// differently (with the host grouping this replaced, `gpu_resident` at 4 tokens made 994
/// vs 967 launches, 306 vs 297 GEMMs, 78 vs 75 `gather_rows`), yet every launch, GEMM,
/// synchronisation and upload count is the same.
#[test]
fn moe_on_the_device_costs_the_same_calls_whatever_the_routing_and_no_routing_sync() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let mixtral_layers = 4u64;
    // (schedule, micro-batches the two prompts occupy: `gpu_resident` has one, the
    // default `sequential` four, each prompt in its own)
    for (schedule, n_ub) in [
        ("schedules/baselines/gpu_resident.sched", 1u64),
        ("schedules/baselines/sequential.sched", 2),
    ] {
        let (_, a, doc) = counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 4, &[], &[]);
        let (_, b, _) = counted_run(
            cache.path(),
            dir.path(),
            schedule,
            &["Mixture of apples", "The capital of Spain is"],
            4,
            &[],
            &[],
        );
        let (_, short, _) = counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 2, &[], &[]);
        // prefill + 3 decode steps for 4 tokens; a decode step that replays a CUDA graph
        // makes no launch call (its kernels run from the graph).
        let (replayed, _, _, _) = graph_counts(&doc, "decode");
        let steps = 4u64 - replayed;
        let moe_tasks = mixtral_layers * n_ub * steps;
        assert_eq!(
            calls(&a, "launch:moe_group"),
            moe_tasks,
            "{schedule}: {a:?}"
        );
        // Mixtral stores its experts [out, in]: the few-row form runs them (its one-row
        // form at a decode step of one sequence), gate, up and SwiGLU in one launch, then
        // down.
        assert_eq!(
            calls(&a, "launch:moe_grouped_gemv")
                + calls(&a, "launch:moe_grouped_gemv_1")
                + calls(&a, "launch:moe_grouped_gemv_rows")
                + calls(&a, "launch:moe_grouped_linear"),
            2 * moe_tasks,
            "{schedule}"
        );
        assert_eq!(calls(&a, "launch:scatter_weighted"), 0, "{schedule}");
        for name in [
            "cuLaunchKernel",
            "cublasGemmEx",
            "cublasSgemm_v2",
            "cuStreamSynchronize",
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2",
            "launch:gather_rows",
        ] {
            assert_eq!(
                calls(&a, name),
                calls(&b, name),
                "{schedule}: {name} depends on the routing"
            );
        }
        // Two more decode steps: `sample`'s read-back synchronises once per micro-batch,
        // the step's end once per device stream (at most 3); a routing read-back would add
        // one per (layer, micro-batch).
        let per_step = |name: &str| (calls(&a, name) - calls(&short, name)) / 2;
        assert!(
            per_step("cuStreamSynchronize") <= n_ub + 3,
            "{schedule}: {} stream synchronisations per decode step",
            per_step("cuStreamSynchronize")
        );
        println!(
            "{schedule}: per decode step {} launches, {} GEMMs, {} stream syncs, {} uploads; \
             per (layer, micro-batch) MoE: 3 launches, 0 GEMMs, 0 syncs, 1 upload",
            per_step("cuLaunchKernel"),
            per_step("cublasGemmEx") + per_step("cublasSgemm_v2"),
            per_step("cuStreamSynchronize"),
            per_step("cuMemcpyHtoDAsync_v2"),
        );
    }
}

/// Quantised weights add no host synchronisation and no call per expert: on llama.cpp's
/// Q4_K_M tiny Mixtral (2 layers) `baselines/gpu_resident` runs its experts as integer
/// products (per (layer, step) one `moe_group` and two `moe_grouped_gemv_q8` launches:
/// gate+up+SwiGLU, down), quantises each input once (`q8_quantize`: q|k|v share one; no
/// `q8_roundtrip`), runs the vocabulary head through `linear_gemv_q8` (no `dequant_f32`),
/// and a decode step synchronises only for `sample` and at its end; with one prompt the
/// decode steps' integer products quantise their row themselves (`*_q8_x1`) and give the
/// CPU backend's tokens. Skipped, saying so, without the fixture.
#[test]
fn quantised_moe_on_the_device_adds_no_synchronisation_or_per_expert_call() {
    let Some(fixtures) = gguf_common::fixtures() else {
        println!(
            "quantised MoE counters: SKIPPED: no mixtral-q4-Q4_K_M.gguf (run \
             scripts/gguf_fixtures.sh, or set MOEC_GGUF_FIXTURES)"
        );
        return;
    };
    let path = fixtures.join("mixtral-q4-Q4_K_M.gguf");
    let weights = ["--weights", path.to_str().expect("UTF-8 path")];
    let (cache, dir) = (tempfile::tempdir().expect("cache"), standin_dir());
    let schedule = "schedules/baselines/gpu_resident.sched";
    let (_, a, doc) = counted_run(
        cache.path(),
        dir.path(),
        schedule,
        &PROMPTS,
        4,
        &weights,
        &[],
    );
    let (_, short, _) = counted_run(
        cache.path(),
        dir.path(),
        schedule,
        &PROMPTS,
        2,
        &weights,
        &[],
    );
    let (replayed, _, _, _) = graph_counts(&doc, "decode");
    let steps = 4u64 - replayed;
    let moe_tasks = 2 * steps;
    assert_eq!(calls(&a, "launch:moe_group"), moe_tasks, "{a:?}");
    // Integer products: gate+up+SwiGLU, then down, per (layer, step); no float product.
    // Two prompts decode two rows a step: the R = 16 kernels (not the row-generic ones,
    // MOEC_Q8_KERNELS unset), after q8_quantize.
    assert_eq!(
        calls(&a, "launch:moe_grouped_gemv_q8_r16"),
        2 * moe_tasks,
        "{a:?}"
    );
    assert_eq!(calls(&a, "launch:moe_grouped_gemv_q8"), 0, "{a:?}");
    assert_eq!(
        calls(&a, "launch:moe_grouped_gemv") + calls(&a, "launch:moe_grouped_linear"),
        0
    );
    assert_eq!(
        calls(&a, "launch:gather_rows"),
        steps,
        "the head's last rows only: {a:?}"
    );
    // Activations quantised once per input: per layer q|k|v share one, o one, the
    // experts' input and hidden rows one each; the head one; nothing rounded to f32.
    assert_eq!(
        calls(&a, "launch:q8_quantize"),
        (2 * 4 + 1) * steps,
        "{a:?}"
    );
    assert_eq!(calls(&a, "launch:q8_roundtrip"), 0, "{a:?}");
    // The vocabulary head (Q6_K) through linear_gemv_q8, no decoded copy.
    assert_eq!(calls(&a, "launch:dequant_f32"), 0, "{a:?}");
    assert_eq!(calls(&a, "launch:embed_quant"), steps, "{a:?}");
    let per_step = |name: &str| (calls(&a, name) - calls(&short, name)) / 2;
    assert!(
        per_step("cuStreamSynchronize") <= 1 + 3,
        "{} stream synchronisations per decode step",
        per_step("cuStreamSynchronize")
    );
    // One prompt: a batch-1 decode step's integer products quantise their row themselves
    // (`*_q8_x1`; the prefill's rows take the R = 16 kernels), with the CPU's tokens.
    let one = [PROMPTS[0]];
    let (tokens1, b, doc1) =
        counted_run(cache.path(), dir.path(), schedule, &one, 4, &weights, &[]);
    let (replayed1, _, _, _) = graph_counts(&doc1, "decode");
    let decode1 = 3u64 - replayed1;
    assert_eq!(
        calls(&b, "launch:moe_grouped_gemv_q8_x1"),
        2 * 2 * decode1,
        "{b:?}"
    );
    assert_eq!(calls(&b, "launch:moe_grouped_gemv_q8"), 0, "{b:?}");
    let mut cpu = Command::new(env!("CARGO_BIN_EXE_moec"));
    cpu.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache.path())
        .args(["run", schedule, "--json", "--gen-len", "4"])
        .args(["--hw", "hardware/t4.ron", "--prompt", one[0]])
        .args(weights);
    let cpu1 = token_ids(&cpu.output().expect("moec runs"), "one prompt, CPU");
    assert_eq!(tokens1, cpu1, "one prompt: cuda (*_q8_x1) vs cpu");
    println!(
        "q4_k_m gpu_resident, one prompt: {} moe_grouped_gemv_q8_x1, {} linear_gemv_q8_x1, {} \
         linear_gemv3_q8_x1, {} q8_quantize launches; the CPU's tokens",
        calls(&b, "launch:moe_grouped_gemv_q8_x1"),
        calls(&b, "launch:linear_gemv_q8_x1"),
        calls(&b, "launch:linear_gemv3_q8_x1"),
        calls(&b, "launch:q8_quantize"),
    );
    println!(
        "q4_k_m gpu_resident: {replayed} decode steps replayed a graph; per decode step {} \
         stream syncs; {} moe_group, {} moe_grouped_gemv_q8_r16, {} q8_quantize launches in {steps} \
         launched steps",
        per_step("cuStreamSynchronize"),
        calls(&a, "launch:moe_group"),
        calls(&a, "launch:moe_grouped_gemv_q8_r16"),
        calls(&a, "launch:q8_quantize"),
    );
}

/// CUDA graphs (issue 28): decode steps of `baselines/gpu_resident`, `fiddler` with every
/// expert resident (mixtral-tiny: 4 layers x 8 experts = 32) and `flexgen` are recorded,
/// captured into a graph when a step repeats the previous one's launches, and replayed
/// after that, with the CPU backend's tokens. Six tokens are five decode steps: the first
/// launched plainly, the second captured, three replayed; the run report says so and the
/// stand-in's counters agree (one capture and instantiation, a graph launch per captured
/// or replayed step, nothing refused while capturing), and a seventh token, one more
/// replayed step, costs one graph launch and no kernel launch, GEMM or copy call. A step
/// with a host decision inside it (fiddler with most experts off the GPU: its guards need
/// the routing on the host) is not captured, and the report says why. VSLPipe's mixed
/// steps too ([`vslpipe_mixed_steps_replay_a_graph_once_their_shape_repeats`]).
#[test]
fn decode_steps_replay_a_captured_cuda_graph_with_the_cpu_tokens() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    for (schedule, extra) in [
        ("schedules/baselines/gpu_resident.sched", &[][..]),
        (
            "schedules/fiddler.sched",
            &["--set", "n_gpu=32", "--set", "ubs=2"][..],
        ),
        ("schedules/flexgen.sched", &[][..]),
        ("schedules/cgopipe.sched", &[][..]),
    ] {
        let mut cpu = Command::new(env!("CARGO_BIN_EXE_moec"));
        cpu.current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("MOEC_CACHE_DIR", cache.path())
            .args(["run", schedule, "--model", "mixtral-tiny", "--json"])
            .args(["--gen-len", "6", "--hw", "hardware/t4.ron"])
            .args(extra);
        for p in PROMPTS {
            cpu.args(["--prompt", p]);
        }
        let want = token_ids(
            &cpu.output().expect("moec runs"),
            &format!("{schedule}, CPU"),
        );
        let (got, counts, doc) =
            counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 6, extra, &[]);
        assert_eq!(
            got, want,
            "{schedule}: CUDA graph tokens differ from the CPU's"
        );
        let (replayed, captured, plain, why) = graph_counts(&doc, "decode");
        println!("{schedule}: decode steps {replayed} replayed, {captured} captured, {plain} plain {why}");
        assert_eq!((replayed, captured, plain), (3, 1, 1), "{schedule}: {why}");
        assert!(
            why.contains("the first step with these launches"),
            "{schedule}: {why}"
        );
        assert_eq!(calls(&counts, "cuStreamBeginCapture_v2"), 1, "{schedule}");
        assert_eq!(
            calls(&counts, "cuGraphInstantiateWithFlags"),
            1,
            "{schedule}"
        );
        assert_eq!(calls(&counts, "cuGraphLaunch"), 4, "{schedule}");
        let refused: Vec<_> = counts
            .keys()
            .filter(|k| k.starts_with("capture refused:"))
            .collect();
        assert!(refused.is_empty(), "{schedule}: {refused:?}");
        let (more, more_counts, more_doc) =
            counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 7, extra, &[]);
        assert_eq!(
            more.iter().map(|t| t[..6].to_vec()).collect::<Vec<_>>(),
            want
        );
        assert_eq!(graph_counts(&more_doc, "decode").0, 4, "{schedule}");
        for name in [
            "cuLaunchKernel",
            "cublasGemmEx",
            "cublasSgemm_v2",
            "cuMemcpyHtoDAsync_v2",
        ] {
            assert_eq!(
                calls(&more_counts, name),
                calls(&counts, name),
                "{schedule}: a replayed step called {name}"
            );
        }
        // A step launched without its ops copies its read-back out of its device buffer
        // (the backend counts those copies); no other copy.
        assert_eq!(
            calls(&more_counts, "cuMemcpyDtoHAsync_v2") - read_back_copies(&more_doc),
            calls(&counts, "cuMemcpyDtoHAsync_v2") - read_back_copies(&doc),
            "{schedule}: a replayed step called cuMemcpyDtoHAsync_v2"
        );
        assert_eq!(calls(&more_counts, "cuGraphLaunch"), 5, "{schedule}");
        if schedule.ends_with("cgopipe.sched") {
            cgopipe_host_nodes(&counts, &more_counts, &doc);
        }
    }
    vslpipe_mixed_steps_replay_a_graph_once_their_shape_repeats(cache.path(), dir.path());
    // A host decision inside the step: no graph, and why.
    let (_, counts, doc) = counted_run(
        cache.path(),
        dir.path(),
        "schedules/fiddler.sched",
        &PROMPTS,
        6,
        &[
            "--set",
            "n_gpu=8",
            "--set",
            "ubs=2",
            "--set",
            "t_copy=1000000",
        ],
        &[],
    );
    let (replayed, captured, plain, why) = graph_counts(&doc, "decode");
    assert_eq!((replayed, captured, plain), (0, 0, 5), "{why}");
    assert!(why.contains("read back to the host"), "{why}");
    assert_eq!(calls(&counts, "cuStreamBeginCapture_v2"), 0);
    // Its guards read the routing back once per layer and step (issue 44 point 4 counts
    // them): 4 layers x (1 prefill + 5 decode steps) = 24, 4 a step.
    let line = doc["backend"].as_str().expect("backend line");
    assert!(
        line.contains("; 24 routing read-backs for the plan's guards;"),
        "{line}"
    );
}

/// Issue 44 point 4, on the counts of `decode_steps_replay_a_captured_cuda_graph_with_the_cpu_tokens`:
/// CGOPipe's decode step, whose `cpu` stream waits for the device in every layer (CPU
/// attention between the GPU's pre- and post-attention), is recorded with its host tasks
/// as host nodes of the step's graph (`runtime::cuda::graph::HostRole`): `embed` and `attn`
/// on the host lane of `cpu`, their waits and records as events there, and `W_CToPin` on
/// `pin` moving labels while the step is recorded. On mixtral-tiny (4 layers), 2 prompts
/// in micro-batch 0 of 4: the graph holds 4 x 4 = 16 `attn` and 4 `embed` host nodes, 20
/// (5 a layer); the plain first step and the capture submit them (40 `cuLaunchHostFunc`),
/// replays none, and a replayed step (7 tokens against 6) waits on no event from the host.
/// Before host nodes (`MOEC_CUDA_HOST_NODES=off`) every decode step ran plainly ("a host
/// stream waits for device work inside the step"), with the same tokens (docs/gpu.md).
fn cgopipe_host_nodes(
    counts: &std::collections::BTreeMap<String, u64>,
    more_counts: &std::collections::BTreeMap<String, u64>,
    doc: &serde_json::Value,
) {
    let host_nodes = calls(counts, "captured:cuLaunchHostFunc");
    let kernel_nodes: u64 = counts
        .iter()
        .filter(|(k, _)| k.starts_with("captured:cuLaunchKernel"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(host_nodes, 20, "{counts:?}");
    assert_eq!(calls(counts, "cuLaunchHostFunc"), 2 * host_nodes);
    for name in ["cuLaunchHostFunc", "cuEventSynchronize"] {
        assert_eq!(
            calls(more_counts, name),
            calls(counts, name),
            "a replayed cgopipe step called {name}"
        );
    }
    let line = doc["backend"].as_str().expect("backend line");
    assert!(
        line.contains(&format!(
            "{} host tasks run as host nodes of recorded steps",
            5 * host_nodes
        )),
        "{line}"
    );
    println!(
        "cgopipe's decode graph on mixtral-tiny: {kernel_nodes} kernel nodes, {host_nodes} host \
         nodes ({} a layer)",
        host_nodes / 4
    );
}

/// Issue 44: `--dump-logits` (a read-back of each step's logits into pinned staging, part
/// of the captured work) does not stop graph replay: `baselines/gpu_resident` on
/// mixtral-tiny generating 4 tokens runs its 3 decode steps plain, captured, replayed with
/// the dump as without it (before the fix of `Staging`, the step after the one that grew
/// the staging for the logits took other addresses: 2 plain, 1 captured, 0 replayed). The
/// dumped logits are the last step's, a replayed one; they equal those of the same run
/// with every step launched plainly (`MOEC_CUDA_GRAPHS=off`, which the report names)
/// within 1e-5 (the same kernels on the same inputs: measured 0), and the tokens are equal.
#[test]
fn decode_steps_replay_with_dumped_logits_equal_to_plain_steps() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/baselines/gpu_resident.sched";
    let mut runs = Vec::new();
    for graphs in ["on", "off"] {
        let dump = tempfile::NamedTempFile::new().expect("temp file");
        let path = dump.path().to_str().expect("UTF-8 temp path");
        let (tokens, _, doc) = counted_run(
            cache.path(),
            dir.path(),
            schedule,
            &PROMPTS,
            4,
            &["--dump-logits", path],
            &[("MOEC_CUDA_GRAPHS", graphs)],
        );
        let counts = graph_counts(&doc, "decode");
        println!("graphs {graphs}: decode steps (replayed, captured, plain, why) {counts:?}");
        let (replayed, captured, plain, why) = counts;
        if graphs == "on" {
            assert_eq!((replayed, captured, plain), (1, 1, 1), "{why}");
        } else {
            assert_eq!((replayed, captured, plain), (0, 0, 3), "{why}");
            assert!(why.contains("MOEC_CUDA_GRAPHS=off"), "{why}");
        }
        runs.push((tokens, logits(dump.path())));
    }
    assert_eq!(runs[0].0, runs[1].0, "replayed and plain tokens");
    assert_eq!(runs[0].1.len(), PROMPTS.len());
    let diff = max_diff(&runs[0].1, &runs[1].1);
    println!("replayed against plain steps: max |logit diff| {diff:.2e}");
    assert!(diff <= 1e-5, "replayed and plain logits differ by {diff}");
}

/// Issue 44 (the H200 call of 2026-11-30: VSLPipe's 1,024 steps at the 600 MB cap all ran
/// plainly, "step steps do not repeat within a batch"): VSLPipe's mixed `step` (prefill and
/// decode rows in one pass, CPU attention between the GPU's halves) is recorded like a
/// decode step, with its `cpu` stream's tasks as host nodes. On mixtral-tiny, 2 prompts,
/// 6 tokens: the pass that prefills both prompts runs plainly ("the first step with these
/// launches"), the first decode-only pass too (its launches differ from the prefill's),
/// the next one repeats it and is captured, and the rest replay that graph: 6 passes,
/// (3, 1, 2) (replayed, captured, plain). It never runs without its ops (its host
/// tasks need the step's state) nor ahead (`Session::may_launch_ahead` keeps mixed
/// sessions out: a pass may admit a waiting prompt). Tokens: the CPU backend's.
///
/// Run by [`decode_steps_replay_a_captured_cuda_graph_with_the_cpu_tokens`], whose cache
/// holds the compiled kernels by then (a cache of its own would compile them again: ~50 s
/// of CPU).
fn vslpipe_mixed_steps_replay_a_graph_once_their_shape_repeats(cache: &Path, dir: &Path) {
    let schedule = "schedules/vslpipe.sched";
    let want = cpu_tokens(cache, schedule, 6, &[]);
    let (got, counts, doc) = counted_run(cache, dir, schedule, &PROMPTS, 6, &[], &[]);
    assert_eq!(got, want, "vslpipe: CUDA tokens differ from the CPU's");
    let (replayed, captured, plain, why) = graph_counts(&doc, "step");
    println!("vslpipe: steps {replayed} replayed, {captured} captured, {plain} plain {why}");
    println!(
        "vslpipe: cuGraphLaunch {}, cuStreamBeginCapture {}, cuLaunchKernel {}, host nodes captured {}",
        calls(&counts, "cuGraphLaunch"),
        calls(&counts, "cuStreamBeginCapture_v2"),
        calls(&counts, "cuLaunchKernel"),
        calls(&counts, "captured:cuLaunchHostFunc"),
    );
    assert_eq!((replayed, captured, plain), (3, 1, 2), "{why}");
    assert!(why.contains("the first step with these launches"), "{why}");
    assert_eq!(calls(&counts, "cuStreamBeginCapture_v2"), captured);
    assert_eq!(calls(&counts, "cuGraphLaunch"), replayed + captured);
    let refused: Vec<_> = counts
        .keys()
        .filter(|k| k.starts_with("capture refused:"))
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
}

/// Tokens of `schedule` on the CPU backend (`extra`: more `moec run` arguments).
fn cpu_tokens(cache: &Path, schedule: &str, gen_len: u32, extra: &[&str]) -> Vec<Vec<u32>> {
    let mut cpu = Command::new(env!("CARGO_BIN_EXE_moec"));
    cpu.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache)
        .args(["run", schedule, "--json"])
        .args(["--gen-len", &gen_len.to_string(), "--hw", "hardware/t4.ron"])
        .args(extra);
    if !extra.contains(&"--model") {
        cpu.args(["--model", "mixtral-tiny"]);
    }
    for p in PROMPTS {
        cpu.args(["--prompt", p]);
    }
    token_ids(
        &cpu.output().expect("moec runs"),
        &format!("{schedule}, CPU"),
    )
}

/// Graph launches made while an earlier one had not been waited for, from the stand-in's
/// call trace: a `cuGraphLaunch` opens a launch, a `cuEventSynchronize` closes the oldest
/// open one, a `cuStreamSynchronize` closes them all.
fn launches_ahead(trace: &str) -> u64 {
    let (mut open, mut ahead) = (0u64, 0u64);
    for call in trace.lines() {
        match call {
            "cuGraphLaunch" => {
                ahead += u64::from(open > 0);
                open += 1;
            }
            "cuEventSynchronize" => open = open.saturating_sub(1),
            "cuStreamSynchronize" => open = 0,
            _ => {}
        }
    }
    ahead
}

/// Read-backs that steps launched without their ops copied out of their device buffers,
/// from the CUDA backend's report line.
fn read_back_copies(doc: &serde_json::Value) -> u64 {
    let line = doc["backend"].as_str().expect("backend line");
    let what = "read-backs copied by the copy engine";
    let at = line
        .find(what)
        .unwrap_or_else(|| panic!("no `{what}` in {line}"));
    line[..at]
        .split_whitespace()
        .last()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no count before `{what}` in {line}"))
}

/// `(launched without their ops, of them ahead, device tasks run on the host)` from the
/// CUDA backend's report line.
fn replay_counts(doc: &serde_json::Value) -> (u64, u64, u64) {
    let line = doc["backend"].as_str().expect("backend line");
    let number_before = |what: &str| -> u64 {
        let at = line
            .find(what)
            .unwrap_or_else(|| panic!("no `{what}` in {line}"));
        line[..at]
            .split_whitespace()
            .last()
            .and_then(|w| w.trim_start_matches('(').parse().ok())
            .unwrap_or_else(|| panic!("no count before `{what}` in {line}"))
    };
    (
        number_before("steps launched their graph without running their ops"),
        number_before("of them launched ahead"),
        number_before("device tasks run on the host"),
    )
}

/// The run report's split of the decode steps launched from their graph (issue 44): the
/// fields exist in `--json`, over `steps` steps of which `queued` were launched behind
/// another (each with the device's idle time before its graph); every part is a time
/// (>= 0), the graph's device time (events around its launch; host clocks on the
/// stand-in) is at most the steps' wall time, staging is part of the launch call, and the
/// decode steps' walls do not overlap (a step launched ahead starts where the step before
/// it ended), so they add up to at most the run's time after its prefill.
fn launched_steps_split_their_time(doc: &serde_json::Value, steps: u64, queued: usize) {
    let r = &doc["report"];
    let d = &r["decode_split"];
    assert_eq!(d["steps"].as_u64(), Some(steps), "{d}");
    let f = |k: &str| {
        d[k].as_f64()
            .unwrap_or_else(|| panic!("no decode_split.{k}: {d}"))
    };
    for k in [
        "wall",
        "device",
        "launch",
        "staging",
        "host_functions",
        "wait",
    ] {
        assert!(f(k) >= 0.0, "{k}: {d}");
    }
    assert!(f("device") > 0.0 && f("device") <= f("wall"), "{d}");
    assert!(f("staging") <= f("launch"), "{d}");
    assert_eq!(d["gap"].as_f64().is_some(), queued > 0, "{d}");
    let n = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no report.{k}"));
    let decode = n("decode_steps") * n("decode_step_seconds");
    let prefill = n("prompt_tokens") / n("prefill_tokens_per_s");
    assert!(
        decode + prefill <= n("seconds"),
        "decode steps {decode} s + prefill {prefill} s > run {} s: steps overlap",
        n("seconds")
    );
}

/// Issue 44, async scheduling: once a decode step's shape has a CUDA graph, a later step of
/// that shape writes its step inputs into the graph's pinned staging and launches the
/// graph without running its ops, and step N+1 is launched before step N's tokens are
/// read (`embed` reads the ids `sample` left on the device). `baselines/gpu_resident` on
/// mixtral-tiny, two prompts, 6 tokens: prefill, decode steps 1 plain, 2 captured, 3
/// launched without its ops once step 2 was read, 4 and 5 each launched before the step
/// before them was read; the tokens are the CPU backend's. The stand-in's trace shows the
/// two graph launches made before the previous launch was waited for, and its counters
/// no host function: each launched step's read-back is one copy-engine copy out of its
/// device buffer, and the inputs of a step queued behind a launch in flight are written
/// by stream writes of the words that changed; no kernel launch or GEMM in those steps.
/// A seventh token adds one graph launch, one read-back copy and no device task run on
/// the host (`MOEC_CUDA_VERIFY_REPLAY=1`, which records every such step anyway and fails
/// when its commands are not its graph's, gives the same tokens). With
/// `MOEC_CUDA_REPLAY_IO=host-functions` the same steps use one host function to copy each
/// launched step's read-backs out of staging and one to write each queued step's inputs
/// (1 + 2 + 2) and no stream write, with the same tokens.
#[test]
fn decode_steps_launch_ahead_without_their_ops_with_the_cpu_tokens() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/baselines/gpu_resident.sched";
    let want = cpu_tokens(cache.path(), schedule, 6, &[]);
    let trace = tempfile::NamedTempFile::new().expect("temp file");
    let trace_path = trace.path().to_str().expect("UTF-8 path");
    let (got, counts, doc) = counted_run(
        cache.path(),
        dir.path(),
        schedule,
        &PROMPTS,
        6,
        &[],
        &[("MOEC_STANDIN_TRACE", trace_path)],
    );
    assert_eq!(got, want, "launched-ahead tokens differ from the CPU's");
    let (replayed, captured, plain, why) = graph_counts(&doc, "decode");
    assert_eq!((replayed, captured, plain), (3, 1, 1), "{why}");
    let (without_ops, ahead, ops) = replay_counts(&doc);
    println!(
        "gpu_resident, 6 tokens: {without_ops} decode steps launched without their ops, \
         {ahead} before the previous step's read-back; {ops} device tasks run on the host"
    );
    assert_eq!((without_ops, ahead), (3, 2));
    launched_steps_split_their_time(&doc, 3, 2);
    let text = std::fs::read_to_string(trace.path()).expect("trace file");
    assert_eq!(
        launches_ahead(&text),
        2,
        "launched before the last read-back"
    );
    assert_eq!(calls(&counts, "cuGraphLaunch"), 4);
    assert_eq!(calls(&counts, "cuLaunchHostFunc"), 0);
    let written = calls(&counts, "cuStreamWriteValue32_v2");
    assert!(written >= 2, "{written} staged words written by the stream");
    let (more, more_counts, more_doc) =
        counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 7, &[], &[]);
    assert_eq!(
        more.iter().map(|t| t[..6].to_vec()).collect::<Vec<_>>(),
        want
    );
    let (_, more_ahead, more_ops) = replay_counts(&more_doc);
    assert_eq!(more_ahead, 3);
    assert_eq!(more_ops, ops, "the added step ran no op on the host");
    assert_eq!(
        calls(&more_counts, "cuMemcpyDtoHAsync_v2"),
        calls(&counts, "cuMemcpyDtoHAsync_v2") + 1,
        "the added step's read-back is one copy"
    );
    assert!(calls(&more_counts, "cuStreamWriteValue32_v2") > written);
    for name in [
        "cuLaunchKernel",
        "cublasGemmEx",
        "cublasSgemm_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuLaunchHostFunc",
    ] {
        assert_eq!(
            calls(&more_counts, name),
            calls(&counts, name),
            "a step launched without its ops called {name}"
        );
    }
    assert_eq!(calls(&more_counts, "cuGraphLaunch"), 5);
    let (by_host, host_counts, host_doc) = counted_run(
        cache.path(),
        dir.path(),
        schedule,
        &PROMPTS,
        6,
        &[],
        &[("MOEC_CUDA_REPLAY_IO", "host-functions")],
    );
    assert_eq!(by_host, want, "tokens with host functions");
    assert_eq!(calls(&host_counts, "cuLaunchHostFunc"), 5);
    assert_eq!(calls(&host_counts, "cuStreamWriteValue32_v2"), 0);
    assert_eq!(replay_counts(&host_doc).0, 3);
    launched_steps_split_their_time(&host_doc, 3, 2);
    // The argument for skipping the ops, checked: each such step recorded anyway.
    let (checked, _, check_doc) = counted_run(
        cache.path(),
        dir.path(),
        schedule,
        &PROMPTS,
        6,
        &[],
        &[("MOEC_CUDA_VERIFY_REPLAY", "1")],
    );
    assert_eq!(checked, want);
    let line = check_doc["backend"].as_str().expect("backend line");
    assert!(
        line.contains("3 steps recorded anyway and found equal to their graph"),
        "{line}"
    );
}

/// A sequence that samples EOS while the step after it is already launched: its row of
/// that step is discarded, never emitted, and the batch goes on with the other sequence
/// (a new shape: its own plain, captured and launched-ahead steps). mixtral-tiny's card
/// with its EOS set to a token the first prompt generates as its 4th on the CPU (and the
/// second prompt never does), `baselines/gpu_resident`, 8 tokens: the CUDA backend's
/// tokens are the CPU backend's, the first prompt's ending at that token.
#[test]
fn a_sequence_ending_at_eos_under_a_launched_step_keeps_the_cpu_tokens() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/baselines/gpu_resident.sched";
    let free = cpu_tokens(cache.path(), schedule, 8, &[]);
    // A token the first prompt makes at index 3..6 and nowhere before, the second never.
    let (at, eos) = (3..6)
        .map(|j| (j, free[0][j]))
        .find(|&(j, t)| !free[0][..j].contains(&t) && !free[1].contains(&t))
        .expect("a token only the first prompt generates");
    let card = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/mixtral-tiny.ron"),
    )
    .expect("card");
    assert!(card.contains("eos_token_id: 2,"));
    let card = card.replace("eos_token_id: 2,", &format!("eos_token_id: {eos},"));
    let card_dir = tempfile::tempdir().expect("card dir");
    let card_path = card_dir.path().join("mixtral-tiny-eos.ron");
    std::fs::write(&card_path, card).expect("write card");
    let model = ["--model", card_path.to_str().expect("UTF-8 path")];
    let want = cpu_tokens(cache.path(), schedule, 8, &model);
    assert_eq!(want[0], free[0][..=at].to_vec(), "the CPU stops at the EOS");
    assert_eq!(want[1], free[1]);
    let (got, _, doc) = counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 8, &model, &[]);
    assert_eq!(
        got, want,
        "tokens with an EOS mid-batch differ from the CPU's"
    );
    let (without_ops, ahead, _) = replay_counts(&doc);
    let (replayed, captured, plain, why) = graph_counts(&doc, "decode");
    println!(
        "EOS of prompt 0 at its token {at}: decode steps {replayed} replayed, {captured} \
         captured, {plain} plain ({why}); {without_ops} launched without their ops, {ahead} ahead"
    );
    assert!(ahead >= 1, "a step was launched ahead");
}

/// What one decode step of `baselines/gpu_resident` at batch 1 puts in its CUDA graph on
/// mixtral-tiny (4 layers), counted by the stand-in as the difference between 3 and 2
/// generated tokens (the extra step is the captured one; the step before it ran plainly
/// with the same commands, and nothing is replayed). Pinned (issue 44): attention is one
/// `paged_decode_attention` launch a layer that appends the token's K/V itself (no
/// `paged_kv_append`, no combine below 256 keys) after one `rope_neox`; the step's small
/// inputs (positions, block tables, the head's row index; `runtime::cuda::step_inputs`)
/// are one buffer copied once a step, not a copy each, nor one per layer; `embed` reads
/// the ids where the last step's `argmax_rows` left them (no copy);
/// the attention norm runs inside the q|k|v launch (`linear_gemv3` normalising its rows);
/// the gate (norm, router product, top-k into the packed route, zeroed slots) is one
/// `moe_gate_route` launch; the experts' weight-address table is copied once, not every
/// step. Graph nodes (launches, GEMMs, copies, memsets) a step: 45, 9 a layer (q|k|v,
/// rope, attention, o, gate, group, gate+up+SwiGLU, down, combine) plus 9 for the step
/// (embed, the step inputs' one copy, gather, final norm, the head's three, argmax, the
/// ids' copy out). It was 47 with the step's three tables copied apart (positions, block
/// tables, the head's row index), 68 (14 a layer) with the norms, router, top-k, slot
/// memset and table copy apart and the ids uploaded, 88 (19) before q|k|v ran in one
/// launch, the router wrote the packed route itself and gate+up+SwiGLU became one expert
/// launch; issue 44 asks for at most 10 a layer. DeepSeek-V2's MLA reads the same one
/// copy: its step made 8 (positions once a layer besides the step's four tables).
#[test]
fn a_gpu_resident_decode_step_stages_its_tables_once_and_attends_in_one_launch_a_layer() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let layers = 4u64;
    let schedule = "schedules/baselines/gpu_resident.sched";
    let prompt = ["Mixture of experts"];
    let (_, short, _) = counted_run(cache.path(), dir.path(), schedule, &prompt, 2, &[], &[]);
    let (tokens, long, doc) = counted_run(cache.path(), dir.path(), schedule, &prompt, 3, &[], &[]);
    assert_eq!(tokens[0].len(), 3);
    assert_eq!(graph_counts(&doc, "decode").0, 0, "no replayed step");
    assert_eq!(graph_counts(&doc, "decode").1, 1, "one captured step");
    let step = |name: &str| calls(&long, name) - calls(&short, name);
    assert_eq!(step("launch:paged_decode_attention"), layers);
    assert_eq!(step("launch:rope_neox"), layers);
    assert_eq!(step("launch:paged_kv_append"), 0);
    assert_eq!(step("launch:paged_decode_combine"), 0);
    assert_eq!(step("cuMemcpyHtoDAsync_v2"), 1, "the step inputs' one copy");
    let nodes = [
        "cuLaunchKernel",
        "cublasGemmEx",
        "cublasSgemm_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemsetD8Async",
        "cuMemsetD32Async",
    ]
    .iter()
    .map(|n| step(n))
    .sum::<u64>();
    println!(
        "gpu_resident decode step, batch 1: {nodes} graph nodes ({} launches, {} copies in), \
         {} a layer past the step's 9",
        step("cuLaunchKernel"),
        step("cuMemcpyHtoDAsync_v2"),
        (nodes - 9) / layers
    );
    assert_eq!(step("launch:moe_gate_route"), layers);
    assert_eq!(step("launch:rms_norm"), 1, "only the final norm");
    assert_eq!(step("cuMemsetD8Async") + step("cuMemsetD32Async"), 0);
    assert_eq!(nodes, 45);
    assert_eq!((nodes - 9) % layers, 0);
    assert!((nodes - 9) / layers <= 10, "issue 44's bound");
    // MLA (`mla_qkv_rows`' rotary, the row attention kernels' row -> sequence) reads its
    // sections of the same copy.
    let model = ["--model", "deepseek-v2-tiny"];
    let (_, short, _) = counted_run(cache.path(), dir.path(), schedule, &prompt, 2, &model, &[]);
    let (_, long, doc) = counted_run(cache.path(), dir.path(), schedule, &prompt, 3, &model, &[]);
    assert_eq!(graph_counts(&doc, "decode").1, 1, "one captured step");
    let step = |name: &str| calls(&long, name) - calls(&short, name);
    assert_eq!(
        step("launch:mla_qkv_rows"),
        layers,
        "deepseek-v2-tiny has 4 layers too"
    );
    assert_eq!(
        step("cuMemcpyHtoDAsync_v2"),
        1,
        "DeepSeek's one copy of the step inputs"
    );
}

/// No relay memcpy when the host can hold the weights (issue 28, item 4). `cgopipe`
/// streams every layer's experts from the checkpoint through pinned pages (`W_CToPin` on
/// its `cpu.copy` stream, then `W_PinToG`). On the stand-in:
/// - by default the checkpoint is registered with the driver read-only
///   (`CU_MEMHOSTREGISTER_READ_ONLY`, at least the image's bytes), the pinned hop only
///   moves weight labels, and the device copies read the registered checkpoint: no byte of
///   the weights goes through a host memcpy (the run report's count is 0), the device never
///   writes the registration, and the tokens are the CPU backend's;
/// - with read-only registration refused (`MOEC_STANDIN_REFUSE_READ_ONLY_REGISTER=1`, a
///   device without `READ_ONLY_HOST_REGISTER_SUPPORTED`) the run falls back to one
///   page-locked copy of the checkpoint, the report says so and why, and still no host relay
///   and the same tokens;
/// - `--weight-copies move` (what every run did before) relays the streamed experts
///   through host memcpys, with the same tokens: the baseline of the figure printed.
#[test]
fn streamed_weights_reach_the_device_from_the_registered_checkpoint_without_a_host_relay() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "schedules/cgopipe.sched";
    let mut cpu = Command::new(env!("CARGO_BIN_EXE_moec"));
    cpu.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache.path())
        .args(["run", schedule, "--model", "mixtral-tiny", "--json"])
        .args(["--gen-len", "4", "--hw", "hardware/t4.ron"]);
    for p in PROMPTS {
        cpu.args(["--prompt", p]);
    }
    let want = token_ids(&cpu.output().expect("moec runs"), "cgopipe, CPU");
    let relayed = |doc: &serde_json::Value| -> u64 {
        let line = doc["backend"].as_str().expect("backend line");
        let (_, rest) = line
            .split_once("host relay memcpy of weights: ")
            .unwrap_or_else(|| panic!("no relay count in {line}"));
        rest.split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("bytes")
    };
    let mut figures = Vec::new();
    for (what, env, extra) in [
        ("registered", &[][..], &[][..]),
        (
            "pinned copy",
            &[("MOEC_STANDIN_REFUSE_READ_ONLY_REGISTER", "1")][..],
            &[][..],
        ),
        ("relay", &[][..], &["--weight-copies", "move"][..]),
    ] {
        let (got, counts, doc) =
            counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 4, extra, env);
        assert_eq!(
            got, want,
            "{what}: CUDA (stand-in) tokens differ from the CPU's"
        );
        let line = doc["backend"].as_str().expect("backend line").to_string();
        let image = doc["memory"]["weights_image_bytes"]
            .as_u64()
            .expect("image");
        assert_eq!(calls(&counts, "read_only:writes_refused"), 0, "{what}");
        match what {
            "registered" => {
                assert!(line.contains("registered read-only"), "{line}");
                assert!(calls(&counts, "register:read_only_calls") >= 1);
                assert!(calls(&counts, "register:read_only_bytes") >= image);
                assert_eq!(relayed(&doc), 0, "{line}");
            }
            "pinned copy" => {
                assert!(calls(&counts, "register:refused") >= 1, "{counts:?}");
                assert_eq!(calls(&counts, "register:read_only_bytes"), 0);
                assert!(
                    line.contains("read once into page-locked memory")
                        && line.contains("CUDA_ERROR_NOT_SUPPORTED"),
                    "{line}"
                );
                assert_eq!(relayed(&doc), 0, "{line}");
            }
            _ => {
                assert!(line.contains("relayed through host memcpys"), "{line}");
                assert!(relayed(&doc) > 0, "{line}");
            }
        }
        // The `pin` stream (`cpu.copy`: W_CToPin) over the decode steps, on the stand-in.
        let pin_busy = doc["report"]["streams"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["stream"] == "pin"))
            .and_then(|s| s["busy_seconds"].as_f64())
            .unwrap_or(f64::NAN);
        figures.push(format!(
            "{what}: host memcpy of weights {} bytes, driver-staged (pageable) host-to-device {} bytes in {} calls, `pin` stream busy {:.2} ms over the decode steps",
            relayed(&doc),
            calls(&counts, "relay:htod_bytes"),
            calls(&counts, "relay:htod_calls"),
            pin_busy * 1e3
        ));
    }
    println!(
        "cgopipe on mixtral-tiny, 4 tokens, stand-in:\n  {}",
        figures.join("\n  ")
    );
}

/// The tensor-core kernels in a whole run: `baselines/gpu_resident` on mixtral-tiny at
/// batch 16 (16 prompts, 3 tokens each) with `MOEC_TENSOR_CORES=always` gives the CPU
/// backend's tokens, with every expert product on tensor cores (`moe_grouped_mma`: gate+
/// up+SwiGLU and down, 2 launches a layer and step, none of `moe_grouped_gemv`) and the
/// prefill's attention too (`paged_prefill_attention_mma`, one launch a layer), counted by
/// the stand-in. (`auto` chooses them from 8 routed rows per expert and 16 new rows per
/// sequence, which the tiny card's test prompts do not reach.)
#[test]
fn tensor_core_kernels_at_batch_16_give_the_cpu_tokens() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let prompts: Vec<String> = (0..16)
        .map(|i| format!("Sequence {i} of a batch on tensor cores says"))
        .collect();
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let schedule = "schedules/baselines/gpu_resident.sched";
    let mut cpu = Command::new(env!("CARGO_BIN_EXE_moec"));
    cpu.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache.path())
        .args(["run", schedule, "--json", "--model", "mixtral-tiny"])
        .args(["--gen-len", "3", "--hw", "hardware/t4.ron"]);
    for p in &prompts {
        cpu.args(["--prompt", p]);
    }
    let want = token_ids(
        &cpu.output().expect("moec runs"),
        "gpu_resident, batch 16, CPU",
    );
    let (got, counts, _) = counted_run(
        cache.path(),
        dir.path(),
        schedule,
        &prompts,
        3,
        &[],
        &[("MOEC_TENSOR_CORES", "always")],
    );
    let layers = 4;
    let (mma, gemv, attn) = (
        calls(&counts, "launch:moe_grouped_mma"),
        calls(&counts, "launch:moe_grouped_gemv"),
        calls(&counts, "launch:paged_prefill_attention_mma"),
    );
    println!(
        "gpu_resident, batch 16, MOEC_TENSOR_CORES=always: moe_grouped_mma {mma}, \
         moe_grouped_gemv {gemv}, paged_prefill_attention_mma {attn} launches"
    );
    assert_eq!(
        got, want,
        "tensor-core kernels: tokens differ from the CPU's"
    );
    assert_eq!((mma, gemv, attn), (2 * layers * 3, 0, layers));
}

/// The bf16 product (`MOEC_BF16_PRODUCT=bf16`) is the CPU backend's: the device kernels keep
/// f32 activations for bf16 weights, so `--backend cuda` refuses it, naming it, before any
/// launch, rather than run host-side and device tasks with two arithmetics.
#[test]
fn the_cuda_backend_refuses_the_bf16_product() {
    let dir = standin_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("LD_LIBRARY_PATH", loader_path(dir.path()))
        .env("MOEC_STANDIN_CACHE", standin_cache())
        .env("MOEC_BF16_PRODUCT", "bf16")
        .args(["run", "schedules/cgopipe.sched", "--model", "mixtral-tiny"])
        .args([
            "--backend",
            "cuda",
            "--hw",
            "hardware/t4.ron",
            "--gen-len",
            "2",
        ])
        .output()
        .expect("moec runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("do not support the bf16 product (MOEC_BF16_PRODUCT=bf16"),
        "{stderr}"
    );
}

/// `moec run --json`'s `substituted_experts` as (substituted, all); `None` when it is null
/// (a plan without a format copy).
fn substituted_experts(out: &Output) -> Option<(u64, u64)> {
    let doc: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("--json");
    let counts = &doc["substituted_experts"];
    Some((counts["substituted"].as_u64()?, counts["all"].as_u64()?))
}

/// Prompts and new tokens of the CUDA hobbit tests: one prompt of 3 tokens, generating
/// [`HOBBIT_GEN_LEN`] (the stand-in runs a decode step in about 0.3 s on these cards).
const HOBBIT_PROMPTS: usize = 1;
const HOBBIT_GEN_LEN: usize = 10;

/// What the child process of a CUDA hobbit test hands back: hobbit.sched's traced run on
/// the CUDA backend with its substitute on (`lowbit = 1`) and off, with the counts of
/// substituted expert computations each reported.
#[derive(serde::Serialize, serde::Deserialize)]
struct DeviceHobbit {
    lossy: Vec<lossy_common::Traced>,
    lossy_substituted: Option<(u64, u64)>,
    plain: Vec<lossy_common::Traced>,
    plain_substituted: Option<(u64, u64)>,
}

/// Issue 45: HOBBIT's mixed precision on the CUDA path (`schedules/hobbit.sched`): a
/// high-precision expert cache and, with `lowbit = 1`, each decode step's cache misses
/// whose largest routing weight is below `thr` computed from their q8_0 copy (`W.q8_0`,
/// made at load in host memory and registered with the driver, each use copied into a gpu
/// slot and multiplied there by `moe_grouped_gemv_q8`), held to the same declared bound as
/// on the CPU backend (`lossy_common::hobbit_bound_failures`, the reasons in
/// tests/runtime_invariance.rs, `hobbit_with_its_substitute_stays_within_the_kl_divergence_of_q8_0_experts`):
/// the device run's own logits at every generated position, against the bf16 oracle `P`
/// and the all-q8_0 oracle `Q` computed on the CPU and teacher-forced on the device run's
/// tokens, mean KL(P || run) <= 2 x KL(P || Q) and top-1 agreement with `P` no worse than
/// `Q`'s less one position in ten.
///
/// Not the CPU backend's tokens or its count of substituted computations: the guard
/// `score_max(l, e, 0) >= thr` compares routing weights each backend computes itself,
/// which differ in their last bits, so an expert whose weight is within a rounding of
/// `thr` takes the bf16 arm on one backend and the q8_0 arm on the other (deepseek-v2-tiny
/// through `moec run`'s two prompts: 126 of 231 substituted on the CPU, 127 on the
/// stand-in). Both arms are proven by the checker; the bound is the contract. The device's
/// count (`moe_count_experts`) must be within [`count_margin`] of the CPU's for the same
/// prompts, and some but not all computations substituted. With `lowbit = 0` nothing is
/// substituted (no format copy, no count) and the tokens are the bf16 oracle's.
///
/// The device runs are in a child process of this test binary under the stand-in (both
/// settings in one process), the CPU run, oracles and KL divergences here.
fn hobbit_within_its_bound_on_the_device(test: &str, card_name: &str) {
    hobbit_within_its_bound_on_the_device_substituting(test, card_name, true);
}

/// [`hobbit_within_its_bound_on_the_device`], where `some` says whether the run must
/// substitute at least one expert computation (a card whose routing weights rarely fall
/// below `thr` may substitute none on the test's one prompt).
fn hobbit_within_its_bound_on_the_device_substituting(test: &str, card_name: &str, some: bool) {
    use lossy_common::{
        experts_q8_0, hobbit_bound_failures, hobbit_plan, hobbit_prompts, kl_against_oracles,
        traced_run,
    };
    use moec::weights::checkpoint::Checkpoint;
    const CHECKPOINT: &str = "MOEC_TEST_CHECKPOINT";
    const OUT: &str = "MOEC_TEST_OUT";
    if standin_common::in_standin_child(test) {
        let dir = PathBuf::from(std::env::var_os(CHECKPOINT).expect("checkpoint folder"));
        let checkpoint = Checkpoint::open(&dir.join("ck")).expect("checkpoint");
        let card = checkpoint.card().clone();
        let prompts = hobbit_prompts(card.vocab, HOBBIT_PROMPTS);
        let cuda = moec::runtime::registry::find("cuda").expect("cuda backend");
        let mut runs = Vec::new();
        for lowbit in [1, 0] {
            let (_, plan) = hobbit_plan(&card, &prompts, HOBBIT_GEN_LEN, lowbit);
            let (traced, stats) = traced_run(cuda, &plan, &checkpoint, &prompts, HOBBIT_GEN_LEN);
            runs.push((traced, stats.substituted_experts));
        }
        let (plain, plain_substituted) = runs.pop().expect("lowbit=0");
        let (lossy, lossy_substituted) = runs.pop().expect("lowbit=1");
        let doc = DeviceHobbit {
            lossy,
            lossy_substituted,
            plain,
            plain_substituted,
        };
        let out = std::env::var_os(OUT).expect("output file");
        std::fs::write(out, serde_json::to_string(&doc).expect("JSON")).expect("write");
        return;
    }
    let started = std::time::Instant::now();
    let card = moec::model::card::ModelCard::load(card_name).expect("card");
    let (dir, checkpoint) = lossy_common::lossy_checkpoint(&card);
    let card = checkpoint.card().clone();
    let prompts = hobbit_prompts(card.vocab, HOBBIT_PROMPTS);
    let out_file = dir.path().join("device.json");
    // A cache of its own, as every run here has: kernel images the stand-in made for
    // another build must not be found.
    let cache = dir.path().join("cache");
    let child = standin_common::standin_child(
        test,
        &[
            (CHECKPOINT, dir.path().as_os_str()),
            (OUT, out_file.as_os_str()),
            ("MOEC_CACHE_DIR", cache.as_os_str()),
        ],
    );
    assert!(
        child.status.success() && String::from_utf8_lossy(&child.stdout).contains("1 passed"),
        "{card_name}: the device runs failed under the stand-in:\n{}\n{}",
        String::from_utf8_lossy(&child.stdout),
        String::from_utf8_lossy(&child.stderr)
    );
    let device: DeviceHobbit =
        serde_json::from_str(&std::fs::read_to_string(&out_file).expect("device runs"))
            .expect("device runs JSON");
    let device_time = started.elapsed();

    let quantized = experts_q8_0(dir.path());
    let b = kl_against_oracles(&checkpoint, &quantized, &prompts, &device.lossy);
    let (_, plan) = hobbit_plan(&card, &prompts, HOBBIT_GEN_LEN, 1);
    let cpu = moec::runtime::registry::default_backend();
    let (cpu_traced, cpu_stats) = traced_run(cpu, &plan, &checkpoint, &prompts, HOBBIT_GEN_LEN);
    let cpu_b = kl_against_oracles(&checkpoint, &quantized, &prompts, &cpu_traced);
    let (cpu_counts, cuda_counts) = (cpu_stats.substituted_experts, device.lossy_substituted);
    println!(
        "hobbit lowbit=1 on {card_name}, CUDA (stand-in): mean KL(P||run) {:.3e}, KL(P||all q8_0) {:.3e} (ratio {:.2}); top-1 {} (run) / {} (all q8_0) of {}; substituted (of all) {cuda_counts:?}, CPU {cpu_counts:?} (CPU run: KL ratio {:.2}, top-1 {}; tokens equal {}); device runs {:.1} s, all {:.1} s",
        b.run,
        b.all_q8,
        b.run / b.all_q8,
        b.top1.0,
        b.top1.1,
        b.positions,
        cpu_b.run / cpu_b.all_q8,
        cpu_b.top1.0,
        cpu_traced.iter().map(|t| &t.tokens).eq(device.lossy.iter().map(|t| &t.tokens)),
        device_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(b.positions, HOBBIT_PROMPTS * HOBBIT_GEN_LEN);
    let failures = hobbit_bound_failures(&format!("{card_name}, CUDA (stand-in)"), &b);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let (substituted, all) = cuda_counts.expect("the device counts a plan with a format copy");
    assert!(
        (!some || 0 < substituted) && substituted < all,
        "{card_name}: mixed precision substitutes some experts, not all: {cuda_counts:?}"
    );
    let (cpu_substituted, cpu_all) = cpu_counts.expect("the CPU counts a plan with a format copy");
    assert!(
        substituted.abs_diff(cpu_substituted) <= count_margin(cpu_all)
            && all.abs_diff(cpu_all) <= count_margin(cpu_all),
        "{card_name}: substituted expert computations {cuda_counts:?} on the device, {cpu_counts:?} on the CPU: more apart than {}",
        count_margin(cpu_all)
    );

    let oracle = moec::oracle::Oracle::new(&checkpoint).expect("oracle");
    let want: Vec<Vec<u32>> = oracle
        .generate(
            &prompts,
            &moec::oracle::GenerateOptions {
                stop_at_eos: false,
                ..moec::oracle::GenerateOptions::greedy(HOBBIT_GEN_LEN)
            },
        )
        .expect("oracle generates")
        .into_iter()
        .map(|g| g.token_ids)
        .collect();
    let got: Vec<Vec<u32>> = device.plain.iter().map(|t| t.tokens.clone()).collect();
    assert_eq!(
        got, want,
        "hobbit lowbit=0 on {card_name}: CUDA tokens are not the oracle's"
    );
    assert_eq!(
        device.plain_substituted, None,
        "{card_name}: lowbit=0 has no format copy"
    );
}

/// How far the device's count of substituted (or of all) expert computations may be from
/// the CPU's for the same prompts: guards at the threshold may go either way on either
/// backend (see [`hobbit_within_its_bound_on_the_device`]), and a different arm can change
/// a later token and so the routing after it. 2, or 5% of the computations where that is
/// more; measured differences are printed by each test.
fn count_margin(all: u64) -> u64 {
    (all / 20).max(2)
}

#[test]
fn hobbit_on_mixtral_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_mixtral_tiny_stays_within_its_bound_on_the_device_path",
        "mixtral-tiny",
    );
}

/// Qwen2-MoE: a shared expert with its gate beside the routed experts.
#[test]
fn hobbit_on_qwen2_moe_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_qwen2_moe_tiny_stays_within_its_bound_on_the_device_path",
        "qwen2-moe-tiny",
    );
}

/// Qwen3-MoE: q/k norms; its KL ratio was the largest of the CPU test's (1.12).
#[test]
fn hobbit_on_qwen3_moe_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_qwen3_moe_tiny_stays_within_its_bound_on_the_device_path",
        "qwen3-moe-tiny",
    );
}

/// OLMoE: 64 experts at top-8, so many misses a step.
#[test]
fn hobbit_on_olmoe_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_olmoe_tiny_stays_within_its_bound_on_the_device_path",
        "olmoe-tiny",
    );
}

/// DeepSeek-V2: MLA attention, a leading dense layer and shared experts; the card whose
/// substituted count differs between the backends at the threshold.
#[test]
fn hobbit_on_deepseek_v2_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_deepseek_v2_tiny_stays_within_its_bound_on_the_device_path",
        "deepseek-v2-tiny",
    );
}

/// DeepSeek-V3: its routing weights (sigmoid, top-8 of 32, renormalised) rarely fall below
/// the default `thr`, so the run may substitute nothing on this prompt (1 of 206 expert
/// computations in the CPU's own test of 3 prompts); the bound and the counts' agreement
/// with the CPU's still hold, and `lowbit=0` gives the oracle's tokens.
#[test]
fn hobbit_on_deepseek_v3_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device_substituting(
        "hobbit_on_deepseek_v3_tiny_stays_within_its_bound_on_the_device_path",
        "deepseek-v3-tiny",
        false,
    );
}

/// DBRX: its down projection stored [in, out] in the checkpoint, so its q8_0 copy is the
/// transpose (`runtime::host::format_copy`), multiplied `[out, in]` beside the
/// checkpoint's `[in, out]` bf16 experts (one grouped call per storage).
#[test]
fn hobbit_on_dbrx_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_dbrx_tiny_stays_within_its_bound_on_the_device_path",
        "dbrx-tiny",
    );
}

/// gpt-oss: fused interleaved gate/up and down with biases, all stored [in, out] in the
/// checkpoint, so the q8_0 copies are their transposes.
#[test]
fn hobbit_on_gpt_oss_tiny_stays_within_its_bound_on_the_device_path() {
    hobbit_within_its_bound_on_the_device(
        "hobbit_on_gpt_oss_tiny_stays_within_its_bound_on_the_device_path",
        "gpt-oss-tiny",
    );
}

/// Issue 45: every routed expert from its q8_0 copy (`tests/fixtures/formats/
/// substitute.sched`: each active expert's slice of `W.q8_0` copied from host memory into
/// one of two gpu slots, then multiplied there), the copies taking the checkpoint's way to
/// the device. Registered (the default here): the stand-in's registrations that are not
/// read-only (the checkpoint's are; the schedule has no pinned arena) cover `W.q8_0`, 4
/// layers x 8 experts x 104,448 bytes (the hand-worked size of
/// tests/compiler_diagnostics.rs) within the two pages its widening to pages adds.
/// Relayed (`MOEC_HOST_WEIGHTS=relay`): the copies stay pageable and the driver stages
/// each, so the run's staged host-to-device bytes exceed the registered run's by at least
/// one q8_0 expert per substituted computation. Both give the CPU backend's tokens (logits
/// within the 8-bit bound above) and count every expert computation as substituted, as
/// many as the CPU backend counts, and the backend line says which way the copies took.
#[test]
fn every_expert_from_its_q8_0_copy_matches_the_cpu_registered_or_relayed() {
    const EXPERT_Q8_0: u64 = 104_448;
    let copy_bytes = 4 * 8 * EXPERT_Q8_0;
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "tests/fixtures/formats/substitute.sched";
    let (cpu, cpu_logits) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, &[]);
    let want = token_ids(&cpu, "substitute.sched, CPU");
    let cpu_counts = substituted_experts(&cpu);
    let (substituted, all) = cpu_counts.expect("the CPU counts a plan with a format copy");
    assert!(all > 0 && substituted == all, "{cpu_counts:?}");
    // The registered run (the default) also dumps its logits for the comparison with the
    // CPU's: one stand-in run fewer than a separate plain run.
    let cuda_logits = tempfile::NamedTempFile::new().expect("temp file");
    let dump = cuda_logits.path().to_str().expect("UTF-8 temp path");
    let mut staged = Vec::new();
    for (what, env, extra) in [
        ("registered", &[][..], &["--dump-logits", dump][..]),
        ("relay", &[("MOEC_HOST_WEIGHTS", "relay")][..], &[][..]),
    ] {
        let (got, counts, doc) =
            counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 4, extra, env);
        assert_eq!(
            got, want,
            "{what}: CUDA (stand-in) tokens differ from the CPU's"
        );
        if what == "registered" {
            let diff = max_diff(&logits(&cpu_logits), &logits(cuda_logits.path()));
            assert!(diff < 0.25, "logits differ by {diff}");
            let _ = std::fs::remove_file(&cpu_logits);
        }
        let device_counts = doc["substituted_experts"]["substituted"]
            .as_u64()
            .zip(doc["substituted_experts"]["all"].as_u64());
        assert_eq!(
            device_counts, cpu_counts,
            "{what}: substituted expert computations"
        );
        let line = doc["backend"].as_str().expect("backend line").to_string();
        let not_read_only =
            calls(&counts, "register:bytes") - calls(&counts, "register:read_only_bytes");
        if what == "registered" {
            assert!(
                line.contains("format copies of the experts (")
                    && line.contains("registered with the driver (widened to whole pages"),
                "{line}"
            );
            assert!(
                (copy_bytes..copy_bytes + 2 * 4096).contains(&not_read_only),
                "{what}: {not_read_only} bytes registered besides the checkpoint"
            );
        } else {
            assert!(
                line.contains("format copies of the experts (")
                    && line.contains("pageable, each copy to the device staged by the driver"),
                "{line}"
            );
            assert_eq!(
                not_read_only, 0,
                "{what}: nothing registered for the copies"
            );
        }
        staged.push(calls(&counts, "relay:htod_bytes"));
        println!(
            "substitute.sched, {what}: {} bytes staged host-to-device, {not_read_only} bytes \
             registered besides the checkpoint; substituted {device_counts:?}",
            calls(&counts, "relay:htod_bytes")
        );
    }
    assert!(
        staged[1] >= staged[0] + substituted * EXPERT_Q8_0,
        "the relayed run stages every copy: {staged:?}, {substituted} copies"
    );
}

/// Issue 45: one `experts` task over experts stored differently
/// (`tests/fixtures/formats/mixed.sched`: expert 0 from the checkpoint in bf16, expert 1
/// from its q8_0 copy, passed together as `w = [hi, lo]`; the other experts from the
/// checkpoint by a second task). The CUDA backend runs the mixed task as one grouped call
/// per storage, still on the device: per (layer, step), counted by the stand-in through
/// `combine_slots` (one a layer and step), 3 `moe_group` launches (2 for the mixed task,
/// 1 for the other), each followed by one `moe_count_experts`, and one q8_0 group (2
/// launches of a `moe_grouped_gemv_q8` form: gate+up+SwiGLU, down); no routing read-back; the
/// decode steps, copies from the registered `W.q8_0` included, are captured as a CUDA
/// graph and replayed. Tokens and the count of substituted expert computations (expert
/// 1's only: some, not all) are the CPU backend's.
#[test]
fn an_experts_task_over_a_checkpoint_expert_and_a_q8_0_copy_runs_one_grouped_call_per_storage() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let schedule = "tests/fixtures/formats/mixed.sched";
    let (cpu, cpu_logits) = run(cache.path(), schedule, "mixtral-tiny", Driver::Cpu, &[]);
    let _ = std::fs::remove_file(cpu_logits);
    let want = token_ids(&cpu, "mixed.sched, CPU");
    let cpu_counts = substituted_experts(&cpu);
    let (substituted, all) = cpu_counts.expect("the CPU counts a plan with a format copy");
    assert!(0 < substituted && substituted < all, "{cpu_counts:?}");
    let (got, counts, doc) = counted_run(cache.path(), dir.path(), schedule, &PROMPTS, 4, &[], &[]);
    assert_eq!(
        got, want,
        "mixed.sched: CUDA (stand-in) tokens differ from the CPU's"
    );
    let device_counts = doc["substituted_experts"]["substituted"]
        .as_u64()
        .zip(doc["substituted_experts"]["all"].as_u64());
    assert_eq!(device_counts, cpu_counts, "substituted expert computations");
    let layer_steps = calls(&counts, "launch:combine_slots");
    assert!(layer_steps > 0, "{counts:?}");
    assert_eq!(
        calls(&counts, "launch:moe_group"),
        3 * layer_steps,
        "{counts:?}"
    );
    assert_eq!(
        calls(&counts, "launch:moe_count_experts"),
        calls(&counts, "launch:moe_group"),
        "{counts:?}"
    );
    // Whichever form of the integer grouped product ran (the row-count forms `_r1`,
    // `_r16`, `_x1` or the generic one): two launches a layer and step.
    let q8_grouped: u64 = ["", "_r1", "_r16", "_x1"]
        .iter()
        .map(|form| calls(&counts, &format!("launch:moe_grouped_gemv_q8{form}")))
        .sum();
    assert_eq!(q8_grouped, 2 * layer_steps, "{counts:?}");
    let line = doc["backend"].as_str().expect("backend line");
    assert!(
        line.contains("0 routing read-backs by experts/post_attn"),
        "{line}"
    );
    // The copies out of the registered `W.q8_0` are device commands: of the 3 decode
    // steps the first runs plainly, the second is captured as a CUDA graph and the third
    // replays it. (Before the fix in `copy_op`, any copy on the h2d stream that ran before
    // a step's `embed` made it upload the ids instead of reading the sampled ones, so the
    // step's first command on stream 0 depended on the threads' timing and a run replayed
    // nothing about one time in five.)
    let (replayed, captured, plain, reasons) = graph_counts(&doc, "decode");
    println!("decode graphs: {captured} captured, {replayed} replayed ({reasons})");
    assert_eq!(
        (replayed, captured, plain),
        (1, 1, 1),
        "decode graphs: {reasons}"
    );
}

/// Issue 45: a format copy in a format the CUDA kernels have no decoder for (Q5_0:
/// `tests/fixtures/formats/substitute.sched` with its q8_0 made q5_0) is refused before
/// set-up, naming the copy's buffer and format, never run some other way.
#[test]
fn a_format_copy_the_cuda_kernels_cannot_decode_is_refused_naming_it() {
    let cache = tempfile::tempdir().expect("cache");
    let dir = standin_dir();
    let source = std::fs::read_to_string("tests/fixtures/formats/substitute.sched")
        .expect("fixture")
        .replace("q8_0", "q5_0");
    let schedule = cache.path().join("substitute_q5_0.sched");
    std::fs::write(&schedule, source).expect("write schedule");
    let (out, logits) = run(
        cache.path(),
        &schedule.to_string_lossy(),
        "mixtral-tiny",
        Driver::Standin(dir.path(), 0),
        &[],
    );
    let _ = std::fs::remove_file(logits);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("`W.q5_0` holds the experts in Q5_0 (a format copy named by `.format(..)`), which the cuda backend's kernels do not compute with"),
        "{stderr}"
    );
}
