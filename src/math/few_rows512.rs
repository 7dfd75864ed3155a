//! The AVX-512 body of `y = x Wᵀ` for bf16 `[out, in]` weights and few activation rows (1 to
//! [`MAX_ROWS`]): the decode GEMV, the grouped expert GEMMs of a batched decode step (about
//! two rows per routed expert at 8 sequences) and the decode step's q|k|v, o and lm_head
//! products.
//!
//! The design of the AVX2 body ([`super::few_rows`]) at 512 bits, with the 32 registers
//! spent on register blocks that fit the rows: groups of up to 4 activation rows, each in
//! one block (8 weight rows x 1 activation row, 8 x 2, 4 x 3 or 4 x 4), so each weight is
//! loaded and widened once per group and no block computes rows only to discard them (the
//! general AVX-512 body's 4 x 4 blocks did at 1, 2 and 3 rows). A group of activation rows
//! stays in L1 while the panel's weight rows stream past it; the panel stays in L2 for the
//! next group.
//! A 16-block of bf16 weights is widened by one 256-bit broadcast load and one byte shuffle
//! (`vpshufb` puts the 8 even elements in the low half of the register and the 8 odd ones
//! in the high half, each as the high 16 bits of an f32 with zeroed low bits), against the
//! activation rows laid out as [`EvenOddRows`] (each 16-block's evens then odds, which is
//! exactly that register's layout, so each activation block is one 512-bit load). The
//! weight rows 16 rows ahead are prefetched at every block, as in the AVX2 body.
//!
//! Guarantees: every output element is summed exactly as the portable body of `linear`
//! sums it: each accumulator lane is one portable lane (the low half lanes 0, 2, .., 14,
//! the high half 1, 3, .., 15), taking `k ≡ l mod 16` with fused multiply-adds in order, and
//! [`few_rows::reduce`] applies the fixed tree to the two halves. So the bits are the
//! portable body's whatever the row count or block shape.

use super::few_rows::{self, EvenOddRows};
use std::arch::x86_64::*;

/// The most activation rows this body takes; from 17 rows on the general body's 4 x 4
/// blocks take over. Measured with `benches/few_rows.rs` (docs/performance.md), the
/// expert FFN at 1, 2, 4, 8 and 16 rows ran 1.5-1.7x, 1.1-1.2x, 1.2x, 1.2x and 1.2x faster
/// than through the 4 x 4 blocks, the lm_head at 8 rows 1.24x; more rows were not measured.
pub(super) const MAX_ROWS: usize = 16;

/// Activation rows one register block takes at most.
const GROUP_ROWS: usize = 4;

// `Ctx::dispatch` has register blocks for up to 4 activation rows.
const _: () = assert!(GROUP_ROWS <= 4);

/// As [`few_rows`]'s prefetch distance (the same measurement).
const PREFETCH_ROWS: usize = 16;

/// Rows `o0..o0 + rows` of `w` (bf16 `[out, k_len]`, as raw bits) times every activation
/// row into `local[t * rows + o]`.
///
/// # Safety
/// AVX-512F/BW/VL available; `w.len() >= (o0 + rows) * k_len`; `x` was laid out for
/// `k_len`; `local.len()` is at least `rows` times the rows `x` holds.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn panel(
    x: &EvenOddRows,
    w: &[u16],
    k_len: usize,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    let n_rows = x.n_rows();
    if rows == 0 || n_rows == 0 {
        return;
    }
    let ctx = Ctx {
        w: w.as_ptr(),
        k_len,
        full: k_len / 16,
        x: x.data().as_ptr(),
        padded: x.padded(),
        shuffle: widen_control(),
    };
    let mut out = Out { local, rows };
    // Groups of up to 4 activation rows outermost: a group stays in L1 while the panel's
    // weight rows stream past it once, and the panel (64 weight rows) stays in L2 for the
    // next group. (Weight rows outermost with 8-row blocks kept the activation rows in L2
    // instead, which measured slower than the general body from 8 rows on.)
    let mut t = 0;
    while t < n_rows {
        let xr = (n_rows - t).min(GROUP_ROWS);
        let full_block = block_rows(xr);
        let mut o = 0;
        while o < rows {
            let wr = full_block.min(rows - o);
            // SAFETY: weight rows o0 + o .. o0 + o + wr <= o0 + rows and activation rows
            // t .. t + xr <= n_rows, the bounds this function's contract gives.
            unsafe { ctx.dispatch(o0 + o, wr, t, xr, &mut out, o) };
            o += wr;
        }
        t += xr;
    }
}

/// Weight rows per register block for `xr` activation rows: enough accumulators to hide
/// the FMA latency (8 to 16 chains) within the 32 registers, and 8 weight rows streaming
/// at once at 1 and 2 rows (8 x 2 measured 1.93x the 4 x 4 blocks at 2 rows where 4 x 2
/// had measured 1.10-1.19x: more rows in flight keep more of the memory busy).
fn block_rows(xr: usize) -> usize {
    match xr {
        1 | 2 => 8,
        _ => 4,
    }
}

/// The `vpshufb` control that turns a 16-block of bf16 broadcast to both 256-bit halves into
/// `[evens | odds]` as f32: output dword `p` takes the two bytes of element `2p` (p < 8) or
/// `2(p - 8) + 1`, from the 128-bit lane that holds them, as its high half; the low half
/// is zero (control bytes with the top bit set).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn widen_control() -> __m512i {
    let mut bytes = [0u8; 64];
    for p in 0..16 {
        let elem = if p < 8 { 2 * p } else { 2 * (p - 8) + 1 };
        let lane = p / 4;
        // The broadcast puts source bytes 0..16 in 128-bit lanes 0 and 2, 16..32 in 1 and
        // 3; the shuffle indexes bytes within the lane.
        let within = 2 * elem - 16 * (lane % 2);
        bytes[4 * p] = 0x80;
        bytes[4 * p + 1] = 0x80;
        bytes[4 * p + 2] = within as u8;
        bytes[4 * p + 3] = within as u8 + 1;
    }
    // SAFETY: `bytes` holds 64 bytes.
    unsafe { _mm512_loadu_si512(bytes.as_ptr() as *const _) }
}

