//! Grouped-query attention over a paged KV cache, for a micro-batch of sequences that
//! each bring one or more new tokens (prefill and decode mixed in one call).
//!
//! Takes the rotated `qkv` rows (`[q | k | v]` per token, sequences concatenated in the
//! order of `seqs`), each sequence's block table and cached length, and one layer's
//! [`KvBlocksMut`]. It first appends the new keys/values, then computes causal attention
//! (new token `j` of a sequence sees cached tokens and new tokens `0..=j`, optionally only
//! the last `sliding_window`), softmax in f32. Work is split over (sequence, kv head)
//! with rayon; each key and value row is read once per kv head and reused by every query
//! head of its group. The cache holds f32 or IEEE half elements (`KvType`): new keys
//! and values are rounded to its type when appended and widened exactly when read, so a
//! half cache gives the bits of an f32 cache holding the rounded values. A decode row
//! (one new token) over blocks of a multiple of 8 slots takes `attn_decode`'s kernel,
//! whose bits are this module's general kernel's. Inconsistent inputs are errors, never
//! panics.

use crate::math::attn_decode::{DecodeHead, KvElem};
use crate::math::isa::Kernels;
use crate::math::kv_cache::{KvBlocksMut, KvPools};
use crate::model::vocab::{AttnShape, KvLayout};
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
        self.attention_with(cache, seqs, qkv, shape, out, attend, true)
    }

    /// [`Kernels::attention`] with every row through the general (tiled) kernel, decode
    /// rows included: the kernel decode rows took before `attn_decode`'s, which gives the
    /// same bits; benches time the two side by side.
    pub fn attention_general(
        self,
        cache: &mut KvBlocksMut<'_>,
        seqs: &[AttnSeq<'_>],
        qkv: &[f32],
        shape: &AttnShape,
        out: &mut [f32],
    ) -> Result<(), AttnError> {
        self.attention_with(cache, seqs, qkv, shape, out, &|_| true, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_with(
        self,
        cache: &mut KvBlocksMut<'_>,
        seqs: &[AttnSeq<'_>],
        qkv: &[f32],
        shape: &AttnShape,
        out: &mut [f32],
        attend: &(dyn Fn(usize) -> bool + Sync),
        decode_kernel: bool,
    ) -> Result<(), AttnError> {
        validate(cache, seqs, qkv, shape, out)?;
        append_kv(cache, seqs, qkv, shape);
        let group = shape.heads / shape.kv_heads;
        let hd = shape.head_dim;
        let mut first_rows = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for s in seqs {
            first_rows.push(row);
            row += s.n_new;
        }
        // Tasks are (sequence, kv head, tile of new tokens); a tile's score rows must fit
        // the scratch bound, so long contexts take fewer rows per tile.
        let mut tasks: Vec<Task> = Vec::new();
        for (s, seq) in seqs.iter().enumerate().filter(|&(s, _)| attend(s)) {
            let longest = seq.context_len + seq.n_new;
            let rows = (SCRATCH_FLOATS / (group * longest).max(1)).clamp(1, QUERY_TILE);
            for h in 0..shape.kv_heads {
                let mut j0 = 0;
                while j0 < seq.n_new {
                    let j1 = (j0 + rows).min(seq.n_new);
                    tasks.push(Task {
                        seq: s,
                        head: h,
                        rows: j0..j1,
                    });
                    j0 = j1;
                }
            }
        }
        let pools = Pools {
            layout: cache.layout,
            data: match &cache.pools {
                KvPools::F32 { k, v } => PoolRef::F32 { k, v },
                KvPools::F16 { k, v } => PoolRef::F16 { k, v },
            },
        };
        let run = |task: &Task| -> Vec<f32> {
            let seq = &seqs[task.seq];
            if decode_kernel && task.rows.len() == 1 && seq.n_new == 1 {
                return self.attend_decode(&pools, seq, first_rows[task.seq], task, qkv, shape);
            }
            self.attend_tile(&pools, seq, first_rows[task.seq], task, qkv, shape)
        };
        let results: Vec<Vec<f32>> = if tasks.len() > 1 {
            tasks.par_iter().map(run).collect()
        } else {
            tasks.iter().map(run).collect()
        };
        let q_w = shape.q_width();
        for (task, local) in tasks.iter().zip(&results) {
            for (i, j) in task.rows.clone().enumerate() {
                let r = first_rows[task.seq] + j;
                let (h, width) = (task.head, group * hd);
                out[r * q_w + h * width..r * q_w + (h + 1) * width]
                    .copy_from_slice(&local[i * width..(i + 1) * width]);
            }
        }
        Ok(())
    }

    /// One task: the outputs (`rows x group x head_dim`) of one kv head's query heads for
    /// a tile of one sequence's new tokens. Key- and value-block-major: each block of the
    /// cache is read once for the whole tile (while it is in L1) rather than once per
    /// query row, which is what makes long prefills memory-bound no more. Each row's
    /// arithmetic is exactly the per-row kernel's: its scores are computed one key at a
    /// time ([`Kernels::key_scores_transposed`] never depends on which keys share a
    /// call), its softmax runs over its whole row once every score is in, and its output
    /// accumulates the value rows in key order ([`Kernels::weighted_rows`]), so a row's
    /// bits do not depend on the tile it is in, nor on prefill or decode.
    fn attend_tile(
        self,
        pools: &Pools<'_>,
        seq: &AttnSeq<'_>,
        first_row: usize,
        task: &Task,
        qkv: &[f32],
        shape: &AttnShape,
    ) -> Vec<f32> {
        let layout = pools.layout;
        let (bs, hd, h) = (layout.block_size, shape.head_dim, task.head);
        let group = shape.heads / shape.kv_heads;
        let row_w = shape.qkv_width();
        let scale = 1.0 / (hd as f32).sqrt();
        // Per row: its first key and key count, and where its scores start in `scores`.
        let rows: Vec<RowKeys> = task
            .rows
            .clone()
            .scan(0usize, |at, j| {
                let pos = seq.context_len + j;
                let start = shape
                    .sliding_window
                    .map_or(0, |w| (pos + 1).saturating_sub(w));
                let row = RowKeys {
                    j,
                    start,
                    pos,
                    scores_at: *at,
                };
                *at += group * (pos + 1 - start);
                Some(row)
            })
            .collect();
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
            return Vec::new();
        };
        let n_scores = last.scores_at + group * last.n_keys();
        let mut scores = vec![0.0f32; n_scores];
        let lowest = rows.iter().map(|r| r.start).min().unwrap_or(first.start);
        let blocks = lowest / bs..=last.pos / bs;
        // A half cache's tile, widened (exactly) once for every row of the tile.
        let mut wide = Vec::new();
        for bi in blocks.clone() {
            let tile = layout.tile(seq.block_table[bi] as usize, h);
            let k_tile = pools.keys(tile..tile + bs * hd, &mut wide);
            for r in &rows {
                let Some((lo, hi)) = r.keys_in(bi, bs) else {
                    continue;
                };
                let q_off = (first_row + r.j) * row_w + h * group * hd;
                let n_keys = r.n_keys();
                self.key_scores_transposed(
                    k_tile,
                    bs,
                    lo % bs,
                    hi - lo + 1,
                    &qkv[q_off..q_off + group * hd],
                    scale,
                    &mut scores[r.scores_at..r.scores_at + group * n_keys],
                    n_keys,
                    lo - r.start,
                );
            }
        }
        for r in &rows {
            let sink_at = (first_row + r.j) * row_w + (shape.heads + 2 * shape.kv_heads) * hd;
            let n_keys = r.n_keys();
            let row_scores = &mut scores[r.scores_at..r.scores_at + group * n_keys];
            for (g, row) in row_scores.chunks_exact_mut(n_keys).enumerate() {
                let sink = shape.sinks.then(|| qkv[sink_at + h * group + g]);
                self.softmax_with_sink_in_place(row, sink);
            }
        }
        let width = group * hd;
        let mut local = vec![0.0f32; rows.len() * width];
        for bi in blocks {
            let block = seq.block_table[bi] as usize;
            for (i, r) in rows.iter().enumerate() {
                let Some((lo, hi)) = r.keys_in(bi, bs) else {
                    continue;
                };
                let off = layout.offset(block, h, lo % bs);
                let n_keys = r.n_keys();
                self.weighted_rows(
                    pools.values(off..off + (hi - lo + 1) * hd, &mut wide),
                    hd,
                    &scores[r.scores_at..r.scores_at + group * n_keys],
                    n_keys,
                    lo - r.start,
                    &mut local[i * width..(i + 1) * width],
                );
            }
        }
        local
    }
}

impl Kernels {
    /// A task of one decode row: [`DecodeHead`]'s score pass, the softmax of
    /// [`Kernels::attend_tile`], then its value pass; the same bits as `attend_tile`.
    fn attend_decode(
        self,
        pools: &Pools<'_>,
        seq: &AttnSeq<'_>,
        first_row: usize,
        task: &Task,
        qkv: &[f32],
        shape: &AttnShape,
    ) -> Vec<f32> {
        let (hd, h) = (shape.head_dim, task.head);
        let group = shape.heads / shape.kv_heads;
        let row_w = shape.qkv_width();
        let scale = 1.0 / (hd as f32).sqrt();
        let pos = seq.context_len;
        let start = shape
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        let q_off = first_row * row_w + h * group * hd;
        let q = &qkv[q_off..q_off + group * hd];
        let sink_at = first_row * row_w + (shape.heads + 2 * shape.kv_heads) * hd;
        let sinks: Vec<f32> = (0..group)
            .filter(|_| shape.sinks)
            .map(|g| qkv[sink_at + h * group + g])
            .collect();
        let mut out = vec![0.0f32; group * hd];
        let (layout, table) = (pools.layout, seq.block_table);
        match pools.data {
            PoolRef::F32 { k, v } => self.decode_head(
                &DecodeHead {
                    k,
                    v,
                    layout,
                    head: h,
                    table,
                    start,
                    pos,
                },
                q,
                scale,
                &sinks,
                &mut out,
            ),
            PoolRef::F16 { k, v } => self.decode_head(
                &DecodeHead {
                    k,
                    v,
                    layout,
                    head: h,
                    table,
                    start,
                    pos,
                },
                q,
                scale,
                &sinks,
                &mut out,
            ),
        }
        out
    }
}

impl Kernels {
    /// Scores, softmax (with each head's sink when `sinks` has them) and values of one
    /// decode row's query heads over `head`.
    fn decode_head<T: KvElem>(
        self,
        head: &DecodeHead<'_, T>,
        q: &[f32],
        scale: f32,
        sinks: &[f32],
        out: &mut [f32],
    ) {
        let n_keys = head.n_keys();
        let group = out.len() / head.layout.head_dim.max(1);
        let mut scores = vec![0.0f32; group * n_keys];
        head.scores(self, q, scale, &mut scores);
        for (g, row) in scores.chunks_exact_mut(n_keys).enumerate() {
            self.softmax_with_sink_in_place(row, sinks.get(g).copied());
        }
        head.values(self, &scores, out);
    }
}

/// Most new tokens one attention task takes (a tile's rows share each key block read).
const QUERY_TILE: usize = 16;

/// Bound on one task's score scratch, in floats (4 MiB): a tile has fewer rows when its
/// rows' scores (`group x keys` each) would take more, down to one row.
const SCRATCH_FLOATS: usize = 1 << 20;

/// One unit of parallel work of [`Kernels::attention_of`].
struct Task {
    seq: usize,
    head: usize,
    /// New-token indices (within the sequence) of the tile.
    rows: std::ops::Range<usize>,
}

/// A layer's pools, read-only once the new K/V are appended.
struct Pools<'a> {
    layout: KvLayout,
    data: PoolRef<'a>,
}

/// The pools in their element type.
#[derive(Clone, Copy)]
enum PoolRef<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    F16 { k: &'a [u16], v: &'a [u16] },
}

