//! `moec run SCHED`: compile, check, lower and execute a schedule as real inference on the
//! CPU backend, with a progress bar and a report at the end.
//!
//! Takes a schedule, a model source, prompts (`--prompt`, `--prompts FILE.jsonl` or
//! `--workload SPEC`) and backend flags; prints the continuations and the report
//! (tokens/s, per-stream busy share, decode step vs critical path, the HRM replay of the
//! same executed steps at their real micro-batch loads: mean decode step, whole run and
//! tokens/s measured vs predicted, memory per space vs budget), or with `--json` one object
//! with `outputs[]`, `stats` (as `moec generate`), `report` and `predicted` (the replay:
//! `decode_step_seconds` and `decode_step_measured_seconds` over the same steps,
//! `run_seconds`/`run_measured_seconds`, `tokens_per_s`/`measured_tokens_per_s`,
//! `steps_by_kind` (each with its own `ops`), `ops`, and `worst_case_step_seconds`, the program's declared worst
//! case). `--trace FILE` writes the Chrome/Perfetto
//! timeline. Errors render with miette (with the schedule's source span when there is
//! one) and exit 1.

use super::generate::fail;
use super::inputs::{ModelArgs, PromptArgs, RunSettings};
use super::workload::parse_workload;
use crate::cost::hardware::Level;
use crate::cost::replay::RunPrediction;
pub use crate::engine::{RunFailure as Failure, RunResult as Finished, DEFAULT_PROMPTS};
use crate::engine::{RunRequest, BOUND_COPY_GB_S};
use crate::runtime::driver::report::timeline;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// Arguments of `moec run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// The `.sched` file.
    pub sched: PathBuf,
    /// Which model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Which prompts.
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Workload, overrides, pools, link, device memory, profile.
    #[command(flatten)]
    pub settings: RunSettings,
    /// Tokens to generate per prompt at most.
    #[arg(long, default_value_t = 32)]
    pub gen_len: usize,
    /// Write the measured Chrome/Perfetto trace here.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0, value_parser = super::inputs::non_negative_finite)]
    pub temperature: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds without progress before a stalled plan is an error.
    #[arg(long, default_value_t = 60.0, value_parser = super::inputs::watchdog_seconds)]
    pub watchdog: f64,
    /// Test hook: fail task number N on its M-th run (`N` or `N:M`).
    #[arg(long, hide = true, value_name = "N[:M]")]
    pub kill_task: Option<String>,
    /// Test hook: skip every wait for event N of each step (proves the stand-in driver
    /// runs streams concurrently: the run must fail or change its tokens).
    #[arg(long, hide = true, value_name = "N")]
    pub test_drop_event: Option<u32>,
    /// Let the planner pick the params the `--set`s leave open (the best predicted that
    /// fit this workload and budget), even when the defaults fit; without it, it does so
    /// only when they do not fit, and says so.
    #[arg(long)]
    pub fit: bool,
    /// Write the logits each prompt's last token was sampled from to FILE (JSON: one
    /// array of vocab floats per prompt), e.g. to compare `--backend cpu` and `cuda`.
    #[arg(long, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
    /// Prefill at most TOKENS prompt tokens of each sequence a pass: longer prompts run in
    /// chunks over several passes (each attending the KV cache the earlier ones wrote), so
    /// the activations are sized for the chunk, not the whole prompt (only for schedules
    /// whose prefill attends the KV cache its decode reads).
    #[arg(long, value_name = "TOKENS")]
    pub prefill_chunk: Option<usize>,
}

fn parse_kill(text: &str) -> Result<(u32, u32), String> {
    let (t, n) = text.split_once(':').unwrap_or((text, "1"));
    let bad = || format!("--kill-task `{text}`: expected N or N:M");
    Ok((
        t.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    ))
}

