//! Hardware profiles: the machine a schedule is costed for, as plain data.
//!
//! Takes a profile name (built-in, embedded from `hardware/*.ron` so the binary needs no
//! files) or a path to a `.ron` file; gives a validated [`HardwareProfile`] with capacity,
//! bandwidth and peak FLOP/s per level and engine, in SI units through its accessors.
//! Guarantees every number the cost model divides by is finite and positive. The RON files
//! keep human units (GB, GB/s, TFLOPS) and cite the source of every number.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Bytes in the decimal gigabyte the datasheets and papers use.
pub const GB: f64 = 1e9;
/// FLOP/s in one TFLOPS.
pub const TFLOPS: f64 = 1e12;

/// The GPU side of a profile. With `count > 1` the GPUs form one tensor-parallel group
/// (MoE-Lightning §4.3) and the accessors aggregate memory, bandwidth and FLOP/s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// Marketing name.
    pub model: String,
    /// GPUs in the tensor-parallel group.
    pub count: u32,
    /// Memory per GPU, GB.
    pub mem_gb: f64,
    /// Share of `mem_gb` a schedule may plan for (driver, context, allocator slack).
    pub usable_fraction: f64,
    /// Device memory bandwidth per GPU, GB/s.
    pub mem_bw_gb_s: f64,
    /// Peak FP32 FLOP/s per GPU, TFLOPS.
    pub f32_tflops: f64,
    /// Peak FP16/BF16 tensor FLOP/s per GPU (dense), TFLOPS.
    pub half_tflops: f64,
}

/// The host side: CPU cores and DRAM (pageable and page-locked share the same DRAM).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuSpec {
    /// Marketing name or description.
    pub model: String,
    /// Physical cores available to the schedule.
    pub cores: u32,
    /// Host DRAM, GB (pageable and pinned buffers together).
    pub mem_gb: f64,
    /// Most page-locked memory the host allows, GB.
    pub pinned_gb: f64,
    /// Share of `mem_gb` a schedule may plan for.
    pub usable_fraction: f64,
    /// Sustained DRAM bandwidth with all cores, GB/s.
    pub mem_bw_gb_s: f64,
    /// Peak FP32 FLOP/s of all cores, TFLOPS.
    pub f32_tflops: f64,
    /// Peak FLOP/s for half-precision inputs (same as FP32 on CPUs without AMX), TFLOPS.
    pub half_tflops: f64,
}

/// Copy paths between the levels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// Pinned host memory to GPU, per GPU, GB/s.
    pub host_to_gpu_gb_s: f64,
    /// GPU to pinned host memory, per GPU, GB/s.
    pub gpu_to_host_gb_s: f64,
    /// Whether the two directions run at full speed at the same time (PCIe is full duplex).
    pub duplex: bool,
    /// Pageable host memory to GPU (staged by the driver), per GPU, GB/s.
    pub pageable_to_gpu_gb_s: f64,
    /// Pageable to pinned host memcpy (one copy thread), GB/s.
    pub pageable_to_pinned_gb_s: f64,
}

/// One machine: GPUs, host, and the links between them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HardwareProfile {
    /// Short name used on the command line (`--hw NAME`).
    pub name: String,
    /// One line for `moec hw`.
    pub description: String,
    /// The GPU(s).
    pub gpu: GpuSpec,
    /// The host CPU and DRAM.
    pub cpu: CpuSpec,
    /// Copy paths.
    pub links: LinkSpec,
    /// Fiddler's expert latency model for one model card, when `moec probe --model`
    /// measured it (gives the `lat.*` symbols).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<ExpertLatency>,
    /// Rates real kernels and copies reach on this machine, fitted or measured (the
    /// datasheet peaks above are what the HRM divides by unless [`Self::effective`] is
    /// asked for); each number cites its source in the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective: Option<EffectiveRates>,
    /// What the effective model adds to the HRM: fixed costs per task and per
    /// synchronisation, rates of op kinds slower than the roofline (GPU attention, KV
    /// stores), and whether the host's copies and CPU compute share one DRAM. Nothing in a
    /// datasheet profile; [`Self::effective`] fills it from `effective`.
    #[serde(default, skip_serializing_if = "Adjustments::is_none")]
    pub adjustments: Adjustments,
    /// Rates moec's own CPU kernels reach on this machine per op kind and rows per weight,
    /// measured by `moec probe` (micro-benchmarks, never fitted to end-to-end runs). When
    /// present the HRM charges each compute task at least its kernel time at these rates
    /// (see [`KernelRates`]); absent, the roofline alone stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<KernelRates>,
    /// What the runtime itself costs around the work (per task, per blocking cross-stream
    /// wait, per stream thread of a step), measured by `moec probe` on this machine or
    /// taken from a stated source; absent, the HRM charges no fixed costs beyond
    /// `adjustments`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<DispatchCosts>,
    /// The disk the checkpoint is read from (the `disk` level of a schedule with a
    /// `disk.read` stream): a datasheet's figures with their source, or what `moec probe`
    /// measured with direct reads. Absent, a disk read is charged infinite time: the
    /// prediction of a disk schedule then says the profile cannot answer it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskSpec>,
}

/// The `disk` level: direct reads (no page cache) from the drive holding the checkpoint.
/// The HRM charges a `disk.read` copy of `b` bytes `latency + b / B`, where `B` is
/// [`DiskSpec::read_gb_s`] for reads of at least [`LARGE_READ_BYTES`] and
/// [`DiskSpec::small_read_gb_s`] below that (several reads are in flight, so one request's
/// latency is paid once per task, not per request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskSpec {
    /// The drive, and where its figures come from.
    pub model: String,
    /// Read bandwidth with several large reads in flight (whole experts, layers), GB/s.
    pub read_gb_s: f64,
    /// Read bandwidth of small reads (pages under [`LARGE_READ_BYTES`]) with several in
    /// flight, GB/s.
    pub small_read_gb_s: f64,
    /// Time of one small read with nothing else in flight, microseconds.
    pub latency_us: f64,
    /// Read bandwidth with one large read in flight at a time, GB/s (reported; the HRM
    /// charges the parallel figure because the runtime keeps several reads in flight).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequential_read_gb_s: Option<f64>,
}

