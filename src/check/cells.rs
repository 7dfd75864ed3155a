//! The byte-range map value tracking keeps per buffer (which tensor piece each run of
//! bytes holds, who wrote it, under which run-time guard), and the guard logic that
//! decides whether a guarded write may be trusted by a reader.

use crate::ir::value::Piece;
use crate::ir::{Guard, GuardAtom, GuardLit, TaskId};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Cell {
    pub(super) end: u64,
    pub(super) piece: Option<Piece>,
    pub(super) writer: Option<TaskId>,
    pub(super) guard: Guard,
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

/// Whether literal `a` implies literal `b` (`active(i, e, j)` implies `active(i, e)`).
pub(super) fn lit_implies(a: &GuardLit, b: &GuardLit) -> bool {
    if a == b {
        return true;
    }
    let (
        GuardAtom::Active {
            layer: la,
            expert: ea,
            ub: ua,
        },
        GuardAtom::Active {
            layer: lb,
            expert: eb,
            ub: ub_b,
        },
    ) = (a.atom, b.atom);
    if la != lb || ea != eb || a.negated != b.negated {
        return false;
    }
    if a.negated {
        ua.is_none() && ub_b.is_some()
    } else {
        ua.is_some() && ub_b.is_none()
    }
}

/// Whether `reader` implies `writer` (every literal of the writer follows from the reader's).
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
