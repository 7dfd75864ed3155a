//! Expert caches: what holds for every run-time choice of slots.
//!
//! Takes a program and its dependency graph; reports, per step:
//! - `cache::unfetched`: a task reads `CACHE.slot(l, e)` with no `fetch` of that expert
//!   before it in the step (the fetch it is bound to, `ir::cache::bindings`, which the
//!   dependency graph orders it after), or may run when that fetch is skipped (its guard
//!   does not imply the fetch's). Together with the runtime holding a fetched slot until
//!   its readers ran, no read sees a slot before its fetch completed or after it was
//!   evicted;
//! - `cache::deadlock`: more fetched experts may be held at once than the cache has slots.
//!   A fetch holds its slot from its start until its last reader ran. When fetch `f`
//!   starts, a fetch `g` may hold a slot unless `g`'s readers all finished before `f`
//!   (ancestors of `f` in the dependency graph) or `g` starts after `f` (`f` is its
//!   ancestor). For each fetch, itself and the fetches that may hold a slot then are counted,
//!   those guarded by `active(l, e[, ub])` of their own expert at most as many per layer
//!   (and ub) as can receive tokens: in decode min(experts, sequences x top_k), in prefill
//!   every expert of the layer. If the largest count fits, a free slot always exists when
//!   a fetch misses, so no fetch waits on another (prefetches never hold a slot past their
//!   own copy and never wait).
//!
//! - `cache::stale_guard`: a task guarded by `CACHE.resident(l, e)` decides it when it is
//!   about to run, from the cache as it is then. Every fetch and prefetch into that cache
//!   (but a fetch guarded by its own key's residency, a hit) must be ordered before every
//!   task the guard decides or after all of them, so all of them see one answer: the
//!   arms stay exclusive and a hit the guard saw is still a hit when its fetch runs. A
//!   residency-guarded fetch needs no free slot (it hits), so `cache::deadlock` does not
//!   count it as waiting, only as holding.
//!
//! A predicted expert in a guard is refused here too (`elab::dynamic`): predictions decide
//! what is copied ahead, never what runs.
//!
//! Both orders are asked of a step's tasks through [`order::Order`] (per task and stream,
//! how many of that stream's tasks are its ancestors), and both checks sweep a stream's
//! fetches in order instead of asking every pair: O(fetches x readers x log fetches) a
//! step and cache, where the pairwise count was quadratic in the fetches (6,144 a step
//! for HOBBIT on qwen3-30b-a3b), which made it most of a planner point's time. The
//! pairwise checks are kept as the tests' reference (`reference`).

mod order;
#[cfg(test)]
mod reference;

use super::cells::implies;
use crate::diag::Diagnostic;
use crate::ir::cache::{bindings, CacheOp};
use crate::ir::deps::Dag;
use crate::ir::{ExpertRef, GuardAtom, Program, Step, StepKind, TaskId};
use order::Order;

/// A task's direct predecessors, from whichever form of the dependency graph the caller
/// holds: the checks ask only which task finishes before which, which every graph with
/// the same reachability answers alike (the reduced [`Dag`], or the unreduced lists of
/// [`crate::ir::deps::candidate_preds`] a planner's point already built).
pub trait Preds {
    /// Calls `each` with every direct predecessor of `task`.
    fn each_pred(&self, task: TaskId, each: &mut dyn FnMut(TaskId));
}

impl Preds for Dag {
    fn each_pred(&self, task: TaskId, each: &mut dyn FnMut(TaskId)) {
        self.preds(task).iter().for_each(|d| each(d.from));
    }
}

impl Preds for [Vec<TaskId>] {
    fn each_pred(&self, task: TaskId, each: &mut dyn FnMut(TaskId)) {
        if let Some(preds) = self.get(task.index()) {
            preds.iter().copied().for_each(each);
        }
    }
}

