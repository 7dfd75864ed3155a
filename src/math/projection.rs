//! The attention block's projections: pre-attention (norm, Q/K/V, their biases, q/k
//! RMSNorm, DBRX/OLMoE clip, rotary) and the output projection with its residual add.
//!
//! Takes f32 rows `[n_tokens, hidden]`, one position per row and a layer's dense weights;
//! gives `qkv` rows laid out `[q | k | v]` with rotary applied (what the attention kernel
//! reads), and adds `o_proj(attn_out)` into the residual.

use crate::math::isa::Kernels;
use crate::math::norm::normalize;
use crate::math::rope::RopeTable;
use crate::math::views::{DenseWeights, QkvWeights};
use crate::math::{check_len, KernelError};
use crate::model::arch::ArchSpec;
use crate::model::vocab::NormKind;

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
    /// Norm, QKV projection, q/k/v biases (Qwen2-MoE), q/k RMSNorm (Qwen3 per head, OLMoE
    /// whole), clip (DBRX) and rotary for `n_tokens = positions.len()` rows of
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
        if let Some(&position) = positions.iter().find(|&&p| p >= rope.max_positions()) {
            return Err(KernelError::Position {
                position,
                max: rope.max_positions(),
            });
        }
        if let QkvWeights::Mla(mla) = &dense.qkv {
            return self.mla_pre_attn(
                arch,
                dense.attn_norm,
                mla,
                rope,
                x,
                positions,
                x_norm,
                qkv_out,
            );
        }
        let n = positions.len();
        let (d, q, kv) = (arch.hidden, arch.q_dim(), arch.kv_dim());
        // Row stride of `qkv_out`: q | k | v, then the sinks with them (gpt-oss).
        let width = arch.attn.qkv_width();
        let proj = q + 2 * kv;
        check_len("pre_attn input", x.len(), n * d)?;
        check_len("pre_attn scratch", x_norm.len(), n * d)?;
        check_len("pre_attn qkv", qkv_out.len(), n * width)?;
        normalize(arch.norm, x, dense.attn_norm, arch.norm_eps, x_norm);
        match &dense.qkv {
            QkvWeights::Fused(w) if width == proj => self.linear(x_norm, n, w, qkv_out)?,
            QkvWeights::Fused(w) => {
                let mut part = vec![0.0f32; n * proj];
                self.linear(x_norm, n, w, &mut part)?;
                for t in 0..n {
                    qkv_out[t * width..t * width + proj]
                        .copy_from_slice(&part[t * proj..(t + 1) * proj]);
                }
            }
            QkvWeights::Mla(_) => {}
            QkvWeights::Separate {
                q: wq,
                k: wk,
                v: wv,
            } => {
                let (mut pq, mut pk, mut pv) = (
                    vec![0.0f32; n * q],
                    vec![0.0f32; n * kv],
                    vec![0.0f32; n * kv],
                );
                self.linear_many(x_norm, n, &[wq, wk, wv], &mut [&mut pq, &mut pk, &mut pv])?;
                for (part, col, cols) in [(&pq, 0, q), (&pk, q, kv), (&pv, q + kv, kv)] {
                    for t in 0..n {
                        qkv_out[t * width + col..t * width + col + cols]
                            .copy_from_slice(&part[t * cols..(t + 1) * cols]);
                    }
                }
            }
        }
        if let Some(biases) = &dense.qkv_bias {
            let b: Vec<Vec<f32>> = biases.iter().map(|b| b.to_f32_vec()).collect();
            for (part, (col, cols)) in b.iter().zip([(0, q), (q, kv), (q + kv, kv)]) {
                check_len("q/k/v bias", part.len(), cols)?;
                for row in qkv_out.chunks_exact_mut(width) {
                    for (v, bv) in row[col..col + cols].iter_mut().zip(part) {
                        *v += bv;
                    }
                }
            }
        }
        if let Some([q_norm, k_norm]) = dense.qk_norm {
            // Qwen3 normalises each head (weights of head_dim), OLMoE the whole q and k
            // projections (weights of q_dim / kv_dim); both before clip and rotary.
            let mut tmp = vec![0.0f32; q.max(kv)];
            for row in qkv_out.chunks_exact_mut(width) {
                for (col, cols, w) in [(0, q, q_norm), (q, kv, k_norm)] {
                    let part = &mut row[col..col + cols];
                    let chunk = w.len().max(1);
                    if cols % chunk != 0 {
                        return Err(KernelError::Shape {
                            what: "q/k norm weight (a divisor of the q or k width)",
                            expected: cols,
                            got: w.len(),
                        });
                    }
                    let out = &mut tmp[..cols];
                    normalize(NormKind::Rms, part, w, arch.norm_eps, out);
                    part.copy_from_slice(out);
                }
            }
        }
        if let Some(clip) = arch.clip_qkv {
            for row in qkv_out.chunks_exact_mut(width) {
                for v in &mut row[..proj] {
                    *v = v.clamp(-clip, clip);
                }
            }
        }
        if arch.attn.sinks {
            let sinks = dense.sinks.map(|s| s.to_f32_vec()).unwrap_or_default();
            check_len("attention sinks", sinks.len(), arch.attn.heads)?;
            for row in qkv_out.chunks_exact_mut(width) {
                row[proj..].copy_from_slice(&sinks);
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
        if let Some(kv_b) = &dense.kv_b_out {
            return self.mla_o_proj_residual(arch, kv_b, &dense.o_proj, attn_out, residual);
        }
        let n = attn_out.len() / arch.q_dim().max(1);
        check_len("o_proj input", attn_out.len(), n * arch.q_dim())?;
        check_len("o_proj residual", residual.len(), n * arch.hidden)?;
        let mut projected = vec![0.0f32; n * arch.hidden];
        self.linear(attn_out, n, &dense.o_proj, &mut projected)?;
        if let Some(bias) = dense.o_bias {
            let bias = bias.to_f32_vec();
            check_len("o_proj bias", bias.len(), arch.hidden)?;
            for row in projected.chunks_exact_mut(arch.hidden) {
                for (v, b) in row.iter_mut().zip(&bias) {
                    *v += b;
                }
            }
        }
        for (r, p) in residual.iter_mut().zip(&projected) {
            *r += p;
        }
        Ok(())
    }
}
