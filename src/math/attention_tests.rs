//! Tests of `math::attention`: the tiled and decode kernels against the per-row kernel
//! (bit for bit), half caches against f32 caches of rounded values, and both against a
//! dense reference.

use super::*;
use crate::math::kv_cache::PagedKvCache;
use crate::model::vocab::{KvLayout, KvType};

/// The kernel before key-block tiling (issue 42): one query row at a time, reading
/// every key and value block once per row. The tiled kernel must give its bits.
fn per_row_reference(
    kernels: Kernels,
    cache: &mut KvBlocksMut<'_>,
    seqs: &[AttnSeq<'_>],
    qkv: &[f32],
    shape: &AttnShape,
    out: &mut [f32],
) -> Result<(), AttnError> {
    let attend = |_: usize| true;
    validate(cache, seqs, qkv, shape, out)?;
    append_kv(cache, seqs, qkv, shape);
    let layout = cache.layout;
    let (k_pool, v_pool) = cache.widened();
    let (k_pool, v_pool) = (&k_pool[..], &v_pool[..]);
    let group = shape.heads / shape.kv_heads;
    let hd = shape.head_dim;
    let row_w = shape.qkv_width();
    let mut first_rows = Vec::with_capacity(seqs.len());
    let mut row = 0;
    for s in seqs {
        first_rows.push(row);
        row += s.n_new;
    }
    let tasks: Vec<(usize, usize)> = (0..seqs.len())
        .filter(|&s| attend(s))
        .flat_map(|s| (0..shape.kv_heads).map(move |h| (s, h)))
        .collect();
    let scale = 1.0 / (hd as f32).sqrt();
    let run = |&(s, h): &(usize, usize)| -> Vec<f32> {
        let seq = &seqs[s];
        let mut local = vec![0.0f32; seq.n_new * group * hd];
        let mut scores: Vec<f32> = Vec::new();
        let bs = layout.block_size;
        for j in 0..seq.n_new {
            let pos = seq.context_len + j;
            let start = shape
                .sliding_window
                .map_or(0, |w| (pos + 1).saturating_sub(w));
            let n_keys = pos + 1 - start;
            let q_off = (first_rows[s] + j) * row_w + h * group * hd;
            let q_group = &qkv[q_off..q_off + group * hd];
            scores.clear();
            scores.resize(group * n_keys, 0.0);
            // Score the keys block by block: a run of slots of one (block, head) tile.
            for bi in start / bs..=pos / bs {
                let first = start.max(bi * bs);
                let last = pos.min(bi * bs + bs - 1);
                let tile = layout.tile(seq.block_table[bi] as usize, h);
                let k_tile = &k_pool[tile..tile + bs * hd];
                kernels.key_scores_transposed(
                    k_tile,
                    bs,
                    first % bs,
                    last - first + 1,
                    q_group,
                    scale,
                    &mut scores,
                    n_keys,
                    first - start,
                );
            }
            let sink_at = (first_rows[s] + j) * row_w + (shape.heads + 2 * shape.kv_heads) * hd;
            for (g, row) in scores.chunks_exact_mut(n_keys).enumerate() {
                let sink = shape.sinks.then(|| qkv[sink_at + h * group + g]);
                kernels.softmax_with_sink_in_place(row, sink);
            }
            let dst = &mut local[j * group * hd..(j + 1) * group * hd];
            for bi in start / bs..=pos / bs {
                let first = start.max(bi * bs);
                let last = pos.min(bi * bs + bs - 1);
                let off = layout.offset(seq.block_table[bi] as usize, h, first % bs);
                let rows = &v_pool[off..off + (last - first + 1) * hd];
                kernels.weighted_rows(rows, hd, &scores, n_keys, first - start, dst);
            }
        }
        local
    };
    let results: Vec<Vec<f32>> = if tasks.len() > 1 {
        tasks.par_iter().map(run).collect()
    } else {
        tasks.iter().map(run).collect()
    };
    let q_w = shape.q_width();
    for (&(s, h), local) in tasks.iter().zip(&results) {
        for j in 0..seqs[s].n_new {
            let r = first_rows[s] + j;
            let dst = &mut out[r * q_w + h * group * hd..r * q_w + (h + 1) * group * hd];
            dst.copy_from_slice(&local[j * group * hd..(j + 1) * group * hd]);
        }
    }
    Ok(())
}

/// Dense reference: causal GQA over full K/V of one sequence.
fn dense(qkv: &[f32], n: usize, shape: &AttnShape) -> Vec<f32> {
    let (hd, g) = (shape.head_dim, shape.heads / shape.kv_heads);
    let row_w = shape.qkv_width();
    let mut out = vec![0.0; n * shape.q_width()];
    for t in 0..n {
        for head in 0..shape.heads {
            let kvh = head / g;
            let q = &qkv[t * row_w + head * hd..][..hd];
            let scores: Vec<f64> = (0..=t)
                .map(|s| {
                    let k = &qkv[s * row_w + shape.heads * hd + kvh * hd..][..hd];
                    q.iter()
                        .zip(k)
                        .map(|(a, b)| (*a as f64) * (*b as f64))
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let v: f64 = (0..=t)
                    .map(|s| {
                        e[s] / z
                            * qkv[s * row_w + (shape.heads + shape.kv_heads) * hd + kvh * hd + d]
                                as f64
                    })
                    .sum();
                out[t * shape.q_width() + head * hd + d] = v as f32;
            }
        }
    }
    out
}

/// Two sequences of different lengths, prefilled in one call then decoded together
/// one token at a time, give the dense causal result at every step.
#[test]
fn paged_prefill_and_mixed_decode_match_dense_attention() {
    let shape = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        sliding_window: None,
        sinks: false,
    };
    let layout = KvLayout {
        block_size: 4,
        kv_heads: 2,
        head_dim: 8,
        values_in_keys: None,
    };
    let mut cache = PagedKvCache::new(layout, 1, 16);
    let lens = [7usize, 3];
    let total = [10usize, 6];
    let all: Vec<Vec<f32>> = total
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            (0..n * shape.qkv_width())
                .map(|i| ((i * 37 + s * 11) % 101) as f32 / 50.0 - 1.0)
                .collect()
        })
        .collect();
    let mut tables = [Vec::new(), Vec::new()];
    for (s, t) in tables.iter_mut().enumerate() {
        cache.allocator.grow(&layout, t, total[s]).unwrap();
    }
    // Prefill both, then decode the remaining tokens (sequence 1 has 3 more, 0 has 3 more).
    let w = shape.qkv_width();
    let mut qkv: Vec<f32> = Vec::new();
    qkv.extend_from_slice(&all[0][..lens[0] * w]);
    qkv.extend_from_slice(&all[1][..lens[1] * w]);
    let seqs = [
        AttnSeq {
            block_table: &tables[0],
            context_len: 0,
            n_new: lens[0],
        },
        AttnSeq {
            block_table: &tables[1],
            context_len: 0,
            n_new: lens[1],
        },
    ];
    let mut out = vec![0.0; (lens[0] + lens[1]) * shape.q_width()];
    attention(&mut cache.layer_mut(0), &seqs, &qkv, &shape, &mut out).unwrap();
    let d0 = dense(&all[0], lens[0], &shape);
    for (a, b) in out[..d0.len()].iter().zip(&d0) {
        assert!((a - b).abs() < 1e-5);
    }
    for step in 0..3 {
        let pos = [lens[0] + step, lens[1] + step];
        let mut qkv = Vec::new();
        qkv.extend_from_slice(&all[0][pos[0] * w..(pos[0] + 1) * w]);
        qkv.extend_from_slice(&all[1][pos[1] * w..(pos[1] + 1) * w]);
        let seqs = [
            AttnSeq {
                block_table: &tables[0],
                context_len: pos[0],
                n_new: 1,
            },
            AttnSeq {
                block_table: &tables[1],
                context_len: pos[1],
                n_new: 1,
            },
        ];
        let mut out = vec![0.0; 2 * shape.q_width()];
        attention(&mut cache.layer_mut(0), &seqs, &qkv, &shape, &mut out).unwrap();
        for s in 0..2 {
            let want = dense(&all[s], pos[s] + 1, &shape);
            let want = &want[pos[s] * shape.q_width()..];
            let got = &out[s * shape.q_width()..(s + 1) * shape.q_width()];
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() < 1e-5, "step {step} seq {s}: {a} vs {b}");
            }
        }
    }
}

