//! One decoder layer of `mixtral-mid` (d 1024, ffn 3584, 16/4 heads, 8 experts top-2, bf16
//! weights), through the same kernels the oracle and the runtime use:
//! - prefill: one sequence of 128 new tokens;
//! - decode: 16 sequences x 1 new token, each over 512 cached tokens.
//!
//! Prints achieved GFLOP/s beside this machine's peak estimate (cores x 2 FMA ports x 16
//! f32 lanes x 2 flops x 2.3 GHz when AVX-512 is detected; 8 lanes otherwise), and for
//! decode the achieved weight+KV streaming rate, since decode is memory-bound. Criterion's
//! throughput lines report the same FLOP counts as "elem/s".

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use moec::math::attention::{attention, AttnSeq};
use moec::math::kv_cache::PagedKvCache;
use moec::math::moe::{combine, expert_ffn, gate};
use moec::math::projection::{o_proj_residual, pre_attn};
use moec::math::rope::RopeTable;
use moec::math::simd::avx512_available;
use moec::math::views::LayerWeights;
use moec::model::vocab::{ExpertGroups, KvLayout};
use moec::model::{ArchSpec, ModelCard};
use moec::weights::synth::{synthetic_layer_image, SynthOptions};
use std::time::Instant;

/// Clock the peak estimate assumes when /proc/cpuinfo gives none (this machine's AMD EPYC
/// reports 2.45 GHz there).
const DEFAULT_CLOCK_GHZ: f64 = 2.45;

/// The first core's clock from /proc/cpuinfo, and where it came from.
fn clock_ghz() -> (f64, &'static str) {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map_or(
            (DEFAULT_CLOCK_GHZ, "assumed: no cpu MHz in /proc/cpuinfo"),
            |mhz| (mhz / 1e3, "/proc/cpuinfo"),
        )
}

struct Setup {
    arch: ArchSpec,
    rope: RopeTable,
}

