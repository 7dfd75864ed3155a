//! The IR: an elaborated schedule as plain data.
//!
//! Takes nothing (built by `elaborate`); gives [`Program`]: params with their bound values,
//! streams bound to engines, buffers with byte sizes in memory spaces, and tasks in issue
//! order, each with its op, stream, argument slices (role, byte range, access), explicit
//! `after` orderings, a dynamic guard, and its work for the cost model. Spans live in a
//! side table ([`SpanTable`]) as in naga, so the IR itself is position-free.
//!
//! This file holds the program and its tasks; buffers (their kinds, layouts, format copies
//! and the checkpoint's layout) live in `buffer`, guards in `guard`, expert caches in
//! [`cache`], all re-exported here.
//!
//! Invariants kept by elaboration (and relied on by `deps` and `check`):
//! - `tasks` is in issue order and every `after` names an earlier task;
//! - every slice lies inside its buffer (`start + len <= bytes`); a slice with a dynamic
//!   expert reads the read-only checkpoint only;
//! - `BufferId(0)` is the checkpoint `W` (host, read-only), laid out as [`CheckpointLayout`];
//! - `steps` partition `tasks` into contiguous ranges in declaration order.

mod buffer;
pub mod cache;
pub mod catalog;
pub mod deps;
pub mod emit;
pub mod expert;
mod guard;

mod ids;
mod kinds;
pub mod profile;
pub mod readback;
pub mod scratch;
pub mod value;
pub mod writers;

pub use buffer::{Buffer, BufferKind, CheckpointLayout, Layout, Substitute};
pub use catalog::{AttnPart, ExpertRef, ExpertSet, Op, Shape, Work};
pub use guard::{Guard, GuardAtom, GuardLit, ScoreKind};
pub use ids::{BufferId, ParamId, StepId, StreamId, TaskId};
pub use kinds::{ParamType, StepKind};

/// A hash map keyed by the compiler's own data (names, labels, ids, layers): foldhash's
/// fast hasher with a fixed seed. The keys come from the schedule, so the standard
/// SipHash's DoS resistance buys nothing, and hashing was a tenth of a real-size plan's
/// time (docs/cost-model.md "Where the DeepSeek-V3 plan's time goes").
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// A hash set with [`FastMap`]'s hasher.
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::FixedState>;

use crate::model::card::ModelCard;
use crate::span::Span;
use serde::{Deserialize, Serialize};

/// An elaborated schedule: everything bound, unrolled and resolved.
#[derive(Debug, Clone, Serialize)]
pub struct Program {
    /// `schedule NAME`.
    pub name: String,
    /// The header's description string (empty if none).
    pub description: String,
    /// The model card the schedule was elaborated for.
    pub model: ModelCard,
    /// The workload the sizes and work assume.
    pub workload: Workload,
    /// How the batch is split (`microbatches COUNT of SIZE`).
    pub micro_batches: MicroBatches,
    /// Declared params with their bound values, in declaration order.
    pub params: Vec<Param>,
    /// Per param (in `params`' order): whether elaborating read its value. A param never
    /// read could have had any other value with the same tasks, buffers and everything
    /// else but `params` itself (the elaborator is deterministic and a value is seen only
    /// through a lookup), which `cost::plan::SamePrograms` relies on.
    #[serde(skip)]
    pub params_read: Vec<bool>,
    /// Streams, indexed by [`StreamId`].
    pub streams: Vec<Stream>,
    /// Buffers (array elements flattened), indexed by [`BufferId`]; 0 is the checkpoint.
    pub buffers: Vec<Buffer>,
    /// Tasks in issue order, indexed by [`TaskId`].
    pub tasks: Vec<Task>,
    /// Step templates in declaration order, indexed by [`StepId`].
    pub steps: Vec<Step>,
    /// `expert_shares[layer][expert]`: the probability a token routes to that expert, from
    /// the routing profile the program was compiled with (`None`: uniform routing, top_k /
    /// experts). The cost model charges guarded tasks by it.
    pub expert_shares: Option<Vec<Vec<f64>>>,
    /// Expert caches (`cache` declarations), indexed by [`cache::CacheKey::cache`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<cache::Cache>,
    /// Declared lossy substitutes (`substitute experts q4_k`), in declaration order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub substitutes: Vec<Substitute>,
    /// The scratch rules of the backend the program was compiled for
    /// (`elaborate::Options::scratch`): the budget counts each device stream's workspace
    /// by them; `None`, the op catalog's workspace, and the budget line says so.
    #[serde(skip)]
    pub scratch: Option<&'static dyn scratch::DeviceScratch>,
    /// Source spans of everything above.
    #[serde(skip)]
    pub spans: SpanTable,
    /// `CheckpointLayout::new(&model)`, computed once by the elaborator: the cost model
    /// asks for it per task ([`Program::checkpoint`]).
    #[serde(skip)]
    pub(crate) layout: CheckpointLayout,
    /// [`writers::Writers`] of the tasks, built on first use ([`Program::writers`]). The
    /// tasks' arguments never change after elaboration, so it stays true.
    #[serde(skip)]
    pub(crate) writers: std::sync::OnceLock<writers::Writers>,
}

