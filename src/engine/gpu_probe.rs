//! A hardware profile of a machine with a CUDA GPU, from what `moec probe --backend cuda`
//! measured: the CPU probe's host side with the device's figures in place of the CPU
//! backend's emulated GPU.
//!
//! Takes the CPU probe's profile (host DRAM, moec's CPU kernel curves, the runtime's
//! dispatch costs) and a [`GpuProbe`]; gives a [`HardwareProfile`] whose `gpu` and `links`
//! hold the device's measured capacity and rates and whose `effective` section holds what
//! the HRM's effective model divides by: prefill and decode GEMM rates, decode and prefill
//! attention rates, the bandwidth moec's decode projections stream weights at, and the
//! fixed costs of a launch and of a cross-stream wait. Here because it joins a runtime
//! measurement and the cost model's profile, which do not import each other.

use crate::cost::hardware::{EffectiveRates, GpuSpec, HardwareProfile, LinkSpec, GB, TFLOPS};
use crate::runtime::probe::GpuProbe;

/// Share of device memory a plan may use: the CUDA context, cuBLAS's workspace and the
/// streams' scratch (the CUDA backend's per-stream workspace) live in the rest. The datasheet
/// profiles of `hardware/` keep 0.86 to 0.9 for the same reason.
const USABLE_FRACTION: f64 = 0.9;

