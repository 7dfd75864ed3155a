//! Mutating a correct schedule breaks it visibly (issue 3 acceptance): one text edit per
//! case, each must be rejected with the expected diagnostic code, with the primary label on
//! the source line that is at fault. The rendered diagnostics are snapshotted.
//!
//! Cases, per acceptance point:
//! - reading `w_gpu[(i + 1) % 2]` instead of `w_gpu[i % 2]` (the other slot of the double
//!   buffer: the previous or the next layer) -> values::wrong at the reading op;
//! - dropping one page / packet copy of the next layer's weights -> values::wrong at the
//!   op that reads the incomplete layer;
//! - a CPU op on a GPU stream -> structure::engine_space at that op;
//! - reading a buffer before it is written -> values::uninitialized at the reader;
//! - a lookahead prefetch not ordered after its `pregate` -> cache::unpredicted at the
//!   prefetch (issue 45).
//!
//! The mutants compile on the tiny card with all 4 of its layers: with 2 layers both
//! weight slots only ever hold their own layer, so a dropped page copy leaves the right
//! bytes in place and the checker (rightly) accepts it.

mod schedules_common;
use schedules_common as common;

use moec::diag::{self, Code, Diagnostic};

struct Mutation {
    /// Snapshot name.
    name: &'static str,
    /// Schedule under `schedules/`, without `.sched`.
    schedule: &'static str,
    /// Text that must occur exactly once in the schedule.
    find: &'static str,
    /// What replaces it.
    replace: &'static str,
    /// The diagnostic code expected among the errors.
    code: Code,
    /// A fragment of the source line the primary label of that diagnostic must sit on.
    line_has: &'static str,
}

