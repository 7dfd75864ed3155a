//! `moec serve`'s HTTP side: an OpenAI-compatible server over an engine
//! [`Session`](crate::engine::session::Session).
//!
//! Takes an open session and a [`ServeConfig`]; serves `/v1/completions`,
//! `/v1/chat/completions` (streaming as server-sent events ending in `data: [DONE]`, or
//! one JSON body), `/v1/models`, `/health` and `/metrics` (Prometheus text) until SIGINT
//! or SIGTERM, then stops accepting, lets in-flight completions finish until the grace
//! deadline, cancels the rest and returns. Only HTTP lives here: tokens, batching and
//! stop strings are the session's. Every refusal is a 4xx in OpenAI's error shape: a body
//! over `max_body_bytes` (413), JSON that does not parse or has a field of the wrong type
//! (400), a prompt longer than the schedule was compiled for or `max_tokens` outside
//! 1..=the compiled generation length (400), a missing or wrong API key (401), more than
//! `max_connections` requests at once (429). A client that goes away drops its receiver,
//! which cancels its sequence before the session's next step.

pub mod openai;
pub mod tools;

use crate::engine::session::{
    Completion, FinishReason, Histogram, Piece, ResponseFormat, Session, SubmitRefusal,
    FINISH_LABELS,
};
use crate::model::vocab::Sampling;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use openai::{ApiError, ChatRequest, CompletionRequest};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Semaphore;

/// How the server listens and what it bounds.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to bind (loopback unless told otherwise).
    pub addr: SocketAddr,
    /// Bearer token every `/v1/*` and `/metrics` request must carry, if set.
    pub api_key: Option<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Requests handled at once; more get 429.
    pub max_connections: usize,
    /// After SIGINT/SIGTERM, how long in-flight completions may run before they are
    /// cancelled.
    pub grace: Duration,
}

/// What every handler shares.
struct Shared {
    session: Arc<Session>,
    api_key: Option<String>,
    slots: Semaphore,
    in_flight: AtomicU64,
    requests: AtomicU64,
    next_id: AtomicU64,
}

/// Serves until SIGINT/SIGTERM (or `stop` resolves), then drains the session. `listening`
/// is told the bound address once the socket accepts (the CLI prints it).
pub fn run(
    session: Arc<Session>,
    config: ServeConfig,
    listening: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    runtime.block_on(serve(session, config, listening))
}

async fn serve(
    session: Arc<Session>,
    config: ServeConfig,
    listening: impl FnOnce(SocketAddr),
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.addr))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let shared = Arc::new(Shared {
        session: Arc::clone(&session),
        api_key: config.api_key.clone(),
        slots: Semaphore::new(config.max_connections.max(1)),
        in_flight: AtomicU64::new(0),
        requests: AtomicU64::new(0),
        next_id: AtomicU64::new(0),
    });
    let app = router(Arc::clone(&shared), config.max_body_bytes);
    listening(addr);
    let (signalled_tx, signalled_rx) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown_signal().await;
        let _ = signalled_tx.send(true);
    };
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown);
    let grace = config.grace;
    let drained = async move {
        let mut rx = signalled_rx;
        // Wait for the signal, then drain the session (blocking: it joins the worker).
        while !*rx.borrow() {
            if rx.changed().await.is_err() {
                return Ok(());
            }
        }
        let deadline = Instant::now() + grace;
        let session = Arc::clone(&session);
        tokio::task::spawn_blocking(move || session.shutdown(deadline))
            .await
            .map_err(|e| format!("the drain failed: {e}"))?
    };
    let (served, drained) = tokio::join!(
        async {
            // Connections that outlive the drain (an idle keep-alive client) do not hold
            // the exit past the grace deadline and a little more.
            server.await.map_err(|e| format!("the server failed: {e}"))
        },
        drained
    );
    served?;
    drained
}

