//! `moec serve`: opens an engine session for a schedule and serves it over HTTP with the
//! OpenAI API (`crate::serve`) until SIGINT or SIGTERM.

use super::generate::fail;
use super::inputs::{positive_finite, ModelArgs};
use crate::engine::session::{Session, SessionRequest};
use crate::engine::{RunFailure, RunRequest};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// The environment variable `--api-key` falls back to.
pub const API_KEY_ENV: &str = "MOEC_API_KEY";

/// `moec serve` flags.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The `.sched` file.
    pub sched: PathBuf,
    /// Which model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to bind (loopback by default: pass 0.0.0.0 to serve other machines).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (default: the MOEC_API_KEY environment
    /// variable, if set).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Most sequences at once: the plan is compiled for this batch.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Prompt tokens one pass prefills per sequence: the plan's activations are compiled
    /// for --max-batch x this. Where the schedule's prefill attends its KV cache, longer
    /// prompts (up to --context) are prefilled in chunks of it, so a long prompt does not
    /// stall the streams decoding beside it; otherwise it is the longest prompt.
    #[arg(long, default_value_t = 256)]
    pub max_prompt: usize,
    /// Longest prompt plus completion in tokens (default and most: the model's own
    /// context, its card's `max_positions`); a request past it gets 400.
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<usize>,
    /// KV cache memory, e.g. `512MB` (all layers and sequences; blocks are given as
    /// sequences grow); default: the KV of --max-batch sequences of 4096 tokens (or of
    /// the context, if shorter).
    #[arg(long, value_name = "BYTES")]
    pub kv_mem: Option<String>,
    /// Most tokens a completion generates: the plan is compiled for it.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Milliseconds a static batch (a schedule with `prefill` + `decode` whose prefill does
    /// not attend its KV cache, which takes requests only between batches) about to start
    /// with room waits for more requests; schedules with a mixed `step`, or whose prefill
    /// attends the cache (chunked prefill), admit at every pass and never wait.
    #[arg(long, default_value_t = 50)]
    pub batch_wait_ms: u64,
    /// Most prompt tokens a pass shared by several sequences prefills over all of them,
    /// where the schedule's prefill attends its KV cache (chunked prefill); a pass's time
    /// grows with its tokens, so a small budget gives the first of several prompts that
    /// arrive together its first token sooner and keeps the decoding streams' steps short,
    /// at the cost of one more pass per budget's worth of prompt. A lone prompt is not
    /// capped. 0: no cap (all the pass has room for). The default, 32, met llama-server's
    /// TTFT p50 on the shared-prefix bench of docs/serving.md.
    #[arg(long, value_name = "TOKENS", default_value_t = 32)]
    pub prefill_budget: u64,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body: usize,
    /// Requests handled at once; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
    /// Seconds in-flight completions may run after SIGINT/SIGTERM before they are
    /// cancelled.
    #[arg(long, default_value_t = 10.0, value_parser = positive_finite)]
    pub grace: f64,
    /// Override a schedule param: `--set n_ub=8` (repeatable).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub sets: Vec<String>,
    /// Threads of the compute pool (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Emulated host<->GPU link bandwidth, GB/s (copy streams are throttled to it).
    #[arg(long, value_name = "GBPS", value_parser = positive_finite)]
    pub link_gbps: Option<f64>,
    /// Hardware profile whose budgets the plan must fit (name or .ron path); default:
    /// only this machine's memory is checked.
    #[arg(long, value_name = "PROFILE")]
    pub hw: Option<String>,
    /// Backend that executes the plan (the registry's names).
    #[arg(long, default_value = "cpu", value_parser = super::inputs::backend())]
    pub backend: &'static crate::runtime::Registration,
    /// KV cache element type, `f32` or `f16` (half the bytes per token: `--kv-mem` holds
    /// twice the tokens); `cuda` keeps only f32.
    #[arg(long, default_value = "f32", value_parser = super::inputs::kv_type)]
    pub kv_type: crate::model::vocab::KvType,
    /// Seconds without progress before a stalled step is an error.
    #[arg(long, default_value_t = 60.0, value_parser = super::inputs::watchdog_seconds)]
    pub watchdog: f64,
    /// Let the planner pick the params the `--set`s leave open for this server's batch,
    /// prompt and generation lengths, even when the defaults fit (without it: only when
    /// they do not, saying so).
    #[arg(long)]
    pub fit: bool,
}

