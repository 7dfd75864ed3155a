//! `moec compile SCHED --emit text|dot|json`: print the checked DAG.

use super::check::SchedArgs;
use crate::ir::emit;
use std::process::ExitCode;

/// Output format of `moec compile`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// Canonical text: tasks in issue order with stream, op, arguments and dependencies.
    Text,
    /// Graphviz dot.
    Dot,
    /// JSON (the IR and the reduced edges).
    Json,
}

/// Arguments of `moec compile`.
#[derive(Debug, Clone, clap::Args)]
pub struct CompileArgs {
    #[command(flatten)]
    sched: SchedArgs,
    /// What to print.
    #[arg(long, value_enum, default_value = "text")]
    emit: Emit,
}

/// Runs `moec compile`.
pub fn run(args: &CompileArgs) -> ExitCode {
    match args.sched.compile() {
        Ok((compiled, _, _)) => {
            let program = &compiled.program;
            let dag = &compiled.info.dag;
            let text = match args.emit {
                Emit::Text => emit::to_text(program, dag),
                Emit::Dot => emit::to_dot(program, dag),
                Emit::Json => match emit::to_json(program, dag) {
                    Ok(json) => json + "\n",
                    Err(e) => {
                        eprintln!("error: cannot serialise the program: {e}");
                        return ExitCode::from(1);
                    }
                },
            };
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprint!("{}", failure.text);
            ExitCode::from(1)
        }
    }
}
