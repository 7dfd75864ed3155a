//! Q4_K, Q6_K, Q8_0, Q4_0 and MXFP4 matrices repacked into tiles of eight output rows, the layout the CPU
//! backend computes from: made once at load in place of the plain blocks (same bytes per
//! tile, so every offset, budget and copy of the packed image is unchanged), and read back
//! block by block when something needs the plain layout ([`untile`]).
//!
//! Why: ggml's row layout gives a SIMD body one output per weight row, so each 256-weight
//! block ends in horizontal sums and scalar f32 steps for that one output. With eight rows'
//! blocks interleaved, one 32-bit lane holds part of one output's integer sum, the scales
//! (and mins) of eight rows are applied with one instruction each, and the f32 block value
//! of eight outputs is one vector operation per step (llama.cpp repacks for the same
//! reason: `block_q4_Kx8` in ggml-cpu's `repack.cpp`; these layouts are moec's own, chosen
//! for its bodies in `crate::math::qmatmul`'s tile bodies
//! (`tiles_x86`, `tiles_q6k_x86`, `tiles_b32_x86`)).
//!
//! The tile of rows `8t..8t + 8`, 256-weight column `b`, is those eight rows' blocks of that
//! column (1152 bytes for Q4_K, 1680 for Q6_K, 2176, 1152 and 1088 for Q8_0's, Q4_0's and
//! MXFP4's eight 32-weight blocks a row, [`tile_bytes`]) at `8t · row_bytes + b ·
//! tile_bytes`, so a range of whole tile rows is the same byte range as the same rows
//! stored plain. Rows of the 32-weight formats need only be whole blocks, not whole
//! columns of 256 (gpt-oss's are 2,880 weights: 11 columns and 64 weights): their last
//! column then holds the `k < 8` blocks left, a tile of `8 k` blocks laid out as a whole
//! one with `k` in place of 8 ([`columns`]), so a tile row still takes exactly its rows'
//! plain bytes. The Q6_K tile is described in [`super::tiles_q6k`], the Q8_0 tile in
//! [`super::tiles_q8_0`], the Q4_0 tile in [`super::tiles_q4_0`], the MXFP4 tile in
//! [`super::tiles_mxfp4`]; the Q4_K tile is:
//!
//! - bytes `0..16`: the eight rows' `d` (f16, row order); `16..32`: their `dmin`;
//! - `32..96`: one byte per (row `r`, sub-block `j`) at [`sm_index`]: the 6-bit scale in
//!   bits 0-5, bits 0-1 of the 6-bit min in bits 6-7;
//! - `96..128`: bits 2-5 of the min of index `i` in the low nibble of byte `i` (`i < 32`)
//!   or the high nibble of byte `i − 32`;
//! - `128..1152`: sixteen 64-byte chunks; chunk `c`, byte `8r + i` holds row `r`'s code
//!   `16c + i` in its low nibble and code `16c + 8 + i` in its high nibble.
//!
//! Every field is the block's own bits moved, so tiling is lossless and [`untile`] gives
//! the original bytes. The products from tiles compute each output exactly as
//! `crate::math::qmatmul::matmul` documents (the same integer sums and f32 steps, blocks added in order),
//! so they give the plain layout's bits in every body.

use crate::quant::blocks::scale_min_k4;
use crate::quant::{QuantFormat, QK_K};

/// Output rows per tile.
pub const TILE_ROWS: usize = 8;

/// Bytes of one Q4_K tile of one super-block column (eight Q4_K blocks).
pub const TILE_BYTES: usize = TILE_ROWS * 144;

/// Bytes of one row's 256 weights of `format` (one K-quant block, eight Q8_0 blocks).
pub(crate) fn group_bytes(format: QuantFormat) -> usize {
    format.block_bytes() * column_blocks(format)
}

/// Blocks of `format` in one row of a whole tile column: 8 for the 32-weight formats, 1
/// for the K-quants.
pub(crate) fn column_blocks(format: QuantFormat) -> usize {
    QK_K / format.block_elems()
}

/// Bytes of one whole tile of `format` (eight rows of 256 weights).
pub fn tile_bytes(format: QuantFormat) -> usize {
    TILE_ROWS * group_bytes(format)
}

/// The tile columns of a row of `cols` weights of `format`: how many whole columns of
/// 256, and the blocks of the partial column after them (0 when there is none; only the
/// 32-weight formats have one).
pub fn columns(format: QuantFormat, cols: usize) -> (usize, usize) {
    let blocks = cols / format.block_elems();
    (
        blocks / column_blocks(format),
        blocks % column_blocks(format),
    )
}

/// The tile columns of a row of `cols` weights, in order: each column's first block (in
/// the row's block order) and its blocks (`k`; the tile is `8 k` blocks).
pub(crate) fn column_spans(
    format: QuantFormat,
    cols: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let (full, part) = columns(format, cols);
    let kb = column_blocks(format);
    (0..full)
        .map(move |b| (b * kb, kb))
        .chain((part > 0).then_some((full * kb, part)))
}

