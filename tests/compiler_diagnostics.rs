//! Every diagnostic code has a negative fixture in `tests/fixtures/diag/<code>.sched`
//! (`::` written `_`); its rendered text (plain theme, width 100) is pinned by a snapshot.
//! Fixture headers may carry `// set: name=value` and `// limit-iterations: N`.

use moec::compile::{compile, Options};
use moec::diag::{render_all, Code};
use moec::model::card::ModelCard;
use std::path::Path;

fn options_for(source: &str) -> Options {
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    for line in source.lines().take_while(|l| l.starts_with("//")) {
        if let Some(set) = line.strip_prefix("// set: ") {
            let (k, v) = set.split_once('=').unwrap();
            options.sets.push((k.to_string(), v.to_string()));
        }
        if let Some(n) = line.strip_prefix("// limit-iterations: ") {
            options.limits.max_iterations = n.trim().parse().unwrap();
        }
    }
    options
}

/// Compiles a fixture and renders every diagnostic it produces (errors or warnings).
fn rendered(name: &str) -> (String, Vec<Code>) {
    let path = format!("tests/fixtures/diag/{name}.sched");
    let source = std::fs::read_to_string(&path).unwrap();
    let diags = match compile(&source, &options_for(&source)) {
        Ok(compiled) => compiled.warnings().to_vec(),
        Err(diags) => diags,
    };
    let codes = diags.iter().map(|d| d.code).collect();
    (render_all(&diags, &format!("{name}.sched"), &source), codes)
}

fn fixture_name(code: Code) -> String {
    code.as_str().replace("::", "_")
}

#[test]
fn every_code_has_a_fixture_that_produces_it() {
    for code in Code::ALL {
        let name = fixture_name(code);
        assert!(
            Path::new(&format!("tests/fixtures/diag/{name}.sched")).exists(),
            "no fixture for {}",
            code.as_str()
        );
        let (text, codes) = rendered(&name);
        assert!(
            codes.contains(&code),
            "{name}.sched does not produce {}:\n{text}",
            code.as_str()
        );
    }
}

#[test]
fn rendered_diagnostics_match_their_snapshots() {
    for code in Code::ALL {
        let name = fixture_name(code);
        let (text, _) = rendered(&name);
        insta::assert_snapshot!(name, text);
    }
}

#[test]
fn syntax_errors_give_line_and_column_in_user_terms() {
    let (text, _) = rendered("syntax_unexpected");
    assert!(text.contains("syntax_unexpected.sched:2:"), "{text}");
    assert!(text.contains("expected `:`"), "{text}");
    assert!(
        !text.contains("param_decl") && !text.contains("ident"),
        "pest rule names leak: {text}"
    );
}

#[test]
fn set_overrides_a_param_and_out_of_range_values_point_at_the_declaration() {
    let source = "schedule s\nparam n_ub: int in 1..=4 = 2\nmicrobatches n_ub of 1\nprefill { }\n";
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.sets.push(("n_ub".to_string(), "3".to_string()));
    // Elaboration only: a prefill that samples nothing is rejected by the checker.
    let ast = moec::compile::source_to_ast(source).unwrap();
    let (program, _) = moec::compile::ast_to_ir(&ast, &options).unwrap();
    assert_eq!(program.micro_batches.count, 3);
    options.sets[0].1 = "9".to_string();
    let diags = compile(source, &options).unwrap_err();
    assert_eq!(diags[0].code, Code::ElabParamValue);
    assert_eq!(diags[0].primary_span().unwrap().start, 11, "{:?}", diags[0]);
    options.sets[0].1 = "2.5".to_string();
    let diags = compile(source, &options).unwrap_err();
    assert!(diags[0].message.contains("is int"), "{}", diags[0].message);
}

