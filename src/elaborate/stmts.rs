//! Statements: step blocks, loops, ifs, lets, template expansion and task issue.
//!
//! Takes statement nodes; appends tasks to the program in issue order. Each statement that
//! fails is reported and skipped, so one run shows every independent error. Dynamic `if`
//! conditions become guards on the tasks inside; static ones pick a branch.

use super::labels::LabelKey;
use super::value::{as_int, SliceVal, Val};
use super::{Elaborator, PendingAfter};
use crate::diag::Diagnostic;
use crate::ir::cache::CacheOp;
use crate::ir::catalog::{self, Op, OpForm, Shape};
use crate::ir::{self, Access, Arg, Guard, Role, Slice, StepId, StreamId, Task, TaskId};
use crate::syntax::ast::{
    self, Block, CallStmt, CopyKind, CopyStmt, ForStmt, IfStmt, LetStmt, Span, StepDecl, StepKind,
    Stmt, TaskTail,
};
use smallvec::SmallVec;

impl<'a> Elaborator<'a> {
    pub(super) fn run_step(&mut self, decl: &'a StepDecl) {
        let id = StepId::new(self.steps.len());
        let first = self.tasks.len() as u32;
        self.step = Some((decl.kind, id));
        self.sync = None;
        self.ceiling_relied = false;
        self.exec_block(&decl.body);
        let routed_ceiling = self.ceiling_relied.then(|| self.step_shape().tokens);
        self.step = None;
        self.sync = None;
        let count = self.tasks.len() as u32 - first;
        self.steps.push(ir::Step {
            kind: decl.kind,
            first,
            count,
            routed_ceiling,
        });
    }

    fn exec_block(&mut self, block: &'a Block) {
        self.scopes.push();
        for stmt in &block.stmts {
            if self.aborted {
                break;
            }
            if let Err(d) = self.exec_stmt(stmt) {
                self.report(d);
            }
        }
        self.scopes.pop();
    }

    fn exec_stmt(&mut self, stmt: &'a Stmt) -> Result<(), Diagnostic> {
        match stmt {
            Stmt::Let(s) => self.exec_let(s),
            Stmt::For(s) => self.exec_for(s),
            Stmt::If(s) => self.exec_if(s),
            Stmt::Copy(s) => self.exec_copy(s),
            Stmt::Call(s) => self.exec_call(s),
            Stmt::Sync(span) => self.exec_sync(*span),
        }
    }

    /// `sync`: FlexGen's `torch.cuda.synchronize()` after each (layer, batch) step. Every
    /// later task of the step is ordered after the last task each stream issued before it
    /// (streams run in issue order, so that is every earlier task of the step).
    fn exec_sync(&mut self, span: Span) -> Result<(), Diagnostic> {
        if !self.guard.is_empty() {
            return Err(Diagnostic::guarded_sync(span));
        }
        let first = self.step_first_task();
        let mut last: Vec<Option<TaskId>> = vec![None; self.streams.len()];
        for (i, task) in self.tasks.iter().enumerate().skip(first) {
            if let Some(slot) = last.get_mut(task.stream.index()) {
                *slot = Some(TaskId::new(i));
            }
        }
        self.sync = Some((last.into_iter().flatten().collect(), span));
        Ok(())
    }

    /// Index of the current step's first task.
    fn step_first_task(&self) -> usize {
        self.steps
            .last()
            .map_or(0, |s| (s.first + s.count) as usize)
    }

    pub(super) fn exec_let(&mut self, stmt: &'a LetStmt) -> Result<(), Diagnostic> {
        let value = self.eval(&stmt.value)?;
        self.scopes
            .bind(std::borrow::Cow::Borrowed(&stmt.name.name), value);
        Ok(())
    }

    fn exec_for(&mut self, stmt: &'a ForStmt) -> Result<(), Diagnostic> {
        let (lo, hi) = match self.eval(&stmt.range)? {
            Val::Range(lo, hi) => (lo, hi),
            other => {
                return Err(Diagnostic::type_mismatch(
                    stmt.range.span,
                    "a range `a..b`",
                    other.type_name(),
                ))
            }
        };
        for value in lo..hi {
            if self.aborted {
                break;
            }
            self.iterations += 1;
            if self.iterations > self.options.limits.max_iterations {
                self.aborted = true;
                return Err(Diagnostic::too_many_tasks(
                    stmt.span,
                    self.options.limits.max_iterations as usize,
                ));
            }
            if self.aborted {
                break;
            }
            self.scopes.push();
            self.scopes
                .bind(std::borrow::Cow::Borrowed(&stmt.var.name), Val::Int(value));
            let errors_before = self.errors;
            self.exec_block(&stmt.body);
            self.scopes.pop();
            if self.errors > errors_before {
                // The body's errors are reported; later iterations would repeat them.
                break;
            }
        }
        Ok(())
    }

