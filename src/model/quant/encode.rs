//! Quantisers: f32 weights into ggml blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), for
//! `moec quantize`.
//!
//! Takes rows of f32 weights whose length is whole blocks of the format; gives the blocks'
//! bytes in ggml's layout (the one [`super::blocks`] decodes). Guarantees: Q8_0 follows the
//! format's definition exactly (scale = the block's largest magnitude over 127, stored as
//! f16 rounded to nearest; codes rounded half away from zero), and Q4_0 and Q4_1 follow
//! round-to-nearest as ggml's `quantize_row_q4_0_ref`/`quantize_row_q4_1_ref` define it
//! (Q4_0: scale = the first value of largest magnitude over −8, codes `min(15, trunc(x /
//! d + 8.5))`; Q4_1: scale = range / 15, offset = the block minimum, codes `min(15,
//! trunc((x − min) / d + 0.5))`), so all three give llama-quantize's bytes for the same
//! f32 input. The K formats pick each sub-block's scale (and, for Q4_K
//! and Q5_K, its min) by least squares over the codes, refined a few rounds from the
//! sub-block's range, then round the sub-block scales to the super-block's 6- or 8-bit grid
//! and choose the final codes against the rounded scales, so the error the test bounds is
//! the one a reader sees. The search is moec's own, not ggml's `make_qkx2_quants`: its
//! bytes differ from llama-quantize's, its error is of the same size (the tests compare
//! both against the f32 weights). A length that is not whole blocks is an error.

use super::{QuantError, QuantFormat, QK_K};
use half::f16;

/// Quantises `src` (whole blocks of `format`) into a new byte vector of its blocks.
pub fn quantize_row(format: QuantFormat, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let Some(bytes) = format.bytes_for(src.len()) else {
        return Err(QuantError::Blocks {
            format,
            elems: src.len(),
            block: format.block_elems(),
            bytes: std::mem::size_of_val(src),
        });
    };
    let mut out = vec![0u8; bytes];
    let encode: fn(&[f32], &mut [u8]) = match format {
        QuantFormat::Q4_0 => q4_0,
        QuantFormat::Q4_1 => q4_1,
        QuantFormat::Q8_0 => q8_0,
        QuantFormat::Q4K => |x, b| kq_asym(x, b, 15),
        QuantFormat::Q5K => |x, b| kq_asym(x, b, 31),
        QuantFormat::Q6K => q6_k,
        QuantFormat::Mxfp4 => mxfp4,
    };
    for (x, b) in src
        .chunks_exact(format.block_elems())
        .zip(out.chunks_exact_mut(format.block_bytes()))
    {
        encode(x, b);
    }
    Ok(out)
}

/// f32 → f16 bits as stored (round to nearest even, what F16C's conversion does), and the
/// f32 the reader will widen them back to.
fn f16_store(v: f32) -> ([u8; 2], f32) {
    let h = f16::from_f32(v);
    (h.to_le_bytes(), h.to_f32())
}

fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_store(d).0);
    for (q, v) in b[2..34].iter_mut().zip(x) {
        // `f32::round` rounds half away from zero, as C's `roundf` does.
        *q = ((v * id).round() as i8) as u8;
    }
}

/// The 32 codes `q` (0..15, weight order) into a Q4_0/Q4_1 block's 16 code bytes: weight
/// `l < 16` in the low nibble of byte `l`, weight `16 + l` in its high nibble.
fn pack_q4(q: &[u8; 32], qs: &mut [u8]) {
    for (l, byte) in qs.iter_mut().enumerate() {
        *byte = q[l] | (q[l + 16] << 4);
    }
}

/// ggml's code of a scaled value: C's `(int8_t)` (truncation toward zero; `as` also
/// saturates what C leaves undefined, so a NaN gives 0), capped at 15 as `MIN(15, ..)`.
fn q4_trunc(v: f32) -> u8 {
    (v as i8).clamp(0, 15) as u8
}

fn q4_0(x: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_store(d).0);
    let mut q = [0u8; 32];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = q4_trunc(v * id + 8.5);
    }
    pack_q4(&q, &mut b[2..18]);
}

fn q4_1(x: &[f32], b: &mut [u8]) {
    let min = x.iter().fold(f32::MAX, |m, &v| if v < m { v } else { m });
    let max = x.iter().fold(-f32::MAX, |m, &v| if v > m { v } else { m });
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_store(d).0);
    b[2..4].copy_from_slice(&f16_store(min).0);
    let mut q = [0u8; 32];
    for (c, &v) in q.iter_mut().zip(x) {
        *c = q4_trunc((v - min) * id + 0.5);
    }
    pack_q4(&q, &mut b[4..20]);
}