/// SIGINT or SIGTERM: through the process's signal watcher (`tempfiles`, which `main`
/// installs and which then owns both signals), or tokio's handlers where no watcher runs.
async fn shutdown_signal() {
    let notify = Arc::new(tokio::sync::Notify::new());
    let told = Arc::clone(&notify);
    crate::tempfiles::on_first_interrupt(move |_| told.notify_one());
    let interrupt = async {
        tokio::select! {
            _ = notify.notified() => {},
            _ = tokio::signal::ctrl_c() => {},
        }
    };
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                // Without a SIGTERM handler SIGINT still works.
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = interrupt => {},
            _ = term => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

fn router(shared: Arc<Shared>, max_body_bytes: usize) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            authorize,
        ));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            bound_connections,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
        .with_state(shared)
}

/// 429 past `max_connections` requests at once; counts what is in flight.
async fn bound_connections(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let Ok(_permit) = shared.slots.try_acquire() else {
        return ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "too many requests at once; retry later",
        )
        .into_response();
    };
    shared.requests.fetch_add(1, Ordering::Relaxed);
    shared.in_flight.fetch_add(1, Ordering::Relaxed);
    let response = next.run(request).await;
    shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    // A streamed body outlives this: the permit bounds requests being set up, and the
    // session's queue bounds the sequences.
    response
}

/// `Authorization: Bearer KEY`, compared in constant time, where a key is set.
async fn authorize(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    if let Some(key) = &shared.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !keys_match(given.as_bytes(), key.as_bytes()) {
            let mut e = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "a valid API key is required: `Authorization: Bearer KEY`",
            );
            e.code = Some("invalid_api_key");
            return e.into_response();
        }
    }
    next.run(request).await
}

/// Equal keys, in time that does not depend on where they differ (only a difference in
/// length, which says nothing of the key's bytes, returns early).
fn keys_match(given: &[u8], key: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    given.ct_eq(key).into()
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such endpoint; moec serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics",
    )
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    if shared.session.is_running() {
        (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the session has stopped",
        )
        .into_response()
    }
}