/// The run API's request for `moec run`'s flags (parsed and checked here, so the engine
/// gets plain data).
pub fn request(args: &RunArgs) -> Result<RunRequest, Failure> {
    let name = args.sched.display().to_string();
    let schedule = crate::textfile::read_capped(&args.sched, crate::textfile::SOURCE_LIMIT)
        .map_err(|e| Failure::Message(format!("cannot read {name}: {e}")))?;
    let mut request = RunRequest::new(&name, &schedule, args.gen_len);
    request.model = args.model.source();
    request.prompts = args.prompt.texts().map_err(Failure::Message)?;
    request.workload = args
        .settings
        .workload
        .as_deref()
        .map(parse_workload)
        .transpose()
        .map_err(Failure::Message)?;
    request.sets = super::inputs::parse_sets(&args.settings.sets).map_err(Failure::Message)?;
    if args.fit {
        request.fit = crate::engine::FitMode::Always;
    }
    request.routing_profile = args.settings.routing_profile.clone();
    request.hw = args.settings.hw.clone();
    request.threads = args.settings.threads;
    request.link_gbps = args.settings.link_gbps;
    request.gpu_mem = gpu_capacity(args)?;
    request.host_mem = host_capacity(args)?;
    request.backend = args.settings.backend;
    request.weight_copies = args.settings.weight_copies.into();
    request.kv_type = args.settings.kv_type;
    request.prefill_chunk = args.prefill_chunk;
    request.sampling = if args.temperature > 0.0 {
        crate::engine::Sampling::Temperature {
            temperature: args.temperature,
            top_p: 1.0,
        }
    } else {
        crate::engine::Sampling::Greedy
    };
    request.seed = args.seed;
    request.watchdog = Duration::from_secs_f64(args.watchdog.max(0.01));
    request.kill_task = args
        .kill_task
        .as_deref()
        .map(parse_kill)
        .transpose()
        .map_err(Failure::Message)?;
    request.drop_event = args.test_drop_event;
    request.capture_logits = args.dump_logits.is_some();
    Ok(request)
}

/// `--host-mem` in bytes, if given.
fn host_capacity(args: &RunArgs) -> Result<Option<u64>, Failure> {
    capacity(args.settings.host_mem.as_deref(), "--host-mem")
}

/// `--gpu-mem` in bytes.
fn gpu_capacity(args: &RunArgs) -> Result<Option<u64>, Failure> {
    capacity(args.settings.gpu_mem.as_deref(), "--gpu-mem")
}

/// A memory flag's value (`16GB`, `600MB`) in bytes, if given.
fn capacity(text: Option<&str>, flag: &str) -> Result<Option<u64>, Failure> {
    text.map(|text| {
        crate::cost::budget::parse_bytes(text)
            .map(|b| b as u64)
            .map_err(|e| Failure::Message(format!("{flag}: {e}")))
    })
    .transpose()
}

