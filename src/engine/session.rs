//! The serving API: a model loaded, a schedule compiled, lowered and its backend opened
//! once, then completions submitted while it runs.
//!
//! Takes a [`SessionRequest`] (a [`RunRequest`] for everything a run shares, plus the most
//! sequences and the longest prompt it serves); the plan is compiled once for that workload
//! (`batch` = `max_batch`, `prompt_len` = `max_prompt`, `gen_len` = the request's
//! `gen_len`; params the planner picks when the defaults do not fit or with `--fit`, as
//! [`super::fit_params`] does for a run), so what the checker proved and the budgets `fit`
//! checked hold for every admission: a longer prompt or more tokens are refused at
//! submission, and sequences beyond what the plan holds wait in the queue. With a
//! [`SessionRequest::context`] (`moec serve`), `max_prompt` is only the prompt tokens one
//! pass prefills per sequence: prompts up to the context (the card's own limit at most)
//! are prefilled in chunks, and the plan's KV cache is sized by
//! [`SessionRequest::kv_bytes`] (its `gen_len` is what makes `prompt_len + gen_len` the
//! KV tokens per sequence), its blocks given as sequences grow. One worker
//! thread owns the checkpoint, the backend and the driver's session
//! ([`crate::runtime::driver::serving::serve`]); a [`Completion`] goes to it over a channel
//! and its text comes back, piece by piece, on the receiver [`Session::submit`] returns.
//! Stop strings and incremental detokenization are done here, so a caller (the HTTP server)
//! sees only text; the token ids come with the end (`moec batch` stores them). Chat prompts
//! are rendered with the checkpoint's `tokenizer_config.json` template
//! ([`Session::chat_prompt`]).

use super::prepare::{prepare, refuse_unavailable_backend, Prepared, ProfileUse, Target};
use super::{message, RunFailure, RunRequest};
use crate::ir::Workload;
use crate::model::vocab::Sampling;
use crate::runtime::driver::serving::{serve, Command, SeqError, TokenSink};
pub use crate::runtime::driver::session::Gauges;
use crate::runtime::driver::session::{SeqEnd, SeqRequest, Session as DriverSession};
use crate::runtime::driver::state::TokenConstraint;
use crate::weights::source::{load_model, LoadedModel};
use crate::weights::tokenizer::TextTokenizer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// A serving session's settings.
#[derive(Debug, Clone)]
pub struct SessionRequest {
    /// Schedule, model, params, backend and its options; `gen_len` is the most tokens a
    /// completion may ask for. Prompts and workload are not read.
    pub run: RunRequest,
    /// Most sequences the plan holds at once (its `batch`).
    pub max_batch: usize,
    /// Longest prompt in tokens (its `prompt_len`); with a `context`, the prompt tokens
    /// per sequence one pass prefills.
    pub max_prompt: usize,
    /// Longest prompt plus generation a sequence may reach, capped at the card's
    /// positions (`usize::MAX`: the card's limit); `None`: `max_prompt` + `gen_len`, with
    /// no chunked prefill (`moec batch`).
    pub context: Option<usize>,
    /// Bytes of KV cache the plan holds (all layers, all sequences); `None`: the KV of
    /// `max_batch` sequences of `min(context, DEFAULT_KV_CONTEXT)` tokens (of `max_prompt`
    /// + `gen_len` without a context).
    pub kv_bytes: Option<u64>,
    /// How long a static batch about to start with room waits for more requests (plans
    /// with mixed steps or chunked prefill admit at every pass and never wait).
    pub batch_wait: Duration,
    /// Most prompt tokens one pass prefills over all its sequences, where the plan
    /// prefills in chunks (`Session::set_prefill_budget` of the driver); `None`: what the
    /// pass has room for.
    pub prefill_budget: Option<usize>,
}

