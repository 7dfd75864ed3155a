//! The AVX-512 VNNI and AVX2 bodies of the products from Q8_0 tiles
//! ([`super::tiles_q8_0`]): one pass over a tile row for up to four activation rows at a
//! time, each output's integer sum of a 32-code block in two 32-bit lanes, the eight
//! outputs' f32 block values in one register.
//!
//! AVX-512 VNNI: the tile holds each code offset by 128 (unsigned), and a row's two lanes
//! start from `−128 · Σ x` over the activation codes they cover
//! ([`super::tiles::TileActs::offsets128`]), so four `vpdpbusd` (one per 64-byte chunk, the
//! activation's eight codes broadcast to every 64-bit lane) leave `Σ q · x` exactly (at
//! most 16 · 128 · 127 in magnitude per lane). AVX2 undoes the offset and multiplies
//! `|q|` by `x` carrying `q`'s sign (`vpsignb`), pairs summed by `vpmaddubsw` (at most 2 ·
//! 128 · 127, so never saturating: Q8_0 activations are within ±127), then `vpmaddwd`.
//!
//! Guarantees: the integer sums are exact, and the f32 value of a block is
//! `(d·dy)·f32(isum)` per output, each step one rounded operation, added to the output's
//! sum block by block in order: the portable body's bits.

use super::tiles::TileActs;
use super::tiles_q8_0::{CODES, TILE};
use super::tiles_x86::prefetch_ahead;
use std::arch::x86_64::*;

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

/// The AVX-512 VNNI pass.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI, AVX2, F16C available; `tile_row` holds `nb` Q8_0 tiles; rows
/// `r0..r0 + N` of `acts` exist, have `8 nb` blocks and were made for Q8_0.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn pass_vnni<const N: usize>(
    tile_row: &[u8],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    assert!(tile_row.len() >= nb * TILE && r0 + N <= acts.q.n_rows);
    // Lanes 2r and 2r + 1 of a register hold row r's halves: summed, then the even lanes.
    let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * TILE..(b + 1) * TILE];
        for j in 0..8 {
            prefetch_ahead(t, TILE, CODES + 256 * j, 4);
            let blk = 8 * b + j;
            let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, blk));
            let off: [&[i32]; N] = std::array::from_fn(|a| acts.offsets128(r0 + a, blk));
            assert!(x.iter().all(|x| x.len() >= 32) && off.iter().all(|o| o.len() >= 2));
            // SAFETY: block `j`'s four chunks (256 bytes at `CODES + 256 j`) are inside the
            // tile; every activation row has 32 codes and 2 offsets per block (asserted).
            unsafe {
                let w: [__m512i; 4] = std::array::from_fn(|c| {
                    _mm512_loadu_si512(t.as_ptr().add(CODES + 256 * j + 64 * c) as *const _)
                });
                for a in 0..N {
                    let mut s = _mm512_set1_epi64((off[a].as_ptr() as *const i64).read_unaligned());
                    for (c, wc) in w.iter().enumerate() {
                        let xc = (x[a].as_ptr().add(8 * c) as *const i64).read_unaligned();
                        s = _mm512_dpbusd_epi32(s, *wc, _mm512_set1_epi64(xc));
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
) -> [__m256; N] {
    assert!(tile_row.len() >= nb * TILE && r0 + N <= acts.q.n_rows);
    let (flip, ones) = (_mm256_set1_epi8(-128), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let t = &tile_row[b * TILE..(b + 1) * TILE];
        for j in 0..8 {
            prefetch_ahead(t, TILE, CODES + 256 * j, 4);
            let blk = 8 * b + j;
            let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, blk));
            assert!(x.iter().all(|x| x.len() >= 32));
            // SAFETY: as in `pass_vnni`.
            unsafe {
                // Chunk c, rows 0-3 and rows 4-7: the signed codes.
                let w: [[__m256i; 2]; 4] = std::array::from_fn(|c| {
                    std::array::from_fn(|half| {
                        let at = CODES + 256 * j + 64 * c + 32 * half;
                        let raw = _mm256_loadu_si256(t.as_ptr().add(at) as *const __m256i);
                        _mm256_xor_si256(raw, flip)
                    })
                });
                for a in 0..N {
                    let mut s = [_mm256_setzero_si256(); 2];
                    for (c, wc) in w.iter().enumerate() {
                        let xc = (x[a].as_ptr().add(8 * c) as *const i64).read_unaligned();
                        let y = _mm256_set1_epi64x(xc);
                        for half in 0..2 {
                            let p = _mm256_maddubs_epi16(
                                _mm256_abs_epi8(wc[half]),
                                _mm256_sign_epi8(y, wc[half]),
                            );
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