/// Runs `moec run`'s request through the run API; `progress` sees (tokens done, tokens at
/// most). Writes `--dump-logits`.
pub fn execute(
    args: &RunArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Finished, Failure> {
    execute_timed(args, false, progress)
}

/// [`execute`], with the report's load breakdown timed from the process's start when
/// `from_process_start` (`moec run`, whose process is the run; `ablate` runs many).
fn execute_timed(
    args: &RunArgs,
    from_process_start: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Finished, Failure> {
    let mut request = request(args)?;
    request.clock_from_process_start = from_process_start;
    let finished = crate::engine::run(&request, progress)?;
    if let Some(path) = &args.dump_logits {
        let text = serde_json::json!({ "logits": finished.logits }).to_string();
        write_atomic(path, &text).map_err(Failure::Message)?;
    }
    Ok(finished)
}

/// The KV cache's element type the plan was compiled for (`--kv-type`) and a token's
/// bytes of it over every layer.
fn kv_type_of(plan: &crate::lower::ExecPlan) -> crate::model::vocab::KvType {
    plan.tasks
        .iter()
        .find(|t| matches!(t.op, crate::ir::Op::Attn { .. }))
        .and_then(|t| crate::model::vocab::KvType::of_bytes(t.shape.kv_bytes))
        .unwrap_or_default()
}

/// One report line: the KV cache's element type and a token's bytes of it.
fn kv_line(plan: &crate::lower::ExecPlan) -> String {
    let kv = kv_type_of(plan);
    let card = &plan.model;
    let per_token = card.kv_elems_per_token_layer() * card.layers * kv.bytes();
    format!(
        "kv cache: {} ({} bytes per element, {} per token over {} layers; --kv-type)",
        kv.name(),
        kv.bytes(),
        human(per_token),
        card.layers
    )
}

/// How the run's copies were carried out, when the backend bound weight copies.
fn weight_copies_line(stats: &crate::records::run::RunStats) -> Option<String> {
    let c = stats.copies?;
    Some(format!(
        "weight copies: bound, not moved ({} of weights: labels moved, kernels read the mapped checkpoint, as a DMA engine leaves the compute cores alone; {} of activations, KV and padding copied; the HRM replay charges bound copies at {BOUND_COPY_GB_S} GB/s unless --link-gbps; --weight-copies move copies every byte)",
        human(c.bound),
        human(c.moved)
    ))
}

/// What the run read from disk: bytes per step and the bandwidth the reads achieved.
fn disk_line(stats: &crate::records::run::RunStats) -> Option<String> {
    let d = stats.disk?;
    let steps = stats.steps.len().max(1) as u64;
    Some(format!(
        "disk: {} read from the checkpoint's files ({} per step over {steps} steps) at {:.2} GB/s while reading ({:.3} s), {}{}",
        human(d.bytes),
        human(d.bytes / steps),
        d.bandwidth() / 1e9,
        d.read_ns as f64 * 1e-9,
        if d.direct {
            "direct I/O (page cache bypassed)"
        } else {
            "buffered reads (the filesystem refused O_DIRECT: the page cache holds what was read)"
        },
        if d.from_memory > 0 {
            format!("; {} taken from memory (padding, tensors held decoded)", human(d.from_memory))
        } else {
            String::new()
        }
    ))
}

fn human(bytes: u64) -> String {
    crate::ir::emit::human_bytes(bytes)
}

/// The report as text.
pub fn report_text(f: &Finished, gpu_capacity: Option<u64>, host_capacity: Option<u64>) -> String {
    use std::fmt::Write as _;
    let r = &f.report;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} tokens in {:.3} s: {:.1} tokens/s overall; prefill {:.1} tokens/s ({} prompt tokens); decode {:.1} tokens/s ({} steps)",
        r.generated_tokens, r.seconds, r.tokens_per_s, r.prefill_tokens_per_s, r.prompt_tokens, r.decode_tokens_per_s, r.decode_steps
    );
    let _ = writeln!(
        out,
        "decode step: {:.2} ms measured, critical path of its measured tasks {:.2} ms (ratio {:.3})",
        r.decode_step_seconds * 1e3,
        r.decode_critical_path_seconds * 1e3,
        r.makespan_over_critical_path
    );
    if let Some(d) = &r.decode_split {
        let ms = |s: f64| format!("{:.3}", s * 1e3);
        let _ = writeln!(
            out,
            "decode step on the device: {} ms of {} ms wall ({} steps launched from their graph; CUDA events around each graph){}; host per step: launch call {} ms (staging {} ms), host functions {} ms, read-back wait {} ms",
            ms(d.device),
            ms(d.wall),
            d.steps,
            d.gap.map_or(String::new(), |g| format!(", device idle before each graph {} ms", ms(g))),
            ms(d.launch),
            ms(d.staging),
            ms(d.host_functions),
            ms(d.wait),
        );
    }
    if let Some(load) = &r.load {
        out.push_str(&load.text());
    }
    match &f.prediction {
        Some(p) => {
            out.push_str(&prediction_text(p));
            if let Some(probe) = &f.probe {
                let _ = writeln!(out, "  {}", probe_line(probe));
            }
        }
        None => {
            let _ = writeln!(out, "HRM prediction: unavailable (pass --hw PROFILE)");
        }
    }
    let _ = writeln!(out, "busy share per stream (decode steps):");
    for s in &r.streams {
        let _ = writeln!(
            out,
            "  {:<10} {:<13} {:>6.1}%  ({:.3} s)",
            s.stream,
            s.engine,
            s.share * 100.0,
            s.busy_seconds
        );
    }
    let [gpu, pinned, host] = f.stats.arena_bytes;
    let gpu_budget = gpu_capacity
        .map(human)
        .or_else(|| {
            f.profile
                .as_ref()
                .map(|p| format!("{} ({})", human(p.budget_bytes(Level::Gpu) as u64), p.name))
        })
        .unwrap_or_else(|| "unlimited".into());
    if let Some(fitted) = &f.fitted {
        let spelled: Vec<String> = fitted
            .values
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect();
        let _ = writeln!(
            out,
            "params picked by the planner: {} ({:.1} tokens/s predicted)",
            spelled.join(" "),
            fitted.predicted_tokens_per_s
        );
    }
    let _ = writeln!(out, "{}", crate::math::report::describe());
    let _ = writeln!(out, "{}", f.stats.backend);
    if let Some((sub, all)) = f.stats.substituted_experts {
        out.push_str(&format!(
            "lossy substitute: {sub} of {all} expert computations ({:.1}%) used a format copy of their expert (declared by the schedule's `substitute`); tokens may differ from the oracle's\n",
            100.0 * sub as f64 / all.max(1) as f64
        ));
    }
    if let Some(line) = disk_line(&f.stats) {
        let _ = writeln!(out, "{line}");
    }
    if let Some(line) = weight_copies_line(&f.stats) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out, "{}", kv_line(&f.plan));
    let _ = writeln!(out, "memory (arenas are allocated once; peak = size):");
    let _ = writeln!(out, "  gpu     {:>10}  budget {gpu_budget}", human(gpu));
    let locked = if f.stats.pinned_locked || pinned == 0 {
        "page-locked".to_string()
    } else {
        "NOT page-locked: the OS refused mlock (raise RLIMIT_MEMLOCK); copies still run".to_string()
    };
    // The budgets `check` and the refusal before allocating use (usable share included).
    let host_budget = |level: Level, what: &str| {
        // `--host-mem` is the host budget the plan was refused against before allocating.
        if let (Level::Host, Some(bytes)) = (level, host_capacity) {
            return format!("; budget {} (--host-mem)", human(bytes));
        }
        f.profile.as_ref().map_or(String::new(), |p| {
            format!(
                "; budget {} ({}{what})",
                human(p.budget_bytes(level) as u64),
                p.name
            )
        })
    };
    let _ = writeln!(
        out,
        "  pinned  {:>10}  {locked}{}",
        human(pinned),
        host_budget(Level::Pinned, " pinned")
    );
    let _ = writeln!(
        out,
        "  host    {:>10}  {} with pinned and the mapped weights{}",
        human(host),
        human(host + pinned + f.stats.image_bytes),
        host_budget(Level::Host, " DRAM")
    );
    let populated = if f.stats.image_populated > 0 {
        format!(
            "; page tables of {} populated before the first step",
            human(f.stats.image_populated)
        )
    } else {
        "; pages faulted in as kernels read them".to_string()
    };
    let populated = if f.stats.image_tiled > 0 {
        // Q4_K matrices the CPU backend repacked at load: allocated in place of their
        // mapped blocks (whose pages it dropped), so not pageable.
        format!(
            "; {} of it Q4_K/Q6_K/Q8_0/Q4_0/MXFP4 tiles repacked at load (allocated in place of the mapped blocks){populated}",
            human(f.stats.image_tiled)
        )
    } else {
        populated
    };
    if f.decoded_weight_bytes == 0 {
        let _ = writeln!(
            out,
            "  weights {:>10}  memory-mapped from the checkpoint (pageable, not allocated){populated}",
            human(f.stats.image_bytes)
        );
    } else {
        // MXFP4 experts are not in the file as the kernels read them: their ggml block
        // rows are allocated once at load and read in place; the rest is mapped.
        let _ = writeln!(
            out,
            "  weights {:>10}  {} MXFP4 experts repacked into ggml blocks at load (allocated, held once), the rest memory-mapped from the checkpoint (pageable, not allocated){populated}",
            human(f.stats.image_bytes),
            human(f.decoded_weight_bytes)
        );
    }
    let _ = writeln!(
        out,
        "tasks: {} run, {} skipped by guards",
        r.tasks_run, r.tasks_skipped
    );
    let _ = writeln!(out, "tokenizer: {}", f.tokenizer);
    if r.preemptions + r.paused_passes > 0 {
        let _ = writeln!(
            out,
            "KV cache: {} sequences preempted and prefilled again, {} sequence-passes paused (blocks ran out)",
            r.preemptions, r.paused_passes
        );
    }
    for c in &f.stats.caches {
        out.push_str(&cache_report_text(c));
    }
    for p in &f.stats.predictions {
        let _ = writeln!(
            out,
            "prediction `{}`: {} of {} experts with tokens predicted ({:.1}%), {} missed, {} predicted without tokens (wasted)",
            p.predictor,
            p.hits,
            p.hits + p.misses,
            100.0 * p.recall(),
            p.misses,
            p.wasted
        );
    }
    out
}

