//! The driver: executes a lowered plan as real MoE inference on any [`Backend`].
//!
//! Takes an [`ExecPlan`], a backend set up for it and prompts as token ids; gives per prompt the
//! generated ids, and a [`RunStats`] with the measured timeline of every task. Requests are
//! batched into the plan's micro-batches ([`batching`]); for a plan with `prefill` and
//! `decode` steps, each batch is prefilled once and the decode step is repeated until every
//! sequence has stopped (EOS or length); a plan with one mixed `step` (VSLPipe) repeats it,
//! admitting waiting prompts into free sequence slots while others decode, under the
//! micro-batch's token cap and KV capacity. Guarded tasks are skipped from the real
//! routing that the plan's `ReadRouting` instructions brought to the host (the checker
//! proves every guarded task is ordered after its gate); `hot(i, k)` follows a running
//! expert-correlation predictor. The driver names no backend type: everything a device
//! does goes through [`Backend`].

pub(crate) mod batching;
pub mod cache;
pub mod eam;
pub mod executor;
pub mod kv_copy;
pub mod report;
pub(crate) mod scheduler;
pub mod serving;
pub mod session;
pub mod state;
pub mod workload;

use super::backend::{Backend, BackendError};
use crate::ir::{ExpertRef, Op, Role, StreamId, TaskId};
use crate::lower::{EventId, ExecPlan, PlanTask};
use crate::model::vocab::Sampling;
use crate::records::{GraphUse, RunStats, TaskRecord, TaskRun, UbLoad};
use crate::span::Span;
use batching::UbCapacity;
use executor::{run_step, ExecError, ExecOptions, StreamOps};
use state::{lock, MicroBatchState, StepState};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The backend could not be set up for the plan.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A step failed (task error, stall).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The plan lacks steps the driver needs.
    #[error("schedule `{0}` has neither `prefill` + `decode` steps nor a mixed `step`")]
    Steps(String),
    /// A prompt that can never be admitted.
    #[error("prompt {index} ({tokens} tokens + {gen_len} to generate) fits in no micro-batch of this schedule (largest: {max_tokens} tokens per step, KV for {kv_tokens}); compile it for a longer prompt_len")]
    PromptTooLarge {
        /// Prompt index.
        index: usize,
        /// Its tokens.
        tokens: usize,
        /// Tokens to generate.
        gen_len: usize,
        /// Largest token cap of a micro-batch.
        max_tokens: usize,
        /// Largest KV capacity of a micro-batch.
        kv_tokens: usize,
    },
    /// An empty prompt.
    #[error("prompt {0} is empty")]
    EmptyPrompt(usize),
    /// A prompt plus its generation runs past the model's positions (checked before any
    /// memory is allocated).
    #[error("prompt {index} has {tokens} tokens; with {gen_len} to generate it needs {needed} positions, past the model's {max}")]
    PastPositions {
        /// Prompt index.
        index: usize,
        /// Its tokens.
        tokens: usize,
        /// Tokens to generate.
        gen_len: usize,
        /// Positions needed (`tokens + gen_len`).
        needed: usize,
        /// The model's positions.
        max: usize,
    },
    /// A sequence was refused by the session it was submitted to.
    #[error("a sequence was refused: {0}")]
    Refused(String),
    /// Every running sequence is paused for KV blocks and none can be admitted.
    #[error("the KV cache is too small for the running sequences: {paused} sequences wait for blocks and none can be preempted (their re-prefill exceeds the token cap of {max_tokens}); give the schedule more KV cache")]
    KvStall {
        /// Sequences waiting for blocks.
        paused: usize,
        /// Largest token cap of a micro-batch.
        max_tokens: usize,
    },
}

