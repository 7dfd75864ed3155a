//! Matrix products from block-quantised weights without decoding them to f32.
//!
//! Takes weights in a GGML block format ([`crate::quant`]) as stored, or repacked at load
//! into tiles of eight rows ([`tiles`]), or repacked a panel at a time while a many-row
//! product runs (`pack`); gives f32 outputs. Activations are quantised per
//! row to 8 bits ([`crate::quant::q8`]) as ggml does, integer sums inside a block, f32
//! accumulation, with portable, AVX2 and AVX-512 VNNI bodies ([`select`]) that give the
//! same bits.

mod dot;
#[cfg(target_arch = "x86_64")]
mod dot_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx512;
pub mod matmul;
#[cfg(test)]
mod matmul_tests;
#[cfg(target_arch = "x86_64")]
mod pack;
pub mod select;
pub mod tiles;
#[cfg(target_arch = "x86_64")]
mod tiles_b32_x86;
#[cfg(target_arch = "x86_64")]
mod tiles_q6k_x86;
#[cfg(target_arch = "x86_64")]
mod tiles_unpacked_x86;
#[cfg(target_arch = "x86_64")]
mod tiles_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use matmul::{quant_linear, QuantMatmulError, QuantMatrix, QuantProduct};
pub use select::{QuantBody, QuantKernels};
