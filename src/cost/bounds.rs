//! Analytical throughput bounds printed beside a simulation.
//!
//! Takes per-layer work split by resource (MoE-Lightning eq. 12-14) or the workload and
//! capacity figures of MoE-Lens's stage-1 model (eq. 3-4); gives the bound and what binds
//! it. Guarantees: every bound is a lower bound on time (an upper bound on tokens/s) for
//! any schedule doing the same work on the same profile, because each resource must at
//! least do its own share serially.

use super::hardware::{HardwareProfile, Level};
use super::hrm::{compute_time, copy_time, ComputeLoad};
use serde::Serialize;

/// One layer's decode work, split the way eq. 12-13 splits it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LayerWork {
    /// Bytes that must cross from host to GPU for the layer (streamed weights, hidden
    /// states after CPU attention, KV cache when attention runs on the GPU).
    pub host_to_gpu_bytes: f64,
    /// Bytes that must cross from GPU to host (QKV for CPU attention, new KV).
    pub gpu_to_host_bytes: f64,
    /// Bytes read from the disk for the layer (`disk.read` copies of the checkpoint).
    #[serde(skip_serializing_if = "is_zero")]
    pub disk_bytes: f64,
    /// Computations on the GPU (attention if A_g = 1, the MoE FFN if F_g = 1, ...).
    pub gpu: Vec<ComputeLoad>,
    /// Computations on the CPU.
    pub cpu: Vec<ComputeLoad>,
}

/// The per-layer bound of eq. 12: `T = max(comm_cpu_to_gpu, T_cpu, T_gpu)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerBound {
    /// `comm^{cpu_to_gpu}`, seconds.
    pub comm_seconds: f64,
    /// GPU-to-host transfer time, seconds. MoE-Lightning leaves it out because PCIe is
    /// full duplex; on a half-duplex link it is added to `comm_seconds` instead.
    pub comm_out_seconds: f64,
    /// Disk read time, seconds: a resource of its own beside the link (eq. 12 gains the
    /// term `comm_disk` when the checkpoint is read from disk).
    #[serde(skip_serializing_if = "is_zero")]
    pub disk_seconds: f64,
    /// `T_cpu` of eq. 13, seconds.
    pub cpu_seconds: f64,
    /// `T_gpu` of eq. 13, seconds.
    pub gpu_seconds: f64,
    /// `T` of eq. 12, seconds.
    pub layer_seconds: f64,
    /// Which term is the maximum: `comm`, `comm_out`, `disk`, `cpu` or `gpu`.
    pub bottleneck: &'static str,
}

/// Eq. 12-14: every computation costs `max(comm_x, comp_x)` (eq. 14, via the HRM), the
/// per-processor times add up (eq. 13) and the layer takes the slowest resource (eq. 12).
pub fn moe_lightning_layer_bound(profile: &HardwareProfile, work: &LayerWork) -> LayerBound {
    let sum = |loads: &[ComputeLoad]| -> f64 {
        loads
            .iter()
            .map(|load| compute_time(profile, load).seconds)
            .sum()
    };
    let mut comm_seconds =
        copy_time(profile, Level::Pinned, Level::Gpu, work.host_to_gpu_bytes).seconds;
    let mut comm_out_seconds =
        copy_time(profile, Level::Gpu, Level::Pinned, work.gpu_to_host_bytes).seconds;
    if !profile.links.duplex {
        comm_seconds += comm_out_seconds;
        comm_out_seconds = 0.0;
    }
    let cpu_seconds = sum(&work.cpu);
    let gpu_seconds = sum(&work.gpu);
    let disk_seconds = copy_time(profile, Level::Disk, Level::Host, work.disk_bytes).seconds;
    let terms = [
        ("comm", comm_seconds),
        ("comm_out", comm_out_seconds),
        ("disk", disk_seconds),
        ("cpu", cpu_seconds),
        ("gpu", gpu_seconds),
    ];
    let (bottleneck, layer_seconds) =
        terms.iter().copied().fold(
            ("comm", 0.0),
            |best, term| if term.1 > best.1 { term } else { best },
        );
    LayerBound {
        comm_seconds,
        comm_out_seconds,
        disk_seconds,
        cpu_seconds,
        gpu_seconds,
        layer_seconds,
        bottleneck,
    }
}

