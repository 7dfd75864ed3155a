//! DeepSeek-V2/V3 on the CUDA backend: multi-head latent attention (MLA), DeepSeek's routers
//! and the leading dense layers, as launches on the task's stream (beside `ops`, `moe` and
//! `attention`, whose op functions call in here where a DeepSeek card differs from the
//! other families).
//!
//! Takes a task's weights and device rows; gives what the CPU backend computes for the same
//! op, in the CPU's layouts: `pre_attn` writes the absorbed MLA `qkv` rows of
//! `math::mla` (one kv head `[c | k_pe]` / `[c | 0]`, queries
//! `[q_nope W_uk_h | q_pe]` with the softmax scale folded in), so the paged cache holds the
//! latent and the rotary key and either backend can read what the other wrote; `attn` runs
//! `mla_paged_attention` over that cache; `o_proj` expands each head's latent output with
//! `W_uv_h` and projects it; `gate` routes with `deepseek_route` into the packed route the
//! device MoE path (`moe_group` / `moe_grouped_linear`) consumes, so routed experts run
//! exactly as every other family's; a leading dense layer's `gate` writes its SwiGLU into
//! the shared-expert row and a route of no expert (`math::dense`). Shared experts are the
//! common `shared_expert` path. Guarantees: no routing or activation is read on the host,
//! and what the kernels cannot take is named by [`unsupported`] before any launch.

use super::launch::{int, row_block, Arg, DevMatrix};
use super::ops::{not_supported, GpuCx, OpError};
use super::step_inputs::StepInput;
use crate::math::mla::LORA_NORM_EPS;
use crate::model::arch::ArchSpec;
use crate::model::card::{DeepseekRouter, DeepseekTopk};
use crate::model::layout::LayerLayout;
use crate::model::segment::SegmentKind;
use crate::runtime::host::memory::View;

/// `MLA_TILE_M` / `MLA_TILE_N` of kernels/mla_attention.cu.
const MLA_TILE_M: usize = 16;
const MLA_TILE_N: usize = 64;
/// `MLA_MAX_HEADS_PER_BLOCK` of kernels/mla_attention.cu.
const MLA_MAX_HEADS_PER_BLOCK: usize = 16;
/// The dynamic shared memory a launch may ask for without opting in (48 KiB).
const MAX_SHARED_BYTES: usize = 48 * 1024;
/// `DEEPSEEK_MAX_EXPERTS` of kernels/deepseek_router.cu.
const DEEPSEEK_MAX_EXPERTS: usize = 256;
/// Threads per block of the attention kernel.
const ATTENTION_THREADS: u32 = 128;

/// What the DeepSeek kernels cannot run for this architecture (None for every other
/// family, and for every shipped DeepSeek card).
pub(super) fn unsupported(arch: &ArchSpec) -> Option<String> {
    if let Some(m) = arch.mla {
        let (r, rope) = (m.kv_lora_rank as usize, m.qk_rope_head_dim as usize);
        if arch.attn.kv_heads != 1 || arch.attn.head_dim != r + rope {
            return Some(format!(
                "latent attention with {} kv heads of {} (the MLA kernels take one kv head of \
                 kv_lora_rank + qk_rope_head_dim = {})",
                arch.attn.kv_heads,
                arch.attn.head_dim,
                r + rope
            ));
        }
        if rope % 2 != 0 || arch.attn.sinks || arch.o_bias || arch.attn.sliding_window.is_some() {
            return Some(
                "latent attention with an odd rotary width, sinks, an o_proj bias or a sliding \
                 window (no DeepSeek card has them)"
                    .to_string(),
            );
        }
        let (_, shared) = attention_grid(arch.attn.heads, arch.attn.head_dim);
        if shared > MAX_SHARED_BYTES {
            return Some(format!(
                "latent attention heads of {} floats (the MLA kernel keeps up to \
                 {MLA_MAX_HEADS_PER_BLOCK} of them in 48 KiB of shared memory)",
                arch.attn.head_dim
            ));
        }
    }
    if arch.deepseek_router.is_some() && arch.experts > DEEPSEEK_MAX_EXPERTS {
        return Some(format!(
            "{} experts (the DeepSeek router kernel takes at most {DEEPSEEK_MAX_EXPERTS})",
            arch.experts
        ));
    }
    if arch.dense_layers > 0 && arch.shared_ffn == 0 {
        // The dense SwiGLU rides in the shared-expert row, which `gate` and `combine` only
        // keep when there is a shared expert.
        return Some("leading dense layers without a shared expert".to_string());
    }
    None
}

