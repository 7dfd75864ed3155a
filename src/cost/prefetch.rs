//! What the prefetches of an expert cache earn when their predictor ranks experts without
//! the layer's own routing: `predict "eam"`, `"cooccurrence"`, `"layer_order"` and
//! `hot(..)` (lookahead gating, which sees a pregate's routing, is modelled in
//! [`super::activation`]).
//!
//! Takes a program, a step, a cache and the tokens of a micro-batch; gives a
//! [`PrefetchPlan`]: per layer the step prefetches into the cache, the probability that
//! each expert is among the prefetched ones (`chosen`), the share of prefetches that find
//! a slot and keep it until their layer's fetches (`room`), and the prefetch tasks that
//! repeat an earlier one of the same key (a no-op: the key is resident by then).
//!
//! The predictor's ranking is modelled by what it is given: the routing profile's share
//! of each expert (or uniform routing, `top_k / experts`, without a profile).
//! `layer_order` ranks experts by index. `eam`, `cooccurrence` and `hot(..)` rank them by
//! the profile's shares, the order their collected counts converge to under the
//! independent routing model of [`super::activation`] (the model has no per-request or
//! cross-layer correlation, so no predictor can beat that order in it). Experts of equal
//! share are a tie the predictor breaks by what it saw, which under this model is
//! independent of the routing: each tied expert takes an equal part of the tied ranks.
//! So with uniform routing a prefetch of `n` ranks holds a routed expert with probability
//! `n / experts`, the accuracy of a guess.
//!
//! A fetch of expert e of a prefetched layer then copies with probability
//! `(1 - h_e)(1 - room x chosen_e)`, `h_e` the steady-state hit rate of
//! [`super::activation::cache_hits`] (the fetches' own). Guarantees: `chosen` is in
//! [0, 1] per expert and sums to at most the layer's distinct prefetched ranks; `room` is
//! in [0, 1]. Not modelled: a prefetch skipped while an on-demand fetch waits, one
//! cancelled once its layer's routing is known, and a fetch that finds its expert still
//! being copied by a prefetch (it is charged as a hit).

use super::activation::share;
use crate::ir::cache::{CacheOp, Predictor};
use crate::ir::catalog::ExpertRef;
use crate::ir::{Op, Program, StepId, TaskId};
use std::collections::{BTreeSet, HashSet};

/// What one step's prefetches into one cache earn, see the module docs.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefetchPlan {
    /// `chosen[layer][expert]`: the probability the expert is among those prefetched for
    /// that layer; `None` for a layer the step prefetches nothing of.
    pub chosen: Vec<Option<Vec<f64>>>,
    /// The most distinct keys prefetched for one layer.
    pub per_layer: u32,
    /// The most layers between a prefetch's target and the layer whose routing was last
    /// known when it was issued (1: the next layer).
    pub distance: u32,
    /// Share of prefetches that find a slot and keep it until their layer is fetched:
    /// `(slots - held) / (per_layer x distance)` clamped to [0, 1], `held` the slots one
    /// layer's fetches hold at once (`min(experts, tokens x top_k)`).
    pub room: f64,
    /// Prefetches of a key an earlier prefetch of the step already copied.
    pub repeats: HashSet<TaskId>,
    /// How the predictor's ranking was modelled, for the report.
    pub ranking: &'static str,
}

impl PrefetchPlan {
    /// The probability a fetch of `expert` of `layer` finds it prefetched, given it is not
    /// resident otherwise (0 for a layer the step prefetches nothing of).
    pub fn credit(&self, layer: u32, expert: ExpertRef) -> f64 {
        let Some(Some(row)) = self.chosen.get(layer as usize) else {
            return 0.0;
        };
        let p = match expert {
            ExpertRef::Index(e) => row.get(e as usize).copied().unwrap_or(0.0),
            // A run-time expert: the layer's mean over its experts.
            _ => row.iter().sum::<f64>() / row.len().max(1) as f64,
        };
        (self.room * p).clamp(0.0, 1.0)
    }

    /// Per expert of `layer`, the probability that a prefetch of `expert` (a ranked
    /// prediction or an index) copies that one.
    pub fn pick(&self, program: &Program, layer: u32, expert: ExpertRef) -> Vec<f64> {
        pick(program, expert, layer)
    }
}

