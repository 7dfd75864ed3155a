//! Exclusive, covering arms: proves that, whatever the routing, each expert that receives
//! tokens from a micro-batch is computed exactly once before that micro-batch's `combine`.
//!
//! Takes the expert outputs that reach one `combine(layer, ub)` (each: the task that
//! wrote it, its expert set and its run-time guard); gives `None` when every active
//! expert is computed exactly once under every routing, else a sentence naming the
//! expert, the routing that breaks it and the tasks involved. Guards are conjunctions of
//! literals "routed tokens of (layer, expert, ub) >= t" (`active` is t = 1), so each
//! routed count splits into the intervals between its thresholds; the proof enumerates
//! every combination of intervals in which the expert has tokens from `ub` (at most
//! [`MAX_CASES`], else the schedule is rejected as too complex to prove) and counts the
//! outputs whose guard holds. Counts of one expert over one micro-batch and over all of
//! them are related only by "the sum is at least the part"; everything else is treated
//! as independent, which can only reject more schedules, never accept a wrong one.
//! Fiddler's `if routed(l, e) >= t { copy; experts on gpu } else { experts on cpu }`
//! passes; an arm missing or repeated under some routing does not.

use crate::ir::cache::Cache;
use crate::ir::catalog::{ExpertRef, ExpertSet};
use crate::ir::{Guard, GuardAtom, ScoreKind, TaskId};
use std::collections::{BTreeMap, HashMap};

/// The most interval combinations enumerated for one expert.
pub const MAX_CASES: usize = 4096;

/// One expert output reaching a `combine`.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The `experts` task that computed it.
    pub task: TaskId,
    /// Its experts.
    pub set: ExpertSet,
    /// The guard it ran under, shared: an accumulator's outputs are copied into every
    /// later value of it (hundreds per layer), which must not copy each guard's literals.
    pub guard: std::rc::Rc<Guard>,
}

/// What a guard variable measures: routed tokens, a cache's residency (0 miss, 1 hit) or a
/// routing-weight statistic (thresholds as `f32` bits, which order positive floats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Quantity {
    Tokens,
    Resident(u32),
    Score(ScoreKind),
}

/// A guard variable: a quantity of (layer, expert) from one micro-batch or from all of them
/// (a residency reads no micro-batch: `None`). Variables of different quantities are
/// treated as independent, which can only reject more schedules.
type Var = (Quantity, u32, ExpertRef, Option<u32>);

fn var_of(a: &GuardAtom) -> Var {
    let quantity = match *a {
        GuardAtom::Active { .. } | GuardAtom::Tokens { .. } => Quantity::Tokens,
        GuardAtom::Resident { cache, .. } => Quantity::Resident(cache),
        GuardAtom::Score { kind, .. } => Quantity::Score(kind),
    };
    (quantity, a.layer(), a.expert(), a.ub())
}

/// Whether any output is guarded by a literal other than `active` (a token count
/// `routed(..) >= t` with t > 1, a cache residency, a routing-weight score): those are
/// proven here, not by the literal-by-literal `active` rule.
pub fn has_load_guard(outputs: &[Output]) -> bool {
    outputs.iter().any(|o| {
        o.guard
            .lits
            .iter()
            .any(|l| !matches!(l.atom, GuardAtom::Active { .. }))
    })
}

/// Checks that every expert of `layer` (fixed indices, or run-time ranks when the outputs
/// name ranks) is computed exactly once whenever it has tokens from `ub`. `name` renders
/// a task for the message, `caches` (the program's) names the caches residency guards read.
pub fn check(
    outputs: &[Output],
    layer: u32,
    ub: u32,
    experts: u64,
    name: &dyn Fn(TaskId) -> String,
    caches: &[Cache],
) -> Option<String> {
    let ranks = outputs
        .iter()
        .any(|o| matches!(o.set, ExpertSet::One(ExpertRef::Hot { .. })));
    // Each expert's outputs in their order, from one pass over the outputs (filtering
    // them once per expert, each set expanded again, was quadratic in the layer's experts).
    let mut by_expert: HashMap<ExpertRef, Vec<&Output>> = HashMap::new();
    for o in outputs {
        for member in o.set.members(experts) {
            let mine = by_expert.entry(member).or_default();
            if !mine.last().is_some_and(|last| std::ptr::eq(*last, o)) {
                mine.push(o);
            }
        }
    }
    for x in 0..experts as u32 {
        let expert = if ranks {
            ExpertRef::Hot { layer, rank: x }
        } else {
            ExpertRef::Index(x)
        };
        let mine = by_expert.get(&expert).map_or(&[][..], Vec::as_slice);
        if let Some(problem) = check_expert(mine, layer, expert, ub, name, caches) {
            return Some(problem);
        }
    }
    None
}