/// Runs the cache checks on `program` under its dependency graph `preds`.
pub fn check(program: &Program, preds: &(impl Preds + ?Sized), diags: &mut Vec<Diagnostic>) {
    if program.caches.is_empty() {
        return;
    }
    for (index, task) in program.tasks.iter().enumerate() {
        let predicted = task
            .guard
            .lits
            .iter()
            .any(|l| matches!(l.atom.expert(), ExpertRef::Predicted { .. }));
        if predicted {
            diags.push(Diagnostic::dynamic_not_allowed(
                program.task_span(TaskId::new(index)),
                "a predicted expert in a guard (predictions decide what is copied ahead, never what runs)",
            ));
        }
    }
    let bound = bindings(program);
    for (index, task) in program.tasks.iter().enumerate() {
        let id = TaskId::new(index);
        for (k, arg) in task.args.iter().enumerate() {
            let Some(key) = arg.slice.cache_key else {
                continue;
            };
            if arg.access.writes() && task.cache_op.is_none() {
                diags.push(Diagnostic::dynamic_not_allowed(
                    program.task_span(id),
                    "an op writing an expert cache slot (only `fetch` and `prefetch` fill a cache)",
                ));
            }
            if !arg.access.reads() {
                continue;
            }
            let cache = &program.caches[key.cache as usize];
            let slot = format!("{}.slot({}, {})", cache.name, key.layer, key.expert);
            let span = program
                .spans
                .task_args
                .get(index)
                .and_then(|a| a.get(k))
                .copied()
                .unwrap_or_else(|| program.task_span(id));
            match bound[index][k] {
                None => diags.push(Diagnostic::cache_unfetched(
                    span,
                    &program.task_name(id),
                    &slot,
                    None,
                    &task.guard.text(&program.caches),
                )),
                Some(fetch) => {
                    let f = program.task(fetch);
                    if !implies(&task.guard, &f.guard) {
                        diags.push(Diagnostic::cache_unfetched(
                            span,
                            &program.task_name(id),
                            &slot,
                            Some((
                                program.task_name(fetch),
                                program.task_span(fetch),
                                f.guard.text(&program.caches),
                            )),
                            &task.guard.text(&program.caches),
                        ));
                    }
                }
            }
        }
    }
    for step in &program.steps {
        // Built once a step has a cache's fetch or residency guard, shared by its caches.
        let mut order: Option<Order> = None;
        for cache in 0..program.caches.len() as u32 {
            let fetches = Fetches::of(program, &bound, step, cache);
            let guarded = Guarded::of(program, step, cache);
            if fetches.is_none() && guarded.is_none() {
                continue;
            }
            let order = order.get_or_insert_with(|| Order::new(program, preds, step));
            if let Some(fetches) = fetches {
                let held = fetches.held(order);
                fetches.report(program, step, cache, &held, diags);
            }
            if let Some(guarded) = guarded {
                if let Some(found) = guarded.first_stale(order) {
                    diags.push(guarded.diagnostic(program, cache, &found));
                }
            }
        }
    }
}

/// Whether `task` is a fetch guarded by its own key's residency (`if ec.resident(l, e) {
/// fetch .. -> ec.slot(l, e) }`): it hits whenever it runs, so it changes no slot.
fn self_hit(program: &Program, task: TaskId) -> bool {
    let t = program.task(task);
    if t.cache_op != Some(CacheOp::Fetch) {
        return false;
    }
    let Some(key) = t.args.iter().find_map(|a| a.slice.cache_key) else {
        return false;
    };
    let own = GuardAtom::Resident {
        cache: key.cache,
        layer: key.layer,
        expert: key.expert,
    };
    t.guard.lits.iter().any(|l| !l.negated && l.atom == own)
}

/// A residency guard: its cache's layer and expert.
type Atom = (u32, ExpertRef);

/// The residency guards of one cache in one step, for `cache::stale_guard`: each guard's
/// deciding tasks (step order), and the tasks that may change the cache.
struct Guarded {
    /// Per guard, in the order the step first names it: the tasks it guards.
    atoms: Vec<(Atom, Vec<TaskId>)>,
    /// Every fetch and prefetch into the cache but self-hits, in step order.
    changers: Vec<TaskId>,
}

/// A stale guard found: the guard (its index), the guarded task that may decide it on the
/// wrong side of the change, and the change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stale {
    atom: usize,
    guarded: TaskId,
    changer: TaskId,
}

impl Guarded {
    /// The guards and changers of `cache` in `step`; `None` when either is missing (no
    /// guard can go stale).
    fn of(program: &Program, step: &Step, cache: u32) -> Option<Guarded> {
        let mut atoms: Vec<(Atom, Vec<TaskId>)> = Vec::new();
        // Where each atom is in `atoms` (a step of HOBBIT has one per expert).
        let mut at: crate::ir::FastMap<Atom, usize> = crate::ir::FastMap::default();
        let mut changers: Vec<TaskId> = Vec::new();
        for id in step.task_ids() {
            let task = program.task(id);
            for lit in &task.guard.lits {
                if let GuardAtom::Resident {
                    cache: c,
                    layer,
                    expert,
                } = lit.atom
                {
                    if c != cache {
                        continue;
                    }
                    let atom = (layer, expert);
                    match at.get(&atom) {
                        Some(&i) => {
                            let tasks = &mut atoms[i].1;
                            if tasks.last() != Some(&id) {
                                tasks.push(id);
                            }
                        }
                        None => {
                            at.insert(atom, atoms.len());
                            atoms.push((atom, vec![id]));
                        }
                    }
                }
            }
            let into_cache = task.cache_op.is_some()
                && task.args.iter().any(|a| {
                    a.access.writes() && a.slice.cache_key.is_some_and(|k| k.cache == cache)
                });
            if into_cache && !self_hit(program, id) {
                changers.push(id);
            }
        }
        (!atoms.is_empty() && !changers.is_empty()).then_some(Guarded { atoms, changers })
    }