    /// Takes the first branch whose condition holds. A dynamic condition guards its
    /// branch's tasks and, negated, every later branch's (so `else if` and `else` only run
    /// where the earlier conditions did not), which needs it to be a single literal when
    /// anything follows. The chain is walked in a loop: a long one cannot overflow the stack.
    fn exec_if(&mut self, stmt: &'a IfStmt) -> Result<(), Diagnostic> {
        let depth = self.guard.len();
        let result = self.exec_branches(stmt);
        self.guard.truncate(depth);
        result
    }

    fn exec_branches(&mut self, stmt: &'a IfStmt) -> Result<(), Diagnostic> {
        for (i, branch) in stmt.branches.iter().enumerate() {
            if self.aborted {
                return Ok(());
            }
            let more_follow = i + 1 < stmt.branches.len() || stmt.otherwise.is_some();
            match self.eval(&branch.cond)? {
                Val::Bool(true) => {
                    self.exec_block(&branch.block);
                    return Ok(());
                }
                Val::Bool(false) => {}
                Val::Cond(lits) => {
                    let depth = self.guard.len();
                    self.guard.extend(lits.iter().copied());
                    self.exec_block(&branch.block);
                    self.guard.truncate(depth);
                    if more_follow {
                        let [lit] = lits.as_slice() else {
                            return Err(Diagnostic::dynamic_else(branch.cond.span));
                        };
                        self.guard.push(ir::GuardLit {
                            atom: lit.atom,
                            negated: !lit.negated,
                        });
                    }
                }
                other => {
                    return Err(Diagnostic::type_mismatch(
                        branch.cond.span,
                        "a condition",
                        other.type_name(),
                    ))
                }
            }
        }
        if let Some(otherwise) = &stmt.otherwise {
            self.exec_block(otherwise);
        }
        Ok(())
    }

    fn exec_call(&mut self, stmt: &'a CallStmt) -> Result<(), Diagnostic> {
        let name = stmt.name.name.as_str();
        if let Some(&template) = self.templates.get(name) {
            return self.expand_template(stmt, template);
        }
        let def = match catalog::op_by_name(name) {
            Some(def) if def.form == OpForm::Call => def,
            _ => {
                let mut known: Vec<&str> = catalog::callable_op_names().collect();
                let templates: Vec<String> = self.templates.keys().cloned().collect();
                known.extend(templates.iter().map(String::as_str));
                return Err(Diagnostic::unknown_name(
                    stmt.name.span,
                    "op or template",
                    name,
                    &known,
                ));
            }
        };
        self.exec_op(stmt, def)
    }

    fn expand_template(
        &mut self,
        stmt: &'a CallStmt,
        template: &'a ast::TemplateDecl,
    ) -> Result<(), Diagnostic> {
        if stmt.tail != TaskTail::default() {
            return Err(Diagnostic::template_tail(stmt.tail_span, &stmt.name.name));
        }
        self.expansions += 1;
        if self.expansions > self.options.limits.max_expansions {
            self.aborted = true;
            return Err(Diagnostic::too_many_expansions(
                stmt.span,
                self.options.limits.max_expansions,
            ));
        }
        if self.template_stack.contains(&stmt.name.name) {
            return Err(Diagnostic::recursive_template(stmt.span, &stmt.name.name));
        }
        if stmt.args.len() != template.params.len() {
            return Err(Diagnostic::arity(
                stmt.span,
                &format!("template `{}`", stmt.name.name),
                template.params.len(),
                stmt.args.len(),
            ));
        }
        let mut bound = Vec::with_capacity(template.params.len());
        for (param, arg) in template.params.iter().zip(&stmt.args) {
            if let Some(name) = &arg.name {
                if name.name != param.name {
                    return Err(Diagnostic::bad_argument(
                        name.span,
                        &stmt.name.name,
                        &name.name,
                        &template
                            .params
                            .iter()
                            .map(|p| p.name.as_str())
                            .collect::<Vec<_>>(),
                    ));
                }
            }
            bound.push((param.name.as_str(), self.eval(&arg.value)?));
        }
        // Templates see the top level and their params, not the caller's locals.
        let caller = self.scopes.enter_template();
        for (name, value) in bound {
            self.scopes.bind(std::borrow::Cow::Borrowed(name), value);
        }
        self.template_stack.push(stmt.name.name.clone());
        self.exec_block(&template.body);
        self.template_stack.pop();
        self.scopes.leave_template(caller);
        Ok(())
    }

