//! The CUDA backend's MoE layer: `gate`, `experts`, `combine` and the fused `post_attn`,
//! staged as vLLM's `fused_moe` stages it: router top-k -> group the routed (token, slot)
//! entries by expert -> the expert products -> combine the slots into the residual.
//!
//! Takes a task's device rows and weights; gives the CPU backend's results for the same op
//! in its layouts (`acc` = `[normalised rows | one slot per (token, k) | the shared
//! expert's rows]`, a packed route of `(expert: u32, weight: f32)` per token and slot).
//! [`GpuCx::route`] writes the route on the device (`router_topk`, gpt-oss's
//! `router_topk_softmax`, DeepSeek's router in `super::deepseek`); [`GpuCx::routed_experts`]
//! groups and runs the experts, on the device when it can ([`GpuCx::device_experts`]:
//! `moe_group` counts, prefix-sums and permutes the entries into tiles, then one
//! `moe_grouped_gemv`/`moe_grouped_linear` launch per projection over every expert's
//! segment, kernels/moe_grouped.cu: no routing read-back, one upload of the experts'
//! weight addresses, 4 launches whatever the routing), else on the host
//! ([`GpuCx::host_experts`]: one routing read-back, counted in the run report as a routing
//! sync, then per-expert GEMMs: a prefill past [`GROUPED_MAX_ENTRIES`], or a member expert
//! whose weights are not all in the task's arguments); [`GpuCx::combine`] sums each
//! token's slots (and its shared-expert row) into the residual in the CPU's order
//! (`moe::combine_shared`). The shared expert (Qwen2-MoE, DeepSeek) is dense work every
//! token does and runs with the router, as the CPU's gate does. An expert found only as a
//! format copy (`W[l].expert(e).format(q8_0)`, [`GpuCx::segment_source`]) is multiplied in
//! the copy's block format by the same quantised kernels; a call whose members are stored
//! differently (checkpoint experts beside copies) runs one grouped call per storage, and
//! in a plan with format copies each grouped call counts its experts with tokens on the
//! device (`moe_count_experts`, `super::format_copies::ExpertSources`), the host grouping
//! on the host, for the run report's `lossy substitute:` line.

use super::deepseek;
use super::launch::{
    act_format, grouped_rows_grid, int, int_product, one_row_half, q8_fold_shared, q8_folds,
    q8_kind, row_block, staged_expert_rows, storage_code, Arg, DevMatrix, LaunchError, Q8Act,
    Scratch, GEMV_MAX_ROWS,
};
use super::ops::{not_supported, GpuCx, OpError};
use super::tensor_cores::TensorCores;
use crate::ir::catalog::OpKind;
use crate::ir::{Op, Role};
use crate::lower::PlanTask;
use crate::model::segment::SegmentKind;
use crate::model::vocab::NormKind;
use crate::model::vocab::Orientation;
use crate::model::vocab::{ExpertGroups, Routing};
use crate::quant::q8::ActFormat;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use crate::runtime::backend::decode_routing;
use crate::runtime::host::memory::View;
use crate::runtime::host::weights::WeightTag;
use crate::runtime::ops::{OpCx, TaskArgs};
use crate::runtime::step::MicroBatchState;
use std::sync::atomic::Ordering;

/// `ROUTER_MAX_EXPERTS` of kernels/router.cuh.
pub(super) const ROUTER_MAX_EXPERTS: usize = 256;

/// `MOE_MAX_EXPERTS` and `MOE_TILE_N` of kernels/moe_grouped.cu, `MOE_TILE_M` and
/// `MOE_GEMV_WARPS` of kernels/moe_tiles.cuh.
pub(super) const MOE_MAX_EXPERTS: usize = 256;
const MOE_TILE_M: usize = 16;
const MOE_TILE_N: usize = 64;
const MOE_GEMV_WARPS: usize = 8;

/// `MOE_MMA_WARPS` and `MOE_MMA_N` of kernels/moe_grouped.cu: `moe_grouped_mma`'s warps a
/// block and outputs a block.
const MOE_MMA_WARPS: usize = 4;
const MOE_MMA_N: usize = 16 * MOE_MMA_WARPS;

/// Routed (token, slot) entries of one call past which the grouped SIMT kernels lose to
/// per-expert tensor-core GEMMs (cuBLAS) enough to pay for one routing read-back: a
/// prefill of 64 x 64 tokens at top-2 spent 17 ms per layer in `moe_grouped_linear` on an
/// H200 (10.6 TFLOP/s of f32 FMAs) where the GEMMs take about 1 ms. Decode steps (a token
/// per sequence) stay under it up to 512 sequences per micro-batch at top-2.
pub(super) const GROUPED_MAX_ENTRIES: usize = 1024;

