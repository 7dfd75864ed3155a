//! Parity of moec's oracle with Hugging Face transformers, without Python.
//!
//! Takes the fixtures in `tests/fixtures/parity/<family>/` written by
//! `scripts/make_parity_fixtures.py`: a small random checkpoint in the Hub layout (bf16
//! `model.safetensors` + `config.json`) and `expected.json`, the greedy output of
//! transformers run in f32 on the widened bf16 weights (the oracle's own numerics). The
//! `gpt_oss_mxfp4` fixture stores its routed experts as MXFP4 (`*_blocks` / `*_scales`,
//! `quantization_config.quant_method: mxfp4`, as the Hub's gpt-oss checkpoints) and its
//! reference is transformers' own MXFP4 load (`Mxfp4Config(dequantize=True)`), so moec's
//! MXFP4 reader (experts kept as ggml block rows, multiplied decoded) is under test, not a
//! bf16 transcription of it.
//! Loads each checkpoint the way `--weights DIR` does (architecture from config.json, no
//! card, no tokenizer), runs greedy generation with the oracle and checks, per prompt:
//!
//! * the generated token ids are identical;
//! * each generated token's log-probability is within [`LOGPROB_TOLERANCE`];
//! * the full last-position logits after prefill are within [`LOGIT_TOLERANCE`].
//!
//! The fixture script selected its seeds so that no comparison sits on a knife edge: every
//! router top-k boundary has a logit gap of at least 1e-3 and every greedy step a gap of at
//! least 1e-3 between the two best tokens, far above f32 rounding noise. It also records how
//! far removing router renormalisation, DBRX `clip_qkv` or the right rope theta moves the
//! logits (at least 0.9, see `sensitivity` in expected.json), so this test fails on each.

use std::path::{Path, PathBuf};

use moec::math::isa::Kernels;
use moec::oracle::{GenerateOptions, Generation, Oracle};
use moec::weights::checkpoint::Checkpoint;
use serde::Deserialize;

/// Log-probabilities of the generated tokens: the bar issue #2 sets for parity.
const LOGPROB_TOLERANCE: f64 = 1e-3;

/// Last-position prefill logits, absolute. Why this value: the oracle and transformers
/// compute the same f32 arithmetic in different orders (own AVX-512 kernels vs. torch),
/// which moves logits (|logit| <= ~15 here) by about 1e-5 on these 3-layer models: 9e-6
/// observed, and transformers' own KV-cache vs. full-recompute paths differ by 1.2e-5
/// (`margins` in expected.json). Every real defect we guard against moves them by far
/// more (`sensitivity` in expected.json, confirmed by patching the oracle): dropping router
/// renormalisation by 2.9 (Mixtral) / 0.9 (DBRX), dropping clip_qkv by 7.8, rope theta 1e4
/// instead of the configured value by >= 3.8, and even computing in bf16 instead of f32 by
/// >= 0.12. 1e-3 leaves two orders of magnitude on each side.
const LOGIT_TOLERANCE: f64 = 1e-3;

