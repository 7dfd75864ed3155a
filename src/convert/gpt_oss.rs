//! gpt-oss written as llama.cpp's `gpt-oss` GGUF, as `convert_hf_to_gguf.py`'s
//! `GptOssModel` (llama-cpp-python 0.3.36's `conversion/gpt_oss.py`) writes it.
//!
//! The Hub stores each layer's experts fused: `gate_up_proj` `[experts, hidden, 2 * ffn]`
//! (in-out) with the gate and up columns interleaved (gate even, up odd), `down_proj`
//! `[experts, ffn, hidden]`, their biases `[experts, 2 * ffn]` and `[experts, hidden]`;
//! an MXFP4 checkpoint stores the two matrices as out-in `_blocks`/`_scales` pairs, which
//! moec reads as ggml's `block_mxfp4` rows. The converter writes them as llama.cpp's
//! merged `ffn_{gate,up,down}_exps.weight` (out-in, expert outermost) and
//! `ffn_{gate,up,down}_exps.bias`, the gate/up rows de-interleaved; MXFP4 experts stay
//! MXFP4, their blocks copied as they are (the same codes and exponents, never decoded
//! and quantised again). Everything else (attention with its biases and sinks, the
//! router with its bias, the norms) is a whole tensor the generic plan places; the
//! hyper-parameters add YaRN's rope-scaling keys, the sliding window and the expert FFN
//! width to the generic ones.

use super::Origin;
use crate::convert::write::{MetaValue, WriteError};
use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::formats::{WeightClass, WeightFormats, WeightTensor};
use crate::model::segment::SegmentKind;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use crate::weights::checkpoint::Checkpoint;
use crate::weights::names::segment_source;

/// One of the converter's merged expert tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// `ffn_gate_exps`: the even rows of `gate_up_proj` (out-in).
    Gate,
    /// `ffn_up_exps`: the odd rows.
    Up,
    /// `ffn_down_exps`.
    Down,
}

/// A merged expert tensor of one layer: its matrix, or (`bias`) its bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Experts {
    layer: usize,
    part: Part,
    bias: bool,
}

/// The GGUF tensors (name, ggml dims, origin) segment `kind` of layer `layer` becomes:
/// `None` for a kind that is not an expert tensor (the generic plan places it); an empty
/// list for experts past the first, whose rows the first's merged tensors already hold.
pub(super) fn expert_tensors(
    arch: &ArchSpec,
    layer: usize,
    kind: SegmentKind,
) -> Option<Vec<(String, Vec<u64>, Origin)>> {
    let (d, f, e) = (arch.hidden as u64, arch.ffn as u64, arch.experts as u64);
    let one = |part: Part, bias: bool| {
        let (stem, dims) = match (part, bias) {
            (Part::Gate, false) => ("ffn_gate_exps.weight", vec![d, f, e]),
            (Part::Up, false) => ("ffn_up_exps.weight", vec![d, f, e]),
            (Part::Down, false) => ("ffn_down_exps.weight", vec![f, d, e]),
            (Part::Gate, true) => ("ffn_gate_exps.bias", vec![f, e]),
            (Part::Up, true) => ("ffn_up_exps.bias", vec![f, e]),
            (Part::Down, true) => ("ffn_down_exps.bias", vec![d, e]),
        };
        let origin = Origin::GptOss(Experts { layer, part, bias });
        (format!("blk.{layer}.{stem}"), dims, origin)
    };
    let (x, parts, bias): (usize, &[Part], bool) = match kind {
        SegmentKind::ExpertGateUp(x) => (x, &[Part::Gate, Part::Up], false),
        SegmentKind::ExpertGateUpBias(x) => (x, &[Part::Gate, Part::Up], true),
        SegmentKind::ExpertDown(x) => (x, &[Part::Down], false),
        SegmentKind::ExpertDownBias(x) => (x, &[Part::Down], true),
        _ => return None,
    };
    Some(if x == 0 {
        parts.iter().map(|&p| one(p, bias)).collect()
    } else {
        Vec::new()
    })
}

