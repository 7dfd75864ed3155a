//! The AVX-512 VNNI and AVX2 bodies of the products from Q4_K tiles ([`super::tiles`]), and
//! the pass loop of both tiled formats (the Q6_K bodies: [`super::tiles_q6k_x86`]):
//! one pass over a tile's blocks for up to four activation rows at a time, each output's
//! integer sums in 32-bit lanes, the eight outputs' f32 block values in one register.
//!
//! AVX-512 VNNI, per pair of sub-blocks: four 64-byte code chunks split into low and high
//! nibbles (eight registers, reused for every activation row), then per row eight
//! `vpdpbusd` against eight activation codes broadcast to every 64-bit lane (lane `2r + h`
//! of a register sums row `r`'s products), the two sub-blocks' registers packed to 16 bits
//! (each lane sums 16 products of a 4-bit code and an 8-bit one, at most 16 · 15 · 128 =
//! 30720, so the pack never saturates) and scaled by `vpdpwssd` with the eight rows' scales
//! in lane order ([`super::tiles::sm_index`]); the mins go through one `vpdpwssd` of the
//! rows' mins with the activation's sub-block sums. AVX2 does the same with
//! `vpmaddubsw` (pairs of products, at most 2 · 15 · 128 each, four summed in 16 bits) and
//! `vpmaddwd`, rows 0-3 and 4-7 in two registers.
//!
//! Guarantees: the integer sums are exact, and the f32 value of a block is `(dx·dy)·f32(isum)
//! − (dmin·dy)·f32(imin)` per output, each step one rounded operation, added to the output's
//! sum block by block in order: the portable body's bits.

use super::matmul::QuantMatrix;
use super::tiles::{TileActs, TILE_BYTES, TILE_ROWS};
use crate::quant::{QuantFormat, QK_K};
use std::arch::x86_64::*;

/// Activation rows per pass over a tile.
pub(super) const PASS_ROWS: usize = 4;

/// The f32 values of one block for eight outputs: `(dx·dy)·f32(isum) − (dmin·dy)·f32(imin)`.
#[target_feature(enable = "avx2")]
#[inline]
fn block_values(dx: __m256, dmin: __m256, dy: f32, isum: __m256i, imin: __m256i) -> __m256 {
    let dy = _mm256_set1_ps(dy);
    let a = _mm256_mul_ps(_mm256_mul_ps(dx, dy), _mm256_cvtepi32_ps(isum));
    let m = _mm256_mul_ps(_mm256_mul_ps(dmin, dy), _mm256_cvtepi32_ps(imin));
    _mm256_sub_ps(a, m)
}

/// A tile's eight `d` and `dmin`, widened.
///
/// # Safety
/// F16C available; `t` has at least 32 bytes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn tile_scales(t: &[u8]) -> (__m256, __m256) {
    debug_assert!(t.len() >= 32);
    // SAFETY: 32 bytes at `t` (the caller's contract).
    unsafe {
        (
            _mm256_cvtph_ps(_mm_loadu_si128(t.as_ptr() as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(t.as_ptr().add(16) as *const __m128i)),
        )
    }
}

/// The 16 scales and the 16 mins of sub-block pair `p` of a tile, as bytes in
/// [`super::tiles::sm_index`] order.
///
/// # Safety
/// SSE2 available; `t` is a whole tile.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn pair_scales_mins(t: &[u8], p: usize) -> (__m128i, __m128i) {
    debug_assert!(t.len() >= TILE_BYTES && p < 4);
    // SAFETY: bytes 32..128 of the tile.
    let (sm, mh) = unsafe {
        (
            _mm_loadu_si128(t.as_ptr().add(32 + 16 * p) as *const __m128i),
            _mm_loadu_si128(t.as_ptr().add(96 + 16 * (p % 2)) as *const __m128i),
        )
    };
    let m4 = _mm_set1_epi8(0x0f);
    let mh = if p >= 2 {
        _mm_and_si128(_mm_srli_epi16::<4>(mh), m4)
    } else {
        _mm_and_si128(mh, m4)
    };
    let sc = _mm_and_si128(sm, _mm_set1_epi8(0x3f));
    // Within 16-bit lanes: the shifted-in bits land above bit 1 (masked off), and a
    // nibble shifted by 2 stays inside its byte.
    let lo = _mm_and_si128(_mm_srli_epi16::<6>(sm), _mm_set1_epi8(3));
    (sc, _mm_or_si128(lo, _mm_slli_epi16::<2>(mh)))
}

