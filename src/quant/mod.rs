//! Block-quantised weights in llama.cpp's GGUF formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
//! Q5_K, Q6_K, MXFP4).
//!
//! Takes the raw bytes of a tensor stored in one of these formats (a run of fixed-size
//! blocks, each holding [`QuantFormat::block_elems`] weights of one row); gives
//! [`QuantSlice`], a borrowed view the kernels accept beside bf16/f16/f32 slices, and
//! the dequantisation of whole blocks to f32. Guarantees: the byte layouts and the
//! arithmetic are those of ggml's reference decoders (`ggml-common.h` block structs,
//! `dequantize_row_*` in `ggml-quants.c`), written here from that format description, so
//! a block decodes to the values llama.cpp computes with (the unit tests hold hand-worked
//! blocks and gguf-py's own `dequantize` output); a length that is not whole blocks is an
//! error, never a panic. Every decoder multiplies and subtracts in separate f32 steps
//! (no fused multiply-add), so the portable and SIMD decoders give the same bits.
//!
//! Matrix products from these blocks without decoding them to f32 are in [`matmul`]
//! ([`quant_linear`]): activations quantised to 8 bits ([`q8`]), integer dot products
//! inside a block, f32 accumulation, with portable, AVX2 and AVX-512 VNNI bodies
//! ([`select`]) that give the same bits. Q4_K, Q6_K, Q8_0 and Q4_0 matrices may also be held in tiles
//! of eight rows ([`tiles`], [`BlockLayout::Tiles8`]), which the CPU backend makes at load in place
//! of the blocks; their products give the row layout's bits too.

pub mod blocks;
pub mod encode;
pub mod mxfp4;
pub mod q8;
pub mod random;
pub mod storage;
pub mod tiles;
pub(crate) mod tiles_mxfp4;
pub(crate) mod tiles_q4_0;
pub(crate) mod tiles_q6k;
pub(crate) mod tiles_q8_0;

pub use blocks::dequantize_blocks;

/// A block-quantised storage format (ggml's `GGML_TYPE_*` of the same name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QuantFormat {
    /// Group-wise symmetric int4: blocks of 32 weights, an f16 scale `d` and 32 4-bit
    /// codes, weight = `d * (q - 8)` (4.5 bits a weight).
    Q4_0,
    /// Group-wise asymmetric int4: blocks of 32 weights, f16 `d` and `m` and 32 4-bit
    /// codes, weight = `d * q + m` (5 bits a weight).
    Q4_1,
    /// Group-wise symmetric int5: blocks of 32 weights, an f16 scale `d`, 32 fifth bits
    /// `qh` and 32 4-bit codes, weight = `d * (q - 16)` (5.5 bits a weight).
    Q5_0,
    /// Blocks of 32 weights: an f16 scale and 32 signed bytes (8.5 bits a weight).
    Q8_0,
    /// Super-blocks of 256 weights: f16 scale and min, eight 6-bit sub-block scales and
    /// mins, 4-bit codes (4.5 bits a weight).
    Q4K,
    /// As [`QuantFormat::Q4K`] with a fifth bit per code (5.5 bits a weight).
    Q5K,
    /// Super-blocks of 256 weights: 6-bit codes, sixteen 8-bit sub-block scales and an
    /// f16 scale (6.5625 bits a weight).
    Q6K,
    /// OCP microscaling FP4 (gpt-oss experts): blocks of 32 weights, one e8m0 exponent
    /// byte and 32 e2m1 codes (4.25 bits a weight).
    Mxfp4,
}

/// Weights per super-block of the K formats (ggml's `QK_K`).
pub const QK_K: usize = 256;

