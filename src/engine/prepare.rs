//! The preparation a one-shot run and a serving session share: a schedule compiled for a
//! workload, its params fitted to the budgets, lowered, checked against memory, with the
//! runtime's options.
//!
//! Takes a [`RunRequest`], the loaded model's card and a [`Target`] (the workload the plan
//! is compiled for, and when a hardware profile is wanted); gives a [`Prepared`] (plain
//! data: the program, the plan, the profile, the runtime's options and the notes so far)
//! or a [`RunFailure`]. Each hop is one function (`compile_for`, `profile_for`,
//! `fit_params`, `lower_plan`, `fit::refuse_what_does_not_fit`, `run_options`) and
//! [`prepare`] chains them, so [`super::run`] and [`super::session`] cannot drift apart:
//! what differs between them (how prompts become a workload, whether the machine is
//! probed, how the backend is opened) is what they hand in or do after.

use super::fit_params::{self, FitMode, FittedParams};
use super::probe_cache::{self, ProbeOrigin};
use super::{fit, message, RunFailure, RunRequest};
use crate::compile::{compile, Compiled, Options};
use crate::cost::hardware::HardwareProfile;
use crate::diag;
use crate::ir::Workload;
use crate::lower::{lower, ExecPlan, LowerOptions};
use crate::model::card::ModelCard;
use crate::runtime::{BackendOptions, RunOptions, WeightCopies};
use std::time::Duration;

/// Buffer of the quick probe behind the HRM replay on this machine. Four times a 64 MiB
/// last-level cache: a buffer the size of the cache measured the cache, not DRAM (32 MiB
/// gave 27 GB/s on a machine that streams 21 GB/s).
const QUICK_PROBE_BYTES: usize = 256 << 20;

/// The rate at which the HRM replay on this machine charges copies whose weight bytes are
/// bound rather than moved (`--weight-copies bind`): they move labels, not bytes.
pub const BOUND_COPY_GB_S: f64 = 1e4;

/// When the chain loads or measures a hardware profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProfileUse {
    /// Always: the run is replayed on it (a quick probe of this machine when `--hw` names
    /// none).
    Replay,
    /// Only when a budget needs one: a named profile, `--fit`, or a `--gpu-mem` the
    /// defaults may exceed. The probe takes seconds, and a plain serving start stays fast.
    Budgets,
}

/// What the plan is prepared for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    /// The workload the schedule is compiled for: its `batch` is also the sequences the
    /// memory check holds logits rows for, its `gen_len` the runtime's token limit.
    pub workload: Workload,
    /// When a hardware profile is wanted.
    pub profile: ProfileUse,
}

/// A plan ready for a backend: what [`prepare`] hands on.
pub(crate) struct Prepared {
    /// The program that was lowered (the planner's, when it picked params).
    pub compiled: Compiled,
    /// The profile the budgets were checked on and a run is replayed on, if any.
    pub profile: Option<HardwareProfile>,
    /// The params the planner picked, when it did.
    pub fitted: Option<FittedParams>,
    /// The lowered plan, known to fit the budgets and this machine's memory.
    pub plan: ExecPlan,
    /// The runtime's options for the request.
    pub run: RunOptions,
    /// What the caller should tell the user so far.
    pub notes: Vec<String>,
    /// Where the quick probe of this machine came from, when the profile is one.
    pub probe: Option<super::probe_cache::ProbeOrigin>,
    /// Wall seconds the hardware profile took (loaded, probed or read from the probe
    /// cache; 0 when none was wanted), for the run report's load breakdown.
    pub probe_seconds: f64,
}

/// One line, before anything is loaded, for a machine without the backend's device.
pub(crate) fn refuse_unavailable_backend(request: &RunRequest) -> Result<(), RunFailure> {
    match (request.backend.refusal)() {
        Some(refusal) => Err(RunFailure::Message(refusal)),
        None => Ok(()),
    }
}

