//! The stand-in driver (standin/, a test tool): the CUDA path through cudarc with no GPU,
//! and the helpers every stand-in test uses.
//!
//! Each test re-runs this test binary as a child process with a private directory of
//! symlinks to libmoec_standin.so (named as cudarc's loader looks for the driver, cuBLAS
//! and NVRTC) first on LD_LIBRARY_PATH; the child (STANDIN_CHILD names which test) calls
//! cudarc exactly as the backend would and checks the results. The loader path is read at
//! process start, hence the child. Tests here: streams and events, cuBLAS, refusals, a
//! kernel overrun; the kernels themselves are in standin_kernels.rs.

use cudarc::driver::sys::{self as cu, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;
use moec::runtime::cuda::kernels::{compile_all, DEFAULT_ARCH, KERNELS};
use std::sync::Arc;

pub(crate) use crate::standin_common::in_standin_child;

/// Runs test `name` of this binary in a child whose CUDA libraries are the stand-in
/// (`standin_common::standin_child`).
pub(crate) fn standin_child(name: &str) -> std::process::Output {
    crate::standin_common::standin_child(name, &[])
}

/// Runs test `name` under the stand-in (see [`standin_child`]) and returns the child's
/// stderr after asserting it passed.
pub(crate) fn run_under_standin(name: &str) -> String {
    let out = standin_child(name);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}");
    assert!(
        out.status.success(),
        "the child test {name} failed under the stand-in"
    );
    assert!(stdout.contains("1 passed"), "the child did not run {name}");
    stderr.into_owned()
}

/// Runs test `name` under the stand-in and returns its exit status and stderr (for tests
/// whose child must die).
pub(crate) fn run_under_standin_status(name: &str) -> (std::process::ExitStatus, String) {
    let out = standin_child(name);
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts the child's stderr holds each of `lines` (the stand-in's refusal messages).
pub(crate) fn assert_logged(stderr: &str, lines: &[&str]) {
    for line in lines {
        assert!(stderr.contains(line), "no log line `{line}` in:\n{stderr}");
    }
}

/// xorshift64*: reproducible test data without a dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    pub(crate) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub(crate) fn standin_context() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = CudaContext::new(0).expect("stand-in context");
    // SAFETY: called before any allocation, as cudarc requires; the backend runs with event
    // tracking off and orders streams with its own events.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("stream");
    (ctx, stream)
}

pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// Loads every kernel file compiled by the (stand-in) NVRTC; by file name.
pub(crate) fn load_kernels(
    ctx: &Arc<CudaContext>,
) -> Vec<(&'static str, Arc<cudarc::driver::CudaModule>)> {
    compile_all(DEFAULT_ARCH)
        .expect("stand-in NVRTC compiles every kernel")
        .into_iter()
        .map(|(file, ptx)| {
            let text = ptx.to_src();
            assert!(text.contains(&format!(".target {DEFAULT_ARCH}")), "{file}");
            (file, ctx.load_module(ptx).expect("module loads"))
        })
        .collect()
}

