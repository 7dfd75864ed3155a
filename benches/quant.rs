//! Quantised expert products ([`QuantKernels::quant_linear`]) against the bf16 product
//! of the same shape ([`Kernels::linear`]), measured in the same run.
//!
//! Shapes: the expert down projections of `mixtral-mid` (`[1024, 3584]`, out x in) and of
//! Mixtral-8x7B (`[4096, 14336]`), Q4_K as llama.cpp's Q4_K_M stores `ffn_gate/up_exps`,
//! both in ggml's row layout and in the tiles of eight rows the CPU backend repacks Q4_K
//! and Q6_K into at load ("Q4_K tiles", "Q6_K tiles"),
//! (and Q6_K, Q5_K, Q8_0 and the group-wise int4 Q4_0, Q4_1 for the small shape). Each timed call multiplies the same
//! activation rows with every matrix of a set of distinct experts in turn, enough experts
//! that the quantised set (>= 64 MB) exceeds the 32 MiB L3, so the weights stream from
//! DRAM as an offloaded expert's would. Rows: 1, 2, 4, 8, 16, 64 (a decode step's rows per
//! expert at batch 1 to 512).
//!
//! Printed per point: the quantised product's time and GB/s of weight bytes, the bf16
//! product's time and GB/s, and the speed-up (bf16 time / quantised time), each the
//! median of [`ROUNDS`] interleaved rounds (quantised then bf16 in each round, so both
//! see the same machine load). First, the small shape on a one-thread pool timed by that
//! thread's CPU time (other processes on shared cores inflate wall time far more than
//! CPU time; `QUANT_BENCH_ONE_THREAD_ONLY=1` stops after it, `QUANT_BENCH_FORMAT=Q8_0`
//! runs only that format's set and stops, `QUANT_BENCH_GPTOSS=1` runs only the gpt-oss
//! shapes, [`gpt_oss`]); then wall time on all
//! threads; then the bodies against each other (portable, AVX2, AVX-512 VNNI where this
//! CPU has them) at the small shape, and criterion's timing of the selected body at 1
//! and 16 rows. `QUANT_BENCH_MANY=1` runs only DeepSeek-V2-Lite's prefill shapes at many
//! rows, the unpacked-tile passes against the ones before them ([`many_rows`]);
//! `QUANT_BENCH_PACK=1` the same shapes from tiles made at load, packed as the product
//! runs and the row layout in place ([`packed`]);
//! `QUANT_BENCH_FEW=1` the tile bodies at 1-8 rows from DRAM and from the cache, the
//! few-row passes against the ones before them ([`few_rows`]; with `QUANT_BENCH_FORMAT`,
//! that format's shapes only); `QUANT_BENCH_DECODE=1` (all threads, wall time) or `=cpu`
//! (one thread, CPU time) OLMoE-1B-7B Q4_K_M's batch-1 decode products op by op against
//! the streaming read, each kernel set with the Q6_K one-row prefetch on and off
//! ([`olmoe_decode`]).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use moec::engine::cpu_probe::stream_read;
use moec::math::isa::Kernels;
use moec::math::qmatmul::select::describe;
use moec::math::qmatmul::{QuantBody, QuantKernels, QuantMatrix, QuantProduct};
use moec::math::tensor::{Matrix, TypedSlice};
use moec::model::vocab::Orientation;
use moec::model::{ArchSpec, ModelCard};
use moec::quant::{QuantFormat, QuantSlice};
use std::time::Instant;

/// Interleaved rounds per point (the median is printed).
const ROUNDS: usize = 5;

/// Rows per product.
const ROWS: [usize; 6] = [1, 2, 4, 8, 16, 64];

/// Bytes the quantised set of experts must exceed (twice the L3).
const SET_BYTES: usize = 64 << 20;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 24
    }
}

