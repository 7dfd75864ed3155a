//! The run-time state one step's ops share: which sequences each micro-batch holds, the
//! routing decisions made so far (for guards and hot-expert order: the host's control
//! plane, what a GPU runtime would read back too), and the sampled tokens. Data that ops
//! hand each other (hidden rows, normalised rows, expert outputs) lives only in the
//! schedule's buffers.
//!
//! Takes the driver's micro-batch contents before a step; gives ops their token ids,
//! positions and block tables, and the driver the sampled tokens after it. The driver
//! writes `ubs` only between steps (no stream thread is running then); everything ops
//! write during a step is behind a mutex, held only for a lookup or an insert.

use crate::ir::{ExpertRef, TaskId};
use crate::lower::PlanArg;
use crate::model::vocab::Routing;
use crate::model::vocab::Sampling;
use crate::rng::Rng;
use crate::runtime::step::StepContext;
pub use crate::runtime::step::{MicroBatchState, SeqSlot};
pub use crate::runtime::sync::lock;
use std::collections::HashMap;
use std::sync::Mutex;

/// Hot-expert prediction for `hot(layer, rank)` (Klotski): running statistics of how often
/// each expert is chosen, and of which experts follow which from one layer to the next.
#[derive(Debug, Clone, Default)]
pub struct HotPredictor {
    /// `freq[layer][expert]`: tokens routed so far.
    pub freq: Vec<Vec<u64>>,
    /// `corr[layer][a][b]`: tokens routed to `a` in layer `layer - 1` and to `b` in `layer`.
    pub corr: Vec<Vec<Vec<u64>>>,
}

impl HotPredictor {
    /// Empty statistics for a model.
    pub fn new(layers: usize, experts: usize) -> Self {
        HotPredictor {
            freq: vec![vec![0; experts]; layers],
            corr: vec![vec![vec![0; experts]; experts]; layers],
        }
    }

    /// Scores of `layer`'s experts given the experts chosen in the previous layer (if known).
    pub fn scores(&self, layer: usize, previous: Option<&[u32]>) -> Vec<u64> {
        let n = self.freq.get(layer).map_or(0, Vec::len);
        match (previous, self.corr.get(layer)) {
            (Some(prev), Some(corr)) if layer > 0 => {
                let mut scores = vec![0; n];
                for &a in prev {
                    if let Some(row) = corr.get(a as usize) {
                        for (s, c) in scores.iter_mut().zip(row) {
                            *s += c;
                        }
                    }
                }
                scores
            }
            _ => self.freq.get(layer).cloned().unwrap_or_default(),
        }
    }

    /// Adds one step's routing (per (layer, ub), rows aligned across layers).
    pub fn update(&mut self, routing: &HashMap<(u32, u32), Routing>) {
        for (&(layer, ub), r) in routing {
            let l = layer as usize;
            if let Some(freq) = self.freq.get_mut(l) {
                for &e in &r.experts {
                    if let Some(f) = freq.get_mut(e as usize) {
                        *f += 1;
                    }
                }
            }
            let Some(prev) = layer.checked_sub(1).and_then(|p| routing.get(&(p, ub))) else {
                continue;
            };
            let Some(corr) = self.corr.get_mut(l) else {
                continue;
            };
            let k = r.top_k.max(1);
            for (row_prev, row) in prev
                .experts
                .chunks(prev.top_k.max(1))
                .zip(r.experts.chunks(k))
            {
                for &a in row_prev {
                    for &b in row {
                        if let Some(c) =
                            corr.get_mut(a as usize).and_then(|x| x.get_mut(b as usize))
                        {
                            *c += 1;
                        }
                    }
                }
            }
        }
    }
}

/// A rule on which tokens a sequence may sample next (a grammar: `response_format`),
/// applied by [`StepState::sample_rows`] to that sequence's row of logits.
pub trait TokenConstraint: Send + std::fmt::Debug {
    /// Sets the logits of the tokens not allowed next to negative infinity.
    fn mask(&mut self, logits: &mut [f32]);
    /// The token sampled (the rule moves on past it).
    fn accept(&mut self, token: u32);
}