const MUTATIONS: &[Mutation] = &[
    Mutation {
        name: "cgopipe_other_weight_slot",
        schedule: "cgopipe",
        find: "post_attn(layer = l, ub = j, w = [w_dense[l], w_gpu[l % 2]], a = a, h = h) on gpu",
        replace: "post_attn(layer = l, ub = j, w = [w_dense[l], w_gpu[(l + 1) % 2]], a = a, h = h) on gpu",
        code: Code::ValuesWrong,
        line_has: "w_gpu[(l + 1) % 2]",
    },
    Mutation {
        name: "flexgen_other_weight_slot",
        schedule: "flexgen",
        find: "post_attn(layer = j, ub = k, w = w_gpu[j % 2], a = a, h = h) on gpu",
        replace: "post_attn(layer = j, ub = k, w = w_gpu[(j + 1) % 2], a = a, h = h) on gpu",
        code: Code::ValuesWrong,
        line_has: "w_gpu[(j + 1) % 2]",
    },
    Mutation {
        name: "vslpipe_other_weight_slot",
        schedule: "vslpipe",
        find: "post_attn(layer = l, ub = x, w = wb[l % 2].post,",
        replace: "post_attn(layer = l, ub = x, w = wb[(l + 1) % 2].post,",
        code: Code::ValuesWrong,
        line_has: "wb[(l + 1) % 2]",
    },
    Mutation {
        name: "cgopipe_drop_one_page",
        schedule: "cgopipe",
        find: "if i + 1 < layers || wrap { pin_to_g((i + 1) % layers, j) }   // W_PinToG(i + 1, j)",
        replace: "if (i + 1 < layers || wrap) && j != 1 { pin_to_g((i + 1) % layers, j) }",
        code: Code::ValuesWrong,
        line_has: "post_attn(layer = l, ub = j, w = [w_dense[l], w_gpu[l % 2]]",
    },
    Mutation {
        name: "vslpipe_drop_one_packet",
        schedule: "vslpipe",
        find: "      copy w_home[x + 1].post.page(p, n_pkt) -> wb[(x + 1) % 2].post.page(p, n_pkt) on mover",
        replace: "      if p != 1 { copy w_home[x + 1].post.page(p, n_pkt) -> wb[(x + 1) % 2].post.page(p, n_pkt) on mover }",
        code: Code::ValuesWrong,
        line_has: "post_attn(layer = l, ub = x",
    },
    Mutation {
        name: "cgopipe_cpu_attention_on_gpu_stream",
        schedule: "cgopipe",
        find: "kv = kv[l][j], out = a_c[j]) on cpu",
        replace: "kv = kv[l][j], out = a_c[j]) on gpu",
        code: Code::StructEngineSpace,
        line_has: "out = a_c[j]) on gpu",
    },
    Mutation {
        name: "vslpipe_cpu_task_on_gpu_stream",
        schedule: "vslpipe",
        find: "kv = kv[l][x], out = ad_c[x]) on cpu",
        replace: "kv = kv[l][x], out = ad_c[x]) on gpu",
        code: Code::StructEngineSpace,
        line_has: "out = ad_c[x]) on gpu",
    },
    Mutation {
        name: "cgopipe_read_before_write",
        schedule: "cgopipe",
        find: "  copy qkv_g[j] -> qkv_c[j] on d2h\n",
        replace: "",
        code: Code::ValuesUninitialized,
        line_has: "qkv = qkv_c[j]",
    },
    Mutation {
        name: "klotski_read_before_write",
        schedule: "klotski",
        find: "  copy w_home[(l + 1) % layers].attn -> w_dense[(l + 1) % 2].attn on w_load\n",
        replace: "",
        code: Code::ValuesUninitialized,
        line_has: "pre_attn(layer = l, ub = k, w = w_dense[s].pre",
    },
    // Issue 11: the holes a skeptical user found (each used to be accepted and ran wrong).
    Mutation {
        name: "cgopipe_decode_skips_layers",
        schedule: "cgopipe",
        find: "  for i in 0..layers {\n    for j in 0..n_ub {\n      copy a_c[j] -> a_g[j] on h2d",
        replace: "  for i in 4..layers {\n    for j in 0..n_ub {\n      copy a_c[j] -> a_g[j] on h2d",
        code: Code::ValuesSampling,
        line_has: "",
    },
    Mutation {
        name: "vslpipe_last_layer_test_never_true",
        schedule: "vslpipe",
        find: "  if l == layers - 1 {\n    lm_head",
        replace: "  if l == layers - 7 {\n    lm_head",
        code: Code::ValuesSampling,
        line_has: "",
    },
    Mutation {
        name: "sequential_no_decode_body",
        schedule: "baselines/sequential",
        find: "decode {\n  forward(decode, 1)\n}",
        replace: "decode {\n}",
        code: Code::ValuesSampling,
        line_has: "sample(ub = j",
    },
    Mutation {
        name: "flexgen_cpu_attn_no_decode_body",
        schedule: "baselines/flexgen_cpu_attn",
        find: "  zigzag(decode, 1)\n",
        replace: "",
        code: Code::ValuesSampling,
        line_has: "sample(ub = k",
    },
    Mutation {
        name: "sequential_stale_embedding",
        schedule: "baselines/sequential",
        find: "      embed(ub = j, w = W.embed, tokens = tok_c[j], h = e_c[j]) on cpu\n",
        replace: "",
        code: Code::ValuesStale,
        line_has: "",
    },
    Mutation {
        name: "klotski_negated_expert_guard",
        schedule: "klotski",
        find: "    if active(l, hot(l, r)) {\n      experts(layer = l, ub = all",
        replace: "    if !active(l, hot(l, r)) {\n      experts(layer = l, ub = all",
        code: Code::ValuesExpertGuard,
        line_has: "experts(layer = l, ub = all, set = hot(l, r)",
    },
    // The group's per-batch guard is implicit (`ub = all` adds `active(l, e, k)` to batch
    // k's part); narrowing the group's own guard to one batch loses the others' tokens.
    Mutation {
        name: "klotski_negated_ub_guard",
        schedule: "klotski",
        find: "    if active(l, hot(l, r)) {\n      experts(layer = l, ub = all",
        replace: "    if !active(l, hot(l, r), 0) {\n      experts(layer = l, ub = all",
        code: Code::ValuesExpertGuard,
        line_has: "experts(layer = l, ub = all, set = hot(l, r)",
    },
    // A store of the positions cached BEFORE the step (`.context()`) where the appended
    // ones belong leaves the home without this token's line: the next step's load finds
    // the cache of the run before.
    Mutation {
        name: "flexgen_store_context_not_appended",
        schedule: "flexgen",
        find: "copy kv_g[g % 3].appended() -> kv[g / n_batch][g % n_batch] on kv_store",
        replace: "copy kv_g[g % 3].context() -> kv[g / n_batch][g % n_batch] on kv_store",
        code: Code::ValuesStale,
        line_has: "kv[g / n_batch][g % n_batch].context() -> kv_g[g % 3]",
    },
    // Loading only the appended positions of a home nobody updated this step.
    Mutation {
        name: "flexgen_load_appended_not_context",
        schedule: "flexgen",
        find: "copy kv[g / n_batch][g % n_batch].context() -> kv_g[g % 3] on kv_load",
        replace: "copy kv[g / n_batch][g % n_batch].appended() -> kv_g[g % 3] on kv_load",
        code: Code::ValuesStale,
        line_has: "kv[g / n_batch][g % n_batch].appended() -> kv_g[g % 3]",
    },
    // Storing into the home of another batch: the prefill's store (all new positions)
    // labels that home with this batch's cache, so the next decode step's attention finds
    // another batch's cache loaded for it.
    Mutation {
        name: "klotski_append_to_another_home",
        schedule: "klotski",
        find: "copy kv_g[(l * n_batch + k) % 3].appended() -> kv[l][k] on kv_store",
        replace: "copy kv_g[(l * n_batch + k) % 3].appended() -> kv[l][(k + 1) % n_batch] on kv_store",
        code: Code::ValuesWrong,
        line_has: "attn(layer = l, ub = k, part = part",
    },
    // Issue 28: an activation copy moves only the rows of its source micro-batch's tokens
    // (`check::live`), so bringing another micro-batch's CPU results back would leave the
    // reader's extra rows uncopied; the checker rejects the reader, as it always did.
    Mutation {
        name: "fiddler_cpu_results_of_another_micro_batch",
        schedule: "fiddler",
        find: "copy acc_c[j] -> acc_cg[j] on h2d",
        replace: "copy acc_c[(j + 1) % n_ub] -> acc_cg[j] on h2d",
        code: Code::ValuesWrong,
        line_has: "combine(layer = l, ub = j",
    },
    // Issue 45: a lookahead prefetch no longer waits for the pregate whose routing it ranks
    // by (nor for the fetch that followed it): the prediction would be read before it is
    // read back.
    Mutation {
        name: "pregated_prefetch_before_its_pregate",
        schedule: "pregated",
        find: "prefetch w_home[l + 1].expert(p) -> ec.slot(l + 1, p) on pf after pregated[l + 1], fetched[l, experts - 1] if l >= dense_layers",
        replace: "prefetch w_home[l + 1].expert(p) -> ec.slot(l + 1, p) on pf",
        code: Code::CacheUnpredicted,
        line_has: "prefetch w_home[l + 1].expert(p) -> ec.slot(l + 1, p) on pf",
    },
];