/// Random blocks of `format` with f16 scales of magnitude below 0.01 (any bytes are a
/// valid block once the scales are finite).
fn quant_bytes(format: QuantFormat, elems: usize, seed: u64) -> Vec<u8> {
    let mut rng = Lcg(seed);
    let bb = format.block_bytes();
    let mut bytes: Vec<u8> = (0..elems / format.block_elems() * bb)
        .map(|_| rng.next() as u8)
        .collect();
    let fields: &[usize] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
        QuantFormat::Mxfp4 => &[],
    };
    for block in bytes.chunks_exact_mut(bb) {
        for &at in fields {
            let v = (rng.next() % 1000) as f32 / 1.0e5 + 1.0e-4;
            block[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
        if format == QuantFormat::Mxfp4 {
            // e8m0 exponent: half scales 2^-12 .. 2^-9, the size of the others' weights.
            block[0] = 116 + (rng.next() % 4) as u8;
        }
    }
    bytes
}

fn bf16_matrix(elems: usize, seed: u64) -> Vec<bf16> {
    let mut rng = Lcg(seed);
    (0..elems)
        .map(|_| bf16::from_f32((rng.next() % 2001) as f32 / 20000.0 - 0.05))
        .collect()
}

/// One shape's expert set in both storages.
struct Set {
    out: usize,
    inp: usize,
    format: QuantFormat,
    /// The blocks in tiles of eight rows, as the CPU backend repacks them at load
    /// (`moec::math::qmatmul::tiles`).
    tiled: bool,
    quant: Vec<Vec<u8>>,
    dense: Vec<Vec<bf16>>,
}

impl Set {
    fn new(format: QuantFormat, out: usize, inp: usize) -> Self {
        let bytes = format.bytes_for(out * inp).expect("whole blocks");
        let n = SET_BYTES.div_ceil(bytes);
        Set {
            out,
            inp,
            format,
            tiled: false,
            quant: (0..n)
                .map(|e| quant_bytes(format, out * inp, e as u64 + 1))
                .collect(),
            dense: (0..n)
                .map(|e| bf16_matrix(out * inp, e as u64 + 7))
                .collect(),
        }
    }

    /// The same set with its matrices in tiles.
    fn into_tiles(mut self) -> Self {
        for q in &mut self.quant {
            let mut t = vec![0u8; q.len()];
            assert!(moec::math::qmatmul::tiles::tile(
                self.format,
                q,
                self.out,
                self.inp,
                &mut t
            ));
            *q = t;
        }
        self.tiled = true;
        self
    }

    /// The format's name, and the layout when tiled.
    fn label(&self) -> String {
        if self.tiled {
            format!("{} tiles", self.format)
        } else {
            self.format.to_string()
        }
    }

    fn quant_bytes(&self) -> usize {
        self.quant.iter().map(Vec::len).sum()
    }

    fn run_quant(&self, k: QuantKernels, x: &[f32], rows: usize, y: &mut [f32]) {
        for q in &self.quant {
            let slice = if self.tiled {
                QuantSlice::tiled(q, self.format, self.out * self.inp, self.inp)
            } else {
                QuantSlice::new(q, self.format, self.out * self.inp)
            }
            .expect("slice");
            let m = QuantMatrix::new(slice, self.out, self.inp).expect("matrix");
            k.quant_linear(&m, x, rows, y).expect("quant product");
        }
    }

    fn run_dense(&self, k: Kernels, x: &[f32], rows: usize, y: &mut [f32]) {
        for d in &self.dense {
            let m = Matrix::new(TypedSlice::Bf16(d), self.out, self.inp, Orientation::OutIn)
                .expect("matrix");
            k.linear(x, rows, &m, y).expect("bf16 product");
        }
    }
}

/// CPU seconds the calling thread has run (robust against other processes sharing the
/// cores, unlike wall time; used on a one-thread pool, where the work runs on one thread).
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Quantised against bf16 on one thread, timed by that thread's CPU time.
fn one_thread(set: &Set, qk: QuantKernels, k: Kernels) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    println!(
        "one thread, CPU time: {} [{}, {}] x {} experts, body {}:",
        set.label(),
        set.out,
        set.inp,
        set.quant.len(),
        qk.body()
    );
    let qb = set.quant_bytes() as f64;
    for rows in ROWS {
        let x = activations(rows, set.inp);
        let mut y = vec![0.0f32; rows * set.out];
        let (mut tq, mut td) = (Vec::new(), Vec::new());
        pool.install(|| {
            set.run_quant(qk, &x, rows, &mut y);
            set.run_dense(k, &x, rows, &mut y);
            for _ in 0..ROUNDS {
                let t0 = thread_cpu_seconds();
                set.run_quant(qk, &x, rows, &mut y);
                let t1 = thread_cpu_seconds();
                set.run_dense(k, &x, rows, &mut y);
                tq.push(t1 - t0);
                td.push(thread_cpu_seconds() - t1);
            }
        });
        let (tq, td) = (median(tq), median(td));
        let macs = (rows * set.out * set.inp * set.quant.len()) as f64;
        println!(
            "  {rows:>2} rows: {:>8.2} ms ({:>5.1} GMAC/s, {:>5.2} GB/s) | bf16 {:>8.2} ms ({:>5.1} GMAC/s) | bf16 time / quant time {:.2}",
            tq * 1e3,
            macs / tq / 1e9,
            qb / tq / 1e9,
            td * 1e3,
            macs / td / 1e9,
            td / tq
        );
    }
}