/// MXFP4 as `quantize_row_mxfp4_ref`: exponent `e = floor(log2(amax)) - 2 + 127` (0 for an
/// all-zero block; `as u8` saturates what C leaves undefined), each code the first table
/// entry nearest to the weight under the half scale.
fn mxfp4(x: &[f32], b: &mut [u8]) {
    use super::blocks::{e8m0_half, KVALUES_MXFP4};
    let amax = x
        .iter()
        .fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m });
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0) as u8
    } else {
        0
    };
    let d = e8m0_half(e);
    b[0] = e;
    let mut q = [0u8; 32];
    for (c, &v) in q.iter_mut().zip(x) {
        let err = |i: usize| (f32::from(KVALUES_MXFP4[i]) * d - v).abs();
        let mut best = 0;
        for i in 1..16 {
            if err(i) < err(best) {
                best = i;
            }
        }
        *c = best as u8;
    }
    pack_q4(&q, &mut b[1..17]);
}

/// Least-squares fit of `x ≈ scale * q + offset` over the codes `q`, with `offset <= 0`
/// (the formats store `-offset` as an unsigned min). `None` when the codes are all equal.
fn fit_affine(x: &[f32], q: &[u8]) -> Option<(f32, f32)> {
    let n = x.len() as f32;
    let (mut sq, mut sqq, mut sx, mut sqx) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
    for (&v, &c) in x.iter().zip(q) {
        let c = f32::from(c);
        sq += c;
        sqq += c * c;
        sx += v;
        sqx += c * v;
    }
    let det = n * sqq - sq * sq;
    if det <= 0.0 {
        return None;
    }
    let scale = (n * sqx - sq * sx) / det;
    let offset = (sqq * sx - sq * sqx) / det;
    if offset <= 0.0 {
        Some((scale, offset))
    } else if sqq > 0.0 {
        Some((sqx / sqq, 0.0))
    } else {
        None
    }
}

fn codes_affine(x: &[f32], scale: f32, offset: f32, nmax: u8, q: &mut [u8]) {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (c, &v) in q.iter_mut().zip(x) {
        *c = ((v - offset) * inv).round().clamp(0.0, f32::from(nmax)) as u8;
    }
}

fn sq_err_affine(x: &[f32], q: &[u8], scale: f32, offset: f32) -> f32 {
    x.iter()
        .zip(q)
        .map(|(&v, &c)| {
            let e = scale * f32::from(c) + offset - v;
            e * e
        })
        .sum()
}

