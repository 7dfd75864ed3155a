//! The AVX-512 bodies of the bf16/f16/f32 products (the register blocks `super` drives).

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
