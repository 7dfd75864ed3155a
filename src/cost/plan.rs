//! The planner: searches a schedule's declared params for the best predicted throughput
//! that fits the memory budgets.
//!
//! Takes the params (name, type, range) and an `evaluate` function that compiles the
//! schedule with given values, checks its budget and predicts it; gives the best
//! candidates. Generic: it knows nothing of any schedule, only of typed ranges. The search
//! follows MoE-Lightning's pattern (§4.2 and its artifact: geometric steps, then doubling
//! plus binary search on feasibility): a coarse grid with doubling steps for integers,
//! five points for floats and both values for booleans, then coordinate-wise bisection
//! around the best few points (which converges on the largest feasible batch when the
//! throughput keeps rising up to the memory limit). The grid's points are kept or skipped
//! as waves of increasing params would keep them, so that points above one past an
//! elaboration limit can be skipped ([`SearchOptions::limits_grow`]), and evaluated on
//! every free thread meanwhile (docs/cost-model.md "How the search is done"). Guarantees: every value tried is inside its declared range; each distinct point
//! is evaluated at most once; the result is deterministic.

mod refine;

use crate::ir::ParamType;
use crate::ir::{Param, Scalar};
use serde::Serialize;
use std::collections::HashMap;

/// The searchable range of one param.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum ParamSpace {
    /// Integers `lo..=hi`.
    Int {
        /// The param's name as declared.
        name: String,
        /// Smallest value searched (inclusive).
        lo: i64,
        /// Largest value searched (inclusive).
        hi: i64,
    },
    /// Floats `lo..=hi`.
    Float {
        /// The param's name as declared.
        name: String,
        /// Smallest value searched (inclusive).
        lo: f64,
        /// Largest value searched (inclusive).
        hi: f64,
    },
    /// Both booleans.
    Bool {
        /// The param's name as declared.
        name: String,
    },
}

impl ParamSpace {
    /// The param's name.
    pub fn name(&self) -> &str {
        match self {
            ParamSpace::Int { name, .. }
            | ParamSpace::Float { name, .. }
            | ParamSpace::Bool { name } => name,
        }
    }

    /// The coarse grid: doubling for integers, five points for floats.
    fn grid(&self) -> Vec<Scalar> {
        match *self {
            ParamSpace::Int { lo, hi, .. } => {
                let mut values = vec![lo];
                let mut v = lo.max(1);
                if v != lo {
                    values.push(v);
                }
                while v < hi {
                    v = v.saturating_mul(2).min(hi);
                    values.push(v);
                }
                values.dedup();
                values.into_iter().map(Scalar::Int).collect()
            }
            ParamSpace::Float { lo, hi, .. } => (0..5)
                .map(|k| Scalar::Float(lo + (hi - lo) * k as f64 / 4.0))
                .collect(),
            ParamSpace::Bool { .. } => vec![Scalar::Bool(false), Scalar::Bool(true)],
        }
    }
}

/// The searchable params: declared params with a range (ints, floats) and booleans, minus
/// those the user fixed. Params without a range are left at their value.
pub fn param_spaces(params: &[Param], fixed: &[String]) -> Vec<ParamSpace> {
    params
        .iter()
        .filter(|p| !fixed.contains(&p.name))
        .filter_map(|p| match (p.ty, p.range) {
            (ParamType::Bool, _) => Some(ParamSpace::Bool {
                name: p.name.clone(),
            }),
            (ParamType::Int, Some(range)) => {
                let (Scalar::Int(lo), Scalar::Int(hi)) = (range.lo, range.hi) else {
                    return None;
                };
                let hi = if range.inclusive { hi } else { hi - 1 };
                (lo < hi).then(|| ParamSpace::Int {
                    name: p.name.clone(),
                    lo,
                    hi,
                })
            }
            (ParamType::Float, Some(range)) => {
                let as_f64 = |s: Scalar| match s {
                    Scalar::Float(v) => Some(v),
                    Scalar::Int(v) => Some(v as f64),
                    Scalar::Bool(_) => None,
                };
                let (lo, hi) = (as_f64(range.lo)?, as_f64(range.hi)?);
                // An exclusive bound is approached to the search's float resolution.
                let hi = if range.inclusive {
                    hi
                } else {
                    hi - (hi - lo) / 64.0
                };
                (lo < hi).then(|| ParamSpace::Float {
                    name: p.name.clone(),
                    lo,
                    hi,
                })
            }
            _ => None,
        })
        .collect()
}

/// One evaluated point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    /// Param values, in the order of the searched params.
    pub values: Vec<(String, Scalar)>,
    /// Predicted generation throughput (the objective), tokens/s.
    pub tokens_per_s: f64,
    /// Predicted decode-only tokens/s.
    pub decode_tokens_per_s: f64,
    /// Peak GPU bytes.
    pub gpu_bytes: u64,
    /// Peak pinned bytes.
    pub pinned_bytes: u64,
    /// Peak host bytes (pinned included).
    pub host_bytes: u64,
}

/// The share of a candidate's predicted throughput a run of `prompts` prompts keeps when
/// the candidate holds `slots` sequences at once. A prediction charges every step as if
/// each slot were full (the declared worst case), so empty slots cost time and give no
/// tokens. With static batches (prefill, then decode) the runtime runs the prompts in
/// `ceil(prompts / slots)` batches, the last one part empty; with `continuous` batching (a
/// mixed step) a freed slot takes the next waiting prompt, so only a run of fewer prompts
/// than slots leaves some empty. 1 when the prompts fill every slot; 0 for no slots.
pub fn share_of_slots_used(prompts: u64, slots: u64, continuous: bool) -> f64 {
    if slots == 0 {
        return 0.0;
    }
    if continuous {
        return (prompts as f64 / slots as f64).min(1.0);
    }
    let batches = prompts.div_ceil(slots);
    prompts as f64 / (batches * slots) as f64
}

