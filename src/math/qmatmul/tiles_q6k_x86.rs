//! The AVX-512 VNNI and AVX2 bodies of the products from Q6_K tiles ([`super::tiles_q6k`]):
//! one pass over a tile's blocks for up to four activation rows at a time, each output's
//! integer sum in 32-bit lanes, the eight outputs' f32 block values in one register.
//!
//! A code's low nibble and top two bits are joined once per tile (one byte per code, 0..64,
//! reused by every activation row). The `−32` of `q − 32` is not applied to the codes
//! (the dot-product instructions take unsigned bytes on one side) but started from: each
//! lane's accumulator begins at `−32 · Σ x` over the activation codes it covers
//! ([`super::tiles::TileActs`]), so after the products it holds `Σ (q − 32) · x` exactly.
//!
//! AVX-512 VNNI, per sub-block `c` (16 codes a row): two `vpdpbusd` against eight
//! activation codes broadcast to every 64-bit lane (lane `2r + h` of a register sums four
//! of row `r`'s products, at most 4 · 32 · 128 = 16384 in magnitude), packed to 16 bits
//! (never saturates) and scaled by `vpdpwssd` with the eight rows' signed scales in lane
//! order. AVX2 does the same with `vpmaddubsw` (pairs of products, at most 2 · 63 · 128,
//! two summed and the offset added in 16 bits: the total, at most 16384 in magnitude,
//! fits, so the wrapping adds are exact) and `vpmaddwd`, rows 0-3 and 4-7 in two registers.
//!
//! Guarantees: the integer sums are exact, and the f32 value of a block is
//! `(d·dy)·f32(isum)` per output, each step one rounded operation, added to the output's
//! sum block by block in order: the portable body's bits.

use super::tiles::{TileActs, TILE_ROWS};
use super::tiles_x86::{bcast256, bcast512, fold512, prefetch_ahead};
use crate::quant::tiles_q6k::{GROUP, GROUPS, SCALES, TILE};
use std::arch::x86_64::*;

/// The eight outputs' f32 values of one block: `(d·dy)·f32(isum)`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn block_values(t: &[u8], dy: f32, isum: __m256i) -> __m256 {
    assert!(t.len() >= 16);
    // SAFETY: 16 bytes at `t` (asserted).
    let d = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(t.as_ptr() as *const __m128i) });
    _mm256_mul_ps(
        _mm256_mul_ps(d, _mm256_set1_ps(dy)),
        _mm256_cvtepi32_ps(isum),
    )
}

/// Sub-block `c`'s codes, one byte each (0..64), from its group's low-nibble bytes `ql`
/// and high-bit bytes `qh`: (codes `16c..16c + 8`, codes `16c + 8..16c + 16`) of every row.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn codes512(ql: __m512i, qh: __m512i, odd: bool) -> (__m512i, __m512i) {
    let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    // Top bits `2m..2m + 2` of each high-bit byte moved to bits 4-5; the 16-bit shifts
    // carry bits across bytes only into positions the mask clears.
    let (h_lo, h_hi) = if odd {
        (qh, _mm512_srli_epi16::<2>(qh))
    } else {
        (_mm512_slli_epi16::<4>(qh), _mm512_slli_epi16::<2>(qh))
    };
    // (a & b) | (c & m30), in two ternary-logic steps.
    let lo = _mm512_ternarylogic_epi64::<0xEA>(ql, m4, _mm512_and_si512(h_lo, m30));
    let hi = _mm512_ternarylogic_epi64::<0xEA>(
        _mm512_srli_epi16::<4>(ql),
        m4,
        _mm512_and_si512(h_hi, m30),
    );
    (lo, hi)
}

/// Lane pattern of the AVX-512 body's 16-bit scales: 128-bit lane `k` takes rows `2k`,
/// `2k + 1` as `[s2k, s2k, s2k+1, s2k+1]` twice (the order `vpackssdw` leaves the packed
/// sums in); the byte shuffle reads a register holding the eight scales in each 64 bits.
const SCALE512: [i8; 32] = {
    let mut m = [0i8; 32];
    let mut i = 0;
    while i < 32 {
        let k = i / 8;
        let j = (i % 8) / 2 % 2;
        m[i] = (2 * k + j) as i8;
        i += 1;
    }
    m
};

/// The AVX-512 VNNI pass.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI, AVX2, F16C available; `tile_row` holds `nb` Q6_K tiles; rows
/// `r0..r0 + N` of `acts` exist, have `nb` blocks and were made for Q6_K. `prefetch`: at
/// one row (`N == 1`), whether to prefetch two tiles ahead (at more rows it always does).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn pass_vnni<const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
    prefetch: bool,
) -> [__m256; N] {
    assert!(tile_row.len() >= nb * TILE && r0 + N <= acts.q.n_rows);
    // SAFETY: 32 bytes.
    let shuf = unsafe { _mm256_loadu_si256(SCALE512.as_ptr() as *const __m256i) };
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * TILE..(b + 1) * TILE];
        let mut isum = [_mm512_setzero_si512(); N];
        let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, b));
        let off: [&[i32]; N] = std::array::from_fn(|a| acts.quads(r0 + a, b));
        assert!(x.iter().all(|x| x.len() >= 256) && off.iter().all(|o| o.len() >= 64));
        for p in 0..8 {
            let g = GROUPS + GROUP * p;
            if N > 1 || prefetch {
                prefetch_ahead(t, TILE, g, 3);
            }
            // SAFETY: group `p` (192 bytes at `g`) and the 128 scale bytes are inside the
            // tile; every activation row has 256 codes and 64 offsets per block (asserted).
            unsafe {
                let qh = _mm512_loadu_si512(t.as_ptr().add(g + 128) as *const _);
                for h in 0..2 {
                    let c = 2 * p + h;
                    let ql = _mm512_loadu_si512(t.as_ptr().add(g + 64 * h) as *const _);
                    let (lo, hi) = codes512(ql, qh, h == 1);
                    let sc8 = bcast256(t.as_ptr().add(SCALES + 8 * c));
                    let scv = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc8, shuf));
                    for a in 0..N {
                        let xa = x[a].as_ptr().add(16 * c);
                        let oa = off[a].as_ptr().add(4 * c) as *const i64;
                        let s0 = _mm512_dpbusd_epi32(bcast512(oa), lo, bcast512(xa));
                        let s1 = _mm512_dpbusd_epi32(bcast512(oa.add(1)), hi, bcast512(xa.add(8)));
                        isum[a] = _mm512_dpwssd_epi32(isum[a], _mm512_packs_epi32(s0, s1), scv);
                    }
                }
            }
        }
        for a in 0..N {
            let v = block_values(t, acts.d(r0 + a, b), fold512(isum[a]));
            acc[a] = _mm256_add_ps(acc[a], v);
        }
    }
    acc
}

