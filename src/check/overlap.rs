//! Argument aliasing: no task writes bytes that another of its own arguments also touches.
//!
//! Takes a program; gives `structure::overlap` diagnostics. Invariant checked, per task
//! (copies included: source and destination): for every argument the task writes, every
//! other argument lies in another buffer or in disjoint bytes of the same buffer. A slice
//! of a run-time chosen expert is taken to cover every expert slot it may name. This is
//! what lets a backend hand a task one mutable view per written argument and shared views
//! of the rest (the runtime's `unsafe fn bytes_mut` relies on it).

use crate::diag::Diagnostic;
use crate::ir::{Arg, Program, TaskId};

/// The bytes an argument may touch: `[start, end)`.
fn extent(program: &Program, arg: &Arg) -> (u64, u64) {
    let slice = &arg.slice;
    match slice.dynamic_expert {
        Some(_) => {
            let experts = program.model.experts.max(1);
            (
                slice.start,
                slice
                    .start
                    .saturating_add(slice.len.saturating_mul(experts)),
            )
        }
        None => (slice.start, slice.end()),
    }
}

/// Reports every pair (written argument, other argument) of a task that overlaps.
pub fn check(program: &Program, diags: &mut Vec<crate::diag::Diagnostic>) {
    for (index, task) in program.tasks.iter().enumerate() {
        let id = TaskId::new(index);
        let spans = program.spans.task_args.get(index);
        let span_of = |k: usize| {
            spans
                .and_then(|s| s.get(k))
                .copied()
                .unwrap_or_else(|| program.task_span(id))
        };
        for (w, written) in task.args.iter().enumerate() {
            if !written.access.writes() {
                continue;
            }
            let (w_lo, w_hi) = extent(program, written);
            for (o, other) in task.args.iter().enumerate() {
                // Each pair once: skip the other written argument's own turn.
                if o == w || (other.access.writes() && o < w) {
                    continue;
                }
                if other.slice.buffer != written.slice.buffer {
                    continue;
                }
                let (o_lo, o_hi) = extent(program, other);
                if w_lo < o_hi && o_lo < w_hi {
                    diags.push(Diagnostic::overlapping_arguments(
                        span_of(w),
                        span_of(o),
                        &program.task_name(id),
                        &program.buffer(written.slice.buffer).name,
                        (w_lo, w_hi),
                        (o_lo, o_hi),
                        other.access.writes(),
                    ));
                }
            }
        }
    }
}
