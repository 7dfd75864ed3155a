//! The CUDA backend's attention op: a micro-batch's rows appended to the paged KV cache,
//! then attended over it, in the CPU backend's cache layout so either backend reads what
//! the other wrote.
//!
//! Takes an `attn` task (its `qkv` rows, its `kv` cache slice or none, its `out` rows) and
//! the micro-batch's sequences; gives the attention output rows. Rows are launched in runs
//! of adjacent sequences: a run whose sequences each bring one token takes the split-KV
//! decode kernel (`paged_decode_attention`, which appends the run's K/V itself, then
//! `paged_decode_combine` past one split: a sequence per launch row, its block table by
//! sequence), any other the row kernels (`paged_kv_append_rows` or, for decode rows
//! appended without being attended, `paged_kv_append`; `paged_prefill_attention`: a table
//! and a sequence per row); DeepSeek's MLA attends with its own kernel
//! (`super::deepseek`). A prefill over whole prompts without a `kv`
//! argument attends over a scratch cache holding only this call's K/V. Guarantees: a
//! block table that does not cover its tokens, or names a block past the cache, is an
//! error before any launch.

use super::deepseek;
use super::launch::{int, Arg, LaunchError, Scratch, StreamCx};
use super::ops::{GpuCx, OpError};
use super::step_inputs::{flat_block_tables, StepInput};
use crate::ir::catalog::OpKind;
use crate::ir::{AttnPart, Op, Role};
use crate::lower::PlanTask;
use crate::model::vocab::AttnShape;
use crate::runtime::host::memory::View;
use crate::runtime::ops::{OpCx, TaskArgs};
use crate::runtime::step::MicroBatchState;

/// Per-row sequence and position, block tables padded to `max_blocks`, for the rows of a
/// micro-batch (row order = the micro-batch's token order).
struct RowTables {
    row_seq: Vec<u32>,
    row_pos: Vec<i32>,
    tables: Vec<u32>,
    max_blocks: usize,
}

fn row_tables(mb: &MicroBatchState, tables: &[Vec<u32>]) -> RowTables {
    let (flat, max_blocks) = flat_block_tables(tables.iter().map(Vec::as_slice));
    let (mut row_seq, mut row_pos) = (Vec::new(), Vec::new());
    for (s, seq) in mb.seqs.iter().enumerate() {
        for j in 0..seq.new_tokens.len() {
            row_seq.push(s as u32);
            row_pos.push((seq.context_len + j) as i32);
        }
    }
    RowTables {
        row_seq,
        row_pos,
        tables: flat,
        max_blocks,
    }
}

