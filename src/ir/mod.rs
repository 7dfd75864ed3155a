//! The IR: an elaborated schedule as plain data.
//!
//! Takes nothing (built by `elaborate`); gives [`Program`]: params with their bound values,
//! streams bound to engines, buffers with byte sizes in memory spaces, and tasks in issue
//! order, each with its op, stream, argument slices (role, byte range, access), explicit
//! `after` orderings, a dynamic guard, and its work for the cost model. Spans live in a
//! side table ([`SpanTable`]) as in naga, so the IR itself is position-free.
//!
//! Invariants kept by elaboration (and relied on by `deps` and `check`):
//! - `tasks` is in issue order and every `after` names an earlier task;
//! - every slice lies inside its buffer (`start + len <= bytes`); a slice with a dynamic
//!   expert reads the read-only checkpoint only;
//! - `BufferId(0)` is the checkpoint `W` (host, read-only), laid out as [`CheckpointLayout`];
//! - `steps` partition `tasks` into contiguous ranges in declaration order.

pub mod cache;
pub mod catalog;
pub mod deps;
pub mod emit;
pub mod expert;

mod ids;
mod kinds;
pub mod profile;
pub mod readback;
pub mod value;

pub use catalog::{AttnPart, ExpertRef, ExpertSet, Op, Shape, Work};
pub use ids::{BufferId, ParamId, StepId, StreamId, TaskId};
pub use kinds::{ParamType, StepKind};

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
    /// Source spans of everything above.
    #[serde(skip)]
    pub spans: SpanTable,
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

/// How a buffer's bytes are organised, from the size helper that declared it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// Unstructured bytes (activations, pages, sums of helpers).
    Raw,
    /// One decoder layer: `[attn | router | expert 0 | ... | expert E-1]`.
    Layer,
    /// A layer's dense part: `[attn | router]`.
    Dense,
    /// `slots` expert-sized slots.
    Experts {
        /// Number of slots.
        slots: u32,
    },
    /// The whole checkpoint, see [`CheckpointLayout`].
    Checkpoint,
}

/// Whether a buffer is the built-in checkpoint, a copy of its experts in another format,
/// or declared by the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BufferKind {
    /// `W`: the memory-mapped checkpoint (host, read-only).
    Checkpoint,
    /// `W.q4_k`: every MoE layer's experts in `format`, made from the checkpoint at load
    /// (host, read-only): slot `(l - dense_layers) * experts + e` holds
    /// `W[l].expert(e).format(..)`, [`Buffer::bytes`] / slots bytes each. Created by the
    /// first `.format(..)` that names the format.
    FormatCopy {
        /// The format its experts are stored in.
        format: crate::model::Storage,
    },
    /// A `buffer` declaration.
    Declared,
}

impl BufferKind {
    /// True for the read-only weight buffers the runtime provides (`W` and its format
    /// copies): no task writes them, and reading them orders nothing.
    pub fn is_weights(self) -> bool {
        matches!(self, BufferKind::Checkpoint | BufferKind::FormatCopy { .. })
    }
}

/// `substitute CLASS FORMAT`: tasks may compute with the weights of `class` in `format`
/// (a lossy copy) where the checkpoint's are expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Substitute {
    /// The weight class (only `experts` is accepted).
    pub class: crate::model::formats::WeightClass,
    /// The format of the copy.
    pub format: crate::model::Storage,
    /// The declaration.
    #[serde(skip)]
    pub span: crate::span::Span,
}

/// One buffer (an element of a declared array).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Buffer {
    /// Element name as shown to users: `w_gpu[1]`, `kv[3][0]`, `W`.
    pub name: String,
    /// The declared array's name (`w_gpu`).
    pub array: String,
    /// Indices of this element in its array (empty for a single buffer).
    pub index: Vec<u32>,
    /// Its memory space.
    pub space: Space,
    /// Its size in bytes.
    pub bytes: u64,
    /// How its bytes are organised.
    pub layout: Layout,
    /// Built-in checkpoint or declared.
    pub kind: BufferKind,
    /// For a layer-shaped slot declared for one layer (`dense_weights(l)` in
    /// `buffer w_dense[layers as l]`): that layer, whose own geometry the slot has (a MoE
    /// layer's `gate` is not sized for a dense layer's). `None`: a slot for any layer, or
    /// not layer-shaped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
}

