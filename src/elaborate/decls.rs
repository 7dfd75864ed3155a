//! Top-level declarations: params (with `--set`), streams, buffers, micro-batches, templates.
//!
//! Takes declaration nodes in textual order; fills the elaborator's tables, reporting
//! duplicates, unknown engines and spaces, bad sizes, and param values out of range.

use super::value::{as_int, Val};
use super::{ArrayDecl, Elaborator, MAX_BUFFERS};
use crate::diag::Diagnostic;
use crate::ir::{
    self, Buffer, BufferId, BufferKind, Engine, Layout, ParamRange, Scalar, Space, Stream, StreamId,
};
use crate::syntax::ast::{
    BinOp, BufferDecl, CacheDecl, Evict, ExprKind, MicroBatchDecl, ParamDecl, ParamType, Span,
    StreamDecl, SubstituteDecl, TemplateDecl,
};
use std::borrow::Cow;

/// At most this many slots in one expert cache (more than any model's experts).
const MAX_CACHE_SLOTS: u32 = 1 << 20;

impl<'a> Elaborator<'a> {
    fn is_declared(&self, name: &str) -> Option<Span> {
        if let Some(&i) = self.param_index.get(name) {
            return Some(self.param_spans[i]);
        }
        if let Some(&i) = self.array_index.get(name) {
            return Some(self.arrays[i].span);
        }
        if let Some(&s) = self.stream_index.get(name) {
            return Some(self.stream_spans[s.index()]);
        }
        None
    }

    fn scalar(&self, v: Val, ty: ParamType, span: Span) -> Result<Scalar, Diagnostic> {
        match (ty, v) {
            (ParamType::Int, v @ (Val::Int(_) | Val::Bytes(_))) => {
                Ok(Scalar::Int(as_int(v, span)?))
            }
            (ParamType::Float, Val::Float(f)) => Ok(Scalar::Float(f)),
            (ParamType::Float, Val::Int(i)) => Ok(Scalar::Float(i as f64)),
            (ParamType::Bool, Val::Bool(b)) => Ok(Scalar::Bool(b)),
            (ty, v) => Err(Diagnostic::type_mismatch(
                span,
                &format!("{} `{}`", article(ty), ty.as_str()),
                v.type_name(),
            )),
        }
    }

    pub(super) fn declare_param(&mut self, decl: &ParamDecl) {
        let name = &decl.name.name;
        if let Some(first) = self.is_declared(name) {
            self.report(Diagnostic::duplicate_name(
                decl.name.span,
                first,
                "param",
                name,
            ));
            return;
        }
        let default = match self
            .eval(&decl.default)
            .and_then(|v| self.scalar(v, decl.ty, decl.default.span))
        {
            Ok(v) => v,
            Err(d) => return self.report(d),
        };
        let range = match &decl.range {
            None => None,
            Some(expr) => match &expr.kind {
                ExprKind::Binary(op @ (BinOp::RangeExclusive | BinOp::RangeInclusive), lo, hi)
                    if decl.ty != ParamType::Bool =>
                {
                    let lo_v = self.eval(lo).and_then(|v| self.scalar(v, decl.ty, lo.span));
                    let hi_v = self.eval(hi).and_then(|v| self.scalar(v, decl.ty, hi.span));
                    match (lo_v, hi_v) {
                        (Ok(lo), Ok(hi)) => Some(ParamRange {
                            lo,
                            hi,
                            inclusive: *op == BinOp::RangeInclusive,
                        }),
                        (Err(d), _) | (_, Err(d)) => return self.report(d),
                    }
                }
                _ => {
                    return self.report(Diagnostic::type_mismatch(
                        expr.span,
                        "a range `lo..=hi` of numbers",
                        "something else",
                    ))
                }
            },
        };
        let mut value = default;
        let mut from_set = false;
        if let Some((_, text)) = self.options.sets.iter().rev().find(|(n, _)| n == name) {
            from_set = true;
            match parse_scalar(text, decl.ty) {
                Some(v) => value = v,
                // Reported; the param keeps its default so the rest of the schedule
                // elaborates without a cascade of "unknown name" errors.
                None => self.report(Diagnostic::param_bad_value(
                    decl.span,
                    name,
                    decl.ty.as_str(),
                    text,
                )),
            }
        }
        if let Some(range) = &range {
            if !in_range(value, range) {
                let range_text = format!(
                    "{}{}{}",
                    range.lo,
                    if range.inclusive { "..=" } else { ".." },
                    range.hi
                );
                self.report(Diagnostic::param_out_of_range(
                    decl.span,
                    name,
                    &value.to_string(),
                    &range_text,
                    from_set,
                ));
                // As above: bind the default (still an error, no cascade).
                value = default;
            }
        }
        self.param_index.insert(name.clone(), self.params.len());
        self.params.push(ir::Param {
            name: name.clone(),
            ty: decl.ty,
            value,
            default,
            range,
            doc: decl.doc.clone(),
        });
        self.param_spans.push(decl.span);
        self.param_used.push(false);
    }

