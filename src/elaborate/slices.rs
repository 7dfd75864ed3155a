//! Fields and methods of buffer slices: `.pre .o .gate .attn .post .dense .experts .embed
//! .head`, `.expert(e)`, `.experts(a, b)`, `.page(p, n)`, `.share(a, b)`.
//!
//! Takes a slice value and the field or method; gives the sub-slice (bytes of the packed
//! weights layout the buffer holds, from the model's checkpoint layout) or a diagnostic at
//! the field or argument.

use super::value::{as_int, check_index, Context, SliceVal, Val};
use crate::diag::Diagnostic;
use crate::ir::Layout;
use crate::syntax::ast::{Expr, Span};

/// Where the parts of a layer-shaped slice are: layer `l`'s own image for a slice of
/// `W[l]`, else a slot that holds any layer (the largest `gate`, experts where a MoE
/// layer's are).
struct Geometry {
    pre: u64,
    o: u64,
    gate: u64,
    experts_start: u64,
    experts: u64,
    total: u64,
}

fn geometry(layout: &crate::ir::CheckpointLayout, layer: Option<u32>) -> Geometry {
    let (pre, o) = (layout.pre_bytes, layout.o_bytes);
    match layer.map(u64::from) {
        Some(l) => Geometry {
            pre,
            o,
            gate: layout.gate_bytes_of(l),
            experts_start: layout.dense_bytes_of(l),
            experts: layout.experts_of(l),
            total: layout.layer_bytes_of(l),
        },
        None => Geometry {
            pre,
            o,
            gate: layout.slot_gate_bytes(),
            experts_start: layout.slot_experts_offset(),
            experts: layout.experts,
            total: layout.slot_layer_bytes(),
        },
    }
}

/// True when `s` is a slice of a dense layer of `W`: its experts are empty.
fn of_dense_layer(s: &SliceVal, layout: &crate::ir::CheckpointLayout) -> bool {
    s.layer.is_some_and(|l| layout.is_dense(u64::from(l)))
}

/// Where the expert slots of a slice start and how many indices it takes: a layer's
/// experts follow its dense part; an expert-slot buffer is all slots. A dense layer of
/// `W` takes every expert index and holds none of them (see [`of_dense_layer`]).
fn expert_region(
    s: &SliceVal,
    layout: &crate::ir::CheckpointLayout,
    method_span: Span,
    method: &str,
) -> Result<(u64, u64), Diagnostic> {
    match s.layout {
        Layout::Layer => {
            let g = geometry(layout, s.layer);
            Ok((g.experts_start, layout.experts))
        }
        Layout::Experts { slots } => Ok((0, u64::from(slots))),
        _ => {
            let call = if method == "expert" {
                "`.expert(e)`"
            } else {
                "`.experts(a, b)`"
            };
            Err(Diagnostic::type_mismatch(
                method_span,
                &format!("{call} on a layer or an expert-slot buffer"),
                &format!("`.{method}` on unstructured bytes"),
            ))
        }
    }
}

/// The part `[start, start + len)` of `s`, `slot_len` bytes long in a slot.
fn sub_slice(s: SliceVal, start: u64, len: u64, slot_len: u64, layout: Layout) -> Val {
    Val::Slice(SliceVal {
        buffer: s.buffer,
        start: s.start + start,
        len,
        layout,
        dynamic_expert: None,
        cache_key: None,
        layer: s.layer,
        slot_len,
    })
}