/// With a sliding window of 3, token t attends to t-2..=t only: equal to dense
/// attention over just those keys.
#[test]
fn sliding_window_limits_the_keys() {
    let shape = AttnShape {
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        sliding_window: Some(3),
        sinks: false,
    };
    let full = AttnShape {
        sliding_window: None,
        sinks: false,
        ..shape
    };
    let layout = KvLayout {
        block_size: 4,
        kv_heads: 1,
        head_dim: 16,
        values_in_keys: None,
    };
    let n = 9;
    let qkv: Vec<f32> = (0..n * shape.qkv_width())
        .map(|i| ((i * 53) % 89) as f32 / 44.0 - 1.0)
        .collect();
    let mut cache = PagedKvCache::new(layout, 1, 8);
    let mut table = Vec::new();
    cache.allocator.grow(&layout, &mut table, n).unwrap();
    let seqs = [AttnSeq {
        block_table: &table,
        context_len: 0,
        n_new: n,
    }];
    let mut out = vec![0.0; n * shape.q_width()];
    attention(&mut cache.layer_mut(0), &seqs, &qkv, &shape, &mut out).unwrap();
    let w = shape.qkv_width();
    let t = 7;
    let window = &qkv[(t - 2) * w..(t + 1) * w];
    let want = dense(window, 3, &full);
    let got = &out[t * shape.q_width()..(t + 1) * shape.q_width()];
    for (a, b) in got.iter().zip(&want[2 * shape.q_width()..]) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

/// Attending only some sequences stores every sequence's K/V exactly as a full call
/// does, gives the attended rows the same bits, and leaves the other rows untouched.
#[test]
fn attending_a_subset_stores_all_kv_and_matches_the_full_call() {
    let shape = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        sliding_window: None,
        sinks: false,
    };
    let layout = KvLayout {
        block_size: 4,
        kv_heads: 2,
        head_dim: 16,
        values_in_keys: None,
    };
    let lens = [6usize, 1, 3];
    let rows: usize = lens.iter().sum();
    let qkv: Vec<f32> = (0..rows * shape.qkv_width())
        .map(|i| ((i * 29) % 83) as f32 / 41.0 - 1.0)
        .collect();
    let run = |attend: &(dyn Fn(usize) -> bool + Sync)| {
        let mut cache = PagedKvCache::new(layout, 1, 16);
        let mut tables = vec![Vec::new(); 3];
        for (t, &n) in tables.iter_mut().zip(&lens) {
            cache.allocator.grow(&layout, t, n).unwrap();
        }
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .zip(&lens)
            .map(|(t, &n)| AttnSeq {
                block_table: t,
                context_len: 0,
                n_new: n,
            })
            .collect();
        let mut out = vec![-7.0; rows * shape.q_width()];
        attention_of(
            &mut cache.layer_mut(0),
            &seqs,
            &qkv,
            &shape,
            &mut out,
            attend,
        )
        .unwrap();
        let (k, v) = cache.layer_mut(0).widened();
        (out, k, v)
    };
    let (full, k_full, v_full) = run(&|_| true);
    let (some, k_some, v_some) = run(&|i| i == 1);
    assert_eq!(k_full, k_some);
    assert_eq!(v_full, v_some);
    let w = shape.q_width();
    assert_eq!(&some[6 * w..7 * w], &full[6 * w..7 * w]);
    assert!(some[..6 * w]
        .iter()
        .chain(&some[7 * w..])
        .all(|&x| x == -7.0));
}

