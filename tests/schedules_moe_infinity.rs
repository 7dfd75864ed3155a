//! `schedules/moe_infinity.sched` (MoE-Infinity's expert cache, Alg. 1, with EAM
//! prefetching) on the CPU backend: whatever the cache size (from the fewest slots the
//! checker accepts to every expert of the model), eviction policy and predictor, the run
//! gives the oracle's greedy tokens on both tiny cards; a cache smaller than the working
//! set misses and evicts, and its counts agree with the fetch tasks the run executed.

mod schedules_common;
use schedules_common as common;

use moec::compile::{compile, Compiled, Options};
use moec::ir::cache::CacheOp;
use moec::ir::Workload;
use moec::lower::{lower, LowerOptions};
use moec::model::card::ModelCard;
use moec::runtime::{generate, RunOptions};

const GEN: usize = 4;

fn compiled(card: &ModelCard, sets: &[(&str, String)]) -> Result<Compiled, String> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/moe_infinity.sched");
    let source = common::read(&path);
    let mut options = Options::new(card.clone());
    options.workload = Workload {
        batch: 4,
        prompt_len: 12,
        gen_len: GEN as u64,
    };
    options.sets = [("bs", "2".to_string())]
        .into_iter()
        .chain(sets.iter().cloned())
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    compile(&source, &options).map_err(|d| {
        d.iter()
            .find(|d| d.is_error())
            .map_or_else(String::new, |d| {
                format!("{}: {}", d.code.as_str(), d.message)
            })
    })
}

/// The fewest slots a decode step can hold at once with batches of 2: min(experts,
/// 2 x top_k) active experts of a layer, each fetched before any is computed.
fn fewest_slots(card: &ModelCard) -> u64 {
    card.experts.min(2 * card.top_k)
}

#[test]
fn every_cache_size_policy_and_predictor_gives_the_oracle_tokens() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for name in ["mixtral-tiny", "dbrx-tiny"] {
        let card = ModelCard::load(name).expect("card");
        let checkpoint = common::tiny_checkpoint(&card, dir.path());
        let prompts = common::varied_prompts(&card);
        let expected = common::oracle_tokens(&checkpoint, &prompts, GEN);
        let least = fewest_slots(&card);
        let all = card.layers * card.experts;
        let mut configs: Vec<Vec<(&str, String)>> = [least, least + 1, all / 2, all]
            .iter()
            .map(|n| vec![("n_cache", n.to_string())])
            .collect();
        for policy in 0..3 {
            for predictor in 0..3 {
                configs.push(vec![
                    ("n_cache", (least + 1).to_string()),
                    ("policy", policy.to_string()),
                    ("predictor", predictor.to_string()),
                ]);
            }
        }
        configs.push(vec![
            ("n_cache", least.to_string()),
            ("code", "1".to_string()),
        ]);
        // Experts fetched straight from the mapped checkpoint (no pinned home).
        configs.push(vec![
            ("n_cache", least.to_string()),
            ("home", "0".to_string()),
        ]);
        configs.push(vec![
            ("n_cache", (least + 2).to_string()),
            ("lookahead", "3".to_string()),
            ("n_pf", card.experts.to_string()),
        ]);
        for sets in &configs {
            let c = compiled(&card, sets).unwrap_or_else(|e| panic!("{name} {sets:?}: {e}"));
            if let Err(e) = common::run_against_oracle(&c, &checkpoint, &prompts, &expected) {
                panic!("{name} {sets:?}: {e}");
            }
        }
    }
}

