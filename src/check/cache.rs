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

use super::cells::implies;
use crate::diag::Diagnostic;
use crate::ir::cache::{bindings, CacheOp};
use crate::ir::deps::Dag;
use crate::ir::{ExpertRef, GuardAtom, Program, Step, StepKind, TaskId};
use std::collections::HashMap;

/// Runs the cache checks.
pub fn check(program: &Program, dag: &Dag, diags: &mut Vec<Diagnostic>) {
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
        for cache in 0..program.caches.len() as u32 {
            held_at_once(program, dag, &bound, step, cache, diags);
            stale_guards(program, dag, step, cache, diags);
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

/// The `cache::stale_guard` check of one cache in one step. A `CACHE.resident(l, e)`
/// guard is decided by each task it guards when that task is about to run, from the
/// cache as it is then; the answers agree (the arms stay exclusive, and a hit seen by the
/// guard is still a hit when its fetch runs) when no fetch or prefetch into the cache can
/// run between two of those decisions. So every fetch and prefetch into the cache must be
/// ordered before every task guarded by that residency, or after all of them; a fetch
/// guarded by its own key's residency is a hit and changes nothing. Any fetch or prefetch
/// counts, whatever its layer or expert: a miss of another expert may evict this one.
/// Reports the first such guard of the step (one per step and cache).
fn stale_guards(
    program: &Program,
    dag: &Dag,
    step: &Step,
    cache: u32,
    diags: &mut Vec<Diagnostic>,
) {
    type Atom = (u32, ExpertRef);
    let mut guarded: Vec<(Atom, Vec<TaskId>)> = Vec::new();
    // Where each atom is in `guarded` (a step of HOBBIT has one per expert).
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
                        let tasks = &mut guarded[i].1;
                        if tasks.last() != Some(&id) {
                            tasks.push(id);
                        }
                    }
                    None => {
                        at.insert(atom, guarded.len());
                        guarded.push((atom, vec![id]));
                    }
                }
            }
        }
        let into_cache = task.cache_op.is_some()
            && task
                .args
                .iter()
                .any(|a| a.access.writes() && a.slice.cache_key.is_some_and(|k| k.cache == cache));
        if into_cache && !self_hit(program, id) {
            changers.push(id);
        }
    }
    if guarded.is_empty() || changers.is_empty() {
        return;
    }
    let order = Order::new(
        dag,
        step,
        changers
            .iter()
            .chain(guarded.iter().flat_map(|(_, t)| t))
            .copied(),
    );
    let before = |x: TaskId, y: TaskId| order.before(x, y);
    let c = &program.caches[cache as usize];
    for ((layer, expert), tasks) in &guarded {
        for &changer in &changers {
            if tasks.contains(&changer) {
                // A guarded fetch or prefetch of another key decides the guard, then may
                // change the cache: every other decider must come before it.
                let late = tasks
                    .iter()
                    .copied()
                    .find(|&t| t != changer && !before(t, changer));
                if let Some(t) = late {
                    // One per step and cache: the fix (an order) is the same for all.
                    diags.push(stale(program, c, *layer, *expert, t, changer));
                    return;
                }
                continue;
            }
            let all_after = tasks.iter().all(|&t| before(changer, t));
            let all_before = tasks.iter().all(|&t| before(t, changer));
            if all_after || all_before {
                continue;
            }
            // The guarded task the change may come before: one not ordered after it.
            let victim = tasks
                .iter()
                .copied()
                .find(|&t| !before(changer, t) && !before(t, changer))
                .unwrap_or_else(|| {
                    tasks
                        .iter()
                        .copied()
                        .find(|&t| !before(changer, t))
                        .unwrap_or(tasks[0])
                });
            diags.push(stale(program, c, *layer, *expert, victim, changer));
            return;
        }
    }
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

/// Which of a step's tasks of interest come before which: `x` before `y` when `x` is an
/// ancestor of `y` in the dependency graph (finished before `y` starts, whatever the
/// streams do); two tasks neither before the other may run in either order or overlap.
/// Both cache checks ask it about a cache's fetches: `cache::deadlock` whether one may
/// still hold its slot when another starts, `cache::stale_guard` whether one may run
/// between two tasks deciding a residency guard.
struct Order {
    /// The step's first task.
    first: usize,
    /// Per task of the step, its bit in the sets if it is of interest (`u32::MAX` if not):
    /// a lookup per `before` question, which both checks ask for every pair of fetches.
    bit: Vec<u32>,
    /// Per task of the step, its ancestors among the tasks of interest, as bitsets.
    anc: Vec<Vec<u64>>,
}

impl Order {
    /// The ancestor sets of `step`'s tasks restricted to `interesting` (tasks of the
    /// step), propagated in issue order: every predecessor comes earlier, so one pass
    /// suffices. Edges from earlier steps are left out (those steps have finished).
    fn new(dag: &Dag, step: &Step, interesting: impl IntoIterator<Item = TaskId>) -> Order {
        let mut tasks: Vec<TaskId> = interesting.into_iter().collect();
        tasks.sort();
        tasks.dedup();
        let first = step.first as usize;
        let mut bit = vec![u32::MAX; step.count as usize];
        for (i, t) in tasks.iter().enumerate() {
            bit[t.index() - first] = i as u32;
        }
        let words = tasks.len().div_ceil(64);
        let mut anc: Vec<Vec<u64>> = vec![vec![0; words]; step.count as usize];
        for k in 0..step.count as usize {
            let id = TaskId::new(first + k);
            let mut set = vec![0u64; words];
            for dep in dag.preds(id) {
                let p = dep.from.index();
                if p < first {
                    continue;
                }
                for (w, a) in set.iter_mut().zip(&anc[p - first]) {
                    *w |= a;
                }
                let b = bit[p - first];
                if b != u32::MAX {
                    let b = b as usize;
                    set[b / 64] |= 1 << (b % 64);
                }
            }
            anc[k] = set;
        }
        Order { first, bit, anc }
    }

