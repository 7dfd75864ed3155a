//! The AVX2 bodies of the products from Q6_K tiles ([`crate::quant::tiles_q6k`]) and Q8_0
//! tiles ([`crate::quant::tiles_q8_0`]) at many activation rows: each tile row (eight
//! outputs) is unpacked once into registers' worth of ready codes and scales
//! ([`unpack_q6k`], [`unpack_q8_0`]), then every activation row runs on them, eight a pass
//! ([`PASS_ROWS`]), each with one register of integer sums, row `r`'s in 32-bit lane `r`.
//!
//! Q8_0 ([`pass_q8_0`]): the unpacked block holds, per group of four codes, the eight rows'
//! `|w|` and `w` with row `r`'s four codes in 32-bit lane `r`; per activation row and
//! group one `vpsignb`, one `vpmaddubsw` and one `vpmaddwd` by ones, where the eight-row
//! pass (`super::tiles_b32_x86::pass_avx2`) holds rows 0-3 and 4-7 of a group of eight
//! codes in two registers, signs both, and joins them with a `vphaddd` per group.
//!
//! Why: the four-row pass (`super::tiles_q6k_x86::pass_avx2`) joins each code's low nibble
//! and top bits again in every pass (about 21 instructions a sub-block, over four rows),
//! and keeps two registers of sums per activation row (rows 0-3 and 4-7 of the tile), so
//! it multiplies by the scales twice per sub-block and row and cannot take more rows.
//! Prefill gives a routed expert tens of rows and a shared expert or an attention
//! projection hundreds (DeepSeek-V2-Lite: Q6_K experts, `docs/performance.md`), so the
//! unpacking is paid once per tile row per product here instead.
//!
//! The unpacked block: per sub-block `c` (16 codes), four registers `W_k` (`k` < 4) whose
//! 32-bit lane `r` holds row `r`'s codes `16c + 4k..16c + 4k + 4` (0..64, the `+ 32` form),
//! then the eight rows' scales as 16-bit pairs (lanes `2r`, `2r + 1` = row `r`'s); after
//! the sixteen sub-blocks, the rows' `d` widened to f32. Per activation row and sub-block:
//! four `vpmaddubsw` of `W_k` against the row's codes `4k..4k + 4` broadcast to every
//! 32-bit lane (16-bit lane `2r` of each sums row `r`'s products of codes `4k, 4k + 1`,
//! lane `2r + 1` of `4k + 2, 4k + 3`, at most 2 · 63 · 127 each: never saturates), added
//! in 16 bits to a start of `−32 · Σ x` over each lane's eight codes
//! ([`super::tiles::TileActs::sub16`]); the total is `Σ (q − 32) · x` over eight codes,
//! at most 8 · 32 · 127 = 32512 in magnitude, so the wrapping 16-bit adds are exact. One
//! `vpmaddwd` with the scales gives row `r`'s scaled sub-block sum in 32-bit lane `r`.
//! Four multiplies of codes and one of scales per 128 products, where the four-row pass
//! has four and two, plus its unpacking.
//!
//! Guarantees: the integer sums are exact, and the f32 value of a block is
//! `(d·dy)·f32(isum)` per output, each step one rounded operation, added to the output's
//! sum block by block in order: the portable body's bits, as every other body.

use super::tiles::{TileActs, TILE_ROWS};
use super::tiles_q6k_x86::codes256;
use crate::quant::tiles_q6k::{GROUP, GROUPS, SCALES, TILE};
use std::arch::x86_64::*;

/// Activation rows per pass over an unpacked tile row.
pub(super) const PASS_ROWS: usize = 8;

/// Below this many activation rows a product keeps the earlier passes (Q6_K's four-row,
/// Q8_0's eight-row): unpacking a panel costs about what a few of their passes spend
/// unpacking, and the unpacked rows are read back from memory. `QUANT_BENCH_MANY=1 cargo
/// bench --bench quant`, three runs (old time / new time): at 16 rows 0.95-1.05 for Q6_K
/// and 0.90-0.95 for Q8_0, at 48 rows 1.14-1.24 and 0.99-1.14.
pub(super) const MIN_ROWS: usize = 32;

/// Registers of one unpacked block: 16 sub-blocks of four code registers and a scale
/// register, then the eight `d`.
pub(super) const BLOCK_REGS: usize = 16 * 5 + 1;

