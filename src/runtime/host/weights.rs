//! Where each weight tensor currently lives: the geometry of the packed weights image (the
//! checkpoint buffer `W`) and a map of weight pieces per memory space that copies keep up
//! to date.
//!
//! Takes a checkpoint and the program's [`CheckpointLayout`]; gives the image geometry
//! ([`ImageLayout`]: `[embed | layer 0 .. L-1 | final norm, lm_head]`, each layer the
//! model's packed [`LayerLayout`]; `runtime::image` serves its bytes from the checkpoint's
//! memory maps) and a [`WeightMap`] that answers "where inside these byte ranges is
//! segment S of layer i, whole?". A copy moves the labels of the bytes it copies, so
//! pages, expert slots and run-time chosen (hot) experts are all found the same way, and
//! an op whose weights are not (wholly) in its `w` arguments is an error naming the tensor,
//! never a read of wrong bytes.

use crate::ir::CheckpointLayout;
use crate::math::tensor::TypedSlice;
use crate::model::layout::LayerLayout;
use crate::model::segment::SegmentKind;
use crate::quant::storage::Storage;
use crate::quant::{QuantFormat, QuantSlice};
use crate::weights::checkpoint::{Checkpoint, CheckpointError};
use std::collections::{BTreeMap, HashSet};

/// A weight tensor that ops look up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightTag {
    /// The embedding table.
    Embed,
    /// The final norm weight.
    FinalNorm,
    /// The lm_head matrix.
    LmHead,
    /// A segment of a layer's packed image.
    Layer {
        /// The layer.
        layer: u32,
        /// The segment.
        kind: SegmentKind,
    },
    /// A routed expert's segment converted at load into another block format (a format
    /// copy, `W[l].expert(e).format(q8_0)`): the same matrix, other bytes. Ops that find a
    /// segment only in this form compute with it (the checker proved the schedule declares
    /// the substitute).
    Converted {
        /// The layer.
        layer: u32,
        /// The segment.
        kind: SegmentKind,
        /// The format it was converted into.
        format: QuantFormat,
    },
}

impl std::fmt::Display for WeightTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightTag::Embed => write!(f, "embedding"),
            WeightTag::FinalNorm => write!(f, "final norm"),
            WeightTag::LmHead => write!(f, "lm_head"),
            WeightTag::Layer { layer, kind } => write!(f, "layer {layer} {kind:?}"),
            WeightTag::Converted {
                layer,
                kind,
                format,
            } => write!(f, "layer {layer} {kind:?} in {}", format.name()),
        }
    }
}

/// A labelled byte range: bytes `[start, start + len)` hold bytes
/// `[tag_offset, tag_offset + len)` of the tensor `tag`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    len: u64,
    tag: WeightTag,
    tag_offset: u64,
}

/// Weight labels of one memory space (or of the image), keyed by start byte.
#[derive(Debug, Clone, Default)]
pub struct WeightMap {
    pieces: BTreeMap<u64, Piece>,
}

impl WeightMap {
    /// Removes labels overlapping `[start, end)`, keeping the parts outside it.
    pub fn clear(&mut self, start: u64, end: u64) {
        let overlapping: Vec<(u64, Piece)> = self
            .pieces
            .range(..end)
            .rev()
            .take_while(|(s, p)| **s + p.len > start)
            .map(|(s, p)| (*s, *p))
            .collect();
        for (s, p) in overlapping {
            self.pieces.remove(&s);
            if s < start {
                self.pieces.insert(
                    s,
                    Piece {
                        len: start - s,
                        ..p
                    },
                );
            }
            let p_end = s + p.len;
            if p_end > end {
                let cut = end - s;
                self.pieces.insert(
                    end,
                    Piece {
                        len: p_end - end,
                        tag: p.tag,
                        tag_offset: p.tag_offset + cut,
                    },
                );
            }
        }
    }

