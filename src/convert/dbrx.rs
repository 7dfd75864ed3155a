//! DBRX written as llama.cpp's `dbrx` architecture, what `convert_hf_to_gguf.py`'s
//! `DbrxModel` writes (and `llama-quantize` keeps).
//!
//! Takes the checkpoint's card (read from its `config.json`, so the values are the
//! config's); gives the hyper-parameter keys `DbrxModel.set_gguf_parameters` writes (it
//! replaces `TextModel`'s: block count, context, widths, heads, rotary base, `clamp_kqv`,
//! experts, LayerNorm epsilon 1e-5 whatever the config says), and the stored orientation
//! after the per-expert transposition the converter applies to the Hub's fused `w2`
//! (made by [`crate::model::layout::transpose`], which format copies share): it views the in-out
//! `[experts * ffn, hidden]` tensor as `[experts, ffn, hidden]` and permutes each expert to
//! `[hidden, ffn]`, out-in like every other ggml matrix (`w1`/`v1` are already out-in and
//! only gain the expert dimension). The tensor names come from the importer's map
//! ([`crate::weights::gguf::llama::place`]: `attn_qkv`, `attn_output_norm` for the second
//! LayerNorm, `ffn_{gate,up,down}_exps`), the vocabulary from [`super::gpt2`].

use super::ExportError;
use crate::convert::write::MetaValue;
use crate::model::arch::ArchSpec;
use crate::weights::gguf::families::gguf_family;

/// The `dbrx.*` keys (and `general.architecture`) as the converter writes them for `arch`;
/// `name` is `general.name`, `file_type` `general.file_type`. A checkpoint without
/// `clip_qkv` is refused, as the converter fails on it (`add_clamp_kqv(None)`).
pub(super) fn metadata(
    arch: &ArchSpec,
    name: &str,
    file_type: u32,
) -> Result<Vec<(String, MetaValue)>, ExportError> {
    let clip = arch.clip_qkv.ok_or_else(|| {
        ExportError::Unsupported(
            "a DBRX checkpoint without `attn_config.clip_qkv`: llama.cpp's converter writes \
             `dbrx.attention.clamp_kqv` from it and fails without one"
                .into(),
        )
    })?;
    let u = |k: &str, v: usize| (format!("dbrx.{k}"), MetaValue::U32(v as u32));
    let f = |k: &str, v: f32| (format!("dbrx.{k}"), MetaValue::F32(v));
    let mut meta = super::metadata::shape_metadata("dbrx", arch, name);
    meta.extend([
        f("rope.freq_base", arch.rope_theta as f32),
        f("attention.clamp_kqv", clip),
        u("expert_count", arch.experts),
        u("expert_used_count", arch.top_k),
        // `DbrxModel` writes 1e-5: DBRX's LayerNorm epsilon, which its config lacks.
        f("attention.layer_norm_epsilon", 1e-5),
        ("general.file_type".into(), MetaValue::U32(file_type)),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ]);
    Ok(meta)
}

/// `arch` as the file stores it, for checking formats against: DBRX's expert down
/// projection out-in (the converter transposes each expert's `w2`, so it quantises as a
/// matrix of `hidden` rows of `ffn`); another family's as it is.
pub(super) fn as_stored(arch: &ArchSpec) -> ArchSpec {
    let mut stored = arch.clone();
    if gguf_family(arch.family).dbrx_layout {
        stored.experts_out_in = true;
    }
    stored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_without_clip_is_refused_as_the_converter_fails_on_it() {
        let card = crate::model::card::ModelCard::load("dbrx-tiny").unwrap();
        let mut arch = ArchSpec::from_card(&card);
        assert!(metadata(&arch, "x", 7).is_ok());
        arch.clip_qkv = None;
        assert!(metadata(&arch, "x", 7).is_err());
    }
}
