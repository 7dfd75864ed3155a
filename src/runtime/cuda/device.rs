//! The CUDA device a plan runs on: the context and moec's kernels loaded for the device's
//! architecture.
//!
//! Takes the CUDA status (libraries and devices found); gives a [`Device`] with every entry
//! point of `kernels/*.cu` loaded as a [`CudaFunction`], or a [`DeviceError`] saying which
//! library, device or kernel is missing. The PTX comes from [`super::ptx_cache`] (compiled
//! once per source, architecture, NVRTC version and device; the run report says how many
//! files came from the cache). Nothing here calls into a library
//! before `detect` found it, so a missing library is an error, never cudarc's panic.

use super::detect::{detect, CudaStatus};
use super::kernels::KERNELS;
use super::ptx_cache::{default_dir, load_or_compile_all, PtxKey};
use super::CudaError;
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use std::collections::HashMap;
use std::sync::Arc;

/// Why the CUDA device cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A library or device is missing (one line, as `moec devices` says it).
    #[error("{0}")]
    Missing(String),
    /// A driver call failed during set-up.
    #[error("CUDA driver call failed while {doing}: {source}")]
    Driver {
        /// What was being done.
        doing: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A kernel could not be compiled.
    #[error(transparent)]
    Compile(#[from] CudaError),
    /// A kernel entry point is missing from its loaded module.
    #[error("kernels/{file}: entry point `{entry}` did not load: {source}")]
    Entry {
        /// The file.
        file: &'static str,
        /// The entry point.
        entry: &'static str,
        /// The driver's error.
        source: DriverError,
    },
}

pub use super::ptx_cache::PtxSources;

/// A CUDA device with moec's kernels loaded.
#[derive(Debug)]
pub struct Device {
    /// The primary context of device 0.
    pub ctx: Arc<CudaContext>,
    /// The device's name as the driver reports it.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// The architecture the kernels were compiled for (`sm_XY`).
    pub arch: &'static str,
    /// Where the PTX came from.
    pub ptx: PtxSources,
    functions: HashMap<&'static str, CudaFunction>,
}

fn driver(doing: &'static str) -> impl FnOnce(DriverError) -> DeviceError {
    move |source| DeviceError::Driver { doing, source }
}

impl Device {
    /// Opens device 0 and loads every kernel, compiling through NVRTC only on a cache miss.
    pub fn open() -> Result<Self, DeviceError> {
        let status = detect();
        if let Some(missing) = status.missing() {
            return Err(DeviceError::Missing(missing));
        }
        if !status.libraries.cublas {
            return Err(DeviceError::Missing(
                "cuBLAS not found (no libcublas.so library could be loaded); the CUDA backend runs its GEMMs on it".into(),
            ));
        }
        let ctx = CudaContext::new(0).map_err(driver("creating the context of device 0"))?;
        // Arenas are a few large allocations addressed by offset, and every cross-stream
        // order is an event of the plan: cudarc's per-allocation event tracking would add
        // syncs the plan did not ask for.
        // SAFETY: no allocation exists yet on this context from this backend, and the
        // backend orders every use of its memory with the plan's events itself.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().map_err(driver("reading the device name"))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let arch = arch_name(compute_capability);
        let (functions, ptx) = load_kernels(&ctx, arch, &status, &name)?;
        Ok(Device {
            ctx,
            name,
            compute_capability,
            arch,
            ptx,
            functions,
        })
    }

    /// A loaded kernel entry point by name (every entry of [`KERNELS`] is loaded).
    pub fn function(&self, entry: &'static str) -> Option<&CudaFunction> {
        self.functions.get(entry)
    }
}

/// `sm_XY` for a compute capability; interned once per process (NVRTC's options take a
/// `&'static str`).
pub fn arch_name((major, minor): (i32, i32)) -> &'static str {
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let name = format!("sm_{major}{minor}");
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&known) = names.iter().find(|n| **n == name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.push(leaked);
    leaked
}

type Loaded = (HashMap<&'static str, CudaFunction>, PtxSources);

fn load_kernels(
    ctx: &Arc<CudaContext>,
    arch: &'static str,
    status: &CudaStatus,
    device: &str,
) -> Result<Loaded, DeviceError> {
    let key = PtxKey {
        arch,
        nvrtc: status.nvrtc_version,
        device,
        nvrtc_loads: status.libraries.nvrtc,
    };
    let (ptx, sources) = load_or_compile_all(default_dir().as_deref(), key)?;
    let mut functions = HashMap::new();
    for (kernel, ptx) in KERNELS.iter().zip(ptx) {
        let module = ctx
            .load_module(ptx)
            .map_err(driver("loading a kernel module"))?;
        for &entry in kernel.entries {
            let f = module
                .load_function(entry)
                .map_err(|source| DeviceError::Entry {
                    file: kernel.file,
                    entry,
                    source,
                })?;
            functions.insert(entry, f);
        }
    }
    Ok((functions, sources))
}