    fn exec_copy(&mut self, stmt: &'a CopyStmt) -> Result<(), Diagnostic> {
        let (src_expr, src_part) = kv_part_of(&stmt.src)?;
        let (dst_expr, dst_part) = kv_part_of(&stmt.dst)?;
        let kv_part = match (src_part, dst_part) {
            (Some((a, _)), Some((b, at))) if a != b => {
                return Err(Diagnostic::type_mismatch(
                    at,
                    &format!("`.{}()` on both sides, or on one", a.as_str()),
                    &format!("`.{}()`", b.as_str()),
                ))
            }
            (a, b) => a.or(b),
        };
        if let Some((part, at)) = kv_part {
            if matches!(stmt.kind, CopyKind::Fetch | CopyKind::Prefetch) {
                return Err(Diagnostic::type_mismatch(
                    at,
                    "one expert's weights (a fetch fills an expert cache slot)",
                    &format!("the `.{}()` of a KV cache", part.as_str()),
                ));
            }
            if matches!(self.step, Some((StepKind::Setup, _)) | None) {
                return Err(Diagnostic::dynamic_not_allowed(
                    at,
                    "a KV cache's context (`.context()`, `.appended()`) in `setup`, which has no sequences,",
                ));
            }
        }
        let src = self.eval_slice(src_expr)?;
        let mut dst = self.eval_slice(dst_expr)?;
        // A part of `W[l]` that layer does not have (a dense layer's experts) is empty:
        // like an arm that never runs, the copy issues nothing.
        if src.layer.is_some() && src.len == 0 && src.slot_len > 0 {
            return Ok(());
        }
        // A part of `W[l]` fills the first bytes of a slot shaped for that part of any
        // layer (a dense layer's `gate` is not a MoE layer's): the copy moves its bytes.
        if src.layer.is_some()
            && dst.layer.is_none()
            && dst.cache_key.is_none()
            && src.len < dst.len
            && src.slot_len == dst.len
        {
            dst.len = src.len;
        }
        // A slot for any layer into a slot declared for one layer (`dense_weights(l)`):
        // the first bytes, where a copy of that layer's part put it (the checker proves
        // which layer the source holds there).
        let mut src = src;
        if src.layer.is_none()
            && dst.layer.is_some()
            && dst.buffer.index() != 0
            && src.buffer.index() != 0
            && src.layout == dst.layout
            && src.len > dst.len
        {
            src.len = dst.len;
            src.slot_len = dst.len;
        }
        let cache_op = match stmt.kind {
            CopyKind::Copy => None,
            CopyKind::Fetch => Some(CacheOp::Fetch),
            CopyKind::Prefetch => Some(CacheOp::Prefetch),
        };
        let keyword = cache_op.map_or("copy", CacheOp::as_str);
        match (cache_op, dst.cache_key) {
            (None, Some(_)) => {
                return Err(Diagnostic::type_mismatch(
                    stmt.dst.span,
                    "a buffer slice (`copy` never writes an expert cache: `fetch` or `prefetch` fill it)",
                    "an expert cache slot",
                ))
            }
            (Some(_), None) => {
                return Err(Diagnostic::type_mismatch(
                    stmt.dst.span,
                    &format!("an expert cache slot `CACHE.slot(layer, expert)` (what `{keyword}` writes)"),
                    "a buffer slice",
                ))
            }
            (Some(CacheOp::Fetch), Some(key)) if matches!(key.expert, ir::ExpertRef::Predicted { .. }) => {
                return Err(Diagnostic::dynamic_not_allowed(
                    stmt.dst.span,
                    "a predicted expert in `fetch` (a fetch is on demand, for an expert that is computed; `prefetch` copies predictions)",
                ))
            }
            _ => {}
        }
        if cache_op.is_some() && src.len != self.checkpoint.expert_bytes {
            return Err(Diagnostic::type_mismatch(
                stmt.src.span,
                &format!(
                    "one expert's weights ({} bytes), such as `W[l].expert(e)`",
                    self.checkpoint.expert_bytes
                ),
                &format!("a slice of {} bytes", src.len),
            ));
        }
        self.cache_op = cache_op;
        self.kv_part = kv_part.map(|(part, _)| part);
        let args: TaskArgs = smallvec::smallvec![
            (
                Arg {
                    role: Role::Src,
                    slice: to_slice(src),
                    access: Access::Read,
                },
                stmt.src.span,
            ),
            (
                Arg {
                    role: Role::Dst,
                    slice: to_slice(dst),
                    access: Access::Write,
                },
                stmt.dst.span,
            ),
        ];
        let issued = self.issue(Op::Copy, args, &stmt.tail, stmt.span, keyword);
        self.cache_op = None;
        self.kv_part = None;
        issued
    }

