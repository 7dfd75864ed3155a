//! `moec probe --backend cuda`: moec's own GPU kernels and copies timed on this device.
//!
//! Takes the sizes to time at (`runtime::probe::GpuProbeSizes`); gives a `GpuProbe`, what the CUDA
//! backend sustains here: the decode projection (`linear_gemv`, the few-row path of
//! [`StreamCx::linear`]) and the prefill GEMM (cuBLAS with the bf16 pair split), decode and
//! prefill attention over a paged KV cache (the kernels `attn` launches), device memory
//! bandwidth, pinned and pageable host <-> device copies, and the fixed costs of a kernel
//! launch and of a cross-stream event wait. Every figure is the runtime's own call on the
//! runtime's own kernels (NVRTC-compiled `kernels/*.cu`, the same cuBLAS call), timed with
//! CUDA events (copies through pageable memory with the host clock around a
//! synchronisation, since the driver stages them), and kept as the best of a few timed
//! repetitions after an untimed one, as the CPU probe keeps its figures. Nothing here is
//! fitted to an end-to-end run. Guarantees: no panic when a library or device is missing
//! (the error names it); every buffer is freed on return.

use super::device::{Device, DeviceError};
use super::graph::Recorder;
use super::launch::{int, Arg, DevMatrix, LaunchError, StreamCx, Workspace};
use crate::model::vocab::{AttnShape, Orientation};
use crate::quant::storage::WeightDtype;
use crate::runtime::probe::{GemvPoint, GpuProbe, GpuProbeSizes};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::Arc;
use std::time::Instant;

