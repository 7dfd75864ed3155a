//! Activation rows quantised to 8 bits, as ggml quantises them before a quantised dot
//! product: Q8_K for the K-quant weights, Q8_0 for Q8_0, Q4_0, Q5_0 and MXFP4 weights, Q8_1 for Q4_1
//! weights (ggml's `vec_dot_type` of each).
//!
//! Takes f32 rows whose length is whole blocks; gives [`Q8Rows`], the int8 codes, one f32
//! scale per block and (Q8_K) the sums of each 16 codes. Guarantees, for finite inputs:
//!
//! - **Q8_K** (256-value blocks) is ggml's `quantize_row_q8_K_ref` (which the x86 build of
//!   llama.cpp also runs): `max` is the first value of largest magnitude `amax`; a block
//!   with `amax == 0` is all zero codes with scale 0; otherwise `iscale = -127 / max`,
//!   code `i` = `min(127, round_half_even(iscale * x[i]))` and the scale is `1 / iscale`
//!   (so it is negative when `max` is positive, and the codes carry the opposite sign:
//!   the products `scale * code` are what count). `bsums[j]` = the sum of codes
//!   `16j..16j+16`.
//! - **Q8_0** (32-value blocks) is the arithmetic of llama.cpp's x86 `quantize_row_q8_0`:
//!   `d = amax / 127` rounded to f16 (that f16 widened is the block's scale), `id = 127 /
//!   amax` (0 when `amax == 0`), code `i` = `round_half_even(x[i] * id)`.
//!
//! Non-finite activations give deterministic but unspecified codes (never a panic).

use super::{QuantFormat, QK_K};

/// Values per Q8_0 block.
pub const QK8_0: usize = 32;

/// Which 8-bit activation format a weight format's dot products take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActFormat {
    /// 256-value blocks with an f32 scale and per-16 code sums (ggml's `block_q8_K`).
    Q8K,
    /// 32-value blocks with an f16 scale (ggml's `block_q8_0`).
    Q8_0,
    /// 32-value blocks with an f16 scale and the f16 of scale times code sum (ggml's
    /// `block_q8_1`).
    Q8_1,
}

impl ActFormat {
    /// The activation format `format`'s dot products are defined with (ggml's
    /// `vec_dot_type`).
    pub fn for_weights(format: QuantFormat) -> Self {
        match format {
            QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 | QuantFormat::Mxfp4 => {
                ActFormat::Q8_0
            }
            QuantFormat::Q4_1 => ActFormat::Q8_1,
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => ActFormat::Q8K,
        }
    }

    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            ActFormat::Q8K => QK_K,
            ActFormat::Q8_0 | ActFormat::Q8_1 => QK8_0,
        }
    }
}

/// `n_rows` activation rows of `cols` values quantised to `format`.
#[derive(Debug, Clone, PartialEq)]
pub struct Q8Rows {
    /// The activation format.
    pub format: ActFormat,
    /// Rows.
    pub n_rows: usize,
    /// Values per row (whole blocks).
    pub cols: usize,
    /// Codes, `[n_rows, cols]`.
    pub qs: Vec<i8>,
    /// Block scales, `[n_rows, cols / block]` (Q8_0: the f16 scale widened).
    pub d: Vec<f32>,
    /// Q8_K only: the sum of each 16 codes, `[n_rows, cols / 16]`; empty otherwise.
    pub bsums: Vec<i16>,
    /// Q8_1 only: each block's `s` (f16 of scale times code sum, widened), laid out as
    /// `d`; empty otherwise.
    pub s: Vec<f32>,
}

