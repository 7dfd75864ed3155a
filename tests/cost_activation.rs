//! Guarded tasks charged by expected activation: a batch-1 decode step of `fiddler.sched`
//! on Mixtral-8x7B (Fiddler's Table 1 setting: 56 resident experts on the Quadro RTX 6000
//! profile) costs the experts one token is expected to run, checked against hand
//! arithmetic.

use moec::compile::{compile, Options};
use moec::cost::activation::activation;
use moec::cost::hardware::{HardwareProfile, Level};
use moec::cost::predict::{predict, CostSettings};
use moec::ir::{Op, StepKind, TaskId, Workload};
use moec::model::card::ModelCard;

#[test]
fn a_batch_one_decode_step_charges_only_the_expected_active_experts() {
    let source = std::fs::read_to_string("schedules/fiddler.sched").expect("schedule");
    let card = ModelCard::load("mixtral-8x7b").expect("card");
    let hw = HardwareProfile::load("quadro-rtx6000").expect("profile");
    let mut options = Options::new(card.clone());
    options.workload = Workload {
        batch: 1,
        prompt_len: 128,
        gen_len: 32,
    };
    options.hardware = hw
        .symbols()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    options.sets = vec![("n_gpu".to_string(), "56".to_string())];
    let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{}", d[0]));
    let program = &compiled.program;
    let decode = program
        .steps
        .iter()
        .position(|s| s.kind == StepKind::Decode)
        .expect("a decode step");
    // One token routes to top_k = 2 of 8 experts: each expert is active with probability
    // exactly 1/4, and over a layer's 8 expert computations (whatever arm) the expected
    // number that run is 2, so 32 layers run 64.
    let mut expected_runs = 0.0;
    for id in program.steps[decode].task_ids() {
        let task = program.task(id);
        if let Op::Experts { .. } = task.op {
            let act = activation(program, id, task.shape.tokens);
            expected_runs += act.runs;
            assert!(
                act.runs == 0.0 || (act.runs - 0.25).abs() < 1e-12,
                "{}: {}",
                program.task_name(id),
                act.runs
            );
        }
    }
    assert!((expected_runs - 64.0).abs() < 1e-9, "{expected_runs}");
    // The CPU arm: 256 - 56 = 200 experts, a quarter of them expected to run, each reading
    // its 3 x 4096 x 14336 bf16 weights once at the CPU's 180 GB/s (one token is memory
    // bound): 50 x 352,321,536 B / 180 GB/s = 97.87 ms.
    let deps: Vec<Vec<TaskId>> = (0..program.tasks.len())
        .map(|t| {
            compiled
                .info
                .dag
                .preds(TaskId::new(t))
                .iter()
                .map(|d| d.from)
                .collect()
        })
        .collect();
    let prediction = predict(program, &deps, &hw, &CostSettings::default()).expect("predicts");
    let step = &prediction.steps[decode];
    let cpu = step
        .arms
        .iter()
        .find(|a| a.arm.starts_with("experts on cpu"))
        .expect("a CPU arm");
    assert_eq!(cpu.tasks, 200);
    assert!((cpu.expected_share - 0.25).abs() < 1e-12);
    let expert_bytes = 3.0 * 4096.0 * 14336.0 * 2.0;
    let hand = 50.0 * expert_bytes / hw.level_bandwidth(Level::Host);
    assert!(
        (cpu.seconds - hand).abs() / hand < 0.01,
        "{} s vs {hand} s",
        cpu.seconds
    );
    // The copy arm needs more tokens than one: never expected in decode.
    let copy = step
        .arms
        .iter()
        .filter(|a| a.arm.contains("routed >="))
        .map(|a| a.expected_share)
        .fold(0.0, f64::max);
    assert_eq!(copy, 0.0);
}

