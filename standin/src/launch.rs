//! Modules and launches: `cuModuleLoadData`/`GetFunction`/`Unload`, `cuLaunchKernel` and
//! `cuLaunchHostFunc`, exported unmangled for cudarc's loader.
//!
//! Takes images from the stand-in NVRTC ([`crate::module`]) and launches of their kernels;
//! gives the launch on its stream. Guarantees: the parameter bytes are copied at call time
//! (their sizes come from the kernel's signature), pointer parameters outside every live
//! allocation or page-locked range are refused with `CUDA_ERROR_ILLEGAL_ADDRESS`, grids
//! and blocks a GPU would refuse are refused, and launches run one at a time (the
//! emulation's grid state is process-global) while copies and GEMMs on other streams still
//! overlap them.

use crate::driver::{code, entry, put, CuResult, MAX_SHARED_PER_BLOCK, MAX_THREADS_PER_BLOCK};
use crate::memory;
use crate::module::{Kernel, Module};
use crate::stream;
use crate::{lock, log, Handles};
use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex};

static MODULES: Handles<Module> = Handles::new(0x8000_0000);

/// A function handle's target: the kernel and the module it came from.
struct Function {
    module: usize,
    kernel: Arc<Kernel>,
}

static FUNCTIONS: Handles<Function> = Handles::new(0x9000_0000);

/// One launch at a time: the shim's grid state (blockDim, barriers, `__shared__` statics) is
/// process-global. Copies and GEMMs on other streams still overlap with a launch.
static DEVICE: Mutex<()> = Mutex::new(());