/// Why the GPU probe failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuProbeError {
    /// No usable device, driver, NVRTC or cuBLAS (one line naming what is missing).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A launch or GEMM failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The decode attention launch refused the geometry or failed.
    #[error(transparent)]
    Attention(#[from] crate::runtime::ops::OpError),
    /// A driver call failed.
    #[error("CUDA {call} failed during the GPU probe: {source}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// cuBLAS could not be set up on the probe's stream.
    #[error("cuBLAS could not be set up for the GPU probe: {0}")]
    Blas(String),
    /// A timing came out zero or not finite (a clock or event problem, never a rate).
    #[error("the GPU probe's {0} timing is not a positive duration")]
    Timing(&'static str),
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> GpuProbeError {
    move |source| GpuProbeError::Driver { call, source }
}

/// Times moec's CUDA kernels and copies on device 0 at `sizes`.
pub fn probe(sizes: GpuProbeSizes) -> Result<GpuProbe, GpuProbeError> {
    let device = Device::open()?;
    let total_mem_bytes = device.ctx.total_mem().map_err(driver("cuDeviceTotalMem"))? as u64;
    let stream = device.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
    let blas =
        CudaBlas::new(Arc::clone(&stream)).map_err(|e| GpuProbeError::Blas(e.to_string()))?;
    let workspace = Workspace::default();
    // Never recording: every call goes to the stream as issued.
    let recorder = Recorder::new(Vec::new(), Vec::new(), Vec::new());
    let cx = StreamCx {
        device: &device,
        stream: &stream,
        blas: &blas,
        workspace: &workspace,
        recorder: &recorder,
        lane: 0,
    };
    let timer = Timer {
        stream: &stream,
        reps: sizes.reps.max(1),
    };
    let device_copy_bytes_per_s = device_copy(&cx, &timer, sizes.copy_bytes)?;
    let (decode, prefill_gemm_flops) = projections(&cx, &timer, &sizes)?;
    let (decode_attn_flops, prefill_attn_flops) = attention(&cx, &timer, &sizes)?;
    let (host_to_device_pinned, device_to_host_pinned, host_to_device_pageable) =
        host_copies(&device, &stream, &timer, sizes.copy_bytes)?;
    let (launch_s, event_wait_s) = fixed_costs(&device, &cx, &timer, sizes.launches.max(1))?;
    Ok(GpuProbe {
        device: device.name.clone(),
        arch: device.arch,
        total_mem_bytes,
        sizes,
        device_copy_bytes_per_s,
        decode,
        prefill_gemm_flops,
        decode_attn_flops,
        prefill_attn_flops,
        host_to_device_pinned,
        device_to_host_pinned,
        host_to_device_pageable,
        launch_s,
        event_wait_s,
    })
}

/// Times work queued on one stream.
struct Timer<'a> {
    stream: &'a Arc<CudaStream>,
    reps: usize,
}

impl Timer<'_> {
    /// The best of `reps` timings (after one untimed run) of the work `queue` puts on the
    /// stream, seconds, from CUDA events around it.
    fn events(
        &self,
        what: &'static str,
        mut queue: impl FnMut() -> Result<(), GpuProbeError>,
    ) -> Result<f64, GpuProbeError> {
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        queue()?;
        let mut best = f64::INFINITY;
        for _ in 0..self.reps {
            let start = self
                .stream
                .record_event(timing)
                .map_err(driver("cuEventRecord"))?;
            queue()?;
            let end = self
                .stream
                .record_event(timing)
                .map_err(driver("cuEventRecord"))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(driver("cuEventElapsedTime"))?;
            best = best.min(f64::from(ms) * 1e-3);
        }
        positive(what, best)
    }

    /// The best of `reps` host-clock timings (after one untimed run) of `queue` then a
    /// stream synchronisation, seconds: for copies the driver stages on the host.
    fn host_clock(
        &self,
        what: &'static str,
        mut queue: impl FnMut() -> Result<(), GpuProbeError>,
    ) -> Result<f64, GpuProbeError> {
        let sync = || {
            self.stream
                .synchronize()
                .map_err(driver("cuStreamSynchronize"))
        };
        queue()?;
        sync()?;
        let mut best = f64::INFINITY;
        for _ in 0..self.reps {
            let start = Instant::now();
            queue()?;
            sync()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        positive(what, best)
    }
}

fn positive(what: &'static str, seconds: f64) -> Result<f64, GpuProbeError> {
    if seconds.is_finite() && seconds > 0.0 {
        Ok(seconds)
    } else {
        Err(GpuProbeError::Timing(what))
    }
}

/// `n` zeroed device elements.
fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>, GpuProbeError> {
    stream
        .alloc_zeros::<T>(n.max(1))
        .map_err(driver("cuMemAllocAsync"))
}

fn addr<T>(stream: &Arc<CudaStream>, slice: &CudaSlice<T>) -> u64 {
    slice.device_ptr(stream).0
}

/// Device memory bandwidth: a device-to-device copy of `bytes`, read plus written.
fn device_copy(cx: &StreamCx<'_>, timer: &Timer<'_>, bytes: usize) -> Result<f64, GpuProbeError> {
    let src = zeros::<u8>(cx.stream, bytes)?;
    let dst = zeros::<u8>(cx.stream, bytes)?;
    let (s, d) = (addr(cx.stream, &src), addr(cx.stream, &dst));
    let seconds = timer.events("device copy", || Ok(cx.copy(d, s, bytes)?))?;
    Ok(2.0 * bytes as f64 / seconds)
}

/// The decode points and the prefill GEMM on one `[ffn, hidden]` bf16 matrix (stored as a
/// checkpoint stores a projection: rows are outputs).
fn projections(
    cx: &StreamCx<'_>,
    timer: &Timer<'_>,
    sizes: &GpuProbeSizes,
) -> Result<(Vec<GemvPoint>, f64), GpuProbeError> {
    let (out, inp) = (sizes.ffn, sizes.hidden);
    // bf16 0x3c00 = 2^-7: finite values, so no NaN path is timed.
    let weights_host = vec![0x3c00u16; out * inp];
    let weights = cx
        .stream
        .clone_htod(&weights_host)
        .map_err(driver("cuMemcpyHtoD"))?;
    drop(weights_host);
    let max_rows = sizes
        .decode_rows
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(sizes.prefill_rows);
    let x = zeros::<f32>(cx.stream, max_rows * inp)?;
    let y = zeros::<f32>(cx.stream, max_rows * out)?;
    let w = DevMatrix {
        ptr: addr(cx.stream, &weights),
        dtype: WeightDtype::Bf16,
        quant: None,
        rows: out,
        cols: inp,
        orientation: Orientation::OutIn,
    };
    let (xp, yp) = (addr(cx.stream, &x), addr(cx.stream, &y));
    let call = |rows: usize| {
        move || -> Result<(), GpuProbeError> {
            cx.workspace.reset(false);
            Ok(cx.linear(xp, rows, &w, yp, out, false)?)
        }
    };
    let weight_bytes = (out * inp * 2) as f64;
    let mut decode = Vec::with_capacity(sizes.decode_rows.len());
    for &rows in &sizes.decode_rows {
        let seconds = timer.events("decode projection", call(rows))?;
        decode.push(GemvPoint {
            rows,
            seconds,
            weight_bytes_per_s: weight_bytes / seconds,
            flops: 2.0 * (rows * out * inp) as f64 / seconds,
        });
    }
    let seconds = timer.events("prefill GEMM", call(sizes.prefill_rows))?;
    let prefill = 2.0 * (sizes.prefill_rows * out * inp) as f64 / seconds;
    Ok((decode, prefill))
}

/// Decode and prefill attention over a paged KV cache of blocks of 16 positions, each
/// sequence's blocks contiguous: the kernels and launch shapes of the `attn` op.
fn attention(
    cx: &StreamCx<'_>,
    timer: &Timer<'_>,
    sizes: &GpuProbeSizes,
) -> Result<(f64, f64), GpuProbeError> {
    const BLOCK: usize = 16;
    let (heads, kv_heads, dim) = sizes.attn_heads;
    let q_width = heads * dim;
    let row_width = (heads + 2 * kv_heads) * dim;
    // Pools for the larger of the two points, as one allocation each.
    let (d_seqs, d_ctx) = sizes.decode_attn;
    let (p_seqs, p_len) = sizes.prefill_attn;
    let seq_blocks = (d_ctx + 1).max(p_len).div_ceil(BLOCK);
    let seqs = d_seqs.max(p_seqs);
    let pool_elems = seqs * seq_blocks * kv_heads * BLOCK * dim;
    let k_pool = zeros::<f32>(cx.stream, pool_elems)?;
    let v_pool = zeros::<f32>(cx.stream, pool_elems)?;
    let tables: Vec<u32> = (0..(seqs * seq_blocks) as u32).collect();
    let tables = cx
        .stream
        .clone_htod(&tables)
        .map_err(driver("cuMemcpyHtoD"))?;
    let rows = d_seqs.max(p_seqs * p_len);
    let qkv = zeros::<f32>(cx.stream, rows * row_width)?;
    let out = zeros::<f32>(cx.stream, rows * q_width)?;
    let max_keys = (d_ctx + 1).max(p_len);
    let scores = zeros::<f32>(cx.stream, rows * heads * max_keys)?;
    let (kp, vp, tp) = (
        addr(cx.stream, &k_pool),
        addr(cx.stream, &v_pool),
        addr(cx.stream, &tables),
    );
    let (qp, op, sp) = (
        addr(cx.stream, &qkv),
        addr(cx.stream, &out),
        addr(cx.stream, &scores),
    );
    let dims = |max_keys: usize| -> Result<Vec<Arg>, LaunchError> {
        Ok(vec![
            Arg::I32(int("heads", heads)?),
            Arg::I32(int("kv_heads", kv_heads)?),
            Arg::I32(int("head_dim", dim)?),
            Arg::I32(int("block_size", BLOCK)?),
            Arg::I32(int("max_blocks", seq_blocks)?),
            Arg::I32(int("max_keys", max_keys)?),
            Arg::I32(0),
            Arg::F32(1.0 / (dim as f32).sqrt()),
            Arg::I32(int("qkv_width", row_width)?),
            Arg::I32(-1),
        ])
    };
    let kvh = int("kv_heads", kv_heads)? as u32;

    // Decode: every sequence has `d_ctx` cached positions and appends one.
    let positions = vec![int("context", d_ctx)?; d_seqs];
    let positions = cx
        .stream
        .clone_htod(&positions)
        .map_err(driver("cuMemcpyHtoD"))?;
    let pos = addr(cx.stream, &positions);
    let decode_shape = AttnShape {
        heads,
        kv_heads,
        head_dim: dim,
        sliding_window: None,
        sinks: false,
    };
    let decode = timer.events("decode attention", || {
        // As `attn` launches it (the kernel appends the rows' K/V itself); its split
        // states take scratch, free again for the next repetition, queued after this one.
        cx.workspace.reset(false);
        super::attention::decode_attention(
            cx,
            &super::attention::DecodeLaunch {
                qkv: qp,
                k_pool: kp,
                v_pool: vp,
                tables: tp,
                context_lens: pos,
                out: op,
                rows: d_seqs,
                shape: &decode_shape,
                block_size: BLOCK,
                max_blocks: seq_blocks,
                max_keys: d_ctx + 1,
                window: 0,
                scale: 1.0 / (dim as f32).sqrt(),
                sink_col: -1,
            },
        )
        .map_err(GpuProbeError::from)
    })?;
    let decode_flops = 4.0 * (q_width * d_seqs * (d_ctx + 1)) as f64 / decode;

    // Prefill: `p_seqs` prompts of `p_len` tokens, rows in sequence order.
    let row_seq: Vec<u32> = (0..p_seqs * p_len).map(|r| (r / p_len) as u32).collect();
    let row_pos: Vec<i32> = (0..p_seqs * p_len)
        .map(|r| int("position", r % p_len))
        .collect::<Result<_, _>>()?;
    let row_seq = cx
        .stream
        .clone_htod(&row_seq)
        .map_err(driver("cuMemcpyHtoD"))?;
    let row_pos = cx
        .stream
        .clone_htod(&row_pos)
        .map_err(driver("cuMemcpyHtoD"))?;
    let (rs, rp) = (addr(cx.stream, &row_seq), addr(cx.stream, &row_pos));
    let prefill_dims = dims(p_len)?;
    let prefill_rows = int("rows", p_seqs * p_len)? as u32;
    let (grid_y, shared) = super::attention::prefill_blocks(&decode_shape)?;
    let prefill = timer.events("prefill attention", || {
        let operands = [
            Arg::Ptr(qp),
            Arg::Ptr(kp),
            Arg::Ptr(vp),
            Arg::Ptr(tp),
            Arg::Ptr(rs),
            Arg::Ptr(rp),
        ];
        let mut append = operands.to_vec();
        append.extend_from_slice(&prefill_dims[..5]);
        append.push(prefill_dims[8]);
        cx.launch(
            "paged_kv_append_rows",
            (prefill_rows, kvh, 1),
            32,
            0,
            &append,
        )?;
        let mut a = operands.to_vec();
        a.extend_from_slice(&[Arg::Ptr(sp), Arg::Ptr(op)]);
        a.extend_from_slice(&prefill_dims);
        cx.launch(
            "paged_prefill_attention",
            (prefill_rows, grid_y, 1),
            64,
            shared,
            &a,
        )?;
        Ok(())
    })?;
    let causal = (p_len * (p_len + 1)) as f64 / 2.0;
    let prefill_flops = 4.0 * (q_width * p_seqs) as f64 * causal / prefill;
    Ok((decode_flops, prefill_flops))
}

/// Pinned host -> device, device -> pinned host and pageable host -> device copies of
/// `bytes`, bytes per second.
fn host_copies(
    device: &Device,
    stream: &Arc<CudaStream>,
    timer: &Timer<'_>,
    bytes: usize,
) -> Result<(f64, f64, f64), GpuProbeError> {
    let on_device = zeros::<u8>(stream, bytes)?;
    let dev = addr(stream, &on_device);
    // SAFETY: the pinned buffer is written by the device -> host copy before anything
    // reads it, and nothing on the host reads it at all.
    let mut pinned =
        unsafe { device.ctx.alloc_pinned::<u8>(bytes.max(1)) }.map_err(driver("cuMemHostAlloc"))?;
    let pinned_ptr = pinned
        .as_mut_ptr()
        .map_err(driver("cuMemHostAlloc (its address)"))?;
    let cu = stream.cu_stream();
    let h2d = timer.events("pinned -> device", || {
        // SAFETY: `pinned_ptr` holds `bytes` bytes for the whole probe (it is freed after
        // the stream's last use below) and `dev` as many.
        let src = unsafe { std::slice::from_raw_parts(pinned_ptr, bytes) };
        // SAFETY: as above; the copy is ordered on this stream only.
        unsafe { cudarc::driver::result::memcpy_htod_async(dev, src, cu) }
            .map_err(driver("cuMemcpyHtoDAsync"))
    })?;
    let d2h = timer.events("device -> pinned", || {
        // SAFETY: as above; no host code touches the pinned bytes while copies run.
        let dst = unsafe { std::slice::from_raw_parts_mut(pinned_ptr, bytes) };
        // SAFETY: `dev` holds `bytes` bytes.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, dev, cu) }
            .map_err(driver("cuMemcpyDtoHAsync"))
    })?;
    let pageable = vec![1u8; bytes];
    let pageable_s = timer.host_clock("pageable -> device", || {
        // SAFETY: `dev` holds `bytes` bytes; the driver stages the pageable source before
        // the timed synchronisation returns, while `pageable` is alive.
        unsafe { cudarc::driver::result::memcpy_htod_async(dev, &pageable, cu) }
            .map_err(driver("cuMemcpyHtoDAsync"))
    })?;
    stream
        .synchronize()
        .map_err(driver("cuStreamSynchronize"))?;
    drop(pinned);
    let b = bytes as f64;
    Ok((b / h2d, b / d2h, b / pageable_s))
}

/// Per-launch cost of back-to-back one-block launches, and the added cost of a
/// cross-stream event dependency per round trip.
fn fixed_costs(
    device: &Device,
    cx: &StreamCx<'_>,
    timer: &Timer<'_>,
    launches: usize,
) -> Result<(f64, f64), GpuProbeError> {
    let cell = zeros::<f32>(cx.stream, 1)?;
    let p = addr(cx.stream, &cell);
    let tiny = |s: &StreamCx<'_>| -> Result<(), LaunchError> {
        s.launch(
            "add_in_place",
            (1, 1, 1),
            32,
            0,
            &[Arg::Ptr(p), Arg::Ptr(p), Arg::I64(1)],
        )
    };
    let launch_s = timer.events("kernel launch", || {
        for _ in 0..launches {
            tiny(cx)?;
        }
        Ok(())
    })? / launches as f64;
    let other = device.ctx.new_stream().map_err(driver("cuStreamCreate"))?;
    let other_blas =
        CudaBlas::new(Arc::clone(&other)).map_err(|e| GpuProbeError::Blas(e.to_string()))?;
    let other_ws = Workspace::default();
    let ocx = StreamCx {
        device,
        stream: &other,
        blas: &other_blas,
        workspace: &other_ws,
        recorder: cx.recorder,
        lane: 1,
    };
    let ev = || device.ctx.new_event(None).map_err(driver("cuEventCreate"));
    let (there, back) = (ev()?, ev()?);
    let round_trips = timer.events("event wait", || {
        for _ in 0..launches {
            tiny(cx)?;
            there.record(cx.stream).map_err(driver("cuEventRecord"))?;
            other.wait(&there).map_err(driver("cuStreamWaitEvent"))?;
            tiny(&ocx)?;
            back.record(&other).map_err(driver("cuEventRecord"))?;
            cx.stream.wait(&back).map_err(driver("cuStreamWaitEvent"))?;
        }
        Ok(())
    })? / launches as f64;
    other.synchronize().map_err(driver("cuStreamSynchronize"))?;
    // Two waits per round trip; the two launches in it are what `launch_s` already is.
    let event_wait_s = ((round_trips - 2.0 * launch_s) / 2.0).max(0.0);
    Ok((launch_s, event_wait_s))
}
