//! Grouped-query attention over a paged KV cache, for a micro-batch of sequences that
//! each bring one or more new tokens (prefill and decode mixed in one call).
//!
//! Takes the rotated `qkv` rows (`[q | k | v]` per token, sequences concatenated in the
//! order of `seqs`), each sequence's block table and cached length, and one layer's
//! [`KvBlocksMut`]. It first appends the new keys/values, then computes causal attention
//! (new token `j` of a sequence sees cached tokens and new tokens `0..=j`, optionally only
//! the last `sliding_window`), softmax in f32. Work is split over (sequence, kv head,
//! tile of up to 16 new tokens) with rayon; each key and value block is read once per
//! tile and reused by every new token and query head of it (register-blocked products).
//! The cache holds f32 or IEEE half elements (`KvType`): new keys and values are rounded
//! to its type when appended and widened exactly when read, so a half cache gives the
//! bits of an f32 cache holding the rounded values. A cache whose values are read from the
//! keys (`KvLayout::values_in_keys`: DeepSeek MLA's latent cached once) stores only the
//! keys, and each value row is its key's first components (then zeros), transposed out of
//! the key tile exactly, so it gives the bits of a cache with a V pool. A decode row
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
            let rows = crate::model::vocab::attention_tile_rows(group, longest);
            for h in 0..shape.kv_heads {
                let mut j0 = 0;
                while j0 < seq.n_new {
                    let j1 = (j0 + rows).min(seq.n_new);
                    tasks.push(Task {
                        seq: s,
                        head: h,
                        rows: j0..j1,
                        qheads: 0..group,
                    });
                    j0 = j1;
                }
            }
        }
        if decode_kernel {
            tasks = split_decode_groups(tasks, seqs, group, rayon::current_num_threads());
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
                let at = r * q_w + (task.head * group + task.qheads.start) * hd;
                let width = task.qheads.len() * hd;
                out[at..at + width].copy_from_slice(&local[i * width..(i + 1) * width]);
            }
        }
        Ok(())
    }

    /// One task: the outputs (`rows x group x head_dim`) of one kv head's query heads for
    /// a tile of one sequence's new tokens. Key- and value-block-major: each block of the
    /// cache is read (and a half cache's block widened) once for the whole tile, and the
    /// products over it run register-blocked over the (row, query head) pairs of the tile
    /// whose key range in that block is the same ([`Kernels::key_scores_blocked`],
    /// [`Kernels::weighted_rows_blocked`]: one loaded key or value vector feeds an FMA
    /// chain per pair). Each row's arithmetic is exactly the per-row kernel's: each
    /// score is one sequential fused sum over the head's dimensions, its softmax runs
    /// over its whole row once every score is in, and its output accumulates the value
    /// rows in key order, so a row's bits do not depend on the tile it is in, on its
    /// neighbours, nor on prefill or decode.
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
        // The worker's scratch: every score of every row is written before it is read.
        let mut scratch = SCORES.with(|cell| cell.take());
        if scratch.len() < n_scores {
            scratch.resize(n_scores, 0.0);
        }
        let scores = &mut scratch[..n_scores];
        let lowest = rows.iter().map(|r| r.start).min().unwrap_or(first.start);
        let blocks = lowest / bs..=last.pos / bs;
        // A half cache's block, widened (exactly) once for every row of the tile.
        let mut wide = Vec::new();
        let mut pairs: Vec<(usize, usize)> = Vec::with_capacity(rows.len() * group);
        for bi in blocks.clone() {
            let tile = layout.tile(seq.block_table[bi] as usize, h);
            let k_tile = pools.keys(tile..tile + bs * hd, &mut wide);
            for (lo, hi, same) in runs_in_block(&rows, bi, bs) {
                pairs.clear();
                for r in same {
                    let q_off = (first_row + r.j) * row_w + h * group * hd;
                    let n_keys = r.n_keys();
                    pairs.extend(
                        (0..group)
                            .map(|g| (q_off + g * hd, r.scores_at + g * n_keys + lo - r.start)),
                    );
                }
                self.key_scores_blocked(
                    k_tile,
                    bs,
                    lo % bs,
                    hi - lo + 1,
                    qkv,
                    &pairs,
                    scale,
                    scores,
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
        let first_j = first.j;
        for bi in blocks {
            let tile = layout.tile(seq.block_table[bi] as usize, h);
            let v_tile = pools.values(self, tile, &mut wide);
            for (lo, hi, same) in runs_in_block(&rows, bi, bs) {
                pairs.clear();
                for r in same {
                    let n_keys = r.n_keys();
                    let out_at = (r.j - first_j) * width;
                    pairs.extend(
                        (0..group)
                            .map(|g| (r.scores_at + g * n_keys + lo - r.start, out_at + g * hd)),
                    );
                }
                self.weighted_rows_blocked(
                    &v_tile[(lo % bs) * hd..(hi % bs + 1) * hd],
                    hd,
                    scores,
                    &pairs,
                    &mut local,
                );
            }
        }
        SCORES.with(|cell| cell.replace(scratch));
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
        let qheads = task.qheads.clone();
        let row_w = shape.qkv_width();
        let scale = 1.0 / (hd as f32).sqrt();
        let pos = seq.context_len;
        let start = shape
            .sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w));
        let q_off = first_row * row_w + (h * group + qheads.start) * hd;
        let q = &qkv[q_off..q_off + qheads.len() * hd];
        let sink_at = first_row * row_w + (shape.heads + 2 * shape.kv_heads) * hd;
        let sinks: Vec<f32> = qheads
            .clone()
            .filter(|_| shape.sinks)
            .map(|g| qkv[sink_at + h * group + g])
            .collect();
        let mut out = vec![0.0f32; qheads.len() * hd];
        let (layout, table) = (pools.layout, seq.block_table);
        // One call for either element type: `decode_head` is generic over it.
        macro_rules! decode {
            ($k:expr, $v:expr) => {
                self.decode_head(
                    &DecodeHead {
                        k: $k,
                        v: $v,
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
                )
            };
        }
        match pools.data {
            PoolRef::F32 { k, v } => decode!(k, v),
            PoolRef::F16 { k, v } => decode!(k, v),
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
        // The worker's score scratch (see `SCORES`): a fresh `group x n_keys` vector was
        // mapped and faulted in on every call (256 KiB a kv head at 8k positions and a
        // group of 8). The score pass writes every score before the softmax reads it.
        let mut scratch = SCORES.with(|cell| cell.take());
        if scratch.len() < group * n_keys {
            scratch.resize(group * n_keys, 0.0);
        }
        let scores = &mut scratch[..group * n_keys];
        head.scores(self, q, scale, scores);
        for (g, row) in scores.chunks_exact_mut(n_keys).enumerate() {
            self.softmax_with_sink_in_place(row, sinks.get(g).copied());
        }
        head.values(self, scores, out);
        SCORES.with(|cell| cell.replace(scratch));
    }
}

thread_local! {
    /// A tile's (or a decode row's) score scratch, kept by each worker thread between its
    /// tasks: a long
    /// prefill's tasks take megabytes each, which fresh allocations paid for in page faults
    /// (a tenth of the kernel's time at 8k on Qwen3's shape).
    static SCORES: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// One unit of parallel work of [`Kernels::attention_of`].
struct Task {
    seq: usize,
    head: usize,
    /// New-token indices (within the sequence) of the tile.
    rows: std::ops::Range<usize>,
    /// The kv head's query heads the task computes (within its group): the whole group,
    /// or part of it for a decode row split by [`split_decode_groups`].
    qheads: std::ops::Range<usize>,
}

/// Splits decode rows' query-head groups where the tasks are fewer than `threads`: one
/// sequence over one kv head (MLA's latent at batch 1: 16 query heads) was one task, so
/// one thread attended 8k positions while the others waited (DeepSeek-V2-Lite: 115 ms of
/// a 214 ms decode step at 8,192 positions). Each part reads the kv head's keys and
/// values itself (more bytes, where the group's arithmetic is what takes the time); a
/// head's scores, softmax and values are its own whatever heads share its task, so the
/// bits do not change. Parts stay whole groups of at least 4 heads (the decode bodies'
/// register blocks).
fn split_decode_groups(
    tasks: Vec<Task>,
    seqs: &[AttnSeq<'_>],
    group: usize,
    threads: usize,
) -> Vec<Task> {
    const MIN_HEADS: usize = 4;
    let decode = |t: &Task| t.rows.len() == 1 && seqs[t.seq].n_new == 1;
    if tasks.is_empty() || tasks.len() >= threads || !tasks.iter().all(decode) {
        return tasks;
    }
    let parts = threads.div_ceil(tasks.len()).min(group / MIN_HEADS).max(1);
    if parts == 1 {
        return tasks;
    }
    let per = group.div_ceil(parts);
    tasks
        .into_iter()
        .flat_map(|t| {
            (0..group).step_by(per).map(move |g0| Task {
                qheads: g0..(g0 + per).min(group),
                rows: t.rows.clone(),
                ..t
            })
        })
        .collect()
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

    /// The value rows (`[slot][head_dim]`) of the whole tile at `tile` as f32: borrowed
    /// from the V pool, or widened into `wide`, or, when the layout reads the values from
    /// the keys, transposed out of the K tile into `wide`.
    fn values<'b>(&'b self, kernels: Kernels, tile: usize, wide: &'b mut Vec<f32>) -> &'b [f32] {
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        let range = tile..tile + bs * hd;
        if let Some(w) = self.layout.values_in_keys {
            if wide.len() < bs * hd {
                wide.resize(bs * hd, 0.0);
            }
            let rows = &mut wide[..bs * hd];
            match self.data {
                PoolRef::F32 { k, .. } => kernels.keys_as_values(&k[range], bs, w, 0..bs, rows),
                PoolRef::F16 { k, .. } => kernels.keys_as_values(&k[range], bs, w, 0..bs, rows),
            }
            return rows;
        }
        match self.data {
            PoolRef::F32 { v, .. } => &v[range],
            PoolRef::F16 { v, .. } => widen_into(&v[range], wide),
        }
    }
}

/// `bits` (IEEE halves) widened to f32 in `wide` (F16C where the CPU has it; exact).
/// `wide` only grows: it is written whole before it is read.
fn widen_into<'b>(bits: &[u16], wide: &'b mut Vec<f32>) -> &'b [f32] {
    if wide.len() < bits.len() {
        wide.resize(bits.len(), 0.0);
    }
    let wide = &mut wide[..bits.len()];
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx") && std::is_x86_feature_detected!("f16c") {
        // SAFETY: AVX and F16C are present (checked); `wide` is as long as `bits`.
        unsafe { widen_f16c(bits, wide) };
        return wide;
    }
    use half::slice::HalfFloatSliceExt;
    let halves: &[half::f16] = bytemuck::cast_slice(bits);
    halves.convert_to_f32_slice(wide);
    wide
}

