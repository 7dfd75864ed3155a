//! `moec batch SCHED --input prompts.jsonl --output results.jsonl`: offline batch
//! inference over a prompt file of any length, resumable after a crash or a kill.
//!
//! Takes `moec run`'s model and run flags, an input of JSON lines (`{"id": ..., "prompt":
//! "..."}`, `id` a string or an integer and optional: the line number by default; a bare
//! JSON string is a prompt with the line number as its id) and `--batch N`. Reads the input
//! a line at a time (never whole), gathers N prompts whose ids are not in the output yet,
//! runs them on one `engine::session::Session` kept for the whole job and appends one
//! JSON line per prompt to the output: `{"id", "prompt_tokens", "output_text",
//! "output_ids", "finish_reason"}` (`stop` when the sequence ended at the card's EOS token,
//! `length` when it reached `--gen-len`), then fsyncs, so a batch is on disk before the
//! next starts.
//!
//! The session (model mapped, schedule compiled for `--batch` sequences and a prompt
//! length, plan lowered, arenas allocated) is opened once: a job's memory is that of one
//! batch whatever the input's length, and no batch pays a compile. It is compiled for
//! prompts of at least 64 tokens, the first batch's longest rounded up to a power of two;
//! a later, longer prompt reopens it for the next power of two (a few times at most).
//!
//! Resuming is re-running the same command: the ids already in the output are skipped.
//! A kill can leave at most a partial last line (each batch is written as whole lines,
//! then synced); it is cut off before anything is appended, so no line is duplicated or
//! truncated. Greedy outputs do not depend on how prompts were grouped into batches (every
//! schedule reproduces the oracle's tokens), so a resumed job writes the same tokens as
//! one never killed; a sampled prompt's seed derives from `--seed` and its line number,
//! not from its batch. A progress bar (prompts, rate, ETA) draws on a terminal; elsewhere
//! one line per batch goes to stderr. A summary ends the run on stdout.

use super::generate::fail;
use super::inputs::{ModelArgs, PromptArgs, RunSettings};
use super::run::{Failure, RunArgs};
use crate::engine::session::{Completion, FinishReason, Piece, Session, SessionRequest};
use crate::engine::{RunFailure, RunRequest};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

/// The longest input or output line read, in bytes: a line past it is an error naming it,
/// not an allocation the size of a corrupt file.
const LINE_LIMIT: u64 = 16 << 20;

/// The shortest prompt length a job's session is compiled for: short prompts share one
/// plan, and the first longer one reopens the session at most a few times.
const MIN_PROMPT_LEN: usize = 64;

/// Arguments of `moec batch`.
#[derive(Debug, Clone, clap::Args)]
pub struct BatchArgs {
    /// The `.sched` file.
    pub sched: PathBuf,
    /// JSON-lines prompts: `{"id": ..., "prompt": "..."}` (id optional: the line number)
    /// or a JSON string per line.
    #[arg(long, value_name = "FILE.jsonl")]
    pub input: PathBuf,
    /// JSON-lines results, appended to; the ids already in it are skipped (resuming).
    #[arg(long, value_name = "FILE.jsonl")]
    pub output: PathBuf,
    /// Prompts per batch: each batch is one run of the schedule compiled for it.
    #[arg(long = "batch", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub batch: u64,
    /// Which model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Overrides, pools, link, device memory, profile (`--workload` is refused: the
    /// prompts are the input's).
    #[command(flatten)]
    pub settings: RunSettings,
    /// Tokens to generate per prompt at most.
    #[arg(long, default_value_t = 32)]
    pub gen_len: usize,
    /// Sampling temperature; 0 means greedy (the only mode whose outputs do not depend
    /// on how prompts were grouped into batches).
    #[arg(long, default_value_t = 0.0, value_parser = super::inputs::non_negative_finite)]
    pub temperature: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seconds without progress before a stalled plan is an error.
    #[arg(long, default_value_t = 60.0, value_parser = super::inputs::watchdog_seconds)]
    pub watchdog: f64,
    /// Let the planner pick the params the `--set`s leave open for each batch, even when
    /// the defaults fit (without it: only when they do not, saying so).
    #[arg(long)]
    pub fit: bool,
}

