//! What a CUDA op needs on its stream: the device, the stream and its cuBLAS handle, kernel
//! launches with plain arguments, scratch memory and the cuBLAS GEMMs.
//!
//! Takes a stream's resources; gives [`StreamCx`]: [`StreamCx::launch`] (a kernel entry of
//! `kernels/*.cu` with its arguments in the kernel's order), [`StreamCx::scratch`]
//! (a piece of the stream's workspace) and
//! [`StreamCx::linear`] (`y = x Wᵀ` for a stored weight matrix). Guarantees: every launch
//! goes to this stream in call order; scratch is never reused before the work that used it
//! has run (it is reused only by the stream's next task, queued after it; see
//! [`Workspace`]).
//!
//! Projections of at most [`GEMV_MAX_ROWS`] rows (decode steps) with Q8_0/Q4_K/Q5_K/Q6_K
//! weights run as integer products on activations quantised once per input
//! (`q8_quantize` + `linear_gemv_q8`, [`int_product`]; [`StreamCx::linear_shared`] shares
//! the quantised rows between q, k and v), vocabulary heads included. Float (and other
//! block) weights stored `[out, in]` with at most [`GEMV_MAX_OUT`] outputs run as one
//! `linear_gemv` launch (a warp per output feature, the weights read once as stored, f32
//! activations and accumulation). Larger ones run as bf16 GEMMs with
//! f32 accumulation (`cublasGemmEx`): the f32
//! activations are split into a bf16 pair (hi = bf16(x), lo = bf16(x - hi), `split_bf16`),
//! both multiplied in one GEMM of twice the columns and summed (`sum_halves`), so the
//! weights are read once and the result agrees with the CPU's f32-activation product to
//! about 2^-17 relative instead of bf16's 2^-8. f32 weights use `cublasSgemm`; f16 weights
//! are widened to f32 first.

use super::device::Device;
use super::graph::{Command, Deferred, Gemm, Recorder};
use crate::math::isa::Kernels;
use crate::model::vocab::Orientation;
use crate::quant::q8::ActFormat;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use cudarc::cublas::result::CublasError;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::Arc;

mod shared_input;
pub use shared_input::{act_format, Q8Act, RmsNormArg};

/// Why a launch, allocation or GEMM failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A kernel entry point that was not loaded.
    #[error("kernel `{0}` is not loaded")]
    NoEntry(&'static str),
    /// A driver call failed.
    #[error("CUDA {call} failed: {source}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS {call} failed: {source:?}")]
    Blas {
        /// The call.
        call: &'static str,
        /// cuBLAS's status.
        source: CublasError,
    },
    /// A graph capture could not be set up (an internal inconsistency, named).
    #[error("CUDA graph capture: {0}")]
    Capture(&'static str),
    /// A dimension past what the kernels or cuBLAS take (32-bit).
    #[error("{what} = {value} exceeds the 32-bit range the kernels take")]
    Range {
        /// The dimension.
        what: &'static str,
        /// Its value.
        value: usize,
    },
    /// An environment setting the launches read that has no meaning (named).
    #[error("{0}")]
    Setting(String),
}

/// A kernel argument, in the kernel signature's order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long`.
    I64(i64),
    /// `float`.
    F32(f32),
}

/// A stored weight matrix in device memory.
#[derive(Debug, Clone, Copy)]
pub struct DevMatrix {
    /// Device address of element 0.
    pub ptr: u64,
    /// Element type (f32 for a quantised matrix: what its blocks decode to).
    pub dtype: WeightDtype,
    /// The ggml block format of a quantised matrix (`None`: plain `dtype` elements). Such
    /// a matrix is stored `[out, in]` with rows of whole blocks (`model::formats`).
    pub quant: Option<QuantFormat>,
    /// Stored rows.
    pub rows: usize,
    /// Stored columns.
    pub cols: usize,
    /// Whether rows are outputs (`OutIn`) or inputs (`InOut`).
    pub orientation: Orientation,
}

impl DevMatrix {
    /// Output features.
    pub fn out_dim(&self) -> usize {
        match self.orientation {
            Orientation::OutIn => self.rows,
            Orientation::InOut => self.cols,
        }
    }

    /// Input features.
    pub fn in_dim(&self) -> usize {
        match self.orientation {
            Orientation::OutIn => self.cols,
            Orientation::InOut => self.rows,
        }
    }

    /// The kernels' `dtype` code of its storage (`kernels/prelude.cuh`).
    pub fn code(&self) -> i32 {
        storage_code(self.dtype, self.quant)
    }
}

/// The kernels' `dtype` code of a storage (`kernels/prelude.cuh`): 0 bf16, 1 f16, 2 f32,
/// 3 Q8_0, 4 Q4_K, 5 Q5_K, 6 Q6_K, 7 Q4_0, 8 Q4_1, 9 MXFP4.
pub fn storage_code(dtype: WeightDtype, quant: Option<QuantFormat>) -> i32 {
    match (quant, dtype) {
        (Some(QuantFormat::Q8_0), _) => 3,
        (Some(QuantFormat::Q4K), _) => 4,
        (Some(QuantFormat::Q5K), _) => 5,
        (Some(QuantFormat::Q6K), _) => 6,
        (Some(QuantFormat::Q4_0), _) => 7,
        (Some(QuantFormat::Q4_1), _) => 8,
        (Some(QuantFormat::Mxfp4), _) => 9,
        // No kernel decodes Q5_0: `ops::QUANT_FORMATS` leaves it out, so the registry
        // refuses its checkpoints before any launch; -1 matches no prelude decoder.
        (Some(QuantFormat::Q5_0), _) => -1,
        (None, WeightDtype::Bf16) => 0,
        (None, WeightDtype::F16) => 1,
        (None, WeightDtype::F32) => 2,
    }
}