/// Byte layout of the checkpoint buffer `W`: `[embedding | layer 0 | ... | layer L-1 |
/// final norm + lm_head]`, every part starting on a 64-byte boundary. A layer is the
/// model's packed image ([`crate::model::layout::LayerLayout`]): `[pre | o | gate | expert 0
/// | ... | expert E-1]` where `pre` = input norm + Q/K/V (DBRX: Wqkv) with their biases and
/// norms, `o` = O projection, `gate` = post-attention norm + router + shared expert; so
/// `W[i].expert(e)` is exactly the image's `expert_range(e)` and the runtime can copy byte
/// ranges of it. A leading dense layer (`dense_layers`, DeepSeek's `first_k_dense_replace`)
/// is `[pre | o | gate]` with `gate` = post-attention norm + its dense SwiGLU and no
/// experts, so each layer's offset and size come from what the layers before it hold.
///
/// A buffer shaped like a layer (`layer_weights()`, `dense_weights()`) is a *slot* that can
/// hold any layer: the `slot_*` sizes, whose `gate` is the larger of the two kinds' and whose
/// experts sit where a MoE layer's do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointLayout {
    /// Bytes of the embedding table (padded to 64).
    pub embed_bytes: u64,
    /// Bytes of a layer's `pre` part (input norm, Q/K/V), padding included.
    pub pre_bytes: u64,
    /// Bytes of a layer's O projection, padding included.
    pub o_bytes: u64,
    /// Bytes of a MoE layer's `gate` part (post-attention norm, router, shared expert),
    /// padding included.
    pub gate_bytes: u64,
    /// Bytes of a dense layer's `gate` part (post-attention norm, dense SwiGLU), padding
    /// included; 0 for a card without dense layers.
    pub dense_gate_bytes: u64,
    /// Bytes of one expert (gate, up, down projections), padding included.
    pub expert_bytes: u64,
    /// Experts per MoE layer.
    pub experts: u64,
    /// Number of decoder layers.
    pub layers: u64,
    /// Leading dense layers (`0..dense_layers`).
    pub dense_layers: u64,
    /// Bytes of the final norm plus lm_head.
    pub head_bytes: u64,
}

const ALIGN: u64 = crate::model::layout::SEGMENT_ALIGN as u64;

fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

impl CheckpointLayout {
    /// The layout for a model card (from the model's packed layer image).
    pub fn new(card: &ModelCard) -> Self {
        // Same rule as `model::layout::LayerLayout::for_card` (segments in image order,
        // each in the bytes the card's formats give it, starting on a SEGMENT_ALIGN
        // boundary), computed without allocating the layout because the op catalog asks
        // for it per task; `matches_the_model_layer_image` pins the two.
        use crate::model::formats::WeightTensor;
        let place =
            |offset: u64, bytes: &[u64]| bytes.iter().fold(offset, |at, n| align_up(at + n));
        let arch = crate::model::arch::ArchSpec::from_card(card);
        let [pre, o, gate, expert, dense_gate] =
            crate::model::layout::LayerLayout::part_bytes(&arch, |k| {
                card.storage(WeightTensor::layer(k))
            });
        let o_start = place(0, &pre);
        let gate_start = place(o_start, &o);
        let experts_start = place(gate_start, &gate);
        let expert_bytes = place(0, &expert);
        let dense_gate_bytes = if card.dense_layers > 0 {
            place(gate_start, &dense_gate) - gate_start
        } else {
            0
        };
        let table = |t: WeightTensor| {
            card.storage(t)
                .matrix_bytes(card.vocab, card.hidden)
                .unwrap_or(0)
        };
        let norm = card
            .storage(WeightTensor::FinalNorm)
            .bytes_for(card.hidden)
            .unwrap_or(0);
        CheckpointLayout {
            embed_bytes: align_up(table(WeightTensor::Embed)),
            pre_bytes: o_start,
            o_bytes: gate_start - o_start,
            gate_bytes: experts_start - gate_start,
            dense_gate_bytes,
            expert_bytes,
            experts: card.experts,
            layers: card.layers,
            dense_layers: card.dense_layers.min(card.layers),
            head_bytes: norm + table(WeightTensor::LmHead),
        }
    }

