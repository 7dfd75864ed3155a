//! Shared helpers of the schedule tests: find every schedule under `schedules/`, and
//! compile one on a small configuration (tiny card cut to 2 layers, 3 micro-batches of 2
//! sequences, 8-token prompts) so snapshots stay readable.

#![allow(dead_code)]

use moec::compile::{compile, Compiled, Options};
use moec::diag::Diagnostic;
use moec::ir::Workload;
use moec::model::card::ModelCard;
use std::path::{Path, PathBuf};

/// Every `.sched` file under `schedules/`, sorted, as (name relative to `schedules/`
/// without the extension, path).
pub fn schedule_files() -> Vec<(String, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules");
    let mut found = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "sched") {
                let rel = path
                    .strip_prefix(&root)
                    .expect("under schedules/")
                    .with_extension("");
                let name = rel
                    .to_string_lossy()
                    .replace(std::path::MAIN_SEPARATOR, "/");
                found.push((name, path));
            }
        }
    }
    found.sort();
    found
}

/// The source text of a schedule.
pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// A built-in card cut to `layers` layers (the compiler takes every dimension from the card,
/// so this is the model-layer override the small snapshots need).
pub fn card_with_layers(name: &str, layers: u64) -> ModelCard {
    let mut card = ModelCard::load(name).unwrap_or_else(|e| panic!("card {name}: {e}"));
    card.layers = layers;
    card
}

/// The names of the params a schedule declares (parse only), so overrides are applied
/// only where they exist.
pub fn declared_params(source: &str) -> Vec<String> {
    match moec::syntax::parse_file(source) {
        Ok(file) => file
            .items
            .iter()
            .filter_map(|item| match item {
                moec::syntax::ast::Item::Param(p) => Some(p.name.name.clone()),
                _ => None,
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The small configuration of the snapshot tests: 3 micro-batches (or batches, or the
/// fixed alpha/beta groups) of 2 sequences, 8-token prompts, 4 generated tokens (and
/// 6 resident experts where a schedule places some).
pub const SMALL_SETS: &[(&str, &str)] = &[
    ("ubs", "2"),
    ("n_ub", "3"),
    ("bs", "2"),
    ("n_batch", "3"),
    ("seqs", "2"),
    ("packet_mb", "1"),
    // Fiddler: 6 of the 16 experts resident, so the snapshot shows all three arms.
    ("n_gpu", "6"),
];

/// Options for the small configuration on `card`.
pub fn small_options(source: &str, card: ModelCard) -> Options {
    let declared = declared_params(source);
    let mut options = Options::new(card);
    options.workload = Workload {
        batch: 6,
        prompt_len: 8,
        gen_len: 4,
    };
    for (name, value) in SMALL_SETS {
        if declared.iter().any(|d| d == name) {
            options.sets.push((name.to_string(), value.to_string()));
        }
    }
    options
}

/// Compiles a schedule on the small configuration of the 2-layer tiny Mixtral card.
pub fn compile_small(source: &str) -> Result<Compiled, Vec<Diagnostic>> {
    compile_small_layers(source, 2)
}

/// The small configuration with `layers` layers of the tiny Mixtral card.
pub fn compile_small_layers(source: &str, layers: u64) -> Result<Compiled, Vec<Diagnostic>> {
    compile(
        source,
        &small_options(source, card_with_layers("mixtral-tiny", layers)),
    )
}

/// A synthetic checkpoint of `card` (seed 7, as the invariance tests) written under `dir`.
pub fn tiny_checkpoint(card: &ModelCard, dir: &Path) -> moec::weights::checkpoint::Checkpoint {
    use moec::weights::synth::{write_checkpoint, SynthOptions};
    let ck_dir = dir.join(format!("ck-{}-{}", card.name, card.layers));
    write_checkpoint(
        card,
        &ck_dir,
        &SynthOptions {
            seed: 7,
            dtype: card.dtype,
            ..SynthOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("synthetic checkpoint: {e}"));
    moec::weights::checkpoint::Checkpoint::open(&ck_dir)
        .unwrap_or_else(|e| panic!("open checkpoint: {e}"))
}

/// The oracle's greedy tokens for `prompts` (`gen_len` each, EOS ignored).
pub fn oracle_tokens(
    checkpoint: &moec::weights::checkpoint::Checkpoint,
    prompts: &[Vec<u32>],
    gen_len: usize,
) -> Vec<Vec<u32>> {
    use moec::oracle::{GenerateOptions, Oracle};
    let oracle = Oracle::new(checkpoint).unwrap_or_else(|e| panic!("oracle: {e}"));
    oracle
        .generate(
            prompts,
            &GenerateOptions {
                stop_at_eos: false,
                ..GenerateOptions::greedy(gen_len)
            },
        )
        .unwrap_or_else(|e| panic!("oracle generate: {e}"))
        .into_iter()
        .map(|g| g.token_ids)
        .collect()
}

/// Lowers a compiled schedule and runs it on the CPU backend (greedy, one thread per
/// pool, EOS ignored) over `prompts`; `Ok` when it produces exactly `expected` (the
/// oracle's tokens, [`oracle_tokens`]), else what went wrong. The one place these tests
/// call the runtime, so a change of its API is adapted here.
pub fn run_against_oracle(
    compiled: &Compiled,
    checkpoint: &moec::weights::checkpoint::Checkpoint,
    prompts: &[Vec<u32>],
    expected: &[Vec<u32>],
) -> Result<(), String> {
    use moec::lower::{lower, LowerOptions};
    use moec::runtime::{generate, RunOptions};
    let gen_len = expected.first().map_or(0, Vec::len);
    let plan = lower(&compiled.program, &compiled.info, &LowerOptions::default())
        .map_err(|e| format!("does not lower: {e}"))?;
    let mut run = RunOptions::greedy(gen_len);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    let (outputs, _) = generate(&plan, checkpoint, prompts, &run, &mut |_, _| {})
        .map_err(|e| format!("run failed: {e}"))?;
    let got: Vec<Vec<u32>> = outputs.into_iter().map(|o| o.token_ids).collect();
    if got != expected {
        return Err(format!(
            "tokens differ:\n  got      {got:?}\n  expected {expected:?}"
        ));
    }
    Ok(())
}

/// 4 prompts of 9-12 tokens (ids spread over the vocabulary): in micro-batches of 2
/// sequences, about 20 tokens each, so an expert gets anywhere from 0 to 20 of them in
/// prefill and at most 2 in decode.
pub fn varied_prompts(card: &ModelCard) -> Vec<Vec<u32>> {
    [12usize, 9, 11, 10]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|t| ((i * 131 + t * 17 + 1) as u64 % card.vocab) as u32)
                .collect()
        })
        .collect()
}