/// Whether products with weights of `format` run as integer dot products on activations
/// quantised once (`q8_quantize` + `linear_gemv_q8` / `moe_grouped_gemv_q8`,
/// kernels/q8_products.cu, and their row-count forms in q8_products_rows.cu): Q8_0, Q4_K, Q5_K and Q6_K with the CPU's default 8-bit product
/// (not under `MOEC_QUANT_PRODUCT=decoded`, where both backends multiply f32 activations).
/// Q4_0, Q4_1 and MXFP4 decode their blocks inside the f32 products instead.
pub fn int_product(format: Option<QuantFormat>) -> bool {
    matches!(
        format,
        Some(QuantFormat::Q8_0 | QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K)
    ) && !Kernels::process().decodes_quant()
}

/// Whether a few-row product runs in its one-row form (`linear_gemv_1`,
/// `moe_grouped_gemv_1`): one row, bf16 or f16 weights (kernel code 0 or 1, not blocks),
/// every address in `ptrs` (weights and activations) on 16 bytes and `in_dim` a multiple
/// of 8, which those kernels assume.
pub fn one_row_half(
    rows: usize,
    quant: Option<QuantFormat>,
    code: i32,
    ptrs: &[u64],
    in_dim: usize,
) -> bool {
    rows == 1
        && quant.is_none()
        && (code == 0 || code == 1)
        && ptrs.iter().all(|p| p.is_multiple_of(16))
        && in_dim.is_multiple_of(8)
}

/// Whether the float decode kernels run in their warp forms, from `MOEC_FLOAT_KERNELS`
/// (read once, [`float_kernel_choice`]): `warp` (the default), `staged-experts` and
/// `generic-rows` run `linear_gemv3_1` for a one-row q|k|v of bf16/f16 weights,
/// `moe_gate_route` (top-k on a warp's lanes) for the fused MoE gate and `moe_group` by
/// warp scans; `block` runs
/// `linear_gemv3`, `moe_gate_route_block` and `moe_group_block` there, the forms before
/// them (the same values, bit for bit), kept so one binary can time both on a GPU.
/// Another value is an error naming it.
pub fn warp_float_kernels() -> Result<bool, String> {
    float_kernel_choice().map(|c| c != "block")
}

/// Whether 2-16 rows of bf16/f16 weights run in the staged row forms (`linear_gemv_r4` /
/// `_r16`, `linear_gemv3_r4` / `_r16`: a chunk's weight loads in flight, the rows in
/// shared memory once a block): under `MOEC_FLOAT_KERNELS=warp` (the default) and
/// `staged-experts`; `block` and `generic-rows` run the generic `linear_gemv` /
/// `linear_gemv3` there (the same values, bit for bit), so one binary can time both on a
/// GPU.
pub fn staged_row_kernels() -> Result<bool, String> {
    float_kernel_choice().map(|c| c == "warp" || c == "staged-experts")
}

/// Whether the grouped expert products of 2-16 rows per expert with bf16/f16 weights run
/// `moe_grouped_gemv_rows` (the rows staged, gate and up rows read against each staged
/// value together, grids from the routed entries, split-K for small outputs): under
/// `MOEC_FLOAT_KERNELS=staged-experts` only (the default's dense staged forms as well), until
/// a GPU has timed it against the generic `moe_grouped_gemv` that `warp` (the default),
/// `generic-rows` and `block` run there. Not the default yet also because the CUDA
/// stand-in emulates its barriers and split-K warps at ~1.7x the generic kernel's CPU
/// (a cgopipe run on mixtral-tiny, 4 new tokens: 5.3 against 3.2 user-s), which as the
/// default added ~275 CPU-s to the CI suite's CUDA sweeps.
pub fn staged_expert_kernels() -> Result<bool, String> {
    float_kernel_choice().map(|c| c == "staged-experts")
}

/// `MOEC_FLOAT_KERNELS` (read once): `warp` (unset too), `staged-experts`, `generic-rows`
/// or `block`; another value is an error naming it.
pub fn float_kernel_choice() -> Result<&'static str, String> {
    static CHOICE: std::sync::OnceLock<Result<&'static str, String>> = std::sync::OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var("MOEC_FLOAT_KERNELS").as_deref() {
            Err(_) | Ok("warp") => Ok("warp"),
            Ok("staged-experts") => Ok("staged-experts"),
            Ok("generic-rows") => Ok("generic-rows"),
            Ok("block") => Ok("block"),
            Ok(other) => Err(format!(
                "MOEC_FLOAT_KERNELS={other:?}: expected warp, staged-experts, generic-rows or \
                 block"
            )),
        })
        .clone()
}

/// Whether `rows` rows of a few-row product run in a staged row form (`linear_gemv_r4`,
/// `linear_gemv_r16` and the linear_gemv3 pair): 2 to 16 rows, bf16 or f16 weights, every
/// address in `ptrs` on 16 bytes and `in_dim` a multiple of 8 (what [`one_row_half`] asks
/// of one row), unless `MOEC_FLOAT_KERNELS` picks the generic forms. The entry's suffix:
/// `_r4` up to 4 rows, `_r16` beyond.
pub fn staged_rows(
    rows: usize,
    quant: Option<QuantFormat>,
    code: i32,
    ptrs: &[u64],
    in_dim: usize,
) -> Result<Option<&'static str>, String> {
    let fits = (2..=GEMV_MAX_ROWS).contains(&rows)
        && quant.is_none()
        && (code == 0 || code == 1)
        && ptrs.iter().all(|p| p.is_multiple_of(16))
        && in_dim.is_multiple_of(8);
    if !fits || !staged_row_kernels()? {
        return Ok(None);
    }
    Ok(Some(if rows <= 4 { "_r4" } else { "_r16" }))
}

