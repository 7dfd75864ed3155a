//! Compile-time values of the language and the expression evaluator.
//!
//! Takes an AST expression and a name lookup; gives a [`Val`] or a diagnostic. Integer
//! arithmetic is checked (overflow and division by zero are errors, never panics); ints
//! mix with floats by promotion; `&&` of dynamic conditions builds a guard conjunction.

use super::slices::{field_of, method_of};
use crate::diag::Diagnostic;
use crate::ir::catalog::{self, ExpertRef};
use crate::ir::{BufferId, GuardAtom, GuardLit, Layout};
use crate::syntax::ast::{BinOp, Expr, ExprKind, Span, UnOp};

/// A byte range of a buffer with the structure needed for `.page`, `.expert`, fields.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SliceVal {
    /// The buffer.
    pub buffer: BufferId,
    /// First byte.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// How these bytes are organised.
    pub layout: Layout,
    /// Set when the slice is one run-time-chosen expert of the checkpoint.
    pub dynamic_expert: Option<ExpertRef>,
    /// Set for `CACHE.slot(layer, expert)`: the slot holding that expert.
    pub cache_key: Option<crate::ir::cache::CacheKey>,
    /// Set for a slice of `W[layer]` (or of a run-time expert of `layer`): the bytes are
    /// laid out as that layer's own image. `None`: a buffer's bytes, which a layer-shaped
    /// buffer lays out as a slot that holds any layer (`CheckpointLayout::slot_*`).
    pub layer: Option<u32>,
    /// The length of the same slice in a slot that holds it for any layer: `len` for a
    /// buffer's bytes; for `W[i]`'s parts what the part takes in the largest kind of layer
    /// (a dense layer's experts are empty, their slot is not). Buffer shapes and `bytes(..)`
    /// use it, and a copy of `W[i]`'s part fills the first `len` bytes of such a slot.
    pub slot_len: u64,
}

impl SliceVal {
    /// The whole of declared buffer `buffer` (id `id`) laid out as `layout`: a slot
    /// declared for one layer has that layer's geometry.
    pub fn of_buffer(id: BufferId, buffer: &crate::ir::Buffer, layout: Layout) -> SliceVal {
        SliceVal {
            layer: buffer.layer,
            ..SliceVal::whole(id, buffer.bytes, layout)
        }
    }

    /// The whole of buffer `buffer` of `len` bytes.
    pub fn whole(buffer: BufferId, len: u64, layout: Layout) -> SliceVal {
        SliceVal {
            buffer,
            start: 0,
            len,
            layout,
            dynamic_expert: None,
            cache_key: None,
            layer: None,
            slot_len: len,
        }
    }
}

/// The indices of a partly indexed buffer array (`kv[l]` of `kv[l][j]`), inline: every
/// slice of an array element is built through one, per task.
pub type ArrayIndices = smallvec::SmallVec<[u32; 4]>;

/// The evaluated arguments of a call or method (`active(l, e, j)`, `.expert(e)`), inline:
/// unrolling evaluates a few per task.
pub type CallArgs = smallvec::SmallVec<[Val; 4]>;

/// The literals of a [`Val::Cond`]: one or two in every schedule, held inline.
pub type CondLits = smallvec::SmallVec<[GuardLit; 2]>;

/// A value during elaboration.
#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    /// A 64-bit signed integer.
    Int(i64),
    /// A 64-bit float.
    Float(f64),
    /// `true` or `false`.
    Bool(bool),
    /// A string literal (quotes removed).
    Str(String),
    /// Bytes from a size helper, with the layout it implies.
    Bytes(catalog::HelperSize),
    /// `a..b` (exclusive end after normalising `..=`).
    Range(i64, i64),
    /// `[a, b]`.
    List(Vec<Val>),
    /// A run-time expert (`hot(i, r)`).
    Expert(ExpertRef),
    /// A run-time condition: a conjunction of literals (inline: `if active(l, e, j)`
    /// builds one per expert and micro-batch while unrolling).
    Cond(CondLits),
    /// `routed(layer, expert[, ub])`: the tokens routed to an expert, known only at run
    /// time; it can only be compared with a compile-time integer, which gives a `Cond`.
    Routed {
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or the sum over all of them.
        ub: Option<u32>,
    },
    /// `score_max(layer, expert[, ub])` / `score_sum(..)`: the routing weights an expert
    /// received, known only at run time; only a comparison with a compile-time number
    /// uses it (`super::guards`), which gives a `Cond`.
    Score {
        /// Largest or summed.
        kind: crate::ir::ScoreKind,
        /// The layer.
        layer: u32,
        /// The expert.
        expert: ExpertRef,
        /// The micro-batch, or every micro-batch of the step.
        ub: Option<u32>,
    },
    /// Inside an eviction score (`evict score(l, e) = ..`): a constant plus run-time
    /// quantities times constants (`super::evict`).
    Linear {
        /// The compile-time part.
        constant: f64,
        /// Each quantity as written, with its coefficient.
        terms: Vec<(super::evict::Quantity, f64)>,
    },
    /// An array of buffers indexed by some of its dimensions so far.
    Array {
        /// Index of the declaration in the elaborator's table.
        decl: usize,
        /// Indices given so far.
        indices: ArrayIndices,
    },
    /// A buffer slice.
    Slice(SliceVal),
    /// A bare word with no binding: `prefill`, `decode`, `all`.
    Word(&'static str),
}

