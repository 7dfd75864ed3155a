//! `y = x Wᵀ` for block-quantised weights `W` stored `[out, in]` in GGML block layout
//! (each output row is `in / block_elems` whole blocks, as llama.cpp stores every matrix,
//! merged expert tensors `ffn_*_exps` included) and f32 activations, computed the way the
//! formats are meant to run: activations quantised to 8 bits, integer dot products inside
//! a block, f32 accumulation of the block results.
//!
//! How one output is computed (what an independent oracle must reproduce):
//!
//! 1. each activation row is quantised to Q8_K (K-quant weights), Q8_0 (Q8_0 and Q4_0
//!    and MXFP4 weights) or Q8_1 (Q4_1 weights) exactly as ggml does it (see [`super::q8`]);
//! 2. each (weight block, activation block) pair gives one f32 value from exact integer
//!    sums (see [`super::dot`]: `(dx·dy)·f32(isum) − (dmin·dy)·f32(imin)` for Q4_K/Q5_K,
//!    `(dx·dy)·f32(isum) + m·sy` for Q4_1, `(dx·dy)·f32(isum)` for Q6_K, Q8_0, Q4_0 and
//!    MXFP4,
//!    each operation rounded separately);
//! 3. `y[r, o]` = the sum of the row's block values in block order, starting from `0.0`,
//!    one rounded f32 addition per block (`((0 + v_0) + v_1) + ...`).
//!
//! That order depends only on the matrix, never on the number of rows, the thread count
//! or the body, so every body ([`QuantBody`]) gives the same bits, and a token gets the
//! same result whichever batch it is in. ggml's `vec_dot_*_q8_K` compute the same integer
//! sums and differ only in how they add the f32 block values (lanes, fused multiply-add).
//!
//! Work is split into panels of output rows run on the current rayon pool (the caller's
//! `ThreadPool::install`, as [`crate::model::kernels::linear`] does).

use super::dot;
use super::q8::{ActFormat, Q8Rows};
use super::select::{QuantBody, QuantKernels};
use super::tiles::{TileActs, TILE_ROWS};
#[cfg(target_arch = "x86_64")]
use super::x86::{CodeOrder, GroupedActs};
use super::{BlockLayout, QuantFormat, QuantSlice};
use crate::model::tensor::{Matrix, Orientation, TypedSlice};
use rayon::prelude::*;

/// Output rows per parallel task.
const PANEL_ROWS: usize = 64;

/// Below this many multiply-adds a product runs on the calling thread only.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// Why a quantised product cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantMatmulError {
    /// The matrix's rows are not whole blocks, or its bytes do not match its shape.
    #[error("{format} matrix [{rows}, {cols}]: {what}")]
    Layout {
        /// The block format.
        format: QuantFormat,
        /// Output rows.
        rows: usize,
        /// Input columns.
        cols: usize,
        /// What is wrong.
        what: &'static str,
    },
    /// A buffer of the wrong length.
    #[error("quantised product {what}: expected {expected} values, got {got}")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// Length needed.
        expected: usize,
        /// Length given.
        got: usize,
    },
}

/// A quantised weight matrix stored `[rows (out), cols (in)]`, each row whole blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantMatrix<'a> {
    /// The blocks, row after row.
    pub data: QuantSlice<'a>,
    /// Output rows.
    pub rows: usize,
    /// Input columns (a multiple of the format's block).
    pub cols: usize,
}

impl<'a> QuantMatrix<'a> {
    /// Views `data` as `[rows, cols]`; rows must be whole blocks and `data` hold exactly
    /// `rows * cols` weights.
    pub fn new(data: QuantSlice<'a>, rows: usize, cols: usize) -> Result<Self, QuantMatmulError> {
        let format = data.format;
        let err = |what| QuantMatmulError::Layout {
            format,
            rows,
            cols,
            what,
        };
        if !cols.is_multiple_of(format.block_elems()) {
            return Err(err("rows are not whole blocks"));
        }
        if rows.checked_mul(cols) != Some(data.len) {
            return Err(err("the weights given are not rows x cols"));
        }
        if matches!(data.layout, BlockLayout::Tiles8 { cols: c } if c != cols || !rows.is_multiple_of(TILE_ROWS))
        {
            return Err(err("its tiles are not whole tiles of this row width"));
        }
        Ok(QuantMatrix { data, rows, cols })
    }

    /// The quantised matrix behind a [`Matrix`] view, when it is quantised and stored
    /// out-in (`None` otherwise).
    pub fn from_matrix(m: &Matrix<'a>) -> Option<Self> {
        match (m.data, m.orientation) {
            (TypedSlice::Quant(q), Orientation::OutIn) => Self::new(q, m.rows, m.cols).ok(),
            _ => None,
        }
    }