    /// The first stale guard, as the pairwise check finds it (guards in order, then
    /// changers in step order): every fetch and prefetch into the cache must be ordered
    /// before every task the guard decides or after all of them, so they all see one
    /// answer. A guarded change of another key decides the guard, then may change the
    /// cache: every other decider must come before it. Any change counts, whatever its
    /// layer or expert: a miss of another expert may evict this one.
    ///
    /// Per guard and changers' stream, in O(guarded x streams + log changers): the
    /// changers ordered before all the guard's tasks are a prefix of the stream's
    /// changers, those after all of them a suffix (the order's counts only grow along a
    /// stream), and the stale ones are between, but the guard's own tasks.
    fn first_stale(&self, order: &Order) -> Option<Stale> {
        let streams = order.streams();
        // The changers of each stream, as indices into `changers` (in stream order).
        let mut by_stream: Vec<Vec<usize>> = vec![Vec::new(); streams];
        for (i, &c) in self.changers.iter().enumerate() {
            by_stream[order.stream(c)].push(i);
        }
        let mut below = vec![u32::MAX; streams];
        let mut ends = vec![0u32; streams];
        for (atom, ((_, _), tasks)) in self.atoms.iter().enumerate() {
            // `c` before every task: its position under each task's count on its stream.
            below.fill(u32::MAX);
            // Every task before `c`: each stream's last task position under `c`'s count.
            ends.fill(0);
            for &t in tasks {
                for (s, b) in below.iter_mut().enumerate() {
                    *b = (*b).min(order.reach(t, s));
                }
                let s = order.stream(t);
                ends[s] = ends[s].max(order.pos(t) + 1);
            }
            let all_before = |c: TaskId| (0..streams).all(|s| ends[s] <= order.reach(c, s));
            // The first stale changer, by its index in `changers` (step order).
            let mut first: Option<(usize, TaskId)> = None;
            let mut found = |i: usize, guarded: TaskId| {
                if first.is_none_or(|(j, _)| i < j) {
                    first = Some((i, guarded));
                }
            };
            for (s, on) in by_stream.iter().enumerate() {
                let after = on.partition_point(|&i| order.pos(self.changers[i]) < below[s]);
                let done = on.partition_point(|&i| !all_before(self.changers[i]));
                for &i in on.get(after..done).unwrap_or_default() {
                    let c = self.changers[i];
                    if !tasks.contains(&c) {
                        found(i, victim(tasks, c, |x, y| order.before(x, y)));
                        break;
                    }
                }
            }
            // The guard's own changers, each against the guard's other tasks.
            for &c in tasks {
                let Ok(i) = self.changers.binary_search(&c) else {
                    continue;
                };
                if let Some(late) = tasks
                    .iter()
                    .copied()
                    .find(|&t| t != c && !order.before(t, c))
                {
                    found(i, late);
                }
            }
            if let Some((i, guarded)) = first {
                return Some(Stale {
                    atom,
                    guarded,
                    changer: self.changers[i],
                });
            }
        }
        None
    }

    /// The diagnostic of a stale guard found in `cache`.
    fn diagnostic(&self, program: &Program, cache: u32, found: &Stale) -> Diagnostic {
        let ((layer, expert), _) = self.atoms[found.atom];
        stale(
            program,
            &program.caches[cache as usize],
            layer,
            expert,
            found.guarded,
            found.changer,
        )
    }
}

/// The guarded task a change not ordered against all of `tasks` may come before (one not
/// ordered either way, else one not after it, else the first).
fn victim(tasks: &[TaskId], changer: TaskId, before: impl Fn(TaskId, TaskId) -> bool) -> TaskId {
    tasks
        .iter()
        .copied()
        .find(|&t| !before(changer, t) && !before(t, changer))
        .unwrap_or_else(|| {
            tasks
                .iter()
                .copied()
                .find(|&t| !before(changer, t))
                .unwrap_or(tasks[0])
        })
}

