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
//! - reading a buffer before it is written -> values::uninitialized at the reader.
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
        find: "post_attn(layer = j, ub = k, w = w_gpu[j % 2], a = a_g, h = h_g[g % 3]) on gpu",
        replace: "post_attn(layer = j, ub = k, w = w_gpu[(j + 1) % 2], a = a_g, h = h_g[g % 3]) on gpu",
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