/// An attention kernel under test: (cache, sequences, qkv rows, outputs).
type KernelCall<'a> = dyn Fn(&mut KvBlocksMut<'_>, &[AttnSeq<'_>], &[f32], &mut [f32]) + 'a;

/// Random sequences in one call: `(context, new)` tokens each, the context appended
/// by an earlier call (so it is read from the cache), uniform values in [-1, 1) (keys
/// scaled up so the softmax is peaked: a max that moves exercises the row max).
struct RandomCall {
    shape: AttnShape,
    layout: KvLayout,
    /// Per sequence: (context tokens, new tokens).
    lens: Vec<(usize, usize)>,
    seed: u64,
    /// The cache's element type.
    kv_type: KvType,
    /// Round every key and value of the rows to a half first (an f32 cache of the
    /// values a half cache stores).
    round_kv: bool,
}

impl RandomCall {
    /// Runs the call through `kernel` on a fresh cache; returns the outputs and the
    /// layer's K/V pools.
    fn run(&self, kernel: &KernelCall) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (shape, layout) = (&self.shape, self.layout);
        let mut rng = crate::rng::Rng::new(self.seed);
        let w = shape.qkv_width();
        let k_cols = shape.heads * shape.head_dim..(shape.heads + shape.kv_heads) * shape.head_dim;
        let kv_cols =
            shape.heads * shape.head_dim..(shape.heads + 2 * shape.kv_heads) * shape.head_dim;
        let round = self.round_kv;
        let mut random_rows = |n: usize| -> Vec<f32> {
            (0..n * w)
                .map(|i| {
                    let x = rng.next_signed_f32();
                    let x = if k_cols.contains(&(i % w)) {
                        3.0 * x
                    } else {
                        x
                    };
                    if round && kv_cols.contains(&(i % w)) {
                        half::f16::from_f32(x).to_f32()
                    } else {
                        x
                    }
                })
                .collect()
        };
        let total: usize = self
            .lens
            .iter()
            .map(|&(c, n)| layout.blocks_for(c + n))
            .sum();
        let mut cache = PagedKvCache::of_type(layout, 1, total, self.kv_type);
        let mut tables = vec![Vec::new(); self.lens.len()];
        for (t, &(c, n)) in tables.iter_mut().zip(&self.lens) {
            cache.allocator.grow(&layout, t, c + n).unwrap();
        }
        // The contexts, appended as an earlier pass leaves them (their outputs are not
        // looked at, so only the append runs: a long context costs no attention here).
        let ctx_rows: usize = self.lens.iter().map(|l| l.0).sum();
        let ctx_qkv = random_rows(ctx_rows);
        let ctx_seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .zip(&self.lens)
            .map(|(t, &(c, _))| AttnSeq {
                block_table: t,
                context_len: 0,
                n_new: c,
            })
            .collect();
        let ctx_out = vec![0.0; ctx_rows * shape.q_width()];
        let mut ctx_cache = cache.layer_mut(0);
        validate(&ctx_cache, &ctx_seqs, &ctx_qkv, shape, &ctx_out).unwrap();
        append_kv(&mut ctx_cache, &ctx_seqs, &ctx_qkv, shape);
        let rows: usize = self.lens.iter().map(|l| l.1).sum();
        let qkv = random_rows(rows);
        let seqs: Vec<AttnSeq<'_>> = tables
            .iter()
            .zip(&self.lens)
            .map(|(t, &(c, n))| AttnSeq {
                block_table: t,
                context_len: c,
                n_new: n,
            })
            .collect();
        let mut out = vec![0.0; rows * shape.q_width()];
        kernel(&mut cache.layer_mut(0), &seqs, &qkv, &mut out);
        let (k, v) = cache.layer_mut(0).widened();
        (out, k, v)
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `call` through `kernels.attention` (decode rows through the decode kernel) gives the
/// per-row kernel's outputs, keys and values bit for bit, all finite.
fn assert_per_row_bits(kernels: Kernels, call: &RandomCall, what: &str) {
    let shape = call.shape;
    let got = call
        .run(&|cache, seqs, qkv, out| kernels.attention(cache, seqs, qkv, &shape, out).unwrap());
    let per_row = call.run(&|cache, seqs, qkv, out| {
        per_row_reference(kernels, cache, seqs, qkv, &shape, out).unwrap()
    });
    assert_eq!(bits(&got.0), bits(&per_row.0), "{what}: outputs");
    assert_eq!(bits(&got.1), bits(&per_row.1), "{what}: keys");
    assert_eq!(bits(&got.2), bits(&per_row.2), "{what}: values");
    assert!(got.0.iter().all(|x| x.is_finite()), "{what}");
}

/// The key-block-tiled kernel gives exactly the per-row kernel's bits on random
/// inputs: prefill, decode and chunked rows after a cached context, several sequences,
/// tiles with a partial last tile (more than [`crate::model::vocab::ATTENTION_QUERY_TILE`] rows, not a multiple),
/// odd block sizes and head widths (the SIMD bodies' tails and the portable path),
/// sliding windows and sinks, on every instruction set this CPU has.
#[test]
fn tiled_attention_gives_the_per_row_kernel_s_bits() {
    for isa in crate::math::isa::Isa::supported() {
        let kernels = Kernels::new(isa).unwrap();
        for kv_type in [KvType::F32, KvType::F16] {
            for (i, call) in random_cases(kv_type, false).into_iter().enumerate() {
                assert_per_row_bits(kernels, &call, &format!("{isa} {kv_type:?} case {i}"));
            }
        }
    }
}

/// The decode kernel at GQA groups of 1, 4, 8 and 16 (its value pass takes 4, 2 and 1
/// heads at a time, so 16 is four chunks of 4 and a group under 4 the tails) gives the
/// per-row kernel's bits: one new token after contexts whose last block is partial at
/// every kind of offset (0, 1, 7, 8, 9, 15 slots into a block of 16 or 32), over many blocks
/// (the prefetch runs ahead of the last), with a sliding window that starts mid-vector,
/// heads of 40 (two-vector chunks and a one-vector tail), 48 over blocks of 16 (the
/// AVX-512 bodies' three-vector rows) and 128; groups that split into every chunk of heads
/// (6: 4 + 2); f32 and half caches, on every instruction set this CPU has.
#[test]
fn decode_rows_at_every_group_and_offset_give_the_per_row_kernel_s_bits() {
    let lens: Vec<(usize, usize)> = [0usize, 1, 7, 8, 9, 15, 16, 31, 33, 200, 255]
        .into_iter()
        .map(|c| (c, 1))
        .collect();
    let mut i = 0;
    for group in [1usize, 4, 6, 8, 16] {
        for (head_dim, block_size, window) in [(40, 16, None), (48, 16, None), (128, 32, Some(37))]
        {
            for isa in crate::math::isa::Isa::supported() {
                let kernels = Kernels::new(isa).unwrap();
                for kv_type in [KvType::F32, KvType::F16] {
                    i += 1;
                    let kv_heads = 2;
                    let call = RandomCall {
                        shape: AttnShape {
                            heads: group * kv_heads,
                            kv_heads,
                            head_dim,
                            sliding_window: window,
                            sinks: false,
                        },
                        layout: KvLayout {
                            block_size,
                            kv_heads,
                            head_dim,
                            values_in_keys: None,
                        },
                        lens: lens.clone(),
                        seed: 900 + i,
                        kv_type,
                        round_kv: false,
                    };
                    let what = format!("{isa} {kv_type:?} group {group}, {head_dim} wide");
                    assert_per_row_bits(kernels, &call, &what);
                }
            }
        }
    }
}

/// A decode row over one kv head (MLA's latent at batch 1) is split into parts of its
/// query heads where the tasks are fewer than the pool's threads (`split_decode_groups`):
/// in pools of 1 to 8 threads, groups of 16, 12, 8, 6 and 4 (parts of 16 = 8 + 8 or 4 x 4,
/// 12 = 6 + 6 or 3 x 4, 6 whole), with sinks and a window, give the per-row kernel's bits.
#[test]
fn decode_rows_split_over_query_heads_give_the_per_row_kernel_s_bits() {
    let mut i = 0;
    for threads in [1usize, 2, 3, 4, 8] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for (group, window, sinks) in [
            (16, None, false),
            (12, Some(50), true),
            (8, None, true),
            (6, None, false),
            (4, Some(9), false),
        ] {
            for isa in crate::math::isa::Isa::supported() {
                let kernels = Kernels::new(isa).unwrap();
                for kv_type in [KvType::F32, KvType::F16] {
                    i += 1;
                    let call = RandomCall {
                        shape: AttnShape {
                            heads: group,
                            kv_heads: 1,
                            head_dim: 40,
                            sliding_window: window,
                            sinks,
                        },
                        layout: KvLayout {
                            block_size: 16,
                            kv_heads: 1,
                            head_dim: 40,
                            values_in_keys: None,
                        },
                        lens: vec![(97, 1)],
                        seed: 1700 + i,
                        kv_type,
                        round_kv: false,
                    };
                    let what = format!("{isa} {kv_type:?} group {group}, {threads} threads");
                    pool.install(|| assert_per_row_bits(kernels, &call, &what));
                }
            }
        }
    }
}

/// The random calls of the kernel tests: prefill, decode and chunked rows after a
/// cached context, several sequences, odd block sizes and head widths (the portable
/// paths), blocks of 8, 16 and 32 (the decode kernel), GQA groups of 1, 2, 3, 4 and
/// 8, partial last blocks, sliding windows and sinks, the real models' 8 x 128 and 8 x 64.
fn random_cases(kv_type: KvType, round_kv: bool) -> Vec<RandomCall> {
    let cases = [
        // (heads, kv_heads, head_dim, block_size, window, sinks, lens)
        (
            4,
            2,
            32,
            16,
            None,
            false,
            vec![(0, 37), (21, 1), (5, 17), (0, 1)],
        ),
        (8, 2, 16, 5, None, true, vec![(13, 40), (0, 3), (47, 1)]),
        (
            6,
            3,
            12,
            7,
            Some(9),
            false,
            vec![(11, 33), (30, 1), (0, 16)],
        ),
        (2, 1, 64, 16, Some(20), true, vec![(40, 35), (3, 2)]),
        (4, 4, 8, 3, None, false, vec![(100, 19), (0, 50)]),
        // Decode rows for the decode kernel: MHA (group 1) over many blocks.
        (
            3,
            3,
            16,
            8,
            None,
            false,
            vec![(70, 1), (7, 1), (0, 1), (16, 1)],
        ),
        // Groups of 8 (chunks of 4 heads) and 3 (2 + 1), widths of 3 and 9 vectors.
        (
            16,
            2,
            24,
            16,
            Some(21),
            true,
            vec![(90, 1), (33, 1), (15, 1)],
        ),
        (12, 4, 72, 32, None, false, vec![(100, 1), (5, 1), (31, 1)]),
        (4, 2, 8, 16, None, true, vec![(250, 1), (1, 1)]),
        // The real models' groups and widths in tiles: Qwen3's 8 x 128 (every pair-chunk
        // size of the blocked kernels, a tile starting mid-block), gpt-oss's 8 x 64 with a
        // sliding window and sinks (rows of one tile with different first keys).
        (16, 2, 128, 16, None, false, vec![(19, 40), (0, 1), (3, 21)]),
        (16, 2, 64, 16, Some(24), true, vec![(30, 37), (0, 18)]),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(
            |(i, (heads, kv_heads, head_dim, block_size, window, sinks, lens))| RandomCall {
                shape: AttnShape {
                    heads,
                    kv_heads,
                    head_dim,
                    sliding_window: window,
                    sinks,
                },
                layout: KvLayout {
                    block_size,
                    kv_heads,
                    head_dim,
                    values_in_keys: None,
                },
                lens,
                seed: 40 + i as u64,
                kv_type,
                round_kv,
            },
        )
        .collect()
}

/// A half cache gives exactly the bits of an f32 cache holding the same keys and
/// values rounded to halves (outputs and stored values), on every instruction set
/// this CPU has: rounding is the only difference a half cache makes.
#[test]
fn half_cache_gives_the_bits_of_an_f32_cache_of_rounded_values() {
    for isa in crate::math::isa::Isa::supported() {
        let kernels = Kernels::new(isa).unwrap();
        let halves = random_cases(KvType::F16, false);
        let rounded = random_cases(KvType::F32, true);
        for (i, (half, f32s)) in halves.iter().zip(&rounded).enumerate() {
            let shape = half.shape;
            let kernel: &KernelCall =
                &|cache, seqs, qkv, out| kernels.attention(cache, seqs, qkv, &shape, out).unwrap();
            let (a, b) = (half.run(kernel), f32s.run(kernel));
            assert_eq!(bits(&a.0), bits(&b.0), "{isa} case {i}: outputs");
            assert_eq!(bits(&a.1), bits(&b.1), "{isa} case {i}: keys");
            assert_eq!(bits(&a.2), bits(&b.2), "{isa} case {i}: values");
        }
    }
}

/// f32 and half caches against the plain dense reference (f64 sums): one sequence
/// prefilled over partial blocks, then decoded a token at a time, GQA groups of 3,
/// heads 24 wide (three vectors), blocks of 8. The f32 cache matches the reference on
/// the rows as given, the half cache matches it on the rows with keys and values
/// rounded to halves, and stays within half precision of the unrounded reference.
#[test]
fn half_and_f32_caches_match_the_dense_reference() {
    let shape = AttnShape {
        heads: 6,
        kv_heads: 2,
        head_dim: 24,
        sliding_window: None,
        sinks: false,
    };
    let layout = KvLayout {
        block_size: 8,
        kv_heads: 2,
        head_dim: 24,
        values_in_keys: None,
    };
    let (w, qw) = (shape.qkv_width(), shape.q_width());
    let (prompt, total) = (13usize, 29usize);
    let mut rng = crate::rng::Rng::new(7);
    let rows: Vec<f32> = (0..total * w).map(|_| rng.next_signed_f32()).collect();
    let kv_cols = shape.heads * shape.head_dim..w;
    let rounded: Vec<f32> = rows
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            if kv_cols.contains(&(i % w)) {
                half::f16::from_f32(x).to_f32()
            } else {
                x
            }
        })
        .collect();
    let exact = dense(&rows, total, &shape);
    let exact_rounded = dense(&rounded, total, &shape);
    for isa in crate::math::isa::Isa::supported() {
        let kernels = Kernels::new(isa).unwrap();
        for kv_type in [KvType::F32, KvType::F16] {
            let mut cache = PagedKvCache::of_type(layout, 1, layout.blocks_for(total), kv_type);
            let mut table = Vec::new();
            cache.allocator.grow(&layout, &mut table, total).unwrap();
            let mut got = vec![0.0f32; total * qw];
            let mut pos = 0;
            while pos < total {
                let n = if pos == 0 { prompt } else { 1 };
                let seqs = [AttnSeq {
                    block_table: &table,
                    context_len: pos,
                    n_new: n,
                }];
                kernels
                    .attention(
                        &mut cache.layer_mut(0),
                        &seqs,
                        &rows[pos * w..(pos + n) * w],
                        &shape,
                        &mut got[pos * qw..(pos + n) * qw],
                    )
                    .unwrap();
                pos += n;
            }
            let (want, tol) = match kv_type {
                KvType::F32 => (&exact, 1e-5),
                KvType::F16 => (&exact_rounded, 1e-5),
            };
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!((a - b).abs() < tol, "{isa} {kv_type:?} [{i}]: {a} vs {b}");
            }
            if kv_type == KvType::F16 {
                for (a, b) in got.iter().zip(&exact) {
                    assert!((a - b).abs() < 4e-3, "{isa} half vs unrounded: {a} vs {b}");
                }
            }
        }
    }
}

