//! The runtime: executes a lowered plan as real MoE inference (the generation driver).
//!
//! Takes an [`ExecPlan`], a checkpoint and prompts as token ids; gives per prompt the
//! generated ids, and a [`RunStats`] with the measured timeline of every task. Requests are
//! batched into the plan's micro-batches ([`batching`]); for a plan with `prefill` and
//! `decode` steps, each batch is prefilled once and the decode step is repeated until every
//! sequence has stopped (EOS or length); a plan with one mixed `step` (VSLPipe) repeats it,
//! admitting waiting prompts into free sequence slots while others decode, under the
//! micro-batch's token cap and KV capacity. Guarded tasks are skipped from the real
//! routing; `hot(i, k)` follows a running expert-correlation predictor.

pub mod arena;
pub mod batching;
pub mod cpu;
pub mod executor;
pub mod image;
pub mod ops;
pub mod report;
pub mod scheduler;
pub mod state;
pub mod weights;
pub mod workload;

use crate::ir::{Engine, Op, Role};
use crate::lower::ExecPlan;
use crate::model::arch::ArchSpec;
use crate::model::checkpoint::Checkpoint;
use crate::model::kernels::rope::RopeTable;
use crate::model::kernels::sampling::Sampling;
use crate::model::rng::Rng;
use crate::syntax::ast::{Span, StepKind};
use batching::{admit, block_size, UbCapacity};
use cpu::{CpuMemory, MemoryError, MemoryOptions};
use executor::{run_step, ExecError, ExecOptions, TaskRecord, TaskRunner};
use ops::OpContext;
use scheduler::{admit_fifo, grow_decoding, KvPool, Pending, Seq};
use state::{lock, HotPredictor, MicroBatchState, SeqSlot, StepState};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The backend could not set up its memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A step failed (task error, stall).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// A rayon pool could not be built.
    #[error("cannot build a thread pool: {0}")]
    Pool(String),
    /// The plan lacks steps the driver needs.
    #[error("schedule `{0}` has neither `prefill` + `decode` steps nor a mixed `step`")]
    Steps(String),
    /// A prompt that can never be admitted.
    #[error("prompt {index} ({tokens} tokens + {gen_len} to generate) fits in no micro-batch of this schedule (largest: {max_tokens} tokens per step, KV for {kv_tokens}); compile it for a longer prompt_len")]
    PromptTooLarge {
        /// Prompt index.
        index: usize,
        /// Its tokens.
        tokens: usize,
        /// Tokens to generate.
        gen_len: usize,
        /// Largest token cap of a micro-batch.
        max_tokens: usize,
        /// Largest KV capacity of a micro-batch.
        kv_tokens: usize,
    },
    /// An empty prompt.
    #[error("prompt {0} is empty")]
    EmptyPrompt(usize),
    /// Every running sequence is paused for KV blocks and none can be admitted.
    #[error("the KV cache is too small for the running sequences: {paused} sequences wait for blocks and none can be preempted (their re-prefill exceeds the token cap of {max_tokens}); give the schedule more KV cache")]
    KvStall {
        /// Sequences waiting for blocks.
        paused: usize,
        /// Largest token cap of a micro-batch.
        max_tokens: usize,
    },
}

impl RunError {
    /// The schedule span the error points at, if any.
    pub fn span(&self) -> Option<Span> {
        match self {
            RunError::Exec(e) => e.span(),
            _ => None,
        }
    }
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Tokens to generate per prompt at most.
    pub max_new_tokens: usize,
    /// Greedy or temperature/top-p.
    pub sampling: Sampling,
    /// Sampler seed (sequence `i` uses the same stream as the oracle's sequence `i`).
    pub seed: u64,
    /// Stop a sequence at the card's EOS token.
    pub stop_at_eos: bool,
    /// Threads of each compute pool (`gpu.compute` emulation and `cpu.compute`).
    pub threads: usize,
    /// Backend memory options (link throttle, device capacity).
    pub memory: MemoryOptions,
    /// Stall detection.
    pub exec: ExecOptions,
    /// Test hook: fail this task (by index) on its n-th run (1-based), as if its kernel
    /// had failed.
    pub kill_task: Option<(u32, u32)>,
}

impl RunOptions {
    /// Greedy generation of `max_new_tokens`, stopping at EOS, default threads.
    pub fn greedy(max_new_tokens: usize) -> Self {
        RunOptions {
            max_new_tokens,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_at_eos: true,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            memory: MemoryOptions::default(),
            exec: ExecOptions::default(),
            kill_task: None,
        }
    }
}

/// One executed step.
#[derive(Debug, Clone)]
pub struct StepRecord {
    /// The step's kind.
    pub kind: StepKind,
    /// Wall time start/end (seconds from the run's origin).
    pub start: f64,
    /// End.
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

/// The output of one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOutput {
    /// Generated ids (the EOS that stopped it included).
    pub token_ids: Vec<u32>,
}

