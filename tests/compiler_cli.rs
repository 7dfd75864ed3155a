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

/// `moec check --backend cuda` proves the GPU budget for the CUDA backend: its scratch
/// rules reach the compile, so the memory table has a `scratch on <stream>` line per device
/// stream with tasks (fiddler's compute stream here) and the schedule's `gpu_scratch(..)`
/// is their bound (no warning). Without `--backend` (the CPU backend, `moec run`'s default,
/// which registers no rules) the table keeps the op catalog's workspace in a line that
/// says so, and `gpu_scratch(..)` warns that it is the catalog's bound.
#[test]
fn check_budgets_the_scratch_of_the_backend_it_names() {
    let args = ["check", "schedules/fiddler.sched", "--hw", "t4"];
    let (code, stdout, stderr) = moec(&[&args[..], &["--backend", "cuda"]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("scratch on gpu (max: "), "{stdout}");
    assert!(!stdout.contains("no backend scratch rules"), "{stdout}");
    assert!(!stderr.contains("lint::catalog_scratch"), "{stderr}");
    let (code, stdout, stderr) = moec(&args);
    assert_eq!(code, 0, "{stderr}");
    assert!(!stdout.contains("scratch on "), "{stdout}");
    assert!(
        stdout.contains("op workspace (catalog: no backend scratch rules; max: "),
        "{stdout}"
    );
    assert!(
        stderr.contains("lint::catalog_scratch") && stderr.contains("--backend cuda"),
        "{stderr}"
    );
    let (code, _, stderr) = moec(&[&args[..], &["--backend", "tpu"]].concat());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("cuda"), "{stderr}");
}

/// The planning commands compile an MLA card as the backend they name runs it
/// (`registry::card_for`): the CPU backend (the default) caches DeepSeek-V2-Lite's latent
/// once, V read from K, where CUDA keeps a V pool of the same width. So `--backend cuda`
/// budgets one more pool: 27 layers x 16 sequences x (128 + 32) positions x (512 latent +
/// 64 rope) x 4 bytes, worked from the card's facts.
#[test]
fn check_budgets_the_kv_layout_of_the_backend_it_names() {
    let args = [
        "check",
        "schedules/baselines/resident.sched",
        "--model",
        "deepseek-v2-lite",
    ];
    let host_mib = |extra: &[&str]| -> f64 {
        let (code, stdout, stderr) = moec(&[&args[..], extra].concat());
        assert_eq!(code, 0, "{stderr}");
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("host") && l.contains("buffers"))
            .unwrap_or_else(|| panic!("no host buffers line: {stdout}"));
        let mib = line
            .split_whitespace()
            .rev()
            .nth(1)
            .and_then(|v| v.parse::<f64>().ok());
        assert!(line.ends_with("MiB"), "{line}");
        mib.unwrap_or_else(|| panic!("no size in {line}"))
    };
    let (cpu, cuda) = (host_mib(&[]), host_mib(&["--backend", "cuda"]));
    let v_pool = (27 * 16 * (128 + 32) * (512 + 64) * 4) as f64 / (1u64 << 20) as f64;
    assert!(
        (cuda - cpu - v_pool).abs() < 0.01,
        "cpu {cpu} MiB, cuda {cuda} MiB: the V pool is {v_pool} MiB"
    );
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

/// The broken schedule the LSP session opens: layer 1's weights are read as layer 0's
/// (`values::wrong`), through a template and a label so that definitions have targets.
const LSP_BROKEN: &str = "schedule next_layer_too_early
microbatches 1 of 1
stream gpu: gpu.compute
stream h2d: gpu.copy_in
buffer emb: gpu = embed_weights()
buffer w[2]: gpu = layer_weights()
buffer h: gpu = hidden(prompt_len)
buffer q: gpu = qkv(prompt_len)
template load(i) { copy W[i] -> w[i % 2] on h2d as ld[i] }
prefill {
  copy W.embed -> emb on h2d
  embed(ub = 0, w = emb, h = h) on gpu
  for i in 0..2 { load(i) }
  pre_attn(layer = 0, ub = 0, w = w[(0 + 1) % 2], h = h, out = q) on gpu after ld[1]
}
";

/// Frames a JSON-RPC message as the protocol does.
fn lsp_frame(message: serde_json::Value) -> String {
    let body = message.to_string();
    format!("Content-Length: {}\r\n\r\n{body}", body.len())
}