impl RunError {
    /// The schedule span the error points at, if any.
    pub fn span(&self) -> Option<Span> {
        match self {
            RunError::Exec(e) => e.span(),
            _ => None,
        }
    }
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Tokens to generate per prompt at most.
    pub max_new_tokens: usize,
    /// Greedy or temperature/top-p.
    pub sampling: Sampling,
    /// Sampler seed (sequence `i` uses the same stream as the oracle's sequence `i`).
    pub seed: u64,
    /// Stop a sequence at the card's EOS token.
    pub stop_at_eos: bool,
    /// Which backend runs the plan (`runtime::generate` sets it up; the driver itself
    /// runs on whatever backend it is given).
    pub on: &'static super::registration::Registration,
    /// What the backend is set up with (threads, link throttle, device capacity).
    pub backend: super::backend::BackendOptions,
    /// Stall detection.
    pub exec: ExecOptions,
    /// Test hook: fail this task (by index) on its n-th run (1-based), as if its kernel
    /// had failed.
    pub kill_task: Option<(u32, u32)>,
    /// `moec profile`: every step's read-back routing is added to these counts (plan
    /// lowered with `read_all_routing`, so every gate's routing is on the host).
    pub routing_profile:
        Option<std::sync::Arc<std::sync::Mutex<crate::ir::profile::RoutingProfile>>>,
    /// Hand each output the logits its last token was sampled from (`moec run
    /// --dump-logits`, comparing backends); costs a read-back per step on a device.
    pub capture_logits: bool,
    /// Request-level expert activation matrices to start the `eam` predictor's
    /// collection with (`moec profile` writes them; `--profile` reads them back).
    pub eam_seed: Vec<Vec<u64>>,
    /// Prefill prompts longer than a pass's token room in chunks over several passes
    /// (`moec run --prefill-chunk`; [`session::Session::on_demand_kv`]); refused where the
    /// plan's prefill does not attend the KV cache its decode reads.
    pub chunked_prefill: bool,
}

impl RunOptions {
    /// Greedy generation of `max_new_tokens`, stopping at EOS, default threads.
    pub fn greedy(max_new_tokens: usize) -> Self {
        RunOptions {
            max_new_tokens,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_at_eos: true,
            on: super::registry::default_backend(),
            backend: super::backend::BackendOptions {
                threads: std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1),
                ..Default::default()
            },
            exec: ExecOptions::default(),
            kill_task: None,
            routing_profile: None,
            capture_logits: false,
            eam_seed: Vec::new(),
            chunked_prefill: false,
        }
    }
}

/// The output of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutput {
    /// Generated ids (the EOS that stopped it included).
    pub token_ids: Vec<u32>,
    /// With `RunOptions::capture_logits`: the logits the last token was sampled from.
    pub logits: Option<Vec<f32>>,
}

/// The driver's side of a step: guards, the kill hook and routing read-back, around the
/// backend's commands.
struct Runner<'a, B: Backend + ?Sized> {
    plan: &'a ExecPlan,
    backend: &'a B,
    state: &'a StepState,
    kill: Option<(u32, u32)>,
    /// Shared by every step's runner, so the hook counts runs across steps.
    kill_count: &'a AtomicU32,
    /// How long a fetch waits for a free cache slot before the run fails (the watchdog).
    patience: std::time::Duration,
}

/// Why a guard could not be decided: the routing it reads was never read back (the
/// checker orders every guarded task after its gate, so this is an internal error).
#[derive(Debug, thiserror::Error)]
#[error("its guard reads the routing of layer {layer}, which has not been read back to the host")]
struct UnknownRouting {
    layer: u32,
}