/// Reads at least this long run at [`DiskSpec::read_gb_s`]; shorter ones at
/// [`DiskSpec::small_read_gb_s`] (1 MiB: past it an NVMe drive's large-read bandwidth is
/// reached in its datasheet's sequential test, which uses 128 KiB to 1 MiB requests).
pub const LARGE_READ_BYTES: f64 = 1048576.0;

impl DiskSpec {
    /// Seconds to read `bytes` from the disk in one task: `latency + bytes / B`.
    pub fn read_seconds(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        let rate = if bytes >= LARGE_READ_BYTES {
            self.read_gb_s
        } else {
            self.small_read_gb_s
        };
        self.latency_us * 1e-6 + bytes / (rate * GB)
    }

    /// Every figure positive and finite.
    pub fn validate(&self) -> Result<(), String> {
        let figures = [
            ("disk.read_gb_s", self.read_gb_s),
            ("disk.small_read_gb_s", self.small_read_gb_s),
            ("disk.latency_us", self.latency_us),
            (
                "disk.sequential_read_gb_s",
                self.sequential_read_gb_s.unwrap_or(1.0),
            ),
        ];
        for (name, value) in figures {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!("`{name}` must be positive, got {value}"));
            }
        }
        Ok(())
    }
}

/// Fixed costs of the runtime that runs a schedule, independent of the work: what a
/// no-op task, a blocking wait and a step's stream threads cost. `moec probe` measures
/// them on this machine (`engine::dispatch`: no-op tasks through the real executor
/// and compute pool); a paper's profile may carry figures with their source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DispatchCosts {
    /// How the figures were obtained, one line.
    pub source: String,
    /// Added to every task that does work, microseconds.
    pub task_us: f64,
    /// Lost by a stream that blocks on another stream's event, from the record to the
    /// waiting stream running again, microseconds (charged only where the simulation
    /// finds the stream idle waiting for that event).
    pub wake_us: f64,
    /// Added to a step per stream that has work in it (its thread started and joined),
    /// microseconds.
    pub stream_thread_us: f64,
}

impl DispatchCosts {
    /// Checks every figure is finite and non-negative.
    pub fn validate(&self) -> Result<(), String> {
        for (name, value) in [
            ("task_us", self.task_us),
            ("wake_us", self.wake_us),
            ("stream_thread_us", self.stream_thread_us),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!(
                    "`dispatch.{name}` must be a non-negative number, got {value}"
                ));
            }
        }
        Ok(())
    }

    /// One line for reports.
    pub fn summary(&self) -> String {
        format!(
            "per task {:.1} us, per blocking wait {:.1} us, per stream thread of a step {:.1} us",
            self.task_us, self.wake_us, self.stream_thread_us
        )
    }
}

/// One measured point of a kernel's rate curve: how fast it streams its weights at a given
/// number of activation rows per weight matrix.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RowsRate {
    /// Activation rows multiplied by each weight matrix in the timed call.
    pub rows: u32,
    /// Weight bytes processed per second at that many rows, GB/s (a bf16 weight byte
    /// carries `rows` FLOPs, so GFLOP/s = `rows * weight_gb_s`).
    pub weight_gb_s: f64,
}

/// Effective rates of moec's own kernels on one machine, by op kind. The HRM's roofline
/// divides by the machine's streaming bandwidth and GEMM peak; moec's kernels reach less,
/// by an amount that depends on the rows per weight (a GEMV cannot hide its loads the way
/// a 256-row GEMM can). Each curve is a list of measured points, rows ascending.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelRates {
    /// How the points were measured (command, shapes, threads), one line.
    pub source: String,
    /// `Kernels::linear` on bf16 `[out, in]` matrices: the dense projections (Q/K/V, O,
    /// router, lm_head).
    pub linear: Vec<RowsRate>,
    /// One expert's SwiGLU FFN: `Kernels::linear_gated` over gate and up, then
    /// `Kernels::linear` over down, rows = tokens routed to the expert.
    pub expert_ffn: Vec<RowsRate>,
    /// Decode attention (one new token per sequence over its cached context): FLOP/s as
    /// the op catalog counts them (`4 x heads x head_dim x context` per token), GFLOP/s.
    pub attn_decode_gflops: f64,
    /// Prefill attention (causal over the prompt): FLOP/s as the op catalog counts them,
    /// GFLOP/s.
    pub attn_prefill_gflops: f64,
    /// One attention call at the smallest shape a step gives it (one sequence, one new
    /// token over a few dozen cached positions), microseconds: the floor of any attention
    /// task, which its FLOPs at the rates above put at a few microseconds while the call
    /// (the KV append, the split of the heads over the pool and the join) takes tens. 0
    /// when not measured (profiles written before it was).
    #[serde(default)]
    pub attn_call_us: f64,
    /// Decode attention's KV read rate over an f32 cache, GB/s: KV bytes over the time of
    /// a memory-bound decode call (one query head per kv head, 4,096 cached positions per
    /// sequence, caches far from L3). With [`KernelRates::attn_decode_peak_gflops`] it
    /// times a decode attention task as a roofline of the kernel as measured:
    /// `max(kv_bytes / rate, flops / peak)` (docs/cost-model.md). 0 when not measured
    /// (profiles written before it was: the FLOP rate above is used alone).
    #[serde(default)]
    pub attn_decode_kv_gb_s: f64,
    /// The same over a half cache (`--kv-type f16`), GB/s of half bytes.
    #[serde(default)]
    pub attn_decode_kv_f16_gb_s: f64,
    /// Decode attention's FLOP rate when its groups are wide (8 query heads per kv head
    /// over the same cache, half elements), GFLOP/s as the op catalog counts them: the
    /// compute roof of the model above.
    #[serde(default)]
    pub attn_decode_peak_gflops: f64,
    /// The same FLOP rate for MLA's latent attention (DeepSeek-V2/V3 on the CPU backend:
    /// 16 query heads over one 576-wide latent key, values its first 512 columns, half
    /// cache), GFLOP/s as the op catalog counts them. Its own roof: the group-8 rate above
    /// put DeepSeek-V2-Lite's decode attention at 8,192 positions at 62 ms a step where it
    /// took 115 (docs/performance.md, session 26). 0 when not measured (profiles written
    /// before it was: the group-8 rate is used).
    #[serde(default)]
    pub attn_decode_latent_gflops: f64,
    /// The quantised products (`QuantKernels`, weights in the layout the CPU backend
    /// computes from), one curve per weight format, GB/s of that format's bytes at each
    /// row count: a block format's cost per weight is its own (Q6_K's integer sums are not
    /// bf16's floats at 0.41x the bytes), most of all at prefill's rows, where the product
    /// is compute-bound. A tensor of a format without a curve is charged at the bf16
    /// curves above (said by [`KernelRates::summary`]). Empty in profiles written before
    /// they were measured.
    #[serde(default)]
    pub quant: Vec<QuantRates>,
}