/// One prompt of the input, with where it came from.
struct Pending {
    /// The id as JSON (a string or an integer), written back as it was given.
    id: serde_json::Value,
    prompt: String,
    /// Its line in the input: its sampler's seed derives from it.
    line_no: u64,
}

/// The ids a job has seen (the input's, to refuse a repeated one) or finished (the
/// output's, to skip them), by a 128-bit fingerprint of their JSON text: 16 bytes an id
/// rather than a string, so a job over millions of prompts keeps a few MB, not tens (two
/// ids share a fingerprint with probability about n^2 / 2^129: never, in practice).
#[derive(Default)]
struct IdSet(HashSet<u128>);

impl IdSet {
    fn fingerprint(key: &str) -> u128 {
        use std::hash::{Hash as _, Hasher as _};
        // Two SipHash streams told apart by a leading byte make the 128 bits.
        let half = |salt: u8| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            salt.hash(&mut h);
            key.hash(&mut h);
            h.finish()
        };
        (u128::from(half(0)) << 64) | u128::from(half(1))
    }

    /// Adds `key`; `false` if it was there.
    fn insert(&mut self, key: &str) -> bool {
        self.0.insert(Self::fingerprint(key))
    }

    fn contains(&self, key: &str) -> bool {
        self.0.contains(&Self::fingerprint(key))
    }
}

/// What a finished (or stopped) job did, for the summary.
#[derive(Default)]
struct Tally {
    input_prompts: u64,
    skipped: u64,
    run: u64,
    batches: u64,
    generated_tokens: u64,
}

/// Runs `moec batch`.
pub fn run(args: &BatchArgs) -> ExitCode {
    match batch(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Rendered(text)) => {
            eprint!("{text}");
            ExitCode::from(1)
        }
        Err(Failure::Message(m)) => fail(m),
    }
}

/// `moec run`'s arguments for the same flags, so the request is built (and checked) by
/// the same code as `moec run`'s.
fn run_args(args: &BatchArgs) -> RunArgs {
    RunArgs {
        sched: args.sched.clone(),
        model: args.model.clone(),
        prompt: PromptArgs {
            prompts: Vec::new(),
            prompts_file: None,
        },
        settings: args.settings.clone(),
        gen_len: args.gen_len,
        trace: None,
        json: false,
        temperature: args.temperature,
        seed: args.seed,
        watchdog: args.watchdog,
        kill_task: None,
        test_drop_event: None,
        dump_logits: None,
        prefill_chunk: None,
        fit: args.fit,
    }
}

fn batch(args: &BatchArgs) -> Result<(), Failure> {
    let msg = Failure::Message;
    if args.settings.workload.is_some() {
        return Err(msg(
            "--workload: `moec batch` runs the prompts of --input; use `moec run --workload` for synthetic prompts".into(),
        ));
    }
    if args.gen_len == 0 {
        return Err(msg("--gen-len must be at least 1".into()));
    }
    if same_file(&args.input, &args.output) {
        return Err(msg(format!(
            "--output {} is the input file; results go to a file of their own",
            args.output.display()
        )));
    }
    let request = super::run::request(&run_args(args))?;
    let input_name = args.input.display().to_string();
    let input = File::open(&args.input).map_err(|e| msg(format!("{input_name}: {e}")))?;
    if !input.metadata().map(|m| m.is_file()).unwrap_or(false) {
        return Err(msg(format!("{input_name}: not a regular file")));
    }
    // One pass to count the prompts (newlines only, nothing kept) gives the bar a length
    // and so an ETA.
    let total = count_lines(&args.input).map_err(|e| msg(format!("{input_name}: {e}")))?;
    let existed = args.output.exists();
    let (mut output, done) = open_output(&args.output)?;
    let mut job = JobSession {
        request,
        max_batch: usize::try_from(args.batch).unwrap_or(usize::MAX),
        session: None,
    };
    let mut result = run_input(args, &mut job, input, total, &mut output, &done);
    if let Err(e) = job.close() {
        result = result.and(Err(e));
    }
    // A job that failed before writing a line leaves no empty output it created.
    if result.is_err() && !existed && output.metadata().is_ok_and(|m| m.len() == 0) {
        let _ = std::fs::remove_file(&args.output);
    }
    result
}

