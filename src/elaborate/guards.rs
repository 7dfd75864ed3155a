//! The run-time guards: a routed token count (`routed(layer, expert[, ub])`), a cache's
//! residency (`CACHE.resident(layer, expert)`) and the routing weights an expert received
//! (`score_max(layer, expert[, ub])`, `score_sum(..)`), compared with a compile-time number.
//!
//! Takes evaluated arguments; gives a [`Val::Cond`] (a conjunction of guard literals), or
//! a compile-time boolean where the answer is known (a dense layer routes nothing and
//! caches none of its experts; a score is never negative; a micro-batch never holds more
//! tokens than its step's ceiling). `value.rs` and `slices.rs` call in here so these words
//! live in one place.

use super::value::{as_int, check_index, conjunction, Context, Val};
use crate::diag::Diagnostic;
use crate::ir::catalog::ExpertRef;
use crate::ir::{GuardAtom, GuardLit, ScoreKind};
use crate::syntax::ast::{BinOp, Expr, Span};

/// `CACHE.resident(layer, expert)`: a literal true when the cache holds that expert at the
/// time the guard is decided.
pub(super) fn resident(
    cache: u32,
    span: Span,
    args: &[Expr],
    values: super::value::CallArgs,
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    let arg_span = |i: usize| args.get(i).map(|a| a.span).unwrap_or(span);
    if values.len() != 2 {
        return Err(Diagnostic::arity(span, "`resident`", 2, values.len()));
    }
    let (card_layers, card_experts) = (cx.card().layers, cx.card().experts);
    let layer = check_index(
        as_int(values[0].clone(), arg_span(0))?,
        card_layers,
        "layer",
        arg_span(0),
    )? as u32;
    let expert = match &values[1] {
        Val::Expert(ExpertRef::Predicted { .. }) => {
            return Err(Diagnostic::dynamic_not_allowed(
                arg_span(1),
                "a predicted expert in a guard (predictions decide what is copied ahead, never what runs)",
            ))
        }
        Val::Expert(e) => *e,
        other => ExpertRef::Index(check_index(
            as_int(other.clone(), arg_span(1))?,
            card_experts,
            "expert",
            arg_span(1),
        )? as u32),
    };
    if let ExpertRef::Hot { layer: l, .. } = expert {
        if l != layer {
            return Err(Diagnostic::type_mismatch(
                arg_span(1),
                &format!("an expert of layer {layer}"),
                &format!("an expert ranked in layer {l}"),
            ));
        }
    }
    // A dense layer has no experts to cache.
    if cx.card().is_dense_layer(u64::from(layer)) {
        return Ok(Val::Bool(false));
    }
    Ok(Val::Cond(smallvec::smallvec![GuardLit {
        atom: GuardAtom::Resident {
            cache,
            layer,
            expert,
        },
        negated: false,
    }]))
}

/// `score_max(..)` / `score_sum(..)` of `(layer, expert[, ub])`; 0 at compile time for a
/// dense layer (no token routes to it).
pub(super) fn score(
    name: &str,
    layer: u32,
    expert: ExpertRef,
    ub: Option<u32>,
    cx: &mut dyn Context,
) -> Val {
    if cx.card().is_dense_layer(u64::from(layer)) {
        return Val::Float(0.0);
    }
    let kind = if name == "score_sum" {
        ScoreKind::Sum
    } else {
        ScoreKind::Max
    };
    Val::Score {
        kind,
        layer,
        expert,
        ub,
    }
}

/// The least `f32` at least `t` (`strict`: greater than `t`), for a non-negative `t`:
/// routing weights are `f32`, so `w >= t` is `w >= least_f32(t)` exactly.
fn least_f32(t: f64, strict: bool) -> u32 {
    let f = t as f32;
    let below = if strict {
        f64::from(f) <= t
    } else {
        f64::from(f) < t
    };
    // For a non-negative finite f32 the next one up is the next bit pattern.
    if below {
        f.to_bits().saturating_add(1)
    } else {
        f.to_bits()
    }
}

