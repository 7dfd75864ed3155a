//! A cache's schedule-computed eviction score: `evict score(l, e) = EXPR`.
//!
//! Takes the declaration's names and expression; gives an [`EvictScore`], the expression
//! evaluated for every (layer, expert) of the card with `l` and `e` bound. The run-time
//! quantities it may read are the ranked expert's routing over the whole step
//! (`score_max(l, e)`, `score_sum(l, e)`, `routed(l, e)`); everything else is known at
//! compile time (params, `rank`, `rank_in_layer`, symbols, arithmetic). The score must be
//! linear in the quantities (a constant times each, plus a constant), so evaluation folds
//! every compile-time part into four numbers per expert and the runtime's eviction is a
//! dot product. The checker needs nothing from the score: it proves slot contents for
//! every choice of victim among slots nobody holds.

use super::value::Val;
use super::Elaborator;
use crate::diag::Diagnostic;
use crate::ir::cache::{EvictScore, ScoreQuantity, ScoreTerms};
use crate::ir::catalog::ExpertRef;
use crate::ir::ScoreKind;
use crate::syntax::ast::{BinOp, Expr, Ident, Span};
use std::borrow::Cow;

/// A run-time quantity of one expert inside an eviction score, as written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantity {
    /// Which quantity.
    pub kind: ScoreQuantity,
    /// Its layer.
    pub layer: u32,
    /// Its expert.
    pub expert: ExpertRef,
    /// The micro-batch, if one was named (refused: a score reads the whole step).
    pub ub: Option<u32>,
}

impl Quantity {
    fn text(&self) -> String {
        let name = match self.kind {
            ScoreQuantity::Max => "score_max",
            ScoreQuantity::Sum => "score_sum",
            ScoreQuantity::Routed => "routed",
        };
        match self.ub {
            Some(ub) => format!("{name}({}, {}, {ub})", self.layer, self.expert),
            None => format!("{name}({}, {})", self.layer, self.expert),
        }
    }
}

/// Whether `v` depends on the run-time quantities (inside an eviction score).
pub(super) fn is_run_time(v: &Val) -> bool {
    matches!(
        v,
        Val::Score { .. } | Val::Routed { .. } | Val::Linear { .. }
    )
}

/// `v` as `constant + sum(coefficient * quantity)`, or `None` if it is not a number.
fn linear(v: Val) -> Option<(f64, Vec<(Quantity, f64)>)> {
    match v {
        Val::Int(i) => Some((i as f64, Vec::new())),
        Val::Float(f) => Some((f, Vec::new())),
        Val::Bytes(b) => Some((b.bytes as f64, Vec::new())),
        Val::Score {
            kind,
            layer,
            expert,
            ub,
        } => {
            let kind = match kind {
                ScoreKind::Max => ScoreQuantity::Max,
                ScoreKind::Sum => ScoreQuantity::Sum,
            };
            Some((
                0.0,
                vec![(
                    Quantity {
                        kind,
                        layer,
                        expert,
                        ub,
                    },
                    1.0,
                )],
            ))
        }
        Val::Routed { layer, expert, ub } => Some((
            0.0,
            vec![(
                Quantity {
                    kind: ScoreQuantity::Routed,
                    layer,
                    expert,
                    ub,
                },
                1.0,
            )],
        )),
        Val::Linear { constant, terms } => Some((constant, terms)),
        _ => None,
    }
}

fn scaled(c: f64, terms: Vec<(Quantity, f64)>, k: f64) -> Val {
    Val::Linear {
        constant: c * k,
        terms: terms.into_iter().map(|(q, x)| (q, x * k)).collect(),
    }
}

/// `-v` of a run-time value inside an eviction score.
pub(super) fn negate(v: Val, span: Span) -> Result<Val, Diagnostic> {
    match linear(v) {
        Some((c, terms)) => Ok(scaled(c, terms, -1.0)),
        None => Err(Diagnostic::type_mismatch(
            span,
            "a number",
            "something else",
        )),
    }
}

