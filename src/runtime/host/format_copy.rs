//! Format copies of the experts (`W[l].expert(e).format(q8_0)`, `BufferKind::FormatCopy`):
//! made once at load, before the first step, into their slots of the `host` arena.
//!
//! Takes the plan's format copies, the weights image and the `host` arena; gives every
//! converted segment's bytes (decoded from the checkpoint's format to f32 and quantised as
//! ggml's reference quantisers do, `quant::encode`) and its labels
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
use crate::model::layout::LayerLayout;

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