/// `routed(..) OP n` (or `n OP routed(..)`) as a run-time condition over atoms
/// `routed >= t`: `>= n` is the atom at n, `> n` at n + 1, `< n` and `<= n` their negations,
/// `== n` the conjunction of `>= n` and `< n + 1`. A threshold of 1 is `active(..)` and one
/// of 0 or less always holds, so equal conditions get equal guards. `!=` would be a
/// disjunction, which guards cannot express. `spans`: the left operand's, the right
/// operand's and the whole comparison's.
///
/// A threshold above the step's ceiling ([`Context::routed_ceiling`]) never holds: the
/// count is of tokens in a micro-batch (or in all of them) routed to one expert, each token
/// routes to an expert at most once (top-k picks k distinct experts), and the runtime never
/// gives a micro-batch more tokens than the ceiling (decode: one per sequence, at most the
/// micro-batch's sequences; prefill and mixed: the step records the ceiling it relied on
/// and the runtime caps each micro-batch's tokens at it). So `routed >= t` is `false` and
/// `routed < t` is `true` there, at compile time: an `if` on it keeps only the arm that
/// can run, and the other arm's tasks are never built. The cost model gives such an arm
/// an expected activation of exactly 0 at the same count (`binomial_between` clips at the
/// step's tokens), so the predicted step is unchanged. `active` (t = 1) is never decided
/// this way.
pub(super) fn routed_comparison(
    op: BinOp,
    a: Val,
    b: Val,
    spans: (Span, Span, Span),
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    use BinOp::*;
    let (a_span, b_span, span) = spans;
    let (count, n, n_span, op) = match (a, b) {
        (Val::Routed { layer, expert, ub }, other) => ((layer, expert, ub), other, b_span, op),
        (other, Val::Routed { layer, expert, ub }) => {
            // `n < routed` is `routed > n`.
            let flipped = match op {
                Lt => Gt,
                Le => Ge,
                Gt => Lt,
                Ge => Le,
                other => other,
            };
            ((layer, expert, ub), other, a_span, flipped)
        }
        _ => {
            return Err(Diagnostic::arithmetic(
                span,
                "comparison without a token count",
            ))
        }
    };
    let n = match n {
        Val::Routed { .. } => {
            return Err(Diagnostic::dynamic_not_allowed(
                n_span,
                "comparing two routed token counts (one side must be a constant)",
            ))
        }
        Val::Float(f) if f.fract() != 0.0 => {
            return Err(Diagnostic::type_mismatch(
                n_span,
                "an integer",
                "a float with a fraction",
            ))
        }
        other => as_int(other, n_span)?,
    };
    let (layer, expert, ub) = count;
    let ceiling = cx.routed_ceiling(ub);
    let mut relied = false;
    // "routed >= t" as a literal, with its truth value when it is decided statically.
    let mut at_least = |t: i64, negated: bool| -> Result<Option<GuardLit>, bool> {
        if t <= 0 {
            return Err(!negated); // always true, so its negation always false
        }
        if t >= 2 && ceiling.is_some_and(|c| u64::try_from(t).is_ok_and(|t| t > c)) {
            relied = true;
            return Err(negated); // never true (see above), so its negation always
        }
        let atom = if t == 1 {
            GuardAtom::Active { layer, expert, ub }
        } else {
            GuardAtom::Tokens {
                layer,
                expert,
                ub,
                at_least: u32::try_from(t).unwrap_or(u32::MAX),
            }
        };
        Ok(Some(GuardLit { atom, negated }))
    };
    let lits = match op {
        Ge => vec![at_least(n, false)],
        Gt => vec![at_least(n.saturating_add(1), false)],
        Lt => vec![at_least(n, true)],
        Le => vec![at_least(n.saturating_add(1), true)],
        Eq => vec![at_least(n, false), at_least(n.saturating_add(1), true)],
        _ => {
            return Err(Diagnostic::dynamic_not_allowed(
                span,
                "`!=` of a routed token count (it is a disjunction; write the two arms with `<` and `>`)",
            ))
        }
    };
    if relied {
        cx.ceiling_relied_on();
    }
    Ok(conjunction(lits))
}