/// `moe_infinity.sched` on Mixtral-8x7B, batch 1, with a cache of 64 slots (a quarter of
/// the model's 256 experts): with uniform routing every expert is requested alike, so any
/// policy keeps a quarter of the requests resident. Hand arithmetic: each expert is
/// active in a decode step with probability 1/4 (top-2 of 8); a fetch copies only on a
/// miss (3/4); so the step's 256 fetches run 256 x 1/4 x 3/4 = 48 expected copies, and
/// its 256 expert computations 64 expected runs.
#[test]
fn a_batch_one_decode_step_of_moe_infinity_charges_expected_experts_and_misses() {
    use moec::cost::activation::cache_hits;
    use moec::ir::cache::CacheOp;
    let source = std::fs::read_to_string("schedules/moe_infinity.sched").expect("schedule");
    let card = ModelCard::load("mixtral-8x7b").expect("card");
    let mut options = Options::new(card);
    options.workload = Workload {
        batch: 1,
        prompt_len: 128,
        gen_len: 32,
    };
    options.sets = vec![
        ("n_cache".to_string(), "64".to_string()),
        ("n_pf".to_string(), "0".to_string()),
    ];
    for policy in ["0", "1", "2"] {
        let mut options = options.clone();
        options
            .sets
            .push(("policy".to_string(), policy.to_string()));
        let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{}", d[0]));
        let program = &compiled.program;
        let hits = cache_hits(program, 0, 1);
        assert!(
            (hits.rate - 0.25).abs() < 1e-6,
            "policy {policy}: {}",
            hits.rate
        );
        let decode = program
            .steps
            .iter()
            .position(|s| s.kind == StepKind::Decode)
            .expect("a decode step");
        let (mut copies, mut computed) = (0.0, 0.0);
        for id in program.steps[decode].task_ids() {
            let task = program.task(id);
            let act = activation(program, id, task.shape.tokens);
            if task.cache_op == Some(CacheOp::Fetch) {
                copies += act.runs;
            }
            if let Op::Experts { .. } = task.op {
                computed += act.runs;
            }
        }
        if policy == "0" {
            // LRU under Che's approximation: equal rates give exactly slots / keys.
            assert!((copies - 48.0).abs() < 1e-6, "policy {policy}: {copies}");
        } else {
            // LFU and the activation score keep 64 whole keys: per key a hit or a miss,
            // 64 fetches of 256 always hit, so 192 x 1/4 = 48 copies again.
            assert!((copies - 48.0).abs() < 1e-6, "policy {policy}: {copies}");
        }
        assert!((computed - 64.0).abs() < 1e-9, "{computed}");
    }
}

/// A skewed profile: in layer 0 of a 2-layer, 4-expert, top-1 model, expert 0 takes 70%
/// of the tokens. LFU with one slot keeps it: batch-1 requests per step are 0.7 + 3 x 0.1
/// in layer 0 and 4 x 0.25 in layer 1, so the hit rate is 0.7 / 2 = 0.35 (hand arithmetic).
#[test]
fn lfu_keeps_the_most_requested_expert_of_a_skewed_profile() {
    use moec::cost::activation::cache_hits;
    use moec::ir::profile::RoutingProfile;
    let mut card = ModelCard::load("mixtral-tiny").expect("card");
    card.layers = 2;
    card.experts = 4;
    card.top_k = 1;
    let profile = RoutingProfile {
        model: card.name.clone(),
        tokens: 100,
        counts: vec![vec![70, 10, 10, 10], vec![25, 25, 25, 25]],
        coactivation: Vec::new(),
        requests: Vec::new(),
    };
    let source = "schedule c\nmicrobatches 1 of 1\nstream gpu: gpu.compute\ncache ec[1]: gpu evict \"lfu\"\nprefill { }\n";
    let mut options = Options::new(card);
    options.profile = Some(std::sync::Arc::new(profile));
    // Elaborated only: the cost model reads the declaration, nothing runs.
    let file = moec::syntax::parse_file(source).expect("parses");
    let (program, _) = moec::elaborate::elaborate(&file, &options).expect("elaborates");
    let hits = cache_hits(&program, 0, 1);
    assert!((hits.rate - 0.35).abs() < 1e-9, "{}", hits.rate);
    assert_eq!(hits.per_key[0][0], 1.0);
    assert!((hits.layer_rate[0] - 0.7).abs() < 1e-9);
    assert_eq!(hits.layer_rate[1], 0.0);
}

