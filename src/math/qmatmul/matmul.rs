//! `y = x Wᵀ` for block-quantised weights `W` stored `[out, in]` in GGML block layout
//! (each output row is `in / block_elems` whole blocks, as llama.cpp stores every matrix,
//! merged expert tensors `ffn_*_exps` included) and f32 activations, computed the way the
//! formats are meant to run: activations quantised to 8 bits, integer dot products inside
//! a block, f32 accumulation of the block results.
//!
//! How one output is computed (what an independent oracle must reproduce):
//!
//! 1. each activation row is quantised to Q8_K (K-quant weights), Q8_0 (Q8_0 and Q4_0
//!    and MXFP4 weights) or Q8_1 (Q4_1 weights) exactly as ggml does it (see [`crate::quant::q8`]);
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
//! `ThreadPool::install`, as [`crate::math::linear`] does).

use super::dot;
use super::select::{QuantBody, QuantKernels};
use super::tiles::{TileActs, TILE_ROWS};
#[cfg(target_arch = "x86_64")]
use super::x86::{CodeOrder, GroupedActs};
use crate::math::tensor::{Matrix, TypedSlice};
use crate::model::vocab::Orientation;
use crate::quant::q8::{ActFormat, Q8Rows};
use crate::quant::{BlockLayout, QuantFormat, QuantSlice};
use rayon::prelude::*;

