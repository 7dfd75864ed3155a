//! Hub tensor names and shapes of every tensor of a checkpoint, per family.
//!
//! Takes an [`ArchSpec`]; gives the full list `(name, shape)` that a Hugging Face
//! checkpoint of that architecture holds (Mixtral per-expert `w1/w2/w3`, DBRX fused
//! `[experts * ffn, hidden]` expert tensors without a `.weight` suffix). Used to write
//! synthetic checkpoints; the reader resolves the same names segment by segment.

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

/// Every tensor of a checkpoint, embedding first, then layer by layer, then the head.
pub fn checkpoint_tensors(a: &ArchSpec) -> Vec<(String, Vec<usize>)> {
    let (d, f, e) = (a.hidden, a.ffn, a.experts);
    let (q, kv) = (a.q_dim(), a.kv_dim());
    let mut out = Vec::new();
    match a.family {
        Family::Mixtral => {
            out.push(("model.embed_tokens.weight".to_string(), vec![a.vocab, d]));
            for l in 0..a.layers {
                let p = format!("model.layers.{l}");
                out.push((format!("{p}.input_layernorm.weight"), vec![d]));
                out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, d]));
                out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, d]));
                out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, d]));
                out.push((format!("{p}.self_attn.o_proj.weight"), vec![d, q]));
                out.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
                out.push((format!("{p}.block_sparse_moe.gate.weight"), vec![e, d]));
                for x in 0..e {
                    let pe = format!("{p}.block_sparse_moe.experts.{x}");
                    out.push((format!("{pe}.w1.weight"), vec![f, d]));
                    out.push((format!("{pe}.w2.weight"), vec![d, f]));
                    out.push((format!("{pe}.w3.weight"), vec![f, d]));
                }
            }
            out.push(("model.norm.weight".to_string(), vec![d]));
        }
        Family::Dbrx => {
            out.push(("transformer.wte.weight".to_string(), vec![a.vocab, d]));
            for l in 0..a.layers {
                let p = format!("transformer.blocks.{l}");
                out.push((format!("{p}.norm_attn_norm.norm_1.weight"), vec![d]));
                out.push((
                    format!("{p}.norm_attn_norm.attn.Wqkv.weight"),
                    vec![q + 2 * kv, d],
                ));
                out.push((
                    format!("{p}.norm_attn_norm.attn.out_proj.weight"),
                    vec![d, q],
                ));
                out.push((format!("{p}.norm_attn_norm.norm_2.weight"), vec![d]));
                out.push((format!("{p}.ffn.router.layer.weight"), vec![e, d]));
                for w in ["w1", "v1", "w2"] {
                    out.push((format!("{p}.ffn.experts.mlp.{w}"), vec![e * f, d]));
                }
            }
            out.push(("transformer.norm_f.weight".to_string(), vec![d]));
        }
    }
    out.push(("lm_head.weight".to_string(), vec![a.vocab, d]));
    out
}

/// Where segment `kind` of layer `layer` lives in a checkpoint: tensor name, its full
/// shape, and the row range the segment takes (all rows except DBRX expert blocks).
pub fn segment_source(a: &ArchSpec, layer: usize, kind: SegmentKind) -> Source {
    let (rows, cols, _) = LayerLayout::shape_of(a, kind);
    let whole = |name: String| Source {
        shape: if kind == SegmentKind::AttnNorm || kind == SegmentKind::FfnNorm {
            vec![cols]
        } else {
            vec![rows, cols]
        },
        rows: 0..rows,
        name,
    };
    match a.family {
        Family::Mixtral => {
            let p = format!("model.layers.{layer}");
            whole(match kind {
                SegmentKind::AttnNorm => format!("{p}.input_layernorm.weight"),
                SegmentKind::QProj => format!("{p}.self_attn.q_proj.weight"),
                SegmentKind::KProj => format!("{p}.self_attn.k_proj.weight"),
                SegmentKind::VProj => format!("{p}.self_attn.v_proj.weight"),
                SegmentKind::QkvProj => format!("{p}.self_attn.qkv_proj.weight"),
                SegmentKind::OProj => format!("{p}.self_attn.o_proj.weight"),
                SegmentKind::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
                SegmentKind::Router => format!("{p}.block_sparse_moe.gate.weight"),
                SegmentKind::ExpertGate(e) => {
                    format!("{p}.block_sparse_moe.experts.{e}.w1.weight")
                }
                SegmentKind::ExpertUp(e) => {
                    format!("{p}.block_sparse_moe.experts.{e}.w3.weight")
                }
                SegmentKind::ExpertDown(e) => {
                    format!("{p}.block_sparse_moe.experts.{e}.w2.weight")
                }
            })
        }
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
    }
}
