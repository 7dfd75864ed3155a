//! What the AVX2 and AVX-512 quantised-product bodies share: the activation side laid out
//! for eight rows at a time, a block's scalars ([`Side`]), the reduction of eight rows'
//! integer lanes, the f32 block values of one row or of eight, and the loop over weight
//! rows, blocks and row groups ([`panel_body`]).
//!
//! Why eight rows at a time: a block's integer sums come out of the dot-product
//! instructions as lanes of partial sums, one register per activation row; reducing
//! eight rows' registers together (one transposing tree of horizontal adds) gives the
//! eight rows' exact totals in one register, and the f32 block value of [`super::dot`]
//! is then computed for the eight rows with one vector operation per scalar step (the
//! same operations in the same order, so the same bits as the portable body).

use crate::quant::q8::{ActFormat, Q8Rows};
use crate::quant::{QuantFormat, QK_K};
use std::arch::x86_64::*;

/// Rows per group (the f32 lanes of a 256-bit register).
pub(super) const GROUP: usize = 8;

/// Up to this many activation rows, each row's block values are formed on their own
/// (scalar, from its exact totals) rather than eight rows at a time: padding a group of
/// eight costs more than it saves below four rows.
pub(super) const FEW_ROWS: usize = 3;

/// The order of the codes of a Q8_K activation block as a body reads them (any order
/// gives the same exact integer sums, as long as the weight codes come in the same one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CodeOrder {
    /// Weight order.
    Natural,
    /// Each 64 codes hold two 32-code sub-blocks two apart: `0, 2 | 1, 3 | 4, 6 | 5, 7`
    /// (the low and the high nibbles of 64 bytes of Q4_K/Q5_K codes, one load each).
    SubBlockPairs,
}

/// The per-block scalars of the activation rows, transposed so a group's eight rows
/// are adjacent: `d[(b * groups + g) * 8 + l]` and, for Q8_K, the code sums in pairs
/// `pairs[((b * 8 + p) * groups + g) * 8 + l]` of row `8g + l`: for Q6_K `bsum[2p]` (low
/// 16 bits) and `bsum[2p + 1]` (high 16 bits), p < 8; for Q4_K/Q5_K, whose mins cover 32
/// codes, the sums of sub-blocks `2p` and `2p + 1` (`bsum[4p] + bsum[4p + 1]`, ...), p < 4
/// (a sub-block sums at most 32 · 127, so 16 bits hold it). Rows past the last are zero.
pub(super) struct GroupedActs<'a> {
    /// The quantised rows (codes read from here, row-major).
    pub q: &'a Q8Rows,
    /// Groups of eight rows.
    pub groups: usize,
    d: Vec<f32>,
    pairs: Vec<i32>,
    /// Q8_0 and Q8_1: `Σ codes` of each block, laid out as `d` (a body whose codes are
    /// offset by `2^k` takes `2^k` times this off its totals, see [`offset_shift`]).
    offsets: Vec<i32>,
    /// Q8_1: each block's `s`, laid out as `d`.
    svals: Vec<f32>,
    /// The codes block-major, `[block][row][block_elems]`: one block of consecutive rows
    /// is contiguous. (Row-major, rows 3584 bytes apart mapped a block of 64 rows onto 8
    /// of L1's 64 sets, and Q8_0's 32-byte blocks thrashed them.) Each Q8_K block's codes
    /// in the [`CodeOrder`] the body asked for.
    codes: Vec<i8>,
}