/// State shared by the ops of a step.
#[derive(Debug)]
pub struct StepState {
    /// Micro-batches (indexed by `ub`).
    pub ubs: Vec<MicroBatchState>,
    /// Sampling rule of the step: what a backend picks its sampling path by (greedy: a
    /// device may take the argmax itself; otherwise every row goes through
    /// [`StepState::sample_rows`]).
    pub sampling: Sampling,
    /// Each request's own rule (by request index), which [`StepState::sample_rows`]
    /// follows; a request without one samples by `sampling`.
    pub request_sampling: Vec<Sampling>,
    /// Per request sampler state.
    pub rngs: Mutex<Vec<Rng>>,
    /// Per request: the rule its tokens follow, if any (by request index).
    pub constraints: Mutex<Vec<Option<Box<dyn TokenConstraint>>>>,
    /// Routing per (layer, ub), recorded by `gate` and `post_attn`.
    pub routing: Mutex<HashMap<(u32, u32), Routing>>,
    /// Lookahead routing per (layer, ub): what `pregate(layer = l, ub = u)` predicted for
    /// layer `l`, read back by the plan's `ReadRouting` after it (the `lookahead`
    /// predictor's input, and the run report's lookahead accuracy).
    pub lookahead: Mutex<HashMap<(u32, u32), Routing>>,
    /// Experts (layer, expert) that a copy named through `hot(..)` this step: what the hot
    /// predictor's prediction moved, for the run report's accuracy.
    pub hot_copied: Mutex<std::collections::HashSet<(u32, u32)>>,
    /// The expert order of each layer this step, fixed at its first use.
    pub hot_order: Mutex<HashMap<u32, Vec<u32>>>,
    /// Predicted hot experts.
    pub predictor: HotPredictor,
    /// Expert caches (contents persist across steps).
    pub caches: Vec<super::cache::CacheRuntime>,
    /// Each fetch's and prefetch's slot this step, by task.
    pub cache_bindings: Mutex<HashMap<crate::ir::TaskId, super::cache::Binding>>,
    /// Request-level expert activation matrices (the `eam` predictor).
    pub eam: Mutex<super::eam::Eam>,
    /// Sampled tokens per ub (one per sequence, row order).
    pub sampled: Mutex<HashMap<u32, Vec<u32>>>,
    /// Whether `sample` also hands the logits it sampled from to the host
    /// ([`StepState::sampled_logits`]): `RunOptions::capture_logits`.
    pub capture_logits: bool,
    /// With `capture_logits`: per ub, the logits `sample` read (`[seqs, vocab]`, row order).
    pub sampled_logits: Mutex<HashMap<u32, Vec<f32>>>,
    /// Distinct experts each (layer, ub)'s routing reached this step, noted by the ops that
    /// computed a routing and hold it anyway (a CPU `gate`, a fused `post_attn` on either
    /// backend). A measurement for the run record and the cost model's replay only: no
    /// decision reads it (the host decides from the plan's `ReadRouting` alone).
    pub active_experts: Mutex<HashMap<(u32, u32), u32>>,
}

/// Distinct experts below `experts` that `routing` chose (a dense layer's routing, which
/// names no expert, chooses none).
pub fn distinct_experts(routing: &Routing, experts: usize) -> u32 {
    let mut seen: Vec<u32> = routing
        .experts
        .iter()
        .copied()
        .filter(|&e| (e as usize) < experts)
        .collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len() as u32
}

impl StepState {
    /// Empty state for `n_ubs` micro-batches.
    pub fn new(n_ubs: usize, sampling: Sampling, rngs: Vec<Rng>) -> Self {
        StepState {
            ubs: vec![MicroBatchState::default(); n_ubs],
            sampling,
            request_sampling: Vec::new(),
            rngs: Mutex::new(rngs),
            constraints: Mutex::new(Vec::new()),
            routing: Mutex::new(HashMap::new()),
            lookahead: Mutex::new(HashMap::new()),
            hot_copied: Mutex::new(std::collections::HashSet::new()),
            hot_order: Mutex::new(HashMap::new()),
            predictor: HotPredictor::default(),
            caches: Vec::new(),
            cache_bindings: Mutex::new(HashMap::new()),
            eam: Mutex::new(super::eam::Eam::default()),
            sampled: Mutex::new(HashMap::new()),
            capture_logits: false,
            sampled_logits: Mutex::new(HashMap::new()),
            active_experts: Mutex::new(HashMap::new()),
        }
    }

