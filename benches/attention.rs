//! Decode attention (the CPU hot spot of every paper) against this machine's memory
//! bandwidth measured in the same run (`moec probe`'s streaming read). Shape: mixtral-mid
//! heads and head width, 16 sequences
//! of 4096 cached tokens (far larger than the caches), one new token each; the bench reads every cached K and V once,
//! so bytes / time is the kernel's achieved bandwidth. The ratio is printed at the end.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use moec::engine::cpu_probe::measure;
use moec::math::attention::{attention, AttnSeq};
use moec::math::kv_cache::KvBlocksMut;
use moec::model::arch::ArchSpec;
use moec::model::card::ModelCard;
use moec::model::vocab::KvLayout;
use std::time::Instant;

const SEQS: usize = 16;
const CONTEXT: usize = 4096;

fn bench(c: &mut Criterion) {
    let arch = ArchSpec::from_card(&ModelCard::load("mixtral-mid").expect("card"));
    let shape = arch.attn;
    let layout = KvLayout {
        block_size: 16,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
    };
    let blocks_per_seq = layout.blocks_for(CONTEXT + 1);
    let n_blocks = SEQS * blocks_per_seq;
    let mut k = vec![0.01f32; n_blocks * layout.block_elems()];
    let mut v = vec![0.02f32; n_blocks * layout.block_elems()];
    let tables: Vec<Vec<u32>> = (0..SEQS)
        .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
        .collect();
    let qkv: Vec<f32> = (0..SEQS * shape.qkv_width())
        .map(|i| ((i % 97) as f32) * 1e-3)
        .collect();
    let mut out = vec![0.0f32; SEQS * shape.q_width()];
    let seqs: Vec<AttnSeq<'_>> = tables
        .iter()
        .map(|t| AttnSeq {
            block_table: t,
            context_len: CONTEXT,
            n_new: 1,
        })
        .collect();
    let bytes = (SEQS * (CONTEXT + 1) * 2 * shape.kv_heads * shape.head_dim * 4) as u64;
    let mut group = c.benchmark_group("attention");
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function("decode_16x4096_mixtral_mid", |b| {
        b.iter(|| {
            let mut cache = KvBlocksMut {
                layout,
                k: &mut k,
                v: &mut v,
            };
            attention(&mut cache, &seqs, &qkv, &shape, &mut out).expect("attention")
        })
    });
    group.finish();
    // Same figure by hand for the ratio, then the machine's bandwidth.
    let threads = rayon::current_num_threads();
    let mut best = f64::MAX;
    for _ in 0..20 {
        let mut cache = KvBlocksMut {
            layout,
            k: &mut k,
            v: &mut v,
        };
        let t = Instant::now();
        attention(&mut cache, &seqs, &qkv, &shape, &mut out).expect("attention");
        best = best.min(t.elapsed().as_secs_f64());
    }
    let kernel = bytes as f64 / best;
    match measure(256 << 20, threads) {
        Ok(m) => eprintln!(
            "attention: {:.2} GB/s (best of 20), stream read {:.2} GB/s on {threads} threads: ratio {:.2}",
            kernel / 1e9,
            m.stream_read_bytes_per_s / 1e9,
            kernel / m.stream_read_bytes_per_s
        ),
        Err(e) => eprintln!("attention: {:.2} GB/s; bandwidth probe failed: {e}", kernel / 1e9),
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