/// Runs `moec lsp` on `input` (framed messages); gives its exit code, stdout and stderr.
fn lsp_session(input: &str) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_moec"))
        .arg("lsp")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("moec lsp starts");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Splits the server's output into its messages.
fn lsp_messages(mut out: &str) -> Vec<serde_json::Value> {
    let mut messages = Vec::new();
    while let Some(header_end) = out.find("\r\n\r\n") {
        let length: usize = out[..header_end]
            .strip_prefix("Content-Length: ")
            .expect("a Content-Length header")
            .parse()
            .unwrap();
        let body = &out[header_end + 4..header_end + 4 + length];
        messages.push(serde_json::from_str(body).unwrap());
        out = &out[header_end + 4 + length..];
    }
    assert!(out.is_empty(), "trailing output: {out:?}");
    messages
}

/// The `(line, character)` of a position in a JSON range.
fn lsp_position(p: &serde_json::Value) -> (u64, u64) {
    (
        p["line"].as_u64().unwrap(),
        p["character"].as_u64().unwrap(),
    )
}

/// `moec lsp`'s `backend` setting is `moec check --backend`: fiddler's `gpu_scratch(..)`
/// takes the CUDA backend's rules without a warning; with no backend (the CPU default) the
/// catalog's bound and `lint::catalog_scratch`, as `check` says; an unknown backend is shown
/// to the user, and the server compiles for the defaults.
#[test]
fn lsp_backend_setting_budgets_that_backend_s_scratch() {
    use serde_json::json;
    let text = std::fs::read_to_string("schedules/fiddler.sched").unwrap();
    let uri = "file:///work/fiddler.sched";
    let session = |options: serde_json::Value| -> Vec<serde_json::Value> {
        let mut input = String::new();
        for message in [
            json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "capabilities": {}, "initializationOptions": options}}),
            json!({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
            json!({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
                "uri": uri, "languageId": "sched", "version": 1, "text": text}}}),
            json!({"jsonrpc": "2.0", "id": 2, "method": "shutdown"}),
            json!({"jsonrpc": "2.0", "method": "exit"}),
        ] {
            input.push_str(&lsp_frame(message));
        }
        let (code, stdout, stderr) = lsp_session(&input);
        assert_eq!(code, Some(0), "{stderr}");
        lsp_messages(&stdout)
    };
    let codes = |messages: &[serde_json::Value]| -> Vec<String> {
        let published = messages
            .iter()
            .find(|m| m["method"] == json!("textDocument/publishDiagnostics"))
            .unwrap_or_else(|| panic!("no diagnostics in {messages:#?}"));
        published["params"]["diagnostics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["code"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let cuda = session(json!({"hw": "t4", "backend": "cuda"}));
    assert!(
        !codes(&cuda).iter().any(|c| c == "lint::catalog_scratch"),
        "{cuda:#?}"
    );
    let cpu = session(json!({"hw": "t4"}));
    assert!(
        codes(&cpu).iter().any(|c| c == "lint::catalog_scratch"),
        "{cpu:#?}"
    );
    let unknown = session(json!({"hw": "t4", "backend": "tpu"}));
    assert!(
        unknown
            .iter()
            .any(|m| m["method"] == json!("window/showMessage")
                && m["params"]["message"]
                    .as_str()
                    .is_some_and(|t| t.contains("backend: ") && t.contains("tpu"))),
        "{unknown:#?}"
    );
}

/// Issue 45 point 6: a scripted session with `moec lsp`. The diagnostic carries the
/// checker's span (the one `moec check` draws, line 14 column 35 1-based, over
/// `w[(0 + 1) % 2]`) and its text; hover gives a buffer's bytes and space for the card
/// named in `initializationOptions` and an op's table entry; definitions go to the buffer,
/// the template and the label; bad input gets error responses, not a crash.
#[test]
fn lsp_session_gives_diagnostics_hover_and_definitions() {
    use serde_json::json;
    let uri = "file:///work/broken.sched";
    let at = |line: u32, character: u32| json!({"textDocument": {"uri": uri}, "position": {"line": line, "character": character}});
    let mut input = String::new();
    for message in [
        json!({"jsonrpc": "2.0", "id": 0, "method": "textDocument/hover", "params": at(0, 0)}),
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "capabilities": {}, "initializationOptions": {"model": "mixtral-tiny", "hw": "t4"}}}),
        json!({"jsonrpc": "2.0", "method": "initialized", "params": {}}),
        json!({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": uri, "languageId": "sched", "version": 1, "text": LSP_BROKEN}}}),
        // `w` in `buffer w[2]`, and `pre_attn` in its call.
        json!({"jsonrpc": "2.0", "id": 2, "method": "textDocument/hover", "params": at(5, 7)}),
        json!({"jsonrpc": "2.0", "id": 3, "method": "textDocument/hover", "params": at(13, 4)}),
        // `w` in `w = w[(0 + 1) % 2]`, `load` in `load(i)`, `ld` in `after ld[1]`.
        json!({"jsonrpc": "2.0", "id": 4, "method": "textDocument/definition", "params": at(13, 34)}),
        json!({"jsonrpc": "2.0", "id": 5, "method": "textDocument/definition", "params": at(12, 19)}),
        json!({"jsonrpc": "2.0", "id": 6, "method": "textDocument/definition", "params": at(13, 80)}),
        json!({"jsonrpc": "2.0", "id": 7, "method": "no/such/method", "params": {}}),
        json!({"jsonrpc": "2.0", "id": 8, "method": "textDocument/hover", "params": {"bad": 1}}),
        json!({"jsonrpc": "2.0", "id": 9, "method": "shutdown"}),
        json!({"jsonrpc": "2.0", "method": "exit"}),
    ] {
        input.push_str(&lsp_frame(message));
        if input.matches("Content-Length").count() == 4 {
            // Not JSON: answered with a parse error, and the session goes on.
            input.push_str("Content-Length: 9\r\n\r\n{not json");
        }
    }
    let (code, stdout, stderr) = lsp_session(&input);
    assert_eq!(code, Some(0), "{stderr}");
    let messages = lsp_messages(&stdout);
    let response = |id: u64| {
        messages
            .iter()
            .find(|m| m["id"] == json!(id) && m.get("method").is_none())
            .unwrap_or_else(|| panic!("no response {id} in {messages:#?}"))
    };
    // Before `initialize`: refused (ServerNotInitialized); the bad body: a parse error.
    assert_eq!(response(0)["error"]["code"], json!(-32002));
    assert!(messages
        .iter()
        .any(|m| m["id"].is_null() && m["error"]["code"] == json!(-32700)));
    let capabilities = &response(1)["result"]["capabilities"];
    assert_eq!(capabilities["hoverProvider"], json!(true));
    assert_eq!(capabilities["definitionProvider"], json!(true));

    // The diagnostics: the checker's error at its span, with `moec check`'s text.
    let published = messages
        .iter()
        .find(|m| m["method"] == json!("textDocument/publishDiagnostics"))
        .expect("diagnostics published");
    assert_eq!(published["params"]["uri"], json!(uri));
    let diagnostics = published["params"]["diagnostics"].as_array().unwrap();
    let wrong = diagnostics
        .iter()
        .find(|d| d["code"] == json!("values::wrong"))
        .unwrap_or_else(|| panic!("no values::wrong in {diagnostics:#?}"));
    assert_eq!(wrong["severity"], json!(1));
    assert_eq!(lsp_position(&wrong["range"]["start"]), (13, 34));
    assert_eq!(
        lsp_position(&wrong["range"]["end"]),
        (13, 34 + "w[(0 + 1) % 2]".len() as u64)
    );
    let message = wrong["message"].as_str().unwrap();
    assert!(
        message.starts_with("task #4 pre_attn(layer=0, ub=0) reads `w[1]` expecting W[0].pre, but it holds W[1].pre")
            && message.contains("\nexpects W[0].pre"),
        "{message}"
    );
    let related = &wrong["relatedInformation"][0];
    assert_eq!(
        lsp_position(&related["location"]["range"]["start"]),
        (8, 19)
    );
    // `moec check` on the same text prints the same sentence.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.sched");
    std::fs::write(&path, LSP_BROKEN).unwrap();
    let (code, _, check_text) = moec(&["check", path.to_str().unwrap()]);
    assert_eq!(code, 1);
    let first_line = message.lines().next().unwrap();
    assert!(
        check_text.contains(&first_line[..60]),
        "{first_line}\n{check_text}"
    );
    assert!(
        diagnostics
            .iter()
            .any(|d| d["code"] == json!("lint::pageable_copy") && d["severity"] == json!(2)),
        "{diagnostics:#?}"
    );

    // Hover: `w`'s two elements, each a layer slot of mixtral-tiny, in gpu memory.
    let card = moec::model::card::ModelCard::load("mixtral-tiny").unwrap();
    let slot = moec::ir::catalog::size_helper("layer_weights", &[], &card, 4, 4, None)
        .unwrap()
        .unwrap()
        .bytes;
    let hover = response(2)["result"]["contents"]["value"].as_str().unwrap();
    assert!(
        hover.starts_with("**buffer** `w[2]` in `gpu`: 2 buffers of ")
            && hover.contains(&format!("({slot} bytes) each"))
            && hover.contains("mixtral-tiny on t4"),
        "{hover}"
    );
    assert_eq!(
        lsp_position(&response(2)["result"]["range"]["start"]),
        (5, 7)
    );
    let hover = response(3)["result"]["contents"]["value"].as_str().unwrap();
    let summary = moec::ir::catalog::op_by_name("pre_attn").unwrap().summary;
    assert!(
        hover.starts_with(&format!("**op** `pre_attn`: {summary}"))
            && hover.contains("`gpu.compute`"),
        "{hover}"
    );

    // Definitions: the buffer's, the template's and the label's declarations.
    let target = |id: u64| {
        let result = &response(id)["result"];
        assert_eq!(result["uri"], json!(uri), "{result}");
        (
            lsp_position(&result["range"]["start"]),
            lsp_position(&result["range"]["end"]),
        )
    };
    assert_eq!(target(4), ((5, 7), (5, 8)));
    assert_eq!(target(5), ((8, 9), (8, 13)));
    assert_eq!(target(6), ((8, 51), (8, 53)));

    assert_eq!(response(7)["error"]["code"], json!(-32601));
    assert_eq!(response(8)["error"]["code"], json!(-32602));
    assert_eq!(response(9)["result"], json!(null));
}