/// One sub-block's `(scale, min)` with `weight = scale * q - min`, `q` in `0..=nmax`.
fn sub_scale_min(x: &[f32], nmax: u8) -> (f32, f32) {
    let lo = x.iter().fold(0.0f32, |m, &v| m.min(v));
    let hi = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if hi <= lo {
        return (0.0, -lo);
    }
    let (mut scale, mut offset) = ((hi - lo) / f32::from(nmax), lo);
    let mut q = vec![0u8; x.len()];
    codes_affine(x, scale, offset, nmax, &mut q);
    let mut best = (sq_err_affine(x, &q, scale, offset), scale, offset);
    for _ in 0..6 {
        let Some((s, o)) = fit_affine(x, &q) else {
            break;
        };
        if s <= 0.0 {
            break;
        }
        (scale, offset) = (s, o);
        codes_affine(x, scale, offset, nmax, &mut q);
        let err = sq_err_affine(x, &q, scale, offset);
        if err < best.0 {
            best = (err, scale, offset);
        }
    }
    (best.1, -best.2)
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31): eight sub-blocks of 32, 6-bit scales and mins
/// under f16 `d` and `dmin`.
fn kq_asym(x: &[f32], b: &mut [u8], nmax: u8) {
    let subs: Vec<(f32, f32)> = x.chunks_exact(32).map(|s| sub_scale_min(s, nmax)).collect();
    let max_scale = subs.iter().fold(0.0f32, |m, s| m.max(s.0));
    let max_min = subs.iter().fold(0.0f32, |m, s| m.max(s.1));
    let (d_bytes, d) = f16_store(max_scale / 63.0);
    let (dmin_bytes, dmin) = f16_store(max_min / 63.0);
    let grid = |v: f32, step: f32| -> u8 {
        if step > 0.0 {
            (v / step).round().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let ls: Vec<u8> = subs.iter().map(|s| grid(s.0, d)).collect();
    let lm: Vec<u8> = subs.iter().map(|s| grid(s.1, dmin)).collect();
    b[..2].copy_from_slice(&d_bytes);
    b[2..4].copy_from_slice(&dmin_bytes);
    let s = &mut b[4..16];
    for j in 0..4 {
        s[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        s[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
        s[j + 8] = (ls[j + 4] & 0x0f) | ((lm[j + 4] & 0x0f) << 4);
    }
    let mut q = [0u8; QK_K];
    for (j, (sub, codes)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        // The reader forms `d * sc` and `dmin * m` as rounded f32 products: choose codes
        // against exactly those.
        let scale = d * f32::from(ls[j]);
        let min = dmin * f32::from(lm[j]);
        codes_affine(sub, scale, -min, nmax, codes);
    }
    let (qh, qs) = if nmax == 15 {
        (None, &mut b[16..16 + QK_K / 2])
    } else {
        let (qh, qs) = b[16..16 + QK_K / 8 + QK_K / 2].split_at_mut(QK_K / 8);
        qh.fill(0);
        (Some(qh), qs)
    };
    for i in 0..4 {
        for l in 0..32 {
            let (even, odd) = (q[64 * i + l], q[64 * i + 32 + l]);
            qs[32 * i + l] = (even & 0x0f) | ((odd & 0x0f) << 4);
        }
    }
    if let Some(qh) = qh {
        for (j, codes) in q.chunks_exact(32).enumerate() {
            for (l, &c) in codes.iter().enumerate() {
                qh[l] |= ((c >> 4) & 1) << j;
            }
        }
    }
}

/// One Q6_K sub-block's signed scale, `weight = scale * q`, `q` in `-32..=31`.
fn sub_scale_sym(x: &[f32]) -> f32 {
    let peak = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    if peak == 0.0 {
        return 0.0;
    }
    // The largest magnitude maps to -32, the one end the codes reach at full size.
    let mut scale = peak / -32.0;
    let codes = |scale: f32| -> Vec<f32> {
        x.iter()
            .map(|&v| (v / scale).round().clamp(-32.0, 31.0))
            .collect()
    };
    let err = |scale: f32, q: &[f32]| -> f32 {
        x.iter()
            .zip(q)
            .map(|(&v, &c)| (scale * c - v) * (scale * c - v))
            .sum()
    };
    let mut q = codes(scale);
    let mut best = (err(scale, &q), scale);
    for _ in 0..6 {
        let (sxq, sqq) = x
            .iter()
            .zip(&q)
            .fold((0.0f32, 0.0f32), |(a, b), (&v, &c)| (a + v * c, b + c * c));
        if sqq == 0.0 {
            break;
        }
        scale = sxq / sqq;
        if scale == 0.0 {
            break;
        }
        q = codes(scale);
        let e = err(scale, &q);
        if e < best.0 {
            best = (e, scale);
        }
    }
    best.1
}

/// Q6_K: sixteen sub-blocks of 16, signed 8-bit scales under an f16 `d`.
fn q6_k(x: &[f32], b: &mut [u8]) {
    let subs: Vec<f32> = x.chunks_exact(16).map(sub_scale_sym).collect();
    let peak = subs
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let (d_bytes, d) = f16_store(peak / -128.0);
    let ls: Vec<i8> = subs
        .iter()
        .map(|&s| {
            if d != 0.0 {
                (s / d).round().clamp(-128.0, 127.0) as i8
            } else {
                0
            }
        })
        .collect();
    let mut q = [0u8; QK_K];
    for (j, (sub, codes)) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)).enumerate() {
        let scale = d * f32::from(ls[j]);
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for (c, &v) in codes.iter_mut().zip(sub) {
            *c = ((v * inv).round().clamp(-32.0, 31.0) + 32.0) as u8;
        }
    }
    b.fill(0);
    for half in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let c = q[128 * half + 32 * s + l];
                b[64 * half + l + 32 * (s % 2)] |= (c & 0x0f) << (4 * (s / 2));
                b[128 + 32 * half + l] |= ((c >> 4) & 3) << (2 * s);
            }
        }
        for k in 0..8 {
            b[192 + 8 * half + k] = ls[8 * half + k] as u8;
        }
    }
    b[208..210].copy_from_slice(&d_bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::dequantize_blocks;

    /// Deterministic weights shaped like a trained matrix's rows: mostly small, a few
    /// large, some sub-blocks all positive (where the min is 0).
    fn weights(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
                let spike = if i % 97 == 0 { 8.0 } else { 1.0 };
                let shift = if (i / 32) % 5 == 3 { 0.6 } else { 0.0 };
                u * 0.1 * spike + shift * 0.1
            })
            .collect()
    }

    fn roundtrip(format: QuantFormat, x: &[f32]) -> Vec<f32> {
        let b = quantize_row(format, x).unwrap();
        assert_eq!(b.len(), format.bytes_for(x.len()).unwrap());
        let mut out = vec![0.0; x.len()];
        dequantize_blocks(format, &b, &mut out).unwrap();
        out
    }

    /// The error of each format against the f32 weights, relative to their RMS, is within
    /// what its code width allows: a uniform quantiser with step `range / (2^bits - 1)` has
    /// RMS error `step / sqrt(12)`; over this data (RMS ≈ 0.04, sub-block ranges ≈ 0.1 and
    /// up to 0.8 where a spike falls) the bounds below leave about 2x headroom over that.
    #[test]
    fn each_format_reconstructs_within_its_code_width() {
        let x = weights(4 * QK_K, 7);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        for (format, bound) in [
            (QuantFormat::Q8_0, 0.01),
            (QuantFormat::Q4_0, 0.25),
            (QuantFormat::Q4_1, 0.2),
            (QuantFormat::Mxfp4, 0.3),
            (QuantFormat::Q6K, 0.04),
            (QuantFormat::Q5K, 0.08),
            (QuantFormat::Q4K, 0.16),
        ] {
            let y = roundtrip(format, &x);
            let err = (x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                / x.len() as f32)
                .sqrt();
            assert!(
                err / rms < bound,
                "{format}: relative RMS error {} over {bound}",
                err / rms
            );
        }
    }

    #[test]
    fn q8_0_is_the_formats_definition_worked_by_hand() {
        // amax 1.27 -> d = 0.01 (f16 0.01000213...), codes round(x / d).
        let mut x = [0.0f32; 32];
        x[0] = 1.27;
        x[1] = -0.635;
        x[2] = 0.004;
        let b = quantize_row(QuantFormat::Q8_0, &x).unwrap();
        let d = f16::from_f32(0.01).to_f32();
        assert_eq!(&b[..2], &f16::from_f32(0.01).to_le_bytes());
        assert_eq!(b[2] as i8, 127);
        assert_eq!(b[3] as i8, (-0.635f32 * (1.0 / 0.01f32)).round() as i8);
        assert_eq!(b[4] as i8, 0);
        assert!((d * 127.0 - 1.27).abs() < 1e-3);
    }

    /// Q4_0 worked by hand from `quantize_row_q4_0_ref`: the first value of largest
    /// magnitude is -0.8 (ahead of +0.8), so d = 0.1 and id = 10; -0.8 -> trunc(0.5) = 0,
    /// +0.8 -> trunc(16.5) capped at 15, 0.26 -> trunc(11.1) = 11, 0 -> 8.
    #[test]
    fn q4_0_is_the_reference_rounding_worked_by_hand() {
        let mut x = [0.0f32; 32];
        x[0] = -0.8;
        x[17] = 0.8;
        x[3] = 0.26;
        let b = quantize_row(QuantFormat::Q4_0, &x).unwrap();
        assert_eq!(&b[..2], &f16::from_f32(-0.8f32 / -8.0).to_le_bytes());
        assert_eq!(b[2], 0x80, "weight 0 code 0, weight 16 code 8");
        assert_eq!(b[3], 8 | (15 << 4), "weight 1 code 8, weight 17 code 15");
        assert_eq!(b[5], 11 | (8 << 4));
    }

    /// Q4_1 by hand: min -0.5, max 1.0, d = 0.1, id = 10; -0.5 -> 0, 1.0 -> 15,
    /// 0.14 -> trunc(6.9) = 6, 0.16 -> trunc(7.1) = 7.
    #[test]
    fn q4_1_is_the_reference_rounding_worked_by_hand() {
        let mut x = [0.0f32; 32];
        x[0] = -0.5;
        x[16] = 1.0;
        x[1] = 0.14;
        x[2] = 0.16;
        let b = quantize_row(QuantFormat::Q4_1, &x).unwrap();
        assert_eq!(&b[..2], &f16::from_f32(1.5f32 / 15.0).to_le_bytes());
        assert_eq!(&b[2..4], &f16::from_f32(-0.5).to_le_bytes());
        assert_eq!((b[4], b[5] & 0x0f, b[6] & 0x0f), (15 << 4, 6, 7));
        // Zeros elsewhere: (0 + 0.5) * 10 + 0.5 = 5.5 -> 5.
        assert_eq!(b[7], 5 | (5 << 4));
    }

    #[test]
    fn constant_and_zero_blocks_encode_exactly() {
        for format in QuantFormat::ALL {
            let zero = vec![0.0f32; format.block_elems()];
            assert_eq!(roundtrip(format, &zero), zero, "{format}");
        }
        let neg = vec![-0.5f32; QK_K];
        let y = roundtrip(QuantFormat::Q4K, &neg);
        assert!(y.iter().all(|v| (v + 0.5).abs() < 1e-3), "{:?}", &y[..4]);
    }

    #[test]
    fn a_length_that_is_not_whole_blocks_is_an_error() {
        assert!(quantize_row(QuantFormat::Q4K, &[0.0; 100]).is_err());
        assert!(quantize_row(QuantFormat::Q8_0, &[0.0; 33]).is_err());
    }
}