    pub(super) fn check_unknown_sets(&mut self) {
        let declared: Vec<String> = self.params.iter().map(|p| p.name.clone()).collect();
        let refs: Vec<&str> = declared.iter().map(String::as_str).collect();
        let sets = self.options.sets.clone();
        for (name, _) in &sets {
            if self.param_index.contains_key(name) {
                continue;
            }
            // Declared but rejected (bad value): already reported at the declaration.
            if self
                .diags
                .iter()
                .any(|d| d.message.starts_with(&format!("param `{name}`")))
            {
                continue;
            }
            self.report(Diagnostic::unknown_param(name, &refs));
        }
    }

    pub(super) fn declare_stream(&mut self, decl: &StreamDecl) {
        let name = &decl.name.name;
        if let Some(first) = self.is_declared(name) {
            return self.report(Diagnostic::duplicate_name(
                decl.name.span,
                first,
                "stream",
                name,
            ));
        }
        let Some(engine) = Engine::parse(&decl.engine.name) else {
            let known: Vec<&str> = Engine::ALL.iter().map(|e| e.as_str()).collect();
            return self.report(Diagnostic::bad_engine(
                decl.engine.span,
                &decl.engine.name,
                "engine",
                &known,
            ));
        };
        if engine == Engine::DiskRead {
            // A schedule that reads the disk keeps its checkpoint there: `W` is read into
            // host buffers on this stream instead of being mapped into host memory whole.
            if let Some(checkpoint) = self.buffers.first_mut() {
                checkpoint.space = Space::Disk;
            }
        }
        self.stream_index
            .insert(name.clone(), StreamId::new(self.streams.len()));
        self.streams.push(Stream {
            name: name.clone(),
            engine,
        });
        self.stream_spans.push(decl.span);
    }

    pub(super) fn declare_buffer(&mut self, decl: &BufferDecl) {
        let name = &decl.name.name;
        if self.redeclared(&decl.name, "buffer") {
            return;
        }
        let Some(space) = self.space_of(&decl.space) else {
            return;
        };
        let mut dims = Vec::new();
        let mut count: u64 = 1;
        for dim in &decl.dims {
            let n = match self.eval(dim).and_then(|v| as_int(v, dim.span)) {
                Ok(n) => n,
                Err(d) => return self.report(d),
            };
            // Zero is allowed: an optional buffer (`w_res[layers * min(n_res, 1)]`).
            if n < 0 || n > i64::from(u32::MAX) {
                return self.report(Diagnostic::out_of_range(
                    dim.span,
                    "array length",
                    n,
                    "0 or more",
                ));
            }
            count = count.saturating_mul(n as u64);
            dims.push(n as u32);
        }
        if count.saturating_add(self.buffers.len() as u64) > MAX_BUFFERS {
            return self.report(Diagnostic::too_many_tasks(decl.span, MAX_BUFFERS as usize));
        }
        let indexed = decl.index_names.iter().any(Option::is_some);
        // Without index names the size is one value for every element.
        let shared = if indexed {
            None
        } else {
            match self.buffer_size(decl) {
                Some(size) => Some(size),
                None => return,
            }
        };
        let first = BufferId::new(self.buffers.len());
        let mut array_layout: Option<Layout> = None;
        for flat in 0..count {
            let mut index = Vec::with_capacity(dims.len());
            let mut rest = flat;
            for &d in dims.iter().rev() {
                index.push((rest % u64::from(d)) as u32);
                rest /= u64::from(d);
            }
            index.reverse();
            let element_name = format!(
                "{name}{}",
                index.iter().map(|i| format!("[{i}]")).collect::<String>()
            );
            let (bytes, layout, layer) = match shared {
                Some(size) => size,
                None => {
                    // `[n as i]`: this element's indices bound for its own size.
                    self.scopes.push();
                    for (n, &i) in decl.index_names.iter().zip(&index) {
                        if let Some(n) = n {
                            self.scopes
                                .bind(Cow::Owned(n.name.clone()), Val::Int(i64::from(i)));
                        }
                    }
                    let size = self.buffer_size(decl);
                    self.scopes.pop();
                    let Some(size) = size else { return };
                    size
                }
            };
            if let Some(first_layout) = array_layout {
                if first_layout != layout {
                    return self.report(Diagnostic::type_mismatch(
                        decl.size.span,
                        "one layout for every element of an array (sizes may differ, kinds may not)",
                        &format!("{element_name} laid out otherwise than the first element"),
                    ));
                }
            }
            array_layout = Some(layout);
            self.buffers.push(Buffer {
                name: element_name,
                array: name.clone(),
                index,
                space,
                bytes,
                layout,
                kind: BufferKind::Declared,
                layer,
            });
            self.buffer_spans.push(decl.span);
        }
        let layout = match (array_layout, shared) {
            (Some(layout), _) | (None, Some((_, layout, _))) => layout,
            // An empty array with named indices: nothing was sized.
            (None, None) => Layout::Raw,
        };
        self.array_index.insert(name.clone(), self.arrays.len());
        self.arrays.push(ArrayDecl {
            name: name.clone(),
            dims,
            first,
            layout,
            span: decl.span,
        });
    }

