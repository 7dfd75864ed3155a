//! The CUDA device a plan runs on: the context, moec's kernels loaded for the device's
//! architecture, and the on-disk PTX cache.
//!
//! Takes the CUDA status (libraries and devices found); gives a [`Device`] with every entry
//! point of `kernels/*.cu` loaded as a [`CudaFunction`], or a [`DeviceError`] saying which
//! library, device or kernel is missing. NVRTC compiles each kernel file once per
//! (source, architecture, NVRTC version): the PTX is kept under
//! `<cache>/cuda-kernels/<hash>.ptx` and later runs load it without compiling (the run
//! report says how many files came from the cache). Nothing here calls into a library
//! before `detect` found it, so a missing library is an error, never cudarc's panic.

use super::detect::{detect, CudaStatus};
use super::kernels::{compile_kernel, KernelSource, KERNELS};
use super::CudaError;
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
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

/// Where the PTX of each kernel file came from in this process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PtxSources {
    /// Files compiled by NVRTC now (and written to the cache).
    pub compiled: usize,
    /// Files read from the on-disk cache.
    pub cached: usize,
}

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

/// The cache file of one kernel file's PTX. The key covers the source, the architecture,
/// the NVRTC version and the device's name, so PTX made by another NVRTC (or by the test
/// stand-in, whose "PTX" names a host object) is never loaded on this device.
fn cache_path(
    kernel: &KernelSource,
    arch: &str,
    nvrtc: Option<(i32, i32)>,
    device: &str,
) -> Option<PathBuf> {
    let dir = crate::weights::source::cache_dir()
        .ok()?
        .join("cuda-kernels");
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    // What NVRTC compiles (the prelude and included headers with the file), so a change to
    // any of them misses the cache.
    (super::kernels::full_source(kernel), arch, nvrtc, device).hash(&mut hasher);
    Some(dir.join(format!(
        "{}-{}-{:016x}.ptx",
        kernel.file.trim_end_matches(".cu"),
        arch,
        hasher.finish()
    )))
}

type Loaded = (HashMap<&'static str, CudaFunction>, PtxSources);

/// Writes a cache file through a temporary file of this process renamed into place:
/// processes sharing the cache (the test suite runs several at once) then read either no
/// file or the whole PTX, never the prefix a plain write shows while it is under way.
fn write_whole(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("ptx.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn load_kernels(
    ctx: &Arc<CudaContext>,
    arch: &'static str,
    status: &CudaStatus,
    device: &str,
) -> Result<Loaded, DeviceError> {
    let mut functions = HashMap::new();
    let mut sources = PtxSources::default();
    for kernel in &KERNELS {
        let path = cache_path(kernel, arch, status.nvrtc_version, device);
        let cached = path
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .filter(|text| text.contains(".entry") || text.contains(".target"));
        let ptx = match cached {
            Some(text) => {
                sources.cached += 1;
                Ptx::from_src(text)
            }
            None => {
                if !status.libraries.nvrtc {
                    return Err(DeviceError::Compile(CudaError::NvrtcMissing));
                }
                let ptx = compile_kernel(kernel, arch)?;
                sources.compiled += 1;
                if let Some(p) = &path {
                    // A cache that cannot be written only costs a compile next time.
                    let _ = p
                        .parent()
                        .map(std::fs::create_dir_all)
                        .transpose()
                        .and_then(|_| write_whole(p, &ptx.to_src()));
                }
                ptx
            }
        };
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
