//! The `moec` command line: parses arguments with clap and dispatches to one module per
//! subcommand. This is the only part of the crate that prints.

pub mod generate;
pub mod models;
pub mod synth;

use clap::{Parser, Subcommand};

pub mod check;
pub mod compile;
use std::process::ExitCode;

pub mod ablate;
pub mod batch;
pub mod devices;
pub mod hw;
pub mod inputs;
pub mod lsp;
pub mod output;
pub mod perplexity;
pub mod plan;
pub mod probe;
pub mod profile;
pub mod quantize;
pub mod reproduce;
pub mod run;
pub mod serve;
pub mod simulate;
pub mod workload;

/// moec: compile, check, simulate and run MoE offload schedules.
#[derive(Debug, Parser)]
#[command(name = "moec", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Compile a schedule and print a summary, or its diagnostics (exit 1).
    Check(check::CheckArgs),
    /// Compile a schedule and print its DAG as text, dot or JSON.
    Compile(compile::CompileArgs),
    /// List the hardware profiles, or show one.
    Hw(hw::HwArgs),
    /// Measure this machine and write a hardware profile.
    Probe(probe::ProbeArgs),
    /// Run a schedule over prompts and write the routing profile (tokens per layer and expert).
    Profile(profile::ProfileArgs),
    /// Generate text with the reference forward pass (the oracle).
    Generate(generate::GenerateArgs),
    /// Write a deterministic synthetic checkpoint of a card (Hugging Face format).
    Synth(synth::SynthArgs),
    /// Write a Hugging Face checkpoint as a quantised llama.cpp GGUF (formats per weight class).
    Quantize(quantize::QuantizeArgs),
    /// A checkpoint's perplexity on a fixed text, and its distance from a reference checkpoint.
    Perplexity(perplexity::PerplexityArgs),
    /// List the built-in model cards with parameter counts and bytes per layer.
    Models(models::ModelsArgs),
    /// Predict a schedule's speed on a hardware profile (HRM + discrete-event simulation).
    Simulate(simulate::SimulateArgs),
    /// Search a schedule's params for the best predicted throughput within budget.
    Plan(plan::PlanArgs),
    /// Predict the papers' published rows and compare (calibration scored leave-one-out).
    Reproduce(reproduce::ReproduceArgs),
    /// Run a schedule as real inference on the CPU backend and report what it measured.
    Run(run::RunArgs),
    /// Run a schedule over a JSON-lines prompt file batch by batch, appending results (resumable).
    Batch(batch::BatchArgs),
    /// Run several schedules on one workload and compare them in one table.
    Ablate(ablate::AblateArgs),
    /// Show the backends this machine can run: CPU features, CUDA driver, NVRTC, cuBLAS.
    Devices(devices::DevicesArgs),
    /// Serve a schedule over HTTP with the OpenAI API, batching requests as they come.
    Serve(serve::ServeArgs),
    /// A language server for `.sched` files on stdin/stdout (diagnostics, hover, definition, completion).
    Lsp(lsp::LspArgs),
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The kernel choice is made once, here: a `MOEC_KERNELS` this CPU cannot honour stops
    // every command before it computes anything (`devices` reports it instead).
    if let (Err(e), false) = (
        crate::math::isa::selection(),
        matches!(cli.command, Command::Devices(_)),
    ) {
        return generate::fail(e);
    }
    match cli.command {
        Command::Check(args) => check::run(&args),
        Command::Compile(args) => compile::run(&args),
        Command::Hw(args) => hw::run(args),
        Command::Probe(args) => probe::run(args),
        Command::Profile(args) => profile::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Synth(args) => synth::run(&args),
        Command::Quantize(args) => quantize::run(&args),
        Command::Perplexity(args) => perplexity::run(&args),
        Command::Models(args) => models::run(&args),
        Command::Simulate(args) => simulate::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Reproduce(args) => reproduce::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Ablate(args) => ablate::run(&args),
        Command::Batch(args) => batch::run(&args),
        Command::Devices(args) => devices::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Lsp(args) => lsp::run(&args),
    }
}
