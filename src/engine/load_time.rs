//! Where a run's load clock starts: the process's own start, as the kernel recorded it.
//!
//! Takes nothing; gives [`process_age`], the time since this process started (so a run's
//! time to first token counts the exec, the dynamic loader and the command line's parsing,
//! as a user waiting for the first token does), and [`origin`], the instant a run's load
//! breakdown is measured from.

use std::time::{Duration, Instant};

/// How long ago this process started: the kernel's start time of it (`/proc/self/stat`,
/// in clock ticks since boot, 10 ms on most kernels) against `CLOCK_BOOTTIME` now; `None`
/// where there is no such file (not Linux) or it does not parse.
pub fn process_age() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name (field 2) is in parentheses and may hold spaces: fields are
        // counted after its closing one. `starttime` is field 22, the 20th after it.
        let rest = &stat[stat.rfind(')')? + 1..];
        let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
        // SAFETY: sysconf only reads a system constant.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if per_second <= 0 {
            return None;
        }
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `now` is a valid, writable timespec for the call to fill.
        if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) } != 0 {
            return None;
        }
        let now = Duration::new(now.tv_sec as u64, now.tv_nsec as u32);
        let started = Duration::from_secs_f64(ticks as f64 / per_second as f64);
        Some(now.saturating_sub(started))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The instant a run's load breakdown starts from and what to call it: the process's start
/// when `from_process_start` and it is known, else now (the run's call).
pub fn origin(from_process_start: bool) -> (Instant, &'static str) {
    let now = Instant::now();
    match from_process_start.then(process_age).flatten() {
        Some(age) => (now.checked_sub(age).unwrap_or(now), "process start"),
        None => (now, "run call"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_started_before_now() {
        // The test binary started before this test ran and not days ago.
        if let Some(age) = process_age() {
            assert!(age < Duration::from_secs(86_400), "{age:?}");
        }
        let (at, name) = origin(false);
        assert_eq!(name, "run call");
        assert!(at <= Instant::now());
    }
}