fn check_expert(
    outputs: &[&Output],
    layer: u32,
    expert: ExpertRef,
    ub: u32,
    name: &dyn Fn(TaskId) -> String,
    caches: &[Cache],
) -> Option<String> {
    let what = match expert {
        ExpertRef::Index(e) => format!("expert {e}"),
        ExpertRef::Hot { rank, .. } => format!("rank {rank}"),
        ExpertRef::Predicted { rank, .. } => format!("predicted rank {rank}"),
    };
    // Cut points of every routed count a guard reads; the expert's own counts always
    // cut at 1, so "has tokens from ub" is exactly "not in the first interval".
    let mine: Var = (Quantity::Tokens, layer, expert, Some(ub));
    let sum: Var = (Quantity::Tokens, layer, expert, None);
    let mut cuts: BTreeMap<Var, Vec<u32>> = BTreeMap::new();
    cuts.entry(mine).or_default().push(1);
    cuts.entry(sum).or_default().push(1);
    for o in outputs {
        for lit in &o.guard.lits {
            let a = lit.atom;
            cuts.entry(var_of(&a)).or_default().push(a.threshold());
        }
    }
    for c in cuts.values_mut() {
        c.sort_unstable();
        c.dedup();
    }
    let vars: Vec<(Var, Vec<u32>)> = cuts.into_iter().collect();
    let cases = vars
        .iter()
        .try_fold(1usize, |n, (_, c)| n.checked_mul(c.len() + 1));
    if cases.is_none_or(|n| n > MAX_CASES) {
        return Some(format!(
            "the guards of {what} read too many routed counts to prove it is computed exactly once (more than {MAX_CASES} cases)"
        ));
    }
    // Interval r of a count with cuts c: [c[r-1], c[r]) (from 0, up to infinity).
    let lo = |c: &[u32], r: usize| if r == 0 { 0 } else { c[r - 1] };
    let hi = |c: &[u32], r: usize| c.get(r).copied().unwrap_or(u32::MAX);
    let mut region = vec![0usize; vars.len()];
    loop {
        let at = |v: &Var| {
            vars.iter()
                .position(|(w, _)| w == v)
                .map(|i| (lo(&vars[i].1, region[i]), hi(&vars[i].1, region[i])))
        };
        let (mine_lo, _) = at(&mine).unwrap_or((0, 0));
        let (sum_lo, sum_hi) = at(&sum).unwrap_or((0, 0));
        // Only routings where the expert has tokens from ub, and the sum over every ub
        // can be at least this ub's count.
        let feasible = mine_lo >= 1 && sum_lo >= 1 && sum_hi > mine_lo;
        if feasible {
            let running: Vec<&&Output> = outputs
                .iter()
                .filter(|o| {
                    o.guard.lits.iter().all(|lit| {
                        let a = lit.atom;
                        let (l, _) = at(&var_of(&a)).unwrap_or((0, 0));
                        (l >= a.threshold()) != lit.negated
                    })
                })
                .collect();
            if running.len() != 1 {
                let case = describe_case(&vars, &region, outputs, ub, caches);
                let tasks: Vec<String> = outputs.iter().map(|o| name(o.task)).collect();
                let why = match tasks.as_slice() {
                    [] => "no task computing it reaches this `combine`".to_string(),
                    [one] => format!("only {one} computes it, and its guard does not hold then"),
                    many => format!(
                        "{} compute it, and none of their guards holds then",
                        many.join(", ")
                    ),
                };
                return Some(match running.as_slice() {
                    [] => format!("{what} is not computed before `combine` when {case} ({why})"),
                    many => format!(
                        "{what} is computed {} times before `combine` when {case} (by {})",
                        many.len(),
                        many.iter()
                            .map(|o| name(o.task))
                            .collect::<Vec<_>>()
                            .join(" and ")
                    ),
                });
            }
        }
        // Next combination (odometer).
        let mut i = 0;
        loop {
            if i == vars.len() {
                return None;
            }
            region[i] += 1;
            if region[i] <= vars[i].1.len() {
                break;
            }
            region[i] = 0;
            i += 1;
        }
    }
}

