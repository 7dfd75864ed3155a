//! No input makes the compiler panic: truncated, line-shuffled and token-shuffled versions
//! of every schedule in `schedules/`, and random bytes, each compile to a program or to
//! diagnostics (rendered too, since rendering slices the source by spans), never a panic.
//! Seeded, so a failure names an input that reproduces.

mod schedules_common;
use schedules_common as common;

use std::panic::{catch_unwind, AssertUnwindSafe};

/// A small deterministic generator (xorshift64*), enough to shuffle and make noise.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// Compiles `source` (and renders its diagnostics) inside `catch_unwind`; on a panic,
/// returns a description of the input.
fn survives(what: &str, source: &str) -> Result<(), String> {
    let outcome = catch_unwind(AssertUnwindSafe(|| match common::compile_small(source) {
        Ok(compiled) => {
            let _ = moec::ir::emit::to_text(&compiled.program, &compiled.info.dag);
            let _ = moec::diag::render_all(compiled.warnings(), "fuzz.sched", source);
        }
        Err(diags) => {
            let _ = moec::diag::render_all(&diags, "fuzz.sched", source);
        }
    }));
    outcome.map_err(|_| format!("{what} panicked; input:\n{source}"))
}

/// Cut points every `stride` bytes, moved back to a char boundary.
fn prefixes(source: &str, count: usize) -> Vec<&str> {
    let stride = (source.len() / count).max(1);
    (0..=source.len())
        .step_by(stride)
        .map(|mut cut| {
            while !source.is_char_boundary(cut) {
                cut -= 1;
            }
            &source[..cut]
        })
        .collect()
}

fn run_all(inputs: Vec<(String, String)>) {
    let mut panics = Vec::new();
    for (what, source) in &inputs {
        if let Err(report) = survives(what, source) {
            panics.push(report);
        }
    }
    assert!(
        panics.is_empty(),
        "{} of {} inputs panicked:\n{}",
        panics.len(),
        inputs.len(),
        panics.join("\n---\n")
    );
}

#[test]
fn truncated_schedules_never_panic() {
    let mut inputs = Vec::new();
    for (name, path) in common::schedule_files() {
        let source = common::read(&path);
        for prefix in prefixes(&source, 150) {
            inputs.push((
                format!("{name} cut at byte {}", prefix.len()),
                prefix.to_string(),
            ));
        }
    }
    run_all(inputs);
}

#[test]
fn line_shuffled_schedules_never_panic() {
    let mut inputs = Vec::new();
    for (name, path) in common::schedule_files() {
        let source = common::read(&path);
        for seed in 1..=12u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut lines: Vec<&str> = source.lines().collect();
            // Swap a few lines (mostly still parses, so elaboration and checks get fuzzed
            // too), and fully shuffle every fourth input.
            if seed % 4 == 0 {
                rng.shuffle(&mut lines);
            } else {
                for _ in 0..seed {
                    let (a, b) = (rng.below(lines.len()), rng.below(lines.len()));
                    lines.swap(a, b);
                }
            }
            inputs.push((format!("{name} lines, seed {seed}"), lines.join("\n")));
        }
    }
    run_all(inputs);
}

#[test]
fn token_shuffled_schedules_never_panic() {
    let mut inputs = Vec::new();
    for (name, path) in common::schedule_files() {
        let source = common::read(&path);
        let tokens: Vec<&str> = source.split_whitespace().collect();
        for seed in 1..=12u64 {
            let mut rng = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03));
            let mut shuffled = tokens.clone();
            // Swap a few tokens (keeps most structure), or drop / duplicate one.
            match seed % 3 {
                0 => {
                    let at = rng.below(shuffled.len());
                    shuffled.remove(at);
                }
                1 => {
                    let at = rng.below(shuffled.len());
                    let token = shuffled[at];
                    shuffled.insert(rng.below(shuffled.len()), token);
                }
                _ => {
                    for _ in 0..3 {
                        let (a, b) = (rng.below(shuffled.len()), rng.below(shuffled.len()));
                        shuffled.swap(a, b);
                    }
                }
            }
            inputs.push((format!("{name} tokens, seed {seed}"), shuffled.join(" ")));
        }
    }
    run_all(inputs);
}

#[test]
fn random_bytes_never_panic() {
    let mut rng = Rng(0x005E_ED0F_F022);
    let alphabet: Vec<char> = "schedule param stream buffer for in if else copy on as after let template \
        prefill decode step setup { } ( ) [ ] . , : = -> + - * / % < > ! & | 0 1 2 9 99999999999999999999 \
        1e308 -1 W gpu pinned host layers experts hot active page \" // \n \t é ∞ \0"
        .chars()
        .collect();
    let mut inputs = Vec::new();
    for case in 0..200 {
        let len = rng.below(400);
        let text: String = if case % 2 == 0 {
            // Raw bytes, made valid UTF-8 the way a file reader with lossy decoding would.
            let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect()
        };
        inputs.push((format!("random input {case}"), text));
    }
    // A valid header followed by noise reaches past the parser's first rule.
    for case in 0..50 {
        let len = rng.below(300);
        let noise: String = (0..len)
            .map(|_| alphabet[rng.below(alphabet.len())])
            .collect();
        inputs.push((
            format!("header + noise {case}"),
            format!("schedule fuzz\n{noise}"),
        ));
    }
    run_all(inputs);
}
