//! The mixture-of-experts block: gate (norm, router softmax over all experts in f32,
//! top-k, renormalisation), experts grouped by expert over their routed rows, combine.
//!
//! Takes the residual `[n_tokens, hidden]`; [`gate`] gives the normalised rows and a
//! [`Routing`]; [`expert_ffn`] runs one expert's SwiGLU on the rows routed to it (gathered
//! into a contiguous block so the products are GEMMs) and adds `weight * y` into the MoE
//! output; [`combine`] adds that output into the residual. Running experts in index order
//! reproduces Hugging Face's summation order.

use crate::model::arch::ArchSpec;
use crate::model::kernels::linear::linear;
use crate::model::kernels::norm::normalize;
use crate::model::kernels::{check_len, KernelError};
use crate::model::weights::{DenseWeights, ExpertWeights};

/// The router's decision for a batch of rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per row.
    pub top_k: usize,
    /// `[n_tokens, top_k]` chosen experts, highest probability first.
    pub experts: Vec<u32>,
    /// `[n_tokens, top_k]` routing weights after renormalisation.
    pub weights: Vec<f32>,
}

/// Rows routed to one expert: `(row, routing weight)`.
pub type ExpertRows = Vec<(u32, f32)>;

impl Routing {
    /// Rows.
    pub fn n_tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }

    /// The rows each expert must process, by expert index, rows ascending.
    pub fn by_expert(&self, n_experts: usize) -> Vec<ExpertRows> {
        let mut groups = vec![Vec::new(); n_experts];
        for (i, (&e, &w)) in self.experts.iter().zip(&self.weights).enumerate() {
            if let Some(g) = groups.get_mut(e as usize) {
                g.push(((i / self.top_k) as u32, w));
            }
        }
        groups
    }
}

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

/// Pre-MoE norm of the residual into `x_norm`, router logits, routing.
pub fn gate(
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
    linear(x_norm, n, &dense.router, &mut logits);
    Ok(route(&logits, arch.experts, arch.top_k, arch.router_norm_p))
}

/// `silu(x) = x * sigmoid(x)`.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Runs one expert on its routed rows of `x_norm` (`[n_tokens, hidden]`) and adds
/// `weight * down(silu(gate(x)) * up(x))` into `moe_out` (`[n_tokens, hidden]`).
pub fn expert_ffn(
    arch: &ArchSpec,
    expert: &ExpertWeights<'_>,
    x_norm: &[f32],
    rows: &[(u32, f32)],
    moe_out: &mut [f32],
) -> Result<(), KernelError> {
    let (d, f) = (arch.hidden, arch.ffn);
    let n_tokens = x_norm.len() / d.max(1);
    check_len("expert output", moe_out.len(), n_tokens * d)?;
    if rows.is_empty() {
        return Ok(());
    }
    if let Some(&(bad, _)) = rows.iter().find(|(r, _)| *r as usize >= n_tokens) {
        return Err(KernelError::Shape {
            what: "expert row index",
            expected: n_tokens,
            got: bad as usize,
        });
    }
    let n = rows.len();
    let mut gathered = vec![0.0f32; n * d];
    for (i, &(r, _)) in rows.iter().enumerate() {
        gathered[i * d..(i + 1) * d].copy_from_slice(&x_norm[r as usize * d..(r as usize + 1) * d]);
    }
    let mut h_gate = vec![0.0f32; n * f];
    let mut h_up = vec![0.0f32; n * f];
    linear(&gathered, n, &expert.gate, &mut h_gate);
    linear(&gathered, n, &expert.up, &mut h_up);
    for (g, u) in h_gate.iter_mut().zip(&h_up) {
        *g = silu(*g) * u;
    }
    linear(&h_gate, n, &expert.down, &mut gathered);
    for (i, &(r, w)) in rows.iter().enumerate() {
        let dst = &mut moe_out[r as usize * d..(r as usize + 1) * d];
        for (o, y) in dst.iter_mut().zip(&gathered[i * d..(i + 1) * d]) {
            *o += w * y;
        }
    }
    Ok(())
}

/// `residual += moe_out`.
pub fn combine(residual: &mut [f32], moe_out: &[f32]) -> Result<(), KernelError> {
    check_len("combine", moe_out.len(), residual.len())?;
    for (r, m) in residual.iter_mut().zip(moe_out) {
        *r += m;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let rows: Vec<Vec<u32>> = r
            .by_expert(4)
            .iter()
            .map(|g| g.iter().map(|p| p.0).collect())
            .collect();
        assert_eq!(rows, vec![vec![], vec![], vec![0], vec![0]]);
    }
}