async fn models(State(shared): State<Arc<Shared>>) -> axum::Json<Value> {
    let info = shared.session.info();
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": info.model,
            "object": "model",
            "created": 0,
            "owned_by": "moec",
            "schedule": info.schedule,
            "max_prompt_tokens": info.max_prompt,
            "context_tokens": info.context,
            "prefill_chunk_tokens": info.prefill_chunk,
            "max_tokens": info.max_tokens,
            "max_batch": info.max_batch,
            "prefix_cache": info.prefix_cache,
        }]
    }))
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    use crate::engine::session::Gauges;
    let g = shared.session.gauges();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let step_total = Gauges::seconds(&g.step_seconds_total);
    let tokens = load(&g.generated_tokens);
    let rate = if step_total > 0.0 {
        tokens as f64 / step_total
    } else {
        0.0
    };
    let mut text = String::new();
    let mut put = |name: &str, kind: &str, help: &str, value: String| {
        text.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    };
    put(
        "moec_queue_length",
        "gauge",
        "Sequences waiting for admission.",
        load(&g.waiting).to_string(),
    );
    put(
        "moec_running_sequences",
        "gauge",
        "Sequences admitted and not ended.",
        load(&g.running).to_string(),
    );
    put(
        "moec_generated_tokens_total",
        "counter",
        "Tokens generated.",
        tokens.to_string(),
    );
    put(
        "moec_prefill_tokens_total",
        "counter",
        "Prompt tokens prefilled (re-prefills included).",
        load(&g.prefill_tokens).to_string(),
    );
    put(
        "moec_steps_total",
        "counter",
        "Steps run.",
        load(&g.steps).to_string(),
    );
    put(
        "moec_step_seconds_last",
        "gauge",
        "Seconds of the last step.",
        format!("{}", Gauges::seconds(&g.last_step_seconds)),
    );
    put(
        "moec_step_seconds_total",
        "counter",
        "Seconds spent in steps.",
        format!("{step_total}"),
    );
    put(
        "moec_tokens_per_second",
        "gauge",
        "Generated tokens per second of step time.",
        format!("{rate}"),
    );
    put(
        "moec_kv_blocks_used",
        "gauge",
        "KV blocks held by running sequences.",
        load(&g.kv_blocks_used).to_string(),
    );
    put(
        "moec_kv_blocks_total",
        "gauge",
        "KV blocks in all micro-batches.",
        load(&g.kv_blocks_total).to_string(),
    );
    put(
        "moec_kv_blocks_free",
        "gauge",
        "KV blocks free in all micro-batches.",
        load(&g.kv_blocks_free).to_string(),
    );
    put(
        "moec_kv_blocks_used_peak",
        "gauge",
        "The most KV blocks running sequences held at once.",
        load(&g.kv_blocks_used_peak).to_string(),
    );
    put(
        "moec_kv_block_tokens",
        "gauge",
        "Tokens per KV block.",
        load(&g.kv_block_tokens).to_string(),
    );
    put(
        "moec_kv_blocks_cached",
        "gauge",
        "Free KV blocks that hold a cached prefix (given out when needed).",
        load(&g.kv_blocks_cached).to_string(),
    );
    put(
        "moec_prefix_cache_hits_total",
        "counter",
        "Sequences admitted that took blocks from the prefix cache.",
        load(&g.prefix_hits).to_string(),
    );
    put(
        "moec_prefix_cache_hit_tokens_total",
        "counter",
        "Tokens taken from the prefix cache instead of being run.",
        load(&g.prefix_cached_tokens).to_string(),
    );
    put(
        "moec_prefix_cache_queried_tokens_total",
        "counter",
        "Tokens of every sequence admitted (prompt and re-prefilled tokens).",
        load(&g.prefix_queried_tokens).to_string(),
    );
    put(
        "moec_preemptions_total",
        "counter",
        "Sequences preempted.",
        load(&g.preemptions).to_string(),
    );
    put(
        "moec_cancelled_total",
        "counter",
        "Sequences cancelled.",
        load(&g.cancelled).to_string(),
    );
    put(
        "moec_http_requests_in_flight",
        "gauge",
        "HTTP requests being handled.",
        load(&shared.in_flight).to_string(),
    );
    put(
        "moec_http_requests_total",
        "counter",
        "HTTP requests accepted.",
        load(&shared.requests).to_string(),
    );
    let m = shared.session.metrics();
    put(
        "moec_request_prompt_tokens_total",
        "counter",
        "Prompt tokens of the completions submitted.",
        load(&m.prompt_tokens).to_string(),
    );
    put(
        "moec_request_completion_tokens_total",
        "counter",
        "Tokens the completions received.",
        load(&m.completion_tokens).to_string(),
    );
    text.push_str("# HELP moec_requests_finished_total Completions ended, by why.\n");
    text.push_str("# TYPE moec_requests_finished_total counter\n");
    for (reason, count) in FINISH_LABELS.iter().zip(&m.finished) {
        text.push_str(&format!(
            "moec_requests_finished_total{{reason=\"{reason}\"}} {}\n",
            load(count)
        ));
    }
    histogram(
        &mut text,
        "moec_time_to_first_token_seconds",
        "Seconds from a completion's submission to its first token.",
        &m.time_to_first_token,
    );
    histogram(
        &mut text,
        "moec_inter_token_seconds",
        "Seconds between consecutive tokens of a completion.",
        &m.inter_token,
    );
    text.push_str("# HELP moec_arena_bytes Bytes of the plan's arenas per memory space.\n");
    text.push_str("# TYPE moec_arena_bytes gauge\n");
    for (space, bytes) in ["gpu", "pinned", "host"].iter().zip(&g.arena_bytes) {
        text.push_str(&format!(
            "moec_arena_bytes{{space=\"{space}\"}} {}\n",
            load(bytes)
        ));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// One histogram in Prometheus' text format: cumulative `_bucket` lines by `le`, then
/// `_sum` and `_count`.
fn histogram(text: &mut String, name: &str, help: &str, h: &Histogram) {
    text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
    let cumulative = h.cumulative();
    for (i, count) in cumulative.iter().enumerate() {
        let le = h
            .bounds
            .get(i)
            .map_or_else(|| "+Inf".to_string(), |b| format!("{b}"));
        text.push_str(&format!("{name}_bucket{{le=\"{le}\"}} {count}\n"));
    }
    text.push_str(&format!("{name}_sum {}\n", h.sum()));
    text.push_str(&format!(
        "{name}_count {}\n",
        cumulative.last().copied().unwrap_or(0)
    ));
}

/// The body, or 413 past the limit.
fn body_or_413(
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status();
        let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is larger than this server accepts (--max-body)".to_string()
        } else {
            format!("cannot read the request body: {e}")
        };
        ApiError::new(status, "invalid_request_error", kind)
    })
}

