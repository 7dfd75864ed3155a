//! `moec check` and `moec compile` from the outside: exit codes, summary, emitted forms.

use std::process::Command;

fn moec(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_moec"))
        .args(args)
        .output()
        .expect("moec runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_prints_a_summary_and_succeeds() {
    let (code, stdout, _) = moec(&["check", "tests/fixtures/all_constructs.sched"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.starts_with("all_constructs: ok"), "{stdout}");
    for stream in ["gpu", "cpu", "h2d", "d2h", "pin"] {
        assert!(stdout.contains(&format!("  {stream} ")), "{stdout}");
    }
    assert!(stdout.contains("model mixtral-tiny"), "{stdout}");
}

#[test]
fn check_reports_diagnostics_and_exits_1() {
    let (code, stdout, stderr) = moec(&["check", "tests/fixtures/diag/values_wrong.sched"]);
    assert_eq!(code, 1);
    assert!(stdout.is_empty());
    assert!(
        stderr.contains("values::wrong") && stderr.contains("rejected"),
        "{stderr}"
    );
}

#[test]
fn set_and_model_flags_reach_the_schedule() {
    let (code, stdout, stderr) = moec(&[
        "check",
        "tests/fixtures/all_constructs.sched",
        "--model",
        "dbrx-tiny",
        "--set",
        "n_ub=3",
        "--gen-len",
        "8",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("model dbrx-tiny")
            && stdout.contains("n_ub=3")
            && stdout.contains("gen_len 8"),
        "{stdout}"
    );
    let (code, _, stderr) = moec(&[
        "check",
        "tests/fixtures/all_constructs.sched",
        "--set",
        "n_ub=100",
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("elab::param_value"), "{stderr}");
    let (code, _, stderr) = moec(&[
        "check",
        "tests/fixtures/all_constructs.sched",
        "--set",
        "n_ub",
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("not of the form name=value"), "{stderr}");
}

#[test]
fn compile_emits_text_dot_and_json() {
    let (code, text, _) = moec(&["compile", "tests/fixtures/all_constructs.sched"]);
    assert_eq!(code, 0);
    assert!(text.contains("decode {") && text.contains("<- "), "{text}");
    let (code, dot, _) = moec(&[
        "compile",
        "tests/fixtures/all_constructs.sched",
        "--emit",
        "dot",
    ]);
    assert_eq!(code, 0);
    assert!(dot.starts_with("digraph") && dot.trim_end().ends_with('}'));
    let (code, json, _) = moec(&[
        "compile",
        "tests/fixtures/all_constructs.sched",
        "--emit",
        "json",
    ]);
    assert_eq!(code, 0);
    let value: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert!(value["edges"].as_array().is_some_and(|e| !e.is_empty()));
}

#[test]
fn a_missing_file_or_card_is_a_clean_error() {
    let (code, _, stderr) = moec(&["check", "no/such/file.sched"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("cannot read"), "{stderr}");
    let (code, _, stderr) = moec(&[
        "check",
        "tests/fixtures/all_constructs.sched",
        "--model",
        "nope",
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("unknown model card"), "{stderr}");
}

/// A rejected `--set` value is one error at the param's declaration: the param keeps its
/// default for the rest of elaboration, so no "unknown name" errors follow from it.
#[test]
fn a_bad_set_value_is_one_error_without_a_cascade() {
    for set in ["n_ub=0", "n_ub=two"] {
        let (code, _, stderr) = moec(&["check", "schedules/cgopipe.sched", "--set", set]);
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains("elab::param_value"), "{stderr}");
        assert!(!stderr.contains("unknown name"), "{stderr}");
        assert!(stderr.contains("1 error(s)"), "{stderr}");
    }
}

/// `moec profile` writes a routing profile a later `--profile` reads back: placement by
/// `rank(..)` follows it, and a profile of another model's shape is refused in one line.
#[test]
fn profile_writes_a_routing_profile_that_check_and_simulate_read() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let out = dir.path().join("tiny.json");
    let out_s = out.to_str().expect("utf-8 path");
    let (code, stdout, stderr) = moec(&[
        "profile",
        "schedules/fiddler.sched",
        "--prompt",
        "The capital of France is",
        "--gen-len",
        "2",
        "--out",
        out_s,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("mixtral-tiny:") && stdout.contains("4 layers x 8 experts"),
        "{stdout}"
    );
    let profile = moec::ir::profile::RoutingProfile::from_json(
        &std::fs::read_to_string(&out).expect("written"),
    )
    .expect("a routing profile");
    assert_eq!(profile.counts.len(), 4);
    // Every token routes to top_k = 2 experts of every layer.
    for counts in &profile.counts {
        assert_eq!(counts.iter().sum::<u64>(), 2 * profile.tokens);
    }
    let (code, stdout, stderr) = moec(&[
        "check",
        "schedules/fiddler.sched",
        "--set",
        "n_gpu=4",
        "--profile",
        out_s,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("fiddler: ok"), "{stdout}");
    let (code, stdout, stderr) = moec(&[
        "simulate",
        "schedules/fiddler.sched",
        "--set",
        "n_gpu=4",
        "--profile",
        out_s,
        "--batch",
        "1",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("routing from the profile"), "{stdout}");
    // The same file against the DBRX card (16 experts per layer) is refused.
    let (code, _, stderr) = moec(&[
        "check",
        "schedules/fiddler.sched",
        "--model",
        "dbrx-tiny",
        "--profile",
        out_s,
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("does not fit dbrx-tiny"), "{stderr}");
    // A schedule without gates has no routing to count.
    let (code, _, stderr) = moec(&[
        "profile",
        "schedules/baselines/resident.sched",
        "--prompt",
        "Hi",
        "--gen-len",
        "1",
        "--out",
        out_s,
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("read back no routing"), "{stderr}");
}

/// `moec compile X | head -1`: when the reader closes the pipe, moec ends quietly (killed
/// by SIGPIPE as Unix tools are), never with a panic (issue 18).
#[test]
fn a_closed_output_pipe_ends_the_command_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        // 200 KB of DAG: far more than a pipe buffers.
        .args([
            "compile",
            "schedules/cgopipe.sched",
            "--model",
            "mixtral-8x7b",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("moec starts");
    let mut first = [0u8; 64];
    child
        .stdout
        .take()
        .expect("stdout")
        .read_exact(&mut first)
        .expect("some output");
    // The read end is dropped here, as `head` closes it.
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    let status = child.wait().expect("moec ends");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(status.code(), Some(101), "{stderr}");
    assert!(
        status.success() || status.signal() == Some(13),
        "ended by {status:?}: {stderr}"
    );
}

/// A schedule path that never ends (`/dev/zero`) or is huge is refused after the size cap
/// by every command that reads a schedule, instead of filling memory (issue 18).
#[test]
fn an_endless_schedule_file_is_refused_by_every_command() {
    for command in ["check", "compile", "simulate", "plan", "run"] {
        let (code, _, stderr) = moec(&[command, "/dev/zero"]);
        assert_eq!(code, 1, "{command}: {stderr}");
        assert!(
            stderr.contains("/dev/zero") && stderr.contains("larger than"),
            "{command}: {stderr}"
        );
    }
}

/// Values `check` and `simulate` used to accept silently (issue 18): a zero batch and a
/// timeline step the schedule does not have are refused naming the flag.
#[test]
fn a_zero_batch_and_an_unknown_timeline_step_are_refused() {
    for command in ["check", "simulate"] {
        let (code, _, stderr) = moec(&[command, "schedules/cgopipe.sched", "--batch", "0"]);
        assert_eq!(code, 2, "{command}: {stderr}");
        assert!(stderr.contains("--batch"), "{command}: {stderr}");
    }
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("t.svg");
    let (code, _, stderr) = moec(&[
        "simulate",
        "schedules/cgopipe.sched",
        "--timeline",
        svg.to_str().unwrap(),
        "--timeline-step",
        "nope",
    ]);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("--timeline-step `nope`") && stderr.contains("decode"),
        "{stderr}"
    );
    assert!(!svg.exists(), "nothing is written for a refused step");
}

/// `--weight-format` sizes the checkpoint from the formats' block structs (ggml's
/// `block_q8_0`: 34 bytes per 32 weights; bf16 2 bytes a weight): mixtral-tiny's experts
/// (4 layers x 8 experts x 3 x 128 x 256 weights) take 17/32 of their bf16 bytes, the
/// other classes are unchanged; bad specs and widths that are not whole blocks are one
/// error naming the class, format or tensor.
#[test]
fn weight_formats_size_the_checkpoint_by_class() {
    let class = |stdout: &str, name: &str| -> String {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} line in\n{stdout}"))
            .to_string()
    };
    let sched = "schedules/cgopipe.sched";
    let (code, bf16, _) = moec(&["check", sched]);
    assert_eq!(code, 0, "{bf16}");
    let (code, q8, stderr) = moec(&["check", sched, "--weight-format", "experts=q8_0"]);
    assert_eq!(code, 0, "{stderr}");
    let experts = 4 * 8 * 3 * 128 * 256;
    let human = moec::ir::emit::human_bytes;
    assert!(
        class(&bf16, "experts").ends_with(&format!(" {}  BF16", human(experts * 2))),
        "{bf16}"
    );
    assert!(
        class(&q8, "experts").ends_with(&format!(" {}  Q8_0", human(experts / 32 * 34))),
        "{q8}"
    );
    assert_eq!(class(&bf16, "attention"), class(&q8, "attention"));
    assert!(q8.contains("model mixtral-tiny; experts Q8_0"), "{q8}");
    for (spec, says) in [
        (
            "experts=q4_k",
            "ExpertGate as Q4_K: rows of 128 weights are not whole 256-weight blocks",
        ),
        ("expert=q8_0", "unknown weight class `expert`"),
        ("norms=q8_0", "stay in a float format"),
    ] {
        let (code, _, stderr) = moec(&["check", sched, "--weight-format", spec]);
        assert_eq!(code, 1, "{spec}");
        assert!(stderr.contains(says), "{spec}: {stderr}");
    }
    // gpt-oss's experts quantised are stored out-in, as the Hub's MXFP4 ones are read:
    // gpt-oss-tiny's (4 layers x 16 experts x 3 x 128 x 64 weights) take ggml's
    // `block_mxfp4`, 17 bytes per 32; their biases stay bf16.
    let (code, mx, stderr) = moec(&[
        "check",
        sched,
        "--model",
        "gpt-oss-tiny",
        "--weight-format",
        "experts=mxfp4",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let (weights, biases) = (4 * 16 * 3 * 128 * 64, 4 * 16 * (2 * 64 + 128) * 2);
    assert!(
        class(&mx, "experts").ends_with(&format!(
            " {}  MXFP4 BF16",
            human(weights / 32 * 17 + biases)
        )),
        "{mx}"
    );
}

/// `--model FILE.gguf` reads the file's header: a wrong magic or a file cut inside its
/// header is one error naming the file and what is wrong.
#[test]
fn a_broken_gguf_model_is_one_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let magic = dir.path().join("magic.gguf");
    std::fs::write(&magic, b"GGML\x03\0\0\0").unwrap();
    let cut = dir.path().join("cut.gguf");
    let mut header = b"GGUF".to_vec();
    header.extend(3u32.to_le_bytes());
    header.extend(1u64.to_le_bytes());
    std::fs::write(&cut, &header).unwrap();
    for (path, says) in [
        (&magic, "not a GGUF file (starts with \"GGML\""),
        (&cut, "truncated GGUF file"),
    ] {
        let p = path.display().to_string();
        let (code, _, stderr) = moec(&["check", "schedules/cgopipe.sched", "--model", &p]);
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains(&p) && stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