/// The workload symbols (`batch`, `prompt_len`, `gen_len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// Sequences in the batch.
    pub batch: u64,
    /// Prompt tokens per sequence (worst case).
    pub prompt_len: u64,
    /// Generated tokens per sequence.
    pub gen_len: u64,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            batch: 64,
            prompt_len: 128,
            gen_len: 32,
        }
    }
}

/// `microbatches COUNT of SIZE`: the batch as COUNT micro-batches of SIZE sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MicroBatches {
    /// Number of micro-batches (`ub` arguments are `0..count`).
    pub count: u32,
    /// Sequences per micro-batch (the worst case the sizes assume).
    pub size: u64,
    /// New tokens of one micro-batch in a mixed step (worst case; `tokens T`, default
    /// `size`: one token per sequence).
    pub mixed_tokens: u64,
}

impl std::fmt::Display for MicroBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.count {
            0 => write!(f, "none"),
            _ if self.mixed_tokens != self.size => {
                write!(
                    f,
                    "{} of {} tokens {}",
                    self.count, self.size, self.mixed_tokens
                )
            }
            _ => write!(f, "{} of {}", self.count, self.size),
        }
    }
}

/// A scalar value of a param.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Scalar {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
}

impl std::fmt::Display for Scalar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scalar::Int(v) => write!(f, "{v}"),
            Scalar::Float(v) => write!(f, "{v:?}"),
            Scalar::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// The allowed values of a param: `lo..hi` or `lo..=hi`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ParamRange {
    /// Smallest allowed value.
    pub lo: Scalar,
    /// Upper bound.
    pub hi: Scalar,
    /// Whether `hi` itself is allowed.
    pub inclusive: bool,
}

/// A declared param with its bound value (the planner searches `range`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Param {
    /// The name (`--set NAME=...`).
    pub name: String,
    /// Declared type.
    #[serde(serialize_with = "ser_param_type")]
    pub ty: ParamType,
    /// The value used for this elaboration (default or `--set`).
    pub value: Scalar,
    /// The declared default.
    pub default: Scalar,
    /// The declared range, if any.
    pub range: Option<ParamRange>,
    /// The trailing `//` comment of the declaration.
    pub doc: Option<String>,
}

fn ser_param_type<S: serde::Serializer>(ty: &ParamType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(ty.as_str())
}

/// What executes a stream's tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Engine {
    /// GPU kernels (`gpu.compute`).
    GpuCompute,
    /// Host -> device copies (`gpu.copy_in`).
    GpuCopyIn,
    /// Device -> host copies (`gpu.copy_out`).
    GpuCopyOut,
    /// The CPU thread pool (`cpu.compute`).
    CpuCompute,
    /// Host memcpy between pageable and pinned memory (`cpu.copy`).
    CpuCopy,
    /// Reads from the checkpoint on disk into host memory (`disk.read`): direct I/O with
    /// several reads in flight.
    DiskRead,
}

impl Engine {
    /// Every engine, in a fixed order.
    pub const ALL: [Engine; 6] = [
        Engine::GpuCompute,
        Engine::GpuCopyIn,
        Engine::GpuCopyOut,
        Engine::CpuCompute,
        Engine::CpuCopy,
        Engine::DiskRead,
    ];