/// What evaluating a point gave.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// It fits; here is its prediction.
    Fits(Candidate),
    /// It fits, and its throughput is at most this many tokens/s, below the threshold
    /// [`search_bounded`] gave (an upper bound from its costed tasks, before its
    /// dependencies and simulation): it cannot change the search's answer. Counted as
    /// fitting.
    Below(f64),
    /// It compiles but does not fit the budget.
    OverBudget,
    /// It does not compile or cannot be simulated (e.g. a param combination the schedule
    /// rejects); the message says why.
    Invalid(String),
    /// It fits and is predicted at `tokens_per_s`, but the full check refuses it (its
    /// expert caches, `check::cache`); `reason` is the check's code and message. Asked only
    /// of a point that could rank (its throughput at least the threshold it was given), so
    /// the search counts it as invalid, with its reason, only where it could rank: at or
    /// above the grid's last kept throughput (the `max(top, refine_from)`-th best that
    /// passed), or above a walk's best (an improvement refused); elsewhere it counts as
    /// fitting, as a point under the threshold whose check was not asked does. Never a
    /// candidate, a refinement start or in the top.
    Refused {
        /// The check's first error: `code: message`.
        reason: String,
        /// Its predicted throughput, as [`Candidate::tokens_per_s`] would be.
        tokens_per_s: f64,
    },
    /// It unrolls past an elaboration limit (tasks, loop iterations, expansions); the
    /// message says which. Counted as invalid; with [`SearchOptions::limits_grow`] the
    /// search assumes every point above it is past the limit too.
    TooLarge(String),
}

/// Points whose program is known to be another point's, for [`search_bounded`]'s
/// `evaluate` to answer without elaborating them (`moec plan`; docs/cost-model.md "Points
/// that read the same params").
///
/// The elaborator is deterministic and sees a param's value only by looking it up, which
/// it records (`ir::Program::params_read`). So a point that differs from an elaborated one
/// only in searched params that elaboration never read (MoE-Infinity's `policy` and
/// `predictor` where `code = 1` selects the released code's own, `select` evaluating only
/// the branch it gives) elaborates to the same tasks, buffers, caches and steps: the same
/// budget, costs and throughput. Its outcome is the other's, with its own values: the
/// same figures when that one fits, the same bound when it was bounded under a threshold
/// this point's is above, over budget when that one was (after elaborating). Points that
/// were invalid or past a limit are not reused, nor an over-budget answer made from the
/// declared buffers alone (no program, so no record of what was read).
#[derive(Debug, Default)]
pub struct SamePrograms {
    known: std::sync::Mutex<Vec<KnownPoint>>,
}

/// An elaborated point: its values, which of them its elaboration read, its outcome once
/// known.
#[derive(Debug)]
struct KnownPoint {
    values: Vec<(String, Scalar)>,
    read: Vec<bool>,
    outcome: Option<Outcome>,
}

impl SamePrograms {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<KnownPoint>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records which of `values` (a point's searched params) elaborating it read, from
    /// its program: a value the program names no param for counts as read.
    pub fn elaborated(&self, values: &[(String, Scalar)], program: &crate::ir::Program) {
        let read = values
            .iter()
            .map(|(name, _)| {
                program
                    .params
                    .iter()
                    .position(|p| &p.name == name)
                    .is_none_or(|i| program.params_read.get(i).copied().unwrap_or(true))
            })
            .collect();
        self.lock().push(KnownPoint {
            values: values.to_vec(),
            read,
            outcome: None,
        });
    }

    /// Records the outcome of a point [`SamePrograms::elaborated`] recorded (any other is
    /// ignored); only outcomes made from the program are kept.
    pub fn evaluated(&self, values: &[(String, Scalar)], outcome: &Outcome) {
        let keep = matches!(
            outcome,
            Outcome::Fits(_) | Outcome::Below(_) | Outcome::OverBudget | Outcome::Refused { .. }
        );
        let mut known = self.lock();
        if let Some(point) = known
            .iter_mut()
            .find(|p| p.outcome.is_none() && p.values == values)
        {
            if keep {
                point.outcome = Some(outcome.clone());
            } else {
                point.read.fill(true);
            }
        }
    }

    /// The outcome of `values` under the threshold `below`, when an elaborated point with
    /// the same values in every param its elaboration read answers it (see the type).
    pub fn known(&self, values: &[(String, Scalar)], below: f64) -> Option<Outcome> {
        let known = self.lock();
        known.iter().find_map(|point| {
            let outcome = point.outcome.as_ref()?;
            let same = point.values.len() == values.len()
                && point.values.iter().zip(values).zip(&point.read).all(
                    |(((name, held), (other, value)), &read)| {
                        name == other && (!read || held == value)
                    },
                );
            if !same {
                return None;
            }
            match outcome {
                Outcome::Fits(candidate) => Some(Outcome::Fits(Candidate {
                    values: values.to_vec(),
                    ..candidate.clone()
                })),
                Outcome::Below(bound) if *bound < below => Some(Outcome::Below(*bound)),
                Outcome::OverBudget => Some(Outcome::OverBudget),
                Outcome::Refused { .. } => Some(outcome.clone()),
                _ => None,
            }
        })
    }
}

/// Search limits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SearchOptions {
    /// Most points in the coarse grid (larger grids are thinned).
    pub max_grid: usize,
    /// Points refined by bisection.
    pub refine_from: usize,
    /// Candidates returned.
    pub top: usize,
    /// Assume unrolling only grows with integer params: a point whose integer params are
    /// all at least those of a point past an elaboration limit (its other params equal)
    /// is not evaluated and counted in [`PlanResult::skipped_too_large`]. Not exact in
    /// general (a schedule may unroll less for a larger value); it spares elaborating
    /// millions of tasks only to hit the limit again. `false`: every point is evaluated.
    pub limits_grow: bool,
    /// Run the refinement's walks ahead, side by side on every free thread, before the
    /// walks that count (`refine::run_ahead`): the same answer and counts, sooner.
    /// `false`: each walk evaluates as it goes (the reference the tests compare with).
    pub walk_ahead: bool,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            max_grid: 400,
            refine_from: 3,
            top: 5,
            limits_grow: true,
            walk_ahead: true,
        }
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanResult {
    /// The params searched.
    pub searched: Vec<ParamSpace>,
    /// Best candidates, best first.
    pub top: Vec<Candidate>,
    /// Points evaluated.
    pub evaluated: usize,
    /// Points that fit.
    pub feasible: usize,
    /// Points over budget.
    pub over_budget: usize,
    /// Points that did not compile; the first few reasons.
    pub invalid: usize,
    /// Up to three distinct reasons points were invalid.
    pub invalid_reasons: Vec<String>,
    /// Points not evaluated because a point below them unrolled past a limit
    /// ([`SearchOptions::limits_grow`]).
    pub skipped_too_large: usize,
}

