//! The Hierarchical Roofline Model (MoE-Lightning §3.2, eq. 4-11) as functions.
//!
//! Takes what a task does (FLOPs on a processor, bytes at each memory level it touches, or
//! bytes copied between two levels) and a [`HardwareProfile`]; gives its time and which
//! roof bounds it. Guarantees: times are finite and non-negative for finite non-negative
//! inputs; zero work takes zero time. The per-op FLOPs and bytes come from the op catalog;
//! nothing here knows what an op computes.

use super::hardware::{ComputeDtype, HardwareProfile, Level, Processor};
use serde::Serialize;

/// What a compute task does, in the HRM's terms.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComputeLoad {
    /// Where it runs.
    pub processor: Processor,
    /// Which peak applies.
    pub dtype: ComputeDtype,
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read or written at each level (a level may appear once).
    pub bytes: Vec<(Level, f64)>,
}

/// The roof that bounds a task's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Roof {
    /// Peak FLOP/s of the processor (eq. 4).
    Compute,
    /// Bandwidth of the processor's own memory level (eq. 5).
    Memory(Level),
    /// Bandwidth of the link from another level (eq. 6), or a copy's link.
    Link(Level, Level),
    /// The measured rate of moec's own kernel for the task's op kind and rows
    /// ([`super::hardware::KernelRates`]), slower than every roof above.
    Kernel,
    /// Nothing to do.
    Idle,
}

impl Roof {
    /// Short label for tables: `compute`, `mem:gpu`, `link:pinned->gpu`.
    pub fn label(self) -> String {
        match self {
            Roof::Compute => "compute".to_string(),
            Roof::Memory(level) => format!("mem:{}", level.name()),
            Roof::Link(from, to) => format!("link:{}->{}", from.name(), to.name()),
            Roof::Kernel => "kernel".to_string(),
            Roof::Idle => "idle".to_string(),
        }
    }
}

/// A task's predicted time and the roof that sets it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TaskTime {
    /// Predicted duration, seconds (the slowest of compute and each level's traffic).
    pub seconds: f64,
    /// The binding roof.
    pub roof: Roof,
}

/// The memory level a processor computes out of ("level i" for that processor).
pub fn home_level(processor: Processor) -> Level {
    match processor {
        Processor::Gpu => Level::Gpu,
        Processor::Cpu => Level::Host,
    }
}

/// Whether a processor reads a level through its own memory bus (no link crossing).
fn is_local(processor: Processor, level: Level) -> bool {
    match processor {
        Processor::Gpu => level == Level::Gpu,
        Processor::Cpu => level != Level::Gpu,
    }
}

/// Time of a compute task: `max(flops / P^i, bytes_i / B^i, bytes_j / B^{j,i})`, the
/// reciprocal form of eq. 7 (eq. 8 when every byte is local).
pub fn compute_time(profile: &HardwareProfile, load: &ComputeLoad) -> TaskTime {
    let mut best = TaskTime {
        seconds: 0.0,
        roof: Roof::Idle,
    };
    let mut consider = |seconds: f64, roof: Roof| {
        if seconds > best.seconds {
            best = TaskTime { seconds, roof };
        }
    };
    consider(
        load.flops / profile.peak_flops(load.processor, load.dtype),
        Roof::Compute,
    );
    let home = home_level(load.processor);
    for &(level, bytes) in &load.bytes {
        if is_local(load.processor, level) {
            // The checkpoint read in place from disk is mapped and resident (the budget
            // charges it to host memory): read at the host's rate.
            let level = if level == Level::Disk {
                Level::Host
            } else {
                level
            };
            consider(bytes / profile.level_bandwidth(level), Roof::Memory(level));
        } else {
            consider(
                bytes / profile.link_bandwidth(level, home),
                Roof::Link(level, home),
            );
        }
    }
    best
}

/// Time of a copy: bytes over the link bandwidth between the two levels; a read from the
/// disk is `latency + bytes / B_disk` ([`super::hardware::DiskSpec::read_seconds`]), and
/// infinite on a profile without a `disk` level.
pub fn copy_time(profile: &HardwareProfile, from: Level, to: Level, bytes: f64) -> TaskTime {
    if bytes <= 0.0 {
        return TaskTime {
            seconds: 0.0,
            roof: Roof::Idle,
        };
    }
    if from == Level::Disk {
        return TaskTime {
            seconds: profile
                .disk
                .as_ref()
                .map_or(f64::INFINITY, |disk| disk.read_seconds(bytes)),
            roof: Roof::Link(from, to),
        };
    }
    TaskTime {
        seconds: bytes / profile.link_bandwidth(from, to),
        roof: Roof::Link(from, to),
    }
}

