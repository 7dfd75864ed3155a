//! OpenAI's gpt-oss: flat fields, YaRN in `rope_scaling` (Hub) or `rope_parameters`
//! (transformers 5), alternating `layer_types`, clamped SwiGLU parameters, MXFP4 routed
//! experts (kept MXFP4 at load, stored out-in); 3-D `mlp.experts.gate_up_proj` / `down_proj`
//! with biases, a router bias and attention sinks.

use super::fields::{torch_dtype, ConfigError, Fields};
use super::hub::{blank_card, CardField, FamilySpec};
use super::hub::{SegmentTensor, Source};
use super::llama;
use crate::model::arch::ArchSpec;
use crate::model::card::{ClampedSwiglu, ModelCard, QkNorm, Yarn};
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;
use crate::quant::storage::WeightDtype;
use crate::weights::gguf::families::{GgufFamily, Meta, TEXT};
use crate::weights::gguf::GgufError;
use serde_json::{json, Value};

/// The gpt-oss family.
pub(super) struct GptOss;

/// llama.cpp's `gpt-oss`: the fused `gate_up_proj` split into gate and up rows, every
/// expert matrix out-in, sinks and the post-attention norm under their own names.
const GGUF: GgufFamily = GgufFamily {
    family: Family::GptOss,
    arch: "gpt-oss",
    gpt_oss_experts: true,
    ..TEXT
};

impl FamilySpec for GptOss {
    fn family(&self) -> Family {
        Family::GptOss
    }

    fn card_from_config(&self, f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
        let hidden = f.uint("hidden_size")?;
        let heads = f.positive_uint("num_attention_heads")?;
        let layers = f.uint("num_hidden_layers")?;
        if !f.flag("attention_bias", true)? {
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
            ("rope_parameters", f.rope_theta()?)
        };
        let yarn = match f.str(&format!("{scaling}.rope_type")) {
            Some("yarn") => Some(yarn(f, scaling)?),
            _ => None,
        };
        let sliding_window = f.opt_uint("sliding_window")?;
        Ok(ModelCard {
            name: name.to_string(),
            family: Family::GptOss,
            description: if f.get("quantization_config").is_some() {
                // Only MXFP4 experts get here (the shared refusals ran first).
                format!(
                    "gpt-oss checkpoint `{name}` (from config.json; {})",
                    crate::model::family::facts::MXFP4_NOTE
                )
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
            tokenizer: self.family().facts().tokenizer.into(),
            bos_token_id: None,
            eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(200002),
            sliding_window,
            router_norm_p: None,
            qk_norm: QkNorm::None,
            qkv_bias: true,
            o_bias: true,
            sinks: true,
            alternate_sliding: sliding_window.is_some(),
            router_bias_topk_softmax: true,
            clamped_swiglu: Some(ClampedSwiglu {
                alpha: f.opt_float("swiglu_alpha")?.unwrap_or(1.702),
                limit: f.opt_float("swiglu_limit")?.unwrap_or(7.0),
                experts_out_in: false,
            }),
            yarn,
            ..blank_card()
        })
    }

    fn config_for_card(&self, card: &ModelCard, dtype: WeightDtype) -> Value {
        json!({
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
        })
    }

    fn config_key(&self, field: CardField) -> Option<&'static str> {
        Some(match field {
            CardField::Experts => "num_local_experts",
            CardField::Yarn => "rope_scaling",
            CardField::ClampedSwiglu => "swiglu_alpha / swiglu_limit",
            other => llama::flat_key(other),
        })
    }

