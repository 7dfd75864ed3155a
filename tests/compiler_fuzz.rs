//! No input makes the compiler panic: truncations, shuffled and duplicated lines, byte
//! flips and random bytes of every fixture and schedule all end in `Ok` or diagnostics.
//! Deterministic (a fixed xorshift seed), so a failure reproduces.

use moec::compile::{compile, Options};
use moec::model::card::ModelCard;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn sources() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for dir in ["tests/fixtures", "tests/fixtures/diag", "schedules"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            if path.extension().is_some_and(|e| e == "sched") {
                out.push((
                    path.display().to_string(),
                    std::fs::read_to_string(&path).unwrap(),
                ));
            }
        }
    }
    assert!(!out.is_empty());
    out
}

/// Variants per source; `MOEC_FUZZ_ROUNDS=N` multiplies them for a longer local run.
fn rounds(base: usize) -> usize {
    base * std::env::var("MOEC_FUZZ_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1)
}

fn options() -> Options {
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    // Mutations can turn a small loop into a huge one; keep each attempt quick.
    options.limits.max_tasks = 20_000;
    options.limits.max_iterations = 200_000;
    options
}

fn must_not_panic(name: &str, source: &str, options: &Options) {
    let result = std::panic::catch_unwind(|| {
        let _ = compile(source, options);
    });
    if result.is_err() {
        let path = std::env::temp_dir().join("moec-fuzz-crash.sched");
        let _ = std::fs::write(&path, source);
        panic!(
            "compiler panicked on a variant of {name}; input saved to {}",
            path.display()
        );
    }
}

#[test]
fn truncated_schedules_never_panic() {
    let options = options();
    for (name, source) in sources() {
        let mut cut = 0;
        let step = (source.len() / 40).max(1);
        while cut < source.len() {
            if source.is_char_boundary(cut) {
                must_not_panic(&name, &source[..cut], &options);
            }
            cut += step;
        }
    }
}

#[test]
fn shuffled_and_duplicated_lines_never_panic() {
    let options = options();
    let mut rng = XorShift(0x5eed_cafe_f00d_1234);
    for (name, source) in sources() {
        let lines: Vec<&str> = source.lines().collect();
        for _ in 0..rounds(12) {
            let mut variant = lines.clone();
            for _ in 0..3 {
                let (a, b) = (rng.below(variant.len()), rng.below(variant.len()));
                variant.swap(a, b);
            }
            let dup = rng.below(variant.len());
            variant.insert(dup, lines[rng.below(lines.len())]);
            must_not_panic(&name, &variant.join("\n"), &options);
        }
    }
}

#[test]
fn flipped_tokens_and_random_bytes_never_panic() {
    let options = options();
    let mut rng = XorShift(0x0123_4567_89ab_cdef);
    let alphabet: &[&str] = &[
        "(",
        ")",
        "{",
        "}",
        "[",
        "]",
        "0",
        "-1",
        "..",
        "=",
        "->",
        "%",
        "/",
        "hot(0, 0)",
        "!",
        "&&",
        "W",
        ".page(0, 0)",
        "99999999999",
        "\"",
        "//",
        "\n",
    ];
    for (name, source) in sources() {
        for _ in 0..rounds(25) {
            let mut variant = source.clone();
            for _ in 0..2 {
                let mut at = rng.below(variant.len());
                while !variant.is_char_boundary(at) {
                    at -= 1;
                }
                variant.insert_str(at, alphabet[rng.below(alphabet.len())]);
            }
            must_not_panic(&name, &variant, &options);
        }
    }
    for len in [0, 1, 7, 64, 512, 4096] {
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        must_not_panic("random bytes", &String::from_utf8_lossy(&bytes), &options);
        let ascii: String = (0..len)
            .map(|_| (b' ' + (rng.next() % 95) as u8) as char)
            .collect();
        must_not_panic("random text", &ascii, &options);
    }
}

/// Runs `f` on a thread with a 2 MiB stack (a spawned thread's default; the main thread has
/// 8 MiB): compiling must not need more than
/// that for any accepted input, so a deep structure that slipped past the parser's limits
/// shows as a failure here rather than as an abort on a user's machine.
fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap()
}

