//! The AVX2 body of `y = x Wᵀ` for bf16 `[out, in]` weights and few activation rows (1 to
//! [`MAX_ROWS`]): the decode GEMV (one row) and the grouped expert GEMMs of a batched
//! decode step (a few rows routed to each expert).
//!
//! With few rows a product is bound by reading the weights (one row) or by the
//! instructions spent per weight (a few rows), not by the multiply-adds alone. So each
//! weight row is loaded once for every activation row (the activation rows sit in L1),
//! 16 bf16 weights are widened with one 256-bit load and two integer ops (the even
//! elements shifted up, the odd ones masked: no shuffles), and the weight rows 16 rows
//! ahead are prefetched as they go. Takes the activation rows through
//! [`EvenOddRows`] (each 16-block's even elements, then its odd ones, zero-padded to a
//! whole block), so one register holds the even lanes and one the odd lanes of a block.
//!
//! Guarantees: every output element is summed exactly as the portable body of
//! `linear` sums it (16 interleaved lanes, lane `l` taking `k ≡ l mod 16` with fused
//! multiply-adds in order, then the fixed tree `l += l + 8, + 4, + 2, + 1`); the even
//! register holds lanes 0, 2, .., 14 and the odd one 1, 3, .., 15, and [`reduce`] pairs
//! them as the tree does. So the bits are the portable body's whatever the row count.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The most activation rows this body takes; from 8 rows on, the general body's widened
/// f32 panels take over (a weight row widened once then serves enough register blocks).
pub(super) const MAX_ROWS: usize = 7;

/// Weight rows ahead of the row being multiplied that each pass prefetches, at every
/// 16-block (32 bytes, so twice per 64-byte line): the hardware prefetcher alone kept the
/// decode GEMV at 13-17 GB/s on the 2-core EPYC of docs/performance.md, 16 rows ahead at
/// 17-20 GB/s; a hint per block streamed about 5% faster than one per line there (median
/// of 25 interleaved rounds against the streaming read, twice: 95.1-96.6% against
/// 89.5-90.5%; checkpoint rows are rarely line-aligned).
const PREFETCH_ROWS: usize = 16;

/// Activation rows laid out for the even/odd lanes: per 16-block of a row, its 8 even
/// elements then its 8 odd ones; each row zero-padded to whole blocks.
pub(super) struct EvenOddRows {
    data: Vec<f32>,
    n_rows: usize,
    /// Values per padded row (a multiple of 16).
    padded: usize,
}

impl EvenOddRows {
    /// Activation rows held.
    pub(super) fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Values per padded row (a multiple of 16).
    pub(super) fn padded(&self) -> usize {
        self.padded
    }

    /// The rows, `padded` values each.
    pub(super) fn data(&self) -> &[f32] {
        &self.data
    }

    /// Lays out `n_rows` rows of `k_len` values of `x` (`x.len() >= n_rows * k_len`).
    pub(super) fn new(x: &[f32], n_rows: usize, k_len: usize) -> Self {
        let padded = k_len.div_ceil(16) * 16;
        let mut data = vec![0.0f32; n_rows * padded];
        for (row, dst) in x.chunks(k_len).take(n_rows).zip(data.chunks_mut(padded)) {
            for (block, d) in row.chunks(16).zip(dst.chunks_mut(16)) {
                for (i, v) in block.iter().enumerate() {
                    d[(i % 2) * 8 + i / 2] = *v;
                }
            }
        }
        EvenOddRows {
            data,
            n_rows,
            padded,
        }
    }
}

