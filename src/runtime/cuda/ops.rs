//! The CUDA backend's ops: each catalog op as kernel launches and cuBLAS GEMMs on the
//! task's CUDA stream, one function per op kind in a table keyed by [`OpKind`] (as the CPU
//! backend's `ops`), with the CPU backend's layouts so one lowered plan runs on either.
//!
//! Takes a task, the step's state and the device memory; gives the task's launches,
//! submitted in order on its stream (asynchronous), or an [`OpError`] naming what is
//! wrong. Host-side data an op needs (token ids, positions, block tables, routed rows) is
//! uploaded per task from pageable memory (CUDA stages it at the call). `experts` and the
//! fused `post_attn` group their tokens per expert on the device (`moe_group`) and run
//! each expert projection as one grouped launch over every expert's segment
//! (`moe_grouped_linear`, kernels/moe_grouped.cu): no routing read-back, one upload (the
//! experts' weight addresses) and a fixed number of launches whatever the routing. Only
//! when a member expert's weights are not all in the task's arguments do they fall back to
//! grouping on the host (the plan's read-back, else a read of the route on their own
//! stream, counted in the run report as routing syncs). `sample` reads the chosen ids (greedy: `argmax_rows` on the device) or
//! the logits (temperature sampling with the CPU's sampler) back, so tokens are the CPU's.
//!
//! Every family of `model::arch` runs: the optional pieces follow the layer layout's
//! segments and the [`ArchSpec`] flags, in the CPU's order (`pre_attn`: projections, q/k/v
//! biases, q/k RMSNorm, clip, sinks into the row, rotary; `gate`: norm, router (+ bias,
//! top-k-then-softmax for gpt-oss), the shared expert into the accumulator's last rows;
//! `combine`: routed slots by expert, then the shared row, then the residual). What the
//! kernels cannot run ([`unsupported`]) is refused at backend set-up, before any launch.

use super::graph::{floats, words, Deferred};
use super::launch::{int, row_block, storage_code, Arg, DevMatrix, LaunchError, Scratch, StreamCx};
use super::memory::{DeviceMemory, DeviceMemoryError};
use crate::ir::catalog::OpKind;
use crate::ir::{AttnPart, ExpertRef, ExpertSet, Op, Role};
use crate::lower::PlanTask;
use crate::model::arch::ArchSpec;
use crate::model::segment::SegmentKind;
use crate::model::vocab::NormKind;
use crate::model::vocab::Orientation;
use crate::model::vocab::RoutedRow;
use crate::model::vocab::Routing;
use crate::model::vocab::Sampling;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use crate::runtime::args::MissingArg;
use crate::runtime::backend::{decode_routing, ShortRoute};
use crate::runtime::host::memory::{HostMemory, View};
use crate::runtime::host::weights::WeightTag;
use crate::runtime::step::{MicroBatchState, StepContext};
use std::sync::atomic::{AtomicUsize, Ordering};

// DeepSeek's MLA, routers and dense layers: a child module so it shares these helpers.
#[path = "deepseek.rs"]
mod deepseek;

/// A task's arguments with this backend's views.
pub(crate) type TaskArgs = crate::runtime::args::TaskArgs<View>;

