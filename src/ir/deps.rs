//! Dependencies by the sequential-task-flow rule, then transitive reduction.
//!
//! Takes a [`Program`]; gives a [`Dag`]: for every task, the earlier tasks it must wait
//! for, with why (stream order, RAW/WAR/WAW on overlapping bytes of one buffer, explicit
//! `after`), with redundant edges removed. Steps of the build, each one function:
//! 1. [`candidate_edges`]: one pass in issue order; per buffer an interval map of "last writer,
//!    readers since" segments, so each access costs O(segments it overlaps), never
//!    all-pairs. Reads of the read-only checkpoint create no edges.
//! 2. `reduce`: transitive reduction in issue (= topological) order. Every task sits on
//!    one stream and consecutive tasks of a stream are always joined by an edge, so the
//!    ancestors of a task, restricted to one stream, are a prefix of that stream: a task's
//!    ancestor set is one integer per stream (the last ancestor's position on it). A
//!    candidate edge `p -> v` is redundant iff `p` is within that prefix for a kept, later
//!    predecessor. O(edges x streams) time, O(tasks x streams) memory. A bitset version
//!    ([`Reduction::Bitsets`], O(n^2) bits) is kept as an independent check. Every edge goes
//!    from an earlier to a later task, so the graph is acyclic by construction.

use super::{Access, BufferId, Program, TaskId};
use serde::Serialize;
use std::collections::BTreeMap;

/// Why one task waits for another (several reasons may hold at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub struct DepKinds(pub u8);

impl DepKinds {
    /// The previous task on the same stream.
    pub const STREAM: u8 = 1;
    /// Read after write: real data flow.
    pub const RAW: u8 = 2;
    /// Write after read: a buffer is reused.
    pub const WAR: u8 = 4;
    /// Write after write.
    pub const WAW: u8 = 8;
    /// An explicit `after`.
    pub const AFTER: u8 = 16;

    /// Whether a reason is present.
    pub fn has(self, kind: u8) -> bool {
        self.0 & kind != 0
    }

    /// True when the edge exists only because a buffer is reused (WAR/WAW, no data flow,
    /// no stream order, no explicit request).
    pub fn is_reuse_only(self) -> bool {
        self.0 & (Self::WAR | Self::WAW) != 0
            && self.0 & (Self::RAW | Self::STREAM | Self::AFTER) == 0
    }

    /// `stream+raw` style rendering.
    pub fn describe(self) -> String {
        let names = [
            (Self::STREAM, "stream"),
            (Self::RAW, "raw"),
            (Self::WAR, "war"),
            (Self::WAW, "waw"),
            (Self::AFTER, "after"),
        ];
        names
            .iter()
            .filter(|(k, _)| self.has(*k))
            .map(|(_, n)| *n)
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// One edge: `to` waits for `from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Dep {
    /// The earlier task.
    pub from: TaskId,
    /// The later task.
    pub to: TaskId,
    /// The underlying cause, as the library or the OS reported it.
    pub kinds: DepKinds,
    /// The first buffer that caused a data hazard, if any.
    pub buffer: Option<BufferId>,
}

/// The reduced dependency graph, as flat arrays (bevy's `SystemSchedule` pattern).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Dag {
    /// Kept edges, sorted by `(to, from)`.
    pub edges: Vec<Dep>,
    /// `edges[pred_start[t]..pred_start[t + 1]]` are the edges into task `t`.
    pub pred_start: Vec<u32>,
    /// Edges found before reduction.
    pub edges_before_reduction: usize,
}

impl Dag {
    /// Edges into a task (its direct predecessors after reduction).
    pub fn preds(&self, task: TaskId) -> &[Dep] {
        let i = task.index();
        match (self.pred_start.get(i), self.pred_start.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.edges[a as usize..b as usize],
            _ => &[],
        }
    }

    /// Predecessor ids of every task (data deps, stream order and `after`, reduced).
    pub fn pred_ids(&self) -> Vec<Vec<TaskId>> {
        (0..self.task_count())
            .map(|t| self.preds(TaskId::new(t)).iter().map(|d| d.from).collect())
            .collect()
    }