    /// Whether `x` (a task of interest) finishes before `y` (any task of the step)
    /// starts; false for a task `x` that is not of interest.
    fn before(&self, x: TaskId, y: TaskId) -> bool {
        self.bit_of(x).is_some_and(|b| self.has(b, y))
    }

    /// `x`'s bit, if it is a task of interest of the step.
    fn bit_of(&self, x: TaskId) -> Option<usize> {
        x.index()
            .checked_sub(self.first)
            .and_then(|k| self.bit.get(k))
            .filter(|&&b| b != u32::MAX)
            .map(|&b| b as usize)
    }

    /// Whether the task of interest with bit `b` finishes before `y` starts.
    fn has(&self, b: usize, y: TaskId) -> bool {
        self.anc[y.index() - self.first][b / 64] & (1 << (b % 64)) != 0
    }
}

/// The `cache::deadlock` check of one cache in one step.
fn held_at_once(
    program: &Program,
    dag: &Dag,
    bound: &[Vec<Option<TaskId>>],
    step: &Step,
    cache: u32,
    diags: &mut Vec<Diagnostic>,
) {
    // The fetches of this cache, and each one's readers.
    let mut fetches: Vec<TaskId> = Vec::new();
    let mut readers: HashMap<TaskId, Vec<TaskId>> = HashMap::new();
    for id in step.task_ids() {
        let task = program.task(id);
        if task.cache_op == Some(CacheOp::Fetch)
            && task
                .args
                .iter()
                .any(|a| a.slice.cache_key.is_some_and(|k| k.cache == cache))
        {
            fetches.push(id);
        }
        for (arg, fetch) in task.args.iter().zip(&bound[id.index()]) {
            if let (Some(f), true) = (fetch, arg.access.reads()) {
                if *f != id && arg.slice.cache_key.is_some_and(|k| k.cache == cache) {
                    readers.entry(*f).or_default().push(id);
                }
            }
        }
    }
    if fetches.is_empty() {
        return;
    }
    let order = Order::new(
        dag,
        step,
        fetches.iter().chain(readers.values().flatten()).copied(),
    );
    // Per fetch, its bit and its readers' bits (every reader is a task of interest):
    // the pairwise count below asks these for every pair of the step's fetches.
    let fetch_bit: Vec<usize> = fetches
        .iter()
        .map(|&f| order.bit_of(f).expect("a fetch is a task of interest"))
        .collect();
    let reader_bits: Vec<Vec<usize>> = fetches
        .iter()
        .map(|f| {
            readers.get(f).map_or_else(Vec::new, |rs| {
                rs.iter()
                    .map(|&r| order.bit_of(r).expect("a reader is a task of interest"))
                    .collect()
            })
        })
        .collect();
    // The `j`-th fetch's slot is free again before `y` starts: its readers (or, without
    // readers, itself) finished before.
    let released_before = |j: usize, y: TaskId| -> bool {
        match reader_bits[j].as_slice() {
            [] => order.has(fetch_bit[j], y),
            rs => rs.iter().all(|&r| order.has(r, y)),
        }
    };
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
            let positive =
                !l.negated && matches!(l.atom, GuardAtom::Active { .. } | GuardAtom::Tokens { .. });
            (positive && l.atom.layer() == key.layer && l.atom.expert() == key.expert)
                .then(|| (key.layer, l.atom.ub()))
        })
    };
    // Groups numbered densely, each with the most of its fetches that can hold a slot.
    let mut group_keys: Vec<(u32, Option<u32>)> = Vec::new();
    let groups: Vec<Option<usize>> = fetches
        .iter()
        .map(|&f| {
            group(f).map(|key| match group_keys.iter().position(|k| *k == key) {
                Some(i) => i,
                None => {
                    group_keys.push(key);
                    group_keys.len() - 1
                }
            })
        })
        .collect();
    let caps: Vec<u64> = group_keys
        .iter()
        .map(|&(_, ub)| experts.min(tokens(ub).saturating_mul(top_k)))
        .collect();
    let mut per_group = vec![0u64; group_keys.len()];
    let mut worst: Option<(u64, TaskId)> = None;
    for (i, &f) in fetches.iter().enumerate() {
        // A fetch guarded by its own expert's residency hits: it never needs a free slot
        // (it still holds its slot, so it counts for the others).
        if self_hit(program, f) {
            continue;
        }
        per_group.iter_mut().for_each(|n| *n = 0);
        let mut loose = 0u64;
        let f_bit = fetch_bit[i];
        for (j, &g) in fetches.iter().enumerate() {
            // Held when `f` starts: started already (not after `f`) and not released.
            let together = i == j || !(released_before(j, f) || order.has(f_bit, g));
            if !together {
                continue;
            }
            match groups[j] {
                Some(k) => per_group[k] += 1,
                None => loose += 1,
            }
        }
        let held: u64 = loose
            + per_group
                .iter()
                .zip(&caps)
                .map(|(&n, &cap)| n.min(cap))
                .sum::<u64>();
        if worst.is_none_or(|(w, _)| held > w) {
            worst = Some((held, f));
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
            kind.as_str(),
        ));
    }
}
