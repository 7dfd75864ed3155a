//! `moec synth`: write a deterministic synthetic checkpoint of a card in the Hub format.
//!
//! Takes `--model CARD --out DIR [--seed N] [--dtype bf16|f16|f32] [--mxfp4]`; writes the
//! folder atomically (temporary folder renamed at the end) and prints what it wrote.
//! `--mxfp4` (gpt-oss cards) stores the experts as the Hub's gpt-oss checkpoints do.

use crate::cli::generate::fail;
use crate::engine::{self, SynthRequest};
use crate::model::WeightDtype;
use std::path::PathBuf;
use std::process::ExitCode;

/// Stored dtype choices on the command line.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum DtypeArg {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
}

/// Arguments of `moec synth`.
#[derive(Debug, clap::Args)]
pub struct SynthArgs {
    /// Model card (built-in name or .ron path).
    #[arg(long, default_value = "mixtral-tiny")]
    pub model: String,
    /// Folder to create (must not exist).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// PRNG seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stored dtype (default: the card's).
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,
    /// Store the routed experts as MXFP4 blocks and scales with a `quantization_config`,
    /// like the Hub's gpt-oss checkpoints (gpt-oss cards only; moec keeps them MXFP4 when
    /// it loads them).
    #[arg(long)]
    pub mxfp4: bool,
}

/// Runs `moec synth`.
pub fn run(args: &SynthArgs) -> ExitCode {
    let request = SynthRequest {
        card: args.model.clone(),
        out: args.out.clone(),
        seed: args.seed,
        dtype: args.dtype.map(|d| match d {
            DtypeArg::Bf16 => WeightDtype::Bf16,
            DtypeArg::F16 => WeightDtype::F16,
            DtypeArg::F32 => WeightDtype::F32,
        }),
        mxfp4: args.mxfp4,
    };
    let written = match engine::synth(&request) {
        Ok(w) => w,
        Err(e) => return fail(e),
    };
    println!(
        "wrote {} ({}, {:.1} MB of {:?} weights{}, seed {}) in {:.1} s",
        args.out.display(),
        written.model,
        written.bytes as f64 / 1e6,
        written.dtype,
        if args.mxfp4 { ", experts MXFP4" } else { "" },
        args.seed,
        written.seconds
    );
    ExitCode::SUCCESS
}