impl Val {
    /// The type as shown in "expected X, found Y".
    pub fn type_name(&self) -> &'static str {
        match self {
            Val::Int(_) => "an integer",
            Val::Float(_) => "a float",
            Val::Bool(_) => "a boolean",
            Val::Str(_) => "a string",
            Val::Bytes(_) => "a size in bytes",
            Val::Range(..) => "a range",
            Val::List(_) => "a list",
            Val::Expert(_) => "a run-time expert",
            Val::Cond(_) => "a run-time condition",
            Val::Routed { .. } => "a run-time token count",
            Val::Score { .. } => "a run-time routing score",
            Val::Linear { .. } => "a run-time eviction score",
            Val::Array { .. } => "an array of buffers",
            Val::Slice(_) => "a buffer slice",
            Val::Word(_) => "a keyword",
        }
    }
}

/// What the evaluator needs from its context: names, buffer structure, model facts.
pub trait Context {
    /// The value bound to a name, or `None` if unknown (the caller reports it).
    fn lookup(&mut self, name: &str, span: Span) -> Result<Option<Val>, Diagnostic>;
    /// A hardware symbol such as `gpu.mem`.
    fn hardware(&mut self, name: &str, span: Span) -> Result<Option<Val>, Diagnostic>;
    /// Whether a hardware profile gives the symbols (`--hw`).
    fn has_hardware(&self) -> bool;
    /// Names in scope, for suggestions.
    fn names(&self) -> Vec<String>;
    /// Indexes an array value.
    fn index_array(
        &mut self,
        decl: usize,
        indices: ArrayIndices,
        index: i64,
        span: Span,
    ) -> Result<Val, Diagnostic>;
    /// The checkpoint layout.
    fn checkpoint(&self) -> crate::ir::CheckpointLayout;
    /// The model card.
    fn card(&self) -> &crate::model::card::ModelCard;
    /// The routing profile, if one was given.
    fn profile(&self) -> Option<&crate::ir::profile::RoutingProfile>;
    /// `rank(layer, expert)`: [`crate::ir::profile::rank_over_layers`] for this card and
    /// profile (a context may keep the whole table).
    fn rank_over_layers(&mut self, layer: u32, expert: u32) -> u64 {
        let card = self.card();
        let (layers, experts) = (card.layers as u32, card.experts as u32);
        let dense = card.dense_layers.min(card.layers) as u32;
        crate::ir::profile::rank_over_layers(self.profile(), layers, experts, dense, layer, expert)
    }
    /// Whether `buffer` is the checkpoint.
    fn is_checkpoint(&self, buffer: BufferId) -> bool;
    /// Bytes per activation element.
    fn act_bytes(&self) -> u64;
    /// Bytes per KV cache element.
    fn kv_bytes(&self) -> u64;
    /// The index of the expert cache whose buffer is `buffer`, if it is one.
    fn cache_of(&self, buffer: BufferId) -> Option<u32>;
    /// The scratch rules of the backend compiled for (`Options::scratch`).
    fn scratch(&self) -> Option<&'static dyn crate::ir::scratch::DeviceScratch> {
        None
    }
    /// Called when `gpu_scratch` at `span` was the catalog's `bytes` (no rules): the
    /// context warns (once a program).
    fn catalog_scratch(&mut self, _span: Span, _bytes: u64) {}

    /// The buffer holding every MoE expert in `format` (`BufferKind::FormatCopy`), created
    /// on first use, and one expert's bytes in it; an error (in words) when the card's
    /// experts cannot be stored in that format.
    fn format_copy(&mut self, format: crate::model::Storage) -> Result<(BufferId, u64), String>;

    /// Whether an eviction score is being evaluated: arithmetic on the run-time routing
    /// quantities then builds a [`Val::Linear`] instead of being refused.
    fn linear_scores(&self) -> bool {
        false
    }

    /// The most tokens `routed(layer, expert, ub)` (`ub: None`: summed over the
    /// micro-batches) can count in the step being elaborated, where the runtime holds every
    /// micro-batch to it; `None` where nothing bounds it (outside a step, no
    /// `microbatches`). A threshold above it can never be reached
    /// (`guards::routed_comparison`).
    fn routed_ceiling(&self, _ub: Option<u32>) -> Option<u64> {
        None
    }

    /// Called when a comparison was decided from [`Context::routed_ceiling`]: the step's
    /// program then relies on it, and says so for the runtime (`ir::Step::routed_ceiling`).
    fn ceiling_relied_on(&mut self) {}
}