fn error_codes(source: &str, options: &Options) -> Vec<&'static str> {
    match compile(source, options) {
        Ok(_) => Vec::new(),
        Err(diags) => diags
            .iter()
            .filter(|d| d.is_error())
            .map(|d| d.code.as_str())
            .collect(),
    }
}

const HEADER: &str = "schedule h\nmicrobatches 1 of 1\nstream gpu: gpu.compute\n";

/// 41 templates, each calling the next twice, would expand 2^41 times: elaboration stops at
/// the expansion limit with one `elab::limit` error (it never finished before).
#[test]
fn exponential_template_expansion_stops_at_the_limit() {
    let mut source = HEADER.to_string();
    for i in 0..40 {
        source.push_str(&format!(
            "template t{i}() {{\n  t{}()\n  t{}()\n}}\n",
            i + 1,
            i + 1
        ));
    }
    source.push_str("template t40() { }\ndecode { t0() }\n");
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.limits.max_expansions = 10_000;
    let codes = on_small_stack(move || error_codes(&source, &options));
    assert_eq!(codes, ["elab::limit"]);
}

/// A loop of 10^18 iterations whose body has an error stops at the first iteration: one
/// error, not 20 million repeats of it (which took 53 s).
#[test]
fn a_loop_stops_at_the_first_error_in_its_body() {
    let source = format!("{HEADER}decode {{ for i in 0..1000000000000000000 {{ bogus(i) }} }}\n");
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    // Were the loop to go on, it would hit this limit and report `elab::limit` too.
    options.limits.max_iterations = 1_000;
    let codes = on_small_stack(move || error_codes(&source, &options));
    assert_eq!(codes, ["elab::unknown_name"]);
}

/// The flat `else if` takes the same branches, with the same guards on the same tasks, as
/// the nested `else { if .. }` it replaced: fiddler's dynamic `else if active(..)` compiled
/// both ways gives the same tasks.
#[test]
fn else_if_elaborates_as_the_nested_else_if() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schedules/fiddler.sched");
    let flat = std::fs::read_to_string(path).unwrap();
    let from = "    } else if active(l, e, j) {";
    assert!(flat.contains(from), "fiddler.sched no longer has {from:?}");
    let nested = flat
        .replace(from, "    } else { if active(l, e, j) {")
        .replace(
            "on cpu as on_cpu[l, j, e]\n      }\n    }",
            "on cpu as on_cpu[l, j, e]\n      }\n    } }",
        );
    assert_ne!(nested, flat);
    let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    let tasks = |source: &str| match compile(source, &options) {
        Ok(compiled) => format!("{:?}", compiled.program.tasks),
        Err(d) => panic!("{:?}", d.iter().map(|d| &d.message).collect::<Vec<_>>()),
    };
    let flat_tasks = tasks(&flat);
    assert!(
        flat_tasks.contains("negated: true"),
        "fiddler has a guarded else"
    );
    assert_eq!(flat_tasks, tasks(&nested));
}

/// Deep but accepted inputs (a 500-deep expression, 200 nested blocks, a 1000-branch
/// `else if`) compile on a 2 MiB stack.
#[test]
fn the_deepest_accepted_inputs_elaborate_on_a_small_stack() {
    let expr = format!("1{}", " + 1".repeat(499));
    let blocks = format!("{}{}", "if true { ".repeat(190), "}".repeat(190));
    let chain = format!(
        "if false {{ }}{} else {{ }}",
        " else if false { }".repeat(1000)
    );
    let source = format!("{HEADER}let x = {expr}\ndecode {{\n{blocks}\n{chain}\n}}\n");
    let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    let codes = on_small_stack(move || error_codes(&source, &options));
    // Parsed and elaborated; the checker then finds the step samples nothing.
    assert_eq!(codes, ["values::sampling"]);
}