    fn segment_tensor(&self, a: &ArchSpec, layer: usize, kind: SegmentKind) -> SegmentTensor {
        let p = format!("model.layers.{layer}");
        let (d, f, e_n) = (a.hidden, a.ffn, a.experts);
        // Expert tensors are 3-D `[experts, in, out]` / 2-D `[experts, n]`; a segment is
        // expert e's block of rows of the tensor seen as `[leading dims, last dim]`.
        let fused = |name: &str, shape: Vec<usize>, e: usize, rows: usize| {
            SegmentTensor::Rows(Source {
                name: format!("{p}.mlp.experts.{name}"),
                shape,
                rows: e * rows..(e + 1) * rows,
            })
        };
        // Stored out-in (`ArchSpec::experts_out_in`, MXFP4 block rows): `[experts, out, in]`,
        // the Hub's `_blocks` order, so expert e's block is its `out` rows.
        let (gate_up, down) = if a.experts_out_in {
            ((vec![e_n, 2 * f, d], 2 * f), (vec![e_n, d, f], d))
        } else {
            ((vec![e_n, d, 2 * f], d), (vec![e_n, f, d], f))
        };
        match kind {
            SegmentKind::ExpertGateUp(e) => fused("gate_up_proj", gate_up.0, e, gate_up.1),
            SegmentKind::ExpertGateUpBias(e) => fused("gate_up_proj_bias", vec![e_n, 2 * f], e, 1),
            SegmentKind::ExpertDown(e) => fused("down_proj", down.0, e, down.1),
            SegmentKind::ExpertDownBias(e) => fused("down_proj_bias", vec![e_n, d], e, 1),
            other => SegmentTensor::Whole(match other {
                SegmentKind::AttnNorm => format!("{p}.input_layernorm.weight"),
                SegmentKind::QProj => format!("{p}.self_attn.q_proj.weight"),
                SegmentKind::KProj => format!("{p}.self_attn.k_proj.weight"),
                SegmentKind::VProj => format!("{p}.self_attn.v_proj.weight"),
                SegmentKind::QBias => format!("{p}.self_attn.q_proj.bias"),
                SegmentKind::KBias => format!("{p}.self_attn.k_proj.bias"),
                SegmentKind::VBias => format!("{p}.self_attn.v_proj.bias"),
                SegmentKind::Sinks => format!("{p}.self_attn.sinks"),
                SegmentKind::OProj => format!("{p}.self_attn.o_proj.weight"),
                SegmentKind::OBias => format!("{p}.self_attn.o_proj.bias"),
                SegmentKind::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
                SegmentKind::Router => format!("{p}.mlp.router.weight"),
                SegmentKind::RouterBias => format!("{p}.mlp.router.bias"),
                // Kinds gpt-oss's layout never lists (names for completeness).
                _ => format!("{p}.(no {kind:?} in gpt-oss)"),
            }),
        }
    }

    fn gguf(&self) -> &'static GgufFamily {
        &GGUF
    }

    /// gpt-oss as llama.cpp's `gpt-oss` architecture runs it (`llm_build_openai_moe_iswa`):
    /// sliding-window attention on even layers (`set_swa_pattern(2)`), sinks, biases, the
    /// router's top-k logits softmaxed, and `swiglu_oai` with alpha 1.702 and limit 7 (fixed
    /// in llama.cpp, not in the metadata). Its YaRN always truncates the correction range to
    /// whole dimensions (`ggml_rope_yarn_corr_dims`), which transformers' gpt-oss does only
    /// with `truncate: true` (the Hub's gpt-oss configs say `false`).
    fn config_from_gguf(&self, m: &Meta<'_>) -> Result<Value, GgufError> {
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
}

/// YaRN as gpt-oss configs write it, under `scaling` (`rope_scaling` or
/// `rope_parameters`): the default attention factor only.
fn yarn(f: &Fields<'_>, scaling: &str) -> Result<Yarn, ConfigError> {
    for unsupported in ["attention_factor", "mscale", "mscale_all_dim"] {
        if f.get(&format!("{scaling}.{unsupported}")).is_some() {
            return Err(f.invalid(
                &format!("{scaling}.{unsupported}"),
                "is not supported (YaRN with its default attention factor only)",
            ));
        }
    }
    Ok(Yarn {
        factor: f
            .opt_float(&format!("{scaling}.factor"))?
            .ok_or_else(|| f.missing(&format!("{scaling}.factor")))?,
        beta_fast: f
            .opt_float(&format!("{scaling}.beta_fast"))?
            .unwrap_or(32.0),
        beta_slow: f.opt_float(&format!("{scaling}.beta_slow"))?.unwrap_or(1.0),
        original_max_positions: f.uint(&format!("{scaling}.original_max_position_embeddings"))?,
        truncate: f.flag(&format!("{scaling}.truncate"), true)?,
        mscale: None,
    })
}
