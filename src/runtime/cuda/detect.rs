//! What CUDA support this machine has: the driver, NVRTC and cuBLAS libraries, and the
//! devices the driver reports.
//!
//! Takes nothing; gives a [`CudaStatus`]. Never panics: a library is only called after
//! its presence check succeeded, and driver failures (a driver with no GPU, a busy device)
//! become [`CudaError::Driver`] values inside the status.

use super::CudaError;
use cudarc::driver::CudaContext;

/// Which CUDA libraries can be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Libraries {
    /// The driver library (`libcuda.so*`).
    pub driver: bool,
    /// The runtime compiler (`libnvrtc.so*`).
    pub nvrtc: bool,
    /// cuBLAS (`libcublas.so*`).
    pub cublas: bool,
}

/// One device the driver reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA A100-SXM4-80GB".
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Free device memory, bytes.
    pub free_bytes: usize,
    /// Total device memory, bytes.
    pub total_bytes: usize,
}

/// The CUDA status of this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaStatus {
    /// Which libraries load.
    pub libraries: Libraries,
    /// NVRTC's (major, minor) version when NVRTC loads.
    pub nvrtc_version: Option<(i32, i32)>,
    /// The driver's CUDA version (e.g. 12080 for 12.8) when the driver loads.
    pub driver_version: Option<i32>,
    /// cuBLAS's version (e.g. 120803) when cuBLAS loads and a device can host a handle.
    pub cublas_version: Option<i32>,
    /// The devices, when the driver loads: `None` without a driver, an error when the
    /// driver fails (e.g. it is installed but there is no GPU).
    pub devices: Option<Result<Vec<DeviceInfo>, CudaError>>,
}

impl CudaStatus {
    /// Why plans cannot run on CUDA here, in one line naming what is missing; `None` when
    /// a driver and at least one device are present (what remains missing then is moec's
    /// CUDA executor itself, which the caller reports).
    pub fn missing(&self) -> Option<String> {
        match &self.devices {
            None => Some("no CUDA driver library (libcuda.so) found".to_string()),
            Some(Err(e)) => Some(format!("the CUDA driver is present but unusable: {e}")),
            Some(Ok(devices)) if devices.is_empty() => {
                Some("the CUDA driver reports no devices".to_string())
            }
            Some(Ok(_)) => None,
        }
    }
}

/// Which CUDA libraries can be loaded (each attempt loads and drops the library).
pub fn libraries() -> Libraries {
    // SAFETY: these functions are unsafe only because loading a shared library runs its
    // initialisers. They try fixed NVIDIA library names (libcuda, libnvrtc, libcublas and
    // their versioned names) whose initialisers take no arguments from us and make no
    // assumptions about our process; the handles are dropped before returning, and no
    // symbol is called.
    unsafe {
        Libraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
        }
    }
}

/// The environment variable set on a process [`use_versioned_libraries`] re-executed, so it
/// never does it twice.
pub const LINKED_ENV: &str = "MOEC_CUDA_LIBRARIES_LINKED";

/// cudarc (built with the CUDA 12.8 names) looks for `libcublas.so`, `libcublas.so.12`,
/// ..., never `.so.13`: the names it tries, per library, and the versioned names and pip
/// wheel folders a CUDA 12 or 13 machine has them under.
const WANTED: [(&str, &[&str], &[&str]); 3] = [
    ("libcuda.so", &["libcuda.so.1"], &[]),
    (
        "libcublas.so",
        &["libcublas.so.13", "libcublas.so.12"],
        &["nvidia/cublas/lib", "nvidia/cu13/lib"],
    ),
    (
        "libnvrtc.so",
        &["libnvrtc.so.13", "libnvrtc.so.12"],
        &["nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib"],
    ),
];

/// Directories the CUDA libraries are looked for in: the loader path, the toolkit's usual
/// homes, and the `nvidia/*/lib` folders of pip wheels in the Python environments moec
/// can see (the active virtual environment, the user's and the system's).
fn search_dirs(wheel_dirs: &[&str]) -> Vec<std::path::PathBuf> {
    use std::path::PathBuf;
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for fixed in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(fixed));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    roots.extend(["/usr/local/lib", "/usr/lib"].map(PathBuf::from));
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for python in entries.filter_map(Result::ok) {
            if !python.file_name().to_string_lossy().starts_with("python3") {
                continue;
            }
            for packages in ["site-packages", "dist-packages"] {
                for wheel in wheel_dirs {
                    dirs.push(python.path().join(packages).join(wheel));
                }
            }
        }
    }
    dirs
}

