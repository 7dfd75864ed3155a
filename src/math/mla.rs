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
//! `W_uv_h` before `o_proj`. `W_uk` and `W_uv` come as the checkpoint stores them
//! ([`KvUp`]): rows of the Hub's `kv_b_proj`, or llama.cpp's split `attn_k_b`/`attn_v_b`
//! multiplied as stored, so a quantised GGUF runs both products through the quantised
//! product with 8-bit activations, as llama.cpp's absorbed MLA does. Guarantees: the cache holds only the latent and the rotary key
//! (see `card::Mla` for the bytes), and the result equals transformers'
//! `DeepseekV2Attention` up to f32 summation order.

use crate::math::isa::Kernels;
use crate::math::norm::normalize;
use crate::math::qmatmul::{QuantKernels, QuantMatrix, QuantProduct};
use crate::math::rope::RopeTable;
use crate::math::tensor::{Matrix, TypedSlice};
use crate::math::{check_len, KernelError};
use crate::model::arch::ArchSpec;
use crate::model::card::Mla;
use crate::model::segment::SegmentKind;
use crate::model::vocab::NormKind;
use crate::model::vocab::Orientation;

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
    /// The keys' up-projection `W_uk`: `kv_b_proj` or llama.cpp's `attn_k_b`.
    pub kv_b: KvUp<'a>,
}

/// One of MLA's per-head up-projections (`W_uk` folded into the queries, `W_uv` expanding
/// the latent attention output) as the checkpoint stores it.
#[derive(Debug, Clone, Copy)]
pub enum KvUp<'a> {
    /// The Hub's `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`:
    /// head h's `W_uk` are rows `h * (qk_nope + v) + [0, qk_nope)`, its `W_uv` the next
    /// `v_head_dim` rows.
    Merged(Matrix<'a>),
    /// llama.cpp's split halves, multiplied as stored (out-in, so a quantised half runs
    /// through the quantised product like any GGUF matrix, as llama.cpp runs it): for the
    /// keys `attn_k_b` `[heads * kv_lora_rank, qk_nope_head_dim]`, for the values
    /// `attn_v_b` `[heads * v_head_dim, kv_lora_rank]`.
    Split(Matrix<'a>),
}

impl<'a> KvUp<'a> {
    /// The values' up-projection `W_uv` through `segment` (as [`MlaWeights::build`] takes
    /// it): the `o` part's copy of `kv_b_proj` (`KvBOut`), or `attn_v_b` (`VB`) where the
    /// checkpoint stores it `split`.
    pub fn values<E>(
        split: bool,
        segment: impl FnOnce(SegmentKind) -> Result<Matrix<'a>, E>,
    ) -> Result<Self, E> {
        Ok(if split {
            KvUp::Split(segment(SegmentKind::VB)?)
        } else {
            KvUp::Merged(segment(SegmentKind::KvBOut)?)
        })
    }

    /// Head `h`'s `W_uk` as a matrix from `qk_nope` inputs to `kv_lora_rank` outputs.
    fn key_head(&self, h: usize, g: &Geometry) -> Result<Matrix<'a>, KernelError> {
        match self {
            KvUp::Merged(w) => {
                g.check_merged(w)?;
                let base = h * (g.nope + g.v);
                Ok(with_orientation(
                    w.row_block(base..base + g.nope),
                    Orientation::InOut,
                ))
            }
            KvUp::Split(w) => {
                check_len("attn_k_b rows", w.rows, g.heads * g.r)?;
                check_len("attn_k_b columns", w.cols, g.nope)?;
                Ok(with_orientation(
                    w.row_block(h * g.r..(h + 1) * g.r),
                    Orientation::OutIn,
                ))
            }
        }
    }

    /// Head `h`'s `W_uv` as a matrix from `kv_lora_rank` inputs to `v_head_dim` outputs.
    fn value_head(&self, h: usize, g: &Geometry) -> Result<Matrix<'a>, KernelError> {
        let rows = match self {
            KvUp::Merged(w) => {
                g.check_merged(w)?;
                let base = h * (g.nope + g.v) + g.nope;
                w.row_block(base..base + g.v)
            }
            KvUp::Split(w) => {
                check_len("attn_v_b rows", w.rows, g.heads * g.v)?;
                check_len("attn_v_b columns", w.cols, g.r)?;
                w.row_block(h * g.v..(h + 1) * g.v)
            }
        };
        Ok(with_orientation(rows, Orientation::OutIn))
    }
}

