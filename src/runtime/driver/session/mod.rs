//! A long-lived run: sequences are submitted while the plan runs, each with its own
//! generation length, sampling rule and seed, and leave when they stop, are cancelled, or
//! the session ends.
//!
//! [`Session`] holds what a run keeps across steps (step state, KV pools, the waiting
//! queue, the running sequences, the records) and advances one step per
//! [`Session::step`], handing back what each sequence produced as [`SeqEvent`]s. A plan
//! with a mixed `step` (VSLPipe) admits waiting sequences before every pass (the
//! `scheduler`'s FIFO admission, with preemption when KV blocks run out); a plan with
//! `prefill` + `decode` takes the waiting sequences at each batch boundary, when the
//! previous batch has finished (`batching::admit`, longest first, up to each micro-batch's
//! sequences, tokens and KV; a serving session with chunked prefill admits at every pass,
//! [`Session::on_demand_kv`]). Budgets are those the plan was compiled for: every
//! reservation is for the session's `gen_len` (the most any sequence may generate), so a
//! sequence asking for fewer tokens only stops earlier. [`generate`](super::generate)
//! submits a fixed list and steps to the end; [`super::serving::serve`] feeds a session
//! from a channel.

use super::batching::{admit, block_size, UbCapacity};
use super::executor::ExecError;
use super::scheduler::{admit_fifo, grow_decoding, KvPool, Pending, Seq};
use super::state::{lock, HotPredictor, MicroBatchState, SeqSlot, StepState, TokenConstraint};
use super::{cache, capacities, check_prompts, count_active_experts, eam, record_activations};
use super::{RunError, RunOptions, StepRunner};
use crate::ir::StepKind;
use crate::lower::ExecPlan;
use crate::model::vocab::Routing;
use crate::model::vocab::Sampling;
use crate::records::run::PredictionReport;
use crate::records::{GraphStep, RunStats, StepRecord, UbLoad};
use crate::rng::Rng;
use crate::runtime::backend::Backend;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

mod ahead;
mod chunks;
use ahead::Ahead;
use chunks::prefill_attends_decode_cache;
pub use chunks::prefills_in_chunks;

/// A sequence's id within its session (reused once the sequence has ended).
pub type SeqId = usize;

/// One sequence to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at most the session's `gen_len`).
    pub max_new_tokens: usize,
    /// Greedy or temperature/top-p.
    pub sampling: Sampling,
    /// The seed of this sequence's sampler (`generate` gives prompt `i` the oracle's
    /// stream `i`).
    pub seed: u64,
    /// Stop at the card's EOS token.
    pub stop_at_eos: bool,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqEnd {
    /// It sampled the card's EOS token (included in its tokens).
    Eos,
    /// It generated its `max_new_tokens`.
    Length,
    /// It was cancelled (its client went away, a stop string matched, the session shut
    /// down).
    Cancelled,
}

/// What a step produced for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// A new token.
    Token {
        /// The sequence.
        id: SeqId,
        /// The token.
        token: u32,
    },
    /// The sequence ended; its id is free again after this event.
    Done {
        /// The sequence.
        id: SeqId,
        /// Why.
        end: SeqEnd,
        /// Every token it generated.
        token_ids: Vec<u32>,
        /// With `RunOptions::capture_logits`: the logits its last token was sampled from.
        logits: Option<Vec<f32>>,
    },
}

/// Why a sequence was refused at submission (the session goes on).
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The prompt is empty, runs past the model's positions, or fits no micro-batch.
    #[error(transparent)]
    Prompt(RunError),
    /// More tokens asked for than the plan was compiled for.
    #[error("max_new_tokens {asked} is more than the {gen_len} tokens this session's plan was compiled for")]
    TooManyTokens {
        /// Asked for.
        asked: usize,
        /// The session's generation length.
        gen_len: usize,
    },
}

/// Live counts of a session, readable from any thread while it runs (a server's
/// `/metrics`).
#[derive(Debug, Default)]
pub struct Gauges {
    /// Sequences waiting for admission.
    pub waiting: AtomicU64,
    /// Sequences admitted and not ended.
    pub running: AtomicU64,
    /// Tokens generated since the session began.
    pub generated_tokens: AtomicU64,
    /// Prompt tokens prefilled since the session began (re-prefills included).
    pub prefill_tokens: AtomicU64,
    /// Steps run (setup excluded).
    pub steps: AtomicU64,
    /// Seconds of the last step, as `f64` bits.
    pub last_step_seconds: AtomicU64,
    /// Seconds of all steps, as `f64` bits.
    pub step_seconds_total: AtomicU64,
    /// KV blocks held by running sequences.
    pub kv_blocks_used: AtomicU64,
    /// KV blocks in all micro-batches' pools (a plan of static batches sizes its blocks
    /// per batch, so this can change between batches).
    pub kv_blocks_total: AtomicU64,
    /// KV blocks free in all micro-batches' pools (idle cached blocks included: they are
    /// given out when needed).
    pub kv_blocks_free: AtomicU64,
    /// Tokens per KV block (the largest over the micro-batches' pools).
    pub kv_block_tokens: AtomicU64,
    /// Of the free blocks, those that hold a cached prefix.
    pub kv_blocks_cached: AtomicU64,
    /// Sequences admitted that took blocks from the prefix cache.
    pub prefix_hits: AtomicU64,
    /// Tokens admitted sequences took from the prefix cache instead of running them.
    pub prefix_cached_tokens: AtomicU64,
    /// Tokens of every admitted sequence (what a prefix cache could have held).
    pub prefix_queried_tokens: AtomicU64,
    /// The most KV blocks running sequences held at once since the session began.
    pub kv_blocks_used_peak: AtomicU64,
    /// Sequences preempted since the session began.
    pub preemptions: AtomicU64,
    /// Sequences cancelled since the session began.
    pub cancelled: AtomicU64,
    /// Bytes of the plan's gpu, pinned and host arenas (fixed for the session).
    pub arena_bytes: [AtomicU64; 3],
}

