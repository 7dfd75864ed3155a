//! Quantisers: f32 weights into ggml blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), for
//! `moec quantize`.
//!
//! Takes rows of f32 weights whose length is whole blocks of the format; gives the blocks'
//! bytes in ggml's layout (the one [`super::blocks`] decodes). Guarantees: Q8_0 follows the
//! format's definition exactly (scale = the block's largest magnitude over 127, stored as
//! f16 rounded to nearest; codes rounded half away from zero), and Q4_0 and Q4_1 follow
//! round-to-nearest as ggml's `quantize_row_q4_0_ref`/`quantize_row_q4_1_ref` define it
//! (Q4_0: scale = the first value of largest magnitude over −8, codes `min(15, trunc(x /
//! d + 8.5))`; Q5_0 the same with −16, 16.5 and 31 (`quantize_row_q5_0_ref`, checked against
//! ggml's bytes); Q4_1: scale = range / 15, offset = the block minimum, codes `min(15,
//! trunc((x − min) / d + 0.5))`), so all three give llama-quantize's bytes for the same
//! f32 input. The K formats follow ggml's reference quantisers as llama-quantize runs them
//! without an importance matrix (`quantize_row_q{4,5,6}_K_ref`): the same searches
//! (`make_qkx2_quants` for Q4_K/Q5_K sub-block scales and mins, `make_qx_quants` for
//! Q6_K's signed scales), ggml's round-half-to-even `nearest_int`, and every sum in ggml's
//! order with f32 operations, so they too give llama-quantize's bytes (checked against
//! ggml's own output in the tests). moec's earlier least-squares search is gone: its RMS
//! error was 3-5% above ggml's on the tiny Mixtral's weights. A length that is not whole
//! blocks is an error.

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
        QuantFormat::Q5_0 => q5_0,
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

/// ggml's `quantize_row_q5_0_ref`: scale = the first value of largest magnitude over −16,
/// codes `min(31, trunc(x / d + 16.5))` (as Q4_0's, one bit wider), the low nibbles packed
/// as Q4_0's and each code's fifth bit at bit `l` of the little-endian `u32` `qh`.
fn q5_0(x: &[f32], b: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&f16_store(d).0);
    let mut q = [0u8; 32];
    let mut qh = 0u32;
    for (l, (c, &v)) in q.iter_mut().zip(x).enumerate() {
        // C's `(int8_t)` truncation, capped as `MIN(31, ..)`; `v * id` lies in [-16, 16].
        let code = ((v * id + 16.5) as i8).clamp(0, 31) as u8;
        qh |= u32::from(code >> 4) << l;
        *c = code & 0x0f;
    }
    b[2..6].copy_from_slice(&qh.to_le_bytes());
    pack_q4(&q, &mut b[6..22]);
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

/// ggml's `nearest_int`: the float's integer part after adding 1.5 * 2^23, read from
/// its mantissa bits. That rounds half to even (not away from zero, as `f32::round`);
/// for magnitudes past 2^22, where ggml's assert is compiled out, it gives ggml's same
/// wrapped value, so even those weights encode as llama-quantize encodes them.
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below it is all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The scratch of one [`fit_scale_min`] search.
struct AffineFit {
    /// Codes of the best fit, `0..=nmax`.
    codes: [u8; 32],
    /// `weight ≈ scale * code - min`.
    scale: f32,
    min: f32,
}

