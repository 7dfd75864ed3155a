//! The CUDA driver API entry points (`cu*`), exported unmangled for cudarc's loader.
//!
//! Takes the driver calls cudarc 0.19 makes with event tracking off (the export set of
//! `shared/notes/backends.md` §B.4) plus their synchronous siblings; gives one device
//! ("moec-standin", compute capability 8.0, memory pools supported) with one primary
//! context, current per thread. Guarantees, as a real driver: pageable host-to-device
//! copies read the source at call time; device-to-pageable copies return once the data
//! arrived; pinned copies run asynchronously on the stream; `cuLaunchKernel` copies the
//! parameter bytes at call time. Refusals (bad ranges, pointers outside live allocations,
//! use after free, unknown handles or kernels) return the driver's error code and log one
//! line on stderr. Modules and launches are in [`crate::launch`].

use crate::graph;
use crate::memory::{self, Kind};
use crate::stream::{self, Node};
use crate::{counters, guard, log};
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Arc;

/// CUresult values the stand-in returns.
pub mod code {
    /// CUDA_SUCCESS.
    pub const SUCCESS: u32 = 0;
    /// CUDA_ERROR_INVALID_VALUE.
    pub const INVALID_VALUE: u32 = 1;
    /// CUDA_ERROR_OUT_OF_MEMORY.
    pub const OUT_OF_MEMORY: u32 = 2;
    /// CUDA_ERROR_INVALID_DEVICE.
    pub const INVALID_DEVICE: u32 = 101;
    /// CUDA_ERROR_INVALID_IMAGE.
    pub const INVALID_IMAGE: u32 = 200;
    /// CUDA_ERROR_INVALID_CONTEXT.
    pub const INVALID_CONTEXT: u32 = 201;
    /// CUDA_ERROR_INVALID_HANDLE.
    pub const INVALID_HANDLE: u32 = 400;
    /// CUDA_ERROR_NOT_FOUND.
    pub const NOT_FOUND: u32 = 500;
    /// CUDA_ERROR_NOT_READY.
    pub const NOT_READY: u32 = 600;
    /// CUDA_ERROR_ILLEGAL_ADDRESS.
    pub const ILLEGAL_ADDRESS: u32 = 700;
    /// CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES.
    pub const LAUNCH_OUT_OF_RESOURCES: u32 = 701;
    /// CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED.
    pub const HOST_MEMORY_ALREADY_REGISTERED: u32 = 712;
    /// CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED.
    pub const HOST_MEMORY_NOT_REGISTERED: u32 = 713;
    /// CUDA_ERROR_NOT_SUPPORTED.
    pub const NOT_SUPPORTED: u32 = 801;
    /// CUDA_ERROR_UNKNOWN.
    pub const UNKNOWN: u32 = 999;
}

/// The context's sticky error (0: none): a fault in device work that ran on a stream
/// thread, returned by every later synchronisation, as a real context stays broken after
/// an illegal address.
static STICKY: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Breaks the context with `error` (the first fault wins).
pub(crate) fn set_sticky(error: u32) {
    let _ = STICKY.compare_exchange(
        0,
        error,
        std::sync::atomic::Ordering::AcqRel,
        std::sync::atomic::Ordering::Acquire,
    );
}

/// The sticky error, if device work faulted.
fn sticky() -> Result<(), u32> {
    match STICKY.load(std::sync::atomic::Ordering::Acquire) {
        0 => Ok(()),
        error => Err(error),
    }
}

/// A CUresult as the C API returns it.
pub(crate) type CuResult = u32;

/// The one context's handle value (never dereferenced by callers).
const CONTEXT: usize = 0x7000_0000;
/// Largest block, as on every GPU since Fermi.
pub(crate) const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// Static shared memory limit per block without opting in (48 KiB).
pub(crate) const MAX_SHARED_PER_BLOCK: u32 = 48 * 1024;

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// Turns a `Result<(), code>` into the code.
fn status(result: Result<(), u32>) -> CuResult {
    match result {
        Ok(()) => code::SUCCESS,
        Err(e) => e,
    }
}

/// Runs an entry point body, mapping panics to CUDA_ERROR_UNKNOWN.
pub(crate) fn entry(call: &str, body: impl FnOnce() -> Result<(), u32>) -> CuResult {
    guard(call, code::UNKNOWN, || status(body()))
}

