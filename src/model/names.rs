//! Hub tensor names and shapes of every tensor of a checkpoint, per family.
//!
//! Takes an [`ArchSpec`]; gives the full list `(name, shape)` that a Hugging Face
//! checkpoint of that architecture holds (Mixtral per-expert `w1/w2/w3`, DBRX fused
//! `[experts * ffn, hidden]` expert tensors without a `.weight` suffix). Used to write
//! synthetic checkpoints; the reader resolves the same names segment by segment.

use crate::model::arch::ArchSpec;
use crate::model::card::Family;

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
                out.push((format!("{p}.norm_attn_norm.attn.Wqkv.weight"), vec![q + 2 * kv, d]));
                out.push((format!("{p}.norm_attn_norm.attn.out_proj.weight"), vec![d, q]));
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
