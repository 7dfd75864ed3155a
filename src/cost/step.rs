//! One step of a compiled program on the simulator: each task's HRM time plus the fixed
//! costs the runtime adds (dispatch, wake-ups, stream threads), the streams and resources
//! it runs on, and the simulated timeline ([`super::sim`]). Apart from [`super::predict`],
//! which costs each task and assembles the whole prediction from these steps.

use super::activation::{activation_memo, Activation, ActivationMemo};
use super::bounds::{self, LayerBound, LayerWork};
use super::hardware::{HardwareProfile, Level, Processor};
use super::hrm::{copy_time, Roof, TaskTime};
use super::predict::*;
use super::sim::{simulate, SimInput, SimResult, SimStream, SimTask};
use crate::ir::catalog::{CostClass, Shape};
use crate::ir::StepKind;
use crate::ir::{Engine, KvPart, Op, Program, Space, TaskId};
use crate::records::timeline::{Span, Timeline};
use crate::records::UbLoad;
use std::collections::BTreeMap;

/// The fixed costs the simulation adds to the HRM's task times, seconds: the effective
/// model's per-task overhead ([`super::hardware::Adjustments`]) and the runtime's measured
/// or sourced dispatch costs ([`super::hardware::DispatchCosts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FixedCosts {
    /// Added to every task that does work (the effective model's launch overhead).
    pub task_s: f64,
    /// Added to every task the runtime runs (its dispatch), work or none.
    pub dispatch_s: f64,
    /// Lost by a stream each time it blocks on another stream's task.
    pub wake_s: f64,
    /// Added to a step per stream with tasks in it.
    pub stream_thread_s: f64,
}

impl FixedCosts {
    /// The fixed costs `profile` charges.
    pub fn of(profile: &HardwareProfile) -> FixedCosts {
        let dispatch = profile.dispatch.clone().unwrap_or_default();
        FixedCosts {
            task_s: profile.adjustments.task_s,
            dispatch_s: dispatch.task_us * 1e-6,
            wake_s: dispatch.wake_us * 1e-6,
            stream_thread_s: dispatch.stream_thread_us * 1e-6,
        }
    }
}

/// One step's tasks, their HRM times and the simulated schedule.
pub(crate) struct StepSim {
    /// The step's tasks in issue order.
    pub ids: Vec<TaskId>,
    /// HRM time of each task in `ids`.
    pub times: Vec<TaskTime>,
    /// Expected activation of each task in `ids` at the declared load (computed once per
    /// task; every task runs in full at a measured or steady load).
    pub activations: Vec<Activation>,
    /// The simulation.
    pub result: SimResult,
}

/// What every step of one program reads from the whole program, computed once (on first
/// use: `default()` holds none yet) rather than once per step (each is a pass over every task: a planner point of
/// DeepSeek-V3 has about 180,000).
#[derive(Default)]
pub(crate) struct ProgramTables {
    /// [`Program::readback_gates`], computed on first use (a point the planner's bound
    /// drops never needs them).
    readback: std::sync::OnceLock<Vec<bool>>,
    /// [`buffer_classes`], where a step may need them (see [`ProgramTables::classes`]).
    classes: std::sync::OnceLock<Vec<BufferClass>>,
}

impl ProgramTables {
    /// The tables with buffer classes the caller already has.
    pub fn with_classes(classes: Vec<BufferClass>) -> Self {
        ProgramTables {
            readback: std::sync::OnceLock::new(),
            classes: std::sync::OnceLock::from(classes),
        }
    }

    /// [`Program::readback_gates`] of the program, computed on first use.
    pub fn readback(&self, program: &Program) -> &[bool] {
        self.readback.get_or_init(|| program.readback_gates())
    }

    /// [`buffer_classes`] of the program, computed on first use.
    pub fn classes(&self, program: &Program) -> &[BufferClass] {
        self.classes.get_or_init(|| buffer_classes(program))
    }
}

/// Simulates one step at `loads`: its tasks, dependencies inside the step (earlier steps
/// are done).
pub(crate) fn simulate_step_times(
    program: &Program,
    deps: &[Vec<TaskId>],
    step_index: usize,
    profile: &HardwareProfile,
    settings: &CostSettings,
    loads: Loads<'_>,
    tables: &ProgramTables,
) -> Result<StepSim, PredictError> {
    simulate_step_ran(
        program, deps, step_index, profile, settings, loads, None, tables,
    )
}

