//! One module per model family: how its Hub `config.json` spells a card (read and
//! written), how its checkpoints name their tensors, which config keys a chosen card is
//! checked against, and what its cards must satisfy beyond the shared rules.
//!
//! A family is one [`FamilySpec`] implementation; [`spec`] is the one place a [`Family`]
//! is mapped to it. The shared code (`model::config`, `model::names`, `ModelCard::
//! validate`, `ArchSpec::from_card`, the embedded tokenizer) dispatches through it, so a
//! new family is its module, its `Family` variant, one arm in [`spec`] and one entry in
//! [`FAMILIES`]. Families whose Hub configs share one shape share a module (`qwen_olmoe`:
//! Qwen2-MoE, Qwen3-MoE and OLMoE; `deepseek`: V2 and V3); `llama` holds the Llama-style
//! keys and tensor names most of them start from, `fields` the config reader and errors.

mod dbrx;
mod deepseek;
pub mod fields;
mod gpt_oss;
mod llama;
mod mixtral;
mod qwen_olmoe;

pub use fields::{ConfigError, Fields};
pub use gpt_oss::MXFP4_UNCONVERTED;

use crate::model::arch::ArchSpec;
use crate::model::card::{Family, ModelCard, QkNorm};
use crate::model::layout::SegmentKind;
use crate::model::names::SegmentTensor;
use crate::model::vocab::NormKind;
use crate::model::vocab::Orientation;
use crate::quant::storage::WeightDtype;
use serde_json::Value;

/// The card fields a config.json must agree on with a chosen card, in the order
/// `model::config::check_agreement` checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CardField {
    /// The family (config.json's `model_type`).
    Family,
    /// Decoder layers.
    Layers,
    /// Model width.
    Hidden,
    /// Routed expert width.
    Ffn,
    /// Query heads.
    Heads,
    /// Key/value heads.
    KvHeads,
    /// Width of one head.
    HeadDim,
    /// Routed experts.
    Experts,
    /// Experts per token.
    TopK,
    /// Vocabulary rows.
    Vocab,
    /// Leading dense layers (DeepSeek).
    DenseLayers,
    /// Width of the leading dense layers' SwiGLU.
    DenseFfn,
    /// Longest context.
    MaxPositions,
    /// Rotary base.
    RopeTheta,
    /// Norm epsilon.
    NormEps,
    /// q/k/v clamp.
    ClipQkv,
    /// Shared expert width.
    SharedFfn,
    /// q/k/v biases.
    QkvBias,
    /// YaRN rotary scaling.
    Yarn,
    /// Multi-head latent attention.
    Mla,
    /// DeepSeek's router.
    DeepseekRouter,
    /// gpt-oss's clamped SwiGLU.
    ClampedSwiglu,
    /// Renormalisation of the chosen experts' weights.
    RouterNormP,
}

/// Everything moec knows about one family that the shared code does not.
pub trait FamilySpec: Sync {
    /// The family this describes.
    fn family(&self) -> Family;

    /// The `model_type` of the family's Hub `config.json`.
    fn model_type(&self) -> &'static str;

    /// Whether the family's configs may ask for YaRN rotary scaling (every other rope type
    /// but the default is refused).
    fn allows_yarn(&self) -> bool {
        false
    }

