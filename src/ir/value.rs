//! Logical tensors: what a buffer's bytes mean at a point of the issue order.
//!
//! Takes a checkpoint layout; gives [`Tensor`] (the value lattice the checker tracks),
//! human-readable names for diagnostics, and [`checkpoint_pieces`], which splits a byte
//! range of the checkpoint `W` into the weight tensors it covers. A [`Piece`] is "bytes of
//! tensor T starting at offset k", so copies of pages keep exact provenance.

use super::expert::ExpertRef;
use super::CheckpointLayout;
use serde::{Deserialize, Serialize};

/// Where in a layer a residual stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Point {
    /// The input of the layer (after the previous layer; layer 0: the embedding).
    In,
    /// After the layer's attention block (o_proj + residual), before its MoE block.
    Mid,
}

/// Which rows of a micro-batch an attention output covers. In a `prefill` step every row
/// is a prefill row, in a `decode` step a decode row; a mixed `step` has both kinds, and
/// `attn(part = prefill)` and `attn(part = decode)` each produce their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Rows {
    /// Every row.
    All,
    /// The prefill tokens' rows.
    Prefill,
    /// The decode tokens' rows.
    Decode,
}

/// A logical tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Tensor {
    /// The token embedding table.
    Embedding,
    /// Final norm + lm_head.
    Head,
    /// A layer's input norm and Q/K/V projections (DBRX: fused Wqkv).
    Pre {
        /// Layer.
        layer: u32,
    },
    /// A layer's O projection.
    O {
        /// Layer.
        layer: u32,
    },
    /// A layer's post-attention norm and router (and shared expert); a dense layer's
    /// post-attention norm and SwiGLU.
    Gate {
        /// Layer.
        layer: u32,
    },
    /// One expert of a layer.
    Expert {
        /// Layer.
        layer: u32,
        /// Which expert (possibly known only at run time).
        expert: ExpertRef,
    },
    /// One expert of a layer in another format than the checkpoint's
    /// (`W[l].expert(e).format(q4_k)`): a lossy copy, never equal to [`Tensor::Expert`].
    ExpertIn {
        /// Layer.
        layer: u32,
        /// Which expert.
        expert: ExpertRef,
        /// The format's ggml type id (`quant::storage::Storage::ggml`).
        format: u32,
        /// Bytes of the expert in that format, padding included.
        bytes: u64,
    },
    /// The residual stream of a micro-batch at `point` of layer `layer` (`layer ==
    /// layers, In` is the final hidden state).
    Residual {
        /// Micro-batch.
        ub: u32,
        /// Layer.
        layer: u32,
        /// Before or in the middle of the layer.
        point: Point,
    },
    /// Q, K, V of a micro-batch for a layer.
    Qkv {
        /// Layer.
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Attention output (before o_proj), for some of the micro-batch's rows.
    AttnOut {
        /// Layer.
        layer: u32,
        /// Micro-batch.
        ub: u32,
        /// Which rows: written by `attn(part = ...)`; readers need all of them.
        rows: Rows,
    },
    /// The KV cache of a layer for a micro-batch.
    KvCache {
        /// Layer.
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Router decisions.
    Routing {
        /// Layer.
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Lookahead routing (`pregate`): layer `layer`'s router over the hidden state entering
    /// layer `layer - 1`'s MoE block; a prediction, read only by cache predictors.
    Lookahead {
        /// The layer predicted.
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Partial sum of expert outputs.
    ExpertAcc {
        /// Layer.
        layer: u32,
        /// Micro-batch.
        ub: u32,
    },
    /// Logits.
    Logits {
        /// Micro-batch.
        ub: u32,
    },
    /// Sampled token ids.
    Tokens {
        /// Micro-batch.
        ub: u32,
    },
}

impl Tensor {
    /// True for model weights (fixed size, located inside an argument by offset).
    pub fn is_weight(&self) -> bool {
        matches!(
            self,
            Tensor::Embedding
                | Tensor::Head
                | Tensor::Pre { .. }
                | Tensor::O { .. }
                | Tensor::Gate { .. }
                | Tensor::Expert { .. }
                | Tensor::ExpertIn { .. }
        )
    }

    /// Size of a weight tensor; `None` for activations (their size is the slice's). A
    /// layer's `gate` part has its own layer's size (a dense layer's holds its SwiGLU).
    pub fn weight_bytes(&self, layout: &CheckpointLayout) -> Option<u64> {
        Some(match self {
            Tensor::Embedding => layout.embed_bytes,
            Tensor::Head => layout.head_bytes,
            Tensor::Pre { .. } => layout.pre_bytes,
            Tensor::O { .. } => layout.o_bytes,
            Tensor::Gate { layer } => layout.gate_bytes_of(u64::from(*layer)),
            Tensor::Expert { .. } => layout.expert_bytes,
            Tensor::ExpertIn { bytes, .. } => *bytes,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tensor::Embedding => write!(f, "W.embed"),
            Tensor::Head => write!(f, "W.head"),
            Tensor::Pre { layer } => write!(f, "W[{layer}].pre"),
            Tensor::O { layer } => write!(f, "W[{layer}].o"),
            Tensor::Gate { layer } => write!(f, "W[{layer}].gate"),
            Tensor::Expert { layer, expert } => write!(f, "W[{layer}].expert({expert})"),
            Tensor::ExpertIn {
                layer,
                expert,
                format,
                ..
            } => write!(
                f,
                "W[{layer}].expert({expert}).format({})",
                format_name(*format)
            ),
            Tensor::Residual {
                ub,
                layer,
                point: Point::In,
            } => {
                write!(f, "hidden of ub {ub} entering layer {layer}")
            }
            Tensor::Residual {
                ub,
                layer,
                point: Point::Mid,
            } => {
                write!(f, "hidden of ub {ub} after attention of layer {layer}")
            }
            Tensor::Qkv { layer, ub } => write!(f, "qkv of layer {layer}, ub {ub}"),
            Tensor::AttnOut { layer, ub, rows } => {
                let which = match rows {
                    Rows::All => "",
                    Rows::Prefill => " (prefill rows)",
                    Rows::Decode => " (decode rows)",
                };
                write!(f, "attention output of layer {layer}, ub {ub}{which}")
            }
            Tensor::KvCache { layer, ub } => write!(f, "kv cache of layer {layer}, ub {ub}"),
            Tensor::Routing { layer, ub } => write!(f, "routing of layer {layer}, ub {ub}"),
            Tensor::Lookahead { layer, ub } => {
                write!(f, "lookahead routing of layer {layer}, ub {ub}")
            }
            Tensor::ExpertAcc { layer, ub } => write!(f, "expert sum of layer {layer}, ub {ub}"),
            Tensor::Logits { ub } => write!(f, "logits of ub {ub}"),
            Tensor::Tokens { ub } => write!(f, "tokens of ub {ub}"),
        }
    }
}

/// The name of the format with ggml type id `id` (`q4_k`), as the language writes it.
pub fn format_name(id: u32) -> String {
    crate::model::Storage::from_ggml_type(id)
        .map_or_else(|| format!("type {id}"), |s| s.name().to_ascii_lowercase())
}

/// Splits `[start, start + len)` of a format copy of the experts (`BufferKind::FormatCopy`,
/// `expert_bytes` per expert in `format`) into the experts it covers.
pub fn format_copy_pieces(
    layout: &CheckpointLayout,
    format: u32,
    expert_bytes: u64,
    start: u64,
    len: u64,
) -> Vec<(u64, u64, Piece)> {
    let eb = expert_bytes.max(1);
    let experts = layout.experts.max(1);
    let end = start + len;
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let slot = at / eb;
        let slot_end = ((slot + 1) * eb).min(end);
        let tensor = Tensor::ExpertIn {
            layer: (layout.dense_layers + slot / experts) as u32,
            expert: ExpertRef::Index((slot % experts) as u32),
            format,
            bytes: expert_bytes,
        };
        out.push((
            at - start,
            slot_end - at,
            Piece {
                tensor,
                offset: at - slot * eb,
            },
        ));
        at = slot_end;
    }
    out
}

/// `len` bytes of `tensor` starting at byte `offset` of the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Piece {
    /// The tensor.
    pub tensor: Tensor,
    /// Offset inside the tensor of the piece's first byte.
    pub offset: u64,
}

/// Splits `[start, start + len)` of the checkpoint into `(slice_offset, len, piece)` runs.
/// With `dynamic_expert`, the slice is that whole expert of the layer at `start`.
pub fn checkpoint_pieces(
    layout: &CheckpointLayout,
    start: u64,
    len: u64,
    dynamic_expert: Option<ExpertRef>,
) -> Vec<(u64, u64, Piece)> {
    if let Some(expert) = dynamic_expert {
        let layer = layout.layer_at(start).unwrap_or_default();
        let tensor = Tensor::Expert {
            layer: layer as u32,
            expert,
        };
        return vec![(0, len, Piece { tensor, offset: 0 })];
    }
    // The tensors in checkpoint order, as (first byte, length, tensor), generated lazily
    // around the requested range so a small slice of a big model stays cheap.
    let mut out = Vec::new();
    let end = start + len;
    let mut push = |t_start: u64, t_len: u64, tensor: Tensor| {
        let lo = t_start.max(start);
        let hi = (t_start + t_len).min(end);
        if lo < hi {
            out.push((
                lo - start,
                hi - lo,
                Piece {
                    tensor,
                    offset: lo - t_start,
                },
            ));
        }
    };
    push(0, layout.embed_bytes, Tensor::Embedding);
    let last = layout.layers.saturating_sub(1);
    let first_layer = layout
        .layer_at(start)
        .unwrap_or(if start < layout.embed_bytes { 0 } else { last });
    let last_layer = layout
        .layer_at(end.saturating_sub(1))
        .unwrap_or(if end <= layout.embed_bytes { 0 } else { last });
    for layer in first_layer..=last_layer {
        if layer >= layout.layers {
            break;
        }
        let base = layout.layer_offset(layer);
        let l = layer as u32;
        push(base, layout.pre_bytes, Tensor::Pre { layer: l });
        push(
            base + layout.pre_bytes,
            layout.o_bytes,
            Tensor::O { layer: l },
        );
        push(
            base + layout.pre_bytes + layout.o_bytes,
            layout.gate_bytes_of(layer),
            Tensor::Gate { layer: l },
        );
        let experts = layout.experts_of(layer);
        let experts_base = base + layout.dense_bytes_of(layer);
        let eb = layout.expert_bytes.max(1);
        let first_e = start.saturating_sub(experts_base) / eb;
        let last_e = (end.saturating_sub(experts_base) / eb).min(experts.saturating_sub(1));
        for e in first_e..=last_e {
            if e >= experts {
                break;
            }
            push(
                experts_base + e * layout.expert_bytes,
                layout.expert_bytes,
                Tensor::Expert {
                    layer: l,
                    expert: ExpertRef::Index(e as u32),
                },
            );
        }
    }
    push(layout.head_offset(), layout.head_bytes, Tensor::Head);
    out.sort_by_key(|(offset, _, _)| *offset);
    out
}