/// A schedule reading its checkpoint from disk (`tests/fixtures/disk/layers.sched`) checks,
/// with `W` in the `disk` space; each mutation of it is rejected with the diagnostic the
/// snapshot pins: a slot read before the disk read that fills it is issued, a disk read
/// into the slot the current layer still reads, the wrong expert's slice read into a cache
/// slot (of `schedules/moe_infinity_disk.sched`),
/// a buffer declared on `disk`, and a disk read into GPU memory.
#[test]
fn disk_schedules_check_and_their_mutations_are_rejected() {
    let base = std::fs::read_to_string("tests/fixtures/disk/layers.sched").unwrap();
    let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    let compiled = compile(&base, &options).unwrap_or_else(|d| {
        panic!("{}", render_all(&d, "layers.sched", &base));
    });
    assert_eq!(compiled.program.buffers[0].space, moec::ir::Space::Disk);
    let mutations: [(&str, &str, &str); 4] = [
        (
            "disk_read_before_the_read",
            "  copy W[0] -> w[0] on io\n  for l in 0..layers {\n",
            "  for l in 0..layers {\n    if l == 1 { copy W[0] -> w[0] on io }\n",
        ),
        (
            "disk_read_into_a_slot_being_read",
            "copy W[l + 1] -> w[(l + 1) % 2] on io",
            "copy W[l + 1] -> w[l % 2] on io",
        ),
        (
            "disk_buffer",
            "buffer tok:        host = tokens(2)",
            "buffer tok:        disk = tokens(2)",
        ),
        (
            "disk_read_into_gpu",
            "copy W.head -> head on io",
            "copy W.head -> head on io\n  copy W.embed -> g on io",
        ),
    ];
    for (name, from, to) in mutations {
        assert!(base.contains(from), "{name}: the base has no `{from}`");
        let mut source = base.replacen(from, to, 1);
        if name == "disk_read_into_gpu" {
            source = source.replacen(
                "buffer tok:",
                "buffer g:          gpu = embed_weights()\nbuffer tok:",
                1,
            );
        }
        let diags = match compile(&source, &options) {
            Ok(_) => panic!("{name}: the mutation was accepted"),
            Err(diags) => diags,
        };
        let text = render_all(&diags, &format!("{name}.sched"), &source);
        insta::assert_snapshot!(name, text);
    }
    // The wrong expert's slice read from disk into an expert cache's slot.
    let cache = std::fs::read_to_string("schedules/moe_infinity_disk.sched").unwrap();
    let from = "fetch W[l].expert(e) -> rc.slot(l, e)";
    assert!(cache.contains(from));
    let source = cache.replacen(
        from,
        "fetch W[l].expert((e + 1) % experts) -> rc.slot(l, e)",
        1,
    );
    let mut options = options.clone();
    options.sets = vec![("bs".to_string(), "2".to_string())];
    let diags = match compile(&source, &options) {
        Ok(_) => panic!("the wrong expert's read was accepted"),
        Err(diags) => diags,
    };
    let text = render_all(&diags, "disk_read_of_the_wrong_expert.sched", &source);
    insta::assert_snapshot!("disk_read_of_the_wrong_expert", text);
}

/// A schedule that computes every expert from its q8_0 copy
/// (`tests/fixtures/formats/substitute.sched`, `substitute experts q8_0`) checks; the copy is
/// a host buffer `W.q8_0` of the format's bytes (mixtral-tiny: an expert's gate, up and down
/// are 128 x 256 weights each, q8_0 stores 32 weights in 34 bytes (ggml's `block_q8_0`: an
/// f16 scale and 32 int8), so 34,816 bytes a projection (a multiple of the 64-byte
/// alignment) and 104,448 an expert, for 4 layers x 8 experts; the checkpoint's bf16 expert
/// is 196,608). Each mutation is rejected with its span: the substitute used without its
/// declaration, the declaration of another format, a q8_0-sized buffer too small for the
/// copy, and q4_k, whose 256-weight blocks do not divide the tiny card's 128-wide rows.
#[test]
fn format_copies_are_sized_by_format_and_substitutes_must_be_declared() {
    let base = std::fs::read_to_string("tests/fixtures/formats/substitute.sched").unwrap();
    let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    let compiled = compile(&base, &options).unwrap_or_else(|d| {
        panic!("{}", render_all(&d, "substitute.sched", &base));
    });
    let program = &compiled.program;
    let copy = program
        .buffers
        .iter()
        .find(|b| b.name == "W.q8_0")
        .expect("the q8_0 copy of the experts");
    assert_eq!(copy.bytes, 4 * 8 * 104_448);
    assert_eq!(copy.space, moec::ir::Space::Host);
    let lo = program.buffers.iter().find(|b| b.name == "lo[0]").unwrap();
    assert_eq!(lo.bytes, 104_448);
    assert_eq!(program.substitutes.len(), 1);
    // Every expert computation (4 layers x 8 experts, prefill and decode) reads the copy.
    assert_eq!(compiled.info.substituted_experts(), (64, 64));
    let mutations: [(&str, &str, &str); 4] = [
        ("substitute_undeclared", "substitute experts q8_0\n", ""),
        (
            "substitute_of_another_format",
            "substitute experts q8_0\n",
            "substitute experts q4_0\n",
        ),
        (
            "format_buffer_too_small",
            "buffer lo[2]:      gpu = W[0].expert(0).format(q8_0)",
            "buffer lo[2]:      gpu = bytes(W[0].expert(0).format(q8_0)) / 2",
        ),
        (
            "format_the_card_cannot_take",
            "buffer lo[2]:      gpu = W[0].expert(0).format(q8_0)",
            "buffer lo[2]:      gpu = W[0].expert(0).format(q4_k)",
        ),
    ];
    for (name, from, to) in mutations {
        assert!(base.contains(from), "{name}: the base has no `{from}`");
        let source = base.replacen(from, to, 1);
        let diags = match compile(&source, &options) {
            Ok(_) => panic!("{name}: the mutation was accepted"),
            Err(diags) => diags,
        };
        let text = render_all(&diags, &format!("{name}.sched"), &source);
        insta::assert_snapshot!(name, text);
    }
}