    /// The modules an MXFP4 checkpoint of the family must keep unquantised, as
    /// `quantization_config.modules_to_not_convert` spells them; `None` where the family's
    /// checkpoints may not be MXFP4 at all.
    fn mxfp4_unconverted(&self) -> Option<&'static [&'static str]> {
        None
    }

    /// Reads a card from a config.json of this family; `name` becomes its name. What
    /// every family refuses (quantisation, rope scaling, activations) was refused first.
    fn card_from_config(&self, f: &Fields<'_>, name: &str) -> Result<ModelCard, ConfigError>;

    /// A config.json for `card` in the family's Hub spelling (for synthetic checkpoints);
    /// [`FamilySpec::card_from_config`] reads it back as the same card.
    fn config_for_card(&self, card: &ModelCard, dtype: WeightDtype) -> Value;

    /// The config.json spelling of a card field, named when a config and a card disagree
    /// on it; `None` where the family's config does not set the field, which is then not
    /// compared.
    fn config_key(&self, field: CardField) -> Option<&'static str>;

    /// Names of the embedding table and the final norm.
    fn head_names(&self) -> (&'static str, &'static str) {
        ("model.embed_tokens.weight", "model.norm.weight")
    }

    /// The tensor that holds segment `kind` of layer `layer` in the family's checkpoints.
    fn segment_tensor(&self, a: &ArchSpec, layer: usize, kind: SegmentKind) -> SegmentTensor;

    /// Whether the family's checkpoints store q, k and v as one projection
    /// (`SegmentKind::QkvProj`) rather than three.
    fn fused_qkv(&self) -> bool {
        false
    }

    /// How routed experts' down projections are stored: `OutIn` is transformers'
    /// `nn.Linear` (`[hidden, ffn]`), `InOut` a fused `[ffn, hidden]` block per expert.
    fn expert_down(&self) -> Orientation {
        Orientation::OutIn
    }

    /// The norm of every layer.
    fn norm(&self) -> NormKind {
        NormKind::Rms
    }

    /// The tokenizer a card read from config.json names, and the embedded one a card
    /// falls back to when its own path names none that is shipped.
    fn tokenizer(&self) -> &'static str {
        "tokenizers/dbrx/tokenizer.json"
    }

    /// Router renormalisation as the forward pass applies it, given the card's.
    fn router_norm_p(&self, card: Option<f64>) -> Option<f64> {
        card
    }

    /// What the family's cards must satisfy beyond `ModelCard::validate`'s shared rules.
    fn check_card(&self, _card: &ModelCard) -> Result<(), String> {
        Ok(())
    }
}

/// Every family, in the order `ConfigError::ModelType` lists their `model_type`s.
pub const FAMILIES: [Family; 8] = [
    Family::Mixtral,
    Family::Dbrx,
    Family::Qwen2Moe,
    Family::Qwen3Moe,
    Family::Olmoe,
    Family::GptOss,
    Family::DeepseekV2,
    Family::DeepseekV3,
];

/// The family's description.
pub fn spec(family: Family) -> &'static dyn FamilySpec {
    match family {
        Family::Mixtral => &mixtral::Mixtral,
        Family::Dbrx => &dbrx::Dbrx,
        Family::Qwen2Moe => &qwen_olmoe::QWEN2_MOE,
        Family::Qwen3Moe => &qwen_olmoe::QWEN3_MOE,
        Family::Olmoe => &qwen_olmoe::OLMOE,
        Family::GptOss => &gpt_oss::GptOss,
        Family::DeepseekV2 => &deepseek::DEEPSEEK_V2,
        Family::DeepseekV3 => &deepseek::DEEPSEEK_V3,
    }
}

/// The family whose Hub configs carry this `model_type`.
pub fn by_model_type(model_type: &str) -> Option<&'static dyn FamilySpec> {
    FAMILIES
        .iter()
        .map(|&family| spec(family))
        .find(|s| s.model_type() == model_type)
}

/// A card with every dimension zero and every optional feature off; each family's reader
/// spreads it under the fields that family sets.
fn blank_card() -> ModelCard {
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
        expert_down_out_in: false,
        yarn: None,
        mla: None,
        deepseek_router: None,
        dense_layers: 0,
        dense_ffn: 0,
        formats: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `spec` and `FAMILIES` agree, every built-in card's family is listed, and the
    /// unsupported-`model_type` error lists exactly the families' `model_type`s in order.
    #[test]
    fn every_family_is_listed_once_and_named_in_the_model_type_error() {
        for family in FAMILIES {
            assert_eq!(spec(family).family(), family);
            assert_eq!(family.model_type(), spec(family).model_type());
            let found = by_model_type(family.model_type()).map(|s| s.family());
            assert_eq!(found, Some(family));
        }
        for card in ModelCard::builtins() {
            assert!(FAMILIES.contains(&card.family), "{}", card.name);
        }
        let err = ConfigError::ModelType {
            path: "c.json".into(),
            model_type: "x".into(),
        }
        .to_string();
        let listed = FAMILIES.map(|f| f.model_type()).join(", ");
        assert!(
            err.ends_with(&format!("(expected one of {listed})")),
            "{err}"
        );
    }
}
