//! Which expert a task names: one known when the schedule is compiled, or one chosen at run
//! time (`hot(..)`, a cache's `predicted(..)`). A leaf of the IR: the op catalog and the
//! value signatures both name it.

use serde::{Deserialize, Serialize};

/// An expert, known at compile time or only at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ExpertRef {
    /// Expert `e`.
    Index(u32),
    /// `hot(layer, rank)`: the expert at position `rank` of layer `layer`'s run-time order,
    /// predicted hot experts first, then the others in routing (arrival) order. Ranks
    /// `0..experts` name every expert exactly once.
    Hot {
        /// The layer whose order is meant.
        layer: u32,
        /// Position in that order.
        rank: u32,
    },
    /// `CACHE.predicted(layer, rank)`: the expert an expert cache's predictor ranks at
    /// `rank` for `layer` when the prefetch naming it starts (only prefetches name it: a
    /// prediction decides what is copied, never what is computed).
    Predicted {
        /// Index into [`crate::ir::Program::caches`].
        cache: u32,
        /// The layer predicted.
        layer: u32,
        /// Position in the predictor's ranking (0: most likely).
        rank: u32,
    },
}

impl ExpertRef {
    /// True for the experts only known at run time (`hot(..)`, `predicted(..)`).
    pub fn is_run_time(self) -> bool {
        !matches!(self, ExpertRef::Index(_))
    }
}

impl std::fmt::Display for ExpertRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertRef::Index(e) => write!(f, "{e}"),
            ExpertRef::Hot { layer, rank } => write!(f, "hot({layer}, {rank})"),
            ExpertRef::Predicted { layer, rank, .. } => write!(f, "predicted({layer}, {rank})"),
        }
    }
}