/// The residency and routing-score guards (`tests/fixtures/guards/resident_score.sched`)
/// check, and their misuses are rejected at the construct that is wrong: a residency
/// guard a prefetch can change while its tasks decide it (`cache::stale_guard`, pinned
/// by a snapshot), a hit arm that reads the slot without fetching it, a predicted expert
/// in a residency guard, `!=` of a score, arithmetic on a score, a score compared with
/// a score, a residency arm overlapping a score arm (an expert computed twice), and a
/// score guard in `setup`.
#[test]
fn residency_and_score_guards_check_and_their_misuses_are_rejected_with_their_spans() {
    let base = std::fs::read_to_string("tests/fixtures/guards/resident_score.sched").unwrap();
    let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    for sets in [vec![], vec![("sum", "1"), ("bs", "2"), ("n_cache", "2")]] {
        let mut options = options.clone();
        options.sets = sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if let Err(d) = compile(&base, &options) {
            panic!("{}", render_all(&d, "resident_score.sched", &base));
        }
    }
    let cpu_arm = " on cpu after pf[l, sel - 1] if l >= 1 && l >= dense_layers";
    // (name, replaced, replacement, code, the source text the first error of that code
    // points at)
    let mutations: [(&str, &str, &str, Code, &str); 8] = [
        (
            "stale_residency",
            cpu_arm,
            " on cpu",
            Code::CacheStaleGuard,
            "experts(layer = l, ub = 0, set = e, w = W[l].expert(e), route = route_c, acc = acc_c) on cpu",
        ),
        (
            "hit_without_fetch",
            "        fetch W[l].expert(e) -> ec.slot(l, e) on h2d after gated[l]\n",
            "",
            Code::CacheUnfetched,
            "ec.slot(l, e)",
        ),
        (
            "predicted_residency",
            "if ec.resident(l, e) {",
            "if ec.resident(l, ec.predicted(l, 0)) {",
            Code::ElabDynamic,
            "ec.predicted(l, 0)",
        ),
        (
            "score_not_equal",
            "score_max(l, e, 0)) >= thr",
            "score_max(l, e, 0)) != thr",
            Code::ElabDynamic,
            "select(sum == 1, score_sum(l, e, 0), score_max(l, e, 0)) != thr",
        ),
        (
            "score_arithmetic",
            "score_max(l, e, 0)) >= thr",
            "score_max(l, e, 0)) + 1 >= thr",
            Code::ElabType,
            "select(sum == 1, score_sum(l, e, 0), score_max(l, e, 0))",
        ),
        (
            "score_against_score",
            "score_max(l, e, 0)) >= thr",
            "score_max(l, e, 0)) >= score_sum(l, e, 0)",
            Code::ElabDynamic,
            "score_sum(l, e, 0)",
        ),
        (
            // The hit arm is not exclusive with the score arm any more.
            "overlapping_arms",
            "      } else if select(sum == 1,",
            "      }\n      if !ec.resident(l, e) {} else if select(sum == 1,",
            Code::ValuesExpertCoverage,
            "combine(layer = l, ub = 0, route = route, acc = [acc, acc_cg], h = h) on gpu as combined[l]",
        ),
        (
            "score_in_setup",
            "  copy W.head -> head on h2d\n",
            "  if score_max(0, 0) >= 0.5 { copy W.head -> head on h2d }\n",
            Code::ElabDynamic,
            "copy W.head -> head on h2d",
        ),
    ];
    for (name, from, to, code, at) in mutations {
        assert!(base.contains(from), "{name}: the base has no `{from}`");
        let source = base.replacen(from, to, 1);
        let diags = match compile(&source, &options) {
            Ok(_) => panic!("{name}: the mutation was accepted"),
            Err(diags) => diags,
        };
        let text = render_all(&diags, &format!("{name}.sched"), &source);
        let found = diags.iter().find(|d| d.code == code).unwrap_or_else(|| {
            panic!("{name}: no {}:\n{text}", code.as_str());
        });
        let span = found.labels[0].span;
        let pointed = &source[span.start as usize..span.end as usize];
        assert_eq!(pointed, at, "{name}: the error points elsewhere:\n{text}");
        if name == "stale_residency" {
            // The errors only: the fixture's copy warnings are not the subject.
            let errors: Vec<_> = diags
                .iter()
                .filter(|d| d.severity == moec::diag::Severity::Error)
                .cloned()
                .collect();
            insta::assert_snapshot!(name, render_all(&errors, "stale_residency.sched", &source));
        }
    }
}