impl<'a> GroupedActs<'a> {
    /// Transposes the scalars of `q`, quantised for weights of `format`, and lays out
    /// the codes of each Q8_K block in `order` (the order the body's decoder gives the
    /// weight codes in).
    pub fn new(q: &'a Q8Rows, format: QuantFormat, order: CodeOrder) -> Self {
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
                    let sub = |j: usize| s[2 * j] + s[2 * j + 1];
                    for p in 0..QK_K / 32 {
                        let (lo, hi) = match format {
                            QuantFormat::Q6K => (s[2 * p], s[2 * p + 1]),
                            _ if p < 4 => (sub(2 * p), sub(2 * p + 1)),
                            _ => (0, 0),
                        };
                        let packed = (lo as u16 as u32) | ((hi as u16 as u32) << 16);
                        pairs[(b * 8 + p) * padded + r] = packed as i32;
                    }
                }
            }
        }
        let mut offsets = Vec::new();
        let mut svals = Vec::new();
        if q.format != ActFormat::Q8K {
            offsets = vec![0i32; nb * padded];
            for r in 0..q.n_rows {
                for b in 0..nb {
                    offsets[b * padded + r] = q.block_qs(r, b).iter().map(|&c| i32::from(c)).sum();
                }
            }
        }
        if q.format == ActFormat::Q8_1 {
            svals = vec![0.0f32; nb * padded];
            for r in 0..q.n_rows {
                for b in 0..nb {
                    svals[b * padded + r] = q.block_s(r, b);
                }
            }
        }
        let be = q.format.block_elems();
        let mut codes = vec![0i8; q.qs.len()];
        for b in 0..nb {
            for r in 0..q.n_rows {
                let at = (b * q.n_rows + r) * be;
                let src = q.block_qs(r, b);
                match order {
                    CodeOrder::SubBlockPairs if q.format == ActFormat::Q8K => {
                        for (c, chunk) in codes[at..at + be].chunks_exact_mut(64).enumerate() {
                            let s = 4 * (c / 2) + c % 2;
                            chunk[..32].copy_from_slice(&src[32 * s..32 * s + 32]);
                            chunk[32..].copy_from_slice(&src[32 * (s + 2)..32 * (s + 2) + 32]);
                        }
                    }
                    _ => codes[at..at + be].copy_from_slice(src),
                }
            }
        }
        GroupedActs {
            q,
            groups,
            d,
            pairs,
            offsets,
            svals,
            codes,
        }
    }

    /// Rows in group `g`.
    pub fn group_len(&self, g: usize) -> usize {
        GROUP.min(self.q.n_rows - g * GROUP)
    }

    /// The codes of block `b` of row `r` (the rows of a block are consecutive).
    pub fn codes(&self, r: usize, b: usize) -> *const i8 {
        let be = self.q.format.block_elems();
        let at = (b * self.q.n_rows + r) * be;
        self.codes[at..at + be].as_ptr()
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
    /// sums times pairs of 16-bit coefficients (each `coef[p]` a broadcast of
    /// `low | high << 16`, see [`coef_vectors`]).
    ///
    /// # Safety
    /// AVX2 available; the rows are Q8_K; `b` and `g` in range.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn pair_dot<const N: usize>(
        &self,
        b: usize,
        g: usize,
        coef: &[__m256i; 8],
    ) -> __m256i {
        let padded = self.groups * GROUP;
        let base = b * 8 * padded + g * GROUP;
        debug_assert!(base + 7 * padded + GROUP <= self.pairs.len());
        let mut acc = _mm256_setzero_si256();
        for (p, c) in coef.iter().enumerate().take(N) {
            // SAFETY: `pairs` holds `nb * 8 * padded` values; b < nb, p < 8, g < groups.
            let v = unsafe {
                _mm256_loadu_si256(self.pairs.as_ptr().add(base + p * padded) as *const __m256i)
            };
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(v, *c));
        }
        acc
    }

    /// Q8_0/Q8_1: `Σ codes` of block `b` of row `r`.
    pub fn offset(&self, r: usize, b: usize) -> i32 {
        self.offsets[b * self.groups * GROUP + r]
    }

    /// Q8_1: the `s` of block `b` of the eight rows of group `g`.
    ///
    /// # Safety
    /// AVX available; the rows are Q8_1; `b` and `g` in range.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn sy(&self, b: usize, g: usize) -> __m256 {
        let at = (b * self.groups + g) * GROUP;
        debug_assert!(at + GROUP <= self.svals.len());
        // SAFETY: `svals` holds `nb * groups * 8` values and b < nb, g < groups.
        unsafe { _mm256_loadu_ps(self.svals.as_ptr().add(at)) }
    }

    /// Q8_0/Q8_1: `Σ codes` of block `b` of the eight rows of group `g`.
    ///
    /// # Safety
    /// AVX available; the rows are Q8_0 or Q8_1; `b` and `g` in range.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn offsets(&self, b: usize, g: usize) -> __m256i {
        let at = (b * self.groups + g) * GROUP;
        debug_assert!(at + GROUP <= self.offsets.len());
        // SAFETY: `offsets` holds `nb * groups * 8` values and b < nb, g < groups.
        unsafe { _mm256_loadu_si256(self.offsets.as_ptr().add(at) as *const __m256i) }
    }

    /// Q8_K: the 16 code sums of block `b` of row `r`, as 16-bit lanes.
    ///
    /// # Safety
    /// AVX available; the rows are Q8_K; `r` and `b` in range.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn bsums(&self, r: usize, b: usize) -> __m256i {
        // SAFETY: `block_bsums` is a checked slice of 16 i16 (32 bytes).
        unsafe { _mm256_loadu_si256(self.q.block_bsums(r, b).as_ptr() as *const __m256i) }
    }
}

