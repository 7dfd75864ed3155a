//! The tables a planner's point leaves behind, kept per thread for its next point.
//!
//! A search elaborates, scores and drops programs of up to a million tasks, one after
//! another on each thread. Their task tables are the largest allocations (hundreds of
//! megabytes), which the allocator maps fresh for each program and unmaps when it is
//! dropped, so each point faulted them in again and the kernel zeroed every page
//! (`clear_page_erms`, the largest symbol of the DeepSeek-V3 plan's profile). A program
//! wrapped in [`Recycled`] hands its task table, its per-task span tables and its label
//! list back, emptied with their capacity kept, when it is dropped; the next lean
//! elaboration (`Options::task_names` false: a planner's point) on the same thread starts
//! from them. Only capacity is shared: every table starts empty, so the program is the one
//! a fresh elaboration gives.

use crate::ir::{Program, Task, TaskId};
use crate::span::Span;
use std::cell::RefCell;

/// The tables kept for the next lean elaboration on this thread.
#[derive(Default)]
pub(super) struct Spare {
    pub tasks: Vec<Task>,
    pub task_spans: Vec<Span>,
    pub task_args: Vec<Vec<Span>>,
    pub task_streams: Vec<Span>,
    pub task_after: Vec<Vec<Span>>,
    pub labels: Vec<((u64, u64), TaskId)>,
}

thread_local! {
    static SPARE: RefCell<Spare> = RefCell::new(Spare::default());
}

/// This thread's spare tables (empty ones when none are kept).
pub(super) fn take() -> Spare {
    SPARE
        .try_with(|spare| std::mem::take(&mut *spare.borrow_mut()))
        .unwrap_or_default()
}

/// Keeps `table` emptied in `slot` when it holds more than what is kept there.
fn keep<T>(slot: &mut Vec<T>, mut table: Vec<T>) {
    if table.capacity() > slot.capacity() {
        table.clear();
        *slot = table;
    }
}

/// Keeps a label list for the next lean elaboration on this thread.
pub(super) fn keep_labels(list: Vec<((u64, u64), TaskId)>) {
    // A thread being torn down keeps nothing.
    let _ = SPARE.try_with(|spare| keep(&mut spare.borrow_mut().labels, list));
}

/// A planner's point's program: when dropped, its task and span tables go back to this
/// thread's spare for the next point (see the module's header). Reads as the program.
pub struct Recycled(Program);

impl Recycled {
    /// Wraps `program`.
    pub fn new(program: Program) -> Self {
        Recycled(program)
    }
}

impl std::ops::Deref for Recycled {
    type Target = Program;
    fn deref(&self) -> &Program {
        &self.0
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let program = &mut self.0;
        let tasks = std::mem::take(&mut program.tasks);
        let spans = &mut program.spans;
        let task_spans = std::mem::take(&mut spans.tasks);
        let task_args = std::mem::take(&mut spans.task_args);
        let task_streams = std::mem::take(&mut spans.task_streams);
        let task_after = std::mem::take(&mut spans.task_after);
        // A thread being torn down keeps nothing.
        let _ = SPARE.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            keep(&mut spare.tasks, tasks);
            keep(&mut spare.task_spans, task_spans);
            keep(&mut spare.task_args, task_args);
            keep(&mut spare.task_streams, task_streams);
            keep(&mut spare.task_after, task_after);
        });
    }
}