/// Evaluates an expression.
pub fn eval(expr: &Expr, cx: &mut dyn Context) -> Result<Val, Diagnostic> {
    let span = expr.span;
    match &expr.kind {
        ExprKind::Int(v) => Ok(Val::Int(*v)),
        ExprKind::Float(v) => Ok(Val::Float(*v)),
        ExprKind::Bool(v) => Ok(Val::Bool(*v)),
        ExprKind::Str(s) => Ok(Val::Str(s.clone())),
        ExprKind::Name(name) => match cx.lookup(name, span)? {
            Some(v) => Ok(v),
            None => match name.as_str() {
                "prefill" => Ok(Val::Word("prefill")),
                "decode" => Ok(Val::Word("decode")),
                "all" => Ok(Val::Word("all")),
                _ => {
                    let names = cx.names();
                    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                    Err(Diagnostic::unknown_name(span, "name", name, &refs))
                }
            },
        },
        ExprKind::List(items) => Ok(Val::List(
            items
                .iter()
                .map(|e| eval(e, cx))
                .collect::<Result<_, _>>()?,
        )),
        // `hw_or(gpu.mem, 24e9)`: the hardware symbol, or the fallback without a profile
        // (evaluated lazily: the symbol is an error without `--hw`).
        ExprKind::Call(name, args) if name.name == "hw_or" => {
            let [symbol, fallback] = args.as_slice() else {
                return Err(Diagnostic::arity(span, "`hw_or`", 2, args.len()));
            };
            let ExprKind::Field(base, field) = &symbol.kind else {
                return Err(Diagnostic::type_mismatch(
                    symbol.span,
                    "a hardware symbol such as `gpu.mem`",
                    "another expression",
                ));
            };
            let ExprKind::Name(prefix) = &base.kind else {
                return Err(Diagnostic::type_mismatch(
                    symbol.span,
                    "a hardware symbol such as `gpu.mem`",
                    "another expression",
                ));
            };
            if !cx.has_hardware() {
                return eval(fallback, cx);
            }
            // A profile without this symbol (`lat.*` exist only once `moec probe --model`
            // measured them) falls back too.
            match cx.hardware(&format!("{prefix}.{}", field.name), symbol.span) {
                Ok(Some(v)) => Ok(v),
                _ => eval(fallback, cx),
            }
        }
        // `select(c, a, b)` evaluates only the argument it gives, as `&&` short-circuits: a
        // param can then choose a form another card cannot take (`.format(q8_0)` of a card
        // whose rows are not whole blocks) without the other branch being an error.
        ExprKind::Call(name, args) if name.name == "select" && args.len() == 3 => {
            match eval(&args[0], cx)? {
                Val::Bool(c) => eval(&args[if c { 1 } else { 2 }], cx),
                cond => {
                    let values = smallvec::smallvec![cond, Val::Int(0), Val::Int(0)];
                    call(&name.name, name.span, span, args, values, cx)
                }
            }
        }
        ExprKind::Call(name, args) => {
            let values = args
                .iter()
                .map(|e| eval(e, cx))
                .collect::<Result<CallArgs, _>>()?;
            call(&name.name, name.span, span, args, values, cx)
        }
        ExprKind::Unary(op, inner) => {
            let v = eval(inner, cx)?;
            if *op == UnOp::Neg && cx.linear_scores() && super::evict::is_run_time(&v) {
                return super::evict::negate(v, inner.span);
            }
            match (op, v) {
                (UnOp::Neg, Val::Int(i)) => i
                    .checked_neg()
                    .map(Val::Int)
                    .ok_or_else(|| Diagnostic::arithmetic(span, "integer overflow")),
                (UnOp::Neg, Val::Float(f)) => Ok(Val::Float(-f)),
                (UnOp::Not, Val::Bool(b)) => Ok(Val::Bool(!b)),
                (UnOp::Not, Val::Cond(lits)) if lits.len() == 1 => {
                    let lit = lits[0];
                    Ok(Val::Cond(smallvec::smallvec![GuardLit {
                        atom: lit.atom,
                        negated: !lit.negated,
                    }]))
                }
                (UnOp::Not, Val::Cond(_)) => Err(Diagnostic::dynamic_not_allowed(
                    span,
                    "`!` of a conjunction of run-time conditions (only one `active(..)` can be negated)",
                )),
                (UnOp::Neg, v) => Err(Diagnostic::type_mismatch(
                    inner.span,
                    "a number",
                    v.type_name(),
                )),
                (UnOp::Not, v) => Err(Diagnostic::type_mismatch(
                    inner.span,
                    "a boolean",
                    v.type_name(),
                )),
            }
        }
        ExprKind::Binary(op, lhs, rhs) => {
            let a = eval(lhs, cx)?;
            // Short-circuit so `j > 0 && x[j - 1] ...` style guards stay in range.
            match (op, &a) {
                (BinOp::And, Val::Bool(false)) => return Ok(Val::Bool(false)),
                (BinOp::Or, Val::Bool(true)) => return Ok(Val::Bool(true)),
                _ => {}
            }
            let b = eval(rhs, cx)?;
            if cx.linear_scores()
                && (super::evict::is_run_time(&a) || super::evict::is_run_time(&b))
            {
                return super::evict::binary(*op, a, b, lhs.span, rhs.span, span);
            }
            let comparison = matches!(
                op,
                BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge
            );
            if comparison && (matches!(a, Val::Routed { .. }) || matches!(b, Val::Routed { .. })) {
                return super::guards::routed_comparison(*op, a, b, (lhs.span, rhs.span, span), cx);
            }
            binary(*op, a, b, lhs.span, rhs.span, span)
        }
        ExprKind::Index(base, index) => {
            let b = eval(base, cx)?;
            let i = eval(index, cx)?;
            let i = as_int(i, index.span)?;
            match b {
                Val::Array { decl, indices } => cx.index_array(decl, indices, i, index.span),
                Val::Slice(slice) if slice.layout == Layout::Checkpoint => {
                    let layout = cx.checkpoint();
                    let layer = check_index(i, layout.layers, "layer", index.span)?;
                    Ok(Val::Slice(SliceVal {
                        buffer: slice.buffer,
                        start: layout.layer_offset(layer),
                        len: layout.layer_bytes_of(layer),
                        layout: Layout::Layer,
                        dynamic_expert: None,
                        cache_key: None,
                        layer: Some(layer as u32),
                        slot_len: layout.slot_layer_bytes(),
                    }))
                }
                Val::List(items) => {
                    let idx = check_index(i, items.len() as u64, "index", index.span)?;
                    Ok(items[idx as usize].clone())
                }
                other => Err(Diagnostic::type_mismatch(
                    base.span,
                    "an array, `W` or a list",
                    other.type_name(),
                )),
            }
        }
        ExprKind::Field(base, field) => {
            if let ExprKind::Name(name) = &base.kind {
                if cx.lookup(name, base.span)?.is_none() {
                    let full = format!("{name}.{}", field.name);
                    return match cx.hardware(&full, span)? {
                        Some(v) => Ok(v),
                        None => Err(Diagnostic::unknown_name(span, "symbol", &full, &[])),
                    };
                }
            }
            let b = eval(base, cx)?;
            field_of(b, &field.name, field.span, base.span, cx)
        }
        ExprKind::Method(base, method, args) => {
            let b = eval(base, cx)?;
            let values = args
                .iter()
                .map(|e| match &e.kind {
                    // `.format(q4_k)`: a format's name is a word of its own, not a name to
                    // look up (a `let` or param of that name is still taken first).
                    ExprKind::Name(n) if method.name == "format" => match eval(e, cx) {
                        Err(_) => Ok(Val::Str(n.clone())),
                        found => found,
                    },
                    _ => eval(e, cx),
                })
                .collect::<Result<CallArgs, _>>()?;
            method_of(
                b,
                &method.name,
                method.span,
                base.span,
                span,
                args,
                values,
                cx,
            )
        }
    }
}

