//! Lowering: a checked program to a flat execution plan (bevy_ecs's `SystemSchedule`).
//!
//! Takes an [`ir::Program`] and its [`ScheduleInfo`] (the checker's reduced dependency
//! graph: data dependencies plus `after`); gives an [`ExecPlan`]: per step, per stream, an
//! instruction list of `Run(task)`, `Record(event)` and `Wait(event)`, and every buffer
//! placed at a byte offset in one arena per memory space. Nothing in it assumes the CPU:
//! the CPU backend and a CUDA backend read the same plan.
//!
//! Guarantees:
//! - a stream's `Run`s are its tasks of that step in issue order;
//! - for every dependency `a -> b` with `a` and `b` on different streams of the same step,
//!   `b`'s stream waits on an event recorded after `a`, unless the dependency is already
//!   implied (same-stream order, or an earlier wait whose recorder had itself seen `a`:
//!   vector clocks), so events exist for cross-stream edges only and none is redundant;
//! - every `Wait` names an event some other stream of the same step records, and a
//!   step's instruction lists can run to completion (the waits follow issue order, which
//!   is a topological order);
//! - dependencies between steps are satisfied by the runtime joining all streams at the
//!   end of each step, so no event crosses a step boundary;
//! - arenas: declared buffers of a space are laid out in declaration order, each at a
//!   [`ARENA_ALIGN`]-aligned offset; the checkpoint `W` is not in an arena (the backend
//!   maps it from the weights file); an arena larger than its capacity is an error.

use crate::check::ScheduleInfo;
use crate::ir::StepKind;
use crate::ir::{
    self, Access, BufferId, BufferKind, CheckpointLayout, Engine, ExpertRef, Guard, MicroBatches,
    Op, Program, Role, Shape, Space, StepId, StreamId, TaskId, Workload,
};
use crate::model::card::ModelCard;
use crate::span::Span;
use serde::Serialize;

/// Alignment of every buffer inside its arena (a cache line; also enough for any SIMD load).
pub const ARENA_ALIGN: u64 = 64;

/// An event: recorded by one stream after one task, waited on by others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct EventId(pub u32);

/// One instruction of a stream's program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Instr {
    /// Run a task (skipped at run time when its guard is false).
    Run(TaskId),
    /// Mark an event complete (everything before it on this stream has finished).
    Record(EventId),
    /// Block until an event is recorded.
    Wait(EventId),
    /// Bring the routing a `gate` task (run just before on this stream) wrote into its
    /// `route` argument back to the host, where guards and `hot(..)` read it: a no-op on
    /// the CPU, a device-to-host copy on a device. Lowering emits one after every gate
    /// whose routing some guard or `hot(..)` of the plan needs, before any event the
    /// stream records after the gate, so every task ordered after the gate also finds its
    /// routing on the host.
    ReadRouting(TaskId),
}

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Placement {
    /// The memory-mapped checkpoint (host, read-only, the backend's weights image).
    Checkpoint,
    /// `offset` bytes into the arena of `space`.
    Arena {
        /// The memory space.
        space: Space,
        /// Byte offset in that space's arena.
        offset: u64,
    },
}

/// A buffer's slot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BufferSlot {
    /// The element name (`w_gpu[1]`).
    pub name: String,
    /// Its placement.
    pub placement: Placement,
    /// Length in bytes.
    pub bytes: u64,
}

/// One memory space's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ArenaPlan {
    /// The space.
    pub space: Space,
    /// Bytes the buffers need (aligned sum).
    pub bytes: u64,
    /// The capacity the plan was lowered against, if limited.
    pub capacity: Option<u64>,
}

