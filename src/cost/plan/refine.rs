//! The search's refinement: coordinate-wise bisection walks from the grid's best points
//! (`super::search_bounded`), and the walks run ahead on every free thread.
//!
//! A walk's path depends only on the outcomes of the points it meets, and every outcome is
//! a function of the point (exact figures; or a bound that is itself a function of the
//! point, given only where it falls under the walk's best, which decides the step the same
//! way the exact figure would: see [`Walker::outcome`]). So the walks can first be run
//! *dry* side by side, each from the state the grid left, their evaluations kept in a
//! shared table; then the walks are run one after another as they always were, taking
//! those evaluations instead of making them. Only that second run counts points and
//! records candidates, so the answer and every count are the sequential search's. Where a
//! dry walk differs from its sequential run (a point past an elaboration limit that an
//! earlier walk found, which the dry walk did not know of), the sequential run evaluates
//! what it lacks itself: slower, never different.

use super::{key, settle_refused, Candidate, Outcome, ParamSpace, PlanResult, Point};
use crate::ir::Scalar;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Mutex;

/// What a bisection walk asks of the points it meets.
pub(super) trait Walker {
    /// The points the walk may meet next (both midpoints of its interval), which a
    /// walker may evaluate ahead, side by side, at the walk's `best`.
    fn ahead(&mut self, points: Vec<Point>, best: f64);
    /// The point's candidate as a walk whose best is `best` needs it: its candidate when it
    /// fits; `None` when it does not, or when it is only known to be at most a throughput
    /// not above `best` (then its exact figure could not beat `best` either).
    fn outcome(&mut self, point: &Point, best: f64) -> Option<Candidate>;
}

/// A point's evaluation under a threshold (`search_bounded`'s `evaluate`).
pub(super) type EvaluateFn<'e> = dyn Fn(&[(String, Scalar)], f64) -> Outcome + Sync + 'e;

/// The search's shared pieces a walker evaluates with.
pub(super) struct Evaluation<'e> {
    /// Evaluates a point (its searched values) under a threshold (`search_bounded`).
    pub evaluate: &'e EvaluateFn<'e>,
    /// A point's searched values with their names.
    pub values_of: &'e (dyn Fn(&Point) -> Vec<(String, Scalar)> + Sync),
    /// Whether a point is skipped as above a point past an elaboration limit.
    pub dominated: &'e (dyn Fn(&Point, &[Point]) -> bool + Sync),
}

/// The search state the sequential walks share and the dry walks start from.
#[derive(Clone, Default)]
pub(super) struct WalkState {
    /// Outcomes known: the candidate, or `None` (no candidate, or skipped).
    pub memo: HashMap<String, Option<Candidate>>,
    /// Points that fit whose throughput is only known to be at most the value held.
    pub bounded: HashMap<String, f64>,
    /// Points past an elaboration limit.
    pub too_large: Vec<Point>,
}

/// One coordinate-wise bisection walk from `start` (throughput `best`) between its grid
/// neighbours in each dimension in turn; gives the improvements in the order found.
pub(super) fn bisect(
    spaces: &[ParamSpace],
    grids: &[Vec<Scalar>],
    start: Point,
    mut best: f64,
    walker: &mut impl Walker,
) -> Vec<(Point, Candidate)> {
    let mut improvements = Vec::new();
    let mut current = start;
    for (dim, space) in spaces.iter().enumerate() {
        let grid = &grids[dim];
        let at = grid.iter().position(|v| *v == current[dim]);
        let (mut below, mut above) = match at {
            Some(i) => (
                if i > 0 { Some(grid[i - 1]) } else { None },
                grid.get(i + 1).copied(),
            ),
            None => (None, None),
        };
        for _ in 0..24 {
            // Both midpoints this iteration may try.
            let ahead: Vec<Point> = [below, above]
                .into_iter()
                .flatten()
                .filter_map(|bound| super::midpoint(space, current[dim], bound))
                .map(|mid| {
                    let mut point = current.clone();
                    point[dim] = mid;
                    point
                })
                .collect();
            walker.ahead(ahead, best);
            let mut improved = false;
            for bound in [below, above].into_iter().flatten() {
                let Some(mid) = super::midpoint(space, current[dim], bound) else {
                    continue;
                };
                let mut point = current.clone();
                point[dim] = mid;
                if let Some(candidate) = walker.outcome(&point, best) {
                    if candidate.tokens_per_s > best {
                        best = candidate.tokens_per_s;
                        let old = current[dim];
                        current = point.clone();
                        improvements.push((point, candidate));
                        // Keep bisecting between the new point and the side it left.
                        if Some(bound) == below {
                            above = Some(old);
                        } else {
                            below = Some(old);
                        }
                        improved = true;
                        break;
                    }
                }
                // No gain towards `bound`: halve the interval on that side.
                if Some(bound) == below {
                    below = Some(mid);
                } else {
                    above = Some(mid);
                }
            }
            if !improved
                && below.is_none_or(|b| super::midpoint(space, current[dim], b).is_none())
                && above.is_none_or(|a| super::midpoint(space, current[dim], a).is_none())
            {
                break;
            }
        }
    }
    improvements
}