struct Runner<'a> {
    plan: &'a ExecPlan,
    ctx: OpContext<'a>,
    gpu_pool: &'a rayon::ThreadPool,
    cpu_pool: &'a rayon::ThreadPool,
    kill: Option<(u32, u32)>,
    /// Shared by every step's runner, so the hook counts runs across steps.
    kill_count: &'a AtomicU32,
}

impl TaskRunner for Runner<'_> {
    fn run_task(&self, task: u32) -> Result<bool, String> {
        let t = &self.plan.tasks[task as usize];
        if let Some((kill, nth)) = self.kill {
            if kill == task && self.kill_count.fetch_add(1, Ordering::SeqCst) + 1 == nth {
                return Err("killed by the test hook".into());
            }
        }
        if !self.ctx.guard_holds(t) {
            return Ok(false);
        }
        let run = || self.ctx.run(t).map_err(|e| e.to_string());
        match t.engine {
            Engine::GpuCompute => self.gpu_pool.install(run)?,
            Engine::CpuCompute => self.cpu_pool.install(run)?,
            _ => run()?,
        }
        Ok(true)
    }
}

/// Everything a step's [`Runner`] needs but the step state, which the driver mutates
/// between steps.
struct StepRunner<'a> {
    plan: &'a ExecPlan,
    arch: &'a ArchSpec,
    rope: &'a RopeTable,
    memory: &'a CpuMemory<'a>,
    dtype: crate::model::card::WeightDtype,
    gpu_pool: &'a rayon::ThreadPool,
    cpu_pool: &'a rayon::ThreadPool,
    kill: Option<(u32, u32)>,
    kill_count: &'a AtomicU32,
    exec: ExecOptions,
    origin: Instant,
}

impl StepRunner<'_> {
    /// Runs step `index` over `state`: (start, end) seconds from the origin and its tasks.
    fn run(
        &self,
        state: &StepState,
        index: usize,
    ) -> Result<(f64, f64, Vec<TaskRecord>), ExecError> {
        let runner = Runner {
            plan: self.plan,
            ctx: OpContext {
                arch: self.arch,
                rope: self.rope,
                memory: self.memory,
                state,
                dtype: self.dtype,
            },
            gpu_pool: self.gpu_pool,
            cpu_pool: self.cpu_pool,
            kill: self.kill,
            kill_count: self.kill_count,
        };
        let start = self.origin.elapsed().as_secs_f64();
        let tasks = run_step(
            self.plan,
            &self.plan.steps[index],
            &runner,
            self.exec,
            self.origin,
        )?;
        Ok((start, self.origin.elapsed().as_secs_f64(), tasks))
    }
}

/// Capacities of each micro-batch in a step (token cap from the `h` arguments, KV tokens
/// from the `kv` arguments of attention tasks anywhere in the plan).
fn capacities(plan: &ExecPlan, step: usize) -> Vec<UbCapacity> {
    let card = &plan.program.model;
    let n_ubs = plan.program.micro_batches.count as usize;
    let size = plan.program.micro_batches.size as usize;
    let mut caps = vec![
        UbCapacity {
            seqs: size,
            tokens: usize::MAX,
            kv_tokens: usize::MAX
        };
        n_ubs
    ];
    let token_bytes = (card.hidden * 4).max(1);
    let kv_token_bytes = (card.kv_elems_per_token_layer() * 4).max(1);
    let range = {
        let s = &plan.program.steps[step];
        s.first as usize..(s.first + s.count) as usize
    };
    for (i, task) in plan.tasks.iter().enumerate() {
        let Some(ub) = task.op.ub().map(|u| u as usize).filter(|u| *u < n_ubs) else {
            continue;
        };
        for arg in &task.args {
            if arg.role == Role::H && range.contains(&i) && !matches!(task.op, Op::LmHead { .. }) {
                caps[ub].tokens = caps[ub].tokens.min((arg.len / token_bytes) as usize);
            }
            if arg.role == Role::Kv && matches!(task.op, Op::Attn { .. }) {
                caps[ub].kv_tokens = caps[ub].kv_tokens.min((arg.len / kv_token_bytes) as usize);
            }
        }
    }
    for c in &mut caps {
        if c.tokens == usize::MAX {
            c.tokens = 0;
        }
        if c.kv_tokens == usize::MAX {
            c.kv_tokens = 0;
        }
    }
    caps
}

