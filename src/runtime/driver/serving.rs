//! A serving session: [`serve`] feeds a driver [`Session`] from a channel of
//! [`Command`]s and hands each sequence's tokens to its [`TokenSink`], between steps, on
//! the session's thread (what `moec serve` and `moec batch` run on).

use super::session::{SeqEnd, SeqEvent, SeqRequest, Session};
use super::state::TokenConstraint;
use super::RunError;
use crate::records::RunStats;
use crate::runtime::backend::Backend;
use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The environment variable that names a file for [`Trace`]'s lines.
pub const TRACE_ENV: &str = "MOEC_SERVE_TRACE";

/// Where a request's first token waits, measured: with `MOEC_SERVE_TRACE=FILE` the serving
/// loop appends one JSON line per sequence taken from the channel (`taken`) and one per
/// step (`start`, `end`, prefill tokens, decoding rows, the sequences that got their first
/// token), each time in wall-clock seconds since the Unix epoch, so a client's own
/// timestamps (`scripts/serve_bench_client.py --trace`) line up with them.
struct Trace {
    out: std::io::BufWriter<std::fs::File>,
    /// By sequence id: whether it has had a token since it was taken (ids are reused).
    had_token: Vec<bool>,
}

impl Trace {
    /// The trace `MOEC_SERVE_TRACE` asks for; a file that cannot be opened is said on
    /// stderr and the session runs untraced.
    fn from_env() -> Option<Trace> {
        let path = std::env::var_os(TRACE_ENV)?;
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
        {
            Ok(f) => Some(Trace {
                out: std::io::BufWriter::new(f),
                had_token: Vec::new(),
            }),
            Err(e) => {
                eprintln!(
                    "moec: {TRACE_ENV}={}: cannot open it ({e}); not tracing",
                    path.to_string_lossy()
                );
                None
            }
        }
    }

    fn now() -> f64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    }

    /// Writes one line; a failed write stops nothing (the trace is a measurement aid).
    fn line(&mut self, value: serde_json::Value) {
        let _ = writeln!(self.out, "{value}");
    }

    /// Sequence `id` was taken from the channel.
    fn taken(&mut self, id: usize) {
        if self.had_token.len() <= id {
            self.had_token.resize(id + 1, false);
        }
        self.had_token[id] = false;
        self.line(serde_json::json!({"taken": Trace::now(), "seq": id}));
    }

    /// One step: when it started and ended, the prompt tokens it ran, the sequences it
    /// held before, and which sequences got their first token.
    fn step(&mut self, start: f64, prefill_tokens: u64, running: usize, events: &[SeqEvent]) {
        let mut first = Vec::new();
        let mut tokens = 0;
        for e in events {
            if let SeqEvent::Token { id, .. } = *e {
                tokens += 1;
                if self.had_token.len() <= id {
                    self.had_token.resize(id + 1, false);
                }
                if !self.had_token[id] {
                    first.push(id);
                }
                self.had_token[id] = true;
            }
        }
        self.line(serde_json::json!({
            "start": start,
            "end": Trace::now(),
            "prefill_tokens": prefill_tokens,
            "running_before": running,
            "tokens": tokens,
            "first": first,
        }));
        // Flushed per step, so a trace read while the server runs is whole.
        let _ = self.out.flush();
    }
}

/// Where a served sequence's output goes. Called on the session's thread between steps.
pub trait TokenSink: Send {
    /// A new token; `false` cancels the sequence (its client went away, a stop string
    /// matched), freeing its KV before the next step.
    fn token(&mut self, token: u32) -> bool;
    /// The sequence ended (after its last token), or was refused or failed (`Err`).
    fn end(&mut self, end: Result<SeqEnd, SeqError>);
    /// Whether the client is gone (checked between steps, so a waiting or running
    /// sequence whose client left is cancelled without waiting for its next token).
    fn is_closed(&self) -> bool;
    /// The rule its tokens must follow, taken once when it is submitted.
    fn take_constraint(&mut self) -> Option<Box<dyn TokenConstraint>> {
        None
    }
}

/// Why a served sequence produced no (more) tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqError {
    /// Refused at submission (a caller error, or the session is draining).
    Refused(String),
    /// The run failed.
    Failed(String),
}

/// What a serving session is told.
pub enum Command {
    /// New sequences, each with where its tokens go. They are queued together, before the
    /// next step: a plan with static batches admits them into one batch rather than
    /// starting a batch with the first and leaving the rest for the next.
    Submit(Vec<(SeqRequest, Box<dyn TokenSink>)>),
    /// Take no more sequences; let the running and waiting ones finish until `deadline`,
    /// then cancel what is left and return.
    Drain {
        /// When the session cancels what is left.
        deadline: Instant,
    },
}

/// The sinks of a serving session, by sequence id.
type Sinks = Vec<Option<Box<dyn TokenSink>>>;