/// The scalars of a weight block every body needs: its f16 scales widened, the 6-bit
/// sub-block scales (Q4_K/Q5_K, byte j = scale j), `lin`, the coefficient of each of the 16 code sums
/// (16-bit lanes: min `t / 2` for code sum `t` of a Q4_K/Q5_K block, `32 · scale_t` for
/// Q6_K), and `pairs`, the coefficients of [`GroupedActs`]' pairs as 32-bit lanes.
pub(super) struct Side {
    pub dx: f32,
    pub dmin: f32,
    pub sc: u64,
    pub lin: __m256i,
    pub pairs: __m256i,
}

/// The f16 at `b[at..at + 2]` widened (exact, as `half` widens it).
///
/// # Safety
/// F16C available. (Always inlined, without a target feature of its own, so that it
/// compiles inside its caller's features: as a separate function the `Side` it feeds
/// came back through memory, and one wide reload of it stalled store forwarding.)
#[inline(always)]
unsafe fn f16_at(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    // SAFETY: F16C, the caller's contract.
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))) }
}

/// The [`Side`] of block `b` of format `FMT` (ggml type id).
///
/// # Safety
/// AVX2 and F16C available; `b` is one whole block of the format. Always inlined (see
/// [`f16_at`]).
#[inline(always)]
pub(super) unsafe fn side<const FMT: u32>(b: &[u8]) -> Side {
    // SAFETY (the intrinsics): AVX2 and F16C, the caller's contract.
    unsafe { side_body::<FMT>(b) }
}

/// [`side`]'s body.
///
/// # Safety
/// As [`side`].
#[inline(always)]
unsafe fn side_body<const FMT: u32>(b: &[u8]) -> Side {
    match FMT {
        12 | 13 => {
            let (sc, mins) = k4_scales_mins(&b[4..16]);
            let m = _mm_set1_epi64x(mins as i64);
            let dup = _mm_shuffle_epi8(
                m,
                _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
            );
            Side {
                dx: f16_at(b, 0),
                dmin: f16_at(b, 2),
                sc,
                lin: _mm256_cvtepu8_epi16(dup),
                pairs: _mm256_castsi128_si256(_mm_cvtepu8_epi16(m)),
            }
        }
        14 => {
            // SAFETY: bytes 192..208 of the 210-byte block are its 16 scales.
            let sc = unsafe { _mm_loadu_si128(b.as_ptr().add(192) as *const __m128i) };
            let lin = _mm256_slli_epi16::<5>(_mm256_cvtepi8_epi16(sc));
            Side {
                dx: f16_at(b, 208),
                dmin: 0.0,
                sc: 0,
                lin,
                pairs: lin,
            }
        }
        39 => Side {
            dx: crate::quant::blocks::e8m0_half(b[0]),
            dmin: 0.0,
            sc: 0,
            lin: _mm256_setzero_si256(),
            pairs: _mm256_setzero_si256(),
        },
        3 => Side {
            // Q4_1: `dmin` carries the offset `m`.
            dx: f16_at(b, 0),
            dmin: f16_at(b, 2),
            sc: 0,
            lin: _mm256_setzero_si256(),
            pairs: _mm256_setzero_si256(),
        },
        _ => Side {
            dx: f16_at(b, 0),
            dmin: 0.0,
            sc: 0,
            lin: _mm256_setzero_si256(),
            pairs: _mm256_setzero_si256(),
        },
    }
}

