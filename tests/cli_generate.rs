//! `moec generate`, `moec synth`, `moec quantize` and `moec models` as a user runs them:
//! the embedded default works with no setup, `--json` has the agreed shape, malformed
//! checkpoints give a one-line error naming what is wrong with exit code 1, and a quantised
//! GGUF holds what llama.cpp's own tools write for the same checkpoint.

#[path = "gguf_common/mod.rs"]
mod gguf_common;

use moec::quant::QuantFormat;
use moec::weights::gguf::{GgufFile, Value};
use std::path::{Path, PathBuf};
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

/// `moec quantize --weights HF --out OUT FLAGS..`, whatever its exit.
fn quantize_run(cache: &Path, hf: &Path, out: &Path, flags: &[&str]) -> Output {
    let mut args = vec![
        "quantize",
        "--weights",
        hf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(flags);
    moec(cache, &args)
}

/// [`quantize_run`], which must succeed.
fn quantize_with(cache: &Path, hf: &Path, out: &Path, flags: &[&str]) -> Output {
    let run = quantize_run(cache, hf, out, flags);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    run
}

/// `moec quantize --all q8_0` (`q4_0`, `q4_1`) of the Hugging Face folder
/// `scripts/gguf_fixtures.sh` made its GGUFs from gives, tensor for tensor, the bytes
/// `convert_hf_to_gguf.py` + `llama-quantize Q8_0` (`--pure Q4_0`, `--pure Q4_1`) wrote
/// (the formats' scales and rounding are ggml's reference definitions, so they must agree
/// to the bit), the same metadata values (but the cosmetic `general.*` names), and
/// llama.cpp (`llama_greedy`, built by that script) loads it and gives its greedy tokens
/// on llama-quantize's file.
#[test]
fn quantize_q8_0_writes_llama_quantizes_bytes_and_llama_cpp_runs_it() {
    quantize_writes_llama_quantizes_bytes("q8_0", "Q8_0");
}

/// As the Q8_0 test, for the group-wise int4 formats (`llama-quantize --pure`: the output
/// matrix in the same format, as `--all` asks).
#[test]
fn quantize_q4_0_and_q4_1_write_llama_quantizes_bytes_and_llama_cpp_runs_them() {
    quantize_writes_llama_quantizes_bytes("q4_0", "Q4_0");
    quantize_writes_llama_quantizes_bytes("q4_1", "Q4_1");
}

/// As the Q8_0 test, for the K formats: `moec quantize --all q4_k` (`q5_k`, `q6_k`) gives
/// `llama-quantize --pure Q4_K_S` (`Q5_K_S`, `Q6_K`)'s bytes, since moec's encoder runs
/// ggml's own sub-block scale searches (`make_qkx2_quants`, `make_qx_quants`).
#[test]
fn quantize_k_formats_write_llama_quantizes_bytes_and_llama_cpp_runs_them() {
    quantize_writes_llama_quantizes_bytes("q4_k", "pure-Q4_K_S");
    quantize_writes_llama_quantizes_bytes("q5_k", "pure-Q5_K_S");
    quantize_writes_llama_quantizes_bytes("q6_k", "pure-Q6_K");
}

/// `moec quantize --mix q4_k_m` (`q4_k_s`, `q5_k_m`) gives `llama-quantize FILE Q4_K_M`'s
/// file (`Q4_K_S`, `Q5_K_M`): each tensor in the type llama.cpp's rules pick (on this
/// 2-layer model: output Q6_K, layer 1's attention V and FFN down Q6_K for the M mixes,
/// both layers' attention V Q5_K for Q4_K_S) and with its bytes; llama.cpp runs it.
#[test]
fn quantize_mix_writes_llama_quantizes_types_and_bytes() {
    quantize_matches_llama_quantize(&["--mix", "q4_k_m"], "Q4_K_M");
    quantize_matches_llama_quantize(&["--mix", "q4_k_s"], "Q4_K_S");
    quantize_matches_llama_quantize(&["--mix", "q5_k_m"], "Q5_K_M");
}

/// Compares `moec quantize --all FORMAT` with the fixture `mixtral-q4-{stem}.gguf`, and
/// llama.cpp's tokens on it with `llama-{stem}.json`.
fn quantize_writes_llama_quantizes_bytes(format: &str, stem: &str) {
    quantize_matches_llama_quantize(&["--all", format], stem);
}

fn quantize_matches_llama_quantize(flags: &[&str], ty: &str) {
    let Some(fx) = gguf_common::fixtures() else {
        eprintln!("skipped: no GGUF fixtures (run scripts/gguf_fixtures.sh)");
        return;
    };
    let ids: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/llama_greedy.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    compare_with_llama_quantize(&LlamaQuantized {
        hf: &fx.join("mixtral-q4-hf"),
        flags,
        theirs: &fx.join(format!("mixtral-q4-{ty}.gguf")),
        tokens: &fx.join(format!("llama-{ty}.json")),
        prompt_ids: &ids["prompt_ids"],
        greedy: &fx.join("llama_greedy"),
        work: tmp.path(),
    });
}

/// One `moec quantize` run to compare with the file llama.cpp's tools made.
struct LlamaQuantized<'a> {
    /// The Hugging Face folder both were made from.
    hf: &'a Path,
    /// moec quantize's type flags.
    flags: &'a [&'a str],
    /// llama-quantize's file.
    theirs: &'a Path,
    /// llama.cpp's greedy tokens on it (`llama_greedy`'s JSON).
    tokens: &'a Path,
    /// The prompt ids those tokens follow.
    prompt_ids: &'a serde_json::Value,
    /// The `llama_greedy` binary.
    greedy: &'a Path,
    /// A scratch folder.
    work: &'a Path,
}