/// Streams the input through batches into `output`, skipping the ids in `done`, and
/// prints the summary.
fn run_input(
    args: &BatchArgs,
    job: &mut JobSession,
    input: File,
    total: u64,
    output: &mut File,
    done: &IdSet,
) -> Result<(), Failure> {
    let msg = Failure::Message;
    let input_name = args.input.display().to_string();
    let start = Instant::now();
    let bar = progress_bar(total, &args.sched);
    let mut tally = Tally::default();
    let mut seen = IdSet::default();
    let mut pending: Vec<Pending> = Vec::new();
    let mut reader = BufReader::new(input);
    let mut line = Vec::new();
    let mut line_no = 0u64;
    loop {
        line.clear();
        let read = (&mut reader)
            .take(LINE_LIMIT + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| msg(format!("{input_name}: {e}")))?;
        if read == 0 {
            break;
        }
        line_no += 1;
        let at = |m: &str| msg(format!("{input_name}:{line_no}: {m}"));
        if read as u64 > LINE_LIMIT {
            return Err(at(&format!("line longer than {} MiB", LINE_LIMIT >> 20)));
        }
        let text = std::str::from_utf8(&line).map_err(|_| at("not UTF-8"))?;
        if text.trim().is_empty() {
            continue;
        }
        let prompt = parse_input_line(text, line_no).map_err(|m| at(&m))?;
        let key = prompt.id.to_string();
        if !seen.insert(&key) {
            return Err(at(&format!(
                "id {key} appears twice in the input; ids name results, so each must be unique"
            )));
        }
        tally.input_prompts += 1;
        if done.contains(&key) {
            tally.skipped += 1;
            bar.inc(1);
            continue;
        }
        pending.push(prompt);
        if pending.len() as u64 == args.batch {
            run_batch(job, &mut pending, output, args, &mut tally)?;
            advance(&bar, &tally, args.batch);
        }
    }
    if !pending.is_empty() {
        let n = pending.len() as u64;
        run_batch(job, &mut pending, output, args, &mut tally)?;
        advance(&bar, &tally, n);
    }
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let rate = if seconds > 0.0 {
        tally.generated_tokens as f64 / seconds
    } else {
        0.0
    };
    println!(
        "{}: {} prompts in {input_name}; {} already in {} (skipped); {} run in {} batch(es) of at most {}: {} tokens in {seconds:.1} s ({rate:.1} tokens/s)",
        args.sched.display(),
        tally.input_prompts,
        tally.skipped,
        args.output.display(),
        tally.run,
        tally.batches,
        args.batch,
        tally.generated_tokens,
    );
    Ok(())
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Non-blank-or-not lines of a file (newlines, plus a last line without one), counted in
/// fixed-size reads.
fn count_lines(path: &Path) -> std::io::Result<u64> {
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 16];
    let (mut lines, mut last) = (0u64, b'\n');
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
        last = buf[n - 1];
    }
    Ok(lines + u64::from(last != b'\n'))
}

/// One input line: `{"id": ..., "prompt": "..."}` or a JSON string.
fn parse_input_line(text: &str, line_no: u64) -> Result<Pending, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let (id, prompt) = match value {
        serde_json::Value::String(s) => (serde_json::Value::from(line_no), s),
        serde_json::Value::Object(mut o) => {
            let prompt = match o.remove("prompt") {
                Some(serde_json::Value::String(s)) => s,
                _ => return Err("object has no string field `prompt`".into()),
            };
            let id = match o.remove("id") {
                None | Some(serde_json::Value::Null) => serde_json::Value::from(line_no),
                Some(id @ serde_json::Value::String(_)) => id,
                Some(serde_json::Value::Number(n)) if n.is_u64() || n.is_i64() => {
                    serde_json::Value::Number(n)
                }
                Some(other) => {
                    return Err(format!("`id` must be a string or an integer, not {other}"))
                }
            };
            (id, prompt)
        }
        _ => return Err("expected a JSON string or an object with `prompt`".into()),
    };
    if prompt.is_empty() {
        return Err("empty prompt".into());
    }
    Ok(Pending {
        id,
        prompt,
        line_no,
    })
}