/// [`simulate_step_times`] of an executed step whose guards the run decided: `ran[k]`
/// false for the step's `k`-th task means its guard skipped it, so it does nothing and
/// costs nothing (the runtime only evaluated its guard).
// The program, its dependencies and tables, the machine, the settings, the step, its
// loads and what ran: each a different caller's choice, none derived from another.
#[allow(clippy::too_many_arguments)]
pub(crate) fn simulate_step_ran(
    program: &Program,
    deps: &[Vec<TaskId>],
    step_index: usize,
    profile: &HardwareProfile,
    settings: &CostSettings,
    loads: Loads<'_>,
    ran: Option<&[bool]>,
    tables: &ProgramTables,
) -> Result<StepSim, PredictError> {
    let costs = cost_step(program, step_index, profile, settings, loads, ran, tables);
    simulate_costed(program, deps, step_index, profile, costs, tables)
}

/// One step's tasks costed before their dependencies are known: every charge of
/// [`simulate_step_ran`] but the readback, the fixed costs and the event waits, which
/// [`simulate_costed`] adds (in the same order, so the times are the same to the bit).
pub(crate) struct StepCosts {
    /// The step's tasks in issue order.
    ids: Vec<TaskId>,
    /// Each task's stream (kept here so that the passes after costing read no task again:
    /// a large point's tasks do not stay in the caches).
    streams: Vec<usize>,
    /// Each task's time so far.
    times: Vec<TaskTime>,
    /// `true` where `times[k]` is already final: a task proven never to run, or one the
    /// run's guards skipped, costs nothing at all (no fixed cost either).
    settled: Vec<bool>,
    /// Expected activation of each task (as [`StepSim::activations`]).
    activations: Vec<Activation>,
}