/// On a machine whose CUDA libraries exist only under names cudarc does not try (CUDA 13's
/// `libcublas.so.13` and `libnvrtc.so.13`, or a pip wheel's folder off the loader path),
/// links them under the names it does try in a private directory and re-executes this
/// process with that directory (and the libraries' own, for what they load themselves)
/// first on `LD_LIBRARY_PATH`; the loader reads that variable only at start-up, so a
/// running process cannot use it otherwise. Does nothing when every library already
/// loads, when none is found, or in a process it re-executed. Returns only when it did
/// not re-execute (the reason, for a message, when it tried and failed). Call it only
/// from the `moec` program before it has printed or started anything (`moec devices`,
/// the CUDA backend's refusal check at the start of a run): it restarts the process.
pub fn use_versioned_libraries() -> Option<String> {
    if std::env::var_os(LINKED_ENV).is_some() {
        return None;
    }
    let present = libraries();
    let missing = [present.driver, present.cublas, present.nvrtc];
    if missing.iter().all(|&p| p) {
        return None;
    }
    let mut links = Vec::new();
    for ((name, versioned, wheels), present) in WANTED.iter().zip(missing) {
        if present {
            continue;
        }
        let found = search_dirs(wheels).into_iter().find_map(|dir| {
            versioned
                .iter()
                .map(|v| dir.join(v))
                .find(|path| path.exists())
        });
        if let Some(path) = found {
            links.push((*name, path));
        }
    }
    if links.is_empty() {
        return None;
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    // One directory per set of targets (a stable name: reruns reuse it, other sets do not
    // clash with it).
    let key = links
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, (name, target)| {
            format!("{name}={}", target.display())
                .bytes()
                .fold(h, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
        });
    let dir = base.join("moec").join(format!("cuda-libraries-{key:016x}"));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return Some(format!("cannot create {}: {e}", dir.display()));
    }
    let mut path_dirs = vec![dir.clone()];
    for (name, target) in &links {
        let link = dir.join(name);
        if std::fs::read_link(&link).ok().as_ref() != Some(target) {
            let _ = std::fs::remove_file(&link);
            if let Err(e) = std::os::unix::fs::symlink(target, &link) {
                return Some(format!("cannot link {}: {e}", link.display()));
            }
        }
        if let Some(parent) = target.parent() {
            path_dirs.push(parent.to_path_buf());
        }
    }
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path_dirs.extend(std::env::split_paths(&old));
    }
    let joined = match std::env::join_paths(path_dirs) {
        Ok(joined) => joined,
        Err(e) => return Some(format!("cannot build LD_LIBRARY_PATH: {e}")),
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Some(format!("cannot find this program to re-run it: {e}")),
    };
    use std::os::unix::process::CommandExt;
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(LINKED_ENV, &dir)
        .exec();
    Some(format!(
        "cannot re-run with the CUDA libraries linked: {error}"
    ))
}

/// Libraries, NVRTC version and devices.
pub fn detect() -> CudaStatus {
    let libraries = libraries();
    let nvrtc_version = libraries.nvrtc.then(nvrtc_version).flatten();
    let driver_version = libraries.driver.then(driver_version).flatten();
    let devices = libraries.driver.then(devices);
    let has_device = matches!(&devices, Some(Ok(d)) if !d.is_empty());
    let cublas_version = (libraries.cublas && has_device)
        .then(cublas_version)
        .flatten();
    CudaStatus {
        libraries,
        nvrtc_version,
        driver_version,
        cublas_version,
        devices,
    }
}

/// The driver's CUDA version; call only when the driver loads.
fn driver_version() -> Option<i32> {
    let mut version = 0i32;
    // SAFETY: the caller checked that libcuda loads, so cudarc resolves
    // `cuDriverGetVersion` (present in every driver); the pointer is a live local integer.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    (status == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(version)
}

/// cuBLAS's version, through a handle on device 0; call only when cuBLAS loads and the
/// driver reports a device.
fn cublas_version() -> Option<i32> {
    let context = CudaContext::new(0).ok()?;
    let stream = context.default_stream();
    let blas = cudarc::cublas::CudaBlas::new(stream).ok()?;
    let mut version = 0i32;
    // SAFETY: `blas` holds a live handle; the pointer is a live local integer.
    let status = unsafe { cudarc::cublas::sys::cublasGetVersion_v2(*blas.handle(), &mut version) };
    (status == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(version)
}

/// NVRTC's version; call only when NVRTC loads.
fn nvrtc_version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: the caller checked that libnvrtc loads, so cudarc resolves `nvrtcVersion`
    // (present in every NVRTC) instead of panicking; the two pointers are to live local
    // integers that the call only writes.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// Devices the driver reports; call only when the driver library loads.
fn devices() -> Result<Vec<DeviceInfo>, CudaError> {
    let driver = |call: &'static str| {
        move |e: cudarc::driver::DriverError| CudaError::Driver {
            call,
            detail: format!("{e:?}"),
        }
    };
    let count = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
    (0..count.max(0) as usize)
        .map(|ordinal| {
            let context = CudaContext::new(ordinal).map_err(driver("cuDevicePrimaryCtxRetain"))?;
            let name = context.name().map_err(driver("cuDeviceGetName"))?;
            let compute_capability = context
                .compute_capability()
                .map_err(driver("cuDeviceGetAttribute"))?;
            let (free_bytes, total_bytes) =
                context.mem_get_info().map_err(driver("cuMemGetInfo"))?;
            Ok(DeviceInfo {
                ordinal,
                name,
                compute_capability,
                free_bytes,
                total_bytes,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever this machine has, detection returns a status whose parts agree: devices
    /// are looked for exactly when the driver loads, a version exactly when NVRTC loads.
    #[test]
    fn detection_is_consistent_with_the_libraries() {
        let status = detect();
        assert_eq!(status.devices.is_some(), status.libraries.driver);
        assert_eq!(status.nvrtc_version.is_some(), status.libraries.nvrtc);
        if !status.libraries.driver {
            assert_eq!(
                status.missing().as_deref(),
                Some("no CUDA driver library (libcuda.so) found")
            );
        }
    }
}