/// Compiles the request's schedule for `card` and `target`, fits its params to the
/// budgets, lowers it and refuses what does not fit before anything is allocated.
pub(crate) fn prepare(
    request: &RunRequest,
    card: &ModelCard,
    target: Target,
) -> Result<Prepared, RunFailure> {
    // The card as the backend lays out its KV cache (MLA's latent once on the CPU).
    let card = &crate::runtime::registry::card_for(request.backend, card);
    let (options, compiled) = compile_for(request, card, target.workload)?;
    let mut notes = Vec::new();
    let probing = std::time::Instant::now();
    let (profile, probe) = profile_for(request, card, target.profile, &mut notes)?;
    let probe_seconds = probing.elapsed().as_secs_f64();
    let (compiled, fitted) = fit_params::fit_params(
        &request.schedule,
        &options,
        compiled,
        fit_params::FitBudget {
            profile: profile.as_ref(),
            gpu_mem: request.gpu_mem,
            host_mem: request.host_mem,
            chosen_profile: request.hw.is_some(),
            gpu_space: request.backend.gpu_space,
            mode: request.fit,
        },
        &mut notes,
    )?;
    let plan = lower_plan(request, &compiled)?;
    fit::refuse_what_does_not_fit(
        &plan,
        &compiled.program,
        profile.as_ref(),
        fit::Budget {
            sequences: usize::try_from(target.workload.batch).unwrap_or(usize::MAX),
            gpu_mem: request.gpu_mem,
            host_mem: request.host_mem,
            chosen_profile: request.hw.is_some(),
            gpu_space: request.backend.gpu_space,
        },
    )?;
    let gen_len = usize::try_from(target.workload.gen_len).unwrap_or(usize::MAX);
    let run = run_options(request, gen_len, &options);
    Ok(Prepared {
        compiled,
        profile,
        fitted,
        plan,
        run,
        notes,
        probe,
        probe_seconds,
    })
}

