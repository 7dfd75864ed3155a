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
        requests: Vec::new(),
    }
}

#[test]
fn every_threshold_and_placement_gives_the_oracle_tokens() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for name in ["mixtral-tiny", "dbrx-tiny"] {
        let card = ModelCard::load(name).expect("card");
        let checkpoint = common::tiny_checkpoint(&card, dir.path());
        let prompts = common::varied_prompts(&card);
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
        _ => None,
    })
}

#[test]
fn one_step_runs_some_experts_on_the_cpu_and_copies_others_in_the_same_layer() {
    use moec::lower::{lower, LowerOptions};
    use moec::runtime::{generate, RunOptions};
    let dir = tempfile::tempdir().expect("temporary directory");
    let card = ModelCard::load("mixtral-tiny").expect("card");
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts = common::varied_prompts(&card);
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
    // The trace shows it: spans labelled by arm, `copied[l, j, e]` on the `gpu` stream and
    // `on_cpu[l, j, e]` on the `cpu` stream, for that layer within that step's time.
    let trace = moec::runtime::driver::report::timeline(&plan, &stats, "fiddler");
    let (s, layer, _, _) = both[0];
    let (start, end) = (stats.steps[s].start, stats.steps[s].end);
    let lane = |name: &str| {
        trace
            .streams
            .iter()
            .position(|n| n == name)
            .expect("stream")
    };
    let shown = |label: &str, stream: usize| {
        trace.spans.iter().any(|sp| {
            sp.stream == stream
                && sp.name.contains(&format!("{label}[{layer}, "))
                && sp.start >= start
                && sp.end <= end
        })
    };
    assert!(shown("copied", lane("gpu")) && shown("on_cpu", lane("cpu")));
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

/// The paper's setting (Table 1, Env. 1: a 24 GB Quadro RTX 6000) on the real cards: it
/// checks and fits; filling the GPU as Fiddler does places as many experts as fit; and
/// `n_gpu = 56` places exactly Table 1's 56 of Mixtral-8x7B's 256 experts, one buffer
/// each, chosen by the profile's ranking.
#[test]
fn the_paper_setting_checks_and_fits_a_24_gb_gpu_on_the_real_cards() {
    use moec::cost::budget::{budget_table, BudgetOverrides};
    use moec::cost::hardware::HardwareProfile;
    let hw = HardwareProfile::load("quadro-rtx6000").expect("profile");
    for (name, n_gpu) in [
        ("mixtral-8x7b", "56"),
        ("mixtral-8x7b", "-1"),
        ("dbrx", "-1"),
    ] {
        let card = ModelCard::load(name).expect("card");
        let mut opts = Options::new(card.clone());
        // Budgeted for the CUDA backend: its scratch rules, which the fill rule's
        // `gpu_scratch` and the budget's `scratch on gpu` line both ask.
        opts.scratch = moec::runtime::registry::find("cuda").unwrap().scratch;
        opts.hardware = hw
            .symbols()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        opts.sets = vec![("n_gpu".to_string(), n_gpu.to_string())];
        // Popularity: expert e of layer l routed (l + 1) * (e + 1) times, so the ranking
        // differs from the placeholder order.
        let profile = RoutingProfile {
            model: name.to_string(),
            tokens: 1,
            counts: (1..=card.layers)
                .map(|l| (1..=card.experts).map(|e| l * e).collect())
                .collect(),
            coactivation: Vec::new(),
            requests: Vec::new(),
        };
        opts.profile = Some(Arc::new(profile));
        let compiled = fiddler(&opts);
        let table = budget_table(&compiled.program, Some(&hw), &BudgetOverrides::default());
        assert!(table.fits(), "{name}, n_gpu={n_gpu}:\n{table}");
        let resident = compiled
            .program
            .buffers
            .iter()
            .filter(|b| b.array == "w_res")
            .count();
        match n_gpu {
            "56" => assert_eq!(resident, 56),
            // Filling: the fill rule leaves room for the compute stream's scratch
            // (`gpu_scratch` of a prefill or a decode step: the largest task of any op, all
            // experts), of which the budget counts the stream's own largest task; beside
            // that reservation, less than two experts stay free (the floor of the rule's
            // own estimate of the rest, which is within an expert of what the budget
            // counts: 10 MB apart on Mixtral-8x7B, whose experts are 352 MB).
            _ => {
                use moec::runtime::cuda::scratch::max_task_bytes;
                let expert = compiled.program.checkpoint().expert_bytes;
                let w = compiled.program.workload;
                let ctx = w.prompt_len + w.gen_len;
                // `options` runs micro-batches of 2 sequences.
                let reserved = max_task_bytes(&card, 2 * w.prompt_len, 2, ctx)
                    .max(max_task_bytes(&card, 2, 2, ctx));
                let counted = table
                    .lines
                    .iter()
                    .find(|l| l.what.starts_with("scratch on gpu"))
                    .map_or(0, |l| l.bytes);
                assert!(counted <= reserved, "{name}: {counted} > {reserved}");
                let gpu = (table.peak("gpu") - counted + reserved) as f64;
                let budget = hw.budget_bytes(moec::cost::hardware::Level::Gpu);
                assert!(
                    resident > 0 && gpu + 2.0 * expert as f64 > budget,
                    "{name}: {resident} experts, {gpu} of {budget} bytes"
                );
            }
        }
        // The most popular expert (the last of the last layer) is resident in slot 0.
        let setup = &compiled.program.steps[0];
        let last = card.layers as u32 - 1;
        let e_last = card.experts as u32 - 1;
        let layout = compiled.program.checkpoint();
        let first_copy = setup
            .task_ids()
            .map(|t| compiled.program.task(t))
            .find(|t| {
                t.args
                    .get(1)
                    .is_some_and(|a| compiled.program.buffer(a.slice.buffer).name == "w_res[0]")
            })
            .expect("slot 0 is filled in setup");
        let src = first_copy.args[0].slice;
        // `d_pin` is a layer slot (`layer_weights()`): experts where a MoE layer's are.
        let staged_layer_offset =
            layout.slot_experts_offset() + u64::from(e_last) * layout.expert_bytes;
        assert_eq!(
            src.start % layout.slot_layer_bytes(),
            staged_layer_offset,
            "{name}: slot 0 holds expert {e_last} (of layer {last})"
        );
    }
}

/// `moec profile`'s counting: a run lowered with every gate read back adds each step's
/// routing; every token is counted once, each layer routes tokens x top_k selections, and
/// co-activation is symmetric with top_k - 1 partners per selection.
#[test]
fn a_profiling_run_counts_every_tokens_routing() {
    use moec::lower::{lower, LowerOptions};
    use moec::runtime::{generate, RunOptions};
    use std::sync::Mutex;
    let dir = tempfile::tempdir().expect("temporary directory");
    let card = ModelCard::load("dbrx-tiny").expect("card");
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts = common::varied_prompts(&card);
    let compiled = fiddler(&options(&card, &[], None));
    let lower_options = LowerOptions {
        read_all_routing: true,
        ..LowerOptions::default()
    };
    let plan = lower(&compiled.program, &compiled.info, &lower_options).expect("lowers");
    let profile = Arc::new(Mutex::new(RoutingProfile::empty(
        &card.name,
        card.layers,
        card.experts,
    )));
    let mut run = RunOptions::greedy(GEN);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    run.routing_profile = Some(Arc::clone(&profile));
    generate(&plan, &checkpoint, &prompts, &run, &mut |_, _| {}).expect("runs");
    let profile = profile.lock().expect("profile").clone();
    // Prefill: every prompt token; each of the GEN decode steps but the last feeds back
    // one token per sequence (the last sampled token is never run).
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let tokens = (prompt_tokens + prompts.len() * (GEN - 1)) as u64;
    assert_eq!(profile.tokens, tokens);
    for (l, counts) in profile.counts.iter().enumerate() {
        assert_eq!(counts.iter().sum::<u64>(), tokens * card.top_k, "layer {l}");
        let co = &profile.coactivation[l];
        for a in 0..card.experts as usize {
            assert_eq!(co[a][a], 0);
            assert_eq!(co[a].iter().sum::<u64>(), counts[a] * (card.top_k - 1));
            for (b, row) in co.iter().enumerate() {
                assert_eq!(co[a][b], row[a]);
            }
        }
    }
}

/// The copy threshold Algorithm 1's rule gives, "copy iff s * cpu_tok > gpu + transfer",
/// i.e. t = floor((gpu + transfer) / cpu_tok) + 1: from measured latencies (`lat.*`,
/// written by `moec probe --model`), from the profile's bandwidths, and the released
/// code's fixed 10.
#[test]
fn the_copy_threshold_follows_the_latency_model() {
    use moec::cost::hardware::{ExpertLatency, HardwareProfile};
    let card = ModelCard::load("mixtral-tiny").expect("card");
    let threshold = |hw: Option<&HardwareProfile>, t_copy: &str| -> u32 {
        let mut opts = options(
            &card,
            &[("t_copy", t_copy.to_string()), ("n_gpu", "0".to_string())],
            None,
        );
        if let Some(hw) = hw {
            opts.hardware = hw
                .symbols()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
        }
        let compiled = fiddler(&opts);
        compiled
            .program
            .tasks
            .iter()
            .flat_map(|t| t.guard.lits.iter())
            .find_map(|l| match l.atom {
                GuardAtom::Tokens { at_least, .. } => Some(at_least),
                _ => None,
            })
            .expect("a copy arm")
    };
    let mut measured = HardwareProfile::load("quadro-rtx6000").expect("profile");
    // Quadro env. 1 by bandwidth: host 180 GB/s, GPU 672 GB/s, link 12 GB/s:
    // 180/672 + 180/12 = 15.27 -> 16.
    assert_eq!(threshold(Some(&measured), "0"), 16);
    // Measured: 1 ms per CPU token, 2 ms on the GPU, 4.5 ms transfer: 6.5 -> 7.
    measured.latency = Some(ExpertLatency {
        model: card.name.clone(),
        cpu_s_per_token: 1e-3,
        gpu_s: 2e-3,
        copy_s: 4.5e-3,
    });
    assert_eq!(threshold(Some(&measured), "0"), 7);
    // No profile: Table 1's env. 1 defaults, 100 GB/s, 672 GB/s, 12 GB/s: 8.48 -> 9.
    assert_eq!(threshold(None, "0"), 9);
    // The released code.
    assert_eq!(threshold(None, "10"), 10);
}