/// Whether a grouped expert product over `n` tokens (tiles of at most min(n, 16) rows)
/// runs `moe_grouped_gemv_rows`: at least 2 tokens (one token takes `moe_grouped_gemv_1`),
/// bf16 or f16 weights (kernel code 0 or 1, not blocks) and every address in `ptrs`
/// (the experts' matrices, the activations) on 16 bytes with `in_dim` a multiple of 8
/// (what the staged loads assume), unless `MOEC_FLOAT_KERNELS` picks the generic form.
pub fn staged_expert_rows(
    n: usize,
    quant: Option<QuantFormat>,
    code: i32,
    ptrs: &[u64],
    in_dim: usize,
) -> Result<bool, String> {
    let fits = n >= 2
        && quant.is_none()
        && (code == 0 || code == 1)
        && ptrs.iter().all(|p| p.is_multiple_of(16))
        && in_dim.is_multiple_of(8);
    Ok(fits && staged_expert_kernels()?)
}

/// Blocks from which a `moe_grouped_gemv_rows` launch splits no output across warps:
/// about one block an SM of an H100/H200 (132 SMs). A block of 8 warps keeps 8 x 16
/// 16-byte loads a lane in flight at 2-4 rows (64 KB), more than an SM's share of HBM
/// needs over a round trip (~26 KB at 3.5 TB/s and 1 us), so fewer, fuller blocks lose
/// nothing until SMs go idle; past that, `split` warps share an output.
pub const GROUPED_ROWS_MIN_BLOCKS: usize = 128;

/// The grid of a `moe_grouped_gemv_rows` launch: (output blocks, tile slots, split).
/// `fused`: mode 3 (a warp's two rows are one output's gate and up; else two outputs).
/// Slots: each block walks tiles slot, slot + slots, ... When `whole` (the group holds
/// every expert of the layer, so every routed entry is the group's) moe_group makes at
/// least max(top_k, ceil(entries / 16)) tiles (a token's top_k experts are distinct, and
/// no tile holds more than 16 positions), so that many slots leave no block without a tile;
/// otherwise (a part of the experts, which may get no entry) one slot per possible tile
/// (`max_tiles`). Split: the least of 1, 2, 4, 8 warps an output that gives
/// [`GROUPED_ROWS_MIN_BLOCKS`] blocks (8 at most).
pub fn grouped_rows_grid(
    out_dim: usize,
    fused: bool,
    entries: usize,
    top_k: usize,
    whole: bool,
    max_tiles: usize,
) -> (usize, usize, usize) {
    let max_tiles = max_tiles.max(1);
    let slots = if whole {
        top_k
            .max(entries.div_ceil(GEMV_MAX_ROWS))
            .clamp(1, max_tiles)
    } else {
        max_tiles
    };
    let per_warp = if fused { 1 } else { 2 };
    let blocks = |split: usize| out_dim.div_ceil(per_warp * GEMV_WARPS / split);
    let mut split = 1;
    while split < GEMV_WARPS && blocks(split) * slots < GROUPED_ROWS_MIN_BLOCKS {
        split *= 2;
    }
    (blocks(split), slots, split)
}

/// The kernel [`StreamCx::linear`] runs for `n` rows of `w` (the run report and
/// `moec devices` name it): for a decode step's few rows, `linear_gemv_q8` (integer
/// products on activations quantised once, [`int_product`] formats stored on 16 bytes,
/// vocabulary heads included) or `linear_gemv` (float weights, or blocks decoded inside
/// the product); else a cuBLAS GEMM, after `dequant_f32` for blocks.
pub fn linear_kernel(w: &DevMatrix, n: usize) -> &'static str {
    if n <= GEMV_MAX_ROWS && int_product(w.quant) && w.ptr.is_multiple_of(16) {
        return "q8_quantize + linear_gemv_q8";
    }
    if n <= GEMV_MAX_ROWS && w.out_dim() <= GEMV_MAX_OUT && w.orientation == Orientation::OutIn {
        return "linear_gemv";
    }
    match (w.quant, w.dtype) {
        (Some(_), _) => "dequant_f32 + cublasSgemm",
        (None, WeightDtype::Bf16) => "cublasGemmEx (bf16 pair)",
        (None, WeightDtype::F16) => "widen_f16 + cublasSgemm",
        (None, WeightDtype::F32) => "cublasSgemm",
    }
}

/// Which integer-product kernels run (`MOEC_Q8_KERNELS`, read once per process; the run
/// report says which, [`q8_kernel_note`]): the row-generic ones (`generic`: kept for A/B
/// timing), the row-count-specialised ones after a `q8_quantize` (`rows`), or, the
/// default, those with one-row products quantising their row themselves ([`q8_folds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Q8Kernels {
    /// `linear_gemv_q8`, `linear_gemv3_q8`, `moe_grouped_gemv_q8` for any row count.
    Generic,
    /// `*_q8_r1` for one row, `*_q8_r16` for more, each after a `q8_quantize`.
    Rows,
    /// As `Rows`, but a one-row product runs `*_q8_x1`, which quantises its row itself.
    Folded,
}

/// The process's [`Q8Kernels`] (`MOEC_Q8_KERNELS` = `generic`, `rows`, or unset / anything
/// else: `Folded`).
pub fn q8_kernels() -> Q8Kernels {
    static KERNELS: std::sync::OnceLock<Q8Kernels> = std::sync::OnceLock::new();
    *KERNELS.get_or_init(|| match std::env::var("MOEC_Q8_KERNELS").as_deref() {
        Ok("generic") => Q8Kernels::Generic,
        Ok("rows") => Q8Kernels::Rows,
        _ => Q8Kernels::Folded,
    })
}

/// Whether the integer products run the row-generic kernels ([`Q8Kernels::Generic`]).
pub fn q8_generic_kernels() -> bool {
    q8_kernels() == Q8Kernels::Generic
}

/// Dynamic shared memory of a `*_q8_x1` launch on rows of `cols` values in `format`: the
/// row's codes, then its scales from the next 16-byte boundary.
pub fn q8_fold_shared(cols: usize, format: ActFormat) -> usize {
    cols.next_multiple_of(16) + 4 * (cols / format.block_elems())
}