impl<B: Backend + ?Sized> Runner<'_, B> {
    fn guard_holds(&self, task: &PlanTask) -> Result<bool, BackendError> {
        if self.backend.decides_guard_on_device(task) {
            return Ok(true);
        }
        // A fetch guarded by its own key's residency (`if ec.resident(l, e) { fetch ..
        // -> ec.slot(l, e) }`) skipped for that literal alone is the cache's miss of an
        // expert the step computes: counted with the misses, once per such arm.
        let own = task.cache.and_then(|c| {
            (c.op == crate::ir::cache::CacheOp::Fetch).then_some(crate::ir::GuardAtom::Resident {
                cache: c.key.cache,
                layer: c.key.layer,
                expert: c.key.expert,
            })
        });
        let mut own_missed = None;
        for lit in &task.guard.lits {
            if self.lit_holds(task, lit)? {
                continue;
            }
            match lit.atom {
                crate::ir::GuardAtom::Resident { cache, layer, .. }
                    if !lit.negated && Some(lit.atom) == own =>
                {
                    own_missed = Some((cache, layer));
                }
                _ => return Ok(false),
            }
        }
        if let Some((cache, layer)) = own_missed {
            if let Some(c) = self.state.caches.get(cache as usize) {
                c.guarded_miss(layer);
            }
            return Ok(false);
        }
        Ok(true)
    }

    /// Whether one literal of `task`'s guard holds now.
    fn lit_holds(&self, task: &PlanTask, lit: &crate::ir::GuardLit) -> Result<bool, BackendError> {
        let (layer, ub) = (lit.atom.layer(), lit.atom.ub());
        let expert = self.state.resolve_expert(
            Some(task.id),
            lit.atom.expert(),
            self.plan.model.experts as u32,
        );
        let holds = match lit.atom {
            // The cache as it is now: `moec check` proved that no fetch or prefetch into it
            // can run between this task's decision and any other task's decision of the
            // same guard (`cache::stale_guard`).
            crate::ir::GuardAtom::Resident { cache, .. } => {
                let Some(c) = self.state.caches.get(cache as usize) else {
                    return Err(BackendError::Task(Box::new(UnknownCache(cache))));
                };
                c.resident((layer, expert))
            }
            crate::ir::GuardAtom::Score {
                kind,
                at_least_bits,
                ..
            } => {
                let Some(score) = self.state.routed_score(layer, expert, ub, kind) else {
                    return Err(BackendError::Task(Box::new(UnknownRouting { layer })));
                };
                score >= f32::from_bits(at_least_bits)
            }
            crate::ir::GuardAtom::Active { .. } | crate::ir::GuardAtom::Tokens { .. } => {
                match self.state.routed_tokens(layer, expert, ub) {
                    Some(tokens) => lit.atom.holds_for(tokens),
                    None => return Err(BackendError::Task(Box::new(UnknownRouting { layer }))),
                }
            }
        };
        Ok(holds != lit.negated)
    }
}

