//! The bf16 product of bf16 `[out, in]` weights (`MOEC_BF16_PRODUCT=bf16`): activations
//! rounded to bf16, pairs multiplied and summed as AVX-512 BF16's `vdpbf16ps` does, which
//! is llama.cpp's arithmetic for bf16 weights and twice the f32 FMA rate per instruction.
//!
//! Takes activation rows laid out by `Bf16Rows` (each value rounded to bf16 once per
//! call, to nearest even, denormals to signed zero, as `vcvtneps2bf16` does) and bf16
//! weight rows; writes `local[t * rows + o]` as `linear`'s `OutIn` bodies do.
//!
//! The product, per output element: 16 f32 lanes; lane `j` takes, in each 32-block `b` of
//! the row, `k = 32b + 2j + 1` then `k = 32b + 2j` (Intel's pseudo-code for `vdpbf16ps`:
//! `acc += a[2j+1] * b[2j+1]`, then `acc += a[2j] * b[2j]`, each a fused multiply-add
//! rounded to nearest even, denormal inputs read as zero and denormal results flushed to
//! signed zero); the ragged last block is zero-padded; the lanes are then reduced with
//! `linear`'s fixed tree (`l += l + 8, + 4, + 2, + 1`). The order depends only on the
//! matrix, never on the rows in the call, so the product is batch-invariant; every body
//! ([`Body`]: the `vdpbf16ps` body, the AVX2 FMA emulation that flushes denormals itself,
//! and the portable loop) computes exactly these operations, so all give the same bits
//! (this CPU's `vdpbf16ps` matched the emulation on 32 million random lanes with
//! denormals, ties and cancellations; `tests` compare the bodies).
//!
//! Error against the exact product: rounding an activation moves it by at most `2^-8` of
//! itself, and each of the at most `m = 2 * ceil(in / 32) + 4` f32 roundings along an
//! element's path adds at most `2^-24` relative, so `|y - Σ w x| <= (2^-8 + 1.01 * m *
//! 2^-24) * Σ |w x|` (plus `m * 2^-126` from flushed denormals).

use crate::math::isa::{has_avx512_bf16, Isa, Kernels};
use crate::math::linear::portable::reduce16;

/// Weight (and activation) elements per accumulator step: 16 f32 lanes of 2 bf16 each.
pub(super) const BLOCK: usize = 32;

/// The body that runs the bf16 product for a kernel choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// `vdpbf16ps` (AVX-512 BF16), on AVX-512 kernels when the CPU has it.
    Avx512Bf16,
    /// AVX2 fused multiply-adds in the instruction's order, denormals flushed by masks:
    /// AVX2 kernels, or AVX-512 kernels on a CPU without AVX-512 BF16.
    Avx2Emulation,
    /// Plain loops of the same operations.
    Portable,
}

impl Body {
    /// The body for `k`'s instruction set on this CPU.
    pub fn for_kernels(k: Kernels) -> Body {
        match k.isa() {
            Isa::Avx512 if has_avx512_bf16() => Body::Avx512Bf16,
            Isa::Avx512 | Isa::Avx2 => Body::Avx2Emulation,
            Isa::Portable => Body::Portable,
        }
    }
}

/// The bf16-product clause of `moec devices` and the run report's kernel line.
pub fn describe(k: Kernels) -> String {
    if !k.bf16_dot() {
        return "bf16 weights: f32 product (activations kept in f32; MOEC_BF16_PRODUCT=f32)"
            .to_string();
    }
    let body = match Body::for_kernels(k) {
        Body::Avx512Bf16 => "vdpbf16ps (AVX-512 BF16) in 8 x 1, 8 x 2, 4 x 3 and 4 x 4 blocks",
        Body::Avx2Emulation if k.isa() == Isa::Avx512 => {
            "AVX2 FMA emulation of vdpbf16ps (this CPU lacks AVX-512 BF16; slower than the \
             f32 product)"
        }
        Body::Avx2Emulation => {
            "AVX2 FMA emulation of vdpbf16ps (slower than the f32 product on this CPU)"
        }
        Body::Portable => "portable emulation of vdpbf16ps",
    };
    format!(
        "bf16 weights: bf16 product (MOEC_BF16_PRODUCT=bf16: activations rounded to bf16, \
         pairs summed as vdpbf16ps does) through {body}, at every row count; in-out bf16 \
         matrices (gpt-oss and DBRX experts, MLA's kv_b) keep the f32 product"
    )
}