    /// Labels `[start, start + len)` as bytes `tag_offset..` of `tag`, merging with a
    /// contiguous neighbour of the same tensor.
    pub fn insert(&mut self, start: u64, len: u64, tag: WeightTag, tag_offset: u64) {
        if len == 0 {
            return;
        }
        self.clear(start, start + len);
        let mut start = start;
        let mut piece = Piece {
            len,
            tag,
            tag_offset,
        };
        if let Some((&ps, &prev)) = self.pieces.range(..start).next_back() {
            if ps + prev.len == start && prev.tag == tag && prev.tag_offset + prev.len == tag_offset
            {
                self.pieces.remove(&ps);
                start = ps;
                piece = Piece {
                    len: prev.len + len,
                    tag,
                    tag_offset: prev.tag_offset,
                };
            }
        }
        let end = start + piece.len;
        if let Some(next) = self.pieces.get(&end).copied() {
            if next.tag == tag && next.tag_offset == piece.tag_offset + piece.len {
                self.pieces.remove(&end);
                piece.len += next.len;
            }
        }
        self.pieces.insert(start, piece);
    }

    /// Start of the piece that covers `start` (the first one that can overlap a range
    /// beginning there), or `start` itself.
    fn first_at(&self, start: u64) -> u64 {
        self.pieces
            .range(..=start)
            .next_back()
            .map_or(start, |(s, _)| *s)
    }

    /// Labels within `[start, start + len)`, clipped, as `(offset from start, len, tag,
    /// tag offset)`.
    pub fn labels_in(&self, start: u64, len: u64) -> Vec<(u64, u64, WeightTag, u64)> {
        let end = start + len;
        let mut out = Vec::new();
        let first = self.first_at(start);
        for (&s, p) in self.pieces.range(first..end) {
            let (lo, hi) = (s.max(start), (s + p.len).min(end));
            if lo < hi {
                out.push((lo - start, hi - lo, p.tag, p.tag_offset + (lo - s)));
            }
        }
        out
    }

    /// Where `tag` (of `tag_len` bytes) lies whole inside `[start, start + len)`: the
    /// absolute start byte.
    pub fn find_whole(&self, start: u64, len: u64, tag: WeightTag, tag_len: u64) -> Option<u64> {
        let end = start + len;
        let first = self.first_at(start);
        self.pieces
            .range(first..end)
            .find(|(s, p)| {
                p.tag == tag
                    && p.tag_offset == 0
                    && p.len >= tag_len
                    && **s >= start
                    && **s + tag_len <= end
            })
            .map(|(s, _)| *s)
    }
}

/// Byte geometry of the weights image, consistent with the IR's [`CheckpointLayout`].
#[derive(Debug, Clone)]
pub struct ImageLayout {
    /// The IR's view (offsets of embed, layers, head).
    pub checkpoint: CheckpointLayout,
    /// The packed layout of the first MoE layer (every MoE layer has its offsets and size;
    /// a tensor's format may differ per layer, see [`ImageLayout::layer_of`]).
    pub layer: LayerLayout,
    /// The packed layout of the first leading dense layer, if the card has any.
    pub dense_layer: Option<LayerLayout>,
    /// Every layer's packed layout: the same geometry as `layer` (or `dense_layer`), with
    /// each segment in the format that layer stores it in.
    pub layers: Vec<LayerLayout>,
    /// Bytes of the final norm (first part of the head region).
    pub final_norm_bytes: u64,
    /// How the embedding, the final norm and the lm_head are stored.
    pub head_storage: [Storage; 3],
    /// Rows of the embedding and lm_head (the card's vocabulary) and their width.
    pub vocab_hidden: (usize, usize),
    /// The Q4_K matrices the image holds in tiles of eight rows (`math::qmatmul::tiles`):
    /// empty unless the CPU backend repacked them at load ([`ImageLayout::tileable`]).
    pub tiled: HashSet<WeightTag>,
}

impl ImageLayout {
    /// The packed layout of layer `layer`.
    pub fn layer_of(&self, layer: u32) -> &LayerLayout {
        if let Some(l) = self.layers.get(layer as usize) {
            return l;
        }
        match &self.dense_layer {
            Some(dense) if self.checkpoint.is_dense(u64::from(layer)) => dense,
            _ => &self.layer,
        }
    }

    /// How tensor `tag` is stored (`None` for a segment the layer does not have).
    pub fn storage(&self, tag: WeightTag) -> Option<Storage> {
        match tag {
            WeightTag::Embed => Some(self.head_storage[0]),
            WeightTag::FinalNorm => Some(self.head_storage[1]),
            WeightTag::LmHead => Some(self.head_storage[2]),
            WeightTag::Layer { layer, kind } => self
                .layer_of(layer)
                .segment(kind)
                .map(|s| s.quant.map_or(Storage::Float(s.dtype), Storage::Quant)),
            WeightTag::Converted {
                layer,
                kind,
                format,
            } => self
                .layer_of(layer)
                .segment(kind)
                .map(|_| Storage::Quant(format)),
        }
    }

