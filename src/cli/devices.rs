//! `moec devices`: which backends this machine can run, in plain words.
//!
//! Prints the CPU backend (threads, the CPU kernels chosen and why, see `MOEC_KERNELS`)
//! and the CUDA status: driver and devices,
//! NVRTC and whether moec's kernels compile with it, cuBLAS. Exits 0, or 1 when NVRTC is
//! present but rejects a kernel (a bug in moec's kernels, shown with NVRTC's log). Also
//! gives the one-line refusal `moec run --backend cuda` reports.

use super::generate::fail;
use crate::math::isa::Isa;
use crate::math::report::describe;
use crate::runtime::cuda::detect::{detect, use_versioned_libraries, CudaStatus};
use crate::runtime::cuda::device::arch_name;
use crate::runtime::cuda::kernels::{compile_all, DEFAULT_ARCH, KERNELS};
use crate::runtime::cuda::CudaError;
use std::process::ExitCode;

/// Arguments of `moec devices` (none).
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {}

/// Runs `moec devices`.
pub fn run(_args: &DevicesArgs) -> ExitCode {
    // CUDA 13 names and pip wheel folders: linked under the names the CUDA backend loads, in a re-run of this
    // command, before anything is printed or loaded for good.
    if let Some(why) = use_versioned_libraries() {
        eprintln!("moec: {why}");
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let has = |isa: Isa| if isa.is_supported() { "yes" } else { "no" };
    println!(
        "cpu: available, {threads} threads, AVX-512: {}, AVX2+FMA: {}",
        has(Isa::Avx512),
        has(Isa::Avx2)
    );
    println!("  {}", describe());
    let status = detect();
    let (nvrtc_line, compile_error) = nvrtc_line(&status);
    println!(
        "{}; {nvrtc_line}; {}",
        cuda_line(&status),
        cublas_line(&status)
    );
    if let Some(Ok(devices)) = &status.devices {
        for d in devices {
            println!(
                "  device {}: {}, sm_{}{}, {:.1} GiB total, {:.1} GiB free",
                d.ordinal,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.total_bytes as f64 / (1u64 << 30) as f64,
                d.free_bytes as f64 / (1u64 << 30) as f64,
            );
        }
    }
    match compile_error {
        Some(e) => fail(e),
        None => ExitCode::SUCCESS,
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
    match compile_all(arch) {
        Ok(modules) => (
            format!(
                "NVRTC{version}: found, {} kernel files compile for {arch}",
                modules.len()
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
