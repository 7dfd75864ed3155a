//! MXFP4 expert weights (gpt-oss Hub checkpoints): repacked into ggml's blocks, or
//! dequantized to bf16.
//!
//! Takes the two u8 tensors the Hub stores per expert projection: `*_blocks`
//! `[experts, out, in/32, 16]` (two e2m1 4-bit codes per byte, low nibble first) and
//! `*_scales` `[experts, out, in/32]` (e8m0 exponents, scale `2^(s - 127)` shared by 32
//! weights). [`repack_ggml`] gives ggml's `block_mxfp4` rows `[experts * out, in]`, what
//! the checkpoint reader keeps (the experts stay MXFP4 everywhere in moec).
//! [`dequantize_into`] gives the bf16 tensor `[experts, in, out]` that a bf16 gpt-oss
//! checkpoint stores under the projection's own name (`gate_up_proj`, `down_proj`), the
//! reference the repacked blocks are tested against; it
//! guarantees the bytes transformers' `convert_moe_packed_tensors` produces
//! (`integrations/mxfp4.py`): its FP4 table, `ldexp` by the exponent computed exactly (an
//! exponent of 255 is `2^128`, not NaN; a product past bf16's range is infinite), and its
//! final `transpose(1, 2)`. A bf16 gpt-oss tensor keeps gate and up interleaved along its
//! last dimension, and so do the blocks' rows, so no de-interleaving happens here.

use half::bf16;

/// Weights that share one e8m0 scale (one block of 16 bytes).
pub const BLOCK: usize = 32;

/// Bytes per block: two 4-bit codes a byte.
pub const BLOCK_BYTES: usize = BLOCK / 2;

/// The e2m1 value of each 4-bit code, as transformers' `FP4_VALUES` lists them: codes 0-7
/// are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same with the sign bit set.
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Shapes of the MXFP4 pair that holds a bf16 expert tensor `[experts, inputs, outputs]`:
/// `(blocks, scales)`. `inputs` must be a multiple of [`BLOCK`] (config reading checks).
pub fn packed_shapes(experts: usize, inputs: usize, outputs: usize) -> (Vec<usize>, Vec<usize>) {
    let groups = inputs / BLOCK;
    (
        vec![experts, outputs, groups, BLOCK_BYTES],
        vec![experts, outputs, groups],
    )
}

/// The bf16 value of code `code` (low four bits used) under e8m0 exponent `scale`,
/// rounded once from the exact product as `torch.ldexp` in bf16 does.
pub fn value(code: u8, scale: u8) -> bf16 {
    let exact = f64::from(FP4_VALUES[usize::from(code & 0x0f)]) * 2f64.powi(i32::from(scale) - 127);
    bf16::from_f64(exact)
}

/// Dequantizes the pair `blocks` / `scales` of shapes [`packed_shapes`]`(experts, inputs,
/// outputs)` into `out`, the little-endian bf16 bytes of `[experts, inputs, outputs]`.
/// Returns `None` (writing nothing) when a length disagrees with the shapes, so a caller's
/// bad slice is an error, never a panic.
pub fn dequantize_into(
    blocks: &[u8],
    scales: &[u8],
    experts: usize,
    inputs: usize,
    outputs: usize,
    out: &mut [u8],
) -> Option<()> {
    let groups = inputs / BLOCK;
    let scale_count = experts.checked_mul(outputs)?.checked_mul(groups)?;
    if groups * BLOCK != inputs
        || scales.len() != scale_count
        || blocks.len() != scale_count.checked_mul(BLOCK_BYTES)?
        || out.len() != scale_count.checked_mul(BLOCK)?.checked_mul(2)?
    {
        return None;
    }
    // Each scale's 256 possible products of the 16 codes, built once per scale value met:
    // a table lookup per byte instead of a float multiply per weight.
    let mut table: Vec<Option<[[u8; 2]; 16]>> = vec![None; 256];
    for (row, (scale, block)) in scales
        .iter()
        .zip(blocks.chunks_exact(BLOCK_BYTES))
        .enumerate()
    {
        let values = table[usize::from(*scale)].get_or_insert_with(|| {
            std::array::from_fn(|code| value(code as u8, *scale).to_le_bytes())
        });
        // `row` walks `[expert, output, group]`; the output tensor is `[expert, input,
        // output]` with input = group * 32 + position in the block (transformers'
        // transpose of its `[expert, output, input]` intermediate).
        let group = row % groups;
        let output = (row / groups) % outputs;
        let expert = row / (groups * outputs);
        for (pair, byte) in block.iter().enumerate() {
            for (half, code) in [byte & 0x0f, byte >> 4].into_iter().enumerate() {
                let input = group * BLOCK + 2 * pair + half;
                let at = 2 * ((expert * inputs + input) * outputs + output);
                out[at..at + 2].copy_from_slice(&values[usize::from(code)]);
            }
        }
    }
    Some(())
}

