//! Matrix products of f32 activations with stored weights: `y = x Wᵀ` (`OutIn`) or
//! `y = x W` (`InOut`), batch-invariant.
//!
//! Takes activations `[n_rows, in]` (f32, row-major) and a [`Matrix`] view in its stored
//! dtype (bf16/f16 weights are widened to f32 in registers as they are loaded); writes
//! `[n_rows, out]`. Every output element is accumulated in one fixed order that depends
//! only on the matrix (never on `n_rows`, the row's position in the batch, the thread
//! count or the blocking), so a token gets bit-identical results whichever micro-batch it
//! is computed in: the runtime's schedules must reproduce the oracle's tokens exactly.
//!
//! Order per element: `OutIn` sums 16 interleaved lanes over `k` (lane `l` takes
//! `k ≡ l mod 16`, zero-padded tail), then reduces the lanes with a fixed tree; `InOut`
//! accumulates sequentially over the input index with fused multiply-adds. We use our own
//! register-blocked kernels (AVX-512, AVX2+FMA and portable bodies of the same per-element
//! structure, chosen by the [`Kernels`] context; they give the same bits; with bf16 weights
//! and few rows the few-row bodies of [`few_rows`] (AVX2, 1 to 7 rows) and [`few_rows512`]
//! (AVX-512, 1 to 16 rows) run, see [`bodies`]) instead of
//! `gemm`, because `gemm` switches between GEMV, "horizontal" and packed kernels and picks
//! its k-blocking by shape, which changes the summation order with the number of rows.
//! Quantised (GGML block) weights run `math::qmatmul::matmul` instead: activations
//! quantised per row to 8 bits, exact integer sums per block, the blocks summed in order,
//! which is as batch-invariant and gives the same bits on every body. With
//! `MOEC_BF16_PRODUCT=bf16` ([`Kernels::bf16_dot`]) bf16 `OutIn` products run
//! [`bf16_dot`] instead at every row count (activations rounded to bf16, pairs summed as
//! `vdpbf16ps` does; its own fixed order, as batch-invariant); `InOut` keeps this product.

use crate::math::bf16_dot::{self, Bf16Rows};
use crate::math::isa::{Isa, Kernels};
use crate::math::qmatmul::{QuantKernels, QuantMatrix};
use crate::math::tensor::{Matrix, TypedSlice};
use crate::math::{check_len, KernelError};
#[cfg(target_arch = "x86_64")]
use crate::math::{few_rows, few_rows512};
use crate::model::vocab::Orientation;
use rayon::prelude::*;

/// Weight rows per parallel task of the `OutIn` kernel (a panel kept hot in L2).
const PANEL_ROWS: usize = 64;

/// Output columns per parallel task of the `InOut` kernel.
const BAND_COLS: usize = 256;

/// Below this many multiply-adds a product runs on the calling thread only.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// [`Kernels::linear`] with the process's kernels.
pub fn linear(
    x: &[f32],
    n_rows: usize,
    w: &Matrix<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    Kernels::process().linear(x, n_rows, w, out)
}

