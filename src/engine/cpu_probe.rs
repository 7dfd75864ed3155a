//! Times this machine for a hardware profile: its memory, and moec's own CPU kernels per
//! op kind.
//!
//! Takes a buffer size, a thread count and a [`ProbeEffort`]; gives the measured DRAM read
//! bandwidth (a streaming sum on all cores), memcpy bandwidth (one thread, as one copy
//! stream of the CPU backend does it) and f32 GEMM FLOP/s (through the `gemm` crate the
//! kernels use, all cores) as [`Measurements`], and the rates of the `math` kernels the
//! runtime calls as [`KernelRates`]. Each figure is the best (or the median) of several
//! timed repetitions after a warm-up, so it estimates what the machine sustains rather
//! than one lucky or unlucky pass. No GPU is involved: the profile describes the CPU
//! backend's emulated GPU (`cost::probe::profile_from_measurements`, the pure half, which
//! stays with the cost model; this half runs kernels, so it lives above the compiler).

use crate::cost::hardware::{
    ExpertLatency, HardwareProfile, KernelRates, QuantRates, RowsRate, GB,
};
use crate::cost::probe::{profile_from_measurements, Measurements};
use rayon::prelude::*;
use std::time::Instant;

/// Errors from probing.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The rayon pool could not be built.
    #[error("cannot start {threads} probe threads: {message}")]
    Threads {
        /// Requested threads.
        threads: usize,
        /// The underlying cause, as the library or the OS reported it.
        message: String,
    },
    /// A size was zero or too small to time.
    #[error("probe buffer of {0} bytes is too small (need at least 1 MiB)")]
    TooSmall(usize),
    /// A synthetic expert matrix could not be viewed (a card with inconsistent sizes).
    #[error("cannot build the synthetic `{0}` matrix of the expert to time")]
    Expert(&'static str),
    /// The expert kernel refused its inputs.
    #[error("the expert kernel failed: {0}")]
    Kernel(String),
}

/// Best of `reps` timings of `f` after one warm-up call, in seconds.
fn best_seconds(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// The median of `times` (the mean of the middle two for an even count; 0 if empty).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    let mid = times.len() / 2;
    match times.len() {
        0 => 0.0,
        n if n % 2 == 1 => times[mid],
        _ => (times[mid - 1] + times[mid]) / 2.0,
    }
}

/// A rayon pool of `threads` threads for the probe's parallel kernels.
fn probe_pool(threads: usize) -> Result<rayon::ThreadPool, ProbeError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| ProbeError::Threads {
            threads,
            message: e.to_string(),
        })
}

/// Parallel streaming read of `data` on the current rayon pool's threads (what `moec
/// probe` times for its streaming bandwidth): each thread sums its chunks with independent
/// accumulators so the loads, not the adds, set the pace. Returns the sum, which the
/// caller must consume (`std::hint::black_box`) so the reads are not optimised away.
/// Public so a benchmark can time it beside a kernel over the same bytes and threads.
pub fn stream_read(data: &[f32]) -> f32 {
    data.par_chunks(1 << 16)
        .map(|chunk| {
            let mut acc = [0.0f32; 16];
            let mut lanes = chunk.chunks_exact(16);
            for lane in &mut lanes {
                for (a, x) in acc.iter_mut().zip(lane) {
                    *a += x;
                }
            }
            acc.iter().sum::<f32>() + lanes.remainder().iter().sum::<f32>()
        })
        .sum()
}

/// Square f32 GEMM `c = a * b` (row-major) through the `gemm` crate.
fn gemm_f32(size: usize, a: &[f32], b: &[f32], c: &mut [f32], threads: usize) {
    assert!(a.len() == size * size && b.len() == size * size && c.len() == size * size);
    let stride = size as isize;
    // SAFETY: the three slices each hold size*size f32 (asserted above), so every index
    // the kernel forms from m = n = k = size with row stride `size` and column stride 1
    // stays inside its slice; `c` is borrowed mutably and does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            size,
            size,
            size,
            c.as_mut_ptr(),
            1,
            stride,
            false,
            a.as_ptr(),
            1,
            stride,
            b.as_ptr(),
            1,
            stride,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(threads),
        );
    }
}

/// Runs the three kernels on `threads` threads with buffers of `buffer_bytes` each.
pub fn measure(buffer_bytes: usize, threads: usize) -> Result<Measurements, ProbeError> {
    if buffer_bytes < (1 << 20) {
        return Err(ProbeError::TooSmall(buffer_bytes));
    }
    let pool = probe_pool(threads)?;
    let elems = buffer_bytes / 4;
    let source: Vec<f32> = (0..elems).map(|i| (i % 1024) as f32 * 1e-3).collect();
    let mut sink = vec![0.0f32; elems];

    let mut checksum = 0.0f32;
    let read_seconds = pool.install(|| best_seconds(5, || checksum += stream_read(&source)));
    let copy_seconds = best_seconds(5, || sink.copy_from_slice(&source));
    std::hint::black_box((checksum, &sink));

    let gemm_size = 1024;
    let a: Vec<f32> = (0..gemm_size * gemm_size).map(|i| (i % 7) as f32).collect();
    let b: Vec<f32> = (0..gemm_size * gemm_size).map(|i| (i % 5) as f32).collect();
    let mut c = vec![0.0f32; gemm_size * gemm_size];
    let gemm_seconds =
        pool.install(|| best_seconds(3, || gemm_f32(gemm_size, &a, &b, &mut c, threads)));
    std::hint::black_box(&c);

    let bytes = (elems * 4) as f64;
    Ok(Measurements {
        threads,
        buffer_bytes: elems * 4,
        stream_read_bytes_per_s: bytes / read_seconds,
        memcpy_bytes_per_s: bytes / copy_seconds,
        gemm_f32_flops: 2.0 * (gemm_size as f64).powi(3) / gemm_seconds,
        gemm_size,
        total_ram_bytes: crate::sysmem::total_bytes().unwrap_or(0),
    })
}

