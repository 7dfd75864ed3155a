//! The byte-range map value tracking keeps per buffer (which tensor piece each run of
//! bytes holds, from which step run, who wrote it, under which run-time guard of which
//! step run, and for an expert accumulator which expert outputs it holds), and the guard
//! logic that decides whether a guarded write may be trusted by a reader (literals on
//! routed counts, `active` being "at least 1", imply each other by threshold and scope).

use super::arms::Output;
use crate::ir::catalog::ExpertRef;
use crate::ir::value::Piece;
use crate::ir::{Guard, GuardAtom, GuardLit, TaskId};
use std::collections::BTreeMap;
use std::rc::Rc;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Cell {
    pub(super) end: u64,
    pub(super) piece: Option<Piece>,
    pub(super) writer: Option<TaskId>,
    pub(super) guard: Guard,
    /// The step run (index into the tracker's run plan) the value belongs to; `None` for
    /// values that belong to no step (weights of a fixed expert or part).
    pub(super) epoch: Option<u32>,
    /// The step run whose routing `guard` was decided from (meaningless when the guard is
    /// empty): a guard only says something about the step run it was evaluated in.
    pub(super) guard_epoch: u32,
    /// For an expert accumulator: the expert outputs it holds (who computed which experts
    /// under which guard). Copies carry them; `combine` proves they cover each routed
    /// expert exactly once.
    pub(super) outputs: Rc<Vec<Output>>,
}

pub(super) type Cells = BTreeMap<u64, Cell>;

/// `(start, end, cell)` runs of a byte range.
pub(super) type Runs = Vec<(u64, u64, Cell)>;

pub(super) fn new_cells(bytes: u64) -> Cells {
    let mut cells = BTreeMap::new();
    cells.insert(
        0,
        Cell {
            end: bytes.max(1),
            piece: None,
            writer: None,
            guard: Guard::default(),
            epoch: None,
            guard_epoch: 0,
            outputs: Rc::default(),
        },
    );
    cells
}

pub(super) fn split_at(cells: &mut Cells, pos: u64) {
    let Some((&start, cell)) = cells.range(..=pos).next_back() else {
        return;
    };
    if start < pos && pos < cell.end {
        let mut right = cell.clone();
        if let Some(piece) = &mut right.piece {
            piece.offset += pos - start;
        }
        if let Some(left) = cells.get_mut(&start) {
            left.end = pos;
        }
        cells.insert(pos, right);
    }
}

/// `(start, end, cell)` runs of a range, clipped to it.
pub(super) fn runs(cells: &Cells, start: u64, end: u64) -> Vec<(u64, u64, Cell)> {
    let mut out = Vec::new();
    let first = cells.range(..=start).next_back().map_or(start, |(k, _)| *k);
    for (&s, cell) in cells.range(first..end) {
        let lo = s.max(start);
        let hi = cell.end.min(end);
        if lo < hi {
            let mut c = cell.clone();
            if let Some(piece) = &mut c.piece {
                piece.offset += lo - s;
            }
            out.push((lo, hi, c));
        }
    }
    out
}

pub(super) fn write(cells: &mut Cells, start: u64, runs_in: Vec<(u64, u64, Cell)>) {
    let Some(end) = runs_in.last().map(|r| r.1) else {
        return;
    };
    split_at(cells, start);
    split_at(cells, end);
    let keys: Vec<u64> = cells.range(start..end).map(|(k, _)| *k).collect();
    for k in keys {
        cells.remove(&k);
    }
    for (lo, hi, mut cell) in runs_in {
        cell.end = hi;
        cells.insert(lo, cell);
    }
}

/// Whether literal `a` implies literal `b`: both count the tokens of the same expert of
/// the same layer, as "count >= threshold" (`active` is a threshold of 1). A count over
/// one micro-batch is at most the count over all of them, so `tokens(i, e, j) >= 5`
/// implies `tokens(i, e) >= 2`, and `!active(i, e)` implies `!active(i, e, j)`.
pub(super) fn lit_implies(a: &GuardLit, b: &GuardLit) -> bool {
    if a == b {
        return true;
    }
    let (x, y) = (a.atom, b.atom);
    // Only atoms of one quantity compare by threshold: token counts with token counts,
    // a score with the same statistic of scores (the largest or summed weight over every
    // micro-batch is at least one micro-batch's, as a count is); a residency only with
    // itself (above).
    let comparable = match (x, y) {
        (GuardAtom::Score { kind: k, .. }, GuardAtom::Score { kind: j, .. }) => k == j,
        _ => x.is_token_count() && y.is_token_count(),
    };
    if !comparable {
        return false;
    }
    if x.layer() != y.layer() || x.expert() != y.expert() || a.negated != b.negated {
        return false;
    }
    // Scope of `b` contains scope of `a` (a sum over all ubs contains one ub's count).
    let b_wider = y.ub().is_none() || y.ub() == x.ub();
    let a_wider = x.ub().is_none() || x.ub() == y.ub();
    if a.negated {
        // count_a < ta  =>  count_b < tb  when count_b <= count_a and ta <= tb.
        a_wider && x.threshold() <= y.threshold()
    } else {
        // count_a >= ta  =>  count_b >= tb  when count_b >= count_a and ta >= tb.
        b_wider && x.threshold() >= y.threshold()
    }
}