/// One layer forward over `seqs`; returns the number of routed (token, expert) rows.
fn layer_forward(
    s: &Setup,
    w: &LayerWeights<'_>,
    cache: &mut PagedKvCache,
    seqs: &[AttnSeq<'_>],
    x: &mut [f32],
) -> usize {
    let a = &s.arch;
    let n: usize = seqs.iter().map(|q| q.n_new).sum();
    let positions: Vec<usize> = seqs
        .iter()
        .flat_map(|q| (0..q.n_new).map(move |j| q.context_len + j))
        .collect();
    let mut x_norm = vec![0.0f32; n * a.hidden];
    let mut qkv = vec![0.0f32; n * a.attn.qkv_width()];
    let mut attn_out = vec![0.0f32; n * a.q_dim()];
    let mut slots = vec![0.0f32; n * a.top_k * a.hidden];
    pre_attn(a, &w.dense, &s.rope, x, &positions, &mut x_norm, &mut qkv).unwrap();
    attention(&mut cache.layer_mut(0), seqs, &qkv, &a.attn, &mut attn_out).unwrap();
    o_proj_residual(a, &w.dense, &attn_out, x).unwrap();
    let routing = gate(a, &w.dense, x, &mut x_norm).unwrap();
    let groups = ExpertGroups::new(&routing, a.experts);
    for (e, rows) in groups.routed() {
        expert_ffn(a, &w.experts[e as usize], &x_norm, rows, &mut slots).unwrap();
    }
    combine(&routing, &slots, x).unwrap();
    groups.routed().count()
}

/// FLOPs of one layer forward: projections, attention (QKᵀ and PV over each token's
/// visible keys), router and the routed experts.
fn layer_flops(a: &ArchSpec, seqs: &[AttnSeq<'_>]) -> f64 {
    let n: f64 = seqs.iter().map(|q| q.n_new as f64).sum();
    let d = a.hidden as f64;
    let proj = 2.0 * n * d * (a.q_dim() + 2 * a.kv_dim()) as f64 + 2.0 * n * a.q_dim() as f64 * d;
    let keys: f64 = seqs
        .iter()
        .flat_map(|q| (0..q.n_new).map(move |j| (q.context_len + j + 1) as f64))
        .sum();
    let attn = 4.0 * keys * a.q_dim() as f64;
    let router = 2.0 * n * d * a.experts as f64;
    let experts = n * a.top_k as f64 * 6.0 * d * a.ffn as f64;
    proj + attn + router + experts
}

fn peak_gflops() -> (f64, String) {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    let lanes = if avx512_available() { 16.0 } else { 8.0 };
    let (clock, clock_source) = clock_ghz();
    let per_core = 2.0 * lanes * 2.0 * clock;
    let basis = format!(
        "{cores} cores x 2 FMA ports x {lanes} f32 lanes ({}) x 2 flops x {clock:.2} GHz ({clock_source}) = {per_core:.0} GFLOP/s per core",
        if lanes == 16.0 { "AVX-512 detected" } else { "no AVX-512: AVX2 assumed" }
    );
    (cores * per_core, basis)
}

/// CPU seconds this process has used (user + system, from /proc; 0 where unavailable).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// Runs `f` `reps` times; returns the median wall time and the CPU seconds per run (so
/// GFLOP per CPU-second shows per-core efficiency even when other jobs share the cores).
fn time_median(mut f: impl FnMut(), reps: usize) -> (f64, f64) {
    let cpu0 = cpu_seconds();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    let cpu = (cpu_seconds() - cpu0) / reps as f64;
    times.sort_by(f64::total_cmp);
    (times[reps / 2], cpu)
}

fn bench_layer(c: &mut Criterion) {
    let card = ModelCard::load("mixtral-mid").unwrap();
    let arch = ArchSpec::from_card(&card);
    let (layout, image) = synthetic_layer_image(&card, 0, &SynthOptions::default());
    let weights = LayerWeights::from_image(image.as_bytes(), &layout).unwrap();
    let setup = Setup {
        rope: RopeTable::new(arch.rope_theta, arch.attn.head_dim, 1024),
        arch: arch.clone(),
    };
    let kv_layout = KvLayout {
        block_size: 16,
        kv_heads: arch.attn.kv_heads,
        head_dim: arch.attn.head_dim,
        values_in_keys: None,
    };
    let (peak, basis) = peak_gflops();
    // Other processes compete for the same cores; say how busy the machine was.
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "peak estimate: {peak:.0} GFLOP/s ({basis}); rayon threads {}; load average: {}",
        rayon::current_num_threads(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );

    // Prefill: 128 new tokens of one sequence.
    let prefill_tokens = 128;
    let mut cache = PagedKvCache::new(kv_layout, 1, kv_layout.blocks_for(prefill_tokens));
    let mut table = Vec::new();
    cache
        .allocator
        .grow(&kv_layout, &mut table, prefill_tokens)
        .unwrap();
    let x0: Vec<f32> = (0..prefill_tokens * arch.hidden)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let seqs = [AttnSeq {
        block_table: &table,
        context_len: 0,
        n_new: prefill_tokens,
    }];
    let flops = layer_flops(&arch, &seqs);
    let (secs, cpu) = time_median(
        || {
            let mut x = x0.clone();
            layer_forward(&setup, &weights, &mut cache, &seqs, &mut x);
        },
        7,
    );
    let per_core = peak
        / std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as f64;
    println!(
        "prefill 128 tokens: {:.2} ms, {:.1} GFLOP/s ({:.0}% of peak); {:.1} GFLOP per CPU-second ({:.0}% of one core's peak)",
        secs * 1e3,
        flops / secs / 1e9,
        100.0 * flops / secs / 1e9 / peak,
        flops / cpu / 1e9,
        100.0 * flops / cpu / 1e9 / per_core
    );
    let mut group = c.benchmark_group("mixtral-mid layer");
    group.sample_size(10);
    group.throughput(Throughput::Elements(flops as u64));
    group.bench_function("prefill 128 tokens (elem = flop)", |b| {
        b.iter(|| {
            let mut x = x0.clone();
            layer_forward(&setup, &weights, &mut cache, &seqs, &mut x)
        })
    });

    // Decode: 16 sequences x 1 token over 512 cached tokens (cache filled with values).
    let n_seqs = 16;
    let context = 512;
    let mut cache = PagedKvCache::new(kv_layout, 1, n_seqs * kv_layout.blocks_for(context + 1));
    let mut tables = vec![Vec::new(); n_seqs];
    for t in tables.iter_mut() {
        cache.allocator.grow(&kv_layout, t, context + 1).unwrap();
    }
    if let moec::math::kv_cache::KvPools::F32 { k, v } = cache.layer_mut(0).pools {
        for (i, x) in k.iter_mut().enumerate() {
            *x = ((i * 2654435761usize) % 2003) as f32 / 1000.0 - 1.0;
        }
        for (i, x) in v.iter_mut().enumerate() {
            *x = ((i * 40503usize) % 1999) as f32 / 1000.0 - 1.0;
        }
    }
    let x0: Vec<f32> = (0..n_seqs * arch.hidden)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .map(|t| AttnSeq {
            block_table: t,
            context_len: context,
            n_new: 1,
        })
        .collect();
    let flops = layer_flops(&arch, &seqs);
    let mut experts_touched = 0;
    let (secs, cpu_decode) = time_median(
        || {
            let mut x = x0.clone();
            experts_touched = layer_forward(&setup, &weights, &mut cache, &seqs, &mut x);
        },
        9,
    );
    let weight_bytes =
        (layout.dense_range().len() + experts_touched * layout.expert_range(0).len()) as f64;
    let kv_bytes = (n_seqs * (context + 1) * 2 * arch.kv_dim() * 4) as f64;
    println!(
        "decode: {:.1} ms of CPU time per step ({:.0}% of the wall time x cores)",
        cpu_decode * 1e3,
        100.0 * cpu_decode / secs / rayon::current_num_threads() as f64
    );
    println!(
        "decode 16 seqs x 1 token, 512 context: {:.2} ms, {:.1} GFLOP/s ({:.1}% of peak); streams {:.1} MB weights ({experts_touched} experts) + {:.1} MB KV = {:.1} GB/s",
        secs * 1e3,
        flops / secs / 1e9,
        100.0 * flops / secs / 1e9 / peak,
        weight_bytes / 1e6,
        kv_bytes / 1e6,
        (weight_bytes + kv_bytes) / secs / 1e9
    );
    // Decode attention alone (the memory-bound hot spot): K/V bytes read per second.
    let qkv: Vec<f32> = (0..n_seqs * arch.attn.qkv_width())
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let mut attn_out = vec![0.0f32; n_seqs * arch.q_dim()];
    let (secs_attn, cpu_attn) = time_median(
        || {
            attention(
                &mut cache.layer_mut(0),
                &seqs,
                &qkv,
                &arch.attn,
                &mut attn_out,
            )
            .unwrap()
        },
        201,
    );
    println!(
        "decode attention alone (16 seqs x 513 keys, {} kv heads x {}): {:.3} ms, {:.1} GB/s of K/V",
        arch.attn.kv_heads,
        arch.attn.head_dim,
        secs_attn * 1e3,
        kv_bytes / secs_attn / 1e9
    );
    println!(
        "decode attention CPU time: {:.3} ms per call ({:.1} GB/s per CPU-second)",
        cpu_attn * 1e3,
        kv_bytes / cpu_attn / 1e9
    );
    group.throughput(Throughput::Elements(flops as u64));
    group.bench_function("decode 16x1 token, 512 context (elem = flop)", |b| {
        b.iter(|| {
            let mut x = x0.clone();
            layer_forward(&setup, &weights, &mut cache, &seqs, &mut x)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_layer);
criterion_main!(benches);