/// Runs `plan` over `prompts` (token ids) and returns the outputs in prompt order.
/// `progress` is called after every step with (tokens generated so far, tokens at most).
pub fn generate(
    plan: &ExecPlan,
    checkpoint: &Checkpoint,
    prompts: &[Vec<u32>],
    options: &RunOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<RunOutput>, RunStats), RunError> {
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(RunError::EmptyPrompt(i));
        }
    }
    let step_idx = |k: StepKind| plan.steps.iter().position(|s| s.kind == k);
    let mode = match (
        step_idx(StepKind::Prefill),
        step_idx(StepKind::Decode),
        step_idx(StepKind::Mixed),
    ) {
        (Some(p), Some(d), _) => (p, d, false),
        (_, _, Some(m)) => (m, m, true),
        _ => return Err(RunError::Steps(plan.name.clone())),
    };
    let (prefill_step, decode_step, mixed) = mode;
    let memory = CpuMemory::new(plan, checkpoint, options.memory)?;
    let card = &plan.program.model;
    let arch = ArchSpec::from_card(card);
    let rope = RopeTable::new(arch.rope_theta, arch.attn.head_dim, arch.max_positions);
    let pool = |name: &'static str| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(options.threads.max(1))
            .thread_name(move |i| format!("moec-{name}-{i}"))
            .build()
            .map_err(|e| RunError::Pool(e.to_string()))
    };
    let (gpu_pool, cpu_pool) = (pool("gpu")?, pool("cpu")?);
    let n_ubs = plan.program.micro_batches.count as usize;
    let rngs = (0..prompts.len())
        .map(|i| Rng::new(options.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
        .collect();
    let mut state = StepState::new(n_ubs, options.sampling, rngs);
    state.predictor = HotPredictor::new(arch.layers, arch.experts);
    let prefill_caps = capacities(plan, prefill_step);
    let gen_len = options.max_new_tokens;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    for (index, &len) in lens.iter().enumerate() {
        let ok = prefill_caps.iter().any(|c| {
            c.seqs > 0 && len <= c.tokens && block_size(c.kv_tokens, &[len + gen_len]).is_some()
        });
        if !ok {
            let max_tokens = prefill_caps.iter().map(|c| c.tokens).max().unwrap_or(0);
            let kv_tokens = prefill_caps.iter().map(|c| c.kv_tokens).max().unwrap_or(0);
            return Err(RunError::PromptTooLarge {
                index,
                tokens: len,
                gen_len,
                max_tokens,
                kv_tokens,
            });
        }
    }
    let mut outputs: Vec<RunOutput> = prompts
        .iter()
        .map(|_| RunOutput {
            token_ids: Vec::new(),
        })
        .collect();
    let mut stats = RunStats {
        pinned_locked: memory.pinned_locked(),
        ..RunStats::default()
    };
    let (arena_bytes, image_bytes) = memory.sizes();
    stats.arena_bytes = arena_bytes;
    stats.image_bytes = image_bytes;
    let origin = Instant::now();
    let mut waiting: VecDeque<Pending> = (0..prompts.len())
        .map(|request| Pending {
            request,
            generated: Vec::new(),
        })
        .collect();
    let mut running: Vec<Seq> = Vec::new();
    // Static batches: pools reset when a batch starts, each sequence reserves its whole
    // generation (Alg. 2). Mixed steps: pools fixed for the run, blocks given as sequences
    // grow, preemption when they run out (`scheduler`).
    let mut pools: Vec<KvPool> = prefill_caps
        .iter()
        .map(|c| {
            let longest = plan.program.workload.prompt_len as usize + gen_len;
            let longest = longest.max(lens.iter().max().copied().unwrap_or(0) + gen_len);
            KvPool::new(
                c.kv_tokens,
                block_size(c.kv_tokens, &[longest]).unwrap_or(1),
            )
        })
        .collect();
    let max_prefill = prefill_caps.iter().map(|c| c.tokens).max().unwrap_or(0);
    let mut next_age = 0u64;
    let total_tokens = prompts.len() * gen_len;
    let mut produced = 0usize;
    let kill_count = AtomicU32::new(0);
    if gen_len == 0 {
        return Ok((outputs, stats));
    }
    let steps = StepRunner {
        plan,
        arch: &arch,
        rope: &rope,
        memory: &memory,
        dtype: card.dtype,
        gpu_pool: &gpu_pool,
        cpu_pool: &cpu_pool,
        kill: options.kill_task,
        kill_count: &kill_count,
        exec: options.exec,
        origin,
    };
    if let Some(setup) = plan.steps.iter().position(|s| s.kind == StepKind::Setup) {
        let (start, end, tasks) = steps.run(&state, setup)?;
        stats.steps.push(StepRecord {
            kind: StepKind::Setup,
            start,
            end,
            prefill_tokens: 0,
            decode_tokens: 0,
            ubs: Vec::new(),
            tasks,
        });
    }
    while !waiting.is_empty() || !running.is_empty() {
        if mixed {
            let decided = grow_decoding(&mut running, &mut pools, &lens, max_prefill);
            stats.preemptions += decided.preempted.len();
            stats.paused += decided.paused;
            for p in decided.preempted.into_iter().rev() {
                waiting.push_front(p);
            }
            admit_fifo(
                &mut waiting,
                &mut running,
                &mut pools,
                &prefill_caps,
                &lens,
                gen_len,
                &mut next_age,
            );
            if !running.is_empty() && running.iter().all(|s| s.paused) {
                return Err(RunError::KvStall {
                    paused: running.len(),
                    max_tokens: max_prefill,
                });
            }
        } else if running.is_empty() {
            // Static batches admit only into an empty plan.
            let ids: Vec<usize> = waiting.iter().map(|p| p.request).collect();
            let (batch, left) = admit(&lens, &ids, gen_len, &prefill_caps);
            for (u, reqs) in batch.iter().enumerate() {
                if reqs.is_empty() {
                    continue;
                }
                let budgets: Vec<usize> = reqs.iter().map(|&r| lens[r] + gen_len).collect();
                let kv_tokens = prefill_caps[u].kv_tokens;
                pools[u] = KvPool::new(kv_tokens, block_size(kv_tokens, &budgets).unwrap_or(1));
                for &r in reqs {
                    let needed = pools[u].blocks_for(lens[r] + gen_len);
                    let block_table = pools[u].take(needed).unwrap_or_default();
                    running.push(Seq {
                        request: r,
                        ub: u,
                        block_table,
                        generated: Vec::new(),
                        prompt_done: false,
                        age: next_age,
                        paused: false,
                    });
                    next_age += 1;
                }
            }
            waiting = left
                .into_iter()
                .map(|request| Pending {
                    request,
                    generated: Vec::new(),
                })
                .collect();
        }
        if running.is_empty() {
            break;
        }
        // Build the step's micro-batches.
        let any_prefill = running.iter().any(|s| !s.prompt_done && !s.paused);
        let step = if any_prefill {
            prefill_step
        } else {
            decode_step
        };
        state.reset_step();
        for ub in state.ubs.iter_mut() {
            *ub = MicroBatchState::default();
        }
        running.sort_by_key(|s| (s.ub, s.request));
        let (mut n_prefill, mut n_decode) = (0, 0);
        let mut loads = vec![UbLoad::default(); n_ubs];
        for s in running.iter().filter(|s| !s.paused) {
            let prompt_len = lens[s.request];
            let new_tokens = s.new_tokens(&prompts[s.request]);
            let load = &mut loads[s.ub];
            if s.prompt_done {
                n_decode += 1;
                load.decode_seqs += 1;
                load.decode_context += prompt_len + s.generated.len();
            } else {
                n_prefill += new_tokens.len();
                load.prefill_seqs += 1;
                load.prefill_tokens += new_tokens.len();
            }
            let mb = &mut state.ubs[s.ub];
            mb.block_size = pools[s.ub].block_size;
            mb.seqs.push(SeqSlot {
                request: s.request,
                context_len: s.context_len(prompt_len),
                new_tokens,
                block_table: s.block_table.clone(),
                prefill: !s.prompt_done,
            });
        }
        let (start, end, tasks) = steps.run(&state, step)?;
        stats.steps.push(StepRecord {
            kind: plan.steps[step].kind,
            start,
            end,
            prefill_tokens: n_prefill,
            decode_tokens: n_decode,
            ubs: loads,
            tasks,
        });
        // Collect the sampled tokens.
        let sampled = std::mem::take(&mut *lock(&state.sampled));
        let routing = std::mem::take(&mut *lock(&state.routing));
        state.predictor.update(&routing);
        let mut row_in_ub = vec![0usize; n_ubs];
        let mut still = Vec::new();
        for mut s in running.drain(..) {
            if s.paused {
                still.push(s);
                continue;
            }
            let k = row_in_ub[s.ub];
            row_in_ub[s.ub] += 1;
            let token = sampled.get(&(s.ub as u32)).and_then(|t| t.get(k)).copied();
            let Some(token) = token else {
                return Err(RunError::Exec(ExecError::Task {
                    task: format!("sample(ub={})", s.ub),
                    message: "the step produced no token for this sequence (does the schedule sample every micro-batch?)".into(),
                    span: Span::default(),
                }));
            };
            s.prompt_done = true;
            s.generated.push(token);
            produced += 1;
            let eos = options.stop_at_eos && token == card.eos_token_id;
            if eos || s.generated.len() >= gen_len {
                outputs[s.request].token_ids = std::mem::take(&mut s.generated);
                produced += gen_len - outputs[s.request].token_ids.len();
                pools[s.ub].give(&mut s.block_table);
            } else {
                still.push(s);
            }
        }
        running = still;
        progress(produced.min(total_tokens), total_tokens);
    }
    stats.wall = origin.elapsed().as_secs_f64();
    Ok((outputs, stats))
}
