//! `moec synth`: write a deterministic synthetic checkpoint of a card in the Hub format.
//!
//! Takes `--model CARD --out DIR [--seed N] [--dtype bf16|f16|f32] [--mxfp4]`; writes the
//! folder atomically (temporary folder renamed at the end) and prints what it wrote.
//! `--mxfp4` (gpt-oss cards) stores the experts as the Hub's gpt-oss checkpoints do.
//! With `--gguf` it writes a llama.cpp GGUF file instead, at full size and without a Hub
//! checkpoint first, each tensor in the type `moec quantize` gives it for the same
//! `--mix`, `--all` or `--weight-format`; it prints the time taken, the file's size, its
//! bytes per type and the vocabulary it holds.

use crate::cli::generate::fail;
use crate::engine::{self, QuantizeFormats, SynthGgufRequest, SynthRequest};
use crate::ir::emit::human_bytes;
use crate::model::WeightDtype;
use std::io::IsTerminal;
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
    /// Folder to create (must not exist); with `--gguf`, the file.
    #[arg(long, value_name = "DIR|FILE.gguf")]
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
    #[arg(long, conflicts_with = "gguf")]
    pub mxfp4: bool,
    /// Write a llama.cpp GGUF file (`--out FILE.gguf`) rather than a Hub folder: the
    /// card's synthetic weights drawn directly in each tensor's type (random codes under
    /// scales sized like the Hub checkpoint's weights), streamed, with the card's
    /// tokenizer as the vocabulary. Types as `moec quantize` gives them (default: experts
    /// Q4_K, gpt-oss's MXFP4, the rest in the card's dtype).
    #[arg(long)]
    pub gguf: bool,
    /// With `--gguf`: one of llama-quantize's mixes (q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k,
    /// mxfp4_moe), as `moec quantize --mix`.
    #[arg(long, value_name = "MIX", requires = "gguf", conflicts_with_all = ["all", "weight_format"])]
    pub mix: Option<String>,
    /// With `--gguf`: every linear weight in this format, as `moec quantize --all`.
    #[arg(
        long,
        value_name = "FORMAT",
        requires = "gguf",
        conflicts_with = "weight_format"
    )]
    pub all: Option<String>,
    /// With `--gguf`: formats per weight class, as `moec quantize --weight-format`.
    #[arg(long, value_name = "CLASS=FORMAT,..", requires = "gguf")]
    pub weight_format: Option<String>,
    /// With `--gguf`: `general.name` in the file (default: the card's name).
    #[arg(long, requires = "gguf")]
    pub name: Option<String>,
}

fn dtype_of(d: DtypeArg) -> WeightDtype {
    match d {
        DtypeArg::Bf16 => WeightDtype::Bf16,
        DtypeArg::F16 => WeightDtype::F16,
        DtypeArg::F32 => WeightDtype::F32,
    }
}

/// Runs `moec synth --gguf`.
fn run_gguf(args: &SynthArgs) -> ExitCode {
    let formats = match (&args.mix, &args.all, &args.weight_format) {
        (Some(mix), _, _) => QuantizeFormats::Mix(mix.clone()),
        (None, Some(all), _) => QuantizeFormats::All(all.clone()),
        (None, None, Some(spec)) => QuantizeFormats::Classes(spec.clone()),
        (None, None, None) => QuantizeFormats::Default,
    };
    let request = SynthGgufRequest {
        card: args.model.clone(),
        out: args.out.clone(),
        seed: args.seed,
        dtype: args.dtype.map(dtype_of),
        formats,
        name: args.name.clone(),
    };
    let bar = std::io::stderr()
        .is_terminal()
        .then(|| indicatif::ProgressBar::new(0));
    let result = engine::synth_gguf(&request, &mut |i, total, tensor| {
        if let Some(bar) = &bar {
            bar.set_length(total as u64);
            bar.set_position(i as u64);
            bar.set_message(tensor.to_string());
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let written = match result {
        Ok(w) => w,
        Err(e) => return fail(e),
    };
    let summary = &written.summary;
    println!(
        "wrote {} ({}, {} tensors, {}, seed {}) in {:.1} s ({:.0} MB/s)",
        args.out.display(),
        written.model,
        summary.tensors,
        human_bytes(summary.file_bytes),
        args.seed,
        written.seconds,
        summary.file_bytes as f64 / 1e6 / written.seconds.max(1e-9)
    );
    for (ty, bytes) in &summary.bytes_by_type {
        println!("  {ty:<5} {:>12}", human_bytes(*bytes));
    }
    println!("  vocabulary: {}", written.vocabulary);
    println!(
        "  weights: synthetic (random codes under scales sized like the card's Hub checkpoint)"
    );
    ExitCode::SUCCESS
}

/// Runs `moec synth`.
pub fn run(args: &SynthArgs) -> ExitCode {
    if args.gguf {
        return run_gguf(args);
    }
    let request = SynthRequest {
        card: args.model.clone(),
        out: args.out.clone(),
        seed: args.seed,
        dtype: args.dtype.map(dtype_of),
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
