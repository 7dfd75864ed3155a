//! Text generation on the oracle (the CPU reference forward pass), with no schedule.
//!
//! Takes a [`GenerateRequest`] (plain data: the model source, prompt texts, token limit,
//! sampling and seed); gives a [`GenerateResult`] (each prompt's ids, generated ids,
//! log-probabilities and decoded continuation, with the totals and where the weights came
//! from) or a one-line message. Prompts go to the oracle in batches ([`FIRST_BATCH`], then
//! [`PROMPTS_PER_BATCH`] at a time), each tokenised just before it runs, so a long prompt
//! file holds one batch's sequences in memory at a time and the caller's progress hears
//! from it within seconds. `moec generate` calls [`generate`]; nothing here prints.

use crate::model::vocab::Sampling;
use crate::oracle::{GenerateOptions, Oracle, OracleError};
use crate::weights::source::{load_model, LoadedModel, ModelSource};
use std::path::PathBuf;

/// Prompts given to the oracle in one call: bounds the memory of a long prompt file (the
/// oracle keeps a row of logits and the KV blocks of every sequence of a call).
const PROMPTS_PER_BATCH: usize = 256;

/// Prompts of the first call: small, so the first progress comes within seconds of the
/// start (256 prompts of 32 tokens took 5 s of one core in a debug build).
const FIRST_BATCH: usize = 16;

/// Mixes the batch number into the seed: batch `b` samples with `seed ^ b * K`, batch 0
/// with `seed` itself, so up to [`FIRST_BATCH`] prompts sample exactly as one call would.
const BATCH_SEED_MIX: u64 = 0xD1B5_4A32_D192_ED03;

/// What `moec generate` asks for.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Which model.
    pub model: ModelSource,
    /// Prompt texts (at least one).
    pub prompts: Vec<String>,
    /// Tokens to generate per prompt at most.
    pub max_new_tokens: usize,
    /// Greedy or temperature/top-p.
    pub sampling: Sampling,
    /// Sampler seed (of the first batch; see [`BATCH_SEED_MIX`]).
    pub seed: u64,
}

/// One prompt's generation.
#[derive(Debug, Clone)]
pub struct GeneratedText {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The generated ids.
    pub token_ids: Vec<u32>,
    /// Log-probability of each generated id.
    pub logprobs: Vec<f32>,
    /// The generated ids decoded in the prompt's context.
    pub text: String,
}

/// What a generation produced.
#[derive(Debug, Clone)]
pub struct GenerateResult {
    /// One per prompt, in order.
    pub outputs: Vec<GeneratedText>,
    /// Prompt tokens over all prompts.
    pub prompt_tokens: usize,
    /// Generated tokens over all prompts.
    pub generated_tokens: usize,
    /// Wall time of the generation (loading excluded).
    pub seconds: f64,
    /// The card's name.
    pub model: String,
    /// The weights were synthesised for the card (no checkpoint was given).
    pub synthetic: bool,
    /// The checkpoint's folder or file.
    pub weights: PathBuf,
    /// How the weights were read when it is not byte for byte (MXFP4 experts).
    pub storage_note: Option<&'static str>,
}

impl GenerateResult {
    /// Generated tokens per second of [`GenerateResult::seconds`] (0 for no time).
    pub fn tokens_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.generated_tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// Loads the model, refuses a prompt too long for its positions before anything runs,
/// and generates every prompt's continuation on the oracle in batches; `progress` hears
/// (prompts done, tokens generated, seconds) after each batch.
pub fn generate(
    request: &GenerateRequest,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<GenerateResult, String> {
    let prompts = &request.prompts;
    let model = load_model(&request.model).map_err(|e| e.to_string())?;
    let oracle = Oracle::new(&model.checkpoint).map_err(|e| e.to_string())?;
    let vocab = model.checkpoint.card().vocab;
    refuse_too_long(prompts, &model, request.max_new_tokens)?;
    let start = std::time::Instant::now();
    // In batches: the oracle holds every sequence of a call at once (KV blocks and a row of
    // logits each), and 40,000 prompts in one call took 5.1 GB. Prompts are tokenised a
    // batch at a time, just before it runs, and the first batch is small, so a long file
    // shows progress within seconds rather than after tokenising every prompt and
    // generating 256.
    let mut generations = Vec::with_capacity(prompts.len());
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
            max_new_tokens: request.max_new_tokens,
            sampling: request.sampling,
            seed: request.seed ^ (batch as u64).wrapping_mul(BATCH_SEED_MIX),
            stop_at_eos: true,
        };
        let generated = oracle
            .generate(chunk, &options)
            .map_err(|e| numbered_in_file(e, first))?;
        // Each output carries its prompt's last logits row (vocab floats, for parity
        // checks); nothing here hands them on, and kept for 40,000 prompts they were 5.1 GB.
        tokens_so_far += generated.iter().map(|g| g.token_ids.len()).sum::<usize>();
        generations.extend(generated.into_iter().map(|mut g| {
            g.prompt_logits = Vec::new();
            g
        }));
        progress(end, tokens_so_far, start.elapsed().as_secs_f64());
        first = end;
        batch += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    let outputs = generations
        .into_iter()
        .zip(ids)
        .map(|(g, prompt_ids)| {
            let text = model
                .tokenizer
                .decode_continuation(&prompt_ids, &g.token_ids)
                .map_err(|e| e.to_string())?;
            Ok(GeneratedText {
                prompt_ids,
                token_ids: g.token_ids,
                logprobs: g.logprobs,
                text,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(GenerateResult {
        prompt_tokens: outputs.iter().map(|o| o.prompt_ids.len()).sum(),
        generated_tokens: outputs.iter().map(|o| o.token_ids.len()).sum(),
        outputs,
        seconds,
        model: model.checkpoint.card().name.clone(),
        synthetic: model.synthetic,
        weights: model.checkpoint.dir().to_path_buf(),
        storage_note: model.checkpoint.storage_note(),
    })
}

/// The oracle's error with its prompt numbered in the whole list: the oracle numbers
/// prompts within the batch, the user in the file.
fn numbered_in_file(error: OracleError, first: usize) -> String {
    match error {
        OracleError::EmptyPrompt { index } => OracleError::EmptyPrompt {
            index: index + first,
        }
        .to_string(),
        OracleError::TooLong { index, tokens, max } => OracleError::TooLong {
            index: index + first,
            tokens,
            max,
        }
        .to_string(),
        other => other.to_string(),
    }
}

/// Refuses, before anything is generated, a prompt too long for the model's positions
/// with its new tokens: the error a batch deep in the file would give, but before the
/// batches ahead of it ran. Only prompts whose bytes could make that many tokens are
/// tokenised here (a token is at least one byte, plus a few special tokens), so a long
/// file of short prompts costs one pass over their lengths.
fn refuse_too_long(
    prompts: &[String],
    model: &LoadedModel,
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
            return Err(OracleError::TooLong { index, tokens, max }.to_string());
        }
    }
    Ok(())
}
