//! The executor: runs one step of an [`ExecPlan`] with one OS thread per stream.
//!
//! Takes a step plan and a [`StreamOps`] (the driver's view of a backend); gives per-task
//! start/end times, or the first failure. Each stream thread runs its instructions in
//! order: `Wait` blocks on the step's host-side event table until the matching `Record`
//! was submitted (one mutex; one condvar per stream, so recording an event wakes only the
//! streams waiting for it), then tells the backend to wait; `Run` runs or submits the
//! task; `Record` tells the backend, then marks the event submitted; `ReadRouting` brings
//! a gate's routing to the host. Guarantees: on any failure every thread
//! stops at its next instruction (waits wake up), all threads are joined before returning,
//! and the first error is returned with the task's name and source span; a watchdog turns
//! a wait with no progress anywhere for `watchdog` into [`ExecError::Stalled`].

use crate::ir::{StreamId, TaskId};
use crate::lower::{EventId, ExecPlan, Instr, StepPlan};
use crate::records::{TaskRecord, TaskRun};
use crate::runtime::backend::BackendError;
use crate::span::Span;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Why a step failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// A task (or an instruction of its stream) failed.
    #[error("task {task} failed: {source}")]
    Task {
        /// The task's name.
        task: String,
        /// Why, as the backend said it.
        source: BackendError,
        /// Where it is written.
        span: Span,
    },
    /// The step ended without a token for a sequence (the checker proves every
    /// micro-batch is sampled once per step, so this is an internal error).
    #[error("sample(ub={ub}) produced no token for sequence {row} of its micro-batch")]
    NoToken {
        /// The micro-batch.
        ub: u32,
        /// The sequence's row in it.
        row: usize,
    },
    /// No progress for the watchdog's period.
    #[error("stream `{stream}` waited {secs:.1} s for task {task} with no progress anywhere (stalled plan)")]
    Stalled {
        /// The waiting stream.
        stream: String,
        /// The task it waited for.
        task: String,
        /// Seconds waited.
        secs: f64,
        /// Where the awaited task is written.
        span: Span,
    },
    /// A stream thread could not be started.
    #[error("cannot start a stream thread: {0}")]
    Thread(String),
}

impl ExecError {
    /// The schedule span of the error.
    pub fn span(&self) -> Option<Span> {
        match self {
            ExecError::Task { span, .. } | ExecError::Stalled { span, .. } => Some(*span),
            ExecError::Thread(_) | ExecError::NoToken { .. } => None,
        }
    }
}

struct Events {
    recorded: Vec<bool>,
    /// The event each stream is blocked on, if any.
    waiting_on: Vec<Option<u32>>,
    aborted: bool,
    /// `aborted`, readable without the lock by [`crate::runtime::step::sleep_in_step`].
    aborted_flag: Arc<AtomicBool>,
    last_progress: Instant,
    error: Option<ExecError>,
}

/// What a stream thread asks of the driver and its backend, one call per instruction.
pub trait StreamOps: Sync {
    /// Runs (or submits) `task` on `stream`, saying what it did.
    fn run_task(&self, stream: StreamId, task: TaskId) -> Result<TaskRun, BackendError>;
    /// Marks `event` on `stream` (called before the host table marks it submitted).
    fn record(&self, stream: StreamId, event: EventId) -> Result<(), BackendError>;
    /// Makes `stream` wait for `event` (called once its record was submitted).
    fn wait(&self, stream: StreamId, event: EventId) -> Result<(), BackendError>;
    /// Brings the routing of `gate` (run just before on `stream`) to the host.
    fn read_routing(&self, stream: StreamId, gate: TaskId) -> Result<(), BackendError>;
}

/// Executor settings.
#[derive(Debug, Clone, Copy)]
pub struct ExecOptions {
    /// A wait with no progress anywhere for this long is a stall.
    pub watchdog: Duration,
    /// Test hook: skip every wait for this event (its index within each step), on the
    /// host and on the device, to prove a backend really runs streams concurrently (a run
    /// without the wait must fail or change its tokens). `None` in every normal run.
    pub drop_wait: Option<u32>,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            watchdog: Duration::from_secs(60),
            drop_wait: None,
        }
    }
}

/// Runs one step; `origin` anchors the recorded times.
pub fn run_step(
    plan: &ExecPlan,
    step: &StepPlan,
    runner: &dyn StreamOps,
    options: ExecOptions,
    origin: Instant,
) -> Result<Vec<TaskRecord>, ExecError> {
    let events = Mutex::new(Events {
        recorded: vec![false; step.events.len()],
        waiting_on: vec![None; step.programs.len()],
        aborted: false,
        aborted_flag: Arc::new(AtomicBool::new(false)),
        last_progress: Instant::now(),
        error: None,
    });
    let conds: Vec<Condvar> = step.programs.iter().map(|_| Condvar::new()).collect();
    let cond = conds.as_slice();
    let mut records = Vec::new();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (s, program) in step.programs.iter().enumerate() {
            if program.is_empty() {
                continue;
            }
            let events = &events;
            let builder =
                std::thread::Builder::new().name(format!("moec-{}", plan.streams[s].name));
            let handle = builder
                .spawn_scoped(scope, move || {
                    stream_thread(
                        plan, step, s, program, runner, events, cond, options, origin,
                    )
                })
                .map_err(|e| ExecError::Thread(e.to_string()));
            match handle {
                Ok(h) => handles.push(h),
                Err(e) => {
                    abort(events, cond, e);
                    break;
                }
            }
        }
        for h in handles {
            // A panicking stream thread is a bug; report it as a failure of the step.
            match h.join() {
                Ok(r) => records.extend(r),
                Err(_) => abort(
                    &events,
                    cond,
                    ExecError::Thread("a stream thread panicked".into()),
                ),
            }
        }
    });
    let state = events.into_inner().unwrap_or_else(|e| e.into_inner());
    match state.error {
        Some(e) => Err(e),
        None => Ok(records),
    }
}

