//! llama.cpp's `llama` architecture (how `convert_hf_to_gguf.py` writes Mixtral) read as a
//! moec checkpoint.
//!
//! Takes an opened [`GgufFile`]; gives the model card (built from the GGUF metadata
//! through the same config reader as a Hugging Face `config.json`, so every card check
//! applies) and, for every tensor the Hub checkpoint names, where its bytes are in the
//! GGUF file: llama.cpp's names (`blk.{i}.attn_q.weight`, the merged
//! `blk.{i}.ffn_{gate,up,down}_exps.weight` whose expert `e` is a contiguous block of
//! rows), its storage, and whether its rows must be put back in the Hub's order (the
//! converter permutes `q_proj`/`k_proj` rows per head for llama.cpp's interleaved rotary
//! pairs; moec's rotary kernel uses the Hub's split halves). Metadata that contradicts the
//! tensors (a head count whose shapes disagree, an expert count the merged tensors do not
//! hold) is an error naming the tensor.

use super::{GgufError, GgufFile, Storage};
use crate::model::arch::ArchSpec;
use crate::model::card::{Family, ModelCard};
use crate::model::layout::{LayerLayout, SegmentKind};
use crate::model::names::{head_names, segment_source};
use std::ops::Range;

/// Where one Hub-named tensor's bytes are in the GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedTensor {
    /// The Hub name moec's readers ask for.
    pub name: String,
    /// Its Hub shape (outermost first).
    pub shape: Vec<usize>,
    /// How its elements are stored.
    pub storage: Storage,
    /// Its bytes inside the file's map.
    pub range: Range<usize>,
    /// For `q_proj`/`k_proj`: the head count whose per-head row interleaving the converter
    /// applied (rows must be un-interleaved before use).
    pub unpermute_heads: Option<usize>,
    /// The GGUF tensor it comes from (for messages).
    pub gguf_name: String,
}

/// A GGUF file read as a checkpoint of one of moec's families.
#[derive(Debug, Clone)]
pub struct Imported {
    /// The architecture, from the metadata.
    pub card: ModelCard,
    /// Every tensor the family's Hub checkpoint has.
    pub tensors: Vec<ImportedTensor>,
}

/// The `config.json` keys of a Mixtral config, from the GGUF metadata keys of the `llama`
/// architecture.
fn mixtral_config(file: &GgufFile) -> Result<serde_json::Value, GgufError> {
    let a = "llama";
    let u = |k: &str| file.get_u64(&format!("{a}.{k}"));
    let heads = u("attention.head_count")?;
    let hidden = u("embedding_length")?;
    let head_dim = match file.metadata.get(&format!("{a}.attention.key_length")) {
        Some(_) => u("attention.key_length")?,
        None if heads > 0 => hidden / heads,
        None => 0,
    };
    let vocab = match file.metadata.get(&format!("{a}.vocab_size")) {
        Some(_) => u("vocab_size")?,
        None => match file.get("tokenizer.ggml.tokens")? {
            super::Value::Array(tokens) => tokens.len() as u64,
            _ => 0,
        },
    };
    let opt_u = |k: &str| file.metadata.get(k).and_then(|v| v.as_u64());
    Ok(serde_json::json!({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": u("feed_forward_length")?,
        "num_attention_heads": heads,
        "num_key_value_heads": u("attention.head_count_kv")?,
        "head_dim": head_dim,
        "num_hidden_layers": u("block_count")?,
        "num_local_experts": u("expert_count")?,
        "num_experts_per_tok": u("expert_used_count")?,
        "vocab_size": vocab,
        "max_position_embeddings": u("context_length")?,
        "rope_theta": file.get_f64(&format!("{a}.rope.freq_base"))?,
        "rms_norm_eps": file.get_f64(&format!("{a}.attention.layer_norm_rms_epsilon"))?,
        "bos_token_id": opt_u("tokenizer.ggml.bos_token_id"),
        "eos_token_id": opt_u("tokenizer.ggml.eos_token_id").unwrap_or(2),
        "tie_word_embeddings": !file.tensors.contains_key("output.weight"),
    }))
}

