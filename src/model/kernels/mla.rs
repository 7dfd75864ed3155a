//! DeepSeek's multi-head latent attention (MLA) around the shared attention kernel.
//!
//! Takes a layer's MLA weights ([`MlaWeights`]) and f32 rows `[n_tokens, hidden]`; gives
//! the `qkv` rows the ordinary attention kernel reads, in MLA's "absorbed" form: one kv
//! head of width `kv_lora_rank + qk_rope_head_dim` (the card's `head_dim`), K = `[c | k_pe]`
//! and V = `[c | 0]` where `c` is the normalised latent and `k_pe` the rotated shared key,
//! and per query head `[q_nope W_uk_h | q_pe]` scaled so that the kernel's
//! `1 / sqrt(head_dim)` becomes transformers' `mscale / sqrt(qk_head_dim)`. Since
//! `q_nope · (c W_uk_hᵀ) = (q_nope W_uk_h) · c`, the scores are transformers' scores; the
//! output of head h is `Σ p c`, which [`Kernels::mla_o_proj_residual`] expands with
//! `W_uv_h` before `o_proj`. Guarantees: the cache holds only the latent and the rotary key
//! (see `card::Mla` for the bytes), and the result equals transformers'
//! `DeepseekV2Attention` up to f32 summation order.

use crate::model::arch::ArchSpec;
use crate::model::card::Mla;
use crate::model::kernels::isa::Kernels;
use crate::model::kernels::norm::{normalize, NormKind};
use crate::model::kernels::rope::RopeTable;
use crate::model::kernels::{check_len, KernelError};
use crate::model::layout::SegmentKind;
use crate::model::tensor::{Matrix, Orientation, TypedSlice};

/// Epsilon of `q_a_layernorm` and `kv_a_layernorm`: transformers builds them with the
/// RMSNorm default, not the config's `rms_norm_eps`.
pub const LORA_NORM_EPS: f32 = 1e-6;

/// How the queries are projected.
#[derive(Debug, Clone, Copy)]
pub enum MlaQuery<'a> {
    /// `q_proj` `[heads * qk_head_dim, hidden]` (no query rank: V2-Lite).
    Direct(Matrix<'a>),
    /// `q_b_proj(q_a_layernorm(q_a_proj(x)))`.
    Lora {
        /// `q_a_proj` `[q_lora_rank, hidden]`.
        a: Matrix<'a>,
        /// `q_a_layernorm` `[q_lora_rank]`.
        norm: TypedSlice<'a>,
        /// `q_b_proj` `[heads * qk_head_dim, q_lora_rank]`.
        b: Matrix<'a>,
    },
}

/// One layer's MLA projections (the `pre` part of its weights).
#[derive(Debug, Clone, Copy)]
pub struct MlaWeights<'a> {
    /// Query projection.
    pub q: MlaQuery<'a>,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a: Matrix<'a>,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    pub kv_a_norm: TypedSlice<'a>,
    /// `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
    pub kv_b: Matrix<'a>,
}

impl<'a> MlaWeights<'a> {
    /// Collects the MLA segments through `segment` (a checkpoint, an image or a runtime
    /// view: each reader fetches a segment its own way); `lora` says whether the layout
    /// has the query rank's three segments or a plain `q_proj`.
    pub fn build<E>(
        lora: bool,
        mut segment: impl FnMut(SegmentKind) -> Result<Matrix<'a>, E>,
    ) -> Result<Self, E> {
        let q = if lora {
            MlaQuery::Lora {
                a: segment(SegmentKind::QAProj)?,
                norm: segment(SegmentKind::QANorm)?.data,
                b: segment(SegmentKind::QBProj)?,
            }
        } else {
            MlaQuery::Direct(segment(SegmentKind::QProj)?)
        };
        Ok(MlaWeights {
            q,
            kv_a: segment(SegmentKind::KvAProj)?,
            kv_a_norm: segment(SegmentKind::KvANorm)?.data,
            kv_b: segment(SegmentKind::KvB)?,
        })
    }
}

