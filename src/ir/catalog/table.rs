//! The shape of the op table: what one entry ([`OpDef`]) declares about an op, and how the
//! table is looked up (by [`OpKind`], by name, from an [`Op`]).
//!
//! Takes nothing; gives the entry types and the lookups over [`super::ops::OPS`]. The
//! table is the one place an op is described: its DSL name, its static parameters and how
//! they parse, its buffer arguments (role, data type, access, optional), the engines it
//! may run on, its value signature and its work formulas. The elaborator, the checker, the
//! cost model and every backend's kernel table look the same entry up. Guarantees (pinned
//! by the tests in `ops.rs`): `OPS[k as usize].kind == k` for every kind, names are unique,
//! and every entry's signature lists exactly its declared arguments, in order.

use super::{AttnPart, ExpertSet, Op, RoleSig, Shape};
use crate::ir::{Access, CheckpointLayout, Engine, Role, RowUnit};
use crate::model::card::ModelCard;

/// An op without its static parameters: the key of the op table and of every backend's
/// kernel table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// `embed`.
    Embed,
    /// `pre_attn`.
    PreAttn,
    /// `attn`.
    Attn,
    /// `post_attn`.
    PostAttn,
    /// `o_proj`.
    OProj,
    /// `gate`.
    Gate,
    /// `pregate`.
    Pregate,
    /// `experts`.
    Experts,
    /// `combine`.
    Combine,
    /// `lm_head`.
    LmHead,
    /// `sample`.
    Sample,
    /// `copy` (written `copy SRC -> DST`).
    Copy,
}

impl OpKind {
    /// Every op kind, in table order (`OPS[i].kind == ALL[i]`).
    pub const ALL: [OpKind; 12] = [
        OpKind::Embed,
        OpKind::PreAttn,
        OpKind::Attn,
        OpKind::PostAttn,
        OpKind::OProj,
        OpKind::Gate,
        OpKind::Pregate,
        OpKind::Experts,
        OpKind::Combine,
        OpKind::LmHead,
        OpKind::Sample,
        OpKind::Copy,
    ];

    /// This op's table entry.
    pub fn def(self) -> &'static OpDef {
        &super::ops::OPS[self as usize]
    }

    /// The op's name as written in schedules.
    pub fn name(self) -> &'static str {
        self.def().name
    }
}

/// How a schedule writes the op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpForm {
    /// A call with named arguments: `pre_attn(layer = i, ub = j, w = .., h = .., out = ..)`.
    Call,
    /// The copy statement `copy SRC -> DST` (not callable by name).
    CopyStatement,
}

/// A static (non-buffer) parameter of an op: known at compile time, part of the [`Op`]
/// value, and parsed by the elaborator as [`StaticParam::syntax`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaticParam {
    /// `layer = i`: an integer in `0..layers`.
    Layer,
    /// `ub = j`: a micro-batch index in `0..microbatches` (needs the `microbatches`
    /// declaration).
    Ub,
    /// `part = prefill | decode | all`: which tokens an attention attends for.
    Part,
    /// `set = all | e | a..b | expert`: which experts (a compile-time index, a range, or a
    /// run-time expert such as `hot(l, r)`).
    Set,
}

impl StaticParam {
    /// The argument name.
    pub fn name(self) -> &'static str {
        match self {
            StaticParam::Layer => "layer",
            StaticParam::Ub => "ub",
            StaticParam::Part => "part",
            StaticParam::Set => "set",
        }
    }

    /// What a schedule may write for it, for documentation and help texts.
    pub fn syntax(self) -> &'static str {
        match self {
            StaticParam::Layer => "an integer in 0..layers",
            StaticParam::Ub => "a micro-batch index in 0..microbatches",
            StaticParam::Part => "`prefill`, `decode` or `all`",
            StaticParam::Set => "`all`, an expert index, a range `a..b` or a run-time expert",
        }
    }
}