/// `(head groups, dynamic shared bytes)` of an `mla_paged_attention` launch: as few groups
/// as keep at most `MLA_MAX_HEADS_PER_BLOCK` query heads in a block.
pub(super) fn attention_grid(heads: usize, head_dim: usize) -> (usize, usize) {
    let groups = heads.div_ceil(MLA_MAX_HEADS_PER_BLOCK).max(1);
    let per_block = heads.div_ceil(groups);
    (groups, per_block * head_dim * 4)
}

/// Launches `mla_paged_attention` with paged_prefill_attention's operands `args`, for
/// `rows` query rows (`attn_op` builds the operands for both kernels alike).
pub(super) fn mla_attention(
    cx: &GpuCx<'_>,
    rows: usize,
    heads: usize,
    head_dim: usize,
    args: &mut Vec<Arg>,
) -> Result<(), OpError> {
    let m = cx.arch.mla.ok_or(OpError::MissingArg("MLA geometry"))?;
    // V = [c | 0]: only the latent columns carry values.
    args.push(Arg::I32(int("kv_lora_rank", m.kv_lora_rank as usize)?));
    let (groups, shared) = attention_grid(heads, head_dim);
    Ok(cx.s.launch(
        "mla_paged_attention",
        (
            int("rows", rows)? as u32,
            int("head groups", groups)? as u32,
            1,
        ),
        ATTENTION_THREADS,
        int("shared", shared)? as u32,
        args,
    )?)
}

/// One `mla_head_linear` launch over `heads` heads (see kernels/mla_attention.cu for the
/// operands).
#[allow(clippy::too_many_arguments)]
fn head_linear(
    cx: &GpuCx<'_>,
    x: (u64, usize, usize),
    w: &DevMatrix,
    w_head_rows: usize,
    w_row_off: usize,
    out_in: bool,
    y: (u64, usize, usize),
    n: usize,
    in_dim: usize,
    out_dim: usize,
    scale: f32,
) -> Result<(), OpError> {
    let heads = cx.arch.attn.heads;
    // Quantised halves (llama.cpp's attn_k_b/attn_v_b) multiply the CPU's 8-bit
    // activation values, as StreamCx::linear does.
    let x =
        cx.s.quant_head_activations(x, n, heads, in_dim, w.quant)?
            .unwrap_or(x);
    Ok(cx.s.launch(
        "mla_head_linear",
        (
            int("token tiles", n.div_ceil(MLA_TILE_M))? as u32,
            int("heads", heads)? as u32,
            int("output tiles", out_dim.div_ceil(MLA_TILE_N))? as u32,
        ),
        256,
        0,
        &[
            Arg::Ptr(x.0),
            Arg::I32(int("x row", x.1)?),
            Arg::I32(int("x head", x.2)?),
            Arg::I32(0),
            Arg::Ptr(w.ptr),
            Arg::I32(w.code()),
            Arg::I32(int("MLA weight columns", w.cols)?),
            Arg::I32(int("MLA weight rows per head", w_head_rows)?),
            Arg::I32(int("MLA weight row offset", w_row_off)?),
            Arg::I32(i32::from(out_in)),
            Arg::Ptr(y.0),
            Arg::I32(int("y row", y.1)?),
            Arg::I32(int("y head", y.2)?),
            Arg::I32(0),
            Arg::I32(int("tokens", n)?),
            Arg::I32(int("in", in_dim)?),
            Arg::I32(int("out", out_dim)?),
            Arg::F32(scale),
        ],
    )?)
}

