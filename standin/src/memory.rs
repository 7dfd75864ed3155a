//! The stand-in's memory: "device" allocations, page-locked host allocations and host
//! ranges registered as pinned, all in host memory.
//!
//! Takes allocation, free and register calls; gives addresses a kernel compiled for the CPU
//! can dereference directly (a `CUdeviceptr` is the host address). Guarantees: every
//! allocation is 256-byte aligned, filled with 0xFF bytes (an f32 NaN, so reading memory
//! nothing wrote shows up instead of reading as zero), and ends less than 256 bytes before
//! an inaccessible guard page, so a kernel running past the end faults; freed memory is
//! unmapped, so a kernel touching it faults too. The table remembers freed ranges so a
//! later use is reported as "use after free", not as an unknown address.

use crate::driver::code;
use crate::{lock, log};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// What a range of memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Device memory (`cuMemAlloc*`).
    Device,
    /// Page-locked host memory the stand-in allocated (`cuMemHostAlloc`).
    PinnedOwned,
    /// Caller memory registered as page-locked (`cuMemHostRegister`); not ours to free.
    PinnedRegistered,
}

#[derive(Debug, Clone, Copy)]
struct Region {
    size: usize,
    kind: Kind,
    /// The whole mapping (start, length, guard page included); zero for registered ranges.
    map_start: usize,
    map_len: usize,
    /// Registered with `CU_MEMHOSTREGISTER_READ_ONLY`: the device may read it, never write.
    read_only: bool,
}

struct Table {
    live: BTreeMap<usize, Region>,
    /// Freed device and pinned allocations (start -> size), until the address is reused.
    freed: BTreeMap<usize, (usize, Kind)>,
    /// The freed allocations whose mapping is gone (a stream-ordered free has run), until
    /// the address is reused: work that reads one ran after its free.
    unmapped: BTreeMap<usize, usize>,
    device_bytes: usize,
}

static TABLE: Mutex<Table> = Mutex::new(Table {
    live: BTreeMap::new(),
    freed: BTreeMap::new(),
    unmapped: BTreeMap::new(),
    device_bytes: 0,
});