/// Checks the shared fields and builds the session's completion.
fn completion(
    shared: &Shared,
    prompt: Vec<u32>,
    s: &openai::Sampling,
    default_max: usize,
) -> Result<Completion, ApiError> {
    if let Some(n) = s.n {
        if n != 1 {
            return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
        }
    }
    let max_tokens = s.max_completion_tokens.or(s.max_tokens);
    let info = shared.session.info();
    let max_tokens = match max_tokens {
        None => default_max.min(info.max_tokens),
        Some(m) if m == 0 || m > info.max_tokens as u64 => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens must be between 1 and {} (this server's --max-tokens), not {m}",
                    info.max_tokens
                ),
                Some("max_tokens"),
            ))
        }
        Some(m) => m as usize,
    };
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("temperature must be between 0 and 2, not {temperature}"),
            Some("temperature"),
        ));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("top_p must be in (0, 1], not {top_p}"),
            Some("top_p"),
        ));
    }
    let stop = s
        .stop
        .clone()
        .map(openai::OneOrMany::into_vec)
        .unwrap_or_default();
    if stop.len() > 4 {
        return Err(ApiError::invalid("at most 4 stop strings", Some("stop")));
    }
    let sampling = if temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::Temperature {
            temperature: temperature as f32,
            top_p: top_p as f32,
        }
    };
    // Without a seed each request samples differently, as OpenAI's API does.
    let seed = match s.seed {
        Some(seed) => seed as u64,
        None => {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
                ^ shared
                    .next_id
                    .load(Ordering::Relaxed)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        }
    };
    let format = match &s.response_format {
        None | Some(openai::ResponseFormat::Text) => None,
        Some(openai::ResponseFormat::JsonObject) => Some(ResponseFormat::JsonObject),
        Some(openai::ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
            Some(schema) if schema.is_object() => Some(ResponseFormat::JsonSchema(schema.clone())),
            _ => {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema must be a JSON schema object",
                    Some("response_format"),
                ))
            }
        },
    };
    Ok(Completion {
        prompt,
        max_tokens,
        sampling,
        seed,
        stop,
        format,
    })
}

/// Submits and waits for the first piece, so a refusal is a 4xx status, not a stream.
async fn start(
    shared: &Shared,
    completion: Completion,
    tool_call: bool,
) -> Result<(UnboundedReceiver<Piece>, Piece), ApiError> {
    let mut rx = shared.session.submit(completion).map_err(|e| match e {
        // A tool call's grammar is the session's `response_format` path: its refusal is
        // about the tools' parameters schemas.
        SubmitRefusal::Invalid(m) if tool_call && m.starts_with("response_format") => {
            ApiError::invalid(
                format!(
                    "tools: a parameters schema is not usable{}",
                    m.split_once(" not usable").map_or("", |(_, rest)| rest)
                ),
                Some("tools"),
            )
        }
        SubmitRefusal::Invalid(m) if m.starts_with("response_format") => {
            ApiError::invalid(m, Some("response_format"))
        }
        SubmitRefusal::Invalid(m) => ApiError::invalid(m, Some("prompt")),
        SubmitRefusal::Unavailable(m) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", m)
        }
    })?;
    let first = rx.recv().await.ok_or_else(|| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the session ended the completion without a word",
        )
    })?;
    match &first {
        Piece::End {
            reason: FinishReason::Refused(why),
            ..
        } => Err(ApiError::invalid(why.clone(), Some("prompt"))),
        Piece::End {
            reason: FinishReason::Failed(why),
            ..
        } => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            why.clone(),
        )),
        _ => Ok((rx, first)),
    }
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(
    State(shared): State<Arc<Shared>>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_or_413(body)?;
    let request: CompletionRequest = openai::parse(&body)?;
    let prompts = request.prompt.into_vec();
    let [prompt] = prompts.as_slice() else {
        return Err(ApiError::invalid(
            "exactly one prompt per request is supported",
            Some("prompt"),
        ));
    };
    let ids = shared
        .session
        .encode(prompt)
        .map_err(|e| ApiError::invalid(e, Some("prompt")))?;
    let prompt_tokens = ids.len();
    let c = completion(&shared, ids, &request.sampling, 16)?;
    respond(
        &shared,
        Kind::Completion,
        c,
        prompt_tokens,
        &request.sampling,
        false,
    )
    .await
}