impl Q8Rows {
    /// Quantises `n_rows` rows of `x` (`x.len() == n_rows * cols`, `cols` whole blocks of
    /// `format`; the caller checks both).
    pub fn quantize(format: ActFormat, x: &[f32], n_rows: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), n_rows * cols);
        debug_assert!(cols.is_multiple_of(format.block_elems()));
        let be = format.block_elems();
        let mut qs = vec![0i8; n_rows * cols];
        let mut d = vec![0.0f32; n_rows * cols / be];
        let mut bsums = Vec::new();
        let mut s = Vec::new();
        match format {
            ActFormat::Q8K => {
                bsums = vec![0i16; n_rows * cols / 16];
                for (((xb, qb), db), sb) in x
                    .chunks_exact(QK_K)
                    .zip(qs.chunks_exact_mut(QK_K))
                    .zip(d.iter_mut())
                    .zip(bsums.chunks_exact_mut(QK_K / 16))
                {
                    *db = q8k_block(xb, qb, sb);
                }
            }
            ActFormat::Q8_0 => {
                for ((xb, qb), db) in x
                    .chunks_exact(QK8_0)
                    .zip(qs.chunks_exact_mut(QK8_0))
                    .zip(d.iter_mut())
                {
                    *db = q8_0_block(xb, qb).0;
                }
            }
            ActFormat::Q8_1 => {
                s = vec![0.0f32; d.len()];
                for (((xb, qb), db), sb) in x
                    .chunks_exact(QK8_0)
                    .zip(qs.chunks_exact_mut(QK8_0))
                    .zip(d.iter_mut())
                    .zip(s.iter_mut())
                {
                    let (dh, d32) = q8_0_block(xb, qb);
                    let sum: i32 = qb.iter().map(|&q| i32::from(q)).sum();
                    *db = dh;
                    *sb = half::f16::from_f32(d32 * sum as f32).to_f32();
                }
            }
        }
        Q8Rows {
            format,
            n_rows,
            cols,
            qs,
            d,
            bsums,
            s,
        }
    }

    /// Blocks per row.
    pub fn blocks_per_row(&self) -> usize {
        self.cols / self.format.block_elems()
    }

    /// The codes of block `b` of row `r`.
    pub fn block_qs(&self, r: usize, b: usize) -> &[i8] {
        let be = self.format.block_elems();
        let at = r * self.cols + b * be;
        &self.qs[at..at + be]
    }

    /// The scale of block `b` of row `r`.
    pub fn block_d(&self, r: usize, b: usize) -> f32 {
        self.d[r * self.blocks_per_row() + b]
    }

    /// Q8_K: the 16 code sums of block `b` of row `r`.
    pub fn block_bsums(&self, r: usize, b: usize) -> &[i16] {
        let at = (r * self.blocks_per_row() + b) * (QK_K / 16);
        &self.bsums[at..at + QK_K / 16]
    }

    /// Q8_1: the `s` of block `b` of row `r` (0 for other formats).
    pub fn block_s(&self, r: usize, b: usize) -> f32 {
        self.s
            .get(r * self.blocks_per_row() + b)
            .copied()
            .unwrap_or(0.0)
    }

    /// The f32 value of every code (`scale * code`), `[n_rows, cols]`: what the
    /// quantised products multiply the weights with.
    pub fn dequantize(&self) -> Vec<f32> {
        let be = self.format.block_elems();
        self.qs
            .chunks_exact(be)
            .zip(&self.d)
            .flat_map(|(q, &d)| q.iter().map(move |&v| d * f32::from(v)))
            .collect()
    }
}