/// The first `N` 32-bit lanes of `pairs` each broadcast, for [`GroupedActs::pair_dot`].
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn coef_vectors<const N: usize>(s: &Side) -> [__m256i; 8] {
    let mut c = [_mm256_setzero_si256(); 8];
    for (p, v) in c.iter_mut().enumerate().take(N) {
        *v = _mm256_permutevar8x32_epi32(s.pairs, _mm256_set1_epi32(p as i32));
    }
    c
}

/// The sum of the eight lanes of `v`.
#[target_feature(enable = "avx2")]
#[inline]
fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
}

/// The sums of the eight lanes of `a` and of `b`.
#[target_feature(enable = "avx2")]
#[inline]
fn hsum2(a: __m256i, b: __m256i) -> (i32, i32) {
    let h = _mm256_hadd_epi32(a, b);
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    let t = _mm_hadd_epi32(s, s);
    (_mm_cvtsi128_si32(t), _mm_extract_epi32::<1>(t))
}

/// The value of block `b` for activation row `r` alone, from the lanes of its code dot
/// product: [`super::dot`]'s scalar arithmetic on the exact totals.
///
/// # Safety
/// AVX2 available; `acts` holds row `r` quantised for `FMT`; `b` in range.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn one_row_value<const FMT: u32>(
    s: &Side,
    lanes: __m256i,
    acts: &GroupedActs<'_>,
    r: usize,
    b: usize,
) -> f32 {
    let dy = acts.q.block_d(r, b);
    match FMT {
        12 | 13 => {
            // SAFETY: Q8_K rows (the formats' activations), row 0 and block b exist.
            let mins = _mm256_madd_epi16(unsafe { acts.bsums(r, b) }, s.lin);
            let (isum, imin) = hsum2(lanes, mins);
            super::dot::k4_value(s.dx, s.dmin, dy, isum, imin)
        }
        14 => {
            // SAFETY: as above.
            let mins = _mm256_madd_epi16(unsafe { acts.bsums(r, b) }, s.lin);
            (s.dx * dy) * hsum(_mm256_sub_epi32(lanes, mins)) as f32
        }
        3 => super::dot::q4_1_value(s.dx, s.dmin, dy, acts.q.block_s(r, b), hsum(lanes)),
        _ => (s.dx * dy) * hsum(lanes) as f32,
    }
}

/// The values of block `b` for the eight rows of group `g` from their exact totals.
///
/// # Safety
/// AVX2 available; `acts` quantised for `FMT`; `b`, `g` in range.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn group_values<const FMT: u32>(
    s: &Side,
    coef: &[__m256i; 8],
    isum: __m256i,
    acts: &GroupedActs<'_>,
    b: usize,
    g: usize,
) -> __m256 {
    // SAFETY: the caller's bounds; Q8_K rows for the K formats.
    unsafe {
        let dy = acts.dy(b, g);
        match FMT {
            12 | 13 => k4_values(s.dx, s.dmin, dy, isum, acts.pair_dot::<4>(b, g, coef)),
            14 => d_values(
                s.dx,
                dy,
                _mm256_sub_epi32(isum, acts.pair_dot::<8>(b, g, coef)),
            ),
            3 => _mm256_add_ps(
                d_values(s.dx, dy, isum),
                _mm256_mul_ps(_mm256_set1_ps(s.dmin), acts.sy(b, g)),
            ),
            _ => d_values(s.dx, dy, isum),
        }
    }
}