/// What kind of data a buffer argument holds; fixes the smallest slice it needs
/// ([`ArgType::min_bytes`], the same formulas as the language's size helpers) and the
/// data class the cost model charges it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgType {
    /// Model weights (checked by value, not size).
    Weights,
    /// Residual-stream rows, `hidden(n)`.
    Hidden,
    /// Q, K and V rows, `qkv(n)`.
    Qkv,
    /// Attention-output rows, `attn_out(n)`.
    AttnOut,
    /// A KV cache, `kv_cache(t)` for every sequence's whole context.
    KvCache,
    /// Routing entries, `routing(n)`.
    Routing,
    /// Normalised rows and per-(token, k) expert outputs, `expert_acc(n)`.
    ExpertAcc,
    /// One logits row per sequence, `logits(s)`.
    Logits,
    /// One token id per sequence, `tokens(s)`.
    Tokens,
    /// Untyped bytes (copies: any length, checked by equal lengths instead).
    Bytes,
}

impl ArgType {
    /// The smallest slice this argument needs for a task of `shape`, or `None` when its
    /// size is not fixed by the shape (weights are checked by value, copies by lengths).
    pub fn min_bytes(self, card: &ModelCard, shape: &Shape) -> Option<u64> {
        if self == ArgType::KvCache {
            let per_position = card.kv_elems_per_token_layer() * shape.kv_bytes;
            return Some(shape.seqs * shape.context * per_position);
        }
        let (unit, row_bytes) = self.row(card, shape.act_bytes)?;
        let rows = match unit {
            RowUnit::Token => shape.tokens,
            RowUnit::Sequence => shape.seqs,
        };
        Some(rows * row_bytes)
    }

    /// What one row of an activation of this type is and its bytes at `act_bytes` per
    /// element; `None` for weights, KV caches and untyped bytes, which have no rows. An
    /// activation of `n` rows is those rows packed (the backends' kernels lay every part
    /// of it out by the step's `n`), so its first `n x row` bytes are all of it.
    pub fn row(self, card: &ModelCard, act_bytes: u64) -> Option<(RowUnit, u64)> {
        let a = act_bytes;
        Some(match self {
            ArgType::Weights | ArgType::Bytes | ArgType::KvCache => return None,
            ArgType::Hidden => (RowUnit::Token, card.hidden * a),
            ArgType::ExpertAcc => (RowUnit::Token, card.acc_rows_per_token() * card.hidden * a),
            ArgType::Qkv => (RowUnit::Token, card.qkv_width() * a),
            ArgType::AttnOut => (RowUnit::Token, card.q_dim() * a),
            ArgType::Routing => (RowUnit::Token, card.top_k * super::ROUTE_ENTRY_BYTES),
            ArgType::Logits => (RowUnit::Sequence, card.vocab * a),
            ArgType::Tokens => (RowUnit::Sequence, super::TOKEN_BYTES),
        })
    }

    /// The data class the cost model charges this argument's traffic to.
    pub fn class(self) -> super::DataClass {
        match self {
            ArgType::Weights => super::DataClass::Weights,
            ArgType::KvCache => super::DataClass::KvCache,
            _ => super::DataClass::Activations,
        }
    }
}

/// One buffer argument as the table declares it. The value signature of a concrete op
/// ([`RoleSig`], from [`OpDef::signature`]) may narrow it: `attn(part = prefill)` only
/// writes its `kv` (declared read-write) and may leave it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgDef {
    /// The role, which is also the argument's name.
    pub role: Role,
    /// What the argument holds.
    pub ty: ArgType,
    /// The widest access any instance of the op has on it.
    pub access: Access,
    /// Whether some instance of the op may leave it out.
    pub optional: bool,
    /// Whether several slices may be passed as a list (`w = [a, b]`: weights split over
    /// buffers; `a = [prefill_rows, decode_rows]`).
    pub list: bool,
}

impl ArgDef {
    /// A required single-slice argument.
    pub const fn new(role: Role, ty: ArgType, access: Access) -> ArgDef {
        ArgDef {
            role,
            ty,
            access,
            optional: false,
            list: false,
        }
    }

    /// The same argument, allowed to be left out.
    pub const fn optional(self) -> ArgDef {
        ArgDef {
            optional: true,
            ..self
        }
    }

    /// The same argument, allowed to be a list of slices.
    pub const fn list(self) -> ArgDef {
        ArgDef { list: true, ..self }
    }
}