impl<B: Backend + ?Sized> Runner<'_, B> {
    /// A `fetch` or `prefetch`: resolve the expert, take a slot (a hit takes the resident
    /// one), and on a copy wait for every reader of the slot's previous expert and fence
    /// the fill, so a device never overwrites a slot still read nor reads one still filled.
    fn cache_copy(
        &self,
        stream: StreamId,
        t: &PlanTask,
        copy: crate::lower::PlanCacheCopy,
    ) -> Result<TaskRun, BackendError> {
        let Some(cache) = self.state.caches.get(copy.key.cache as usize) else {
            return Err(BackendError::Task(Box::new(UnknownCache(copy.key.cache))));
        };
        let (layers, experts) = (
            self.plan.model.layers as usize,
            self.plan.model.experts as u32,
        );
        let layer = copy.key.layer;
        let expert = match copy.key.expert {
            ExpertRef::Predicted { rank, .. } => {
                let (e, idle) =
                    self.state
                        .predicted_expert(cache.spec.predictor, layer, rank, layers, experts);
                if idle {
                    cache.prefetch_cancelled(layer);
                    return Ok(TaskRun::Skipped);
                }
                e
            }
            other => self.state.resolve_expert(Some(t.id), other, experts),
        };
        let scores = self.state.policy_scores(cache, layers, experts as usize);
        let score = |(l, e): cache::Key| {
            scores
                .get(l as usize)
                .and_then(|r| r.get(e as usize))
                .copied()
                .unwrap_or(0.0)
        };
        let bind = |slot: u32, remaining: u32| {
            lock(&self.state.cache_bindings).insert(
                t.id,
                cache::Binding {
                    cache: copy.key.cache,
                    slot,
                    expert,
                    remaining,
                },
            );
        };
        let prefetch = copy.op == crate::ir::cache::CacheOp::Prefetch;
        let slot = if prefetch {
            match cache.prefetch((layer, expert), &score) {
                Some(slot) => slot,
                None => return Ok(TaskRun::Skipped),
            }
        } else {
            match cache
                .fetch((layer, expert), &score, self.patience)
                .map_err(|e| BackendError::Task(Box::new(e)))?
            {
                cache::Fetched::Hit(slot) => {
                    bind(slot, copy.readers);
                    let fill = self.plan.slot_fence(copy.key.cache, slot, None);
                    self.backend.wait(stream, fill)?;
                    if copy.readers == 0 {
                        cache.release(slot);
                    }
                    return Ok(TaskRun::Hit);
                }
                cache::Fetched::Miss(slot) => slot,
            }
        };
        bind(slot, if prefetch { 0 } else { copy.readers });
        // The slot's previous fill (on another stream, maybe still in flight on a device)
        // and every read of its previous expert come first.
        self.backend
            .wait(stream, self.plan.slot_fence(copy.key.cache, slot, None))?;
        for s in 0..self.plan.streams.len() {
            let read = self
                .plan
                .slot_fence(copy.key.cache, slot, Some(StreamId::new(s)));
            self.backend.wait(stream, read)?;
        }
        self.backend.run(stream, t.engine, t, self.state)?;
        self.backend
            .record(stream, self.plan.slot_fence(copy.key.cache, slot, None))?;
        cache.filled(slot, prefetch);
        if !prefetch && copy.readers == 0 {
            cache.release(slot);
        }
        Ok(TaskRun::Ran)
    }

    /// A copy of part of a KV cache: the runs of bytes that hold the wanted positions of
    /// the micro-batch's sequences, at the same offsets in both slices, as one backend
    /// command.
    fn kv_part_copy(
        &self,
        stream: StreamId,
        t: &PlanTask,
        kv: crate::lower::PlanKvCopy,
    ) -> Result<(), BackendError> {
        let Some(mb) = self.state.ubs.get(kv.ub as usize) else {
            return Ok(()); // a micro-batch beyond the plan's holds no sequences
        };
        let card = &self.plan.model;
        let layout = crate::model::vocab::KvLayout {
            block_size: mb.block_size.max(1),
            kv_heads: card.kv_heads as usize,
            head_dim: card.head_dim as usize,
            values_in_keys: card.mla.and_then(|m| m.values_in_keys()),
        };
        let (Some(src), Some(dst)) = (t.args.first(), t.args.get(1)) else {
            return Ok(());
        };
        // The copy moves the plan's cache elements (`--kv-type`), as its task's shape says.
        let elem = t.shape.kv_bytes.max(1);
        let runs = kv_copy::runs(&layout, elem, src.len.min(dst.len), &mb.seqs, kv.part)
            .map_err(|e| BackendError::Task(Box::new(e)))?;
        if runs.is_empty() {
            return Ok(()); // no wanted positions (a prefill's context): no command at all
        }
        self.backend
            .copy_runs(stream, t.engine, t, &runs, self.state)
    }

    /// A copy of an activation's live rows: the first `rows x row_bytes` bytes of both
    /// slices, the rows the micro-batch's tokens (or sequences) occupy in this step, as
    /// one backend command; the rest of the slice holds nothing this step reads
    /// (`check::live`).
    fn live_copy(
        &self,
        stream: StreamId,
        t: &PlanTask,
        live: crate::ir::LiveRows,
    ) -> Result<(), BackendError> {
        let Some(mb) = self.state.ubs.get(live.ub as usize) else {
            return Ok(()); // a micro-batch beyond the plan's holds no rows
        };
        let (Some(src), Some(dst)) = (t.args.first(), t.args.get(1)) else {
            return Ok(());
        };
        let bytes = live
            .bytes(mb.n_tokens() as u64, mb.seqs.len() as u64)
            .min(src.len.min(dst.len));
        if bytes == 0 {
            return Ok(()); // an empty micro-batch: no rows, no command
        }
        self.backend
            .copy_runs(stream, t.engine, t, &[(0, bytes)], self.state)
    }

    /// After a task ran (`ran`) or was skipped: each cache slot it read counts down its
    /// fetch's readers (a read is fenced on this stream first); the last one frees the slot.
    fn release_reads(&self, stream: StreamId, t: &PlanTask, ran: bool) -> Result<(), BackendError> {
        for arg in &t.args {
            let Some(fetch) = arg.cache_fetch.filter(|f| *f != t.id && arg.access.reads()) else {
                continue;
            };
            let mut bindings = lock(&self.state.cache_bindings);
            let Some(b) = bindings.get_mut(&fetch) else {
                continue; // its fetch was skipped, so this read was too
            };
            if ran {
                self.backend
                    .record(stream, self.plan.slot_fence(b.cache, b.slot, Some(stream)))?;
            }
            b.remaining = b.remaining.saturating_sub(1);
            if b.remaining == 0 {
                if let Some(c) = self.state.caches.get(b.cache as usize) {
                    c.release(b.slot);
                }
            }
        }
        Ok(())
    }
}