/// Rounds `v` to bf16 bits as `vcvtneps2bf16` does: to nearest even, zero and denormals
/// to signed zero, NaN quieted (its top 16 bits with the quiet bit set), infinities kept.
pub fn round_to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    if b & 0x7F80_0000 == 0 {
        return ((b >> 16) & 0x8000) as u16;
    }
    // Cannot overflow: the largest non-NaN pattern is 0xFF80_0000.
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// bf16 bits as f32 with a denormal read as signed zero (the instruction's DAZ).
fn widen_daz(b: u16) -> f32 {
    ftz(f32::from_bits((b as u32) << 16))
}

/// A denormal flushed to signed zero (the instruction's FTZ); other values unchanged.
fn ftz(v: f32) -> f32 {
    let b = v.to_bits();
    if b & 0x7F80_0000 == 0 {
        f32::from_bits(b & 0x8000_0000)
    } else {
        v
    }
}

/// One lane's step of `vdpbf16ps`: `acc += x_odd * w_odd`, then `acc += x_even * w_even`.
fn step(acc: f32, x: [u16; 2], w: [u16; 2]) -> f32 {
    let acc = ftz(widen_daz(x[1]).mul_add(widen_daz(w[1]), acc));
    ftz(widen_daz(x[0]).mul_add(widen_daz(w[0]), acc))
}

/// Activation rows rounded to bf16 ([`round_to_bf16`]) and zero-padded to whole 32-blocks:
/// the layout every body reads (one 512-bit load per block for `vdpbf16ps`).
pub(super) struct Bf16Rows {
    data: Vec<u16>,
    n_rows: usize,
    /// Values per padded row (a multiple of [`BLOCK`]).
    padded: usize,
}

impl Bf16Rows {
    /// Rounds `n_rows` rows of `k_len` values of `x` (`x.len() >= n_rows * k_len`).
    pub(super) fn new(x: &[f32], n_rows: usize, k_len: usize) -> Self {
        let padded = k_len.div_ceil(BLOCK) * BLOCK;
        let mut data = vec![0u16; n_rows * padded];
        if k_len > 0 {
            for (row, dst) in x.chunks(k_len).take(n_rows).zip(data.chunks_mut(padded)) {
                for (d, v) in dst.iter_mut().zip(row) {
                    *d = round_to_bf16(*v);
                }
            }
        }
        Bf16Rows {
            data,
            n_rows,
            padded,
        }
    }

    /// Activation rows held.
    pub(super) fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Values per padded row.
    pub(super) fn padded(&self) -> usize {
        self.padded
    }

    /// The rows, `padded` values each.
    pub(super) fn data(&self) -> &[u16] {
        &self.data
    }
}

/// Rows `o0..o0 + rows` of `w` (bf16 `[out, k_len]`, as raw bits) times every row of `x`
/// into `local[t * rows + o]`, on `k`'s body ([`Body::for_kernels`]).
///
/// Panics (a caller bug, not bad input) when `w` lacks those rows, `x` was laid out for
/// another `k_len` or `local` is shorter than `x.n_rows() * rows`: `linear` checks every
/// length before any body runs.
pub(super) fn panel(
    k: Kernels,
    x: &Bf16Rows,
    w: &[u16],
    k_len: usize,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    assert!(
        w.len() >= (o0 + rows) * k_len
            && x.padded == k_len.div_ceil(BLOCK) * BLOCK
            && local.len() >= x.n_rows * rows,
        "bf16 product: panel bounds"
    );
    match Body::for_kernels(k) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Body::Avx512Bf16` is chosen only when this CPU has AVX-512F/BW/VL and
        // AVX-512 BF16; the bounds the body needs were asserted above.
        Body::Avx512Bf16 => unsafe { super::bf16_dot512::panel(x, w, k_len, o0, rows, local) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Body::Avx2Emulation` is chosen only for AVX2 or AVX-512 kernels, which
        // a `Kernels` value vouches this CPU has (AVX-512 CPUs have AVX2 and FMA); the
        // bounds were asserted above.
        Body::Avx2Emulation => unsafe { super::bf16_dot_avx2::panel(x, w, k_len, o0, rows, local) },
        _ => portable_panel(x, w, k_len, o0, rows, local),
    }
}