fn seconds(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn activations(rows: usize, inp: usize) -> Vec<f32> {
    let mut rng = Lcg(99);
    (0..rows * inp)
        .map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// Quantised against bf16 for every row count of one shape.
fn against_bf16(set: &Set, qk: QuantKernels, k: Kernels) {
    let (qb, db) = (
        set.quant_bytes() as f64,
        (set.dense.len() * set.out * set.inp * 2) as f64,
    );
    println!(
        "{} [{}, {}] x {} experts ({:.0} MB; bf16 {:.0} MB), body {}:",
        set.label(),
        set.out,
        set.inp,
        set.quant.len(),
        qb / 1e6,
        db / 1e6,
        qk.body()
    );
    for rows in ROWS {
        let x = activations(rows, set.inp);
        let mut y = vec![0.0f32; rows * set.out];
        set.run_quant(qk, &x, rows, &mut y);
        set.run_dense(k, &x, rows, &mut y);
        let (mut tq, mut td) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            tq.push(seconds(|| set.run_quant(qk, &x, rows, &mut y)));
            td.push(seconds(|| set.run_dense(k, &x, rows, &mut y)));
        }
        let ratios: Vec<f64> = td.iter().zip(&tq).map(|(d, q)| d / q).collect();
        let (tq, td) = (median(tq), median(td));
        println!(
            "  {rows:>2} rows: {:>8.2} ms {:>6.2} GB/s | bf16 {:>8.2} ms {:>6.2} GB/s | bf16 time / quant time {:.2} (median of {ROUNDS} rounds)",
            tq * 1e3,
            qb / tq / 1e9,
            td * 1e3,
            db / td / 1e9,
            median(ratios)
        );
    }
}

/// Every body this CPU has at the small shape, against the selected one.
fn bodies(set: &Set) {
    println!(
        "bodies, {} [{}, {}] x {} experts:",
        set.label(),
        set.out,
        set.inp,
        set.quant.len()
    );
    for rows in [1, 16] {
        let x = activations(rows, set.inp);
        let mut y = vec![0.0f32; rows * set.out];
        let mut line = format!("  {rows:>2} rows:");
        for body in QuantBody::supported() {
            let qk = QuantKernels::new(body).expect("supported");
            set.run_quant(qk, &x, rows, &mut y);
            let t = median(
                (0..ROUNDS)
                    .map(|_| seconds(|| set.run_quant(qk, &x, rows, &mut y)))
                    .collect(),
            );
            line += &format!(
                " {body} {:.2} ms ({:.2} GB/s);",
                t * 1e3,
                set.quant_bytes() as f64 / t / 1e9
            );
        }
        println!("{line}");
    }
}

/// gpt-oss-20b's products in ggml's row layout against the same matrices in tiles, the
/// two interleaved in each round (same machine load): its MXFP4 experts' fused gate/up
/// `[5760, 2880]` and down `[2880, 2880]`, and its Q8_0 `q_proj` `[4096, 2880]` (rows of
/// 2,880 weights: 11 tile columns and a partial one of two blocks), at 1, 8 and 32 rows
/// (a decode step's rows per expert at small batches; per dense matrix: the batch), on
/// all threads (wall time) and on one thread (its CPU time). Sets of >= 64 MB, so the
/// weights stream from DRAM as a decode step's routed experts do.
fn gpt_oss(qk: QuantKernels) {
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    // `QUANT_BENCH_GPTOSS=all` adds Q4_0 at gpt-oss's width and Qwen3-30B-A3B's Q4_K
    // expert gate `[768, 2048]` and Q6_K expert down `[2048, 768]` (the other tiled formats).
    let all = std::env::var("QUANT_BENCH_GPTOSS").is_ok_and(|v| v == "all");
    let mut shapes = vec![
        (QuantFormat::Mxfp4, 5760, 2880, "expert gate_up"),
        (QuantFormat::Mxfp4, 2880, 2880, "expert down"),
        (QuantFormat::Q8_0, 4096, 2880, "q_proj"),
    ];
    if all {
        shapes.extend([
            (QuantFormat::Q4_0, 4096, 2880, "Q4_0 at q_proj's shape"),
            (QuantFormat::Q4K, 768, 2048, "Qwen3 expert gate"),
            (QuantFormat::Q6K, 2048, 768, "Qwen3 expert down"),
        ]);
    }
    for (format, out, inp, what) in shapes {
        let rows_set = Set::new(format, out, inp);
        let tiles = Set::new(format, out, inp).into_tiles();
        let gb = rows_set.quant_bytes() as f64 / 1e9;
        println!(
            "gpt-oss {what}: {format} [{out}, {inp}] x {} matrices ({:.0} MB), body {}:",
            rows_set.quant.len(),
            gb * 1e3,
            qk.body()
        );
        for rows in [1, 8, 32] {
            let x = activations(rows, inp);
            let mut y = vec![0.0f32; rows * out];
            let mut line = format!("  {rows} rows:");
            for (label, threads) in [("all threads, wall", None), ("one thread, CPU", Some(&one))] {
                let (mut tr, mut tt) = (Vec::new(), Vec::new());
                let time = |set: &Set, y: &mut [f32]| match threads {
                    None => seconds(|| set.run_quant(qk, &x, rows, y)),
                    Some(pool) => pool.install(|| {
                        let t0 = thread_cpu_seconds();
                        set.run_quant(qk, &x, rows, y);
                        thread_cpu_seconds() - t0
                    }),
                };
                time(&rows_set, &mut y);
                time(&tiles, &mut y);
                for _ in 0..ROUNDS {
                    tr.push(time(&rows_set, &mut y));
                    tt.push(time(&tiles, &mut y));
                }
                let (tr, tt) = (median(tr), median(tt));
                line += &format!(
                    " {label}: rows {:.2} GB/s, tiles {:.2} GB/s ({:.2}x);",
                    gb / tr,
                    gb / tt,
                    tr / tt
                );
            }
            println!("{line}");
        }
    }
}

/// Tiles made at load against tiles packed as the product runs (`QUANT_BENCH_PACK=1`):
/// DeepSeek-V2-Lite's prefill shapes ([`many_rows`]'s) at 1 to 128 activation rows, each
/// set three ways, one thread timed by its CPU time, interleaved rounds: from tiles made
/// at load (`MOEC_QUANT_TILES=load`), from the row layout packed a panel at a time
/// (`pack`, at every row count here) and from the row layout in place (`off`). What
/// [`moec::math::qmatmul::tiles::pack_min_rows`] is chosen from.
fn packed(qk: QuantKernels) {
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let (load, pack, rows_k) = (
        qk.with_pack_rows(None),
        qk.with_pack_rows(Some(1)),
        qk.with_pack_rows(None),
    );
    let shapes = [
        (QuantFormat::Q6K, 1408, 2048, "expert gate/up"),
        (QuantFormat::Q8_0, 2048, 1408, "expert down"),
        (QuantFormat::Q6K, 2048, 2816, "shared experts' down"),
        (QuantFormat::Q4K, 1408, 2048, "Q4_K at the gate's shape"),
    ];
    for (format, out, inp, what) in shapes {
        let mut plain = Set::new(format, out, inp);
        plain.dense.clear();
        let mut tiles = Set::new(format, out, inp).into_tiles();
        tiles.dense.clear();
        let all = plain.quant.len();
        println!(
            "packed, {what}: {format} [{out}, {inp}] x {all} matrices, body {}, one thread (CPU time), ms per matrix: tiles at load / packed / row layout in place",
            qk.body()
        );
        for rows in [1usize, 4, 8, 16, 32, 48, 128] {
            let used = matrices_timed(all, rows);
            let x = activations(rows, inp);
            let mut y = vec![0.0f32; rows * out];
            let (pf, tf) = (
                std::mem::take(&mut plain.quant),
                std::mem::take(&mut tiles.quant),
            );
            plain.quant = pf[..used].to_vec();
            tiles.quant = tf[..used].to_vec();
            let mut t = [Vec::new(), Vec::new(), Vec::new()];
            one.install(|| {
                let runs: [(&Set, QuantKernels); 3] =
                    [(&tiles, load), (&plain, pack), (&plain, rows_k)];
                for round in 0..=ROUNDS {
                    for i in 0..3 {
                        let (set, k) = runs[(i + round) % 3];
                        let t0 = thread_cpu_seconds();
                        set.run_quant(k, &x, rows, &mut y);
                        if round > 0 {
                            t[(i + round) % 3].push((thread_cpu_seconds() - t0) / used as f64);
                        }
                    }
                }
            });
            let [a, b, c] = t.map(median);
            println!(
                "  {rows:>3} rows x {used:>2}: {:.3} / {:.3} / {:.3} ms (packed / at load {:.2}x, in place / at load {:.2}x)",
                1e3 * a,
                1e3 * b,
                1e3 * c,
                b / a,
                c / a
            );
            plain.quant = pf;
            tiles.quant = tf;
        }
    }
}

/// DeepSeek-V2-Lite's prefill products from tiles at many rows (`QUANT_BENCH_MANY=1`):
/// its routed experts' Q6_K gate/up `[1408, 2048]` and Q8_0 down `[2048, 1408]` (1,408 is
/// not whole 256-weight blocks), its shared experts' Q6_K down `[2048, 2816]`, and Q4_K at
/// the gate's shape (the format whose tiles keep up), at 16, 48, 128 and 512 rows (a
/// 512-token prompt gives each of the 64 routed experts about 48 rows, the shared
/// experts and the attention projections all 512). One thread, timed by its CPU time;
/// each round runs the unpacked-tile passes (`QuantKernels::with_unpacked_tiles(true)`,
/// the default) and the passes before them (`false`) on the same matrices, alternating
/// which goes first; printed: each one's median GMAC/s and GB/s of weights and the
/// median per-round ratio (old time / new time). Up to 48 rows the set holds >= 64 MB so
/// the weights stream from DRAM as a prefill's experts do; above, fewer matrices (the
/// product is compute-bound there). Then criterion times both at 48 rows on all threads.
fn many_rows(c: &mut Criterion, qk: QuantKernels) {
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let (new, old) = (qk.with_unpacked_tiles(true), qk.with_unpacked_tiles(false));
    let shapes = [
        (QuantFormat::Q6K, 1408, 2048, "expert gate/up"),
        (QuantFormat::Q8_0, 2048, 1408, "expert down"),
        (QuantFormat::Q6K, 2048, 2816, "shared experts' down"),
        (QuantFormat::Q4K, 1408, 2048, "Q4_K at the gate's shape"),
    ];
    let mut sets = Vec::new();
    for (format, out, inp, what) in shapes {
        let mut set = Set::new(format, out, inp).into_tiles();
        let all = set.quant.len();
        println!(
            "many rows, {what}: {format} tiles [{out}, {inp}] x {all} matrices, body {}, one thread (CPU time):",
            qk.body()
        );
        for rows in [16, 48, 128, 512] {
            let used = matrices_timed(all, rows);
            let x = activations(rows, inp);
            let mut y = vec![0.0f32; rows * out];
            let (mut tn, mut to) = (Vec::new(), Vec::new());
            let full = std::mem::take(&mut set.quant);
            set.quant = full[..used].to_vec();
            one.install(|| {
                let time = |k: QuantKernels, y: &mut [f32]| {
                    let t0 = thread_cpu_seconds();
                    set.run_quant(k, &x, rows, y);
                    thread_cpu_seconds() - t0
                };
                time(new, &mut y);
                time(old, &mut y);
                for round in 0..ROUNDS {
                    if round % 2 == 0 {
                        tn.push(time(new, &mut y));
                        to.push(time(old, &mut y));
                    } else {
                        to.push(time(old, &mut y));
                        tn.push(time(new, &mut y));
                    }
                }
            });
            let ratio = median(to.iter().zip(&tn).map(|(o, n)| o / n).collect());
            let (tn, to) = (median(tn), median(to));
            let macs = (rows * out * inp * used) as f64;
            let gb = set.quant_bytes() as f64 / 1e9;
            println!(
                "  {rows:>3} rows x {used:>2}: new {:>6.1} GMAC/s ({:>5.2} GB/s) | old {:>6.1} GMAC/s ({:>5.2} GB/s) | old time / new time {ratio:.2}",
                macs / tn / 1e9,
                gb / tn,
                macs / to / 1e9,
                gb / to,
            );
            set.quant = full;
        }
        sets.push(set);
    }
    let mut group = c.benchmark_group("quant many rows");
    group.sample_size(10);
    for set in sets.iter_mut().take(2) {
        let rows = 48;
        set.quant.truncate(8);
        let x = activations(rows, set.inp);
        let mut y = vec![0.0f32; rows * set.out];
        for (name, k) in [("unpacked", new), ("before", old)] {
            group.bench_function(
                format!(
                    "{} [{}, {}] x 8, {rows} rows, {name}",
                    set.label(),
                    set.out,
                    set.inp
                ),
                |b| b.iter(|| set.run_quant(k, &x, rows, &mut y)),
            );
        }
    }
    group.finish();
}

/// Bytes a cache-resident set holds at most (one matrix when a single one is bigger): a
/// quarter of the 32 MiB L3, so the set stays in it between rounds.
const CACHED_BYTES: usize = 8 << 20;

/// The tile bodies at a decode step's rows per expert (`QUANT_BENCH_FEW=1`): 1, 2, 4 and
/// 8 activation rows over gpt-oss-20b's MXFP4 experts (fused gate_up `[5760, 2880]`, down
/// `[2880, 2880]`), DeepSeek-V2-Lite's Q6_K expert gate/up `[1408, 2048]` and MLA `q_proj`
/// `[3072, 2048]` and its Q8_0 expert down `[2048, 1408]`, and Qwen3-30B-A3B's Q4_K expert
/// gate `[768, 2048]` (the tiles whose rate the others should reach), all in tiles. Each
/// shape on a set bigger than the L3 (>= 64 MB: the weights stream from DRAM, as a decode
/// step's do) and on a cache-resident one ([`CACHED_BYTES`]: whether the body keeps up with
/// the memory or is bound by its own instructions). One thread, timed by its CPU time;
/// each round runs the few-row passes (`QuantKernels::with_few_row_passes(true)`, the
/// default) and the passes before them (`false`) on the same matrices, alternating which
/// goes first; printed: each one's median GB/s of weights (and GMAC/s), and the median
/// per-round ratio (old time / new time).
fn few_rows(qk: QuantKernels) {
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let (new, old) = (qk.with_few_row_passes(true), qk.with_few_row_passes(false));
    let only = std::env::var("QUANT_BENCH_FORMAT").ok();
    let shapes = [
        (QuantFormat::Mxfp4, 5760, 2880, "gpt-oss expert gate_up"),
        (QuantFormat::Mxfp4, 2880, 2880, "gpt-oss expert down"),
        (QuantFormat::Q4K, 768, 2048, "Qwen3 expert gate"),
        (
            QuantFormat::Q6K,
            1408,
            2048,
            "DeepSeek-V2-Lite expert gate/up",
        ),
        (QuantFormat::Q6K, 3072, 2048, "DeepSeek-V2-Lite q_proj"),
        (
            QuantFormat::Q8_0,
            2048,
            1408,
            "DeepSeek-V2-Lite expert down",
        ),
    ];
    for (format, out, inp, what) in shapes {
        if only.as_deref().is_some_and(|name| name != format.name()) {
            continue;
        }
        let mut set = Set::new(format, out, inp).into_tiles();
        let all = set.quant.len();
        let cached = (CACHED_BYTES / set.quant[0].len()).max(1);
        println!(
            "few rows, {what}: {format} tiles [{out}, {inp}], body {}, one thread (CPU time), {all} matrices from DRAM / {cached} cached:",
            qk.body()
        );
        for rows in [1, 2, 4, 8] {
            let x = activations(rows, inp);
            let mut y = vec![0.0f32; rows * out];
            let mut line = format!("  {rows} rows:");
            for (label, used) in [("DRAM", all), ("cached", cached)] {
                let full = std::mem::take(&mut set.quant);
                set.quant = full[..used].to_vec();
                // The cached set is small: enough passes per timing for a few ms.
                let reps = (all / used).max(1);
                let (mut tn, mut to) = (Vec::new(), Vec::new());
                one.install(|| {
                    let time = |k: QuantKernels, y: &mut [f32]| {
                        let t0 = thread_cpu_seconds();
                        for _ in 0..reps {
                            set.run_quant(k, &x, rows, y);
                        }
                        thread_cpu_seconds() - t0
                    };
                    time(new, &mut y);
                    time(old, &mut y);
                    for round in 0..ROUNDS {
                        if round % 2 == 0 {
                            tn.push(time(new, &mut y));
                            to.push(time(old, &mut y));
                        } else {
                            to.push(time(old, &mut y));
                            tn.push(time(new, &mut y));
                        }
                    }
                });
                let ratio = median(to.iter().zip(&tn).map(|(o, n)| o / n).collect());
                let (tn, to) = (median(tn), median(to));
                let gb = (set.quant_bytes() * reps) as f64 / 1e9;
                let macs = (rows * out * inp * used * reps) as f64;
                line += &format!(
                    " {label}: new {:>5.2} GB/s ({:>5.1} GMAC/s), old {:>5.2} GB/s, old/new {ratio:.2};",
                    gb / tn,
                    macs / tn / 1e9,
                    gb / to,
                );
                set.quant = full;
            }
            println!("{line}");
        }
    }
}

/// The tiled bytes of one random `[out, inp]` matrix of `format`.
fn tiled_matrix(format: QuantFormat, out: usize, inp: usize, seed: u64) -> Vec<u8> {
    let plain = quant_bytes(format, out * inp, seed);
    let mut t = vec![0u8; plain.len()];
    assert!(moec::math::qmatmul::tiles::tile(
        format, &plain, out, inp, &mut t
    ));
    t
}

/// A tiled matrix's view.
fn tiled_view(bytes: &[u8], format: QuantFormat, out: usize, inp: usize) -> QuantMatrix<'_> {
    let q = QuantSlice::tiled(bytes, format, out * inp, inp).expect("tiles");
    QuantMatrix::new(q, out, inp).expect("matrix")
}