/// The MLA geometry `(kv_lora_rank, qk_nope, qk_rope, v_head)` of a card, and its
/// up-projection segment `kind` (`kv_b_proj`, or llama.cpp's `attn_k_b`/`attn_v_b`) checked
/// against it.
fn geometry(
    cx: &GpuCx<'_>,
    w: &DevMatrix,
    kind: SegmentKind,
) -> Result<(usize, usize, usize, usize), OpError> {
    let m = cx.arch.mla.ok_or(OpError::MissingArg("MLA geometry"))?;
    let g = (
        m.kv_lora_rank as usize,
        m.qk_nope_head_dim as usize,
        m.qk_rope_head_dim as usize,
        m.v_head_dim as usize,
    );
    let (rows, cols, _) = LayerLayout::shape_of(cx.arch, kind);
    if w.rows != rows || w.cols != cols {
        return Err(not_supported(format!(
            "{kind:?} of {} x {} (MLA needs {rows} x {cols})",
            w.rows, w.cols
        )));
    }
    Ok(g)
}

/// MLA's `pre_attn` for the `n = positions.len()` rows of `x`: input norm, query (direct or
/// through the query rank and its norm) and latent projections, `W_uk` folded into the
/// queries, rotary of `q_pe` and `k_pe`, the latent norm, the softmax scale; writes the
/// absorbed `qkv` rows `[heads + 2, head_dim]` into `out` (`Kernels::mla_pre_attn`).
/// Positions are checked against the rotary tables by the caller.
pub(super) fn mla_pre_attn(
    cx: &GpuCx<'_>,
    weights: &[View],
    (layer, ub): (u32, u32),
    x: u64,
    positions: &[usize],
    out: u64,
) -> Result<(), OpError> {
    let arch = cx.arch;
    let m = arch.mla.ok_or(OpError::MissingArg("MLA geometry"))?;
    let n = positions.len();
    if n == 0 {
        return Ok(());
    }
    let (d, heads, hd) = (arch.hidden, arch.attn.heads, arch.attn.head_dim);
    let (key_kind, _) = LayerLayout::mla_up_kinds(&m);
    let kv_b = cx.segment(weights, layer, key_kind)?;
    let (r, nope, rope, v) = geometry(cx, &kv_b, key_kind)?;
    let qk = nope + rope;
    let width = arch.attn.qkv_width();
    if hd != r + rope || width != (heads + 2) * hd {
        return Err(not_supported(format!(
            "MLA qkv rows of {width} floats with heads of {hd} (kv_lora_rank {r} + rope {rope})"
        )));
    }
    let norm_w = cx.layer_norm_weight(weights, layer, SegmentKind::AttnNorm)?;
    let x_norm = cx.s.scratch(n * d * 4)?;
    cx.normalize(x, norm_w, x_norm.ptr(), n)?;
    let q = cx.s.scratch(n * heads * qk * 4)?;
    if m.q_lora_rank.is_some() {
        // V3: q_b_proj(q_a_layernorm(q_a_proj(x))).
        let a = cx.segment(weights, layer, SegmentKind::QAProj)?;
        let rank = a.out_dim();
        let qa = cx.s.scratch(n * rank * 4)?;
        cx.s.linear(x_norm.ptr(), n, &a, qa.ptr(), rank, false)?;
        let norm = cx.segment(weights, layer, SegmentKind::QANorm)?;
        if norm.rows * norm.cols != rank {
            return Err(not_supported(format!(
                "q_a_layernorm of {} values for a query rank of {rank}",
                norm.rows * norm.cols
            )));
        }
        let qa_norm = cx.s.scratch(n * rank * 4)?;
        cx.s.launch(
            "mla_rms_norm",
            (int("rows", n)? as u32, 1, 1),
            row_block(rank),
            0,
            &[
                Arg::Ptr(qa.ptr()),
                Arg::Ptr(norm.ptr),
                Arg::Ptr(qa_norm.ptr()),
                Arg::I32(int("q_lora_rank", rank)?),
                Arg::I32(norm.code()),
                Arg::F32(LORA_NORM_EPS),
            ],
        )?;
        let b = cx.segment(weights, layer, SegmentKind::QBProj)?;
        cx.s.linear(qa_norm.ptr(), n, &b, q.ptr(), heads * qk, false)?;
    } else {
        let w = cx.segment(weights, layer, SegmentKind::QProj)?;
        cx.s.linear(x_norm.ptr(), n, &w, q.ptr(), heads * qk, false)?;
    }
    let kv_a = cx.segment(weights, layer, SegmentKind::KvAProj)?;
    let ckv = cx.s.scratch(n * (r + rope) * 4)?;
    cx.s.linear(x_norm.ptr(), n, &kv_a, ckv.ptr(), r + rope, false)?;
    // transformers scales scores by mscale / sqrt(qk_head_dim); the attention kernel divides
    // by sqrt(head_dim), so the queries carry the ratio (computed as the CPU does).
    let q_scale = (m.softmax_mscale * (hd as f64).sqrt() / (qk as f64).sqrt()) as f32;
    // q_nope W_uk_h for every head into the first r columns of its query: W_uk_h is
    // kv_b_proj's first qk_nope rows of head h read in-out, or attn_k_b's r rows of head h
    // read as stored (out-in).
    let (head_rows, out_in) = if m.kv_b_split {
        (r, true)
    } else {
        (nope + v, false)
    };
    head_linear(
        cx,
        (q.ptr(), heads * qk, qk),
        &kv_b,
        head_rows,
        0,
        out_in,
        (out, width, hd),
        n,
        nope,
        r,
        q_scale,
    )?;
    let kv_norm = cx.segment(weights, layer, SegmentKind::KvANorm)?;
    if kv_norm.rows * kv_norm.cols != r {
        return Err(not_supported(format!(
            "kv_a_layernorm of {} values for kv_lora_rank {r}",
            kv_norm.rows * kv_norm.cols
        )));
    }
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    // The step's positions, shared by every layer (one copy of the step's inputs).
    let pos = cx.step_input(ub, StepInput::Positions, &pos)?;
    cx.s.launch(
        "mla_qkv_rows",
        (
            int("rows", n)? as u32,
            int("heads + 1", heads + 1)? as u32,
            1,
        ),
        row_block(r),
        0,
        &[
            Arg::Ptr(q.ptr()),
            Arg::Ptr(ckv.ptr()),
            Arg::Ptr(kv_norm.ptr),
            Arg::I32(kv_norm.code()),
            Arg::Ptr(pos),
            Arg::Ptr(cx.rope.0),
            Arg::Ptr(cx.rope.1),
            Arg::Ptr(out),
            Arg::I32(int("heads", heads)?),
            Arg::I32(int("qk_nope_head_dim", nope)?),
            Arg::I32(int("qk_rope_head_dim", rope)?),
            Arg::I32(int("kv_lora_rank", r)?),
            Arg::I32(i32::from(m.rope_interleave)),
            Arg::F32(q_scale),
            Arg::F32(LORA_NORM_EPS),
        ],
    )?;
    Ok(())
}