/// Sub-block codes as [`codes512`], for half a chunk (four rows).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn codes256(ql: __m256i, qh: __m256i, odd: bool) -> (__m256i, __m256i) {
    let (m4, m30) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
    let (h_lo, h_hi) = if odd {
        (qh, _mm256_srli_epi16::<2>(qh))
    } else {
        (_mm256_slli_epi16::<4>(qh), _mm256_slli_epi16::<2>(qh))
    };
    let lo = _mm256_or_si256(_mm256_and_si256(ql, m4), _mm256_and_si256(h_lo, m30));
    let hi = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4),
        _mm256_and_si256(h_hi, m30),
    );
    (lo, hi)
}

/// Byte shuffles for the AVX2 body's scales: half `h` puts row `4h + L / 4`'s scale at
/// 16-bit lane `L` (each 32-bit lane `2r + i` of `vpmaddwd` takes row `r`'s scale).
const SCALE256: [[i8; 16]; 2] = {
    let mut m = [[0i8; 16]; 2];
    let mut h = 0;
    while h < 2 {
        let mut l = 0;
        while l < 16 {
            m[h][l] = (4 * h + l / 4) as i8;
            l += 1;
        }
        h += 1;
    }
    m
};

/// The AVX2 pass.
///
/// # Safety
/// AVX2 and F16C available; as [`pass_vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass_avx2<const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
    prefetch: bool,
) -> [__m256; N] {
    assert!(tile_row.len() >= nb * TILE && r0 + N <= acts.q.n_rows);
    // SAFETY: 16 bytes each.
    let shuf = unsafe {
        [
            _mm_loadu_si128(SCALE256[0].as_ptr() as *const __m128i),
            _mm_loadu_si128(SCALE256[1].as_ptr() as *const __m128i),
        ]
    };
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * TILE..(b + 1) * TILE];
        // Rows 0-3 and rows 4-7 (lane `2r + i` of each holds local row `r`).
        let mut isum = [[_mm256_setzero_si256(); 2]; N];
        let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, b));
        let off: [&[i16]; N] = std::array::from_fn(|a| acts.pairs16(r0 + a, b));
        assert!(x.iter().all(|x| x.len() >= 256) && off.iter().all(|o| o.len() >= 64));
        for p in 0..8 {
            let g = GROUPS + GROUP * p;
            if N > 1 || prefetch {
                prefetch_ahead(t, TILE, g, 3);
            }
            // SAFETY: as in `pass_vnni`.
            unsafe {
                let qh: [__m256i; 2] = std::array::from_fn(|half| {
                    _mm256_loadu_si256(t.as_ptr().add(g + 128 + 32 * half) as *const __m256i)
                });
                for h in 0..2 {
                    let c = 2 * p + h;
                    let sc8 = _mm_loadl_epi64(t.as_ptr().add(SCALES + 8 * c) as *const __m128i);
                    let mut codes = [[_mm256_setzero_si256(); 2]; 2];
                    let mut scv = [_mm256_setzero_si256(); 2];
                    for half in 0..2 {
                        let at = g + 64 * h + 32 * half;
                        let ql = _mm256_loadu_si256(t.as_ptr().add(at) as *const __m256i);
                        let (lo, hi) = codes256(ql, qh[half], h == 1);
                        codes[half] = [lo, hi];
                        scv[half] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, shuf[half]));
                    }
                    for a in 0..N {
                        let xa = x[a].as_ptr().add(16 * c);
                        let y_lo = bcast256(xa);
                        let y_hi = bcast256(xa.add(8));
                        let o = bcast256(off[a].as_ptr().add(4 * c));
                        for half in 0..2 {
                            let s = _mm256_add_epi16(
                                _mm256_add_epi16(
                                    _mm256_maddubs_epi16(codes[half][0], y_lo),
                                    _mm256_maddubs_epi16(codes[half][1], y_hi),
                                ),
                                o,
                            );
                            isum[a][half] =
                                _mm256_add_epi32(isum[a][half], _mm256_madd_epi16(s, scv[half]));
                        }
                    }
                }
            }
        }
        for a in 0..N {
            // [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order.
            let hs = _mm256_hadd_epi32(isum[a][0], isum[a][1]);
            let is = _mm256_permute4x64_epi64::<0b11_01_10_00>(hs);
            let v = block_values(t, acts.d(r0 + a, b), is);
            acc[a] = _mm256_add_ps(acc[a], v);
        }
    }
    acc
}

/// Tiles of eight outputs: the number of outputs a pass gives.
const _: () = assert!(TILE_ROWS == 8);
