//! `moec devices`: which backends this machine can run, in plain words.
//!
//! Prints, for every backend of the registry in its order, what its registration's
//! `devices` entry reports: the CPU backend (threads, the CPU kernels chosen and why, see
//! `MOEC_KERNELS`) and the CUDA status (driver and devices, NVRTC and whether moec's kernels
//! compile with it, cuBLAS). Exits 0, or 1 when a backend's kernels do not build with the
//! compiler found here (a bug in moec's kernels, shown with the compiler's log). Names no
//! backend: a new one's lines appear here by registering.

use super::generate::fail;
use crate::runtime::registry::BACKENDS;
use std::process::ExitCode;

/// Arguments of `moec devices` (none).
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {}

/// Runs `moec devices`.
pub fn run(_args: &DevicesArgs) -> ExitCode {
    // Libraries under other names (CUDA 13's, a pip wheel's folder) are linked where the
    // backend loads them, in a re-run of this command, before anything is printed or
    // loaded for good.
    for backend in BACKENDS {
        if let Some(why) = (backend.link_libraries)() {
            eprintln!("moec: {why}");
        }
    }
    let mut failure = None;
    for backend in BACKENDS {
        let report = (backend.devices)();
        for line in &report.lines {
            println!("{line}");
        }
        failure = failure.or(report.failure);
    }
    match failure {
        Some(e) => fail(e),
        None => ExitCode::SUCCESS,
    }
}
