//! Measures what the runtime itself costs around the work on the CPU backend: per task,
//! per blocking cross-stream wait, and per stream thread of a step.
//!
//! Takes a thread count; gives [`DispatchTimes`], measured by running synthetic steps of
//! no-op tasks through the real executor ([`run_step`]: one OS thread per stream, the
//! host-side event table, the per-task records) with a runner that dispatches each
//! compute task into a rayon pool built as the CPU backend builds its own (one shared pool
//! of `threads` threads, entered with `install` from the stream thread), so each figure is
//! the executor's and the pool's overhead with no kernel inside. Micro-benchmarks only:
//! nothing here is fitted to an end-to-end run. Each figure is the best of a few
//! repetitions after a warm-up, as the probe's other figures are.

use crate::ir::{Engine, Guard, Op, Shape, StepId, StepKind, StreamId, TaskId};
use crate::lower::{EventId, ExecPlan, Instr, PlanStream, PlanTask, StepPlan};
use crate::model::card::ModelCard;
use crate::records::TaskRun;
use crate::runtime::backend::BackendError;
use crate::runtime::driver::executor::{run_step, ExecOptions, StreamOps};
use std::time::Instant;

/// The runtime's own costs on this machine, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DispatchTimes {
    /// One task on a stream, from the end of the previous task on that stream to the end
    /// of this one when the task does nothing: the executor's bookkeeping and the hop into
    /// the compute pool and back.
    pub task_s: f64,
    /// What a stream blocked on an event recorded by another stream loses: from the
    /// record to the waiting thread running again (a condvar wake-up).
    pub wake_s: f64,
    /// Per stream with work in a step: starting and joining its thread.
    pub stream_thread_s: f64,
    /// Threads of the compute pool the tasks were dispatched into.
    pub threads: usize,
}

/// Why the dispatch probe failed.
#[derive(Debug, thiserror::Error)]
pub enum DispatchProbeError {
    /// The compute pool could not be built.
    #[error("cannot build the dispatch probe's pool of {threads} threads: {message}")]
    Pool {
        /// Requested threads.
        threads: usize,
        /// The library's message.
        message: String,
    },
    /// The executor failed on the synthetic steps.
    #[error("the dispatch probe's synthetic step failed: {0}")]
    Exec(String),
    /// The built-in card the synthetic plan names could not be loaded.
    #[error("the dispatch probe's model card: {0}")]
    Card(String),
}

/// No-op tasks in the chain of the per-task figure.
const CHAIN_TASKS: usize = 400;
/// Rounds of the two-stream ping-pong of the wake-up figure.
const PING_PONG_ROUNDS: usize = 200;
/// Streams of the per-thread figure (a typical offload schedule's five or six).
const STEP_STREAMS: usize = 6;
/// Timed repetitions of each figure (the best is kept), after one warm-up.
const REPETITIONS: usize = 5;

/// The runner of the synthetic steps: a compute task enters the pool and returns, a copy
/// task does nothing on its stream thread (as the CPU backend runs copies), events are the
/// executor's host-side table alone (the CPU backend's `record`/`wait` are no-ops).
struct NoOpRunner<'a> {
    plan: &'a ExecPlan,
    pool: &'a rayon::ThreadPool,
}

impl StreamOps for NoOpRunner<'_> {
    fn run_task(&self, _stream: StreamId, task: TaskId) -> Result<TaskRun, BackendError> {
        let engine = self.plan.tasks.get(task.index()).map(|t| t.engine);
        match engine {
            Some(Engine::GpuCompute | Engine::CpuCompute) => {
                self.pool.install(|| std::hint::black_box(task));
            }
            _ => {
                std::hint::black_box(task);
            }
        }
        Ok(TaskRun::Ran)
    }

    fn record(&self, _stream: StreamId, _event: EventId) -> Result<(), BackendError> {
        Ok(())
    }

    fn wait(&self, _stream: StreamId, _event: EventId) -> Result<(), BackendError> {
        Ok(())
    }

    fn read_routing(&self, _stream: StreamId, _gate: TaskId) -> Result<(), BackendError> {
        Ok(())
    }
}

