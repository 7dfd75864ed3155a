//! What a user reads is true (issue 18): every command shown in `README.md`,
//! `schedules/README.md` and `docs/*.md` is executed, and where the page shows its output,
//! the output is compared.
//!
//! How a page is read:
//! - A fenced block tagged `sh`, `console` or `bash` without `$ ` lines: each line is a
//!   command (a trailing `\` continues it; `# ...` after a command is a comment). It must
//!   exit 0, or the code its comment names (`# ... exit 1 ...`).
//! - A fenced block (any tag) whose lines start with `$ `: a session. Each `$ COMMAND` is run
//!   and the lines after it, up to the next `$ `, are its shown output (stdout, then
//!   stderr). A line `...` stands for any number of lines; `[..]` inside a line for any
//!   text. Decimal figures (`0.414 s`, `463.8 tokens/s`, `5.89 GiB`) are masked on both
//!   sides: timings, throughputs and sizes move between runs and machines; so is the width
//!   of a run of spaces (columns move with them). Integers (task, edge, token and step
//!   counts) must match.
//! - `moec` is the built binary (`printf` and `echo` lines, which write a next command's
//!   input file, run too); `cargo run --release -- ARGS` is run as `moec ARGS`.
//!   Commands run through `sh` in a scratch folder holding copies of the repository's
//!   `schedules/`, `hardware/`, `docs/`, ... (so `schedules/x.sched` resolves and outputs
//!   land in the scratch folder, never in the repository), with a cache of its own; `/tmp/`
//!   in a command is the scratch folder.
//!
//! Not run, each listed in the test's output with the reason, never silently: commands of
//! other tools (`cargo test`, `pip`, `huggingface-cli`, scripts), commands that need a GPU
//! or downloaded weights, and slow commands (a block after an HTML comment
//! `<!-- slow -->`, or `plan`, `reproduce` and the `*-mid` cards, which take minutes in a
//! debug build). `MOEC_DOCS_SLOW=1 cargo test --test docs_examples -- --nocapture` runs the
//! slow ones too.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The pages whose commands are executed.
fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md"), root.join("schedules/README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// One command found on a page, with what the page shows of its output.
#[derive(Debug, Clone)]
struct Example {
    /// `page:line`.
    place: String,
    command: String,
    /// Shown output lines (sessions only).
    shown: Option<Vec<String>>,
    /// The block was marked `<!-- slow -->`.
    marked_slow: bool,
}

/// The examples of one page.
fn examples(page: &Path) -> Vec<Example> {
    let text = std::fs::read_to_string(page).unwrap();
    let name = page
        .strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(page)
        .display()
        .to_string();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut marked_slow = false;
    while i < lines.len() {
        let line = lines[i].trim_start();
        if line.starts_with("<!--") && line.contains("slow") {
            marked_slow = true;
        }
        let Some(tag) = line.strip_prefix("```") else {
            if !line.is_empty() && !line.starts_with("<!--") {
                marked_slow = false;
            }
            i += 1;
            continue;
        };
        let tag = tag.trim().to_string();
        let start = i + 1;
        let mut end = start;
        while end < lines.len() && !lines[end].trim_start().starts_with("```") {
            end += 1;
        }
        let body = &lines[start..end.min(lines.len())];
        let session = body.iter().any(|l| l.starts_with("$ "));
        if session {
            let mut k = 0;
            while k < body.len() {
                if let Some(first) = body[k].strip_prefix("$ ") {
                    let line_no = start + k + 1;
                    let mut command = first.to_string();
                    while command.ends_with('\\') && k + 1 < body.len() {
                        command.pop();
                        k += 1;
                        command.push_str(body[k].trim_start());
                    }
                    k += 1;
                    let mut shown = Vec::new();
                    while k < body.len() && !body[k].starts_with("$ ") {
                        shown.push(body[k].to_string());
                        k += 1;
                    }
                    while shown.last().is_some_and(|l| l.trim().is_empty()) {
                        shown.pop();
                    }
                    out.push(Example {
                        place: format!("{name}:{line_no}"),
                        command,
                        shown: Some(shown),
                        marked_slow,
                    });
                } else {
                    k += 1;
                }
            }
        } else if matches!(tag.as_str(), "sh" | "console" | "bash") {
            let mut k = 0;
            while k < body.len() {
                let line_no = start + k + 1;
                let mut command = body[k].trim().to_string();
                while command.ends_with('\\') && k + 1 < body.len() {
                    command.pop();
                    k += 1;
                    command.push(' ');
                    command.push_str(body[k].trim());
                }
                k += 1;
                if command.is_empty() || command.starts_with('#') {
                    continue;
                }
                out.push(Example {
                    place: format!("{name}:{line_no}"),
                    command,
                    shown: None,
                    marked_slow,
                });
            }
        }
        marked_slow = false;
        i = end + 1;
    }
    out
}

