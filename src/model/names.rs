//! Hub tensor names and shapes of every tensor of a checkpoint, per family.
//!
//! Takes an [`ArchSpec`]; gives the full list `(name, shape)` that a Hugging Face
//! checkpoint of that architecture holds (Mixtral per-expert `w1/w2/w3`; Qwen2-MoE,
//! Qwen3-MoE and OLMoE per-expert `gate_proj/up_proj/down_proj` with their q/k norms,
//! q/k/v biases and shared expert; DeepSeek-V2/V3 MLA projections (`q_a_proj`/`q_b_proj`
//! or `q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`), `shared_experts` and V3's
//! `e_score_correction_bias`, and the leading dense layers' `mlp.gate_proj/up_proj/down_proj`; gpt-oss 3-D `mlp.experts.gate_up_proj` /
//! `down_proj` with biases, router bias, sinks; DBRX fused `[experts * ffn, hidden]` expert tensors
//! without a `.weight` suffix). Used to write synthetic checkpoints; the reader resolves
//! the same names segment by segment.

use crate::model::arch::ArchSpec;
use crate::model::card::Family;
use crate::model::layout::{LayerLayout, SegmentKind};
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

/// Names of the embedding table and the final norm.
pub fn head_names(family: Family) -> (&'static str, &'static str) {
    match family {
        Family::Dbrx => ("transformer.wte.weight", "transformer.norm_f.weight"),
        _ => ("model.embed_tokens.weight", "model.norm.weight"),
    }
}

/// Every tensor of a checkpoint, embedding first, then layer by layer (in the layer
/// image's segment order, each tensor once), then the final norm and the head.
pub fn checkpoint_tensors(a: &ArchSpec) -> Vec<(String, Vec<usize>)> {
    let (embed, norm) = head_names(a.family);
    let mut out = vec![(embed.to_string(), vec![a.vocab, a.hidden])];
    for l in 0..a.layers {
        let first = out.len();
        for kind in LayerLayout::kinds(a, l) {
            let src = segment_source(a, l, kind);
            // DBRX's fused expert tensors hold every expert: list them once.
            if !out[first..].iter().any(|(n, _)| *n == src.name) {
                out.push((src.name, src.shape));
            }
        }
    }
    out.push((norm.to_string(), vec![a.hidden]));
    out.push(("lm_head.weight".to_string(), vec![a.vocab, a.hidden]));
    out
}

