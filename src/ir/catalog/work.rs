//! What a task costs: flops and bytes per argument and memory level, from the op and the
//! task's [`Shape`] — the numbers the cost model (HRM) consumes as is.

use super::{ExpertSet, Op, Shape};
use crate::ir::{CheckpointLayout, Role, Space};
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

/// Flops of an op for a shape (the formula of the op's table entry). Attention over
/// `context` counts QK^T and PV (4 flops per query, key and head dimension); prefill
/// attention is causal (half the square).
pub fn flops(op: &Op, card: &ModelCard, shape: &Shape) -> f64 {
    (op.def().work.flops)(op, card, shape)
}

/// Token-expert pairs an `experts` task computes, assuming uniform routing (the average
/// case; memory checks never depend on it).
pub fn routed_tokens(set: &ExpertSet, card: &ModelCard, shape: &Shape) -> f64 {
    let share = set.len(card.experts) as f64 / card.experts as f64;
    shape.tokens as f64 * card.top_k as f64 * share
}

/// Bytes an op moves through one argument (read + write), and what kind of data it is
/// (from the argument's declared type). Weights count only the tensors the op reads;
/// experts only those that can be active (`min(experts in the set, tokens x top_k)`). A
/// role the op does not declare moves its slice once.
pub fn role_traffic(
    op: &Op,
    role: Role,
    card: &ModelCard,
    shape: &Shape,
    slice_len: u64,
) -> (DataClass, f64) {
    role_traffic_in(
        op,
        role,
        card,
        &CheckpointLayout::new(card),
        shape,
        slice_len,
    )
}

/// [`role_traffic`] with the card's checkpoint layout computed by the caller
/// (`CheckpointLayout::new(card)`), for callers that cost many tasks of one card.
pub fn role_traffic_in(
    op: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    slice_len: u64,
) -> (DataClass, f64) {
    let def = op.def();
    let class = def
        .arg(role)
        .map_or(DataClass::Activations, |arg| arg.ty.class());
    (
        class,
        (def.work.bytes)(op, role, card, layout, shape, slice_len),
    )
}

/// The work of a task whose arguments live in `arg_spaces` (role, space, slice length).
pub fn work(op: &Op, card: &ModelCard, shape: &Shape, args: &[(Role, Space, u64)]) -> Work {
    work_in(op, card, &CheckpointLayout::new(card), shape, args)
}

/// [`work`] with the card's checkpoint layout computed by the caller
/// (`CheckpointLayout::new(card)`): the elaborator and the cost model cost every task of
/// one card, and building the layout per task was a sixteenth of a real-size plan's time.
pub fn work_in(
    op: &Op,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    args: &[(Role, Space, u64)],
) -> Work {
    // Weights the op reads are counted once, however many `w` arguments hold them: split
    // in proportion to the arguments' lengths, none reading more than it holds.
    let weight_len: u64 = args.iter().filter(|a| a.0 == Role::W).map(|a| a.2).sum();
    let mem = args
        .iter()
        .map(|&(role, space, len)| {
            let (class, mut bytes) = role_traffic_in(op, role, card, layout, shape, len);
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
/// on (the formula of the op's table entry): the experts' gate/up intermediates
/// (`routed tokens x ffn x 2` elements) and the attention scores of one key block (1024
/// keys) per query row and head.
pub fn workspace_bytes(op: &Op, card: &ModelCard, shape: &Shape) -> u64 {
    (op.def().work.workspace)(op, card, shape)
}