/// `moec quantize` of `c.hf` equals `c.theirs` tensor by tensor (names, types, dims,
/// bytes) and metadata key by key, both ways, but for what the converter derives from
/// the folder name and parameter count (`general.name`, `basename`, `finetune`,
/// `size_label`) and the pre-tokenizer name it hashes from transformers' tokenisation
/// (`tokenizer.ggml.pre`; moec names it by the split regex); OLMoE's `<|padding|>`, a
/// token transformers' class adds that `tokenizer.json` lacks, may be moec's `[PADi]`.
/// llama.cpp runs moec's file with its greedy tokens on llama-quantize's.
fn compare_with_llama_quantize(c: &LlamaQuantized) {
    if !c.theirs.is_file() {
        eprintln!(
            "skipped: no {} (rerun scripts/gguf_fixtures.sh)",
            c.theirs.display()
        );
        return;
    }
    let what = c.theirs.file_name().unwrap().to_string_lossy().into_owned();
    let ours = c.work.join(format!("ours-{what}"));
    let out = quantize_with(c.work, c.hf, &ours, c.flags);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (a, b) = (
        GgufFile::open(&ours).unwrap(),
        GgufFile::open(c.theirs).unwrap(),
    );
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (name, tb) in &b.tensors {
        // The summary names each quantised type the file holds.
        if let Some(q) = QuantFormat::from_ggml_type(tb.ggml_type) {
            assert!(stdout.contains(q.name()), "{stdout}");
        }
        let ta = &a.tensors[name];
        assert_eq!(
            (ta.ggml_type, &ta.dims),
            (tb.ggml_type, &tb.dims),
            "{what} {name}"
        );
        assert!(
            a.bytes()[ta.range.clone()] == b.bytes()[tb.range.clone()],
            "{what} {name}: bytes differ from llama-quantize's"
        );
    }
    let cosmetic = [
        "general.name",
        "general.basename",
        "general.finetune",
        "general.size_label",
        "tokenizer.ggml.pre",
    ];
    let keys: std::collections::BTreeSet<&String> =
        a.metadata.keys().chain(b.metadata.keys()).collect();
    for key in keys.into_iter().filter(|k| !cosmetic.contains(&k.as_str())) {
        let (va, vb) = (a.metadata.get(key), b.metadata.get(key));
        if let (Some(Value::Array(xa)), Some(Value::Array(xb))) = (va, vb) {
            let differ: Vec<usize> = (0..xa.len().max(xb.len()))
                .filter(|&i| xa.get(i) != xb.get(i))
                .collect();
            let padding = b
                .metadata
                .get("tokenizer.ggml.tokens")
                .and_then(|t| match t {
                    Value::Array(t) => t
                        .iter()
                        .position(|v| *v == Value::Str("<|padding|>".into())),
                    _ => None,
                });
            let olmoe = a.metadata.get("general.architecture") == Some(&Value::Str("olmoe".into()));
            let allowed = olmoe && padding.is_some() && differ == [padding.unwrap()];
            assert!(
                differ.is_empty() || allowed,
                "{what} `{key}` differs at {differ:?}"
            );
        } else {
            assert_eq!(va, vb, "{what} metadata `{key}`");
        }
    }
    if !c.greedy.is_file() || !c.tokens.is_file() {
        eprintln!(
            "skipped the llama.cpp run: no {} or {}",
            c.greedy.display(),
            c.tokens.display()
        );
        return;
    }
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c.tokens).unwrap()).unwrap();
    let mut args = vec![ours.display().to_string(), "16".into()];
    args.extend(
        c.prompt_ids
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string()),
    );
    let run = Command::new(c.greedy).args(&args).output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(got["tokens"], expected["tokens"], "{what}");
}