/// The device's memory size: `MOEC_STANDIN_DEVICE_BYTES` if set, else 16 GiB. Allocations
/// past it fail with `CUDA_ERROR_OUT_OF_MEMORY`, so budgets can be tested.
pub fn total_bytes() -> usize {
    std::env::var("MOEC_STANDIN_DEVICE_BYTES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(16 << 30)
}

/// Device bytes currently allocated.
pub fn used_bytes() -> usize {
    lock(&TABLE).device_bytes
}

fn page() -> usize {
    // SAFETY: sysconf with a valid name has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(4096)
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// Maps `size` bytes ending just before a guard page; returns (start of the allocation,
/// mapping start, mapping length).
fn map(size: usize) -> Option<(usize, usize, usize)> {
    let page = page();
    let body = round_up(size, page);
    let len = body.checked_add(page)?;
    // SAFETY: an anonymous private mapping with a null hint has no preconditions; the
    // result is checked against MAP_FAILED before use.
    let start = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if start == libc::MAP_FAILED {
        return None;
    }
    let start = start as usize;
    // SAFETY: [start + body, start + len) is the last page of the mapping just created.
    let guarded = unsafe { libc::mprotect((start + body) as *mut _, page, libc::PROT_NONE) };
    let offset = body - round_up(size, 256);
    if guarded != 0 {
        // SAFETY: unmapping exactly the mapping created above, which nothing else uses.
        unsafe { libc::munmap(start as *mut _, len) };
        return None;
    }
    // SAFETY: the allocation [start + offset, start + offset + size) lies inside the
    // writable part of the fresh mapping.
    unsafe { std::ptr::write_bytes((start + offset) as *mut u8, 0xFF, size) };
    Some((start + offset, start, len))
}

fn allocate(size: usize, kind: Kind) -> Result<usize, u32> {
    if size == 0 {
        log("allocation of 0 bytes refused (CUDA_ERROR_INVALID_VALUE)");
        return Err(code::INVALID_VALUE);
    }
    let mut table = lock(&TABLE);
    if kind == Kind::Device && table.device_bytes.saturating_add(size) > total_bytes() {
        log(&format!(
            "out of device memory: {size} bytes asked, {} of {} in use",
            table.device_bytes,
            total_bytes()
        ));
        return Err(code::OUT_OF_MEMORY);
    }
    let Some((ptr, map_start, map_len)) = map(size) else {
        log(&format!("host mmap of {size} bytes failed"));
        return Err(code::OUT_OF_MEMORY);
    };
    let stale: Vec<usize> = table
        .freed
        .range(..map_start + map_len)
        .filter(|(&start, &(len, _))| start + len > map_start)
        .map(|(&start, _)| start)
        .collect();
    for start in stale {
        table.freed.remove(&start);
        table.unmapped.remove(&start);
    }
    if kind == Kind::Device {
        table.device_bytes += size;
    }
    table.live.insert(
        ptr,
        Region {
            size,
            kind,
            map_start,
            map_len,
            read_only: false,
        },
    );
    Ok(ptr)
}

/// Allocates `size` bytes of device memory.
pub fn alloc_device(size: usize) -> Result<usize, u32> {
    allocate(size, Kind::Device)
}

/// Allocates `size` bytes of page-locked host memory.
pub fn alloc_pinned(size: usize) -> Result<usize, u32> {
    allocate(size, Kind::PinnedOwned)
}

/// Takes the allocation starting at `ptr` of kind `kind` out of the live table (later uses
/// are refused as use after free) and returns a closure that unmaps it, to run when the
/// stream that frees it reaches the free.
pub fn release(ptr: usize, kind: Kind, call: &str) -> Result<impl FnOnce() + Send, u32> {
    let mut table = lock(&TABLE);
    let region = match table.live.get(&ptr) {
        Some(region) if region.kind == kind => *region,
        _ => {
            let why = describe_missing(&table, ptr);
            log(&format!(
                "{call}({ptr:#x}) refused: not the start of a live {kind:?} allocation ({why})"
            ));
            return Err(code::INVALID_VALUE);
        }
    };
    table.live.remove(&ptr);
    if kind == Kind::Device {
        table.device_bytes -= region.size;
    }
    table.freed.insert(ptr, (region.size, kind));
    Ok(move || {
        // Recorded before the mapping goes, so no new mapping at this address can be
        // entered before it (an allocation drops the record when it reuses the address).
        lock(&TABLE).unmapped.insert(ptr, region.size);
        // SAFETY: the mapping was created by `map` for this region alone and has just been
        // taken out of the table, so no new user can be handed it; work queued before the
        // free has finished when the stream runs this.
        unsafe { libc::munmap(region.map_start as *mut _, region.map_len) };
    })
}

/// Registers caller memory `[ptr, ptr + size)` as page-locked; with `read_only`, as memory
/// the device may only read (`CU_MEMHOSTREGISTER_READ_ONLY`).
pub fn register(ptr: usize, size: usize, read_only: bool) -> Result<(), u32> {
    if ptr == 0 || size == 0 {
        log("cuMemHostRegister of a null or empty range refused");
        return Err(code::INVALID_VALUE);
    }
    let mut table = lock(&TABLE);
    if let Some((start, region)) = containing(&table, ptr.saturating_add(size - 1)) {
        if start < ptr + size && start + region.size > ptr {
            log(&format!(
                "cuMemHostRegister({ptr:#x}, {size}) refused: overlaps registered/pinned memory at {start:#x}"
            ));
            return Err(code::HOST_MEMORY_ALREADY_REGISTERED);
        }
    }
    table.live.insert(
        ptr,
        Region {
            size,
            kind: Kind::PinnedRegistered,
            map_start: 0,
            map_len: 0,
            read_only,
        },
    );
    Ok(())
}

/// Unregisters memory registered at `ptr`.
pub fn unregister(ptr: usize) -> Result<(), u32> {
    let mut table = lock(&TABLE);
    match table.live.get(&ptr) {
        Some(region) if region.kind == Kind::PinnedRegistered => {
            table.live.remove(&ptr);
            Ok(())
        }
        _ => {
            log(&format!(
                "cuMemHostUnregister({ptr:#x}) refused: this host memory was never registered \
                 (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)"
            ));
            Err(code::HOST_MEMORY_NOT_REGISTERED)
        }
    }
}

/// The first range registered read-only that `[ptr, ptr + len)` meets, as (start, size).
pub fn read_only_overlap(ptr: usize, len: usize) -> Option<(usize, usize)> {
    let table = lock(&TABLE);
    let end = ptr.saturating_add(len.max(1));
    containing(&table, ptr)
        .into_iter()
        .chain(table.live.range(ptr..end).map(|(&s, r)| (s, *r)))
        .find(|(start, region)| region.read_only && *start < end && start + region.size > ptr)
        .map(|(start, region)| (start, region.size))
}

/// Every range registered read-only, as (start, size): what a kernel must leave as it was.
pub fn read_only_ranges() -> Vec<(usize, usize)> {
    lock(&TABLE)
        .live
        .iter()
        .filter(|(_, r)| r.read_only)
        .map(|(&s, r)| (s, r.size))
        .collect()
}

/// The bytes of each of `ranges` (registered read-only ranges a kernel may read), taken
/// before the kernel runs; empty when there are none (the common case costs nothing).
pub fn snapshot(ranges: &[(usize, usize)]) -> Vec<Vec<u8>> {
    ranges
        .iter()
        .map(|&(start, size)| {
            // SAFETY: the range is a live registration (checked at the launch's
            // submission); registered memory stays mapped until it is unregistered,
            // which synchronises every stream first, so not while this kernel runs.
            unsafe { std::slice::from_raw_parts(start as *const u8, size) }.to_vec()
        })
        .collect()
}

/// After a kernel: a range registered read-only whose bytes differ from `before` was
/// written by the device, which a real device refuses (the range is mapped read-only for
/// it): the bytes are put back, the write is logged and counted
/// (`read_only:writes_refused`) and the context gets the sticky
/// `CUDA_ERROR_ILLEGAL_ADDRESS` its next synchronisation returns.
pub fn check_unwritten(ranges: &[(usize, usize)], before: Vec<Vec<u8>>, call: &str) {
    for (&(start, size), old) in ranges.iter().zip(before) {
        // SAFETY: as in `snapshot`: a live registration of `size` bytes.
        let now = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, size) };
        if let Some(at) = now.iter().zip(&old).position(|(a, b)| a != b) {
            now.copy_from_slice(&old);
            crate::counters::count("read_only:writes_refused");
            log(&format!(
                "{call}: the kernel wrote byte {:#x} of host memory registered read-only \
                 ({size} bytes at {start:#x}); a device faults there (CUDA_ERROR_ILLEGAL_ADDRESS, \
                 sticky)",
                start + at
            ));
            crate::driver::set_sticky(code::ILLEGAL_ADDRESS);
        }
    }
}

