//! The Llama-style spellings every family but DBRX shares: flat config.json keys
//! (`num_hidden_layers`, `hidden_size`, ...) and `model.layers.{i}.self_attn.q_proj`-style
//! tensor names. Each family module overrides what it spells differently.

use super::hub::CardField;
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;

/// The flat config.json key of a card field (Mixtral's spelling, the base the Llama-style
/// families override). Fields such a config has no key for are named by a description in
/// parentheses, or by `model_type` where only the family decides them.
pub(super) fn flat_key(field: CardField) -> &'static str {
    match field {
        CardField::Layers => "num_hidden_layers",
        CardField::Hidden => "hidden_size",
        CardField::Ffn => "intermediate_size",
        CardField::Heads => "num_attention_heads",
        CardField::KvHeads => "num_key_value_heads",
        CardField::HeadDim => "head_dim",
        CardField::Experts => "num_local_experts",
        CardField::TopK => "num_experts_per_tok",
        CardField::Vocab => "vocab_size",
        CardField::MaxPositions => "max_position_embeddings",
        CardField::RopeTheta => "rope_theta",
        CardField::NormEps => "rms_norm_eps",
        CardField::ClipQkv => "(clip_qkv)",
        CardField::RouterNormP => "(router renormalisation)",
        CardField::Family
        | CardField::DenseLayers
        | CardField::DenseFfn
        | CardField::SharedFfn
        | CardField::QkvBias
        | CardField::Yarn
        | CardField::Mla
        | CardField::DeepseekRouter
        | CardField::ClampedSwiglu => "model_type",
    }
}

/// How a Llama-style family names its MoE block and its per-expert projections.
pub(super) struct MoeNames {
    /// The MoE block under `model.layers.{i}` (`block_sparse_moe` or `mlp`).
    pub block: &'static str,
    /// An expert's gate, up and down projections.
    pub gate: &'static str,
    /// See `gate`.
    pub up: &'static str,
    /// See `gate`.
    pub down: &'static str,
}

/// transformers' `mlp.experts.{e}.gate_proj/up_proj/down_proj` (Qwen, OLMoE, DeepSeek).
pub(super) const MLP: MoeNames = MoeNames {
    block: "mlp",
    gate: "gate_proj",
    up: "up_proj",
    down: "down_proj",
};

/// The tensor holding segment `kind` of layer `layer`, in the Llama-style names; kinds no
/// Llama-style layout lists get a name that says so.
pub(super) fn segment_name(
    moe: &MoeNames,
    family: Family,
    layer: usize,
    kind: SegmentKind,
) -> String {
    let p = format!("model.layers.{layer}");
    let block = moe.block;
    let expert = |e: usize, w: &str| format!("{p}.{block}.experts.{e}.{w}.weight");
    match kind {
        SegmentKind::AttnNorm => format!("{p}.input_layernorm.weight"),
        SegmentKind::QProj => format!("{p}.self_attn.q_proj.weight"),
        SegmentKind::KProj => format!("{p}.self_attn.k_proj.weight"),
        SegmentKind::VProj => format!("{p}.self_attn.v_proj.weight"),
        SegmentKind::QkvProj => format!("{p}.self_attn.qkv_proj.weight"),
        SegmentKind::QBias => format!("{p}.self_attn.q_proj.bias"),
        SegmentKind::KBias => format!("{p}.self_attn.k_proj.bias"),
        SegmentKind::VBias => format!("{p}.self_attn.v_proj.bias"),
        SegmentKind::QNorm => format!("{p}.self_attn.q_norm.weight"),
        SegmentKind::KNorm => format!("{p}.self_attn.k_norm.weight"),
        SegmentKind::OProj => format!("{p}.self_attn.o_proj.weight"),
        SegmentKind::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
        SegmentKind::Router => format!("{p}.{block}.gate.weight"),
        SegmentKind::SharedGate => format!("{p}.{block}.shared_expert.gate_proj.weight"),
        SegmentKind::SharedUp => format!("{p}.{block}.shared_expert.up_proj.weight"),
        SegmentKind::SharedDown => format!("{p}.{block}.shared_expert.down_proj.weight"),
        SegmentKind::SharedExpertGate => format!("{p}.{block}.shared_expert_gate.weight"),
        SegmentKind::ExpertGate(e) => expert(e, moe.gate),
        SegmentKind::ExpertUp(e) => expert(e, moe.up),
        SegmentKind::ExpertDown(e) => expert(e, moe.down),
        // Kinds only other layouts list (names for completeness).
        other => format!("{p}.(no {other:?} in {family:?})"),
    }
}
