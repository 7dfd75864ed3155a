//! The canonical packed image of one decoder layer's weights, and typed views into it.
//!
//! Takes an [`ArchSpec`] and the stored dtype of each tensor; gives a [`LayerLayout`]:
//! named segments with byte offsets, shapes, dtype and orientation, dense part first
//! (norms, attention with its biases and q/k norms, router, shared expert) then the routed
//! experts expert-major, so one expert is one contiguous byte range. The image holds the checkpoint tensors' raw bytes (building it
//! is byte copies only, see `Checkpoint::copy_layer_image`); every segment starts on a
//! [`SEGMENT_ALIGN`]-byte boundary relative to the image start. The typed views into an
//! image (`crate::math::views::LayerWeights::from_image`, which validates sizes and
//! alignment and never panics) sit with the kernels that read them, so the runtime can copy
//! byte ranges of an image between memory spaces and compute from the copy.

use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::card::{Family, QkNorm};
use crate::model::family;
use crate::model::formats::WeightTensor;
use crate::model::vocab::Orientation;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use std::ops::Range;

/// Alignment of every segment inside an image (a cache line; enough for any dtype/SIMD).
pub const SEGMENT_ALIGN: usize = 64;

/// What a segment of the layer image holds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum SegmentKind {
    /// Pre-attention norm weight `[hidden]`.
    AttnNorm,
    /// Mixtral `q_proj` `[q_dim, hidden]`.
    QProj,
    /// Mixtral `k_proj` `[kv_dim, hidden]`.
    KProj,
    /// Mixtral `v_proj` `[kv_dim, hidden]`.
    VProj,
    /// DBRX fused `Wqkv` `[q_dim + 2 kv_dim, hidden]`.
    QkvProj,
    /// `q_proj` bias `[q_dim]` (Qwen2-MoE).
    QBias,
    /// `k_proj` bias `[kv_dim]`.
    KBias,
    /// `v_proj` bias `[kv_dim]`.
    VBias,
    /// Attention sinks `[heads]` (gpt-oss).
    Sinks,
    /// q RMSNorm weight: `[head_dim]` per head (Qwen3) or `[q_dim]` (OLMoE).
    QNorm,
    /// k RMSNorm weight: `[head_dim]` per head (Qwen3) or `[kv_dim]` (OLMoE).
    KNorm,
    /// MLA query down-projection `q_a_proj` `[q_lora_rank, hidden]` (DeepSeek with a
    /// query rank).
    QAProj,
    /// MLA `q_a_layernorm` `[q_lora_rank]`.
    QANorm,
    /// MLA query up-projection `q_b_proj` `[heads * qk_head_dim, q_lora_rank]`.
    QBProj,
    /// MLA `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    KvAProj,
    /// MLA `kv_a_layernorm` `[kv_lora_rank]`.
    KvANorm,
    /// MLA `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]` in the
    /// `pre` part: its key rows are folded into the queries.
    KvB,
    /// The same `kv_b_proj` again in the `o` part: its value rows expand the attention
    /// output before `o_proj` (the `o` op reads only its own part of `W`).
    KvBOut,
    /// llama.cpp's `attn_k_b` `[heads * kv_lora_rank, qk_nope_head_dim]` in the `pre` part
    /// of a checkpoint that stores `kv_b_proj` split (`Mla::kv_b_split`): per head,
    /// `kv_lora_rank` rows of `qk_nope_head_dim` weights (`W_uk_h` transposed), so
    /// `q_nope W_uk_h` is an out-in product with it as stored.
    KB,
    /// llama.cpp's `attn_v_b` `[heads * v_head_dim, kv_lora_rank]` in the `o` part of such a
    /// checkpoint: per head, `v_head_dim` rows of `kv_lora_rank` weights (`W_uv_h`).
    VB,
    /// Output projection `[hidden, q_dim]` (MLA: `[hidden, heads * v_head_dim]`).
    OProj,
    /// Output projection bias `[hidden]` (gpt-oss).
    OBias,
    /// Pre-MoE norm weight `[hidden]`.
    FfnNorm,
    /// Router `[experts, hidden]`.
    Router,
    /// Router bias `[experts]` (gpt-oss).
    RouterBias,
    /// Shared expert gate projection `[shared_ffn, hidden]` (Qwen2-MoE).
    SharedGate,
    /// Shared expert up projection `[shared_ffn, hidden]`.
    SharedUp,
    /// Shared expert down projection `[hidden, shared_ffn]`.
    SharedDown,
    /// The shared expert's sigmoid gate `[1, hidden]` (Qwen2-MoE `shared_expert_gate`).
    SharedExpertGate,
    /// A dense layer's gate projection `mlp.gate_proj` `[dense_ffn, hidden]` (DeepSeek's
    /// leading dense layers).
    DenseGate,
    /// A dense layer's up projection `mlp.up_proj` `[dense_ffn, hidden]`.
    DenseUp,
    /// A dense layer's down projection `mlp.down_proj` `[hidden, dense_ffn]`.
    DenseDown,
    /// Expert gate projection (Mixtral `w1`, DBRX `w1` rows) `[ffn, hidden]`.
    ExpertGate(usize),
    /// Expert up projection (Mixtral `w3`, DBRX `v1` rows) `[ffn, hidden]`.
    ExpertUp(usize),
    /// Expert down projection: Mixtral `w2` `[hidden, ffn]` (out, in); DBRX `w2` rows and
    /// gpt-oss `down_proj[e]` `[ffn, hidden]` (in, out), used as stored (gpt-oss stored
    /// out-in: `[hidden, ffn]`).
    ExpertDown(usize),
    /// gpt-oss fused gate/up `gate_up_proj[e]` `[hidden, 2 ffn]` (in, out), gate and up
    /// interleaved (even columns gate, odd columns up); stored out-in
    /// (`ArchSpec::experts_out_in`) `[2 ffn, hidden]`, even rows gate, odd rows up.
    ExpertGateUp(usize),
    /// gpt-oss `gate_up_proj_bias[e]` `[2 ffn]`, interleaved like the columns.
    ExpertGateUpBias(usize),
    /// gpt-oss `down_proj_bias[e]` `[hidden]`.
    ExpertDownBias(usize),
}

