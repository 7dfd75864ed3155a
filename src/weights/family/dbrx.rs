//! Databricks' DBRX: nested `attn_config` / `ffn_config` (whose serialized junk fields are
//! ignored), LayerNorm without bias, a fused `Wqkv`, and fused `[experts * ffn, hidden]`
//! expert tensors without a `.weight` suffix under `transformer.blocks.{i}`.

use super::fields::{torch_dtype, ConfigError, Fields};
use super::hub::{blank_card, CardField, FamilySpec};
use super::hub::{SegmentTensor, Source};
use crate::model::arch::ArchSpec;
use crate::model::card::{ModelCard, QkNorm};
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;
use crate::quant::storage::WeightDtype;
use crate::weights::gguf::families::GgufKeys;
use crate::weights::gguf::families::{GgufFamily, Meta, TEXT};
use crate::weights::gguf::GgufError;
use serde_json::{json, Value};

/// The DBRX family.
pub(super) struct Dbrx;

/// llama.cpp's `dbrx`: its own keys and a GPT-2 vocabulary, each expert's `w2` transposed
/// to out-in and the post-attention norm named `attn_output_norm`.
const GGUF: GgufFamily = GgufFamily {
    family: Family::Dbrx,
    arch: "dbrx",
    keys: GgufKeys::Dbrx,
    dbrx_layout: true,
    ..TEXT
};

impl FamilySpec for Dbrx {
    fn family(&self) -> Family {
        Family::Dbrx
    }

    fn card_from_config(&self, f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
        let hidden = f.uint("d_model")?;
        let heads = f.uint("n_heads")?;
        if heads == 0 || hidden % heads != 0 {
            return Err(f.invalid("n_heads", "must be positive and divide d_model"));
        }
        let rope_theta = f.opt_float("attn_config.rope_theta")?.unwrap_or(10000.0);
        // transformers 5.x reads the rotary base from top-level `rope_parameters` and
        // ignores `attn_config.rope_theta`; a checkpoint where they differ computes
        // differently in HF than its Hub config says, so refuse it rather than pick one
        // silently.
        if let Some(other) = f.opt_float("rope_parameters.rope_theta")? {
            if other != rope_theta {
                return Err(f.invalid(
                    "rope_parameters.rope_theta",
                    &format!("({other}) disagrees with attn_config.rope_theta ({rope_theta})"),
                ));
            }
        }
        // An explicit null turns renormalisation off; an absent field keeps DBRX's p = 1.
        let router_norm_p = match f
            .raw("ffn_config")
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
            tokenizer: self.family().facts().tokenizer.into(),
            bos_token_id: None,
            eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(100257),
            router_norm_p,
            qk_norm: QkNorm::None,
            ..blank_card()
        })
    }

    fn config_for_card(&self, card: &ModelCard, dtype: WeightDtype) -> Value {
        json!({
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
        })
    }

    fn config_key(&self, field: CardField) -> Option<&'static str> {
        Some(match field {
            CardField::Layers => "n_layers",
            CardField::Hidden => "d_model",
            CardField::Ffn => "ffn_config.ffn_hidden_size",
            CardField::Heads => "n_heads",
            CardField::KvHeads => "attn_config.kv_n_heads",
            CardField::HeadDim => "d_model / n_heads",
            CardField::Experts => "ffn_config.moe_num_experts",
            CardField::TopK => "ffn_config.moe_top_k",
            CardField::Vocab => "vocab_size",
            CardField::MaxPositions => "max_seq_len",
            CardField::RopeTheta => "attn_config.rope_theta",
            CardField::NormEps => "(LayerNorm eps)",
            CardField::ClipQkv => "attn_config.clip_qkv",
            CardField::RouterNormP => "ffn_config.moe_normalize_expert_weights",
            CardField::Family
            | CardField::DenseLayers
            | CardField::DenseFfn
            | CardField::SharedFfn
            | CardField::QkvBias
            | CardField::Yarn
            | CardField::Mla
            | CardField::DeepseekRouter
            | CardField::ClampedSwiglu => "model_type",
        })
    }

    fn head_names(&self) -> (&'static str, &'static str) {
        ("transformer.wte.weight", "transformer.norm_f.weight")
    }

    fn segment_tensor(&self, a: &ArchSpec, layer: usize, kind: SegmentKind) -> SegmentTensor {
        let p = format!("transformer.blocks.{layer}");
        // Every expert's projection is one block of `rows` rows of a fused tensor.
        let fused = |w: &str, e: usize, rows: usize, cols: usize| {
            SegmentTensor::Rows(Source {
                name: format!("{p}.ffn.experts.mlp.{w}"),
                shape: vec![a.experts * rows, cols],
                rows: e * rows..(e + 1) * rows,
            })
        };
        let (f, d) = (a.ffn, a.hidden);
        match kind {
            SegmentKind::ExpertGate(e) => fused("w1", e, f, d),
            SegmentKind::ExpertUp(e) => fused("v1", e, f, d),
            // Stored out-in (a GGUF's `ffn_down_exps`): `hidden` rows of `ffn` per expert.
            SegmentKind::ExpertDown(e) if a.experts_out_in => fused("w2", e, d, f),
            SegmentKind::ExpertDown(e) => fused("w2", e, f, d),
            other => SegmentTensor::Whole(match other {
                SegmentKind::AttnNorm => format!("{p}.norm_attn_norm.norm_1.weight"),
                SegmentKind::FfnNorm => format!("{p}.norm_attn_norm.norm_2.weight"),
                SegmentKind::OProj => format!("{p}.norm_attn_norm.attn.out_proj.weight"),
                SegmentKind::Router => format!("{p}.ffn.router.layer.weight"),
                _ => format!("{p}.norm_attn_norm.attn.Wqkv.weight"),
            }),
        }
    }

    fn gguf(&self) -> &'static GgufFamily {
        &GGUF
    }

    /// DBRX as llama.cpp's `dbrx` architecture runs it (`llm_build_dbrx`): LayerNorm without
    /// bias at `attention.layer_norm_epsilon` (the reader sets the card's epsilon from it, as
    /// the Hub config has no key for it), the fused QKV clamped to `attention.clamp_kqv` when
    /// that is positive, NeoX rotary over whole heads, and the top-k weights of the softmax
    /// router divided by their sum (`build_moe_ffn` with `norm_w`, DBRX's p = 1).
    fn config_from_gguf(&self, m: &Meta<'_>) -> Result<Value, GgufError> {
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
}