/// Unpacks a tile row of `nb` Q6_K tiles into `out` (`nb · BLOCK_REGS` registers, the
/// layout of the module's doc).
///
/// # Safety
/// AVX2 and F16C available.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn unpack_q6k(tile_row: &[u8], nb: usize, out: &mut [__m256i]) {
    assert!(tile_row.len() >= nb * TILE && out.len() >= nb * BLOCK_REGS);
    for b in 0..nb {
        let t = &tile_row[b * TILE..(b + 1) * TILE];
        let o = &mut out[b * BLOCK_REGS..(b + 1) * BLOCK_REGS];
        // SAFETY: every load below is inside the tile: groups `GROUPS + GROUP p` (192
        // bytes each, p < 8), the scales `SCALES..SCALES + 128` and `d` (bytes 0..16).
        unsafe {
            for p in 0..8 {
                let g = GROUPS + GROUP * p;
                let qh: [__m256i; 2] = std::array::from_fn(|half| {
                    _mm256_loadu_si256(t.as_ptr().add(g + 128 + 32 * half) as *const __m256i)
                });
                for h in 0..2 {
                    let c = 2 * p + h;
                    // Per half (rows 4 half..4 half + 4): codes 0-7 (`lo`) and 8-15 (`hi`)
                    // of the sub-block, eight bytes a row, rows 2i, 2i + 1 in 128-bit lane i.
                    let mut lo = [_mm256_setzero_si256(); 2];
                    let mut hi = [_mm256_setzero_si256(); 2];
                    for half in 0..2 {
                        let at = g + 64 * h + 32 * half;
                        let ql = _mm256_loadu_si256(t.as_ptr().add(at) as *const __m256i);
                        (lo[half], hi[half]) = codes256(ql, qh[half], h == 1);
                    }
                    let (w0, w1) = four_bytes_per_row(lo);
                    let (w2, w3) = four_bytes_per_row(hi);
                    o[5 * c..5 * c + 4].copy_from_slice(&[w0, w1, w2, w3]);
                    let sc8 = _mm_loadl_epi64(t.as_ptr().add(SCALES + 8 * c) as *const __m128i);
                    o[5 * c + 4] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(t.as_ptr() as *const __m128i));
            o[80] = _mm256_castps_si256(d);
        }
    }
}

/// Eight codes a row of rows 0-3 (`v[0]`) and 4-7 (`v[1]`), rows `2i, 2i + 1` of each in
/// 128-bit lane `i`, as two registers of four codes a row with row `r` in 32-bit lane `r`:
/// (codes 0-3, codes 4-7).
#[target_feature(enable = "avx2")]
#[inline]
fn four_bytes_per_row(v: [__m256i; 2]) -> (__m256i, __m256i) {
    // Per 128-bit lane [rA c0-3, rA c4-7, rB c0-3, rB c4-7] -> [rA c0-3, rB c0-3, rA c4-7,
    // rB c4-7]; then 64-bit lanes [01 c0-3, 01 c4-7, 23 c0-3, 23 c4-7] -> [01 c0-3, 23
    // c0-3, 01 c4-7, 23 c4-7].
    let p = v.map(|v| {
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi32::<0b11_01_10_00>(v))
    });
    (
        _mm256_permute2x128_si256::<0x20>(p[0], p[1]),
        _mm256_permute2x128_si256::<0x31>(p[0], p[1]),
    )
}

/// One pass of `N` activation rows from `r0` over an unpacked tile row of `nb` blocks:
/// the eight outputs' sums of each row.
///
/// # Safety
/// AVX2, FMA and F16C available; `un` holds `nb` unpacked blocks ([`unpack_q6k`]); rows
/// `r0..r0 + N` of `acts` exist, have `nb` blocks and were made for Q6_K without VNNI.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass<const N: usize>(
    un: &[__m256i],
    nb: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    assert!(un.len() >= nb * BLOCK_REGS && r0 + N <= acts.q.n_rows);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let blk = &un[b * BLOCK_REGS..(b + 1) * BLOCK_REGS];
        let x: [&[i8]; N] = std::array::from_fn(|a| acts.codes(r0 + a, b));
        let off: [&[i32]; N] = std::array::from_fn(|a| acts.sub16(r0 + a, b));
        assert!(x.iter().all(|x| x.len() >= 256) && off.iter().all(|o| o.len() >= 16));
        let mut isum = [_mm256_setzero_si256(); N];
        for c in 0..16 {
            let w = [blk[5 * c], blk[5 * c + 1], blk[5 * c + 2], blk[5 * c + 3]];
            let sc = blk[5 * c + 4];
            for a in 0..N {
                // SAFETY: codes `16c..16c + 16` of a 256-code block and offset `c` of 16
                // (asserted lengths).
                let (xa, start) = unsafe { (x[a].as_ptr().add(16 * c), *off[a].as_ptr().add(c)) };
                let mut s = _mm256_set1_epi32(start);
                for (k, wk) in w.iter().enumerate() {
                    // SAFETY: 4 of the 16 codes from `xa`.
                    let y = unsafe { (xa.add(4 * k) as *const i32).read_unaligned() };
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(*wk, _mm256_set1_epi32(y)));
                }
                isum[a] = _mm256_add_epi32(isum[a], _mm256_madd_epi16(s, sc));
            }
        }
        let d = _mm256_castsi256_ps(blk[80]);
        for a in 0..N {
            let dy = _mm256_set1_ps(acts.d(r0 + a, b));
            let v = _mm256_mul_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum[a]));
            acc[a] = _mm256_add_ps(acc[a], v);
        }
    }
    acc
}
const _: () = assert!(PASS_ROWS <= super::tiles_b32_x86::AVX2_PASS_ROWS);

