//! llama-quantize's K-quant mixes (`Q4_K_M`, `Q4_K_S`, `Q5_K_M`, `Q5_K_S`, `Q6_K`) and
//! `MXFP4_MOE` (merged experts MXFP4, the rest Q8_0, as for gpt-oss): the
//! ggml type of each tensor, by the rules of `llama_tensor_get_type` in llama.cpp's
//! `src/llama-quant.cpp` (llama-cpp-python 0.3.36's copy), for `moec quantize --mix`.
//!
//! Takes the file's tensor table in its order (names, dims) and the model's expert and
//! layer counts; gives each tensor's type. Guarantees, as llama-quantize without an
//! importance matrix or overrides: only 2-D and 3-D `*.weight` tensors are quantised,
//! never norms or the router (`ffn_gate_inp.weight`); the output matrix (and the
//! embedding when it is tied to it) is Q6_K (Q8_0 when its rows are not whole 256-weight
//! blocks); attention V (and `attn_kv_b`, `attn_qkv`) and the FFN down projections
//! (experts and shared experts alike) get more bits in the layers `use_more_bits` picks;
//! 8-expert models keep attention K and V in Q8_0 and attention output in Q5_K; a row
//! that is not whole 256-weight blocks falls back as llama-quantize falls back (Q6_K to
//! Q8_0, Q4_K to Q5_0; Q5_K to Q5_1, which moec does not write, so that is an error
//! naming the tensor). llama.cpp's rule for its 70B dense model type (V in Q5_K) does not
//! arise for the MoE families moec writes.

use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;

/// One of llama-quantize's K-quant file types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// `Q4_K_M` (llama_ftype 15).
    Q4KM,
    /// `Q4_K_S` (14).
    Q4KS,
    /// `Q5_K_M` (17).
    Q5KM,
    /// `Q5_K_S` (16).
    Q5KS,
    /// `Q6_K` (18).
    Q6K,
    /// `MXFP4_MOE` (38): merged expert tensors MXFP4, every other quantised one Q8_0.
    Mxfp4Moe,
}

impl Mix {
    /// Every mix, in the order `--help` lists them.
    pub const ALL: [Mix; 6] = [
        Mix::Q4KM,
        Mix::Q4KS,
        Mix::Q5KM,
        Mix::Q5KS,
        Mix::Q6K,
        Mix::Mxfp4Moe,
    ];

