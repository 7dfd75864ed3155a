//! Expected activation: how often a guarded task runs, and how much of its declared work
//! it does when it runs, under a routing model.
//!
//! Takes a program (its guards, micro-batch sizes and, if it was compiled with a routing
//! profile, each expert's share of the tokens) and a task; gives [`Activation`]: the
//! probability its guard holds and the expected share of its declared FLOPs. The routing
//! model: each of the n tokens of a micro-batch routes to expert e of layer l
//! independently with probability q (`top_k / experts`, or the profile's share; a
//! run-time rank `hot(l, r)` takes the r-th largest share), so the tokens an expert gets
//! are Binomial(n, q); counts of different experts or micro-batches are treated as
//! independent. A guard is a conjunction of "count >= t" literals, so per count it is an
//! interval and its probability a binomial sum. Guarantees: both figures are in [0, 1];
//! an unguarded task runs with probability 1 and its full work; arms that partition a
//! count have probabilities summing to the probability of the partitioned event.
//!
//! An `experts` task's declared FLOPs are its expert's mean routed tokens (the catalog's
//! uniform-routing figure); run under a guard on its own count in [lo, hi), it does
//! E[N; lo <= N < hi] of them, which is n q P(lo - 1 <= M < hi - 1) for M ~ Binomial(n -
//! 1, q) (the size-biased identity), so its work share is that probability times the
//! probability of the guard's other literals.

use crate::ir::catalog::{ExpertRef, ExpertSet};
use crate::ir::FastMap;
use crate::ir::{GuardAtom, GuardLit, Op, Program, TaskId};
use serde::Serialize;

/// The probability that a fetch or prefetch task finds its expert not resident (`None`
/// for any other task), from [`cache_hits`].
fn cache_miss(
    program: &Program,
    id: TaskId,
    tokens_per_ub: u64,
    memo: &mut ActivationMemo,
) -> Option<f64> {
    let task = program.task(id);
    task.cache_op?;
    let key = task.args.iter().find_map(|a| a.slice.cache_key)?;
    // A fetch guarded by its own key's residency is a hit whenever it runs.
    let own_hit = GuardAtom::Resident {
        cache: key.cache,
        layer: key.layer,
        expert: key.expert,
    };
    if task
        .guard
        .lits
        .iter()
        .any(|l| !l.negated && l.atom == own_hit)
    {
        return Some(0.0);
    }
    if task.cache_op == Some(crate::ir::cache::CacheOp::Fetch)
        && lookahead_prefetched(program, task.step, key.cache, key.layer)
    {
        return Some(0.0);
    }
    // A prefetch ranked without the layer's routing (`eam`, `cooccurrence`, ...): it
    // copies its pick when that is not resident, if it finds room; a repeat of an
    // earlier prefetch of the step finds its key resident.
    if task.cache_op == Some(crate::ir::cache::CacheOp::Prefetch) {
        if let Some(plan) = prefetch_plan(program, task.step, key.cache, tokens_per_ub, memo) {
            if plan.repeats.contains(&id) {
                return Some(0.0);
            }
            let (room, pick) = (plan.room, plan.pick(program, key.layer, key.expert));
            let hits = cache_hits_memo(program, key.cache, tokens_per_ub, memo);
            let resident: f64 = hits
                .per_key
                .get(key.layer as usize)
                .map_or(0.0, |h| h.iter().zip(&pick).map(|(h, p)| h * p).sum());
            return Some((room * (1.0 - resident)).clamp(0.0, 1.0));
        }
    }
    let hit = hit_rate(
        program,
        key.cache,
        key.layer,
        key.expert,
        tokens_per_ub,
        memo,
    );
    // A fetch whose expert a prefetch of the step may have copied already.
    let credit = prefetch_credit(program, task.step, key, tokens_per_ub, memo);
    Some((1.0 - hit) * (1.0 - credit))
}

/// The step's prefetch plan for `cache` ([`super::prefetch::plan`]), computed once per
/// step, cache and load.
fn prefetch_plan<'m>(
    program: &Program,
    step: crate::ir::StepId,
    cache: u32,
    tokens_per_ub: u64,
    memo: &'m mut ActivationMemo,
) -> Option<&'m super::prefetch::PrefetchPlan> {
    memo.prefetch
        .entry((step.index(), cache, tokens_per_ub))
        .or_insert_with(|| super::prefetch::plan(program, step, cache, tokens_per_ub))
        .as_ref()
}

