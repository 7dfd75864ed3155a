//! Row-wise normalisation of f32 activations: RMSNorm (Mixtral) and LayerNorm without
//! bias (DBRX), both with a stored per-channel weight.
//!
//! Takes `[n_rows, d]` f32 and a weight of `d` elements in any stored dtype; gives
//! `[n_rows, d]` f32. Statistics are computed in f32 exactly as Hugging Face does
//! (mean of squares, biased variance), then the weight multiplies the normalised value.

use crate::model::tensor::TypedSlice;

/// Which normalisation a family uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `x * rsqrt(mean(x²) + eps) * w`.
    Rms,
    /// `(x - mean) * rsqrt(var + eps) * w`, no bias.
    LayerNoBias,
}

/// Normalises each row of `x` (`[n_rows, d]`, `d = weight.len()`) into `out`.
pub fn normalize(kind: NormKind, x: &[f32], weight: TypedSlice<'_>, eps: f32, out: &mut [f32]) {
    let d = weight.len();
    debug_assert_eq!(x.len(), out.len());
    let w = weight.to_f32_vec();
    for (row, dst) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        match kind {
            NormKind::Rms => {
                let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
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
}