/// Where the scale/min byte of row `r`, sub-block `j` sits in a tile's 64 scale bytes:
/// pairs of sub-blocks `(2p, 2p + 1)` take 16 bytes each, ordered so that byte `4k + q`
/// of pair `p` belongs to row `2k + q % 2`, sub-block `2p + q / 2` (the order of the
/// 32-bit lanes of the AVX-512 body's packed sums).
pub(crate) fn sm_index(r: usize, j: usize) -> usize {
    16 * (j / 2) + 4 * (r / 2) + 2 * (j % 2) + r % 2
}

/// Code `k` (0..256) of a plain Q4_K block (what the tests read a tile against).
#[cfg(test)]
fn plain_code(block: &[u8], k: usize) -> u8 {
    let (j, l) = (k / 32, k % 32);
    (block[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f
}

/// Whether a `[rows, cols]` matrix of `format` can be tiled: a format with a tile, rows
/// whole tiles of eight, rows of whole blocks (whole columns of 256 for the K-quants,
/// whose block is the column).
pub fn tileable(format: QuantFormat, rows: usize, cols: usize) -> bool {
    matches!(
        format,
        QuantFormat::Q4K
            | QuantFormat::Q6K
            | QuantFormat::Q8_0
            | QuantFormat::Q4_0
            | QuantFormat::Mxfp4
    ) && rows.is_multiple_of(TILE_ROWS)
        && cols > 0
        && cols.is_multiple_of(format.block_elems())
}

/// Tiles the plain matrix `src` of `format` (`[rows, cols]`, [`tileable`]) into `dst`
/// (the same length). `false` (and `dst` untouched) when the shape or the lengths do not
/// fit.
pub fn tile(format: QuantFormat, src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) -> bool {
    let bb = format.block_bytes();
    let row_bytes = cols / format.block_elems() * bb;
    if !tileable(format, rows, cols) || src.len() != rows * row_bytes || dst.len() != src.len() {
        return false;
    }
    for t in 0..rows / TILE_ROWS {
        let mut at = t * TILE_ROWS * row_bytes;
        for (first, k) in column_spans(format, cols) {
            let out = &mut dst[at..at + TILE_ROWS * k * bb];
            at += out.len();
            let block = |r: usize| {
                let from = (TILE_ROWS * t + r) * row_bytes + first * bb;
                &src[from..from + k * bb]
            };
            match format {
                QuantFormat::Q6K => super::tiles_q6k::tile_block(block, out),
                QuantFormat::Q8_0 => super::tiles_q8_0::tile_block(block, out),
                QuantFormat::Q4_0 => super::tiles_q4_0::tile_block(block, out),
                QuantFormat::Mxfp4 => super::tiles_mxfp4::tile_block(block, out),
                _ => tile_block_q4k(block, out),
            }
        }
    }
    true
}

/// One Q4_K tile from its eight rows' blocks.
fn tile_block_q4k<'a>(block: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    out[96..128].fill(0);
    for r in 0..TILE_ROWS {
        let src = block(r);
        out[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
        out[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &src[4..16]);
            let i = sm_index(r, j);
            out[32 + i] = sc | ((m & 3) << 6);
            out[96 + i % 32] |= (m >> 2) << (4 * (i / 32));
        }
        // Codes `16c..16c + 16` are 16 consecutive bytes' nibbles of one half-block of
        // the plain layout (`plain_code`: sub-block `c / 2`, bytes from `16 (c % 2)`),
        // so each chunk's eight bytes of row `r` are two words of them, moved at once.
        for c in 0..16 {
            let at = 16 + 32 * (c / 4) + 16 * (c % 2);
            let shift = 4 * ((c / 2) % 2);
            let lo = (word(src, at) >> shift) & NIBBLES;
            let hi = (word(src, at + 8) >> shift) & NIBBLES;
            put_word(out, 128 + 64 * c + 8 * r, lo | (hi << 4));
        }
    }
}

/// The low nibble of every byte of a word.
pub(crate) const NIBBLES: u64 = 0x0f0f_0f0f_0f0f_0f0f;

/// The eight bytes of `b` at `at` as a little-endian word: a tile moves eight rows' or
/// eight codes' bytes at once.
pub(crate) fn word(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Stores `w` little-endian as the eight bytes of `out` at `at`.
pub(crate) fn put_word(out: &mut [u8], at: usize, w: u64) {
    out[at..at + 8].copy_from_slice(&w.to_le_bytes());
}

/// The scale and min of row `r`, sub-block `j` of a tile.
fn tile_scale_min(tile: &[u8], r: usize, j: usize) -> (u8, u8) {
    let i = sm_index(r, j);
    let s = tile[32 + i];
    let hi = (tile[96 + i % 32] >> (4 * (i / 32))) & 0x0f;
    (s & 63, (s >> 6) | (hi << 2))
}

/// Row `r`'s plain blocks of `format` from a tile (the bytes [`tile`] took), into `out`
/// (the row's weights of that column: one K-quant block, `k` blocks of a 32-weight
/// format, `k` = 8 but in a partial column).
pub(crate) fn untile_block(format: QuantFormat, tile: &[u8], r: usize, out: &mut [u8]) {
    match format {
        QuantFormat::Q6K => super::tiles_q6k::untile_block(tile, r, out),
        QuantFormat::Q8_0 => super::tiles_q8_0::untile_block(tile, r, out),
        QuantFormat::Q4_0 => super::tiles_q4_0::untile_block(tile, r, out),
        QuantFormat::Mxfp4 => super::tiles_mxfp4::untile_block(tile, r, out),
        _ => out.copy_from_slice(&untile_block_q4k(tile, r)),
    }
}

/// Row `r`'s plain Q4_K block from a tile.
fn untile_block_q4k(tile: &[u8], r: usize) -> [u8; 144] {
    let mut out = [0u8; 144];
    out[0..2].copy_from_slice(&tile[2 * r..2 * r + 2]);
    out[2..4].copy_from_slice(&tile[16 + 2 * r..16 + 2 * r + 2]);
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (sc[j], m[j]) = tile_scale_min(tile, r, j);
    }
    // The inverse of `scale_min_k4`'s 12-byte packing (every bit of it is a scale or min).
    for j in 0..4 {
        out[4 + j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        out[8 + j] = m[j] | ((m[j + 4] >> 4) << 6);
        out[12 + j] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    for c in 0..16 {
        for i in 0..8 {
            let byte = tile[128 + 64 * c + 8 * r + i];
            for (k, code) in [(16 * c + i, byte & 0x0f), (16 * c + 8 + i, byte >> 4)] {
                let (j, l) = (k / 32, k % 32);
                out[16 + 32 * (j / 2) + l] |= code << (4 * (j % 2));
            }
        }
    }
    out
}

/// The plain bytes of a tiled matrix of `format` (`[rows, cols]`, `tiled.len()` bytes):
/// the inverse of [`tile`]. `None` when the shape does not fit the bytes.
pub fn untile(format: QuantFormat, tiled: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    let bb = format.block_bytes();
    let row_bytes = cols / format.block_elems() * bb;
    if !tileable(format, rows, cols) || tiled.len() != rows * row_bytes {
        return None;
    }
    let mut out = vec![0u8; tiled.len()];
    for t in 0..rows / TILE_ROWS {
        let mut at = t * TILE_ROWS * row_bytes;
        for (first, k) in column_spans(format, cols) {
            let tile = &tiled[at..at + TILE_ROWS * k * bb];
            at += tile.len();
            for r in 0..TILE_ROWS {
                let to = (TILE_ROWS * t + r) * row_bytes + first * bb;
                untile_block(format, tile, r, &mut out[to..to + k * bb]);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::random_blocks;

    /// Tiling keeps every bit: untiling gives the plain bytes back, and each tile holds
    /// its rows' `d`, codes and 6-bit scales where the layout says (read with ggml's own
    /// decoders of the plain block, `scale_min_k4` and the code nibbles).
    #[test]
    fn tiling_is_lossless_and_follows_the_layout() {
        let (rows, cols) = (16, 512);
        let plain = random_blocks(QuantFormat::Q4K, rows * cols / QK_K, 7);
        let mut tiled = vec![0u8; plain.len()];
        assert!(tile(QuantFormat::Q4K, &plain, rows, cols, &mut tiled));
        assert_ne!(tiled, plain);
        assert_eq!(untile(QuantFormat::Q4K, &tiled, rows, cols).unwrap(), plain);
        let nb = cols / QK_K;
        for (row, b) in [(0, 0), (9, 1), (15, 0)] {
            let block = &plain[(row * nb + b) * 144..][..144];
            let tile = &tiled[((row / 8) * nb + b) * TILE_BYTES..][..TILE_BYTES];
            let r = row % 8;
            assert_eq!(tile[2 * r..2 * r + 2], block[0..2]);
            assert_eq!(tile[16 + 2 * r..16 + 2 * r + 2], block[2..4]);
            for j in 0..8 {
                assert_eq!(tile_scale_min(tile, r, j), scale_min_k4(j, &block[4..16]));
            }
            for k in [0, 7, 8, 15, 16, 31, 32, 100, 255] {
                let byte = tile[128 + 64 * (k / 16) + 8 * r + k % 8];
                let code = if k % 16 < 8 { byte & 15 } else { byte >> 4 };
                assert_eq!(code, plain_code(block, k), "row {row} block {b} code {k}");
            }
        }
        let q4k = QuantFormat::Q4K;
        assert!(!tile(
            q4k,
            &plain[..plain.len() - 144],
            rows,
            cols,
            &mut tiled
        ));
        assert!(!tile(q4k, &plain[..144 * 4], 4, 256, &mut tiled[..144 * 4]));
        assert!(untile(q4k, &tiled, 12, cols).is_none());
        assert!(!tileable(q4k, 8, 2880));
        assert!(tileable(QuantFormat::Q8_0, 8, 2880));
        assert!(!tileable(QuantFormat::Mxfp4, 12, 2880));
        assert_eq!(columns(QuantFormat::Mxfp4, 2880), (11, 2));
        assert_eq!(columns(q4k, 512), (2, 0));
        assert!(!tile(
            QuantFormat::Q5K,
            &plain[..176 * 16],
            16,
            256,
            &mut tiled[..176 * 16]
        ));
    }
}
