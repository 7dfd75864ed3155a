//! The `vdpbf16ps` body of the bf16 product ([`super::bf16_dot`]): AVX-512 BF16.
//!
//! A 32-block of bf16 weights is one 512-bit load used as it is stored (no widening), and
//! one `vdpbf16ps` multiplies it by a 32-block of the bf16 activation rows and adds the
//! pairs to 16 f32 lanes: twice the multiply-adds of an f32 FMA per instruction, and half
//! the activation bytes. Register blocks as the AVX-512 few-row body's (8 weight rows x 1
//! or 2 activation rows, 4 x 3, 4 x 4: 8 to 16 accumulators), at every row count; the
//! weight rows 16 rows ahead are prefetched at every block (the decode GEMV streams them).
//!
//! Guarantees: each accumulator lane is the product's lane `j` (the instruction's own
//! order), the ragged last block is zero-padded, and the lanes are reduced with
//! `linear`'s tree, so the bits are those of the portable body.

use super::bf16_dot::{block_of, for_blocks, store_block, Bf16Rows, Ctx, BLOCK};
use super::linear::avx2::reduce;
use std::arch::x86_64::*;

/// Activation rows one register block takes at most.
const GROUP_ROWS: usize = 4;

/// Weight rows ahead that each block prefetches (as the few-row bodies).
const PREFETCH_ROWS: usize = 16;

/// Rows `o0..o0 + rows` of `w` times every row of `x` into `local[t * rows + o]`.
///
/// # Safety
/// AVX-512F/BW/VL and AVX-512 BF16 available; `w.len() >= (o0 + rows) * k_len`; `x` was
/// laid out for `k_len`; `local.len() >= x.n_rows() * rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn panel(
    x: &Bf16Rows,
    w: &[u16],
    k_len: usize,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let ctx = Ctx::new(x, w, k_len);
    let block_rows = |xr: usize| if xr <= 2 { 8 } else { 4 };
    for_blocks(
        x.n_rows(),
        o0,
        rows,
        GROUP_ROWS,
        block_rows,
        |w0, wr, t0, xr, o| {
            macro_rules! go {
                ($wr:literal, $xr:literal, $w0:expr, $o:expr) => {{
                    // SAFETY: this CPU has the features (this function's contract); the
                    // block's rows lie inside `w` and `x` (`for_blocks` stays inside the
                    // panel and the activation rows).
                    let s = unsafe { ctx.block512::<$wr, $xr>($w0, t0) };
                    store_block(&s, local, rows, t0, $o);
                }};
            }
            macro_rules! rows_of {
                ($wr:literal, $w0:expr, $o:expr) => {
                    match xr {
                        1 => go!($wr, 1, $w0, $o),
                        2 => go!($wr, 2, $w0, $o),
                        3 => go!($wr, 3, $w0, $o),
                        _ => go!($wr, 4, $w0, $o),
                    }
                };
            }
            match wr {
                8 => match xr {
                    1 => go!(8, 1, w0, o),
                    _ => go!(8, 2, w0, o),
                },
                4 => rows_of!(4, w0, o),
                // The panel's last few weight rows: one at a time.
                _ => {
                    for i in 0..wr {
                        rows_of!(1, w0 + i, o + i);
                    }
                }
            }
        },
    );
}

impl Ctx<'_> {
    /// `WR` weight rows from `w0` times `XR` activation rows from `t0`.
    ///
    /// # Safety
    /// AVX-512F/BW/VL and AVX-512 BF16 available; rows `w0..w0 + WR` of `w` and
    /// `t0..t0 + XR` of `x` exist.
    // Indices name a register block's accumulator `acc[weight row][activation row]`.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    #[inline]
    unsafe fn block512<const WR: usize, const XR: usize>(
        &self,
        w0: usize,
        t0: usize,
    ) -> [[f32; XR]; WR] {
        let z = _mm512_setzero_ps();
        let mut acc = [[z; XR]; WR];
        let wp: [*const u16; WR] =
            std::array::from_fn(|i| self.w.as_ptr().wrapping_add((w0 + i) * self.k_len));
        let xp = self.x.as_ptr().wrapping_add(t0 * self.padded);
        let ahead = PREFETCH_ROWS * self.k_len;
        for b in 0..self.full {
            // SAFETY: block b < full lies inside each weight row and each padded activation
            // row (the caller's contract); `__m512i` and `__m512bh` are both 64 bytes of
            // plain bits, so reinterpreting one as the other is sound.
            unsafe {
                let mut wv: [__m512bh; WR] = std::mem::zeroed();
                for i in 0..WR {
                    // A hint only: an address past the matrix is never read.
                    _mm_prefetch::<_MM_HINT_T0>(wp[i].wrapping_add(ahead + b * BLOCK) as *const i8);
                    wv[i] = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        wp[i].add(b * BLOCK) as *const _,
                    ));
                }
                for j in 0..XR {
                    let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        xp.add(j * self.padded + b * BLOCK) as *const _,
                    ));
                    for i in 0..WR {
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[i]);
                    }
                }
            }
        }
        if self.full * BLOCK < self.k_len {
            for i in 0..WR {
                let row = &self.w[(w0 + i) * self.k_len..(w0 + i + 1) * self.k_len];
                let buf = block_of(row, self.full * BLOCK);
                // SAFETY: `buf` holds one block; the padded activation rows hold the last
                // block; the bit reinterpretation as above.
                unsafe {
                    let wv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        buf.as_ptr() as *const _,
                    ));
                    for j in 0..XR {
                        let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                            xp.add(j * self.padded + self.full * BLOCK) as *const _,
                        ));
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv);
                    }
                }
            }
        }
        let mut out = [[0.0f32; XR]; WR];
        for i in 0..WR {
            for j in 0..XR {
                let a = acc[i][j];
                out[i][j] = reduce(
                    _mm512_castps512_ps256(a),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
                );
            }
        }
        out
    }
}
