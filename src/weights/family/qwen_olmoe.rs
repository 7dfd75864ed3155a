//! Qwen2-MoE, Qwen3-MoE and AllenAI's OLMoE: one Llama-style config.json shape (flat
//! fields, `num_experts` or `num_local_experts`, `norm_topk_prob`, Qwen2's
//! `shared_expert_*`), per-expert `mlp.experts.{e}.gate_proj/up_proj/down_proj` with the
//! q/k norms, q/k/v biases and shared expert their layouts list. Sliding-window or
//! dense-only layers of the Qwen families, and attention biases where the family has none,
//! are refused by field.

use super::fields::{torch_dtype, ConfigError, Fields};
use super::hub::SegmentTensor;
use super::hub::{blank_card, CardField, FamilySpec};
use super::llama;
use crate::model::arch::ArchSpec;
use crate::model::card::{ModelCard, QkNorm};
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;
use crate::quant::storage::WeightDtype;
use crate::weights::gguf::families::EpsRule;
use crate::weights::gguf::families::{GgufFamily, Meta, TEXT};
use crate::weights::gguf::GgufError;
use serde_json::{json, Value};

/// One of the three families (the field says which).
pub(super) struct QwenOlmoe(Family);

/// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B).
pub(super) const QWEN2_MOE: QwenOlmoe = QwenOlmoe(Family::Qwen2Moe);
/// Qwen3-MoE (30B-A3B, 235B-A22B).
pub(super) const QWEN3_MOE: QwenOlmoe = QwenOlmoe(Family::Qwen3Moe);
/// OLMoE.
pub(super) const OLMOE: QwenOlmoe = QwenOlmoe(Family::Olmoe);

impl QwenOlmoe {
    /// Every layer sparse and full attention: what moec's uniform layers implement.
    fn refuse_nonuniform_layers(f: &Fields<'_>) -> Result<(), ConfigError> {
        if f.flag("use_sliding_window", false)? {
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
        Ok(())
    }
}

/// llama.cpp's `qwen2moe`, `qwen3moe` (the routed and shared experts' widths under their
/// own keys) and `olmoe` (whose converter always writes epsilon 1e-5).
const GGUF: [GgufFamily; 3] = [
    GgufFamily {
        family: Family::Qwen2Moe,
        arch: "qwen2moe",
        expert_width_keys: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::Qwen3Moe,
        arch: "qwen3moe",
        expert_width_keys: true,
        ..TEXT
    },
    GgufFamily {
        family: Family::Olmoe,
        arch: "olmoe",
        eps: EpsRule::Fixed(1e-5),
        ..TEXT
    },
];

impl FamilySpec for QwenOlmoe {
    fn family(&self) -> Family {
        self.0
    }

    fn card_from_config(&self, f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
        let family = self.0;
        let hidden = f.uint("hidden_size")?;
        let heads = f.positive_uint("num_attention_heads")?;
        let rope_theta = f.rope_theta()?.unwrap_or(10000.0);
        if family != Family::Olmoe {
            Self::refuse_nonuniform_layers(f)?;
        }
        let ffn_field = match family {
            Family::Olmoe => "intermediate_size",
            _ => "moe_intermediate_size",
        };
        let experts = match f.opt_uint("num_experts")? {
            Some(e) => e,
            None => f.uint("num_local_experts")?,
        };
        let qkv_bias = match family {
            Family::Qwen2Moe => f.flag("qkv_bias", true)?,
            _ => false,
        };
        if family != Family::Qwen2Moe && f.flag("attention_bias", false)? {
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
        let (default_eos, eps) = match family {
            Family::Olmoe => (50279, 1e-5),
            _ => (151643, 1e-6),
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
            tokenizer: self.family().facts().tokenizer.into(),
            // The Qwen and OLMoE tokenizers prepend nothing (config `bos_token_id` is only
            // the id of a special token).
            bos_token_id: None,
            eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(default_eos),
            sliding_window: None,
            router_norm_p: f.flag("norm_topk_prob", false)?.then_some(1.0),
            qk_norm: match family {
                Family::Qwen3Moe => QkNorm::PerHead,
                Family::Olmoe => QkNorm::Full,
                _ => QkNorm::None,
            },
            qkv_bias,
            shared_ffn,
            shared_gate: shared_ffn > 0,
            ..blank_card()
        })
    }

    fn config_for_card(&self, card: &ModelCard, dtype: WeightDtype) -> Value {
        let mut v = json!({
            "architectures": [match self.0 {
                Family::Qwen2Moe => "Qwen2MoeForCausalLM",
                Family::Qwen3Moe => "Qwen3MoeForCausalLM",
                _ => "OlmoeForCausalLM",
            }],
            "model_type": self.family().model_type(),
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
        });
        let extra = match self.0 {
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
        if let (Some(obj), Value::Object(extra)) = (v.as_object_mut(), extra) {
            obj.extend(extra);
        }
        v
    }

    fn config_key(&self, field: CardField) -> Option<&'static str> {
        Some(match field {
            CardField::Experts => "num_experts",
            CardField::Ffn if self.0 != Family::Olmoe => "moe_intermediate_size",
            CardField::RouterNormP => "norm_topk_prob",
            CardField::ClipQkv => "clip_qkv",
            CardField::SharedFfn => "shared_expert_intermediate_size",
            CardField::QkvBias => "qkv_bias",
            other => llama::flat_key(other),
        })
    }

    fn segment_tensor(&self, _a: &ArchSpec, layer: usize, kind: SegmentKind) -> SegmentTensor {
        SegmentTensor::Whole(llama::segment_name(&llama::MLP, self.0, layer, kind))
    }

    fn gguf(&self) -> &'static GgufFamily {
        match self.0 {
            Family::Qwen2Moe => &GGUF[0],
            Family::Qwen3Moe => &GGUF[1],
            _ => &GGUF[2],
        }
    }

    fn config_from_gguf(&self, m: &Meta<'_>) -> Result<Value, GgufError> {
        let (file, family) = (m.file, self.0);
        let (model_type, hf_arch) = match family {
            Family::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
            Family::Qwen2Moe => ("qwen2_moe", "Qwen2MoeForCausalLM"),
            _ => ("olmoe", "OlmoeForCausalLM"),
        };
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
}
