//! The attention block's projections: pre-attention (norm, Q/K/V, DBRX clip, rotary) and
//! the output projection with its residual add.
//!
//! Takes f32 rows `[n_tokens, hidden]`, one position per row and a layer's dense weights;
//! gives `qkv` rows laid out `[q | k | v]` with rotary applied (what the attention kernel
//! reads), and adds `o_proj(attn_out)` into the residual.

use crate::model::arch::ArchSpec;
use crate::model::kernels::isa::Kernels;
use crate::model::kernels::norm::normalize;
use crate::model::kernels::rope::RopeTable;
use crate::model::kernels::{check_len, KernelError};
use crate::model::weights::{DenseWeights, QkvWeights};

/// [`Kernels::pre_attn`] with the process's kernels.
pub fn pre_attn(
    arch: &ArchSpec,
    dense: &DenseWeights<'_>,
    rope: &RopeTable,
    x: &[f32],
    positions: &[usize],
    x_norm: &mut [f32],
    qkv_out: &mut [f32],
) -> Result<(), KernelError> {
    Kernels::process().pre_attn(arch, dense, rope, x, positions, x_norm, qkv_out)
}

/// [`Kernels::o_proj_residual`] with the process's kernels.
pub fn o_proj_residual(
    arch: &ArchSpec,
    dense: &DenseWeights<'_>,
    attn_out: &[f32],
    residual: &mut [f32],
) -> Result<(), KernelError> {
    Kernels::process().o_proj_residual(arch, dense, attn_out, residual)
}

impl Kernels {
    /// Norm, QKV projection, clip (DBRX) and rotary for `n_tokens = positions.len()` rows of
    /// `x`. `x_norm` is scratch `[n_tokens, hidden]`; `qkv_out` is `[n_tokens, qkv_width]`.
    #[allow(clippy::too_many_arguments)]
    pub fn pre_attn(
        self,
        arch: &ArchSpec,
        dense: &DenseWeights<'_>,
        rope: &RopeTable,
        x: &[f32],
        positions: &[usize],
        x_norm: &mut [f32],
        qkv_out: &mut [f32],
    ) -> Result<(), KernelError> {
        let n = positions.len();
        let (d, q, kv) = (arch.hidden, arch.q_dim(), arch.kv_dim());
        let width = q + 2 * kv;
        check_len("pre_attn input", x.len(), n * d)?;
        check_len("pre_attn scratch", x_norm.len(), n * d)?;
        check_len("pre_attn qkv", qkv_out.len(), n * width)?;
        if let Some(&position) = positions.iter().find(|&&p| p >= rope.max_positions()) {
            return Err(KernelError::Position {
                position,
                max: rope.max_positions(),
            });
        }
        normalize(arch.norm, x, dense.attn_norm, arch.norm_eps, x_norm);
        match &dense.qkv {
            QkvWeights::Fused(w) => self.linear(x_norm, n, w, qkv_out)?,
            QkvWeights::Separate {
                q: wq,
                k: wk,
                v: wv,
            } => {
                let mut part = vec![0.0f32; n * q.max(kv)];
                for (w, col, cols) in [(wq, 0, q), (wk, q, kv), (wv, q + kv, kv)] {
                    self.linear(x_norm, n, w, &mut part[..n * cols])?;
                    for t in 0..n {
                        qkv_out[t * width + col..t * width + col + cols]
                            .copy_from_slice(&part[t * cols..(t + 1) * cols]);
                    }
                }
            }
        }
        if let Some(clip) = arch.clip_qkv {
            for v in qkv_out.iter_mut() {
                *v = v.clamp(-clip, clip);
            }
        }
        let hd = arch.attn.head_dim;
        for (t, &pos) in positions.iter().enumerate() {
            let row = &mut qkv_out[t * width..t * width + q + kv];
            for head in row.chunks_exact_mut(hd) {
                rope.rotate(head, pos);
            }
        }
        Ok(())
    }

    /// `residual += attn_out · o_projᵀ` for `[n_tokens, q_dim]` attention outputs.
    pub fn o_proj_residual(
        self,
        arch: &ArchSpec,
        dense: &DenseWeights<'_>,
        attn_out: &[f32],
        residual: &mut [f32],
    ) -> Result<(), KernelError> {
        let n = attn_out.len() / arch.q_dim().max(1);
        check_len("o_proj input", attn_out.len(), n * arch.q_dim())?;
        check_len("o_proj residual", residual.len(), n * arch.hidden)?;
        let mut projected = vec![0.0f32; n * arch.hidden];
        self.linear(attn_out, n, &dense.o_proj, &mut projected)?;
        for (r, p) in residual.iter_mut().zip(&projected) {
            *r += p;
        }
        Ok(())
    }
}
