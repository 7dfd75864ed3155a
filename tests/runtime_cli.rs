//! `moec run` and `moec ablate` end to end: the JSON output's tokens equal `moec generate`'s
//! (the oracle) for the same prompts, the trace is a Chrome trace of every stream, and the
//! ablation table marks identical outputs and lands in CSV/JSON. Bad flags are one-line
//! errors with exit 1.

use std::path::Path;
use std::process::{Command, Output};

fn moec(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache)
        .args(args)
        .output()
        .expect("moec runs")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn token_ids(doc: &serde_json::Value) -> Vec<Vec<u64>> {
    doc["outputs"]
        .as_array()
        .expect("outputs")
        .iter()
        .map(|o| {
            o["token_ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|t| t.as_u64().expect("id"))
                .collect()
        })
        .collect()
}

#[test]
fn run_json_matches_generate_and_writes_a_trace() {
    let cache = tempfile::tempdir().unwrap();
    let trace = cache.path().join("trace.json");
    let prompts = [
        "--prompt",
        "The capital of France is",
        "--prompt",
        "Mixture of experts",
    ];
    let mut run = vec![
        "run",
        "schedules/cgopipe.sched",
        "--json",
        "--hw",
        "t4",
        "--gen-len",
        "5",
    ];
    run.extend(prompts);
    run.extend(["--trace", trace.to_str().unwrap()]);
    let got = json(&moec(cache.path(), &run));
    let mut gen = vec!["generate", "--json", "--max-new-tokens", "5"];
    gen.extend(prompts);
    let expected = json(&moec(cache.path(), &gen));
    assert_eq!(token_ids(&got), token_ids(&expected));
    assert_eq!(
        got["stats"]["generated_tokens"],
        expected["stats"]["generated_tokens"]
    );
    let report = &got["report"];
    assert!(report["decode_steps"].as_u64().unwrap() >= 1);
    assert!(report["makespan_over_critical_path"].as_f64().unwrap() >= 0.99);
    assert!(got["predicted"]["decode_step_seconds"].as_f64().unwrap() > 0.0);
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(events
        .iter()
        .any(|e| e["name"].as_str().is_some_and(|n| n.contains("attn"))));
}

#[test]
fn ablate_marks_identical_outputs_and_writes_csv_and_json() {
    let cache = tempfile::tempdir().unwrap();
    let prefix = cache.path().join("table");
    let out = moec(
        cache.path(),
        &[
            "ablate",
            "schedules/baselines/sequential.sched",
            "schedules/flexgen.sched",
            "--workload",
            "count=3,mean=6,max=9",
            "--gen-len",
            "3",
            "--hw",
            "t4",
            "--out",
            prefix.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("sequential.sched") && stdout.contains("flexgen.sched"),
        "{stdout}"
    );
    let csv = std::fs::read_to_string(prefix.with_extension("csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "{csv}");
    assert!(
        lines[1].ends_with(",reference") && lines[2].ends_with(",true"),
        "{csv}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(prefix.with_extension("json")).unwrap())
            .unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 2);
}

#[test]
fn bad_run_flags_are_one_line_errors() {
    let cache = tempfile::tempdir().unwrap();
    for args in [
        vec![
            "run",
            "schedules/cgopipe.sched",
            "--workload",
            "count=0,mean=3",
        ],
        vec!["run", "no/such.sched", "--prompt", "x"],
        vec![
            "run",
            "schedules/cgopipe.sched",
            "--prompt",
            "x",
            "--set",
            "nonsense",
        ],
        vec![
            "run",
            "schedules/cgopipe.sched",
            "--prompt",
            "x",
            "--gpu-mem",
            "lots",
        ],
    ] {
        let out = moec(cache.path(), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    }
}
