//! The AVX2 emulation of the bf16 product ([`super::bf16_dot`]) for CPUs without AVX-512
//! BF16: the same operations as `vdpbf16ps`, with FMAs and masks.
//!
//! A product lane `j` of a 32-block holds elements `2j` and `2j + 1`, so 16 stored bf16
//! (weights or the bf16 activation rows) loaded as 8 dwords give lanes `0..8` (or `8..16`
//! from the block's second half): each dword's high half is the odd element as an f32
//! (masked), its low half shifted up the even one. Each lane then takes an FMA with the
//! odd pair and one with the even pair, in that order, and every FMA result and weight has
//! its denormals flushed to signed zero (the instruction's FTZ and DAZ: the activations
//! were flushed when rounded), which costs four integer ops per FMA: this body exists for
//! the same bits, not for speed.
//!
//! Guarantees: the bits of the portable body (the lanes are its lanes, reduced with
//! `linear`'s tree).

use super::bf16_dot::{block_of, for_blocks, store_block, Bf16Rows, Ctx, BLOCK};
use super::linear::avx2::reduce;
use std::arch::x86_64::*;

/// Activation rows one register block takes at most.
const GROUP_ROWS: usize = 2;

/// Rows `o0..o0 + rows` of `w` times every row of `x` into `local[t * rows + o]`.
///
/// # Safety
/// AVX2 and FMA available; `w.len() >= (o0 + rows) * k_len`; `x` was laid out for
/// `k_len`; `local.len() >= x.n_rows() * rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel(
    x: &Bf16Rows,
    w: &[u16],
    k_len: usize,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let ctx = Ctx::new(x, w, k_len);
    for_blocks(
        x.n_rows(),
        o0,
        rows,
        GROUP_ROWS,
        |_| 2,
        |w0, wr, t0, xr, o| {
            macro_rules! go {
                ($wr:literal, $xr:literal, $w0:expr, $o:expr) => {{
                    // SAFETY: this CPU has AVX2 and FMA (this function's contract); the
                    // block's rows lie inside `w` and `x`.
                    let s = unsafe { ctx.block_avx2::<$wr, $xr>($w0, t0) };
                    store_block(&s, local, rows, t0, $o);
                }};
            }
            match (wr, xr) {
                (2, 1) => go!(2, 1, w0, o),
                (2, _) => go!(2, 2, w0, o),
                (_, 1) => go!(1, 1, w0, o),
                _ => go!(1, 2, w0, o),
            }
        },
    );
}

/// `v` with denormals flushed to signed zero: lanes whose magnitude bits are below the
/// smallest normal keep only their sign.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ftz(v: __m256) -> __m256 {
    let magnitude = _mm256_set1_epi32(0x7FFF_FFFF);
    let bits = _mm256_castps_si256(v);
    let tiny = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(0x0080_0000),
        _mm256_and_si256(bits, magnitude),
    );
    _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_and_si256(tiny, magnitude), bits))
}

/// 16 stored bf16 as the (odd, even) elements of 8 lanes, in f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn split(raw: __m256i) -> (__m256, __m256) {
    let odd = _mm256_and_si256(raw, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
    let even = _mm256_slli_epi32::<16>(raw);
    (_mm256_castsi256_ps(odd), _mm256_castsi256_ps(even))
}

impl Ctx<'_> {
    /// `WR` weight rows from `w0` times `XR` activation rows from `t0`.
    ///
    /// # Safety
    /// AVX2 and FMA available; rows `w0..w0 + WR` of `w` and `t0..t0 + XR` of `x` exist.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn block_avx2<const WR: usize, const XR: usize>(
        &self,
        w0: usize,
        t0: usize,
    ) -> [[f32; XR]; WR] {
        let z = _mm256_setzero_ps();
        // acc[half][i][j]: lanes 0..8 and 8..16.
        let mut acc = [[[z; XR]; WR]; 2];
        let xp = self.x.as_ptr().wrapping_add(t0 * self.padded);
        let wrow = |i: usize| &self.w[(w0 + i) * self.k_len..(w0 + i + 1) * self.k_len];
        let tails: [[u16; BLOCK]; WR] = std::array::from_fn(|i| {
            if self.full * BLOCK < self.k_len {
                block_of(wrow(i), self.full * BLOCK)
            } else {
                [0; BLOCK]
            }
        });
        let blocks = self.padded / BLOCK;
        for b in 0..blocks {
            let wp: [*const u16; WR] = std::array::from_fn(|i| {
                if b < self.full {
                    wrow(i)[b * BLOCK..].as_ptr()
                } else {
                    tails[i].as_ptr()
                }
            });
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: each weight pointer has a whole block (a row's block b < full, or
                // its zero-padded copy) and each padded activation row has block b; the
                // loads read 16 elements at offset 16 * h < 32.
                unsafe {
                    let mut wv = [(z, z); WR];
                    for i in 0..WR {
                        let (o, e) = split(_mm256_loadu_si256(wp[i].add(16 * h) as *const __m256i));
                        wv[i] = (ftz(o), ftz(e));
                    }
                    for j in 0..XR {
                        let raw = _mm256_loadu_si256(
                            xp.add(j * self.padded + b * BLOCK + 16 * h) as *const __m256i
                        );
                        let (xo, xe) = split(raw);
                        for i in 0..WR {
                            let a = ftz(_mm256_fmadd_ps(xo, wv[i].0, acc[i][j]));
                            acc[i][j] = ftz(_mm256_fmadd_ps(xe, wv[i].1, a));
                        }
                    }
                }
            }
        }
        let mut out = [[0.0f32; XR]; WR];
        for i in 0..WR {
            for j in 0..XR {
                out[i][j] = reduce(acc[0][i][j], acc[1][i][j]);
            }
        }
        out
    }
}