/// A task argument as the backend sees it: a byte range of a placed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanArg {
    /// The role it is passed as.
    pub role: Role,
    /// Read, write or both.
    pub access: Access,
    /// The buffer.
    pub buffer: BufferId,
    /// First byte within the buffer.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// For `W[i].expert(hot(i, k))`: resolved at run time (`start` is expert 0).
    pub dynamic_expert: Option<ExpertRef>,
    /// For `CACHE.slot(l, e)`: the `fetch` (or the `fetch`/`prefetch` task itself, for
    /// the slot it fills) whose run-time slot this names; the runtime adds `slot * len`
    /// to `start` (slot 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_fetch: Option<TaskId>,
}

/// A copy of part of one layer's KV cache (`.context()` / `.appended()`): the runtime
/// copies those positions of the micro-batch's sequences (each through its block table),
/// at the same offsets in both slices, and nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanKvCopy {
    /// Which positions.
    pub part: crate::ir::KvPart,
    /// The layer whose cache it is (its attention geometry lays the cache out).
    pub layer: u32,
    /// The micro-batch whose sequences' positions are copied.
    pub ub: u32,
}

/// A `fetch` or `prefetch`: which cache and expert, and how many task arguments read the
/// slot it makes resident (the runtime frees the slot once they ran or were skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanCacheCopy {
    /// Fetch or prefetch.
    pub op: crate::ir::cache::CacheOp,
    /// The cache (index into [`ExecPlan::caches`]) and the expert.
    pub key: crate::ir::cache::CacheKey,
    /// Reader arguments bound to this fetch in its step.
    pub readers: u32,
}

/// An expert cache as the runtime needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanCache {
    /// The declared name.
    pub name: String,
    /// Its buffer.
    pub buffer: BufferId,
    /// Slots.
    pub slots: u32,
    /// Bytes of one slot (one expert).
    pub slot_bytes: u64,
    /// Eviction policy.
    pub policy: crate::ir::cache::EvictPolicy,
    /// With `EvictPolicy::Score`: the schedule-computed score of every (layer, expert).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<crate::ir::cache::EvictScore>,
    /// Predictor of `predicted(..)`.
    pub predictor: crate::ir::cache::Predictor,
    /// First of its fences: per slot, one event its fills record and, per stream, one its
    /// readers record ([`ExecPlan::slot_fence`]). Fence ids follow every step's events.
    pub fence_base: u32,
}

/// A task as the backend needs it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanTask {
    /// Its id (its index in the plan's tasks), so a backend can report per-task times.
    #[serde(skip)]
    pub id: TaskId,
    /// Short human name (`#12 post_attn(layer=1, ub=0)`).
    pub name: String,
    /// The op.
    pub op: Op,
    /// The engine of its stream.
    pub engine: Engine,
    /// Index into [`ExecPlan::streams`].
    pub stream: StreamId,
    /// The step it belongs to.
    pub step: StepId,
    /// Its arguments.
    pub args: Vec<PlanArg>,
    /// Runs only when this holds.
    pub guard: Guard,
    /// Set on a copy into an expert cache slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<PlanCacheCopy>,
    /// Set on a copy of part of a KV cache: which positions of whose cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv: Option<PlanKvCopy>,
    /// Set on a copy of an activation the checker proved holds one micro-batch's rows of
    /// the running step: the runtime copies those rows (the first `rows x row_bytes`
    /// bytes of both slices), not the whole slice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<crate::ir::LiveRows>,
    /// The worst-case shape the sizes assume.
    pub shape: Shape,
    /// Where it is written in the schedule.
    #[serde(skip)]
    pub span: Span,
}

/// A stream's name and engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlanStream {
    /// Its name.
    pub name: String,
    /// Its engine.
    pub engine: Engine,
}

/// One step template's programs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepPlan {
    /// Prefill, decode or mixed.
    #[serde(serialize_with = "ser_kind")]
    pub kind: StepKind,
    /// Its tasks: `tasks[first..first + count]` of the plan.
    pub first: u32,
    /// Number of tasks.
    pub count: u32,
    /// [`crate::ir::Step::routed_ceiling`]: the most tokens a micro-batch of this step
    /// may hold, where the compiled program relies on it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_ceiling: Option<u64>,
    /// One instruction list per stream (indexed like [`ExecPlan::streams`]).
    pub programs: Vec<Vec<Instr>>,
    /// Events this step uses: `events[e]` is the task after which event `e` is recorded.
    pub events: Vec<TaskId>,
}