    /// The engine as written in a `stream` declaration.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::GpuCompute => "gpu.compute",
            Engine::GpuCopyIn => "gpu.copy_in",
            Engine::GpuCopyOut => "gpu.copy_out",
            Engine::CpuCompute => "cpu.compute",
            Engine::CpuCopy => "cpu.copy",
            Engine::DiskRead => "disk.read",
        }
    }

    /// Parses `gpu.compute` etc.
    pub fn parse(text: &str) -> Option<Engine> {
        Engine::ALL.into_iter().find(|e| e.as_str() == text)
    }

    /// Whether the engine runs compute ops (as opposed to copies only).
    pub fn is_compute(self) -> bool {
        matches!(self, Engine::GpuCompute | Engine::CpuCompute)
    }
}

/// A memory space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Space {
    /// Device memory.
    Gpu,
    /// Page-locked host memory (fast DMA).
    Pinned,
    /// Pageable host memory; the checkpoint lives here, memory-mapped, unless the schedule
    /// reads it from disk.
    Host,
    /// The disk: only the checkpoint `W` lives here, in a schedule that declares a
    /// `disk.read` stream; it is read into `host`/`pinned` buffers on that stream (or, by a
    /// compute op reading `W` in place, through the file's memory map). No buffer is
    /// declared on it and it has no arena.
    Disk,
}

impl Space {
    /// Every space that holds buffers (one arena each), in a fixed order; [`Space::Disk`]
    /// holds only the checkpoint and is not among them.
    pub const ALL: [Space; 3] = [Space::Gpu, Space::Pinned, Space::Host];

    /// The space as written.
    pub fn as_str(self) -> &'static str {
        match self {
            Space::Gpu => "gpu",
            Space::Pinned => "pinned",
            Space::Host => "host",
            Space::Disk => "disk",
        }
    }

    /// Parses `gpu`, `pinned`, `host`, `disk`.
    pub fn parse(text: &str) -> Option<Space> {
        Space::ALL
            .into_iter()
            .chain([Space::Disk])
            .find(|s| s.as_str() == text)
    }
}

/// A stream: an in-order queue on one engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stream {
    /// Its name in the schedule.
    pub name: String,
    /// The engine it is bound to.
    pub engine: Engine,
}

/// A byte range of one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// The buffer.
    pub buffer: BufferId,
    /// First byte.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// Set for `W[i].expert(hot(i, k))`: the expert is only known at run time. `start` is
    /// then the offset of expert 0 of that layer and `len` one expert; the runtime adds
    /// `resolved_expert * len`. Dependency analysis treats the whole experts region as read.
    pub dynamic_expert: Option<ExpertRef>,
    /// Set for `CACHE.slot(layer, expert)`: the slot holding that expert, chosen at run
    /// time. `start` is slot 0 and `len` one slot; the runtime adds `slot * len`.
    /// Dependency analysis orders it only after the fetch of the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_key: Option<cache::CacheKey>,
}

impl Slice {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Whether a task reads or writes an argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Access {
    /// Read only.
    Read,
    /// Overwritten without being read.
    Write,
    /// Read and updated in place.
    ReadWrite,
}

impl Access {
    /// True for `Read` and `ReadWrite`.
    pub fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }

    /// True for `Write` and `ReadWrite`.
    pub fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }

    /// `r`, `w` or `rw`.
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "r",
            Access::Write => "w",
            Access::ReadWrite => "rw",
        }
    }
}

/// The role of an argument: the name it is passed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Role {
    /// Weights (`w`).
    W,
    /// The residual stream of a micro-batch (`h`).
    H,
    /// Q, K and V of a micro-batch (`qkv`).
    Qkv,
    /// A KV cache (`kv`).
    Kv,
    /// An op's main output (`out`): attention output, QKV of `pre_attn`.
    Out,
    /// Routing decisions (`route`).
    Route,
    /// Expert output accumulator (`acc`).
    Acc,
    /// Logits (`logits`).
    Logits,
    /// Sampled tokens (`tokens`).
    Tokens,
    /// Attention output read by `post_attn`/`o_proj` (`a`).
    A,
    /// Copy source (`src`).
    Src,
    /// Copy destination (`dst`).
    Dst,
}

