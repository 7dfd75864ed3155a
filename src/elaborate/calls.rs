//! Op calls: an op's static parameters and buffer arguments, matched against the op
//! table, and `experts(.., ub = all, ..)` groups.
//!
//! Takes a call statement and its op's table entry; issues its task (through
//! `Elaborator::issue`) or gives the diagnostic. The checks of the argument names, which
//! depend on the text alone, are made once per statement (`Elaborator::clean_calls`).

use super::stmts::to_slice;
use super::value::{as_int, check_index, Context, SliceVal, Val};
use super::Elaborator;
use crate::diag::Diagnostic;
use crate::ir::catalog::{
    self, AttnPart, ExpertRef, ExpertSet, Op, OpDef, StaticArgs, StaticParam,
};
use crate::ir::{self, Arg, Role, TaskId};
use crate::syntax::ast::{self, CallStmt, Span};
use smallvec::SmallVec;

/// What `exec_op` needs of one role of an op's signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RoleAccess {
    /// The role (argument name).
    pub role: Role,
    /// How the op touches it.
    pub access: ir::Access,
    /// It may be left out.
    pub optional: bool,
}

/// An op's roles in argument order (inline: an op takes a handful).
pub(super) type OpRoles = SmallVec<[RoleAccess; 6]>;

/// The key of an op's roles: its table entry (by address) and, for `attn`, its part.
pub(super) type OpRolesKey = (usize, Option<AttnPart>);

impl<'a> Elaborator<'a> {
    fn micro_count(&mut self, span: Span) -> Result<u32, Diagnostic> {
        self.micro
            .map(|m| m.count)
            .ok_or_else(|| Diagnostic::missing_microbatches(span))
    }

    /// The roles of a concrete op in argument order, with the access and whether each may
    /// be left out: its signature's ([`catalog::signature`]) without the value tensors.
    /// Those three depend on the op's kind alone, and for `attn` on its part (the catalog's
    /// signatures; debug builds compare every answer with the signature), so they are
    /// worked out once per kind: a signature is four vectors to allocate and free per
    /// `experts` task (a real-size plan issues millions).
    fn op_roles(&mut self, def: &'static OpDef, op: &Op) -> OpRoles {
        let part = match op {
            Op::Attn { part, .. } => Some(*part),
            _ => None,
        };
        let key = (def as *const OpDef as usize, part);
        let card = &self.card;
        let roles = self
            .op_roles
            .entry(key)
            .or_insert_with(|| op_roles_of(op, card))
            .clone();
        debug_assert_eq!(
            roles,
            op_roles_of(op, card),
            "{}: roles that depend on more than the op's kind and part",
            def.name
        );
        roles
    }