    /// The lower-case name the flag takes (`q4_k_m`).
    pub fn name(self) -> &'static str {
        match self {
            Mix::Q4KM => "q4_k_m",
            Mix::Q4KS => "q4_k_s",
            Mix::Q5KM => "q5_k_m",
            Mix::Q5KS => "q5_k_s",
            Mix::Q6K => "q6_k",
            Mix::Mxfp4Moe => "mxfp4_moe",
        }
    }

    /// The mix `text` names (case-insensitive).
    pub fn parse(text: &str) -> Result<Mix, String> {
        let t = text.trim().to_ascii_lowercase();
        Mix::ALL.into_iter().find(|m| m.name() == t).ok_or_else(|| {
            format!(
                "`{text}` is not a mix moec writes ({})",
                Mix::ALL.map(Mix::name).join(", ")
            )
        })
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`) for the mix.
    pub fn file_type(self) -> u32 {
        match self {
            Mix::Q4KS => 14,
            Mix::Q4KM => 15,
            Mix::Q5KS => 16,
            Mix::Q5KM => 17,
            Mix::Q6K => 18,
            Mix::Mxfp4Moe => 38,
        }
    }

    /// The type every quantised tensor starts from.
    fn base(self) -> QuantFormat {
        match self {
            Mix::Q4KM | Mix::Q4KS => QuantFormat::Q4K,
            Mix::Q5KM | Mix::Q5KS => QuantFormat::Q5K,
            Mix::Q6K => QuantFormat::Q6K,
            Mix::Mxfp4Moe => QuantFormat::Mxfp4,
        }
    }
}

/// llama-quantize's broad tensor category, from the name (`tensor_get_category`: the
/// first of these substrings the name holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttnQkv,
    AttnKvB,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        return Category::Output;
    }
    if name == "token_embd.weight" {
        return Category::TokenEmbd;
    }
    [
        ("attn_qkv.weight", Category::AttnQkv),
        ("attn_kv_b.weight", Category::AttnKvB),
        ("attn_v.weight", Category::AttnV),
        ("attn_k.weight", Category::AttnK),
        ("attn_q.weight", Category::AttnQ),
        ("attn_output.weight", Category::AttnOutput),
        ("ffn_up", Category::FfnUp),
        ("ffn_gate", Category::FfnGate),
        ("ffn_down", Category::FfnDown),
    ]
    .into_iter()
    .find(|(part, _)| name.contains(part))
    .map_or(Category::Other, |(_, c)| c)
}

/// Whether llama-quantize quantises the tensor at all (`tensor_allows_quantization` for
/// the names moec writes): 2-D or 3-D, a `weight`, not a norm, not the router.
fn quantisable(name: &str, dims: &[u64]) -> bool {
    dims.len() >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third
/// one between.
fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8).rem_euclid(3) == 2
}

/// The layer in a `blk.N.` name.
fn layer_of(name: &str) -> Option<i64> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The model facts the rules read.
#[derive(Debug, Clone, Copy)]
pub struct MixModel {
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Transformer layers.
    pub layers: usize,
}

/// The type of each tensor of `tensors` (name, ggml dims, row first) under `mix`: `None`
/// for one llama-quantize leaves in its source type, else its storage.
pub fn mix_types(
    mix: Mix,
    model: MixModel,
    tensors: &[(&str, &[u64])],
) -> Result<Vec<Option<Storage>>, String> {
    let tied = !tensors.iter().any(|(n, _)| *n == "output.weight");
    let n_attention_wv = tensors
        .iter()
        .filter(|(n, _)| {
            matches!(
                category(n),
                Category::AttnV | Category::AttnQkv | Category::AttnKvB
            )
        })
        .count() as i64;
    let n_layer = model.layers as i64;
    let eight = model.experts == 8;
    let (mut i_attention_wv, mut i_ffn_down) = (0i64, 0i64);
    let mut out = Vec::with_capacity(tensors.len());
    for &(name, dims) in tensors {
        if !quantisable(name, dims) {
            out.push(None);
            continue;
        }
        let cols = dims[0] as usize;
        let mut ty = mix.base();
        let cat = category(name);
        if mix == Mix::Mxfp4Moe {
            // The output matrix (and a tied embedding) Q8_0; any other tensor MXFP4 when
            // it stacks experts (a third dimension over 1), else Q8_0.
            let output = cat == Category::Output || (tied && cat == Category::TokenEmbd);
            if output || dims.get(2).is_none_or(|&e| e <= 1) {
                ty = QuantFormat::Q8_0;
            }
            out.push(Some(fallback(name, ty, cols)?));
            continue;
        }
        match cat {
            Category::Output | Category::TokenEmbd if cat == Category::Output || tied => {
                ty = if !cols.is_multiple_of(256) {
                    QuantFormat::Q8_0
                } else {
                    QuantFormat::Q6K
                };
            }
            Category::TokenEmbd => {}
            Category::AttnV | Category::AttnQkv | Category::AttnKvB => {
                if matches!(mix, Mix::Q4KM | Mix::Q5KM)
                    && use_more_bits(i_attention_wv, n_attention_wv)
                {
                    ty = QuantFormat::Q6K;
                } else if mix == Mix::Q4KS && i_attention_wv < 4 {
                    ty = QuantFormat::Q5K;
                }
                if eight {
                    ty = QuantFormat::Q8_0;
                }
                i_attention_wv += 1;
            }
            Category::AttnK if eight => ty = QuantFormat::Q8_0,
            Category::FfnDown => {
                // With experts, llama.cpp reads the layer from the name (expert tensors
                // are not one per layer in every file); without, it counts.
                let i_layer = if model.experts > 1 {
                    layer_of(name)
                        .filter(|l| (0..n_layer).contains(l))
                        .ok_or_else(|| {
                            format!("tensor `{name}`: no layer below {n_layer} in its name")
                        })?
                } else {
                    i_ffn_down
                };
                match mix {
                    Mix::Q4KM | Mix::Q5KM if use_more_bits(i_layer, n_layer) => {
                        ty = QuantFormat::Q6K;
                    }
                    Mix::Q4KS if i_layer < n_layer / 8 => ty = QuantFormat::Q5K,
                    _ => {}
                }
                i_ffn_down += 1;
            }
            Category::AttnOutput if eight && matches!(mix, Mix::Q4KM | Mix::Q4KS) => {
                ty = QuantFormat::Q5K;
            }
            _ => {}
        }
        out.push(Some(fallback(name, ty, cols)?));
    }
    Ok(out)
}

/// llama-quantize's `tensor_type_fallback`: a row that is not whole blocks of `ty` takes
/// Q8_0 for Q6_K and Q5_0 for Q4_K (Q5_1 for Q5_K, a format moec does not write: an
/// error naming the tensor), and F16 where even the fallback's 32-weight blocks do not
/// fit.
fn fallback(name: &str, ty: QuantFormat, cols: usize) -> Result<Storage, String> {
    if cols.is_multiple_of(ty.block_elems()) {
        return Ok(Storage::Quant(ty));
    }
    if !cols.is_multiple_of(32) {
        return Ok(Storage::Float(WeightDtype::F16));
    }
    match ty {
        QuantFormat::Q4K => Ok(Storage::Quant(QuantFormat::Q5_0)),
        QuantFormat::Q5K => Err(format!(
            "tensor `{name}`: rows of {cols} weights are not whole {} blocks, and \
             llama-quantize's fallback for it (Q5_1) is a format moec does not write",
            ty.name(),
        )),
        _ => Ok(Storage::Quant(QuantFormat::Q8_0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_more_bits_is_llamas() {
        // 32 layers (Mixtral-8x7B): 0-3, 28-31 and every third from 6.
        let picked: Vec<i64> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            picked,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
        // 2 layers: n/8 = 0, 7n/8 = 1.
        assert!(!use_more_bits(0, 2) && use_more_bits(1, 2));
    }

    #[test]
    fn categories_follow_the_first_match() {
        assert_eq!(category("blk.3.attn_kv_b.weight"), Category::AttnKvB);
        assert_eq!(category("blk.3.ffn_down_shexp.weight"), Category::FfnDown);
        assert_eq!(
            category("blk.3.ffn_gate_inp_shexp.weight"),
            Category::FfnGate
        );
        assert!(!quantisable("blk.0.ffn_gate_inp.weight", &[256, 4]));
        assert!(quantisable("blk.0.ffn_gate_inp_shexp.weight", &[256, 1]));
        assert!(!quantisable("blk.0.attn_norm.weight", &[256]));
    }

    #[test]
    fn mxfp4_moe_puts_stacked_experts_in_mxfp4_and_the_rest_in_q8_0() {
        // llama-quantize's MXFP4_MOE on gpt-oss: `ne[2] > 1` is MXFP4, the output matrix
        // and every other quantised tensor Q8_0, biases and the router untouched.
        let tensors: [(&str, &[u64]); 6] = [
            ("output.weight", &[128, 512]),
            ("token_embd.weight", &[128, 512]),
            ("blk.0.ffn_gate_exps.weight", &[128, 64, 8]),
            ("blk.0.ffn_gate_exps.bias", &[64, 8]),
            ("blk.0.attn_q.weight", &[128, 128]),
            ("blk.0.ffn_gate_inp.weight", &[128, 8]),
        ];
        let model = MixModel {
            experts: 8,
            layers: 1,
        };
        let (q8, mx) = (
            Some(Storage::Quant(QuantFormat::Q8_0)),
            Some(Storage::Quant(QuantFormat::Mxfp4)),
        );
        assert_eq!(
            mix_types(Mix::Mxfp4Moe, model, &tensors).unwrap(),
            [q8, q8, mx, None, q8, None]
        );
    }

    /// DeepSeek-V2-Lite's routed experts have rows of 1408 weights (5.5 super-blocks):
    /// under Q4_K_M llama-quantize writes their down projections Q5_0 (Q4_K's fallback), or
    /// Q8_0 in the layers `use_more_bits` picks (Q6_K's), and the gate/up projections
    /// (rows of 2048) Q4_K; under Q5_K_M the fallback would be Q5_1, an error naming the
    /// tensor.
    #[test]
    fn rows_of_1408_fall_back_to_q5_0_under_q4_k_m() {
        let names: Vec<String> = (0..8)
            .map(|i| format!("blk.{i}.ffn_down_exps.weight"))
            .collect();
        let mut tensors: Vec<(&str, &[u64])> = names
            .iter()
            .map(|n| (n.as_str(), &[1408u64, 2048, 64][..]))
            .collect();
        tensors.push(("blk.0.ffn_gate_exps.weight", &[2048, 1408, 64]));
        let model = MixModel {
            experts: 64,
            layers: 8,
        };
        let (q5_0, q8, q4k) = (
            Some(Storage::Quant(QuantFormat::Q5_0)),
            Some(Storage::Quant(QuantFormat::Q8_0)),
            Some(Storage::Quant(QuantFormat::Q4K)),
        );
        // use_more_bits(i, 8): layers 0, 3, 6 and 7.
        assert_eq!(
            mix_types(Mix::Q4KM, model, &tensors).unwrap(),
            [q8, q5_0, q5_0, q8, q5_0, q5_0, q8, q8, q4k]
        );
        let err = mix_types(Mix::Q5KM, model, &tensors).unwrap_err();
        assert!(
            err.contains("tensor `blk.1.ffn_down_exps.weight`") && err.contains("(Q5_1)"),
            "{err}"
        );
    }
}
