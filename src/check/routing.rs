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
//!
//! The same pass proves lookahead predictions known before they are read: a `prefetch`
//! naming `CACHE.predicted(l, ..)` of a cache whose predictor is `lookahead` must have a
//! `pregate(layer = l, ub = u)` of every micro-batch `u` among its ancestors, else
//! `cache::unpredicted` (the runtime would rank from a routing not read back yet).

use crate::diag::Diagnostic;
use crate::ir::cache::Predictor;
use crate::ir::catalog::ExpertRef;
use crate::ir::deps::Dag;
use crate::ir::{Op, Program, TaskId};
use std::collections::HashMap;

/// Reports guards that read routing no gate has produced before them.
pub fn check(program: &Program, dag: &Dag, diags: &mut Vec<Diagnostic>) {
    for step in &program.steps {
        let first = step.first as usize;
        let range = first..first + step.count as usize;
        let tasks = &program.tasks[range.clone()];
        if tasks
            .iter()
            .all(|t| t.guard.is_always() && lookahead_layer(program, t).is_none())
        {
            continue;
        }
        // Bit index of each gate (layer, ub) of this step (`pregate`s: `true`).
        let mut gate_bit: HashMap<(bool, u32, u32), usize> = HashMap::new();
        for t in tasks {
            let key = match t.op {
                Op::Gate { layer, ub } => (false, layer, ub),
                Op::Pregate { layer, ub } => (true, layer, ub),
                _ => continue,
            };
            let next = gate_bit.len();
            gate_bit.entry(key).or_insert(next);
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
            let produced = match t.op {
                Op::Gate { layer, ub } => Some((false, layer, ub)),
                Op::Pregate { layer, ub } => Some((true, layer, ub)),
                _ => None,
            };
            if let Some(&bit) = produced.and_then(|key| gate_bit.get(&key)) {
                bits[bit / 64] |= 1 << (bit % 64);
            }
            let known = |key: (bool, u32, u32)| {
                gate_bit
                    .get(&key)
                    .is_some_and(|&bit| bits[bit / 64] & (1 << (bit % 64)) != 0)
            };
            if let Some(layer) = lookahead_layer(program, t) {
                let missing: Vec<u32> = (0..program.micro_batches.count)
                    .filter(|&u| !known((true, layer, u)))
                    .collect();
                if !missing.is_empty() {
                    diags.push(Diagnostic::unpredicted(
                        program.task_span(id),
                        &program.task_name(id),
                        layer,
                        &missing,
                        step.kind.as_str(),
                    ));
                }
            }
            // A cache residency reads no routing (`cache::stale_guard` orders it instead).
            for lit in t.guard.lits.iter().filter(|l| l.atom.reads_routing()) {
                let (layer, ub) = (lit.atom.layer(), lit.atom.ub());
                let ubs: Vec<u32> = match ub {
                    Some(u) => vec![u],
                    None => (0..program.micro_batches.count).collect(),
                };
                let missing: Vec<u32> = ubs
                    .into_iter()
                    .filter(|&u| !known((false, layer, u)))
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

/// The layer a task's `predicted(..)` expert of a `lookahead` cache names, if it names one.
fn lookahead_layer(program: &Program, task: &crate::ir::Task) -> Option<u32> {
    task.args.iter().find_map(|a| {
        let key = a.slice.cache_key?;
        let ExpertRef::Predicted { cache, layer, .. } = key.expert else {
            return None;
        };
        let c = program.caches.get(cache as usize)?;
        (c.predictor == Predictor::Lookahead).then_some(layer)
    })
}