/// The GGUF fixture folders (llama.cpp's tools, the families' files) and llama.cpp's
/// greedy ids on them (`llama_greedy_families.json`); `None`, saying so, on a clean clone.
fn family_quantize_fixtures() -> Option<(PathBuf, PathBuf, serde_json::Value)> {
    let (Some(fx), Some(ffx)) = (gguf_common::fixtures(), gguf_common::family_fixtures()) else {
        eprintln!("skipped: no GGUF family fixtures (run scripts/gguf_fixtures.sh)");
        return None;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ids = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/gguf/llama_greedy_families.json"))
            .unwrap(),
    )
    .unwrap();
    Some((fx, ffx, ids))
}

/// The other families: for Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2 and DeepSeek-V3,
/// `moec quantize --all q8_0` (and for Qwen3-MoE and DeepSeek-V2 `--mix q4_k_m`) of
/// `moec synth`'s checkpoint equal `convert_hf_to_gguf.py` + `llama-quantize Q8_0`
/// (`Q4_K_M`) of the same checkpoint (scripts/gguf_fixtures.sh's and
/// scripts/gguf_deepseek_v3.sh's family files) tensor by tensor and key by key (as
/// [`compare_with_llama_quantize`] says; DeepSeek's `kv_b_proj` split per head into
/// `attn_k_b`/`attn_v_b` included), and llama.cpp runs moec's files with its tokens on
/// those (but DeepSeek-V3, whose reference tokens are llama.cpp's with f32 attention).
#[test]
fn quantize_writes_every_family_as_llama_cpp_does() {
    let Some((fx, ffx, ids)) = family_quantize_fixtures() else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for family in [
        "qwen3-moe",
        "qwen2-moe",
        "olmoe",
        "deepseek-v2",
        "deepseek-v3",
        "dbrx",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = tmp.path().join("hf");
        let ron = root.join(format!("tests/fixtures/gguf/{family}-q4-tiny.ron"));
        let synth = moec(
            tmp.path(),
            &[
                "synth",
                "--model",
                ron.to_str().unwrap(),
                "--out",
                hf.to_str().unwrap(),
            ],
        );
        assert!(
            synth.status.success(),
            "{}",
            String::from_utf8_lossy(&synth.stderr)
        );
        // The Q4_K_M mix of two families (Qwen3-MoE's 8 experts: attention K and V in
        // Q8_0; DeepSeek's 3-D `attn_k_b`/`attn_v_b`) keeps the test cheap; the Mixtral
        // test covers the mixes' other rules.
        let mixes: &[([&str; 2], &str)] = if ["qwen3-moe", "deepseek-v2", "dbrx"].contains(&family)
        {
            &[(["--all", "q8_0"], "Q8_0"), (["--mix", "q4_k_m"], "Q4_K_M")]
        } else {
            &[(["--all", "q8_0"], "Q8_0")]
        };
        for (flags, ty) in mixes {
            compare_with_llama_quantize(&LlamaQuantized {
                hf: &hf,
                flags,
                theirs: &ffx.join(format!("{family}-q4-{ty}.gguf")),
                tokens: &ffx.join(format!("llama-{family}-{ty}.json")),
                prompt_ids: &ids[family]["prompt_ids"],
                greedy: &fx.join("llama_greedy"),
                work: tmp.path(),
            });
        }
    }
}