impl<'a> MlaWeights<'a> {
    /// Collects the MLA segments through `segment` (a checkpoint, an image or a runtime
    /// view: each reader fetches a segment its own way); `lora` says whether the layout
    /// has the query rank's three segments or a plain `q_proj`, `split` whether it has
    /// `attn_k_b` (`KB`) rather than `kv_b_proj` (`KvB`).
    pub fn build<E>(
        lora: bool,
        split: bool,
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
            kv_b: if split {
                KvUp::Split(segment(SegmentKind::KB)?)
            } else {
                KvUp::Merged(segment(SegmentKind::KvB)?)
            },
        })
    }
}

/// `block` seen with orientation `orientation`.
fn with_orientation(mut block: Matrix<'_>, orientation: Orientation) -> Matrix<'_> {
    block.orientation = orientation;
    block
}

/// A card's MLA widths, as `usize`.
struct Geometry {
    m: Mla,
    r: usize,
    nope: usize,
    rope: usize,
    v: usize,
    heads: usize,
}

impl Geometry {
    fn of(arch: &ArchSpec) -> Result<Self, KernelError> {
        let m = arch.mla.ok_or(KernelError::Shape {
            what: "MLA geometry (the card has none)",
            expected: 1,
            got: 0,
        })?;
        Ok(Geometry {
            m,
            r: m.kv_lora_rank as usize,
            nope: m.qk_nope_head_dim as usize,
            rope: m.qk_rope_head_dim as usize,
            v: m.v_head_dim as usize,
            heads: arch.attn.heads,
        })
    }

    /// `kv_b_proj`'s shape checked against the geometry.
    fn check_merged(&self, kv_b: &Matrix<'_>) -> Result<(), KernelError> {
        check_len(
            "kv_b_proj rows",
            kv_b.rows,
            self.heads * (self.nope + self.v),
        )?;
        check_len("kv_b_proj columns", kv_b.cols, self.r)
    }
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
        let g = Geometry::of(arch)?;
        let (m, r, nope, rope_dim, heads) = (g.m, g.r, g.nope, g.rope, g.heads);
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
        let mut ckv = vec![0.0f32; n * (r + rope_dim)];
        // The products that read `x_norm` run together (`linear_many`: a quantised input
        // quantised once, one parallel region), each with the bits `linear` gives it.
        match &w.q {
            MlaQuery::Direct(q_proj) => {
                self.linear_many(x_norm, n, &[q_proj, &w.kv_a], &mut [&mut q, &mut ckv])?
            }
            MlaQuery::Lora { a, norm, b } => {
                let rank = a.out_dim();
                let mut qa = vec![0.0f32; n * rank];
                self.linear_many(x_norm, n, &[a, &w.kv_a], &mut [&mut qa, &mut ckv])?;
                check_len("q_a_layernorm", norm.len(), rank)?;
                let mut qa_norm = vec![0.0f32; n * rank];
                normalize(NormKind::Rms, &qa, *norm, LORA_NORM_EPS, &mut qa_norm);
                self.linear(&qa_norm, n, b, &mut q)?;
            }
        }
        check_len("kv_a_layernorm", w.kv_a_norm.len(), r)?;
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
        // A group of heads' `q_nope` rows, head after head (`[group, n, qk_nope]`), through
        // their `W_uk` into `[group, n, kv_lora_rank]`.
        let group = head_group(heads, n);
        let mut q_nope = vec![0.0f32; group * n * nope];
        let mut q_abs = vec![0.0f32; group * n * r];
        for h0 in (0..heads).step_by(group) {
            let hs = h0..(h0 + group).min(heads);
            let (xs, ys) = (
                &mut q_nope[..hs.len() * n * nope],
                &mut q_abs[..hs.len() * n * r],
            );
            for (i, dst) in xs.chunks_exact_mut(nope).enumerate() {
                let (h, t) = (h0 + i / n, i % n);
                let src = (t * heads + h) * qk;
                dst.copy_from_slice(&q[src..src + nope]);
            }
            let keys = hs
                .clone()
                .map(|h| w.kv_b.key_head(h, &g))
                .collect::<Result<Vec<_>, _>>()?;
            self.linear_per_head(xs, n, &keys, ys)?;
            for h in hs {
                for (t, &pos) in positions.iter().enumerate() {
                    let row = &mut qkv_out[t * width + h * hd..t * width + (h + 1) * hd];
                    let src = ((h - h0) * n + t) * r;
                    row[..r].copy_from_slice(&ys[src..src + r]);
                    let src = (t * heads + h) * qk + nope;
                    row[r..].copy_from_slice(&q[src..src + rope_dim]);
                    rotate(&mut row[r..], pos);
                    for v in row.iter_mut() {
                        *v *= q_scale;
                    }
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
    /// `[n_tokens, heads * head_dim]` latent attention outputs, `W_uv` from `kv_b` (the
    /// `o` part's `kv_b_proj` or `attn_v_b`).
    pub fn mla_o_proj_residual(
        self,
        arch: &ArchSpec,
        kv_b: &KvUp<'_>,
        o_proj: &Matrix<'_>,
        attn_out: &[f32],
        residual: &mut [f32],
    ) -> Result<(), KernelError> {
        let g = Geometry::of(arch)?;
        let (r, v_dim, heads) = (g.r, g.v, g.heads);
        let hd = arch.attn.head_dim;
        let n = attn_out.len() / (heads * hd).max(1);
        check_len("MLA o_proj input", attn_out.len(), n * heads * hd)?;
        check_len("MLA o_proj residual", residual.len(), n * arch.hidden)?;
        // A group of heads' latent rows, head after head (`[group, n, kv_lora_rank]`),
        // through their `W_uv` into `[group, n, v_head_dim]`, then to `[n, heads * v]`.
        let group = head_group(heads, n);
        let mut latent = vec![0.0f32; group * n * r];
        let mut head_out = vec![0.0f32; group * n * v_dim];
        let mut values = vec![0.0f32; n * heads * v_dim];
        for h0 in (0..heads).step_by(group) {
            let hs = h0..(h0 + group).min(heads);
            let (xs, ys) = (
                &mut latent[..hs.len() * n * r],
                &mut head_out[..hs.len() * n * v_dim],
            );
            for (i, dst) in xs.chunks_exact_mut(r).enumerate() {
                let (h, t) = (h0 + i / n, i % n);
                let src = (t * heads + h) * hd;
                dst.copy_from_slice(&attn_out[src..src + r]);
            }
            let value_heads = hs
                .map(|h| kv_b.value_head(h, &g))
                .collect::<Result<Vec<_>, _>>()?;
            self.linear_per_head(xs, n, &value_heads, ys)?;
            for (i, src) in ys.chunks_exact(v_dim).enumerate() {
                let (h, t) = (h0 + i / n, i % n);
                let dst = (t * heads + h) * v_dim;
                values[dst..dst + v_dim].copy_from_slice(src);
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

/// Activation rows (heads x tokens) a group of MLA's per-head products covers at most:
/// at decode's few tokens every head runs in one parallel region, at a prefill's hundreds
/// one head at a time (each product is large enough alone), so the grouped buffers stay
/// a few hundred rows (`256 x kv_lora_rank` f32: 512 KB at V2's 512) however long the prompt.
const HEAD_GROUP_ROWS: usize = 256;

/// Heads per group for `n` tokens ([`HEAD_GROUP_ROWS`]), at least one.
fn head_group(heads: usize, n: usize) -> usize {
    (HEAD_GROUP_ROWS / n.max(1)).clamp(1, heads.max(1))
}

impl Kernels {
    /// `outs[h] = xs[h] · ws[h]` for each head `h` of `ws`, with `xs` the heads' inputs
    /// `[heads, n, in]` and `outs` their outputs `[heads, n, out]` (one width for every
    /// head), each with the bits [`Kernels::linear`] gives it. Quantised out-in heads (a
    /// GGUF's `attn_k_b`/`attn_v_b`) run in one parallel region
    /// ([`QuantKernels::quant_products`]): a decode step's per-head products are 512 K
    /// multiply-adds each at eight rows, where one region per head paid a fork, a join and
    /// a half-idle tail sixteen times a layer. Other heads run one `linear` after another.
    fn linear_per_head(
        self,
        xs: &[f32],
        n: usize,
        ws: &[Matrix<'_>],
        outs: &mut [f32],
    ) -> Result<(), KernelError> {
        let Some(first) = ws.first() else {
            return Ok(());
        };
        let (in_dim, out_dim) = (first.in_dim(), first.out_dim());
        for w in ws {
            check_len("per-head input width", w.in_dim(), in_dim)?;
            check_len("per-head output width", w.out_dim(), out_dim)?;
        }
        check_len("per-head inputs", xs.len(), ws.len() * n * in_dim)?;
        check_len("per-head outputs", outs.len(), ws.len() * n * out_dim)?;
        if n == 0 || in_dim == 0 || out_dim == 0 {
            outs.fill(0.0);
            return Ok(());
        }
        let quant = ws
            .iter()
            .map(QuantMatrix::from_matrix)
            .collect::<Option<Vec<_>>>()
            .filter(|_| !self.decodes_quant());
        let inputs = xs.chunks_exact(n * in_dim);
        if let Some(qs) = quant {
            let products: Vec<QuantProduct<'_>> = qs
                .into_iter()
                .zip(inputs)
                .map(|(w, x)| QuantProduct { w, x, n_rows: n })
                .collect();
            let mut ys: Vec<&mut [f32]> = outs.chunks_exact_mut(n * out_dim).collect();
            QuantKernels::for_kernels(self).quant_products(&products, &mut ys)?;
            return Ok(());
        }
        for ((w, x), y) in ws
            .iter()
            .zip(inputs)
            .zip(outs.chunks_exact_mut(n * out_dim))
        {
            self.linear(x, n, w, y)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Head `h`'s `W_uk` and `W_uv` read from llama.cpp's split halves give the products
    /// transformers computes from the Hub's `kv_b_proj` (`kv_b[h][i][c]` numbered by hand,
    /// split as `convert_hf_to_gguf.py` does: `attn_k_b[h][c][i] = kv_b[h][i][c]` for the
    /// `qk_nope` key rows, `attn_v_b[h][j][c] = kv_b[h][qk_nope + j][c]`), and so do the
    /// Hub tensor's own rows: `(q_nope W_uk_h)[c] = Σ_i q_nope[i] kv_b[h][i][c]` and
    /// `(latent W_uv_hᵀ)[j] = Σ_c latent[c] kv_b[h][qk_nope + j][c]`.
    #[test]
    fn split_halves_multiply_as_kv_b_proj() {
        let (heads, r, nope, v) = (2usize, 3usize, 2usize, 2usize);
        let hub = |h: usize, i: usize, c: usize| (100 * h + 10 * i + c) as f32 / 64.0;
        let merged: Vec<f32> = (0..heads)
            .flat_map(|h| (0..nope + v).flat_map(move |i| (0..r).map(move |c| hub(h, i, c))))
            .collect();
        let k_b: Vec<f32> = (0..heads)
            .flat_map(|h| (0..r).flat_map(move |c| (0..nope).map(move |i| hub(h, i, c))))
            .collect();
        let v_b: Vec<f32> = (0..heads)
            .flat_map(|h| (0..v).flat_map(move |j| (0..r).map(move |c| hub(h, nope + j, c))))
            .collect();
        let m = Mla {
            q_lora_rank: None,
            kv_lora_rank: r as u64,
            qk_nope_head_dim: nope as u64,
            qk_rope_head_dim: 2,
            v_head_dim: v as u64,
            rope_interleave: true,
            softmax_mscale: 1.0,
            kv_b_split: true,
            values_in_keys: false,
        };
        let g = Geometry {
            m,
            r,
            nope,
            rope: 2,
            v,
            heads,
        };
        let matrix = |data: &'static [f32], rows, cols| {
            Matrix::new(TypedSlice::F32(data), rows, cols, Orientation::OutIn).unwrap()
        };
        let leak = |x: Vec<f32>| -> &'static [f32] { Box::leak(x.into_boxed_slice()) };
        let whole = KvUp::Merged(matrix(leak(merged), heads * (nope + v), r));
        let keys = KvUp::Split(matrix(leak(k_b), heads * r, nope));
        let values = KvUp::Split(matrix(leak(v_b), heads * v, r));
        let k = Kernels::process();
        let q_nope = [0.5f32, -1.25];
        let latent = [2.0f32, -0.5, 0.75];
        for h in 0..heads {
            let want: Vec<f32> = (0..r)
                .map(|c| (0..nope).map(|i| q_nope[i] * hub(h, i, c)).sum())
                .collect();
            for up in [&whole, &keys] {
                let mut got = vec![0.0f32; r];
                k.linear(&q_nope, 1, &up.key_head(h, &g).unwrap(), &mut got)
                    .unwrap();
                assert_eq!(got, want, "W_uk of head {h} from {up:?}");
            }
            let want: Vec<f32> = (0..v)
                .map(|j| (0..r).map(|c| latent[c] * hub(h, nope + j, c)).sum())
                .collect();
            for up in [&whole, &values] {
                let mut got = vec![0.0f32; v];
                k.linear(&latent, 1, &up.value_head(h, &g).unwrap(), &mut got)
                    .unwrap();
                assert_eq!(got, want, "W_uv of head {h} from {up:?}");
            }
        }
        // A half of the wrong shape is an error naming it, not a panic.
        let err = values.key_head(0, &g).unwrap_err().to_string();
        assert!(err.contains("attn_k_b"), "{err}");
    }

    /// MLA's grouped per-head products give every head the bits of its own `linear`
    /// call: four heads of a split `attn_k_b`-like `[4 x 128, 256]` in Q8_0 (the row
    /// layout and the CPU backend's tiles: one parallel region for all heads, `quant_products`)
    /// and in bf16 (one `linear` a head), at 1, 3 and 8 rows (8 rows is 1 M multiply-adds:
    /// past the parallel threshold); and `head_group` keeps a group within
    /// `HEAD_GROUP_ROWS` rows from 16 heads at decode to one head at a prefill.
    #[test]
    fn grouped_heads_give_each_head_s_own_linear_bits() {
        use crate::quant::tiles::tile;
        use crate::quant::{random_blocks, QuantFormat, QuantSlice};
        let (heads, out, inp) = (4usize, 128usize, 256usize);
        let format = QuantFormat::Q8_0;
        let elems = heads * out * inp;
        let rows_bytes = random_blocks(format, elems / 32, 23);
        let mut tiled = vec![0u8; rows_bytes.len()];
        assert!(tile(format, &rows_bytes, heads * out, inp, &mut tiled));
        let floats: Vec<half::bf16> = (0..elems)
            .map(|i| half::bf16::from_f32(((i * 7919) % 613) as f32 / 613.0 - 0.5))
            .collect();
        let datas = [
            TypedSlice::Quant(QuantSlice::new(&rows_bytes, format, elems).unwrap()),
            TypedSlice::Quant(QuantSlice::tiled(&tiled, format, elems, inp).unwrap()),
            TypedSlice::Bf16(&floats),
        ];
        let k = Kernels::process();
        for data in datas {
            let m = Matrix::new(data, heads * out, inp, Orientation::OutIn).unwrap();
            let ws: Vec<Matrix<'_>> = (0..heads)
                .map(|h| m.row_block(h * out..(h + 1) * out))
                .collect();
            for n in [1usize, 3, 8] {
                let xs: Vec<f32> = (0..heads * n * inp)
                    .map(|i| ((i * 104_729) % 1_009) as f32 / 250.0 - 2.0)
                    .collect();
                let mut got = vec![f32::NAN; heads * n * out];
                k.linear_per_head(&xs, n, &ws, &mut got).unwrap();
                for h in 0..heads {
                    let mut want = vec![0.0f32; n * out];
                    k.linear(&xs[h * n * inp..(h + 1) * n * inp], n, &ws[h], &mut want)
                        .unwrap();
                    let got = &got[h * n * out..(h + 1) * n * out];
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "head {h}, {n} rows, {:?}",
                        data.quant_format()
                    );
                }
            }
        }
        assert_eq!(head_group(16, 8), 16);
        assert_eq!(head_group(16, 64), 4);
        assert_eq!(head_group(16, 4096), 1);
        assert_eq!(head_group(16, 0), 16);
    }
}