impl SegmentKind {
    /// The expert this segment belongs to, if any.
    pub fn expert(&self) -> Option<usize> {
        match *self {
            SegmentKind::ExpertGate(e)
            | SegmentKind::ExpertUp(e)
            | SegmentKind::ExpertDown(e)
            | SegmentKind::ExpertGateUp(e)
            | SegmentKind::ExpertGateUpBias(e)
            | SegmentKind::ExpertDownBias(e) => Some(e),
            _ => None,
        }
    }
}

/// One tensor (or expert row block) inside the image.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Segment {
    /// What it holds.
    pub kind: SegmentKind,
    /// Byte offset from the image start (multiple of [`SEGMENT_ALIGN`]).
    pub offset: usize,
    /// Bytes of data (padding excluded).
    pub len_bytes: usize,
    /// Bytes the image reserves for it before the next segment's alignment: `len_bytes`,
    /// or more where another layer stores the same tensor in a wider format (a GGUF
    /// Q4_K_M keeps some layers' `ffn_down` in Q6_K), so every layer's image has the same
    /// offsets and size.
    pub slot_bytes: usize,
    /// Stored rows (1 for a vector).
    pub rows: usize,
    /// Stored columns.
    pub cols: usize,
    /// Stored dtype (f32 for a quantised segment: what it decodes to).
    pub dtype: WeightDtype,
    /// The block format of a quantised segment (`None`: plain `dtype` elements).
    pub quant: Option<QuantFormat>,
    /// Matrix orientation; `None` for vectors (norm weights).
    pub orientation: Option<Orientation>,
}

impl Segment {
    /// Byte range inside the image.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len_bytes
    }
}

