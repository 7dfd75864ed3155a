//! What a device backend's GPU probe measures (`moec probe --backend <name>`), in terms no
//! backend owns: the sizes it times at and the figures it gives.
//!
//! Takes nothing; gives [`GpuProbeSizes`] (what to time) and [`GpuProbe`] (what the
//! backend sustains on its device), which a backend's registration entry
//! (`runtime::registration::Registration::probe`) produces and `engine::gpu_probe` turns
//! into a hardware profile. Here, apart from the backend that measures them, so the CLI and
//! the engine read a probe without importing a backend.

/// The shapes the probe times at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GpuProbeSizes {
    /// Input features of the projection (a model's hidden width).
    pub hidden: usize,
    /// Output features of the projection (an expert's FFN width).
    pub ffn: usize,
    /// Rows of the decode points (each at most the few-row path's 16).
    pub decode_rows: [usize; 3],
    /// Rows of the prefill GEMM.
    pub prefill_rows: usize,
    /// Attention geometry: query heads, KV heads, head dimension.
    pub attn_heads: (usize, usize, usize),
    /// Decode attention: sequences, cached positions each.
    pub decode_attn: (usize, usize),
    /// Prefill attention: sequences, prompt tokens each (causal).
    pub prefill_attn: (usize, usize),
    /// Bytes of each copy.
    pub copy_bytes: usize,
    /// Back-to-back launches (and event round trips) of the fixed-cost figures.
    pub launches: usize,
    /// Timed repetitions of each figure (the best is kept), after one untimed.
    pub reps: usize,
}

impl GpuProbeSizes {
    /// `moec probe --backend cuda` on a real GPU: Mixtral-8x7B's expert projection
    /// (4096 x 14336 bf16, 117 MB: more than an H100's or H200's L2, so the decode points
    /// stream it from device memory), a 2048-row prefill GEMM on it, Mixtral's attention
    /// geometry (32 query heads, 8 KV heads of 128) at 64 sequences x 2048 cached
    /// positions (decode, 537 MB of KV) and 4 prompts of 1024 tokens (prefill), 256 MiB
    /// copies and 2000 launches.
    pub const FULL: GpuProbeSizes = GpuProbeSizes {
        hidden: 4096,
        ffn: 14336,
        decode_rows: [1, 4, 16],
        prefill_rows: 2048,
        attn_heads: (32, 8, 128),
        decode_attn: (64, 2048),
        prefill_attn: (4, 1024),
        copy_bytes: 256 << 20,
        launches: 2000,
        reps: 5,
    };
    /// The same figures at sizes the stand-in driver (a CPU emulation) runs in a second:
    /// for tests of this code path, never for a profile.
    pub const TINY: GpuProbeSizes = GpuProbeSizes {
        hidden: 64,
        ffn: 96,
        decode_rows: [1, 4, 16],
        prefill_rows: 32,
        attn_heads: (4, 2, 16),
        decode_attn: (3, 40),
        prefill_attn: (2, 24),
        copy_bytes: 1 << 20,
        launches: 16,
        reps: 2,
    };
}

/// One decode point: a projection of `rows` rows.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GemvPoint {
    /// Activation rows.
    pub rows: usize,
    /// Seconds per call.
    pub seconds: f64,
    /// Weight bytes read per second.
    pub weight_bytes_per_s: f64,
    /// FLOP/s (`2 x rows x out x in` per call).
    pub flops: f64,
}

/// What the CUDA backend sustains on this device.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuProbe {
    /// The device's name.
    pub device: String,
    /// The architecture the kernels were compiled for (`sm_XY`).
    pub arch: &'static str,
    /// Device memory, bytes.
    pub total_mem_bytes: u64,
    /// The sizes timed.
    pub sizes: GpuProbeSizes,
    /// Device-to-device copy: bytes read plus bytes written per second.
    pub device_copy_bytes_per_s: f64,
    /// The decode projection at each of `sizes.decode_rows`.
    pub decode: Vec<GemvPoint>,
    /// The prefill GEMM, FLOP/s.
    pub prefill_gemm_flops: f64,
    /// Decode attention (KV append, then one query per sequence), FLOP/s as the op
    /// catalog counts them (`4 x q_width x context` per sequence).
    pub decode_attn_flops: f64,
    /// Prefill attention (causal over each prompt), FLOP/s as the catalog counts them
    /// (`4 x q_width x c (c + 1) / 2` per sequence).
    pub prefill_attn_flops: f64,
    /// Pinned host -> device, bytes per second.
    pub host_to_device_pinned: f64,
    /// Device -> pinned host, bytes per second.
    pub device_to_host_pinned: f64,
    /// Pageable host -> device (the driver stages it), bytes per second.
    pub host_to_device_pageable: f64,
    /// One kernel launch when launches are back to back (a launch-bound stream's cost per
    /// launch), seconds.
    pub launch_s: f64,
    /// One cross-stream dependency: an event recorded on one stream and waited on by
    /// another, each side a one-block kernel, per round trip minus two launches, seconds.
    pub event_wait_s: f64,
}

impl GpuProbe {
    /// The figures as lines for a person.
    pub fn summary(&self) -> Vec<String> {
        let gb = |b: f64| b / 1e9;
        let mut lines = vec![
            format!(
                "device {} ({}), {:.1} GB",
                self.device,
                self.arch,
                gb(self.total_mem_bytes as f64)
            ),
            format!(
                "device memory (copy, read + write)  {:>9.1} GB/s",
                gb(self.device_copy_bytes_per_s)
            ),
        ];
        for p in &self.decode {
            lines.push(format!(
                "projection {} rows x {}x{} bf16       {:>9.1} GB/s of weights, {:.2} TFLOP/s ({:.1} us)",
                p.rows,
                self.sizes.ffn,
                self.sizes.hidden,
                gb(p.weight_bytes_per_s),
                p.flops / 1e12,
                p.seconds * 1e6
            ));
        }
        let (heads, kv, dim) = self.sizes.attn_heads;
        lines.extend([
            format!(
                "prefill GEMM {} rows                {:>9.1} TFLOP/s",
                self.sizes.prefill_rows,
                self.prefill_gemm_flops / 1e12
            ),
            format!(
                "decode attention {} seqs x {} ({heads}/{kv} heads of {dim})  {:.2} TFLOP/s",
                self.sizes.decode_attn.0,
                self.sizes.decode_attn.1,
                self.decode_attn_flops / 1e12
            ),
            format!(
                "prefill attention {} x {} tokens     {:>9.2} TFLOP/s",
                self.sizes.prefill_attn.0,
                self.sizes.prefill_attn.1,
                self.prefill_attn_flops / 1e12
            ),
            format!(
                "pinned -> device / device -> pinned {:>9.1} / {:.1} GB/s",
                gb(self.host_to_device_pinned),
                gb(self.device_to_host_pinned)
            ),
            format!(
                "pageable -> device                  {:>9.1} GB/s",
                gb(self.host_to_device_pageable)
            ),
            format!(
                "kernel launch (back to back)        {:>9.2} us",
                self.launch_s * 1e6
            ),
            format!(
                "cross-stream event wait             {:>9.2} us",
                self.event_wait_s * 1e6
            ),
        ]);
        lines
    }
}
