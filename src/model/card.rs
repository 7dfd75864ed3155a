//! Model cards: the architecture of one MoE model (Mixtral, DBRX, Qwen2-MoE, Qwen3-MoE,
//! OLMoE, gpt-oss or DeepSeek-V2/V3 family) as plain data.
//!
//! A card is read from RON (`models/*.ron`; the shipped cards are embedded in the binary so
//! `moec` works from any directory) and gives every dimension the compiler, the cost model
//! and the runtime size things by. Byte counts assume the card's weight dtype, except for
//! the tensors its [`ModelCard::formats`] name (block-quantised classes or tensors).

use crate::model::family::facts::Family;
use crate::model::formats::{WeightFormats, WeightTensor};
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use serde::{Deserialize, Serialize};

/// YaRN rotary scaling (`rope_scaling` / `rope_parameters` with `rope_type: "yarn"`), as
/// transformers computes it: interpolated and extrapolated frequencies blended over a
/// linear ramp between the correction dimensions, cos/sin scaled by `0.1 ln(factor) + 1`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    /// Context extension factor.
    pub factor: f64,
    /// Rotations at which extrapolation stops (`beta_fast`).
    pub beta_fast: f64,
    /// Rotations at which interpolation starts (`beta_slow`).
    pub beta_slow: f64,
    /// Context length of pre-training.
    pub original_max_positions: u64,
    /// Round the correction range outwards to whole dimensions.
    pub truncate: bool,
    /// `(mscale, mscale_all_dim)` of DeepSeek's configs: cos/sin are then scaled by
    /// `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` instead of
    /// `get_mscale(factor)` (transformers' `_compute_yarn_parameters`, both non-zero).
    #[serde(default)]
    pub mscale: Option<(f64, f64)>,
}

impl Yarn {
    /// transformers' `get_mscale(scale, mscale) = 0.1 mscale ln(scale) + 1` (1 below scale 1).
    pub fn get_mscale(scale: f64, mscale: f64) -> f64 {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * mscale * scale.ln() + 1.0
        }
    }

    /// The factor cos and sin are multiplied by.
    pub fn attention_factor(&self) -> f64 {
        match self.mscale {
            Some((m, all)) if m != 0.0 && all != 0.0 => {
                Self::get_mscale(self.factor, m) / Self::get_mscale(self.factor, all)
            }
            _ => Self::get_mscale(self.factor, 1.0),
        }
    }
}