    /// The storage format.
    pub fn format(&self) -> QuantFormat {
        self.data.format
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.format().block_elems() * self.format().block_bytes()
    }

    /// The bytes of row `o` (`o < rows`; the row layout only).
    pub(super) fn row(&self, o: usize) -> &'a [u8] {
        debug_assert_eq!(self.data.layout, BlockLayout::Rows);
        let rb = self.row_bytes();
        &self.data.bytes[o * rb..(o + 1) * rb]
    }
}

/// [`QuantKernels::quant_linear`] with the process's kernels ([`QuantKernels::process`]).
pub fn quant_linear(
    w: &QuantMatrix<'_>,
    x: &[f32],
    n_rows: usize,
    y: &mut [f32],
) -> Result<(), QuantMatmulError> {
    QuantKernels::process().quant_linear(w, x, n_rows, y)
}

impl QuantKernels {
    /// `y[r, o] = Σ_k x[r, k] · W[o, k]` for `n_rows` activation rows `x` (`[n_rows,
    /// w.cols]`, f32) into `y` (`[n_rows, w.rows]`), computed as the module documents.
    /// Lengths that do not match are an error naming the argument.
    pub fn quant_linear(
        self,
        w: &QuantMatrix<'_>,
        x: &[f32],
        n_rows: usize,
        y: &mut [f32],
    ) -> Result<(), QuantMatmulError> {
        let check = |what, got: usize, expected: usize| {
            if got == expected {
                Ok(())
            } else {
                Err(QuantMatmulError::Shape {
                    what,
                    expected,
                    got,
                })
            }
        };
        // Re-checked because the fields are public.
        let w = QuantMatrix::new(w.data, w.rows, w.cols)?;
        check("input", x.len(), n_rows * w.cols)?;
        check("output", y.len(), n_rows * w.rows)?;
        if n_rows == 0 || w.rows == 0 || w.cols == 0 {
            y.fill(0.0);
            return Ok(());
        }
        let acts = Q8Rows::quantize(ActFormat::for_weights(w.format()), x, n_rows, w.cols);
        if w.data.layout != BlockLayout::Rows {
            self.tiled_products(&w, &acts, y);
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        let grouped = (self.body() != QuantBody::Portable)
            .then(|| GroupedActs::new(&acts, w.format(), simd_code_order(self.body(), w.format())));
        let task = |p: usize| {
            let o0 = p * PANEL_ROWS;
            let rows = PANEL_ROWS.min(w.rows - o0);
            let mut local = vec![0.0f32; n_rows * rows];
            #[cfg(target_arch = "x86_64")]
            if let Some(g) = &grouped {
                simd_panel(self.body(), &w, g, o0, rows, &mut local);
                return local;
            }
            portable_panel(&w, &acts, o0, rows, &mut local);
            local
        };
        run_panels(&w, n_rows, task, y);
        Ok(())
    }

    /// The products from a tiled matrix ([`super::tiles`]): panels of whole tiles through
    /// this body's tile pass.
    fn tiled_products(self, w: &QuantMatrix<'_>, acts: &Q8Rows, y: &mut [f32]) {
        let tile_acts = TileActs::new(acts, w.format());
        let task = |p: usize| {
            let o0 = p * PANEL_ROWS;
            let rows = PANEL_ROWS.min(w.rows - o0);
            let mut local = vec![0.0f32; acts.n_rows * rows];
            #[cfg(target_arch = "x86_64")]
            if self.body() != QuantBody::Portable {
                // SAFETY: the body's features are this CPU's (the `QuantKernels`
                // invariant); `QuantMatrix::new` checked that the tiles are whole tiles
                // of `w.cols` of a tileable format (Q4_K or Q6_K, `QuantSlice::tiled`);
                // `tile_acts` was made for that format; PANEL_ROWS is a multiple of eight,
                // so a panel is whole tiles too, and o0 + rows <= w.rows; `acts` holds
                // rows of `w.cols`; `local` is n_rows * rows.
                unsafe {
                    super::tiles_x86::panel(
                        self.body() == QuantBody::Avx512Vnni,
                        w,
                        &tile_acts,
                        o0,
                        rows,
                        &mut local,
                    )
                };
                return local;
            }
            super::tiles::portable_panel(
                w.format(),
                w.data.bytes,
                w.cols,
                acts,
                o0,
                rows,
                &mut local,
            );
            local
        };
        run_panels(w, acts.n_rows, task, y);
    }
}

/// Runs `task` for every panel of `PANEL_ROWS` output rows (on the rayon pool when the
/// product is large enough) and scatters each panel's `[n_rows, rows]` into `y`.
fn run_panels(
    w: &QuantMatrix<'_>,
    n_rows: usize,
    task: impl Fn(usize) -> Vec<f32> + Sync + Send,
    y: &mut [f32],
) {
    let n_panels = w.rows.div_ceil(PANEL_ROWS);
    let panels: Vec<Vec<f32>> = if n_rows * w.rows * w.cols < PARALLEL_MIN_WORK || n_panels == 1 {
        (0..n_panels).map(task).collect()
    } else {
        (0..n_panels).into_par_iter().map(task).collect()
    };
    for (p, local) in panels.iter().enumerate() {
        let o0 = p * PANEL_ROWS;
        let rows = local.len() / n_rows;
        for (t, part) in local.chunks_exact(rows).enumerate() {
            y[t * w.rows + o0..t * w.rows + o0 + rows].copy_from_slice(part);
        }
    }
}

/// A SIMD body's panel (`body` is not portable and this CPU runs it: a [`QuantKernels`]
/// value vouches for that).
#[cfg(target_arch = "x86_64")]
fn simd_panel(
    body: QuantBody,
    w: &QuantMatrix<'_>,
    acts: &GroupedActs<'_>,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    use super::{dot_avx2, dot_avx512};
    type Panel = unsafe fn(&QuantMatrix<'_>, &GroupedActs<'_>, usize, usize, &mut [f32]);
    let f: Panel = match (body, w.format()) {
        (QuantBody::Avx512Vnni, QuantFormat::Q4_0) => dot_avx512::panel::<2>,
        (QuantBody::Avx512Vnni, QuantFormat::Q4_1) => dot_avx512::panel::<3>,
        (QuantBody::Avx512Vnni, QuantFormat::Q8_0) => dot_avx512::panel::<8>,
        (QuantBody::Avx512Vnni, QuantFormat::Q4K) => dot_avx512::panel::<12>,
        (QuantBody::Avx512Vnni, QuantFormat::Q5K) => dot_avx512::panel::<13>,
        (QuantBody::Avx512Vnni, QuantFormat::Q6K) => dot_avx512::panel::<14>,
        (QuantBody::Avx512Vnni, QuantFormat::Mxfp4) => dot_avx512::panel::<39>,
        (_, QuantFormat::Q4_0) => dot_avx2::panel::<2>,
        (_, QuantFormat::Q4_1) => dot_avx2::panel::<3>,
        (_, QuantFormat::Q8_0) => dot_avx2::panel::<8>,
        (_, QuantFormat::Q4K) => dot_avx2::panel::<12>,
        (_, QuantFormat::Q5K) => dot_avx2::panel::<13>,
        (_, QuantFormat::Q6K) => dot_avx2::panel::<14>,
        (_, QuantFormat::Mxfp4) => dot_avx2::panel::<39>,
    };
    // SAFETY: the body's features are this CPU's (the `QuantKernels` invariant; the
    // portable body never gets here); the panel's format is `w`'s by the match above;
    // `acts` was quantised from `n_rows` rows of `w.cols` for this format; the caller made
    // o0 + rows <= w.rows and `local` n_rows * rows long.
    unsafe { f(w, acts, o0, rows, local) }
}

/// The order a SIMD body's decoder gives a format's codes in (the activation codes are
/// laid out to match).
#[cfg(target_arch = "x86_64")]
fn simd_code_order(body: QuantBody, format: QuantFormat) -> CodeOrder {
    match (body, format) {
        (QuantBody::Avx512Vnni, QuantFormat::Q4K | QuantFormat::Q5K) => CodeOrder::SubBlockPairs,
        _ => CodeOrder::Natural,
    }
}

/// The reference body: each output summed block by block as the module documents.
fn portable_panel(w: &QuantMatrix<'_>, acts: &Q8Rows, o0: usize, rows: usize, local: &mut [f32]) {
    let format = w.format();
    let bb = format.block_bytes();
    let k_quant = acts.format == ActFormat::Q8K;
    for i in 0..rows {
        let row = w.row(o0 + i);
        for r in 0..acts.n_rows {
            let mut acc = 0.0f32;
            for (b, wb) in row.chunks_exact(bb).enumerate() {
                let bsums = if k_quant { acts.block_bsums(r, b) } else { &[] };
                let (dy, sy) = (acts.block_d(r, b), acts.block_s(r, b));
                acc += dot::block_value(format, wb, acts.block_qs(r, b), bsums, dy, sy);
            }
            local[r * rows + i] = acc;
        }
    }
}
