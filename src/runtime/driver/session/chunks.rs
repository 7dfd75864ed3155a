//! Which plans can prefill a prompt over several passes: those whose prefill attends the
//! KV cache their decode reads (prefix reuse and chunked prefill both need it).

use crate::ir::StepKind;
use crate::lower::ExecPlan;

/// Whether `plan` can prefill a prompt in chunks over several passes: its prefill step
/// (or its mixed step) attends the same KV cache its decode reads, so a chunk sees the
/// tokens the chunks before it wrote ([`super::Session::on_demand_kv`]).
pub fn prefills_in_chunks(plan: &ExecPlan) -> bool {
    let step = |k: StepKind| plan.steps.iter().position(|s| s.kind == k);
    match (
        step(StepKind::Prefill),
        step(StepKind::Decode),
        step(StepKind::Mixed),
    ) {
        (Some(p), Some(d), _) => prefill_attends_decode_cache(plan, p, d),
        (_, _, Some(m)) => prefill_attends_decode_cache(plan, m, m),
        _ => false,
    }
}

/// Whether every attention of the prefill step reads and writes a KV cache slice that an
/// attention of the decode step uses too (the same step for mixed plans): then a prefill
/// row can attend positions an earlier sequence wrote, which prefix reuse needs. A plan
/// that prefills into a separate cache (CGOPipe's GPU lines, copied to the host cache
/// after) or into none cannot take a cached prefix.
pub(super) fn prefill_attends_decode_cache(plan: &ExecPlan, prefill: usize, decode: usize) -> bool {
    use crate::ir::{Op, Role};
    let kv_args = |step: usize| -> Option<Vec<(crate::ir::BufferId, u64, u64)>> {
        let s = plan.steps.get(step)?;
        let mut args = Vec::new();
        for task in plan
            .tasks
            .get(s.first as usize..(s.first + s.count) as usize)?
        {
            if !matches!(task.op, Op::Attn { .. }) {
                continue;
            }
            let kv: Vec<_> = task
                .args
                .iter()
                .filter(|a| a.role == Role::Kv)
                .map(|a| (a.buffer, a.start, a.len))
                .collect();
            if kv.is_empty() {
                return None;
            }
            args.extend(kv);
        }
        Some(args)
    };
    if prefill == decode {
        return kv_args(prefill).is_some_and(|a| !a.is_empty());
    }
    match (kv_args(prefill), kv_args(decode)) {
        (Some(p), Some(d)) => !p.is_empty() && p.iter().all(|a| d.contains(a)),
        _ => false,
    }
}
