//! What the operating system says about this machine's memory.
//!
//! Takes nothing; gives the bytes `/proc/meminfo` reports as available (`MemAvailable`:
//! what can be allocated without swapping) and in all (`MemTotal`). `None` where that file does not exist or
//! does not parse (not Linux): callers then skip what depends on it and say so. And, for a
//! run (every run: its peak RSS must follow what is live), has the C allocator give freed
//! memory back at once.

/// Bytes of memory the OS can still give (`MemAvailable` of /proc/meminfo), if known.
pub fn available_bytes() -> Option<u64> {
    meminfo_field("MemAvailable:")
}

/// Bytes of RAM the machine has (`MemTotal` of /proc/meminfo), if known.
pub fn total_bytes() -> Option<u64> {
    meminfo_field("MemTotal:")
}

/// A `/proc/meminfo` line's value in bytes (the file gives kiB).
fn meminfo_field(name: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// Bytes from which glibc serves a block by its own `mmap` once
/// [`return_freed_memory`] has run: what is freed at or above it leaves the process.
pub const MMAP_THRESHOLD: usize = 1 << 20;

/// Has the C allocator give freed big blocks back to the OS at once, for a run whose peak
/// RSS must stay within `--host-mem`: blocks of [`MMAP_THRESHOLD`] bytes or more are mapped
/// on their own and unmapped when freed. glibc otherwise raises that threshold as big
/// blocks are freed and serves later ones from its heap, which keeps them resident: the
/// gate/up intermediates of a batch-16 prefill of Mixtral-8x7B Q4_K_M from disk stayed,
/// and the run peaked 270 MB above its planned 15.90 GB (16.17 GB against a 16 GB budget);
/// with the threshold fixed, 47 MB above (15.95 GB). Gives the line for the run's notes;
/// `None` where the allocator is not glibc's.
pub fn return_freed_blocks() -> Option<String> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` takes plain integers and changes only glibc's own tuning, under
        // its arena lock; this process has allocated already, so glibc's first-use
        // initialisation (the one part that is not thread-safe) is behind it.
        let set = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) };
        Some(if set == 1 {
            format!(
                "allocator: blocks of {} MiB or more are mapped on their own and unmapped when \
                 freed, so the peak RSS follows what is live (held to --host-mem)",
                MMAP_THRESHOLD >> 20
            )
        } else {
            "allocator: glibc refused a fixed mmap threshold; freed big blocks may stay \
             resident and the peak RSS exceed what --host-mem counts"
                .to_string()
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}