impl Gauges {
    /// Reads an `f64` gauge.
    pub fn seconds(gauge: &AtomicU64) -> f64 {
        f64::from_bits(gauge.load(Ordering::Relaxed))
    }
}

/// Per-slot bookkeeping of a submitted sequence.
#[derive(Debug, Clone)]
struct Live {
    prompt: Vec<u32>,
    max_new_tokens: usize,
    sampling: Sampling,
    stop_at_eos: bool,
    logits: Option<Vec<f32>>,
}

/// A sequence's sampler state kept aside over a pass that runs a chunk of its prompt:
/// request, generator, constraint.
type HeldSampler = (usize, Option<Rng>, Option<Box<dyn TokenConstraint>>);

/// A run that takes sequences while it runs (see the module doc).
pub struct Session<'a, B: Backend + ?Sized> {
    plan: &'a ExecPlan,
    backend: &'a B,
    options: &'a RunOptions,
    state: StepState,
    /// Most tokens any sequence generates: every KV reservation is for this many.
    gen_len: usize,
    prefill_step: usize,
    decode_step: usize,
    mixed: bool,
    prefill_caps: Vec<UbCapacity>,
    max_prefill: usize,
    pools: Vec<KvPool>,
    /// Slots by sequence id; `None` is free.
    slots: Vec<Option<Live>>,
    /// Prompt length per slot (what the scheduler reads), 0 for a free slot.
    lens: Vec<usize>,
    waiting: VecDeque<Pending>,
    running: Vec<Seq>,
    next_age: u64,
    kill_count: AtomicU32,
    origin: Instant,
    setup_done: bool,
    /// Keep every step's record in the stats (`generate`); a long-lived server does not.
    record_steps: bool,
    /// Static batches also take KV blocks as they grow, from pools kept for the session,
    /// and reserve nothing for tokens not yet generated ([`Session::on_demand_kv`]).
    on_demand: bool,
    /// A prompt longer than a pass's token room is prefilled in chunks over several passes
    /// (each chunk attends the cache the earlier ones wrote): set with the prefix cache,
    /// where the prefill attends the decode's KV cache ([`Session::on_demand_kv`]).
    chunked_prefill: bool,
    /// With chunked prefill: the most prompt tokens one pass prefills over all its
    /// sequences ([`Session::set_prefill_budget`]; `usize::MAX`: what the pass has room for).
    prefill_budget: usize,
    stats: RunStats,
    gauges: Arc<Gauges>,
    /// A decode step launched before the previous step's tokens were read (async
    /// scheduling), not collected yet.
    ahead: Option<Ahead>,
}

impl<'a, B: Backend + ?Sized> Session<'a, B> {
    /// A session over `plan` on `backend` in which sequences generate at most `gen_len`
    /// tokens and prompts are at most `longest_prompt` tokens (or the plan's `prompt_len`,
    /// whichever is larger): the KV block size is chosen for them.
    pub fn new(
        plan: &'a ExecPlan,
        backend: &'a B,
        options: &'a RunOptions,
        gen_len: usize,
        longest_prompt: usize,
    ) -> Result<Self, RunError> {
        let step_idx = |k: StepKind| plan.steps.iter().position(|s| s.kind == k);
        let (prefill_step, decode_step, mixed) = match (
            step_idx(StepKind::Prefill),
            step_idx(StepKind::Decode),
            step_idx(StepKind::Mixed),
        ) {
            (Some(p), Some(d), _) => (p, d, false),
            (_, _, Some(m)) => (m, m, true),
            _ => return Err(RunError::Steps(plan.name.clone())),
        };
        let card = &plan.model;
        let n_ubs = plan.micro_batches.count as usize;
        let mut state = StepState::new(n_ubs, options.sampling, Vec::new());
        state.capture_logits = options.capture_logits;
        state.predictor = HotPredictor::new(card.layers as usize, card.experts as usize);
        state.caches = plan
            .caches
            .iter()
            .map(|c| cache::CacheRuntime::new(c.clone(), card.layers as usize))
            .collect();
        {
            let mut eam = eam::Eam::new(
                card.layers as usize,
                card.experts as usize,
                eam::DEFAULT_CAPACITY,
            );
            eam.seed(&options.eam_seed);
            *lock(&state.eam) = eam;
        }
        let prefill_caps = capacities(plan, prefill_step);
        // Static batches: pools reset when a batch starts, each sequence reserves its whole
        // generation (Alg. 2). Mixed steps: pools fixed for the run, blocks given as
        // sequences grow, preemption when they run out (`scheduler`).
        let longest = (plan.workload.prompt_len as usize).max(longest_prompt) + gen_len;
        let pools: Vec<KvPool> = prefill_caps
            .iter()
            .map(|c| {
                KvPool::new(
                    c.kv_tokens,
                    block_size(c.kv_tokens, &[longest]).unwrap_or(1),
                )
            })
            .collect();
        let max_prefill = prefill_caps.iter().map(|c| c.tokens).max().unwrap_or(0);
        let memory = backend.memory();
        let stats = RunStats {
            pinned_locked: memory.pinned_locked,
            arena_bytes: memory.arena_bytes,
            image_bytes: memory.image_bytes,
            image_populated: memory.populated,
            image_tiled: memory.tiled,
            backend: backend.describe(),
            ..RunStats::default()
        };
        let gauges = Arc::new(Gauges::default());
        for (gauge, bytes) in gauges.arena_bytes.iter().zip(memory.arena_bytes) {
            gauge.store(bytes, Ordering::Relaxed);
        }
        let total_blocks: u64 = pools.iter().map(|p| p.total as u64).sum();
        gauges
            .kv_blocks_total
            .store(total_blocks, Ordering::Relaxed);
        gauges.kv_blocks_free.store(total_blocks, Ordering::Relaxed);
        Ok(Session {
            plan,
            backend,
            options,
            state,
            gen_len,
            prefill_step,
            decode_step,
            mixed,
            prefill_caps,
            max_prefill,
            pools,
            slots: Vec::new(),
            lens: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_age: 0,
            kill_count: AtomicU32::new(0),
            origin: Instant::now(),
            setup_done: false,
            record_steps: true,
            on_demand: false,
            chunked_prefill: false,
            prefill_budget: usize::MAX,
            stats,
            gauges,
            ahead: None,
        })
    }

