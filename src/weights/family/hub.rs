//! The contract each family's module fulfils: how its Hub `config.json` spells a card
//! (read and written), which config keys a chosen card is checked against, how its
//! checkpoints name each segment's tensor, and how llama.cpp stores it (its GGUF row and
//! its config from GGUF keys). What is plain data about a family is its row in
//! `model::family::facts`; what its cards must satisfy, `model::family::checks`.

use crate::model::arch::ArchSpec;
use crate::model::card::{ModelCard, QkNorm};
use crate::model::family::facts::Family;
use crate::model::segment::SegmentKind;
use crate::quant::storage::WeightDtype;
use crate::weights::family::fields::{ConfigError, Fields};
use crate::weights::gguf::families::{GgufFamily, Meta};
use crate::weights::gguf::GgufError;
use serde_json::Value;
use std::ops::Range;

/// A segment's origin in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Tensor name.
    pub name: String,
    /// The tensor's full shape.
    pub shape: Vec<usize>,
    /// Rows of the tensor the segment takes.
    pub rows: Range<usize>,
}

/// Where a family keeps one segment of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentTensor {
    /// All of a tensor of its own, by name (its shape is the segment's).
    Whole(String),
    /// A block of rows of a larger tensor (DBRX's and gpt-oss's fused experts).
    Rows(Source),
}

/// The card fields a config.json must agree on with a chosen card, in the order
/// `weights::config::check_agreement` checks them.
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

    /// How llama.cpp's converter and loader store the family: its architecture name, keys,
    /// vocabulary and tensor layout (the GGUF reader and `moec quantize` read this row).
    fn gguf(&self) -> &'static GgufFamily;

    /// The family's `config.json`, in the Hub spelling [`FamilySpec::card_from_config`]
    /// reads, from a GGUF file's `{arch}.*` keys (where llama.cpp hard-codes what a Hub
    /// config says, the config says the same).
    fn config_from_gguf(&self, m: &Meta<'_>) -> Result<Value, GgufError>;
}

/// A card with every dimension zero and every optional feature off; each family's reader
/// spreads it under the fields that family sets.
pub(super) fn blank_card() -> ModelCard {
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
        held: Default::default(),
    }
}