/// Layout of one decoder layer's packed weight image.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LayerLayout {
    /// Segments in image order.
    pub segments: Vec<Segment>,
    /// Model family (decides Q/K/V fused or separate).
    pub family: Family,
    /// Experts in the layer (0 for a dense layer).
    pub n_experts: usize,
    /// A leading dense layer's layout: its `gate` part holds the dense SwiGLU, no router.
    pub dense_ffn: bool,
    /// Image size in bytes (a multiple of [`SEGMENT_ALIGN`]).
    pub image_bytes: usize,
}

fn align_up(x: usize) -> usize {
    x.div_ceil(SEGMENT_ALIGN) * SEGMENT_ALIGN
}

/// Bytes of a `[rows, cols]` segment stored as `storage` (0 for a quantised row width
/// that is not whole blocks: `WeightFormats::check` and the readers refuse those first).
fn segment_bytes(storage: Storage, rows: usize, cols: usize) -> usize {
    storage.matrix_bytes(rows as u64, cols as u64).unwrap_or(0) as usize
}

impl LayerLayout {
    /// Shape `(rows, cols)` and orientation of each kind for this architecture.
    pub fn shape_of(arch: &ArchSpec, kind: SegmentKind) -> (usize, usize, Option<Orientation>) {
        let (d, f) = (arch.hidden, arch.ffn);
        let (q, kv) = (arch.q_dim(), arch.kv_dim());
        let lin = Some(Orientation::OutIn);
        let hd = arch.attn.head_dim;
        let fs = arch.shared_ffn;
        if let Some(m) = arch.mla {
            let h = arch.attn.heads;
            let q_out = h * m.qk_head_dim() as usize;
            let kv_b_rows = h * (m.qk_nope_head_dim + m.v_head_dim) as usize;
            let (q_rank, r) = (m.q_lora_rank.unwrap_or(0) as usize, m.kv_lora_rank as usize);
            match kind {
                SegmentKind::QProj => return (q_out, d, lin),
                SegmentKind::QAProj => return (q_rank, d, lin),
                SegmentKind::QANorm => return (1, q_rank, None),
                SegmentKind::QBProj => return (q_out, q_rank, lin),
                SegmentKind::KvAProj => return (m.latent_dim() as usize, d, lin),
                SegmentKind::KvANorm => return (1, r, None),
                SegmentKind::KvB | SegmentKind::KvBOut => return (kv_b_rows, r, lin),
                SegmentKind::KB => return (h * r, m.qk_nope_head_dim as usize, lin),
                SegmentKind::VB => return (h * m.v_head_dim as usize, r, lin),
                SegmentKind::OProj => return (d, h * m.v_head_dim as usize, lin),
                _ => {}
            }
        }
        match kind {
            // MLA kinds of a layout without MLA: empty.
            SegmentKind::QAProj
            | SegmentKind::QANorm
            | SegmentKind::QBProj
            | SegmentKind::KvAProj
            | SegmentKind::KvANorm
            | SegmentKind::KvB
            | SegmentKind::KvBOut
            | SegmentKind::KB
            | SegmentKind::VB => (0, 0, lin),
            SegmentKind::AttnNorm | SegmentKind::FfnNorm => (1, d, None),
            SegmentKind::QBias => (1, q, None),
            SegmentKind::Sinks => (1, arch.attn.heads, None),
            SegmentKind::OBias | SegmentKind::ExpertDownBias(_) => (1, d, None),
            SegmentKind::RouterBias => (1, arch.experts, None),
            SegmentKind::ExpertGateUp(_) if arch.experts_out_in => (2 * f, d, lin),
            SegmentKind::ExpertGateUp(_) => (d, 2 * f, Some(Orientation::InOut)),
            SegmentKind::ExpertDown(_) if arch.experts_out_in => (d, f, lin),
            SegmentKind::ExpertGateUpBias(_) => (1, 2 * f, None),
            SegmentKind::KBias | SegmentKind::VBias => (1, kv, None),
            SegmentKind::QNorm => match arch.qk_norm {
                QkNorm::Full => (1, q, None),
                _ => (1, hd, None),
            },
            SegmentKind::KNorm => match arch.qk_norm {
                QkNorm::Full => (1, kv, None),
                _ => (1, hd, None),
            },
            SegmentKind::DenseGate | SegmentKind::DenseUp => (arch.dense_ffn, d, lin),
            SegmentKind::DenseDown => (d, arch.dense_ffn, lin),
            SegmentKind::SharedGate | SegmentKind::SharedUp => (fs, d, lin),
            SegmentKind::SharedDown => (d, fs, lin),
            SegmentKind::SharedExpertGate => (1, d, lin),
            SegmentKind::QProj => (q, d, lin),
            SegmentKind::KProj | SegmentKind::VProj => (kv, d, lin),
            SegmentKind::QkvProj => (q + 2 * kv, d, lin),
            SegmentKind::OProj => (d, q, lin),
            SegmentKind::Router => (arch.experts, d, lin),
            SegmentKind::ExpertGate(_) | SegmentKind::ExpertUp(_) => (f, d, lin),
            SegmentKind::ExpertDown(_) => match family::spec(arch.family).expert_down() {
                Orientation::InOut => (f, d, Some(Orientation::InOut)),
                Orientation::OutIn => (d, f, lin),
            },
        }
    }

