//! llama.cpp's architectures as moec's families: which `general.architecture` is which
//! family, the shape of a family's GGUF row ([`GgufFamily`]: how the converter and loader
//! store it), and the reader of the `{arch}.*` metadata keys `convert_hf_to_gguf.py` writes
//! ([`Meta`]). Each family's row and its `config.json` built from those keys live in its
//! own module (`weights::family::<name>`, `FamilySpec::gguf` and
//! `FamilySpec::config_from_gguf`).
//!
//! Takes an opened [`GgufFile`]; gives the family and its config as JSON, which the
//! family's own config reader then checks like any `config.json` (so a GGUF gets every
//! card check a Hub checkpoint gets). Where llama.cpp hard-codes what the Hub config
//! says (Qwen3-MoE always renormalises its top-k weights, Qwen2-MoE and OLMoE never do;
//! Qwen and DeepSeek rotate split halves or pairs without a row permutation; gpt-oss's
//! clamped SwiGLU is alpha 1.702, limit 7 and its YaRN correction range is truncated;
//! DBRX always renormalises its top-k weights by their sum), the config says the same.

use super::{GgufError, GgufFile, Value};
use crate::model::family::facts::{Family, FAMILIES};
use crate::weights::family::spec;
use serde_json::json;

/// Which keys and vocabulary `convert_hf_to_gguf.py` writes for a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufKeys {
    /// `llama`'s keys and the SentencePiece vocabulary (`LlamaHfVocab`): Mixtral.
    Llama,
    /// DBRX's own keys and a GPT-2 vocabulary.
    Dbrx,
    /// `TextModel.set_gguf_parameters`' keys from config.json and a GPT-2 vocabulary.
    Text,
}

/// The norm epsilon llama.cpp's converter writes for a family.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EpsRule {
    /// The config's, when it has one.
    Config,
    /// This value whatever the config says (OLMoE's converter).
    Fixed(f64),
    /// The config's, else this value (DeepSeek's converter).
    ConfigOr(f64),
}

/// How llama.cpp's converter and loader store one family: one row per family, in the
/// family's own module (`FamilySpec::gguf`), read by the GGUF reader
/// (`weights::gguf::llama`) and by `moec quantize` (`crate::convert`) alike, so no code
/// outside the family modules and `model` matches on the family.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GgufFamily {
    /// The family this row describes.
    pub family: Family,
    /// llama.cpp's `general.architecture` for the family (DeepSeek-V2 and V3 share
    /// `deepseek2`, told apart by their gating function).
    pub arch: &'static str,
    /// The keys and vocabulary the converter writes.
    pub keys: GgufKeys,
    /// The converter permutes `q_proj`/`k_proj` rows for llama.cpp's paired rotation
    /// (only `llama`); the others are stored as the Hub stores them.
    pub permuted_qk: bool,
    /// gpt-oss's experts: the fused `gate_up_proj` split into gate and up rows, every
    /// expert matrix out-in, a Hub checkpoint's MXFP4 blocks copied as they are, sinks and
    /// the post-attention norm under their own names.
    pub gpt_oss_experts: bool,
    /// The converter transposes each expert's `w2` to out-in and names the post-attention
    /// norm `attn_output_norm` (DBRX).
    pub dbrx_layout: bool,
    /// MLA's keys (`kv_lora_rank`, ...) and no per-head key/value length keys (DeepSeek).
    pub mla_keys: bool,
    /// The routed and shared experts' widths under their own keys (Qwen's MoE).
    pub expert_width_keys: bool,
    /// The norm epsilon written.
    pub eps: EpsRule,
}

/// The row most families spread their own under: `TextModel.set_gguf_parameters`' keys,
/// nothing permuted, transposed or renamed, the config's epsilon.
pub(crate) const TEXT: GgufFamily = GgufFamily {
    family: Family::Mixtral,
    arch: "",
    keys: GgufKeys::Text,
    permuted_qk: false,
    gpt_oss_experts: false,
    dbrx_layout: false,
    mla_keys: false,
    expert_width_keys: false,
    eps: EpsRule::Config,
};

/// The family's GGUF row (its module's).
pub fn gguf_family(family: Family) -> &'static GgufFamily {
    spec(family).gguf()
}

/// The family of `file`'s architecture, or an error naming an architecture moec does
/// not import.
pub fn family_of(file: &GgufFile) -> Result<Family, GgufError> {
    let arch = file.get_str("general.architecture")?;
    let named: Vec<Family> = FAMILIES
        .into_iter()
        .filter(|f| gguf_family(*f).arch == arch)
        .collect();
    Ok(match named[..] {
        // llama.cpp's `llama` without experts is a dense Llama, which moec does not run.
        [family] if arch != "llama" || file.metadata.contains_key("llama.expert_count") => family,
        // DeepSeek-V2 and V3 (in that order in `FAMILIES`) are both `deepseek2`; V3 gates
        // with a sigmoid (2).
        [v2, v3] => match file.metadata.get(&format!("{arch}.expert_gating_func")) {
            Some(v) if v.as_u64() == Some(2) => v3,
            _ => v2,
        },
        _ => {
            return Err(GgufError::Metadata {
                path: file.path().display().to_string(),
                key: "general.architecture".into(),
                message: format!(
                    "`{arch}` is not imported: moec reads llama.cpp's `llama` with experts \
                     (Mixtral), `qwen3moe`, `qwen2moe`, `olmoe`, `deepseek2`, `gpt-oss` and `dbrx`"
                ),
            })
        }
    })
}