    /// The size of a buffer declaration's element (its index names bound, if any): bytes,
    /// layout and the layer a slot is declared for; `None` after reporting why not.
    fn buffer_size(&mut self, decl: &BufferDecl) -> Option<(u64, Layout, Option<u32>)> {
        let size = match self.eval(&decl.size) {
            Ok(Val::Bytes(size)) => (size.bytes, size.layout, size.layer),
            Ok(Val::Int(n)) if n >= 0 => (n as u64, Layout::Raw, None),
            // A buffer shaped like a weight slice: `= W[0].experts(0, n_res)`, a slot for
            // that part of any layer (also when layer 0 is dense and has no experts).
            Ok(Val::Slice(slice)) if slice.dynamic_expert.is_none() => {
                let layout = match slice.layout {
                    Layout::Checkpoint => Layout::Raw,
                    Layout::Experts { .. } => Layout::Experts {
                        slots: u32::try_from(slice.slot_len / self.checkpoint.expert_bytes.max(1))
                            .unwrap_or(u32::MAX),
                    },
                    other => other,
                };
                (slice.slot_len, layout, None)
            }
            Ok(Val::Int(n)) => {
                self.report(Diagnostic::out_of_range(
                    decl.size.span,
                    "buffer size",
                    n,
                    "0 or more bytes",
                ));
                return None;
            }
            Ok(v) => {
                self.report(Diagnostic::type_mismatch(
                    decl.size.span,
                    "a size in bytes",
                    v.type_name(),
                ));
                return None;
            }
            Err(d) => {
                self.report(d);
                return None;
            }
        };
        Some(size)
    }

    /// Reports `name` if something of that name exists already; true then.
    fn redeclared(&mut self, name: &crate::syntax::ast::Ident, kind: &str) -> bool {
        let Some(first) = self.is_declared(&name.name) else {
            return false;
        };
        self.report(Diagnostic::duplicate_name(
            name.span, first, kind, &name.name,
        ));
        true
    }

    /// The memory space a declaration names, or `None` after reporting an unknown one.
    fn space_of(&mut self, space: &crate::syntax::ast::Ident) -> Option<Space> {
        let parsed = Space::parse(&space.name);
        if parsed == Some(Space::Disk) {
            self.report(Diagnostic::disk_buffer(space.span));
            return None;
        }
        if parsed.is_none() {
            let known: Vec<&str> = Space::ALL.iter().map(|s| s.as_str()).collect();
            self.report(Diagnostic::bad_engine(
                space.span,
                &space.name,
                "memory space",
                &known,
            ));
        }
        parsed
    }