pub(crate) fn function(
    modules: &[(&'static str, Arc<cudarc::driver::CudaModule>)],
    file: &str,
    name: &str,
) -> cudarc::driver::CudaFunction {
    let module = &modules
        .iter()
        .find(|(f, _)| *f == file)
        .expect("kernel file")
        .1;
    module.load_function(name).expect("kernel entry")
}

/// Entry point `name` from whichever kernel file defines it (its [`KERNELS`] row), so a
/// test names the kernel, not the file it lives in.
pub(crate) fn kernel_entry(
    modules: &[(&'static str, Arc<cudarc::driver::CudaModule>)],
    name: &str,
) -> cudarc::driver::CudaFunction {
    let file = KERNELS
        .iter()
        .find(|k| k.entries.contains(&name))
        .unwrap_or_else(|| panic!("no kernel file defines {name}"))
        .file;
    function(modules, file, name)
}

/// Blocks a stream until the test sends on the channel (a host-held gate: the only way to
/// make one stream's work certainly wait while another stream's runs).
unsafe extern "C" fn wait_for_release(data: *mut std::ffi::c_void) {
    // SAFETY: `gate` passed ownership of a boxed receiver; this callback runs once.
    let receiver = unsafe { Box::from_raw(data.cast::<std::sync::mpsc::Receiver<()>>()) };
    let _ = receiver.recv();
}

/// Holds `stream` at this point until the returned sender is used (or dropped).
pub(crate) fn gate(stream: &CudaStream) -> std::sync::mpsc::Sender<()> {
    let (release, receiver) = std::sync::mpsc::channel::<()>();
    let data = Box::into_raw(Box::new(receiver));
    // SAFETY: the callback takes ownership of `data` and makes no CUDA calls.
    unsafe {
        cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            wait_for_release,
            data.cast(),
        )
    }
    .expect("cuLaunchHostFunc");
    release
}

/// Two streams ordered by an event give the right result; without the event the consumer
/// runs while the producer is still held, and reads the input instead of the result (a
/// race the stand-in shows every time, never hides by luck). Also the event rules:
/// pending events are NOT_READY, elapsed time needs timing events that were recorded.
#[test]
fn streams_run_concurrently_and_events_order_them() {
    const NAME: &str = "standin::streams_run_concurrently_and_events_order_them";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let (ctx, producer) = standin_context();
    let consumer = ctx.new_stream().expect("stream");
    let modules = load_kernels(&ctx);
    let swiglu = function(&modules, "swiglu.cu", "swiglu");
    let g: Vec<f32> = (0..64).map(|i| i as f32 / 8.0 - 4.0).collect();
    let u = vec![2.0f32; 64];
    let want: Vec<f32> = g.iter().map(|&x| x / (1.0 + (-x).exp()) * 2.0).collect();
    let n = 64i32;
    let run = |with_event: bool| -> Vec<f32> {
        let mut g_dev = producer.clone_htod(&g).expect("htod");
        let u_dev = producer.clone_htod(&u).expect("htod");
        producer.synchronize().expect("sync");
        let release = gate(&producer);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            producer
                .launch_builder(&swiglu)
                .arg(&mut g_dev)
                .arg(&u_dev)
                .arg(&n)
                .launch(cfg((1, 1, 1), 64, 0))
        }
        .expect("launch");
        let done = ctx
            .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event");
        done.record(&producer).expect("record");
        assert!(!done.is_complete(), "the producer is held");
        let got = if with_event {
            consumer.wait(&done).expect("wait");
            release.send(()).expect("release");
            consumer.clone_dtoh(&g_dev).expect("dtoh")
        } else {
            // The pageable read-back returns when the consumer stream did it: before the
            // producer, still held, ran the kernel.
            let got = consumer.clone_dtoh(&g_dev).expect("dtoh");
            release.send(()).expect("release");
            got
        };
        producer.synchronize().expect("sync");
        got
    };
    assert_eq!(run(true), want, "ordered by the event: the kernel's result");
    let raced = run(false);
    assert_eq!(raced, g, "without the event the consumer read the input");
    println!(
        "without the event the consumer read {} stale values of 64",
        raced.iter().zip(&want).filter(|(a, b)| a != b).count()
    );

    // Captured at call time: a pageable source (the driver stages it) and the launch's
    // parameter bytes, both changed by the host while the stream is still held.
    let release = gate(&producer);
    let mut host = vec![1.0f32; 8];
    let mut staged_dev = producer.clone_htod(&host).expect("htod");
    host.fill(5.0);
    let ones_dev = producer.clone_htod(&[1.0f32; 8]).expect("htod");
    let mut count = Box::new(4i32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        producer
            .launch_builder(&swiglu)
            .arg(&mut staged_dev)
            .arg(&ones_dev)
            .arg(&*count)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("launch");
    *count = 8;
    drop(count);
    release.send(()).expect("release");
    let silu_one = 1.0 / (1.0 + (-1.0f32).exp());
    assert_eq!(
        producer.clone_dtoh(&staged_dev).expect("dtoh"),
        [silu_one, silu_one, silu_one, silu_one, 1.0, 1.0, 1.0, 1.0],
        "the copy read the source and the launch its n when they were called"
    );

    // A wait binds to the record submitted before it: recording the event again on an
    // idle stream does not release a consumer waiting on the earlier (held) record.
    let third = ctx.new_stream().expect("stream");
    let again = ctx.new_event(None).expect("event");
    let release = gate(&producer);
    again.record(&producer).expect("record");
    consumer.wait(&again).expect("wait");
    let marker = ctx.new_event(None).expect("event");
    marker.record(&consumer).expect("record");
    again.record(&third).expect("record");
    third.synchronize().expect("sync");
    assert!(again.is_complete(), "the latest record has run");
    assert!(
        !marker.is_complete(),
        "the consumer still waits for the first record"
    );
    release.send(()).expect("release");
    marker.synchronize().expect("sync");

    // Event rules through the raw driver calls.
    let timed = ctx
        .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let untimed = ctx.new_event(None).expect("event");
    let never = ctx
        .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    assert!(never.is_complete(), "a never-recorded event is complete");
    let release = gate(&producer);
    timed.record(&producer).expect("record");
    untimed.record(&producer).expect("record");
    let elapsed = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
        let mut ms = 0.0f32;
        // SAFETY: two live events and a live float.
        unsafe { cu::cuEventElapsedTime(&mut ms, a.cu_event(), b.cu_event()) }
    };
    assert_eq!(elapsed(&timed, &timed), CUresult::CUDA_ERROR_NOT_READY);
    // SAFETY: a live event.
    assert_eq!(
        unsafe { cu::cuEventQuery(timed.cu_event()) },
        CUresult::CUDA_ERROR_NOT_READY
    );
    // A wait binds to the record before it: recording `never` later does not matter.
    consumer.wait(&never).expect("wait");
    consumer
        .synchronize()
        .expect("a wait on a never-recorded event does not block");
    release.send(()).expect("release");
    producer.synchronize().expect("sync");
    assert_eq!(
        elapsed(&timed, &untimed),
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
    assert_eq!(elapsed(&timed, &never), CUresult::CUDA_ERROR_INVALID_HANDLE);
    assert_eq!(elapsed(&timed, &timed), CUresult::CUDA_SUCCESS);
}

/// cuBLAS through cudarc: f32 GEMM against a hand-computed 2x2 product and a row-major
/// reference, strided batched f32, and bf16 GEMM with f32 accumulation against the
/// widened operands (the output rounds once, so it is exact up to that rounding: 1 bf16
/// ulp, 2^-8 relative).
#[test]
fn cublas_gemms_match_references() {
    const NAME: &str = "standin::cublas_gemms_match_references";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
    let (_ctx, stream) = standin_context();
    let blas = CudaBlas::new(Arc::clone(&stream)).expect("cuBLAS handle");

    // Column-major A = [[1, 2], [3, 4]], B = [[5, 6], [7, 8]]: A*B = [[19, 22], [43, 50]].
    let a = stream.clone_htod(&[1.0f32, 3.0, 2.0, 4.0]).expect("htod");
    let b = stream.clone_htod(&[5.0f32, 7.0, 6.0, 8.0]).expect("htod");
    let mut c = stream.alloc_zeros::<f32>(4).expect("alloc");
    let config = GemmConfig {
        transa: CUBLAS_OP_N,
        transb: CUBLAS_OP_N,
        m: 2,
        n: 2,
        k: 2,
        alpha: 1.0f32,
        lda: 2,
        ldb: 2,
        beta: 0.0,
        ldc: 2,
    };
    // SAFETY: the operands hold m*k, k*n and m*n elements.
    unsafe { blas.gemm(config, &a, &b, &mut c) }.expect("sgemm");
    assert_eq!(
        stream.clone_dtoh(&c).expect("dtoh"),
        [19.0, 43.0, 22.0, 50.0]
    );

    // The backend's use: y[rows, out] = x[rows, in] * W[out, in]^T with row-major x and W,
    // i.e. column-major y^T = W * x^T: transa = T on W stored [in, out] column-major.
    let mut rng = Rng(42);
    let (rows, inp, out) = (3usize, 40usize, 24usize);
    let x = rng.vec(rows * inp, 1.0);
    let w = rng.vec(out * inp, 1.0);
    let mut want = vec![0.0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            want[r * out + o] = (0..inp).map(|i| x[r * inp + i] * w[o * inp + i]).sum();
        }
    }
    let x_dev = stream.clone_htod(&x).expect("htod");
    let w_dev = stream.clone_htod(&w).expect("htod");
    let mut y_dev = stream.alloc_zeros::<f32>(rows * out).expect("alloc");
    let linear = GemmConfig {
        transa: CUBLAS_OP_T,
        transb: CUBLAS_OP_N,
        m: out as i32,
        n: rows as i32,
        k: inp as i32,
        alpha: 1.0f32,
        lda: inp as i32,
        ldb: inp as i32,
        beta: 0.0,
        ldc: out as i32,
    };
    // SAFETY: shapes as configured.
    unsafe { blas.gemm(linear, &w_dev, &x_dev, &mut y_dev) }.expect("sgemm");
    let err = max_abs_diff(&stream.clone_dtoh(&y_dev).expect("dtoh"), &want);
    println!("sgemm linear: max abs diff {err:.3e}");
    assert!(err < 1e-5, "{err}");

    // Strided batched: two independent 2x2 products in one call.
    let a2 = stream
        .clone_htod(&[1.0f32, 3.0, 2.0, 4.0, 1.0, 0.0, 0.0, 1.0])
        .expect("htod");
    let b2 = stream
        .clone_htod(&[5.0f32, 7.0, 6.0, 8.0, 9.0, 10.0, 11.0, 12.0])
        .expect("htod");
    let mut c2 = stream.alloc_zeros::<f32>(8).expect("alloc");
    let batched = StridedBatchedConfig {
        gemm: config,
        batch_size: 2,
        stride_a: 4,
        stride_b: 4,
        stride_c: 4,
    };
    // SAFETY: two batches of 4 elements each.
    unsafe { blas.gemm_strided_batched(batched, &a2, &b2, &mut c2) }.expect("batched");
    assert_eq!(
        stream.clone_dtoh(&c2).expect("dtoh"),
        [19.0, 43.0, 22.0, 50.0, 9.0, 10.0, 11.0, 12.0]
    );

    // bf16 storage, f32 compute (cublasGemmEx), the same linear layer.
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let xb_dev = stream.clone_htod(&xb).expect("htod");
    let wb_dev = stream.clone_htod(&wb).expect("htod");
    let mut yb_dev = stream.alloc_zeros::<bf16>(rows * out).expect("alloc");
    let linear_bf16 = GemmConfig {
        alpha: bf16::ONE,
        beta: bf16::ZERO,
        transa: linear.transa,
        transb: linear.transb,
        m: linear.m,
        n: linear.n,
        k: linear.k,
        lda: linear.lda,
        ldb: linear.ldb,
        ldc: linear.ldc,
    };
    // SAFETY: shapes as configured.
    unsafe { blas.gemm(linear_bf16, &wb_dev, &xb_dev, &mut yb_dev) }.expect("gemm_ex");
    let got = stream.clone_dtoh(&yb_dev).expect("dtoh");
    for r in 0..rows {
        for o in 0..out {
            let exact: f32 = (0..inp)
                .map(|i| xb[r * inp + i].to_f32() * wb[o * inp + i].to_f32())
                .sum();
            let g = got[r * out + o].to_f32();
            assert!(
                (g - exact).abs() <= exact.abs() / 256.0 + 1e-6,
                "bf16 gemm [{r}, {o}]: {g} vs {exact}"
            );
        }
    }
    println!("gemm_ex bf16: within 1 bf16 ulp of the f32-accumulated product");

    // bf16 weights and activations with an f32 output and f32 compute (the backend's
    // projections), plus beta = 1 accumulating into the output (a residual add): exact
    // against the widened operands summed in the same (ascending k) order.
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
    let residual = rng.vec(rows * out, 1.0);
    let mut acc_dev = stream.clone_htod(&residual).expect("htod");
    let (alpha, beta) = (1.0f32, 1.0f32);
    {
        let (w_ptr, _w) = cudarc::driver::DevicePtr::device_ptr(&wb_dev, &stream);
        let (x_ptr, _x) = cudarc::driver::DevicePtr::device_ptr(&xb_dev, &stream);
        let (c_ptr, _c) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut acc_dev, &stream);
        // SAFETY: the device pointers cover the configured shapes; alpha and beta are host
        // f32 values, as f32 compute requires.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                CUBLAS_OP_T,
                CUBLAS_OP_N,
                out as i32,
                rows as i32,
                inp as i32,
                (&alpha as *const f32).cast(),
                w_ptr as *const _,
                cudaDataType_t::CUDA_R_16BF,
                inp as i32,
                x_ptr as *const _,
                cudaDataType_t::CUDA_R_16BF,
                inp as i32,
                (&beta as *const f32).cast(),
                c_ptr as *mut _,
                cudaDataType_t::CUDA_R_32F,
                out as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .expect("gemm_ex bf16 -> f32");
    }
    let got = stream.clone_dtoh(&acc_dev).expect("dtoh");
    for r in 0..rows {
        for o in 0..out {
            let mut dot = 0.0f32;
            for i in 0..inp {
                dot += xb[r * inp + i].to_f32() * wb[o * inp + i].to_f32();
            }
            let want = dot + residual[r * out + o];
            assert_eq!(got[r * out + o].to_bits(), want.to_bits(), "[{r}, {o}]");
        }
    }
    println!("gemm_ex bf16 x bf16 -> f32 with beta = 1: exact");
}

/// What a real driver refuses, the stand-in refuses with the driver's code (and a
/// `moec-standin:` line on stderr, checked by the parent).
#[test]
fn refuses_what_a_driver_refuses() {
    const NAME: &str = "standin::refuses_what_a_driver_refuses";
    if !in_standin_child(NAME) {
        assert_logged(
            &run_under_standin(NAME),
            &[
                "cuMemcpyHtoDAsync_v2 refused: destination",
                "runs past the end of the device allocation",
                "cuMemcpyDtoHAsync_v2 refused: source",
                "cuLaunchKernel(swiglu) refused: pointer parameter 0",
                "use after free",
                "cuModuleGetFunction refused: unknown kernel",
                "never registered",
                "cuModuleLoadData refused: the image is not a moec-standin module",
            ],
        );
        return;
    }
    use CUresult::*;
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let s = stream.cu_stream();
    let buf: CudaSlice<f32> = stream.alloc_zeros(16).expect("alloc");
    let (dev, _sync) = cudarc::driver::DevicePtr::device_ptr(&buf, &stream);
    let host = [0.0f32; 32];
    let mut back = vec![0.0f32; 32];
    // SAFETY (every raw call below): live host buffers of 32 floats, a live stream; the
    // device ranges are what is being tested.
    unsafe {
        // Out-of-bounds copies: 32 floats into/out of a 16-float allocation.
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(dev, host.as_ptr().cast(), 128, s),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cu::cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), dev + 32, 64, s),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(dev, host.as_ptr().cast(), 64, s),
            CUDA_SUCCESS
        );
        // A host buffer used as pinned that was never registered.
        assert_eq!(
            cu::cuMemHostUnregister(back.as_mut_ptr().cast()),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        let mut mapped = 0u64;
        assert_eq!(
            cu::cuMemHostGetDevicePointer_v2(&mut mapped, back.as_mut_ptr().cast(), 0),
            CUDA_ERROR_INVALID_VALUE
        );
        // Registered, it is accepted, and unregistering works once.
        assert_eq!(
            cu::cuMemHostRegister_v2(back.as_mut_ptr().cast(), 128, 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            cu::cuMemHostGetDevicePointer_v2(&mut mapped, back.as_mut_ptr().cast(), 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            cu::cuMemHostUnregister(back.as_mut_ptr().cast()),
            CUDA_SUCCESS
        );
    }
    // A launch whose pointer argument is host memory the driver never saw.
    let swiglu = function(&modules, "swiglu.cu", "swiglu");
    let host_ptr = host.as_ptr() as u64;
    let n = 16i32;
    // SAFETY: argument types match; the pointer is what is being tested.
    let launch = unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&host_ptr)
            .arg(&buf)
            .arg(&n)
            .launch(cfg((1, 1, 1), 32, 0))
    };
    assert_eq!(
        launch.map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_ILLEGAL_ADDRESS)
    );
    // Use after free: a freed allocation in a copy and in a launch.
    let freed = {
        let victim: CudaSlice<f32> = stream.alloc_zeros(16).expect("alloc");
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&victim, &stream);
        ptr
    };
    stream.synchronize().expect("sync");
    // SAFETY: live host buffer; the freed device pointer is what is being tested.
    assert_eq!(
        unsafe { cu::cuMemcpyHtoDAsync_v2(freed, host.as_ptr().cast(), 64, s) },
        CUDA_ERROR_INVALID_VALUE
    );
    // SAFETY: as above.
    let launch = unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&freed)
            .arg(&buf)
            .arg(&n)
            .launch(cfg((1, 1, 1), 32, 0))
    };
    assert_eq!(
        launch.map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_ILLEGAL_ADDRESS)
    );
    // Unknown kernel.
    let module = &modules
        .iter()
        .find(|(f, _)| *f == "swiglu.cu")
        .expect("module")
        .1;
    assert_eq!(
        module
            .load_function("no_such_kernel")
            .map(drop)
            .map_err(|e| e.0),
        Err(CUDA_ERROR_NOT_FOUND)
    );
    // Real PTX cannot run on the stand-in.
    let ptx = cudarc::nvrtc::Ptx::from_src(".version 8.0\n.target sm_80\n.address_size 64\n");
    assert_eq!(
        ctx.load_module(ptx).map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_INVALID_IMAGE)
    );
    // Blocks larger than a GPU allows.
    // SAFETY: argument types match.
    let launch = unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&buf)
            .arg(&buf)
            .arg(&n)
            .launch(cfg((1, 1, 1), 2048, 0))
    };
    assert_eq!(
        launch.map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    stream.synchronize().expect("the valid work still ran");
}

