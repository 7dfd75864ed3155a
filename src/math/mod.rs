//! The model's math, one file per family of ops, shared by the oracle and the runtime.
//!
//! Every kernel takes f32 activations in caller-owned slices (so the runtime can pass
//! views into its arenas) and weight views in their stored dtype; none allocates model
//! state or knows about schedules. The oracle is only a sequential composition of these.
//! Each SIMD kernel is a method of the [`isa::Kernels`] context (AVX-512, AVX2+FMA or
//! portable bodies that give the same bits, chosen once per process from the CPU and
//! `MOEC_KERNELS`); the free functions below use the process's choice.
//!
//! | op | function |
//! | --- | --- |
//! | embedding | [`head::embed`] |
//! | norm + QKV (+ DBRX clip) + rotary | [`projection::pre_attn`] |
//! | append K/V + paged GQA attention | [`attention::attention`] |
//! | o_proj + residual | [`projection::o_proj_residual`] |
//! | norm + router softmax + top-k + renormalise | [`moe::gate`] |
//! | one expert over its routed rows | [`moe::expert_ffn`] |
//! | combine into the residual | [`moe::combine`] |
//! | final norm + lm_head | [`head::logits`] |
//! | greedy / temperature + top-p | [`sampling::sample`] |

pub mod attention;
mod attn_decode;
pub mod bf16_dot;
#[cfg(target_arch = "x86_64")]
mod bf16_dot512;
#[cfg(target_arch = "x86_64")]
mod bf16_dot_avx2;
pub mod deepseek_route;
pub mod dense;
#[cfg(target_arch = "x86_64")]
mod few_rows;
#[cfg(target_arch = "x86_64")]
mod few_rows512;
pub mod head;
pub mod isa;
pub mod kv_cache;
pub mod linear;
pub mod mla;
pub mod moe;
pub mod norm;
pub mod projection;
pub mod qmatmul;
pub mod report;
pub mod rope;
pub mod sampling;
pub mod simd;
pub mod softmax;
pub mod tensor;
pub mod views;

/// Errors a kernel reports instead of panicking on inconsistent inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// Attention arguments are inconsistent.
    #[error(transparent)]
    Attention(#[from] attention::AttnError),
    /// A position past the rotary table.
    #[error("position {position} is past the model's {max} positions")]
    Position {
        /// Position asked for.
        position: usize,
        /// Table size.
        max: usize,
    },
    /// A token id past the embedding.
    #[error("token id {id} is outside the vocabulary of {vocab} rows")]
    TokenId {
        /// Offending id.
        id: u32,
        /// Embedding rows.
        vocab: usize,
    },
    /// A buffer of the wrong length.
    #[error("{what}: expected {expected} values, got {got}")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// Length needed.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// Quantised weights in a layout the quantised products do not take.
    #[error("{format} weights stored {what}: moec multiplies quantised matrices only as stored [out, in] rows of whole blocks")]
    QuantLayout {
        /// The block format.
        format: crate::quant::QuantFormat,
        /// What is unsupported about the layout.
        what: &'static str,
    },
    /// A product from quantised weights failed (`math::qmatmul::quant_linear`).
    #[error(transparent)]
    Quant(#[from] crate::math::qmatmul::QuantMatmulError),
}

/// Checks a buffer length.
pub(crate) fn check_len(
    what: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::Shape {
            what,
            expected,
            got,
        })
    }
}