/// Accepts ints and helper sizes as integers.
pub fn coerce_int(v: Val, span: Span) -> Result<Val, Diagnostic> {
    match v {
        Val::Int(i) => Ok(Val::Int(i)),
        Val::Bytes(size) => i64::try_from(size.bytes)
            .map(Val::Int)
            .map_err(|_| Diagnostic::arithmetic(span, "size does not fit in 64 bits")),
        other => Err(Diagnostic::type_mismatch(
            span,
            "an integer",
            other.type_name(),
        )),
    }
}

/// The value as an i64, or a type error.
#[inline]
pub fn as_int(v: Val, span: Span) -> Result<i64, Diagnostic> {
    // Unrolling asks this of every index and loop bound: an int needs no coercion.
    if let Val::Int(i) = v {
        return Ok(i);
    }
    match coerce_int(v, span)? {
        Val::Int(i) => Ok(i),
        _ => Err(Diagnostic::type_mismatch(
            span,
            "an integer",
            "something else",
        )),
    }
}

/// Checks `0 <= i < limit`.
pub fn check_index(i: i64, limit: u64, what: &str, span: Span) -> Result<u64, Diagnostic> {
    if i < 0 || i as u64 >= limit {
        Err(Diagnostic::out_of_range(
            span,
            what,
            i,
            &format!("0..{limit}"),
        ))
    } else {
        Ok(i as u64)
    }
}

