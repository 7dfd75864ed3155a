//! `moec generate`: run the oracle on prompts and print the text (or one JSON object).
//!
//! Takes a model source (`--model`, `--weights`, both or neither), prompts (`--prompt`
//! repeated, or `--prompts FILE.jsonl` with one `{"prompt": ...}` object or JSON string per
//! line) and sampling flags; prints the continuation and a tokens/s line, or with `--json`
//! `{"outputs": [{prompt, token_ids, text, logprobs}], "stats": {prompt_tokens,
//! generated_tokens, seconds, tokens_per_s}}`. Errors print one line and exit 1.
//! `engine::generate` runs the prompts on the oracle in batches; this shows its progress
//! (a bar on a terminal, a line per batch on stderr otherwise) from its first seconds.

use super::inputs::{ModelArgs, PromptArgs};
use crate::engine::{self, GenerateRequest, Sampling};
use std::process::ExitCode;

/// Progress over the prompts: a bar on a terminal, otherwise one line per batch on stderr
/// (a log shows how far a long file got).
struct Progress {
    bar: indicatif::ProgressBar,
    total: usize,
}

impl Progress {
    fn new(total: usize) -> Self {
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} generating [{bar:30}] {pos}/{len} prompts ({per_sec}, ETA {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Progress { bar, total }
    }

    fn update(&self, prompts_done: usize, tokens: usize, seconds: f64) {
        self.bar.set_position(prompts_done as u64);
        if self.bar.is_hidden() {
            let rate = if seconds > 0.0 {
                tokens as f64 / seconds
            } else {
                0.0
            };
            eprintln!(
                "moec: generated {prompts_done}/{} prompts, {tokens} tokens in {seconds:.1} s ({rate:.1} tokens/s)",
                self.total
            );
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Arguments of `moec generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Which model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Which prompts.
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Tokens to generate per prompt at most.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus (top-p) mass when sampling.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Prints an error as a one-line miette diagnostic (no colour, no wrapping) and returns
/// exit code 1.
pub(crate) fn fail(message: impl std::fmt::Display) -> ExitCode {
    let report = miette::miette!("{message}");
    let handler =
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
            .with_width(usize::MAX);
    let mut rendered = String::new();
    if handler
        .render_report(&mut rendered, report.as_ref())
        .is_err()
    {
        rendered = format!("error: {message}");
    }
    eprintln!("{}", rendered.trim());
    ExitCode::from(1)
}

fn read_prompts(args: &GenerateArgs) -> Result<Vec<String>, String> {
    let prompts = args.prompt.texts()?;
    if prompts.is_empty() {
        return Err("no prompts: pass --prompt TEXT (repeatable) or --prompts FILE.jsonl".into());
    }
    Ok(prompts)
}

/// Runs `moec generate`.
pub fn run(args: &GenerateArgs) -> ExitCode {
    match generate(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => fail(message),
    }
}

fn generate(args: &GenerateArgs) -> Result<(), String> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(format!(
            "--temperature must be >= 0 (got {})",
            args.temperature
        ));
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        return Err(format!("--top-p must be in (0, 1] (got {})", args.top_p));
    }
    let prompts = read_prompts(args)?;
    let sampling = if args.temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::Temperature {
            temperature: args.temperature,
            top_p: args.top_p,
        }
    };
    let request = GenerateRequest {
        model: args.model.source(),
        prompts,
        max_new_tokens: args.max_new_tokens,
        sampling,
        seed: args.seed,
    };
    let progress = Progress::new(request.prompts.len());
    let result = engine::generate(&request, &mut |done, tokens, seconds| {
        progress.update(done, tokens, seconds)
    });
    progress.finish();
    let result = result?;
    let (seconds, tokens_per_s) = (result.seconds, result.tokens_per_s());
    let (prompt_tokens, generated_tokens) = (result.prompt_tokens, result.generated_tokens);
    if args.json {
        let outs: Vec<serde_json::Value> = result
            .outputs
            .iter()
            .zip(&request.prompts)
            .map(|(o, p)| {
                serde_json::json!({"prompt": p, "token_ids": o.token_ids, "text": o.text, "logprobs": o.logprobs})
            })
            .collect();
        let doc = serde_json::json!({
            "outputs": outs,
            "stats": {
                "prompt_tokens": prompt_tokens,
                "generated_tokens": generated_tokens,
                "seconds": seconds,
                "tokens_per_s": tokens_per_s,
            }
        });
        println!("{doc}");
    } else {
        for (p, o) in request.prompts.iter().zip(&result.outputs) {
            println!("{p}{}", o.text);
        }
        let origin = if result.synthetic {
            "synthetic weights"
        } else {
            "weights"
        };
        // Say how the weights were read when it is not byte for byte (MXFP4 experts).
        let note = result
            .storage_note
            .map_or_else(String::new, |n| format!("; {n}"));
        println!(
            "{generated_tokens} tokens in {seconds:.3} s: {tokens_per_s:.1} tokens/s ({} prompt tokens; {} from {origin} at {}{note})",
            prompt_tokens,
            result.model,
            result.weights.display()
        );
    }
    Ok(())
}
