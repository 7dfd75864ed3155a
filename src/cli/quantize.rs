//! `moec quantize`: write a Hugging Face checkpoint as a quantised llama.cpp GGUF.
//!
//! Takes `--weights DIR --out FILE.gguf` and the formats per weight class
//! (`--weight-format experts=q4_k,attention=q8_0`, default experts only as Q4_K; or
//! `--all FORMAT` for every linear weight, or `--mix q4_k_m` for llama-quantize's per-tensor
//! types of that file type); writes the file atomically (nothing is left
//! behind on an error or an interrupt) and prints its tensors' bytes per type (and how
//! many kept the checkpoint's own MXFP4 blocks). The file
//! runs in moec (`--weights FILE.gguf`) and in llama.cpp. Writes the Mixtral, Qwen3-MoE,
//! Qwen2-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss and DBRX families.

use crate::cli::generate::fail;
use crate::engine::{self, QuantizeFormats, QuantizeRequest, QuantizeResult};
use crate::ir::emit::human_bytes;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moec quantize`.
#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    pub weights: PathBuf,
    /// The GGUF file to write (must not exist).
    #[arg(long, value_name = "FILE.gguf")]
    pub out: PathBuf,
    /// Formats per weight class (classes experts, attention, shared, router, embedding,
    /// head; formats q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k, mxfp4, bf16, f16, f32). Classes not named keep the
    /// checkpoint's dtype (a gpt-oss Hub checkpoint's MXFP4 experts their blocks), the
    /// router f32; norms are always f32. Default: experts=q4_k (gpt-oss: experts=mxfp4).
    #[arg(long, value_name = "CLASS=FORMAT,..", conflicts_with = "all")]
    pub weight_format: Option<String>,
    /// Every linear weight (experts, attention, shared experts, embedding, head) in this
    /// format; the router stays f32, as llama-quantize keeps it. q8_0, q4_0, q4_1, q4_k,
    /// q5_k and q6_k give `llama-quantize --pure`'s bytes (Q8_0, Q4_0, Q4_1, Q4_K_S,
    /// Q5_K_S, Q6_K).
    #[arg(long, value_name = "FORMAT")]
    pub all: Option<String>,
    /// One of llama-quantize's K-quant mixes (q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k) or
    /// mxfp4_moe: each tensor in the type `llama-quantize FILE Q4_K_M` (etc.) gives it, by
    /// llama.cpp's rules (output Q6_K; attention V and FFN down in more bits in the layers
    /// llama.cpp picks; Q8_0 attention K/V for 8-expert models; for mxfp4_moe the merged
    /// experts MXFP4 and the rest Q8_0), with llama-quantize's bytes.
    #[arg(long, value_name = "MIX", conflicts_with_all = ["all", "weight_format"])]
    pub mix: Option<String>,
    /// `general.name` in the file (default: the folder's name).
    #[arg(long)]
    pub name: Option<String>,
}

/// The formats the flags ask for, as spelled (`engine::quantize` parses them for the
/// checkpoint's family).
fn formats(args: &QuantizeArgs) -> QuantizeFormats {
    match (&args.mix, &args.all, &args.weight_format) {
        (Some(mix), _, _) => QuantizeFormats::Mix(mix.clone()),
        (None, Some(all), _) => QuantizeFormats::All(all.clone()),
        (None, None, Some(spec)) => QuantizeFormats::Classes(spec.clone()),
        (None, None, None) => QuantizeFormats::Default,
    }
}

/// Runs `moec quantize`.
pub fn run(args: &QuantizeArgs) -> ExitCode {
    let request = QuantizeRequest {
        weights: args.weights.clone(),
        out: args.out.clone(),
        formats: formats(args),
        name: args.name.clone(),
    };
    let bar = std::io::stderr()
        .is_terminal()
        .then(|| indicatif::ProgressBar::new(0));
    let result = engine::quantize(&request, &mut |i, total, tensor| {
        if let Some(bar) = &bar {
            bar.set_length(total as u64);
            bar.set_position(i as u64);
            bar.set_message(tensor.to_string());
        }
    });
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let QuantizeResult { summary, seconds } = match result {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    println!(
        "wrote {} ({} tensors, {}) in {:.1} s",
        args.out.display(),
        summary.tensors,
        human_bytes(summary.file_bytes),
        seconds
    );
    for (ty, bytes) in &summary.bytes_by_type {
        println!("  {ty:<5} {:>12}", human_bytes(*bytes));
    }
    if summary.copied > 0 {
        println!(
            "  {} tensors: the checkpoint's MXFP4 blocks, copied (not quantised again)",
            summary.copied
        );
    }
    ExitCode::SUCCESS
}