/// Submits a sequence (refused while draining) or starts the drain.
fn take_command<B: Backend + ?Sized>(
    command: Command,
    session: &mut Session<'_, B>,
    sinks: &mut Sinks,
    deadline: &mut Option<Instant>,
    trace: &mut Option<Trace>,
) {
    match command {
        Command::Submit(sequences) => {
            for (request, mut sink) in sequences {
                if deadline.is_some() {
                    sink.end(Err(SeqError::Refused(
                        "the server is shutting down".to_string(),
                    )));
                    continue;
                }
                match session.submit(request) {
                    Ok(id) => {
                        if let Some(t) = trace.as_mut() {
                            t.taken(id);
                        }
                        if let Some(constraint) = sink.take_constraint() {
                            session.constrain(id, constraint);
                        }
                        if sinks.len() <= id {
                            sinks.resize_with(id + 1, || None);
                        }
                        sinks[id] = Some(sink);
                    }
                    Err(e) => sink.end(Err(SeqError::Refused(e.to_string()))),
                }
            }
        }
        Command::Drain { deadline: d } => *deadline = Some(d),
    }
}

/// Runs a session that takes its sequences from `incoming` until it is drained (or every
/// sender is gone, which cancels what is left). Blocks on the channel while idle; between
/// steps it takes every submitted sequence, cancels those whose sink closed, and hands
/// each token to its sink. A failing step ends every live sequence with the error and
/// returns it.
pub fn serve<B: Backend + ?Sized>(
    mut session: Session<'_, B>,
    incoming: std::sync::mpsc::Receiver<Command>,
    batch_wait: Duration,
) -> Result<RunStats, RunError> {
    use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
    let mut sinks: Sinks = Vec::new();
    let mut deadline: Option<Instant> = None;
    let mut trace = Trace::from_env();
    let gauges = session.gauges();
    loop {
        // Idle: wait for work (a drain with nothing live ends the session).
        if session.is_idle() {
            if deadline.is_some() {
                break;
            }
            match incoming.recv_timeout(Duration::from_millis(200)) {
                Ok(c) => take_command(c, &mut session, &mut sinks, &mut deadline, &mut trace),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut disconnected = false;
        loop {
            match incoming.try_recv() {
                Ok(c) => take_command(c, &mut session, &mut sinks, &mut deadline, &mut trace),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        // A static batch fixes its sequences until it ends: one about to start with room
        // waits up to `batch_wait` for more requests (closed-loop clients resubmit within
        // milliseconds of their answer), so it does not run half empty while they queue
        // for a whole batch.
        if !disconnected && deadline.is_none() && session.batch_room().is_some() {
            let until = Instant::now() + batch_wait;
            let waited_from = Trace::now();
            while session.batch_room().is_some() {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match incoming.recv_timeout(left) {
                    Ok(c) => take_command(c, &mut session, &mut sinks, &mut deadline, &mut trace),
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            if let Some(t) = trace.as_mut() {
                t.line(serde_json::json!({
                    "batch_wait_from": waited_from,
                    "to": Trace::now(),
                    "waiting": session.waiting(),
                }));
            }
        }
        let past_deadline = deadline.is_some_and(|d| Instant::now() >= d);
        for (id, slot) in sinks.iter_mut().enumerate() {
            let gone = slot.as_ref().is_some_and(|s| s.is_closed());
            if gone || ((disconnected || past_deadline) && slot.is_some()) {
                session.cancel(id);
                if let Some(mut sink) = slot.take() {
                    sink.end(Ok(SeqEnd::Cancelled));
                }
            }
        }
        if disconnected || past_deadline {
            break;
        }
        let (started, prefilled) = (Trace::now(), gauges.prefill_tokens.load(Ordering::Relaxed));
        let running_before = session.running();
        let events = match session.step() {
            Ok(events) => events,
            Err(e) => {
                for mut sink in sinks.iter_mut().filter_map(Option::take) {
                    sink.end(Err(SeqError::Failed(format!("the run failed: {e}"))));
                }
                return Err(e);
            }
        };
        if let Some(t) = trace.as_mut() {
            let prefilled = gauges.prefill_tokens.load(Ordering::Relaxed) - prefilled;
            t.step(started, prefilled, running_before, &events);
        }
        for event in events {
            match event {
                SeqEvent::Token { id, token } => {
                    let keep = sinks
                        .get_mut(id)
                        .and_then(Option::as_mut)
                        .is_some_and(|s| s.token(token));
                    if !keep && session.cancel(id).is_some() {
                        if let Some(mut sink) = sinks.get_mut(id).and_then(Option::take) {
                            sink.end(Ok(SeqEnd::Cancelled));
                        }
                    }
                }
                SeqEvent::Done { id, end, .. } => {
                    if let Some(mut sink) = sinks.get_mut(id).and_then(Option::take) {
                        sink.end(Ok(end));
                    }
                }
            }
        }
    }
    Ok(session.finish())
}