/// One weight format's measured product rates ([`KernelRates::quant`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QuantRates {
    /// The format as ggml names it (`Q6_K`, `Q8_0`, ...).
    pub format: String,
    /// GB/s of the format's weight bytes at each row count, rows ascending.
    pub points: Vec<RowsRate>,
}

impl KernelRates {
    /// The measured curve of weight format `format` (ggml's name), if the profile has one.
    pub fn quant_curve(&self, format: &str) -> Option<&[RowsRate]> {
        self.quant
            .iter()
            .find(|q| q.format == format)
            .map(|q| q.points.as_slice())
    }

    /// Seconds of a product over weights made of `segments` (each a format's name, or
    /// `None` for floats, and its bytes) at `rows` rows per weight: each quantised
    /// segment at its format's curve ([`Self::quant_curve`]) and the rest at `fallback`
    /// (the op kind's bf16 curve), per byte ([`Self::seconds_per_weight_byte`]), in
    /// proportion to the segment's share of the segments' bytes, times `bytes` (the
    /// task's weight traffic, which may count more or fewer copies of the same segments).
    /// `None` when no segment has a curve of its own: the caller keeps `fallback` alone.
    pub fn seconds_by_format(
        &self,
        fallback: &[RowsRate],
        segments: &[(Option<&str>, f64)],
        bytes: f64,
        rows: f64,
    ) -> Option<f64> {
        let total: f64 = segments.iter().map(|s| s.1.max(0.0)).sum();
        let own = |f: &Option<&str>| f.and_then(|f| self.quant_curve(f));
        if total <= 0.0 || !segments.iter().any(|(f, b)| *b > 0.0 && own(f).is_some()) {
            return None;
        }
        let mut per_byte = 0.0;
        for (format, seg) in segments {
            let curve = own(format).unwrap_or(fallback);
            per_byte += Self::seconds_per_weight_byte(curve, rows)? * seg.max(0.0) / total;
        }
        Some(per_byte * bytes)
    }

    /// Seconds per weight byte on `curve` at `rows` rows per weight (`None` for an empty
    /// curve). Between two measured points the time per byte is interpolated linearly in
    /// rows (a kernel's time is a fixed streaming part plus a part per row); below the
    /// first point it is the first point's; above the last it grows in proportion to the
    /// rows (the last point's FLOP/s, as a compute-bound GEMM keeps).
    pub fn seconds_per_weight_byte(curve: &[RowsRate], rows: f64) -> Option<f64> {
        let per_byte = |p: &RowsRate| 1.0 / (p.weight_gb_s * GB);
        let first = curve.first()?;
        let last = curve.last()?;
        let rows = rows.max(0.0);
        if rows <= f64::from(first.rows) {
            return Some(per_byte(first));
        }
        if rows >= f64::from(last.rows) {
            return Some(per_byte(last) * rows / f64::from(last.rows));
        }
        let upper = curve.iter().position(|p| f64::from(p.rows) >= rows)?;
        let (a, b) = (&curve[upper.checked_sub(1)?], &curve[upper]);
        let span = f64::from(b.rows) - f64::from(a.rows);
        let t = if span > 0.0 {
            (rows - f64::from(a.rows)) / span
        } else {
            0.0
        };
        Some(per_byte(a) + t * (per_byte(b) - per_byte(a)))
    }