    /// Notes how many distinct experts below `experts` `routing` reached in (layer, ub)
    /// ([`distinct_experts`]).
    pub fn note_active_experts(&self, layer: u32, ub: u32, routing: &Routing, experts: usize) {
        lock(&self.active_experts).insert((layer, ub), distinct_experts(routing, experts));
    }

    /// Clears what one step produced (keeps ubs and samplers).
    pub fn reset_step(&mut self) {
        lock(&self.routing).clear();
        lock(&self.lookahead).clear();
        lock(&self.hot_copied).clear();
        lock(&self.hot_order).clear();
        lock(&self.cache_bindings).clear();
        for c in &self.caches {
            c.begin_step();
        }
        lock(&self.sampled).clear();
        lock(&self.sampled_logits).clear();
        lock(&self.active_experts).clear();
    }

    /// The token of each sequence of `mb` from its row of `logits` (`[seqs, vocab]`): the
    /// run's sampler with the request's own generator (argmax without one). Every backend
    /// samples through this, so their tokens come from one rule.
    pub fn sample_rows(&self, mb: &MicroBatchState, logits: &[f32], vocab: usize) -> Vec<u32> {
        let mut rngs = lock(&self.rngs);
        let mut constraints = lock(&self.constraints);
        mb.seqs
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let mut row = &logits[k * vocab..(k + 1) * vocab];
                let mut constraint = constraints.get_mut(s.request).and_then(Option::as_mut);
                let masked;
                if let Some(c) = constraint.as_mut() {
                    let mut copy = row.to_vec();
                    c.mask(&mut copy);
                    masked = copy;
                    row = &masked;
                }
                let rule = self
                    .request_sampling
                    .get(s.request)
                    .unwrap_or(&self.sampling);
                let token = match rngs.get_mut(s.request) {
                    Some(rng) => crate::math::sampling::sample(row, rule, rng),
                    None => crate::math::sampling::argmax(row),
                };
                if let Some(c) = constraint {
                    c.accept(token);
                }
                token
            })
            .collect()
    }

    /// Expert at `rank` of `layer`'s order: predicted hot experts first, then the others
    /// by tokens routed to them this step (most first; unknown routing: index order).
    pub fn hot_expert(&self, layer: u32, rank: u32, n_experts: u32) -> u32 {
        let mut orders = lock(&self.hot_order);
        let order = orders.entry(layer).or_insert_with(|| {
            let routing = lock(&self.routing);
            let mut counts = vec![0u64; n_experts as usize];
            let mut previous: Option<Vec<u32>> = None;
            for ((l, _), r) in routing.iter() {
                if *l == layer {
                    for &e in &r.experts {
                        if let Some(c) = counts.get_mut(e as usize) {
                            *c += 1;
                        }
                    }
                }
                if layer > 0 && *l == layer - 1 {
                    previous.get_or_insert_with(Vec::new).extend(&r.experts);
                }
            }
            let scores = self.predictor.scores(layer as usize, previous.as_deref());
            let score = |e: u32| scores.get(e as usize).copied().unwrap_or(0);
            // Predicted hot experts first (by score), then by this step's routed tokens.
            let mut order: Vec<u32> = (0..n_experts).collect();
            order.sort_by_key(|&e| {
                (
                    std::cmp::Reverse(score(e)),
                    std::cmp::Reverse(counts[e as usize]),
                    e,
                )
            });
            order
        });
        order.get(rank as usize).copied().unwrap_or(rank)
    }

    /// Whether `expert` of `layer` got tokens (from `ub`, or any ub); `None` if the routing
    /// is not known yet.
    pub fn is_active(&self, layer: u32, expert: u32, ub: Option<u32>) -> Option<bool> {
        self.routed_tokens(layer, expert, ub).map(|n| n > 0)
    }

    /// Tokens routed to `expert` of `layer` (from `ub`, or summed over every micro-batch
    /// of the step); `None` if a routing it needs is not known yet. An empty micro-batch
    /// routes nothing (its gate reads nothing back).
    pub fn routed_tokens(&self, layer: u32, expert: u32, ub: Option<u32>) -> Option<u64> {
        let routing = lock(&self.routing);
        let ubs: Vec<u32> = match ub {
            Some(u) => vec![u],
            None => (0..self.ubs.len() as u32).collect(),
        };
        let mut count = 0u64;
        for u in ubs {
            if self.ubs.get(u as usize).is_some_and(|m| m.seqs.is_empty()) {
                continue;
            }
            let r = routing.get(&(layer, u))?;
            // Top-k picks distinct experts, so each occurrence is one token.
            count += r.experts.iter().filter(|&&e| e == expert).count() as u64;
        }
        Some(count)
    }
}

