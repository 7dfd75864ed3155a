//! What a probe of this machine measured, made into a [`HardwareProfile`].
//!
//! Takes [`Measurements`] (plain figures: DRAM read bandwidth, one thread's memcpy, f32
//! GEMM FLOP/s, RAM); gives the profile of the CPU backend's emulated GPU on this machine
//! ([`profile_from_measurements`]). Pure: the timing itself is `engine::cpu_probe`'s,
//! which runs moec's CPU kernels (the compiler's side imports none of them).

use super::hardware::{CpuSpec, GpuSpec, HardwareProfile, LinkSpec, GB, TFLOPS};
use serde::Serialize;

/// What `moec probe` measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Measurements {
    /// Threads used by the parallel kernels.
    pub threads: usize,
    /// Bytes per buffer used for the bandwidth kernels.
    pub buffer_bytes: usize,
    /// DRAM read bandwidth with all threads, bytes/s.
    pub stream_read_bytes_per_s: f64,
    /// Bytes copied per second by one thread's `memcpy` (each byte is read and written).
    pub memcpy_bytes_per_s: f64,
    /// f32 GEMM throughput with all threads, FLOP/s.
    pub gemm_f32_flops: f64,
    /// GEMM size used (m = n = k).
    pub gemm_size: usize,
    /// Total RAM reported by the OS, bytes (0 if unknown).
    pub total_ram_bytes: u64,
}

/// Builds this machine's profile. The CPU backend emulates the GPU on the same cores and
/// DRAM, so: GPU FLOP/s = measured GEMM (f32 and "half" alike: the backend computes in
/// f32), GPU memory bandwidth = measured streaming read, host<->GPU links = one thread's
/// memcpy (each copy stream is one thread copying between arenas), pageable->pinned the
/// same. Capacities: the `gpu` arena gets a quarter of RAM and pinned another quarter by
/// default (both live in the same DRAM as the pageable checkpoint mapping); pass
/// `--gpu-mem` / `--host-mem` to budget differently. The CPU side reports the same
/// measured figures, because it is the same silicon: a simulation on this profile shows
/// "gpu" and "cpu" work overlapping, which the real 2-core machine cannot fully do.
pub fn profile_from_measurements(name: &str, measured: &Measurements) -> HardwareProfile {
    let ram_gb = if measured.total_ram_bytes > 0 {
        measured.total_ram_bytes as f64 / GB
    } else {
        8.0
    };
    let threads = measured.threads.max(1) as u32;
    let read_gb_s = measured.stream_read_bytes_per_s / GB;
    let copy_gb_s = measured.memcpy_bytes_per_s / GB;
    let flops_t = measured.gemm_f32_flops / TFLOPS;
    HardwareProfile {
        name: name.to_string(),
        description: format!(
            "this machine, measured by `moec probe` ({threads} threads; the GPU is the CPU backend's emulation)"
        ),
        gpu: GpuSpec {
            model: "emulated on CPU (moec cpu backend)".to_string(),
            count: 1,
            mem_gb: ram_gb / 4.0,
            usable_fraction: 1.0,
            mem_bw_gb_s: read_gb_s,
            f32_tflops: flops_t,
            half_tflops: flops_t,
        },
        cpu: CpuSpec {
            model: "this machine".to_string(),
            cores: threads,
            mem_gb: ram_gb,
            pinned_gb: ram_gb / 4.0,
            usable_fraction: 0.8,
            mem_bw_gb_s: read_gb_s,
            f32_tflops: flops_t,
            half_tflops: flops_t,
        },
        links: LinkSpec {
            host_to_gpu_gb_s: copy_gb_s,
            gpu_to_host_gb_s: copy_gb_s,
            duplex: threads > 1,
            pageable_to_gpu_gb_s: copy_gb_s,
            pageable_to_pinned_gb_s: copy_gb_s,
        },
        latency: None,
        effective: None,
        // One compute pool serves both engines on the CPU backend.
        adjustments: super::hardware::Adjustments {
            shared_compute: true,
            ..Default::default()
        },
        kernels: None,
        dispatch: None,
        // The disk is measured apart (`engine::disk_probe`), where a checkpoint's drive is.
        disk: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Figures of a small machine give a profile that validates and survives RON (what
    /// `moec probe` writes), its GPU and CPU sides both at the measured figures.
    #[test]
    fn measurements_give_a_valid_profile() {
        let measured = Measurements {
            threads: 2,
            buffer_bytes: 4 << 20,
            stream_read_bytes_per_s: 20e9,
            memcpy_bytes_per_s: 10e9,
            gemm_f32_flops: 100e9,
            gemm_size: 1024,
            total_ram_bytes: 16 << 30,
        };
        let profile = profile_from_measurements("probe-test", &measured);
        profile.validate().unwrap();
        assert!(HardwareProfile::from_ron(&profile.to_ron(), "probe").is_ok());
        assert_eq!(profile.gpu.mem_bw_gb_s, 20e9 / GB);
        assert_eq!(profile.cpu.cores, 2);
    }
}
