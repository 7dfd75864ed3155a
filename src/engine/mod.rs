//! The run API: load a model, compile a schedule for the run, lower it and run it on a
//! chosen backend, with the HRM replay of what ran.
//!
//! Takes a [`RunRequest`] (plain data: the schedule's text, the model source, prompts,
//! params, budgets, the backend's [`Registration`], sampling and test hooks); gives a
//! [`RunResult`] (the plan, outputs, measured stats, the report, the prediction and the
//! decoded texts) or a [`RunFailure`] ready to print. `moec run`, `ablate` and `profile`,
//! the benches and any server call [`run`]; none of them branches on the backend: what
//! differs per backend is asked of its registration (where its `gpu` space lives,
//! whether weight copies bind, why it cannot run here) or of the backend itself (its
//! report line). Nothing here prints: what a caller should tell the user comes back in
//! [`RunResult::notes`].
//!
//! The top of the library: it joins the stages (`compile`, `lower`, `runtime`) and the
//! cost model, which do not import each other.

pub mod dispatch;
mod fit;
pub mod fit_params;
pub mod gpu_probe;
pub mod session;

use crate::compile::{compile, Options};
use crate::cost::hardware::HardwareProfile;
use crate::cost::predict::{predict, CostSettings};
use crate::cost::probe::{probe_profile, ProbeEffort};
use crate::cost::replay::{predict_run, RunPrediction};
use crate::diag;
use crate::ir::profile::RoutingProfile;
use crate::ir::{TaskId, Workload};
use crate::lower::{lower, ExecPlan, LowerOptions};
use crate::model::card::ModelCard;
use crate::model::vocab::Sampling;
use crate::records::RunStats;
use crate::runtime::driver::report::{summarize, RunReport};
use crate::runtime::driver::workload::WorkloadSpec;
use crate::runtime::{BackendOptions, Registration, RunError, RunOptions, RunOutput, WeightCopies};
use crate::weights::source::{load_model, LoadedModel, ModelSource};
use crate::weights::tokenizer::TextTokenizer;
pub use fit_params::{FitMode, FittedParams};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Prompts used when none are given (varied lengths, so micro-batches mix sequence lengths).
pub const DEFAULT_PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Mixture-of-experts models route each token to a few experts, which",
    "Once upon a time",
    "To offload a large model from GPU memory to the CPU, an inference engine must overlap weight transfers with computation so that",
    "The quick brown fox",
    "In 1969, the first humans landed on the Moon. The mission was called",
];

/// Buffer of the quick probe behind the HRM replay on this machine. Four times a 64 MiB
/// last-level cache: a buffer the size of the cache measured the cache, not DRAM (32 MiB
/// gave 27 GB/s on a machine that streams 21 GB/s).
const QUICK_PROBE_BYTES: usize = 256 << 20;

/// The rate at which the HRM replay on this machine charges copies whose weight bytes are
/// bound rather than moved (`--weight-copies bind`): they move labels, not bytes.
pub const BOUND_COPY_GB_S: f64 = 1e4;