/// The command without its trailing `# comment` (outside quotes), and the comment.
fn split_comment(command: &str) -> (String, String) {
    let mut quote = None;
    for (i, c) in command.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if i > 0 && command[..i].ends_with(char::is_whitespace) => {
                return (
                    command[..i].trim().to_string(),
                    command[i + 1..].trim().to_string(),
                )
            }
            _ => {}
        }
    }
    (command.trim().to_string(), String::new())
}

/// Why a command is not run in this mode, if it is not.
fn not_run(command: &str, marked_slow: bool, slow_mode: bool) -> Option<&'static str> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let first = words.first().copied().unwrap_or("");
    // `printf`/`echo` write the small input files a page's next command reads.
    let runs = matches!(first, "moec" | "printf" | "echo");
    if !runs && !command.starts_with("cargo run --release -- ") {
        return Some("not a moec command (another tool, a script or a build)");
    }
    if command.contains("--backend cuda") {
        return Some("needs a CUDA device (none on the test machines)");
    }
    if command.contains("~/") || command.contains("$HOME") {
        return Some("needs a checkpoint downloaded by the user");
    }
    let slow = marked_slow
        || matches!(words.get(1).copied(), Some("plan" | "reproduce"))
        || command.contains("-mid");
    if slow && !slow_mode {
        return Some("slow in a debug build (MOEC_DOCS_SLOW=1 runs it)");
    }
    None
}

