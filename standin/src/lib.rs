//! moec-standin: a stand-in for the CUDA driver, cuBLAS and NVRTC, for testing moec's CUDA
//! path on machines without a GPU. It is a test tool: nothing in moec loads it unless a
//! test (or a user) puts it on the loader path under the CUDA library names.
//!
//! Takes the C calls cudarc makes (`cu*`, `cublas*`, `nvrtc*`, exported unmangled from one
//! cdylib so the three "libraries" share one instance when symlinked as `libcuda.so`,
//! `libcublas.so` and `libnvrtc.so`). Gives a single sm_80-like device whose memory is host
//! memory, one OS thread per CUDA stream running its work in submission order, CUDA's event
//! semantics, and kernels that are the `.cu` source itself compiled for the CPU with the
//! builtin emulation of `kernels/cpu_emulation/shim.h` (see [`module`]). cuBLAS GEMMs are
//! plain reference loops ([`cublas`]). Stream capture makes graphs whose work runs only
//! when they are launched ([`graph`]).
//!
//! Guarantees: what a real driver refuses is refused with the real error code and a line
//! on stderr starting `moec-standin:` (out-of-bounds copies, launches whose pointer
//! arguments are outside every live allocation, use after free, unknown kernels and
//! handles, unregistering host memory that was never registered). Streams really run
//! concurrently, so a missing event shows up as a race, not as luck. No exported function
//! panics across the C boundary: every entry point catches panics and reports them as an
//! error code.

pub mod counters;
pub mod cublas;
pub mod driver;
pub mod graph;
pub mod launch;
pub mod memory;
pub mod module;
pub mod nvrtc;
pub mod stream;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Writes one diagnostic line to stderr, prefixed so test output shows where it came from.
pub fn log(message: &str) {
    eprintln!("moec-standin: {message}");
}

/// Locks a mutex, recovering the data if another thread panicked while holding it (the
/// stand-in's tables stay consistent at every await point, so the data is still usable).
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A table of live objects of one kind (streams, events, modules, ...) keyed by the opaque
/// handle value handed to the caller. Handles are never reused, so a destroyed handle is
/// reported as invalid instead of silently naming a newer object.
pub struct Handles<T> {
    next: AtomicUsize,
    live: Mutex<BTreeMap<usize, Arc<T>>>,
}

impl<T> Handles<T> {
    /// An empty table whose handles start at `base` (distinct bases per kind make a handle
    /// of the wrong kind fail the lookup, and keep clear of the special stream values 0-2).
    pub const fn new(base: usize) -> Self {
        Handles {
            next: AtomicUsize::new(base),
            live: Mutex::new(BTreeMap::new()),
        }
    }

    fn map(&self) -> MutexGuard<'_, BTreeMap<usize, Arc<T>>> {
        lock(&self.live)
    }

    /// Registers `value` and returns its handle (16-aligned so it looks like a pointer).
    pub fn insert(&self, value: Arc<T>) -> usize {
        let handle = self.next.fetch_add(16, Ordering::Relaxed);
        self.map().insert(handle, value);
        handle
    }

    /// The object behind `handle`, if it is live.
    pub fn get(&self, handle: usize) -> Option<Arc<T>> {
        self.map().get(&handle).cloned()
    }

    /// Removes `handle`, returning its object if it was live.
    pub fn remove(&self, handle: usize) -> Option<Arc<T>> {
        self.map().remove(&handle)
    }

    /// Every live object.
    pub fn all(&self) -> Vec<Arc<T>> {
        self.map().values().cloned().collect()
    }
}

/// Runs `body`, turning a panic into `on_panic` (unwinding across `extern "C"` would abort
/// the caller's process with no message; this logs the panic and returns an error code).
pub fn guard<R>(call: &str, on_panic: R, body: impl FnOnce() -> R) -> R {
    // Exported entry points are one word; internal uses ("stream work") are not counted.
    if !call.contains(' ') {
        counters::count(call);
        counters::trace(call);
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            log(&format!("{call}: internal error: {what}"));
            on_panic
        }
    }
}
