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

/// One score pass's operands (see [`DecodeHead::scores`]): the K pool and its tiles'
/// shape, the attended slot vectors, the group's query rows and the score rows' length.
#[derive(Clone, Copy)]
struct ScoreArgs<'a, T> {
    k: &'a [T],
    bs: usize,
    hd: usize,
    vecs: &'a [SlotVec],
    q: &'a [f32],
    group: usize,
    scale: f32,
    n_keys: usize,
}

/// One block's value-pass operands (see [`block_values`]): its value rows, their width,
/// and where row `r`'s probability of query head `g` lies (`probs[g * stride + base + r]`).
#[derive(Clone, Copy)]
struct ValueArgs<'a, T> {
    rows: &'a [T],
    hd: usize,
    probs: &'a [f32],
    stride: usize,
    base: usize,
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

    /// The score pass's operands over `vecs`.
    fn score_args<'s>(
        &'s self,
        bs: usize,
        hd: usize,
        vecs: &'s [SlotVec],
        q: &'s [f32],
        scale: f32,
    ) -> ScoreArgs<'s, T> {
        ScoreArgs {
            k: self.k,
            bs,
            hd,
            vecs,
            q,
            group: q.len() / hd.max(1),
            scale,
            n_keys: self.n_keys(),
        }
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
            unsafe { avx512::scores(&self.score_args(bs, hd, &vecs, q, scale), scores) };
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
            unsafe { avx2::scores(&self.score_args(bs, hd, &vecs, q, scale), scores) };
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
            Body::Avx2 => (8, avx2_split),
            Body::Avx512 => (16, avx512_split),
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

/// How a body splits the query heads left: `(heads, vectors)` a pass.
type HeadSplit = fn(usize) -> (usize, usize);

/// The AVX2 bodies' `(heads, vectors of 8)` for `left` query heads (score and value
/// passes alike): 8 accumulators, of the 16 registers.
fn avx2_split(left: usize) -> (usize, usize) {
    match left {
        l if l >= 4 => (4, 2),
        l if l >= 2 => (2, 4),
        _ => (1, 8),
    }
}

