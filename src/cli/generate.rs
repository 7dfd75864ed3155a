//! `moec generate`: run the oracle on prompts and print the text (or one JSON object).
//!
//! Takes a model source (`--model`, `--weights`, both or neither), prompts (`--prompt`
//! repeated, or `--prompts FILE.jsonl` with one `{"prompt": ...}` object or JSON string per
//! line) and sampling flags; prints the continuation and a tokens/s line, or with `--json`
//! `{"outputs": [{prompt, token_ids, text, logprobs}], "stats": {prompt_tokens,
//! generated_tokens, seconds, tokens_per_s}}`. Errors print one line and exit 1. Prompts
//! are tokenised and go to the oracle in batches (16, then 256 at a time), so a long
//! prompt file holds one batch's sequences in memory at a time and shows progress (a bar
//! on a terminal, a line per batch on stderr otherwise) from its first seconds.

use super::inputs::{ModelArgs, PromptArgs};
use crate::model::vocab::Sampling;
use crate::oracle::{GenerateOptions, Oracle};
use crate::weights::source::load_model;
use std::process::ExitCode;

/// Prompts given to the oracle in one call: bounds the memory of a long prompt file (the
/// oracle keeps a row of logits and the KV blocks of every sequence of a call).
const PROMPTS_PER_BATCH: usize = 256;

/// Prompts of the first call: small, so the first progress comes within seconds of the
/// start (256 prompts of 32 tokens took 5 s of one core in a debug build).
const FIRST_BATCH: usize = 16;

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

/// Refuses, before anything is generated, a prompt too long for the model's positions
/// with its new tokens: the error a batch deep in the file would give, but before the
/// batches ahead of it ran. Only prompts whose bytes could make that many tokens are
/// tokenised here (a token is at least one byte, plus a few special tokens), so a long
/// file of short prompts costs one pass over their lengths.
fn refuse_too_long(
    prompts: &[String],
    model: &crate::weights::source::LoadedModel,
    max_new_tokens: usize,
) -> Result<(), String> {
    /// Tokens a tokenizer may add to the text's own (BOS, EOS, a prefix space).
    const SPECIAL_TOKENS: usize = 8;
    let max = usize::try_from(model.checkpoint.card().max_positions)
        .unwrap_or(usize::MAX)
        .min(1 << 20);
    for (index, p) in prompts.iter().enumerate() {
        if p.len()
            .saturating_add(SPECIAL_TOKENS)
            .saturating_add(max_new_tokens)
            <= max
        {
            continue;
        }
        let tokens = model.tokenizer.encode(p).map_err(|e| e.to_string())?.len();
        let tokens = tokens.saturating_add(max_new_tokens);
        if tokens > max {
            return Err(crate::oracle::OracleError::TooLong { index, tokens, max }.to_string());
        }
    }
    Ok(())
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
    let source = args.model.source();
    let model = load_model(&source).map_err(|e| e.to_string())?;
    let oracle = Oracle::new(&model.checkpoint).map_err(|e| e.to_string())?;
    let vocab = model.checkpoint.card().vocab;
    let sampling = if args.temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::Temperature {
            temperature: args.temperature,
            top_p: args.top_p,
        }
    };
    refuse_too_long(&prompts, &model, args.max_new_tokens)?;
    let start = std::time::Instant::now();
    let progress = Progress::new(prompts.len());
    // In batches: the oracle holds every sequence of a call at once (KV blocks and a row of
    // logits each), and 40,000 prompts in one call took 5.1 GB. Prompts are tokenised a
    // batch at a time, just before it runs, and the first batch is small, so a long file
    // shows progress within seconds rather than after tokenising every prompt and
    // generating 256. Batch `b` samples with the seed `seed ^ b * K` (batch 0 with `seed`
    // itself, so up to FIRST_BATCH prompts sample exactly as one call would).
    let mut outputs = Vec::with_capacity(prompts.len());
    let mut ids: Vec<Vec<u32>> = Vec::with_capacity(prompts.len());
    let mut first = 0;
    let mut batch = 0usize;
    let mut tokens_so_far = 0usize;
    while first < prompts.len() {
        let size = if batch == 0 {
            FIRST_BATCH
        } else {
            PROMPTS_PER_BATCH
        };
        let end = prompts.len().min(first + size);
        for (i, p) in prompts[first..end].iter().enumerate() {
            let encoded = model.tokenizer.encode(p).map_err(|e| e.to_string())?;
            if let Some(bad) = encoded.iter().find(|&&id| id as u64 >= vocab) {
                return Err(format!(
                    "prompt {}: token id {bad} from tokenizer {} is outside the checkpoint's vocabulary of {vocab}; put the model's own tokenizer.json in the weights folder",
                    first + i,
                    model.tokenizer.origin()
                ));
            }
            ids.push(encoded);
        }
        let chunk = &ids[first..end];
        let options = GenerateOptions {
            max_new_tokens: args.max_new_tokens,
            sampling,
            seed: args.seed ^ (batch as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
            stop_at_eos: true,
        };
        let generated = oracle.generate(chunk, &options).map_err(|e| match e {
            // The oracle numbers prompts within the batch; the user numbers them in the file.
            crate::oracle::OracleError::EmptyPrompt { index } => {
                crate::oracle::OracleError::EmptyPrompt {
                    index: index + first,
                }
                .to_string()
            }
            crate::oracle::OracleError::TooLong { index, tokens, max } => {
                crate::oracle::OracleError::TooLong {
                    index: index + first,
                    tokens,
                    max,
                }
                .to_string()
            }
            other => other.to_string(),
        })?;
        // Each output carries its prompt's last logits row (vocab floats, for parity
        // checks); nothing here prints them, and kept for 40,000 prompts they were 5.1 GB.
        tokens_so_far += generated.iter().map(|g| g.token_ids.len()).sum::<usize>();
        outputs.extend(generated.into_iter().map(|mut g| {
            g.prompt_logits = Vec::new();
            g
        }));
        progress.update(end, tokens_so_far, start.elapsed().as_secs_f64());
        first = end;
        batch += 1;
    }
    progress.finish();
    let seconds = start.elapsed().as_secs_f64();
    let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
    let generated_tokens: usize = outputs.iter().map(|o| o.token_ids.len()).sum();
    let tokens_per_s = if seconds > 0.0 {
        generated_tokens as f64 / seconds
    } else {
        0.0
    };
    let texts = outputs
        .iter()
        .zip(&ids)
        .map(|(o, p)| model.tokenizer.decode_continuation(p, &o.token_ids))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    if args.json {
        let outs: Vec<serde_json::Value> = outputs
            .iter()
            .zip(&prompts)
            .zip(&texts)
            .map(|((o, p), t)| {
                serde_json::json!({"prompt": p, "token_ids": o.token_ids, "text": t, "logprobs": o.logprobs})
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
        for (p, t) in prompts.iter().zip(&texts) {
            println!("{p}{t}");
        }
        let card = model.checkpoint.card();
        let origin = if model.synthetic {
            "synthetic weights"
        } else {
            "weights"
        };
        // Say how the weights were read when it is not byte for byte (MXFP4 experts).
        let note = model
            .checkpoint
            .storage_note()
            .map_or_else(String::new, |n| format!("; {n}"));
        println!(
            "{generated_tokens} tokens in {seconds:.3} s: {tokens_per_s:.1} tokens/s ({} prompt tokens; {} from {origin} at {}{note})",
            prompt_tokens,
            card.name,
            model.checkpoint.dir().display()
        );
    }
    Ok(())
}
