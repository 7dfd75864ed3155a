//! The expert projections of `mixtral-mid` (d 1024, ffn 3584, bf16 weights) through
//! [`Kernels::linear`], against this machine's limits measured in the same run by
//! `moec probe`'s kernels (`cost::probe::measure`): the streaming read bandwidth and the
//! f32 GEMM peak (the `gemm` crate, 1024³, all threads).
//!
//! - decode: one token through gate and up (fused, [`Kernels::linear_gated`]) and down of
//!   each of 6 experts in turn (132 MB of weights, far larger than the caches), so every
//!   weight byte comes from DRAM once:
//!   bytes / time over the streaming bandwidth is the GEMV's efficiency (goal >= 85%);
//! - prefill: 256 gathered tokens through one expert's gate projection: FLOP/s over the
//!   GEMM peak (goal >= 70%).
//!
//! Each figure is printed for every instruction set this CPU has (portable is what ran on
//! AVX2-only machines before the AVX2 bodies existed), so before/after ratios come from
//! one run; three rounds, each probing beside the kernels, and a best-of summary (other
//! jobs share the cores). Criterion then times the selected kernels.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use moec::cost::probe::measure;
use moec::model::kernels::isa::{Isa, Kernels};
use moec::model::tensor::{Matrix, Orientation, TypedSlice};
use std::time::Instant;

const D: usize = 1024;
const F: usize = 3584;
const EXPERTS: usize = 6;
const PREFILL_ROWS: usize = 256;

/// One expert's three bf16 matrices, `[out, in]` as Hugging Face stores them.
struct Expert {
    gate: Vec<bf16>,
    up: Vec<bf16>,
    down: Vec<bf16>,
}

fn matrix(seed: usize, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|i| bf16::from_f32((((i + seed) * 7919) % 2003) as f32 / 20030.0 - 0.05))
        .collect()
}

fn view(w: &[bf16], rows: usize, cols: usize) -> Matrix<'_> {
    Matrix::new(TypedSlice::Bf16(w), rows, cols, Orientation::OutIn).expect("shape")
}

/// `silu(x) = x * sigmoid(x)`, the experts' activation.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Decode: one row through every expert's gate and up (one fused pass, as the MoE block
/// runs them) and down.
fn decode(k: Kernels, experts: &[Expert], x: &[f32], h: &mut [f32], y: &mut [f32]) {
    for e in experts {
        k.linear_gated(x, 1, &view(&e.gate, F, D), &view(&e.up, F, D), silu, h)
            .expect("gate and up");
        k.linear(h, 1, &view(&e.down, D, F), y).expect("down");
    }
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
    let experts: Vec<Expert> = (0..EXPERTS)
        .map(|e| Expert {
            gate: matrix(3 * e, F * D),
            up: matrix(3 * e + 1, F * D),
            down: matrix(3 * e + 2, D * F),
        })
        .collect();
    let x: Vec<f32> = (0..PREFILL_ROWS * D)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let mut h = vec![0.0f32; PREFILL_ROWS * F];
    let mut y = vec![0.0f32; D];
    let decode_bytes = (EXPERTS * 3 * F * D * 2) as f64;
    let prefill_flops = 2.0 * (PREFILL_ROWS * F * D) as f64;
    // Other jobs share this machine: three rounds, each probing the machine beside the
    // kernels, and the summary compares the best of each (the probe reports its best too).
    let isas = Isa::supported();
    let mut best_bw = 0.0f64;
    let mut best_peak = 0.0f64;
    let mut best_decode = vec![f64::INFINITY; isas.len()];
    let mut best_prefill = vec![f64::INFINITY; isas.len()];
    for round in 0..3 {
        let probe = measure(256 << 20, threads).expect("probe");
        let (bw, peak) = (probe.stream_read_bytes_per_s, probe.gemm_f32_flops);
        best_bw = best_bw.max(bw);
        best_peak = best_peak.max(peak);
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!(
            "round {round}: probe, {threads} threads: streaming read {:.2} GB/s, f32 GEMM peak {:.1} GFLOP/s (gemm crate, {}³); load average {}",
            bw / 1e9,
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
            let secs = best(7, || decode(k, &experts, &x[..D], &mut h[..F], &mut y));
            best_decode[i] = best_decode[i].min(secs);
            let gate = view(&experts[0].gate, F, D);
            let psecs = best(3, || {
                k.linear(&x, PREFILL_ROWS, &gate, &mut h).expect("prefill");
            });
            best_prefill[i] = best_prefill[i].min(psecs);
            println!(
                "round {round}: {isa:>8} decode {:.2} ms = {:.1}% of this round's streaming read; prefill {:.2} ms = {:.1}% of its GEMM peak",
                secs * 1e3,
                100.0 * decode_bytes / secs / bw,
                psecs * 1e3,
                100.0 * prefill_flops / psecs / peak
            );
        }
    }
    println!(
        "best of 3 rounds: streaming read {:.2} GB/s, f32 GEMM peak {:.1} GFLOP/s",
        best_bw / 1e9,
        best_peak / 1e9
    );
    for (i, isa) in isas.iter().enumerate() {
        println!(
            "{isa:>8} decode GEMV, 1 token x {EXPERTS} experts x (gate, up, down) bf16: {:.2} ms, {:.2} GB/s = {:.1}% of the streaming read",
            best_decode[i] * 1e3,
            decode_bytes / best_decode[i] / 1e9,
            100.0 * decode_bytes / best_decode[i] / best_bw
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
    group.throughput(Throughput::Bytes(decode_bytes as u64));
    group.bench_function("decode GEMV 1 token x 6 experts", |b| {
        b.iter(|| decode(k, &experts, &x[..D], &mut h[..F], &mut y))
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