/// A plan of `streams` compute streams alternating `gpu.compute` and `cpu.compute`, and
/// `tasks` no-op tasks (their stream is set per step by the instruction lists).
fn synthetic_plan(streams: usize, tasks: usize) -> Result<ExecPlan, DispatchProbeError> {
    let model =
        ModelCard::load("mixtral-tiny").map_err(|e| DispatchProbeError::Card(e.to_string()))?;
    let engine = |s: usize| {
        if s.is_multiple_of(2) {
            Engine::GpuCompute
        } else {
            Engine::CpuCompute
        }
    };
    let shape = Shape {
        tokens: 1,
        seqs: 1,
        context: 1,
        act_bytes: 4,
        kv_bytes: 4,
    };
    Ok(ExecPlan {
        name: "dispatch-probe".to_string(),
        checkpoint: crate::ir::CheckpointLayout::new(&model),
        model,
        micro_batches: crate::ir::MicroBatches {
            count: 1,
            size: 1,
            mixed_tokens: 1,
        },
        workload: Default::default(),
        streams: (0..streams)
            .map(|s| PlanStream {
                name: format!("s{s}"),
                engine: engine(s),
            })
            .collect(),
        tasks: (0..tasks)
            .map(|t| PlanTask {
                id: TaskId::new(t),
                name: format!("#{t} no-op"),
                op: Op::Copy,
                engine: engine(t % streams.max(1)),
                stream: StreamId::new(t % streams.max(1)),
                step: StepId::new(0),
                args: Vec::new(),
                guard: Guard::default(),
                cache: None,
                kv: None,
                live: None,
                shape,
                span: Default::default(),
            })
            .collect(),
        buffers: Vec::new(),
        arenas: Vec::new(),
        steps: Vec::new(),
        preds: Vec::new(),
        caches: Vec::new(),
        format_copies: Vec::new(),
    })
}

/// Best wall seconds of `REPETITIONS` runs of `step` (after a warm-up).
fn best_step_seconds(
    plan: &ExecPlan,
    step: &StepPlan,
    runner: &NoOpRunner<'_>,
) -> Result<f64, DispatchProbeError> {
    let mut best = f64::INFINITY;
    for rep in 0..=REPETITIONS {
        let origin = Instant::now();
        run_step(plan, step, runner, ExecOptions::default(), origin)
            .map_err(|e| DispatchProbeError::Exec(e.to_string()))?;
        let seconds = origin.elapsed().as_secs_f64();
        if rep > 0 {
            best = best.min(seconds);
        }
    }
    Ok(best)
}