/// How many timed passes the kernel probe takes per point (it keeps the median).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeEffort {
    /// Passes per `linear` / `expert_ffn` point, round-robin over the points.
    pub kernel_reps: usize,
    /// Timed smallest attention calls.
    pub attn_call_reps: usize,
}

impl ProbeEffort {
    /// `moec probe`: the profile a replay table or a user's `--hw` file is made from.
    pub const FULL: ProbeEffort = ProbeEffort {
        kernel_reps: KERNEL_REPS,
        attn_call_reps: ATTN_CALL_REPS,
    };
    /// The probe `moec run` takes when no `--hw` is given: the same points with fewer
    /// passes (about a third of the time), since every such run pays it.
    pub const QUICK: ProbeEffort = ProbeEffort {
        kernel_reps: 3,
        attn_call_reps: 21,
    };
}

/// [`measure`] and [`measure_kernels`] on `threads` threads, made into this machine's
/// profile named `name` (what `moec probe` writes and `moec run` predicts with), with
/// the quantised product curves of `quant` (those of [`QUANT_FORMATS`] among them).
pub fn probe_profile(
    name: &str,
    buffer_bytes: usize,
    threads: usize,
    effort: ProbeEffort,
    quant: &[crate::quant::QuantFormat],
) -> Result<(Measurements, HardwareProfile), ProbeError> {
    let measured = measure(buffer_bytes, threads)?;
    let mut profile = profile_from_measurements(name, &measured);
    profile.kernels = Some(measure_kernels(threads, effort, quant)?);
    Ok((measured, profile))
}

/// The block formats `card` stores any tensor in, in any layer: the quantised curves a
/// run of it needs ([`probe_profile`]'s `quant`).
pub fn quant_formats_of(card: &crate::model::card::ModelCard) -> Vec<crate::quant::QuantFormat> {
    let f = &card.formats;
    let mut out: Vec<crate::quant::QuantFormat> = f
        .classes
        .values()
        .chain(f.tensors.values())
        .chain(f.layers.values().flat_map(|l| l.values()))
        .filter_map(|s| s.quant())
        .collect();
    out.sort_by_key(|q| q.name());
    out.dedup();
    out
}

/// Hidden width of the kernel probe's matrices (mixtral-mid's, the card this machine runs).
const KERNEL_HIDDEN: usize = 1024;
/// FFN width of the kernel probe's experts (mixtral-mid's).
const KERNEL_FFN: usize = 3584;
/// Experts the decode points stream through in turn: 6 x 3 x 1024 x 3584 bf16 = 132 MB,
/// four times a 32 MiB last-level cache (a batch-1 decode step's 6 active experts), so
/// every weight byte of a GEMV comes from DRAM. Two experts (44 MB) barely passed the
/// cache: the one-row rate then moved between 16 and 32 GB/s from one probe to the next.
const KERNEL_DECODE_EXPERTS: usize = 6;
/// Timed passes per kernel point, taken round-robin over the points after one untimed
/// pass of each; the probe keeps the median. Single passes over the DRAM-streamed
/// experts moved by up to 2x (the first point's first passes, measured under
/// `/work/quiet.sh`), and the best of two kept the lucky ones; a run calls each kernel
/// hundreds of times and pays the typical pass.
const KERNEL_REPS: usize = 7;
/// Rows per weight of the measured points: decode (1 to 16 tokens per matrix; 2 and 3
/// are the rows of a batch-1 prompt's projections and of an expert in a batch-16 step of
/// two micro-batches, where the time per byte is 5-10% above the line from 1 to 4 rows),
/// the rows a dense projection sees in a batch-64 decode step (64) and a prefill GEMM
/// (256).
const KERNEL_ROWS: [u32; 8] = [1, 2, 3, 4, 8, 16, 64, 256];
/// From this many rows a kernel is compute-bound (64 FLOPs per bf16 weight byte against
/// ~20 GB/s is ~1.3 TFLOP/s, far above the cores' peak), so where its weights live does
/// not matter: those points run on a narrower expert ([`KERNEL_COMPUTE_FFN`]) to stay
/// quick. Below it (8 and 16 rows: the tokens an expert meets in a batch-16 to batch-64
/// decode step) the kernel neither streams at DRAM speed nor computes at its peak, and a
/// cache-resident expert measured it too fast, so those points stream from DRAM too.
const KERNEL_COMPUTE_ROWS: u32 = 64;
/// FFN width of the compute-bound points' expert (1.5 MB of bf16 weights).
const KERNEL_COMPUTE_FFN: usize = 256;
/// Attention head geometry of the probe (mixtral-mid's: 16 query heads, 4 KV heads of 64).
const ATTN_HEADS: (usize, usize, usize) = (16, 4, 64);
/// Decode attention point: this many sequences, each one new token over this context.
const ATTN_DECODE: (usize, usize) = (16, 512);
/// Prefill attention point: one sequence's prompt of this many tokens, causal.
const ATTN_PREFILL_TOKENS: usize = 256;
/// The smallest attention call: one sequence, one new token over this many cached
/// positions (a batch-1 decode step on a short prompt). Its FLOPs at the decode rate take
/// a few microseconds; the call takes tens (the KV append, the heads split over the pool
/// and joined), which a batch-1 step pays once per layer and micro-batch.
const ATTN_CALL_CONTEXT: usize = 32;
/// Timed calls of the smallest attention point, of which the probe keeps the median.
const ATTN_CALL_REPS: usize = 101;
/// Bytes streamed before each timed smallest call (twice a 32 MiB last-level cache), as
/// a step streams a layer's weights between two attention calls: back to back, the call
/// finds its KV blocks and buffers cached (10.7 us in one quiet probe; 13-23 us after the
/// stream in two).
const ATTN_EVICT_BYTES: usize = 64 << 20;

