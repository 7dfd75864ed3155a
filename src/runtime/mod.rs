//! The runtime: executes a lowered plan as real MoE inference.
//!
//! Takes an [`ExecPlan`], a checkpoint and prompts as token ids; gives the generated ids
//! and a [`RunStats`] with the measured timeline of every task. Three parts, each with one
//! job:
//! - [`driver`]: batching, admission, steps, guards, sampling, outputs and the run report,
//!   generic over a [`Backend`]; it names no backend type;
//! - [`backend`]: the interface a backend implements (run a task, record and wait events,
//!   read routing back, finish a step) and the options and capabilities it reports;
//! - [`step`]: what a task reads of its step ([`step::StepContext`], which the driver's
//!   state implements), so backends never see the driver;
//! - [`host`]: host memory every backend uses (arenas, the weights image over the
//!   checkpoint's maps, weight labels, copies);
//! - the backends: [`cpu`] (the default, always available) and [`cuda`] (CUDA streams,
//!   events, device arenas, NVRTC kernels and cuBLAS), side by side, each registered in
//!   [`registry`], the one place that picks a backend.
//!
//! [`generate`] sets up the backend the run options name and runs the driver on it.

pub mod args;
pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod driver;
pub mod host;
pub mod registry;
pub mod step;

pub use backend::{Backend, BackendError, BackendOptions, WeightCopies};
pub use driver::executor::{ExecError, ExecOptions};
pub use driver::{RunError, RunOptions, RunOutput};
pub use registry::Registration;

/// Locks a mutex, recovering the data if a panicking thread poisoned it (every critical
/// section of the runtime is a single insert, lookup or counter update, so the data is
/// consistent).
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

use crate::lower::ExecPlan;
use crate::records::RunStats;
use crate::weights::checkpoint::Checkpoint;

/// Runs `plan` on the backend `options.on` names over `prompts` (token ids); the outputs
/// come back in prompt order. `progress` is called after every step with (tokens
/// generated so far, tokens at most). The backend is set up here, after the prompts were
/// checked, and dropped when the run ends; a backend that cannot run on this machine
/// fails with [`BackendError::Unavailable`] in one line.
pub fn generate(
    plan: &ExecPlan,
    checkpoint: &Checkpoint,
    prompts: &[Vec<u32>],
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<RunOutput>, RunStats), RunError> {
    driver::check_prompts(&plan.model, prompts, options.max_new_tokens)?;
    if let Some(refusal) = (options.on.refusal)() {
        return Err(RunError::Backend(BackendError::Unavailable(refusal)));
    }
    let backend = registry::open(options.on, plan, checkpoint, &options.backend)
        .map_err(RunError::Backend)?;
    driver::generate(plan, &*backend, prompts, options, progress)
}