    /// The dense segment kinds of a layer in image order, grouped as the checkpoint buffer
    /// `W` names its parts: `pre` (input norm, Q/K/V, their biases and norms), `o` (output
    /// projection) and `gate` (post-attention norm, router, shared expert; for a leading
    /// dense layer, `dense_layer`, the post-attention norm and the dense SwiGLU).
    pub fn dense_parts(arch: &ArchSpec, dense_layer: bool) -> [Vec<SegmentKind>; 3] {
        let mut pre = vec![SegmentKind::AttnNorm];
        match (arch.family, arch.mla) {
            (_, Some(m)) => {
                if m.q_lora_rank.is_some() {
                    pre.extend([
                        SegmentKind::QAProj,
                        SegmentKind::QANorm,
                        SegmentKind::QBProj,
                    ]);
                } else {
                    pre.push(SegmentKind::QProj);
                }
                let (key_up, _) = Self::mla_up_kinds(&m);
                pre.extend([SegmentKind::KvAProj, SegmentKind::KvANorm, key_up]);
            }
            (_, None) if family::spec(arch.family).fused_qkv() => pre.push(SegmentKind::QkvProj),
            _ => pre.extend([SegmentKind::QProj, SegmentKind::KProj, SegmentKind::VProj]),
        }
        if arch.qkv_bias {
            pre.extend([SegmentKind::QBias, SegmentKind::KBias, SegmentKind::VBias]);
        }
        if arch.qk_norm != QkNorm::None {
            pre.extend([SegmentKind::QNorm, SegmentKind::KNorm]);
        }
        if arch.attn.sinks {
            pre.push(SegmentKind::Sinks);
        }
        let mut o = vec![SegmentKind::OProj];
        if let Some(m) = arch.mla {
            o.push(Self::mla_up_kinds(&m).1);
        }
        if arch.o_bias {
            o.push(SegmentKind::OBias);
        }
        if dense_layer {
            let gate = vec![
                SegmentKind::FfnNorm,
                SegmentKind::DenseGate,
                SegmentKind::DenseUp,
                SegmentKind::DenseDown,
            ];
            return [pre, o, gate];
        }
        let mut gate = vec![SegmentKind::FfnNorm, SegmentKind::Router];
        if arch.has_router_bias() {
            gate.push(SegmentKind::RouterBias);
        }
        if arch.shared_ffn > 0 {
            gate.extend([
                SegmentKind::SharedGate,
                SegmentKind::SharedUp,
                SegmentKind::SharedDown,
            ]);
            if arch.shared_gate {
                gate.push(SegmentKind::SharedExpertGate);
            }
        }
        [pre, o, gate]
    }

