//! Mistral's Mixtral: flat config.json fields with `rope_theta` at top level or under
//! `rope_parameters`, `sliding_window` null or an integer; per-expert `w1/w3/w2` under
//! `block_sparse_moe`.

use super::fields::{torch_dtype, ConfigError, Fields};
use super::hub::SegmentTensor;
use super::hub::{blank_card, CardField, FamilySpec};
use super::llama::{self, MoeNames};
use crate::model::arch::ArchSpec;
use crate::model::card::{ModelCard, QkNorm};
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;
use crate::quant::storage::WeightDtype;
use crate::weights::gguf::families::GgufKeys;
use crate::weights::gguf::families::{GgufFamily, Meta, TEXT};
use crate::weights::gguf::GgufError;
use serde_json::{json, Value};

/// The Mixtral family.
pub(super) struct Mixtral;

/// `block_sparse_moe.experts.{e}.w1/w3/w2`.
const NAMES: MoeNames = MoeNames {
    block: "block_sparse_moe",
    gate: "w1",
    up: "w3",
    down: "w2",
};

/// llama.cpp's `llama` architecture with experts: its own keys and the SentencePiece
/// vocabulary, `q_proj`/`k_proj` rows permuted for its paired rotation.
const GGUF: GgufFamily = GgufFamily {
    family: Family::Mixtral,
    arch: "llama",
    keys: GgufKeys::Llama,
    permuted_qk: true,
    ..TEXT
};

impl FamilySpec for Mixtral {
    fn family(&self) -> Family {
        Family::Mixtral
    }

    fn card_from_config(&self, f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError> {
        let hidden = f.uint("hidden_size")?;
        let heads = f.positive_uint("num_attention_heads")?;
        let rope_theta = f.rope_theta()?.unwrap_or(1e6);
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
            dtype: WeightDtype::Bf16,
            tokenizer: self.family().facts().tokenizer.into(),
            bos_token_id: f.opt_token("bos_token_id")?.or(Some(1)),
            eos_token_id: f.opt_token("eos_token_id")?.unwrap_or(2),
            sliding_window: f.opt_uint("sliding_window")?,
            router_norm_p: Some(1.0),
            qk_norm: QkNorm::None,
            ..blank_card()
        })
    }

    fn config_for_card(&self, card: &ModelCard, dtype: WeightDtype) -> Value {
        json!({
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
        })
    }

    fn config_key(&self, field: CardField) -> Option<&'static str> {
        match field {
            // Mixtral always renormalises the chosen experts' weights (p = 1); its config
            // has no field to disagree on.
            CardField::RouterNormP => None,
            other => Some(llama::flat_key(other)),
        }
    }

    fn segment_tensor(&self, _a: &ArchSpec, layer: usize, kind: SegmentKind) -> SegmentTensor {
        SegmentTensor::Whole(llama::segment_name(&NAMES, Family::Mixtral, layer, kind))
    }

    fn gguf(&self) -> &'static GgufFamily {
        &GGUF
    }

    fn config_from_gguf(&self, m: &Meta<'_>) -> Result<Value, GgufError> {
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
}