/// What a session was opened with, for `/v1/models` and the startup line.
#[derive(Debug, Clone)]
pub struct SessionInfo {
    /// The card's name.
    pub model: String,
    /// The schedule's name.
    pub schedule: String,
    /// The backend's report line.
    pub backend: String,
    /// Longest prompt in tokens.
    pub max_prompt: usize,
    /// Prompt tokens one pass prefills per sequence (longer prompts run in chunks); equal
    /// to `max_prompt` without a context.
    pub prefill_chunk: usize,
    /// Longest prompt plus generation a sequence may reach.
    pub context: usize,
    /// Tokens the KV cache holds, all sequences together.
    pub kv_tokens: usize,
    /// Most tokens a completion generates.
    pub max_tokens: usize,
    /// Most sequences at once.
    pub max_batch: usize,
    /// Where the tokenizer came from.
    pub tokenizer: String,
    /// Where the chat template came from, or why there is none.
    pub chat_template: Result<String, String>,
    /// What the caller should tell the user (params the planner picked, a failed probe).
    pub notes: Vec<String>,
    /// Whether whole blocks of tokens already run are shared with later sequences that
    /// start with them (only where the schedule's prefill attends the KV cache its decode
    /// reads).
    pub prefix_cache: bool,
    /// The model's vocabulary (rows of its logits).
    pub vocab: usize,
    /// The model's end-of-sequence token.
    pub eos_token: u32,
}

/// One completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Greedy or temperature/top-p.
    pub sampling: Sampling,
    /// Sampler seed.
    pub seed: u64,
    /// Text that ends the completion (not included in it).
    pub stop: Vec<String>,
    /// The shape its text must have, if any (OpenAI's `response_format`).
    pub format: Option<ResponseFormat>,
}

/// A completion's required shape: its tokens are sampled only among those a grammar
/// allows next (llguidance), so the text parses as asked, unless `max_tokens` cuts it.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(serde_json::Value),
    /// Text of this llguidance Lark grammar (`moec serve`'s `tool_choice: "auto"`: plain
    /// text or a call).
    Lark(String),
}

/// Why a completion ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The client went away, or the session shut down first.
    Cancelled,
    /// Refused at submission (a caller error: the text says why).
    Refused(String),
    /// The run failed (a server error).
    Failed(String),
}

/// A piece of a completion's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// More text.
    Text(String),
    /// The end: why, and the tokens generated.
    End {
        /// Why.
        reason: FinishReason,
        /// Every token generated (the stop string's tokens included): their count is the
        /// completion's usage, and a caller that stores ids (`moec batch`) reads them here.
        token_ids: Vec<u32>,
    },
}

/// Why a completion was refused before it was queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitRefusal {
    /// A caller error (too long, too many tokens, empty).
    #[error("{0}")]
    Invalid(String),
    /// The session has stopped.
    #[error("{0}")]
    Unavailable(String),
}

/// A histogram of seconds with fixed upper bounds (Prometheus' cumulative shape is made
/// when it is rendered): safe to observe from the session's thread while a server reads it.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds in seconds, ascending (the `+Inf` bucket is implied).
    pub bounds: &'static [f64],
    /// Observations per bucket (not cumulative): one per bound, then one past the last.
    counts: Vec<AtomicU64>,
    /// Sum of the observations, as `f64` bits.
    sum: AtomicU64,
}

impl Histogram {
    /// An empty histogram over `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Counts one observation.
    pub fn observe(&self, seconds: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        // One writer (the session's thread) in practice; the loop keeps it exact anyway.
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + seconds).to_bits())
            });
    }

    /// Cumulative counts: observations at most each bound, then the total (`+Inf`).
    pub fn cumulative(&self) -> Vec<u64> {
        let mut total = 0;
        self.counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect()
    }

    /// Sum of the observations in seconds.
    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum.load(Ordering::Relaxed))
    }
}

/// Per-request figures of a serving session, counted as tokens reach their completions.
#[derive(Debug)]
pub struct RequestMetrics {
    /// Submission to the first generated token, per completion that got one.
    pub time_to_first_token: Histogram,
    /// Between consecutive tokens of one completion.
    pub inter_token: Histogram,
    /// Completions ended, by [`FinishReason`] (stop, length, cancelled, refused, failed).
    pub finished: [AtomicU64; 5],
    /// Prompt tokens of the completions submitted.
    pub prompt_tokens: AtomicU64,
    /// Tokens the completions received.
    pub completion_tokens: AtomicU64,
}

/// The labels of [`RequestMetrics::finished`], in its order.
pub const FINISH_LABELS: [&str; 5] = ["stop", "length", "cancelled", "refused", "failed"];

impl Default for RequestMetrics {
    fn default() -> Self {
        const TTFT: &[f64] = &[
            0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
        ];
        const INTER_TOKEN: &[f64] = &[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
        ];
        RequestMetrics {
            time_to_first_token: Histogram::new(TTFT),
            inter_token: Histogram::new(INTER_TOKEN),
            finished: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
        }
    }
}