impl GpuCx<'_> {
    /// The shared expert (Qwen2-MoE) on `n` rows of `x_norm` into `out` (`[n, d]`):
    /// `down(silu(gate(x)) * up(x))`, times `sigmoid(x · shared_expert_gate)` when the
    /// layer has that gate (`Kernels::shared_expert`).
    pub(super) fn shared_expert(
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
    /// of a shared expert, a dense layer (`Kernels::shared_expert`) and a routed expert
    /// grouped on the host.
    pub(super) fn swiglu_mlp(
        &self,
        [gate, up, down]: [DevMatrix; 3],
        x_norm: u64,
        n: usize,
        out: u64,
    ) -> Result<(), OpError> {
        let f = gate.out_dim();
        let (hg, hu) = (self.s.scratch(n * f * 4)?, self.s.scratch(n * f * 4)?);
        self.s.linear_shared(
            x_norm,
            n,
            &[(&gate, hg.ptr(), f, false), (&up, hu.ptr(), f, false)],
        )?;
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

    /// gpt-oss's clamped SwiGLU of `rows` interleaved gate/up rows (`[rows, 2 * ffn]`, its
    /// bias added) into `out` (`[rows, ffn]`), as `Kernels::expert_ffn`'s fused arm;
    /// `live` (0: none) a device count of the rows that hold values.
    fn clamped_swiglu(
        &self,
        gate_up: u64,
        out: u64,
        rows: usize,
        (alpha, limit): (f32, f32),
        live: u64,
    ) -> Result<(), OpError> {
        let f = self.arch.ffn;
        Ok(self.s.launch(
            "clamped_swiglu",
            (int("rows", rows)? as u32, 1, 1),
            row_block(f),
            0,
            &[
                Arg::Ptr(gate_up),
                Arg::Ptr(out),
                Arg::I32(int("ffn", f)?),
                Arg::F32(alpha),
                Arg::F32(limit),
                Arg::Ptr(live),
            ],
        )?)
    }

    /// Router logits and top-k for `n` rows of normalised `x`: gives the packed route
    /// (`[n * top_k]` (expert, weight) entries) in `route`.
    pub(super) fn route(
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
            return Err(not_supported(format!(
                "{e} experts with top-{k} (the router kernel takes at most {ROUTER_MAX_EXPERTS} experts)"
            )));
        }
        let router = self.segment(weights, layer, SegmentKind::Router)?;
        let logits = self.s.scratch(n * e * 4)?;
        self.s.linear(x_norm, n, &router, logits.ptr(), e, false)?;
        // The router writes the packed route itself (no separate experts/weights arrays
        // and no route_pack launch).
        let mut operands = vec![
            Arg::Ptr(logits.ptr()),
            Arg::Ptr(0),
            Arg::Ptr(0),
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
        operands.push(Arg::Ptr(route));
        self.s.launch(
            entry,
            (int("rows", n.div_ceil(64))? as u32, 1, 1),
            64,
            0,
            &operands,
        )?;
        Ok(())
    }

    /// The gate of `n` residual rows `h` in one launch (`moe_gate_route`, kernels/
    /// moe_grouped.cu): the FFN norm into `x_norm`, the router's logits, `router_topk`'s
    /// choice into the packed `route` and the rows' `slots` (`[n, top_k, d]`, 0: none)
    /// zeroed; the values of the launches it replaces ([`GpuCx::normalize`],
    /// [`GpuCx::route`], a memset), bit for bit. For a decode step's few rows with a float
    /// router stored `[out, in]` and the softmax-then-top-k router; gives false, having
    /// launched nothing, otherwise (the caller runs those launches).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_gate(
        &self,
        weights: &[View],
        layer: u32,
        h: u64,
        x_norm: u64,
        slots: u64,
        n: usize,
        route: u64,
    ) -> Result<bool, OpError> {
        let (d, e, k) = (self.arch.hidden, self.arch.experts, self.arch.top_k);
        if n == 0
            || n > GEMV_MAX_ROWS
            || self.arch.deepseek_router.is_some()
            || self.arch.router_bias_topk_softmax
            || e > ROUTER_MAX_EXPERTS
            || k > e
        {
            return Ok(false);
        }
        let router = self.segment(weights, layer, SegmentKind::Router)?;
        if router.quant.is_some() || router.orientation != Orientation::OutIn {
            return Ok(false);
        }
        let (norm_w, norm_code) = self.layer_norm_weight(weights, layer, SegmentKind::FfnNorm)?;
        let layer_norm = match self.arch.norm {
            NormKind::Rms => 0,
            NormKind::LayerNoBias => 1,
        };
        // The warp form (router rows loaded before the norm, top-k on a warp's lanes)
        // unless MOEC_FLOAT_KERNELS=block; the same values either way.
        let entry = if super::launch::warp_float_kernels().map_err(not_supported)? {
            "moe_gate_route"
        } else {
            "moe_gate_route_block"
        };
        self.s.launch(
            entry,
            (int("rows", n)? as u32, 1, 1),
            row_block(d),
            0,
            &[
                Arg::Ptr(h),
                Arg::Ptr(norm_w),
                Arg::I32(norm_code),
                Arg::I32(layer_norm),
                Arg::F32(self.arch.norm_eps),
                Arg::Ptr(router.ptr),
                Arg::I32(router.code()),
                Arg::Ptr(x_norm),
                Arg::Ptr(slots),
                Arg::Ptr(route),
                Arg::I32(int("hidden", d)?),
                Arg::I32(int("experts", e)?),
                Arg::I32(int("top_k", k)?),
                Arg::F32(self.arch.router_norm_p.map_or(0.0, |p| p as f32)),
            ],
        )?;
        Ok(true)
    }

    /// The group-by-expert and expert stages: every routed expert of `members` over
    /// `x_norm` (`[n, d]`), `weight * y` into each (row, slot) of `slots` (`[n, top_k,
    /// d]`), grouped on the device when [`GpuCx::device_experts`] can, else on the host
    /// from the routing `host` says where to find ([`GpuCx::host_experts`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn routed_experts(
        &self,
        weights: &[View],
        (layer, ub): (u32, u32),
        members: &[u32],
        route: u64,
        n: usize,
        x_norm: u64,
        slots: u64,
        host: HostRouting,
    ) -> Result<(), OpError> {
        if self.device_experts(weights, layer, members, route, n, x_norm, slots)? {
            return Ok(());
        }
        let routing = match host {
            HostRouting::OfGate => match self.state.read_back_routing(layer, ub) {
                Some(r) => r,
                None => self.read_route(
                    route,
                    n,
                    "`experts` reads its routing back to group tokens per expert on the host",
                )?,
            },
            HostRouting::Own => {
                let routing = self.read_route(
                    route,
                    n,
                    "`post_attn` reads its routing back to group tokens per expert on the host",
                )?;
                self.state
                    .note_active_experts(layer, ub, &routing, self.arch.experts);
                routing
            }
        };
        self.host_experts(weights, layer, members, &routing, x_norm, slots)
    }

    /// The packed route of `n` tokens, read on this stream (waits for the stream; counted
    /// in the run report as a routing sync); `why` names the reader for the graph recorder.
    fn read_route(&self, route: u64, n: usize, why: &'static str) -> Result<Routing, OpError> {
        let k = self.arch.top_k;
        let mut bytes = vec![0u8; n * k * 8];
        self.s.download(route, &mut bytes, why)?;
        self.routing_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(decode_routing(&bytes, n, k)?)
    }

    /// Every routed expert of `members` over `x_norm` (`[n, d]`), `weight * y` into each
    /// (row, slot) of `slots` (`[n, top_k, d]`), grouped on the host from `routing`: per
    /// expert a gather, its projections (cuBLAS for many rows) and a weighted scatter,
    /// each expert's weights as stored (a format copy's blocks included), each counted in
    /// the host memory's expert computations (the device path counts on the device).
    fn host_experts(
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
        let groups = ExpertGroups::new(routing, self.arch.experts);
        for (e, rows) in groups.of(members) {
            // Each expert's scratch is handed out again to the next one: its kernels are
            // queued on this stream before the next expert's, which reuse the bytes (the
            // workspace's own argument, per expert instead of per task), so the task takes
            // its largest expert's scratch, not the sum over the routed experts.
            let _expert_scratch = self.s.workspace.scope();
            if let Some(bad) = rows
                .iter()
                .find(|r| r.row as usize >= n_tokens || r.slot as usize >= k)
            {
                return Err(not_supported(format!(
                    "a routed row ({}, slot {}) outside {n_tokens} tokens x top-{k}",
                    bad.row, bad.slot
                )));
            }
            let (down, substituted) =
                self.segment_source(weights, layer, SegmentKind::ExpertDown(e as usize))?;
            // One expert computation for the run report, as the CPU backend counts it.
            self.host.note_expert_source(substituted);
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
            let y = self.s.scratch(m * d * 4)?;
            match self.arch.clamped_swiglu {
                Some((alpha, limit)) => {
                    // gpt-oss: fused interleaved gate/up with its bias, the clamped SwiGLU,
                    // then down with its bias (`Kernels::expert_ffn`'s fused arm).
                    let e = e as usize;
                    let gate_up = self.segment(weights, layer, SegmentKind::ExpertGateUp(e))?;
                    let hg = self.s.scratch(m * f * 4)?;
                    let gu = self.s.scratch(m * 2 * f * 4)?;
                    self.s
                        .linear(gathered.ptr(), m, &gate_up, gu.ptr(), 2 * f, false)?;
                    let bias = SegmentKind::ExpertGateUpBias(e);
                    self.bias_rows(weights, layer, bias, gu.ptr(), m, 2 * f, 0, 2 * f, true)?;
                    self.clamped_swiglu(gu.ptr(), hg.ptr(), m, (alpha, limit), 0)?;
                    self.s.linear(hg.ptr(), m, &down, y.ptr(), d, false)?;
                    let bias = SegmentKind::ExpertDownBias(e);
                    self.bias_rows(weights, layer, bias, y.ptr(), m, d, 0, d, true)?;
                }
                None => {
                    let gate = self.segment(weights, layer, SegmentKind::ExpertGate(e as usize))?;
                    let up = self.segment(weights, layer, SegmentKind::ExpertUp(e as usize))?;
                    self.swiglu_mlp([gate, up, down], gathered.ptr(), m, y.ptr())?;
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
    /// active: 4 (5 with gpt-oss's clamped SwiGLU) per call, per storage of the members'
    /// weights (one, unless a task mixes checkpoint experts with format copies of others).
    /// Gives false, having launched nothing, when a member's weights are not all in
    /// `weights` (the caller then groups on the host, which looks up only the experts that
    /// are routed to), or when the call has more than [`GROUPED_MAX_ENTRIES`] routed
    /// entries (a prefill: the caller's per-expert cuBLAS GEMMs are faster there than the
    /// grouped kernels, after one read-back).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn device_experts(
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
        // The members by how their weights are stored and whether they are format copies:
        // each group is one grouped call, its own table.
        let mut groups: Vec<MemberGroup> = Vec::new();
        for &m in members {
            let m = m as usize;
            if m >= e {
                continue;
            }
            let found = |kind| match self.segment_source(weights, layer, kind) {
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
            // Substituted or not as its down projection is (the CPU backend's rule).
            let (Some((first, _)), Some((down, substituted))) = (first, down) else {
                return Ok(false);
            };
            let second = match (fused, second) {
                (Some(_), _) => first,
                (None, Some((up, _))) => up,
                (None, None) => return Ok(false),
            };
            let shapes = [first, second, down].map(|w| (w.code(), w.orientation, w.quant));
            let at = match groups
                .iter()
                .position(|g| g.shapes == shapes && g.substituted == substituted)
            {
                Some(at) => at,
                None => {
                    groups.push(MemberGroup {
                        shapes,
                        substituted,
                        table: vec![0u64; 5 * e],
                        members: 0,
                        bias_dtype: WeightDtype::F32,
                    });
                    groups.len() - 1
                }
            };
            let group = &mut groups[at];
            group.members += 1;
            group.table[m] = first.ptr;
            group.table[e + m] = second.ptr;
            group.table[2 * e + m] = down.ptr;
            if fused.is_some() {
                for (slot, kind) in [
                    (3, SegmentKind::ExpertGateUpBias(m)),
                    (4, SegmentKind::ExpertDownBias(m)),
                ] {
                    if self.has(kind) {
                        let (b, _) = found(kind)?.ok_or(OpError::MissingWeight {
                            tag: WeightTag::Layer { layer, kind },
                        })?;
                        if b.rows * b.cols != if slot == 3 { 2 * f } else { d } {
                            return Err(not_supported(format!(
                                "{} with {} values",
                                WeightTag::Layer { layer, kind },
                                b.rows * b.cols
                            )));
                        }
                        group.bias_dtype = b.dtype;
                        group.table[slot * e + m] = b.ptr;
                    }
                }
            }
        }
        // No group when the layer has none of the members: nothing to run.
        for group in &groups {
            self.grouped_experts(group, route, n, x_norm, slots)?;
        }
        Ok(true)
    }

    /// One grouped call of [`GpuCx::device_experts`]: the experts of `group` (all stored
    /// alike), grouped by `moe_group`, counted when the plan has format copies
    /// (`moe_count_experts`), then their projections.
    fn grouped_experts(
        &self,
        group: &MemberGroup,
        route: u64,
        n: usize,
        x_norm: u64,
        slots: u64,
    ) -> Result<(), OpError> {
        let (d, f, k, e) = (
            self.arch.hidden,
            self.arch.ffn,
            self.arch.top_k,
            self.arch.experts,
        );
        let fused = self.arch.clamped_swiglu;
        let (shapes, table, bias_dtype) = (group.shapes, &group.table, group.bias_dtype);
        let code = |dt: WeightDtype| storage_code(dt, None);
        // Each projection's own storage (DBRX stores down [in, out], gate and up [out, in];
        // a Q4_K_M GGUF some layers' down in Q6_K and their gate and up in Q4_K).
        let (code_of, out_in_of) = (
            |which: usize| shapes[which.min(2)].0,
            |which: usize| i32::from(shapes[which.min(2)].1 == Orientation::OutIn),
        );
        let entries = n * k;
        let max_tiles = max_tiles(entries, group.members);
        let tensor_cores = TensorCores::process()
            .map_err(not_supported)?
            .chosen(entries, group.members);
        let aligned = table[..3 * e].iter().all(|&p| p.is_multiple_of(16));
        // The same addresses every step while the weights stay put: copied once.
        let table = self.s.upload_constant(table.as_slice())?;
        let perm_row = self.s.scratch(entries * 4)?;
        let perm_slot = self.s.scratch(entries * 4)?;
        let perm_weight = self.s.scratch(entries * 4)?;
        let tiles = self.s.scratch((2 + 3 * max_tiles) * 4)?;
        // Warp scans of the route (moe_group) unless MOEC_FLOAT_KERNELS=block
        // (moe_group_block); the same grouping either way.
        let group_entry = if super::launch::warp_float_kernels().map_err(not_supported)? {
            "moe_group"
        } else {
            "moe_group_block"
        };
        self.s.launch(
            group_entry,
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
        if self.expert_counts != 0 {
            // The run report's count of expert computations (and of those from a format
            // copy), kept on the device: no routing read-back.
            self.s.launch(
                "moe_count_experts",
                (1, 1, 1),
                32,
                0,
                &[
                    Arg::Ptr(tiles.ptr()),
                    Arg::Ptr(self.expert_counts),
                    Arg::I32(i32::from(group.substituted)),
                ],
            )?;
        }
        // tiles[1]: how many grouped positions hold values (the routed entries of the
        // member experts); rows past it are never written, so nothing reads them.
        let live = tiles.ptr() + 4;
        let tiles_x = int("tiles", max_tiles)? as u32;
        let table_at = |slot: usize| table.ptr() + (slot * e * 8) as u64;
        let plan = ExpertKernels::choose(&shapes, fused.is_some(), aligned);
        if plan == ExpertKernels::Int {
            // Integer products: the layer's normalised rows quantised once for gate and
            // up, the SwiGLU'd hidden rows once for down.
            // The activation of an integer product: quantised rows (`q8_quantize`), or
            // (one token, `q8_folds`) float rows (pointer, stride, format) that the
            // `moe_grouped_gemv_q8_x1` launch quantises itself.
            enum Act {
                Quantised(Q8Act),
                Folded(u64, usize, ActFormat),
            }
            let grouped_q8 = |a: &Act,
                              cols: usize,
                              gather: bool,
                              mode: i32,
                              which: usize,
                              second: u64,
                              y: u64,
                              out_dim: usize| {
                let (entry, shared, head) = match *a {
                    Act::Quantised(q) => (
                        // Rows per tile: at most the tokens (each routes to an expert once).
                        super::launch::q8_entry("moe_grouped_gemv_q8", n),
                        0,
                        [Arg::Ptr(q.codes), Arg::Ptr(q.scales)].to_vec(),
                    ),
                    Act::Folded(x, x_row, format) => (
                        "moe_grouped_gemv_q8_x1",
                        q8_fold_shared(cols, format) as u32,
                        [
                            Arg::Ptr(x),
                            Arg::I64(x_row as i64),
                            Arg::I32(q8_kind(format)),
                        ]
                        .to_vec(),
                    ),
                };
                let mut args = head;
                args.extend([
                    Arg::Ptr(perm_row.ptr()),
                    Arg::Ptr(perm_slot.ptr()),
                    Arg::Ptr(perm_weight.ptr()),
                    Arg::Ptr(tiles.ptr()),
                    Arg::Ptr(table_at(which)),
                    Arg::Ptr(second),
                    Arg::Ptr(y),
                    Arg::I32(i32::from(gather)),
                    Arg::I32(mode),
                    Arg::I32(int("in", cols)?),
                    Arg::I32(int("out", out_dim)?),
                    Arg::I32(code_of(which)),
                    Arg::I32(int("top_k", k)?),
                ]);
                self.s.launch(
                    entry,
                    (
                        tiles_x,
                        int("out", out_dim.div_ceil(MOE_GEMV_WARPS))? as u32,
                        1,
                    ),
                    (32 * MOE_GEMV_WARPS) as u32,
                    shared,
                    &args,
                )
            };
            let hidden = self.s.scratch(entries * f * 4)?;
            let (fmt_in, fmt_hidden) = (act_format(shapes[0].2), act_format(shapes[2].2));
            // One token: every expert tile holds one row, which the launch quantises.
            let x8 = if q8_folds(n, d, fmt_in) {
                Act::Folded(x_norm, d, fmt_in)
            } else {
                Act::Quantised(self.s.quantize_q8(x_norm, d, n, d, fmt_in, 0)?)
            };
            grouped_q8(&x8, d, true, 3, 0, table_at(1), hidden.ptr(), f)?;
            let h8 = if q8_folds(n, f, fmt_hidden) {
                Act::Folded(hidden.ptr(), f, fmt_hidden)
            } else {
                Act::Quantised(
                    self.s
                        .quantize_q8(hidden.ptr(), f, entries, f, fmt_hidden, live)?,
                )
            };
            grouped_q8(&h8, f, false, 2, 2, 0, slots, d)?;
            return Ok(());
        }
        let grouped = |x: u64,
                       gather: bool,
                       mode: i32,
                       which: usize,
                       bias: usize,
                       y: u64,
                       in_dim: usize,
                       out_dim: usize| {
            let bias_ptr = if bias == 0 { 0 } else { table_at(bias) };
            // A warp per output feature reads a stored row: rows must be outputs. One
            // token (each expert's tile one row) with aligned 16-bit weights: the one-row
            // form.
            let (entry, per_block) = if out_in_of(which) != 1 {
                ("moe_grouped_linear", MOE_TILE_N)
            } else if tensor_cores
                && shapes[which.min(2)].2.is_none()
                && code_of(which) == storage_code(WeightDtype::Bf16, None)
                && (mode != 3 || shapes[0] == shapes[1])
            {
                // bf16 rows are outputs (and, with mode 3, up stored as gate is).
                ("moe_grouped_mma", MOE_MMA_N)
            } else if bias == 0
                && aligned
                && one_row_half(n, shapes[which.min(2)].2, code_of(which), &[x], in_dim)
            {
                ("moe_grouped_gemv_1", MOE_GEMV_WARPS)
            } else if aligned
                && staged_expert_rows(n, shapes[which.min(2)].2, code_of(which), &[x], in_dim)
                    .map_err(LaunchError::Setting)?
            {
                // 2-16 rows per expert: staged rows, grid from the routed entries.
                ("moe_grouped_gemv_rows", 0)
            } else {
                ("moe_grouped_gemv", MOE_GEMV_WARPS)
            };
            // Grid (tiles, output blocks); the staged form's (output blocks, tile slots)
            // and its warps an output.
            let (gx, gy, split) = if per_block == 0 {
                let whole = group.members == e;
                let (blocks, slots, split) =
                    grouped_rows_grid(out_dim, mode == 3, entries, k, whole, max_tiles);
                (blocks, slots, Some(split))
            } else {
                (max_tiles, out_dim.div_ceil(per_block), None)
            };
            let second = if mode == 3 { table_at(1) } else { 0 };
            let mut args = vec![
                Arg::Ptr(x),
                Arg::Ptr(perm_row.ptr()),
                Arg::Ptr(perm_slot.ptr()),
                Arg::Ptr(perm_weight.ptr()),
                Arg::Ptr(tiles.ptr()),
                Arg::Ptr(table_at(which)),
            ];
            if entry != "moe_grouped_linear" {
                args.push(Arg::Ptr(second));
            }
            args.extend([
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
            ]);
            if let Some(split) = split {
                args.push(Arg::I32(int("split", split)?));
            }
            let threads = if entry == "moe_grouped_mma" {
                32 * MOE_MMA_WARPS
            } else {
                256
            };
            self.s.launch(
                entry,
                (int("grid", gx)? as u32, int("grid", gy)? as u32, 1),
                threads as u32,
                0,
                &args,
            )
        };
        // Each projection multiplies its inputs as the CPU's product with its weights
        // does (8-bit activations for quantised weights unless decoded).
        let inputs = |x: u64, rows: usize, cols: usize, which: usize, live: u64| {
            self.s
                .quant_activations(x, rows, cols, shapes[which].2, live)
        };
        let hidden = self.s.scratch(entries * f * 4)?;
        match fused {
            Some((alpha, limit)) => {
                let gu = self.s.scratch(entries * 2 * f * 4)?;
                grouped(
                    inputs(x_norm, n, d, 0, 0)?,
                    true,
                    0,
                    0,
                    3,
                    gu.ptr(),
                    d,
                    2 * f,
                )?;
                // Positions past the routed ones hold scratch: `live` keeps every kernel
                // off them.
                self.clamped_swiglu(gu.ptr(), hidden.ptr(), entries, (alpha, limit), live)?;
                let down_in = inputs(hidden.ptr(), entries, f, 2, live)?;
                grouped(down_in, false, 2, 2, 4, slots, f, d)?;
            }
            None => {
                let gate_in = inputs(x_norm, n, d, 0, 0)?;
                let up_in = if shapes[1].2 == shapes[0].2 {
                    gate_in
                } else {
                    inputs(x_norm, n, d, 1, 0)?
                };
                if plan == ExpertKernels::FusedFloat && up_in == gate_in {
                    // Gate, up and SwiGLU in one launch.
                    grouped(gate_in, true, 3, 0, 0, hidden.ptr(), d, f)?;
                } else {
                    grouped(gate_in, true, 0, 0, 0, hidden.ptr(), d, f)?;
                    grouped(up_in, true, 1, 1, 0, hidden.ptr(), d, f)?;
                }
                let down_in = inputs(hidden.ptr(), entries, f, 2, live)?;
                grouped(down_in, false, 2, 2, 0, slots, f, d)?;
            }
        }
        Ok(())
    }

    /// The combine stage: `residual[n, d] += sum of each token's slots (+ its
    /// shared-expert row at `shared`, when not 0)` in the CPU's order
    /// (`moe::combine_shared`), the slots' experts taken from the packed `route` (a slot
    /// of `NO_EXPERT` adds nothing).
    pub(super) fn combine(
        &self,
        route: u64,
        slots: u64,
        shared: u64,
        residual: u64,
        n: usize,
    ) -> Result<(), OpError> {
        let (d, k) = (self.arch.hidden, self.arch.top_k);
        if k > 64 {
            return Err(not_supported(format!("top-{k} (combine takes at most 64)")));
        }
        // combine_slots reads each slot's expert from the packed route in place (every
        // second word); blocks along y split each row, a value a thread (a batch-1 step's
        // one block walking the row was 8 us on an H200).
        let threads = row_block(d);
        Ok(self.s.launch(
            "combine_slots",
            (
                int("rows", n)? as u32,
                int("hidden", d.div_ceil(threads as usize))? as u32,
                1,
            ),
            threads,
            0,
            &[
                Arg::Ptr(slots),
                Arg::Ptr(route),
                Arg::Ptr(shared),
                Arg::Ptr(residual),
                Arg::I32(int("top_k", k)?),
                Arg::I32(int("hidden", d)?),
                Arg::I32(2),
            ],
        )?)
    }

    /// Sums partial accumulators' slots (`acc = [a, b]`, `[n, top_k, d]` at `offset` in
    /// each): each (token, k) slot was written in one of them and is zero (from the gate)
    /// in the others, so their sum is that expert's output exactly; summed in argument
    /// order, as the CPU does. One accumulator is its own slots (no copy).
    fn summed_slots(&self, accs: &[u64], offset: u64, n: usize) -> Result<Rows, OpError> {
        let elems = n * self.arch.top_k * self.arch.hidden;
        match accs {
            [] => Err(OpError::MissingArg("acc")),
            [one] => Ok(Rows::Arg(one + offset)),
            [first, rest @ ..] => {
                let summed = self.s.scratch(elems * 4)?;
                self.s.copy(summed.ptr(), first + offset, elems * 4)?;
                for other in rest {
                    self.s.launch_1d(
                        "add_in_place",
                        elems,
                        &[
                            Arg::Ptr(summed.ptr()),
                            Arg::Ptr(other + offset),
                            Arg::I64(elems as i64),
                        ],
                    )?;
                }
                Ok(Rows::Built(summed))
            }
        }
    }

    /// The rows of attention output `post_attn` projects: one `a` holds all; two (VSLPipe)
    /// hold prefill and decode rows, merged here into scratch by each sequence's kind.
    fn attention_rows(&self, mb: &MicroBatchState, a_args: &[View]) -> Result<Rows, OpError> {
        let (n, q) = (mb.n_tokens(), self.arch.q_dim());
        match a_args {
            [] => Err(OpError::MissingArg("a")),
            [one] => Ok(Rows::Arg(self.ptr(*one, "a", n * q * 4)?)),
            [prefill, decode, ..] => {
                let (p, dcd) = (
                    self.ptr(*prefill, "a", n * q * 4)?,
                    self.ptr(*decode, "a", n * q * 4)?,
                );
                let merged = self.s.scratch(n * q * 4)?;
                let mut row = 0;
                for s in &mb.seqs {
                    let len = s.new_tokens.len();
                    let src = if s.prefill { p } else { dcd };
                    let at = (row * q * 4) as u64;
                    // Both ranges hold the sequence's rows (sizes checked above); the
                    // scratch is this task's alone.
                    self.s.copy(merged.ptr() + at, src + at, len * q * 4)?;
                    row += len;
                }
                Ok(Rows::Built(merged))
            }
        }
    }
}

/// How [`GpuCx::device_experts`] runs a layer's expert products (the run report names
/// the kernels: `ops::quant_kernels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ExpertKernels {
    /// Q8_0/Q4_K/Q5_K/Q6_K weights (gate and up in one activation format, every matrix
    /// on 16 bytes) with the CPU's 8-bit product: `q8_quantize` of the normalised rows,
    /// `moe_grouped_gemv_q8` gate+up+SwiGLU, `q8_quantize` of the hidden rows,
    /// `moe_grouped_gemv_q8` down.
    Int,
    /// Gate and up stored alike, rows are outputs, no biases: `moe_grouped_gemv` gate+up+
    /// SwiGLU in one launch, then down (blocks of other formats decoded inside the
    /// product, activations rounded by `q8_roundtrip` unless decoded).
    FusedFloat,
    /// Otherwise (gpt-oss's interleaved gate/up with biases, `[in, out]` storage): one
    /// launch per projection (`moe_grouped_gemv` or `moe_grouped_linear`).
    Separate,
}

/// A layer's (gate, up, down) storage: kernel code, orientation and block format.
type ExpertShapes = [(i32, Orientation, Option<QuantFormat>); 3];

/// Members of one `experts` call stored alike: one grouped call of
/// [`GpuCx::device_experts`].
struct MemberGroup {
    /// Their (gate, up, down) storage.
    shapes: ExpertShapes,
    /// Whether they are format copies of their experts (a declared lossy substitute).
    substituted: bool,
    /// Per expert: [first projection, second (gate/up split only), down, first's bias,
    /// down's bias] addresses; 0 where an expert is not in this group (or has no bias).
    table: Vec<u64>,
    /// Experts in the group.
    members: usize,
    /// The biases' dtype (gpt-oss).
    bias_dtype: WeightDtype,
}

impl ExpertKernels {
    /// The kernels for experts stored as `shapes`; `fused`: gpt-oss's gate/up with biases;
    /// `aligned`: every member's matrices start on 16 bytes.
    pub(super) fn choose(shapes: &ExpertShapes, fused: bool, aligned: bool) -> Self {
        let out_in = shapes.iter().all(|s| s.1 == Orientation::OutIn);
        if fused || !out_in {
            return ExpertKernels::Separate;
        }
        let int = shapes.iter().all(|s| int_product(s.2))
            && act_format(shapes[0].2) == act_format(shapes[1].2);
        if int && aligned {
            return ExpertKernels::Int;
        }
        if shapes[0] == shapes[1] {
            ExpertKernels::FusedFloat
        } else {
            ExpertKernels::Separate
        }
    }
}

/// Tiles `moe_group` can make of `entries` routed entries over `members` experts: an
/// expert with c entries makes ceil(c / MOE_TILE_M) <= (c + MOE_TILE_M - 1) / MOE_TILE_M
/// tiles, and at most min(entries, members) experts have any, so the grid has no block
/// that can never find a tile beyond that bound (2 at a decode step's top-2 of one token,
/// where the bound entries / MOE_TILE_M + members gave 9).
pub(super) fn max_tiles(entries: usize, members: usize) -> usize {
    (entries + (MOE_TILE_M - 1) * entries.min(members)).div_ceil(MOE_TILE_M)
}

/// Rows an op reads: in one of its arguments, or built into scratch this task keeps alive.
enum Rows {
    /// The device address of rows in an argument.
    Arg(u64),
    /// Rows built in scratch.
    Built(Scratch),
}

impl Rows {
    fn ptr(&self) -> u64 {
        match self {
            Rows::Arg(ptr) => *ptr,
            Rows::Built(scratch) => scratch.ptr(),
        }
    }
}

/// Where the host finds a routing when the experts must be grouped there.
#[derive(Debug, Clone, Copy)]
pub(super) enum HostRouting {
    /// An `experts` task: its gate's plan read-back, else read on this stream.
    OfGate,
    /// The fused `post_attn`: its own router's, read on this stream (a plan read-back
    /// covers only gates), the experts it reached noted for the replay.
    Own,
}

/// `gate`: normalise, route (router top-k into the packed route), zero the slots, and the
/// shared expert into the accumulator's last rows.
pub(super) fn gate_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Gate { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::Gate, task));
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
    let slots = acc + (n * d * 4) as u64;
    if !cx.fused_gate(&weights, layer, h, acc, slots, n, route)? {
        let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::FfnNorm)?;
        cx.normalize(h, norm_w, acc, n)?;
        cx.route(&weights, layer, acc, n, route)?;
        cx.s.zero(slots, n * k * d * 4)?;
    }
    // The shared expert is dense work every token does: computed with the router, as the
    // CPU's gate does, so schedules move its weights with the gate's.
    if cx.arch.shared_ffn > 0 {
        cx.shared_expert(&weights, layer, acc, n, acc + (n * (1 + k) * d * 4) as u64)?;
    }
    Ok(())
}