/// The 8 bytes at `x` (eight activation codes, or two 32-bit lane offsets) in every 64-bit
/// lane.
///
/// # Safety
/// AVX-512 F available; 8 bytes at `x`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn bcast512<T>(x: *const T) -> __m512i {
    // SAFETY: 8 bytes at `x`.
    _mm512_set1_epi64(unsafe { (x as *const i64).read_unaligned() })
}

/// Asks for `lines` cache lines from `at` bytes past `tile` (a tile's start) two tiles of
/// `tile_bytes` ahead: with one activation row a pass does little work per byte, and the
/// hardware prefetcher alone left it waiting on the weight stream (`cargo bench --bench
/// quant`). Only addresses are formed (`wrapping_add`), never dereferenced, so a prefetch
/// past the matrix's end is harmless.
#[target_feature(enable = "sse")]
#[inline]
pub(super) fn prefetch_ahead(tile: &[u8], tile_bytes: usize, at: usize, lines: usize) {
    let ahead = tile.as_ptr().wrapping_add(2 * tile_bytes + at);
    for l in 0..lines {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l) as *const i8);
    }
}

/// The eight outputs' totals from a register whose lane `4k + q` holds row `2k + q % 2`'s
/// sums (two lanes per row: `q / 2` = which sub-block of the pair).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) fn fold512(v: __m512i) -> __m256i {
    let t = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0x4E>(v));
    let idx = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13);
    _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, t))
}

/// The AVX-512 VNNI pass.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI, AVX2, F16C available; `tile_row` holds `nb` tiles; rows
/// `r0..r0 + N` of `acts` exist and have `nb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pass_vnni<const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    assert!(tile_row.len() >= nb * TILE_BYTES && r0 + N <= acts.q.n_rows);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * TILE_BYTES..(b + 1) * TILE_BYTES];
        let mut isum = [_mm512_setzero_si512(); N];
        let mut imin = [_mm512_setzero_si512(); N];
        let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, b));
        for p in 0..4 {
            // One row's pass kept pace with the weight stream without it (`cargo bench
            // --bench quant`: 3.96 ms without, 5.32 with, 12.6 vs 15.8 at eight rows).
            if N > 1 {
                prefetch_ahead(t, TILE_BYTES, 128 + 256 * p, 4);
            }
            // SAFETY: `t` is a whole tile; chunks 4p..4p + 4 are inside its codes; every
            // activation row has 256 codes and 16 wide sums per block.
            unsafe {
                let (sc, mn) = pair_scales_mins(t, p);
                let sc = _mm512_cvtepu8_epi32(sc);
                let scv = _mm512_or_si512(sc, _mm512_slli_epi32::<16>(sc));
                let mv = _mm512_cvtepu8_epi32(mn);
                let mut lo = [_mm512_setzero_si512(); 4];
                let mut hi = [_mm512_setzero_si512(); 4];
                for c in 0..4 {
                    let raw =
                        _mm512_loadu_si512(t.as_ptr().add(128 + 64 * (4 * p + c)) as *const _);
                    lo[c] = _mm512_and_si512(raw, m4);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                }
                for a in 0..N {
                    let xa = x[a].as_ptr().add(64 * p);
                    let mut s = [_mm512_setzero_si512(); 2];
                    for c in 0..4 {
                        let v = &mut s[c / 2];
                        *v = _mm512_dpbusd_epi32(*v, lo[c], bcast512(xa.add(16 * c)));
                        *v = _mm512_dpbusd_epi32(*v, hi[c], bcast512(xa.add(16 * c + 8)));
                    }
                    let packed = _mm512_packs_epi32(s[0], s[1]);
                    isum[a] = _mm512_dpwssd_epi32(isum[a], packed, scv);
                    let w = acts.wide(r0 + a, b).as_ptr().add(4 * p);
                    let sv = _mm512_broadcast_i32x4(_mm_loadu_si128(w as *const __m128i));
                    imin[a] = _mm512_dpwssd_epi32(imin[a], mv, sv);
                }
            }
        }
        // SAFETY: a whole tile.
        let (dx, dmin) = unsafe { tile_scales(t) };
        for a in 0..N {
            let dy = acts.d(r0 + a, b);
            let v = block_values(dx, dmin, dy, fold512(isum[a]), fold512(imin[a]));
            acc[a] = _mm256_add_ps(acc[a], v);
        }
    }
    acc
}

