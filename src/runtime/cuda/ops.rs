//! The CUDA backend's op table and weight addressing: each catalog op as kernel launches
//! and cuBLAS GEMMs on the task's CUDA stream, one function per op kind in a table keyed by
//! [`OpKind`] (a `runtime::ops::OpTable`, as the CPU backend's), with the CPU backend's
//! layouts so one lowered plan runs on either.
//!
//! Takes a task, the step's state and the device memory; gives the task's launches,
//! submitted in order on its stream (asynchronous), or an [`OpError`] naming what is
//! wrong. Host-side data an op needs is uploaded from pageable memory (CUDA stages it at
//! the call): the step's token ids, positions and block tables as one buffer a step
//! (`super::step_inputs`), routed rows per task. This module holds
//! the table, [`GpuCx`] (an op's context) with the addressing of arguments and weights
//! every op uses (sizes checked, segments found by content, norm and vector weights in the
//! kernels' dtype codes), and the ops that are a few launches each (`copy`, `embed`,
//! `pre_attn`, `o_proj`, `lm_head`, `sample`). The MoE layer (`gate`, `experts`,
//! `combine`, the fused `post_attn`) is `super::moe`, attention `super::attention`, and
//! DeepSeek's MLA, routers and dense layers `super::deepseek`. `sample` reads the chosen
//! ids (greedy: `argmax_rows` on the device) or the logits (temperature sampling with the
//! CPU's sampler) back, so tokens are the CPU's.
//!
//! Every family of `model::arch` runs: the optional pieces follow the layer layout's
//! segments and the [`ArchSpec`] flags, in the CPU's order (`pre_attn`: projections, q/k/v
//! biases, q/k RMSNorm, clip, sinks into the row, rotary). What the kernels cannot run
//! ([`unsupported`]) is refused at backend set-up, before any launch.

use super::attention::attn_op;
use super::deepseek;
use super::graph::{floats, words, Deferred};
use super::launch::{
    int, row_block, storage_code, Arg, DevMatrix, LaunchError, RmsNormArg, Scratch, StreamCx,
};
use super::memory::{DeviceMemory, DeviceMemoryError};
use super::moe::{combine_op, experts_op, gate_op, post_attn_op, pregate_op, ROUTER_MAX_EXPERTS};
use super::step_inputs::StepInput;
use crate::ir::catalog::OpKind;
use crate::ir::{Op, Role, Space};
use crate::lower::PlanTask;
use crate::model::arch::ArchSpec;
use crate::model::segment::SegmentKind;
use crate::model::vocab::NormKind;
use crate::model::vocab::Orientation;
use crate::model::vocab::Sampling;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::runtime::host::memory::{HostMemory, Region, View};
use crate::runtime::host::weights::WeightTag;
use crate::runtime::ops::{run_task, sized, OpCx, OpTable, TaskArgs};
use crate::runtime::step::StepContext;
use std::sync::atomic::AtomicUsize;

pub use crate::runtime::ops::OpError;

// Device memory and launches fail in the driver's words.
impl From<DeviceMemoryError> for OpError {
    fn from(e: DeviceMemoryError) -> Self {
        OpError::Backend(Box::new(e))
    }
}

impl From<LaunchError> for OpError {
    fn from(e: LaunchError) -> Self {
        OpError::Backend(Box::new(e))
    }
}

