//! What `moec devices` prints for the CUDA backend (its registration's `devices` entry).
//!
//! Takes the machine; gives the status line (driver and devices, NVRTC and whether moec's
//! kernels compile with it for device 0's architecture, cuBLAS), a line per device, and the
//! compile error when NVRTC is present but rejects a kernel (a bug in moec's kernels, shown
//! with NVRTC's log). Guarantees: nothing here panics on a missing library (every call is
//! behind `detect`'s presence checks).

use super::detect::{detect, CudaStatus};
use super::device::arch_name;
use super::kernels::{DEFAULT_ARCH, KERNELS};
use super::ptx_cache::{default_dir, load_or_compile_all, PtxKey};
use super::CudaError;
use crate::runtime::registration::DevicesReport;

/// The CUDA backend's lines of `moec devices`.
pub fn devices() -> DevicesReport {
    let status = detect();
    let (nvrtc_line, compile_error) = nvrtc_line(&status);
    let mut lines = vec![format!(
        "{}; {nvrtc_line}; {}",
        cuda_line(&status),
        cublas_line(&status)
    )];
    if let Some(Ok(devices)) = &status.devices {
        for d in devices {
            lines.push(format!(
                "  device {}: {}, sm_{}{}, {:.1} GiB total, {:.1} GiB free",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.total_bytes as f64 / (1u64 << 30) as f64,
                d.free_bytes as f64 / (1u64 << 30) as f64,
            ));
        }
    }
    DevicesReport {
        lines,
        failure: compile_error.map(|e| e.to_string()),
    }
}

/// The driver part of the status line.
fn cuda_line(status: &CudaStatus) -> String {
    match (&status.devices, status.missing()) {
        (_, Some(missing)) => format!("cuda: not available ({missing})"),
        (Some(Ok(devices)), None) => format!(
            "cuda: driver{} found, {} device(s); plans run with --backend cuda",
            status.driver_version.map_or(String::new(), |v| format!(
                " (CUDA {}.{})",
                v / 1000,
                v % 1000 / 10
            )),
            devices.len()
        ),
        (_, None) => "cuda: driver found".to_string(),
    }
}

/// The NVRTC part of the status line, and the compile error when a kernel is rejected.
fn nvrtc_line(status: &CudaStatus) -> (String, Option<CudaError>) {
    if !status.libraries.nvrtc {
        return ("NVRTC: not found".to_string(), None);
    }
    let version = status
        .nvrtc_version
        .map_or(String::new(), |(major, minor)| format!(" {major}.{minor}"));
    // The architecture the backend compiles for: device 0's, as `Device::open` does; the
    // default only when the driver reports no device.
    let arch = match &status.devices {
        Some(Ok(devices)) => devices
            .first()
            .map_or(DEFAULT_ARCH, |d| arch_name(d.compute_capability)),
        _ => DEFAULT_ARCH,
    };
    // Device 0's name, as `Device::open` keys the cache: `moec devices` then leaves the PTX
    // a later `moec run --backend cuda` on that device loads without compiling.
    let device = match &status.devices {
        Some(Ok(devices)) => devices.first().map_or("", |d| d.name.as_str()),
        _ => "",
    };
    let key = PtxKey {
        arch,
        nvrtc: status.nvrtc_version,
        device,
        nvrtc_loads: true,
    };
    match load_or_compile_all(default_dir().as_deref(), key) {
        Ok((modules, sources)) => (
            format!(
                "NVRTC{version}: found, {} kernel files compile for {arch} ({} compiled now, {} from the cache)",
                modules.len(),
                sources.compiled,
                sources.cached
            ),
            None,
        ),
        Err(e) => (
            format!(
                "NVRTC{version}: found, but the {} kernel files do not compile for {arch}",
                KERNELS.len()
            ),
            Some(e),
        ),
    }
}

/// The cuBLAS part of the status line.
fn cublas_line(status: &CudaStatus) -> String {
    match (status.libraries.cublas, status.cublas_version) {
        (true, Some(v)) => format!("cuBLAS {}.{}.{}: found", v / 10000, v / 100 % 100, v % 100),
        (true, None) => "cuBLAS: found".to_string(),
        (false, _) => "cuBLAS: not found".to_string(),
    }
}
