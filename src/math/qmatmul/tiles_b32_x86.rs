//! The AVX-512 VNNI and AVX2 bodies of the products from tiles of 32-weight blocks: Q8_0
//! ([`super::tiles_q8_0`]), Q4_0 ([`super::tiles_q4_0`]) and MXFP4
//! ([`super::tiles_mxfp4`]). One pass over a tile row for up to four activation rows at a
//! time (VNNI) or eight ([`AVX2_PASS_ROWS`], AVX2: one register of integer sums per row),
//! the eight outputs' f32 block values in one register. The AVX2 pass also reads a row's partial last column
//! (rows of whole blocks that are not whole columns of 256, gpt-oss's 2,880); the VNNI pass
//! reads whole columns of Q8_0 and Q4_0 only, and [`pass`] gives the rest to the AVX2 pass
//! (every CPU with VNNI has AVX2; a VNNI MXFP4 body was not written: the machine this was
//! built on has no AVX-512 to test it).
//!
//! The weight codes go to the unsigned side of the dot-product instructions: Q8_0's tile
//! holds each code offset by 128, Q4_0's codes are 0..16 for a weight of `q − 8`. A row's two
//! lanes start from `−128 · Σ x` (Q8_0) or `−8 · Σ x` (Q4_0) over the activation codes they
//! cover ([`super::tiles::TileActs::block_offsets`]), so after the products they hold
//! `Σ w · x` exactly (at most 32 · 128 · 127 in magnitude). AVX-512 VNNI: one `vpdpbusd` per
//! eight codes of eight rows, the activation's eight codes broadcast to every 64-bit lane.
//! AVX2: Q4_0 by `vpmaddubsw` (pairs at most 2 · 15 · 128), `vphaddw` and `vpmaddwd`, the
//! offset `−8 · Σ x` added to each block's totals; Q8_0 undoes the offset and multiplies
//! `|q|` by `x` carrying `q`'s sign (`vpsignb`; pairs at most 2 · 128 · 127, never
//! saturating: Q8_0 activations are within ±127). MXFP4 is Q4_0's pass with each code
//! replaced by its table value plus 12 (`vpshufb`: 0..=24, pairs at most 2 · 24 · 128) and
//! `−12 · Σ x` added to the totals ([`pass_avx2`] gives the 16-bit bounds); its eight rows' scales are
//! their e8m0 exponents turned into `2^(e − 128)` as ggml's `ggml_e8m0_to_fp32_half` builds
//! them (the bits, subnormals for `e` < 2).
//!
//! Guarantees: the integer sums are exact, and the f32 value of a block is
//! `(d·dy)·f32(isum)` per output (`d` = `2^(e − 128)` for MXFP4), each step one rounded operation, added to the output's
//! sum block by block in order: the portable body's bits.

use super::tiles::{TileActs, MXFP4_OFFSET, TILE_ROWS};
use super::tiles_x86::{bcast256, bcast512, prefetch_ahead, PASS_ROWS};
use crate::quant::{tiles_mxfp4, tiles_q4_0, tiles_q8_0};
use std::arch::x86_64::*;

/// The 32-weight tiles a pass reads (its `F` parameter).
pub(super) const Q8_0: u8 = 0;
/// Q4_0 tiles.
pub(super) const Q4_0: u8 = 1;
/// MXFP4 tiles.
pub(super) const MXFP4: u8 = 2;

/// Activation rows per AVX2 pass over a tile row (the VNNI pass takes
/// [`super::tiles_x86::PASS_ROWS`]).
pub(super) const AVX2_PASS_ROWS: usize = 8;

/// Bytes of one block of tile kind `f`.
const fn block_bytes(f: u8) -> usize {
    match f {
        Q8_0 => 34,
        Q4_0 => 18,
        _ => 17,
    }
}

/// Bytes of a block's scale in tile kind `f` (f16 `d`, or MXFP4's exponent byte).
const fn scale_bytes(f: u8) -> usize {
    if f == MXFP4 {
        1
    } else {
        2
    }
}

/// Bytes of the eight rows' codes of one block in tile kind `f`.
const fn code_bytes(f: u8) -> usize {
    if f == Q8_0 {
        256
    } else {
        128
    }
}

