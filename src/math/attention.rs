//! Grouped-query attention over a paged KV cache, for a micro-batch of sequences that
//! each bring one or more new tokens (prefill and decode mixed in one call).
//!
//! Takes the rotated `qkv` rows (`[q | k | v]` per token, sequences concatenated in the
//! order of `seqs`), each sequence's block table and cached length, and one layer's
//! [`KvBlocksMut`]. It first appends the new keys/values, then computes causal attention
//! (new token `j` of a sequence sees cached tokens and new tokens `0..=j`, optionally only
//! the last `sliding_window`), softmax in f32. Work is split over (sequence, kv head)
//! with rayon; each key and value row is read once per kv head and reused by every query
//! head of its group. Inconsistent inputs are errors, never panics.

use crate::math::isa::Kernels;
use crate::math::kv_cache::KvBlocksMut;
use crate::model::vocab::AttnShape;
use rayon::prelude::*;

/// One sequence of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// Block ids holding this sequence's tokens, in order.
    pub block_table: &'a [u32],
    /// Tokens already in the cache before this call.
    pub context_len: usize,
    /// New tokens (rows of `qkv`) this call appends and attends for.
    pub n_new: usize,
}

/// Inconsistent arguments to [`attention`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttnError {
    /// Row counts do not add up.
    #[error("attention got {rows} qkv rows but the sequences bring {expected} new tokens")]
    RowCount {
        /// Rows present.
        rows: usize,
        /// Sum of `n_new`.
        expected: usize,
    },
    /// The cache layout does not match the heads.
    #[error("KV cache layout ({cache_heads} heads x {cache_dim}) does not match the model ({kv_heads} x {head_dim})")]
    Layout {
        /// Cache kv heads.
        cache_heads: usize,
        /// Cache head width.
        cache_dim: usize,
        /// Model kv heads.
        kv_heads: usize,
        /// Model head width.
        head_dim: usize,
    },
    /// A block table is too short or names a block outside the pool.
    #[error("sequence {seq}: block table does not cover {tokens} tokens within a pool of {n_blocks} blocks")]
    BlockTable {
        /// Sequence index in the call.
        seq: usize,
        /// Tokens that must be covered.
        tokens: usize,
        /// Pool size.
        n_blocks: usize,
    },
}