/// `pregate` (lookahead gating): layer `layer`'s norm and router over the hidden rows `h`
/// (those entering the previous layer's MoE block) into `route`, the normalised rows in
/// scratch; no accumulator, no shared expert.
pub(super) fn pregate_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Pregate { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::Pregate, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let weights = args.all(Role::W);
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let route = cx.ptr(args.need(Role::Route)?, "route", n * k * 8)?;
    let x_norm = cx.s.scratch(n * d * 4)?;
    let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::FfnNorm)?;
    cx.normalize(h, norm_w, x_norm.ptr(), n)?;
    cx.route(&weights, layer, x_norm.ptr(), n, route)
}

/// `experts`: the group-by-expert and expert stages for the set's members, into the
/// accumulator's slots.
pub(super) fn experts_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Experts { layer, ub, set } = task.op else {
        return Err(cx.wrong_op(OpKind::Experts, task));
    };
    if cx.arch.is_dense(layer as usize) {
        // A dense layer's route chooses no expert: nothing to compute.
        return Ok(());
    }
    let n = cx.ub(ub)?.n_tokens();
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let route = cx.ptr(args.need(Role::Route)?, "route", n * k * 8)?;
    let acc = cx.ptr(args.need(Role::Acc)?, "acc", n * (1 + k) * d * 4)?;
    let slots = acc + (n * d * 4) as u64;
    let members = cx.members(set);
    let weights = args.all(Role::W);
    cx.routed_experts(
        &weights,
        (layer, ub),
        &members,
        route,
        n,
        acc,
        slots,
        HostRouting::OfGate,
    )
}