fn abort(events: &Mutex<Events>, conds: &[Condvar], error: ExecError) {
    let mut ev = events.lock().unwrap_or_else(|e| e.into_inner());
    if ev.error.is_none() {
        ev.error = Some(error);
    }
    ev.aborted = true;
    ev.aborted_flag.store(true, Ordering::Relaxed);
    for c in conds {
        c.notify_all();
    }
}

/// The first failure of a stream's instruction, attributed to `task` (the task it ran,
/// or for an event the task that records it).
fn fail(plan: &ExecPlan, events: &Mutex<Events>, conds: &[Condvar], task: TaskId, e: BackendError) {
    let (name, span) = plan
        .tasks
        .get(task.index())
        .map(|t| (t.name.clone(), t.span))
        .unwrap_or_default();
    abort(
        events,
        conds,
        ExecError::Task {
            task: name,
            source: e,
            span,
        },
    );
}

#[allow(clippy::too_many_arguments)]
fn stream_thread(
    plan: &ExecPlan,
    step: &StepPlan,
    stream: usize,
    program: &[Instr],
    runner: &dyn StreamOps,
    events: &Mutex<Events>,
    conds: &[Condvar],
    options: ExecOptions,
    origin: Instant,
) -> Vec<TaskRecord> {
    let aborted = Arc::clone(
        &events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .aborted_flag,
    );
    let _watch = crate::runtime::step::watch_step(aborted, options.watchdog);
    stream_instructions(
        plan, step, stream, program, runner, events, conds, options, origin,
    )
}

#[allow(clippy::too_many_arguments)]
fn stream_instructions(
    plan: &ExecPlan,
    step: &StepPlan,
    stream: usize,
    program: &[Instr],
    runner: &dyn StreamOps,
    events: &Mutex<Events>,
    conds: &[Condvar],
    options: ExecOptions,
    origin: Instant,
) -> Vec<TaskRecord> {
    let stream_id = StreamId::new(stream);
    let recorder = |e: EventId| step.events.get(e.0 as usize).copied().unwrap_or_default();
    let mut records = Vec::new();
    for instr in program {
        match *instr {
            Instr::Wait(e) if options.drop_wait == Some(e.0) => {}
            Instr::Wait(e) => {
                let mut ev = events.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if ev.aborted {
                        return records;
                    }
                    if ev.recorded.get(e.0 as usize).copied().unwrap_or(true) {
                        break;
                    }
                    let idle = ev.last_progress.elapsed();
                    if idle >= options.watchdog {
                        let task = recorder(e);
                        let error = ExecError::Stalled {
                            stream: plan.streams[stream].name.clone(),
                            task: plan
                                .tasks
                                .get(task.index())
                                .map(|t| t.name.clone())
                                .unwrap_or_default(),
                            secs: idle.as_secs_f64(),
                            span: plan
                                .tasks
                                .get(task.index())
                                .map(|t| t.span)
                                .unwrap_or_default(),
                        };
                        drop(ev);
                        abort(events, conds, error);
                        return records;
                    }
                    let wait = options.watchdog - idle;
                    ev.waiting_on[stream] = Some(e.0);
                    ev = conds[stream]
                        .wait_timeout(ev, wait)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    ev.waiting_on[stream] = None;
                }
                drop(ev);
                if let Err(err) = runner.wait(stream_id, e) {
                    fail(plan, events, conds, recorder(e), err);
                    return records;
                }
            }
            Instr::Record(e) => {
                if let Err(err) = runner.record(stream_id, e) {
                    fail(plan, events, conds, recorder(e), err);
                    return records;
                }
                let mut ev = events.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(r) = ev.recorded.get_mut(e.0 as usize) {
                    *r = true;
                }
                for (s, waiting) in ev.waiting_on.iter().enumerate() {
                    if *waiting == Some(e.0) {
                        conds[s].notify_one();
                    }
                }
            }
            Instr::ReadRouting(gate) => {
                if let Err(err) = runner.read_routing(stream_id, gate) {
                    fail(plan, events, conds, gate, err);
                    return records;
                }
            }
            Instr::Run(t) => {
                if events.lock().unwrap_or_else(|e| e.into_inner()).aborted {
                    return records;
                }
                let start = origin.elapsed().as_secs_f64();
                let outcome = runner.run_task(stream_id, t);
                let end = origin.elapsed().as_secs_f64();
                match outcome {
                    Ok(run) => {
                        records.push(TaskRecord {
                            task: t,
                            stream: stream_id,
                            start,
                            end,
                            ran: run != TaskRun::Skipped,
                            hit: run == TaskRun::Hit,
                        });
                        events
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .last_progress = Instant::now();
                    }
                    Err(err) => {
                        fail(plan, events, conds, t, err);
                        return records;
                    }
                }
            }
        }
    }
    records
}