/// gpt-oss, from `moec synth`'s two checkpoints of `gpt-oss-q4-tiny.ron` (the Hub's MXFP4
/// experts, `--mxfp4`, and bf16), each `moec quantize` equals the file llama.cpp's tools
/// made (scripts/gguf_fixtures.sh's gpt-oss section) tensor by tensor and key by key, as
/// [`compare_with_llama_quantize`] says (the fused experts split into
/// `ffn_{gate,up,down}_exps` with gate/up de-interleaved, biases, sinks, YaRN, sliding
/// window), and llama.cpp runs moec's files with its tokens on those:
/// - the default on the MXFP4 folder (experts kept MXFP4, the rest bf16) is
///   `convert_hf_to_gguf.py --outtype bf16`: the Hub's MXFP4 blocks copied unchanged;
/// - `experts=mxfp4` with Q8_0 attention, embedding and head on the MXFP4 folder is the
///   converter's `--outtype q8_0` (MXFP4 experts beside Q8_0);
/// - `--mix mxfp4_moe` on the MXFP4 folder is `llama-quantize MXFP4_MOE` of the converter's
///   MXFP4 file (the MXFP4 blocks copied again, the rest Q8_0);
/// - `--all q8_0` on the bf16 folder is `llama-quantize --pure Q8_0` of the converter's f32
///   file, and `--mix mxfp4_moe` its `MXFP4_MOE` (ggml's MXFP4 quantiser on the experts).
///
/// moec runs its own `--all q8_0` file with llama.cpp's greedy tokens on it for at least
/// 95% of the positions (issue 29's bar); the other files hold the converter's very bytes,
/// which `gguf_families_greedy_tokens_match_llama_cpp` (tests/model_checkpoint.rs) runs.
#[test]
fn quantize_writes_gpt_oss_as_llama_cpp_does() {
    let Some((fx, ffx, ids)) = family_quantize_fixtures() else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let ron = root.join("tests/fixtures/gguf/gpt-oss-q4-tiny.ron");
    // The converter names `general.name` from the folder; moec's test ignores it.
    let (mxfp4, bf16) = (tmp.path().join("gpt-oss-q4-hf"), tmp.path().join("bf16"));
    for (dir, extra) in [(&mxfp4, Some("--mxfp4")), (&bf16, None)] {
        let mut args = vec!["synth", "--model", ron.to_str().unwrap()];
        args.extend(extra);
        args.extend(["--out", dir.to_str().unwrap()]);
        let synth = moec(tmp.path(), &args);
        assert!(
            synth.status.success(),
            "{}",
            String::from_utf8_lossy(&synth.stderr)
        );
    }
    let q8_rest = "experts=mxfp4,attention=q8_0,embedding=q8_0,head=q8_0";
    let cases: [(&Path, &[&str], &str); 5] = [
        (&mxfp4, &[], "bf16"),
        (&mxfp4, &["--weight-format", q8_rest], "Q8_0"),
        (&mxfp4, &["--mix", "mxfp4_moe"], "hub-MXFP4_MOE"),
        (&bf16, &["--all", "q8_0"], "pure-Q8_0"),
        (&bf16, &["--mix", "mxfp4_moe"], "MXFP4_MOE"),
    ];
    for (hf, flags, ty) in cases {
        compare_with_llama_quantize(&LlamaQuantized {
            hf,
            flags,
            theirs: &ffx.join(format!("gpt-oss-q4-{ty}.gguf")),
            tokens: &ffx.join(format!("llama-gpt-oss-{ty}.json")),
            prompt_ids: &ids["gpt-oss"]["prompt_ids"],
            greedy: &fx.join("llama_greedy"),
            work: tmp.path(),
        });
    }
    let ours = tmp.path().join("ours-gpt-oss-q4-pure-Q8_0.gguf");
    let tokens = ffx.join("llama-gpt-oss-pure-Q8_0.json");
    if !ours.is_file() || !tokens.is_file() {
        return;
    }
    let gen = moec(
        tmp.path(),
        &[
            "generate",
            "--weights",
            ours.to_str().unwrap(),
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "16",
            "--json",
        ],
    );
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&gen.stdout).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tokens).unwrap()).unwrap();
    let (got, want) = (
        got["outputs"][0]["token_ids"].as_array().unwrap().clone(),
        want["tokens"].as_array().unwrap().clone(),
    );
    let agree = got.iter().zip(&want).filter(|(a, b)| a == b).count();
    assert!(
        agree * 100 >= 95 * want.len(),
        "moec on its gpt-oss --all q8_0 file: {agree} of {} of llama.cpp's tokens\n  moec  \
         {got:?}\n  llama {want:?}",
        want.len()
    );
}