/// Why a CUDA op failed.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// Device or host memory.
    #[error(transparent)]
    Memory(#[from] DeviceMemoryError),
    /// A launch, allocation or GEMM.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A `route` slice too short.
    #[error(transparent)]
    Route(#[from] ShortRoute),
    /// A weight not (wholly) in the task's `w` arguments.
    #[error("{tag} is not (wholly) in the task's `w` argument(s)")]
    MissingWeight {
        /// The tensor.
        tag: WeightTag,
    },
    /// An argument the op needs is absent.
    #[error("missing `{0}` argument")]
    MissingArg(&'static str),
    /// An argument too small for the micro-batch.
    #[error("`{role}` holds {got} bytes but this micro-batch needs {needed}")]
    TooSmall {
        /// The argument.
        role: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        got: u64,
    },
    /// A micro-batch index past the step's micro-batches.
    #[error("micro-batch {0} does not exist in this run")]
    Ub(u32),
    /// What the CUDA kernels do not take (named, never run wrong).
    #[error("the CUDA kernels do not support {0}")]
    Unsupported(String),
    /// A KV block table that does not cover a token, or a block past the cache.
    #[error("KV cache: {0}")]
    Kv(String),
    /// A kernel table row that pairs an op kind with another op's kernel.
    #[error("the CUDA kernel of `{kernel}` was given a `{op}` task")]
    WrongKernel {
        /// The op the kernel implements.
        kernel: &'static str,
        /// The task's op.
        op: &'static str,
    },
}

impl From<MissingArg> for OpError {
    fn from(e: MissingArg) -> Self {
        OpError::MissingArg(e.0)
    }
}

/// Everything an op needs besides its task.
#[derive(Debug)]
pub struct GpuCx<'a> {
    /// The task's stream, device and cuBLAS handle.
    pub s: StreamCx<'a>,
    /// The gpu arena.
    pub mem: &'a DeviceMemory,
    /// The host side (views, image layout).
    pub host: &'a HostMemory<'a>,
    /// Kernel-facing architecture.
    pub arch: &'a ArchSpec,
    /// Device addresses of the rotary cos and sin tables.
    pub rope: (u64, u64),
    /// The step state.
    pub state: &'a dyn StepContext,
    /// Stored dtype of the embedding, final norm and lm_head.
    pub dtype: WeightDtype,
    /// Routing read back by an op itself (no plan read-back for its gate).
    pub routing_syncs: &'a AtomicUsize,
}

/// `ROUTER_MAX_EXPERTS` of kernels/router_topk.cu.
const ROUTER_MAX_EXPERTS: usize = 256;

/// `MOE_MAX_EXPERTS`, `MOE_TILE_M` / `MOE_TILE_N` and `MOE_GEMV_WARPS` of
/// kernels/moe_grouped.cu.
const MOE_MAX_EXPERTS: usize = 256;
const MOE_TILE_M: usize = 16;
const MOE_TILE_N: usize = 64;
const MOE_GEMV_WARPS: usize = 8;

/// Routed (token, slot) entries of one call past which the grouped SIMT kernels lose to
/// per-expert tensor-core GEMMs (cuBLAS) enough to pay for one routing read-back: a
/// prefill of 64 x 64 tokens at top-2 spent 17 ms per layer in `moe_grouped_linear` on an
/// H200 (10.6 TFLOP/s of f32 FMAs) where the GEMMs take about 1 ms. Decode steps (a token
/// per sequence) stay under it up to 512 sequences per micro-batch at top-2.
const GROUPED_MAX_ENTRIES: usize = 1024;

/// What the CUDA kernels cannot run for this model, named before any launch (backend
/// set-up calls this): the router kernels take at most 256 experts, combine top-64, the norm
/// kernels float weights. Every family's numerics (q/k norms, biases, shared experts, sinks,
/// per-layer windows, YaRN, clamped SwiGLU, DeepSeek's MLA, routers and dense layers) have
/// kernels, and every weight storage moec reads (bf16, f16, f32 and the ggml blocks Q8_0,
/// Q4_K, Q5_K, Q6_K, decoded inside the products) too, so neither is a reason.
pub fn unsupported(arch: &ArchSpec, layer: &crate::model::layout::LayerLayout) -> Option<String> {
    if let Some(why) = deepseek::unsupported(arch) {
        return Some(why);
    }
    let (e, k) = (arch.experts, arch.top_k);
    if e > ROUTER_MAX_EXPERTS || k > e || k > 64 {
        return Some(format!(
            "{e} experts with top-{k} (the router kernel takes at most {ROUTER_MAX_EXPERTS} experts, combine top-64)"
        ));
    }
    for kind in [SegmentKind::AttnNorm, SegmentKind::FfnNorm] {
        if let Some(format) = layer.segment(kind).and_then(|seg| seg.quant) {
            return Some(format!(
                "{kind:?} weights stored as {format} (the norm kernels take float weights)"
            ));
        }
    }
    None
}

/// The ggml block formats the kernels decode inside their products (the prelude's dtype
/// codes 3-9): every format moec reads.
pub const QUANT_FORMATS: [crate::quant::QuantFormat; crate::quant::QuantFormat::ALL.len()] =
    crate::quant::QuantFormat::ALL;

/// What computes with the image's block-quantised weights, for the run report: the
/// formats with how many of the image's tensors hold each, and the kernels that decode
/// them ([`StreamCx::linear`]'s choice by rows; `None` for float weights).
pub fn quant_kernels(layout: &crate::runtime::host::weights::ImageLayout) -> Option<String> {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for (_, _, tag) in layout.tags() {
        if let Some(format) = layout.storage(tag).and_then(|s| s.quant()) {
            *counts.entry(format.name()).or_insert(0) += 1;
        }
    }
    if counts.is_empty() {
        return None;
    }
    let formats: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{name} ({n} tensors)"))
        .collect();
    let activations = if crate::math::isa::Kernels::process().decodes_quant() {
        "f32 activations (MOEC_QUANT_PRODUCT=decoded)"
    } else {
        "activations rounded through ggml's 8-bit formats first (q8_roundtrip, the CPU's int8 \
         product's values)"
    };
    Some(format!(
        "quantised weights {} decoded inside the products: linear_gemv and moe_grouped_gemv \
         up to {GEMV_ROWS} rows, moe_grouped_linear's shared-memory tiles, dequant_f32 + \
         cublasSgemm for more rows or over {GEMV_OUT} outputs, embed_quant; {activations}",
        formats.join(", "),
        GEMV_ROWS = super::launch::GEMV_MAX_ROWS,
        GEMV_OUT = super::launch::GEMV_MAX_OUT,
    ))
}

type GpuKernel = fn(&GpuCx<'_>, &PlanTask, &TaskArgs) -> Result<(), OpError>;

/// The CUDA backend's implementation per op kind.
static GPU_KERNELS: &[(OpKind, GpuKernel)] = &[
    (OpKind::Embed, embed_op),
    (OpKind::PreAttn, pre_attn_op),
    (OpKind::Attn, attn_op),
    (OpKind::PostAttn, post_attn_op),
    (OpKind::OProj, o_proj_op),
    (OpKind::Gate, gate_op),
    (OpKind::Experts, experts_op),
    (OpKind::Combine, combine_op),
    (OpKind::LmHead, lm_head_op),
    (OpKind::Sample, sample_op),
    (OpKind::Copy, copy_op),
];

/// The CUDA implementation of an op kind, if there is one.
pub fn gpu_kernel(kind: OpKind) -> Option<GpuKernel> {
    GPU_KERNELS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(_, f)| *f)
}

fn wrong_op(kernel: OpKind, task: &PlanTask) -> OpError {
    OpError::WrongKernel {
        kernel: kernel.name(),
        op: task.op.name(),
    }
}

impl GpuCx<'_> {
    /// Submits one task: its op's launches, then forgets weight labels of what it wrote.
    pub fn run(&self, task: &PlanTask) -> Result<(), OpError> {
        let kind = task.op.kind();
        let kernel = gpu_kernel(kind).ok_or_else(|| {
            OpError::Unsupported(format!("the op `{}` (no CUDA kernel)", kind.name()))
        })?;
        let views = task
            .args
            .iter()
            .map(|a| {
                // A run-time expert of a layer, or the slot of a cache: resolved now.
                let expert = self.state.arg_index(task.id, a, self.arch.experts as u32);
                Ok((
                    *a,
                    self.host
                        .view(task, a, expert)
                        .map_err(DeviceMemoryError::from)?,
                ))
            })
            .collect::<Result<Vec<_>, OpError>>()?;
        let args = TaskArgs::new(views);
        kernel(self, task, &args)?;
        if kind != OpKind::Copy {
            for (a, v) in args.iter() {
                if a.access.writes() {
                    self.mem.clobber(*v);
                }
            }
        }
        Ok(())
    }

    /// An expert of an op's set (predictions never name one: elaboration refuses them).
    fn resolve_expert(&self, expert: ExpertRef) -> u32 {
        self.state.resolve_expert(expert, self.arch.experts as u32)
    }

    fn ub(&self, ub: u32) -> Result<&MicroBatchState, OpError> {
        self.state.micro_batch(ub).ok_or(OpError::Ub(ub))
    }

    /// The device address of an argument holding at least `needed` bytes.
    fn ptr(&self, view: View, role: &'static str, needed: usize) -> Result<u64, OpError> {
        if needed as u64 > view.len {
            return Err(OpError::TooSmall {
                role,
                needed: needed as u64,
                got: view.len,
            });
        }
        Ok(self.mem.ptr(view)?)
    }

    fn weight(&self, weights: &[View], tag: WeightTag) -> Result<u64, OpError> {
        let len = self.host.layout().tag_len(tag);
        let view = self
            .mem
            .find_weight(weights, tag, len)
            .ok_or(OpError::MissingWeight { tag })?;
        Ok(self.mem.ptr(view)?)
    }

    fn segment(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<DevMatrix, OpError> {
        let tag = WeightTag::Layer { layer, kind };
        let seg = self
            .host
            .layout()
            .layer_of(layer)
            .segment(kind)
            .cloned()
            .ok_or(OpError::MissingWeight { tag })?;
        Ok(DevMatrix {
            ptr: self.weight(weights, tag)?,
            dtype: seg.dtype,
            quant: seg.quant,
            rows: seg.rows,
            cols: seg.cols,
            orientation: seg.orientation.unwrap_or(Orientation::OutIn),
        })
    }

    /// A norm weight's address and the kernels' code of its float dtype (Hub checkpoints
    /// store norms in bf16, GGUF files in f32; a vector is never block-quantised, and one
    /// that claims to be is refused by name).
    fn norm_weight(&self, weights: &[View], tag: WeightTag) -> Result<(u64, i32), OpError> {
        let code = match self.storage(tag)? {
            Storage::Float(dtype) => storage_code(dtype, None),
            Storage::Quant(format) => {
                return Err(OpError::Unsupported(format!(
                    "{tag} stored as {format} (the norm kernels take float weights)"
                )))
            }
        };
        Ok((self.weight(weights, tag)?, code))
    }

    /// How tensor `tag` is stored (a float dtype or a block format).
    fn storage(&self, tag: WeightTag) -> Result<Storage, OpError> {
        self.host
            .layout()
            .storage(tag)
            .ok_or(OpError::MissingWeight { tag })
    }

    fn layer_norm_weight(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<(u64, i32), OpError> {
        self.norm_weight(weights, WeightTag::Layer { layer, kind })
    }

    /// Whether the layer layout has a segment (the optional ones of some families).
    fn has(&self, kind: SegmentKind) -> bool {
        self.host.layout().layer.segment(kind).is_some()
    }

    /// A layer's vector segment (bias, sinks, q/k norm weight) as f32 on the device: the
    /// stored one when it is f32, else widened into scratch on this stream. Gives the
    /// address, the element count and the scratch keeping it alive.
    fn vector_f32(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<(u64, usize, Option<Scratch>), OpError> {
        let m = self.segment(weights, layer, kind)?;
        let elems = m.rows * m.cols;
        let entry = match m.dtype {
            WeightDtype::F32 => return Ok((m.ptr, elems, None)),
            WeightDtype::Bf16 => "widen_bf16",
            WeightDtype::F16 => "widen_f16",
        };
        let wide = self.s.scratch(elems * 4)?;
        self.s.launch_1d(
            entry,
            elems,
            &[
                Arg::Ptr(m.ptr),
                Arg::Ptr(wide.ptr()),
                Arg::I64(elems as i64),
            ],
        )?;
        Ok((wide.ptr(), elems, Some(wide)))
    }

    /// `x[r, col + i] (+)= v[i]` for `n` rows `ld` floats apart, `v` a layer's vector
    /// segment of `cols` values (a bias, or the sinks copied into each qkv row).
    #[allow(clippy::too_many_arguments)]
    fn bias_rows(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
        x: u64,
        n: usize,
        ld: usize,
        col: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<(), OpError> {
        let (v, elems, _keep) = self.vector_f32(weights, layer, kind)?;
        if elems != cols {
            return Err(OpError::Unsupported(format!(
                "{} with {elems} values where {cols} are needed",
                WeightTag::Layer { layer, kind }
            )));
        }
        if n == 0 {
            return Ok(());
        }
        Ok(self.s.launch(
            "bias_rows",
            (int("rows", n)? as u32, 1, 1),
            row_block(cols),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(v),
                Arg::I32(int("ld", ld)?),
                Arg::I32(int("col", col)?),
                Arg::I32(int("cols", cols)?),
                Arg::I32(accumulate as i32),
            ],
        )?)
    }

    /// RMSNorm in place of columns `col..col + cols` of `n` rows `ld` floats apart, in
    /// runs as wide as the weight (Qwen3: per head; OLMoE: the whole q or k projection).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
        x: u64,
        n: usize,
        ld: usize,
        col: usize,
        cols: usize,
    ) -> Result<(), OpError> {
        let (w, chunk, _keep) = self.vector_f32(weights, layer, kind)?;
        if chunk == 0 || !cols.is_multiple_of(chunk) {
            return Err(OpError::Unsupported(format!(
                "{} of {chunk} values for {cols} columns (a divisor is needed)",
                WeightTag::Layer { layer, kind }
            )));
        }
        if n == 0 {
            return Ok(());
        }
        Ok(self.s.launch(
            "qk_rms_norm_f32",
            (int("rows", n)? as u32, int("runs", cols / chunk)? as u32, 1),
            row_block(chunk),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::I32(int("ld", ld)?),
                Arg::I32(int("col", col)?),
                Arg::I32(int("chunk", chunk)?),
                Arg::F32(self.arch.norm_eps),
            ],
        )?)
    }

    /// `h[n, d] += a[n, q] · o_projᵀ (+ o_bias)`: with a bias the projection is summed with
    /// its bias before the residual add, in the CPU's order.
    fn o_proj_residual(
        &self,
        weights: &[View],
        layer: u32,
        a: u64,
        h: u64,
        n: usize,
    ) -> Result<(), OpError> {
        if self.arch.mla.is_some() {
            return deepseek::mla_o_proj_residual(self, weights, layer, a, h, n);
        }
        let d = self.arch.hidden;
        let w = self.segment(weights, layer, SegmentKind::OProj)?;
        if !(self.arch.o_bias && self.has(SegmentKind::OBias)) {
            self.s.linear(a, n, &w, h, d, true)?;
            return Ok(());
        }
        let projected = self.s.scratch(n * d * 4)?;
        self.s.linear(a, n, &w, projected.ptr(), d, false)?;
        self.bias_rows(
            weights,
            layer,
            SegmentKind::OBias,
            projected.ptr(),
            n,
            d,
            0,
            d,
            true,
        )?;
        self.s.launch_1d(
            "add_in_place",
            n * d,
            &[
                Arg::Ptr(h),
                Arg::Ptr(projected.ptr()),
                Arg::I64((n * d) as i64),
            ],
        )?;
        Ok(())
    }

    /// The shared expert (Qwen2-MoE) on `n` rows of `x_norm` into `out` (`[n, d]`):
    /// `down(silu(gate(x)) * up(x))`, times `sigmoid(x · shared_expert_gate)` when the
    /// layer has that gate (`Kernels::shared_expert`).
    fn shared_expert(
        &self,
        weights: &[View],
        layer: u32,
        x_norm: u64,
        n: usize,
        out: u64,
    ) -> Result<(), OpError> {
        if n == 0 {
            return Ok(());
        }
        let d = self.arch.hidden;
        let gate = self.segment(weights, layer, SegmentKind::SharedGate)?;
        let up = self.segment(weights, layer, SegmentKind::SharedUp)?;
        let down = self.segment(weights, layer, SegmentKind::SharedDown)?;
        self.swiglu_mlp([gate, up, down], x_norm, n, out)?;
        if self.has(SegmentKind::SharedExpertGate) {
            let g = self.segment(weights, layer, SegmentKind::SharedExpertGate)?;
            let logits = self.s.scratch(n * 4)?;
            self.s.linear(x_norm, n, &g, logits.ptr(), 1, false)?;
            self.s.launch(
                "sigmoid_scale_rows",
                (int("rows", n)? as u32, 1, 1),
                row_block(d),
                0,
                &[
                    Arg::Ptr(out),
                    Arg::Ptr(logits.ptr()),
                    Arg::I32(int("hidden", d)?),
                ],
            )?;
        }
        Ok(())
    }

    /// `out[n, d] = down(silu(gate(x)) * up(x))` over `n` rows of `x_norm`: the SwiGLU MLP
    /// of a shared expert and of a dense layer (`Kernels::shared_expert`).
    pub(super) fn swiglu_mlp(
        &self,
        [gate, up, down]: [DevMatrix; 3],
        x_norm: u64,
        n: usize,
        out: u64,
    ) -> Result<(), OpError> {
        let f = gate.out_dim();
        let (hg, hu) = (self.s.scratch(n * f * 4)?, self.s.scratch(n * f * 4)?);
        self.s.linear(x_norm, n, &gate, hg.ptr(), f, false)?;
        self.s.linear(x_norm, n, &up, hu.ptr(), f, false)?;
        self.s.launch_1d(
            "swiglu",
            n * f,
            &[
                Arg::Ptr(hg.ptr()),
                Arg::Ptr(hu.ptr()),
                Arg::I32(int("n*ffn", n * f)?),
            ],
        )?;
        self.s
            .linear(hg.ptr(), n, &down, out, self.arch.hidden, false)?;
        Ok(())
    }

    /// `out[n, d] = norm(x[n, d]) * w` with the architecture's norm, `w` a norm weight's
    /// address and dtype code ([`GpuCx::norm_weight`]).
    fn normalize(&self, x: u64, (w, code): (u64, i32), out: u64, n: usize) -> Result<(), OpError> {
        let entry = match self.arch.norm {
            NormKind::Rms => "rms_norm",
            NormKind::LayerNoBias => "layer_norm",
        };
        let d = self.arch.hidden;
        Ok(self.s.launch(
            entry,
            (int("rows", n)? as u32, 1, 1),
            row_block(d),
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(out),
                Arg::I32(int("hidden", d)?),
                Arg::F32(self.arch.norm_eps),
                Arg::I32(code),
            ],
        )?)
    }

    /// Router logits and top-k for `n` rows of normalised `x`: gives the packed route
    /// (`[n * top_k]` (expert, weight) entries) in `route`.
    fn route(
        &self,
        weights: &[View],
        layer: u32,
        x_norm: u64,
        n: usize,
        route: u64,
    ) -> Result<(), OpError> {
        if let Some(router) = &self.arch.deepseek_router {
            return deepseek::route(self, weights, layer, router, x_norm, n, route);
        }
        let (e, k) = (self.arch.experts, self.arch.top_k);
        if e > ROUTER_MAX_EXPERTS || k > e {
            return Err(OpError::Unsupported(format!(
                "{e} experts with top-{k} (the router kernel takes at most {ROUTER_MAX_EXPERTS} experts)"
            )));
        }
        let router = self.segment(weights, layer, SegmentKind::Router)?;
        let logits = self.s.scratch(n * e * 4)?;
        self.s.linear(x_norm, n, &router, logits.ptr(), e, false)?;
        let experts = self.s.scratch(n * k * 4)?;
        let probs = self.s.scratch(n * k * 4)?;
        let mut operands = vec![
            Arg::Ptr(logits.ptr()),
            Arg::Ptr(experts.ptr()),
            Arg::Ptr(probs.ptr()),
            Arg::I32(int("rows", n)?),
            Arg::I32(int("experts", e)?),
            Arg::I32(int("top_k", k)?),
        ];
        let entry = if self.arch.router_bias_topk_softmax {
            // gpt-oss: the router bias on the logits, top-k of them, softmax over the k.
            if self.has(SegmentKind::RouterBias) {
                self.bias_rows(
                    weights,
                    layer,
                    SegmentKind::RouterBias,
                    logits.ptr(),
                    n,
                    e,
                    0,
                    e,
                    true,
                )?;
            }
            "router_topk_softmax"
        } else {
            operands.push(Arg::F32(self.arch.router_norm_p.map_or(0.0, |p| p as f32)));
            "router_topk"
        };
        self.s.launch(
            entry,
            (int("rows", n.div_ceil(64))? as u32, 1, 1),
            64,
            0,
            &operands,
        )?;
        self.s.launch_1d(
            "route_pack",
            n * k,
            &[
                Arg::Ptr(experts.ptr()),
                Arg::Ptr(probs.ptr()),
                Arg::Ptr(route),
                Arg::I64((n * k) as i64),
            ],
        )?;
        Ok(())
    }

    /// The routing of (layer, ub) on the host: the plan's read-back if there was one, else
    /// read from `route` on this stream (waits for the stream).
    fn host_routing(&self, layer: u32, ub: u32, route: u64, n: usize) -> Result<Routing, OpError> {
        if let Some(r) = self.state.read_back_routing(layer, ub) {
            return Ok(r);
        }
        let k = self.arch.top_k;
        let mut bytes = vec![0u8; n * k * 8];
        self.s.download(
            route,
            &mut bytes,
            "`experts` reads its routing back to group tokens per expert on the host",
        )?;
        self.routing_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(decode_routing(&bytes, n, k)?)
    }

    /// Every routed expert of `members` over `x_norm` (`[n, d]`), `weight * y` into each
    /// (row, slot) of `slots` (`[n, top_k, d]`).
    fn run_experts(
        &self,
        weights: &[View],
        layer: u32,
        members: &[u32],
        routing: &Routing,
        x_norm: u64,
        slots: u64,
    ) -> Result<(), OpError> {
        let (d, f, k) = (self.arch.hidden, self.arch.ffn, self.arch.top_k);
        let n_tokens = routing.experts.len() / k.max(1);
        let groups = routing.by_expert(self.arch.experts);
        for &e in members {
            let rows: &[RoutedRow] = groups.get(e as usize).map(Vec::as_slice).unwrap_or(&[]);
            if rows.is_empty() {
                continue;
            }
            if let Some(bad) = rows
                .iter()
                .find(|r| r.row as usize >= n_tokens || r.slot as usize >= k)
            {
                return Err(OpError::Unsupported(format!(
                    "a routed row ({}, slot {}) outside {n_tokens} tokens x top-{k}",
                    bad.row, bad.slot
                )));
            }
            let down = self.segment(weights, layer, SegmentKind::ExpertDown(e as usize))?;
            let m = rows.len();
            let idx: Vec<u32> = rows.iter().map(|r| r.row).collect();
            let slot_of: Vec<u32> = rows.iter().map(|r| r.slot).collect();
            let w: Vec<f32> = rows.iter().map(|r| r.weight).collect();
            let (idx, slot_of, w) = (
                self.s.upload(&idx)?,
                self.s.upload(&slot_of)?,
                self.s.upload(&w)?,
            );
            let gathered = self.s.scratch(m * d * 4)?;
            let di = int("hidden", d)?;
            self.s.launch(
                "gather_rows",
                (int("rows", m)? as u32, 1, 1),
                row_block(d),
                0,
                &[
                    Arg::Ptr(x_norm),
                    Arg::Ptr(idx.ptr()),
                    Arg::Ptr(gathered.ptr()),
                    Arg::I32(di),
                ],
            )?;
            let hg = self.s.scratch(m * f * 4)?;
            let y = self.s.scratch(m * d * 4)?;
            match self.arch.clamped_swiglu {
                Some((alpha, limit)) => {
                    // gpt-oss: fused interleaved gate/up with its bias, the clamped SwiGLU,
                    // then down with its bias (`Kernels::expert_ffn`'s fused arm).
                    let e = e as usize;
                    let gate_up = self.segment(weights, layer, SegmentKind::ExpertGateUp(e))?;
                    let gu = self.s.scratch(m * 2 * f * 4)?;
                    self.s
                        .linear(gathered.ptr(), m, &gate_up, gu.ptr(), 2 * f, false)?;
                    let bias = SegmentKind::ExpertGateUpBias(e);
                    self.bias_rows(weights, layer, bias, gu.ptr(), m, 2 * f, 0, 2 * f, true)?;
                    self.s.launch(
                        "clamped_swiglu",
                        (int("rows", m)? as u32, 1, 1),
                        row_block(f),
                        0,
                        &[
                            Arg::Ptr(gu.ptr()),
                            Arg::Ptr(hg.ptr()),
                            Arg::I32(int("ffn", f)?),
                            Arg::F32(alpha),
                            Arg::F32(limit),
                        ],
                    )?;
                    self.s.linear(hg.ptr(), m, &down, y.ptr(), d, false)?;
                    let bias = SegmentKind::ExpertDownBias(e);
                    self.bias_rows(weights, layer, bias, y.ptr(), m, d, 0, d, true)?;
                }
                None => {
                    let gate = self.segment(weights, layer, SegmentKind::ExpertGate(e as usize))?;
                    let up = self.segment(weights, layer, SegmentKind::ExpertUp(e as usize))?;
                    let hu = self.s.scratch(m * f * 4)?;
                    self.s
                        .linear(gathered.ptr(), m, &gate, hg.ptr(), f, false)?;
                    self.s.linear(gathered.ptr(), m, &up, hu.ptr(), f, false)?;
                    self.s.launch_1d(
                        "swiglu",
                        m * f,
                        &[
                            Arg::Ptr(hg.ptr()),
                            Arg::Ptr(hu.ptr()),
                            Arg::I32(int("m*ffn", m * f)?),
                        ],
                    )?;
                    self.s.linear(hg.ptr(), m, &down, y.ptr(), d, false)?;
                }
            }
            self.s.launch(
                "scatter_weighted",
                (int("rows", m)? as u32, 1, 1),
                row_block(d),
                0,
                &[
                    Arg::Ptr(y.ptr()),
                    Arg::Ptr(idx.ptr()),
                    Arg::Ptr(slot_of.ptr()),
                    Arg::Ptr(w.ptr()),
                    Arg::Ptr(slots),
                    Arg::I32(int("top_k", k)?),
                    Arg::I32(di),
                ],
            )?;
        }
        Ok(())
    }

    /// Every routed expert of `members` over `x_norm` (`[n, d]`), `weight * y` into each
    /// (row, slot) of `slots` (`[n, top_k, d]`), entirely on the device: `moe_group` groups
    /// the route's entries per member expert (count, prefix sum, permute) and
    /// `moe_grouped_linear` runs each projection over every expert's segment in one launch,
    /// reading the stored weights through a table of their addresses (one upload). No
    /// routing is read on the host, and the launches do not depend on how many experts are
    /// active: 4 (5 with gpt-oss's clamped SwiGLU) per call. Gives false, having launched
    /// nothing, when a member's weights are not all in `weights` (the caller then groups on
    /// the host, which looks up only the experts that are routed to), or when the call has
    /// more than [`GROUPED_MAX_ENTRIES`] routed entries (a prefill: the caller's per-expert
    /// cuBLAS GEMMs are faster there than the grouped kernels, after one read-back).
    #[allow(clippy::too_many_arguments)]
    fn device_experts(
        &self,
        weights: &[View],
        layer: u32,
        members: &[u32],
        route: u64,
        n: usize,
        x_norm: u64,
        slots: u64,
    ) -> Result<bool, OpError> {
        let (d, f, k, e) = (
            self.arch.hidden,
            self.arch.ffn,
            self.arch.top_k,
            self.arch.experts,
        );
        if e > MOE_MAX_EXPERTS || members.is_empty() || n == 0 {
            return Ok(members.is_empty() || n == 0);
        }
        if n * k > GROUPED_MAX_ENTRIES {
            return Ok(false);
        }
        let fused = self.arch.clamped_swiglu;
        // Per expert: [first projection, second (gate/up split only), down, first's bias,
        // down's bias]; 0 where an expert is not a member (or has no bias).
        let mut table = vec![0u64; 5 * e];
        let mut shapes: Option<[(i32, Orientation, Option<QuantFormat>); 3]> = None;
        let mut bias_dtype = WeightDtype::F32;
        for &m in members {
            let m = m as usize;
            if m >= e {
                continue;
            }
            let found = |kind| match self.segment(weights, layer, kind) {
                Ok(w) => Ok(Some(w)),
                Err(OpError::MissingWeight { .. }) => Ok(None),
                Err(other) => Err(other),
            };
            let (first, second) = match fused {
                Some(_) => (found(SegmentKind::ExpertGateUp(m))?, None),
                None => (
                    found(SegmentKind::ExpertGate(m))?,
                    found(SegmentKind::ExpertUp(m))?,
                ),
            };
            let down = found(SegmentKind::ExpertDown(m))?;
            let (Some(first), Some(down)) = (first, down) else {
                return Ok(false);
            };
            let second = match (fused, second) {
                (Some(_), _) => first,
                (None, Some(up)) => up,
                (None, None) => return Ok(false),
            };
            let shape = [first, second, down].map(|w| (w.code(), w.orientation, w.quant));
            if *shapes.get_or_insert(shape) != shape {
                return Err(OpError::Unsupported(
                    "experts of one layer stored in different formats or orientations".into(),
                ));
            }
            table[m] = first.ptr;
            table[e + m] = second.ptr;
            table[2 * e + m] = down.ptr;
            if fused.is_some() {
                for (slot, kind) in [
                    (3, SegmentKind::ExpertGateUpBias(m)),
                    (4, SegmentKind::ExpertDownBias(m)),
                ] {
                    if self.has(kind) {
                        let b = found(kind)?.ok_or(OpError::MissingWeight {
                            tag: WeightTag::Layer { layer, kind },
                        })?;
                        if b.rows * b.cols != if slot == 3 { 2 * f } else { d } {
                            return Err(OpError::Unsupported(format!(
                                "{} with {} values",
                                WeightTag::Layer { layer, kind },
                                b.rows * b.cols
                            )));
                        }
                        bias_dtype = b.dtype;
                        table[slot * e + m] = b.ptr;
                    }
                }
            }
        }
        let Some(shapes) = shapes else {
            // No member this layer has: nothing to run.
            return Ok(true);
        };
        let code = |dt: WeightDtype| storage_code(dt, None);
        // Each projection's own storage (DBRX stores down [in, out], gate and up [out, in];
        // a Q4_K_M GGUF some layers' down in Q6_K and their gate and up in Q4_K).
        let (code_of, out_in_of) = (
            |which: usize| shapes[which.min(2)].0,
            |which: usize| i32::from(shapes[which.min(2)].1 == Orientation::OutIn),
        );
        let entries = n * k;
        let n_members = members.iter().filter(|&&m| (m as usize) < e).count();
        let max_tiles = entries.div_ceil(MOE_TILE_M) + n_members;
        let table = self.s.upload(&table)?;
        let perm_row = self.s.scratch(entries * 4)?;
        let perm_slot = self.s.scratch(entries * 4)?;
        let perm_weight = self.s.scratch(entries * 4)?;
        let tiles = self.s.scratch((2 + 3 * max_tiles) * 4)?;
        self.s.launch(
            "moe_group",
            (1, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(route),
                Arg::Ptr(table.ptr() + (2 * e * 8) as u64),
                Arg::Ptr(perm_row.ptr()),
                Arg::Ptr(perm_slot.ptr()),
                Arg::Ptr(perm_weight.ptr()),
                Arg::Ptr(tiles.ptr()),
                Arg::I64(entries as i64),
                Arg::I32(int("top_k", k)?),
                Arg::I32(int("experts", e)?),
            ],
        )?;
        let tiles_x = int("tiles", max_tiles)? as u32;
        let grouped = |x: u64,
                       gather: bool,
                       mode: i32,
                       which: usize,
                       bias: usize,
                       y: u64,
                       in_dim: usize,
                       out_dim: usize| {
            let bias_ptr = if bias == 0 {
                0
            } else {
                table.ptr() + (bias * e * 8) as u64
            };
            // A warp per output feature reads a stored row: rows must be outputs.
            let (entry, per_block) = if out_in_of(which) == 1 {
                ("moe_grouped_gemv", MOE_GEMV_WARPS)
            } else {
                ("moe_grouped_linear", MOE_TILE_N)
            };
            self.s.launch(
                entry,
                (tiles_x, int("out", out_dim.div_ceil(per_block))? as u32, 1),
                256,
                0,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(perm_row.ptr()),
                    Arg::Ptr(perm_slot.ptr()),
                    Arg::Ptr(perm_weight.ptr()),
                    Arg::Ptr(tiles.ptr()),
                    Arg::Ptr(table.ptr() + (which * e * 8) as u64),
                    Arg::Ptr(bias_ptr),
                    Arg::Ptr(y),
                    Arg::I32(i32::from(gather)),
                    Arg::I32(mode),
                    Arg::I32(int("in", in_dim)?),
                    Arg::I32(int("out", out_dim)?),
                    Arg::I32(code_of(which)),
                    Arg::I32(out_in_of(which)),
                    Arg::I32(code(bias_dtype)),
                    Arg::I32(int("top_k", k)?),
                ],
            )
        };
        // Each projection multiplies its inputs as the CPU's product with its weights
        // does (8-bit activations for quantised weights unless decoded).
        let inputs = |x: u64, rows: usize, cols: usize, which: usize| {
            self.s.quant_activations(x, rows, cols, shapes[which].2)
        };
        let hidden = self.s.scratch(entries * f * 4)?;
        match fused {
            Some((alpha, limit)) => {
                let gu = self.s.scratch(entries * 2 * f * 4)?;
                grouped(inputs(x_norm, n, d, 0)?, true, 0, 0, 3, gu.ptr(), d, 2 * f)?;
                // Positions past the routed ones hold scratch; their results are never read.
                self.s.launch(
                    "clamped_swiglu",
                    (int("rows", entries)? as u32, 1, 1),
                    row_block(f),
                    0,
                    &[
                        Arg::Ptr(gu.ptr()),
                        Arg::Ptr(hidden.ptr()),
                        Arg::I32(int("ffn", f)?),
                        Arg::F32(alpha),
                        Arg::F32(limit),
                    ],
                )?;
                let down_in = inputs(hidden.ptr(), entries, f, 2)?;
                grouped(down_in, false, 2, 2, 4, slots, f, d)?;
            }
            None => {
                let gate_in = inputs(x_norm, n, d, 0)?;
                let up_in = if shapes[1].2 == shapes[0].2 {
                    gate_in
                } else {
                    inputs(x_norm, n, d, 1)?
                };
                grouped(gate_in, true, 0, 0, 0, hidden.ptr(), d, f)?;
                grouped(up_in, true, 1, 1, 0, hidden.ptr(), d, f)?;
                let down_in = inputs(hidden.ptr(), entries, f, 2)?;
                grouped(down_in, false, 2, 2, 0, slots, f, d)?;
            }
        }
        Ok(true)
    }

    /// `residual[n, d] += sum of each token's slots (+ its shared-expert row at `shared`,
    /// when not 0)` in the CPU's order (`moe::combine_shared`).
    fn combine(
        &self,
        route_experts: u64,
        slots: u64,
        shared: u64,
        residual: u64,
        n: usize,
    ) -> Result<(), OpError> {
        let (d, k) = (self.arch.hidden, self.arch.top_k);
        if k > 64 {
            return Err(OpError::Unsupported(format!(
                "top-{k} (combine takes at most 64)"
            )));
        }
        Ok(self.s.launch(
            "combine_slots",
            (int("rows", n)? as u32, 1, 1),
            row_block(d),
            0,
            &[
                Arg::Ptr(slots),
                Arg::Ptr(route_experts),
                Arg::Ptr(shared),
                Arg::Ptr(residual),
                Arg::I32(int("top_k", k)?),
                Arg::I32(int("hidden", d)?),
            ],
        )?)
    }

    fn members(&self, set: ExpertSet) -> Vec<u32> {
        set.members(self.arch.experts as u64)
            .into_iter()
            .map(|e| self.resolve_expert(e))
            .collect()
    }
}