impl RequestMetrics {
    fn finish(&self, reason: &FinishReason) {
        let i = match reason {
            FinishReason::Stop => 0,
            FinishReason::Length => 1,
            FinishReason::Cancelled => 2,
            FinishReason::Refused(_) => 3,
            FinishReason::Failed(_) => 4,
        };
        self.finished[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// An open serving session (see the module doc).
pub struct Session {
    commands: Mutex<mpsc::Sender<Command>>,
    tokenizer: Arc<TextTokenizer>,
    gauges: Arc<Gauges>,
    metrics: Arc<RequestMetrics>,
    info: SessionInfo,
    template: Option<ChatTemplate>,
    /// What compiles `response_format` grammars, built at the first such request.
    grammars: OnceLock<Result<llguidance::ParserFactory, String>>,
    worker: Mutex<Option<JoinHandle<Result<(), String>>>>,
}

/// What the worker hands back once the backend is open.
type Ready = Result<(SessionInfo, Arc<TextTokenizer>, Arc<Gauges>), RunFailure>;

impl Session {
    /// Loads the model, compiles the schedule for the session's workload, lowers it,
    /// refuses what does not fit, opens the backend and starts serving on a worker thread.
    pub fn open(request: SessionRequest) -> Result<Session, RunFailure> {
        refuse_unavailable_backend(&request.run)?;
        if request.max_batch == 0 || request.max_prompt == 0 || request.run.gen_len == 0 {
            return Err(RunFailure::Message(
                "a serving session needs a batch, a prompt length and a generation length of at least 1".to_string(),
            ));
        }
        let (ready_tx, ready_rx) = mpsc::channel::<Ready>();
        let (commands, incoming) = mpsc::channel::<Command>();
        let worker = std::thread::Builder::new()
            .name("moec-session".to_string())
            .spawn(move || worker(request, ready_tx, incoming))
            .map_err(|e| RunFailure::Message(format!("cannot start the session thread: {e}")))?;
        let (info, tokenizer, gauges) = match ready_rx.recv() {
            Ok(Ok(ready)) => ready,
            Ok(Err(failure)) => {
                let _ = worker.join();
                return Err(failure);
            }
            Err(_) => {
                let why = match worker.join() {
                    Ok(Err(e)) => e,
                    Ok(Ok(())) => "it ended".to_string(),
                    Err(_) => "it panicked".to_string(),
                };
                return Err(RunFailure::Message(format!(
                    "the session thread stopped before it was ready: {why}"
                )));
            }
        };
        // A template that does not load or parse leaves completions served and chats
        // answered with why (the CLI says it at start).
        let mut info = info;
        let template = match &info.chat_template {
            Ok(_) => match ChatTemplate::load(&info.tokenizer_dir()) {
                Ok(mut t) => {
                    t.tokenizer_adds_bos = tokenizer.encode("").is_ok_and(|ids| !ids.is_empty());
                    Some(t)
                }
                Err(why) => {
                    info.chat_template = Err(why);
                    None
                }
            },
            Err(_) => None,
        };
        Ok(Session {
            commands: Mutex::new(commands),
            tokenizer,
            gauges,
            metrics: Arc::new(RequestMetrics::default()),
            info,
            template,
            grammars: OnceLock::new(),
            worker: Mutex::new(Some(worker)),
        })
    }

    /// What the session was opened with.
    pub fn info(&self) -> &SessionInfo {
        &self.info
    }

    /// The live counts (queue, running, tokens, steps, KV blocks).
    pub fn gauges(&self) -> &Gauges {
        &self.gauges
    }

    /// Per-request figures (time to first token, inter-token times, finishes).
    pub fn metrics(&self) -> &RequestMetrics {
        &self.metrics
    }

    /// Token ids of `text` (BOS first where the card uses one).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer.encode(text).map_err(|e| e.to_string())
    }

    /// The prompt text of a chat: the checkpoint's template rendered over `messages`
    /// (role, content) with the generation prompt added; without a template, why not.
    pub fn chat_prompt(&self, messages: &[(String, String)]) -> Result<String, String> {
        match (&self.template, &self.info.chat_template) {
            (Some(t), _) => t.render(messages),
            (None, Err(why)) => Err(why.clone()),
            (None, Ok(_)) => Err("the chat template was not loaded".to_string()),
        }
    }

    /// Queues a completion; its text arrives on the receiver, ending with
    /// [`Piece::End`]. Dropping the receiver cancels it before its next step.
    pub fn submit(
        &self,
        completion: Completion,
    ) -> Result<UnboundedReceiver<Piece>, SubmitRefusal> {
        self.submit_all(vec![completion])?
            .pop()
            .ok_or_else(|| SubmitRefusal::Unavailable("nothing was queued".to_string()))
    }

    /// Queues completions together (one receiver each, in order), so they start in the
    /// same step or batch (`moec batch` submits a batch this way); refused whole, before
    /// anything is queued, if any of them is.
    pub fn submit_all(
        &self,
        completions: Vec<Completion>,
    ) -> Result<Vec<UnboundedReceiver<Piece>>, SubmitRefusal> {
        let info = &self.info;
        for completion in &completions {
            let len = completion.prompt.len();
            if len + completion.max_tokens > info.context {
                return Err(SubmitRefusal::Invalid(format!(
                    "the prompt has {len} tokens; with max_tokens {} that is past this server's context of {} tokens (prompt and completion; --context, at most the model's)",
                    completion.max_tokens, info.context
                )));
            }
            if len > info.max_prompt {
                return Err(SubmitRefusal::Invalid(format!(
                    "the prompt has {len} tokens; this server's schedule was compiled for prompts of at most {} (--max-prompt)",
                    info.max_prompt
                )));
            }
            if completion.max_tokens == 0 || completion.max_tokens > info.max_tokens {
                return Err(SubmitRefusal::Invalid(format!(
                    "max_tokens must be between 1 and {} (--max-tokens), not {}",
                    info.max_tokens, completion.max_tokens
                )));
            }
        }
        // Grammars first, so a bad schema refuses the whole submission before anything runs.
        let mut constraints = Vec::with_capacity(completions.len());
        for completion in &completions {
            constraints.push(match &completion.format {
                None => None,
                Some(format) => Some(self.constraint(format)?),
            });
        }
        let mut receivers = Vec::with_capacity(completions.len());
        let mut sequences: Vec<(SeqRequest, Box<dyn TokenSink>)> =
            Vec::with_capacity(completions.len());
        let submitted = Instant::now();
        for (completion, constraint) in completions.into_iter().zip(constraints) {
            let (tx, rx) = unbounded_channel();
            self.metrics
                .prompt_tokens
                .fetch_add(completion.prompt.len() as u64, Ordering::Relaxed);
            let sink = TextSink {
                metrics: Arc::clone(&self.metrics),
                submitted,
                last_token: None,
                tokenizer: Arc::clone(&self.tokenizer),
                prompt: completion.prompt.clone(),
                generated: Vec::new(),
                emitted: 0,
                stop: completion
                    .stop
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .collect(),
                stopped: false,
                constraint,
                tx,
            };
            let request = SeqRequest {
                prompt: completion.prompt,
                max_new_tokens: completion.max_tokens,
                sampling: completion.sampling,
                seed: completion.seed,
                stop_at_eos: true,
            };
            sequences.push((request, Box::new(sink)));
            receivers.push(rx);
        }
        let commands = crate::runtime::sync::lock(&self.commands);
        commands
            .send(Command::Submit(sequences))
            .map_err(|_| SubmitRefusal::Unavailable("the session has stopped".to_string()))?;
        Ok(receivers)
    }

    /// The grammar of `format` over this model's tokens, ready to mask a sequence's logits.
    fn constraint(
        &self,
        format: &ResponseFormat,
    ) -> Result<Box<dyn TokenConstraint>, SubmitRefusal> {
        let factory = self
            .grammars
            .get_or_init(|| grammar_factory(&self.tokenizer, self.info.vocab, self.info.eos_token))
            .as_ref()
            .map_err(|e| {
                SubmitRefusal::Unavailable(format!(
                    "response_format is not available with this tokenizer: {e}"
                ))
            })?;
        let mut schema = match format {
            ResponseFormat::JsonObject => serde_json::json!({"type": "object"}),
            ResponseFormat::JsonSchema(schema) => schema.clone(),
            ResponseFormat::Lark(_) => serde_json::Value::Null,
        };
        // Compact JSON unless the schema says otherwise: with free whitespace between
        // tokens a weak model can fill its whole `max_tokens` with blanks.
        if let Some(object) = schema.as_object_mut() {
            object
                .entry("x-guidance")
                .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
        }
        let grammar = match format {
            ResponseFormat::Lark(lark) => llguidance::api::TopLevelGrammar::from_lark(lark.clone()),
            _ => llguidance::api::TopLevelGrammar::from_json_schema(schema),
        };
        let parser = factory.create_parser(grammar).map_err(|e| {
            SubmitRefusal::Invalid(format!("response_format: the schema is not usable: {e}"))
        })?;
        let matcher = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(SubmitRefusal::Invalid(format!(
                "response_format: the schema is not usable: {e}"
            )));
        }
        Ok(Box::new(Grammar {
            matcher,
            eos: self.info.eos_token,
        }))
    }

    /// Takes no more completions; the live ones finish until `deadline`, then are
    /// cancelled. Returns once the worker has ended, with its error if the run failed.
    pub fn shutdown(&self, deadline: Instant) -> Result<(), String> {
        {
            let commands = crate::runtime::sync::lock(&self.commands);
            // A worker already gone has nothing left to drain.
            let _ = commands.send(Command::Drain { deadline });
        }
        let Some(worker) = crate::runtime::sync::lock(&self.worker).take() else {
            return Ok(());
        };
        worker
            .join()
            .map_err(|_| "the session thread panicked".to_string())?
    }

    /// Whether the worker is still serving.
    pub fn is_running(&self) -> bool {
        crate::runtime::sync::lock(&self.worker)
            .as_ref()
            .is_some_and(|w| !w.is_finished())
    }
}

impl SessionInfo {
    fn tokenizer_dir(&self) -> std::path::PathBuf {
        match &self.chat_template {
            Ok(path) => std::path::Path::new(path)
                .parent()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default(),
            Err(_) => std::path::PathBuf::new(),
        }
    }
}

/// KV tokens per sequence of the default budget with a context: KV is given as sequences
/// grow, so this bounds what is held at once, not any one sequence (which may take its
/// whole micro-batch's pool).
pub const DEFAULT_KV_CONTEXT: usize = 4096;

/// How big a session's plan and limits are, from its request and the card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SessionSizes {
    /// Longest prompt accepted.
    max_prompt: usize,
    /// Longest prompt plus generation.
    context: usize,
    /// KV tokens of the plan, all sequences.
    kv_tokens: usize,
    /// The plan's `gen_len`: `prompt_len + gen_len` is the KV tokens per sequence.
    plan_gen_len: usize,
}

