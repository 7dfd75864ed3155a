//! The cache checks' pairwise reference (the checker before the sweeps): ancestor bitsets
//! over a step's tasks of interest, propagated along the dependency graph, and every pair
//! of fetches (every guard against every change) asked in turn. The tests require the
//! sweeps' per-fetch counts and first stale guard to be this reference's, on the shipped
//! cache schedules and the residency fixture, at slots that pass and slots that do not.

use super::{victim, Fetches, Guarded, Order, Stale};
use crate::ir::deps::Dag;
use crate::ir::{Step, TaskId};

/// Per task of the step, its ancestors among the tasks of interest, as bitsets.
struct Bitsets {
    first: usize,
    bit: Vec<u32>,
    anc: Vec<Vec<u64>>,
}

impl Bitsets {
    fn new(dag: &Dag, step: &Step, interesting: impl IntoIterator<Item = TaskId>) -> Bitsets {
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
            let mut set = vec![0u64; words];
            for dep in dag.preds(TaskId::new(first + k)) {
                let p = dep.from.index();
                if p < first {
                    continue;
                }
                for (w, a) in set.iter_mut().zip(&anc[p - first]) {
                    *w |= a;
                }
                let b = bit[p - first];
                if b != u32::MAX {
                    set[b as usize / 64] |= 1 << (b % 64);
                }
            }
            anc[k] = set;
        }
        Bitsets { first, bit, anc }
    }

    fn before(&self, x: TaskId, y: TaskId) -> bool {
        let b = self.bit[x.index() - self.first];
        b != u32::MAX && self.anc[y.index() - self.first][b as usize / 64] & (1 << (b % 64)) != 0
    }
}

/// Per fetch, the fetched experts held when it starts, asked of every pair.
fn held_pairwise(fetches: &Fetches, before: impl Fn(TaskId, TaskId) -> bool) -> Vec<u64> {
    let released_before = |j: usize, y: TaskId| match fetches.readers[j].as_slice() {
        [] => before(fetches.ids[j], y),
        rs => rs.iter().all(|&r| before(r, y)),
    };
    let mut per_group = vec![0u64; fetches.caps.len()];
    fetches
        .ids
        .iter()
        .enumerate()
        .map(|(i, &f)| {
            per_group.iter_mut().for_each(|n| *n = 0);
            let mut loose = 0u64;
            for (j, &g) in fetches.ids.iter().enumerate() {
                if i == j || !(released_before(j, f) || before(f, g)) {
                    match fetches.groups[j] {
                        Some(k) => per_group[k] += 1,
                        None => loose += 1,
                    }
                }
            }
            loose
                + per_group
                    .iter()
                    .zip(&fetches.caps)
                    .map(|(&n, &cap)| n.min(cap))
                    .sum::<u64>()
        })
        .collect()
}