/// [`Kernels::attention`] with the process's kernels.
pub fn attention(
    cache: &mut KvBlocksMut<'_>,
    seqs: &[AttnSeq<'_>],
    qkv: &[f32],
    shape: &AttnShape,
    out: &mut [f32],
) -> Result<(), AttnError> {
    Kernels::process().attention_of(cache, seqs, qkv, shape, out, &|_| true)
}

/// [`Kernels::attention_of`] with the process's kernels.
pub fn attention_of(
    cache: &mut KvBlocksMut<'_>,
    seqs: &[AttnSeq<'_>],
    qkv: &[f32],
    shape: &AttnShape,
    out: &mut [f32],
    attend: &(dyn Fn(usize) -> bool + Sync),
) -> Result<(), AttnError> {
    Kernels::process().attention_of(cache, seqs, qkv, shape, out, attend)
}

impl Kernels {
    /// Appends the new K/V of every sequence, then writes attention outputs
    /// (`[rows, heads * head_dim]`) into `out`.
    pub fn attention(
        self,
        cache: &mut KvBlocksMut<'_>,
        seqs: &[AttnSeq<'_>],
        qkv: &[f32],
        shape: &AttnShape,
        out: &mut [f32],
    ) -> Result<(), AttnError> {
        self.attention_of(cache, seqs, qkv, shape, out, &|_| true)
    }

    /// Like [`Kernels::attention`], but attends only the sequences `attend(index)`
    /// selects: the others' K/V are stored and their output rows are left as they are
    /// (VSLPipe's CPU task stores the prefill rows' K/V the GPU attended and attends only
    /// the decode rows).
    pub fn attention_of(
        self,
        cache: &mut KvBlocksMut<'_>,
        seqs: &[AttnSeq<'_>],
        qkv: &[f32],
        shape: &AttnShape,
        out: &mut [f32],
        attend: &(dyn Fn(usize) -> bool + Sync),
    ) -> Result<(), AttnError> {
        validate(cache, seqs, qkv, shape, out)?;
        append_kv(cache, seqs, qkv, shape);
        let layout = cache.layout;
        let (k_pool, v_pool) = (&*cache.k, &*cache.v);
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
                    self.key_scores_transposed(
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
                    self.softmax_with_sink_in_place(row, sink);
                }
                let dst = &mut local[j * group * hd..(j + 1) * group * hd];
                for bi in start / bs..=pos / bs {
                    let first = start.max(bi * bs);
                    let last = pos.min(bi * bs + bs - 1);
                    let off = layout.offset(seq.block_table[bi] as usize, h, first % bs);
                    let rows = &v_pool[off..off + (last - first + 1) * hd];
                    self.weighted_rows(rows, hd, &scores, n_keys, first - start, dst);
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
}

fn validate(
    cache: &KvBlocksMut<'_>,
    seqs: &[AttnSeq<'_>],
    qkv: &[f32],
    shape: &AttnShape,
    out: &[f32],
) -> Result<(), AttnError> {
    let layout = cache.layout;
    if layout.kv_heads != shape.kv_heads || layout.head_dim != shape.head_dim || shape.kv_heads == 0
    {
        return Err(AttnError::Layout {
            cache_heads: layout.kv_heads,
            cache_dim: layout.head_dim,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
        });
    }
    let expected: usize = seqs.iter().map(|s| s.n_new).sum();
    let rows = qkv.len() / shape.qkv_width().max(1);
    if rows * shape.qkv_width() != qkv.len()
        || rows != expected
        || out.len() != rows * shape.q_width()
    {
        return Err(AttnError::RowCount { rows, expected });
    }
    let n_blocks = cache.n_blocks();
    for (i, s) in seqs.iter().enumerate() {
        let tokens = s.context_len + s.n_new;
        let covered = s.block_table.len() * layout.block_size >= tokens;
        let in_pool = s
            .block_table
            .iter()
            .take(layout.blocks_for(tokens))
            .all(|&b| (b as usize) < n_blocks);
        if !covered || !in_pool {
            return Err(AttnError::BlockTable {
                seq: i,
                tokens,
                n_blocks,
            });
        }
    }
    Ok(())
}

fn append_kv(cache: &mut KvBlocksMut<'_>, seqs: &[AttnSeq<'_>], qkv: &[f32], shape: &AttnShape) {
    let layout = cache.layout;
    let hd = shape.head_dim;
    let row_w = shape.qkv_width();
    let k_base = shape.heads * hd;
    let v_base = k_base + shape.kv_heads * hd;
    let mut row = 0;
    for s in seqs {
        for j in 0..s.n_new {
            let pos = s.context_len + j;
            let b = s.block_table[pos / layout.block_size] as usize;
            let src = &qkv[(row + j) * row_w..(row + j + 1) * row_w];
            let slot = pos % layout.block_size;
            for h in 0..shape.kv_heads {
                let off = layout.offset(b, h, slot);
                cache.v[off..off + hd]
                    .copy_from_slice(&src[v_base + h * hd..v_base + (h + 1) * hd]);
                // Keys are stored transposed within the tile (see `KvLayout`).
                for (dim, &k) in src[k_base + h * hd..k_base + (h + 1) * hd]
                    .iter()
                    .enumerate()
                {
                    cache.k[layout.key_offset(b, h, slot, dim)] = k;
                }
            }
        }
        row += s.n_new;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::kv_cache::PagedKvCache;
    use crate::model::vocab::KvLayout;

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
                                * qkv
                                    [s * row_w + (shape.heads + shape.kv_heads) * hd + kvh * hd + d]
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
            let layer = cache.layer_mut(0);
            (out, layer.k.to_vec(), layer.v.to_vec())
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
}
