//! What each family is, as data: one const row per family of the facts its math and its
//! checkpoints' shape follow, after llama.cpp's `llama-arch.cpp` (architectures and their
//! properties as tables rather than code spread over the tree).
//!
//! Takes a [`Family`]; gives its [`FamilyFacts`] row. The architecture (`ArchSpec`), the
//! layer layout, the weight views, the config reader and the tokenizer fallback read these
//! instead of matching on the family. What needs code per family (reading and writing its
//! Hub `config.json`, its Hub and GGUF tensor names, its GGUF row) is its `FamilySpec` in
//! the family's module on the weights floor (`weights::family::spec`); its own card rules
//! are `model::family::checks`. This file imports only the vocabulary types, so everything
//! else in `model` may read it.

use crate::model::vocab::{NormKind, Orientation};
use serde::{Deserialize, Serialize};

/// Which reference implementation a card follows (names of tensors, norms, router rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Family {
    /// Mistral's Mixtral: RMSNorm, separate q/k/v/o, per-expert w1/w2/w3.
    Mixtral,
    /// Databricks' DBRX: LayerNorm without bias, fused Wqkv with `clip_qkv`, fused experts.
    Dbrx,
    /// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): RMSNorm, q/k/v biases, per-expert
    /// `gate_proj/up_proj/down_proj`, a shared expert scaled by `sigmoid(shared_expert_gate)`.
    Qwen2Moe,
    /// Qwen3-MoE (30B-A3B, 235B-A22B): RMSNorm, per-head RMSNorm of q and k before rotary,
    /// many small experts with top-8 routing.
    Qwen3Moe,
    /// AllenAI's OLMoE: RMSNorm, RMSNorm over the whole q and k projections, 64 experts top-8.
    Olmoe,
    /// OpenAI's gpt-oss: attention sinks, sliding window on every other layer, biases on
    /// q/k/v/o, router and experts, top-k-then-softmax routing, a clamped SwiGLU over fused
    /// interleaved gate/up experts, YaRN rotary scaling.
    GptOss,
    /// DeepSeek-V2 (V2-Lite, V2): multi-head latent attention ([`Mla`]), softmax routing
    /// (greedy or group-limited greedy) scaled by `routed_scaling_factor`, shared experts.
    DeepseekV2,
    /// DeepSeek-V3: V2's attention, sigmoid routing with a selection-only correction bias
    /// and group top-2 sums (`noaux_tc`), optional renormalisation.
    DeepseekV3,
}

/// How a family renormalises the chosen experts' routing weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterNorm {
    /// Always divide by their sum (p = 1), whatever the card says (Mixtral's router).
    Sum,
    /// As the card's `router_norm_p` says (`None`: keep the softmax probabilities).
    FromCard,
}

/// The facts of one family that the shared code reads as data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FamilyFacts {
    /// The family this row describes.
    pub family: Family,
    /// The `model_type` of the family's Hub `config.json`.
    pub model_type: &'static str,
    /// Whether the family's configs may ask for YaRN rotary scaling (every other rope type
    /// but the default is refused).
    pub allows_yarn: bool,
    /// The modules an MXFP4 checkpoint of the family must keep unquantised, as
    /// `quantization_config.modules_to_not_convert` spells them; `None` where the family's
    /// checkpoints may not be MXFP4 at all.
    pub mxfp4_unconverted: Option<&'static [&'static str]>,
    /// Whether the family's checkpoints store q, k and v as one projection
    /// (`SegmentKind::QkvProj`) rather than three.
    pub fused_qkv: bool,
    /// How routed experts' down projections are stored: `OutIn` is transformers'
    /// `nn.Linear` (`[hidden, ffn]`), `InOut` a fused `[ffn, hidden]` block per expert.
    pub expert_down: Orientation,
    /// The norm of every layer.
    pub norm: NormKind,
    /// The shipped tokenizer a card read from config.json names, and the embedded one a card
    /// falls back to when its own path names none that is shipped.
    pub tokenizer: &'static str,
    /// How the chosen experts' weights are renormalised.
    pub router_norm: RouterNorm,
    /// Whether the Hub checkpoints use the Llama-style names
    /// (`model.layers.{i}.self_attn.q_proj`, ...).
    pub llama_names: bool,
}

/// The modules gpt-oss's MXFP4 checkpoints keep in bf16 (`modules_to_not_convert`).
pub const MXFP4_UNCONVERTED: [&str; 4] = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
];