/// Byte shuffles for the AVX2 body: `SC[h][half]` puts, in 16-bit-lane order after
/// widening, the scale of row `4 · half + L / 4`, sub-block `2p + h` at lane `L` (each
/// 32-bit lane `2r + i` of `vpmaddwd` takes row `r`'s scale); `MIN` puts the mins of row
/// `r`, sub-blocks `2p` and `2p + 1` at lanes `2r`, `2r + 1`.
const fn shuffles() -> ([[[i8; 16]; 2]; 2], [i8; 16]) {
    let mut sc = [[[0i8; 16]; 2]; 2];
    let mut min = [0i8; 16];
    let mut h = 0;
    while h < 2 {
        let mut half = 0;
        while half < 2 {
            let mut l = 0;
            while l < 16 {
                let r = 4 * half + l / 4;
                sc[h][half][l] = (4 * (r / 2) + 2 * h + r % 2) as i8;
                l += 1;
            }
            half += 1;
        }
        h += 1;
    }
    let mut o = 0;
    while o < 16 {
        let (r, h) = (o / 2, o % 2);
        min[o] = (4 * (r / 2) + 2 * h + r % 2) as i8;
        o += 1;
    }
    (sc, min)
}

const SHUFFLES: ([[[i8; 16]; 2]; 2], [i8; 16]) = shuffles();

/// The 8 bytes at `x` in every 64-bit lane ([`bcast512`]'s 256-bit twin).
///
/// # Safety
/// AVX available; 8 bytes at `x`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn bcast256<T>(x: *const T) -> __m256i {
    // SAFETY: 8 bytes at `x`.
    _mm256_set1_epi64x(unsafe { (x as *const i64).read_unaligned() })
}

/// `mask` as a register.
#[target_feature(enable = "avx2")]
#[inline]
fn mask128(mask: &[i8; 16]) -> __m128i {
    // SAFETY: 16 bytes.
    unsafe { _mm_loadu_si128(mask.as_ptr() as *const __m128i) }
}

/// The AVX2 pass.
///
/// # Safety
/// AVX2 and F16C available; as [`pass_vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass_avx2<const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    assert!(tile_row.len() >= nb * TILE_BYTES && r0 + N <= acts.q.n_rows);
    let m4 = _mm256_set1_epi8(0x0f);
    let (sc_masks, min_mask) = (&SHUFFLES.0, mask128(&SHUFFLES.1));
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * TILE_BYTES..(b + 1) * TILE_BYTES];
        // Rows 0-3 and rows 4-7 (lane `2r + i` of each holds local row `r`).
        let mut isum = [[_mm256_setzero_si256(); 2]; N];
        let mut imin = [_mm256_setzero_si256(); N];
        let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, b));
        for p in 0..4 {
            // One row's pass kept pace with the weight stream without it (`cargo bench
            // --bench quant`: 3.96 ms without, 5.32 with, 12.6 vs 15.8 at eight rows).
            if N > 1 {
                prefetch_ahead(t, TILE_BYTES, 128 + 256 * p, 4);
            }
            // SAFETY: as in `pass_vnni`.
            unsafe {
                let (sc, mn) = pair_scales_mins(t, p);
                let mv = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(mn, min_mask));
                for (h, masks) in sc_masks.iter().enumerate() {
                    let j = 2 * p + h;
                    let scv: [__m256i; 2] = std::array::from_fn(|half| {
                        _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sc, mask128(&masks[half])))
                    });
                    let mut lo = [[_mm256_setzero_si256(); 2]; 2];
                    let mut hi = [[_mm256_setzero_si256(); 2]; 2];
                    for c in 0..2 {
                        for half in 0..2 {
                            let at = 128 + 64 * (2 * j + c) + 32 * half;
                            let raw = _mm256_loadu_si256(t.as_ptr().add(at) as *const __m256i);
                            lo[c][half] = _mm256_and_si256(raw, m4);
                            hi[c][half] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
                        }
                    }
                    for a in 0..N {
                        let xa = x[a].as_ptr().add(32 * j);
                        let xs = [
                            [bcast256(xa), bcast256(xa.add(8))],
                            [bcast256(xa.add(16)), bcast256(xa.add(24))],
                        ];
                        for half in 0..2 {
                            let mut s = _mm256_setzero_si256();
                            for c in 0..2 {
                                s = _mm256_add_epi16(
                                    s,
                                    _mm256_maddubs_epi16(lo[c][half], xs[c][0]),
                                );
                                s = _mm256_add_epi16(
                                    s,
                                    _mm256_maddubs_epi16(hi[c][half], xs[c][1]),
                                );
                            }
                            isum[a][half] =
                                _mm256_add_epi32(isum[a][half], _mm256_madd_epi16(s, scv[half]));
                        }
                    }
                }
                for (a, im) in imin.iter_mut().enumerate() {
                    let pair = _mm256_set1_epi32(acts.pairs(r0 + a, b)[p]);
                    *im = _mm256_add_epi32(*im, _mm256_madd_epi16(mv, pair));
                }
            }
        }
        // SAFETY: a whole tile.
        let (dx, dmin) = unsafe { tile_scales(t) };
        for a in 0..N {
            // [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order.
            let h = _mm256_hadd_epi32(isum[a][0], isum[a][1]);
            let is = _mm256_permute4x64_epi64::<0b11_01_10_00>(h);
            let dy = acts.d(r0 + a, b);
            acc[a] = _mm256_add_ps(acc[a], block_values(dx, dmin, dy, is, imin[a]));
        }
    }
    acc
}