/// `what` is beyond the CUDA kernels (named, never run wrong).
pub(super) fn not_supported(what: String) -> OpError {
    OpError::Unsupported {
        backend: <GpuCx<'_> as OpCx>::BACKEND,
        what,
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
    /// What the device tokens buffers hold from their last `sample`.
    pub sampled_ids: &'a SampledIds,
    /// The device address of this stream's pair of expert counters (all, from a format
    /// copy: `super::format_copies::ExpertSources`), `0` when the plan has no format copy
    /// (nothing counted on the device).
    pub expert_counts: u64,
}

/// The ids each device tokens buffer (by address) holds from the `sample` that last wrote
/// it, known on the host once its read-back arrived. `embed` of a decode step whose ids
/// are exactly those reads them where `sample` left them instead of uploading them (no
/// copy node a step, and nothing of the host between one step's sampling and the next
/// step's embedding): the plan's value check makes a decode `embed`'s tokens argument the
/// buffer its micro-batch's `sample` wrote, and equal ids mean equal rows, whatever joined
/// or left the batch.
#[derive(Debug, Default)]
pub struct SampledIds(std::sync::Mutex<std::collections::HashMap<u64, Vec<u32>>>);

impl SampledIds {
    /// `sample` wrote `ids` at device address `dst`.
    pub fn wrote(&self, dst: u64, ids: &[u32]) {
        crate::runtime::sync::lock(&self.0).insert(dst, ids.to_vec());
    }

    /// Forgets the buffers a copy into device bytes `[start, start + len)` overlaps (a
    /// schedule that samples on the host and copies the ids over): those are not trusted
    /// until their next `sample`. Only the copy's own destination is forgotten, never every
    /// buffer: a weight copy on another stream that happens to run before this step's
    /// `embed` must not change what `embed` issues (an upload instead of the sampled ids),
    /// or the step's commands would depend on the stream threads' timing and a decode step
    /// would be captured into a CUDA graph in some runs only.
    fn forget_overlapping(&self, start: u64, len: u64) {
        crate::runtime::sync::lock(&self.0).retain(|&at, ids| {
            at >= start.saturating_add(len) || at + 4 * ids.len() as u64 <= start
        });
    }

    /// Whether the buffer at `at` holds exactly `ids` from its last `sample`.
    pub(super) fn holds(&self, at: u64, ids: &[u32]) -> bool {
        crate::runtime::sync::lock(&self.0)
            .get(&at)
            .is_some_and(|held| held.as_slice() == ids)
    }
}

impl OpCx for GpuCx<'_> {
    const BACKEND: &'static str = "CUDA";

    fn step(&self) -> &dyn StepContext {
        self.state
    }

    fn experts(&self) -> usize {
        self.arch.experts
    }
}

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
/// codes 3-9): every format moec reads but Q5_0, which has no kernels yet, so the registry
/// refuses a checkpoint holding a Q5_0 tensor, naming it, before set-up.
pub const QUANT_FORMATS: [crate::quant::QuantFormat; 7] = {
    use crate::quant::QuantFormat::*;
    [Q4_0, Q4_1, Q8_0, Q4K, Q5K, Q6K, Mxfp4]
};

