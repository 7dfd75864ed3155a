//! The CUDA backend's foundation: finding the CUDA libraries and devices at run time and
//! compiling moec's CUDA kernels (`kernels/*.cu`) through NVRTC.
//!
//! Takes nothing but the machine; gives a [`detect::CudaStatus`] (which of the driver,
//! NVRTC and cuBLAS libraries load, and the devices the driver reports) and PTX for every
//! kernel ([`kernels::compile_all`]). Guarantees that nothing here panics when a library
//! is missing: cudarc is built with dynamic loading and panics on any call into a library
//! it cannot load, so every call is behind that library's presence check. Executing an
//! `ExecPlan` on CUDA is not built yet; the kernels mirror `model::kernels` (the CPU
//! backend's math and KV layout), so both backends read the same lowered plan.

pub mod detect;
pub mod kernels;

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
