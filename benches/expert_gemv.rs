//! The expert projections of `mixtral-mid` (d 1024, ffn 3584, bf16 weights) through
//! [`Kernels::linear`], against this machine's limits measured in the same run by
//! `moec probe`'s kernels: the streaming read ([`stream_read`]) and the f32 GEMM peak
//! (`engine::cpu_probe::measure`: the `gemm` crate, 1024³, all threads).
//!
//! - decode: one token through gate and up (fused, [`Kernels::linear_gated`]) and down of
//!   each of 6 experts in turn (132 MB of weights, far larger than the caches), so every
//!   weight byte comes from DRAM once: bytes / time over the streaming read is the GEMV's
//!   efficiency (goal >= 85%). The ratio is taken in [`RATIO_ROUNDS`] interleaved rounds,
//!   each timing the probe's streaming read over a buffer of the same 132 MB and then the
//!   GEMV, both on the same rayon pool (all threads), [`RATIO_REPS`] timing each after a
//!   warm-up call; the
//!   headline is the median of the rounds' ratios (this machine's bandwidth drifts by
//!   10-30% between seconds, so only a ratio within one round compares like with like),
//!   printed with the lowest and highest;
//! - expert GEMMs at 4 rows (a batch-16 decode step routes about 4 tokens to each expert):
//!   gate and up fused, then down, of one expert over 4 gathered rows: GFLOP/s over the GEMM
//!   peak;
//! - prefill: 256 gathered tokens through one expert's gate projection: FLOP/s over the
//!   GEMM peak (goal >= 70%).
//!
//! The 4-row and prefill figures are printed for every instruction set this CPU has
//! (portable is what ran on AVX2-only machines before the AVX2 bodies existed), so
//! before/after ratios come from one run; three rounds, each probing beside the kernels,
//! and a best-of summary (other jobs share the cores). Criterion then times the selected
//! kernels.

mod mixtral_mid;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mixtral_mid::{expert_rows, silu, view, Expert, D, F};
use moec::engine::cpu_probe::{measure, stream_read};
use moec::math::isa::{Isa, Kernels};
use std::time::Instant;

const EXPERTS: usize = 6;
const PREFILL_ROWS: usize = 256;
/// Rows of the few-row expert GEMM point (a batch-16 decode step's rows per expert).
const FEW_ROWS: usize = 4;
/// Interleaved rounds of the decode-GEMV-over-streaming-read ratio.
const RATIO_ROUNDS: usize = 31;
/// Timings per side and round (the best is kept). One: the two sides of a round are then
/// a few milliseconds apart, closer than this machine's bandwidth drifts.
const RATIO_REPS: usize = 1;

/// Decode: one row through every expert's gate and up (one fused pass, as the MoE block
/// runs them) and down.
fn decode(k: Kernels, experts: &[Expert], x: &[f32], h: &mut [f32], y: &mut [f32]) {
    for e in experts {
        k.linear_gated(x, 1, &view(&e.gate, F, D), &view(&e.up, F, D), silu, h)
            .expect("gate and up");
        k.linear(h, 1, &view(&e.down, D, F), y).expect("down");
    }
}

/// The decode GEMV against the probe's streaming read over the same bytes on the same
/// threads, interleaved; prints every round and the median ratio.
fn decode_ratio(k: Kernels, experts: &[Expert], x: &[f32], h: &mut [f32], y: &mut [f32]) {
    let bytes = EXPERTS * 3 * F * D * 2;
    let threads = rayon::current_num_threads();
    let source: Vec<f32> = (0..bytes / 4).map(|i| (i % 1024) as f32 * 1e-3).collect();
    let mut checksum = 0.0f32;
    let mut ratios = Vec::with_capacity(RATIO_ROUNDS);
    let (mut best_read, mut best_gemv) = (f64::INFINITY, f64::INFINITY);
    for round in 0..RATIO_ROUNDS {
        let read = best(RATIO_REPS, || checksum += stream_read(&source));
        let gemv = best(RATIO_REPS, || {
            decode(k, experts, &x[..D], &mut h[..F], &mut y[..D])
        });
        best_read = best_read.min(read);
        best_gemv = best_gemv.min(gemv);
        ratios.push(read / gemv);
        println!(
            "ratio round {round}: streaming read {:.2} GB/s, {} decode GEMV {:.2} GB/s = {:.1}%",
            bytes as f64 / read / 1e9,
            k.isa(),
            bytes as f64 / gemv / 1e9,
            100.0 * read / gemv
        );
    }
    std::hint::black_box(checksum);
    ratios.sort_by(f64::total_cmp);
    println!(
        "{} decode GEMV, 1 token x {EXPERTS} experts x (gate, up, down) bf16 ({:.0} MB), {threads} threads: median of {RATIO_ROUNDS} interleaved rounds {:.1}% of the probe's streaming read over {:.0} MB on the same threads (lowest {:.1}%, highest {:.1}%); best times {:.2} ms = {:.2} GB/s against {:.2} GB/s = {:.1}%",
        k.isa(),
        bytes as f64 / 1e6,
        100.0 * ratios[RATIO_ROUNDS / 2],
        bytes as f64 / 1e6,
        100.0 * ratios[0],
        100.0 * ratios[RATIO_ROUNDS - 1],
        best_gemv * 1e3,
        bytes as f64 / best_gemv / 1e9,
        bytes as f64 / best_read / 1e9,
        100.0 * best_read / best_gemv
    );
}

