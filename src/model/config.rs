//! Hugging Face `config.json` <-> [`ModelCard`].
//!
//! Takes the text of a Hub `config.json` in its family's spelling (Mixtral's flat fields
//! with `rope_theta` at top level or under `rope_parameters`, `sliding_window` null or an
//! integer; DBRX's nested `attn_config` / `ffn_config`, whose serialized junk fields are
//! ignored; Qwen2-MoE's, Qwen3-MoE's and OLMoE's flat fields with `num_experts` (or
//! `num_local_experts`), `moe_intermediate_size`, `norm_topk_prob`, `shared_expert_*`);
//! gives a card with any dimensions. Whatever moec does not implement is refused with
//! the field named: an unknown `model_type`, a rope scaling type other than the default, a
//! `quantization_config` (except gpt-oss's MXFP4 experts with every other module listed in
//! `modules_to_not_convert`; the card's description then says they are dequantized to bf16
//! at load), an activation other than SiLU, sliding-window or dense-only
//! layers in the Qwen families, attention biases where the family has none. Also checks that a config agrees with a
//! chosen card (naming the first field that differs) and writes a config in the family's
//! real spelling for synthetic checkpoints. Every problem is an error naming the file and
//! field.

use crate::model::card::{
    ClampedSwiglu, DeepseekRouter, DeepseekTopk, Family, Mla, ModelCard, QkNorm, WeightDtype, Yarn,
};
use serde_json::{json, Map, Value};

/// Problems with a `config.json`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or not an object.
    #[error("{path}: not a valid config.json: {message}")]
    Json {
        /// The file.
        path: String,
        /// Parser message.
        message: String,
    },
    /// `model_type` names no family moec implements.
    #[error("{path}: model_type `{model_type}` is not supported (expected one of mixtral, dbrx, qwen2_moe, qwen3_moe, olmoe, gpt_oss, deepseek_v2, deepseek_v3)")]
    ModelType {
        /// The file.
        path: String,
        /// What it says.
        model_type: String,
    },
    /// A required field is absent.
    #[error("{path}: missing field `{field}`")]
    Missing {
        /// The file.
        path: String,
        /// Dotted field name.
        field: String,
    },
    /// A field has an unusable value.
    #[error("{path}: field `{field}` {message}")]
    Invalid {
        /// The file.
        path: String,
        /// Dotted field name.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The config contradicts the card chosen with `--model`.
    #[error("{path}: `{field}` is {config_value} but card `{card}` has {card_value}")]
    Mismatch {
        /// The file.
        path: String,
        /// Card name.
        card: String,
        /// config.json field name.
        field: String,
        /// Value in config.json.
        config_value: String,
        /// Value in the card.
        card_value: String,
    },
}

struct Fields<'a> {
    path: &'a str,
    root: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn get(&self, dotted: &str) -> Option<&'a Value> {
        let mut cur = self.root;
        let mut parts = dotted.split('.').peekable();
        while let Some(p) = parts.next() {
            let v = cur.get(p)?;
            if parts.peek().is_none() {
                return (!v.is_null()).then_some(v);
            }
            cur = v.as_object()?;
        }
        None
    }

    fn invalid(&self, field: &str, message: &str) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_string(),
            field: field.to_string(),
            message: message.to_string(),
        }
    }

    fn opt_uint(&self, field: &str) -> Result<Option<u64>, ConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.invalid(field, "must be a non-negative integer")),
        }
    }

    fn uint(&self, field: &str) -> Result<u64, ConfigError> {
        self.opt_uint(field)?.ok_or_else(|| ConfigError::Missing {
            path: self.path.to_string(),
            field: field.to_string(),
        })
    }

    fn opt_float(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.invalid(field, "must be a number")),
        }
    }

    /// An id that may be written as an integer or a list of integers (first wins).
    fn opt_token(&self, field: &str) -> Result<Option<u32>, ConfigError> {
        let v = match self.get(field) {
            None => return Ok(None),
            Some(Value::Array(a)) => match a.first() {
                None => return Ok(None),
                Some(v) => v,
            },
            Some(v) => v,
        };
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| self.invalid(field, "must be a token id"))
    }
}

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
    let f = Fields { path, root };
    let model_type = f.get("model_type").and_then(Value::as_str).unwrap_or("");
    if matches!(
        model_type,
        "mixtral"
            | "dbrx"
            | "qwen2_moe"
            | "qwen3_moe"
            | "olmoe"
            | "gpt_oss"
            | "deepseek_v2"
            | "deepseek_v3"
    ) {
        refuse_unimplemented(
            &f,
            matches!(model_type, "gpt_oss" | "deepseek_v2" | "deepseek_v3"),
            model_type == "gpt_oss",
        )?;
    }
    let card = match model_type {
        "mixtral" => mixtral_card(&f, name)?,
        "dbrx" => dbrx_card(&f, name)?,
        "qwen2_moe" => qwen_olmoe_card(&f, name, Family::Qwen2Moe)?,
        "qwen3_moe" => qwen_olmoe_card(&f, name, Family::Qwen3Moe)?,
        "olmoe" => qwen_olmoe_card(&f, name, Family::Olmoe)?,
        "gpt_oss" => gpt_oss_card(&f, name)?,
        "deepseek_v2" => deepseek_card(&f, name, Family::DeepseekV2)?,
        "deepseek_v3" => deepseek_card(&f, name, Family::DeepseekV3)?,
        other => {
            return Err(ConfigError::ModelType {
                path: path.into(),
                model_type: other.into(),
            })
        }
    };
    card.validate()
        .map_err(|message| f.invalid("(dimensions)", &message))?;
    Ok(card)
}