/// One synthetic OLMoE-1B-7B layer as its Q4_K_M file stores the matrices a batch-1 decode
/// step reads, in tiles: q, k, o Q4_K; v and the experts' down Q6_K in `more_bits` layers
/// (llama.cpp's `use_more_bits`: half of OLMoE's 16), Q4_K otherwise; the step's 8 routed
/// experts' gate and up Q4_K.
struct DecodeLayer {
    /// q, k, v, o: `[hidden, hidden]`.
    attn: [(Vec<u8>, QuantFormat); 4],
    /// Per expert: gate, up `[ffn, hidden]`, down `[hidden, ffn]`.
    experts: Vec<[(Vec<u8>, QuantFormat); 3]>,
}

impl DecodeLayer {
    fn new(d: usize, f: usize, top_k: usize, more_bits: bool, seed: u64) -> Self {
        let wide = if more_bits {
            QuantFormat::Q6K
        } else {
            QuantFormat::Q4K
        };
        let m = |format, out, inp, s: u64| (tiled_matrix(format, out, inp, seed * 100 + s), format);
        DecodeLayer {
            attn: [
                m(QuantFormat::Q4K, d, d, 0),
                m(QuantFormat::Q4K, d, d, 1),
                m(wide, d, d, 2),
                m(QuantFormat::Q4K, d, d, 3),
            ],
            experts: (0..top_k as u64)
                .map(|e| {
                    [
                        m(QuantFormat::Q4K, f, d, 10 + 3 * e),
                        m(QuantFormat::Q4K, f, d, 11 + 3 * e),
                        m(wide, d, f, 12 + 3 * e),
                    ]
                })
                .collect(),
        }
    }

