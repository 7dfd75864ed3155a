//! What a run measured: every executed step with its micro-batch loads and task times.
//!
//! Takes nothing (the runtime's driver fills it); gives [`RunStats`], [`StepRecord`],
//! [`UbLoad`] and [`TaskRecord`], plain data that the run report, the trace writer and
//! the cost model's replay read. It sits apart from both `runtime` and `cost` so that
//! neither imports the other.

use crate::ir::{StepKind, StreamId, TaskId};

/// One executed task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TaskRecord {
    /// The task.
    pub task: TaskId,
    /// The stream.
    pub stream: StreamId,
    /// Start, seconds since the executor's origin.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
    /// False when its guard skipped it.
    pub ran: bool,
}

/// One executed step.
#[derive(Debug, Clone)]
pub struct StepRecord {
    /// The step's kind.
    pub kind: StepKind,
    /// Wall time start/end (seconds from the run's origin).
    pub start: f64,
    /// End, in the same unit and from the same origin as `start`.
    pub end: f64,
    /// Prompt tokens it processed.
    pub prefill_tokens: usize,
    /// Decode tokens it processed.
    pub decode_tokens: usize,
    /// What each micro-batch held (indexed by ub; empty for `setup`).
    pub ubs: Vec<UbLoad>,
    /// Its tasks.
    pub tasks: Vec<TaskRecord>,
}

/// The real contents of one micro-batch in one executed step: what the cost model needs
/// to predict the same step (the compiled program assumes its declared worst case).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UbLoad {
    /// Sequences running their prompt (or a re-prefill after preemption).
    pub prefill_seqs: usize,
    /// Their new tokens.
    pub prefill_tokens: usize,
    /// Sequences decoding one token.
    pub decode_seqs: usize,
    /// Sum over decoding sequences of the tokens they attend to (cached + the new one).
    pub decode_context: usize,
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Every step in order.
    pub steps: Vec<StepRecord>,
    /// Whole run, seconds.
    pub wall: f64,
    /// Whether the pinned arena was page-locked.
    pub pinned_locked: bool,
    /// Bytes of the gpu, pinned and host arenas, and of the weights image.
    pub arena_bytes: [u64; 3],
    /// Bytes of the weights image.
    pub image_bytes: u64,
    /// Sequences preempted because KV blocks ran out (mixed steps; each is prefilled again).
    pub preemptions: usize,
    /// Sequence-passes skipped waiting for KV blocks (mixed steps).
    pub paused: usize,
}