/// The card fields only gpt-oss sets, all off (the other readers spread this in).
fn gpt_oss_off() -> ModelCard {
    ModelCard {
        name: String::new(),
        family: Family::Mixtral,
        description: String::new(),
        layers: 0,
        hidden: 0,
        ffn: 0,
        heads: 0,
        kv_heads: 0,
        head_dim: 0,
        experts: 0,
        top_k: 0,
        vocab: 0,
        max_positions: 0,
        rope_theta: 0.0,
        norm_eps: 0.0,
        clip_qkv: None,
        dtype: WeightDtype::Bf16,
        tokenizer: String::new(),
        bos_token_id: None,
        eos_token_id: 0,
        sliding_window: None,
        router_norm_p: None,
        qk_norm: QkNorm::None,
        qkv_bias: false,
        shared_ffn: 0,
        shared_gate: false,
        o_bias: false,
        sinks: false,
        alternate_sliding: false,
        router_bias_topk_softmax: false,
        clamped_swiglu: None,
        yarn: None,
        mla: None,
        deepseek_router: None,
        dense_layers: 0,
        dense_ffn: 0,
    }
}

/// gpt-oss: flat fields, YaRN in `rope_scaling` (Hub) or `rope_parameters` (transformers
/// 5), alternating `layer_types`, clamped SwiGLU parameters.
fn gpt_oss_card(f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
    let hidden = f.uint("hidden_size")?;
    let heads = f.uint("num_attention_heads")?;
    if heads == 0 {
        return Err(f.invalid("num_attention_heads", "must be positive"));
    }
    let layers = f.uint("num_hidden_layers")?;
    if !flag(f, "attention_bias", true)? {
        return Err(f.invalid(
            "attention_bias",
            "is false: gpt-oss without attention biases is not supported",
        ));
    }
    if let Some(types) = f.get("layer_types") {
        let alternating = types.as_array().is_some_and(|a| {
            a.len() as u64 == layers
                && a.iter().enumerate().all(|(i, t)| {
                    t.as_str()
                        == Some(if i % 2 == 0 {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        })
                })
        });
        if !alternating {
            return Err(f.invalid(
                "layer_types",
                "is not sliding/full alternating from layer 0: only that pattern is supported",
            ));
        }
    }
    let (scaling, theta) = if f.get("rope_scaling").is_some() {
        ("rope_scaling", f.opt_float("rope_theta")?)
    } else {
        (
            "rope_parameters",
            match f.opt_float("rope_theta")? {
                Some(t) => Some(t),
                None => f.opt_float("rope_parameters.rope_theta")?,
            },
        )
    };
    let yarn = match f.get(&format!("{scaling}.rope_type")) {
        Some(Value::String(t)) if t == "yarn" => {
            for unsupported in ["attention_factor", "mscale", "mscale_all_dim"] {
                if f.get(&format!("{scaling}.{unsupported}")).is_some() {
                    return Err(f.invalid(
                        &format!("{scaling}.{unsupported}"),
                        "is not supported (YaRN with its default attention factor only)",
                    ));
                }
            }
            Some(Yarn {
                factor: f.opt_float(&format!("{scaling}.factor"))?.ok_or_else(|| {
                    ConfigError::Missing {
                        path: f.path.to_string(),
                        field: format!("{scaling}.factor"),
                    }
                })?,
                beta_fast: f
                    .opt_float(&format!("{scaling}.beta_fast"))?
                    .unwrap_or(32.0),
                beta_slow: f.opt_float(&format!("{scaling}.beta_slow"))?.unwrap_or(1.0),
                original_max_positions: f
                    .uint(&format!("{scaling}.original_max_position_embeddings"))?,
                truncate: flag(f, &format!("{scaling}.truncate"), true)?,
                mscale: None,
            })
        }
        _ => None,
    };
    let sliding_window = f.opt_uint("sliding_window")?;
    Ok(ModelCard {
        name: name.to_string(),
        family: Family::GptOss,
        description: if f.get("quantization_config").is_some() {
            // Only MXFP4 experts get here (refuse_unimplemented ran first).
            format!("gpt-oss checkpoint `{name}` (from config.json; {MXFP4_NOTE})")
        } else {
            format!("gpt-oss checkpoint `{name}` (from config.json)")
        },
        layers,
        hidden,
        ffn: f.uint("intermediate_size")?,
        heads,
        kv_heads: f.opt_uint("num_key_value_heads")?.unwrap_or(heads),
        head_dim: f.opt_uint("head_dim")?.unwrap_or(hidden / heads),
        experts: match f.opt_uint("num_local_experts")? {
            Some(e) => e,
            None => f.uint("num_experts")?,
        },
        top_k: match f.opt_uint("num_experts_per_tok")? {
            Some(k) => k,
            None => f.uint("experts_per_token")?,
        },
        vocab: f.uint("vocab_size")?,
        max_positions: f.uint("max_position_embeddings")?,
        rope_theta: theta.unwrap_or(150000.0),
        norm_eps: f.opt_float("rms_norm_eps")?.unwrap_or(1e-5),
        clip_qkv: None,
        dtype: WeightDtype::Bf16,
        tokenizer: "tokenizers/dbrx/tokenizer.json".into(),
        bos_token_id: None,
        eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(200002),
        sliding_window,
        router_norm_p: None,
        qk_norm: QkNorm::None,
        qkv_bias: true,
        shared_ffn: 0,
        shared_gate: false,
        o_bias: true,
        sinks: true,
        alternate_sliding: sliding_window.is_some(),
        router_bias_topk_softmax: true,
        clamped_swiglu: Some(ClampedSwiglu {
            alpha: f.opt_float("swiglu_alpha")?.unwrap_or(1.702),
            limit: f.opt_float("swiglu_limit")?.unwrap_or(7.0),
        }),
        yarn,
        ..gpt_oss_off()
    })
}