/// The architecture's metadata keys, `{arch}.{key}`, as a family's
/// `FamilySpec::config_from_gguf` reads them.
pub struct Meta<'a> {
    /// The file.
    pub file: &'a GgufFile,
    /// Its `general.architecture`.
    pub arch: &'static str,
}

impl Meta<'_> {
    /// `{arch}.{key}` as an unsigned integer.
    pub fn u(&self, key: &str) -> Result<u64, GgufError> {
        self.file.get_u64(&format!("{}.{key}", self.arch))
    }

    /// `{arch}.{key}` read by `get` when present (absent is `None`, a wrong type an error).
    pub fn opt<T>(
        &self,
        key: &str,
        get: fn(&GgufFile, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        let full = format!("{}.{key}", self.arch);
        match self.file.metadata.get(&full) {
            Some(_) => get(self.file, &full).map(Some),
            None => Ok(None),
        }
    }

    /// `{arch}.{key}` as an unsigned integer when present.
    pub fn opt_u(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.opt(key, GgufFile::get_u64)
    }

    /// `{arch}.{key}` as a float.
    pub fn f(&self, key: &str) -> Result<f64, GgufError> {
        self.file.get_f64(&format!("{}.{key}", self.arch))
    }

    /// `{arch}.{key}` as a float when present.
    pub fn opt_f(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.opt(key, GgufFile::get_f64)
    }

    /// `{arch}.vocab_size`, else the length of the token list (llama.cpp's own rule).
    pub fn vocab(&self) -> Result<u64, GgufError> {
        if let Some(v) = self.opt_u("vocab_size")? {
            return Ok(v);
        }
        match self.file.get("tokenizer.ggml.tokens")? {
            Value::Array(tokens) => Ok(tokens.len() as u64),
            other => Err(GgufError::Metadata {
                path: self.file.path().display().to_string(),
                key: "tokenizer.ggml.tokens".into(),
                message: format!("{other:?} is not an array"),
            }),
        }
    }

    /// A routed expert's FFN width: `expert_feed_forward_length`, else the dense
    /// `feed_forward_length` (files that write only one).
    pub fn expert_ffn(&self) -> Result<u64, GgufError> {
        match self.opt_u("expert_feed_forward_length")? {
            Some(f) => Ok(f),
            None => self.u("feed_forward_length"),
        }
    }

    /// The attention head width: `attention.key_length`, else hidden / heads.
    pub fn head_dim(&self, hidden: u64, heads: u64) -> Result<u64, GgufError> {
        Ok(match self.opt_u("attention.key_length")? {
            Some(k) => k,
            None => hidden.checked_div(heads).unwrap_or(0),
        })
    }

    /// The BOS id when the vocabulary says to add it (`tokenizer.ggml.add_bos_token`;
    /// absent, llama.cpp adds it for SentencePiece `llama` vocabularies only).
    pub fn bos(&self) -> Option<u64> {
        let add = match self.file.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            _ => {
                self.file
                    .metadata
                    .get("tokenizer.ggml.model")
                    .and_then(Value::as_str)
                    == Some("llama")
            }
        };
        if add {
            self.token("bos_token_id")
        } else {
            None
        }
    }

    /// `{arch}.rope.scaling.*` as the YaRN fields every Hub config spells alike (factor,
    /// original context, both betas), `None` without scaling; another scaling type is an
    /// error naming the key.
    pub fn yarn(&self) -> Result<Option<serde_json::Map<String, serde_json::Value>>, GgufError> {
        let key = format!("{}.rope.scaling.type", self.arch);
        match self.file.metadata.get(&key).and_then(Value::as_str) {
            Some("yarn") => Ok(json!({
                "factor": self.f("rope.scaling.factor")?,
                "original_max_position_embeddings": self.u("rope.scaling.original_context_length")?,
                "beta_fast": self.opt_f("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                "beta_slow": self.opt_f("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
            })
            .as_object()
            .cloned()),
            None | Some("none") => Ok(None),
            Some(other) => Err(GgufError::Metadata {
                path: self.file.path().display().to_string(),
                key,
                message: format!("`{other}` rope scaling is not supported (none or yarn)"),
            }),
        }
    }

    /// `tokenizer.ggml.{key}` when present.
    pub fn token(&self, key: &str) -> Option<u64> {
        self.file
            .metadata
            .get(&format!("tokenizer.ggml.{key}"))
            .and_then(Value::as_u64)
    }
}

/// The `config.json` of `family` from `file`'s metadata (the family module's reader).
pub fn config(file: &GgufFile, family: Family) -> Result<serde_json::Value, GgufError> {
    let arch = gguf_family(family).arch;
    spec(family).config_from_gguf(&Meta { file, arch })
}

/// `dbrx.attention.layer_norm_epsilon`, which llama.cpp's DBRX LayerNorms use (DBRX's Hub
/// config has no key for it; its card says 1e-5, what the converter writes).
pub fn dbrx_norm_eps(file: &GgufFile) -> Result<f64, GgufError> {
    file.get_f64("dbrx.attention.layer_norm_epsilon")
}

#[cfg(test)]
mod table_tests {
    use super::*;

    /// Each family's module gives its own row, with an architecture name.
    #[test]
    fn every_family_has_its_gguf_row() {
        for family in FAMILIES {
            assert_eq!(gguf_family(family).family, family);
            assert!(!gguf_family(family).arch.is_empty(), "{family:?}");
        }
    }
}
