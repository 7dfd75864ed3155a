//! The op catalog: what every op reads and writes, which value it expects and produces,
//! where it may run, and how much work it does.
//!
//! Every op is one entry of the op table ([`OPS`], an [`OpDef`] per [`OpKind`], in
//! `ops.rs`): its name, static parameters, typed arguments, engines, value signature and
//! work formulas. The functions here are the table's lookups under the names the rest of
//! the compiler calls. Takes a model card and a task [`Shape`]; gives each op's argument
//! roles with access mode ([`signature`]), the tensors it expects and produces ([`RoleSig`]), the minimum bytes
//! of each activation argument ([`required_bytes`]), the size helpers of the language
//! ([`size_helper`]) and the flops/bytes per memory level of a task ([`work`]), which the
//! cost model consumes as is. One constant, [`ACT_BYTES`], sizes every activation and KV
//! cache element (the runtime computes in f32); weights use the card's dtype.

mod ops;
mod sizes;
mod table;
mod work;

pub use ops::OPS;
pub use table::{
    callable_op_names, op_by_name, ArgDef, ArgType, CostClass, OpDef, OpForm, OpKind,
    RooflineReason, StaticArgs, StaticParam, WorkDef,
};

pub use sizes::{size_helper, HelperSize, SIZE_HELPERS};
pub use work::{
    flops, role_traffic, role_traffic_in, routed_tokens, work, work_in, workspace_bytes, CopyWork,
    DataClass, MemTraffic, Work,
};

pub use super::expert::ExpertRef;
use super::value::{Rows, Tensor};
use super::{Access, Role};
use crate::model::card::ModelCard;
use serde::{Deserialize, Serialize};

/// Bytes per element of activations and KV caches (f32 in the runtime).
pub const ACT_BYTES: u64 = 4;

/// Bytes per routing entry: an expert index (u32) and its weight (f32).
pub const ROUTE_ENTRY_BYTES: u64 = 8;

/// Bytes per token id (u32).
pub const TOKEN_BYTES: u64 = 4;

/// The experts an `experts` task computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExpertSet {
    /// Every expert of the layer.
    All,
    /// Experts `start..end`.
    Range {
        /// First expert.
        start: u32,
        /// One past the last.
        end: u32,
    },
    /// A single expert.
    One(ExpertRef),
}

impl ExpertSet {
    /// Number of experts in the set.
    pub fn len(&self, experts: u64) -> u64 {
        match self {
            ExpertSet::All => experts,
            ExpertSet::Range { start, end } => u64::from(end.saturating_sub(*start)),
            ExpertSet::One(_) => 1,
        }
    }

    /// True for an empty range.
    pub fn is_empty(&self, experts: u64) -> bool {
        self.len(experts) == 0
    }

    /// The experts as a list of references.
    pub fn members(&self, experts: u64) -> Vec<ExpertRef> {
        match self {
            ExpertSet::All => (0..experts as u32).map(ExpertRef::Index).collect(),
            ExpertSet::Range { start, end } => (*start..*end).map(ExpertRef::Index).collect(),
            ExpertSet::One(e) => vec![*e],
        }
    }
}

impl std::fmt::Display for ExpertSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertSet::All => write!(f, "all"),
            ExpertSet::Range { start, end } => write!(f, "{start}..{end}"),
            ExpertSet::One(e) => write!(f, "{e}"),
        }
    }
}

/// Which tokens an `attn` task attends for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttnPart {
    /// Prompt tokens (causal over the prompt; fills the KV cache).
    Prefill,
    /// One new token per sequence over the cached context.
    Decode,
    /// Both kinds mixed in one micro-batch (VSLPipe).
    All,
}

impl AttnPart {
    /// The attention-output rows this part writes.
    pub fn rows(self) -> Rows {
        match self {
            AttnPart::Prefill => Rows::Prefill,
            AttnPart::Decode => Rows::Decode,
            AttnPart::All => Rows::All,
        }
    }

    /// As written in `part = ...`.
    pub fn as_str(self) -> &'static str {
        match self {
            AttnPart::Prefill => "prefill",
            AttnPart::Decode => "decode",
            AttnPart::All => "all",
        }
    }
}

