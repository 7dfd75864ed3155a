//! Format copies of the experts (`W[l].expert(e).format(q8_0)`, `BufferKind::FormatCopy`):
//! made once at load, before the first step, into their slots of the `host` arena.
//!
//! Takes the plan's format copies, the weights image and the `host` arena; gives every
//! converted segment's bytes (decoded from the checkpoint's format to f32, transposed to
//! `[out, in]` where the checkpoint stores the matrix `[in, out]` (the Hub's DBRX down
//! projection, gpt-oss's experts: block formats run along stored rows, as `moec quantize`
//! writes them), and quantised as ggml's reference quantisers do, `quant::encode`) and its labels
//! (`WeightTag::Converted`), so copies move them like any weight and an op that finds an
//! expert only in this form computes with it (on either backend: a device backend copies
//! the converted bytes from here, registered with its driver where it can). Slot `(l - dense_layers) * experts + e` holds
//! expert `e` of layer `l`, laid out as that expert of the card with its experts in the
//! copy's format (`model::layout::with_expert_storage`), which is how the compiler sized it.

use super::arena::Arena;
use super::image::MappedImage;
use super::weights::{ImageLayout, WeightTag};
use crate::lower::{ExecPlan, Placement};
use crate::model::arch::ArchSpec;
use crate::model::layout::{LayerLayout, Segment};
use crate::model::vocab::Orientation;

/// One converted segment: where it lies in the `host` arena and what it is.
pub(super) struct Converted {
    /// Offset in the `host` arena.
    pub start: u64,
    /// Bytes.
    pub len: u64,
    /// Its label.
    pub tag: WeightTag,
}