/// Compiles the request's schedule for `card` and `workload` with its `--set`s and routing
/// profile: the compile options (the run's options are derived from them) and the program,
/// or the rendered diagnostics.
fn compile_for(
    request: &RunRequest,
    card: &ModelCard,
    workload: Workload,
) -> Result<(Options, Compiled), RunFailure> {
    let (name, source) = (&request.schedule_name, &request.schedule);
    if let Some(why) = crate::runtime::registry::kv_type_refusal(request.backend, request.kv_type) {
        return Err(RunFailure::Message(why));
    }
    let mut options = Options::new(card.clone());
    // The budget counts the scratch the backend that runs it takes.
    options.scratch = request.backend.scratch;
    options.kv_bytes = Some(request.kv_type.bytes());
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

/// The profile `profile_use` asks for: for a replay always, for budgets only when one
/// will be read (a named profile is checked; without one the machine's memory still is).
fn profile_for(
    request: &RunRequest,
    card: &ModelCard,
    profile_use: ProfileUse,
    notes: &mut Vec<String>,
) -> Result<(Option<HardwareProfile>, Option<ProbeOrigin>), RunFailure> {
    let needed = match profile_use {
        ProfileUse::Replay => true,
        ProfileUse::Budgets => {
            request.hw.is_some()
                || request.profile.is_some()
                || request.fit == FitMode::Always
                || request.gpu_mem.is_some()
        }
    };
    if needed {
        replay_profile(request, card, notes)
    } else {
        Ok((None, None))
    }
}

/// The profile the run is replayed on: the named one, or a quick probe of this machine
/// (its memory, moec's own kernels per op kind, and the runtime's fixed costs per task,
/// blocking wait and stream thread; the quantised product curves of the card's block
/// formats), taken for this run or reused from the cache folder (`probe_cache`), adjusted
/// for how this run copies; with where a probe came from.
fn replay_profile(
    request: &RunRequest,
    card: &ModelCard,
    notes: &mut Vec<String>,
) -> Result<(Option<HardwareProfile>, Option<ProbeOrigin>), RunFailure> {
    let mut origin = None;
    let profile = match &request.hw {
        _ if request.profile.is_some() => request.profile.clone(),
        Some(hw) => Some(HardwareProfile::load(hw).map_err(|e| message(&e))?),
        None => match quick_probe(
            request,
            card,
            probe_cache::max_age().map_err(RunFailure::Message)?,
        ) {
            Ok((p, o)) => {
                origin = Some(o);
                Some(p)
            }
            // The run goes on without a prediction (the report says it is unavailable);
            // why is said, not dropped.
            Err(e) => {
                notes.push(format!("the quick probe of this machine failed ({e}): no HRM prediction; pass --hw PROFILE for one"));
                None
            }
        },
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
    // A device backend registers the checkpoint where the host can hold it, so its host
    // copies of weights move labels and its device copies read the checkpoint at the
    // pinned rate (`Adjustments::registered_weights`; the run report's `weights:` clause
    // says whether registration was taken).
    let registers = request.backend.gpu_space == crate::runtime::registration::GpuSpace::Device
        && measured_here
        && request.weight_copies == WeightCopies::Bind;
    let profile = profile.map(|mut p| {
        // Activations and KV are still copied at the probed memcpy rate.
        if (binds || registers) && request.link_gbps.is_none() {
            p.adjustments.weight_copy_bytes_per_s = BOUND_COPY_GB_S * crate::cost::hardware::GB;
            p.adjustments.registered_weights = registers;
        }
        if let Some(gbps) = request.link_gbps {
            p.links.host_to_gpu_gb_s = gbps;
            p.links.gpu_to_host_gb_s = gbps;
            p.links.pageable_to_gpu_gb_s = gbps;
        }
        p
    });
    Ok((profile, origin))
}

/// The quick probe of this machine for `request` and `card`: the cached one when a run
/// with the same key took it within `MOEC_PROBE_MAX_AGE`, else a new one, stored for the
/// runs that follow (a cache folder that cannot be written only loses the reuse).
fn quick_probe(
    request: &RunRequest,
    card: &ModelCard,
    max_age: std::time::Duration,
) -> Result<(HardwareProfile, ProbeOrigin), String> {
    let threads = request.threads.unwrap_or(2).max(1);
    let formats = super::cpu_probe::quant_formats_of(card);
    let file = probe_cache::key(threads, QUICK_PROBE_BYTES, &formats).and_then(|key| {
        let dir = crate::weights::source::cache_dir().ok()?;
        Some((probe_cache::path(&dir, &key), key))
    });
    if let Some((path, key)) = &file {
        if let Some((profile, age)) = probe_cache::read(path, key, max_age) {
            let path = path.clone();
            return Ok((profile, ProbeOrigin::Reused { path, age }));
        }
    }
    let (_, mut profile) = super::cpu_probe::probe_profile(
        "this-machine",
        QUICK_PROBE_BYTES,
        threads,
        super::cpu_probe::ProbeEffort::QUICK,
        &formats,
    )
    .map_err(|e| e.to_string())?;
    profile.dispatch = Some(super::dispatch::measured_dispatch(threads)?);
    let mut kept_for = std::time::Duration::ZERO;
    if let Some((path, key)) = file.as_ref().filter(|_| !max_age.is_zero()) {
        if probe_cache::write(path, key, &profile).is_ok() {
            kept_for = max_age;
        }
    }
    Ok((profile, ProbeOrigin::Taken { kept_for }))
}

/// Lowers the fitted program for the request's `gpu` capacity; an error with a span is
/// rendered against the schedule's text, so a run and a session show it alike.
fn lower_plan(request: &RunRequest, compiled: &Compiled) -> Result<ExecPlan, RunFailure> {
    let lower_options = LowerOptions {
        gpu_capacity: request.gpu_mem,
        read_all_routing: request.collect_routing.is_some(),
        ..LowerOptions::default()
    };
    lower(&compiled.program, &compiled.info, &lower_options).map_err(|e| match e.span() {
        Some(span) => RunFailure::Rendered(fit::render_span_error(
            &e.to_string(),
            span,
            &request.schedule_name,
            &request.schedule,
        )),
        None => message(&e),
    })
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