/// Measures [`DispatchTimes`] with a compute pool of `threads` threads.
///
/// - per task: one stream runs [`CHAIN_TASKS`] no-op compute tasks back to back; the
///   step's wall time less that of a one-task step, over the extra tasks;
/// - per wake-up: two streams ping-pong (`a` runs, records; `b` waits, runs, records; `a`
///   waits ...), so every wait blocks; a round's time less its two tasks, halved;
/// - per stream thread: a step of one no-op task on each of [`STEP_STREAMS`] streams,
///   less one task, over the streams.
pub fn measure_dispatch(threads: usize) -> Result<DispatchTimes, DispatchProbeError> {
    let threads = threads.max(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("moec-probe-{i}"))
        .build()
        .map_err(|e| DispatchProbeError::Pool {
            threads,
            message: e.to_string(),
        })?;
    let tasks = CHAIN_TASKS.max(2 * PING_PONG_ROUNDS).max(STEP_STREAMS);
    let plan = synthetic_plan(STEP_STREAMS, tasks)?;
    let runner = NoOpRunner {
        plan: &plan,
        pool: &pool,
    };
    let step = |programs: Vec<Vec<Instr>>, events: Vec<TaskId>| StepPlan {
        kind: StepKind::Decode,
        first: 0,
        count: tasks as u32,
        routed_ceiling: None,
        programs,
        events,
    };
    let on_first_stream = |n: usize| {
        let mut programs = vec![Vec::new(); STEP_STREAMS];
        programs[0] = (0..n).map(|t| Instr::Run(TaskId::new(t))).collect();
        step(programs, Vec::new())
    };
    let one = best_step_seconds(&plan, &on_first_stream(1), &runner)?;
    let chain = best_step_seconds(&plan, &on_first_stream(CHAIN_TASKS), &runner)?;
    let task_s = ((chain - one) / (CHAIN_TASKS - 1) as f64).max(0.0);

    // Ping-pong between streams 0 and 1: round r runs task 2r on stream 0, which records
    // event 2r; stream 1 waits for it, runs task 2r + 1 and records event 2r + 1, which
    // stream 0 waits for before its next round.
    let mut programs = vec![Vec::new(); STEP_STREAMS];
    let mut events = Vec::with_capacity(2 * PING_PONG_ROUNDS);
    for round in 0..PING_PONG_ROUNDS {
        let (a, b) = (2 * round, 2 * round + 1);
        if round > 0 {
            programs[0].push(Instr::Wait(EventId(a as u32 - 1)));
        }
        programs[0].push(Instr::Run(TaskId::new(a)));
        programs[0].push(Instr::Record(EventId(a as u32)));
        programs[1].push(Instr::Wait(EventId(a as u32)));
        programs[1].push(Instr::Run(TaskId::new(b)));
        programs[1].push(Instr::Record(EventId(b as u32)));
        events.push(TaskId::new(a));
        events.push(TaskId::new(b));
    }
    let ping_pong = best_step_seconds(&plan, &step(programs, events), &runner)?;
    let round = (ping_pong - one) / PING_PONG_ROUNDS as f64;
    let wake_s = ((round - 2.0 * task_s) / 2.0).max(0.0);

    let spread = (0..STEP_STREAMS)
        .map(|s| vec![Instr::Run(TaskId::new(s))])
        .collect();
    let wide = best_step_seconds(&plan, &step(spread, Vec::new()), &runner)?;
    let stream_thread_s = ((wide - task_s) / STEP_STREAMS as f64).max(0.0);
    Ok(DispatchTimes {
        task_s,
        wake_s,
        stream_thread_s,
        threads,
    })
}

/// The runtime's fixed costs on this machine ([`measure_dispatch`]: no-op tasks through the
/// real executor and a compute pool of `threads` threads), in the hardware profile's terms
/// and with their source. Joined here because `cost` and `runtime` do not import each
/// other.
pub fn measured_dispatch(threads: usize) -> Result<crate::cost::hardware::DispatchCosts, String> {
    let times = measure_dispatch(threads).map_err(|e| e.to_string())?;
    Ok(crate::cost::hardware::DispatchCosts {
        source: format!(
            "moec probe: engine::dispatch on {} threads, no-op tasks through the executor (best of 5): a chain on one stream, a two-stream ping-pong of blocking waits, one task on each of 6 streams",
            times.threads
        ),
        task_us: times.task_s * 1e6,
        wake_us: times.wake_s * 1e6,
        stream_thread_us: times.stream_thread_s * 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe runs the executor on its synthetic steps and gives finite, non-negative
    /// figures (their size is the machine's, not asserted).
    #[test]
    fn dispatch_probe_runs_the_executor_and_gives_finite_costs() {
        let times = measure_dispatch(1).unwrap();
        for v in [times.task_s, times.wake_s, times.stream_thread_s] {
            assert!(v.is_finite() && v >= 0.0, "{times:?}");
        }
        assert_eq!(times.threads, 1);
    }
}
