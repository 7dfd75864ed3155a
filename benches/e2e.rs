//! End to end: `generate` of 8 prompts x 8 tokens on mixtral-tiny through the sequential
//! baseline and FlexGen-with-CPU-attention schedules (real weights, real kernels).

use criterion::{criterion_group, criterion_main, Criterion};
use moec::compile::{compile, Options};
use moec::ir::Workload;
use moec::lower::{lower, LowerOptions};
use moec::model::card::ModelCard;
use moec::model::checkpoint::Checkpoint;
use moec::model::synth::{write_checkpoint, SynthOptions};
use moec::runtime::{generate, RunOptions};

fn bench(c: &mut Criterion) {
    let card = ModelCard::load("mixtral-tiny").expect("card");
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(
        &card,
        &dir.path().join("ck"),
        &SynthOptions {
            seed: 2,
            dtype: card.dtype,
            ..Default::default()
        },
    )
    .expect("synth");
    let checkpoint = Checkpoint::open(&dir.path().join("ck")).expect("checkpoint");
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            (0..(8 + 3 * i))
                .map(|t| (5 + i * 31 + t * 7) as u32)
                .collect()
        })
        .collect();
    for sched in [
        "schedules/baselines/sequential.sched",
        "schedules/baselines/flexgen_cpu_attn.sched",
    ] {
        let source = std::fs::read_to_string(format!("{}/{sched}", env!("CARGO_MANIFEST_DIR")))
            .expect("schedule");
        let mut options = Options::new(card.clone());
        options.workload = Workload {
            batch: 8,
            prompt_len: 29,
            gen_len: 8,
        };
        let compiled = compile(&source, &options).unwrap_or_else(|_| panic!("{sched} compiles"));
        let plan =
            lower(&compiled.program, &compiled.info, &LowerOptions::default()).expect("lowers");
        let mut run = RunOptions::greedy(8);
        run.stop_at_eos = false;
        c.bench_function(&format!("e2e/{}/8x8_tokens", plan.name), |b| {
            b.iter(|| generate(&plan, &checkpoint, &prompts, &run, &mut |_, _| {}).expect("runs"))
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
