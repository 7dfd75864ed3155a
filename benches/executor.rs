//! Executor overhead per task: the decode step of `sequential.sched` and
//! `flexgen_cpu_attn.sched` (mixtral-tiny, 4 micro-batches) run with a task runner that
//! does no work, so the time is thread wake-ups, event record/wait and bookkeeping only.
//! Divide the reported time by the task count printed first.

use criterion::{criterion_group, criterion_main, Criterion};
use moec::compile::{compile, Options};
use moec::ir::Workload;
use moec::ir::{StreamId, TaskId};
use moec::lower::EventId;
use moec::lower::{lower, ExecPlan, Instr, LowerOptions};
use moec::model::card::ModelCard;
use moec::records::TaskRun;
use moec::runtime::driver::executor::{run_step, ExecOptions, StreamOps};
use moec::runtime::BackendError;
use std::time::Instant;

/// A backend that does nothing: every instruction succeeds at once.
struct NoWork;

impl StreamOps for NoWork {
    fn run_task(&self, _stream: StreamId, _task: TaskId) -> Result<TaskRun, BackendError> {
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

fn plan(sched: &str) -> ExecPlan {
    let source = std::fs::read_to_string(format!("{}/{sched}", env!("CARGO_MANIFEST_DIR")))
        .expect("schedule");
    let mut options = Options::new(ModelCard::load("mixtral-tiny").expect("card"));
    options.workload = Workload {
        batch: 8,
        prompt_len: 16,
        gen_len: 8,
    };
    let c = compile(&source, &options).unwrap_or_else(|_| panic!("{sched} compiles"));
    lower(&c.program, &c.info, &LowerOptions::default()).expect("lowers")
}

fn bench(c: &mut Criterion) {
    for sched in [
        "schedules/baselines/sequential.sched",
        "schedules/baselines/flexgen_cpu_attn.sched",
    ] {
        let plan = plan(sched);
        let step = plan
            .steps
            .iter()
            .find(|s| s.kind.as_str() == "decode")
            .expect("decode step");
        let tasks = step
            .programs
            .iter()
            .flatten()
            .filter(|i| matches!(i, Instr::Run(_)))
            .count();
        let waits = step
            .programs
            .iter()
            .flatten()
            .filter(|i| matches!(i, Instr::Wait(_)))
            .count();
        eprintln!(
            "{sched}: decode step has {tasks} tasks, {waits} waits on {} streams",
            plan.streams.len()
        );
        let name = format!("executor/decode_step/{}", plan.name);
        c.bench_function(&name, |b| {
            b.iter(|| {
                run_step(&plan, step, &NoWork, ExecOptions::default(), Instant::now())
                    .expect("runs")
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