fn ser_kind<S: serde::Serializer>(kind: &StepKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(kind.as_str())
}

/// The flat plan every backend executes.
#[derive(Debug, Clone, Serialize)]
pub struct ExecPlan {
    /// The schedule's name.
    pub name: String,
    /// The model card the plan was compiled for (the backend's kernels and weights).
    #[serde(skip)]
    pub model: ModelCard,
    /// The packed layout of the checkpoint `W` that weight slices address.
    #[serde(skip)]
    pub checkpoint: CheckpointLayout,
    /// Micro-batches: how many, and the worst case each was sized for.
    pub micro_batches: MicroBatches,
    /// The workload the sizes assume (the driver's longest prompt for KV blocks).
    pub workload: Workload,
    /// Streams, indexed by `StreamId`, with their engines.
    pub streams: Vec<PlanStream>,
    /// Tasks, indexed by [`TaskId`].
    pub tasks: Vec<PlanTask>,
    /// Buffers, indexed by [`BufferId`].
    pub buffers: Vec<BufferSlot>,
    /// One arena per memory space, in [`Space::ALL`] order.
    pub arenas: Vec<ArenaPlan>,
    /// Steps in declaration order.
    pub steps: Vec<StepPlan>,
    /// Each task's direct predecessors (the checker's reduced graph), for reports.
    #[serde(skip)]
    pub preds: Vec<Vec<TaskId>>,
    /// Expert caches, indexed by [`crate::ir::cache::CacheKey::cache`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<PlanCache>,
    /// Format copies of the experts (`W.q8_0`) the runtime makes at load into their
    /// `host` arena slots.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub format_copies: Vec<PlanFormatCopy>,
}

/// A format copy of every MoE expert (`BufferKind::FormatCopy`): slot `(l - dense_layers)
/// * experts + e` of `buffer` holds expert `e` of layer `l` in `format`, laid out as that
/// expert of the card with its experts in `format` (`model::layout::with_expert_storage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanFormatCopy {
    /// The buffer (placed in the `host` arena).
    pub buffer: BufferId,
    /// The format.
    pub format: crate::model::Storage,
    /// One expert's bytes in it.
    pub expert_bytes: u64,
}

impl ExecPlan {
    /// The arena of a space.
    pub fn arena(&self, space: Space) -> ArenaPlan {
        self.arenas
            .iter()
            .copied()
            .find(|a| a.space == space)
            .unwrap_or(ArenaPlan {
                space,
                bytes: 0,
                capacity: None,
            })
    }

    /// Events a backend must create: the most any step uses, then the cache fences.
    pub fn event_count(&self) -> usize {
        let step_events = self.steps.iter().map(|s| s.events.len()).max().unwrap_or(0);
        step_events + self.fence_count()
    }

    /// Cache fences: per cache slot, one for fills and one per stream for readers.
    pub fn fence_count(&self) -> usize {
        self.caches
            .iter()
            .map(|c| c.slots as usize * (1 + self.streams.len()))
            .sum()
    }

    /// The fence of `slot` of `cache` that its fills record (`reader: None`) or that its
    /// readers on stream `reader` record. A fill waits for the slot's previous fill and
    /// every reader fence of the slot, and a hit waits for the fill fence, so a device
    /// never overwrites a slot a task still reads or another copy still fills, nor reads
    /// one still being filled.
    pub fn slot_fence(&self, cache: u32, slot: u32, reader: Option<StreamId>) -> EventId {
        let base = self.caches.get(cache as usize).map_or(0, |c| c.fence_base);
        let per_slot = 1 + self.streams.len() as u32;
        EventId(base + slot * per_slot + reader.map_or(0, |s| 1 + s.0))
    }