/// Issue 45: `moec check` says when a schedule computes with a lossy substitute, and lists
/// the format copy with its bytes (`tests/fixtures/formats/substitute.sched`: every expert
/// of the tiny Mixtral in q8_0, 32 x 104,448 bytes = 3.19 MiB; every one of the plan's 64
/// expert weight reads uses it).
#[test]
fn check_says_a_schedule_uses_a_lossy_substitute() {
    let (code, stdout, stderr) = moec(&["check", "tests/fixtures/formats/substitute.sched"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("format copy     3.19 MiB (`W.q8_0`: the experts converted at load"),
        "{stdout}"
    );
    assert!(
        stdout.contains("lossy substitute: experts in q8_0 (declared); 64 of 64 expert weight reads in the plan use it"),
        "{stdout}"
    );
    // Without a substitute, no such line.
    let (_, plain, _) = moec(&["check", "tests/fixtures/all_constructs.sched"]);
    assert!(!plain.contains("lossy substitute"), "{plain}");
}

/// `check --kv-type f16` counts the KV cache at two bytes an element, as `moec run --kv-type
/// f16` keeps it. tests/fixtures/cost/budget.sched on mixtral-tiny without a profile
/// (tests/cost_budget.rs works its bytes by hand): host 31,702,272 B with the f32 cache
/// (one CPU thread's attention tile, 32,768 B, is its op workspace), 1,310,720 B less with
/// halves, so a 31 MB budget holds the half cache and refuses the f32 one.
#[test]
fn check_counts_the_kv_cache_at_the_kv_type_it_is_given() {
    let args = [
        "check",
        "tests/fixtures/cost/budget.sched",
        "--host-mem",
        "31MB",
    ];
    let (code, _, stderr) = moec(&args);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("OVER by 702.3 kB"), "{stderr}");
    let (code, stdout, stderr) = moec(&[&args[..], &["--kv-type", "f16"]].concat());
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.starts_with("all_constructs: ok"), "{stdout}");
    let (code, _, stderr) = moec(&[&args[..], &["--kv-type", "f8"]].concat());
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("expected `f32` or `f16`"), "{stderr}");
}