/// Whether an integer product of `rows` activation rows (per call, or per expert tile) of
/// `cols` values in `format` quantises its row itself (`*_q8_x1`, no `q8_quantize`): one
/// row, [`Q8Kernels::Folded`], and the row's codes and scales within the 48 KiB of shared
/// memory a launch gets without opting in (past that: `q8_quantize` and `*_q8_r1`).
pub fn q8_folds(rows: usize, cols: usize, format: ActFormat) -> bool {
    rows == 1 && q8_kernels() == Q8Kernels::Folded && q8_fold_shared(cols, format) <= 48 * 1024
}

/// The `kind` argument of `q8_quantize` and the `*_q8_x1` kernels for `format`.
pub fn q8_kind(format: ActFormat) -> i32 {
    match format {
        ActFormat::Q8K => 0,
        _ => 1,
    }
}

/// The integer-product entry of kernel family `base` (`linear_gemv_q8`, `linear_gemv3_q8`
/// or `moe_grouped_gemv_q8`) for products of at most `rows` activation rows per tile or
/// call: `base_r1` for one row, `base_r16` for more (both take `base`'s arguments, the
/// linear ones a lane-group size too), or `base` itself under
/// [`q8_generic_kernels`].
pub fn q8_entry(base: &'static str, rows: usize) -> &'static str {
    let one = rows <= 1;
    match (base, q8_generic_kernels(), one) {
        (_, true, _) => base,
        ("linear_gemv_q8", false, true) => "linear_gemv_q8_r1",
        ("linear_gemv_q8", false, false) => "linear_gemv_q8_r16",
        ("linear_gemv3_q8", false, true) => "linear_gemv3_q8_r1",
        ("linear_gemv3_q8", false, false) => "linear_gemv3_q8_r16",
        ("moe_grouped_gemv_q8", false, true) => "moe_grouped_gemv_q8_r1",
        ("moe_grouped_gemv_q8", false, false) => "moe_grouped_gemv_q8_r16",
        _ => base,
    }
}

/// The run report's line on the integer-product kernels [`q8_kernels`] picks.
pub fn q8_kernel_note() -> &'static str {
    match q8_kernels() {
        Q8Kernels::Generic => {
            "row-generic integer kernels (MOEC_Q8_KERNELS=generic: linear_gemv_q8, \
             linear_gemv3_q8, moe_grouped_gemv_q8)"
        }
        Q8Kernels::Rows => {
            "row-count-specialised integer kernels after q8_quantize (MOEC_Q8_KERNELS=rows: \
             *_q8_r1 for one row, *_q8_r16 up to 16)"
        }
        Q8Kernels::Folded => {
            "row-count-specialised integer kernels: one row quantised inside the product \
             (*_q8_x1, no q8_quantize), *_q8_r16 after q8_quantize up to 16 rows \
             (MOEC_Q8_KERNELS=rows / generic select the others)"
        }
    }
}

/// Device scratch memory of one task, a piece of its stream's [`Workspace`].
#[derive(Debug)]
pub struct Scratch {
    ptr: u64,
}

impl Scratch {
    /// Its device address (0 for an empty scratch, never dereferenced).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// Alignment of every scratch piece (cuBLAS and the kernels' vector loads want 16 bytes;
/// 256 is what the driver's own allocations give).
const SCRATCH_ALIGN: usize = 256;

/// A stream's scratch memory: one device buffer that a task's [`StreamCx::scratch`] calls
/// take pieces of by bumping an offset, handed out again from the start at the next task
/// on the stream ([`Workspace::reset`]). That is safe because a stream runs its work in
/// order: the next task's kernels, which reuse the bytes, run after the last task's
/// kernels that used them, and no other stream touches a task's scratch. It replaces a
/// stream-ordered allocation and free per piece (a dozen per op, and the driver's pool
/// gives its memory back at every step's synchronisation, so each step paid to map it
/// again). When a task needs more than the buffer holds, a buffer of twice the size (at
/// least what the task has taken so far plus the request) replaces it; the old one is
/// freed on the stream after the work queued on it, so after a step or two a stream stops
/// allocating.
#[derive(Debug, Default)]
pub struct Workspace {
    inner: std::sync::Mutex<WorkspaceInner>,
    step: std::sync::Mutex<StepTables>,
    constants: std::sync::Mutex<ConstantTables>,
}

/// Tables a stream's tasks upload with the same bytes step after step (a layer's expert
/// weight addresses, `moe::device_experts`), each copied to a device buffer of its own
/// once and read there from then on ([`StreamCx::upload_constant`]): no copy per layer
/// and step, so no copy node in a step's graph. Keyed by the bytes, so a table whose
/// addresses changed (weights moved) is a new entry and an entry's device bytes never
/// change. At most [`MAX_CONSTANT_TABLES`] entries (a few KiB each), kept for the
/// stream's life.
#[derive(Debug, Default)]
struct ConstantTables {
    tables: std::collections::HashMap<Vec<u8>, CudaSlice<u8>>,
}

/// Entries past which [`StreamCx::upload_constant`] uploads per call, as
/// [`StreamCx::upload`] does (the same values; only the copy is not saved).
const MAX_CONSTANT_TABLES: usize = 4096;

/// Replaces a bump arena's device buffer with a fresh one of `size` bytes, keeping the old
/// one in `retired` (work already submitted may still read it), and returns the new base.
/// The step tables and the scratch arena both grow this way.
fn regrow(
    stream: &Arc<CudaStream>,
    buffer: &mut Option<CudaSlice<u8>>,
    retired: &mut Vec<CudaSlice<u8>>,
    size: usize,
) -> Result<u64, LaunchError> {
    // SAFETY: the arena's callers write every byte they hand out before a kernel reads it
    // (step tables by their copy, scratch by the kernels of its stream); uninitialised
    // device memory is never read as a value.
    let fresh = unsafe { stream.alloc::<u8>(size) }.map_err(|source| LaunchError::Driver {
        call: "cuMemAllocAsync",
        source,
    })?;
    let base = fresh.device_ptr(stream).0;
    if let Some(old) = buffer.replace(fresh) {
        retired.push(old);
    }
    Ok(base)
}

/// The per-step tables a stream's tasks upload ([`StreamCx::upload_step`]; the step's
/// inputs, `super::step_inputs`, are one such table): positions and block tables are the
/// same for every layer of a step, so each (name, micro-batch) table
/// is copied to the device once a step (one copy node in a graph, not one per layer) and
/// later tasks of the step on the stream that ask for it with the same bytes read that
/// copy. Keyed by micro-batch, not by bytes alone, so how many copies a step makes never
/// depends on two micro-batches' tables happening to be equal. A buffer of its own, handed out
/// from the start at each step ([`Workspace::begin_step`]), so a step's offsets, and so a
/// replayed graph's, are the same every step.
#[derive(Debug, Default)]
struct StepTables {
    buffer: Option<CudaSlice<u8>>,
    base: u64,
    size: usize,
    used: usize,
    /// Buffers replaced during the step, freed (stream-ordered) at the next step.
    retired: Vec<CudaSlice<u8>>,
    /// What this step uploaded: (name, micro-batch, bytes, device address).
    seen: Vec<(&'static str, u32, Vec<u8>, u64)>,
}

#[derive(Debug, Default)]
struct WorkspaceInner {
    buffer: Option<CudaSlice<u8>>,
    base: u64,
    size: usize,
    used: usize,
    /// Buffers replaced during the current task: their pieces are still in use by its
    /// queued work, so they are freed (stream-ordered) at the next reset.
    retired: Vec<CudaSlice<u8>>,
    grown: usize,
    /// What the run measures against the budget ([`ScratchUse`]).
    usage: ScratchUse,
}

/// A stream's scratch as measured against its budgeted bound (`super::scratch`): the
/// most one task took (the sum of its pieces, across any growth), which task, and the
/// tasks that took more than the bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScratchUse {
    /// The budgeted bound, when the workspace was reserved at one.
    pub bound: Option<usize>,
    /// The most bytes one task took.
    pub peak: usize,
    /// The task that took them.
    pub peak_task: Option<crate::ir::TaskId>,
    /// Tasks that took more than `bound`.
    pub over: usize,
    /// The current task and the bytes it has taken.
    task: Option<crate::ir::TaskId>,
    taken: usize,
    counted_over: bool,
}

impl Workspace {
    /// Starts a task: every piece is free again (see the type's safety argument). In a
    /// step recorded for a graph (`keep_retired`) nothing has been submitted yet, so
    /// buffers replaced during the step are kept until [`Workspace::release_retired`]
    /// after its end (freeing one now would queue the free before the work using it).
    pub fn reset(&self, keep_retired: bool) {
        let mut w = crate::runtime::sync::lock(&self.inner);
        w.used = 0;
        w.usage.taken = 0;
        w.usage.counted_over = false;
        if !keep_retired {
            w.retired.clear();
        }
    }

