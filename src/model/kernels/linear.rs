//! Matrix products of f32 activations with stored weights: `y = x Wᵀ` (`OutIn`) or
//! `y = x W` (`InOut`).
//!
//! Takes activations `[n_rows, in]` (f32, row-major) and a [`Matrix`] view in its stored
//! dtype; writes `[n_rows, out]`. Few rows (decode) go through a rayon row-parallel GEMV
//! that streams each weight row once and dots it with every activation row; more rows
//! (prefill, grouped experts) widen weight tiles to f32 and call `gemm` (AVX-512 kernels,
//! rayon). Both paths accumulate in f32; the choice depends only on the shape.

use crate::model::kernels::simd::{axpy, dot_rows};
use crate::model::tensor::{Matrix, Orientation, TypedSlice};
use gemm::{gemm, Parallelism};
use rayon::prelude::*;

/// Up to this many activation rows the GEMV path is used; above it, tiled `gemm`.
pub const GEMV_MAX_ROWS: usize = 16;

/// Below this many weight elements a product runs on the calling thread only.
const PARALLEL_MIN_ELEMS: usize = 1 << 16;

/// f32 elements in one widened weight tile handed to `gemm` (2 MiB, about an L2).
const TILE_ELEMS: usize = 1 << 19;

/// Weight rows per GEMV task.
const GEMV_ROWS_PER_TASK: usize = 16;

/// Output columns per task of the `InOut` GEMV.
const GEMV_COLS_PER_TASK: usize = 256;

/// Computes `out[n_rows, w.out_dim()] = x[n_rows, w.in_dim()] · W` (shape checked by the
/// caller; debug builds assert it).
pub fn linear(x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    debug_assert_eq!(x.len(), n_rows * w.in_dim());
    debug_assert_eq!(out.len(), n_rows * w.out_dim());
    if n_rows == 0 {
        return;
    }
    match (w.orientation, n_rows <= GEMV_MAX_ROWS) {
        (Orientation::OutIn, true) => gemv_out_in(x, n_rows, w, out),
        (Orientation::InOut, true) => gemv_in_out(x, n_rows, w, out),
        (Orientation::OutIn, false) => gemm_out_in(x, n_rows, w, out),
        (Orientation::InOut, false) => gemm_in_out(x, n_rows, w, out),
    }
}

/// Decode GEMV for `[out, in]` weights: each task owns a run of weight rows and produces
/// the transposed result for them, which is scattered into `out` afterwards.
fn gemv_out_in(x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    let (out_dim, in_dim) = (w.rows, w.cols);
    let mut out_t = vec![0.0f32; out_dim * n_rows];
    let task = |buf: &mut Vec<f32>, (chunk_idx, dst): (usize, &mut [f32])| {
        for (i, d) in dst.chunks_mut(n_rows).enumerate() {
            let row = chunk_idx * GEMV_ROWS_PER_TASK + i;
            match w.data {
                TypedSlice::F32(s) => dot_rows(&s[row * in_dim..(row + 1) * in_dim], x, in_dim, d),
                _ => {
                    w.row(row).widen_into(buf);
                    dot_rows(buf, x, in_dim, d);
                }
            }
        }
    };
    let chunks = out_t.chunks_mut(GEMV_ROWS_PER_TASK * n_rows).enumerate();
    if w.rows * w.cols < PARALLEL_MIN_ELEMS {
        let mut buf = vec![0.0; in_dim];
        chunks.for_each(|c| task(&mut buf, c));
    } else {
        out_t
            .par_chunks_mut(GEMV_ROWS_PER_TASK * n_rows)
            .enumerate()
            .for_each_init(|| vec![0.0; in_dim], task);
    }
    for t in 0..n_rows {
        let row = &mut out[t * out_dim..(t + 1) * out_dim];
        for (o, v) in row.iter_mut().enumerate() {
            *v = out_t[o * n_rows + t];
        }
    }
}

/// Decode GEMV for `[in, out]` weights: each task owns a band of output columns and
/// accumulates `x[t, i] * W[i, band]` over the input rows.
fn gemv_in_out(x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    let (in_dim, out_dim) = (w.rows, w.cols);
    let n_bands = out_dim.div_ceil(GEMV_COLS_PER_TASK);
    let band = |b: usize| -> Vec<f32> {
        let c0 = b * GEMV_COLS_PER_TASK;
        let c1 = (c0 + GEMV_COLS_PER_TASK).min(out_dim);
        let width = c1 - c0;
        let mut local = vec![0.0f32; n_rows * width];
        let mut buf = vec![0.0f32; width];
        for i in 0..in_dim {
            w.data.slice(i * out_dim + c0..i * out_dim + c1).widen_into(&mut buf);
            for t in 0..n_rows {
                axpy(x[t * in_dim + i], &buf, &mut local[t * width..(t + 1) * width]);
            }
        }
        local
    };
    let bands: Vec<Vec<f32>> = if w.rows * w.cols < PARALLEL_MIN_ELEMS {
        (0..n_bands).map(band).collect()
    } else {
        (0..n_bands).into_par_iter().map(band).collect()
    };
    for (b, local) in bands.iter().enumerate() {
        let c0 = b * GEMV_COLS_PER_TASK;
        let width = local.len() / n_rows;
        for t in 0..n_rows {
            out[t * out_dim + c0..t * out_dim + c0 + width].copy_from_slice(&local[t * width..(t + 1) * width]);
        }
    }
}