fn as_f64(v: &Val) -> Option<f64> {
    match v {
        Val::Int(i) => Some(*i as f64),
        Val::Float(f) => Some(*f),
        Val::Bytes(b) => Some(b.bytes as f64),
        _ => None,
    }
}

fn is_intlike(v: &Val) -> bool {
    matches!(v, Val::Int(_) | Val::Bytes(_))
}

fn binary(
    op: BinOp,
    a: Val,
    b: Val,
    a_span: Span,
    b_span: Span,
    span: Span,
) -> Result<Val, Diagnostic> {
    use BinOp::*;
    match op {
        RangeExclusive | RangeInclusive => {
            let lo = as_int(a, a_span)?;
            let hi = as_int(b, b_span)?;
            let hi = if op == RangeInclusive {
                hi.checked_add(1)
                    .ok_or_else(|| Diagnostic::arithmetic(span, "integer overflow"))?
            } else {
                hi
            };
            Ok(Val::Range(lo, hi.max(lo)))
        }
        And | Or => match (a, b) {
            (Val::Bool(x), Val::Bool(y)) => Ok(Val::Bool(if op == And { x && y } else { x || y })),
            (Val::Cond(mut x), Val::Cond(y)) if op == And => {
                x.extend(y);
                x.sort();
                x.dedup();
                Ok(Val::Cond(x))
            }
            (Val::Cond(x), Val::Bool(true)) | (Val::Bool(true), Val::Cond(x)) if op == And => {
                Ok(Val::Cond(x))
            }
            (Val::Cond(_), Val::Bool(false)) if op == And => Ok(Val::Bool(false)),
            (Val::Cond(x), Val::Bool(false)) | (Val::Bool(false), Val::Cond(x)) if op == Or => {
                Ok(Val::Cond(x))
            }
            (Val::Cond(_), Val::Bool(true)) if op == Or => Ok(Val::Bool(true)),
            (Val::Cond(_), _) | (_, Val::Cond(_)) => Err(Diagnostic::dynamic_not_allowed(
                span,
                "`||` of run-time conditions (only `&&` conjunctions can guard tasks)",
            )),
            (Val::Bool(_), other) => Err(Diagnostic::type_mismatch(
                b_span,
                "a boolean",
                other.type_name(),
            )),
            (other, _) => Err(Diagnostic::type_mismatch(
                a_span,
                "a boolean",
                other.type_name(),
            )),
        },
        Eq | Ne | Lt | Le | Gt | Ge
            if matches!(a, Val::Score { .. }) || matches!(b, Val::Score { .. }) =>
        {
            super::guards::score_comparison(op, a, b, a_span, b_span, span)
        }
        Eq | Ne | Lt | Le | Gt | Ge => {
            let ordering = match (&a, &b) {
                (Val::Bool(x), Val::Bool(y)) if matches!(op, Eq | Ne) => Some(x.cmp(y)),
                (x, y) if is_intlike(x) && is_intlike(y) => {
                    let (Ok(x), Ok(y)) = (as_int(x.clone(), a_span), as_int(y.clone(), b_span))
                    else {
                        return Err(Diagnostic::arithmetic(
                            span,
                            "comparison of sizes too large",
                        ));
                    };
                    Some(x.cmp(&y))
                }
                (x, y) => match (as_f64(x), as_f64(y)) {
                    (Some(x), Some(y)) => x.partial_cmp(&y),
                    _ => {
                        let (bad, bad_span) = if as_f64(&a).is_none() {
                            (&a, a_span)
                        } else {
                            (&b, b_span)
                        };
                        if matches!(bad, Val::Expert(_)) {
                            return Err(Diagnostic::dynamic_not_allowed(
                                bad_span,
                                "comparing run-time experts",
                            ));
                        }
                        return Err(Diagnostic::type_mismatch(
                            bad_span,
                            "a number",
                            bad.type_name(),
                        ));
                    }
                },
            };
            let Some(ordering) = ordering else {
                return Ok(Val::Bool(false));
            };
            use std::cmp::Ordering::*;
            Ok(Val::Bool(match op {
                Eq => ordering == Equal,
                Ne => ordering != Equal,
                Lt => ordering == Less,
                Le => ordering != Greater,
                Gt => ordering == Greater,
                _ => ordering != Less,
            }))
        }
        Add | Sub | Mul | Div | Rem => {
            if matches!(a, Val::Routed { .. }) || matches!(b, Val::Routed { .. }) {
                let at = if matches!(a, Val::Routed { .. }) {
                    a_span
                } else {
                    b_span
                };
                return Err(Diagnostic::dynamic_not_allowed(
                    at,
                    "arithmetic on a routed token count (compare `routed(..)` with a constant instead)",
                ));
            }
            if is_intlike(&a) && is_intlike(&b) {
                let x = as_int(a, a_span)?;
                let y = as_int(b, b_span)?;
                let overflow = || Diagnostic::arithmetic(span, "integer overflow");
                let result = match op {
                    Add => x.checked_add(y).ok_or_else(overflow)?,
                    Sub => x.checked_sub(y).ok_or_else(overflow)?,
                    Mul => x.checked_mul(y).ok_or_else(overflow)?,
                    Div | Rem if y == 0 => {
                        return Err(Diagnostic::arithmetic(b_span, "division by zero"))
                    }
                    Div => x.checked_div(y).ok_or_else(overflow)?,
                    _ => x.checked_rem_euclid(y).ok_or_else(overflow)?,
                };
                return Ok(Val::Int(result));
            }
            match (as_f64(&a), as_f64(&b)) {
                (Some(x), Some(y)) => {
                    let r = match op {
                        Add => x + y,
                        Sub => x - y,
                        Mul => x * y,
                        Div => x / y,
                        _ => x.rem_euclid(y),
                    };
                    if r.is_finite() {
                        Ok(Val::Float(r))
                    } else {
                        Err(Diagnostic::arithmetic(
                            span,
                            "the result is not a finite number",
                        ))
                    }
                }
                (None, _) => Err(Diagnostic::type_mismatch(a_span, "a number", a.type_name())),
                (_, None) => Err(Diagnostic::type_mismatch(b_span, "a number", b.type_name())),
            }
        }
    }
}

