//! `moec generate`, `moec synth` and `moec models` as a user runs them: the embedded
//! default works with no setup, `--json` has the agreed shape, and malformed checkpoints
//! give a one-line error naming what is wrong with exit code 1.

use std::path::Path;
use std::process::{Command, Output};

fn moec(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moec"))
        .args(args)
        .env("MOEC_CACHE_DIR", cache)
        .output()
        .expect("run moec")
}

fn stderr_line(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected a one-line error, got:\n{text}");
    lines[0].to_string()
}

#[test]
fn embedded_default_generates_text_and_reports_tokens_per_second() {
    let cache = tempfile::tempdir().unwrap();
    let out = moec(
        cache.path(),
        &[
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "8",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("The capital of France is"), "{text}");
    assert!(
        text.contains("tokens/s") && text.contains("mixtral-tiny"),
        "{text}"
    );
    // The synthetic checkpoint landed in the cache, complete, with no temp folders left.
    let synthetic = cache.path().join("synthetic");
    let entries: Vec<String> = std::fs::read_dir(&synthetic)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert!(entries[0].starts_with("mixtral-tiny-seed0-bf16-v"));
    assert!(synthetic
        .join(&entries[0])
        .join("model.safetensors")
        .is_file());
}

#[test]
fn json_output_has_outputs_and_stats() {
    let cache = tempfile::tempdir().unwrap();
    let prompts = cache.path().join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"Hello there\"}\n\n\"Another prompt\"\n",
    )
    .unwrap();
    let out = moec(
        cache.path(),
        &[
            "generate",
            "--model",
            "dbrx-tiny",
            "--prompts",
            prompts.to_str().unwrap(),
            "--prompt",
            "x",
            "--max-new-tokens",
            "5",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let outputs = v["outputs"].as_array().unwrap();
    assert_eq!(outputs.len(), 3);
    assert_eq!(outputs[0]["prompt"], "x");
    assert_eq!(outputs[1]["prompt"], "Hello there");
    for o in outputs {
        let ids = o["token_ids"].as_array().unwrap();
        let lps = o["logprobs"].as_array().unwrap();
        assert_eq!(ids.len(), lps.len());
        assert!(!ids.is_empty() && ids.len() <= 5);
        assert!(o["text"].is_string());
        assert!(lps.iter().all(|l| l.as_f64().unwrap() <= 0.0));
    }
    let stats = &v["stats"];
    let generated: u64 = outputs
        .iter()
        .map(|o| o["token_ids"].as_array().unwrap().len() as u64)
        .sum();
    assert_eq!(stats["generated_tokens"].as_u64().unwrap(), generated);
    assert!(stats["prompt_tokens"].as_u64().unwrap() >= 4);
    assert!(
        stats["seconds"].as_f64().unwrap() > 0.0 && stats["tokens_per_s"].as_f64().unwrap() > 0.0
    );
}

fn synth_into(cache: &Path, name: &str) -> std::path::PathBuf {
    let dir = cache.join(name);
    let out = moec(
        cache,
        &[
            "synth",
            "--model",
            "mixtral-tiny",
            "--out",
            dir.to_str().unwrap(),
            "--seed",
            "3",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

#[test]
fn synth_then_generate_from_weights_with_and_without_card() {
    let cache = tempfile::tempdir().unwrap();
    let dir = synth_into(cache.path(), "ck");
    assert!(dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file());
    let w = dir.to_str().unwrap();
    let alone = moec(
        cache.path(),
        &[
            "generate",
            "--weights",
            w,
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    );
    let both = moec(
        cache.path(),
        &[
            "generate",
            "--model",
            "mixtral-tiny",
            "--weights",
            w,
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    );
    assert!(alone.status.success() && both.status.success());
    let ids = |o: &Output| {
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["outputs"][0]["token_ids"]
            .clone()
    };
    assert_eq!(ids(&alone), ids(&both));
    // Seed 3 differs from the embedded default (seed 0).
    let default = moec(
        cache.path(),
        &[
            "generate",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    );
    assert_ne!(ids(&alone), ids(&default));
    // Refuses to overwrite.
    let again = moec(
        cache.path(),
        &["synth", "--model", "mixtral-tiny", "--out", w],
    );
    assert_eq!(again.status.code(), Some(1));
    assert!(stderr_line(&again).contains("already exists"));
}

/// Each malformed checkpoint: exit 1 and one line naming the file / tensor / field.
#[test]
fn malformed_checkpoints_fail_with_one_line() {
    let cache = tempfile::tempdir().unwrap();
    let run = |dir: &Path, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--weights",
            dir.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "2",
        ];
        args.extend_from_slice(extra);
        let out = moec(cache.path(), &args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        stderr_line(&out)
    };
    // Truncated safetensors.
    let dir = synth_into(cache.path(), "truncated");
    let st = dir.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&st)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let line = run(&dir, &[]);
    assert!(
        line.contains("truncated") && line.contains("model.safetensors"),
        "{line}"
    );
    // Bad config.json.
    let dir = synth_into(cache.path(), "badconfig");
    std::fs::write(dir.join("config.json"), "{ this is not json").unwrap();
    let line = run(&dir, &[]);
    assert!(
        line.contains("config.json") && line.contains("not a valid config.json"),
        "{line}"
    );
    // A missing tensor: the header names one that is not there.
    let dir = synth_into(cache.path(), "missing");
    let index = serde_json::json!({"weight_map": {"model.norm.weight": "model.safetensors", "ghost.weight": "model.safetensors"}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let line = run(&dir, &[]);
    assert!(
        line.contains("missing tensor") && line.contains("ghost.weight"),
        "{line}"
    );
    // Wrong shape: a config whose ffn disagrees with the stored tensors.
    let dir = synth_into(cache.path(), "shape");
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 256", "\"intermediate_size\": 192");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let line = run(&dir, &[]);
    assert!(
        line.contains("model.safetensors")
            && line.contains("has shape [256, 128], expected [192, 128]"),
        "{line}"
    );
    // Config contradicting the chosen card.
    let dir = synth_into(cache.path(), "card");
    let line = run(&dir, &["--model", "dbrx-tiny"]);
    assert!(
        line.contains("config.json") && line.contains("dbrx-tiny"),
        "{line}"
    );
    // No weights at all.
    let line = run(&cache.path().join("nowhere"), &[]);
    assert!(
        line.contains("nowhere") && line.contains("config.json"),
        "{line}"
    );
}

#[test]
fn bad_arguments_are_one_line_errors() {
    let cache = tempfile::tempdir().unwrap();
    let none = moec(cache.path(), &["generate", "--max-new-tokens", "2"]);
    assert_eq!(none.status.code(), Some(1));
    assert!(stderr_line(&none).contains("no prompts"));
    let big = moec(
        cache.path(),
        &["generate", "--model", "dbrx", "--prompt", "x"],
    );
    assert_eq!(big.status.code(), Some(1));
    assert!(stderr_line(&big).contains("--weights"));
    let unknown = moec(
        cache.path(),
        &["generate", "--model", "gpt-5", "--prompt", "x"],
    );
    assert!(stderr_line(&unknown).contains("unknown model card"));
    let bad_jsonl = cache.path().join("bad.jsonl");
    std::fs::write(&bad_jsonl, "{\"text\": 1}\n").unwrap();
    let out = moec(
        cache.path(),
        &["generate", "--prompts", bad_jsonl.to_str().unwrap()],
    );
    assert!(stderr_line(&out).contains("bad.jsonl:1"));
}

#[test]
fn models_lists_every_card_with_layer_bytes() {
    let cache = tempfile::tempdir().unwrap();
    let out = moec(cache.path(), &["models"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for name in [
        "mixtral-8x7b",
        "mixtral-8x22b",
        "dbrx",
        "mixtral-mid",
        "dbrx-mid",
        "mixtral-tiny",
        "dbrx-tiny",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing:\n{text}"
        );
    }
    // Mixtral-8x7B: 46.70 B parameters, 8 experts of 352.3 MB (3 x 4096 x 14336 x 2 bytes).
    let line = text
        .lines()
        .find(|l| l.starts_with("mixtral-8x7b"))
        .unwrap();
    assert!(
        line.contains("46.70 B") && line.contains("8x352.3 MB"),
        "{line}"
    );
}

/// A prompt file longer than one oracle batch (256 prompts) is generated batch by batch:
/// every prompt gets its output, in file order, and greedy outputs do not depend on the
/// batching (the last prompts, alone in a short file, give the same tokens; a too-long
/// prompt deep in the file is named by its line's index, not its index in the batch).
#[test]
fn long_prompt_files_are_generated_in_batches_with_the_same_outputs() {
    let cache = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..300)
        .map(|i| format!("{{\"prompt\": \"number {i} is\"}}"))
        .collect();
    let long = cache.path().join("long.jsonl");
    std::fs::write(&long, prompts.join("\n")).unwrap();
    let short = cache.path().join("short.jsonl");
    std::fs::write(&short, prompts[290..].join("\n")).unwrap();
    let run = |file: &Path| {
        let out = moec(
            cache.path(),
            &[
                "generate",
                "--prompts",
                file.to_str().unwrap(),
                "--max-new-tokens",
                "2",
                "--json",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        doc["outputs"].as_array().unwrap().clone()
    };
    let long_out = run(&long);
    let short_out = run(&short);
    assert_eq!(long_out.len(), 300);
    assert_eq!(long_out[299]["prompt"], "number 299 is");
    for (a, b) in long_out[290..].iter().zip(&short_out) {
        assert_eq!(a["prompt"], b["prompt"]);
        assert_eq!(a["token_ids"], b["token_ids"]);
    }
    let mut with_long = prompts.clone();
    with_long[280] = format!("{{\"prompt\": \"{}\"}}", "word ".repeat(3000));
    std::fs::write(&long, with_long.join("\n")).unwrap();
    let out = moec(
        cache.path(),
        &["generate", "--prompts", long.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    let line = stderr_line(&out);
    assert!(line.contains("prompt 280"), "{line}");
}