    /// `cache NAME[SLOTS]: SPACE evict POLICY [predict PREDICTOR]`: one buffer of SLOTS
    /// expert slots (it counts against its space's budget like any buffer) and the cache's
    /// policy and predictor, named by strings so a param can choose them (`select`).
    pub(super) fn declare_cache(&mut self, decl: &CacheDecl) {
        let name = &decl.name.name;
        if self.redeclared(&decl.name, "cache") {
            return;
        }
        let Some(space) = self.space_of(&decl.space) else {
            return;
        };
        let slots = match self
            .eval(&decl.slots)
            .and_then(|v| as_int(v, decl.slots.span))
        {
            Ok(n) if (1..=i64::from(MAX_CACHE_SLOTS)).contains(&n) => n as u32,
            Ok(n) => {
                return self.report(Diagnostic::out_of_range(
                    decl.slots.span,
                    "cache slots",
                    n,
                    &format!("1 to {MAX_CACHE_SLOTS}"),
                ))
            }
            Err(d) => return self.report(d),
        };
        let (policy, score) = match &decl.evict {
            // `score` is a policy with an expression, not a name.
            Evict::Named(e) if matches!(&e.kind, ExprKind::Str(s) if s == "score") => {
                return self.report(Diagnostic::type_mismatch(
                    e.span,
                    "an eviction policy name (\"lru\", \"lfu\", \"activation\") or `score(l, e) = EXPR`",
                    "\"score\" without its expression",
                ));
            }
            Evict::Named(e) => match self.name_choice(
                e,
                "eviction policy",
                &ir::cache::EvictPolicy::ALL.map(|p| p.as_str()),
            ) {
                Ok(p) => (ir::cache::EvictPolicy::parse(&p), None),
                Err(d) => return self.report(d),
            },
            Evict::Score {
                layer,
                expert,
                score,
            } => match self.eviction_score(layer, expert, score) {
                Ok(s) => (Some(ir::cache::EvictPolicy::Score), Some(s)),
                Err(d) => {
                    // The error fails the compile; the cache is still declared so its uses
                    // are not reported again as unknown names.
                    self.report(d);
                    (Some(ir::cache::EvictPolicy::Score), None)
                }
            },
        };
        let predictor = match &decl.predict {
            None => Some(ir::cache::Predictor::Cooccurrence),
            Some(e) => match self.name_choice(
                e,
                "predictor",
                &ir::cache::Predictor::ALL.map(|p| p.as_str()),
            ) {
                Ok(p) => ir::cache::Predictor::parse(&p),
                Err(d) => return self.report(d),
            },
        };
        let (Some(policy), Some(predictor)) = (policy, predictor) else {
            return;
        };
        if self.buffers.len() as u64 + 1 > MAX_BUFFERS {
            return self.report(Diagnostic::too_many_tasks(decl.span, MAX_BUFFERS as usize));
        }
        let layout = Layout::Experts { slots };
        let buffer = BufferId::new(self.buffers.len());
        self.buffers.push(Buffer {
            name: name.clone(),
            array: name.clone(),
            index: Vec::new(),
            space,
            bytes: u64::from(slots).saturating_mul(self.checkpoint.expert_bytes),
            layout,
            kind: BufferKind::Declared,
            layer: None,
        });
        self.buffer_spans.push(decl.span);
        self.array_index.insert(name.clone(), self.arrays.len());
        self.arrays.push(ArrayDecl {
            name: name.clone(),
            dims: Vec::new(),
            first: buffer,
            layout,
            span: decl.span,
        });
        self.caches.push(ir::cache::Cache {
            name: name.clone(),
            buffer,
            slots,
            policy,
            score,
            predictor,
        });
    }

    /// Evaluates a string naming one of `known` (a cache's policy or predictor).
    fn name_choice(
        &mut self,
        expr: &crate::syntax::ast::Expr,
        what: &str,
        known: &[&str],
    ) -> Result<String, Diagnostic> {
        match self.eval(expr)? {
            Val::Str(s) if known.contains(&s.as_str()) => Ok(s),
            Val::Str(s) => Err(Diagnostic::unknown_name(expr.span, what, &s, known)),
            other => Err(Diagnostic::type_mismatch(
                expr.span,
                &format!("a string naming the {what}"),
                other.type_name(),
            )),
        }
    }

    pub(super) fn declare_micro_batches(&mut self, decl: &MicroBatchDecl) {
        if self.micro.is_some() {
            return self.report(Diagnostic::duplicate_name(
                decl.span,
                decl.span,
                "declaration",
                "microbatches",
            ));
        }
        let count = match self
            .eval(&decl.count)
            .and_then(|v| as_int(v, decl.count.span))
        {
            Ok(n) if (1..=i64::from(u32::MAX)).contains(&n) => n as u32,
            Ok(n) => {
                return self.report(Diagnostic::out_of_range(
                    decl.count.span,
                    "micro-batch count",
                    n,
                    "1 or more",
                ))
            }
            Err(d) => return self.report(d),
        };
        let size = match self
            .eval(&decl.size)
            .and_then(|v| as_int(v, decl.size.span))
        {
            Ok(n) if n >= 1 => n as u64,
            Ok(n) => {
                return self.report(Diagnostic::out_of_range(
                    decl.size.span,
                    "micro-batch size",
                    n,
                    "1 or more",
                ))
            }
            Err(d) => return self.report(d),
        };
        let mixed_tokens = match &decl.tokens {
            None => size,
            Some(expr) => match self.eval(expr).and_then(|v| as_int(v, expr.span)) {
                Ok(n) if n >= 1 => n as u64,
                Ok(n) => {
                    return self.report(Diagnostic::out_of_range(
                        expr.span,
                        "tokens per micro-batch",
                        n,
                        "1 or more",
                    ))
                }
                Err(d) => return self.report(d),
            },
        };
        self.micro = Some(ir::MicroBatches {
            count,
            size,
            mixed_tokens,
        });
    }

