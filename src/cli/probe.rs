//! `moec probe`: measures this machine and writes a hardware profile.

use crate::cost::hardware::{Level, GB, TFLOPS};
use crate::engine::cpu_probe::{probe_profile, ProbeEffort};
use crate::runtime::probe::GpuProbeSizes;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moec probe`.
#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// Write the profile here (RON); without it, print it.
    #[arg(long, short)]
    pub out: Option<PathBuf>,
    /// Name of the profile.
    #[arg(long, default_value = "this-machine")]
    pub name: String,
    /// Buffer size for the bandwidth kernels, MiB (larger than the last-level cache).
    #[arg(long, default_value_t = 512)]
    pub size_mib: usize,
    /// Threads for the parallel kernels (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the measurements as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also time one expert of this model card (Fiddler's latency model: CPU time per
    /// token, GPU time, weight copy), giving the profile's `lat.*` symbols.
    #[arg(long, value_name = "CARD")]
    pub model: Option<String>,
    /// `cuda`: also time moec's CUDA kernels and copies on device 0 and write them as the
    /// profile's GPU (its `gpu`, `links` and `effective` rates); `cpu` (the default): the
    /// GPU is the CPU backend's emulation.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub backend: String,
    /// Sizes of the CUDA figures: `full` (Mixtral-8x7B's projection and attention, 256 MiB
    /// copies) or `tiny` (the stand-in driver's test sizes: launch costs, not a device's
    /// rates).
    #[arg(long, default_value = "full", value_parser = ["full", "tiny"])]
    pub gpu_sizes: String,
    /// Folder on the drive to measure for the profile's `disk` level (direct reads of a
    /// temporary file written there, removed after): the checkpoint's drive.
    #[arg(long, default_value = ".")]
    pub disk_dir: PathBuf,
    /// Size of that temporary file, MiB; 0 leaves the disk unmeasured (no `disk` level).
    #[arg(long, default_value_t = 256)]
    pub disk_mib: u64,
}

/// Runs `moec probe`.
pub fn run(args: ProbeArgs) -> ExitCode {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let (measured, mut profile) = match probe_profile(
        &args.name,
        args.size_mib.saturating_mul(1 << 20),
        threads,
        ProbeEffort::FULL,
        &crate::engine::cpu_probe::QUANT_FORMATS,
    ) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{:?}", miette::Report::msg(e.to_string()));
            return ExitCode::FAILURE;
        }
    };
    match crate::engine::dispatch::measured_dispatch(threads) {
        Ok(dispatch) => profile.dispatch = Some(dispatch),
        Err(e) => {
            eprintln!("{:?}", miette::Report::msg(e));
            return ExitCode::FAILURE;
        }
    }
    let disk = if args.disk_mib > 0 {
        match crate::engine::disk_probe::measure(&args.disk_dir, args.disk_mib << 20) {
            Ok((figures, spec)) => {
                profile.disk = Some(spec);
                Some(figures)
            }
            Err(e) => {
                eprintln!("{:?}", miette::Report::msg(e));
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    if let Some(model) = &args.model {
        let card = match crate::model::card::ModelCard::load(model) {
            Ok(card) => card,
            Err(e) => {
                eprintln!("{:?}", miette::Report::msg(e.to_string()));
                return ExitCode::FAILURE;
            }
        };
        match crate::engine::cpu_probe::measure_expert_latency(&card, measured.memcpy_bytes_per_s) {
            Ok(lat) => profile.latency = Some(lat),
            Err(e) => {
                eprintln!("{:?}", miette::Report::msg(e.to_string()));
                return ExitCode::FAILURE;
            }
        }
    }
    // A backend with a device times its own kernels there (its registration's probe); the
    // CPU backend has none, and its GPU is the emulation the CPU probe measured.
    let device_probe = match crate::runtime::registry::find(&args.backend) {
        Ok(backend) => backend.probe,
        Err(e) => {
            eprintln!("{:?}", miette::Report::msg(e.to_string()));
            return ExitCode::FAILURE;
        }
    };
    let gpu = match device_probe {
        Some(probe) => {
            let sizes = match args.gpu_sizes.as_str() {
                "tiny" => GpuProbeSizes::TINY,
                _ => GpuProbeSizes::FULL,
            };
            match probe(sizes) {
                Ok(gpu) => Some(gpu),
                Err(e) => {
                    eprintln!("{:?}", miette::Report::msg(e));
                    return ExitCode::FAILURE;
                }
            }
        }
        None => None,
    };
    if let Some(gpu) = &gpu {
        profile = crate::engine::gpu_probe::cuda_profile(profile, gpu);
    }
    if args.json {
        let value = serde_json::json!({ "measurements": measured, "gpu": gpu, "disk": disk, "profile": profile });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
    } else {
        println!(
            "measured on {threads} threads, {} MiB buffers:",
            measured.buffer_bytes >> 20
        );
        println!(
            "  streaming read (all threads)  {:>8.2} GB/s",
            measured.stream_read_bytes_per_s / GB
        );
        println!(
            "  memcpy (one thread)           {:>8.2} GB/s copied",
            measured.memcpy_bytes_per_s / GB
        );
        println!(
            "  f32 GEMM {n}x{n}x{n} (gemm)    {:>8.1} GFLOP/s",
            measured.gemm_f32_flops / 1e9,
            n = measured.gemm_size
        );
        if gpu.is_none() {
            println!(
                "profile `{}`: emulated gpu {:.1} GB at {:.1} GB/s, {:.3} TFLOPS; links {:.1} GB/s",
                profile.name,
                profile.capacity_bytes(Level::Gpu) / GB,
                profile.level_bandwidth(Level::Gpu) / GB,
                profile.gpu.f32_tflops * TFLOPS / TFLOPS,
                profile.link_bandwidth(Level::Pinned, Level::Gpu) / GB
            );
            println!("  (the GPU is the CPU backend's emulation on the same cores and DRAM)");
        }
        if let Some(d) = &disk {
            println!(
                "disk (direct reads of a {} MiB file in {}): sequential {:.2} GB/s ({} MiB reads, one in flight), parallel {:.2} GB/s ({} readers), {} KiB pages {:.2} GB/s, one 4 KiB read {:.0} us",
                d.file_bytes >> 20,
                args.disk_dir.display(),
                d.sequential / GB,
                crate::runtime::host::disk::CHUNK >> 20,
                d.parallel / GB,
                crate::runtime::host::disk::READERS,
                crate::engine::disk_probe::PAGE >> 10,
                d.pages / GB,
                d.latency * 1e6
            );
        }
        if let Some(k) = &profile.kernels {
            println!("moec's kernels (weight bytes per second by rows per weight):");
            for line in k.summary() {
                println!("  {line}");
            }
        }
        if let Some(d) = &profile.dispatch {
            println!(
                "moec's runtime (no-op tasks through the executor): {}",
                d.summary()
            );
        }
        if let Some(lat) = &profile.latency {
            println!(
                "expert latency of {} (lat.*): cpu {:.3} ms per token, gpu {:.3} ms at batch 4, copy {:.3} ms",
                lat.model,
                lat.cpu_s_per_token * 1e3,
                lat.gpu_s * 1e3,
                lat.copy_s * 1e3
            );
        }
    }
    if let Some(gpu) = &gpu {
        if !args.json {
            println!("moec's CUDA kernels and copies ({} sizes):", args.gpu_sizes);
            for line in gpu.summary() {
                println!("  {line}");
            }
            println!(
                "profile `{}`: gpu {} {:.1} GB usable; effective rates from these figures",
                profile.name,
                profile.gpu.model,
                profile.capacity_bytes(Level::Gpu) / GB
            );
        }
    }
    let gpu_line = match &gpu {
        Some(g) => format!(
            "// The GPU: {} ({}), timed by `moec probe --backend cuda --gpu-sizes {}`.",
            g.device, g.arch, args.gpu_sizes
        ),
        None => {
            "// The GPU is the CPU backend's emulation: same cores and DRAM as the host.".into()
        }
    };
    let text = format!(
        "// Measured by `moec probe` ({threads} threads, {} MiB buffers).\n{gpu_line}\n{}\n",
        measured.buffer_bytes >> 20,
        profile.to_ron()
    );
    match &args.out {
        Some(path) => {
            if let Err(e) = write_atomically(path, &text) {
                eprintln!("{:?}", miette::Report::msg(e));
                return ExitCode::FAILURE;
            }
            println!("wrote {}", path.display());
        }
        None if !args.json => print!("{text}"),
        None => {}
    }
    ExitCode::SUCCESS
}

/// Writes an output file (`cli::output`: atomic over regular files, never over links or
/// device nodes).
pub(crate) fn write_atomically(path: &std::path::Path, text: &str) -> Result<(), String> {
    super::output::write_output(path, text)
}
