//! What the AVX2 and AVX-512 quantised-product bodies share: the activation side laid out
//! for eight rows at a time, the reduction of eight rows' integer lanes, the f32 block
//! values of eight rows, and the loop over weight rows, blocks and row groups.
//!
//! Why eight rows at a time: a block's integer sums come out of the dot-product
//! instructions as lanes of partial sums, one register per activation row; reducing
//! eight rows' registers together (one transposing tree of horizontal adds) gives the
//! eight rows' exact totals in one register, and the f32 block value of [`super::dot`]
//! is then computed for the eight rows with one vector operation per scalar step (the
//! same operations in the same order, so the same bits as the portable body).

use super::q8::{ActFormat, Q8Rows};
use super::QK_K;
use std::arch::x86_64::*;

/// Rows per group (the f32 lanes of a 256-bit register).
pub(super) const GROUP: usize = 8;

/// The per-block scalars of the activation rows, transposed so a group's eight rows
/// are adjacent: `d[(b * groups + g) * 8 + l]` and, for Q8_K, the code sums in pairs
/// `pairs[((b * 8 + p) * groups + g) * 8 + l]` = `bsum[2p]` (low 16 bits) and
/// `bsum[2p + 1]` (high 16 bits) of row `8g + l`. Rows past the last are zero.
pub(super) struct GroupedActs<'a> {
    /// The quantised rows (codes read from here, row-major).
    pub q: &'a Q8Rows,
    /// Groups of eight rows.
    pub groups: usize,
    d: Vec<f32>,
    pairs: Vec<i32>,
}

impl<'a> GroupedActs<'a> {
    /// Transposes the scalars of `q`.
    pub fn new(q: &'a Q8Rows) -> Self {
        let groups = q.n_rows.div_ceil(GROUP);
        let nb = q.blocks_per_row();
        let padded = groups * GROUP;
        let mut d = vec![0.0f32; nb * padded];
        let mut pairs = Vec::new();
        for r in 0..q.n_rows {
            for b in 0..nb {
                d[b * padded + r] = q.block_d(r, b);
            }
        }
        if q.format == ActFormat::Q8K {
            pairs = vec![0i32; nb * 8 * padded];
            for r in 0..q.n_rows {
                for b in 0..nb {
                    let s = q.block_bsums(r, b);
                    for p in 0..QK_K / 32 {
                        let packed =
                            (s[2 * p] as u16 as u32) | ((s[2 * p + 1] as u16 as u32) << 16);
                        pairs[(b * 8 + p) * padded + r] = packed as i32;
                    }
                }
            }
        }
        GroupedActs {
            q,
            groups,
            d,
            pairs,
        }
    }

    /// Rows in group `g`.
    pub fn group_len(&self, g: usize) -> usize {
        GROUP.min(self.q.n_rows - g * GROUP)
    }

    /// The codes of block `b` of row `r`.
    pub fn codes(&self, r: usize, b: usize) -> *const i8 {
        self.q.block_qs(r, b).as_ptr()
    }

    /// The eight scales of group `g`, block `b`.
    ///
    /// # Safety
    /// AVX available; `b` and `g` in range.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn dy(&self, b: usize, g: usize) -> __m256 {
        let at = (b * self.groups + g) * GROUP;
        debug_assert!(at + GROUP <= self.d.len());
        // SAFETY: `d` holds `nb * groups * 8` values and b < nb, g < groups.
        unsafe { _mm256_loadu_ps(self.d.as_ptr().add(at)) }
    }

    /// `Σ_p coef[p] · pair_p` per row of group `g`, block `b` (Q8_K rows): pairs of code
    /// sums times pairs of 16-bit coefficients (`coef[p]` = low | high << 16).
    ///
    /// # Safety
    /// AVX2 available; the rows are Q8_K; `b` and `g` in range.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn pair_dot(&self, b: usize, g: usize, coef: &[i32; 8]) -> __m256i {
        let padded = self.groups * GROUP;
        let base = b * 8 * padded + g * GROUP;
        debug_assert!(base + 7 * padded + GROUP <= self.pairs.len());
        let mut acc = _mm256_setzero_si256();
        for (p, &c) in coef.iter().enumerate() {
            // SAFETY: `pairs` holds `nb * 8 * padded` values; b < nb, p < 8, g < groups.
            let v = unsafe {
                _mm256_loadu_si256(self.pairs.as_ptr().add(base + p * padded) as *const __m256i)
            };
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi32(c)));
        }
        acc
    }
}

/// The totals of eight rows' lanes: lane `l` of the result is the sum of the eight lanes
/// of `v[l]` (integer adds, exact in any order).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    // Per 128-bit half: rows 0-3 (resp. 4-7), each the sum of that half's four lanes.
    let q0 = _mm256_hadd_epi32(h01, h23);
    let q1 = _mm256_hadd_epi32(h45, h67);
    let lo = _mm256_permute2x128_si256::<0x20>(q0, q1);
    let hi = _mm256_permute2x128_si256::<0x31>(q0, q1);
    _mm256_add_epi32(lo, hi)
}

/// The Q4_K/Q5_K block value of eight rows: `(dx·dy)·f32(isum) − (dmin·dy)·f32(imin)`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn k4_values(dx: f32, dmin: f32, dy: __m256, isum: __m256i, imin: __m256i) -> __m256 {
    let a = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_set1_ps(dx), dy),
        _mm256_cvtepi32_ps(isum),
    );
    let m = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_set1_ps(dmin), dy),
        _mm256_cvtepi32_ps(imin),
    );
    _mm256_sub_ps(a, m)
}

