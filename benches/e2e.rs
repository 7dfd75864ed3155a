//! End to end through the run API (`engine::run`, what `moec run` calls): 8 prompts x 8
//! tokens on a synthetic mixtral-tiny checkpoint through the sequential baseline and
//! FlexGen-with-CPU-attention schedules on the CPU backend (real weights, real kernels).
//! Each iteration loads the checkpoint, compiles, lowers, runs and replays on the `t4`
//! profile (named, so no quick probe of this machine runs inside the measurement).

use criterion::{criterion_group, criterion_main, Criterion};
use moec::engine::{run, RunRequest};
use moec::model::card::ModelCard;
use moec::weights::source::ModelSource;
use moec::weights::synth::{write_checkpoint, SynthOptions};

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
    // Prompt texts of 8 to 29 words, as the former token-id prompts' lengths.
    let prompts: Vec<String> = (0..8)
        .map(|i| {
            (0..(8 + 3 * i))
                .map(|t| format!("w{}", (5 + i * 31 + t * 7) % 97))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    for sched in [
        "schedules/baselines/sequential.sched",
        "schedules/baselines/flexgen_cpu_attn.sched",
    ] {
        let source = std::fs::read_to_string(format!("{}/{sched}", env!("CARGO_MANIFEST_DIR")))
            .expect("schedule");
        let mut request = RunRequest::new(sched, &source, 8);
        request.model = ModelSource {
            card: None,
            weights: Some(dir.path().join("ck")),
        };
        request.prompts = prompts.clone();
        request.hw = Some("t4".to_string());
        request.stop_at_eos = false;
        let name = std::path::Path::new(sched)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or(sched)
            .to_string();
        c.bench_function(&format!("e2e/{name}/8x8_tokens"), |b| {
            b.iter(|| run(&request, &mut |_, _| {}).expect("runs"))
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