    fn eval_slice(&mut self, expr: &ast::Expr) -> Result<SliceVal, Diagnostic> {
        match self.eval(expr)? {
            Val::Slice(s) => Ok(s),
            Val::Array { .. } => Err(Diagnostic::type_mismatch(
                expr.span,
                "a buffer slice",
                "an array of buffers (index it)",
            )),
            other => Err(Diagnostic::type_mismatch(
                expr.span,
                "a buffer slice",
                other.type_name(),
            )),
        }
    }

    pub(super) fn step_shape(&self) -> Shape {
        let size = self.micro.map_or(1, |m| m.size);
        let w = self.options.workload;
        let act_bytes = self.options.act_bytes.max(1);
        let kv_bytes = self
            .options
            .kv_bytes
            .unwrap_or(self.options.act_bytes)
            .max(1);
        match self.step.map(|s| s.0) {
            Some(StepKind::Prefill) => Shape {
                tokens: size.saturating_mul(w.prompt_len),
                seqs: size,
                context: w.prompt_len,
                act_bytes,
                kv_bytes,
            },
            Some(StepKind::Mixed) => Shape {
                tokens: self.micro.map_or(size, |m| m.mixed_tokens),
                seqs: size,
                context: w.prompt_len.saturating_add(w.gen_len),
                act_bytes,
                kv_bytes,
            },
            _ => Shape {
                tokens: size,
                seqs: size,
                context: w.prompt_len.saturating_add(w.gen_len),
                act_bytes,
                kv_bytes,
            },
        }
    }