async fn chat_completions(
    State(shared): State<Arc<Shared>>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_or_413(body)?;
    let request: ChatRequest = openai::parse(&body)?;
    if request.messages.is_empty() {
        return Err(ApiError::invalid("messages is empty", Some("messages")));
    }
    let tool_use = tools::tool_use(request.tools.as_deref(), request.tool_choice.as_ref())?;
    if tool_use.is_some()
        && !matches!(
            request.sampling.response_format,
            None | Some(openai::ResponseFormat::Text)
        )
    {
        return Err(ApiError::invalid(
            "response_format and a tool call cannot both shape one output",
            Some("response_format"),
        ));
    }
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    for (i, m) in request.messages.into_iter().enumerate() {
        let mut text = match m.content {
            Some(c) => c.text()?,
            None if m.tool_calls.is_some() => String::new(),
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}] has no content"),
                    Some("messages"),
                ))
            }
        };
        if let Some(calls) = &m.tool_calls {
            let calls = tools::history_text(calls, i)?;
            if !text.is_empty() && !calls.is_empty() {
                text.push('\n');
            }
            text.push_str(&calls);
        }
        messages.push((m.role, text));
    }
    // The tools go to the model as system text, merged into a leading system message
    // so templates that take one system message still render.
    if let Some(tool_use) = &tool_use {
        let about = tools::system_text(&tool_use.tools);
        match messages.first_mut() {
            Some((role, text)) if role == "system" => {
                text.push_str("\n\n");
                text.push_str(&about);
            }
            _ => messages.insert(0, ("system".to_string(), about)),
        }
    }
    let text = shared
        .session
        .chat_prompt(&messages)
        .map_err(|e| ApiError::invalid(e, Some("messages")))?;
    let ids = shared
        .session
        .encode(&text)
        .map_err(|e| ApiError::invalid(e, Some("messages")))?;
    let prompt_tokens = ids.len();
    let max = shared.session.info().max_tokens;
    let mut c = completion(&shared, ids, &request.sampling, max)?;
    if let Some(t) = &tool_use {
        c.format = Some(if t.optional {
            ResponseFormat::Lark(tools::auto_grammar(&t.tools))
        } else {
            ResponseFormat::JsonSchema(tools::call_schema(&t.tools))
        });
    }
    respond(
        &shared,
        Kind::Chat,
        c,
        prompt_tokens,
        &request.sampling,
        tool_use.is_some(),
    )
    .await
}

fn finish_reason(reason: &FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        // Not an OpenAI value: the server shut down (or the client left) first.
        FinishReason::Cancelled => "cancelled",
        FinishReason::Refused(_) | FinishReason::Failed(_) => "error",
    }
}

async fn respond(
    shared: &Shared,
    kind: Kind,
    c: Completion,
    prompt_tokens: usize,
    s: &openai::Sampling,
    tool_call: bool,
) -> Result<Response, ApiError> {
    let id_number = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Completion => format!("cmpl-{id_number}"),
        Kind::Chat => format!("chatcmpl-{id_number}"),
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let model = s
        .model
        .clone()
        .unwrap_or_else(|| shared.session.info().model.clone());
    let (rx, first) = start(shared, c, tool_call).await?;
    let meta = Meta {
        tool_call_id: tool_call.then(|| format!("call_{id_number}")),
        kind,
        id,
        created,
        model,
        prompt_tokens,
        include_usage: s.stream_options.as_ref().is_some_and(|o| o.include_usage),
    };
    if s.stream {
        Ok(stream_response(meta, rx, first))
    } else {
        whole_response(meta, rx, first).await
    }
}

/// What every chunk of one response repeats.
struct Meta {
    /// The id of the tool call the output is held to, if it is one.
    tool_call_id: Option<String>,
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    include_usage: bool,
}