/// Rows `o0..o0 + rows` of `w` (bf16 `[out, k_len]`, as raw bits) times every activation
/// row into `local[t * rows + o]`.
///
/// # Safety
/// AVX2 and FMA available; `w.len() >= (o0 + rows) * k_len`; `x` was laid out for
/// `k_len`; `local.len()` is at least `rows` times the rows `x` holds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn panel(
    x: &EvenOddRows,
    w: &[u16],
    k_len: usize,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let n_rows = x.n_rows;
    if rows == 0 || n_rows == 0 {
        return;
    }
    let full = k_len / 16;
    let ctx = Ctx {
        w: w.as_ptr(),
        k_len,
        full,
        x: x.data.as_ptr(),
        padded: x.padded,
    };
    let mut o = 0;
    while o < rows {
        // Four weight rows per step; past the panel's end the last row repeats (its
        // results are not stored).
        let wr: [usize; 4] = std::array::from_fn(|i| o0 + (o + i).min(rows - 1));
        let live = (rows - o).min(4);
        let mut t = 0;
        // SAFETY (every call below): weight rows < o0 + rows and activation rows <
        // n_rows, the bounds this function's contract gives.
        unsafe {
            while n_rows - t >= 4 {
                for i in 0..live {
                    let s = ctx.block::<1, 4>([wr[i]], [t, t + 1, t + 2, t + 3]);
                    for (j, v) in s[0].iter().enumerate() {
                        local[(t + j) * rows + o + i] = *v;
                    }
                }
                t += 4;
            }
            match n_rows - t {
                3 => {
                    for i in 0..live {
                        let s = ctx.block::<1, 3>([wr[i]], [t, t + 1, t + 2]);
                        for (j, v) in s[0].iter().enumerate() {
                            local[(t + j) * rows + o + i] = *v;
                        }
                    }
                }
                2 => {
                    for i0 in (0..live).step_by(2) {
                        let s = ctx.block::<2, 2>([wr[i0], wr[i0 + 1]], [t, t + 1]);
                        for (i, sums) in s.iter().enumerate().take(live - i0) {
                            for (j, v) in sums.iter().enumerate() {
                                local[(t + j) * rows + o + i0 + i] = *v;
                            }
                        }
                    }
                }
                1 => {
                    let s = ctx.block::<4, 1>(wr, [t]);
                    for (i, sums) in s.iter().enumerate().take(live) {
                        local[t * rows + o + i] = sums[0];
                    }
                }
                _ => {}
            }
        }
        o += 4;
    }
}

/// Pointers and sizes one panel's register blocks share.
#[cfg(target_arch = "x86_64")]
struct Ctx {
    w: *const u16,
    k_len: usize,
    /// Whole 16-blocks per weight row.
    full: usize,
    x: *const f32,
    padded: usize,
}

