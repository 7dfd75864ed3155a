//! Compile time of a production-size schedule: `schedules/cgopipe.sched` on the full `dbrx`
//! card with 16 micro-batches (40 layers x 16 micro-batches, about 10^4 tasks), from text to
//! a checked DAG, and each stage alone so a regression can be located.
//! Run: `cargo bench --bench compile`.

use criterion::{criterion_group, criterion_main, Criterion};
use moec::compile::{self, Options};
use moec::model::card::ModelCard;
use std::hint::black_box;

fn options() -> Options {
    let mut options = Options::new(ModelCard::load("dbrx").expect("built-in card"));
    options.sets.push(("n_ub".to_string(), "16".to_string()));
    options
}

fn bench_compile(c: &mut Criterion) {
    let source =
        std::fs::read_to_string("schedules/cgopipe.sched").expect("schedules/cgopipe.sched");
    let options = options();
    let compiled = compile::compile(&source, &options).expect("cgopipe compiles on dbrx");
    eprintln!(
        "cgopipe on dbrx, n_ub = 16: {} tasks, {} edges ({} before reduction)",
        compiled.program.tasks.len(),
        compiled.info.dag.edges.len(),
        compiled.info.dag.edges_before_reduction
    );
    let mut group = c.benchmark_group("cgopipe_dbrx_16ub");
    group.sample_size(20);
    group.bench_function("text_to_checked_dag", |b| {
        b.iter(|| compile::compile(black_box(&source), black_box(&options)).expect("compiles"))
    });
    group.bench_function("parse", |b| {
        b.iter(|| compile::source_to_ast(black_box(&source)).expect("parses"))
    });
    let ast = compile::source_to_ast(&source).expect("parses");
    group.bench_function("elaborate", |b| {
        b.iter(|| compile::ast_to_ir(black_box(&ast), &options).expect("elaborates"))
    });
    let (program, _) = compile::ast_to_ir(&ast, &options).expect("elaborates");
    group.bench_function("dependencies_and_reduction", |b| {
        b.iter(|| moec::ir::deps::build(black_box(&program)))
    });
    group.bench_function("value_tracking", |b| {
        b.iter(|| moec::check::values::check(black_box(&program)))
    });
    group.bench_function("check_all", |b| {
        b.iter(|| moec::check::check(black_box(&program)).expect("checks"))
    });
    group.finish();
}

criterion_group!(benches, bench_compile);
criterion_main!(benches);