/// The session's request for the flags.
fn request(args: &ServeArgs) -> Result<SessionRequest, String> {
    let name = args.sched.display().to_string();
    let schedule = crate::textfile::read_capped(&args.sched, crate::textfile::SOURCE_LIMIT)
        .map_err(|e| format!("cannot read {name}: {e}"))?;
    let mut run = RunRequest::new(&name, &schedule, args.max_tokens);
    run.model = args.model.source();
    run.sets = super::inputs::parse_sets(&args.sets)?;
    run.hw = args.hw.clone();
    run.threads = args.threads;
    run.link_gbps = args.link_gbps;
    run.backend = args.backend;
    run.kv_type = args.kv_type;
    run.watchdog = Duration::from_secs_f64(args.watchdog.max(0.01));
    if args.fit {
        run.fit = crate::engine::FitMode::Always;
    }
    let kv_bytes = match &args.kv_mem {
        Some(text) => Some(
            crate::cost::budget::parse_bytes(text).map_err(|e| format!("--kv-mem: {e}"))? as u64,
        ),
        None => None,
    };
    Ok(SessionRequest {
        run,
        max_batch: args.max_batch,
        max_prompt: args.max_prompt,
        context: Some(args.context.unwrap_or(usize::MAX)),
        kv_bytes,
        batch_wait: Duration::from_millis(args.batch_wait_ms),
        prefill_budget: (args.prefill_budget > 0)
            .then(|| usize::try_from(args.prefill_budget).unwrap_or(usize::MAX)),
    })
}

/// Runs `moec serve`: exit 0 after a clean shutdown, 1 when the session cannot open or
/// the run fails.
pub fn run(args: &ServeArgs) -> ExitCode {
    let request = match request(args) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var(API_KEY_ENV).ok())
        .filter(|k| !k.is_empty());
    let session = match Session::open(request) {
        Ok(s) => Arc::new(s),
        Err(RunFailure::Rendered(text)) => {
            eprint!("{text}");
            return ExitCode::from(1);
        }
        Err(RunFailure::Message(m)) => return fail(m),
    };
    let info = session.info().clone();
    if !info.prefix_cache {
        eprintln!(
            "moec serve: no prefix cache: this schedule's prefill does not attend the KV cache \
             its decode reads, so requests that share a prefix each run it"
        );
    }
    for note in &info.notes {
        eprintln!("moec serve: {note}");
    }
    let config = crate::serve::ServeConfig {
        addr: SocketAddr::new(args.host, args.port),
        api_key,
        max_body_bytes: args.max_body,
        max_connections: args.max_connections,
        grace: Duration::from_secs_f64(args.grace),
    };
    let keyed = config.api_key.is_some();
    let result = crate::serve::run(session, config, |addr| {
        eprintln!(
            "moec serve: {} with {} on {} (batch {}, contexts up to {} tokens, prompts prefilled {} tokens a pass, up to {} generated, KV for {} tokens)",
            info.model,
            info.schedule,
            info.backend,
            info.max_batch,
            info.context,
            info.prefill_chunk,
            info.max_tokens,
            info.kv_tokens
        );
        if let Err(why) = &info.chat_template {
            eprintln!("moec serve: no chat completions: {why}");
        }
        if !keyed {
            eprintln!(
                "moec serve: no API key (--api-key or {API_KEY_ENV}): every client is served"
            );
        }
        // The line a script or test waits for.
        println!("listening on http://{addr}");
    });
    match result {
        Ok(()) => {
            eprintln!("moec serve: shut down");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}
