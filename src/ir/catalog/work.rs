//! What a task costs: flops and bytes per argument and memory level, from the op and the
//! task's [`Shape`] — the numbers the cost model (HRM) consumes as is.

use super::{ExpertSet, Op, Shape, ROUTE_ENTRY_BYTES, TOKEN_BYTES};
use crate::ir::{AttnPart, Role, Space};
use crate::model::card::ModelCard;
use serde::{Deserialize, Serialize};

/// Which kind of data a memory access moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DataClass {
    /// Model weights.
    Weights,
    /// Activations (hidden states, QKV, logits, routing, tokens).
    Activations,
    /// KV cache reads and appends.
    KvCache,
}

/// Bytes moved at one memory level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemTraffic {
    /// The memory space touched.
    pub space: Space,
    /// What is moved.
    pub class: DataClass,
    /// Bytes read plus bytes written.
    pub bytes: f64,
}

/// A copy's transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyWork {
    /// Source space.
    pub src: Space,
    /// Destination space.
    pub dst: Space,
    /// Bytes transferred.
    pub bytes: u64,
}

/// What a task costs, for the HRM: `time = max(flops / peak, bytes / bandwidth per level)`,
/// copies `bytes / link bandwidth`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Work {
    /// Floating-point operations (a multiply-add counts 2).
    pub flops: f64,
    /// Bytes moved per memory level and data class (one entry per argument).
    pub mem: Vec<MemTraffic>,
    /// For copies: the transfer.
    pub copy: Option<CopyWork>,
}

impl Work {
    /// Bytes moved at one memory level, all classes.
    pub fn bytes_in(&self, space: Space) -> f64 {
        self.mem
            .iter()
            .filter(|m| m.space == space)
            .map(|m| m.bytes)
            .sum()
    }
}

/// Flops of an op for a shape. Attention over `context` counts QK^T and PV (4 flops per
/// query, key and head dimension); prefill attention is causal (half the square).
pub fn flops(op: &Op, card: &ModelCard, shape: &Shape) -> f64 {
    let n = shape.tokens as f64;
    let s = shape.seqs as f64;
    let c = shape.context as f64;
    let h = card.hidden as f64;
    let q = card.q_dim() as f64;
    let kv = card.kv_dim() as f64;
    let e = card.experts as f64;
    let k = card.top_k as f64;
    let f = card.ffn as f64;
    let norm = 4.0 * n * h;
    let expert_flops = |routed_tokens: f64| 2.0 * routed_tokens * 3.0 * h * f;
    match op {
        Op::Embed { .. } | Op::Copy => 0.0,
        Op::PreAttn { .. } => norm + 2.0 * n * h * (q + 2.0 * kv) + 3.0 * n * (q + kv),
        Op::Attn { part, .. } => match part {
            AttnPart::Prefill => 4.0 * q * s * c * (c + 1.0) / 2.0,
            AttnPart::Decode | AttnPart::All => 4.0 * q * n * c,
        },
        Op::PostAttn { .. } => {
            2.0 * n * q * h + norm + 2.0 * n * h * e + expert_flops(n * k) + 3.0 * n * h
        }
        Op::OProj { .. } => 2.0 * n * q * h + n * h,
        Op::Gate { .. } => norm + 2.0 * n * h * e + 5.0 * n * e,
        Op::Experts { set, .. } => expert_flops(routed_tokens(set, card, shape)),
        Op::Combine { .. } => n * h,
        Op::LmHead { .. } => 4.0 * s * h + 2.0 * s * h * card.vocab as f64,
        Op::Sample { .. } => s * card.vocab as f64,
    }
}

/// Token-expert pairs an `experts` task computes, assuming uniform routing (the average
/// case; memory checks never depend on it).
pub fn routed_tokens(set: &ExpertSet, card: &ModelCard, shape: &Shape) -> f64 {
    let share = set.len(card.experts) as f64 / card.experts as f64;
    shape.tokens as f64 * card.top_k as f64 * share
}

