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
use crate::compile::{compile, Options};
use crate::cost::hardware::{HardwareProfile, Level};
use crate::cost::predict::{predict, CostSettings};
use crate::cost::probe::{probe_profile, ProbeEffort};
use crate::cost::replay::{predict_run, RunPrediction};
use crate::diag;
use crate::ir::{TaskId, Workload};
use crate::lower::{lower, ExecPlan, LowerOptions};
use crate::model::card::ModelCard;
use crate::model::source::{load_model, LoadedModel};
use crate::model::tokenizer::TextTokenizer;
use crate::model::Sampling;
use crate::records::RunStats;
use crate::runtime::driver::report::{summarize, timeline, RunReport};
use crate::runtime::driver::workload::WorkloadSpec;
use crate::runtime::BackendOptions;
use crate::runtime::{generate, RunError, RunOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Prompts used when none are given (varied lengths, so micro-batches mix sequence lengths).
pub const DEFAULT_PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Mixture-of-experts models route each token to a few experts, which",
    "Once upon a time",
    "To offload a large model from GPU memory to the CPU, an inference engine must overlap weight transfers with computation so that",
    "The quick brown fox",
    "In 1969, the first humans landed on the Moon. The mission was called",
];

/// The CUDA backend's line of the run report: the device, where the kernels came from,
/// and the routing syncs ops made themselves.
fn cuda_line(r: &crate::runtime::cuda::CudaReport) -> String {
    format!(
        "backend: cuda on {}; kernels for {} ({} compiled by NVRTC, {} from the cache); \
         pinned arena {}; {} routing read-backs by experts/post_attn (grouping tokens per expert)",
        r.device,
        r.arch,
        r.ptx.compiled,
        r.ptx.cached,
        if r.pinned_registered {
            "registered with the driver"
        } else {
            "empty or pageable"
        },
        r.routing_syncs
    )
}

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
    /// Write the logits each prompt's last token was sampled from to FILE (JSON: one
    /// array of vocab floats per prompt), e.g. to compare `--backend cpu` and `cuda`.
    #[arg(long, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
}

/// Everything a finished run produced (shared with `moec ablate`).
#[derive(Debug)]
pub struct Finished {
    /// The lowered plan.
    pub plan: ExecPlan,
    /// Prompt token ids.
    pub prompt_ids: Vec<Vec<u32>>,
    /// Generated ids per prompt.
    pub outputs: Vec<Vec<u32>>,
    /// Measured stats.
    pub stats: RunStats,
    /// The summary.
    pub report: RunReport,
    /// The HRM replay of the executed steps on the profile (each at its real loads), if
    /// predicted.
    pub prediction: Option<RunPrediction>,
    /// HRM seconds of the repeated step at the program's declared worst case (every
    /// micro-batch full), if predicted.
    pub worst_case_step_seconds: Option<f64>,
    /// Profile used for the prediction.
    pub profile: Option<HardwareProfile>,
    /// How the CPU backend's compute pools use the cores, or the CUDA device and kernels
    /// (the run report says it).
    pub pools: String,
    /// Bytes of the weights image that are not mapped from the checkpoint but decoded into
    /// memory at load (gpt-oss MXFP4 experts, dequantized to bf16); 0 when all are mapped.
    pub decoded_weight_bytes: u64,
    /// Where the tokenizer came from: the weights folder's `tokenizer.json`, or the card's
    /// embedded file when the folder has none (the run report says which).
    pub tokenizer: String,
}

/// A failure ready to print.
pub enum Failure {
    /// Rendered diagnostics (schedule errors with spans).
    Rendered(String),
    /// A one-line message.
    Message(String),
}

fn parse_kill(text: &str) -> Result<(u32, u32), String> {
    let (t, n) = text.split_once(':').unwrap_or((text, "1"));
    let bad = || format!("--kill-task `{text}`: expected N or N:M");
    Ok((
        t.trim().parse().map_err(|_| bad())?,
        n.trim().parse().map_err(|_| bad())?,
    ))
}

/// Compiles, lowers and runs; `progress` sees (tokens done, tokens at most).
pub fn execute(
    args: &RunArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Finished, Vec<(String, String)>), Failure> {
    execute_profiling(args, progress, None)
}