/// What computes the image's products, for the run report: the block-quantised formats
/// with how many of the image's tensors hold each, and the kernels that run them
/// ([`StreamCx::linear`]'s and the experts' choices by rows), or the float weights'
/// kernels.
pub fn quant_kernels(layout: &crate::runtime::host::weights::ImageLayout) -> Option<String> {
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for (_, _, tag) in layout.tags() {
        if let Some(format) = layout.storage(tag).and_then(|s| s.quant()) {
            *counts.entry(format.name()).or_insert(0) += 1;
        }
    }
    if counts.is_empty() {
        return Some(format!(
            "float weights: linear_gemv up to {GEMV_ROWS} rows and {GEMV_OUT} outputs \
             (linear_gemv_1 for one row of bf16/f16; q|k|v and a shared expert's gate|up in \
             one linear_gemv3{ONE}; cuBLAS beyond); experts up to {GROUPED} routed entries: \
             moe_group, moe_grouped_gemv (moe_grouped_gemv_1 at one token with bf16/f16 \
             experts{ROWS}) with gate+up+SwiGLU in one launch, then down (one launch per \
             projection for gpt-oss's biased gate/up and [in, out] storage); the fused MoE \
             gate: {GATE}; {TC}",
            ROWS = match super::launch::staged_expert_kernels() {
                Ok(true) => {
                    ", moe_grouped_gemv_rows at 2-16 rows per expert of bf16/f16: rows staged, \
                     grid from the routed entries, split-K for small outputs \
                     (MOEC_FLOAT_KERNELS=staged-experts)"
                }
                Ok(false) => {
                    ", the generic form at 2-16 rows per expert (moe_grouped_gemv_rows: \
                     MOEC_FLOAT_KERNELS=staged-experts)"
                }
                Err(_) => "",
            },
            ONE = match super::launch::warp_float_kernels() {
                Ok(true) => match super::launch::staged_row_kernels() {
                    Ok(true) => {
                        ", linear_gemv3_1 for one row of bf16/f16, linear_gemv(3)_r4/_r16 for \
                         2-16 rows of bf16/f16"
                    }
                    _ => {
                        ", linear_gemv3_1 for one row of bf16/f16, the generic forms for 2-16 \
                         rows (MOEC_FLOAT_KERNELS=generic-rows)"
                    }
                },
                Ok(false) => " (MOEC_FLOAT_KERNELS=block)",
                Err(_) => "",
            },
            GATE = match super::launch::warp_float_kernels() {
                Ok(true) => "moe_gate_route (warp top-k), moe_group by warp scans".to_string(),
                Ok(false) => "moe_gate_route_block and moe_group_block (MOEC_FLOAT_KERNELS=block)"
                    .to_string(),
                Err(e) => e,
            },
            TC = super::tensor_cores::tensor_core_note(),
            GEMV_ROWS = super::launch::GEMV_MAX_ROWS,
            GEMV_OUT = super::launch::GEMV_MAX_OUT,
            GROUPED = super::moe::GROUPED_MAX_ENTRIES,
        ));
    }
    let formats: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{name} ({n} tensors)"))
        .collect();
    let few_rows = if crate::math::isa::Kernels::process().decodes_quant() {
        "blocks decoded inside the f32 products (MOEC_QUANT_PRODUCT=decoded): linear_gemv and \
         moe_grouped_gemv"
            .to_string()
    } else {
        format!(
            "Q8_0/Q4_K/Q5_K/Q6_K as integer products (__dp4a) on activations quantised once per \
             input (q8_quantize shared by q, k and v and by gate and up; q|k|v in one linear_gemv3_q8; \
             linear_gemv_q8, vocabulary heads included, and moe_grouped_gemv_q8 with gate+up+SwiGLU in one launch; {}); Q4_0, \
             Q4_1 and MXFP4 decoded inside the f32 products (linear_gemv, moe_grouped_gemv) on \
             activations rounded by q8_roundtrip",
            super::launch::q8_kernel_note()
        )
    };
    Some(format!(
        "quantised weights {}: up to {GEMV_ROWS} rows {few_rows}; more rows: \
         moe_grouped_linear's shared-memory tiles, dequant_f32 + cublasSgemm; embed_quant; {TC}",
        formats.join(", "),
        TC = super::tensor_cores::tensor_core_note(),
        GEMV_ROWS = super::launch::GEMV_MAX_ROWS,
    ))
}

