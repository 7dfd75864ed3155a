//! llama.cpp's architectures as moec's families: which `general.architecture` is which
//! family, and the Hugging Face `config.json` of each, built from the GGUF metadata keys
//! `convert_hf_to_gguf.py` writes (`llama.*`, `qwen3moe.*`, `qwen2moe.*`, `olmoe.*`,
//! `deepseek2.*`, `gpt-oss.*`, `dbrx.*`).
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

/// How llama.cpp's converter and loader store one family, beyond its architecture name
/// (`FamilyFacts::gguf_arch`): one row per family, read by the GGUF reader
/// (`weights::gguf::llama`) and by `moec quantize` (`crate::convert`) alike, so no code
/// outside this table and `model` matches on the family.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GgufFamily {
    /// The family this row describes.
    pub family: Family,
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

const TEXT: GgufFamily = GgufFamily {
    family: Family::Mixtral,
    keys: GgufKeys::Text,
    permuted_qk: false,
    gpt_oss_experts: false,
    dbrx_layout: false,
    mla_keys: false,
    expert_width_keys: false,
    eps: EpsRule::Config,
};

/// One row per family, in the order of `FAMILIES`.
pub const GGUF_FAMILIES: [GgufFamily; 8] = [
    GgufFamily {
        family: Family::Mixtral,
        keys: GgufKeys::Llama,
        permuted_qk: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::Dbrx,
        keys: GgufKeys::Dbrx,
        dbrx_layout: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::Qwen2Moe,
        expert_width_keys: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::Qwen3Moe,
        expert_width_keys: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::Olmoe,
        eps: EpsRule::Fixed(1e-5),
        ..TEXT
    },
    GgufFamily {
        family: Family::GptOss,
        gpt_oss_experts: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::DeepseekV2,
        mla_keys: true,
        eps: EpsRule::ConfigOr(1e-6),
        ..TEXT
    },
    GgufFamily {
        family: Family::DeepseekV3,
        mla_keys: true,
        eps: EpsRule::ConfigOr(1e-6),
        ..TEXT
    },
];

/// The family's row of [`GGUF_FAMILIES`].
pub fn gguf_family(family: Family) -> &'static GgufFamily {
    // Every family has its row (a unit test holds it); the first is never a fallback
    // that is taken.
    GGUF_FAMILIES
        .iter()
        .find(|g| g.family == family)
        .unwrap_or(&GGUF_FAMILIES[0])
}

/// The family of `file`'s architecture, or an error naming an architecture moec does
/// not import.
pub fn family_of(file: &GgufFile) -> Result<Family, GgufError> {
    let arch = file.get_str("general.architecture")?;
    let named: Vec<Family> = FAMILIES
        .into_iter()
        .filter(|f| f.facts().gguf_arch == arch)
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

/// The architecture's metadata keys, `{arch}.{key}`.
struct Meta<'a> {
    file: &'a GgufFile,
    arch: &'static str,
}

