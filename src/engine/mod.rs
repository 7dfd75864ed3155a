//! The entry of every command that loads a model: runs of a schedule, serving, and the
//! oracle's and the checkpoint writers' commands.
//!
//! Takes a request of plain data per command; gives its result, with what a caller should
//! tell the user as notes, or a failure ready to print. Nothing here prints: `cli` (and
//! `serve`, over [`session`]) print.
//!
//! - [`run`]: a [`RunRequest`] (the schedule's text, the model source, prompts, params,
//!   budgets, the backend's [`Registration`], sampling and test hooks) in, a [`RunResult`]
//!   (the plan, outputs, measured stats, the report, the prediction and the decoded texts,
//!   [`RunResult::notes`]) or a [`RunFailure`] out. `moec run`, `ablate` and `profile`,
//!   the benches and any server call it; none of them branches on the backend: what
//!   differs per backend is asked of its registration (where its `gpu` space lives,
//!   whether weight copies bind, why it cannot run here) or of the backend itself (its
//!   report line). [`session`] keeps a plan open for serving and batches; both prepare
//!   the plan through one chain (`prepare`).
//! - [`generate`] and [`perplexity`]: the oracle (the CPU reference forward pass) on
//!   prompts or on a text, no schedule involved.
//! - [`quantize`] and [`synth`]: a GGUF written from a checkpoint, a synthetic checkpoint
//!   written from a card.
//! - [`cpu_probe`], [`dispatch`], [`gpu_probe`]: what `moec probe` and the quick probe of a
//!   run measure of this machine, made into `cost`'s hardware profile.
//!
//! The top of the library: it joins the stages (`compile`, `lower`, `runtime`), the cost
//! model, which do not import each other, and the model stack's loaders and kernels.

pub mod cpu_probe;
pub mod disk_probe;
pub mod dispatch;
mod fit;
pub mod fit_params;
mod generate;
pub mod gpu_probe;
pub mod load_time;
mod perplexity;
mod prepare;
pub mod probe_cache;
mod quantize;
pub mod session;
mod synth;

use crate::cost::hardware::HardwareProfile;
use crate::cost::predict::{predict, CostSettings};
use crate::cost::replay::{predict_run, RunPrediction};
use crate::ir::profile::RoutingProfile;
use crate::ir::{TaskId, Workload};
use crate::lower::ExecPlan;
use crate::model::card::ModelCard;
pub use crate::model::vocab::Sampling;
use crate::records::load::{Laps, LoadPhase};
use crate::records::RunStats;
use crate::runtime::driver::report::{summarize, RunReport};
use crate::runtime::driver::workload::WorkloadSpec;
use crate::runtime::{Registration, RunError, RunOutput, WeightCopies};
use crate::weights::source::{load_model, LoadedModel, ModelSource};
use crate::weights::tokenizer::TextTokenizer;
pub use fit_params::{FitMode, FittedParams};
pub use generate::{generate, GenerateRequest, GenerateResult, GeneratedText};
use load_time::{load_breakdown, split_lap, Generation};
pub use perplexity::{perplexity, PerplexityRequest, PerplexityResult};
pub use prepare::BOUND_COPY_GB_S;
use prepare::{Prepared, ProfileUse, Target};
pub use quantize::{quantize, QuantizeFormats, QuantizeRequest, QuantizeResult};
use std::sync::{Arc, Mutex};
use std::time::Duration;
pub use synth::{synth, synth_gguf, SynthGgufRequest, SynthGgufResult, SynthRequest, SynthResult};