/// ggml's `make_qkx2_quants` for one sub-block of 32: the `(scale, min)` of `weight ≈
/// scale * code - min`, codes in `0..=nmax`, `min >= 0`, that minimises the
/// `weights`-weighted squared error over `1 + nstep` candidate code grids (the range
/// split into `nmax + rmin + k * rdelta` steps); each candidate's scale and min are its
/// codes' weighted least-squares fit (scale alone, through zero, where the fitted min
/// would be positive). The start, the range split in `nmax` steps, wins ties. Every sum
/// runs in ggml's order with ggml's f32 operations, so the result is the same to the bit.
fn fit_scale_min(
    x: &[f32],
    weights: &[f32],
    nmax: u8,
    rmin: f32,
    rdelta: f32,
    nstep: u32,
) -> AffineFit {
    let n = f32::from(nmax);
    let mut codes = [0u8; 32];
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
        sum_w += w;
        sum_x += w * v;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        return AffineFit {
            codes,
            scale: 0.0,
            min: -min,
        };
    }
    // `min` is the best fit's so far: ggml's later grids start from it, as here.
    let code =
        |iscale: f32, v: f32, min: f32| nearest_int(iscale * (v - min)).clamp(0, i32::from(nmax));
    let err = |scale: f32, offset: f32, codes: &[u8]| -> f32 {
        let mut e = 0.0f32;
        for ((&v, &w), &c) in x.iter().zip(weights).zip(codes) {
            let diff = scale * f32::from(c) + offset - v;
            e += w * (diff * diff);
        }
        e
    };
    let iscale = n / (max - min);
    let mut scale = 1.0 / iscale;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = code(iscale, v, min) as u8;
    }
    let mut best = err(scale, min, &codes);
    let mut trial = [0u8; 32];
    for step in 0..=nstep {
        let iscale = (rmin + rdelta * step as f32 + n) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for ((t, &v), &w) in trial.iter_mut().zip(x).zip(weights) {
            let l = code(iscale, v, min);
            *t = l as u8;
            let l = l as f32;
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let e = err(this_scale, this_min, &trial);
            if e < best {
                codes = trial;
                best = e;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    AffineFit {
        codes,
        scale,
        min: -min,
    }
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31) as `quantize_row_q4_K_ref` /
/// `quantize_row_q5_K_ref` (llama-quantize without an importance matrix): each sub-block
/// of 32 fitted by [`fit_scale_min`] under weights `rms + |x|` (search `-1 + 0.1k`,
/// k ≤ 20, for Q4_K; `-0.5 + 0.1k`, k ≤ 15, for Q5_K), the scales and mins put on the
/// super-block's 6-bit grids (`d = max scale / 63`, `dmin = max min / 63`, f16), then
/// each weight's code chosen again against the rounded `d * sc` and `dmin * m` (a
/// sub-block whose rounded scale is 0 keeps its fitted codes).
fn kq_asym(x: &[f32], b: &mut [u8], nmax: u8) {
    let (rmin, nstep) = if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) };
    let mut q = [0u8; QK_K];
    let mut fits = [(0.0f32, 0.0f32); QK_K / 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for ((sub, codes), fit) in x
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .zip(fits.iter_mut())
    {
        let mut sum_x2 = 0.0f32;
        for &v in sub {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0.0f32; 32];
        for (w, &v) in weights.iter_mut().zip(sub) {
            *w = av_x + v.abs();
        }
        let f = fit_scale_min(sub, &weights, nmax, rmin, 0.1, nstep);
        codes.copy_from_slice(&f.codes);
        *fit = (f.scale, f.min);
        if f.scale > max_scale {
            max_scale = f.scale;
        }
        if f.min > max_min {
            max_min = f.min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    // `(uint8_t)nearest_int(..)` then `MIN(63, ..)`: C's conversion wraps, as `as u8` does.
    let ls: Vec<u8> = fits
        .iter()
        .map(|f| (nearest_int(inv_scale * f.0) as u8).min(63))
        .collect();
    let lm: Vec<u8> = fits
        .iter()
        .map(|f| (nearest_int(inv_min * f.1) as u8).min(63))
        .collect();
    let (d_bytes, d) = f16_store(max_scale / 63.0);
    let (dmin_bytes, dmin) = f16_store(max_min / 63.0);
    b[..2].copy_from_slice(&d_bytes);
    b[2..4].copy_from_slice(&dmin_bytes);
    let s = &mut b[4..16];
    for j in 0..4 {
        s[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        s[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
        s[j + 8] = (ls[j + 4] & 0x0f) | ((lm[j + 4] & 0x0f) << 4);
    }
    for (j, (sub, codes)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let scale = d * f32::from(ls[j]);
        if scale == 0.0 {
            continue;
        }
        let min = dmin * f32::from(lm[j]);
        for (c, &v) in codes.iter_mut().zip(sub) {
            *c = nearest_int((v + min) / scale).clamp(0, i32::from(nmax)) as u8;
        }
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

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights, for `nmax` 32
/// (Q6_K's sub-blocks of 16): the signed scale of `weight ≈ scale * code`, codes in
/// `-32..=31` (returned offset by 32), chosen among the grids that map the largest
/// magnitude to `-(32 + 0.1k)`, `|k| <= 9`, by the `x²`-weighted least-squares fit's
/// gain `(Σ w x l)² / Σ w l²`; the start (k = 0) wins ties.
fn fit_scale_sym(x: &[f32], codes: &mut [u8]) -> f32 {
    const NMAX: i32 = 32;
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-NMAX, NMAX - 1);
    let sums = |iscale: f32| -> (f32, f32) {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = code(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let fill = |iscale: f32, codes: &mut [u8]| {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = (code(iscale, v) + NMAX) as u8;
        }
    };
    let iscale = -(NMAX as f32) / max;
    fill(iscale, codes);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for k in (-9..=9).filter(|&k| k != 0) {
        let iscale = -(NMAX as f32 + 0.1 * k as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            fill(iscale, codes);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K as `quantize_row_q6_K_ref`: each sub-block of 16 fitted by [`fit_scale_sym`],
/// the scales put on a signed 8-bit grid whose `-128` is the scale of largest magnitude
/// (`d`, f16), each code chosen again against the rounded `d * sc` (a sub-block whose
/// rounded scale is 0 keeps its fitted codes); a block whose scales are all below
/// `GROUP_MAX_EPS` is all zero bytes.
fn q6_k(x: &[f32], b: &mut [u8]) {
    let mut q = [0u8; QK_K];
    let mut scales = [0.0f32; QK_K / 16];
    let (mut max_scale, mut max_abs) = (0.0f32, 0.0f32);
    for ((sub, codes), s) in x
        .chunks_exact(16)
        .zip(q.chunks_exact_mut(16))
        .zip(scales.iter_mut())
    {
        *s = fit_scale_sym(sub, codes);
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = *s;
        }
    }
    b.fill(0);
    if max_abs < GROUP_MAX_EPS {
        return;
    }
    let iscale = -128.0 / max_scale;
    let (d_bytes, d) = f16_store(1.0 / iscale);
    // `MIN(127, nearest_int(..))` stored in an `int8_t`: C's conversion wraps, as `as i8`.
    let ls: Vec<i8> = scales
        .iter()
        .map(|&s| nearest_int(iscale * s).min(127) as i8)
        .collect();
    for (j, (sub, codes)) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)).enumerate() {
        let scale = d * f32::from(ls[j]);
        if scale == 0.0 {
            continue;
        }
        for (c, &v) in codes.iter_mut().zip(sub) {
            *c = (nearest_int(v / scale).clamp(-32, 31) + 32) as u8;
        }
    }
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
    use crate::quant::dequantize_blocks;

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
            (QuantFormat::Q5_0, 0.13),
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

    /// ggml's own bytes (`ggml_quantize_chunk`, what llama-quantize runs without an
    /// importance matrix; Q4_K, Q5_K, Q6_K and Q5_0) for `scripts/kquant_golden.c`'s 8 x 512 matrix: small and
    /// spiky rows, all-positive and all-negative ones, zero sub-blocks, values below
    /// ggml's `GROUP_MAX_EPS`, constant halves, and sub-blocks from 1e-3 to 1e3. Made by
    /// `scripts/kquant_golden.sh`; moec's encoder must give them byte for byte.
    #[test]
    fn k_formats_give_ggmls_bytes() {
        const GOLDEN: &[u8] = include_bytes!("../../tests/fixtures/quant/kquant-golden.bin");
        let n = 8 * 512;
        let x: Vec<f32> = GOLDEN[..4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut at = 4 * n;
        for format in [
            QuantFormat::Q4K,
            QuantFormat::Q5K,
            QuantFormat::Q6K,
            QuantFormat::Q5_0,
        ] {
            let len = format.bytes_for(n).unwrap();
            let theirs = &GOLDEN[at..at + len];
            at += len;
            let ours = quantize_row(format, &x).unwrap();
            let bb = format.block_bytes();
            for (i, (a, b)) in ours.chunks(bb).zip(theirs.chunks(bb)).enumerate() {
                assert!(
                    a == b,
                    "{format} block {i} (row {}): first differing byte {:?}",
                    i * format.block_elems() / 512,
                    a.iter().zip(b).position(|(p, q)| p != q)
                );
            }
        }
        assert_eq!(at, GOLDEN.len());
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

    /// Q5_0 worked by hand from `quantize_row_q5_0_ref`: the first value of largest
    /// magnitude is -1.6 (ahead of +1.6), so d = 0.1, id = 10; -1.6 -> trunc(0.5) = 0,
    /// +1.6 -> trunc(32.5) capped at 31 (fifth bit set), 0.26 -> trunc(19.1) = 19 (fifth
    /// bit set), 0 -> 16 (fifth bit set); bit `l` of `qh` is weight `l`'s fifth bit.
    #[test]
    fn q5_0_is_the_reference_rounding_worked_by_hand() {
        let mut x = [0.0f32; 32];
        x[0] = -1.6;
        x[17] = 1.6;
        x[3] = 0.26;
        let b = quantize_row(QuantFormat::Q5_0, &x).unwrap();
        assert_eq!(&b[..2], &f16::from_f32(-1.6f32 / -16.0).to_le_bytes());
        assert_eq!(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), !1u32);
        assert_eq!(b[6], 0, "weight 0 code 0, weight 16 code 16");
        assert_eq!(b[7], 15 << 4, "weight 1 code 16, weight 17 code 31");
        assert_eq!(b[9], 3, "weight 3 code 19");
        let mut y = [0.0f32; 32];
        crate::quant::dequantize_blocks(QuantFormat::Q5_0, &b, &mut y).unwrap();
        let d = f16::from_f32(0.1).to_f32();
        assert_eq!(
            (y[0], y[17], y[3], y[5]),
            (-16.0 * d, 15.0 * d, 3.0 * d, 0.0)
        );
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
