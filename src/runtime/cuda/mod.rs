//! The CUDA backend's foundation: finding the CUDA libraries and devices at run time and
//! compiling moec's CUDA kernels (`kernels/*.cu`) through NVRTC.
//!
//! Takes the machine, a plan and a checkpoint; gives a [`detect::CudaStatus`] (which of
//! the driver, NVRTC and cuBLAS libraries load, and the devices the driver reports), PTX for
//! every kernel ([`kernels::compile_all`]) and the executing [`CudaBackend`] (streams,
//! events, device arenas, kernels and cuBLAS GEMMs), registered as [`REGISTRATION`].
//! Guarantees that nothing here panics when a library is missing: cudarc is built with
//! dynamic loading and panics on any call into a library it cannot load, so every call is
//! behind that library's presence check. The kernels mirror `math` (the CPU
//! backend's math and layouts), so both backends run the same lowered plan. No module
//! outside this one imports cudarc.

pub mod attention;
pub mod backend;
pub mod deepseek;
pub mod detect;
pub mod device;
pub mod devices;
pub mod format_copies;
pub mod graph;
pub mod host_weights;
pub mod kernels;
pub mod launch;
pub mod memory;
pub mod moe;
pub mod ops;
pub mod probe;
pub mod ptx_cache;
pub mod scratch;
pub mod step_inputs;
pub mod tensor_cores;
pub mod warmup;

pub use backend::{CudaBackend, CudaReport, CudaSetupError};

use crate::lower::ExecPlan;
use crate::runtime::backend::{Backend, BackendError, BackendOptions};
use crate::runtime::host::HostMemory;
use crate::runtime::probe::{GpuProbe, GpuProbeSizes};
use crate::runtime::registration::{GpuSpace, HostEngine, Registration};
use crate::weights::checkpoint::Checkpoint;
use std::sync::Arc;

/// The CUDA backend's registration (listed by `runtime::registry`): the `gpu` space on the device,
/// weight copies reach the device as bytes (a device kernel cannot read the mapped
/// checkpoint, so the replay charges them as copies; on the host side they bind when the
/// checkpoint is registered: `runtime::cuda::host_weights`), and it refuses to start, in
/// one line naming what is missing, on a machine without a driver or device.
pub const REGISTRATION: Registration = Registration {
    name: "cuda",
    about: "the CUDA backend: gpu.* streams as CUDA streams (NVRTC kernels, cuBLAS), cpu.* on the CPU backend beside it",
    gpu_space: GpuSpace::Device,
    binds_weight_copies: false,
    quant_formats: &ops::QUANT_FORMATS,
    // Its attention kernels read f32 caches only: `--kv-type f16` is refused (docs/cuda.md).
    kv_types: &[crate::model::vocab::KvType::F32],
    // Its MLA kernels read V from a V pool (`kernels/mla_attention.cu`): the latent twice.
    mla_values_in_keys: false,
    // Each device stream keeps a workspace of its own, sized by its kernels' choices.
    scratch: Some(&scratch::CUDA),
    refusal: run_refusal,
    open: open_cuda,
    link_libraries: detect::use_versioned_libraries,
    devices: devices::devices,
    probe: Some(run_probe),
};

/// `moec probe --backend cuda`: moec's kernels and copies timed on device 0.
fn run_probe(sizes: GpuProbeSizes) -> Result<GpuProbe, String> {
    probe::probe(sizes).map_err(|e| e.to_string())
}

/// Why a plan cannot run on the CUDA backend here, in one line: what is missing.
pub fn run_refusal() -> Option<String> {
    // The `moec` program only (never a test binary or an embedding program, which a
    // re-run would restart): CUDA 13 names and pip wheel folders linked where cudarc looks.
    let is_moec = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s == "moec"))
        .unwrap_or(false);
    if is_moec {
        if let Some(why) = detect::use_versioned_libraries() {
            return Some(format!("cannot run on the CUDA backend: {why}"));
        }
    }
    detect::detect()
        .missing()
        .map(|missing| format!("cannot run on the CUDA backend: {missing}"))
}

/// Sets the CUDA backend up over the plan's host side (no `gpu` arena in host memory)
/// with `host` running its `cpu.*` streams. Fails with [`BackendError::Unavailable`] (one
/// line naming what is missing) when there is no usable driver, device, NVRTC or cuBLAS.
fn open_cuda<'c>(
    plan: &ExecPlan,
    checkpoint: &'c Checkpoint,
    options: &BackendOptions,
    host: HostEngine,
) -> Result<Box<dyn Backend + 'c>, BackendError> {
    let memory = HostMemory::host_side(plan, checkpoint, options)
        .map_err(|e| BackendError::Setup(Box::new(e)))?;
    let memory = Arc::new(memory);
    let host = host(plan, Arc::clone(&memory), options)?;
    let backend = CudaBackend::new(plan, memory, host, options).map_err(|e| match e {
        CudaSetupError::Device(device::DeviceError::Missing(what)) => {
            BackendError::Unavailable(what)
        }
        other => BackendError::Setup(Box::new(other)),
    })?;
    Ok(Box::new(backend))
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
