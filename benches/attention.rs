//! Decode attention (the CPU hot spot of every paper) against this machine's streaming
//! read rate measured in the same run (`moec probe`'s, over the same threads). Shapes:
//! OLMoE-1B-7B's (16 heads, 16 kv heads of 128: one query head per kv head),
//! Qwen3-30B-A3B's (32 heads, 4 kv heads of 128: groups of 8) and DeepSeek-V2-Lite's latent
//! attention (16 heads over one kv head of 512 + 64, the values read from the keys' first
//! 512: the latent cached once, as the CPU backend stores it); `SEQS` sequences, one new
//! token each over 512, 4,096 and 8,192 cached positions; f32 and f16 caches; the general
//! (tiled) kernel decode rows took before (`Kernels::attention_general`) and the decode
//! kernel, A/B in one run on the same cache. Each call reads every cached K and V (the
//! latent: every K) once, so KV bytes over time is the kernel's read rate; each timing is the best of `REPS` calls,
//! each after streaming 256 MiB (a step streams a layer's weights between two attention
//! calls). Prints one line per point; asserts that both kernels give the same bits.
//!
//! `cargo bench --bench attention` (`MOEC_ATTN_POSITIONS=512,4096` for other lengths).

use moec::engine::cpu_probe::{measure, stream_read};
use moec::math::attention::AttnSeq;
use moec::math::isa::Kernels;
use moec::math::kv_cache::PagedKvCache;
use moec::model::vocab::{AttnShape, KvLayout, KvType};
use std::time::Instant;

const SEQS: usize = 4;
const REPS: usize = 5;

fn main() {
    let positions: Vec<usize> = std::env::var("MOEC_ATTN_POSITIONS")
        .ok()
        .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![512, 4096, 8192]);
    let threads = rayon::current_num_threads();
    let stream = match measure(256 << 20, threads) {
        Ok(m) => m.stream_read_bytes_per_s,
        Err(e) => {
            eprintln!("bandwidth probe failed: {e}");
            f64::NAN
        }
    };
    let kernels = Kernels::process();
    eprintln!(
        "decode attention, {SEQS} sequences, {threads} threads, {:?} kernels; stream read {:.2} GB/s",
        kernels.isa(),
        stream / 1e9
    );
    let evict = vec![1.0f32; (256 << 20) / 4];
    let shapes = [
        ("olmoe", 16usize, 16usize, 128usize, None),
        ("qwen3-30b", 32, 4, 128, None),
        ("dsv2-lite", 16, 1, 576, Some(512)),
    ];
    for (name, heads, kv_heads, head_dim, values_in_keys) in shapes {
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
            values_in_keys,
        };
        for &context in &positions {
            for kv_type in [KvType::F32, KvType::F16] {
                let per_seq = layout.blocks_for(context + 1);
                let mut cache = PagedKvCache::of_type(layout, 1, SEQS * per_seq, kv_type);
                let tables: Vec<Vec<u32>> = (0..SEQS)
                    .map(|_| {
                        let mut t = Vec::new();
                        cache
                            .allocator
                            .grow(&layout, &mut t, context + 1)
                            .expect("blocks");
                        t
                    })
                    .collect();
                // The context's K/V, stored by one call per sequence that attends nothing.
                let fill: Vec<f32> = (0..context * shape.qkv_width())
                    .map(|i| ((i * 7919 % 2003) as f32 / 1001.0 - 1.0) * 0.5)
                    .collect();
                let mut fill_out = vec![0.0f32; context * shape.q_width()];
                for t in &tables {
                    let s = [AttnSeq {
                        block_table: t,
                        context_len: 0,
                        n_new: context,
                    }];
                    kernels
                        .attention_of(
                            &mut cache.layer_mut(0),
                            &s,
                            &fill,
                            &shape,
                            &mut fill_out,
                            &|_| false,
                        )
                        .expect("fill");
                }
                drop(fill);
                let seqs: Vec<AttnSeq<'_>> = tables
                    .iter()
                    .map(|t| AttnSeq {
                        block_table: t,
                        context_len: context,
                        n_new: 1,
                    })
                    .collect();
                let qkv: Vec<f32> = (0..SEQS * shape.qkv_width())
                    .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
                    .collect();
                let bytes = (SEQS * (context + 1) * layout.pools() * kv_heads * head_dim) as f64
                    * kv_type.bytes() as f64;
                let mut time = |general: bool| -> (f64, Vec<f32>) {
                    let mut out = vec![0.0f32; SEQS * shape.q_width()];
                    let mut best = f64::INFINITY;
                    for _ in 0..=REPS {
                        std::hint::black_box(stream_read(&evict));
                        let mut blocks = cache.layer_mut(0);
                        let t = Instant::now();
                        if general {
                            kernels.attention_general(&mut blocks, &seqs, &qkv, &shape, &mut out)
                        } else {
                            kernels.attention(&mut blocks, &seqs, &qkv, &shape, &mut out)
                        }
                        .expect("attention");
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                    (best, out)
                };
                let (before, a) = time(true);
                let (after, b) = time(false);
                let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same,
                    "{name} {context} {kv_type:?}: the kernels' bits differ"
                );
                let line = |what: &str, s: f64| {
                    format!(
                        "{what} {:.2} ms {:.2} GB/s ({:.2} of stream)",
                        s * 1e3,
                        bytes / s / 1e9,
                        bytes / s / stream
                    )
                };
                eprintln!(
                    "{name:<9} {context:>5} positions {:<3}: {}; {}; speed-up {:.2}x",
                    kv_type.name(),
                    line("general", before),
                    line("decode", after),
                    before / after
                );
            }
        }
    }
}