/// DeepSeek's multi-head latent attention (MLA), as transformers' `DeepseekV2Attention`
/// computes it, run here in its "absorbed" form so the cache holds the compressed latent.
///
/// Per token: `c = RMSNorm(x W_kv_a[..kv_lora_rank])` and one rotary key `k_pe` shared by
/// all heads; per head `k = [c W_uk_h | k_pe]`, `v = c W_uv_h`, `q = [q_nope | q_pe]`. Since
/// `q_nope · (c W_uk_h) = (q_nope W_uk_hᵀ) · c`, `pre_attn` folds `W_uk` into the query and
/// attention runs as multi-query attention with one kv head of width
/// `kv_lora_rank + qk_rope_head_dim` (the card's `kv_heads = 1`, `head_dim` = that width):
/// K = `[c | k_pe]`, V = `[c | 0]`. `o_proj` applies `W_uv` per head, then `o_proj`.
/// **The KV cache stores per token and layer `kv_lora_rank + qk_rope_head_dim` values**
/// when V is read as a view of K's first `kv_lora_rank` columns ([`Mla::values_in_keys`],
/// the CPU backend's layout, llama.cpp's too): MLA's minimum, `heads * (qk_nope + qk_rope +
/// v_head_dim) / (kv_lora + qk_rope)` times less than the decompressed keys and values
/// (8.9x for DeepSeek-V2-Lite: 5,120 against 576); twice that (the latent again as a V
/// pool) otherwise, the CUDA backend's layout. [`ModelCard::kv_elems_per_token_layer`]
/// counts either.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Mla {
    /// Rank of the query compression (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); `None`
    /// for a plain `q_proj` (V2-Lite).
    pub q_lora_rank: Option<u64>,
    /// Rank of the key/value latent (`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`).
    pub kv_lora_rank: u64,
    /// Per-head query/key width without rotary.
    pub qk_nope_head_dim: u64,
    /// Rotary width (shared key, per-head query part).
    pub qk_rope_head_dim: u64,
    /// Per-head value width.
    pub v_head_dim: u64,
    /// Rotary pairs are adjacent `(x0, x1), (x2, x3), ...` (DeepSeek's layout; V3's
    /// `rope_interleave`); otherwise the NeoX halves.
    pub rope_interleave: bool,
    /// Softmax scale multiplier on top of `(qk_nope + qk_rope)^-1/2`: YaRN's
    /// `(0.1 mscale_all_dim ln(factor) + 1)^2`, 1.0 without it.
    pub softmax_mscale: f64,
    /// The checkpoint stores `kv_b_proj` as llama.cpp's converter writes it, split per head
    /// into `attn_k_b` (`W_uk` transposed: `kv_lora_rank` rows of `qk_nope_head_dim`
    /// weights) and `attn_v_b` (`W_uv`: `v_head_dim` rows of `kv_lora_rank` weights), each
    /// possibly block-quantised. The layer layout then holds them as the `KB` and `VB`
    /// segments, multiplied as stored (as llama.cpp does), instead of `kv_b_proj`. Set by
    /// the GGUF reader; a Hub checkpoint has `kv_b_proj` (false).
    #[serde(default)]
    pub kv_b_split: bool,
    /// The KV cache has no V pool: a slot's value is its key's first `kv_lora_rank`
    /// components (the latent `c`) followed by zeros, read in place. A property of the
    /// backend that runs the card, not of the checkpoint: a checkpoint's card has it false
    /// (a K pool and a V pool, the CUDA backend's layout) and a run sets it for its backend
    /// (`runtime::registry::card_for`), so the plan's `kv_cache` buffers, its copies and
    /// the budget count what that backend's attention stores.
    #[serde(default)]
    pub values_in_keys: bool,
}

impl Mla {
    /// Per-head query/key width `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> u64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Width of the attention kernel's one kv head: `kv_lora_rank + qk_rope_head_dim`.
    pub fn latent_dim(&self) -> u64 {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// The width of the values read from the keys (`kv_lora_rank`) when the cache holds
    /// the latent once ([`Mla::values_in_keys`]), else `None`.
    pub fn values_in_keys(&self) -> Option<usize> {
        self.values_in_keys
            .then(|| usize::try_from(self.kv_lora_rank).unwrap_or(usize::MAX))
    }
}

/// How DeepSeek picks experts (`topk_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeepseekTopk {
    /// Softmax, then the top-k of all experts (`greedy`).
    Greedy,
    /// Softmax; keep the `topk_group` groups with the highest expert score, top-k inside
    /// them (`group_limited_greedy`).
    GroupLimitedGreedy,
    /// Sigmoid scores; choose by score + correction bias, groups ranked by the sum of their
    /// two best biased scores; weights are the unbiased scores (`noaux_tc`, V3).
    NoauxTc,
}

/// DeepSeek's router, as transformers' `DeepseekV2TopkRouter` / `DeepseekV3TopkRouter`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeepseekRouter {
    /// Selection rule.
    pub topk: DeepseekTopk,
    /// Expert groups (`n_group`; 1 = no grouping).
    pub n_group: u64,
    /// Groups kept per token (`topk_group`).
    pub topk_group: u64,
    /// Routed weights are multiplied by this (`routed_scaling_factor`).
    pub routed_scaling_factor: f64,
    /// Chosen weights are divided by their sum (+1e-20) before scaling (V3's
    /// `norm_topk_prob`; transformers' V2 router never renormalises).
    pub norm_topk_prob: bool,
}

