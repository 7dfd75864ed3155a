//! The `moec` command line: parses arguments with clap and dispatches to one module per
//! subcommand. This is the only part of the crate that prints.

use clap::{Parser, Subcommand};

pub mod check;
pub mod compile;
use std::process::ExitCode;

pub mod hw;
pub mod plan;
pub mod probe;
pub mod simulate;

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
    /// Predict a schedule's speed on a hardware profile (HRM + discrete-event simulation).
    Simulate(simulate::SimulateArgs),
    /// Search a schedule's params for the best predicted throughput within budget.
    Plan(plan::PlanArgs),
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check(args) => check::run(&args),
        Command::Compile(args) => compile::run(&args),
        Command::Hw(args) => hw::run(args),
        Command::Probe(args) => probe::run(args),
        Command::Simulate(args) => simulate::run(args),
        Command::Plan(args) => plan::run(args),
    }
}