/// Best wall time of `reps` runs after one warm-up (the probe reports its best too, so
/// the ratios compare like with like on a machine other jobs share).
fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn bench(c: &mut Criterion) {
    let threads = rayon::current_num_threads();
    let experts: Vec<Expert> = (0..EXPERTS).map(Expert::new).collect();
    let x: Vec<f32> = (0..PREFILL_ROWS * D)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let mut h = vec![0.0f32; PREFILL_ROWS * F];
    let mut y = vec![0.0f32; PREFILL_ROWS * D];
    decode_ratio(Kernels::process(), &experts, &x, &mut h, &mut y);
    let few_flops = 2.0 * 3.0 * (FEW_ROWS * F * D) as f64;
    let few_bytes = (3 * F * D * 2) as f64;
    let prefill_flops = 2.0 * (PREFILL_ROWS * F * D) as f64;
    // Other jobs share this machine: three rounds, each probing the machine beside the
    // kernels, and the summary compares the best of each (the probe reports its best too).
    let isas = Isa::supported();
    let mut best_peak = 0.0f64;
    let mut best_few = vec![f64::INFINITY; isas.len()];
    let mut best_prefill = vec![f64::INFINITY; isas.len()];
    for round in 0..3 {
        let probe = measure(256 << 20, threads).expect("probe");
        let peak = probe.gemm_f32_flops;
        best_peak = best_peak.max(peak);
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!(
            "round {round}: probe, {threads} threads: f32 GEMM peak {:.1} GFLOP/s (gemm crate, {}³); load average {}",
            peak / 1e9,
            probe.gemm_size,
            load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
        );
        for (i, &isa) in isas.iter().enumerate() {
            // The portable bodies take seconds per call here: one round is enough.
            if isa == Isa::Portable && round > 0 {
                continue;
            }
            let k = Kernels::new(isa).expect("supported");
            // One expert (22 MB, past what the 32 MiB last-level cache keeps beside
            // everything else): at 4 rows the kernel streams its weights from DRAM at
            // close to the streaming read, so the GB/s figure says as much as GFLOP/s.
            let secs = best(7, || {
                expert_rows(k, &experts[0], FEW_ROWS, &x, &mut h, &mut y)
            });
            best_few[i] = best_few[i].min(secs);
            let gate = view(&experts[0].gate, F, D);
            let psecs = best(3, || {
                k.linear(&x, PREFILL_ROWS, &gate, &mut h).expect("prefill");
            });
            best_prefill[i] = best_prefill[i].min(psecs);
            println!(
                "round {round}: {isa:>8} {FEW_ROWS}-row expert {:.2} ms = {:.1}% of its GEMM peak; prefill {:.2} ms = {:.1}% of its GEMM peak",
                secs * 1e3,
                100.0 * few_flops / secs / peak,
                psecs * 1e3,
                100.0 * prefill_flops / psecs / peak
            );
        }
    }
    println!(
        "best of 3 rounds: f32 GEMM peak {:.1} GFLOP/s",
        best_peak / 1e9
    );
    for (i, isa) in isas.iter().enumerate() {
        println!(
            "{isa:>8} expert GEMM, {FEW_ROWS} tokens x gate, up [{F} x {D}] (fused) and down [{D} x {F}] bf16: {:.2} ms, {:.1} GFLOP/s = {:.1}% of the f32 GEMM peak; its {:.0} MB of weights at {:.2} GB/s",
            best_few[i] * 1e3,
            few_flops / best_few[i] / 1e9,
            100.0 * few_flops / best_few[i] / best_peak,
            few_bytes / 1e6,
            few_bytes / best_few[i] / 1e9
        );
        println!(
            "{isa:>8} prefill GEMM, {PREFILL_ROWS} tokens x gate [{F} x {D}] bf16: {:.2} ms, {:.1} GFLOP/s = {:.1}% of the f32 GEMM peak",
            best_prefill[i] * 1e3,
            prefill_flops / best_prefill[i] / 1e9,
            100.0 * prefill_flops / best_prefill[i] / best_peak
        );
    }

    let k = Kernels::process();
    let mut group = c.benchmark_group(format!("mixtral-mid experts ({})", k.isa()));
    group.sample_size(10);
    group.throughput(Throughput::Bytes((EXPERTS * 3 * F * D * 2) as u64));
    group.bench_function("decode GEMV 1 token x 6 experts", |b| {
        b.iter(|| decode(k, &experts, &x[..D], &mut h[..F], &mut y[..D]))
    });
    group.throughput(Throughput::Elements(few_flops as u64));
    group.bench_function("expert GEMM 4 tokens x 1 expert (elem = flop)", |b| {
        b.iter(|| expert_rows(k, &experts[0], FEW_ROWS, &x, &mut h, &mut y))
    });
    let gate = view(&experts[0].gate, F, D);
    group.throughput(Throughput::Elements(prefill_flops as u64));
    group.bench_function("prefill GEMM 256 tokens x gate (elem = flop)", |b| {
        b.iter(|| k.linear(&x, PREFILL_ROWS, &gate, &mut h).expect("prefill"))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
