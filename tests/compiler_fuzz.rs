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