    /// Number of tasks.
    pub fn task_count(&self) -> usize {
        self.pred_start.len().saturating_sub(1)
    }

    /// Successor lists, computed on demand.
    pub fn succs(&self) -> Vec<Vec<TaskId>> {
        let mut out = vec![Vec::new(); self.task_count()];
        for e in &self.edges {
            out[e.from.index()].push(e.to);
        }
        out
    }

    /// The DAG as a petgraph graph (node `i` is task `i`), for graph algorithms and export.
    pub fn to_petgraph(&self) -> petgraph::graph::DiGraph<TaskId, DepKinds> {
        let mut graph =
            petgraph::graph::DiGraph::with_capacity(self.task_count(), self.edges.len());
        for i in 0..self.task_count() {
            graph.add_node(TaskId::new(i));
        }
        for e in &self.edges {
            graph.add_edge(
                petgraph::graph::NodeIndex::new(e.from.index()),
                petgraph::graph::NodeIndex::new(e.to.index()),
                e.kinds,
            );
        }
        graph
    }
}

/// How transitive reduction finds redundant edges (both give the same graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Per-stream ancestor prefixes: fast and small; the default.
    Chains,
    /// Ancestor bitsets: n^2/2 bits; an independent check for tests.
    Bitsets,
}

/// Candidate edges into each task before reduction: `(from, reasons, buffer)`.
pub type Candidates = Vec<Vec<(TaskId, DepKinds, Option<BufferId>)>>;

/// Builds the reduced DAG of a program.
pub fn build(program: &Program) -> Dag {
    build_with(program, Reduction::Chains)
}

/// Builds the reduced DAG with a chosen reduction algorithm.
pub fn build_with(program: &Program, reduction: Reduction) -> Dag {
    let candidates = candidate_edges(program);
    let before = candidates.iter().map(Vec::len).sum();
    let kept = match reduction {
        Reduction::Chains => {
            let streams: Vec<usize> = program.tasks.iter().map(|t| t.stream.index()).collect();
            reduce_chains(candidates, &streams, program.streams.len())
        }
        Reduction::Bitsets => reduce_bitsets(candidates),
    };
    assemble(kept, before)
}

#[derive(Debug, Clone)]
struct Segment {
    end: u64,
    writer: Option<TaskId>,
    readers: Vec<TaskId>,
}

/// Per buffer: segments keyed by start, covering `[0, bytes)` without gaps.
struct BufferState {
    segments: BTreeMap<u64, Segment>,
}

impl BufferState {
    fn new(bytes: u64) -> Self {
        let mut segments = BTreeMap::new();
        segments.insert(
            0,
            Segment {
                end: bytes.max(1),
                writer: None,
                readers: Vec::new(),
            },
        );
        BufferState { segments }
    }

    /// Ensures a segment boundary at `pos`.
    fn split_at(&mut self, pos: u64) {
        let Some((&start, seg)) = self.segments.range(..=pos).next_back() else {
            return;
        };
        if start < pos && pos < seg.end {
            let mut right = seg.clone();
            if let Some(left) = self.segments.get_mut(&start) {
                left.end = pos;
            }
            right.end = right.end.max(pos);
            self.segments.insert(
                pos,
                Segment {
                    end: right.end,
                    writer: right.writer,
                    readers: right.readers,
                },
            );
        }
    }

    fn access(
        &mut self,
        start: u64,
        end: u64,
        access: Access,
        task: TaskId,
        edges: &mut Vec<(TaskId, u8)>,
    ) {
        if start >= end {
            return;
        }
        self.split_at(start);
        self.split_at(end);
        let keys: Vec<u64> = self.segments.range(start..end).map(|(k, _)| *k).collect();
        for key in &keys {
            let Some(seg) = self.segments.get_mut(key) else {
                continue;
            };
            if let Some(w) = seg.writer {
                if access.reads() {
                    edges.push((w, DepKinds::RAW));
                }
                if access.writes() {
                    edges.push((w, DepKinds::WAW));
                }
            }
            if access.writes() {
                edges.extend(seg.readers.iter().map(|&r| (r, DepKinds::WAR)));
            } else if seg.readers.last() != Some(&task) {
                seg.readers.push(task);
            }
        }
        if access.writes() {
            for key in &keys {
                self.segments.remove(key);
            }
            self.segments.insert(
                start,
                Segment {
                    end,
                    writer: Some(task),
                    readers: Vec::new(),
                },
            );
        }
    }
}