/// Writes `value` through an out-pointer, refusing null.
///
/// # Safety
/// `out` must be null or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T, call: &str) -> Result<(), u32> {
    if out.is_null() {
        log(&format!("{call} refused: null output pointer"));
        return Err(code::INVALID_VALUE);
    }
    // SAFETY: non-null, and valid for writes by the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// A raw address that may cross to a stream thread (the caller keeps it valid until the
/// work has run, as CUDA requires of async copies).
#[derive(Clone, Copy)]
struct Addr(usize);

fn copy_work(dst: Addr, src: Addr, bytes: usize) -> Node {
    Arc::new(move || {
        // SAFETY: both ranges were checked at submission (device ranges against live
        // allocations; host ranges are the caller's, valid until the stream reaches this).
        unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes) }
    })
}

#[no_mangle]
extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    memory::install_fault_report();
    code::SUCCESS
}

#[no_mangle]
unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CuResult {
    // SAFETY: cudarc passes a live integer.
    entry("cuDriverGetVersion", || unsafe {
        put(version, 12080, "cuDriverGetVersion")
    })
}

#[no_mangle]
unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    // SAFETY: cudarc passes a live integer.
    entry("cuDeviceGetCount", || unsafe {
        put(count, 1, "cuDeviceGetCount")
    })
}

fn check_device(ordinal: c_int, call: &str) -> Result<(), u32> {
    if ordinal == 0 {
        Ok(())
    } else {
        log(&format!(
            "{call} refused: device {ordinal} does not exist (the stand-in has one device, 0)"
        ));
        Err(code::INVALID_DEVICE)
    }
}

#[no_mangle]
unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CuResult {
    entry("cuDeviceGet", || {
        check_device(ordinal, "cuDeviceGet")?;
        // SAFETY: cudarc passes a live integer.
        unsafe { put(device, 0, "cuDeviceGet") }
    })
}

/// The device name `cuDeviceGetName` reports.
pub const DEVICE_NAME: &str = "moec-standin (CPU emulation of a CUDA device)";