/// `a OP b` inside an eviction score where one side is run-time: sums, differences, and
/// products and quotients by a compile-time number keep it linear; anything else is
/// refused at the operator.
pub(super) fn binary(
    op: BinOp,
    a: Val,
    b: Val,
    a_span: Span,
    b_span: Span,
    span: Span,
) -> Result<Val, Diagnostic> {
    use BinOp::*;
    let a_name = a.type_name();
    let b_name = b.type_name();
    let (Some((ca, ta)), Some((cb, tb))) = (linear(a), linear(b)) else {
        let (at, name) = if matches!(a_name, "an integer" | "a float" | "a size in bytes")
            || a_name.starts_with("a run-time")
        {
            (b_span, b_name)
        } else {
            (a_span, a_name)
        };
        return Err(Diagnostic::type_mismatch(at, "a number", name));
    };
    match op {
        Add | Sub => {
            let sign = if op == Add { 1.0 } else { -1.0 };
            let mut terms = ta;
            terms.extend(tb.into_iter().map(|(q, x)| (q, sign * x)));
            Ok(Val::Linear {
                constant: ca + sign * cb,
                terms,
            })
        }
        Mul if ta.is_empty() => Ok(scaled(cb, tb, ca)),
        Mul if tb.is_empty() => Ok(scaled(ca, ta, cb)),
        Div if tb.is_empty() && cb != 0.0 => Ok(scaled(ca, ta, 1.0 / cb)),
        Div if tb.is_empty() => Err(Diagnostic::arithmetic(b_span, "division by zero")),
        Mul | Div => Err(Diagnostic::eviction_score(
            span,
            "must be linear in the run-time quantities",
            "a product or quotient of two run-time quantities",
        )),
        _ => Err(Diagnostic::eviction_score(
            span,
            "is a number, not a condition",
            "a comparison, `%` or logic on a run-time quantity",
        )),
    }
}

impl Elaborator<'_> {
    /// Evaluates `evict score(l, e) = EXPR` for every (layer, expert) of the card.
    pub(super) fn eviction_score(
        &mut self,
        layer: &Ident,
        expert: &Ident,
        score: &Expr,
    ) -> Result<EvictScore, Diagnostic> {
        if layer.name == expert.name {
            return Err(Diagnostic::type_mismatch(
                expert.span,
                "a second name (for the expert)",
                "the layer's name again",
            ));
        }
        let (layers, experts) = (self.card.layers as u32, self.card.experts as u32);
        let mut terms = Vec::with_capacity(layers as usize * experts as usize);
        for l in 0..layers {
            for e in 0..experts {
                self.scopes.push();
                self.scopes
                    .bind(Cow::Owned(layer.name.clone()), Val::Int(i64::from(l)));
                self.scopes
                    .bind(Cow::Owned(expert.name.clone()), Val::Int(i64::from(e)));
                self.linear_scores = true;
                let value = self.eval(score);
                self.linear_scores = false;
                self.scopes.pop();
                terms.push(fold(value?, l, e, score.span)?);
            }
        }
        Ok(EvictScore { experts, terms })
    }
}

/// One expert's value as [`ScoreTerms`]: every quantity must be the ranked expert's over
/// the whole step, and every number finite.
fn fold(value: Val, layer: u32, expert: u32, span: Span) -> Result<ScoreTerms, Diagnostic> {
    let name = value.type_name();
    let Some((constant, quantities)) = linear(value) else {
        return Err(Diagnostic::type_mismatch(
            span,
            "a number (the score)",
            name,
        ));
    };
    let mut out = ScoreTerms {
        constant,
        per_quantity: [0.0; 3],
    };
    for (q, x) in quantities {
        if q.layer != layer || q.expert != ExpertRef::Index(expert) || q.ub.is_some() {
            return Err(Diagnostic::eviction_score(
                span,
                "reads only the routing of the expert it ranks, over the whole step",
                &format!(
                    "for expert {expert} of layer {layer} this reads `{}`",
                    q.text()
                ),
            ));
        }
        let k = ScoreQuantity::ALL
            .iter()
            .position(|&k| k == q.kind)
            .unwrap_or(0);
        out.per_quantity[k] += x;
    }
    if !out.constant.is_finite() || out.per_quantity.iter().any(|x| !x.is_finite()) {
        return Err(Diagnostic::arithmetic(
            span,
            &format!(
                "the eviction score of expert {expert} of layer {layer} is not a finite number"
            ),
        ));
    }
    Ok(out)
}