/// Attainable performance of eq. 7, FLOP/s: `min(P^i, B^i I^i, B^{j,i} I^j)`; pass
/// `remote = None` for eq. 8.
pub fn attainable_flops(
    peak: f64,
    local_bandwidth: f64,
    local_intensity: f64,
    remote: Option<(f64, f64)>,
) -> f64 {
    let mut performance = peak.min(local_bandwidth * local_intensity);
    if let Some((link_bandwidth, remote_intensity)) = remote {
        performance = performance.min(link_bandwidth * remote_intensity);
    }
    performance
}

/// Turning point P1 (eq. 9): the intensity `I^j` (FLOPs per byte of level-j data) below
/// which moving the data to level i does not beat computing at level j. Eq. 9 is a fixed
/// point `I = min(P^j, B^j I) / B^{j,i}`: when `B^j > B^{j,i}` it is `P^j / B^{j,i}`;
/// otherwise the link is never the slower path and there is no such point.
pub fn turning_point_p1(peak_j: f64, bandwidth_j: f64, link_bandwidth: f64) -> Option<f64> {
    (bandwidth_j > link_bandwidth).then(|| peak_j / link_bandwidth)
}

/// Turning point P2 (eq. 10): the intensity `I^j` below which a task at level i with
/// intensity `I^i` is bound by the link from j: `min(P^i, B^i I^i) / B^{j,i}`.
pub fn turning_point_p2(
    peak_i: f64,
    bandwidth_i: f64,
    intensity_i: f64,
    link_bandwidth: f64,
) -> f64 {
    peak_i.min(bandwidth_i * intensity_i) / link_bandwidth
}