/// Reads `file` as a moec checkpoint; only llama.cpp's `llama` architecture with experts
/// (Mixtral) is read so far, anything else is an error naming the architecture.
pub fn import(file: &GgufFile, name: &str) -> Result<Imported, GgufError> {
    let arch_name = file.get_str("general.architecture")?;
    let meta_err = |key: &str, message: String| GgufError::Metadata {
        path: file.path().display().to_string(),
        key: key.into(),
        message,
    };
    if arch_name != "llama" || !file.metadata.contains_key("llama.expert_count") {
        return Err(meta_err(
            "general.architecture",
            format!(
                "`{arch_name}` is not read yet: moec imports llama.cpp's `llama` architecture with \
                 experts (Mixtral); Qwen3-MoE, DeepSeek-V2 and the other families are to come"
            ),
        ));
    }
    let config = mixtral_config(file)?;
    let path = file.path().display().to_string();
    let mut card = crate::model::config::card_from_config(&config.to_string(), &path, name)
        .map_err(|e| meta_err("(hyper-parameters)", e.to_string()))?;
    card.description = format!("Mixtral-family GGUF `{name}` (from its metadata)");
    let arch = ArchSpec::from_card(&card);
    let (q_heads, kv_heads) = (arch.attn.heads, arch.attn.kv_heads);
    let mut tensors = Vec::new();
    let mut add = |name: String,
                   shape: Vec<usize>,
                   gguf: &str,
                   gguf_shape: Vec<usize>,
                   rows: Option<Range<usize>>,
                   unpermute_heads: Option<usize>|
     -> Result<(), GgufError> {
        let (info, storage) = file.tensor(gguf, &gguf_shape)?;
        let cols = *gguf_shape.last().unwrap_or(&1);
        let row_bytes = storage
            .bytes_for(cols as u64)
            .ok_or_else(|| GgufError::Tensor {
                path: path.clone(),
                tensor: gguf.into(),
                message: format!("rows of {cols} are not whole {} blocks", storage.name()),
            })? as usize;
        let range = match rows {
            Some(r) => info.range.start + r.start * row_bytes..info.range.start + r.end * row_bytes,
            None => info.range.clone(),
        };
        tensors.push(ImportedTensor {
            name,
            shape,
            storage,
            range,
            unpermute_heads,
            gguf_name: gguf.into(),
        });
        Ok(())
    };
    let (d, f, e, vocab) = (arch.hidden, arch.ffn, arch.experts, arch.vocab);
    let (embed_name, norm_name) = head_names(Family::Mixtral);
    add(
        embed_name.into(),
        vec![vocab, d],
        "token_embd.weight",
        vec![vocab, d],
        None,
        None,
    )?;
    add(
        norm_name.into(),
        vec![d],
        "output_norm.weight",
        vec![d],
        None,
        None,
    )?;
    let head = if file.tensors.contains_key("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    add(
        "lm_head.weight".into(),
        vec![vocab, d],
        head,
        vec![vocab, d],
        None,
        None,
    )?;
    for layer in 0..arch.layers {
        for kind in LayerLayout::kinds(&arch, layer) {
            let src = segment_source(&arch, layer, kind);
            let b = |t: &str| format!("blk.{layer}.{t}.weight");
            let (gguf, gguf_shape, rows, heads) = match kind {
                SegmentKind::AttnNorm => (b("attn_norm"), src.shape.clone(), None, None),
                SegmentKind::FfnNorm => (b("ffn_norm"), src.shape.clone(), None, None),
                SegmentKind::QProj => (b("attn_q"), src.shape.clone(), None, Some(q_heads)),
                SegmentKind::KProj => (b("attn_k"), src.shape.clone(), None, Some(kv_heads)),
                SegmentKind::VProj => (b("attn_v"), src.shape.clone(), None, None),
                SegmentKind::OProj => (b("attn_output"), src.shape.clone(), None, None),
                SegmentKind::Router => (b("ffn_gate_inp"), src.shape.clone(), None, None),
                SegmentKind::ExpertGate(x) => (b("ffn_gate_exps"), vec![e, f, d], Some(x * f..(x + 1) * f), None),
                SegmentKind::ExpertUp(x) => (b("ffn_up_exps"), vec![e, f, d], Some(x * f..(x + 1) * f), None),
                SegmentKind::ExpertDown(x) => (b("ffn_down_exps"), vec![e, d, f], Some(x * d..(x + 1) * d), None),
                other => {
                    return Err(meta_err(
                        "general.architecture",
                        format!("the Mixtral layout has a {other:?} segment moec cannot map to a GGUF tensor"),
                    ))
                }
            };
            add(src.name, src.shape, &gguf, gguf_shape, rows, heads)?;
        }
    }
    Ok(Imported { card, tensors })
}

/// Puts back the Hub's row order of a `q_proj`/`k_proj` matrix that `convert_hf_to_gguf.py`
/// permuted for `heads` heads: within each head of `2h` rows, the converter stores Hub row
/// `p * h + i` (half `p`, pair `i`) at position `2i + p`. Rows are moved whole (`row_bytes`
/// each), so this works for every storage. `None` when the sizes do not divide.
pub fn unpermute_rows(bytes: &[u8], heads: usize, row_bytes: usize) -> Option<Vec<u8>> {
    let rows = bytes.len().checked_div(row_bytes)?;
    let per_head = rows.checked_div(heads)?;
    if row_bytes == 0
        || rows * row_bytes != bytes.len()
        || per_head * heads != rows
        || per_head % 2 != 0
    {
        return None;
    }
    let half = per_head / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for p in 0..2 {
            for i in 0..half {
                let hub = h * per_head + p * half + i;
                let stored = h * per_head + 2 * i + p;
                out[hub * row_bytes..(hub + 1) * row_bytes]
                    .copy_from_slice(&bytes[stored * row_bytes..(stored + 1) * row_bytes]);
            }
        }
    }
    Some(out)
}