/// Evaluations the dry walks made, for the sequential walks to take.
#[derive(Default)]
pub(super) struct Ahead {
    /// A point's outcome under the threshold of the walk that evaluated it.
    pub outcomes: HashMap<String, Outcome>,
    /// A bounded point's exact outcome (evaluated without a threshold).
    pub exact: HashMap<String, Outcome>,
}

/// Runs the walks from `starts` dry, side by side on rayon's threads, each from `state`,
/// and gives what they evaluated. Nothing is counted or recorded.
pub(super) fn run_ahead(
    spaces: &[ParamSpace],
    grids: &[Vec<Scalar>],
    starts: &[(Point, Candidate)],
    state: &WalkState,
    evaluation: &Evaluation<'_>,
) -> Ahead {
    let shared = Mutex::new(Ahead::default());
    starts.par_iter().for_each(|(start, candidate)| {
        let mut dry = DryWalker {
            state: state.clone(),
            shared: &shared,
            evaluation,
        };
        bisect(
            spaces,
            grids,
            start.clone(),
            candidate.tokens_per_s,
            &mut dry,
        );
    });
    shared.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// A walk run ahead: its own copy of the state, evaluations shared with the other dry
/// walks (one made by another walk under another threshold decides a step as this walk's
/// own would: [`Walker::outcome`]).
struct DryWalker<'s, 'e> {
    state: WalkState,
    shared: &'s Mutex<Ahead>,
    evaluation: &'s Evaluation<'e>,
}

impl DryWalker<'_, '_> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ahead> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn known(&self, k: &str) -> bool {
        self.state.memo.contains_key(k)
            || self.state.bounded.contains_key(k)
            || self.lock().outcomes.contains_key(k)
    }
}

impl Walker for DryWalker<'_, '_> {
    fn ahead(&mut self, points: Vec<Point>, best: f64) {
        let todo: Vec<(String, Point)> = points
            .into_iter()
            .map(|p| (key(&p), p))
            .filter(|(k, p)| {
                !self.known(k) && !(self.evaluation.dominated)(p, &self.state.too_large)
            })
            .collect();
        if todo.len() < 2 {
            return;
        }
        let evaluation = self.evaluation;
        let outcomes: Vec<Outcome> = todo
            .par_iter()
            .map(|(_, p)| (evaluation.evaluate)(&(evaluation.values_of)(p), best))
            .collect();
        let mut shared = self.lock();
        for ((k, _), outcome) in todo.into_iter().zip(outcomes) {
            shared.outcomes.entry(k).or_insert(outcome);
        }
    }

    fn outcome(&mut self, point: &Point, best: f64) -> Option<Candidate> {
        let k = key(point);
        if let Some(known) = self.state.memo.get(&k) {
            return known.clone();
        }
        let evaluation = self.evaluation;
        let bound = match self.state.bounded.get(&k) {
            Some(&bound) => bound,
            None => {
                if (evaluation.dominated)(point, &self.state.too_large) {
                    self.state.memo.insert(k, None);
                    return None;
                }
                let known = self.lock().outcomes.get(&k).cloned();
                let outcome = known.unwrap_or_else(|| {
                    let outcome = (evaluation.evaluate)(&(evaluation.values_of)(point), best);
                    self.lock()
                        .outcomes
                        .entry(k.clone())
                        .or_insert_with(|| outcome.clone());
                    outcome
                });
                match outcome {
                    Outcome::Below(bound) => {
                        self.state.bounded.insert(k.clone(), bound);
                        bound
                    }
                    other => {
                        if let Outcome::TooLarge(_) = other {
                            self.state.too_large.push(point.clone());
                        }
                        let candidate = match other {
                            Outcome::Fits(candidate) => Some(candidate),
                            _ => None,
                        };
                        self.state.memo.insert(k, candidate.clone());
                        return candidate;
                    }
                }
            }
        };
        if bound <= best {
            return None;
        }
        self.state.bounded.remove(&k);
        let known = self.lock().exact.get(&k).cloned();
        let exact = known.unwrap_or_else(|| {
            let outcome = (evaluation.evaluate)(&(evaluation.values_of)(point), f64::NEG_INFINITY);
            self.lock()
                .exact
                .entry(k.clone())
                .or_insert_with(|| outcome.clone());
            outcome
        });
        let candidate = match exact {
            Outcome::Fits(candidate) => Some(candidate),
            _ => None,
        };
        self.state.memo.insert(k, candidate.clone());
        candidate
    }
}

