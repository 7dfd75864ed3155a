//! Register-blocked attention products over one key block for many (query row, query
//! head) pairs at once: the scores `q · key` of every pair over a run of slots of a
//! transposed key tile, and the probability-weighted sums of a run of value rows.
//!
//! Takes the flat query, score and output buffers and a list of pairs (offsets into them):
//! each pair is one query row's query head, so a tile of new tokens and its GQA group are
//! one call. Guarantees: every element is computed exactly as
//! [`Kernels::key_scores_transposed`] and [`Kernels::weighted_rows`] compute it (a score is
//! `scale * Σ_dim q[dim] * key[dim]` summed sequentially over `dim` with fused
//! multiply-adds from zero; an output element accumulates `fma(p, value, out)` over the
//! rows in order), so a pair's bits never depend on which pairs, keys or columns share a
//! call or on the instruction set. The blocking only lets one loaded key or value vector
//! feed several independent FMA chains (one per pair), which is what the per-pair
//! kernels could not do: they were bound by loads and by FMA latency (4 chains).

use crate::math::isa::{Isa, Kernels};

impl Kernels {
    /// For every pair `(q_at, score_at)`: `scores[score_at + r] = scale * Σ_dim
    /// q[q_at + dim] * k_tile[dim * block_size + slot0 + r]` for `r < n`, summed over `dim`
    /// in order with fused multiply-adds (the bits of [`Kernels::key_scores_transposed`]).
    /// `head_dim` is `k_tile.len() / block_size`. Out-of-range arguments write nothing;
    /// pairs whose score runs overlap get one of their values (which is unspecified).
    #[allow(clippy::too_many_arguments)]
    pub fn key_scores_blocked(
        self,
        k_tile: &[f32],
        block_size: usize,
        slot0: usize,
        n: usize,
        q: &[f32],
        pairs: &[(usize, usize)],
        scale: f32,
        scores: &mut [f32],
    ) {
        let hd = k_tile.len() / block_size.max(1);
        let fits = block_size > 0
            && hd > 0
            && hd * block_size == k_tile.len()
            && slot0 + n <= block_size
            && pairs
                .iter()
                .all(|&(qa, sa)| qa + hd <= q.len() && sa + n <= scores.len());
        if !fits || n == 0 || pairs.is_empty() {
            return;
        }
        let args = BlockedScores {
            k: k_tile,
            bs: block_size,
            slot0,
            n,
            hd,
            q,
            pairs,
            scale,
        };
        #[cfg(target_arch = "x86_64")]
        if self.isa() != Isa::Portable && Isa::Avx2.is_supported() {
            // SAFETY: AVX2 and FMA are present (checked); `fits` checked every index the
            // body reads or writes.
            unsafe { avx2::scores(&args, scores) };
            return;
        }
        portable::scores(&args, scores);
    }

    /// For every pair `(p_at, out_at)` and every value row `r` of `rows` (`n` rows of
    /// `hd`) in order: `out[out_at + c] = fma(probs[p_at + r], rows[r * hd + c],
    /// out[out_at + c])` (the bits of [`Kernels::weighted_rows`]). Out-of-range arguments
    /// write nothing; pairs whose outputs overlap get an unspecified mix of their sums
    /// (each body keeps a chunk of pairs in registers), so callers give disjoint ones.
    pub fn weighted_rows_blocked(
        self,
        rows: &[f32],
        hd: usize,
        probs: &[f32],
        pairs: &[(usize, usize)],
        out: &mut [f32],
    ) {
        let n = rows.len() / hd.max(1);
        let fits = hd > 0
            && n * hd == rows.len()
            && pairs
                .iter()
                .all(|&(pa, oa)| pa + n <= probs.len() && oa + hd <= out.len());
        if !fits || n == 0 || pairs.is_empty() {
            return;
        }
        let args = BlockedValues {
            rows,
            n,
            hd,
            probs,
            pairs,
        };
        #[cfg(target_arch = "x86_64")]
        if self.isa() != Isa::Portable && Isa::Avx2.is_supported() && hd.is_multiple_of(8) {
            // SAFETY: AVX2 and FMA are present; hd is a multiple of 8; `fits` checked every
            // index the body reads or writes.
            unsafe { avx2::values(&args, out) };
            return;
        }
        portable::values(&args, out);
    }
}