impl Meta<'_> {
    fn u(&self, key: &str) -> Result<u64, GgufError> {
        self.file.get_u64(&format!("{}.{key}", self.arch))
    }

    /// `{arch}.{key}` read by `get` when present (absent is `None`, a wrong type an error).
    fn opt<T>(
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

    fn opt_u(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.opt(key, GgufFile::get_u64)
    }

    fn f(&self, key: &str) -> Result<f64, GgufError> {
        self.file.get_f64(&format!("{}.{key}", self.arch))
    }

    fn opt_f(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.opt(key, GgufFile::get_f64)
    }

    /// `{arch}.vocab_size`, else the length of the token list (llama.cpp's own rule).
    fn vocab(&self) -> Result<u64, GgufError> {
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
    fn expert_ffn(&self) -> Result<u64, GgufError> {
        match self.opt_u("expert_feed_forward_length")? {
            Some(f) => Ok(f),
            None => self.u("feed_forward_length"),
        }
    }

    /// The attention head width: `attention.key_length`, else hidden / heads.
    fn head_dim(&self, hidden: u64, heads: u64) -> Result<u64, GgufError> {
        Ok(match self.opt_u("attention.key_length")? {
            Some(k) => k,
            None => hidden.checked_div(heads).unwrap_or(0),
        })
    }

    /// The BOS id when the vocabulary says to add it (`tokenizer.ggml.add_bos_token`;
    /// absent, llama.cpp adds it for SentencePiece `llama` vocabularies only).
    fn bos(&self) -> Option<u64> {
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
    fn yarn(&self) -> Result<Option<serde_json::Map<String, serde_json::Value>>, GgufError> {
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

    fn token(&self, key: &str) -> Option<u64> {
        self.file
            .metadata
            .get(&format!("tokenizer.ggml.{key}"))
            .and_then(Value::as_u64)
    }
}

/// The `config.json` of `family` from `file`'s metadata.
pub fn config(file: &GgufFile, family: Family) -> Result<serde_json::Value, GgufError> {
    match family {
        Family::Mixtral => mixtral(&Meta {
            file,
            arch: "llama",
        }),
        Family::Qwen3Moe | Family::Qwen2Moe | Family::Olmoe => qwen_olmoe(file, family),
        Family::GptOss => gpt_oss(&Meta {
            file,
            arch: "gpt-oss",
        }),
        Family::Dbrx => dbrx(&Meta { file, arch: "dbrx" }),
        _ => deepseek(
            &Meta {
                file,
                arch: "deepseek2",
            },
            family,
        ),
    }
}

fn mixtral(m: &Meta<'_>) -> Result<serde_json::Value, GgufError> {
    let heads = m.u("attention.head_count")?;
    let hidden = m.u("embedding_length")?;
    Ok(json!({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": m.u("feed_forward_length")?,
        "num_attention_heads": heads,
        "num_key_value_heads": m.u("attention.head_count_kv")?,
        "head_dim": m.head_dim(hidden, heads)?,
        "num_hidden_layers": m.u("block_count")?,
        "num_local_experts": m.u("expert_count")?,
        "num_experts_per_tok": m.u("expert_used_count")?,
        "vocab_size": m.vocab()?,
        "max_position_embeddings": m.u("context_length")?,
        "rope_theta": m.f("rope.freq_base")?,
        "rms_norm_eps": m.f("attention.layer_norm_rms_epsilon")?,
        "bos_token_id": m.bos(),
        "eos_token_id": m.token("eos_token_id").unwrap_or(2),
        "tie_word_embeddings": !m.file.tensors.contains_key("output.weight"),
    }))
}

/// gpt-oss as llama.cpp's `gpt-oss` architecture runs it (`llm_build_openai_moe_iswa`):
/// sliding-window attention on even layers (`set_swa_pattern(2)`), sinks, biases, the
/// router's top-k logits softmaxed, and `swiglu_oai` with alpha 1.702 and limit 7 (fixed
/// in llama.cpp, not in the metadata). Its YaRN always truncates the correction range to
/// whole dimensions (`ggml_rope_yarn_corr_dims`), which transformers' gpt-oss does only
/// with `truncate: true` (the Hub's gpt-oss configs say `false`).
fn gpt_oss(m: &Meta<'_>) -> Result<serde_json::Value, GgufError> {
    let heads = m.u("attention.head_count")?;
    let hidden = m.u("embedding_length")?;
    let layers = m.u("block_count")?;
    let window = m.opt_u("attention.sliding_window")?;
    let rope_scaling = m.yarn()?.map_or(serde_json::Value::Null, |mut y| {
        y.insert("rope_type".into(), json!("yarn"));
        y.insert("truncate".into(), json!(true));
        serde_json::Value::Object(y)
    });
    let expert_ffn = m.expert_ffn()?;
    let mut v = json!({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": hidden,
        "intermediate_size": expert_ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m.opt_u("attention.head_count_kv")?.unwrap_or(heads),
        "head_dim": m.head_dim(hidden, heads)?,
        "num_local_experts": m.u("expert_count")?,
        "num_experts_per_tok": m.u("expert_used_count")?,
        "vocab_size": m.vocab()?,
        "max_position_embeddings": m.u("context_length")?,
        "rope_theta": m.f("rope.freq_base")?,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": m.f("attention.layer_norm_rms_epsilon")?,
        "attention_bias": true,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "eos_token_id": m.token("eos_token_id"),
        "tie_word_embeddings": !m.file.tensors.contains_key("output.weight"),
    });
    if let (Some(window), Some(obj)) = (window, v.as_object_mut()) {
        let types: Vec<&str> = (0..layers)
            .map(|i| {
                if i % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        obj.insert("sliding_window".into(), json!(window));
        obj.insert("layer_types".into(), json!(types));
    }
    Ok(v)
}

/// DBRX as llama.cpp's `dbrx` architecture runs it (`llm_build_dbrx`): LayerNorm without
/// bias at `attention.layer_norm_epsilon` (the reader sets the card's epsilon from it, as
/// the Hub config has no key for it), the fused QKV clamped to `attention.clamp_kqv` when
/// that is positive, NeoX rotary over whole heads, and the top-k weights of the softmax
/// router divided by their sum (`build_moe_ffn` with `norm_w`, DBRX's p = 1).
fn dbrx(m: &Meta<'_>) -> Result<serde_json::Value, GgufError> {
    let clip = m.opt_f("attention.clamp_kqv")?.filter(|c| *c > 0.0);
    Ok(json!({
        "architectures": ["DbrxForCausalLM"],
        "model_type": "dbrx",
        "d_model": m.u("embedding_length")?,
        "n_heads": m.u("attention.head_count")?,
        "n_layers": m.u("block_count")?,
        "max_seq_len": m.u("context_length")?,
        "vocab_size": m.vocab()?,
        "attn_config": {
            "clip_qkv": clip,
            "kv_n_heads": m.u("attention.head_count_kv")?,
            "rope_theta": m.f("rope.freq_base")?,
        },
        "ffn_config": {
            "ffn_hidden_size": m.expert_ffn()?,
            "moe_num_experts": m.u("expert_count")?,
            "moe_top_k": m.u("expert_used_count")?,
            "moe_normalize_expert_weights": 1.0,
        },
        "eos_token_id": m.token("eos_token_id").unwrap_or(100257),
        "tie_word_embeddings": false,
    }))
}

/// `dbrx.attention.layer_norm_epsilon`, which llama.cpp's DBRX LayerNorms use (DBRX's Hub
/// config has no key for it; its card says 1e-5, what the converter writes).
pub fn dbrx_norm_eps(file: &GgufFile) -> Result<f64, GgufError> {
    file.get_f64("dbrx.attention.layer_norm_epsilon")
}

fn qwen_olmoe(file: &GgufFile, family: Family) -> Result<serde_json::Value, GgufError> {
    let (arch, model_type, hf_arch) = match family {
        Family::Qwen3Moe => ("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM"),
        Family::Qwen2Moe => ("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM"),
        _ => ("olmoe", "olmoe", "OlmoeForCausalLM"),
    };
    let m = Meta { file, arch };
    let heads = m.u("attention.head_count")?;
    let hidden = m.u("embedding_length")?;
    // OLMoE's converter writes the expert width as `feed_forward_length`.
    let expert_ffn = m.expert_ffn()?;
    let mut v = json!({
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": m.opt_u("attention.head_count_kv")?.unwrap_or(heads),
        "head_dim": m.head_dim(hidden, heads)?,
        "num_hidden_layers": m.u("block_count")?,
        "num_experts": m.u("expert_count")?,
        "num_experts_per_tok": m.u("expert_used_count")?,
        "moe_intermediate_size": expert_ffn,
        "intermediate_size": expert_ffn,
        // llama.cpp's build_moe_ffn: `true` for qwen3moe, `false` for qwen2moe and olmoe.
        "norm_topk_prob": family == Family::Qwen3Moe,
        "vocab_size": m.vocab()?,
        "max_position_embeddings": m.u("context_length")?,
        "rope_theta": m.f("rope.freq_base")?,
        "rms_norm_eps": m.f("attention.layer_norm_rms_epsilon")?,
        "eos_token_id": m.token("eos_token_id"),
        "tie_word_embeddings": !file.tensors.contains_key("output.weight"),
    });
    let obj = v.as_object_mut();
    if let Some(obj) = obj {
        if family == Family::Qwen2Moe {
            obj.insert(
                "shared_expert_intermediate_size".into(),
                json!(m.u("expert_shared_feed_forward_length")?),
            );
            obj.insert(
                "qkv_bias".into(),
                json!(file.tensors.contains_key("blk.0.attn_q.bias")),
            );
        }
        if family == Family::Olmoe {
            obj.insert("clip_qkv".into(), json!(m.opt_f("attention.clamp_kqv")?));
        }
    }
    Ok(v)
}

fn deepseek(m: &Meta<'_>, family: Family) -> Result<serde_json::Value, GgufError> {
    let v3 = family == Family::DeepseekV3;
    let rope = m.u("rope.dimension_count")?;
    let key_mla = m.u("attention.key_length_mla")?;
    let n_group = m.opt_u("expert_group_count")?.unwrap_or(1).max(1);
    let topk_method = match (v3, n_group) {
        (true, _) => "noaux_tc",
        (false, 1) => "greedy",
        (false, _) => "group_limited_greedy",
    };
    // The converter writes `yarn_log_multiplier` as 0.1 * mscale_all_dim and drops
    // `mscale`; llama.cpp then uses the one value for both, and so does this.
    let all = m.opt_f("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0) / 0.1;
    let rope_scaling = m.yarn()?.map_or(serde_json::Value::Null, |mut y| {
        y.insert("type".into(), json!("yarn"));
        y.insert("mscale".into(), json!(all));
        y.insert("mscale_all_dim".into(), json!(all));
        serde_json::Value::Object(y)
    });
    Ok(json!({
        "architectures": [if v3 { "DeepseekV3ForCausalLM" } else { "DeepseekV2ForCausalLM" }],
        "model_type": if v3 { "deepseek_v3" } else { "deepseek_v2" },
        "hidden_size": m.u("embedding_length")?,
        "intermediate_size": m.u("feed_forward_length")?,
        "moe_intermediate_size": m.u("expert_feed_forward_length")?,
        "num_hidden_layers": m.u("block_count")?,
        "num_attention_heads": m.u("attention.head_count")?,
        "n_shared_experts": m.opt_u("expert_shared_count")?.unwrap_or(0),
        "n_routed_experts": m.u("expert_count")?,
        "num_experts_per_tok": m.u("expert_used_count")?,
        "first_k_dense_replace": m.opt_u("leading_dense_block_count")?.unwrap_or(0),
        "topk_method": topk_method,
        "n_group": n_group,
        "topk_group": m.opt_u("expert_group_used_count")?.unwrap_or(n_group),
        "routed_scaling_factor": m.opt_f("expert_weights_scale")?.unwrap_or(1.0),
        "norm_topk_prob": m
            .file
            .metadata
            .get("deepseek2.expert_weights_norm")
            .is_some_and(|v| *v == Value::Bool(true)),
        "q_lora_rank": m.opt_u("attention.q_lora_rank")?,
        "kv_lora_rank": m.u("attention.kv_lora_rank")?,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key_mla.saturating_sub(rope),
        "v_head_dim": m.u("attention.value_length_mla")?,
        "vocab_size": m.vocab()?,
        "max_position_embeddings": m.u("context_length")?,
        "rms_norm_eps": m.f("attention.layer_norm_rms_epsilon")?,
        "rope_theta": m.f("rope.freq_base")?,
        "rope_scaling": rope_scaling,
        "bos_token_id": m.bos(),
        "eos_token_id": m.token("eos_token_id"),
        "tie_word_embeddings": !m.file.tensors.contains_key("output.weight"),
    }))
}

#[cfg(test)]
mod table_tests {
    use super::*;

    /// Each family has exactly one row.
    #[test]
    fn every_family_has_one_gguf_row() {
        for family in FAMILIES {
            let rows = GGUF_FAMILIES.iter().filter(|g| g.family == family).count();
            assert_eq!(rows, 1, "{family:?}");
            assert_eq!(gguf_family(family).family, family);
        }
    }
}
