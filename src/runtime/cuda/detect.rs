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