/// `formats` with the checkpoint's own expert format where the user named none: an MXFP4
/// Hub checkpoint's experts stay MXFP4 (as the converter keeps them) unless `experts=`
/// (or `--all`) says otherwise.
pub(super) fn keep_stored_experts(card: &ModelCard, formats: &WeightFormats) -> WeightFormats {
    let mut out = formats.clone();
    let named = formats.classes.contains_key(&WeightClass::Experts)
        || formats
            .tensors
            .keys()
            .any(|t| t.class() == WeightClass::Experts);
    if !named {
        for (tensor, storage) in &card.formats.tensors {
            if tensor.class() == WeightClass::Experts {
                out.tensors.insert(*tensor, *storage);
            }
        }
    }
    out
}

/// `general.file_type` as the converter and llama-quantize set it for gpt-oss: the type
/// the attention weights are quantised to (the converter's `--outtype q8_0` keeps MXFP4
/// experts but is "mostly Q8_0"); with float attention, MXFP4 experts make the file
/// `MOSTLY_MXFP4_MOE` (38, the converter's rule for an MXFP4 checkpoint), else the
/// experts' type decides as for the other families.
pub(super) fn file_type(formats: &WeightFormats, dtype: WeightDtype) -> u32 {
    let experts = formats.storage(dtype, WeightTensor::layer(SegmentKind::ExpertGateUp(0)));
    let attention = formats.storage(dtype, WeightTensor::layer(SegmentKind::QProj));
    match (attention, experts) {
        (Storage::Quant(_), _) => super::file_type(attention),
        (_, Storage::Quant(QuantFormat::Mxfp4)) => 38,
        _ => super::file_type(experts),
    }
}

/// The keys `GptOssModel.set_gguf_parameters` adds to the generic ones: YaRN's (from
/// `rope_scaling`: type, factor, original context, beta fast/slow), the sliding window
/// and the expert FFN width (`intermediate_size`). Another rope scaling is an error.
pub(super) fn metadata(
    config: &serde_json::Value,
    arch_name: &str,
) -> Result<Vec<(String, MetaValue)>, String> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let count = |k: &str| -> Result<u32, String> {
        config[k]
            .as_u64()
            .map(|v| v as u32)
            .ok_or_else(|| format!("`{k}` is missing or not a count"))
    };
    let mut meta = super::metadata::yarn_metadata(config, arch_name, "gpt-oss")?;
    meta.push((
        key("attention.sliding_window"),
        MetaValue::U32(count("sliding_window")?),
    ));
    meta.push((
        key("expert_feed_forward_length"),
        MetaValue::U32(count("intermediate_size")?),
    ));
    Ok(meta)
}

/// Expert `x`'s rows of `part` from its `[out, in]` rows of the fused tensor (`rows`
/// rows of `row` items each): the gate's are the even rows of `gate_up_proj`, the up's
/// the odd ones, the down projection's all of them.
fn part_rows<T: Copy>(fused: &[T], row: usize, part: Part, out: &mut Vec<T>) {
    let rows = fused.len() / row.max(1);
    for r in 0..rows {
        let keep = match part {
            Part::Gate => r % 2 == 0,
            Part::Up => r % 2 == 1,
            Part::Down => true,
        };
        if keep {
            out.extend_from_slice(&fused[r * row..(r + 1) * row]);
        }
    }
}

/// The segment kind of expert `x`'s fused tensor for `part`.
fn fused_kind(part: Part, bias: bool, x: usize) -> SegmentKind {
    match (part, bias) {
        (Part::Down, false) => SegmentKind::ExpertDown(x),
        (Part::Down, true) => SegmentKind::ExpertDownBias(x),
        (_, false) => SegmentKind::ExpertGateUp(x),
        (_, true) => SegmentKind::ExpertGateUpBias(x),
    }
}

