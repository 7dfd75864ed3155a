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
