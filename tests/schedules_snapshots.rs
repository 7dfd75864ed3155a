//! Every schedule in `schedules/` compiled on the small configuration (tiny Mixtral card
//! cut to 2 layers, 3 micro-batches of 2 sequences) as canonical text and as Graphviz dot,
//! pinned with insta. A changed DAG fails the suite until its snapshot is reviewed. Also:
//! every schedule passes `check` with its default params on every built-in card.

mod schedules_common;
use schedules_common as common;

use moec::compile::{compile, Options};
use moec::diag;
use moec::ir::emit;

/// Compiles `name` on the small configuration or fails with the rendered diagnostics.
fn compiled_small(name: &str, path: &std::path::Path) -> (moec::compile::Compiled, String) {
    let source = common::read(path);
    match common::compile_small(&source) {
        Ok(compiled) => (compiled, source),
        Err(diags) => panic!(
            "{name} does not compile:\n{}",
            diag::render_all(&diags, name, &source)
        ),
    }
}

#[test]
fn every_schedule_as_text() {
    for (name, path) in common::schedule_files() {
        let (compiled, source) = compiled_small(&name, &path);
        let mut text = String::new();
        let warnings = compiled.warnings();
        if warnings.is_empty() {
            text.push_str("// warnings: none\n");
        } else {
            text.push_str(&diag::render_all(warnings, &name, &source));
        }
        text.push_str(&emit::to_text(&compiled.program, &compiled.info.dag));
        insta::assert_snapshot!(format!("{}_text", name.replace('/', "__")), text);
    }
}

#[test]
fn every_schedule_as_dot() {
    for (name, path) in common::schedule_files() {
        let (compiled, _) = compiled_small(&name, &path);
        let dot = emit::to_dot(&compiled.program, &compiled.info.dag);
        insta::assert_snapshot!(format!("{}_dot", name.replace('/', "__")), dot);
    }
}

/// `schedules/hobbit.sched` with its substitute on (`lowbit = 1`), whose decode the
/// default-param snapshot does not show: per layer, the important experts' bf16 fetches
/// first, then per active expert the three arms (important from the cache, hit from the
/// cache through a self-hit fetch, q8_0 copy through `lo`), each under its guard.
#[test]
fn hobbit_with_its_substitute_as_text() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/hobbit.sched");
    let source = common::read(&path);
    let from = "param lowbit:  int in 0..=1        = 0";
    assert!(source.contains(from), "hobbit.sched declares lowbit");
    let source = source.replacen(from, "param lowbit:  int in 0..=1        = 1", 1);
    let compiled = common::compile_small(&source)
        .unwrap_or_else(|d| panic!("{}", diag::render_all(&d, "hobbit", &source)));
    let mut text = String::new();
    let warnings = compiled.warnings();
    if warnings.is_empty() {
        text.push_str("// warnings: none\n");
    } else {
        text.push_str(&diag::render_all(warnings, "hobbit", &source));
    }
    text.push_str(&emit::to_text(&compiled.program, &compiled.info.dag));
    insta::assert_snapshot!("hobbit_lowbit_text", text);
}

/// Acceptance: `moec check` passes on every schedule for every built-in card, with the
/// schedule's default params and the default workload.
#[test]
fn every_schedule_checks_on_every_card() {
    let cards = [
        "mixtral-tiny",
        "dbrx-tiny",
        "mixtral-mid",
        "dbrx-mid",
        "mixtral-8x7b",
        "mixtral-8x22b",
        "dbrx",
    ];
    let mut failures = Vec::new();
    for (name, path) in common::schedule_files() {
        let source = common::read(&path);
        for card_name in cards {
            let card = moec::model::card::ModelCard::load(card_name).expect("built-in card");
            if let Err(diags) = compile(&source, &Options::new(card)) {
                failures.push(format!(
                    "{name} on {card_name}:\n{}",
                    diag::render_all(&diags, &name, &source)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every schedule checks across small shapes, corner cases included: 1 to 5 layers (an
/// odd count takes the unoverlapped path for the next token's first layer), 1 to 4
/// micro-batches (FlexGen's multi-batch loop needs 2), with and without resident experts,
/// on both tiny families.
#[test]
fn every_schedule_checks_across_small_shapes() {
    let mut failures = Vec::new();
    for (name, path) in common::schedule_files() {
        let source = common::read(&path);
        let declared = common::declared_params(&source);
        for card_name in ["mixtral-tiny", "dbrx-tiny"] {
            for layers in 1..=5 {
                for count in 1..=4u32 {
                    for r_w in ["0.0", "0.3"] {
                        let mut options = Options::new(common::card_with_layers(card_name, layers));
                        options.workload = moec::ir::Workload {
                            batch: 8,
                            prompt_len: 8,
                            gen_len: 4,
                        };
                        let sets = [
                            ("n_ub", count.to_string()),
                            ("n_batch", count.max(2).to_string()),
                            ("ubs", "2".to_string()),
                            ("bs", "2".to_string()),
                            ("seqs", "2".to_string()),
                            ("packet_mb", "1".to_string()),
                            ("r_w", r_w.to_string()),
                        ];
                        for (param, value) in sets {
                            if declared.iter().any(|d| d == param) {
                                options.sets.push((param.to_string(), value));
                            }
                        }
                        if let Err(diags) = compile(&source, &options) {
                            failures.push(format!(
                                "{name} on {card_name} with {layers} layers, count {count}, r_w {r_w}:\n{}",
                                diag::render_all(&diags, &name, &source)
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} configurations failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
