//! `schedules/fiddler.sched` (Fiddler, Algorithm 1) on the CPU backend: whatever the
//! threshold (always the CPU, always copy, the paper's latency rule, the released code's
//! 10 tokens) and whatever the placement (none, a few experts by Fiddler's placeholder
//! order, by a popularity profile), the run gives the oracle's greedy tokens on both tiny
//! cards; and one run whose routed counts vary takes both load arms (experts on the CPU
//! and experts copied to the GPU) in the same layer and step, as its trace records.

mod schedules_common;
use schedules_common as common;

use moec::compile::{compile, Compiled, Options};
use moec::ir::profile::RoutingProfile;
use moec::ir::{GuardAtom, Op, Workload};
use moec::model::card::ModelCard;
use std::sync::Arc;

/// 4 prompts of 9-12 tokens in micro-batches of 2 sequences: about 20 tokens per
/// micro-batch, so an expert gets anywhere from 0 to 20 of them in prefill and at most 2
/// in decode.
fn prompts(card: &ModelCard) -> Vec<Vec<u32>> {
    [12usize, 9, 11, 10]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|t| ((i * 131 + t * 17 + 1) as u64 % card.vocab) as u32)
                .collect()
        })
        .collect()
}

const GEN: usize = 3;

fn options(card: &ModelCard, sets: &[(&str, String)], profile: Option<&RoutingProfile>) -> Options {
    let mut options = Options::new(card.clone());
    options.workload = Workload {
        batch: 4,
        prompt_len: 12,
        gen_len: GEN as u64,
    };
    options.sets = [("ubs", "2".to_string()), ("n_ub", "2".to_string())]
        .into_iter()
        .chain(sets.iter().cloned())
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    options.profile = profile.cloned().map(Arc::new);
    options
}

fn fiddler(options: &Options) -> Compiled {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/fiddler.sched");
    let source = common::read(&path);
    compile(&source, options).unwrap_or_else(|d| panic!("fiddler.sched does not compile: {}", d[0]))
}

/// A profile that makes the highest-numbered experts of every layer the most popular
/// (the reverse of the placeholder order), so placement by profile differs from it.
fn reversed_profile(card: &ModelCard) -> RoutingProfile {
    RoutingProfile {
        model: card.name.clone(),
        tokens: 1000,
        counts: (0..card.layers)
            .map(|l| (0..card.experts).map(|e| 10 * e + l).collect())
            .collect(),
        coactivation: Vec::new(),
    }
}

#[test]
fn every_threshold_and_placement_gives_the_oracle_tokens() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for name in ["mixtral-tiny", "dbrx-tiny"] {
        let card = ModelCard::load(name).expect("card");
        let checkpoint = common::tiny_checkpoint(&card, dir.path());
        let prompts = prompts(&card);
        let expected = common::oracle_tokens(&checkpoint, &prompts, GEN);
        let profile = reversed_profile(&card);
        // always copy, always the CPU, the paper's latency rule, the released code's rule
        for t_copy in ["1", "1000000", "0", "10"] {
            for (n_gpu, with_profile) in [("0", false), ("6", false), ("6", true), ("-1", false)] {
                let sets = [("t_copy", t_copy.to_string()), ("n_gpu", n_gpu.to_string())];
                let compiled = fiddler(&options(&card, &sets, with_profile.then_some(&profile)));
                if let Err(e) =
                    common::run_against_oracle(&compiled, &checkpoint, &prompts, &expected)
                {
                    panic!("{name}, t_copy={t_copy}, n_gpu={n_gpu}, profile={with_profile}: {e}");
                }
            }
        }
    }
}

/// Which load arm a task belongs to: the copy arm (guarded by `routed >= t`, t > 1) or the
/// CPU arm (its negation).
fn arm(compiled: &Compiled, task: moec::ir::TaskId) -> Option<(bool, u32)> {
    let t = compiled.program.task(task);
    let Op::Experts { layer, .. } = t.op else {
        return None;
    };
    t.guard.lits.iter().find_map(|lit| match lit.atom {
        GuardAtom::Tokens { .. } => Some((!lit.negated, layer)),
        GuardAtom::Active { .. } => None,
    })
}

#[test]
fn one_step_runs_some_experts_on_the_cpu_and_copies_others_in_the_same_layer() {
    use moec::lower::{lower, LowerOptions};
    use moec::runtime::{generate, RunOptions};
    let dir = tempfile::tempdir().expect("temporary directory");
    let card = ModelCard::load("mixtral-tiny").expect("card");
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts = prompts(&card);
    let expected = common::oracle_tokens(&checkpoint, &prompts, GEN);
    // No resident experts; copy at 6 tokens: prefill micro-batches of ~20 tokens route
    // 40 (token, expert) pairs over 8 experts, so some get 6 or more, some fewer.
    let sets = [("t_copy", "6".to_string()), ("n_gpu", "0".to_string())];
    let compiled = fiddler(&options(&card, &sets, None));
    let plan = lower(&compiled.program, &compiled.info, &LowerOptions::default()).expect("lowers");
    let mut run = RunOptions::greedy(GEN);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    let (outputs, stats) =
        generate(&plan, &checkpoint, &prompts, &run, &mut |_, _| {}).expect("runs");
    let got: Vec<Vec<u32>> = outputs.into_iter().map(|o| o.token_ids).collect();
    assert_eq!(got, expected, "the oracle's tokens");
    let mut both = Vec::new();
    for (s, step) in stats.steps.iter().enumerate() {
        for layer in 0..card.layers as u32 {
            let ran = |copy: bool| {
                step.tasks
                    .iter()
                    .filter(|r| r.ran && arm(&compiled, r.task) == Some((copy, layer)))
                    .count()
            };
            let (copied, on_cpu) = (ran(true), ran(false));
            if copied > 0 && on_cpu > 0 {
                both.push((s, layer, copied, on_cpu));
            }
        }
    }
    assert!(
        !both.is_empty(),
        "no layer of any step ran both a copied and a CPU expert"
    );
    // The skipped arm of each expert is recorded as not run: every guarded expert task
    // either ran or was skipped, and some of each kind were skipped.
    let prefill = &stats
        .steps
        .iter()
        .find(|s| s.prefill_tokens > 0)
        .expect("a prefill");
    let skipped = |copy: bool| {
        prefill
            .tasks
            .iter()
            .filter(|r| !r.ran && arm(&compiled, r.task).is_some_and(|a| a.0 == copy))
            .count()
    };
    assert!(skipped(true) > 0 && skipped(false) > 0);
}