/// The probability a fetch of `key` in `step` finds its expert prefetched by the step,
/// where it is not resident otherwise (0 without such prefetches).
fn prefetch_credit(
    program: &Program,
    step: crate::ir::StepId,
    key: crate::ir::cache::CacheKey,
    tokens_per_ub: u64,
    memo: &mut ActivationMemo,
) -> f64 {
    prefetch_plan(program, step, key.cache, tokens_per_ub, memo)
        .map_or(0.0, |p| p.credit(key.layer, key.expert))
}

/// [`cache_hits`] of `cache` at a load, solved once per memo.
fn cache_hits_memo<'m>(
    program: &Program,
    cache: u32,
    tokens_per_ub: u64,
    memo: &'m mut ActivationMemo,
) -> &'m CacheHits {
    memo.hits
        .entry((cache, tokens_per_ub))
        .or_insert_with(|| cache_hits(program, cache, tokens_per_ub))
}

/// The probability that a prefetch of a `lookahead` cache's `predicted(l, r)` copies
/// anything (`None` for any other task): the runtime skips it unless the step's pregates
/// of layer `l` (one per micro-batch, `n` tokens in all) selected at least `r + 1`
/// distinct experts. Each token selects `top_k` distinct experts, so at least
/// `min(experts, top_k)` are selected (any token at all) and at most `min(experts, n x
/// top_k)`; in between, the count of distinct experts is the routing model's: expert e
/// is selected with probability 1 - (1 - q_e)^n, independently (a Poisson binomial).
fn lookahead_selected(program: &Program, id: TaskId, tokens_per_ub: u64) -> Option<f64> {
    let task = program.task(id);
    if task.cache_op != Some(crate::ir::cache::CacheOp::Prefetch) {
        return None;
    }
    let key = task.args.iter().find_map(|a| a.slice.cache_key)?;
    let ExpertRef::Predicted { layer, rank, .. } = key.expert else {
        return None;
    };
    let cache = program.caches.get(key.cache as usize)?;
    if cache.predictor != crate::ir::cache::Predictor::Lookahead {
        return None;
    }
    let card = &program.model;
    let n = tokens_per_ub.saturating_mul(u64::from(program.micro_batches.count.max(1)));
    let need = u64::from(rank) + 1;
    let (experts, k) = (card.experts, card.top_k.max(1));
    if n == 0 || card.is_dense_layer(u64::from(layer)) {
        return Some(0.0);
    }
    if need <= experts.min(k) {
        return Some(1.0);
    }
    if need > experts.min(n.saturating_mul(k)) {
        return Some(0.0);
    }
    // P(D >= need) for D the number of selected experts: a Poisson binomial by dynamic
    // programming over the experts (dist[d] = P(d selected so far)).
    let mut dist = vec![0.0f64; experts as usize + 1];
    dist[0] = 1.0;
    for (e, seen) in (0..experts as u32).zip(0usize..) {
        let q = share(program, layer, ExpertRef::Index(e));
        let p = 1.0 - (1.0 - q).powf(n as f64);
        for d in (0..=seen + 1).rev() {
            let stay = dist[d] * (1.0 - p);
            let came = if d > 0 { dist[d - 1] * p } else { 0.0 };
            dist[d] = stay + came;
        }
    }
    let at_least: f64 = dist.iter().skip(need as usize).sum();
    // The Poisson binomial ignores that every token selects `top_k`: condition on D being
    // at least that floor, which the real routing always reaches.
    let floor: f64 = dist.iter().skip(experts.min(k) as usize).sum();
    Some(if floor > 0.0 {
        (at_least / floor).clamp(0.0, 1.0)
    } else {
        1.0
    })
}