fn float_to_int(f: f64, span: Span) -> Result<Val, Diagnostic> {
    if f.is_finite() && f.abs() < 9.0e18 {
        Ok(Val::Int(f as i64))
    } else {
        Err(Diagnostic::arithmetic(
            span,
            "the value does not fit in an integer",
        ))
    }
}

/// Built-in functions.
fn call(
    name: &str,
    name_span: Span,
    span: Span,
    args: &[Expr],
    values: CallArgs,
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    let arg_span = |i: usize| args.get(i).map(|a| a.span).unwrap_or(span);
    let arity = |n: usize| {
        if values.len() == n {
            Ok(())
        } else {
            Err(Diagnostic::arity(
                span,
                &format!("`{name}`"),
                n,
                values.len(),
            ))
        }
    };
    match name {
        "min" | "max" => {
            if values.len() < 2 {
                return Err(Diagnostic::arity(
                    span,
                    &format!("`{name}`"),
                    2,
                    values.len(),
                ));
            }
            let all_int = values.iter().all(is_intlike);
            let mut best: Option<Val> = None;
            for (i, v) in values.into_iter().enumerate() {
                let v = if all_int {
                    Val::Int(as_int(v, arg_span(i))?)
                } else {
                    v
                };
                let x = as_f64(&v).ok_or_else(|| {
                    Diagnostic::type_mismatch(arg_span(i), "a number", v.type_name())
                })?;
                let better = match &best {
                    None => true,
                    Some(b) => {
                        let y = as_f64(b).unwrap_or(0.0);
                        if name == "min" {
                            x < y
                        } else {
                            x > y
                        }
                    }
                };
                if better {
                    best = Some(if all_int { v } else { Val::Float(x) });
                }
            }
            best.ok_or_else(|| Diagnostic::arity(span, &format!("`{name}`"), 2, 0))
        }
        "ceil" | "floor" => {
            arity(1)?;
            match &values[0] {
                Val::Int(i) => Ok(Val::Int(*i)),
                Val::Float(f) => {
                    float_to_int(if name == "ceil" { f.ceil() } else { f.floor() }, span)
                }
                other => Err(Diagnostic::type_mismatch(
                    arg_span(0),
                    "a number",
                    other.type_name(),
                )),
            }
        }
        "hot" => {
            arity(2)?;
            // Two counts, not a clone of the card: a schedule ranks every expert of every
            // layer in every step.
            let (card_layers, card_experts) = (cx.card().layers, cx.card().experts);
            let layer = check_index(
                as_int(values[0].clone(), arg_span(0))?,
                card_layers,
                "layer",
                arg_span(0),
            )?;
            let rank = check_index(
                as_int(values[1].clone(), arg_span(1))?,
                card_experts,
                "expert rank",
                arg_span(1),
            )?;
            Ok(Val::Expert(ExpertRef::Hot {
                layer: layer as u32,
                rank: rank as u32,
            }))
        }
        "active" => {
            if !(2..=3).contains(&values.len()) {
                return Err(Diagnostic::arity(span, "`active`", 2, values.len()));
            }
            let (layer, expert, ub) = expert_scope(&values, &arg_span, cx.card())?;
            // No token is ever routed to an expert of a dense layer.
            if cx.card().is_dense_layer(u64::from(layer)) {
                return Ok(Val::Bool(false));
            }
            Ok(Val::Cond(smallvec::smallvec![GuardLit {
                atom: GuardAtom::Active { layer, expert, ub },
                negated: false,
            }]))
        }
        // `select(c, a, b)`: a when the compile-time boolean c holds, else b.
        "select" => {
            arity(3)?;
            match &values[0] {
                Val::Bool(c) => Ok(values[if *c { 1 } else { 2 }].clone()),
                Val::Cond(_) => Err(Diagnostic::dynamic_not_allowed(
                    arg_span(0),
                    "the condition of `select`",
                )),
                other => Err(Diagnostic::type_mismatch(
                    arg_span(0),
                    "a boolean",
                    other.type_name(),
                )),
            }
        }
        "rank" | "rank_in_layer" => {
            arity(2)?;
            // Two counts, not a clone of the card: a schedule ranks every expert of every
            // layer in every step.
            let (card_layers, card_experts) = (cx.card().layers, cx.card().experts);
            let layer = check_index(
                as_int(values[0].clone(), arg_span(0))?,
                card_layers,
                "layer",
                arg_span(0),
            )? as u32;
            let expert = match &values[1] {
                Val::Expert(_) => {
                    return Err(Diagnostic::dynamic_not_allowed(
                        arg_span(1),
                        "the expert of a compile-time ranking",
                    ))
                }
                other => check_index(
                    as_int(other.clone(), arg_span(1))?,
                    card_experts,
                    "expert",
                    arg_span(1),
                )? as u32,
            };
            let experts = card_experts as u32;
            let rank = if name == "rank" {
                cx.rank_over_layers(layer, expert)
            } else {
                crate::ir::profile::rank_in_layer(cx.profile(), experts, layer, expert)
            };
            Ok(Val::Int(rank as i64))
        }
        "routed" => {
            if !(2..=3).contains(&values.len()) {
                return Err(Diagnostic::arity(span, "`routed`", 2, values.len()));
            }
            let (layer, expert, ub) = expert_scope(&values, &arg_span, cx.card())?;
            // A dense layer routes no token: its counts are 0 at compile time.
            if cx.card().is_dense_layer(u64::from(layer)) {
                return Ok(Val::Int(0));
            }
            Ok(Val::Routed { layer, expert, ub })
        }
        "score_max" | "score_sum" => {
            if !(2..=3).contains(&values.len()) {
                return Err(Diagnostic::arity(
                    span,
                    &format!("`{name}`"),
                    2,
                    values.len(),
                ));
            }
            let (layer, expert, ub) = expert_scope(&values, &arg_span, cx.card())?;
            Ok(super::guards::score(name, layer, expert, ub, cx))
        }
        "bytes" => {
            arity(1)?;
            match &values[0] {
                // A slot's size: what the part takes for any layer.
                Val::Slice(slice) => {
                    Ok(Val::Int(i64::try_from(slice.slot_len).unwrap_or(i64::MAX)))
                }
                Val::Bytes(size) => Ok(Val::Int(i64::try_from(size.bytes).unwrap_or(i64::MAX))),
                other => Err(Diagnostic::type_mismatch(
                    arg_span(0),
                    "a buffer slice",
                    other.type_name(),
                )),
            }
        }
        _ => {
            let mut ints = Vec::with_capacity(values.len());
            for (i, v) in values.iter().enumerate() {
                let n = as_int(v.clone(), arg_span(i))?;
                if n < 0 {
                    return Err(Diagnostic::out_of_range(
                        arg_span(i),
                        "size argument",
                        n,
                        "0 or more",
                    ));
                }
                ints.push(n as u64);
            }
            // `dense_weights(l)` names a layer of the model.
            if let (Some(&l), "dense_weights") = (ints.first(), name) {
                let layers = cx.card().layers;
                if l >= layers {
                    return Err(Diagnostic::out_of_range(
                        arg_span(0),
                        "layer",
                        i64::try_from(l).unwrap_or(i64::MAX),
                        &format!("0..{layers}, the model's layers"),
                    ));
                }
            }
            let scratch = cx.scratch();
            match catalog::size_helper(
                name,
                &ints,
                cx.card(),
                cx.act_bytes(),
                cx.kv_bytes(),
                scratch,
            ) {
                Some(Ok(size)) => {
                    if name == "gpu_scratch" && scratch.is_none() {
                        cx.catalog_scratch(span, size.bytes);
                    }
                    Ok(Val::Bytes(size))
                }
                Some(Err(expected)) => Err(Diagnostic::arity(
                    span,
                    &format!("`{name}`"),
                    expected,
                    values.len(),
                )),
                None => {
                    let mut known: Vec<&str> = super::vocabulary::FUNCTIONS.to_vec();
                    known.extend(catalog::SIZE_HELPERS);
                    Err(Diagnostic::unknown_name(
                        name_span, "function", name, &known,
                    ))
                }
            }
        }
    }
}