/// A kernel that runs past the end of its buffer (its pointer arguments are valid, so the
/// launch is accepted) hits the guard page after the allocation: the process dies with
/// SIGSEGV instead of silently reading or corrupting neighbouring memory.
#[test]
fn kernel_overrun_faults_at_the_guard_page() {
    const NAME: &str = "standin::kernel_overrun_faults_at_the_guard_page";
    if !in_standin_child(NAME) {
        use std::os::unix::process::ExitStatusExt;
        let (status, stderr) = run_under_standin_status(NAME);
        println!("child: {status:?}\n{stderr}");
        assert_eq!(status.signal(), Some(libc_sigsegv()), "{stderr}");
        assert!(stderr.contains("launching the overrun"), "{stderr}");
        assert!(
            stderr.contains("moec-standin: memory fault at 0x")
                && stderr.contains("past an allocation's end"),
            "{stderr}"
        );
        return;
    }
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let swiglu = function(&modules, "swiglu.cu", "swiglu");
    // 64 floats = 256 bytes: the allocation ends exactly at its guard page.
    let mut g_dev = stream.alloc_zeros::<f32>(64).expect("alloc");
    let u_dev = stream.alloc_zeros::<f32>(64).expect("alloc");
    let n = 128i32;
    eprintln!("launching the overrun");
    // SAFETY: not safe on purpose: n runs past both buffers; the stand-in must fault.
    unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&mut g_dev)
            .arg(&u_dev)
            .arg(&n)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("the launch itself is valid");
    stream.synchronize().expect("sync");
    panic!("the overrun did not fault");
}