/// Row ranges of the sequences `pick` selects, merged where adjacent.
fn runs(mb: &MicroBatchState, pick: impl Fn(usize) -> bool) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut row = 0;
    for (s, seq) in mb.seqs.iter().enumerate() {
        let r = row..row + seq.new_tokens.len();
        row = r.end;
        if !pick(s) || r.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// The layer's KV cache for one call: the pools' device addresses, the block size, each
/// sequence's block table, the row runs to append, and the scratch holding a cache of this
/// call's own K/V (none when the task's `kv` slice is the cache).
struct KvPools {
    k: u64,
    v: u64,
    block: usize,
    tables: Vec<Vec<u32>>,
    append: Vec<std::ops::Range<usize>>,
    _scratch: Option<Scratch>,
}

/// `attn`: append every new row's K/V, then attend the rows its part selects.
pub(super) fn attn_op(cx: &GpuCx<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Attn { layer, ub, part } = task.op else {
        return Err(cx.wrong_op(OpKind::Attn, task));
    };
    let mb = cx.ub(ub)?;
    let n = mb.n_tokens();
    // The layer's geometry: gpt-oss slides its window on even layers only.
    let shape = cx.arch.attn_of(layer as usize);
    let (qw, ow) = (shape.qkv_width(), shape.q_width());
    let qkv = cx.ptr(args.need(Role::Qkv)?, "qkv", n * qw * 4)?;
    let out = cx.ptr(args.need(Role::Out)?, "out", n * ow * 4)?;
    let wanted = |s: usize| {
        mb.seqs.get(s).is_some_and(|seq| match part {
            AttnPart::All => true,
            AttnPart::Prefill => seq.prefill,
            AttnPart::Decode => !seq.prefill,
        })
    };
    let pools = match args.get(Role::Kv) {
        Some(kv) => task_cache(cx, mb, kv, &shape)?,
        None => scratch_cache(cx, mb, &shape, wanted)?,
    };
    let attend = runs(mb, wanted);
    if attend.is_empty() && pools.append.is_empty() {
        return Ok(());
    }
    let calls = Calls::new(cx, (ub, mb), &pools, &shape, qkv)?;
    // Decode runs append their own rows inside the attention kernel: only the other rows
    // take the append kernels, all before any attention (prefill rows attend each other).
    let fused: Vec<_> = attend
        .iter()
        .filter(|r| calls.decode_kernel(r))
        .cloned()
        .collect();
    for r in &pools.append {
        for rest in without(r, &fused) {
            calls.append(&rest)?;
        }
    }
    for r in &attend {
        calls.attend(r, out)?;
    }
    Ok(())
}

/// The parts of row range `r` outside every range of `taken`, in order.
fn without(
    r: &std::ops::Range<usize>,
    taken: &[std::ops::Range<usize>],
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut at = r.start;
    let mut cuts: Vec<_> = taken
        .iter()
        .filter(|t| t.start < r.end && t.end > r.start)
        .collect();
    cuts.sort_by_key(|t| t.start);
    for t in cuts {
        if t.start > at {
            out.push(at..t.start);
        }
        at = at.max(t.end);
    }
    if at < r.end {
        out.push(at..r.end);
    }
    out
}

/// Keys up to which `paged_decode_attention` runs one split (one block per sequence and kv
/// head, no combine launch): a block streams its keys in chunks, the next chunk's loads in
/// flight while it computes the current one, so a few chunks cost little more than one,
/// while a split adds the `paged_decode_combine` node.
const DECODE_ONE_SPLIT_KEYS: usize = 512;
/// Fewest keys of a split past [`DECODE_ONE_SPLIT_KEYS`].
const DECODE_SPLIT_MIN_KEYS: usize = 256;
/// Blocks per SM a split launch aims for (several resident blocks hide each other's
/// latency).
const DECODE_BLOCKS_PER_SM: usize = 2;
/// Threads of a `paged_decode_attention` block (`MOEC_DECODE_THREADS`).
const DECODE_THREADS: u32 = 256;
/// `MOEC_DECODE_MAX_GROUP` and the widest head of kernels/decode_attention.cu.
const DECODE_MAX_GROUP: usize = 8;
const DECODE_MAX_HEAD_DIM: usize = 256;

/// Keys a `paged_decode_attention` block stages at a time (kernels/decode_attention.cu's
/// `moec_decode_chunk`): 4096 floats of K (and as many of V) over the head's dims (2048
/// past 128 dims), at most 128, a multiple of 4.
fn decode_chunk(head_dim: usize) -> usize {
    let budget = if head_dim > 128 { 2048 } else { 4096 };
    (budget / head_dim.max(1)).min(128) & !3
}

/// Dynamic shared memory of a `paged_decode_attention` block serving `g` query heads of
/// `head_dim` (kernels/decode_attention.cu's header): the chunk's K and V, the queries,
/// probabilities and outputs of the heads, and three floats a head.
pub(super) fn decode_shared_bytes(g: usize, head_dim: usize) -> usize {
    let chunk = decode_chunk(head_dim);
    (2 * chunk * head_dim + 2 * g * head_dim + g * chunk + 3 * g) * 4
}

/// The device's SM count (read once): split launches are sized to fill them.
fn sm_count(s: &StreamCx<'_>) -> Result<usize, LaunchError> {
    static SMS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if let Some(&n) = SMS.get() {
        return Ok(n);
    }
    let n = s
        .device
        .ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|source| LaunchError::Driver {
            call: "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
            source,
        })?;
    Ok(*SMS.get_or_init(|| n.max(1) as usize))
}

