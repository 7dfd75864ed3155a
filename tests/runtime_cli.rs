//! `moec run` and `moec ablate` end to end: the JSON output's tokens equal `moec generate`'s
//! (the oracle) for the same prompts, the trace is a Chrome trace of every stream, and the
//! ablation table marks identical outputs and lands in CSV/JSON; MXFP4 experts are
//! reported as repacked, not mapped; the bf16 product keeps the oracle's tokens; every
//! predictor's accuracy is in the report. Bad flags are one-line errors with exit 1.

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

/// Gives a test's cache folder the suite's shared PTX cache (tests/cuda_backend.rs), so its
/// `moec devices` reads moec's kernels instead of compiling them again with NVRTC (over a
/// minute and a half of CPU where NVRTC is installed, as in CI).
fn share_kernel_cache(cache: &Path) {
    let kernels = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-cache/cuda-kernels");
    std::fs::create_dir_all(&kernels).unwrap();
    std::os::unix::fs::symlink(&kernels, cache.join("cuda-kernels")).unwrap();
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
    // Every weight of a bf16 checkpoint is mapped, none decoded.
    assert_eq!(got["memory"]["weights_decoded_bytes"], 0);
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

/// Issue 45: the run report gives every predictor's accuracy. `pregated.sched` (lookahead
/// gating into an expert cache) gives the oracle's tokens and reports the `pregate`
/// routing against the gates' (`lookahead`) and its cache's prefetches, whose figures are
/// the cache's own counts; `klotski.sched`, which has no cache, reports the experts its
/// `hot(..)` copies moved before their layer's gate (`hot`). Text and `--json` agree.
#[test]
fn every_predictor_s_accuracy_is_in_the_run_report() {
    let cache = tempfile::tempdir().unwrap();
    let prompts = [
        "--prompt",
        "Mixture of experts",
        "--prompt",
        "The capital of France is",
    ];
    // Predictions and cache counts only: a paper profile spares every run here the quick
    // probe of this machine (about 7 s of CPU each in the test build;
    // a_quick_probe_is_kept_for_the_runs_that_follow_it takes one).
    let mut run = vec![
        "run",
        "schedules/pregated.sched",
        "--json",
        "--gen-len",
        "4",
        "--hw",
        "hardware/t4.ron",
    ];
    run.extend(prompts);
    let got = json(&moec(cache.path(), &run));
    let mut gen = vec!["generate", "--json", "--max-new-tokens", "4"];
    gen.extend(prompts);
    let expected = json(&moec(cache.path(), &gen));
    assert_eq!(token_ids(&got), token_ids(&expected));
    let predictions = got["predictions"].as_array().expect("predictions");
    let find = |name: &str| {
        predictions
            .iter()
            .find(|p| p["predictor"] == name)
            .unwrap_or_else(|| panic!("no `{name}` in {predictions:?}"))
    };
    let n = |v: &serde_json::Value| v.as_u64().expect("a count");
    let lookahead = find("lookahead");
    assert!(n(&lookahead["hits"]) > 0, "{lookahead}");
    assert!(n(&lookahead["hits"]) + n(&lookahead["misses"]) > 0);
    let ec = find("cache ec (lookahead)");
    let total = &got["caches"][0]["total"];
    assert_eq!(ec["hits"], total["prefetch_used"]);
    assert_eq!(ec["misses"], total["misses"]);
    assert_eq!(ec["wasted"], total["prefetch_wasted"]);
    let text = moec(
        cache.path(),
        &[
            "run",
            "schedules/pregated.sched",
            "--gen-len",
            "4",
            "--hw",
            "hardware/t4.ron",
            prompts[0],
            prompts[1],
        ],
    );
    let text =
        String::from_utf8_lossy(&text.stdout).to_string() + &String::from_utf8_lossy(&text.stderr);
    assert!(
        text.contains("prediction `lookahead`: ")
            && text.contains("prediction `cache ec (lookahead)`: "),
        "{text}"
    );
    let klotski = json(&moec(
        cache.path(),
        &[
            "run",
            "schedules/klotski.sched",
            "--json",
            "--gen-len",
            "2",
            "--hw",
            "hardware/t4.ron",
            prompts[0],
            prompts[1],
        ],
    ));
    assert!(klotski["caches"].as_array().is_some_and(Vec::is_empty));
    let hot = klotski["predictions"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["predictor"] == "hot"))
        .unwrap_or_else(|| panic!("no `hot` in {}", klotski["predictions"]));
    assert!(n(&hot["hits"]) + n(&hot["misses"]) > 0, "{hot}");
}