/// Fills every format copy of `plan` in `host` (the `host` arena) from `image`; gives the
/// labels of what it wrote, or what stopped it, in words.
pub(super) fn make_format_copies(
    plan: &ExecPlan,
    image: &MappedImage<'_>,
    layout: &ImageLayout,
    host: &Arena,
) -> Result<Vec<Converted>, String> {
    let mut out = Vec::new();
    for copy in &plan.format_copies {
        let Some(slot) = plan.buffers.get(copy.buffer.index()) else {
            return Err(format!(
                "format copy of buffer #{} not in the plan",
                copy.buffer.index()
            ));
        };
        let Placement::Arena { offset: base, .. } = slot.placement else {
            return Err(format!("`{}` is not placed in an arena", slot.name));
        };
        let Some(format) = copy.format.quant() else {
            return Err(format!(
                "`{}`: the runtime makes format copies only in block formats (q8_0, q4_k, ...), not {}",
                slot.name,
                copy.format.name()
            ));
        };
        let card = crate::model::layout::with_expert_storage(&plan.model, copy.format)
            .map_err(|e| format!("`{}`: {e}", slot.name))?;
        let arch = ArchSpec::from_card(&card);
        let c = &plan.checkpoint;
        for layer in c.dense_layers..c.layers {
            let converted = LayerLayout::for_card(&card, &arch, layer as usize);
            for e in 0..c.experts as usize {
                let expert_start = converted.expert_range(e).start as u64;
                let slot_base =
                    base + ((layer - c.dense_layers) * c.experts + e as u64) * copy.expert_bytes;
                for seg in converted
                    .segments
                    .iter()
                    .filter(|s| s.kind.expert() == Some(e))
                {
                    let src_tag = WeightTag::Layer {
                        layer: layer as u32,
                        kind: seg.kind,
                    };
                    let src = image
                        .tensor(src_tag)
                        .ok_or_else(|| format!("{src_tag}: not in the weights image"))?;
                    let values = layout.typed(src_tag, src)?.to_f32_vec();
                    let stored =
                        layout
                            .layer_of(layer as u32)
                            .segment(seg.kind)
                            .ok_or_else(|| {
                                format!("{src_tag}: not in the checkpoint's layer layout")
                            })?;
                    let values = in_copy_order(&values, stored, seg)
                        .map_err(|e| format!("{src_tag} as {}: {e}", format.name()))?;
                    // Vectors (biases) stay in their float format, as the layout keeps them.
                    let (bytes, tag) = match seg.quant {
                        Some(q) => (
                            crate::quant::encode::quantize_row(q, &values)
                                .map_err(|e| format!("{src_tag} as {}: {e}", q.name()))?,
                            WeightTag::Converted {
                                layer: layer as u32,
                                kind: seg.kind,
                                format,
                            },
                        ),
                        None => (src.to_vec(), src_tag),
                    };
                    let start = slot_base + seg.offset as u64 - expert_start;
                    // SAFETY: load time, before any step: no task runs and no other view of
                    // the `host` arena exists; the range is inside the copy's slot, which
                    // lowering placed inside the arena.
                    let dst = unsafe { host.bytes_mut(start, bytes.len() as u64) }
                        .map_err(|e| e.to_string())?;
                    dst.copy_from_slice(&bytes);
                    out.push(Converted {
                        start,
                        len: bytes.len() as u64,
                        tag,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// A segment's values, decoded from the checkpoint's `stored` segment, in the order of the
/// copy's segment `copy`: transposed where the checkpoint stores the matrix `[in, out]`
/// and the copy `[out, in]` ([`Segment::block_copy_shape`]), as they are where both agree.
/// An error where the two shapes are not one matrix's.
fn in_copy_order(values: &[f32], stored: &Segment, copy: &Segment) -> Result<Vec<f32>, String> {
    let orientation = |s: &Segment| s.orientation.unwrap_or(Orientation::OutIn);
    let (from, to) = (orientation(stored), orientation(copy));
    let shape = |s: &Segment| format!("[{}, {}] {:?}", s.rows, s.cols, orientation(s));
    let mismatch = || {
        format!(
            "the checkpoint stores it {} and the copy is laid out {}",
            shape(stored),
            shape(copy)
        )
    };
    match (from, to) {
        (Orientation::InOut, Orientation::OutIn) => {
            if (copy.rows, copy.cols) != (stored.cols, stored.rows) {
                return Err(mismatch());
            }
            crate::model::layout::transpose(values, stored.rows, stored.cols)
                .ok_or_else(|| format!("{} values, not {}", values.len(), shape(stored)))
        }
        _ if from == to && (copy.rows, copy.cols) == (stored.rows, stored.cols) => {
            Ok(values.to_vec())
        }
        _ => Err(mismatch()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::segment::SegmentKind;
    use crate::quant::storage::WeightDtype;
    use crate::quant::QuantFormat;

    fn segment(rows: usize, cols: usize, orientation: Orientation) -> Segment {
        Segment {
            kind: SegmentKind::ExpertDown(0),
            offset: 0,
            len_bytes: 0,
            slot_bytes: 0,
            rows,
            cols,
            dtype: WeightDtype::F32,
            quant: None,
            orientation: Some(orientation),
        }
    }

    /// An `[in, out]` matrix of 2 inputs and 32 outputs (`w[i][o] = 100 i + o`), copied to
    /// q8_0: 32 rows of 2 after the transpose, so the copy's row `o` holds `(o, 100 + o)`.
    /// Quantised and decoded, each value is within its block's step (the block's largest
    /// magnitude / 127) of the hand-worked transpose, and far from the untransposed value
    /// at the same position.
    #[test]
    fn an_in_out_matrix_is_copied_transposed() {
        let (ins, outs) = (2usize, 32usize);
        let w: Vec<f32> = (0..ins * outs)
            .map(|k| (100 * (k / outs) + k % outs) as f32)
            .collect();
        let stored = segment(ins, outs, Orientation::InOut);
        let copy = Segment {
            quant: Some(QuantFormat::Q8_0),
            ..segment(outs, ins, Orientation::OutIn)
        };
        let t = in_copy_order(&w, &stored, &copy).unwrap();
        // Copy row o = output o over both inputs; rows of 2 make 64 values, 2 blocks.
        let want: Vec<f32> = (0..outs)
            .flat_map(|o| [o as f32, (100 + o) as f32])
            .collect();
        assert_eq!(t, want);
        let q = crate::quant::encode::quantize_row(QuantFormat::Q8_0, &t).unwrap();
        let mut back = vec![0f32; t.len()];
        crate::quant::blocks::dequantize_blocks(QuantFormat::Q8_0, &q, &mut back).unwrap();
        for (block, (got, want)) in back.chunks(32).zip(want.chunks(32)).enumerate() {
            let step = want.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (i, (g, x)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - x).abs() <= step,
                    "block {block} value {i}: {g} for {x}"
                );
            }
        }
        // Position 1 of the copy is w[1][0] = 100, where the stored order has w[0][1] = 1.
        assert!((back[1] - 100.0).abs() < 1.0, "{}", back[1]);
        // An `[out, in]` checkpoint matrix is copied as it is; shapes of two matrices fail.
        let same = segment(outs, ins, Orientation::OutIn);
        assert_eq!(in_copy_order(&w, &same, &copy).unwrap(), w);
        let e = in_copy_order(&w, &segment(ins, outs, Orientation::OutIn), &copy).unwrap_err();
        assert!(
            e.contains("[2, 32] OutIn") && e.contains("[32, 2] OutIn"),
            "{e}"
        );
    }
}