/// Checked arguments of [`Kernels::key_scores_blocked`].
struct BlockedScores<'a> {
    k: &'a [f32],
    bs: usize,
    slot0: usize,
    n: usize,
    hd: usize,
    q: &'a [f32],
    pairs: &'a [(usize, usize)],
    scale: f32,
}

/// Checked arguments of [`Kernels::weighted_rows_blocked`].
struct BlockedValues<'a> {
    rows: &'a [f32],
    n: usize,
    hd: usize,
    probs: &'a [f32],
    pairs: &'a [(usize, usize)],
}

/// Plain loops, each element in the vector bodies' order.
mod portable {
    use super::{BlockedScores, BlockedValues};

    pub(super) fn scores(s: &BlockedScores<'_>, scores: &mut [f32]) {
        for &(qa, sa) in s.pairs {
            let q = &s.q[qa..qa + s.hd];
            for r in 0..s.n {
                let mut acc = 0.0f32;
                for (dim, &qd) in q.iter().enumerate() {
                    acc = qd.mul_add(s.k[dim * s.bs + s.slot0 + r], acc);
                }
                scores[sa + r] = acc * s.scale;
            }
        }
    }

    pub(super) fn values(v: &BlockedValues<'_>, out: &mut [f32]) {
        for &(pa, oa) in v.pairs {
            for r in 0..v.n {
                let p = v.probs[pa + r];
                let row = &v.rows[r * v.hd..(r + 1) * v.hd];
                for (y, &x) in out[oa..oa + v.hd].iter_mut().zip(row) {
                    *y = p.mul_add(x, *y);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockedScores, BlockedValues};
    use std::arch::x86_64::*;

    /// Lane mask of the first `lanes` (<= 8) lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn lane_mask(lanes: usize) -> __m256i {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), idx)
    }

    /// Scores of `P` pairs over `NV` vectors of 8 slots from `r0`: `P x NV` independent
    /// chains, each summed over every dimension in order; one key load feeds `P` FMAs.
    /// `FULL`: every lane of every vector is a slot of the call (plain loads and stores),
    /// else the lanes past `n` are masked off.
    ///
    /// # Safety
    /// AVX2 and FMA available; `pairs` are `P` checked pairs of `s`; `r0 + 8 (NV - 1) < n`,
    /// and `r0 + 8 NV <= n` when `FULL`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn chunk<const NV: usize, const P: usize, const FULL: bool>(
        s: &BlockedScores<'_>,
        r0: usize,
        pairs: &[(usize, usize)],
        scores: *mut f32,
    ) {
        let mut masks = [_mm256_setzero_si256(); NV];
        for (v, m) in masks.iter_mut().enumerate() {
            *m = lane_mask((s.n - r0 - 8 * v).min(8));
        }
        let qp: [*const f32; P] =
            // SAFETY: each pair's query (hd floats from q_at) is inside `q` (checked).
            std::array::from_fn(|i| unsafe { s.q.as_ptr().add(pairs[i].0) });
        // SAFETY: slot0 + r0 < block_size, so row 0's slot r0 is inside the tile.
        let kp = unsafe { s.k.as_ptr().add(s.slot0 + r0) };
        let mut acc = [[_mm256_setzero_ps(); NV]; P];
        for dim in 0..s.hd {
            let mut kv = [_mm256_setzero_ps(); NV];
            for (v, x) in kv.iter_mut().enumerate() {
                // SAFETY: row `dim` of the tile holds slots slot0 + r0 + 8v .. + 8 when FULL,
                // else its enabled lanes (slots below slot0 + n <= block_size); masked-off
                // lanes are not read.
                unsafe {
                    let at = kp.add(dim * s.bs + 8 * v);
                    *x = if FULL {
                        _mm256_loadu_ps(at)
                    } else {
                        _mm256_maskload_ps(at, masks[v])
                    };
                }
            }
            for (a, &q) in acc.iter_mut().zip(&qp) {
                // SAFETY: dim < hd, inside the pair's query.
                let qb = _mm256_set1_ps(unsafe { *q.add(dim) });
                for (x, &k) in a.iter_mut().zip(&kv) {
                    *x = _mm256_fmadd_ps(qb, k, *x);
                }
            }
        }
        let scale = _mm256_set1_ps(s.scale);
        for (a, &(_, sa)) in acc.iter().zip(pairs) {
            for (v, &x) in a.iter().enumerate() {
                let y = _mm256_mul_ps(x, scale);
                // SAFETY: the pair's scores sa .. sa + n are inside `scores` (checked);
                // stores cover r0 + 8v .. + 8 <= n when FULL, else only enabled lanes.
                unsafe {
                    let at = scores.add(sa + r0 + 8 * v);
                    if FULL {
                        _mm256_storeu_ps(at, y);
                    } else {
                        _mm256_maskstore_ps(at, masks[v], y);
                    }
                }
            }
        }
    }

    /// Every pair over `NV` vectors from `r0`, in chunks of 6 pairs (12 with one vector:
    /// 12 chains, 15 registers), then 4, 2, 1.
    ///
    /// # Safety
    /// As [`chunk`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn all_pairs<const NV: usize, const FULL: bool>(
        s: &BlockedScores<'_>,
        r0: usize,
        scores: *mut f32,
    ) {
        let mut left = s.pairs;
        // SAFETY (every call below): the pairs are checked pairs of `s`; `r0` as the
        // caller's.
        unsafe {
            while !left.is_empty() {
                let taken = match (NV, left.len()) {
                    (1, 12..) => {
                        chunk::<NV, 12, FULL>(s, r0, left, scores);
                        12
                    }
                    (_, 6..) => {
                        chunk::<NV, 6, FULL>(s, r0, left, scores);
                        6
                    }
                    (_, 4..) => {
                        chunk::<NV, 4, FULL>(s, r0, left, scores);
                        4
                    }
                    (_, 2..) => {
                        chunk::<NV, 2, FULL>(s, r0, left, scores);
                        2
                    }
                    _ => {
                        chunk::<NV, 1, FULL>(s, r0, left, scores);
                        1
                    }
                };
                left = &left[taken..];
            }
        }
    }

