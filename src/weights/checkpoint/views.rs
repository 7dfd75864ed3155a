//! The typed views of an opened checkpoint as the kernels read them: each layer's
//! [`LayerWeights`], the model's [`ModelWeights`], the head's stored tensors, and byte
//! copies of a layer into its packed image. Opening and checking the files is the
//! parent's job ([`super::Checkpoint::open`]); this half only reads what it checked.

use super::{Checkpoint, CheckpointError, HeadTensors, StoredTensor};
use crate::math::mla::{KvUp, MlaWeights};
use crate::math::tensor::{Matrix, TypedSlice};
use crate::math::views::{
    DenseWeights, ExpertWeights, FusedExpert, LayerWeights, ModelWeights, QkvWeights,
    SharedExpertWeights,
};
use crate::model::card::QkNorm;
use crate::model::formats::WeightTensor;
use crate::model::layout::{ImageBuffer, LayerLayout, Segment};
use crate::model::segment::SegmentKind;
use crate::model::vocab::Orientation;
use crate::quant::storage::{Storage, WeightDtype};
use crate::quant::QuantSlice;
use crate::weights::family::hub::Source;
use crate::weights::names::{head_names, segment_source};
use std::collections::BTreeMap;

impl Checkpoint {
    /// `src`'s part of its tensor's `bytes` (stored as `dtype`) and its column count: a
    /// vector whole; a matrix's `src.rows`, with the rows over the leading dimensions
    /// flattened (gpt-oss's 3-D expert tensors are `[experts * in, out]` this way) and the
    /// tensor's own last dimension as the row width (checked against the card, not the
    /// layout's); `None` when those rows run past the bytes.
    fn rows_of<'b>(
        &self,
        src: &Source,
        bytes: &'b [u8],
        dtype: WeightDtype,
    ) -> (Option<&'b [u8]>, usize) {
        let cols = src.shape.last().copied().unwrap_or(1);
        if src.shape.len() == 1 {
            return (Some(bytes), cols);
        }
        let row_bytes = self
            .tensors
            .get(&src.name)
            .and_then(|e| e.row_bytes(cols, dtype))
            .unwrap_or(0);
        (
            bytes.get(src.rows.start * row_bytes..src.rows.end * row_bytes),
            cols,
        )
    }

    /// Typed view of `src` and its column count (a vector's length for 1-D tensors).
    pub(super) fn view(&self, src: &Source) -> Result<(TypedSlice<'_>, usize), CheckpointError> {
        let (bytes, dtype, path) = self.checked(&src.name, &src.shape)?;
        let quant = self.tensors.get(&src.name).and_then(|e| e.quant);
        let bytes = match quant {
            // Blocks are bytes: any address will do.
            Some(_) => bytes,
            None => self.aligned_bytes(&src.name, bytes, dtype),
        };
        let (rows, cols) = self.rows_of(src, bytes, dtype);
        let bytes = rows.unwrap_or_default();
        if let Some(format) = quant {
            let elems = if src.shape.len() == 1 {
                cols
            } else {
                src.rows.len() * cols
            };
            let slice =
                QuantSlice::new(bytes, format, elems).map_err(|e| CheckpointError::Shape {
                    path: path.display().to_string(),
                    tensor: format!("{} ({e})", src.name),
                    expected: src.shape.clone(),
                    got: vec![bytes.len()],
                })?;
            return Ok((TypedSlice::Quant(slice), cols));
        }
        // `aligned_bytes` made the start aligned and rows are whole elements, so this fails
        // only on a length that is not whole elements: a shape the header contradicts.
        let slice = TypedSlice::from_bytes(bytes, dtype).map_err(|_| CheckpointError::Shape {
            path: path.display().to_string(),
            tensor: src.name.clone(),
            expected: src.shape.clone(),
            got: vec![bytes.len() / dtype.bytes() as usize],
        })?;
        Ok((slice, cols))
    }

    pub(super) fn matrix(
        &self,
        src: &Source,
        orientation: Orientation,
    ) -> Result<Matrix<'_>, CheckpointError> {
        let (data, cols) = self.view(src)?;
        let rows = src.rows.len();
        Matrix::new(data, rows, cols, orientation).ok_or_else(|| CheckpointError::Shape {
            path: self.dir.display().to_string(),
            tensor: src.name.clone(),
            expected: vec![rows, cols],
            got: src.shape.clone(),
        })
    }

    /// Where segment `kind` of layer `layer` lives in the checkpoint.
    pub(super) fn source(&self, layer: usize, kind: SegmentKind) -> Source {
        segment_source(&self.arch, layer, kind)
    }

    pub(super) fn segment_matrix(
        &self,
        layer: usize,
        kind: SegmentKind,
    ) -> Result<Matrix<'_>, CheckpointError> {
        let (_, _, orientation) = LayerLayout::shape_of(&self.arch, kind);
        self.matrix(
            &self.source(layer, kind),
            orientation.unwrap_or(Orientation::OutIn),
        )
    }

    pub(super) fn segment_vector(
        &self,
        layer: usize,
        kind: SegmentKind,
    ) -> Result<TypedSlice<'_>, CheckpointError> {
        Ok(self.view(&self.source(layer, kind))?.0)
    }

    pub(super) fn check_layer(&self, layer: usize) -> Result<(), CheckpointError> {
        if layer >= self.arch.layers {
            return Err(CheckpointError::Layer {
                layer,
                layers: self.arch.layers,
            });
        }
        Ok(())
    }

    /// Zero-copy views of layer `layer`, straight from the memory map.
    pub fn layer_weights(&self, layer: usize) -> Result<LayerWeights<'_>, CheckpointError> {
        self.check_layer(layer)?;
        let qkv = match (self.arch.family, self.arch.mla) {
            _ if self.arch.family.facts().fused_qkv => {
                QkvWeights::Fused(self.segment_matrix(layer, SegmentKind::QkvProj)?)
            }
            (_, Some(m)) => QkvWeights::Mla(MlaWeights::build(
                m.q_lora_rank.is_some(),
                m.kv_b_split,
                |kind| self.segment_matrix(layer, kind),
            )?),
            _ => QkvWeights::Separate {
                q: self.segment_matrix(layer, SegmentKind::QProj)?,
                k: self.segment_matrix(layer, SegmentKind::KProj)?,
                v: self.segment_matrix(layer, SegmentKind::VProj)?,
            },
        };
        let a = &self.arch;
        let qkv_bias = if a.qkv_bias {
            Some([
                self.segment_vector(layer, SegmentKind::QBias)?,
                self.segment_vector(layer, SegmentKind::KBias)?,
                self.segment_vector(layer, SegmentKind::VBias)?,
            ])
        } else {
            None
        };
        let qk_norm = if a.qk_norm != QkNorm::None {
            Some([
                self.segment_vector(layer, SegmentKind::QNorm)?,
                self.segment_vector(layer, SegmentKind::KNorm)?,
            ])
        } else {
            None
        };
        let dense_layer = a.is_dense(layer);
        let shared = if dense_layer {
            // A leading dense layer's SwiGLU runs where a shared expert would: every token.
            Some(SharedExpertWeights {
                ffn: ExpertWeights {
                    gate: self.segment_matrix(layer, SegmentKind::DenseGate)?,
                    up: self.segment_matrix(layer, SegmentKind::DenseUp)?,
                    down: self.segment_matrix(layer, SegmentKind::DenseDown)?,
                    fused: None,
                },
                gate: None,
            })
        } else if a.shared_ffn > 0 {
            Some(SharedExpertWeights {
                ffn: ExpertWeights {
                    gate: self.segment_matrix(layer, SegmentKind::SharedGate)?,
                    up: self.segment_matrix(layer, SegmentKind::SharedUp)?,
                    down: self.segment_matrix(layer, SegmentKind::SharedDown)?,
                    fused: None,
                },
                gate: if a.shared_gate {
                    Some(self.segment_matrix(layer, SegmentKind::SharedExpertGate)?)
                } else {
                    None
                },
            })
        } else {
            None
        };
        let optional = |present: bool, kind| -> Result<Option<TypedSlice<'_>>, CheckpointError> {
            if present {
                self.segment_vector(layer, kind).map(Some)
            } else {
                Ok(None)
            }
        };
        let dense = DenseWeights {
            attn_norm: self.segment_vector(layer, SegmentKind::AttnNorm)?,
            qkv,
            qkv_bias,
            qk_norm,
            sinks: optional(a.attn.sinks, SegmentKind::Sinks)?,
            o_proj: self.segment_matrix(layer, SegmentKind::OProj)?,
            o_bias: optional(a.o_bias, SegmentKind::OBias)?,
            ffn_norm: self.segment_vector(layer, SegmentKind::FfnNorm)?,
            router: if dense_layer {
                Matrix::empty()
            } else {
                self.segment_matrix(layer, SegmentKind::Router)?
            },
            router_bias: optional(!dense_layer && a.has_router_bias(), SegmentKind::RouterBias)?,
            shared,
            kv_b_out: a
                .mla
                .map(|m| KvUp::values(m.kv_b_split, |kind| self.segment_matrix(layer, kind)))
                .transpose()?,
        };
        let routed = if dense_layer { 0 } else { self.arch.experts };
        let experts = (0..routed)
            .map(|e| {
                if a.clamped_swiglu.is_some() {
                    return Ok(ExpertWeights {
                        gate: Matrix::empty(),
                        up: Matrix::empty(),
                        down: self.segment_matrix(layer, SegmentKind::ExpertDown(e))?,
                        fused: Some(FusedExpert {
                            gate_up: self.segment_matrix(layer, SegmentKind::ExpertGateUp(e))?,
                            gate_up_bias: self
                                .segment_vector(layer, SegmentKind::ExpertGateUpBias(e))?,
                            down_bias: self
                                .segment_vector(layer, SegmentKind::ExpertDownBias(e))?,
                        }),
                    });
                }
                Ok(ExpertWeights {
                    gate: self.segment_matrix(layer, SegmentKind::ExpertGate(e))?,
                    up: self.segment_matrix(layer, SegmentKind::ExpertUp(e))?,
                    down: self.segment_matrix(layer, SegmentKind::ExpertDown(e))?,
                    fused: None,
                })
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        Ok(LayerWeights { dense, experts })
    }

    /// Where the embedding table, the final norm and the lm_head live (the lm_head is the
    /// embedding when a tied checkpoint (`tie_word_embeddings = true`) ships none).
    pub(super) fn head_sources(&self) -> (Source, Source, Source) {
        let a = &self.arch;
        let (embed, norm) = head_names(a.family);
        let table = |name: &str| Source {
            name: name.into(),
            shape: vec![a.vocab, a.hidden],
            rows: 0..a.vocab,
        };
        let lm_head = if !self.tensors.contains_key("lm_head.weight") && self.ties_embeddings() {
            table(embed)
        } else {
            table("lm_head.weight")
        };
        let norm = Source {
            name: norm.into(),
            shape: vec![a.hidden],
            rows: 0..a.hidden,
        };
        (table(embed), norm, lm_head)
    }

    /// Zero-copy views of the whole model (every tensor's name, shape and dtype checked).
    pub fn model_weights(&self) -> Result<ModelWeights<'_>, CheckpointError> {
        let (embed, norm, lm_head) = self.head_sources();
        let embed = self.matrix(&embed, Orientation::OutIn)?;
        let lm_head = self.matrix(&lm_head, Orientation::OutIn)?;
        let final_norm = self.view(&norm)?.0;
        let layers = (0..self.arch.layers)
            .map(|l| self.layer_weights(l))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ModelWeights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// The stored bytes of the embedding, final norm and lm_head, straight from the memory
    /// maps (names, shapes and dtypes checked; alignment is not required).
    pub fn head_tensors(&self) -> Result<HeadTensors<'_>, CheckpointError> {
        let (embed, norm, lm_head) = self.head_sources();
        let stored = |src: &Source| -> Result<StoredTensor<'_>, CheckpointError> {
            let (bytes, dtype, _) = self.checked(&src.name, &src.shape)?;
            let quant = self.tensors.get(&src.name).and_then(|e| e.quant);
            Ok(StoredTensor {
                bytes,
                dtype,
                quant,
            })
        };
        Ok(HeadTensors {
            embed: stored(&embed)?,
            final_norm: stored(&norm)?,
            lm_head: stored(&lm_head)?,
        })
    }

    pub(super) fn ties_embeddings(&self) -> bool {
        crate::textfile::read_capped(&self.dir.join("config.json"), crate::textfile::CONFIG_LIMIT)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("tie_word_embeddings").and_then(|b| b.as_bool()))
            .unwrap_or(false)
    }

    /// The packed-image layout of layer `layer`, with each segment in its stored format,
    /// in the slot the card's formats give it (a GGUF's widest format of that tensor over
    /// the layers), so every layer's image has the same offsets.
    pub fn layer_layout(&self, layer: usize) -> Result<LayerLayout, CheckpointError> {
        self.check_layer(layer)?;
        let mut stored = BTreeMap::new();
        for kind in LayerLayout::kinds(&self.arch, layer) {
            let src = self.source(layer, kind);
            // The entry only: an MXFP4 tensor is not decoded to learn its dtype.
            let (entry, dtype, _) = self.checked_entry(&src.name, &src.shape)?;
            let storage = entry.quant.map_or(Storage::Float(dtype), Storage::Quant);
            stored.insert(kind, storage);
        }
        let card = &self.card;
        Ok(LayerLayout::with_storage(
            &self.arch,
            layer,
            |k| card.storage(WeightTensor::layer(k)),
            |k| {
                stored
                    .get(&k)
                    .copied()
                    .unwrap_or_else(|| card.storage(WeightTensor::layer(k)))
            },
        ))
    }

    /// The stored bytes of segment `seg` of layer `layer`, straight from the memory map: the
    /// whole tensor, or for a DBRX expert its rows of the fused expert tensor (contiguous).
    /// The dtype must be `seg.dtype` and the length `seg.len_bytes`; alignment is not
    /// required. `seg` must come from [`Checkpoint::layer_layout`].
    pub fn segment_bytes(&self, layer: usize, seg: &Segment) -> Result<&[u8], CheckpointError> {
        self.check_layer(layer)?;
        let src = self.source(layer, seg.kind);
        let (bytes, dtype, path) = self.checked(&src.name, &src.shape)?;
        let entry_quant = self.tensors.get(&src.name).and_then(|e| e.quant);
        if dtype != seg.dtype || entry_quant != seg.quant {
            return Err(CheckpointError::Dtype {
                path: path.display().to_string(),
                tensor: src.name,
                dtype: format!("{dtype:?} (layout expects {:?})", seg.dtype),
            });
        }
        let (part, _) = self.rows_of(&src, bytes, dtype);
        match part.filter(|p| p.len() == seg.len_bytes) {
            Some(part) => Ok(part),
            None => Err(CheckpointError::Shape {
                path: path.display().to_string(),
                tensor: src.name,
                expected: vec![seg.rows, seg.cols],
                got: src.shape.clone(),
            }),
        }
    }

    /// Copies layer `layer`'s tensors byte for byte into `dst` at `layout`'s offsets
    /// (padding is zeroed). `layout` must come from [`Checkpoint::layer_layout`].
    pub fn copy_layer_image(
        &self,
        layer: usize,
        layout: &LayerLayout,
        dst: &mut [u8],
    ) -> Result<(), CheckpointError> {
        self.check_layer(layer)?;
        if dst.len() < layout.image_bytes {
            return Err(CheckpointError::ImageBuffer {
                needed: layout.image_bytes,
                got: dst.len(),
            });
        }
        dst[..layout.image_bytes].fill(0);
        for seg in &layout.segments {
            let part = self.segment_bytes(layer, seg)?;
            let Some(slot) = dst.get_mut(seg.range()) else {
                return Err(CheckpointError::ImageBuffer {
                    needed: seg.range().end,
                    got: dst.len(),
                });
            };
            slot.copy_from_slice(part);
        }
        Ok(())
    }

    /// Layout and a freshly copied image of layer `layer`.
    pub fn layer_image(&self, layer: usize) -> Result<(LayerLayout, ImageBuffer), CheckpointError> {
        let layout = self.layer_layout(layer)?;
        let mut image = ImageBuffer::zeroed(layout.image_bytes);
        self.copy_layer_image(layer, &layout, image.as_bytes_mut())?;
        Ok((layout, image))
    }
}
