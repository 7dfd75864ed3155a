//! DeepSeek's `kv_b_proj` from an older `convert_hf_to_gguf.py`, which wrote it whole.
//!
//! Today's converter (llama-cpp-python 0.3.36's llama.cpp) splits the Hub's `kv_b_proj`
//! `[heads * (qk_nope + v), kv_lora]` into `attn_k_b` and `attn_v_b` for its absorbed MLA;
//! moec reads those as stored (`Mla::kv_b_split`, the `KB`/`VB` segments) and multiplies
//! them as llama.cpp does. An older converter's single `attn_kv_b` is the Hub tensor as
//! stored; this decodes it (any float or block storage moec reads) to f32, because moec's
//! product with its key rows reads them in-out, which the quantised products refuse.
//! A shape the metadata does not imply is an error naming the tensor.

use super::{GgufError, GgufFile, Storage};
use crate::model::arch::ArchSpec;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantSlice;

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

/// Layer `layer`'s `kv_b_proj` (an older converter's `attn_kv_b`) in f32 little-endian
/// bytes.
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
    let name = format!("blk.{layer}.attn_kv_b.weight");
    let shape = [heads * (nope + v), rank];
    let (info, storage) = file.tensor(&name, &shape)?;
    let elems = shape.iter().product();
    let values =
        decode_f32(file.tensor_bytes(info), storage, elems).ok_or_else(|| GgufError::Tensor {
            path: file.path().display().to_string(),
            tensor: name.clone(),
            message: format!("its bytes are not {elems} {} elements", storage.name()),
        })?;
    Ok(values.iter().flat_map(|x| x.to_le_bytes()).collect())
}
