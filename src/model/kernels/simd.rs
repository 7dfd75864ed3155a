//! Inner loops shared by every kernel: widening stored weights to f32, multi-row dot
//! products and axpy.
//!
//! Each function picks an AVX-512 body at run time (`is_x86_feature_detected!`) and falls
//! back to portable chunked loops, so results never depend on the build flags and the
//! binary runs on any x86-64 or other host. Accumulation is always f32.

use crate::model::tensor::TypedSlice;
use half::slice::HalfFloatSliceExt;

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// True when the AVX-512 bodies are used on this host (reported by benches).
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Widens `src` into `dst` (equal lengths) as f32.
pub fn widen(src: TypedSlice<'_>, dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    match src {
        TypedSlice::F32(s) => dst.copy_from_slice(s),
        TypedSlice::F16(s) => s.convert_to_f32_slice(dst),
        TypedSlice::Bf16(s) => {
            let bits: &[u16] = bytemuck::cast_slice(s);
            #[cfg(target_arch = "x86_64")]
            if has_avx512() {
                // SAFETY: the avx512f feature was detected on this CPU just above.
                unsafe { widen_bf16_avx512(bits, dst) };
                return;
            }
            for (d, &b) in dst.iter_mut().zip(bits) {
                *d = f32::from_bits((b as u32) << 16);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_bf16_avx512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n bounds both the 32-byte load and the 64-byte store.
        unsafe {
            let raw = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
            let wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(wide));
        }
        i += 16;
    }
    for j in i..n {
        dst[j] = f32::from_bits((src[j] as u32) << 16);
    }
}

/// `out[t] = dot(w, xs[t * x_stride .. t * x_stride + w.len()])` for `t < out.len()`.
///
/// The weight row is read once per group of four rows of `xs`, which is what makes
/// decode-time GEMV and grouped-query attention memory-bound rather than load-bound.
pub fn dot_rows(w: &[f32], xs: &[f32], x_stride: usize, out: &mut [f32]) {
    let n_rows = out.len();
    let len = w.len();
    debug_assert!(n_rows == 0 || (n_rows - 1) * x_stride + len <= xs.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: avx512f detected; the debug assertion's bound is checked below too.
        if n_rows == 0 || (n_rows - 1) * x_stride + len <= xs.len() {
            unsafe { dot_rows_avx512(w, xs, x_stride, out) };
            return;
        }
    }
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot(w, &xs[t * x_stride..t * x_stride + len]);
    }
}

/// Portable dot product with eight independent partial sums (vectorises at -O2+).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_avx512(w: &[f32], xs: &[f32], x_stride: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let len = w.len();
    let full = len / 16 * 16;
    let wp = w.as_ptr();
    let mut t = 0;
    while t < out.len() {
        let group = (out.len() - t).min(4);
        // SAFETY: every pointer below reads xs[(t+g)*x_stride + k] with k < len and
        // t+g < out.len(), within the caller-checked bound (n_rows-1)*x_stride+len <= xs.len().
        unsafe {
            let x0 = xs.as_ptr().add(t * x_stride);
            let x1 = xs.as_ptr().add((t + (1 % group)) * x_stride);
            let x2 = xs.as_ptr().add((t + (2 % group)) * x_stride);
            let x3 = xs.as_ptr().add((t + (3 % group)) * x_stride);
            let (mut a0, mut a1, mut a2, mut a3) = (
                _mm512_setzero_ps(),
                _mm512_setzero_ps(),
                _mm512_setzero_ps(),
                _mm512_setzero_ps(),
            );
            let mut k = 0;
            while k < full {
                let wv = _mm512_loadu_ps(wp.add(k));
                a0 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x0.add(k)), a0);
                a1 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x1.add(k)), a1);
                a2 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x2.add(k)), a2);
                a3 = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x3.add(k)), a3);
                k += 16;
            }
            let sums = [
                _mm512_reduce_add_ps(a0),
                _mm512_reduce_add_ps(a1),
                _mm512_reduce_add_ps(a2),
                _mm512_reduce_add_ps(a3),
            ];
            let rows = [x0, x1, x2, x3];
            for g in 0..group {
                let mut s = sums[g];
                for kk in full..len {
                    s += *wp.add(kk) * *rows[g].add(kk);
                }
                out[t + g] = s;
            }
        }
        t += group;
    }
}