/// An op with its static parameters (`layer`, `ub`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Token embedding of micro-batch `ub`: the prompt (prefill) or the tokens sampled last
    /// step (`tokens`, optional: without it they come from the runtime's batch).
    Embed {
        /// Micro-batch.
        ub: u32,
    },
    /// Input norm, QKV projection (DBRX: fused + clip), rotary.
    PreAttn {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Append K/V to the cache and run grouped-query attention.
    Attn {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch (also names its KV cache).
        ub: u32,
        /// Prefill, decode or both.
        part: AttnPart,
    },
    /// O-projection + residual + gate + all experts + combine + residual.
    PostAttn {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// O-projection + residual only.
    OProj {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Post-attention norm, router softmax, top-k; zeroes the expert accumulator.
    Gate {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Lookahead gating (Pre-gated MoE): layer `layer`'s post-attention norm and router
    /// applied to the hidden state entering layer `layer - 1`'s MoE block, writing a
    /// routing that only predictors read (never `experts` or `combine`).
    Pregate {
        /// The layer whose router runs (>= 1): the layer predicted.
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Some experts over the tokens routed to them, accumulated into `acc`.
    Experts {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch.
        ub: u32,
        /// Which experts.
        set: ExpertSet,
    },
    /// Adds the expert accumulator to the residual stream.
    Combine {
        /// The decoder layer (0-based).
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Final norm + logits for the last token of each sequence.
    LmHead {
        /// Micro-batch.
        ub: u32,
    },
    /// Picks the next token of each sequence (greedy or temperature).
    Sample {
        /// Micro-batch.
        ub: u32,
    },
    /// A byte copy between two slices of equal length.
    Copy,
}

impl Op {
    /// The op's name as written (from its table entry).
    pub fn name(&self) -> &'static str {
        self.def().name
    }

    /// The layer the op works on, if any.
    pub fn layer(&self) -> Option<u32> {
        match *self {
            Op::PreAttn { layer, .. }
            | Op::Attn { layer, .. }
            | Op::PostAttn { layer, .. }
            | Op::OProj { layer, .. }
            | Op::Gate { layer, .. }
            | Op::Pregate { layer, .. }
            | Op::Experts { layer, .. }
            | Op::Combine { layer, .. } => Some(layer),
            _ => None,
        }
    }

    /// The micro-batch the op works on, if any.
    pub fn ub(&self) -> Option<u32> {
        match *self {
            Op::Embed { ub }
            | Op::LmHead { ub }
            | Op::Sample { ub }
            | Op::PreAttn { ub, .. }
            | Op::Attn { ub, .. }
            | Op::PostAttn { ub, .. }
            | Op::OProj { ub, .. }
            | Op::Gate { ub, .. }
            | Op::Pregate { ub, .. }
            | Op::Experts { ub, .. }
            | Op::Combine { ub, .. } => Some(ub),
            Op::Copy => None,
        }
    }

    /// `pre_attn(layer=1, ub=0)` style description (`copy` for copies): the static
    /// parameters the op's table entry declares, in its order.
    pub fn describe(&self) -> String {
        let def = self.def();
        if def.params.is_empty() {
            return def.name.to_string();
        }
        let statics = self.statics();
        let parts: Vec<String> = def
            .params
            .iter()
            .map(|param| {
                let value = match param {
                    StaticParam::Layer => statics.layer.map(|l| l.to_string()),
                    StaticParam::Ub => statics.ub.map(|u| u.to_string()),
                    StaticParam::Part => statics.part.map(|p| p.as_str().to_string()),
                    StaticParam::Set => statics.set.map(|s| s.to_string()),
                };
                format!("{}={}", param.name(), value.unwrap_or_default())
            })
            .collect();
        format!("{}({})", def.name, parts.join(", "))
    }
}

/// One argument role of an op's signature.
#[derive(Debug, Clone, PartialEq)]
pub struct RoleSig {
    /// The role (argument name).
    pub role: Role,
    /// How the op touches it.
    pub access: Access,
    /// Tensors the argument must hold before the task (weights: each one whole somewhere
    /// in the argument; activations: exactly one, over the whole slice). Empty: no check.
    pub expects: Vec<Tensor>,
    /// For `kv` of prefill attention: an argument nobody wrote yet is also accepted.
    pub may_be_empty: bool,
    /// The argument may be left out (`kv` of `attn(part = prefill)`: attend over the new
    /// tokens only, nothing cached).
    pub optional: bool,
    /// The tensor the argument holds after the task (for writes).
    pub produces: Option<Tensor>,
}

/// The roles of `op` in argument order, with their value signatures (the op's table entry
/// decides). `copy` has `src` and `dst` with no expectation (its value is whatever `src`
/// holds).
pub fn signature(op: &Op, card: &ModelCard) -> Vec<RoleSig> {
    (op.def().signature)(op, card)
}

/// The tokens, sequences and context a task's sizes and work assume (worst case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// New tokens in the micro-batch (prefill: sequences x prompt_len; decode: sequences).
    pub tokens: u64,
    /// Sequences in the micro-batch.
    pub seqs: u64,
    /// Tokens each sequence attends to, the new ones included (prefill: prompt_len;
    /// decode and mixed: prompt_len + gen_len, the worst case; the cost model may pass an
    /// average to [`work`] instead).
    pub context: u64,
    /// Bytes per activation element: [`ACT_BYTES`] (f32, what the runtime computes in)
    /// unless elaboration was asked otherwise (the cost model may model fp16).
    pub act_bytes: u64,
    /// Bytes per KV cache element: [`ACT_BYTES`] unless the run stores its cache in
    /// halves (`--kv-type f16`, 2); every KV size and KV traffic counts it.
    #[serde(default = "default_kv_bytes")]
    pub kv_bytes: u64,
}

/// [`Shape::kv_bytes`] of shapes written before it existed (f32 caches).
fn default_kv_bytes() -> u64 {
    ACT_BYTES
}

/// Bytes a copy of `part` of one layer's KV cache moves for a micro-batch of `shape`: the
/// positions cached before the step's new tokens (`context`: `seqs x (context - new
/// tokens per sequence)`) or only the new tokens' (`appended`), at `kv_bytes` per element.
/// At the declared (worst-case) shape this is what the memory check and the copy-bytes
/// test count; the cost model passes the context it assumes, the runtime copies each
/// sequence's real positions.
pub fn kv_part_bytes(card: &ModelCard, shape: &Shape, part: crate::ir::KvPart) -> u64 {
    let per_token = card.kv_elems_per_token_layer() * shape.kv_bytes;
    let new_per_seq = shape.tokens / shape.seqs.max(1);
    let positions = match part {
        crate::ir::KvPart::Context => shape.seqs * shape.context.saturating_sub(new_per_seq),
        crate::ir::KvPart::Appended => shape.tokens,
    };
    positions * per_token
}

/// [`required_bytes`] for a task of a `kind` step. In a mixed step the runtime's
/// resource-aware scheduler gives KV blocks as sequences grow and preempts the youngest
/// when they run out (MoE-Lens §6.2), so a KV slice need only hold one whole sequence.
pub fn required_bytes_in_step(
    op: &Op,
    role: Role,
    card: &ModelCard,
    shape: &Shape,
    kind: crate::ir::StepKind,
) -> Option<u64> {
    if kind == crate::ir::StepKind::Mixed && role == Role::Kv {
        let one = Shape { seqs: 1, ..*shape };
        return required_bytes(op, role, card, &one);
    }
    required_bytes(op, role, card, shape)
}

/// The smallest slice an activation argument needs, or `None` when the role has no fixed
/// size (weights are checked by value; copies by equal lengths) or the op has no such
/// argument. The size follows the argument's declared type ([`ArgType::min_bytes`]).
pub fn required_bytes(op: &Op, role: Role, card: &ModelCard, shape: &Shape) -> Option<u64> {
    op.def().arg(role)?.ty.min_bytes(card, shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flops of one decoded token through every layer and the head, context 1.
    fn flops_per_token(card: &ModelCard) -> f64 {
        let shape = Shape {
            tokens: 1,
            seqs: 1,
            context: 1,
            act_bytes: ACT_BYTES,
            kv_bytes: ACT_BYTES,
        };
        let per_layer: f64 = [
            Op::PreAttn { layer: 0, ub: 0 },
            Op::Attn {
                layer: 0,
                ub: 0,
                part: AttnPart::Decode,
            },
            Op::PostAttn { layer: 0, ub: 0 },
        ]
        .iter()
        .map(|op| flops(op, card, &shape))
        .sum();
        per_layer * card.layers as f64 + flops(&Op::LmHead { ub: 0 }, card, &shape)
    }

    /// A token costs about 2 flops per active parameter (embedding lookups are free):
    /// Mistral publishes 12.9B active parameters for Mixtral-8x7B, Databricks 36B for DBRX.
    #[test]
    fn decode_flops_match_the_published_active_parameters() {
        for (name, active) in [("mixtral-8x7b", 12.9e9), ("dbrx", 36.0e9)] {
            let card = ModelCard::load(name).unwrap();
            let embed = (card.vocab * card.hidden) as f64;
            let expected = 2.0 * (active - embed);
            let got = flops_per_token(&card);
            assert!(
                (got / expected - 1.0).abs() < 0.02,
                "{name}: {got:e} vs {expected:e}"
            );
        }
    }

    /// The fine ops add up to post_attn.
    #[test]
    fn fine_ops_add_up_to_post_attn() {
        let card = ModelCard::load("mixtral-8x7b").unwrap();
        let shape = Shape {
            tokens: 64,
            seqs: 64,
            context: 512,
            act_bytes: ACT_BYTES,
            kv_bytes: ACT_BYTES,
        };
        let fine: f64 = [
            Op::OProj { layer: 0, ub: 0 },
            Op::Gate { layer: 0, ub: 0 },
            Op::Experts {
                layer: 0,
                ub: 0,
                set: ExpertSet::All,
            },
            Op::Combine { layer: 0, ub: 0 },
        ]
        .iter()
        .map(|op| flops(op, &card, &shape))
        .sum();
        let whole = flops(&Op::PostAttn { layer: 0, ub: 0 }, &card, &shape);
        assert!((fine / whole - 1.0).abs() < 0.001, "{fine:e} vs {whole:e}");
    }

    /// Size helpers scale with the element size given.
    #[test]
    fn activation_sizes_follow_act_bytes() {
        let card = ModelCard::load("mixtral-tiny").unwrap();
        let f32_size = size_helper("kv_cache", &[10], &card, 4, 4, None)
            .unwrap()
            .unwrap()
            .bytes;
        let f16_size = size_helper("kv_cache", &[10], &card, 4, 2, None)
            .unwrap()
            .unwrap()
            .bytes;
        assert_eq!(f32_size, 10 * 2 * card.kv_dim() * 4);
        assert_eq!(f16_size * 2, f32_size);
        assert_eq!(size_helper("hidden", &[], &card, 4, 4, None), Some(Err(1)));
        assert_eq!(size_helper("nope", &[1], &card, 4, 4, None), None);
    }
}