/// [`execute`], adding every gate's routing to `routing` when given (`moec profile`).
pub fn execute_profiling(
    args: &RunArgs,
    progress: &mut dyn FnMut(usize, usize),
    routing: Option<std::sync::Arc<std::sync::Mutex<crate::ir::profile::RoutingProfile>>>,
) -> Result<(Finished, Vec<(String, String)>), Failure> {
    let on_cuda = args.settings.backend == super::inputs::Backend::Cuda;
    if on_cuda {
        // Before loading anything: a machine without a driver or device gets one line.
        if let Some(refusal) = super::devices::cuda_run_refusal() {
            return Err(Failure::Message(refusal));
        }
    }
    let msg = |e: &dyn std::fmt::Display| Failure::Message(e.to_string());
    let name = args.sched.display().to_string();
    let source = crate::textfile::read_capped(&args.sched, crate::textfile::SOURCE_LIMIT)
        .map_err(|e| Failure::Message(format!("cannot read {name}: {e}")))?;
    let LoadedModel {
        checkpoint,
        tokenizer,
        ..
    } = load_model(&args.model.source()).map_err(|e| msg(&e))?;
    let card: ModelCard = checkpoint.card().clone();
    let mut texts = args.prompt.texts().map_err(Failure::Message)?;
    let mut gen_len = args.gen_len;
    let mut prompt_ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tokenizer.encode(t))
        .collect::<Result<_, _>>()
        .map_err(|e| msg(&e))?;
    if let Some(spec) = &args.settings.workload {
        let spec = parse_workload(spec).map_err(Failure::Message)?;
        gen_len = spec.gen_len.unwrap_or(gen_len);
        let synthetic = spec.prompts(card.vocab as u32);
        texts.extend(
            synthetic
                .iter()
                .map(|p| format!("<{} synthetic tokens>", p.len())),
        );
        prompt_ids.extend(synthetic);
    }
    if prompt_ids.is_empty() {
        // The README's main command: a small built-in prompt set of different lengths.
        for text in DEFAULT_PROMPTS {
            texts.push(text.to_string());
            prompt_ids.push(tokenizer.encode(text).map_err(|e| msg(&e))?);
        }
    }
    // A tokenizer takes 32 MiB (Mixtral's) to 95 MiB (cl100k) of heap, as much as the
    // workspaces of a small model's run: it is dropped once the prompts are encoded and
    // loaded again for decoding after the checkpoint is unmapped, so it never adds to the
    // peak the weights set.
    let tokenizer_dir = checkpoint.dir().to_path_buf();
    drop(tokenizer);
    if let Some((i, bad)) = prompt_ids.iter().enumerate().find_map(|(i, p)| {
        p.iter()
            .find(|&&id| u64::from(id) >= card.vocab)
            .map(|b| (i, b))
    }) {
        return Err(Failure::Message(format!(
            "prompt {i}: token id {bad} is outside the checkpoint's vocabulary of {}",
            card.vocab
        )));
    }
    let mut options = Options::new(card.clone());
    if let Some(path) = &args.settings.routing_profile {
        options.profile =
            Some(super::inputs::load_routing_profile(path, &card).map_err(Failure::Message)?);
    }
    options.workload = Workload {
        batch: prompt_ids.len() as u64,
        prompt_len: prompt_ids.iter().map(Vec::len).max().unwrap_or(1) as u64,
        gen_len: gen_len as u64,
    };
    for set in &args.settings.sets {
        match set.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => options
                .sets
                .push((k.trim().to_string(), v.trim().to_string())),
            _ => {
                return Err(Failure::Message(format!(
                    "--set `{set}`: expected NAME=VALUE"
                )))
            }
        }
    }
    let compiled = compile(&source, &options).map_err(|diags| {
        let errors = diags.iter().filter(|d| d.is_error()).count();
        let mut text = diag::render_all(&diags, &name, &source);
        text.push_str(&format!(
            "\n{name}: {errors} error(s); the schedule was rejected\n"
        ));
        Failure::Rendered(text)
    })?;
    let profile = match &args.settings.hw {
        Some(hw) => Some(HardwareProfile::load(hw).map_err(|e| msg(&e))?),
        // Four times a 64 MiB last-level cache: a buffer the size of the cache measured
        // the cache, not DRAM (32 MiB gave 27 GB/s on a machine that streams 21 GB/s).
        // The quick probe also times moec's own kernels per op kind (`cost::probe`), so
        // the replay charges each task at the rate its kernel reaches here.
        // And the runtime's fixed costs per task, blocking wait and stream thread.
        None => {
            let threads = args.settings.threads.unwrap_or(2).max(1);
            let probed = probe_profile(
                "this-machine",
                QUICK_PROBE_BYTES,
                threads,
                ProbeEffort::QUICK,
            )
            .map_err(|e| e.to_string())
            .and_then(|(_, mut profile)| {
                profile.dispatch = Some(super::probe::measured_dispatch(threads)?);
                Ok(profile)
            });
            // The run goes on without a prediction (the report says it is unavailable);
            // why is said here, not dropped.
            probed
                .map_err(|e| eprintln!("moec: the quick probe of this machine failed ({e}): no HRM prediction; pass --hw PROFILE for one"))
                .ok()
        }
    };
    // Bound weight copies take no time on this machine unless the link is throttled, so
    // the replay on a profile of this machine's CPU backend (the quick probe, or a `moec
    // probe` file: it carries moec's own kernel rates) charges them at BOUND_COPY_GB_S
    // (the report says so); a paper's profile (`--hw t4`) is left as it is.
    let measured_here = args.settings.hw.is_none()
        || profile
            .as_ref()
            .is_some_and(|p| p.kernels.is_some() && p.dispatch.is_some());
    let binds = !on_cuda
        && measured_here
        && args.settings.weight_copies == super::inputs::WeightCopies::Bind;
    let profile = profile.map(|mut p| {
        // Activations and KV are still copied at the probed memcpy rate.
        if binds && args.settings.link_gbps.is_none() {
            p.adjustments.weight_copy_bytes_per_s = BOUND_COPY_GB_S * crate::cost::hardware::GB;
        }
        if let Some(gbps) = args.settings.link_gbps {
            p.links.host_to_gpu_gb_s = gbps;
            p.links.gpu_to_host_gb_s = gbps;
            p.links.pageable_to_gpu_gb_s = gbps;
        }
        p
    });
    let gpu_capacity = match &args.settings.gpu_mem {
        Some(text) => Some(
            crate::cost::budget::parse_bytes(text)
                .map_err(|e| Failure::Message(format!("--gpu-mem: {e}")))? as u64,
        ),
        None => None,
    };
    let lower_options = LowerOptions {
        gpu_capacity,
        read_all_routing: routing.is_some(),
        ..LowerOptions::default()
    };
    let plan =
        lower(&compiled.program, &compiled.info, &lower_options).map_err(|e| match e.span() {
            Some(span) => {
                Failure::Rendered(render_span_error(&e.to_string(), span, &name, &source))
            }
            None => msg(&e),
        })?;
    refuse_what_does_not_fit(
        &plan,
        &compiled.program,
        profile.as_ref(),
        Budget {
            sequences: prompt_ids.len(),
            gpu_mem: gpu_capacity,
            chosen_profile: args.settings.hw.is_some(),
            on_cuda,
        },
    )?;
    let mut run = RunOptions::greedy(gen_len);
    run.sampling = if args.temperature > 0.0 {
        Sampling::Temperature {
            temperature: args.temperature,
            top_p: 1.0,
        }
    } else {
        Sampling::Greedy
    };
    run.seed = args.seed;
    run.routing_profile = routing;
    if let Some(p) = &options.profile {
        run.eam_seed = p.requests.clone();
    }
    if let Some(t) = args.settings.threads {
        run.backend.threads = t.max(1);
    }
    run.backend = BackendOptions {
        link_gbps: args.settings.link_gbps,
        gpu_capacity,
        weight_copies: args.settings.weight_copies.into(),
        ..run.backend
    };
    run.exec.watchdog = std::time::Duration::from_secs_f64(args.watchdog.max(0.01));
    run.exec.drop_wait = args.test_drop_event;
    run.capture_logits = args.dump_logits.is_some();
    run.kill_task = args
        .kill_task
        .as_deref()
        .map(parse_kill)
        .transpose()
        .map_err(Failure::Message)?;
    // The tokenizer's and the quick probe's freed pages leave the resident set before the
    // weights enter it.
    release_freed_heap();
    let ran = if on_cuda {
        crate::runtime::cuda::generate(&plan, &checkpoint, &prompt_ids, &run, progress)
            .map(|(outputs, stats, report)| (outputs, stats, cuda_line(&report)))
    } else {
        generate(&plan, &checkpoint, &prompt_ids, &run, progress).map(|(outputs, stats)| {
            (
                outputs,
                stats,
                crate::runtime::cpu::pool_split(run.backend.threads),
            )
        })
    };
    let (outputs, stats, pools) =
        ran.map_err(|e: RunError| match e.span().filter(|s| s.end > s.start) {
            Some(span) => {
                Failure::Rendered(render_span_error(&e.to_string(), span, &name, &source))
            }
            None => msg(&e),
        })?;
    if let Some(path) = &args.dump_logits {
        let logits: Vec<&Option<Vec<f32>>> = outputs.iter().map(|o| &o.logits).collect();
        let text = serde_json::json!({ "logits": logits }).to_string();
        write_atomic(path, &text).map_err(Failure::Message)?;
    }
    let prompt_tokens = prompt_ids.iter().map(Vec::len).sum();
    let generated = outputs.iter().map(|o| o.token_ids.len()).sum();
    let report = summarize(&plan, &stats, prompt_tokens, generated);
    let (mut prediction, mut worst_case_step_seconds) = (None, None);
    if let Some(p) = &profile {
        let deps: &[Vec<TaskId>] = &plan.preds;
        let settings = CostSettings::default();
        prediction = predict_run(&compiled.program, deps, p, &settings, &stats, generated).ok();
        worst_case_step_seconds = predict(&compiled.program, deps, p, &settings)
            .ok()
            .and_then(|pred| pred.step_seconds);
    }
    let outputs: Vec<Vec<u32>> = outputs.into_iter().map(|o| o.token_ids).collect();
    let decoded_weight_bytes = checkpoint.decoded_bytes();
    drop(checkpoint);
    let tokenizer =
        TextTokenizer::load(&card, Some(tokenizer_dir.as_path())).map_err(|e| msg(&e))?;
    let texts_out = outputs
        .iter()
        .zip(&prompt_ids)
        .map(|(o, p)| tokenizer.decode_continuation(p, o).unwrap_or_default())
        .collect::<Vec<_>>();
    let texts = texts.into_iter().zip(texts_out).collect();
    Ok((
        Finished {
            plan,
            prompt_ids,
            outputs,
            stats,
            report,
            prediction,
            worst_case_step_seconds,
            profile,
            pools,
            decoded_weight_bytes,
            tokenizer: tokenizer.origin().to_string(),
        },
        texts,
    ))
}