    pub(super) fn issue(
        &mut self,
        op: Op,
        args: TaskArgs,
        tail: &'a TaskTail,
        span: Span,
        op_name: &str,
    ) -> Result<(), Diagnostic> {
        if self.tasks.len() >= self.options.limits.max_tasks {
            self.aborted = true;
            return Err(Diagnostic::too_many_tasks(
                span,
                self.options.limits.max_tasks,
            ));
        }
        // `setup` runs once, before any gate: an expert ranked by run-time routing has no
        // value there (placement must be a compile-time function, e.g. of a profile).
        if matches!(self.step, Some((StepKind::Setup, _))) {
            let is_hot = |e: Option<ir::ExpertRef>| matches!(e, Some(ir::ExpertRef::Hot { .. }));
            let hot_arg = args.iter().find(|(a, _)| is_hot(a.slice.dynamic_expert));
            let hot_set = matches!(
                op,
                Op::Experts {
                    set: ir::ExpertSet::One(ir::ExpertRef::Hot { .. }),
                    ..
                }
            );
            if let Some((_, at)) = hot_arg {
                return Err(Diagnostic::dynamic_not_allowed(
                    *at,
                    "an expert ranked at run time (`hot(..)`) in `setup`, which runs before any routing,",
                ));
            }
            if hot_set || !self.guard.is_empty() {
                return Err(Diagnostic::dynamic_not_allowed(
                    span,
                    "a run-time expert or guard in `setup`, which runs before any routing,",
                ));
            }
        }
        // A cache's bytes are named only by the expert a slot holds; a prediction only
        // decides what a prefetch copies.
        for (arg, at) in &args {
            let is_cache = self.caches.iter().any(|c| c.buffer == arg.slice.buffer);
            if is_cache && arg.slice.cache_key.is_none() {
                return Err(Diagnostic::type_mismatch(
                    *at,
                    "an expert cache slot named by the expert it holds, `CACHE.slot(layer, expert)`",
                    "the cache's bytes",
                ));
            }
            let predicted =
                |e: Option<ir::ExpertRef>| matches!(e, Some(ir::ExpertRef::Predicted { .. }));
            if self.cache_op != Some(CacheOp::Prefetch)
                && (predicted(arg.slice.dynamic_expert)
                    || predicted(arg.slice.cache_key.map(|k| k.expert)))
            {
                return Err(Diagnostic::dynamic_not_allowed(
                    *at,
                    "a predicted expert (`CACHE.predicted(..)`) outside `prefetch` (predictions decide what is copied ahead, never what is computed or fetched)",
                ));
            }
        }
        if let Op::Experts {
            set: ir::ExpertSet::One(ir::ExpertRef::Predicted { .. }),
            ..
        } = op
        {
            return Err(Diagnostic::dynamic_not_allowed(
                span,
                "a predicted expert as the expert an `experts` task computes (predictions decide what is copied ahead, never what is computed)",
            ));
        }
        // An arm whose guard holds a literal and its negation never runs (`if routed(l, e)
        // >= 1 { .. } else { .. }` inside `if active(l, e)`): like a static branch not
        // taken, it issues nothing.
        let contradictory = self.guard.iter().any(|a| {
            self.guard
                .iter()
                .any(|b| a.atom == b.atom && a.negated != b.negated)
        });
        if contradictory {
            return Ok(());
        }
        let on = tail
            .on
            .as_ref()
            .ok_or_else(|| Diagnostic::missing_stream(span, op_name))?;
        let stream: StreamId = match self.stream_index.get(&on.name) {
            Some(&s) => s,
            None => {
                let known: Vec<&str> = self.stream_index.keys().map(String::as_str).collect();
                let mut known = known;
                known.sort();
                return Err(Diagnostic::unknown_name(
                    on.span, "stream", &on.name, &known,
                ));
            }
        };
        let id = TaskId::new(self.tasks.len());
        let label = match &tail.label {
            Some(label) => Some(self.label_key(label)?),
            None => None,
        };
        let mut after = Vec::new();
        for item in &tail.after {
            if let Some(cond) = &item.condition {
                match self.eval(cond)? {
                    Val::Bool(false) => continue,
                    Val::Bool(true) => {}
                    other => {
                        return Err(Diagnostic::type_mismatch(
                            cond.span,
                            "a compile-time boolean",
                            other.type_name(),
                        ))
                    }
                }
            }
            after.push((self.label_key(&item.label)?, item.span));
        }
        let label_text = match label {
            Some(key) => {
                // The text only where it is kept (`Options::task_names`) or reported.
                let text = self.options.task_names.then(|| key.text());
                if let Err(first) = self.labels.insert(&key, id) {
                    let first_span = self.spans.tasks[first.index()];
                    // The key is equal to the first's, so is its text.
                    let text = text.unwrap_or_else(|| key.text());
                    return Err(Diagnostic::duplicate_label(span, first_span, &text));
                }
                text
            }
            None => None,
        };
        for (key, span) in after {
            self.pending_after.push(PendingAfter {
                task: id,
                label: key,
                span,
            });
        }
        let shape = self.step_shape();
        let arg_info: SmallVec<[(Role, ir::Space, u64); 6]> = args
            .iter()
            .map(|(a, _)| {
                (
                    a.role,
                    self.buffers[a.slice.buffer.index()].space,
                    a.slice.len,
                )
            })
            .collect();
        let mut work = catalog::work_in(&op, &self.card, &self.checkpoint, &shape, &arg_info);
        if let (Some(part), Some(copy)) = (self.kv_part, work.copy.as_mut()) {
            // The positions the copy moves at the declared (worst-case) shape.
            copy.bytes = catalog::kv_part_bytes(&self.card, &shape, part).min(copy.bytes);
            for m in &mut work.mem {
                m.bytes = copy.bytes as f64;
            }
        }
        let mut lits = self.guard.clone();
        lits.sort();
        lits.dedup();
        let (arg_list, arg_spans): (Vec<Arg>, Vec<Span>) = if self.options.task_names {
            args.into_iter().unzip()
        } else {
            (args.into_iter().map(|(arg, _)| arg).collect(), Vec::new())
        };
        // After a `sync`, the barrier's tasks on other streams (stream order covers its own).
        let (synced, sync_spans): (Vec<TaskId>, Vec<Span>) = match &self.sync {
            Some((before, sync_span)) => before
                .iter()
                .filter(|t| self.tasks[t.index()].stream != stream)
                .map(|&t| (t, *sync_span))
                .unzip(),
            None => (Vec::new(), Vec::new()),
        };
        self.tasks.push(Task {
            op,
            stream,
            step: self.step.map_or(StepId(0), |s| s.1),
            args: arg_list,
            after: synced,
            guard: Guard { lits },
            shape,
            work,
            label: label_text,
            cache_op: self.cache_op,
            kv: self.kv_part,
            live: None,
            group: None,
        });
        self.spans.tasks.push(span);
        self.spans.task_args.push(arg_spans);
        self.spans.task_streams.push(on.span);
        self.spans.task_after.push(sync_spans);
        Ok(())
    }