/// `pregated.sched`'s lookahead prefetches are charged as lookahead gating copies them:
/// only the experts the next layer's pregate selected, and the fetches of a predicted
/// layer as hits. At batch 1 on Mixtral-8x7B (top-2
/// of 8) the one token selects exactly 2 experts, so both prefetch ranks are charged alike
/// (an unguarded prefetch as a copy: the cache model does not discount prefetches); at
/// batch 4 the 8 prefetch ranks copy only as far as the 4 tokens select
/// distinct experts: rank r copies with probability P(D >= r + 1) given D >= 2, D the
/// number of experts 4 tokens select (each with probability 1 - (3/4)^4 = 175/256,
/// independently: a binomial over 8 experts), checked here against that hand sum.
#[test]
fn lookahead_prefetches_are_charged_only_for_the_experts_the_pregate_selected() {
    let source = std::fs::read_to_string("schedules/pregated.sched").expect("schedule");
    let card = ModelCard::load("mixtral-8x7b").expect("card");
    let prefetch_runs = |bs: u32| -> Vec<f64> {
        let mut options = Options::new(card.clone());
        options.workload = Workload {
            batch: u64::from(bs),
            prompt_len: 128,
            gen_len: 32,
        };
        options.sets = vec![
            ("bs".to_string(), bs.to_string()),
            ("home".to_string(), "1".to_string()),
        ];
        let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{}", d[0]));
        let program = &compiled.program;
        let decode = program
            .steps
            .iter()
            .position(|s| s.kind == StepKind::Decode)
            .expect("a decode step");
        // The prefetches of layer 1's experts, by rank.
        program.steps[decode]
            .task_ids()
            .filter(|&id| {
                let t = program.task(id);
                t.cache_op == Some(moec::ir::cache::CacheOp::Prefetch)
                    && t.args
                        .iter()
                        .any(|a| a.slice.cache_key.is_some_and(|k| k.layer == 1))
            })
            .map(|id| activation(program, id, program.task(id).shape.tokens).runs)
            .collect()
    };
    // A fetch of a layer the pregates predicted is charged as a hit (the pregate taken to
    // select the gate's experts); layer 0, which nothing predicts, copies on a miss.
    {
        let mut options = Options::new(card.clone());
        options.workload = Workload {
            batch: 1,
            prompt_len: 128,
            gen_len: 32,
        };
        options.sets = vec![("bs".to_string(), "1".to_string())];
        let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{}", d[0]));
        let program = &compiled.program;
        let decode = program
            .steps
            .iter()
            .position(|s| s.kind == StepKind::Decode)
            .expect("a decode step");
        let fetch_runs = |layer: u32| -> Vec<f64> {
            program.steps[decode]
                .task_ids()
                .filter(|&id| {
                    let t = program.task(id);
                    t.cache_op == Some(moec::ir::cache::CacheOp::Fetch)
                        && t.args
                            .iter()
                            .any(|a| a.slice.cache_key.is_some_and(|k| k.layer == layer))
                })
                .map(|id| activation(program, id, program.task(id).shape.tokens).runs)
                .collect()
        };
        let (first, second) = (fetch_runs(0), fetch_runs(1));
        assert_eq!((first.len(), second.len()), (8, 8));
        assert!(first.iter().all(|&r| r > 0.0), "{first:?}");
        assert!(second.iter().all(|&r| r == 0.0), "{second:?}");
    }
    let one = prefetch_runs(1);
    assert_eq!(one.len(), 2, "{one:?}");
    // Both ranks are selected and charged alike.
    assert!(one[0] > 0.0 && (one[0] - one[1]).abs() < 1e-12, "{one:?}");
    let four = prefetch_runs(4);
    assert_eq!(four.len(), 8, "{four:?}");
    // Ranks 0 and 1 are always selected: what they charge is the cache's miss
    // probability alone, the same for every rank of a layer.
    let miss = four[0];
    assert!(miss > 0.0 && (four[1] - miss).abs() < 1e-12, "{four:?}");
    // P(D = d) for D ~ Binomial(8, 175/256), conditioned on D >= 2.
    let p = 175.0 / 256.0;
    let choose =
        |n: u64, k: u64| -> f64 { (0..k).map(|i| (n - i) as f64 / (i + 1) as f64).product() };
    let pmf = |d: u64| choose(8, d) * f64::powi(p, d as i32) * f64::powi(1.0 - p, 8 - d as i32);
    let floor: f64 = (2..=8).map(pmf).sum();
    for (r, &runs) in four.iter().enumerate() {
        let need = r as u64 + 1;
        let selected = if need <= 2 {
            1.0
        } else {
            (need..=8).map(pmf).sum::<f64>() / floor
        };
        assert!(
            (runs - miss * selected).abs() < 1e-9,
            "rank {r}: {runs} vs {} x {selected}",
            miss
        );
    }
}