/// An expert cache's counts: the run's totals, then one line per layer.
fn cache_report_text(c: &crate::records::run::CacheReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let t = &c.total;
    let _ = writeln!(
        out,
        "expert cache `{}` ({} slots, evict {}, predict {}): {} hits, {} misses (hit rate {:.1}%), {} evictions; prefetches {} copied, {} used, {} wasted, {} skipped",
        c.name,
        c.slots,
        c.policy,
        c.predictor,
        t.hits,
        t.misses,
        100.0 * t.hit_rate(),
        t.evictions,
        t.prefetched,
        t.prefetch_used,
        t.prefetch_wasted,
        t.prefetch_skipped
    );
    for (l, s) in c.layers.iter().enumerate() {
        let _ = writeln!(
            out,
            "  layer {l:>3}: {:>5} hits {:>5} misses {:>5} evictions  prefetch {:>4} copied {:>4} used {:>4} wasted {:>4} skipped",
            s.hits, s.misses, s.evictions, s.prefetched, s.prefetch_used, s.prefetch_wasted, s.prefetch_skipped
        );
    }
    out
}

/// The `--json` document.
pub fn report_json(f: &Finished) -> serde_json::Value {
    let outs: Vec<serde_json::Value> = f
        .outputs
        .iter()
        .zip(&f.texts)
        .map(|(ids, (prompt, text))| serde_json::json!({"prompt": prompt, "token_ids": ids, "text": text}))
        .collect();
    serde_json::json!({
        "outputs": outs,
        "stats": {
            "prompt_tokens": f.report.prompt_tokens,
            "generated_tokens": f.report.generated_tokens,
            "seconds": f.report.seconds,
            "tokens_per_s": f.report.tokens_per_s,
        },
        "report": f.report,
        "predicted": predicted_json(f),
        "memory": {
            "gpu_bytes": f.stats.arena_bytes[0],
            "pinned_bytes": f.stats.arena_bytes[1],
            "host_bytes": f.stats.arena_bytes[2],
            "weights_image_bytes": f.stats.image_bytes,
            "weights_decoded_bytes": f.decoded_weight_bytes,
            "pinned_locked": f.stats.pinned_locked,
        },
        "tokenizer": f.tokenizer,
        "probe": f.probe.as_ref().map(|p| match p {
            crate::engine::probe_cache::ProbeOrigin::Taken { kept_for } => serde_json::json!({
                "reused": false,
                "kept_seconds": kept_for.as_secs(),
            }),
            crate::engine::probe_cache::ProbeOrigin::Reused { path, age } => serde_json::json!({
                "reused": true,
                "path": path.display().to_string(),
                "age_seconds": age.as_secs_f64(),
            }),
        }),
        "backend": f.stats.backend,
        "kv_type": kv_type_of(&f.plan).name(),
        "fitted_params": f.fitted.as_ref().map(|p| p.values.iter().cloned().collect::<std::collections::BTreeMap<_, _>>()),
        "weight_copies": f.stats.copies.map(|c| serde_json::json!({
            "mode": "bind",
            "bound_bytes": c.bound,
            "moved_bytes": c.moved,
        })).unwrap_or_else(|| serde_json::json!({ "mode": "move" })),
        "caches": f.stats.caches,
        "predictions": f.stats.predictions,
        "substituted_experts": f.stats.substituted_experts.map(|(sub, all)| serde_json::json!({
            "substituted": sub,
            "all": all,
        })),
        "disk": f.stats.disk.map(|d| serde_json::json!({
            "bytes": d.bytes,
            "bytes_per_step": d.bytes / f.stats.steps.len().max(1) as u64,
            "read_seconds": d.read_ns as f64 * 1e-9,
            "bandwidth_bytes_per_s": d.bandwidth(),
            "direct": d.direct,
            "from_memory_bytes": d.from_memory,
        })),
    })
}

