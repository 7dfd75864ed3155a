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
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    // Every helper that calls an intrinsic carries the same `target_feature`s as its
    // callers so that LLVM inlines the intrinsics (a closure or a helper without them
    // would turn each intrinsic into a call).
    const BF16: u8 = 0;
    const F16: u8 = 1;
    const F32: u8 = 2;

    /// Loads 16 (masked) weights starting at element `idx` of `base` as f32.
    ///
    /// # Safety
    /// The unmasked lanes must be in bounds (masked-off lanes are never accessed: AVX-512
    /// masked loads suppress faults).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    unsafe fn load_w<const DT: u8>(base: *const u8, idx: usize, mask: __mmask16) -> __m512 {
        // SAFETY: per the function contract.
        unsafe {
            match DT {
                BF16 => {
                    let raw = _mm256_maskz_loadu_epi16(mask, base.add(idx * 2) as *const i16);
                    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
                }
                F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                    mask,
                    base.add(idx * 2) as *const i16,
                )),
                _ => _mm512_maskz_loadu_ps(mask, base.add(idx * 4) as *const f32),
            }
        }
    }

    fn base(w: &Matrix<'_>) -> *const u8 {
        match w.data {
            TypedSlice::Bf16(s) => s.as_ptr() as *const u8,
            TypedSlice::F16(s) => s.as_ptr() as *const u8,
            TypedSlice::F32(s) => s.as_ptr() as *const u8,
            // Never read as typed elements: `Kernels::linear` sends quantised weights to
            // `quant_linear` (out-in) or refuses them (in-out) before any body runs.
            TypedSlice::Quant(q) => q.bytes.as_ptr(),
        }
    }

    fn mask_for(remaining: usize) -> __mmask16 {
        if remaining >= 16 {
            0xFFFF
        } else {
            ((1u32 << remaining) - 1) as __mmask16
        }
    }

    /// Fixed pairwise reduction of the 16 lanes: lane i += lane i+8, then i+4, i+2, i+1
    /// (the same tree as the portable fallback).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    #[inline]
    fn reduce(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    /// # Safety
    /// avx512f/bw/vl available; `x` holds `n_rows * w.cols` values; `o0 + rows <= w.rows`;
    /// `local` holds `n_rows * rows` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn out_in_panel(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        o0: usize,
        rows: usize,
        local: &mut [f32],
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match w.data {
                TypedSlice::Bf16(_) => out_in_panel_t::<BF16>(x, n_rows, w, o0, rows, local),
                TypedSlice::F16(_) => out_in_panel_t::<F16>(x, n_rows, w, o0, rows, local),
                TypedSlice::F32(_) => out_in_panel_t::<F32>(x, n_rows, w, o0, rows, local),
                // `Kernels::linear` sends quantised matrices to `quant_linear` before
                // any body; the portable body gives the same bits if one ever arrives.
                TypedSlice::Quant(_) => portable::out_in_panel(x, n_rows, w, o0, rows, local),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn out_in_panel_t<const DT: u8>(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        o0: usize,
        rows: usize,
        local: &mut [f32],
    ) {
        let k_len = w.cols;
        let wb = base(w);
        let xp = x.as_ptr();
        let mut t0 = 0;
        while t0 < n_rows {
            // Rows past the end repeat the last row: same arithmetic, results discarded.
            let x0 = t0.min(n_rows - 1) * k_len;
            let x1 = (t0 + 1).min(n_rows - 1) * k_len;
            let x2 = (t0 + 2).min(n_rows - 1) * k_len;
            let x3 = (t0 + 3).min(n_rows - 1) * k_len;
            let mut o = 0;
            while o < rows {
                let w0 = (o0 + o) * k_len;
                let w1 = (o0 + (o + 1).min(rows - 1)) * k_len;
                let w2 = (o0 + (o + 2).min(rows - 1)) * k_len;
                let w3 = (o0 + (o + 3).min(rows - 1)) * k_len;
                let z = _mm512_setzero_ps();
                let (mut a00, mut a01, mut a02, mut a03) = (z, z, z, z);
                let (mut a10, mut a11, mut a12, mut a13) = (z, z, z, z);
                let (mut a20, mut a21, mut a22, mut a23) = (z, z, z, z);
                let (mut a30, mut a31, mut a32, mut a33) = (z, z, z, z);
                let mut k = 0;
                while k < k_len {
                    let m = mask_for(k_len - k);
                    // SAFETY: lanes k..k+16 are masked to < k_len inside rows of x and w.
                    unsafe {
                        let v0 = _mm512_maskz_loadu_ps(m, xp.add(x0 + k));
                        let v1 = _mm512_maskz_loadu_ps(m, xp.add(x1 + k));
                        let v2 = _mm512_maskz_loadu_ps(m, xp.add(x2 + k));
                        let v3 = _mm512_maskz_loadu_ps(m, xp.add(x3 + k));
                        let w = load_w::<DT>(wb, w0 + k, m);
                        a00 = _mm512_fmadd_ps(w, v0, a00);
                        a01 = _mm512_fmadd_ps(w, v1, a01);
                        a02 = _mm512_fmadd_ps(w, v2, a02);
                        a03 = _mm512_fmadd_ps(w, v3, a03);
                        let w = load_w::<DT>(wb, w1 + k, m);
                        a10 = _mm512_fmadd_ps(w, v0, a10);
                        a11 = _mm512_fmadd_ps(w, v1, a11);
                        a12 = _mm512_fmadd_ps(w, v2, a12);
                        a13 = _mm512_fmadd_ps(w, v3, a13);
                        let w = load_w::<DT>(wb, w2 + k, m);
                        a20 = _mm512_fmadd_ps(w, v0, a20);
                        a21 = _mm512_fmadd_ps(w, v1, a21);
                        a22 = _mm512_fmadd_ps(w, v2, a22);
                        a23 = _mm512_fmadd_ps(w, v3, a23);
                        let w = load_w::<DT>(wb, w3 + k, m);
                        a30 = _mm512_fmadd_ps(w, v0, a30);
                        a31 = _mm512_fmadd_ps(w, v1, a31);
                        a32 = _mm512_fmadd_ps(w, v2, a32);
                        a33 = _mm512_fmadd_ps(w, v3, a33);
                    }
                    k += 16;
                }
                let acc = [
                    [a00, a01, a02, a03],
                    [a10, a11, a12, a13],
                    [a20, a21, a22, a23],
                    [a30, a31, a32, a33],
                ];
                for (oi, acc_row) in acc.iter().enumerate() {
                    if o + oi >= rows {
                        break;
                    }
                    for (ti, a) in acc_row.iter().enumerate() {
                        if t0 + ti >= n_rows {
                            break;
                        }
                        local[(t0 + ti) * rows + o + oi] = reduce(*a);
                    }
                }
                o += 4;
            }
            t0 += 4;
        }
    }

    /// # Safety
    /// avx512f/bw/vl available; `x` holds `n_rows * w.rows` values; `c0 + width <= w.cols`;
    /// `local` holds `n_rows * width` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn in_out_band(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        c0: usize,
        width: usize,
        local: &mut [f32],
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match w.data {
                TypedSlice::Bf16(_) => in_out_band_t::<BF16>(x, n_rows, w, c0, width, local),
                TypedSlice::F16(_) => in_out_band_t::<F16>(x, n_rows, w, c0, width, local),
                TypedSlice::F32(_) => in_out_band_t::<F32>(x, n_rows, w, c0, width, local),
                // `Kernels::linear` refuses quantised in-out matrices before any body.
                TypedSlice::Quant(_) => portable::in_out_band(x, n_rows, w, c0, width, local),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn in_out_band_t<const DT: u8>(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        c0: usize,
        width: usize,
        local: &mut [f32],
    ) {
        let (in_dim, out_dim) = (w.rows, w.cols);
        let wb = base(w);
        let xp = x.as_ptr();
        let mut c = 0;
        while c < width {
            let m0 = mask_for(width - c);
            let m1 = mask_for((width - c).saturating_sub(16));
            let mut t0 = 0;
            while t0 < n_rows {
                let x0 = t0.min(n_rows - 1) * in_dim;
                let x1 = (t0 + 1).min(n_rows - 1) * in_dim;
                let x2 = (t0 + 2).min(n_rows - 1) * in_dim;
                let x3 = (t0 + 3).min(n_rows - 1) * in_dim;
                let z = _mm512_setzero_ps();
                let (mut a00, mut a01, mut a10, mut a11) = (z, z, z, z);
                let (mut a20, mut a21, mut a30, mut a31) = (z, z, z, z);
                for i in 0..in_dim {
                    // SAFETY: row i < in_dim; columns c0+c..c0+c+32 masked to < c0+width;
                    // x offsets are rows < n_rows of length in_dim.
                    unsafe {
                        let w0 = load_w::<DT>(wb, i * out_dim + c0 + c, m0);
                        let w1 = load_w::<DT>(wb, i * out_dim + c0 + c + 16, m1);
                        let b = _mm512_set1_ps(*xp.add(x0 + i));
                        a00 = _mm512_fmadd_ps(b, w0, a00);
                        a01 = _mm512_fmadd_ps(b, w1, a01);
                        let b = _mm512_set1_ps(*xp.add(x1 + i));
                        a10 = _mm512_fmadd_ps(b, w0, a10);
                        a11 = _mm512_fmadd_ps(b, w1, a11);
                        let b = _mm512_set1_ps(*xp.add(x2 + i));
                        a20 = _mm512_fmadd_ps(b, w0, a20);
                        a21 = _mm512_fmadd_ps(b, w1, a21);
                        let b = _mm512_set1_ps(*xp.add(x3 + i));
                        a30 = _mm512_fmadd_ps(b, w0, a30);
                        a31 = _mm512_fmadd_ps(b, w1, a31);
                    }
                }
                let acc = [[a00, a01], [a10, a11], [a20, a21], [a30, a31]];
                for (ti, a) in acc.iter().enumerate() {
                    if t0 + ti >= n_rows {
                        break;
                    }
                    let dst = &mut local[(t0 + ti) * width + c..];
                    // SAFETY: masked stores write only columns < width of this row.
                    unsafe {
                        _mm512_mask_storeu_ps(dst.as_mut_ptr(), m0, a[0]);
                        if m1 != 0 {
                            _mm512_mask_storeu_ps(dst.as_mut_ptr().add(16), m1, a[1]);
                        }
                    }
                }
                t0 += 4;
            }
            c += 32;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    // Every helper that calls an intrinsic carries the callers' `target_feature`s so LLVM
    // inlines the intrinsics. A 16-lane accumulator of the portable body is two 8-lane
    // registers here (lanes 0..8 and 8..16), so each output element sees the same
    // additions in the same order.
    const BF16: u8 = 0;
    const F16: u8 = 1;
    const F32: u8 = 2;

    /// Loads 8 weights starting at element `idx` of `base` as f32.
    ///
    /// # Safety
    /// Elements `idx..idx + 8` must be in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<const DT: u8>(base: *const u8, idx: usize) -> __m256 {
        // SAFETY: per the function contract.
        unsafe {
            match DT {
                BF16 => {
                    let raw = _mm_loadu_si128(base.add(idx * 2) as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
                }
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(base.add(idx * 2) as *const __m128i)),
                _ => _mm256_loadu_ps(base.add(idx * 4) as *const f32),
            }
        }
    }

    fn base(w: &Matrix<'_>) -> *const u8 {
        match w.data {
            TypedSlice::Bf16(s) => s.as_ptr() as *const u8,
            TypedSlice::F16(s) => s.as_ptr() as *const u8,
            TypedSlice::F32(s) => s.as_ptr() as *const u8,
            // Never read as typed elements: `Kernels::linear` sends quantised weights to
            // `quant_linear` (out-in) or refuses them (in-out) before any body runs.
            TypedSlice::Quant(q) => q.bytes.as_ptr(),
        }
    }

    /// The portable body's reduction tree over lanes `lo` (0..8) and `hi` (8..16).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(in crate::math) fn reduce(lo: __m256, hi: __m256) -> f32 {
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    /// Weight rows widened to f32 at a time when many activation rows share them (a block
    /// that stays in L2 while every activation row streams past it).
    const WIDEN_ROWS: usize = 16;

    /// Activation rows from which widening a weight block once beats converting bf16/f16
    /// in every register block.
    const WIDEN_MIN_ROWS: usize = 8;

    /// # Safety
    /// avx2, fma and f16c available; `x` holds `n_rows * w.cols` values; `o0 + rows <=
    /// w.rows`; `w.data` holds `w.rows * w.cols` values; `local` holds `n_rows * rows`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn out_in_panel(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        o0: usize,
        rows: usize,
        local: &mut [f32],
    ) {
        let k_len = w.cols;
        let out = Out {
            stride: rows,
            col0: 0,
        };
        let block = Block { r0: o0, rows };
        // SAFETY: forwarded contract; every block below lies inside the checked panel.
        unsafe {
            match w.data {
                TypedSlice::F32(_) => blocked::<F32>(x, n_rows, w.data, k_len, block, local, out),
                // bf16 below `WIDEN_MIN_ROWS` rows runs the few-row body (see `prepare`).
                TypedSlice::F16(_) if n_rows < WIDEN_MIN_ROWS => {
                    blocked::<F16>(x, n_rows, w.data, k_len, block, local, out)
                }
                _ => {
                    // Widening is exact, so the f32 body gives the same bits.
                    let mut wide = vec![0.0f32; WIDEN_ROWS * k_len];
                    let mut b0 = 0;
                    while b0 < rows {
                        let n = WIDEN_ROWS.min(rows - b0);
                        let src = w.data.slice((o0 + b0) * k_len..(o0 + b0 + n) * k_len);
                        Kernels::new(Isa::Avx2)
                            .unwrap_or(Kernels::portable())
                            .widen(src, &mut wide[..n * k_len]);
                        let out = Out {
                            stride: rows,
                            col0: b0,
                        };
                        blocked::<F32>(
                            x,
                            n_rows,
                            TypedSlice::F32(&wide[..n * k_len]),
                            k_len,
                            Block { r0: 0, rows: n },
                            local,
                            out,
                        );
                        b0 += n;
                    }
                }
            }
        }
    }

    /// Every activation row through the register blocks that fit it: 2 weight rows x 3
    /// activation rows while three or more rows remain, then one 2 x 2 or 4 x 1 pass for the
    /// last two or one (a 2 x 3 block over one or two rows would compute rows only to
    /// discard them: a third to two thirds of a decode step's expert work at 4 rows per
    /// expert). Every block sums each element in the same order, so the bits do not
    /// depend on this choice.
    ///
    /// # Safety
    /// As [`panel`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn blocked<const DT: u8>(
        x: &[f32],
        n_rows: usize,
        wdata: TypedSlice<'_>,
        k_len: usize,
        b: Block,
        local: &mut [f32],
        out: Out,
    ) {
        let main = n_rows / 3 * 3;
        // SAFETY: forwarded contract; each call covers a sub-range of 0..n_rows.
        unsafe {
            if main > 0 {
                panel::<DT, 2, 3>(x, 0..main, wdata, k_len, b, local, out);
            }
            match n_rows - main {
                2 => panel::<DT, 2, 2>(x, main..n_rows, wdata, k_len, b, local, out),
                1 => panel::<DT, 4, 1>(x, main..n_rows, wdata, k_len, b, local, out),
                _ => {}
            }
        }
    }

    /// Stored bf16/f16 rows ahead of the ones being multiplied that each block prefetches
    /// at the same column: the hardware prefetcher alone kept the decode GEMV at 13-17
    /// GB/s on the 2-core EPYC of docs/performance.md, 16 rows ahead at 17-20 GB/s
    /// (streaming read 21.7 GB/s; 5 alternating runs each). Widened f32 blocks sit in L2.
    const PREFETCH_ROWS: usize = 16;

    /// Which stored rows a register-blocked pass reads.
    #[derive(Clone, Copy)]
    struct Block {
        r0: usize,
        rows: usize,
    }

    /// Where a pass writes: `local[t * stride + col0 + o]` for activation row `t` and
    /// block row `o`.
    #[derive(Clone, Copy)]
    struct Out {
        stride: usize,
        col0: usize,
    }

    /// `WR` weight rows x `XR` activation rows per register block (`2 * WR * XR`
    /// accumulators) over the activation rows `t_rows`; rows past the end repeat the last
    /// one (results discarded).
    ///
    /// # Safety
    /// avx2, fma and f16c available; `w` holds rows `b.r0 .. b.r0 + b.rows` of `k_len`
    /// values; `x` holds `t_rows.end * k_len`; `t_rows` is not empty; `local` holds index
    /// `(t_rows.end - 1) * out.stride + out.col0 + b.rows - 1`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn panel<const DT: u8, const WR: usize, const XR: usize>(
        x: &[f32],
        t_rows: std::ops::Range<usize>,
        wdata: TypedSlice<'_>,
        k_len: usize,
        b: Block,
        local: &mut [f32],
        out: Out,
    ) {
        let (o0, rows) = (b.r0, b.rows);
        let full = k_len / 16 * 16;
        let wb = match wdata {
            TypedSlice::Bf16(s) => s.as_ptr() as *const u8,
            TypedSlice::F16(s) => s.as_ptr() as *const u8,
            TypedSlice::F32(s) => s.as_ptr() as *const u8,
            // Not reached: see `base`.
            TypedSlice::Quant(q) => q.bytes.as_ptr(),
        };
        let xp = x.as_ptr();
        let n_rows = t_rows.end;
        let ahead = PREFETCH_ROWS * k_len;
        let mut t0 = t_rows.start;
        while t0 < n_rows {
            let mut xo = [0usize; XR];
            for (j, o) in xo.iter_mut().enumerate() {
                *o = (t0 + j).min(n_rows - 1) * k_len;
            }
            let mut o = 0;
            while o < rows {
                let mut wo = [0usize; WR];
                for (i, r) in wo.iter_mut().enumerate() {
                    *r = (o0 + (o + i).min(rows - 1)) * k_len;
                }
                let z = _mm256_setzero_ps();
                let mut lo = [[z; XR]; WR];
                let mut hi = [[z; XR]; WR];
                let mut k = 0;
                while k < full {
                    // SAFETY: k + 16 <= full <= k_len, inside rows of x and w.
                    unsafe {
                        if DT != F32 {
                            for r in wo {
                                // A hint only: an address past the matrix is never read.
                                _mm_prefetch::<_MM_HINT_T0>(
                                    wb.wrapping_add((r + ahead + k) * 2) as *const i8
                                );
                            }
                        }
                        let mut xl = [z; XR];
                        for j in 0..XR {
                            xl[j] = _mm256_loadu_ps(xp.add(xo[j] + k));
                        }
                        for i in 0..WR {
                            let wv = load8::<DT>(wb, wo[i] + k);
                            for j in 0..XR {
                                lo[i][j] = _mm256_fmadd_ps(wv, xl[j], lo[i][j]);
                            }
                        }
                        for j in 0..XR {
                            xl[j] = _mm256_loadu_ps(xp.add(xo[j] + k + 8));
                        }
                        for i in 0..WR {
                            let wv = load8::<DT>(wb, wo[i] + k + 8);
                            for j in 0..XR {
                                hi[i][j] = _mm256_fmadd_ps(wv, xl[j], hi[i][j]);
                            }
                        }
                    }
                    k += 16;
                }
                if full < k_len {
                    // The ragged tail through zero-padded copies: lanes past `k_len` add
                    // 0 * 0, which leaves an accumulator's bits unchanged.
                    let tail = k_len - full;
                    let mut xbuf = [[0.0f32; 16]; XR];
                    for (j, b) in xbuf.iter_mut().enumerate() {
                        b[..tail].copy_from_slice(&x[xo[j] + full..xo[j] + k_len]);
                    }
                    for i in 0..WR {
                        let mut wbuf = [0.0f32; 16];
                        Kernels::portable()
                            .widen(wdata.slice(wo[i] + full..wo[i] + k_len), &mut wbuf[..tail]);
                        // SAFETY: both buffers hold 16 values.
                        unsafe {
                            let (w0, w1) = (
                                _mm256_loadu_ps(wbuf.as_ptr()),
                                _mm256_loadu_ps(wbuf.as_ptr().add(8)),
                            );
                            for j in 0..XR {
                                let (x0, x1) = (
                                    _mm256_loadu_ps(xbuf[j].as_ptr()),
                                    _mm256_loadu_ps(xbuf[j].as_ptr().add(8)),
                                );
                                lo[i][j] = _mm256_fmadd_ps(w0, x0, lo[i][j]);
                                hi[i][j] = _mm256_fmadd_ps(w1, x1, hi[i][j]);
                            }
                        }
                    }
                }
                for i in 0..WR {
                    if o + i >= rows {
                        break;
                    }
                    for j in 0..XR {
                        if t0 + j >= n_rows {
                            break;
                        }
                        local[(t0 + j) * out.stride + out.col0 + o + i] =
                            reduce(lo[i][j], hi[i][j]);
                    }
                }
                o += WR;
            }
            t0 += XR;
        }
    }

    /// # Safety
    /// avx2, fma and f16c available; `x` holds `n_rows * w.rows` values; `c0 + width <=
    /// w.cols`; `w.data` holds `w.rows * w.cols` values; `local` holds `n_rows * width`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn in_out_band(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        c0: usize,
        width: usize,
        local: &mut [f32],
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            match w.data {
                TypedSlice::Bf16(_) => in_out_band_t::<BF16>(x, n_rows, w, c0, width, local),
                TypedSlice::F16(_) => in_out_band_t::<F16>(x, n_rows, w, c0, width, local),
                TypedSlice::F32(_) => in_out_band_t::<F32>(x, n_rows, w, c0, width, local),
                // `Kernels::linear` refuses quantised in-out matrices before any body.
                TypedSlice::Quant(_) => portable::in_out_band(x, n_rows, w, c0, width, local),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn in_out_band_t<const DT: u8>(
        x: &[f32],
        n_rows: usize,
        w: &Matrix<'_>,
        c0: usize,
        width: usize,
        local: &mut [f32],
    ) {
        let (in_dim, out_dim) = (w.rows, w.cols);
        let wb = base(w);
        let xp = x.as_ptr();
        let full = width / 16 * 16;
        let mut c = 0;
        while c < full {
            let mut t0 = 0;
            while t0 < n_rows {
                let xo = [
                    t0.min(n_rows - 1) * in_dim,
                    (t0 + 1).min(n_rows - 1) * in_dim,
                    (t0 + 2).min(n_rows - 1) * in_dim,
                    (t0 + 3).min(n_rows - 1) * in_dim,
                ];
                let z = _mm256_setzero_ps();
                let mut acc = [[z; 2]; 4];
                for i in 0..in_dim {
                    // SAFETY: row i < in_dim; columns c0+c..c0+c+16 <= c0+width <= out_dim;
                    // x offsets are rows < n_rows of length in_dim.
                    unsafe {
                        let w0 = load8::<DT>(wb, i * out_dim + c0 + c);
                        let w1 = load8::<DT>(wb, i * out_dim + c0 + c + 8);
                        for (j, a) in acc.iter_mut().enumerate() {
                            let b = _mm256_set1_ps(*xp.add(xo[j] + i));
                            a[0] = _mm256_fmadd_ps(b, w0, a[0]);
                            a[1] = _mm256_fmadd_ps(b, w1, a[1]);
                        }
                    }
                }
                for (j, a) in acc.iter().enumerate() {
                    if t0 + j >= n_rows {
                        break;
                    }
                    let dst = &mut local[(t0 + j) * width + c..(t0 + j) * width + c + 16];
                    // SAFETY: `dst` holds 16 values.
                    unsafe {
                        _mm256_storeu_ps(dst.as_mut_ptr(), a[0]);
                        _mm256_storeu_ps(dst.as_mut_ptr().add(8), a[1]);
                    }
                }
                t0 += 4;
            }
            c += 16;
        }
        if full < width {
            // The last few columns: same sequential fused sums, scalar.
            portable::in_out_cols(x, n_rows, w, c0 + full, width - full, local, width, full);
        }
    }
}

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
