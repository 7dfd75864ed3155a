//! A run's load clock: where it starts (the process's own start, as the kernel recorded
//! it) and the breakdown of its time to first token.
//!
//! Takes nothing; gives [`process_age`], the time since this process started (so a run's
//! time to first token counts the exec, the dynamic loader and the command line's parsing,
//! as a user waiting for the first token does), [`origin`], the instant a run's load
//! breakdown is measured from, and the breakdown itself from the phases `engine::run`
//! timed and the instants of its generation.

use crate::records::load::{Laps, LoadBreakdown, LoadPhase};
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

/// Splits a phase that ran two things back to back into its parts: the first, named and
/// timed by its callee, and `rest`, the remainder.
pub(super) fn split_lap(phase: &mut LoadPhase, (first, first_seconds): (&str, f64), rest: &str) {
    let first_seconds = first_seconds.min(phase.seconds);
    phase.parts = vec![
        LoadPhase::new(first, first_seconds),
        LoadPhase::new(rest, phase.seconds - first_seconds),
    ];
}

/// The instants of a run's generation (`runtime::generate`), as the engine saw them.
pub(super) struct Generation {
    /// The call.
    pub(super) started: Instant,
    /// The backend's set-up inside it, as `runtime::generate` timed it.
    pub(super) backend_open: Option<LoadPhase>,
    /// The end of the first step that gave a token, and of the last step.
    pub(super) first_token: Option<Instant>,
    pub(super) last_token: Option<Instant>,
    /// Its return (the backend dropped), and the end of the replay after it.
    pub(super) ended: Instant,
    pub(super) replayed: Instant,
    /// Prompt tokens of the run.
    pub(super) prompt_tokens: usize,
}

/// The run's load breakdown: the phases timed so far (`laps`, from the clock's origin to
/// the call of `runtime::generate`), then the backend's set-up and the first prefill up to
/// the first token; after the last token, what the driver and the backend took to finish
/// and the replay.
pub(super) fn load_breakdown(laps: Laps, origin: &str, g: Generation) -> LoadBreakdown {
    let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
    let mut phases = laps.into_phases();
    let until = g.first_token.unwrap_or(g.ended);
    let generation = secs(g.started, until);
    let open = g
        .backend_open
        .unwrap_or_else(|| LoadPhase::new("backend open", 0.0));
    let open_seconds = open.seconds.min(generation);
    let prefill = generation - open_seconds;
    phases.push(LoadPhase {
        seconds: open_seconds,
        ..open
    });
    let what = if g.first_token.is_some() {
        "first prefill"
    } else {
        "run"
    };
    phases.push(
        LoadPhase::new(what, prefill).with_detail(format!("{} prompt tokens", g.prompt_tokens)),
    );
    let first_token_seconds = g
        .first_token
        .map(|_| phases.iter().map(|p| p.seconds).sum());
    let mut after = Vec::new();
    if let Some(last) = g.last_token {
        after.push(
            LoadPhase::new("run finished and backend dropped", secs(last, g.ended))
                .with_detail("arenas and tiles freed".into()),
        );
    }
    after.push(LoadPhase::new(
        "replay and checkpoint dropped",
        secs(g.ended, g.replayed),
    ));
    LoadBreakdown {
        origin: origin.to_string(),
        first_token_seconds,
        phases,
        after,
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