/// The sequential walks: they count and record what they meet, taking the dry walks'
/// evaluations where those have them.
pub(super) struct CountingWalker<'s, 'e> {
    /// The shared state.
    pub state: &'s mut WalkState,
    /// The counts.
    pub result: &'s mut PlanResult,
    /// Outcomes evaluated ahead, taken when the walk reaches them.
    pub ahead: &'s mut Ahead,
    /// How to evaluate.
    pub evaluation: &'s Evaluation<'e>,
    /// Counts an outcome, giving its candidate when it fits.
    pub record: &'s dyn Fn(Outcome, &mut PlanResult) -> Option<Candidate>,
}

impl Walker for CountingWalker<'_, '_> {
    fn ahead(&mut self, points: Vec<Point>, best: f64) {
        // Both midpoints evaluated ahead, in parallel, and taken when the walk reaches
        // them: the walk, its counts and its answer are the sequential ones.
        let todo: Vec<(String, Point)> = points
            .into_iter()
            .map(|p| (key(&p), p))
            .filter(|(k, p)| {
                !self.state.memo.contains_key(k)
                    && !self.state.bounded.contains_key(k)
                    && !self.ahead.outcomes.contains_key(k)
                    && !(self.evaluation.dominated)(p, &self.state.too_large)
            })
            .collect();
        if todo.len() < 2 {
            return;
        }
        let evaluation = self.evaluation;
        let outcomes: Vec<Outcome> = todo
            .par_iter()
            .map(|(_, p)| (evaluation.evaluate)(&(evaluation.values_of)(p), best))
            .collect();
        for ((k, _), outcome) in todo.into_iter().zip(outcomes) {
            self.ahead.outcomes.insert(k, outcome);
        }
    }

    fn outcome(&mut self, point: &Point, best: f64) -> Option<Candidate> {
        let k = key(point);
        if let Some(known) = self.state.memo.get(&k) {
            return known.clone();
        }
        let evaluation = self.evaluation;
        let bound = match self.state.bounded.get(&k) {
            Some(&bound) => bound,
            None => {
                if (evaluation.dominated)(point, &self.state.too_large) {
                    self.result.skipped_too_large += 1;
                    self.state.memo.insert(k, None);
                    return None;
                }
                let outcome =
                    self.ahead.outcomes.remove(&k).unwrap_or_else(|| {
                        (evaluation.evaluate)(&(evaluation.values_of)(point), best)
                    });
                if let Outcome::TooLarge(_) = outcome {
                    self.state.too_large.push(point.clone());
                }
                // A refused point is invalid where it would have improved on the walk.
                let outcome = settle_refused(outcome, |t| t > best);
                let Outcome::Below(bound) = outcome else {
                    let candidate = (self.record)(outcome, &mut *self.result);
                    self.state.memo.insert(k, candidate.clone());
                    return candidate;
                };
                if bound > best {
                    // Bounded under another walk's best, above this one's, and met here
                    // first: its exact outcome is what this walk counts (a point the full
                    // check refuses is invalid here if it would have improved on it).
                    let exact = self.ahead.exact.remove(&k).unwrap_or_else(|| {
                        (evaluation.evaluate)(&(evaluation.values_of)(point), f64::NEG_INFINITY)
                    });
                    let candidate =
                        (self.record)(settle_refused(exact, |t| t > best), &mut *self.result);
                    self.state.memo.insert(k, candidate.clone());
                    return candidate;
                }
                (self.record)(outcome, &mut *self.result);
                self.state.bounded.insert(k.clone(), bound);
                bound
            }
        };
        if bound <= best {
            return None;
        }
        // Bounded under another walk's best, above this one's: its exact figures, once
        // (it is counted already).
        self.state.bounded.remove(&k);
        let exact = self.ahead.exact.remove(&k).unwrap_or_else(|| {
            (evaluation.evaluate)(&(evaluation.values_of)(point), f64::NEG_INFINITY)
        });
        let candidate = match exact {
            Outcome::Fits(candidate) => Some(candidate),
            _ => None,
        };
        self.state.memo.insert(k, candidate.clone());
        candidate
    }
}
