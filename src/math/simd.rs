//! Inner loops shared by the attention kernels: widening stored weights to f32, axpy,
//! attention scores over a transposed key tile and probability-weighted value rows.
//!
//! Takes f32 slices (and weight slices in their stored dtype); each function has an
//! AVX-512 body, an AVX2+FMA body and a portable body, picked by the [`Kernels`] context
//! (the free functions use the process's choice, [`Kernels::process`]). Guarantees: the
//! three bodies give the same bits (every element is accumulated in the same order with
//! fused multiply-adds; unit tests compare them), so which one runs never changes a
//! result. Accumulation is always f32.

use crate::math::isa::{Isa, Kernels};
use crate::math::tensor::TypedSlice;
use half::slice::HalfFloatSliceExt;

/// True when this CPU has the AVX-512 bodies (reported by benches).
pub fn avx512_available() -> bool {
    Isa::Avx512.is_supported()
}

/// Widens `src` into `dst` (equal lengths) as f32, with the process's kernels.
pub fn widen(src: TypedSlice<'_>, dst: &mut [f32]) {
    Kernels::process().widen(src, dst);
}

/// `y = fma(a, x, y)` element-wise (equal lengths), with the process's kernels.
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    Kernels::process().axpy(a, x, y);
}

/// [`Kernels::key_scores_transposed`] with the process's kernels.
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
    Kernels::process().key_scores_transposed(
        k_tile, block_size, slot0, n, q_group, scale, scores, stride, base,
    );
}

/// [`Kernels::weighted_rows`] with the process's kernels.
pub fn weighted_rows(
    rows: &[f32],
    hd: usize,
    probs: &[f32],
    stride: usize,
    base: usize,
    out: &mut [f32],
) {
    Kernels::process().weighted_rows(rows, hd, probs, stride, base, out);
}

impl Kernels {
    /// Widens `src` into `dst` (equal lengths) as f32; exact for every float dtype, and
    /// ggml's reference decoding for quantised weights (the same bits for every `isa`).
    pub fn widen(self, src: TypedSlice<'_>, dst: &mut [f32]) {
        debug_assert_eq!(src.len(), dst.len());
        match src {
            TypedSlice::F32(s) => {
                let n = s.len().min(dst.len());
                dst[..n].copy_from_slice(&s[..n]);
            }
            TypedSlice::F16(s) => {
                let n = s.len().min(dst.len());
                s[..n].convert_to_f32_slice(&mut dst[..n]);
            }
            TypedSlice::Bf16(s) => {
                let bits: &[u16] = bytemuck::cast_slice(s);
                match self.isa() {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: a `Kernels` value names only an instruction set this CPU has.
                    Isa::Avx512 => unsafe { avx512::widen_bf16(bits, dst) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Isa::Avx2 => unsafe { avx2::widen_bf16(bits, dst) },
                    _ => portable::widen_bf16(bits, dst),
                }
            }
            TypedSlice::Quant(q) => {
                // Lengths were checked against each other above (debug) and by every
                // caller's view; a mismatch leaves `dst` as it was rather than panicking.
                let n = q.len.min(dst.len());
                let _ = q.dequantize_into(&mut dst[..n]);
            }
        }
    }

    /// `y[i] = fma(a, x[i], y[i])` (equal lengths; a longer `y` keeps its tail).
    pub fn axpy(self, a: f32, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), y.len());
        let n = x.len().min(y.len());
        let (x, y) = (&x[..n], &mut y[..n]);
        match self.isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` value names only an instruction set this CPU has.
            Isa::Avx512 => unsafe { avx512::axpy(a, x, y) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { avx2::axpy(a, x, y) },
            _ => portable::axpy(a, x, y),
        }
    }

    /// Attention scores for `n` consecutive slots starting at `slot0` of one transposed
    /// key tile (`k_tile[dim * block_size + slot]`): `scores[g * stride + base + r] =
    /// scale * Σ_dim q_group[g][dim] * key[slot0 + r][dim]`, summed sequentially over `dim`
    /// with fused multiply-adds (so every body gives the same bits, and a score never
    /// depends on which other keys share the call). Out-of-range arguments write nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn key_scores_transposed(
        self,
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
        let fits = block_size > 0
            && hd * block_size == k_tile.len()
            && group * hd == q_group.len()
            && slot0 + n <= block_size
            && scores.len() >= (group.max(1) - 1) * stride + base + n;
        if !fits || n == 0 || group == 0 {
            return;
        }
        let args = ScoreArgs {
            k_tile,
            block_size,
            slot0,
            n,
            q_group,
            hd,
            group,
            scale,
            stride,
            base,
        };
        match self.isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the instruction set is this CPU's (a `Kernels` invariant); `fits`
            // checked every bound the body relies on.
            Isa::Avx512 => unsafe { avx512::key_scores(&args, scores) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { avx2::key_scores(&args, scores) },
            _ => portable::key_scores(&args, scores),
        }
    }

    /// `out[g] = fma(probs[g * stride + base + r], rows[r], out[g])` for every key row `r`
    /// in order and every query head `g` (rows contiguous, each `hd` wide): the same
    /// per-element order as repeated [`Kernels::axpy`]. Out-of-range arguments write
    /// nothing.
    pub fn weighted_rows(
        self,
        rows: &[f32],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
    ) {
        if hd == 0 {
            return;
        }
        let group = out.len() / hd;
        let n = rows.len() / hd;
        if group == 0 || n == 0 || probs.len() < (group - 1) * stride + base + n {
            return;
        }
        let rows = &rows[..n * hd];
        let out = &mut out[..group * hd];
        match self.isa() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the instruction set is this CPU's; hd is a multiple of 16; `probs`,
            // `rows` and `out` bounds checked above.
            Isa::Avx512 if hd.is_multiple_of(16) => unsafe {
                avx512::weighted_rows(rows, hd, probs, stride, base, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, hd a multiple of 8.
            Isa::Avx2 | Isa::Avx512 if hd.is_multiple_of(8) && Isa::Avx2.is_supported() => unsafe {
                avx2::weighted_rows(rows, hd, probs, stride, base, out)
            },
            _ => {
                for r in 0..n {
                    for g in 0..group {
                        self.axpy(
                            probs[g * stride + base + r],
                            &rows[r * hd..(r + 1) * hd],
                            &mut out[g * hd..(g + 1) * hd],
                        );
                    }
                }
            }
        }
    }
}

