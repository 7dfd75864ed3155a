//! The Q4_0 tile: eight rows' blocks of one 256-weight column (eight 32-weight blocks
//! each), in the order the SIMD bodies (`crate::math::qmatmul`'s `tiles_b32_x86`) read them (why tiles
//! exist: [`super::tiles`]). The MXFP4 tile ([`super::tiles_mxfp4`]) is this one with a
//! one-byte scale, so both are made here ([`tile_nibbles`], [`untile_nibbles`]).
//!
//! A tile of `k` blocks a row (`k` = 8 but in a row's partial last column, see
//! [`super::tiles`]) is `144 k` bytes, the `8 k` 18-byte blocks it replaces (a whole
//! tile, `k` = 8, is 1152 bytes: a whole number of 64-byte cache lines):
//!
//! - bytes `0..16 k`: the `d` (f16) of block `j` (codes `32j..32j + 32`) of row `r` at
//!   `2 (8j + r)`;
//! - `16 k..144 k`: `2 k` chunks of 64 bytes, chunk `2j + c` at `16 k + 64 (2j + c)`: byte
//!   `8r + i` holds row `r`'s code `32j + 16c + i` in its low nibble and code `32j + 16c + 8 + i`
//!   in its high nibble (codes 0..16; the weight is `d · (q − 8)`).
//!
//! Every field is the blocks' own bits moved, so tiling is lossless ([`untile_block`]).

use super::blocks::q4_code;
use super::tiles::TILE_ROWS;

/// Bytes of one Q4_0 block.
const BLOCK: usize = 18;

/// Bytes of one whole tile.
pub(crate) const TILE: usize = TILE_ROWS * 8 * BLOCK;

/// Where the code chunks start in a whole tile.
pub(crate) const CODES: usize = 128;

/// One tile from its eight rows' blocks of one column (`k` blocks, `18 k` bytes each;
/// `k = out.len() / 144`).
pub(crate) fn tile_block<'a>(group: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    tile_nibbles(2, group, out)
}

/// Row `r`'s plain Q4_0 blocks of one column from a tile (the bytes [`tile_block`] took),
/// into `out` (`18 k` bytes).
pub(crate) fn untile_block(tile: &[u8], r: usize, out: &mut [u8]) {
    untile_nibbles(2, tile, r, out)
}

/// The tile of a format whose block is `sb` scale bytes then ggml's 16 bytes of 4-bit
/// codes (Q4_0: `sb` = 2, MXFP4: 1): scale `s` of block `j` of row `r` at `sb (8j + r)`,
/// then the code chunks as the module says from `8 k sb` (`k = out.len() / (8 (sb + 16))`).
pub(crate) fn tile_nibbles<'a>(sb: usize, group: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    let block = sb + 16;
    let k = out.len() / (TILE_ROWS * block);
    let codes = TILE_ROWS * k * sb;
    for r in 0..TILE_ROWS {
        let src = group(r);
        for j in 0..k {
            let b = &src[j * block..(j + 1) * block];
            out[sb * (8 * j + r)..sb * (8 * j + r + 1)].copy_from_slice(&b[..sb]);
            for c in 0..2 {
                for i in 0..8 {
                    let lo = q4_code(&b[sb..], 16 * c + i);
                    let hi = q4_code(&b[sb..], 16 * c + 8 + i);
                    out[codes + 64 * (2 * j + c) + 8 * r + i] = lo | (hi << 4);
                }
            }
        }
    }
}

/// Row `r`'s plain blocks from a tile of [`tile_nibbles`]`(sb, ..)`, into `out` (`k`
/// blocks of `sb + 16` bytes).
pub(crate) fn untile_nibbles(sb: usize, tile: &[u8], r: usize, out: &mut [u8]) {
    let block = sb + 16;
    let k = out.len() / block;
    let codes = TILE_ROWS * k * sb;
    out.fill(0);
    for j in 0..k {
        let b = &mut out[j * block..(j + 1) * block];
        b[..sb].copy_from_slice(&tile[sb * (8 * j + r)..sb * (8 * j + r + 1)]);
        for c in 0..2 {
            for i in 0..8 {
                let byte = tile[codes + 64 * (2 * j + c) + 8 * r + i];
                for (l, code) in [(16 * c + i, byte & 0x0f), (16 * c + 8 + i, byte >> 4)] {
                    // ggml's packing: code `l` in byte `l % 16`, nibble `l / 16`.
                    b[sb + l % 16] |= code << (4 * (l / 16));
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
    /// `q4_code`), and untiling gives the blocks back, for a whole tile and for the
    /// partial columns of one to seven blocks.
    #[test]
    fn q4_0_tile_follows_the_layout_and_is_lossless() {
        for k in 1..=8 {
            let plain = random_blocks(QuantFormat::Q4_0, TILE_ROWS * k, 17 + k as u64);
            let group = |r: usize| &plain[r * k * BLOCK..(r + 1) * k * BLOCK];
            let mut tile = vec![0u8; TILE_ROWS * k * BLOCK];
            tile_block(group, &mut tile);
            let codes = 16 * k;
            for r in 0..TILE_ROWS {
                for (j, l) in [(0usize, 0usize), (2, 9), (5, 17), (7, 31)] {
                    let j = j % k;
                    let block = &group(r)[j * BLOCK..(j + 1) * BLOCK];
                    let byte = tile[codes + 64 * (2 * j + l / 16) + 8 * r + l % 8];
                    let code = if l % 16 < 8 { byte & 15 } else { byte >> 4 };
                    assert_eq!(
                        code,
                        q4_code(&block[2..18], l),
                        "k {k} row {r} block {j} code {l}"
                    );
                    assert_eq!(tile[2 * (8 * j + r)..2 * (8 * j + r) + 2], block[0..2]);
                }
                let mut back = vec![0u8; k * BLOCK];
                untile_block(&tile, r, &mut back);
                assert_eq!(back, group(r), "k {k} row {r}");
            }
        }
    }
}
