//! `moec synth`: write a deterministic synthetic checkpoint of a card in the Hub format.
//!
//! Takes `--model CARD --out DIR [--seed N] [--dtype bf16|f16|f32] [--mxfp4]`; writes the
//! folder atomically (temporary folder renamed at the end) and prints what it wrote.
//! `--mxfp4` (gpt-oss cards) stores the experts as the Hub's gpt-oss checkpoints do.

use crate::cli::generate::fail;
use crate::model::{ModelCard, WeightDtype};
use crate::weights::synth::{write_checkpoint_as, ExpertStorage, SynthOptions};
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
    let card = match ModelCard::load(&args.model) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let dtype = match args.dtype {
        Some(DtypeArg::Bf16) => WeightDtype::Bf16,
        Some(DtypeArg::F16) => WeightDtype::F16,
        Some(DtypeArg::F32) => WeightDtype::F32,
        None => card.dtype,
    };
    let opts = SynthOptions {
        seed: args.seed,
        dtype,
        ..SynthOptions::default()
    };
    let start = std::time::Instant::now();
    let experts = if args.mxfp4 {
        ExpertStorage::Mxfp4
    } else {
        ExpertStorage::Dense
    };
    if let Err(e) = write_checkpoint_as(&card, &args.out, &opts, experts) {
        return fail(e);
    }
    // MXFP4 stores 32 four-bit codes and one byte of scale per block: 4.25 bits a weight.
    let bytes = match experts {
        ExpertStorage::Dense => card.total_params() * dtype.bytes(),
        ExpertStorage::Mxfp4 => {
            // The expert matrices only: their biases stay in the dtype.
            let packed = card.layers * card.experts * 3 * card.hidden * card.ffn;
            (card.total_params() - packed) * dtype.bytes() + packed * 17 / 32
        }
    };
    println!(
        "wrote {} ({}, {:.1} MB of {:?} weights{}, seed {}) in {:.1} s",
        args.out.display(),
        card.name,
        bytes as f64 / 1e6,
        dtype,
        if args.mxfp4 { ", experts MXFP4" } else { "" },
        args.seed,
        start.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}