/// A run without `--hw` replays on a quick probe of this machine and keeps it in the cache
/// folder: the next run there reuses it (the report says so, with the file and its age,
/// and predicts the same steps in the same times: the same profile), and an unparsable
/// `MOEC_PROBE_MAX_AGE` is refused naming it. One probe in all (about 7 s of CPU here).
#[test]
fn a_quick_probe_is_kept_for_the_runs_that_follow_it() {
    let cache = tempfile::tempdir().unwrap();
    let args = [
        "run",
        "schedules/baselines/resident.sched",
        "--json",
        "--gen-len",
        "2",
        "--prompt",
        "Mixture of experts",
    ];
    let first = json(&moec(cache.path(), &args));
    assert_eq!(first["probe"]["reused"], false, "{}", first["probe"]);
    assert_eq!(first["probe"]["kept_seconds"], 600);
    let second = json(&moec(cache.path(), &args));
    let probe = &second["probe"];
    assert_eq!(probe["reused"], true, "{probe}");
    let file = Path::new(probe["path"].as_str().expect("the probe's file"));
    assert!(
        file.starts_with(cache.path().join("probes")) && file.is_file(),
        "{probe}"
    );
    assert!(probe["age_seconds"]
        .as_f64()
        .is_some_and(|a| (0.0..600.0).contains(&a)));
    assert_eq!(token_ids(&first), token_ids(&second));
    let predicted = |doc: &serde_json::Value| doc["predicted"]["decode_step_seconds"].clone();
    assert!(predicted(&first).is_f64(), "{}", first["predicted"]);
    assert_eq!(predicted(&first), predicted(&second));
    let text_args: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
    let text = moec(cache.path(), &text_args);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("  profile: a quick probe of this machine, reused: taken "),
        "{text}"
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache.path())
        .env("MOEC_PROBE_MAX_AGE", "ten minutes")
        .args(args)
        .output()
        .expect("moec runs");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && stderr.contains("MOEC_PROBE_MAX_AGE"),
        "{stderr}"
    );
}

/// A gpt-oss checkpoint with MXFP4 experts: the report says the experts were repacked into
/// ggml's MXFP4 blocks at load and how many bytes (4 layers x 16 experts x 3 x 128 x 64
/// weights of gpt-oss-tiny, 17 bytes per 32), in the text and in `--json`, instead of
/// calling them memory-mapped; its tokens are the oracle's (`moec generate`) on the same
/// packed experts.
#[test]
fn run_reports_mxfp4_experts_as_repacked_not_mapped() {
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("gpt-oss-tiny-mxfp4");
    let dir_arg = dir.to_str().unwrap();
    let synth = moec(
        cache.path(),
        &[
            "synth",
            "--model",
            "gpt-oss-tiny",
            "--mxfp4",
            "--out",
            dir_arg,
        ],
    );
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    // The weights line and tokens only: a paper profile spares both runs the quick probe.
    let run = [
        "run",
        "schedules/baselines/resident.sched",
        "--weights",
        dir_arg,
        "--prompt",
        "Hello",
        "--gen-len",
        "2",
        "--hw",
        "hardware/t4.ron",
    ];
    let out = moec(cache.path(), &run);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("weights "))
        .expect("a weights line");
    assert!(
        line.contains("816.00 KiB MXFP4 experts repacked into ggml blocks at load")
            && line.contains("the rest memory-mapped"),
        "{line}"
    );
    let mut with_json = run.to_vec();
    with_json.push("--json");
    let doc = json(&moec(cache.path(), &with_json));
    assert_eq!(
        doc["memory"]["weights_decoded_bytes"],
        4 * 16 * 3 * 128 * 64 / 32 * 17
    );
    // The schedule computes from the packed experts what the oracle computes from them.
    let gen = [
        "generate",
        "--weights",
        dir_arg,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "2",
        "--json",
    ];
    assert_eq!(token_ids(&doc), token_ids(&json(&moec(cache.path(), &gen))));
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

