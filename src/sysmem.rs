//! What the operating system says about this machine's memory.
//!
//! Takes nothing; gives the bytes `/proc/meminfo` reports as available (`MemAvailable`:
//! what can be allocated without swapping) and in all (`MemTotal`). `None` where that file does not exist or
//! does not parse (not Linux): callers then skip what depends on it and say so.

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
