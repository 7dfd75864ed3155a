//! The step a task runs in, as every backend sees it: which sequences each micro-batch
//! holds, how run-time expert references resolve, the routing the plan read back, the
//! sampler, and where a task hands back what the host keeps (sampled tokens, their
//! logits, the experts a routing reached).
//!
//! Takes nothing; gives the plain micro-batch contents ([`MicroBatchState`], [`SeqSlot`]),
//! the [`StepContext`] trait a backend's ops read the step through, and the watched sleep
//! ([`sleep_in_step`]) a long wait inside a task uses. The driver owns the step's real
//! state (expert caches, predictors, the event table) and implements [`StepContext`] over
//! it, so a backend sees the step's control data without seeing the driver: the interface
//! (`runtime::backend`) and the backends name this module, never the driver.

use crate::ir::{ExpertRef, TaskId};
use crate::lower::PlanArg;
use crate::model::vocab::Routing;
use crate::model::vocab::Sampling;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One sequence's part of a micro-batch in one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSlot {
    /// Index of the request (prompt) this sequence answers.
    pub request: usize,
    /// Tokens already in its KV cache.
    pub context_len: usize,
    /// New tokens this step runs (the prompt, or the last sampled token).
    pub new_tokens: Vec<u32>,
    /// Its blocks in the micro-batch's KV cache slice (same ids in every layer).
    pub block_table: Vec<u32>,
    /// True while its prompt is being run (selects `attn(part = prefill)`).
    pub prefill: bool,
}

/// A micro-batch's sequences in one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MicroBatchState {
    /// Sequences, in row order.
    pub seqs: Vec<SeqSlot>,
    /// Tokens per KV block in this micro-batch's cache slices.
    pub block_size: usize,
}

impl MicroBatchState {
    /// New tokens in the step.
    pub fn n_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.new_tokens.len()).sum()
    }

    /// Token ids in row order.
    pub fn token_ids(&self) -> Vec<u32> {
        self.seqs
            .iter()
            .flat_map(|s| s.new_tokens.iter().copied())
            .collect()
    }

    /// Positions in row order.
    pub fn positions(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .flat_map(|s| (0..s.new_tokens.len()).map(move |j| s.context_len + j))
            .collect()
    }
}

/// What a task reads of its step besides its buffers, and where it hands back what the
/// host keeps. Called from stream threads while the step runs: every method takes
/// `&self` and an implementation locks only for a lookup or an insert.
pub trait StepContext: Sync + std::fmt::Debug {
    /// Micro-batch `ub`'s sequences this step (`None`: not a micro-batch of the plan).
    fn micro_batch(&self, ub: u32) -> Option<&MicroBatchState>;

    /// The expert a reference of an op's expert set names this step (hot order and
    /// predictions are decided by the driver; an index is itself).
    fn resolve_expert(&self, expert: ExpertRef, experts: u32) -> u32;

    /// The multiple of an argument's length to add to its start: the resolved expert of a
    /// run-time expert slice, or the slot of a cache slot (its fetch's binding); `None`
    /// for a static argument.
    fn arg_index(&self, task: TaskId, arg: &PlanArg, experts: u32) -> Option<u32>;

    /// The routing of (layer, ub) when the plan read it back this step (`ReadRouting`).
    fn read_back_routing(&self, layer: u32, ub: u32) -> Option<Routing>;

    /// The run's sampling rule.
    fn sampling(&self) -> &Sampling;

    /// The token of each sequence of `mb` from its row of `logits` (`[seqs, vocab]`): the
    /// run's sampler with each request's own generator. Every backend samples through
    /// this, so their tokens come from one rule.
    fn sample_rows(&self, mb: &MicroBatchState, logits: &[f32], vocab: usize) -> Vec<u32>;

    /// Hands the step the tokens `sample` chose for `ub`'s sequences (row order).
    fn put_sampled(&self, ub: u32, tokens: Vec<u32>);

    /// Whether `sample` should also hand back the logits it sampled from.
    fn wants_logits(&self) -> bool;

    /// Hands the step the logits `sample` read for `ub` (`[seqs, vocab]`, row order).
    fn put_logits(&self, ub: u32, logits: Vec<f32>);

    /// Notes the distinct experts a routing computed for (layer, ub) reached (a
    /// measurement for the run record and the replay; no decision reads it).
    fn note_active_experts(&self, layer: u32, ub: u32, routing: &Routing, experts: usize);
}

thread_local! {
    /// The step this stream thread runs (set by the executor for the thread's lifetime
    /// through [`watch_step`]), so a long wait inside a task (the CPU backend's link
    /// throttle) ends once the step is abandoned, and is itself bounded by the watchdog,
    /// instead of holding up the join.
    static STEP: RefCell<Option<StepWatch>> = const { RefCell::new(None) };
}

/// What a wait inside a task needs to know of its step.
#[derive(Clone)]
struct StepWatch {
    aborted: Arc<AtomicBool>,
    watchdog: Duration,
}

/// Marks the calling thread as a stream thread of a step until dropped: [`sleep_in_step`]
/// on it then watches `aborted` and `watchdog`.
pub struct StepWatchGuard(());

impl Drop for StepWatchGuard {
    fn drop(&mut self) {
        STEP.with(|w| *w.borrow_mut() = None);
    }
}

/// Makes the calling thread a stream thread of a step whose abort flag is `aborted` and
/// whose watchdog is `watchdog`, until the guard is dropped.
pub fn watch_step(aborted: Arc<AtomicBool>, watchdog: Duration) -> StepWatchGuard {
    STEP.with(|w| *w.borrow_mut() = Some(StepWatch { aborted, watchdog }));
    StepWatchGuard(())
}

/// Why [`sleep_in_step`] returned before sleeping the whole time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SleepCut {
    /// The step was aborted (a task failed or a waiting stream's watchdog fired).
    Aborted,
    /// The sleep alone would have outlasted the watchdog: it slept that long, no longer.
    Watchdog(Duration),
}

/// Sleeps for `duration` in short slices inside a task on a stream thread, returning
/// early once the step is aborted, and never longer than the watchdog (a task that
/// sleeps past it would otherwise hold up the whole run with nobody waiting to notice).
/// Off a stream thread it simply sleeps.
pub fn sleep_in_step(duration: Duration) -> Result<(), SleepCut> {
    const SLICE: Duration = Duration::from_millis(20);
    let watch = STEP.with(|w| w.borrow().clone());
    let limit = watch
        .as_ref()
        .map_or(duration, |w| duration.min(w.watchdog));
    let until = Instant::now() + limit;
    loop {
        if watch
            .as_ref()
            .is_some_and(|w| w.aborted.load(Ordering::Relaxed))
        {
            return Err(SleepCut::Aborted);
        }
        let now = Instant::now();
        if now >= until {
            return match watch {
                Some(w) if duration > w.watchdog => Err(SleepCut::Watchdog(w.watchdog)),
                _ => Ok(()),
            };
        }
        std::thread::sleep((until - now).min(SLICE));
    }
}