    /// Labels are scoped to their step: `after` never crosses step boundaries.
    fn label_key(&mut self, label: &'a ast::Label) -> Result<LabelKey<'a>, Diagnostic> {
        let mut indices = SmallVec::new();
        for index in &label.indices {
            let v = self.eval(index)?;
            indices.push(as_int(v, index.span)?);
        }
        Ok(LabelKey {
            step: self.step.map_or(0, |s| s.1 .0),
            name: &label.name.name,
            indices,
        })
    }
}

/// A KV part a copy side names, with the span of its method.
type KvPartAt = (ir::KvPart, Span);

/// A copy side written `SLICE.context()` or `SLICE.appended()`: the slice expression and
/// the KV part it names (with the method's span), else the side itself.
fn kv_part_of(expr: &ast::Expr) -> Result<(&ast::Expr, Option<KvPartAt>), Diagnostic> {
    let ast::ExprKind::Method(base, method, args) = &expr.kind else {
        return Ok((expr, None));
    };
    let part = match method.name.as_str() {
        "context" => ir::KvPart::Context,
        "appended" => ir::KvPart::Appended,
        _ => return Ok((expr, None)),
    };
    if !args.is_empty() {
        return Err(Diagnostic::arity(
            expr.span,
            &format!("`{}`", method.name),
            0,
            args.len(),
        ));
    }
    Ok((base, Some((part, method.span))))
}

/// A task's arguments with their spans as an op call or copy gives them to `issue`:
/// inline, as every op takes a handful (no allocation per task beyond the task's own).
pub(super) type TaskArgs = SmallVec<[(Arg, Span); 6]>;

pub(super) fn to_slice(s: SliceVal) -> Slice {
    Slice {
        buffer: s.buffer,
        start: s.start,
        len: s.len,
        dynamic_expert: s.dynamic_expert,
        cache_key: s.cache_key,
    }
}

#[cfg(test)]
mod tests {
    use crate::diag::Diagnostic;
    use crate::elaborate::Options;
    use crate::ir::Program;
    use crate::model::card::ModelCard;

    /// Parses and elaborates `source`: the two stages whose diagnostics these tests read.
    /// Not `crate::compile::compile`, which sits above this module (an import of it from
    /// here closes a circle through `compile.rs`, which the layering test refuses).
    fn compile(
        source: &str,
        options: &Options,
    ) -> Result<(Program, Vec<Diagnostic>), Vec<Diagnostic>> {
        let file = crate::syntax::parse_file(source).map_err(|d| vec![d])?;
        crate::elaborate::elaborate(&file, options)
    }

    /// The first error of a prefill step holding one call on a `gpu.compute` stream.
    fn first_error(call: &str) -> String {
        let source = format!(
            "schedule t\nmicrobatches 1 of 1\nstream gpu: gpu.compute\nprefill {{\n  {call} on gpu\n}}\n"
        );
        let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
        let diags = compile(&source, &options).err().unwrap_or_default();
        let error = diags.iter().find(|d| d.is_error());
        error.map_or_else(String::new, |d| {
            format!(
                "{}; help: {}",
                d.message,
                d.help.clone().unwrap_or_default()
            )
        })
    }

    /// A lean elaboration (a planner's point: no task names, labels checked for
    /// duplicates once at the end) gives a schedule with a label given twice the
    /// diagnostics a named one gives, and a schedule without one the same tasks and
    /// `after` orderings.
    #[test]
    fn a_lean_elaboration_reports_a_label_given_twice_as_a_named_one() {
        let source = |second: &str| {
            format!(
                "schedule t
microbatches 1 of 1
stream cpu: cpu.compute
stream gpu: gpu.compute
                 buffer h: host = hidden(prompt_len)
buffer qkv: host = qkv(prompt_len)
                 prefill {{
                 for l in 0..layers {{
                 pre_attn(layer = l, ub = 0, w = W[l], h = h, out = qkv) on cpu as pre[l, 0]
                 pre_attn(layer = l, ub = 0, w = W[l], h = h, out = qkv) on gpu as {second} after pre[l, 0]
                 }}
}}
"
            )
        };
        let named = Options::new(ModelCard::load("mixtral-tiny").unwrap());
        let mut lean = named.clone();
        lean.task_names = false;
        // `pre[0, 0]` given twice: at l = 0, the second task of the body.
        let twice = source("pre[0, 0]");
        let file = crate::syntax::parse_file(&twice).unwrap();
        let named_diags = crate::elaborate::elaborate(&file, &named).err().unwrap();
        let lean_diags = crate::elaborate::elaborate(&file, &lean).err().unwrap();
        assert!(
            named_diags.iter().any(|d| d.message.contains("pre[0, 0]")),
            "{named_diags:?}"
        );
        // Message, spans and help alike.
        assert_eq!(lean_diags, named_diags);
        // Distinct labels: the same tasks, each second one after its first.
        let once = source("post[l]");
        let file = crate::syntax::parse_file(&once).unwrap();
        let (named_program, _) = crate::elaborate::elaborate(&file, &named).unwrap();
        let (lean_program, _) = crate::elaborate::elaborate(&file, &lean).unwrap();
        assert_eq!(lean_program.tasks.len(), named_program.tasks.len());
        for (a, b) in lean_program.tasks.iter().zip(&named_program.tasks) {
            assert_eq!((&a.op, &a.after, &a.args), (&b.op, &b.after, &b.args));
        }
        assert_eq!(
            named_program.tasks[1].after,
            vec![crate::ir::TaskId::new(0)]
        );
    }