/// Where a block's sums go: `local[t * rows + o]`.
struct Out<'a> {
    local: &'a mut [f32],
    rows: usize,
}

/// Pointers and sizes a panel's register blocks share.
struct Ctx {
    w: *const u16,
    k_len: usize,
    /// Whole 16-blocks per weight row.
    full: usize,
    x: *const f32,
    padded: usize,
    shuffle: __m512i,
}

impl Ctx {
    /// One register block of `wr` weight rows from `w0` and `xr` activation rows from `t0`,
    /// stored at panel row `o` onwards.
    ///
    /// # Safety
    /// AVX-512F/BW/VL available; the rows are inside the matrix and the activation rows;
    /// `wr <= 8`, `xr <= GROUP_ROWS`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn dispatch(&self, w0: usize, wr: usize, t0: usize, xr: usize, out: &mut Out, o: usize) {
        macro_rules! go {
            ($wr:literal, $xr:literal, $w0:expr, $o:expr) => {{
                // SAFETY: forwarded contract.
                let s = unsafe { self.block::<$wr, $xr>($w0, t0) };
                for (i, sums) in s.iter().enumerate() {
                    for (j, v) in sums.iter().enumerate() {
                        out.store(t0 + j, $o + i, *v);
                    }
                }
            }};
        }
        macro_rules! rows_of {
            ($wr:literal, $w0:expr, $o:expr; $($xr:literal)*) => {
                match xr {
                    $($xr => go!($wr, $xr, $w0, $o),)*
                    _ => {}
                }
            };
        }
        match wr {
            8 if xr <= 2 => rows_of!(8, w0, o; 1 2),
            4 => rows_of!(4, w0, o; 1 2 3 4),
            // The panel's last few weight rows: one at a time.
            _ => {
                for i in 0..wr {
                    rows_of!(1, w0 + i, o + i; 1 2 3 4);
                }
            }
        }
    }

    /// `WR` weight rows from `w0` times `XR` activation rows from `t0`: `WR * XR`
    /// accumulators, each weight block loaded and widened once for all rows.
    ///
    /// # Safety
    /// AVX-512F/BW/VL available; the rows are inside the matrix and the activation rows.
    // Indices name a register block's accumulator `acc[weight row][activation row]`, as
    // the AVX2 body's do: iterators over the two axes would hide which is which.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[inline]
    unsafe fn block<const WR: usize, const XR: usize>(
        &self,
        w0: usize,
        t0: usize,
    ) -> [[f32; XR]; WR] {
        let z = _mm512_setzero_ps();
        let mut acc = [[z; XR]; WR];
        let wp: [*const u16; WR] =
            std::array::from_fn(|i| self.w.wrapping_add((w0 + i) * self.k_len));
        let xp = self.x.wrapping_add(t0 * self.padded);
        let ahead = PREFETCH_ROWS * self.k_len;
        for b in 0..self.full {
            // SAFETY: block b < full lies inside each weight row and each padded
            // activation row (the caller's contract).
            unsafe {
                let mut wv = [z; WR];
                for i in 0..WR {
                    // A hint only: an address past the matrix is never read.
                    _mm_prefetch::<_MM_HINT_T0>(wp[i].wrapping_add(ahead + b * 16) as *const i8);
                    let raw = _mm256_loadu_si256(wp[i].add(b * 16) as *const __m256i);
                    wv[i] = self.widen(raw);
                }
                for j in 0..XR {
                    let xv = _mm512_loadu_ps(xp.add(j * self.padded + b * 16));
                    for i in 0..WR {
                        acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
                    }
                }
            }
        }
        let tail = self.k_len - self.full * 16;
        if tail > 0 {
            // The ragged last block from zero-padded copies: lanes past `k_len` add 0 * 0
            // (the activation rows are zero-padded already), as the other bodies do.
            for i in 0..WR {
                // SAFETY: the row's last `tail` elements are inside the matrix.
                let buf = unsafe { few_rows::padded_tail(wp[i], self.full * 16, tail) };
                // SAFETY: `buf` holds 16 values; the padded activation rows hold the block.
                unsafe {
                    let wv = self.widen(_mm256_loadu_si256(buf.as_ptr() as *const __m256i));
                    for j in 0..XR {
                        let xv = _mm512_loadu_ps(xp.add(j * self.padded + self.full * 16));
                        acc[i][j] = _mm512_fmadd_ps(wv, xv, acc[i][j]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; XR]; WR];
        for i in 0..WR {
            for j in 0..XR {
                let a = acc[i][j];
                out[i][j] = few_rows::reduce(
                    _mm512_castps512_ps256(a),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))),
                );
            }
        }
        out
    }

    /// 16 bf16 weights as `[evens | odds]` f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[inline]
    fn widen(&self, raw: __m256i) -> __m512 {
        _mm512_castsi512_ps(_mm512_shuffle_epi8(
            _mm512_broadcast_i64x4(raw),
            self.shuffle,
        ))
    }
}

impl Out<'_> {
    /// The sum of activation row `t` and panel row `o`.
    fn store(&mut self, t: usize, o: usize, v: f32) {
        self.local[t * self.rows + o] = v;
    }
}