/// [`widen_into`]'s body with F16C: `half`'s slice conversion (the same instruction)
/// made a call per 8 halves, a tenth of a long prefill's time on a half cache.
///
/// # Safety
/// AVX and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(bits: &[u16], wide: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = bits.len().min(wide.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n bounds the 16-byte load and the 32-byte store.
        unsafe {
            let h = _mm_loadu_si128(bits.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(wide.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (w, &b) in wide[i..n].iter_mut().zip(&bits[i..n]) {
        *w = half::f16::from_bits(b).to_f32();
    }
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

/// The tile's rows that attend keys of block `bi`, in runs of consecutive rows with the
/// same first and last key there (`lo`, `hi`): each run is one blocked call.
fn runs_in_block(
    rows: &[RowKeys],
    bi: usize,
    bs: usize,
) -> impl Iterator<Item = (usize, usize, &[RowKeys])> {
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < rows.len() {
            let Some(range) = rows[i].keys_in(bi, bs) else {
                i += 1;
                continue;
            };
            let len = rows[i..]
                .iter()
                .take_while(|r| r.keys_in(bi, bs) == Some(range))
                .count();
            let run = &rows[i..i + len];
            i += len;
            return Some((range.0, range.1, run));
        }
        None
    })
}

fn validate(
    cache: &KvBlocksMut<'_>,
    seqs: &[AttnSeq<'_>],
    qkv: &[f32],
    shape: &AttnShape,
    out: &[f32],
) -> Result<(), AttnError> {
    let layout = cache.layout;
    let values_fit = layout.values_in_keys.is_none_or(|w| w <= layout.head_dim);
    if layout.kv_heads != shape.kv_heads
        || layout.head_dim != shape.head_dim
        || shape.kv_heads == 0
        || !values_fit
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
                // A cache that reads the values from the keys stores no V.
                let values = (layout.values_in_keys.is_none()).then(|| {
                    (
                        layout.offset(b, h, slot),
                        &src[v_base + h * hd..v_base + (h + 1) * hd],
                    )
                });
                let keys = src[k_base + h * hd..k_base + (h + 1) * hd].iter();
                // Keys are stored transposed within the tile (see `KvLayout`).
                match &mut cache.pools {
                    KvPools::F32 { k, v } => {
                        if let Some((off, values)) = values {
                            v[off..off + hd].copy_from_slice(values);
                        }
                        for (dim, &x) in keys.enumerate() {
                            k[layout.key_offset(b, h, slot, dim)] = x;
                        }
                    }
                    KvPools::F16 { k, v } => {
                        if let Some((off, values)) = values {
                            for (dst, &x) in v[off..off + hd].iter_mut().zip(values) {
                                *dst = to_half_bits(x);
                            }
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
#[path = "attention_tests.rs"]
mod tests;