impl Role {
    /// The argument name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::W => "w",
            Role::H => "h",
            Role::Qkv => "qkv",
            Role::Kv => "kv",
            Role::Out => "out",
            Role::Route => "route",
            Role::Acc => "acc",
            Role::Logits => "logits",
            Role::Tokens => "tokens",
            Role::A => "a",
            Role::Src => "src",
            Role::Dst => "dst",
        }
    }
}

/// One argument of a task.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Arg {
    /// The role it is passed as.
    pub role: Role,
    /// The bytes it touches.
    pub slice: Slice,
    /// Read, write or both.
    pub access: Access,
}

/// Which positions of a KV cache a `copy` moves (`SLICE.context()`, `SLICE.appended()`):
/// the bytes follow each sequence's context at run time, so a decode step moves the cache
/// it attends over, or only the lines it appended, not the line declared for the longest
/// context (FlexGen's `load_cache` of `k_home[:src_s]` and `store_cache` of `k_new`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvPart {
    /// Every position cached before this step's new tokens (what attention reads back).
    Context,
    /// Only this step's new tokens' positions (what attention appended).
    Appended,
}

impl KvPart {
    /// The method that names it: `context` or `appended`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvPart::Context => "context",
            KvPart::Appended => "appended",
        }
    }
}

/// What one row of an activation is: a new token's (hidden, QKV, attention output,
/// routing, expert sums) or a sequence's (logits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RowUnit {
    /// One row per new token of the micro-batch.
    Token,
    /// One row per sequence of the micro-batch.
    Sequence,
}

/// The rows of a micro-batch's activation a copy moves: every backend's kernels lay an
/// activation of `n` rows out packed by `n` (`expert_acc`'s normalised rows, then its
/// `(token, k)` slots, then its shared rows all start at multiples of `n`), so the bytes a
/// step's rows occupy are the first `rows x row_bytes` of the tensor, one run. Set on a
/// copy whose source value tracking proved holds one such tensor of the step that runs it,
/// from its first byte (`check::live`): a decode step then moves its tokens' rows, not the
/// buffer's prefill-sized worst case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LiveRows {
    /// The micro-batch whose tensor the source holds.
    pub ub: u32,
    /// Token rows or sequence rows.
    pub unit: RowUnit,
    /// Bytes of one row.
    pub row_bytes: u64,
}

impl LiveRows {
    /// Bytes of the rows of a micro-batch holding `tokens` new tokens of `seqs` sequences.
    pub fn bytes(&self, tokens: u64, seqs: u64) -> u64 {
        let rows = match self.unit {
            RowUnit::Token => tokens,
            RowUnit::Sequence => seqs,
        };
        rows.saturating_mul(self.row_bytes)
    }
}

/// One task: an op applied to buffer slices on a stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Task {
    /// The op and its static parameters.
    pub op: Op,
    /// The stream it is issued on.
    pub stream: StreamId,
    /// The step template it belongs to.
    pub step: StepId,
    /// Its arguments, in the catalog's role order.
    pub args: Vec<Arg>,
    /// Explicit orderings: tasks that must finish first (all earlier in issue order).
    pub after: Vec<TaskId>,
    /// Runs only when this dynamic condition holds.
    pub guard: Guard,
    /// Tokens, sequences and context the work assumes.
    pub shape: Shape,
    /// Flops and bytes for the cost model (see [`catalog::work`]).
    pub work: Work,
    /// `as NAME[i, j]` rendered with its indices, if labelled.
    pub label: Option<String>,
    /// Set on a copy into an expert cache slot: `fetch` or `prefetch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_op: Option<cache::CacheOp>,
    /// Set on a copy of part of a KV cache (`.context()` / `.appended()`): the runtime
    /// copies those positions of the micro-batch whose cache the source holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvPart>,
    /// Set on a copy of an activation by `compile::ir_to_checked` from what the checker
    /// proved its source holds ([`crate::check::ScheduleInfo::live_rows`]): the runtime
    /// copies the rows of the step's tokens only, and `work.copy.bytes` is those rows at
    /// the declared shape.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveRows>,
    /// Set on the tasks `experts(.., ub = all, ..)` unrolls into: the first task of the
    /// group. The group is one expert computation over every micro-batch's tokens, so its
    /// weights are read once (charged to the first task); each micro-batch's part is a
    /// task of its own for the checker and the runtime.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<TaskId>,
}