/// Rows `rows` of `kv_b` seen as a matrix of orientation `orientation`.
fn kv_b_rows<'a>(
    kv_b: &Matrix<'a>,
    rows: std::ops::Range<usize>,
    orientation: Orientation,
) -> Matrix<'a> {
    let mut block = kv_b.row_block(rows);
    block.orientation = orientation;
    block
}

fn geometry(arch: &ArchSpec) -> Result<(Mla, usize, usize, usize, usize, usize), KernelError> {
    let m = arch.mla.ok_or(KernelError::Shape {
        what: "MLA geometry (the card has none)",
        expected: 1,
        got: 0,
    })?;
    Ok((
        m,
        m.kv_lora_rank as usize,
        m.qk_nope_head_dim as usize,
        m.qk_rope_head_dim as usize,
        m.v_head_dim as usize,
        arch.attn.heads,
    ))
}

impl Kernels {
    /// MLA's pre-attention for `positions.len()` rows of `x`: norm, query and latent
    /// projections, latent norm, rotary of `q_pe` and `k_pe`, `W_uk` folded into the
    /// queries, the softmax scale folded into them too; writes `[q | K | V]` rows of the
    /// latent geometry into `qkv_out` (`[n, (heads + 2) * head_dim]`). Positions are
    /// checked against the rotary table by the caller ([`Kernels::pre_attn`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mla_pre_attn(
        self,
        arch: &ArchSpec,
        attn_norm: TypedSlice<'_>,
        w: &MlaWeights<'_>,
        rope: &RopeTable,
        x: &[f32],
        positions: &[usize],
        x_norm: &mut [f32],
        qkv_out: &mut [f32],
    ) -> Result<(), KernelError> {
        let (m, r, nope, rope_dim, v_dim, heads) = geometry(arch)?;
        let n = positions.len();
        let d = arch.hidden;
        let hd = arch.attn.head_dim;
        let qk = nope + rope_dim;
        let width = arch.attn.qkv_width();
        check_len("MLA head width", hd, r + rope_dim)?;
        check_len("MLA input", x.len(), n * d)?;
        check_len("MLA scratch", x_norm.len(), n * d)?;
        check_len("MLA qkv", qkv_out.len(), n * width)?;
        normalize(arch.norm, x, attn_norm, arch.norm_eps, x_norm);
        let mut q = vec![0.0f32; n * heads * qk];
        match &w.q {
            MlaQuery::Direct(q_proj) => self.linear(x_norm, n, q_proj, &mut q)?,
            MlaQuery::Lora { a, norm, b } => {
                let rank = a.out_dim();
                let mut qa = vec![0.0f32; n * rank];
                self.linear(x_norm, n, a, &mut qa)?;
                check_len("q_a_layernorm", norm.len(), rank)?;
                let mut qa_norm = vec![0.0f32; n * rank];
                normalize(NormKind::Rms, &qa, *norm, LORA_NORM_EPS, &mut qa_norm);
                self.linear(&qa_norm, n, b, &mut q)?;
            }
        }
        let mut ckv = vec![0.0f32; n * (r + rope_dim)];
        self.linear(x_norm, n, &w.kv_a, &mut ckv)?;
        check_len("kv_a_layernorm", w.kv_a_norm.len(), r)?;
        check_len("kv_b_proj rows", w.kv_b.rows, heads * (nope + v_dim))?;
        let rotate = |head: &mut [f32], pos: usize| {
            if m.rope_interleave {
                rope.rotate_interleaved(head, pos);
            } else {
                rope.rotate(head, pos);
            }
        };
        // transformers scales scores by mscale / sqrt(qk_head_dim); the kernel divides by
        // sqrt(head_dim), so the queries carry the ratio.
        let q_scale = (m.softmax_mscale * (hd as f64).sqrt() / (qk as f64).sqrt()) as f32;
        let mut q_nope = vec![0.0f32; n * nope];
        let mut q_abs = vec![0.0f32; n * r];
        for h in 0..heads {
            for t in 0..n {
                let src = (t * heads + h) * qk;
                q_nope[t * nope..(t + 1) * nope].copy_from_slice(&q[src..src + nope]);
            }
            let base = h * (nope + v_dim);
            let w_uk = kv_b_rows(&w.kv_b, base..base + nope, Orientation::InOut);
            self.linear(&q_nope, n, &w_uk, &mut q_abs)?;
            for (t, &pos) in positions.iter().enumerate() {
                let row = &mut qkv_out[t * width + h * hd..t * width + (h + 1) * hd];
                row[..r].copy_from_slice(&q_abs[t * r..(t + 1) * r]);
                let src = (t * heads + h) * qk + nope;
                row[r..].copy_from_slice(&q[src..src + rope_dim]);
                rotate(&mut row[r..], pos);
                for v in row.iter_mut() {
                    *v *= q_scale;
                }
            }
        }
        let q_width = heads * hd;
        for (t, &pos) in positions.iter().enumerate() {
            let latent = &ckv[t * (r + rope_dim)..(t + 1) * (r + rope_dim)];
            let row = &mut qkv_out[t * width + q_width..t * width + q_width + 2 * hd];
            let (k, v) = row.split_at_mut(hd);
            normalize(
                NormKind::Rms,
                &latent[..r],
                w.kv_a_norm,
                LORA_NORM_EPS,
                &mut k[..r],
            );
            k[r..].copy_from_slice(&latent[r..]);
            rotate(&mut k[r..], pos);
            let (k_latent, _) = k.split_at(r);
            v[..r].copy_from_slice(k_latent);
            v[r..].fill(0.0);
        }
        Ok(())
    }

    /// `residual += (per head h: attn_out_h[..kv_lora_rank] W_uv_hᵀ) · o_projᵀ` for
    /// `[n_tokens, heads * head_dim]` latent attention outputs.
    pub fn mla_o_proj_residual(
        self,
        arch: &ArchSpec,
        kv_b: &Matrix<'_>,
        o_proj: &Matrix<'_>,
        attn_out: &[f32],
        residual: &mut [f32],
    ) -> Result<(), KernelError> {
        let (_, r, nope, _, v_dim, heads) = geometry(arch)?;
        let hd = arch.attn.head_dim;
        let n = attn_out.len() / (heads * hd).max(1);
        check_len("MLA o_proj input", attn_out.len(), n * heads * hd)?;
        check_len("MLA o_proj residual", residual.len(), n * arch.hidden)?;
        check_len("kv_b_proj rows", kv_b.rows, heads * (nope + v_dim))?;
        let mut latent = vec![0.0f32; n * r];
        let mut head_out = vec![0.0f32; n * v_dim];
        let mut values = vec![0.0f32; n * heads * v_dim];
        for h in 0..heads {
            for t in 0..n {
                let src = (t * heads + h) * hd;
                latent[t * r..(t + 1) * r].copy_from_slice(&attn_out[src..src + r]);
            }
            let base = h * (nope + v_dim) + nope;
            let w_uv = kv_b_rows(kv_b, base..base + v_dim, Orientation::OutIn);
            self.linear(&latent, n, &w_uv, &mut head_out)?;
            for t in 0..n {
                let dst = (t * heads + h) * v_dim;
                values[dst..dst + v_dim].copy_from_slice(&head_out[t * v_dim..(t + 1) * v_dim]);
            }
        }
        let mut projected = vec![0.0f32; n * arch.hidden];
        self.linear(&values, n, o_proj, &mut projected)?;
        for (x, p) in residual.iter_mut().zip(&projected) {
            *x += p;
        }
        Ok(())
    }
}
