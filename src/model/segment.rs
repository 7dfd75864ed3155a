//! What a segment of a layer's packed image holds: one tensor, or one expert's row block
//! of a fused tensor. The layout ([`super::layout`]) places segments; the formats, the
//! architecture and the families name them.

/// What a segment of the layer image holds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum SegmentKind {
    /// Pre-attention norm weight `[hidden]`.
    AttnNorm,
    /// Mixtral `q_proj` `[q_dim, hidden]`.
    QProj,
    /// Mixtral `k_proj` `[kv_dim, hidden]`.
    KProj,
    /// Mixtral `v_proj` `[kv_dim, hidden]`.
    VProj,
    /// DBRX fused `Wqkv` `[q_dim + 2 kv_dim, hidden]`.
    QkvProj,
    /// `q_proj` bias `[q_dim]` (Qwen2-MoE).
    QBias,
    /// `k_proj` bias `[kv_dim]`.
    KBias,
    /// `v_proj` bias `[kv_dim]`.
    VBias,
    /// Attention sinks `[heads]` (gpt-oss).
    Sinks,
    /// q RMSNorm weight: `[head_dim]` per head (Qwen3) or `[q_dim]` (OLMoE).
    QNorm,
    /// k RMSNorm weight: `[head_dim]` per head (Qwen3) or `[kv_dim]` (OLMoE).
    KNorm,
    /// MLA query down-projection `q_a_proj` `[q_lora_rank, hidden]` (DeepSeek with a
    /// query rank).
    QAProj,
    /// MLA `q_a_layernorm` `[q_lora_rank]`.
    QANorm,
    /// MLA query up-projection `q_b_proj` `[heads * qk_head_dim, q_lora_rank]`.
    QBProj,
    /// MLA `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    KvAProj,
    /// MLA `kv_a_layernorm` `[kv_lora_rank]`.
    KvANorm,
    /// MLA `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]` in the
    /// `pre` part: its key rows are folded into the queries.
    KvB,
    /// The same `kv_b_proj` again in the `o` part: its value rows expand the attention
    /// output before `o_proj` (the `o` op reads only its own part of `W`).
    KvBOut,
    /// llama.cpp's `attn_k_b` `[heads * kv_lora_rank, qk_nope_head_dim]` in the `pre` part
    /// of a checkpoint that stores `kv_b_proj` split (`Mla::kv_b_split`): per head,
    /// `kv_lora_rank` rows of `qk_nope_head_dim` weights (`W_uk_h` transposed), so
    /// `q_nope W_uk_h` is an out-in product with it as stored.
    KB,
    /// llama.cpp's `attn_v_b` `[heads * v_head_dim, kv_lora_rank]` in the `o` part of such a
    /// checkpoint: per head, `v_head_dim` rows of `kv_lora_rank` weights (`W_uv_h`).
    VB,
    /// Output projection `[hidden, q_dim]` (MLA: `[hidden, heads * v_head_dim]`).
    OProj,
    /// Output projection bias `[hidden]` (gpt-oss).
    OBias,
    /// Pre-MoE norm weight `[hidden]`.
    FfnNorm,
    /// Router `[experts, hidden]`.
    Router,
    /// Router bias `[experts]` (gpt-oss).
    RouterBias,
    /// Shared expert gate projection `[shared_ffn, hidden]` (Qwen2-MoE).
    SharedGate,
    /// Shared expert up projection `[shared_ffn, hidden]`.
    SharedUp,
    /// Shared expert down projection `[hidden, shared_ffn]`.
    SharedDown,
    /// The shared expert's sigmoid gate `[1, hidden]` (Qwen2-MoE `shared_expert_gate`).
    SharedExpertGate,
    /// A dense layer's gate projection `mlp.gate_proj` `[dense_ffn, hidden]` (DeepSeek's
    /// leading dense layers).
    DenseGate,
    /// A dense layer's up projection `mlp.up_proj` `[dense_ffn, hidden]`.
    DenseUp,
    /// A dense layer's down projection `mlp.down_proj` `[hidden, dense_ffn]`.
    DenseDown,
    /// Expert gate projection (Mixtral `w1`, DBRX `w1` rows) `[ffn, hidden]`.
    ExpertGate(usize),
    /// Expert up projection (Mixtral `w3`, DBRX `v1` rows) `[ffn, hidden]`.
    ExpertUp(usize),
    /// Expert down projection: Mixtral `w2` `[hidden, ffn]` (out, in); DBRX `w2` rows and
    /// gpt-oss `down_proj[e]` `[ffn, hidden]` (in, out), used as stored (gpt-oss stored
    /// out-in: `[hidden, ffn]`).
    ExpertDown(usize),
    /// gpt-oss fused gate/up `gate_up_proj[e]` `[hidden, 2 ffn]` (in, out), gate and up
    /// interleaved (even columns gate, odd columns up); stored out-in
    /// (`ArchSpec::experts_out_in`) `[2 ffn, hidden]`, even rows gate, odd rows up.
    ExpertGateUp(usize),
    /// gpt-oss `gate_up_proj_bias[e]` `[2 ffn]`, interleaved like the columns.
    ExpertGateUpBias(usize),
    /// gpt-oss `down_proj_bias[e]` `[hidden]`.
    ExpertDownBias(usize),
}

impl SegmentKind {
    /// The expert this segment belongs to, if any.
    pub fn expert(&self) -> Option<usize> {
        match *self {
            SegmentKind::ExpertGate(e)
            | SegmentKind::ExpertUp(e)
            | SegmentKind::ExpertDown(e)
            | SegmentKind::ExpertGateUp(e)
            | SegmentKind::ExpertGateUpBias(e)
            | SegmentKind::ExpertDownBias(e) => Some(e),
            _ => None,
        }
    }
}
