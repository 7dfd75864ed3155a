//! Borrowed views of a model's weights as the kernels consume them.
//!
//! Gives [`LayerWeights`] (dense part + experts) and [`ModelWeights`]; every field is a
//! typed slice pointing into a memory map or any byte buffer, built here from a packed
//! layer image by its [`LayerLayout`] ([`LayerWeights::from_image`]; `checkpoint` builds
//! them straight from safetensors). Nothing here owns or converts weights.

use crate::math::mla::{KvUp, MlaWeights};
use crate::math::tensor::{CastError, Matrix, TypedSlice};
use crate::model::layout::LayerLayout;
use crate::model::segment::SegmentKind;
use crate::model::vocab::Orientation;
use crate::quant::{QuantError, QuantSlice};
use std::ops::Range;

/// Query/key/value projections: separate (Mixtral) or one fused matrix (DBRX).
#[derive(Debug, Clone, Copy)]
pub enum QkvWeights<'a> {
    /// `q_proj`, `k_proj`, `v_proj`.
    Separate {
        /// `[q_dim, hidden]`.
        q: Matrix<'a>,
        /// `[kv_dim, hidden]`.
        k: Matrix<'a>,
        /// `[kv_dim, hidden]`.
        v: Matrix<'a>,
    },
    /// `Wqkv` `[q_dim + 2 kv_dim, hidden]`, rows ordered q, k, v.
    Fused(Matrix<'a>),
    /// DeepSeek's multi-head latent attention projections.
    Mla(crate::math::mla::MlaWeights<'a>),
}

/// The dense (non-expert) weights of one layer.
#[derive(Debug, Clone, Copy)]
pub struct DenseWeights<'a> {
    /// Pre-attention norm weight.
    pub attn_norm: TypedSlice<'a>,
    /// Q/K/V projections.
    pub qkv: QkvWeights<'a>,
    /// Biases of q, k and v (`[q_dim]`, `[kv_dim]`, `[kv_dim]`), Qwen2-MoE.
    pub qkv_bias: Option<[TypedSlice<'a>; 3]>,
    /// RMSNorm weights of q and k (per head `[head_dim]` or whole `[q_dim]`/`[kv_dim]`).
    pub qk_norm: Option<[TypedSlice<'a>; 2]>,
    /// Attention sink logits `[heads]` (gpt-oss).
    pub sinks: Option<TypedSlice<'a>>,
    /// Output projection `[hidden, q_dim]`.
    pub o_proj: Matrix<'a>,
    /// Output projection bias `[hidden]` (gpt-oss).
    pub o_bias: Option<TypedSlice<'a>>,
    /// Pre-MoE norm weight.
    pub ffn_norm: TypedSlice<'a>,
    /// Router `[experts, hidden]`.
    pub router: Matrix<'a>,
    /// Router bias `[experts]` (gpt-oss).
    pub router_bias: Option<TypedSlice<'a>>,
    /// The shared expert every token runs (Qwen2-MoE), if the family has one.
    pub shared: Option<SharedExpertWeights<'a>>,
    /// MLA's `W_uv` as the `o` part holds it (`kv_b_proj`'s value rows, or llama.cpp's
    /// `attn_v_b`): it expands the latent attention output before `o_proj` (`None` without
    /// MLA).
    pub kv_b_out: Option<crate::math::mla::KvUp<'a>>,
}

/// A shared expert: a SwiGLU like a routed one (down stored out x in), optionally scaled
/// by `sigmoid(x · gate)`.
#[derive(Debug, Clone, Copy)]
pub struct SharedExpertWeights<'a> {
    /// Its gate, up and down projections.
    pub ffn: ExpertWeights<'a>,
    /// `shared_expert_gate` `[1, hidden]`.
    pub gate: Option<Matrix<'a>>,
}

/// One expert's SwiGLU feed-forward weights.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// Gate projection `[ffn, hidden]` (out, in); empty for gpt-oss (see `fused`).
    pub gate: Matrix<'a>,
    /// Up projection `[ffn, hidden]` (out, in); empty for gpt-oss (see `fused`).
    pub up: Matrix<'a>,
    /// Down projection: out x in `[hidden, ffn]` (Mixtral) or in x out `[ffn, hidden]`
    /// (DBRX, gpt-oss).
    pub down: Matrix<'a>,
    /// gpt-oss's fused interleaved gate/up and biases; `None` for the other families.
    pub fused: Option<FusedExpert<'a>>,
}

/// gpt-oss's expert parts besides `down`.
#[derive(Debug, Clone, Copy)]
pub struct FusedExpert<'a> {
    /// `gate_up_proj[e]` `[hidden, 2 ffn]` (in, out), gate and up columns interleaved.
    pub gate_up: Matrix<'a>,
    /// `gate_up_proj_bias[e]` `[2 ffn]`.
    pub gate_up_bias: TypedSlice<'a>,
    /// `down_proj_bias[e]` `[hidden]`.
    pub down_bias: TypedSlice<'a>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights<'a> {
    /// Norms, attention, router.
    pub dense: DenseWeights<'a>,
    /// Experts in index order.
    pub experts: Vec<ExpertWeights<'a>>,
}