/// Costs step `step_index`'s tasks at `loads` ([`StepCosts`]): what needs no dependency.
pub(crate) fn cost_step(
    program: &Program,
    step_index: usize,
    profile: &HardwareProfile,
    settings: &CostSettings,
    loads: Loads<'_>,
    ran: Option<&[bool]>,
    tables: &ProgramTables,
) -> StepCosts {
    let step = &program.steps[step_index];
    let ids: Vec<TaskId> = step.task_ids().collect();
    let overheads = profile.adjustments;
    let kv_store_rate = overheads.kv_store_bytes_per_s;
    let steady = matches!(loads, Loads::Steady(_));
    let weight_copy_rate = overheads.weight_copy_bytes_per_s;
    let registered = overheads.registered_weights;
    let classes: &[BufferClass] =
        if kv_store_rate > 0.0 || steady || weight_copy_rate > 0.0 || registered {
            tables.classes(program)
        } else {
            &[]
        };
    let kv_load = kv_part_load(program, step.kind, settings, loads);
    let mut memo = ActivationMemo::default();
    let activations: Vec<Activation> = ids
        .iter()
        .map(|&id| match loads {
            Loads::Declared => {
                activation_memo(program, id, program.task(id).shape.tokens, &mut memo)
            }
            Loads::Measured(_) | Loads::Steady(_) => Activation::ALWAYS,
        })
        .collect();
    let mut settled = Vec::with_capacity(ids.len());
    let mut streams = Vec::with_capacity(ids.len());
    let times: Vec<TaskTime> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            let task = program.task(id);
            streams.push(task.stream.index());
            // A task proven never to run at the declared load (its guard's token counts
            // cannot hold with the micro-batch's tokens: `routed >= t` above them) costs
            // nothing, as if the elaborator had left it out
            // (`elaborate::guards::routed_comparison` does where the step's ceiling
            // decides it): neither the GPU rate cap nor the weight-copy, KV or readback
            // charges below, which take a task's full work. A task the activation model
            // merely expects at 0 (a score threshold it rounds to "never", a cache it
            // predicts always hits) may still run, and keeps those charges.
            if matches!(loads, Loads::Declared)
                && activations[k].runs <= 0.0
                && never_runs(program, id, task.shape.tokens)
            {
                let roof = expected_task_time(program, id, profile, settings, activations[k]).roof;
                settled.push(true);
                return TaskTime { seconds: 0.0, roof };
            }
            if ran.and_then(|r| r.get(k)) == Some(&false) {
                settled.push(true);
                return TaskTime {
                    seconds: 0.0,
                    roof: Roof::Idle,
                };
            }
            settled.push(false);
            let mut time = match loads {
                Loads::Declared => {
                    expected_task_time(program, id, profile, settings, activations[k])
                }
                Loads::Measured(_) => task_time_at(program, id, profile, settings, loads),
                Loads::Steady(per_ub) => {
                    let mut time = task_time_at(program, id, profile, settings, loads);
                    // A live-row copy is already at its micro-batch's rows.
                    if task.work.copy.is_some()
                        && task.live.is_none()
                        && classes.get(task.args[0].slice.buffer.index())
                            == Some(&BufferClass::Activations)
                    {
                        time.seconds *= steady_row_share(program, per_ub);
                    }
                    time
                }
            };
            // `.context()` / `.appended()` move the positions the step's sequences hold
            // (FlexGen loads `k_home[:src_s]`, stores `k_new`), not the declared line.
            if let (Some(copy), Some(part)) = (task.work.copy, task.kv) {
                let bytes = kv_part_bytes_at(program, &task.shape, part, &kv_load);
                time = copy_time(profile, level_of(copy.src), level_of(copy.dst), bytes);
            }
            if let (Some(copy), false) = (task.work.copy, classes.is_empty()) {
                let class = task.args.first().map(|a| classes[a.slice.buffer.index()]);
                let weights = class == Some(BufferClass::Weights) && copy.src != Space::Disk;
                if weights && registered && copy.dst == Space::Gpu {
                    // DMA out of the registered checkpoint or pinned staging: the pinned
                    // link's rate, whichever host level the copy names.
                    if copy.src != Space::Gpu {
                        time = copy_time(profile, Level::Pinned, Level::Gpu, copy.bytes as f64);
                    }
                } else if weights && weight_copy_rate > 0.0 {
                    // The measured weight-copy rate is the link's; a disk read keeps its
                    // own. (With registered weights: a copy into a host level, a label
                    // move.)
                    time = TaskTime {
                        seconds: copy.bytes as f64 / weight_copy_rate,
                        roof: time.roof,
                    };
                }
                let store = copy.src == Space::Gpu && copy.dst != Space::Gpu;
                if class == Some(BufferClass::KvCache) && kv_store_rate > 0.0 && store {
                    let bytes = match task.kv {
                        Some(part) => kv_part_bytes_at(program, &task.shape, part, &kv_load),
                        None => copy.bytes as f64,
                    };
                    time.seconds = time.seconds.max(bytes / kv_store_rate);
                }
            }
            // GPU kernels reach different rates by kind and phase (FlexGen fits four:
            // GEMM and attention, prefill and decode); the profile may cap each.
            if program.engine_of(id) == Engine::GpuCompute && task.work.copy.is_none() {
                let cap = gpu_rate_cap(&task.op, &task.shape, step.kind, &overheads);
                if cap > 0.0 {
                    let flops = compute_load(program, id, settings, loads).flops;
                    time.seconds = time.seconds.max(flops / cap);
                }
            }
            // moec's own kernels on this machine reach less than the roofline by op kind
            // and rows: a measured profile charges each compute task at least that. The
            // curves are the CPU kernels': they time a `gpu` stream's task only where the
            // GPU is the CPU backend's emulation on the same cores (`shared_compute`).
            let cpu_kernels =
                profile.adjustments.shared_compute || program.engine_of(id) != Engine::GpuCompute;
            if let (Some(kernels), true) = (&profile.kernels, cpu_kernels) {
                let mut seconds = kernel_seconds(program, id, settings, loads, kernels);
                if let Loads::Declared = loads {
                    seconds *= activations[k].runs;
                }
                if seconds > time.seconds {
                    time = TaskTime {
                        seconds,
                        roof: Roof::Kernel,
                    };
                }
            }
            time
        })
        .collect();
    StepCosts {
        ids,
        streams,
        times,
        settled,
        activations,
    }
}

