//! DeepSeek-V2 / V3: MLA fields, shared and routed experts, the router's method and
//! groups, YaRN with mscale, leading dense layers (`first_k_dense_replace`, of
//! `intermediate_size`); MLA projections (`q_a_proj`/`q_b_proj` or `q_proj`,
//! `kv_a_proj_with_mqa`, `kv_b_proj`), `shared_experts`, V3's `e_score_correction_bias`
//! and the dense layers' `mlp.gate_proj/up_proj/down_proj`. What transformers' DeepSeek
//! code ignores or does not implement (`moe_layer_freq`, biases, V2's `norm_topk_prob`)
//! is refused by name.

use super::fields::{torch_dtype, ConfigError, Fields};
use super::hub::SegmentTensor;
use super::hub::{blank_card, CardField, FamilySpec};
use super::llama;
use crate::model::arch::ArchSpec;
use crate::model::card::{DeepseekRouter, DeepseekTopk, Mla, ModelCard, Yarn};
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;
use crate::quant::storage::WeightDtype;
use crate::weights::gguf::families::EpsRule;
use crate::weights::gguf::families::{GgufFamily, Meta, TEXT};
use crate::weights::gguf::GgufError;
use serde_json::{json, Value};

/// DeepSeek-V2 or V3 (the field says which).
pub(super) struct Deepseek(Family);

/// DeepSeek-V2 (V2-Lite, V2).
pub(super) const DEEPSEEK_V2: Deepseek = Deepseek(Family::DeepseekV2);
/// DeepSeek-V3.
pub(super) const DEEPSEEK_V3: Deepseek = Deepseek(Family::DeepseekV3);

/// llama.cpp's `deepseek2` (V2 and V3, told apart by the gating function): MLA's keys and
/// no per-head key/value length keys; the config's epsilon, else 1e-6.
const GGUF: [GgufFamily; 2] = [
    GgufFamily {
        family: Family::DeepseekV2,
        arch: "deepseek2",
        mla_keys: true,
        eps: EpsRule::ConfigOr(1e-6),
        ..TEXT
    },
    GgufFamily {
        family: Family::DeepseekV3,
        arch: "deepseek2",
        mla_keys: true,
        eps: EpsRule::ConfigOr(1e-6),
        ..TEXT
    },
];

impl FamilySpec for Deepseek {
    fn family(&self) -> Family {
        self.0
    }

