//! First-use costs taken at load instead of inside the first prefill (issue 44, first
//! H200 call of 2026-11-30: `pre_attn` of layer 0 took 68.5 ms of a batch-16 prefill
//! against 0.11-0.16 ms in layers 1-7, `gate` of layer 0 4.2 ms against 0.035 ms).
//!
//! Takes the backend's device streams and their cuBLAS handles and the model's widths;
//! gives a [`WarmUp`]: the GEMMs run (one per shape class and element type on each
//! compute stream's handle) and the seconds they took, which the run report's backend
//! line prints as set-up time. Why GEMMs only: moec's own kernels are loaded when the
//! backend opens (`Device::open` asks the driver for every entry point, and under CUDA
//! 12+'s default lazy loading `cuModuleGetFunction` is what loads a kernel), while
//! cuBLAS initialises itself and loads each of its kernels on its first GEMM, and picks
//! kernels by shape, so the classes here are the products a prefill issues through it
//! (hidden x hidden projections, the router's few outputs, the experts' wider ones) at a
//! prefill's row count. The warm-up writes only its own scratch, freed before the run
//! starts. `MOEC_CUDA_WARMUP=off` skips it (an A/B on a device: the report says so).

use crate::ir::Engine;
use crate::lower::ExecPlan;
use crate::model::arch::ArchSpec;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaStream, DevicePtr};
use std::sync::Arc;

/// What the warm-up did at load.
#[derive(Debug, Clone, PartialEq)]
pub enum WarmUp {
    /// Skipped: `MOEC_CUDA_WARMUP=off`.
    Off,
    /// `gemms` cuBLAS GEMMs over `classes` shape classes on `handles` handles took
    /// `seconds` (the streams synchronised at the end).
    Ran {
        /// GEMMs issued.
        gemms: usize,
        /// Shape classes, `m x k` of A (each at `rows` columns of B, bf16 and f32).
        classes: Vec<(usize, usize)>,
        /// Columns of B (rows of activations) each GEMM had.
        rows: usize,
        /// cuBLAS handles warmed (one per compute stream).
        handles: usize,
        /// Wall seconds, synchronised.
        seconds: f64,
    },
    /// A call failed: nothing is wrong with the run (its GEMMs will pay the first use
    /// themselves), and the report says why.
    Failed(String),
}

impl WarmUp {
    /// One clause of the backend line.
    pub fn describe(&self) -> String {
        match self {
            WarmUp::Off => "first-use warm-up at load: none (MOEC_CUDA_WARMUP=off)".into(),
            WarmUp::Ran {
                gemms,
                classes,
                rows,
                handles,
                seconds,
            } => format!(
                "first-use warm-up at load (set-up time, not prefill): {gemms} cuBLAS GEMMs \
                 (bf16 pair and f32, A transposed, shapes {} at {rows} rows) on {handles} \
                 handles in {:.1} ms",
                classes
                    .iter()
                    .map(|(m, k)| format!("{m}x{k}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                seconds * 1e3
            ),
            WarmUp::Failed(why) => format!("first-use warm-up at load failed ({why})"),
        }
    }
}

/// Whether the warm-up is switched off (`MOEC_CUDA_WARMUP=off`).
fn switched_off() -> bool {
    std::env::var("MOEC_CUDA_WARMUP").as_deref() == Ok("off")
}

/// Elements of A past which a class is narrowed (its `m` cut), so the scratch stays small
/// on a full-size model (Mixtral-8x7B's 14336 x 4096 experts would be 235 MB of f32):
/// 8 M elements, 32 MB of f32. A narrower `m` can pick another cuBLAS kernel than the
/// full product, which then loads on its first use; the library's own start-up, the
/// larger cost, is paid either way.
const MAX_A_ELEMS: usize = 8 << 20;

/// The shape classes (m, k) of A for a model of residual width `hidden`, expert width
/// `ffn` and `experts` experts: square projections, the router, an expert's up and down.
fn classes(hidden: usize, ffn: usize, experts: usize) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (m, k) in [
        (hidden, hidden),
        (experts, hidden),
        (ffn, hidden),
        (hidden, ffn),
    ] {
        let (m, k) = (m.max(1), k.max(1));
        let m = m.min((MAX_A_ELEMS / k).max(1));
        if !out.contains(&(m, k)) {
            out.push((m, k));
        }
    }
    out
}

/// The warm-up of a plan's run: on the cuBLAS handles of its `gpu.compute` streams
/// (`handles`, one per plan stream, `None` for host streams), at the rows of its first
/// prefill (a micro-batch's sequences x the workload's prompt, or a mixed step's tokens).
pub fn for_plan<'a>(
    plan: &ExecPlan,
    arch: &ArchSpec,
    handles: impl Iterator<Item = Option<(&'a Arc<CudaStream>, &'a Arc<CudaBlas>)>>,
) -> WarmUp {
    let compute: Vec<_> = plan
        .streams
        .iter()
        .zip(handles)
        .filter(|(s, _)| s.engine == Engine::GpuCompute)
        .filter_map(|(_, h)| h.map(|(s, b)| (Arc::clone(s), Arc::clone(b))))
        .collect();
    let ub = &plan.micro_batches;
    let rows = (ub.size.max(1) * plan.workload.prompt_len.max(1)).max(ub.mixed_tokens);
    warm_up(
        &compute,
        (arch.hidden, arch.ffn, arch.experts),
        usize::try_from(rows).unwrap_or(usize::MAX),
    )
}