/// YaRN parameters in `rope_scaling` (the Hub's spelling, `type` or `rope_type`) or
/// `rope_parameters` (transformers 5), with DeepSeek's `mscale` / `mscale_all_dim`; `None`
/// without YaRN. Returns the rotary base too (top level, or inside `rope_parameters`).
fn deepseek_yarn(f: &Fields<'_>) -> Result<(Option<Yarn>, Option<f64>), ConfigError> {
    let scaling = if f.get("rope_scaling").is_some() {
        "rope_scaling"
    } else {
        "rope_parameters"
    };
    let theta = match f.opt_float("rope_theta")? {
        Some(t) => Some(t),
        None => f.opt_float("rope_parameters.rope_theta")?,
    };
    let kind = f
        .get(&format!("{scaling}.rope_type"))
        .or_else(|| f.get(&format!("{scaling}.type")))
        .and_then(Value::as_str);
    if kind != Some("yarn") {
        return Ok((None, theta));
    }
    let field = |name: &str| format!("{scaling}.{name}");
    if f.get(&field("attention_factor")).is_some() {
        return Err(f.invalid(
            &field("attention_factor"),
            "is not supported (YaRN's attention factor is derived from mscale / mscale_all_dim)",
        ));
    }
    let factor = f
        .opt_float(&field("factor"))?
        .ok_or_else(|| ConfigError::Missing {
            path: f.path.to_string(),
            field: field("factor"),
        })?;
    let mscale = match (
        f.opt_float(&field("mscale"))?,
        f.opt_float(&field("mscale_all_dim"))?,
    ) {
        (None, None) => None,
        (m, all) => Some((m.unwrap_or(0.0), all.unwrap_or(0.0))),
    };
    let yarn = Yarn {
        factor,
        beta_fast: f.opt_float(&field("beta_fast"))?.unwrap_or(32.0),
        beta_slow: f.opt_float(&field("beta_slow"))?.unwrap_or(1.0),
        original_max_positions: f.uint(&field("original_max_position_embeddings"))?,
        truncate: flag(f, &field("truncate"), true)?,
        mscale,
    };
    Ok((Some(yarn), theta))
}

/// DeepSeek-V2 / V3: MLA fields, shared and routed experts, the router's method and groups,
/// YaRN with mscale, leading dense layers (`first_k_dense_replace`, of `intermediate_size`).
/// What transformers' DeepSeek code ignores or
/// does not implement (`moe_layer_freq`, biases, V2's `norm_topk_prob`) are refused by name.
fn deepseek_card(f: &Fields<'_>, name: &str, family: Family) -> Result<ModelCard, ConfigError> {
    let hidden = f.uint("hidden_size")?;
    let heads = f.uint("num_attention_heads")?;
    let v3 = family == Family::DeepseekV3;
    // Layers 0..k are dense: one SwiGLU of `intermediate_size` instead of the MoE block.
    let dense_layers = f.opt_uint("first_k_dense_replace")?.unwrap_or(0);
    let layers = f.uint("num_hidden_layers")?;
    if dense_layers > layers {
        return Err(f.invalid(
            "first_k_dense_replace",
            &format!("is {dense_layers}, more than num_hidden_layers ({layers})"),
        ));
    }
    let dense_ffn = if dense_layers > 0 {
        f.uint("intermediate_size")?
    } else {
        0
    };
    if f.opt_uint("moe_layer_freq")?.is_some_and(|v| v != 1) {
        return Err(f.invalid(
            "moe_layer_freq",
            "must be 1 (transformers ignores it; only every-layer MoE is implemented)",
        ));
    }
    for field in ["attention_bias", "mlp_bias"] {
        if flag(f, field, false)? {
            return Err(f.invalid(field, "is true: DeepSeek with biases is not supported"));
        }
    }
    let topk_method = f
        .get("topk_method")
        .and_then(Value::as_str)
        .unwrap_or(if v3 { "noaux_tc" } else { "greedy" });
    let topk = match (v3, topk_method) {
        (false, "greedy") => DeepseekTopk::Greedy,
        (false, "group_limited_greedy") => DeepseekTopk::GroupLimitedGreedy,
        (true, "noaux_tc") => DeepseekTopk::NoauxTc,
        (_, other) => {
            return Err(f.invalid(
                "topk_method",
                &format!(
                    "`{other}` is not supported for {} (V2: greedy or group_limited_greedy; V3: \
                     noaux_tc)",
                    family.model_type()
                ),
            ))
        }
    };
    let scoring = f.get("scoring_func").and_then(Value::as_str);
    let expected_scoring = if v3 { "sigmoid" } else { "softmax" };
    if scoring.is_some_and(|s| s != expected_scoring) {
        return Err(f.invalid(
            "scoring_func",
            &format!("must be {expected_scoring} for {}", family.model_type()),
        ));
    }
    let norm_topk_prob = flag(f, "norm_topk_prob", v3)?;
    if norm_topk_prob && !v3 {
        return Err(f.invalid(
            "norm_topk_prob",
            "is true: transformers' DeepSeek-V2 router never renormalises, so its numerics are \
             not defined here",
        ));
    }
    let (yarn, theta) = deepseek_yarn(f)?;
    let kv_lora_rank = f.uint("kv_lora_rank")?;
    let qk_rope_head_dim = f.uint("qk_rope_head_dim")?;
    let qk_nope_head_dim = f.uint("qk_nope_head_dim")?;
    let mla = Mla {
        q_lora_rank: f.opt_uint("q_lora_rank")?,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim: f.uint("v_head_dim")?,
        rope_interleave: if v3 {
            flag(f, "rope_interleave", true)?
        } else {
            true
        },
        softmax_mscale: yarn
            .and_then(|y| y.mscale)
            .filter(|&(_, all)| all != 0.0)
            .map_or(1.0, |(_, all)| {
                let m = Yarn::get_mscale(yarn.map_or(1.0, |y| y.factor), all);
                m * m
            }),
    };
    let moe_ffn = f.uint("moe_intermediate_size")?;
    let experts = match f.opt_uint("n_routed_experts")? {
        Some(e) => e,
        None => f.uint("num_local_experts")?,
    };
    let n_group = f.opt_uint("n_group")?.unwrap_or(1);
    Ok(ModelCard {
        name: name.to_string(),
        family,
        description: format!(
            "{} checkpoint `{name}` (from config.json)",
            family.model_type()
        ),
        layers: f.uint("num_hidden_layers")?,
        hidden,
        ffn: moe_ffn,
        heads,
        kv_heads: 1,
        head_dim: kv_lora_rank + qk_rope_head_dim,
        experts,
        top_k: f.uint("num_experts_per_tok")?,
        vocab: f.uint("vocab_size")?,
        max_positions: f.uint("max_position_embeddings")?,
        rope_theta: theta.unwrap_or(10000.0),
        norm_eps: f.opt_float("rms_norm_eps")?.unwrap_or(1e-6),
        dtype: WeightDtype::Bf16,
        tokenizer: "tokenizers/dbrx/tokenizer.json".into(),
        bos_token_id: f.opt_token("bos_token_id")?,
        eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(1),
        shared_ffn: f.opt_uint("n_shared_experts")?.unwrap_or(0) * moe_ffn,
        yarn,
        mla: Some(mla),
        dense_layers,
        dense_ffn,
        deepseek_router: Some(DeepseekRouter {
            topk,
            n_group,
            topk_group: f.opt_uint("topk_group")?.unwrap_or(n_group),
            routed_scaling_factor: f.opt_float("routed_scaling_factor")?.unwrap_or(1.0),
            norm_topk_prob,
        }),
        ..gpt_oss_off()
    })
}