impl Kernels {
    /// [`Kernels::linear`] of several matrices on the same input `x`, `ws[m]`'s product
    /// into `outs[m]`, each with the bits `linear` gives it. Quantised out-in matrices
    /// (under `int8` products) run in one parallel region with the input quantised once
    /// ([`QuantKernels::quant_linear_many`]); any other set runs one `linear` after another.
    pub fn linear_many(
        self,
        x: &[f32],
        n_rows: usize,
        ws: &[&Matrix<'_>],
        outs: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        check_len("matmul outputs", outs.len(), ws.len())?;
        let quant: Option<Vec<QuantMatrix<'_>>> = ws
            .iter()
            .map(|w| QuantMatrix::from_matrix(w))
            .collect::<Option<_>>()
            .filter(|_| !self.decodes_quant());
        if let Some(qs) = quant {
            for (w, out) in ws.iter().zip(outs.iter()) {
                check_len("matmul input", x.len(), n_rows * w.in_dim())?;
                check_len("matmul output", out.len(), n_rows * w.out_dim())?;
                check_quant(w)?;
            }
            QuantKernels::for_kernels(self).quant_linear_many(&qs, x, n_rows, outs)?;
            return Ok(());
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.linear(x, n_rows, w, out)?;
        }
        Ok(())
    }

    /// Computes `out[n_rows, w.out_dim()] = x[n_rows, w.in_dim()] · W`; lengths that do
    /// not match the matrix are an error naming the argument.
    pub fn linear(
        self,
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("matmul input", x.len(), n_rows * w.in_dim())?;
        check_len("matmul output", out.len(), n_rows * w.out_dim())?;
        check_len("matmul weights", w.data.len(), w.rows * w.cols)?;
        if n_rows == 0 || w.rows == 0 || w.cols == 0 {
            out.fill(0.0);
            return Ok(());
        }
        check_quant(w)?;
        // Quantised weights run the way their format is meant to (activations to 8 bits,
        // integer block sums: `math::qmatmul::matmul`), on this process's bodies, unless
        // `MOEC_QUANT_PRODUCT=decoded` asks for f32 products of the decoded weights (the
        // portable panel, which decodes each panel with ggml's reference decoder).
        if let (Some(q), false) = (QuantMatrix::from_matrix(w), self.decodes_quant()) {
            QuantKernels::for_kernels(self).quant_linear(&q, x, n_rows, out)?;
            return Ok(());
        }
        // The decoded products read rows one at a time: Q4_K tiles (the CPU backend's
        // layout) are read back into ggml's rows first.
        if let TypedSlice::Quant(q) = w.data {
            if q.layout != crate::quant::BlockLayout::Rows {
                let plain = q.plain_bytes();
                let q = crate::quant::QuantSlice::new(&plain, q.format, q.len).map_err(|_| {
                    KernelError::QuantLayout {
                        format: q.format,
                        what: "in tiles that do not read back as whole rows",
                    }
                })?;
                let m = Matrix {
                    data: TypedSlice::Quant(q),
                    ..*w
                };
                return self.linear(x, n_rows, &m, out);
            }
        }
        match w.orientation {
            Orientation::OutIn => out_in(self, x, n_rows, w, out),
            Orientation::InOut => in_out(self.isa(), x, n_rows, w, out),
        }
        Ok(())
    }
}

/// Refuses quantised weights the products cannot read block by block: stored in-out
/// (GGUF stores every matrix out-in), or with rows that are not whole blocks.
fn check_quant(w: &Matrix<'_>) -> Result<(), KernelError> {
    let Some(format) = w.data.quant_format() else {
        return Ok(());
    };
    if w.orientation == Orientation::InOut {
        return Err(KernelError::QuantLayout {
            format,
            what: "in-out",
        });
    }
    if !w.cols.is_multiple_of(format.block_elems()) {
        return Err(KernelError::QuantLayout {
            format,
            what: "with rows that are not whole blocks",
        });
    }
    Ok(())
}

/// Which `OutIn` bodies (the projections of every model) an instruction set runs, by rows
/// per call, in words for the run report and `moec devices`.
pub fn bodies(isa: Isa) -> &'static str {
    match isa {
        Isa::Avx512 => {
            "matrix products: bf16 weights with 1-16 rows through the AVX-512 few-row kernel \
             (groups of up to 4 rows in one register block, each weight widened by one byte \
             shuffle, 16 rows prefetched ahead), 17+ rows or f16/f32 weights through 4 x 4 \
             register blocks"
        }
        Isa::Avx2 => {
            "matrix products: bf16 weights with 1-7 rows through the few-row kernel (each \
             weight loaded once for up to 4 rows, bf16 widened in registers, 16 rows \
             prefetched ahead), 8+ rows or f16/f32 weights through 2 x 3 register blocks"
        }
        Isa::Portable => "matrix products: plain loops",
    }
}