    /// One line per curve for reports: `linear 1 rows 10.1 GB/s (10 GFLOP/s), ...`, then the
    /// attention rates.
    pub fn summary(&self) -> Vec<String> {
        let curve = |name: &str, points: &[RowsRate]| {
            let text = points
                .iter()
                .map(|p| {
                    format!(
                        "{} rows {:.2} GB/s ({:.1} GFLOP/s)",
                        p.rows,
                        p.weight_gb_s,
                        p.weight_gb_s * f64::from(p.rows)
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            format!("{name:<11} {text}")
        };
        let mut lines = vec![
            curve("linear", &self.linear),
            curve("expert ffn", &self.expert_ffn),
            format!(
                "{:<11} decode {:.2} GFLOP/s, prefill {:.2} GFLOP/s, one call at least {:.1} us",
                "attention", self.attn_decode_gflops, self.attn_prefill_gflops, self.attn_call_us
            ),
            format!(
                "{:<11} decode KV read {:.2} GB/s (f32 cache), {:.2} GB/s (f16 cache), wide groups {:.2} GFLOP/s, MLA latent {:.2} GFLOP/s",
                "",
                self.attn_decode_kv_gb_s,
                self.attn_decode_kv_f16_gb_s,
                self.attn_decode_peak_gflops,
                self.attn_decode_latent_gflops
            ),
        ];
        for q in &self.quant {
            let text = q
                .points
                .iter()
                .map(|p| format!("{} rows {:.2} GB/s", p.rows, p.weight_gb_s))
                .collect::<Vec<_>>()
                .join(", ");
            lines.push(format!("{:<11} {text} (of {} bytes)", q.format, q.format));
        }
        lines.push(if self.quant.is_empty() {
            "quantised  no curve per format: quantised weights at the bf16 curves".to_string()
        } else {
            "quantised  formats without a curve above: at the bf16 curves".to_string()
        });
        lines
    }

    /// Seconds of a decode attention task reading `kv_bytes` of a cache of `kv_elem_bytes`
    /// elements for `flops` (the catalog's): the roofline of the measured kernel,
    /// `max(kv_bytes / read rate, flops / wide-group rate)`, the MLA latent rate for
    /// `latent` attention where it was measured; `None` when the profile has no KV read
    /// rate for that element type (it predates them).
    pub fn decode_attention_seconds(
        &self,
        kv_bytes: f64,
        kv_elem_bytes: u64,
        flops: f64,
        latent: bool,
    ) -> Option<f64> {
        let rate = match kv_elem_bytes {
            2 => self.attn_decode_kv_f16_gb_s,
            _ => self.attn_decode_kv_gb_s,
        };
        if !(rate.is_finite() && rate > 0.0) {
            return None;
        }
        let memory = kv_bytes.max(0.0) / (rate * GB);
        let peak = if latent && self.attn_decode_latent_gflops > 0.0 {
            self.attn_decode_latent_gflops
        } else {
            self.attn_decode_peak_gflops
        };
        let compute = if peak > 0.0 {
            flops.max(0.0) / (peak * 1e9)
        } else {
            0.0
        };
        Some(memory.max(compute))
    }

    /// Checks every rate is finite and positive and each curve's rows strictly ascend.
    pub fn validate(&self) -> Result<(), String> {
        let named = [("linear", &self.linear), ("expert_ffn", &self.expert_ffn)]
            .into_iter()
            .chain(self.quant.iter().map(|q| (q.format.as_str(), &q.points)));
        for (name, curve) in named {
            if let Some(p) = curve
                .iter()
                .find(|p| p.rows == 0 || !(p.weight_gb_s.is_finite() && p.weight_gb_s > 0.0))
            {
                return Err(format!(
                    "`kernels.{name}`: point at {} rows needs rows > 0 and a positive rate, got {}",
                    p.rows, p.weight_gb_s
                ));
            }
            if curve.windows(2).any(|w| w[0].rows >= w[1].rows) {
                return Err(format!("`kernels.{name}`: rows must strictly ascend"));
            }
        }
        for (name, value) in [
            ("attn_decode_gflops", self.attn_decode_gflops),
            ("attn_prefill_gflops", self.attn_prefill_gflops),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "`kernels.{name}` must be a positive number, got {value}"
                ));
            }
        }
        if !(self.attn_call_us.is_finite() && self.attn_call_us >= 0.0) {
            return Err(format!(
                "`kernels.attn_call_us` must be a number >= 0, got {}",
                self.attn_call_us
            ));
        }
        Ok(())
    }
}

/// Effective rates of one machine: what its kernels and copies sustain, as opposed to the
/// datasheet peaks. Every field is optional: an absent one keeps the datasheet number.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EffectiveRates {
    /// Where the numbers come from (paper, table, regression), one line.
    pub source: String,
    /// Half-precision GEMM rate the GPU sustains in prefill, TFLOPS (FlexGen's
    /// `mm_flops_p`); replaces the half peak.
    #[serde(default)]
    pub gpu_prefill_gemm_tflops: Option<f64>,
    /// GEMM rate in decode (a few rows per weight), TFLOPS (FlexGen's `mm_flops_g`).
    #[serde(default)]
    pub gpu_decode_gemm_tflops: Option<f64>,
    /// GPU attention rate in prefill, TFLOPS (FlexGen's `bmm_flops_p`).
    #[serde(default)]
    pub gpu_prefill_attn_tflops: Option<f64>,
    /// Device memory bandwidth GPU kernels sustain, GB/s.
    #[serde(default)]
    pub gpu_mem_bw_gb_s: Option<f64>,
    /// DRAM bandwidth CPU kernels (attention over the KV cache) sustain, GB/s.
    #[serde(default)]
    pub cpu_mem_bw_gb_s: Option<f64>,
    /// FLOP/s CPU attention sustains, TFLOPS.
    #[serde(default)]
    pub cpu_tflops: Option<f64>,
    /// Pinned host -> GPU copies, GB/s (FlexGen's `ctog_bdw`).
    #[serde(default)]
    pub host_to_gpu_gb_s: Option<f64>,
    /// GPU -> pinned host copies, GB/s (FlexGen's `gtoc_bdw`).
    #[serde(default)]
    pub gpu_to_host_gb_s: Option<f64>,
    /// Pageable -> pinned relay copies, GB/s.
    #[serde(default)]
    pub pageable_to_pinned_gb_s: Option<f64>,
    /// GPU attention rate in decode (batched matrix-vector products over the KV cache),
    /// TFLOPS (FlexGen's `bmm_flops_g`).
    #[serde(default)]
    pub gpu_decode_attn_tflops: Option<f64>,
    /// GPU -> host copies of the KV cache, GB/s (FlexGen's `gtoc_bdw_cache`: strided
    /// writes into the cache home are far slower than a contiguous copy).
    #[serde(default)]
    pub kv_store_gb_s: Option<f64>,
    /// Fixed cost of launching one task (kernel launch, Python dispatch), microseconds.
    #[serde(default)]
    pub task_overhead_us: f64,
    /// Fixed cost of one cross-stream wait (event record + wait), microseconds.
    #[serde(default)]
    pub sync_overhead_us: f64,
    /// Whether pageable <-> pinned copies and CPU compute contend for one DRAM (they do on
    /// every real host; MoE-Lens §7 measures it).
    #[serde(default)]
    pub shared_host_dram: bool,
}