/// ggml's `nearest_int`: round half to even by adding `1.5 * 2^23` (exact for
/// `|v| <= 2^22 - 1`; any other input gives some value in `-2^22..2^22`, never a panic).
fn nearest_int(v: f32) -> i32 {
    let biased = v + 12_582_912.0;
    (biased.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// One Q8_K block: codes into `qs`, code sums into `bsums`; returns the scale.
fn q8k_block(x: &[f32], qs: &mut [i8], bsums: &mut [i16]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        qs.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in qs.iter_mut().zip(x) {
        // Finite inputs give -127..=127; `as` keeps the low byte otherwise, as C does.
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, q16) in bsums.iter_mut().zip(qs.chunks_exact(16)) {
        *s = q16.iter().map(|&q| i16::from(q)).sum();
    }
    1.0 / iscale
}

/// One Q8_0 block: codes into `qs`; returns the scale (the f16 scale widened) and the
/// unrounded f32 scale `amax / 127` (Q8_1's `s` multiplies that one).
fn q8_0_block(x: &[f32], qs: &mut [i8]) -> (f32, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d32 = amax / 127.0;
    let d = half::f16::from_f32(d32);
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(x) {
        // Finite inputs give -127..=127 (|v * id| <= 127 up to rounding); `as` saturates.
        *q = (v * id).round_ties_even() as i8;
    }
    (d.to_f32(), d32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's Q8_K by hand: max = -127 (the first value of largest magnitude, ahead of
    /// the +127), iscale = 1, codes round half to even (2.5 -> 2, 3.5 -> 4), scale = 1.
    #[test]
    fn q8k_by_hand() {
        let mut x = vec![0.0f32; 256];
        x[0] = 2.5;
        x[1] = -127.0;
        x[2] = 3.5;
        x[3] = -0.5;
        x[17] = 127.0;
        let q = Q8Rows::quantize(ActFormat::Q8K, &x, 1, 256);
        assert_eq!(&q.qs[..4], &[2, -127, 4, 0]);
        assert_eq!(q.qs[17], 127);
        assert_eq!(q.d[0], 1.0);
        assert_eq!(q.bsums[0], 2 - 127 + 4);
        assert_eq!(q.bsums[1], 127);
        assert!(q.bsums[2..].iter().all(|&s| s == 0));
        // All zero: scale 0 and zero codes.
        let z = Q8Rows::quantize(ActFormat::Q8K, &[0.0; 256], 1, 256);
        assert_eq!((z.d[0], z.qs.iter().all(|&v| v == 0)), (0.0, true));
    }

    /// A positive largest value gives a negative scale and negated codes (ggml's sign).
    #[test]
    fn q8k_scale_takes_the_sign_of_minus_max() {
        let mut x = vec![0.0f32; 256];
        x[5] = 4.0;
        x[6] = -1.0;
        let q = Q8Rows::quantize(ActFormat::Q8K, &x, 1, 256);
        assert_eq!((q.qs[5], q.qs[6]), (-127, 32));
        assert_eq!(q.d[0], 1.0 / (-127.0 / 4.0));
        assert_eq!(q.dequantize()[5], q.d[0] * -127.0);
    }

    /// llama.cpp's x86 Q8_0 by hand: amax 127, d = f16(1), id = 1, codes round half to
    /// even (-63.5 -> -64, 2.5 -> 2); amax 2.54 gives the f16 of 0.02.
    #[test]
    fn q8_0_by_hand() {
        let mut x = vec![0.0f32; 32];
        x[0] = 127.0;
        x[1] = -63.5;
        x[2] = 2.5;
        x[3] = 0.5;
        let q = Q8Rows::quantize(ActFormat::Q8_0, &x, 1, 32);
        assert_eq!(&q.qs[..4], &[127, -64, 2, 0]);
        assert_eq!(q.d[0], 1.0);
        let mut y = vec![0.0f32; 32];
        y[7] = -2.54;
        let q = Q8Rows::quantize(ActFormat::Q8_0, &y, 1, 32);
        assert_eq!(q.d[0], half::f16::from_f32(2.54 / 127.0).to_f32());
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-3.5), -4);
    }

    /// llama.cpp's x86 Q8_1 by hand: Q8_0's codes and scale; amax 31.75 gives d32 = 0.25,
    /// id = 4, codes 127 (x = 31.75), -64 (x = -15.875: -63.5 rounds to even), 1 (x =
    /// 0.25), so s = f16(0.25 · 64) = 16.
    #[test]
    fn q8_1_by_hand() {
        let mut x = vec![0.0f32; 32];
        x[0] = 31.75;
        x[1] = -15.875;
        x[5] = 0.25;
        let q = Q8Rows::quantize(ActFormat::Q8_1, &x, 1, 32);
        let q0 = Q8Rows::quantize(ActFormat::Q8_0, &x, 1, 32);
        assert_eq!((&q.qs, &q.d), (&q0.qs, &q0.d));
        assert_eq!((q.qs[0], q.qs[1], q.qs[5], q.d[0]), (127, -64, 1, 0.25));
        assert_eq!(q.s, [16.0]);
        assert_eq!(q.block_s(0, 0), 16.0);
    }

    /// NaN and infinite activations quantise without panicking.
    #[test]
    fn non_finite_activations_do_not_panic() {
        let mut x = vec![1.0f32; 256];
        x[3] = f32::NAN;
        x[4] = f32::INFINITY;
        let _ = Q8Rows::quantize(ActFormat::Q8K, &x, 1, 256);
        let _ = Q8Rows::quantize(ActFormat::Q8_0, &x, 1, 256);
        let _ = Q8Rows::quantize(ActFormat::Q8_1, &x, 1, 256);
    }
}