/// Finishes [`cost_step`]'s times with the charges that need the dependencies (event
/// waits) or the program's readback gates, and simulates the step.
pub(crate) fn simulate_costed(
    program: &Program,
    deps: &[Vec<TaskId>],
    step_index: usize,
    profile: &HardwareProfile,
    costs: StepCosts,
    tables: &ProgramTables,
) -> Result<StepSim, PredictError> {
    let step = &program.steps[step_index];
    let first = step.first as usize;
    let StepCosts {
        ids,
        streams: task_streams,
        mut times,
        settled,
        activations,
    } = costs;
    let streams: Vec<SimStream> = program
        .streams
        .iter()
        .map(|s| SimStream {
            name: s.name.clone(),
            resource: resource_of(s.engine, profile).into(),
        })
        .collect();
    let readback = tables.readback(program);
    let overheads = profile.adjustments;
    let fixed = FixedCosts::of(profile);
    let tasks: Vec<SimTask> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            let stream = task_streams[k];
            let step_deps: super::sim::SimDeps = deps[id.index()]
                .iter()
                .filter(|d| d.index() >= first)
                .map(|d| d.index() - first)
                .collect();
            let time = &mut times[k];
            if !settled[k] {
                if readback.get(id.index()).copied().unwrap_or(false) {
                    time.seconds += readback_seconds(program, id, profile);
                }
                if time.seconds > 0.0 {
                    // Fixed costs: a launch per task, an event wait per other stream
                    // waited on.
                    let mut waited: smallvec::SmallVec<[usize; 8]> = step_deps
                        .iter()
                        .map(|&d| task_streams[d])
                        .filter(|&s| s != stream)
                        .collect();
                    waited.sort_unstable();
                    waited.dedup();
                    time.seconds += fixed.task_s + overheads.sync_s * waited.len() as f64;
                }
                // The runtime dispatches every task it runs, work or none (an empty
                // micro-batch's kernels still enter the pool); at the declared load a
                // guarded task runs with its expected probability.
                if fixed.dispatch_s > 0.0 {
                    time.seconds += fixed.dispatch_s * activations[k].runs;
                }
            }
            SimTask {
                stream,
                seconds: time.seconds,
                deps: step_deps,
            }
        })
        .collect();
    let mut used_streams: Vec<usize> = tasks.iter().map(|t| t.stream).collect();
    used_streams.sort_unstable();
    used_streams.dedup();
    let input = SimInput {
        streams,
        tasks,
        wake_seconds: fixed.wake_s,
    };
    let mut result: SimResult = simulate(&input).map_err(|source| PredictError::Sim {
        step: step.kind.as_str().to_string(),
        source,
    })?;
    // The runtime starts and joins one thread per stream with work in the step.
    if !ids.is_empty() {
        result.makespan += fixed.stream_thread_s * used_streams.len() as f64;
    }
    Ok(StepSim {
        ids,
        times,
        activations,
        result,
    })
}

/// A lower bound on the makespan [`simulate_costed`] gives the step `costs` describes,
/// without its dependencies. The simulator runs one task at a time on each resource
/// (streams on one resource share it), inside the makespan, so the makespan is at least
/// each resource's summed task times; each task's time there is at least its time in
/// `costs` plus the launch cost (when it already has work) and its expected dispatch,
/// since the readback, the event waits and the wake-ups only add (each term is a
/// non-negative addition, and rounding is monotone). The stream threads' cost is the
/// simulator's own term. The sum is taken 1e-6 low to cover the different order of the
/// floating-point additions. `None` when a time is not a finite non-negative number (the
/// simulation would report it).
pub(crate) fn makespan_lower_bound(
    program: &Program,
    profile: &HardwareProfile,
    costs: &StepCosts,
) -> Option<f64> {
    let fixed = FixedCosts::of(profile);
    // The monotonicity below needs the added charges non-negative (a readback is a copy
    // over the GPU -> pinned link: finite when its rate is positive).
    let readback_rate = profile.link_bandwidth(Level::Gpu, Level::Pinned);
    if !(fixed.task_s >= 0.0 && profile.adjustments.sync_s >= 0.0 && readback_rate > 0.0) {
        return None;
    }
    let mut resources: Vec<&'static str> = Vec::new();
    let resource: Vec<usize> = program
        .streams
        .iter()
        .map(|s| {
            let name = resource_of(s.engine, profile);
            match resources.iter().position(|&r| r == name) {
                Some(at) => at,
                None => {
                    resources.push(name);
                    resources.len() - 1
                }
            }
        })
        .collect();
    let mut busy = vec![0.0f64; resources.len()];
    let mut used = vec![false; program.streams.len()];
    for (k, &stream) in costs.streams.iter().enumerate() {
        used[stream] = true;
        let mut seconds = costs.times[k].seconds;
        if !(seconds >= 0.0 && seconds.is_finite()) {
            return None;
        }
        if !costs.settled[k] {
            if seconds > 0.0 {
                seconds += fixed.task_s;
            }
            if fixed.dispatch_s > 0.0 {
                seconds += fixed.dispatch_s * costs.activations[k].runs;
            }
        }
        busy[resource[stream]] += seconds;
    }
    let mut bound = busy.iter().copied().fold(0.0f64, f64::max) * (1.0 - 1e-6);
    if !costs.ids.is_empty() {
        bound += fixed.stream_thread_s * used.iter().filter(|&&u| u).count() as f64;
    }
    Some(bound)
}