impl QuantFormat {
    /// Every format, in ggml type-id order.
    pub const ALL: [QuantFormat; 8] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
        QuantFormat::Mxfp4,
    ];

    /// Weights per block (from [`storage::GGML_TYPES`]).
    pub fn block_elems(self) -> usize {
        storage::Storage::Quant(self).ggml().block_elems
    }

    /// Bytes per block (from [`storage::GGML_TYPES`]).
    pub fn block_bytes(self) -> usize {
        storage::Storage::Quant(self).ggml().block_bytes
    }

    /// Bytes of `elems` weights, when `elems` is whole blocks.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        elems
            .is_multiple_of(self.block_elems())
            .then(|| elems / self.block_elems() * self.block_bytes())
    }

    /// The ggml type id (from [`storage::GGML_TYPES`]).
    pub fn ggml_type(self) -> u32 {
        storage::Storage::Quant(self).ggml().id
    }

    /// The format of a ggml type id, if moec computes with it.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        storage::Storage::from_ggml_type(id)?.quant()
    }

    /// The name llama.cpp prints (`Q4_K`).
    pub fn name(self) -> &'static str {
        storage::Storage::Quant(self).ggml().name
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why bytes cannot be viewed or decoded as quantised weights.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The element count is not whole blocks, or the bytes disagree with it.
    #[error("{elems} {format} weights need whole blocks of {block} ({bytes} bytes given)")]
    Blocks {
        /// The format.
        format: QuantFormat,
        /// Weights asked for.
        elems: usize,
        /// Weights per block.
        block: usize,
        /// Bytes given.
        bytes: usize,
    },
    /// A Q4_K view in tiles whose shape does not tile.
    #[error(
        "{elems} {format} weights in rows of {cols} cannot be tiles of eight rows of whole blocks"
    )]
    Tiles {
        /// The format asked for.
        format: QuantFormat,
        /// Weights asked for.
        elems: usize,
        /// Weights per row.
        cols: usize,
    },
}

/// How a quantised matrix's blocks are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockLayout {
    /// ggml's: row after row, each row its blocks in order (every file stores this).
    Rows,
    /// Q4_K, Q6_K, Q8_0, Q4_0 or MXFP4 in tiles of eight rows of `cols` weights ([`tiles`]), made at load for
    /// the CPU backend's products; only whole tiles can be sliced out.
    Tiles8 {
        /// Weights per row.
        cols: usize,
    },
}

/// A borrowed run of quantised weights: `len` weights in whole blocks of `format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSlice<'a> {
    /// The storage format.
    pub format: QuantFormat,
    /// The blocks, `len / block_elems * block_bytes` bytes.
    pub bytes: &'a [u8],
    /// Weights (a multiple of the format's block).
    pub len: usize,
    /// The order of the blocks.
    pub layout: BlockLayout,
}

impl<'a> QuantSlice<'a> {
    /// Views `bytes` as `elems` weights of `format`; the bytes must be exactly whole blocks.
    pub fn new(bytes: &'a [u8], format: QuantFormat, elems: usize) -> Result<Self, QuantError> {
        match format.bytes_for(elems) {
            Some(n) if n == bytes.len() => Ok(QuantSlice {
                format,
                bytes,
                len: elems,
                layout: BlockLayout::Rows,
            }),
            _ => Err(QuantError::Blocks {
                format,
                elems,
                block: format.block_elems(),
                bytes: bytes.len(),
            }),
        }
    }

    /// Views `bytes` as `elems` weights of `format` in tiles of eight rows of `cols`
    /// ([`tiles::tile`]'s output); the format and shape must tile and the bytes be exactly
    /// whole blocks.
    pub fn tiled(
        bytes: &'a [u8],
        format: QuantFormat,
        elems: usize,
        cols: usize,
    ) -> Result<Self, QuantError> {
        let plain = Self::new(bytes, format, elems)?;
        let rows = elems.checked_div(cols).unwrap_or(0);
        if cols == 0 || rows * cols != elems || !tiles::tileable(format, rows, cols) {
            return Err(QuantError::Tiles {
                format,
                elems,
                cols,
            });
        }
        Ok(QuantSlice {
            layout: BlockLayout::Tiles8 { cols },
            ..plain
        })
    }

