//! Which activation copies may move only the rows the step's tokens occupy.
//!
//! Takes what value tracking knows at a copy (which tensor its source holds, from which
//! step run); gives, per copy, the micro-batch and row size ([`LiveRows`]) when in every
//! run the checker walks the source holds, from its first copied byte, one activation of
//! the running step: a residual stream, QKV, attention output, routing, expert sums or
//! logits. Those tensors are only ever read by the ops of the run that made them (the
//! checker's epochs), each op reads the rows of its own micro-batch (the tensor names its
//! micro-batch, and op signatures match it), and every backend lays an activation of `n`
//! rows out packed by `n` (`ir::LiveRows`), so a reader never finds a row the copy left
//! out. Sampled tokens are not among them: the next run's `embed` reads them, and its
//! micro-batch may hold other sequences. Anything else (weights, KV caches, which have
//! `.context()` / `.appended()`, a source that holds another run's value or pieces of
//! several tensors, or a copy whose source differs between runs) is copied whole, which
//! is always sound; a schedule never says which, so it cannot get it wrong.

use super::cells::Cell;
use crate::ir::catalog::ArgType;
use crate::ir::value::{Piece, Tensor};
use crate::ir::{LiveRows, Program, Task};

/// What the runs seen so far say about one copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Seen {
    /// Not visited (a step the epochs do not run).
    #[default]
    Unseen,
    /// Every visit found these rows.
    Rows(LiveRows),
    /// Some visit found no single activation of the run, or other rows: copied whole.
    Whole,
}

impl Seen {
    /// Joins one more visit's finding.
    pub(super) fn join(self, now: Option<LiveRows>) -> Seen {
        match (self, now) {
            (Seen::Unseen, Some(rows)) => Seen::Rows(rows),
            (Seen::Rows(seen), Some(rows)) if seen == rows => Seen::Rows(seen),
            _ => Seen::Whole,
        }
    }

    /// The rows every visit agreed on.
    pub(super) fn rows(self) -> Option<LiveRows> {
        match self {
            Seen::Rows(rows) => Some(rows),
            Seen::Unseen | Seen::Whole => None,
        }
    }
}

/// The activation type and micro-batch of a tensor whose rows a copy may trim.
fn activation(tensor: &Tensor) -> Option<(ArgType, u32)> {
    Some(match *tensor {
        Tensor::Residual { ub, .. } => (ArgType::Hidden, ub),
        Tensor::Qkv { ub, .. } => (ArgType::Qkv, ub),
        Tensor::AttnOut { ub, .. } => (ArgType::AttnOut, ub),
        Tensor::Routing { ub, .. } | Tensor::Lookahead { ub, .. } => (ArgType::Routing, ub),
        Tensor::ExpertAcc { ub, .. } => (ArgType::ExpertAcc, ub),
        Tensor::Logits { ub } => (ArgType::Logits, ub),
        _ => return None,
    })
}

/// The rows a copy's source holds in this visit: `runs_in` (the source slice's cells, in
/// order, clipped to it) must cover `[start, start + len)` with pieces of one activation
/// tensor at consecutive offsets from 0, every piece written in run `now`.
pub(super) fn held_rows(
    program: &Program,
    task: &Task,
    runs_in: &[(u64, u64, Cell)],
    start: u64,
    len: u64,
    now: u32,
) -> Option<LiveRows> {
    let (_, _, first) = runs_in.first()?;
    let tensor = first.piece?.tensor;
    let (ty, ub) = activation(&tensor)?;
    let mut at = start;
    for (lo, hi, cell) in runs_in {
        let whole_piece = cell.piece
            == Some(Piece {
                tensor,
                offset: lo - start,
            });
        if *lo != at || !whole_piece || cell.epoch != Some(now) {
            return None;
        }
        at = *hi;
    }
    if at < start + len {
        return None;
    }
    let (unit, row_bytes) = ty.row(&program.model, task.shape.act_bytes)?;
    Some(LiveRows {
        ub,
        unit,
        row_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::RowUnit;

    const ROWS: LiveRows = LiveRows {
        ub: 0,
        unit: RowUnit::Token,
        row_bytes: 512,
    };

    #[test]
    fn a_copy_is_trimmed_only_when_every_visit_agrees() {
        assert_eq!(Seen::Unseen.join(Some(ROWS)).rows(), Some(ROWS));
        assert_eq!(
            Seen::Unseen.join(Some(ROWS)).join(Some(ROWS)).rows(),
            Some(ROWS)
        );
        let other = LiveRows { ub: 1, ..ROWS };
        assert_eq!(Seen::Unseen.join(Some(ROWS)).join(Some(other)), Seen::Whole);
        assert_eq!(Seen::Unseen.join(Some(ROWS)).join(None), Seen::Whole);
        // Once whole, always whole.
        assert_eq!(Seen::Unseen.join(None).join(Some(ROWS)), Seen::Whole);
        assert_eq!(Seen::Unseen.rows(), None);
    }

    #[test]
    fn sampled_tokens_kv_caches_and_weights_are_never_trimmed() {
        assert!(activation(&Tensor::Tokens { ub: 0 }).is_none());
        assert!(activation(&Tensor::KvCache { layer: 0, ub: 0 }).is_none());
        assert!(activation(&Tensor::Head).is_none());
        assert_eq!(
            activation(&Tensor::ExpertAcc { layer: 1, ub: 2 }),
            Some((ArgType::ExpertAcc, 2))
        );
    }
}