/// Every edge the sequential-task-flow rule gives, per task, before reduction.
pub fn candidate_edges(program: &Program) -> Candidates {
    let mut out = Vec::with_capacity(program.tasks.len());
    each_task_edges(program, |found| out.push(found.to_vec()));
    out
}

/// The dependency graph with every candidate edge kept (no transitive reduction): the
/// same reachability as [`build`]'s, since a reduction removes only implied edges. For a
/// check that asks only what is ordered before what (`check::cache`) on a program that is
/// scored and dropped (a planner's point), without the reduction's cost.
pub fn unreduced(program: &Program) -> Dag {
    let candidates = candidate_edges(program);
    let before = candidates.iter().map(Vec::len).sum();
    assemble(candidates, before)
}

/// [`candidate_edges`]' predecessors alone, per task, in the same order: what a prediction
/// needs (`cost::predict`), built without the kinds and buffers (one vector per task with
/// predecessors, none for a task without).
pub fn candidate_preds(program: &Program) -> Vec<Vec<TaskId>> {
    let mut out = Vec::with_capacity(program.tasks.len());
    each_task_edges(program, |found| {
        out.push(found.iter().map(|&(from, _, _)| from).collect())
    });
    out
}

/// Calls `sink` with each task's candidate edges, in task order (the slice is reused).
fn each_task_edges(
    program: &Program,
    mut sink: impl FnMut(&[(TaskId, DepKinds, Option<BufferId>)]),
) {
    let experts = program.model.experts;
    let mut states: Vec<Option<BufferState>> = program.buffers.iter().map(|_| None).collect();
    let mut last_on_stream: Vec<Option<TaskId>> = vec![None; program.streams.len()];
    let mut raw_edges: Vec<(TaskId, u8)> = Vec::new();
    let mut found: Vec<(TaskId, DepKinds, Option<BufferId>)> = Vec::new();
    // Only a cache's slots are bound to fetches; without caches nothing is (and the
    // per-task table is not built).
    let bound = (!program.caches.is_empty()).then(|| super::cache::bindings(program));
    for (index, task) in program.tasks.iter().enumerate() {
        let id = TaskId::new(index);
        found.clear();
        let mut add = |from: TaskId, kind: u8, buffer: Option<BufferId>| {
            if from == id {
                return;
            }
            match found.iter_mut().find(|(f, _, _)| *f == from) {
                Some(entry) => {
                    entry.1 .0 |= kind;
                    if entry.2.is_none() {
                        entry.2 = buffer;
                    }
                }
                None => found.push((from, DepKinds(kind), buffer)),
            }
        };
        if let Some(prev) = last_on_stream.get(task.stream.index()).copied().flatten() {
            add(prev, DepKinds::STREAM, None);
        }
        if let Some(slot) = last_on_stream.get_mut(task.stream.index()) {
            *slot = Some(id);
        }
        for &a in &task.after {
            add(a, DepKinds::AFTER, None);
        }
        // Reads first, then writes, so a task never waits for its own access.
        let mut ordered: smallvec::SmallVec<[&super::Arg; 6]> = task
            .args
            .iter()
            .filter(|a| a.access == Access::Read)
            .collect();
        ordered.extend(task.args.iter().filter(|a| a.access != Access::Read));
        // A cache slot is chosen at run time: a reader waits for the fetch that makes its
        // expert resident (the runtime keeps that slot until its readers ran); nothing
        // else about a cache's bytes orders tasks.
        let fetches = bound.as_ref().map_or(&[][..], |b| b[index].as_slice());
        for (arg, fetch) in task.args.iter().zip(fetches) {
            if let (Some(fetch), true) = (fetch, arg.access.reads()) {
                add(*fetch, DepKinds::RAW, Some(arg.slice.buffer));
            }
        }
        for arg in ordered {
            if arg.slice.cache_key.is_some() {
                continue;
            }
            let buffer = &program.buffers[arg.slice.buffer.index()];
            if buffer.kind.is_weights() && arg.access == Access::Read {
                continue;
            }
            let (start, end) = match arg.slice.dynamic_expert {
                Some(_) => (arg.slice.start, arg.slice.start + arg.slice.len * experts),
                None => (arg.slice.start, arg.slice.end()),
            };
            let state = states[arg.slice.buffer.index()]
                .get_or_insert_with(|| BufferState::new(buffer.bytes));
            raw_edges.clear();
            state.access(
                start,
                end.min(buffer.bytes.max(1)),
                arg.access,
                id,
                &mut raw_edges,
            );
            for &(from, kind) in &raw_edges {
                add(from, kind, Some(arg.slice.buffer));
            }
        }
        sink(&found);
    }
}