/// gpt-oss's clamped SwiGLU: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
/// `g = min(gate, limit)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClampedSwiglu {
    /// Slope inside the sigmoid (`swiglu_alpha`).
    pub alpha: f64,
    /// Clamp bound (`swiglu_limit`).
    pub limit: f64,
    /// The checkpoint stores each expert's projections `[out, in]`: `gate_up` as `2 ffn`
    /// rows of `hidden` (gate and up rows still interleaved) and `down` as `hidden` rows of
    /// `ffn`, as MXFP4 block rows (a Hub checkpoint's `_blocks` / `_scales`, kept packed)
    /// and llama.cpp's GGUF store them. Set by the readers; false for the Hub's bf16
    /// `[in, out]` tensors. A storage fact, not an architecture one: cards that agree on
    /// everything else describe the same model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub experts_out_in: bool,
}

/// Where a family normalises queries and keys after their projections (before rotary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum QkNorm {
    /// No q/k norm (Mixtral, DBRX, Qwen2-MoE).
    #[default]
    None,
    /// RMSNorm of each head (`head_dim` weights), Qwen3.
    PerHead,
    /// RMSNorm of the whole projection (`q_dim` / `kv_dim` weights), OLMoE.
    Full,
}

/// Checkpoint bytes held in anonymous memory rather than mapped from the file: the rows
/// of a llama.cpp GGUF's `q`/`k` projections put back in the Hub's order, tensors a loader
/// builds at open, MXFP4 experts repacked into ggml's blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    /// Of each decoder layer's attention part (its `pre` segment: restored `q`/`k` rows).
    pub attention: u64,
    /// Of each MoE layer's experts (MXFP4 experts repacked).
    pub experts: u64,
    /// Everything else.
    pub other: u64,
}