/// DeepSeek MLA's rows (`V = [K[..w] | 0]`, one kv head) for two sequences of `lens`
/// tokens, attended as a prefill of all but the last `decode` tokens of each then one
/// decode step a token; gives every output row and the layer's widened (K, V) pools.
fn latent_steps(
    kernels: Kernels,
    layout: KvLayout,
    kv_type: KvType,
    shape: &AttnShape,
    w: usize,
    lens: [usize; 2],
    decode: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (row_w, qw, hd) = (shape.qkv_width(), shape.q_width(), shape.head_dim);
    let mut rng = crate::rng::Rng::new(11 + w as u64);
    let k_at = shape.heads * hd;
    let rows: Vec<Vec<f32>> = lens
        .iter()
        .map(|&n| {
            let mut rows: Vec<f32> = (0..n * row_w).map(|_| rng.next_signed_f32()).collect();
            for r in rows.chunks_exact_mut(row_w) {
                for c in 0..hd {
                    r[k_at + hd + c] = if c < w { r[k_at + c] } else { 0.0 };
                }
            }
            rows
        })
        .collect();
    let blocks = lens.iter().map(|&n| layout.blocks_for(n)).sum();
    let mut cache = PagedKvCache::of_type(layout, 1, blocks, kv_type);
    let mut tables = [Vec::new(), Vec::new()];
    for (t, &n) in tables.iter_mut().zip(&lens) {
        cache.allocator.grow(&layout, t, n).unwrap();
    }
    let mut outs = Vec::new();
    let mut done = [0usize; 2];
    for step in 0..=decode {
        let new: Vec<usize> = lens
            .iter()
            .map(|&n| if step == 0 { n - decode } else { 1 })
            .collect();
        let seqs: Vec<AttnSeq<'_>> = (0..2)
            .map(|s| AttnSeq {
                block_table: &tables[s],
                context_len: done[s],
                n_new: new[s],
            })
            .collect();
        let qkv: Vec<f32> = (0..2)
            .flat_map(|s| {
                rows[s][done[s] * row_w..(done[s] + new[s]) * row_w]
                    .iter()
                    .copied()
            })
            .collect();
        let mut out = vec![0.0f32; (new[0] + new[1]) * qw];
        kernels
            .attention(&mut cache.layer_mut(0), &seqs, &qkv, shape, &mut out)
            .unwrap();
        outs.extend(out);
        for s in 0..2 {
            done[s] += new[s];
        }
    }
    let (k, v) = cache.layer_mut(0).widened();
    (outs, k, v)
}