    fn qkv_bytes(&self) -> usize {
        self.attn[..3].iter().map(|(b, _)| b.len()).sum()
    }

    fn expert_bytes(&self) -> usize {
        self.experts.iter().flatten().map(|(b, _)| b.len()).sum()
    }
}

/// Layers of the batch-1 decode bench: four distinct ones (162 MB, five times the L3), so
/// every weight byte of a round comes from DRAM as in a real step.
const DECODE_LAYERS: usize = 4;

/// Rounds of the batch-1 decode bench (medians are printed).
const DECODE_ROUNDS: usize = 15;

/// The ops of the batch-1 decode bench, in the order they are printed.
const DECODE_OPS: [&str; 5] = [
    "q/k/v",
    "o_proj",
    "experts (Q4_K down)",
    "experts (Q6_K down)",
    "lm_head",
];

/// OLMoE-1B-7B Q4_K_M's batch-1 decode products (`QUANT_BENCH_DECODE=1`), op by op in the
/// parallel regions the CPU backend runs them in, each entered into the pool with `install`
/// from a thread outside it (as the backend's stream thread does): `pre_attn`'s q/k/v (one
/// region), `o_proj`, the 8 routed experts' gate and up (one region), SwiGLU and down (one
/// region), as `Kernels::experts_ffn` groups them (split by the down projection's format),
/// and the Q6_K `lm_head` `[50304, 2048]`; for each kernel set this CPU has (AVX-512 VNNI,
/// AVX2: what `MOEC_KERNELS` forces), with the Q6_K passes' one-row prefetch on (the
/// default) and off ([`QuantKernels::with_q6k_row_prefetch`]), beside the probe's streaming
/// read ([`stream_read`], 256 MB on the same pool), all in every round. Printed per op: ms
/// (per layer; per step for the head), GB/s of weights and that over the same round's
/// streaming read, medians of [`DECODE_ROUNDS`] rounds; then what an empty `install` costs.
/// `QUANT_BENCH_DECODE=cpu` runs on one thread timed by its CPU time (robust to other
/// processes on the cores); otherwise on all threads, wall time.
fn olmoe_decode() {
    let arch = ArchSpec::from_card(&ModelCard::load("olmoe-1b-7b").expect("built-in card"));
    let (d, f, top_k) = (arch.hidden, arch.ffn, arch.top_k);
    let cpu = std::env::var("QUANT_BENCH_DECODE").is_ok_and(|v| v == "cpu");
    let threads = if cpu { 1 } else { rayon::current_num_threads() };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let layers: Vec<DecodeLayer> = (0..DECODE_LAYERS)
        .map(|l| DecodeLayer::new(d, f, top_k, l % 2 == 0, l as u64 + 1))
        .collect();
    let head = tiled_matrix(QuantFormat::Q6K, arch.vocab, d, 77);
    let head_view = tiled_view(&head, QuantFormat::Q6K, arch.vocab, d);
    let stream: Vec<f32> = vec![1.0; 64 << 20];
    let x = activations(1, d);
    let configs: Vec<QuantKernels> = QuantBody::supported()
        .into_iter()
        .filter(|b| *b != QuantBody::Portable)
        .filter_map(|b| QuantKernels::new(b).ok())
        .flat_map(|k| [k, k.with_q6k_row_prefetch(false)])
        .collect();
    println!(
        "OLMoE-1B-7B Q4_K_M batch-1 decode products, {DECODE_LAYERS} layers ({:.0} MB) + lm_head ({:.1} MB), {threads} thread(s), {}, median of {DECODE_ROUNDS} rounds:",
        layers
            .iter()
            .map(|l| l.qkv_bytes() + l.attn[3].0.len() + l.expert_bytes())
            .sum::<usize>() as f64
            / 1e6,
        head.len() as f64 / 1e6,
        if cpu { "CPU time" } else { "wall time" }
    );
    // Per configuration and op: seconds per round, and the bytes and calls of one round.
    let n_ops = DECODE_OPS.len();
    let mut times = vec![vec![vec![0.0f64; DECODE_ROUNDS]; n_ops]; configs.len()];
    let mut bytes = vec![vec![0usize; n_ops]; configs.len()];
    let mut calls = vec![vec![0usize; n_ops]; configs.len()];
    let mut stream_gbs = Vec::new();
    let mut logits = vec![0.0f32; arch.vocab];
    // `f` run in the pool: its wall time from outside, or its CPU time on the one thread.
    let timed = |f: &mut (dyn FnMut() + Send)| -> f64 {
        if cpu {
            pool.install(|| {
                let t0 = thread_cpu_seconds();
                f();
                thread_cpu_seconds() - t0
            })
        } else {
            seconds(|| pool.install(f))
        }
    };
    // Round 0 warms up and is not kept.
    for round in 0..=DECODE_ROUNDS {
        let t = timed(&mut || {
            std::hint::black_box(stream_read(&stream));
        });
        if round > 0 {
            stream_gbs.push((stream.len() * 4) as f64 / t / 1e9);
        }
        for (c, &k) in configs.iter().enumerate() {
            let mut add = |op: usize, t: f64, b: usize| {
                if round > 0 {
                    times[c][op][round - 1] += t;
                }
                if round == 1 {
                    bytes[c][op] += b;
                    calls[c][op] += 1;
                }
            };
            for layer in &layers {
                let m: Vec<QuantMatrix<'_>> = layer
                    .attn
                    .iter()
                    .map(|(b, format)| tiled_view(b, *format, d, d))
                    .collect();
                let mut qkv = vec![vec![0.0f32; d]; 3];
                let t = timed(&mut || {
                    let mut outs: Vec<&mut [f32]> =
                        qkv.iter_mut().map(|v| v.as_mut_slice()).collect();
                    k.quant_linear_many(&m[..3], &x, 1, &mut outs)
                        .expect("q/k/v")
                });
                add(0, t, layer.qkv_bytes());
                let mut o = vec![0.0f32; d];
                let t = timed(&mut || k.quant_linear(&m[3], &qkv[0], 1, &mut o).expect("o_proj"));
                add(1, t, layer.attn[3].0.len());
                let t = timed(&mut || decode_experts(k, layer, d, f, &x));
                let op = if layer.experts[0][2].1 == QuantFormat::Q6K {
                    3
                } else {
                    2
                };
                add(op, t, layer.expert_bytes());
            }
            let t = timed(&mut || {
                k.quant_linear(&head_view, &x, 1, &mut logits)
                    .expect("head")
            });
            add(4, t, head.len());
        }
    }
    println!(
        "  streaming read (the probe's, 256 MB): {:.2} GB/s (rounds {:.2}-{:.2})",
        median(stream_gbs.clone()),
        stream_gbs.iter().copied().fold(f64::INFINITY, f64::min),
        stream_gbs.iter().copied().fold(0.0, f64::max)
    );
    for (c, k) in configs.iter().enumerate() {
        let pf = if k.q6k_row_prefetch() { "on" } else { "off" };
        println!("  {} body, Q6_K one-row prefetch {pf}:", k.body());
        for (op, name) in DECODE_OPS.iter().enumerate() {
            let ratios: Vec<f64> = times[c][op]
                .iter()
                .zip(&stream_gbs)
                .map(|(t, s)| bytes[c][op] as f64 / t / 1e9 / s)
                .collect();
            let t = median(times[c][op].clone());
            println!(
                "    {name:<20} {:>7.3} ms each, {:>6.2} GB/s, {:.2} of the streaming read",
                t / calls[c][op].max(1) as f64 * 1e3,
                bytes[c][op] as f64 / t / 1e9,
                median(ratios)
            );
        }
    }
    let reps = 2000;
    let hop = seconds(|| {
        for _ in 0..reps {
            pool.install(|| std::hint::black_box(0));
        }
    }) / reps as f64;
    println!(
        "  an empty install from outside the pool: {:.1} us",
        hop * 1e6
    );
}