/// Issue 10: the kernels are chosen once per process (`MOEC_KERNELS`); schedules on both
/// tiny cards give the same greedy tokens with the portable kernels as with the SIMD ones
/// this CPU has. (The logit difference between the two paths is measured on the oracle in
/// `tests/model_oracle.rs`; the runtime calls the same kernels.) On the CPU backend a
/// schedule decides only which ops run and on how many rows, not which kernels, so four
/// schedules cover every kernel entry: one whole batch through separate ops (`resident`),
/// micro-batches through the fused `post_attn` (`cgopipe`), separate gate, experts and
/// combine tasks per expert group (`klotski`), and mixed prefill-and-decode steps
/// (`vslpipe`); every schedule's tokens are the oracle's in tests/runtime_invariance.rs.
#[test]
fn schedules_give_the_same_tokens_with_portable_and_simd_kernels() {
    let cache = tempfile::tempdir().unwrap();
    share_kernel_cache(cache.path());
    let devices = moec(cache.path(), &["devices"]);
    let chosen = String::from_utf8_lossy(&devices.stdout)
        .lines()
        .find(|l| l.contains("CPU kernels:"))
        .unwrap_or("CPU kernels: unknown")
        .trim()
        .to_string();
    println!("auto selection: {chosen}");
    if chosen.contains("portable") {
        println!("SKIPPED in effect: this CPU has no SIMD kernels, so both runs below use the portable ones");
    }
    let run = |schedule: &str, card: &str, kernels: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_moec"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("MOEC_CACHE_DIR", cache.path())
            .env("MOEC_KERNELS", kernels)
            .args([
                "run",
                schedule,
                "--model",
                card,
                "--json",
                "--gen-len",
                "4",
                "--prompt",
                "Mixture of experts",
                "--prompt",
                "The capital of France is",
                // Tokens only: a paper profile spares each of these runs the quick probe
                // of this machine behind the report's replay (about 2 s in the test build).
                "--hw",
                "hardware/t4.ron",
            ])
            .output()
            .expect("moec runs");
        token_ids(&json(&out))
    };
    let mut compared = 0;
    for card in ["mixtral-tiny", "dbrx-tiny"] {
        for schedule in [
            "schedules/baselines/resident.sched",
            "schedules/cgopipe.sched",
            "schedules/klotski.sched",
            "schedules/vslpipe.sched",
        ] {
            let portable = run(schedule, card, "portable");
            let simd = run(schedule, card, "auto");
            assert_eq!(portable, simd, "{schedule} on {card}: tokens differ");
            compared += 1;
        }
    }
    println!(
        "{compared} (schedule, card) pairs: identical greedy tokens with portable and {chosen}"
    );
}

/// `MOEC_BF16_PRODUCT=bf16` (activations rounded to bf16, pairs summed as `vdpbf16ps`
/// does): the oracle (`moec generate`) computes with the same product, so three schedules
/// of different shapes (one resident batch, CGOPipe's micro-batches, VSLPipe's mixed
/// prefill and decode steps) give its tokens exactly; the product is in effect (its first
/// logits differ from the f32 product's) and named on `moec devices`; an unknown value stops
/// a command with the accepted values.
#[test]
fn bf16_product_runs_give_the_oracle_tokens() {
    let cache = tempfile::tempdir().unwrap();
    share_kernel_cache(cache.path());
    let with = |product: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_moec"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("MOEC_CACHE_DIR", cache.path())
            .env("MOEC_BF16_PRODUCT", product)
            .args(args)
            .output()
            .expect("moec runs")
    };
    let prompts = [
        "--prompt",
        "Mixture of experts",
        "--prompt",
        "The capital of France is",
    ];
    let mut gen = vec!["generate", "--json", "--max-new-tokens", "4"];
    gen.extend(prompts);
    let oracle = token_ids(&json(&with("bf16", &gen)));
    let logits_of = |product: &str, schedule: &str| {
        let dump = cache.path().join(format!("logits-{product}.json"));
        let mut run = vec![
            "run",
            schedule,
            "--json",
            "--gen-len",
            "4",
            "--hw",
            "hardware/t4.ron",
            "--dump-logits",
            dump.to_str().unwrap(),
        ];
        run.extend(prompts);
        let doc = json(&with(product, &run));
        let text = std::fs::read_to_string(&dump).expect("logits file");
        let logits: serde_json::Value = serde_json::from_str(&text).expect("logits JSON");
        (token_ids(&doc), logits["logits"][0].clone())
    };
    let mut first_logits = None;
    for schedule in [
        "schedules/baselines/resident.sched",
        "schedules/cgopipe.sched",
        "schedules/vslpipe.sched",
    ] {
        let (tokens, logits) = logits_of("bf16", schedule);
        assert_eq!(tokens, oracle, "{schedule} under the bf16 product");
        first_logits.get_or_insert(logits);
    }
    let (_, f32_logits) = logits_of("f32", "schedules/baselines/resident.sched");
    assert_ne!(
        first_logits,
        Some(f32_logits),
        "the bf16 product is in effect"
    );
    let devices = String::from_utf8_lossy(&with("bf16", &["devices"]).stdout).into_owned();
    assert!(
        devices.contains("bf16 weights: bf16 product (MOEC_BF16_PRODUCT=bf16"),
        "{devices}"
    );
    let refused = with("fp8", &gen);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("MOEC_BF16_PRODUCT=\"fp8\" is not a bf16 product: use f32 or bf16"),
        "{err}"
    );
}