    /// MLA's up-projection segments as the checkpoint stores them: the one in the `pre`
    /// part (the keys' `W_uk`) and the one in the `o` part (the values' `W_uv`); `KvB` and
    /// `KvBOut` (both `kv_b_proj`) or, split, `KB` and `VB`.
    pub fn mla_up_kinds(m: &crate::model::card::Mla) -> (SegmentKind, SegmentKind) {
        if m.kv_b_split {
            (SegmentKind::KB, SegmentKind::VB)
        } else {
            (SegmentKind::KvB, SegmentKind::KvBOut)
        }
    }

    /// The segment kinds of expert `e`, in image order (contiguous in the image).
    pub fn expert_kinds(arch: &ArchSpec, e: usize) -> Vec<SegmentKind> {
        if arch.clamped_swiglu.is_some() {
            vec![
                SegmentKind::ExpertGateUp(e),
                SegmentKind::ExpertGateUpBias(e),
                SegmentKind::ExpertDown(e),
                SegmentKind::ExpertDownBias(e),
            ]
        } else {
            vec![
                SegmentKind::ExpertGate(e),
                SegmentKind::ExpertUp(e),
                SegmentKind::ExpertDown(e),
            ]
        }
    }

    /// Bytes of each segment of [`LayerLayout::dense_parts`] of a MoE layer, of one
    /// expert's segments and of a dense layer's `gate` part, in image order, each stored as
    /// `storage_of` says (what `ir::CheckpointLayout` sizes the parts of `W` from; `pre`
    /// and `o` are the same in both kinds of layer).
    pub fn part_bytes(
        arch: &ArchSpec,
        storage_of: impl Fn(SegmentKind) -> Storage,
    ) -> [Vec<u64>; 5] {
        let bytes = |kind: SegmentKind| {
            let (rows, cols, _) = Self::shape_of(arch, kind);
            segment_bytes(storage_of(kind), rows, cols) as u64
        };
        let [pre, o, gate] = Self::dense_parts(arch, false);
        let [_, _, dense_gate] = Self::dense_parts(arch, true);
        let expert = Self::expert_kinds(arch, 0);
        [
            pre.into_iter().map(bytes).collect(),
            o.into_iter().map(bytes).collect(),
            gate.into_iter().map(bytes).collect(),
            expert.into_iter().map(bytes).collect(),
            dense_gate.into_iter().map(bytes).collect(),
        ]
    }

    /// Segment kinds of layer `layer` in image order (a dense layer has no experts).
    pub fn kinds(arch: &ArchSpec, layer: usize) -> Vec<SegmentKind> {
        let dense = arch.is_dense(layer);
        let mut kinds: Vec<SegmentKind> = Self::dense_parts(arch, dense)
            .into_iter()
            .flatten()
            .collect();
        if !dense {
            for e in 0..arch.experts {
                kinds.extend(Self::expert_kinds(arch, e));
            }
        }
        kinds
    }

    /// Layout of layer `layer` with each segment's dtype given by `dtype_of`.
    pub fn new(
        arch: &ArchSpec,
        layer: usize,
        dtype_of: impl Fn(SegmentKind) -> WeightDtype,
    ) -> Self {
        let storage = |k| Storage::Float(dtype_of(k));
        Self::with_storage(arch, layer, storage, storage)
    }

    /// Layout of layer `layer` of a model `card` describes: every segment stored as the
    /// card's formats say (its dtype, or a class's or tensor's format).
    pub fn for_card(card: &ModelCard, arch: &ArchSpec, layer: usize) -> Self {
        let storage = |k| card.storage(WeightTensor::layer(k));
        Self::with_storage(arch, layer, storage, storage)
    }