/// Opens the output for appending and gives the ids it already holds. A last line without
/// its newline is what a kill mid-write leaves: it is cut off (and said), so the next
/// line appended starts on a line of its own. Any other line that is not a result is an
/// error: appending to a file moec did not write would mix two things.
fn open_output(path: &Path) -> Result<(File, IdSet), Failure> {
    let name = path.display().to_string();
    let msg = |e: &dyn std::fmt::Display| Failure::Message(format!("{name}: {e}"));
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.is_file() {
            return Err(Failure::Message(format!(
                "{name}: not a regular file; --output must be a file moec can append to"
            )));
        }
    }
    let mut file = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .open(path)
        .map_err(|e| msg(&e))?;
    let mut done = IdSet::default();
    let mut reader = BufReader::new(&mut file);
    let mut line = Vec::new();
    let (mut complete_bytes, mut line_no) = (0u64, 0u64);
    loop {
        line.clear();
        let read = (&mut reader)
            .take(LINE_LIMIT + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| msg(&e))?;
        if read == 0 {
            break;
        }
        line_no += 1;
        if line.last() != Some(&b'\n') {
            if read as u64 > LINE_LIMIT {
                return Err(msg(&format!(
                    "line {line_no} is longer than {} MiB",
                    LINE_LIMIT >> 20
                )));
            }
            // The partial last line of a killed run (nothing follows it).
            break;
        }
        complete_bytes += read as u64;
        let id = std::str::from_utf8(&line)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
            .and_then(|v| v.get("id").cloned());
        match id {
            Some(id) => {
                done.insert(&id.to_string());
            }
            None => {
                return Err(msg(&format!(
                    "line {line_no} is not a result line of `moec batch`; refusing to append to this file"
                )))
            }
        }
    }
    drop(reader);
    let len = file.metadata().map_err(|e| msg(&e))?.len();
    if len > complete_bytes {
        file.set_len(complete_bytes).map_err(|e| msg(&e))?;
        file.sync_all().map_err(|e| msg(&e))?;
        eprintln!(
            "moec: {name}: dropped a partial last line ({} bytes) left by an interrupted run; its prompt runs again",
            len - complete_bytes
        );
    }
    file.seek(SeekFrom::End(0)).map_err(|e| msg(&e))?;
    Ok((file, done))
}

/// The job's engine session and what it is opened with.
struct JobSession {
    /// Schedule, model, params, backend, sampling and `gen_len` of every batch.
    request: RunRequest,
    /// `--batch`: the most sequences the plan holds.
    max_batch: usize,
    /// Opened at the first batch; reopened for a longer prompt.
    session: Option<Session>,
}

impl JobSession {
    /// The session, compiled for prompts of at least `longest` tokens: the open one when
    /// it holds them, else a new one for the next power of two (the old one is closed
    /// first, so two plans never hold memory at once).
    fn session_for(&mut self, longest: usize) -> Result<&Session, Failure> {
        if self
            .session
            .as_ref()
            .is_some_and(|s| s.info().max_prompt < longest)
        {
            self.close()?;
        }
        if self.session.is_none() {
            let request = SessionRequest {
                run: self.request.clone(),
                max_batch: self.max_batch,
                max_prompt: longest.max(MIN_PROMPT_LEN).next_power_of_two(),
                context: None,
                kv_bytes: None,
                // Every prompt of a batch is submitted before it runs: nothing to wait for.
                batch_wait: std::time::Duration::ZERO,
                prefill_budget: None,
            };
            let session = Session::open(request).map_err(|f| match f {
                RunFailure::Rendered(t) => Failure::Rendered(t),
                RunFailure::Message(m) => Failure::Message(m),
            })?;
            for note in &session.info().notes {
                eprintln!("moec: {note}");
            }
            self.session = Some(session);
        }
        self.session
            .as_ref()
            .ok_or_else(|| Failure::Message("the session did not open".into()))
    }

    /// Ends the session (nothing is in flight between batches), with its error if the run
    /// failed.
    fn close(&mut self) -> Result<(), Failure> {
        match self.session.take() {
            Some(session) => session
                .shutdown(std::time::Instant::now())
                .map_err(Failure::Message),
            None => Ok(()),
        }
    }
}