/// Decimal figures masked (every `D.D` becomes `#.#`) and runs of spaces made one, since
/// a figure of another width moves the columns after it.
fn mask(line: &str) -> String {
    masked_decimals(line)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn masked_decimals(line: &str) -> String {
    let chars: Vec<char> = line.trim_end().chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_number = chars[i].is_ascii_digit() && (i == 0 || !chars[i - 1].is_ascii_digit());
        if starts_number {
            let mut j = i;
            while j < chars.len() && chars[j].is_ascii_digit() {
                j += 1;
            }
            if j + 1 < chars.len() && chars[j] == '.' && chars[j + 1].is_ascii_digit() {
                let mut k = j + 1;
                while k < chars.len() && chars[k].is_ascii_digit() {
                    k += 1;
                }
                out.push_str("#.#");
                i = k;
                continue;
            }
            out.extend(&chars[i..j]);
            i = j;
            continue;
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

/// A shown line against an actual one: masked, with `[..]` matching any text.
fn line_matches(shown: &str, actual: &str) -> bool {
    let (shown, actual) = (mask(shown), mask(actual));
    if !shown.contains("[..]") {
        return shown == actual;
    }
    let parts: Vec<&str> = shown.split("[..]").collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !actual.starts_with(first) || actual.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &actual[first.len()..];
    if !rest.ends_with(last) {
        return false;
    }
    rest = &rest[..rest.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Where the shown lines fail to match the actual ones, if they do (`...` = any lines).
fn mismatch(shown: &[String], actual: &[String]) -> Option<String> {
    let chunks: Vec<&[String]> = shown.split(|l| l.trim() == "...").collect();
    let open_start = shown.first().is_some_and(|l| l.trim() == "...");
    let open_end = shown.last().is_some_and(|l| l.trim() == "...");
    let fits = |chunk: &[String], at: usize| {
        at + chunk.len() <= actual.len()
            && chunk
                .iter()
                .zip(&actual[at..])
                .all(|(s, a)| line_matches(s, a))
    };
    let mut pos = 0;
    let n = chunks.len();
    for (index, chunk) in chunks.iter().enumerate() {
        if chunk.is_empty() {
            continue;
        }
        let found = if index == 0 && !open_start {
            fits(chunk, 0).then_some(0)
        } else if index == n - 1 && !open_end {
            let at = actual.len().checked_sub(chunk.len());
            at.filter(|&at| at >= pos && fits(chunk, at))
        } else {
            (pos..=actual.len()).find(|&at| fits(chunk, at))
        };
        match found {
            Some(at) => pos = at + chunk.len(),
            None => {
                // Name the first shown line of the chunk that has no match after `pos`.
                let missing = chunk
                    .iter()
                    .find(|s| {
                        !actual[pos.min(actual.len())..]
                            .iter()
                            .any(|a| line_matches(s, a))
                    })
                    .unwrap_or(&chunk[0]);
                return Some(format!(
                    "shown line not in the output (in order): {missing:?}"
                ));
            }
        }
    }
    if !open_end && pos != actual.len() {
        return Some("the output has more lines than shown".into());
    }
    None
}

/// A scratch folder with copies of the repository's small top-level folders (a command
/// may write into them: `--timeline docs/x.svg` must not change the repository) and a
/// link to `models/`, which no command writes.
fn scratch() -> tempfile::TempDir {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            let target = to.join(entry.file_name());
            if entry.path().is_dir() {
                copy(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for name in [
        "schedules",
        "hardware",
        "docs",
        "reproduce",
        "scripts",
        "kernels",
    ] {
        if root.join(name).is_dir() {
            copy(&root.join(name), &dir.path().join(name));
        }
    }
    std::os::unix::fs::symlink(root.join("models"), dir.path().join("models")).unwrap();
    // The PTX cache is shared with tests/cuda_backend.rs (same NVRTC, same sources, same
    // key): `moec devices` then compiles moec's kernels once for the suite, not per test
    // binary (a cold compile is over a minute and a half of CPU).
    let kernels = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-cache/cuda-kernels");
    std::fs::create_dir_all(&kernels).unwrap();
    std::fs::create_dir_all(dir.path().join(".cache")).unwrap();
    std::os::unix::fs::symlink(&kernels, dir.path().join(".cache/cuda-kernels")).unwrap();
    dir
}

/// The exit code a comment names (`exit 1`), else 0.
fn expected_code(comment: &str) -> i32 {
    comment
        .split("exit ")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Every page's commands run (or are listed as not run, with why) and their shown output
/// matches; every failure is listed before the test fails.
#[test]
fn every_command_the_docs_show_runs_and_prints_what_they_show() {
    let slow_mode = std::env::var("MOEC_DOCS_SLOW").is_ok_and(|v| v == "1");
    let dir = scratch();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_moec")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let scratch_prefix = format!("{}/", dir.path().display());
    let mut failures = Vec::new();
    let (mut ran, mut skipped) = (0, 0);
    let mut seen = std::collections::BTreeMap::new();
    for page in pages() {
        for example in examples(&page) {
            let (command, comment) = split_comment(&example.command);
            let command = match command.strip_prefix("cargo run --release -- ") {
                Some(rest) => format!("moec {rest}"),
                None => command,
            };
            if let Some(why) = not_run(&command, example.marked_slow, slow_mode) {
                println!("not run ({why}): {}  [{}]", command, example.place);
                skipped += 1;
                continue;
            }
            let command = command.replace("/tmp/", &scratch_prefix);
            // A command shown twice (a `sh` block and its session) runs once.
            let output = seen.entry(command.clone()).or_insert_with(|| {
                ran += 1;
                let started = std::time::Instant::now();
                let out = Command::new("sh")
                    .arg("-c")
                    .arg(&command)
                    .current_dir(dir.path())
                    .env("PATH", &path)
                    .env("MOEC_CACHE_DIR", dir.path().join(".cache"))
                    .env("NO_COLOR", "1")
                    .env("COLUMNS", "100")
                    .output()
                    .unwrap();
                // Per-command times, shown with `--nocapture`, find a command to mark slow.
                println!("ran in {:.1} s: {command}", started.elapsed().as_secs_f64());
                out
            });
            let code = output.status.code().unwrap_or(-1);
            let stderr = String::from_utf8_lossy(&output.stderr);
            let want = expected_code(&comment);
            if code != want {
                // ablate reports a failed schedule in its table, on stdout: show both ends.
                let stdout = String::from_utf8_lossy(&output.stdout);
                let tail: Vec<&str> = stdout.lines().rev().take(5).collect();
                failures.push(format!(
                    "{}: `{command}` exited {code}, the page implies {want}\n  stderr: {}\n  stdout (last lines): {}",
                    example.place,
                    stderr.lines().take(5).collect::<Vec<_>>().join("\n  "),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n  ")
                ));
                continue;
            }
            let Some(shown) = &example.shown else {
                continue;
            };
            let actual: Vec<String> = String::from_utf8_lossy(&output.stdout)
                .lines()
                .chain(stderr.lines())
                .map(str::to_string)
                .collect();
            if let Some(problem) = mismatch(shown, &actual) {
                failures.push(format!(
                    "{}: `{command}`: {problem}\n  actual output:\n    {}",
                    example.place,
                    actual.join("\n    ")
                ));
            }
        }
    }
    println!("{ran} commands run, {skipped} not run (listed above)");
    assert!(
        failures.is_empty(),
        "{} doc example(s) are not true:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn the_matcher_masks_decimals_and_honours_ellipses_and_wildcards() {
    let actual: Vec<String> = ["a 1.25 s", "b", "c 7 tasks", "d"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let lines = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(mismatch(&lines(&["a 9.99 s", "..."]), &actual), None);
    assert_eq!(mismatch(&lines(&["...", "c 7 tasks", "d"]), &actual), None);
    assert_eq!(
        mismatch(&lines(&["a [..] s", "b", "c 7 tasks", "d"]), &actual),
        None
    );
    assert!(mismatch(&lines(&["...", "c 8 tasks", "..."]), &actual).is_some());
    assert!(mismatch(&lines(&["a 1.25 s", "c 7 tasks", "..."]), &actual).is_some());
    assert!(mismatch(&lines(&["a 1.25 s", "b"]), &actual).is_some());
    assert_eq!(
        split_comment("moec x --y 'a # b'  # exit 1, no"),
        ("moec x --y 'a # b'".into(), "exit 1, no".into())
    );
    assert_eq!(expected_code("without a driver: exit 1, \"...\""), 1);
}

/// Top-level folders a path in ARCHITECTURE.md may start with, checked against the tree.
const TREE_ROOTS: [&str; 8] = [
    "src/",
    "tests/",
    "benches/",
    "kernels/",
    "schedules/",
    "standin/",
    "hardware/",
    "docs/",
];

/// Crates and std a `a::b` path in ARCHITECTURE.md may name; any other lowercase first
/// segment must be a module of `src/`.
const EXTERNAL: [&str; 10] = [
    "std", "cudarc", "miette", "petgraph", "pest", "rayon", "serde", "insta", "half", "ron",
];

/// The words of a Rust source text (identifiers), for finding an item's name.
fn words(text: &str) -> std::collections::HashSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// Whether a Rust source text declares `name` (an item, a method, a field, a variant) or
/// imports it as a leaf of a `use` (a re-export), not merely mentions it.
fn declares(text: &str, name: &str) -> bool {
    let is_word_end =
        |rest: &str| !rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
    let mut in_use = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("//") {
            continue;
        }
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        if t.starts_with("use ") {
            in_use = true;
        }
        if in_use {
            // A leaf: the word, not followed by `::`.
            let mut rest = t;
            while let Some(at) = rest.find(name) {
                let before = rest[..at].chars().last();
                let after = &rest[at + name.len()..];
                let starts_word = before.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
                if starts_word && is_word_end(after) && !after.starts_with("::") {
                    return true;
                }
                rest = after;
            }
            if t.contains(';') {
                in_use = false;
            }
            continue;
        }
        for kw in [
            "fn ",
            "struct ",
            "enum ",
            "trait ",
            "type ",
            "const ",
            "static ",
            "mod ",
            "unsafe fn ",
            "const fn ",
        ] {
            if let Some(rest) = t.strip_prefix(kw).and_then(|r| r.strip_prefix(name)) {
                if is_word_end(rest) {
                    return true;
                }
            }
        }
        // A field (`name: T`) or a variant (`Name,`, `Name {`, `Name(`).
        if let Some(rest) = t.strip_prefix(name) {
            if rest.starts_with(':') && !rest.starts_with("::")
                || rest.starts_with(',')
                || rest.starts_with(" {")
                || rest.starts_with('(')
                || rest.is_empty()
            {
                return true;
            }
        }
    }
    false
}

/// Every `.rs` text of a module: `src/a/b.rs`, or every file under `src/a/b/`.
fn module_text(path: &Path) -> String {
    if path.is_file() {
        return std::fs::read_to_string(path).unwrap_or_default();
    }
    let mut text = String::new();
    let mut dirs = vec![path.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = entry.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                text.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
            }
        }
    }
    text
}

/// `x a::{b, c::d} y` -> `x a::b a::c::d y` (one level of braces, as the doc writes them).
fn expand_braces(quoted: &str) -> String {
    let mut out = String::new();
    let mut rest = quoted;
    while let Some(open) = rest.find("::{") {
        let Some(close) = rest[open..].find('}').map(|c| open + c) else {
            break;
        };
        let start = rest[..open]
            .rfind(|c: char| c.is_whitespace() || "(`".contains(c))
            .map_or(0, |i| i + 1);
        out.push_str(&rest[..start]);
        let prefix = &rest[start..open];
        for part in rest[open + 3..close].split(',') {
            out.push_str(&format!(" {prefix}::{} ", part.trim()));
        }
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

/// Why a `module::path` does not name what exists, if it does not: its modules are
/// files or folders of `src/`, and the rest are names in the last module's source.
fn unresolved(path: &str, src: &Path) -> Option<String> {
    let segments: Vec<&str> = path
        .trim_start_matches("crate::")
        .trim_start_matches("moec::")
        .split("::")
        .filter(|s| !s.is_empty())
        .collect();
    let first = *segments.first()?;
    if EXTERNAL.contains(&first) {
        return None;
    }
    if first.starts_with(|c: char| c.is_ascii_uppercase()) {
        // `Type::item`: the type and its item are named somewhere in the crate.
        let all = words(&module_text(src));
        return segments
            .iter()
            .find(|s| !all.contains(**s))
            .map(|s| format!("`{s}` is named nowhere in src/"));
    }
    let mut module = src.join(first);
    if !module.is_dir() && !module.with_extension("rs").is_file() {
        return Some(format!("no module src/{first}"));
    }
    if !module.is_dir() {
        module = module.with_extension("rs");
    }
    let mut rest = &segments[1..];
    while let Some((next, tail)) = rest.split_first() {
        let dir = if module.is_dir() {
            module.clone()
        } else {
            break;
        };
        if dir.join(next).is_dir() {
            module = dir.join(next);
        } else if dir.join(format!("{next}.rs")).is_file() {
            module = dir.join(format!("{next}.rs"));
        } else {
            break;
        }
        rest = tail;
    }
    // A folder module's names are those its `mod.rs` declares or re-exports, or its
    // sibling `name.rs` where the folder holds only its submodules (`cost/plan.rs` beside
    // `cost/plan/refine.rs`).
    let file = if module.is_dir() {
        let sibling = module.with_extension("rs");
        if sibling.is_file() {
            sibling
        } else {
            module.join("mod.rs")
        }
    } else {
        module
    };
    let text = module_text(&file);
    rest.iter()
        .find(|s| !declares(&text, s))
        .map(|s| format!("`{s}` is not named in {}", file.display()))
}

/// ARCHITECTURE.md names only what exists (issue 27: it had named nine paths that were
/// gone): every path of the tree it cites (`src/...`, `tests/...::test_name`, ...) exists,
/// and every `module::path` in backticks resolves to modules of `src/` and names in them.
#[test]
fn architecture_names_only_paths_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let src = root.join("src");
    // Diagnostic codes (`values::lost_output`) are spelled like paths: they are checked
    // against the code table instead.
    let codes = std::fs::read_to_string(src.join("diag/codes.rs")).unwrap();
    let mut missing = Vec::new();
    let mut checked = 0;
    for (n, line) in doc.lines().enumerate() {
        let cited = line.split('`').skip(1).step_by(2);
        for quoted in cited {
            let quoted = expand_braces(quoted);
            for token in quoted.split(|c: char| c.is_whitespace() || "(),;".contains(c)) {
                let token = token.trim_end_matches(['.', ':']);
                if TREE_ROOTS.iter().any(|r| token.starts_with(r)) {
                    checked += 1;
                    let (file, item) = token.split_once("::").unwrap_or((token, ""));
                    if file.contains('*') || file.contains('<') {
                        continue;
                    }
                    let path = root.join(file);
                    if !path.exists() {
                        missing.push(format!("line {}: {file} does not exist", n + 1));
                    } else if !item.is_empty() && !words(&module_text(&path)).contains(item) {
                        missing.push(format!("line {}: {item} is not in {file}", n + 1));
                    }
                } else if token.contains("::") && !token.contains('/') {
                    checked += 1;
                    if codes.contains(&format!("\"{token}\"")) {
                        continue;
                    }
                    if let Some(why) = unresolved(token, &src) {
                        missing.push(format!("line {}: `{token}`: {why}", n + 1));
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: the reader is broken"
    );
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names what does not exist:\n{}",
        missing.join("\n")
    );
}

/// The inline code spans of a Markdown text (`` `x` ``), outside fenced blocks.
fn code_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        spans.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
    }
    spans
}

/// Issue 45: `docs/language.md` is the language's reference. Every word a schedule can
/// use has an entry there: the grammar's keywords, the built-in functions, size helpers,
/// symbols, fields and methods, the ops and their arguments, the engines, spaces, eviction
/// policies, predictors and hardware symbols, each read from the table the compiler uses,
/// so a word added to the language without a reference entry fails here. And the
/// walk-through's schedule shown on the page is the file its commands run.
#[test]
fn the_language_reference_has_an_entry_for_every_word() {
    use moec::elaborate::vocabulary;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/language.md")).unwrap();
    let spans = code_spans(&page);
    // An entry: the word as a code span of its own (`min`, `gpu.copy_in`).
    let entries: std::collections::HashSet<&str> = spans.iter().map(String::as_str).collect();
    // A mention: the word inside some code span (`evict "lru"` mentions `evict`).
    let mentioned: std::collections::HashSet<String> =
        spans.iter().flat_map(|s| words(s)).collect();
    let mut missing = Vec::new();
    let mut need_entry = |kind: &str, name: &str| {
        if !entries.contains(name) {
            missing.push(format!("{kind} `{name}`"));
        }
    };
    for f in vocabulary::FUNCTIONS {
        need_entry("function", f);
    }
    for f in moec::ir::catalog::SIZE_HELPERS {
        need_entry("size helper", f);
    }
    for m in vocabulary::SLICE_METHODS {
        need_entry("method", m);
    }
    for m in vocabulary::CACHE_METHODS {
        need_entry("cache method", m);
    }
    for f in vocabulary::FIELDS {
        need_entry("field", f);
    }
    for s in vocabulary::SYMBOLS {
        need_entry("symbol", s);
    }
    for w in vocabulary::WORDS {
        need_entry("word", w);
    }
    for op in moec::ir::catalog::OPS.iter() {
        need_entry("op", op.name);
    }
    for e in moec::ir::Engine::ALL {
        need_entry("engine", e.as_str());
    }
    for s in moec::ir::Space::ALL {
        need_entry("space", s.as_str());
    }
    for p in moec::ir::cache::EvictPolicy::ALL {
        need_entry("eviction policy", p.as_str());
    }
    for p in moec::ir::cache::Predictor::ALL {
        need_entry("predictor", p.as_str());
    }
    let mut symbols: Vec<&str> = moec::cost::HardwareProfile::builtins()
        .iter()
        .flat_map(|p| p.symbols().into_iter().map(|(name, _)| name))
        .collect();
    // The latency symbols exist only in a profile `moec probe --model` wrote.
    symbols.extend(["lat.cpu_token", "lat.gpu", "lat.transfer"]);
    symbols.sort_unstable();
    symbols.dedup();
    for s in symbols {
        need_entry("hardware symbol", s);
    }
    // Op arguments and the grammar's keywords: mentioned in code somewhere on the page.
    let grammar = std::fs::read_to_string(root.join("grammar/sched.pest")).unwrap();
    let keywords: std::collections::BTreeSet<&str> = grammar
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .flat_map(|l| l.split('"').skip(1).step_by(2))
        .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    assert!(keywords.contains("microbatches") && keywords.contains("prefetch"));
    let mut need_mention = |kind: &str, name: &str| {
        if !mentioned.contains(name) {
            missing.push(format!("{kind} `{name}`"));
        }
    };
    for k in keywords {
        need_mention("keyword", k);
    }
    for op in moec::ir::catalog::OPS.iter() {
        for arg in op.arg_names() {
            need_mention(&format!("argument of `{}`", op.name), arg);
        }
    }
    assert!(
        missing.is_empty(),
        "docs/language.md has no entry for: {}",
        missing.join(", ")
    );

    // `<!-- file: PATH -->` before a fenced block: the block is that file, verbatim.
    let lines: Vec<&str> = page.lines().collect();
    let mut shown_files = 0;
    for (i, line) in lines.iter().enumerate() {
        let Some(path) = line
            .trim()
            .strip_prefix("<!-- file: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let start = i + 2;
        let end = start
            + lines[start..]
                .iter()
                .position(|l| l.starts_with("```"))
                .unwrap();
        let shown = lines[start..end].join("\n") + "\n";
        let file = std::fs::read_to_string(root.join(path)).unwrap();
        assert_eq!(
            shown, file,
            "docs/language.md shows {path} differently from the file"
        );
        shown_files += 1;
    }
    assert!(
        shown_files >= 1,
        "the walk-through's schedule is shown from its file"
    );
}

/// Issue 45: the TextMate grammar (`editors/vscode/syntaxes/sched.tmLanguage.json`)
/// highlights every word of the language: the grammar's keywords (read from
/// `grammar/sched.pest` as the reference test reads them) and every word of the
/// compiler's tables (ops, functions, size helpers, methods, fields, symbols, words,
/// engines, spaces, eviction policies, predictors, hardware prefixes) appears as a whole
/// word in one of its patterns, so a word added to the language without highlighting
/// fails here.
#[test]
fn the_textmate_grammar_highlights_every_word() {
    use moec::elaborate::vocabulary;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("editors/vscode/syntaxes/sched.tmLanguage.json"))
        .unwrap();
    let grammar: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(grammar["scopeName"], "source.sched");
    // Every regex of the grammar, joined.
    let mut patterns = Vec::new();
    let mut stack = vec![&grammar];
    while let Some(node) = stack.pop() {
        match node {
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    match (key.as_str(), value) {
                        ("match" | "begin" | "end", serde_json::Value::String(s)) => {
                            patterns.push(s.clone())
                        }
                        _ => stack.push(value),
                    }
                }
            }
            serde_json::Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    let patterns = patterns.join("\n");
    // A word is highlighted when it stands alone in a pattern (an alternative of a group):
    // the characters around it are not identifier characters.
    let has_word = |word: &str| {
        let escaped = word.replace('.', "\\.");
        patterns.match_indices(&escaped).any(|(i, m)| {
            let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
            let before = patterns[..i].chars().next_back().is_none_or(|c| !ident(c));
            let after = patterns[i + m.len()..]
                .chars()
                .next()
                .is_none_or(|c| !ident(c));
            before && after
        })
    };
    let grammar_text = std::fs::read_to_string(root.join("grammar/sched.pest")).unwrap();
    let keywords: std::collections::BTreeSet<&str> = grammar_text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .flat_map(|l| l.split('"').skip(1).step_by(2))
        .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        // Not words: `_` (an identifier character) and `e` (a float's exponent).
        .filter(|w| w.len() > 1)
        .collect();
    assert!(keywords.contains("microbatches") && keywords.contains("prefetch"));
    let mut words: Vec<(&str, String)> = Vec::new();
    words.extend(keywords.iter().map(|k| ("keyword", k.to_string())));
    let tables: [(&str, &[&str]); 7] = [
        ("function", &vocabulary::FUNCTIONS),
        ("size helper", &moec::ir::catalog::SIZE_HELPERS),
        ("method", &vocabulary::SLICE_METHODS),
        ("cache method", &vocabulary::CACHE_METHODS),
        ("field", &vocabulary::FIELDS),
        ("symbol", &vocabulary::SYMBOLS),
        ("word", &vocabulary::WORDS),
    ];
    for (kind, table) in tables {
        words.extend(table.iter().map(|w| (kind, w.to_string())));
    }
    for prefix in vocabulary::HARDWARE_PREFIXES {
        words.push(("hardware prefix", prefix.trim_end_matches('.').to_string()));
    }
    words.extend(moec::ir::catalog::callable_op_names().map(|name| ("op", name.to_string())));
    words.extend(
        moec::ir::Engine::ALL
            .iter()
            .map(|e| ("engine", e.as_str().to_string())),
    );
    words.extend(
        moec::ir::Space::ALL
            .iter()
            .chain([&moec::ir::Space::Disk])
            .map(|s| ("space", s.as_str().to_string())),
    );
    words.extend(
        moec::ir::cache::EvictPolicy::ALL
            .iter()
            .map(|p| ("eviction policy", p.as_str().to_string())),
    );
    words.extend(
        moec::ir::cache::Predictor::ALL
            .iter()
            .map(|p| ("predictor", p.as_str().to_string())),
    );
    let missing: Vec<String> = words
        .iter()
        .filter(|(_, word)| !has_word(word))
        .map(|(kind, word)| format!("{kind} `{word}`"))
        .collect();
    assert!(
        missing.is_empty(),
        "editors/vscode/syntaxes/sched.tmLanguage.json does not highlight: {}",
        missing.join(", ")
    );
    // The extension names the grammar and the language configuration it ships.
    let package: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("editors/vscode/package.json")).unwrap(),
    )
    .unwrap();
    let contributes = &package["contributes"];
    assert_eq!(contributes["languages"][0]["extensions"][0], ".sched");
    for path in [
        contributes["grammars"][0]["path"].as_str().unwrap(),
        contributes["languages"][0]["configuration"]
            .as_str()
            .unwrap(),
    ] {
        assert!(root.join("editors/vscode").join(path).is_file(), "{path}");
    }
}