/// Runs the warm-up on `handles` (a compute stream and its cuBLAS handle each) for a
/// model of the given widths at `rows` activation rows (a prefill's micro-batch, at most
/// 512: the kernel classes cuBLAS picks stop changing well before that). The stand-in
/// driver runs the same calls (33.5 ms at mixtral-tiny's 128 rows since its GEMM widens
/// each operand once), so CI exercises the path a GPU takes.
pub fn warm_up(
    handles: &[(Arc<CudaStream>, Arc<CudaBlas>)],
    (hidden, ffn, experts): (usize, usize, usize),
    rows: usize,
) -> WarmUp {
    if switched_off() {
        return WarmUp::Off;
    }
    let began = std::time::Instant::now();
    let classes = classes(hidden, ffn, experts);
    let rows = rows.clamp(1, 512);
    match run(handles, &classes, rows) {
        Ok(gemms) => WarmUp::Ran {
            gemms,
            classes,
            rows,
            handles: handles.len(),
            seconds: began.elapsed().as_secs_f64(),
        },
        Err(why) => WarmUp::Failed(why),
    }
}

fn run(
    handles: &[(Arc<CudaStream>, Arc<CudaBlas>)],
    classes: &[(usize, usize)],
    rows: usize,
) -> Result<usize, String> {
    let Some((first, _)) = handles.first() else {
        return Ok(0);
    };
    // One scratch for every GEMM, sized for the largest: A (f32, or bf16 in its first
    // half), B (2 x rows columns of bf16 pairs, or rows of f32), C (m x 2 rows of f32).
    let (max_m, max_k) = classes
        .iter()
        .fold((1, 1), |(m, k), &(cm, ck)| (m.max(cm), k.max(ck)));
    let a_len = classes.iter().map(|&(m, k)| m * k).max().unwrap_or(1);
    let b_len = max_k * 2 * rows;
    let c_len = max_m * 2 * rows;
    let zeros = |n: usize| {
        first
            .alloc_zeros::<f32>(n)
            .map_err(|e| format!("allocating warm-up scratch: {e}"))
    };
    let (a, b, c) = (zeros(a_len)?, zeros(b_len)?, zeros(c_len)?);
    let (pa, pb, pc) = (
        a.device_ptr(first).0,
        b.device_ptr(first).0,
        c.device_ptr(first).0,
    );
    // The scratch is zeroed on `first`: the other streams wait for it.
    first
        .synchronize()
        .map_err(|e| format!("synchronising: {e}"))?;
    let mut gemms = 0;
    for (_, handle) in handles {
        let h = *handle.handle();
        for &(m, k) in classes {
            let (mi, ki) = (as_i32(m)?, as_i32(k)?);
            let (alpha, beta) = (1.0f32, 0.0f32);
            // bf16 weights (A transposed, as moec stores [out, in]) times a bf16 pair
            // (2 x rows columns) into f32, as `StreamCx::linear` issues it.
            // SAFETY: A holds m x k bf16 (lda k) inside the f32 scratch of at least m x k
            // elements, B k x 2rows bf16 (ldb k) inside b_len f32, C m x 2rows f32 (ldc
            // m) inside c_len; scalars are host f32 as CUBLAS_COMPUTE_32F requires; the
            // scratch lives until the streams are synchronised below.
            unsafe {
                blas::gemm_ex(
                    h,
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    mi,
                    as_i32(2 * rows)?,
                    ki,
                    (&alpha as *const f32).cast(),
                    pa as *const std::ffi::c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    ki,
                    pb as *const std::ffi::c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    ki,
                    (&beta as *const f32).cast(),
                    pc as *mut std::ffi::c_void,
                    cudaDataType_t::CUDA_R_32F,
                    mi,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| format!("cublasGemmEx: {e:?}"))?;
            // f32 throughout (dequantised or f16-widened weights, `quant_gemm`).
            // SAFETY: A m x k f32 (lda k), B k x rows f32 (ldb k), C m x rows f32 (ldc
            // m), all inside the scratch as above.
            unsafe {
                blas::sgemm(
                    h,
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    mi,
                    as_i32(rows)?,
                    ki,
                    &alpha,
                    pa as *const f32,
                    ki,
                    pb as *const f32,
                    ki,
                    &beta,
                    pc as *mut f32,
                    mi,
                )
            }
            .map_err(|e| format!("cublasSgemm: {e:?}"))?;
            gemms += 2;
        }
    }
    for (stream, _) in handles {
        stream
            .synchronize()
            .map_err(|e| format!("synchronising: {e}"))?;
    }
    drop((a, b, c));
    first
        .synchronize()
        .map_err(|e| format!("synchronising: {e}"))?;
    Ok(gemms)
}

fn as_i32(n: usize) -> Result<i32, String> {
    i32::try_from(n).map_err(|_| format!("{n} does not fit a GEMM dimension"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_the_prefill_products_and_stay_small() {
        // mixtral-mid: hidden 1024, ffn 3584, 8 experts.
        assert_eq!(
            classes(1024, 3584, 8),
            vec![(1024, 1024), (8, 1024), (3584, 1024), (1024, 3584)]
        );
        // Mixtral-8x7B: classes past 8 M elements of A are narrowed (4096 x 4096 and the
        // experts' 14336 x 4096 both to 2048 x 4096, kept once).
        let big = classes(4096, 14336, 8);
        assert!(big.iter().all(|&(m, k)| m * k <= MAX_A_ELEMS), "{big:?}");
        assert_eq!(big, vec![(2048, 4096), (8, 4096), (585, 14336)]);
    }
}