/// The power of two times each activation block's code sum a body takes off its totals
/// for format `FMT` (0: none): Q4_0's codes are stored `w + 8` and dotted as they are
/// (`8 = 2^3`), Q5_0's `w + 16` (`2^4`); a body whose Q8_0 (and MXFP4) dot multiplies `w + 128` (`q8_0_offset`)
/// takes `2^7`.
pub(super) const fn offset_shift(fmt: u32, q8_0_offset: bool) -> i32 {
    match fmt {
        2 => 3,
        6 => 4,
        8 | 39 if q8_0_offset => 7,
        _ => 0,
    }
}

/// Blocks per k-chunk for `n_rows` activation rows: about 128 KiB of activation codes
/// (they stay in L2 while a panel's weight rows pass over them; a whole 14336-wide row
/// of 64 activation rows would be 900 KiB and spill).
pub(super) fn chunk_blocks(n_rows: usize, block_elems: usize) -> usize {
    ((128 << 10) / n_rows.max(1) / block_elems).max(1)
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

/// The eight 6-bit scales and mins of a Q4_K/Q5_K super-block from its 12 packed bytes,
/// four at a time in 32-bit words (the layout of `blocks::scale_min_k4`: words 0 and 1
/// hold scales/mins 0-3 in their low 6 bits per byte and bits 4-5 of scales/mins 4-7 in
/// their top 2; word 2 holds the low 4 bits of scale `4 + i` and min `4 + i`). Byte `j`
/// of each result (little-endian) is scale/min `j`; kept in integer registers (a byte
/// array read back as one word cost a store-forwarding stall per block). Always inlined:
/// left to the compiler it stayed a call per block (perf).
#[inline(always)]
pub(super) fn k4_scales_mins(s: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let sc_lo = w0 & 0x3f3f_3f3f;
    let m_lo = w1 & 0x3f3f_3f3f;
    let sc_hi = (w2 & 0x0f0f_0f0f) | (((w0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((w2 >> 4) & 0x0f0f_0f0f) | (((w1 >> 6) & 0x0303_0303) << 4);
    let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    (join(sc_lo, sc_hi), join(m_lo, m_hi))
}

/// One panel of weight rows through a body's block decoder and row dot product: for
/// each weight row, each block is decoded once, then (up to [`FEW_ROWS`] rows) each
/// row's block value is formed from its own totals, or (more rows) every group of eight
/// activation rows takes its dot products, [`reduce8`] and the block values of its
/// format; either way each output adds its block values one by one in block order (the
/// order of `matmul`). With many rows the blocks are taken in k-chunks
/// ([`chunk_blocks`]) so the activation codes a chunk reads stay in L2; the order per
/// output does not change.
///
/// `$features` are the body's target features; `$decode(block: &[u8], &Side) -> Dec`
/// and `$dot(&Dec, codes: *const i8) -> __m256i` (unsafe, same features) its format
/// functions, chosen by the `FMT` const parameter of the generated function;
/// `$q8_0_offset`: the body's Q8_0 dot multiplies `w + 128`, so `128 · Σ a` of the
/// activation block ([`GroupedActs::offsets`]) is subtracted from each total (as `8 · Σ a`
/// is for Q4_0 in every body: [`offset_shift`]).
macro_rules! panel_body {
    ($name:ident, $features:literal, $dec:ty, $decode:ident, $dot:ident, $q8_0_offset:literal) => {
        /// Weight rows `o0..o0 + rows` of `w` (format `FMT` as `QuantFormat::ggml_type`)
        /// times every row of `acts` into `local[r * rows + i]`.
        ///
        /// # Safety
        /// The CPU has the body's features; `w`'s format is `FMT`'s; `acts` was
        /// quantised for it from rows of `w.cols` values; `o0 + rows <= w.rows`;
        /// `local.len() == acts.q.n_rows * rows`.
        #[target_feature(enable = $features)]
        pub(in crate::math::qmatmul) unsafe fn $name<const FMT: u32>(
            w: &crate::math::qmatmul::matmul::QuantMatrix<'_>,
            acts: &crate::math::qmatmul::x86::GroupedActs<'_>,
            o0: usize,
            rows: usize,
            local: &mut [f32],
        ) {
            use crate::math::qmatmul::x86::{
                chunk_blocks, coef_vectors, group_values, offset_shift, one_row_value, reduce8,
                side, FEW_ROWS, GROUP,
            };
            let shift = offset_shift(FMT, $q8_0_offset);
            use std::arch::x86_64::*;
            let bb = w.format().block_bytes();
            let nb = w.cols / w.format().block_elems();
            // SAFETY (the unsafe blocks below): the features are the caller's contract;
            // blocks are whole (rows are whole blocks); activation rows and blocks are
            // inside `acts`.
            let n_rows = acts.q.n_rows;
            if n_rows <= FEW_ROWS {
                // Few rows: each row's block value from its own totals (no group of eight
                // to fill), the block decoded once for all of them.
                for i in 0..rows {
                    let row = w.row(o0 + i);
                    let mut acc = [0.0f32; FEW_ROWS];
                    for (b, block) in row.chunks_exact(bb).enumerate() {
                        unsafe {
                            let s = side::<FMT>(block);
                            let dec: $dec = $decode::<FMT>(block, &s);
                            for (r, a) in acc.iter_mut().enumerate().take(n_rows) {
                                let mut lanes = $dot::<FMT>(&dec, acts.codes(r, b));
                                if shift != 0 {
                                    lanes = _mm256_sub_epi32(
                                        lanes,
                                        _mm256_castsi128_si256(_mm_cvtsi32_si128(
                                            acts.offset(r, b) << shift,
                                        )),
                                    );
                                }
                                *a += one_row_value::<FMT>(&s, lanes, acts, r, b);
                            }
                        }
                    }
                    for (r, a) in acc.iter().enumerate().take(n_rows) {
                        local[r * rows + i] = *a;
                    }
                }
                return;
            }
            let groups = acts.groups;
            let chunk = chunk_blocks(acts.q.n_rows, w.format().block_elems());
            let mut accs = vec![_mm256_setzero_ps(); rows * groups];
            for c0 in (0..nb).step_by(chunk) {
                for i in 0..rows {
                    let row = w.row(o0 + i);
                    let acc = &mut accs[i * groups..(i + 1) * groups];
                    for b in c0..(c0 + chunk).min(nb) {
                        let block = &row[b * bb..(b + 1) * bb];
                        unsafe {
                            let s = side::<FMT>(block);
                            let dec: $dec = $decode::<FMT>(block, &s);
                            // Pairs of code sums: 4 (Q4_K, Q5_K), 8 (Q6_K), none (Q8_0).
                            let coef = match FMT {
                                12 | 13 => coef_vectors::<4>(&s),
                                14 => coef_vectors::<8>(&s),
                                _ => [_mm256_setzero_si256(); 8],
                            };
                            for (g, a) in acc.iter_mut().enumerate() {
                                let mut sums = [_mm256_setzero_si256(); GROUP];
                                // The group's rows of block b are one block apart.
                                let first = acts.codes(g * GROUP, b);
                                let be = w.format().block_elems();
                                for (l, v) in sums.iter_mut().enumerate().take(acts.group_len(g)) {
                                    *v = $dot::<FMT>(&dec, first.add(l * be));
                                }
                                let mut isum = reduce8(&sums);
                                if shift != 0 {
                                    isum = _mm256_sub_epi32(
                                        isum,
                                        _mm256_sll_epi32(
                                            acts.offsets(b, g),
                                            _mm_cvtsi32_si128(shift),
                                        ),
                                    );
                                }
                                let v = group_values::<FMT>(&s, &coef, isum, acts, b, g);
                                *a = _mm256_add_ps(*a, v);
                            }
                        }
                    }
                }
            }
            for i in 0..rows {
                for g in 0..groups {
                    let mut lanes = [0.0f32; GROUP];
                    // SAFETY: `lanes` holds eight f32.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), accs[i * groups + g]) };
                    for (l, v) in lanes.iter().enumerate().take(acts.group_len(g)) {
                        local[(g * GROUP + l) * rows + i] = *v;
                    }
                }
            }
        }
    };
}
pub(super) use panel_body;
