//! The MXFP4 tile: eight rows' blocks of one 256-weight column (eight 32-weight blocks
//! each), in the order the AVX2 body (`crate::math::qmatmul`'s `tiles_b32_x86`) reads them
//! (why tiles exist: [`super::tiles`]). It is the Q4_0 tile ([`super::tiles_q4_0`]) with
//! ggml's one-byte e8m0 exponent in place of the f16 `d`.
//!
//! A tile of `k` blocks a row (`k` = 8 but in a row's partial last column) is `136 k`
//! bytes, the `8 k` 17-byte blocks it replaces (a whole tile is 1088 bytes, 17 cache lines):
//!
//! - bytes `0..8 k`: the exponent `e` of block `j` (codes `32j..32j + 32`) of row `r` at
//!   `8j + r`;
//! - `8 k..136 k`: `2 k` chunks of 64 bytes, chunk `2j + c` at `8 k + 64 (2j + c)`: byte
//!   `8r + i` holds row `r`'s code `32j + 16c + i` in its low nibble and code
//!   `32j + 16c + 8 + i` in its high nibble (codes 0..16, indices into
//!   `kvalues_mxfp4`; the weight is `kvalues_mxfp4[q] · 2^(e − 128)`).
//!
//! Every field is the blocks' own bits moved, so tiling is lossless ([`untile_block`]).

use super::tiles::TILE_ROWS;
use super::tiles_q4_0::{tile_nibbles, untile_nibbles};

/// Bytes of one MXFP4 block.
const BLOCK: usize = 17;

/// Bytes of one whole tile.
pub(crate) const TILE: usize = TILE_ROWS * 8 * BLOCK;

/// Where the code chunks start in a whole tile.
pub(crate) const CODES: usize = 64;

/// One tile from its eight rows' blocks of one column (`k` blocks, `17 k` bytes each;
/// `k = out.len() / 136`).
pub(crate) fn tile_block<'a>(group: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    tile_nibbles(1, group, out)
}

/// Row `r`'s plain MXFP4 blocks of one column from a tile (the bytes [`tile_block`]
/// took), into `out` (`17 k` bytes).
pub(crate) fn untile_block(tile: &[u8], r: usize, out: &mut [u8]) {
    untile_nibbles(1, tile, r, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::q4_code;
    use crate::quant::{random_blocks, QuantFormat};

    /// Every code and exponent lands where the layout says (ggml's code order,
    /// `q4_code` of the block's bytes 1..17), and untiling gives the blocks back, for a
    /// whole tile and for partial columns (gpt-oss's rows of 2,880 end in one of two
    /// blocks).
    #[test]
    fn mxfp4_tile_follows_the_layout_and_is_lossless() {
        for k in [1usize, 2, 5, 8] {
            let plain = random_blocks(QuantFormat::Mxfp4, TILE_ROWS * k, 41 + k as u64);
            let group = |r: usize| &plain[r * k * BLOCK..(r + 1) * k * BLOCK];
            let mut tile = vec![0u8; TILE_ROWS * k * BLOCK];
            tile_block(group, &mut tile);
            for r in 0..TILE_ROWS {
                for j in 0..k {
                    let block = &group(r)[j * BLOCK..(j + 1) * BLOCK];
                    assert_eq!(
                        tile[8 * j + r],
                        block[0],
                        "k {k} row {r} block {j} exponent"
                    );
                    for l in [0usize, 7, 8, 15, 16, 23, 24, 31] {
                        let byte = tile[8 * k + 64 * (2 * j + l / 16) + 8 * r + l % 8];
                        let code = if l % 16 < 8 { byte & 15 } else { byte >> 4 };
                        assert_eq!(code, q4_code(&block[1..17], l), "k {k} row {r} code {l}");
                    }
                }
                let mut back = vec![0u8; k * BLOCK];
                untile_block(&tile, r, &mut back);
                assert_eq!(back, group(r), "k {k} row {r}");
            }
        }
        assert_eq!(CODES, 8 * 8);
    }
}