/// Registers of one unpacked Q8_0 block (32 codes of eight rows): per group `k` of four
/// codes (`k` < 8) the codes' magnitudes and the codes themselves, then the eight `d`.
pub(super) const Q8_BLOCK_REGS: usize = 2 * 8 + 1;

/// Unpacks a tile row of Q8_0 tiles (`full` whole columns, then a partial one of `part`
/// blocks) into `out` (`(8 full + part) · Q8_BLOCK_REGS` registers).
///
/// # Safety
/// AVX2 and F16C available.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn unpack_q8_0(tile_row: &[u8], full: usize, part: usize, out: &mut [__m256i]) {
    let nblk = 8 * full + part;
    assert!(tile_row.len() >= nblk * 8 * 34 && out.len() >= nblk * Q8_BLOCK_REGS);
    let flip = _mm256_set1_epi8(-128);
    let mut at_col = 0;
    for col in 0..full + usize::from(part > 0) {
        let k = if col < full { 8 } else { part };
        let t = &tile_row[at_col..at_col + 272 * k];
        at_col += 272 * k;
        for j in 0..k {
            let o = &mut out[(8 * col + j) * Q8_BLOCK_REGS..][..Q8_BLOCK_REGS];
            // SAFETY: block `j`'s `d` (16 bytes at `16 j`) and its four 64-byte code chunks
            // (at `16 k + 64 (4 j + c)`) are inside the tile of `272 k` bytes.
            unsafe {
                for c in 0..4 {
                    let at = 16 * k + 64 * (4 * j + c);
                    let h: [__m256i; 2] = std::array::from_fn(|half| {
                        let p = t.as_ptr().add(at + 32 * half) as *const __m256i;
                        _mm256_xor_si256(_mm256_loadu_si256(p), flip)
                    });
                    let (w0, w1) = four_bytes_per_row(h);
                    o[4 * c..4 * c + 4].copy_from_slice(&[
                        _mm256_abs_epi8(w0),
                        w0,
                        _mm256_abs_epi8(w1),
                        w1,
                    ]);
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(t.as_ptr().add(16 * j) as *const __m128i));
                o[16] = _mm256_castps_si256(d);
            }
        }
    }
}

/// One pass of `N` activation rows (Q8_0) from `r0` over an unpacked Q8_0 tile row of
/// `nblk` blocks: per group of four codes `|w|` times `x` with `w`'s sign (`vpsignb`;
/// pairs at most 2 · 128 · 127, never saturating: Q8_0 activations are within ±127),
/// widened by `vpmaddwd` by ones into row `r`'s 32-bit lane `r`.
///
/// # Safety
/// AVX2, FMA and F16C available; `un` holds `nblk` unpacked blocks ([`unpack_q8_0`]);
/// rows `r0..r0 + N` of `acts` exist and are Q8_0 rows of at least `nblk` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pass_q8_0<const N: usize>(
    un: &[__m256i],
    nblk: usize,
    acts: &TileActs<'_>,
    r0: usize,
) -> [__m256; N] {
    let q = acts.q;
    let nbr = q.blocks_per_row();
    assert!(un.len() >= nblk * Q8_BLOCK_REGS && r0 + N <= q.n_rows);
    assert!(q.format.block_elems() == 32 && nbr >= nblk);
    let xs: [&[i8]; N] = std::array::from_fn(|a| &q.qs[(r0 + a) * q.cols..][..32 * nbr]);
    let ds: [&[f32]; N] = std::array::from_fn(|a| &q.d[(r0 + a) * nbr..][..nbr]);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    for j in 0..nblk {
        let blk = &un[j * Q8_BLOCK_REGS..(j + 1) * Q8_BLOCK_REGS];
        let mut isum = [_mm256_setzero_si256(); N];
        for k in 0..8 {
            let (m, w) = (blk[2 * k], blk[2 * k + 1]);
            for a in 0..N {
                // SAFETY: codes `32 j + 4 k..+ 4` of a row of `32 nbr` (j < nblk <= nbr).
                let y =
                    unsafe { (xs[a].as_ptr().add(32 * j + 4 * k) as *const i32).read_unaligned() };
                let p = _mm256_maddubs_epi16(m, _mm256_sign_epi8(_mm256_set1_epi32(y), w));
                isum[a] = _mm256_add_epi32(isum[a], _mm256_madd_epi16(p, ones));
            }
        }
        let d = _mm256_castsi256_ps(blk[16]);
        for a in 0..N {
            let dy = _mm256_set1_ps(ds[a][j]);
            let v = _mm256_mul_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(isum[a]));
            acc[a] = _mm256_add_ps(acc[a], v);
        }
    }
    acc
}