/// Whether step `step` prefetches `CACHE.predicted(layer, ..)` into `cache` and the cache's
/// predictor is `lookahead`: then a fetch of that layer finds its expert prefetched, as
/// far as the pregate selects what the gate selects. The cost model takes it that it does
/// (Pre-gated MoE's fine-tuned pre-gate; an upper bound for the inference-time form),
/// and `moec simulate` says so; `moec run` reports the measured accuracy.
pub fn lookahead_prefetched(
    program: &Program,
    step: crate::ir::StepId,
    cache: u32,
    layer: u32,
) -> bool {
    let Some(c) = program.caches.get(cache as usize) else {
        return false;
    };
    if c.predictor != crate::ir::cache::Predictor::Lookahead {
        return false;
    }
    let Some(s) = program.steps.get(step.index()) else {
        return false;
    };
    s.task_ids().any(|id| {
        let t = program.task(id);
        t.cache_op == Some(crate::ir::cache::CacheOp::Prefetch)
            && t.args.iter().any(|a| {
                a.slice.cache_key.is_some_and(|k| {
                    k.cache == cache
                        && matches!(k.expert, ExpertRef::Predicted { layer: l, .. } if l == layer)
                })
            })
    })
}

/// The probability that `expert` of `layer` is resident in `cache`, from [`cache_hits`].
fn hit_rate(
    program: &Program,
    cache: u32,
    layer: u32,
    expert: ExpertRef,
    tokens_per_ub: u64,
    memo: &mut ActivationMemo,
) -> f64 {
    let hits = cache_hits_memo(program, cache, tokens_per_ub, memo);
    let hit = match expert {
        ExpertRef::Index(e) => hits
            .per_key
            .get(layer as usize)
            .and_then(|r| r.get(e as usize))
            .copied(),
        // A run-time expert: the layer's mean over its requests.
        _ => hits.layer_rate.get(layer as usize).copied(),
    };
    hit.unwrap_or(0.0).clamp(0.0, 1.0)
}

/// A token-count or score literal's threshold as a token count. A score is modelled as
/// the uniform router gives it: every token routed to an expert weighs `1 / top_k`, so
/// `score_max >= t` holds for an active expert when `t <= 1 / top_k` (never otherwise)
/// and `score_sum >= t` when at least `ceil(t x top_k)` tokens route to it.
fn token_threshold(program: &Program, a: &GuardAtom) -> u64 {
    match *a {
        GuardAtom::Score {
            kind,
            at_least_bits,
            ..
        } => {
            let k = program.model.top_k.max(1) as f64;
            let t = f64::from(f32::from_bits(at_least_bits));
            match kind {
                crate::ir::ScoreKind::Max if t * k <= 1.0 => 1,
                crate::ir::ScoreKind::Max => u64::MAX,
                crate::ir::ScoreKind::Sum => (t * k).ceil().max(1.0) as u64,
            }
        }
        _ => u64::from(a.threshold()),
    }
}

/// The predicted steady-state hit rate of an expert cache.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CacheHits {
    /// `per_key[layer][expert]`: probability a fetch of that expert hits.
    pub per_key: Vec<Vec<f64>>,
    /// Per layer, hits over fetches.
    pub layer_rate: Vec<f64>,
    /// Hits over fetches, every layer.
    pub rate: f64,
}