fn is_zero(value: &f64) -> bool {
    *value == 0.0
}

/// Parallelism-memory efficiency of a sequence (MoE-Lens eq. 3): tokens produced per
/// token-slot of KV cache per step over its lifetime, `2 (p + g) / ((2p + g) g)`.
pub fn parallelism_memory_efficiency(prompt_len: f64, gen_len: f64) -> f64 {
    2.0 * (prompt_len + gen_len) / ((2.0 * prompt_len + gen_len) * gen_len)
}

/// Inputs of MoE-Lens's stage-1 bound (eq. 4).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stage1Inputs {
    /// Average prompt length `p`.
    pub prompt_len: f64,
    /// Generation length `g`.
    pub gen_len: f64,
    /// Bytes of weights streamed to the GPU per pass over the model ("Model Size").
    pub streamed_weight_bytes: f64,
    /// KV cache capacity in token slots (`M`).
    pub kv_capacity_tokens: f64,
    /// Host-to-GPU bandwidth `B_IO`, bytes/s.
    pub link_bandwidth: f64,
    /// Most tokens/s the GPU can compute when fully fed (`T_GPU`).
    pub gpu_tokens_per_s: f64,
}

/// MoE-Lens's stage-1 bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stage1Bound {
    /// Eq. 3.
    pub pme: f64,
    /// `delta = Model Size / B_IO`, seconds per pass over the weights.
    pub delta_seconds: f64,
    /// `PME * M / delta`, tokens/s: the CPU-memory-capacity bound.
    pub memory_bound_tokens_per_s: f64,
    /// `T_GPU`, tokens/s.
    pub gpu_bound_tokens_per_s: f64,
    /// Eq. 4: the smaller of the two.
    pub tokens_per_s: f64,
    /// `kv_capacity` or `gpu`.
    pub bottleneck: &'static str,
}

/// Eq. 4: `T_max = min(PME * M / delta, T_GPU)`.
pub fn moe_lens_stage1(inputs: &Stage1Inputs) -> Stage1Bound {
    let pme = parallelism_memory_efficiency(inputs.prompt_len, inputs.gen_len);
    let delta_seconds = inputs.streamed_weight_bytes / inputs.link_bandwidth;
    let memory_bound = pme * inputs.kv_capacity_tokens / delta_seconds;
    let (tokens_per_s, bottleneck) = if memory_bound <= inputs.gpu_tokens_per_s {
        (memory_bound, "kv_capacity")
    } else {
        (inputs.gpu_tokens_per_s, "gpu")
    };
    Stage1Bound {
        pme,
        delta_seconds,
        memory_bound_tokens_per_s: memory_bound,
        gpu_bound_tokens_per_s: inputs.gpu_tokens_per_s,
        tokens_per_s,
        bottleneck,
    }
}

/// Tokens the GPU must hold in flight to be compute-bound while weights stream (MoE-Lens
/// eq. 2): `n >= C_GPU / B_IO * N_e / N_k`.
pub fn moe_lens_saturating_tokens(
    gpu_flops: f64,
    link_bandwidth: f64,
    experts: f64,
    top_k: f64,
) -> f64 {
    gpu_flops / link_bandwidth * experts / top_k
}

/// Measured (or HRM) times Klotski's planner inequalities (Klotski eq. 4) take, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KlotskiTimes {
    /// `t_c_A`: attention of one batch.
    pub attn: f64,
    /// `t_c_G`: gate of one batch.
    pub gate: f64,
    /// `t_c_hot_E`: the prefetched hot experts over all batches of the group.
    pub hot_experts: f64,
    /// `sum_{i in Q} t_c_E_i`: the cold experts activated, over all batches.
    pub cold_experts: f64,
    /// `len(Q)`: how many cold experts are activated per layer.
    pub cold_count: f64,
    /// `K`: prefetched hot experts per layer.
    pub hot_count: f64,
    /// `t_I/O_A`: transfer of the next layer's attention weights.
    pub io_attn: f64,
    /// `t_I/O_G`: transfer of the gate weights.
    pub io_gate: f64,
    /// `t_I/O_E`: transfer of one expert.
    pub io_expert: f64,
}