/// The `(layer, expert[, ub])` arguments of `active` and `routed`.
fn expert_scope(
    values: &[Val],
    arg_span: &dyn Fn(usize) -> Span,
    card: &crate::model::card::ModelCard,
) -> Result<(u32, ExpertRef, Option<u32>), Diagnostic> {
    let layer = check_index(
        as_int(values[0].clone(), arg_span(0))?,
        card.layers,
        "layer",
        arg_span(0),
    )?;
    let expert = match &values[1] {
        Val::Expert(e) => *e,
        other => {
            let e = as_int(other.clone(), arg_span(1))?;
            ExpertRef::Index(check_index(e, card.experts, "expert", arg_span(1))? as u32)
        }
    };
    let ub = match values.get(2) {
        Some(v) => Some(u32::try_from(as_int(v.clone(), arg_span(2))?.max(0)).unwrap_or(u32::MAX)),
        None => None,
    };
    Ok((layer as u32, expert, ub))
}

/// The conjunction of a guard comparison's literals, each a literal or its truth value
/// when decided at compile time (`None`: a literal that says nothing): `false` if one is
/// false, `true` if none is left, else the sorted literals.
pub(super) fn conjunction(lits: Vec<Result<Option<GuardLit>, bool>>) -> Val {
    let mut out = CondLits::new();
    for lit in lits {
        match lit {
            Err(false) => return Val::Bool(false),
            Err(true) => {}
            Ok(lit) => out.extend(lit),
        }
    }
    if out.is_empty() {
        return Val::Bool(true);
    }
    out.sort();
    out.dedup();
    Val::Cond(out)
}