/// Everything one run needs, as plain data (a CLI, a server or a bench builds it).
#[derive(Debug, Clone)]
pub struct RunRequest {
    /// The schedule's name in diagnostics (its path, usually).
    pub schedule_name: String,
    /// The schedule's text.
    pub schedule: String,
    /// Which model.
    pub model: ModelSource,
    /// Prompt texts, encoded with the checkpoint's tokenizer.
    pub prompts: Vec<String>,
    /// Synthetic prompts added after the texts (`--workload`); its `gen_len` replaces
    /// [`RunRequest::gen_len`].
    pub workload: Option<WorkloadSpec>,
    /// Tokens to generate per prompt at most.
    pub gen_len: usize,
    /// Param overrides, `(name, value)` in order.
    pub sets: Vec<(String, String)>,
    /// When the planner picks the params the overrides leave open ([`fit_params`]).
    pub fit: FitMode,
    /// A routing profile (`moec profile` output) that placement and the cost model read.
    pub routing_profile: Option<std::path::PathBuf>,
    /// Hardware profile for the replay (name or `.ron` path); `None`: probe this machine
    /// quickly.
    pub hw: Option<String>,
    /// A hardware profile already loaded or probed (an earlier run's
    /// [`RunResult::profile`]): used instead of [`RunRequest::hw`], so a caller running
    /// many batches (`moec batch`) probes this machine once, not per batch.
    pub profile: Option<HardwareProfile>,
    /// Threads of each compute pool; `None`: all cores.
    pub threads: Option<usize>,
    /// Emulated host<->device link, GB/s.
    pub link_gbps: Option<f64>,
    /// Device memory for the `gpu` arena, bytes.
    pub gpu_mem: Option<u64>,
    /// The backend that runs the plan.
    pub backend: &'static Registration,
    /// How a backend computing on host memory copies weights.
    pub weight_copies: WeightCopies,
    /// Greedy or temperature sampling.
    pub sampling: Sampling,
    /// Sampler seed.
    pub seed: u64,
    /// Stop a sequence at the card's EOS token (`false`: always `gen_len` tokens, as a
    /// benchmark wants).
    pub stop_at_eos: bool,
    /// No progress for this long is a stalled plan.
    pub watchdog: Duration,
    /// Test hook: fail task N on its M-th run.
    pub kill_task: Option<(u32, u32)>,
    /// Test hook: skip every wait for this event of each step.
    pub drop_event: Option<u32>,
    /// Hand back the logits each prompt's last token was sampled from.
    pub capture_logits: bool,
    /// `moec profile`: add every gate's routing to these counts (every gate is read back).
    pub collect_routing: Option<Arc<Mutex<RoutingProfile>>>,
}

impl RunRequest {
    /// A greedy run of `schedule` on the default model and backend with the default
    /// prompts, generating `gen_len` tokens each, everything else at its default.
    pub fn new(schedule_name: &str, schedule: &str, gen_len: usize) -> Self {
        RunRequest {
            schedule_name: schedule_name.to_string(),
            schedule: schedule.to_string(),
            model: ModelSource::default(),
            prompts: Vec::new(),
            workload: None,
            gen_len,
            sets: Vec::new(),
            fit: FitMode::WhenOver,
            routing_profile: None,
            hw: None,
            profile: None,
            threads: None,
            link_gbps: None,
            gpu_mem: None,
            backend: crate::runtime::registry::default_backend(),
            weight_copies: WeightCopies::Bind,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_at_eos: true,
            watchdog: Duration::from_secs(60),
            kill_task: None,
            drop_event: None,
            capture_logits: false,
            collect_routing: None,
        }
    }
}

/// Everything a finished run produced.
#[derive(Debug)]
pub struct RunResult {
    /// The lowered plan.
    pub plan: ExecPlan,
    /// Prompt token ids.
    pub prompt_ids: Vec<Vec<u32>>,
    /// Generated ids per prompt.
    pub outputs: Vec<Vec<u32>>,
    /// (prompt as given, decoded continuation) per prompt.
    pub texts: Vec<(String, String)>,
    /// With [`RunRequest::capture_logits`]: the logits each prompt's last token was
    /// sampled from.
    pub logits: Vec<Option<Vec<f32>>>,
    /// Measured stats (the backend's own line in `stats.backend`).
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
    /// Bytes of the weights image that are not mapped from the checkpoint but built in
    /// memory at load (gpt-oss Hub MXFP4 experts, repacked into ggml block rows); 0 when
    /// all are mapped.
    pub decoded_weight_bytes: u64,
    /// Where the tokenizer came from: the weights folder's `tokenizer.json`, or the card's
    /// embedded file when the folder has none.
    pub tokenizer: String,
    /// What the caller should tell the user (a failed quick probe, say).
    pub notes: Vec<String>,
    /// The params the planner picked, when it did ([`fit_params`]).
    pub fitted: Option<FittedParams>,
}

/// A failure ready to print.
#[derive(Debug)]
pub enum RunFailure {
    /// Rendered diagnostics (schedule errors with spans).
    Rendered(String),
    /// A one-line message.
    Message(String),
}

fn message(e: &dyn std::fmt::Display) -> RunFailure {
    RunFailure::Message(e.to_string())
}