/// Issue 45: an eviction policy by a score the schedule computes (`evict score(l, e) =
/// EXPR`, on the residency fixture's cache). The expression folds, per (layer, expert), to
/// a constant plus a coefficient of each run-time quantity (worked by hand below from the
/// expression, with `l` and `e` bound); a score the runtime could not compute as a dot
/// product (a product of two quantities, a condition, another expert's or one
/// micro-batch's routing) is rejected at its source text.
#[test]
fn eviction_scores_fold_per_expert_and_their_misuses_are_rejected_with_their_spans() {
    let fixture = std::fs::read_to_string("tests/fixtures/guards/resident_score.sched").unwrap();
    let policy = "evict \"lru\"";
    assert!(fixture.contains(policy), "the fixture evicts by lru");
    let score = "2 * score_sum(l, e) + routed(l, e) / 4 - score_max(l, e) - 1.0 * l / layers + e";
    let base = fixture.replacen(policy, &format!("evict score(l, e) = {score}"), 1);
    let card = ModelCard::load("mixtral-tiny").unwrap();
    let options = Options::new(card.clone());
    let compiled = compile(&base, &options)
        .unwrap_or_else(|d| panic!("{}", render_all(&d, "score.sched", &base)));
    let cache = &compiled.program.caches[0];
    assert_eq!(cache.policy, moec::ir::cache::EvictPolicy::Score);
    let table = cache.score.as_ref().expect("the score's table");
    assert_eq!(table.terms.len() as u64, card.layers * card.experts);
    for (l, e) in [(0u32, 0u32), (1, 3), (card.layers as u32 - 1, 7)] {
        let terms = table.terms(l, e).expect("in range");
        // e - l / layers, and -1, 2, 1/4 times score_max, score_sum, routed.
        let constant = f64::from(e) - f64::from(l) / card.layers as f64;
        assert!(
            (terms.constant - constant).abs() < 1e-12,
            "({l}, {e}): constant {} against {constant}",
            terms.constant
        );
        assert_eq!(terms.per_quantity, [-1.0, 2.0, 0.25], "({l}, {e})");
    }
    // (name, replaced, replacement, code, the source text the first error points at)
    let mutations: [(&str, &str, &str, Code, &str); 5] = [
        (
            "score_as_a_name",
            &format!("score(l, e) = {score}"),
            "\"score\"",
            Code::ElabType,
            "\"score\"",
        ),
        (
            "score_product",
            "2 * score_sum(l, e)",
            "score_sum(l, e) * score_max(l, e)",
            Code::ElabDynamic,
            "score_sum(l, e) * score_max(l, e)",
        ),
        (
            "score_condition",
            "2 * score_sum(l, e)",
            "(score_sum(l, e) > 0.5)",
            Code::ElabDynamic,
            "(score_sum(l, e) > 0.5)",
        ),
        (
            "score_of_another_expert",
            "routed(l, e) / 4",
            "routed(l, 0) / 4",
            Code::ElabDynamic,
            "2 * score_sum(l, e) + routed(l, 0) / 4 - score_max(l, e) - 1.0 * l / layers + e",
        ),
        (
            "score_of_one_micro_batch",
            "score_max(l, e)",
            "score_max(l, e, 0)",
            Code::ElabDynamic,
            "2 * score_sum(l, e) + routed(l, e) / 4 - score_max(l, e, 0) - 1.0 * l / layers + e",
        ),
    ];
    for (name, from, to, code, at) in mutations {
        assert!(base.contains(from), "{name}: the base has no `{from}`");
        let source = base.replacen(from, to, 1);
        let diags = match compile(&source, &options) {
            Ok(_) => panic!("{name}: the mutation was accepted"),
            Err(diags) => diags,
        };
        let text = render_all(&diags, &format!("{name}.sched"), &source);
        let found = diags.iter().find(|d| d.code == code).unwrap_or_else(|| {
            panic!("{name}: no {}:\n{text}", code.as_str());
        });
        let span = found.labels[0].span;
        let pointed = &source[span.start as usize..span.end as usize];
        assert_eq!(pointed, at, "{name}: the error points elsewhere:\n{text}");
        if name == "score_product" {
            let errors: Vec<_> = diags
                .iter()
                .filter(|d| d.severity == moec::diag::Severity::Error)
                .cloned()
                .collect();
            insta::assert_snapshot!(name, render_all(&errors, "score_product.sched", &source));
        }
    }
}