/// LRU over a decode that visits the layers in order (`cost::activation::
/// lru_first_fetch_hits`): at batch 1 on Mixtral-8x7B every expert is used in a step with
/// probability 1/4, and a key is still cached at its next use g steps later iff fewer
/// than N other keys were used in between, D(g) in expectation: D(1) = 31 layers x 2 = 62,
/// D(2) = 31 x (8 x (1 - (3/4)^2)) + 7 x 1/4 = 110.25, D(3) = 31 x 4.625 + 7 x 0.4375 =
/// 146.4 (hand arithmetic). So 55 slots never hit (the Mixtral-8x7B Q4_K_M disk bench: 0
/// hits in 2,240 fetches), 64 and 110 hit when the gap is one step (1/4), 129 when it is at
/// most two (1 - (3/4)^2 = 7/16; the same run with 129 slots: 990 of 2,230, 44%), 147
/// within three (37/64).
#[test]
fn lru_hits_follow_reuse_distances_of_a_layer_ordered_decode() {
    use moec::cost::activation::cache_hits;
    let source = std::fs::read_to_string("schedules/moe_infinity.sched").expect("schedule");
    let card = ModelCard::load("mixtral-8x7b").expect("card");
    for (slots, want) in [
        (55, 0.0),
        (64, 0.25),
        (110, 0.25),
        (129, 7.0 / 16.0),
        (147, 37.0 / 64.0),
    ] {
        let mut options = Options::new(card.clone());
        options.workload = Workload {
            batch: 1,
            prompt_len: 128,
            gen_len: 32,
        };
        options.sets = vec![
            ("n_cache".to_string(), slots.to_string()),
            ("n_pf".to_string(), "0".to_string()),
            ("policy".to_string(), "0".to_string()),
        ];
        let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{}", d[0]));
        let hits = cache_hits(&compiled.program, 0, 1);
        assert!(
            (hits.rate - want).abs() < 1e-9,
            "{slots} slots: {} (want {want})",
            hits.rate
        );
    }
}