/// `CACHE.slot(layer, expert)` (the slot holding that expert) and `CACHE.predicted(layer,
/// rank)` (the expert the cache's predictor ranks there): the only ways to name a cache's
/// bytes, since which slot holds what is decided at run time.
#[allow(clippy::too_many_arguments)]
fn cache_method(
    cache: u32,
    s: SliceVal,
    method: &str,
    method_span: Span,
    span: Span,
    args: &[Expr],
    values: super::value::CallArgs,
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    let arg_span = |i: usize| args.get(i).map(|a| a.span).unwrap_or(span);
    if method == "resident" {
        return super::guards::resident(cache, span, args, values, cx);
    }
    let card = cx.card().clone();
    if method != "slot" && method != "predicted" {
        return Err(Diagnostic::unknown_name(
            method_span,
            "method of an expert cache",
            method,
            &super::vocabulary::CACHE_METHODS,
        ));
    }
    if values.len() != 2 {
        return Err(Diagnostic::arity(
            span,
            &format!("`{method}`"),
            2,
            values.len(),
        ));
    }
    let layer = check_index(
        as_int(values[0].clone(), arg_span(0))?,
        card.layers,
        "layer",
        arg_span(0),
    )? as u32;
    if method == "predicted" {
        let rank = check_index(
            as_int(values[1].clone(), arg_span(1))?,
            card.experts,
            "rank",
            arg_span(1),
        )? as u32;
        return Ok(Val::Expert(crate::ir::ExpertRef::Predicted {
            cache,
            layer,
            rank,
        }));
    }
    let expert = match &values[1] {
        Val::Expert(e) => *e,
        other => crate::ir::ExpertRef::Index(check_index(
            as_int(other.clone(), arg_span(1))?,
            card.experts,
            "expert",
            arg_span(1),
        )? as u32),
    };
    if let crate::ir::ExpertRef::Hot { layer: l, .. }
    | crate::ir::ExpertRef::Predicted { layer: l, .. } = expert
    {
        if l != layer {
            return Err(Diagnostic::type_mismatch(
                arg_span(1),
                &format!("an expert of layer {layer}"),
                &format!("an expert ranked in layer {l}"),
            ));
        }
    }
    Ok(Val::Slice(SliceVal {
        buffer: s.buffer,
        start: s.start,
        len: cx.checkpoint().expert_bytes,
        layout: Layout::Experts { slots: 1 },
        dynamic_expert: None,
        cache_key: Some(crate::ir::cache::CacheKey {
            cache,
            layer,
            expert,
        }),
        layer: None,
        slot_len: cx.checkpoint().expert_bytes,
    }))
}