/// Whether `reader` implies `writer` (every literal of the writer follows from the reader's).
/// Literal by literal: `a && b` implies `c` only if `a` or `b` alone implies `c`, so an
/// implication that needs two literals together is not found (sound, not complete), and
/// a negated literal implies only negated literals of the same expert.
pub(super) fn implies(reader: &Guard, writer: &Guard) -> bool {
    writer
        .lits
        .iter()
        .all(|w| reader.lits.iter().any(|r| lit_implies(r, w)))
}

pub(super) fn union(a: &Guard, b: &Guard) -> Guard {
    let mut lits = a.lits.clone();
    lits.extend(b.lits.iter().copied());
    lits.sort();
    lits.dedup();
    Guard { lits }
}

/// The guard epoch a value keeps when `guards` (with their epochs) are combined in step run
/// `epoch`: `epoch` when every non-empty guard was decided in this run, else the oldest
/// run one of them was decided in (so the combined guard is never trusted now).
pub(super) fn combined_guard_epoch<'a>(
    guards: impl IntoIterator<Item = (&'a Guard, u32)>,
    epoch: u32,
) -> u32 {
    guards
        .into_iter()
        .filter(|(g, e)| !g.is_always() && *e != epoch)
        .map(|(_, e)| e)
        .min()
        .unwrap_or(epoch)
}

/// Whether a task guarded by `guard` runs whenever expert `expert` of `layer` receives
/// tokens from micro-batch `ub`: every literal must follow from `active(layer, expert,
/// ub)`, i.e. be `active(layer, expert)` or `active(layer, expert, ub)` itself. A negated
/// literal never follows (skipping an active expert loses its contribution).
pub(super) fn runs_when_active(guard: &Guard, layer: u32, expert: ExpertRef, ub: u32) -> bool {
    guard.lits.iter().all(|lit| match lit.atom {
        GuardAtom::Active {
            layer: l,
            expert: e,
            ub: u,
        } => !lit.negated && l == layer && e == expert && u.is_none_or(|u| u == ub),
        GuardAtom::Tokens { .. } | GuardAtom::Resident { .. } | GuardAtom::Score { .. } => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lit(layer: u32, expert: ExpertRef, ub: Option<u32>, negated: bool) -> GuardLit {
        GuardLit {
            atom: GuardAtom::Active { layer, expert, ub },
            negated,
        }
    }

    fn guard(lits: &[GuardLit]) -> Guard {
        let mut lits = lits.to_vec();
        lits.sort();
        Guard { lits }
    }

    const HOT: ExpertRef = ExpertRef::Hot { layer: 1, rank: 3 };

    #[test]
    fn an_expert_task_may_be_guarded_only_by_its_own_activity() {
        let any = guard(&[lit(1, HOT, None, false)]);
        let this_ub = guard(&[lit(1, HOT, None, false), lit(1, HOT, Some(0), false)]);
        assert!(runs_when_active(&Guard::default(), 1, HOT, 0));
        assert!(runs_when_active(&any, 1, HOT, 0));
        assert!(runs_when_active(&this_ub, 1, HOT, 0));
        // Another micro-batch's activity, another expert, another layer: may skip it.
        assert!(!runs_when_active(&this_ub, 1, HOT, 1));
        assert!(!runs_when_active(&any, 1, ExpertRef::Index(3), 0));
        assert!(!runs_when_active(&any, 2, HOT, 0));
        // Klotski's negated mutants: skipped exactly when the expert has tokens.
        let negated = guard(&[lit(1, HOT, None, true), lit(1, HOT, Some(0), false)]);
        assert!(!runs_when_active(&negated, 1, HOT, 0));
        let negated_ub = guard(&[lit(1, HOT, None, false), lit(1, HOT, Some(0), true)]);
        assert!(!runs_when_active(&negated_ub, 1, HOT, 0));
    }

    #[test]
    fn negation_implies_only_negation_of_a_narrower_atom() {
        let none_anywhere = guard(&[lit(1, HOT, None, true)]);
        let none_from_ub0 = guard(&[lit(1, HOT, Some(0), true)]);
        let some = guard(&[lit(1, HOT, None, false)]);
        // No tokens from any ub => none from ub 0; not the other way round.
        assert!(implies(&none_anywhere, &none_from_ub0));
        assert!(!implies(&none_from_ub0, &none_anywhere));
        // A negated literal never implies the positive one (nor the reverse).
        assert!(!implies(&none_anywhere, &some));
        assert!(!implies(&some, &none_anywhere));
        assert!(implies(&some, &Guard::default()));
        assert!(!implies(&Guard::default(), &some));
    }

    #[test]
    fn a_guard_decided_in_an_earlier_run_keeps_that_run() {
        let g = guard(&[lit(0, ExpertRef::Index(1), None, false)]);
        let always = Guard::default();
        assert_eq!(combined_guard_epoch([(&g, 5), (&always, 2)], 5), 5);
        assert_eq!(combined_guard_epoch([(&g, 3), (&g, 4)], 5), 3);
        // An empty guard says nothing, whatever run it was "decided" in.
        assert_eq!(combined_guard_epoch([(&always, 1)], 5), 5);
    }
}