    /// Weights `range` of this slice, when both ends fall on block boundaries (a matrix
    /// row of a quantised tensor always does: rows are whole blocks) and, for tiles, on
    /// tile boundaries (whole groups of eight rows); `None` otherwise.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Option<QuantSlice<'a>> {
        if let BlockLayout::Tiles8 { cols } = self.layout {
            let tile = tiles::TILE_ROWS * cols;
            if !range.start.is_multiple_of(tile) || !range.end.is_multiple_of(tile) {
                return None;
            }
        }
        let block = self.format.block_elems();
        if !range.start.is_multiple_of(block)
            || !range.end.is_multiple_of(block)
            || range.start > range.end
            || range.end > self.len
        {
            return None;
        }
        let bb = self.format.block_bytes();
        Some(QuantSlice {
            format: self.format,
            bytes: &self.bytes[range.start / block * bb..range.end / block * bb],
            len: range.len(),
            layout: self.layout,
        })
    }

    /// The blocks in ggml's row layout: borrowed when they are, untiled otherwise.
    pub fn plain_bytes(&self) -> std::borrow::Cow<'a, [u8]> {
        match self.layout {
            BlockLayout::Rows => std::borrow::Cow::Borrowed(self.bytes),
            BlockLayout::Tiles8 { cols } => std::borrow::Cow::Owned(
                // `tiled` checked the shape, and slices keep whole tiles.
                tiles::untile(self.format, self.bytes, self.len / cols, cols).unwrap_or_default(),
            ),
        }
    }

    /// Decodes every weight into `dst` (`len` values).
    pub fn dequantize_into(&self, dst: &mut [f32]) -> Result<(), QuantError> {
        dequantize_blocks(self.format, &self.plain_bytes(), dst)
    }
}

/// Test blocks: `n_blocks` blocks of `format` with pseudo-random codes and scale bytes and
/// finite f16 super-block scales of magnitude below `0.05` (any such bytes are a valid
/// block), deterministic in `seed`.
#[cfg(test)]
pub(crate) fn random_blocks(format: QuantFormat, n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = crate::rng::Rng::new(seed);
    let bb = format.block_bytes();
    let mut bytes: Vec<u8> = (0..n_blocks * bb)
        .map(|_| (rng.next_u64() >> 56) as u8)
        .collect();
    let f16_fields: &[usize] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
        QuantFormat::Mxfp4 => &[],
    };
    for block in bytes.chunks_exact_mut(bb) {
        for &at in f16_fields {
            let v = ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
        if format == QuantFormat::Mxfp4 {
            // e8m0 exponents 118..134: scales 2^-10 .. 2^5 (times the half of the table).
            block[0] = 118 + (rng.next_u64() % 16) as u8;
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_fall_on_block_boundaries_only() {
        let bytes = random_blocks(QuantFormat::Q4K, 4, 1);
        let q = QuantSlice::new(&bytes, QuantFormat::Q4K, 1024).unwrap();
        let part = q.slice(256..768).unwrap();
        assert_eq!((part.len, part.bytes.len()), (512, 288));
        assert_eq!(part.bytes, &bytes[144..432]);
        assert!(q.slice(0..100).is_none());
        assert!(q.slice(256..1280).is_none());
        assert!(QuantSlice::new(&bytes[..143], QuantFormat::Q4K, 256).is_err());
        assert!(QuantSlice::new(&bytes, QuantFormat::Q4K, 1000).is_err());
    }

    #[test]
    fn ggml_type_ids_round_trip() {
        for f in QuantFormat::ALL {
            assert_eq!(QuantFormat::from_ggml_type(f.ggml_type()), Some(f));
        }
        assert_eq!(QuantFormat::from_ggml_type(2), Some(QuantFormat::Q4_0));
        assert_eq!(QuantFormat::from_ggml_type(3), Some(QuantFormat::Q4_1));
        assert_eq!(QuantFormat::from_ggml_type(6), Some(QuantFormat::Q5_0));
        assert_eq!(
            QuantFormat::from_ggml_type(10),
            None,
            "Q2_K is not supported"
        );
    }
}