/// The ranking a prefetch's expert reference is chosen by, if it is a ranked prediction:
/// `Some(predictor)` for `predicted(..)` of a cache whose predictor does not see the
/// layer's routing and for `hot(..)` (co-occurrence), `None` otherwise.
fn ranked_by(program: &Program, expert: ExpertRef) -> Option<Predictor> {
    match expert {
        ExpertRef::Predicted { cache, .. } => {
            let p = program.caches.get(cache as usize)?.predictor;
            (p != Predictor::Lookahead).then_some(p)
        }
        ExpertRef::Hot { .. } => Some(Predictor::Cooccurrence),
        ExpertRef::Index(_) => None,
    }
}

/// `row[expert]`: the probability that `predictor` ranks `expert` of `layer` at `rank`,
/// see the module docs (experts of equal share split their ranks equally).
pub fn rank_row(program: &Program, predictor: Predictor, layer: u32, rank: u32) -> Vec<f64> {
    let experts = program.model.experts as usize;
    let mut row = vec![0.0; experts];
    let rank = rank as usize;
    if rank >= experts {
        return row;
    }
    if predictor == Predictor::LayerOrder {
        row[rank] = 1.0;
        return row;
    }
    let shares: Vec<f64> = (0..experts as u32)
        .map(|e| share(program, layer, ExpertRef::Index(e)))
        .collect();
    let mut order: Vec<usize> = (0..experts).collect();
    order.sort_by(|&a, &b| shares[b].total_cmp(&shares[a]).then(a.cmp(&b)));
    // The tie group holding position `rank`.
    let at = shares[order[rank]];
    let tied: Vec<usize> = order.iter().copied().filter(|&e| shares[e] == at).collect();
    for &e in &tied {
        row[e] = 1.0 / tied.len() as f64;
    }
    row
}

/// The probability `expert` of `layer` (a ranked prediction, or an index) is the one a
/// prefetch of it copies: `m[rank]` of its ranking, or the index itself.
fn pick(program: &Program, expert: ExpertRef, layer: u32) -> Vec<f64> {
    let experts = program.model.experts as usize;
    match (expert, ranked_by(program, expert)) {
        (ExpertRef::Index(e), _) => {
            let mut row = vec![0.0; experts];
            if let Some(x) = row.get_mut(e as usize) {
                *x = 1.0;
            }
            row
        }
        (ExpertRef::Predicted { rank, .. } | ExpertRef::Hot { rank, .. }, Some(predictor)) => {
            rank_row(program, predictor, layer, rank)
        }
        _ => vec![0.0; experts],
    }
}

