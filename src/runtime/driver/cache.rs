//! Expert caches at run time: which slot holds which expert, who holds each slot, which
//! slot a miss replaces, and what the predictor ranks for a prefetch.
//!
//! Takes the plan's caches; gives the driver `fetch` (a hit holds the slot; a miss picks a
//! victim by the cache's policy among slots nobody holds, waiting only while every slot is
//! held or being filled), `prefetch` (a free slot or nothing: it never waits and skips when
//! a fetch is waiting), `filled` and `release`, and per-layer counts for the run report.
//! Contents persist across steps (only the holds are per step).
//!
//! Guarantees: a held slot is never chosen as a victim, and a slot being filled is never
//! handed to a hit before its copy was submitted (`filled`), so with the driver's fences a
//! reader always sees the expert its fetch named. `moec check` proves that every fetch
//! finds a slot nobody holds (`check::cache`), so waiting is bounded by in-flight
//! prefetch copies.

use super::state::{lock, StepState};
use crate::ir::cache::{EvictPolicy, Predictor};
use crate::ir::TaskId;
use crate::ir::{ExpertRef, ScoreKind};
use crate::lower::{PlanArg, PlanCache};
pub use crate::records::run::{CacheReport, LayerCacheStats};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// A (layer, expert) pair: what a slot holds.
pub type Key = (u32, u32);

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    key: Option<Key>,
    /// Fetches holding it this step (each until its readers ran).
    holds: u32,
    /// A copy into it was chosen but not yet submitted.
    filling: bool,
    last_use: u64,
    /// Filled by a prefetch and not fetched since.
    prefetched: bool,
}

#[derive(Debug, Default)]
struct Table {
    slots: Vec<Slot>,
    index: HashMap<Key, u32>,
    /// Fetches per key over the run (LFU).
    fetches: HashMap<Key, u64>,
    clock: u64,
    /// Fetches waiting for a slot.
    waiting: u32,
    stats: Vec<LayerCacheStats>,
    /// With a schedule-computed score: per (layer, expert), row-major, the routing
    /// quantities (`score_max`, `score_sum`, `routed`) of the latest step whose routing of
    /// that layer was on the host at a fetch or prefetch into this cache.
    quantities: Vec<[f64; 3]>,
    /// Per layer: its quantities were taken from this step's routing already.
    noted: Vec<bool>,
}

/// What a fetch found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetched {
    /// Resident in this slot (now held).
    Hit(u32),
    /// Not resident: this slot (now held and being filled) is to be copied into.
    Miss(u32),
}

/// Why a fetch gave up.
#[derive(Debug, thiserror::Error)]
#[error("expert cache `{cache}`: no free slot for {seconds} s (all {slots} held or being filled)")]
pub struct CacheStall {
    cache: String,
    seconds: u64,
    slots: u32,
}

/// One cache's run-time state.
#[derive(Debug)]
pub struct CacheRuntime {
    /// The plan's description.
    pub spec: PlanCache,
    table: Mutex<Table>,
    freed: Condvar,
}

impl CacheRuntime {
    /// An empty cache.
    pub fn new(spec: PlanCache, layers: usize) -> Self {
        let experts = spec.score.as_ref().map_or(0, |s| s.experts as usize);
        let table = Table {
            slots: vec![Slot::default(); spec.slots as usize],
            stats: vec![LayerCacheStats::default(); layers],
            quantities: vec![[0.0; 3]; layers * experts],
            noted: vec![false; layers],
            ..Table::default()
        };
        CacheRuntime {
            spec,
            table: Mutex::new(table),
            freed: Condvar::new(),
        }
    }

    /// Drops every hold (a step starts with none; a failed step may have left some).
    pub fn begin_step(&self) {
        let mut t = lock(&self.table);
        for s in &mut t.slots {
            s.holds = 0;
        }
        t.noted.iter_mut().for_each(|n| *n = false);
    }

