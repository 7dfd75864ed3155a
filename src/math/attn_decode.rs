//! Decode attention (one new token of one sequence, one kv head) at the memory rate.
//!
//! Takes the layer's K and V pools in their stored element type (f32, or IEEE half bits),
//! the sequence's block table, the keys a query row attends (`start..=pos`) and the
//! group's query heads; gives the scores (`group x n_keys`) and, once the caller has
//! softmaxed them, the outputs (`group x head_dim`). Each K and V block of the head is
//! read from memory once for every query head of its GQA group: the score pass walks
//! vectors of 8 key slots, up to 8 of them (from several blocks) at a time so that enough
//! independent fused multiply-add chains are in flight to keep up with the loads, and
//! every query head of the group takes the same chunk while it is in L1; halves are
//! widened in registers (F16C). Guarantees: every score is `scale * Σ_dim q[dim] *
//! key[dim]` summed sequentially over `dim` with fused multiply-adds, and every output
//! element `Σ_r p[r] * value[r]` sequentially over the keys from zero, exactly as
//! `math::simd`'s kernels sum them, so the bits equal the general kernel's on the same
//! (widened) cache. Under the AVX-512 set, block sizes and head widths that are multiples
//! of 16 take vectors of 16 lanes (16 keys a score vector: each K element widened once
//! for up to 8 query heads); other multiples of 8 take the AVX2 bodies
//! ([`DecodeHead::fits_vector`]); the rest plain loops. The next tiles' cache lines are
//! asked for a few at a time as the arithmetic runs ([`Trickle`]).

use crate::math::isa::{Isa, Kernels};
use crate::model::vocab::KvLayout;

/// One decode row's work over one kv head (see the module header).
pub(crate) struct DecodeHead<'a, T> {
    /// The layer's K pool.
    pub k: &'a [T],
    /// The layer's V pool.
    pub v: &'a [T],
    /// The pools' shape.
    pub layout: KvLayout,
    /// The kv head.
    pub head: usize,
    /// The sequence's block table (covers `pos`).
    pub table: &'a [u32],
    /// First key attended.
    pub start: usize,
    /// Last key attended (the new token's position).
    pub pos: usize,
}

/// A stored KV element the kernels widen to f32.
pub(crate) trait KvElem: Copy + Send + Sync {
    /// The element as f32 (exact).
    fn widen(self) -> f32;

    /// Eight elements widened to f32 lanes.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; `p..p + 8` readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen elements widened to f32 lanes.
    ///
    /// # Safety
    /// AVX-512F available; `p..p + 16` readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller guarantees 8 readable elements.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller guarantees 16 readable elements.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElem for u16 {
    fn widen(self) -> f32 {
        half::f16::from_bits(self).to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 8 readable halves (16 bytes).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 16 readable halves (32 bytes).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
}
/// Eight key slots of one block: the element offset of their first dimension's row in the
/// K pool (dimension `d` at `+ d * block_size`), the lanes `lo..hi` attended, and the
/// score index of lane `lo`.
#[derive(Debug, Clone, Copy)]
struct SlotVec {
    off: usize,
    lo: usize,
    hi: usize,
    key: usize,
}

impl<T: KvElem> DecodeHead<'_, T> {
    /// Keys attended.
    pub fn n_keys(&self) -> usize {
        self.pos + 1 - self.start
    }

    /// Whether the vector bodies run (`kernels` has AVX2, FMA and F16C; blocks and heads
    /// are whole vectors of 8).
    pub fn fits_vector(&self, kernels: Kernels) -> bool {
        vector_bodies(kernels)
            && self.layout.block_size.is_multiple_of(8)
            && self.layout.head_dim.is_multiple_of(8)
    }

    /// Whether the AVX-512 bodies run (`kernels` is the AVX-512 set; blocks and heads are
    /// whole vectors of 16).
    fn fits_wide(&self, kernels: Kernels) -> bool {
        wide_bodies(kernels)
            && self.layout.block_size.is_multiple_of(16)
            && self.layout.head_dim.is_multiple_of(16)
    }

    /// The attended key slots in vectors of `W` (8 or 16, dividing the block size), in
    /// key order.
    fn slot_vecs<const W: usize>(&self) -> Vec<SlotVec> {
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        let mut out = Vec::with_capacity(self.n_keys() / W + 2);
        for bi in self.start / bs..=self.pos / bs {
            let tile = self.layout.tile(self.table[bi] as usize, self.head);
            let first = self.start.max(bi * bs) - bi * bs;
            let last = self.pos.min(bi * bs + bs - 1) - bi * bs;
            let mut v0 = first / W * W;
            while v0 <= last {
                let lo = first.max(v0) - v0;
                let hi = (last + 1).min(v0 + W) - v0;
                out.push(SlotVec {
                    off: tile + v0,
                    lo,
                    hi,
                    key: bi * bs + v0 + lo - self.start,
                });
                v0 += W;
            }
            debug_assert!(tile + bs * hd <= self.k.len());
        }
        out
    }

