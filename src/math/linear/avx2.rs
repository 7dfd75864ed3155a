//! The AVX2 + FMA bodies of the bf16/f16/f32 products (the register blocks `super`
//! drives), and the horizontal reduction the bf16 dot bodies share.

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
                    local[(t0 + j) * out.stride + out.col0 + o + i] = reduce(lo[i][j], hi[i][j]);
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