/// Output rows per parallel task (and per panel a product packs into tiles).
pub(super) const PANEL_ROWS: usize = 64;

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
        self.quant_linear_many(&[*w], x, n_rows, &mut [y])
    }

    /// [`QuantKernels::quant_linear`] of several matrices on the same input `x` (every
    /// `ws[m].cols` wide), `ws[m]`'s product into `ys[m]` ([`QuantKernels::quant_products`]).
    pub fn quant_linear_many(
        self,
        ws: &[QuantMatrix<'_>],
        x: &[f32],
        n_rows: usize,
        ys: &mut [&mut [f32]],
    ) -> Result<(), QuantMatmulError> {
        let products: Vec<QuantProduct<'_>> =
            ws.iter().map(|&w| QuantProduct { w, x, n_rows }).collect();
        self.quant_products(&products, ys)
    }

    /// Several [`QuantKernels::quant_linear`] products at once, `products[m]`'s into
    /// `ys[m]`: each input is quantised once per activation format (products that share
    /// an input, such as q/k/v or gate/up, share it) and every matrix's panels run in one
    /// parallel region: one fork and join instead of one per matrix, where a decode step's
    /// products are a few microseconds of work each. Each output has the bits
    /// `quant_linear` gives it.
    pub fn quant_products(
        self,
        products: &[QuantProduct<'_>],
        ys: &mut [&mut [f32]],
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
        check("outputs", ys.len(), products.len())?;
        // Re-checked because the fields are public.
        let ws = products
            .iter()
            .map(|p| QuantMatrix::new(p.w.data, p.w.rows, p.w.cols))
            .collect::<Result<Vec<_>, _>>()?;
        for ((w, p), y) in ws.iter().zip(products).zip(ys.iter()) {
            check("input", p.x.len(), p.n_rows * w.cols)?;
            check("output", y.len(), p.n_rows * w.rows)?;
        }
        // Products with no output (no rows, no columns) have no panels and are zero.
        let live = |m: usize| products[m].n_rows > 0 && ws[m].cols > 0;
        // The input of each live product, quantised for its format: an index into
        // `quantised`.
        let mut quantised: Vec<Q8Rows> = Vec::new();
        let mut keys: Vec<(*const f32, usize, ActFormat)> = Vec::new();
        let mut which = Vec::with_capacity(products.len());
        for (m, (w, p)) in ws.iter().zip(products).enumerate() {
            let key = (p.x.as_ptr(), p.x.len(), ActFormat::for_weights(w.format()));
            let i = match keys.iter().position(|k| *k == key) {
                _ if !live(m) => None,
                Some(i) => Some(i),
                None => {
                    keys.push(key);
                    quantised.push(Q8Rows::quantize(key.2, p.x, p.n_rows, w.cols));
                    Some(keys.len() - 1)
                }
            };
            which.push(i);
        }
        let prepared: Vec<Option<Prepared<'_>>> = ws
            .iter()
            .zip(&which)
            .map(|(w, i)| i.map(|i| Prepared::new(self, w, &quantised[i])))
            .collect();
        // One task per panel of every live product, each with what its body reads.
        let tasks: Vec<(usize, usize, &Prepared<'_>)> = prepared
            .iter()
            .enumerate()
            .filter_map(|(m, prep)| prep.as_ref().map(|prep| (m, prep)))
            .flat_map(|(m, prep)| (0..ws[m].rows.div_ceil(PANEL_ROWS)).map(move |p| (m, p, prep)))
            .collect();
        let work: usize = (0..ws.len())
            .map(|m| products[m].n_rows * ws[m].rows * ws[m].cols)
            .sum();
        let task = |&(m, p, prep): &(usize, usize, &Prepared<'_>)| {
            prep.panel(self, &ws[m], products[m].n_rows, p)
        };
        let panels: Vec<Vec<f32>> = if work < PARALLEL_MIN_WORK || tasks.len() <= 1 {
            tasks.iter().map(task).collect()
        } else {
            tasks.par_iter().map(task).collect()
        };
        for (m, y) in ys.iter_mut().enumerate() {
            if !live(m) {
                y.fill(0.0);
            }
        }
        for (&(m, p, _), local) in tasks.iter().zip(&panels) {
            let (w, y) = (&ws[m], &mut *ys[m]);
            let o0 = p * PANEL_ROWS;
            let rows = local.len() / products[m].n_rows;
            for (t, part) in local.chunks_exact(rows).enumerate() {
                y[t * w.rows + o0..t * w.rows + o0 + rows].copy_from_slice(part);
            }
        }
        Ok(())
    }
}

/// One product of [`QuantKernels::quant_products`]: `n_rows` rows `x` (`[n_rows, w.cols]`)
/// times the matrix `w`.
#[derive(Debug, Clone, Copy)]
pub struct QuantProduct<'a> {
    /// The weights.
    pub w: QuantMatrix<'a>,
    /// The input rows.
    pub x: &'a [f32],
    /// How many rows `x` holds.
    pub n_rows: usize,
}

/// What a matrix's panels read of the quantised input: the activation side its body and
/// layout want.
enum Prepared<'a> {
    /// Tiles ([`super::tiles`]).
    Tiles(TileActs<'a>),
    /// The row layout packed into tiles a panel at a time as the product runs
    /// (`super::pack`).
    #[cfg(target_arch = "x86_64")]
    Packed(TileActs<'a>),
    /// The row layout through a SIMD body.
    #[cfg(target_arch = "x86_64")]
    Grouped(GroupedActs<'a>),
    /// The row layout through the portable body.
    Rows(&'a Q8Rows),
}

impl<'a> Prepared<'a> {
    fn new(k: QuantKernels, w: &QuantMatrix<'_>, acts: &'a Q8Rows) -> Self {
        if w.data.layout != BlockLayout::Rows {
            let vnni = k.body() == QuantBody::Avx512Vnni;
            return Prepared::Tiles(TileActs::new(acts, w.format(), vnni));
        }
        #[cfg(target_arch = "x86_64")]
        if k.packs(w.format(), w.cols, acts.n_rows) {
            let vnni = k.body() == QuantBody::Avx512Vnni;
            return Prepared::Packed(TileActs::new(acts, w.format(), vnni));
        }
        #[cfg(target_arch = "x86_64")]
        if k.body() != QuantBody::Portable {
            let order = simd_code_order(k.body(), w.format());
            return Prepared::Grouped(GroupedActs::new(acts, w.format(), order));
        }
        let _ = k;
        Prepared::Rows(acts)
    }

    /// Panel `p` (rows `p · PANEL_ROWS..`) of `w` times every input row: `[n_rows, rows]`.
    fn panel(&self, k: QuantKernels, w: &QuantMatrix<'_>, n_rows: usize, p: usize) -> Vec<f32> {
        let o0 = p * PANEL_ROWS;
        let rows = PANEL_ROWS.min(w.rows - o0);
        let mut local = vec![0.0f32; n_rows * rows];
        match self {
            Prepared::Tiles(acts) => {
                #[cfg(target_arch = "x86_64")]
                if k.body() != QuantBody::Portable {
                    // SAFETY: the body's features are this CPU's (the `QuantKernels`
                    // invariant); `QuantMatrix::new` checked that the tiles are whole tiles
                    // of `w.cols` of a tileable format (Q4_K, Q6_K, Q8_0, Q4_0, MXFP4:
                    // `QuantSlice::tiled`);
                    // `acts` was made for that format from rows of `w.cols`; PANEL_ROWS is
                    // a multiple of eight, so a panel is whole tiles too, and
                    // o0 + rows <= w.rows; `local` is n_rows * rows.
                    unsafe {
                        super::tiles_x86::panel(
                            k.body() == QuantBody::Avx512Vnni,
                            (k.unpacked_tiles(), k.few_row_passes(), k.q6k_row_prefetch()),
                            w,
                            acts,
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
                    acts.q,
                    o0,
                    rows,
                    &mut local,
                );
            }
            #[cfg(target_arch = "x86_64")]
            Prepared::Packed(acts) => super::pack::panel(k, w, acts, o0, rows, &mut local),
            #[cfg(target_arch = "x86_64")]
            Prepared::Grouped(g) => simd_panel(k.body(), w, g, o0, rows, &mut local),
            Prepared::Rows(acts) => portable_panel(w, acts, o0, rows, &mut local),
        }
        local
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
        // Q5_0 has only the AVX2 body (the VNNI body's CPUs have AVX2 too: its
        // `is_supported`).
        (_, QuantFormat::Q5_0) => dot_avx2::panel::<6>,
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