/// The AVX-512 bodies' `(heads, vectors of 16)` for `left` query heads (score and value
/// passes alike): 16 accumulators while the group allows, of the 32 registers.
fn avx512_split(left: usize) -> (usize, usize) {
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
    let args = ValueArgs {
        rows,
        hd,
        probs,
        stride,
        base,
    };
    #[cfg(target_arch = "x86_64")]
    if body == Body::Avx512 {
        // SAFETY: `Avx512` says the AVX-512 set is present and `hd` is a multiple of 16;
        // `rows` holds whole rows of `hd`, `out` whole heads, and `probs` every index
        // read (`group x stride`, the caller's rows inside its keys).
        unsafe { avx512::values(&args, out, trickle) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if body == Body::Avx2 {
        // SAFETY: `Avx2` says AVX2, FMA and F16C are present and `hd` is a multiple of
        // 8; `rows` holds whole rows of `hd`, `out` whole heads, and `probs` every index
        // read (`group x stride`, the caller's rows inside its keys).
        unsafe { avx2::values(&args, out, trickle) };
        return;
    }
    let _ = (body, &trickle, &args);
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

/// The score and value passes for one vector width: `$lanes` f32 lanes a vector of type
/// `$v` (lanes are key slots in the score pass, columns in the value pass), under target
/// features `$feat`, with `$split` choosing `(heads, vectors)` a pass. Written once for
/// both widths so the two bodies cannot drift apart: every sum runs in the same order, so
/// both give the same bits.
#[cfg(target_arch = "x86_64")]
macro_rules! decode_bodies {
    (
        features: $feat:literal,
        lanes: $lanes:literal,
        vector: $v:ty,
        load: $load:ident,
        zero: $zero:ident,
        set1: $set1:ident,
        fmadd: $fmadd:ident,
        mul: $mul:ident,
        loadu: $loadu:ident,
        storeu: $storeu:ident,
        split: $split:path $(,)?
    ) => {
        /// Accumulators of `G` query heads over `NV` slot vectors, summed over every
        /// dimension in order: `acc[i][j] = Σ_d q[i][d] * key_j[d]` (fused, sequential
        /// in d).
        ///
        /// # Safety
        /// The features available; for every `j` and `d < hd`, `k + offs[j] + d * bs`
        /// has a vector of readable elements; `q` has `G x hd` readable floats.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn score_chunk<T: KvElem, const NV: usize, const G: usize>(
            k: *const T,
            bs: usize,
            hd: usize,
            offs: [usize; NV],
            q: *const f32,
            trickle: &mut Trickle,
        ) -> [[$v; NV]; G] {
            let mut acc = [[$zero(); NV]; G];
            for d in 0..hd {
                trickle.step();
                let mut kv = [$zero(); NV];
                for (x, &off) in kv.iter_mut().zip(&offs) {
                    // SAFETY: in bounds by the function's contract.
                    *x = unsafe { T::$load(k.add(off + d * bs)) };
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    // SAFETY: i < G, d < hd.
                    let qb = $set1(unsafe { *q.add(i * hd + d) });
                    for (a, &x) in row.iter_mut().zip(&kv) {
                        *a = $fmadd(qb, x, *a);
                    }
                }
            }
            acc
        }

        /// Query heads `g0..g0 + G` over the slot vectors `vecs[..NV]` (a short last
        /// chunk repeats its last vector; only real vectors are stored).
        ///
        /// # Safety
        /// As [`scores`].
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $feat)]
        unsafe fn heads_chunk<T: KvElem, const NV: usize, const G: usize>(
            a: &ScoreArgs<'_, T>,
            vecs: &[SlotVec],
            g0: usize,
            scores: &mut [f32],
            trickle: &mut Trickle,
        ) {
            let (k, bs, hd, q, scale, n_keys) = (a.k, a.bs, a.hd, a.q, a.scale, a.n_keys);
            let last = vecs.len() - 1;
            let offs: [usize; NV] = std::array::from_fn(|j| vecs[j.min(last)].off);
            // SAFETY: the caller's contract covers every tile row read and heads
            // g0..g0+G.
            let acc = unsafe {
                score_chunk::<T, NV, G>(k.as_ptr(), bs, hd, offs, q.as_ptr().add(g0 * hd), trickle)
            };
            let scale_v = $set1(scale);
            for (i, row) in acc.iter().enumerate() {
                for (j, v) in vecs.iter().enumerate().take(NV) {
                    let s = $mul(row[j], scale_v);
                    let at = (g0 + i) * n_keys + v.key;
                    if v.lo == 0 && v.hi == $lanes {
                        // SAFETY: the keys v.key..v.key + lanes are attended keys of row
                        // g0 + i.
                        unsafe { $storeu(scores.as_mut_ptr().add(at), s) };
                    } else {
                        let mut lanes = [0.0f32; $lanes];
                        // SAFETY: a vector of floats into a local array of its size.
                        unsafe { $storeu(lanes.as_mut_ptr(), s) };
                        scores[at..at + v.hi - v.lo].copy_from_slice(&lanes[v.lo..v.hi]);
                    }
                }
            }
        }

        /// Every slot vector in chunks of `NV`, each chunk taken by every query head
        /// (`$split`'s heads at a time) while it is in L1. Each tile is asked for
        /// `PREFETCH_BLOCKS` blocks ahead of its first use, a few lines a dimension
        /// ([`Trickle`]): a sequence's blocks lie anywhere in the pool, where the
        /// hardware's prefetcher loses the stream at every block.
        ///
        /// # Safety
        /// As [`scores`].
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $feat)]
        unsafe fn by_chunks<T: KvElem, const NV: usize>(a: &ScoreArgs<'_, T>, scores: &mut [f32]) {
            let (k, bs, hd, vecs, group) = (a.k, a.bs, a.hd, a.vecs, a.group);
            let (tile_elems, ahead) = (bs * hd, PREFETCH_BLOCKS * bs / $lanes);
            let (mut fetched, mut last) = (0usize, usize::MAX);
            let (mut calls, mut g) = (0, 0);
            while g < group {
                g += $split(group - g).0;
                calls += 1;
            }
            // A chunk's lines over its score passes' dimensions.
            let chunk_lines = (NV * $lanes * hd * std::mem::size_of::<T>()).div_ceil(64);
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
                    let t = &mut trickle;
                    // SAFETY: heads g0..g0 + G <= group, the chunk's vectors are the
                    // caller's.
                    g0 += unsafe {
                        match $split(group - g0).0 {
                            8 => {
                                heads_chunk::<T, NV, 8>(a, chunk, g0, scores, t);
                                8
                            }
                            4 => {
                                heads_chunk::<T, NV, 4>(a, chunk, g0, scores, t);
                                4
                            }
                            2 => {
                                heads_chunk::<T, NV, 2>(a, chunk, g0, scores, t);
                                2
                            }
                            _ => {
                                heads_chunk::<T, NV, 1>(a, chunk, g0, scores, t);
                                1
                            }
                        }
                    };
                }
            }
        }

        /// The score pass (see `DecodeHead::scores`).
        ///
        /// # Safety
        /// The features available; every vector's slots of every dimension row lie in
        /// `k`; `q` holds `group x hd`; `scores` holds `group x n_keys` and every
        /// vector's lanes `lo..hi` map to keys below `n_keys`.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn scores<T: KvElem>(a: &ScoreArgs<'_, T>, scores: &mut [f32]) {
            if a.vecs.is_empty() || a.group == 0 {
                return;
            }
            // SAFETY: the caller's contract.
            unsafe {
                match $split(a.group).1 {
                    2 => by_chunks::<T, 2>(a, scores),
                    4 => by_chunks::<T, 4>(a, scores),
                    _ => by_chunks::<T, 8>(a, scores),
                }
            }
        }

        /// Columns `c0..c0 + C` vectors of query heads `g0..g0 + GH`: `out[g] = fma(p,
        /// row, out[g])` over the rows in order, each row's `C` vectors loaded (and
        /// widened) once for the `GH` heads.
        ///
        /// # Safety
        /// As [`values`], and `c0 + C lanes <= hd`, `g0 + GH <= group`.
        #[allow(clippy::too_many_arguments)]
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn value_heads<T: KvElem, const C: usize, const GH: usize>(
            a: &ValueArgs<'_, T>,
            out: &mut [f32],
            c0: usize,
            g0: usize,
            trickle: &mut Trickle,
        ) {
            let (rows, hd, probs, stride, base) = (a.rows, a.hd, a.probs, a.stride, a.base);
            let n = rows.len() / hd;
            let (rp, pp) = (rows.as_ptr(), probs.as_ptr());
            // SAFETY: heads g0..g0 + GH, columns c0..c0 + C lanes are inside `out`.
            let dst = unsafe { out.as_mut_ptr().add(g0 * hd + c0) };
            let mut acc: [[$v; C]; GH] = std::array::from_fn(|i| {
                // SAFETY: as above.
                std::array::from_fn(|c| unsafe { $loadu(dst.add(i * hd + c * $lanes)) })
            });
            for r in 0..n {
                trickle.step();
                // SAFETY: r < n rows of hd; columns c0 + (c + 1) lanes <= hd.
                let v: [$v; C] =
                    std::array::from_fn(|c| unsafe { T::$load(rp.add(r * hd + c0 + c * $lanes)) });
                for (i, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `probs` covers (g0 + i) * stride + base + r (the caller's
                    // rows).
                    let pb = $set1(unsafe { *pp.add((g0 + i) * stride + base + r) });
                    for (x, &vc) in a.iter_mut().zip(&v) {
                        *x = $fmadd(pb, vc, *x);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                for (c, x) in a.iter().enumerate() {
                    // SAFETY: as for the loads of `out`.
                    unsafe { $storeu(dst.add(i * hd + c * $lanes), *x) };
                }
            }
        }

        /// Every column of query heads `g0..g0 + GH`, `C` vectors at a time, then the
        /// last vectors one at a time.
        ///
        /// # Safety
        /// As [`values`], and `g0 + GH <= group`.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $feat)]
        unsafe fn heads_values<T: KvElem, const C: usize, const GH: usize>(
            a: &ValueArgs<'_, T>,
            out: &mut [f32],
            g0: usize,
            trickle: &mut Trickle,
        ) {
            let (hd, mut c0) = (a.hd, 0);
            // SAFETY: every call's columns are inside hd (a multiple of the lanes), its
            // heads the caller's.
            unsafe {
                while c0 + $lanes * C <= hd {
                    value_heads::<T, C, GH>(a, out, c0, g0, trickle);
                    c0 += $lanes * C;
                }
                while c0 + $lanes <= hd {
                    value_heads::<T, 1, GH>(a, out, c0, g0, trickle);
                    c0 += $lanes;
                }
            }
        }

        /// The value pass of one block (see `DecodeHead::values`): `$split`'s heads at a
        /// time, each row's vectors loaded once for all of them while the accumulators
        /// (heads x column vectors) cover the FMA latency.
        ///
        /// # Safety
        /// The features available; `hd` a multiple of the lanes; `rows` whole rows of
        /// `hd`, `out` whole heads; `probs` covers `g * stride + base + r` for every head
        /// and row.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn values<T: KvElem>(
            a: &ValueArgs<'_, T>,
            out: &mut [f32],
            trickle: &mut Trickle,
        ) {
            let group = out.len() / a.hd;
            let mut g0 = 0;
            // SAFETY: heads g0..g0 + GH <= group; the rest is the caller's contract.
            unsafe {
                while g0 < group {
                    g0 += match $split(group - g0) {
                        (8, 2) => {
                            heads_values::<T, 2, 8>(a, out, g0, trickle);
                            8
                        }
                        (4, 2) => {
                            heads_values::<T, 2, 4>(a, out, g0, trickle);
                            4
                        }
                        (4, 4) => {
                            heads_values::<T, 4, 4>(a, out, g0, trickle);
                            4
                        }
                        (2, 4) => {
                            heads_values::<T, 4, 2>(a, out, g0, trickle);
                            2
                        }
                        (2, 8) => {
                            heads_values::<T, 8, 2>(a, out, g0, trickle);
                            2
                        }
                        _ => {
                            heads_values::<T, 8, 1>(a, out, g0, trickle);
                            1
                        }
                    };
                }
            }
        }
    };
}