/// SIGSEGV's number on Linux (no libc dependency in the tests for one constant).
fn libc_sigsegv() -> i32 {
    11
}

/// A paged-attention case for the attention kernels' tests: the block tables of sequences
/// of (cached, new) tokens (`max_blocks` slots each, blocks spread over `n_blocks`), and the
/// sequence and position of each new row.
pub(crate) struct PagedRows {
    pub(crate) tables: Vec<u32>,
    pub(crate) row_seq: Vec<u32>,
    pub(crate) row_pos: Vec<i32>,
}

pub(crate) fn paged_rows(
    seqs: &[(usize, usize)],
    block_size: usize,
    n_blocks: usize,
    max_blocks: usize,
) -> PagedRows {
    let mut tables = vec![0u32; seqs.len() * max_blocks];
    let mut next = 0u32;
    for (s, &(cached, new)) in seqs.iter().enumerate() {
        for b in 0..(cached + new).div_ceil(block_size) {
            tables[s * max_blocks + b] = (next * 5 + 1) % n_blocks as u32;
            next += 1;
        }
    }
    let (mut row_seq, mut row_pos) = (Vec::new(), Vec::new());
    for (s, &(cached, new)) in seqs.iter().enumerate() {
        for j in 0..new {
            row_seq.push(s as u32);
            row_pos.push((cached + j) as i32);
        }
    }
    PagedRows {
        tables,
        row_seq,
        row_pos,
    }
}

