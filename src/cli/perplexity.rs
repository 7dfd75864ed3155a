//! `moec perplexity`: a checkpoint's perplexity on a fixed text, and with `--reference`
//! how far its next-token distributions are from another checkpoint's (a quantised GGUF
//! against the bf16 folder it came from).
//!
//! Takes the model flags (`--weights DIR|FILE.gguf`, `--model`), `--text FILE` (default:
//! the opening of the US Declaration of Independence, public domain, embedded from
//! `models/text/declaration.txt`), `--window N` and `--reference DIR|FILE`; prints the
//! figures as a line each, or one JSON object with `--json`. `engine::perplexity` scores
//! the text; this reads the flags and prints.

use crate::cli::generate::fail;
use crate::cli::inputs::ModelArgs;
use crate::engine::{self, PerplexityRequest, PerplexityResult};
use std::path::PathBuf;
use std::process::ExitCode;

/// The text scored when `--text` is absent.
const DEFAULT_TEXT: &str = include_str!("../../models/text/declaration.txt");

/// Arguments of `moec perplexity`.
#[derive(Debug, clap::Args)]
pub struct PerplexityArgs {
    /// Which model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// A UTF-8 text file to score (default: the opening of the US Declaration of
    /// Independence, embedded).
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
    /// Tokens per window: the text is cut into whole windows, each scored from its start.
    #[arg(long, default_value_t = 64)]
    pub window: usize,
    /// A second checkpoint (folder or .gguf) to compare with: its perplexity, the mean KL
    /// divergence from it, top-1 agreement and the largest logit difference.
    #[arg(long, value_name = "DIR|FILE")]
    pub reference: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs `moec perplexity`.
pub fn run(args: &PerplexityArgs) -> ExitCode {
    match score(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn score(args: &PerplexityArgs) -> Result<(), String> {
    let (text, text_name) = match &args.text {
        Some(p) => (
            std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?,
            p.display().to_string(),
        ),
        None => (DEFAULT_TEXT.to_string(), "the embedded text".to_string()),
    };
    let request = PerplexityRequest {
        model: args.model.source(),
        text,
        text_name,
        window: args.window,
        reference: args.reference.clone(),
    };
    let PerplexityResult {
        report,
        tokens,
        seconds,
    } = engine::perplexity(&request)?;
    let text_name = &request.text_name;
    if args.json {
        let json = serde_json::json!({
            "text": text_name,
            "tokens": tokens,
            "report": report,
            "seconds": seconds,
        });
        println!("{json}");
        return Ok(());
    }
    println!(
        "perplexity {:.4} over {} predictions ({} windows of {} tokens of {text_name}, {} tokens) in {:.1} s",
        report.perplexity,
        report.predictions,
        report.windows,
        report.window,
        tokens,
        seconds
    );
    if let (Some(r), Some(path)) = (&report.reference, &args.reference) {
        println!(
            "reference {}: perplexity {:.4} (ratio {:.5}); mean KL {:.3e} nats (max {:.3e}); \
             top-1 agreement {:.1}%; max |logit difference| {:.4}",
            path.display(),
            r.perplexity,
            report.perplexity / r.perplexity,
            r.mean_kl,
            r.max_kl,
            100.0 * r.top1_agreement,
            r.max_logit_diff
        );
    }
    Ok(())
}
