//! The decode step's few-row products on `mixtral-mid` (d 1024, ffn 3584, bf16 weights),
//! every body this CPU has, against the streaming read measured in the same rounds:
//!
//! - the expert FFN (gate and up fused, [`Kernels::linear_gated`], then down) at 1, 2, 4, 8
//!   and 16 rows, each pass through 6 experts in turn (132 MB, far past the caches, so every
//!   weight byte comes from DRAM once, as in a decode step where each routed expert is read
//!   once): a batch-8 decode step of Mixtral's top-2 routing gives each expert about 2 rows;
//! - the lm_head (`[32000, 1024]`, 65.5 MB) at 8 rows (the batch-8 step's last positions).
//!
//! Bodies: each instruction set's default (its few-row body where it has one) and the same
//! instruction set with every row count through the general register blocks
//! ([`Kernels::general_blocks`], what the AVX-512 kernels ran at every row count before the
//! AVX-512 few-row body). In each of [`ROUNDS`] interleaved rounds the probe's streaming
//! read ([`stream_read`]) times a buffer of the same bytes on the same threads, then each
//! body runs once after a warm-up (in reverse order every other round); the report is the
//! median over rounds of each body's GB/s, its ratio to the round's streaming read, and its
//! ratio to the general blocks of its instruction set in the same round (this machine's
//! bandwidth drifts between seconds, so only figures within one round compare like with
//! like). Where an instruction set has no few-row body at a row count (AVX2 from 8 rows)
//! its two bodies are the same code: their ratio is the noise floor of the run. Criterion then times the
//! process's kernels at 2 rows, few-row against general.
//!
//! Then the bf16 product (`MOEC_BF16_PRODUCT=bf16`, activations rounded to bf16, `vdpbf16ps`
//! where the CPU has AVX-512 BF16) against the default f32 product, on the process's
//! instruction set: one expert's FFN at 1, 8, 16, 98 (a 392-token prefill's rows per expert
//! under top-2 of 8) and 392 rows (the prefill's attention projections' row count), each
//! pass through the 6 experts in turn at up to 16 rows and through one expert beyond (the
//! work is then compute-bound); [`ROUNDS`] interleaved rounds, alternating which product
//! runs first; the report is each product's median GFLOP/s and the median per-round ratio.
//! Criterion then times both at 392 rows.

mod mixtral_mid;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mixtral_mid::{expert_rows, matrix, view, Expert, D, F};
use moec::engine::cpu_probe::stream_read;
use moec::math::isa::{Isa, Kernels};
use std::time::Instant;

const VOCAB: usize = 32000;
const EXPERTS: usize = 6;
const ROWS: [usize; 5] = [1, 2, 4, 8, 16];
const HEAD_ROWS: usize = 8;
/// Interleaved rounds.
const ROUNDS: usize = 9;

/// `rows` rows through every expert's FFN in turn.
fn experts_pass(
    k: Kernels,
    experts: &[Expert],
    rows: usize,
    x: &[f32],
    h: &mut [f32],
    y: &mut [f32],
) {
    for e in experts {
        expert_rows(k, e, rows, x, h, y);
    }
}

/// Wall time of one call after a warm-up call.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let s = Instant::now();
    f();
    s.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The bodies compared: each instruction set's default and its general blocks (portable
/// is left out: seconds per pass).
fn bodies() -> Vec<(String, Kernels)> {
    let mut out = Vec::new();
    for isa in Isa::supported() {
        if isa == Isa::Portable {
            continue;
        }
        let k = Kernels::new(isa).expect("supported");
        out.push((format!("{isa}"), k));
        out.push((format!("{isa} general"), k.general_blocks()));
    }
    out
}

/// One product kind's rounds: `run(kernels)` over `bytes` of weights, against the streaming
/// read of `source` (the same bytes); prints the medians.
fn compare(label: &str, bytes: usize, source: &[f32], mut run: impl FnMut(Kernels)) {
    let bodies = bodies();
    let mut checksum = 0.0f32;
    let mut gbs = vec![Vec::new(); bodies.len()];
    let mut of_read = vec![Vec::new(); bodies.len()];
    let mut of_general = vec![Vec::new(); bodies.len()];
    let mut reads = Vec::new();
    for round in 0..ROUNDS {
        let read = time(|| checksum += stream_read(source));
        reads.push(bytes as f64 / read / 1e9);
        // Every other round runs the bodies in reverse order, so no body always runs
        // first or last after the streaming read.
        let mut secs = vec![0.0f64; bodies.len()];
        let mut order: Vec<usize> = (0..bodies.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            secs[i] = time(|| run(bodies[i].1));
        }
        for (i, s) in secs.iter().enumerate() {
            gbs[i].push(bytes as f64 / s / 1e9);
            of_read[i].push(read / s);
            // Bodies come in pairs: default, then its general blocks.
            of_general[i].push(secs[i | 1] / s);
        }
    }
    std::hint::black_box(checksum);
    println!(
        "{label} ({:.0} MB): streaming read median {:.2} GB/s",
        bytes as f64 / 1e6,
        median(reads)
    );
    for (i, (name, _)) in bodies.iter().enumerate() {
        println!(
            "  {name:>16}: {:6.2} GB/s = {:5.1}% of the streaming read, {:.2}x its general blocks (medians of {ROUNDS} rounds)",
            median(gbs[i].clone()),
            100.0 * median(of_read[i].clone()),
            median(of_general[i].clone())
        );
    }
}