    /// With a schedule-computed score: takes the routing quantities of every layer whose
    /// routing of this step is on the host (all its micro-batches read back) and was not
    /// taken yet this step. A layer not routed yet keeps its previous step's.
    fn note_routing(&self, state: &StepState, experts: usize) {
        let pending: Vec<u32> = {
            let t = lock(&self.table);
            if t.quantities.is_empty() {
                return;
            }
            (0..t.noted.len() as u32)
                .filter(|&l| !t.noted[l as usize])
                .collect()
        };
        for layer in pending {
            let quantities = |e: u32| -> Option<[f64; 3]> {
                Some([
                    f64::from(state.routed_score(layer, e, None, ScoreKind::Max)?),
                    f64::from(state.routed_score(layer, e, None, ScoreKind::Sum)?),
                    state.routed_tokens(layer, e, None)? as f64,
                ])
            };
            let Some(row) = (0..experts as u32)
                .map(quantities)
                .collect::<Option<Vec<_>>>()
            else {
                continue;
            };
            let mut t = lock(&self.table);
            let start = layer as usize * experts;
            if let Some(dst) = t.quantities.get_mut(start..start + experts) {
                dst.copy_from_slice(&row);
            }
            t.noted[layer as usize] = true;
        }
    }

    /// Every key's schedule-computed score now (`layers x experts`; empty without one).
    fn schedule_scores(&self, state: &StepState, layers: usize) -> Vec<Vec<f64>> {
        let Some(score) = &self.spec.score else {
            return Vec::new();
        };
        let experts = score.experts as usize;
        self.note_routing(state, experts);
        let t = lock(&self.table);
        (0..layers)
            .map(|l| {
                (0..experts)
                    .map(|e| {
                        let q = t
                            .quantities
                            .get(l * experts + e)
                            .copied()
                            .unwrap_or_default();
                        score.terms(l as u32, e as u32).map_or(0.0, |s| s.at(q))
                    })
                    .collect()
            })
            .collect()
    }

    /// Makes `key` resident and holds its slot. `score` ranks residents for the
    /// activation-aware policy (lowest leaves).
    pub fn fetch(
        &self,
        key: Key,
        score: &dyn Fn(Key) -> f64,
        patience: Duration,
    ) -> Result<Fetched, CacheStall> {
        let mut t = lock(&self.table);
        *t.fetches.entry(key).or_default() += 1;
        let layer = key.0 as usize;
        let mut waited = false;
        loop {
            t.clock += 1;
            let now = t.clock;
            if let Some(&s) = t.index.get(&key) {
                let slot = &mut t.slots[s as usize];
                if !slot.filling {
                    slot.holds += 1;
                    slot.last_use = now;
                    let used = std::mem::take(&mut slot.prefetched);
                    if let Some(st) = t.stats.get_mut(layer) {
                        st.hits += 1;
                        st.prefetch_used += u64::from(used);
                    }
                    if waited {
                        t.waiting -= 1;
                    }
                    return Ok(Fetched::Hit(s));
                }
            } else if let Some(s) = victim(&t, self.spec.policy, score) {
                evict(&mut t, s);
                let slot = &mut t.slots[s as usize];
                *slot = Slot {
                    key: Some(key),
                    holds: 1,
                    filling: true,
                    last_use: now,
                    prefetched: false,
                };
                t.index.insert(key, s);
                if let Some(st) = t.stats.get_mut(layer) {
                    st.misses += 1;
                }
                if waited {
                    t.waiting -= 1;
                }
                return Ok(Fetched::Miss(s));
            }
            if !waited {
                t.waiting += 1;
                waited = true;
            }
            let (guard, timeout) = self
                .freed
                .wait_timeout(t, patience)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            t = guard;
            if timeout.timed_out() {
                t.waiting -= 1;
                return Err(CacheStall {
                    cache: self.spec.name.clone(),
                    seconds: patience.as_secs(),
                    slots: self.spec.slots,
                });
            }
        }
    }

    /// Copies `key` ahead into a free slot, if it is not resident, no fetch is waiting and
    /// a slot nobody holds exists; the slot is held only until [`CacheRuntime::filled`].
    pub fn prefetch(&self, key: Key, score: &dyn Fn(Key) -> f64) -> Option<u32> {
        let mut t = lock(&self.table);
        let layer = key.0 as usize;
        let skip = t.index.contains_key(&key) || t.waiting > 0;
        let s = if skip {
            None
        } else {
            victim(&t, self.spec.policy, score)
        };
        let Some(s) = s else {
            if let Some(st) = t.stats.get_mut(layer) {
                st.prefetch_skipped += 1;
            }
            return None;
        };
        evict(&mut t, s);
        t.clock += 1;
        let now = t.clock;
        t.slots[s as usize] = Slot {
            key: Some(key),
            holds: 1,
            filling: true,
            last_use: now,
            prefetched: true,
        };
        t.index.insert(key, s);
        if let Some(st) = t.stats.get_mut(layer) {
            st.prefetched += 1;
        }
        Some(s)
    }

