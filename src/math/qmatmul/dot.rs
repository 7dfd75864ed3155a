//! The portable (reference) dot product of one weight block with one 8-bit activation
//! block, the arithmetic every quantised-product body reproduces bit for bit.
//!
//! Takes a weight block's bytes (ggml layout), the activation block's codes, its Q8_K
//! code sums and its scale; gives the block's f32 contribution. The integer part is exact
//! (any summation order gives the same integers); the f32 part is fixed here:
//!
//! - Q4_K, Q5_K: `isum = Σ_j sc_j · Σ_{k in sub-block j} q_k a_k` (8 sub-blocks of 32,
//!   codes 0..15 or 0..31), `imin = Σ_j m_j · (bsum_{2j} + bsum_{2j+1})`; value =
//!   `(dx · dy) · f32(isum) − (dmin · dy) · f32(imin)` (ggml's `vec_dot_q4_K_q8_K`).
//! - Q6_K: `isum = Σ_j sc_j · (Σ_{k in sub-block j} q_k a_k − 32 · bsum_j)` (16 sub-blocks
//!   of 16, codes 0..63, `sc_j` signed); value = `(dx · dy) · f32(isum)`.
//! - Q8_0: `isum = Σ_k q_k a_k` (32 signed codes each); value = `(dx · dy) · f32(isum)`.
//! - Q4_0: `isum = Σ_k (q_k − 8) a_k` (codes 0..15, Q8_0 activations); value =
//!   `(dx · dy) · f32(isum)` (ggml's `vec_dot_q4_0_q8_0`).
//! - Q5_0: `isum = Σ_k (q_k − 16) a_k` (codes 0..31, Q8_0 activations); value =
//!   `(dx · dy) · f32(isum)` (ggml's `vec_dot_q5_0_q8_0`).
//! - Q4_1: `isum = Σ_k q_k a_k` (codes 0..15, Q8_1 activations); value =
//!   `(dx · dy) · f32(isum) + m · sy`, `m` the block's f16 offset widened and `sy` the
//!   activation block's Q8_1 `s` (ggml's `vec_dot_q4_1_q8_1`).
//! - MXFP4: `isum = Σ_k kvalues_mxfp4[q_k] a_k` (table values −12..12, Q8_0 activations);
//!   value = `(dx · dy) · f32(isum)` with `dx = 2^(e − 128)` (ggml's
//!   `vec_dot_mxfp4_q8_0`).
//!
//! Every product and difference is one rounded f32 operation (no fused multiply-add);
//! `f32(i)` is the round-to-nearest conversion of an `i32`; `dx`, `dmin` are the block's
//! f16 scales widened, `dy` the activation block's scale.

use crate::quant::blocks::{e8m0_half, q4_code, q5_0_code, q6k_codes, scale_min_k4, KVALUES_MXFP4};
use crate::quant::QuantFormat;
use half::f16;

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The value of weight block `w` (whole block of `format`) times the activation block
/// with codes `a`, Q8_K code sums `bsums` (K-quants only), scale `dy` and Q8_1 sum `sy`
/// (Q4_1 only).
pub(super) fn block_value(
    format: QuantFormat,
    w: &[u8],
    a: &[i8],
    bsums: &[i16],
    dy: f32,
    sy: f32,
) -> f32 {
    match format {
        QuantFormat::Q4_0 => {
            let isum: i32 = (0..32)
                .map(|l| (i32::from(q4_code(&w[2..18], l)) - 8) * i32::from(a[l]))
                .sum();
            (f16_at(w, 0) * dy) * isum as f32
        }
        QuantFormat::Q5_0 => {
            let isum: i32 = (0..32)
                .map(|l| (i32::from(q5_0_code(w, l)) - 16) * i32::from(a[l]))
                .sum();
            (f16_at(w, 0) * dy) * isum as f32
        }
        QuantFormat::Q4_1 => {
            let isum: i32 = (0..32)
                .map(|l| i32::from(q4_code(&w[4..20], l)) * i32::from(a[l]))
                .sum();
            q4_1_value(f16_at(w, 0), f16_at(w, 2), dy, sy, isum)
        }
        QuantFormat::Q8_0 => {
            let isum: i32 = w[2..34]
                .iter()
                .zip(a)
                .map(|(&q, &x)| i32::from(q as i8) * i32::from(x))
                .sum();
            (f16_at(w, 0) * dy) * isum as f32
        }
        QuantFormat::Q4K | QuantFormat::Q5K => {
            let (isum, imin) = k4_ints(format, w, a, bsums);
            k4_value(f16_at(w, 0), f16_at(w, 2), dy, isum, imin)
        }
        QuantFormat::Q6K => (f16_at(w, 208) * dy) * q6k_isum(w, a, bsums) as f32,
        QuantFormat::Mxfp4 => {
            let isum: i32 = (0..32)
                .map(|l| {
                    let kv = KVALUES_MXFP4[usize::from(q4_code(&w[1..17], l))];
                    i32::from(kv) * i32::from(a[l])
                })
                .sum();
            (e8m0_half(w[0]) * dy) * isum as f32
        }
    }
}

/// The f32 part of a Q4_1 block, shared by every body.
#[inline]
pub(super) fn q4_1_value(dx: f32, m: f32, dy: f32, sy: f32, isum: i32) -> f32 {
    (dx * dy) * isum as f32 + m * sy
}

/// The f32 part of a Q4_K/Q5_K block, shared by every body.
#[inline]
pub(super) fn k4_value(dx: f32, dmin: f32, dy: f32, isum: i32, imin: i32) -> f32 {
    (dx * dy) * isum as f32 - (dmin * dy) * imin as f32
}

/// `(isum, imin)` of a Q4_K or Q5_K block.
fn k4_ints(format: QuantFormat, w: &[u8], a: &[i8], bsums: &[i16]) -> (i32, i32) {
    let scales = &w[4..16];
    let (qh, qs): (&[u8], &[u8]) = match format {
        QuantFormat::Q5K => (&w[16..48], &w[48..176]),
        _ => (&[], &w[16..144]),
    };
    let (mut isum, mut imin) = (0i32, 0i32);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        let low = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        let mut dot = 0i32;
        for (l, &x) in a[32 * j..32 * j + 32].iter().enumerate() {
            let mut q = (low[l] >> shift) & 0x0f;
            if !qh.is_empty() {
                q |= ((qh[l] >> j) & 1) << 4;
            }
            dot += i32::from(q) * i32::from(x);
        }
        isum += i32::from(sc) * dot;
        imin += i32::from(m) * (i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1]));
    }
    (isum, imin)
}

/// `isum` of a Q6_K block (codes `0..64`, the `-32` applied through the code sums).
fn q6k_isum(w: &[u8], a: &[i8], bsums: &[i16]) -> i32 {
    let mut codes = [0u8; 256];
    q6k_codes(w, &mut codes);
    let mut isum = 0i32;
    for (j, (q16, a16)) in codes.chunks_exact(16).zip(a.chunks_exact(16)).enumerate() {
        let dot: i32 = q16
            .iter()
            .zip(a16)
            .map(|(&q, &x)| i32::from(q) * i32::from(x))
            .sum();
        let sc = i32::from(w[192 + j] as i8);
        isum += sc * (dot - 32 * i32::from(bsums[j]));
    }
    isum
}
