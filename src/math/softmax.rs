//! Row softmax in place, the exponentials 16 (AVX-512) or 8 (AVX2) lanes at a time.
//!
//! Decode attention exponentiates one score per cached token and query head; a scalar
//! libm `expf` per score costs about as much time as streaming the token's K and V rows,
//! so the exponential is our own: Cody-Waite range reduction `x = t ln2 + r`, a degree-6
//! polynomial for `e^r` (the Cephes `expf` coefficients, max relative error ~2 ulp on
//! [-ln2/2, ln2/2]) evaluated with fused multiply-adds, and `2^t` applied with one
//! correctly rounded multiplication (`vscalefps` on AVX-512; an exponent-field power of
//! two, split in two exact steps below 2^-126, on AVX2 and in the portable body). The
//! sum accumulates element `i` into lane `i mod 16` and reduces the 16 lanes with a fixed
//! tree. Guarantees: the AVX-512, AVX2 and portable bodies give the same bits (unit test),
//! and each row is computed on its own, so attention stays batch-invariant.

use crate::math::isa::{Isa, Kernels};
// The sum's fixed reduction tree, the one every product body ends with.
use crate::math::linear::portable::reduce16;

/// Arguments below this (after subtracting the row max) give 0: e^-104 < 2^-150.
const LOWEST: f32 = -104.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` polynomial, highest degree first.
const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `row = softmax(row)` with the process's kernels ([`Kernels::softmax_in_place`]).
pub fn softmax_in_place(row: &mut [f32]) {
    Kernels::process().softmax_in_place(row);
}

impl Kernels {
    /// `row = softmax(row)`: `exp(v - max)` normalised by the sum. An empty row is left
    /// as is.
    pub fn softmax_in_place(self, row: &mut [f32]) {
        self.softmax_with_sink_in_place(row, None);
    }

    /// [`Kernels::softmax_in_place`] with an optional attention sink: one more logit that
    /// takes part in the max and the denominator but has no output (gpt-oss:
    /// `softmax(cat(row, sink))[..-1]`).
    pub fn softmax_with_sink_in_place(self, row: &mut [f32], sink: Option<f32>) {
        if row.is_empty() {
            return;
        }
        let row_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let max = sink.map_or(row_max, |s| row_max.max(s));
        let sum = match self.isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` value names only an instruction set this CPU has; the
            // body touches `row` only below `row.len()`.
            Isa::Avx512 => unsafe { avx512::exp_shifted(row, max) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { avx2::exp_shifted(row, max) },
            _ => {
                let mut lanes = [0.0f32; 16];
                exp_shifted_tail(row, 0, max, &mut lanes);
                reduce16(&lanes)
            }
        };
        let sum = sum + sink.map_or(0.0, |s| exp_scalar(s, max));
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// `e^(v - max)` exactly as the vector bodies compute it, one element.
fn exp_scalar(v: f32, max: f32) -> f32 {
    let x = (v - max).max(LOWEST);
    let t = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-t).mul_add(LN2_HI, x);
    let r = (-t).mul_add(LN2_LO, r);
    let mut y = POLY[0];
    for &c in &POLY[1..] {
        y = y.mul_add(r, c);
    }
    let y = (y * r).mul_add(r, r + 1.0);
    scale_pow2(y, t as i32)
}

/// `y * 2^t` with one rounding (what `vscalefps` gives) for `t` in [-150, 127]: one
/// multiplication by a normal power of two, or below 2^-126 an exact scaling by 2^(t+64)
/// followed by a multiplication by 2^-64 that rounds once into the subnormals.
fn scale_pow2(y: f32, t: i32) -> f32 {
    let pow = |e: i32| f32::from_bits(((e + 127).clamp(1, 254) as u32) << 23);
    if t >= -126 {
        y * pow(t)
    } else {
        (y * pow(t + 64)) * pow(-64)
    }
}

