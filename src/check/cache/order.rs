//! Which of a step's tasks finish before which start, as one number per task and stream:
//! what both cache checks ask about every pair of a cache's fetches, answered in O(1).
//!
//! A stream runs its tasks in issue order (the dependency graph always joins consecutive
//! tasks of a stream, `ir::deps`' STREAM edge; it is folded in here too), so a task's
//! ancestors on one stream are a prefix of that stream: an ancestor's earlier stream-mates
//! are ancestors of it, hence of the task. A task's ancestor set is then, per stream, how
//! many of the step's tasks on that stream are its ancestors (`ir::deps` reduces the graph
//! by the same fact), and `x` finishes before `y` starts exactly when `x` is an ancestor of
//! `y`: `x`'s position on its stream is under `y`'s count for that stream. The counts only
//! grow along a stream (a later task has every ancestor of an earlier stream-mate), which
//! the checks' sweeps rely on. Edges from earlier steps are left out: those steps have
//! finished, and a path between two tasks of a step never leaves it (edges go forward in
//! issue order and a step's tasks are contiguous).

use super::Preds;
use crate::ir::{Program, Step, TaskId};

/// The order of one step's tasks (see the module).
pub(super) struct Order {
    /// The step's first task.
    first: usize,
    /// Streams of the program (at least 1).
    streams: usize,
    /// Per task of the step: its position among the step's tasks on its stream.
    pos: Vec<u32>,
    /// Per task of the step: its stream.
    stream: Vec<u32>,
    /// Per task of the step, `streams` counts: how many of the step's tasks on each
    /// stream are its ancestors.
    reach: Vec<u32>,
}

impl Order {
    /// The order of `step`'s tasks under `preds` (any form of the dependency graph with
    /// its reachability), in one pass in issue order: O(tasks x (predecessors + 1) x
    /// streams).
    pub(super) fn new(program: &Program, preds: &(impl Preds + ?Sized), step: &Step) -> Order {
        let first = step.first as usize;
        let count = step.count as usize;
        let streams = program.streams.len().max(1);
        let mut order = Order {
            first,
            streams,
            pos: vec![0; count],
            stream: vec![0; count],
            reach: vec![0; count * streams],
        };
        let mut on_stream = vec![0u32; streams];
        let mut last: Vec<Option<usize>> = vec![None; streams];
        let mut from: Vec<usize> = Vec::new();
        for k in 0..count {
            let id = TaskId::new(first + k);
            let s = program.task(id).stream.index().min(streams - 1);
            from.clear();
            from.extend(last[s]);
            preds.each_pred(id, &mut |p| {
                // Only the step's own earlier tasks (a predecessor is always earlier).
                if let Some(p) = p.index().checked_sub(first).filter(|&p| p < k) {
                    from.push(p);
                }
            });
            let (done, rest) = order.reach.split_at_mut(k * streams);
            let mine = &mut rest[..streams];
            for &p in &from {
                for (r, a) in mine.iter_mut().zip(&done[p * streams..(p + 1) * streams]) {
                    *r = (*r).max(*a);
                }
                let ps = order.stream[p] as usize;
                mine[ps] = mine[ps].max(order.pos[p] + 1);
            }
            order.pos[k] = on_stream[s];
            order.stream[k] = s as u32;
            on_stream[s] += 1;
            last[s] = Some(k);
        }
        order
    }

    /// The task's index in the step, if it is one of the step's.
    fn at(&self, task: TaskId) -> Option<usize> {
        task.index()
            .checked_sub(self.first)
            .filter(|&k| k < self.pos.len())
    }

    /// Whether `x` finishes before `y` starts (both tasks of the step; false otherwise).
    pub(super) fn before(&self, x: TaskId, y: TaskId) -> bool {
        match (self.at(x), self.at(y)) {
            (Some(x), Some(y)) => {
                self.pos[x] < self.reach[y * self.streams + self.stream[x] as usize]
            }
            _ => false,
        }
    }

    /// The task's stream (a task of the step).
    pub(super) fn stream(&self, task: TaskId) -> usize {
        self.at(task).map_or(0, |k| self.stream[k] as usize)
    }

    /// The task's position among the step's tasks on its stream (a task of the step).
    pub(super) fn pos(&self, task: TaskId) -> u32 {
        self.at(task).map_or(0, |k| self.pos[k])
    }

    /// How many of the step's tasks on `stream` are ancestors of `task`: `x` on that
    /// stream finishes before `task` starts iff `pos(x)` is under it.
    pub(super) fn reach(&self, task: TaskId, stream: usize) -> u32 {
        self.at(task).map_or(0, |k| {
            self.reach[k * self.streams + stream.min(self.streams - 1)]
        })
    }

    /// Streams of the program (at least 1).
    pub(super) fn streams(&self) -> usize {
        self.streams
    }
}
