//! Where a run's time went before its first token: the load, phase by phase, measured.
//!
//! Takes nothing (the engine and the backend time their own phases with [`Laps`]); gives
//! [`LoadPhase`] (one measured phase, with its parts) and [`LoadBreakdown`] (the phases
//! from the clock's origin to the first token, which add up to the time to first token,
//! and what followed the last token), plain data the run report prints.

use std::time::Instant;

/// One measured phase of a run's start (or of what follows its last token).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoadPhase {
    /// What ran (`checkpoint open`, `tiles repacked`, ...).
    pub phase: String,
    /// Its wall seconds.
    pub seconds: f64,
    /// What the phase did, where a figure says more than its name (bytes, threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Its own phases, in order, where it was timed inside (they add up to at most
    /// `seconds`; what is not in a part is the phase's own bookkeeping).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<LoadPhase>,
}

impl LoadPhase {
    /// A phase of `seconds` with no detail and no parts.
    pub fn new(phase: &str, seconds: f64) -> Self {
        LoadPhase {
            phase: phase.to_string(),
            seconds,
            detail: None,
            parts: Vec::new(),
        }
    }

    /// The same phase with `detail`.
    pub fn with_detail(mut self, detail: String) -> Self {
        self.detail = Some(detail);
        self
    }

    /// The phase as the run report's text: `name 1.23 s (detail; part 0.10, ...)`.
    pub fn text(&self) -> String {
        let mut inner: Vec<String> = self.detail.iter().cloned().collect();
        if !self.parts.is_empty() {
            let parts: Vec<String> = self.parts.iter().map(LoadPhase::text).collect();
            inner.push(parts.join(", "));
        }
        if inner.is_empty() {
            format!("{} {:.2} s", self.phase, self.seconds)
        } else {
            format!(
                "{} {:.2} s ({})",
                self.phase,
                self.seconds,
                inner.join("; ")
            )
        }
    }
}

/// A run's time to first token, phase by phase.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoadBreakdown {
    /// Where the clock starts: `process start` (the kernel's start time of the process:
    /// `moec run`) or `run call` (a caller that loaded moec as a library).
    pub origin: String,
    /// Seconds from the origin to the first token (the phases' sum); `None` when the run
    /// generated no token, and then the phases end with the run.
    pub first_token_seconds: Option<f64>,
    /// The phases from the origin to the first token, in order and back to back.
    pub phases: Vec<LoadPhase>,
    /// What followed the last token before the report: the replay on the hardware
    /// profile and dropping the backend and the checkpoint.
    pub after: Vec<LoadPhase>,
}

impl LoadBreakdown {
    /// The phases' sum: the seconds from the origin to the first token (to the run's end
    /// when it generated none).
    pub fn total(&self) -> f64 {
        self.phases.iter().map(|p| p.seconds).sum()
    }

    /// The run report's lines: the phases, then what followed the last token.
    pub fn text(&self) -> String {
        let phases: Vec<String> = self.phases.iter().map(LoadPhase::text).collect();
        let head = match self.first_token_seconds {
            Some(s) => format!("time to first token: {s:.2} s from {}", self.origin),
            None => format!(
                "load: {:.2} s from {} to the end of the run (no token generated)",
                self.total(),
                self.origin
            ),
        };
        let mut out = format!("{head}: {}\n", phases.join(", "));
        if !self.after.is_empty() {
            let after: Vec<String> = self.after.iter().map(LoadPhase::text).collect();
            out.push_str(&format!("  after the last token: {}\n", after.join(", ")));
        }
        out
    }
}

/// A stopwatch that times consecutive phases: each [`Laps::lap`] records the time since
/// the previous one (or since the start), so the phases are back to back and add up to
/// the time since the start.
#[derive(Debug)]
pub struct Laps {
    last: Instant,
    phases: Vec<LoadPhase>,
}

impl Laps {
    /// A stopwatch started now.
    pub fn start() -> Self {
        Self::from(Instant::now())
    }

    /// A stopwatch started at `at`.
    pub fn from(at: Instant) -> Self {
        Laps {
            last: at,
            phases: Vec::new(),
        }
    }

    /// Ends a phase called `name` now; gives it, to add a detail or parts.
    pub fn lap(&mut self, name: &str) -> &mut LoadPhase {
        let now = Instant::now();
        let seconds = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.phases.push(LoadPhase::new(name, seconds));
        self.phases.last_mut().expect("a phase was just pushed")
    }

    /// Adds a phase timed elsewhere without moving the stopwatch (a part measured by a
    /// callee, say).
    pub fn push(&mut self, phase: LoadPhase) {
        self.phases.push(phase);
    }

    /// Splits the last phase in two: `first` (timed by a callee inside it, its seconds
    /// capped at the last phase's) goes before it, and the last keeps the rest; gives the
    /// last. Without a last phase, `first` becomes it.
    pub fn split_last(&mut self, mut first: LoadPhase) -> &mut LoadPhase {
        match self.phases.pop() {
            Some(mut last) => {
                first.seconds = first.seconds.min(last.seconds);
                last.seconds -= first.seconds;
                self.phases.push(first);
                self.phases.push(last);
            }
            None => self.phases.push(first),
        }
        self.phases.last_mut().expect("a phase was just pushed")
    }

    /// The phases so far.
    pub fn into_phases(self) -> Vec<LoadPhase> {
        self.phases
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_are_back_to_back_and_the_text_names_every_phase() {
        let start = Instant::now();
        let mut laps = Laps::from(start);
        laps.lap("one");
        std::thread::sleep(std::time::Duration::from_millis(2));
        laps.lap("two").detail = Some("2 threads".into());
        let elapsed = start.elapsed().as_secs_f64();
        let phases = laps.into_phases();
        let sum: f64 = phases.iter().map(|p| p.seconds).sum();
        assert!(sum <= elapsed && phases[1].seconds >= 0.002, "{phases:?}");
        let mut split = Laps::start();
        split.push(LoadPhase::new("whole", 3.0));
        split.split_last(LoadPhase::new("inside", 1.0)).detail = Some("rest".into());
        let split = split.into_phases();
        assert_eq!(
            (split[0].phase.as_str(), split[0].seconds, split[1].seconds),
            ("inside", 1.0, 2.0)
        );
        let mut outer = LoadPhase::new("open", sum);
        outer.parts = phases;
        let b = LoadBreakdown {
            origin: "run call".into(),
            first_token_seconds: Some(sum),
            phases: vec![outer],
            after: vec![LoadPhase::new("teardown", 0.5)],
        };
        let text = b.text();
        assert!(text.starts_with("time to first token: "), "{text}");
        for word in [
            "open",
            "one",
            "two",
            "2 threads",
            "after the last token",
            "teardown 0.50 s",
        ] {
            assert!(text.contains(word), "{word} not in {text}");
        }
    }
}