/// The panel loop both SIMD bodies share: groups of up to `group` activation rows
/// outermost (a group stays in L1 while the panel's weight rows stream past it, the panel
/// in L2 for the next group), weight rows in blocks of `block_rows(xr)`; `run(w0, wr, t0,
/// xr, o)` computes one register block and stores it at panel row `o`.
pub(super) fn for_blocks(
    n_rows: usize,
    o0: usize,
    rows: usize,
    group: usize,
    block_rows: impl Fn(usize) -> usize,
    mut run: impl FnMut(usize, usize, usize, usize, usize),
) {
    let mut t = 0;
    while t < n_rows {
        let xr = (n_rows - t).min(group);
        let full = block_rows(xr);
        let mut o = 0;
        while o < rows {
            let wr = full.min(rows - o);
            run(o0 + o, wr, t, xr, o);
            o += wr;
        }
        t += xr;
    }
}

/// The 32-block of a weight row from `start` (`start <= row.len()`), zero-padded past
/// the row's end: the ragged last block's padding lanes add `0 * 0`.
pub(super) fn block_of(row: &[u16], start: usize) -> [u16; BLOCK] {
    let mut buf = [0u16; BLOCK];
    let part = &row[start..(start + BLOCK).min(row.len())];
    buf[..part.len()].copy_from_slice(part);
    buf
}

/// A register block's sums (`sums[weight row][activation row]`, weight rows from panel
/// row `o`, activation rows from `t0`) into `local[t * rows + o]`, as [`panel`] lays it out.
pub(super) fn store_block<const WR: usize, const XR: usize>(
    sums: &[[f32; XR]; WR],
    local: &mut [f32],
    rows: usize,
    t0: usize,
    o: usize,
) {
    for (i, row) in sums.iter().enumerate() {
        for (j, v) in row.iter().enumerate() {
            local[(t0 + j) * rows + o + i] = *v;
        }
    }
}

/// The weights and activation rows a SIMD body's register blocks share (each body adds
/// its own `block` method).
pub(super) struct Ctx<'a> {
    pub(super) w: &'a [u16],
    pub(super) k_len: usize,
    /// Whole 32-blocks per weight row.
    pub(super) full: usize,
    pub(super) x: &'a [u16],
    pub(super) padded: usize,
}

impl<'a> Ctx<'a> {
    /// The panel's weights `w` (rows of `k_len`) and activation rows `x`.
    pub(super) fn new(x: &'a Bf16Rows, w: &'a [u16], k_len: usize) -> Self {
        Ctx {
            w,
            k_len,
            full: k_len / BLOCK,
            x: x.data(),
            padded: x.padded(),
        }
    }
}

/// The reference body: each element's lanes stepped in the instruction's order.
fn portable_panel(
    x: &Bf16Rows,
    w: &[u16],
    k_len: usize,
    o0: usize,
    rows: usize,
    local: &mut [f32],
) {
    for o in 0..rows {
        let wrow = &w[(o0 + o) * k_len..(o0 + o + 1) * k_len];
        for t in 0..x.n_rows {
            let xrow = &x.data[t * x.padded..(t + 1) * x.padded];
            let mut lanes = [0.0f32; 16];
            for (b, xb) in xrow.chunks_exact(BLOCK).enumerate() {
                let wb = block_of(wrow, b * BLOCK);
                for (j, lane) in lanes.iter_mut().enumerate() {
                    *lane = step(
                        *lane,
                        [xb[2 * j], xb[2 * j + 1]],
                        [wb[2 * j], wb[2 * j + 1]],
                    );
                }
            }
            local[t * rows + o] = reduce16(&lanes);
        }
    }
}

#[cfg(test)]
#[path = "bf16_dot_tests.rs"]
mod tests;