/// Numeric flags that used to panic or be accepted silently (issue 18) are refused by
/// their parsers with one line naming the flag and the value, exit 2, before any work.
#[test]
fn numeric_run_flags_out_of_range_are_refused_naming_the_flag() {
    let cache = tempfile::tempdir().unwrap();
    for (flag, value, said) in [
        ("--watchdog", "inf", "not a positive finite number"),
        ("--watchdog", "1e300", "more than a year"),
        ("--link-gbps", "0", "not a positive finite number"),
        ("--link-gbps", "-1", "not a positive finite number"),
        ("--link-gbps", "nan", "not a positive finite number"),
        ("--temperature", "-1", "not a finite number >= 0"),
        ("--temperature", "nan", "not a finite number >= 0"),
    ] {
        let arg = format!("{flag}={value}");
        let out = moec(
            cache.path(),
            &["run", "schedules/cgopipe.sched", "--gen-len", "1", &arg],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{arg}: {stderr}");
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.contains(flag) && first.contains(said),
            "{arg}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{arg}: {stderr}");
    }
    for spec in [
        "count=18446744073709551615,mean=4,max=8",
        "count=2,mean=100,max=8",
    ] {
        let out = moec(
            cache.path(),
            &[
                "run",
                "schedules/cgopipe.sched",
                "--gen-len",
                "1",
                "--workload",
                spec,
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{spec}: {stderr}");
        assert!(
            stderr.contains("bad --workload") && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
}

/// The result lines of a `moec batch` output, by id; every line must be valid JSON with
/// the result's fields, and no id may appear twice.
fn batch_results(path: &Path) -> std::collections::BTreeMap<String, serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.ends_with('\n'), "a partial last line was left");
    let mut results = std::collections::BTreeMap::new();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        for field in [
            "prompt_tokens",
            "output_text",
            "output_ids",
            "finish_reason",
        ] {
            assert!(value.get(field).is_some(), "{field} missing in {line}");
        }
        let id = value["id"].to_string();
        assert!(results.insert(id.clone(), value).is_none(), "{id} twice");
    }
    results
}

/// `moec batch` over 200 prompts (batches of 20, 4 tokens each), killed with SIGKILL once
/// some batches are on disk and left with a partial last line (as a kill mid-write leaves
/// it), then run again with the same command: the output holds every id exactly once,
/// each line valid JSON, with the tokens of a run that was never killed; a third run has
/// nothing left to do. An input with a repeated id is refused before anything runs.
#[test]
fn batch_resumes_after_a_kill_without_losing_or_repeating_a_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    let mut lines = String::new();
    for i in 0..200 {
        // Half the prompts carry an id, half default to their line number.
        let line = if i % 2 == 0 {
            serde_json::json!({"id": format!("q{i}"), "prompt": format!("Question {i}: why is the sky")})
        } else {
            serde_json::json!({"prompt": format!("Story {i} begins")})
        };
        lines.push_str(&format!("{line}\n"));
    }
    std::fs::write(&input, lines).unwrap();
    let args = |output: &Path| -> Vec<String> {
        [
            "batch",
            "schedules/cgopipe.sched",
            "--input",
            input.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
            "--batch",
            "20",
            "--gen-len",
            "4",
            "--hw",
            "hardware/t4.ron",
        ]
        .map(String::from)
        .to_vec()
    };
    let whole = dir.path().join("whole.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", dir.path())
        .args(args(&whole))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = batch_results(&whole);
    assert_eq!(expected.len(), 200);
    assert!(expected.contains_key("\"q0\"") && expected.contains_key("2"));

    let killed = dir.path().join("killed.jsonl");
    let mut child = Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", dir.path())
        .args(args(&killed))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    loop {
        let written = std::fs::read_to_string(&killed).unwrap_or_default();
        if written.lines().count() >= 40 {
            break;
        }
        assert!(
            started.elapsed().as_secs() < 120,
            "no two batches written in 2 minutes"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "killed before it finished: {status:?}");
    let after_kill = batch_results(&killed).len();
    assert!((40..200).contains(&after_kill), "{after_kill} lines");
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&killed)
        .unwrap();
    std::io::Write::write_all(&mut file, b"{\"finish_reason\":\"len").unwrap();
    drop(file);

    let resumed = moec_in(dir.path(), &args(&killed));
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(stderr.contains("dropped a partial last line"), "{stderr}");
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(
        stdout.contains(&format!("{after_kill} already in")),
        "{stdout}"
    );
    assert_eq!(batch_results(&killed), expected);

    let again = moec_in(dir.path(), &args(&killed));
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("0 run in 0 batch(es)"));
    assert_eq!(batch_results(&killed), expected);

    let twice = dir.path().join("twice.jsonl");
    std::fs::write(
        &twice,
        "{\"id\": 7, \"prompt\": \"a\"}\n{\"id\": 7, \"prompt\": \"b\"}\n",
    )
    .unwrap();
    let mut bad = args(&dir.path().join("never.jsonl"));
    bad[3] = twice.to_str().unwrap().to_string();
    let refused = moec_in(dir.path(), &bad);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("twice.jsonl:2: id 7 appears twice"));
    assert!(
        !dir.path().join("never.jsonl").exists(),
        "no empty output left"
    );
}