impl SessionSizes {
    fn new(request: &SessionRequest, card: &crate::model::card::ModelCard) -> Result<Self, String> {
        let gen_len = request.run.gen_len;
        let batch = request.max_batch.max(1);
        let Some(asked) = request.context else {
            let context = request.max_prompt + gen_len;
            return Ok(SessionSizes {
                max_prompt: request.max_prompt,
                context,
                kv_tokens: batch * context,
                plan_gen_len: gen_len,
            });
        };
        let limit = usize::try_from(card.max_positions).unwrap_or(usize::MAX);
        let context = asked.min(limit);
        if context < 2 {
            return Err(format!(
                "a context of {context} tokens leaves no room for a prompt"
            ));
        }
        // At the cache's element width: a half cache holds twice the tokens in a budget.
        let token_bytes =
            card.kv_elems_per_token_layer() * request.run.kv_type.bytes() * card.layers;
        let kv_tokens = match request.kv_bytes {
            Some(bytes) => usize::try_from(bytes / token_bytes.max(1)).unwrap_or(usize::MAX),
            None => batch * context.min(DEFAULT_KV_CONTEXT),
        };
        let per_seq = kv_tokens / batch;
        // Every sequence of a full batch must be able to hold one pass's prompt tokens and
        // its whole generation; one sequence may grow to the context by taking the KV of
        // its micro-batch's others.
        let least = request.max_prompt + gen_len;
        if per_seq < least {
            return Err(format!(
                "the KV budget holds {kv_tokens} tokens ({per_seq} per sequence of --max-batch {batch}); \
                 each sequence needs at least --max-prompt + --max-tokens = {least}: raise --kv-mem"
            ));
        }
        Ok(SessionSizes {
            max_prompt: context - 1,
            context,
            kv_tokens: per_seq * batch,
            plan_gen_len: per_seq - request.max_prompt,
        })
    }
}

