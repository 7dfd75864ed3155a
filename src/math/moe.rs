//! The mixture-of-experts block in the stages of the MoE contract every backend follows
//! (`model::vocab::ExpertGroups` states it): router (norm, router softmax over all experts
//! in f32, top-k, renormalisation), group by expert, the expert products, combine.
//!
//! Takes the residual `[n_tokens, hidden]`; [`gate`] (the router stage) gives the
//! normalised rows and a [`Routing`]; `ExpertGroups` groups its entries by expert;
//! [`Kernels::experts_ffn`] (the CPU's expert products) runs each expert's SwiGLU on the
//! rows routed to it (gathered into a contiguous block) and writes `weight * y` into that
//! (row, slot)'s place of a `[n_tokens, top_k, hidden]` slot buffer; [`combine`] sums each
//! row's slots in ascending expert index (Hugging Face's summation order), adds the shared
//! expert's row when the family has one ([`Kernels::shared_expert`], Qwen2-MoE:
//! `sigmoid(x · g) * swiglu(x)`, added after the routed sum as transformers does) and adds
//! the sum to the residual. So the result is bit-identical whatever order, grouping or
//! micro-batch the experts run in. [`Kernels::moe_block`] chains the stages for the oracle;
//! the CPU backend's ops chain the same stages (`gate`, `experts`, `combine`, or all of
//! them in the fused `post_attn`).

use crate::math::isa::Kernels;
use crate::math::norm::normalize;
use crate::math::qmatmul::{QuantKernels, QuantMatrix, QuantProduct};
use crate::math::views::{DenseWeights, ExpertWeights, FusedExpert, SharedExpertWeights};
use crate::math::{check_len, KernelError};
use crate::model::arch::ArchSpec;
use crate::model::vocab::{ExpertGroups, RoutedRow, Routing};

/// Softmax over all experts in f32, top-k (ties to the lower index), then division by
/// the p-norm of the chosen weights when `norm_p` is set (Mixtral: p = 1, the sum).
pub fn route(
    router_logits: &[f32],
    n_experts: usize,
    top_k: usize,
    norm_p: Option<f64>,
) -> Routing {
    let n = router_logits.len() / n_experts.max(1);
    let mut experts = Vec::with_capacity(n * top_k);
    let mut weights = Vec::with_capacity(n * top_k);
    let mut order: Vec<usize> = Vec::with_capacity(n_experts);
    for row in router_logits.chunks_exact(n_experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let probs: Vec<f32> = exps.iter().map(|e| e / sum).collect();
        order.clear();
        order.extend(0..n_experts);
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let denom = match norm_p {
            Some(p) => chosen
                .iter()
                .map(|&e| (probs[e].abs() as f64).powf(p))
                .sum::<f64>()
                .powf(1.0 / p) as f32,
            None => 1.0,
        };
        for &e in chosen {
            experts.push(e as u32);
            weights.push(probs[e] / denom);
        }
    }
    Routing {
        top_k,
        experts,
        weights,
    }
}