/// Issue 45: `schedules/hobbit.sched` with its substitute on issues the important
/// experts' fetches (the ones that may change its cache) before every residency decision
/// of the layer, which `cache::stale_guard` requires. Fetching an important expert in its
/// own arm instead, after the less important experts before it decided their residency,
/// is rejected: that fetch could evict an expert whose hit arm decided already while its
/// miss arm has not (both would run).
#[test]
fn hobbit_fetches_before_its_residency_decisions_and_a_late_fetch_is_a_stale_guard() {
    let base = std::fs::read_to_string("schedules/hobbit.sched").unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.sets = vec![("lowbit".into(), "1".into())];
    if let Err(d) = compile(&base, &options) {
        panic!("{}", render_all(&d, "hobbit.sched", &base));
    }
    let from = "        if score_max(l, e, 0) >= thr {\n          experts(";
    assert!(base.contains(from), "hobbit.sched's important arm");
    let source = base.replacen(
        from,
        "        if score_max(l, e, 0) >= thr {\n          fetch_hi(l, e, false)\n          experts(",
        1,
    );
    let diags = match compile(&source, &options) {
        Ok(_) => panic!("a fetch after the residency decisions was accepted"),
        Err(diags) => diags,
    };
    let text = render_all(&diags, "late_fetch.sched", &source);
    let found = diags
        .iter()
        .find(|d| d.code == Code::CacheStaleGuard)
        .unwrap_or_else(|| panic!("no cache::stale_guard:\n{text}"));
    let span = found.labels[0].span;
    let pointed = &source[span.start as usize..span.end as usize];
    println!("{text}\npointed at: {pointed}");
    assert!(
        pointed.starts_with("experts(layer = l, ub = 0, set = e, w = ")
            || pointed.starts_with("fetch ")
            || pointed.starts_with("copy W[l].expert(e).format(q8_0)"),
        "the error points at a task the residency guard decides: {pointed}\n{text}"
    );
    let errors: Vec<_> = diags
        .iter()
        .filter(|d| d.severity == moec::diag::Severity::Error)
        .cloned()
        .collect();
    insta::assert_snapshot!(
        "hobbit_late_fetch",
        render_all(&errors, "late_fetch.sched", &source)
    );
}