    pub(super) fn declare_template(&mut self, decl: &'a TemplateDecl) {
        let name = &decl.name.name;
        if let Some(first) = self.templates.get(name) {
            let first = first.name.span;
            return self.report(Diagnostic::duplicate_name(
                decl.name.span,
                first,
                "template",
                name,
            ));
        }
        if crate::ir::catalog::op_by_name(name).is_some() {
            return self.report(Diagnostic::duplicate_name(
                decl.name.span,
                decl.name.span,
                "op",
                name,
            ));
        }
        self.templates.insert(name.clone(), decl);
    }
}

fn article(ty: ParamType) -> &'static str {
    match ty {
        ParamType::Int => "an",
        _ => "a",
    }
}

fn parse_scalar(text: &str, ty: ParamType) -> Option<Scalar> {
    let text = text.trim();
    let digits: String = text.chars().filter(|c| *c != '_').collect();
    match ty {
        ParamType::Int => digits.parse().ok().map(Scalar::Int),
        ParamType::Float => digits
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite())
            .map(Scalar::Float),
        ParamType::Bool => match text {
            "true" => Some(Scalar::Bool(true)),
            "false" => Some(Scalar::Bool(false)),
            _ => None,
        },
    }
}

fn in_range(value: Scalar, range: &ParamRange) -> bool {
    let as_f = |s: Scalar| match s {
        Scalar::Int(i) => i as f64,
        Scalar::Float(f) => f,
        Scalar::Bool(b) => f64::from(u8::from(b)),
    };
    if let (Scalar::Int(v), Scalar::Int(lo), Scalar::Int(hi)) = (value, range.lo, range.hi) {
        return v >= lo && if range.inclusive { v <= hi } else { v < hi };
    }
    let (v, lo, hi) = (as_f(value), as_f(range.lo), as_f(range.hi));
    v >= lo && if range.inclusive { v <= hi } else { v < hi }
}

impl Elaborator<'_> {
    /// `substitute CLASS FORMAT`: tasks may compute with CLASS's weights in FORMAT (a copy
    /// made at load) where the checkpoint's are expected. Only the routed experts can be
    /// substituted; the format must be one the card's experts can be stored in, and not the
    /// checkpoint's own.
    pub(super) fn declare_substitute(&mut self, decl: &SubstituteDecl) {
        use crate::model::formats::{WeightClass, WeightTensor};
        use crate::model::segment::SegmentKind;
        if decl.class.name != "experts" {
            return self.report(Diagnostic::unknown_name(
                decl.class.span,
                "weight class a `substitute` can replace",
                &decl.class.name,
                &["experts"],
            ));
        }
        let format = match crate::model::Storage::parse(&decl.format.name) {
            Ok(f) => f,
            Err(e) => return self.report(Diagnostic::bad_weight_format(decl.format.span, &e)),
        };
        let own = self
            .card
            .storage(WeightTensor::layer(SegmentKind::ExpertDown(0)));
        if own == format {
            return self.report(Diagnostic::bad_weight_format(
                decl.format.span,
                &format!(
                    "the checkpoint's experts are already {}: a substitute must be another format",
                    decl.format.name
                ),
            ));
        }
        // Whether the card's experts can take the format is checked where a `.format(..)`
        // names it: a param may leave a declared substitute unused on a card that cannot take
        // it.
        if let Some(first) = self
            .substitutes
            .iter()
            .find(|s| s.format == format)
            .map(|s| s.span)
        {
            return self.report(Diagnostic::duplicate_name(
                decl.span,
                first,
                "substitute",
                &decl.format.name,
            ));
        }
        self.substitutes.push(crate::ir::Substitute {
            class: WeightClass::Experts,
            format,
            span: decl.span,
        });
    }
}
