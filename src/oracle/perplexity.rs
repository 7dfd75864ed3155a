//! Perplexity of a model on a token stream, and how far its next-token distributions are
//! from a reference model's (`moec perplexity`: a quantised checkpoint against its bf16
//! source, as llama.cpp's `llama-perplexity --kl-divergence` compares them).
//!
//! Takes one or two [`Oracle`]s over the same vocabulary and the tokens; gives the mean
//! negative log-likelihood (perplexity = its exponential) of every token after the first of
//! each window, and, with a reference, the reference's perplexity, the mean KL divergence
//! `KL(reference || model)` of the next-token distributions, the share of positions whose
//! top token agrees, and the largest logit difference. The text is cut into whole windows
//! of `window` tokens (a tail shorter than a window is left out, so every window sees the
//! same context lengths); all windows run together as one batch of sequences, one
//! position per step, so both models see exactly the same contexts. Log-probabilities are
//! formed in f64 from the f32 logits (max-subtracted log-sum-exp).

use crate::math::sampling::{argmax, log_softmax};
use crate::oracle::{Oracle, OracleError, StepSeq};

/// What [`perplexity`] measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PerplexityReport {
    /// Windows scored.
    pub windows: usize,
    /// Tokens per window.
    pub window: usize,
    /// Predictions scored (`windows * (window - 1)`).
    pub predictions: usize,
    /// The model's perplexity.
    pub perplexity: f64,
    /// Against the reference, when one was given.
    pub reference: Option<ReferenceReport>,
}

/// The model against a reference model on the same positions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReferenceReport {
    /// The reference's perplexity.
    pub perplexity: f64,
    /// Mean `KL(reference || model)` in nats.
    pub mean_kl: f64,
    /// The largest per-position KL divergence.
    pub max_kl: f64,
    /// Share of positions whose argmax token is the same.
    pub top1_agreement: f64,
    /// Largest |logit difference| at any position and token.
    pub max_logit_diff: f32,
}

/// Why a text cannot be scored.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    /// The text has fewer tokens than one window.
    #[error("the text has {tokens} tokens, fewer than one window of {window}")]
    TooShort {
        /// Tokens in the text.
        tokens: usize,
        /// The window.
        window: usize,
    },
    /// A window of fewer than 2 tokens predicts nothing, or is longer than the model's
    /// positions.
    #[error("window of {window} tokens: {why}")]
    Window {
        /// The window.
        window: usize,
        /// What is wrong.
        why: String,
    },
    /// The two models' vocabularies differ.
    #[error("the model has {model} logits a position, the reference {reference}")]
    Vocab {
        /// The model's.
        model: usize,
        /// The reference's.
        reference: usize,
    },
    /// A forward pass failed.
    #[error(transparent)]
    Oracle(#[from] OracleError),
}

/// Scores `tokens` under `model` (and `reference`) in windows of `window` tokens.
pub fn perplexity(
    model: &Oracle<'_>,
    reference: Option<&Oracle<'_>>,
    tokens: &[u32],
    window: usize,
) -> Result<PerplexityReport, PerplexityError> {
    let max = model.rope().max_positions();
    if window < 2 || window > max {
        return Err(PerplexityError::Window {
            window,
            why: format!("it must be 2 to the model's {max} positions"),
        });
    }
    let windows: Vec<&[u32]> = tokens.chunks_exact(window).collect();
    if windows.is_empty() {
        return Err(PerplexityError::TooShort {
            tokens: tokens.len(),
            window,
        });
    }
    let models: Vec<&Oracle<'_>> = std::iter::once(model).chain(reference).collect();
    let mut runs = Vec::new();
    for m in &models {
        let budgets = vec![window; windows.len()];
        let mut cache = m.new_cache(&budgets);
        let layout = cache.layout();
        let mut tables: Vec<Vec<u32>> = vec![Vec::new(); windows.len()];
        for t in tables.iter_mut() {
            cache
                .allocator
                .grow(&layout, t, window)
                .map_err(OracleError::from)?;
        }
        runs.push((cache, tables));
    }
    let (mut nll, mut nll_ref, mut kl_sum, mut kl_max) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let (mut agree, mut max_diff) = (0usize, 0.0f32);
    for pos in 0..window - 1 {
        let mut rows = Vec::with_capacity(models.len());
        for (m, (cache, tables)) in models.iter().zip(runs.iter_mut()) {
            let seqs: Vec<StepSeq<'_>> = windows
                .iter()
                .zip(tables.iter())
                .map(|(w, table)| StepSeq {
                    block_table: table,
                    context_len: pos,
                    tokens: &w[pos..pos + 1],
                })
                .collect();
            rows.push(m.step(cache, &seqs)?);
        }
        let vocab = rows[0].len() / windows.len();
        if let Some(r) = rows.get(1) {
            if r.len() != rows[0].len() {
                return Err(PerplexityError::Vocab {
                    model: vocab,
                    reference: r.len() / windows.len(),
                });
            }
        }
        for (i, w) in windows.iter().enumerate() {
            let next = w[pos + 1] as usize;
            let row = &rows[0][i * vocab..(i + 1) * vocab];
            let lp = log_softmax(row);
            nll -= lp.get(next).copied().unwrap_or(f64::NEG_INFINITY);
            if let Some(r) = rows.get(1) {
                let rrow = &r[i * vocab..(i + 1) * vocab];
                let lq = log_softmax(rrow);
                nll_ref -= lq.get(next).copied().unwrap_or(f64::NEG_INFINITY);
                let kl: f64 = lq.iter().zip(&lp).map(|(q, p)| q.exp() * (q - p)).sum();
                kl_sum += kl;
                kl_max = kl_max.max(kl);
                agree += usize::from(argmax(row) == argmax(rrow));
                for (a, b) in row.iter().zip(rrow) {
                    max_diff = max_diff.max((a - b).abs());
                }
            }
        }
    }
    let n = windows.len() * (window - 1);
    Ok(PerplexityReport {
        windows: windows.len(),
        window,
        predictions: n,
        perplexity: (nll / n as f64).exp(),
        reference: reference.map(|_| ReferenceReport {
            perplexity: (nll_ref / n as f64).exp(),
            mean_kl: kl_sum / n as f64,
            max_kl: kl_max,
            top1_agreement: agree as f64 / n as f64,
            max_logit_diff: max_diff,
        }),
    })
}