/// `routed(0, 3, 1) is 1..=9 and routed(0, 3) >= 10`: the intervals of the counts the
/// guards read.
fn describe_case(
    vars: &[(Var, Vec<u32>)],
    region: &[usize],
    outputs: &[&Output],
    ub: u32,
    caches: &[Cache],
) -> String {
    let read = |v: &Var| {
        outputs
            .iter()
            .any(|o| o.guard.lits.iter().any(|l| var_of(&l.atom) == *v))
    };
    let mut parts = Vec::new();
    for ((var, cuts), &r) in vars.iter().zip(region) {
        if !read(var) {
            continue;
        }
        let (quantity, layer, expert, ub) = *var;
        let ub = ub.map(|u| format!(", {u}")).unwrap_or_default();
        let lo = if r == 0 { 0 } else { cuts[r - 1] };
        match quantity {
            Quantity::Tokens => {
                let range = match cuts.get(r) {
                    Some(&hi) if hi == lo + 1 => format!("is {lo}"),
                    Some(&hi) => format!("is {lo}..={}", hi - 1),
                    None => format!(">= {lo}"),
                };
                parts.push(format!("routed({layer}, {expert}{ub}) {range}"));
            }
            Quantity::Resident(cache) => {
                let hit = if lo >= 1 { "a hit" } else { "a miss" };
                let atom = GuardAtom::Resident {
                    cache,
                    layer,
                    expert,
                };
                parts.push(format!("{} is {hit}", atom.text(caches)));
            }
            Quantity::Score(kind) => {
                let f = |bits: u32| f32::from_bits(bits);
                let name = kind.as_str();
                let range = match (r, cuts.get(r)) {
                    (0, Some(&hi)) => format!("< {}", f(hi)),
                    (_, Some(&hi)) => format!("is in {}..{}", f(lo), f(hi)),
                    (_, None) => format!(">= {}", f(lo)),
                };
                parts.push(format!("{name}({layer}, {expert}{ub}) {range}"));
            }
        }
    }
    if parts.is_empty() {
        return format!("it has tokens from ub {ub}");
    }
    parts.join(" and ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::GuardLit;

    fn tokens(expert: u32, ub: Option<u32>, at_least: u32, negated: bool) -> GuardLit {
        let expert = ExpertRef::Index(expert);
        let atom = if at_least == 1 {
            GuardAtom::Active {
                layer: 0,
                expert,
                ub,
            }
        } else {
            GuardAtom::Tokens {
                layer: 0,
                expert,
                ub,
                at_least,
            }
        };
        GuardLit { atom, negated }
    }

    fn out(task: u32, set: ExpertSet, lits: &[GuardLit]) -> Output {
        let mut lits = lits.to_vec();
        lits.sort();
        Output {
            task: TaskId(task),
            set,
            guard: std::rc::Rc::new(Guard { lits }),
        }
    }

    fn name(t: TaskId) -> String {
        format!("#{}", t.0)
    }

    /// Two experts; expert 1 always on its own unguarded task; expert 0 under `arms`;
    /// one expert cache, `ec` (what residency guards read).
    fn run(arms: &[Output]) -> Option<String> {
        let mut all = arms.to_vec();
        all.push(out(99, ExpertSet::One(ExpertRef::Index(1)), &[]));
        let ec = Cache {
            name: "ec".to_string(),
            buffer: crate::ir::BufferId(1),
            slots: 2,
            policy: crate::ir::cache::EvictPolicy::Lru,
            score: None,
            predictor: crate::ir::cache::Predictor::Cooccurrence,
        };
        check(&all, 0, 0, 2, &name, &[ec])
    }

    const E0: ExpertSet = ExpertSet::One(ExpertRef::Index(0));

    #[test]
    fn an_if_else_on_a_token_count_covers_every_active_expert_once() {
        // if active(0, 0) { if routed(0, 0) >= 10 { A } else { B } }
        let a = out(
            1,
            E0,
            &[tokens(0, None, 1, false), tokens(0, None, 10, false)],
        );
        let b = out(
            2,
            E0,
            &[tokens(0, None, 1, false), tokens(0, None, 10, true)],
        );
        assert_eq!(run(&[a.clone(), b.clone()]), None);
        // The arms alone, without the `active` guard around them, also cover it.
        let a = out(1, E0, &[tokens(0, None, 10, false)]);
        let b = out(2, E0, &[tokens(0, None, 10, true)]);
        assert_eq!(run(&[a, b]), None);
        // Three arms on one count: >= 10, 3..=9, 1..=2 (else-if chains).
        let arms = [
            out(1, E0, &[tokens(0, None, 10, false)]),
            out(
                2,
                E0,
                &[tokens(0, None, 10, true), tokens(0, None, 3, false)],
            ),
            out(3, E0, &[tokens(0, None, 3, true)]),
        ];
        assert_eq!(run(&arms), None);
    }

    #[test]
    fn a_missing_arm_names_the_counts_where_nothing_runs() {
        let a = out(1, E0, &[tokens(0, None, 10, false)]);
        let problem = run(&[a]).expect("uncovered");
        assert!(
            problem.contains("expert 0 is not computed")
                && problem.contains("routed(0, 0) is 1..=9"),
            "{problem}"
        );
    }

    #[test]
    fn overlapping_arms_are_computed_twice() {
        // >= 3 and < 10 overlap in 3..=9.
        let a = out(1, E0, &[tokens(0, None, 3, false)]);
        let b = out(2, E0, &[tokens(0, None, 10, true)]);
        let problem = run(&[a, b]).expect("overlap");
        assert!(
            problem.contains("computed 2 times") && problem.contains("routed(0, 0) is 3..=9"),
            "{problem}"
        );
        // An unguarded copy next to a guarded arm.
        let a = out(1, E0, &[tokens(0, None, 10, false)]);
        let b = out(2, E0, &[]);
        assert!(run(&[a, b]).is_some_and(|p| p.contains("computed 2 times")));
    }

    #[test]
    fn a_per_ub_arm_and_a_summed_arm_are_related_by_the_sum() {
        // routed(0, 0, 0) >= 4 implies routed(0, 0) >= 4: arms `ub count >= 4` and
        // `sum < 4` leave ub count 1..=3 with sum >= 4 uncovered.
        let a = out(1, E0, &[tokens(0, Some(0), 4, false)]);
        let b = out(2, E0, &[tokens(0, None, 4, true)]);
        let problem = run(&[a, b]).expect("gap");
        assert!(problem.contains("is not computed"), "{problem}");
        // `sum >= 4` and `sum < 4` cover everything, whatever the ub's own count.
        let a = out(1, E0, &[tokens(0, None, 4, false)]);
        let b = out(2, E0, &[tokens(0, None, 4, true)]);
        assert_eq!(run(&[a, b]), None);
    }

    fn resident(negated: bool) -> GuardLit {
        GuardLit {
            atom: GuardAtom::Resident {
                cache: 0,
                layer: 0,
                expert: ExpertRef::Index(0),
            },
            negated,
        }
    }

    fn score_max(at_least: f32, negated: bool) -> GuardLit {
        GuardLit {
            atom: GuardAtom::Score {
                kind: ScoreKind::Max,
                layer: 0,
                expert: ExpertRef::Index(0),
                ub: Some(0),
                at_least_bits: at_least.to_bits(),
            },
            negated,
        }
    }

    #[test]
    fn residency_and_score_arms_are_proven_like_count_arms() {
        let active = tokens(0, Some(0), 1, false);
        // if active { if resident { A } else if score >= 0.3 { B } else { C } }
        let a = out(1, E0, &[active, resident(false)]);
        let b = out(2, E0, &[active, resident(true), score_max(0.3, false)]);
        let c = out(3, E0, &[active, resident(true), score_max(0.3, true)]);
        assert_eq!(run(&[a.clone(), b.clone(), c.clone()]), None);
        // The miss arm missing: nothing computes expert 0 on a miss.
        let problem = run(std::slice::from_ref(&a)).expect("uncovered");
        assert!(
            problem.contains("not computed") && problem.contains("ec.resident(0, 0) is a miss"),
            "{problem}"
        );
        // The score arms without the miss guard overlap the hit arm.
        let b_loose = out(2, E0, &[active, score_max(0.3, false)]);
        let problem = run(&[a, b_loose, c]).expect("overlap");
        assert!(
            problem.contains("computed 2 times") && problem.contains("score_max(0, 0, 0) >= 0.3"),
            "{problem}"
        );
    }

    #[test]
    fn another_experts_count_is_an_independent_condition() {
        // Guarding expert 0's only task by expert 1's load loses expert 0 when expert 1
        // has few tokens.
        let a = out(1, E0, &[tokens(1, None, 5, false)]);
        assert!(run(&[a]).is_some_and(|p| p.contains("routed(0, 1) is 0..=4")));
    }
}