    /// Keeps no per-step records (a long-lived session would grow without bound); the
    /// gauges still count.
    pub fn without_step_records(mut self) -> Self {
        self.record_steps = false;
        self
    }

    /// Serving: KV blocks are given as every sequence grows (static batches too), so
    /// `gen_len` bounds a sequence without reserving blocks for it, and a sequence is
    /// admitted only if its pool can hold it to its own `max_new_tokens`. Mixed steps admit
    /// by free blocks and preempt by recompute when a pool runs out; a static batch, which
    /// takes a preempted sequence back only once it has ended, admits only what its pool
    /// can hold to the end at once, so it never preempts. Where the plan's prefill attends the same
    /// KV cache as its decode, the pools keep a prefix cache (see `scheduler`): whole
    /// blocks of tokens already run are shared by the sequences that start with them.
    /// The same plans prefill a prompt longer than a pass's token room in chunks (the
    /// pass's activations stay within what the plan was compiled for; the rest of the
    /// prompt waits for the next pass while the other sequences decode), so a prompt is
    /// bounded by its pool's KV blocks and the card's positions only; and a `prefill` +
    /// `decode` plan among them admits at every pass, not only into an empty plan (its
    /// prefill pass runs the decoding sequences' next tokens as one-token chunks), so a
    /// request does not wait for the batch before it to end.
    /// Returns whether the prefix cache is on.
    pub fn on_demand_kv(&mut self) -> bool {
        self.on_demand = true;
        let prefix = prefill_attends_decode_cache(self.plan, self.prefill_step, self.decode_step);
        self.chunked_prefill = prefix;
        if prefix {
            for pool in &mut self.pools {
                *pool =
                    KvPool::new(pool.total * pool.block_size, pool.block_size).with_prefix_cache();
            }
        }
        self.update_gauges();
        prefix
    }

    /// With chunked prefill (see [`Session::on_demand_kv`]): a pass that runs more than one
    /// sequence prefills at most `tokens` prompt tokens over all of them (at least 1; a
    /// lone prompt takes what the pass has room for), oldest first; the rest
    /// of a prompt, and the prompts that got none, wait for the next pass while the
    /// decoding sequences go on. A pass's time grows with its tokens, so a budget near a few
    /// prompts' worth gives the first of several prompts that arrive together their first
    /// token after a short pass instead of after one pass over all of them, and bounds how
    /// long a decoding stream waits for a prefill. Without chunked prefill it has no effect.
    pub fn set_prefill_budget(&mut self, tokens: usize) {
        self.prefill_budget = tokens.max(1);
    }

    /// The live counts.
    pub fn gauges(&self) -> Arc<Gauges> {
        Arc::clone(&self.gauges)
    }

    /// Most tokens a sequence may generate.
    pub fn gen_len(&self) -> usize {
        self.gen_len
    }

    /// Sequences waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and not ended.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// For a plan of static batches about to start a new batch that still has room: how
    /// many more sequences it could take (`None` for mixed steps, a running batch, an empty
    /// queue or a full batch).
    pub fn batch_room(&self) -> Option<usize> {
        if !self.static_batches() || !self.running.is_empty() || self.waiting.is_empty() {
            return None;
        }
        let seats: usize = self.prefill_caps.iter().map(|c| c.seqs).sum();
        seats.checked_sub(self.waiting.len()).filter(|&r| r > 0)
    }

    /// True for a plan of static batches (`prefill` + `decode`), which takes new sequences
    /// only between batches; false for mixed steps and, with chunked prefill, for
    /// `prefill` + `decode` plans too, which then admit at every pass.
    pub fn static_batches(&self) -> bool {
        !self.mixed && !self.chunked_prefill
    }