    /// Issue 45: "param `t` is never used" came and went with another param's value,
    /// because only an evaluated name counted. A param named anywhere in the text is used.
    #[test]
    fn a_param_read_only_in_a_dropped_branch_is_still_used() {
        let source = |extra: &str| {
            format!(
                "schedule t\nparam p: int in 0..=1 = 0\nparam t: int in 1..=8 = 2\n{extra}\
                 microbatches 1 of 1\nstream cpu: cpu.compute\n\
                 buffer h: host = hidden(prompt_len)\nbuffer qkv: host = qkv(prompt_len)\n\
                 buffer a: host = attn_out(prompt_len)\nbuffer lg: host = logits(1)\n\
                 buffer tok: host = tokens(1)\n\
                 buffer kv[layers]: host = kv_cache(prompt_len + gen_len)\n\
                 prefill {{\n  if p == 1 {{ let x = t }}\n\
                 embed(ub = 0, w = W.embed, h = h) on cpu\n\
                 for l in 0..layers {{\n\
                 pre_attn(layer = l, ub = 0, w = W[l], h = h, out = qkv) on cpu\n\
                 attn(layer = l, ub = 0, part = prefill, qkv = qkv, kv = kv[l], out = a) on cpu\n\
                 post_attn(layer = l, ub = 0, w = W[l], a = a, h = h) on cpu\n  }}\n\
                 lm_head(ub = 0, w = W.head, h = h, logits = lg) on cpu\n\
                 sample(ub = 0, logits = lg, tokens = tok) on cpu\n}}\n"
            )
        };
        let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
        let unused = |src: &str| -> Vec<String> {
            let (_, warnings) = compile(src, &options).unwrap();
            warnings
                .iter()
                .map(|d| d.message.clone())
                .filter(|m| m.ends_with("is never used") && m.starts_with("param"))
                .collect()
        };
        assert_eq!(unused(&source("")), Vec::<String>::new());
        assert_eq!(
            unused(&source("param q: int = 1\n")),
            vec!["param `q` is never used".to_string()]
        );
    }

    /// `.context()` / `.appended()` belong to a side of a `copy` in a step with sequences:
    /// inside an op argument, in `setup`, with arguments, or different on the two sides
    /// they are refused at elaboration.
    #[test]
    fn kv_parts_only_name_a_side_of_a_copy_in_a_step() {
        let compile_error = |body: &str| {
            let source = format!(
                "schedule t\nmicrobatches 1 of 1\nstream gpu: gpu.compute\nstream h2d: gpu.copy_in\n\
                 buffer kv: pinned = kv_cache(8)\nbuffer kv_g: gpu = kv_cache(8)\n\
                 buffer q: gpu = qkv(8)\nbuffer a: gpu = attn_out(8)\n{body}\n"
            );
            let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
            let diags = compile(&source, &options).err().unwrap_or_default();
            diags
                .iter()
                .find(|d| d.is_error())
                .map_or_else(String::new, |d| d.message.clone())
        };
        let in_arg = compile_error(
            "prefill { attn(layer = 0, ub = 0, part = prefill, qkv = q, kv = kv_g.context(), out = a) on gpu }",
        );
        assert!(in_arg.contains("a side of a `copy`"), "{in_arg}");
        let in_setup = compile_error("setup { copy kv.context() -> kv_g on h2d }");
        assert!(in_setup.contains("`setup`"), "{in_setup}");
        let with_args = compile_error("decode { copy kv.context(1) -> kv_g on h2d }");
        assert!(with_args.contains("`context`"), "{with_args}");
        let mixed = compile_error("decode { copy kv.context() -> kv_g.appended() on h2d }");
        assert!(mixed.contains("`.appended()`"), "{mixed}");
    }

    /// Static parameters are asked for in the order each op declares them, then the first
    /// required buffer argument of its signature (expected messages written by hand from
    /// the op catalog of DESIGN.md).
    #[test]
    fn missing_arguments_are_named_from_the_op_table() {
        let cases = [
            ("embed()", "`embed` needs the argument `ub`"),
            ("embed(ub = 0)", "`embed` needs the argument `w`"),
            ("pre_attn(ub = 0)", "`pre_attn` needs the argument `layer`"),
            (
                "attn(layer = 0, ub = 0)",
                "`attn` needs the argument `part`",
            ),
            (
                "attn(layer = 0, ub = 0, part = decode)",
                "`attn` needs the argument `qkv`",
            ),
            (
                "experts(layer = 0, ub = 0)",
                "`experts` needs the argument `set`",
            ),
            (
                "combine(layer = 0, ub = 0)",
                "`combine` needs the argument `route`",
            ),
            ("sample(ub = 0)", "`sample` needs the argument `logits`"),
        ];
        for (call, expected) in cases {
            let error = first_error(call);
            assert!(error.starts_with(expected), "{call}: {error}");
        }
    }

