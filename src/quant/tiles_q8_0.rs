//! The Q8_0 tile: eight rows' blocks of one 256-weight column (eight 32-weight blocks
//! each), in the order the SIMD bodies (`crate::math::qmatmul`'s `tiles_b32_x86`) read them (why tiles
//! exist: [`super::tiles`]).
//!
//! A tile of `k` blocks a row (`k` = 8 but in a row's partial last column, see
//! [`super::tiles`]) is `272 k` bytes, the `8 k` 34-byte blocks it replaces (a whole tile,
//! `k` = 8, is 2176 bytes: a whole number of 64-byte cache lines, so a tile's code chunks
//! stay aligned as the matrix's start is):
//!
//! - bytes `0..16 k`: the `d` (f16) of block `j` (codes `32j..32j + 32`) of row `r` at
//!   `2 (8j + r)`;
//! - `16 k..272 k`: `4 k` chunks of 64 bytes, chunk `4j + c` at `16 k + 64 (4j + c)`: byte
//!   `8r + i` holds row `r`'s code `32j + 8c + i`, offset by 128 (`code ^ 0x80` read as
//!   unsigned: 0..256), the form the unsigned side of `vpdpbusd` takes.
//!
//! Every field is the blocks' own bits moved (the offset is undone by the same `^ 0x80`), so
//! tiling is lossless ([`untile_block`]).

use super::tiles::{put_word, word, TILE_ROWS};

/// Bytes of one Q8_0 block.
const BLOCK: usize = 34;

/// Bytes of one whole tile.
pub(crate) const TILE: usize = TILE_ROWS * 8 * BLOCK;

/// Where the code chunks start in a whole tile.
pub(crate) const CODES: usize = 128;

/// One tile from its eight rows' blocks of one column (`k` blocks, `34 k` bytes each;
/// `k = out.len() / 272`).
pub(crate) fn tile_block<'a>(group: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    let k = out.len() / (TILE_ROWS * BLOCK);
    let codes = 16 * k;
    for r in 0..TILE_ROWS {
        let src = group(r);
        for j in 0..k {
            let block = &src[j * BLOCK..(j + 1) * BLOCK];
            out[2 * (8 * j + r)..2 * (8 * j + r) + 2].copy_from_slice(&block[0..2]);
            // Eight codes of one row at once, each offset by 128.
            for c in 0..4 {
                let w = word(block, 2 + 8 * c) ^ 0x8080_8080_8080_8080;
                put_word(out, codes + 64 * (4 * j + c) + 8 * r, w);
            }
        }
    }
}

/// Row `r`'s plain Q8_0 blocks of one column from a tile (the bytes [`tile_block`] took),
/// into `out` (`34 k` bytes).
pub(crate) fn untile_block(tile: &[u8], r: usize, out: &mut [u8]) {
    let k = out.len() / BLOCK;
    let codes = 16 * k;
    for j in 0..k {
        let block = &mut out[j * BLOCK..(j + 1) * BLOCK];
        block[0..2].copy_from_slice(&tile[2 * (8 * j + r)..2 * (8 * j + r) + 2]);
        for c in 0..4 {
            for i in 0..8 {
                block[2 + 8 * c + i] = tile[codes + 64 * (4 * j + c) + 8 * r + i] ^ 0x80;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{random_blocks, QuantFormat};

    /// Every code and `d` lands where the layout says, and untiling gives the blocks back,
    /// for a whole tile and for the partial columns of one to seven blocks.
    #[test]
    fn q8_0_tile_follows_the_layout_and_is_lossless() {
        for k in 1..=8 {
            let plain = random_blocks(QuantFormat::Q8_0, TILE_ROWS * k, 13 + k as u64);
            let group = |r: usize| &plain[r * k * BLOCK..(r + 1) * k * BLOCK];
            let mut tile = vec![0u8; TILE_ROWS * k * BLOCK];
            tile_block(group, &mut tile);
            for r in 0..TILE_ROWS {
                for (j, l) in [(0usize, 0usize), (3, 9), (7, 31)] {
                    let j = j % k;
                    let block = &group(r)[j * BLOCK..(j + 1) * BLOCK];
                    let byte = tile[16 * k + 64 * (4 * j + l / 8) + 8 * r + l % 8];
                    assert_eq!(
                        (byte ^ 0x80) as i8,
                        block[2 + l] as i8,
                        "k {k} row {r} block {j}"
                    );
                    assert_eq!(tile[2 * (8 * j + r)..2 * (8 * j + r) + 2], block[0..2]);
                }
                let mut back = vec![0u8; k * BLOCK];
                untile_block(&tile, r, &mut back);
                assert_eq!(back, group(r), "k {k} row {r}");
            }
        }
        assert_eq!(TILE, 272 * 8);
    }
}
