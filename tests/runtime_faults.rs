//! Faults: a task killed mid-run (test hook) ends the run with the task's name and source
//! span after joining every stream; a stalled plan becomes a watchdog error, never a hang;
//! an over-capacity device and an unadmittable prompt are clear errors; and the CLI exits 1
//! showing the schedule line of the failed task.

use moec::compile::{compile, Options};
use moec::ir::{Op, Workload};
use moec::lower::{lower, ExecPlan, Instr, LowerOptions};
use moec::model::card::ModelCard;
use moec::runtime::cpu::CpuSetupError;
use moec::runtime::host::memory::MemoryError;
use moec::runtime::{generate, RunError, RunOptions};
use moec::runtime::{BackendError, ExecError};
use moec::weights::checkpoint::Checkpoint;
use moec::weights::synth::{write_checkpoint, SynthOptions};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const SCHED: &str = "schedules/baselines/sequential.sched";

fn setup() -> (tempfile::TempDir, Checkpoint, ExecPlan, String) {
    let card = ModelCard::load("mixtral-tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(
        &card,
        &dir.path().join("ck"),
        &SynthOptions {
            seed: 1,
            dtype: card.dtype,
            ..Default::default()
        },
    )
    .unwrap();
    let checkpoint = Checkpoint::open(&dir.path().join("ck")).unwrap();
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(SCHED)).unwrap();
    let mut options = Options::new(card);
    options.workload = Workload {
        batch: 2,
        prompt_len: 6,
        gen_len: 3,
    };
    let c = compile(&source, &options).unwrap();
    let plan = lower(&c.program, &c.info, &LowerOptions::default()).unwrap();
    (dir, checkpoint, plan, source)
}

fn expect_err<T>(result: Result<T, RunError>) -> RunError {
    match result {
        Ok(_) => panic!("expected the run to fail"),
        Err(e) => e,
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 6, 7, 8, 9, 10], vec![11, 12, 13]]
}

#[test]
fn killed_task_stops_the_run_with_its_name_and_span() {
    let (_dir, checkpoint, plan, source) = setup();
    // The decode step's attention of layer 1, on its second run (the second decode step):
    // the run is well under way.
    let decode = plan
        .steps
        .iter()
        .position(|s| s.kind.as_str() == "decode")
        .unwrap();
    let attn = plan
        .tasks
        .iter()
        .position(|t| {
            t.step.index() == decode
                && matches!(
                    t.op,
                    Op::Attn {
                        layer: 1,
                        ub: 0,
                        ..
                    }
                )
        })
        .unwrap();
    let mut options = RunOptions::greedy(3);
    options.kill_task = Some((attn as u32, 2));
    let started = Instant::now();
    let err = expect_err(generate(
        &plan,
        &checkpoint,
        &prompts(),
        &options,
        &mut |_, _| {},
    ));
    assert!(started.elapsed() < Duration::from_secs(30));
    let RunError::Exec(ExecError::Task {
        task,
        source: BackendError::Killed,
        span,
    }) = err
    else {
        panic!("expected a task error, got {err}")
    };
    assert!(task.contains("attn(layer=1, ub=0"), "{task}");
    let text = &source[span.start as usize..span.end as usize];
    assert!(text.starts_with("attn("), "span points at {text:?}");
}

