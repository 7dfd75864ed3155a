//! The FFN block of a leading dense layer (DeepSeek's `first_k_dense_replace` layers), as
//! the oracle and the runtime both run it.
//!
//! Takes the residual and the layer's dense weights, whose `shared` holds the layer's
//! SwiGLU (`mlp.gate_proj/up_proj/down_proj`; a dense layer has no router and no routed
//! expert); gives the residual updated to `x + down(silu(gate(n)) * up(n))`, `n` the
//! post-attention norm of `x`. It is computed from the MoE block's own pieces: the norm, a
//! routing that chooses no expert ([`NO_EXPERT`] in every slot, weight 0), zero expert
//! slots, the SwiGLU as the shared row, and `combine_shared`; so a schedule's `gate` (which
//! writes that routing and the SwiGLU's rows) and `combine` reproduce the oracle bit for
//! bit, and a `0 + y` in the sum leaves `y` unchanged.

use crate::math::isa::Kernels;
use crate::math::moe::combine_shared;
use crate::math::norm::normalize;
use crate::math::views::DenseWeights;
use crate::math::{check_len, KernelError};
use crate::model::arch::ArchSpec;
use crate::model::vocab::Routing;

/// The expert id of a routing slot that routes to no expert (every slot of a dense
/// layer): past every expert index, so grouping by expert and every per-expert count skip it.
pub const NO_EXPERT: u32 = u32::MAX;

/// The routing of a dense layer over `n_tokens` tokens: `top_k` slots each, no expert,
/// weight 0.
pub fn no_expert_routing(n_tokens: usize, top_k: usize) -> Routing {
    Routing {
        top_k,
        experts: vec![NO_EXPERT; n_tokens * top_k],
        weights: vec![0.0; n_tokens * top_k],
    }
}

/// The post-attention norm of `residual` into `x_norm` and the layer's SwiGLU of it into
/// `out` (all `[n_tokens, hidden]`): what a dense layer's `gate` computes.
pub fn dense_ffn_rows(
    kernels: Kernels,
    arch: &ArchSpec,
    dense: &DenseWeights<'_>,
    residual: &[f32],
    x_norm: &mut [f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n = residual.len() / arch.hidden.max(1);
    check_len("dense FFN input", residual.len(), n * arch.hidden)?;
    check_len("dense FFN scratch", x_norm.len(), n * arch.hidden)?;
    let Some(ffn) = &dense.shared else {
        return Err(KernelError::Shape {
            what: "dense layer FFN (mlp.gate_proj/up_proj/down_proj)",
            expected: 1,
            got: 0,
        });
    };
    normalize(arch.norm, residual, dense.ffn_norm, arch.norm_eps, x_norm);
    kernels.shared_expert(arch, ffn, x_norm, out)
}

/// The whole FFN block of a dense layer on the residual `x` (`[n_tokens, hidden]`);
/// returns the (empty) routing it stands for.
pub fn dense_block(
    kernels: Kernels,
    arch: &ArchSpec,
    dense: &DenseWeights<'_>,
    x: &mut [f32],
) -> Result<Routing, KernelError> {
    let n = x.len() / arch.hidden.max(1);
    let mut x_norm = vec![0.0f32; x.len()];
    let mut out = vec![0.0f32; x.len()];
    dense_ffn_rows(kernels, arch, dense, x, &mut x_norm, &mut out)?;
    let routing = no_expert_routing(n, arch.top_k);
    let slots = vec![0.0f32; x.len() * arch.top_k];
    combine_shared(&routing, &slots, Some(&out), x)?;
    Ok(routing)
}