/// The architecture of one model, as the compiler, cost model and runtime see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// Short name used on the command line (`--model NAME`).
    pub name: String,
    /// Model family: decides tensor names, norm and router details.
    pub family: Family,
    /// One line for `moec models`.
    pub description: String,
    /// Decoder layers.
    pub layers: u64,
    /// Model (residual stream) width.
    pub hidden: u64,
    /// Width of one expert's feed-forward layer.
    pub ffn: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u64,
    /// Width of one attention head.
    pub head_dim: u64,
    /// Experts per MoE layer.
    pub experts: u64,
    /// Experts each token is routed to.
    pub top_k: u64,
    /// Rows of the embedding and lm_head (may exceed the tokenizer's vocabulary: DBRX pads).
    pub vocab: u64,
    /// Longest sequence the rotary tables are built for.
    pub max_positions: u64,
    /// Rotary embedding base.
    pub rope_theta: f64,
    /// Epsilon of the RMSNorm / LayerNorm.
    pub norm_eps: f64,
    /// DBRX clamps the fused QKV output to `[-clip, clip]`; `None` for Mixtral.
    #[serde(default)]
    pub clip_qkv: Option<f64>,
    /// Weight dtype of checkpoints of this card.
    pub dtype: WeightDtype,
    /// Tokenizer file, relative to `models/` (e.g. `tokenizers/mixtral/tokenizer.json`).
    pub tokenizer: String,
    /// Token prepended to every prompt, if the family does so (`<s>` = 1 for Mixtral).
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token that stops generation.
    pub eos_token_id: u32,
    /// Attend only to the last this-many positions (Mixtral's `sliding_window`; `None`
    /// for full attention).
    #[serde(default)]
    pub sliding_window: Option<u64>,
    /// DBRX `moe_normalize_expert_weights`: top-k routing weights are divided by their
    /// p-norm with this p (`None`: no renormalisation). Mixtral always divides by the sum.
    #[serde(default = "default_router_norm_p")]
    pub router_norm_p: Option<f64>,
    /// RMSNorm of q and k after their projections (Qwen3 per head, OLMoE whole).
    #[serde(default)]
    pub qk_norm: QkNorm,
    /// The q, k and v projections carry biases (Qwen2-MoE).
    #[serde(default)]
    pub qkv_bias: bool,
    /// Width of the shared expert every token runs besides its routed ones (Qwen2-MoE's
    /// `shared_expert_intermediate_size`); 0 for none.
    #[serde(default)]
    pub shared_ffn: u64,
    /// The shared expert's output is scaled by `sigmoid(x · shared_expert_gate)` (Qwen2-MoE).
    #[serde(default)]
    pub shared_gate: bool,
    /// The output projection carries a bias (gpt-oss).
    #[serde(default)]
    pub o_bias: bool,
    /// Each head has a learned attention sink: an extra logit in its softmax (gpt-oss).
    #[serde(default)]
    pub sinks: bool,
    /// `sliding_window` applies to even layers only, odd layers attend fully (gpt-oss's
    /// alternating `layer_types`).
    #[serde(default)]
    pub alternate_sliding: bool,
    /// The router carries a bias, takes the top-k logits and softmaxes over those k only
    /// (gpt-oss); otherwise softmax over all experts, then top-k.
    #[serde(default)]
    pub router_bias_topk_softmax: bool,
    /// Experts are gpt-oss's: fused interleaved gate/up with biases, down with a bias, and
    /// this clamped SwiGLU.
    #[serde(default)]
    pub clamped_swiglu: Option<ClampedSwiglu>,
    /// The checkpoint stores each expert's down projection `[out, in]` (`hidden` rows of
    /// `ffn`) where the family's Hub checkpoint stores it `[in, out]`: DBRX's `w2` as
    /// llama.cpp's converter writes `ffn_down_exps`. Set by the GGUF reader; a storage fact,
    /// not an architecture one (gpt-oss records its own in [`ClampedSwiglu`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expert_down_out_in: bool,
    /// YaRN rotary scaling.
    #[serde(default)]
    pub yarn: Option<Yarn>,
    /// DeepSeek's multi-head latent attention; `heads` query heads, and `kv_heads = 1`,
    /// `head_dim = kv_lora_rank + qk_rope_head_dim` describe the latent cache (see [`Mla`]).
    #[serde(default)]
    pub mla: Option<Mla>,
    /// DeepSeek's router (replaces the softmax-top-k rule).
    #[serde(default)]
    pub deepseek_router: Option<DeepseekRouter>,
    /// Leading dense layers (`first_k_dense_replace`): layers `0..dense_layers` have no
    /// router and no routed experts; their FFN is one dense SwiGLU of width `dense_ffn`
    /// (`mlp.gate_proj/up_proj/down_proj`), held in the layer's `gate` part.
    #[serde(default)]
    pub dense_layers: u64,
    /// Width of the leading dense layers' FFN (`intermediate_size`).
    #[serde(default)]
    pub dense_ffn: u64,
    /// Storage of the weights not held in `dtype`: block-quantised classes or tensors
    /// (a GGUF checkpoint's, or `--weight-format` when planning from a card). Empty for
    /// the shipped cards: every tensor in `dtype`.
    #[serde(default, skip_serializing_if = "WeightFormats::is_empty")]
    pub formats: WeightFormats,
    /// Bytes of the checkpoint its loader holds in process memory for the whole run instead
    /// of mapping them (set when a checkpoint is opened; zero for a card from `models/`):
    /// the host budget counts them whoever reads them.
    #[serde(skip)]
    pub held: HeldBytes,
}

fn default_router_norm_p() -> Option<f64> {
    Some(1.0)
}

impl ModelCard {
    /// True for a leading dense layer (`layer < dense_layers`): no router, no routed
    /// experts, one dense SwiGLU of width `dense_ffn`.
    pub fn is_dense_layer(&self, layer: u64) -> bool {
        layer < self.dense_layers
    }

    /// Leading dense layers, then MoE layers: `layers - dense_layers`.
    pub fn moe_layers(&self) -> u64 {
        self.layers.saturating_sub(self.dense_layers)
    }

    /// Parameters of a dense layer's `gate` part: post-attention norm and the dense SwiGLU.
    pub fn dense_ffn_params(&self) -> u64 {
        self.hidden + 3 * self.hidden * self.dense_ffn
    }

    /// Width of the query projection output (`heads * head_dim`).
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of one `qkv` activation row: Q, K and V, plus one sink value per head for
    /// families with attention sinks (gpt-oss; `pre_attn` carries them to `attn`).
    pub fn qkv_width(&self) -> u64 {
        self.q_dim() + 2 * self.kv_dim() + if self.sinks { self.heads } else { 0 }
    }