    /// Views `bytes` (all of tensor `tag`) as the elements it stores: floats of its dtype
    /// or blocks of its quantised format.
    pub fn typed<'a>(&self, tag: WeightTag, bytes: &'a [u8]) -> Result<TypedSlice<'a>, String> {
        match self.storage(tag) {
            None => Err(format!("{tag}: not in this layer's image")),
            Some(Storage::Float(dtype)) => {
                TypedSlice::from_bytes(bytes, dtype).map_err(|e| format!("{tag}: {e}"))
            }
            Some(Storage::Quant(format)) => {
                let elems = self.tag_elems(tag);
                // The tensor's own blocks: a view may run on into the padding after it.
                let len = format.bytes_for(elems).unwrap_or(0);
                let bytes = bytes.get(..len).unwrap_or(bytes);
                let slice = match self.tiled_cols(tag) {
                    Some(cols) => QuantSlice::tiled(bytes, format, elems, cols),
                    None => QuantSlice::new(bytes, format, elems),
                };
                slice
                    .map(TypedSlice::Quant)
                    .map_err(|e| format!("{tag}: {e}"))
            }
        }
    }

    /// The row width of tensor `tag` when the image holds it in tiles.
    fn tiled_cols(&self, tag: WeightTag) -> Option<usize> {
        if !self.tiled.contains(&tag) {
            return None;
        }
        match tag {
            WeightTag::LmHead => Some(self.vocab_hidden.1),
            WeightTag::Layer { layer, kind } => self.layer_of(layer).segment(kind).map(|s| s.cols),
            WeightTag::Embed | WeightTag::FinalNorm | WeightTag::Converted { .. } => None,
        }
    }

    /// The tensors the CPU backend may hold in tiles of eight rows, with their format and
    /// `(rows, cols)`: the Q4_K, Q6_K, Q8_0, Q4_0 and MXFP4 out-in matrices that only ever
    /// multiply whole (attention projections, MLA's query and latent projections, dense,
    /// shared and expert FFN matrices, gpt-oss's fused gate/up stored out-in, the lm_head;
    /// not the embedding, whose rows are read one at a time) or one MLA head at a time
    /// where every head's rows are whole tiles (`attn_k_b`, `attn_v_b`), and whose rows are
    /// whole tiles (eight rows of whole blocks).
    pub fn tileable(&self) -> Vec<(WeightTag, QuantFormat, usize, usize)> {
        use crate::math::qmatmul::tiles::{tileable, TILE_ROWS};
        use crate::model::vocab::Orientation;
        let whole = |kind: SegmentKind| {
            matches!(
                kind,
                SegmentKind::QProj
                    | SegmentKind::KProj
                    | SegmentKind::VProj
                    | SegmentKind::QkvProj
                    | SegmentKind::QAProj
                    | SegmentKind::QBProj
                    | SegmentKind::KvAProj
                    | SegmentKind::OProj
                    | SegmentKind::SharedGate
                    | SegmentKind::SharedUp
                    | SegmentKind::SharedDown
                    | SegmentKind::DenseGate
                    | SegmentKind::DenseUp
                    | SegmentKind::DenseDown
                    | SegmentKind::ExpertGate(_)
                    | SegmentKind::ExpertUp(_)
                    | SegmentKind::ExpertDown(_)
                    | SegmentKind::ExpertGateUp(_)
            )
        };
        // `math::mla` multiplies llama.cpp's split halves one head's rows at a time:
        // `attn_k_b` `[heads x kv_lora_rank, qk_nope]` by `kv_lora_rank` rows (`attn_v_b`'s
        // columns), `attn_v_b` `[heads x v_head_dim, kv_lora_rank]` by `v_head_dim`; a tile
        // view can only be cut at whole tiles, so they tile where both are multiples of 8.
        let per_head_whole =
            |l: &LayerLayout| match (l.segment(SegmentKind::KB), l.segment(SegmentKind::VB)) {
                (Some(kb), Some(vb)) if vb.cols > 0 && kb.rows.is_multiple_of(vb.cols) => {
                    let heads = kb.rows / vb.cols;
                    heads > 0
                        && vb.cols.is_multiple_of(TILE_ROWS)
                        && vb.rows.is_multiple_of(heads)
                        && (vb.rows / heads).is_multiple_of(TILE_ROWS)
                }
                _ => false,
            };
        let mut out = Vec::new();
        for layer in 0..self.checkpoint.layers as u32 {
            let l = self.layer_of(layer);
            let split_halves = per_head_whole(l);
            for seg in &l.segments {
                let out_in = seg.orientation.unwrap_or(Orientation::OutIn) == Orientation::OutIn;
                let multiplied = whole(seg.kind)
                    || (split_halves && matches!(seg.kind, SegmentKind::KB | SegmentKind::VB));
                if let Some(format) = seg.quant.filter(|_| multiplied && out_in) {
                    if tileable(format, seg.rows, seg.cols) {
                        let tag = WeightTag::Layer {
                            layer,
                            kind: seg.kind,
                        };
                        out.push((tag, format, seg.rows, seg.cols));
                    }
                }
            }
        }
        // The lm_head is stored `[vocab, hidden]` (out-in) in every checkpoint.
        let (vocab, hidden) = self.vocab_hidden;
        if let Storage::Quant(format) = self.head_storage[2] {
            if tileable(format, vocab, hidden) {
                out.push((WeightTag::LmHead, format, vocab, hidden));
            }
        }
        out
    }

    /// Elements of tensor `tag`.
    fn tag_elems(&self, tag: WeightTag) -> usize {
        let (vocab, hidden) = self.vocab_hidden;
        match tag {
            WeightTag::FinalNorm => hidden,
            WeightTag::Embed | WeightTag::LmHead => vocab * hidden,
            WeightTag::Layer { layer, kind } | WeightTag::Converted { layer, kind, .. } => self
                .layer_of(layer)
                .segment(kind)
                .map_or(0, |s| s.rows * s.cols),
        }
    }

    /// The first tensor stored block-quantised, with its format (`None`: all floats).
    pub fn quantised_tensor(&self) -> Option<(WeightTag, QuantFormat)> {
        self.tags()
            .into_iter()
            .find_map(|(_, _, tag)| self.storage(tag).and_then(|s| s.quant()).map(|f| (tag, f)))
    }

    /// Every tensor of the image with its offset and length.
    pub fn tags(&self) -> Vec<(u64, u64, WeightTag)> {
        let c = &self.checkpoint;
        let mut out = vec![(0, c.embed_bytes, WeightTag::Embed)];
        for layer in 0..c.layers {
            let base = c.layer_offset(layer);
            for seg in &self.layer_of(layer as u32).segments {
                let tag = WeightTag::Layer {
                    layer: layer as u32,
                    kind: seg.kind,
                };
                out.push((base + seg.offset as u64, seg.len_bytes as u64, tag));
            }
        }
        let head = c.head_offset();
        out.push((head, self.final_norm_bytes, WeightTag::FinalNorm));
        out.push((
            head + self.final_norm_bytes,
            c.head_bytes - self.final_norm_bytes,
            WeightTag::LmHead,
        ));
        out
    }

    /// Bytes of a tensor.
    pub fn tag_len(&self, tag: WeightTag) -> u64 {
        match tag {
            WeightTag::Embed => self.checkpoint.embed_bytes,
            WeightTag::FinalNorm => self.final_norm_bytes,
            WeightTag::LmHead => self.checkpoint.head_bytes - self.final_norm_bytes,
            WeightTag::Layer { layer, kind } => self
                .layer_of(layer)
                .segment(kind)
                .map(|s| s.len_bytes as u64)
                .unwrap_or(0),
            WeightTag::Converted { format, .. } => {
                format.bytes_for(self.tag_elems(tag)).unwrap_or(0) as u64
            }
        }
    }

    /// The initial labels of the image.
    pub fn map(&self) -> WeightMap {
        let mut map = WeightMap::default();
        for (start, len, tag) in self.tags() {
            map.insert(start, len, tag, 0);
        }
        map
    }
}