    /// No sequence waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// With `RunOptions::capture_logits`: the logits sequence `id`'s latest token was
    /// sampled from, while it runs (its [`SeqEvent::Done`] carries the last ones). Read
    /// after each [`Session::step`], it gives every position's next-token distribution
    /// (the KL-divergence bounds of lossy schedules compare them with the oracle's).
    pub fn latest_logits(&self, id: SeqId) -> Option<&[f32]> {
        self.slots
            .get(id)
            .and_then(Option::as_ref)
            .and_then(|live| live.logits.as_deref())
    }

    /// Refuses what can never run (empty, past the model's positions, too many tokens,
    /// fits no micro-batch); otherwise queues the sequence for the next admission.
    pub fn submit(&mut self, request: SeqRequest) -> Result<SeqId, SubmitError> {
        let len = request.prompt.len();
        if request.max_new_tokens > self.gen_len {
            return Err(SubmitError::TooManyTokens {
                asked: request.max_new_tokens,
                gen_len: self.gen_len,
            });
        }
        let index = self
            .slots
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.slots.len());
        // On demand nothing is reserved for tokens a sequence may not generate: it is
        // bounded by its own `max_new_tokens`.
        let gen_len = if self.on_demand {
            request.max_new_tokens
        } else {
            self.gen_len
        };
        check_prompts(
            &self.plan.model,
            std::slice::from_ref(&request.prompt),
            gen_len,
        )
        .map_err(|e| SubmitError::Prompt(renumber(e, index)))?;
        let chunked = self.chunked_prefill;
        let fits = self.prefill_caps.iter().any(|c| {
            c.seqs > 0
                && (chunked || len <= c.tokens)
                && block_size(c.kv_tokens, &[len + gen_len]).is_some()
        });
        if !fits {
            return Err(SubmitError::Prompt(RunError::PromptTooLarge {
                index,
                tokens: len,
                gen_len,
                max_tokens: self
                    .prefill_caps
                    .iter()
                    .map(|c| c.tokens)
                    .max()
                    .unwrap_or(0),
                kv_tokens: self
                    .prefill_caps
                    .iter()
                    .map(|c| c.kv_tokens)
                    .max()
                    .unwrap_or(0),
            }));
        }
        let live = Live {
            prompt: request.prompt,
            max_new_tokens: request.max_new_tokens,
            sampling: request.sampling,
            stop_at_eos: request.stop_at_eos,
            logits: None,
        };
        let rng = Rng::new(request.seed);
        if index == self.slots.len() {
            self.slots.push(Some(live));
            self.lens.push(len);
            lock(&self.state.rngs).push(rng);
            self.state.request_sampling.push(request.sampling);
        } else {
            self.slots[index] = Some(live);
            self.lens[index] = len;
            if let Some(r) = lock(&self.state.rngs).get_mut(index) {
                *r = rng;
            }
            if let Some(s) = self.state.request_sampling.get_mut(index) {
                *s = request.sampling;
            }
        }
        self.waiting.push_back(Pending {
            request: index,
            generated: Vec::new(),
        });
        self.update_gauges();
        Ok(index)
    }

    /// Cancels a sequence: a waiting one leaves the queue, a running one gives its KV
    /// blocks back now (the next step no longer holds it). Returns its `Done` event, or
    /// `None` if no such sequence is live.
    pub fn cancel(&mut self, id: SeqId) -> Option<SeqEvent> {
        let generated = if let Some(at) = self.waiting.iter().position(|p| p.request == id) {
            self.waiting
                .remove(at)
                .map(|p| p.generated)
                .unwrap_or_default()
        } else if let Some(at) = self.running.iter().position(|s| s.request == id) {
            let s = self.running.remove(at);
            self.retire(s).generated
        } else {
            return None;
        };
        lock(&self.state.eam).finish(id);
        self.gauges.cancelled.fetch_add(1, Ordering::Relaxed);
        let live = self.free(id)?;
        self.update_gauges();
        Some(SeqEvent::Done {
            id,
            end: SeqEnd::Cancelled,
            token_ids: generated,
            logits: live.logits,
        })
    }

    /// Gives a sequence's blocks back, registering those whose tokens it has run with the
    /// prefix cache first (where its pool keeps one).
    fn retire(&mut self, mut s: Seq) -> Seq {
        let written = self
            .slots
            .get(s.request)
            .and_then(Option::as_ref)
            .map(|l| s.written(&l.prompt))
            .unwrap_or_default();
        if let Some(pool) = self.pools.get_mut(s.ub) {
            pool.register(&written, &s.block_table);
            pool.give(&mut s.block_table);
        }
        s
    }

    /// Makes a submitted sequence's tokens follow `constraint` (before its first step).
    pub fn constrain(&mut self, id: SeqId, constraint: Box<dyn TokenConstraint>) {
        let mut constraints = lock(&self.state.constraints);
        if constraints.len() <= id {
            constraints.resize_with(id + 1, || None);
        }
        constraints[id] = Some(constraint);
    }

    /// Frees a slot.
    fn free(&mut self, id: SeqId) -> Option<Live> {
        if let Some(c) = lock(&self.state.constraints).get_mut(id) {
            *c = None;
        }
        let live = self.slots.get_mut(id)?.take();
        if let Some(len) = self.lens.get_mut(id) {
            *len = 0;
        }
        live
    }

    fn update_gauges(&self) {
        let g = &self.gauges;
        g.waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        g.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        // Blocks held, each once (a cached prefix may be shared by several sequences).
        let used: usize = self.pools.iter().map(|p| p.total - p.available()).sum();
        g.kv_blocks_used.store(used as u64, Ordering::Relaxed);
        g.kv_blocks_used_peak
            .fetch_max(used as u64, Ordering::Relaxed);
        let free: usize = self.pools.iter().map(KvPool::available).sum();
        g.kv_blocks_free.store(free as u64, Ordering::Relaxed);
        let block = self.pools.iter().map(|p| p.block_size).max().unwrap_or(0);
        g.kv_block_tokens.store(block as u64, Ordering::Relaxed);
        let cached: usize = self.pools.iter().map(KvPool::idle_cached).sum();
        g.kv_blocks_cached.store(cached as u64, Ordering::Relaxed);
        let total: usize = self.pools.iter().map(|p| p.total).sum();
        g.kv_blocks_total.store(total as u64, Ordering::Relaxed);
    }

    fn runner(&self) -> StepRunner<'_, B> {
        StepRunner {
            plan: self.plan,
            backend: self.backend,
            kill: self.options.kill_task,
            kill_count: &self.kill_count,
            exec: self.options.exec,
            origin: self.origin,
        }
    }

    /// Admits what the schedule allows, runs one step and hands back what each sequence
    /// produced; no events when nothing waits or runs. The plan's `setup` step runs before
    /// the first.
    pub fn step(&mut self) -> Result<Vec<SeqEvent>, RunError> {
        if self.is_idle() {
            return Ok(Vec::new());
        }
        if !self.setup_done {
            self.setup_done = true;
            if let Some(setup) = self
                .plan
                .steps
                .iter()
                .position(|s| s.kind == StepKind::Setup)
            {
                let (start, end, tasks, graph) = self.runner().run_graphed(&self.state, setup)?;
                if let Some(graph) = graph {
                    self.stats.graph_steps.push(GraphStep {
                        kind: StepKind::Setup,
                        graph,
                    });
                }
                self.stats.steps.push(StepRecord {
                    kind: StepKind::Setup,
                    start,
                    end,
                    prefill_tokens: 0,
                    decode_tokens: 0,
                    ubs: Vec::new(),
                    tasks,
                });
            }
        }
        self.admit()?;
        self.update_gauges();
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let events = self.run_pass()?;
        self.update_gauges();
        Ok(events)
    }

    /// Mixed steps: grow the decoding sequences (preempting where blocks run out) and
    /// admit from the queue's head; static batches: a new batch only into an empty plan.
    fn admit(&mut self) -> Result<(), RunError> {
        let gen_len = self.gen_len;
        if self.mixed || self.on_demand {
            // With chunked prefill any preempted sequence can be prefilled again.
            let refill = if self.chunked_prefill {
                usize::MAX
            } else {
                self.max_prefill
            };
            let decided = grow_decoding(&mut self.running, &mut self.pools, &self.lens, refill);
            self.stats.preemptions += decided.preempted.len();
            self.gauges
                .preemptions
                .fetch_add(decided.preempted.len() as u64, Ordering::Relaxed);
            self.stats.paused += decided.paused;
            for p in decided.preempted.into_iter().rev() {
                self.waiting.push_front(p);
            }
            // Static batches take new sequences only into an empty plan, unless their
            // prefill pass can run the decoding sequences' tokens too (chunked prefill:
            // `plan_chunks`), which lets a sequence join at any pass.
            if self.mixed || self.chunked_prefill || self.running.is_empty() {
                let prompts: Vec<&[u32]> = self
                    .slots
                    .iter()
                    .map(|l| l.as_ref().map_or(&[][..], |l| l.prompt.as_slice()))
                    .collect();
                // Without `on_demand_kv` every sequence may reach `gen_len` tokens (what
                // `generate` has always reserved for); with it, its own `max_new_tokens`.
                let finish: Vec<usize> = self
                    .slots
                    .iter()
                    .map(|l| {
                        l.as_ref().map_or(0, |l| {
                            l.prompt.len()
                                + if self.on_demand {
                                    l.max_new_tokens
                                } else {
                                    gen_len
                                }
                        })
                    })
                    .collect();
                let done = admit_fifo(
                    &mut self.waiting,
                    &mut self.running,
                    &mut self.pools,
                    &self.prefill_caps,
                    &prompts,
                    &finish,
                    !self.mixed,
                    self.chunked_prefill,
                    &mut self.next_age,
                );
                let g = &self.gauges;
                g.prefix_hits
                    .fetch_add(done.prefix_hits as u64, Ordering::Relaxed);
                g.prefix_cached_tokens
                    .fetch_add(done.cached_tokens as u64, Ordering::Relaxed);
                g.prefix_queried_tokens
                    .fetch_add(done.tokens as u64, Ordering::Relaxed);
            }
            if !self.running.is_empty() && self.running.iter().all(|s| s.paused) {
                return Err(RunError::KvStall {
                    paused: self.running.len(),
                    max_tokens: self.max_prefill,
                });
            }
        } else if self.running.is_empty() {
            let ids: Vec<usize> = self.waiting.iter().map(|p| p.request).collect();
            let (batch, left) = admit(&self.lens, &ids, gen_len, &self.prefill_caps);
            for (u, reqs) in batch.iter().enumerate() {
                if reqs.is_empty() {
                    continue;
                }
                let budgets: Vec<usize> = reqs.iter().map(|&r| self.lens[r] + gen_len).collect();
                let kv_tokens = self.prefill_caps[u].kv_tokens;
                self.pools[u] =
                    KvPool::new(kv_tokens, block_size(kv_tokens, &budgets).unwrap_or(1));
                for &r in reqs {
                    let needed = self.pools[u].blocks_for(self.lens[r] + gen_len);
                    let block_table = self.pools[u].take(needed).unwrap_or_default();
                    self.running.push(Seq {
                        request: r,
                        ub: u,
                        block_table,
                        generated: Vec::new(),
                        prompt_done: false,
                        age: self.next_age,
                        paused: false,
                        cached: 0,
                    });
                    self.next_age += 1;
                }
            }
            // What did not fit waits for the next batch, in submission order.
            self.waiting.retain(|p| left.contains(&p.request));
        }
        Ok(())
    }

    /// With chunked prefill, fits this pass in each micro-batch's token room and the
    /// session's prefill budget: decoding sequences take one token each, then prefilling
    /// ones (oldest first) take what is left of their prompt up to the room and the
    /// budget; one that gets none skips the pass (`paused`). A static plan's prefill pass
    /// runs a decoding sequence's next token as a one-token chunk of prefill attending its
    /// cache (`run_pass` marks its row so), so the streams keep decoding while others
    /// prefill. Returns the sequences (request, tokens) whose chunk does not end their
    /// prompt. Without chunked prefill: nothing.
    fn plan_chunks(&mut self) -> Vec<(usize, usize)> {
        if !self.chunked_prefill {
            return Vec::new();
        }
        let mut room: Vec<usize> = self.prefill_caps.iter().map(|c| c.tokens).collect();
        // A lone sequence has nobody to wait for it: it prefills what the pass has room for.
        let mut budget = if self.running.len() > 1 {
            self.prefill_budget
        } else {
            usize::MAX
        };
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        order.sort_by_key(|&i| (!self.running[i].prompt_done, self.running[i].age));
        let mut chunks = Vec::new();
        for i in order {
            let s = &mut self.running[i];
            if s.paused {
                continue;
            }
            let Some(room) = room.get_mut(s.ub) else {
                continue;
            };
            if s.prompt_done {
                if *room == 0 {
                    s.paused = true;
                } else {
                    *room -= 1;
                }
                continue;
            }
            let remaining = (self.lens.get(s.request).copied().unwrap_or(0) + s.generated.len())
                .saturating_sub(s.cached);
            let take = remaining.min(*room).min(budget);
            *room -= take;
            budget -= take;
            if take == 0 {
                s.paused = true;
            } else if take < remaining {
                chunks.push((s.request, take));
            }
        }
        chunks
    }

    /// Runs one step over the running sequences and collects their tokens.
    fn run_pass(&mut self) -> Result<Vec<SeqEvent>, RunError> {
        if let Some(ahead) = self.ahead.take() {
            return self.pass_in_flight(ahead);
        }
        let n_ubs = self.plan.micro_batches.count as usize;
        let chunks = self.plan_chunks();
        let any_prefill = self.running.iter().any(|s| !s.prompt_done && !s.paused);
        let step = if any_prefill {
            self.prefill_step
        } else {
            self.decode_step
        };
        self.state.reset_step();
        for ub in self.state.ubs.iter_mut() {
            *ub = MicroBatchState::default();
        }
        // A backend picks its sampling path from the run's rule (a device argmax for
        // greedy); with any sampled sequence in the step every row goes through the
        // per-sequence rules of `StepState::sample_rows`.
        self.state.sampling = self
            .running
            .iter()
            .filter(|s| !s.paused)
            .filter_map(|s| self.slots.get(s.request).and_then(Option::as_ref))
            .map(|l| l.sampling)
            .find(|s| *s != Sampling::Greedy)
            .unwrap_or(Sampling::Greedy);
        // A constrained sequence's logits are masked on the host before its rule samples
        // them: a step with one goes the host path (its greedy rows stay greedy, as every
        // row follows its own request's rule there).
        let constrained = {
            let constraints = lock(&self.state.constraints);
            self.running
                .iter()
                .filter(|s| !s.paused)
                .any(|s| constraints.get(s.request).is_some_and(Option::is_some))
        };
        if constrained && self.state.sampling == Sampling::Greedy {
            self.state.sampling = Sampling::Temperature {
                temperature: 1.0,
                top_p: 1.0,
            };
        }
        self.running.sort_by_key(|s| (s.ub, s.request));
        let (mut n_prefill, mut n_decode) = (0, 0);
        let mut loads = vec![UbLoad::default(); n_ubs];
        // A static plan's prefill pass runs its decoding sequences' tokens as one-token
        // chunks of prefill (only with chunked prefill: `plan_chunks`).
        let as_prefill = !self.mixed && step == self.prefill_step;
        for s in self.running.iter().filter(|s| !s.paused) {
            let Some(live) = self.slots.get(s.request).and_then(Option::as_ref) else {
                continue;
            };
            let prompt_len = live.prompt.len();
            let mut new_tokens = s.new_tokens(&live.prompt);
            if let Some(&(_, n)) = chunks.iter().find(|(r, _)| *r == s.request) {
                new_tokens.truncate(n);
            }
            let load = &mut loads[s.ub];
            if s.prompt_done && as_prefill {
                // What the step ran: a row of prefill (the records' replay costs it so).
                n_decode += 1;
                load.prefill_seqs += 1;
                load.prefill_tokens += 1;
            } else if s.prompt_done {
                n_decode += 1;
                load.decode_seqs += 1;
                load.decode_context += prompt_len + s.generated.len();
            } else {
                n_prefill += new_tokens.len();
                load.prefill_seqs += 1;
                load.prefill_tokens += new_tokens.len();
            }
            let mb = &mut self.state.ubs[s.ub];
            mb.block_size = self.pools[s.ub].block_size;
            mb.seqs.push(SeqSlot {
                request: s.request,
                context_len: s.context_len(prompt_len),
                new_tokens,
                block_table: s.block_table.clone(),
                prefill: !s.prompt_done || as_prefill,
            });
        }
        // A chunk that does not end its prompt samples a token nobody takes: its
        // generator and constraint are put back as they were after the pass.
        let held: Vec<HeldSampler> = chunks
            .iter()
            .map(|&(r, _)| {
                let rng = lock(&self.state.rngs).get(r).cloned();
                let constraint = lock(&self.state.constraints)
                    .get_mut(r)
                    .and_then(Option::take);
                (r, rng, constraint)
            })
            .collect();
        let ran = self.runner().run_graphed(&self.state, step);
        for (r, rng, constraint) in held {
            if let (Some(slot), Some(rng)) = (lock(&self.state.rngs).get_mut(r), rng) {
                *slot = rng;
            }
            if let Some(slot) = lock(&self.state.constraints).get_mut(r) {
                if constraint.is_some() {
                    *slot = constraint;
                }
            }
        }
        let (start, end, tasks, graph) = ran?;
        // A long-lived session keeps no per-step records (the backend's line counts them).
        if let Some(graph) = graph.filter(|_| self.record_steps) {
            self.stats.graph_steps.push(GraphStep {
                kind: self.plan.steps[step].kind,
                graph,
            });
        }
        count_active_experts(&mut loads, &self.state, self.plan.model.experts as usize);
        let g = &self.gauges;
        g.steps.fetch_add(1, Ordering::Relaxed);
        g.prefill_tokens
            .fetch_add(n_prefill as u64, Ordering::Relaxed);
        g.last_step_seconds
            .store((end - start).to_bits(), Ordering::Relaxed);
        let total = Gauges::seconds(&g.step_seconds_total) + (end - start);
        g.step_seconds_total
            .store(total.to_bits(), Ordering::Relaxed);
        if self.record_steps {
            self.stats.steps.push(StepRecord {
                kind: self.plan.steps[step].kind,
                start,
                end,
                prefill_tokens: n_prefill,
                decode_tokens: n_decode,
                ubs: loads,
                tasks,
            });
        }
        let sampled = std::mem::take(&mut *lock(&self.state.sampled));
        let sampled_logits = std::mem::take(&mut *lock(&self.state.sampled_logits));
        let routing = std::mem::take(&mut *lock(&self.state.routing));
        self.tally_predictions(&routing);
        self.state.predictor.update(&routing);
        record_activations(&self.state, &routing);
        if let Some(profile) = &self.options.routing_profile {
            let mut profile = lock(profile);
            for (&(layer, _), r) in &routing {
                profile.add(layer, &r.experts, r.top_k);
            }
        }
        let mut events = Vec::new();
        let mut row_in_ub = vec![0usize; n_ubs];
        let mut still = Vec::new();
        for mut s in std::mem::take(&mut self.running) {
            if s.paused {
                still.push(s);
                continue;
            }
            let k = row_in_ub[s.ub];
            row_in_ub[s.ub] += 1;
            let Some(token) = sampled.get(&(s.ub as u32)).and_then(|t| t.get(k)).copied() else {
                return Err(RunError::Exec(ExecError::NoToken {
                    ub: s.ub as u32,
                    row: k,
                }));
            };
            if let Some(&(_, n)) = chunks.iter().find(|(r, _)| *r == s.request) {
                // A chunk of its prompt ran: the rest waits for the next pass.
                s.cached += n;
                still.push(s);
                continue;
            }
            if let Some(s) = self.accept_token(s, k, token, &sampled_logits, &mut events) {
                still.push(s);
            }
        }
        self.running = still;
        if self.may_launch_ahead(false) {
            self.ahead = self.launch_ahead(false)?;
        }
        Ok(events)
    }

    /// Sequence `s` (row `k` of its micro-batch) sampled `token`: appended, announced, and
    /// the sequence ended at EOS or its length (blocks given back, slot freed). Gives the
    /// sequence back while it runs on.
    fn accept_token(
        &mut self,
        mut s: Seq,
        k: usize,
        token: u32,
        sampled_logits: &HashMap<u32, Vec<f32>>,
        events: &mut Vec<SeqEvent>,
    ) -> Option<Seq> {
        let plan = self.plan;
        let card = &plan.model;
        {
            let live = self.slots.get_mut(s.request).and_then(Option::as_mut)?;
            if let Some(rows) = sampled_logits.get(&(s.ub as u32)) {
                let vocab = card.vocab as usize;
                live.logits = rows.get(k * vocab..(k + 1) * vocab).map(<[f32]>::to_vec);
            }
        }
        let live = self.slots.get(s.request).and_then(Option::as_ref)?;
        let (stop_at_eos, max_new_tokens) = (live.stop_at_eos, live.max_new_tokens);
        let prefilled = !s.prompt_done;
        s.prompt_done = true;
        s.generated.push(token);
        if prefilled {
            // Its prompt's blocks are cached now, for the sequences that follow.
            let written = s.written(&live.prompt);
            if let Some(pool) = self.pools.get_mut(s.ub) {
                pool.register(&written, &s.block_table);
            }
        }
        self.gauges.generated_tokens.fetch_add(1, Ordering::Relaxed);
        events.push(SeqEvent::Token {
            id: s.request,
            token,
        });
        let eos = stop_at_eos && token == card.eos_token_id;
        if !eos && s.generated.len() < max_new_tokens {
            return Some(s);
        }
        let matrix = lock(&self.state.eam).finish(s.request);
        if let (Some(profile), Some(m)) = (&self.options.routing_profile, matrix) {
            lock(profile).requests.push(m);
        }
        let written = s.written(&live.prompt);
        if let Some(pool) = self.pools.get_mut(s.ub) {
            pool.register(&written, &s.block_table);
            pool.give(&mut s.block_table);
        }
        let live = self.free(s.request);
        events.push(SeqEvent::Done {
            id: s.request,
            end: if eos { SeqEnd::Eos } else { SeqEnd::Length },
            token_ids: std::mem::take(&mut s.generated),
            logits: live.and_then(|l| l.logits),
        });
        None
    }

    /// Ends the session: the measured stats (the backend's line said again, as a device
    /// backend's counts what the run did).
    pub fn finish(mut self) -> RunStats {
        self.stats.wall = self.origin.elapsed().as_secs_f64();
        self.stats.copies = self.backend.memory().copies;
        self.stats.disk = self.backend.memory().disk;
        self.stats.substituted_experts = self.backend.memory().substituted;
        self.stats.backend = self.backend.describe();
        self.stats.caches = self
            .state
            .caches
            .iter()
            .map(cache::CacheRuntime::report)
            .collect();
        for c in &self.stats.caches {
            let t = &c.total;
            if t.prefetched > 0 {
                self.stats.predictions.push(PredictionReport {
                    predictor: format!("cache {} ({})", c.name, c.predictor),
                    hits: t.prefetch_used,
                    misses: t.misses,
                    wasted: t.prefetch_wasted,
                });
            }
        }
        self.stats
    }

    /// Adds this step's predictions to the run's accuracy: the `pregate` routing read back
    /// (`lookahead`) and the experts `hot(..)` copies moved (`hot`), each against the
    /// gate's routing of the same layer where the host read it back.
    fn tally_predictions(&mut self, routing: &HashMap<(u32, u32), Routing>) {
        let experts = self.plan.model.experts as usize;
        let distinct = |r: &Routing| -> Vec<u32> {
            let mut v: Vec<u32> = r
                .experts
                .iter()
                .copied()
                .filter(|&e| (e as usize) < experts)
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let lookahead = std::mem::take(&mut *lock(&self.state.lookahead));
        let mut keys: Vec<_> = lookahead.keys().copied().collect();
        keys.sort_unstable();
        for key in keys {
            if let (Some(p), Some(r)) = (lookahead.get(&key), routing.get(&key)) {
                prediction(&mut self.stats.predictions, "lookahead")
                    .tally(&distinct(p), &distinct(r));
            }
        }
        let copied = std::mem::take(&mut *lock(&self.state.hot_copied));
        let mut layers: Vec<u32> = copied.iter().map(|&(l, _)| l).collect();
        layers.sort_unstable();
        layers.dedup();
        for l in layers {
            let mut routed: Vec<u32> = routing
                .iter()
                .filter(|(&(layer, _), _)| layer == l)
                .flat_map(|(_, r)| distinct(r))
                .collect();
            if routed.is_empty() && !routing.keys().any(|&(layer, _)| layer == l) {
                continue;
            }
            routed.sort_unstable();
            routed.dedup();
            let mut named: Vec<u32> = copied
                .iter()
                .filter(|&&(layer, _)| layer == l)
                .map(|&(_, e)| e)
                .collect();
            named.sort_unstable();
            prediction(&mut self.stats.predictions, "hot").tally(&named, &routed);
        }
    }
}

/// A prompt error names the prompt by its index in the list checked; a submitted
/// sequence is named by its id instead.
fn renumber(e: RunError, id: SeqId) -> RunError {
    match e {
        RunError::EmptyPrompt(_) => RunError::EmptyPrompt(id),
        RunError::PastPositions {
            tokens,
            gen_len,
            needed,
            max,
            ..
        } => RunError::PastPositions {
            index: id,
            tokens,
            gen_len,
            needed,
            max,
        },
        other => other,
    }
}

/// The run's entry for `predictor`, added on first use.
fn prediction<'r>(
    list: &'r mut Vec<PredictionReport>,
    predictor: &str,
) -> &'r mut PredictionReport {
    let at = match list.iter().position(|p| p.predictor == predictor) {
        Some(at) => at,
        None => {
            list.push(PredictionReport {
                predictor: predictor.to_string(),
                ..PredictionReport::default()
            });
            list.len() - 1
        }
    };
    &mut list[at]
}