    /// The first step of a kind.
    pub fn step_of(&self, kind: StepKind) -> Option<&StepPlan> {
        self.steps.iter().find(|s| s.kind == kind)
    }

    /// Number of instructions of one kind over all steps and streams.
    pub fn count(&self, pred: impl Fn(&Instr) -> bool) -> usize {
        self.steps
            .iter()
            .flat_map(|s| s.programs.iter().flatten())
            .filter(|i| pred(i))
            .count()
    }
}

/// What lowering is told about the target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Capacity of the `gpu` arena (profile or `--gpu-mem`); `None`: unlimited.
    pub gpu_capacity: Option<u64>,
    /// Capacity of the `pinned` arena; `None`: unlimited.
    pub pinned_capacity: Option<u64>,
    /// Capacity of the `host` arena; `None`: unlimited.
    pub host_capacity: Option<u64>,
    /// Read every gate's routing back to the host, not only those a guard or `hot(..)`
    /// needs (`moec profile` counts them all).
    pub read_all_routing: bool,
}

impl LowerOptions {
    fn capacity(&self, space: Space) -> Option<u64> {
        match space {
            Space::Gpu => self.gpu_capacity,
            Space::Pinned => self.pinned_capacity,
            Space::Host => self.host_capacity,
            // No arena lives on disk; only the checkpoint, which is not placed.
            Space::Disk => None,
        }
    }
}

/// Why a program cannot be lowered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// The predecessor table does not match the program.
    #[error("dependency table has {got} entries but the program has {expected} tasks")]
    DepsLength {
        /// Tasks in the program.
        expected: usize,
        /// Entries given.
        got: usize,
    },
    /// A dependency that does not point to an earlier task.
    #[error("task {task} depends on {pred}, which is not issued before it")]
    DepOrder {
        /// The task.
        task: String,
        /// The predecessor.
        pred: String,
        /// Where the task is written.
        span: Span,
    },
    /// An arena over its capacity.
    #[error("the {space} arena needs {needed} bytes but has {capacity}: {largest}")]
    ArenaOverflow {
        /// The space.
        space: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        capacity: u64,
        /// The largest buffers, for the message.
        largest: String,
        /// The declaration of the largest buffer.
        span: Span,
    },
}

impl LowerError {
    /// The schedule span the error points at, if any.
    pub fn span(&self) -> Option<Span> {
        match self {
            LowerError::DepOrder { span, .. } | LowerError::ArenaOverflow { span, .. } => {
                Some(*span)
            }
            LowerError::DepsLength { .. } => None,
        }
    }
}

/// Lowers a checked program (the checker's [`ScheduleInfo`] is required: an unchecked
/// program cannot be lowered).
pub fn lower(
    program: &Program,
    info: &ScheduleInfo,
    options: &LowerOptions,
) -> Result<ExecPlan, LowerError> {
    let preds: Vec<Vec<TaskId>> = (0..program.tasks.len())
        .map(|t| {
            info.dag
                .preds(TaskId::new(t))
                .iter()
                .map(|d| d.from)
                .collect()
        })
        .collect();
    lower_with_preds(program, &preds, &info.kv_sources, &info.live_rows, options)
}