/// The decode KV-read points: kv heads and head width of the cache (OLMoE's and Qwen3's
/// 128-wide heads), sequences and cached positions each: 64 MiB of f32 K and V per call,
/// past most last-level caches, and the evicting stream before each timed call.
const ATTN_KV_CACHE: (usize, usize, usize, usize) = (8, 128, 4, 4096);
/// Query heads per kv head of the wide-group point (Qwen3-30B-A3B's and gpt-oss's 8).
const ATTN_KV_WIDE_GROUP: usize = 8;

/// MLA's latent decode point: DeepSeek-V2-Lite's query heads over one kv head of the
/// latent and rope key (512 + 64), values the latent's first 512 columns read from the
/// keys (the CPU backend's layout), over the same sequences and positions.
const ATTN_LATENT: (usize, usize, usize) = (16, 576, 512);

/// The decode attention kernel's KV read rate over an f32 and a half cache (one query
/// head per kv head: bytes bound), its FLOP rate with wide groups over the half cache (8
/// query heads per kv head: the most arithmetic per byte a card has but MLA's) and over
/// MLA's latent ([`ATTN_LATENT`]), on the current rayon pool: (f32 GB/s, f16 GB/s,
/// GFLOP/s, latent GFLOP/s, both as the catalog counts them). Each the best of `reps`
/// timed calls, each after [`ATTN_EVICT_BYTES`] streamed.
pub fn time_decode_kv(reps: usize) -> Result<(f64, f64, f64, f64), ProbeError> {
    use crate::math::attention::AttnSeq;
    use crate::math::isa::Kernels;
    use crate::math::kv_cache::PagedKvCache;
    use crate::model::vocab::{AttnShape, KvLayout, KvType};
    let (kv_heads, head_dim, seqs, context) = ATTN_KV_CACHE;
    let evict = vec![1.0f32; ATTN_EVICT_BYTES / 4];
    let kernels = Kernels::process();
    let time = |kv_type: KvType,
                group: usize,
                (kv_heads, head_dim, values_in_keys): (usize, usize, Option<usize>)|
     -> Result<f64, ProbeError> {
        let layout = KvLayout {
            block_size: 16,
            kv_heads,
            head_dim,
            values_in_keys,
        };
        let per_seq = layout.blocks_for(context + 1);
        let shape = AttnShape {
            heads: kv_heads * group,
            kv_heads,
            head_dim,
            sliding_window: None,
            sinks: false,
        };
        let mut cache = PagedKvCache::of_type(layout, 1, seqs * per_seq, kv_type);
        let mut tables = Vec::with_capacity(seqs);
        for _ in 0..seqs {
            let mut table = Vec::new();
            cache
                .allocator
                .grow(&layout, &mut table, context + 1)
                .map_err(|e| ProbeError::Kernel(e.to_string()))?;
            tables.push(table);
        }
        // Fill the cache (non-zero pages, as a run's are): each sequence's K/V stored by a
        // call that attends nothing (only the stored K/V matter, so group-1 rows do).
        let store = AttnShape {
            heads: kv_heads,
            ..shape
        };
        let fill: Vec<f32> = (0..context * store.qkv_width())
            .map(|i| ((i % 251) as f32 - 125.0) * 1e-3)
            .collect();
        let mut fill_out = vec![0.0f32; context * store.q_width()];
        for table in &tables {
            let prefill = [AttnSeq {
                block_table: table,
                context_len: 0,
                n_new: context,
            }];
            kernels
                .attention_of(
                    &mut cache.layer_mut(0),
                    &prefill,
                    &fill,
                    &store,
                    &mut fill_out,
                    &|_| false,
                )
                .map_err(|e| ProbeError::Kernel(e.to_string()))?;
        }
        let decode: Vec<AttnSeq<'_>> = tables
            .iter()
            .map(|table| AttnSeq {
                block_table: table,
                context_len: context,
                n_new: 1,
            })
            .collect();
        let qkv = vec![0.01f32; seqs * shape.qkv_width()];
        let mut out = vec![0.0f32; seqs * shape.q_width()];
        let mut best = f64::INFINITY;
        for _ in 0..=reps.max(1) {
            std::hint::black_box(stream_read(&evict));
            let start = Instant::now();
            kernels
                .attention(&mut cache.layer_mut(0), &decode, &qkv, &shape, &mut out)
                .map_err(|e| ProbeError::Kernel(e.to_string()))?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        std::hint::black_box(&out);
        Ok(best)
    };
    let kv_bytes = |kv_type: KvType| {
        (seqs * (context + 1) * 2 * kv_heads * head_dim) as f64 * kv_type.bytes() as f64
    };
    let gqa = (kv_heads, head_dim, None);
    let f32_s = time(KvType::F32, 1, gqa)?;
    let f16_s = time(KvType::F16, 1, gqa)?;
    let wide_s = time(KvType::F16, ATTN_KV_WIDE_GROUP, gqa)?;
    let (latent_heads, latent_dim, latent_values) = ATTN_LATENT;
    let latent_s = time(
        KvType::F16,
        latent_heads,
        (1, latent_dim, Some(latent_values)),
    )?;
    // The catalog's count: 4 flops per query head, key dimension and position.
    let flops = |q_dim: usize| 4.0 * q_dim as f64 * seqs as f64 * (context + 1) as f64;
    Ok((
        kv_bytes(KvType::F32) / f32_s.max(1e-12) / GB,
        kv_bytes(KvType::F16) / f16_s.max(1e-12) / GB,
        flops(kv_heads * ATTN_KV_WIDE_GROUP * head_dim) / wide_s.max(1e-12) / 1e9,
        flops(latent_heads * latent_dim) / latent_s.max(1e-12) / 1e9,
    ))
}

/// Measures the rates of moec's own kernels (`math`, the runtime's, with the
/// process's instruction set) on `threads` threads: [`KernelRates`] with the `linear` and
/// `expert_ffn` curves at [`KERNEL_ROWS`] rows on bf16 mixtral-mid-sized matrices, decode
/// attention (16 sequences x 512 cached positions), prefill attention (256 tokens,
/// causal) and the smallest attention call ([`ATTN_CALL_CONTEXT`]). Each curve point is
/// the median of `effort.kernel_reps` passes taken round-robin over the points after an
/// untimed pass of each; the two attention rate points the best of two timings, the
/// smallest call the median of `effort.attn_call_reps` ([`ProbeEffort`]).
pub fn measure_kernels(
    threads: usize,
    effort: ProbeEffort,
    quant: &[crate::quant::QuantFormat],
) -> Result<KernelRates, ProbeError> {
    use crate::math::isa::Kernels;
    use crate::math::tensor::Matrix;
    let pool = probe_pool(threads)?;
    let kernels = Kernels::process();
    let (d, f) = (KERNEL_HIDDEN, KERNEL_FFN);
    let elems = d * f;
    // Three matrices per expert, [out, in] as Hugging Face stores them: gate, up, down.
    let weights: Vec<half::bf16> =
        vec![half::bf16::from_f32(1e-3); 3 * elems * KERNEL_DECODE_EXPERTS];
    let decode_set: Vec<[Matrix<'_>; 3]> = weights
        .chunks_exact(3 * elems)
        .map(|e| probe_expert(e, d, f))
        .collect::<Result<_, ProbeError>>()?;
    let compute_set = [probe_expert(&weights, d, KERNEL_COMPUTE_FFN)?];
    let max_rows = KERNEL_ROWS[KERNEL_ROWS.len() - 1] as usize;
    let x = vec![0.01f32; max_rows * f];
    let mut h = vec![0.0f32; max_rows * f];
    let mut y = vec![0.0f32; max_rows * f];
    let silu = |v: f32| v / (1.0 + (-v).exp());
    let mut failed: Option<String> = None;
    // One timed pass of a point over its set: decode points stream the six experts,
    // compute-bound ones the narrow expert.
    let mut pass = |rows: u32, gated: bool| -> f64 {
        let n = rows as usize;
        let set: &[[Matrix<'_>; 3]] = if rows >= KERNEL_COMPUTE_ROWS {
            &compute_set
        } else {
            &decode_set
        };
        let start = Instant::now();
        pool.install(|| {
            for [gate, up, down] in set {
                let (o, i) = (gate.rows, gate.cols);
                let result = if gated {
                    kernels
                        .linear_gated(&x[..n * i], n, gate, up, silu, &mut h[..n * o])
                        .and_then(|()| kernels.linear(&h[..n * o], n, down, &mut y[..n * i]))
                } else {
                    kernels
                        .linear(&x[..n * i], n, gate, &mut h[..n * o])
                        .and_then(|()| kernels.linear(&x[..n * i], n, up, &mut h[..n * o]))
                        .and_then(|()| kernels.linear(&h[..n * o], n, down, &mut y[..n * i]))
                };
                if let Err(e) = result {
                    failed = Some(e.to_string());
                }
            }
        });
        start.elapsed().as_secs_f64()
    };
    let points: Vec<(u32, bool)> = KERNEL_ROWS
        .iter()
        .flat_map(|&rows| [(rows, false), (rows, true)])
        .collect();
    for &(rows, gated) in &points {
        pass(rows, gated);
    }
    // Round-robin: a slow phase of the machine (a neighbour's burst, the first passes
    // after start-up) costs every point one sample rather than one point all of its own.
    let reps = effort.kernel_reps.max(1);
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(reps); points.len()];
    for _ in 0..reps {
        for (times, &(rows, gated)) in samples.iter_mut().zip(&points) {
            times.push(pass(rows, gated));
        }
    }
    let rate = |rows: u32, times: Vec<f64>| {
        let set = if rows >= KERNEL_COMPUTE_ROWS {
            &compute_set[..]
        } else {
            &decode_set[..]
        };
        let bytes: usize = set
            .iter()
            .map(|m| m.iter().map(|w| w.rows * w.cols * 2).sum::<usize>())
            .sum();
        RowsRate {
            rows,
            weight_gb_s: bytes as f64 / median(times).max(1e-12) / GB,
        }
    };
    let mut linear = Vec::with_capacity(KERNEL_ROWS.len());
    let mut expert_ffn = Vec::with_capacity(KERNEL_ROWS.len());
    for (times, &(rows, gated)) in samples.into_iter().zip(&points) {
        if gated {
            expert_ffn.push(rate(rows, times));
        } else {
            linear.push(rate(rows, times));
        }
    }
    std::hint::black_box(&y);
    if let Some(e) = failed {
        return Err(ProbeError::Kernel(e));
    }
    let (decode_seconds, prefill_seconds, call_seconds) =
        pool.install(|| time_attention(effort.attn_call_reps.max(1)))?;
    let (kv_gb_s, kv_f16_gb_s, peak_gflops, latent_gflops) = pool.install(|| time_decode_kv(2))?;
    let quant = measure_quant_rates(&pool, reps, quant)?;
    let (heads, _, head_dim) = ATTN_HEADS;
    let q = (heads * head_dim) as f64;
    let (seqs, context) = ATTN_DECODE;
    // The op catalog's FLOPs: decode 4 q n c over the positions each token sees (its
    // context and itself); prefill 4 q c (c + 1) / 2, causal.
    let decode_flops = 4.0 * q * seqs as f64 * (context + 1) as f64;
    let t = ATTN_PREFILL_TOKENS as f64;
    let prefill_flops = 4.0 * q * t * (t + 1.0) / 2.0;
    let decode_mb = KERNEL_DECODE_EXPERTS * 3 * elems * 2 / 1_000_000;
    Ok(KernelRates {
        source: format!(
            "moec probe: math ({:?}) on {threads} threads; linear and expert_ffn on bf16 [out, in] matrices, rows below {KERNEL_COMPUTE_ROWS} over {KERNEL_DECODE_EXPERTS} experts of {d}x{f} ({decode_mb} MB), rows {KERNEL_COMPUTE_ROWS}+ over one {d}x{KERNEL_COMPUTE_FFN} expert, attention 16 heads / 4 KV heads of 64 at decode {seqs} seqs x {context} and prefill {ATTN_PREFILL_TOKENS} tokens (best of 2), its smallest call 1 seq x {ATTN_CALL_CONTEXT} (median of {}, each after 64 MiB streamed), decode KV read 4 seqs x 4096 of 8 KV heads of 128 (f32 and f16 caches, groups of 1; f16 groups of 8; MLA's latent, 16 heads over one kv head of 576, values the first 512, f16; best of 2 after 64 MiB streamed); linear and expert_ffn the median of {reps} passes per point, taken round-robin; quantised expert FFNs (Q4_K, Q6_K, Q8_0, MXFP4 held as the CPU backend holds them: {}; `QuantKernels`) at the same rows over the same shapes ({} MB or more of each format below {KERNEL_COMPUTE_ROWS} rows), GB/s of each format's bytes",
            kernels.isa(),
            effort.attn_call_reps.max(1),
            crate::math::qmatmul::tiles::describe_mode(),
            QUANT_DECODE_BYTES / 1_000_000
        ),
        linear,
        expert_ffn,
        attn_decode_gflops: decode_flops / decode_seconds.max(1e-12) / 1e9,
        attn_prefill_gflops: prefill_flops / prefill_seconds.max(1e-12) / 1e9,
        attn_call_us: call_seconds * 1e6,
        attn_decode_kv_gb_s: kv_gb_s,
        attn_decode_kv_f16_gb_s: kv_f16_gb_s,
        attn_decode_peak_gflops: peak_gflops,
        attn_decode_latent_gflops: latent_gflops,
        quant,
    })
}

/// The formats whose products [`measure_quant_rates`] can time (`moec probe` times all):
/// those of the checkpoints people run on the CPU backend (Q4_K_M's Q4_K and Q6_K, Q8_0,
/// which a Q6_K mix falls back to where a row is not whole 256-weight blocks, and MXFP4,
/// gpt-oss's experts in MXFP4_MOE).
pub const QUANT_FORMATS: [crate::quant::QuantFormat; 4] = [
    crate::quant::QuantFormat::Q4K,
    crate::quant::QuantFormat::Q6K,
    crate::quant::QuantFormat::Q8_0,
    crate::quant::QuantFormat::Mxfp4,
];

/// Bytes the quantised decode points stream through at least (as the bf16 points' six
/// experts, 132 MB: four times a 32 MiB L3). Six experts of the probe's shape are only
/// 35-48 MB in these formats, barely past the L3, where the bf16 one-row rate moved
/// between 16 and 32 GB/s from one probe to the next ([`KERNEL_DECODE_EXPERTS`]).
const QUANT_DECODE_BYTES: usize = 132_000_000;

/// Blocks of `format` for `elems` weights, fast rather than realistic (the probe makes
/// tens of MB on every `moec run` of a quantised checkpoint): bytes from a xorshift
/// generator, then every block's f16 scales set to 1e-3 (any bytes are a valid block of
/// these formats once its scales are finite; the products' time does not depend on the
/// values).
fn probe_blocks(format: crate::quant::QuantFormat, elems: usize, seed: u64) -> Vec<u8> {
    use crate::quant::QuantFormat;
    let bb = format.block_bytes();
    let mut bytes = vec![0u8; elems / format.block_elems() * bb];
    let mut state = seed | 1;
    for chunk in bytes.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let n = chunk.len();
        chunk.copy_from_slice(&state.to_le_bytes()[..n]);
    }
    let fields: &[usize] = match format {
        QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q4_1 => &[0, 2],
        QuantFormat::Q6K => &[208],
        QuantFormat::Mxfp4 => &[],
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
    };
    let scale = half::f16::from_f32(1e-3).to_le_bytes();
    for block in bytes.chunks_exact_mut(bb) {
        for &at in fields {
            block[at..at + 2].copy_from_slice(&scale);
        }
        if format == QuantFormat::Mxfp4 {
            // An e8m0 exponent of 2^-8 (random bytes could be 255, ggml's NaN, or give
            // subnormal block values, which some FPUs take slow paths for).
            block[0] = 119;
        }
    }
    bytes
}

/// [`KernelRates::quant`]: each of [`QUANT_FORMATS`]'s expert FFN products (gate, up,
/// down through `QuantKernels::quant_linear` on the process's body, weights held as the
/// CPU backend holds them: in tiles where it repacks the format at load
/// (`tiles::tiled_at_load`), else in the row layout, which the product reads in place or
/// packs a panel at a time from `tiles::pack_min_rows` rows, as a run's does) at
/// [`KERNEL_ROWS`] rows, as the bf16
/// curves are timed: rows below [`KERNEL_COMPUTE_ROWS`] over enough experts of the
/// probe's shape for [`QUANT_DECODE_BYTES`] (one random expert copied into each, distinct
/// memory, so the weights come from DRAM), the others over one narrow expert; the median
/// of `reps` passes per point, round-robin. GB/s of the format's bytes.
fn measure_quant_rates(
    pool: &rayon::ThreadPool,
    reps: usize,
    formats: &[crate::quant::QuantFormat],
) -> Result<Vec<QuantRates>, ProbeError> {
    use crate::math::qmatmul::{tiles, QuantKernels, QuantMatrix};
    use crate::quant::QuantSlice;
    let qk = QuantKernels::process();
    let (d, f, narrow) = (KERNEL_HIDDEN, KERNEL_FFN, KERNEL_COMPUTE_FFN);
    let max_rows = KERNEL_ROWS[KERNEL_ROWS.len() - 1] as usize;
    let x = vec![0.01f32; max_rows * f];
    let mut h = vec![0.0f32; max_rows * f];
    let mut y = vec![0.0f32; max_rows * f];
    let mut out = Vec::with_capacity(QUANT_FORMATS.len());
    let wanted = QUANT_FORMATS.into_iter().filter(|f| formats.contains(f));
    for (i, format) in wanted.enumerate() {
        // A [rows, cols] matrix of random blocks, tiled where a run's would be.
        let at_load = tiles::tiled_at_load(format);
        let make = |rows: usize, cols: usize, seed: u64| -> Result<Vec<u8>, ProbeError> {
            let plain = probe_blocks(format, rows * cols, seed);
            if !at_load {
                return Ok(plain);
            }
            let mut tiled = vec![0u8; plain.len()];
            if !tiles::tile(format, &plain, rows, cols, &mut tiled) {
                return Err(ProbeError::Kernel(format!(
                    "{format} [{rows}, {cols}] does not tile"
                )));
            }
            Ok(tiled)
        };
        let seed = 11 + 3 * i as u64;
        let wide = [
            make(f, d, seed)?,
            make(f, d, seed + 1)?,
            make(d, f, seed + 2)?,
        ];
        let expert_bytes: usize = wide.iter().map(Vec::len).sum();
        let n_decode = QUANT_DECODE_BYTES
            .div_ceil(expert_bytes.max(1))
            .max(KERNEL_DECODE_EXPERTS);
        let decode: Vec<[Vec<u8>; 3]> = (0..n_decode).map(|_| wide.clone()).collect();
        let compute = [[
            make(narrow, d, seed)?,
            make(narrow, d, seed + 1)?,
            make(d, narrow, seed + 2)?,
        ]];
        let shapes = |ffn: usize| [(ffn, d), (ffn, d), (d, ffn)];
        let mut failed: Option<String> = None;
        let mut pass = |rows: u32| -> f64 {
            let n = rows as usize;
            let (set, ffn): (&[[Vec<u8>; 3]], usize) = if rows >= KERNEL_COMPUTE_ROWS {
                (&compute, narrow)
            } else {
                (&decode, f)
            };
            let start = Instant::now();
            pool.install(|| {
                for expert in set {
                    for (m, (bytes, (o, i))) in expert.iter().zip(shapes(ffn)).enumerate() {
                        let slice = if at_load {
                            QuantSlice::tiled(bytes, format, o * i, i)
                        } else {
                            QuantSlice::new(bytes, format, o * i)
                        };
                        let result = slice
                            .map_err(|e| e.to_string())
                            .and_then(|q| QuantMatrix::new(q, o, i).map_err(|e| e.to_string()))
                            .and_then(|w| {
                                let (input, output) = if m < 2 {
                                    (&x[..n * i], &mut h[..n * o])
                                } else {
                                    (&h[..n * i], &mut y[..n * o])
                                };
                                qk.quant_linear(&w, input, n, output)
                                    .map_err(|e| e.to_string())
                            });
                        if let Err(e) = result {
                            failed = Some(e);
                        }
                    }
                }
            });
            start.elapsed().as_secs_f64()
        };
        for &rows in &KERNEL_ROWS {
            pass(rows);
        }
        let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(reps); KERNEL_ROWS.len()];
        for _ in 0..reps {
            for (times, &rows) in samples.iter_mut().zip(&KERNEL_ROWS) {
                times.push(pass(rows));
            }
        }
        if let Some(e) = failed {
            return Err(ProbeError::Kernel(format!("{format} product: {e}")));
        }
        let bytes = |set: &[[Vec<u8>; 3]]| -> usize { set.iter().flatten().map(Vec::len).sum() };
        let points = samples
            .into_iter()
            .zip(&KERNEL_ROWS)
            .map(|(times, &rows)| {
                let b = if rows >= KERNEL_COMPUTE_ROWS {
                    bytes(&compute)
                } else {
                    bytes(&decode)
                };
                RowsRate {
                    rows,
                    weight_gb_s: b as f64 / median(times).max(1e-12) / GB,
                }
            })
            .collect();
        out.push(QuantRates {
            format: format.name().to_string(),
            points,
        });
    }
    std::hint::black_box(&y);
    Ok(out)
}