/// A cache whose values are read from the keys (`KvLayout::values_in_keys`, MLA's
/// latent cached once) gives exactly the bits of a cache with a V pool holding `[K[..w] |
/// 0]`, with no V pool at all: prefill (the tiled kernel) and decode rows (the decode
/// kernel: blocks and widths of whole vectors, with SIMD transposes when `w` is whole
/// vectors too; scalar ones otherwise), f32 and half caches, groups of 16, 4 and 3, on
/// every instruction set this CPU has.
#[test]
fn values_read_from_the_keys_give_the_bits_of_a_value_pool() {
    // (heads, head_dim, w, block_size): DeepSeek's group 16 with 32 + 8, a latent that is
    // not whole vectors, a head that is not, and a block that is not.
    for (heads, hd, w, bs) in [
        (16, 40, 32, 16),
        (4, 40, 20, 8),
        (4, 36, 32, 8),
        (3, 20, 16, 5),
    ] {
        let shape = AttnShape {
            heads,
            kv_heads: 1,
            head_dim: hd,
            sliding_window: None,
            sinks: false,
        };
        let pool = KvLayout {
            block_size: bs,
            kv_heads: 1,
            head_dim: hd,
            values_in_keys: None,
        };
        let lone = KvLayout {
            values_in_keys: Some(w),
            ..pool
        };
        for isa in crate::math::isa::Isa::supported() {
            let kernels = Kernels::new(isa).unwrap();
            for kv_type in [KvType::F32, KvType::F16] {
                let what = format!("{isa} {kv_type:?} {heads} x {hd}, w {w}, blocks of {bs}");
                let want = latent_steps(kernels, pool, kv_type, &shape, w, [45, 19], 3);
                let got = latent_steps(kernels, lone, kv_type, &shape, w, [45, 19], 3);
                assert_eq!(bits(&got.0), bits(&want.0), "{what}: outputs");
                assert_eq!(bits(&got.1), bits(&want.1), "{what}: keys");
                assert!(got.2.is_empty(), "{what}: a V pool of {}", got.2.len());
                assert!(got.0.iter().all(|x| x.is_finite()), "{what}");
            }
        }
    }
}

