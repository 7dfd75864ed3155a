//! Guards: the dynamic conditions a task runs under, decided at run time from the real
//! routing or a cache's contents. A [`Guard`] is a conjunction of [`GuardLit`]s, each a
//! possibly negated [`GuardAtom`]: an expert is active, received at least so many tokens,
//! is resident in an expert cache, or scored at least a threshold ([`ScoreKind`]). Each
//! prints as the schedule writes it (`text`, with caches by their declared names).
//! Re-exported from [`crate::ir`].

use serde::{Deserialize, Serialize};

use super::cache::Cache;
use super::ExpertRef;

/// A dynamic condition atom, decided by the runtime from the real routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GuardAtom {
    /// `active(layer, expert)` or `active(layer, expert, ub)`: the expert received tokens
    /// (from micro-batch `ub`, or from any micro-batch of the step).
    Active {
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or any.
        ub: Option<u32>,
    },
    /// `routed(layer, expert[, ub]) >= at_least` (every comparison of a routed token
    /// count with a constant is this atom or its negation, or a conjunction of two): the
    /// expert received at least `at_least` tokens (from micro-batch `ub`, or summed over
    /// every micro-batch of the step). Fiddler's CPU-or-copy rule branches on it.
    Tokens {
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or the sum over all of them.
        ub: Option<u32>,
        /// The threshold (at least 2: `>= 1` is `active`, `>= 0` always holds).
        at_least: u32,
    },
    /// `CACHE.resident(layer, expert)`: the expert is in a slot of cache `cache` when the
    /// guard is decided (a hit). The checker orders every fetch or prefetch into that
    /// cache before every task guarded by it or after all of them
    /// (`cache::stale_guard`), so every such task sees the same answer.
    Resident {
        /// The cache (index into `Program::caches`).
        cache: u32,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
    },
    /// `score_max(layer, expert[, ub]) >= at_least` or `score_sum(..) >= at_least`: the
    /// largest (or summed) routing weight the expert received from the tokens of
    /// micro-batch `ub` (or of every micro-batch of the step); 0 for an expert no token
    /// routed to. Thresholds are positive (`>= 0` always holds, `>= t` with `t <= 0` is
    /// folded at compile time), stored as the bits of an `f32` so the atom stays `Eq` and
    /// `Ord` (positive floats order as their bits).
    Score {
        /// Largest or summed.
        kind: ScoreKind,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or every micro-batch of the step.
        ub: Option<u32>,
        /// `f32::to_bits` of the (positive) threshold.
        at_least_bits: u32,
    },
}

/// Which statistic of an expert's routing weights a score guard reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ScoreKind {
    /// `score_max`: the largest weight a token gave the expert.
    Max,
    /// `score_sum`: the sum of the weights its tokens gave it (its share of the output).
    Sum,
}

impl ScoreKind {
    /// The function that reads it (`score_max`, `score_sum`).
    pub fn as_str(self) -> &'static str {
        match self {
            ScoreKind::Max => "score_max",
            ScoreKind::Sum => "score_sum",
        }
    }
}

impl GuardAtom {
    /// The layer whose routing (or cache slot) decides the atom.
    pub fn layer(&self) -> u32 {
        match *self {
            GuardAtom::Active { layer, .. }
            | GuardAtom::Tokens { layer, .. }
            | GuardAtom::Resident { layer, .. }
            | GuardAtom::Score { layer, .. } => layer,
        }
    }

    /// The expert it reads.
    pub fn expert(&self) -> ExpertRef {
        match *self {
            GuardAtom::Active { expert, .. }
            | GuardAtom::Tokens { expert, .. }
            | GuardAtom::Resident { expert, .. }
            | GuardAtom::Score { expert, .. } => expert,
        }
    }

    /// The micro-batch it reads, or `None` for every micro-batch of the step (a
    /// residency guard reads no micro-batch: `None`).
    pub fn ub(&self) -> Option<u32> {
        match *self {
            GuardAtom::Active { ub, .. }
            | GuardAtom::Tokens { ub, .. }
            | GuardAtom::Score { ub, .. } => ub,
            GuardAtom::Resident { .. } => None,
        }
    }

    /// True for the atoms that count routed tokens (`active`, `routed >= t`): the ones
    /// [`GuardAtom::threshold`] and [`GuardAtom::holds_for`] describe.
    pub fn is_token_count(&self) -> bool {
        matches!(self, GuardAtom::Active { .. } | GuardAtom::Tokens { .. })
    }

    /// True for the atoms decided from the gate's routing read back to the host (every
    /// atom but a cache residency).
    pub fn reads_routing(&self) -> bool {
        !matches!(self, GuardAtom::Resident { .. })
    }