/// The sentence that says where MXFP4 experts went, for card descriptions and load lines.
pub const MXFP4_NOTE: &str = "experts stored as MXFP4 (4.25 bits/weight) and kept MXFP4 \
     (repacked into ggml block rows at load); memory and the cost model count MXFP4";

/// The row most families start from: Llama-style names, RMSNorm, separate q/k/v, experts'
/// down projections out-in, the card's router renormalisation, cl100k as the stand-in
/// tokenizer.
const LLAMA_LIKE: FamilyFacts = FamilyFacts {
    family: Family::Mixtral,
    model_type: "",
    allows_yarn: false,
    mxfp4_unconverted: None,
    fused_qkv: false,
    expert_down: Orientation::OutIn,
    norm: NormKind::Rms,
    tokenizer: CL100K,
    router_norm: RouterNorm::FromCard,
    llama_names: true,
};

/// cl100k (DBRX's byte-level BPE), the stand-in for families whose own tokenizer is not
/// shipped: its ids fit Qwen's 151936, DeepSeek's 102400 / 129280 and gpt-oss's rows.
const CL100K: &str = "tokenizers/dbrx/tokenizer.json";

/// Mixtral's SentencePiece vocabulary (32000 ids), also OLMoE's stand-in (50304 rows).
const MIXTRAL_SPM: &str = "tokenizers/mixtral/tokenizer.json";

/// One row per family, in the order `ConfigError::ModelType` lists their `model_type`s.
pub const FACTS: [FamilyFacts; 8] = [
    FamilyFacts {
        family: Family::Mixtral,
        model_type: "mixtral",
        tokenizer: MIXTRAL_SPM,
        router_norm: RouterNorm::Sum,
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::Dbrx,
        model_type: "dbrx",
        fused_qkv: true,
        expert_down: Orientation::InOut,
        norm: NormKind::LayerNoBias,
        llama_names: false,
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::Qwen2Moe,
        model_type: "qwen2_moe",
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::Qwen3Moe,
        model_type: "qwen3_moe",
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::Olmoe,
        model_type: "olmoe",
        tokenizer: MIXTRAL_SPM,
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::GptOss,
        model_type: "gpt_oss",
        allows_yarn: true,
        mxfp4_unconverted: Some(&MXFP4_UNCONVERTED),
        expert_down: Orientation::InOut,
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::DeepseekV2,
        model_type: "deepseek_v2",
        allows_yarn: true,
        ..LLAMA_LIKE
    },
    FamilyFacts {
        family: Family::DeepseekV3,
        model_type: "deepseek_v3",
        allows_yarn: true,
        ..LLAMA_LIKE
    },
];

/// Every family, in the order of [`FACTS`].
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

impl Family {
    /// The family's row of [`FACTS`].
    pub fn facts(self) -> &'static FamilyFacts {
        // `FAMILIES` and `FACTS` list the families in this order (a unit test holds it).
        &FACTS[match self {
            Family::Mixtral => 0,
            Family::Dbrx => 1,
            Family::Qwen2Moe => 2,
            Family::Qwen3Moe => 3,
            Family::Olmoe => 4,
            Family::GptOss => 5,
            Family::DeepseekV2 => 6,
            Family::DeepseekV3 => 7,
        }]
    }

    /// The `model_type` of the family's Hub `config.json`.
    pub fn model_type(self) -> &'static str {
        self.facts().model_type
    }

    /// True for the families whose Hub checkpoints use the Llama-style names
    /// (`model.layers.{i}.self_attn.q_proj`, ...), i.e. every family but DBRX.
    pub fn llama_names(self) -> bool {
        self.facts().llama_names
    }

    /// The family whose Hub configs carry this `model_type`.
    pub fn by_model_type(model_type: &str) -> Option<Family> {
        FACTS
            .iter()
            .find(|f| f.model_type == model_type)
            .map(|f| f.family)
    }
}

impl FamilyFacts {
    /// Router renormalisation as the forward pass applies it, given the card's.
    pub fn router_norm_p(&self, card: Option<f64>) -> Option<f64> {
        match self.router_norm {
            RouterNorm::Sum => Some(1.0),
            RouterNorm::FromCard => card,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each row sits at its family's place, so `Family::facts` finds its own row.
    #[test]
    fn every_family_has_its_own_row() {
        for (i, family) in FAMILIES.iter().enumerate() {
            assert_eq!(FACTS[i].family, *family);
            assert_eq!(family.facts().family, *family);
            assert_eq!(Family::by_model_type(family.model_type()), Some(*family));
        }
    }
}
