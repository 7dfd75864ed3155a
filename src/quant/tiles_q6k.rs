//! The Q6_K tile: eight rows' blocks of one 256-weight column, in the order the SIMD bodies
//! (`crate::math::qmatmul`'s `tiles_q6k_x86`) read them (the Q4_K tile and why tiles exist: [`super::tiles`]).
//!
//! A tile is 1680 bytes, the eight 210-byte blocks it replaces:
//!
//! - bytes `0..16`: the eight rows' `d` (f16, row order);
//! - `16..144`: the scales, byte `16 + 8c + r` = row `r`'s signed scale of the 16 codes
//!   `16c..16c + 16` (sub-block `c`);
//! - `144..1680`: eight groups of 192 bytes, group `p` at `144 + 192p`: the low nibbles
//!   of sub-blocks `2p` and `2p + 1` (64 bytes each), then their high bits (64 bytes).
//!   In a sub-block `c`'s 64 bytes, byte `8r + i` holds the low four bits of row `r`'s
//!   code `16c + i` in its low nibble and of code `16c + 8 + i` in its high nibble; in the
//!   high-bit bytes, byte `8r + i` holds the top two bits of row `r`'s code `32p + 8m + i`
//!   in its bits `2m..2m + 2` (`m` < 4).
//!
//! Every field is the block's own bits moved, so tiling is lossless ([`untile_block`]).

use super::tiles::{put_word, word, NIBBLES, TILE_ROWS};

/// Bytes of one Q6_K block.
pub(crate) const BLOCK: usize = 210;

/// Bytes of one tile.
pub(crate) const TILE: usize = TILE_ROWS * BLOCK;

/// Where the scales start.
pub(crate) const SCALES: usize = 16;

/// Where the code groups start, and the bytes of one.
pub(crate) const GROUPS: usize = 144;
/// Bytes of one group of two sub-blocks' codes.
pub(crate) const GROUP: usize = 192;

/// One tile from its eight rows' blocks.
///
/// Group `p`'s 32 codes `32p + j` are, in ggml's packing (`q6k_codes`), the nibble
/// `p % 4 / 2` of the 32 bytes `ql[64 (p / 4) + 32 (p % 2) + j]` and bits `2 (p % 4)` of
/// `qh[32 (p / 4) + j]`: each of a row's 8-byte runs of the tile is built from whole
/// words of those, eight codes at once.
pub(crate) fn tile_block<'a>(block: impl Fn(usize) -> &'a [u8], out: &mut [u8]) {
    for r in 0..TILE_ROWS {
        let src = block(r);
        out[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
        for c in 0..16 {
            out[SCALES + 8 * c + r] = src[192 + c];
        }
        for p in 0..8 {
            let (half, s) = (p / 4, p % 4);
            let ql = 64 * half + 32 * (s % 2);
            let qh = 128 + 32 * half;
            let low = |at: usize| (word(src, ql + at) >> (4 * (s / 2))) & NIBBLES;
            let g = GROUPS + GROUP * p;
            for h in 0..2 {
                put_word(
                    out,
                    g + 64 * h + 8 * r,
                    low(16 * h) | (low(16 * h + 8) << 4),
                );
            }
            let mut high = 0u64;
            for m in 0..4 {
                high |= ((word(src, qh + 8 * m) >> (2 * s)) & TWO_BITS) << (2 * m);
            }
            put_word(out, g + 128 + 8 * r, high);
        }
    }
}

/// The low two bits of every byte of a word.
const TWO_BITS: u64 = 0x0303_0303_0303_0303;

/// Row `r`'s 256 codes (unsigned, 0..64) from a tile, in weight order.
fn tile_codes(tile: &[u8], r: usize) -> [u8; 256] {
    let mut codes = [0u8; 256];
    for p in 0..8 {
        let g = GROUPS + GROUP * p;
        for i in 0..8 {
            let high = tile[g + 128 + 8 * r + i];
            for m in 0..4 {
                let k = 32 * p + 8 * m + i;
                let byte = tile[g + 64 * (m / 2) + 8 * r + i];
                let low = if m % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                codes[k] = low | (((high >> (2 * m)) & 3) << 4);
            }
        }
    }
    codes
}

/// Row `r`'s plain Q6_K block from a tile (the bytes [`tile_block`] took), into `out`
/// (210 bytes).
pub(crate) fn untile_block(tile: &[u8], r: usize, out: &mut [u8]) {
    out.fill(0);
    out[208..210].copy_from_slice(&tile[2 * r..2 * r + 2]);
    for c in 0..16 {
        out[192 + c] = tile[SCALES + 8 * c + r];
    }
    // The inverse of ggml's Q6_K packing (`q6k_codes` reads it): per half of 128 codes,
    // code `32s + l` keeps its low four bits in `ql[l + 32 (s % 2)]` (nibble `s / 2`) and
    // its top two in `qh[l]` (bits `2s`).
    let codes = tile_codes(tile, r);
    for half in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let code = codes[128 * half + 32 * s + l];
                out[64 * half + l + 32 * (s % 2)] |= (code & 0x0f) << (4 * (s / 2));
                out[128 + 32 * half + l] |= (code >> 4) << (2 * s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::q6k_codes;
    use crate::quant::{random_blocks, QuantFormat};

    /// Every code, scale and `d` lands where the layout says (read with ggml's own
    /// decoder of the plain block, `q6k_codes`), and untiling gives the block back.
    #[test]
    fn q6k_tile_follows_the_layout_and_is_lossless() {
        let plain = random_blocks(QuantFormat::Q6K, TILE_ROWS, 11);
        let block = |r: usize| &plain[r * BLOCK..(r + 1) * BLOCK];
        let mut tile = vec![0u8; TILE];
        tile_block(block, &mut tile);
        for r in 0..TILE_ROWS {
            let mut codes = [0u8; 256];
            q6k_codes(block(r), &mut codes);
            assert_eq!(tile_codes(&tile, r), codes, "row {r}");
            for k in [0usize, 7, 8, 15, 16, 31, 32, 100, 255] {
                let (c, i) = (k / 16, k % 16);
                let (p, h) = (c / 2, c % 2);
                let g = GROUPS + GROUP * p;
                let byte = tile[g + 64 * h + 8 * r + i % 8];
                let low = if i < 8 { byte & 15 } else { byte >> 4 };
                let m = (k % 32) / 8;
                let high = (tile[g + 128 + 8 * r + k % 8] >> (2 * m)) & 3;
                assert_eq!(low | (high << 4), codes[k], "row {r} code {k}");
            }
            assert_eq!(tile[SCALES + 8 * 5 + r], block(r)[192 + 5]);
            assert_eq!(tile[2 * r..2 * r + 2], block(r)[208..210]);
            let mut back = [0u8; BLOCK];
            untile_block(&tile, r, &mut back);
            assert_eq!(back[..], *block(r), "row {r}");
        }
    }
}