    /// Issues a call of the op `def`: its static parameters parsed as the table declares
    /// them, then its buffer arguments checked against the table (unknown names, missing
    /// required ones) and against the op's value signature.
    pub(super) fn exec_op(
        &mut self,
        stmt: &'a CallStmt,
        def: &'static OpDef,
    ) -> Result<(), Diagnostic> {
        if self.group_ub.is_none() && def.kind == catalog::OpKind::Experts {
            let ub = stmt
                .args
                .iter()
                .find(|a| a.name.as_ref().is_some_and(|n| n.name == "ub"));
            if let Some(ub) = ub {
                if self.eval(&ub.value)? == Val::Word("all") {
                    return self.exec_experts_group(stmt, def);
                }
            }
        }
        let op_name = def.name;
        let clean = *self
            .clean_calls
            .entry(stmt as *const CallStmt as usize)
            .or_insert_with(|| names_well_formed(stmt, def));
        // An op takes a handful of arguments: a list searched in place, no map per task.
        let mut named: SmallVec<[(&str, &ast::Arg); 8]> = SmallVec::new();
        for arg in &stmt.args {
            let Some(name) = &arg.name else {
                return Err(Diagnostic::positional_op_argument(arg.span, op_name));
            };
            if !clean && named.iter().any(|(n, _)| *n == name.name) {
                return Err(Diagnostic::bad_argument(
                    name.span,
                    op_name,
                    &format!("{} (given twice)", name.name),
                    &def.arg_names(),
                ));
            }
            named.push((name.name.as_str(), arg));
        }
        let named_get = |key: &str| named.iter().find(|(n, _)| *n == key).map(|&(_, arg)| arg);
        // Ask for the micro-batch count first: without it no `ub` can be checked.
        let ub_limit = if def.params.contains(&StaticParam::Ub) {
            u64::from(self.micro_count(stmt.name.span)?)
        } else {
            0
        };
        let mut parsed = StaticArgs::default();
        for &param in def.params {
            let arg = named_get(param.name())
                .ok_or_else(|| Diagnostic::missing_argument(stmt.span, op_name, param.name()))?;
            match param {
                StaticParam::Layer => {
                    parsed.layer = Some(self.static_index(arg, self.card.layers, "layer")?)
                }
                StaticParam::Ub => {
                    parsed.ub = match self.group_ub {
                        Some(k) => Some(k),
                        None => Some(self.static_index(arg, ub_limit, "micro-batch")?),
                    }
                }
                StaticParam::Part => parsed.part = Some(self.static_part(arg, param)?),
                StaticParam::Set => parsed.set = Some(self.static_set(arg)?),
            }
        }
        let op = (def.build)(&parsed)
            .map_err(|param| Diagnostic::missing_argument(stmt.span, op_name, param.name()))?;
        // Lookahead gating needs a layer before it and a router in its own layer.
        if let Op::Pregate { layer, .. } = op {
            let first = self.card.dense_layers.max(1);
            if u64::from(layer) < first {
                let span = named_get("layer").map_or(stmt.span, |a| a.value.span);
                return Err(Diagnostic::out_of_range(
                    span,
                    "pregate layer",
                    i64::from(layer),
                    &format!(
                        "a layer with a router and a layer before it: {first}..{}",
                        self.card.layers
                    ),
                ));
            }
        }
        for arg in stmt.args.iter().filter(|_| !clean) {
            if let Some(name) = &arg.name {
                let allowed = def.params.iter().any(|p| p.name() == name.name)
                    || def.args.iter().any(|a| a.role.as_str() == name.name);
                if !allowed {
                    return Err(Diagnostic::bad_argument(
                        name.span,
                        op_name,
                        &name.name,
                        &def.arg_names(),
                    ));
                }
            }
        }
        // The concrete op's signature decides what is required (`attn(part = prefill)` may
        // leave out its `kv`) and with which access each argument is passed.
        let signature = self.op_roles(def, &op);
        let mut args = super::stmts::TaskArgs::new();
        for role_sig in &signature {
            let key = role_sig.role.as_str();
            let Some(arg) = named_get(key) else {
                if role_sig.optional {
                    continue;
                }
                return Err(Diagnostic::missing_argument(stmt.span, op_name, key));
            };
            let mut value = self.eval(&arg.value)?;
            // In a group, `route` and `acc` name arrays indexed by micro-batch.
            if let (Some(k), Val::Array { decl, indices }) = (self.group_ub, &value) {
                if matches!(role_sig.role, Role::Route | Role::Acc) {
                    value =
                        self.index_array(*decl, indices.clone(), i64::from(k), arg.value.span)?;
                }
            }
            // Inline: one slice per argument but for `w` or `acc` lists.
            let slices: SmallVec<[(SliceVal, Span); 2]> = match value {
                Val::Slice(s) => smallvec::smallvec![(s, arg.value.span)],
                Val::List(items)
                    if def.arg(role_sig.role).is_some_and(|a| a.list) && !items.is_empty() =>
                {
                    let spans: Vec<Span> = match &arg.value.kind {
                        ast::ExprKind::List(exprs) => exprs.iter().map(|e| e.span).collect(),
                        _ => vec![arg.value.span; items.len()],
                    };
                    let mut out = SmallVec::new();
                    for (item, span) in items.into_iter().zip(spans) {
                        match item {
                            Val::Slice(s) => out.push((s, span)),
                            other => {
                                return Err(Diagnostic::type_mismatch(
                                    span,
                                    "a buffer slice",
                                    other.type_name(),
                                ))
                            }
                        }
                    }
                    out
                }
                Val::Array { .. } => {
                    return Err(Diagnostic::type_mismatch(
                        arg.value.span,
                        "a buffer slice",
                        "an array of buffers (index it)",
                    ))
                }
                other => {
                    let expected = if def.arg(role_sig.role).is_some_and(|a| a.list) {
                        "a buffer slice or a list of them"
                    } else {
                        "a buffer slice"
                    };
                    return Err(Diagnostic::type_mismatch(
                        arg.value.span,
                        expected,
                        other.type_name(),
                    ));
                }
            };
            for (slice, span) in slices {
                args.push((
                    Arg {
                        role: role_sig.role,
                        slice: to_slice(slice),
                        access: role_sig.access,
                    },
                    span,
                ));
            }
        }
        self.issue(op, args, &stmt.tail, stmt.span, op_name)
    }

    /// A compile-time index `0..limit` (`layer`, `ub`).
    fn static_index(&mut self, arg: &ast::Arg, limit: u64, what: &str) -> Result<u32, Diagnostic> {
        let value = self.eval(&arg.value)?;
        if matches!(value, Val::Expert(_)) {
            return Err(Diagnostic::dynamic_not_allowed(arg.value.span, what));
        }
        let i = as_int(value, arg.value.span)?;
        Ok(check_index(i, limit, what, arg.value.span)? as u32)
    }

