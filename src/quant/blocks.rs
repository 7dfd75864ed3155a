//! Scalar decoders of one block of each format, from ggml's block layouts.
//!
//! Takes whole blocks; gives f32 weights in storage order. Each decoder is written from the
//! layout (field order and bit positions), not from ggml's loops, and follows ggml's
//! reference arithmetic exactly: the f16 scales widened to f32, per-sub-block scale and
//! min products formed first (`d * sc`, `dmin * m`), then `scale * q - min` as two
//! rounded f32 operations.

use super::{QuantError, QuantFormat, QK_K};
use half::f16;

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Decodes `bytes` (whole blocks of `format`) into `dst` (all their weights).
pub fn dequantize_blocks(
    format: QuantFormat,
    bytes: &[u8],
    dst: &mut [f32],
) -> Result<(), QuantError> {
    let (be, bb) = (format.block_elems(), format.block_bytes());
    if format.bytes_for(dst.len()) != Some(bytes.len()) {
        return Err(QuantError::Blocks {
            format,
            elems: dst.len(),
            block: be,
            bytes: bytes.len(),
        });
    }
    let decode: fn(&[u8], &mut [f32]) = match format {
        QuantFormat::Q4_0 => q4_0,
        QuantFormat::Q4_1 => q4_1,
        QuantFormat::Q5_0 => q5_0,
        QuantFormat::Q8_0 => q8_0,
        QuantFormat::Q4K => q4_k,
        QuantFormat::Q5K => q5_k,
        QuantFormat::Q6K => q6_k,
        QuantFormat::Mxfp4 => mxfp4,
    };
    for (block, out) in bytes.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
        decode(block, out);
    }
    Ok(())
}

/// Code `l` (0..32) of a Q4_0/Q4_1 block's 16 code bytes: weights 0..16 are the low
/// nibbles of bytes 0..16, weights 16..32 their high nibbles (not Q4_K's interleaving).
pub(crate) fn q4_code(qs: &[u8], l: usize) -> u8 {
    (qs[l % 16] >> (4 * (l / 16))) & 0x0f
}

/// `block_q4_0`: `d` (f16), then 16 code bytes; weight `l` = `d * (q_l - 8)`.
fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (l, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(q4_code(&b[2..18], l) as i8 - 8);
    }
}

/// `block_q4_1`: `d`, `m` (f16), then 16 code bytes; weight `l` = `d * q_l + m` (a
/// rounded product, then a rounded sum).
fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (l, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(q4_code(&b[4..20], l)) + m;
    }
}

/// Code `l` (0..32) of a Q5_0 block `b`: [`q4_code`] of its 16 code bytes (6..22) with
/// bit `l` of the little-endian `u32` `qh` (bytes 2..6) as its fifth bit.
pub(crate) fn q5_0_code(b: &[u8], l: usize) -> u8 {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    q4_code(&b[6..22], l) | ((((qh >> l) & 1) as u8) << 4)
}

/// `block_q5_0`: `d` (f16), `qh` (4 bytes of fifth bits), then 16 code bytes; weight `l`
/// = `d * (q_l - 16)` (ggml's `dequantize_row_q5_0`: an exact integer times `d`).
fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (l, o) in out.iter_mut().enumerate() {
        *o = (i32::from(q5_0_code(b, l)) - 16) as f32 * d;
    }
}

/// Twice the e2m1 value of each 4-bit code (ggml's `kvalues_mxfp4`): codes 0-7 are 0, 0.5,
/// 1, 1.5, 2, 3, 4, 6 and 8-15 their negatives, doubled so they are integers; the block
/// scale is halved to match ([`e8m0_half`]).
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the scale of e8m0 exponent `e`, `2^(e - 128)`, as ggml's `ggml_e8m0_to_fp32_half`
/// builds it from bits (`e` 0 and 1 give the subnormals 2^-128 and 2^-127).
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// `block_mxfp4`: the e8m0 exponent `e`, then 16 code bytes (Q4_0's nibble order); weight
/// `l` = `kvalues_mxfp4[q_l] * 2^(e - 128)`, exact (a product of small integers and a power
/// of two), so the same values transformers' `FP4_VALUES[q] * 2^(e - 127)` gives, but for
/// code 8 (ggml's +0 where transformers has -0).
fn mxfp4(b: &[u8], out: &mut [f32]) {
    let d = e8m0_half(b[0]);
    for (l, o) in out.iter_mut().enumerate() {
        *o = f32::from(KVALUES_MXFP4[usize::from(q4_code(&b[1..17], l))]) * d;
    }
}