/// `y += a * x` (equal lengths).
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && x.len() == y.len() {
        // SAFETY: avx512f detected; lengths are equal.
        unsafe { axpy_avx512(a, x, y) };
        return;
    }
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(a: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let av = _mm512_set1_ps(a);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n = x.len() = y.len().
        unsafe {
            let yv = _mm512_loadu_ps(y.as_ptr().add(i));
            let r = _mm512_fmadd_ps(av, _mm512_loadu_ps(x.as_ptr().add(i)), yv);
            _mm512_storeu_ps(y.as_mut_ptr().add(i), r);
        }
        i += 16;
    }
    for j in i..n {
        y[j] += a * x[j];
    }
}

/// Attention scores for `n` consecutive slots starting at `slot0` of one transposed key
/// tile (`k_tile[dim * block_size + slot]`): `scores[g * stride + base + r] = scale *
/// Σ_dim q_group[g][dim] * key[slot0 + r][dim]`, summed sequentially over `dim` with fused
/// multiply-adds (so the AVX-512 body, 16 slots per vector, and the portable body give the
/// same bits, and a score never depends on which other keys share the call).
#[allow(clippy::too_many_arguments)]
pub fn key_scores_transposed(
    k_tile: &[f32],
    block_size: usize,
    slot0: usize,
    n: usize,
    q_group: &[f32],
    scale: f32,
    scores: &mut [f32],
    stride: usize,
    base: usize,
) {
    let hd = k_tile.len() / block_size.max(1);
    let group = q_group.len() / hd.max(1);
    let fits = slot0 + n <= block_size && scores.len() >= (group.max(1) - 1) * stride + base + n;
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && fits && group * hd == q_group.len() {
        // SAFETY: avx512f detected; slots slot0..slot0+n lie inside the tile (checked) and
        // every score index is inside `scores` (checked).
        unsafe {
            key_scores_transposed_avx512(
                k_tile, block_size, slot0, n, q_group, scale, scores, stride, base,
            )
        };
        return;
    }
    if !fits {
        return;
    }
    for g in 0..group {
        let q = &q_group[g * hd..(g + 1) * hd];
        for r in 0..n {
            let mut acc = 0.0f32;
            for (dim, &qd) in q.iter().enumerate() {
                acc = qd.mul_add(k_tile[dim * block_size + slot0 + r], acc);
            }
            scores[g * stride + base + r] = acc * scale;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn key_scores_transposed_avx512(
    k_tile: &[f32],
    block_size: usize,
    slot0: usize,
    n: usize,
    q_group: &[f32],
    scale: f32,
    scores: &mut [f32],
    stride: usize,
    base: usize,
) {
    use std::arch::x86_64::*;
    let hd = k_tile.len() / block_size;
    let group = q_group.len() / hd;
    let scale_v = _mm512_set1_ps(scale);
    let kp = k_tile.as_ptr();
    let qp = q_group.as_ptr();
    let mut r0 = 0;
    while r0 < n {
        let lanes = (n - r0).min(16);
        let mask: __mmask16 = if lanes == 16 {
            0xFFFF
        } else {
            ((1u32 << lanes) - 1) as __mmask16
        };
        // Four query heads at a time: four independent FMA chains hide the latency; a
        // short last group repeats its last head (same arithmetic, result discarded).
        let mut g0 = 0;
        while g0 < group {
            let qo = [
                g0,
                (g0 + 1).min(group - 1),
                (g0 + 2).min(group - 1),
                (g0 + 3).min(group - 1),
            ];
            let z = _mm512_setzero_ps();
            let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
            for dim in 0..hd {
                // SAFETY: slots slot0+r0 .. slot0+r0+lanes < block_size (caller-checked), so
                // the masked lanes stay inside row `dim` of the tile; q indices < group*hd.
                unsafe {
                    let kv = _mm512_maskz_loadu_ps(mask, kp.add(dim * block_size + slot0 + r0));
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(qo[0] * hd + dim)), kv, a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(qo[1] * hd + dim)), kv, a1);
                    a2 = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(qo[2] * hd + dim)), kv, a2);
                    a3 = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(qo[3] * hd + dim)), kv, a3);
                }
            }
            for (i, a) in [a0, a1, a2, a3].into_iter().enumerate() {
                if g0 + i >= group {
                    break;
                }
                let out = _mm512_mul_ps(a, scale_v);
                // SAFETY: indices (g0+i)*stride+base+r0 .. +lanes are inside `scores`
                // (caller-checked).
                unsafe {
                    _mm512_mask_storeu_ps(
                        scores.as_mut_ptr().add((g0 + i) * stride + base + r0),
                        mask,
                        out,
                    )
                };
            }
            g0 += 4;
        }
        r0 += 16;
    }
}