/// Prompts used when none are given (varied lengths, so micro-batches mix sequence lengths).
pub const DEFAULT_PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Mixture-of-experts models route each token to a few experts, which",
    "Once upon a time",
    "To offload a large model from GPU memory to the CPU, an inference engine must overlap weight transfers with computation so that",
    "The quick brown fox",
    "In 1969, the first humans landed on the Moon. The mission was called",
];

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
    /// `--host-mem`: bytes of host memory the plan may use (arenas, caches and the part of
    /// the checkpoint read in place); `None`: the profile's host budget.
    pub host_mem: Option<u64>,
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
    /// `--kv-type`: the KV cache's element type (f32 unless asked; the backend must
    /// keep its cache in it or the run is refused).
    pub kv_type: crate::model::vocab::KvType,
    /// `--prefill-chunk`: prefill at most this many prompt tokens of a sequence a pass
    /// (longer prompts over several passes, each attending the cache the earlier ones
    /// wrote), so the plan's activations are sized for the chunk and only the KV cache for
    /// the whole prompt; `None`: every prompt in one pass.
    pub prefill_chunk: Option<usize>,
    /// Time the report's load breakdown from the process's start (`moec run`: the process
    /// is the run) rather than from the call to [`run`] (a library caller, a test).
    pub clock_from_process_start: bool,
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
            host_mem: None,
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
            kv_type: crate::model::vocab::KvType::F32,
            prefill_chunk: None,
            clock_from_process_start: false,
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
    /// Where the quick probe of this machine the run was replayed on came from, when it
    /// was replayed on one.
    pub probe: Option<probe_cache::ProbeOrigin>,
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
    let (origin, origin_name) = load_time::origin(request.clock_from_process_start);
    let mut laps = Laps::from(origin);
    laps.lap(origin_name);
    prepare::refuse_unavailable_backend(request)?;
    let (name, source) = (&request.schedule_name, &request.schedule);
    let LoadedModel {
        checkpoint,
        tokenizer,
        open_seconds,
        ..
    } = load_model(&request.model).map_err(|e| message(&e))?;
    let card: ModelCard = checkpoint.card().clone();
    let prompts = encode_prompts(request, &tokenizer, &card)?;
    split_lap(
        laps.lap("checkpoint and tokenizer"),
        ("checkpoint open", open_seconds),
        "tokenizer and prompts",
    );
    // A tokenizer takes 32 MiB (Mixtral's) to 95 MiB (cl100k) of heap, as much as the
    // workspaces of a small model's run: once the prompts are encoded only its decoding
    // half is kept (the vocabulary, a few MiB), so the merge tables never add to the peak
    // the weights set.
    let tokenizer = tokenizer.into_decoder();
    let Prompts {
        texts,
        ids: prompt_ids,
        gen_len,
    } = prompts;
    let longest = prompt_ids.iter().map(Vec::len).max().unwrap_or(1) as u64;
    let chunk = request
        .prefill_chunk
        .map(|c| c.max(1) as u64)
        .filter(|&c| c < longest);
    // In chunks the plan is compiled for a chunk's prompt tokens and a generation long
    // enough that its KV cache (sized for `prompt_len + gen_len`) still holds the longest
    // prompt and its new tokens; the runtime generates the request's `gen_len`.
    let workload = match chunk {
        Some(c) => Workload {
            batch: prompt_ids.len() as u64,
            prompt_len: c,
            gen_len: longest - c + gen_len as u64,
        },
        None => Workload {
            batch: prompt_ids.len() as u64,
            prompt_len: longest,
            gen_len: gen_len as u64,
        },
    };
    let Prepared {
        compiled,
        profile,
        fitted,
        plan,
        mut run,
        mut notes,
        probe,
        probe_seconds,
    } = prepare::prepare(
        request,
        &card,
        Target {
            workload,
            profile: ProfileUse::Replay,
        },
    )?;
    match (request.prefill_chunk, chunk) {
        (Some(_), Some(_)) if !crate::runtime::driver::session::prefills_in_chunks(&plan) => {
            return Err(RunFailure::Message(format!(
                "--prefill-chunk: schedule `{}` cannot prefill in chunks: its prefill does not attend the KV cache its decode reads, so a chunk would not see the prompt tokens before it; run it without --prefill-chunk",
                plan.name
            )));
        }
        (Some(_), Some(c)) => {
            run.max_new_tokens = gen_len;
            run.chunked_prefill = true;
            notes.push(format!(
                "prefill in chunks of at most {c} prompt tokens a sequence a pass (--prefill-chunk): activations sized for {c} tokens a sequence, the KV cache for the longest prompt ({longest}) and {gen_len} new"
            ));
        }
        (Some(c), None) => notes.push(format!(
            "--prefill-chunk {c}: no prompt is longer, so every prompt is prefilled in one pass"
        )),
        (None, _) => {}
    }
    // The tokenizer's and the quick probe's freed pages leave the resident set before the
    // weights enter it.
    release_freed_heap();
    // What big temporaries free must leave the process: under a host budget, or the peak
    // outgrows what the budget table counts; and in every run, or the prefill's freed
    // scratch stays resident in glibc's arenas through the decode (the probe's freed
    // buffers raise glibc's own threshold to 32 MiB) and the peak RSS exceeds what the
    // run holds. The note is said under a budget, and wherever glibc refused.
    let allocator = crate::sysmem::return_freed_blocks();
    if request.host_mem.is_some() || allocator.as_deref().is_some_and(|a| a.contains("refused")) {
        notes.extend(allocator);
    }
    // `prepare` probes the machine between compiling and fitting: the probe is its own
    // phase, the rest of `prepare` (and the allocator's set-up above) the plan's.
    let probe_what = match &probe {
        Some(probe_cache::ProbeOrigin::Reused { .. }) => "a kept quick probe read",
        Some(probe_cache::ProbeOrigin::Taken { .. }) => "a quick probe taken",
        None if request.hw.is_some() || request.profile.is_some() => "a profile given",
        None => "none",
    };
    laps.lap("plan set-up");
    let plan_phase = laps
        .split_last(LoadPhase::new("machine probe", probe_seconds).with_detail(probe_what.into()));
    plan_phase.detail = Some("compile, fit, lower, memory check".into());
    // The first token is the end of the first step that gave one (`progress` is called
    // after every step), the last token the end of the last step.
    let (mut first_token, mut last_token) = (None, None);
    let mut timed_progress = |done: usize, total: usize| {
        let now = std::time::Instant::now();
        if done > 0 && first_token.is_none() {
            first_token = Some(now);
        }
        last_token = Some(now);
        progress(done, total);
    };
    let generating = std::time::Instant::now();
    let (outputs, stats) =
        crate::runtime::generate(&plan, &checkpoint, &prompt_ids, &run, &mut timed_progress)
            .map_err(|e: RunError| match e.span().filter(|s| s.end > s.start) {
                Some(span) => {
                    RunFailure::Rendered(fit::render_span_error(&e.to_string(), span, name, source))
                }
                None => message(&e),
            })?;
    let generated_at = std::time::Instant::now();
    let prompt_tokens = prompt_ids.iter().map(Vec::len).sum();
    let generated = outputs.iter().map(|o| o.token_ids.len()).sum();
    let mut report = summarize(&plan, &stats, prompt_tokens, generated);
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
    let replayed_at = std::time::Instant::now();
    report.load = Some(load_breakdown(
        laps,
        origin_name,
        Generation {
            started: generating,
            backend_open: stats.backend_open.clone(),
            first_token,
            last_token,
            ended: generated_at,
            replayed: replayed_at,
            prompt_tokens,
        },
    ));
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
        probe,
        fitted,
    })
}