/// The reference for a paged attention kernel: the CPU's `attention` over copies of the
/// pools the device started from (it appends the new rows' K and V, as the kernels must),
/// after asserting the device pools now hold exactly the K and V the CPU appended. Gives
/// the CPU's output rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cpu_attention_checking_appends(
    stream: &Arc<CudaStream>,
    layout: moec::model::vocab::KvLayout,
    shape: &moec::model::vocab::AttnShape,
    rows: &PagedRows,
    seqs: &[(usize, usize)],
    max_blocks: usize,
    qkv: &[f32],
    start_pools: (&[f32], &[f32]),
    device_pools: (&CudaSlice<f32>, &CudaSlice<f32>),
) -> Vec<f32> {
    use moec::math::attention::{attention, AttnSeq};
    use moec::math::kv_cache::KvBlocksMut;
    let (mut k_cpu, mut v_cpu) = (start_pools.0.to_vec(), start_pools.1.to_vec());
    let mut want = vec![0.0f32; rows.row_seq.len() * shape.heads * shape.head_dim];
    let attn_seqs: Vec<AttnSeq<'_>> = seqs
        .iter()
        .enumerate()
        .map(|(s, &(cached, new))| AttnSeq {
            block_table: &rows.tables[s * max_blocks..(s + 1) * max_blocks],
            context_len: cached,
            n_new: new,
        })
        .collect();
    let mut cache = KvBlocksMut::f32(layout, &mut k_cpu, &mut v_cpu);
    attention(&mut cache, &attn_seqs, qkv, shape, &mut want).expect("CPU attention");
    assert_eq!(
        stream.clone_dtoh(device_pools.0).expect("dtoh"),
        k_cpu,
        "appended K"
    );
    assert_eq!(
        stream.clone_dtoh(device_pools.1).expect("dtoh"),
        v_cpu,
        "appended V"
    );
    want
}