    /// True for a leading dense layer.
    pub fn is_dense(&self, layer: u64) -> bool {
        layer < self.dense_layers
    }

    /// Bytes of layer `layer`'s `gate` part.
    pub fn gate_bytes_of(&self, layer: u64) -> u64 {
        if self.is_dense(layer) {
            self.dense_gate_bytes
        } else {
            self.gate_bytes
        }
    }

    /// Routed experts of layer `layer` (0 for a dense layer).
    pub fn experts_of(&self, layer: u64) -> u64 {
        if self.is_dense(layer) {
            0
        } else {
            self.experts
        }
    }

    /// Bytes of layer `layer`'s `[pre | o | gate]` (where its experts start).
    pub fn dense_bytes_of(&self, layer: u64) -> u64 {
        self.pre_bytes + self.o_bytes + self.gate_bytes_of(layer)
    }

    /// Bytes of the whole layer `layer`.
    pub fn layer_bytes_of(&self, layer: u64) -> u64 {
        self.dense_bytes_of(layer) + self.experts_of(layer) * self.expert_bytes
    }

    /// Bytes of one MoE layer.
    pub fn moe_layer_bytes(&self) -> u64 {
        self.pre_bytes + self.o_bytes + self.gate_bytes + self.experts * self.expert_bytes
    }

    /// Bytes of one dense layer.
    pub fn dense_layer_bytes(&self) -> u64 {
        self.pre_bytes + self.o_bytes + self.dense_gate_bytes
    }

    /// Bytes of a slot's `gate` part: room for either kind of layer's.
    pub fn slot_gate_bytes(&self) -> u64 {
        self.gate_bytes.max(self.dense_gate_bytes)
    }

    /// Bytes of a slot's `[pre | o | gate]` (`dense_weights()`).
    pub fn slot_dense_bytes(&self) -> u64 {
        self.pre_bytes + self.o_bytes + self.slot_gate_bytes()
    }

    /// Offset of the experts inside a slot: where a MoE layer's are.
    pub fn slot_experts_offset(&self) -> u64 {
        self.pre_bytes + self.o_bytes + self.gate_bytes
    }

    /// Bytes of a slot that holds any layer (`layer_weights()`).
    pub fn slot_layer_bytes(&self) -> u64 {
        self.slot_dense_bytes().max(self.moe_layer_bytes())
    }

    /// Offset of layer `layer` in the checkpoint.
    pub fn layer_offset(&self, layer: u64) -> u64 {
        let dense = layer.min(self.dense_layers);
        self.embed_bytes
            + dense * self.dense_layer_bytes()
            + (layer - dense) * self.moe_layer_bytes()
    }

    /// The layer whose bytes hold checkpoint offset `offset`, if any.
    pub fn layer_at(&self, offset: u64) -> Option<u64> {
        let rel = offset.checked_sub(self.embed_bytes)?;
        let dense_total = self.dense_layers * self.dense_layer_bytes();
        let layer = if rel < dense_total {
            rel / self.dense_layer_bytes().max(1)
        } else {
            self.dense_layers + (rel - dense_total) / self.moe_layer_bytes().max(1)
        };
        (layer < self.layers).then_some(layer)
    }

