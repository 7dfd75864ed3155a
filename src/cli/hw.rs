//! `moec hw [NAME] [--json]`: lists the hardware profiles, or shows one in full.

use crate::cost::hardware::{ComputeDtype, HardwareProfile, Level, Processor, GB, TFLOPS};
use clap::Args;
use std::process::ExitCode;

/// Arguments of `moec hw`.
#[derive(Debug, Args)]
pub struct HwArgs {
    /// A built-in profile name or a .ron path; without it, list the built-in profiles.
    pub name: Option<String>,
    /// Print as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `moec hw`.
pub fn run(args: HwArgs) -> ExitCode {
    let profiles = match &args.name {
        Some(name) => match HardwareProfile::load(name) {
            Ok(profile) => vec![profile],
            Err(e) => {
                eprintln!("{:?}", miette::Report::msg(e.to_string()));
                return ExitCode::FAILURE;
            }
        },
        None => HardwareProfile::builtins(),
    };
    if args.json {
        let text = if args.name.is_some() {
            serde_json::to_string_pretty(&profiles[0])
        } else {
            serde_json::to_string_pretty(&profiles)
        };
        println!("{}", text.unwrap_or_default());
        return ExitCode::SUCCESS;
    }
    if args.name.is_some() {
        print_one(&profiles[0]);
    } else {
        print_table(&profiles);
    }
    ExitCode::SUCCESS
}

fn print_table(profiles: &[HardwareProfile]) {
    println!(
        "{:<13} {:>8} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7}  description",
        "name", "gpu GB", "gpu GB/s", "gpu TF16", "host GB", "host GB/s", "h2d GB/s", "cores"
    );
    for p in profiles {
        println!(
            "{:<13} {:>8.0} {:>9.0} {:>9.1} {:>8.0} {:>9.0} {:>9.1} {:>7}  {}",
            p.name,
            p.capacity_bytes(Level::Gpu) / GB,
            p.level_bandwidth(Level::Gpu) / GB,
            p.peak_flops(Processor::Gpu, ComputeDtype::Half) / TFLOPS,
            p.capacity_bytes(Level::Host) / GB,
            p.level_bandwidth(Level::Host) / GB,
            p.link_bandwidth(Level::Pinned, Level::Gpu) / GB,
            p.cpu.cores,
            p.description
        );
    }
}

fn print_one(p: &HardwareProfile) {
    println!("{}: {}", p.name, p.description);
    println!("  gpu     {} x{}", p.gpu.model, p.gpu.count);
    println!("  cpu     {} ({} cores)", p.cpu.model, p.cpu.cores);
    println!("  level    capacity GB   budget GB   bandwidth GB/s");
    for level in Level::ALL {
        println!(
            "  {:<8} {:>11.1} {:>11.1} {:>16.1}",
            level.name(),
            p.capacity_bytes(level) / GB,
            p.budget_bytes(level) / GB,
            p.level_bandwidth(level) / GB
        );
    }
    println!(
        "  peak    gpu f32 {:.2} TFLOPS, gpu f16/bf16 {:.1} TFLOPS, cpu f32 {:.2} TFLOPS",
        p.peak_flops(Processor::Gpu, ComputeDtype::F32) / TFLOPS,
        p.peak_flops(Processor::Gpu, ComputeDtype::Half) / TFLOPS,
        p.peak_flops(Processor::Cpu, ComputeDtype::F32) / TFLOPS
    );
    println!(
        "  links   pinned->gpu {:.1} GB/s, gpu->pinned {:.1} GB/s ({}), host->gpu {:.1} GB/s, host->pinned {:.1} GB/s",
        p.link_bandwidth(Level::Pinned, Level::Gpu) / GB,
        p.link_bandwidth(Level::Gpu, Level::Pinned) / GB,
        if p.links.duplex { "full duplex" } else { "half duplex" },
        p.link_bandwidth(Level::Host, Level::Gpu) / GB,
        p.link_bandwidth(Level::Host, Level::Pinned) / GB
    );
    match &p.disk {
        Some(d) => println!(
            "  disk    {}: {:.2} GB/s reads of 1 MiB or more, {:.2} GB/s smaller, {:.0} us a read",
            d.model, d.read_gb_s, d.small_read_gb_s, d.latency_us
        ),
        None => println!("  disk    none (a `disk.read` copy cannot be predicted on this profile)"),
    }
}