/// Rows `o0..o0 + rows` (whole tiles) of the tiled matrix `w` (Q4_K, Q6_K, Q8_0, Q4_0 or
/// MXFP4) times every row of `acts` into `local[r * rows + i]`, with the AVX-512 VNNI bodies
/// (`vnni`, where one exists for the tiles: see `tiles_b32_x86::pass`) or the AVX2 ones;
/// Q6_K on AVX2 at `tiles_unpacked_x86::MIN_ROWS` rows or more unpacks each tile row once
/// for all of them (`tiles_unpacked_x86`) unless `unpacked` is off; the 32-weight
/// formats at up to `tiles_b32_x86::FEW_ROWS` rows run its few-row pass unless `few` is
/// off; the Q6_K passes prefetch at one activation row unless `q6k_prefetch` is off.
///
/// # Safety
/// The CPU has the body's features (AVX-512 F/BW/VL, VNNI, AVX2, F16C for `vnni`; AVX2,
/// FMA, F16C otherwise); `w` is whole tiles of its format (`QuantMatrix::new` checked
/// that) and `acts` rows of `w.cols` values, made for that format;
/// `o0 + rows <= w.rows`; `local.len() == acts.q.n_rows * rows`.
pub(super) unsafe fn panel(
    vnni: bool,
    (unpacked, few, q6k_prefetch): (bool, bool, bool),
    w: &QuantMatrix<'_>,
    acts: &TileActs<'_>,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let (format, bytes, cols) = (w.format(), w.data.bytes, w.cols);
    use super::tiles_b32_x86 as b32;
    use super::tiles_q6k_x86 as q6;
    let nb = cols / QK_K;
    // The 32-weight formats' whole columns and the blocks of their partial one.
    let spans = super::tiles::columns(format, cols);
    // 0: Q4_K, 1: Q6_K, otherwise a 32-weight tile kind.
    let kind = match format {
        QuantFormat::Q6K => 1,
        QuantFormat::Q8_0 => 2,
        QuantFormat::Q4_0 => 3,
        QuantFormat::Mxfp4 => 4,
        _ => 0,
    };
    let tile_row_bytes = TILE_ROWS * w.row_bytes();
    let n_rows = acts.q.n_rows;
    use super::tiles_unpacked_x86 as un;
    let many = unpacked && n_rows >= un::MIN_ROWS;
    // Q6_K without VNNI, and Q8_0 where its AVX2 pass would run (no VNNI, or a partial
    // column).
    let unpack_q6 = kind == 1 && !vnni && many;
    let unpack_q8 = kind == 2 && many && b32::pass_rows(0, vnni, spans.1) != PASS_ROWS;
    if unpack_q6 || unpack_q8 {
        let at = o0 / TILE_ROWS * tile_row_bytes;
        let tiles = rows / TILE_ROWS;
        let panel_bytes = &bytes[at..at + tiles * tile_row_bytes];
        // SAFETY: the caller's contract (AVX2, F16C; the panel is `tiles` tile rows of
        // `tile_row_bytes` of the format's tiles, `spans` their columns; `acts` made for
        // it without VNNI; `local` is n_rows * rows).
        unsafe { un::panel(unpack_q8, panel_bytes, tile_row_bytes, spans, acts, local) };
        return;
    }
    for t in 0..rows / TILE_ROWS {
        let at = (o0 / TILE_ROWS + t) * tile_row_bytes;
        let tile_row = &bytes[at..at + tile_row_bytes];
        // The 32-weight formats' AVX2 pass takes up to eight rows, the others four.
        let step = if kind >= 2 {
            b32::pass_rows(kind as u8 - 2, vnni, spans.1)
        } else {
            PASS_ROWS
        };
        let mut r0 = 0;
        while r0 < n_rows {
            let n = step.min(n_rows - r0);
            let mut sums = [[0.0f32; TILE_ROWS]; b32::AVX2_PASS_ROWS];
            let (tr, s, pf) = (tile_row, &mut sums, q6k_prefetch);
            // SAFETY: the caller's contract (features, lengths, the format's tiles and
            // activation sums); `r0 + n <= n_rows`; a tile row is `8 · row_bytes`.
            unsafe {
                match (kind, vnni, n) {
                    (0, true, 1) => store(s, pass_vnni::<1>(tr, nb, acts, r0)),
                    (0, true, 2) => store(s, pass_vnni::<2>(tr, nb, acts, r0)),
                    (0, true, 3) => store(s, pass_vnni::<3>(tr, nb, acts, r0)),
                    (0, true, _) => store(s, pass_vnni::<4>(tr, nb, acts, r0)),
                    (0, false, 1) => store(s, pass_avx2::<1>(tr, nb, acts, r0)),
                    (0, false, 2) => store(s, pass_avx2::<2>(tr, nb, acts, r0)),
                    (0, false, 3) => store(s, pass_avx2::<3>(tr, nb, acts, r0)),
                    (0, false, _) => store(s, pass_avx2::<4>(tr, nb, acts, r0)),
                    (1, true, 1) => store(s, q6::pass_vnni::<1>(tr, nb, acts, r0, pf)),
                    (1, true, 2) => store(s, q6::pass_vnni::<2>(tr, nb, acts, r0, pf)),
                    (1, true, 3) => store(s, q6::pass_vnni::<3>(tr, nb, acts, r0, pf)),
                    (1, true, _) => store(s, q6::pass_vnni::<4>(tr, nb, acts, r0, pf)),
                    (1, false, 1) => store(s, q6::pass_avx2::<1>(tr, nb, acts, r0, pf)),
                    (1, false, 2) => store(s, q6::pass_avx2::<2>(tr, nb, acts, r0, pf)),
                    (1, false, 3) => store(s, q6::pass_avx2::<3>(tr, nb, acts, r0, pf)),
                    (1, false, _) => store(s, q6::pass_avx2::<4>(tr, nb, acts, r0, pf)),
                    (2, _, _) => b32::pass(b32::Q8_0, (vnni, few), n, tr, spans, acts, r0, s),
                    (3, _, _) => b32::pass(b32::Q4_0, (vnni, few), n, tr, spans, acts, r0, s),
                    (_, _, _) => b32::pass(b32::MXFP4, (vnni, few), n, tr, spans, acts, r0, s),
                }
            }
            for (a, s) in sums.iter().enumerate().take(n) {
                let dst = (r0 + a) * rows + t * TILE_ROWS;
                local[dst..dst + TILE_ROWS].copy_from_slice(s);
            }
            r0 += n;
        }
    }
}

/// Stores a pass's registers into plain arrays (the first `N`).
fn store<const N: usize>(
    dst: &mut [[f32; TILE_ROWS]; super::tiles_b32_x86::AVX2_PASS_ROWS],
    v: [__m256; N],
) {
    for (d, v) in dst.iter_mut().zip(v) {
        // SAFETY: `__m256` is eight f32 in lane order, as `[f32; 8]` (same size, any bits
        // valid).
        *d = unsafe { std::mem::transmute::<__m256, [f32; TILE_ROWS]>(v) };
    }
}