/// The bench's attention shapes by `MOEC_ATTN_SHAPE` name: `tiny` (the tiny cards': 4
/// heads, 2 kv heads, 32 wide), `qwen3` (Qwen3-30B-A3B: 32, 4, 128), `dsv2` (DeepSeek-V2-
/// Lite's latent attention: 16 heads over one 576-wide latent head), `gptoss` (gpt-oss-20b's
/// full layers: 64, 8, 64, sinks) and `gptoss-swa` (its 128-token sliding-window layers);
/// blocks of 16 (the runtime's block size whenever the pool allows it).
fn bench_shape(name: &str) -> Option<AttnShape> {
    let (heads, kv_heads, head_dim, sliding_window, sinks) = match name {
        "tiny" => (4, 2, 32, None, false),
        "qwen3" => (32, 4, 128, None, false),
        "dsv2" => (16, 1, 576, None, false),
        "gptoss" => (64, 8, 64, None, true),
        "gptoss-swa" => (64, 8, 64, Some(128), true),
        _ => return None,
    };
    Some(AttnShape {
        heads,
        kv_heads,
        head_dim,
        sliding_window,
        sinks,
    })
}

/// FLOP of one call's QK^T and PV products: 2 x (query, key) pairs x head width x query
/// heads, for each of the two.
fn attention_flop(shape: &AttnShape, lens: &[(usize, usize)]) -> f64 {
    let pairs: usize = lens
        .iter()
        .flat_map(|&(c, n)| c..c + n)
        .map(|pos| shape.sliding_window.map_or(pos + 1, |w| (pos + 1).min(w)))
        .sum();
    2.0 * 2.0 * (pairs * shape.head_dim * shape.heads) as f64
}