/// The whole model.
#[derive(Debug, Clone)]
pub struct ModelWeights<'a> {
    /// Token embedding `[vocab, hidden]`.
    pub embed: Matrix<'a>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights<'a>>,
    /// Final norm weight `[hidden]`.
    pub final_norm: TypedSlice<'a>,
    /// Output projection `[vocab, hidden]` (the embedding when tied).
    pub lm_head: Matrix<'a>,
}

/// Why bytes cannot be viewed as a layer's weights.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The buffer is shorter than the layout needs.
    #[error("weight image has {got} bytes but the layout needs {needed}")]
    TooShort {
        /// Bytes needed.
        needed: usize,
        /// Bytes given.
        got: usize,
    },
    /// A segment's bytes are misaligned or not whole elements.
    #[error("segment {kind:?}: {source}")]
    Cast {
        /// The segment.
        kind: SegmentKind,
        /// The underlying cause, as the library or the OS reported it.
        source: CastError,
    },
    /// A quantised segment's bytes are not whole blocks of its format.
    #[error("segment {kind:?}: {source}")]
    Quant {
        /// The segment.
        kind: SegmentKind,
        /// What is wrong.
        source: QuantError,
    },
    /// The layout lacks a segment the family needs (a hand-built layout).
    #[error("layout has no {0:?} segment")]
    Missing(SegmentKind),
    /// An expert index past the layout's experts.
    #[error("expert {expert} out of range (layer has {n_experts})")]
    Expert {
        /// Asked for.
        expert: usize,
        /// Experts the layer has.
        n_experts: usize,
    },
}

/// Views the segment `kind` inside `bytes`, where `bytes` starts at image offset `base`.
fn view<'a>(
    layout: &LayerLayout,
    bytes: &'a [u8],
    base: usize,
    kind: SegmentKind,
) -> Result<TypedSlice<'a>, LayoutError> {
    let seg = layout.segment(kind).ok_or(LayoutError::Missing(kind))?;
    let start = seg
        .offset
        .checked_sub(base)
        .ok_or(LayoutError::Missing(kind))?;
    let raw = bytes
        .get(start..start + seg.len_bytes)
        .ok_or(LayoutError::TooShort {
            needed: start + seg.len_bytes,
            got: bytes.len(),
        })?;
    match seg.quant {
        Some(format) => QuantSlice::new(raw, format, seg.rows * seg.cols)
            .map(TypedSlice::Quant)
            .map_err(|source| LayoutError::Quant { kind, source }),
        None => TypedSlice::from_bytes(raw, seg.dtype)
            .map_err(|source| LayoutError::Cast { kind, source }),
    }
}

fn matrix<'a>(
    layout: &LayerLayout,
    bytes: &'a [u8],
    base: usize,
    kind: SegmentKind,
) -> Result<Matrix<'a>, LayoutError> {
    let data = view(layout, bytes, base, kind)?;
    let seg = layout.segment(kind).ok_or(LayoutError::Missing(kind))?;
    let orientation = seg.orientation.unwrap_or(Orientation::OutIn);
    Matrix::new(data, seg.rows, seg.cols, orientation).ok_or(LayoutError::Missing(kind))
}