/// Without llama.cpp's files: `moec quantize`'s default for a gpt-oss Hub checkpoint keeps
/// its MXFP4 expert blocks and its bf16 tensors as they are, so moec generates the same
/// tokens from the GGUF as from the folder; `gpt-oss-tiny`, whose Mixtral tokenizer has no
/// split expression for llama.cpp to name (the converter refuses it too, "BPE
/// pre-tokenizer was not recognized"), is one line naming that, and no file.
#[test]
fn quantize_keeps_gpt_oss_mxfp4_experts_as_the_hub_stores_them() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let synth = |model: &str, dir: &Path| {
        let run = moec(
            tmp.path(),
            &[
                "synth",
                "--model",
                model,
                "--mxfp4",
                "--out",
                dir.to_str().unwrap(),
            ],
        );
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
    };
    let (hf, out) = (tmp.path().join("hf"), tmp.path().join("default.gguf"));
    let ron = root.join("tests/fixtures/gguf/gpt-oss-q4-tiny.ron");
    synth(ron.to_str().unwrap(), &hf);
    let wrote = quantize_with(tmp.path(), &hf, &out, &[]);
    let stdout = String::from_utf8_lossy(&wrote.stdout);
    assert!(
        stdout.contains("MXFP4") && stdout.contains("BF16"),
        "{stdout}"
    );
    // 4 layers x gate, up, down: the blocks copied, as the summary says.
    assert!(
        stdout.contains("12 tensors: the checkpoint's MXFP4 blocks, copied"),
        "{stdout}"
    );
    let tokens = |weights: &Path| -> serde_json::Value {
        let gen = moec(
            tmp.path(),
            &[
                "generate",
                "--weights",
                weights.to_str().unwrap(),
                "--prompt",
                "The capital of France is",
                "--max-new-tokens",
                "8",
                "--json",
            ],
        );
        assert!(
            gen.status.success(),
            "{}",
            String::from_utf8_lossy(&gen.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&gen.stdout).unwrap();
        json["outputs"][0]["token_ids"].clone()
    };
    assert_eq!(tokens(&out), tokens(&hf));
    let (tiny, refused_out) = (tmp.path().join("tiny"), tmp.path().join("tiny.gguf"));
    synth("gpt-oss-tiny", &tiny);
    let refused = quantize_run(tmp.path(), &tiny, &refused_out, &[]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_line(&refused).contains("split regex"),
        "{}",
        stderr_line(&refused)
    );
    assert!(!refused_out.exists());
}

