//! The CUDA backend's checks that need no GPU: detection never panics and names what is
//! missing, `moec devices` and `moec run --backend cuda` report it in plain words, the
//! kernels compile through NVRTC when NVRTC is present, `moec probe --backend cuda` writes
//! the device into a profile (module `gpu_probe`), and (modules `standin` and
//! `standin_kernels`) the CUDA path runs through cudarc against the stand-in driver
//! (standin/, built by `cargo test --workspace`): every kernel against the CPU kernels,
//! streams and events, cuBLAS, and what a driver refuses.
//!
//! `.ci/run` installs NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel) so the real compile tests
//! run in CI; elsewhere, without NVRTC, they print why they did not compile and pass. To
//! run them locally: `pip install nvidia-cuda-nvrtc-cu12` and point `LD_LIBRARY_PATH` at
//! the wheel's `nvidia/cuda_nvrtc/lib`.

use moec::runtime::cuda::detect::{detect, libraries};
use moec::runtime::cuda::kernels::{
    compile_all, compile_kernel, KernelSource, DEFAULT_ARCH, KERNELS,
};
use moec::runtime::cuda::ptx_cache::{load_or_compile_all, PtxKey};
use moec::runtime::cuda::CudaError;
use std::process::Command;

/// The cache folder these tests give `moec` (and whose `cuda-kernels` tests/docs_examples.rs
/// shares): moec's kernels compile once per NVRTC and source for the suite, not once per
/// test (a cold compile of the 16 files is over a minute and a half of CPU).
fn test_cache() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-cache")
}

fn moec(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moec"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", test_cache())
        .output()
        .expect("moec starts")
}

#[test]
fn detection_never_panics_and_names_a_missing_driver() {
    let status = detect();
    println!("{status:?}");
    assert_eq!(status.devices.is_some(), status.libraries.driver);
    if status.libraries.driver {
        // A driver with no usable device is still reported, as an error or an empty list.
        if let Some(Ok(devices)) = &status.devices {
            assert_eq!(status.missing().is_none(), !devices.is_empty());
        }
    } else {
        assert_eq!(
            status.missing().as_deref(),
            Some("no CUDA driver library (libcuda.so) found")
        );
    }
}