    /// The score body (see `Kernels::key_scores_blocked`): slots in runs of 16 (two
    /// vectors), a last run of 8 or fewer as one vector.
    ///
    /// # Safety
    /// AVX2 and FMA available; `s` passed `key_scores_blocked`'s checks for `scores`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores(s: &BlockedScores<'_>, scores: &mut [f32]) {
        let out = scores.as_mut_ptr();
        // Each pair's scores of the next block follow these: fetch their lines now (one
        // stream per pair is too many for the hardware prefetcher; a prefetch never
        // faults, so the address may be past the end).
        for &(_, sa) in s.pairs {
            _mm_prefetch::<_MM_HINT_T0>(out.wrapping_add(sa + s.n) as *const i8);
        }
        let mut r0 = 0;
        // SAFETY (every call): r0 < n; the FULL variants only when the vectors are whole.
        unsafe {
            while r0 < s.n {
                let left = s.n - r0;
                match left {
                    16.. => all_pairs::<2, true>(s, r0, out),
                    9..=15 => all_pairs::<2, false>(s, r0, out),
                    8 => all_pairs::<1, true>(s, r0, out),
                    _ => all_pairs::<1, false>(s, r0, out),
                }
                r0 += 16;
            }
        }
    }

    /// Columns `c0 .. c0 + 8 C` of `P` pairs over every value row in order: one value
    /// load feeds `P` FMAs, one probability broadcast `C`.
    ///
    /// # Safety
    /// AVX2 and FMA available; `pairs` are `P` checked pairs of `v`; `c0 + 8 C <= hd`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn value_chunk<const C: usize, const P: usize>(
        v: &BlockedValues<'_>,
        c0: usize,
        pairs: &[(usize, usize)],
        out: *mut f32,
    ) {
        let dst: [*mut f32; P] =
            // SAFETY: each pair's outputs out_at .. out_at + hd are inside `out` (checked).
            std::array::from_fn(|i| unsafe { out.add(pairs[i].1 + c0) });
        let mut acc: [[__m256; C]; P] = [[_mm256_setzero_ps(); C]; P];
        for (a, &d) in acc.iter_mut().zip(&dst) {
            for (c, x) in a.iter_mut().enumerate() {
                // SAFETY: c0 + 8c + 8 <= hd, inside the pair's outputs.
                *x = unsafe { _mm256_loadu_ps(d.add(8 * c)) };
            }
        }
        let rp = v.rows.as_ptr();
        for r in 0..v.n {
            let mut x = [_mm256_setzero_ps(); C];
            for (c, xc) in x.iter_mut().enumerate() {
                // SAFETY: r < n rows of hd; c0 + 8c + 8 <= hd.
                *xc = unsafe { _mm256_loadu_ps(rp.add(r * v.hd + c0 + 8 * c)) };
            }
            for (a, &(pa, _)) in acc.iter_mut().zip(pairs) {
                // SAFETY: pa + r < pa + n <= probs.len() (checked).
                let p = _mm256_set1_ps(unsafe { *v.probs.get_unchecked(pa + r) });
                for (y, &xc) in a.iter_mut().zip(&x) {
                    *y = _mm256_fmadd_ps(p, xc, *y);
                }
            }
        }
        for (a, &d) in acc.iter().zip(&dst) {
            for (c, &y) in a.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { _mm256_storeu_ps(d.add(8 * c), y) };
            }
        }
    }

    /// Pairs `pairs` (`P` of them) over every column, in chunks of 2 vectors (then 1):
    /// a pair's probabilities stay in L1 for all its columns (its rows of scores are far
    /// apart in the tile's scratch, often on the same L1 set). `P x 2` accumulators, 2
    /// value vectors and a broadcast fit the 16 registers (`4 x 3` did not: two
    /// accumulators went through the stack).
    ///
    /// # Safety
    /// As [`value_chunk`], without the column bound: `hd` a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn all_columns<const P: usize>(
        v: &BlockedValues<'_>,
        pairs: &[(usize, usize)],
        out: *mut f32,
    ) {
        // The pairs' probabilities of the next block follow theirs in the scratch: fetch
        // them now (each pair's row is its own stream, too many for the hardware
        // prefetcher; a prefetch never faults, so the address may be past the end).
        for &(pa, _) in &pairs[..P] {
            _mm_prefetch::<_MM_HINT_T0>(v.probs.as_ptr().wrapping_add(pa + v.n) as *const i8);
        }
        let mut c0 = 0;
        // SAFETY (every call): the columns are inside hd.
        unsafe {
            while c0 + 16 <= v.hd {
                value_chunk::<2, P>(v, c0, pairs, out);
                c0 += 16;
            }
            if c0 < v.hd {
                value_chunk::<1, P>(v, c0, pairs, out);
            }
        }
    }

    /// The value body (see `Kernels::weighted_rows_blocked`): pairs in chunks of 6 (12
    /// chains with 2 column vectors), then 4, 2, 1; each element still sums its rows in
    /// order.
    ///
    /// # Safety
    /// AVX2 and FMA available; `hd` a multiple of 8; `v` passed `weighted_rows_blocked`'s
    /// checks for `out`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn values(v: &BlockedValues<'_>, out: &mut [f32]) {
        let out = out.as_mut_ptr();
        let mut left = v.pairs;
        // SAFETY (every call): checked pairs of `v`.
        unsafe {
            while !left.is_empty() {
                let taken = match left.len() {
                    6.. => {
                        all_columns::<6>(v, left, out);
                        6
                    }
                    4.. => {
                        all_columns::<4>(v, left, out);
                        4
                    }
                    2.. => {
                        all_columns::<2>(v, left, out);
                        2
                    }
                    _ => {
                        all_columns::<1>(v, left, out);
                        1
                    }
                };
                left = &left[taken..];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{bits, data};
    use crate::math::isa::{Isa, Kernels};

    /// The blocked score body gives, pair by pair, the bits of the per-group kernel
    /// (`key_scores_transposed`, one call per pair) on every instruction set: slot runs
    /// of every length and offset (whole and masked vectors, one and two vectors), pair
    /// counts that take every chunk size (12, 6, 4, 2, 1), head widths of 5 to 128.
    #[test]
    fn blocked_scores_give_the_per_pair_kernel_s_bits() {
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            for &(bs, hd, n_pairs) in &[
                (16usize, 128usize, 29usize),
                (20, 24, 13),
                (7, 5, 3),
                (32, 8, 1),
            ] {
                let tile = data(bs * hd, 3);
                // Queries at scattered offsets (every third head-width slot, shifted by one).
                let q = data((3 * n_pairs + 1) * hd, 4);
                let stride = bs + 3;
                let pairs: Vec<(usize, usize)> = (0..n_pairs)
                    .map(|i| (1 + 3 * i * hd, i * stride + 2))
                    .collect();
                for slot0 in [0, 1, bs / 2, bs - 1] {
                    for n in [1, 7, 8, 9, 15, 16, 17, bs - slot0] {
                        if n == 0 || slot0 + n > bs {
                            continue;
                        }
                        let mut got = vec![-3.0f32; n_pairs * stride + 2];
                        let mut want = got.clone();
                        k.key_scores_blocked(&tile, bs, slot0, n, &q, &pairs, 0.3, &mut got);
                        for &(qa, sa) in &pairs {
                            k.key_scores_transposed(
                                &tile,
                                bs,
                                slot0,
                                n,
                                &q[qa..qa + hd],
                                0.3,
                                &mut want[sa..sa + n],
                                n,
                                0,
                            );
                        }
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{isa} scores bs {bs} hd {hd} pairs {n_pairs} {slot0}+{n}"
                        );
                    }
                }
            }
        }
    }

    /// The blocked value body gives, pair by pair, the bits of `weighted_rows` (one head
    /// per call) on every instruction set: widths of 4, 8, 24, 72 and 128 columns (every
    /// column chunk and the portable path), pair counts that take every chunk size.
    #[test]
    fn blocked_values_give_the_per_pair_kernel_s_bits() {
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            for &(hd, n, n_pairs) in &[
                (128usize, 16usize, 11usize),
                (72, 5, 4),
                (24, 9, 2),
                (8, 1, 3),
                (4, 3, 5),
            ] {
                let rows = data(n * hd, 5);
                let stride = n + 2;
                let probs = data(n_pairs * stride + 1, 6);
                let pairs: Vec<(usize, usize)> =
                    (0..n_pairs).map(|i| (i * stride + 1, i * hd)).collect();
                let mut got = data(n_pairs * hd, 7);
                let mut want = got.clone();
                k.weighted_rows_blocked(&rows, hd, &probs, &pairs, &mut got);
                for &(pa, oa) in &pairs {
                    k.weighted_rows(&rows, hd, &probs, 0, pa, &mut want[oa..oa + hd]);
                }
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{isa} values hd {hd} n {n} pairs {n_pairs}"
                );
            }
        }
    }
}