/// Activation rows of the f32-against-bf16 comparison (see the module doc).
const PRODUCT_ROWS: [usize; 5] = [1, 8, 16, 98, 392];

/// The bf16 product against the f32 one (see the module doc); prints the medians.
fn compare_products(experts: &[Expert], x: &[f32], h: &mut [f32], y: &mut [f32]) {
    let f32_product = Kernels::process();
    let bf16_product = f32_product.bf16_product();
    println!(
        "f32 against bf16 product, expert FFN [{F} x {D}] x 3 ({} kernels; shared machine: medians of {ROUNDS} rounds)",
        f32_product.isa()
    );
    for rows in PRODUCT_ROWS {
        let pass = if rows <= 16 { experts } else { &experts[..1] };
        let flops = (pass.len() * 2 * 3 * rows * D * F) as f64;
        let (mut a, mut b, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let mut run = |k: Kernels| time(|| experts_pass(k, pass, rows, x, h, y));
            let (sa, sb) = if round % 2 == 0 {
                let sa = run(f32_product);
                (sa, run(bf16_product))
            } else {
                let sb = run(bf16_product);
                (run(f32_product), sb)
            };
            a.push(flops / sa / 1e9);
            b.push(flops / sb / 1e9);
            ratio.push(sa / sb);
        }
        println!(
            "  {rows:>3} rows x {} expert(s): f32 {:7.1} GFLOP/s, bf16 {:7.1} GFLOP/s, bf16 {:.2}x f32",
            pass.len(),
            median(a),
            median(b),
            median(ratio)
        );
    }
}

fn bench(c: &mut Criterion) {
    let threads = rayon::current_num_threads();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{threads} threads; load average {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let experts: Vec<Expert> = (0..EXPERTS).map(Expert::new).collect();
    let max_rows = PRODUCT_ROWS[PRODUCT_ROWS.len() - 1];
    let x: Vec<f32> = (0..max_rows * F)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let mut h = vec![0.0f32; max_rows * F];
    let mut y = vec![0.0f32; max_rows * VOCAB];
    let bytes = EXPERTS * 3 * F * D * 2;
    let source: Vec<f32> = (0..bytes / 4).map(|i| (i % 1024) as f32 * 1e-3).collect();
    for rows in ROWS {
        compare(
            &format!("expert FFN, {rows} rows x {EXPERTS} experts"),
            bytes,
            &source,
            |k| experts_pass(k, &experts, rows, &x, &mut h, &mut y),
        );
    }
    let head = matrix(7, VOCAB * D);
    let head_bytes = VOCAB * D * 2;
    compare(
        &format!("lm_head, {HEAD_ROWS} rows x [{VOCAB} x {D}]"),
        head_bytes,
        &source[..head_bytes / 4],
        |k| {
            k.linear(
                &x[..HEAD_ROWS * D],
                HEAD_ROWS,
                &view(&head, VOCAB, D),
                &mut y[..HEAD_ROWS * VOCAB],
            )
            .expect("lm_head")
        },
    );

    compare_products(&experts, &x, &mut h, &mut y);

    let k = Kernels::process();
    let mut group = c.benchmark_group(format!("mixtral-mid expert at 392 rows ({})", k.isa()));
    group.sample_size(10);
    group.throughput(Throughput::Elements((2 * 3 * 392 * D * F) as u64));
    for (name, kk) in [("f32 product", k), ("bf16 product", k.bf16_product())] {
        group.bench_function(format!("{name}: 392 rows x 1 expert (elem = flop)"), |b| {
            b.iter(|| experts_pass(kk, &experts[..1], 392, &x, &mut h, &mut y))
        });
    }
    group.finish();

    let mut group = c.benchmark_group(format!("mixtral-mid experts at 2 rows ({})", k.isa()));
    group.sample_size(10);
    group.throughput(Throughput::Bytes(bytes as u64));
    for (name, kk) in [("few-row", k), ("general", k.general_blocks())] {
        group.bench_function(format!("{name}: 2 rows x 6 experts"), |b| {
            b.iter(|| experts_pass(kk, &experts, 2, &x, &mut h, &mut y))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
