//! DeepSeek's routers, as transformers' `DeepseekV2TopkRouter` and `DeepseekV3TopkRouter`.
//!
//! Takes f32 router logits `[n_tokens, experts]`, the card's [`DeepseekRouter`] and, for
//! V3, the selection correction bias; gives a [`Routing`] whose weights are what the
//! experts' outputs are multiplied by. V2: softmax over all experts, then the top-k of all
//! (`greedy`) or of the `topk_group` groups with the highest expert score (masked scores
//! are 0, `group_limited_greedy`), times `routed_scaling_factor`. V3 (`noaux_tc`): sigmoid
//! scores; selection by score + bias among the `topk_group` groups with the highest sum of
//! their two best biased scores (masked to -inf); the weights are the unbiased scores,
//! divided by their sum + 1e-20 when `norm_topk_prob`, times `routed_scaling_factor`. Ties
//! go to the lower index (torch's `topk` leaves them unspecified; random weights never tie).

use crate::model::card::{DeepseekRouter, DeepseekTopk};
use crate::model::vocab::Routing;

/// The `k` largest of `values` (ties to the lower index), highest first.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Keeps the `topk_group` groups ranked highest by `group_score` and sets every score
/// outside them to `masked`.
fn mask_groups(
    scores: &mut [f32],
    r: &DeepseekRouter,
    masked: f32,
    group_score: impl Fn(&[f32]) -> f32,
) {
    let n_group = r.n_group.max(1) as usize;
    let per_group = scores.len() / n_group;
    if n_group <= 1 || per_group == 0 {
        return;
    }
    let group_scores: Vec<f32> = scores.chunks_exact(per_group).map(&group_score).collect();
    let kept = top_indices(&group_scores, r.topk_group as usize);
    for (g, chunk) in scores.chunks_exact_mut(per_group).enumerate() {
        if !kept.contains(&g) {
            chunk.fill(masked);
        }
    }
}

/// Routes every row of `logits` (`[n_tokens, experts]`); `bias` is V3's
/// `e_score_correction_bias` (`experts` values; absent = zeros).
pub fn route_deepseek(
    logits: &[f32],
    experts: usize,
    top_k: usize,
    r: &DeepseekRouter,
    bias: Option<&[f32]>,
) -> Routing {
    let n = logits.len() / experts.max(1);
    let mut chosen_experts = Vec::with_capacity(n * top_k);
    let mut weights = Vec::with_capacity(n * top_k);
    let scale = r.routed_scaling_factor as f32;
    for row in logits.chunks_exact(experts.max(1)).take(n) {
        let (chosen, picked): (Vec<usize>, Vec<f32>) = match r.topk {
            DeepseekTopk::Greedy | DeepseekTopk::GroupLimitedGreedy => {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
                let sum: f32 = exps.iter().sum();
                let mut scores: Vec<f32> = exps.iter().map(|e| e / sum).collect();
                if r.topk == DeepseekTopk::GroupLimitedGreedy {
                    mask_groups(&mut scores, r, 0.0, |g| {
                        g.iter().copied().fold(f32::NEG_INFINITY, f32::max)
                    });
                }
                let chosen = top_indices(&scores, top_k);
                let picked = chosen.iter().map(|&e| scores[e]).collect();
                (chosen, picked)
            }
            DeepseekTopk::NoauxTc => {
                let scores: Vec<f32> = row.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
                let mut choice: Vec<f32> = scores
                    .iter()
                    .enumerate()
                    .map(|(e, s)| s + bias.and_then(|b| b.get(e)).copied().unwrap_or(0.0))
                    .collect();
                mask_groups(&mut choice, r, f32::NEG_INFINITY, |g| {
                    top_indices(g, 2).iter().map(|&i| g[i]).sum()
                });
                let chosen = top_indices(&choice, top_k);
                let mut picked: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
                if r.norm_topk_prob {
                    let denominator = picked.iter().sum::<f32>() + 1e-20;
                    for w in &mut picked {
                        *w /= denominator;
                    }
                }
                (chosen, picked)
            }
        };
        for (e, w) in chosen.into_iter().zip(picked) {
            chosen_experts.push(e as u32);
            weights.push(w * scale);
        }
    }
    Routing {
        top_k,
        experts: chosen_experts,
        weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(topk: DeepseekTopk, n_group: u64, topk_group: u64, norm: bool) -> DeepseekRouter {
        DeepseekRouter {
            topk,
            n_group,
            topk_group,
            routed_scaling_factor: 2.0,
            norm_topk_prob: norm,
        }
    }

    /// Four experts in two groups, logits ln(1), ln(2), ln(3), ln(4): softmax = 0.1, 0.2,
    /// 0.3, 0.4. Greedy top-2 picks 3 and 2 (0.4, 0.3) scaled by 2; group-limited with one
    /// group keeps group 1 (max 0.4 > 0.2), the same two.
    #[test]
    fn v2_greedy_and_group_limited_match_hand_arithmetic() {
        let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| v.ln()).collect();
        for topk in [DeepseekTopk::Greedy, DeepseekTopk::GroupLimitedGreedy] {
            let got = route_deepseek(&logits, 4, 2, &router(topk, 2, 1, false), None);
            assert_eq!(got.experts, vec![3, 2]);
            assert!((got.weights[0] - 0.8).abs() < 1e-6, "{:?}", got.weights);
            assert!((got.weights[1] - 0.6).abs() < 1e-6, "{:?}", got.weights);
        }
    }

    /// Group-limited greedy masks the lower group even when it holds the second best
    /// expert: scores 0.05, 0.35, 0.3, 0.3 (groups {0,1} max 0.35, {2,3} max 0.3); one group
    /// kept, so top-2 = experts 1 and 0 although 2 and 3 score higher than 0.
    #[test]
    fn v2_group_limited_keeps_only_the_best_group() {
        let logits: Vec<f32> = [0.05f32, 0.35, 0.3, 0.3].iter().map(|v| v.ln()).collect();
        let got = route_deepseek(
            &logits,
            4,
            2,
            &router(DeepseekTopk::GroupLimitedGreedy, 2, 1, false),
            None,
        );
        assert_eq!(got.experts, vec![1, 0]);
        assert!((got.weights[1] - 0.1).abs() < 1e-6, "{:?}", got.weights);
    }

    /// V3: logits 0 everywhere (sigmoid 0.5); the bias alone decides selection (group {2,3}
    /// sums 0.5+0.3 + 0.5+0.2 > group {0,1}'s 0.5+0.1 + 0.5), weights are the unbiased 0.5,
    /// renormalised to 0.5 each, times 2 = 1.0.
    #[test]
    fn v3_bias_selects_and_scores_weigh() {
        let bias = [0.1f32, 0.0, 0.3, 0.2];
        let r = router(DeepseekTopk::NoauxTc, 2, 1, true);
        let got = route_deepseek(&[0.0; 4], 4, 2, &r, Some(&bias));
        assert_eq!(got.experts, vec![2, 3]);
        assert_eq!(got.weights, vec![1.0, 1.0]);
        let r = router(DeepseekTopk::NoauxTc, 2, 1, false);
        let got = route_deepseek(&[0.0; 4], 4, 2, &r, Some(&bias));
        assert_eq!(got.weights, vec![1.0, 1.0]);
    }
}
