//! Buffers: what a buffer is ([`Buffer`]), how its bytes are organised ([`Layout`]), where
//! it comes from ([`BufferKind`]: the checkpoint `W`, a copy of its experts in another
//! format made at load, or a `buffer` declaration), the lossy substitutes that let tasks
//! read those format copies ([`Substitute`]), and the byte layout of the checkpoint itself
//! ([`CheckpointLayout`]). Re-exported from [`crate::ir`].

use crate::model::card::ModelCard;
use serde::{Deserialize, Serialize};

use super::Space;

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