/// A run's prompts: the texts as the report shows them, their token ids, and the tokens
/// to generate (a `--workload`'s `gen_len` replaces the request's).
struct Prompts {
    texts: Vec<String>,
    ids: Vec<Vec<u32>>,
    gen_len: usize,
}

/// Encodes the request's prompts, adds its synthetic workload, falls back to
/// [`DEFAULT_PROMPTS`] when there are none, and refuses a token outside the checkpoint's
/// vocabulary (a tokenizer that is not the model's own) before anything is compiled.
fn encode_prompts(
    request: &RunRequest,
    tokenizer: &TextTokenizer,
    card: &ModelCard,
) -> Result<Prompts, RunFailure> {
    let mut texts = request.prompts.clone();
    let mut gen_len = request.gen_len;
    let mut ids: Vec<Vec<u32>> = texts
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
        ids.extend(synthetic);
    }
    if ids.is_empty() {
        // The README's main command: a small built-in prompt set of different lengths.
        for text in DEFAULT_PROMPTS {
            texts.push(text.to_string());
            ids.push(tokenizer.encode(text).map_err(|e| message(&e))?);
        }
    }
    if let Some((i, bad)) = ids.iter().enumerate().find_map(|(i, p)| {
        p.iter()
            .find(|&&id| u64::from(id) >= card.vocab)
            .map(|b| (i, b))
    }) {
        return Err(RunFailure::Message(format!(
            "prompt {i}: token id {bad} is outside the checkpoint's vocabulary of {}",
            card.vocab
        )));
    }
    Ok(Prompts {
        texts,
        ids,
        gen_len,
    })
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