const _: () = assert!(tiles_q8_0::TILE == TILE_ROWS * 8 * block_bytes(Q8_0));
const _: () = assert!(tiles_q4_0::TILE == TILE_ROWS * 8 * block_bytes(Q4_0));
const _: () = assert!(tiles_mxfp4::TILE == TILE_ROWS * 8 * block_bytes(MXFP4));
const _: () = assert!(tiles_mxfp4::CODES == TILE_ROWS * 8 * scale_bytes(MXFP4));

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

/// The eight outputs' f32 values of block `j` of a Q8_0 or Q4_0 tile: `(d·dy)·f32(isum)`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn block_values(t: &[u8], j: usize, dy: f32, isum: __m256i) -> __m256 {
    _mm256_mul_ps(
        _mm256_mul_ps(block_scales::<Q8_0>(t, j), _mm256_set1_ps(dy)),
        _mm256_cvtepi32_ps(isum),
    )
}

/// The AVX-512 VNNI pass over Q4_0 tiles (`Q4`) or Q8_0 tiles.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI, AVX2, F16C available; `tile_row` holds `nb` tiles of that
/// format; rows `r0..r0 + N` of `acts` exist, have `8 nb` blocks and were made for it.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pass_vnni<const Q4: bool, const N: usize>(
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
                    let v = block_values(t, j, acts.d(r0 + a, blk), isum);
                    acc[a] = _mm256_add_ps(acc[a], v);
                }
            }
        }
    }
    acc
}

/// The eight rows' `d` of block `j` of a tile of kind `F`: the f16 scales widened, or for
/// MXFP4 the exponents' `2^(e − 128)` (`crate::quant::blocks::e8m0_half`'s bits: `(e − 1)
/// << 23`, or `0x0020_0000 << e` for the subnormals of `e` < 2).
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn block_scales<const F: u8>(t: &[u8], j: usize) -> __m256 {
    let sb = scale_bytes(F);
    assert!(t.len() >= 8 * sb * (j + 1));
    if F == MXFP4 {
        // SAFETY: 8 bytes at `8 j` (asserted).
        let e = _mm256_cvtepu8_epi32(unsafe {
            _mm_loadl_epi64(t.as_ptr().add(8 * j) as *const __m128i)
        });
        let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
        let small = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, is_small))
    } else {
        // SAFETY: 16 bytes at `16 j` (asserted).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(t.as_ptr().add(16 * j) as *const __m128i) })
    }
}