/// The steady-state hit rate of cache `cache` when every micro-batch of a step holds
/// `tokens_per_ub` tokens, under the independent reference model: expert e of layer l is
/// fetched r = ubs x (1 - (1 - q)^n) times a step (q its share of tokens, as in
/// [`activation`]); with N slots, LRU as [`lru_first_fetch_hits`] gives it (decode visits
/// the layers in order every step, so reuse distances are not those of independent
/// references: Che's approximation, used here before, predicted 21% hits for 55 slots of
/// Mixtral-8x7B's 256 experts at batch 1, where the run hit none); LFU keeps the N
/// keys fetched most often; the activation-aware policy the N with the highest
/// r x (1 - l / L) (its score with the profile's activation standing in for the
/// predictor's). These are the fetches' own hits: what a step's prefetches add is
/// [`super::prefetch`]'s (lookahead gating's, [`lookahead_prefetched`]), and the
/// prefetched experts' slots are not taken from the fetches' steady state.
pub fn cache_hits(program: &Program, cache: u32, tokens_per_ub: u64) -> CacheHits {
    use crate::ir::cache::EvictPolicy;
    let card = &program.model;
    let (layers, experts) = (card.layers as usize, card.experts as usize);
    let ubs = f64::from(program.micro_batches.count.max(1));
    let rate: Vec<Vec<f64>> = (0..layers)
        .map(|l| {
            (0..experts)
                .map(|e| {
                    let q = share(program, l as u32, ExpertRef::Index(e as u32));
                    ubs * (1.0 - (1.0 - q).powf(tokens_per_ub as f64))
                })
                .collect()
        })
        .collect();
    let Some(c) = program.caches.get(cache as usize) else {
        return CacheHits {
            per_key: vec![vec![0.0; experts]; layers],
            layer_rate: vec![0.0; layers],
            rate: 0.0,
        };
    };
    let slots = f64::from(c.slots);
    let keys = (layers * experts) as f64;
    let mut hit = vec![vec![0.0; experts]; layers];
    if slots >= keys {
        hit = vec![vec![1.0; experts]; layers];
    } else {
        match c.policy {
            EvictPolicy::Lru => {
                let used: Vec<Vec<f64>> = (0..layers)
                    .map(|l| {
                        (0..experts)
                            .map(|e| {
                                let q = share(program, l as u32, ExpertRef::Index(e as u32));
                                1.0 - (1.0 - q).powf(tokens_per_ub as f64 * ubs)
                            })
                            .collect()
                    })
                    .collect();
                let first = lru_first_fetch_hits(&used, c.slots);
                for l in 0..layers {
                    for e in 0..experts {
                        let (p, r) = (used[l][e], rate[l][e]);
                        // The step's later fetches of a key (other micro-batches) follow
                        // its first within one layer's visit: hits.
                        hit[l][e] = if r > 0.0 {
                            ((p * first[l][e] + (r - p).max(0.0)) / r).clamp(0.0, 1.0)
                        } else {
                            0.0
                        };
                    }
                }
            }
            EvictPolicy::Lfu | EvictPolicy::Activation | EvictPolicy::Score => {
                let mut order: Vec<(usize, usize, f64)> = (0..layers)
                    .flat_map(|l| (0..experts).map(move |e| (l, e)))
                    .map(|(l, e)| {
                        let decay = if c.policy == EvictPolicy::Activation {
                            1.0 - l as f64 / layers.max(1) as f64
                        } else {
                            1.0
                        };
                        (l, e, rate[l][e] * decay)
                    })
                    .collect();
                order.sort_by(|a, b| b.2.total_cmp(&a.2));
                for &(l, e, _) in order.iter().take(c.slots as usize) {
                    hit[l][e] = 1.0;
                }
            }
        }
    }
    let weighted = |l: usize| -> (f64, f64) {
        rate[l]
            .iter()
            .zip(&hit[l])
            .fold((0.0, 0.0), |(h, n), (r, x)| (h + r * x, n + r))
    };
    let layer_rate: Vec<f64> = (0..layers)
        .map(|l| {
            let (h, n) = weighted(l);
            if n > 0.0 {
                h / n
            } else {
                0.0
            }
        })
        .collect();
    let (h, n) = (0..layers)
        .map(weighted)
        .fold((0.0, 0.0), |(a, b), (h, n)| (a + h, b + n));
    CacheHits {
        per_key: hit,
        layer_rate,
        rate: if n > 0.0 { h / n } else { 0.0 },
    }
}