#[no_mangle]
unsafe extern "C" fn cuModuleLoadData(out: *mut *mut c_void, image: *const c_void) -> CuResult {
    entry("cuModuleLoadData", || {
        if image.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: cudarc passes a NUL-terminated image (its PTX as a C string).
        let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_string_lossy();
        let module = Module::load(&text).map_err(|e| {
            log(&format!("cuModuleLoadData refused: {e}"));
            code::INVALID_IMAGE
        })?;
        let handle = MODULES.insert(Arc::new(module));
        // SAFETY: cudarc passes a live CUmodule slot.
        unsafe { put(out, handle as *mut c_void, "cuModuleLoadData") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuModuleGetFunction(
    out: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CuResult {
    entry("cuModuleGetFunction", || {
        let Some(loaded) = MODULES.get(module as usize) else {
            log(&format!(
                "cuModuleGetFunction refused: unknown or unloaded module {:#x}",
                module as usize
            ));
            return Err(code::INVALID_HANDLE);
        };
        if name.is_null() {
            return Err(code::INVALID_VALUE);
        }
        // SAFETY: cudarc passes a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let kernel = loaded.function(&name).map_err(|e| {
            log(&format!("cuModuleGetFunction refused: unknown kernel: {e}"));
            code::NOT_FOUND
        })?;
        let handle = FUNCTIONS.insert(Arc::new(Function {
            module: module as usize,
            kernel: Arc::new(kernel),
        }));
        // SAFETY: cudarc passes a live CUfunction slot.
        unsafe { put(out, handle as *mut c_void, "cuModuleGetFunction") }
    })
}

#[no_mangle]
extern "C" fn cuModuleUnload(module: *mut c_void) -> CuResult {
    entry("cuModuleUnload", || {
        MODULES.remove(module as usize).map(drop).ok_or_else(|| {
            log(&format!(
                "cuModuleUnload refused: unknown module {:#x}",
                module as usize
            ));
            code::INVALID_HANDLE
        })
    })
}

/// The copied parameter bytes of one launch, each parameter 16-byte aligned.
struct Params {
    storage: Vec<u128>,
    offsets: Vec<usize>,
}

// SAFETY: Params owns its bytes; raw pointers into it are only built on the stream thread.
unsafe impl Send for Params {}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn cuLaunchKernel(
    function: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared_bytes: c_uint,
    handle: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    entry("cuLaunchKernel", || {
        let Some(function) = FUNCTIONS.get(function as usize) else {
            log(&format!(
                "cuLaunchKernel refused: unknown function handle {:#x}",
                function as usize
            ));
            return Err(code::INVALID_HANDLE);
        };
        let kernel = Arc::clone(&function.kernel);
        let call = format!("cuLaunchKernel({})", kernel.name);
        crate::counters::count(&format!("launch:{}", kernel.name));
        if MODULES.get(function.module).is_none() {
            log(&format!("{call} refused: its module was unloaded"));
            return Err(code::INVALID_HANDLE);
        }
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        if gx == 0 || gy == 0 || gz == 0 || threads == 0 || gy > 65535 || gz > 65535 || bz > 64 {
            log(&format!(
                "{call} refused: grid ({gx}, {gy}, {gz}) / block ({bx}, {by}, {bz}) out of range"
            ));
            return Err(code::INVALID_VALUE);
        }
        if threads > u64::from(MAX_THREADS_PER_BLOCK) {
            log(&format!(
                "{call} refused: {threads} threads per block (at most {MAX_THREADS_PER_BLOCK})"
            ));
            return Err(code::INVALID_VALUE);
        }
        if shared_bytes > MAX_SHARED_PER_BLOCK {
            log(&format!("{call} refused: {shared_bytes} bytes of dynamic shared memory (at most {MAX_SHARED_PER_BLOCK})"));
            return Err(code::INVALID_VALUE);
        }
        if !extra.is_null() {
            log(&format!(
                "{call} refused: `extra` parameter packing is not supported by the stand-in"
            ));
            return Err(code::NOT_SUPPORTED);
        }
        let n = kernel.sizes.len();
        if n > 0 && params.is_null() {
            log(&format!(
                "{call} refused: kernelParams is null but the kernel takes {n} parameters"
            ));
            return Err(code::INVALID_VALUE);
        }
        let mut offsets = Vec::with_capacity(n);
        let mut total = 0usize;
        for &size in &kernel.sizes {
            offsets.push(total);
            total += size.div_ceil(16) * 16;
        }
        let mut storage = vec![0u128; total / 16 + 1];
        // Ranges registered read-only that a pointer parameter points into: the kernel may
        // read them, and a write is found by comparing them before and after it runs.
        let mut read_only: Vec<(usize, usize)> = Vec::new();
        let bytes = storage.as_mut_ptr().cast::<u8>();
        for (i, (&size, &offset)) in kernel.sizes.iter().zip(&offsets).enumerate() {
            // SAFETY: `params` holds one pointer per parameter (the launch contract).
            let src = unsafe { *params.add(i) };
            if src.is_null() {
                log(&format!("{call} refused: kernelParams[{i}] is null"));
                return Err(code::INVALID_VALUE);
            }
            // SAFETY: kernelParams[i] points at the parameter's `size` bytes (the launch
            // contract); the destination has room for it at `offset`. Copying now is the
            // driver's contract: the caller's values may die when this call returns.
            unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), bytes.add(offset), size) };
            if kernel.pointers[i] && size == 8 {
                // SAFETY: the 8 bytes at `offset` were just written.
                let addr = unsafe { bytes.add(offset).cast::<u64>().read_unaligned() } as usize;
                if let Err(why) = memory::check_kernel_pointer(addr) {
                    log(&format!(
                        "{call} refused: pointer parameter {i}: {why} (CUDA_ERROR_ILLEGAL_ADDRESS)"
                    ));
                    return Err(code::ILLEGAL_ADDRESS);
                }
                if let Some(range) = memory::read_only_overlap(addr, 1) {
                    read_only.push(range);
                }
            }
        }
        let launch = Params { storage, offsets };
        let name = call.clone();
        let dims = [gx, gy, gz, bx, by, bz];
        stream::submit(
            handle as usize,
            &call,
            Arc::new(move || {
                // A copy per run: a graph may run the launch again with the same bytes.
                let mut storage = launch.storage.clone();
                let base = storage.as_mut_ptr().cast::<u8>();
                // SAFETY: every offset lies inside `storage`, which lives until the end of
                // this closure, after the launch returned.
                let mut pointers: Vec<*mut c_void> = launch
                    .offsets
                    .iter()
                    .map(|&o| unsafe { base.add(o) }.cast())
                    .collect();
                let _one_at_a_time = lock(&DEVICE);
                // A pointer parameter whose allocation was freed, and its free run, between
                // submission and now would fault or read whatever reuses the address: say
                // which and end the process, as a GPU's illegal address ends its context.
                for (i, &offset) in launch.offsets.iter().enumerate() {
                    if kernel.pointers[i] && kernel.sizes[i] == 8 {
                        // SAFETY: the 8 bytes at `offset` of `storage` are the parameter.
                        let addr = unsafe { base.add(offset).cast::<u64>().read_unaligned() };
                        if let Err(why) = crate::memory::check_kernel_pointer_at_run(addr as usize)
                        {
                            log(&format!(
                                "{name}: pointer parameter {i} when the launch ran: {why}"
                            ));
                            std::process::abort();
                        }
                    }
                }
                let before = crate::memory::snapshot(&read_only);
                // SAFETY: one pointer per parameter, each to its copied bytes; pointer
                // parameters were checked against live allocations at submission.
                unsafe { kernel.run(&dims, pointers.as_mut_ptr()) };
                crate::memory::check_unwritten(&read_only, before, &name);
            }),
        )?;
        Ok(())
    })
}

/// A host callback with its argument, run on a stream thread.
struct HostCall(unsafe extern "C" fn(*mut c_void), usize);

#[no_mangle]
extern "C" fn cuLaunchHostFunc(
    handle: *mut c_void,
    function: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CuResult {
    entry("cuLaunchHostFunc", || {
        let Some(function) = function else {
            log("cuLaunchHostFunc refused: null function");
            return Err(code::INVALID_VALUE);
        };
        let call = HostCall(function, data as usize);
        stream::submit(
            handle as usize,
            "cuLaunchHostFunc",
            Arc::new(move || {
                let call = &call;
                // SAFETY: the caller's contract: the function may be called once with its
                // data from a driver thread when the stream reaches it.
                unsafe { (call.0)(call.1 as *mut c_void) }
            }),
        )?;
        Ok(())
    })
}