/// Where segment `kind` of layer `layer` lives in a checkpoint: tensor name, its full
/// shape, and the row range the segment takes (all rows except DBRX expert blocks).
pub fn segment_source(a: &ArchSpec, layer: usize, kind: SegmentKind) -> Source {
    let (rows, cols, orientation) = LayerLayout::shape_of(a, kind);
    let whole = |name: String| Source {
        shape: if orientation.is_none() {
            vec![cols]
        } else {
            vec![rows, cols]
        },
        rows: 0..rows,
        name,
    };
    match a.family {
        Family::Dbrx => {
            let p = format!("transformer.blocks.{layer}");
            let fused = |w: &str, e: usize| Source {
                name: format!("{p}.ffn.experts.mlp.{w}"),
                shape: vec![a.experts * a.ffn, a.hidden],
                rows: e * a.ffn..(e + 1) * a.ffn,
            };
            match kind {
                SegmentKind::ExpertGate(e) => fused("w1", e),
                SegmentKind::ExpertUp(e) => fused("v1", e),
                SegmentKind::ExpertDown(e) => fused("w2", e),
                other => whole(match other {
                    SegmentKind::AttnNorm => format!("{p}.norm_attn_norm.norm_1.weight"),
                    SegmentKind::FfnNorm => format!("{p}.norm_attn_norm.norm_2.weight"),
                    SegmentKind::OProj => format!("{p}.norm_attn_norm.attn.out_proj.weight"),
                    SegmentKind::Router => format!("{p}.ffn.router.layer.weight"),
                    _ => format!("{p}.norm_attn_norm.attn.Wqkv.weight"),
                }),
            }
        }
        Family::GptOss => {
            let p = format!("model.layers.{layer}");
            let (d, f, e_n) = (a.hidden, a.ffn, a.experts);
            // Expert tensors are 3-D `[experts, in, out]` / 2-D `[experts, n]`; a segment
            // is expert e's block of rows of the tensor seen as `[leading dims, last dim]`.
            let fused = |name: &str, shape: Vec<usize>, e: usize, rows: usize| Source {
                name: format!("{p}.mlp.experts.{name}"),
                shape,
                rows: e * rows..(e + 1) * rows,
            };
            match kind {
                SegmentKind::ExpertGateUp(e) => fused("gate_up_proj", vec![e_n, d, 2 * f], e, d),
                SegmentKind::ExpertGateUpBias(e) => {
                    fused("gate_up_proj_bias", vec![e_n, 2 * f], e, 1)
                }
                SegmentKind::ExpertDown(e) => fused("down_proj", vec![e_n, f, d], e, f),
                SegmentKind::ExpertDownBias(e) => fused("down_proj_bias", vec![e_n, d], e, 1),
                other => whole(match other {
                    SegmentKind::AttnNorm => format!("{p}.input_layernorm.weight"),
                    SegmentKind::QProj => format!("{p}.self_attn.q_proj.weight"),
                    SegmentKind::KProj => format!("{p}.self_attn.k_proj.weight"),
                    SegmentKind::VProj => format!("{p}.self_attn.v_proj.weight"),
                    SegmentKind::QBias => format!("{p}.self_attn.q_proj.bias"),
                    SegmentKind::KBias => format!("{p}.self_attn.k_proj.bias"),
                    SegmentKind::VBias => format!("{p}.self_attn.v_proj.bias"),
                    SegmentKind::Sinks => format!("{p}.self_attn.sinks"),
                    SegmentKind::OProj => format!("{p}.self_attn.o_proj.weight"),
                    SegmentKind::OBias => format!("{p}.self_attn.o_proj.bias"),
                    SegmentKind::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
                    SegmentKind::Router => format!("{p}.mlp.router.weight"),
                    SegmentKind::RouterBias => format!("{p}.mlp.router.bias"),
                    // Kinds gpt-oss's layout never lists (names for completeness).
                    _ => format!("{p}.(no {kind:?} in gpt-oss)"),
                }),
            }
        }
        family => {
            let p = format!("model.layers.{layer}");
            let moe = if family == Family::Mixtral {
                "block_sparse_moe"
            } else {
                "mlp"
            };
            let expert = |e: usize, mixtral: &str, other: &str| {
                let w = if family == Family::Mixtral {
                    mixtral
                } else {
                    other
                };
                format!("{p}.{moe}.experts.{e}.{w}.weight")
            };
            let deepseek = matches!(family, Family::DeepseekV2 | Family::DeepseekV3);
            whole(match kind {
                SegmentKind::AttnNorm => format!("{p}.input_layernorm.weight"),
                SegmentKind::QProj => format!("{p}.self_attn.q_proj.weight"),
                SegmentKind::QAProj => format!("{p}.self_attn.q_a_proj.weight"),
                SegmentKind::QANorm => format!("{p}.self_attn.q_a_layernorm.weight"),
                SegmentKind::QBProj => format!("{p}.self_attn.q_b_proj.weight"),
                SegmentKind::KvAProj => format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
                SegmentKind::KvANorm => format!("{p}.self_attn.kv_a_layernorm.weight"),
                // One tensor, viewed by both the `pre` and the `o` part.
                SegmentKind::KvB | SegmentKind::KvBOut => {
                    format!("{p}.self_attn.kv_b_proj.weight")
                }
                // A leading dense layer's FFN (`DeepseekV2MLP` of `intermediate_size`).
                SegmentKind::DenseGate => format!("{p}.mlp.gate_proj.weight"),
                SegmentKind::DenseUp => format!("{p}.mlp.up_proj.weight"),
                SegmentKind::DenseDown => format!("{p}.mlp.down_proj.weight"),
                SegmentKind::RouterBias if deepseek => {
                    format!("{p}.mlp.gate.e_score_correction_bias")
                }
                SegmentKind::SharedGate if deepseek => {
                    format!("{p}.mlp.shared_experts.gate_proj.weight")
                }
                SegmentKind::SharedUp if deepseek => {
                    format!("{p}.mlp.shared_experts.up_proj.weight")
                }
                SegmentKind::SharedDown if deepseek => {
                    format!("{p}.mlp.shared_experts.down_proj.weight")
                }
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
                SegmentKind::Router => format!("{p}.{moe}.gate.weight"),
                SegmentKind::SharedGate => format!("{p}.{moe}.shared_expert.gate_proj.weight"),
                SegmentKind::SharedUp => format!("{p}.{moe}.shared_expert.up_proj.weight"),
                SegmentKind::SharedDown => format!("{p}.{moe}.shared_expert.down_proj.weight"),
                SegmentKind::SharedExpertGate => format!("{p}.{moe}.shared_expert_gate.weight"),
                SegmentKind::ExpertGate(e) => expert(e, "w1", "gate_proj"),
                SegmentKind::ExpertUp(e) => expert(e, "w3", "up_proj"),
                SegmentKind::ExpertDown(e) => expert(e, "w2", "down_proj"),
                // Kinds only gpt-oss's layout lists.
                other => format!("{p}.(no {other:?} in {family:?})"),
            })
        }
    }
}
