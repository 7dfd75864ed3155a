//! `moec probe --backend cuda` through the stand-in: the GPU figures are timed with the
//! runtime's own kernels and copies, land in the written profile as its GPU and its
//! effective rates, and `moec simulate` predicts on that profile with them. The stand-in's
//! figures describe a CPU emulation (the test checks where they go, not their size).

use crate::standin_common::{loader_path, standin_cache, standin_dir};
use std::process::Command;

#[test]
fn probe_on_the_cuda_backend_writes_the_device_into_a_profile_simulate_uses() {
    let dir = standin_dir();
    let cache = tempfile::tempdir().expect("cache");
    let out = tempfile::tempdir().expect("out");
    let profile = out.path().join("standin.ron");
    let moec = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_moec"))
            .args(args)
            .env("LD_LIBRARY_PATH", loader_path(dir.path()))
            .env("XDG_CACHE_HOME", cache.path())
            .env("MOEC_STANDIN_CACHE", standin_cache())
            .output()
            .expect("moec runs")
    };
    let probed = moec(&[
        "probe",
        "--backend",
        "cuda",
        "--gpu-sizes",
        "tiny",
        "--size-mib",
        "16",
        "--threads",
        "1",
        "--name",
        "standin",
        "--out",
        profile.to_str().expect("utf-8 path"),
    ]);
    let stdout = String::from_utf8_lossy(&probed.stdout);
    let stderr = String::from_utf8_lossy(&probed.stderr);
    assert!(probed.status.success(), "{stdout}\n{stderr}");
    for figure in [
        "device moec-standin",
        "projection 16 rows",
        "prefill GEMM 32 rows",
        "decode attention 3 seqs x 40",
        "pinned -> device / device -> pinned",
        "kernel launch (back to back)",
        "cross-stream event wait",
    ] {
        assert!(stdout.contains(figure), "`{figure}` missing:\n{stdout}");
    }
    let text = std::fs::read_to_string(&profile).expect("the profile is written");
    assert!(
        text.contains("timed by `moec probe --backend cuda --gpu-sizes tiny`"),
        "{text}"
    );
    assert!(text.contains("model: \"moec-standin"), "{text}");
    assert!(text.contains("effective: Some(("), "{text}");
    assert!(text.contains("gpu_decode_attn_tflops: Some("), "{text}");
    // Not the CPU probe's emulated GPU, whose compute the CPU shares.
    assert!(!text.contains("shared_compute: true"), "{text}");

    let simulated = moec(&[
        "simulate",
        "schedules/baselines/gpu_resident.sched",
        "--hw",
        profile.to_str().expect("utf-8 path"),
    ]);
    let stdout = String::from_utf8_lossy(&simulated.stdout);
    let stderr = String::from_utf8_lossy(&simulated.stderr);
    assert!(simulated.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("effective (`moec probe --backend cuda` on moec-standin"),
        "the prediction names the probed rates:\n{stdout}"
    );
}