/// One layer's routed experts at one row, in `Kernels::experts_ffn`'s two regions: every
/// expert's gate and up, then SwiGLU, then every expert's down.
fn decode_experts(k: QuantKernels, layer: &DecodeLayer, d: usize, f: usize, x: &[f32]) {
    let n = layer.experts.len();
    let mut gu = vec![vec![0.0f32; f]; 2 * n];
    let firsts: Vec<QuantProduct<'_>> = layer
        .experts
        .iter()
        .flat_map(|e| &e[..2])
        .map(|(b, format)| QuantProduct {
            w: tiled_view(b, *format, f, d),
            x,
            n_rows: 1,
        })
        .collect();
    let mut outs: Vec<&mut [f32]> = gu.iter_mut().map(|v| v.as_mut_slice()).collect();
    k.quant_products(&firsts, &mut outs).expect("gate/up");
    let hs: Vec<Vec<f32>> = gu
        .chunks_exact(2)
        .map(|p| p[0].iter().zip(&p[1]).map(|(g, u)| silu(*g) * u).collect())
        .collect();
    let downs: Vec<QuantProduct<'_>> = layer
        .experts
        .iter()
        .zip(&hs)
        .map(|(e, h)| QuantProduct {
            w: tiled_view(&e[2].0, e[2].1, d, f),
            x: h,
            n_rows: 1,
        })
        .collect();
    let mut ys = vec![vec![0.0f32; d]; n];
    let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|v| v.as_mut_slice()).collect();
    k.quant_products(&downs, &mut outs).expect("down");
}