/// `h[n, d] += (per head: a_h[..kv_lora_rank] W_uv_hᵀ) · o_projᵀ` for `n` latent attention
/// rows `a` (`[n, heads * head_dim]`), as `Kernels::mla_o_proj_residual`: `W_uv` comes
/// from the copy of `kv_b_proj` that travels with `o_proj` (`KvBOut`), or from
/// llama.cpp's `attn_v_b` (`VB`) where the checkpoint stores `kv_b_proj` split.
pub(super) fn mla_o_proj_residual(
    cx: &GpuCx<'_>,
    weights: &[View],
    layer: u32,
    a: u64,
    h: u64,
    n: usize,
) -> Result<(), OpError> {
    if n == 0 {
        return Ok(());
    }
    let (heads, hd, d) = (cx.arch.attn.heads, cx.arch.attn.head_dim, cx.arch.hidden);
    let m = cx.arch.mla.ok_or(OpError::MissingArg("MLA geometry"))?;
    let (_, value_kind) = LayerLayout::mla_up_kinds(&m);
    let kv_b = cx.segment(weights, layer, value_kind)?;
    let (r, nope, _, v) = geometry(cx, &kv_b, value_kind)?;
    // W_uv_h: kv_b_proj's v rows after head h's qk_nope key rows, or attn_v_b's v rows.
    let (head_rows, row_off) = if m.kv_b_split {
        (v, 0)
    } else {
        (nope + v, nope)
    };
    let values = cx.s.scratch(n * heads * v * 4)?;
    head_linear(
        cx,
        (a, heads * hd, hd),
        &kv_b,
        head_rows,
        row_off,
        true,
        (values.ptr(), heads * v, v),
        n,
        r,
        v,
        1.0,
    )?;
    let o = cx.segment(weights, layer, SegmentKind::OProj)?;
    cx.s.linear(values.ptr(), n, &o, h, d, true)?;
    Ok(())
}

