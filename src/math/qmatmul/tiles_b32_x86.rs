//! The AVX-512 VNNI and AVX2 bodies of the products from tiles of 32-weight blocks: Q8_0
//! ([`super::tiles_q8_0`]) and Q4_0 ([`super::tiles_q4_0`]). One pass over a tile row for
//! up to four activation rows at a time, each output's integer sum of a block in two 32-bit
//! lanes, the eight outputs' f32 block values in one register.
//!
//! The weight codes go to the unsigned side of the dot-product instructions: Q8_0's tile
//! holds each code offset by 128, Q4_0's codes are 0..16 for a weight of `q − 8`. A row's two
//! lanes start from `−128 · Σ x` (Q8_0) or `−8 · Σ x` (Q4_0) over the activation codes they
//! cover ([`super::tiles::TileActs::block_offsets`]), so after the products they hold
//! `Σ w · x` exactly (at most 32 · 128 · 127 in magnitude). AVX-512 VNNI: one `vpdpbusd` per
//! eight codes of eight rows, the activation's eight codes broadcast to every 64-bit lane.
//! AVX2: Q4_0 by `vpmaddubsw` (pairs at most 2 · 15 · 127) and `vpmaddwd`; Q8_0 undoes the
//! offset and multiplies `|q|` by `x` carrying `q`'s sign (`vpsignb`; pairs at most 2 · 128 ·
//! 127, never saturating: Q8_0 activations are within ±127), starting from zero.
//!
//! Guarantees: the integer sums are exact, and the f32 value of a block is
//! `(d·dy)·f32(isum)` per output, each step one rounded operation, added to the output's
//! sum block by block in order: the portable body's bits.

use super::tiles::TileActs;
use super::tiles_x86::{bcast256, bcast512, prefetch_ahead};
use crate::quant::{tiles_q4_0, tiles_q8_0};
use std::arch::x86_64::*;

/// Where the codes start in both tiles (after the 64 `d`).
const CODES: usize = tiles_q8_0::CODES;
const _: () = assert!(tiles_q4_0::CODES == CODES);

/// Bytes of one tile: Q4_0's (`Q4`) or Q8_0's.
const fn tile_bytes(q4: bool) -> usize {
    if q4 {
        tiles_q4_0::TILE
    } else {
        tiles_q8_0::TILE
    }
}

/// The eight outputs' f32 values of block `j` of a tile: `(d·dy)·f32(isum)`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn block_values(t: &[u8], j: usize, dy: f32, isum: __m256i) -> __m256 {
    assert!(t.len() >= 16 * (j + 1));
    // SAFETY: 16 bytes at `16 j` (asserted).
    let d = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(t.as_ptr().add(16 * j) as *const __m128i) });
    _mm256_mul_ps(
        _mm256_mul_ps(d, _mm256_set1_ps(dy)),
        _mm256_cvtepi32_ps(isum),
    )
}

/// The AVX-512 VNNI pass over Q4_0 tiles (`Q4`) or Q8_0 tiles.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI, AVX2, F16C available; `tile_row` holds `nb` tiles of that
/// format; rows `r0..r0 + N` of `acts` exist, have `8 nb` blocks and were made for it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn pass_vnni<const Q4: bool, const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    let tb = tile_bytes(Q4);
    assert!(tile_row.len() >= nb * tb && r0 + N <= acts.q.n_rows);
    let m4 = _mm512_set1_epi8(0x0f);
    // Lanes 2r and 2r + 1 of a register hold row r's halves: summed, then the even lanes.
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * tb..(b + 1) * tb];
        for j in 0..8 {
            // A block's codes: 256 bytes (Q8_0) or 128 (Q4_0) from `at`.
            let at = CODES + if Q4 { 128 * j } else { 256 * j };
            prefetch_ahead(t, tb, at, if Q4 { 2 } else { 4 });
            let blk = 8 * b + j;
            let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, blk));
            let off: [&[i32]; N] = std::array::from_fn(|a| acts.block_offsets(r0 + a, blk));
            assert!(x.iter().all(|x| x.len() >= 32) && off.iter().all(|o| o.len() >= 2));
            // SAFETY: the block's code bytes (`at` onwards) are inside the tile; every
            // activation row has 32 codes and 2 offsets per block (asserted).
            unsafe {
                // Eight registers of eight rows by eight codes, for codes 8g.. (g < 4).
                let w: [__m512i; 4] = std::array::from_fn(|g| {
                    if Q4 {
                        let raw = _mm512_loadu_si512(t.as_ptr().add(at + 64 * (g / 2)) as *const _);
                        if g % 2 == 0 {
                            _mm512_and_si512(raw, m4)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4)
                        }
                    } else {
                        _mm512_loadu_si512(t.as_ptr().add(at + 64 * g) as *const _)
                    }
                });
                for a in 0..N {
                    let mut s = bcast512(off[a].as_ptr());
                    for (g, wg) in w.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, *wg, bcast512(x[a].as_ptr().add(8 * g)));
                    }
                    let pairs = _mm512_add_epi32(s, _mm512_shuffle_epi32::<0xB1>(s));
                    let isum = _mm512_castsi512_si256(_mm512_permutexvar_epi32(evens, pairs));
                    let v = block_values(t, j, acts.q.block_d(r0 + a, blk), isum);
                    acc[a] = _mm256_add_ps(acc[a], v);
                }
            }
        }
    }
    acc
}

