//! What a family's cards must satisfy beyond `ModelCard::validate`'s shared rules: the
//! card's own math (DeepSeek's latent attention and expert groups, OLMoE's q norm).
//!
//! Takes a card; gives the first rule it breaks, in words naming the card field. The card
//! check (`model::cards`) asks here after the shared rules; how a family's checkpoints
//! spell a card is `weights::family`'s.

use crate::model::card::{DeepseekTopk, ModelCard, QkNorm};
use crate::model::family::facts::Family;

/// The family's own rules for `card`.
pub fn check_card(card: &ModelCard) -> Result<(), String> {
    match card.family {
        Family::DeepseekV2 | Family::DeepseekV3 => deepseek(card),
        Family::Olmoe => olmoe(card),
        _ => Ok(()),
    }
}

/// MLA's latent geometry and the router's expert groups (that `mla` and
/// `deepseek_router` are set at all is a shared rule).
fn deepseek(card: &ModelCard) -> Result<(), String> {
    let (Some(m), Some(r)) = (card.mla, card.deepseek_router) else {
        return Ok(());
    };
    let dims = [
        ("mla.kv_lora_rank", m.kv_lora_rank),
        ("mla.qk_nope_head_dim", m.qk_nope_head_dim),
        ("mla.qk_rope_head_dim", m.qk_rope_head_dim),
        ("mla.v_head_dim", m.v_head_dim),
        ("mla.q_lora_rank", m.q_lora_rank.unwrap_or(1)),
        ("deepseek_router.n_group", r.n_group),
        ("deepseek_router.topk_group", r.topk_group),
    ];
    if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
        return Err(format!("`{name}` must be positive"));
    }
    if !m.qk_rope_head_dim.is_multiple_of(2) {
        return Err(format!(
            "mla.qk_rope_head_dim ({}) must be even for rotary embeddings",
            m.qk_rope_head_dim
        ));
    }
    if card.kv_heads != 1 || card.head_dim != m.latent_dim() {
        return Err(format!(
            "an MLA card's attention runs over its latent: kv_heads must be 1 and head_dim \
             kv_lora_rank + qk_rope_head_dim = {} (got {} and {})",
            m.latent_dim(),
            card.kv_heads,
            card.head_dim
        ));
    }
    if !(m.softmax_mscale.is_finite() && m.softmax_mscale > 0.0) {
        return Err(format!(
            "mla.softmax_mscale ({}) must be positive and finite",
            m.softmax_mscale
        ));
    }
    if !card.experts.is_multiple_of(r.n_group) || r.topk_group > r.n_group {
        return Err(format!(
            "deepseek_router: n_group ({}) must divide experts ({}) and topk_group ({}) \
             must not exceed it",
            r.n_group, card.experts, r.topk_group
        ));
    }
    let reachable = r.topk_group * (card.experts / r.n_group);
    let per_group = card.experts / r.n_group;
    if card.top_k > reachable || (r.topk == DeepseekTopk::NoauxTc && per_group < 2) {
        return Err(format!(
            "deepseek_router: top_k ({}) must fit in topk_group x experts per group ({}), \
             and noaux_tc needs 2 experts per group",
            card.top_k, reachable
        ));
    }
    if !(r.routed_scaling_factor.is_finite() && r.routed_scaling_factor > 0.0) {
        return Err(format!(
            "deepseek_router.routed_scaling_factor ({}) must be positive and finite",
            r.routed_scaling_factor
        ));
    }
    if card.dense_layers > card.layers || (card.dense_layers > 0) != (card.dense_ffn > 0) {
        return Err(format!(
            "dense_layers ({}) must not exceed layers ({}) and come with dense_ffn ({})",
            card.dense_layers, card.layers, card.dense_ffn
        ));
    }
    Ok(())
}

/// OLMoE's q norm spans the whole width.
fn olmoe(card: &ModelCard) -> Result<(), String> {
    if card.qk_norm == QkNorm::Full && card.q_dim() != card.hidden {
        return Err(format!(
            "OLMoE's q norm spans hidden ({}) weights, so heads x head_dim ({}) must equal it",
            card.hidden,
            card.q_dim()
        ));
    }
    Ok(())
}
