//! Random blocks of each ggml format, for synthetic GGUF files (`moec synth --gguf`).
//!
//! Takes a format, the root mean square the decoded weights should have and a generator;
//! fills whole blocks in ggml's layout (the one [`super::blocks`] decodes) with uniformly
//! random codes under finite, positive scales sized so that the weights have about that
//! root mean square and, for the formats with a per-block minimum (Q4_1, Q4_K, Q5_K), a
//! mean near zero. Synthetic weights are random anyway: drawing the codes directly is as
//! good as quantising random values and a hundred times cheaper, which is what lets a
//! 20 GB file be written at about the disk's speed. Guarantees: the same generator state
//! gives the same bytes; every scale is a finite, nonzero f16 (or, for MXFP4, an e8m0
//! exponent inside 1..=254), so no block decodes to an infinity or a NaN; a length that is
//! not whole blocks is an error.

use super::{QuantError, QuantFormat};
use crate::rng::Rng;
use half::f16;

/// Root mean square of a uniformly random signed byte (`-128..=127`): the mean of `k^2`
/// is 5461.5.
const RMS_I8: f32 = 73.902;
/// Of `q - 8` for a uniform 4-bit `q` (Q4_0): the mean of `k^2` over `-8..=7` is 21.5.
const RMS_Q4_SIGNED: f32 = 4.6368;
/// Of `q - 16` for a uniform 5-bit `q` (Q5_0): the mean of `k^2` over `-16..=15` is 85.5.
const RMS_Q5_SIGNED: f32 = 9.2466;
/// Standard deviation of a uniform 4-bit code (`(16^2 - 1) / 12` = 21.25).
const STD_Q4: f32 = 4.6098;
/// Of a uniform 5-bit code (`(32^2 - 1) / 12`).
const STD_Q5: f32 = 9.2331;
/// Root mean square of `q - 32` for a uniform 6-bit `q` (Q6_K; the mean of `k^2` is
/// 341.5).
const RMS_Q6: f32 = 18.480;
/// Twice the root mean square of the 16 MXFP4 values (`kvalues_mxfp4`, doubled: mean of
/// the squares 34.25).
const RMS_MXFP4_DOUBLED: f32 = 5.8523;
/// The K formats' sub-block scales are drawn from `32..=64`: large enough that the 6-bit
/// mins can cancel the mean, varied like a real file's. Their root mean square is 48.39.
const SUB_SCALE_LOW: u8 = 32;
const RMS_SUB_SCALE: f32 = 48.389;

/// Fills `out` with random bytes.
fn fill(rng: &mut Rng, out: &mut [u8]) {
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = rng.next_u64().to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&last[..n]);
}

/// An f16 scale, clamped so a tiny or huge target stays finite and nonzero. Subnormal
/// scales are kept (ggml widens them exactly): the K formats' per-weight scales of a
/// 2048-wide layer are about 2e-5, below f16's smallest normal (6.1e-5).
fn f16_scale(v: f32) -> [u8; 2] {
    f16::from_f32(v.clamp(1.0e-7, 6.0e4)).to_le_bytes()
}

/// A random sub-block scale in `32..=63` (six bits).
fn sub_scale(r: u64) -> u8 {
    SUB_SCALE_LOW + (r % 32) as u8
}

/// Packs eight 6-bit scales and mins as Q4_K/Q5_K store them (the inverse of
/// [`super::blocks::scale_min_k4`]).
fn pack_scale_min(sc: &[u8; 8], m: &[u8; 8], s: &mut [u8]) {
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
}

/// Q4_K/Q5_K: `dmin = ratio * d` and each min `round(sc * mean / ratio)` so that
/// `d * sc * mean(q) - dmin * m` is about zero.
fn k_scales(rng: &mut Rng, mean_code: f32, ratio: f32, s: &mut [u8]) {
    let r = rng.next_u64();
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = sub_scale(r >> (8 * j));
        m[j] = (f32::from(sc[j]) * mean_code / ratio).round().min(63.0) as u8;
    }
    pack_scale_min(&sc, &m, s);
}