/// The Q6_K/Q8_0 block value of eight rows: `(dx·dy)·f32(isum)`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn d_values(dx: f32, dy: __m256, isum: __m256i) -> __m256 {
    _mm256_mul_ps(
        _mm256_mul_ps(_mm256_set1_ps(dx), dy),
        _mm256_cvtepi32_ps(isum),
    )
}

/// The f16 at `b[at..at + 2]` widened.
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The eight 6-bit scales and mins of a Q4_K/Q5_K super-block from its 12 packed bytes,
/// four at a time in 32-bit words (the layout of `blocks::scale_min_k4`: words 0 and 1
/// hold scales/mins 0-3 in their low 6 bits per byte and bits 4-5 of scales/mins 4-7 in
/// their top 2; word 2 holds the low 4 bits of scale `4 + i` and min `4 + i`).
pub(super) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let sc_lo = w0 & 0x3f3f_3f3f;
    let m_lo = w1 & 0x3f3f_3f3f;
    let sc_hi = (w2 & 0x0f0f_0f0f) | (((w0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((w2 >> 4) & 0x0f0f_0f0f) | (((w1 >> 6) & 0x0303_0303) << 4);
    let join = |lo: u32, hi: u32| {
        let (a, b) = (lo.to_le_bytes(), hi.to_le_bytes());
        [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
    };
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
}

/// The code-sum coefficients of a Q4_K/Q5_K block: pair `p` (code sums `2p`, `2p + 1`,
/// sub-block `p`) times min `p` in both halves.
pub(super) fn k4_coef(mins: &[u8; 8]) -> [i32; 8] {
    std::array::from_fn(|p| i32::from(mins[p]) * 0x0001_0001)
}

/// The code-sum coefficients of a Q6_K block: code sum `t` times `32 · scale_t`.
pub(super) fn q6k_coef(scales: &[u8]) -> [i32; 8] {
    std::array::from_fn(|p| {
        let lo = (32 * i32::from(scales[2 * p] as i8)) as u16 as u32;
        let hi = (32 * i32::from(scales[2 * p + 1] as i8)) as u16 as u32;
        (lo | (hi << 16)) as i32
    })
}

/// One panel of weight rows through a body's block decoder and row dot product: for
/// each weight row, each block is decoded once, then every group of eight activation
/// rows takes its dot products, [`reduce8`] and the block values of its format, added
/// to the group's accumulators block by block (the order of `matmul`).
///
/// `$features` are the body's target features; `$decode(block: &[u8]) -> Dec` and
/// `$dot(&Dec, codes: *const i8) -> __m256i` (unsafe, same features) its format
/// functions, chosen by the `FMT` const parameter of the generated function.
macro_rules! panel_body {
    ($name:ident, $features:literal, $dec:ty, $decode:ident, $dot:ident) => {
        /// Weight rows `o0..o0 + rows` of `w` (format `FMT` as `QuantFormat::ggml_type`)
        /// times every row of `acts` into `local[r * rows + i]`.
        ///
        /// # Safety
        /// The CPU has the body's features; `w`'s format is `FMT`'s; `acts` was
        /// quantised for it from rows of `w.cols` values; `o0 + rows <= w.rows`;
        /// `local.len() == acts.q.n_rows * rows`.
        #[target_feature(enable = $features)]
        pub(in crate::model::quant) unsafe fn $name<const FMT: u32>(
            w: &crate::model::quant::matmul::QuantMatrix<'_>,
            acts: &crate::model::quant::x86::GroupedActs<'_>,
            o0: usize,
            rows: usize,
            local: &mut [f32],
        ) {
            use crate::model::quant::x86::{d_values, k4_values, reduce8, GROUP};
            use std::arch::x86_64::*;
            let bb = w.format().block_bytes();
            let nb = w.cols / w.format().block_elems();
            let mut acc = vec![_mm256_setzero_ps(); acts.groups];
            for i in 0..rows {
                let row = w.row(o0 + i);
                acc.fill(_mm256_setzero_ps());
                for b in 0..nb {
                    let block = &row[b * bb..(b + 1) * bb];
                    // SAFETY (this block): the features are the caller's contract; the
                    // code pointers are whole activation blocks of rows < n_rows.
                    unsafe {
                        let dec: $dec = $decode::<FMT>(block);
                        for (g, a) in acc.iter_mut().enumerate() {
                            let mut sums = [_mm256_setzero_si256(); GROUP];
                            for (l, s) in sums.iter_mut().enumerate().take(acts.group_len(g)) {
                                *s = $dot::<FMT>(&dec, acts.codes(g * GROUP + l, b));
                            }
                            let isum = reduce8(&sums);
                            let dy = acts.dy(b, g);
                            let v = match FMT {
                                12 | 13 => k4_values(
                                    dec.dx,
                                    dec.dmin,
                                    dy,
                                    isum,
                                    acts.pair_dot(b, g, &dec.coef),
                                ),
                                14 => d_values(
                                    dec.dx,
                                    dy,
                                    _mm256_sub_epi32(isum, acts.pair_dot(b, g, &dec.coef)),
                                ),
                                _ => d_values(dec.dx, dy, isum),
                            };
                            *a = _mm256_add_ps(*a, v);
                        }
                    }
                }
                for (g, a) in acc.iter().enumerate() {
                    let mut lanes = [0.0f32; GROUP];
                    // SAFETY: `lanes` holds eight f32.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
                    for (l, v) in lanes.iter().enumerate().take(acts.group_len(g)) {
                        local[(g * GROUP + l) * rows + i] = *v;
                    }
                }
            }
        }
    };
}
pub(super) use panel_body;