/// True when task `id`'s guard can never hold with `tokens_per_ub` tokens in each
/// micro-batch, whatever the routing: for some routed count it reads (one expert's tokens
/// from one micro-batch, at most `tokens_per_ub`; or from all of them, at most that times
/// the micro-batch count, since a token routes to an expert at most once) its `active` /
/// `routed >= t` literals ask at least `lo` tokens and its negated ones fewer than `hi`,
/// and no count in `0..=max` lies in `[lo, hi)`. Only these literals are exact token
/// bounds: residency and routing-score literals are left to the activation model (which
/// may give them probability 0 where they can still hold), so they never prove a task dead.
pub(crate) fn never_runs(program: &Program, id: TaskId, tokens_per_ub: u64) -> bool {
    let lits = &program.task(id).guard.lits;
    let ubs = u64::from(program.micro_batches.count.max(1));
    lits.iter()
        .filter(|l| l.atom.is_token_count())
        .any(|first| {
            let var = (first.atom.layer(), first.atom.expert(), first.atom.ub());
            let (mut lo, mut hi) = (0u64, u64::MAX);
            for l in lits.iter().filter(|l| {
                l.atom.is_token_count() && (l.atom.layer(), l.atom.expert(), l.atom.ub()) == var
            }) {
                let t = u64::from(l.atom.threshold());
                if l.negated {
                    hi = hi.min(t);
                } else {
                    lo = lo.max(t);
                }
            }
            let max = match var.2 {
                Some(_) => tokens_per_ub,
                None => tokens_per_ub.saturating_mul(ubs),
            };
            lo >= hi || lo > max
        })
}

/// The share of a mixed step's declared rows a steady pass holds: its new tokens per
/// micro-batch over the declared `mixed_tokens`.
pub(super) fn steady_row_share(program: &Program, per_ub: &[UbLoad]) -> f64 {
    let declared = program.micro_batches.mixed_tokens.max(1) as f64;
    let tokens = per_ub
        .iter()
        .map(|l| (l.prefill_tokens + l.decode_seqs) as f64)
        .fold(0.0, f64::max);
    (tokens / declared).min(1.0)
}

/// The FLOP/s cap of a GPU task's kind in a step of `kind` (0: none). A mixed step's task
/// counts as prefill when it carries more tokens than sequences.
pub(super) fn gpu_rate_cap(
    op: &Op,
    shape: &Shape,
    kind: StepKind,
    adjust: &super::hardware::Adjustments,
) -> f64 {
    let prefill = match kind {
        StepKind::Prefill => true,
        StepKind::Decode => false,
        _ => shape.tokens > shape.seqs,
    };
    // No wildcard: a new class must say which cap (if any) its flops meet.
    match (op.def().cost, prefill) {
        (CostClass::Attention, true) => adjust.gpu_prefill_attn_flops,
        (CostClass::Attention, false) => adjust.gpu_decode_attn_flops,
        (CostClass::Copy, _) => 0.0,
        // Prefill GEMMs run at the prefill rate the profile's peak already holds
        // (`HardwareProfile::effective`); decode ones are capped at the decode GEMM rate.
        (
            CostClass::Linear
            | CostClass::LinearPerSequence
            | CostClass::ExpertFfn
            | CostClass::FusedPostAttn
            | CostClass::Roofline(_),
            true,
        ) => 0.0,
        (
            CostClass::Linear
            | CostClass::LinearPerSequence
            | CostClass::ExpertFfn
            | CostClass::FusedPostAttn
            | CostClass::Roofline(_),
            false,
        ) => adjust.gpu_decode_gemm_flops,
    }
}

