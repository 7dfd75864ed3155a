//! Lowering: a small plan pinned as a snapshot, and the plan's ordering guarantees checked
//! independently of the lowering's own vector clocks (a happens-before search over the
//! instruction lists) on every schedule that compiles.

use moec::compile::{compile, Options};
use moec::ir::{TaskId, Workload};
use moec::lower::{lower, render, ExecPlan, Instr, LowerError, LowerOptions};
use moec::model::card::ModelCard;
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;

fn compiled(sched: &str, sets: &[(&str, &str)], workload: Workload) -> moec::compile::Compiled {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(sched);
    let source = std::fs::read_to_string(path).unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.workload = workload;
    options.sets = sets
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    compile(&source, &options)
        .unwrap_or_else(|d| panic!("{sched}: {:?}", d.first().map(|d| d.to_string())))
}

fn small() -> Workload {
    Workload {
        batch: 2,
        prompt_len: 4,
        gen_len: 2,
    }
}

/// Every dependency `p -> t` inside a step must be ordered by the instructions: a path from
/// `Run(p)` to `Run(t)` along stream order and record -> wait edges.
fn assert_orders_every_dependency(plan: &ExecPlan) {
    for (step_idx, step) in plan.steps.iter().enumerate() {
        // Nodes: (stream, instruction index).
        let mut record_at: HashMap<u32, (usize, usize)> = HashMap::new();
        let mut run_at: HashMap<u32, (usize, usize)> = HashMap::new();
        for (s, prog) in step.programs.iter().enumerate() {
            for (i, instr) in prog.iter().enumerate() {
                match instr {
                    Instr::Record(e) => {
                        assert!(
                            record_at.insert(e.0, (s, i)).is_none(),
                            "event recorded twice"
                        );
                    }
                    Instr::Run(t) => {
                        run_at.insert(t.0, (s, i));
                    }
                    Instr::Wait(_) => {}
                    Instr::ReadRouting(g) => {
                        // The read-back follows its gate directly on the gate's stream,
                        // before any event recorded after the gate.
                        assert!(
                            i > 0 && prog[i - 1] == Instr::Run(*g),
                            "ReadRouting({g}) does not follow Run({g}) on stream {s}"
                        );
                    }
                }
            }
        }
        let mut waits_of: HashMap<(usize, usize), Vec<(usize, usize)>> = HashMap::new();
        for (s, prog) in step.programs.iter().enumerate() {
            for (i, instr) in prog.iter().enumerate() {
                if let Instr::Wait(e) = instr {
                    let rec = *record_at
                        .get(&e.0)
                        .expect("every waited event is recorded in the step");
                    assert_ne!(rec.0, s, "events are for cross-stream edges only");
                    waits_of.entry(rec).or_default().push((s, i));
                }
            }
        }
        let reaches = |from: (usize, usize), to: (usize, usize)| {
            let mut seen = HashSet::new();
            let mut queue = VecDeque::from([from]);
            while let Some((s, i)) = queue.pop_front() {
                if s == to.0 && i <= to.1 {
                    return true;
                }
                if !seen.insert((s, i)) {
                    continue;
                }
                if i + 1 < step.programs[s].len() {
                    queue.push_back((s, i + 1));
                }
                if let Some(ws) = waits_of.get(&(s, i)) {
                    queue.extend(ws.iter().copied());
                }
            }
            false
        };
        let tasks: Vec<u32> = run_at.keys().copied().collect();
        for t in tasks {
            for p in &plan.preds[t as usize] {
                let Some(&from) = run_at.get(&p.0) else {
                    continue;
                };
                assert!(
                    reaches(from, run_at[&t]),
                    "step {step_idx}: dependency t{} -> t{t} is not ordered",
                    p.0
                );
            }
        }
    }
}

#[test]
fn sequential_plan_snapshot() {
    let c = compiled(
        "schedules/baselines/sequential.sched",
        &[("ubs", "1"), ("n_ub", "2")],
        small(),
    );
    let plan = lower(&c.program, &c.info, &LowerOptions::default()).unwrap();
    insta::assert_snapshot!(render(&plan));
}

#[test]
fn every_compiling_schedule_orders_all_its_dependencies() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules");
    let mut checked = 0;
    for sub in ["", "baselines"] {
        for entry in std::fs::read_dir(dir.join(sub)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|x| x != "sched") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
            options.workload = small();
            let Ok(c) = compile(&source, &options) else {
                continue;
            };
            let plan = lower(&c.program, &c.info, &LowerOptions::default()).unwrap();
            assert_orders_every_dependency(&plan);
            // Pruning: fewer waits than cross-stream edges.
            let cross = (0..c.program.tasks.len())
                .flat_map(|t| plan.preds[t].iter().map(move |p| (*p, TaskId::new(t))))
                .filter(|(p, t)| {
                    plan.tasks[p.index()].stream != plan.tasks[t.index()].stream
                        && plan.tasks[p.index()].step == plan.tasks[t.index()].step
                })
                .count();
            let waits = plan.count(|i| matches!(i, Instr::Wait(_)));
            assert!(
                waits <= cross,
                "{}: {waits} waits for {cross} cross-stream edges",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 1);
}

#[test]
fn gpu_arena_over_capacity_is_an_error_naming_the_largest_buffers() {
    let c = compiled("schedules/baselines/sequential.sched", &[], small());
    let err = lower(
        &c.program,
        &c.info,
        &LowerOptions {
            gpu_capacity: Some(1 << 20),
            ..LowerOptions::default()
        },
    )
    .unwrap_err();
    let LowerError::ArenaOverflow {
        space,
        needed,
        capacity,
        ref largest,
        span,
    } = err
    else {
        panic!("expected an arena overflow, got {err}")
    };
    assert_eq!((space, capacity), ("gpu", 1 << 20));
    assert!(needed > capacity);
    assert!(largest.contains("w_gpu"), "{largest}");
    assert!(span.end > span.start);
}