fn stale(
    program: &Program,
    cache: &crate::ir::cache::Cache,
    layer: u32,
    expert: ExpertRef,
    guarded: TaskId,
    changer: TaskId,
) -> Diagnostic {
    Diagnostic::stale_guard(
        program.task_span(guarded),
        &program.task_name(guarded),
        &format!("{}.resident({layer}, {expert})", cache.name),
        (program.task_name(changer), program.task_span(changer)),
        &cache.name,
    )
}

/// The fetches of one cache in one step, for `cache::deadlock`: each with its readers and
/// the group (layer and ub) whose activity guards it, if its guard says so.
struct Fetches {
    /// The fetches, in step order.
    ids: Vec<TaskId>,
    /// Per fetch, the tasks reading the slot it fills (in step order).
    readers: Vec<Vec<TaskId>>,
    /// Per fetch, its group, if its guard is its own expert's activity.
    groups: Vec<Option<usize>>,
    /// Per group, the most of its fetches that can hold a slot: as many as can receive
    /// tokens (decode: min(experts, sequences x top_k); prefill: every expert).
    caps: Vec<u64>,
}

impl Fetches {
    /// The fetches of `cache` in `step`; `None` if it has none.
    fn of(
        program: &Program,
        bound: &[Vec<Option<TaskId>>],
        step: &Step,
        cache: u32,
    ) -> Option<Fetches> {
        let mut ids: Vec<TaskId> = Vec::new();
        let mut readers: Vec<Vec<TaskId>> = Vec::new();
        let mut index: crate::ir::FastMap<TaskId, usize> = crate::ir::FastMap::default();
        for id in step.task_ids() {
            let task = program.task(id);
            if task.cache_op == Some(CacheOp::Fetch)
                && task
                    .args
                    .iter()
                    .any(|a| a.slice.cache_key.is_some_and(|k| k.cache == cache))
            {
                index.insert(id, ids.len());
                ids.push(id);
                readers.push(Vec::new());
            }
            for (arg, fetch) in task.args.iter().zip(&bound[id.index()]) {
                if let (Some(f), true) = (fetch, arg.access.reads()) {
                    if *f != id && arg.slice.cache_key.is_some_and(|k| k.cache == cache) {
                        if let Some(&i) = index.get(f) {
                            readers[i].push(id);
                        }
                    }
                }
            }
        }
        if ids.is_empty() {
            return None;
        }
        let kind = step.kind;
        let (experts, top_k) = (program.model.experts, program.model.top_k);
        let mb = program.micro_batches;
        let tokens = |ub: Option<u32>| -> u64 {
            let per_ub = match kind {
                StepKind::Decode => mb.size,
                StepKind::Mixed => mb.mixed_tokens,
                _ => u64::MAX / 4,
            };
            match ub {
                Some(_) => per_ub,
                None => per_ub.saturating_mul(u64::from(mb.count)),
            }
        };
        // Per fetch, the layer (and ub) whose activity guards it, if its guard says so.
        let group = |f: TaskId| -> Option<(u32, Option<u32>)> {
            let task = program.task(f);
            let key = task.args.iter().find_map(|a| a.slice.cache_key)?;
            task.guard.lits.iter().find_map(|l| {
                let positive = !l.negated
                    && matches!(l.atom, GuardAtom::Active { .. } | GuardAtom::Tokens { .. });
                (positive && l.atom.layer() == key.layer && l.atom.expert() == key.expert)
                    .then(|| (key.layer, l.atom.ub()))
            })
        };
        // Groups numbered densely.
        let mut group_keys: Vec<(u32, Option<u32>)> = Vec::new();
        let mut numbered: crate::ir::FastMap<(u32, Option<u32>), usize> =
            crate::ir::FastMap::default();
        let groups: Vec<Option<usize>> = ids
            .iter()
            .map(|&f| {
                group(f).map(|key| {
                    *numbered.entry(key).or_insert_with(|| {
                        group_keys.push(key);
                        group_keys.len() - 1
                    })
                })
            })
            .collect();
        let caps: Vec<u64> = group_keys
            .iter()
            .map(|&(_, ub)| experts.min(tokens(ub).saturating_mul(top_k)))
            .collect();
        Some(Fetches {
            ids,
            readers,
            groups,
            caps,
        })
    }