#[test]
fn a_cache_smaller_than_the_working_set_misses_and_evicts_and_counts_its_fetches() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let card = ModelCard::load("mixtral-tiny").expect("card");
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts = common::varied_prompts(&card);
    let expected = common::oracle_tokens(&checkpoint, &prompts, GEN);
    let slots = fewest_slots(&card);
    let c = compiled(&card, &[("n_cache", slots.to_string())]).expect("compiles");
    let plan = lower(&c.program, &c.info, &LowerOptions::default()).expect("lowers");
    let mut run = RunOptions::greedy(GEN);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    let (outputs, stats) =
        generate(&plan, &checkpoint, &prompts, &run, &mut |_, _| {}).expect("runs");
    let got: Vec<Vec<u32>> = outputs.into_iter().map(|o| o.token_ids).collect();
    assert_eq!(got, expected, "the oracle's tokens");
    let [cache] = stats.caches.as_slice() else {
        panic!("one cache reported, got {}", stats.caches.len());
    };
    let t = cache.total;
    // Every fetch task that ran is one hit or one miss; prefetches are counted apart.
    let fetches_run = stats
        .steps
        .iter()
        .flat_map(|s| &s.tasks)
        .filter(|r| r.ran && c.program.task(r.task).cache_op == Some(CacheOp::Fetch))
        .count() as u64;
    assert_eq!(t.hits + t.misses, fetches_run, "{t:?}");
    // The records mark the hits (the replay charges them nothing): one per cache hit.
    let hits_recorded = stats
        .steps
        .iter()
        .flat_map(|s| &s.tasks)
        .filter(|r| r.hit)
        .count() as u64;
    assert_eq!(hits_recorded, t.hits, "{t:?}");
    // 2 layers x 8 experts through 4 slots: the working set does not fit.
    assert!(t.misses > slots, "{t:?}");
    // Every copy (miss or prefetch) but the `slots` into empty slots replaced a resident.
    assert_eq!(
        t.evictions,
        t.misses + t.prefetched - slots,
        "evictions {} for {} misses and {} prefetches into {slots} slots",
        t.evictions,
        t.misses,
        t.prefetched
    );
    assert_eq!(
        t.prefetched,
        t.prefetch_used + t.prefetch_wasted,
        "every prefetched expert is used or wasted by the end: {t:?}"
    );
    let per_layer: u64 = cache.layers.iter().map(|l| l.hits + l.misses).sum();
    assert_eq!(per_layer, fetches_run);
}

#[test]
fn a_cache_holding_every_expert_misses_each_expert_at_most_once() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let card = ModelCard::load("dbrx-tiny").expect("card");
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts = common::varied_prompts(&card);
    let all = card.layers * card.experts;
    // No prefetch: with room for the whole model nothing is ever evicted, so each
    // (layer, expert) is copied once, on its first fetch.
    let sets = [("n_cache", all.to_string()), ("n_pf", "0".to_string())];
    let c = compiled(&card, &sets).expect("compiles");
    let plan = lower(&c.program, &c.info, &LowerOptions::default()).expect("lowers");
    let mut run = RunOptions::greedy(GEN);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    let (_, stats) = generate(&plan, &checkpoint, &prompts, &run, &mut |_, _| {}).expect("runs");
    let t = stats.caches[0].total;
    assert_eq!(t.evictions, 0, "{t:?}");
    assert!(t.misses <= all, "{t:?}");
    assert!(t.hits > 0, "{t:?}");
}

/// The acceptance setting: on Mixtral-8x7B and DBRX with a 24 GB GPU profile (Quadro RTX
/// 6000, MoE-Infinity's personal-machine class) the schedule checks with its default cache
/// (as many slots as fit) and its memory fits the profile's budget; the cache has more
/// slots than one token needs and fewer than the model's experts.
#[test]
fn checks_on_mixtral_and_dbrx_and_fits_a_24_gb_gpu() {
    use moec::cost::budget::{check_budget, BudgetOverrides};
    use moec::cost::hardware::HardwareProfile;
    let hw = HardwareProfile::load("quadro-rtx6000").expect("profile");
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/moe_infinity.sched");
    let source = common::read(&path);
    for name in ["mixtral-8x7b", "dbrx"] {
        let card = ModelCard::load(name).expect("card");
        let mut options = Options::new(card.clone());
        options.workload = Workload {
            batch: 1,
            prompt_len: 512,
            gen_len: 32,
        };
        options.hardware = hw
            .symbols()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{name}: {}", d[0]));
        let cache = &compiled.program.caches[0];
        assert!(
            u64::from(cache.slots) >= card.top_k
                && u64::from(cache.slots) < card.layers * card.experts,
            "{name}: {} slots",
            cache.slots
        );
        if let Err(e) = check_budget(&compiled.program, Some(&hw), &BudgetOverrides::default()) {
            panic!("{name}: {e}");
        }
    }
}