/// The source line holding byte `at`.
fn line_at(source: &str, at: usize) -> &str {
    let at = at.min(source.len());
    let start = source[..at].rfind('\n').map_or(0, |i| i + 1);
    let end = source[at..].find('\n').map_or(source.len(), |i| at + i);
    &source[start..end]
}

/// The first three errors rendered, and how many more there are (snapshots stay short).
fn rendered(errors: &[&Diagnostic], name: &str, source: &str) -> String {
    let shown: Vec<Diagnostic> = errors.iter().take(3).map(|d| (*d).clone()).collect();
    let mut text = diag::render_all(&shown, name, source);
    if errors.len() > shown.len() {
        text.push_str(&format!(
            "... and {} more error(s)\n",
            errors.len() - shown.len()
        ));
    }
    text
}

#[test]
fn unmutated_schedules_compile() {
    for schedule in ["cgopipe", "flexgen", "vslpipe", "klotski"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("schedules/{schedule}.sched"));
        let source = common::read(&path);
        if let Err(diags) = common::compile_small_layers(&source, 4) {
            panic!(
                "{schedule} must compile before mutation:\n{}",
                diag::render_all(&diags, schedule, &source)
            );
        }
    }
}

#[test]
fn each_mutation_is_rejected_at_the_right_line() {
    for m in MUTATIONS {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("schedules/{}.sched", m.schedule));
        let original = common::read(&path);
        assert_eq!(
            original.matches(m.find).count(),
            1,
            "{}: `{}` must occur exactly once",
            m.name,
            m.find
        );
        let source = original.replacen(m.find, m.replace, 1);
        let file_name = format!("{}.sched", m.schedule);
        let diags = match common::compile_small_layers(&source, 4) {
            Ok(_) => panic!("{}: the mutated schedule was accepted", m.name),
            Err(diags) => diags,
        };
        let errors: Vec<&Diagnostic> = diags.iter().filter(|d| d.is_error()).collect();
        let hit = errors.iter().find(|d| d.code == m.code).unwrap_or_else(|| {
            panic!(
                "{}: no {:?} among:\n{}",
                m.name,
                m.code,
                diag::render_all(&diags, &file_name, &source)
            )
        });
        let primary = hit
            .labels
            .first()
            .unwrap_or_else(|| panic!("{}: diagnostic without a label", m.name));
        let line = line_at(&source, primary.span.start as usize);
        assert!(
            line.contains(m.line_has),
            "{}: primary label on `{}`, expected the line with `{}`:\n{}",
            m.name,
            line.trim(),
            m.line_has,
            diag::render(hit, &file_name, &source)
        );
        insta::assert_snapshot!(
            format!("mutation_{}", m.name),
            rendered(&errors, &file_name, &source)
        );
    }
}