/// One micro-batch's load as a `.context()` / `.appended()` copy sees it: at the declared
/// load, full micro-batches whose decoding sequences attend over the context `settings`
/// assumes; at a measured or steady load, the mean over the step's micro-batches (a copy
/// does not name its micro-batch in the program: value tracking finds it for the runtime).
pub(super) fn kv_part_load(
    program: &Program,
    kind: StepKind,
    settings: &CostSettings,
    loads: Loads<'_>,
) -> UbLoad {
    let size = program.micro_batches.size as usize;
    match loads {
        Loads::Measured(per_ub) | Loads::Steady(per_ub) => {
            let n = per_ub.len().max(1);
            let sum = |f: fn(&UbLoad) -> usize| per_ub.iter().map(f).sum::<usize>() / n;
            UbLoad {
                prefill_seqs: sum(|l| l.prefill_seqs),
                prefill_tokens: sum(|l| l.prefill_tokens),
                decode_seqs: sum(|l| l.decode_seqs),
                decode_context: sum(|l| l.decode_context),
                active_experts: Vec::new(),
            }
        }
        Loads::Declared if kind == StepKind::Prefill => UbLoad {
            prefill_seqs: size,
            prefill_tokens: size * program.workload.prompt_len as usize,
            ..UbLoad::default()
        },
        Loads::Declared => UbLoad {
            decode_seqs: size,
            decode_context: size * decode_context_len(program, settings) as usize,
            ..UbLoad::default()
        },
    }
}

/// Bytes a `.context()` (the positions cached before the step: decoding sequences'
/// context less their new token) or `.appended()` (every new token's position) copy moves
/// for a micro-batch at `load`, at the task's element size.
pub(super) fn kv_part_bytes_at(
    program: &Program,
    declared: &Shape,
    part: KvPart,
    load: &UbLoad,
) -> f64 {
    let per_token = (program.model.kv_elems_per_token_layer() * declared.kv_bytes) as f64;
    let positions = match part {
        KvPart::Context => load.decode_context.saturating_sub(load.decode_seqs),
        KvPart::Appended => load.prefill_tokens + load.decode_seqs,
    };
    positions as f64 * per_token
}

/// Simulates one step at `loads` and describes it (busy shares, bounds, timeline).
pub(crate) fn simulate_step(
    program: &Program,
    deps: &[Vec<TaskId>],
    step_index: usize,
    profile: &HardwareProfile,
    settings: &CostSettings,
    tables: &ProgramTables,
    loads: Loads<'_>,
) -> Result<StepPrediction, PredictError> {
    let step = &program.steps[step_index];
    let classes = tables.classes(program);
    let StepSim {
        ids,
        times,
        activations,
        result,
    } = simulate_step_times(program, deps, step_index, profile, settings, loads, tables)?;
    let makespan = result.makespan.max(1e-30);
    let stream_busy = program
        .streams
        .iter()
        .zip(&result.stream_busy)
        .map(|(s, busy)| (s.name.clone(), busy / makespan))
        .collect();
    let resource_busy = result
        .resource_busy
        .iter()
        .map(|(r, busy)| (r.clone(), busy / makespan))
        .collect();
    let spans = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| Span {
            stream: program.task(id).stream.index(),
            name: program.task_name(id),
            op: task_kind(program, id, classes),
            start: result.start[k],
            end: result.end[k],
        })
        .collect();
    let mut op_seconds: BTreeMap<String, (f64, String)> = BTreeMap::new();
    let mut op_roofs: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for (span, time) in spans_iter(&ids, program, classes).zip(&times) {
        op_seconds
            .entry(span.clone())
            .or_insert((0.0, String::new()))
            .0 += time.seconds;
        *op_roofs
            .entry(span)
            .or_default()
            .entry(time.roof.label())
            .or_default() += time.seconds;
    }
    for (op, entry) in op_seconds.iter_mut() {
        if let Some(roofs) = op_roofs.get(op) {
            entry.1 = roofs
                .iter()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .map(|(roof, _)| roof.clone())
                .unwrap_or_default();
        }
    }
    let copy_bytes = step_copy_bytes(
        program,
        &ids,
        &activations,
        step.kind,
        settings,
        classes,
        loads,
    );
    let timeline = Timeline {
        title: format!(
            "{} ({} step) on {}: {:.3} ms",
            program.name,
            step.kind.as_str(),
            profile.name,
            result.makespan * 1e3
        ),
        streams: program.streams.iter().map(|s| s.name.clone()).collect(),
        spans,
    };
    let mut arms: BTreeMap<String, ArmShare> = BTreeMap::new();
    if matches!(loads, Loads::Declared) {
        for ((&id, time), act) in ids.iter().zip(&times).zip(&activations) {
            let task = program.task(id);
            if task.guard.is_always() {
                continue;
            }
            let key = super::activation::arm_key(program, id);
            let entry = arms.entry(key.clone()).or_insert(ArmShare {
                arm: key,
                tasks: 0,
                expected_share: 0.0,
                seconds: 0.0,
            });
            entry.tasks += 1;
            entry.expected_share += act.runs;
            entry.seconds += time.seconds;
        }
    }
    let arms = arms
        .into_values()
        .map(|mut a| {
            a.expected_share /= a.tasks.max(1) as f64;
            a
        })
        .collect();
    Ok(StepPrediction {
        kind: step.kind.as_str().to_string(),
        arms,
        tasks: ids.len(),
        seconds: result.makespan,
        stream_busy,
        resource_busy,
        resource_bound: step_resource_bound(program, &ids, &activations, profile, settings, loads),
        op_seconds,
        copy_bytes,
        timeline,
    })
}