/// With `MOEC_ATTN_BENCH=2048,8192` (lengths; `1` for 2k, 8k and 32k): prefill of one
/// sequence of each length and one decode step at that length, for the shapes of
/// `MOEC_ATTN_SHAPE` (comma-separated [`bench_shape`] names, `tiny` by default) and the
/// caches of `MOEC_ATTN_KV` (`f32`, `f16` or both; `f32` by default), timed for the tiled
/// kernel and (unless `MOEC_ATTN_REF=0`) the per-row kernel. Prints milliseconds and
/// GFLOP/s (see [`attention_flop`]) with the load average; asserts only equal bits
/// (timings depend on the machine).
#[test]
fn attention_timings_at_long_context_when_asked() {
    let Ok(lengths) = std::env::var("MOEC_ATTN_BENCH") else {
        return;
    };
    let lengths: Vec<usize> = lengths
        .split(',')
        .filter_map(|l| l.trim().parse().ok())
        .filter(|&l| l > 1)
        .collect();
    let lengths = if lengths.is_empty() {
        vec![2048, 8192, 32768]
    } else {
        lengths
    };
    let env_list = |var: &str, default: &str| -> Vec<String> {
        std::env::var(var)
            .unwrap_or_else(|_| default.to_string())
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    let shapes: Vec<(String, AttnShape)> = env_list("MOEC_ATTN_SHAPE", "tiny")
        .into_iter()
        .map(|name| {
            let shape = bench_shape(&name)
                .unwrap_or_else(|| panic!("MOEC_ATTN_SHAPE: no shape named {name:?}"));
            (name, shape)
        })
        .collect();
    let kv_types: Vec<KvType> = env_list("MOEC_ATTN_KV", "f32")
        .iter()
        .map(|t| match t.as_str() {
            "f32" => KvType::F32,
            "f16" => KvType::F16,
            _ => panic!("MOEC_ATTN_KV: f32 or f16, not {t:?}"),
        })
        .collect();
    let with_ref = std::env::var("MOEC_ATTN_REF").map_or(true, |v| v != "0");
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let kernels = Kernels::process();
    eprintln!(
        "attention bench: {:?} kernels, {} threads",
        kernels.isa(),
        rayon::current_num_threads()
    );
    for (name, shape) in &shapes {
        let shape = *shape;
        let layout = KvLayout {
            block_size: 16,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            values_in_keys: None,
        };
        for &kv_type in &kv_types {
            for &n in &lengths {
                for (what, lens) in [("prefill", vec![(0, n)]), ("decode", vec![(n - 1, 1)])] {
                    let flop = attention_flop(&shape, &lens);
                    let call = RandomCall {
                        shape,
                        layout,
                        lens,
                        seed: 1,
                        kv_type,
                        round_kv: false,
                    };
                    let report =
                        |kernel: &str, secs: f64| {
                            eprintln!(
                            "  {name} {kv_type:?} {what} {n}: {kernel} {:.2} ms, {:.2} GFLOP/s \
                             (load {})",
                            secs * 1e3,
                            flop / secs / 1e9,
                            load().split_whitespace().take(3).collect::<Vec<_>>().join(" ")
                        )
                        };
                    let tiled = call.run(&|cache, seqs, qkv, out| {
                        let t = std::time::Instant::now();
                        kernels.attention(cache, seqs, qkv, &shape, out).unwrap();
                        report("tiled  ", t.elapsed().as_secs_f64());
                    });
                    if !with_ref {
                        continue;
                    }
                    let per_row = call.run(&|cache, seqs, qkv, out| {
                        let t = std::time::Instant::now();
                        per_row_reference(kernels, cache, seqs, qkv, &shape, out).unwrap();
                        report("per-row", t.elapsed().as_secs_f64());
                    });
                    assert_eq!(bits(&tiled.0), bits(&per_row.0));
                }
            }
        }
    }
}

#[test]
fn short_block_table_is_an_error() {
    let shape = AttnShape {
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        sliding_window: None,
        sinks: false,
    };
    let layout = KvLayout {
        block_size: 2,
        kv_heads: 1,
        head_dim: 4,
        values_in_keys: None,
    };
    let mut cache = PagedKvCache::new(layout, 1, 4);
    let table = [0u32];
    let qkv = vec![0.0; 3 * shape.qkv_width()];
    let mut out = vec![0.0; 3 * shape.q_width()];
    let seqs = [AttnSeq {
        block_table: &table,
        context_len: 0,
        n_new: 3,
    }];
    let err = attention(&mut cache.layer_mut(0), &seqs, &qkv, &shape, &mut out).unwrap_err();
    assert!(matches!(
        err,
        AttnError::BlockTable {
            seq: 0,
            tokens: 3,
            ..
        }
    ));
}
