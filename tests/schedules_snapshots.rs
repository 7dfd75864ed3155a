//! Every schedule in `schedules/` compiled on the small configuration (tiny Mixtral card
//! cut to 2 layers, 3 micro-batches of 2 sequences) as canonical text and as Graphviz dot,
//! pinned with insta. A changed DAG fails the suite until its snapshot is reviewed. Also:
//! every schedule passes `check` with its default params on every built-in card.

mod common;

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