/// Loads the model, compiles the schedule for the request's prompts, lowers, refuses what
/// does not fit before allocating, runs on the request's backend and replays the run on
/// the hardware profile; `progress` sees (tokens done, tokens at most).
pub fn run(
    request: &RunRequest,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<RunResult, RunFailure> {
    // Before loading anything: a machine without the backend's device gets one line.
    if let Some(refusal) = (request.backend.refusal)() {
        return Err(RunFailure::Message(refusal));
    }
    let name = &request.schedule_name;
    let source = &request.schedule;
    let LoadedModel {
        checkpoint,
        tokenizer,
        ..
    } = load_model(&request.model).map_err(|e| message(&e))?;
    let card: ModelCard = checkpoint.card().clone();
    let mut texts = request.prompts.clone();
    let mut gen_len = request.gen_len;
    let mut prompt_ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tokenizer.encode(t))
        .collect::<Result<_, _>>()
        .map_err(|e| message(&e))?;
    if let Some(spec) = &request.workload {
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
            prompt_ids.push(tokenizer.encode(text).map_err(|e| message(&e))?);
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
        return Err(RunFailure::Message(format!(
            "prompt {i}: token id {bad} is outside the checkpoint's vocabulary of {}",
            card.vocab
        )));
    }
    let workload = Workload {
        batch: prompt_ids.len() as u64,
        prompt_len: prompt_ids.iter().map(Vec::len).max().unwrap_or(1) as u64,
        gen_len: gen_len as u64,
    };
    let (options, compiled) = compile_for(request, &card, workload)?;
    let mut notes = Vec::new();
    let profile = replay_profile(request, &mut notes)?;
    let (compiled, fitted) = fit_params::fit_params(
        source,
        &options,
        compiled,
        fit_params::FitBudget {
            profile: profile.as_ref(),
            gpu_mem: request.gpu_mem,
            chosen_profile: request.hw.is_some(),
            gpu_space: request.backend.gpu_space,
            mode: request.fit,
        },
        &mut notes,
    )?;
    let lower_options = LowerOptions {
        gpu_capacity: request.gpu_mem,
        read_all_routing: request.collect_routing.is_some(),
        ..LowerOptions::default()
    };
    let plan =
        lower(&compiled.program, &compiled.info, &lower_options).map_err(|e| match e.span() {
            Some(span) => {
                RunFailure::Rendered(fit::render_span_error(&e.to_string(), span, name, source))
            }
            None => message(&e),
        })?;
    fit::refuse_what_does_not_fit(
        &plan,
        &compiled.program,
        profile.as_ref(),
        fit::Budget {
            sequences: prompt_ids.len(),
            gpu_mem: request.gpu_mem,
            chosen_profile: request.hw.is_some(),
            gpu_space: request.backend.gpu_space,
        },
    )?;
    let run = run_options(request, gen_len, &options);
    // The tokenizer's and the quick probe's freed pages leave the resident set before the
    // weights enter it.
    release_freed_heap();
    let (outputs, stats) =
        crate::runtime::generate(&plan, &checkpoint, &prompt_ids, &run, progress).map_err(
            |e: RunError| match e.span().filter(|s| s.end > s.start) {
                Some(span) => {
                    RunFailure::Rendered(fit::render_span_error(&e.to_string(), span, name, source))
                }
                None => message(&e),
            },
        )?;
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
    let (outputs, logits): (Vec<Vec<u32>>, Vec<Option<Vec<f32>>>) = outputs
        .into_iter()
        .map(|RunOutput { token_ids, logits }| (token_ids, logits))
        .unzip();
    let decoded_weight_bytes = checkpoint.decoded_bytes();
    drop(checkpoint);
    let tokenizer =
        TextTokenizer::load(&card, Some(tokenizer_dir.as_path())).map_err(|e| message(&e))?;
    let continuations = outputs
        .iter()
        .zip(&prompt_ids)
        .map(|(o, p)| tokenizer.decode_continuation(p, o).unwrap_or_default());
    let texts = texts.into_iter().zip(continuations).collect();
    Ok(RunResult {
        plan,
        prompt_ids,
        outputs,
        texts,
        logits,
        stats,
        report,
        prediction,
        worst_case_step_seconds,
        profile,
        decoded_weight_bytes,
        tokenizer: tokenizer.origin().to_string(),
        notes,
        fitted,
    })
}