/// Why the weights image could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The checkpoint's stored layout does not match the card the schedule was compiled for.
    #[error("checkpoint {dir}: {what} takes {got} bytes but the compiled schedule assumes {expected} (is the checkpoint stored in the card's dtype?)")]
    Mismatch {
        /// The checkpoint folder.
        dir: String,
        /// Which part.
        what: &'static str,
        /// Bytes in the checkpoint.
        got: u64,
        /// Bytes the IR assumes.
        expected: u64,
    },
    /// A tensor's stored bytes do not fill its place in the image.
    #[error(
        "checkpoint {dir}: {tag} takes {got} bytes but the compiled schedule assumes {expected}"
    )]
    Tensor {
        /// The checkpoint folder.
        dir: String,
        /// The tensor.
        tag: WeightTag,
        /// Bytes in the checkpoint.
        got: u64,
        /// Bytes the image layout gives it.
        expected: u64,
    },
    /// The memory for the tiles the CPU backend repacks quantised matrices into could
    /// not be mapped.
    #[error("weights image: {bytes} bytes for the repacked tiles could not be mapped: {why}")]
    TileArena {
        /// Bytes asked for.
        bytes: usize,
        /// The OS's answer.
        why: String,
    },
    /// Two tensors of the image layout overlap (a hand-built layout).
    #[error("weights image layout: {first} overlaps {second}")]
    Overlap {
        /// The earlier tensor.
        first: WeightTag,
        /// The later one.
        second: WeightTag,
    },
}