#[test]
fn a_stalled_plan_is_a_watchdog_error() {
    let (_dir, checkpoint, mut plan, _) = setup();
    // Drop the first record of the prefill step: its waiter can never proceed.
    let prefill = plan
        .steps
        .iter()
        .position(|s| s.kind.as_str() == "prefill")
        .unwrap();
    let dropped = plan.steps[prefill].programs.iter_mut().find_map(|p| {
        p.iter()
            .position(|i| matches!(i, Instr::Record(_)))
            .map(|at| p.remove(at))
    });
    assert!(dropped.is_some());
    let mut options = RunOptions::greedy(2);
    options.exec.watchdog = Duration::from_millis(300);
    let started = Instant::now();
    let err = expect_err(generate(
        &plan,
        &checkpoint,
        &prompts(),
        &options,
        &mut |_, _| {},
    ));
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(
        matches!(err, RunError::Exec(ExecError::Stalled { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("stalled plan"), "{err}");
}

#[test]
fn device_capacity_and_prompt_admission_are_checked() {
    let (_dir, checkpoint, plan, _) = setup();
    let mut options = RunOptions::greedy(2);
    options.backend.gpu_capacity = Some(4096);
    let err = expect_err(generate(
        &plan,
        &checkpoint,
        &prompts(),
        &options,
        &mut |_, _| {},
    ));
    let RunError::Backend(BackendError::Setup(setup)) = &err else {
        panic!("expected a backend setup error, got {err}");
    };
    assert!(
        matches!(
            setup.downcast_ref::<CpuSetupError>(),
            Some(CpuSetupError::Memory(MemoryError::GpuCapacity {
                capacity: 4096,
                ..
            }))
        ),
        "{err}"
    );
    let long = vec![vec![3u32; 200]];
    let err = expect_err(generate(
        &plan,
        &checkpoint,
        &long,
        &RunOptions::greedy(2),
        &mut |_, _| {},
    ));
    assert!(
        matches!(
            err,
            RunError::PromptTooLarge {
                index: 0,
                tokens: 200,
                ..
            }
        ),
        "{err}"
    );
    let err = expect_err(generate(
        &plan,
        &checkpoint,
        &[vec![]],
        &RunOptions::greedy(2),
        &mut |_, _| {},
    ));
    assert!(matches!(err, RunError::EmptyPrompt(0)), "{err}");
}

#[test]
fn cli_reports_the_failed_task_with_its_schedule_line() {
    let (dir, _checkpoint, plan, _) = setup();
    let lm = plan
        .tasks
        .iter()
        .position(|t| matches!(t.op, Op::LmHead { ub: 0 }))
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", dir.path())
        .args([
            "run",
            SCHED,
            "--weights",
            dir.path().join("ck").to_str().unwrap(),
            "--hw",
            "t4",
        ])
        .args([
            "--prompt",
            "hello there",
            "--gen-len",
            "3",
            "--kill-task",
            &format!("{lm}:1"),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("lm_head(ub=0)") && stderr.contains("killed by the test hook"),
        "{stderr}"
    );
    assert!(
        stderr.contains("lm_head(ub = j"),
        "the schedule line is shown: {stderr}"
    );
}

/// `--link-gbps 1e-6` makes one weight copy sleep for hours; the watchdog still ends the run
/// (the throttle sleeps in slices, stops once the step is aborted, and never sleeps past the
/// watchdog: here the copy stream is the only one busy, so no waiting stream would notice).
/// Bounded by `timeout`: exit 124 would mean the run hung.
#[test]
fn a_throttled_copy_does_not_outlive_the_watchdog() {
    let (dir, _checkpoint, _plan, _) = setup();
    let out = Command::new("timeout")
        .arg("60")
        .arg(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", dir.path())
        .args([
            "run",
            SCHED,
            "--weights",
            dir.path().join("ck").to_str().unwrap(),
            "--prompt",
            "hello there",
            "--gen-len",
            "2",
            "--link-gbps",
            "1e-6",
            "--watchdog",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("past the 1 s watchdog") && stderr.contains("--link-gbps"),
        "{stderr}"
    );
}

/// A checkpoint file shrunk while a disk schedule runs (`schedules/moe_infinity_disk.sched`,
/// after the checkpoint was opened): the first disk read past the new end ends the run with
/// one error naming the tensor it was reading and the file, and no stream panics.
#[test]
fn a_checkpoint_truncated_under_a_disk_schedule_is_one_error_naming_the_tensor() {
    let card = ModelCard::load("mixtral-tiny").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    write_checkpoint(
        &card,
        &ck,
        &SynthOptions {
            seed: 1,
            dtype: card.dtype,
            ..Default::default()
        },
    )
    .unwrap();
    let checkpoint = Checkpoint::open(&ck).unwrap();
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/moe_infinity_disk.sched"),
    )
    .unwrap();
    let mut options = Options::new(card);
    options.workload = Workload {
        batch: 2,
        prompt_len: 8,
        gen_len: 2,
    };
    options.sets = vec![("bs".to_string(), "2".to_string())];
    let compiled = compile(&source, &options).unwrap();
    let plan = lower(&compiled.program, &compiled.info, &LowerOptions::default()).unwrap();
    // Shrink every shard to a quarter: the embedding, which `setup` reads first, lies past
    // the new end.
    for entry in std::fs::read_dir(&ck).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let len = std::fs::metadata(&path).unwrap().len();
            let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            file.set_len(len / 4).unwrap();
        }
    }
    let mut run = RunOptions::greedy(2);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    let err = expect_err(generate(
        &plan,
        &checkpoint,
        &prompts(),
        &run,
        &mut |_, _| {},
    ));
    let text = format!("{err}");
    assert!(
        text.starts_with("task #0 copy failed: reading embedding from disk: "),
        "names the task and the tensor: {text}"
    );
    assert!(text.contains("model.safetensors"), "names the file: {text}");
    assert!(text.contains("(truncated?)"), "{text}");
}