/// Widens `rows` stored rows starting at `first` into `tile` (row-major, f32).
fn widen_rows(w: &Matrix<'_>, first: usize, rows: usize, tile: &mut [f32]) {
    let cols = w.cols;
    let src = w.data.slice(first * cols..(first + rows) * cols);
    if rows * cols < PARALLEL_MIN_ELEMS {
        src.widen_into(tile);
    } else {
        tile.par_chunks_mut(cols)
            .enumerate()
            .for_each(|(r, dst)| src.slice(r * cols..(r + 1) * cols).widen_into(dst));
    }
}

fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    if m * n * k < 48 * 48 * 256 {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    }
}

/// Prefill GEMM for `[out, in]` weights: tiles of output rows, widened then multiplied.
fn gemm_out_in(x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    let (out_dim, in_dim) = (w.rows, w.cols);
    let tile_rows = (TILE_ELEMS / in_dim.max(1)).max(16).min(out_dim);
    let mut tile = match w.data {
        TypedSlice::F32(_) => Vec::new(),
        _ => vec![0.0f32; tile_rows * in_dim],
    };
    let mut o0 = 0;
    while o0 < out_dim {
        let rows = tile_rows.min(out_dim - o0);
        let rhs: &[f32] = match w.data {
            TypedSlice::F32(s) => &s[o0 * in_dim..(o0 + rows) * in_dim],
            _ => {
                widen_rows(w, o0, rows, &mut tile[..rows * in_dim]);
                &tile[..rows * in_dim]
            }
        };
        // SAFETY: dst covers out[t * out_dim + o0 + j] for t < n_rows, j < rows, all inside
        // `out` (len n_rows * out_dim, o0 + rows <= out_dim); lhs reads x[t * in_dim + k]
        // (len n_rows * in_dim); rhs reads rhs[j * in_dim + k] (len rows * in_dim). The
        // three regions do not overlap (distinct allocations), as gemm requires.
        unsafe {
            gemm(
                n_rows,
                rows,
                in_dim,
                out.as_mut_ptr().add(o0),
                1,
                out_dim as isize,
                false,
                x.as_ptr(),
                1,
                in_dim as isize,
                rhs.as_ptr(),
                in_dim as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism(n_rows, rows, in_dim),
            );
        }
        o0 += rows;
    }
}

/// Prefill GEMM for `[in, out]` weights: tiles of input rows, accumulated into `out`.
fn gemm_in_out(x: &[f32], n_rows: usize, w: &Matrix<'_>, out: &mut [f32]) {
    let (in_dim, out_dim) = (w.rows, w.cols);
    let tile_rows = (TILE_ELEMS / out_dim.max(1)).max(16).min(in_dim);
    let mut tile = match w.data {
        TypedSlice::F32(_) => Vec::new(),
        _ => vec![0.0f32; tile_rows * out_dim],
    };
    let mut k0 = 0;
    while k0 < in_dim {
        let rows = tile_rows.min(in_dim - k0);
        let rhs: &[f32] = match w.data {
            TypedSlice::F32(s) => &s[k0 * out_dim..(k0 + rows) * out_dim],
            _ => {
                widen_rows(w, k0, rows, &mut tile[..rows * out_dim]);
                &tile[..rows * out_dim]
            }
        };
        // SAFETY: dst is all of `out` (n_rows x out_dim, row stride out_dim); lhs reads
        // x[t * in_dim + k0 + k] for k < rows (k0 + rows <= in_dim); rhs reads
        // rhs[k * out_dim + j] (len rows * out_dim). No overlap between them.
        unsafe {
            gemm(
                n_rows,
                out_dim,
                rows,
                out.as_mut_ptr(),
                1,
                out_dim as isize,
                k0 > 0,
                x.as_ptr().add(k0),
                1,
                in_dim as isize,
                rhs.as_ptr(),
                1,
                out_dim as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism(n_rows, out_dim, rows),
            );
        }
        k0 += rows;
    }
}

/// Floating-point operations of one `linear` call (multiply and add counted apart).
pub fn linear_flops(n_rows: usize, w: &Matrix<'_>) -> u64 {
    2 * n_rows as u64 * w.rows as u64 * w.cols as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn naive(x: &[f32], n_rows: usize, w: &[f32], rows: usize, cols: usize, orient: Orientation) -> Vec<f32> {
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

    /// Every path (GEMV/GEMM x orientation x bf16/f32, small and parallel sizes) agrees
    /// with a naive f64 product.
    #[test]
    fn all_paths_match_naive_product() {
        for &(rows, cols) in &[(37usize, 29usize), (300, 260)] {
            let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb_f: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            for orient in [Orientation::OutIn, Orientation::InOut] {
                for n_rows in [1usize, 3, 16, 17, 40] {
                    let in_dim = if orient == Orientation::OutIn { cols } else { rows };
                    let x: Vec<f32> = (0..n_rows * in_dim).map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5).collect();
                    for (data, reference) in [(TypedSlice::F32(&wf), &wf), (TypedSlice::Bf16(&wb), &wb_f)] {
                        let m = Matrix::new(data, rows, cols, orient).unwrap();
                        let mut out = vec![0.0; n_rows * m.out_dim()];
                        linear(&x, n_rows, &m, &mut out);
                        let want = naive(&x, n_rows, reference, rows, cols, orient);
                        for (g, w) in out.iter().zip(&want) {
                            assert!((g - w).abs() < 1e-3 * (1.0 + w.abs()), "{orient:?} {n_rows}x{rows}x{cols}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }
}