// The register-blocked products over many (query row, query head) pairs at once.
#[path = "simd_blocked.rs"]
mod blocked;

/// Checked arguments of a key-score call (see [`Kernels::key_scores_transposed`]).
struct ScoreArgs<'a> {
    k_tile: &'a [f32],
    block_size: usize,
    slot0: usize,
    n: usize,
    q_group: &'a [f32],
    hd: usize,
    group: usize,
    scale: f32,
    stride: usize,
    base: usize,
}

/// Plain loops in the SIMD bodies' order.
mod portable {
    use super::ScoreArgs;

    pub(super) fn widen_bf16(src: &[u16], dst: &mut [f32]) {
        for (d, &b) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((b as u32) << 16);
        }
    }

    pub(super) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = a.mul_add(xi, *yi);
        }
    }

    pub(super) fn key_scores(s: &ScoreArgs<'_>, scores: &mut [f32]) {
        for g in 0..s.group {
            let q = &s.q_group[g * s.hd..(g + 1) * s.hd];
            for r in 0..s.n {
                let mut acc = 0.0f32;
                for (dim, &qd) in q.iter().enumerate() {
                    acc = qd.mul_add(s.k_tile[dim * s.block_size + s.slot0 + r], acc);
                }
                scores[g * s.stride + s.base + r] = acc * s.scale;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::ScoreArgs;
    use std::arch::x86_64::*;

    /// # Safety
    /// avx512f available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_bf16(src: &[u16], dst: &mut [f32]) {
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
        super::portable::widen_bf16(&src[i..n], &mut dst[i..n]);
    }

    /// # Safety
    /// avx512f available; `x.len() == y.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
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
        super::portable::axpy(a, &x[i..n], &mut y[i..n]);
    }

    /// # Safety
    /// avx512f available; the arguments passed `key_scores_transposed`'s bound checks.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn key_scores(s: &ScoreArgs<'_>, scores: &mut [f32]) {
        let (hd, group, bs) = (s.hd, s.group, s.block_size);
        let scale_v = _mm512_set1_ps(s.scale);
        let kp = s.k_tile.as_ptr();
        let qp = s.q_group.as_ptr();
        let mut r0 = 0;
        while r0 < s.n {
            let lanes = (s.n - r0).min(16);
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
                    // SAFETY: slots slot0+r0 .. slot0+r0+lanes <= block_size (checked), so
                    // the masked lanes stay inside row `dim` of the tile; q indices < group*hd.
                    unsafe {
                        let kv = _mm512_maskz_loadu_ps(mask, kp.add(dim * bs + s.slot0 + r0));
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
                    // (checked).
                    unsafe {
                        _mm512_mask_storeu_ps(
                            scores.as_mut_ptr().add((g0 + i) * s.stride + s.base + r0),
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

    /// # Safety
    /// avx512f available; `hd` a multiple of 16; `rows` holds whole rows, `out` whole heads;
    /// `probs` covers every index read.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_rows(
        rows: &[f32],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
    ) {
        let group = out.len() / hd;
        let n = rows.len() / hd;
        let rp = rows.as_ptr();
        // Columns in chunks of up to 8 vectors kept in registers; each element still sums
        // its keys in order, so the chunking does not change any bits.
        for g in 0..group {
            let dst = out[g * hd..(g + 1) * hd].as_mut_ptr();
            let mut c0 = 0;
            while c0 < hd {
                let chunks = ((hd - c0) / 16).min(8);
                let mut acc = [_mm512_setzero_ps(); 8];
                for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                    // SAFETY: c0 + c*16 + 16 <= hd, inside head g's slice of `out`.
                    *a = unsafe { _mm512_loadu_ps(dst.add(c0 + c * 16)) };
                }
                for r in 0..n {
                    let p = _mm512_set1_ps(probs[g * stride + base + r]);
                    for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                        // SAFETY: r < n rows of hd values each; column c0+c*16+16 <= hd.
                        let v = unsafe { _mm512_loadu_ps(rp.add(r * hd + c0 + c * 16)) };
                        *a = _mm512_fmadd_ps(p, v, *a);
                    }
                }
                for (c, a) in acc.iter().enumerate().take(chunks) {
                    // SAFETY: as for the loads.
                    unsafe { _mm512_storeu_ps(dst.add(c0 + c * 16), *a) };
                }
                c0 += chunks * 16;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::ScoreArgs;
    use std::arch::x86_64::*;

    /// # Safety
    /// avx2 available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn widen_bf16(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n bounds the 16-byte load and the 32-byte store.
            unsafe {
                let raw = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                let wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(wide));
            }
            i += 8;
        }
        super::portable::widen_bf16(&src[i..n], &mut dst[i..n]);
    }

    /// # Safety
    /// avx2 and fma available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n = x.len() = y.len().
            unsafe {
                let yv = _mm256_loadu_ps(y.as_ptr().add(i));
                let r = _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), yv);
                _mm256_storeu_ps(y.as_mut_ptr().add(i), r);
            }
            i += 8;
        }
        super::portable::axpy(a, &x[i..n], &mut y[i..n]);
    }

    /// Lane mask for the first `lanes` (< 8) of a vector, for `maskload`/`maskstore`.
    #[target_feature(enable = "avx2,fma")]
    fn lane_mask(lanes: usize) -> __m256i {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), idx)
    }

    /// # Safety
    /// avx2 and fma available; the arguments passed `key_scores_transposed`'s bound checks.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn key_scores(s: &ScoreArgs<'_>, scores: &mut [f32]) {
        let (hd, group, bs) = (s.hd, s.group, s.block_size);
        let scale_v = _mm256_set1_ps(s.scale);
        let kp = s.k_tile.as_ptr();
        let qp = s.q_group.as_ptr();
        let mut r0 = 0;
        while r0 < s.n {
            let lanes = (s.n - r0).min(8);
            let mask = lane_mask(lanes);
            let mut g0 = 0;
            while g0 < group {
                let qo = [
                    g0,
                    (g0 + 1).min(group - 1),
                    (g0 + 2).min(group - 1),
                    (g0 + 3).min(group - 1),
                ];
                let z = _mm256_setzero_ps();
                let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
                for dim in 0..hd {
                    // SAFETY: the enabled lanes are slots slot0+r0 .. slot0+r0+lanes <=
                    // block_size (checked) of row `dim`; masked-off lanes are not read.
                    unsafe {
                        let kv = _mm256_maskload_ps(kp.add(dim * bs + s.slot0 + r0), mask);
                        a0 = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(qo[0] * hd + dim)), kv, a0);
                        a1 = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(qo[1] * hd + dim)), kv, a1);
                        a2 = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(qo[2] * hd + dim)), kv, a2);
                        a3 = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(qo[3] * hd + dim)), kv, a3);
                    }
                }
                for (i, a) in [a0, a1, a2, a3].into_iter().enumerate() {
                    if g0 + i >= group {
                        break;
                    }
                    let out = _mm256_mul_ps(a, scale_v);
                    // SAFETY: the enabled lanes' indices (g0+i)*stride+base+r0 .. +lanes are
                    // inside `scores` (checked).
                    unsafe {
                        _mm256_maskstore_ps(
                            scores.as_mut_ptr().add((g0 + i) * s.stride + s.base + r0),
                            mask,
                            out,
                        )
                    };
                }
                g0 += 4;
            }
            r0 += 8;
        }
    }

    /// # Safety
    /// avx2 and fma available; `hd` a multiple of 8; `rows` holds whole rows, `out` whole
    /// heads; `probs` covers every index read.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_rows(
        rows: &[f32],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
    ) {
        let group = out.len() / hd;
        let n = rows.len() / hd;
        let rp = rows.as_ptr();
        // Columns in chunks of up to 8 vectors kept in registers; each element still sums
        // its keys in order, so the chunking does not change any bits.
        for g in 0..group {
            let dst = out[g * hd..(g + 1) * hd].as_mut_ptr();
            let mut c0 = 0;
            while c0 < hd {
                let chunks = ((hd - c0) / 8).min(8);
                let mut acc = [_mm256_setzero_ps(); 8];
                for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                    // SAFETY: c0 + c*8 + 8 <= hd, inside head g's slice of `out`.
                    *a = unsafe { _mm256_loadu_ps(dst.add(c0 + c * 8)) };
                }
                for r in 0..n {
                    let p = _mm256_set1_ps(probs[g * stride + base + r]);
                    for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                        // SAFETY: r < n rows of hd values each; column c0+c*8+8 <= hd.
                        let v = unsafe { _mm256_loadu_ps(rp.add(r * hd + c0 + c * 8)) };
                        *a = _mm256_fmadd_ps(p, v, *a);
                    }
                }
                for (c, a) in acc.iter().enumerate().take(chunks) {
                    // SAFETY: as for the loads.
                    unsafe { _mm256_storeu_ps(dst.add(c0 + c * 8), *a) };
                }
                c0 += chunks * 8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Deterministic values in [-1, 1) (the blocked bodies' tests use them too).
    pub(super) fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919) % 2003) as f32 / 1001.0 - 1.0)
            .collect()
    }

    /// Each value's bits, so equal vectors mean equal bits (NaN included).
    pub(super) fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn widening_bf16_is_exact() {
        let vals: Vec<bf16> = (0..41)
            .map(|i| bf16::from_f32(i as f32 * -1.25 + 0.5))
            .collect();
        for k in Isa::supported()
            .into_iter()
            .filter_map(|i| Kernels::new(i).ok())
        {
            let mut out = vec![0.0; vals.len()];
            k.widen(TypedSlice::Bf16(&vals), &mut out);
            for (v, o) in vals.iter().zip(&out) {
                assert_eq!(v.to_f32(), *o, "{:?}", k.isa());
            }
        }
    }

    /// Every SIMD body gives the portable body's bits (and the portable axpy is a plain
    /// fused multiply-add per element).
    #[test]
    fn simd_bodies_give_the_portable_bits() {
        let p = Kernels::portable();
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            for n in [1usize, 7, 8, 15, 16, 33, 100] {
                let x = data(n, 1);
                let mut y = data(n, 2);
                let mut y2 = y.clone();
                let want: Vec<f32> = x
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| 0.3f32.mul_add(*a, *b))
                    .collect();
                k.axpy(0.3, &x, &mut y);
                p.axpy(0.3, &x, &mut y2);
                assert_eq!(bits(&y), bits(&want), "{isa} axpy n={n}");
                assert_eq!(bits(&y2), bits(&want), "portable axpy n={n}");
            }
            for &(bs, hd, group) in &[(20usize, 24usize, 3usize), (16, 128, 4), (5, 8, 1)] {
                let tile = data(bs * hd, 3);
                let q = data(group * hd, 4);
                for (slot0, n) in [(0, bs), (1, bs - 1), (bs / 2, bs - bs / 2), (bs - 1, 1)] {
                    let mut a = vec![7.0f32; group * bs];
                    let mut b = a.clone();
                    k.key_scores_transposed(&tile, bs, slot0, n, &q, 0.25, &mut a, bs, slot0);
                    p.key_scores_transposed(&tile, bs, slot0, n, &q, 0.25, &mut b, bs, slot0);
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "{isa} scores {bs}x{hd}x{group} {slot0}+{n}"
                    );
                }
                let n_keys = bs;
                let rows = data(n_keys * hd, 5);
                let probs = data(group * n_keys + 3, 6);
                let mut a = data(group * hd, 7);
                let mut b = a.clone();
                k.weighted_rows(&rows, hd, &probs, n_keys, 3, &mut a);
                p.weighted_rows(&rows, hd, &probs, n_keys, 3, &mut b);
                assert_eq!(bits(&a), bits(&b), "{isa} weighted rows {bs}x{hd}x{group}");
            }
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