    /// Per fetch, how many fetched experts may hold a slot when it starts (itself
    /// included, each group at most its cap): fetch `g` holds a slot when `f` starts unless
    /// `g`'s readers (without readers, `g` itself) all finished before `f`, or `g` starts
    /// after `f`.
    ///
    /// Swept per stream of the fetches `f`, in stream order: `f`'s counts only grow along
    /// its stream, so `g` starts holding from the first `f` it does not start after
    /// (`order.reach(g)` on `f`'s stream is no more than `f`'s position) and stops at the
    /// first `f` its readers all finished before (each a binary search); between, it is
    /// counted. A released fetch was started (its readers come after it), so every `g`
    /// holds over one interval of the stream's fetches.
    fn held(&self, order: &Order) -> Vec<u64> {
        let n = self.ids.len();
        let mut held = vec![0u64; n];
        let mut streams: Vec<usize> = self.ids.iter().map(|&f| order.stream(f)).collect();
        streams.sort_unstable();
        streams.dedup();
        for sf in streams {
            // The fetches on this stream (indices into `ids`), in stream order.
            let on: Vec<usize> = (0..n)
                .filter(|&i| order.stream(self.ids[i]) == sf)
                .collect();
            // The first of `on` that `x` finishes before.
            let finished_before = |x: TaskId| {
                let (s, p) = (order.stream(x), order.pos(x));
                on.partition_point(|&i| order.reach(self.ids[i], s) <= p)
            };
            let mut starts: Vec<Vec<usize>> = vec![Vec::new(); on.len()];
            let mut stops: Vec<Vec<usize>> = vec![Vec::new(); on.len()];
            for (j, &g) in self.ids.iter().enumerate() {
                let reach = order.reach(g, sf);
                let start = on.partition_point(|&i| order.pos(self.ids[i]) < reach);
                let stop = match self.readers[j].as_slice() {
                    [] => finished_before(g),
                    rs => rs.iter().map(|&r| finished_before(r)).max().unwrap_or(0),
                };
                if start < stop {
                    starts[start].push(j);
                    if stop < on.len() {
                        stops[stop].push(j);
                    }
                }
            }
            let mut count = Counted {
                per_group: vec![0; self.caps.len()],
                caps: &self.caps,
                held: 0,
            };
            for (k, &i) in on.iter().enumerate() {
                for &j in &stops[k] {
                    count.change(self.groups[j], false);
                }
                for &j in &starts[k] {
                    count.change(self.groups[j], true);
                }
                held[i] = count.held;
            }
        }
        held
    }

    /// Reports `cache::deadlock` when the largest count of `held` (per fetch, as
    /// [`Fetches::held`] gives it) exceeds the cache's slots, at the first fetch with that
    /// count. A fetch guarded by its own expert's residency hits: it never needs a free
    /// slot (it still holds its slot, so it counts for the others).
    fn report(
        &self,
        program: &Program,
        step: &Step,
        cache: u32,
        held: &[u64],
        diags: &mut Vec<Diagnostic>,
    ) {
        let mut worst: Option<(u64, TaskId)> = None;
        for (&f, &h) in self.ids.iter().zip(held) {
            if self_hit(program, f) {
                continue;
            }
            if worst.is_none_or(|(w, _)| h > w) {
                worst = Some((h, f));
            }
        }
        let c = &program.caches[cache as usize];
        if let Some((held, f)) = worst.filter(|(h, _)| *h > u64::from(c.slots)) {
            let decl = program
                .spans
                .buffers
                .get(c.buffer.index())
                .copied()
                .unwrap_or_default();
            diags.push(Diagnostic::cache_deadlock(
                decl,
                &c.name,
                c.slots,
                held,
                (program.task_name(f), program.task_span(f)),
                step.kind.as_str(),
            ));
        }
    }
}

/// The fetches holding a slot, counted as `cache::deadlock` counts them: each group at
/// most its cap, fetches without a group each.
struct Counted<'a> {
    per_group: Vec<u64>,
    caps: &'a [u64],
    held: u64,
}

impl Counted<'_> {
    /// One fetch of `group` starts (`true`) or stops holding.
    fn change(&mut self, group: Option<usize>, starts: bool) {
        let Some(k) = group else {
            if starts {
                self.held += 1;
            } else {
                self.held -= 1;
            }
            return;
        };
        let cap = self.caps[k];
        let was = self.per_group[k].min(cap);
        if starts {
            self.per_group[k] += 1;
        } else {
            self.per_group[k] -= 1;
        }
        self.held = self.held - was + self.per_group[k].min(cap);
    }
}