impl Pools<'_> {
    /// Keys `range` of the K pool as f32: borrowed, or widened into `wide`.
    fn keys<'b>(&'b self, range: std::ops::Range<usize>, wide: &'b mut Vec<f32>) -> &'b [f32] {
        match self.data {
            PoolRef::F32 { k, .. } => &k[range],
            PoolRef::F16 { k, .. } => widen_into(&k[range], wide),
        }
    }

    /// Values `range` of the V pool as f32: borrowed, or widened into `wide`.
    fn values<'b>(&'b self, range: std::ops::Range<usize>, wide: &'b mut Vec<f32>) -> &'b [f32] {
        match self.data {
            PoolRef::F32 { v, .. } => &v[range],
            PoolRef::F16 { v, .. } => widen_into(&v[range], wide),
        }
    }
}

/// `bits` (IEEE halves) widened to f32 in `wide` (F16C where the CPU has it; exact).
fn widen_into<'b>(bits: &[u16], wide: &'b mut Vec<f32>) -> &'b [f32] {
    use half::slice::HalfFloatSliceExt;
    wide.clear();
    wide.resize(bits.len(), 0.0);
    let halves: &[half::f16] = bytemuck::cast_slice(bits);
    halves.convert_to_f32_slice(wide);
    wide
}

/// `x` rounded to a half (nearest, ties to even), as its bits.
pub fn to_half_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// The keys one query row attends: positions `start..=pos`.
struct RowKeys {
    /// New-token index within the sequence.
    j: usize,
    start: usize,
    pos: usize,
    /// Offset of the row's `group x n_keys` scores in the tile's scratch.
    scores_at: usize,
}