/// The AVX2 pass over a tile row of kind `F` ([`Q8_0`], [`Q4_0`], [`MXFP4`]): `full`
/// whole columns, then the partial column of `part` blocks (none when 0).
///
/// Up to [`AVX2_PASS_ROWS`] activation rows a pass: per block, the eight rows' weights of
/// a group of codes are decoded once into registers and every activation row runs on them.
/// Q4_0 and MXFP4, per 64-byte chunk (16 codes of eight rows): the low and the high
/// nibbles' `vpmaddubsw` pairs (each at most 2 · 24 · 128 = 6144 in magnitude) of rows 0-3
/// and 4-7 joined by `vphaddw` (12288) and the two added (24576 < 2^15: never wraps), then
/// widened by `vpmaddwd` by ones into one register of the eight rows' 32-bit sums, the
/// activation's offset added to the totals at the end of the block. Q8_0, per group of
/// eight codes: `|w|` times `x` with `w`'s sign (pairs up to 2 · 128 · 127), widened, and
/// the two halves joined by `vphaddd`. One register of sums per activation row (not two)
/// is what lets eight rows share each decoded weight: the first pass (four rows, two
/// registers each, every row's scale and offsets looked up per block with a division and
/// bounds checks) ran at 0.64-0.90x of the row layout's body at 8 and 32 rows. Each row's
/// codes, scales and offsets are walked from slices taken once per pass, and the eight
/// rows' `d` are formed once per block.
///
/// # Safety
/// AVX2 and F16C available; `tile_row` holds that tile row of that format (`8 (8 full +
/// part)` blocks); rows `r0..r0 + N` of `acts` exist, have `8 full + part` blocks and were
/// made for it.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass_avx2<const F: u8, const N: usize>(
    tile_row: &[u8],
    full: usize,
    part: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    let bb = block_bytes(F);
    let nibbles = F != Q8_0;
    let nblk = 8 * full + part;
    let q = acts.q;
    let nbr = q.blocks_per_row();
    assert!(tile_row.len() >= TILE_ROWS * nblk * bb && r0 + N <= q.n_rows);
    assert!(q.format.block_elems() == 32 && nbr >= nblk);
    // Each row's codes (32 a block), scales and lane offsets (two a block) from block 0:
    // the slices' lengths hold every block the pass reads (asserted above).
    let xs: [&[i8]; N] = std::array::from_fn(|a| &q.qs[(r0 + a) * q.cols..][..32 * nbr]);
    let ds: [&[f32]; N] = std::array::from_fn(|a| &q.d[(r0 + a) * nbr..][..nbr]);
    let offs: [&[i32]; N] = std::array::from_fn(|a| {
        if nibbles {
            acts.row_block_offsets(r0 + a)
        } else {
            &[]
        }
    });
    assert!(offs.iter().all(|o| !nibbles || o.len() >= 2 * nbr));
    let (flip, ones, m4) = (
        _mm256_set1_epi8(-128),
        _mm256_set1_epi16(1),
        _mm256_set1_epi8(0x0f),
    );
    // `kvalues_mxfp4` plus MXFP4_OFFSET, in both 128-bit halves (`vpshufb` looks up per half).
    let off = MXFP4_OFFSET as i8;
    let kv: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let table: [i8; 32] = std::array::from_fn(|i| kv[i % 16] + off);
    // SAFETY: 32 bytes.
    let table = unsafe { _mm256_loadu_si256(table.as_ptr() as *const __m256i) };
    let mut acc = [_mm256_setzero_ps(); N];
    let mut at_col = 0;
    for b in 0..full + usize::from(part > 0) {
        let k = if b < full { 8 } else { part };
        let tb = TILE_ROWS * k * bb;
        let t = &tile_row[at_col..at_col + tb];
        at_col += tb;
        let codes = TILE_ROWS * k * scale_bytes(F);
        for j in 0..k {
            let at = codes + code_bytes(F) * j;
            prefetch_ahead(t, tb, at, code_bytes(F) / 64);
            let blk = 8 * b + j;
            assert!(t.len() >= at + code_bytes(F) && blk < nblk);
            let d = block_scales::<F>(t, j);
            // SAFETY: the block's code bytes (`at..at + code_bytes`) are inside the tile
            // (asserted); `blk < nblk <= nbr`, so each row's codes `32 blk..32 blk + 32`,
            // scale `blk` and offsets `2 blk..2 blk + 2` are inside its slices (asserted
            // lengths).
            unsafe {
                let x: [*const i8; N] = std::array::from_fn(|a| xs[a].as_ptr().add(32 * blk));
                // Lane order of every row's sums: [r0 r1 r4 r5 | r2 r3 r6 r7].
                let mut s = [_mm256_setzero_si256(); N];
                if nibbles {
                    // Per 64-byte chunk `c`: the low nibbles are codes `16c..16c + 8`
                    // of the eight rows, the high ones the next eight.
                    for c in 0..2 {
                        let raw: [__m256i; 2] = std::array::from_fn(|half| {
                            let p = t.as_ptr().add(at + 64 * c + 32 * half);
                            _mm256_loadu_si256(p as *const __m256i)
                        });
                        let value = |q: __m256i| {
                            if F == MXFP4 {
                                _mm256_shuffle_epi8(table, q)
                            } else {
                                q
                            }
                        };
                        let lo = raw.map(|r| value(_mm256_and_si256(r, m4)));
                        let hi =
                            raw.map(|r| value(_mm256_and_si256(_mm256_srli_epi16::<4>(r), m4)));
                        for (a, sa) in s.iter_mut().enumerate() {
                            let (ylo, yhi) =
                                (bcast256(x[a].add(16 * c)), bcast256(x[a].add(16 * c + 8)));
                            // `vphaddw` of the two halves' pairs: [r0 r0 r1 r1 r4 r4 r5 r5 |
                            // r2 r2 r3 r3 r6 r6 r7 r7], each lane four products.
                            let l = _mm256_hadd_epi16(
                                _mm256_maddubs_epi16(lo[0], ylo),
                                _mm256_maddubs_epi16(lo[1], ylo),
                            );
                            let h = _mm256_hadd_epi16(
                                _mm256_maddubs_epi16(hi[0], yhi),
                                _mm256_maddubs_epi16(hi[1], yhi),
                            );
                            let lanes = _mm256_madd_epi16(_mm256_add_epi16(l, h), ones);
                            *sa = _mm256_add_epi32(*sa, lanes);
                        }
                    }
                } else {
                    for g in 0..4 {
                        let w: [__m256i; 2] = std::array::from_fn(|half| {
                            let p = t.as_ptr().add(at + 64 * g + 32 * half);
                            _mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), flip)
                        });
                        let mag = w.map(|w| _mm256_abs_epi8(w));
                        for (a, sa) in s.iter_mut().enumerate() {
                            let y = bcast256(x[a].add(8 * g));
                            let p: [__m256i; 2] = std::array::from_fn(|half| {
                                let signed = _mm256_sign_epi8(y, w[half]);
                                _mm256_madd_epi16(_mm256_maddubs_epi16(mag[half], signed), ones)
                            });
                            *sa = _mm256_add_epi32(*sa, _mm256_hadd_epi32(p[0], p[1]));
                        }
                    }
                }
                for (a, sa) in s.iter().enumerate() {
                    // [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order.
                    let mut isum = _mm256_permute4x64_epi64::<0b11_01_10_00>(*sa);
                    if nibbles {
                        let o = offs[a].as_ptr().add(2 * blk);
                        isum = _mm256_add_epi32(isum, _mm256_set1_epi32(*o + *o.add(1)));
                    }
                    let dy = _mm256_set1_ps(*ds[a].as_ptr().add(blk));
                    let v = _mm256_mul_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum));
                    acc[a] = _mm256_add_ps(acc[a], v);
                }
            }
        }
    }
    acc
}