/// Repacks the pair `blocks` / `scales` of shapes [`packed_shapes`]`(experts, inputs,
/// outputs)` into ggml's `block_mxfp4` order ([`crate::quant::QuantFormat::Mxfp4`]):
/// a matrix `[experts * outputs, inputs]` stored out-in, each row `inputs / 32` blocks of
/// the exponent byte then 16 code bytes. The Hub packs weights `2j` and `2j + 1` of a block
/// into byte `j` (low nibble first); ggml packs weight `l` and `l + 16` into byte `l`, so
/// only the nibbles move: the values are the same codes under the same exponents (and
/// decode to transformers' values, `quant::blocks`' tests). `None` when a length disagrees
/// with the shapes.
pub fn repack_ggml(
    blocks: &[u8],
    scales: &[u8],
    experts: usize,
    inputs: usize,
    outputs: usize,
) -> Option<Vec<u8>> {
    let groups = inputs / BLOCK;
    let scale_count = experts.checked_mul(outputs)?.checked_mul(groups)?;
    if groups * BLOCK != inputs
        || scales.len() != scale_count
        || blocks.len() != scale_count.checked_mul(BLOCK_BYTES)?
    {
        return None;
    }
    let mut out = Vec::with_capacity(scale_count * (1 + BLOCK_BYTES));
    for (scale, hub) in scales.iter().zip(blocks.chunks_exact(BLOCK_BYTES)) {
        let code = |w: usize| (hub[w / 2] >> (4 * (w % 2))) & 0x0f;
        out.push(*scale);
        out.extend((0..BLOCK_BYTES).map(|l| code(l) | (code(l + BLOCK_BYTES) << 4)));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Repacked blocks decoded by moec's MXFP4 decoder (ggml's arithmetic, checked against
    /// gguf-py) hold, row `expert * outputs + output`, the values transformers' decoding
    /// (`dequantize_into`) puts at `[expert, input, output]`.
    #[test]
    fn repacked_blocks_decode_to_transformers_values() {
        use crate::quant::{dequantize_blocks, QuantFormat};
        let (experts, inputs, outputs) = (2, 64, 3);
        let mut rng = crate::rng::Rng::new(39);
        let (bs, ss) = packed_shapes(experts, inputs, outputs);
        let blocks: Vec<u8> = (0..bs.iter().product::<usize>())
            .map(|_| (rng.next_u64() >> 56) as u8)
            .collect();
        let scales: Vec<u8> = (0..ss.iter().product::<usize>())
            .map(|_| 110 + (rng.next_u64() % 30) as u8)
            .collect();
        let ggml = repack_ggml(&blocks, &scales, experts, inputs, outputs).unwrap();
        assert_eq!(
            Some(ggml.len()),
            QuantFormat::Mxfp4.bytes_for(experts * inputs * outputs)
        );
        let mut got = vec![0.0f32; experts * outputs * inputs];
        dequantize_blocks(QuantFormat::Mxfp4, &ggml, &mut got).unwrap();
        let mut want = vec![0u8; experts * inputs * outputs * 2];
        dequantize_into(&blocks, &scales, experts, inputs, outputs, &mut want).unwrap();
        for e in 0..experts {
            for i in 0..inputs {
                for o in 0..outputs {
                    let at = 2 * ((e * inputs + i) * outputs + o);
                    let w = bf16::from_le_bytes([want[at], want[at + 1]]).to_f32();
                    assert_eq!(got[(e * outputs + o) * inputs + i], w, "[{e}, {i}, {o}]");
                }
            }
        }
        assert!(repack_ggml(&blocks[1..], &scales, experts, inputs, outputs).is_none());
    }

    /// Hand-worked bytes against transformers' table (values also printed by
    /// `convert_moe_packed_tensors` on the same bytes with torch 2.x): byte 0x21 under scale
    /// 128 (x2) is code 1 (0.5) then code 2 (1.0), so 1.0 then 2.0; 0xF9 is code 9 (-0.5)
    /// then 15 (-6): -1, -12; 0x7E is code 14 (-4) then 7 (6): -8, 12. Under scale 125
    /// (x1/4), 0x83 is 1.5/4 then -0.0, and byte 15 = 0x5C is -2/4, 3/4 at inputs 30, 31.
    #[test]
    fn hand_worked_bytes_match_transformers_table_and_orientation() {
        let mut blocks = [0u8; 2 * BLOCK_BYTES];
        blocks[..3].copy_from_slice(&[0x21, 0xF9, 0x7E]);
        blocks[BLOCK_BYTES] = 0x83;
        blocks[2 * BLOCK_BYTES - 1] = 0x5C;
        let scales = [128u8, 125];
        // One expert, two outputs, 32 inputs: the result is `[32 inputs, 2 outputs]`.
        let mut out = vec![0u8; 32 * 2 * 2];
        dequantize_into(&blocks, &scales, 1, 32, 2, &mut out).unwrap();
        let at = |input: usize, output: usize| {
            let i = 2 * (input * 2 + output);
            bf16::from_le_bytes([out[i], out[i + 1]]).to_f32()
        };
        let first_output: Vec<f32> = (0..6).map(|i| at(i, 0)).collect();
        assert_eq!(first_output, [1.0, 2.0, -1.0, -12.0, -8.0, 12.0]);
        assert_eq!((at(0, 1), at(1, 1)), (0.375, 0.0));
        assert!(at(1, 1).is_sign_negative(), "code 8 is -0.0");
        assert_eq!((at(30, 1), at(31, 1)), (-0.5, 0.75));
        assert_eq!(at(29, 0), 0.0);
    }

    /// The scale's extremes as transformers computes them: exponent 0 gives subnormal bf16
    /// (0.5 * 2^-127 = 2^-128), 255 is 2^128 (no NaN), products past bf16 are infinite.
    #[test]
    fn extreme_scales_follow_exact_ldexp() {
        assert_eq!(value(1, 0).to_f64(), 2f64.powi(-128));
        assert_eq!(value(7, 0).to_f64(), 6.0 * 2f64.powi(-127));
        assert_eq!(value(1, 127).to_f32(), 0.5);
        assert_eq!(value(1, 254).to_f64(), 2f64.powi(126));
        assert_eq!(value(1, 255).to_f64(), 2f64.powi(127));
        assert!(value(7, 254).to_f32().is_infinite());
        assert_eq!(value(0, 255).to_f32(), 0.0);
    }

    #[test]
    fn lengths_that_disagree_with_the_shapes_are_refused() {
        let mut out = vec![0u8; 128];
        assert!(dequantize_into(&[0; 16], &[127], 1, 32, 1, &mut out[..64]).is_some());
        assert!(dequantize_into(&[0; 15], &[127], 1, 32, 1, &mut out[..64]).is_none());
        assert!(dequantize_into(&[0; 16], &[127], 1, 32, 1, &mut out).is_none());
        assert!(dequantize_into(&[0; 16], &[127], 1, 33, 1, &mut out[..66]).is_none());
    }
}