fn containing(table: &Table, addr: usize) -> Option<(usize, Region)> {
    table
        .live
        .range(..=addr)
        .next_back()
        .filter(|(&start, region)| addr < start + region.size.max(1))
        .map(|(&start, region)| (start, *region))
}

fn describe_missing(table: &Table, addr: usize) -> String {
    match table.freed.range(..=addr).next_back() {
        Some((&start, &(size, kind))) if addr <= start + size => format!(
            "use after free: {addr:#x} is in the {kind:?} allocation of {size} bytes at {start:#x}, \
             already freed"
        ),
        _ => format!("{addr:#x} is in no live allocation"),
    }
}

/// Checks that `[ptr, ptr + len)` lies inside one live device allocation.
pub fn check_device(ptr: usize, len: usize, call: &str, what: &str) -> Result<(), u32> {
    let table = lock(&TABLE);
    match containing(&table, ptr) {
        Some((start, region)) if region.kind == Kind::Device => {
            if ptr.saturating_add(len) <= start + region.size {
                Ok(())
            } else {
                log(&format!(
                    "{call} refused: {what} [{ptr:#x}, +{len}) runs past the end of the device \
                     allocation of {} bytes at {start:#x} by {} bytes",
                    region.size,
                    ptr + len - (start + region.size)
                ));
                Err(code::INVALID_VALUE)
            }
        }
        Some((start, region)) => {
            log(&format!(
                "{call} refused: {what} {ptr:#x} is host memory ({:?} at {start:#x}), not device memory",
                region.kind
            ));
            Err(code::INVALID_VALUE)
        }
        None => {
            log(&format!(
                "{call} refused: {what}: {}",
                describe_missing(&table, ptr)
            ));
            Err(code::INVALID_VALUE)
        }
    }
}