/// DeepSeek's router for `n` rows of normalised `x`: logits, then `deepseek_route` writes
/// the packed route (`[n * top_k]` (expert, weight) entries) into `route`.
pub(super) fn route(
    cx: &GpuCx<'_>,
    weights: &[View],
    layer: u32,
    router: &DeepseekRouter,
    x_norm: u64,
    n: usize,
    route: u64,
) -> Result<(), OpError> {
    let (e, k) = (cx.arch.experts, cx.arch.top_k);
    if e > DEEPSEEK_MAX_EXPERTS || k > e {
        return Err(not_supported(format!(
            "{e} experts with top-{k} (the DeepSeek router kernel takes at most {DEEPSEEK_MAX_EXPERTS} experts)"
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let w = cx.segment(weights, layer, SegmentKind::Router)?;
    let logits = cx.s.scratch(n * e * 4)?;
    cx.s.linear(x_norm, n, &w, logits.ptr(), e, false)?;
    let mode = match router.topk {
        DeepseekTopk::Greedy => 0,
        DeepseekTopk::GroupLimitedGreedy => 1,
        DeepseekTopk::NoauxTc => 2,
    };
    // V3's e_score_correction_bias (selection only); V2's routers have none.
    let has_bias = router.topk == DeepseekTopk::NoauxTc
        && cx
            .host
            .layout()
            .layer_of(layer)
            .segment(SegmentKind::RouterBias)
            .is_some();
    let (bias, _keep) = if has_bias {
        let (ptr, elems, keep) = cx.vector_f32(weights, layer, SegmentKind::RouterBias)?;
        if elems != e {
            return Err(not_supported(format!(
                "e_score_correction_bias of {elems} values for {e} experts"
            )));
        }
        (ptr, keep)
    } else {
        (0, None)
    };
    cx.s.launch(
        "deepseek_route",
        (int("rows", n.div_ceil(64))? as u32, 1, 1),
        64,
        0,
        &[
            Arg::Ptr(logits.ptr()),
            Arg::Ptr(bias),
            Arg::Ptr(route),
            Arg::I32(int("rows", n)?),
            Arg::I32(int("experts", e)?),
            Arg::I32(int("top_k", k)?),
            Arg::I32(mode),
            Arg::I32(int("n_group", router.n_group as usize)?),
            Arg::I32(int("topk_group", router.topk_group as usize)?),
            Arg::I32(i32::from(router.norm_topk_prob)),
            Arg::F32(router.routed_scaling_factor as f32),
        ],
    )?;
    Ok(())
}

/// A leading dense layer's SwiGLU `down(silu(gate(x)) * up(x))` over `n` rows of `x_norm`
/// into `out` (`[n, d]`): `Kernels::shared_expert` over `mlp.gate_proj/up_proj/down_proj`.
fn dense_swiglu(
    cx: &GpuCx<'_>,
    weights: &[View],
    layer: u32,
    x_norm: u64,
    n: usize,
    out: u64,
) -> Result<(), OpError> {
    let gate = cx.segment(weights, layer, SegmentKind::DenseGate)?;
    let up = cx.segment(weights, layer, SegmentKind::DenseUp)?;
    let down = cx.segment(weights, layer, SegmentKind::DenseDown)?;
    cx.swiglu_mlp([gate, up, down], x_norm, n, out)
}

/// A dense layer's `gate` (`math::dense`): the post-attention norm of `h` into the
/// accumulator's first rows, zero expert slots, the SwiGLU into the shared-expert row, and
/// a route of no expert (weight 0) in every slot, which `moe_group` and `combine_slots`
/// skip; `combine` then adds the SwiGLU to the residual as the CPU's `dense_block` does.
pub(super) fn dense_gate(
    cx: &GpuCx<'_>,
    weights: &[View],
    layer: u32,
    h: u64,
    acc: u64,
    route: u64,
    n: usize,
) -> Result<(), OpError> {
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let norm_w = cx.layer_norm_weight(weights, layer, SegmentKind::FfnNorm)?;
    cx.normalize(h, norm_w, acc, n)?;
    cx.s.zero(acc + (n * d * 4) as u64, n * k * d * 4)?;
    cx.s.launch_1d(
        "deepseek_no_route",
        n * k,
        &[Arg::Ptr(route), Arg::I64((n * k) as i64)],
    )?;
    if n == 0 {
        return Ok(());
    }
    dense_swiglu(
        cx,
        weights,
        layer,
        acc,
        n,
        acc + (n * (1 + k) * d * 4) as u64,
    )
}

/// A dense layer's FFN block on the residual `h` (the fused `post_attn` after `o_proj`):
/// `h += down(silu(gate(n)) * up(n))`, `n` the post-attention norm of `h`. The CPU's
/// `dense_block` adds the SwiGLU through `combine_shared` with zero expert slots, whose
/// sum `0 + y` is `y`, so one addition gives the same values.
pub(super) fn dense_block(
    cx: &GpuCx<'_>,
    weights: &[View],
    layer: u32,
    h: u64,
    n: usize,
) -> Result<(), OpError> {
    if n == 0 {
        return Ok(());
    }
    let d = cx.arch.hidden;
    let norm_w = cx.layer_norm_weight(weights, layer, SegmentKind::FfnNorm)?;
    let x_norm = cx.s.scratch(n * d * 4)?;
    cx.normalize(h, norm_w, x_norm.ptr(), n)?;
    let out = cx.s.scratch(n * d * 4)?;
    dense_swiglu(cx, weights, layer, x_norm.ptr(), n, out.ptr())?;
    cx.s.launch_1d(
        "add_in_place",
        n * d,
        &[Arg::Ptr(h), Arg::Ptr(out.ptr()), Arg::I64((n * d) as i64)],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::card::ModelCard;

    /// Both DeepSeek tiny cards and the real ones run on these kernels; the attention
    /// launch of DeepSeek-V3 (128 heads of 576) splits its heads into groups of 16 within
    /// 48 KiB; a card the kernels cannot take is named.
    #[test]
    fn deepseek_cards_fit_the_kernels_and_what_does_not_is_named() {
        for name in [
            "deepseek-v2-tiny",
            "deepseek-v3-tiny",
            "deepseek-v2-lite",
            "deepseek-v3",
        ] {
            let arch = ArchSpec::from_card(&ModelCard::load(name).unwrap());
            assert_eq!(unsupported(&arch), None, "{name}");
        }
        let v3 = ArchSpec::from_card(&ModelCard::load("deepseek-v3").unwrap());
        assert_eq!(attention_grid(128, 576), (8, 16 * 576 * 4));
        assert_eq!(attention_grid(4, 80), (1, 4 * 80 * 4));
        assert_eq!(attention_grid(20, 80), (2, 10 * 80 * 4));
        let mut wide = v3.clone();
        wide.experts = 512;
        assert!(unsupported(&wide).unwrap().contains("512 experts"));
        let mut two_kv = v3.clone();
        two_kv.attn.kv_heads = 2;
        assert!(unsupported(&two_kv).unwrap().contains("2 kv heads"));
        let mut no_shared = v3;
        no_shared.shared_ffn = 0;
        assert!(unsupported(&no_shared).unwrap().contains("dense layers"));
    }
}