/// LRU's hit probability for the first fetch of each key in a step, when every step
/// visits the layers in order and key (l, e) is used in a step with probability
/// `used[l][e]`, independently across keys and steps. The key is still cached at its next
/// use, g steps later (probability u (1 - u)^(g - 1)), iff fewer than `slots` other keys
/// were used in between: every key of the other layers over g visits of theirs and the
/// other keys of its own layer over g - 1, in expectation
/// D(g) = sum over other layers' keys of 1 - (1 - u')^g + sum over its layer's other
/// keys of 1 - (1 - u')^(g - 1). D grows with g, so the key hits for g <= G, the largest
/// g with D(g) < slots: a hit probability of 1 - (1 - u)^G. Worked by hand for Mixtral at
/// batch 1 (u = 1/4 for all 256 keys): D(1) = 31 x 2 = 62, D(2) = 31 x 3.5 + 7 x 0.25 =
/// 110.25, D(3) = 31 x 4.625 + 7 x 0.4375 = 146.4; 55 slots: G = 0, no hits; 64 or 110
/// slots: G = 1, 25%; 129 slots: G = 2, 43.75% (the run: 990 hits of 2,230 fetches,
/// 44%). Gaps past 4,096 steps count as hits (only keys used less than once in ~1,000
/// steps reach them).
pub fn lru_first_fetch_hits(used: &[Vec<f64>], slots: u32) -> Vec<Vec<f64>> {
    const MAX_GAP: u32 = 4096;
    let slots = f64::from(slots);
    // stay[l][e] = (1 - u)^g for the gap g being tried.
    let mut stay: Vec<Vec<f64>> = used
        .iter()
        .map(|row| row.iter().map(|u| 1.0 - u.clamp(0.0, 1.0)).collect())
        .collect();
    let mut gap: Vec<Vec<Option<u32>>> = used.iter().map(|row| vec![None; row.len()]).collect();
    // Own-layer terms for g - 1 (g = 1: none of the layer's other keys were used).
    let mut before: Vec<Vec<f64>> = used.iter().map(|row| vec![0.0; row.len()]).collect();
    for g in 1..=MAX_GAP {
        let layer_sum: Vec<f64> = stay
            .iter()
            .map(|row| row.iter().map(|s| 1.0 - s).sum())
            .collect();
        let total: f64 = layer_sum.iter().sum();
        let mut open = false;
        for (l, row) in gap.iter_mut().enumerate() {
            let own: f64 = before[l].iter().sum();
            for (e, g_of) in row.iter_mut().enumerate() {
                if g_of.is_some() {
                    continue;
                }
                let distinct = total - layer_sum[l] + own - before[l][e];
                if distinct >= slots {
                    *g_of = Some(g - 1);
                } else {
                    open = true;
                }
            }
        }
        if !open {
            break;
        }
        for (l, row) in stay.iter_mut().enumerate() {
            for (e, s) in row.iter_mut().enumerate() {
                before[l][e] = 1.0 - *s;
                *s *= 1.0 - used[l][e].clamp(0.0, 1.0);
            }
        }
    }
    used.iter()
        .zip(&gap)
        .map(|(row, gaps)| {
            row.iter()
                .zip(gaps)
                .map(|(u, g)| {
                    let u = u.clamp(0.0, 1.0);
                    match g {
                        Some(g) => 1.0 - (1.0 - u).powi(*g as i32),
                        None => 1.0,
                    }
                })
                .collect()
        })
        .collect()
}

/// How often a task runs and how much of its declared work it does on average.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Activation {
    /// Probability that its guard holds (1 for an unguarded task).
    pub runs: f64,
    /// Expected share of its declared FLOPs (and activation traffic).
    pub work: f64,
}

impl Activation {
    /// An unguarded task.
    pub const ALWAYS: Activation = Activation {
        runs: 1.0,
        work: 1.0,
    };
}

/// A routed count: (layer, expert, micro-batch or all).
type Var = (u32, ExpertRef, Option<u32>);

/// What [`activation_memo`] keeps between the tasks of one program: each cache's hit
/// rates per micro-batch load ([`cache_hits`] solves over every layer and expert, the same
/// for every fetch of that cache).
#[derive(Debug, Default)]
pub struct ActivationMemo {
    hits: FastMap<(u32, u64), CacheHits>,
    /// [`binomial_between`] by `(n, q's bits, lo, hi)`: every expert of a step asks the
    /// same few (one share without a profile, one token count, one threshold per arm),
    /// and a sum runs over up to `n` terms.
    binomials: FastMap<(u64, u64, u64, u64), f64>,
    /// [`super::prefetch::plan`] by `(step, cache, tokens per micro-batch)`.
    prefetch: FastMap<(usize, u32, u64), Option<super::prefetch::PrefetchPlan>>,
}

impl ActivationMemo {
    fn binomial_between(&mut self, n: u64, q: f64, lo: u64, hi: u64) -> f64 {
        *self
            .binomials
            .entry((n, q.to_bits(), lo, hi))
            .or_insert_with(|| binomial_between(n, q, lo, hi))
    }
}

/// The expected activation of task `id` when every micro-batch holds `tokens_per_ub`
/// tokens.
pub fn activation(program: &Program, id: TaskId, tokens_per_ub: u64) -> Activation {
    activation_memo(program, id, tokens_per_ub, &mut ActivationMemo::default())
}