/// The static parameters given to a call, as parsed by the elaborator; [`OpDef::build`]
/// turns them into an [`Op`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StaticArgs {
    /// `layer`, if given.
    pub layer: Option<u32>,
    /// `ub`, if given.
    pub ub: Option<u32>,
    /// `part`, if given.
    pub part: Option<AttnPart>,
    /// `set`, if given.
    pub set: Option<ExpertSet>,
}

impl StaticArgs {
    /// `layer`, or the name of the missing parameter.
    pub fn layer(&self) -> Result<u32, StaticParam> {
        self.layer.ok_or(StaticParam::Layer)
    }

    /// `ub`, or the name of the missing parameter.
    pub fn ub(&self) -> Result<u32, StaticParam> {
        self.ub.ok_or(StaticParam::Ub)
    }

    /// `part`, or the name of the missing parameter.
    pub fn part(&self) -> Result<AttnPart, StaticParam> {
        self.part.ok_or(StaticParam::Part)
    }

    /// `set`, or the name of the missing parameter.
    pub fn set(&self) -> Result<ExpertSet, StaticParam> {
        self.set.ok_or(StaticParam::Set)
    }
}

/// An op's work formulas, all for one task of the given [`Shape`] (worst case unless the
/// cost model passes an average).
#[derive(Clone, Copy)]
pub struct WorkDef {
    /// Floating-point operations (a multiply-add counts 2).
    pub flops: fn(&Op, &ModelCard, &Shape) -> f64,
    /// Bytes read plus written through the argument of role `role` whose slice is
    /// `slice_len` bytes long (weights: the tensors the op reads, before being split over
    /// several `w` arguments). `layout` is the card's [`CheckpointLayout`], which the
    /// weight formulas read: the caller computes it once per card, not per task.
    pub bytes: fn(
        op: &Op,
        role: Role,
        card: &ModelCard,
        layout: &CheckpointLayout,
        shape: &Shape,
        slice_len: u64,
    ) -> f64,
    /// Scratch bytes beyond the arguments, in the memory of the engine the op runs on.
    pub workspace: fn(&Op, &ModelCard, &Shape) -> u64,
}

/// Which measured kernel rate the cost model times an op's compute at, beside the roofline
/// of its work formulas (`cost::predict::kernel_seconds`, `gpu_rate_cap`). Every entry
/// names one and the cost model matches on it without a wildcard, so a new op cannot be
/// charged nothing by omission: adding a variant here fails to compile there, and the test
/// `cost_classes_agree_with_the_work_formulas` (`ops.rs`) fails when an entry's class does
/// not fit its flops and bytes (an op that streams weight matrices in a roofline-only
/// class, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostClass {
    /// A dense projection that streams its weight matrices once per call over one row per
    /// new token (`pre_attn`, `o_proj`, `gate`'s router and shared expert): the `linear`
    /// kernel curve at the micro-batch's tokens.
    Linear,
    /// A dense projection over one row per sequence (`lm_head`: the last token of each):
    /// the `linear` curve at the micro-batch's sequences.
    LinearPerSequence,
    /// Routed expert FFNs (`experts`): the `expert_ffn` curve at the tokens routed to each
    /// active expert.
    ExpertFfn,
    /// The fused post-attention block (`post_attn`): its active experts' weights at the
    /// `expert_ffn` rate, the rest (o_proj, norms, router) at the `linear` rate.
    FusedPostAttn,
    /// Attention over the KV cache (`attn`): its flops at the measured prefill or decode
    /// attention rate, at least one smallest call.
    Attention,
    /// A byte copy between memory spaces (`copy`): timed by the link it crosses, never by
    /// a kernel rate.
    Copy,
    /// No kernel of its own is measured: the roofline of the op's flops and bytes is its
    /// whole time, for the reason given.
    Roofline(RooflineReason),
}

/// Why the roofline alone times an op of [`CostClass::Roofline`]: each reason is a claim
/// about the op's work formulas that the table's tests check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RooflineReason {
    /// A lookup of one weight row per token (`embed`): its weight bytes grow with the
    /// tokens, not with a matrix streamed whole, and it does no arithmetic.
    Gather,
    /// Elementwise over activation rows (`combine`): no weights, at most one flop per
    /// byte moved, so memory bound on every profile.
    Elementwise,
    /// A reduction over each sequence's logits row (`sample`): no weights, at most one
    /// flop per byte moved.
    RowReduction,
}