    /// `experts(layer = l, ub = all, set = e, w = .., route = R, acc = A)`: one expert
    /// computation over every micro-batch (Klotski §4: each expert's weights serve the
    /// tokens of all batches of the group). It unrolls into one task per micro-batch k
    /// (`route = R[k]`, `acc = A[k]`; with one expert, guarded by `active(l, e, k)` as
    /// well, so a micro-batch without its tokens skips its part), marked as one group: the
    /// checker and the runtime see ordinary tasks, the cost model reads the weights once.
    fn exec_experts_group(
        &mut self,
        stmt: &'a CallStmt,
        def: &'static OpDef,
    ) -> Result<(), Diagnostic> {
        let n = self.micro_count(stmt.name.span)?;
        let arg = |name: &str| {
            stmt.args
                .iter()
                .find(|a| a.name.as_ref().is_some_and(|n| n.name == name))
        };
        let (Some(layer), Some(set)) = (arg("layer"), arg("set")) else {
            return Err(Diagnostic::missing_argument(
                stmt.span,
                def.name,
                "layer or set",
            ));
        };
        let layer = self.static_index(layer, self.card.layers, "layer")?;
        let set = self.static_set(set)?;
        let first = self.tasks.len();
        for k in 0..n {
            let depth = self.guard.len();
            if let ExpertSet::One(expert) = set {
                self.guard.push(ir::GuardLit {
                    atom: ir::GuardAtom::Active {
                        layer,
                        expert,
                        ub: Some(k),
                    },
                    negated: false,
                });
            }
            self.group_ub = Some(k);
            let result = self.exec_op(stmt, def);
            self.group_ub = None;
            self.guard.truncate(depth);
            result?;
        }
        if self.tasks.len() > first {
            let head = TaskId::new(first);
            for task in &mut self.tasks[first..] {
                task.group = Some(head);
            }
        }
        Ok(())
    }

    /// `part = prefill | decode | all`.
    fn static_part(&mut self, arg: &ast::Arg, param: StaticParam) -> Result<AttnPart, Diagnostic> {
        match self.eval(&arg.value)? {
            Val::Word("prefill") => Ok(AttnPart::Prefill),
            Val::Word("decode") => Ok(AttnPart::Decode),
            Val::Word("all") => Ok(AttnPart::All),
            other => Err(Diagnostic::type_mismatch(
                arg.value.span,
                param.syntax(),
                other.type_name(),
            )),
        }
    }

    /// `set = all | e | a..b | expert` (a run-time expert such as `hot(l, r)`).
    fn static_set(&mut self, arg: &ast::Arg) -> Result<ExpertSet, Diagnostic> {
        let experts = self.card.experts;
        Ok(match self.eval(&arg.value)? {
            Val::Word("all") => ExpertSet::All,
            Val::Expert(e) => ExpertSet::One(e),
            Val::Range(lo, hi) => {
                let start = check_index(lo, experts, "expert", arg.value.span)? as u32;
                if hi > experts as i64 || hi <= lo {
                    return Err(Diagnostic::out_of_range(
                        arg.value.span,
                        "expert range end",
                        hi,
                        &format!("{}..={experts}", lo + 1),
                    ));
                }
                ExpertSet::Range {
                    start,
                    end: hi as u32,
                }
            }
            other => {
                let e = as_int(other, arg.value.span)?;
                ExpertSet::One(ExpertRef::Index(
                    check_index(e, experts, "expert", arg.value.span)? as u32,
                ))
            }
        })
    }
}

/// Whether every argument of an op call is named, once, with a name `def` takes: then
/// none of `exec_op`'s checks of the names can fail, whatever the values.
fn names_well_formed(stmt: &CallStmt, def: &OpDef) -> bool {
    stmt.args.iter().enumerate().all(|(k, arg)| {
        arg.name.as_ref().is_some_and(|name| {
            let once = stmt.args[..k]
                .iter()
                .all(|a| a.name.as_ref().is_none_or(|n| n.name != name.name));
            let taken = def.params.iter().any(|p| p.name() == name.name)
                || def.args.iter().any(|a| a.role.as_str() == name.name);
            once && taken
        })
    })
}

/// The role, access and optionality of each argument of `op`'s full signature.
fn op_roles_of(op: &Op, card: &crate::model::card::ModelCard) -> OpRoles {
    catalog::signature(op, card)
        .iter()
        .map(|s| RoleAccess {
            role: s.role,
            access: s.access,
            optional: s.optional,
        })
        .collect()
}
