//! DeepSeek's `kv_b_proj` put back together from llama.cpp's split halves.
//!
//! `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36's llama.cpp) writes the Hub's
//! `kv_b_proj` `[heads * (qk_nope + v), kv_lora]` as two tensors for its absorbed MLA:
//! `attn_k_b`, each head's `qk_nope` key rows transposed (`[heads, kv_lora, qk_nope]`
//! outermost first), and `attn_v_b`, each head's `v` value rows (`[heads, v, kv_lora]`).
//! `llama-quantize` quantises both like any matrix (rows of `qk_nope` and `kv_lora`
//! weights). moec's MLA reads the Hub layout, so this takes both (any float or block
//! storage moec reads, decoded to f32), transposes the key half back, and interleaves them
//! per head: head `h` is rows `k_b[h]^T` then `v_b[h]`. The product with `kv_b` therefore
//! runs in f32 from the decoded values, not from the blocks.
//! An older converter's single `attn_kv_b` is the Hub tensor as stored and is decoded as is.
//! Gives the f32 bytes; a missing half or a shape the metadata does not imply is an error
//! naming the tensor.

use super::{GgufError, GgufFile, Storage};
use crate::model::arch::ArchSpec;
use crate::model::card::WeightDtype;
use crate::model::quant::QuantSlice;

/// The elements of a stored tensor as f32 (`None` when the bytes are not `elems` of
/// `storage`).
pub fn decode_f32(bytes: &[u8], storage: Storage, elems: usize) -> Option<Vec<f32>> {
    let mut out = vec![0f32; elems];
    match storage {
        Storage::Float(WeightDtype::F32) => {
            if bytes.len() != elems * 4 {
                return None;
            }
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Storage::Float(WeightDtype::F16) | Storage::Float(WeightDtype::Bf16) => {
            if bytes.len() != elems * 2 {
                return None;
            }
            let f16 = storage == Storage::Float(WeightDtype::F16);
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                let bits = u16::from_le_bytes([c[0], c[1]]);
                *o = if f16 {
                    half::f16::from_bits(bits).to_f32()
                } else {
                    half::bf16::from_bits(bits).to_f32()
                };
            }
        }
        Storage::Quant(format) => {
            QuantSlice::new(bytes, format, elems)
                .ok()?
                .dequantize_into(&mut out)
                .ok()?;
        }
    }
    Some(out)
}

/// Layer `layer`'s `kv_b_proj` as the Hub stores it, in f32 little-endian bytes.
pub fn kv_b(file: &GgufFile, arch: &ArchSpec, layer: usize) -> Result<Vec<u8>, GgufError> {
    let mla = arch.mla.as_ref().ok_or_else(|| GgufError::Metadata {
        path: file.path().display().to_string(),
        key: "deepseek2.attention.kv_lora_rank".into(),
        message: "an MLA tensor without MLA metadata".into(),
    })?;
    // A width past usize becomes 0, which no tensor's shape matches: an error naming it.
    let us = |x: u64| usize::try_from(x).unwrap_or(0);
    let (heads, rank) = (arch.attn.heads, us(mla.kv_lora_rank));
    let (nope, v) = (us(mla.qk_nope_head_dim), us(mla.v_head_dim));
    let decode = |name: &str, shape: &[usize]| -> Result<Vec<f32>, GgufError> {
        let (info, storage) = file.tensor(name, shape)?;
        let elems = shape.iter().product();
        decode_f32(file.tensor_bytes(info), storage, elems).ok_or_else(|| GgufError::Tensor {
            path: file.path().display().to_string(),
            tensor: name.into(),
            message: format!("its bytes are not {elems} {} elements", storage.name()),
        })
    };
    let merged = format!("blk.{layer}.attn_kv_b.weight");
    let values = if file.tensors.contains_key(&merged) {
        decode(&merged, &[heads * (nope + v), rank])?
    } else {
        let k_b = decode(
            &format!("blk.{layer}.attn_k_b.weight"),
            &[heads, rank, nope],
        )?;
        let v_b = decode(&format!("blk.{layer}.attn_v_b.weight"), &[heads, v, rank])?;
        let mut out = Vec::with_capacity(heads * (nope + v) * rank);
        for h in 0..heads {
            for r in 0..nope {
                out.extend((0..rank).map(|c| k_b[(h * rank + c) * nope + r]));
            }
            out.extend_from_slice(&v_b[h * v * rank..(h + 1) * v * rank]);
        }
        out
    };
    Ok(values.iter().flat_map(|x| x.to_le_bytes()).collect())
}