/// The product of a panel of whole tile rows (`panel`, `tile_row_bytes` each) of Q6_K
/// tiles (`q8` false; `spans` = (blocks, 0)) or Q8_0 tiles (`q8`; `spans` = whole columns
/// and the partial column's blocks) with every row of `acts`, into `local[r · rows + i]`
/// (`rows` = the panel's output rows). Every tile row of the panel is unpacked first
/// (tens to hundreds of KB, held in L2), then each pass of [`PASS_ROWS`] activation rows
/// runs over all of them while its rows stay in L1: a prefill's hundreds of activation
/// rows (over a MB of codes) then stream from L3 once per panel instead of once per tile
/// row.
///
/// # Safety
/// AVX2, FMA and F16C available; `panel` is whole tile rows of that format with `spans`
/// columns; `acts` was made for it without VNNI (Q8_0 or Q8_K rows of those columns);
/// `local.len() == acts.q.n_rows · rows`.
pub(super) unsafe fn panel(
    q8: bool,
    panel: &[u8],
    tile_row_bytes: usize,
    (full, part): (usize, usize),
    acts: &TileActs<'_>,
    local: &mut [f32],
) {
    assert!(tile_row_bytes > 0 && panel.len().is_multiple_of(tile_row_bytes));
    let tiles = panel.len() / tile_row_bytes;
    let rows = tiles * TILE_ROWS;
    let n_rows = acts.q.n_rows;
    assert_eq!(local.len(), n_rows * rows);
    let (blocks, regs) = if q8 {
        (8 * full + part, Q8_BLOCK_REGS)
    } else {
        (full, BLOCK_REGS)
    };
    let per = blocks * regs;
    let mut un = vec![_mm256_setzero_si256(); tiles * per];
    for (t, out) in un.chunks_exact_mut(per).enumerate() {
        let tile_row = &panel[t * tile_row_bytes..(t + 1) * tile_row_bytes];
        // SAFETY: the caller's features; `out` holds `blocks` unpacked blocks.
        unsafe {
            if q8 {
                unpack_q8_0(tile_row, full, part, out);
            } else {
                unpack_q6k(tile_row, full, out);
            }
        }
    }
    macro_rules! run {
        ($n:literal, $u:expr, $r0:expr) => {{
            // SAFETY: the caller's contract; `$r0 + $n <= n_rows`.
            unsafe {
                if q8 {
                    widen(pass_q8_0::<$n>($u, blocks, acts, $r0))
                } else {
                    widen(pass::<$n>($u, blocks, acts, $r0))
                }
            }
        }};
    }
    let mut r0 = 0;
    while r0 < n_rows {
        let n = PASS_ROWS.min(n_rows - r0);
        for (t, u) in un.chunks_exact(per).enumerate() {
            let sums = match n {
                1 => run!(1, u, r0),
                2 => run!(2, u, r0),
                3 => run!(3, u, r0),
                4 => run!(4, u, r0),
                5 => run!(5, u, r0),
                6 => run!(6, u, r0),
                7 => run!(7, u, r0),
                _ => run!(8, u, r0),
            };
            for (a, s) in sums.iter().enumerate().take(n) {
                let dst = (r0 + a) * rows + t * TILE_ROWS;
                local[dst..dst + TILE_ROWS].copy_from_slice(s);
            }
        }
        r0 += n;
    }
}

/// A pass's registers as plain arrays (the first `N` of [`PASS_ROWS`]).
fn widen<const N: usize>(v: [__m256; N]) -> [[f32; TILE_ROWS]; PASS_ROWS] {
    let mut out = [[0.0f32; TILE_ROWS]; PASS_ROWS];
    for (d, v) in out.iter_mut().zip(v) {
        // SAFETY: `__m256` is eight f32 in lane order, as `[f32; 8]` (same size, any bits
        // valid).
        *d = unsafe { std::mem::transmute::<__m256, [f32; TILE_ROWS]>(v) };
    }
    out
}
