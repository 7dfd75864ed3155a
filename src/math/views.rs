//! Borrowed views of a model's weights as the kernels consume them.
//!
//! Gives [`LayerWeights`] (dense part + experts) and [`ModelWeights`]; every field is a
//! typed slice pointing into a memory map or any byte buffer (see `layout` for building
//! them from a packed image, `checkpoint` for building them straight from safetensors).
//! Nothing here owns or converts weights.

use crate::math::tensor::{Matrix, TypedSlice};

/// Query/key/value projections: separate (Mixtral) or one fused matrix (DBRX).
#[derive(Debug, Clone, Copy)]
pub enum QkvWeights<'a> {
    /// `q_proj`, `k_proj`, `v_proj`.
    Separate {
        /// `[q_dim, hidden]`.
        q: Matrix<'a>,
        /// `[kv_dim, hidden]`.
        k: Matrix<'a>,
        /// `[kv_dim, hidden]`.
        v: Matrix<'a>,
    },
    /// `Wqkv` `[q_dim + 2 kv_dim, hidden]`, rows ordered q, k, v.
    Fused(Matrix<'a>),
    /// DeepSeek's multi-head latent attention projections.
    Mla(crate::math::mla::MlaWeights<'a>),
}

/// The dense (non-expert) weights of one layer.
#[derive(Debug, Clone, Copy)]
pub struct DenseWeights<'a> {
    /// Pre-attention norm weight.
    pub attn_norm: TypedSlice<'a>,
    /// Q/K/V projections.
    pub qkv: QkvWeights<'a>,
    /// Biases of q, k and v (`[q_dim]`, `[kv_dim]`, `[kv_dim]`), Qwen2-MoE.
    pub qkv_bias: Option<[TypedSlice<'a>; 3]>,
    /// RMSNorm weights of q and k (per head `[head_dim]` or whole `[q_dim]`/`[kv_dim]`).
    pub qk_norm: Option<[TypedSlice<'a>; 2]>,
    /// Attention sink logits `[heads]` (gpt-oss).
    pub sinks: Option<TypedSlice<'a>>,
    /// Output projection `[hidden, q_dim]`.
    pub o_proj: Matrix<'a>,
    /// Output projection bias `[hidden]` (gpt-oss).
    pub o_bias: Option<TypedSlice<'a>>,
    /// Pre-MoE norm weight.
    pub ffn_norm: TypedSlice<'a>,
    /// Router `[experts, hidden]`.
    pub router: Matrix<'a>,
    /// Router bias `[experts]` (gpt-oss).
    pub router_bias: Option<TypedSlice<'a>>,
    /// The shared expert every token runs (Qwen2-MoE), if the family has one.
    pub shared: Option<SharedExpertWeights<'a>>,
    /// MLA's `W_uv` as the `o` part holds it (`kv_b_proj`'s value rows, or llama.cpp's
    /// `attn_v_b`): it expands the latent attention output before `o_proj` (`None` without
    /// MLA).
    pub kv_b_out: Option<crate::math::mla::KvUp<'a>>,
}

/// A shared expert: a SwiGLU like a routed one (down stored out x in), optionally scaled
/// by `sigmoid(x · gate)`.
#[derive(Debug, Clone, Copy)]
pub struct SharedExpertWeights<'a> {
    /// Its gate, up and down projections.
    pub ffn: ExpertWeights<'a>,
    /// `shared_expert_gate` `[1, hidden]`.
    pub gate: Option<Matrix<'a>>,
}

/// One expert's SwiGLU feed-forward weights.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// Gate projection `[ffn, hidden]` (out, in); empty for gpt-oss (see `fused`).
    pub gate: Matrix<'a>,
    /// Up projection `[ffn, hidden]` (out, in); empty for gpt-oss (see `fused`).
    pub up: Matrix<'a>,
    /// Down projection: out x in `[hidden, ffn]` (Mixtral) or in x out `[ffn, hidden]`
    /// (DBRX, gpt-oss).
    pub down: Matrix<'a>,
    /// gpt-oss's fused interleaved gate/up and biases; `None` for the other families.
    pub fused: Option<FusedExpert<'a>>,
}

/// gpt-oss's expert parts besides `down`.
#[derive(Debug, Clone, Copy)]
pub struct FusedExpert<'a> {
    /// `gate_up_proj[e]` `[hidden, 2 ffn]` (in, out), gate and up columns interleaved.
    pub gate_up: Matrix<'a>,
    /// `gate_up_proj_bias[e]` `[2 ffn]`.
    pub gate_up_bias: TypedSlice<'a>,
    /// `down_proj_bias[e]` `[hidden]`.
    pub down_bias: TypedSlice<'a>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights<'a> {
    /// Norms, attention, router.
    pub dense: DenseWeights<'a>,
    /// Experts in index order.
    pub experts: Vec<ExpertWeights<'a>>,
}

/// The whole model.
#[derive(Debug, Clone)]
pub struct ModelWeights<'a> {
    /// Token embedding `[vocab, hidden]`.
    pub embed: Matrix<'a>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights<'a>>,
    /// Final norm weight `[hidden]`.
    pub final_norm: TypedSlice<'a>,
    /// Output projection `[vocab, hidden]` (the embedding when tied).
    pub lm_head: Matrix<'a>,
}