/// `combine`: the (summed) slots and the shared expert's rows into the residual.
pub(super) fn combine_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Combine { ub, .. } = task.op else {
        return Err(cx.wrong_op(OpKind::Combine, task));
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
    let slots = cx.summed_slots(&accs, (n * d * 4) as u64, n)?;
    cx.combine(route, slots.ptr(), shared, h, n)
}

/// The fused `post_attn`: `o_proj` with the residual, then the whole MoE layer in its
/// stages (norm, route, group and experts over every expert, shared expert, combine).
pub(super) fn post_attn_op(
    cx: &GpuCx<'_>,
    task: &PlanTask,
    args: &TaskArgs,
) -> Result<(), OpError> {
    let Op::PostAttn { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::PostAttn, task));
    };
    let mb = cx.ub(ub)?;
    let n = mb.n_tokens();
    let (d, k) = (cx.arch.hidden, cx.arch.top_k);
    let weights = args.all(Role::W);
    let h = cx.ptr(args.need(Role::H)?, "h", n * d * 4)?;
    let a = cx.attention_rows(mb, &args.all(Role::A))?;
    cx.o_proj_residual(&weights, layer, a.ptr(), h, n)?;
    if cx.arch.is_dense(layer as usize) {
        return deepseek::dense_block(cx, &weights, layer, h, n);
    }
    let x_norm = cx.s.scratch(n * d * 4)?;
    let route = cx.s.scratch(n * k * 8)?;
    let slots = cx.s.scratch(n * k * d * 4)?;
    let (xp, rp, sp) = (x_norm.ptr(), route.ptr(), slots.ptr());
    if !cx.fused_gate(&weights, layer, h, xp, sp, n, rp)? {
        let norm_w = cx.layer_norm_weight(&weights, layer, SegmentKind::FfnNorm)?;
        cx.normalize(h, norm_w, xp, n)?;
        cx.route(&weights, layer, xp, n, rp)?;
        cx.s.zero(sp, n * k * d * 4)?;
    }
    let all: Vec<u32> = (0..cx.arch.experts as u32).collect();
    cx.routed_experts(
        &weights,
        (layer, ub),
        &all,
        route.ptr(),
        n,
        x_norm.ptr(),
        slots.ptr(),
        HostRouting::Own,
    )?;
    let shared: Option<Scratch> = if cx.arch.shared_ffn > 0 {
        let out = cx.s.scratch(n * d * 4)?;
        cx.shared_expert(&weights, layer, x_norm.ptr(), n, out.ptr())?;
        Some(out)
    } else {
        None
    };
    let shared_ptr = shared.as_ref().map_or(0, Scratch::ptr);
    cx.combine(route.ptr(), slots.ptr(), shared_ptr, h, n)
}
