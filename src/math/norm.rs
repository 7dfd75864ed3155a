//! Row-wise normalisation of f32 activations: RMSNorm (Mixtral) and LayerNorm without
//! bias (DBRX), both with a stored per-channel weight.
//!
//! Takes `[n_rows, d]` f32 and a weight of `d` elements in any stored dtype; gives
//! `[n_rows, d]` f32. Statistics are those Hugging Face computes (mean of squares, biased
//! variance), then the weight multiplies the normalised value. RMSNorm sums the f32
//! squares in f64 and rounds the mean to f32, as ggml's `rms_norm` does (llama.cpp): that
//! is the correctly rounded mean in all but rare cases, and it keeps moec's normalised
//! rows bit-equal to llama.cpp's, which matters for quantised weights: their products
//! quantise these rows to 8 bits, and one ulp of difference flips a code (on llama.cpp's
//! own Q8_0 Mixtral fixture an f32 running sum moved the first-step logits by 0.136, see
//! ARCHITECTURE.md's quantised-weights section).

use crate::math::tensor::TypedSlice;
use crate::model::vocab::NormKind;

/// Normalises each row of `x` (`[n_rows, d]`, `d = weight.len()`) into `out`.
pub fn normalize(kind: NormKind, x: &[f32], weight: TypedSlice<'_>, eps: f32, out: &mut [f32]) {
    let d = weight.len();
    debug_assert_eq!(x.len(), out.len());
    let w = weight.to_f32_vec();
    for (row, dst) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        match kind {
            NormKind::Rms => {
                let sum: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
                let mean_sq = (sum / d as f64) as f32;
                let scale = 1.0 / (mean_sq + eps).sqrt();
                for ((o, &v), &wv) in dst.iter_mut().zip(row).zip(&w) {
                    *o = wv * (v * scale);
                }
            }
            NormKind::LayerNoBias => {
                let mean = row.iter().sum::<f32>() / d as f32;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
                let scale = 1.0 / (var + eps).sqrt();
                for ((o, &v), &wv) in dst.iter_mut().zip(row).zip(&w) {
                    *o = (v - mean) * scale * wv;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Worked by hand: x = [1, 2, 3, 4], w = [1, 1, 2, 2], eps = 0.
    #[test]
    fn rms_and_layer_norm_match_hand_computation() {
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let w = [1.0f32, 1.0, 2.0, 2.0];
        let mut out = [0.0f32; 4];
        normalize(NormKind::Rms, &x, TypedSlice::F32(&w), 0.0, &mut out);
        let rms = (30.0f32 / 4.0).sqrt();
        let want = [1.0 / rms, 2.0 / rms, 6.0 / rms, 8.0 / rms];
        assert!(
            out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6),
            "{out:?}"
        );
        normalize(
            NormKind::LayerNoBias,
            &x,
            TypedSlice::F32(&w),
            0.0,
            &mut out,
        );
        let sd = 1.25f32.sqrt();
        let want = [-1.5 / sd, -0.5 / sd, 1.0 / sd, 3.0 / sd];
        assert!(
            out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6),
            "{out:?}"
        );
    }

    /// RMSNorm's mean of squares is ggml's: f32 squares summed in f64, the mean rounded
    /// to f32. With x = [4096, 1, 1, 1] an f32 running sum stays at 2^24 (each + 1 rounds
    /// away); ggml's sum is 16777219, mean f32(4194304.75).
    #[test]
    fn rms_mean_of_squares_is_summed_as_ggml_does() {
        let x = [4096.0f32, 1.0, 1.0, 1.0];
        let mut out = [0.0f32; 4];
        normalize(NormKind::Rms, &x, TypedSlice::F32(&[1.0; 4]), 0.0, &mut out);
        let mean = (16_777_219.0f64 / 4.0) as f32;
        let scale = 1.0f32 / mean.sqrt();
        assert_eq!(out, [4096.0 * scale, scale, scale, scale]);
        assert_ne!(mean, 16_777_216.0f32 / 4.0, "the f32 running sum differs");
    }
}
