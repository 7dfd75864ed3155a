//! Hugging Face `config.json` <-> [`ModelCard`]: what every family shares.
//!
//! Takes the text of a Hub `config.json`; its `model_type` picks the family module
//! (`weights::family`) that reads the rest in the family's spelling and gives a card with
//! any dimensions. Whatever no family here implements is refused first, with the field
//! named: an unknown `model_type`, a rope scaling type other than the default (YaRN where
//! the family allows it), a `quantization_config` (except MXFP4 experts where the family
//! allows them, with every other module listed in `modules_to_not_convert`; the card's
//! description then says they are kept MXFP4 at load), an activation other than
//! SiLU. Also checks that a config agrees with a chosen card (naming the first field that
//! differs, in the family's spelling) and writes a config in the family's real spelling
//! for synthetic checkpoints. Every problem is an error naming the file and field.

use crate::model::card::ModelCard;
use crate::quant::storage::WeightDtype;
use crate::weights::family::{self, CardField, FamilySpec, Fields};
use serde_json::Value;
use std::fmt::Debug;

pub use crate::model::family::MXFP4_UNCONVERTED;
pub use crate::weights::family::ConfigError;

/// Reads a card from config.json text; `path` names the file in errors, `name` becomes
/// the card's name.
pub fn card_from_config(text: &str, path: &str, name: &str) -> Result<ModelCard, ConfigError> {
    let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
        path: path.to_string(),
        message: e.to_string(),
    })?;
    let root = value.as_object().ok_or_else(|| ConfigError::Json {
        path: path.to_string(),
        message: "top level is not an object".into(),
    })?;
    let f = Fields::new(path, root);
    let model_type = f.str("model_type").unwrap_or("");
    let spec = family::by_model_type(model_type).ok_or_else(|| ConfigError::ModelType {
        path: path.into(),
        model_type: model_type.into(),
    })?;
    refuse_unimplemented(&f, spec)?;
    let card = spec.card_from_config(&f, name)?;
    card.validate()
        .map_err(|message| f.invalid("(dimensions)", &message))?;
    Ok(card)
}

/// Refuses, naming the field, what no family's numerics here implement: quantised weights
/// (except MXFP4 experts where the family allows them), rope scaling (YaRN only where the
/// family allows it), activations other than SiLU.
fn refuse_unimplemented(f: &Fields<'_>, spec: &dyn FamilySpec) -> Result<(), ConfigError> {
    if let Some(q) = f.get("quantization_config") {
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("(unnamed)");
        let unconverted = spec.family().facts().mxfp4_unconverted;
        match unconverted {
            Some(modules) if method == "mxfp4" => refuse_mxfp4_outside_experts(f, modules)?,
            _ => {
                let only = if unconverted.is_some() {
                    "bf16, f16, f32 and MXFP4 experts"
                } else {
                    "bf16, f16 and f32 weights"
                };
                return Err(f.invalid(
                    "quantization_config.quant_method",
                    &format!("`{method}` is not supported (moec reads {only} only)"),
                ));
            }
        }
    }
    for field in [
        "rope_scaling.rope_type",
        "rope_scaling.type",
        "rope_parameters.rope_type",
    ] {
        if let Some(v) = f.get(field) {
            let kind = v.as_str().unwrap_or("(not a string)");
            if kind != "default" && !(spec.family().facts().allows_yarn && kind == "yarn") {
                return Err(f.invalid(
                    field,
                    &format!("`{kind}` is not supported (only the default rotary embedding)"),
                ));
            }
        }
    }
    if let Some(Value::Object(_)) = f.raw("rope_scaling") {
        if f.get("rope_scaling.rope_type").is_none() && f.get("rope_scaling.type").is_none() {
            return Err(f.invalid(
                "rope_scaling",
                "has no rope type (only the default rotary embedding is supported)",
            ));
        }
    }
    if let Some(act) = f.get("hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(f.invalid(
                "hidden_act",
                &format!("{act} is not supported (SwiGLU with SiLU only)"),
            ));
        }
    }
    Ok(())
}