/// Fills each micro-batch's distinct routed experts per layer from what the step's ops
/// noted ([`StepState::note_active_experts`]) and, where an op did not (a CUDA `gate`),
/// from the routing the plan read back; what the cost model's replay charges a whole-layer
/// expert task for.
fn count_active_experts(loads: &mut [UbLoad], state: &StepState, experts: usize) {
    let mut seen = lock(&state.active_experts).clone();
    for (&key, r) in lock(&state.routing).iter() {
        seen.entry(key)
            .or_insert_with(|| state::distinct_experts(r, experts));
    }
    for ((layer, ub), n) in seen {
        let Some(load) = loads.get_mut(ub as usize) else {
            continue;
        };
        let layer = layer as usize;
        if load.active_experts.len() <= layer {
            load.active_experts.resize(layer + 1, 0);
        }
        load.active_experts[layer] = n;
    }
}

/// A plan naming a cache the run did not set up (an internal error).
#[derive(Debug, thiserror::Error)]
#[error("the plan names expert cache {0}, which this run has not set up")]
struct UnknownCache(u32);

impl<B: Backend + ?Sized> StreamOps for Runner<'_, B> {
    fn run_task(&self, stream: StreamId, task: TaskId) -> Result<TaskRun, BackendError> {
        let t = &self.plan.tasks[task.index()];
        if let Some((kill, nth)) = self.kill {
            if kill == task.0 && self.kill_count.fetch_add(1, Ordering::SeqCst) + 1 == nth {
                return Err(BackendError::Killed);
            }
        }
        if !self.guard_holds(t)? {
            self.release_reads(stream, t, false)?;
            return Ok(TaskRun::Skipped);
        }
        if let Some(copy) = t.cache {
            return self.cache_copy(stream, t, copy);
        }
        if let Some(kv) = t.kv {
            self.kv_part_copy(stream, t, kv)?;
            return Ok(TaskRun::Ran);
        }
        if let Some(live) = t.live {
            self.live_copy(stream, t, live)?;
            return Ok(TaskRun::Ran);
        }
        self.backend.run(stream, t.engine, t, self.state)?;
        self.release_reads(stream, t, true)?;
        Ok(TaskRun::Ran)
    }

    fn record(&self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        self.backend.record(stream, event)
    }

    fn wait(&self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        self.backend.wait(stream, event)
    }

    fn read_routing(&self, stream: StreamId, gate: TaskId) -> Result<(), BackendError> {
        let t = &self.plan.tasks[gate.index()];
        let (layer, ub, lookahead) = match t.op {
            Op::Gate { layer, ub } => (layer, ub, false),
            Op::Pregate { layer, ub } => (layer, ub, true),
            _ => return Ok(()),
        };
        if self.backend.skips_read_back(t) {
            return Ok(());
        }
        let tokens = self
            .state
            .ubs
            .get(ub as usize)
            .map_or(0, MicroBatchState::n_tokens);
        if tokens == 0 {
            return Ok(());
        }
        let Some(route) = t.args.iter().find(|a| a.role == Role::Route) else {
            return Err(BackendError::Routing(format!(
                "{} has no `route` argument",
                t.name
            )));
        };
        let top_k = self.plan.model.top_k as usize;
        let routing = self.backend.read_routing(stream, t, route, tokens, top_k)?;
        let into = if lookahead {
            &self.state.lookahead
        } else {
            &self.state.routing
        };
        lock(into).insert((layer, ub), routing);
        Ok(())
    }
}

/// A step as [`StepRunner::run_graphed`] ran it: (start, end) seconds from the origin,
/// its tasks, how its device work was submitted and where its time went
/// ([`crate::records::StepSplit`], for a step launched from its graph).
type Graphed = (
    f64,
    f64,
    Vec<TaskRecord>,
    Option<GraphUse>,
    Option<crate::records::StepSplit>,
);

/// Everything a step's [`Runner`] needs but the step state, which the driver mutates
/// between steps.
struct StepRunner<'a, B: Backend + ?Sized> {
    plan: &'a ExecPlan,
    backend: &'a B,
    kill: Option<(u32, u32)>,
    kill_count: &'a AtomicU32,
    exec: ExecOptions,
    origin: Instant,
}