/// [`activation`], keeping in `memo` what other tasks of the same program reuse; the
/// memo must only ever see one program.
pub fn activation_memo(
    program: &Program,
    id: TaskId,
    tokens_per_ub: u64,
    memo: &mut ActivationMemo,
) -> Activation {
    let task = program.task(id);
    if task.guard.is_always() {
        // An unguarded lookahead prefetch still copies only a selected expert.
        if let Some(p) = lookahead_selected(program, id, tokens_per_ub) {
            return Activation { runs: p, work: p };
        }
        // An unguarded prefetch ranked without its layer's routing copies its pick only
        // when that is not resident and it finds room (lookahead gating's prefetches are
        // charged as above, as before).
        let ranked = task.cache_op == Some(crate::ir::cache::CacheOp::Prefetch)
            && task
                .args
                .iter()
                .find_map(|a| a.slice.cache_key)
                .is_some_and(|k| {
                    prefetch_plan(program, task.step, k.cache, tokens_per_ub, memo).is_some()
                });
        if ranked {
            if let Some(miss) = cache_miss(program, id, tokens_per_ub, memo) {
                return Activation {
                    runs: miss,
                    work: miss,
                };
            }
        }
        return Activation::ALWAYS;
    }
    let ubs = u64::from(program.micro_batches.count.max(1));
    // Interval [lo, hi) of each count the guard reads: a guard reads a few, so a list
    // (sorted by count below, the order a map by count would give the product).
    let mut intervals: smallvec::SmallVec<[(Var, (u64, u64)); 4]> = smallvec::SmallVec::new();
    // A residency literal's probability: the cache model's hit rate of its key.
    let mut resident = 1.0;
    for lit in &task.guard.lits {
        let a = lit.atom;
        if let GuardAtom::Resident {
            cache,
            layer,
            expert,
        } = a
        {
            let hit = hit_rate(program, cache, layer, expert, tokens_per_ub, memo);
            let key = crate::ir::cache::CacheKey {
                cache,
                layer,
                expert,
            };
            let credit = prefetch_credit(program, task.step, key, tokens_per_ub, memo);
            let hit = hit + (1.0 - hit) * credit;
            resident *= if lit.negated { 1.0 - hit } else { hit };
            continue;
        }
        let var = (a.layer(), a.expert(), a.ub());
        let at = match intervals.iter().position(|(v, _)| *v == var) {
            Some(at) => at,
            None => {
                intervals.push((var, (0, u64::MAX)));
                intervals.len() - 1
            }
        };
        let entry = &mut intervals[at].1;
        let t = token_threshold(program, &a);
        if lit.negated {
            entry.1 = entry.1.min(t);
        } else {
            entry.0 = entry.0.max(t);
        }
    }
    // The count whose tokens an `experts` task computes.
    let own: Option<Var> = match task.op {
        Op::Experts {
            layer,
            ub,
            set: ExpertSet::One(e),
        } => Some((layer, e, Some(ub))),
        _ => None,
    };
    let mut runs = 1.0;
    let mut work = 1.0;
    let mut own_seen = false;
    intervals.sort_unstable_by_key(|a| a.0);
    for &((layer, expert, ub), (lo, hi)) in &intervals {
        let n = match ub {
            Some(_) => tokens_per_ub,
            None => tokens_per_ub.saturating_mul(ubs),
        };
        let q = share(program, layer, expert);
        let p = memo.binomial_between(n, q, lo, hi);
        runs *= p;
        if own == Some((layer, expert, ub)) && n > 0 {
            own_seen = true;
            work *= memo.binomial_between(n - 1, q, lo.saturating_sub(1), hi.saturating_sub(1));
        } else {
            work *= p;
        }
    }
    if own.is_some() && !own_seen {
        // The guard reads other counts only: the task does its mean work when it runs.
        work = runs;
    }
    runs *= resident;
    work *= resident;
    // A lookahead prefetch copies only an expert the pregates selected.
    if let Some(selected) = lookahead_selected(program, id, tokens_per_ub) {
        runs *= selected;
        work *= selected;
    }
    // A fetch or prefetch copies only when its expert is not resident.
    if let Some(miss) = cache_miss(program, id, tokens_per_ub, memo) {
        runs *= miss;
        work *= miss;
    }
    Activation {
        runs: runs.clamp(0.0, 1.0),
        work: work.clamp(0.0, 1.0),
    }
}