    /// Offset of the final norm + lm_head.
    pub fn head_offset(&self) -> u64 {
        self.layer_offset(self.layers)
    }

    /// Total bytes.
    pub fn total_bytes(&self) -> u64 {
        self.head_offset() + self.head_bytes
    }
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

/// A dynamic condition atom, decided by the runtime from the real routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GuardAtom {
    /// `active(layer, expert)` or `active(layer, expert, ub)`: the expert received tokens
    /// (from micro-batch `ub`, or from any micro-batch of the step).
    Active {
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or any.
        ub: Option<u32>,
    },
    /// `routed(layer, expert[, ub]) >= at_least` (every comparison of a routed token
    /// count with a constant is this atom or its negation, or a conjunction of two): the
    /// expert received at least `at_least` tokens (from micro-batch `ub`, or summed over
    /// every micro-batch of the step). Fiddler's CPU-or-copy rule branches on it.
    Tokens {
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or the sum over all of them.
        ub: Option<u32>,
        /// The threshold (at least 2: `>= 1` is `active`, `>= 0` always holds).
        at_least: u32,
    },
    /// `CACHE.resident(layer, expert)`: the expert is in a slot of cache `cache` when the
    /// guard is decided (a hit). The checker orders every fetch or prefetch into that
    /// cache before every task guarded by it or after all of them
    /// (`cache::stale_guard`), so every such task sees the same answer.
    Resident {
        /// The cache (index into `Program::caches`).
        cache: u32,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
    },
    /// `score_max(layer, expert[, ub]) >= at_least` or `score_sum(..) >= at_least`: the
    /// largest (or summed) routing weight the expert received from the tokens of
    /// micro-batch `ub` (or of every micro-batch of the step); 0 for an expert no token
    /// routed to. Thresholds are positive (`>= 0` always holds, `>= t` with `t <= 0` is
    /// folded at compile time), stored as the bits of an `f32` so the atom stays `Eq` and
    /// `Ord` (positive floats order as their bits).
    Score {
        /// Largest or summed.
        kind: ScoreKind,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or every micro-batch of the step.
        ub: Option<u32>,
        /// `f32::to_bits` of the (positive) threshold.
        at_least_bits: u32,
    },
}

/// Which statistic of an expert's routing weights a score guard reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ScoreKind {
    /// `score_max`: the largest weight a token gave the expert.
    Max,
    /// `score_sum`: the sum of the weights its tokens gave it (its share of the output).
    Sum,
}

impl ScoreKind {
    /// The function that reads it (`score_max`, `score_sum`).
    pub fn as_str(self) -> &'static str {
        match self {
            ScoreKind::Max => "score_max",
            ScoreKind::Sum => "score_sum",
        }
    }
}

impl GuardAtom {
    /// The layer whose routing (or cache slot) decides the atom.
    pub fn layer(&self) -> u32 {
        match *self {
            GuardAtom::Active { layer, .. }
            | GuardAtom::Tokens { layer, .. }
            | GuardAtom::Resident { layer, .. }
            | GuardAtom::Score { layer, .. } => layer,
        }
    }

    /// The expert it reads.
    pub fn expert(&self) -> ExpertRef {
        match *self {
            GuardAtom::Active { expert, .. }
            | GuardAtom::Tokens { expert, .. }
            | GuardAtom::Resident { expert, .. }
            | GuardAtom::Score { expert, .. } => expert,
        }
    }

    /// The micro-batch it reads, or `None` for every micro-batch of the step (a
    /// residency guard reads no micro-batch: `None`).
    pub fn ub(&self) -> Option<u32> {
        match *self {
            GuardAtom::Active { ub, .. }
            | GuardAtom::Tokens { ub, .. }
            | GuardAtom::Score { ub, .. } => ub,
            GuardAtom::Resident { .. } => None,
        }
    }

