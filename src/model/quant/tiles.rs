//! Q4_K, Q6_K, Q8_0 and Q4_0 matrices repacked into tiles of eight output rows, the layout the CPU
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
//! for its bodies in [`super::tiles_x86`], [`super::tiles_q6k_x86`] and
//! [`super::tiles_b32_x86`]).
//!
//! The tile of rows `8t..8t + 8`, 256-weight column `b`, is those eight rows' blocks of that
//! column (1152 bytes for Q4_K, 1680 for Q6_K, 2176 and 1152 for Q8_0's and Q4_0's eight
//! 32-weight blocks a row, [`tile_bytes`]) at `(t · nb + b) · tile_bytes` (`nb` columns of 256 per row), so a
//! range of whole tiles is the same byte range as the same rows stored plain. The Q6_K tile
//! is described in [`super::tiles_q6k`], the Q8_0 tile in [`super::tiles_q8_0`], the Q4_0
//! tile in [`super::tiles_q4_0`]; the Q4_K tile is:
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
//! [`super::matmul`] documents (the same integer sums and f32 steps, blocks added in order),
//! so they give the plain layout's bits in every body.

use super::blocks::scale_min_k4;
use super::dot;
use super::q8::Q8Rows;
use super::{QuantFormat, QK_K};

/// Whether the CPU backend repacks Q4_K, Q6_K, Q8_0 and Q4_0 matrices into tiles at load: yes unless
/// `MOEC_QUANT_TILES=off` (the row layout, for comparing the two; any other value than
/// `on`/`off` warns once and keeps tiles). Either way the results are the same bits.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| match std::env::var("MOEC_QUANT_TILES").as_deref() {
        Err(_) | Ok("on") => true,
        Ok("off") => false,
        Ok(other) => {
            eprintln!("warning: MOEC_QUANT_TILES={other} is neither on nor off; keeping tiles");
            true
        }
    })
}

/// Output rows per tile.
pub const TILE_ROWS: usize = 8;

/// Bytes of one Q4_K tile of one super-block column (eight Q4_K blocks).
pub const TILE_BYTES: usize = TILE_ROWS * 144;

/// Bytes of one row's 256 weights of `format` (one K-quant block, eight Q8_0 blocks).
fn group_bytes(format: QuantFormat) -> usize {
    format.block_bytes() * (QK_K / format.block_elems())
}

/// Bytes of one tile of `format` (eight rows of 256 weights).
pub fn tile_bytes(format: QuantFormat) -> usize {
    TILE_ROWS * group_bytes(format)
}

/// Where the scale/min byte of row `r`, sub-block `j` sits in a tile's 64 scale bytes:
/// pairs of sub-blocks `(2p, 2p + 1)` take 16 bytes each, ordered so that byte `4k + q`
/// of pair `p` belongs to row `2k + q % 2`, sub-block `2p + q / 2` (the order of the
/// 32-bit lanes of the AVX-512 body's packed sums).
pub(super) fn sm_index(r: usize, j: usize) -> usize {
    16 * (j / 2) + 4 * (r / 2) + 2 * (j % 2) + r % 2
}