impl Meta {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    fn chunk(&self, text: Option<&str>, finish: Option<&str>, first: bool) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
        }
    }
}

async fn whole_response(
    meta: Meta,
    mut rx: UnboundedReceiver<Piece>,
    first: Piece,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut piece = Some(first);
    loop {
        let next = match piece.take() {
            Some(p) => Some(p),
            None => rx.recv().await,
        };
        match next {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::End { reason, token_ids }) => {
                let completion_tokens = token_ids.len();
                match &reason {
                    FinishReason::Cancelled => {
                        return Err(ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "server_error",
                            "the server shut down before the completion finished",
                        ))
                    }
                    FinishReason::Failed(why) | FinishReason::Refused(why) => {
                        return Err(ApiError::new(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "server_error",
                            why.clone(),
                        ))
                    }
                    _ => {}
                }
                let finish = finish_reason(&reason);
                let call = meta
                    .tool_call_id
                    .as_deref()
                    .and_then(|id| tools::call_of(&text, id));
                let choice = match meta.kind {
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
                    }
                    Kind::Chat if call.is_some() => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": null, "tool_calls": [call]},
                        "logprobs": null,
                        "finish_reason": "tool_calls",
                    }),
                    // A call cut by max_tokens is not a call: its text, with `length`.
                    Kind::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": finish,
                    }),
                };
                let object = match meta.kind {
                    Kind::Completion => "text_completion",
                    Kind::Chat => "chat.completion",
                };
                return Ok(axum::Json(json!({
                    "id": meta.id, "object": object, "created": meta.created,
                    "model": meta.model, "choices": [choice],
                    "usage": meta.usage(completion_tokens),
                }))
                .into_response());
            }
            None => {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "the session dropped the completion",
                ))
            }
        }
    }
}