/// Fills `out` (whole blocks of `format`) with random blocks whose weights have about
/// root mean square `rms`.
pub fn random_blocks(
    format: QuantFormat,
    rms: f32,
    rng: &mut Rng,
    out: &mut [u8],
) -> Result<(), QuantError> {
    let (be, bb) = (format.block_elems(), format.block_bytes());
    if !out.len().is_multiple_of(bb) {
        return Err(QuantError::Blocks {
            format,
            elems: out.len() / bb * be,
            block: be,
            bytes: out.len(),
        });
    }
    fill(rng, out);
    for b in out.chunks_exact_mut(bb) {
        match format {
            QuantFormat::Q8_0 => b[0..2].copy_from_slice(&f16_scale(rms / RMS_I8)),
            QuantFormat::Q4_0 => b[0..2].copy_from_slice(&f16_scale(rms / RMS_Q4_SIGNED)),
            QuantFormat::Q5_0 => b[0..2].copy_from_slice(&f16_scale(rms / RMS_Q5_SIGNED)),
            QuantFormat::Q4_1 => {
                let d = f16::from_le_bytes(f16_scale(rms / STD_Q4)).to_f32();
                b[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                b[2..4].copy_from_slice(&f16::from_f32(-7.5 * d).to_le_bytes());
            }
            QuantFormat::Mxfp4 => {
                // Weights are 2^(e - 128) times the doubled values: each block takes the
                // power of two below the target's scale or the one above, the lower with
                // the probability that makes the mean square the target's, so blocks vary
                // as a real file's do and the spread is the one asked.
                let x = (rms / RMS_MXFP4_DOUBLED).log2();
                let low = x.floor();
                let p_low = (4f32.powf(low + 1.0) - 4f32.powf(x)) / (3.0 * 4f32.powf(low));
                let up = (rng.next_f64() as f32 >= p_low) as u8 as f32;
                b[0] = (128.0 + low + up).clamp(1.0, 254.0) as u8;
            }
            QuantFormat::Q4K => {
                let d = rms / (RMS_SUB_SCALE * STD_Q4);
                b[0..2].copy_from_slice(&f16_scale(d));
                b[2..4].copy_from_slice(&f16_scale(8.0 * d));
                k_scales(rng, 7.5, 8.0, &mut b[4..16]);
            }
            QuantFormat::Q5K => {
                let d = rms / (RMS_SUB_SCALE * STD_Q5);
                b[0..2].copy_from_slice(&f16_scale(d));
                b[2..4].copy_from_slice(&f16_scale(16.0 * d));
                k_scales(rng, 15.5, 16.0, &mut b[4..16]);
            }
            QuantFormat::Q6K => {
                let r = rng.next_u64() ^ rng.next_u64().rotate_left(32);
                for (j, s) in b[192..208].iter_mut().enumerate() {
                    *s = sub_scale(r >> (4 * j));
                }
                b[208..210].copy_from_slice(&f16_scale(rms / (RMS_SUB_SCALE * RMS_Q6)));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_blocks;

    /// Every format's random blocks decode to finite weights with the asked root mean
    /// square (within 15%: the sub-block scales and codes are random) and, where the
    /// format has a minimum, a mean well under it.
    #[test]
    fn random_blocks_decode_to_the_asked_spread() {
        for format in QuantFormat::ALL {
            let blocks = 64;
            let mut bytes = vec![0u8; blocks * format.block_bytes()];
            let mut rng = Rng::new(7);
            random_blocks(format, 0.02, &mut rng, &mut bytes).unwrap();
            let mut w = vec![0f32; blocks * format.block_elems()];
            dequantize_blocks(format, &bytes, &mut w).unwrap();
            assert!(w.iter().all(|x| x.is_finite()), "{format}");
            let n = w.len() as f32;
            let rms = (w.iter().map(|x| x * x).sum::<f32>() / n).sqrt();
            let mean = w.iter().sum::<f32>() / n;
            // MXFP4's exponent is a power of two: up to a factor sqrt(2) off.
            let tol = if format == QuantFormat::Mxfp4 {
                0.45
            } else {
                0.15
            };
            assert!((rms / 0.02 - 1.0).abs() < tol, "{format}: rms {rms}");
            // Q4_0 has no minimum: its codes `q - 8` average -0.5, a mean of -0.11 rms
            // (Q5_0's `q - 16`: -0.05 rms).
            let mean_tol = if matches!(format, QuantFormat::Q4_0 | QuantFormat::Q5_0) {
                0.13
            } else {
                0.05
            };
            assert!(mean.abs() < mean_tol * 0.02, "{format}: mean {mean}");
            // The same state gives the same bytes.
            let mut again = vec![0u8; bytes.len()];
            random_blocks(format, 0.02, &mut Rng::new(7), &mut again).unwrap();
            assert_eq!(again, bytes);
        }
        let mut odd = vec![0u8; 35];
        assert!(random_blocks(QuantFormat::Q8_0, 1.0, &mut Rng::new(0), &mut odd).is_err());
    }

    #[test]
    fn packed_scales_decode_to_what_was_packed() {
        let sc = [32, 40, 63, 33, 50, 61, 34, 47];
        let m = [30, 37, 59, 31, 47, 57, 32, 44];
        let mut s = [0u8; 12];
        pack_scale_min(&sc, &m, &mut s);
        for j in 0..8 {
            assert_eq!(super::super::blocks::scale_min_k4(j, &s), (sc[j], m[j]));
        }
    }
}