/// The kind of guard a task has, with layers, experts and micro-batches left out, so the
/// tasks of one arm group together: `experts on cpu if active && routed < 9`.
pub fn arm_key(program: &Program, id: TaskId) -> String {
    let task = program.task(id);
    let lit = |l: &GuardLit| match (l.atom, l.negated) {
        (GuardAtom::Active { .. }, false) => "active".to_string(),
        (GuardAtom::Active { .. }, true) => "!active".to_string(),
        (GuardAtom::Tokens { at_least, .. }, false) => format!("routed >= {at_least}"),
        (GuardAtom::Tokens { at_least, .. }, true) => format!("routed < {at_least}"),
        (GuardAtom::Resident { .. }, false) => "resident".to_string(),
        (GuardAtom::Resident { .. }, true) => "!resident".to_string(),
        (
            GuardAtom::Score {
                kind,
                at_least_bits,
                ..
            },
            negated,
        ) => format!(
            "{} {} {}",
            kind.as_str(),
            if negated { "<" } else { ">=" },
            f32::from_bits(at_least_bits)
        ),
    };
    let mut lits: Vec<String> = task.guard.lits.iter().map(lit).collect();
    lits.dedup();
    format!(
        "{} on {} if {}",
        task.cache_op.map_or(task.op.def().name, |c| c.as_str()),
        program.stream(task.stream).name,
        lits.join(" && ")
    )
}

/// The probability a token routes to `expert` of `layer`.
pub(super) fn share(program: &Program, layer: u32, expert: ExpertRef) -> f64 {
    let card = &program.model;
    // No token is routed to an expert of a leading dense layer.
    if card.is_dense_layer(u64::from(layer)) {
        return 0.0;
    }
    let uniform = (card.top_k as f64 / card.experts.max(1) as f64).min(1.0);
    let Some(shares) = program
        .expert_shares
        .as_ref()
        .and_then(|s| s.get(layer as usize))
    else {
        return uniform;
    };
    match expert {
        ExpertRef::Index(e) => shares.get(e as usize).copied().unwrap_or(uniform),
        // A prediction ranks like the hot order: its share is the rank-th largest.
        ExpertRef::Hot { rank, .. } | ExpertRef::Predicted { rank, .. } => {
            let mut sorted = shares.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted.get(rank as usize).copied().unwrap_or(uniform)
        }
    }
}

/// P(lo <= N < hi) for N ~ Binomial(n, q), summing whichever side is shorter in log
/// space (no underflow for large n).
pub fn binomial_between(n: u64, q: f64, lo: u64, hi: u64) -> f64 {
    let hi = hi.min(n.saturating_add(1));
    if lo >= hi {
        return 0.0;
    }
    if q <= 0.0 {
        return if lo == 0 { 1.0 } else { 0.0 };
    }
    if q >= 1.0 {
        return if lo <= n && n < hi { 1.0 } else { 0.0 };
    }
    // P(N < t) = sum_{k < t} pmf(k); only the terms below the larger bound are needed.
    let below = |t: u64| -> f64 {
        if t == 0 {
            return 0.0;
        }
        if t > n {
            return 1.0;
        }
        let (ln_q, ln_p) = (q.ln(), (1.0 - q).ln());
        let mut ln_pmf = n as f64 * ln_p;
        let mut sum = ln_pmf.exp();
        for k in 0..t - 1 {
            ln_pmf += ((n - k) as f64 / (k + 1) as f64).ln() + ln_q - ln_p;
            sum += ln_pmf.exp();
        }
        sum.min(1.0)
    };
    (below(hi) - below(lo)).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_intervals_match_hand_arithmetic() {
        // n = 2, q = 1/4: P(0) = 9/16, P(1) = 6/16, P(2) = 1/16.
        let p = |lo, hi| binomial_between(2, 0.25, lo, hi);
        assert!((p(0, 1) - 9.0 / 16.0).abs() < 1e-12);
        assert!((p(1, 2) - 6.0 / 16.0).abs() < 1e-12);
        assert!((p(1, u64::MAX) - 7.0 / 16.0).abs() < 1e-12);
        assert!((p(2, 3) - 1.0 / 16.0).abs() < 1e-12);
        assert_eq!(p(3, u64::MAX), 0.0);
        // Arms >= t and < t partition "active".
        let active = binomial_between(40, 0.25, 1, u64::MAX);
        let copy = binomial_between(40, 0.25, 10, u64::MAX);
        let cpu = binomial_between(40, 0.25, 1, 10);
        assert!((copy + cpu - active).abs() < 1e-12);
        // Large n does not underflow: the mean 2500 is far above 10.
        assert!((binomial_between(10_000, 0.25, 10, u64::MAX) - 1.0).abs() < 1e-9);
    }
}
