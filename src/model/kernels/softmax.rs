//! Row softmax in place, the exponentials 16 lanes at a time on AVX-512.
//!
//! Decode attention exponentiates one score per cached token and query head; a scalar
//! `expf` per score costs about as much time as streaming the token's K and V rows, so the
//! exponential is vectorised: Cody-Waite range reduction `x = t ln2 + r`, a degree-6
//! polynomial for `e^r` (the Cephes `expf` coefficients, max relative error ~2 ulp on
//! [-ln2/2, ln2/2]) and `2^t` applied with `vscalefps`. Each row is computed on its own
//! (same bits whatever other rows exist), so attention stays batch-invariant.

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// `row = softmax(row)`: `exp(v - max)` normalised by the sum. An empty row is left as is.
pub fn softmax_in_place(row: &mut [f32]) {
    if row.is_empty() {
        return;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = exp_shifted(row, max);
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// `row[i] = exp(row[i] - max)`; returns the sum of the results.
fn exp_shifted(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: avx512f was detected at run time; the body only touches `row` through
        // loads/stores of indices below `row.len()` (full chunks, then a masked tail).
        return unsafe { exp_shifted_avx512(row, max) };
    }
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(row: &mut [f32], max: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = row.len();
    let p = row.as_mut_ptr();
    let shift = _mm512_set1_ps(max);
    let lowest = _mm512_set1_ps(-104.0); // e^-104 < 2^-150: scales to 0
    let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
    let ln2_hi = _mm512_set1_ps(0.693_359_4);
    let ln2_lo = _mm512_set1_ps(-2.121_944_4e-4);
    let c = [
        _mm512_set1_ps(1.987_569_1e-4),
        _mm512_set1_ps(1.398_2e-3),
        _mm512_set1_ps(8.333_452e-3),
        _mm512_set1_ps(4.166_579_6e-2),
        _mm512_set1_ps(0.166_666_65),
        _mm512_set1_ps(0.5),
    ];
    let one = _mm512_set1_ps(1.0);
    let exp = |x: __m512| {
        let x = _mm512_max_ps(_mm512_sub_ps(x, shift), lowest);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, log2e),
        );
        let r = _mm512_fnmadd_ps(t, ln2_hi, x);
        let r = _mm512_fnmadd_ps(t, ln2_lo, r);
        let mut y = c[0];
        for &k in &c[1..] {
            y = _mm512_fmadd_ps(y, r, k);
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
    if i < n {
        let mask: __mmask16 = (1u16 << (n - i)) - 1;
        // SAFETY: the mask enables only lanes i..n, all inside `row`; masked-off lanes are
        // neither read nor written.
        unsafe {
            let e = exp(_mm512_maskz_loadu_ps(mask, p.add(i)));
            _mm512_mask_storeu_ps(p.add(i), mask, e);
            acc = _mm512_mask_add_ps(acc, mask, acc, e);
        }
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64 `exp` over the range attention produces (scores minus their max, down
    /// to where f32 underflows), including a ragged tail.
    #[test]
    fn softmax_matches_f64_reference() {
        for n in [1usize, 7, 16, 33, 1000] {
            let row: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 2003) as f32 / 2003.0 * 60.0 - 45.0)
                .collect();
            // The shift is an f32 subtraction in any f32 softmax (its rounding is not the
            // exponential's error), so the reference exponentiates the same f32 differences.
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f64> = row.iter().map(|&v| ((v - max) as f64).exp()).collect();
            let z: f64 = e.iter().sum();
            let mut got = row.clone();
            softmax_in_place(&mut got);
            for (i, (g, w)) in got.iter().zip(&e).enumerate() {
                let want = w / z;
                assert!(
                    ((*g as f64) - want).abs() <= 1e-6 * want,
                    "n={n} i={i}: {g} vs {want}"
                );
            }
        }
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
