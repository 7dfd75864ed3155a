//! Expert caches: a buffer of expert-sized slots whose contents the runtime chooses.
//!
//! A `cache NAME[N]: SPACE evict POLICY predict PREDICTOR` declaration gives one buffer of
//! `N` expert slots and a [`Cache`] entry. Tasks name a slot only by the expert it holds
//! (`NAME.slot(layer, expert)`, a [`CacheKey`]): `fetch` makes the key resident (a no-op
//! on a hit, a copy into a slot the policy frees on a miss) and holds its slot until the
//! last task reading that key through it has run; `prefetch` copies a predicted expert
//! into a free slot if one is free, never waiting and never holding it. Contents persist
//! across steps; which slot holds what is decided at run time, so the checker proves the
//! properties that hold for every decision (see `check::cache`).

use super::catalog::ExpertRef;
use super::BufferId;
use serde::{Deserialize, Serialize};

/// Which resident expert a miss replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EvictPolicy {
    /// Least recently used (fetched or hit) slot.
    Lru,
    /// Least frequently fetched expert, ties by recency (MoE-Infinity's released code,
    /// `moe_infinity/memory/expert_cache.py`, per the notes).
    Lfu,
    /// MoE-Infinity's activation-aware score (paper Alg. 1 lines 8-17): the predicted
    /// activation of the expert in the matched request-level EAM, row-normalised, times
    /// `1 - layer / L` (earlier layers kept longer); lowest score leaves.
    Activation,
    /// A score the schedule computes (`evict score(l, e) = EXPR`, [`EvictScore`]): lowest
    /// leaves, ties by recency. Not a name a string can choose: it needs its expression.
    Score,
}

impl EvictPolicy {
    /// Every policy a schedule names by a string, in the order the language documents
    /// them (the schedule-computed [`EvictPolicy::Score`] is written `score(l, e) = ..`).
    pub const ALL: [EvictPolicy; 3] = [EvictPolicy::Lru, EvictPolicy::Lfu, EvictPolicy::Activation];

    /// The name a schedule writes (`"lru"`, `"lfu"`, `"activation"`; `score` for a
    /// schedule-computed score).
    pub fn as_str(self) -> &'static str {
        match self {
            EvictPolicy::Lru => "lru",
            EvictPolicy::Lfu => "lfu",
            EvictPolicy::Activation => "activation",
            EvictPolicy::Score => "score",
        }
    }

    /// Parses a schedule's policy name (one of [`EvictPolicy::ALL`]).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

/// A run-time quantity an eviction score may read for the expert it ranks: the routing of
/// that expert's layer in the latest step whose routing of the layer reached the host
/// before the eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScoreQuantity {
    /// `score_max(l, e)`: the largest normalised routing weight a token gave the expert.
    Max,
    /// `score_sum(l, e)`: the weights summed over the step's tokens.
    Sum,
    /// `routed(l, e)`: the tokens routed to it.
    Routed,
}

impl ScoreQuantity {
    /// Every quantity, in the order of [`ScoreTerms::per_quantity`].
    pub const ALL: [ScoreQuantity; 3] = [
        ScoreQuantity::Max,
        ScoreQuantity::Sum,
        ScoreQuantity::Routed,
    ];
}

/// One expert's eviction score: `constant + sum(per_quantity[q] * q)` over the run-time
/// quantities ([`ScoreQuantity::ALL`] order). The schedule's expression is linear in them
/// (the elaborator refuses products of two), so every compile-time part folds into the
/// coefficients.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct ScoreTerms {
    /// The compile-time part.
    pub constant: f64,
    /// Coefficients of `score_max`, `score_sum`, `routed`.
    pub per_quantity: [f64; 3],
}

impl ScoreTerms {
    /// The score for the quantities' values (in [`ScoreQuantity::ALL`] order).
    pub fn at(&self, values: [f64; 3]) -> f64 {
        self.constant
            + self
                .per_quantity
                .iter()
                .zip(values)
                .map(|(c, v)| c * v)
                .sum::<f64>()
    }
}

/// A schedule-computed eviction score: every (layer, expert)'s [`ScoreTerms`], row-major
/// (`layer * experts + expert`). Every number is finite (the elaborator checks).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvictScore {
    /// Experts per layer.
    pub experts: u32,
    /// `layers * experts` entries.
    pub terms: Vec<ScoreTerms>,
}

// Every number is finite, so equality is reflexive.
impl Eq for EvictScore {}

impl EvictScore {
    /// The terms of (layer, expert), if in range.
    pub fn terms(&self, layer: u32, expert: u32) -> Option<&ScoreTerms> {
        if expert >= self.experts {
            return None;
        }
        self.terms
            .get(layer as usize * self.experts as usize + expert as usize)
    }
}

