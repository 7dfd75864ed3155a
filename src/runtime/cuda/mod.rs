//! The CUDA backend's foundation: finding the CUDA libraries and devices at run time and
//! compiling moec's CUDA kernels (`kernels/*.cu`) through NVRTC.
//!
//! Takes the machine, a plan and a checkpoint; gives a [`detect::CudaStatus`] (which of
//! the driver, NVRTC and cuBLAS libraries load, and the devices the driver reports), PTX for
//! every kernel ([`kernels::compile_all`]) and the executing [`CudaBackend`] (streams,
//! events, device arenas, kernels and cuBLAS GEMMs; [`generate`] runs the driver on it).
//! Guarantees that nothing here panics when a library is missing: cudarc is built with
//! dynamic loading and panics on any call into a library it cannot load, so every call is
//! behind that library's presence check. The kernels mirror `model::kernels` (the CPU
//! backend's math and layouts), so both backends run the same lowered plan. No module
//! outside this one imports cudarc.

pub mod backend;
pub mod detect;
pub mod device;
pub mod kernels;
pub mod launch;
pub mod memory;
pub mod ops;

pub use backend::{CudaBackend, CudaReport, CudaSetupError};

use crate::lower::ExecPlan;
use crate::model::checkpoint::Checkpoint;
use crate::records::RunStats;
use crate::runtime::{BackendError, RunError, RunOptions, RunOutput};

/// Runs `plan` on the CUDA backend over `prompts` (token ids), as `runtime::generate` does
/// on the CPU; also gives what the backend found and did. Fails with
/// [`BackendError::Unavailable`] (one line naming what is missing) when there is no usable
/// driver, device, NVRTC or cuBLAS.
pub fn generate(
    plan: &ExecPlan,
    checkpoint: &Checkpoint,
    prompts: &[Vec<u32>],
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<RunOutput>, RunStats, CudaReport), RunError> {
    crate::runtime::driver::check_prompts(&plan.model, prompts, options.max_new_tokens)?;
    let backend = CudaBackend::new(plan, checkpoint, &options.backend).map_err(|e| {
        RunError::Backend(match e {
            CudaSetupError::Device(device::DeviceError::Missing(what)) => {
                BackendError::Unavailable(what)
            }
            other => BackendError::Setup(Box::new(other)),
        })
    })?;
    let (outputs, stats) =
        crate::runtime::driver::generate(plan, &backend, prompts, options, progress)?;
    Ok((outputs, stats, backend.report()))
}

/// What can go wrong finding CUDA or compiling the kernels.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// The NVRTC library (`libnvrtc.so*`) could not be loaded.
    #[error("NVRTC not found (no libnvrtc.so library could be loaded), so the CUDA kernels cannot be compiled")]
    NvrtcMissing,
    /// NVRTC rejected a kernel source.
    #[error("kernels/{file}: NVRTC failed to compile it for {arch} ({status}):\n{log}")]
    Compile {
        /// Kernel file name (under `kernels/`).
        file: &'static str,
        /// Target architecture, e.g. `sm_80`.
        arch: &'static str,
        /// NVRTC's status code.
        status: String,
        /// NVRTC's compile log.
        log: String,
    },
    /// NVRTC failed outside compilation proper (creating the program, fetching the PTX).
    #[error("kernels/{file}: NVRTC error: {detail}")]
    Nvrtc {
        /// Kernel file name (under `kernels/`).
        file: &'static str,
        /// What NVRTC reported.
        detail: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {detail}")]
    Driver {
        /// The call, e.g. `cuInit`.
        call: &'static str,
        /// The driver's error code.
        detail: String,
    },
}