    /// [`Workspace::reset`] for task `task`, whose pieces the measurement then counts.
    pub fn begin_task(&self, keep_retired: bool, task: crate::ir::TaskId) {
        self.reset(keep_retired);
        crate::runtime::sync::lock(&self.inner).usage.task = Some(task);
    }

    /// Reserves the buffer at `bound` bytes (the stream's budgeted scratch, from
    /// `super::scratch`), so no task within it makes the buffer grow, and measures every
    /// task against it from now on.
    pub fn reserve(&self, stream: &Arc<CudaStream>, bound: usize) -> Result<(), LaunchError> {
        let mut w = crate::runtime::sync::lock(&self.inner);
        let w = &mut *w;
        let size = bound.next_multiple_of(SCRATCH_ALIGN);
        if size > w.size {
            w.base = regrow(stream, &mut w.buffer, &mut w.retired, size)?;
            w.size = size;
            w.used = 0;
        }
        w.usage.bound = Some(bound);
        Ok(())
    }

    /// A scope whose pieces are handed out again when it ends (pieces taken before it
    /// stay): for a loop whose iterations each take scratch (the host-grouped experts),
    /// safe as [`Workspace::reset`] is, since the next iteration's kernels are queued on
    /// the stream after the last one's. When the buffer grew inside the scope, its end
    /// keeps everything (the old pieces are in the retired buffer).
    pub fn scope(&self) -> ScratchScope<'_> {
        let w = crate::runtime::sync::lock(&self.inner);
        ScratchScope {
            workspace: self,
            base: w.base,
            used: w.used,
            taken: w.usage.taken,
        }
    }

    /// The scratch measured so far against the bound.
    pub fn usage(&self) -> ScratchUse {
        crate::runtime::sync::lock(&self.inner).usage.clone()
    }

    /// Starts a step: the step tables' buffer is handed out from its start again and no
    /// table of the last step is found any more. Safe: the last step's work, which read
    /// them, was queued on this stream before the new step's copies overwrite them.
    pub fn begin_step(&self) {
        let mut t = crate::runtime::sync::lock(&self.step);
        t.used = 0;
        t.seen.clear();
        t.retired.clear();
    }

    /// The device address of micro-batch `ub`'s table `name` holding `data` if this step
    /// uploaded it already.
    fn step_table(&self, name: &'static str, ub: u32, data: &[u8]) -> Option<u64> {
        let t = crate::runtime::sync::lock(&self.step);
        t.seen
            .iter()
            .find(|(n, u, bytes, _)| *n == name && *u == ub && bytes.as_slice() == data)
            .map(|&(_, _, _, ptr)| ptr)
    }