type Point = Vec<Scalar>;

fn key(point: &Point) -> String {
    point
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs the search. `evaluate` receives `(name, value)` pairs for the searched params.
pub fn search(
    spaces: &[ParamSpace],
    options: &SearchOptions,
    evaluate: impl Fn(&[(String, Scalar)]) -> Outcome + Sync,
) -> PlanResult {
    search_bounded(spaces, options, |values, _| evaluate(values))
}

/// [`search`], where `evaluate(values, below)` may answer [`Outcome::Below`] for a point
/// that fits and whose throughput it can bound under `below` tokens/s without predicting
/// it exactly. The answer (the top candidates, their order and every count) is
/// [`search`]'s with the same exact evaluation: `below` is only ever a value such a point
/// cannot matter under. On the coarse grid it is the `max(top, refine_from)`-th best
/// throughput found so far (strictly below it, a point can be neither a refinement start
/// nor in the top: the final list holds at least that many points as good); in a
/// bisection walk it is the walk's best (a point strictly below it is no improvement, and
/// only improvements join the list). A bounded point met again by a walk whose best is
/// below its bound is evaluated exactly then (not counted again; counted then when that
/// walk meets it first). `evaluate` may also leave a check to the points at or above
/// `below` ([`Outcome::Refused`]): a refused point is counted where it could rank whatever
/// the timing, so the answer and counts stay the plain search's where every point is
/// checked.
pub fn search_bounded(
    spaces: &[ParamSpace],
    options: &SearchOptions,
    evaluate: impl Fn(&[(String, Scalar)], f64) -> Outcome + Sync,
) -> PlanResult {
    // `MOEC_PLAN_TRACE=1`: each point's values, outcome and evaluation time on stderr
    // (where a search's time goes; docs/cost-model.md).
    let trace = std::env::var_os("MOEC_PLAN_TRACE").is_some();
    // Each line also says when the point ended, from the search's start (where the wall
    // time goes: the phases and which points ran side by side).
    let search_began = std::time::Instant::now();
    let evaluate = |values: &[(String, Scalar)], below: f64| -> Outcome {
        if !trace {
            return evaluate(values, below);
        }
        let started = std::time::Instant::now();
        let outcome = evaluate(values, below);
        let spelled: Vec<String> = values.iter().map(|(n, v)| format!("{n}={v}")).collect();
        let what = match &outcome {
            Outcome::Fits(c) => format!("fits {:.4} tok/s", c.tokens_per_s),
            Outcome::Below(bound) => format!("fits, at most {bound:.4} tok/s (< {below:.4})"),
            Outcome::OverBudget => "over budget".to_string(),
            Outcome::Invalid(_) => "invalid".to_string(),
            Outcome::TooLarge(_) => "too large".to_string(),
            Outcome::Refused { tokens_per_s, .. } => {
                format!("refused by the full check at {tokens_per_s:.4} tok/s")
            }
        };
        eprintln!(
            "plan-trace {} {what} {:.3} s (ended at {:.2} s)",
            spelled.join(" "),
            started.elapsed().as_secs_f64(),
            search_began.elapsed().as_secs_f64()
        );
        outcome
    };
    let mut grids: Vec<Vec<Scalar>> = spaces.iter().map(ParamSpace::grid).collect();
    // Thin the largest grid (every other value, keeping both ends) until the product fits.
    loop {
        let product: usize = grids.iter().map(Vec::len).product();
        if product <= options.max_grid.max(1) {
            break;
        }
        let Some((largest, _)) = grids
            .iter()
            .enumerate()
            .filter(|(_, g)| g.len() > 2)
            .max_by_key(|(_, g)| g.len())
        else {
            break;
        };
        let grid = &grids[largest];
        let last = grid[grid.len() - 1];
        let mut thinned: Vec<Scalar> = grid.iter().step_by(2).copied().collect();
        if thinned.last() != Some(&last) {
            thinned.push(last);
        }
        grids[largest] = thinned;
    }

    let mut memo: HashMap<String, Option<Candidate>> = HashMap::new();
    let mut result = PlanResult {
        searched: spaces.to_vec(),
        top: Vec::new(),
        evaluated: 0,
        feasible: 0,
        over_budget: 0,
        invalid: 0,
        invalid_reasons: Vec::new(),
        skipped_too_large: 0,
    };
    let values_of = |point: &Point| -> Vec<(String, Scalar)> {
        spaces
            .iter()
            .map(|s| s.name().to_string())
            .zip(point.iter().copied())
            .collect()
    };
    let record = |outcome: Outcome, result: &mut PlanResult| -> Option<Candidate> {
        result.evaluated += 1;
        match outcome {
            Outcome::Fits(candidate) => {
                result.feasible += 1;
                Some(candidate)
            }
            // Kept apart by the callers (`bounded`): it fits, and is no candidate.
            Outcome::Below(_) => {
                result.feasible += 1;
                None
            }
            Outcome::OverBudget => {
                result.over_budget += 1;
                None
            }
            // The callers settle it first (`settle_refused`): where it could rank it is
            // invalid, elsewhere it fits.
            Outcome::Refused { reason, .. }
            | Outcome::Invalid(reason)
            | Outcome::TooLarge(reason) => {
                result.invalid += 1;
                if result.invalid_reasons.len() < 3 && !result.invalid_reasons.contains(&reason) {
                    result.invalid_reasons.push(reason);
                }
                None
            }
        }
    };
    // Coarse grid: the cartesian product in lexicographic order.
    let mut points: Vec<Point> = Vec::new();
    let mut indices: Vec<Vec<usize>> = Vec::new();
    let mut index = vec![0usize; grids.len()];
    loop {
        points.push(index.iter().zip(&grids).map(|(&i, g)| g[i]).collect());
        indices.push(index.clone());
        let mut dim = 0;
        while dim < grids.len() {
            index[dim] += 1;
            if index[dim] < grids[dim].len() {
                break;
            }
            index[dim] = 0;
            dim += 1;
        }
        if dim == grids.len() {
            break;
        }
    }
    // Kept or skipped as waves of equal grid-index sum (smallest params first) would keep
    // them, so a point past an elaboration limit is known before the points above it are
    // settled (`evaluate_grid` may start them earlier); recorded in lexicographic order
    // whatever the timing, so ties rank as they always did.
    let integer: Vec<bool> = spaces
        .iter()
        .map(|s| matches!(s, ParamSpace::Int { .. }))
        .collect();
    let dominated = |point: &Point, too_large: &[Point]| {
        options.limits_grow
            && too_large.iter().any(|low| {
                point
                    .iter()
                    .zip(low)
                    .zip(&integer)
                    .all(|((q, p), &int)| match (int, q, p) {
                        (true, Scalar::Int(q), Scalar::Int(p)) => q >= p,
                        _ => q == p,
                    })
            })
    };
    // The best throughputs of the grid so far, best first, at most `keep` of them: a point
    // strictly below the `keep`-th cannot be a refinement start or in the top.
    let keep = options.top.max(options.refine_from).max(1);
    let best_so_far: std::sync::Mutex<Vec<f64>> = std::sync::Mutex::new(Vec::new());
    let grid_threshold = || {
        let best = best_so_far.lock().unwrap_or_else(|e| e.into_inner());
        if best.len() < keep {
            f64::NEG_INFINITY
        } else {
            best[keep - 1]
        }
    };
    let (outcomes, too_large) = evaluate_grid(
        &points,
        &indices,
        &grids,
        &integer,
        |i| evaluate(&values_of(&points[i]), grid_threshold()),
        // Only kept outcomes raise the threshold: a point started ahead and then skipped
        // is in no list, so it must not push another point under the threshold.
        |outcome| {
            if let Outcome::Fits(candidate) = outcome {
                let mut best = best_so_far.lock().unwrap_or_else(|e| e.into_inner());
                let at = best.partition_point(|&b| b >= candidate.tokens_per_s);
                best.insert(at, candidate.tokens_per_s);
                best.truncate(keep);
            }
        },
        &|point: &Point, too_large: &[Point]| dominated(point, too_large),
    );
    // The grid's last kept throughput: a refused point at or above it could rank (it was
    // checked whatever the timing, since no threshold the grid gave was above it).
    let ranks_from = {
        let mut kept: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| match o {
                Some(Outcome::Fits(c)) => Some(c.tokens_per_s),
                _ => None,
            })
            .collect();
        kept.sort_by(|a, b| b.total_cmp(a));
        kept.get(keep - 1).copied().unwrap_or(f64::NEG_INFINITY)
    };
    // Points that fit whose throughput is only known to be at most the value held.
    let mut bounded: HashMap<String, f64> = HashMap::new();
    let mut found: Vec<(Point, Candidate)> = Vec::new();
    for (point, outcome) in points.into_iter().zip(outcomes) {
        let Some(outcome) = outcome else {
            result.skipped_too_large += 1;
            memo.insert(key(&point), None);
            continue;
        };
        let outcome = settle_refused(outcome, |t| t >= ranks_from);
        if let Outcome::Below(bound) = outcome {
            record(outcome, &mut result);
            bounded.insert(key(&point), bound);
            continue;
        }
        let candidate = record(outcome, &mut result);
        memo.insert(key(&point), candidate.clone());
        if let Some(candidate) = candidate {
            found.push((point, candidate));
        }
    }

    // Refinement: coordinate-wise bisection between each start and its grid neighbours
    // (`refine::bisect`), the walks first run ahead side by side (`refine::run_ahead`),
    // then one after another, counting, as they always were: the same answer and counts.
    let by_throughput = |a: &(Point, Candidate), b: &(Point, Candidate)| {
        b.1.tokens_per_s.total_cmp(&a.1.tokens_per_s)
    };
    found.sort_by(by_throughput);
    let starts: Vec<(Point, Candidate)> = found.iter().take(options.refine_from).cloned().collect();
    let mut state = refine::WalkState {
        memo,
        bounded,
        too_large,
    };
    let evaluation = refine::Evaluation {
        evaluate: &evaluate,
        values_of: &values_of,
        dominated: &dominated,
    };
    let mut ahead = if options.walk_ahead && starts.len() > 1 && rayon::current_num_threads() > 1 {
        refine::run_ahead(spaces, &grids, &starts, &state, &evaluation)
    } else {
        refine::Ahead::default()
    };
    for (start, start_candidate) in starts {
        let mut walker = refine::CountingWalker {
            state: &mut state,
            result: &mut result,
            ahead: &mut ahead,
            evaluation: &evaluation,
            record: &record,
        };
        found.extend(refine::bisect(
            spaces,
            &grids,
            start,
            start_candidate.tokens_per_s,
            &mut walker,
        ));
    }
    found.sort_by(by_throughput);
    let mut seen = std::collections::HashSet::new();
    result.top = found
        .into_iter()
        .filter(|(p, _)| seen.insert(key(p)))
        .take(options.top)
        .map(|(_, c)| c)
        .collect();
    result
}