/// The Hub tensor a merged expert tensor is split from (its first expert's, which names
/// the fused tensor and its shape).
pub(super) fn hub_source(arch: &ArchSpec, t: &Experts) -> crate::weights::family::hub::Source {
    segment_source(arch, t.layer, fused_kind(t.part, t.bias, 0))
}

/// The values of a merged expert tensor in GGUF order (expert outermost, each expert's
/// matrix out-in), from the checkpoint's values (transposed from the Hub's in-out
/// layout unless the experts are stored out-in).
pub(super) fn values(ckpt: &Checkpoint, t: &Experts, name: &str) -> Result<Vec<f32>, WriteError> {
    let arch = ckpt.arch();
    let mut out = Vec::new();
    for x in 0..arch.experts {
        let src = segment_source(arch, t.layer, fused_kind(t.part, t.bias, x));
        let v = ckpt
            .source_f32(&src)
            .map_err(|e| WriteError::Source(format!("reading `{}` for `{name}`: {e}", src.name)))?;
        if t.bias {
            // A bias is one row: gate/up interleaved item by item.
            part_rows(&v, 1, t.part, &mut out);
            continue;
        }
        let cols = src.shape.last().copied().unwrap_or(1);
        let rows = src.rows.len();
        if v.len() != rows * cols {
            return Err(WriteError::Tensor {
                tensor: name.into(),
                message: format!(
                    "`{}` gave {} values, not {rows} x {cols}",
                    src.name,
                    v.len()
                ),
            });
        }
        let out_in = if arch.experts_out_in {
            v
        } else {
            (0..cols)
                .flat_map(|c| (0..rows).map(move |r| (r, c)))
                .map(|(r, c)| v[r * cols + c])
                .collect()
        };
        let row = if arch.experts_out_in { cols } else { rows };
        part_rows(&out_in, row, t.part, &mut out);
    }
    Ok(out)
}

/// The stored MXFP4 blocks of a merged expert matrix written as MXFP4 from an MXFP4
/// checkpoint (`None` otherwise: the values are encoded): each expert's block rows of
/// `part`, copied.
pub(super) fn packed(
    ckpt: &Checkpoint,
    t: &Experts,
    ggml_type: u32,
    name: &str,
) -> Result<Option<Vec<u8>>, WriteError> {
    if t.bias || ggml_type != QuantFormat::Mxfp4.ggml_type() {
        return Ok(None);
    }
    let arch = ckpt.arch();
    let failed = |e: String| WriteError::Source(format!("reading the experts for `{name}`: {e}"));
    let layout = ckpt
        .layer_layout(t.layer)
        .map_err(|e| failed(e.to_string()))?;
    let mut out = Vec::new();
    for x in 0..arch.experts {
        let kind = fused_kind(t.part, false, x);
        let Some(seg) = layout.segments.iter().find(|s| s.kind == kind) else {
            return Ok(None);
        };
        if seg.quant != Some(QuantFormat::Mxfp4) {
            return Ok(None);
        }
        let bytes = ckpt
            .segment_bytes(t.layer, seg)
            .map_err(|e| failed(e.to_string()))?;
        let row = QuantFormat::Mxfp4
            .bytes_for(seg.cols)
            .ok_or_else(|| failed(format!("rows of {} are not whole MXFP4 blocks", seg.cols)))?;
        part_rows(bytes, row, t.part, &mut out);
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_and_up_are_the_even_and_odd_rows() {
        let fused: Vec<u32> = (0..12).collect();
        let (mut gate, mut up, mut down) = (Vec::new(), Vec::new(), Vec::new());
        part_rows(&fused, 3, Part::Gate, &mut gate);
        part_rows(&fused, 3, Part::Up, &mut up);
        part_rows(&fused, 3, Part::Down, &mut down);
        assert_eq!(gate, [0, 1, 2, 6, 7, 8]);
        assert_eq!(up, [3, 4, 5, 9, 10, 11]);
        assert_eq!(down, fused);
    }
}