    /// Whether `key` is in a slot now (a `CACHE.resident(..)` guard): filled, or being
    /// filled by a copy already chosen (a fetch of it then hits once the copy is fenced).
    pub fn resident(&self, key: Key) -> bool {
        lock(&self.table).index.contains_key(&key)
    }

    /// A fetch guarded by its own key's residency found it not resident (the schedule
    /// computes the expert another way): a miss of the cache, counted as one.
    pub fn guarded_miss(&self, layer: u32) {
        if let Some(st) = lock(&self.table).stats.get_mut(layer as usize) {
            st.misses += 1;
        }
    }

    /// A prefetch found its expert idle once the layer's routing was in: not copied.
    pub fn prefetch_cancelled(&self, layer: u32) {
        if let Some(st) = lock(&self.table).stats.get_mut(layer as usize) {
            st.prefetch_skipped += 1;
        }
    }

    /// The copy into `slot` was submitted (fenced): hits may use it. A prefetch also
    /// lets the slot go.
    pub fn filled(&self, slot: u32, prefetch: bool) {
        let mut t = lock(&self.table);
        if let Some(s) = t.slots.get_mut(slot as usize) {
            s.filling = false;
            if prefetch {
                s.holds = s.holds.saturating_sub(1);
            }
        }
        drop(t);
        self.freed.notify_all();
    }

    /// A fetch's readers all ran: its hold on `slot` ends.
    pub fn release(&self, slot: u32) {
        let mut t = lock(&self.table);
        if let Some(s) = t.slots.get_mut(slot as usize) {
            s.holds = s.holds.saturating_sub(1);
        }
        drop(t);
        self.freed.notify_all();
    }

    /// The run's counts (prefetched experts still unused count as wasted).
    pub fn report(&self) -> CacheReport {
        let t = lock(&self.table);
        let mut layers = t.stats.clone();
        for s in &t.slots {
            if let (true, Some((l, _))) = (s.prefetched, s.key) {
                if let Some(st) = layers.get_mut(l as usize) {
                    st.prefetch_wasted += 1;
                }
            }
        }
        let mut total = LayerCacheStats::default();
        for l in &layers {
            total.add(l);
        }
        CacheReport {
            name: self.spec.name.clone(),
            slots: self.spec.slots,
            policy: self.spec.policy.as_str(),
            predictor: self.spec.predictor.as_str(),
            layers,
            total,
        }
    }
}

/// The slot a miss replaces: an empty one, else by policy among slots nobody holds or
/// fills.
fn victim(t: &Table, policy: EvictPolicy, score: &dyn Fn(Key) -> f64) -> Option<u32> {
    let free = t
        .slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.holds == 0 && !s.filling);
    let mut best: Option<(u32, (f64, u64))> = None;
    for (i, s) in free {
        let Some(key) = s.key else {
            return Some(i as u32);
        };
        let rank = match policy {
            EvictPolicy::Lru => (0.0, s.last_use),
            EvictPolicy::Lfu => (t.fetches.get(&key).copied().unwrap_or(0) as f64, s.last_use),
            EvictPolicy::Activation | EvictPolicy::Score => (score(key), s.last_use),
        };
        let lower = best.is_none_or(|(_, b)| rank.0 < b.0 || (rank.0 == b.0 && rank.1 < b.1));
        if lower {
            best = Some((i as u32, rank));
        }
    }
    best.map(|(i, _)| i)
}

fn evict(t: &mut Table, s: u32) {
    let old = t.slots[s as usize];
    if let Some(key) = old.key {
        t.index.remove(&key);
        if let Some(st) = t.stats.get_mut(key.0 as usize) {
            st.evictions += 1;
            st.prefetch_wasted += u64::from(old.prefetched);
        }
    }
}

/// A fetch's or prefetch's slot this step and the expert it resolved.
#[derive(Debug, Clone, Copy)]
pub struct Binding {
    /// The cache.
    pub cache: u32,
    /// The slot.
    pub slot: u32,
    /// The expert the key named (a prediction or `hot(..)` resolved once).
    pub expert: u32,
    /// Reader arguments still to run or be skipped.
    pub remaining: u32,
}

impl StepState {
    /// The expert `e` names for `task`: an index as is, `hot(..)` by this step's order, a
    /// prediction as its prefetch resolved it.
    pub fn resolve_expert(&self, task: Option<TaskId>, e: ExpertRef, experts: u32) -> u32 {
        match e {
            ExpertRef::Index(e) => e,
            ExpertRef::Hot { layer, rank } => self.hot_expert(layer, rank, experts),
            ExpertRef::Predicted { rank, .. } => task
                .and_then(|t| lock(&self.cache_bindings).get(&t).map(|b| b.expert))
                .unwrap_or(rank),
        }
    }