fn copy_op(cx: &GpuCx<'_>, _task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let (src, dst) = (args.need(Role::Src)?, args.need(Role::Dst)?);
    if cx.s.recorder.recording() {
        // Between the gpu and pinned arenas: a device command like any launch.
        if let Some(commands) = cx.mem.copy_commands(cx.host, src, dst)? {
            for c in commands {
                cx.s.issue(c)?;
            }
            return Ok(());
        }
        cx.s.recorder
            .flush("a copy to or from pageable host memory")?;
    }
    cx.mem.copy(cx.host, cx.s.stream, src, dst)?;
    Ok(())
}

fn embed_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Embed { ub } = task.op else {
        return Err(wrong_op(OpKind::Embed, task));
    };
    let ids = cx.ub(ub)?.token_ids();
    let (n, d) = (ids.len(), cx.arch.hidden);
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cx.arch.vocab) {
        return Err(OpError::Unsupported(format!(
            "token id {bad} (the vocabulary has {} tokens)",
            cx.arch.vocab
        )));
    }
    let table = cx.weight(&args.all(Role::W), WeightTag::Embed)?;
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let storage = cx.storage(WeightTag::Embed)?;
    let mut operands = vec![
        Arg::Ptr(table),
        Arg::Ptr(0),
        Arg::Ptr(h),
        Arg::I32(int("hidden", d)?),
    ];
    let entry = match storage {
        Storage::Float(WeightDtype::Bf16) => "embed_bf16",
        Storage::Float(WeightDtype::F16) => "embed_f16",
        Storage::Float(WeightDtype::F32) => "embed_f32",
        Storage::Quant(format) => {
            operands.push(Arg::I32(storage_code(WeightDtype::F32, Some(format))));
            "embed_quant"
        }
    };
    let ids = cx.s.upload(&ids)?;
    operands[1] = Arg::Ptr(ids.ptr());
    cx.s.launch(
        entry,
        (int("tokens", n)? as u32, 1, 1),
        row_block(d),
        0,
        &operands,
    )?;
    Ok(())
}