    /// Width of one of K or V (`kv_heads * head_dim`).
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Parameters of one layer's attention: Q, K, V and O projections, the two layer norms,
    /// and the q/k biases and norms of the families that have them.
    pub fn attn_params(&self) -> u64 {
        if let Some(m) = self.mla {
            let (d, h) = (self.hidden, self.heads);
            let q = match m.q_lora_rank {
                Some(r) => d * r + r + r * h * m.qk_head_dim(),
                None => d * h * m.qk_head_dim(),
            };
            let kv = d * m.latent_dim()
                + m.kv_lora_rank
                + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim);
            return q + kv + h * m.v_head_dim * d + 2 * d;
        }
        let qkv = self.hidden * (self.q_dim() + 2 * self.kv_dim());
        let o = self.q_dim() * self.hidden;
        let bias = if self.qkv_bias {
            self.q_dim() + 2 * self.kv_dim()
        } else {
            0
        };
        let qk_norm = match self.qk_norm {
            QkNorm::None => 0,
            QkNorm::PerHead => 2 * self.head_dim,
            QkNorm::Full => self.q_dim() + self.kv_dim(),
        };
        let o_bias = if self.o_bias { self.hidden } else { 0 };
        let sinks = if self.sinks { self.heads } else { 0 };
        qkv + o + 2 * self.hidden + bias + qk_norm + o_bias + sinks
    }

    /// Multiply-adds per token of `pre_attn`'s projections: `hidden x (q_dim + 2 kv_dim)`;
    /// with MLA the query chain, `kv_a_proj_with_mqa` and the absorption of `W_uk` into each
    /// head's query (`heads x qk_nope x kv_lora_rank`), which is what the kernels compute.
    pub fn pre_attn_macs_per_token(&self) -> u64 {
        match self.mla {
            Some(m) => {
                let q = match m.q_lora_rank {
                    Some(r) => self.hidden * r + r * self.heads * m.qk_head_dim(),
                    None => self.hidden * self.heads * m.qk_head_dim(),
                };
                q + self.hidden * m.latent_dim() + self.heads * m.qk_nope_head_dim * m.kv_lora_rank
            }
            None => self.hidden * (self.q_dim() + 2 * self.kv_dim()),
        }
    }

    /// Multiply-adds per token of the output projection: `q_dim x hidden`; with MLA each
    /// head's `W_uv` (`v_head_dim x kv_lora_rank`) first, then `o_proj`.
    pub fn o_proj_macs_per_token(&self) -> u64 {
        match self.mla {
            Some(m) => self.heads * m.v_head_dim * (m.kv_lora_rank + self.hidden),
            None => self.q_dim() * self.hidden,
        }
    }

    /// Parameters of one layer's shared expert (gate, up, down and its sigmoid gate); 0
    /// for families without one. It is part of the layer's dense weights: every token uses it.
    pub fn shared_params(&self) -> u64 {
        3 * self.hidden * self.shared_ffn + if self.shared_gate { self.hidden } else { 0 }
    }

    /// Rows per token of an expert accumulator (`expert_acc`): the normalised row, one
    /// output row per routed expert, and one for the shared expert when there is one (or
    /// for a dense layer's SwiGLU, which a card with leading dense layers puts there).
    pub fn acc_rows_per_token(&self) -> u64 {
        1 + self.top_k + u64::from(self.shared_ffn > 0 || self.dense_layers > 0)
    }

    /// Parameters of one layer's router (`experts x hidden`, plus its bias if any).
    pub fn router_params(&self) -> u64 {
        self.experts * self.hidden
            + if self.has_router_bias() {
                self.experts
            } else {
                0
            }
    }

    /// The router carries a per-expert vector: gpt-oss's bias, DeepSeek-V3's selection
    /// correction bias (`e_score_correction_bias`).
    pub fn has_router_bias(&self) -> bool {
        self.router_bias_topk_softmax
            || self
                .deepseek_router
                .is_some_and(|r| r.topk == DeepseekTopk::NoauxTc)
    }

    /// Parameters of one expert (gate, up and down projections, plus gpt-oss's biases).
    pub fn expert_params(&self) -> u64 {
        3 * self.hidden * self.ffn
            + if self.clamped_swiglu.is_some() {
                2 * self.ffn + self.hidden
            } else {
                0
            }
    }

    /// Parameters of one decoder layer.
    pub fn layer_params(&self) -> u64 {
        self.attn_params()
            + self.router_params()
            + self.shared_params()
            + self.experts * self.expert_params()
    }

    /// Parameters outside the layers: embedding, final norm, lm_head (never tied here).
    pub fn outer_params(&self) -> u64 {
        2 * self.vocab * self.hidden + self.hidden
    }

    /// Parameters of one leading dense layer (attention + one SwiGLU of `dense_ffn`).
    pub fn dense_layer_params(&self) -> u64 {
        self.attn_params() + 3 * self.hidden * self.dense_ffn
    }

    /// All parameters.
    pub fn total_params(&self) -> u64 {
        self.layers.saturating_sub(self.dense_layers) * self.layer_params()
            + self.dense_layers * self.dense_layer_params()
            + self.outer_params()
    }

    /// Parameters a single token touches (attention, router, shared expert, `top_k`
    /// experts, plus outer).
    pub fn active_params(&self) -> u64 {
        self.layers.saturating_sub(self.dense_layers)
            * (self.attn_params()
                + self.router_params()
                + self.shared_params()
                + self.top_k * self.expert_params())
            + self.dense_layers * self.dense_layer_params()
            + self.outer_params()
    }

    /// How `tensor` is stored: its entry in [`ModelCard::formats`], else the card's dtype.
    pub fn storage(&self, tensor: WeightTensor) -> Storage {
        self.formats.storage(self.dtype, tensor)
    }

    /// The card's name, with the formats of the weights not in its dtype where it has any
    /// (`mixtral-8x7b; experts Q4_K`): how the planning commands' headers name the model.
    pub fn label(&self) -> String {
        match self.formats.summary(self.dtype) {
            Some(formats) => format!("{}; {formats}", self.name),
            None => self.name.clone(),
        }
    }

    /// Bytes of one layer's attention weights in the card's dtype.
    pub fn attn_bytes(&self) -> u64 {
        self.attn_params() * self.dtype.bytes()
    }

    /// Bytes of one layer's router weights.
    pub fn router_bytes(&self) -> u64 {
        self.router_params() * self.dtype.bytes()
    }

    /// Bytes of one expert's weights.
    pub fn expert_bytes(&self) -> u64 {
        self.expert_params() * self.dtype.bytes()
    }

    /// Bytes of one whole decoder layer.
    pub fn layer_bytes(&self) -> u64 {
        self.layer_params() * self.dtype.bytes()
    }

    /// Bytes of the whole checkpoint.
    pub fn total_bytes(&self) -> u64 {
        self.total_params() * self.dtype.bytes()
    }

    /// Elements of K and V for one token in one layer: `2 * kv_heads * head_dim`, or
    /// `kv_heads * head_dim` (K alone) for an MLA card whose V is a view of K
    /// ([`Mla::values_in_keys`]).
    pub fn kv_elems_per_token_layer(&self) -> u64 {
        self.kv_pools() * self.kv_dim()
    }

    /// Pools of the KV cache: 1 (K alone, an MLA card whose V is a view of K) or 2.
    pub fn kv_pools(&self) -> u64 {
        match self.mla {
            Some(m) if m.values_in_keys => 1,
            _ => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_card_parses_and_validates() {
        for card in ModelCard::builtins() {
            card.validate().unwrap();
        }
    }

    /// Published totals: 46.7B (Mixtral-8x7B), 140.6B (8x22B), 131.6B (DBRX); within 0.5%.
    #[test]
    fn parameter_counts_match_published_totals() {
        let expect = [
            ("mixtral-8x7b", 46.70e9),
            ("mixtral-8x22b", 140.6e9),
            ("dbrx", 131.6e9),
        ];
        for (name, published) in expect {
            let card = ModelCard::load(name).unwrap();
            let got = card.total_params() as f64;
            assert!(
                (got / published - 1.0).abs() < 0.005,
                "{name}: {got} vs {published}"
            );
        }
    }

    /// Published totals and active parameters of the newer families (model cards on the
    /// Hub): Qwen3-30B-A3B 30.5B / 3.3B, Qwen3-235B-A22B 235B / 22B, OLMoE-1B-7B 6.9B /
    /// 1.3B, Qwen2-57B-A14B 57.4B / 14.2B, gpt-oss-20b 20.91B / 3.61B, gpt-oss-120b 116.83B /
    /// 5.13B (OpenAI's model card); within 2% (active: 2.5%, since "2.4B" rounds anything from 2.35B to 2.45B).
    #[test]
    fn new_family_parameter_counts_match_published_figures() {
        let expect = [
            ("qwen3-30b-a3b", 30.5e9, 3.3e9),
            ("qwen3-235b-a22b", 235.0e9, 22.0e9),
            ("olmoe-1b-7b", 6.9e9, 1.3e9),
            ("qwen2-57b-a14b", 57.4e9, 14.2e9),
            ("gpt-oss-20b", 20.91e9, 3.61e9),
            ("gpt-oss-120b", 116.83e9, 5.13e9),
            // DeepSeek's model cards: V2-Lite 15.7B / 2.4B, V3 671B / 37B (without the
            // 14B multi-token-prediction module, which inference does not run).
            ("deepseek-v2-lite", 15.7e9, 2.4e9),
            ("deepseek-v3", 671.0e9, 37.0e9),
        ];
        for (name, total, active) in expect {
            let card = ModelCard::load(name).unwrap();
            let got = card.total_params() as f64;
            assert!((got / total - 1.0).abs() < 0.02, "{name}: {got} vs {total}");
            // OpenAI and DeepSeek count active parameters without the embedding table (a
            // lookup, not a matmul); the others count it.
            let lookup = if matches!(
                card.family,
                Family::GptOss | Family::DeepseekV2 | Family::DeepseekV3
            ) {
                card.vocab * card.hidden
            } else {
                0
            };
            let got = (card.active_params() - lookup) as f64;
            assert!(
                (got / active - 1.0).abs() < 0.025,
                "{name} active: {got} vs {active}"
            );
        }
    }

    /// The issue fixes the mid-size Mixtral card at 0.79 B parameters, 1.6 GB in bf16.
    #[test]
    fn mid_mixtral_card_has_the_agreed_size() {
        let card = ModelCard::load("mixtral-mid").unwrap();
        let params = card.total_params() as f64;
        assert!((params / 0.79e9 - 1.0).abs() < 0.02, "{params}");
        assert!((card.total_bytes() as f64 / 1.6e9 - 1.0).abs() < 0.03);
    }

    /// MLA's projection work by hand for DeepSeek-V2-Lite (d 2048, 16 heads, qk 128 + 64,
    /// v 128, kv_lora 512, no query rank): pre = 2048 x 16 x 192 (q) + 2048 x 576 (kv_a) +
    /// 16 x 128 x 512 (W_uk absorbed) = 8,519,680; o = 16 x 128 x (512 + 2048) = 5,242,880.
    /// The KV cache holds 2 x 576 values per token and layer with a V pool, 576 when V is
    /// a view of K.
    #[test]
    fn mla_work_and_cache_match_hand_arithmetic() {
        let mut lite = ModelCard::load("deepseek-v2-lite").unwrap();
        assert_eq!(lite.pre_attn_macs_per_token(), 8_519_680);
        assert_eq!(lite.o_proj_macs_per_token(), 5_242_880);
        assert_eq!(lite.kv_elems_per_token_layer(), 1152);
        if let Some(m) = lite.mla.as_mut() {
            m.values_in_keys = true;
        }
        assert_eq!(lite.kv_elems_per_token_layer(), 576);
    }

    #[test]
    fn unknown_card_lists_the_known_ones() {
        let err = ModelCard::load("mixtral-9x9b").unwrap_err().to_string();
        assert!(err.contains("mixtral-tiny"), "{err}");
    }
}
