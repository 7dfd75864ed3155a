//! Routing known before it is read: every guarded task is ordered after the gate whose
//! decisions its guard reads.
//!
//! Takes a program and its dependency graph; reports `values::routing_unknown` for each
//! guard literal `active(l, e[, u])` or `tokens(l, e[, u]) >= n` whose task has no `gate(layer = l, ub = u)` of the
//! same step among its ancestors (for `active(l, e)` without a micro-batch: a gate of
//! every micro-batch). Guarantees to lowering and the runtime: the plan's `ReadRouting`
//! instruction that follows such a gate runs before the guarded task on any backend, so a
//! guard is never decided from routing that is not on the host yet (no "unknown means
//! run" at run time). Reachability is one pass in issue order with a bitset of the step's
//! gates per task, so the cost is edges x gates / 64.

use crate::diag::Diagnostic;
use crate::ir::deps::Dag;
use crate::ir::{Op, Program, TaskId};
use std::collections::HashMap;

/// Reports guards that read routing no gate has produced before them.
pub fn check(program: &Program, dag: &Dag, diags: &mut Vec<Diagnostic>) {
    for step in &program.steps {
        let first = step.first as usize;
        let range = first..first + step.count as usize;
        let tasks = &program.tasks[range.clone()];
        if tasks.iter().all(|t| t.guard.is_always()) {
            continue;
        }
        // Bit index of each gate (layer, ub) of this step.
        let mut gate_bit: HashMap<(u32, u32), usize> = HashMap::new();
        for t in tasks {
            if let Op::Gate { layer, ub } = t.op {
                let next = gate_bit.len();
                gate_bit.entry((layer, ub)).or_insert(next);
            }
        }
        let words = gate_bit.len().div_ceil(64).max(1);
        let mut reach: Vec<Vec<u64>> = vec![vec![0; words]; tasks.len()];
        for (k, t) in tasks.iter().enumerate() {
            let id = TaskId::new(first + k);
            let mut bits = vec![0u64; words];
            for dep in dag.preds(id) {
                let Some(pk) = dep.from.index().checked_sub(first) else {
                    continue;
                };
                if let Some(pred_bits) = reach.get(pk) {
                    for (b, p) in bits.iter_mut().zip(pred_bits) {
                        *b |= p;
                    }
                }
            }
            if let Op::Gate { layer, ub } = t.op {
                if let Some(&bit) = gate_bit.get(&(layer, ub)) {
                    bits[bit / 64] |= 1 << (bit % 64);
                }
            }
            for lit in &t.guard.lits {
                let (layer, ub) = (lit.atom.layer(), lit.atom.ub());
                let ubs: Vec<u32> = match ub {
                    Some(u) => vec![u],
                    None => (0..program.micro_batches.count).collect(),
                };
                let missing: Vec<u32> = ubs
                    .into_iter()
                    .filter(|&u| {
                        gate_bit
                            .get(&(layer, u))
                            .is_none_or(|&bit| bits[bit / 64] & (1 << (bit % 64)) == 0)
                    })
                    .collect();
                if !missing.is_empty() {
                    diags.push(Diagnostic::routing_unknown(
                        program.task_span(id),
                        &program.task_name(id),
                        layer,
                        &missing,
                        step.kind.as_str(),
                    ));
                }
            }
            reach[k] = bits;
        }
    }
}