/// `block_q8_0`: `d` (f16), then 32 `i8` codes; weight `i` = `d * q[i]`.
fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, q) in out.iter_mut().zip(&b[2..34]) {
        *o = d * f32::from(*q as i8);
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block, from its
/// 12 packed bytes `s`: bytes 0-3 hold the low 6 bits of scales 0-3 (their top 2 bits
/// carry bits 4-5 of scales 4-7), bytes 4-7 the same for mins 0-3 / mins 4-7, and bytes
/// 8-11 the low 4 bits of scale `4 + i` (low nibble) and min `4 + i` (high nibble).
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// `block_q4_K`: `d`, `dmin` (f16), 12 bytes of scales/mins, 128 bytes of codes. The
/// 256 weights are 8 sub-blocks of 32; sub-blocks `2i` and `2i + 1` share code bytes
/// `32i..32i + 32`, the even one in the low nibbles. Weight = `d*sc * q - dmin*m`.
fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..16 + QK_K / 2];
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        for (o, q) in sub.iter_mut().zip(bytes) {
            *o = scale * f32::from((q >> shift) & 0x0f) - min;
        }
    }
}

/// `block_q5_K`: `d`, `dmin`, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes
/// of low nibbles (laid out as Q4_K's). Weight `l` of sub-block `j` takes bit `j` of high
/// byte `l` as its fifth bit.
fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..48 + QK_K / 2];
    for (j, sub) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
        let low = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        for (l, o) in sub.iter_mut().enumerate() {
            let q = ((low[l] >> shift) & 0x0f) | (((qh[l] >> j) & 1) << 4);
            *o = scale * f32::from(q) - min;
        }
    }
}

/// `block_q6_K`: 128 bytes of low nibbles `ql`, 64 bytes of 2-bit high parts `qh`, 16
/// `i8` sub-block scales, `d` (f16). Each half of 128 weights uses 64 `ql` bytes, 32 `qh`
/// bytes and 8 scales: weight `32s + l` (quarter `s` 0..4, `l` 0..32) takes the low
/// (s < 2) or high (s >= 2) nibble of `ql[l + 32 (s % 2)]`, bits `2s..2s+2` of `qh[l]`
/// above it, minus 32, times `d * scale[2s + l / 16]`.
fn q6_k(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 208);
    for (half, hout) in out.chunks_exact_mut(128).enumerate() {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        for (s, quarter) in hout.chunks_exact_mut(32).enumerate() {
            for (l, o) in quarter.iter_mut().enumerate() {
                let low = (ql[l + 32 * (s % 2)] >> (4 * (s / 2))) & 0x0f;
                let high = (qh[l] >> (2 * s)) & 3;
                let q = i32::from(low | (high << 4)) - 32;
                let scale = f32::from(sc[2 * s + l / 16] as i8);
                *o = d * scale * q as f32;
            }
        }
    }
}

