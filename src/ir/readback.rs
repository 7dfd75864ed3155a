//! Which gates' routing the host needs back: the rule lowering follows to emit
//! `ReadRouting` and the cost model follows to charge it.
//!
//! Takes a program; gives, per task, whether it is a `gate` whose decisions a guard or
//! `hot(..)` reads on the host. Guards name a layer (and a micro-batch, or any); `hot(..)`
//! ranks experts from the routing of every layer (its predictor learns from all of
//! them), so a program that uses `hot` reads every gate back. A `pregate` (lookahead
//! gating) exists only to be read by a predictor, so every one is read back.

use super::{ExpertRef, ExpertSet, Op, Program};

/// Per task: true for a gate whose routing the host reads back.
pub fn readback_gates(program: &Program) -> Vec<bool> {
    let mut every_gate = false;
    let mut guarded: super::FastSet<(u32, Option<u32>)> = super::FastSet::default();
    let is_hot = |e: ExpertRef| matches!(e, ExpertRef::Hot { .. });
    for task in &program.tasks {
        for lit in &task.guard.lits {
            if lit.atom.reads_routing() {
                guarded.insert((lit.atom.layer(), lit.atom.ub()));
            }
            every_gate |= is_hot(lit.atom.expert());
        }
        every_gate |= task
            .args
            .iter()
            .any(|a| a.slice.dynamic_expert.is_some_and(is_hot));
        if let Op::Experts {
            set: ExpertSet::One(e),
            ..
        } = task.op
        {
            every_gate |= is_hot(e);
        }
    }
    program
        .tasks
        .iter()
        .map(|t| match t.op {
            Op::Gate { layer, ub } => {
                every_gate
                    || guarded.contains(&(layer, Some(ub)))
                    || guarded.contains(&(layer, None))
            }
            Op::Pregate { .. } => true,
            _ => false,
        })
        .collect()
}