/// The AVX2 bodies: vectors of 8 (and the transposition of MLA's keys into value rows).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{avx2_split, KvElem, ScoreArgs, SlotVec, Trickle, ValueArgs, PREFETCH_BLOCKS};
    use std::arch::x86_64::*;

    decode_bodies! {
        features: "avx2,fma,f16c",
        lanes: 8,
        vector: __m256,
        load: load8,
        zero: _mm256_setzero_ps,
        set1: _mm256_set1_ps,
        fmadd: _mm256_fmadd_ps,
        mul: _mm256_mul_ps,
        loadu: _mm256_loadu_ps,
        storeu: _mm256_storeu_ps,
        split: avx2_split,
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
}

/// The AVX-512 bodies: vectors of 16, so at GQA group 8 a K element is loaded and widened
/// once for all 8 query heads, whose 16 accumulators the 32 registers hold.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{avx512_split, KvElem, ScoreArgs, SlotVec, Trickle, ValueArgs, PREFETCH_BLOCKS};
    use std::arch::x86_64::*;

    decode_bodies! {
        features: "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        lanes: 16,
        vector: __m512,
        load: load16,
        zero: _mm512_setzero_ps,
        set1: _mm512_set1_ps,
        fmadd: _mm512_fmadd_ps,
        mul: _mm512_mul_ps,
        loadu: _mm512_loadu_ps,
        storeu: _mm512_storeu_ps,
        split: avx512_split,
    }
}