/// gpt-oss's routing: top-k of the raw logits (ties to the lower index), softmax over
/// those k only.
pub fn route_topk_softmax(router_logits: &[f32], n_experts: usize, top_k: usize) -> Routing {
    let n = router_logits.len() / n_experts.max(1);
    let mut experts = Vec::with_capacity(n * top_k);
    let mut weights = Vec::with_capacity(n * top_k);
    let mut order: Vec<usize> = Vec::with_capacity(n_experts);
    for row in router_logits.chunks_exact(n_experts) {
        order.clear();
        order.extend(0..n_experts);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let max = chosen.first().map_or(0.0, |&e| row[e]);
        let exps: Vec<f32> = chosen.iter().map(|&e| (row[e] - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        for (&e, x) in chosen.iter().zip(&exps) {
            experts.push(e as u32);
            weights.push(x / sum);
        }
    }
    Routing {
        top_k,
        experts,
        weights,
    }
}

/// [`Kernels::gate`] with the process's kernels.
pub fn gate(
    arch: &ArchSpec,
    dense: &DenseWeights<'_>,
    residual: &[f32],
    x_norm: &mut [f32],
) -> Result<Routing, KernelError> {
    Kernels::process().gate(arch, dense, residual, x_norm)
}

/// [`Kernels::expert_ffn`] with the process's kernels.
pub fn expert_ffn(
    arch: &ArchSpec,
    expert: &ExpertWeights<'_>,
    x_norm: &[f32],
    rows: &[RoutedRow],
    slots: &mut [f32],
) -> Result<(), KernelError> {
    Kernels::process().expert_ffn(arch, expert, x_norm, rows, slots)
}

/// `silu(x) = x * sigmoid(x)`.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// gpt-oss's clamped SwiGLU on the fused product's rows `gate_up` (`[n, 2 ffn]`, gate and
/// up interleaved) plus the expert's `gate_up_bias`, into `h` (`[n, ffn]`):
/// `(clamp(u + bu, ±limit) + 1) · g' · sigmoid(alpha · g')` with `g' = min(g + bg, limit)`.
/// The one-at-a-time and the grouped expert paths both call it, so they give the same bits.
fn clamped_swiglu(
    gate_up: &[f32],
    fused: &FusedExpert<'_>,
    (alpha, limit): (f32, f32),
    ffn: usize,
    h: &mut [f32],
) -> Result<(), KernelError> {
    let b = fused.gate_up_bias.to_f32_vec();
    check_len("expert gate_up bias", b.len(), 2 * ffn)?;
    check_len("expert gate_up product", gate_up.len(), 2 * h.len())?;
    for (row, out) in gate_up.chunks_exact(2 * ffn).zip(h.chunks_exact_mut(ffn)) {
        for (i, o) in out.iter_mut().enumerate() {
            let g = (row[2 * i] + b[2 * i]).min(limit);
            let u = (row[2 * i + 1] + b[2 * i + 1]).clamp(-limit, limit);
            let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
            *o = (u + 1.0) * glu;
        }
    }
    Ok(())
}

/// Adds gpt-oss's `down_bias` (`[hidden]`) to every row of an expert's down product `y`
/// (`[n, hidden]`).
fn add_down_bias(fused: &FusedExpert<'_>, hidden: usize, y: &mut [f32]) -> Result<(), KernelError> {
    let b = fused.down_bias.to_f32_vec();
    check_len("expert down bias", b.len(), hidden)?;
    for row in y.chunks_exact_mut(hidden) {
        for (v, bv) in row.iter_mut().zip(&b) {
            *v += bv;
        }
    }
    Ok(())
}

impl Kernels {
    /// Pre-MoE norm of the residual into `x_norm`, router logits, routing.
    pub fn gate(
        self,
        arch: &ArchSpec,
        dense: &DenseWeights<'_>,
        residual: &[f32],
        x_norm: &mut [f32],
    ) -> Result<Routing, KernelError> {
        let n = residual.len() / arch.hidden.max(1);
        check_len("gate input", residual.len(), n * arch.hidden)?;
        check_len("gate scratch", x_norm.len(), n * arch.hidden)?;
        normalize(arch.norm, residual, dense.ffn_norm, arch.norm_eps, x_norm);
        let mut logits = vec![0.0f32; n * arch.experts];
        self.linear(x_norm, n, &dense.router, &mut logits)?;
        if let Some(router) = &arch.deepseek_router {
            let bias = dense.router_bias.map(|b| b.to_f32_vec());
            return Ok(crate::math::deepseek_route::route_deepseek(
                &logits,
                arch.experts,
                arch.top_k,
                router,
                bias.as_deref(),
            ));
        }
        if arch.router_bias_topk_softmax {
            if let Some(bias) = dense.router_bias {
                let bias = bias.to_f32_vec();
                check_len("router bias", bias.len(), arch.experts)?;
                for row in logits.chunks_exact_mut(arch.experts) {
                    for (v, b) in row.iter_mut().zip(&bias) {
                        *v += b;
                    }
                }
            }
            return Ok(route_topk_softmax(&logits, arch.experts, arch.top_k));
        }
        Ok(route(&logits, arch.experts, arch.top_k, arch.router_norm_p))
    }

    /// Runs one expert on its routed rows of `x_norm` (`[n_tokens, hidden]`) and writes
    /// `weight * down(silu(gate(x)) * up(x))` into each row's slot of `slots`
    /// (`[n_tokens, top_k, hidden]`).
    pub fn expert_ffn(
        self,
        arch: &ArchSpec,
        expert: &ExpertWeights<'_>,
        x_norm: &[f32],
        rows: &[RoutedRow],
        slots: &mut [f32],
    ) -> Result<(), KernelError> {
        let d = arch.hidden;
        let f = arch.ffn;
        let Some(mut gathered) = gather_rows(arch, x_norm, rows, slots)? else {
            return Ok(());
        };
        let n = rows.len();
        let mut h_gate = vec![0.0f32; n * f];
        match (&expert.fused, arch.clamped_swiglu) {
            (Some(fused), Some(clamp)) => {
                // gpt-oss: gate_up = x W + b, gate/up interleaved; clamped SwiGLU; then
                // down with its bias.
                let mut gate_up = vec![0.0f32; n * 2 * f];
                self.linear(&gathered, n, &fused.gate_up, &mut gate_up)?;
                clamped_swiglu(&gate_up, fused, clamp, f, &mut h_gate)?;
                self.linear(&h_gate, n, &expert.down, &mut gathered)?;
                add_down_bias(fused, d, &mut gathered)?;
            }
            _ => {
                self.linear_gated(&gathered, n, &expert.gate, &expert.up, silu, &mut h_gate)?;
                self.linear(&h_gate, n, &expert.down, &mut gathered)?;
            }
        }
        scatter_rows(d, arch.top_k, rows, &gathered, slots);
        Ok(())
    }

    /// [`Kernels::expert_ffn`] for every `(expert, rows)` of `jobs`. When every expert's
    /// matrices are quantised and stored out-in, multiplied as their format is meant to run
    /// (`int8`: not `decodes_quant`), and they hold at most [`GROUPED_MAX_ROWS`] rows in all,
    /// all their first products (gate and up, or gpt-oss's fused gate_up) run in one
    /// parallel region and all their down products in another
    /// ([`QuantKernels::quant_products`]: a decode step's experts are a few microseconds to
    /// a millisecond of work each, and one region per product paid a fork and join and a
    /// half-idle tail for each); otherwise one expert after another. The slots get the same
    /// bits either way: the same products, and the same activation code
    /// ([`clamped_swiglu`], [`add_down_bias`] for gpt-oss).
    pub fn experts_ffn(
        self,
        arch: &ArchSpec,
        jobs: &[(ExpertWeights<'_>, &[RoutedRow])],
        x_norm: &[f32],
        slots: &mut [f32],
    ) -> Result<(), KernelError> {
        let grouped: Option<Vec<GroupedExpert<'_>>> = jobs
            .iter()
            .map(|(e, _)| GroupedExpert::new(arch, e))
            .collect::<Option<_>>()
            .filter(|_| {
                jobs.len() > 1
                    && jobs.iter().map(|(_, r)| r.len()).sum::<usize>() <= GROUPED_MAX_ROWS
                    && !self.decodes_quant()
            });
        let Some(mats) = grouped else {
            for (expert, rows) in jobs {
                self.expert_ffn(arch, expert, x_norm, rows, slots)?;
            }
            return Ok(());
        };
        let (d, f) = (arch.hidden, arch.ffn);
        let mut inputs = Vec::with_capacity(jobs.len());
        // Shapes are checked by the products (each input and output against its matrix).
        for (_, rows) in jobs {
            inputs.push(gather_rows(arch, x_norm, rows, slots)?.unwrap_or_default());
        }
        let qk = QuantKernels::for_kernels(self);
        // Every expert's first products' outputs: gate and up (`[n, ffn]` each), or the
        // fused gate_up (`[n, 2 ffn]`).
        let mut firsts: Vec<Vec<Vec<f32>>> = jobs
            .iter()
            .zip(&mats)
            .map(|((_, r), m)| {
                m.first()
                    .iter()
                    .map(|w| vec![0.0f32; r.len() * w.rows])
                    .collect()
            })
            .collect();
        {
            let mut products = Vec::with_capacity(2 * jobs.len());
            let mut outs: Vec<&mut [f32]> = Vec::with_capacity(2 * jobs.len());
            for ((((_, rows), m), x), ys) in jobs.iter().zip(&mats).zip(&inputs).zip(&mut firsts) {
                for (w, y) in m.first().iter().zip(ys.iter_mut()) {
                    let n_rows = rows.len();
                    products.push(QuantProduct { w: *w, x, n_rows });
                    outs.push(y);
                }
            }
            qk.quant_products(&products, &mut outs)?;
        }
        let mut hs: Vec<Vec<f32>> = Vec::with_capacity(jobs.len());
        for ((ys, m), (_, rows)) in firsts.iter_mut().zip(&mats).zip(jobs) {
            match (m, ys.as_mut_slice()) {
                (GroupedExpert::Swiglu(_), [g, u]) => {
                    for (g, u) in g.iter_mut().zip(u.iter()) {
                        *g = silu(*g) * u;
                    }
                    hs.push(std::mem::take(g));
                }
                (GroupedExpert::Fused { fused, clamp, .. }, [gate_up]) => {
                    let mut h = vec![0.0f32; rows.len() * f];
                    clamped_swiglu(gate_up, fused, *clamp, f, &mut h)?;
                    hs.push(h);
                }
                // `GroupedExpert::first` gives two products for a SwiGLU expert, one fused.
                (_, ys) => {
                    return Err(KernelError::Shape {
                        what: "grouped expert's first products",
                        expected: m.first().len(),
                        got: ys.len(),
                    })
                }
            }
        }
        let products: Vec<QuantProduct<'_>> = jobs
            .iter()
            .zip(&mats)
            .zip(&hs)
            .map(|(((_, rows), m), h)| QuantProduct {
                w: m.down(),
                x: h,
                n_rows: rows.len(),
            })
            .collect();
        let mut outs: Vec<&mut [f32]> = inputs.iter_mut().map(|v| v.as_mut_slice()).collect();
        qk.quant_products(&products, &mut outs)?;
        for (((_, rows), y), m) in jobs.iter().zip(&mut inputs).zip(&mats) {
            if let GroupedExpert::Fused { fused, .. } = m {
                add_down_bias(fused, d, y)?;
            }
            scatter_rows(d, arch.top_k, rows, y, slots);
        }
        Ok(())
    }

    /// The shared expert on every row of `x_norm` (`[n_tokens, hidden]`) into `out`
    /// (same shape): `down(silu(gate(x)) * up(x))`, times `sigmoid(x · shared_expert_gate)`
    /// when the family gates it.
    pub fn shared_expert(
        self,
        arch: &ArchSpec,
        shared: &SharedExpertWeights<'_>,
        x_norm: &[f32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let d = arch.hidden;
        let n = x_norm.len() / d.max(1);
        check_len("shared expert input", x_norm.len(), n * d)?;
        check_len("shared expert output", out.len(), n * d)?;
        if n == 0 {
            return Ok(());
        }
        let f = shared.ffn.gate.out_dim();
        let mut h = vec![0.0f32; n * f];
        self.linear_gated(x_norm, n, &shared.ffn.gate, &shared.ffn.up, silu, &mut h)?;
        self.linear(&h, n, &shared.ffn.down, out)?;
        if let Some(gate) = &shared.gate {
            let mut g = vec![0.0f32; n];
            self.linear(x_norm, n, gate, &mut g)?;
            for (row, &logit) in out.chunks_exact_mut(d).zip(&g) {
                let s = 1.0 / (1.0 + (-logit).exp());
                for v in row {
                    *v *= s;
                }
            }
        }
        Ok(())
    }

    /// The whole sparse-MoE block on the residual `x` (`[n_tokens, hidden]`) in the
    /// contract's stages: [`gate`] (router), `ExpertGroups` (group by expert),
    /// [`Kernels::experts_ffn`] for the experts some row routes to (in expert order;
    /// `expert(e)` gives its weights and is called for those experts only), the shared
    /// expert, then [`combine`] into `x`. Returns the routing. The oracle runs this; the CPU
    /// backend's ops run the same stages.
    pub fn moe_block<'w, E>(
        self,
        arch: &ArchSpec,
        dense: &DenseWeights<'_>,
        x: &mut [f32],
        mut expert: impl FnMut(usize) -> Result<ExpertWeights<'w>, E>,
    ) -> Result<Routing, E>
    where
        E: From<KernelError>,
    {
        let mut x_norm = vec![0.0f32; x.len()];
        let routing = self.gate(arch, dense, x, &mut x_norm)?;
        let groups = ExpertGroups::new(&routing, arch.experts);
        let jobs = groups
            .routed()
            .map(|(e, rows)| Ok((expert(e as usize)?, rows)))
            .collect::<Result<Vec<_>, E>>()?;
        let mut slots = vec![0.0f32; x.len() * arch.top_k];
        self.experts_ffn(arch, &jobs, &x_norm, &mut slots)?;
        match &dense.shared {
            Some(shared) => {
                let mut shared_out = vec![0.0f32; x.len()];
                self.shared_expert(arch, shared, &x_norm, &mut shared_out)?;
                combine_shared(&routing, &slots, Some(&shared_out), x)?;
            }
            None => combine(&routing, &slots, x)?,
        }
        Ok(routing)
    }
}

/// One expert's quantised out-in matrices, as [`Kernels::experts_ffn`] groups them.
enum GroupedExpert<'a> {
    /// A SwiGLU expert: gate, up, down.
    Swiglu([QuantMatrix<'a>; 3]),
    /// gpt-oss: the fused gate_up `[2 ffn, hidden]` (out-in, as its GGUF stores it), down,
    /// the biases and the clamp `(alpha, limit)`.
    Fused {
        gate_up: QuantMatrix<'a>,
        down: QuantMatrix<'a>,
        fused: FusedExpert<'a>,
        clamp: (f32, f32),
    },
}

impl<'a> GroupedExpert<'a> {
    /// `e`'s matrices when every one the expert path multiplies is quantised and out-in;
    /// `None` otherwise (bf16, in-out, or a fused expert without its clamp).
    fn new(arch: &ArchSpec, e: &ExpertWeights<'a>) -> Option<Self> {
        let quant = QuantMatrix::from_matrix;
        match (&e.fused, arch.clamped_swiglu) {
            (None, None) => Some(GroupedExpert::Swiglu([
                quant(&e.gate)?,
                quant(&e.up)?,
                quant(&e.down)?,
            ])),
            (Some(fused), Some(clamp)) => Some(GroupedExpert::Fused {
                gate_up: quant(&fused.gate_up)?,
                down: quant(&e.down)?,
                fused: *fused,
                clamp,
            }),
            _ => None,
        }
    }

    /// The products on the expert's input: gate and up, or the fused gate_up.
    fn first(&self) -> &[QuantMatrix<'a>] {
        match self {
            GroupedExpert::Swiglu(m) => &m[..2],
            GroupedExpert::Fused { gate_up, .. } => std::slice::from_ref(gate_up),
        }
    }

    /// The down product.
    fn down(&self) -> QuantMatrix<'a> {
        match self {
            GroupedExpert::Swiglu(m) => m[2],
            GroupedExpert::Fused { down, .. } => *down,
        }
    }
}

/// The most routed rows [`Kernels::experts_ffn`] runs in one region: every expert's
/// intermediates are alive at once there (a batch-64 prefill's 8192 routed rows would hold
/// about 235 MB of gate and up values for a 3584-wide FFN, twice over while the panels are
/// gathered), and past a decode step's rows one region per expert costs nothing that
/// matters.
pub const GROUPED_MAX_ROWS: usize = 256;

/// Checks `rows` against `x_norm` (`[n_tokens, hidden]`) and `slots` (`[n_tokens, top_k,
/// hidden]`) and gathers the rows routed to one expert into a contiguous block; `None`
/// when no row is.
fn gather_rows(
    arch: &ArchSpec,
    x_norm: &[f32],
    rows: &[RoutedRow],
    slots: &[f32],
) -> Result<Option<Vec<f32>>, KernelError> {
    let (d, k) = (arch.hidden, arch.top_k);
    let n_tokens = x_norm.len() / d.max(1);
    check_len("expert input", x_norm.len(), n_tokens * d)?;
    check_len("expert slots", slots.len(), n_tokens * k * d)?;
    if rows.is_empty() {
        return Ok(None);
    }
    if let Some(bad) = rows
        .iter()
        .find(|r| r.row as usize >= n_tokens || r.slot as usize >= k)
    {
        return Err(KernelError::Shape {
            what: "routed row (row, slot)",
            expected: n_tokens * k,
            got: bad.row as usize * k + bad.slot as usize,
        });
    }
    let mut gathered = vec![0.0f32; rows.len() * d];
    for (i, r) in rows.iter().enumerate() {
        let src = r.row as usize * d;
        gathered[i * d..(i + 1) * d].copy_from_slice(&x_norm[src..src + d]);
    }
    Ok(Some(gathered))
}

/// Writes `weight * y` of each routed row into its (row, slot) of `slots`.
fn scatter_rows(d: usize, top_k: usize, rows: &[RoutedRow], y: &[f32], slots: &mut [f32]) {
    for (i, r) in rows.iter().enumerate() {
        let at = (r.row as usize * top_k + r.slot as usize) * d;
        for (o, v) in slots[at..at + d].iter_mut().zip(&y[i * d..(i + 1) * d]) {
            *o = r.weight * v;
        }
    }
}

/// `residual += Σ slots` per row, the slots summed in ascending expert index starting
/// from zero (as Hugging Face's `index_add` loop over experts does).
pub fn combine(routing: &Routing, slots: &[f32], residual: &mut [f32]) -> Result<(), KernelError> {
    combine_shared(routing, slots, None, residual)
}

/// [`combine`], with the shared expert's rows (`[n_tokens, hidden]`) added to each row's
/// routed sum before the sum goes into the residual (Qwen2-MoE's
/// `residual + (experts + shared)`).
pub fn combine_shared(
    routing: &Routing,
    slots: &[f32],
    shared: Option<&[f32]>,
    residual: &mut [f32],
) -> Result<(), KernelError> {
    let k = routing.top_k.max(1);
    let n = routing.n_tokens();
    let d = residual.len() / n.max(1);
    check_len("combine residual", residual.len(), n * d)?;
    check_len("combine slots", slots.len(), n * k * d)?;
    if let Some(shared) = shared {
        check_len("combine shared expert rows", shared.len(), n * d)?;
    }
    let mut order: Vec<usize> = Vec::with_capacity(k);
    let mut sum = vec![0.0f32; d];
    for t in 0..n {
        let chosen = &routing.experts[t * k..(t + 1) * k];
        order.clear();
        order.extend(0..k);
        order.sort_by_key(|&s| (chosen[s], s));
        sum.fill(0.0);
        for &s in &order {
            let at = (t * k + s) * d;
            for (acc, v) in sum.iter_mut().zip(&slots[at..at + d]) {
                *acc += v;
            }
        }
        if let Some(shared) = shared {
            for (acc, v) in sum.iter_mut().zip(&shared[t * d..(t + 1) * d]) {
                *acc += v;
            }
        }
        for (r, v) in residual[t * d..(t + 1) * d].iter_mut().zip(&sum) {
            *r += v;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gpt-oss: logits [1, 3, 2, 0], top-2 = experts 1 and 2, softmax over (3, 2) only:
    /// e / (e + 1) = 0.731059 and 1 / (e + 1) = 0.268941.
    #[test]
    fn gpt_oss_routing_softmaxes_over_the_top_k_only() {
        let r = route_topk_softmax(&[1.0, 3.0, 2.0, 0.0], 4, 2);
        assert_eq!(r.experts, vec![1, 2]);
        let e = std::f32::consts::E;
        assert!(
            (r.weights[0] - e / (e + 1.0)).abs() < 1e-6,
            "{:?}",
            r.weights
        );
        assert!(
            (r.weights[1] - 1.0 / (e + 1.0)).abs() < 1e-6,
            "{:?}",
            r.weights
        );
    }

    /// The shared expert's rows are added to the routed sum before the residual:
    /// residual 1, one slot 2 (weight already applied), shared row 4 gives 7.
    #[test]
    fn combine_adds_the_shared_expert_row() {
        let routing = Routing {
            top_k: 1,
            experts: vec![0],
            weights: vec![1.0],
        };
        let mut residual = [1.0f32, 1.0];
        combine_shared(&routing, &[2.0, 2.0], Some(&[4.0, 4.0]), &mut residual).unwrap();
        assert_eq!(residual, [7.0, 7.0]);
        assert!(combine_shared(&routing, &[2.0, 2.0], Some(&[4.0]), &mut residual).is_err());
    }

    /// Logits [ln 1, ln 2, ln 3, ln 4]: probabilities 0.1..0.4; top-2 = experts 3, 2 with
    /// 0.4 and 0.3, renormalised by their sum to 4/7 and 3/7.
    #[test]
    fn routing_renormalises_by_the_top_k_sum() {
        let logits = [1f32.ln(), 2f32.ln(), 3f32.ln(), 4f32.ln()];
        let r = route(&logits, 4, 2, Some(1.0));
        assert_eq!(r.experts, vec![3, 2]);
        assert!((r.weights[0] - 4.0 / 7.0).abs() < 1e-6 && (r.weights[1] - 3.0 / 7.0).abs() < 1e-6);
        let raw = route(&logits, 4, 2, None);
        assert!((raw.weights[0] - 0.4).abs() < 1e-6 && (raw.weights[1] - 0.3).abs() < 1e-6);
        let groups = ExpertGroups::new(&r, 4);
        let rows: Vec<Vec<(u32, u32)>> = (0..4)
            .map(|e| groups.rows_of(e).iter().map(|p| (p.row, p.slot)).collect())
            .collect();
        assert_eq!(rows, vec![vec![], vec![], vec![(0, 1)], vec![(0, 0)]]);
    }
}

#[cfg(test)]
mod grouped_tests {
    use super::*;
    use crate::math::tensor::{Matrix, TypedSlice};
    use crate::model::card::ModelCard;

    /// Five tokens of width `d` and their routing to three experts (a token at most once an
    /// expert, slots 0 and 1), shared by the grouped-against-one-at-a-time tests.
    fn five_tokens_to_three_experts(d: usize) -> (usize, Vec<f32>, [Vec<RoutedRow>; 3]) {
        let n_tokens = 5;
        let x: Vec<f32> = (0..n_tokens * d)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let row = |row: u32, slot: u32, weight: f32| RoutedRow { row, slot, weight };
        let rows = [
            vec![row(0, 0, 0.7), row(3, 1, 0.2)],
            vec![row(0, 1, 0.3), row(1, 0, 0.9), row(4, 0, 0.5)],
            vec![row(2, 0, 1.0)],
        ];
        (n_tokens, x, rows)
    }
    use crate::model::vocab::Orientation;
    use crate::quant::{random_blocks, QuantFormat, QuantSlice};

    /// Several quantised experts run together (one region for their gate/up products, one
    /// for their downs) give each slot the bits of running them one at a time.
    #[test]
    fn grouped_quantised_experts_give_the_one_at_a_time_bits() {
        let arch = ArchSpec::from_card(&ModelCard::load("mixtral-tiny").unwrap());
        let (d, f, k) = (arch.hidden, arch.ffn, arch.top_k);
        let format = QuantFormat::Q8_0;
        let blocks = |elems: usize, seed: u64| random_blocks(format, elems / 32, seed);
        let bytes: Vec<[Vec<u8>; 3]> = (0..3)
            .map(|e| {
                [
                    blocks(f * d, 3 * e),
                    blocks(f * d, 3 * e + 1),
                    blocks(d * f, 3 * e + 2),
                ]
            })
            .collect();
        fn matrix(b: &[u8], rows: usize, cols: usize) -> Matrix<'_> {
            let q = QuantSlice::new(b, QuantFormat::Q8_0, rows * cols).unwrap();
            Matrix::new(TypedSlice::Quant(q), rows, cols, Orientation::OutIn).unwrap()
        }
        let experts: Vec<ExpertWeights<'_>> = bytes
            .iter()
            .map(|[g, u, dn]| ExpertWeights {
                gate: matrix(g, f, d),
                up: matrix(u, f, d),
                down: matrix(dn, d, f),
                fused: None,
            })
            .collect();
        let (n_tokens, x, rows) = five_tokens_to_three_experts(d);
        let jobs: Vec<(ExpertWeights<'_>, &[RoutedRow])> = experts
            .iter()
            .zip(&rows)
            .map(|(e, r)| (*e, r.as_slice()))
            .collect();
        let kernels = Kernels::process();
        let mut grouped = vec![0.0f32; n_tokens * k * d];
        kernels.experts_ffn(&arch, &jobs, &x, &mut grouped).unwrap();
        let mut one_by_one = vec![0.0f32; n_tokens * k * d];
        for (e, r) in &jobs {
            kernels
                .expert_ffn(&arch, e, &x, r, &mut one_by_one)
                .unwrap();
        }
        assert!(grouped.iter().any(|v| *v != 0.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&grouped), bits(&one_by_one));
    }

    /// gpt-oss's experts (MXFP4 fused gate_up `[2 ffn, hidden]` and down `[hidden, ffn]`,
    /// out-in as its GGUF stores them, with biases and the clamped SwiGLU) run grouped give
    /// each slot the bits of running them one at a time, in the row layout and in tiles.
    #[test]
    fn grouped_gpt_oss_experts_give_the_one_at_a_time_bits() {
        let arch = ArchSpec::from_card(&ModelCard::load("gpt-oss-tiny").unwrap());
        let (d, f, k) = (arch.hidden, arch.ffn, arch.top_k);
        assert!(arch.clamped_swiglu.is_some());
        let format = QuantFormat::Mxfp4;
        let plain: Vec<[Vec<u8>; 2]> = (0..3)
            .map(|e| {
                [
                    random_blocks(format, 2 * f * d / 32, 5 * e + 1),
                    random_blocks(format, d * f / 32, 5 * e + 2),
                ]
            })
            .collect();
        let biases: Vec<[Vec<half::bf16>; 2]> = (0..3)
            .map(|e| {
                let b = |n: usize, s: usize| {
                    (0..n)
                        .map(|i| half::bf16::from_f32(((i * 7 + s) % 13) as f32 / 4.0 - 1.5))
                        .collect::<Vec<_>>()
                };
                [b(2 * f, e), b(d, e + 5)]
            })
            .collect();
        let tile = |b: &[u8], rows: usize, cols: usize| {
            let mut t = vec![0u8; b.len()];
            assert!(crate::math::qmatmul::tiles::tile(
                format, b, rows, cols, &mut t
            ));
            t
        };
        let tiled: Vec<[Vec<u8>; 2]> = plain
            .iter()
            .map(|[gu, dn]| [tile(gu, 2 * f, d), tile(dn, d, f)])
            .collect();
        let (n_tokens, x, rows) = five_tokens_to_three_experts(d);
        fn matrix(b: &[u8], tiles: bool, rows: usize, cols: usize) -> Matrix<'_> {
            let format = QuantFormat::Mxfp4;
            let q = if tiles {
                QuantSlice::tiled(b, format, rows * cols, cols)
            } else {
                QuantSlice::new(b, format, rows * cols)
            };
            Matrix::new(
                TypedSlice::Quant(q.unwrap()),
                rows,
                cols,
                Orientation::OutIn,
            )
            .unwrap()
        }
        for (layout, bytes) in [("rows", &plain), ("tiles", &tiled)] {
            let tiles = layout == "tiles";
            let empty = Matrix::empty();
            let experts: Vec<ExpertWeights<'_>> = bytes
                .iter()
                .zip(&biases)
                .map(|([gu, dn], [bgu, bdn])| ExpertWeights {
                    gate: empty,
                    up: empty,
                    down: matrix(dn, tiles, d, f),
                    fused: Some(FusedExpert {
                        gate_up: matrix(gu, tiles, 2 * f, d),
                        gate_up_bias: TypedSlice::Bf16(bgu),
                        down_bias: TypedSlice::Bf16(bdn),
                    }),
                })
                .collect();
            let jobs: Vec<(ExpertWeights<'_>, &[RoutedRow])> = experts
                .iter()
                .zip(&rows)
                .map(|(e, r)| (*e, r.as_slice()))
                .collect();
            assert!(jobs
                .iter()
                .all(|(e, _)| GroupedExpert::new(&arch, e).is_some()));
            let kernels = Kernels::process();
            let mut grouped = vec![0.0f32; n_tokens * k * d];
            kernels.experts_ffn(&arch, &jobs, &x, &mut grouped).unwrap();
            let mut one_by_one = vec![0.0f32; n_tokens * k * d];
            for (e, r) in &jobs {
                kernels
                    .expert_ffn(&arch, e, &x, r, &mut one_by_one)
                    .unwrap();
            }
            assert!(
                grouped.iter().filter(|v| **v != 0.0).count() > d,
                "{layout}"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&grouped), bits(&one_by_one), "{layout}");
        }
    }
}