/// Code `k` (0..256) of a plain Q4_K block.
fn plain_code(block: &[u8], k: usize) -> u8 {
    let (j, l) = (k / 32, k % 32);
    (block[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f
}

/// Whether a `[rows, cols]` matrix of `format` can be tiled.
pub fn tileable(format: QuantFormat, rows: usize, cols: usize) -> bool {
    matches!(
        format,
        QuantFormat::Q4K | QuantFormat::Q6K | QuantFormat::Q8_0 | QuantFormat::Q4_0
    ) && rows.is_multiple_of(TILE_ROWS)
        && cols.is_multiple_of(QK_K)
}

/// Tiles the plain matrix `src` of `format` (`[rows, cols]`, [`tileable`]) into `dst`
/// (the same length). `false` (and `dst` untouched) when the shape or the lengths do not
/// fit.
pub fn tile(format: QuantFormat, src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) -> bool {
    let (nb, bb, tb) = (cols / QK_K, group_bytes(format), tile_bytes(format));
    if !tileable(format, rows, cols) || src.len() != rows * nb * bb || dst.len() != src.len() {
        return false;
    }
    for t in 0..rows / TILE_ROWS {
        for b in 0..nb {
            let out = &mut dst[(t * nb + b) * tb..(t * nb + b + 1) * tb];
            let block = |r: usize| {
                let at = ((TILE_ROWS * t + r) * nb + b) * bb;
                &src[at..at + bb]
            };
            match format {
                QuantFormat::Q6K => super::tiles_q6k::tile_block(block, out),
                QuantFormat::Q8_0 => super::tiles_q8_0::tile_block(block, out),
                QuantFormat::Q4_0 => super::tiles_q4_0::tile_block(block, out),
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
        for c in 0..16 {
            for i in 0..8 {
                let lo = plain_code(src, 16 * c + i);
                let hi = plain_code(src, 16 * c + 8 + i);
                out[128 + 64 * c + 8 * r + i] = lo | (hi << 4);
            }
        }
    }
}

/// The scale and min of row `r`, sub-block `j` of a tile.
fn tile_scale_min(tile: &[u8], r: usize, j: usize) -> (u8, u8) {
    let i = sm_index(r, j);
    let s = tile[32 + i];
    let hi = (tile[96 + i % 32] >> (4 * (i / 32))) & 0x0f;
    (s & 63, (s >> 6) | (hi << 2))
}

/// Row `r`'s plain blocks of `format` from a tile (the bytes [`tile`] took), into `out`
/// (the row's 256 weights: one K-quant block, eight Q8_0 blocks).
pub(super) fn untile_block(format: QuantFormat, tile: &[u8], r: usize, out: &mut [u8]) {
    match format {
        QuantFormat::Q6K => super::tiles_q6k::untile_block(tile, r, out),
        QuantFormat::Q8_0 => super::tiles_q8_0::untile_block(tile, r, out),
        QuantFormat::Q4_0 => super::tiles_q4_0::untile_block(tile, r, out),
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
    let (nb, bb, tb) = (cols / QK_K, group_bytes(format), tile_bytes(format));
    if !tileable(format, rows, cols) || tiled.len() != rows * nb * bb {
        return None;
    }
    let mut out = vec![0u8; tiled.len()];
    for t in 0..rows / TILE_ROWS {
        for b in 0..nb {
            let tile = &tiled[(t * nb + b) * tb..(t * nb + b + 1) * tb];
            for r in 0..TILE_ROWS {
                let at = ((TILE_ROWS * t + r) * nb + b) * bb;
                untile_block(format, tile, r, &mut out[at..at + bb]);
            }
        }
    }
    Some(out)
}

/// The activation side the SIMD bodies read per (row, block), besides the codes.
///
/// Q4_K: the sums of each 32-code sub-block `s_j = bsum_2j + bsum_2j+1`, as `[s0, s0, s1,
/// s1, .., s7, s7]` (`wide`, the AVX-512 body: four per pair of sub-blocks) and as pairs
/// `s_2p | s_2p+1 << 16` (`pairs`, the AVX2 body). A sub-block sums at most 32 · 128, so
/// 16 bits hold it.
///
/// Q6_K: the `−32 · code` part of `(q − 32) · x` summed over the codes a body's lane
/// covers, so a lane can start from it and hold `Σ (q − 32) · x` directly: `quads`
/// (AVX-512: `−32 · Σ x` over each 4 consecutive codes, 64 per block) and `pairs16`
/// (AVX2: `−32 · (x_2m + x_2m+1 + x_8+2m + x_8+2m+1)` for each sub-block `c` (codes
/// `16c..`) and `m < 4`, 64 per block; at most 32 · 512 in magnitude, so 16 bits hold it).
pub(super) struct TileActs<'a> {
    /// The quantised rows (Q8_K).
    pub q: &'a Q8Rows,
    wide: Vec<i32>,
    pairs: Vec<i32>,
    quads: Vec<i32>,
    pairs16: Vec<i16>,
    block_offsets: Vec<i32>,
}

impl<'a> TileActs<'a> {
    /// What the bodies for `format` read of `q` (Q8_K rows).
    pub fn new(q: &'a Q8Rows, format: QuantFormat) -> Self {
        let nb = q.blocks_per_row();
        let mut acts = TileActs {
            q,
            wide: Vec::new(),
            pairs: Vec::new(),
            quads: Vec::new(),
            pairs16: Vec::new(),
            block_offsets: Vec::new(),
        };
        if let Some(offset) = match format {
            QuantFormat::Q8_0 => Some(128),
            QuantFormat::Q4_0 => Some(8),
            _ => None,
        } {
            // Per 32-code block: lane `h` of a row's 64-bit group covers codes `8g + 4h..`
            // of every group `g` of eight.
            let nb32 = q.blocks_per_row();
            acts.block_offsets = vec![0i32; q.n_rows * nb32 * 2];
            for r in 0..q.n_rows {
                for b in 0..nb32 {
                    let x = q.block_qs(r, b);
                    for h in 0..2 {
                        let s: i32 = (0..4)
                            .flat_map(|g| x[8 * g + 4 * h..8 * g + 4 * h + 4].iter())
                            .map(|&v| i32::from(v))
                            .sum();
                        acts.block_offsets[(r * nb32 + b) * 2 + h] = -offset * s;
                    }
                }
            }
            return acts;
        }
        if format == QuantFormat::Q6K {
            acts.quads = vec![0i32; q.n_rows * nb * 64];
            acts.pairs16 = vec![0i16; q.n_rows * nb * 64];
            for r in 0..q.n_rows {
                for b in 0..nb {
                    let x = q.block_qs(r, b);
                    let at = (r * nb + b) * 64;
                    let sum = |from: usize, n: usize| -> i32 {
                        x[from..from + n].iter().map(|&v| i32::from(v)).sum()
                    };
                    for k in 0..64 {
                        acts.quads[at + k] = -32 * sum(4 * k, 4);
                    }
                    for c in 0..16 {
                        for m in 0..4 {
                            let s = sum(16 * c + 2 * m, 2) + sum(16 * c + 8 + 2 * m, 2);
                            acts.pairs16[at + 4 * c + m] = (-32 * s) as i16;
                        }
                    }
                }
            }
            return acts;
        }
        acts.wide = vec![0i32; q.n_rows * nb * 16];
        acts.pairs = vec![0i32; q.n_rows * nb * 4];
        for r in 0..q.n_rows {
            for b in 0..nb {
                let s = q.block_bsums(r, b);
                let sub = |j: usize| i32::from(s[2 * j]) + i32::from(s[2 * j + 1]);
                let at = r * nb + b;
                for j in 0..8 {
                    acts.wide[at * 16 + 2 * j] = sub(j);
                    acts.wide[at * 16 + 2 * j + 1] = sub(j);
                }
                for p in 0..4 {
                    let packed =
                        (sub(2 * p) as u16 as u32) | ((sub(2 * p + 1) as u16 as u32) << 16);
                    acts.pairs[at * 4 + p] = packed as i32;
                }
            }
        }
        acts
    }

    /// Row `r`'s 256 codes of block `b`.
    pub fn codes(&self, r: usize, b: usize) -> &[i8] {
        self.q.block_qs(r, b)
    }

    /// Q4_K: row `r`'s sixteen wide sums of block `b`.
    pub fn wide(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.q.blocks_per_row() + b) * 16;
        &self.wide[at..at + 16]
    }

    /// Q4_K: row `r`'s four packed pairs of block `b`.
    pub fn pairs(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.q.blocks_per_row() + b) * 4;
        &self.pairs[at..at + 4]
    }

    /// Q6_K: row `r`'s 64 quad offsets of block `b`.
    pub fn quads(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.q.blocks_per_row() + b) * 64;
        &self.quads[at..at + 64]
    }

    /// Q8_0 and Q4_0: row `r`'s two lane offsets of (32-code) block `b`: `−128 · Σ x`
    /// (Q8_0) or `−8 · Σ x` (Q4_0) over the codes `8g..8g + 4` and `8g + 4..8g + 8` of its
    /// four groups of eight.
    pub fn block_offsets(&self, r: usize, b: usize) -> &[i32] {
        let at = (r * self.q.blocks_per_row() + b) * 2;
        &self.block_offsets[at..at + 2]
    }

    /// Q6_K: row `r`'s 64 pair offsets of block `b`.
    pub fn pairs16(&self, r: usize, b: usize) -> &[i16] {
        let at = (r * self.q.blocks_per_row() + b) * 64;
        &self.pairs16[at..at + 64]
    }
}

/// The reference body on tiles: each output's blocks read back plain ([`untile_block`])
/// and summed as [`super::matmul`] documents. Rows `o0..o0 + rows` (whole tiles) of the
/// tiled `[.., cols]` matrix `bytes` of `format` into `local[r * rows + i]`.
pub(super) fn portable_panel(
    format: QuantFormat,
    bytes: &[u8],
    cols: usize,
    acts: &Q8Rows,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let (nb, tb) = (cols / QK_K, tile_bytes(format));
    let (bb, sub) = (format.block_bytes(), QK_K / format.block_elems());
    let k_quant = acts.format == super::q8::ActFormat::Q8K;
    let mut group = vec![0u8; group_bytes(format)];
    for t in 0..rows / TILE_ROWS {
        let tile_row = &bytes[(o0 / TILE_ROWS + t) * nb * tb..];
        for l in 0..TILE_ROWS {
            let i = t * TILE_ROWS + l;
            for r in 0..acts.n_rows {
                let mut acc = 0.0f32;
                for b in 0..nb {
                    untile_block(format, &tile_row[b * tb..(b + 1) * tb], l, &mut group);
                    for (j, block) in group.chunks_exact(bb).enumerate() {
                        let blk = sub * b + j;
                        let bsums = if k_quant {
                            acts.block_bsums(r, blk)
                        } else {
                            &[]
                        };
                        let (dy, qs) = (acts.block_d(r, blk), acts.block_qs(r, blk));
                        acc += dot::block_value(format, block, qs, bsums, dy, 0.0);
                    }
                }
                local[r * rows + i] = acc;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::random_blocks;

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
        assert!(!tile(
            QuantFormat::Q5K,
            &plain[..176 * 16],
            16,
            256,
            &mut tiled[..176 * 16]
        ));
    }
}
