//! The ends of the network: token embedding, and final norm + lm_head.
//!
//! Takes token ids / final residual rows; gives f32 embedding rows / logits. Ids past the
//! embedding are an error (a tokenizer larger than the checkpoint's vocabulary).

use crate::math::isa::Kernels;
use crate::math::norm::normalize;
use crate::math::tensor::{Matrix, TypedSlice};
use crate::math::{check_len, KernelError};
use crate::model::arch::ArchSpec;

/// Widens the embedding rows of `ids` into `out` (`[ids.len(), hidden]`).
pub fn embed(embedding: &Matrix<'_>, ids: &[u32], out: &mut [f32]) -> Result<(), KernelError> {
    let d = embedding.cols;
    check_len("embedding output", out.len(), ids.len() * d)?;
    for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(d)) {
        if id as usize >= embedding.rows {
            return Err(KernelError::TokenId {
                id,
                vocab: embedding.rows,
            });
        }
        embedding.row(id as usize).widen_into(dst);
    }
    Ok(())
}

/// [`Kernels::logits`] with the process's kernels.
pub fn logits(
    arch: &ArchSpec,
    final_norm: TypedSlice<'_>,
    lm_head: &Matrix<'_>,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    Kernels::process().logits(arch, final_norm, lm_head, x, out)
}

impl Kernels {
    /// Final norm then lm_head for `[n_tokens, hidden]` rows; gives `[n_tokens, vocab]`.
    pub fn logits(
        self,
        arch: &ArchSpec,
        final_norm: TypedSlice<'_>,
        lm_head: &Matrix<'_>,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let n = x.len() / arch.hidden.max(1);
        check_len("lm_head input", x.len(), n * arch.hidden)?;
        check_len("logits", out.len(), n * lm_head.out_dim())?;
        let mut normed = vec![0.0f32; x.len()];
        normalize(arch.norm, x, final_norm, arch.norm_eps, &mut normed);
        self.linear(&normed, n, lm_head, out)?;
        Ok(())
    }
}