/// CUDA graphs by stream capture on the stand-in, as the driver documents them: captured
/// work runs only when the graph is launched, and each launch runs it again (a copy from
/// pinned memory reads it at launch time); a stream that waits on an event recorded in the
/// capture joins it and must be joined back before the capture ends
/// (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`); while a stream captures, synchronising it, a copy
/// from pageable host memory and synchronising an event recorded in the capture are
/// refused (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, `CUDA_ERROR_CAPTURED_EVENT`) and
/// invalidate the capture, so later calls and the end of the capture say so
/// (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, no graph).
#[test]
fn graph_capture_replays_work_and_refuses_host_synchronisation() {
    const NAME: &str = "standin::graph_capture_replays_work_and_refuses_host_synchronisation";
    if !in_standin_child(NAME) {
        assert_logged(
            &run_under_standin(NAME),
            &[
                "cuStreamSynchronize refused: synchronising it while the stream captures",
                "cuMemcpyHtoDAsync_v2 refused: a copy from pageable host memory while the stream captures",
                "cuEventSynchronize refused: the event was last recorded in a capturing stream",
                "was not joined back into the origin stream",
            ],
        );
        return;
    }
    use cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL as THREAD_LOCAL;
    use CUresult::*;
    let (ctx, stream) = standin_context();
    let other = ctx.new_stream().expect("second stream");
    let s = stream.cu_stream();
    let dev: CudaSlice<u32> = stream.alloc_zeros(4).expect("alloc");
    let copy: CudaSlice<u32> = stream.alloc_zeros(4).expect("alloc");
    let (d, _sync) = cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
    let (d2, _sync) = cudarc::driver::DevicePtr::device_ptr(&copy, &stream);
    stream.synchronize().expect("sync");
    // SAFETY: a plain 16-byte page-locked allocation, freed at the end.
    let pinned = unsafe { cudarc::driver::result::malloc_host(16, 0) }.expect("pinned") as *mut u32;
    let fill = |v: u32| {
        for i in 0..4 {
            // SAFETY: 4 u32 fit the 16 bytes; no copy from it is in flight (synchronised).
            unsafe { pinned.add(i).write(v + i as u32) };
        }
    };
    let read = |ptr: u64| {
        let mut back = [0u32; 4];
        // SAFETY: `ptr` holds 4 u32 and `back` 16 bytes; a synchronous copy.
        let r = unsafe { cu::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), ptr, 16) };
        assert_eq!(r, CUDA_SUCCESS);
        back
    };
    let end = |st: cu::CUstream| {
        let mut g: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: a live stream and a graph slot.
        let r = unsafe { cu::cuStreamEndCapture(st, &mut g) };
        (r, g)
    };

    // Captured work runs at launch, again at every launch, reading the pinned source then.
    fill(10);
    stream.begin_capture(THREAD_LOCAL).expect("begin");
    // SAFETY: 16 pinned bytes into a 16-byte allocation.
    let r = unsafe { cu::cuMemcpyHtoDAsync_v2(d, pinned.cast(), 16, s) };
    assert_eq!(r, CUDA_SUCCESS);
    let graph = stream
        .end_capture(cu::CUgraphInstantiate_flags(0))
        .expect("end")
        .expect("a graph");
    assert_eq!(read(d), [0; 4], "captured work ran before the launch");
    graph.launch().expect("launch");
    stream.synchronize().expect("sync");
    assert_eq!(read(d), [10, 11, 12, 13]);
    fill(20);
    graph.launch().expect("launch again");
    stream.synchronize().expect("sync");
    assert_eq!(read(d), [20, 21, 22, 23]);

    // Refusals while capturing; each invalidates the capture.
    let host = [7u32; 4];
    let ev = ctx.new_event(None).expect("event");
    // SAFETY (the raw calls): live streams, events and buffers of the sizes passed.
    unsafe {
        stream.begin_capture(THREAD_LOCAL).expect("begin");
        assert_eq!(
            cu::cuStreamSynchronize(s),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(
            cu::cuMemsetD8Async(d, 0, 16, s),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        let (r, g) = end(s);
        assert_eq!(
            (r, g.is_null()),
            (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, true)
        );

        stream.begin_capture(THREAD_LOCAL).expect("begin");
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(d, host.as_ptr().cast(), 16, s),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

        stream.begin_capture(THREAD_LOCAL).expect("begin");
        ev.record(&stream).expect("record in the capture");
        assert_eq!(
            cu::cuEventSynchronize(ev.cu_event()),
            CUDA_ERROR_CAPTURED_EVENT
        );
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    assert_eq!(read(d), [20, 21, 22, 23], "refused work ran");

    // Fork and join: a second stream joins by waiting on an event of the capture; ended
    // without joining it back, the capture is refused; joined, both streams' work is in
    // the graph, in order.
    let fork = ctx.new_event(None).expect("event");
    let join = ctx.new_event(None).expect("event");
    // SAFETY (the raw calls): live streams and 16-byte device buffers.
    unsafe {
        stream.begin_capture(THREAD_LOCAL).expect("begin");
        fork.record(&stream).expect("fork");
        other.wait(&fork).expect("join the capture");
        assert_eq!(
            cu::cuMemsetD8Async(d, 1, 16, other.cu_stream()),
            CUDA_SUCCESS
        );
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_UNJOINED);

        stream.begin_capture(THREAD_LOCAL).expect("begin");
        fork.record(&stream).expect("fork");
        other.wait(&fork).expect("join the capture");
        assert_eq!(
            cu::cuMemsetD8Async(d, 1, 16, other.cu_stream()),
            CUDA_SUCCESS
        );
        join.record(&other).expect("join");
        stream.wait(&join).expect("wait for the join");
        assert_eq!(cu::cuMemcpyDtoDAsync_v2(d2, d, 16, s), CUDA_SUCCESS);
    }
    let graph = stream
        .end_capture(cu::CUgraphInstantiate_flags(0))
        .expect("end")
        .expect("a graph");
    let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
    // SAFETY: a live stream and a status slot.
    let r = unsafe { cu::cuStreamIsCapturing(other.cu_stream(), &mut status) };
    assert_eq!(r, CUDA_SUCCESS);
    assert_eq!(
        status,
        cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    );
    assert_eq!(read(d2), [0; 4], "captured work ran before the launch");
    graph.launch().expect("launch");
    stream.synchronize().expect("sync");
    assert_eq!(read(d2), [0x0101_0101; 4]);
    drop(graph);
    // SAFETY: allocated above; every copy from it has finished.
    unsafe { cudarc::driver::result::free_host(pinned.cast()) }.expect("free");
}

/// What `moe_group` leaves on the device: the routed entries permuted into per-expert
/// tiles (each entry's token row, slot and weight) and the tile table
/// (`[tiles, live, (expert, start, rows) x tiles]`).
pub(crate) struct Grouped {
    pub perm_row: CudaSlice<u32>,
    pub perm_slot: CudaSlice<u32>,
    pub perm_weight: CudaSlice<f32>,
    pub tiles: CudaSlice<i32>,
}

/// One `moe_group` launch over `entries` routed entries of `route_dev` (packed `(expert,
/// weight bits)` per token and slot, `k` slots, `e` experts), experts with a null address in
/// the table at `members` left out, room for `max_tiles` tiles.
#[allow(clippy::too_many_arguments)]
pub(crate) fn group_entries(
    stream: &Arc<CudaStream>,
    modules: &[(&'static str, Arc<cudarc::driver::CudaModule>)],
    route_dev: &CudaSlice<u32>,
    members: u64,
    entries: usize,
    k: usize,
    e: usize,
    max_tiles: usize,
) -> Grouped {
    let mut g = Grouped {
        perm_row: stream.alloc_zeros::<u32>(entries).expect("alloc"),
        perm_slot: stream.alloc_zeros::<u32>(entries).expect("alloc"),
        perm_weight: stream.alloc_zeros::<f32>(entries).expect("alloc"),
        tiles: stream.alloc_zeros::<i32>(2 + 3 * max_tiles).expect("alloc"),
    };
    let (entries_i, k_i, e_i) = (entries as i64, k as i32, e as i32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&kernel_entry(modules, "moe_group"))
            .arg(route_dev)
            .arg(&members)
            .arg(&mut g.perm_row)
            .arg(&mut g.perm_slot)
            .arg(&mut g.perm_weight)
            .arg(&mut g.tiles)
            .arg(&entries_i)
            .arg(&k_i)
            .arg(&e_i)
            .launch(cfg((1, 1, 1), 256, 0))
    }
    .expect("moe_group");
    g
}