/// What the effective model adds to the HRM: fixed costs, per-op-kind rate caps, host DRAM
/// sharing. Zero (no cap) fields change nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Adjustments {
    /// Seconds added to every task that does work.
    #[serde(default)]
    pub task_s: f64,
    /// Seconds added to a task for each stream other than its own it waits on.
    #[serde(default)]
    pub sync_s: f64,
    /// Pageable <-> pinned copies and CPU compute are one resource (one DRAM bus).
    #[serde(default)]
    pub shared_host_dram: bool,
    /// `gpu.compute` and `cpu.compute` are one resource: the GPU is emulated on the host's
    /// cores, and the CPU backend runs both engines' tasks in one shared pool.
    #[serde(default)]
    pub shared_compute: bool,
    /// FLOP/s caps of GPU work by kind (0: none): GEMM-like ops in decode, attention in
    /// prefill, attention in decode.
    #[serde(default)]
    pub gpu_decode_gemm_flops: f64,
    /// See `gpu_decode_gemm_flops`.
    #[serde(default)]
    pub gpu_prefill_attn_flops: f64,
    /// See `gpu_decode_gemm_flops`.
    #[serde(default)]
    pub gpu_decode_attn_flops: f64,
    /// Bytes/s of KV-cache copies GPU -> host; 0: the link's rate.
    #[serde(default)]
    pub kv_store_bytes_per_s: f64,
    /// Bytes/s of copies of weights, in place of the link's rate (0: the link's). The CPU
    /// backend binds weight copies (it moves labels, not bytes) while it still moves
    /// activations and KV at the memcpy rate, so a replay on this machine charges the two
    /// classes differently.
    #[serde(default)]
    pub weight_copy_bytes_per_s: f64,
    /// The device reads the host's checkpoint in place (registered with the driver,
    /// `runtime::cuda::host_weights`): a weight copy into a host level moves labels only
    /// (charged at `weight_copy_bytes_per_s`, the bound rate, when set), and a weight copy
    /// from any host level into the GPU is DMA out of page-locked memory, at the pinned
    /// link's rate (a pageable checkpoint would go at the pageable rate).
    #[serde(default)]
    pub registered_weights: bool,
}

impl Adjustments {
    /// True when nothing is added (the datasheet model).
    pub fn is_none(&self) -> bool {
        *self == Adjustments::default()
    }
}

/// Fiddler's latency model (§3.3: "these constants are determined in the initialization
/// phase"; the cppExpert code measures them at start-up): one expert of `model` on the CPU
/// per token, on the GPU at a small batch, and the copy of its weights host -> GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertLatency {
    /// The model card whose expert was timed.
    pub model: String,
    /// CPU time of one expert on one token, seconds (`cpu_lat(s) = s x this`).
    pub cpu_s_per_token: f64,
    /// GPU time of one expert at batch 4, seconds (flat in the batch, §3.3).
    pub gpu_s: f64,
    /// Time to copy one expert's weights to the GPU, seconds.
    pub copy_s: f64,
}

/// A memory level of the hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Level {
    /// GPU device memory.
    Gpu,
    /// Page-locked host memory.
    Pinned,
    /// Pageable host memory.
    Host,
    /// The disk holding the checkpoint (read only, by `disk.read` copies).
    Disk,
}

impl Level {
    /// Every level, in listing order.
    pub const ALL: [Level; 3] = [Level::Gpu, Level::Pinned, Level::Host];

    /// The name schedules use for the space.
    pub fn name(self) -> &'static str {
        match self {
            Level::Gpu => "gpu",
            Level::Pinned => "pinned",
            Level::Host => "host",
            Level::Disk => "disk",
        }
    }
}

/// A compute engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Processor {
    /// The GPU(s).
    Gpu,
    /// The host cores.
    Cpu,
}

/// Element type a computation runs in, to pick the right peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ComputeDtype {
    /// FP32 (the CPU backend's activations).
    F32,
    /// FP16/BF16 (tensor cores).
    Half,
}

const BUILTIN_PROFILES: &[(&str, &str)] = &[
    ("t4", include_str!("../../hardware/t4.ron")),
    ("l4", include_str!("../../hardware/l4.ron")),
    ("t4-x2", include_str!("../../hardware/t4-x2.ron")),
    ("t4-x4", include_str!("../../hardware/t4-x4.ron")),
    ("a40", include_str!("../../hardware/a40.ron")),
    ("a40-16gb", include_str!("../../hardware/a40-16gb.ron")),
    ("a40-24gb", include_str!("../../hardware/a40-24gb.ron")),
    ("a100-40gb", include_str!("../../hardware/a100-40gb.ron")),
    ("a100-80gb", include_str!("../../hardware/a100-80gb.ron")),
    (
        "a100-80gb-x2",
        include_str!("../../hardware/a100-80gb-x2.ron"),
    ),
    ("h100", include_str!("../../hardware/h100.ron")),
    ("h200", include_str!("../../hardware/h200.ron")),
    ("rtx3090", include_str!("../../hardware/rtx3090.ron")),
    (
        "quadro-rtx6000",
        include_str!("../../hardware/quadro-rtx6000.ron"),
    ),
];