pub(super) fn field_of(
    base: Val,
    field: &str,
    field_span: Span,
    base_span: Span,
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    let Val::Slice(s) = base else {
        return Err(Diagnostic::type_mismatch(
            base_span,
            "a buffer slice",
            base.type_name(),
        ));
    };
    let layout = cx.checkpoint();
    let fields: &[&str] = match s.layout {
        Layout::Checkpoint => &["embed", "head"],
        Layout::Layer => &["pre", "o", "gate", "attn", "post", "dense", "experts"],
        Layout::Dense => &["pre", "o", "gate", "attn"],
        _ => &[],
    };
    // A part's size in a slot: for `W[l]`'s parts, a slot for any layer; a slot declared
    // for one layer (`dense_weights(l)`) is that layer's own size.
    let of_checkpoint = s.buffer.index() == 0;
    let (g, slot) = (
        geometry(&layout, s.layer),
        geometry(&layout, if of_checkpoint { None } else { s.layer }),
    );
    let (pre, o) = (g.pre, g.o);
    let experts = g.experts * layout.expert_bytes;
    let slot_experts = layout.experts * layout.expert_bytes;
    // A dense layer's experts are empty; the slot keeps every expert's room.
    let all_experts = Layout::Experts {
        slots: layout.experts as u32,
    };
    match (s.layout, field) {
        (Layout::Checkpoint, "embed") => Ok(sub_slice(
            s,
            0,
            layout.embed_bytes,
            layout.embed_bytes,
            Layout::Raw,
        )),
        (Layout::Checkpoint, "head") => Ok(sub_slice(
            s,
            layout.head_offset(),
            layout.head_bytes,
            layout.head_bytes,
            Layout::Raw,
        )),
        (Layout::Layer | Layout::Dense, "pre") => Ok(sub_slice(s, 0, pre, pre, Layout::Raw)),
        (Layout::Layer | Layout::Dense, "o") => Ok(sub_slice(s, pre, o, o, Layout::Raw)),
        (Layout::Layer | Layout::Dense, "gate") => {
            Ok(sub_slice(s, pre + o, g.gate, slot.gate, Layout::Raw))
        }
        (Layout::Layer | Layout::Dense, "attn") => {
            Ok(sub_slice(s, 0, pre + o, pre + o, Layout::Raw))
        }
        (Layout::Layer, "post") => Ok(sub_slice(
            s,
            pre,
            g.total - pre,
            slot.total - pre,
            Layout::Raw,
        )),
        (Layout::Layer, "dense") => Ok(sub_slice(
            s,
            0,
            pre + o + g.gate,
            layout.slot_dense_bytes(),
            Layout::Dense,
        )),
        (Layout::Layer, "experts") => Ok(sub_slice(
            s,
            g.experts_start,
            experts,
            slot_experts,
            all_experts,
        )),
        _ if fields.is_empty() => Err(Diagnostic::type_mismatch(
            field_span,
            "a field of a structured slice (`W`, a layer, its dense part)",
            "a field of unstructured bytes",
        )),
        _ => Err(Diagnostic::unknown_name(field_span, "field", field, fields)),
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn method_of(
    base: Val,
    method: &str,
    method_span: Span,
    base_span: Span,
    span: Span,
    args: &[Expr],
    values: super::value::CallArgs,
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    let Val::Slice(s) = base else {
        return Err(Diagnostic::type_mismatch(
            base_span,
            "a buffer slice",
            base.type_name(),
        ));
    };
    let arg_span = |i: usize| args.get(i).map(|a| a.span).unwrap_or(span);
    // A name that is no method at all is reported as such first: "must be known at compile
    // time" would send the user looking for a dynamic value that is not the problem.
    // The cache itself takes the cache's methods; a slot of it (`ec.slot(l, e)`) is a slice.
    let cache = cx.cache_of(s.buffer).filter(|_| s.cache_key.is_none());
    let known: &[&str] = if cache.is_some() {
        &super::vocabulary::CACHE_METHODS
    } else {
        &super::vocabulary::SLICE_METHODS
    };
    if !known.contains(&method) {
        let what = if cache.is_some() {
            "method of an expert cache"
        } else {
            "method"
        };
        return Err(Diagnostic::unknown_name(method_span, what, method, known));
    }
    if s.dynamic_expert.is_some() || s.cache_key.is_some() {
        return Err(Diagnostic::dynamic_not_allowed(
            base_span,
            "a slice inside a run-time expert",
        ));
    }
    if let Some(cache) = cx.cache_of(s.buffer) {
        return cache_method(cache, s, method, method_span, span, args, values, cx);
    }
    match method {
        "page" => {
            if values.len() != 2 {
                return Err(Diagnostic::arity(span, "`page`", 2, values.len()));
            }
            let n = as_int(values[1].clone(), arg_span(1))?;
            if n <= 0 {
                return Err(Diagnostic::out_of_range(
                    arg_span(1),
                    "page count",
                    n,
                    "1 or more",
                ));
            }
            let k = check_index(
                as_int(values[0].clone(), arg_span(0))?,
                n as u64,
                "page",
                arg_span(0),
            )?;
            let n = n as u64;
            let page_of = |len: u64| {
                let page = len.div_ceil(n);
                ((k * page).min(len), ((k + 1) * page).min(len))
            };
            let (start, end) = page_of(s.len);
            let (slot_start, slot_end) = page_of(s.slot_len);
            Ok(sub_slice(
                s,
                start,
                end - start,
                slot_end - slot_start,
                Layout::Raw,
            ))
        }
        "expert" => {
            if values.len() != 1 {
                return Err(Diagnostic::arity(span, "`expert`", 1, values.len()));
            }
            let layout = cx.checkpoint();
            let (base, slots) = expert_region(&s, &layout, method_span, "expert")?;
            let eb = layout.expert_bytes;
            let one = Layout::Experts { slots: 1 };
            // A run-time expert names its layer: an expert of a dense layer holds nothing.
            let ref_layer = match &values[0] {
                Val::Expert(crate::ir::ExpertRef::Hot { layer, .. })
                | Val::Expert(crate::ir::ExpertRef::Predicted { layer, .. }) => Some(*layer),
                _ => None,
            };
            if let Some(l) = ref_layer.filter(|&l| layout.is_dense(u64::from(l))) {
                let mut empty = s;
                empty.layer = Some(l);
                return Ok(sub_slice(empty, base, 0, eb, one));
            }
            if of_dense_layer(&s, &layout) {
                if !matches!(values[0], Val::Expert(_)) {
                    check_index(
                        as_int(values[0].clone(), arg_span(0))?,
                        slots,
                        "expert",
                        arg_span(0),
                    )?;
                }
                return Ok(sub_slice(s, base, 0, eb, one));
            }
            match &values[0] {
                Val::Expert(e) => {
                    if s.layout != Layout::Layer {
                        return Err(Diagnostic::dynamic_not_allowed(
                            arg_span(0),
                            "the expert slot of a buffer that is not a whole layer (`W[i]` or `layer_weights()`)",
                        ));
                    }
                    Ok(Val::Slice(SliceVal {
                        buffer: s.buffer,
                        start: s.start + base,
                        len: eb,
                        layout: one,
                        dynamic_expert: Some(*e),
                        cache_key: None,
                        layer: s.layer,
                        slot_len: eb,
                    }))
                }
                other => {
                    let e = check_index(
                        as_int(other.clone(), arg_span(0))?,
                        slots,
                        "expert",
                        arg_span(0),
                    )?;
                    Ok(sub_slice(s, base + e * eb, eb, eb, one))
                }
            }
        }
        "share" => {
            if values.len() != 2 {
                return Err(Diagnostic::arity(span, "`share`", 2, values.len()));
            }
            let mut bounds = [0u64; 2];
            let mut slot_bounds = [0u64; 2];
            for (k, v) in values.iter().enumerate() {
                let f = match v {
                    Val::Int(i) => *i as f64,
                    Val::Float(f) => *f,
                    other => {
                        return Err(Diagnostic::type_mismatch(
                            arg_span(k),
                            "a fraction in 0..=1",
                            other.type_name(),
                        ))
                    }
                };
                if !(0.0..=1.0).contains(&f) {
                    return Err(Diagnostic::out_of_range(
                        arg_span(k),
                        "share bound (x1000)",
                        (f * 1000.0) as i64,
                        "0..=1000",
                    ));
                }
                bounds[k] = (f * s.len as f64).floor() as u64;
                slot_bounds[k] = (f * s.slot_len as f64).floor() as u64;
            }
            let (lo, hi) = (bounds[0], bounds[1].max(bounds[0]));
            let slot = slot_bounds[1].max(slot_bounds[0]) - slot_bounds[0];
            Ok(sub_slice(s, lo, hi - lo, slot, Layout::Raw))
        }
        "experts" => {
            if values.len() != 2 {
                return Err(Diagnostic::arity(span, "`experts`", 2, values.len()));
            }
            let layout = cx.checkpoint();
            let (base, slots) = expert_region(&s, &layout, method_span, "experts")?;
            let lo = as_int(values[0].clone(), arg_span(0))?;
            let hi = as_int(values[1].clone(), arg_span(1))?;
            if lo < 0 || hi < lo || hi as u64 > slots {
                return Err(Diagnostic::out_of_range(
                    arg_span(1),
                    "expert range end",
                    hi,
                    &format!("{}..={slots}", lo.max(0)),
                ));
            }
            let (lo, hi) = (lo as u64, hi as u64);
            let slots_taken = Layout::Experts {
                slots: (hi - lo) as u32,
            };
            let eb = layout.expert_bytes;
            // A dense layer's experts are empty, at the end of its image.
            let len = if of_dense_layer(&s, &layout) {
                0
            } else {
                (hi - lo) * eb
            };
            let start = if len == 0 { base } else { base + lo * eb };
            Ok(sub_slice(s, start, len, (hi - lo) * eb, slots_taken))
        }
        "format" => format_of(s, method_span, span, args, values, cx),
        // Resolved by `copy` itself (`stmts::kv_part_of`): the positions follow the run.
        "context" | "appended" => Err(Diagnostic::type_mismatch(
            method_span,
            "a side of a `copy` (a KV cache's positions are only known at run time)",
            &format!("`.{method}()` inside an expression or an op argument"),
        )),
        _ => Err(Diagnostic::unknown_name(
            method_span,
            "method",
            method,
            &super::vocabulary::SLICE_METHODS,
        )),
    }
}

/// `W[l].expert(e).format(q4_k)`: expert `e` of layer `l` in another format than the
/// checkpoint's, a slice of the format copy `W.q4_k` (made from the checkpoint at load) that
/// is the format's size. In the checkpoint's own format it is the checkpoint's expert.
/// Computing with a copy in another format needs a `substitute` declaration (the checker's).
fn format_of(
    s: SliceVal,
    method_span: Span,
    span: Span,
    args: &[Expr],
    values: super::value::CallArgs,
    cx: &mut dyn Context,
) -> Result<Val, Diagnostic> {
    use crate::model::formats::WeightTensor;
    use crate::model::segment::SegmentKind;
    let arg_span = args.first().map(|a| a.span).unwrap_or(span);
    if values.len() != 1 {
        return Err(Diagnostic::arity(span, "`format`", 1, values.len()));
    }
    let name = match &values[0] {
        Val::Str(name) => name.clone(),
        other => {
            return Err(Diagnostic::type_mismatch(
                arg_span,
                "a weight format (`q4_k`, `q8_0`, `q6_k`, ...)",
                other.type_name(),
            ))
        }
    };
    let format = crate::model::Storage::parse(&name)
        .map_err(|e| Diagnostic::bad_weight_format(arg_span, &e))?;
    let layout = cx.checkpoint();
    let one_expert = cx.is_checkpoint(s.buffer)
        && s.layout == Layout::Experts { slots: 1 }
        && s.len == layout.expert_bytes
        && s.layer.is_some_and(|l| !layout.is_dense(u64::from(l)));
    let Some(layer) = s.layer.filter(|_| one_expert) else {
        return Err(Diagnostic::type_mismatch(
            method_span,
            "`.format(..)` on one expert of a MoE layer of the checkpoint (`W[l].expert(e)`)",
            "`.format(..)` on another slice",
        ));
    };
    let own = cx
        .card()
        .storage(WeightTensor::layer(SegmentKind::ExpertDown(0)));
    if own == format {
        return Ok(Val::Slice(s));
    }
    let (buffer, expert_bytes) = cx.format_copy(format).map_err(|e| {
        let card = &cx.card().name;
        Diagnostic::bad_weight_format(
            arg_span,
            &format!("the experts of {card} cannot be stored in {name}: {e}"),
        )
    })?;
    let experts_start =
        layout.layer_offset(u64::from(layer)) + layout.dense_bytes_of(u64::from(layer));
    let expert = (s.start - experts_start) / layout.expert_bytes.max(1);
    let slot = (u64::from(layer) - layout.dense_layers) * layout.experts + expert;
    Ok(Val::Slice(SliceVal {
        buffer,
        start: slot * expert_bytes,
        len: expert_bytes,
        layout: Layout::Experts { slots: 1 },
        dynamic_expert: None,
        cache_key: None,
        layer: None,
        slot_len: expert_bytes,
    }))
}
