//! The quick probe of this machine, kept in the cache folder for the runs that follow it.
//!
//! A run without `--hw` is replayed on a quick probe of this machine (memory, moec's own
//! kernels, the runtime's dispatch costs), which takes seconds: in a release build about
//! as long as a tiny card's whole run, and several times longer in a debug build. Runs
//! in a row on one machine measure the same figures, so a probe is reused by the runs that
//! start within [`max_age`] of it (`MOEC_PROBE_MAX_AGE` seconds, default
//! [`DEFAULT_MAX_AGE_S`]; `0` probes every run), and only by runs that would have measured
//! the same things: the same executable (its size and modification time), CPU model,
//! threads, probe size, block formats and `MOEC_*` settings (which pick kernels) make the
//! key. The run report says whether its probe was taken for it or reused, and how old it
//! is. A missing, stale, unreadable or foreign file is probed again and rewritten, never
//! an error.

use crate::cost::hardware::HardwareProfile;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How long a probe is reused unless `MOEC_PROBE_MAX_AGE` says otherwise.
pub const DEFAULT_MAX_AGE_S: u64 = 600;

/// The environment variable that sets [`max_age`].
pub const MAX_AGE_VAR: &str = "MOEC_PROBE_MAX_AGE";

/// Where a run's quick probe came from (the report's `probe:` line).
#[derive(Debug, Clone, PartialEq)]
pub enum ProbeOrigin {
    /// Measured for this run, and kept for the runs that start within `kept_for`.
    Taken {
        /// [`max_age`] (zero: not kept).
        kept_for: Duration,
    },
    /// Read from `path`, measured `age` before this run.
    Reused {
        /// The cache file.
        path: PathBuf,
        /// Its age when read.
        age: Duration,
    },
}

/// The oldest probe a run reuses: `MOEC_PROBE_MAX_AGE` seconds, else
/// [`DEFAULT_MAX_AGE_S`]; an unparsable value is an error naming it.
pub fn max_age() -> Result<Duration, String> {
    match std::env::var(MAX_AGE_VAR) {
        Err(_) => Ok(Duration::from_secs(DEFAULT_MAX_AGE_S)),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| {
                format!("{MAX_AGE_VAR}={v:?} is not a whole number of seconds (0 probes every run)")
            }),
    }
}

/// What a probe measured with: the key a reused probe must match. `None` when the
/// executable cannot be identified (then nothing is reused).
pub fn key(
    threads: usize,
    buffer_bytes: usize,
    formats: &[crate::quant::QuantFormat],
) -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let meta = std::fs::metadata(&exe).ok()?;
    let modified = meta
        .modified()
        .ok()?
        .duration_since(SystemTime::UNIX_EPOCH)
        .ok()?
        .as_nanos();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let mut settings: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("MOEC_") && k != MAX_AGE_VAR && k != "MOEC_CACHE_DIR")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    settings.sort();
    let formats: Vec<&str> = formats.iter().map(|f| f.name()).collect();
    Some(format!(
        "moec {} exe {} {} bytes {modified} ns; cpu {cpu}; threads {threads}; buffer {buffer_bytes}; formats {}; settings {}",
        env!("CARGO_PKG_VERSION"),
        exe.display(),
        meta.len(),
        formats.join(","),
        settings.join(" ")
    ))
}

/// The cache file for `key` under `dir`.
pub fn path(dir: &Path, key: &str) -> PathBuf {
    let hash = crate::weights::synth::fnv1a(key);
    dir.join("probes")
        .join(format!("this-machine-{hash:016x}.ron"))
}

/// The probe stored for `key` in `file` if it is at most `max_age` old and was stored
/// under the same key (its first line); `None` otherwise.
pub fn read(file: &Path, key: &str, max_age: Duration) -> Option<(HardwareProfile, Duration)> {
    if max_age.is_zero() {
        return None;
    }
    let age = std::fs::metadata(file)
        .ok()?
        .modified()
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())?;
    if age > max_age {
        return None;
    }
    let text = std::fs::read_to_string(file).ok()?;
    let (first, body) = text.split_once('\n')?;
    if first.strip_prefix("// key: ")? != key {
        return None;
    }
    let profile = HardwareProfile::from_ron(body, &file.display().to_string()).ok()?;
    Some((profile, age))
}

/// Stores `profile` for `key` in `file`, whole or not at all (a temporary file renamed
/// over it), so a run reading it at the same time sees the old probe or the new one.
pub fn write(file: &Path, key: &str, profile: &HardwareProfile) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = crate::tempfiles::temp_beside(file, "moec");
    let _guard = crate::tempfiles::register(&tmp);
    std::fs::write(&tmp, format!("// key: {key}\n{}", profile.to_ron()))
        .and_then(|()| std::fs::rename(&tmp, file))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_probe_is_read_back_whole_only_under_its_key_and_age() {
        let dir = tempfile::tempdir().unwrap();
        let mut profile = HardwareProfile::load("t4").unwrap();
        profile.name = "this-machine".into();
        profile.cpu.mem_bw_gb_s = 13.837_219_512_3;
        let key = "moec test key";
        let file = path(dir.path(), key);
        write(&file, key, &profile).unwrap();
        let hour = Duration::from_secs(3600);
        let (back, age) = read(&file, key, hour).expect("a fresh probe is reused");
        assert_eq!(back, profile, "every figure round-trips exactly");
        assert!(age < hour);
        assert!(read(&file, "another key", hour).is_none());
        assert!(read(&file, key, Duration::ZERO).is_none());
        std::fs::write(&file, "// key: moec test key\n(not a profile").unwrap();
        assert!(
            read(&file, key, hour).is_none(),
            "a corrupt file is probed again"
        );
        assert_ne!(path(dir.path(), "a"), path(dir.path(), "b"));
    }
}
