//! Choosing the next token from logits: greedy, or seeded temperature with top-p.
//!
//! Takes one row of f32 logits and a [`Sampling`] rule (and an [`Rng`] for the seeded
//! rule); gives a token id. [`log_prob`] gives the log-probability of a token under the
//! model's unscaled distribution, which is what `moec generate` reports.

use crate::model::vocab::Sampling;
use crate::rng::Rng;

/// Index of the largest logit (first on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `log(sum(exp(logits)))` in f64, max-subtracted so large logits do not overflow.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + z.ln()
}

/// `log softmax(logits)[token]`, computed in f64 for a stable reference value.
pub fn log_prob(logits: &[f32], token: u32) -> f32 {
    (logits[token as usize] as f64 - log_sum_exp(logits)) as f32
}

/// `log softmax(logits)` of every entry, in f64 (perplexity and KL divergence).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let lse = log_sum_exp(logits);
    logits.iter().map(|&v| v as f64 - lse).collect()
}

/// Picks the next token.
pub fn sample(logits: &[f32], sampling: &Sampling, rng: &mut Rng) -> u32 {
    match *sampling {
        Sampling::Greedy => argmax(logits),
        Sampling::Temperature { temperature, top_p } => {
            let t = temperature.max(1e-6) as f64;
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let mut probs: Vec<(u32, f64)> = logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, ((v as f64 - max) / t).exp()))
                .collect();
            let z: f64 = probs.iter().map(|p| p.1).sum();
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let target = top_p.clamp(0.0, 1.0) as f64 * z;
            let mut kept = 0;
            let mut mass = 0.0;
            for p in &probs {
                kept += 1;
                mass += p.1;
                if mass >= target {
                    break;
                }
            }
            let mut draw = rng.next_f64() * mass;
            for p in &probs[..kept] {
                if draw < p.1 {
                    return p.0;
                }
                draw -= p.1;
            }
            probs[kept - 1].0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_is_normalised_and_exact_on_a_hand_example() {
        // logits [0, ln 3]: probabilities 1/4 and 3/4.
        let lp = log_softmax(&[0.0, 3.0f32.ln()]);
        assert!((lp[0] - 0.25f64.ln()).abs() < 1e-7);
        assert!((lp[1] - 0.75f64.ln()).abs() < 1e-7);
        let big = log_softmax(&[1000.0, 1000.0]);
        assert!((big[0] - 0.5f64.ln()).abs() < 1e-9, "no overflow");
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_logprob_is_normalised() {
        let logits = [0.0f32, 2.0, 2.0, -1.0];
        assert_eq!(sample(&logits, &Sampling::Greedy, &mut Rng::new(0)), 1);
        let total: f64 = (0..4).map(|t| (log_prob(&logits, t) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    /// With top_p small enough only the best token survives; with a fixed seed the draws
    /// repeat exactly.
    #[test]
    fn top_p_truncates_and_seed_fixes_draws() {
        let logits = [0.0f32, 3.0, 1.0, 2.0];
        let nucleus = Sampling::Temperature {
            temperature: 1.0,
            top_p: 0.1,
        };
        assert!((0..50).all(|s| sample(&logits, &nucleus, &mut Rng::new(s)) == 1));
        let full = Sampling::Temperature {
            temperature: 2.0,
            top_p: 1.0,
        };
        let draws = |seed| {
            let mut rng = Rng::new(seed);
            (0..64)
                .map(|_| sample(&logits, &full, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(9), draws(9));
        assert!(
            draws(9).iter().any(|&t| t != 1),
            "temperature 2 should sometimes leave the argmax"
        );
    }
}
