//! Call counters: how many times each exported entry point was called, and each kernel
//! launched, so a test can assert how many launches, GEMMs, synchronisations and uploads
//! an op costs (a figure a GPU profiler would give, read without one).
//!
//! Counting is on only when `MOEC_STANDIN_COUNTERS` names a file: at process exit the
//! counts are written there, one `name count` line each, sorted by name (`cuLaunchKernel`
//! also once per kernel as `launch:<entry>`). Calls the process made before the variable
//! was read count too: it is read on the first call.
//!
//! `MOEC_STANDIN_TRACE` names another file: at exit, every exported entry point called, one
//! name a line in the order the calls began (a test of call order: that the host read a
//! step's tokens after it launched the next step, say).

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

/// Where the counts go, if counting is on.
fn target() -> Option<&'static str> {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    TARGET
        .get_or_init(|| {
            let path = std::env::var("MOEC_STANDIN_COUNTERS")
                .ok()
                .filter(|p| !p.is_empty())?;
            extern "C" {
                fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
            }
            // SAFETY: `dump` is an `extern "C" fn()` that never unwinds (it catches
            // everything through `guard`) and touches only this module's statics, which
            // live until the process ends.
            unsafe { atexit(dump) };
            Some(path)
        })
        .as_deref()
}

fn counts() -> &'static Mutex<BTreeMap<String, u64>> {
    static COUNTS: OnceLock<Mutex<BTreeMap<String, u64>>> = OnceLock::new();
    COUNTS.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// Counts one call of `name` (an entry point, or `launch:<kernel>`), if counting is on.
pub fn count(name: &str) {
    add(name, 1);
}

/// Where the call trace goes, if tracing is on.
fn trace_target() -> Option<&'static str> {
    static TARGET: OnceLock<Option<String>> = OnceLock::new();
    TARGET
        .get_or_init(|| {
            let path = std::env::var("MOEC_STANDIN_TRACE")
                .ok()
                .filter(|p| !p.is_empty())?;
            extern "C" {
                fn atexit(callback: extern "C" fn()) -> std::os::raw::c_int;
            }
            // SAFETY: as for `dump`: never unwinds, touches only this module's statics.
            unsafe { atexit(dump_trace) };
            Some(path)
        })
        .as_deref()
}

/// Calls past which the trace stops growing (a run far larger than a test's).
const TRACE_LIMIT: usize = 1 << 20;

fn trace_calls() -> &'static Mutex<Vec<String>> {
    static CALLS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    CALLS.get_or_init(|| Mutex::new(Vec::new()))
}

/// Notes a call of entry point `name` in the trace, if tracing is on.
pub fn trace(name: &str) {
    if trace_target().is_none() {
        return;
    }
    let mut calls = crate::lock(trace_calls());
    if calls.len() < TRACE_LIMIT {
        calls.push(name.to_string());
    }
}

extern "C" fn dump_trace() {
    crate::guard("trace at exit", (), || {
        if let Some(path) = trace_target() {
            let mut text = crate::lock(trace_calls()).join("\n");
            text.push('\n');
            if let Err(e) = std::fs::write(path, text) {
                crate::log(&format!("cannot write the call trace to {path}: {e}"));
            }
        }
    });
}

/// Adds `n` to the count of `name` (bytes, for the byte counters), if counting is on.
///
/// Besides the entry points, the memory counters a test reads:
/// - `register:calls`, `register:bytes`: successful `cuMemHostRegister` calls and the
///   bytes they page-locked; `register:read_only_calls`, `register:read_only_bytes`: those
///   with `CU_MEMHOSTREGISTER_READ_ONLY`; `register:refused`: calls refused;
/// - `relay:htod_calls`, `relay:htod_bytes`, `relay:dtoh_calls`, `relay:dtoh_bytes`:
///   copies whose host side is pageable, which a real driver stages through its own
///   pinned buffer with a host memcpy (the relay a registered source avoids);
/// - `read_only:writes_refused`: device writes (a copy, a memset, a kernel) into a range
///   registered read-only.
pub fn add(name: &str, n: u64) {
    if target().is_none() {
        return;
    }
    let mut map = crate::lock(counts());
    match map.get_mut(name) {
        Some(count) => *count += n,
        None => {
            map.insert(name.to_string(), n);
        }
    }
}

/// The counts so far, as `name count` lines.
pub fn render() -> String {
    crate::lock(counts())
        .iter()
        .map(|(name, n)| format!("{name} {n}\n"))
        .collect()
}

extern "C" fn dump() {
    crate::guard("counters at exit", (), || {
        if let Some(path) = target() {
            if let Err(e) = std::fs::write(path, render()) {
                crate::log(&format!("cannot write the call counters to {path}: {e}"));
            }
        }
    });
}