/// The modules a gpt-oss MXFP4 checkpoint must keep unquantised, as the Hub's
/// `quantization_config.modules_to_not_convert` spells them: MXFP4 is read for the routed
/// experts only.
pub const MXFP4_UNCONVERTED: [&str; 4] = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
];

/// Refuses, naming the field, what no family's numerics here implement: quantised weights
/// (except gpt-oss's MXFP4 experts where `allow_mxfp4`), rope scaling (YaRN only where
/// `allow_yarn`), activations other than SiLU.
fn refuse_unimplemented(
    f: &Fields<'_>,
    allow_yarn: bool,
    allow_mxfp4: bool,
) -> Result<(), ConfigError> {
    if let Some(q) = f.get("quantization_config") {
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("(unnamed)");
        if !(allow_mxfp4 && method == "mxfp4") {
            let only = if allow_mxfp4 {
                "bf16, f16, f32 and MXFP4 experts"
            } else {
                "bf16, f16 and f32 weights"
            };
            return Err(f.invalid(
                "quantization_config.quant_method",
                &format!("`{method}` is not supported (moec reads {only} only)"),
            ));
        }
        refuse_mxfp4_outside_experts(f)?;
    }
    for field in [
        "rope_scaling.rope_type",
        "rope_scaling.type",
        "rope_parameters.rope_type",
    ] {
        if let Some(v) = f.get(field) {
            let kind = v.as_str().unwrap_or("(not a string)");
            if kind != "default" && !(allow_yarn && kind == "yarn") {
                return Err(f.invalid(
                    field,
                    &format!("`{kind}` is not supported (only the default rotary embedding)"),
                ));
            }
        }
    }
    if let Some(Value::Object(_)) = f.root.get("rope_scaling") {
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

/// An MXFP4 config must leave every non-expert module unquantised (listing each in
/// `modules_to_not_convert`), and the experts' input widths must be whole 32-weight blocks.
fn refuse_mxfp4_outside_experts(f: &Fields<'_>) -> Result<(), ConfigError> {
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
    if let Some(module) = MXFP4_UNCONVERTED.iter().find(|m| !kept(m)) {
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
            if !n.is_multiple_of(crate::model::mxfp4::BLOCK as u64) {
                return Err(f.invalid(
                    width,
                    &format!(
                        "is {n}: MXFP4 experts need a multiple of {}",
                        crate::model::mxfp4::BLOCK
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

/// The sentence that says where MXFP4 experts went, for card descriptions and load lines.
pub const MXFP4_NOTE: &str = "experts stored as MXFP4 (4.25 bits/weight on disk), \
     dequantized to bf16 at load; memory and the cost model count bf16";

fn flag(f: &Fields<'_>, field: &str, default: bool) -> Result<bool, ConfigError> {
    match f.get(field) {
        None => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| f.invalid(field, "must be true or false")),
    }
}

/// Qwen2-MoE, Qwen3-MoE and OLMoE: Llama-style flat fields.
fn qwen_olmoe_card(f: &Fields<'_>, name: &str, family: Family) -> Result<ModelCard, ConfigError> {
    let hidden = f.uint("hidden_size")?;
    let heads = f.uint("num_attention_heads")?;
    if heads == 0 {
        return Err(f.invalid("num_attention_heads", "must be positive"));
    }
    let rope_theta = match f.opt_float("rope_theta")? {
        Some(t) => t,
        None => f
            .opt_float("rope_parameters.rope_theta")?
            .unwrap_or(10000.0),
    };
    // Every layer sparse and full attention: what moec's uniform layers implement.
    if family != Family::Olmoe {
        if flag(f, "use_sliding_window", false)? {
            return Err(f.invalid(
                "use_sliding_window",
                "is true: sliding-window layers of this family are not supported",
            ));
        }
        if let Some(step) = f.opt_uint("decoder_sparse_step")? {
            if step != 1 {
                return Err(f.invalid(
                    "decoder_sparse_step",
                    &format!("is {step}: only every layer sparse (1) is supported"),
                ));
            }
        }
        if let Some(layers) = f.get("mlp_only_layers") {
            if layers.as_array().is_none_or(|a| !a.is_empty()) {
                return Err(f.invalid(
                    "mlp_only_layers",
                    "lists dense layers: only every layer sparse is supported",
                ));
            }
        }
    }
    let (experts_field, ffn_field) = match family {
        Family::Olmoe => ("num_experts", "intermediate_size"),
        _ => ("num_experts", "moe_intermediate_size"),
    };
    let experts = match f.opt_uint(experts_field)? {
        Some(e) => e,
        None => f.uint("num_local_experts")?,
    };
    let qkv_bias = match family {
        Family::Qwen2Moe => flag(f, "qkv_bias", true)?,
        _ => false,
    };
    if family != Family::Qwen2Moe && flag(f, "attention_bias", false)? {
        return Err(f.invalid(
            "attention_bias",
            "is true: attention biases of this family are not supported",
        ));
    }
    let shared_ffn = match family {
        Family::Qwen2Moe => f.uint("shared_expert_intermediate_size")?,
        _ => 0,
    };
    let clip_qkv = match family {
        Family::Olmoe => f.opt_float("clip_qkv")?,
        _ => None,
    };
    let (tokenizer, default_eos, eps) = match family {
        Family::Olmoe => ("tokenizers/mixtral/tokenizer.json", 50279, 1e-5),
        _ => ("tokenizers/dbrx/tokenizer.json", 151643, 1e-6),
    };
    Ok(ModelCard {
        name: name.to_string(),
        family,
        description: format!("{family:?}-family checkpoint `{name}` (from config.json)"),
        layers: f.uint("num_hidden_layers")?,
        hidden,
        ffn: f.uint(ffn_field)?,
        heads,
        kv_heads: f.opt_uint("num_key_value_heads")?.unwrap_or(heads),
        head_dim: match family {
            // OLMoE has no head_dim field: its q/k norms assume hidden / heads.
            Family::Olmoe => hidden / heads,
            _ => f.opt_uint("head_dim")?.unwrap_or(hidden / heads),
        },
        experts,
        top_k: f.uint("num_experts_per_tok")?,
        vocab: f.uint("vocab_size")?,
        max_positions: f.uint("max_position_embeddings")?,
        rope_theta,
        norm_eps: f.opt_float("rms_norm_eps")?.unwrap_or(eps),
        clip_qkv,
        dtype: WeightDtype::Bf16,
        tokenizer: tokenizer.into(),
        // The Qwen and OLMoE tokenizers prepend nothing (config `bos_token_id` is only the
        // id of a special token).
        bos_token_id: None,
        eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(default_eos),
        sliding_window: None,
        router_norm_p: flag(f, "norm_topk_prob", false)?.then_some(1.0),
        qk_norm: match family {
            Family::Qwen3Moe => QkNorm::PerHead,
            Family::Olmoe => QkNorm::Full,
            _ => QkNorm::None,
        },
        qkv_bias,
        shared_ffn,
        shared_gate: shared_ffn > 0,
        ..gpt_oss_off()
    })
}

fn mixtral_card(f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
    let hidden = f.uint("hidden_size")?;
    let heads = f.uint("num_attention_heads")?;
    if heads == 0 {
        return Err(f.invalid("num_attention_heads", "must be positive"));
    }
    let rope_theta = match f.opt_float("rope_theta")? {
        Some(t) => t,
        None => f.opt_float("rope_parameters.rope_theta")?.unwrap_or(1e6),
    };
    Ok(ModelCard {
        name: name.to_string(),
        family: Family::Mixtral,
        description: format!("Mixtral-family checkpoint `{name}` (from config.json)"),
        layers: f.uint("num_hidden_layers")?,
        hidden,
        ffn: f.uint("intermediate_size")?,
        heads,
        kv_heads: f.opt_uint("num_key_value_heads")?.unwrap_or(heads),
        head_dim: f.opt_uint("head_dim")?.unwrap_or(hidden / heads),
        experts: f.uint("num_local_experts")?,
        top_k: f.uint("num_experts_per_tok")?,
        vocab: f.uint("vocab_size")?,
        max_positions: f.uint("max_position_embeddings")?,
        rope_theta,
        norm_eps: f.opt_float("rms_norm_eps")?.unwrap_or(1e-5),
        clip_qkv: None,
        dtype: WeightDtype::Bf16,
        tokenizer: "tokenizers/mixtral/tokenizer.json".into(),
        bos_token_id: f.opt_token("bos_token_id")?.or(Some(1)),
        eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(2),
        sliding_window: f.opt_uint("sliding_window")?,
        router_norm_p: Some(1.0),
        qk_norm: QkNorm::None,
        qkv_bias: false,
        shared_ffn: 0,
        shared_gate: false,
        ..gpt_oss_off()
    })
}

fn dbrx_card(f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
    let hidden = f.uint("d_model")?;
    let heads = f.uint("n_heads")?;
    if heads == 0 || hidden % heads != 0 {
        return Err(f.invalid("n_heads", "must be positive and divide d_model"));
    }
    let rope_theta = f.opt_float("attn_config.rope_theta")?.unwrap_or(10000.0);
    // transformers 5.x reads the rotary base from top-level `rope_parameters` and ignores
    // `attn_config.rope_theta`; a checkpoint where they differ computes differently in HF
    // than its Hub config says, so refuse it rather than pick one silently.
    if let Some(other) = f.opt_float("rope_parameters.rope_theta")? {
        if other != rope_theta {
            return Err(f.invalid(
                "rope_parameters.rope_theta",
                &format!("({other}) disagrees with attn_config.rope_theta ({rope_theta})"),
            ));
        }
    }
    let router_norm_p = match f
        .root
        .get("ffn_config")
        .and_then(|c| c.get("moe_normalize_expert_weights"))
    {
        Some(Value::Null) => None,
        None => Some(1.0),
        Some(v) => Some(v.as_f64().ok_or_else(|| {
            f.invalid(
                "ffn_config.moe_normalize_expert_weights",
                "must be a number or null",
            )
        })?),
    };
    Ok(ModelCard {
        name: name.to_string(),
        family: Family::Dbrx,
        description: format!("DBRX-family checkpoint `{name}` (from config.json)"),
        layers: f.uint("n_layers")?,
        hidden,
        ffn: f.uint("ffn_config.ffn_hidden_size")?,
        heads,
        kv_heads: f.opt_uint("attn_config.kv_n_heads")?.unwrap_or(1),
        head_dim: hidden / heads,
        experts: f.uint("ffn_config.moe_num_experts")?,
        top_k: f.uint("ffn_config.moe_top_k")?,
        vocab: f.uint("vocab_size")?,
        max_positions: f.uint("max_seq_len")?,
        rope_theta,
        norm_eps: 1e-5,
        clip_qkv: f.opt_float("attn_config.clip_qkv")?,
        dtype: WeightDtype::Bf16,
        tokenizer: "tokenizers/dbrx/tokenizer.json".into(),
        bos_token_id: None,
        eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(100257),
        sliding_window: None,
        router_norm_p,
        qk_norm: QkNorm::None,
        qkv_bias: false,
        shared_ffn: 0,
        shared_gate: false,
        ..gpt_oss_off()
    })
}

/// The config.json spelling of each architectural card field, per family.
fn field_name(family: Family, card_field: &str) -> &'static str {
    let (mixtral, dbrx) = match card_field {
        "layers" => ("num_hidden_layers", "n_layers"),
        "hidden" => ("hidden_size", "d_model"),
        "ffn" => ("intermediate_size", "ffn_config.ffn_hidden_size"),
        "heads" => ("num_attention_heads", "n_heads"),
        "kv_heads" => ("num_key_value_heads", "attn_config.kv_n_heads"),
        "head_dim" => ("head_dim", "d_model / n_heads"),
        "experts" => ("num_local_experts", "ffn_config.moe_num_experts"),
        "top_k" => ("num_experts_per_tok", "ffn_config.moe_top_k"),
        "vocab" => ("vocab_size", "vocab_size"),
        "max_positions" => ("max_position_embeddings", "max_seq_len"),
        "rope_theta" => ("rope_theta", "attn_config.rope_theta"),
        "norm_eps" => ("rms_norm_eps", "(LayerNorm eps)"),
        "clip_qkv" => ("(clip_qkv)", "attn_config.clip_qkv"),
        "router_norm_p" => (
            "(router renormalisation)",
            "ffn_config.moe_normalize_expert_weights",
        ),
        _ => ("model_type", "model_type"),
    };
    let qwen = match card_field {
        "experts" => "num_experts",
        "ffn" if family != Family::Olmoe => "moe_intermediate_size",
        "router_norm_p" => "norm_topk_prob",
        "clip_qkv" => "clip_qkv",
        "shared_ffn" => "shared_expert_intermediate_size",
        "qkv_bias" => "qkv_bias",
        _ => mixtral,
    };
    match family {
        Family::Mixtral => mixtral,
        Family::Dbrx => dbrx,
        Family::Qwen2Moe | Family::Qwen3Moe | Family::Olmoe => qwen,
        Family::GptOss => match card_field {
            "experts" => "num_local_experts",
            "yarn" => "rope_scaling",
            "clamped_swiglu" => "swiglu_alpha / swiglu_limit",
            _ => mixtral,
        },
        Family::DeepseekV2 | Family::DeepseekV3 => match card_field {
            "experts" => "n_routed_experts",
            "ffn" => "moe_intermediate_size",
            "kv_heads" | "head_dim" => "kv_lora_rank + qk_rope_head_dim",
            "shared_ffn" => "n_shared_experts",
            "dense_layers" => "first_k_dense_replace",
            "dense_ffn" => "intermediate_size",
            "yarn" => "rope_scaling",
            "mla" => "q_lora_rank / kv_lora_rank / qk_*_head_dim / v_head_dim",
            "deepseek_router" => "topk_method / n_group / topk_group / routed_scaling_factor",
            _ => mixtral,
        },
    }
}

/// Checks that the architecture read from config.json (`from_config`) is the card's.
pub fn check_agreement(
    from_config: &ModelCard,
    card: &ModelCard,
    path: &str,
) -> Result<(), ConfigError> {
    let mismatch = |field: &str, config_value: String, card_value: String| ConfigError::Mismatch {
        path: path.to_string(),
        card: card.name.clone(),
        field: field_name(from_config.family, field).to_string(),
        config_value,
        card_value,
    };
    if from_config.family != card.family {
        return Err(mismatch(
            "family",
            format!("{:?}", from_config.family),
            format!("{:?}", card.family),
        ));
    }
    let ints = [
        ("layers", from_config.layers, card.layers),
        ("hidden", from_config.hidden, card.hidden),
        ("ffn", from_config.ffn, card.ffn),
        ("heads", from_config.heads, card.heads),
        ("kv_heads", from_config.kv_heads, card.kv_heads),
        ("head_dim", from_config.head_dim, card.head_dim),
        ("experts", from_config.experts, card.experts),
        ("top_k", from_config.top_k, card.top_k),
        ("vocab", from_config.vocab, card.vocab),
        ("dense_layers", from_config.dense_layers, card.dense_layers),
        ("dense_ffn", from_config.dense_ffn, card.dense_ffn),
        (
            "max_positions",
            from_config.max_positions,
            card.max_positions,
        ),
    ];
    for (field, a, b) in ints {
        if a != b {
            return Err(mismatch(field, a.to_string(), b.to_string()));
        }
    }
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    if !close(from_config.rope_theta, card.rope_theta) {
        return Err(mismatch(
            "rope_theta",
            from_config.rope_theta.to_string(),
            card.rope_theta.to_string(),
        ));
    }
    if !close(from_config.norm_eps, card.norm_eps) {
        return Err(mismatch(
            "norm_eps",
            from_config.norm_eps.to_string(),
            card.norm_eps.to_string(),
        ));
    }
    if from_config.clip_qkv != card.clip_qkv {
        return Err(mismatch(
            "clip_qkv",
            format!("{:?}", from_config.clip_qkv),
            format!("{:?}", card.clip_qkv),
        ));
    }
    if from_config.shared_ffn != card.shared_ffn {
        return Err(mismatch(
            "shared_ffn",
            from_config.shared_ffn.to_string(),
            card.shared_ffn.to_string(),
        ));
    }
    if from_config.qkv_bias != card.qkv_bias {
        return Err(mismatch(
            "qkv_bias",
            from_config.qkv_bias.to_string(),
            card.qkv_bias.to_string(),
        ));
    }
    if from_config.yarn != card.yarn {
        return Err(mismatch(
            "yarn",
            format!("{:?}", from_config.yarn),
            format!("{:?}", card.yarn),
        ));
    }
    if from_config.mla != card.mla {
        return Err(mismatch(
            "mla",
            format!("{:?}", from_config.mla),
            format!("{:?}", card.mla),
        ));
    }
    if from_config.deepseek_router != card.deepseek_router {
        return Err(mismatch(
            "deepseek_router",
            format!("{:?}", from_config.deepseek_router),
            format!("{:?}", card.deepseek_router),
        ));
    }
    if from_config.clamped_swiglu != card.clamped_swiglu {
        return Err(mismatch(
            "clamped_swiglu",
            format!("{:?}", from_config.clamped_swiglu),
            format!("{:?}", card.clamped_swiglu),
        ));
    }
    if card.family != Family::Mixtral && from_config.router_norm_p != card.router_norm_p {
        return Err(mismatch(
            "router_norm_p",
            format!("{:?}", from_config.router_norm_p),
            format!("{:?}", card.router_norm_p),
        ));
    }
    Ok(())
}

/// A DeepSeek config.json in the Hub's spelling (what transformers' `DeepseekV2Config` /
/// `DeepseekV3Config` read): MLA ranks and head widths, router fields, YaRN in
/// `rope_scaling` with `mscale` / `mscale_all_dim`.
fn deepseek_config(card: &ModelCard, dtype: WeightDtype) -> Value {
    let v3 = card.family == Family::DeepseekV3;
    let mla = card.mla.unwrap_or(Mla {
        q_lora_rank: None,
        kv_lora_rank: card.head_dim,
        qk_nope_head_dim: 0,
        qk_rope_head_dim: 0,
        v_head_dim: 0,
        rope_interleave: true,
        softmax_mscale: 1.0,
    });
    let router = card.deepseek_router.unwrap_or(DeepseekRouter {
        topk: DeepseekTopk::Greedy,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 1.0,
        norm_topk_prob: false,
    });
    let topk_method = match router.topk {
        DeepseekTopk::Greedy => "greedy",
        DeepseekTopk::GroupLimitedGreedy => "group_limited_greedy",
        DeepseekTopk::NoauxTc => "noaux_tc",
    };
    let mut v = json!({
        "architectures": [if v3 { "DeepseekV3ForCausalLM" } else { "DeepseekV2ForCausalLM" }],
        "model_type": card.family.model_type(),
        "hidden_size": card.hidden,
        "intermediate_size": card.dense_ffn.max(card.ffn),
        "moe_intermediate_size": card.ffn,
        "num_hidden_layers": card.layers,
        "num_attention_heads": card.heads,
        "num_key_value_heads": card.heads,
        "n_shared_experts": card.shared_ffn / card.ffn.max(1),
        "n_routed_experts": card.experts,
        "num_experts_per_tok": card.top_k,
        "first_k_dense_replace": card.dense_layers,
        "moe_layer_freq": 1,
        "topk_method": topk_method,
        "scoring_func": if v3 { "sigmoid" } else { "softmax" },
        "n_group": router.n_group,
        "topk_group": router.topk_group,
        "routed_scaling_factor": router.routed_scaling_factor,
        "norm_topk_prob": router.norm_topk_prob,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "vocab_size": card.vocab,
        "max_position_embeddings": card.max_positions,
        "rms_norm_eps": card.norm_eps,
        "rope_theta": card.rope_theta,
        "rope_scaling": card.yarn.map(|y| {
            let mut r = json!({
                "type": "yarn",
                "factor": y.factor,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
                "original_max_position_embeddings": y.original_max_positions,
                "truncate": y.truncate,
            });
            if let (Some((m, all)), Some(obj)) = (y.mscale, r.as_object_mut()) {
                obj.insert("mscale".into(), json!(m));
                obj.insert("mscale_all_dim".into(), json!(all));
            }
            r
        }),
        "attention_bias": false,
        "bos_token_id": card.bos_token_id,
        "eos_token_id": card.eos_token_id,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": torch_dtype(dtype),
    });
    if let (true, Some(obj)) = (v3, v.as_object_mut()) {
        obj.insert("rope_interleave".into(), json!(mla.rope_interleave));
    }
    v
}

fn torch_dtype(dtype: WeightDtype) -> &'static str {
    match dtype {
        WeightDtype::Bf16 => "bfloat16",
        WeightDtype::F16 => "float16",
        WeightDtype::F32 => "float32",
    }
}

/// A config.json for `card` in its family's Hub spelling (for synthetic checkpoints).
pub fn config_for_card(card: &ModelCard, dtype: WeightDtype) -> Value {
    let llama_style = || {
        json!({
            "architectures": [match card.family {
                Family::Qwen2Moe => "Qwen2MoeForCausalLM",
                Family::Qwen3Moe => "Qwen3MoeForCausalLM",
                _ => "OlmoeForCausalLM",
            }],
            "model_type": card.family.model_type(),
            "hidden_size": card.hidden,
            "num_hidden_layers": card.layers,
            "num_attention_heads": card.heads,
            "num_key_value_heads": card.kv_heads,
            "num_experts": card.experts,
            "num_experts_per_tok": card.top_k,
            "norm_topk_prob": card.router_norm_p.is_some(),
            "vocab_size": card.vocab,
            "max_position_embeddings": card.max_positions,
            "rms_norm_eps": card.norm_eps,
            "rope_theta": card.rope_theta,
            "eos_token_id": card.eos_token_id,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "output_router_logits": false,
            "use_cache": true,
            "torch_dtype": torch_dtype(dtype),
        })
    };
    match card.family {
        Family::GptOss => json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": card.hidden,
            "intermediate_size": card.ffn,
            "num_hidden_layers": card.layers,
            "num_attention_heads": card.heads,
            "num_key_value_heads": card.kv_heads,
            "head_dim": card.head_dim,
            "num_local_experts": card.experts,
            "num_experts_per_tok": card.top_k,
            "vocab_size": card.vocab,
            "max_position_embeddings": card.max_positions,
            "rms_norm_eps": card.norm_eps,
            "rope_theta": card.rope_theta,
            "rope_scaling": card.yarn.map(|y| json!({
                "rope_type": "yarn",
                "factor": y.factor,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
                "original_max_position_embeddings": y.original_max_positions,
                "truncate": y.truncate,
            })),
            "sliding_window": card.sliding_window,
            "layer_types": (0..card.layers)
                .map(|i| if i % 2 == 0 && card.sliding_window.is_some() {
                    "sliding_attention"
                } else {
                    "full_attention"
                })
                .collect::<Vec<_>>(),
            "attention_bias": true,
            "swiglu_alpha": card.clamped_swiglu.map(|c| c.alpha),
            "swiglu_limit": card.clamped_swiglu.map(|c| c.limit),
            "eos_token_id": card.eos_token_id,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "output_router_logits": false,
            "use_cache": true,
            "torch_dtype": torch_dtype(dtype),
        }),
        Family::DeepseekV2 | Family::DeepseekV3 => deepseek_config(card, dtype),
        Family::Qwen2Moe | Family::Qwen3Moe | Family::Olmoe => {
            let mut v = llama_style();
            if let Some(obj) = v.as_object_mut() {
                let extra = match card.family {
                    Family::Qwen2Moe => json!({
                        "moe_intermediate_size": card.ffn,
                        "intermediate_size": card.shared_ffn,
                        "shared_expert_intermediate_size": card.shared_ffn,
                        "qkv_bias": card.qkv_bias,
                        "head_dim": card.head_dim,
                        "use_sliding_window": false,
                        "decoder_sparse_step": 1,
                        "mlp_only_layers": [],
                    }),
                    Family::Qwen3Moe => json!({
                        "moe_intermediate_size": card.ffn,
                        "intermediate_size": card.ffn * card.top_k,
                        "head_dim": card.head_dim,
                        "attention_bias": false,
                        "use_sliding_window": false,
                        "decoder_sparse_step": 1,
                        "mlp_only_layers": [],
                    }),
                    _ => json!({
                        "intermediate_size": card.ffn,
                        "clip_qkv": card.clip_qkv,
                        "attention_bias": false,
                    }),
                };
                if let Value::Object(extra) = extra {
                    obj.extend(extra);
                }
            }
            v
        }
        Family::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_size": card.hidden,
            "intermediate_size": card.ffn,
            "num_hidden_layers": card.layers,
            "num_attention_heads": card.heads,
            "num_key_value_heads": card.kv_heads,
            "head_dim": card.head_dim,
            "num_local_experts": card.experts,
            "num_experts_per_tok": card.top_k,
            "vocab_size": card.vocab,
            "max_position_embeddings": card.max_positions,
            "rms_norm_eps": card.norm_eps,
            "rope_theta": card.rope_theta,
            "sliding_window": card.sliding_window,
            "bos_token_id": card.bos_token_id,
            "eos_token_id": card.eos_token_id,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_dropout": 0.0,
            "router_aux_loss_coef": 0.02,
            "output_router_logits": false,
            "initializer_range": 0.02,
            "use_cache": true,
            "torch_dtype": torch_dtype(dtype),
        }),
        Family::Dbrx => json!({
            "architectures": ["DbrxForCausalLM"],
            "model_type": "dbrx",
            "d_model": card.hidden,
            "n_heads": card.heads,
            "n_layers": card.layers,
            "max_seq_len": card.max_positions,
            "vocab_size": card.vocab,
            "attn_config": {
                "clip_qkv": card.clip_qkv,
                "kv_n_heads": card.kv_heads,
                "rope_theta": card.rope_theta,
                "attn_pdrop": 0.0,
                "model_type": "",
            },
            "ffn_config": {
                "ffn_hidden_size": card.ffn,
                "moe_num_experts": card.experts,
                "moe_top_k": card.top_k,
                "moe_jitter_eps": 0.0,
                "moe_loss_weight": 0.05,
                "moe_normalize_expert_weights": card.router_norm_p,
                "ffn_act_fn": {"name": "silu"},
                "model_type": "",
            },
            "eos_token_id": card.eos_token_id,
            "tie_word_embeddings": false,
            "initializer_range": 0.02,
            "output_router_logits": false,
            "resid_pdrop": 0.0,
            "emb_pdrop": 0.0,
            "use_cache": true,
            "torch_dtype": torch_dtype(dtype),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    /// dequantized to bf16. The same config without `quantization_config` (a bf16
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