#[no_mangle]
unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> CuResult {
    entry("cuDeviceGetName", || {
        check_device(device, "cuDeviceGetName")?;
        let len = usize::try_from(len).unwrap_or(0);
        if name.is_null() || len == 0 {
            return Err(code::INVALID_VALUE);
        }
        let bytes = DEVICE_NAME.as_bytes();
        let n = bytes.len().min(len - 1);
        // SAFETY: the caller's buffer holds `len` bytes; we write n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// The value of a device attribute, as an sm_80 part with one multiprocessor would report
/// it; `None` for attributes the stand-in does not model.
fn attribute(attribute: c_int) -> Option<c_int> {
    Some(match attribute {
        1 => MAX_THREADS_PER_BLOCK as c_int,     // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,                           // MAX_BLOCK_DIM_X, _Y
        4 => 64,                                 // MAX_BLOCK_DIM_Z
        5 => i32::MAX,                           // MAX_GRID_DIM_X
        6 | 7 => 65535,                          // MAX_GRID_DIM_Y, _Z
        8 => MAX_SHARED_PER_BLOCK as c_int,      // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 65536,                              // TOTAL_CONSTANT_MEMORY
        10 => 32,                                // WARP_SIZE
        12 => 65536,                             // MAX_REGISTERS_PER_BLOCK
        13 => 1_410_000,                         // CLOCK_RATE (kHz)
        14 => 256,                               // TEXTURE_ALIGNMENT
        15 => 1,                                 // GPU_OVERLAP
        16 => 1,                                 // MULTIPROCESSOR_COUNT
        17 => 0,                                 // KERNEL_EXEC_TIMEOUT
        18 => 0,                                 // INTEGRATED
        19 => 1,                                 // CAN_MAP_HOST_MEMORY
        20 => 0,                                 // COMPUTE_MODE (default)
        31 => 1,                                 // CONCURRENT_KERNELS
        33 | 34 | 50 => 0,                       // PCI bus / device / domain id
        39 => 2048,                              // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 2,                                 // ASYNC_ENGINE_COUNT
        41 => 1,                                 // UNIFIED_ADDRESSING
        75 => 8,                                 // COMPUTE_CAPABILITY_MAJOR
        76 => 0,                                 // COMPUTE_CAPABILITY_MINOR
        81 => 164 * 1024,                        // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        82 => 65536,                             // MAX_REGISTERS_PER_MULTIPROCESSOR
        83 => 1,                                 // MANAGED_MEMORY
        97 => MAX_SHARED_PER_BLOCK as c_int,     // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN (no opt-in)
        113 => c_int::from(!refuse_read_only()), // READ_ONLY_HOST_REGISTER_SUPPORTED
        115 => 1,                                // MEMORY_POOLS_SUPPORTED
        _ => return None,
    })
}

#[no_mangle]
unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    device: c_int,
) -> CuResult {
    entry("cuDeviceGetAttribute", || {
        check_device(device, "cuDeviceGetAttribute")?;
        let Some(v) = attribute(attrib) else {
            log(&format!(
                "cuDeviceGetAttribute({attrib}) refused: attribute not modelled by the stand-in"
            ));
            return Err(code::INVALID_VALUE);
        };
        // SAFETY: cudarc passes a live integer.
        unsafe { put(value, v, "cuDeviceGetAttribute") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: c_int) -> CuResult {
    entry("cuDeviceTotalMem_v2", || {
        check_device(device, "cuDeviceTotalMem_v2")?;
        // SAFETY: cudarc passes a live size_t.
        unsafe { put(bytes, memory::total_bytes(), "cuDeviceTotalMem_v2") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    entry("cuMemGetInfo_v2", || {
        let total_bytes = memory::total_bytes();
        // SAFETY: cudarc passes two live size_t.
        unsafe {
            put(
                free,
                total_bytes.saturating_sub(memory::used_bytes()),
                "cuMemGetInfo_v2",
            )?;
            put(total, total_bytes, "cuMemGetInfo_v2")
        }
    })
}

#[no_mangle]
unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut *mut c_void,
    device: c_int,
) -> CuResult {
    entry("cuDevicePrimaryCtxRetain", || {
        check_device(device, "cuDevicePrimaryCtxRetain")?;
        // SAFETY: cudarc passes a live CUcontext slot.
        unsafe { put(context, CONTEXT as *mut c_void, "cuDevicePrimaryCtxRetain") }
    })
}

#[no_mangle]
extern "C" fn cuDevicePrimaryCtxRelease_v2(device: c_int) -> CuResult {
    entry("cuDevicePrimaryCtxRelease_v2", || {
        check_device(device, "cuDevicePrimaryCtxRelease_v2")
    })
}

#[no_mangle]
unsafe extern "C" fn cuCtxGetCurrent(context: *mut *mut c_void) -> CuResult {
    let current = CURRENT.with(Cell::get);
    // SAFETY: cudarc passes a live CUcontext slot.
    entry("cuCtxGetCurrent", || unsafe {
        put(context, current as *mut c_void, "cuCtxGetCurrent")
    })
}

#[no_mangle]
extern "C" fn cuCtxSetCurrent(context: *mut c_void) -> CuResult {
    let value = context as usize;
    if value != 0 && value != CONTEXT {
        log(&format!(
            "cuCtxSetCurrent({value:#x}) refused: not the stand-in's context"
        ));
        return code::INVALID_CONTEXT;
    }
    CURRENT.with(|c| c.set(value));
    code::SUCCESS
}

#[no_mangle]
unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> CuResult {
    // SAFETY: the caller passes a live integer.
    entry("cuCtxGetDevice", || unsafe {
        put(device, 0, "cuCtxGetDevice")
    })
}

#[no_mangle]
extern "C" fn cuCtxSynchronize() -> CuResult {
    entry("cuCtxSynchronize", || {
        graph::refuse_context_sync("cuCtxSynchronize")?;
        stream::synchronize_all();
        sticky()
    })
}

#[no_mangle]
unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: c_uint) -> CuResult {
    entry("cuStreamCreate", || {
        let handle = stream::create(flags)?;
        // SAFETY: cudarc passes a live CUstream slot.
        unsafe { put(out, handle as *mut c_void, "cuStreamCreate") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut *mut c_void,
    flags: c_uint,
    _priority: c_int,
) -> CuResult {
    // SAFETY: same contract as cuStreamCreate; priorities do not change the emulation.
    unsafe { cuStreamCreate(out, flags) }
}

#[no_mangle]
extern "C" fn cuStreamDestroy_v2(handle: *mut c_void) -> CuResult {
    entry("cuStreamDestroy_v2", || stream::destroy(handle as usize))
}

#[no_mangle]
extern "C" fn cuStreamSynchronize(handle: *mut c_void) -> CuResult {
    entry("cuStreamSynchronize", || {
        stream::synchronize(handle as usize)?;
        sticky()
    })
}

#[no_mangle]
extern "C" fn cuStreamQuery(handle: *mut c_void) -> CuResult {
    guard("cuStreamQuery", code::UNKNOWN, || {
        match stream::query(handle as usize) {
            Ok(true) => code::SUCCESS,
            Ok(false) => code::NOT_READY,
            Err(e) => e,
        }
    })
}

#[no_mangle]
extern "C" fn cuStreamWaitEvent(
    handle: *mut c_void,
    event: *mut c_void,
    _flags: c_uint,
) -> CuResult {
    entry("cuStreamWaitEvent", || {
        stream::stream_wait_event(handle as usize, event as usize)
    })
}

#[no_mangle]
unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, flags: c_uint) -> CuResult {
    entry("cuEventCreate", || {
        let handle = stream::event_create(flags);
        // SAFETY: cudarc passes a live CUevent slot.
        unsafe { put(out, handle as *mut c_void, "cuEventCreate") }
    })
}

#[no_mangle]
extern "C" fn cuEventRecord(event: *mut c_void, handle: *mut c_void) -> CuResult {
    entry("cuEventRecord", || {
        stream::event_record(event as usize, handle as usize)
    })
}

#[no_mangle]
extern "C" fn cuEventQuery(event: *mut c_void) -> CuResult {
    guard(
        "cuEventQuery",
        code::UNKNOWN,
        || match stream::event_query(event as usize) {
            Ok(true) => code::SUCCESS,
            Ok(false) => code::NOT_READY,
            Err(e) => e,
        },
    )
}

#[no_mangle]
extern "C" fn cuEventSynchronize(event: *mut c_void) -> CuResult {
    entry("cuEventSynchronize", || {
        stream::event_synchronize(event as usize)?;
        sticky()
    })
}

#[no_mangle]
unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CuResult {
    entry("cuEventElapsedTime", || {
        let value = stream::event_elapsed(start as usize, end as usize)?;
        // SAFETY: cudarc passes a live float.
        unsafe { put(ms, value, "cuEventElapsedTime") }
    })
}

#[no_mangle]
extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CuResult {
    entry("cuEventDestroy_v2", || {
        stream::event_destroy(event as usize)
    })
}

#[no_mangle]
unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, bytes: usize) -> CuResult {
    entry("cuMemAlloc_v2", || {
        let ptr = memory::alloc_device(bytes)?;
        // SAFETY: cudarc passes a live CUdeviceptr slot.
        unsafe { put(out, ptr as u64, "cuMemAlloc_v2") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuMemAllocAsync(out: *mut u64, bytes: usize, handle: *mut c_void) -> CuResult {
    entry("cuMemAllocAsync", || {
        let s = stream::resolve(handle as usize, "cuMemAllocAsync")?;
        refuse_memory_node(&s, "cuMemAllocAsync")?;
        let ptr = memory::alloc_device(bytes)?;
        // SAFETY: cudarc passes a live CUdeviceptr slot.
        unsafe { put(out, ptr as u64, "cuMemAllocAsync") }
    })
}

#[no_mangle]
extern "C" fn cuMemFree_v2(ptr: u64) -> CuResult {
    entry("cuMemFree_v2", || {
        graph::refuse_unsafe_call("cuMemFree_v2")?;
        let unmap = memory::release(ptr as usize, Kind::Device, "cuMemFree_v2")?;
        // cuMemFree synchronises: work still using the memory finishes first.
        stream::synchronize_all();
        unmap();
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuMemFreeAsync(ptr: u64, handle: *mut c_void) -> CuResult {
    entry("cuMemFreeAsync", || {
        let s = stream::resolve(handle as usize, "cuMemFreeAsync")?;
        refuse_memory_node(&s, "cuMemFreeAsync")?;
        let unmap = memory::release(ptr as usize, Kind::Device, "cuMemFreeAsync")?;
        stream::submit_plain(handle as usize, "cuMemFreeAsync", Box::new(unmap))?;
        Ok(())
    })
}

#[no_mangle]
unsafe extern "C" fn cuMemHostAlloc(
    out: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CuResult {
    entry("cuMemHostAlloc", || {
        let ptr = memory::alloc_pinned(bytes)?;
        // SAFETY: cudarc passes a live pointer slot.
        unsafe { put(out, ptr as *mut c_void, "cuMemHostAlloc") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuMemAllocHost_v2(out: *mut *mut c_void, bytes: usize) -> CuResult {
    // SAFETY: same contract as cuMemHostAlloc.
    unsafe { cuMemHostAlloc(out, bytes, 0) }
}

#[no_mangle]
extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> CuResult {
    entry("cuMemFreeHost", || {
        graph::refuse_unsafe_call("cuMemFreeHost")?;
        let unmap = memory::release(ptr as usize, Kind::PinnedOwned, "cuMemFreeHost")?;
        stream::synchronize_all();
        unmap();
        Ok(())
    })
}

/// `MOEC_STANDIN_REFUSE_READ_ONLY_REGISTER=1`: the device does not support read-only host
/// registration (`CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED` is 0), so
/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_READ_ONLY` fails with
/// `CUDA_ERROR_NOT_SUPPORTED`, as the driver documents for such a device.
fn refuse_read_only() -> bool {
    std::env::var("MOEC_STANDIN_REFUSE_READ_ONLY_REGISTER").is_ok_and(|v| v.trim() == "1")
}

/// The flags `cuMemHostRegister` knows: PORTABLE, DEVICEMAP, IOMEMORY, READ_ONLY.
const REGISTER_FLAGS: c_uint = 1 | 2 | 4 | 8;
const REGISTER_IOMEMORY: c_uint = 4;
const REGISTER_READ_ONLY: c_uint = 8;

#[no_mangle]
extern "C" fn cuMemHostRegister_v2(ptr: *mut c_void, bytes: usize, flags: c_uint) -> CuResult {
    entry("cuMemHostRegister_v2", || {
        let read_only = flags & REGISTER_READ_ONLY != 0;
        let refused = if flags & !REGISTER_FLAGS != 0 {
            log(&format!(
                "cuMemHostRegister_v2 refused: unknown flags {flags:#x} (CUDA_ERROR_INVALID_VALUE)"
            ));
            Err(code::INVALID_VALUE)
        } else if flags & REGISTER_IOMEMORY != 0 {
            log("cuMemHostRegister_v2 refused: CU_MEMHOSTREGISTER_IOMEMORY is not modelled (CUDA_ERROR_NOT_SUPPORTED)");
            Err(code::NOT_SUPPORTED)
        } else if read_only && refuse_read_only() {
            log(
                "cuMemHostRegister_v2 refused: CU_MEMHOSTREGISTER_READ_ONLY on a device without \
                 READ_ONLY_HOST_REGISTER_SUPPORTED (MOEC_STANDIN_REFUSE_READ_ONLY_REGISTER; \
                 CUDA_ERROR_NOT_SUPPORTED)",
            );
            Err(code::NOT_SUPPORTED)
        } else {
            memory::register(ptr as usize, bytes, read_only)
        };
        if refused.is_err() {
            counters::count("register:refused");
            return refused;
        }
        counters::count("register:calls");
        counters::add("register:bytes", bytes as u64);
        if read_only {
            counters::count("register:read_only_calls");
            counters::add("register:read_only_bytes", bytes as u64);
        }
        Ok(())
    })
}

/// Refuses a device write (`what`) into `[ptr, ptr + bytes)` where it meets a range
/// registered read-only: the driver maps such a range read-only for the device, so the
/// write faults (`CUDA_ERROR_ILLEGAL_ADDRESS`); counted as `read_only:writes_refused`.
fn refuse_read_only_write(ptr: usize, bytes: usize, call: &str, what: &str) -> Result<(), u32> {
    match memory::read_only_overlap(ptr, bytes) {
        Some((start, size)) => {
            counters::count("read_only:writes_refused");
            log(&format!(
                "{call} refused: {what} [{ptr:#x}, +{bytes}) writes into host memory registered \
                 read-only ({size} bytes at {start:#x}) (CUDA_ERROR_ILLEGAL_ADDRESS)"
            ));
            Err(code::ILLEGAL_ADDRESS)
        }
        None => Ok(()),
    }
}

#[no_mangle]
extern "C" fn cuMemHostUnregister(ptr: *mut c_void) -> CuResult {
    entry("cuMemHostUnregister", || {
        stream::synchronize_all();
        memory::unregister(ptr as usize)
    })
}

#[no_mangle]
unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut u64,
    ptr: *mut c_void,
    _flags: c_uint,
) -> CuResult {
    entry("cuMemHostGetDevicePointer_v2", || {
        if !memory::is_pinned(ptr as usize, 1) {
            log(&format!(
                "cuMemHostGetDevicePointer_v2({:#x}) refused: host memory used as pinned was never \
                 registered or allocated with cuMemHostAlloc",
                ptr as usize
            ));
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: the caller passes a live CUdeviceptr slot.
        unsafe { put(out, ptr as u64, "cuMemHostGetDevicePointer_v2") }
    })
}

/// Refuses a stream-ordered allocation or free on a capturing stream: graph memory nodes
/// are not modelled, so the capture is invalidated rather than recorded wrong.
fn refuse_memory_node(stream: &stream::Stream, call: &str) -> Result<(), u32> {
    if let Some(capture) = stream.capture() {
        capture.invalidate(call, "stream-ordered allocation (graph memory nodes)");
        log(&format!(
            "{call} refused: graph memory nodes are not modelled by the stand-in (CUDA_ERROR_NOT_SUPPORTED)"
        ));
        return Err(code::NOT_SUPPORTED);
    }
    Ok(())
}

fn host_range_ok(ptr: usize, bytes: usize, call: &str) -> Result<(), u32> {
    if ptr == 0 || ptr.checked_add(bytes).is_none() {
        log(&format!(
            "{call} refused: null or wrapping host range {ptr:#x} + {bytes}"
        ));
        return Err(code::INVALID_VALUE);
    }
    Ok(())
}

/// Host to device on `stream`: pinned sources are read when the stream gets there,
/// pageable ones are read now (snapshot), as the driver stages them.
fn htod(dst: u64, src: usize, bytes: usize, handle: usize, call: &str) -> Result<u64, u32> {
    if bytes == 0 {
        return Ok(0);
    }
    memory::check_device(dst as usize, bytes, call, "destination")?;
    host_range_ok(src, bytes, call)?;
    let work: Node = if memory::is_pinned(src, bytes) {
        copy_work(Addr(dst as usize), Addr(src), bytes)
    } else {
        let s = stream::resolve(handle, call)?;
        graph::refuse_on(&s, call, "a copy from pageable host memory")?;
        counters::count("relay:htod_calls");
        counters::add("relay:htod_bytes", bytes as u64);
        // SAFETY: the caller guarantees `src` is readable for `bytes` during the call.
        let snapshot = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec();
        let dst = Addr(dst as usize);
        Arc::new(move || {
            // SAFETY: the destination range was checked against a live allocation.
            unsafe { std::ptr::copy_nonoverlapping(snapshot.as_ptr(), dst.0 as *mut u8, bytes) }
        })
    };
    Ok(stream::submit(handle, call, delayed(work))?.1)
}

/// `MOEC_STANDIN_COPY_DELAY_MS`: every host-to-device copy first sleeps this long on its
/// stream, so work that should have waited for a copy (a missing event) runs before it
/// for certain, not by chance (the dropped-event test sets it).
fn copy_delay() -> Option<std::time::Duration> {
    static DELAY: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        std::env::var("MOEC_STANDIN_COPY_DELAY_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .map(std::time::Duration::from_millis)
    })
}

fn delayed(work: Node) -> Node {
    match copy_delay() {
        Some(delay) => Arc::new(move || {
            std::thread::sleep(delay);
            work()
        }),
        None => work,
    }
}

/// Device to host on `stream`: into pinned memory asynchronously; into pageable memory the
/// call returns when the data arrived.
fn dtoh(
    dst: usize,
    src: u64,
    bytes: usize,
    handle: usize,
    call: &str,
    blocking: bool,
) -> Result<(), u32> {
    if bytes == 0 {
        return Ok(());
    }
    memory::check_device(src as usize, bytes, call, "source")?;
    host_range_ok(dst, bytes, call)?;
    refuse_read_only_write(dst, bytes, call, "destination")?;
    let pinned = memory::is_pinned(dst, bytes);
    if !pinned {
        counters::count("relay:dtoh_calls");
        counters::add("relay:dtoh_bytes", bytes as u64);
    }
    if blocking || !pinned {
        let s = stream::resolve(handle, call)?;
        let why = if pinned {
            "a synchronous copy to the host"
        } else {
            "a copy to pageable host memory"
        };
        graph::refuse_on(&s, call, why)?;
    }
    let (stream, ticket) = stream::submit(
        handle,
        call,
        copy_work(Addr(dst), Addr(src as usize), bytes),
    )?;
    if blocking || !pinned {
        stream.wait_for(ticket);
    }
    Ok(())
}

fn dtod(dst: u64, src: u64, bytes: usize, handle: usize, call: &str) -> Result<(), u32> {
    if bytes == 0 {
        return Ok(());
    }
    refuse_read_only_write(dst as usize, bytes, call, "destination")?;
    memory::check_device(dst as usize, bytes, call, "destination")?;
    memory::check_device(src as usize, bytes, call, "source")?;
    stream::submit(
        handle,
        call,
        copy_work(Addr(dst as usize), Addr(src as usize), bytes),
    )?;
    Ok(())
}

#[no_mangle]
extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    handle: *mut c_void,
) -> CuResult {
    entry("cuMemcpyHtoDAsync_v2", || {
        htod(
            dst,
            src as usize,
            bytes,
            handle as usize,
            "cuMemcpyHtoDAsync_v2",
        )
        .map(drop)
    })
}

#[no_mangle]
extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, bytes: usize) -> CuResult {
    entry("cuMemcpyHtoD_v2", || {
        graph::refuse_unsafe_call("cuMemcpyHtoD_v2")?;
        htod(dst, src as usize, bytes, 0, "cuMemcpyHtoD_v2")?;
        stream::synchronize(0)
    })
}

#[no_mangle]
extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    handle: *mut c_void,
) -> CuResult {
    entry("cuMemcpyDtoHAsync_v2", || {
        dtoh(
            dst as usize,
            src,
            bytes,
            handle as usize,
            "cuMemcpyDtoHAsync_v2",
            false,
        )
    })
}

#[no_mangle]
extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, bytes: usize) -> CuResult {
    entry("cuMemcpyDtoH_v2", || {
        graph::refuse_unsafe_call("cuMemcpyDtoH_v2")?;
        dtoh(dst as usize, src, bytes, 0, "cuMemcpyDtoH_v2", true)
    })
}

#[no_mangle]
extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    bytes: usize,
    handle: *mut c_void,
) -> CuResult {
    entry("cuMemcpyDtoDAsync_v2", || {
        dtod(dst, src, bytes, handle as usize, "cuMemcpyDtoDAsync_v2")
    })
}

#[no_mangle]
extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, bytes: usize) -> CuResult {
    entry("cuMemcpyDtoD_v2", || {
        graph::refuse_unsafe_call("cuMemcpyDtoD_v2")?;
        dtod(dst, src, bytes, 0, "cuMemcpyDtoD_v2")?;
        stream::synchronize(0)
    })
}

fn memset(dst: u64, value: u8, bytes: usize, handle: usize, call: &str) -> Result<(), u32> {
    if bytes == 0 {
        return Ok(());
    }
    refuse_read_only_write(dst as usize, bytes, call, "destination")?;
    memory::check_device(dst as usize, bytes, call, "destination")?;
    let dst = Addr(dst as usize);
    stream::submit(
        handle,
        call,
        Arc::new(move || {
            // SAFETY: the range was checked against a live device allocation.
            unsafe { std::ptr::write_bytes(dst.0 as *mut u8, value, bytes) }
        }),
    )?;
    Ok(())
}

#[no_mangle]
extern "C" fn cuMemsetD8Async(dst: u64, value: u8, bytes: usize, handle: *mut c_void) -> CuResult {
    entry("cuMemsetD8Async", || {
        memset(dst, value, bytes, handle as usize, "cuMemsetD8Async")
    })
}

/// `cuStreamWriteValue32`: writes `value` at `addr` (device memory, or page-locked host
/// memory through its device address, which is the host address under unified
/// addressing) when the stream reaches it; refused when the 4 bytes are neither.
#[no_mangle]
extern "C" fn cuStreamWriteValue32_v2(
    handle: *mut c_void,
    addr: u64,
    value: u32,
    _flags: c_uint,
) -> CuResult {
    entry("cuStreamWriteValue32_v2", || {
        let at = addr as usize;
        if !memory::is_pinned(at, 4) {
            memory::check_device(at, 4, "cuStreamWriteValue32_v2", "address")?;
        }
        refuse_read_only_write(at, 4, "cuStreamWriteValue32_v2", "address")?;
        let dst = Addr(at);
        stream::submit(
            handle as usize,
            "cuStreamWriteValue32_v2",
            Arc::new(move || {
                // SAFETY: the 4 bytes were checked against a live allocation.
                unsafe { std::ptr::write_unaligned(dst.0 as *mut u32, value) }
            }),
        )?;
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, bytes: usize) -> CuResult {
    entry("cuMemsetD8_v2", || {
        graph::refuse_unsafe_call("cuMemsetD8_v2")?;
        memset(dst, value, bytes, 0, "cuMemsetD8_v2")?;
        stream::synchronize(0)
    })
}

/// (name, description) of a CUresult.
fn describe(result: u32) -> (&'static CStr, &'static CStr) {
    match result {
        code::SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        code::INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        code::OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        code::INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        code::INVALID_IMAGE => (
            c"CUDA_ERROR_INVALID_IMAGE",
            c"device kernel image is invalid",
        ),
        code::INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        code::INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        code::NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        code::NOT_READY => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        code::ILLEGAL_ADDRESS => (
            c"CUDA_ERROR_ILLEGAL_ADDRESS",
            c"an illegal memory access was encountered",
        ),
        code::LAUNCH_OUT_OF_RESOURCES => (
            c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            c"too many resources requested for launch",
        ),
        code::HOST_MEMORY_ALREADY_REGISTERED => (
            c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            c"part or all of the requested memory range is already mapped",
        ),
        code::HOST_MEMORY_NOT_REGISTERED => (
            c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            c"pointer does not correspond to a registered memory region",
        ),
        code::NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        _ => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
    }
}

#[no_mangle]
unsafe extern "C" fn cuGetErrorString(result: u32, out: *mut *const c_char) -> CuResult {
    // SAFETY: cudarc passes a live pointer slot; the strings are 'static.
    entry("cuGetErrorString", || unsafe {
        put(out, describe(result).1.as_ptr(), "cuGetErrorString")
    })
}

#[no_mangle]
unsafe extern "C" fn cuGetErrorName(result: u32, out: *mut *const c_char) -> CuResult {
    // SAFETY: cudarc passes a live pointer slot; the strings are 'static.
    entry("cuGetErrorName", || unsafe {
        put(out, describe(result).0.as_ptr(), "cuGetErrorName")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A range registered read-only may be copied to the device but never written by it:
    /// a device-to-host copy or a memset into it fails with CUDA_ERROR_ILLEGAL_ADDRESS and
    /// leaves its bytes alone, while the same copy into a range registered without the
    /// flag succeeds; unknown flags are refused.
    #[test]
    fn a_read_only_registration_is_never_written_by_the_device() {
        let mut host = vec![7u8; 8192];
        let mut plain = vec![0u8; 4096];
        let mut dev = 0u64;
        // SAFETY: `dev` is a live slot; the host buffers outlive their registrations.
        unsafe {
            assert_eq!(cuMemAlloc_v2(&mut dev, 4096), code::SUCCESS);
        }
        assert_eq!(cuMemsetD8_v2(dev, 1, 4096), code::SUCCESS);
        let ptr = host.as_mut_ptr().cast::<c_void>();
        assert_eq!(
            cuMemHostRegister_v2(ptr, 8192, 0x100),
            code::INVALID_VALUE,
            "unknown flag"
        );
        assert_eq!(
            cuMemHostRegister_v2(ptr, 8192, REGISTER_READ_ONLY | 1),
            code::SUCCESS
        );
        assert_eq!(
            cuMemcpyHtoD_v2(dev, ptr.cast_const(), 4096),
            code::SUCCESS,
            "reading it is allowed"
        );
        // SAFETY: the destination is the registered buffer, 8192 bytes long.
        let into = unsafe { ptr.cast::<u8>().add(1000) }.cast::<c_void>();
        assert_eq!(cuMemcpyDtoH_v2(into, dev, 100), code::ILLEGAL_ADDRESS);
        assert_eq!(
            cuMemsetD8_v2(into as u64, 0, 100),
            code::ILLEGAL_ADDRESS,
            "a memset through its (device-mapped) address"
        );
        assert!(host.iter().all(|&b| b == 7), "the device wrote it");
        let other = plain.as_mut_ptr().cast::<c_void>();
        assert_eq!(cuMemHostRegister_v2(other, 4096, 1), code::SUCCESS);
        assert_eq!(cuMemcpyDtoH_v2(other, dev, 4096), code::SUCCESS);
        // The device holds the 7s it read from the read-only range.
        assert!(plain.iter().all(|&b| b == 7));
        assert_eq!(cuMemHostUnregister(other), code::SUCCESS);
        assert_eq!(cuMemHostUnregister(ptr), code::SUCCESS);
        assert_eq!(cuMemFree_v2(dev), code::SUCCESS);
    }
}