/// Checks the checkpoint against the program's layout and returns the image geometry.
pub fn image_layout(
    checkpoint: &Checkpoint,
    layout: CheckpointLayout,
) -> Result<ImageLayout, ImageError> {
    let dir = checkpoint.dir().display().to_string();
    let mismatch = |what, got: u64, expected: u64| ImageError::Mismatch {
        dir: dir.clone(),
        what,
        got,
        expected,
    };
    // The first MoE layer's layout stands for every MoE layer's (and the first layer's
    // for every dense one's): the checkpoint checks each layer's tensors at open.
    let moe_layer = layout.dense_layers.min(layout.layers.saturating_sub(1));
    let layer = checkpoint.layer_layout(moe_layer as usize)?;
    let dense_layer = if layout.dense_layers > 0 {
        let dense = checkpoint.layer_layout(0)?;
        if dense.image_bytes as u64 != layout.layer_bytes_of(0) {
            return Err(mismatch(
                "one dense layer",
                dense.image_bytes as u64,
                layout.layer_bytes_of(0),
            ));
        }
        Some(dense)
    } else {
        None
    };
    if !layout.is_dense(moe_layer) {
        if layer.image_bytes as u64 != layout.layer_bytes_of(moe_layer) {
            return Err(mismatch(
                "one layer",
                layer.image_bytes as u64,
                layout.layer_bytes_of(moe_layer),
            ));
        }
        let expert = layer.expert_range(0);
        if (expert.end - expert.start) as u64 != layout.expert_bytes {
            return Err(mismatch(
                "one expert",
                (expert.end - expert.start) as u64,
                layout.expert_bytes,
            ));
        }
    }
    let head = checkpoint.head_tensors()?;
    let embed = head.embed.bytes.len() as u64;
    if embed != layout.embed_bytes {
        return Err(mismatch("the embedding", embed, layout.embed_bytes));
    }
    let final_norm_bytes = head.final_norm.bytes.len() as u64;
    let lm_head = head.lm_head.bytes.len() as u64;
    let expected_lm_head = layout.head_bytes.saturating_sub(final_norm_bytes);
    if lm_head != expected_lm_head {
        return Err(mismatch("the lm_head", lm_head, expected_lm_head));
    }
    // Every layer's own formats, in the shared geometry (checked per layer: a layer whose
    // tensors need more room than the compiled schedule gives it is an error naming it).
    let mut layers = Vec::with_capacity(layout.layers as usize);
    for l in 0..layout.layers {
        let own = checkpoint.layer_layout(l as usize)?;
        if own.image_bytes as u64 != layout.layer_bytes_of(l) {
            return Err(mismatch(
                "a layer",
                own.image_bytes as u64,
                layout.layer_bytes_of(l),
            ));
        }
        layers.push(own);
    }
    let storage = |t: &crate::weights::checkpoint::StoredTensor<'_>| {
        t.quant.map_or(Storage::Float(t.dtype), Storage::Quant)
    };
    Ok(ImageLayout {
        checkpoint: layout,
        layer,
        dense_layer,
        layers,
        final_norm_bytes,
        head_storage: [
            storage(&head.embed),
            storage(&head.final_norm),
            storage(&head.lm_head),
        ],
        vocab_hidden: (checkpoint.arch().vocab, checkpoint.arch().hidden),
        tiled: HashSet::new(),
    })
}