/// Splits of a decode launch: one up to [`DECODE_ONE_SPLIT_KEYS`] keys; past it, enough
/// for `blocks` (sequences x kv-head blocks) to give every SM [`DECODE_BLOCKS_PER_SM`]
/// blocks, each split at least [`DECODE_SPLIT_MIN_KEYS`] keys. From `max_keys` (what the
/// tables can hold), not the span, so the launch stays the same while positions grow.
pub(super) fn decode_splits(max_keys: usize, blocks: usize, sms: usize) -> usize {
    if max_keys <= DECODE_ONE_SPLIT_KEYS {
        return 1;
    }
    (DECODE_BLOCKS_PER_SM * sms)
        .div_ceil(blocks.max(1))
        .clamp(1, max_keys.div_ceil(DECODE_SPLIT_MIN_KEYS))
}

/// The most splits [`decode_splits`] gives a launch over `max_keys` keys whatever its rows
/// and the device's SMs (the scratch rules' bound on its partials, `super::scratch`).
pub(super) fn decode_split_bound(max_keys: usize) -> usize {
    decode_splits(max_keys, 1, usize::MAX / 4)
}

/// Floats of one block of one KV head's pool.
fn block_elems(shape: &AttnShape, block: usize) -> usize {
    block * shape.kv_heads * shape.head_dim
}

/// The task's `kv` slice as the cache (`[K pool | V pool]`, the micro-batch's block
/// size): every sequence's table must cover its tokens with blocks inside the pools.
fn task_cache(
    cx: &GpuCx<'_>,
    mb: &MicroBatchState,
    kv: View,
    shape: &AttnShape,
) -> Result<KvPools, OpError> {
    let block = mb.block_size.max(1);
    let pool_blocks = (kv.len as usize / 4 / 2 / block_elems(shape, block).max(1)) as u64;
    let pool_elems = pool_blocks as usize * block_elems(shape, block);
    let base = cx.ptr(kv, "kv", 2 * pool_elems * 4)?;
    let tables: Vec<Vec<u32>> = mb.seqs.iter().map(|s| s.block_table.clone()).collect();
    for (seq, t) in mb.seqs.iter().zip(&tables) {
        let needed = (seq.context_len + seq.new_tokens.len()).div_ceil(block);
        if t.len() < needed || t.iter().any(|&b| u64::from(b) >= pool_blocks) {
            return Err(OpError::Kv(format!(
                "a block table of {} blocks (ids below {pool_blocks} needed) does not cover {} tokens of {block}",
                t.len(),
                seq.context_len + seq.new_tokens.len()
            )));
        }
    }
    Ok(KvPools {
        k: base,
        v: base + (pool_elems * 4) as u64,
        block,
        tables,
        append: runs(mb, |_| true),
        _scratch: None,
    })
}

/// A GPU prefill over whole prompts without a `kv` argument: a scratch cache holding only
/// this call's K/V, blocks of 16 handed out in sequence order to the sequences attended.
fn scratch_cache(
    cx: &GpuCx<'_>,
    mb: &MicroBatchState,
    shape: &AttnShape,
    wanted: impl Fn(usize) -> bool + Copy,
) -> Result<KvPools, OpError> {
    let block = 16;
    let mut next = 0u32;
    let mut tables = Vec::new();
    for (s, seq) in mb.seqs.iter().enumerate() {
        if wanted(s) {
            if seq.context_len > 0 {
                return Err(OpError::MissingArg(
                    "kv (a sequence with cached tokens needs its KV cache)",
                ));
            }
            let blocks = seq.new_tokens.len().div_ceil(block) as u32;
            tables.push((next..next + blocks).collect());
            next += blocks;
        } else {
            tables.push(Vec::new());
        }
    }
    let elems = next as usize * block_elems(shape, block);
    let scratch = cx.s.scratch(2 * elems * 4)?;
    let base = scratch.ptr();
    Ok(KvPools {
        k: base,
        v: base + (elems * 4) as u64,
        block,
        tables,
        append: runs(mb, wanted),
        _scratch: Some(scratch),
    })
}