/// The worker thread: prepares everything, says it is ready, then serves until drained.
fn worker(
    request: SessionRequest,
    ready: mpsc::Sender<Ready>,
    incoming: mpsc::Receiver<Command>,
) -> Result<(), String> {
    let fail = |failure: RunFailure| {
        let text = match &failure {
            RunFailure::Rendered(t) | RunFailure::Message(t) => t.clone(),
        };
        let _ = ready.send(Err(failure));
        text
    };
    let run = &request.run;
    let LoadedModel {
        checkpoint,
        tokenizer,
        ..
    } = load_model(&run.model).map_err(|e| fail(message(&e)))?;
    // The card as the backend lays out its KV cache: `--kv-mem` holds that many tokens.
    let card = crate::runtime::registry::card_for(run.backend, checkpoint.card());
    let name = &run.schedule_name;
    let sizes = SessionSizes::new(&request, &card).map_err(|m| fail(RunFailure::Message(m)))?;
    let target = |plan_gen_len: usize| Target {
        workload: Workload {
            batch: request.max_batch as u64,
            prompt_len: request.max_prompt as u64,
            gen_len: plan_gen_len as u64,
        },
        profile: ProfileUse::Budgets,
    };
    let mut prepared = prepare(run, &card, target(sizes.plan_gen_len)).map_err(fail)?;
    // The plan holds KV for every sequence it seats (micro-batches x their size), which a
    // schedule's own micro-batch size may make more than --max-batch: then it is compiled
    // once more with fewer KV tokens per sequence, so the KV budget is what they all hold.
    if request.context.is_some() {
        let batches = &prepared.plan.micro_batches;
        let seats = (batches.size as usize).saturating_mul(batches.count as usize);
        let per_seat = sizes.kv_tokens / seats.max(1);
        if seats > request.max_batch && per_seat >= request.max_prompt + run.gen_len {
            prepared = prepare(run, &card, target(per_seat - request.max_prompt)).map_err(fail)?;
        }
    }
    let Prepared {
        plan,
        run: options_run,
        mut notes,
        ..
    } = prepared;
    let backend =
        crate::runtime::registry::open(run.backend, &plan, &checkpoint, &options_run.backend)
            .map_err(|e| fail(message(&e)))?;
    let mut session = DriverSession::new(
        &plan,
        &*backend,
        &options_run,
        run.gen_len,
        request.max_prompt,
    )
    .map_err(|e| fail(message(&e)))?
    .without_step_records();
    let prefix_cache = session.on_demand_kv();
    match (request.prefill_budget, prefix_cache) {
        (Some(tokens), true) => {
            session.set_prefill_budget(tokens);
            notes.push(format!(
                "a pass shared by several sequences prefills at most {tokens} prompt tokens over all of them (--prefill-budget; 0: no cap)"
            ));
        }
        (Some(tokens), false) => notes.push(format!(
            "prefill budget {tokens} unused: this schedule's prefill does not attend its KV cache, so it prefills each prompt whole"
        )),
        (None, _) => {}
    }
    if session.static_batches() && !request.batch_wait.is_zero() {
        notes.push(format!(
            "static batches: requests join between batches; one about to start with room \
             waits up to {} ms for more (--batch-wait-ms)",
            request.batch_wait.as_millis()
        ));
    }
    let config = checkpoint.dir().join("tokenizer_config.json");
    let chat_template = if config.is_file() {
        Ok(config.display().to_string())
    } else {
        Err(format!(
            "the checkpoint has no chat template ({} is absent); use /v1/completions with a prompt",
            config.display()
        ))
    };
    let info = SessionInfo {
        model: card.name.clone(),
        schedule: name.clone(),
        backend: backend.describe(),
        // Without chunked prefill (a plan whose prefill does not attend its cache) a
        // prompt must fit one pass.
        max_prompt: if prefix_cache {
            sizes.max_prompt
        } else {
            sizes.max_prompt.min(request.max_prompt)
        },
        prefill_chunk: request.max_prompt,
        context: sizes.context,
        // What the pools hold (the plan's KV is per micro-batch: its own sequence count
        // times the tokens per sequence, which may differ from `max_batch`'s).
        kv_tokens: {
            let g = session.gauges();
            let total = g.kv_blocks_total.load(Ordering::Relaxed)
                * g.kv_block_tokens.load(Ordering::Relaxed);
            usize::try_from(total).unwrap_or(sizes.kv_tokens)
        },
        max_tokens: run.gen_len,
        max_batch: request.max_batch,
        tokenizer: tokenizer.origin().to_string(),
        chat_template,
        notes,
        prefix_cache,
        vocab: card.vocab as usize,
        eos_token: card.eos_token_id,
    };
    let gauges = session.gauges();
    if ready.send(Ok((info, Arc::new(tokenizer), gauges))).is_err() {
        return Ok(()); // nobody waits for this session any more
    }
    serve(session, incoming, request.batch_wait)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Turns a sequence's tokens into text pieces: decoded in context, held back while the
/// text ends in an incomplete character or in what may be the start of a stop string, cut
/// at the first stop string (which then cancels the sequence).
struct TextSink {
    metrics: Arc<RequestMetrics>,
    /// When the completion was handed to the session.
    submitted: Instant,
    /// When its last token came.
    last_token: Option<Instant>,
    tokenizer: Arc<TextTokenizer>,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    /// Bytes of the continuation already sent.
    emitted: usize,
    stop: Vec<String>,
    stopped: bool,
    /// The grammar its tokens follow, handed to the session at submission.
    constraint: Option<Box<dyn TokenConstraint>>,
    tx: UnboundedSender<Piece>,
}

impl TextSink {
    fn text(&self) -> String {
        self.tokenizer
            .decode_continuation(&self.prompt, &self.generated)
            .unwrap_or_default()
    }

    /// Sends `text[emitted..upto]`.
    fn send_upto(&mut self, text: &str, upto: usize) {
        if upto > self.emitted {
            if let Some(piece) = text.get(self.emitted..upto) {
                let _ = self.tx.send(Piece::Text(piece.to_string()));
                self.emitted = upto;
            }
        }
    }
}

/// Bytes of `text` that are safe to send: before a trailing replacement character (an
/// incomplete UTF-8 sequence the next token completes) and before a suffix that is the
/// start of a stop string.
fn safe_prefix(text: &str, stop: &[String]) -> usize {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    for s in stop {
        for (i, _) in text[..end].char_indices() {
            if s.starts_with(&text[i..end]) {
                end = i;
                break;
            }
        }
    }
    end
}

impl TokenSink for TextSink {
    fn token(&mut self, token: u32) -> bool {
        let now = Instant::now();
        match self.last_token {
            None => self
                .metrics
                .time_to_first_token
                .observe((now - self.submitted).as_secs_f64()),
            Some(last) => self.metrics.inter_token.observe((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        self.metrics
            .completion_tokens
            .fetch_add(1, Ordering::Relaxed);
        self.generated.push(token);
        let text = self.text();
        let first_stop = self.stop.iter().filter_map(|s| text.find(s.as_str())).min();
        if let Some(at) = first_stop {
            self.send_upto(&text, at);
            self.stopped = true;
            return false;
        }
        let upto = safe_prefix(&text, &self.stop);
        self.send_upto(&text, upto);
        !self.tx.is_closed()
    }

    fn end(&mut self, end: Result<SeqEnd, SeqError>) {
        let reason = match end {
            _ if self.stopped => FinishReason::Stop,
            Ok(SeqEnd::Eos) => FinishReason::Stop,
            Ok(SeqEnd::Length) => FinishReason::Length,
            Ok(SeqEnd::Cancelled) => FinishReason::Cancelled,
            Err(SeqError::Refused(why)) => FinishReason::Refused(why),
            Err(SeqError::Failed(why)) => FinishReason::Failed(why),
        };
        if matches!(reason, FinishReason::Length | FinishReason::Stop) && !self.stopped {
            let text = self.text();
            let len = text.len();
            self.send_upto(&text, len);
        }
        self.metrics.finish(&reason);
        let _ = self.tx.send(Piece::End {
            reason,
            token_ids: std::mem::take(&mut self.generated),
        });
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    fn take_constraint(&mut self) -> Option<Box<dyn TokenConstraint>> {
        self.constraint.take()
    }
}

/// llguidance's parser factory over this tokenizer's tokens: each token's bytes from the
/// tokenizer's `tokenizer.json`, ids past the tokenizer's (a vocabulary padded for the
/// model) as special tokens no grammar allows.
fn grammar_factory(
    tokenizer: &TextTokenizer,
    vocab: usize,
    eos: u32,
) -> Result<llguidance::ParserFactory, String> {
    use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
    let json: serde_json::Value = serde_json::from_str(&tokenizer.to_json()?)
        .map_err(|e| format!("the tokenizer's JSON does not parse: {e}"))?;
    let mut words =
        llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
    while words.len() < vocab {
        // 0xff opens a special token's name in toktrie's convention.
        let mut word = vec![0xff];
        word.extend(format!("<[{}]>", words.len()).bytes());
        words.push(word);
    }
    let info = TokRxInfo::new(words.len() as u32, eos);
    let trie = TokTrie::from(&info, &words);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = llguidance::ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    Ok(factory)
}

/// A sequence's `response_format` grammar (see [`ResponseFormat`]).
struct Grammar {
    matcher: llguidance::Matcher,
    eos: u32,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("eos", &self.eos).finish()
    }
}

impl TokenConstraint for Grammar {
    fn mask(&mut self, logits: &mut [f32]) {
        // Once the grammar is complete (or has failed) only the end token is allowed.
        match self.matcher.compute_mask_or_eos() {
            Ok(allowed) => {
                for (token, logit) in logits.iter_mut().enumerate() {
                    if !allowed.is_allowed(token as u32) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
            Err(_) => {
                for (token, logit) in logits.iter_mut().enumerate() {
                    if token as u32 != self.eos {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }

    fn accept(&mut self, token: u32) {
        // A token the grammar refuses leaves the matcher in its error state, whose masks
        // allow only the end token: the completion ends.
        let _ = self.matcher.consume_token(token);
    }
}

/// A checkpoint's chat template (`tokenizer_config.json`'s `chat_template`, a string or
/// the entry named `default` of a list), with its BOS and EOS token texts.
struct ChatTemplate {
    source: String,
    bos: String,
    eos: String,
    /// The tokenizer puts a BOS first when it encodes (set once the tokenizer is known).
    tokenizer_adds_bos: bool,
}

impl ChatTemplate {
    fn load(dir: &std::path::Path) -> Result<ChatTemplate, String> {
        let path = dir.join("tokenizer_config.json");
        let text = crate::textfile::read_capped(&path, crate::textfile::SOURCE_LIMIT)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let source = match &config["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string)
                .ok_or_else(|| {
                    format!("{}: `chat_template` has no `default` entry", path.display())
                })?,
            _ => {
                return Err(format!(
                    "{}: no string `chat_template`; chat completions need one",
                    path.display()
                ))
            }
        };
        let token = |key: &str| match &config[key] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => o
                .get("content")
                .and_then(|c| c.as_str())
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        let template = ChatTemplate {
            source,
            bos: token("bos_token"),
            eos: token("eos_token"),
            tokenizer_adds_bos: false,
        };
        // A template that does not parse is refused at start, not at the first chat.
        template.environment()?;
        Ok(template)
    }

    fn environment(&self) -> Result<minijinja::Environment<'_>, String> {
        let mut env = minijinja::Environment::new();
        // Hugging Face templates call Python string methods (`.strip()`, `.startswith()`).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", &self.source)
            .map_err(|e| format!("the chat template does not parse: {e}"))?;
        Ok(env)
    }

    fn render(&self, messages: &[(String, String)]) -> Result<String, String> {
        let env = self.environment()?;
        let template = env.get_template("chat").map_err(|e| e.to_string())?;
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        let text = template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos,
                eos_token => self.eos,
            })
            .map_err(|e| format!("the chat template failed: {e}"))?;
        // Templates write the BOS token themselves and the tokenizer adds it again when it
        // encodes (as it does for every prompt): the template's copy goes, so the prompt
        // starts with one BOS, as the model was trained.
        Ok(match text.strip_prefix(self.bos.as_str()) {
            Some(rest) if self.tokenizer_adds_bos && !self.bos.is_empty() => rest.to_string(),
            _ => text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_back_text_is_an_incomplete_character_or_a_stop_prefix() {
        let stop = vec!["\n\nUser:".to_string()];
        assert_eq!(safe_prefix("Hello", &stop), 5);
        assert_eq!(safe_prefix("Hello\n", &stop), 5);
        assert_eq!(safe_prefix("Hello\n\nUs", &stop), 5);
        assert_eq!(safe_prefix("Hello\u{FFFD}", &stop), 5);
        assert_eq!(safe_prefix("Hello\nX", &stop), 7);
    }
}
