//! A checkpoint's perplexity on a text, and how far its next-token distributions are from
//! a reference checkpoint's (a quantised GGUF against the bf16 folder it came from).
//!
//! Takes a [`PerplexityRequest`] (the model source, the text and its name in messages,
//! the window, an optional reference checkpoint); gives a [`PerplexityResult`] (the
//! oracle's report, the text's token count and the scoring time) or a one-line message.
//! Both models run on the oracle (the CPU reference forward pass) with the same kernels,
//! so a difference is the weights'. `moec perplexity` calls [`perplexity`]; nothing here
//! prints.

use crate::oracle::perplexity::PerplexityReport;
use crate::oracle::Oracle;
use crate::weights::source::{load_model, ModelSource};
use std::path::PathBuf;

/// What `moec perplexity` asks for.
#[derive(Debug, Clone)]
pub struct PerplexityRequest {
    /// Which model.
    pub model: ModelSource,
    /// The text to score.
    pub text: String,
    /// The text's name in messages (its path, or what stands for an embedded text).
    pub text_name: String,
    /// Tokens per window: the text is cut into whole windows, each scored from its start.
    pub window: usize,
    /// A second checkpoint (folder or .gguf) to compare with.
    pub reference: Option<PathBuf>,
}

/// What scoring a text produced.
#[derive(Debug, Clone)]
pub struct PerplexityResult {
    /// The oracle's figures (and the reference's, when one was given).
    pub report: PerplexityReport,
    /// Tokens of the text.
    pub tokens: usize,
    /// Wall time of the scoring (loading excluded).
    pub seconds: f64,
}

/// Loads the model (and the reference, which must tokenise the text identically) and
/// scores the text in windows.
pub fn perplexity(request: &PerplexityRequest) -> Result<PerplexityResult, String> {
    let text_name = &request.text_name;
    let model = load_model(&request.model).map_err(|e| e.to_string())?;
    let reference = match &request.reference {
        Some(path) => Some(
            load_model(&ModelSource {
                card: None,
                weights: Some(path.clone()),
            })
            .map_err(|e| format!("--reference: {e}"))?,
        ),
        None => None,
    };
    let tokens = model
        .tokenizer
        .encode(&request.text)
        .map_err(|e| format!("{text_name}: {e}"))?;
    if let Some(r) = &reference {
        let theirs = r
            .tokenizer
            .encode(&request.text)
            .map_err(|e| format!("--reference: {e}"))?;
        if theirs != tokens {
            return Err(format!(
                "--reference tokenises {text_name} differently ({} tokens against {}): the \
                 two checkpoints must share a tokenizer",
                theirs.len(),
                tokens.len()
            ));
        }
    }
    let oracle = Oracle::new(&model.checkpoint).map_err(|e| e.to_string())?;
    let ref_oracle = match &reference {
        Some(r) => Some(Oracle::new(&r.checkpoint).map_err(|e| format!("--reference: {e}"))?),
        None => None,
    };
    let start = std::time::Instant::now();
    let report = crate::oracle::perplexity::perplexity(
        &oracle,
        ref_oracle.as_ref(),
        &tokens,
        request.window,
    )
    .map_err(|e| format!("{text_name}: {e}"))?;
    Ok(PerplexityResult {
        report,
        tokens: tokens.len(),
        seconds: start.elapsed().as_secs_f64(),
    })
}