#[cfg(target_arch = "x86_64")]
impl Ctx {
    /// `WR` weight rows (by index) times `XR` activation rows (by index): `2 * WR * XR`
    /// accumulators (even and odd lanes), each weight block loaded once for all rows.
    ///
    /// # Safety
    /// AVX2 and FMA available; the rows are inside the matrix and the activation rows.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn block<const WR: usize, const XR: usize>(
        &self,
        wrows: [usize; WR],
        xrows: [usize; XR],
    ) -> [[f32; XR]; WR] {
        let z = _mm256_setzero_ps();
        let mut even = [[z; XR]; WR];
        let mut odd = [[z; XR]; WR];
        let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        let wp: [*const u16; WR] =
            std::array::from_fn(|i| self.w.wrapping_add(wrows[i] * self.k_len));
        let xp: [*const f32; XR] =
            std::array::from_fn(|j| self.x.wrapping_add(xrows[j] * self.padded));
        let ahead = PREFETCH_ROWS * self.k_len;
        for b in 0..self.full {
            // SAFETY: block b < full lies inside each weight row and each padded
            // activation row (the caller's contract).
            unsafe {
                for p in wp {
                    // A hint only: an address past the matrix is never read.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + b * 16) as *const i8);
                }
                let mut we = [_mm256_setzero_ps(); WR];
                let mut wo = [_mm256_setzero_ps(); WR];
                for i in 0..WR {
                    let raw = _mm256_loadu_si256(wp[i].add(b * 16) as *const __m256i);
                    we[i] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    wo[i] = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                }
                for j in 0..XR {
                    let xe = _mm256_loadu_ps(xp[j].add(b * 16));
                    let xo = _mm256_loadu_ps(xp[j].add(b * 16 + 8));
                    for i in 0..WR {
                        even[i][j] = _mm256_fmadd_ps(we[i], xe, even[i][j]);
                        odd[i][j] = _mm256_fmadd_ps(wo[i], xo, odd[i][j]);
                    }
                }
            }
        }
        let tail = self.k_len - self.full * 16;
        if tail > 0 {
            // The ragged last block from zero-padded copies: lanes past `k_len` add 0 * 0
            // (the activation rows are zero-padded already), as the other bodies do.
            for i in 0..WR {
                // SAFETY: the row's last `tail` elements are inside the matrix.
                let buf = unsafe { padded_tail(wp[i], self.full * 16, tail) };
                // SAFETY: `buf` holds 16 values; the padded activation rows hold the block.
                unsafe {
                    let raw = _mm256_loadu_si256(buf.as_ptr() as *const __m256i);
                    let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                    let wo = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                    for j in 0..XR {
                        let xe = _mm256_loadu_ps(xp[j].add(self.full * 16));
                        let xo = _mm256_loadu_ps(xp[j].add(self.full * 16 + 8));
                        even[i][j] = _mm256_fmadd_ps(we, xe, even[i][j]);
                        odd[i][j] = _mm256_fmadd_ps(wo, xo, odd[i][j]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; XR]; WR];
        for i in 0..WR {
            for j in 0..XR {
                out[i][j] = reduce(even[i][j], odd[i][j]);
            }
        }
        out
    }
}

/// Elements `start .. start + tail` (`tail < 16`) of a weight row, zero-padded to a
/// 16-block: the ragged last block of a row, whose padding lanes add 0 * 0.
///
/// # Safety
/// `row.add(start) .. row.add(start + tail)` lies inside the matrix.
pub(super) unsafe fn padded_tail(row: *const u16, start: usize, tail: usize) -> [u16; 16] {
    let mut buf = [0u16; 16];
    // SAFETY: the caller's contract.
    let src = unsafe { std::slice::from_raw_parts(row.add(start), tail) };
    buf[..tail].copy_from_slice(src);
    buf
}

/// The portable body's tree over lanes held as even (0, 2, .., 14) and odd (1, 3, .., 15)
/// registers: halves added give lanes `l + (l + 8)` (evens 0, 2, 4, 6 and odds 1, 3, 5,
/// 7), the high pair added to the low pair gives `l + (l + 4)` for l < 4, interleaving
/// the two gives those four lanes in order, and the last two steps are the portable ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn reduce(even: __m256, odd: __m256) -> f32 {
    let e8 = _mm_add_ps(
        _mm256_castps256_ps128(even),
        _mm256_extractf128_ps::<1>(even),
    );
    let o8 = _mm_add_ps(_mm256_castps256_ps128(odd), _mm256_extractf128_ps::<1>(odd));
    let e4 = _mm_add_ps(e8, _mm_movehl_ps(e8, e8));
    let o4 = _mm_add_ps(o8, _mm_movehl_ps(o8, o8));
    let s4 = _mm_unpacklo_ps(e4, o4);
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout: each 16-block's evens then odds, the ragged block zero-padded.
    #[test]
    fn even_odd_layout_by_hand() {
        let x: Vec<f32> = (0..36).map(|i| i as f32).collect();
        let rows = EvenOddRows::new(&x, 2, 18);
        assert_eq!(rows.padded, 32);
        let want_first: Vec<f32> = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert_eq!(&rows.data[..16], &want_first[..]);
        let mut want_tail = [0.0f32; 16];
        want_tail[0] = 16.0;
        want_tail[8] = 17.0;
        assert_eq!(&rows.data[16..32], &want_tail[..]);
        assert_eq!(rows.data[32], 18.0);
        assert_eq!(rows.data[40], 19.0);
    }
}