type GpuKernel = fn(&GpuCx<'_>, &PlanTask, &TaskArgs) -> Result<(), OpError>;

/// The CUDA backend's implementation per op kind.
static GPU_KERNELS: OpTable<GpuKernel> = OpTable::new(
    "CUDA",
    &[
        (OpKind::Embed, embed_op),
        (OpKind::PreAttn, pre_attn_op),
        (OpKind::Attn, attn_op),
        (OpKind::PostAttn, post_attn_op),
        (OpKind::OProj, o_proj_op),
        (OpKind::Gate, gate_op),
        (OpKind::Pregate, pregate_op),
        (OpKind::Experts, experts_op),
        (OpKind::Combine, combine_op),
        (OpKind::LmHead, lm_head_op),
        (OpKind::Sample, sample_op),
        (OpKind::Copy, copy_op),
    ],
);

impl GpuCx<'_> {
    /// Submits one task: its op's launches, then forgets weight labels of what it wrote.
    pub fn run(&self, task: &PlanTask) -> Result<(), OpError> {
        let kernel = GPU_KERNELS.kernel(task.op.kind())?;
        run_task(
            self,
            self.host,
            task,
            |args| kernel(self, task, args),
            |v| self.mem.clobber(v),
        )
    }

    /// The device address of an argument holding at least `needed` bytes.
    pub(super) fn ptr(
        &self,
        view: View,
        role: &'static str,
        needed: usize,
    ) -> Result<u64, OpError> {
        Ok(self.mem.ptr(sized(view, role, needed)?)?)
    }

    pub(super) fn weight(&self, weights: &[View], tag: WeightTag) -> Result<u64, OpError> {
        let len = self.host.layout().tag_len(tag);
        let view = self
            .mem
            .find_weight(weights, tag, len)
            .ok_or(OpError::MissingWeight { tag })?;
        Ok(self.mem.ptr(view)?)
    }

    pub(super) fn segment(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<DevMatrix, OpError> {
        Ok(self.segment_source(weights, layer, kind)?.0)
    }

    /// [`GpuCx::segment`], and whether a routed expert's segment was found only as a
    /// format copy (`WeightTag::Converted`, `W[l].expert(e).format(q8_0)`; the checker
    /// proved the schedule declares that substitute): then the matrix is the
    /// checkpoint's shape in the copy's blocks, which the quantised kernels multiply as
    /// they do a quantised checkpoint's. The host engine's ops find a segment the same
    /// way, so both count a substituted expert alike.
    pub(super) fn segment_source(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<(DevMatrix, bool), OpError> {
        let tag = WeightTag::Layer { layer, kind };
        let seg = self
            .host
            .layout()
            .layer_of(layer)
            .segment(kind)
            .cloned()
            .ok_or(OpError::MissingWeight { tag })?;
        let orientation = seg.orientation.unwrap_or(Orientation::OutIn);
        match self.weight(weights, tag) {
            Ok(ptr) => {
                return Ok((
                    DevMatrix {
                        ptr,
                        dtype: seg.dtype,
                        quant: seg.quant,
                        rows: seg.rows,
                        cols: seg.cols,
                        orientation,
                    },
                    false,
                ))
            }
            Err(OpError::MissingWeight { .. }) if kind.expert().is_some() => {}
            Err(other) => return Err(other),
        }
        for &format in self.host.converted_formats() {
            let converted = WeightTag::Converted {
                layer,
                kind,
                format,
            };
            let ptr = match self.weight(weights, converted) {
                Ok(ptr) => ptr,
                Err(OpError::MissingWeight { .. }) => continue,
                Err(other) => return Err(other),
            };
            // A copy holds the matrix `[out, in]`, transposed where the checkpoint stores
            // it `[in, out]` (`model::layout::Segment::block_copy_shape`).
            let (rows, cols, orientation) = seg.block_copy_shape();
            return Ok((
                DevMatrix {
                    ptr,
                    dtype: WeightDtype::F32,
                    quant: Some(format),
                    rows,
                    cols,
                    orientation,
                },
                true,
            ));
        }
        Err(OpError::MissingWeight { tag })
    }

    /// A norm weight's address and the kernels' code of its float dtype (Hub checkpoints
    /// store norms in bf16, GGUF files in f32; a vector is never block-quantised, and one
    /// that claims to be is refused by name).
    pub(super) fn norm_weight(
        &self,
        weights: &[View],
        tag: WeightTag,
    ) -> Result<(u64, i32), OpError> {
        let code = match self.storage(tag)? {
            Storage::Float(dtype) => storage_code(dtype, None),
            Storage::Quant(format) => {
                return Err(not_supported(format!(
                    "{tag} stored as {format} (the norm kernels take float weights)"
                )))
            }
        };
        Ok((self.weight(weights, tag)?, code))
    }

    /// How tensor `tag` is stored (a float dtype or a block format).
    pub(super) fn storage(&self, tag: WeightTag) -> Result<Storage, OpError> {
        self.host
            .layout()
            .storage(tag)
            .ok_or(OpError::MissingWeight { tag })
    }

    pub(super) fn layer_norm_weight(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<(u64, i32), OpError> {
        self.norm_weight(weights, WeightTag::Layer { layer, kind })
    }

    /// Whether the layer layout has a segment (the optional ones of some families).
    pub(super) fn has(&self, kind: SegmentKind) -> bool {
        self.host.layout().layer.segment(kind).is_some()
    }

    /// A layer's vector segment (bias, sinks, q/k norm weight) as f32 on the device: the
    /// stored one when it is f32, else widened into scratch on this stream. Gives the
    /// address, the element count and the scratch keeping it alive.
    pub(super) fn vector_f32(
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
    pub(super) fn bias_rows(
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
            return Err(not_supported(format!(
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
    pub(super) fn qk_norm(
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
            return Err(not_supported(format!(
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
    pub(super) fn o_proj_residual(
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

    /// `out[n, d] = norm(x[n, d]) * w` with the architecture's norm, `w` a norm weight's
    /// address and dtype code ([`GpuCx::norm_weight`]).
    pub(super) fn normalize(
        &self,
        x: u64,
        (w, code): (u64, i32),
        out: u64,
        n: usize,
    ) -> Result<(), OpError> {
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
}

fn copy_op(cx: &GpuCx<'_>, _task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let (src, dst) = (args.need(Role::Src)?, args.need(Role::Dst)?);
    // Sampled ids live in the gpu arena: a copy elsewhere cannot overwrite them.
    if dst.region == Region::Arena(Space::Gpu) {
        cx.sampled_ids.forget_overlapping(cx.mem.ptr(dst)?, dst.len);
    }
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
        return Err(cx.wrong_op(OpKind::Embed, task));
    };
    let ids = cx.ub(ub)?.token_ids();
    let (n, d) = (ids.len(), cx.arch.hidden);
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= cx.arch.vocab) {
        return Err(not_supported(format!(
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
    // A decode step's ids where the last step's `sample` left them, when they are those (a
    // tokens argument that is not device memory of the ids' size holds none of them).
    let on_device = args
        .all(Role::Tokens)
        .first()
        .and_then(|&tokens| cx.ptr(tokens, "tokens", n * 4).ok())
        .filter(|&at| cx.sampled_ids.holds(at, &ids));
    operands[1] = Arg::Ptr(match on_device {
        Some(at) => {
            // A graph launched without its ops needs the ids there again.
            cx.s.recorder.note_device_ids(ub, at);
            at
        }
        None => cx.step_input(ub, StepInput::Ids, &ids)?,
    });
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
        return Err(cx.wrong_op(OpKind::PreAttn, task));
    };
    let positions = cx.ub(ub)?.positions();
    let n = positions.len();
    let arch = cx.arch;
    let (d, q, kv) = (arch.hidden, arch.q_dim(), arch.kv_dim());
    // Row stride: q | k | v, then the sinks with them (gpt-oss).
    let width = arch.attn.qkv_width();
    let proj = q + 2 * kv;
    if let Some(&p) = positions.iter().find(|&&p| p >= arch.max_positions) {
        return Err(not_supported(format!(
            "position {p} (the rotary tables cover {})",
            arch.max_positions
        )));
    }
    let weights = args.all(Role::W);
    let x = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let out = cx.ptr(args.need(Role::Out)?, "out", n * width * 4)?;
    if arch.mla.is_some() {
        return deepseek::mla_pre_attn(cx, &weights, (layer, ub), x, &positions, out);
    }
    let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::AttnNorm)?;
    let parts = [
        (SegmentKind::QProj, SegmentKind::QBias, 0, q),
        (SegmentKind::KProj, SegmentKind::KBias, q, kv),
        (SegmentKind::VProj, SegmentKind::VBias, q + kv, kv),
    ];
    if cx.has(SegmentKind::QkvProj) {
        // DBRX: one fused projection, [q | k | v] in its output rows.
        let w = cx.segment(&weights, layer, SegmentKind::QkvProj)?;
        let x_norm = cx.s.scratch(n * d * 4)?;
        cx.normalize(x, norm_w, x_norm.ptr(), n)?;
        cx.s.linear(x_norm.ptr(), n, &w, out, width, false)?;
    } else {
        // q, k and v of one input: integer products quantise it once and share it.
        let ws = parts
            .iter()
            .map(|&(kind, _, col, _)| Ok((cx.segment(&weights, layer, kind)?, col)))
            .collect::<Result<Vec<_>, OpError>>()?;
        let products: Vec<_> = ws
            .iter()
            .map(|(w, col)| (w, out + (col * 4) as u64, width, false))
            .collect();
        // Float q|k|v of an RMSNorm'd input: the norm inside their launch.
        let rms = RmsNormArg {
            weight: norm_w.0,
            code: norm_w.1,
            eps: arch.norm_eps,
            width: d,
        };
        let folded =
            arch.norm == NormKind::Rms && cx.s.linear_shared_rms_normed(x, n, rms, &products)?;
        if !folded {
            let x_norm = cx.s.scratch(n * d * 4)?;
            cx.normalize(x, norm_w, x_norm.ptr(), n)?;
            cx.s.linear_shared(x_norm.ptr(), n, &products)?;
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
    // The step's positions, read where `attn` reads them (one copy of the step's inputs).
    let pos = cx.step_input(ub, StepInput::Positions, &pos)?;
    let rot_heads = arch.attn.heads + arch.attn.kv_heads;
    cx.s.launch(
        "rope_neox",
        (int("tokens", n)? as u32, int("heads", rot_heads)? as u32, 1),
        32,
        0,
        &[
            Arg::Ptr(out),
            Arg::Ptr(pos),
            Arg::Ptr(cx.rope.0),
            Arg::Ptr(cx.rope.1),
            Arg::I32(int("width", width)?),
            Arg::I32(int("heads", rot_heads)?),
            Arg::I32(int("head_dim", arch.attn.head_dim)?),
        ],
    )?;
    Ok(())
}

fn o_proj_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::OProj { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::OProj, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let a = cx.ptr(args.need(Role::A)?, "a", n * cx.arch.q_dim() * 4)?;
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    cx.o_proj_residual(&args.all(Role::W), layer, a, h, n)
}

fn lm_head_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::LmHead { ub } = task.op else {
        return Err(cx.wrong_op(OpKind::LmHead, task));
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
    let idx = cx.step_input(ub, StepInput::LastRows, &last)?;
    let gathered = cx.s.scratch(seqs * d * 4)?;
    cx.s.launch(
        "gather_rows",
        (int("seqs", seqs)? as u32, 1, 1),
        row_block(d),
        0,
        &[
            Arg::Ptr(h),
            Arg::Ptr(idx),
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
        return Err(cx.wrong_op(OpKind::Sample, task));
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
                // A row's scan is a chain of dependent compares per thread: 1024 threads
                // make it a quarter of 256's (56 us for 32k logits on an H200 at 256).
                1024,
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
                    dst: tokens_ptr,
                })?;
            if let Some(bytes) = read {
                let ids = words(&bytes);
                cx.sampled_ids.wrote(tokens_ptr, &ids);
                cx.state.put_sampled(ub, ids);
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
            cx.sampled_ids.wrote(tokens_ptr, &tokens);
            cx.state.put_sampled(ub, tokens);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy forgets exactly the sampled-ids buffers its destination bytes overlap: one
    /// ending where a buffer starts, or starting where it ends, forgets nothing (a weight
    /// copy beside the tokens buffer must not make `embed` upload the ids), one byte
    /// inside forgets that buffer alone, and a range reaching the top of the address space
    /// does not overflow.
    #[test]
    fn a_copy_forgets_only_the_sampled_ids_it_overwrites() {
        let ids = SampledIds::default();
        ids.wrote(0x1000, &[1, 2]);
        ids.wrote(0x2000, &[3]);
        ids.forget_overlapping(0x1008, 0x100);
        ids.forget_overlapping(0x0f00, 0x100);
        assert!(ids.holds(0x1000, &[1, 2]) && ids.holds(0x2000, &[3]));
        ids.forget_overlapping(0x1007, 1);
        assert!(!ids.holds(0x1000, &[1, 2]) && ids.holds(0x2000, &[3]));
        ids.forget_overlapping(0x1fff, u64::MAX);
        assert!(!ids.holds(0x2000, &[3]));
    }

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
        assert_eq!(GPU_KERNELS.gaps(), vec![], "one kernel row per op");
    }
}