#[test]
fn devices_command_names_the_cpu_and_cuda_status() {
    let out = moec(&["devices"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        lines[0].starts_with(&format!("cpu: available, {threads} threads, AVX-512: ")),
        "{stdout}"
    );
    let cuda = lines
        .iter()
        .find(|l| l.starts_with("cuda:"))
        .copied()
        .unwrap_or_default();
    let libs = libraries();
    if !libs.driver {
        assert!(
            cuda.starts_with("cuda: not available (no CUDA driver library (libcuda.so) found); "),
            "{cuda}"
        );
    }
    if libs.nvrtc {
        assert!(
            cuda.contains(&format!(
                ": found, {} kernel files compile for sm_",
                KERNELS.len()
            )),
            "{cuda}"
        );
    } else {
        assert!(cuda.contains("; NVRTC: not found;"), "{cuda}");
    }
    let cublas = if libs.cublas {
        "cuBLAS: found"
    } else {
        "cuBLAS: not found"
    };
    assert!(cuda.ends_with(cublas), "{cuda}");
}

#[test]
fn run_on_cuda_fails_with_one_clear_line() {
    let out = moec(&[
        "run",
        "schedules/cgopipe.sched",
        "--model",
        "mixtral-tiny",
        "--backend",
        "cuda",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty());
    let text: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(text.len(), 1, "{stderr}");
    let want = if libraries().driver {
        "cannot run on the CUDA backend: "
    } else {
        "cannot run on the CUDA backend: no CUDA driver library (libcuda.so) found"
    };
    assert!(text[0].contains(want), "{stderr}");
}

#[test]
fn an_unknown_backend_is_rejected_by_the_parser() {
    let out = moec(&["run", "schedules/cgopipe.sched", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("possible values: cpu, cuda"));
}

/// True when NVRTC loads; otherwise says why a compile test is skipped.
fn nvrtc_present(test: &str) -> bool {
    let present = libraries().nvrtc;
    if !present {
        println!(
            "{test}: NVRTC not found (no libnvrtc.so on the loader path), so the kernels were \
             not compiled; install nvidia-cuda-nvrtc-cu12 and set LD_LIBRARY_PATH to check"
        );
    }
    present
}

#[test]
fn every_kernel_compiles_through_nvrtc_and_exports_its_entries() {
    if !nvrtc_present("every_kernel_compiles_through_nvrtc_and_exports_its_entries") {
        assert_eq!(
            compile_all(DEFAULT_ARCH).err(),
            Some(CudaError::NvrtcMissing)
        );
        return;
    }
    // Through the cache `moec devices` fills (the devices test runs beside this one): a
    // file either test compiles first, under the entry's lock, the other reads. The key
    // holds NVRTC's version and the full source, so a cached file is this NVRTC's PTX of
    // these sources.
    let key = PtxKey {
        arch: DEFAULT_ARCH,
        nvrtc: detect().nvrtc_version,
        device: "",
        nvrtc_loads: true,
    };
    let (modules, sources) =
        match load_or_compile_all(Some(&test_cache().join("cuda-kernels")), key) {
            Ok(loaded) => loaded,
            Err(e) => panic!("{e}"),
        };
    println!("{sources:?}");
    assert_eq!(modules.len(), KERNELS.len());
    for (ptx, kernel) in modules.iter().zip(&KERNELS) {
        let file = kernel.file;
        let text = ptx.to_src();
        assert!(text.contains(&format!(".target {DEFAULT_ARCH}")), "{file}");
        for entry in kernel.entries {
            assert!(
                text.contains(&format!(".entry {entry}(")),
                "kernels/{file}: no PTX entry {entry}"
            );
        }
        println!("kernels/{file}: {} bytes of PTX", text.len());
    }
}

#[test]
fn a_rejected_source_names_its_file_and_carries_the_nvrtc_log() {
    if !nvrtc_present("a_rejected_source_names_its_file_and_carries_the_nvrtc_log") {
        return;
    }
    let broken = KernelSource {
        file: "broken.cu",
        source: "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }",
        entries: &["broken"],
    };
    match compile_kernel(&broken, DEFAULT_ARCH) {
        Err(e @ CudaError::Compile { .. }) => {
            let message = e.to_string();
            assert!(message.starts_with("kernels/broken.cu: NVRTC failed to compile it for sm_80"));
            assert!(message.contains("undeclared_name"), "{message}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

// The stand-in driver (standin/, a test tool): the CUDA path through cudarc with no GPU.
#[path = "standin_common/mod.rs"]
mod standin_common;

#[path = "cuda_backend/gpu_probe.rs"]
mod gpu_probe;
#[path = "cuda_backend/standin.rs"]
mod standin;
#[path = "cuda_backend/standin_deepseek.rs"]
mod standin_deepseek;
#[path = "cuda_backend/standin_experts.rs"]
mod standin_experts;
#[path = "cuda_backend/standin_format_copies.rs"]
mod standin_format_copies;
#[path = "cuda_backend/standin_int_products.rs"]
mod standin_int_products;
#[path = "cuda_backend/standin_kernels.rs"]
mod standin_kernels;
#[path = "cuda_backend/standin_tensor_cores.rs"]
mod standin_tensor_cores;

/// CUDA 13's library names, with no link made by the user: the stand-in only as
/// `libcuda.so.1`, `libcublas.so.13` and `libnvrtc.so.13` (names cudarc's CUDA 12.8 build
/// never tries for cuBLAS and NVRTC), alone on the loader path; `moec devices` links them
/// where cudarc looks, re-runs itself and finds the driver and its device, NVRTC (the
/// kernels compile for the device's architecture, the stand-in's sm_80) and cuBLAS.
#[test]
fn devices_finds_the_cuda_13_library_names_without_links() {
    let library = standin_common::standin_library();
    let dir = tempfile::tempdir().expect("temp dir");
    for name in ["libcuda.so.1", "libcublas.so.13", "libnvrtc.so.13"] {
        std::os::unix::fs::symlink(&library, dir.path().join(name)).expect("symlink");
    }
    let cache = tempfile::tempdir().expect("cache");
    let out = Command::new(env!("CARGO_BIN_EXE_moec"))
        .arg("devices")
        .env("LD_LIBRARY_PATH", dir.path())
        .env("XDG_CACHE_HOME", cache.path())
        .env("MOEC_STANDIN_CACHE", standin_common::standin_cache())
        .env_remove("MOEC_CUDA_LIBRARIES_LINKED")
        .output()
        .expect("moec runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let cuda = stdout
        .lines()
        .find(|l| l.starts_with("cuda:"))
        .unwrap_or_default();
    assert!(
        cuda.starts_with("cuda: driver (CUDA ") && cuda.contains("found, 1 device(s)"),
        "{stdout}\n{stderr}"
    );
    assert!(
        cuda.contains(&format!(
            ": found, {} kernel files compile for sm_80",
            KERNELS.len()
        )),
        "{cuda}"
    );
    assert!(
        cuda.contains("cuBLAS") && cuda.ends_with(": found"),
        "{cuda}"
    );
    assert!(
        stdout.contains("  device 0: moec-standin") && stdout.contains(", sm_80, "),
        "{stdout}"
    );
    // Printed once: the re-run happened before anything was printed.
    assert_eq!(stdout.matches("cpu: available").count(), 1, "{stdout}");
}