/// `silu(x) = x * sigmoid(x)`.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn bench(c: &mut Criterion) {
    let k = Kernels::process();
    let qk = QuantKernels::process();
    println!("{}", moec::math::report::describe());
    println!("{}", describe(k));
    println!("threads: {}", rayon::current_num_threads());
    if std::env::var_os("QUANT_BENCH_GPTOSS").is_some() {
        gpt_oss(qk);
        return;
    }
    if std::env::var_os("QUANT_BENCH_DECODE").is_some() {
        olmoe_decode();
        return;
    }
    if std::env::var_os("QUANT_BENCH_FEW").is_some() {
        few_rows(qk);
        return;
    }
    if std::env::var_os("QUANT_BENCH_MANY").is_some() {
        many_rows(c, qk);
        return;
    }
    if std::env::var_os("QUANT_BENCH_PACK").is_some() {
        packed(qk);
        return;
    }
    // `QUANT_BENCH_FORMAT=Q8_0` (a format's name) times only that format on one thread.
    let only = std::env::var("QUANT_BENCH_FORMAT").ok();
    for format in [
        QuantFormat::Q4K,
        QuantFormat::Q6K,
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Mxfp4,
    ] {
        if only.as_deref().is_none_or(|name| name == format.name()) {
            one_thread(&Set::new(format, 1024, 3584), qk, k);
            if moec::math::qmatmul::tiles::tileable(format, 1024, 3584) {
                one_thread(&Set::new(format, 1024, 3584).into_tiles(), qk, k);
            }
        }
    }
    if std::env::var_os("QUANT_BENCH_ONE_THREAD_ONLY").is_some() || only.is_some() {
        return;
    }
    let small = Set::new(QuantFormat::Q4K, 1024, 3584);
    against_bf16(&small, qk, k);
    let small_tiles = Set::new(QuantFormat::Q4K, 1024, 3584).into_tiles();
    against_bf16(&small_tiles, qk, k);
    let big = Set::new(QuantFormat::Q4K, 4096, 14336);
    against_bf16(&big, qk, k);
    against_bf16(&big.into_tiles(), qk, k);
    for format in [
        QuantFormat::Q6K,
        QuantFormat::Q5K,
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Mxfp4,
    ] {
        against_bf16(&Set::new(format, 1024, 3584), qk, k);
        if format == QuantFormat::Q6K {
            against_bf16(&Set::new(format, 1024, 3584).into_tiles(), qk, k);
        }
    }
    bodies(&small);
    bodies(&small_tiles);

    let mut group = c.benchmark_group("quant");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(small.quant_bytes() as u64));
    for set in [&small, &small_tiles] {
        for rows in [1, 16] {
            let x = activations(rows, set.inp);
            let mut y = vec![0.0f32; rows * set.out];
            group.bench_function(
                format!(
                    "{} [1024, 3584] x {} experts, {rows} rows",
                    set.label(),
                    set.quant.len()
                ),
                |b| b.iter(|| set.run_quant(qk, &x, rows, &mut y)),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

/// How many of a set's `all` matrices a pass of `rows` activation rows times: all of them
/// up to 48 rows, fewer above (the work grows with the rows), at least 2.
fn matrices_timed(all: usize, rows: usize) -> usize {
    if rows <= 48 {
        all
    } else {
        (all * 48 / rows).max(2)
    }
}