    /// Room for micro-batch `ub`'s table `name` holding `data` in the step tables' buffer (growing it as
    /// [`Workspace::take`] does; a replaced buffer's tables are not handed out again),
    /// remembered for the rest of the step.
    fn take_step_table(
        &self,
        stream: &Arc<CudaStream>,
        (name, ub): (&'static str, u32),
        data: &[u8],
    ) -> Result<u64, LaunchError> {
        let bytes = data.len().next_multiple_of(SCRATCH_ALIGN);
        let mut t = crate::runtime::sync::lock(&self.step);
        if t.used + bytes > t.size {
            let size = (2 * t.size).max(t.used + bytes).max(64 << 10);
            // Every table is written by its copy before a kernel reads it.
            let t = &mut *t;
            t.base = regrow(stream, &mut t.buffer, &mut t.retired, size)?;
            t.size = size;
            t.used = 0;
            t.seen.clear();
        }
        let ptr = t.base + t.used as u64;
        t.used += bytes;
        t.seen.push((name, ub, data.to_vec(), ptr));
        Ok(ptr)
    }

    /// Frees the buffers replaced during a recorded step, after its work was submitted.
    pub fn release_retired(&self) {
        crate::runtime::sync::lock(&self.inner).retired.clear();
    }

    /// Bytes the buffer holds, and how many times it grew.
    pub fn size(&self) -> (usize, usize) {
        let w = crate::runtime::sync::lock(&self.inner);
        (w.size, w.grown)
    }

    fn take(&self, stream: &Arc<CudaStream>, bytes: usize) -> Result<u64, LaunchError> {
        let bytes = bytes.next_multiple_of(SCRATCH_ALIGN);
        let mut w = crate::runtime::sync::lock(&self.inner);
        if w.used + bytes > w.size {
            let size = (2 * w.size).max(w.used + bytes).max(1 << 20);
            // Scratch is written by this stream's kernels before they read it.
            let w = &mut *w;
            w.base = regrow(stream, &mut w.buffer, &mut w.retired, size)?;
            w.size = size;
            w.used = 0;
            w.grown += 1;
        }
        let ptr = w.base + w.used as u64;
        w.used += bytes;
        let u = &mut w.usage;
        u.taken += bytes;
        if u.taken > u.peak {
            u.peak = u.taken;
            u.peak_task = u.task;
        }
        if u.bound.is_some_and(|b| u.taken > b) && !u.counted_over {
            u.counted_over = true;
            u.over += 1;
        }
        Ok(ptr)
    }
}

/// A scope of a [`Workspace`] ([`Workspace::scope`]): its pieces are free again when it
/// is dropped.
#[derive(Debug)]
pub struct ScratchScope<'a> {
    workspace: &'a Workspace,
    base: u64,
    used: usize,
    taken: usize,
}

impl Drop for ScratchScope<'_> {
    fn drop(&mut self) {
        let mut w = crate::runtime::sync::lock(&self.workspace.inner);
        if w.base == self.base && w.used >= self.used {
            w.used = self.used;
            w.usage.taken = self.taken;
        }
    }
}

/// Whether `MOEC_CUDA_POISON_SCRATCH` is set (read once): see [`StreamCx::scratch`].
fn poison_scratch() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var_os("MOEC_CUDA_POISON_SCRATCH").is_some())
}

/// Converts a size to a kernel's `int`.
pub fn int(what: &'static str, value: usize) -> Result<i32, LaunchError> {
    i32::try_from(value).map_err(|_| LaunchError::Range { what, value })
}

fn block_for(n: usize) -> u32 {
    n.clamp(32, 256).next_power_of_two().min(256) as u32
}

/// Rows up to which [`StreamCx::linear`] runs `linear_gemv` (kernels/linear_gemv.cu;
/// kernels/moe_tiles.cuh's `MOE_TILE_M`) instead of cuBLAS, and that kernel's warps per block (`MOE_GEMV_WARPS`).
pub const GEMV_MAX_ROWS: usize = 16;

/// Output features up to which `linear_gemv` is used: a layer's projections. A vocabulary
/// head (32k to 200k outputs) stays on cuBLAS: reading its tens of MB dwarfs the two extra
/// launches, and a warp per output there is a million emulated threads per call on the
/// stand-in, which would slow every CUDA test by minutes.
pub const GEMV_MAX_OUT: usize = 16_384;
const GEMV_WARPS: usize = 8;

/// One CUDA stream's resources.
#[derive(Debug)]
pub struct StreamCx<'a> {
    /// The device.
    pub device: &'a Device,
    /// The stream.
    pub stream: &'a Arc<CudaStream>,
    /// Its cuBLAS handle (bound to this stream).
    pub blas: &'a CudaBlas,
    /// Its scratch memory.
    pub workspace: &'a Workspace,
    /// The backend's step recorder (CUDA graphs): commands go there while a step is
    /// recorded, to the stream otherwise.
    pub recorder: &'a Recorder,
    /// This stream's index in the plan (its lane in the recorder).
    pub lane: usize,
}