    fn card_from_config(&self, f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
        let family = self.0;
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
            if f.flag(field, false)? {
                return Err(f.invalid(field, "is true: DeepSeek with biases is not supported"));
            }
        }
        let topk_method = f
            .str("topk_method")
            .unwrap_or(if v3 { "noaux_tc" } else { "greedy" });
        let topk = match (v3, topk_method) {
            (false, "greedy") => DeepseekTopk::Greedy,
            (false, "group_limited_greedy") => DeepseekTopk::GroupLimitedGreedy,
            (true, "noaux_tc") => DeepseekTopk::NoauxTc,
            (_, other) => {
                return Err(f.invalid(
                    "topk_method",
                    &format!(
                        "`{other}` is not supported for {} (V2: greedy or group_limited_greedy; \
                         V3: noaux_tc)",
                        self.family().model_type()
                    ),
                ))
            }
        };
        let scoring = f.str("scoring_func");
        let expected_scoring = if v3 { "sigmoid" } else { "softmax" };
        if scoring.is_some_and(|s| s != expected_scoring) {
            return Err(f.invalid(
                "scoring_func",
                &format!(
                    "must be {expected_scoring} for {}",
                    self.family().model_type()
                ),
            ));
        }
        let norm_topk_prob = f.flag("norm_topk_prob", v3)?;
        if norm_topk_prob && !v3 {
            return Err(f.invalid(
                "norm_topk_prob",
                "is true: transformers' DeepSeek-V2 router never renormalises, so its numerics \
                 are not defined here",
            ));
        }
        let (yarn, theta) = yarn(f)?;
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
                f.flag("rope_interleave", true)?
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
            kv_b_split: false,
            values_in_keys: false,
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
                self.family().model_type()
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
            tokenizer: self.family().facts().tokenizer.into(),
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
            ..blank_card()
        })
    }

    /// The Hub's spelling (what transformers' `DeepseekV2Config` / `DeepseekV3Config`
    /// read): MLA ranks and head widths, router fields, YaRN in `rope_scaling` with
    /// `mscale` / `mscale_all_dim`.
    fn config_for_card(&self, card: &ModelCard, dtype: WeightDtype) -> Value {
        let v3 = self.0 == Family::DeepseekV3;
        let mla = card.mla.unwrap_or(Mla {
            q_lora_rank: None,
            kv_lora_rank: card.head_dim,
            qk_nope_head_dim: 0,
            qk_rope_head_dim: 0,
            v_head_dim: 0,
            rope_interleave: true,
            softmax_mscale: 1.0,
            kv_b_split: false,
            values_in_keys: false,
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
            "model_type": self.family().model_type(),
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

    fn config_key(&self, field: CardField) -> Option<&'static str> {
        Some(match field {
            CardField::Experts => "n_routed_experts",
            CardField::Ffn => "moe_intermediate_size",
            CardField::KvHeads | CardField::HeadDim => "kv_lora_rank + qk_rope_head_dim",
            CardField::SharedFfn => "n_shared_experts",
            CardField::DenseLayers => "first_k_dense_replace",
            CardField::DenseFfn => "intermediate_size",
            CardField::Yarn => "rope_scaling",
            CardField::Mla => "q_lora_rank / kv_lora_rank / qk_*_head_dim / v_head_dim",
            CardField::DeepseekRouter => {
                "topk_method / n_group / topk_group / routed_scaling_factor"
            }
            other => llama::flat_key(other),
        })
    }

    fn segment_tensor(&self, _a: &ArchSpec, layer: usize, kind: SegmentKind) -> SegmentTensor {
        let p = format!("model.layers.{layer}");
        SegmentTensor::Whole(match kind {
            SegmentKind::QAProj => format!("{p}.self_attn.q_a_proj.weight"),
            SegmentKind::QANorm => format!("{p}.self_attn.q_a_layernorm.weight"),
            SegmentKind::QBProj => format!("{p}.self_attn.q_b_proj.weight"),
            SegmentKind::KvAProj => format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
            SegmentKind::KvANorm => format!("{p}.self_attn.kv_a_layernorm.weight"),
            // One tensor, viewed by both the `pre` and the `o` part.
            SegmentKind::KvB | SegmentKind::KvBOut => format!("{p}.self_attn.kv_b_proj.weight"),
            // llama.cpp's split halves of `kv_b_proj` (GGUF files only; the Hub has no such
            // tensors), named here so the GGUF reader can file them.
            SegmentKind::KB => format!("{p}.self_attn.k_b_proj.weight"),
            SegmentKind::VB => format!("{p}.self_attn.v_b_proj.weight"),
            // A leading dense layer's FFN (`DeepseekV2MLP` of `intermediate_size`).
            SegmentKind::DenseGate => format!("{p}.mlp.gate_proj.weight"),
            SegmentKind::DenseUp => format!("{p}.mlp.up_proj.weight"),
            SegmentKind::DenseDown => format!("{p}.mlp.down_proj.weight"),
            SegmentKind::RouterBias => format!("{p}.mlp.gate.e_score_correction_bias"),
            SegmentKind::SharedGate => format!("{p}.mlp.shared_experts.gate_proj.weight"),
            SegmentKind::SharedUp => format!("{p}.mlp.shared_experts.up_proj.weight"),
            SegmentKind::SharedDown => format!("{p}.mlp.shared_experts.down_proj.weight"),
            other => llama::segment_name(&llama::MLP, self.0, layer, other),
        })
    }

    fn gguf(&self) -> &'static GgufFamily {
        match self.0 {
            Family::DeepseekV3 => &GGUF[1],
            _ => &GGUF[0],
        }
    }

    fn config_from_gguf(&self, m: &Meta<'_>) -> Result<Value, GgufError> {
        let v3 = self.0 == Family::DeepseekV3;
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
                .is_some_and(|v| *v == crate::weights::gguf::Value::Bool(true)),
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
}

/// YaRN parameters in `rope_scaling` (the Hub's spelling, `type` or `rope_type`) or
/// `rope_parameters` (transformers 5), with DeepSeek's `mscale` / `mscale_all_dim`;
/// `None` without YaRN. Returns the rotary base too (top level, or inside
/// `rope_parameters`).
fn yarn(f: &Fields<'_>) -> Result<(Option<Yarn>, Option<f64>), ConfigError> {
    let scaling = if f.get("rope_scaling").is_some() {
        "rope_scaling"
    } else {
        "rope_parameters"
    };
    let theta = f.rope_theta()?;
    let field = |name: &str| format!("{scaling}.{name}");
    let kind = f
        .get(&field("rope_type"))
        .or_else(|| f.get(&field("type")))
        .and_then(Value::as_str);
    if kind != Some("yarn") {
        return Ok((None, theta));
    }
    if f.get(&field("attention_factor")).is_some() {
        return Err(f.invalid(
            &field("attention_factor"),
            "is not supported (YaRN's attention factor is derived from mscale / mscale_all_dim)",
        ));
    }
    let factor = f
        .opt_float(&field("factor"))?
        .ok_or_else(|| f.missing(&field("factor")))?;
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
        truncate: f.flag(&field("truncate"), true)?,
        mscale,
    };
    Ok((Some(yarn), theta))
}