fn pre_attn_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::PreAttn { layer, ub } = task.op else {
        return Err(wrong_op(OpKind::PreAttn, task));
    };
    let positions = cx.ub(ub)?.positions();
    let n = positions.len();
    let arch = cx.arch;
    let (d, q, kv) = (arch.hidden, arch.q_dim(), arch.kv_dim());
    // Row stride: q | k | v, then the sinks with them (gpt-oss).
    let width = arch.attn.qkv_width();
    let proj = q + 2 * kv;
    if let Some(&p) = positions.iter().find(|&&p| p >= arch.max_positions) {
        return Err(OpError::Unsupported(format!(
            "position {p} (the rotary tables cover {})",
            arch.max_positions
        )));
    }
    let weights = args.all(Role::W);
    let x = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let out = cx.ptr(args.need(Role::Out)?, "out", n * width * 4)?;
    if arch.mla.is_some() {
        return deepseek::mla_pre_attn(cx, &weights, layer, x, &positions, out);
    }
    let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::AttnNorm)?;
    let x_norm = cx.s.scratch(n * d * 4)?;
    cx.normalize(x, norm_w, x_norm.ptr(), n)?;
    let parts = [
        (SegmentKind::QProj, SegmentKind::QBias, 0, q),
        (SegmentKind::KProj, SegmentKind::KBias, q, kv),
        (SegmentKind::VProj, SegmentKind::VBias, q + kv, kv),
    ];
    if cx.has(SegmentKind::QkvProj) {
        // DBRX: one fused projection, [q | k | v] in its output rows.
        let w = cx.segment(&weights, layer, SegmentKind::QkvProj)?;
        cx.s.linear(x_norm.ptr(), n, &w, out, width, false)?;
    } else {
        for (kind, _, col, _) in parts {
            let w = cx.segment(&weights, layer, kind)?;
            cx.s.linear(x_norm.ptr(), n, &w, out + (col * 4) as u64, width, false)?;
        }
    }
    // Then, in the CPU's order: q/k/v biases, q/k RMSNorm, clip, sinks, rotary.
    if cx.has(SegmentKind::QBias) {
        for (_, bias, col, cols) in parts {
            cx.bias_rows(&weights, layer, bias, out, n, width, col, cols, true)?;
        }
    }
    if cx.has(SegmentKind::QNorm) {
        for (norm, col, cols) in [(SegmentKind::QNorm, 0, q), (SegmentKind::KNorm, q, kv)] {
            cx.qk_norm(&weights, layer, norm, out, n, width, col, cols)?;
        }
    }
    if let Some(clip) = arch.clip_qkv {
        cx.s.launch_1d(
            "clamp_in_place",
            n * width,
            &[Arg::Ptr(out), Arg::F32(clip), Arg::I64((n * width) as i64)],
        )?;
    }
    if arch.attn.sinks {
        let heads = arch.attn.heads;
        cx.bias_rows(
            &weights,
            layer,
            SegmentKind::Sinks,
            out,
            n,
            width,
            proj,
            heads,
            false,
        )?;
    }
    let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let pos = cx.s.upload(&pos)?;
    let rot_heads = arch.attn.heads + arch.attn.kv_heads;
    cx.s.launch(
        "rope_neox",
        (int("tokens", n)? as u32, int("heads", rot_heads)? as u32, 1),
        32,
        0,
        &[
            Arg::Ptr(out),
            Arg::Ptr(pos.ptr()),
            Arg::Ptr(cx.rope.0),
            Arg::Ptr(cx.rope.1),
            Arg::I32(int("width", width)?),
            Arg::I32(int("heads", rot_heads)?),
            Arg::I32(int("head_dim", arch.attn.head_dim)?),
        ],
    )?;
    Ok(())
}