/// What `moec quantize` cannot do is one line and exit 1, with no file left behind; what it
/// writes, moec runs.
#[test]
fn quantize_refuses_clearly_and_what_it_writes_runs() {
    let cache = tempfile::tempdir().unwrap();
    let dir = synth_into(cache.path(), "ck");
    let out_path = cache.path().join("e.gguf");
    let quantize = |extra: &[&str]| quantize_run(cache.path(), &dir, &out_path, extra);
    // mixtral-tiny's rows are 128 weights: not whole 256-weight K-quant blocks.
    let refused = quantize(&[]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_line(&refused).contains("Q4_K"),
        "{}",
        stderr_line(&refused)
    );
    assert!(!out_path.exists());
    let bad = quantize(&["--all", "q3_k"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr_line(&bad).contains("q3_k"));
    let ok = quantize(&["--weight-format", "experts=q8_0"]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let again = quantize(&["--weight-format", "experts=q8_0"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(stderr_line(&again).contains("already exists"));
    let leftovers: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temporaries left: {leftovers:?}");
    let gen = moec(
        cache.path(),
        &[
            "generate",
            "--weights",
            out_path.to_str().unwrap(),
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    );
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
    // Q5_0 (llama.cpp's Q4_K_M fallback for rows that are not whole super-blocks) is
    // written where the other formats are, and what it writes runs.
    let q5_path = cache.path().join("e-q5_0.gguf");
    let q5 = quantize_run(
        cache.path(),
        &dir,
        &q5_path,
        &["--weight-format", "experts=q5_0,attention=q5_0"],
    );
    assert!(
        q5.status.success(),
        "{}",
        String::from_utf8_lossy(&q5.stderr)
    );
    let gen = moec(
        cache.path(),
        &[
            "generate",
            "--weights",
            q5_path.to_str().unwrap(),
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    );
    assert!(
        gen.status.success(),
        "{}",
        String::from_utf8_lossy(&gen.stderr)
    );
}

/// `moec perplexity --json` of `weights` against `reference` on the embedded text.
fn perplexity_json(cache: &Path, weights: &Path, reference: &Path) -> serde_json::Value {
    let out = moec(
        cache,
        &[
            "perplexity",
            "--weights",
            weights.to_str().unwrap(),
            "--reference",
            reference.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Each of llama.cpp's GGUFs of the tiny Mixtral against the bf16 folder they were made
/// from, on the embedded text (252 predictions). The f32 file holds the folder's values
/// exactly, so its distributions are the folder's to the bit (KL 0, every top token the
/// same). The quantised files are bounded by what this random-weight model measured with
/// the default product (8-bit activations), with about 3x headroom on the KL (Q8_0: mean
/// KL 7.7e-4 nats, top-1 96.4%; Q4_K_M: 0.085 nats, 73.8%; the f32-decoded product gives
/// 3.4e-4 / 99.2% and 0.085 / 74.6%): a random model's logits spread over 28, so its KL is
/// far above a trained model's (llama.cpp reports about 1e-3 for Q8_0 and 1e-2 for Q4_K_M
/// on LLaMA), and the bounds are regression bounds for this fixture. What holds for any
/// model is the order: Q8_0's 8.5 bits a weight stay closer than Q4_K_M's 4.9.
#[test]
fn perplexity_of_llama_cpps_ggufs_against_their_bf16_source() {
    let Some(fx) = gguf_common::fixtures() else {
        eprintln!("skipped: no GGUF fixtures (run scripts/gguf_fixtures.sh)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let hf = fx.join("mixtral-q4-hf");
    let report = |t: &str| {
        let j = perplexity_json(tmp.path(), &fx.join(format!("mixtral-q4-{t}.gguf")), &hf);
        assert_eq!(j["report"]["predictions"], 252);
        j["report"]["reference"].clone()
    };
    let exact = report("f32");
    assert_eq!(exact["mean_kl"].as_f64(), Some(0.0));
    assert_eq!(exact["top1_agreement"].as_f64(), Some(1.0));
    let (q8, q4) = (report("Q8_0"), report("Q4_K_M"));
    let kl = |r: &serde_json::Value| r["mean_kl"].as_f64().unwrap();
    let top1 = |r: &serde_json::Value| r["top1_agreement"].as_f64().unwrap();
    assert!(kl(&q8) < 2.5e-3 && top1(&q8) >= 0.9, "Q8_0: {q8}");
    assert!(kl(&q4) < 0.25 && top1(&q4) >= 0.6, "Q4_K_M: {q4}");
    assert!(kl(&q8) < kl(&q4), "Q8_0 {q8} against Q4_K_M {q4}");
}

/// With no fixture: the embedded default scores, a checkpoint against itself is at KL 0,
/// and a window that predicts nothing or a text shorter than a window is one line, exit 1.
#[test]
fn perplexity_runs_on_the_default_and_refuses_bad_windows() {
    let cache = tempfile::tempdir().unwrap();
    let dir = synth_into(cache.path(), "ck");
    let same = perplexity_json(cache.path(), &dir, &dir);
    assert_eq!(same["report"]["reference"]["mean_kl"].as_f64(), Some(0.0));
    assert!(same["report"]["perplexity"].as_f64().unwrap() > 1.0);
    let d = dir.to_str().unwrap();
    let bad = moec(
        cache.path(),
        &["perplexity", "--weights", d, "--window", "1"],
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(stderr_line(&bad).contains("window of 1"));
    let short = cache.path().join("short.txt");
    std::fs::write(&short, "Hello there").unwrap();
    let out = moec(
        cache.path(),
        &[
            "perplexity",
            "--weights",
            d,
            "--text",
            short.to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr_line(&out).contains("fewer than one window"),
        "{}",
        stderr_line(&out)
    );
}
