//! The runtime: executes a lowered plan as real MoE inference.
//!
//! Takes an [`ExecPlan`], a checkpoint and prompts as token ids; gives the generated ids
//! and a [`RunStats`] with the measured timeline of every task. Three parts, each with one
//! job:
//! - [`driver`]: batching, admission, steps, guards, sampling, outputs and the run report,
//!   generic over a [`Backend`]; it names no backend type;
//! - [`backend`]: the interface a backend implements (run a task, record and wait events,
//!   read routing back, finish a step) and the options and capabilities it reports;
//! - the backends: [`cpu`] (the default, always available) and [`cuda`] (CUDA streams,
//!   events, device arenas, NVRTC kernels and cuBLAS; `cuda::generate` runs on it).
//!
//! [`generate`] is the CPU backend's entry point: it sets the backend up for the plan and
//! runs the driver on it.

pub mod args;
pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod driver;

pub use backend::{Backend, BackendError, BackendOptions};
pub use driver::executor::{ExecError, ExecOptions};
pub use driver::{RunError, RunOptions, RunOutput};

use crate::lower::ExecPlan;
use crate::model::checkpoint::Checkpoint;
use crate::records::RunStats;

/// Runs `plan` on the CPU backend over `prompts` (token ids); the outputs come back in
/// prompt order. `progress` is called after every step with (tokens generated so far,
/// tokens at most).
pub fn generate(
    plan: &ExecPlan,
    checkpoint: &Checkpoint,
    prompts: &[Vec<u32>],
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<RunOutput>, RunStats), RunError> {
    driver::check_prompts(&plan.model, prompts, options.max_new_tokens)?;
    let backend = cpu::CpuBackend::new(plan, checkpoint, &options.backend)
        .map_err(|e| RunError::Backend(BackendError::Setup(Box::new(e))))?;
    driver::generate(plan, &backend, prompts, options, progress)
}