    /// An unknown argument lists what the op takes; a bad `part` says what `part` takes;
    /// a misspelt op is matched against the table's callable names.
    #[test]
    fn unknown_arguments_and_bad_static_values_are_diagnosed_from_the_op_table() {
        let error = first_error("gate(layer = 0, ub = 0, acc_out = 1)");
        assert_eq!(
            error,
            "`gate` takes no argument `acc_out`; help: `gate` takes: layer, ub, w, h, route, acc"
        );
        let error = first_error("attn(layer = 0, ub = 0, part = 3)");
        assert!(
            error.starts_with("expected `prefill`, `decode` or `all`, found"),
            "{error}"
        );
        let error = first_error("pre_atn(layer = 0, ub = 0)");
        assert_eq!(
            error,
            "unknown op or template `pre_atn`; help: did you mean `pre_attn`?"
        );
    }

    // The vocabulary tables (elaborate::vocabulary) against the evaluator. They live here,
    // not in vocabulary.rs, because the tables are imported by the evaluator that compile.rs
    // reaches: a test there importing compile.rs would close an import circle.

    /// The messages of the errors (not warnings) of a schedule with `items` at top level
    /// and `body` in its prefill step.
    fn vocabulary_errors(items: &str, body: &str) -> Vec<String> {
        let source = format!(
            "schedule t\nmicrobatches 1 of 1\nstream gpu: gpu.compute\n{items}\nprefill {{\n{body}\n}}\n"
        );
        let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
        let diags = compile(&source, &options).err().unwrap_or_default();
        diags
            .iter()
            .filter(|d| d.is_error())
            .map(|d| d.message.clone())
            .collect()
    }

    /// Each table names words the evaluator knows: a word the table lists but the
    /// evaluator does not would send users (and the reference) to a word that fails.
    #[test]
    fn every_listed_word_is_one_the_evaluator_knows() {
        for f in super::super::vocabulary::FUNCTIONS {
            let errs = vocabulary_errors(&format!("let x = {f}()"), "");
            assert!(
                errs.iter().all(|e| !e.starts_with("unknown function")),
                "{f}: {errs:?}"
            );
        }
        // The test schedule samples nothing, which the checker reports; only "unknown ..."
        // errors say a word is not known.
        let known = |errs: &[String]| errs.iter().all(|e| !e.starts_with("unknown"));
        for s in super::super::vocabulary::SYMBOLS {
            let errs = vocabulary_errors(&format!("let x = {s}"), "");
            assert!(known(&errs), "{s}: {errs:?}");
        }
        for m in super::super::vocabulary::SLICE_METHODS {
            let errs = vocabulary_errors(&format!("let x = bytes(W[0].{m}())"), "");
            assert!(
                errs.iter().all(|e| !e.starts_with("unknown method")),
                "{m}: {errs:?}"
            );
        }
        for m in super::super::vocabulary::CACHE_METHODS {
            let errs = vocabulary_errors(
                &format!("cache ec[2]: gpu evict \"lru\"\nlet x = bytes(ec.{m}(0, 0))"),
                "",
            );
            assert!(
                errs.iter().all(|e| !e.starts_with("unknown method")),
                "{m}: {errs:?}"
            );
        }
        for f in super::super::vocabulary::FIELDS {
            let base = if matches!(f, "embed" | "head") {
                "W"
            } else {
                "W[0]"
            };
            let errs = vocabulary_errors(&format!("let x = bytes({base}.{f})"), "");
            assert!(known(&errs), "{f}: {errs:?}");
        }
    }

    /// Issue 45: a misspelt method on a run-time expert's slice said "must be known at
    /// compile time"; the name is the problem, and the message says so.
    #[test]
    fn an_unknown_method_is_named_before_the_run_time_expert_rule() {
        let errs = vocabulary_errors(
            "buffer w: gpu = expert_weights(1)",
            "  copy W[0].expert(hot(0, 0)).q4() -> w on gpu",
        );
        assert_eq!(
            errs.first().map(String::as_str),
            Some("unknown method `q4`"),
            "{errs:?}"
        );
        // A real slice method on a run-time expert still meets the run-time rule.
        let errs = vocabulary_errors(
            "buffer w: gpu = expert_weights(1)",
            "  copy W[0].expert(hot(0, 0)).page(0, 2) -> w on gpu",
        );
        assert!(
            errs.first()
                .is_some_and(|e| e.contains("known at compile time")),
            "{errs:?}"
        );
    }
}