impl<B: Backend + ?Sized> StepRunner<'_, B> {
    /// Runs step `index` over `state`: (start, end) seconds from the origin and its tasks
    /// (device-measured times replace the host's when the backend has them).
    /// With how the backend submitted the step's device work (`None`: no device).
    fn run_graphed(&self, state: &StepState, index: usize) -> Result<Graphed, RunError> {
        let runner = Runner {
            plan: self.plan,
            backend: self.backend,
            state,
            kill: self.kill,
            kill_count: self.kill_count,
            patience: self.exec.watchdog,
        };
        let start = self.origin.elapsed().as_secs_f64();
        // A step whose device work the backend holds for exactly its shape is launched
        // without running its tasks (nothing of them differs: `Backend::launch_replay`).
        if self.kill.is_none() {
            if let Ok(ticket) = self
                .backend
                .launch_replay(self.plan, index, state, false, false)?
            {
                let ended = self.backend.collect_replay(ticket, state)?;
                let end = self.origin.elapsed().as_secs_f64();
                return Ok((start, end, Vec::new(), ended.graph, ended.split));
            }
        }
        self.backend.begin_step(self.plan, index, state)?;
        let mut tasks = run_step(
            self.plan,
            &self.plan.steps[index],
            &runner,
            self.exec,
            self.origin,
        )?;
        let ended = self.backend.end_step(state)?;
        if let Some(times) = ended.times {
            // A KV-part copy is submitted once per run of bytes: it spans from its first
            // submission's start to its last one's end.
            let mut seen = std::collections::HashSet::new();
            for t in &times {
                if let Some(r) = tasks.iter_mut().find(|r| r.task == t.task) {
                    if seen.insert(t.task) {
                        r.start = start + t.start;
                        r.end = start + t.end;
                    } else {
                        r.start = r.start.min(start + t.start);
                        r.end = r.end.max(start + t.end);
                    }
                }
            }
        }
        Ok((
            start,
            self.origin.elapsed().as_secs_f64(),
            tasks,
            ended.graph,
            ended.split,
        ))
    }
}

/// Capacities of each micro-batch in a step (token cap from the `h` arguments, KV tokens
/// from the `kv` arguments of attention tasks anywhere in the plan).
fn capacities(plan: &ExecPlan, step: usize) -> Vec<UbCapacity> {
    let card = &plan.model;
    let n_ubs = plan.micro_batches.count as usize;
    let size = plan.micro_batches.size as usize;
    let mut caps = vec![
        UbCapacity {
            seqs: size,
            tokens: usize::MAX,
            kv_tokens: usize::MAX
        };
        n_ubs
    ];
    let token_bytes = (card.hidden * 4).max(1);
    let range = {
        let s = &plan.steps[step];
        s.first as usize..(s.first + s.count) as usize
    };
    for (i, task) in plan.tasks.iter().enumerate() {
        let Some(ub) = task.op.ub().map(|u| u as usize).filter(|u| *u < n_ubs) else {
            continue;
        };
        for arg in &task.args {
            if arg.role == Role::H && range.contains(&i) && !matches!(task.op, Op::LmHead { .. }) {
                caps[ub].tokens = caps[ub].tokens.min((arg.len / token_bytes) as usize);
            }
            if arg.role == Role::Kv && matches!(task.op, Op::Attn { .. }) {
                let kv_token_bytes = (card.kv_elems_per_token_layer() * task.shape.kv_bytes).max(1);
                caps[ub].kv_tokens = caps[ub].kv_tokens.min((arg.len / kv_token_bytes) as usize);
            }
        }
    }
    // A program that left out arms whose `routed(..) >= t` exceeds the step's tokens per
    // micro-batch is only right while no micro-batch holds more (`ir::Step::routed_ceiling`).
    let ceiling = plan.steps[step]
        .routed_ceiling
        .map_or(usize::MAX, |c| usize::try_from(c).unwrap_or(usize::MAX));
    for c in &mut caps {
        c.tokens = c.tokens.min(ceiling);
        if c.tokens == usize::MAX {
            c.tokens = 0;
        }
        if c.kv_tokens == usize::MAX {
            c.kv_tokens = 0;
        }
    }
    caps
}