/// The activation rows of an `OutIn` product as the chosen body reads them.
enum Acts<'a> {
    /// Row-major, as given.
    Plain(&'a [f32]),
    /// Laid out for the few-row bf16 body (and as given, for a matrix of another dtype).
    #[cfg(target_arch = "x86_64")]
    EvenOdd(few_rows::EvenOddRows, &'a [f32]),
    /// Rounded to bf16 for the bf16 product (and as given, for a matrix of another dtype).
    Bf16(Bf16Rows, &'a [f32]),
}

/// Picks the body for `n_rows` rows of `w` (see [`bodies`]) and lays `x` out for it.
fn prepare<'a>(k: Kernels, x: &'a [f32], n_rows: usize, w: &Matrix<'_>) -> Acts<'a> {
    if k.bf16_dot() && matches!(w.data, TypedSlice::Bf16(_)) {
        return Acts::Bf16(Bf16Rows::new(x, n_rows, w.cols), x);
    }
    #[cfg(target_arch = "x86_64")]
    {
        let max = match k.isa() {
            Isa::Avx512 => few_rows512::MAX_ROWS,
            Isa::Avx2 => few_rows::MAX_ROWS,
            Isa::Portable => 0,
        };
        if k.few_rows() && n_rows <= max && matches!(w.data, TypedSlice::Bf16(_)) {
            return Acts::EvenOdd(few_rows::EvenOddRows::new(x, n_rows, w.cols), x);
        }
    }
    let _ = (k, n_rows, w);
    Acts::Plain(x)
}

/// Floating-point operations of one `linear` call (multiply and add counted apart).
pub fn linear_flops(n_rows: usize, w: &Matrix<'_>) -> u64 {
    2 * n_rows as u64 * w.rows as u64 * w.cols as u64
}

/// Runs `task(chunk_index, local_out)` over chunks, in parallel when the work is large.
fn for_chunks<F>(n_chunks: usize, work: usize, task: F) -> Vec<Vec<f32>>
where
    F: Fn(usize) -> Vec<f32> + Sync + Send,
{
    if work < PARALLEL_MIN_WORK || n_chunks == 1 {
        (0..n_chunks).map(task).collect()
    } else {
        (0..n_chunks).into_par_iter().map(task).collect()
    }
}

/// Rows `o0..o0 + rows` of an `OutIn` product into `local` (`[n_rows, rows]`).
///
/// The length checks of [`Kernels::linear`] have passed and `o0 + rows <= w.rows`.
fn out_in_rows(
    k: Kernels,
    acts: &Acts<'_>,
    n_rows: usize,
    w: &Matrix<'_>,
    o0: usize,
    rows: usize,
) -> Vec<f32> {
    let isa = k.isa();
    let mut local = vec![0.0f32; n_rows * rows];
    let x = match acts {
        Acts::Plain(x) => *x,
        Acts::Bf16(rows_bf, x) => {
            if let TypedSlice::Bf16(data) = w.data {
                let bits: &[u16] = bytemuck::cast_slice(data);
                bf16_dot::panel(k, rows_bf, bits, w.cols, o0, rows, &mut local);
                return local;
            }
            *x
        }
        #[cfg(target_arch = "x86_64")]
        Acts::EvenOdd(rows_eo, x) => {
            if let TypedSlice::Bf16(data) = w.data {
                let bits: &[u16] = bytemuck::cast_slice(data);
                // SAFETY: `prepare` chose these bodies only for AVX-512 or AVX2 (which a
                // `Kernels` value vouches this CPU has) and bf16 weights; `rows_eo` was
                // laid out from `n_rows` rows of `w.cols` values; o0 + rows <= w.rows and
                // `local` holds n_rows * rows values.
                unsafe {
                    match isa {
                        Isa::Avx512 => {
                            few_rows512::panel(rows_eo, bits, w.cols, o0, rows, &mut local)
                        }
                        _ => few_rows::panel(rows_eo, bits, w.cols, o0, rows, &mut local),
                    }
                };
                return local;
            }
            *x
        }
    };
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set is this CPU's (a `Kernels` invariant); the panel
        // and `x` bounds are those the kernel documents (rows o0..o0+rows of w, n_rows
        // rows of x of in_dim each), checked by `Kernels::linear`.
        Isa::Avx512 => unsafe { avx512::out_in_panel(x, n_rows, w, o0, rows, &mut local) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { avx2::out_in_panel(x, n_rows, w, o0, rows, &mut local) },
        _ => portable::out_in_panel(x, n_rows, w, o0, rows, &mut local),
    }
    local
}

/// Copies each panel's `[n_rows, rows]` block to its columns of `out` (`[n_rows, out_dim]`).
fn scatter_panels(panels: &[Vec<f32>], n_rows: usize, out_dim: usize, out: &mut [f32]) {
    for (p, local) in panels.iter().enumerate() {
        let o0 = p * PANEL_ROWS;
        let rows = local.len() / n_rows;
        for t in 0..n_rows {
            out[t * out_dim + o0..t * out_dim + o0 + rows]
                .copy_from_slice(&local[t * rows..(t + 1) * rows]);
        }
    }
}

/// The length checks of [`Kernels::linear`] have passed.
fn out_in(k: Kernels, x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    let (out_dim, in_dim) = (w.rows, w.cols);
    let n_panels = out_dim.div_ceil(PANEL_ROWS);
    let acts = prepare(k, x, n_rows, w);
    let panels = for_chunks(n_panels, n_rows * out_dim * in_dim, |p| {
        let o0 = p * PANEL_ROWS;
        out_in_rows(k, &acts, n_rows, w, o0, PANEL_ROWS.min(out_dim - o0))
    });
    scatter_panels(&panels, n_rows, out_dim, out);
}

impl Kernels {
    /// The gated projection of a SwiGLU-style FFN in one pass: `out[t, o] = act(x_t ·
    /// gate_o) * (x_t · up_o)` for `[out, in]` matrices of one shape. Each parallel task
    /// computes one panel of rows of both products while its activation rows are hot and
    /// applies `act` and the product there, so the FFN's two input projections cost one
    /// dispatch and no `[n_rows, out]` intermediate. Every element is exactly what
    /// [`Kernels::linear`] gives for each matrix, so `act(g) * u` has the bits of the
    /// unfused form; other orientations or shapes run as two `linear` calls.
    pub fn linear_gated(
        self,
        x: &[f32],
        n_rows: usize,
        gate: &Matrix<'_>,
        up: &Matrix<'_>,
        act: fn(f32) -> f32,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        // Quantised matrices go through their own products (both in one parallel region).
        let fused = gate.orientation == Orientation::OutIn
            && up.orientation == Orientation::OutIn
            && (gate.rows, gate.cols) == (up.rows, up.cols)
            && gate.data.quant_format().is_none()
            && up.data.quant_format().is_none();
        if !fused || n_rows == 0 || gate.rows == 0 || gate.cols == 0 {
            let mut u = vec![0.0f32; out.len()];
            self.linear_many(x, n_rows, &[gate, up], &mut [out, &mut u])?;
            for (g, u) in out.iter_mut().zip(&u) {
                *g = act(*g) * u;
            }
            return Ok(());
        }
        for w in [gate, up] {
            check_len("matmul input", x.len(), n_rows * w.in_dim())?;
            check_len("matmul output", out.len(), n_rows * w.out_dim())?;
            check_len("matmul weights", w.data.len(), w.rows * w.cols)?;
            check_quant(w)?;
        }
        let (out_dim, in_dim) = (gate.rows, gate.cols);
        let n_panels = out_dim.div_ceil(PANEL_ROWS);
        // Gate and up have one shape and dtype, so one layout serves both.
        let acts = prepare(self, x, n_rows, gate);
        let panels = for_chunks(n_panels, 2 * n_rows * out_dim * in_dim, |p| {
            let o0 = p * PANEL_ROWS;
            let rows = PANEL_ROWS.min(out_dim - o0);
            let mut g = out_in_rows(self, &acts, n_rows, gate, o0, rows);
            let u = out_in_rows(self, &acts, n_rows, up, o0, rows);
            for (g, u) in g.iter_mut().zip(&u) {
                *g = act(*g) * u;
            }
            g
        });
        scatter_panels(&panels, n_rows, out_dim, out);
        Ok(())
    }
}

/// As [`out_in`], for `[in, out]` matrices.
fn in_out(isa: Isa, x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    let (in_dim, out_dim) = (w.rows, w.cols);
    let n_bands = out_dim.div_ceil(BAND_COLS);
    let bands = for_chunks(n_bands, n_rows * out_dim * in_dim, |b| {
        let c0 = b * BAND_COLS;
        let width = BAND_COLS.min(out_dim - c0);
        let mut local = vec![0.0f32; n_rows * width];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the instruction set is this CPU's; columns c0..c0+width <= out_dim.
            Isa::Avx512 => unsafe { avx512::in_out_band(x, n_rows, w, c0, width, &mut local) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Isa::Avx2 => unsafe { avx2::in_out_band(x, n_rows, w, c0, width, &mut local) },
            _ => portable::in_out_band(x, n_rows, w, c0, width, &mut local),
        }
        local
    });
    for (b, local) in bands.iter().enumerate() {
        let c0 = b * BAND_COLS;
        let width = local.len() / n_rows;
        for t in 0..n_rows {
            out[t * out_dim + c0..t * out_dim + c0 + width]
                .copy_from_slice(&local[t * width..(t + 1) * width]);
        }
    }
}

/// Fallback with the same per-element structure (16 lanes, then a fixed reduction).
pub(super) mod portable {
    use super::*;

    fn widen_row(w: &Matrix<'_>, r: usize, buf: &mut [f32]) {
        Kernels::portable().widen(w.row(r), buf);
    }

    pub(super) fn out_in_panel(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        o0: usize,
        rows: usize,
        local: &mut [f32],
    ) {
        let in_dim = w.cols;
        let mut buf = vec![0.0f32; in_dim];
        for o in 0..rows {
            widen_row(w, o0 + o, &mut buf);
            for t in 0..n_rows {
                let xr = &x[t * in_dim..(t + 1) * in_dim];
                let mut lanes = [0.0f32; 16];
                for (k, (a, b)) in buf.iter().zip(xr).enumerate() {
                    lanes[k % 16] = a.mul_add(*b, lanes[k % 16]);
                }
                local[t * rows + o] = reduce16(&lanes);
            }
        }
    }

    /// Columns `c0..c0 + width` of the product into `local` (`[n_rows, width]`).
    pub(super) fn in_out_band(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        c0: usize,
        width: usize,
        local: &mut [f32],
    ) {
        in_out_cols(x, n_rows, w, c0, width, local, width, 0);
    }

    /// Columns `c0..c0 + width` of the product into `local` rows of `stride` values,
    /// starting at column `at` (the AVX2 body uses this for its last few columns).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn in_out_cols(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        c0: usize,
        width: usize,
        local: &mut [f32],
        stride: usize,
        at: usize,
    ) {
        let (in_dim, out_dim) = (w.rows, w.cols);
        let mut buf = vec![0.0f32; width];
        for i in 0..in_dim {
            Kernels::portable().widen(
                w.data.slice(i * out_dim + c0..i * out_dim + c0 + width),
                &mut buf,
            );
            for t in 0..n_rows {
                let a = x[t * in_dim + i];
                let dst = &mut local[t * stride + at..t * stride + at + width];
                for (o, b) in dst.iter_mut().zip(&buf) {
                    *o = a.mul_add(*b, *o);
                }
            }
        }
    }

    /// Lane `i` += lane `i + 8`, then `+ 4`, `+ 2`, `+ 1`: every body's reduction tree.
    pub(in crate::math) fn reduce16(l: &[f32; 16]) -> f32 {
        let mut v = *l;
        for half in [8, 4, 2, 1] {
            for i in 0..half {
                v[i] += v[i + half];
            }
        }
        v[0]
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2;

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn naive(
        x: &[f32],
        n_rows: usize,
        w: &[f32],
        rows: usize,
        cols: usize,
        orient: Orientation,
    ) -> Vec<f32> {
        let (in_dim, out_dim) = match orient {
            Orientation::OutIn => (cols, rows),
            Orientation::InOut => (rows, cols),
        };
        let mut out = vec![0.0; n_rows * out_dim];
        for t in 0..n_rows {
            for o in 0..out_dim {
                let mut s = 0.0f64;
                for i in 0..in_dim {
                    let wv = match orient {
                        Orientation::OutIn => w[o * cols + i],
                        Orientation::InOut => w[i * cols + o],
                    };
                    s += x[t * in_dim + i] as f64 * wv as f64;
                }
                out[t * out_dim + o] = s as f32;
            }
        }
        out
    }

    fn weights(rows: usize, cols: usize) -> (Vec<f32>, Vec<bf16>, Vec<f16>) {
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        (
            wf.clone(),
            wf.iter().map(|&v| bf16::from_f32(v)).collect(),
            wf.iter().map(|&v| f16::from_f32(v)).collect(),
        )
    }

    /// Every dtype and orientation, small and parallel sizes, odd shapes: agrees with a
    /// naive f64 product of the (rounded) weights.
    #[test]
    fn all_dtypes_and_orientations_match_naive_product() {
        for &(rows, cols) in &[(37usize, 29usize), (300, 260)] {
            let (wf, wb, wh) = weights(rows, cols);
            for orient in [Orientation::OutIn, Orientation::InOut] {
                for n_rows in [1usize, 3, 17] {
                    let in_dim = if orient == Orientation::OutIn {
                        cols
                    } else {
                        rows
                    };
                    let x: Vec<f32> = (0..n_rows * in_dim)
                        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                        .collect();
                    let cases = [
                        (TypedSlice::F32(&wf), wf.clone()),
                        (
                            TypedSlice::Bf16(&wb),
                            wb.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
                        ),
                        (
                            TypedSlice::F16(&wh),
                            wh.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
                        ),
                    ];
                    for (data, reference) in cases {
                        let m = Matrix::new(data, rows, cols, orient).unwrap();
                        let mut out = vec![0.0; n_rows * m.out_dim()];
                        linear(&x, n_rows, &m, &mut out).unwrap();
                        let want = naive(&x, n_rows, &reference, rows, cols, orient);
                        for (g, w) in out.iter().zip(&want) {
                            assert!(
                                (g - w).abs() < 1e-3 * (1.0 + w.abs()),
                                "{orient:?} {n_rows}x{rows}x{cols}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A row's result is bit-identical whether computed alone, in a split of 5 + 32, or
    /// in one call of 37 rows, for both orientations and a parallel-sized matrix.
    #[test]
    fn results_are_bit_identical_across_batch_splits() {
        for &(rows, cols) in &[(520usize, 300usize), (7, 33)] {
            let (_, wb, _) = weights(rows, cols);
            for orient in [Orientation::OutIn, Orientation::InOut] {
                let m = Matrix::new(TypedSlice::Bf16(&wb), rows, cols, orient).unwrap();
                let (in_dim, out_dim) = (m.in_dim(), m.out_dim());
                let x: Vec<f32> = (0..37 * in_dim)
                    .map(|i| ((i * 131) % 211) as f32 / 105.0 - 1.0)
                    .collect();
                let mut all = vec![0.0; 37 * out_dim];
                linear(&x, 37, &m, &mut all).unwrap();
                let mut split = vec![0.0; 37 * out_dim];
                linear(&x[..5 * in_dim], 5, &m, &mut split[..5 * out_dim]).unwrap();
                linear(&x[5 * in_dim..], 32, &m, &mut split[5 * out_dim..]).unwrap();
                assert_eq!(all, split, "{orient:?} split 5+32");
                for t in 0..37 {
                    let mut one = vec![0.0; out_dim];
                    linear(&x[t * in_dim..(t + 1) * in_dim], 1, &m, &mut one).unwrap();
                    assert_eq!(
                        &all[t * out_dim..(t + 1) * out_dim],
                        &one[..],
                        "{orient:?} row {t}"
                    );
                }
            }
        }
    }

    /// Every SIMD body gives the portable body's bits, for every dtype, orientation, ragged
    /// tails (in-dim and out-dim not multiples of 16) and row counts around the register
    /// blocks.
    #[test]
    fn simd_bodies_give_the_portable_bits() {
        use crate::math::isa::{Isa, Kernels};
        for &(rows, cols) in &[(37usize, 29usize), (70, 300), (9, 16)] {
            let (wf, wb, wh) = weights(rows, cols);
            for orient in [Orientation::OutIn, Orientation::InOut] {
                for n_rows in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 17] {
                    let m_in = if orient == Orientation::OutIn {
                        cols
                    } else {
                        rows
                    };
                    let x: Vec<f32> = (0..n_rows * m_in)
                        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                        .collect();
                    for data in [
                        TypedSlice::F32(&wf),
                        TypedSlice::Bf16(&wb),
                        TypedSlice::F16(&wh),
                    ] {
                        let m = Matrix::new(data, rows, cols, orient).unwrap();
                        let mut want = vec![0.0; n_rows * m.out_dim()];
                        Kernels::portable()
                            .linear(&x, n_rows, &m, &mut want)
                            .unwrap();
                        for isa in Isa::supported() {
                            let mut got = vec![0.0; n_rows * m.out_dim()];
                            Kernels::new(isa)
                                .unwrap()
                                .linear(&x, n_rows, &m, &mut got)
                                .unwrap();
                            let bits =
                                |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{isa} {orient:?} {n_rows}x{rows}x{cols} {:?}",
                                m.data.dtype()
                            );
                        }
                    }
                }
            }
        }
    }

    /// The few-row bodies (AVX-512 and AVX2, bf16) and the general register blocks give
    /// the portable body's bits at every row count from 1 to past the largest few-row
    /// bound, for widths that are odd, not a multiple of 16, a multiple of 16 but not of
    /// 32, and a single element; panels cut mid-block (37 and 70 weight rows), plain and
    /// gated.
    #[test]
    fn few_row_bodies_give_the_portable_bits_at_every_row_count() {
        use crate::math::isa::{Isa, Kernels};
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for &(rows, cols) in &[(37usize, 29usize), (70, 300), (9, 48), (11, 1), (5, 33)] {
            let (_, wb, _) = weights(rows, cols);
            let mut ub = wb.clone();
            ub.reverse();
            let m = Matrix::new(TypedSlice::Bf16(&wb), rows, cols, Orientation::OutIn).unwrap();
            let u = Matrix::new(TypedSlice::Bf16(&ub), rows, cols, Orientation::OutIn).unwrap();
            for n_rows in 1..=18usize {
                let x: Vec<f32> = (0..n_rows * cols)
                    .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                    .collect();
                let p = Kernels::portable();
                let mut want = vec![0.0; n_rows * rows];
                p.linear(&x, n_rows, &m, &mut want).unwrap();
                let mut want_gated = vec![0.0; n_rows * rows];
                p.linear_gated(&x, n_rows, &m, &u, double, &mut want_gated)
                    .unwrap();
                for isa in Isa::supported() {
                    let k = Kernels::new(isa).unwrap();
                    for k in [k, k.general_blocks()] {
                        let mut got = vec![0.0; n_rows * rows];
                        k.linear(&x, n_rows, &m, &mut got).unwrap();
                        let what = format!("{isa} few-row {} {n_rows}x{rows}x{cols}", k.few_rows());
                        assert_eq!(bits(&got), bits(&want), "{what}");
                        k.linear_gated(&x, n_rows, &m, &u, double, &mut got)
                            .unwrap();
                        assert_eq!(bits(&got), bits(&want_gated), "gated {what}");
                    }
                }
            }
        }
    }

    fn double(v: f32) -> f32 {
        2.0 * v
    }

    /// By hand: x = [1, 2], gate rows [1, 0] and [0, 2] give [1, 4]; up rows [3, 1] and
    /// [1, 1] give [5, 3]; act = 2v: out = [2 * 5, 8 * 3] = [10, 24].
    #[test]
    fn gated_projection_by_hand() {
        let (g, u) = ([1.0f32, 0.0, 0.0, 2.0], [3.0f32, 1.0, 1.0, 1.0]);
        let gate = Matrix::new(TypedSlice::F32(&g), 2, 2, Orientation::OutIn).unwrap();
        let up = Matrix::new(TypedSlice::F32(&u), 2, 2, Orientation::OutIn).unwrap();
        let mut out = vec![0.0; 2];
        Kernels::process()
            .linear_gated(&[1.0, 2.0], 1, &gate, &up, double, &mut out)
            .unwrap();
        assert_eq!(out, vec![10.0, 24.0]);
    }

    /// The fused gated projection gives, bit for bit, `act(linear(gate)) * linear(up)`
    /// for every instruction set, dtype, orientation (`InOut` takes the unfused path) and
    /// row counts around the register blocks, including more rows than one panel.
    #[test]
    fn gated_projection_has_the_unfused_bits() {
        use crate::math::isa::{Isa, Kernels};
        let (rows, cols) = (70usize, 45usize);
        let (wf, wb, _) = weights(rows, cols);
        // The same values in reverse order, so the two products differ.
        let (mut uf, mut ub, _) = weights(rows, cols);
        uf.reverse();
        ub.reverse();
        for orient in [Orientation::OutIn, Orientation::InOut] {
            for n_rows in [1usize, 2, 4, 8, 10] {
                for (gd, ud) in [
                    (TypedSlice::F32(&wf), TypedSlice::F32(&uf)),
                    (TypedSlice::Bf16(&wb), TypedSlice::Bf16(&ub)),
                ] {
                    let gate = Matrix::new(gd, rows, cols, orient).unwrap();
                    let up = Matrix::new(ud, rows, cols, orient).unwrap();
                    let x: Vec<f32> = (0..n_rows * gate.in_dim())
                        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                        .collect();
                    for isa in Isa::supported() {
                        let k = Kernels::new(isa).unwrap();
                        let mut want = vec![0.0; n_rows * gate.out_dim()];
                        let mut u = want.clone();
                        k.linear(&x, n_rows, &gate, &mut want).unwrap();
                        k.linear(&x, n_rows, &up, &mut u).unwrap();
                        for (g, u) in want.iter_mut().zip(&u) {
                            *g = double(*g) * u;
                        }
                        let mut got = vec![0.0; want.len()];
                        k.linear_gated(&x, n_rows, &gate, &up, double, &mut got)
                            .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{isa} {orient:?} {n_rows}");
                    }
                }
            }
        }
    }

    /// Inputs or outputs of the wrong length are an error naming the argument, in release
    /// builds too (never a silent no-op or an out-of-bounds read).
    #[test]
    fn mismatched_lengths_are_errors() {
        let w = vec![0.5f32; 6];
        let m = Matrix::new(TypedSlice::F32(&w), 2, 3, Orientation::OutIn).unwrap();
        let mut out = vec![0.0; 2];
        let err = linear(&[1.0; 4], 1, &m, &mut out).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("matmul input: expected 3 values, got 4"),
            "{err}"
        );
        let mut long = vec![0.0; 3];
        let err = linear(&[1.0; 3], 1, &m, &mut long).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("matmul output: expected 2 values, got 3"),
            "{err}"
        );
        linear(&[1.0; 3], 1, &m, &mut out).unwrap();
        assert_eq!(out, vec![1.5, 1.5]);
    }

    /// Quantised weights (every format, one block per row and several, panels split
    /// mid-way) multiply through `math::qmatmul::quant_linear` with the kernels' own body:
    /// the same bits as the portable body at every row count and instruction set, each
    /// row's result the same alone as in a batch (batch invariance), the gated form equal
    /// to `act(gate) * up` of two plain products, and within the 8-bit activation
    /// rounding of a naive f64 product of the decoded weights (each activation moves by at
    /// most half a step, `amax / 254`, so an output by at most `sum |w| * amax / 254`).
    #[test]
    fn quantised_products_are_the_quantised_bodies_products() {
        use crate::math::isa::{Isa, Kernels};
        use crate::math::qmatmul::{QuantKernels, QuantMatrix};
        use crate::quant::{random_blocks, QuantFormat, QuantSlice};
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for format in QuantFormat::ALL {
            for &(rows, blocks_per_row) in &[(3usize, 1usize), (70, 2)] {
                let cols = blocks_per_row * format.block_elems();
                let bytes = random_blocks(format, rows * blocks_per_row, rows as u64);
                let q = QuantSlice::new(&bytes, format, rows * cols).unwrap();
                let mut decoded = vec![0.0f32; rows * cols];
                q.dequantize_into(&mut decoded).unwrap();
                let m = Matrix::new(TypedSlice::Quant(q), rows, cols, Orientation::OutIn).unwrap();
                let qm = QuantMatrix::from_matrix(&m).unwrap();
                for n_rows in [1usize, 2, 5, 9] {
                    let x: Vec<f32> = (0..n_rows * cols)
                        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                        .collect();
                    let want_naive = naive(&x, n_rows, &decoded, rows, cols, Orientation::OutIn);
                    let mut portable = vec![0.0; n_rows * rows];
                    QuantKernels::for_kernels(Kernels::portable())
                        .quant_linear(&qm, &x, n_rows, &mut portable)
                        .unwrap();
                    for isa in Isa::supported() {
                        let k = Kernels::new(isa).unwrap();
                        let mut got = vec![0.0; n_rows * rows];
                        k.linear(&x, n_rows, &m, &mut got).unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&portable),
                            "{format} {isa} {n_rows}x{rows}x{cols}"
                        );
                        let last = n_rows - 1;
                        let mut alone = vec![0.0; rows];
                        k.linear(&x[last * cols..], 1, &m, &mut alone).unwrap();
                        assert_eq!(bits(&alone), bits(&got[last * rows..]), "batch invariance");
                        for t in 0..n_rows {
                            let row = &x[t * cols..(t + 1) * cols];
                            let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                            for o in 0..rows {
                                let w_abs: f32 = decoded[o * cols..(o + 1) * cols]
                                    .iter()
                                    .map(|w| w.abs())
                                    .sum();
                                let (g, n) = (got[t * rows + o], want_naive[t * rows + o]);
                                let bound = w_abs * amax / 254.0 * 1.01 + 1e-4 * (1.0 + n.abs());
                                assert!(
                                    (g - n).abs() <= bound,
                                    "{format}: {g} vs {n} (bound {bound})"
                                );
                            }
                        }
                        let silu = |v: f32| v / (1.0 + (-v).exp());
                        let mut gated = vec![0.0; n_rows * rows];
                        k.linear_gated(&x, n_rows, &m, &m, silu, &mut gated)
                            .unwrap();
                        let want: Vec<f32> = got.iter().map(|&g| silu(g) * g).collect();
                        assert_eq!(bits(&gated), bits(&want), "gated {format} {isa}");
                    }
                }
            }
        }
    }

    /// Quantised weights stored in-out, or with rows that are not whole blocks, are an
    /// error naming the format, never a panic.
    #[test]
    fn quantised_layouts_the_products_do_not_take_are_errors() {
        use crate::quant::{random_blocks, QuantFormat, QuantSlice};
        let bytes = random_blocks(QuantFormat::Q8_0, 4, 2);
        let q = QuantSlice::new(&bytes, QuantFormat::Q8_0, 128).unwrap();
        let in_out = Matrix {
            data: TypedSlice::Quant(q),
            rows: 4,
            cols: 32,
            orientation: Orientation::InOut,
        };
        let mut out = vec![0.0; 32];
        let err = linear(&[0.5; 4], 1, &in_out, &mut out).unwrap_err();
        assert!(
            err.to_string().contains("Q8_0 weights stored in-out"),
            "{err}"
        );
        assert!(Matrix::new(TypedSlice::Quant(q), 8, 16, Orientation::OutIn).is_none());
        let ragged = Matrix {
            data: TypedSlice::Quant(q),
            rows: 8,
            cols: 16,
            orientation: Orientation::OutIn,
        };
        let mut out = vec![0.0; 8];
        assert!(linear(&[0.5; 16], 1, &ragged, &mut out).is_err());
    }
}
