//! The Q4_0 tile: eight rows' blocks of one 256-weight column (eight 32-weight blocks
//! each), in the order the SIMD bodies (`crate::math::qmatmul`'s `tiles_b32_x86`) read them (why tiles
//! exist: [`super::tiles`]).
//!
//! A tile is 1152 bytes, the 64 18-byte blocks it replaces (a whole number of 64-byte
//! cache lines):
//!
//! - bytes `0..128`: the `d` (f16) of block `j` (codes `32j..32j + 32`) of row `r` at
//!   `2 (8j + r)`;
//! - `128..1152`: 16 chunks of 64 bytes, chunk `2j + c` at `128 + 64 (2j + c)`: byte `8r + i`
//!   holds row `r`'s code `32j + 16c + i` in its low nibble and code `32j + 16c + 8 + i` in
//!   its high nibble (codes 0..16; the weight is `d · (q − 8)`).
//!
//! Every field is the blocks' own bits moved, so tiling is lossless ([`untile_block`]).

use super::blocks::q4_code;
use super::tiles::TILE_ROWS;

/// Bytes of one Q4_0 block.
const BLOCK: usize = 18;

/// Bytes of one tile.
pub(crate) const TILE: usize = TILE_ROWS * 8 * BLOCK;

/// Where the code chunks start.
pub(crate) const CODES: usize = 128;

/// One tile from its eight rows' 256 weights (eight blocks, 144 bytes each).
pub(crate) fn tile_block<'a>(group: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    for r in 0..TILE_ROWS {
        let src = group(r);
        for j in 0..8 {
            let block = &src[j * BLOCK..(j + 1) * BLOCK];
            out[2 * (8 * j + r)..2 * (8 * j + r) + 2].copy_from_slice(&block[0..2]);
            for c in 0..2 {
                for i in 0..8 {
                    let lo = q4_code(&block[2..18], 16 * c + i);
                    let hi = q4_code(&block[2..18], 16 * c + 8 + i);
                    out[CODES + 64 * (2 * j + c) + 8 * r + i] = lo | (hi << 4);
                }
            }
        }
    }
}

/// Row `r`'s eight plain Q4_0 blocks from a tile (the bytes [`tile_block`] took), into
/// `out` (144 bytes).
pub(crate) fn untile_block(tile: &[u8], r: usize, out: &mut [u8]) {
    out.fill(0);
    for j in 0..8 {
        let block = &mut out[j * BLOCK..(j + 1) * BLOCK];
        block[0..2].copy_from_slice(&tile[2 * (8 * j + r)..2 * (8 * j + r) + 2]);
        for c in 0..2 {
            for i in 0..8 {
                let byte = tile[CODES + 64 * (2 * j + c) + 8 * r + i];
                for (k, code) in [(16 * c + i, byte & 0x0f), (16 * c + 8 + i, byte >> 4)] {
                    // ggml's packing: code `k` in byte `k % 16`, nibble `k / 16`.
                    block[2 + k % 16] |= code << (4 * (k / 16));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{random_blocks, QuantFormat};

    /// Every code and `d` lands where the layout says (read with ggml's own code order,
    /// `q4_code`), and untiling gives the blocks back.
    #[test]
    fn q4_0_tile_follows_the_layout_and_is_lossless() {
        let plain = random_blocks(QuantFormat::Q4_0, TILE_ROWS * 8, 17);
        let group = |r: usize| &plain[r * 8 * BLOCK..(r + 1) * 8 * BLOCK];
        let mut tile = vec![0u8; TILE];
        tile_block(group, &mut tile);
        for r in 0..TILE_ROWS {
            for (j, k) in [(0usize, 0usize), (2, 9), (5, 17), (7, 31)] {
                let block = &group(r)[j * BLOCK..(j + 1) * BLOCK];
                let byte = tile[CODES + 64 * (2 * j + k / 16) + 8 * r + k % 8];
                let code = if k % 16 < 8 { byte & 15 } else { byte >> 4 };
                assert_eq!(
                    code,
                    q4_code(&block[2..18], k),
                    "row {r} block {j} code {k}"
                );
                assert_eq!(tile[2 * (8 * j + r)..2 * (8 * j + r) + 2], block[0..2]);
            }
            let mut back = vec![0u8; 8 * BLOCK];
            untile_block(&tile, r, &mut back);
            assert_eq!(back, group(r), "row {r}");
        }
    }
}