/// An MXFP4 config must leave every non-expert module unquantised (listing each of
/// `unconverted` in `modules_to_not_convert`), and the experts' input widths must be
/// whole 32-weight blocks.
fn refuse_mxfp4_outside_experts(f: &Fields<'_>, unconverted: &[&str]) -> Result<(), ConfigError> {
    let field = "quantization_config.modules_to_not_convert";
    let listed: Vec<&str> = f
        .get(field)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    // transformers matches an entry against a module name's tail, so `lm_head` or
    // `self_attn` alone also keep the module unquantised.
    let kept = |module: &str| {
        listed
            .iter()
            .any(|e| module == *e || module.ends_with(&format!(".{e}")))
    };
    if let Some(module) = unconverted.iter().find(|m| !kept(m)) {
        return Err(f.invalid(
            field,
            &format!(
                "does not list `{module}`: moec reads MXFP4 for the routed experts only \
                 (mlp.experts.gate_up_proj / down_proj)"
            ),
        ));
    }
    for width in ["hidden_size", "intermediate_size"] {
        if let Some(n) = f.opt_uint(width)? {
            if !n.is_multiple_of(crate::quant::mxfp4::BLOCK as u64) {
                return Err(f.invalid(
                    width,
                    &format!(
                        "is {n}: MXFP4 experts need a multiple of {}",
                        crate::quant::mxfp4::BLOCK
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether a config.json that [`card_from_config`] accepted stores its experts as MXFP4
/// (`quantization_config.quant_method: mxfp4`, gpt-oss only).
pub fn experts_in_mxfp4(text: &str) -> bool {
    serde_json::from_str::<Value>(text).is_ok_and(|v| {
        v.pointer("/quantization_config/quant_method")
            .and_then(Value::as_str)
            == Some("mxfp4")
    })
}

/// How one card field is compared, and how its two values are printed when they differ.
enum Compare {
    /// Integers, equal.
    Int(fn(&ModelCard) -> u64),
    /// Floats, equal to a relative 1e-9.
    Float(fn(&ModelCard) -> f64),
    /// Any other value: `Some((config, card))` printed with `Debug` when they differ.
    Other(fn(&ModelCard, &ModelCard) -> Option<(String, String)>),
}

/// `Some` of both values printed with `Debug` where they differ.
fn differ<T: PartialEq + Debug>(config: &T, card: &T) -> Option<(String, String)> {
    (config != card).then(|| (format!("{config:?}"), format!("{card:?}")))
}

/// What a config.json must agree on with a chosen card, in the order it is checked (the
/// family first, so every later key is spelled in the card's family).
const AGREEMENT: [(CardField, Compare); 23] = [
    (
        CardField::Family,
        Compare::Other(|a, b| differ(&a.family, &b.family)),
    ),
    (CardField::Layers, Compare::Int(|c| c.layers)),
    (CardField::Hidden, Compare::Int(|c| c.hidden)),
    (CardField::Ffn, Compare::Int(|c| c.ffn)),
    (CardField::Heads, Compare::Int(|c| c.heads)),
    (CardField::KvHeads, Compare::Int(|c| c.kv_heads)),
    (CardField::HeadDim, Compare::Int(|c| c.head_dim)),
    (CardField::Experts, Compare::Int(|c| c.experts)),
    (CardField::TopK, Compare::Int(|c| c.top_k)),
    (CardField::Vocab, Compare::Int(|c| c.vocab)),
    (CardField::DenseLayers, Compare::Int(|c| c.dense_layers)),
    (CardField::DenseFfn, Compare::Int(|c| c.dense_ffn)),
    (CardField::MaxPositions, Compare::Int(|c| c.max_positions)),
    (CardField::RopeTheta, Compare::Float(|c| c.rope_theta)),
    (CardField::NormEps, Compare::Float(|c| c.norm_eps)),
    (
        CardField::ClipQkv,
        Compare::Other(|a, b| differ(&a.clip_qkv, &b.clip_qkv)),
    ),
    (CardField::SharedFfn, Compare::Int(|c| c.shared_ffn)),
    (
        CardField::QkvBias,
        Compare::Other(|a, b| differ(&a.qkv_bias, &b.qkv_bias)),
    ),
    (
        CardField::Yarn,
        Compare::Other(|a, b| differ(&a.yarn, &b.yarn)),
    ),
    (
        CardField::Mla,
        // How the checkpoint stores `kv_b_proj`, and how a backend lays out the latent
        // cache, are not part of the architecture.
        Compare::Other(|a, b| {
            let geometry = |c: &ModelCard| {
                c.mla.map(|m| crate::model::card::Mla {
                    kv_b_split: false,
                    values_in_keys: false,
                    ..m
                })
            };
            differ(&geometry(a), &geometry(b))
        }),
    ),
    (
        CardField::DeepseekRouter,
        Compare::Other(|a, b| differ(&a.deepseek_router, &b.deepseek_router)),
    ),
    (
        CardField::ClampedSwiglu,
        Compare::Other(|a, b| {
            // How the experts are stored is not part of the architecture.
            let params = |c: &ModelCard| c.clamped_swiglu.map(|c| (c.alpha, c.limit));
            differ(&params(a), &params(b))
        }),
    ),
    (
        CardField::RouterNormP,
        Compare::Other(|a, b| differ(&a.router_norm_p, &b.router_norm_p)),
    ),
];

/// Checks that the architecture read from config.json (`from_config`) is the card's,
/// naming the first field that differs as `from_config`'s family spells it; fields that
/// family's configs do not set are not compared.
pub fn check_agreement(
    from_config: &ModelCard,
    card: &ModelCard,
    path: &str,
) -> Result<(), ConfigError> {
    let spec = family::spec(from_config.family);
    // A GGUF stores these floats as f32 (llama.cpp's `rms_norm_eps` 1e-5 reads back as
    // 9.99999975e-6), so a card compared with a GGUF's metadata agrees to f32 precision
    // (relative rounding 6e-8); any real difference of a card field is far larger.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * a.abs().max(b.abs());
    for (field, compare) in &AGREEMENT {
        let Some(key) = spec.config_key(*field) else {
            continue;
        };
        let differs = match compare {
            Compare::Int(get) => {
                let (a, b) = (get(from_config), get(card));
                (a != b).then(|| (a.to_string(), b.to_string()))
            }
            Compare::Float(get) => {
                let (a, b) = (get(from_config), get(card));
                (!close(a, b)).then(|| (a.to_string(), b.to_string()))
            }
            Compare::Other(differ) => differ(from_config, card),
        };
        if let Some((config_value, card_value)) = differs {
            return Err(ConfigError::Mismatch {
                path: path.to_string(),
                card: card.name.clone(),
                field: key.to_string(),
                config_value,
                card_value,
            });
        }
    }
    Ok(())
}

/// A config.json for `card` in its family's Hub spelling (for synthetic checkpoints).
pub fn config_for_card(card: &ModelCard, dtype: WeightDtype) -> Value {
    family::spec(card.family).config_for_card(card, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::card::{DeepseekTopk, QkNorm};

    /// The Hub's Mixtral-8x7B-v0.1 config.json (2024 revision, sliding_window null).
    const MIXTRAL_8X7B: &str = r#"{"architectures":["MixtralForCausalLM"],"attention_dropout":0.0,
      "bos_token_id":1,"eos_token_id":2,"hidden_act":"silu","hidden_size":4096,"initializer_range":0.02,
      "intermediate_size":14336,"max_position_embeddings":32768,"model_type":"mixtral",
      "num_attention_heads":32,"num_experts_per_tok":2,"num_hidden_layers":32,"num_key_value_heads":8,
      "num_local_experts":8,"output_router_logits":false,"rms_norm_eps":1e-05,"rope_theta":1000000.0,
      "router_aux_loss_coef":0.02,"sliding_window":null,"tie_word_embeddings":false,
      "torch_dtype":"bfloat16","transformers_version":"4.36.0.dev0","use_cache":true,"vocab_size":32000}"#;

    /// The Hub's DBRX config.json, junk fields in the nested configs included.
    const DBRX: &str = r#"{"architectures":["DbrxForCausalLM"],
      "attn_config":{"clip_qkv":8,"kv_n_heads":8,"model_type":"","rope_theta":500000,
        "tie_word_embeddings":true,"temperature":1.0,"id2label":{"0":"LABEL_0"}},
      "d_model":6144,"emb_pdrop":0.0,
      "ffn_config":{"ffn_hidden_size":10752,"model_type":"","moe_jitter_eps":0.01,"moe_loss_weight":0.05,
        "moe_num_experts":16,"moe_top_k":4,"moe_normalize_expert_weights":1,"ffn_act_fn":{"name":"silu"}},
      "initializer_range":0.02,"max_seq_len":32768,"model_type":"dbrx","n_heads":48,"n_layers":40,
      "output_router_logits":false,"resid_pdrop":0.0,"router_aux_loss_coef":0.05,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","transformers_version":"4.38.2",
      "use_cache":true,"vocab_size":100352}"#;

    /// Qwen3-30B-A3B's config.json as published on the Hub (2025-04 revision; written
    /// from the model card's published file, not downloaded here).
    const QWEN3_30B_A3B: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"attention_bias":false,
      "attention_dropout":0.0,"bos_token_id":151643,"decoder_sparse_step":1,"eos_token_id":151645,
      "head_dim":128,"hidden_act":"silu","hidden_size":2048,"initializer_range":0.02,
      "intermediate_size":6144,"max_position_embeddings":40960,"max_window_layers":48,
      "mlp_only_layers":[],"model_type":"qwen3_moe","moe_intermediate_size":768,"norm_topk_prob":true,
      "num_attention_heads":32,"num_experts":128,"num_experts_per_tok":8,"num_hidden_layers":48,
      "num_key_value_heads":4,"output_router_logits":false,"rms_norm_eps":1e-06,"rope_scaling":null,
      "rope_theta":1000000.0,"router_aux_loss_coef":0.001,"sliding_window":null,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","transformers_version":"4.51.0",
      "use_cache":true,"use_sliding_window":false,"vocab_size":151936}"#;

    /// OLMoE-1B-7B-0924's config.json as published on the Hub (same provenance).
    const OLMOE_1B_7B: &str = r#"{"architectures":["OlmoeForCausalLM"],"attention_bias":false,
      "attention_dropout":0.0,"clip_qkv":null,"eos_token_id":50279,"hidden_act":"silu",
      "hidden_size":2048,"initializer_range":0.02,"intermediate_size":1024,
      "max_position_embeddings":4096,"model_type":"olmoe","norm_topk_prob":false,
      "num_attention_heads":16,"num_experts":64,"num_experts_per_tok":8,"num_hidden_layers":16,
      "num_key_value_heads":16,"output_router_logits":false,"pad_token_id":1,"rms_norm_eps":1e-05,
      "rope_scaling":null,"rope_theta":10000.0,"router_aux_loss_coef":0.01,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,"vocab_size":50304}"#;

    /// Qwen2-57B-A14B's config.json as published on the Hub (same provenance; no
    /// `qkv_bias` field: the biases are always there).
    const QWEN2_57B_A14B: &str = r#"{"architectures":["Qwen2MoeForCausalLM"],"attention_dropout":0.0,
      "bos_token_id":151643,"decoder_sparse_step":1,"eos_token_id":151643,"hidden_act":"silu",
      "hidden_size":3584,"initializer_range":0.02,"intermediate_size":18944,
      "max_position_embeddings":32768,"max_window_layers":28,"model_type":"qwen2_moe",
      "moe_intermediate_size":2560,"norm_topk_prob":false,"num_attention_heads":28,"num_experts":64,
      "num_experts_per_tok":8,"num_hidden_layers":28,"num_key_value_heads":4,"rms_norm_eps":1e-06,
      "rope_theta":1000000.0,"shared_expert_intermediate_size":20480,"sliding_window":65536,
      "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,
      "use_sliding_window":false,"vocab_size":151936}"#;

    /// gpt-oss-20b's config.json as published on the Hub (same provenance), with its 24
    /// alternating `layer_types` written out by [`gpt_oss_20b`].
    const GPT_OSS_20B: &str = r#"{"architectures":["GptOssForCausalLM"],"attention_bias":true,
      "attention_dropout":0.0,"eos_token_id":200002,"experts_per_token":4,"head_dim":64,
      "hidden_act":"silu","hidden_size":2880,"initial_context_length":4096,"initializer_range":0.02,
      "intermediate_size":2880,"layer_types":LAYER_TYPES,"max_position_embeddings":131072,
      "model_type":"gpt_oss","num_attention_heads":64,"num_experts_per_tok":4,"num_hidden_layers":24,
      "num_key_value_heads":8,"num_local_experts":32,"output_router_logits":false,"pad_token_id":199999,
      "quantization_config":{"modules_to_not_convert":["model.layers.*.self_attn",
        "model.layers.*.mlp.router","model.embed_tokens","lm_head"],"quant_method":"mxfp4"},
      "rms_norm_eps":1e-05,"rope_scaling":{"beta_fast":32.0,"beta_slow":1.0,"factor":32.0,
        "original_max_position_embeddings":4096,"rope_type":"yarn","truncate":false},
      "rope_theta":150000,"router_aux_loss_coef":0.9,"sliding_window":128,"swiglu_limit":7.0,
      "tie_word_embeddings":false,"transformers_version":"4.55.0.dev0","use_cache":true,
      "vocab_size":201088}"#;

    /// DeepSeek-V2-Lite's Hub config.json (fields as published).
    const DEEPSEEK_V2_LITE: &str = r#"{"architectures":["DeepseekV2ForCausalLM"],
      "attention_bias":false,"attention_dropout":0.0,"aux_loss_alpha":0.001,
      "bos_token_id":100000,"eos_token_id":100001,"first_k_dense_replace":1,"hidden_act":"silu",
      "hidden_size":2048,"initializer_range":0.02,"intermediate_size":10944,"kv_lora_rank":512,
      "max_position_embeddings":163840,"model_type":"deepseek_v2","moe_intermediate_size":1408,
      "moe_layer_freq":1,"n_group":1,"n_routed_experts":64,"n_shared_experts":2,
      "norm_topk_prob":false,"num_attention_heads":16,"num_experts_per_tok":6,
      "num_hidden_layers":27,"num_key_value_heads":16,"pretraining_tp":1,"q_lora_rank":null,
      "qk_nope_head_dim":128,"qk_rope_head_dim":64,"rms_norm_eps":1e-06,
      "rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":0.707,
        "mscale_all_dim":0.707,"original_max_position_embeddings":4096,"type":"yarn"},
      "rope_theta":10000,"routed_scaling_factor":1.0,"scoring_func":"softmax","seq_aux":true,
      "tie_word_embeddings":false,"topk_group":1,"topk_method":"greedy","torch_dtype":"bfloat16",
      "transformers_version":"4.33.1","use_cache":true,"v_head_dim":128,"vocab_size":102400}"#;

    /// DeepSeek-V3's Hub config.json (fields as published; fp8 block-quantised weights).
    const DEEPSEEK_V3: &str = r#"{"architectures":["DeepseekV3ForCausalLM"],
      "attention_bias":false,"attention_dropout":0.0,"aux_loss_alpha":0.001,"bos_token_id":0,
      "eos_token_id":1,"ep_size":1,"first_k_dense_replace":3,"hidden_act":"silu",
      "hidden_size":7168,"initializer_range":0.02,"intermediate_size":18432,"kv_lora_rank":512,
      "max_position_embeddings":163840,"model_type":"deepseek_v3","moe_intermediate_size":2048,
      "moe_layer_freq":1,"n_group":8,"n_routed_experts":256,"n_shared_experts":1,
      "norm_topk_prob":true,"num_attention_heads":128,"num_experts_per_tok":8,
      "num_hidden_layers":61,"num_key_value_heads":128,"num_nextn_predict_layers":1,
      "q_lora_rank":1536,"qk_nope_head_dim":128,"qk_rope_head_dim":64,
      "quantization_config":{"activation_scheme":"dynamic","fmt":"e4m3","quant_method":"fp8",
        "weight_block_size":[128,128]},
      "rms_norm_eps":1e-06,"rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":1.0,
        "mscale_all_dim":1.0,"original_max_position_embeddings":4096,"type":"yarn"},
      "rope_theta":10000,"routed_scaling_factor":2.5,"scoring_func":"sigmoid","seq_aux":true,
      "tie_word_embeddings":false,"topk_group":4,"topk_method":"noaux_tc","torch_dtype":"bfloat16",
      "transformers_version":"4.33.1","use_cache":true,"v_head_dim":128,"vocab_size":129280}"#;

    /// The Hub DeepSeek configs give the built-in cards once what moec refuses is taken
    /// out (V3's fp8 quantisation): MLA geometry as the latent cache (kv_heads 1, head_dim
    /// 512 + 64), the softmax mscale of YaRN's mscale_all_dim, the routers, the leading
    /// dense layers (V2-Lite 1 of width 10944, V3 3 of 18432).
    #[test]
    fn deepseek_hub_configs_agree_with_the_builtin_cards() {
        let lite = card_from_config(DEEPSEEK_V2_LITE, "c.json", "x").unwrap();
        assert_eq!((lite.dense_layers, lite.dense_ffn), (1, 10944));
        check_agreement(
            &lite,
            &ModelCard::load("deepseek-v2-lite").unwrap(),
            "c.json",
        )
        .unwrap();
        assert_eq!(
            (lite.kv_heads, lite.head_dim, lite.shared_ffn),
            (1, 576, 2816)
        );
        // (0.1 * 0.707 * ln 40 + 1)^2, by hand: ln 40 = 3.68888, so 1.260804^2 = 1.589627.
        let mscale = lite.mla.unwrap().softmax_mscale;
        assert!((mscale - 1.589627).abs() < 1e-5, "{mscale}");
        let start = DEEPSEEK_V3.find(r#""quantization_config""#).unwrap();
        let end = DEEPSEEK_V3.find(r#""rms_norm_eps""#).unwrap();
        let bf16 = format!("{}{}", &DEEPSEEK_V3[..start], &DEEPSEEK_V3[end..]);
        let v3 = card_from_config(&bf16, "c.json", "x").unwrap();
        assert_eq!((v3.dense_layers, v3.dense_ffn), (3, 18432));
        check_agreement(&v3, &ModelCard::load("deepseek-v3").unwrap(), "c.json").unwrap();
        assert_eq!(v3.deepseek_router.unwrap().topk, DeepseekTopk::NoauxTc);
        assert!(v3.has_router_bias());
    }

    fn gpt_oss_20b() -> String {
        let types: Vec<&str> = (0..24)
            .map(|i| {
                if i % 2 == 0 {
                    "\"sliding_attention\""
                } else {
                    "\"full_attention\""
                }
            })
            .collect();
        GPT_OSS_20B.replace("LAYER_TYPES", &format!("[{}]", types.join(",")))
    }

    /// The Hub's gpt-oss-20b config.json, with its MXFP4 `quantization_config`, is read:
    /// the card agrees with the built-in one and its description says the experts are
    /// kept MXFP4. The same config without `quantization_config` (a bf16
    /// conversion) gives the same card.
    #[test]
    fn gpt_oss_hub_config_with_mxfp4_experts_is_accepted_and_agrees_in_bf16() {
        let hub = gpt_oss_20b();
        let builtin = ModelCard::load("gpt-oss-20b").unwrap();
        let card = card_from_config(&hub, "c.json", "x").unwrap();
        check_agreement(&card, &builtin, "c.json").unwrap();
        assert!(card.description.contains("MXFP4"), "{}", card.description);
        assert!(experts_in_mxfp4(&hub));
        let start = hub.find(r#""quantization_config""#).unwrap();
        let end = hub.find(r#""rms_norm_eps""#).unwrap();
        let bf16 = format!("{}{}", &hub[..start], &hub[end..]);
        let card = card_from_config(&bf16, "c.json", "x").unwrap();
        assert!(!experts_in_mxfp4(&bf16));
        assert!(!card.description.contains("MXFP4"));
        check_agreement(&card, &builtin, "c.json").unwrap();
        assert!(card.sinks && card.alternate_sliding && card.o_bias);
        assert_eq!(card.sliding_window, Some(128));
        let bad = bf16.replacen(r#""full_attention""#, r#""sliding_attention""#, 1);
        let err = card_from_config(&bad, "c.json", "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("layer_types"), "{err}");
    }

    /// gpt-oss quantised other than MXFP4, or MXFP4 reaching a module other than the
    /// routed experts, or expert widths that are not whole 32-weight blocks, is refused
    /// naming the field.
    #[test]
    fn gpt_oss_quantization_beyond_mxfp4_experts_is_refused_by_field() {
        let hub = gpt_oss_20b();
        let cases = [
            (
                hub.replace(r#""quant_method":"mxfp4""#, r#""quant_method":"fp8""#),
                "quantization_config.quant_method",
            ),
            (
                hub.replace(r#""model.layers.*.self_attn","#, ""),
                "quantization_config.modules_to_not_convert",
            ),
            (
                hub.replace(r#","lm_head"]"#, "]"),
                "quantization_config.modules_to_not_convert",
            ),
            (
                hub.replace(r#""intermediate_size":2880"#, r#""intermediate_size":2888"#),
                "intermediate_size",
            ),
        ];
        for (text, field) in cases {
            let err = card_from_config(&text, "c.json", "x")
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
        let err = card_from_config(&hub.replace(r#","lm_head"]"#, "]"), "c.json", "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`lm_head`"), "{err}");
    }

    #[test]
    fn new_family_hub_configs_agree_with_the_builtin_cards() {
        for (text, name) in [
            (QWEN3_30B_A3B, "qwen3-30b-a3b"),
            (OLMOE_1B_7B, "olmoe-1b-7b"),
            (QWEN2_57B_A14B, "qwen2-57b-a14b"),
        ] {
            let from_config = card_from_config(text, "config.json", "x").unwrap();
            check_agreement(&from_config, &ModelCard::load(name).unwrap(), "config.json")
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let qwen3 = card_from_config(QWEN3_30B_A3B, "c.json", "x").unwrap();
        assert_eq!(
            (qwen3.qk_norm, qwen3.router_norm_p, qwen3.bos_token_id),
            (QkNorm::PerHead, Some(1.0), None)
        );
        let olmoe = card_from_config(OLMOE_1B_7B, "c.json", "x").unwrap();
        assert_eq!((olmoe.qk_norm, olmoe.router_norm_p), (QkNorm::Full, None));
        let qwen2 = card_from_config(QWEN2_57B_A14B, "c.json", "x").unwrap();
        assert_eq!(
            (
                qwen2.qkv_bias,
                qwen2.shared_ffn,
                qwen2.shared_gate,
                qwen2.sliding_window
            ),
            (true, 20480, true, None)
        );
    }

    /// What moec does not implement is refused with the field named, never run.
    #[test]
    fn unimplemented_fields_are_refused_by_name() {
        let cases = [
            (
                QWEN3_30B_A3B.replace(
                    r#""rope_scaling":null"#,
                    r#""rope_scaling":{"rope_type":"yarn","factor":4.0}"#,
                ),
                "rope_scaling.rope_type",
            ),
            (
                MIXTRAL_8X7B.replace(
                    r#""rope_theta":1000000.0,"#,
                    r#""rope_parameters":{"rope_theta":1e6,"rope_type":"llama3"},"#,
                ),
                "rope_parameters.rope_type",
            ),
            (
                OLMOE_1B_7B.replace(
                    r#""clip_qkv":null,"#,
                    r#""clip_qkv":null,"quantization_config":{"quant_method":"mxfp4"},"#,
                ),
                "quantization_config.quant_method",
            ),
            (
                QWEN3_30B_A3B.replace(
                    r#""use_sliding_window":false"#,
                    r#""use_sliding_window":true"#,
                ),
                "use_sliding_window",
            ),
            (
                QWEN2_57B_A14B.replace(r#""decoder_sparse_step":1"#, r#""decoder_sparse_step":2"#),
                "decoder_sparse_step",
            ),
            (
                QWEN3_30B_A3B.replace(r#""mlp_only_layers":[]"#, r#""mlp_only_layers":[0]"#),
                "mlp_only_layers",
            ),
            (
                OLMOE_1B_7B.replace(r#""attention_bias":false"#, r#""attention_bias":true"#),
                "attention_bias",
            ),
            (
                QWEN3_30B_A3B.replace(r#""hidden_act":"silu""#, r#""hidden_act":"gelu""#),
                "hidden_act",
            ),
            (
                QWEN3_30B_A3B.replace(r#""model_type":"qwen3_moe""#, r#""model_type":"jamba""#),
                "model_type `jamba`",
            ),
            (
                DEEPSEEK_V2_LITE.replace(
                    r#""first_k_dense_replace":1"#,
                    r#""first_k_dense_replace":28"#,
                ),
                "first_k_dense_replace",
            ),
            (DEEPSEEK_V3.to_string(), "quantization_config.quant_method"),
            (
                DEEPSEEK_V2_LITE
                    .to_string()
                    .replace(r#""topk_method":"greedy""#, r#""topk_method":"noaux_tc""#),
                "topk_method",
            ),
            (
                DEEPSEEK_V2_LITE
                    .to_string()
                    .replace(r#""norm_topk_prob":false"#, r#""norm_topk_prob":true"#),
                "norm_topk_prob",
            ),
            (
                DEEPSEEK_V2_LITE
                    .to_string()
                    .replace(r#""moe_layer_freq":1"#, r#""moe_layer_freq":2"#),
                "moe_layer_freq",
            ),
            (
                DEEPSEEK_V2_LITE
                    .to_string()
                    .replace(r#""type":"yarn""#, r#""type":"dynamic""#),
                "rope_scaling.type",
            ),
        ];
        for (text, field) in cases {
            let err = card_from_config(&text, "c.json", "x")
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{field}: {err}");
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn hub_configs_agree_with_the_builtin_cards() {
        let mixtral = card_from_config(MIXTRAL_8X7B, "config.json", "x").unwrap();
        check_agreement(
            &mixtral,
            &ModelCard::load("mixtral-8x7b").unwrap(),
            "config.json",
        )
        .unwrap();
        let dbrx = card_from_config(DBRX, "config.json", "x").unwrap();
        check_agreement(&dbrx, &ModelCard::load("dbrx").unwrap(), "config.json").unwrap();
        assert_eq!(dbrx.clip_qkv, Some(8.0));
        assert_eq!(dbrx.head_dim, 128);
    }

    #[test]
    fn rope_parameters_spelling_and_integer_sliding_window_are_read() {
        let text = MIXTRAL_8X7B
            .replace(
                r#""rope_theta":1000000.0,"#,
                r#""rope_parameters":{"rope_theta":12345.0,"rope_type":"default"},"#,
            )
            .replace(r#""sliding_window":null"#, r#""sliding_window":4096"#);
        let card = card_from_config(&text, "c.json", "x").unwrap();
        assert_eq!(card.rope_theta, 12345.0);
        assert_eq!(card.sliding_window, Some(4096));
    }

    #[test]
    fn disagreement_names_the_config_field() {
        let text = MIXTRAL_8X7B.replace(r#""hidden_size":4096"#, r#""hidden_size":1024"#);
        let from_config = card_from_config(&text, "w/config.json", "x").unwrap();
        let err = check_agreement(
            &from_config,
            &ModelCard::load("mixtral-8x7b").unwrap(),
            "w/config.json",
        );
        let msg = err.unwrap_err().to_string();
        assert!(
            msg.contains("`hidden_size` is 1024") && msg.contains("`mixtral-8x7b` has 4096"),
            "{msg}"
        );
    }

    /// A float read back from a GGUF (stored as f32) agrees with the card's f64; a real
    /// difference (1e-5 against 1e-6, 1e6 against 1e6 + 10) does not.
    #[test]
    fn floats_agree_to_f32_precision_and_no_looser() {
        let card = ModelCard::load("mixtral-8x7b").unwrap();
        let mut from_gguf = card.clone();
        from_gguf.norm_eps = f64::from(card.norm_eps as f32);
        from_gguf.rope_theta = f64::from(card.rope_theta as f32);
        assert_ne!(from_gguf.norm_eps, card.norm_eps);
        check_agreement(&from_gguf, &card, "m.gguf").unwrap();
        from_gguf.norm_eps = 1e-6;
        let msg = check_agreement(&from_gguf, &card, "m.gguf")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`rms_norm_eps` is 0.000001"), "{msg}");
        from_gguf.norm_eps = card.norm_eps;
        from_gguf.rope_theta = card.rope_theta + 10.0;
        let msg = check_agreement(&from_gguf, &card, "m.gguf")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`rope_theta`"), "{msg}");
    }

    /// A disagreement is named in the family's own spelling; a field the family's config
    /// does not set (Mixtral's renormalisation) is not compared.
    #[test]
    fn disagreements_are_named_in_each_familys_spelling() {
        type Edit = fn(&mut ModelCard);
        let cases: [(&str, Edit, Option<&str>); 8] = [
            ("dbrx-tiny", |c| c.hidden += 64, Some("`d_model` is")),
            (
                "dbrx-tiny",
                |c| c.norm_eps *= 2.0,
                Some("`(LayerNorm eps)` is"),
            ),
            (
                "qwen3-moe-tiny",
                |c| c.experts += 1,
                Some("`num_experts` is"),
            ),
            (
                "qwen2-moe-tiny",
                |c| c.ffn += 1,
                Some("`moe_intermediate_size` is"),
            ),
            ("olmoe-tiny", |c| c.ffn += 1, Some("`intermediate_size` is")),
            (
                "deepseek-v2-tiny",
                |c| c.kv_heads += 1,
                Some("`kv_lora_rank + qk_rope_head_dim` is"),
            ),
            ("gpt-oss-tiny", |c| c.yarn = None, Some("`rope_scaling` is")),
            ("mixtral-tiny", |c| c.router_norm_p = None, None),
        ];
        for (name, edit, expected) in cases {
            let card = ModelCard::load(name).unwrap();
            let mut from_config = card.clone();
            edit(&mut from_config);
            let got = check_agreement(&from_config, &card, "c.json");
            match (got, expected) {
                (Ok(()), None) => {}
                (Err(e), Some(want)) => assert!(e.to_string().contains(want), "{name}: {e}"),
                (got, want) => panic!("{name}: {got:?}, expected {want:?}"),
            }
        }
    }

    #[test]
    fn bad_configs_are_errors_naming_the_problem() {
        let missing = MIXTRAL_8X7B.replace(r#""num_local_experts":8,"#, "");
        assert!(card_from_config(&missing, "c.json", "x")
            .unwrap_err()
            .to_string()
            .contains("num_local_experts"));
        assert!(matches!(
            card_from_config("{not json", "c.json", "x"),
            Err(ConfigError::Json { .. })
        ));
        let llama = MIXTRAL_8X7B.replace(r#""model_type":"mixtral""#, r#""model_type":"llama""#);
        assert!(matches!(
            card_from_config(&llama, "c.json", "x"),
            Err(ConfigError::ModelType { .. })
        ));
        let neg = MIXTRAL_8X7B.replace(r#""num_hidden_layers":32"#, r#""num_hidden_layers":-3"#);
        assert!(card_from_config(&neg, "c.json", "x")
            .unwrap_err()
            .to_string()
            .contains("num_hidden_layers"));
    }

    #[test]
    fn written_configs_read_back_as_the_same_card() {
        for name in [
            "mixtral-tiny",
            "dbrx-tiny",
            "mixtral-mid",
            "qwen3-moe-tiny",
            "qwen3-30b-a3b",
            "olmoe-tiny",
            "olmoe-1b-7b",
            "qwen2-moe-tiny",
            "qwen2-57b-a14b",
            "gpt-oss-tiny",
            "gpt-oss-20b",
            "deepseek-v2-tiny",
            "deepseek-v3-tiny",
        ] {
            let card = ModelCard::load(name).unwrap();
            let text = config_for_card(&card, WeightDtype::Bf16).to_string();
            let back = card_from_config(&text, "c.json", name).unwrap();
            check_agreement(&back, &card, "c.json").unwrap();
        }
    }
}