/// Activation rows up to which [`pass`] runs [`pass_avx2_few`] on AVX2 (when the
/// few-row passes are on: `QuantKernels::with_few_row_passes`).
pub(super) const FEW_ROWS: usize = 4;

/// The AVX2 pass at few activation rows (1..=[`FEW_ROWS`]): [`pass_avx2`]'s arithmetic
/// without its per-chunk horizontal adds.
///
/// [`pass_avx2`] joins rows 0-3 and 4-7 with `vphaddw` in every 64-byte chunk so that one
/// register of sums per row is enough for eight rows; with at most four rows there are
/// registers for two per row, so here each row keeps rows 0-3's and 4-7's sums apart for
/// the whole block and joins them once: Q4_0 and MXFP4 add the low and the high nibbles'
/// `vpmaddubsw` pairs of both chunks in 16 bits (four pairs, each at most 2 · 24 · 128 =
/// 6144 in magnitude: 24576 < 2^15, never wraps), widen each half once by `vpmaddwd`
/// and join them with one `vphaddd`; Q8_0 widens each group's pairs and adds them in 32
/// bits, then one `vphaddd` per block. The integer sums and every f32 step are
/// [`pass_avx2`]'s, so the bits are the same.
///
/// # Safety
/// As [`pass_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass_avx2_few<const F: u8, const N: usize>(
    tile_row: &[u8],
    full: usize,
    part: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    let bb = block_bytes(F);
    let nibbles = F != Q8_0;
    let nblk = 8 * full + part;
    let q = acts.q;
    let nbr = q.blocks_per_row();
    assert!(tile_row.len() >= TILE_ROWS * nblk * bb && r0 + N <= q.n_rows);
    assert!(q.format.block_elems() == 32 && nbr >= nblk);
    let xs: [&[i8]; N] = std::array::from_fn(|a| &q.qs[(r0 + a) * q.cols..][..32 * nbr]);
    let ds: [&[f32]; N] = std::array::from_fn(|a| &q.d[(r0 + a) * nbr..][..nbr]);
    let offs: [&[i32]; N] = std::array::from_fn(|a| {
        if nibbles {
            acts.row_block_offsets(r0 + a)
        } else {
            &[]
        }
    });
    assert!(offs.iter().all(|o| !nibbles || o.len() >= 2 * nbr));
    let (flip, ones, m4) = (
        _mm256_set1_epi8(-128),
        _mm256_set1_epi16(1),
        _mm256_set1_epi8(0x0f),
    );
    let off = MXFP4_OFFSET as i8;
    let kv: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let table: [i8; 32] = std::array::from_fn(|i| kv[i % 16] + off);
    // SAFETY: 32 bytes.
    let table = unsafe { _mm256_loadu_si256(table.as_ptr() as *const __m256i) };
    let mut acc = [_mm256_setzero_ps(); N];
    let mut at_col = 0;
    for b in 0..full + usize::from(part > 0) {
        let k = if b < full { 8 } else { part };
        let tb = TILE_ROWS * k * bb;
        let t = &tile_row[at_col..at_col + tb];
        at_col += tb;
        let codes = TILE_ROWS * k * scale_bytes(F);
        for j in 0..k {
            let at = codes + code_bytes(F) * j;
            prefetch_ahead(t, tb, at, code_bytes(F) / 64);
            let blk = 8 * b + j;
            assert!(t.len() >= at + code_bytes(F) && blk < nblk);
            let d = block_scales::<F>(t, j);
            // SAFETY: as in `pass_avx2` (the same bounds, asserted the same way).
            unsafe {
                let x: [*const i8; N] = std::array::from_fn(|a| xs[a].as_ptr().add(32 * blk));
                // Per row: rows 0-3's and rows 4-7's sums, [r0 r0 r1 r1 | r2 r2 r3 r3].
                let mut s = [[_mm256_setzero_si256(); 2]; N];
                if nibbles {
                    for c in 0..2 {
                        let raw: [__m256i; 2] = std::array::from_fn(|half| {
                            let p = t.as_ptr().add(at + 64 * c + 32 * half);
                            _mm256_loadu_si256(p as *const __m256i)
                        });
                        let value = |q: __m256i| {
                            if F == MXFP4 {
                                _mm256_shuffle_epi8(table, q)
                            } else {
                                q
                            }
                        };
                        let lo = raw.map(|r| value(_mm256_and_si256(r, m4)));
                        let hi =
                            raw.map(|r| value(_mm256_and_si256(_mm256_srli_epi16::<4>(r), m4)));
                        for (a, sa) in s.iter_mut().enumerate() {
                            let (ylo, yhi) =
                                (bcast256(x[a].add(16 * c)), bcast256(x[a].add(16 * c + 8)));
                            for half in 0..2 {
                                let p = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo[half], ylo),
                                    _mm256_maddubs_epi16(hi[half], yhi),
                                );
                                sa[half] = _mm256_add_epi16(sa[half], p);
                            }
                        }
                    }
                    for sa in s.iter_mut() {
                        *sa = sa.map(|v| _mm256_madd_epi16(v, ones));
                    }
                } else {
                    for g in 0..4 {
                        let w: [__m256i; 2] = std::array::from_fn(|half| {
                            let p = t.as_ptr().add(at + 64 * g + 32 * half);
                            _mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), flip)
                        });
                        let mag = w.map(|w| _mm256_abs_epi8(w));
                        for (a, sa) in s.iter_mut().enumerate() {
                            let y = bcast256(x[a].add(8 * g));
                            for half in 0..2 {
                                let signed = _mm256_sign_epi8(y, w[half]);
                                let p = _mm256_madd_epi16(
                                    _mm256_maddubs_epi16(mag[half], signed),
                                    ones,
                                );
                                sa[half] = _mm256_add_epi32(sa[half], p);
                            }
                        }
                    }
                }
                for (a, sa) in s.iter().enumerate() {
                    // [r0 r1 r4 r5 | r2 r3 r6 r7] -> rows in order.
                    let joined = _mm256_hadd_epi32(sa[0], sa[1]);
                    let mut isum = _mm256_permute4x64_epi64::<0b11_01_10_00>(joined);
                    if nibbles {
                        let o = offs[a].as_ptr().add(2 * blk);
                        isum = _mm256_add_epi32(isum, _mm256_set1_epi32(*o + *o.add(1)));
                    }
                    let dy = _mm256_set1_ps(*ds[a].as_ptr().add(blk));
                    let v = _mm256_mul_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum));
                    acc[a] = _mm256_add_ps(acc[a], v);
                }
            }
        }
    }
    acc
}