/// Transitive reduction by per-stream ancestor prefixes (see the module header).
fn reduce_chains(candidates: Candidates, streams: &[usize], n_streams: usize) -> Candidates {
    let n = candidates.len();
    let width = n_streams.max(1);
    let mut position = vec![0i64; n];
    let mut count = vec![0i64; width];
    for (t, &s) in streams.iter().enumerate() {
        position[t] = count[s];
        count[s] += 1;
    }
    // prefix[v * width + s]: position of v's last ancestor on stream s (-1: none).
    let mut prefix = vec![-1i64; n * width];
    let mut kept = Vec::with_capacity(n);
    let mut reach = vec![-1i64; width];
    for (v, mut preds) in candidates.into_iter().enumerate() {
        preds.sort_by_key(|p| std::cmp::Reverse(p.0));
        reach.fill(-1);
        let mut keep = Vec::with_capacity(preds.len());
        for pred in preds {
            let p = pred.0.index();
            if position[p] <= reach[streams[p]] {
                continue;
            }
            for (r, a) in reach.iter_mut().zip(&prefix[p * width..(p + 1) * width]) {
                *r = (*r).max(*a);
            }
            reach[streams[p]] = reach[streams[p]].max(position[p]);
            keep.push(pred);
        }
        prefix[v * width..(v + 1) * width].copy_from_slice(&reach);
        kept.push(keep);
    }
    kept
}

/// Transitive reduction with ancestor bitsets (quadratic memory; the tests' reference).
fn reduce_bitsets(candidates: Candidates) -> Candidates {
    let n = candidates.len();
    let mut kept = Vec::with_capacity(n);
    // ancestors[v] has bit u set iff u reaches v; only bits below v are stored.
    let mut ancestors: Vec<Vec<u64>> = Vec::with_capacity(n);
    for (v, mut preds) in candidates.into_iter().enumerate() {
        preds.sort_by_key(|p| std::cmp::Reverse(p.0));
        let mut reach = vec![0u64; v / 64 + 1];
        let mut keep = Vec::with_capacity(preds.len());
        for pred in preds {
            let p = pred.0.index();
            if reach[p / 64] & (1 << (p % 64)) != 0 {
                continue;
            }
            reach[p / 64] |= 1 << (p % 64);
            for (word, bits) in reach.iter_mut().zip(&ancestors[p]) {
                *word |= bits;
            }
            keep.push(pred);
        }
        ancestors.push(reach);
        kept.push(keep);
    }
    kept
}

/// Flattens kept edges into the CSR form of [`Dag`].
fn assemble(kept: Candidates, before: usize) -> Dag {
    let n = kept.len();
    let mut edges = Vec::new();
    let mut pred_start = Vec::with_capacity(n + 1);
    for (v, mut keep) in kept.into_iter().enumerate() {
        pred_start.push(edges.len() as u32);
        keep.sort_by_key(|k| k.0);
        edges.extend(keep.into_iter().map(|(from, kinds, buffer)| Dep {
            from,
            to: TaskId::new(v),
            kinds,
            buffer,
        }));
    }
    pred_start.push(edges.len() as u32);
    Dag {
        edges,
        pred_start,
        edges_before_reduction: before,
    }
}