/// The 256 unsigned 6-bit codes of a Q6_K block in weight order (the bit positions of
/// the decoder above).
pub(crate) fn q6k_codes(w: &[u8], codes: &mut [u8; 256]) {
    for half in 0..2 {
        let ql = &w[64 * half..64 * half + 64];
        let qh = &w[128 + 32 * half..128 + 32 * half + 32];
        for s in 0..4 {
            for l in 0..32 {
                let low = (ql[l + 32 * (s % 2)] >> (4 * (s / 2))) & 0x0f;
                let high = (qh[l] >> (2 * s)) & 3;
                codes[128 * half + 32 * s + l] = low | (high << 4);
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    fn decode(format: QuantFormat, b: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; format.block_elems() * b.len() / format.block_bytes()];
        dequantize_blocks(format, b, &mut out).unwrap();
        out
    }

    #[test]
    fn block_sizes_are_ggmls() {
        // ggml-common.h's static_asserts: 18, 20, 22, 34, 144, 176, 210 and 17 bytes.
        let sizes: Vec<usize> = QuantFormat::ALL.iter().map(|f| f.block_bytes()).collect();
        assert_eq!(sizes, [18, 20, 22, 34, 144, 176, 210, 17]);
        assert_eq!(QuantFormat::Q4K.bytes_for(4096), Some(16 * 144));
        assert_eq!(QuantFormat::Q4K.bytes_for(100), None);
    }

    /// Q8_0 by hand: d = 0.5, codes 0, 1, -1, 127, -128 give 0, 0.5, -0.5, 63.5, -64.
    #[test]
    fn q8_0_by_hand() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16_bytes(0.5));
        b[2..7].copy_from_slice(&[0, 1, 0xff, 127, 0x80]);
        let out = decode(QuantFormat::Q8_0, &b);
        assert_eq!(&out[..5], &[0.0, 0.5, -0.5, 63.5, -64.0]);
        assert!(out[5..].iter().all(|v| *v == 0.0));
    }

    /// Q4_0 by hand: d = 0.25; byte 0 = 0xF0 (weight 0 code 0 -> -8 * 0.25 = -2, weight 16
    /// code 15 -> 7 * 0.25 = 1.75); byte 5 = 0x89 (weight 5 code 9 -> 0.25, weight 21 code
    /// 8 -> 0); code byte 0x88 elsewhere is zero.
    #[test]
    fn q4_0_by_hand() {
        let mut b = vec![0x88u8; 18];
        b[..2].copy_from_slice(&f16_bytes(0.25));
        b[2] = 0xF0;
        b[2 + 5] = 0x89;
        let out = decode(QuantFormat::Q4_0, &b);
        assert_eq!((out[0], out[16], out[5], out[21]), (-2.0, 1.75, 0.25, 0.0));
        assert_eq!(out.iter().filter(|v| **v != 0.0).count(), 3);
    }

    /// Q4_1 by hand: d = 0.5, m = -1; byte 0 = 0x3C (weight 0 code 12 -> 5, weight 16 code
    /// 3 -> 0.5); code 0 elsewhere is m = -1.
    #[test]
    fn q4_1_by_hand() {
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&f16_bytes(0.5));
        b[2..4].copy_from_slice(&f16_bytes(-1.0));
        b[4] = 0x3C;
        let out = decode(QuantFormat::Q4_1, &b);
        assert_eq!((out[0], out[16], out[1], out[31]), (5.0, 0.5, -1.0, -1.0));
    }

    /// MXFP4 by hand: e = 128 (half scale 1): byte 0 = 0x7F (weight 0 code 15 -> -12,
    /// weight 16 code 7 -> 12); e = 1 gives the subnormal 2^-127, e = 255 2^127.
    #[test]
    fn mxfp4_by_hand() {
        let mut b = vec![0u8; 17];
        b[0] = 128;
        b[1] = 0x7F;
        b[2] = 0x92;
        let out = decode(QuantFormat::Mxfp4, &b);
        assert_eq!((out[0], out[16], out[1], out[17]), (-12.0, 12.0, 2.0, -1.0));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(255), 2f32.powi(127));
    }

    /// Every code under a range of exponents decodes to transformers' value (its FP4 table
    /// times `2^(e - 127)`, `crate::quant::mxfp4::value`), so packed gpt-oss experts compute
    /// with the weights its bf16 decoding holds (the bf16 rounding is exact here: at most
    /// two significant bits); only transformers' -0 for code 8 reads as +0.
    #[test]
    fn mxfp4_values_are_transformers_fp4_table() {
        for e in (2u8..=250).step_by(8) {
            let mut b = vec![e; 17];
            for (j, byte) in b[1..].iter_mut().enumerate() {
                *byte = j as u8 | ((15 - j as u8) << 4);
            }
            let out = decode(QuantFormat::Mxfp4, &b);
            for (l, v) in out.iter().enumerate() {
                let code = if l < 16 { l as u8 } else { 31 - l as u8 };
                let want = crate::quant::mxfp4::value(code, e).to_f32();
                assert_eq!(*v, want, "e {e} code {code}");
            }
        }
    }

    /// A Q4_K block worked by hand from the layout. d = 1, dmin = 0.5.
    /// Scales bytes: s[0] = 0b01_000010 (scale 0 = 2, its top bits 01 are bits 4-5 of
    /// scale 4), s[4] = 3 (min 0 = 3), s[1] = 5 (scale 1 = 5), s[5] = 0b10_000001 (min 1 = 1;
    /// top bits 10 are bits 4-5 of min 5), s[8] = 0x97 (scale 4 low = 7, min 4 low = 9),
    /// s[9] = 0x21 (scale 5 low = 1, min 5 low = 2).
    /// So scale 4 = 7 | 1 << 4 = 23, min 4 = 9 (s[4] top bits 00); scale 5 = 1 (s[1] top
    /// bits 00), min 5 = 2 | 2 << 4 = 34.
    /// Code byte 0 = 0xA3: sub-block 0 weight 0 = 2*3 - 0.5*3 = 4.5, sub-block 1 weight 0
    /// = 5*10 - 0.5*1 = 49.5. Code byte 64 = 0x5C: sub-block 4 weight 0 = 23*12 - 0.5*9 =
    /// 271.5, sub-block 5 weight 0 = 1*5 - 0.5*34 = -12.
    #[test]
    fn q4_k_by_hand() {
        let mut b = vec![0u8; 144];
        b[..2].copy_from_slice(&f16_bytes(1.0));
        b[2..4].copy_from_slice(&f16_bytes(0.5));
        let s = &mut b[4..16];
        s[0] = 0b0100_0010;
        s[4] = 3;
        s[1] = 5;
        s[5] = 0b1000_0001;
        s[8] = 0x97;
        s[9] = 0x21;
        b[16] = 0xA3;
        b[16 + 64] = 0x5C;
        let out = decode(QuantFormat::Q4K, &b);
        assert_eq!(out[0], 4.5);
        assert_eq!(out[32], 49.5);
        assert_eq!(out[128], 271.5);
        assert_eq!(out[160], -12.0);
        // Code 0 elsewhere in those sub-blocks: just -dmin * min.
        assert_eq!(
            (out[1], out[33], out[129], out[161]),
            (-1.5, -0.5, -4.5, -17.0)
        );
        assert_eq!(scale_min_k4(4, &b[4..16]), (23, 9));
        assert_eq!(scale_min_k4(5, &b[4..16]), (1, 34));
    }

    /// Q5_K: the Q4_K block above with high byte 0 = 0b10 (bit 1: sub-block 1's weight 0
    /// gets +16) and high byte 3 = 0b1 (sub-block 0's weight 3). Low nibbles as Q4_K's.
    #[test]
    fn q5_k_by_hand() {
        let mut b = vec![0u8; 176];
        b[..2].copy_from_slice(&f16_bytes(1.0));
        b[2..4].copy_from_slice(&f16_bytes(0.5));
        b[4] = 2; // scale 0 = 2
        b[8] = 3; // min 0 = 3
        b[5] = 5; // scale 1 = 5
        b[9] = 1; // min 1 = 1
        b[16] = 0b10;
        b[16 + 3] = 0b1;
        b[48] = 0xA3;
        let out = decode(QuantFormat::Q5K, &b);
        assert_eq!(out[0], 2.0 * 3.0 - 1.5);
        assert_eq!(out[32], 5.0 * 26.0 - 0.5);
        assert_eq!(out[3], 2.0 * 16.0 - 1.5);
        assert_eq!(out[1], -1.5);
    }

    /// Q6_K: d = 0.25, scale 0 = 4, scale 2 = -2, scale 4 = 1, scale 9 = 3.
    /// ql[0] = 0x7A, ql[32] = 0x05, qh[0] = 0b11_01_10_00: weight 0 = (0xA | 0 << 4) - 32
    /// = -22 times 0.25*4 = -22; weight 32 = (5 | 2 << 4) - 32 = 5, times 0.25*-2 = -2.5;
    /// weight 64 = (7 | 1 << 4) - 32 = -9, times 0.25*1 = -2.25; weight 96 uses scale 6 = 0.
    /// Second half: ql[64 + 16] = 0x0F, qh[32 + 16] = 0b11 -> weight 128 + 16 = (15 | 3 << 4)
    /// - 32 = 31, scale index 8 + 0 + 16/16 = 9 -> 31 * 0.25 * 3 = 23.25.
    #[test]
    fn q6_k_by_hand() {
        let mut b = vec![0u8; 210];
        b[0] = 0x7A;
        b[32] = 0x05;
        b[128] = 0b1101_1000;
        b[64 + 16] = 0x0F;
        b[128 + 32 + 16] = 0b11;
        let sc = &mut b[192..208];
        sc[0] = 4;
        sc[2] = (-2i8) as u8;
        sc[4] = 1;
        sc[9] = 3;
        b[208..210].copy_from_slice(&f16_bytes(0.25));
        let out = decode(QuantFormat::Q6K, &b);
        assert_eq!(out[0], -22.0);
        assert_eq!(out[32], -2.5);
        assert_eq!(out[64], -2.25);
        assert_eq!(out[96], 0.0);
        assert_eq!(out[144], 23.25);
        // Code 0 is -32: weight 1 = -32 * 1.0.
        assert_eq!(out[1], -32.0);
    }

    #[test]
    fn partial_blocks_are_errors() {
        let mut out = vec![0.0; 256];
        assert!(dequantize_blocks(QuantFormat::Q4K, &[0; 143], &mut out).is_err());
        assert!(dequantize_blocks(QuantFormat::Q4K, &[0; 144], &mut out[..255]).is_err());
        assert!(dequantize_blocks(QuantFormat::Q8_0, &[0; 34 * 8], &mut out).is_ok());
    }

    fn hex_bytes(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    /// gguf-py's decoding of random blocks (`scripts/quant_golden.py`), as
    /// `(format, block bytes, weights)`.
    pub(in crate::quant) fn golden() -> Vec<(QuantFormat, Vec<u8>, Vec<f32>)> {
        let text = include_str!("../../tests/fixtures/quant/blocks.json");
        let json: serde_json::Value = serde_json::from_str(text).unwrap();
        json["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|case| {
                let format = QuantFormat::ALL
                    .into_iter()
                    .find(|f| f.name() == case["format"].as_str().unwrap())
                    .unwrap();
                let bits = hex_bytes(case["weights_f32_bits"].as_str().unwrap());
                let weights = bits
                    .chunks_exact(4)
                    .map(|b| f32::from_bits(u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
                    .collect();
                (format, hex_bytes(case["bytes"].as_str().unwrap()), weights)
            })
            .collect()
    }

    /// Bit-exact agreement with gguf-py, llama.cpp's own Python implementation of the
    /// formats, on random codes and scale bytes (every bit position exercised).
    #[test]
    fn random_blocks_decode_as_gguf_py_decodes_them() {
        let cases = golden();
        assert_eq!(cases.len(), QuantFormat::ALL.len());
        for (format, bytes, expected) in cases {
            let got = decode(format, &bytes);
            assert_eq!(got.len(), expected.len(), "{format}");
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert_eq!(g.to_bits(), e.to_bits(), "{format} weight {i}: {g} vs {e}");
            }
        }
    }

    /// Q4_K with the nibbles of a code byte taken in the wrong order (high nibble for the
    /// even sub-block): a plausible slip the golden test must catch.
    fn q4_k_swapped_nibbles(b: &[u8], out: &mut [f32]) {
        let mut fixed = b.to_vec();
        for q in &mut fixed[16..] {
            *q = q.rotate_left(4);
        }
        q4_k(&fixed, out);
    }

    /// Q4_K reading sub-blocks 4-7's scales without their two high bits (the 6-bit
    /// packing taken as plain 4-bit nibbles).
    fn q4_k_low_scale_bits_only(b: &[u8], out: &mut [f32]) {
        let mut fixed = b.to_vec();
        for s in &mut fixed[4..12] {
            *s &= 0x3f;
        }
        q4_k(&fixed, out);
    }

    /// Both broken decoders disagree with gguf-py on the golden blocks, so the golden test
    /// has the power to catch either mistake.
    #[test]
    fn broken_decoders_fail_the_golden_blocks() {
        type Decoder = fn(&[u8], &mut [f32]);
        let broken: [(&str, Decoder); 2] = [
            ("swapped nibbles", q4_k_swapped_nibbles),
            ("scale high bits dropped", q4_k_low_scale_bits_only),
        ];
        let (_, bytes, expected) = golden()
            .into_iter()
            .find(|(f, _, _)| *f == QuantFormat::Q4K)
            .unwrap();
        for (what, decoder) in broken {
            let mut got = vec![0.0; expected.len()];
            for (b, o) in bytes.chunks_exact(144).zip(got.chunks_exact_mut(256)) {
                decoder(b, o);
            }
            let wrong = got.iter().zip(&expected).filter(|(g, e)| g != e).count();
            assert!(wrong > 100, "{what}: only {wrong} of 768 weights differ");
        }
    }
}