    /// `scores[g * n_keys + key] = scale * q[g] · key` for every query head `g` of `q`
    /// (`group x head_dim`); `scores` holds `group x n_keys`.
    pub fn scores(&self, kernels: Kernels, q: &[f32], scale: f32, scores: &mut [f32]) {
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        let n_keys = self.n_keys();
        let group = q.len() / hd.max(1);
        debug_assert!(scores.len() >= group * n_keys);
        #[cfg(target_arch = "x86_64")]
        if self.fits_wide(kernels) {
            let vecs = self.slot_vecs::<16>();
            // SAFETY: the AVX-512 set is present (`fits_wide`); every slot vector lies
            // inside its tile (block sizes are multiples of 16 and the table names blocks
            // of the pool, checked by the caller's validation), so all 16 lanes of every
            // load of every dimension are in the K pool; stores touch only lanes lo..hi
            // of a row of `scores`, which `n_keys` covers.
            unsafe { avx512::scores(self.k, bs, hd, &vecs, q, group, scale, n_keys, scores) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.fits_vector(kernels) {
            let vecs = self.slot_vecs::<8>();
            // SAFETY: AVX2, FMA and F16C are present (`fits_vector`); every slot vector lies
            // inside its tile (block sizes are multiples of 8 and the table names blocks of
            // the pool, checked by the caller's validation), so all 8 lanes of every load
            // of every dimension are in the K pool; stores touch only lanes lo..hi of a
            // row of `scores`, which `n_keys` covers.
            unsafe { avx2::scores(self.k, bs, hd, &vecs, q, group, scale, n_keys, scores) };
            return;
        }
        for g in 0..group {
            let qg = &q[g * hd..(g + 1) * hd];
            for (i, p) in (self.start..=self.pos).enumerate() {
                let tile = self.layout.tile(self.table[p / bs] as usize, self.head);
                let slot = p % bs;
                let mut acc = 0.0f32;
                for (d, &qd) in qg.iter().enumerate() {
                    acc = qd.mul_add(self.k[tile + d * bs + slot].widen(), acc);
                }
                scores[g * n_keys + i] = acc * scale;
            }
        }
    }

    /// `out[g] = Σ_key probs[g * n_keys + key] * value[key]` (from zero, in key order).
    /// With the values in the keys (`KvLayout::values_in_keys`), each block's value rows
    /// are first transposed out of its K tile ([`Kernels::keys_as_values`]).
    pub fn values(&self, kernels: Kernels, probs: &[f32], out: &mut [f32]) {
        let (bs, hd) = (self.layout.block_size, self.layout.head_dim);
        let n_keys = self.n_keys();
        let body = if self.fits_wide(kernels) {
            Body::Avx512
        } else if self.fits_vector(kernels) {
            Body::Avx2
        } else {
            Body::Portable
        };
        out.fill(0.0);
        let mut rows_of_keys = Vec::new();
        let blocks = self.start / bs..=self.pos / bs;
        let read = self
            .layout
            .values_in_keys
            .map_or(bs * hd, |w| w.min(hd) * bs);
        // A block's lines over the value pass's steps (one a row and column chunk).
        let steps = bs * body.value_steps_per_row(out.len() / hd.max(1), hd);
        let mut trickle = Trickle::at_pace((read * std::mem::size_of::<T>()).div_ceil(64), steps);
        for bi in blocks.clone() {
            // The value rows (or the keys they are read from) `PREFETCH_BLOCKS` ahead.
            if let Some(&b) = self
                .table
                .get(bi + PREFETCH_BLOCKS)
                .filter(|_| bi + PREFETCH_BLOCKS <= *blocks.end())
            {
                let tile = self.layout.tile(b as usize, self.head);
                let pool = if self.layout.values_in_keys.is_some() {
                    self.k
                } else {
                    self.v
                };
                trickle.push(&pool[tile..tile + read]);
            }
            let first = self.start.max(bi * bs);
            let last = self.pos.min(bi * bs + bs - 1);
            let base = first - self.start;
            let (block, slots) = (self.table[bi] as usize, first % bs..last % bs + 1);
            if let Some(w) = self.layout.values_in_keys {
                let tile = self.layout.tile(block, self.head);
                rows_of_keys.resize(slots.len() * hd, 0.0);
                let k_tile = &self.k[tile..tile + bs * hd];
                kernels.keys_as_values(k_tile, bs, w, slots, &mut rows_of_keys);
                block_values(
                    body,
                    &rows_of_keys,
                    hd,
                    probs,
                    n_keys,
                    base,
                    out,
                    &mut trickle,
                );
            } else {
                let off = self.layout.offset(block, self.head, slots.start);
                let rows = &self.v[off..off + slots.len() * hd];
                block_values(body, rows, hd, probs, n_keys, base, out, &mut trickle);
            }
        }
    }
}

/// Which body a value pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// Plain loops.
    Portable,
    /// Vectors of 8 ([`DecodeHead::fits_vector`]).
    Avx2,
    /// Vectors of 16 ([`DecodeHead::fits_wide`]).
    Avx512,
}

impl Body {
    /// The value pass's steps a row takes (column chunks over every group of query
    /// heads), as the body walks them: `(heads, vectors)` at a time from the widest
    /// that fits what is left of the group, the last columns a vector at a time.
    fn value_steps_per_row(self, group: usize, hd: usize) -> usize {
        let (lanes, split): (usize, HeadSplit) = match self {
            Body::Portable => return 1,
            Body::Avx2 => (8, |left| match left {
                l if l >= 4 => (4, 2),
                l if l >= 2 => (2, 4),
                _ => (1, 8),
            }),
            Body::Avx512 => (16, avx512_value_split),
        };
        let (mut g, mut steps) = (0, 0);
        while g < group {
            let (gh, c) = split(group - g);
            steps += hd / (lanes * c) + (hd % (lanes * c)) / lanes;
            g += gh;
        }
        steps.max(1)
    }
}

/// How a value body splits the query heads left: `(heads, vectors)` a pass.
type HeadSplit = fn(usize) -> (usize, usize);

/// The AVX-512 value pass's `(heads, vectors of 16 columns)` for `left` query heads: 16
/// accumulators while the group allows, of the 32 registers.
fn avx512_value_split(left: usize) -> (usize, usize) {
    match left {
        l if l >= 8 => (8, 2),
        l if l >= 4 => (4, 4),
        l if l >= 2 => (2, 8),
        _ => (1, 8),
    }
}

/// One block's `out[g] += Σ_r probs[g * stride + base + r] * rows[r]` (fused, in row
/// order), with `body`'s vectors, which issue `trickle`'s lines as they go.
#[allow(clippy::too_many_arguments)]
fn block_values<T: KvElem>(
    body: Body,
    rows: &[T],
    hd: usize,
    probs: &[f32],
    stride: usize,
    base: usize,
    out: &mut [f32],
    trickle: &mut Trickle,
) {
    #[cfg(target_arch = "x86_64")]
    if body == Body::Avx512 {
        // SAFETY: `Avx512` says the AVX-512 set is present and `hd` is a multiple of 16;
        // `rows` holds whole rows of `hd`, `out` whole heads, and `probs` every index
        // read (`group x stride`, the caller's rows inside its keys).
        unsafe { avx512::values(rows, hd, probs, stride, base, out, trickle) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if body == Body::Avx2 {
        // SAFETY: `Avx2` says AVX2, FMA and F16C are present and `hd` is a multiple of
        // 8; `rows` holds whole rows of `hd`, `out` whole heads, and `probs` every index
        // read (`group x stride`, the caller's rows inside its keys).
        unsafe { avx2::values(rows, hd, probs, stride, base, out, trickle) };
        return;
    }
    let _ = (body, &trickle);
    let group = out.len() / hd.max(1);
    for g in 0..group {
        let o = &mut out[g * hd..(g + 1) * hd];
        for (r, row) in rows.chunks_exact(hd).enumerate() {
            let p = probs[g * stride + base + r];
            for (y, &x) in o.iter_mut().zip(row) {
                *y = p.mul_add(x.widen(), *y);
            }
        }
    }
}

impl Kernels {
    /// The value rows of `slots` of one K tile (`[head_dim][block_size]`, `bs` slots a
    /// row) whose values are its keys' first `w` components: `rows[(s - slots.start) *
    /// head_dim + c]` is key component `c` of slot `s` widened for `c < w`, zero past it
    /// (`head_dim = k_tile.len() / bs`, `rows` holds `slots.len()` rows of it). Exact (a
    /// copy), so the value pass over these rows gives the bits of a V pool holding them.
    /// 8 x 8 blocks are transposed in registers where AVX2 is present.
    pub(crate) fn keys_as_values<T: KvElem>(
        self,
        k_tile: &[T],
        bs: usize,
        w: usize,
        slots: std::ops::Range<usize>,
        rows: &mut [f32],
    ) {
        let hd = k_tile.len() / bs.max(1);
        let w = w.min(hd);
        let n = slots.len();
        debug_assert!(slots.end <= bs && rows.len() >= n * hd);
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if vector_bodies(self) && w.is_multiple_of(8) && slots.end <= bs && rows.len() >= n * hd {
            // SAFETY: AVX2, FMA and F16C are present; every 8 x 8 block reads dims
            // c..c + 8 <= w <= hd of slots s..s + 8 <= slots.end <= bs, inside the tile,
            // and writes rows below n, columns below w, inside `rows`.
            unsafe { avx2::transpose_keys(k_tile, bs, hd, w, slots.start, n, rows) };
            done = n / 8 * 8;
        }
        for (i, row) in rows.chunks_exact_mut(hd).take(n).enumerate() {
            if i >= done {
                for (c, x) in row[..w].iter_mut().enumerate() {
                    *x = k_tile[c * bs + slots.start + i].widen();
                }
            }
            row[w..].fill(0.0);
        }
    }
}

/// How many blocks ahead of the one being read the decode passes ask for the next
/// tiles' cache lines ([`prefetch`]).
const PREFETCH_BLOCKS: usize = 2;

/// Cache lines asked for a few at a time between pieces of work. A whole tile's lines
/// asked at once (64 of an f16 tile, 128 of an f32 one) fill the core's queue of
/// outstanding misses, and the arithmetic stalls behind them until they land; a few lines
/// a step arrive while the arithmetic runs. Hints only: a prefetch neither faults nor
/// changes a result, whatever the address.
#[derive(Debug, Default)]
pub(crate) struct Trickle {
    /// Ranges queued and not yet issued, oldest at `head`: (next line, bytes left).
    ranges: [(usize, usize); TRICKLE_RANGES],
    head: usize,
    len: usize,
    /// Lines a step issues: what is queued for a piece of work over the steps it takes,
    /// so the lines keep pace with the arithmetic (0 issues none).
    rate: usize,
}

/// Ranges a [`Trickle`] holds; a push past them issues the oldest whole.
const TRICKLE_RANGES: usize = 8;

impl Trickle {
    /// Queues `data`'s cache lines.
    fn push<T>(&mut self, data: &[T]) {
        if self.len == TRICKLE_RANGES {
            let lines = self.ranges[self.head].1.div_ceil(64);
            self.issue(lines);
        }
        let at = (self.head + self.len) % TRICKLE_RANGES;
        self.ranges[at] = (data.as_ptr() as usize, std::mem::size_of_val(data));
        self.len += 1;
    }

    /// A trickle that issues `lines_per_piece` lines over `steps_per_piece` steps.
    fn at_pace(lines_per_piece: usize, steps_per_piece: usize) -> Self {
        Trickle {
            rate: lines_per_piece.div_ceil(steps_per_piece.max(1)).max(1),
            ..Trickle::default()
        }
    }

    /// Issues this step's share of the queued lines, oldest first.
    #[inline(always)]
    fn step(&mut self) {
        self.issue(self.rate);
    }

    /// Issues up to `lines` queued lines, oldest first.
    #[inline(always)]
    fn issue(&mut self, mut lines: usize) {
        while lines > 0 && self.len > 0 {
            let range = &mut self.ranges[self.head];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: SSE is part of x86_64, and a prefetch reads nothing the program
            // sees and never faults, at any address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    range.0 as *const i8,
                )
            };
            range.0 += 64;
            range.1 = range.1.saturating_sub(64);
            lines -= 1;
            if range.1 == 0 {
                self.head = (self.head + 1) % TRICKLE_RANGES;
                self.len -= 1;
            }
        }
    }
}

/// Whether the AVX-512 bodies may run under `kernels` (the AVX-512 set, which this CPU
/// has; every AVX-512 CPU has F16C).
fn wide_bodies(kernels: Kernels) -> bool {
    cfg!(target_arch = "x86_64") && kernels.isa() == Isa::Avx512 && Isa::Avx512.is_supported()
}

/// Whether the AVX2 bodies may run under `kernels`.
fn vector_bodies(kernels: Kernels) -> bool {
    cfg!(target_arch = "x86_64") && kernels.isa() != Isa::Portable && Isa::Avx2.is_supported()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{KvElem, SlotVec, Trickle, PREFETCH_BLOCKS};
    use std::arch::x86_64::*;

    /// Accumulators of `G` query heads over `NV` slot vectors, summed over every
    /// dimension in order: `acc[i][j] = Σ_d q[i][d] * key_j[d]` (fused, sequential in d).
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; for every `j` and `d < hd`, `k + offs[j] + d * bs`
    /// has 8 readable elements; `q` has `G x hd` readable floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn score_chunk<T: KvElem, const NV: usize, const G: usize>(
        k: *const T,
        bs: usize,
        hd: usize,
        offs: [usize; NV],
        q: *const f32,
        trickle: &mut Trickle,
    ) -> [[__m256; NV]; G] {
        let mut acc = [[_mm256_setzero_ps(); NV]; G];
        for d in 0..hd {
            trickle.step();
            let mut kv = [_mm256_setzero_ps(); NV];
            for (x, &off) in kv.iter_mut().zip(&offs) {
                // SAFETY: in bounds by the function's contract.
                *x = unsafe { T::load8(k.add(off + d * bs)) };
            }
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: i < G, d < hd.
                let qb = _mm256_set1_ps(unsafe { *q.add(i * hd + d) });
                for (a, &x) in row.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qb, x, *a);
                }
            }
        }
        acc
    }

    /// Query heads `g0..g0 + G` over the slot vectors `vecs[c..c + NV]` (a short last
    /// chunk repeats its last vector; only real vectors are stored).
    ///
    /// # Safety
    /// As [`scores`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn heads_chunk<T: KvElem, const NV: usize, const G: usize>(
        k: &[T],
        bs: usize,
        hd: usize,
        vecs: &[SlotVec],
        q: &[f32],
        g0: usize,
        scale: f32,
        n_keys: usize,
        scores: &mut [f32],
        trickle: &mut Trickle,
    ) {
        let last = vecs.len() - 1;
        let offs: [usize; NV] = std::array::from_fn(|j| vecs[j.min(last)].off);
        // SAFETY: the caller's contract covers every tile row read and heads g0..g0+G.
        let acc = unsafe {
            score_chunk::<T, NV, G>(k.as_ptr(), bs, hd, offs, q.as_ptr().add(g0 * hd), trickle)
        };
        let scale_v = _mm256_set1_ps(scale);
        for (i, row) in acc.iter().enumerate() {
            for (j, v) in vecs.iter().enumerate().take(NV) {
                let s = _mm256_mul_ps(row[j], scale_v);
                let at = (g0 + i) * n_keys + v.key;
                if v.lo == 0 && v.hi == 8 {
                    // SAFETY: the 8 keys v.key..v.key+8 are attended keys of row g0+i.
                    unsafe { _mm256_storeu_ps(scores.as_mut_ptr().add(at), s) };
                } else {
                    let mut lanes = [0.0f32; 8];
                    // SAFETY: 8 floats into a local array.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
                    scores[at..at + v.hi - v.lo].copy_from_slice(&lanes[v.lo..v.hi]);
                }
            }
        }
    }

    /// Every slot vector in chunks of `NV`, each chunk taken by every query head (4, 2
    /// or 1 at a time) while it is in L1.
    ///
    /// # Safety
    /// As [`scores`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn by_chunks<T: KvElem, const NV: usize>(
        k: &[T],
        bs: usize,
        hd: usize,
        vecs: &[SlotVec],
        q: &[f32],
        group: usize,
        scale: f32,
        n_keys: usize,
        scores: &mut [f32],
    ) {
        // Each tile is asked for `PREFETCH_BLOCKS` blocks ahead of its first use, a few
        // lines a dimension ([`Trickle`]): a sequence's blocks lie anywhere in the pool,
        // where the hardware's prefetcher loses the stream at every block.
        let (tile_elems, ahead) = (bs * hd, PREFETCH_BLOCKS * bs / 8);
        let (mut fetched, mut last) = (0usize, usize::MAX);
        let mut calls = 0;
        let mut g = 0;
        while g < group {
            let left = group - g;
            g += if left >= 4 && NV <= 2 {
                4
            } else if left >= 2 && NV <= 4 {
                2
            } else {
                1
            };
            calls += 1;
        }
        // A chunk's lines over its score passes' dimensions.
        let chunk_lines = (NV * 8 * hd * std::mem::size_of::<T>()).div_ceil(64);
        let mut trickle = Trickle::at_pace(chunk_lines, hd * calls);
        for (c, chunk) in vecs.chunks(NV).enumerate() {
            while fetched < (c * NV + NV + ahead).min(vecs.len()) {
                let tile = vecs[fetched].off / tile_elems * tile_elems;
                if tile != last {
                    trickle.push(&k[tile..tile + tile_elems]);
                    last = tile;
                }
                fetched += 1;
            }
            let mut g0 = 0;
            while g0 < group {
                let left = group - g0;
                // SAFETY: heads g0..g0+G < group, the chunk's vectors are the caller's.
                unsafe {
                    if left >= 4 && NV <= 2 {
                        heads_chunk::<T, NV, 4>(
                            k,
                            bs,
                            hd,
                            chunk,
                            q,
                            g0,
                            scale,
                            n_keys,
                            scores,
                            &mut trickle,
                        );
                        g0 += 4;
                    } else if left >= 2 && NV <= 4 {
                        heads_chunk::<T, NV, 2>(
                            k,
                            bs,
                            hd,
                            chunk,
                            q,
                            g0,
                            scale,
                            n_keys,
                            scores,
                            &mut trickle,
                        );
                        g0 += 2;
                    } else {
                        heads_chunk::<T, NV, 1>(
                            k,
                            bs,
                            hd,
                            chunk,
                            q,
                            g0,
                            scale,
                            n_keys,
                            scores,
                            &mut trickle,
                        );
                        g0 += 1;
                    }
                }
            }
        }
    }

    /// The score pass (see `DecodeHead::scores`).
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; every vector's 8 slots of every dimension row lie in
    /// `k`; `q` holds `group x hd`; `scores` holds `group x n_keys` and every vector's
    /// lanes `lo..hi` map to keys below `n_keys`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores<T: KvElem>(
        k: &[T],
        bs: usize,
        hd: usize,
        vecs: &[SlotVec],
        q: &[f32],
        group: usize,
        scale: f32,
        n_keys: usize,
        scores: &mut [f32],
    ) {
        if vecs.is_empty() || group == 0 {
            return;
        }
        // Enough independent chains (vectors x heads, 8) to cover the FMA latency while
        // the 16 registers hold them.
        // SAFETY: the caller's contract.
        unsafe {
            match group {
                1 => by_chunks::<T, 8>(k, bs, hd, vecs, q, group, scale, n_keys, scores),
                2 => by_chunks::<T, 4>(k, bs, hd, vecs, q, group, scale, n_keys, scores),
                _ => by_chunks::<T, 2>(k, bs, hd, vecs, q, group, scale, n_keys, scores),
            }
        }
    }

    /// `rows[i * hd + c] = k[c * bs + s0 + i]` widened, for `c < w` and `i` below `n`
    /// rounded down to 8: 8 dims of 8 slots loaded, transposed in registers, stored.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; `w` a multiple of 8, `w <= hd`, `s0 + n <= bs`,
    /// `k` holds `hd x bs`, `rows` holds `n x hd`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn transpose_keys<T: KvElem>(
        k: &[T],
        bs: usize,
        hd: usize,
        w: usize,
        s0: usize,
        n: usize,
        rows: &mut [f32],
    ) {
        let (kp, rp) = (k.as_ptr(), rows.as_mut_ptr());
        for i0 in (0..n / 8 * 8).step_by(8) {
            for c0 in (0..w).step_by(8) {
                // SAFETY: dims c0..c0 + 8 <= w <= hd, slots s0 + i0 + 8 <= s0 + n <= bs.
                let r: [__m256; 8] =
                    std::array::from_fn(|j| unsafe { T::load8(kp.add((c0 + j) * bs + s0 + i0)) });
                let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                let t4 = _mm256_unpacklo_ps(r[4], r[5]);
                let t5 = _mm256_unpackhi_ps(r[4], r[5]);
                let t6 = _mm256_unpacklo_ps(r[6], r[7]);
                let t7 = _mm256_unpackhi_ps(r[6], r[7]);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                let cols = [
                    _mm256_permute2f128_ps::<0x20>(u0, u4),
                    _mm256_permute2f128_ps::<0x20>(u1, u5),
                    _mm256_permute2f128_ps::<0x20>(u2, u6),
                    _mm256_permute2f128_ps::<0x20>(u3, u7),
                    _mm256_permute2f128_ps::<0x31>(u0, u4),
                    _mm256_permute2f128_ps::<0x31>(u1, u5),
                    _mm256_permute2f128_ps::<0x31>(u2, u6),
                    _mm256_permute2f128_ps::<0x31>(u3, u7),
                ];
                for (i, col) in cols.iter().enumerate() {
                    // SAFETY: row i0 + i < n, columns c0..c0 + 8 <= hd.
                    unsafe { _mm256_storeu_ps(rp.add((i0 + i) * hd + c0), *col) };
                }
            }
        }
    }

    /// Columns `c0..c0 + 8 C` of query heads `g0..g0 + GH`: `out[g] = fma(p, row, out[g])`
    /// over the rows in order, each row's `C` vectors loaded (and widened) once for the
    /// `GH` heads.
    ///
    /// # Safety
    /// As [`values`], and `c0 + 8 C <= hd`, `g0 + GH <= group`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn value_heads<T: KvElem, const C: usize, const GH: usize>(
        rows: &[T],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
        c0: usize,
        g0: usize,
        trickle: &mut Trickle,
    ) {
        let n = rows.len() / hd;
        let (rp, pp) = (rows.as_ptr(), probs.as_ptr());
        // SAFETY: heads g0..g0 + GH, columns c0..c0 + 8C are inside `out`.
        let dst = unsafe { out.as_mut_ptr().add(g0 * hd + c0) };
        let mut acc: [[__m256; C]; GH] = std::array::from_fn(|i| {
            // SAFETY: as above.
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(dst.add(i * hd + c * 8)) })
        });
        for r in 0..n {
            trickle.step();
            // SAFETY: r < n rows of hd; columns c0 + 8c + 8 <= hd.
            let v: [__m256; C] =
                std::array::from_fn(|c| unsafe { T::load8(rp.add(r * hd + c0 + c * 8)) });
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: `probs` covers (g0 + i) * stride + base + r (the caller's rows).
                let pb = _mm256_set1_ps(unsafe { *pp.add((g0 + i) * stride + base + r) });
                for (x, &vc) in a.iter_mut().zip(&v) {
                    *x = _mm256_fmadd_ps(pb, vc, *x);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (c, x) in a.iter().enumerate() {
                // SAFETY: as for the loads of `out`.
                unsafe { _mm256_storeu_ps(dst.add(i * hd + c * 8), *x) };
            }
        }
    }

    /// Every column of query heads `g0..g0 + GH`, `C` vectors at a time, then the last
    /// vectors one at a time.
    ///
    /// # Safety
    /// As [`values`], and `g0 + GH <= group`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn heads_values<T: KvElem, const C: usize, const GH: usize>(
        rows: &[T],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
        g0: usize,
        trickle: &mut Trickle,
    ) {
        let mut c0 = 0;
        // SAFETY: every call's columns are inside hd (a multiple of 8), its heads the caller's.
        unsafe {
            while c0 + 8 * C <= hd {
                value_heads::<T, C, GH>(rows, hd, probs, stride, base, out, c0, g0, trickle);
                c0 += 8 * C;
            }
            while c0 + 8 <= hd {
                value_heads::<T, 1, GH>(rows, hd, probs, stride, base, out, c0, g0, trickle);
                c0 += 8;
            }
        }
    }

    /// The value pass of one block (see `DecodeHead::values`): query heads 4 at a time
    /// (then 2, then 1), each row's vectors loaded once for all of them while 8
    /// independent accumulator chains (heads x column vectors) cover the FMA latency; a
    /// GQA group of 8 widens each value twice rather than 8 times.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; `hd` a multiple of 8; `rows` whole rows of `hd`,
    /// `out` whole heads; `probs` covers `g * stride + base + r` for every head and row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn values<T: KvElem>(
        rows: &[T],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
        trickle: &mut Trickle,
    ) {
        let group = out.len() / hd;
        let mut g0 = 0;
        // SAFETY: heads g0..g0 + GH < group; the rest is the caller's contract.
        unsafe {
            while g0 < group {
                match group - g0 {
                    left if left >= 4 => {
                        heads_values::<T, 2, 4>(rows, hd, probs, stride, base, out, g0, trickle);
                        g0 += 4;
                    }
                    left if left >= 2 => {
                        heads_values::<T, 4, 2>(rows, hd, probs, stride, base, out, g0, trickle);
                        g0 += 2;
                    }
                    _ => {
                        heads_values::<T, 8, 1>(rows, hd, probs, stride, base, out, g0, trickle);
                        g0 += 1;
                    }
                }
            }
        }
    }
}