/// Bytes moved per copy kind over a step's tasks `ids` (`activations` their expected
/// activations, as [`StepSim`] holds them), as `simulate_step_ran` charges them.
pub(super) fn step_copy_bytes(
    program: &Program,
    ids: &[TaskId],
    activations: &[Activation],
    kind: StepKind,
    settings: &CostSettings,
    classes: &[BufferClass],
    loads: Loads<'_>,
) -> BTreeMap<String, f64> {
    let kv_load = kv_part_load(program, kind, settings, loads);
    let mut bytes: BTreeMap<String, f64> = BTreeMap::new();
    for (&id, act) in ids.iter().zip(activations) {
        let task = program.task(id);
        let Some(copy) = task.work.copy else {
            continue;
        };
        let runs = act.runs;
        let moved = match task.kv {
            Some(part) => kv_part_bytes_at(program, &task.shape, part, &kv_load),
            None => copy_bytes_at(task, copy, loads),
        };
        *bytes.entry(task_kind(program, id, classes)).or_default() += moved * runs;
    }
    bytes
}

pub(super) fn spans_iter<'a>(
    ids: &'a [TaskId],
    program: &'a Program,
    classes: &'a [BufferClass],
) -> impl Iterator<Item = String> + 'a {
    ids.iter().map(move |&id| task_kind(program, id, classes))
}

/// Eq. 12-13 over a step's own tasks (`activations` as [`StepSim`] holds them):
/// host->GPU bytes, GPU->host bytes, GPU and CPU work.
pub(super) fn step_resource_bound(
    program: &Program,
    ids: &[TaskId],
    activations: &[Activation],
    profile: &HardwareProfile,
    settings: &CostSettings,
    loads: Loads<'_>,
) -> LayerBound {
    let mut work = LayerWork::default();
    for (&id, &act) in ids.iter().zip(activations) {
        let task = program.task(id);
        // At the declared load, guarded work counts by its expected activation (as in the
        // simulation); a measured load is re-costed in full.
        if let Some(copy) = task.work.copy {
            let bytes = copy_bytes_at(task, copy, loads) * act.runs;
            match (copy.src, copy.dst) {
                (Space::Gpu, Space::Gpu) => {}
                (Space::Disk, _) => work.disk_bytes += bytes,
                (_, Space::Gpu) => work.host_to_gpu_bytes += bytes,
                (Space::Gpu, _) => work.gpu_to_host_bytes += bytes,
                _ => {}
            }
            continue;
        }
        if task.op == Op::Copy {
            continue;
        }
        let mut load = compute_load(program, id, settings, loads);
        load.flops *= act.work;
        for (_, bytes) in &mut load.bytes {
            *bytes *= act.runs;
        }
        match load.processor {
            Processor::Gpu => work.gpu.push(load),
            Processor::Cpu => work.cpu.push(load),
        }
    }
    bounds::moe_lightning_layer_bound(profile, &work)
}

