//! The numbers the kernels need from a card, in the types they use.
//!
//! Takes a [`ModelCard`]; gives an [`ArchSpec`] (norm kind, eps, head geometry, clip,
//! q/k norms and biases, router renormalisation, shared expert) so kernels never interpret
//! family names themselves.

use crate::model::card::{DeepseekRouter, Mla, ModelCard, QkNorm, Yarn};
use crate::model::family::facts::Family;
use crate::model::formats::WeightTensor;
use crate::model::segment::SegmentKind;
use crate::model::vocab::AttnShape;
use crate::model::vocab::NormKind;

/// Kernel-facing description of one architecture.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchSpec {
    /// Family (tensor names, router details).
    pub family: Family,
    /// RMSNorm or LayerNorm without bias.
    pub norm: NormKind,
    /// Norm epsilon.
    pub norm_eps: f32,
    /// Residual width.
    pub hidden: usize,
    /// Expert feed-forward width.
    pub ffn: usize,
    /// Attention geometry.
    pub attn: AttnShape,
    /// Experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Embedding / lm_head rows.
    pub vocab: usize,
    /// Decoder layers.
    pub layers: usize,
    /// DBRX clamps the fused QKV output to `[-c, c]`.
    pub clip_qkv: Option<f32>,
    /// Top-k routing weights are divided by their p-norm with this p (Mixtral: sum, i.e.
    /// p = 1); `None` keeps the softmax probabilities as they are.
    pub router_norm_p: Option<f64>,
    /// Positions the rotary tables cover.
    pub max_positions: usize,
    /// Rotary base.
    pub rope_theta: f64,
    /// RMSNorm of q and k after the projections (and biases), before clip and rotary.
    pub qk_norm: QkNorm,
    /// q, k and v projections carry biases.
    pub qkv_bias: bool,
    /// Shared expert width (0: none).
    pub shared_ffn: usize,
    /// The shared expert's output is scaled by `sigmoid(x · shared_expert_gate)`.
    pub shared_gate: bool,
    /// The output projection carries a bias.
    pub o_bias: bool,
    /// `attn.sliding_window` applies to even layers only (gpt-oss).
    pub alternate_sliding: bool,
    /// Router bias, top-k over logits, softmax over the k chosen (gpt-oss).
    pub router_bias_topk_softmax: bool,
    /// gpt-oss experts: `(alpha, limit)` of the clamped SwiGLU over fused interleaved
    /// gate/up with biases.
    pub clamped_swiglu: Option<(f32, f32)>,
    /// gpt-oss experts stored `[out, in]` (`ClampedSwiglu::experts_out_in`: MXFP4 block
    /// rows, GGUF; or a card whose formats quantise them, `--weight-format experts=mxfp4`),
    /// or DBRX's expert down stored `[out, in]` (`ModelCard::expert_down_out_in`, GGUF);
    /// otherwise the Hub's bf16 `[in, out]`.
    pub experts_out_in: bool,
    /// YaRN rotary scaling.
    pub yarn: Option<Yarn>,
    /// DeepSeek's latent attention (`attn` is then the latent MQA geometry).
    pub mla: Option<Mla>,
    /// DeepSeek's router.
    pub deepseek_router: Option<DeepseekRouter>,
    /// Leading dense layers (`first_k_dense_replace`): no router, no routed experts.
    pub dense_layers: usize,
    /// Width of the dense layers' SwiGLU (`intermediate_size`).
    pub dense_ffn: usize,
}

impl ArchSpec {
    /// Derives the spec from a (validated) card.
    pub fn from_card(card: &ModelCard) -> Self {
        let family = card.family.facts();
        ArchSpec {
            family: card.family,
            norm: family.norm,
            norm_eps: card.norm_eps as f32,
            hidden: card.hidden as usize,
            ffn: card.ffn as usize,
            attn: AttnShape {
                heads: card.heads as usize,
                kv_heads: card.kv_heads as usize,
                head_dim: card.head_dim as usize,
                sliding_window: card.sliding_window.map(|w| w as usize),
                sinks: card.sinks,
            },
            experts: card.experts as usize,
            top_k: card.top_k as usize,
            vocab: card.vocab as usize,
            layers: card.layers as usize,
            clip_qkv: card.clip_qkv.map(|c| c as f32),
            router_norm_p: family.router_norm_p(card.router_norm_p),
            max_positions: card.max_positions as usize,
            rope_theta: card.rope_theta,
            qk_norm: card.qk_norm,
            qkv_bias: card.qkv_bias,
            shared_ffn: card.shared_ffn as usize,
            shared_gate: card.shared_gate,
            o_bias: card.o_bias,
            alternate_sliding: card.alternate_sliding,
            router_bias_topk_softmax: card.router_bias_topk_softmax,
            clamped_swiglu: card
                .clamped_swiglu
                .map(|c| (c.alpha as f32, c.limit as f32)),
            // Quantised experts are out-in by construction (moec multiplies blocks only
            // along stored rows), so a card that plans them quantised stores them so.
            experts_out_in: card.expert_down_out_in
                || card.clamped_swiglu.is_some_and(|c| {
                    c.experts_out_in
                        || card
                            .storage(WeightTensor::layer(SegmentKind::ExpertGateUp(0)))
                            .quant()
                            .is_some()
                }),
            yarn: card.yarn,
            mla: card.mla,
            deepseek_router: card.deepseek_router,
            dense_layers: card.dense_layers as usize,
            dense_ffn: card.dense_ffn as usize,
        }
    }

    /// True for a leading dense layer: its FFN is one SwiGLU of `dense_ffn`, no router.
    pub fn is_dense(&self, layer: usize) -> bool {
        layer < self.dense_layers
    }

    /// Width the rotary tables rotate: the whole head, or MLA's rotary part.
    pub fn rope_dim(&self) -> usize {
        match &self.mla {
            Some(m) => m.qk_rope_head_dim as usize,
            None => self.attn.head_dim,
        }
    }

    /// The router carries a per-expert vector (gpt-oss's bias, DeepSeek-V3's correction).
    pub fn has_router_bias(&self) -> bool {
        self.router_bias_topk_softmax
            || self
                .deepseek_router
                .is_some_and(|r| r.topk == crate::model::card::DeepseekTopk::NoauxTc)
    }

    /// The attention geometry of layer `layer`: the sliding window only on even layers
    /// when the family alternates (gpt-oss), else on every layer.
    pub fn attn_of(&self, layer: usize) -> AttnShape {
        let mut shape = self.attn;
        if self.alternate_sliding && layer % 2 == 1 {
            shape.sliding_window = None;
        }
        shape
    }

    /// Query width `heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.attn.heads * self.attn.head_dim
    }

    /// Rows per token of an expert accumulator: normalised row, `top_k` routed outputs and,
    /// with a shared expert (or dense layers' SwiGLU), its output row last (see `ModelCard::acc_rows_per_token`).
    pub fn acc_rows(&self) -> usize {
        1 + self.top_k + usize::from(self.shared_ffn > 0 || self.dense_layers > 0)
    }

    /// K (or V) width `kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.attn.kv_heads * self.attn.head_dim
    }

    /// The KV layout's [`crate::model::vocab::KvLayout::values_in_keys`]: MLA's latent
    /// width when the card caches it once, else `None`.
    pub fn values_in_keys(&self) -> Option<usize> {
        self.mla.and_then(|m| m.values_in_keys())
    }
}