/// One synthetic expert of the kernel probe over `data` (at least `3 x hidden x ffn`
/// elements): gate and up `[ffn, hidden]`, down `[hidden, ffn]`.
fn probe_expert(
    data: &[half::bf16],
    hidden: usize,
    ffn: usize,
) -> Result<[crate::math::tensor::Matrix<'_>; 3], ProbeError> {
    use crate::math::tensor::{Matrix, TypedSlice};
    use crate::model::vocab::Orientation;
    let n = hidden * ffn;
    let part = |i: usize, rows, cols| {
        let slice = data
            .get(i * n..(i + 1) * n)
            .ok_or(ProbeError::Expert("probe"))?;
        Matrix::new(TypedSlice::Bf16(slice), rows, cols, Orientation::OutIn)
            .ok_or(ProbeError::Expert("probe"))
    };
    Ok([
        part(0, ffn, hidden)?,
        part(1, ffn, hidden)?,
        part(2, hidden, ffn)?,
    ])
}

/// Best seconds of the decode and the prefill attention point (see [`ATTN_DECODE`] and
/// [`ATTN_PREFILL_TOKENS`]) through the runtime's attention kernel and paged KV cache.
fn time_attention(call_reps: usize) -> Result<(f64, f64, f64), ProbeError> {
    use crate::math::attention::AttnSeq;
    use crate::math::isa::Kernels;
    use crate::math::kv_cache::PagedKvCache;
    use crate::model::vocab::AttnShape;
    use crate::model::vocab::KvLayout;
    let (heads, kv_heads, head_dim) = ATTN_HEADS;
    let shape = AttnShape {
        heads,
        kv_heads,
        head_dim,
        sliding_window: None,
        sinks: false,
    };
    let layout = KvLayout {
        block_size: 16,
        kv_heads,
        head_dim,
        values_in_keys: None,
    };
    let (seqs, context) = ATTN_DECODE;
    let per_seq = layout.blocks_for(context + 1);
    let n_blocks = (seqs * per_seq).max(layout.blocks_for(ATTN_PREFILL_TOKENS));
    let mut cache = PagedKvCache::new(layout, 1, n_blocks);
    let mut tables: Vec<Vec<u32>> = Vec::with_capacity(seqs);
    for _ in 0..seqs {
        let mut table = Vec::new();
        cache
            .allocator
            .grow(&layout, &mut table, context + 1)
            .map_err(|e| ProbeError::Kernel(e.to_string()))?;
        tables.push(table);
    }
    let kernels = Kernels::process();
    // Non-zero: a zeroed allocation maps one shared zero page, which never leaves cache.
    let evict = vec![1.0f32; ATTN_EVICT_BYTES / 4];
    // `reps` timed calls after a warm-up; the median of them for a call that takes
    // microseconds (single timings of it scatter), the best for one that takes
    // milliseconds.
    let mut run = |attn: &[AttnSeq<'_>], rows: usize, reps: usize| -> Result<f64, ProbeError> {
        let qkv = vec![0.01f32; rows * shape.qkv_width()];
        let mut out = vec![0.0f32; rows * shape.q_width()];
        let mut failed = None;
        let mut call = || {
            let mut blocks = cache.layer_mut(0);
            if let Err(e) = kernels.attention(&mut blocks, attn, &qkv, &shape, &mut out) {
                failed = Some(e.to_string());
            }
        };
        let seconds = if reps > 2 {
            call();
            median(
                (0..reps)
                    .map(|_| {
                        // In a step the layer's weights stream between two attention
                        // calls and leave nothing of the last one in the caches.
                        std::hint::black_box(stream_read(&evict));
                        let start = Instant::now();
                        call();
                        start.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        } else {
            best_seconds(reps, call)
        };
        std::hint::black_box(&out);
        match failed {
            Some(e) => Err(ProbeError::Kernel(e)),
            None => Ok(seconds),
        }
    };
    let decode: Vec<AttnSeq<'_>> = tables
        .iter()
        .map(|table| AttnSeq {
            block_table: table,
            context_len: context,
            n_new: 1,
        })
        .collect();
    let decode_seconds = run(&decode, seqs, 2)?;
    let smallest = [AttnSeq {
        block_table: &tables[0],
        context_len: ATTN_CALL_CONTEXT,
        n_new: 1,
    }];
    let call_seconds = run(&smallest, 1, call_reps)?;
    // The prefill sequence reuses the first blocks of the pool (the decode tables'
    // contents do not matter to the timing).
    let prefill_table: Vec<u32> = (0..layout.blocks_for(ATTN_PREFILL_TOKENS) as u32).collect();
    let prefill = [AttnSeq {
        block_table: &prefill_table,
        context_len: 0,
        n_new: ATTN_PREFILL_TOKENS,
    }];
    let prefill_seconds = run(&prefill, ATTN_PREFILL_TOKENS, 2)?;
    Ok((decode_seconds, prefill_seconds, call_seconds))
}

/// Times one expert of `card` as Fiddler's cppExpert does at start-up, on this machine:
/// the CPU kernel (`math::moe::expert_ffn`, the runtime's) on one token and on
/// a batch of 4 (the CPU backend's emulated GPU runs the same kernel on the same cores),
/// and the weight copy at `memcpy_bytes_per_s` (the emulated link). Weights are synthetic
/// in the card's dtype; the times are the best of a few repetitions.
pub fn measure_expert_latency(
    card: &crate::model::card::ModelCard,
    memcpy_bytes_per_s: f64,
) -> Result<ExpertLatency, ProbeError> {
    use crate::math::moe::expert_ffn;
    use crate::math::tensor::{Matrix, TypedSlice};
    use crate::math::views::ExpertWeights;
    use crate::model::arch::ArchSpec;
    use crate::model::vocab::Orientation;
    use crate::model::vocab::RoutedRow;
    let arch = ArchSpec::from_card(card);
    let (d, f, k) = (arch.hidden, arch.ffn, arch.top_k.max(1));
    let elems = d * f;
    // bf16 like the checkpoints (memory-bound at one token: the bytes are what count).
    let data: Vec<half::bf16> = (0..3 * elems)
        .map(|i| half::bf16::from_f32(((i % 17) as f32 - 8.0) * 1e-3))
        .collect();
    let (gate, rest) = data.split_at(elems);
    let (up, down) = rest.split_at(elems);
    let matrix = |m: &'static str, slice, rows, cols, o| {
        Matrix::new(TypedSlice::Bf16(slice), rows, cols, o).ok_or(ProbeError::Expert(m))
    };
    // The family's own orientation (DBRX and gpt-oss store `[in, out]`), as the checkpoint
    // views read it, so the probe times the layout the kernels will see.
    let down_matrix = match card.family.facts().expert_down {
        Orientation::InOut => matrix("down", down, f, d, Orientation::InOut)?,
        Orientation::OutIn => matrix("down", down, d, f, Orientation::OutIn)?,
    };
    let expert = ExpertWeights {
        gate: matrix("gate", gate, f, d, Orientation::OutIn)?,
        up: matrix("up", up, f, d, Orientation::OutIn)?,
        down: down_matrix,
        fused: None,
    };
    let time = |tokens: usize| -> Result<f64, ProbeError> {
        let x = vec![0.01f32; tokens * d];
        let rows: Vec<RoutedRow> = (0..tokens as u32)
            .map(|row| RoutedRow {
                row,
                slot: 0,
                weight: 1.0,
            })
            .collect();
        let mut slots = vec![0.0f32; tokens * k * d];
        let mut failed = None;
        let seconds = best_seconds(3, || {
            if let Err(e) = expert_ffn(&arch, &expert, &x, &rows, &mut slots) {
                failed = Some(e.to_string());
            }
        });
        match failed {
            Some(e) => Err(ProbeError::Kernel(e)),
            None => Ok(seconds),
        }
    };
    let bytes = (3 * elems * 2) as f64;
    Ok(ExpertLatency {
        model: card.name.clone(),
        cpu_s_per_token: time(1)?,
        gpu_s: time(4)?,
        copy_s: bytes / memcpy_bytes_per_s.max(1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small probe runs and gives a valid profile (figures are not asserted: they are
    /// measurements of whatever machine runs the test).
    #[test]
    fn small_probe_gives_a_valid_profile() {
        let measured = measure(4 << 20, 1).unwrap();
        assert!(measured.stream_read_bytes_per_s > 0.0 && measured.gemm_f32_flops > 0.0);
        let profile = profile_from_measurements("probe-test", &measured);
        profile.validate().unwrap();
        assert!(HardwareProfile::from_ron(&profile.to_ron(), "probe").is_ok());
    }

    /// The tiny card's expert times are positive and a batch of 4 takes at least as long
    /// as one token up to timing noise (not asserted: a timed assertion); the copy time is
    /// its bytes over the given rate: 3 x 128 x 256 bf16 = 196,608 B at 1 GB/s.
    #[test]
    fn the_expert_latency_model_is_measured_for_a_card() {
        let card = crate::model::card::ModelCard::load("mixtral-tiny").unwrap();
        let lat = measure_expert_latency(&card, 1e9).unwrap();
        assert!(lat.cpu_s_per_token > 0.0 && lat.gpu_s > 0.0);
        assert!((lat.copy_s - 196_608.0 / 1e9).abs() < 1e-15);
        assert_eq!(lat.model, "mixtral-tiny");
    }

    /// The kernel probe gives a rate at every row count, rows ascending (the figures are
    /// the machine's, not asserted), and a profile carrying them validates.
    #[test]
    fn kernel_probe_gives_a_valid_curve_per_op_kind() {
        let q6k = crate::quant::QuantFormat::Q6K;
        let rates = measure_kernels(1, ProbeEffort::QUICK, &[q6k]).unwrap();
        let rows: Vec<u32> = rates.linear.iter().map(|p| p.rows).collect();
        assert_eq!(rows, KERNEL_ROWS);
        assert_eq!(rates.expert_ffn.len(), KERNEL_ROWS.len());
        // Only the format asked for has a quantised curve, at every row count.
        assert_eq!(rates.quant.len(), 1);
        assert_eq!(
            rates.quant_curve("Q6_K").map(<[_]>::len),
            Some(KERNEL_ROWS.len())
        );
        rates.validate().unwrap();
        let mut profile = profile_from_measurements("probe-test", &measure(1 << 20, 1).unwrap());
        profile.kernels = Some(rates);
        assert!(HardwareProfile::from_ron(&profile.to_ron(), "probe").is_ok());
    }

    #[test]
    fn rejects_tiny_buffers() {
        assert!(matches!(measure(1000, 1), Err(ProbeError::TooSmall(1000))));
    }
}