/// The AVX2 pass over Q4_0 tiles (`Q4`) or Q8_0 tiles.
///
/// # Safety
/// AVX2 and F16C available; as [`pass_vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass_avx2<const Q4: bool, const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    let tb = tile_bytes(Q4);
    assert!(tile_row.len() >= nb * tb && r0 + N <= acts.q.n_rows);
    let (flip, ones, m4) = (
        _mm256_set1_epi8(-128),
        _mm256_set1_epi16(1),
        _mm256_set1_epi8(0x0f),
    );
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * tb..(b + 1) * tb];
        for j in 0..8 {
            let at = CODES + if Q4 { 128 * j } else { 256 * j };
            prefetch_ahead(t, tb, at, if Q4 { 2 } else { 4 });
            let blk = 8 * b + j;
            let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, blk));
            let off: [&[i32]; N] = std::array::from_fn(|a| acts.block_offsets(r0 + a, blk));
            assert!(x.iter().all(|x| x.len() >= 32) && off.iter().all(|o| o.len() >= 2));
            // SAFETY: as in `pass_vnni`.
            unsafe {
                // Codes 8g.. of rows 0-3 and rows 4-7: Q4_0's unsigned, Q8_0's signed.
                let w: [[__m256i; 2]; 4] = std::array::from_fn(|g| {
                    std::array::from_fn(|half| {
                        if Q4 {
                            let p = t.as_ptr().add(at + 64 * (g / 2) + 32 * half);
                            let raw = _mm256_loadu_si256(p as *const __m256i);
                            if g % 2 == 0 {
                                _mm256_and_si256(raw, m4)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4)
                            }
                        } else {
                            let p = t.as_ptr().add(at + 64 * g + 32 * half);
                            _mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), flip)
                        }
                    })
                });
                for a in 0..N {
                    let start = if Q4 {
                        bcast256(off[a].as_ptr())
                    } else {
                        _mm256_setzero_si256()
                    };
                    let mut s = [start; 2];
                    for (g, wg) in w.iter().enumerate() {
                        let y = bcast256(x[a].as_ptr().add(8 * g));
                        for half in 0..2 {
                            let p = if Q4 {
                                _mm256_maddubs_epi16(wg[half], y)
                            } else {
                                _mm256_maddubs_epi16(
                                    _mm256_abs_epi8(wg[half]),
                                    _mm256_sign_epi8(y, wg[half]),
                                )
                            };
                            s[half] = _mm256_add_epi32(s[half], _mm256_madd_epi16(p, ones));
                        }
                    }
                    // [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order.
                    let hs = _mm256_hadd_epi32(s[0], s[1]);
                    let isum = _mm256_permute4x64_epi64::<0b11_01_10_00>(hs);
                    let v = block_values(t, j, acts.q.block_d(r0 + a, blk), isum);
                    acc[a] = _mm256_add_ps(acc[a], v);
                }
            }
        }
    }
    acc
}