/// Writes an output file (`cli::output`: atomic over regular files, never over links or
/// device nodes).
pub fn write_atomic(path: &Path, text: &str) -> Result<(), String> {
    super::output::write_output(path, text)
}

/// Runs `moec run`.
pub fn run(args: &RunArgs) -> ExitCode {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {msg} [{bar:30}] {pos}/{len} tokens ({per_sec})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(args.sched.display().to_string());
    let mut progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let result = execute_timed(args, true, &mut progress);
    bar.finish_and_clear();
    let finished = match result {
        Ok(x) => x,
        Err(Failure::Rendered(text)) => {
            eprint!("{text}");
            return ExitCode::from(1);
        }
        Err(Failure::Message(m)) => return fail(m),
    };
    if let Some(path) = &args.trace {
        let title = format!(
            "measured: {} on {}",
            finished.plan.name, finished.plan.model.name
        );
        let trace = timeline(&finished.plan, &finished.stats, &title).to_chrome_trace();
        if let Err(e) = write_atomic(path, &trace.to_string()) {
            return fail(e);
        }
    }
    for note in &finished.notes {
        eprintln!("moec: {note}");
    }
    let gpu_capacity = gpu_capacity(args).ok().flatten();
    let host_capacity = host_capacity(args).ok().flatten();
    if args.json {
        println!("{}", report_json(&finished));
    } else {
        for (prompt, continuation) in &finished.texts {
            println!("{prompt}{continuation}");
        }
        print!("{}", report_text(&finished, gpu_capacity, host_capacity));
    }
    ExitCode::SUCCESS
}

