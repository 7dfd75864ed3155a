//! Typed, borrowed views of weight tensors: what the kernels read.
//!
//! Takes raw little-endian bytes (from a memory map or any byte buffer) and gives typed
//! slices in the checkpoint's dtype (bf16, f16 or f32, or a GGUF block-quantised format,
//! see `quant`) plus matrix views that know their storage orientation. Nothing here
//! copies or converts weights; kernels widen (or dequantise) to f32 tile by tile. Casting
//! checks length and alignment and never panics; a quantised matrix's rows are whole
//! blocks, checked when it is built.

use crate::model::vocab::Orientation;
use crate::quant::storage::WeightDtype;
use crate::quant::{QuantFormat, QuantSlice};
use half::{bf16, f16};

/// A borrowed run of weights in their stored dtype.
#[derive(Debug, Clone, Copy)]
pub enum TypedSlice<'a> {
    /// bfloat16 elements.
    Bf16(&'a [bf16]),
    /// IEEE half elements.
    F16(&'a [f16]),
    /// IEEE single elements.
    F32(&'a [f32]),
    /// Block-quantised weights (llama.cpp's GGUF formats), decoded to f32 as read.
    Quant(QuantSlice<'a>),
}

/// Why bytes cannot be viewed as a typed slice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CastError {
    /// The byte length is not a multiple of the element size.
    #[error("{len} bytes is not a whole number of {dtype:?} elements")]
    Length {
        /// Bytes given.
        len: usize,
        /// Element type asked for.
        dtype: WeightDtype,
    },
    /// The bytes do not start at a multiple of the element size.
    #[error("data is not aligned to {align} bytes for {dtype:?}")]
    Alignment {
        /// Required alignment.
        align: usize,
        /// Element type asked for.
        dtype: WeightDtype,
    },
}

impl<'a> TypedSlice<'a> {
    /// Views `bytes` as elements of `dtype` (little-endian, as safetensors stores them).
    pub fn from_bytes(bytes: &'a [u8], dtype: WeightDtype) -> Result<Self, CastError> {
        let elem = dtype.bytes() as usize;
        if !bytes.len().is_multiple_of(elem) {
            return Err(CastError::Length {
                len: bytes.len(),
                dtype,
            });
        }
        if !(bytes.as_ptr() as usize).is_multiple_of(elem) {
            return Err(CastError::Alignment { align: elem, dtype });
        }
        // Alignment and length were checked above, so these casts cannot fail; map the
        // (impossible) error anyway rather than unwrap.
        let misaligned = CastError::Alignment { align: elem, dtype };
        Ok(match dtype {
            WeightDtype::Bf16 => {
                TypedSlice::Bf16(bytemuck::try_cast_slice(bytes).map_err(|_| misaligned)?)
            }
            WeightDtype::F16 => {
                TypedSlice::F16(bytemuck::try_cast_slice(bytes).map_err(|_| misaligned)?)
            }
            WeightDtype::F32 => {
                TypedSlice::F32(bytemuck::try_cast_slice(bytes).map_err(|_| misaligned)?)
            }
        })
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            TypedSlice::Bf16(s) => s.len(),
            TypedSlice::F16(s) => s.len(),
            TypedSlice::F32(s) => s.len(),
            TypedSlice::Quant(q) => q.len,
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stored float dtype; f32 for quantised weights (what they decode to; see
    /// [`TypedSlice::quant_format`]).
    pub fn dtype(&self) -> WeightDtype {
        match self {
            TypedSlice::Bf16(_) => WeightDtype::Bf16,
            TypedSlice::F16(_) => WeightDtype::F16,
            TypedSlice::F32(_) | TypedSlice::Quant(_) => WeightDtype::F32,
        }
    }

    /// The block format of quantised weights; `None` for float ones.
    pub fn quant_format(&self) -> Option<QuantFormat> {
        match self {
            TypedSlice::Quant(q) => Some(q.format),
            _ => None,
        }
    }

    /// Elements `range` of this slice (caller guarantees the range is in bounds and, for
    /// quantised weights, on block boundaries: whole rows of a [`Matrix`] always are).
    pub fn slice(&self, range: std::ops::Range<usize>) -> TypedSlice<'a> {
        match self {
            TypedSlice::Bf16(s) => TypedSlice::Bf16(&s[range]),
            TypedSlice::F16(s) => TypedSlice::F16(&s[range]),
            TypedSlice::F32(s) => TypedSlice::F32(&s[range]),
            TypedSlice::Quant(q) => match q.slice(range.clone()) {
                Some(part) => TypedSlice::Quant(part),
                None => panic!(
                    "weights {range:?} of {} {} weights are not whole blocks",
                    q.len, q.format
                ),
            },
        }
    }

    /// Widens all elements into `dst` (same length) as f32.
    pub fn widen_into(&self, dst: &mut [f32]) {
        crate::math::simd::widen(*self, dst);
    }

    /// Widens into a new vector (for small tensors such as norm weights).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.widen_into(&mut out);
        out
    }
}

/// A borrowed 2-D weight matrix, row-major as stored.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    /// `rows * cols` elements.
    pub data: TypedSlice<'a>,
    /// Stored rows.
    pub rows: usize,
    /// Stored columns.
    pub cols: usize,
    /// Whether rows are outputs (`OutIn`) or inputs (`InOut`).
    pub orientation: Orientation,
}

impl<'a> Matrix<'a> {
    /// Builds a matrix view; `None` if the element count does not match, or for quantised
    /// weights when a stored row is not whole blocks.
    pub fn new(
        data: TypedSlice<'a>,
        rows: usize,
        cols: usize,
        orientation: Orientation,
    ) -> Option<Self> {
        if let TypedSlice::Quant(q) = data {
            if !cols.is_multiple_of(q.format.block_elems()) {
                return None;
            }
        }
        (rows.checked_mul(cols)? == data.len()).then_some(Matrix {
            data,
            rows,
            cols,
            orientation,
        })
    }

    /// A 0 x 0 matrix: the placeholder for a projection a family does not have (gpt-oss's
    /// separate gate and up, which it fuses).
    pub fn empty() -> Matrix<'static> {
        Matrix {
            data: TypedSlice::F32(&[]),
            rows: 0,
            cols: 0,
            orientation: Orientation::OutIn,
        }
    }

    /// Width of the input the matrix multiplies.
    pub fn in_dim(&self) -> usize {
        match self.orientation {
            Orientation::OutIn => self.cols,
            Orientation::InOut => self.rows,
        }
    }

    /// Width of the product.
    pub fn out_dim(&self) -> usize {
        match self.orientation {
            Orientation::OutIn => self.rows,
            Orientation::InOut => self.cols,
        }
    }

    /// Stored row `r` (caller guarantees `r < rows`).
    pub fn row(&self, r: usize) -> TypedSlice<'a> {
        self.data.slice(r * self.cols..(r + 1) * self.cols)
    }

    /// Stored rows `range` as a matrix with the same orientation.
    pub fn row_block(&self, range: std::ops::Range<usize>) -> Matrix<'a> {
        Matrix {
            data: self
                .data
                .slice(range.start * self.cols..range.end * self.cols),
            rows: range.len(),
            cols: self.cols,
            orientation: self.orientation,
        }
    }
}