/// `moe_infinity.sched`'s `eam` prefetches earn hits, as far as the ranking they are
/// given can: Mixtral-8x7B at batch 1, 64 LRU slots, 2 experts prefetched one layer ahead.
/// Uniform routing gives the predictor nothing to rank by, so the 2 experts it prefetches
/// hold a routed expert with probability 2/8. Hand arithmetic per decode step: every
/// expert is active with probability 1/4 and resident with probability 1/4 (LRU by reuse
/// distance: 62 other keys are used in one step, fewer than 64 slots, and 110 in two, so a
/// key hits when its gap is one step: 1/4). Layer 0 (nothing prefetches it): 8 fetches x 1/4
/// x 3/4 = 1.5 copies. Layers 1-31: 8 x 1/4 x 3/4 x (1 - 2/8) = 1.125 copies each,
/// 34.875 in all; 36.375 with layer 0 (48 without the prefetches' credit). The prefetches:
/// 31 layers x 2, each copying its pick unless resident (3/4): 46.5 copies; 64 slots less
/// the 2 one token's fetches hold leave room for the 2 in flight. With `lookahead = 2` a
/// layer is prefetched after each of the two gates before it, and the second prefetch of
/// a key finds it resident: the same 46.5 copies.
#[test]
fn eam_prefetches_earn_the_hits_their_ranking_gives_on_uniform_routing() {
    use moec::cost::prefetch::decode_credit;
    use moec::ir::cache::CacheOp;
    let source = std::fs::read_to_string("schedules/moe_infinity.sched").expect("schedule");
    let card = ModelCard::load("mixtral-8x7b").expect("card");
    for lookahead in ["1", "2"] {
        let mut options = Options::new(card.clone());
        options.workload = Workload {
            batch: 1,
            prompt_len: 128,
            gen_len: 32,
        };
        options.sets = [
            ("n_cache", "64"),
            ("n_pf", "2"),
            ("lookahead", lookahead),
            ("policy", "0"),
            ("predictor", "1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let file = moec::syntax::parse_file(&source).expect("parses");
        let (program, _) = moec::elaborate::elaborate(&file, &options).expect("elaborates");
        let decode = program
            .steps
            .iter()
            .position(|s| s.kind == StepKind::Decode)
            .expect("a decode step");
        let (mut fetches, mut prefetches, mut prefetch_tasks) = (0.0, 0.0, 0);
        for id in program.steps[decode].task_ids() {
            let task = program.task(id);
            let runs = activation(&program, id, task.shape.tokens).runs;
            match task.cache_op {
                Some(CacheOp::Fetch) => fetches += runs,
                Some(CacheOp::Prefetch) => {
                    prefetches += runs;
                    prefetch_tasks += 1;
                }
                None => {}
            }
        }
        let tasks = if lookahead == "1" { 62 } else { 122 };
        assert_eq!(prefetch_tasks, tasks, "lookahead {lookahead}");
        assert!(
            (fetches - 36.375).abs() < 1e-6,
            "lookahead {lookahead}: {fetches}"
        );
        assert!(
            (prefetches - 46.5).abs() < 1e-6,
            "lookahead {lookahead}: {prefetches}"
        );
        // What `moec simulate` prints under the cache's line: a quarter of the misses of
        // 31 layers found prefetched; hits 1/4 + 3/4 x 1/4 x 31/32 over all fetches.
        let credit = decode_credit(&program, 0, 1).expect("prefetches");
        assert_eq!(credit.layers, 31);
        assert_eq!(credit.plan.per_layer, 2);
        assert!((credit.plan.room - 1.0).abs() < 1e-12);
        assert!((credit.accuracy - 0.25).abs() < 1e-9, "{}", credit.accuracy);
        let rate = 0.25 + 0.75 * 0.25 * 31.0 / 32.0;
        assert!(
            (credit.rate - rate).abs() < 1e-6,
            "{} vs {rate}",
            credit.rate
        );
    }
}

/// With a profile the `eam` ranking is the profile's: a 2-layer, 4-expert, top-1 model
/// whose layer 1 routes 40%, 40%, 10%, 10% (layer 0 uniform), 3 slots under the
/// activation-aware policy, one expert prefetched for layer 1 after layer 0's gate.
/// Hand arithmetic: the policy keeps the 3 keys of highest rate x (1 - l / 2): layer 0's
/// experts 0-2 (0.25 each, against layer 1's 0.2, 0.2, 0.05, 0.05). The predictor's first
/// rank is expert 0 or 1 (tied at 40%), each with probability 1/2, so a fetch of either
/// finds it prefetched half the time. Fetch copies per decode step: layer 0, expert 3:
/// 0.25; layer 1: 0.4 x 1/2 twice and 0.1 twice = 0.6; 0.85 in all (1.25 without the
/// prefetch). The prefetch copies its pick (never resident) whenever it runs: 1. Hit
/// rate: (0.75 + 0.4) / 2 = 57.5%, where the fetches alone hit 37.5%; of layer 1's
/// misses (1.0 expected), 0.4 found prefetched: 40%.
#[test]
fn eam_prefetches_rank_by_the_profile_and_split_its_ties() {
    use moec::cost::activation::cache_hits;
    use moec::cost::prefetch::decode_credit;
    use moec::ir::cache::CacheOp;
    use moec::ir::profile::RoutingProfile;
    let mut card = ModelCard::load("mixtral-tiny").expect("card");
    card.layers = 2;
    card.experts = 4;
    card.top_k = 1;
    let profile = RoutingProfile {
        model: card.name.clone(),
        tokens: 100,
        counts: vec![vec![25, 25, 25, 25], vec![40, 40, 10, 10]],
        coactivation: Vec::new(),
        requests: Vec::new(),
    };
    let source = std::fs::read_to_string("schedules/moe_infinity.sched").expect("schedule");
    let mut options = Options::new(card);
    options.profile = Some(std::sync::Arc::new(profile));
    options.workload = Workload {
        batch: 1,
        prompt_len: 8,
        gen_len: 4,
    };
    options.sets = [
        ("n_cache", "3"),
        ("n_pf", "1"),
        ("policy", "2"),
        ("predictor", "1"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let file = moec::syntax::parse_file(&source).expect("parses");
    let (program, _) = moec::elaborate::elaborate(&file, &options).expect("elaborates");
    let hits = cache_hits(&program, 0, 1);
    assert_eq!(hits.per_key[0], vec![1.0, 1.0, 1.0, 0.0]);
    assert_eq!(hits.per_key[1], vec![0.0; 4]);
    assert!((hits.rate - 0.375).abs() < 1e-9, "{}", hits.rate);
    let decode = program
        .steps
        .iter()
        .position(|s| s.kind == StepKind::Decode)
        .expect("a decode step");
    let mut fetch = [[0.0f64; 4]; 2];
    let mut prefetches = Vec::new();
    for id in program.steps[decode].task_ids() {
        let task = program.task(id);
        let runs = activation(&program, id, task.shape.tokens).runs;
        let key = task.args.iter().find_map(|a| a.slice.cache_key);
        match (task.cache_op, key) {
            (Some(CacheOp::Fetch), Some(k)) => {
                let moec::ir::catalog::ExpertRef::Index(e) = k.expert else {
                    panic!("a fetch of a static expert");
                };
                fetch[k.layer as usize][e as usize] += runs;
            }
            (Some(CacheOp::Prefetch), Some(_)) => prefetches.push(runs),
            _ => {}
        }
    }
    let close = |a: &[f64; 4], b: [f64; 4]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
    assert!(close(&fetch[0], [0.0, 0.0, 0.0, 0.25]), "{:?}", fetch[0]);
    assert!(close(&fetch[1], [0.2, 0.2, 0.1, 0.1]), "{:?}", fetch[1]);
    assert_eq!(prefetches, vec![1.0]);
    let credit = decode_credit(&program, 0, 1).expect("prefetches");
    assert_eq!(credit.layers, 1);
    assert!((credit.rate - 0.575).abs() < 1e-9, "{}", credit.rate);
    assert!((credit.accuracy - 0.4).abs() < 1e-9, "{}", credit.accuracy);
}