/// A session's tokenizer knows the prompt's tokens; encoding needs it open, so the first
/// batch opens it before its prompts' lengths are known and may reopen it once.
fn encode_batch(job: &mut JobSession, pending: &[Pending]) -> Result<Vec<Vec<u32>>, Failure> {
    let session = job.session_for(MIN_PROMPT_LEN)?;
    let encoded = pending
        .iter()
        .map(|p| {
            session
                .encode(&p.prompt)
                .map_err(|e| Failure::Message(format!("id {}: {e}", p.id)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
    job.session_for(longest)?;
    Ok(encoded)
}

/// One prompt's result: its text, ids and finish reason.
fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Piece>,
    id: &serde_json::Value,
) -> Result<(String, Vec<u32>, &'static str), Failure> {
    let mut text = String::new();
    loop {
        match rx.blocking_recv() {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::End { reason, token_ids }) => {
                let finish = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Cancelled => {
                        return Err(Failure::Message(format!(
                            "id {id}: the session stopped before the prompt finished"
                        )))
                    }
                    FinishReason::Refused(why) | FinishReason::Failed(why) => {
                        return Err(Failure::Message(format!("id {id}: {why}")))
                    }
                };
                return Ok((text, token_ids, finish));
            }
            None => {
                return Err(Failure::Message(format!(
                    "id {id}: the session ended without finishing the prompt"
                )))
            }
        }
    }
}

/// Runs one batch on the job's session and appends its results, then syncs them.
fn run_batch(
    job: &mut JobSession,
    pending: &mut Vec<Pending>,
    output: &mut File,
    args: &BatchArgs,
    tally: &mut Tally,
) -> Result<(), Failure> {
    let encoded = encode_batch(job, pending)?;
    let (sampling, seed) = (job.request.sampling, job.request.seed);
    let session = job.session_for(0)?;
    let completions = pending
        .iter()
        .zip(&encoded)
        .map(|(p, prompt)| Completion {
            prompt: prompt.clone(),
            max_tokens: args.gen_len,
            sampling,
            // The oracle's per-sequence stream, keyed by the line rather than the batch.
            seed: seed ^ p.line_no.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            stop: Vec::new(),
            format: None,
        })
        .collect();
    // Submitted together: a schedule with static batches runs them as one batch.
    let receivers = session
        .submit_all(completions)
        .map_err(|e| Failure::Message(e.to_string()))?;
    let mut lines = String::new();
    for ((p, prompt_ids), rx) in pending.iter().zip(&encoded).zip(receivers) {
        let (text, ids, finish) = collect(rx, &p.id)?;
        let line = serde_json::json!({
            "id": p.id,
            "prompt_tokens": prompt_ids,
            "output_text": text,
            "output_ids": ids,
            "finish_reason": finish,
        });
        lines.push_str(&line.to_string());
        lines.push('\n');
        tally.generated_tokens += ids.len() as u64;
    }
    let name = args.output.display();
    // One write of whole lines, then a sync: a kill leaves at most a partial last line,
    // which the next start cuts off.
    output
        .write_all(lines.as_bytes())
        .and_then(|()| output.sync_data())
        .map_err(|e| Failure::Message(format!("{name}: {e}")))?;
    tally.run += pending.len() as u64;
    tally.batches += 1;
    pending.clear();
    release_freed_heap();
    Ok(())
}

/// Gives the pages of a finished batch's freed heap back to the OS before the next batch
/// allocates: without it glibc keeps freed chunks below the heap's top (the id sets grow
/// between batches) and the resident set creeps up batch after batch.
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's own arenas to the OS; it
    // touches no live allocation and is thread-safe (it takes each arena's lock).
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The bar: prompts done of the input's lines, the rate and the ETA.
fn progress_bar(total: u64, sched: &Path) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {msg} [{bar:30}] {pos}/{len} prompts ({per_sec}, ETA {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(sched.display().to_string());
    bar
}

/// Moves the bar by a finished batch; without a terminal (a log, a cluster job) one line
/// per batch says the same.
fn advance(bar: &indicatif::ProgressBar, tally: &Tally, n: u64) {
    if tally.batches == 1 {
        // The skipped prompts took no time: the rate and ETA count from here.
        bar.reset_eta();
    }
    bar.inc(n);
    if bar.is_hidden() {
        eprintln!(
            "moec: batch {}: {} prompts run, {} skipped, {} tokens",
            tally.batches, tally.run, tally.skipped, tally.generated_tokens
        );
    }
}