    /// The multiple of an argument's length to add to its start: the resolved expert of
    /// a run-time expert slice, or the slot of a cache slot (its fetch's binding).
    pub fn arg_index(&self, task: TaskId, arg: &PlanArg, experts: u32) -> Option<u32> {
        if let Some(fetch) = arg.cache_fetch {
            return lock(&self.cache_bindings).get(&fetch).map(|b| b.slot);
        }
        let e = arg.dynamic_expert?;
        let resolved = self.resolve_expert(Some(task), e, experts);
        // A copy's source named by `hot(..)` before its layer's routing is on the host:
        // the hot predictor's guess moved this expert (after the gate it is no guess).
        if let (ExpertRef::Hot { layer, .. }, crate::ir::Role::Src) = (e, arg.role) {
            let known = lock(&self.routing).keys().any(|&(l, _)| l == layer);
            if !known {
                lock(&self.hot_copied).insert((layer, resolved));
            }
        }
        Some(resolved)
    }

    /// Tokens routed this step to each (layer, expert) so far, `layers * experts`.
    fn step_counts(&self, layers: usize, experts: usize) -> Vec<u32> {
        let mut counts = vec![0u32; layers * experts];
        for (&(l, _), r) in lock(&self.routing).iter() {
            for &e in &r.experts {
                if let Some(c) = counts.get_mut(l as usize * experts + e as usize) {
                    *c += 1;
                }
            }
        }
        counts
    }

    /// Each expert's predicted activation per layer (`layers x experts`, rows summing to
    /// 1 or all zero) by a cache's predictor.
    pub fn likelihood(&self, predictor: Predictor, layers: usize, experts: usize) -> Vec<Vec<f64>> {
        let uniform = vec![vec![0.0; experts]; layers];
        match predictor {
            Predictor::LayerOrder => uniform,
            // The pregates' routing of this step, tokens per expert, row-normalised; a
            // layer no pregate predicted stays all zero (the checker requires one before
            // every `predicted` prefetch of a lookahead cache).
            Predictor::Lookahead => {
                let mut rows = uniform;
                for (&(l, _), r) in lock(&self.lookahead).iter() {
                    if let Some(row) = rows.get_mut(l as usize) {
                        for &e in &r.experts {
                            if let Some(x) = row.get_mut(e as usize) {
                                *x += 1.0;
                            }
                        }
                    }
                }
                for row in &mut rows {
                    let sum: f64 = row.iter().sum();
                    if sum > 0.0 {
                        row.iter_mut().for_each(|x| *x /= sum);
                    }
                }
                rows
            }
            Predictor::Cooccurrence => self
                .predictor
                .freq
                .iter()
                .map(|row| {
                    let sum: u64 = row.iter().sum();
                    row.iter()
                        .map(|&c| if sum > 0 { c as f64 / sum as f64 } else { 0.0 })
                        .collect()
                })
                .collect(),
            Predictor::Eam => {
                let requests: Vec<usize> = self
                    .ubs
                    .iter()
                    .flat_map(|u| u.seqs.iter().map(|s| s.request))
                    .collect();
                let step = self.step_counts(layers, experts);
                let eam = lock(&self.eam);
                let current = eam.current(&requests, &step);
                eam.predict(&current).unwrap_or(uniform)
            }
        }
    }

    /// Every key's eviction score under `cache`'s policy (`layers x experts`, lowest
    /// leaves): the activation-aware one, the schedule's own (`evict score(l, e) = ..`),
    /// or none (lru and lfu rank by the cache's own counts).
    pub fn policy_scores(
        &self,
        cache: &CacheRuntime,
        layers: usize,
        experts: usize,
    ) -> Vec<Vec<f64>> {
        match cache.spec.policy {
            EvictPolicy::Activation => self.eviction_scores(cache.spec.predictor, layers, experts),
            EvictPolicy::Score => cache.schedule_scores(self, layers),
            EvictPolicy::Lru | EvictPolicy::Lfu => Vec::new(),
        }
    }