/// The decode passes in vectors of 16 lanes (16 key slots a score vector, 16 columns a
/// value vector): each K element is loaded and widened once for up to 8 query heads, whose
/// 16 accumulators the 32 registers hold. Lanes are keys (scores) or columns (values), so
/// every score and every output element is summed in the AVX2 bodies' order: the same
/// bits.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{avx512_value_split, KvElem, SlotVec, Trickle, PREFETCH_BLOCKS};
    use std::arch::x86_64::*;

    /// Accumulators of `G` query heads over `NV` slot vectors of 16, summed over every
    /// dimension in order: `acc[i][j] = Σ_d q[i][d] * key_j[d]` (fused, sequential in d).
    ///
    /// # Safety
    /// AVX-512F available; for every `j` and `d < hd`, `k + offs[j] + d * bs` has 16
    /// readable elements; `q` has `G x hd` readable floats.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn score_chunk<T: KvElem, const NV: usize, const G: usize>(
        k: *const T,
        bs: usize,
        hd: usize,
        offs: [usize; NV],
        q: *const f32,
        trickle: &mut Trickle,
    ) -> [[__m512; NV]; G] {
        let mut acc = [[_mm512_setzero_ps(); NV]; G];
        for d in 0..hd {
            trickle.step();
            let mut kv = [_mm512_setzero_ps(); NV];
            for (x, &off) in kv.iter_mut().zip(&offs) {
                // SAFETY: in bounds by the function's contract.
                *x = unsafe { T::load16(k.add(off + d * bs)) };
            }
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: i < G, d < hd.
                let qb = _mm512_set1_ps(unsafe { *q.add(i * hd + d) });
                for (a, &x) in row.iter_mut().zip(&kv) {
                    *a = _mm512_fmadd_ps(qb, x, *a);
                }
            }
        }
        acc
    }

    /// Query heads `g0..g0 + G` over the slot vectors `vecs[..NV]` (a short last chunk
    /// repeats its last vector; only real vectors are stored).
    ///
    /// # Safety
    /// As [`scores`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn heads_chunk<T: KvElem, const NV: usize, const G: usize>(
        k: &[T],
        bs: usize,
        hd: usize,
        vecs: &[SlotVec],
        q: &[f32],
        g0: usize,
        scale: f32,
        n_keys: usize,
        scores: &mut [f32],
        trickle: &mut Trickle,
    ) {
        let last = vecs.len() - 1;
        let offs: [usize; NV] = std::array::from_fn(|j| vecs[j.min(last)].off);
        // SAFETY: the caller's contract covers every tile row read and heads g0..g0+G.
        let acc = unsafe {
            score_chunk::<T, NV, G>(k.as_ptr(), bs, hd, offs, q.as_ptr().add(g0 * hd), trickle)
        };
        let scale_v = _mm512_set1_ps(scale);
        for (i, row) in acc.iter().enumerate() {
            for (j, v) in vecs.iter().enumerate().take(NV) {
                let s = _mm512_mul_ps(row[j], scale_v);
                let at = (g0 + i) * n_keys + v.key;
                if v.lo == 0 && v.hi == 16 {
                    // SAFETY: the 16 keys v.key..v.key+16 are attended keys of row g0+i.
                    unsafe { _mm512_storeu_ps(scores.as_mut_ptr().add(at), s) };
                } else {
                    let mut lanes = [0.0f32; 16];
                    // SAFETY: 16 floats into a local array.
                    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
                    scores[at..at + v.hi - v.lo].copy_from_slice(&lanes[v.lo..v.hi]);
                }
            }
        }
    }

    /// The `(heads, slot vectors)` a score chunk takes for `left` query heads: 16
    /// accumulators where the group allows.
    fn score_split(left: usize) -> (usize, usize) {
        match left {
            l if l >= 8 => (8, 2),
            l if l >= 4 => (4, 4),
            l if l >= 2 => (2, 8),
            _ => (1, 8),
        }
    }

    /// Every slot vector in chunks of `NV`, each chunk taken by every query head (`G` at
    /// a time, as [`score_split`] says) while it is in L1.
    ///
    /// # Safety
    /// As [`scores`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn by_chunks<T: KvElem, const NV: usize>(
        k: &[T],
        bs: usize,
        hd: usize,
        vecs: &[SlotVec],
        q: &[f32],
        group: usize,
        scale: f32,
        n_keys: usize,
        scores: &mut [f32],
    ) {
        let (tile_elems, ahead) = (bs * hd, PREFETCH_BLOCKS * bs / 16);
        let (mut fetched, mut last) = (0usize, usize::MAX);
        let (mut calls, mut g) = (0, 0);
        while g < group {
            g += score_split(group - g).0.min(group - g);
            calls += 1;
        }
        let chunk_lines = (NV * 16 * hd * std::mem::size_of::<T>()).div_ceil(64);
        let mut trickle = Trickle::at_pace(chunk_lines, hd * calls);
        for (c, chunk) in vecs.chunks(NV).enumerate() {
            while fetched < (c * NV + NV + ahead).min(vecs.len()) {
                let tile = vecs[fetched].off / tile_elems * tile_elems;
                if tile != last {
                    trickle.push(&k[tile..tile + tile_elems]);
                    last = tile;
                }
                fetched += 1;
            }
            let mut g0 = 0;
            while g0 < group {
                let args = (k, bs, hd, chunk, q, g0, scale, n_keys);
                // SAFETY: heads g0..g0+G <= group, the chunk's vectors are the caller's.
                unsafe {
                    g0 += match score_split(group - g0).0 {
                        8 => {
                            heads_chunk::<T, NV, 8>(
                                args.0,
                                args.1,
                                args.2,
                                args.3,
                                args.4,
                                args.5,
                                args.6,
                                args.7,
                                scores,
                                &mut trickle,
                            );
                            8
                        }
                        4 => {
                            heads_chunk::<T, NV, 4>(
                                args.0,
                                args.1,
                                args.2,
                                args.3,
                                args.4,
                                args.5,
                                args.6,
                                args.7,
                                scores,
                                &mut trickle,
                            );
                            4
                        }
                        2 => {
                            heads_chunk::<T, NV, 2>(
                                args.0,
                                args.1,
                                args.2,
                                args.3,
                                args.4,
                                args.5,
                                args.6,
                                args.7,
                                scores,
                                &mut trickle,
                            );
                            2
                        }
                        _ => {
                            heads_chunk::<T, NV, 1>(
                                args.0,
                                args.1,
                                args.2,
                                args.3,
                                args.4,
                                args.5,
                                args.6,
                                args.7,
                                scores,
                                &mut trickle,
                            );
                            1
                        }
                    };
                }
            }
        }
    }

    /// The score pass in vectors of 16 (see `DecodeHead::scores`).
    ///
    /// # Safety
    /// The AVX-512 set available; every vector's 16 slots of every dimension row lie in
    /// `k`; `q` holds `group x hd`; `scores` holds `group x n_keys` and every vector's
    /// lanes `lo..hi` map to keys below `n_keys`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn scores<T: KvElem>(
        k: &[T],
        bs: usize,
        hd: usize,
        vecs: &[SlotVec],
        q: &[f32],
        group: usize,
        scale: f32,
        n_keys: usize,
        scores: &mut [f32],
    ) {
        if vecs.is_empty() || group == 0 {
            return;
        }
        // SAFETY: the caller's contract.
        unsafe {
            match score_split(group).1 {
                2 => by_chunks::<T, 2>(k, bs, hd, vecs, q, group, scale, n_keys, scores),
                4 => by_chunks::<T, 4>(k, bs, hd, vecs, q, group, scale, n_keys, scores),
                _ => by_chunks::<T, 8>(k, bs, hd, vecs, q, group, scale, n_keys, scores),
            }
        }
    }

    /// Columns `c0..c0 + 16 C` of query heads `g0..g0 + GH`: `out[g] = fma(p, row,
    /// out[g])` over the rows in order, each row's `C` vectors loaded (and widened) once
    /// for the `GH` heads.
    ///
    /// # Safety
    /// As [`values`], and `c0 + 16 C <= hd`, `g0 + GH <= group`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn value_heads<T: KvElem, const C: usize, const GH: usize>(
        rows: &[T],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
        c0: usize,
        g0: usize,
        trickle: &mut Trickle,
    ) {
        let n = rows.len() / hd;
        let (rp, pp) = (rows.as_ptr(), probs.as_ptr());
        // SAFETY: heads g0..g0 + GH, columns c0..c0 + 16C are inside `out`.
        let dst = unsafe { out.as_mut_ptr().add(g0 * hd + c0) };
        let mut acc: [[__m512; C]; GH] = std::array::from_fn(|i| {
            // SAFETY: as above.
            std::array::from_fn(|c| unsafe { _mm512_loadu_ps(dst.add(i * hd + c * 16)) })
        });
        for r in 0..n {
            trickle.step();
            // SAFETY: r < n rows of hd; columns c0 + 16c + 16 <= hd.
            let v: [__m512; C] =
                std::array::from_fn(|c| unsafe { T::load16(rp.add(r * hd + c0 + c * 16)) });
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: `probs` covers (g0 + i) * stride + base + r (the caller's rows).
                let pb = _mm512_set1_ps(unsafe { *pp.add((g0 + i) * stride + base + r) });
                for (x, &vc) in a.iter_mut().zip(&v) {
                    *x = _mm512_fmadd_ps(pb, vc, *x);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            for (c, x) in a.iter().enumerate() {
                // SAFETY: as for the loads of `out`.
                unsafe { _mm512_storeu_ps(dst.add(i * hd + c * 16), *x) };
            }
        }
    }

    /// Every column of query heads `g0..g0 + GH`, `C` vectors at a time, then the last
    /// vectors one at a time.
    ///
    /// # Safety
    /// As [`values`], and `g0 + GH <= group`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn heads_values<T: KvElem, const C: usize, const GH: usize>(
        rows: &[T],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
        g0: usize,
        trickle: &mut Trickle,
    ) {
        let mut c0 = 0;
        // SAFETY: every call's columns are inside hd (a multiple of 16), its heads the
        // caller's.
        unsafe {
            while c0 + 16 * C <= hd {
                value_heads::<T, C, GH>(rows, hd, probs, stride, base, out, c0, g0, trickle);
                c0 += 16 * C;
            }
            while c0 + 16 <= hd {
                value_heads::<T, 1, GH>(rows, hd, probs, stride, base, out, c0, g0, trickle);
                c0 += 16;
            }
        }
    }

    /// The value pass of one block in vectors of 16 (see `DecodeHead::values`).
    ///
    /// # Safety
    /// The AVX-512 set available; `hd` a multiple of 16; `rows` whole rows of `hd`, `out`
    /// whole heads; `probs` covers `g * stride + base + r` for every head and row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn values<T: KvElem>(
        rows: &[T],
        hd: usize,
        probs: &[f32],
        stride: usize,
        base: usize,
        out: &mut [f32],
        trickle: &mut Trickle,
    ) {
        let group = out.len() / hd;
        let mut g0 = 0;
        // SAFETY: heads g0..g0 + GH <= group; the rest is the caller's contract.
        unsafe {
            while g0 < group {
                let (gh, _) = avx512_value_split(group - g0);
                match gh {
                    8 => heads_values::<T, 2, 8>(rows, hd, probs, stride, base, out, g0, trickle),
                    4 => heads_values::<T, 4, 4>(rows, hd, probs, stride, base, out, g0, trickle),
                    2 => heads_values::<T, 8, 2>(rows, hd, probs, stride, base, out, g0, trickle),
                    _ => heads_values::<T, 8, 1>(rows, hd, probs, stride, base, out, g0, trickle),
                }
                g0 += gh;
            }
        }
    }
}