/// Measured over predicted, or 0 when nothing was predicted.
fn ratio(measured: f64, predicted: f64) -> f64 {
    if predicted > 0.0 {
        measured / predicted
    } else {
        0.0
    }
}

/// Where the quick probe the run was replayed on came from (`engine::probe_cache`).
fn probe_line(probe: &crate::engine::probe_cache::ProbeOrigin) -> String {
    use crate::engine::probe_cache::{ProbeOrigin, MAX_AGE_VAR};
    match probe {
        ProbeOrigin::Taken { kept_for } if kept_for.is_zero() => {
            "profile: a quick probe of this machine, taken for this run".to_string()
        }
        ProbeOrigin::Taken { kept_for } => format!(
            "profile: a quick probe of this machine, taken for this run and kept for the runs of the next {} s ({MAX_AGE_VAR})",
            kept_for.as_secs()
        ),
        ProbeOrigin::Reused { path, age } => format!(
            "profile: a quick probe of this machine, reused: taken {:.0} s ago by an earlier run ({}; {MAX_AGE_VAR}=0 probes every run)",
            age.as_secs_f64(),
            path.display()
        ),
    }
}

/// The HRM lines of the report: the same executed steps, measured and predicted.
fn prediction_text(p: &RunPrediction) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "HRM replay on `{}` (every executed step predicted at its real micro-batch loads):",
        p.hardware
    );
    if let Some(d) = &p.decode_step {
        let _ = writeln!(
            out,
            "  {} step: {:.2} ms measured, {:.2} ms predicted (measured / predicted = {:.2}; mean of {} steps)",
            d.which,
            d.measured_seconds * 1e3,
            d.predicted_seconds * 1e3,
            ratio(d.measured_seconds, d.predicted_seconds),
            d.steps
        );
    }
    let _ = writeln!(
        out,
        "  run: {:.3} s measured, {:.3} s predicted (measured / predicted = {:.2}); {} tokens: {:.1} tokens/s measured, {:.1} predicted",
        p.measured_seconds,
        p.predicted_seconds,
        ratio(p.measured_seconds, p.predicted_seconds),
        p.generated_tokens,
        p.measured_tokens_per_s,
        p.predicted_tokens_per_s
    );
    let kinds: Vec<String> = p
        .kinds
        .iter()
        .map(|k| {
            format!(
                "{} {} x {:.1} / {:.1} ms",
                k.kind,
                k.steps,
                k.measured_seconds * 1e3,
                k.predicted_seconds * 1e3
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "  per step kind (measured / predicted, summed): {}",
        kinds.join(", ")
    );
    // The op kinds that took longest: where measured and predicted part ways.
    let ops: Vec<String> = p
        .ops
        .iter()
        .take(6)
        .map(|o| {
            format!(
                "{} {:.3} / {:.3} s",
                o.op, o.measured_seconds, o.predicted_seconds
            )
        })
        .collect();
    // The same per step of the decode-like kind: the run-wide figures mix in prefill,
    // whose ops are the decode step's at other shapes.
    let per_step = p
        .kinds
        .iter()
        .find(|k| k.kind == "decode")
        .or_else(|| p.kinds.iter().find(|k| k.kind == "step"))
        .filter(|k| k.steps > 0)
        .map(|k| {
            let n = k.steps as f64;
            let ops: Vec<String> = k
                .ops
                .iter()
                .take(6)
                .map(|o| {
                    format!(
                        "{} {:.2} / {:.2}",
                        o.op,
                        o.measured_seconds * 1e3 / n,
                        o.predicted_seconds * 1e3 / n
                    )
                })
                .collect();
            format!("; per {} step (ms): {}", k.kind, ops.join(", "))
        })
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "  busiest ops (task seconds measured / predicted): {}{per_step}",
        ops.join(", ")
    );
    out
}

/// The `predicted` object of `--json`: the HRM replay of the same executed steps.
fn predicted_json(f: &Finished) -> serde_json::Value {
    let p = f.prediction.as_ref();
    let decode = p.and_then(|p| p.decode_step.as_ref());
    serde_json::json!({
        "profile": f.profile.as_ref().map(|p| p.name.clone()),
        "decode_step_which": decode.map(|d| d.which.clone()),
        "decode_steps": decode.map(|d| d.steps),
        "decode_step_measured_seconds": decode.map(|d| d.measured_seconds),
        "decode_step_seconds": decode.map(|d| d.predicted_seconds),
        "run_measured_seconds": p.map(|p| p.measured_seconds),
        "run_seconds": p.map(|p| p.predicted_seconds),
        "tokens_per_s": p.map(|p| p.predicted_tokens_per_s),
        "measured_tokens_per_s": p.map(|p| p.measured_tokens_per_s),
        "steps_by_kind": p.map(|p| &p.kinds),
        "ops": p.map(|p| &p.ops),
        "simulations": p.map(|p| p.simulations),
        "worst_case_step_seconds": f.worst_case_step_seconds,
    })
}