/// Exponentiates `row[from..]` in place, adding element `i` into `lanes[i % 16]`.
fn exp_shifted_tail(row: &mut [f32], from: usize, max: f32, lanes: &mut [f32; 16]) {
    for (i, v) in row.iter_mut().enumerate().skip(from) {
        *v = exp_scalar(*v, max);
        lanes[i % 16] += *v;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// `row[i] = exp(row[i] - max)`; returns the sum (lane `i mod 16`, fixed tree).
    ///
    /// # Safety
    /// avx512f available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let shift = _mm512_set1_ps(max);
        let lowest = _mm512_set1_ps(LOWEST);
        let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
        let ln2_hi = _mm512_set1_ps(LN2_HI);
        let ln2_lo = _mm512_set1_ps(LN2_LO);
        let one = _mm512_set1_ps(1.0);
        let exp = |x: __m512| {
            let x = _mm512_max_ps(_mm512_sub_ps(x, shift), lowest);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, log2e),
            );
            let r = _mm512_fnmadd_ps(t, ln2_hi, x);
            let r = _mm512_fnmadd_ps(t, ln2_lo, r);
            let mut y = _mm512_set1_ps(POLY[0]);
            for &k in &POLY[1..] {
                y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(k));
            }
            let y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, one));
            _mm512_scalef_ps(y, t)
        };
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, so the 16 lanes are inside `row`.
            unsafe {
                let e = exp(_mm512_loadu_ps(p.add(i)));
                _mm512_storeu_ps(p.add(i), e);
                acc = _mm512_add_ps(acc, e);
            }
            i += 16;
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        exp_shifted_tail(row, i, max, &mut lanes);
        reduce16(&lanes)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// `row[i] = exp(row[i] - max)`; returns the sum (lane `i mod 16`, fixed tree).
    ///
    /// # Safety
    /// avx2 and fma available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
        let n = row.len();
        let p = row.as_mut_ptr();
        let shift = _mm256_set1_ps(max);
        let lowest = _mm256_set1_ps(LOWEST);
        let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
        let ln2_hi = _mm256_set1_ps(LN2_HI);
        let ln2_lo = _mm256_set1_ps(LN2_LO);
        let one = _mm256_set1_ps(1.0);
        let bias = _mm256_set1_epi32(127);
        let min_normal = _mm256_set1_epi32(-126);
        let k64 = _mm256_set1_epi32(64);
        let two_m64 = _mm256_set1_ps(f32::from_bits(63 << 23)); // 2^-64
        let exp = |x: __m256| {
            let x = _mm256_max_ps(_mm256_sub_ps(x, shift), lowest);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, log2e),
            );
            let r = _mm256_fnmadd_ps(t, ln2_hi, x);
            let r = _mm256_fnmadd_ps(t, ln2_lo, r);
            let mut y = _mm256_set1_ps(POLY[0]);
            for &k in &POLY[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(k));
            }
            let y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, one));
            // 2^t as in `scale_pow2`: lanes below 2^-126 scale by 2^(t+64), then 2^-64.
            let ti = _mm256_cvtps_epi32(t);
            let small = _mm256_cmpgt_epi32(min_normal, ti);
            let t1 = _mm256_add_epi32(ti, _mm256_and_si256(small, k64));
            let pow = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(t1, bias), 23));
            let y1 = _mm256_mul_ps(y, pow);
            let y2 = _mm256_mul_ps(y1, two_m64);
            _mm256_blendv_ps(y1, y2, _mm256_castsi256_ps(small))
        };
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, so both 8-lane halves are inside `row`.
            unsafe {
                let e0 = exp(_mm256_loadu_ps(p.add(i)));
                let e1 = exp(_mm256_loadu_ps(p.add(i + 8)));
                _mm256_storeu_ps(p.add(i), e0);
                _mm256_storeu_ps(p.add(i + 8), e1);
                lo = _mm256_add_ps(lo, e0);
                hi = _mm256_add_ps(hi, e1);
            }
            i += 16;
        }
        let mut lanes = [0.0f32; 16];
        // SAFETY: `lanes` holds 16 f32: lanes 0..8 then 8..16.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
        }
        exp_shifted_tail(row, i, max, &mut lanes);
        reduce16(&lanes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores [0, ln 2] with a sink of logit 0: exponentials 1, 2 and the sink's 1, so the
    /// probabilities are 1/4 and 2/4 (the sink's quarter has no output); a sink far above
    /// the scores takes almost everything, one far below changes nothing.
    #[test]
    fn a_sink_takes_its_share_of_the_denominator() {
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            let mut r = [0.0f32, 2f32.ln()];
            k.softmax_with_sink_in_place(&mut r, Some(0.0));
            assert!(
                (r[0] - 0.25).abs() < 1e-6 && (r[1] - 0.5).abs() < 1e-6,
                "{r:?}"
            );
            let mut high = [0.0f32, 2f32.ln()];
            k.softmax_with_sink_in_place(&mut high, Some(40.0));
            assert!(high.iter().all(|p| *p < 1e-15), "{high:?}");
            let mut low = [0.0f32, 2f32.ln()];
            k.softmax_with_sink_in_place(&mut low, Some(-1e30));
            assert!((low[0] - 1.0 / 3.0).abs() < 1e-6 && (low[1] - 2.0 / 3.0).abs() < 1e-6);
        }
    }

    fn row(n: usize, span: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919) % 2003) as f32 / 2003.0 * span - 0.75 * span)
            .collect()
    }

    /// Against f64 `exp` over the range attention produces (scores minus their max, down
    /// to where f32 underflows), including a ragged tail, for every body this CPU has.
    #[test]
    fn softmax_matches_f64_reference() {
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            for n in [1usize, 7, 16, 33, 1000] {
                let row = row(n, 60.0);
                // The shift is an f32 subtraction in any f32 softmax (its rounding is not
                // the exponential's error), so the reference exponentiates the same f32
                // differences.
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f64> = row.iter().map(|&v| ((v - max) as f64).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut got = row.clone();
                k.softmax_in_place(&mut got);
                for (i, (g, w)) in got.iter().zip(&e).enumerate() {
                    let want = w / z;
                    assert!(
                        ((*g as f64) - want).abs() <= 1e-6 * want,
                        "{isa} n={n} i={i}: {g} vs {want}"
                    );
                }
            }
        }
    }

    /// The SIMD bodies give the portable body's bits, including results in the
    /// subnormal range (differences down to -104) and ragged tails.
    #[test]
    fn simd_bodies_give_the_portable_bits() {
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            for n in [1usize, 5, 15, 16, 17, 31, 64, 250] {
                for span in [1.0f32, 40.0, 140.0] {
                    let mut a = row(n, span);
                    let mut b = a.clone();
                    k.softmax_in_place(&mut a);
                    Kernels::portable().softmax_in_place(&mut b);
                    let (a, b): (Vec<u32>, Vec<u32>) = (
                        a.iter().map(|v| v.to_bits()).collect(),
                        b.iter().map(|v| v.to_bits()).collect(),
                    );
                    assert_eq!(a, b, "{isa} n={n} span={span}");
                }
            }
        }
    }

    /// Subnormal results are correctly rounded: e^(-100) = 3.72e-44 is 27 times 2^-149.
    #[test]
    fn subnormal_exponentials_round_once() {
        let got = exp_scalar(-100.0, 0.0);
        let want = (-100.0f64).exp();
        let ulp = f32::from_bits(1) as f64;
        assert!((got as f64 - want).abs() <= ulp, "{got} vs {want}");
        assert_eq!(exp_scalar(-104.0, 0.0), 0.0);
    }

    /// Scores over 104 below the max underflow to 0, never NaN or negative.
    #[test]
    fn far_below_the_max_is_zero() {
        let mut row = vec![0.0f32, -110.0, -1e30, 5.0];
        softmax_in_place(&mut row);
        assert_eq!(row[1], 0.0);
        assert_eq!(row[2], 0.0);
        assert!((row[0] - (-5.0f64).exp() as f32 / (1.0 + (-5.0f64).exp() as f32)).abs() < 1e-6);
        assert!(row.iter().all(|v| v.is_finite() && *v >= 0.0));
    }
}