/// Balance point (eq. 11): the `I^j` at which `B^i I^i = B^{j,i} I^j`.
pub fn balance_point(bandwidth_i: f64, intensity_i: f64, link_bandwidth: f64) -> f64 {
    bandwidth_i * intensity_i / link_bandwidth
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l4() -> HardwareProfile {
        HardwareProfile::load("l4").unwrap()
    }

    /// Mixtral-8x7B MoE FFN in decode on the L4 profile (MoE-Lightning §3.3, Fig. 5),
    /// worked by hand. One layer's experts: 8 experts x 3 matrices x 4096 x 14336 bf16
    /// = 8 * 3 * 4096 * 14336 * 2 B = 2,818,572,288 B. N tokens, each through top-2
    /// experts: flops = N * 2 * 3 * 2 * 4096 * 14336 = N * 704,643,072. So the intensity
    /// on the CPU-resident weights is I^j = N * 704,643,072 / 2,818,572,288 = N / 4
    /// FLOP/B, and on GPU for a micro-batch of mu tokens (all experts read once from HBM)
    /// I^i = mu / 4.
    /// L4 profile: P_cpu = 1.6e12, B_cpu = 76e9, B_cg = 16e9, P_gpu = 104e12,
    /// B_gpu = 285e9.
    #[test]
    fn mixtral_ffn_turning_points_on_l4_by_hand() {
        let hw = l4();
        let p_cpu = hw.peak_flops(Processor::Cpu, ComputeDtype::Half);
        let b_cpu = hw.level_bandwidth(Level::Host);
        let b_cg = hw.link_bandwidth(Level::Pinned, Level::Gpu);
        let p_gpu = hw.peak_flops(Processor::Gpu, ComputeDtype::Half);
        let b_gpu = hw.level_bandwidth(Level::Gpu);
        // P1: B_cpu (76) > B_cg (16), so I = P_cpu / B_cg = 1.6e12 / 16e9 = 100 FLOP/B,
        // i.e. N = 4 * 100 = 400 tokens per batch.
        let p1 = turning_point_p1(p_cpu, b_cpu, b_cg).unwrap();
        assert!((p1 - 100.0).abs() < 1e-9, "{p1}");
        // P2 at mu = 128 (the kernel size of Fig. 5): I^i = 32, B_gpu * 32 = 9.12e12 <
        // P_gpu = 104e12, so the GPU side is memory-bound; I^j = 9.12e12 / 16e9 = 570
        // FLOP/B, i.e. N = 2280 tokens.
        let p2 = turning_point_p2(p_gpu, b_gpu, 128.0 / 4.0, b_cg);
        assert!((p2 - 570.0).abs() < 1e-9, "{p2}");
        // The balance point (eq. 11) is the same number here because the GPU side is
        // memory-bound: 285e9 * 32 / 16e9 = 570.
        assert!((balance_point(b_gpu, 32.0, b_cg) - 570.0).abs() < 1e-9);
        // Attainable FLOP/s at N = 1024 (I^j = 256), mu = 128 (I^i = 32), eq. 7:
        // min(104e12, 285e9 * 32 = 9.12e12, 16e9 * 256 = 4.096e12) = 4.096e12.
        let attained = attainable_flops(p_gpu, b_gpu, 32.0, Some((b_cg, 256.0)));
        assert!((attained - 4.096e12).abs() < 1.0, "{attained}");
    }

    /// The same FFN as a task: N = 1024 tokens, weights streamed from pinned memory while
    /// the GPU computes (eq. 7): time = max(1024 * 704,643,072 / 104e12 = 6.938 ms,
    /// 2,818,572,288 / 16e9 = 176.16 ms) = 176.16 ms, bound by the pinned->gpu link.
    /// Once the weights are on the GPU (eq. 8) with mu = 128: max(128 * 704,643,072 /
    /// 104e12 = 0.8673 ms, 2,818,572,288 / 285e9 = 9.8897 ms) = 9.8897 ms, HBM-bound.
    #[test]
    fn ffn_task_times_by_hand() {
        let hw = l4();
        let weights = 2_818_572_288.0;
        let streamed = ComputeLoad {
            processor: Processor::Gpu,
            dtype: ComputeDtype::Half,
            flops: 1024.0 * 704_643_072.0,
            bytes: vec![(Level::Pinned, weights)],
        };
        let time = compute_time(&hw, &streamed);
        assert!((time.seconds - 0.176_160_768).abs() < 1e-9, "{time:?}");
        assert_eq!(time.roof, Roof::Link(Level::Pinned, Level::Gpu));
        let resident = ComputeLoad {
            processor: Processor::Gpu,
            dtype: ComputeDtype::Half,
            flops: 128.0 * 704_643_072.0,
            bytes: vec![(Level::Gpu, weights)],
        };
        let time = compute_time(&hw, &resident);
        assert!(
            (time.seconds - 2_818_572_288.0 / 285e9).abs() < 1e-12,
            "{time:?}"
        );
        assert_eq!(time.roof, Roof::Memory(Level::Gpu));
    }

    /// Decode GQA attention of Mixtral-8x7B on the CPU (MoE-Lightning Fig. 4, context 512):
    /// per token and layer the KV read is 2 * 8 heads * 128 * 512 * 2 B (fp16) = 2,097,152 B
    /// and the work is 2 * 2 * 32 heads * 128 * 512 = 8,388,608 FLOPs, intensity 4 FLOP/B,
    /// below P1 (100), so attention belongs on the CPU. For 1024 tokens on the L4 host:
    /// max(8.59e9 / 1.6e12 = 5.369 ms, 2.147e9 / 76e9 = 28.26 ms) = 28.26 ms, memory-bound.
    /// Streaming the same KV to the GPU instead: 2.147e9 / 16e9 = 134.2 ms (4.75x slower,
    /// the ratio B_cpu / B_cg that §6.2 observes as "3-4x").
    #[test]
    fn cpu_attention_by_hand() {
        let hw = l4();
        let kv = 1024.0 * 2_097_152.0;
        let load = ComputeLoad {
            processor: Processor::Cpu,
            dtype: ComputeDtype::F32,
            flops: 1024.0 * 8_388_608.0,
            bytes: vec![(Level::Host, kv)],
        };
        let time = compute_time(&hw, &load);
        assert!((time.seconds - kv / 76e9).abs() < 1e-12);
        assert_eq!(time.roof, Roof::Memory(Level::Host));
        let transfer = copy_time(&hw, Level::Pinned, Level::Gpu, kv);
        assert!((transfer.seconds / time.seconds - 76.0 / 16.0).abs() < 1e-9);
    }

    /// A disk read is `latency + bytes / B` (docs/cost-model.md, "The disk level"), on the
    /// H200 profile's PM9A3 figures (6.5 GB/s large reads, 3.69 GB/s small, 80 us): one
    /// Mixtral-8x7B bf16 expert (3 x 4096 x 14336 x 2 = 352,321,536 bytes) takes
    /// 80e-6 + 352321536 / 6.5e9 = 0.054283 s; a 64 KiB page 80e-6 + 65536 / 3.69e9 =
    /// 97.760 us; a profile without a disk level cannot finish one.
    #[test]
    fn disk_reads_by_hand() {
        let h200 = HardwareProfile::load("h200").unwrap();
        let expert = copy_time(&h200, Level::Disk, Level::Host, 352_321_536.0);
        assert!(
            (expert.seconds - 0.054_283_313).abs() < 1e-8,
            "{}",
            expert.seconds
        );
        assert_eq!(expert.roof, Roof::Link(Level::Disk, Level::Host));
        let page = copy_time(&h200, Level::Disk, Level::Pinned, 65_536.0);
        assert!(
            (page.seconds - 97.760_434e-6).abs() < 1e-11,
            "{}",
            page.seconds
        );
        let mut no_disk = h200.clone();
        no_disk.disk = None;
        assert!(copy_time(&no_disk, Level::Disk, Level::Host, 1.0)
            .seconds
            .is_infinite());
    }

    #[test]
    fn zero_work_is_free() {
        let hw = l4();
        let idle = ComputeLoad {
            processor: Processor::Gpu,
            dtype: ComputeDtype::Half,
            flops: 0.0,
            bytes: vec![],
        };
        assert_eq!(compute_time(&hw, &idle).seconds, 0.0);
        assert_eq!(
            copy_time(&hw, Level::Host, Level::Pinned, 0.0).roof,
            Roof::Idle
        );
    }
}
