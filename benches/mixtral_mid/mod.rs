//! The `mixtral-mid` expert shape (d 1024, ffn 3584, bf16 `[out, in]` weights) the kernel
//! benches share: synthetic experts and one expert's FFN over gathered rows, as the MoE
//! block runs it (gate and up fused, then down).

use half::bf16;
use moec::math::isa::Kernels;
use moec::math::tensor::{Matrix, TypedSlice};
use moec::model::vocab::Orientation;

/// Hidden size.
pub const D: usize = 1024;
/// Expert FFN width.
pub const F: usize = 3584;

/// One expert's three bf16 matrices, `[out, in]` as Hugging Face stores them.
pub struct Expert {
    pub gate: Vec<bf16>,
    pub up: Vec<bf16>,
    pub down: Vec<bf16>,
}

impl Expert {
    /// Expert number `e`, with values that differ between experts.
    pub fn new(e: usize) -> Self {
        Expert {
            gate: matrix(3 * e, F * D),
            up: matrix(3 * e + 1, F * D),
            down: matrix(3 * e + 2, D * F),
        }
    }
}

/// `n` bf16 values in [-0.05, 0.05), different for each `seed`.
pub fn matrix(seed: usize, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|i| bf16::from_f32((((i + seed) * 7919) % 2003) as f32 / 20030.0 - 0.05))
        .collect()
}

/// An `[out, in]` bf16 matrix view.
pub fn view(w: &[bf16], rows: usize, cols: usize) -> Matrix<'_> {
    Matrix::new(TypedSlice::Bf16(w), rows, cols, Orientation::OutIn).expect("shape")
}

/// `silu(x) = x * sigmoid(x)`, the experts' activation.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// One expert's gate and up (fused) then down over `rows` gathered rows of `x`.
pub fn expert_rows(k: Kernels, e: &Expert, rows: usize, x: &[f32], h: &mut [f32], y: &mut [f32]) {
    k.linear_gated(
        &x[..rows * D],
        rows,
        &view(&e.gate, F, D),
        &view(&e.up, F, D),
        silu,
        &mut h[..rows * F],
    )
    .expect("gate and up");
    k.linear(
        &h[..rows * F],
        rows,
        &view(&e.down, D, F),
        &mut y[..rows * D],
    )
    .expect("down");
}