/// What every append and attention launch of one call shares: the uploaded row tables
/// and the operands both kernel pairs take.
struct Calls<'a, 'c> {
    cx: &'a GpuCx<'c>,
    mb: &'a MicroBatchState,
    pools: &'a KvPools,
    shape: &'a AttnShape,
    rt: RowTables,
    /// Device copies of the row tables, sections of the step's inputs uploaded once a step
    /// ([`GpuCx::step_input`]): every layer's call reads the same.
    row_seq: u64,
    row_pos: u64,
    tables: u64,
    qkv: u64,
    dims: [Arg; 5],
    row_width: Arg,
    kv_heads: u32,
}

impl<'a, 'c> Calls<'a, 'c> {
    fn new(
        cx: &'a GpuCx<'c>,
        (ub, mb): (u32, &'a MicroBatchState),
        pools: &'a KvPools,
        shape: &'a AttnShape,
        qkv: u64,
    ) -> Result<Self, OpError> {
        let rt = row_tables(mb, &pools.tables);
        // Positions as `pre_attn`'s rotary reads them (the same table), block tables, and
        // row -> sequence only where a run takes the row kernels (MLA's always does).
        let row_seq = if cx.arch.mla.is_none()
            && runs(mb, |_| true).iter().all(|r| {
                rt.row_seq[r.clone()].iter().all(|&s| {
                    mb.seqs
                        .get(s as usize)
                        .is_some_and(|q| q.new_tokens.len() == 1)
                })
            }) {
            0
        } else {
            cx.step_input(ub, StepInput::RowSeq, &rt.row_seq)?
        };
        let row_pos = cx.step_input(ub, StepInput::Positions, &rt.row_pos)?;
        let tables = cx.step_input(ub, StepInput::BlockTables, &rt.tables)?;
        let dims = [
            Arg::I32(int("heads", shape.heads)?),
            Arg::I32(int("kv_heads", shape.kv_heads)?),
            Arg::I32(int("head_dim", shape.head_dim)?),
            Arg::I32(int("block_size", pools.block)?),
            Arg::I32(int("max_blocks", rt.max_blocks)?),
        ];
        Ok(Calls {
            cx,
            mb,
            pools,
            shape,
            row_width: Arg::I32(int("qkv_width", shape.qkv_width())?),
            kv_heads: int("kv_heads", shape.kv_heads)? as u32,
            rt,
            row_seq,
            row_pos,
            tables,
            qkv,
            dims,
        })
    }

    /// Whether every sequence of run `r` brings one token (decode): such a run takes the
    /// decode kernels, one row per sequence, its block table and position indexed by the
    /// launch's sequence.
    fn one_token_each(&self, r: &std::ops::Range<usize>) -> bool {
        self.rt.row_seq[r.clone()].iter().all(|&s| {
            self.mb
                .seqs
                .get(s as usize)
                .is_some_and(|q| q.new_tokens.len() == 1)
        })
    }

    /// The operands both kernel pairs start with: qkv rows, the pools, then the decode
    /// kernels' (block tables from the run's first sequence, positions) or the row
    /// kernels' (all tables, row -> sequence, positions).
    fn operands(&self, r: &std::ops::Range<usize>, decode: bool) -> Vec<Arg> {
        let qw = self.shape.qkv_width();
        let mut a = vec![
            Arg::Ptr(self.qkv + (r.start * qw * 4) as u64),
            Arg::Ptr(self.pools.k),
            Arg::Ptr(self.pools.v),
        ];
        if decode {
            let seq = self.rt.row_seq.get(r.start).copied().unwrap_or(0) as usize;
            a.push(Arg::Ptr(
                self.tables + (seq * self.rt.max_blocks * 4) as u64,
            ));
        } else {
            a.push(Arg::Ptr(self.tables));
            a.push(Arg::Ptr(self.row_seq + (r.start * 4) as u64));
        }
        a.push(Arg::Ptr(self.row_pos + (r.start * 4) as u64));
        a
    }

    /// Appends run `r`'s K/V to the cache.
    fn append(&self, r: &std::ops::Range<usize>) -> Result<(), OpError> {
        let decode = self.one_token_each(r);
        let mut a = self.operands(r, decode);
        a.extend_from_slice(&self.dims);
        a.push(self.row_width);
        let entry = if decode {
            "paged_kv_append"
        } else {
            "paged_kv_append_rows"
        };
        let grid = (int("rows", r.len())? as u32, self.kv_heads, 1);
        Ok(self.cx.s.launch(entry, grid, 32, 0, &a)?)
    }

    /// The most keys a row of run `r` can attend: what its block table can hold (at least
    /// its span), not the span itself, so a step's launches (the prefill kernel's scores
    /// stride, the decode kernel's splits) are the same every step of a batch (CUDA graphs
    /// replay them) while positions grow.
    fn max_keys(&self, r: &std::ops::Range<usize>) -> usize {
        let window = self.shape.sliding_window.unwrap_or(0);
        r.clone()
            .map(|row| {
                let seq = self.rt.row_seq.get(row).copied().unwrap_or(0) as usize;
                let span = self.rt.row_pos.get(row).map_or(1, |&p| p as usize + 1);
                let held = self
                    .pools
                    .tables
                    .get(seq)
                    .map_or(0, |t| t.len() * self.pools.block)
                    .max(span);
                if window > 0 {
                    held.min(window)
                } else {
                    held
                }
            })
            .max()
            .unwrap_or(1)
    }

    /// Whether run `r` takes `paged_decode_attention` (one token per sequence, not MLA),
    /// which appends the run's K/V itself.
    fn decode_kernel(&self, r: &std::ops::Range<usize>) -> bool {
        self.one_token_each(r) && self.cx.arch.mla.is_none()
    }

    /// Attends run `r`'s rows over the cache into `out`.
    fn attend(&self, r: &std::ops::Range<usize>, out: u64) -> Result<(), OpError> {
        let shape = self.shape;
        let window = shape.sliding_window.unwrap_or(0);
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        // gpt-oss's sinks follow q | k | v in each row; -1: none.
        let sink_col = if shape.sinks {
            int(
                "sink column",
                (shape.heads + 2 * shape.kv_heads) * shape.head_dim,
            )?
        } else {
            -1
        };
        let max_keys = self.max_keys(r);
        let out = out + (r.start * shape.q_width() * 4) as u64;
        if self.decode_kernel(r) {
            return self.decode(r, out, max_keys, window, scale, sink_col);
        }
        if self.tensor_core_prefill(r)? {
            // The flash-attention form: scores stay in shared memory (no scratch).
            let mut a = self.operands(r, false);
            a.extend_from_slice(&[Arg::Ptr(0), Arg::Ptr(out)]);
            a.extend_from_slice(&self.dims);
            a.extend_from_slice(&[
                Arg::I32(int("max_keys", max_keys)?),
                Arg::I32(int("sliding_window", window)?),
                Arg::F32(scale),
                self.row_width,
                Arg::I32(sink_col),
                Arg::I32(int("rows", r.len())?),
            ]);
            return Ok(self.cx.s.launch(
                "paged_prefill_attention_mma",
                (
                    int("row tiles", r.len().div_ceil(16))? as u32,
                    int("heads", shape.heads)? as u32,
                    1,
                ),
                32,
                0,
                &a,
            )?);
        }
        let scores = self.cx.s.scratch(r.len() * shape.heads * max_keys * 4)?;
        let mut a = self.operands(r, false);
        a.extend_from_slice(&[Arg::Ptr(scores.ptr()), Arg::Ptr(out)]);
        a.extend_from_slice(&self.dims);
        a.extend_from_slice(&[
            Arg::I32(int("max_keys", max_keys)?),
            Arg::I32(int("sliding_window", window)?),
            Arg::F32(scale),
            self.row_width,
            Arg::I32(sink_col),
        ]);
        if self.cx.arch.mla.is_some() {
            // MLA's kernel takes the row operands for decode too.
            return deepseek::mla_attention(self.cx, r.len(), shape.heads, shape.head_dim, &mut a);
        }
        let (grid_y, shared) = prefill_blocks(shape)?;
        Ok(self.cx.s.launch(
            "paged_prefill_attention",
            (int("rows", r.len())? as u32, grid_y, 1),
            64,
            shared,
            &a,
        )?)
    }

    /// Whether run `r` (not a decode run) attends on tensor cores
    /// (`paged_prefill_attention_mma`): not MLA, heads a multiple of the kv heads,
    /// `head_dim` at most [`ATTN_MMA_MAX_DIM`], and under `MOEC_TENSOR_CORES=auto` (the
    /// default) at least [`ATTN_MMA_MIN_ROWS`] new rows per sequence of the run on average
    /// (a prefill; the kernel's 16-row tiles would be mostly empty on fewer).
    fn tensor_core_prefill(&self, r: &std::ops::Range<usize>) -> Result<bool, OpError> {
        let shape = self.shape;
        if self.cx.arch.mla.is_some()
            || shape.kv_heads == 0
            || !shape.heads.is_multiple_of(shape.kv_heads)
            || shape.head_dim > ATTN_MMA_MAX_DIM
        {
            return Ok(false);
        }
        let policy =
            super::tensor_cores::TensorCores::process().map_err(super::ops::not_supported)?;
        let rows = r.len();
        let mut seqs: Vec<u32> = self.rt.row_seq.get(r.clone()).unwrap_or_default().to_vec();
        seqs.dedup();
        Ok(policy.chosen_rows(rows, seqs.len(), ATTN_MMA_MIN_ROWS))
    }

    /// Decode run `r` (a sequence per row) by [`decode_attention`], which appends the
    /// rows' K/V too.
    fn decode(
        &self,
        r: &std::ops::Range<usize>,
        out: u64,
        max_keys: usize,
        window: usize,
        scale: f32,
        sink_col: i32,
    ) -> Result<(), OpError> {
        let seq = self.rt.row_seq.get(r.start).copied().unwrap_or(0) as usize;
        decode_attention(
            &self.cx.s,
            &DecodeLaunch {
                qkv: self.qkv + (r.start * self.shape.qkv_width() * 4) as u64,
                k_pool: self.pools.k,
                v_pool: self.pools.v,
                tables: self.tables + (seq * self.rt.max_blocks * 4) as u64,
                context_lens: self.row_pos + (r.start * 4) as u64,
                out,
                rows: r.len(),
                shape: self.shape,
                block_size: self.pools.block,
                max_blocks: self.rt.max_blocks,
                max_keys,
                window,
                scale,
                sink_col,
            },
        )
    }
}

/// `MOEC_ATTN_MMA_MAX_DIM` of kernels/prefill_attention.cu: the widest head
/// `paged_prefill_attention_mma` takes.
pub(super) const ATTN_MMA_MAX_DIM: usize = 128;

/// Mean new rows per sequence of a run from which prefill attention runs on tensor cores
/// (`paged_prefill_attention_mma`'s tiles are 16 rows of one sequence); where it overtakes
/// `paged_prefill_attention` on a GPU is still to be measured (docs/gpu.md's "Tensor
/// cores").
pub(super) const ATTN_MMA_MIN_ROWS: usize = 16;

/// Most query heads a `paged_prefill_attention` block serves (kernels/paged_attention.cuh's
/// `MOEC_ATTEND_MAX_HEADS`).
const ATTEND_MAX_HEADS: usize = 16;

/// `paged_prefill_attention`'s blocks per row (`kv_heads` times the chunks each group is
/// split into, of at most [`ATTEND_MAX_HEADS`] heads) and their dynamic shared memory (a
/// chunk's queries).
pub(super) fn prefill_blocks(shape: &AttnShape) -> Result<(u32, u32), LaunchError> {
    let group = shape.heads / shape.kv_heads.max(1);
    let chunks = group.div_ceil(ATTEND_MAX_HEADS).max(1);
    let per_block = group.div_ceil(chunks);
    Ok((
        int("kv head blocks", shape.kv_heads * chunks)? as u32,
        int("shared", per_block * shape.head_dim * 4)? as u32,
    ))
}

/// One `paged_decode_attention` call: a sequence per row (kernels/decode_attention.cu's
/// operands).
pub(super) struct DecodeLaunch<'a> {
    /// The rows' qkv (row i: sequence i of the launch).
    pub qkv: u64,
    /// The K pool.
    pub k_pool: u64,
    /// The V pool.
    pub v_pool: u64,
    /// The rows' block tables, `max_blocks` each.
    pub tables: u64,
    /// The rows' cached token counts (their positions).
    pub context_lens: u64,
    /// The rows' outputs.
    pub out: u64,
    /// Rows (sequences).
    pub rows: usize,
    /// The layer's attention geometry.
    pub shape: &'a AttnShape,
    /// Positions per KV block.
    pub block_size: usize,
    /// Entries of each block table.
    pub max_blocks: usize,
    /// The most keys a row can attend (a launch shape that stays while positions grow).
    pub max_keys: usize,
    /// Sliding window (0: none).
    pub window: usize,
    /// Score scale.
    pub scale: f32,
    /// Column of gpt-oss's sink logits in a qkv row (-1: none).
    pub sink_col: i32,
}