/// Lowers a program given each task's predecessors (indexed by task; every predecessor
/// earlier in issue order), whose cache each KV-part copy moves and which activation rows
/// each trimmed copy moves. [`lower`] is the entry point for checked programs.
pub(crate) fn lower_with_preds(
    program: &Program,
    preds: &[Vec<TaskId>],
    kv_sources: &[Option<crate::check::values::KvSource>],
    live_rows: &[Option<crate::ir::LiveRows>],
    options: &LowerOptions,
) -> Result<ExecPlan, LowerError> {
    if preds.len() != program.tasks.len() {
        return Err(LowerError::DepsLength {
            expected: program.tasks.len(),
            got: preds.len(),
        });
    }
    let (buffers, arenas) = place_buffers(program, options)?;
    let tasks = plan_tasks(program, kv_sources, live_rows);
    let mut readback = program.readback_gates();
    if options.read_all_routing {
        for (read, task) in readback.iter_mut().zip(&program.tasks) {
            *read |= matches!(task.op, Op::Gate { .. });
        }
    }
    let mut steps = Vec::with_capacity(program.steps.len());
    for step in &program.steps {
        steps.push(lower_step(program, step, preds, &readback)?);
    }
    let streams = program
        .streams
        .iter()
        .map(|s| PlanStream {
            name: s.name.clone(),
            engine: s.engine,
        })
        .collect();
    Ok(ExecPlan {
        name: program.name.clone(),
        model: program.model.clone(),
        checkpoint: program.checkpoint(),
        micro_batches: program.micro_batches,
        workload: program.workload,
        streams,
        tasks,
        buffers,
        arenas,
        preds: preds.to_vec(),
        caches: plan_caches(program, &steps),
        format_copies: program
            .buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| match (b.kind, b.layout) {
                (BufferKind::FormatCopy { format }, ir::Layout::Experts { slots }) => {
                    Some(PlanFormatCopy {
                        buffer: BufferId(i as u32),
                        format,
                        expert_bytes: b.bytes / u64::from(slots.max(1)),
                    })
                }
                _ => None,
            })
            .collect(),
        steps,
    })
}

/// The caches with their fence ids, numbered after the events of the busiest step.
fn plan_caches(program: &Program, steps: &[StepPlan]) -> Vec<PlanCache> {
    let mut next = steps.iter().map(|s| s.events.len()).max().unwrap_or(0) as u32;
    let per_slot = 1 + program.streams.len() as u32;
    program
        .caches
        .iter()
        .map(|c| {
            let fence_base = next;
            next = next.saturating_add(c.slots.saturating_mul(per_slot));
            PlanCache {
                name: c.name.clone(),
                buffer: c.buffer,
                slots: c.slots,
                slot_bytes: program.checkpoint().expert_bytes,
                policy: c.policy,
                score: c.score.clone(),
                predictor: c.predictor,
                fence_base,
            }
        })
        .collect()
}

fn place_buffers(
    program: &Program,
    options: &LowerOptions,
) -> Result<(Vec<BufferSlot>, Vec<ArenaPlan>), LowerError> {
    let mut next = [0u64; 3];
    let space_idx = |s: Space| Space::ALL.iter().position(|x| *x == s).unwrap_or(0);
    let mut slots = Vec::with_capacity(program.buffers.len());
    for buffer in &program.buffers {
        let placement = match buffer.kind {
            BufferKind::Checkpoint => Placement::Checkpoint,
            // Made by the runtime at load into its host arena slot.
            BufferKind::Declared | BufferKind::FormatCopy { .. } => {
                let i = space_idx(buffer.space);
                let offset = next[i].div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
                next[i] = offset + buffer.bytes;
                Placement::Arena {
                    space: buffer.space,
                    offset,
                }
            }
        };
        slots.push(BufferSlot {
            name: buffer.name.clone(),
            placement,
            bytes: buffer.bytes,
        });
    }
    let mut arenas = Vec::new();
    for space in Space::ALL {
        let bytes = next[space_idx(space)].div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
        let capacity = options.capacity(space);
        if let Some(capacity) = capacity.filter(|&c| bytes > c) {
            return Err(overflow(program, space, bytes, capacity));
        }
        arenas.push(ArenaPlan {
            space,
            bytes,
            capacity,
        });
    }
    Ok((slots, arenas))
}

