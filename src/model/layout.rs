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
use crate::model::card::QkNorm;
use crate::model::family::facts::Family;
use crate::model::formats::{WeightClass, WeightFormats, WeightTensor};
use crate::model::segment::SegmentKind;
use crate::model::vocab::Orientation;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use std::collections::BTreeMap;
use std::ops::Range;

/// Alignment of every segment inside an image (a cache line; enough for any dtype/SIMD).
pub const SEGMENT_ALIGN: usize = 64;

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

    /// `(rows, cols, orientation)` of this segment as a format copy in a block format holds
    /// it ([`with_expert_storage`]): blocks run along stored rows, so a matrix the
    /// checkpoint stores `[in, out]` is held transposed, `[out, in]`
    /// (`runtime::host::format_copy` writes it so); an `[out, in]` matrix as it is. What
    /// the ops of both backends multiply when they find an expert only as such a copy.
    pub fn block_copy_shape(&self) -> (usize, usize, Orientation) {
        match self.orientation {
            Some(Orientation::InOut) => (self.cols, self.rows, Orientation::OutIn),
            _ => (self.rows, self.cols, Orientation::OutIn),
        }
    }
}

/// The `[cols, rows]` transpose of the row-major `[rows, cols]` matrix `values` (an
/// `[in, out]` matrix of `rows` inputs made `[out, in]`, as torch's `w.permute(1, 0)` and
/// llama.cpp's converters store it). `None` when `values` is not `rows * cols` long.
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Option<Vec<f32>> {
    if rows.checked_mul(cols)? != values.len() {
        return None;
    }
    let mut out = Vec::with_capacity(values.len());
    for c in 0..cols {
        out.extend((0..rows).map(|r| values[r * cols + c]));
    }
    Some(out)
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
            SegmentKind::ExpertDown(_) => match arch.family.facts().expert_down {
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
            (_, None) if arch.family.facts().fused_qkv => pre.push(SegmentKind::QkvProj),
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

/// The formats' check against the shapes: it lives with the layout, which knows each
/// tensor's shape and orientation.
impl WeightFormats {
    /// Checks every quantised tensor of `arch` (whose card dtype is `dtype`): a matrix
    /// stored `[out, in]` whose rows are whole blocks of its format. The error names the
    /// tensor, its format and what is wrong.
    pub fn check(&self, arch: &ArchSpec, dtype: WeightDtype) -> Result<(), String> {
        let mut tensors: Vec<(WeightTensor, usize, Option<Orientation>)> = vec![
            (WeightTensor::Embed, arch.hidden, Some(Orientation::OutIn)),
            (WeightTensor::LmHead, arch.hidden, Some(Orientation::OutIn)),
            (WeightTensor::FinalNorm, arch.hidden, None),
        ];
        for layer in [0, arch.dense_layers.min(arch.layers.saturating_sub(1))] {
            for kind in LayerLayout::kinds(arch, layer) {
                let (rows, cols, orientation) = LayerLayout::shape_of(arch, kind);
                if rows * cols > 0 {
                    tensors.push((WeightTensor::layer(kind), cols, orientation));
                }
            }
        }
        for (tensor, cols, orientation) in tensors {
            let Storage::Quant(format) = self.storage(dtype, tensor) else {
                continue;
            };
            if tensor.is_vector() || orientation != Some(Orientation::OutIn) {
                return Err(format!(
                    "{tensor} as {format}: moec quantises only matrices stored [out, in] \
                     ({} stores it {})",
                    arch.family.model_type(),
                    if tensor.is_vector() {
                        "as a vector"
                    } else {
                        "[in, out]"
                    }
                ));
            }
            if format.bytes_for(cols).is_none() {
                return Err(format!(
                    "{tensor} as {format}: rows of {cols} weights are not whole {}-weight blocks",
                    format.block_elems()
                ));
            }
        }
        Ok(())
    }
}

/// Bytes of each weight class in the checkpoint buffer `W` of `card` (padding excluded;
/// a tensor in the room its format takes there), with the formats the class holds, in
/// [`WeightClass::ALL`] order; classes the model lacks are left out.
pub fn bytes_by_class(card: &ModelCard) -> Vec<(WeightClass, u64, Vec<Storage>)> {
    let arch = ArchSpec::from_card(card);
    let mut out: BTreeMap<WeightClass, (u64, Vec<Storage>)> = BTreeMap::new();
    let mut add = |tensor: WeightTensor, bytes: u64, times: u64| {
        let storage = card.storage(tensor);
        let entry = out.entry(tensor.class()).or_default();
        entry.0 += bytes * times;
        if !entry.1.contains(&storage) {
            entry.1.push(storage);
        }
    };
    let table = |t: WeightTensor| {
        card.storage(t)
            .matrix_bytes(card.vocab, card.hidden)
            .unwrap_or(0)
    };
    add(WeightTensor::Embed, table(WeightTensor::Embed), 1);
    add(WeightTensor::LmHead, table(WeightTensor::LmHead), 1);
    let norm = card.storage(WeightTensor::FinalNorm).bytes_for(card.hidden);
    add(WeightTensor::FinalNorm, norm.unwrap_or(0), 1);
    // Layers of one kind (dense, MoE) share their layout: one of each, times its count.
    let dense = card.dense_layers.min(card.layers);
    for (layer, count) in [(0, dense), (dense, card.layers - dense)] {
        if count == 0 {
            continue;
        }
        let layout = LayerLayout::for_card(card, &arch, layer as usize);
        for seg in &layout.segments {
            add(WeightTensor::layer(seg.kind), seg.len_bytes as u64, count);
        }
    }
    WeightClass::ALL
        .into_iter()
        .filter_map(|c| out.remove(&c).filter(|e| e.0 > 0).map(|(b, s)| (c, b, s)))
        .collect()
}

/// A buffer aligned for any dtype, for a layer image or a tensor the weights image holds in
/// memory (a realigned or decoded tensor): zeroed pages of its own, never shared with
/// another allocation. The CUDA backend registers the image's tensors with the driver in
/// whole pages (`runtime::cuda::host_weights`); a heap buffer's first and last pages held
/// other heap objects, which then looked page-locked (and read-only) to the driver: a
/// pageable copy's source freed after the call was read later, as a pinned one is, and a
/// copy to a heap buffer in those pages was refused.
#[derive(Debug)]
pub struct ImageBuffer {
    map: memmap2::MmapMut,
    len: usize,
}

impl ImageBuffer {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        // An anonymous map is zero-filled, page-aligned and its own pages. Out of memory
        // ends the process, as a failed heap allocation does.
        let map = memmap2::MmapMut::map_anon(len.max(1))
            .unwrap_or_else(|e| panic!("cannot map {len} bytes for a weights buffer: {e}"));
        ImageBuffer { map, len }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

impl Clone for ImageBuffer {
    fn clone(&self) -> Self {
        let mut copy = ImageBuffer::zeroed(self.len);
        copy.as_bytes_mut().copy_from_slice(self.as_bytes());
        copy
    }
}

/// `card` with every routed expert stored in `storage` (what a format copy of the experts,
/// `W[l].expert(e).format(..)`, is laid out as), checked as `--weight-format experts=..` is:
/// every expert matrix stored `[out, in]` with rows of whole blocks.
/// A block format is read along stored rows, so a copy in one stores every expert matrix
/// `[out, in]`, as `moec quantize` writes them: where the checkpoint stores them `[in, out]`
/// (the Hub's DBRX down projection, gpt-oss's gate/up and down) the copy holds their
/// transpose (`runtime::host::format_copy` makes it; [`Segment::block_copy_shape`] is what
/// the ops multiply). A float copy keeps the checkpoint's orientation.
pub fn with_expert_storage(card: &ModelCard, storage: Storage) -> Result<ModelCard, String> {
    let mut card = card.clone();
    card.formats
        .tensors
        .retain(|t, _| t.class() != WeightClass::Experts);
    for own in card.formats.layers.values_mut() {
        own.retain(|t, _| t.class() != WeightClass::Experts);
    }
    card.formats.layers.retain(|_, own| !own.is_empty());
    card.formats.classes.insert(WeightClass::Experts, storage);
    if storage.quant().is_some() {
        // The storage facts a GGUF of this card in `storage` records (`moec quantize`):
        // gpt-oss's in its clamped SwiGLU, DBRX's in `expert_down_out_in`.
        match card.clamped_swiglu.as_mut() {
            Some(swiglu) => swiglu.experts_out_in = true,
            None => {
                card.expert_down_out_in |= card.family.facts().expert_down == Orientation::InOut;
            }
        }
    }
    let arch = ArchSpec::from_card(&card);
    card.formats.check(&arch, card.dtype)?;
    Ok(card)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A q8_0 copy of experts the checkpoint stores `[in, out]` is laid out `[out, in]`:
    /// DBRX's down projection (`[ffn, hidden]` in the Hub checkpoint) becomes `hidden`
    /// rows of `ffn`, gpt-oss's gate/up and down likewise, each the transpose of the
    /// checkpoint's segment (`block_copy_shape`); Mixtral's `[out, in]` experts keep their
    /// shape. A float copy keeps the orientation.
    #[test]
    fn a_block_format_copy_lays_in_out_experts_out_in() {
        let q8 = Storage::parse("q8_0").unwrap();
        for (name, kinds) in [
            ("dbrx-tiny", vec![SegmentKind::ExpertDown(1)]),
            (
                "gpt-oss-tiny",
                vec![SegmentKind::ExpertGateUp(1), SegmentKind::ExpertDown(1)],
            ),
            (
                "mixtral-tiny",
                vec![SegmentKind::ExpertGate(1), SegmentKind::ExpertDown(1)],
            ),
        ] {
            let card = ModelCard::load(name).unwrap();
            let copy = with_expert_storage(&card, q8).unwrap();
            let layer = card.dense_layers as usize;
            let source = LayerLayout::for_card(&card, &ArchSpec::from_card(&card), layer);
            let converted = LayerLayout::for_card(&copy, &ArchSpec::from_card(&copy), layer);
            for kind in kinds {
                let (s, c) = (
                    source.segment(kind).unwrap(),
                    converted.segment(kind).unwrap(),
                );
                assert_eq!(
                    (c.rows, c.cols, c.orientation.unwrap()),
                    s.block_copy_shape(),
                    "{name} {kind:?}"
                );
                let transposed = s.orientation == Some(Orientation::InOut);
                assert_eq!(transposed, name != "mixtral-tiny", "{name} {kind:?}");
                if transposed {
                    assert_eq!((c.rows, c.cols), (s.cols, s.rows), "{name} {kind:?}");
                }
                assert_eq!(c.quant, Some(QuantFormat::Q8_0), "{name} {kind:?}");
            }
            let f32_copy = with_expert_storage(&card, Storage::Float(WeightDtype::F32)).unwrap();
            assert_eq!(
                ArchSpec::from_card(&f32_copy).experts_out_in,
                ArchSpec::from_card(&card).experts_out_in,
                "{name}"
            );
        }
        // By hand from the cards: DBRX's tiny down projection is `ffn` 192 rows of
        // `hidden` 128 in the Hub checkpoint, 128 rows of 192 in the copy; gpt-oss's
        // (`ffn` 64, `hidden` 128) 64 rows of 128, then 128 rows of 64.
        let down = |name: &str| {
            let card = ModelCard::load(name).unwrap();
            let copy = with_expert_storage(&card, q8).unwrap();
            let shape = |c: &ModelCard| {
                let s = LayerLayout::for_card(c, &ArchSpec::from_card(c), 0);
                let d = s.segment(SegmentKind::ExpertDown(0)).unwrap();
                (d.rows, d.cols)
            };
            (shape(&card), shape(&copy))
        };
        assert_eq!(down("dbrx-tiny"), ((192, 128), (128, 192)));
        assert_eq!(down("gpt-oss-tiny"), ((64, 128), (128, 64)));
    }

    /// The transpose moves input rows to output rows: torch's `w.permute(1, 0)` of
    /// `[[0, 1, 2], [3, 4, 5]]`.
    #[test]
    fn transpose_moves_input_rows_to_output_rows() {
        let t = transpose(&[0., 1., 2., 3., 4., 5.], 2, 3).unwrap();
        assert_eq!(t, vec![0., 3., 1., 4., 2., 5.]);
        assert!(transpose(&[0.; 5], 2, 3).is_none());
    }

    /// A quantised format on rows that are not whole blocks, or on a matrix stored
    /// `[in, out]` (gpt-oss's experts), is refused naming the tensor.
    #[test]
    fn check_names_the_tensor_it_cannot_quantise() {
        let card = ModelCard::load("mixtral-tiny").unwrap();
        let arch = ArchSpec::from_card(&card);
        let mut f = WeightFormats::default();
        f.parse_classes("experts=q4_k").unwrap();
        let e = f.check(&arch, card.dtype).unwrap_err();
        assert!(
            e.contains("ExpertGate as Q4_K") && e.contains("not whole 256"),
            "{e}"
        );
        let mut f = WeightFormats::default();
        f.parse_classes("experts=q8_0").unwrap();
        f.check(&arch, card.dtype).unwrap();
        let gpt = ModelCard::load("gpt-oss-tiny").unwrap();
        let e = f.check(&ArchSpec::from_card(&gpt), gpt.dtype).unwrap_err();
        assert!(e.contains("[in, out]"), "{e}");
    }

    /// Mixtral-8x7B's expert bytes are its 45.1B expert weights at 2 bytes (bf16) or
    /// 144/256 bytes (Q4_K): the quantised experts take 4.5/16 of the bf16 bytes.
    #[test]
    fn class_bytes_follow_the_formats() {
        let card = ModelCard::load("mixtral-8x7b").unwrap();
        let experts = |c: &ModelCard| {
            bytes_by_class(c)
                .into_iter()
                .find(|(class, _, _)| *class == WeightClass::Experts)
                .unwrap()
        };
        let bf16 = experts(&card);
        assert_eq!(bf16.1, 32 * 8 * 3 * 4096 * 14336 * 2);
        let mut q = card.clone();
        q.formats.parse_classes("experts=q4_k").unwrap();
        let q4 = experts(&q);
        assert_eq!(q4.1 * 64, bf16.1 * 18);
        assert_eq!(q4.2, vec![Storage::Quant(QuantFormat::Q4K)]);
        let norms: u64 = bytes_by_class(&q)
            .iter()
            .filter(|(c, _, _)| *c == WeightClass::Norms)
            .map(|(_, b, _)| *b)
            .sum();
        assert_eq!(norms, (2 * 32 + 1) * 4096 * 2);
    }
}