/// Split-KV decode attention as `attn` launches it: `paged_decode_attention` over
/// [`decode_splits`] splits of the `max_keys` keys a row can attend (the split count stays
/// the same while positions grow, so graphs replay), appending the rows' K/V, then
/// `paged_decode_combine` when there is more than one split.
pub(super) fn decode_attention(s: &StreamCx<'_>, d: &DecodeLaunch<'_>) -> Result<(), OpError> {
    let shape = d.shape;
    if shape.head_dim > DECODE_MAX_HEAD_DIM || shape.head_dim == 0 || shape.kv_heads == 0 {
        return Err(OpError::Unsupported {
            backend: "CUDA",
            what: format!(
                "decode attention with head_dim {} and {} kv heads (head_dim 1 to {DECODE_MAX_HEAD_DIM})",
                shape.head_dim, shape.kv_heads
            ),
        });
    }
    let group = shape.heads / shape.kv_heads;
    let chunks = group.div_ceil(DECODE_MAX_GROUP);
    let g = group.min(DECODE_MAX_GROUP);
    let shared = decode_shared_bytes(g, shape.head_dim);
    let n_splits = decode_splits(d.max_keys, d.rows * shape.kv_heads * chunks, sm_count(s)?);
    let split_keys = d.max_keys.div_ceil(n_splits).max(1);
    let rows = int("rows", d.rows)? as u32;
    let partials = s.scratch(if n_splits > 1 {
        d.rows * shape.heads * n_splits * (2 + shape.head_dim) * 4
    } else {
        0
    })?;
    // With one split the kernel never touches `partials`: any valid address.
    let partials_ptr = if n_splits > 1 { partials.ptr() } else { d.out };
    let row_width = Arg::I32(int("qkv_width", shape.qkv_width())?);
    let a = [
        Arg::Ptr(d.qkv),
        Arg::Ptr(d.k_pool),
        Arg::Ptr(d.v_pool),
        Arg::Ptr(d.tables),
        Arg::Ptr(d.context_lens),
        Arg::Ptr(partials_ptr),
        Arg::Ptr(d.out),
        Arg::I32(int("heads", shape.heads)?),
        Arg::I32(int("kv_heads", shape.kv_heads)?),
        Arg::I32(int("head_dim", shape.head_dim)?),
        Arg::I32(int("block_size", d.block_size)?),
        Arg::I32(int("max_blocks", d.max_blocks)?),
        Arg::I32(int("split_keys", split_keys)?),
        Arg::I32(int("sliding_window", d.window)?),
        Arg::F32(d.scale),
        row_width,
        Arg::I32(d.sink_col),
        // append: the kernel writes the rows' K/V into the pools.
        Arg::I32(1),
    ];
    let grid_y = int("kv head blocks", shape.kv_heads * chunks)? as u32;
    let grid_z = int("splits", n_splits)? as u32;
    s.launch(
        "paged_decode_attention",
        (rows, grid_y, grid_z),
        DECODE_THREADS,
        int("shared", shared)? as u32,
        &a,
    )?;
    if n_splits == 1 {
        return Ok(());
    }
    let c = [
        Arg::Ptr(d.qkv),
        Arg::Ptr(partials.ptr()),
        Arg::Ptr(d.out),
        Arg::I32(int("heads", shape.heads)?),
        Arg::I32(int("head_dim", shape.head_dim)?),
        Arg::I32(int("splits", n_splits)?),
        row_width,
        Arg::I32(d.sink_col),
    ];
    Ok(s.launch(
        "paged_decode_combine",
        (rows, int("heads", shape.heads)? as u32, 1),
        64,
        0,
        &c,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split policy by hand: one split while the tables hold at most 512 keys (no
    /// combine node, whatever the batch); past it, two blocks an SM over sequences x kv
    /// heads, each split at least 256 keys.
    #[test]
    fn decode_splits_fill_the_sms_only_past_512_keys() {
        // Batch 1 of mixtral-mid (4 kv heads) on 132 SMs: 70 or 512 keys stay one split.
        assert_eq!(decode_splits(70, 4, 132), 1);
        assert_eq!(decode_splits(512, 4, 132), 1);
        // 4096 keys: 264 / 4 = 66 wanted, at most 4096 / 256 = 16 splits.
        assert_eq!(decode_splits(4096, 4, 132), 16);
        // 600 keys: at most ceil(600 / 256) = 3.
        assert_eq!(decode_splits(600, 4, 132), 3);
        // Batch 64 (256 blocks): ceil(264 / 256) = 2; batch 128 (512 blocks): 1.
        assert_eq!(decode_splits(4096, 256, 132), 2);
        assert_eq!(decode_splits(4096, 512, 132), 1);
    }

    /// Chunks and shared memory by hand (kernels/decode_attention.cu's header): under the
    /// 48 KB a block gets without opting in, for every head width up to 256.
    #[test]
    fn decode_chunks_keep_shared_memory_under_48_kb() {
        assert_eq!(decode_chunk(64), 64);
        assert_eq!(decode_chunk(128), 32);
        assert_eq!(decode_chunk(256), 8);
        assert_eq!(decode_chunk(16), 128);
        assert_eq!(decode_chunk(48), 84);
        // head_dim 64, a group of 4: K and V 2 * 64 * 64, q and outputs 2 * 4 * 64,
        // probabilities 4 * 64, 12 floats.
        assert_eq!(decode_shared_bytes(4, 64), (8192 + 512 + 256 + 12) * 4);
        for head_dim in 1..=DECODE_MAX_HEAD_DIM {
            let chunk = decode_chunk(head_dim);
            assert!(
                chunk >= 4 && chunk.is_multiple_of(4),
                "head_dim {head_dim}: chunk {chunk}"
            );
            let bytes = decode_shared_bytes(DECODE_MAX_GROUP, head_dim);
            assert!(bytes <= 48 * 1024, "head_dim {head_dim}: {bytes} bytes");
        }
    }
}
