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
//! - [`registration`]: what a backend is before it exists (name, spaces, refusal, set-up,
//!   what `moec devices` and `moec probe` ask of it), the interface every backend
//!   registers through; [`probe`]: the figures a device backend's GPU probe gives;
//!   [`sync`]: the one lock helper; [`args`]: a task's arguments by role; [`ops`]: what
//!   both backends' ops share (the op table's plumbing, `OpError`, the step lookups);
//! - the backends: [`cpu`] (the default, always available) and [`cuda`] (CUDA streams,
//!   events, device arenas, NVRTC kernels and cuBLAS), side by side, each importing only
//!   the interface and never each other;
//! - [`registry`]: the list of backends on top of them, the one place that picks one.
//!
//! [`generate`] sets up the backend the run options name and runs the driver on it.

pub mod args;
pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod driver;
pub mod host;
pub mod ops;
pub mod probe;
pub mod registration;
pub mod registry;
pub mod step;
pub mod sync;

pub use backend::{Backend, BackendError, BackendOptions, WeightCopies};
pub use driver::executor::{ExecError, ExecOptions};
pub use driver::{RunError, RunOptions, RunOutput};
pub use registration::Registration;

use crate::lower::ExecPlan;
use crate::records::RunStats;
use crate::weights::checkpoint::Checkpoint;

/// Runs `plan` on the backend `options.on` names over `prompts` (token ids); the outputs
/// come back in prompt order. `progress` is called after every step with (tokens
/// generated so far, tokens at most). The backend is set up here, after the prompts were
/// checked, and dropped when the run ends; a backend that cannot run on this machine
/// fails with [`BackendError::Unavailable`] in one line. The stats carry the set-up's
/// time (`RunStats::backend_open`), with the parts the backend timed itself.
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
    let opening = std::time::Instant::now();
    let backend = registry::open(options.on, plan, checkpoint, &options.backend)
        .map_err(RunError::Backend)?;
    let mut open =
        crate::records::load::LoadPhase::new("backend open", opening.elapsed().as_secs_f64());
    open.parts = backend.setup_phases();
    let (outputs, mut stats) = driver::generate(plan, &*backend, prompts, options, progress)?;
    stats.backend_open = Some(open);
    Ok((outputs, stats))
}