/// A step template after unrolling.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    /// Prefill, decode or mixed.
    #[serde(serialize_with = "ser_step_kind")]
    pub kind: StepKind,
    /// Its tasks: `tasks[first..first + count]`.
    pub first: u32,
    /// Number of tasks.
    pub count: u32,
    /// The most tokens one micro-batch of this step may hold at run time, when the
    /// elaborator decided a `routed(..) >= t` comparison from it (t above it can never
    /// hold, so that arm was not built): the runtime then never gives a micro-batch more
    /// (`runtime::driver`'s capacities). `None`: nothing relies on a bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_ceiling: Option<u64>,
}

fn ser_step_kind<S: serde::Serializer>(kind: &StepKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(kind.as_str())
}

impl Step {
    /// Ids of the step's tasks.
    pub fn task_ids(&self) -> impl Iterator<Item = TaskId> {
        (self.first..self.first + self.count).map(TaskId)
    }
}

/// Source spans beside the IR, indexed like its tables.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpanTable {
    /// The task statement (`pre_attn(...) on gpu`).
    pub tasks: Vec<Span>,
    /// Each task's argument expressions, parallel to `Task::args`.
    pub task_args: Vec<Vec<Span>>,
    /// Each task's `on STREAM`.
    pub task_streams: Vec<Span>,
    /// Each task's `after` items, parallel to `Task::after`.
    pub task_after: Vec<Vec<Span>>,
    /// The buffer declarations (shared by the elements of an array).
    pub buffers: Vec<Span>,
    /// The stream declarations.
    pub streams: Vec<Span>,
    /// The param declarations.
    pub params: Vec<Span>,
}

impl Program {
    /// Per task, whether it is a gate whose routing the host reads back
    /// ([`readback::readback_gates`]).
    pub fn readback_gates(&self) -> Vec<bool> {
        readback::readback_gates(self)
    }

    /// The checkpoint layout for this program's model.
    pub fn checkpoint(&self) -> CheckpointLayout {
        self.layout
    }

    /// Which tasks write each cache key and buffer ([`writers::Writers`]), indexed once.
    pub fn writers(&self) -> &writers::Writers {
        self.writers.get_or_init(|| writers::Writers::of(self))
    }

    /// The task with this id.
    pub fn task(&self, id: TaskId) -> &Task {
        &self.tasks[id.index()]
    }

    /// The buffer with this id.
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.index()]
    }

    /// The stream with this id.
    pub fn stream(&self, id: StreamId) -> &Stream {
        &self.streams[id.index()]
    }

    /// The engine a task runs on.
    pub fn engine_of(&self, id: TaskId) -> Engine {
        self.stream(self.task(id).stream).engine
    }

    /// The source span of a task.
    pub fn task_span(&self, id: TaskId) -> Span {
        self.spans
            .tasks
            .get(id.index())
            .copied()
            .unwrap_or_default()
    }

    /// A short human name for a task: its label, or `#N op`.
    pub fn task_name(&self, id: TaskId) -> String {
        let task = self.task(id);
        let key = task.args.iter().find_map(|a| a.slice.cache_key);
        match (&task.label, task.cache_op, key) {
            (Some(label), _, _) => format!("#{} {}", id.0, label),
            (None, Some(op), Some(k)) => {
                let cache = self
                    .caches
                    .get(k.cache as usize)
                    .map_or("?", |c| c.name.as_str());
                format!(
                    "#{} {} {cache}.slot({}, {})",
                    id.0,
                    op.as_str(),
                    k.layer,
                    k.expert
                )
            }
            _ => format!("#{} {}", id.0, task.op.describe()),
        }
    }

    /// A param's bound value by name.
    pub fn param(&self, name: &str) -> Option<Scalar> {
        self.params.iter().find(|p| p.name == name).map(|p| p.value)
    }

    /// Total bytes of declared buffers and format copies per space (the checkpoint
    /// excluded).
    pub fn bytes_per_space(&self) -> Vec<(Space, u64)> {
        Space::ALL
            .into_iter()
            .map(|space| {
                let bytes = self
                    .buffers
                    .iter()
                    .filter(|b| b.kind != BufferKind::Checkpoint && b.space == space)
                    .fold(0u64, |sum, b| sum.saturating_add(b.bytes));
                (space, bytes)
            })
            .collect()
    }
}