impl StepState {
    /// The largest (`Max`) or summed (`Sum`) routing weight the tokens of `ub` (or of every
    /// micro-batch of the step) gave `expert` of `layer`: the gate's normalised weights
    /// that `combine` multiplies by; 0 when no token routed to it; `None` if a routing it
    /// needs is not known yet.
    pub fn routed_score(
        &self,
        layer: u32,
        expert: u32,
        ub: Option<u32>,
        kind: crate::ir::ScoreKind,
    ) -> Option<f32> {
        let routing = lock(&self.routing);
        let ubs: Vec<u32> = match ub {
            Some(u) => vec![u],
            None => (0..self.ubs.len() as u32).collect(),
        };
        let mut score = 0.0f32;
        for u in ubs {
            if self.ubs.get(u as usize).is_some_and(|m| m.seqs.is_empty()) {
                continue;
            }
            let r = routing.get(&(layer, u))?;
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                if e == expert {
                    score = match kind {
                        crate::ir::ScoreKind::Max => score.max(w),
                        crate::ir::ScoreKind::Sum => score + w,
                    };
                }
            }
        }
        Some(score)
    }
}

/// The step as a backend's ops see it: the driver's state behind the interface's trait.
impl StepContext for StepState {
    fn micro_batch(&self, ub: u32) -> Option<&MicroBatchState> {
        self.ubs.get(ub as usize)
    }

    fn resolve_expert(&self, expert: ExpertRef, experts: u32) -> u32 {
        StepState::resolve_expert(self, None, expert, experts)
    }

    fn arg_index(&self, task: TaskId, arg: &PlanArg, experts: u32) -> Option<u32> {
        StepState::arg_index(self, task, arg, experts)
    }

    fn read_back_routing(&self, layer: u32, ub: u32) -> Option<Routing> {
        lock(&self.routing).get(&(layer, ub)).cloned()
    }

    fn sampling(&self) -> &Sampling {
        &self.sampling
    }

    fn sample_rows(&self, mb: &MicroBatchState, logits: &[f32], vocab: usize) -> Vec<u32> {
        StepState::sample_rows(self, mb, logits, vocab)
    }

    fn put_sampled(&self, ub: u32, tokens: Vec<u32>) {
        lock(&self.sampled).insert(ub, tokens);
    }

    fn wants_logits(&self) -> bool {
        self.capture_logits
    }

    fn put_logits(&self, ub: u32, logits: Vec<f32>) {
        lock(&self.sampled_logits).insert(ub, logits);
    }

    fn note_active_experts(&self, layer: u32, ub: u32, routing: &Routing, experts: usize) {
        StepState::note_active_experts(self, layer, ub, routing, experts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::vocab::Sampling;

    #[test]
    fn active_experts_count_each_expert_once_and_no_dense_sentinel() {
        let state = StepState::new(2, Sampling::Greedy, Vec::new());
        // Three tokens, top-2 over 8 experts: {1, 5}, {5, 2}, {1, 2} reach 3 experts.
        let routing = Routing {
            top_k: 2,
            experts: vec![1, 5, 5, 2, 1, 2],
            weights: vec![0.5; 6],
        };
        state.note_active_experts(3, 1, &routing, 8);
        let dense = crate::math::dense::no_expert_routing(3, 2);
        state.note_active_experts(0, 1, &dense, 8);
        let seen = lock(&state.active_experts).clone();
        assert_eq!(seen.get(&(3, 1)), Some(&3));
        assert_eq!(seen.get(&(0, 1)), Some(&0));
    }
}