/// `score(..) OP t` (or `t OP score(..)`) as a run-time condition over atoms
/// `score >= t`: `>=` is the atom, `>` the atom at the next `f32` up, `<` and `<=` their
/// negations, `==` both bounds. A score is never negative, so `>= t` with `t <= 0` always
/// holds (and `> t` with `t < 0`). `!=` would be a disjunction, which guards cannot
/// express.
pub(super) fn score_comparison(
    op: BinOp,
    a: Val,
    b: Val,
    a_span: Span,
    b_span: Span,
    span: Span,
) -> Result<Val, Diagnostic> {
    use BinOp::*;
    let (score, n, n_span, op) = match (a, b) {
        (
            Val::Score {
                kind,
                layer,
                expert,
                ub,
            },
            other,
        ) => ((kind, layer, expert, ub), other, b_span, op),
        (
            other,
            Val::Score {
                kind,
                layer,
                expert,
                ub,
            },
        ) => {
            // `t < score` is `score > t`.
            let flipped = match op {
                Lt => Gt,
                Le => Ge,
                Gt => Lt,
                Ge => Le,
                other => other,
            };
            ((kind, layer, expert, ub), other, a_span, flipped)
        }
        _ => return Err(Diagnostic::arithmetic(span, "comparison without a score")),
    };
    let t = match n {
        Val::Int(i) => i as f64,
        Val::Float(f) if f.is_finite() => f,
        Val::Score { .. } => {
            return Err(Diagnostic::dynamic_not_allowed(
                n_span,
                "comparing two routing scores (one side must be a constant)",
            ))
        }
        other => {
            return Err(Diagnostic::type_mismatch(
                n_span,
                "a number",
                other.type_name(),
            ))
        }
    };
    let (kind, layer, expert, ub) = score;
    // "score >= least f32 (above) t" as a literal, or its truth value when always true.
    let at_least = |strict: bool, negated: bool| -> Result<GuardLit, bool> {
        if t < 0.0 || (t == 0.0 && !strict) {
            return Err(!negated);
        }
        Ok(GuardLit {
            atom: GuardAtom::Score {
                kind,
                layer,
                expert,
                ub,
                at_least_bits: least_f32(t, strict),
            },
            negated,
        })
    };
    let lits = match op {
        Ge => vec![at_least(false, false)],
        Gt => vec![at_least(true, false)],
        Lt => vec![at_least(false, true)],
        Le => vec![at_least(true, true)],
        Eq => vec![at_least(false, false), at_least(true, true)],
        _ => return Err(Diagnostic::dynamic_not_allowed(
            span,
            "`!=` of a routing score (it is a disjunction; write the two arms with `<` and `>`)",
        )),
    };
    Ok(conjunction(lits.into_iter().map(|l| l.map(Some)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_are_the_least_f32_on_the_right_side() {
        // 0.3 is not an f32: `>= 0.3` starts at the first f32 above it.
        let ge = f32::from_bits(least_f32(0.3, false));
        assert!(f64::from(ge) >= 0.3);
        assert!(f64::from(f32::from_bits(least_f32(0.3, false) - 1)) < 0.3);
        // 0.5 is one: `>= 0.5` is at it, `> 0.5` one ulp up.
        assert_eq!(f32::from_bits(least_f32(0.5, false)), 0.5);
        assert_eq!(least_f32(0.5, true), 0.5f32.to_bits() + 1);
        // `> 0` is the smallest positive weight.
        assert_eq!(least_f32(0.0, true), 1);
    }
}