/// Errors from finding or reading a hardware profile.
#[derive(Debug, thiserror::Error)]
pub enum HardwareError {
    /// Neither a built-in name nor a readable file.
    #[error("unknown hardware profile `{name}` (known: {known}); pass a built-in name or a path to a .ron profile")]
    Unknown {
        /// What the user asked for.
        name: String,
        /// Comma-separated built-in names.
        known: String,
    },
    /// The file could not be read.
    #[error("cannot read hardware profile {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying cause, as the library or the OS reported it.
        source: std::io::Error,
    },
    /// Not valid RON for a profile.
    #[error("hardware profile {origin} is malformed: {message}")]
    Parse {
        /// File or built-in name.
        origin: String,
        /// The RON error.
        message: String,
    },
    /// Parsed, but a number is unusable.
    #[error("hardware profile {origin} is invalid: {message}")]
    Invalid {
        /// File or built-in name.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

impl HardwareProfile {
    /// Names of the built-in profiles, in listing order.
    pub fn builtin_names() -> impl Iterator<Item = &'static str> {
        BUILTIN_PROFILES.iter().map(|(name, _)| *name)
    }

    /// All built-in profiles.
    pub fn builtins() -> Vec<HardwareProfile> {
        BUILTIN_PROFILES
            .iter()
            .map(|(name, text)| {
                Self::from_ron(text, name)
                    .unwrap_or_else(|e| panic!("built-in hardware profile {name}: {e}"))
            })
            .collect()
    }

    /// Finds a profile by built-in name, or reads it from a `.ron` path.
    pub fn load(name_or_path: &str) -> Result<HardwareProfile, HardwareError> {
        if let Some((name, text)) = BUILTIN_PROFILES.iter().find(|(n, _)| *n == name_or_path) {
            return Self::from_ron(text, name);
        }
        let path = Path::new(name_or_path);
        if path.extension().is_some_and(|e| e == "ron") || path.exists() {
            let text = crate::textfile::read_capped(path, crate::textfile::SOURCE_LIMIT).map_err(
                |source| HardwareError::Io {
                    path: path.display().to_string(),
                    source,
                },
            )?;
            return Self::from_ron(&text, &path.display().to_string());
        }
        Err(HardwareError::Unknown {
            name: name_or_path.to_string(),
            known: Self::builtin_names().collect::<Vec<_>>().join(", "),
        })
    }

    /// Parses and validates a profile from RON text; `origin` names it in errors.
    pub fn from_ron(text: &str, origin: &str) -> Result<HardwareProfile, HardwareError> {
        let profile: HardwareProfile = ron::from_str(text).map_err(|e| HardwareError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        profile
            .validate()
            .map_err(|message| HardwareError::Invalid {
                origin: origin.to_string(),
                message,
            })?;
        Ok(profile)
    }

    /// Renders the profile as RON (what `moec probe` writes).
    pub fn to_ron(&self) -> String {
        let config = ron::ser::PrettyConfig::new().struct_names(false);
        // Serialising plain structs of numbers and strings cannot fail.
        ron::ser::to_string_pretty(self, config).unwrap_or_default()
    }

    /// Checks every rate and capacity is finite and positive and fractions are in (0, 1].
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("gpu.mem_gb", self.gpu.mem_gb),
            ("gpu.mem_bw_gb_s", self.gpu.mem_bw_gb_s),
            ("gpu.f32_tflops", self.gpu.f32_tflops),
            ("gpu.half_tflops", self.gpu.half_tflops),
            ("cpu.mem_gb", self.cpu.mem_gb),
            ("cpu.pinned_gb", self.cpu.pinned_gb),
            ("cpu.mem_bw_gb_s", self.cpu.mem_bw_gb_s),
            ("cpu.f32_tflops", self.cpu.f32_tflops),
            ("cpu.half_tflops", self.cpu.half_tflops),
            ("links.host_to_gpu_gb_s", self.links.host_to_gpu_gb_s),
            ("links.gpu_to_host_gb_s", self.links.gpu_to_host_gb_s),
            (
                "links.pageable_to_gpu_gb_s",
                self.links.pageable_to_gpu_gb_s,
            ),
            (
                "links.pageable_to_pinned_gb_s",
                self.links.pageable_to_pinned_gb_s,
            ),
        ];
        if let Some((name, value)) = positive.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            return Err(format!("`{name}` must be a positive number, got {value}"));
        }
        for (name, value) in [
            ("gpu.usable_fraction", self.gpu.usable_fraction),
            ("cpu.usable_fraction", self.cpu.usable_fraction),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(format!("`{name}` must be in (0, 1], got {value}"));
            }
        }
        if self.gpu.count == 0 || self.cpu.cores == 0 {
            return Err("`gpu.count` and `cpu.cores` must be positive".to_string());
        }
        if let Some(kernels) = &self.kernels {
            kernels.validate()?;
        }
        if let Some(dispatch) = &self.dispatch {
            dispatch.validate()?;
        }
        if let Some(disk) = &self.disk {
            disk.validate()?;
        }
        if self.cpu.pinned_gb > self.cpu.mem_gb {
            return Err(format!(
                "`cpu.pinned_gb` ({}) exceeds `cpu.mem_gb` ({}): pinned memory is host DRAM",
                self.cpu.pinned_gb, self.cpu.mem_gb
            ));
        }
        Ok(())
    }

    /// Total capacity of a level in bytes (all GPUs for `Gpu`; `Pinned` is the lock limit,
    /// `Host` the whole DRAM, which pinned buffers also occupy).
    pub fn capacity_bytes(&self, level: Level) -> f64 {
        match level {
            Level::Gpu => self.gpu.mem_gb * GB * f64::from(self.gpu.count),
            Level::Pinned => self.cpu.pinned_gb * GB,
            Level::Host => self.cpu.mem_gb * GB,
            // The checkpoint's drive: no buffer is placed there, so no budget.
            Level::Disk => f64::INFINITY,
        }
    }

    /// Bytes of a level a schedule may plan for: capacity times the usable share.
    pub fn budget_bytes(&self, level: Level) -> f64 {
        match level {
            Level::Gpu => self.capacity_bytes(level) * self.gpu.usable_fraction,
            Level::Pinned | Level::Host => self.capacity_bytes(level) * self.cpu.usable_fraction,
            Level::Disk => f64::INFINITY,
        }
    }

    /// Bandwidth of the processor next to a level reading it, bytes/s (B^i in eq. 5).
    pub fn level_bandwidth(&self, level: Level) -> f64 {
        match level {
            Level::Gpu => self.gpu.mem_bw_gb_s * GB * f64::from(self.gpu.count),
            Level::Pinned | Level::Host => self.cpu.mem_bw_gb_s * GB,
            Level::Disk => self.disk.as_ref().map_or(0.0, |d| d.read_gb_s * GB),
        }
    }

    /// Peak FLOP/s of a processor for a dtype (P^i in eq. 4).
    pub fn peak_flops(&self, processor: Processor, dtype: ComputeDtype) -> f64 {
        match (processor, dtype) {
            (Processor::Gpu, ComputeDtype::F32) => {
                self.gpu.f32_tflops * TFLOPS * f64::from(self.gpu.count)
            }
            (Processor::Gpu, ComputeDtype::Half) => {
                self.gpu.half_tflops * TFLOPS * f64::from(self.gpu.count)
            }
            (Processor::Cpu, ComputeDtype::F32) => self.cpu.f32_tflops * TFLOPS,
            (Processor::Cpu, ComputeDtype::Half) => self.cpu.half_tflops * TFLOPS,
        }
    }

    /// Bandwidth of a copy from one level to another, bytes/s (B^{j,i} in eq. 6). A copy
    /// within one level runs at half the level's bandwidth (each byte is read and written).
    pub fn link_bandwidth(&self, from: Level, to: Level) -> f64 {
        let gpus = f64::from(self.gpu.count);
        match (from, to) {
            (Level::Pinned, Level::Gpu) => self.links.host_to_gpu_gb_s * GB * gpus,
            (Level::Host, Level::Gpu) => self.links.pageable_to_gpu_gb_s * GB * gpus,
            (Level::Gpu, Level::Pinned) | (Level::Gpu, Level::Host) => {
                self.links.gpu_to_host_gb_s * GB * gpus
            }
            (Level::Host, Level::Pinned) | (Level::Pinned, Level::Host) => {
                self.links.pageable_to_pinned_gb_s * GB
            }
            (Level::Gpu, Level::Gpu) => self.level_bandwidth(Level::Gpu) / 2.0,
            (Level::Host, Level::Host) | (Level::Pinned, Level::Pinned) => {
                self.level_bandwidth(Level::Host) / 2.0
            }
            // Only `disk.read` copies reach the disk (into host memory), charged by
            // `DiskSpec::read_seconds`; this is its large-read rate.
            (Level::Disk, _) | (_, Level::Disk) => self.level_bandwidth(Level::Disk),
        }
    }

    /// This profile with its [`EffectiveRates`] in place of the datasheet numbers and its
    /// overheads applied; the profile itself when it has none. The name gains `+eff`.
    pub fn effective(&self) -> HardwareProfile {
        let Some(rates) = &self.effective else {
            return self.clone();
        };
        let mut out = self.clone();
        let set = |slot: &mut f64, value: Option<f64>| {
            if let Some(v) = value.filter(|v| v.is_finite() && *v > 0.0) {
                *slot = v;
            }
        };
        set(&mut out.gpu.half_tflops, rates.gpu_prefill_gemm_tflops);
        set(&mut out.gpu.mem_bw_gb_s, rates.gpu_mem_bw_gb_s);
        set(&mut out.cpu.mem_bw_gb_s, rates.cpu_mem_bw_gb_s);
        set(&mut out.cpu.f32_tflops, rates.cpu_tflops);
        set(&mut out.cpu.half_tflops, rates.cpu_tflops);
        set(&mut out.links.host_to_gpu_gb_s, rates.host_to_gpu_gb_s);
        set(&mut out.links.gpu_to_host_gb_s, rates.gpu_to_host_gb_s);
        set(
            &mut out.links.pageable_to_pinned_gb_s,
            rates.pageable_to_pinned_gb_s,
        );
        // A pageable source is staged by the driver: never faster than a pinned one.
        out.links.pageable_to_gpu_gb_s = out
            .links
            .pageable_to_gpu_gb_s
            .min(out.links.host_to_gpu_gb_s);
        let tflops =
            |v: Option<f64>| v.filter(|v| v.is_finite() && *v > 0.0).unwrap_or(0.0) * TFLOPS;
        out.adjustments = Adjustments {
            task_s: rates.task_overhead_us.max(0.0) * 1e-6,
            sync_s: rates.sync_overhead_us.max(0.0) * 1e-6,
            shared_host_dram: rates.shared_host_dram,
            shared_compute: self.adjustments.shared_compute,
            gpu_decode_gemm_flops: tflops(rates.gpu_decode_gemm_tflops),
            gpu_prefill_attn_flops: tflops(rates.gpu_prefill_attn_tflops),
            gpu_decode_attn_flops: tflops(rates.gpu_decode_attn_tflops),
            kv_store_bytes_per_s: rates.kv_store_gb_s.filter(|v| *v > 0.0).unwrap_or(0.0) * GB,
            weight_copy_bytes_per_s: self.adjustments.weight_copy_bytes_per_s,
            registered_weights: self.adjustments.registered_weights,
        };
        out.name = format!("{}+eff", self.name);
        out
    }

    /// This profile with pinned host -> GPU copies at the pageable rate: what a schedule
    /// gets when its pinned buffers exceed what the host lets it lock (the frameworks fall
    /// back to pageable memory; FlexGen's `pin_weight` silently does).
    pub fn pageable_fallback(&self) -> HardwareProfile {
        let mut out = self.clone();
        out.links.host_to_gpu_gb_s = out.links.pageable_to_gpu_gb_s;
        out.links.gpu_to_host_gb_s = out
            .links
            .gpu_to_host_gb_s
            .min(out.links.pageable_to_gpu_gb_s);
        out
    }

    /// Hardware symbols a schedule may use (`gpu.mem`, ...), in bytes, bytes/s and FLOP/s.
    pub fn symbols(&self) -> Vec<(&'static str, f64)> {
        let mut symbols = vec![
            ("gpu.mem", self.budget_bytes(Level::Gpu)),
            ("gpu.count", f64::from(self.gpu.count)),
            ("gpu.bw", self.level_bandwidth(Level::Gpu)),
            (
                "gpu.flops",
                self.peak_flops(Processor::Gpu, ComputeDtype::Half),
            ),
            ("pinned.mem", self.budget_bytes(Level::Pinned)),
            ("host.mem", self.budget_bytes(Level::Host)),
            ("host.bw", self.level_bandwidth(Level::Host)),
            ("cpu.cores", f64::from(self.cpu.cores)),
            (
                "cpu.flops",
                self.peak_flops(Processor::Cpu, ComputeDtype::F32),
            ),
            ("link.h2d", self.link_bandwidth(Level::Pinned, Level::Gpu)),
            ("link.d2h", self.link_bandwidth(Level::Gpu, Level::Pinned)),
        ];
        if let Some(lat) = &self.latency {
            symbols.extend([
                ("lat.cpu_token", lat.cpu_s_per_token),
                ("lat.gpu", lat.gpu_s),
                ("lat.transfer", lat.copy_s),
            ]);
        }
        symbols
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode attention task is the roofline of the measured kernel, worked by hand: 1 GB
    /// of half KV at 10 GB/s is 0.1 s, 20 GFLOP at the group-8 roof of 100 GFLOP/s 0.2 s,
    /// at the latent roof of 50 GFLOP/s 0.4 s; a profile without the latent rate (0) keeps
    /// the group-8 roof for latent attention; one without the f16 read rate has no answer.
    #[test]
    fn decode_attention_takes_the_latent_roof_for_latent_attention() {
        let mut k = KernelRates {
            attn_decode_kv_f16_gb_s: 10.0,
            attn_decode_peak_gflops: 100.0,
            attn_decode_latent_gflops: 50.0,
            ..KernelRates::default()
        };
        let at = |k: &KernelRates, flops: f64, latent| {
            k.decode_attention_seconds(1e9, 2, flops, latent).unwrap()
        };
        assert!((at(&k, 20e9, false) - 0.2).abs() < 1e-12);
        assert!((at(&k, 20e9, true) - 0.4).abs() < 1e-12);
        assert!((at(&k, 1e9, true) - 0.1).abs() < 1e-12, "bytes-bound");
        k.attn_decode_latent_gflops = 0.0;
        assert!((at(&k, 20e9, true) - 0.2).abs() < 1e-12);
        assert_eq!(k.decode_attention_seconds(1e9, 4, 20e9, true), None);
    }

    #[test]
    fn every_builtin_profile_parses_and_validates() {
        let profiles = HardwareProfile::builtins();
        assert_eq!(profiles.len(), BUILTIN_PROFILES.len());
        for (profile, (name, _)) in profiles.iter().zip(BUILTIN_PROFILES) {
            assert_eq!(profile.name, *name, "file name and `name` field agree");
        }
    }

    #[test]
    fn tensor_parallel_profiles_aggregate_gpu_resources() {
        let one = HardwareProfile::load("t4").unwrap();
        let four = HardwareProfile::load("t4-x4").unwrap();
        assert_eq!(
            four.capacity_bytes(Level::Gpu),
            4.0 * one.capacity_bytes(Level::Gpu)
        );
        assert_eq!(four.level_bandwidth(Level::Gpu), 4.0 * 300e9);
        assert_eq!(four.link_bandwidth(Level::Pinned, Level::Gpu), 4.0 * 16e9);
    }

    #[test]
    fn round_trips_through_ron() {
        let l4 = HardwareProfile::load("l4").unwrap();
        let again = HardwareProfile::from_ron(&l4.to_ron(), "round trip").unwrap();
        assert_eq!(l4, again);
    }

    #[test]
    fn rejects_zero_bandwidth_and_unknown_names() {
        let mut bad = HardwareProfile::load("t4").unwrap();
        bad.links.host_to_gpu_gb_s = 0.0;
        let err = HardwareProfile::from_ron(&bad.to_ron(), "bad")
            .unwrap_err()
            .to_string();
        assert!(err.contains("host_to_gpu_gb_s"), "{err}");
        let err = HardwareProfile::load("tpu-v9").unwrap_err().to_string();
        assert!(err.contains("t4") && err.contains("h200"), "{err}");
    }
}