    /// The atom as "routed tokens >= threshold": `active` is a threshold of 1. For the
    /// atoms that are not token counts, the threshold of their own quantity in an
    /// order-preserving integer form: 1 for a residency (0 = miss, 1 = hit), the `f32`
    /// bits of a score's threshold.
    pub fn threshold(&self) -> u32 {
        match *self {
            GuardAtom::Active { .. } | GuardAtom::Resident { .. } => 1,
            GuardAtom::Tokens { at_least, .. } => at_least,
            GuardAtom::Score { at_least_bits, .. } => at_least_bits,
        }
    }

    /// Decides the atom from the tokens the expert received (from its micro-batch, or
    /// summed over the step's).
    pub fn holds_for(&self, routed_tokens: u64) -> bool {
        routed_tokens >= u64::from(self.threshold())
    }
}

impl GuardAtom {
    /// The atom as the schedule writes it: `active(0, 3)`, `routed(0, 3, 1) >= 2`,
    /// `score_max(0, 3) >= 0.4`, and a residency with its cache's declared name,
    /// `ec.resident(0, 3)` (`caches` is [`crate::ir::Program::caches`], which the atom
    /// indexes).
    pub fn text(&self, caches: &[Cache]) -> String {
        let ub = self.ub().map(|u| format!(", {u}")).unwrap_or_default();
        match *self {
            GuardAtom::Active { layer, expert, .. } => format!("active({layer}, {expert}{ub})"),
            GuardAtom::Tokens {
                layer,
                expert,
                at_least,
                ..
            } => format!("routed({layer}, {expert}{ub}) >= {at_least}"),
            GuardAtom::Resident {
                cache,
                layer,
                expert,
            } => format!("{}.resident({layer}, {expert})", cache_name(caches, cache)),
            GuardAtom::Score {
                kind,
                layer,
                expert,
                at_least_bits,
                ..
            } => format!(
                "{}({layer}, {expert}{ub}) >= {}",
                kind.as_str(),
                f32::from_bits(at_least_bits)
            ),
        }
    }
}

/// The declared name of cache `index`; an index no cache has (a program built by hand,
/// not by elaboration) says so rather than borrowing another cache's name.
fn cache_name(caches: &[Cache], index: u32) -> String {
    caches
        .get(index as usize)
        .map_or_else(|| format!("<cache {index} undeclared>"), |c| c.name.clone())
}

impl GuardLit {
    /// The literal as the schedule writes it (see [`GuardAtom::text`]); a negated
    /// comparison reads as the comparison it came from (`routed(0, 3) < 2`, not
    /// `!(routed(0, 3) >= 2)`).
    pub fn text(&self, caches: &[Cache]) -> String {
        match (self.negated, self.atom) {
            (false, atom) => atom.text(caches),
            (true, GuardAtom::Active { .. } | GuardAtom::Resident { .. }) => {
                format!("!{}", self.atom.text(caches))
            }
            (
                true,
                GuardAtom::Score {
                    kind,
                    layer,
                    expert,
                    ub,
                    at_least_bits,
                },
            ) => {
                let ub = ub.map(|u| format!(", {u}")).unwrap_or_default();
                let t = f32::from_bits(at_least_bits);
                format!("{}({layer}, {expert}{ub}) < {t}", kind.as_str())
            }
            (
                true,
                GuardAtom::Tokens {
                    layer,
                    expert,
                    ub,
                    at_least,
                },
            ) => {
                let ub = ub.map(|u| format!(", {u}")).unwrap_or_default();
                format!("routed({layer}, {expert}{ub}) < {at_least}")
            }
        }
    }
}

/// A possibly negated atom.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GuardLit {
    /// The condition.
    pub atom: GuardAtom,
    /// True for `!atom`.
    pub negated: bool,
}

/// A conjunction of literals; the task runs only when all hold. Empty = always runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Guard {
    /// The literals, sorted and deduplicated.
    pub lits: Vec<GuardLit>,
}

impl Guard {
    /// True when the task always runs.
    pub fn is_always(&self) -> bool {
        self.lits.is_empty()
    }

    /// Whether every literal of `self` is also in `other` (so `other` implies `self`).
    pub fn implied_by(&self, other: &Guard) -> bool {
        self.lits.iter().all(|l| other.lits.contains(l))
    }

    /// The guard as the schedule writes it, literals joined by `&&` (see
    /// [`GuardLit::text`]; `caches` is [`crate::ir::Program::caches`]); empty when it
    /// always holds.
    pub fn text(&self, caches: &[Cache]) -> String {
        let text: Vec<String> = self.lits.iter().map(|l| l.text(caches)).collect();
        text.join(" && ")
    }
}