/// The prefetches of `step` into `cache` when a micro-batch holds `tokens_per_ub` tokens;
/// `None` when the cache's predictor is lookahead gating (see [`super::activation`]) or
/// the step prefetches nothing into it.
pub fn plan(
    program: &Program,
    step: StepId,
    cache: u32,
    tokens_per_ub: u64,
) -> Option<PrefetchPlan> {
    let c = program.caches.get(cache as usize)?;
    if c.predictor == Predictor::Lookahead {
        return None;
    }
    let s = program.steps.get(step.index())?;
    let card = &program.model;
    let layers = card.layers as usize;
    // Distinct keys per layer, the first prefetch of each, and the distance from the
    // layer whose routing was last known (a `gate` or fused `post_attn` before it).
    let mut keys: Vec<BTreeSet<ExpertRef>> = vec![BTreeSet::new(); layers];
    let mut repeats = HashSet::new();
    let mut distance = 1u32;
    let mut routed: Option<u32> = None;
    for id in s.task_ids() {
        let t = program.task(id);
        if matches!(t.op, Op::Gate { .. } | Op::PostAttn { .. }) {
            routed = t.op.layer();
        }
        if t.cache_op != Some(CacheOp::Prefetch) {
            continue;
        }
        let Some(key) = t.args.iter().find_map(|a| a.slice.cache_key) else {
            continue;
        };
        if key.cache != cache || key.layer as usize >= layers {
            continue;
        }
        if !keys[key.layer as usize].insert(key.expert) {
            repeats.insert(id);
        }
        if let Some(r) = routed.filter(|&r| key.layer > r) {
            distance = distance.max(key.layer - r);
        }
    }
    if keys.iter().all(BTreeSet::is_empty) {
        return None;
    }
    let experts = card.experts as usize;
    let chosen: Vec<Option<Vec<f64>>> = keys
        .iter()
        .enumerate()
        .map(|(l, refs)| {
            if refs.is_empty() {
                return None;
            }
            let mut row = vec![0.0; experts];
            for &e in refs {
                for (x, p) in row.iter_mut().zip(pick(program, e, l as u32)) {
                    *x += p;
                }
            }
            Some(row.into_iter().map(|x| x.clamp(0.0, 1.0)).collect())
        })
        .collect();
    let per_layer = keys.iter().map(BTreeSet::len).max().unwrap_or(0) as u32;
    let tokens = tokens_per_ub.saturating_mul(u64::from(program.micro_batches.count.max(1)));
    let held = card.experts.min(tokens.saturating_mul(card.top_k)) as f64;
    let need = f64::from(per_layer) * f64::from(distance);
    let room = if need > 0.0 {
        ((f64::from(c.slots) - held) / need).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let ranked: BTreeSet<&'static str> = keys
        .iter()
        .flatten()
        .filter_map(|&e| ranked_by(program, e))
        .map(|p| match p {
            Predictor::LayerOrder => "by index",
            _ if program.expert_shares.is_some() => "by the profile's shares",
            _ => "without a profile (uniform routing ties every expert: a guess)",
        })
        .collect();
    Some(PrefetchPlan {
        chosen,
        per_layer,
        distance,
        room,
        repeats,
        ranking: ranked
            .into_iter()
            .next()
            .unwrap_or("by the schedule (static experts)"),
    })
}

/// A cache's decode hit rate with its prefetches' credit, for `moec simulate`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefetchCredit {
    /// The plan of the step it was computed for.
    pub plan: PrefetchPlan,
    /// Layers the step prefetches into the cache.
    pub layers: usize,
    /// Over the fetches of those layers not resident otherwise, the share found
    /// prefetched (fetch-weighted `room x chosen`).
    pub accuracy: f64,
    /// Hits over fetches, every layer, prefetches counted.
    pub rate: f64,
}

/// [`plan`] of the first decode step (else the last step) and what it adds to the cache's
/// hit rate; `None` where [`plan`] gives none.
pub fn decode_credit(program: &Program, cache: u32, tokens_per_ub: u64) -> Option<PrefetchCredit> {
    use crate::ir::StepKind;
    let step = program
        .steps
        .iter()
        .position(|s| s.kind == StepKind::Decode)
        .or(program.steps.len().checked_sub(1))?;
    let plan = plan(program, StepId::new(step), cache, tokens_per_ub)?;
    let hits = super::activation::cache_hits(program, cache, tokens_per_ub);
    let card = &program.model;
    let ubs = f64::from(program.micro_batches.count.max(1));
    let (mut hit, mut all, mut found, mut missing) = (0.0, 0.0, 0.0, 0.0);
    for l in 0..card.layers as u32 {
        for e in 0..card.experts as u32 {
            let q = share(program, l, ExpertRef::Index(e));
            let rate = ubs * (1.0 - (1.0 - q).powf(tokens_per_ub as f64));
            let h = hits
                .per_key
                .get(l as usize)
                .and_then(|r| r.get(e as usize))
                .copied()
                .unwrap_or(0.0);
            let credit = plan.credit(l, ExpertRef::Index(e));
            hit += rate * (h + (1.0 - h) * credit);
            all += rate;
            if plan.chosen.get(l as usize).is_some_and(Option::is_some) {
                found += rate * (1.0 - h) * credit;
                missing += rate * (1.0 - h);
            }
        }
    }
    Some(PrefetchCredit {
        layers: plan.chosen.iter().filter(|c| c.is_some()).count(),
        accuracy: if missing > 0.0 { found / missing } else { 0.0 },
        rate: if all > 0.0 { hit / all } else { 0.0 },
        plan,
    })
}