/// `moec batch` runs a job on one engine session, compiled for prompts of 64 tokens and
/// reopened when a later batch holds a longer prompt (here the second batch's 100-word
/// prompt): every line's tokens are `moec run`'s for the same prompt.
#[test]
fn batch_reopens_its_session_for_a_longer_prompt_with_run_s_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let long = (0..100)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    let prompts = [
        "The capital of France is",
        "Once upon a time",
        long.as_str(),
    ];
    let input = dir.path().join("prompts.jsonl");
    let lines: String = prompts
        .iter()
        .map(|p| format!("{}\n", serde_json::json!(p)))
        .collect();
    std::fs::write(&input, lines).unwrap();
    let output = dir.path().join("results.jsonl");
    let common = [
        "schedules/cgopipe.sched",
        "--hw",
        "hardware/t4.ron",
        "--gen-len",
        "4",
    ];
    let mut args: Vec<&str> = vec!["batch"];
    args.extend(common);
    args.extend([
        "--batch",
        "2",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    let out = moec(dir.path(), &args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results = batch_results(&output);
    let long_tokens = results["3"]["prompt_tokens"].as_array().unwrap().len();
    assert!(long_tokens > 64, "the long prompt has {long_tokens} tokens");
    let mut args: Vec<&str> = vec!["run"];
    args.extend(common);
    for p in &prompts {
        args.extend(["--prompt", p]);
    }
    args.push("--json");
    let run = token_ids(&json(&moec(dir.path(), &args)));
    let batch: Vec<Vec<u64>> = (1..=3)
        .map(|line| {
            results[&line.to_string()]["output_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(batch, run);
}

fn moec_in(cache: &Path, args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", cache)
        .args(args)
        .output()
        .expect("moec runs")
}

/// Runs that fit: cgopipe's defaults need about 17 MB of `gpu` arena on mixtral-tiny, so
/// at `--gpu-mem 14MB` the run does not refuse but lets the planner pick params for this
/// workload and budget, says so and names them (stderr, the report, `--json`), and
/// generates the tokens of the defaults' run; at 4 MB no params fit (the LM head alone is
/// 8 MB) and the refusal says the planner searched, with the budget table.
#[test]
fn a_run_over_its_gpu_budget_runs_at_params_the_planner_picked() {
    let cache = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "schedules/cgopipe.sched",
            "--hw",
            "hardware/t4.ron",
            "--gen-len",
            "3",
            "--prompt",
            "The capital of France is",
            "--json",
        ];
        args.extend(extra);
        moec(cache.path(), &args)
    };
    let defaults = json(&run(&[]));
    assert_eq!(defaults["fitted_params"], serde_json::Value::Null);
    let fitted_out = run(&["--gpu-mem", "14MB"]);
    let fitted = json(&fitted_out);
    let stderr = String::from_utf8_lossy(&fitted_out.stderr);
    assert!(
        stderr.contains("do not fit (gpu over by") && stderr.contains("the planner picked"),
        "{stderr}"
    );
    let params = fitted["fitted_params"].as_object().expect("fitted params");
    assert!(
        params.contains_key("n_ub") && params.contains_key("ubs"),
        "{params:?}"
    );
    assert!(fitted["memory"]["gpu_bytes"].as_u64().unwrap() <= 14_000_000);
    assert_eq!(token_ids(&fitted), token_ids(&defaults));
    let refused = run(&["--gpu-mem", "4MB"]);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("the planner found no params that fit") && stderr.contains("OVER by"),
        "{stderr}"
    );
}

/// `scripts/ray_batch.py` on a local Ray cluster of 2 workers: 40 prompts in 4 shards
/// (batches of 2), one shard's `moec batch` killed with SIGKILL by the test once its first
/// batch is on disk; the script runs that shard again (it resumes from its own output)
/// and the merged output equals one `moec batch` over the whole input (in batches of 10),
/// line for line, in input order.
/// Needs Python with `ray` (`.ci/run` installs it and sets `MOEC_REQUIRE_RAY=1`, which
/// makes a missing Ray a failure); elsewhere the test says it skipped and returns.
#[test]
fn ray_shards_a_batch_job_retries_a_killed_shard_and_merges_in_order() {
    let python = std::env::var("MOEC_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_ray = Command::new(&python)
        .args(["-c", "import ray"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_ray {
        assert!(
            std::env::var_os("MOEC_REQUIRE_RAY").is_none(),
            "MOEC_REQUIRE_RAY is set but `{python} -c 'import ray'` fails"
        );
        eprintln!("skipped: no `ray` for {python} (set MOEC_PYTHON, or run .ci/run)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    let lines: String = (0..40)
        .map(|i| {
            if i % 3 == 0 {
                format!("{}\n", serde_json::json!(format!("Line {i} of the story")))
            } else {
                format!("{}\n", serde_json::json!({"id": format!("r{i}"), "prompt": format!("Request {i} asks")}))
            }
        })
        .collect();
    std::fs::write(&input, lines).unwrap();
    let moec_flags = [
        "schedules/cgopipe.sched",
        "--gen-len",
        "3",
        "--threads",
        "1",
        "--hw",
        "hardware/t4.ron",
    ];
    let whole = dir.path().join("whole.jsonl");
    let mut args: Vec<String> = vec!["batch".into()];
    args.extend(moec_flags.iter().map(|s| s.to_string()));
    args.extend([
        "--batch".into(),
        "10".into(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        whole.display().to_string(),
    ]);
    let out = moec_in(dir.path(), &args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let merged = dir.path().join("merged.jsonl");
    let workdir = dir.path().join("shards");
    let child = Command::new(&python)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("MOEC_CACHE_DIR", dir.path())
        .arg("scripts/ray_batch.py")
        .args(["--input", input.to_str().unwrap()])
        .args(["--output", merged.to_str().unwrap()])
        .args(["--workdir", workdir.to_str().unwrap()])
        .args(["--shards", "4", "--num-cpus", "2", "--retries", "2"])
        .args(["--moec", env!("CARGO_BIN_EXE_moec"), "--"])
        .args(moec_flags)
        .args(["--batch", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Kill shard 1's moec once its first batch is on disk.
    let (pid_file, shard_out) = (
        workdir.join("shard-1.pid"),
        workdir.join("shard-1.out.jsonl"),
    );
    let started = std::time::Instant::now();
    loop {
        let lines = std::fs::read_to_string(&shard_out)
            .unwrap_or_default()
            .lines()
            .count();
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if let (true, Some(pid)) = (lines >= 2, pid) {
            // SAFETY: kill(2) on a process id the script wrote for its running shard.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
            break;
        }
        assert!(
            started.elapsed().as_secs() < 300,
            "shard 1 never wrote a batch"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("shard 1 failed (exit -9, run 1)"),
        "{stderr}"
    );
    assert!(stderr.contains("shard 1 done (run 2)"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(&merged).unwrap(),
        std::fs::read_to_string(&whole).unwrap()
    );
}

/// `run --weights X.gguf` with a file that is not a GGUF, or one cut inside its header, is
/// one error naming the file and what is wrong (the GGUF reader's), never a panic.
#[test]
fn run_on_a_broken_gguf_is_one_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let magic = dir.path().join("magic.gguf");
    std::fs::write(&magic, b"GGML\x03\0\0\0").unwrap();
    let cut = dir.path().join("cut.gguf");
    let mut header = b"GGUF".to_vec();
    header.extend(3u32.to_le_bytes());
    header.extend(2u64.to_le_bytes());
    std::fs::write(&cut, &header).unwrap();
    for (path, says) in [(&magic, "not a GGUF file"), (&cut, "truncated GGUF file")] {
        let p = path.display().to_string();
        let out = moec(
            dir.path(),
            &[
                "run",
                "schedules/baselines/resident.sched",
                "--weights",
                &p,
                "--prompt",
                "hi",
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(&p) && stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// Writes mixtral-tiny as a GGUF with every matrix in Q8_0 (`moec synth --gguf`) into
/// `dir`; gives its path.
fn tiny_q8_gguf(dir: &Path) -> String {
    let g = dir.join("tiny.gguf").display().to_string();
    let out = moec(
        dir,
        &[
            "synth",
            "--model",
            "mixtral-tiny",
            "--gguf",
            "--all",
            "q8_0",
            "--out",
            &g,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    g
}

/// `moec run` of `resident.sched` on the checkpoint at `path` (given by `flag`: `--weights`
/// or `--model`), prompt "hello", 3 new tokens, on the t4 profile (no probe of this machine).
fn tiny_run_args<'a>(flag: &'a str, path: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "schedules/baselines/resident.sched",
        flag,
        path,
        "--prompt",
        "hello",
        "--gen-len",
        "3",
        "--hw",
        "t4",
    ]
}

/// `moec plan --model FILE.gguf` prints its `moec run` line with the same `--model FILE.gguf`
/// (issue 43: "its printed `moec run` line runs"): `run --model` takes a GGUF file as its
/// checkpoint, the card from its header, exactly as `--weights FILE.gguf` does.
#[test]
fn run_takes_a_gguf_file_as_its_model_as_the_planner_prints_it() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_q8_gguf(dir.path());
    let run = |flag: &str| {
        let mut args = tiny_run_args(flag, &g);
        args.push("--json");
        json(&moec(dir.path(), &args))
    };
    let by_model = run("--model");
    assert_eq!(token_ids(&by_model), token_ids(&run("--weights")));
    assert_eq!(token_ids(&by_model)[0].len(), 3, "{by_model}");
}

/// Issue 45: `moec run` reports the share of expert computations that used a declared
/// lossy substitute, in its text and in `--json` (`substituted_experts`), here every one
/// (`tests/fixtures/formats/substitute.sched` computes every expert from its q8_0 copy);
/// a schedule without one has no such line and `null` in the JSON.
#[test]
fn run_reports_the_share_of_experts_computed_with_a_substitute() {
    let cache = tempfile::tempdir().unwrap();
    let schedule = "tests/fixtures/formats/substitute.sched";
    // Counts only: a paper profile spares the three runs the quick probe of this machine.
    let t4 = ["--hw", "hardware/t4.ron"];
    let doc = json(&moec(
        cache.path(),
        &[
            "run",
            schedule,
            "--json",
            "--gen-len",
            "3",
            "--prompt",
            "Mixture of experts",
            t4[0],
            t4[1],
        ],
    ));
    let sub = &doc["substituted_experts"];
    let all = sub["all"].as_u64().expect("a count");
    assert!(all > 0, "{sub}");
    assert_eq!(sub["substituted"].as_u64(), Some(all), "{sub}");
    let text = moec(
        cache.path(),
        &[
            "run",
            schedule,
            "--gen-len",
            "3",
            "--prompt",
            "Mixture of experts",
            t4[0],
            t4[1],
        ],
    );
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.contains(&format!(
            "lossy substitute: {all} of {all} expert computations (100.0%) used a format copy"
        )),
        "{stdout}"
    );
    let plain = json(&moec(
        cache.path(),
        &[
            "run",
            "docs/examples/first.sched",
            "--json",
            "--gen-len",
            "2",
            "--prompt",
            "Hi",
            t4[0],
            t4[1],
        ],
    ));
    assert!(
        plain["substituted_experts"].is_null(),
        "{}",
        plain["substituted_experts"]
    );
}

/// Issue 42 point 2: `moec run`'s report breaks its time to first token down, measured: in
/// `--json`, `report.load` lists the phases from the process's start (the checkpoint opened,
/// the plan set up, the machine probe, the backend opened with its own parts, the first
/// prefill), back to back, so they add up to `first_token_seconds`, which is at most the
/// process's wall time as this test measured it from outside; the text report says the
/// same in its `time to first token` line. On a tiny Q8_0 GGUF (where the CPU backend
/// repacks its matrices into tiles at load, `MOEC_QUANT_TILES=load`, the tiles' arena and
/// repacking are parts of the backend's set-up: [`the_tile_modes_give_the_same_tokens_and_say_which_ran`]).
#[test]
fn run_report_breaks_the_time_to_first_token_down() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_q8_gguf(dir.path());
    let args = |json: bool| {
        let mut a = tiny_run_args("--weights", &g);
        if json {
            a.push("--json");
        }
        a
    };
    let started = std::time::Instant::now();
    let out = moec(dir.path(), &args(true));
    let wall = started.elapsed().as_secs_f64();
    let doc = json(&out);
    let load = &doc["report"]["load"];
    assert_eq!(load["origin"], "process start", "{load}");
    let secs = |p: &serde_json::Value| p["seconds"].as_f64().expect("seconds");
    let names = |list: &serde_json::Value| -> Vec<String> {
        list.as_array()
            .expect("a list of phases")
            .iter()
            .map(|p| p["phase"].as_str().expect("a name").to_string())
            .collect()
    };
    let phases = load["phases"].as_array().expect("phases");
    assert_eq!(
        names(&load["phases"]),
        [
            "process start",
            "checkpoint and tokenizer",
            "machine probe",
            "plan set-up",
            "backend open",
            "first prefill"
        ],
        "{load}"
    );
    assert!(phases.iter().all(|p| secs(p) >= 0.0), "{load}");
    let sum: f64 = phases.iter().map(secs).sum();
    let first = load["first_token_seconds"].as_f64().expect("a first token");
    assert!((sum - first).abs() < 1e-6, "{sum} != {first}: {load}");
    assert!(
        first <= wall,
        "{first} s to the first token, {wall} s wall: {load}"
    );
    // Every phase timed inside another lies within it.
    for p in phases {
        if let Some(parts) = p["parts"].as_array() {
            let inner: f64 = parts.iter().map(secs).sum();
            assert!(inner <= secs(p) + 1e-6, "{p}");
        }
    }
    let open = &phases[4];
    let parts = names(&open["parts"]);
    for part in ["arenas", "weights image mapped", "page tables populated"] {
        assert!(parts.iter().any(|p| p == part), "{part}: {open}");
    }
    if doc["backend"]
        .as_str()
        .is_some_and(|b| b.contains("in tiles of eight rows"))
    {
        for part in ["tile arena mapped", "tiles repacked"] {
            assert!(parts.iter().any(|p| p == part), "{part}: {open}");
        }
    }
    assert_eq!(
        names(&load["after"]),
        [
            "run finished and backend dropped",
            "replay and checkpoint dropped"
        ]
    );
    let text = moec(dir.path(), &args(false));
    assert!(text.status.success());
    let stdout = String::from_utf8_lossy(&text.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("time to first token: "))
        .unwrap_or_else(|| panic!("no load line in {stdout}"));
    for phase in [
        "from process start",
        "checkpoint open",
        "backend open",
        "first prefill",
    ] {
        assert!(line.contains(phase), "{phase}: {line}");
    }
    assert!(stdout.contains("after the last token: "), "{stdout}");
}

/// Where the quantised products' tiles come from (`MOEC_QUANT_TILES`): packed a panel at a
/// time as the many-row products run (`pack`, the default), repacked at load (`load`) or
/// none (`off`) give the same tokens on a tiny Q8_0 GGUF, with a prompt long enough that
/// its prefill's products pack (Q8_0 packs from 4 activation rows), and each run says its
/// choice: the backend line, and the kernels line of the text report; only `load` has the
/// tiles' arena and repacking among the backend's set-up phases.
#[test]
fn the_tile_modes_give_the_same_tokens_and_say_which_ran() {
    let dir = tempfile::tempdir().unwrap();
    let g = tiny_q8_gguf(dir.path());
    let mut args = tiny_run_args("--weights", &g);
    args[5] = "a prompt of a dozen tokens or more, so that its products pack";
    let run = |mode: &str, json: bool| {
        let mut a = args.clone();
        if json {
            a.push("--json");
        }
        Command::new(env!("CARGO_BIN_EXE_moec"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env("MOEC_CACHE_DIR", dir.path())
            .env("MOEC_QUANT_TILES", mode)
            .args(&a)
            .output()
            .expect("moec runs")
    };
    let says = [
        ("pack", "pack each panel into tiles as they run"),
        ("load", "in tiles of eight rows"),
        ("off", "in ggml's row layout (MOEC_QUANT_TILES=off)"),
    ];
    let mut tokens = Vec::new();
    for (mode, backend) in says {
        let doc = json(&run(mode, true));
        let line = doc["backend"].as_str().expect("a backend line");
        assert!(line.contains(backend), "{mode}: {line}");
        let open = &doc["report"]["load"]["phases"][4];
        let parts: Vec<&str> = open["parts"]
            .as_array()
            .expect("parts")
            .iter()
            .filter_map(|p| p["phase"].as_str())
            .collect();
        assert_eq!(
            parts.contains(&"tiles repacked"),
            mode == "load",
            "{mode}: {open}"
        );
        tokens.push(token_ids(&doc));
        let text = run(mode, false);
        assert!(text.status.success());
        let stdout = String::from_utf8_lossy(&text.stdout);
        let kernels = format!("MOEC_QUANT_TILES={mode}");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("CPU kernels: ") && l.contains(&kernels)),
            "{mode}: {stdout}"
        );
    }
    assert!(!tokens[0].is_empty() && !tokens[0][0].is_empty());
    assert_eq!(tokens[0], tokens[1], "pack vs load");
    assert_eq!(tokens[0], tokens[2], "pack vs off");
}