/// Compiles the request's schedule for `card` and `workload` with its `--set`s and routing
/// profile: the compile options (the run's options are derived from them) and the program,
/// or the rendered diagnostics. Shared by one-shot runs and serving sessions, so both
/// compile a schedule the same way.
pub(crate) fn compile_for(
    request: &RunRequest,
    card: &ModelCard,
    workload: Workload,
) -> Result<(Options, crate::compile::Compiled), RunFailure> {
    let (name, source) = (&request.schedule_name, &request.schedule);
    let mut options = Options::new(card.clone());
    if let Some(path) = &request.routing_profile {
        options.profile =
            Some(crate::ir::profile::load_for_card(path, card).map_err(RunFailure::Message)?);
    }
    options.workload = workload;
    options.sets = request.sets.clone();
    let compiled = compile(source, &options).map_err(|diags| {
        let errors = diags.iter().filter(|d| d.is_error()).count();
        let mut text = diag::render_all(&diags, name, source);
        text.push_str(&format!(
            "\n{name}: {errors} error(s); the schedule was rejected\n"
        ));
        RunFailure::Rendered(text)
    })?;
    Ok((options, compiled))
}

/// The profile the run is replayed on: the named one, or a quick probe of this machine
/// (its memory, moec's own kernels per op kind, and the runtime's fixed costs per task,
/// blocking wait and stream thread), adjusted for how this run copies.
fn replay_profile(
    request: &RunRequest,
    notes: &mut Vec<String>,
) -> Result<Option<HardwareProfile>, RunFailure> {
    let profile = match &request.hw {
        _ if request.profile.is_some() => request.profile.clone(),
        Some(hw) => Some(HardwareProfile::load(hw).map_err(|e| message(&e))?),
        None => {
            let threads = request.threads.unwrap_or(2).max(1);
            let probed = probe_profile(
                "this-machine",
                QUICK_PROBE_BYTES,
                threads,
                ProbeEffort::QUICK,
            )
            .map_err(|e| e.to_string())
            .and_then(|(_, mut profile)| {
                profile.dispatch = Some(dispatch::measured_dispatch(threads)?);
                Ok(profile)
            });
            // The run goes on without a prediction (the report says it is unavailable);
            // why is said, not dropped.
            match probed {
                Ok(p) => Some(p),
                Err(e) => {
                    notes.push(format!("the quick probe of this machine failed ({e}): no HRM prediction; pass --hw PROFILE for one"));
                    None
                }
            }
        }
    };
    // Bound weight copies take no time on this machine unless the link is throttled, so
    // the replay on a profile of this machine's backend (the quick probe, or a `moec
    // probe` file: it carries moec's own kernel rates) charges them at BOUND_COPY_GB_S
    // (the report says so); a paper's profile (`--hw t4`) is left as it is.
    let measured_here = request.hw.is_none()
        || profile
            .as_ref()
            .is_some_and(|p| p.kernels.is_some() && p.dispatch.is_some());
    let binds = request.backend.binds_weight_copies
        && measured_here
        && request.weight_copies == WeightCopies::Bind;
    Ok(profile.map(|mut p| {
        // Activations and KV are still copied at the probed memcpy rate.
        if binds && request.link_gbps.is_none() {
            p.adjustments.weight_copy_bytes_per_s = BOUND_COPY_GB_S * crate::cost::hardware::GB;
        }
        if let Some(gbps) = request.link_gbps {
            p.links.host_to_gpu_gb_s = gbps;
            p.links.gpu_to_host_gb_s = gbps;
            p.links.pageable_to_gpu_gb_s = gbps;
        }
        p
    }))
}

/// The runtime's options for the request.
fn run_options(request: &RunRequest, gen_len: usize, options: &Options) -> RunOptions {
    let mut run = RunOptions::greedy(gen_len);
    run.sampling = request.sampling;
    run.seed = request.seed;
    run.stop_at_eos = request.stop_at_eos;
    run.routing_profile = request.collect_routing.clone();
    if let Some(p) = &options.profile {
        run.eam_seed = p.requests.clone();
    }
    if let Some(t) = request.threads {
        run.backend.threads = t.max(1);
    }
    run.on = request.backend;
    run.backend = BackendOptions {
        link_gbps: request.link_gbps,
        gpu_capacity: request.gpu_mem,
        weight_copies: request.weight_copies,
        ..run.backend
    };
    run.exec.watchdog = request.watchdog.max(Duration::from_millis(10));
    run.exec.drop_wait = request.drop_event;
    run.capture_logits = request.capture_logits;
    run.kill_task = request.kill_task;
    run
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