/// `host` (the CPU probe's profile of this machine) with `gpu`'s device in place of the
/// emulated one.
pub fn cuda_profile(host: HardwareProfile, gpu: &GpuProbe) -> HardwareProfile {
    let prefill_tflops = gpu.prefill_gemm_flops / TFLOPS;
    // The decode GEMM cap: the rate at the most rows the few-row path takes, where a
    // projection is furthest from streaming-bound (fewer rows are bound by the bytes the
    // GEMV point below gives).
    let decode_tflops = gpu
        .decode
        .iter()
        .max_by_key(|p| p.rows)
        .map(|p| p.flops / TFLOPS);
    // A decode step's device traffic is mostly weights through `linear_gemv` and the
    // grouped expert GEMV: the one-row projection's weight rate is what it streams at,
    // below a plain copy's.
    let stream_gb_s = gpu
        .decode
        .iter()
        .min_by_key(|p| p.rows)
        .map_or(gpu.device_copy_bytes_per_s, |p| p.weight_bytes_per_s)
        / GB;
    let mut profile = host;
    profile.description = format!(
        "this machine, measured by `moec probe --backend cuda`: {} ({}) and the host ({} threads)",
        gpu.device, gpu.arch, profile.cpu.cores
    );
    profile.gpu = GpuSpec {
        model: gpu.device.clone(),
        count: 1,
        mem_gb: gpu.total_mem_bytes as f64 / GB,
        usable_fraction: USABLE_FRACTION,
        mem_bw_gb_s: gpu.device_copy_bytes_per_s / GB,
        // moec multiplies f32 activations by stored weights either way (the bf16 pair
        // split of `StreamCx::linear`): one rate for both.
        f32_tflops: prefill_tflops,
        half_tflops: prefill_tflops,
    };
    profile.links = LinkSpec {
        host_to_gpu_gb_s: gpu.host_to_device_pinned / GB,
        gpu_to_host_gb_s: gpu.device_to_host_pinned / GB,
        // Not measured: PCIe and NVLink-C2C links carry both directions at once.
        duplex: true,
        pageable_to_gpu_gb_s: gpu.host_to_device_pageable / GB,
        pageable_to_pinned_gb_s: profile.links.pageable_to_pinned_gb_s,
    };
    profile.effective = Some(EffectiveRates {
        source: format!(
            "`moec probe --backend cuda` on {} ({}): moec's kernels, cuBLAS call and copies at {}x{} projections, {}/{} attention heads of {}",
            gpu.device,
            gpu.arch,
            gpu.sizes.ffn,
            gpu.sizes.hidden,
            gpu.sizes.attn_heads.0,
            gpu.sizes.attn_heads.1,
            gpu.sizes.attn_heads.2
        ),
        gpu_prefill_gemm_tflops: Some(prefill_tflops),
        gpu_decode_gemm_tflops: decode_tflops,
        gpu_prefill_attn_tflops: Some(gpu.prefill_attn_flops / TFLOPS),
        gpu_mem_bw_gb_s: Some(stream_gb_s),
        cpu_mem_bw_gb_s: Some(profile.cpu.mem_bw_gb_s),
        cpu_tflops: Some(profile.cpu.f32_tflops),
        host_to_gpu_gb_s: Some(gpu.host_to_device_pinned / GB),
        gpu_to_host_gb_s: Some(gpu.device_to_host_pinned / GB),
        pageable_to_pinned_gb_s: Some(profile.links.pageable_to_pinned_gb_s),
        gpu_decode_attn_tflops: Some(gpu.decode_attn_flops / TFLOPS),
        kv_store_gb_s: None,
        // Every GPU task launches at least one kernel; a launch-bound stream pays this
        // per launch.
        task_overhead_us: gpu.launch_s * 1e6,
        sync_overhead_us: gpu.event_wait_s * 1e6,
        // Relay copies and CPU compute share the host's DRAM on every real machine.
        shared_host_dram: true,
    });
    // The device is not the CPU's cores: GPU and CPU work overlap.
    profile.adjustments.shared_compute = false;
    profile
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::probe::{profile_from_measurements, Measurements};
    use crate::runtime::probe::{GemvPoint, GpuProbeSizes};

    fn host() -> HardwareProfile {
        profile_from_measurements(
            "box",
            &Measurements {
                threads: 16,
                buffer_bytes: 1 << 29,
                stream_read_bytes_per_s: 100e9,
                memcpy_bytes_per_s: 20e9,
                gemm_f32_flops: 1e12,
                gemm_size: 1024,
                total_ram_bytes: 128_000_000_000,
            },
        )
    }

    /// Figures of the shape an H100 gives, worked through by hand: each profile field is
    /// the measured figure in the profile's unit.
    #[test]
    fn the_profile_holds_the_device_figures_in_the_profile_units() {
        let gpu = GpuProbe {
            device: "NVIDIA H100 80GB HBM3".into(),
            arch: "sm_90",
            total_mem_bytes: 80_000_000_000,
            sizes: GpuProbeSizes::FULL,
            device_copy_bytes_per_s: 2.6e12,
            decode: vec![
                GemvPoint {
                    rows: 1,
                    seconds: 60e-6,
                    weight_bytes_per_s: 1.95e12,
                    flops: 1.96e12,
                },
                GemvPoint {
                    rows: 16,
                    seconds: 90e-6,
                    weight_bytes_per_s: 1.3e12,
                    flops: 20.9e12,
                },
            ],
            prefill_gemm_flops: 550e12,
            decode_attn_flops: 3e12,
            prefill_attn_flops: 40e12,
            host_to_device_pinned: 50e9,
            device_to_host_pinned: 48e9,
            host_to_device_pageable: 12e9,
            launch_s: 2.5e-6,
            event_wait_s: 1.5e-6,
        };
        let p = cuda_profile(host(), &gpu);
        assert_eq!(p.gpu.model, "NVIDIA H100 80GB HBM3");
        assert!((p.gpu.mem_gb - 80.0).abs() < 1e-9);
        assert!((p.gpu.mem_bw_gb_s - 2600.0).abs() < 1e-6);
        assert!((p.gpu.half_tflops - 550.0).abs() < 1e-9);
        assert!((p.links.host_to_gpu_gb_s - 50.0).abs() < 1e-9);
        assert!((p.links.gpu_to_host_gb_s - 48.0).abs() < 1e-9);
        assert!((p.links.pageable_to_gpu_gb_s - 12.0).abs() < 1e-9);
        // The host side is the CPU probe's, untouched.
        assert!((p.links.pageable_to_pinned_gb_s - 20.0).abs() < 1e-9);
        assert_eq!(p.cpu.cores, 16);
        let e = p.effective.as_ref().expect("an effective section");
        assert_eq!(e.gpu_decode_gemm_tflops, Some(20.9));
        assert_eq!(e.gpu_mem_bw_gb_s, Some(1950.0));
        assert_eq!(e.gpu_decode_attn_tflops, Some(3.0));
        assert_eq!(e.gpu_prefill_attn_tflops, Some(40.0));
        assert!((e.task_overhead_us - 2.5).abs() < 1e-9);
        assert!((e.sync_overhead_us - 1.5).abs() < 1e-9);
        assert!(!p.adjustments.shared_compute);
        // What the HRM divides by: the effective profile takes these rates.
        let eff = p.effective();
        assert!((eff.gpu.mem_bw_gb_s - 1950.0).abs() < 1e-6);
        assert!((eff.adjustments.task_s - 2.5e-6).abs() < 1e-15);
        assert!((eff.adjustments.gpu_decode_gemm_flops - 20.9e12).abs() < 1.0);
    }
}
