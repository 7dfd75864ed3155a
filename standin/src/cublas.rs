//! The cuBLAS entry points (`cublas*`): GEMMs as plain reference loops on a stream.
//!
//! Takes column-major GEMMs as cuBLAS defines them (`C = alpha * op(A) op(B) + beta * C`,
//! `op` = none or transpose, leading dimensions, optional strided batches) in f32, f16 or
//! bf16 storage with f32 compute; alpha and beta in host memory (the default pointer mode).
//! Gives the result on the handle's stream, in submission order with the stream's other
//! work. Each output element is `sum over l = 0..k` in ascending order, f32 multiply then
//! f32 add (no fused multiply-add), widened from the storage type exactly and rounded to
//! the output type to nearest even; with beta = 0, C is not read (so NaN poison in a fresh
//! buffer does not leak in), as BLAS specifies. Guarantees: operands outside live device
//! allocations, inconsistent leading dimensions and unsupported types are refused with
//! `CUBLAS_STATUS_INVALID_VALUE` / `_NOT_SUPPORTED` and a log line.

use crate::memory;
use crate::stream;
use crate::{guard, lock, log, Handles};
use half::{bf16, f16};
use std::ffi::{c_int, c_longlong, c_void};
use std::sync::{Arc, Mutex};

const SUCCESS: c_int = 0;
const NOT_INITIALIZED: c_int = 1;
const INVALID_VALUE: c_int = 7;
const EXECUTION_FAILED: c_int = 13;
const INTERNAL_ERROR: c_int = 14;
const NOT_SUPPORTED: c_int = 15;

/// cudaDataType values.
const R_32F: c_int = 0;
const R_16F: c_int = 2;
const R_16BF: c_int = 14;

struct Blas {
    stream: Mutex<usize>,
}

static HANDLES: Handles<Blas> = Handles::new(0xb000_0000);

fn run(call: &str, body: impl FnOnce() -> Result<(), c_int>) -> c_int {
    guard(call, INTERNAL_ERROR, || match body() {
        Ok(()) => SUCCESS,
        Err(e) => e,
    })
}

fn blas(handle: *mut c_void, call: &str) -> Result<Arc<Blas>, c_int> {
    HANDLES.get(handle as usize).ok_or_else(|| {
        log(&format!(
            "{call} refused: unknown or destroyed cuBLAS handle {:#x}",
            handle as usize
        ));
        NOT_INITIALIZED
    })
}