/// A refused point as the search counts it (`Outcome::Refused`): invalid, with its reason,
/// where it could rank (`could_rank` of its throughput); elsewhere a point that fits and
/// is known to be at most its throughput, as one under the threshold whose check was not
/// asked. Every other outcome as it is.
fn settle_refused(outcome: Outcome, could_rank: impl FnOnce(f64) -> bool) -> Outcome {
    match outcome {
        Outcome::Refused {
            reason,
            tokens_per_s,
        } => {
            if could_rank(tokens_per_s) {
                Outcome::Invalid(reason)
            } else {
                Outcome::Below(tokens_per_s)
            }
        }
        other => other,
    }
}

/// Evaluates the coarse grid: every point, except one whose integer params are all at
/// least those of a point past an elaboration limit (`dominated`), which stays `None`.
/// Gives each point's outcome (in `points`' order) and the points past the limit;
/// `counted` sees each outcome that is kept, once, as soon as it is known to be kept.
///
/// Whether a point is skipped depends only on the points below it (a point that dominates
/// it is one grid step or more below it in each integer param), so it is decided once the
/// points one step below it in each integer param are settled (kept or skipped), exactly
/// as evaluating the grid in waves of equal index sum decides it, whatever the timing.
/// The evaluation itself need not wait for that: a free thread starts any point whose
/// points one step below have all been started, and the point is settled when they are
/// (its outcome dropped if it turns out skipped). So a chain of points, each one step
/// above the last (`n_ub` 1, 2, 4, ... 64 at the smallest batch), runs side by side on
/// the free threads instead of one point after the other on one, and no thread idles
/// while a point is left to start. Of the points that may start, the one whose slowest
/// point below has taken longest so far starts first (the larger points of a chain, whose
/// cost grows with it, start early instead of holding the last seconds alone). A point
/// started ahead and then skipped costs its evaluation for nothing; the shipped schedules
/// have no point past a limit on the cards in docs/cost-model.md, where none is wasted.
fn evaluate_grid(
    points: &[Point],
    indices: &[Vec<usize>],
    grids: &[Vec<Scalar>],
    integer: &[bool],
    evaluate: impl Fn(usize) -> Outcome + Sync,
    counted: impl Fn(&Outcome) + Sync,
    dominated: &(dyn Fn(&Point, &[Point]) -> bool + Sync),
) -> (Vec<Option<Outcome>>, Vec<Point>) {
    use std::sync::Mutex;
    use std::time::Instant;
    // Position of an index vector: the grid is enumerated with the first param fastest.
    let mut stride = vec![1usize; grids.len()];
    for dim in 1..grids.len() {
        stride[dim] = stride[dim - 1] * grids[dim - 1].len();
    }
    let n = points.len();
    let mut below: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut above: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, index) in indices.iter().enumerate() {
        for ((&at, &int), &step) in index.iter().zip(integer).zip(&stride) {
            if int && at > 0 {
                below[i].push(i - step);
                above[i - step].push(i);
            }
        }
    }
    /// Where one point is.
    #[derive(Clone)]
    enum Stage {
        /// Not started.
        Waiting,
        /// Being evaluated since then.
        Running(Instant),
        /// Evaluated (`None`: known to be skipped when started) in this many seconds,
        /// not yet settled.
        Done(Option<Outcome>, f64),
        /// Settled (its outcome in `outcomes`) after this many seconds of evaluation.
        Settled(f64),
    }
    struct State {
        stage: Vec<Stage>,
        /// Points one step below not yet settled.
        unsettled_below: Vec<usize>,
        outcomes: Vec<Option<Outcome>>,
        too_large: Vec<Point>,
    }
    let state = Mutex::new(State {
        stage: vec![Stage::Waiting; n],
        unsettled_below: below.iter().map(Vec::len).collect(),
        outcomes: vec![None; n],
        too_large: Vec::new(),
    });
    let lock = || state.lock().unwrap_or_else(|e| e.into_inner());
    // The next point to start: one whose points below have all started, the one whose
    // slowest point below has taken longest so far first (ties: grid order).
    let pick = |state: &State, now: Instant| -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (i, below_i) in below.iter().enumerate() {
            if !matches!(state.stage[i], Stage::Waiting) {
                continue;
            }
            let mut slowest = 0.0f64;
            let mut ready = true;
            for &b in below_i {
                match &state.stage[b] {
                    Stage::Waiting => {
                        ready = false;
                        break;
                    }
                    Stage::Running(since) => slowest = slowest.max((now - *since).as_secs_f64()),
                    Stage::Done(_, took) | Stage::Settled(took) => slowest = slowest.max(*took),
                }
            }
            if ready && best.is_none_or(|(_, s)| slowest > s) {
                best = Some((i, slowest));
            }
        }
        best.map(|(i, _)| i)
    };
    // Settles `first` if it is evaluated and the points below it are settled, then every
    // point above it that this makes settleable.
    let settle = |state: &mut State, first: usize| {
        let mut queue = vec![first];
        while let Some(i) = queue.pop() {
            if state.unsettled_below[i] > 0 {
                continue;
            }
            let Stage::Done(outcome, took) = &state.stage[i] else {
                continue;
            };
            let took = *took;
            let outcome = if dominated(&points[i], &state.too_large) {
                None
            } else {
                outcome.clone()
            };
            if let Some(outcome) = &outcome {
                if let Outcome::TooLarge(_) = outcome {
                    state.too_large.push(points[i].clone());
                }
                counted(outcome);
            }
            state.outcomes[i] = outcome;
            state.stage[i] = Stage::Settled(took);
            for &next in &above[i] {
                state.unsettled_below[next] -= 1;
                if state.unsettled_below[next] == 0 {
                    queue.push(next);
                }
            }
        }
    };
    let worker = || loop {
        let (i, skip) = {
            let mut state = lock();
            let now = Instant::now();
            let Some(i) = pick(&state, now) else {
                break;
            };
            state.stage[i] = Stage::Running(now);
            // Already dominated by a settled point past the limit: it will be skipped.
            (i, dominated(&points[i], &state.too_large))
        };
        let began = Instant::now();
        let outcome = (!skip).then(|| evaluate(i));
        let took = began.elapsed().as_secs_f64();
        let mut state = lock();
        state.stage[i] = Stage::Done(outcome, took);
        settle(&mut state, i);
    };
    let threads = rayon::current_num_threads().clamp(1, n.max(1));
    rayon::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|_| worker());
        }
    });
    let state = state.into_inner().unwrap_or_else(|e| e.into_inner());
    (state.outcomes, state.too_large)
}