/// How `CACHE.predicted(layer, rank)` ranks a layer's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Predictor {
    /// Co-occurrence counts (the predictor `hot(..)` uses): with the previous layer's
    /// routing of this step known, experts by how many tokens routed to each of them after
    /// the previous layer's chosen experts, over every step so far; otherwise by total
    /// tokens routed to them so far. The ranking is fixed at the prefetch's start.
    Cooccurrence,
    /// MoE-Infinity's request-level expert activation matrix (paper §4.3-4.5): the running
    /// requests' EAMs summed, matched by cosine similarity against a collection of
    /// finished requests' EAMs; the nearest one's rows, normalised and weighted by layer
    /// proximity `1 - (i - l) / L`, rank each layer's experts.
    Eam,
    /// The released code with an empty trace collection: experts in index order.
    LayerOrder,
    /// Lookahead gating (Pre-gated MoE, AdapMoE, HOBBIT): the layer's own router applied to
    /// an earlier hidden state by a `pregate(layer = l, ..)` task; experts by the tokens
    /// that routing sends them. The checker requires every prefetch of `predicted(l, ..)`
    /// to be ordered after a `pregate` of layer `l` for every micro-batch
    /// (`cache::unpredicted`), so the prediction is never read before it is written.
    Lookahead,
}

impl Predictor {
    /// Every predictor, in the order the language documents them.
    pub const ALL: [Predictor; 4] = [
        Predictor::Cooccurrence,
        Predictor::Eam,
        Predictor::LayerOrder,
        Predictor::Lookahead,
    ];

    /// The name a schedule writes.
    pub fn as_str(self) -> &'static str {
        match self {
            Predictor::Cooccurrence => "cooccurrence",
            Predictor::Eam => "eam",
            Predictor::LayerOrder => "layer_order",
            Predictor::Lookahead => "lookahead",
        }
    }

    /// Parses a schedule's predictor name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }
}

/// One expert cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cache {
    /// The declared name.
    pub name: String,
    /// Its buffer: `slots` expert-sized slots.
    pub buffer: BufferId,
    /// Number of slots.
    pub slots: u32,
    /// Eviction policy.
    pub policy: EvictPolicy,
    /// With [`EvictPolicy::Score`]: the score of every (layer, expert).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<EvictScore>,
    /// Predictor of `predicted(..)`.
    pub predictor: Predictor,
}

/// The expert a slot access names: `CACHE.slot(layer, expert)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CacheKey {
    /// Index into [`crate::ir::Program::caches`].
    pub cache: u32,
    /// The layer.
    pub layer: u32,
    /// The expert of that layer.
    pub expert: ExpertRef,
}

/// Whether a copy into a cache slot is an on-demand fetch or a prefetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CacheOp {
    /// `fetch`: a no-op on a hit; on a miss waits for a free slot and copies; holds the
    /// slot until its readers ran.
    Fetch,
    /// `prefetch`: copies into a free slot if one is free and the key is not resident,
    /// never waits, holds nothing; skipped when no slot is free, when an on-demand fetch
    /// is waiting, or when the layer's routing is known and the expert got no tokens.
    Prefetch,
}

impl CacheOp {
    /// The statement keyword.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheOp::Fetch => "fetch",
            CacheOp::Prefetch => "prefetch",
        }
    }
}

/// For every task argument, the `fetch` whose slot it names: for an argument reading
/// `CACHE.slot(l, e)`, the latest `fetch` of the same key issued before it in the same
/// step (`None` if there is none: the checker rejects that); for the slot a `fetch` or
/// `prefetch` writes, the task itself. Every other argument: `None`. Dependency analysis
/// orders a reader after this fetch, the runtime resolves the reader's slot through it
/// and counts the fetch's readers to know when its slot may be reused.
pub fn bindings(program: &super::Program) -> Vec<Vec<Option<super::TaskId>>> {
    use std::collections::HashMap;
    let mut out = Vec::with_capacity(program.tasks.len());
    for step in &program.steps {
        let mut last_fetch: HashMap<CacheKey, super::TaskId> = HashMap::new();
        for id in step.task_ids() {
            let task = program.task(id);
            let mut bound = vec![None; task.args.len()];
            for (k, arg) in task.args.iter().enumerate() {
                let Some(key) = arg.slice.cache_key else {
                    continue;
                };
                bound[k] = if arg.access.writes() && task.cache_op.is_some() {
                    Some(id)
                } else if arg.access.reads() {
                    last_fetch.get(&key).copied()
                } else {
                    None
                };
            }
            if task.cache_op == Some(CacheOp::Fetch) {
                for arg in &task.args {
                    if let (Some(key), true) = (arg.slice.cache_key, arg.access.writes()) {
                        last_fetch.insert(key, id);
                    }
                }
            }
            out.push(bound);
        }
    }
    out
}