    /// Layout of layer `layer` whose segments are stored as `storage_of` says, each in a
    /// slot of the bytes `slot_of`'s storage takes (at least as many: the widest format
    /// any layer stores that tensor in), so layers that store a tensor in different
    /// formats still share offsets and size. A quantised segment's rows are whole blocks
    /// (the readers checked); its `dtype` is f32, what the blocks decode to.
    pub fn with_storage(
        arch: &ArchSpec,
        layer: usize,
        slot_of: impl Fn(SegmentKind) -> Storage,
        storage_of: impl Fn(SegmentKind) -> Storage,
    ) -> Self {
        let dense = arch.is_dense(layer);
        let mut offset = 0;
        let mut segments = Vec::new();
        for kind in Self::kinds(arch, layer) {
            let (rows, cols, orientation) = Self::shape_of(arch, kind);
            let storage = storage_of(kind);
            let len_bytes = segment_bytes(storage, rows, cols);
            let slot_bytes = segment_bytes(slot_of(kind), rows, cols).max(len_bytes);
            segments.push(Segment {
                kind,
                offset,
                len_bytes,
                slot_bytes,
                rows,
                cols,
                dtype: storage.dtype(),
                quant: storage.quant(),
                orientation,
            });
            offset = align_up(offset + slot_bytes);
        }
        LayerLayout {
            segments,
            family: arch.family,
            n_experts: if dense { 0 } else { arch.experts },
            dense_ffn: dense,
            image_bytes: offset,
        }
    }

    /// Layout of a MoE layer (the first after the leading dense ones) with every segment
    /// in `dtype`.
    pub fn uniform(arch: &ArchSpec, dtype: WeightDtype) -> Self {
        Self::new(arch, arch.dense_layers, |_| dtype)
    }

    /// Layout of layer `layer` with every segment in `dtype`.
    pub fn uniform_for(arch: &ArchSpec, layer: usize, dtype: WeightDtype) -> Self {
        Self::new(arch, layer, |_| dtype)
    }

    /// The segment of `kind`, if the layout has one.
    pub fn segment(&self, kind: SegmentKind) -> Option<&Segment> {
        self.segments.iter().find(|s| s.kind == kind)
    }

    fn span(&self, pred: impl Fn(&Segment) -> bool) -> Range<usize> {
        let mut it = self.segments.iter().filter(|s| pred(s));
        let Some(first) = it.next() else { return 0..0 };
        let last = it.last().unwrap_or(first);
        first.offset..align_up(last.offset + last.slot_bytes)
    }

    /// Bytes of the attention part: input norm, Q/K/V (or Wqkv) with their biases and
    /// norms, O and the post-attention norm.
    pub fn attention_range(&self) -> Range<usize> {
        self.span(|s| {
            s.kind.expert().is_none()
                && !matches!(
                    s.kind,
                    SegmentKind::Router
                        | SegmentKind::RouterBias
                        | SegmentKind::DenseGate
                        | SegmentKind::DenseUp
                        | SegmentKind::DenseDown
                        | SegmentKind::SharedGate
                        | SegmentKind::SharedUp
                        | SegmentKind::SharedDown
                        | SegmentKind::SharedExpertGate
                )
        })
    }

    /// Bytes of the router (and its bias).
    pub fn router_range(&self) -> Range<usize> {
        self.span(|s| matches!(s.kind, SegmentKind::Router | SegmentKind::RouterBias))
    }

    /// Bytes of the dense part (attention, router, shared expert): everything before the
    /// routed experts.
    pub fn dense_range(&self) -> Range<usize> {
        self.span(|s| s.kind.expert().is_none())
    }

    /// Bytes of expert `expert` (its gate, up and down, contiguous); empty if out of range.
    pub fn expert_range(&self, expert: usize) -> Range<usize> {
        self.span(|s| s.kind.expert() == Some(expert))
    }
}

/// A heap buffer aligned for any dtype (backed by u64s), for holding a layer image.
#[derive(Debug, Clone)]
pub struct ImageBuffer {
    words: Vec<u64>,
    len: usize,
}

impl ImageBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        ImageBuffer {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }
}
