//! One module per model family on the weights floor: how its Hub `config.json` spells a
//! card (read and written), how its checkpoints name their tensors, and which config keys
//! a chosen card is checked against.
//!
//! A family is one row of `model::family::facts::FACTS` (what its math and its
//! checkpoints' shape follow, as data, with its card rules in `model::family::checks`) and
//! one [`FamilySpec`] implementation here (what needs code); [`spec`] is the one place a
//! [`Family`] is mapped to the latter. The shared code (`weights::config`,
//! `weights::names`) dispatches through it, so a new family is its module, its `Family`
//! variant and facts row, and one arm in [`spec`]. Families whose Hub configs share one
//! shape share a module (`qwen_olmoe`: Qwen2-MoE, Qwen3-MoE and OLMoE; `deepseek`: V2 and
//! V3); `llama` holds the Llama-style keys and tensor names most of them start from,
//! `fields` the config reader and errors.

mod dbrx;
mod deepseek;
pub mod fields;
mod gpt_oss;
pub mod hub;
mod llama;
mod mixtral;
mod qwen_olmoe;

use crate::model::family::facts::Family;
pub use fields::{ConfigError, Fields};
pub use hub::{CardField, FamilySpec, SegmentTensor, Source};

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
    Family::by_model_type(model_type).map(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::card::ModelCard;
    use crate::model::family::FAMILIES;

    /// `spec` and `FAMILIES` agree, every built-in card's family is listed, and the
    /// unsupported-`model_type` error lists exactly the families' `model_type`s in order.
    #[test]
    fn every_family_is_listed_once_and_named_in_the_model_type_error() {
        for family in FAMILIES {
            assert_eq!(spec(family).family(), family);
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
