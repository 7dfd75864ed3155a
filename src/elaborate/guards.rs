//! The run-time guards that are not token counts: a cache's residency
//! (`CACHE.resident(layer, expert)`) and the routing weights an expert received
//! (`score_max(layer, expert[, ub])`, `score_sum(..)`) compared with a compile-time number.
//!
//! Takes evaluated arguments; gives a [`Val::Cond`] (a conjunction of guard literals), or
//! a compile-time boolean where the answer is known (a dense layer routes nothing and
//! caches none of its experts; a score is never negative). `value.rs` and `slices.rs` call
//! in here so these words live in one place.

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
    Ok(Val::Cond(vec![GuardLit {
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