/// `out[g] += Σ_r probs[g * stride + base + r] * rows[r]` for every query head `g` (rows
/// contiguous, each `hd` wide), accumulated key by key with fused multiply-adds: the same
/// per-element order as repeated [`axpy`].
pub fn weighted_rows(
    rows: &[f32],
    hd: usize,
    probs: &[f32],
    stride: usize,
    base: usize,
    out: &mut [f32],
) {
    let group = out.len() / hd.max(1);
    let n = rows.len() / hd.max(1);
    #[cfg(target_arch = "x86_64")]
    if has_avx512()
        && hd.is_multiple_of(16)
        && hd <= 256
        && probs.len() >= (group.max(1) - 1) * stride + base + n
    {
        // SAFETY: avx512f detected; hd a multiple of 16 and at most 256; probs bound checked.
        unsafe { weighted_rows_avx512(rows, hd, probs, stride, base, out) };
        return;
    }
    for r in 0..n {
        for g in 0..group {
            axpy(
                probs[g * stride + base + r],
                &rows[r * hd..(r + 1) * hd],
                &mut out[g * hd..(g + 1) * hd],
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_rows_avx512(
    rows: &[f32],
    hd: usize,
    probs: &[f32],
    stride: usize,
    base: usize,
    out: &mut [f32],
) {
    // SAFETY: forwarded contract; each body handles hd = 16 * C exactly.
    unsafe {
        match hd / 16 {
            1 => weighted_rows_c::<1>(rows, probs, stride, base, out),
            2 => weighted_rows_c::<2>(rows, probs, stride, base, out),
            4 => weighted_rows_c::<4>(rows, probs, stride, base, out),
            8 => weighted_rows_c::<8>(rows, probs, stride, base, out),
            _ => weighted_rows_any(rows, hd, probs, stride, base, out),
        }
    }
}

/// Head width `16 * C` known at compile time, so the `C` accumulators live in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_rows_c<const C: usize>(
    rows: &[f32],
    probs: &[f32],
    stride: usize,
    base: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let hd = 16 * C;
    let group = out.len() / hd;
    let n = rows.len() / hd;
    let rp = rows.as_ptr();
    for g in 0..group {
        let dst = out[g * hd..(g + 1) * hd].as_mut_ptr();
        let mut acc = [_mm512_setzero_ps(); C];
        for (c, a) in acc.iter_mut().enumerate() {
            // SAFETY: c * 16 + 16 <= hd, inside head g's slice of `out`.
            *a = unsafe { _mm512_loadu_ps(dst.add(c * 16)) };
        }
        for r in 0..n {
            let p = _mm512_set1_ps(probs[g * stride + base + r]);
            for (c, a) in acc.iter_mut().enumerate() {
                // SAFETY: r < n rows of hd values each.
                *a = _mm512_fmadd_ps(p, unsafe { _mm512_loadu_ps(rp.add(r * hd + c * 16)) }, *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: as for the loads.
            unsafe { _mm512_storeu_ps(dst.add(c * 16), *a) };
        }
    }
}

/// Any head width that is a multiple of 16 (at most 256).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_rows_any(
    rows: &[f32],
    hd: usize,
    probs: &[f32],
    stride: usize,
    base: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let group = out.len() / hd;
    let n = rows.len() / hd;
    let chunks = hd / 16;
    for g in 0..group {
        let dst = &mut out[g * hd..(g + 1) * hd];
        let mut acc = [_mm512_setzero_ps(); 16];
        for (c, a) in acc.iter_mut().enumerate().take(chunks) {
            // SAFETY: c * 16 + 16 <= hd = dst.len().
            *a = unsafe { _mm512_loadu_ps(dst.as_ptr().add(c * 16)) };
        }
        for r in 0..n {
            let p = _mm512_set1_ps(probs[g * stride + base + r]);
            let row = &rows[r * hd..(r + 1) * hd];
            for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                // SAFETY: c * 16 + 16 <= hd = row.len().
                *a = _mm512_fmadd_ps(p, unsafe { _mm512_loadu_ps(row.as_ptr().add(c * 16)) }, *a);
            }
        }
        for (c, a) in acc.iter().enumerate().take(chunks) {
            // SAFETY: c * 16 + 16 <= hd = dst.len().
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(c * 16), *a) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn dot_rows_matches_naive_sums_for_odd_lengths() {
        let len = 37;
        let w: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
        let xs: Vec<f32> = (0..len * 7).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![0.0; 6];
        dot_rows(&w, &xs, len, &mut out);
        for (t, got) in out.iter().enumerate() {
            let want: f64 = (0..len).map(|k| w[k] as f64 * xs[t * len + k] as f64).sum();
            assert!(
                (*got as f64 - want).abs() < 1e-4,
                "row {t}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn widening_bf16_is_exact() {
        let vals: Vec<bf16> = (0..41)
            .map(|i| bf16::from_f32(i as f32 * -1.25 + 0.5))
            .collect();
        let mut out = vec![0.0; vals.len()];
        widen(TypedSlice::Bf16(&vals), &mut out);
        for (v, o) in vals.iter().zip(&out) {
            assert_eq!(v.to_f32(), *o);
        }
    }

    /// The vector body and a scalar sequential fused multiply-add give the same bits, for
    /// every run split of the tile.
    #[test]
    fn transposed_key_scores_are_exact_sequential_fmas() {
        let (bs, hd, group) = (20usize, 24usize, 3usize);
        let tile: Vec<f32> = (0..bs * hd)
            .map(|i| ((i * 37) % 113) as f32 / 56.0 - 1.0)
            .collect();
        let q: Vec<f32> = (0..group * hd)
            .map(|i| ((i * 11) % 29) as f32 / 14.0 - 1.0)
            .collect();
        let mut whole = vec![0.0f32; group * bs];
        key_scores_transposed(&tile, bs, 0, bs, &q, 0.5, &mut whole, bs, 0);
        let mut split = vec![0.0f32; group * bs];
        key_scores_transposed(&tile, bs, 0, 3, &q, 0.5, &mut split, bs, 0);
        key_scores_transposed(&tile, bs, 3, bs - 3, &q, 0.5, &mut split, bs, 3);
        assert_eq!(whole, split);
        for g in 0..group {
            for r in 0..bs {
                let mut acc = 0.0f32;
                for d in 0..hd {
                    acc = q[g * hd + d].mul_add(tile[d * bs + r], acc);
                }
                assert_eq!(whole[g * bs + r].to_bits(), (acc * 0.5).to_bits());
            }
        }
    }

    #[test]
    fn axpy_adds_scaled_vector() {
        let x: Vec<f32> = (0..35).map(|i| i as f32).collect();
        let mut y = vec![1.0; 35];
        axpy(2.0, &x, &mut y);
        assert!(y
            .iter()
            .enumerate()
            .all(|(i, v)| *v == 1.0 + 2.0 * i as f32));
    }
}