/// Per-row sequence and position, block tables padded to `max_blocks`, for the rows of a
/// micro-batch (row order = the micro-batch's token order).
struct RowTables {
    row_seq: Vec<u32>,
    row_pos: Vec<i32>,
    tables: Vec<u32>,
    max_blocks: usize,
}

fn row_tables(mb: &MicroBatchState, tables: &[Vec<u32>]) -> RowTables {
    let max_blocks = tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut flat = vec![0u32; tables.len() * max_blocks];
    for (s, t) in tables.iter().enumerate() {
        flat[s * max_blocks..s * max_blocks + t.len()].copy_from_slice(t);
    }
    let (mut row_seq, mut row_pos) = (Vec::new(), Vec::new());
    for (s, seq) in mb.seqs.iter().enumerate() {
        for j in 0..seq.new_tokens.len() {
            row_seq.push(s as u32);
            row_pos.push((seq.context_len + j) as i32);
        }
    }
    RowTables {
        row_seq,
        row_pos,
        tables: flat,
        max_blocks,
    }
}

/// Row ranges of the sequences `pick` selects, merged where adjacent.
fn runs(mb: &MicroBatchState, pick: impl Fn(usize) -> bool) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut row = 0;
    for (s, seq) in mb.seqs.iter().enumerate() {
        let r = row..row + seq.new_tokens.len();
        row = r.end;
        if !pick(s) || r.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

fn attn_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Attn { layer, ub, part } = task.op else {
        return Err(wrong_op(OpKind::Attn, task));
    };
    let mb = cx.ub(ub)?;
    let n = mb.n_tokens();
    // The layer's geometry: gpt-oss slides its window on even layers only.
    let shape = cx.arch.attn_of(layer as usize);
    let (qw, ow) = (shape.qkv_width(), shape.q_width());
    let qkv = cx.ptr(args.need(Role::Qkv)?, "qkv", n * qw * 4)?;
    let out = cx.ptr(args.need(Role::Out)?, "out", n * ow * 4)?;
    let wanted = |s: usize| {
        mb.seqs.get(s).is_some_and(|seq| match part {
            AttnPart::All => true,
            AttnPart::Prefill => seq.prefill,
            AttnPart::Decode => !seq.prefill,
        })
    };
    let block_elems = |block: usize| block * shape.kv_heads * shape.head_dim;
    // The cache: the task's `kv` slice, or (GPU prefill over whole prompts) a scratch
    // cache holding only this call's K/V.
    let scratch_pools: Scratch;
    let (k_pool, v_pool, block, tables, append) = match args.get(Role::Kv) {
        Some(kv) => {
            let block = mb.block_size.max(1);
            let pool_blocks = (kv.len as usize / 4 / 2 / block_elems(block).max(1)) as u64;
            let pool_elems = pool_blocks as usize * block_elems(block);
            let base = cx.ptr(kv, "kv", 2 * pool_elems * 4)?;
            let tables: Vec<Vec<u32>> = mb.seqs.iter().map(|s| s.block_table.clone()).collect();
            for (seq, t) in mb.seqs.iter().zip(&tables) {
                let needed = (seq.context_len + seq.new_tokens.len()).div_ceil(block);
                if t.len() < needed || t.iter().any(|&b| u64::from(b) >= pool_blocks) {
                    return Err(OpError::Kv(format!(
                        "a block table of {} blocks (ids below {pool_blocks} needed) does not cover {} tokens of {block}",
                        t.len(),
                        seq.context_len + seq.new_tokens.len()
                    )));
                }
            }
            let all = runs(mb, |_| true);
            (base, base + (pool_elems * 4) as u64, block, tables, all)
        }
        None => {
            let block = 16;
            let mut next = 0u32;
            let mut tables = Vec::new();
            for (s, seq) in mb.seqs.iter().enumerate() {
                if wanted(s) {
                    if seq.context_len > 0 {
                        return Err(OpError::MissingArg(
                            "kv (a sequence with cached tokens needs its KV cache)",
                        ));
                    }
                    let blocks = seq.new_tokens.len().div_ceil(block) as u32;
                    tables.push((next..next + blocks).collect());
                    next += blocks;
                } else {
                    tables.push(Vec::new());
                }
            }
            let elems = next as usize * block_elems(block);
            scratch_pools = cx.s.scratch(2 * elems * 4)?;
            let base = scratch_pools.ptr();
            (
                base,
                base + (elems * 4) as u64,
                block,
                tables,
                runs(mb, wanted),
            )
        }
    };
    let attend = runs(mb, wanted);
    if attend.is_empty() && append.is_empty() {
        return Ok(());
    }
    let rt = row_tables(mb, &tables);
    let (row_seq, row_pos, tables_dev) = (
        cx.s.upload(&rt.row_seq)?,
        cx.s.upload(&rt.row_pos)?,
        cx.s.upload(&rt.tables)?,
    );
    let dims = [
        Arg::I32(int("heads", shape.heads)?),
        Arg::I32(int("kv_heads", shape.kv_heads)?),
        Arg::I32(int("head_dim", shape.head_dim)?),
        Arg::I32(int("block_size", block)?),
        Arg::I32(int("max_blocks", rt.max_blocks)?),
    ];
    let row_width = Arg::I32(int("qkv_width", qw)?);
    // gpt-oss's sinks follow q | k | v in each row; -1: none.
    let sink_col = if shape.sinks {
        int(
            "sink column",
            (shape.heads + 2 * shape.kv_heads) * shape.head_dim,
        )?
    } else {
        -1
    };
    let kvh = int("kv_heads", shape.kv_heads)? as u32;
    // A run whose sequences each bring one token (decode) uses the decode kernels: one
    // row per sequence, its block table and position indexed by the launch's sequence.
    let one_token_each = |r: &std::ops::Range<usize>| {
        rt.row_seq[r.clone()].iter().all(|&s| {
            mb.seqs
                .get(s as usize)
                .is_some_and(|q| q.new_tokens.len() == 1)
        })
    };
    let first_table = |r: &std::ops::Range<usize>| {
        let seq = rt.row_seq.get(r.start).copied().unwrap_or(0) as usize;
        tables_dev.ptr() + (seq * rt.max_blocks * 4) as u64
    };
    // The operands both kernel pairs start with: qkv rows, the pools, then the decode
    // kernels' (block tables from the run's first sequence, positions) or the row kernels'
    // (all tables, row -> sequence, positions).
    let run_operands = |r: &std::ops::Range<usize>, decode: bool| {
        let mut a = vec![
            Arg::Ptr(qkv + (r.start * qw * 4) as u64),
            Arg::Ptr(k_pool),
            Arg::Ptr(v_pool),
        ];
        if decode {
            a.push(Arg::Ptr(first_table(r)));
        } else {
            a.push(Arg::Ptr(tables_dev.ptr()));
            a.push(Arg::Ptr(row_seq.ptr() + (r.start * 4) as u64));
        }
        a.push(Arg::Ptr(row_pos.ptr() + (r.start * 4) as u64));
        a
    };
    for r in &append {
        let decode = one_token_each(r);
        let mut a = run_operands(r, decode);
        a.extend_from_slice(&dims);
        a.push(row_width);
        let entry = if decode {
            "paged_kv_append"
        } else {
            "paged_kv_append_rows"
        };
        cx.s.launch(entry, (int("rows", r.len())? as u32, kvh, 1), 32, 0, &a)?;
    }
    let window = shape.sliding_window.unwrap_or(0);
    let scale = 1.0 / (shape.head_dim as f32).sqrt();
    let group_bytes = (shape.heads / shape.kv_heads.max(1)) * shape.head_dim * 4;
    for r in &attend {
        // The scores' row stride: the most keys any row's block table can hold (at least
        // its span), not the span itself, so a decode step's launch is the same every
        // step of a batch (CUDA graphs replay it) while positions grow.
        let max_keys = r
            .clone()
            .map(|row| {
                let seq = rt.row_seq.get(row).copied().unwrap_or(0) as usize;
                let span = rt.row_pos.get(row).map_or(1, |&p| p as usize + 1);
                let held = tables.get(seq).map_or(0, |t| t.len() * block).max(span);
                if window > 0 {
                    held.min(window)
                } else {
                    held
                }
            })
            .max()
            .unwrap_or(1);
        let scores = cx.s.scratch(r.len() * shape.heads * max_keys * 4)?;
        // MLA's kernel takes the row operands for decode too.
        let decode = one_token_each(r) && cx.arch.mla.is_none();
        let mut a = run_operands(r, decode);
        a.extend_from_slice(&[
            Arg::Ptr(scores.ptr()),
            Arg::Ptr(out + (r.start * ow * 4) as u64),
        ]);
        a.extend_from_slice(&dims);
        a.extend_from_slice(&[
            Arg::I32(int("max_keys", max_keys)?),
            Arg::I32(int("sliding_window", window)?),
            Arg::F32(scale),
            row_width,
            Arg::I32(sink_col),
        ]);
        if cx.arch.mla.is_some() {
            deepseek::mla_attention(cx, r.len(), shape.heads, shape.head_dim, &mut a)?;
            continue;
        }
        let entry = if decode {
            "paged_decode_attention"
        } else {
            "paged_prefill_attention"
        };
        cx.s.launch(
            entry,
            (int("rows", r.len())? as u32, kvh, 1),
            64,
            int("shared", group_bytes)? as u32,
            &a,
        )?;
    }
    Ok(())
}