impl<'a> DenseWeights<'a> {
    /// Views the dense part; `bytes` holds the image's [`LayerLayout::dense_range`]
    /// (which starts at image offset 0), e.g. a copy of it in another memory space.
    pub fn from_bytes(bytes: &'a [u8], layout: &LayerLayout) -> Result<Self, LayoutError> {
        let has = |kind| layout.segment(kind).is_some();
        let qkv = match layout.family {
            _ if layout.family.facts().fused_qkv => {
                QkvWeights::Fused(matrix(layout, bytes, 0, SegmentKind::QkvProj)?)
            }
            _ if has(SegmentKind::KvAProj) => QkvWeights::Mla(MlaWeights::build(
                has(SegmentKind::QAProj),
                has(SegmentKind::KB),
                |kind| matrix(layout, bytes, 0, kind),
            )?),
            _ => QkvWeights::Separate {
                q: matrix(layout, bytes, 0, SegmentKind::QProj)?,
                k: matrix(layout, bytes, 0, SegmentKind::KProj)?,
                v: matrix(layout, bytes, 0, SegmentKind::VProj)?,
            },
        };
        let vector = |kind| -> Result<Option<TypedSlice<'a>>, LayoutError> {
            if has(kind) {
                view(layout, bytes, 0, kind).map(Some)
            } else {
                Ok(None)
            }
        };
        let qkv_bias = match (
            vector(SegmentKind::QBias)?,
            vector(SegmentKind::KBias)?,
            vector(SegmentKind::VBias)?,
        ) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            _ => None,
        };
        let qk_norm = match (vector(SegmentKind::QNorm)?, vector(SegmentKind::KNorm)?) {
            (Some(q), Some(k)) => Some([q, k]),
            _ => None,
        };
        let shared = if has(SegmentKind::SharedGate) {
            Some(SharedExpertWeights {
                ffn: ExpertWeights {
                    gate: matrix(layout, bytes, 0, SegmentKind::SharedGate)?,
                    up: matrix(layout, bytes, 0, SegmentKind::SharedUp)?,
                    down: matrix(layout, bytes, 0, SegmentKind::SharedDown)?,
                    fused: None,
                },
                gate: if has(SegmentKind::SharedExpertGate) {
                    Some(matrix(layout, bytes, 0, SegmentKind::SharedExpertGate)?)
                } else {
                    None
                },
            })
        } else if has(SegmentKind::DenseGate) {
            // A dense layer's SwiGLU runs where a shared expert would: on every token.
            Some(SharedExpertWeights {
                ffn: ExpertWeights {
                    gate: matrix(layout, bytes, 0, SegmentKind::DenseGate)?,
                    up: matrix(layout, bytes, 0, SegmentKind::DenseUp)?,
                    down: matrix(layout, bytes, 0, SegmentKind::DenseDown)?,
                    fused: None,
                },
                gate: None,
            })
        } else {
            None
        };
        Ok(DenseWeights {
            attn_norm: view(layout, bytes, 0, SegmentKind::AttnNorm)?,
            qkv,
            qkv_bias,
            qk_norm,
            sinks: vector(SegmentKind::Sinks)?,
            o_proj: matrix(layout, bytes, 0, SegmentKind::OProj)?,
            o_bias: vector(SegmentKind::OBias)?,
            ffn_norm: view(layout, bytes, 0, SegmentKind::FfnNorm)?,
            router: if layout.dense_ffn {
                Matrix::empty()
            } else {
                matrix(layout, bytes, 0, SegmentKind::Router)?
            },
            router_bias: vector(SegmentKind::RouterBias)?,
            shared,
            kv_b_out: if has(SegmentKind::KvBOut) || has(SegmentKind::VB) {
                Some(KvUp::values(has(SegmentKind::VB), |kind| {
                    matrix(layout, bytes, 0, kind)
                })?)
            } else {
                None
            },
        })
    }
}

impl<'a> ExpertWeights<'a> {
    /// Views expert `expert`; `bytes` holds exactly its [`LayerLayout::expert_range`]
    /// (wherever that copy lives).
    pub fn from_bytes(
        bytes: &'a [u8],
        layout: &LayerLayout,
        expert: usize,
    ) -> Result<Self, LayoutError> {
        if expert >= layout.n_experts {
            return Err(LayoutError::Expert {
                expert,
                n_experts: layout.n_experts,
            });
        }
        let base = layout.expert_range(expert).start;
        if layout.segment(SegmentKind::ExpertGateUp(expert)).is_some() {
            return Ok(ExpertWeights {
                gate: Matrix::empty(),
                up: Matrix::empty(),
                down: matrix(layout, bytes, base, SegmentKind::ExpertDown(expert))?,
                fused: Some(FusedExpert {
                    gate_up: matrix(layout, bytes, base, SegmentKind::ExpertGateUp(expert))?,
                    gate_up_bias: view(layout, bytes, base, SegmentKind::ExpertGateUpBias(expert))?,
                    down_bias: view(layout, bytes, base, SegmentKind::ExpertDownBias(expert))?,
                }),
            });
        }
        Ok(ExpertWeights {
            gate: matrix(layout, bytes, base, SegmentKind::ExpertGate(expert))?,
            up: matrix(layout, bytes, base, SegmentKind::ExpertUp(expert))?,
            down: matrix(layout, bytes, base, SegmentKind::ExpertDown(expert))?,
            fused: None,
        })
    }
}

impl<'a> LayerWeights<'a> {
    /// Views a whole layer image (at least `layout.image_bytes` bytes, base aligned to the
    /// widest element used, which any `Vec<f32>`/page-aligned buffer is).
    pub fn from_image(bytes: &'a [u8], layout: &LayerLayout) -> Result<Self, LayoutError> {
        if bytes.len() < layout.image_bytes {
            return Err(LayoutError::TooShort {
                needed: layout.image_bytes,
                got: bytes.len(),
            });
        }
        // `get` rather than indexing: a hand-built layout may describe ranges past its
        // own `image_bytes`.
        let part = |range: Range<usize>| {
            let needed = range.end;
            bytes.get(range).ok_or(LayoutError::TooShort {
                needed,
                got: bytes.len(),
            })
        };
        let dense = DenseWeights::from_bytes(part(layout.dense_range())?, layout)?;
        let experts = (0..layout.n_experts)
            .map(|e| ExpertWeights::from_bytes(part(layout.expert_range(e))?, layout, e))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LayerWeights { dense, experts })
    }
}