#[no_mangle]
unsafe extern "C" fn cublasCreate_v2(out: *mut *mut c_void) -> c_int {
    run("cublasCreate_v2", || {
        if out.is_null() {
            return Err(INVALID_VALUE);
        }
        let handle = HANDLES.insert(Arc::new(Blas {
            stream: Mutex::new(0),
        }));
        // SAFETY: non-null, points at the caller's handle slot.
        unsafe { out.write(handle as *mut c_void) };
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cublasDestroy_v2(handle: *mut c_void) -> c_int {
    run("cublasDestroy_v2", || {
        HANDLES
            .remove(handle as usize)
            .map(drop)
            .ok_or(NOT_INITIALIZED)
    })
}

#[no_mangle]
extern "C" fn cublasSetStream_v2(handle: *mut c_void, stream_handle: *mut c_void) -> c_int {
    run("cublasSetStream_v2", || {
        let blas = blas(handle, "cublasSetStream_v2")?;
        stream::resolve(stream_handle as usize, "cublasSetStream_v2").map_err(|_| INVALID_VALUE)?;
        *lock(&blas.stream) = stream_handle as usize;
        Ok(())
    })
}

#[no_mangle]
unsafe extern "C" fn cublasGetStream_v2(handle: *mut c_void, out: *mut *mut c_void) -> c_int {
    run("cublasGetStream_v2", || {
        let blas = blas(handle, "cublasGetStream_v2")?;
        if out.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: non-null, points at the caller's stream slot.
        unsafe { out.write(*lock(&blas.stream) as *mut c_void) };
        Ok(())
    })
}

#[no_mangle]
unsafe extern "C" fn cublasGetVersion_v2(handle: *mut c_void, version: *mut c_int) -> c_int {
    run("cublasGetVersion_v2", || {
        blas(handle, "cublasGetVersion_v2")?;
        if version.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: non-null, points at the caller's integer.
        unsafe { version.write(120_800) };
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cublasSetPointerMode_v2(handle: *mut c_void, mode: c_int) -> c_int {
    run("cublasSetPointerMode_v2", || {
        blas(handle, "cublasSetPointerMode_v2")?;
        if mode != 0 {
            log("cublasSetPointerMode_v2 refused: only host pointer mode is supported by the stand-in");
            return Err(NOT_SUPPORTED);
        }
        Ok(())
    })
}

#[no_mangle]
unsafe extern "C" fn cublasGetPointerMode_v2(handle: *mut c_void, mode: *mut c_int) -> c_int {
    run("cublasGetPointerMode_v2", || {
        blas(handle, "cublasGetPointerMode_v2")?;
        if mode.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: non-null, points at the caller's integer.
        unsafe { mode.write(0) };
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cublasSetMathMode(handle: *mut c_void, _mode: c_int) -> c_int {
    // Math modes only allow faster, less exact GPU paths; the reference loop ignores them.
    run("cublasSetMathMode", || {
        blas(handle, "cublasSetMathMode").map(drop)
    })
}

/// One operand of a GEMM.
#[derive(Clone, Copy)]
struct Operand {
    ptr: usize,
    dtype: c_int,
    ld: usize,
    stride: usize,
}

impl Operand {
    fn size(&self) -> usize {
        match self.dtype {
            R_32F => 4,
            _ => 2,
        }
    }

    /// Element `index` (in elements) of batch `batch`, widened to f32.
    ///
    /// # Safety
    /// The element must lie inside the operand's checked range.
    unsafe fn get(&self, batch: usize, index: usize) -> f32 {
        let at = self.ptr + (batch * self.stride + index) * self.size();
        // SAFETY: the caller's contract; reads are unaligned-tolerant.
        unsafe {
            match self.dtype {
                R_32F => (at as *const f32).read_unaligned(),
                R_16F => f16::from_bits((at as *const u16).read_unaligned()).to_f32(),
                _ => bf16::from_bits((at as *const u16).read_unaligned()).to_f32(),
            }
        }
    }

    /// Element `src(o, i)` of batch `batch`, widened to f32, into `out[dst(o, i)]` for
    /// `o < outer`, `i < inner`, `i` the inner loop: callers make `src` contiguous in `i`,
    /// so the reads stream (a strided read of a weight matrix missed the cache on every
    /// element). One match on the type for the whole operand.
    ///
    /// # Safety
    /// Every `src(o, i)` must lie inside the operand's checked range.
    unsafe fn widen(
        &self,
        batch: usize,
        (outer, inner): (usize, usize),
        src: impl Fn(usize, usize) -> usize,
        dst: impl Fn(usize, usize) -> usize,
        out: &mut [f32],
    ) {
        let base = self.ptr + batch * self.stride * self.size();
        let each = |read: &dyn Fn(usize) -> f32, out: &mut [f32]| {
            for o in 0..outer {
                for i in 0..inner {
                    out[dst(o, i)] = read(src(o, i));
                }
            }
        };
        // SAFETY (each read): the caller's contract; reads are unaligned-tolerant.
        match self.dtype {
            R_32F => each(
                &|i| unsafe { (base as *const f32).add(i).read_unaligned() },
                out,
            ),
            R_16F => each(
                &|i| unsafe {
                    f16::from_bits((base as *const u16).add(i).read_unaligned()).to_f32()
                },
                out,
            ),
            _ => each(
                &|i| unsafe {
                    bf16::from_bits((base as *const u16).add(i).read_unaligned()).to_f32()
                },
                out,
            ),
        }
    }

    /// Stores `value` rounded to the operand's type.
    ///
    /// # Safety
    /// The element must lie inside the operand's checked range.
    unsafe fn set(&self, batch: usize, index: usize, value: f32) {
        let at = self.ptr + (batch * self.stride + index) * self.size();
        // SAFETY: the caller's contract.
        unsafe {
            match self.dtype {
                R_32F => (at as *mut f32).write_unaligned(value),
                R_16F => (at as *mut u16).write_unaligned(f16::from_f32(value).to_bits()),
                _ => (at as *mut u16).write_unaligned(bf16::from_f32(value).to_bits()),
            }
        }
    }
}

/// A checked GEMM, ready to run on a stream.
struct Gemm {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    beta: f32,
    a: Operand,
    b: Operand,
    c: Operand,
    batches: usize,
}

impl Gemm {
    /// C = alpha * op(A) op(B) + beta * C, each dot product summed in order over `l` as a
    /// plain loop would. Each batch's operands are widened to f32 once: op(B) by columns,
    /// op(A) in panels of eight rows with the eight rows' `l`-th elements side by side, so
    /// the dot products of a panel with a column of op(B) run as one eight-wide sum per
    /// `l`, each lane still its own serial sum (one sum at a time waited on every addition:
    /// a tenth of a stand-in run's CPU).
    fn run(&self) {
        const ROWS: usize = 8;
        let (m, n, k) = (self.m, self.n, self.k);
        let panels = m.div_ceil(ROWS);
        // Rows past `m` in the last panel stay zero and are never stored.
        let mut a = vec![0.0f32; panels * ROWS * k];
        let mut b = vec![0.0f32; n * k];
        let (lda, ldb) = (self.a.ld, self.b.ld);
        let panel_at = |i: usize, l: usize| (i / ROWS) * ROWS * k + l * ROWS + i % ROWS;
        for batch in 0..self.batches {
            // a[panel_at(i, l)] = op(A)[i, l]; b[j * k + l] = op(B)[l, j]; reads in storage
            // order.
            // SAFETY: every index is inside the operand ranges checked in `check`.
            unsafe {
                if self.trans_a {
                    self.a
                        .widen(batch, (m, k), |i, l| l + i * lda, panel_at, &mut a);
                } else {
                    let dst = |l, i| panel_at(i, l);
                    self.a.widen(batch, (k, m), |l, i| i + l * lda, dst, &mut a);
                }
                if self.trans_b {
                    let (src, dst) = (|l, j| j + l * ldb, |l, j| j * k + l);
                    self.b.widen(batch, (k, n), src, dst, &mut b);
                } else {
                    let (src, dst) = (|j, l| l + j * ldb, |j, l| j * k + l);
                    self.b.widen(batch, (n, k), src, dst, &mut b);
                }
            }
            for j in 0..n {
                let column = &b[j * k..(j + 1) * k];
                for p in 0..panels {
                    let panel = &a[p * ROWS * k..(p + 1) * ROWS * k];
                    let mut sums = [0.0f32; ROWS];
                    for (&y, xs) in column.iter().zip(panel.chunks_exact(ROWS)) {
                        for (sum, &x) in sums.iter_mut().zip(xs) {
                            *sum += x * y;
                        }
                    }
                    let rows = ROWS.min(m - p * ROWS);
                    for (r, &sum) in sums.iter().enumerate().take(rows) {
                        let at = p * ROWS + r + j * self.c.ld;
                        let mut value = self.alpha * sum;
                        if self.beta != 0.0 {
                            // SAFETY: as above.
                            value += self.beta * unsafe { self.c.get(batch, at) };
                        }
                        // SAFETY: as above.
                        unsafe { self.c.set(batch, at, value) };
                    }
                }
            }
        }
    }
}

fn operation(op: c_int, call: &str) -> Result<bool, c_int> {
    match op {
        0 => Ok(false),
        1 | 2 => Ok(true), // transpose; conjugate transpose is the same for real types
        _ => {
            log(&format!("{call} refused: unknown operation {op}"));
            Err(INVALID_VALUE)
        }
    }
}

/// Validates shapes, leading dimensions and device ranges, and reads alpha/beta.
#[allow(clippy::too_many_arguments)]
unsafe fn check(
    call: &str,
    (ta, tb): (c_int, c_int),
    (m, n, k): (c_int, c_int, c_int),
    alpha: *const f32,
    beta: *const f32,
    operands: [(usize, c_int, c_int, c_longlong); 3],
    batches: c_int,
) -> Result<Gemm, c_int> {
    let trans_a = operation(ta, call)?;
    let trans_b = operation(tb, call)?;
    let dims = [m, n, k, batches].map(usize::try_from);
    let [Ok(m), Ok(n), Ok(k), Ok(batches)] = dims else {
        log(&format!("{call} refused: negative m/n/k/batch count"));
        return Err(INVALID_VALUE);
    };
    if alpha.is_null() || beta.is_null() {
        log(&format!("{call} refused: null alpha or beta"));
        return Err(INVALID_VALUE);
    }
    // SAFETY: host pointer mode: alpha and beta are host values read at call time.
    let (alpha, beta) = unsafe { (alpha.read(), beta.read()) };
    // (rows, cols) of each stored operand.
    let shapes = [
        if trans_a { (k, m) } else { (m, k) },
        if trans_b { (n, k) } else { (k, n) },
        (m, n),
    ];
    let mut checked = Vec::with_capacity(3);
    for (name, ((ptr, dtype, ld, stride), (rows, cols))) in
        ["A", "B", "C"].iter().zip(operands.into_iter().zip(shapes))
    {
        let (Ok(ld), Ok(stride)) = (usize::try_from(ld), usize::try_from(stride)) else {
            log(&format!(
                "{call} refused: negative leading dimension or stride of {name}"
            ));
            return Err(INVALID_VALUE);
        };
        if ld < rows.max(1) {
            log(&format!(
                "{call} refused: leading dimension of {name} is {ld}, below its {rows} rows"
            ));
            return Err(INVALID_VALUE);
        }
        let operand = Operand {
            ptr,
            dtype,
            ld,
            stride,
        };
        if rows > 0 && cols > 0 && batches > 0 {
            let span = (batches - 1) * stride + ld * (cols - 1) + rows;
            memory::check_device(ptr, span * operand.size(), call, &format!("operand {name}"))
                .map_err(|_| INVALID_VALUE)?;
        }
        checked.push(operand);
    }
    Ok(Gemm {
        trans_a,
        trans_b,
        m,
        n,
        k,
        alpha,
        beta,
        a: checked[0],
        b: checked[1],
        c: checked[2],
        batches,
    })
}

fn check_types(call: &str, a: c_int, b: c_int, c: c_int, compute: c_int) -> Result<(), c_int> {
    let storage = [R_32F, R_16F, R_16BF];
    // CUBLAS_COMPUTE_32F and its _FAST_ variants, or the legacy CUDA_R_32F compute type.
    let f32_compute = [68, 74, 75, 77, R_32F];
    if a != b || !storage.contains(&a) || !(c == a || c == R_32F) || !f32_compute.contains(&compute)
    {
        log(&format!(
            "{call} refused: types A={a} B={b} C={c} compute={compute} are not supported \
             (f32/f16/bf16 storage with f32 compute)"
        ));
        return Err(NOT_SUPPORTED);
    }
    Ok(())
}

fn enqueue(handle: *mut c_void, call: &str, gemm: Gemm) -> Result<(), c_int> {
    let blas = blas(handle, call)?;
    let stream_handle = *lock(&blas.stream);
    if gemm.m == 0 || gemm.n == 0 || gemm.batches == 0 {
        return Ok(());
    }
    stream::submit(stream_handle, call, Arc::new(move || gemm.run()))
        .map_err(|_| EXECUTION_FAILED)?;
    Ok(())
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn cublasSgemm_v2(
    handle: *mut c_void,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> c_int {
    // SAFETY: cuBLAS's contract for the pointers; `check` validates the device ranges.
    unsafe {
        cublasSgemmStridedBatched(
            handle, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1,
        )
    }
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn cublasSgemmStridedBatched(
    handle: *mut c_void,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    stride_a: c_longlong,
    b: *const f32,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
    stride_c: c_longlong,
    batches: c_int,
) -> c_int {
    run("cublasSgemm", || {
        // SAFETY: cuBLAS's contract: alpha/beta are host values; ranges are checked.
        let gemm = unsafe {
            check(
                "cublasSgemm",
                (ta, tb),
                (m, n, k),
                alpha,
                beta,
                [
                    (a as usize, R_32F, lda, stride_a),
                    (b as usize, R_32F, ldb, stride_b),
                    (c as usize, R_32F, ldc, stride_c),
                ],
                batches,
            )?
        };
        enqueue(handle, "cublasSgemm", gemm)
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn cublasGemmEx(
    handle: *mut c_void,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    compute: c_int,
    algo: c_int,
) -> c_int {
    // SAFETY: cuBLAS's contract, forwarded.
    unsafe {
        cublasGemmStridedBatchedEx(
            handle, ta, tb, m, n, k, alpha, a, a_type, lda, 0, b, b_type, ldb, 0, beta, c, c_type,
            ldc, 0, 1, compute, algo,
        )
    }
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn cublasGemmStridedBatchedEx(
    handle: *mut c_void,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    stride_a: c_longlong,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    stride_b: c_longlong,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    stride_c: c_longlong,
    batches: c_int,
    compute: c_int,
    _algo: c_int,
) -> c_int {
    run("cublasGemmEx", || {
        check_types("cublasGemmEx", a_type, b_type, c_type, compute)?;
        // SAFETY: f32 compute: alpha/beta are host f32 values; ranges are checked.
        let gemm = unsafe {
            check(
                "cublasGemmEx",
                (ta, tb),
                (m, n, k),
                alpha.cast::<f32>(),
                beta.cast::<f32>(),
                [
                    (a as usize, a_type, lda, stride_a),
                    (b as usize, b_type, ldb, stride_b),
                    (c as usize, c_type, ldc, stride_c),
                ],
                batches,
            )?
        };
        enqueue(handle, "cublasGemmEx", gemm)
    })
}