/// The value halfway between `from` and `to`, or `None` when none is left in between.
fn midpoint(space: &ParamSpace, from: Scalar, to: Scalar) -> Option<Scalar> {
    match (space, from, to) {
        (ParamSpace::Int { .. }, Scalar::Int(a), Scalar::Int(b)) => {
            let mid = a + (b - a) / 2;
            (mid != a && mid != b).then_some(Scalar::Int(mid))
        }
        (ParamSpace::Float { lo, hi, .. }, Scalar::Float(a), Scalar::Float(b)) => {
            let resolution = (hi - lo) / 64.0;
            ((a - b).abs() > resolution).then_some(Scalar::Float((a + b) / 2.0))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand: 16 prompts in 64 slots use a quarter of one batch; 16 in 16, all; 20 in 16
    /// take two static batches of 16 (20 of 32 slots used), or keep 16 slots busy under
    /// continuous batching; no slots give nothing.
    #[test]
    fn slots_beyond_the_prompts_earn_nothing() {
        for continuous in [false, true] {
            assert_eq!(share_of_slots_used(16, 64, continuous), 0.25);
            assert_eq!(share_of_slots_used(16, 16, continuous), 1.0);
            assert_eq!(share_of_slots_used(16, 0, continuous), 0.0);
        }
        assert_eq!(share_of_slots_used(20, 16, false), 20.0 / 32.0);
        assert_eq!(share_of_slots_used(20, 16, true), 1.0);
    }

    fn candidate(values: &[(String, Scalar)], tokens_per_s: f64) -> Candidate {
        Candidate {
            values: values.to_vec(),
            tokens_per_s,
            decode_tokens_per_s: tokens_per_s,
            gpu_bytes: 0,
            pinned_bytes: 0,
            host_bytes: 0,
        }
    }

    /// Throughput rises with the batch until memory runs out at 37: the search must find
    /// exactly 37 (doubling to 64 overshoots; bisection between 32 and 64 lands on it).
    #[test]
    fn finds_the_largest_feasible_batch() {
        let spaces = vec![ParamSpace::Int {
            name: "ubs".into(),
            lo: 1,
            hi: 4096,
        }];
        let result = search(&spaces, &SearchOptions::default(), |values| {
            let Scalar::Int(ubs) = values[0].1 else {
                unreachable!()
            };
            if ubs > 37 {
                Outcome::OverBudget
            } else {
                Outcome::Fits(candidate(values, ubs as f64))
            }
        });
        assert_eq!(result.top[0].values[0].1, Scalar::Int(37));
        assert!(result.evaluated < 40, "{}", result.evaluated);
    }

    /// An interior optimum in two dimensions (a concave bowl at ubs = 100, r = 0.3).
    #[test]
    fn finds_an_interior_optimum() {
        let spaces = vec![
            ParamSpace::Int {
                name: "ubs".into(),
                lo: 1,
                hi: 1024,
            },
            ParamSpace::Float {
                name: "r".into(),
                lo: 0.0,
                hi: 1.0,
            },
        ];
        let result = search(&spaces, &SearchOptions::default(), |values| {
            let (Scalar::Int(ubs), Scalar::Float(r)) = (values[0].1, values[1].1) else {
                unreachable!()
            };
            let score = 1000.0
                - ((ubs as f64).ln() - 100f64.ln()).powi(2) * 50.0
                - (r - 0.3).powi(2) * 100.0;
            Outcome::Fits(candidate(values, score))
        });
        let best = &result.top[0];
        let Scalar::Int(ubs) = best.values[0].1 else {
            unreachable!()
        };
        let Scalar::Float(r) = best.values[1].1 else {
            unreachable!()
        };
        assert!((90..=110).contains(&ubs), "{ubs}");
        assert!((r - 0.3).abs() < 0.05, "{r}");
    }

    /// Points past a limit (ubs * n > 100) skip every point above them, and the grid's
    /// points may start before those below them are settled: the points counted as
    /// evaluated and skipped are those of evaluating the grid in waves of equal index sum,
    /// one wave at a time (the reference below, written out sequentially), and any other
    /// point evaluated was started ahead of a point below it past the limit.
    #[test]
    fn the_grid_skips_what_waves_skip() {
        use std::sync::Mutex;
        let spaces = vec![
            ParamSpace::Int {
                name: "ubs".into(),
                lo: 1,
                hi: 64,
            },
            ParamSpace::Bool { name: "b".into() },
            ParamSpace::Int {
                name: "n".into(),
                lo: 1,
                hi: 16,
            },
        ];
        let too_large = |ubs: i64, n: i64, b: bool| ubs * n > if b { 100 } else { 40 };
        let seen = Mutex::new(Vec::new());
        let result = search(
            &spaces,
            &SearchOptions {
                refine_from: 0,
                ..SearchOptions::default()
            },
            |values| {
                let (Scalar::Int(ubs), Scalar::Bool(b), Scalar::Int(n)) =
                    (values[0].1, values[1].1, values[2].1)
                else {
                    unreachable!()
                };
                seen.lock().unwrap().push((ubs, b, n));
                if too_large(ubs, n, b) {
                    Outcome::TooLarge("limit".into())
                } else {
                    Outcome::Fits(candidate(values, (ubs * n) as f64))
                }
            },
        );
        // The reference: waves of equal index sum over the doubling grids.
        let ubs_grid: Vec<i64> = (0..7).map(|k| 1 << k).collect();
        let n_grid: Vec<i64> = (0..5).map(|k| 1 << k).collect();
        let mut evaluated = Vec::new();
        let mut past: Vec<(i64, bool, i64)> = Vec::new();
        for wave in 0..=(6 + 1 + 4) {
            let mut found = Vec::new();
            for (i, &ubs) in ubs_grid.iter().enumerate() {
                for (j, b) in [false, true].into_iter().enumerate() {
                    for (k, &n) in n_grid.iter().enumerate() {
                        let dominated = past
                            .iter()
                            .any(|&(pu, pb, pn)| pb == b && ubs >= pu && n >= pn);
                        if i + j + k == wave && !dominated {
                            evaluated.push((ubs, b, n));
                            if too_large(ubs, n, b) {
                                found.push((ubs, b, n));
                            }
                        }
                    }
                }
            }
            past.extend(found);
        }
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        seen.dedup();
        evaluated.sort();
        for point in &evaluated {
            assert!(seen.contains(point), "{point:?} never evaluated");
        }
        for &(ubs, b, n) in &seen {
            let counted = evaluated.contains(&(ubs, b, n));
            let ahead = past
                .iter()
                .any(|&(pu, pb, pn)| pb == b && ubs >= pu && n >= pn);
            assert!(counted || ahead, "{:?} evaluated for nothing", (ubs, b, n));
        }
        assert_eq!(result.evaluated, evaluated.len());
        assert_eq!(result.skipped_too_large, 7 * 2 * 5 - evaluated.len());
        assert_eq!(result.invalid, past.len());
        assert_eq!(result.top[0].tokens_per_s, 64.0);
    }

    /// Two integer params and a float: `ubs` in 1..=512, `n` in 1..=16, `r` in 0..=1.
    fn ubs_n_r() -> Vec<ParamSpace> {
        vec![
            ParamSpace::Int {
                name: "ubs".into(),
                lo: 1,
                hi: 512,
            },
            ParamSpace::Int {
                name: "n".into(),
                lo: 1,
                hi: 16,
            },
            ParamSpace::Float {
                name: "r".into(),
                lo: 0.0,
                hi: 1.0,
            },
        ]
    }

    /// A point of [`ubs_n_r`]'s values; `None` (over budget) where `ubs * n > 900`.
    fn ubs_n_r_of(values: &[(String, Scalar)]) -> Option<(i64, i64, f64)> {
        let (Scalar::Int(ubs), Scalar::Int(n), Scalar::Float(r)) =
            (values[0].1, values[1].1, values[2].1)
        else {
            unreachable!()
        };
        (ubs * n <= 900).then_some((ubs, n, r))
    }

    /// A bounded search gives the plain search's answer and counts: an evaluation that
    /// answers `Below` whenever its bound (here 1.25x the exact throughput, an upper bound
    /// as the planner's is) falls under the threshold it was given. On a bumpy landscape
    /// with several local optima, two integer params and a float, over-budget points, a
    /// tight top list and several refinement starts, so bounded points meet later walks.
    #[test]
    fn a_bounded_search_answers_as_the_plain_one() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let spaces = ubs_n_r();
        let exact = |values: &[(String, Scalar)]| -> Option<f64> {
            let (ubs, n, r) = ubs_n_r_of(values)?;
            let x = (ubs as f64).ln();
            Some(10.0 + 3.0 * (x * 1.7).sin() + (n as f64).sqrt() - 4.0 * (r - 0.6).powi(2))
        };
        for (top, refine_from) in [(1, 1), (2, 3), (5, 3), (3, 6)] {
            let options = SearchOptions {
                top,
                refine_from,
                ..SearchOptions::default()
            };
            let plain = search(&spaces, &options, |values| match exact(values) {
                Some(t) => Outcome::Fits(candidate(values, t)),
                None => Outcome::OverBudget,
            });
            let below_answers = AtomicUsize::new(0);
            let bounded = search_bounded(&spaces, &options, |values, below| match exact(values) {
                Some(t) if t * 1.25 < below => {
                    below_answers.fetch_add(1, Ordering::Relaxed);
                    Outcome::Below(t * 1.25)
                }
                Some(t) => Outcome::Fits(candidate(values, t)),
                None => Outcome::OverBudget,
            });
            assert_eq!(bounded, plain, "top {top}, refine_from {refine_from}");
            assert!(below_answers.into_inner() > 0, "top {top}: nothing bounded");
        }
    }

    /// Points the full check refuses (`Outcome::Refused`, asked only of a point at or
    /// above the threshold, as `evaluate_point_bounded` asks it) leave the answer and every
    /// count the plain search's, where every point is checked: a refused point counts as
    /// invalid only where it could rank, whatever the timing, and none is a candidate. On
    /// the bumpy landscape above with a region refused (large `ubs` at several `n`, as a
    /// cache's slots refuse the largest batches), with and without the walks run ahead.
    #[test]
    fn refused_points_never_rank_and_are_counted_as_the_plain_search_counts_them() {
        let spaces = ubs_n_r();
        // (throughput, refused) or over budget.
        let exact = |values: &[(String, Scalar)]| -> Option<(f64, bool)> {
            let (ubs, n, r) = ubs_n_r_of(values)?;
            let t = 5.0 + (ubs as f64).ln() + (n as f64).sqrt() - 4.0 * (r - 0.6).powi(2);
            Some((t, ubs * n > 200 && n != 8))
        };
        let refused = |values: &[(String, Scalar)], t: f64| Outcome::Refused {
            reason: format!("cache::deadlock: {values:?}"),
            tokens_per_s: t,
        };
        let mut invalid_seen = 0;
        for walk_ahead in [false, true] {
            for (top, refine_from) in [(1, 1), (2, 3), (5, 3), (3, 6)] {
                let options = SearchOptions {
                    top,
                    refine_from,
                    walk_ahead,
                    ..SearchOptions::default()
                };
                let plain = search(&spaces, &options, |values| match exact(values) {
                    Some((t, true)) => refused(values, t),
                    Some((t, false)) => Outcome::Fits(candidate(values, t)),
                    None => Outcome::OverBudget,
                });
                let bounded =
                    search_bounded(&spaces, &options, |values, below| match exact(values) {
                        Some((t, _)) if t * 1.25 < below => Outcome::Below(t * 1.25),
                        Some((t, _)) if t < below => Outcome::Below(t),
                        Some((t, true)) => refused(values, t),
                        Some((t, false)) => Outcome::Fits(candidate(values, t)),
                        None => Outcome::OverBudget,
                    });
                let at = format!("top {top}, refine_from {refine_from}, ahead {walk_ahead}");
                assert_eq!(bounded, plain, "{at}");
                assert!(!plain.top.is_empty(), "{at}");
                for c in &plain.top {
                    assert_eq!(exact(&c.values).map(|(_, r)| r), Some(false), "{at}: {c:?}");
                }
                invalid_seen += plain.invalid;
                assert!(
                    plain
                        .invalid_reasons
                        .iter()
                        .all(|r| r.starts_with("cache::deadlock: ")),
                    "{at}: {plain:?}"
                );
            }
        }
        assert!(invalid_seen > 0, "no refused point could rank");
    }

    /// The walks run ahead side by side, then one after another (`walk_ahead`), give the
    /// answer and every count of walks that evaluate as they go: on a bumpy landscape
    /// with over-budget points, points past a limit (which an earlier walk finds and a
    /// walk run ahead does not know of), bounded points met by walks with other bests,
    /// several starts, on three threads.
    #[test]
    fn walks_run_ahead_answer_as_walks_one_after_another() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let spaces = vec![
            ParamSpace::Int {
                name: "ubs".into(),
                lo: 1,
                hi: 700,
            },
            ParamSpace::Int {
                name: "n".into(),
                lo: 1,
                hi: 24,
            },
            ParamSpace::Float {
                name: "r".into(),
                lo: 0.0,
                hi: 1.0,
            },
        ];
        let evaluations = AtomicUsize::new(0);
        let evaluate = |values: &[(String, Scalar)], below: f64| -> Outcome {
            evaluations.fetch_add(1, Ordering::Relaxed);
            let (Scalar::Int(ubs), Scalar::Int(n), Scalar::Float(r)) =
                (values[0].1, values[1].1, values[2].1)
            else {
                unreachable!()
            };
            if ubs * n > 2000 {
                return Outcome::TooLarge("limit".into());
            }
            if ubs * n > 900 || (ubs % 7 == 3 && r > 0.5) {
                return Outcome::OverBudget;
            }
            let x = (ubs as f64).ln();
            let t = 10.0 + 3.0 * (x * 1.7).sin() + (n as f64).sqrt() * (1.0 + (x * 0.9).cos())
                - 4.0 * (r - 0.6).powi(2);
            if t * 1.25 < below {
                Outcome::Below(t * 1.25)
            } else {
                Outcome::Fits(candidate(values, t))
            }
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for (top, refine_from) in [(1, 3), (2, 3), (5, 4), (3, 6), (10, 2)] {
            for limits_grow in [true, false] {
                let options = |walk_ahead| SearchOptions {
                    top,
                    refine_from,
                    limits_grow,
                    walk_ahead,
                    ..SearchOptions::default()
                };
                let one_by_one =
                    pool.install(|| search_bounded(&spaces, &options(false), evaluate));
                let before = evaluations.load(Ordering::Relaxed);
                let ahead = pool.install(|| search_bounded(&spaces, &options(true), evaluate));
                let made = evaluations.load(Ordering::Relaxed) - before;
                assert_eq!(ahead, one_by_one, "top {top}, refine_from {refine_from}");
                assert!(made >= ahead.evaluated, "{made} < {}", ahead.evaluated);
            }
        }
    }

    #[test]
    fn invalid_points_are_counted_with_reasons() {
        let spaces = vec![ParamSpace::Bool {
            name: "cpu_attn".into(),
        }];
        let result = search(&spaces, &SearchOptions::default(), |values| {
            match values[0].1 {
                Scalar::Bool(true) => Outcome::Invalid("needs n_ub >= 2".into()),
                _ => Outcome::Fits(candidate(values, 1.0)),
            }
        });
        assert_eq!((result.feasible, result.invalid), (1, 1));
        assert_eq!(result.invalid_reasons, vec!["needs n_ub >= 2".to_string()]);
    }
}