fn overflow(program: &Program, space: Space, needed: u64, capacity: u64) -> LowerError {
    let mut in_space: Vec<(usize, &ir::Buffer)> = program
        .buffers
        .iter()
        .enumerate()
        .filter(|(_, b)| b.kind == BufferKind::Declared && b.space == space)
        .collect();
    in_space.sort_by_key(|b| std::cmp::Reverse(b.1.bytes));
    let largest = in_space
        .iter()
        .take(4)
        .map(|(_, b)| format!("{} = {} B", b.name, b.bytes))
        .collect::<Vec<_>>()
        .join(", ");
    let span = in_space
        .first()
        .and_then(|(i, _)| program.spans.buffers.get(*i).copied())
        .unwrap_or_default();
    LowerError::ArenaOverflow {
        space: space.as_str(),
        needed,
        capacity,
        largest,
        span,
    }
}

fn plan_tasks(
    program: &Program,
    kv_sources: &[Option<crate::check::values::KvSource>],
    live_rows: &[Option<crate::ir::LiveRows>],
) -> Vec<PlanTask> {
    let bound = crate::ir::cache::bindings(program);
    let mut readers = vec![0u32; program.tasks.len()];
    for (i, b) in bound.iter().enumerate() {
        for (arg, fetch) in program.tasks[i].args.iter().zip(b) {
            if let Some(f) = fetch.filter(|f| f.index() != i && arg.access.reads()) {
                readers[f.index()] += 1;
            }
        }
    }
    program
        .tasks
        .iter()
        .enumerate()
        .map(|(i, task)| {
            let id = TaskId::new(i);
            let cache = task.cache_op.and_then(|op| {
                let key = task.args.iter().find_map(|a| a.slice.cache_key)?;
                Some(PlanCacheCopy {
                    op,
                    key,
                    readers: readers[i],
                })
            });
            PlanTask {
                id,
                name: program.task_name(id),
                op: task.op,
                engine: program.stream(task.stream).engine,
                stream: task.stream,
                step: task.step,
                args: task
                    .args
                    .iter()
                    .zip(&bound[i])
                    .map(|(a, fetch)| PlanArg {
                        role: a.role,
                        access: a.access,
                        buffer: a.slice.buffer,
                        start: a.slice.start,
                        len: a.slice.len,
                        dynamic_expert: a.slice.dynamic_expert,
                        cache_fetch: *fetch,
                    })
                    .collect(),
                guard: task.guard.clone(),
                cache,
                kv: task
                    .kv
                    .zip(kv_sources.get(i).copied().flatten())
                    .map(|(part, source)| PlanKvCopy {
                        part,
                        layer: source.layer,
                        ub: source.ub,
                    }),
                live: live_rows.get(i).copied().flatten(),
                shape: task.shape,
                span: program.task_span(id),
            }
        })
        .collect()
}

/// A vector clock: per stream, how many of its tasks (of this step) are known finished.
type Clock = Vec<u32>;