/// Refuses prompts that are empty or that, with `gen_len` tokens generated, run past the
/// model's positions: the backends call it before allocating their arenas.
pub fn check_prompts(
    card: &crate::model::card::ModelCard,
    prompts: &[Vec<u32>],
    gen_len: usize,
) -> Result<(), RunError> {
    let max = usize::try_from(card.max_positions).unwrap_or(usize::MAX);
    for (index, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(RunError::EmptyPrompt(index));
        }
        let needed = p.len().saturating_add(gen_len);
        if needed > max {
            return Err(RunError::PastPositions {
                index,
                tokens: p.len(),
                gen_len,
                needed,
                max,
            });
        }
    }
    Ok(())
}

/// Runs `plan` on `backend` (set up for this plan) over `prompts` (token ids) and returns
/// the outputs in prompt order. `progress` is called after every step with (tokens
/// generated so far, tokens at most). A [`session::Session`] that every prompt is
/// submitted to before the first step (prompt `i` samples with the oracle's stream `i`).
pub fn generate<B: Backend + ?Sized>(
    plan: &ExecPlan,
    backend: &B,
    prompts: &[Vec<u32>],
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<RunOutput>, RunStats), RunError> {
    check_prompts(&plan.model, prompts, options.max_new_tokens)?;
    let gen_len = options.max_new_tokens;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut session = session::Session::new(plan, backend, options, gen_len, longest)?;
    if options.chunked_prefill && !session.on_demand_kv() {
        return Err(RunError::Refused(format!(
            "schedule `{}` cannot prefill in chunks: its prefill does not attend the KV cache its decode reads",
            plan.name
        )));
    }
    let mut outputs: Vec<RunOutput> = prompts
        .iter()
        .map(|_| RunOutput {
            token_ids: Vec::new(),
            logits: None,
        })
        .collect();
    // Every prompt is refused or accepted before anything runs; ids are prompt indices
    // (no sequence ends before all are submitted, so none is reused).
    let mut index_of = Vec::with_capacity(prompts.len());
    for (index, prompt) in prompts.iter().enumerate() {
        let request = session::SeqRequest {
            prompt: prompt.clone(),
            max_new_tokens: gen_len,
            sampling: options.sampling,
            seed: options.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            stop_at_eos: options.stop_at_eos,
        };
        let id = session.submit(request).map_err(|e| match e {
            session::SubmitError::Prompt(RunError::PromptTooLarge {
                tokens,
                gen_len,
                max_tokens,
                kv_tokens,
                ..
            }) => RunError::PromptTooLarge {
                index,
                tokens,
                gen_len,
                max_tokens,
                kv_tokens,
            },
            session::SubmitError::Prompt(e) => e,
            // Every prompt asks for the session's own length, so this is not reached.
            e @ session::SubmitError::TooManyTokens { .. } => RunError::Refused(e.to_string()),
        })?;
        if index_of.len() <= id {
            index_of.resize(id + 1, usize::MAX);
        }
        index_of[id] = index;
    }
    if gen_len == 0 {
        return Ok((outputs, session.finish()));
    }
    let total_tokens = prompts.len() * gen_len;
    let mut produced = 0usize;
    while !session.is_idle() {
        for event in session.step()? {
            match event {
                session::SeqEvent::Token { .. } => produced += 1,
                session::SeqEvent::Done {
                    id,
                    token_ids,
                    logits,
                    ..
                } => {
                    // A sequence that stopped early counts its unused tokens as done.
                    produced += gen_len.saturating_sub(token_ids.len());
                    if let Some(out) = index_of.get(id).and_then(|&i| outputs.get_mut(i)) {
                        *out = RunOutput { token_ids, logits };
                    }
                }
            }
        }
        progress(produced.min(total_tokens), total_tokens);
    }
    Ok((outputs, session.finish()))
}

/// Adds a step's routing to each request's activation matrix: a micro-batch's rows are
/// its sequences' new tokens in order.
fn record_activations(
    state: &StepState,
    routing: &std::collections::HashMap<(u32, u32), crate::model::vocab::Routing>,
) {
    let mut eam = lock(&state.eam);
    for (&(layer, ub), r) in routing {
        let Some(mb) = state.ubs.get(ub as usize) else {
            continue;
        };
        let k = r.top_k.max(1);
        let mut rows = r.experts.chunks(k);
        for seq in &mb.seqs {
            for _ in 0..seq.new_tokens.len() {
                for &e in rows.next().unwrap_or(&[]) {
                    eam.record(seq.request, layer, e, 1);
                }
            }
        }
    }
}