fn o_proj_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::OProj { layer, ub } = task.op else {
        return Err(wrong_op(OpKind::OProj, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let a = cx.ptr(args.need(Role::A)?, "a", n * cx.arch.q_dim() * 4)?;
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    cx.o_proj_residual(&args.all(Role::W), layer, a, h, n)
}

fn gate_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Gate { layer, ub } = task.op else {
        return Err(wrong_op(OpKind::Gate, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let weights = args.all(Role::W);
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    // `acc` = [normalised rows | one slot per (token, k) | the shared expert's rows], as
    // on the CPU (`expert_acc`).
    let acc = cx.ptr(args.need(Role::Acc)?, "acc", n * cx.arch.acc_rows() * d * 4)?;
    let route = cx.ptr(args.need(Role::Route)?, "route", n * k * 8)?;
    if cx.arch.is_dense(layer as usize) {
        return deepseek::dense_gate(cx, &weights, layer, h, acc, route, n);
    }
    let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::FfnNorm)?;
    cx.normalize(h, norm_w, acc, n)?;
    cx.route(&weights, layer, acc, n, route)?;
    cx.s.zero(acc + (n * d * 4) as u64, n * k * d * 4)?;
    // The shared expert is dense work every token does: computed with the router, as the
    // CPU's gate does, so schedules move its weights with the gate's.
    if cx.arch.shared_ffn > 0 {
        cx.shared_expert(&weights, layer, acc, n, acc + (n * (1 + k) * d * 4) as u64)?;
    }
    Ok(())
}

fn experts_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Experts { layer, ub, set } = task.op else {
        return Err(wrong_op(OpKind::Experts, task));
    };
    if cx.arch.is_dense(layer as usize) {
        // A dense layer's route chooses no expert: nothing to compute.
        return Ok(());
    }
    let n = cx.ub(ub)?.n_tokens();
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let route = cx.ptr(args.need(Role::Route)?, "route", n * k * 8)?;
    let acc = cx.ptr(args.need(Role::Acc)?, "acc", n * (1 + k) * d * 4)?;
    let members = cx.members(set);
    let weights = args.all(Role::W);
    let slots = acc + (n * d * 4) as u64;
    if cx.device_experts(&weights, layer, &members, route, n, acc, slots)? {
        return Ok(());
    }
    let routing = cx.host_routing(layer, ub, route, n)?;
    cx.run_experts(
        &args.all(Role::W),
        layer,
        &members,
        &routing,
        acc,
        acc + (n * d * 4) as u64,
    )
}

fn combine_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Combine { ub, .. } = task.op else {
        return Err(wrong_op(OpKind::Combine, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let route = cx.ptr(args.need(Role::Route)?, "route", n * k * 8)?;
    let accs = args
        .all(Role::Acc)
        .into_iter()
        .map(|v| cx.ptr(v, "acc", n * cx.arch.acc_rows() * d * 4))
        .collect::<Result<Vec<_>, _>>()?;
    // The gate wrote the shared expert's rows into the accumulator it initialised; a
    // partial accumulator copied from it holds the same rows: taken from the first.
    let shared = match accs.first() {
        Some(first) if cx.arch.shared_ffn > 0 => first + (n * (1 + k) * d * 4) as u64,
        _ => 0,
    };
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let slot_offset = (n * d * 4) as u64;
    let slot_elems = n * k * d;
    // Partial accumulators (`acc = [a, b]`): each (token, k) slot was written in one of
    // them and is zero (from the gate) in the others, so their sum is that expert's
    // output exactly; summed in argument order, as the CPU does.
    let summed: Scratch;
    let slots = match accs.as_slice() {
        [] => return Err(OpError::MissingArg("acc")),
        [one] => one + slot_offset,
        [first, rest @ ..] => {
            summed = cx.s.scratch(slot_elems * 4)?;
            cx.s.copy(summed.ptr(), first + slot_offset, slot_elems * 4)?;
            for other in rest {
                cx.s.launch_1d(
                    "add_in_place",
                    slot_elems,
                    &[
                        Arg::Ptr(summed.ptr()),
                        Arg::Ptr(other + slot_offset),
                        Arg::I64(slot_elems as i64),
                    ],
                )?;
            }
            summed.ptr()
        }
    };
    let experts = cx.s.scratch(n * k * 4)?;
    cx.s.launch_1d(
        "route_experts",
        n * k,
        &[
            Arg::Ptr(route),
            Arg::Ptr(experts.ptr()),
            Arg::I64((n * k) as i64),
        ],
    )?;
    cx.combine(experts.ptr(), slots, shared, h, n)
}

fn post_attn_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::PostAttn { layer, ub } = task.op else {
        return Err(wrong_op(OpKind::PostAttn, task));
    };
    let mb = cx.ub(ub)?;
    let n = mb.n_tokens();
    let (d, k, q) = (cx.arch.hidden, cx.arch.top_k, cx.arch.q_dim());
    let weights = args.all(Role::W);
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    // Attention rows: one `a` holds all; two (VSLPipe) hold prefill and decode rows.
    let a_args = args.all(Role::A);
    let merged: Scratch;
    let a = match a_args.as_slice() {
        [] => return Err(OpError::MissingArg("a")),
        [one] => cx.ptr(*one, "a", n * q * 4)?,
        [prefill, decode, ..] => {
            let (p, dcd) = (
                cx.ptr(*prefill, "a", n * q * 4)?,
                cx.ptr(*decode, "a", n * q * 4)?,
            );
            merged = cx.s.scratch(n * q * 4)?;
            let mut row = 0;
            for s in &mb.seqs {
                let len = s.new_tokens.len();
                let src = if s.prefill { p } else { dcd };
                let at = (row * q * 4) as u64;
                // Both ranges hold the sequence's rows (sizes checked above); the scratch
                // is this task's alone.
                cx.s.copy(merged.ptr() + at, src + at, len * q * 4)?;
                row += len;
            }
            merged.ptr()
        }
    };
    cx.o_proj_residual(&weights, layer, a, h, n)?;
    if cx.arch.is_dense(layer as usize) {
        return deepseek::dense_block(cx, &weights, layer, h, n);
    }
    let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::FfnNorm)?;
    let x_norm = cx.s.scratch(n * d * 4)?;
    cx.normalize(h, norm_w, x_norm.ptr(), n)?;
    let route = cx.s.scratch(n * k * 8)?;
    cx.route(&weights, layer, x_norm.ptr(), n, route.ptr())?;
    let slots = cx.s.scratch(n * k * d * 4)?;
    cx.s.zero(slots.ptr(), n * k * d * 4)?;
    let all: Vec<u32> = (0..cx.arch.experts as u32).collect();
    let on_device = cx.device_experts(
        &weights,
        layer,
        &all,
        route.ptr(),
        n,
        x_norm.ptr(),
        slots.ptr(),
    )?;
    if !on_device {
        // The fused op's own routing: read on this stream (a plan read-back covers only
        // gates).
        let mut bytes = vec![0u8; n * k * 8];
        cx.s.download(
            route.ptr(),
            &mut bytes,
            "`post_attn` reads its routing back to group tokens per expert on the host",
        )?;
        cx.routing_syncs.fetch_add(1, Ordering::Relaxed);
        let routing = decode_routing(&bytes, n, k)?;
        cx.state
            .note_active_experts(layer, ub, &routing, cx.arch.experts);
        cx.run_experts(&weights, layer, &all, &routing, x_norm.ptr(), slots.ptr())?;
    }
    let shared: Option<Scratch> = if cx.arch.shared_ffn > 0 {
        let out = cx.s.scratch(n * d * 4)?;
        cx.shared_expert(&weights, layer, x_norm.ptr(), n, out.ptr())?;
        Some(out)
    } else {
        None
    };
    let experts = cx.s.scratch(n * k * 4)?;
    cx.s.launch_1d(
        "route_experts",
        n * k,
        &[
            Arg::Ptr(route.ptr()),
            Arg::Ptr(experts.ptr()),
            Arg::I64((n * k) as i64),
        ],
    )?;
    let shared_ptr = shared.as_ref().map_or(0, Scratch::ptr);
    cx.combine(experts.ptr(), slots.ptr(), shared_ptr, h, n)
}

fn lm_head_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::LmHead { ub } = task.op else {
        return Err(wrong_op(OpKind::LmHead, task));
    };
    let mb = cx.ub(ub)?;
    let (d, vocab) = (cx.arch.hidden, cx.arch.vocab);
    let n = mb.n_tokens();
    let seqs = mb.seqs.len();
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let mut last = Vec::with_capacity(seqs);
    let mut row = 0u32;
    for s in &mb.seqs {
        row += s.new_tokens.len() as u32;
        last.push(row.saturating_sub(1));
    }
    let weights = args.all(Role::W);
    let norm = cx.norm_weight(&weights, WeightTag::FinalNorm)?;
    let storage = cx.storage(WeightTag::LmHead)?;
    let head = DevMatrix {
        ptr: cx.weight(&weights, WeightTag::LmHead)?,
        dtype: storage.dtype(),
        quant: storage.quant(),
        rows: vocab,
        cols: d,
        orientation: Orientation::OutIn,
    };
    let out = cx.ptr(args.need(Role::Logits)?, "logits", seqs * vocab * 4)?;
    let idx = cx.s.upload(&last)?;
    let gathered = cx.s.scratch(seqs * d * 4)?;
    cx.s.launch(
        "gather_rows",
        (int("seqs", seqs)? as u32, 1, 1),
        row_block(d),
        0,
        &[
            Arg::Ptr(h),
            Arg::Ptr(idx.ptr()),
            Arg::Ptr(gathered.ptr()),
            Arg::I32(int("hidden", d)?),
        ],
    )?;
    let normed = cx.s.scratch(seqs * d * 4)?;
    cx.normalize(gathered.ptr(), norm, normed.ptr(), seqs)?;
    cx.s.linear(normed.ptr(), seqs, &head, out, vocab, false)?;
    Ok(())
}

fn sample_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Sample { ub } = task.op else {
        return Err(wrong_op(OpKind::Sample, task));
    };
    let mb = cx.ub(ub)?;
    let (seqs, vocab) = (mb.seqs.len(), cx.arch.vocab);
    let logits = cx.ptr(args.need(Role::Logits)?, "logits", seqs * vocab * 4)?;
    let tokens_ptr = cx.ptr(args.need(Role::Tokens)?, "tokens", seqs * 4)?;
    if cx.state.wants_logits() {
        let count = seqs * vocab;
        let read =
            cx.s.read_back(logits, count * 4, |at| Deferred::Logits { ub, at, count })?;
        if let Some(bytes) = read {
            cx.state.put_logits(ub, floats(&bytes));
        }
    }
    match cx.state.sampling() {
        Sampling::Greedy => {
            cx.s.launch(
                "argmax_rows",
                (int("seqs", seqs)? as u32, 1, 1),
                256,
                0,
                &[
                    Arg::Ptr(logits),
                    Arg::Ptr(tokens_ptr),
                    Arg::I32(int("vocab", vocab)?),
                ],
            )?;
            let read =
                cx.s.read_back(tokens_ptr, seqs * 4, |at| Deferred::Sampled {
                    ub,
                    at,
                    count: seqs,
                })?;
            if let Some(bytes) = read {
                cx.state.put_sampled(ub, words(&bytes));
            }
        }
        Sampling::Temperature { .. } => {
            let mut host = vec![0f32; seqs * vocab];
            cx.s.download(
                logits,
                &mut host,
                "temperature sampling reads the logits back to the host",
            )?;
            let tokens = cx.state.sample_rows(mb, &host, vocab);
            let up = cx.s.upload(&tokens)?;
            cx.s.copy(tokens_ptr, up.ptr(), seqs * 4)?;
            cx.state.put_sampled(ub, tokens);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family's cards run on the CUDA kernels (the published ones too: up to 256
    /// experts), and what the kernels cannot take is named.
    #[test]
    fn every_card_is_supported_and_what_is_not_is_named() {
        use crate::model::card::ModelCard;
        use crate::model::layout::LayerLayout;
        for name in [
            "mixtral-tiny",
            "dbrx-tiny",
            "qwen3-moe-tiny",
            "olmoe-tiny",
            "qwen2-moe-tiny",
            "gpt-oss-tiny",
            "qwen3-30b-a3b",
            "gpt-oss-120b",
            "deepseek-v2-tiny",
            "deepseek-v3-tiny",
            "deepseek-v3",
        ] {
            let card = ModelCard::load(name).unwrap();
            let arch = ArchSpec::from_card(&card);
            let layout = LayerLayout::uniform(&arch, card.dtype);
            assert_eq!(unsupported(&arch, &layout), None, "{name}");
            let mut wide = arch.clone();
            wide.experts = 512;
            let why = unsupported(&wide, &layout).unwrap();
            assert!(why.contains("512 experts"), "{why}");
            // Float norms of any width run (a GGUF's are f32); blocks are named.
            let mut quant_norm = layout.clone();
            for seg in &mut quant_norm.segments {
                if seg.kind == SegmentKind::AttnNorm {
                    seg.quant = Some(crate::quant::QuantFormat::Q8_0);
                }
            }
            let why = unsupported(&arch, &quant_norm).unwrap();
            assert!(why.contains("AttnNorm weights stored as Q8_0"), "{why}");
        }
    }

    /// Every op of the table has a CUDA implementation (a missing row fails here, not in
    /// a user's run), and no kind has two.
    #[test]
    fn every_op_has_one_cuda_kernel() {
        for kind in OpKind::ALL {
            assert!(
                gpu_kernel(kind).is_some(),
                "{}: no CUDA kernel",
                kind.name()
            );
            assert_eq!(
                GPU_KERNELS.iter().filter(|(k, _)| *k == kind).count(),
                1,
                "{kind:?}"
            );
        }
    }
}