/// The smallest batch-group size `n` satisfying all four inequalities of Klotski eq. 4 (so
/// I/O hides behind computation at points I-IV of its Fig. 9); `None` when attention and
/// gate take no time, so no `n` helps.
pub fn klotski_min_batches(t: &KlotskiTimes) -> Option<u64> {
    let per_batch_attn = t.attn;
    let per_batch = t.attn + t.gate;
    if per_batch <= 0.0 {
        return None;
    }
    let needs = [
        // (I) gate weights before the gate: n t_cA >= t_IO_G.
        (per_batch_attn, t.io_gate, 0.0),
        // (II) K hot experts before they compute.
        (per_batch, t.io_gate + t.hot_count * t.io_expert, 0.0),
        // (III) the first cold expert after the hot ones.
        (
            per_batch,
            t.io_gate + (t.hot_count + 1.0) * t.io_expert,
            t.hot_experts,
        ),
        // (IV) next layer's attention after all experts.
        (
            per_batch,
            t.io_gate + (t.hot_count + t.cold_count) * t.io_expert + t.io_attn,
            t.hot_experts + t.cold_experts,
        ),
    ];
    let mut n = 1.0f64;
    for (coefficient, io, head_start) in needs {
        if coefficient <= 0.0 {
            if io > head_start {
                return None;
            }
            continue;
        }
        n = n.max(((io - head_start) / coefficient).ceil());
    }
    Some(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::hardware::{ComputeDtype, Processor};

    /// MoE-Lightning Tab. 5 policy on S1 (T4): mu = 36, N = 504 (n_ub = 14), MTBench,
    /// generation 128, r_w = 0 (all weights streamed). Worked by hand for one layer of
    /// Mixtral-8x7B with bf16 weights and fp16 KV. Layer parameters: attention 4096 *
    /// (4096 + 2 * 1024) + 4096 * 4096 + 2 * 4096 = 41,951,232; router 8 * 4096 = 32,768;
    /// experts 8 * 3 * 4096 * 14336 = 1,409,286,144; total 1,451,270,144 (2,902,540,288 B).
    /// - comm: weights 2,902,540,288 B + attention output 504 * 4096 * 2 = 4,128,768 B =
    ///   2,906,669,056 B / 16e9 = 181.67 ms.
    /// - cpu: decode attention at context 77 + 64 (mid-generation) = 141: KV bytes 504 *
    ///   2 * 1024 * 141 * 2 = 291,078,144 B / 100e9 = 2.91 ms (compute 504 * 4 * 4096 *
    ///   141 = 1.164e9 FLOPs / 0.8e12 = 1.455 ms is lower).
    /// - gpu: projections + FFN; each micro-batch re-reads the layer's weights from HBM:
    ///   14 * 2,902,540,288 / 300e9 = 135.45 ms (compute: 504 tokens * 2 * (1,451,270,144
    ///   minus 6 experts * 3 * 4096 * 14336) = 504 * 2 * 394,305,536 = 3.975e11 / 65e12 =
    ///   6.1 ms is lower).
    ///
    /// So T = 181.67 ms, bound by comm; 32 layers -> 5.813 s per step of 504 tokens =
    /// 86.70 tokens/s decode-only, an upper bound above the 30.12 tokens/s Tab. 5 measured
    /// end to end (prefill included).
    #[test]
    fn tab5_policy_layer_bound_on_t4_by_hand() {
        let hw = HardwareProfile::load("t4").unwrap();
        let layer_weight_bytes = 2_902_540_288.0;
        let work = LayerWork {
            host_to_gpu_bytes: layer_weight_bytes + 504.0 * 4096.0 * 2.0,
            gpu_to_host_bytes: 504.0 * 6144.0 * 2.0,
            disk_bytes: 0.0,
            gpu: vec![ComputeLoad {
                processor: Processor::Gpu,
                dtype: ComputeDtype::Half,
                flops: 504.0 * 2.0 * 394_305_536.0,
                bytes: vec![(Level::Gpu, 14.0 * layer_weight_bytes)],
            }],
            cpu: vec![ComputeLoad {
                processor: Processor::Cpu,
                dtype: ComputeDtype::F32,
                flops: 504.0 * 4.0 * 4096.0 * 141.0,
                bytes: vec![(Level::Host, 291_078_144.0)],
            }],
        };
        let bound = moe_lightning_layer_bound(&hw, &work);
        assert_eq!(bound.bottleneck, "comm");
        assert!((bound.comm_seconds - 0.181_666_816).abs() < 1e-12);
        assert!((bound.cpu_seconds - 291_078_144.0 / 100e9).abs() < 1e-12);
        assert!((bound.gpu_seconds - 14.0 * layer_weight_bytes / 300e9).abs() < 1e-12);
        let tokens_per_s = 504.0 / (32.0 * bound.layer_seconds);
        assert!((tokens_per_s - 86.697).abs() < 0.001, "{tokens_per_s}");
    }

    /// A half-duplex link serialises the two directions.
    #[test]
    fn half_duplex_adds_both_directions() {
        let mut hw = HardwareProfile::load("t4").unwrap();
        hw.links.duplex = false;
        let work = LayerWork {
            host_to_gpu_bytes: 16e9,
            gpu_to_host_bytes: 8e9,
            ..Default::default()
        };
        let bound = moe_lightning_layer_bound(&hw, &work);
        assert!((bound.comm_seconds - 1.5).abs() < 1e-12);
        assert_eq!(bound.comm_out_seconds, 0.0);
    }

    /// MoE-Lens §5.1: A40 (C_GPU = 150 TFLOPS, B = 32 GB/s), N_e = 8, N_k = 2:
    /// 150e12 / 32e9 * 8 / 2 = 18,750 tokens (the paper rounds this to "19.2k", which is
    /// what 150e12 / 31.25e9 * 4 gives).
    #[test]
    fn moe_lens_eq2_saturation_by_hand() {
        let n = moe_lens_saturating_tokens(150e12, 32e9, 8.0, 2.0);
        assert!((n - 18_750.0).abs() < 1e-6, "{n}");
    }

    /// MoE-Lens eq. 3-4 by hand for Mixtral-8x7B on the a40-16gb profile, MTBench-like
    /// p = 77, g = 128, a 70 GB KV cache (its smallest setting):
    /// PME = 2 * 205 / (282 * 128) = 410 / 36,096 = 0.011358;
    /// KV per token = 32 layers * 2 * 8 heads * 128 * 2 B = 131,072 B, so M = 70e9 /
    /// 131,072 = 534,058 slots; delta = 93.4e9 B / 19.5e9 = 4.790 s;
    /// PME * M / delta = 0.011358 * 534,058 / 4.790 = 1266.4 tokens/s, below T_GPU =
    /// 150e12 / (2 * 12.9e9 active params) = 5814 tokens/s: capacity-bound.
    #[test]
    fn moe_lens_stage1_by_hand() {
        let bound = moe_lens_stage1(&Stage1Inputs {
            prompt_len: 77.0,
            gen_len: 128.0,
            streamed_weight_bytes: 93.4e9,
            kv_capacity_tokens: 70e9 / 131_072.0,
            link_bandwidth: 19.5e9,
            gpu_tokens_per_s: 150e12 / (2.0 * 12.9e9),
        });
        assert!((bound.pme - 410.0 / 36_096.0).abs() < 1e-12);
        assert!((bound.delta_seconds - 4.7897).abs() < 1e-4);
        assert!(
            (bound.tokens_per_s - 1266.4).abs() < 0.1,
            "{}",
            bound.tokens_per_s
        );
        assert_eq!(bound.bottleneck, "kv_capacity");
    }

    /// Klotski eq. 4 by hand: t_cA = 10 ms, t_cG = 1 ms, hot experts 30 ms, cold 40 ms for
    /// len(Q) = 4, K = 2, t_IO_A = 20 ms, t_IO_G = 2 ms, t_IO_E = 50 ms.
    /// (I) n >= 2 / 10 -> 1; (II) 11 n >= 2 + 100 -> n >= 9.27 -> 10;
    /// (III) 11 n + 30 >= 152 -> n >= 11.09 -> 12; (IV) 11 n + 70 >= 2 + 300 + 20 -> n >=
    /// 22.9 -> 23. So n = 23.
    #[test]
    fn klotski_eq4_by_hand() {
        let n = klotski_min_batches(&KlotskiTimes {
            attn: 0.010,
            gate: 0.001,
            hot_experts: 0.030,
            cold_experts: 0.040,
            cold_count: 4.0,
            hot_count: 2.0,
            io_attn: 0.020,
            io_gate: 0.002,
            io_expert: 0.050,
        });
        assert_eq!(n, Some(23));
    }
}