/// Gives the pages of freed heap chunks back to the OS: glibc keeps a freed chunk below
/// the heap's top mapped, so without this the dropped tokenizer's and the quick probe's
/// pages would stay in the run's resident set.
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's own arenas to the OS; it
    // touches no live allocation and is thread-safe (it takes each arena's lock).
    unsafe {
        libc::malloc_trim(0);
    }
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

/// Buffer of the quick probe behind the HRM replay on this machine.
const QUICK_PROBE_BYTES: usize = 256 << 20;

/// The rate at which the HRM replay on this machine charges copies whose weight bytes are
/// bound rather than moved (`--weight-copies bind`): they move labels, not bytes.
const BOUND_COPY_GB_S: f64 = 1e4;

fn render_span_error(
    message: &str,
    span: crate::syntax::ast::Span,
    name: &str,
    source: &str,
) -> String {
    let report = miette::miette!(
        labels = vec![miette::LabeledSpan::at(
            span.start as usize..span.end as usize,
            "this task"
        )],
        "{message}"
    )
    .with_source_code(miette::NamedSource::new(name, source.to_string()));
    let handler =
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor());
    let mut out = String::new();
    if handler.render_report(&mut out, report.as_ref()).is_err() {
        out = format!("error: {message}\n");
    }
    out
}