    /// True for the atoms that count routed tokens (`active`, `routed >= t`): the ones
    /// [`GuardAtom::threshold`] and [`GuardAtom::holds_for`] describe.
    pub fn is_token_count(&self) -> bool {
        matches!(self, GuardAtom::Active { .. } | GuardAtom::Tokens { .. })
    }

    /// True for the atoms decided from the gate's routing read back to the host (every
    /// atom but a cache residency).
    pub fn reads_routing(&self) -> bool {
        !matches!(self, GuardAtom::Resident { .. })
    }

    /// The atom as "routed tokens >= threshold": `active` is a threshold of 1. For the
    /// atoms that are not token counts, the threshold of their own quantity in an
    /// order-preserving integer form: 1 for a residency (0 = miss, 1 = hit), the `f32`
    /// bits of a score's threshold.
    pub fn threshold(&self) -> u32 {
        match *self {
            GuardAtom::Active { .. } | GuardAtom::Resident { .. } => 1,
            GuardAtom::Tokens { at_least, .. } => at_least,
            GuardAtom::Score { at_least_bits, .. } => at_least_bits,
        }
    }

    /// Decides the atom from the tokens the expert received (from its micro-batch, or
    /// summed over the step's).
    pub fn holds_for(&self, routed_tokens: u64) -> bool {
        routed_tokens >= u64::from(self.threshold())
    }
}

impl GuardAtom {
    /// The atom as the schedule writes it: `active(0, 3)`, `routed(0, 3, 1) >= 2`,
    /// `score_max(0, 3) >= 0.4`, and a residency with its cache's declared name,
    /// `ec.resident(0, 3)` (`caches` is [`Program::caches`], which the atom indexes).
    pub fn text(&self, caches: &[cache::Cache]) -> String {
        let ub = self.ub().map(|u| format!(", {u}")).unwrap_or_default();
        match *self {
            GuardAtom::Active { layer, expert, .. } => format!("active({layer}, {expert}{ub})"),
            GuardAtom::Tokens {
                layer,
                expert,
                at_least,
                ..
            } => format!("routed({layer}, {expert}{ub}) >= {at_least}"),
            GuardAtom::Resident {
                cache,
                layer,
                expert,
            } => format!("{}.resident({layer}, {expert})", cache_name(caches, cache)),
            GuardAtom::Score {
                kind,
                layer,
                expert,
                at_least_bits,
                ..
            } => format!(
                "{}({layer}, {expert}{ub}) >= {}",
                kind.as_str(),
                f32::from_bits(at_least_bits)
            ),
        }
    }
}

/// The declared name of cache `index`; an index no cache has (a program built by hand,
/// not by elaboration) says so rather than borrowing another cache's name.
fn cache_name(caches: &[cache::Cache], index: u32) -> String {
    caches
        .get(index as usize)
        .map_or_else(|| format!("<cache {index} undeclared>"), |c| c.name.clone())
}

impl GuardLit {
    /// The literal as the schedule writes it (see [`GuardAtom::text`]); a negated
    /// comparison reads as the comparison it came from (`routed(0, 3) < 2`, not
    /// `!(routed(0, 3) >= 2)`).
    pub fn text(&self, caches: &[cache::Cache]) -> String {
        match (self.negated, self.atom) {
            (false, atom) => atom.text(caches),
            (true, GuardAtom::Active { .. } | GuardAtom::Resident { .. }) => {
                format!("!{}", self.atom.text(caches))
            }
            (
                true,
                GuardAtom::Score {
                    kind,
                    layer,
                    expert,
                    ub,
                    at_least_bits,
                },
            ) => {
                let ub = ub.map(|u| format!(", {u}")).unwrap_or_default();
                let t = f32::from_bits(at_least_bits);
                format!("{}({layer}, {expert}{ub}) < {t}", kind.as_str())
            }
            (
                true,
                GuardAtom::Tokens {
                    layer,
                    expert,
                    ub,
                    at_least,
                },
            ) => {
                let ub = ub.map(|u| format!(", {u}")).unwrap_or_default();
                format!("routed({layer}, {expert}{ub}) < {at_least}")
            }
        }
    }
}