// ---- soundness: every accepted mutant runs with the oracle's tokens -------------------

/// A tiny deterministic generator (splitmix64): the same mutants on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        (!items.is_empty()).then(|| &items[self.below(items.len())])
    }
}

/// The kinds of edit a mutant makes (one per mutant).
const KINDS: &[&str] = &[
    "delete",
    "duplicate",
    "swap",
    "number",
    "loop",
    "index",
    "negate",
    "stream",
    "after",
    "compare",
];

/// Byte ranges of the integer literals of a line (not parts of names).
fn numbers(line: &str) -> Vec<(usize, usize)> {
    let bytes = line.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = bytes[i].is_ascii_digit()
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts {
            let mut j = i;
            while j < bytes.len() && (bytes[j].is_ascii_digit() || bytes[j] == b'_') {
                j += 1;
            }
            if j >= bytes.len() || bytes[j] != b'.' || bytes.get(j + 1) == Some(&b'.') {
                out.push((i, j));
            }
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// The code part of a line (before a `//` comment).
fn code_of(line: &str) -> &str {
    line.find("//").map_or(line, |i| &line[..i])
}

/// One mutant of `source`: (description, text), or `None` when the drawn edit does not
/// apply to the drawn line.
fn mutate(source: &str, rng: &mut Rng) -> Option<(String, String)> {
    let lines: Vec<&str> = source.lines().collect();
    let code_lines: Vec<usize> = (0..lines.len())
        .filter(|&i| {
            let code = code_of(lines[i]).trim();
            !code.is_empty() && !code.starts_with("schedule")
        })
        .collect();
    let streams: Vec<String> = lines
        .iter()
        .filter_map(|l| l.trim().strip_prefix("stream "))
        .filter_map(|rest| rest.split(':').next())
        .map(|name| name.trim().to_string())
        .collect();
    let kind = *rng.pick(KINDS)?;
    let at = *rng.pick(&code_lines)?;
    let line = lines[at];
    let code = code_of(line);
    let comment = &line[code.len()..];
    let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let new_line: String = match kind {
        "delete" => {
            out.remove(at);
            return Some((
                format!("line {}: delete `{}`", at + 1, code.trim()),
                out.join("\n"),
            ));
        }
        "duplicate" => {
            out.insert(at, line.to_string());
            return Some((
                format!("line {}: duplicate `{}`", at + 1, code.trim()),
                out.join("\n"),
            ));
        }
        "swap" => {
            let next = code_lines.iter().find(|&&i| i > at)?;
            out.swap(at, *next);
            return Some((
                format!("lines {} and {}: swap", at + 1, next + 1),
                out.join("\n"),
            ));
        }
        "number" => {
            let &(lo, hi) = rng.pick(&numbers(code))?;
            let value: i64 = code[lo..hi].replace('_', "").parse().ok()?;
            let new = match rng.below(3) {
                0 => value + 1,
                1 => (value - 1).max(0),
                _ => [0, 1, 2][rng.below(3)],
            };
            if new == value {
                return None;
            }
            format!("{}{new}{}", &code[..lo], &code[hi..])
        }
        "loop" => {
            let start = code.find("for ")?;
            let dots = start + code[start..].find("..")?;
            let open = dots + code[dots..].find('{')?;
            let in_at = start + code[start..].find(" in ")? + 4;
            match rng.below(3) {
                0 => format!("{}1 + {}", &code[..in_at], &code[in_at..]),
                1 => format!("{} - 1 {}", code[..open].trim_end(), &code[open..]),
                _ => format!("{} + 1 {}", code[..open].trim_end(), &code[open..]),
            }
        }
        "index" => {
            let opens: Vec<usize> = code.match_indices('[').map(|(i, _)| i).collect();
            let &open = rng.pick(&opens)?;
            let close = open + code[open..].find(']')?;
            let inner = &code[open + 1..close];
            if inner.is_empty() || inner.contains('[') {
                return None;
            }
            let new = match rng.below(3) {
                0 => format!("({inner} + 1)"),
                1 => format!("({inner} - 1)"),
                _ => "0".to_string(),
            };
            format!("{}{new}{}", &code[..=open], &code[close..])
        }
        "negate" => {
            let at_if = code.find("if ")?;
            if let Some(rest) = code[at_if + 3..].strip_prefix('!') {
                format!("{}if {rest}", &code[..at_if])
            } else {
                let open = at_if + code[at_if..].find('{')?;
                let cond = code[at_if + 3..open].trim_end();
                format!("{}if !({cond}) {}", &code[..at_if], &code[open..])
            }
        }
        "stream" => {
            let on = code.rfind(" on ")?;
            let name_end = code[on + 4..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .map_or(code.len(), |i| on + 4 + i);
            let other = rng.pick(&streams)?;
            if *other == code[on + 4..name_end] {
                return None;
            }
            format!("{} on {other}{}", &code[..on], &code[name_end..])
        }
        "after" => {
            let after = code.find(" after ")?;
            let end = code[after..].find('}').map_or(code.len(), |i| after + i);
            format!("{} {}", &code[..after], &code[end..])
        }
        _ => {
            let ops = ["==", "!=", "<=", ">=", " < ", " > "];
            let found: Vec<(usize, &str)> = ops
                .iter()
                .flat_map(|op| {
                    code.match_indices(op)
                        .map(|(i, _)| (i, *op))
                        .collect::<Vec<_>>()
                })
                .collect();
            let &(i, op) = rng.pick(&found)?;
            let new = match op {
                "==" => "!=",
                "!=" => "==",
                "<=" => "<",
                ">=" => ">",
                " < " => " <= ",
                _ => " >= ",
            };
            format!("{}{new}{}", &code[..i], &code[i + op.len()..])
        }
    };
    if new_line == code {
        return None;
    }
    out[at] = format!("{new_line}{comment}");
    Some((
        format!(
            "line {}: {kind}: `{}` -> `{}`",
            at + 1,
            code.trim(),
            new_line.trim()
        ),
        out.join("\n"),
    ))
}

/// The configuration the mutants are compiled and run in: the tiny Mixtral card with all
/// 4 layers, 3 prompts of 3-6 tokens, 3 new tokens each, micro-batches of one sequence
/// and two of them per batch (so the runtime runs two batches: the second prefill starts
/// from what the first batch's last decode left).
fn mutant_options(source: &str, card: &moec::model::card::ModelCard) -> moec::compile::Options {
    let declared = common::declared_params(source);
    let mut options = moec::compile::Options::new(card.clone());
    options.workload = moec::ir::Workload {
        batch: 3,
        prompt_len: 6,
        gen_len: 3,
    };
    for (name, value) in [
        ("ubs", "1"),
        ("n_ub", "2"),
        ("bs", "1"),
        ("n_batch", "2"),
        ("seqs", "1"),
        // Fiddler: 12 of the 32 experts resident and a threshold the prompts straddle,
        // so mutants hit all three arms.
        ("n_gpu", "12"),
        ("t_copy", "3"),
    ] {
        if declared.iter().any(|d| d == name) {
            options.sets.push((name.to_string(), value.to_string()));
        }
    }
    options
}

/// `MOEC_MUTANTS=N` asks for N mutants (default 120: about a minute on 2 cores).
fn mutant_count() -> usize {
    std::env::var("MOEC_MUTANTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120)
}

#[test]
fn every_accepted_mutant_runs_with_the_oracle_tokens() {
    let card = common::card_with_layers("mixtral-tiny", 4);
    let dir = tempfile::tempdir().expect("temporary directory");
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts: Vec<Vec<u32>> = [5usize, 3, 6]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|t| ((i * 131 + t * 17 + 1) as u64 % card.vocab) as u32)
                .collect()
        })
        .collect();
    let expected = common::oracle_tokens(&checkpoint, &prompts, 3);
    let schedules = common::schedule_files();
    // The originals first: the configuration itself must run correctly, also with an odd
    // layer count (the next token's layer 0 cannot be prefetched into slot 0; the second
    // batch's prefill must load it itself).
    let odd_card = common::card_with_layers("mixtral-tiny", 3);
    let odd_checkpoint = common::tiny_checkpoint(&odd_card, dir.path());
    let odd_expected = common::oracle_tokens(&odd_checkpoint, &prompts, 3);
    let mut sources = Vec::new();
    for (name, path) in &schedules {
        let source = common::read(path);
        for (card, checkpoint, expected) in [
            (&card, &checkpoint, &expected),
            (&odd_card, &odd_checkpoint, &odd_expected),
        ] {
            let compiled = moec::compile::compile(&source, &mutant_options(&source, card))
                .unwrap_or_else(|d| panic!("{name} does not compile: {}", d[0]));
            if let Err(e) = common::run_against_oracle(&compiled, checkpoint, &prompts, expected) {
                panic!("{name} (unmutated, {} layers): {e}", card.layers);
            }
        }
        sources.push((name.clone(), source));
    }
    let wanted = mutant_count();
    let mut rng = Rng(0x6d6f_6563_2d31_3121);
    let mut seen = std::collections::HashSet::new();
    let (mut made, mut accepted, mut correct) = (0usize, 0usize, 0usize);
    let mut failures = Vec::new();
    let mut attempts = 0;
    while made < wanted && attempts < wanted * 50 {
        attempts += 1;
        let (name, source) = &sources[rng.below(sources.len())];
        let Some((what, text)) = mutate(source, &mut rng) else {
            continue;
        };
        if text == *source || !seen.insert(text.clone()) {
            continue;
        }
        made += 1;
        let Ok(compiled) = moec::compile::compile(&text, &mutant_options(&text, &card)) else {
            continue;
        };
        accepted += 1;
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            common::run_against_oracle(&compiled, &checkpoint, &prompts, &expected)
        }));
        match run {
            Ok(Ok(())) => correct += 1,
            Ok(Err(e)) => failures.push(format!("{name}: {what}\n  {e}")),
            Err(_) => failures.push(format!("{name}: {what}\n  the run panicked")),
        }
    }
    println!(
        "mutants: {made} made, {accepted} accepted by check, {correct} of those ran with the oracle's tokens"
    );
    assert!(
        failures.is_empty(),
        "{} accepted mutant(s) ran wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