/// Stores a pass's registers into plain arrays.
fn store<const N: usize>(dst: &mut [[f32; TILE_ROWS]; AVX2_PASS_ROWS], v: [__m256; N]) {
    for (d, v) in dst.iter_mut().zip(v) {
        // SAFETY: `__m256` is eight f32 in lane order, as `[f32; 8]` (same size, any bits
        // valid).
        *d = unsafe { std::mem::transmute::<__m256, [f32; TILE_ROWS]>(v) };
    }
}

/// Whether [`pass`] runs the VNNI pass for tile kind `f` (whole columns of Q8_0 or Q4_0
/// when `vnni`), and so how many rows a pass takes: [`PASS_ROWS`] or [`AVX2_PASS_ROWS`].
pub(super) fn pass_rows(f: u8, vnni: bool, part: usize) -> usize {
    if vnni && part == 0 && f != MXFP4 {
        PASS_ROWS
    } else {
        AVX2_PASS_ROWS
    }
}

/// One pass of `n` activation rows from `r0` (1..=[`pass_rows`]) over a tile row of kind
/// `f` (`full` whole columns then `part` blocks), into `sums[a]` for row `r0 + a`: the
/// VNNI pass when `vnni` and the tile row is whole columns of Q8_0 or Q4_0; otherwise
/// the few-row AVX2 pass ([`pass_avx2_few`]) when `few` and `n` <= [`FEW_ROWS`], the AVX2
/// pass ([`pass_avx2`]) else.
///
/// # Safety
/// As [`pass_avx2`] (and [`pass_vnni`] when `vnni`: the CPU has its features), with `N` =
/// `n`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pass(
    f: u8,
    (vnni, few): (bool, bool),
    n: usize,
    tr: &[u8],
    (full, part): (usize, usize),
    acts: &TileActs<'_>,
    r0: usize,
    s: &mut [[f32; TILE_ROWS]; AVX2_PASS_ROWS],
) {
    assert!(n >= 1 && n <= pass_rows(f, vnni, part));
    macro_rules! avx2 {
        ($f:expr) => {
            match n {
                1 => store(s, pass_avx2::<{ $f }, 1>(tr, full, part, acts, r0)),
                2 => store(s, pass_avx2::<{ $f }, 2>(tr, full, part, acts, r0)),
                3 => store(s, pass_avx2::<{ $f }, 3>(tr, full, part, acts, r0)),
                4 => store(s, pass_avx2::<{ $f }, 4>(tr, full, part, acts, r0)),
                5 => store(s, pass_avx2::<{ $f }, 5>(tr, full, part, acts, r0)),
                6 => store(s, pass_avx2::<{ $f }, 6>(tr, full, part, acts, r0)),
                7 => store(s, pass_avx2::<{ $f }, 7>(tr, full, part, acts, r0)),
                _ => store(s, pass_avx2::<{ $f }, 8>(tr, full, part, acts, r0)),
            }
        };
    }
    macro_rules! few {
        ($f:expr) => {
            match n {
                1 => store(s, pass_avx2_few::<{ $f }, 1>(tr, full, part, acts, r0)),
                2 => store(s, pass_avx2_few::<{ $f }, 2>(tr, full, part, acts, r0)),
                3 => store(s, pass_avx2_few::<{ $f }, 3>(tr, full, part, acts, r0)),
                _ => store(s, pass_avx2_few::<{ $f }, 4>(tr, full, part, acts, r0)),
            }
        };
    }
    let vnni_pass = pass_rows(f, vnni, part) == PASS_ROWS;
    // SAFETY: the caller's contract, for whichever pass runs.
    unsafe {
        match (f, vnni_pass, n) {
            (Q8_0, true, 1) => store(s, pass_vnni::<false, 1>(tr, full, acts, r0)),
            (Q8_0, true, 2) => store(s, pass_vnni::<false, 2>(tr, full, acts, r0)),
            (Q8_0, true, 3) => store(s, pass_vnni::<false, 3>(tr, full, acts, r0)),
            (Q8_0, true, _) => store(s, pass_vnni::<false, 4>(tr, full, acts, r0)),
            (Q4_0, true, 1) => store(s, pass_vnni::<true, 1>(tr, full, acts, r0)),
            (Q4_0, true, 2) => store(s, pass_vnni::<true, 2>(tr, full, acts, r0)),
            (Q4_0, true, 3) => store(s, pass_vnni::<true, 3>(tr, full, acts, r0)),
            (Q4_0, true, _) => store(s, pass_vnni::<true, 4>(tr, full, acts, r0)),
            (Q8_0, _, n) if few && n <= FEW_ROWS => few!(Q8_0),
            (Q4_0, _, n) if few && n <= FEW_ROWS => few!(Q4_0),
            (_, _, n) if few && n <= FEW_ROWS => few!(MXFP4),
            (Q8_0, _, _) => avx2!(Q8_0),
            (Q4_0, _, _) => avx2!(Q4_0),
            (_, _, _) => avx2!(MXFP4),
        }
    }
}