/// Server-sent events: one chunk per text piece, a last chunk with the finish reason,
/// a usage chunk if asked for, then `data: [DONE]`. Dropping the body (the client went
/// away) drops the receiver, which cancels the sequence.
///
/// A tool call (an output that opens with `{` when tools are in use) is sent as OpenAI
/// does: a delta with the call's id, type and name and empty arguments, deltas with the
/// arguments' text, and a last chunk with finish reason `tool_calls`. The first delta goes
/// once the name is known: as soon as `{"name":"N","arguments":` is written (the grammar's
/// order), then the arguments stream as they come, less the last character (it may be
/// the call's closing brace); were the name written last, once the call is whole.
fn stream_response(meta: Meta, rx: UnboundedReceiver<Piece>, first: Piece) -> Response {
    struct St {
        meta: Meta,
        rx: UnboundedReceiver<Piece>,
        pending: Option<Piece>,
        first_chunk: bool,
        done: bool,
        /// A tool call's text so far.
        held: String,
        /// `tool_choice: "auto"` wrote text, not a call.
        text_chosen: bool,
        /// A tool call's whole text.
        whole: String,
        /// The call's first delta (id and name) has been sent.
        opened: bool,
    }
    fn delta_event(meta: &Meta, delta: Value) -> String {
        let mut chunk = meta.chunk(None, None, false);
        chunk["choices"][0]["delta"] = delta;
        format!("data: {chunk}\n\n")
    }
    let event = |v: &Value| Bytes::from(format!("data: {v}\n\n"));
    let state = St {
        meta,
        rx,
        pending: Some(first),
        first_chunk: true,
        done: false,
        held: String::new(),
        text_chosen: false,
        whole: String::new(),
        opened: false,
    };
    let stream = futures_util::stream::unfold(state, move |mut st| async move {
        if st.done {
            return None;
        }
        let mut piece = match st.pending.take() {
            Some(p) => Some(p),
            None => st.rx.recv().await,
        };
        if let Some(id) = st.meta.tool_call_id.clone().filter(|_| !st.text_chosen) {
            let mut out = String::new();
            while let Some(Piece::Text(t)) = &piece {
                st.held.push_str(t);
                st.whole.push_str(t);
                if !st.opened && !st.held.is_empty() && !st.held.starts_with('{') {
                    // `"auto"` chose text (a call opens with `{`): it streams from here.
                    st.text_chosen = true;
                    st.whole.clear();
                    piece = Some(Piece::Text(std::mem::take(&mut st.held)));
                    break;
                }
                if !st.opened {
                    if let Some((name, arguments)) = tools::call_head(&st.held) {
                        let opening = json!({"role": "assistant", "content": null, "tool_calls": [{
                            "index": 0, "id": id, "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }]});
                        st.held = arguments.to_string();
                        out.push_str(&delta_event(&st.meta, opening));
                        st.first_chunk = false;
                        st.opened = true;
                    }
                }
                if st.opened {
                    if let Some((cut, _)) = st.held.char_indices().last().filter(|(c, _)| *c > 0) {
                        let fragment: String = st.held.drain(..cut).collect();
                        let delta = json!({"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]});
                        out.push_str(&delta_event(&st.meta, delta));
                    }
                }
                if !out.is_empty() {
                    return Some((Ok(Bytes::from(out)), st));
                }
                piece = st.rx.recv().await;
            }
        }
        let bytes = match piece {
            Some(Piece::Text(t)) => {
                let chunk = st.meta.chunk(Some(&t), None, st.first_chunk);
                st.first_chunk = false;
                event(&chunk)
            }
            Some(Piece::End { reason, token_ids }) => {
                let completion_tokens = token_ids.len();
                st.done = true;
                let mut out = String::new();
                let mut finish = finish_reason(&reason);
                if let Some(id) = st.meta.tool_call_id.clone().filter(|_| !st.text_chosen) {
                    let held = std::mem::take(&mut st.held);
                    let call = tools::call_of(&st.whole, &id);
                    let failed =
                        matches!(reason, FinishReason::Failed(_) | FinishReason::Refused(_));
                    let deltas = match (&reason, call) {
                        _ if failed => vec![],
                        // The head went out: the rest of the arguments, less the call's
                        // closing brace if it is whole.
                        (_, call) if st.opened => {
                            let rest = match call {
                                Some(_) => {
                                    finish = "tool_calls";
                                    held.strip_suffix('}').unwrap_or(&held).to_string()
                                }
                                None => held,
                            };
                            if rest.is_empty() {
                                vec![]
                            } else {
                                vec![
                                    json!({"tool_calls": [{"index": 0, "function": {"arguments": rest}}]}),
                                ]
                            }
                        }
                        (_, Some(call)) => {
                            finish = "tool_calls";
                            let opening = json!({"role": "assistant", "content": null, "tool_calls": [{
                                "index": 0, "id": call["id"], "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""},
                            }]});
                            let arguments = json!({"tool_calls": [{
                                "index": 0, "function": {"arguments": call["function"]["arguments"]},
                            }]});
                            vec![opening, arguments]
                        }
                        // Cut by max_tokens (or cancelled): the text as it is.
                        (_, None) if held.is_empty() => vec![],
                        (_, None) => vec![json!({"role": "assistant", "content": held})],
                    };
                    for delta in deltas {
                        out.push_str(&delta_event(&st.meta, delta));
                        st.first_chunk = false;
                    }
                }
                let last = match &reason {
                    FinishReason::Failed(why) | FinishReason::Refused(why) => ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        why.clone(),
                    )
                    .body(),
                    _ => st.meta.chunk(None, Some(finish), st.first_chunk),
                };
                out.push_str(&format!("data: {last}\n\n"));
                if st.meta.include_usage {
                    let mut usage = st.meta.chunk(None, None, false);
                    usage["choices"] = json!([]);
                    usage["usage"] = st.meta.usage(completion_tokens);
                    out.push_str(&format!("data: {usage}\n\n"));
                }
                out.push_str("data: [DONE]\n\n");
                Bytes::from(out)
            }
            None => {
                st.done = true;
                Bytes::from_static(b"data: [DONE]\n\n")
            }
        };
        Some((Ok::<Bytes, std::convert::Infallible>(bytes), st))
    });
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    (headers, Body::from_stream(stream)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_only_when_equal() {
        assert!(keys_match(b"secret", b"secret"));
        assert!(!keys_match(b"secreT", b"secret"));
        assert!(!keys_match(b"secret-longer", b"secret"));
        assert!(!keys_match(b"", b"secret"));
    }
}