/// A possibly negated atom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GuardLit {
    /// The condition.
    pub atom: GuardAtom,
    /// True for `!atom`.
    pub negated: bool,
}

/// A conjunction of literals; the task runs only when all hold. Empty = always runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Guard {
    /// The literals, sorted and deduplicated.
    pub lits: Vec<GuardLit>,
}

impl Guard {
    /// True when the task always runs.
    pub fn is_always(&self) -> bool {
        self.lits.is_empty()
    }

    /// Whether every literal of `self` is also in `other` (so `other` implies `self`).
    pub fn implied_by(&self, other: &Guard) -> bool {
        self.lits.iter().all(|l| other.lits.contains(l))
    }

    /// The guard as the schedule writes it, literals joined by `&&` (see
    /// [`GuardLit::text`]; `caches` is [`Program::caches`]); empty when it always holds.
    pub fn text(&self, caches: &[cache::Cache]) -> String {
        let text: Vec<String> = self.lits.iter().map(|l| l.text(caches)).collect();
        text.join(" && ")
    }
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
        CheckpointLayout::new(&self.model)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::LayerLayout;
    use crate::model::segment::SegmentKind;

    #[test]
    fn matches_the_model_layer_image() {
        // Every shipped card, and each once more with quantised classes where its widths
        // allow them (Q8_0 blocks of 32; Q4_K super-blocks of 256 on the big cards).
        let mut cards = Vec::new();
        for card in ModelCard::builtins() {
            for spec in [
                "",
                "experts=q8_0,attention=q8_0,embedding=q8_0",
                "experts=q4_k,head=q6_k",
            ] {
                let mut c = card.clone();
                c.formats.parse_classes(spec).unwrap();
                let arch = crate::model::arch::ArchSpec::from_card(&c);
                if c.formats.check(&arch, c.dtype).is_ok() {
                    cards.push(c);
                }
            }
        }
        assert!(cards.len() > 2 * ModelCard::builtins().len());
        for card in cards {
            let layout = CheckpointLayout::new(&card);
            let arch = crate::model::arch::ArchSpec::from_card(&card);
            // The first layer (dense on the DeepSeek cards) and the last (MoE).
            for layer in [0, card.layers - 1] {
                let image = LayerLayout::for_card(&card, &arch, layer as usize);
                let offset = |kind| image.segment(kind).map(|s| s.offset as u64).unwrap();
                let name = format!("{} layer {layer}", card.name);
                assert_eq!(layout.pre_bytes, offset(SegmentKind::OProj), "{name}");
                assert_eq!(
                    layout.pre_bytes + layout.o_bytes,
                    offset(SegmentKind::FfnNorm),
                    "{name}"
                );
                assert_eq!(
                    layout.dense_bytes_of(layer),
                    image.dense_range().end as u64,
                    "{name}"
                );
                assert_eq!(layout.experts_of(layer), image.n_experts as u64, "{name}");
                for e in (0..image.n_experts).filter(|&e| e == 0 || e + 1 == image.n_experts) {
                    let range = image.expert_range(e);
                    assert_eq!(
                        layout.dense_bytes_of(layer) + e as u64 * layout.expert_bytes,
                        range.start as u64,
                        "{name}"
                    );
                    assert_eq!(layout.expert_bytes, range.len() as u64, "{name}");
                }
                assert_eq!(
                    layout.layer_bytes_of(layer),
                    image.image_bytes as u64,
                    "{name}"
                );
                let next = layout.layer_offset(layer + 1) - layout.layer_offset(layer);
                assert_eq!(next, image.image_bytes as u64, "{name}");
                assert_eq!(layout.layer_at(layout.layer_offset(layer)), Some(layer));
            }
        }
    }
}