/// Whether host range `[ptr, ptr + len)` is page-locked (allocated or registered as such).
pub fn is_pinned(ptr: usize, len: usize) -> bool {
    let table = lock(&TABLE);
    matches!(containing(&table, ptr), Some((start, region))
        if region.kind != Kind::Device && ptr.saturating_add(len) <= start + region.size)
}

/// Checks a pointer a kernel receives: null, or inside (or one past the end of) a live
/// device or page-locked allocation. Returns what is wrong otherwise.
pub fn check_kernel_pointer(ptr: usize) -> Result<(), String> {
    if ptr == 0 {
        return Ok(());
    }
    let table = lock(&TABLE);
    let inside = table
        .live
        .range(..=ptr)
        .next_back()
        .is_some_and(|(&start, region)| ptr <= start + region.size);
    if inside {
        Ok(())
    } else {
        Err(describe_missing(&table, ptr))
    }
}

/// Checks, when a launch runs, that a pointer parameter (checked live when the launch was
/// submitted) does not point into an allocation whose stream-ordered free has run since:
/// the work that freed it was not ordered after this launch. A freed allocation whose free
/// has not run yet is still valid, as on a GPU.
pub fn check_kernel_pointer_at_run(ptr: usize) -> Result<(), String> {
    if ptr == 0 {
        return Ok(());
    }
    let table = lock(&TABLE);
    match table.unmapped.range(..=ptr).next_back() {
        Some((&start, &size)) if ptr <= start + size && containing(&table, ptr).is_none() => {
            Err(format!(
                "use after free: {ptr:#x} is in the allocation of {size} bytes at {start:#x}, \
                 live when the launch was submitted, whose free ran before the launch did"
            ))
        }
        _ => Ok(()),
    }
}

/// The handler that was installed before ours, restored when a fault happens.
static mut PREVIOUS: [Option<libc::sigaction>; 2] = [None, None];

/// On SIGSEGV/SIGBUS: says on stderr (async-signal-safely) that stand-in memory was
/// touched outside every live allocation, restores the previous handler and returns, so
/// the fault repeats and ends the process as it would have (Rust's stack-overflow report
/// included).
extern "C" fn on_fault(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    let mut line = *b"moec-standin: memory fault at 0x0000000000000000: if a kernel or copy did this, it touched memory outside every live allocation (past an allocation's end, or freed)\n";
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let address = unsafe { (*info).si_addr() } as usize;
    let digits = b"0123456789abcdef";
    let start = "moec-standin: memory fault at 0x".len();
    for i in 0..16 {
        line[start + i] = digits[(address >> (60 - 4 * i)) & 0xf];
    }
    // SAFETY: write(2) and sigaction(2) are async-signal-safe; PREVIOUS is written once,
    // before the handler is installed, and only read here.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        let slot = if signal == libc::SIGSEGV { 0 } else { 1 };
        let previous = (*std::ptr::addr_of!(PREVIOUS))[slot];
        match previous {
            Some(action) => libc::sigaction(signal, &action, std::ptr::null_mut()),
            None => libc::signal(signal, libc::SIG_DFL) as libc::c_int,
        };
    }
}

/// Installs a SIGSEGV/SIGBUS handler, once per process, that prints the faulting address
/// before the process dies as it would have (the previous handler is chained).
pub fn install_fault_report() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (slot, signal) in [libc::SIGSEGV, libc::SIGBUS].into_iter().enumerate() {
            // SAFETY: a zeroed sigaction is a valid starting point; the handler has the
            // SA_SIGINFO signature; PREVIOUS is written before our handler can run.
            unsafe {
                let mut old: libc::sigaction = std::mem::zeroed();
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_fault as *const () as usize;
                action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut action.sa_mask);
                if libc::sigaction(signal, std::ptr::null(), &mut old) == 0 {
                    (*std::ptr::addr_of_mut!(PREVIOUS))[slot] = Some(old);
                }
                libc::sigaction(signal, &action, std::ptr::null_mut());
            }
        }
    });
}