impl StreamCx<'_> {
    /// Submits `command` on the stream, or records it when the step is recorded.
    pub fn issue(&self, command: Command) -> Result<(), LaunchError> {
        match self.recorder.record(self.lane, command) {
            Some(c) => c.submit(self.stream, Some(self.blas), &[]),
            None => Ok(()),
        }
    }

    /// Launches `entry` with `args` (in the kernel's order) on the stream.
    pub fn launch(
        &self,
        entry: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), LaunchError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let func = self
            .device
            .function(entry)
            .ok_or(LaunchError::NoEntry(entry))?;
        self.issue(Command::Launch {
            entry,
            func: func.clone(),
            grid,
            block,
            shared,
            args: args.to_vec(),
        })
    }

    /// A 1-D grid-stride launch over `n` elements.
    pub fn launch_1d(
        &self,
        entry: &'static str,
        n: usize,
        args: &[Arg],
    ) -> Result<(), LaunchError> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(256).min(4096) as u32;
        self.launch(entry, (blocks, 1, 1), 256, 0, args)
    }

    /// `bytes` of device scratch (uninitialised) from the stream's workspace, valid until
    /// the stream's next task. Under `MOEC_CUDA_POISON_SCRATCH` (a test mode) each piece is
    /// first filled with 0xFF bytes, an f32 NaN, so a kernel that reads scratch nothing of
    /// its task wrote (what `compute-sanitizer --tool initcheck` flags on a fresh buffer,
    /// but here on every piece, however often the workspace was reused) turns results into
    /// NaN instead of reading an earlier task's values.
    pub fn scratch(&self, bytes: usize) -> Result<Scratch, LaunchError> {
        if bytes == 0 {
            return Ok(Scratch { ptr: 0 });
        }
        let ptr = self.workspace.take(self.stream, bytes)?;
        if poison_scratch() {
            self.issue(Command::Poison { dst: ptr, bytes })?;
        }
        Ok(Scratch { ptr })
    }

    /// Scratch holding `data`, copied now from pageable memory (CUDA stages it before the
    /// call returns, so `data` may be dropped right after); in a recorded step, written
    /// to pinned staging now and copied by a recorded command (the same staging offsets
    /// every step, so a replayed graph reads this step's values).
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        data: &[T],
    ) -> Result<Scratch, LaunchError> {
        let bytes = std::mem::size_of_val(data);
        let s = self.scratch(bytes)?;
        if data.is_empty() {
            return Ok(s);
        }
        // SAFETY: `data` is `bytes` initialised bytes of plain values (DeviceRepr types).
        let raw = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), bytes) };
        if let Some(at) = self.recorder.stage(self.lane, raw)? {
            self.issue(Command::HtoD {
                dst: s.ptr,
                src: at,
                bytes,
            })?;
            return Ok(s);
        }
        // SAFETY: the scratch holds exactly `data`'s bytes.
        unsafe { cudarc::driver::result::memcpy_htod_async(s.ptr, data, self.stream.cu_stream()) }
            .map_err(|source| LaunchError::Driver {
                call: "cuMemcpyHtoDAsync",
                source,
            })?;
        Ok(s)
    }

    /// Device memory holding `data`, a table expected again with the same bytes (see
    /// [`ConstantTables`]): its cached copy when there is one, else copied now into a
    /// buffer of its own on this stream (before any later work of the stream, recorded or
    /// not, so every reader runs after the copy) and cached; past the cache's bound,
    /// [`StreamCx::upload`].
    pub fn upload_constant<T: cudarc::driver::DeviceRepr>(
        &self,
        data: &[T],
    ) -> Result<Scratch, LaunchError> {
        let bytes = std::mem::size_of_val(data);
        if bytes == 0 {
            return Ok(Scratch { ptr: 0 });
        }
        // SAFETY: `data` is `bytes` initialised bytes of plain values (DeviceRepr types).
        let raw = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), bytes) };
        let mut c = crate::runtime::sync::lock(&self.workspace.constants);
        if let Some(table) = c.tables.get(raw) {
            return Ok(Scratch {
                ptr: table.device_ptr(self.stream).0,
            });
        }
        if c.tables.len() >= MAX_CONSTANT_TABLES {
            drop(c);
            return self.upload(data);
        }
        let driver = |call| move |source| LaunchError::Driver { call, source };
        // SAFETY: written by the copy below before any kernel of the stream reads it.
        let table = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(driver("cuMemAllocAsync"))?;
        let ptr = table.device_ptr(self.stream).0;
        // SAFETY: the buffer holds exactly `data`'s bytes; a pageable source is staged by
        // the driver before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, raw, self.stream.cu_stream()) }
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        c.tables.insert(raw.to_vec(), table);
        Ok(Scratch { ptr })
    }

    /// The device address of `data` as micro-batch `ub`'s table `name` of this step
    /// (positions, block tables: what every layer of a step reads alike): uploaded as
    /// [`StreamCx::upload`] does at its first request in the step on this stream, and that
    /// copy afterwards while the bytes are the same (see [`Workspace::begin_step`]). Valid
    /// until the stream's next step.
    pub fn upload_step<T: cudarc::driver::DeviceRepr>(
        &self,
        name: &'static str,
        ub: u32,
        data: &[T],
    ) -> Result<u64, LaunchError> {
        let bytes = std::mem::size_of_val(data);
        if bytes == 0 {
            return Ok(0);
        }
        // SAFETY: `data` is `bytes` initialised bytes of plain values (DeviceRepr types).
        let raw = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), bytes) };
        if let Some(ptr) = self.workspace.step_table(name, ub, raw) {
            return Ok(ptr);
        }
        let ptr = self
            .workspace
            .take_step_table(self.stream, (name, ub), raw)?;
        if let Some(at) = self.recorder.stage(self.lane, raw)? {
            self.issue(Command::HtoD {
                dst: ptr,
                src: at,
                bytes,
            })?;
            return Ok(ptr);
        }
        // SAFETY: the table holds exactly `data`'s bytes.
        unsafe { cudarc::driver::result::memcpy_htod_async(ptr, data, self.stream.cu_stream()) }
            .map_err(|source| LaunchError::Driver {
                call: "cuMemcpyHtoDAsync",
                source,
            })?;
        Ok(ptr)
    }

    /// Copies `dst.len()` elements from device address `src` to the host and waits for
    /// them (and so for everything queued on the stream before). A host decision inside
    /// the step: a recorded step is flushed first and reported plain because of `why`.
    pub fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        src: u64,
        dst: &mut [T],
        why: &str,
    ) -> Result<(), LaunchError> {
        if dst.is_empty() {
            return Ok(());
        }
        self.recorder.flush(why)?;
        let driver = |call| move |source| LaunchError::Driver { call, source };
        // SAFETY: the caller passes an address holding `dst.len()` elements.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }

    /// `bytes` from device address `src` for the host after the step: in a recorded step a
    /// recorded copy into pinned staging, handed over as `then(address)` at the step's end
    /// (gives `None`); otherwise read now (gives the bytes).
    pub fn read_back(
        &self,
        src: u64,
        bytes: usize,
        then: impl FnOnce(usize) -> Deferred,
    ) -> Result<Option<Vec<u8>>, LaunchError> {
        if let Some(at) = self.recorder.read_back(self.lane, bytes, then)? {
            self.issue(Command::DtoH {
                dst: at,
                src,
                bytes,
            })?;
            return Ok(None);
        }
        let mut out = vec![0u8; bytes];
        self.download(src, &mut out, "")?;
        Ok(Some(out))
    }

    /// Copies `bytes` bytes from device address `src` to `dst` on the stream.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), LaunchError> {
        if bytes == 0 {
            return Ok(());
        }
        self.issue(Command::DtoD { dst, src, bytes })
    }

    /// Sets `bytes` bytes at `ptr` to zero on the stream.
    pub fn zero(&self, ptr: u64, bytes: usize) -> Result<(), LaunchError> {
        if bytes == 0 {
            return Ok(());
        }
        self.issue(Command::Zero { dst: ptr, bytes })
    }

    /// `y[n, out] (=|+=) x[n, in] · Wᵀ` with `y` rows `ldy` floats apart (a slice of a wider
    /// row, e.g. q, k or v of a qkv row). `accumulate` adds to `y` (a residual).
    pub fn linear(
        &self,
        x: u64,
        n: usize,
        w: &DevMatrix,
        y: u64,
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), LaunchError> {
        if n == 0 {
            return Ok(());
        }
        let (m, k) = (w.out_dim(), w.in_dim());
        if linear_kernel(w, n) == "q8_quantize + linear_gemv_q8" {
            if q8_folds(n, k, act_format(w.quant)) {
                return self.linear_q8_folded(x, k, w, y, ldy, accumulate);
            }
            let a = self.quantize_q8(x, k, n, k, act_format(w.quant), 0)?;
            return self.linear_q8(&a, w, y, ldy, accumulate);
        }
        let x = self.quant_activations(x, n, k, w.quant, 0)?;
        if linear_kernel(w, n) == "linear_gemv" {
            // A decode step's few rows: one launch reading the stored weights (or blocks)
            // once; one row of aligned 16-bit weights through its one-row form.
            let dtype = w.code();
            let staged =
                staged_rows(n, w.quant, dtype, &[w.ptr, x], k).map_err(LaunchError::Setting)?;
            let entry = if one_row_half(n, w.quant, dtype, &[w.ptr, x], k) {
                "linear_gemv_1"
            } else {
                match staged {
                    Some("_r4") => "linear_gemv_r4",
                    Some(_) => "linear_gemv_r16",
                    None => "linear_gemv",
                }
            };
            return self.launch(
                entry,
                (int("out", m.div_ceil(GEMV_WARPS))? as u32, 1, 1),
                (32 * GEMV_WARPS) as u32,
                0,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(w.ptr),
                    Arg::Ptr(y),
                    Arg::I32(int("n", n)?),
                    Arg::I32(int("in", k)?),
                    Arg::I32(int("out", m)?),
                    Arg::I32(dtype),
                    Arg::I32(int("ldy", ldy)?),
                    Arg::I32(i32::from(accumulate)),
                ],
            );
        }
        let (transa, lda) = match w.orientation {
            Orientation::OutIn => (true, w.cols),
            Orientation::InOut => (false, w.cols),
        };
        let (mi, ki, ldai) = (int("out", m)?, int("in", k)?, int("lda", lda)?);
        if w.quant.is_some() {
            return self.quant_gemm(x, n, w, y, ldy, accumulate);
        }
        match w.dtype {
            WeightDtype::Bf16 => {
                let elems = n * k;
                let pair = self.scratch(2 * elems * 2)?;
                self.launch_1d(
                    "split_bf16",
                    elems,
                    &[Arg::Ptr(x), Arg::Ptr(pair.ptr()), Arg::I64(elems as i64)],
                )?;
                let products = self.scratch(m * 2 * n * 4)?;
                // A is m x k bf16 (lda as stored), B the 2n columns of the pair (k bf16
                // each), C m x 2n f32 scratch.
                self.issue(Command::Gemm(Gemm {
                    bf16: true,
                    transa,
                    m: mi,
                    n: int("2n", 2 * n)?,
                    k: ki,
                    alpha: 1.0,
                    beta: 0.0,
                    a: (w.ptr, ldai),
                    b: (pair.ptr(), ki),
                    c: (products.ptr(), mi),
                }))?;
                self.launch(
                    "sum_halves",
                    (
                        int("n", n)? as u32,
                        m.div_ceil(block_for(m) as usize).min(1024) as u32,
                        1,
                    ),
                    block_for(m),
                    0,
                    &[
                        Arg::Ptr(products.ptr()),
                        Arg::Ptr(y),
                        Arg::I32(mi),
                        Arg::I32(int("n", n)?),
                        Arg::I32(int("ldy", ldy)?),
                        Arg::I32(accumulate as i32),
                    ],
                )
            }
            WeightDtype::F32 | WeightDtype::F16 => {
                let widened;
                let a = if w.dtype == WeightDtype::F16 {
                    let elems = w.rows * w.cols;
                    widened = self.scratch(elems * 4)?;
                    self.launch_1d(
                        "widen_f16",
                        elems,
                        &[
                            Arg::Ptr(w.ptr),
                            Arg::Ptr(widened.ptr()),
                            Arg::I64(elems as i64),
                        ],
                    )?;
                    widened.ptr()
                } else {
                    w.ptr
                };
                // A is m x k f32 (lda as stored), B is k x n f32 (x rows), C is y with
                // its row stride.
                self.issue(Command::Gemm(Gemm {
                    bf16: false,
                    transa,
                    m: mi,
                    n: int("n", n)?,
                    k: ki,
                    alpha: 1.0,
                    beta: if accumulate { 1.0 } else { 0.0 },
                    a: (a, ldai),
                    b: (x, ki),
                    c: (y, int("ldy", ldy)?),
                }))
            }
        }
    }
}

/// A threads-per-block for row kernels over `width` elements: a power of two in 32..=256.
pub fn row_block(width: usize) -> u32 {
    block_for(width)
}