impl RowKeys {
    fn n_keys(&self) -> usize {
        self.pos + 1 - self.start
    }

    /// The row's keys within block `bi` (first and last position), if any.
    fn keys_in(&self, bi: usize, bs: usize) -> Option<(usize, usize)> {
        let lo = self.start.max(bi * bs);
        let hi = self.pos.min(bi * bs + bs - 1);
        (lo <= hi).then_some((lo, hi))
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
                let values = &src[v_base + h * hd..v_base + (h + 1) * hd];
                let keys = src[k_base + h * hd..k_base + (h + 1) * hd].iter();
                // Keys are stored transposed within the tile (see `KvLayout`).
                match &mut cache.pools {
                    KvPools::F32 { k, v } => {
                        v[off..off + hd].copy_from_slice(values);
                        for (dim, &x) in keys.enumerate() {
                            k[layout.key_offset(b, h, slot, dim)] = x;
                        }
                    }
                    KvPools::F16 { k, v } => {
                        for (dst, &x) in v[off..off + hd].iter_mut().zip(values) {
                            *dst = to_half_bits(x);
                        }
                        for (dim, &x) in keys.enumerate() {
                            k[layout.key_offset(b, h, slot, dim)] = to_half_bits(x);
                        }
                    }
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
            let k_cols =
                shape.heads * shape.head_dim..(shape.heads + shape.kv_heads) * shape.head_dim;
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
            // The contexts, appended with the per-row kernel (what an earlier pass left).
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
            let mut ctx_out = vec![0.0; ctx_rows * shape.q_width()];
            per_row_reference(
                Kernels::portable(),
                &mut cache.layer_mut(0),
                &ctx_seqs,
                &ctx_qkv,
                shape,
                &mut ctx_out,
            )
            .unwrap();
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

    /// The key-block-tiled kernel gives exactly the per-row kernel's bits on random
    /// inputs: prefill, decode and chunked rows after a cached context, several sequences,
    /// tiles with a partial last tile (more than [`QUERY_TILE`] rows, not a multiple),
    /// odd block sizes and head widths (the SIMD bodies' tails and the portable path),
    /// sliding windows and sinks, on every instruction set this CPU has.
    #[test]
    fn tiled_attention_gives_the_per_row_kernel_s_bits() {
        for isa in crate::math::isa::Isa::supported() {
            let kernels = Kernels::new(isa).unwrap();
            for kv_type in [KvType::F32, KvType::F16] {
                for (i, call) in random_cases(kv_type, false).into_iter().enumerate() {
                    let shape = call.shape;
                    let tiled = call.run(&|cache, seqs, qkv, out| {
                        kernels.attention(cache, seqs, qkv, &shape, out).unwrap()
                    });
                    let per_row = call.run(&|cache, seqs, qkv, out| {
                        per_row_reference(kernels, cache, seqs, qkv, &shape, out).unwrap()
                    });
                    let what = format!("{isa} {kv_type:?} case {i}");
                    assert_eq!(bits(&tiled.0), bits(&per_row.0), "{what}: outputs");
                    assert_eq!(bits(&tiled.1), bits(&per_row.1), "{what}: keys");
                    assert_eq!(bits(&tiled.2), bits(&per_row.2), "{what}: values");
                    assert!(tiled.0.iter().all(|x| x.is_finite()));
                }
            }
        }
    }

    /// The random calls of the kernel tests: prefill, decode and chunked rows after a
    /// cached context, several sequences, odd block sizes and head widths (the portable
    /// paths), blocks of 8, 16 and 32 (the decode kernel), GQA groups of 1, 2, 3, 4 and
    /// 8, partial last blocks, sliding windows and sinks.
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
                let kernel: &KernelCall = &|cache, seqs, qkv, out| {
                    kernels.attention(cache, seqs, qkv, &shape, out).unwrap()
                };
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

    /// With `MOEC_ATTN_BENCH=1`: prefill of one sequence of 2k, 8k and 32k tokens on the
    /// tiny cards' attention shape (4 heads, 2 kv heads, 32 wide, blocks of 16), and one
    /// decode step at that length, timed for the per-row and the tiled kernel. Prints
    /// milliseconds; asserts only equal bits (timings depend on the machine).
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
        let shape = AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            sliding_window: None,
            sinks: false,
        };
        let layout = KvLayout {
            block_size: 16,
            kv_heads: 2,
            head_dim: 32,
        };
        let kernels = Kernels::process();
        for n in lengths {
            for (what, lens) in [("prefill", vec![(0, n)]), ("decode", vec![(n - 1, 1)])] {
                let call = RandomCall {
                    shape,
                    layout,
                    lens,
                    seed: 1,
                    kv_type: KvType::F32,
                    round_kv: false,
                };
                let tiled = call.run(&|cache, seqs, qkv, out| {
                    let t = std::time::Instant::now();
                    kernels.attention(cache, seqs, qkv, &shape, out).unwrap();
                    eprintln!(
                        "  tiled   {what} {n}: {:.2} ms",
                        t.elapsed().as_secs_f64() * 1e3
                    );
                });
                let per_row = call.run(&|cache, seqs, qkv, out| {
                    let t = std::time::Instant::now();
                    per_row_reference(kernels, cache, seqs, qkv, &shape, out).unwrap();
                    eprintln!(
                        "  per-row {what} {n}: {:.2} ms",
                        t.elapsed().as_secs_f64() * 1e3
                    );
                });
                assert_eq!(bits(&tiled.0), bits(&per_row.0));
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