/// Bytes an op moves through one argument (read + write), and what kind of data it is.
/// Weights count only the tensors the op reads; experts only those that can be active
/// (`min(experts in the set, tokens x top_k)`).
pub fn role_traffic(
    op: &Op,
    role: Role,
    card: &ModelCard,
    shape: &Shape,
    slice_len: u64,
) -> (DataClass, f64) {
    let n = shape.tokens as f64;
    let s = shape.seqs as f64;
    let c = shape.context as f64;
    let h = card.hidden as f64;
    let q = card.q_dim() as f64;
    let kv = card.kv_dim() as f64;
    let dt = card.dtype.bytes() as f64;
    let a = shape.act_bytes as f64;
    let layout = crate::ir::CheckpointLayout::new(card);
    let expert_bytes = layout.expert_bytes as f64;
    let active = |m: f64| m.min(n * card.top_k as f64);
    match (op, role) {
        (Op::Copy, _) => (DataClass::Activations, slice_len as f64),
        (Op::Embed { .. }, Role::W) => (DataClass::Weights, n * h * dt),
        (Op::PreAttn { .. }, Role::W) => (DataClass::Weights, layout.pre_bytes as f64),
        (Op::OProj { .. }, Role::W) => (DataClass::Weights, layout.o_bytes as f64),
        (Op::PostAttn { .. }, Role::W) => (
            DataClass::Weights,
            (layout.o_bytes + layout.gate_bytes) as f64
                + active(card.experts as f64) * expert_bytes,
        ),
        (Op::Gate { .. }, Role::W) => (DataClass::Weights, layout.gate_bytes as f64),
        (Op::Experts { set, .. }, Role::W) => (
            DataClass::Weights,
            active(set.len(card.experts) as f64) * expert_bytes,
        ),
        (Op::LmHead { .. }, Role::W) => (DataClass::Weights, (card.vocab as f64 * h + h) * dt),
        (_, Role::W) => (DataClass::Weights, 0.0),
        (Op::Attn { part, .. }, Role::Kv) => {
            let append = n * 2.0 * kv * a;
            let read = match part {
                AttnPart::Prefill => s * c * 2.0 * kv * a,
                AttnPart::Decode | AttnPart::All => s * c * 2.0 * kv * a,
            };
            (DataClass::KvCache, append + read)
        }
        (Op::Attn { .. }, Role::Qkv) => (DataClass::Activations, n * (q + 2.0 * kv) * a),
        (Op::Attn { .. }, Role::Out) | (_, Role::A) => (DataClass::Activations, n * q * a),
        (Op::PreAttn { .. }, Role::Out) => (DataClass::Activations, n * (q + 2.0 * kv) * a),
        (Op::PreAttn { .. } | Op::Gate { .. }, Role::H) => (DataClass::Activations, n * h * a),
        (Op::Embed { .. }, Role::H) => (DataClass::Activations, n * h * a),
        (Op::LmHead { .. }, Role::H) => (DataClass::Activations, s * h * a),
        (_, Role::H) => (DataClass::Activations, 2.0 * n * h * a),
        (_, Role::Route) => (
            DataClass::Activations,
            n * card.top_k as f64 * ROUTE_ENTRY_BYTES as f64,
        ),
        (Op::Experts { set, .. }, Role::Acc) => (
            DataClass::Activations,
            2.0 * routed_tokens(set, card, shape) * h * a,
        ),
        // The gate writes the normalised rows and zeroes every (token, k) slot.
        (Op::Gate { .. }, Role::Acc) => (
            DataClass::Activations,
            n * (1.0 + card.top_k as f64) * h * a,
        ),
        // Combine reads the top_k slots of every token.
        (_, Role::Acc) => (DataClass::Activations, n * card.top_k as f64 * h * a),
        (_, Role::Logits) => (DataClass::Activations, s * card.vocab as f64 * a),
        (_, Role::Tokens) => (DataClass::Activations, s * TOKEN_BYTES as f64),
        _ => (DataClass::Activations, slice_len as f64),
    }
}

/// The work of a task whose arguments live in `arg_spaces` (role, space, slice length).
pub fn work(op: &Op, card: &ModelCard, shape: &Shape, args: &[(Role, Space, u64)]) -> Work {
    // Weights the op reads are counted once, however many `w` arguments hold them: split
    // in proportion to the arguments' lengths, none reading more than it holds.
    let weight_len: u64 = args.iter().filter(|a| a.0 == Role::W).map(|a| a.2).sum();
    let mem = args
        .iter()
        .map(|&(role, space, len)| {
            let (class, mut bytes) = role_traffic(op, role, card, shape, len);
            if role == Role::W && *op != Op::Copy && weight_len > 0 {
                bytes = (bytes * len as f64 / weight_len as f64).min(len as f64);
            }
            MemTraffic {
                space,
                class,
                bytes,
            }
        })
        .collect();
    let copy = match (op, args) {
        (Op::Copy, [(_, src, len), (_, dst, _)]) => Some(CopyWork {
            src: *src,
            dst: *dst,
            bytes: *len,
        }),
        _ => None,
    };
    Work {
        flops: flops(op, card, shape),
        mem,
        copy,
    }
}

/// Scratch bytes an op needs beyond its arguments, in the memory of the engine it runs
/// on: the experts' gate/up intermediates (`routed tokens x ffn x 2` elements) and the
/// attention scores of one key block (1024 keys) per query row and head.
pub fn workspace_bytes(op: &Op, card: &ModelCard, shape: &Shape) -> u64 {
    let a = shape.act_bytes;
    match op {
        Op::PostAttn { .. } => shape.tokens * card.top_k * card.ffn * 2 * a,
        Op::Experts { set, .. } => {
            let routed = routed_tokens(set, card, shape).ceil() as u64;
            routed.min(shape.tokens) * card.ffn * 2 * a
        }
        Op::Attn { .. } => shape.tokens * card.heads * shape.context.min(1024) * a,
        _ => 0,
    }
}