/// One entry of the op table: everything the compiler and the backends know about an op.
#[derive(Clone, Copy)]
pub struct OpDef {
    /// The key (`OPS[kind as usize]` is this entry).
    pub kind: OpKind,
    /// The name as written in schedules.
    pub name: &'static str,
    /// What the op computes, in one line.
    pub summary: &'static str,
    /// How a schedule writes it.
    pub form: OpForm,
    /// Static parameters, in the order they are parsed (and printed by [`Op::describe`]).
    pub params: &'static [StaticParam],
    /// Buffer arguments, in signature order.
    pub args: &'static [ArgDef],
    /// Engines whose streams may run it.
    pub engines: &'static [Engine],
    /// Builds the op from its parsed static parameters (`Err`: the parameter missing).
    pub build: fn(&StaticArgs) -> Result<Op, StaticParam>,
    /// The value signature of a concrete op: per argument, in the order of `args`, the
    /// access, what it must hold before and what it holds after.
    pub signature: fn(&Op, &ModelCard) -> Vec<RoleSig>,
    /// Flops, bytes and workspace.
    pub work: WorkDef,
    /// Which kernel rate the cost model times the op at (beside the roofline of `work`).
    pub cost: CostClass,
}

impl std::fmt::Debug for OpDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpDef")
            .field("kind", &self.kind)
            .field("name", &self.name)
            .field("params", &self.params)
            .field("args", &self.args)
            .field("engines", &self.engines)
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

impl OpDef {
    /// The declared argument of role `role`, if the op has one.
    pub fn arg(&self, role: Role) -> Option<&'static ArgDef> {
        self.args.iter().find(|a| a.role == role)
    }

    /// Every argument name a call may use: static parameters, then buffer arguments.
    pub fn arg_names(&self) -> Vec<&'static str> {
        self.params
            .iter()
            .map(|p| p.name())
            .chain(self.args.iter().map(|a| a.role.as_str()))
            .collect()
    }

    /// Whether a stream on `engine` may run the op.
    pub fn runs_on(&self, engine: Engine) -> bool {
        self.engines.contains(&engine)
    }
}

/// The table entry of the op named `name` (copy included), if there is one.
pub fn op_by_name(name: &str) -> Option<&'static OpDef> {
    super::ops::OPS.iter().find(|d| d.name == name)
}

/// The names of every op a schedule may call by name (`copy` is a statement of its own).
pub fn callable_op_names() -> impl Iterator<Item = &'static str> {
    super::ops::OPS
        .iter()
        .filter(|d| d.form == OpForm::Call)
        .map(|d| d.name)
}

impl Op {
    /// The op's kind (its key in the op table).
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Embed { .. } => OpKind::Embed,
            Op::PreAttn { .. } => OpKind::PreAttn,
            Op::Attn { .. } => OpKind::Attn,
            Op::PostAttn { .. } => OpKind::PostAttn,
            Op::OProj { .. } => OpKind::OProj,
            Op::Gate { .. } => OpKind::Gate,
            Op::Pregate { .. } => OpKind::Pregate,
            Op::Experts { .. } => OpKind::Experts,
            Op::Combine { .. } => OpKind::Combine,
            Op::LmHead { .. } => OpKind::LmHead,
            Op::Sample { .. } => OpKind::Sample,
            Op::Copy => OpKind::Copy,
        }
    }

    /// The op's table entry.
    pub fn def(&self) -> &'static OpDef {
        self.kind().def()
    }

    /// The op's static parameters, the inverse of [`OpDef::build`].
    pub fn statics(&self) -> StaticArgs {
        let (part, set) = match *self {
            Op::Attn { part, .. } => (Some(part), None),
            Op::Experts { set, .. } => (None, Some(set)),
            _ => (None, None),
        };
        StaticArgs {
            layer: self.layer(),
            ub: self.ub(),
            part,
            set,
        }
    }
}