fn human(bytes: u64) -> String {
    crate::ir::emit::human_bytes(bytes)
}

/// The report as text.
pub fn report_text(f: &Finished, gpu_capacity: Option<u64>) -> String {
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
    match &f.prediction {
        Some(p) => out.push_str(&prediction_text(p)),
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
    let _ = writeln!(out, "{}", crate::model::kernels::isa::describe());
    let _ = writeln!(out, "{}", f.pools);
    if let Some(line) = weight_copies_line(&f.stats) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(out, "memory (arenas are allocated once; peak = size):");
    let _ = writeln!(out, "  gpu     {:>10}  budget {gpu_budget}", human(gpu));
    let locked = if f.stats.pinned_locked || pinned == 0 {
        "page-locked".to_string()
    } else {
        "NOT page-locked: the OS refused mlock (raise RLIMIT_MEMLOCK); copies still run".to_string()
    };
    // The budgets `check` and the refusal before allocating use (usable share included).
    let host_budget = |level: Level, what: &str| {
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
    if f.decoded_weight_bytes == 0 {
        let _ = writeln!(
            out,
            "  weights {:>10}  memory-mapped from the checkpoint (pageable, not allocated){populated}",
            human(f.stats.image_bytes)
        );
    } else {
        // MXFP4 experts are not in the file as the kernels read them: their bf16 decoding
        // is allocated once at load and read in place; the rest is mapped.
        let _ = writeln!(
            out,
            "  weights {:>10}  {} MXFP4 experts decoded to bf16 at load (allocated, held once), the rest memory-mapped from the checkpoint (pageable, not allocated){populated}",
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
pub fn report_json(f: &Finished, texts: &[(String, String)]) -> serde_json::Value {
    let outs: Vec<serde_json::Value> = f
        .outputs
        .iter()
        .zip(texts)
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
        "weight_copies": f.stats.copies.map(|c| serde_json::json!({
            "mode": "bind",
            "bound_bytes": c.bound,
            "moved_bytes": c.moved,
        })).unwrap_or_else(|| serde_json::json!({ "mode": "move" })),
        "caches": f.stats.caches,
    })
}

/// Writes an output file (`cli::output`: atomic over regular files, never over links or
/// device nodes).
pub fn write_atomic(path: &Path, text: &str) -> Result<(), String> {
    super::output::write_output(path, text)
}

/// Parses `--workload`: the runtime's specs (`mtbench[:COUNT]`, `count=...`) and the paper
/// presets `simulate` and `plan` take, `mtbench-GEN[:COUNT]` (the MT-Bench-shaped prompts,
/// generating the preset's GEN tokens), so one spelling works in every command. Resolved
/// here because the runtime does not import the cost model (issue 10's layering).
fn parse_workload(text: &str) -> Result<WorkloadSpec, String> {
    let Some(tail) = text.strip_prefix("mtbench-") else {
        return WorkloadSpec::parse(text).map_err(|e| e.to_string());
    };
    let (gen, count) = match tail.split_once(':') {
        Some((gen, count)) => (gen, Some(count)),
        None => (tail, None),
    };
    let name = format!("mtbench-{gen}");
    let preset = crate::cost::workloads::preset(&name).ok_or_else(|| {
        format!(
            "bad --workload `{text}`: unknown preset `{name}` (known: {})",
            crate::cost::workloads::preset_names()
        )
    })?;
    let runtime_spec = match count {
        Some(count) => format!("mtbench:{count}"),
        None => "mtbench".to_string(),
    };
    let spec = WorkloadSpec::parse(&runtime_spec)
        .map_err(|e| format!("bad --workload `{text}`: {}", e.reason))?;
    Ok(WorkloadSpec {
        gen_len: Some(preset.gen_len as usize),
        ..spec
    })
}

/// Refuses, before any arena is allocated, a plan that does not fit: first the budgets the
/// run report prints (the hardware profile's, `--gpu-mem` for the `gpu` space), with the
/// table `check` prints; then the memory the machine has available, since a profile may
/// describe a larger machine than this one (issue 18: a schedule with `ctx x 10000` ran a
/// 2-token job at 10 GB RSS, and larger ones were stopped by the OS). On the CUDA backend
/// the `gpu` arena is on the device: it is left out of the machine's memory, and without
/// `--hw` or `--gpu-mem` (the measured profile knows no device) out of the budgets too.
fn refuse_what_does_not_fit(
    plan: &ExecPlan,
    program: &crate::ir::Program,
    profile: Option<&HardwareProfile>,
    budget: Budget,
) -> Result<(), Failure> {
    use crate::cost::budget::{budget_table, check_budget, BudgetOverrides};
    let device_unknown = budget.on_cuda && !budget.chosen_profile && budget.gpu_mem.is_none();
    let overrides = BudgetOverrides {
        gpu_bytes: match budget.gpu_mem {
            Some(bytes) => Some(bytes as f64),
            None if device_unknown => Some(f64::INFINITY),
            None => None,
        },
        host_bytes: None,
    };
    if let Err(e) = check_budget(program, profile, &overrides) {
        return Err(Failure::Rendered(format!(
            "error: this plan does not fit the run's memory budgets: {}; nothing was allocated \
             (pass --hw PROFILE or --gpu-mem for other budgets)\nmemory (peak per space over the run)\n{}",
            e.summary, e.table
        )));
    }
    let Some(available) = crate::sysmem::available_bytes() else {
        return Ok(());
    };
    let arenas: u64 = plan
        .arenas
        .iter()
        .filter(|a| !(budget.on_cuda && a.space == crate::ir::Space::Gpu))
        .map(|a| a.bytes)
        .fold(0, u64::saturating_add);
    let logits = (budget.sequences as u64)
        .saturating_mul(program.model.vocab)
        .saturating_mul(4);
    let needed = arenas.saturating_add(logits);
    if needed <= available {
        return Ok(());
    }
    let table = budget_table(program, profile, &overrides);
    Err(Failure::Rendered(format!(
        "error: this plan needs {needed} bytes of memory ({arenas} in arenas, {logits} for logits) but the machine has {available} available (MemAvailable, /proc/meminfo); nothing was allocated\nmemory (peak per space over the run)\n{table}"
    )))
}

/// What [`refuse_what_does_not_fit`] needs to know of the run besides the plan.
#[derive(Debug, Clone, Copy)]
struct Budget {
    /// Sequences the run holds logits rows for.
    sequences: usize,
    /// `--gpu-mem`, in bytes.
    gpu_mem: Option<u64>,
    /// The profile was named with `--hw` (not measured on this machine).
    chosen_profile: bool,
    /// The `gpu` arena is on a CUDA device.
    on_cuda: bool,
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
    let result = execute(args, &mut progress);
    bar.finish_and_clear();
    let (finished, texts) = match result {
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
    let gpu_capacity = args
        .settings
        .gpu_mem
        .as_deref()
        .and_then(|t| crate::cost::budget::parse_bytes(t).ok())
        .map(|b| b as u64);
    if args.json {
        println!("{}", report_json(&finished, &texts));
    } else {
        for (prompt, continuation) in &texts {
            println!("{prompt}{continuation}");
        }
        print!("{}", report_text(&finished, gpu_capacity));
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

#[cfg(test)]
mod tests {
    use super::parse_workload;

    /// `run` takes the paper presets `simulate` and `plan` name, with an optional count, as
    /// well as its own `mtbench:COUNT`; unknown presets and empty counts are refused.
    #[test]
    fn workload_presets_are_spelled_as_simulate_spells_them() {
        let preset = parse_workload("mtbench-128").unwrap();
        assert_eq!((preset.count, preset.gen_len), (80, Some(128)));
        let preset = parse_workload("mtbench-32:5").unwrap();
        assert_eq!((preset.count, preset.gen_len), (5, Some(32)));
        assert_eq!(parse_workload("mtbench:7").unwrap().count, 7);
        assert!(parse_workload("mtbench-33")
            .unwrap_err()
            .contains("unknown preset `mtbench-33`"));
        assert!(parse_workload("mtbench-32:").is_err());
    }
}