/// Bytes of weights a decode step streams to the GPU (copies of weight-class buffers).
pub(super) fn streamed_weight_bytes(
    program: &Program,
    ids: &[TaskId],
    classes: &[BufferClass],
) -> f64 {
    ids.iter()
        .map(|&id| program.task(id))
        .filter_map(|task| {
            let copy = task.work.copy?;
            let src = task.args.first()?.slice.buffer;
            (copy.dst == Space::Gpu
                && copy.src != Space::Gpu
                && classes[src.index()] == BufferClass::Weights)
                .then_some(copy.bytes as f64)
        })
        .sum()
}

/// A planner point's steps costed once, before its dependencies are built: an upper bound
/// on its throughput from them alone ([`PointCosts::throughput_bound`]), then the exact
/// figures of [`super::predict::predict_throughput`] once the dependencies are known
/// ([`PointCosts::throughput`]), without costing a task twice.
pub struct PointCosts<'p> {
    program: &'p Program,
    /// The profile, or its pageable fallback when the pinned peak exceeds what the host
    /// can lock (as [`super::predict::predict`] decides).
    profile: std::borrow::Cow<'p, HardwareProfile>,
    steady: Vec<UbLoad>,
    tables: ProgramTables,
    steps: Vec<StepCosts>,
}

impl<'p> PointCosts<'p> {
    /// Costs every step of `program` (in parallel) at the loads the prediction uses: the
    /// declared worst case, or a mixed step's steady state. `pinned_peak` is the program's
    /// peak pinned bytes ([`super::budget::BudgetTable::peak`]).
    pub fn new(
        program: &'p Program,
        profile: &'p HardwareProfile,
        settings: &CostSettings,
        pinned_peak: u64,
    ) -> Self {
        use rayon::prelude::*;
        let profile = if pinned_peak as f64 > profile.capacity_bytes(Level::Pinned) {
            std::borrow::Cow::Owned(profile.pageable_fallback())
        } else {
            std::borrow::Cow::Borrowed(profile)
        };
        let steady = super::predict::steady_mixed_loads(program);
        let tables = ProgramTables::default();
        let steps = (0..program.steps.len())
            .into_par_iter()
            .map(|index| {
                let loads = if program.steps[index].kind == StepKind::Mixed {
                    Loads::Steady(&steady)
                } else {
                    Loads::Declared
                };
                cost_step(program, index, &profile, settings, loads, None, &tables)
            })
            .collect();
        PointCosts {
            program,
            profile,
            steady,
            tables,
            steps,
        }
    }

    /// An upper bound on the figures [`PointCosts::throughput`] will give, from each
    /// step's [`makespan_lower_bound`] (the throughput falls as any step's seconds grow),
    /// or `None` when no bound holds (a time that is not a finite non-negative number,
    /// which the simulation reports as an error).
    pub fn throughput_bound(&self) -> Option<Throughput> {
        let seconds = self
            .steps
            .iter()
            .map(|costs| makespan_lower_bound(self.program, &self.profile, costs))
            .collect::<Option<Vec<f64>>>()?;
        Some(throughput_of(self.program, &self.steady, &seconds))
    }

    /// The point's throughput figures, equal to [`super::predict::predict_throughput`]'s
    /// (which is this): each step simulated with `deps` (per task, the earlier tasks it
    /// waits for), the steps in parallel.
    pub fn throughput(self, deps: &[Vec<TaskId>]) -> Result<Throughput, PredictError> {
        use rayon::prelude::*;
        if deps.len() != self.program.tasks.len() {
            return Err(PredictError::DepsMismatch {
                got: deps.len(),
                tasks: self.program.tasks.len(),
            });
        }
        let PointCosts {
            program,
            profile,
            steady,
            tables,
            steps,
        } = self;
        // Collected in step order, so the error reported is the first step's, as in
        // `predict`.
        let simulated: Vec<Result<f64, PredictError>> = steps
            .into_par_iter()
            .enumerate()
            .map(|(index, costs)| {
                simulate_costed(program, deps, index, &profile, costs, &tables)
                    .map(|sim| sim.result.makespan)
            })
            .collect();
        let seconds = simulated.into_iter().collect::<Result<Vec<f64>, _>>()?;
        Ok(throughput_of(program, &steady, &seconds))
    }
}