    /// The activation-aware eviction score of every key (paper Alg. 1 line 12):
    /// `(p[l][e] + eps) * (1 - l / L)`, `p` the predictor's row-normalised activation.
    pub fn eviction_scores(
        &self,
        predictor: Predictor,
        layers: usize,
        experts: usize,
    ) -> Vec<Vec<f64>> {
        let p = self.likelihood(predictor, layers, experts);
        p.iter()
            .enumerate()
            .map(|(l, row)| {
                let decay = 1.0 - l as f64 / layers.max(1) as f64;
                row.iter().map(|&x| (x + 1e-6) * decay).collect()
            })
            .collect()
    }

    /// The expert `cache`'s predictor ranks at `rank` for `layer` now, and whether that
    /// expert is known to get no tokens (the layer's routing of this step is in and it
    /// has none: the prefetch is cancelled). Experts with tokens this step rank first,
    /// then by predicted activation (co-occurrence after the previous layer's choice when
    /// known), ties by index (the released code's layer order).
    pub fn predicted_expert(
        &self,
        predictor: Predictor,
        layer: u32,
        rank: u32,
        layers: usize,
        experts: u32,
    ) -> (u32, bool) {
        let n = experts as usize;
        let mut routed = vec![0u64; n];
        let mut known = 0usize;
        let mut previous: Option<Vec<u32>> = None;
        {
            let routing = lock(&self.routing);
            for (&(l, _), r) in routing.iter() {
                if l == layer {
                    known += 1;
                    for &e in &r.experts {
                        if let Some(c) = routed.get_mut(e as usize) {
                            *c += 1;
                        }
                    }
                }
                if layer > 0 && l == layer - 1 {
                    previous.get_or_insert_with(Vec::new).extend(&r.experts);
                }
            }
        }
        let active_ubs = self.ubs.iter().filter(|u| !u.seqs.is_empty()).count();
        let all_known = active_ubs > 0 && known >= active_ubs;
        let score: Vec<f64> = match predictor {
            Predictor::Cooccurrence => self
                .predictor
                .scores(layer as usize, previous.as_deref())
                .into_iter()
                .map(|c| c as f64)
                .collect(),
            _ => self
                .likelihood(predictor, layers, n)
                .get(layer as usize)
                .cloned()
                .unwrap_or_default(),
        };
        let s = |e: usize| score.get(e).copied().unwrap_or(0.0);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| {
            routed[b]
                .cmp(&routed[a])
                .then(s(b).total_cmp(&s(a)))
                .then(a.cmp(&b))
        });
        let e = order.get(rank as usize).copied().unwrap_or(rank as usize);
        // Lookahead gating prefetches only the experts its routing selected.
        let unselected = predictor == Predictor::Lookahead && s(e) <= 0.0;
        (
            e as u32,
            unselected || (all_known && routed.get(e).copied().unwrap_or(0) == 0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three residents: a schedule-computed score evicts the lowest score, ties by
    /// recency, and never a held slot; a free slot goes first.
    #[test]
    fn a_schedule_computed_score_evicts_its_lowest_unheld_resident() {
        let resident = |key: Key, last_use: u64| Slot {
            key: Some(key),
            last_use,
            ..Slot::default()
        };
        let mut t = Table {
            slots: vec![
                resident((0, 1), 1),
                resident((0, 2), 2),
                resident((1, 3), 3),
            ],
            ..Table::default()
        };
        // (0, 2) and (1, 3) tie at 0.1: the least recently used of them leaves.
        let score = |(l, e): Key| match (l, e) {
            (0, 1) => 0.5,
            _ => 0.1,
        };
        assert_eq!(victim(&t, EvictPolicy::Score, &score), Some(1));
        // Held, it stays; the other of the tie goes.
        t.slots[1].holds = 1;
        assert_eq!(victim(&t, EvictPolicy::Score, &score), Some(2));
        // Only the highest score is left unheld.
        t.slots[2].filling = true;
        assert_eq!(victim(&t, EvictPolicy::Score, &score), Some(0));
        // An empty slot before any resident.
        t.slots.push(Slot::default());
        assert_eq!(victim(&t, EvictPolicy::Score, &score), Some(3));
    }

    /// A score's terms: constant plus each quantity times its coefficient.
    #[test]
    fn score_terms_are_a_dot_product_with_the_quantities() {
        let terms = crate::ir::cache::ScoreTerms {
            constant: -1.0,
            per_quantity: [0.5, 2.0, 0.25],
        };
        // -1 + 0.5 * 0.8 + 2 * 1.2 + 0.25 * 3 = 2.55
        assert!((terms.at([0.8, 1.2, 3.0]) - 2.55).abs() < 1e-12);
    }
}