fn lower_step(
    program: &Program,
    step: &ir::Step,
    preds: &[Vec<TaskId>],
    readback: &[bool],
) -> Result<StepPlan, LowerError> {
    let n_streams = program.streams.len();
    let first = step.first as usize;
    let count = step.count as usize;
    // Position of each task of the step on its stream (1-based: "n tasks finished").
    let mut position = vec![0u32; count];
    let mut stream_len = vec![0u32; n_streams];
    for (k, task) in program.tasks[first..first + count].iter().enumerate() {
        let s = task.stream.index();
        stream_len[s] += 1;
        position[k] = stream_len[s];
    }
    let mut clock_after: Vec<Clock> = Vec::with_capacity(count);
    let mut stream_clock: Vec<Clock> = vec![vec![0; n_streams]; n_streams];
    let mut waits: Vec<Vec<usize>> = vec![Vec::new(); count];
    let mut recorded = vec![false; count];
    for k in 0..count {
        let id = TaskId::new(first + k);
        let task = program.task(id);
        let s = task.stream.index();
        let mut clock = stream_clock[s].clone();
        let mut cross: Vec<usize> = Vec::new();
        for &pred in &preds[first + k] {
            if pred >= id {
                return Err(LowerError::DepOrder {
                    task: program.task_name(id),
                    pred: program.task_name(pred),
                    span: program.task_span(id),
                });
            }
            // Earlier steps finished at the step barrier.
            if pred.index() < first {
                continue;
            }
            let pk = pred.index() - first;
            if program.task(pred).stream.index() != s {
                cross.push(pk);
            }
        }
        // Latest predecessors first: their clocks subsume the earlier ones most often.
        cross.sort_by(|a, b| b.cmp(a));
        for pk in cross {
            let ps = program.tasks[first + pk].stream.index();
            if clock[ps] >= position[pk] {
                continue;
            }
            for (c, p) in clock.iter_mut().zip(&clock_after[pk]) {
                *c = (*c).max(*p);
            }
            waits[k].push(pk);
            recorded[pk] = true;
        }
        clock[s] = position[k];
        stream_clock[s] = clock.clone();
        clock_after.push(clock);
    }
    let mut event_of = vec![None; count];
    let mut events = Vec::new();
    for (k, rec) in recorded.iter().enumerate() {
        if *rec {
            event_of[k] = Some(EventId(events.len() as u32));
            events.push(TaskId::new(first + k));
        }
    }
    let mut programs: Vec<Vec<Instr>> = vec![Vec::new(); n_streams];
    for k in 0..count {
        let id = TaskId::new(first + k);
        let s = program.task(id).stream.index();
        for &pk in &waits[k] {
            if let Some(e) = event_of[pk] {
                programs[s].push(Instr::Wait(e));
            }
        }
        programs[s].push(Instr::Run(id));
        if readback.get(id.index()).copied().unwrap_or(false) {
            programs[s].push(Instr::ReadRouting(id));
        }
        if let Some(e) = event_of[k] {
            programs[s].push(Instr::Record(e));
        }
    }
    Ok(StepPlan {
        kind: step.kind,
        first: step.first,
        count: step.count,
        routed_ceiling: step.routed_ceiling,
        programs,
        events,
    })
}

/// Renders a plan as text for snapshots and `moec debug`: arenas, buffers, then each
/// step's per-stream programs.
pub fn render(plan: &ExecPlan) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "plan {}", plan.name);
    for arena in &plan.arenas {
        let cap = arena
            .capacity
            .map(|c| format!(" / {c}"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "arena {:<6} {} B{}",
            arena.space.as_str(),
            arena.bytes,
            cap
        );
    }
    for (i, b) in plan.buffers.iter().enumerate() {
        let place = match b.placement {
            Placement::Checkpoint => "checkpoint".to_string(),
            Placement::Arena { space, offset } => format!("{}+{}", space.as_str(), offset),
        };
        let _ = writeln!(
            out,
            "buffer b{i} {:<12} {:>10} B at {place}",
            b.name, b.bytes
        );
    }
    for step in &plan.steps {
        let _ = writeln!(
            out,
            "step {} ({} events)",
            step.kind.as_str(),
            step.events.len()
        );
        for (s, prog) in step.programs.iter().enumerate() {
            let stream = &plan.streams[s];
            let _ = write!(out, "  {} [{}]:", stream.name, stream.engine.as_str());
            for instr in prog {
                let _ = match instr {
                    Instr::Run(t) => write!(out, " run {}", plan.tasks[t.index()].name),
                    Instr::Record(e) => write!(out, " ; record e{}", e.0),
                    Instr::Wait(e) => write!(out, " ; wait e{} ;", e.0),
                    Instr::ReadRouting(t) => {
                        write!(out, " ; read routing of {}", plan.tasks[t.index()].name)
                    }
                };
            }
            let _ = writeln!(out);
        }
    }
    out
}