#[derive(Debug, Deserialize)]
struct Expected {
    family: String,
    generator: Generator,
    /// How transformers loaded the checkpoint when not the plain f32 widening (MXFP4).
    #[serde(default)]
    reference_load: Option<String>,
    max_new_tokens: usize,
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
struct Generator {
    transformers: String,
    torch: String,
}

#[derive(Debug, Deserialize)]
struct Case {
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
    logprobs: Vec<f64>,
    prefill_last_logits: Vec<f64>,
}

fn fixture_dir(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join("parity")
        .join(family)
}

fn load_expected(dir: &Path) -> Expected {
    let path = dir.join("expected.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|error| panic!("cannot parse {}: {error}", path.display()))
}

/// Largest absolute difference and where it is.
fn max_abs_diff(actual: &[f64], expected: &[f64]) -> (f64, usize) {
    actual
        .iter()
        .zip(expected)
        .map(|(a, e)| (a - e).abs())
        .enumerate()
        .fold((0.0, 0), |(worst, at), (index, diff)| {
            if diff > worst || diff.is_nan() {
                (diff, index)
            } else {
                (worst, at)
            }
        })
}

/// `error <= tolerance`, with NaN counted as out of tolerance.
fn within(error: f64, tolerance: f64) -> bool {
    error <= tolerance
}

/// Every disagreement found, and the largest errors seen (reported even on success).
#[derive(Default)]
struct Comparison {
    failures: Vec<String>,
    worst_logprob: f64,
    worst_logit: f64,
}

impl Comparison {
    /// Compares one oracle output with transformers' for the same prompt.
    fn case(&mut self, label: &str, case: &Case, output: &Generation) {
        if output.token_ids != case.generated_ids {
            let diverge = output
                .token_ids
                .iter()
                .zip(&case.generated_ids)
                .position(|(a, e)| a != e)
                .unwrap_or(output.token_ids.len().min(case.generated_ids.len()));
            self.failures.push(format!(
                "{label}: generated ids differ from step {diverge}\n    oracle:       {:?}\n    transformers: {:?}",
                output.token_ids, case.generated_ids
            ));
        }

        // Compared even when the tokens diverge: the steps before the divergence tell
        // whether the numbers drifted or a whole feature is missing.
        let logprobs: Vec<f64> = output.logprobs.iter().map(|&v| f64::from(v)).collect();
        let (logprob_err, logprob_at) = max_abs_diff(&logprobs, &case.logprobs);
        self.worst_logprob = self.worst_logprob.max(logprob_err);
        if logprobs.len() != case.logprobs.len() || !within(logprob_err, LOGPROB_TOLERANCE) {
            self.failures.push(format!(
                "{label}: logprobs off by {logprob_err:.3e} at step {logprob_at} (tolerance {LOGPROB_TOLERANCE:e})\n    oracle:       {logprobs:?}\n    transformers: {:?}",
                case.logprobs
            ));
        }

        let logits: Vec<f64> = output.prompt_logits.iter().map(|&v| f64::from(v)).collect();
        let (logit_err, logit_at) = max_abs_diff(&logits, &case.prefill_last_logits);
        self.worst_logit = self.worst_logit.max(logit_err);
        if logits.len() != case.prefill_last_logits.len() || !within(logit_err, LOGIT_TOLERANCE) {
            self.failures.push(format!(
                "{label}: prefill logits off by {logit_err:.3e} at token {logit_at} (oracle {:?}, transformers {:?}; tolerance {LOGIT_TOLERANCE:e}; {} vs {} logits)",
                logits.get(logit_at),
                case.prefill_last_logits.get(logit_at),
                logits.len(),
                case.prefill_last_logits.len()
            ));
        }
    }
}

/// Runs the oracle on one fixture family and compares it with transformers' output, once
/// with all prompts in one batch and once with each prompt alone (different code paths:
/// mixed-length prefill and per-sequence KV caches vs. a single sequence).
fn check_family(family: &str) {
    check_family_with(family, None);
}

/// [`check_family`] with the oracle on `kernels` (the process's when `None`).
fn check_family_with(family: &str, kernels: Option<Kernels>) {
    let dir = fixture_dir(family);
    let expected = load_expected(&dir);
    assert_eq!(
        expected.family, family,
        "fixture folder and expected.json disagree"
    );
    let origin = format!(
        "reference: transformers {} / torch {}, f32 compute on bf16 weights{}",
        expected.generator.transformers,
        expected.generator.torch,
        expected
            .reference_load
            .as_deref()
            .map(|load| format!(", MXFP4 experts through {load}"))
            .unwrap_or_default()
    );

    let checkpoint = Checkpoint::open(&dir)
        .unwrap_or_else(|error| panic!("{family}: cannot open {}: {error}", dir.display()));
    let oracle = Oracle::new(&checkpoint)
        .unwrap_or_else(|error| panic!("{family}: cannot build the oracle: {error}"));
    let oracle = match kernels {
        Some(k) => oracle.with_kernels(k),
        None => oracle,
    };
    // The fixtures never generate EOS (checked by the script); not stopping keeps the
    // comparison about numerics only.
    let options = GenerateOptions {
        stop_at_eos: false,
        ..GenerateOptions::greedy(expected.max_new_tokens)
    };
    let generate = |prompts: &[Vec<u32>]| {
        let outputs = oracle
            .generate(prompts, &options)
            .unwrap_or_else(|error| panic!("{family}: generation failed: {error}"));
        assert_eq!(
            outputs.len(),
            prompts.len(),
            "{family}: one output per prompt"
        );
        outputs
    };

    let mut comparison = Comparison::default();
    let prompts: Vec<Vec<u32>> = expected
        .cases
        .iter()
        .map(|case| case.prompt_ids.clone())
        .collect();
    let batched = generate(&prompts);
    for (case_idx, (case, output)) in expected.cases.iter().zip(&batched).enumerate() {
        let label = format!(
            "{family} case {case_idx} ({} prompt tokens, batch of {})",
            case.prompt_ids.len(),
            prompts.len()
        );
        comparison.case(&label, case, output);
    }
    for (case_idx, case) in expected.cases.iter().enumerate() {
        let alone = generate(std::slice::from_ref(&case.prompt_ids));
        let label = format!(
            "{family} case {case_idx} ({} prompt tokens, alone)",
            case.prompt_ids.len()
        );
        comparison.case(&label, case, &alone[0]);
    }

    // Shown with `--nocapture`; the report quotes these figures.
    eprintln!(
        "{family}: max |logprob diff| {:.3e}, max |prefill logit diff| {:.3e} ({origin})",
        comparison.worst_logprob, comparison.worst_logit
    );
    assert!(
        comparison.failures.is_empty(),
        "{family}: oracle disagrees with transformers ({origin}):\n  {}",
        comparison.failures.join("\n  ")
    );
}

#[test]
fn mixtral_oracle_matches_transformers() {
    check_family("mixtral");
}

#[test]
fn dbrx_oracle_matches_transformers() {
    check_family("dbrx");
}

#[test]
fn qwen3_moe_oracle_matches_transformers() {
    check_family("qwen3_moe");
}

#[test]
fn olmoe_oracle_matches_transformers() {
    check_family("olmoe");
}

#[test]
fn qwen2_moe_oracle_matches_transformers() {
    check_family("qwen2_moe");
}

#[test]
fn gpt_oss_oracle_matches_transformers() {
    check_family("gpt_oss");
}

/// The MXFP4 fixture is read as MXFP4 and kept so (every expert tensor repacked from its
/// blocks and scales into ggml block rows), not as a bf16 checkpoint; multiplied with the
/// blocks decoded to f32 (`MOEC_QUANT_PRODUCT=decoded`: f32 activations, transformers'
/// arithmetic) it matches transformers' own MXFP4 load within the tolerances above. The
/// default product quantises activations to 8 bits as llama.cpp does and is held to
/// llama.cpp's on the same weights instead (`tests/model_checkpoint.rs`, GGUF families).
#[test]
fn gpt_oss_mxfp4_oracle_matches_transformers_mxfp4_load() {
    let dir = fixture_dir("gpt_oss_mxfp4");
    let checkpoint = Checkpoint::open(&dir).unwrap();
    assert!(checkpoint.storage_note().is_some(), "not read as MXFP4");
    // 4 layers x 16 experts x (64 x 64 gate/up + 32 x 64 down) weights, 17 bytes per 32.
    assert_eq!(
        checkpoint.decoded_bytes(),
        4 * 16 * (64 * 64 + 32 * 64) / 32 * 17
    );
    check_family_with("gpt_oss_mxfp4", Some(Kernels::process().quant_decoded()));
}

#[test]
fn deepseek_v2_oracle_matches_transformers() {
    check_family("deepseek_v2");
}

#[test]
fn deepseek_v3_oracle_matches_transformers() {
    check_family("deepseek_v3");
}