/// The first stale guard, every guard against every change in turn.
fn first_stale_pairwise(
    guarded: &Guarded,
    before: impl Fn(TaskId, TaskId) -> bool,
) -> Option<Stale> {
    for (atom, (_, tasks)) in guarded.atoms.iter().enumerate() {
        for &changer in &guarded.changers {
            let found = |guarded| Stale {
                atom,
                guarded,
                changer,
            };
            if tasks.contains(&changer) {
                if let Some(t) = tasks
                    .iter()
                    .copied()
                    .find(|&t| t != changer && !before(t, changer))
                {
                    return Some(found(t));
                }
                continue;
            }
            let all_after = tasks.iter().all(|&t| before(changer, t));
            let all_before = tasks.iter().all(|&t| before(t, changer));
            if !(all_after || all_before) {
                return Some(found(victim(tasks, changer, &before)));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::{ast_to_ir, source_to_ast, Options};
    use crate::ir::cache::bindings;
    use crate::ir::deps;
    use crate::model::ModelCard;

    /// What one program's steps and caches gave: (fetches with counts, deadlocked
    /// counts, stale guards found).
    #[derive(Debug, Default)]
    struct Seen {
        fetches: usize,
        over_slots: usize,
        stale: usize,
    }

    /// Compares the sweeps with the pairwise reference on every step and cache of
    /// `source` at `sets` on mixtral-tiny, under the reduced graph and the unreduced
    /// predecessor lists alike.
    fn compare(name: &str, source: &str, sets: &[(&str, &str)], seen: &mut Seen) {
        let file = source_to_ast(source).unwrap_or_else(|d| panic!("{name}: {d:?}"));
        let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
        options.sets = sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (program, _) = ast_to_ir(&file, &options).unwrap_or_else(|d| panic!("{name}: {d:?}"));
        let dag = deps::build(&program);
        let unreduced = deps::candidate_preds(&program);
        let bound = bindings(&program);
        for step in &program.steps {
            let order = Order::new(&program, &dag, step);
            let lean = Order::new(&program, unreduced.as_slice(), step);
            let every = Bitsets::new(&dag, step, step.task_ids());
            for cache in 0..program.caches.len() as u32 {
                let at = format!("{name} {sets:?} {} cache {cache}", step.kind.as_str());
                if let Some(fetches) = Fetches::of(&program, &bound, step, cache) {
                    let held = fetches.held(&order);
                    let reference = held_pairwise(&fetches, |x, y| every.before(x, y));
                    assert_eq!(held, reference, "{at}: held per fetch");
                    assert_eq!(fetches.held(&lean), held, "{at}: unreduced");
                    assert_eq!(
                        held_pairwise(&fetches, |x, y| order.before(x, y)),
                        reference,
                        "{at}: the order's pairs"
                    );
                    seen.fetches += held.len();
                    let slots = u64::from(program.caches[cache as usize].slots);
                    seen.over_slots += held.iter().filter(|&&h| h > slots).count();
                }
                if let Some(guarded) = Guarded::of(&program, step, cache) {
                    let found = guarded.first_stale(&order);
                    let reference = first_stale_pairwise(&guarded, |x, y| every.before(x, y));
                    assert_eq!(found, reference, "{at}: first stale guard");
                    assert_eq!(guarded.first_stale(&lean), found, "{at}: unreduced");
                    seen.stale += usize::from(found.is_some());
                }
            }
        }
    }

    /// The sweeps count what the pairwise check counts and find the stale guard it finds,
    /// on HOBBIT (both paths; its fill rule, and one that forgets the batch), MoE-Infinity,
    /// its disk variant, Pre-gated, and the residency fixture (as shipped, and with the CPU
    /// arm's order dropped: `tests/compiler_diagnostics.rs`' stale guard).
    #[test]
    fn the_sweeps_answer_as_every_pair() {
        let read = |path: &str| std::fs::read_to_string(path).unwrap();
        let mut seen = Seen::default();
        let hobbit = read("schedules/hobbit.sched");
        let fill = "max(fit, min(experts, bs * top_k) + top_k)";
        assert!(hobbit.contains(fill), "hobbit's fill rule moved");
        let forgetful = hobbit.replacen(fill, "4", 1);
        for source in [&hobbit, &forgetful] {
            for lowbit in ["0", "1"] {
                for bs in ["1", "3", "8"] {
                    let sets = [("lowbit", lowbit), ("bs", bs), ("thr", "0.3")];
                    compare("hobbit", source, &sets, &mut seen);
                }
            }
        }
        let infinity = read("schedules/moe_infinity.sched");
        for (bs, n_cache, n_pf) in [("1", "-1", "2"), ("4", "3", "4"), ("8", "1", "0")] {
            let sets = [("bs", bs), ("n_cache", n_cache), ("n_pf", n_pf)];
            compare("moe_infinity", &infinity, &sets, &mut seen);
        }
        let disk = read("schedules/moe_infinity_disk.sched");
        compare(
            "moe_infinity_disk",
            &disk,
            &[("bs", "4"), ("n_cache", "2")],
            &mut seen,
        );
        let pregated = read("schedules/pregated.sched");
        compare("pregated", &pregated, &[("bs", "4")], &mut seen);
        let fixture = read("tests/fixtures/guards/resident_score.sched");
        let cpu_arm = " on cpu after pf[l, sel - 1] if l >= 1 && l >= dense_layers";
        assert!(fixture.contains(cpu_arm), "the fixture's CPU arm moved");
        let stale = fixture.replacen(cpu_arm, " on cpu", 1);
        for source in [&fixture, &stale] {
            for sets in [vec![], vec![("sum", "1"), ("bs", "2"), ("n_cache", "2")]] {
                compare("resident_score", source, &sets, &mut seen);
            }
        }
        // Both checks had something to find.
        assert!(seen.fetches > 1000, "{seen:?}");
        assert!(seen.over_slots > 0, "{seen:?}");
        assert!(seen.stale > 0, "{seen:?}");
    }
}
