//! `moec ablate SCHED...`: run several schedules on the same model and workload and print
//! one comparison table, also written as CSV and JSON.
//!
//! Takes the schedules and `moec run`'s flags (one workload for all); gives per schedule:
//! measured tokens/s (overall and decode), the HRM's predicted tokens/s and decode step,
//! decode makespan / critical path, busy share per engine, arena bytes per space, and
//! whether its tokens are identical to the first schedule's. A schedule that fails is a
//! row with its error (the others still run); the exit code is 1 if any failed or any
//! output differs.

use super::generate::fail;
use super::inputs::{ModelArgs, PromptArgs, RunSettings};
use super::run::{execute, write_atomic, Failure, Finished, RunArgs};
use crate::ir::Engine;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `moec ablate`.
#[derive(Debug, Clone, clap::Args)]
pub struct AblateArgs {
    /// The `.sched` files to compare (the first is the reference for identical outputs).
    #[arg(required = true, num_args = 1..)]
    pub scheds: Vec<PathBuf>,
    /// Everything else as for `moec run` (its SCHED argument is ignored).
    #[command(flatten)]
    pub run: AblateRunArgs,
    /// Write the table to PREFIX.csv and PREFIX.json.
    #[arg(long, value_name = "PREFIX")]
    pub out: Option<PathBuf>,
}

/// `moec run`'s flags without its positional schedule.
#[derive(Debug, Clone, clap::Args)]
pub struct AblateRunArgs {
    /// Which model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Which prompts.
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Workload, overrides, pools, link, device memory, profile (as `moec run`).
    #[command(flatten)]
    pub settings: RunSettings,
    /// Tokens to generate per prompt at most.
    #[arg(long, default_value_t = 16)]
    pub gen_len: usize,
}

/// One row of the table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// Schedule file.
    pub schedule: String,
    /// Error, if it failed.
    pub error: Option<String>,
    /// Measured generated tokens / run seconds.
    pub tokens_per_s: f64,
    /// Measured decode tokens / decode seconds.
    pub decode_tokens_per_s: f64,
    /// Measured mean decode step, seconds.
    pub decode_step_seconds: f64,
    /// HRM tokens/s of the same run: generated tokens over the predicted seconds of every
    /// executed step, each at its real micro-batch loads.
    pub predicted_tokens_per_s: Option<f64>,
    /// HRM mean decode step (mixed steps when the run had no decode-only step), seconds,
    /// predicted over the same steps as `decode_step_seconds`.
    pub predicted_step_seconds: Option<f64>,
    /// Decode makespan / critical path of measured tasks.
    pub makespan_over_critical_path: f64,
    /// Busy share per engine (streams of one engine summed), decode steps.
    pub busy: Vec<(String, f64)>,
    /// Arena bytes: gpu, pinned, host.
    pub arena_bytes: [u64; 3],
    /// Tokens identical to the first schedule's.
    pub identical: Option<bool>,
}

fn row(schedule: String, f: &Finished, reference: Option<&Vec<Vec<u32>>>) -> Row {
    let r = &f.report;
    let busy = Engine::ALL
        .iter()
        .map(|e| {
            let share: f64 = r
                .streams
                .iter()
                .filter(|s| s.engine == e.as_str())
                .map(|s| s.share)
                .sum();
            (e.as_str().to_string(), share)
        })
        .collect();
    Row {
        schedule,
        error: None,
        tokens_per_s: r.tokens_per_s,
        decode_tokens_per_s: r.decode_tokens_per_s,
        decode_step_seconds: r.decode_step_seconds,
        predicted_tokens_per_s: f.prediction.as_ref().map(|p| p.predicted_tokens_per_s),
        predicted_step_seconds: f
            .prediction
            .as_ref()
            .and_then(|p| p.decode_step.as_ref())
            .map(|d| d.predicted_seconds),
        makespan_over_critical_path: r.makespan_over_critical_path,
        busy,
        arena_bytes: f.stats.arena_bytes,
        identical: reference.map(|x| *x == f.outputs),
    }
}

fn opt(v: Option<f64>, scale: f64) -> String {
    v.map(|x| format!("{:.2}", x * scale))
        .unwrap_or_else(|| "-".into())
}

/// The table as aligned text.
pub fn table(rows: &[Row]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    // Schedules given by path (`/abs/dir/x.sched`) are longer than the usual names: the
    // first column takes the longest, so every row keeps its columns.
    let w = rows
        .iter()
        .map(|r| r.schedule.chars().count())
        .max()
        .unwrap_or(0)
        .max(26);
    let _ = writeln!(
        out,
        "{:<w$} {:>9} {:>9} {:>9} {:>10} {:>9} {:>6}  {:<34} {:>9} {:>9} {:>9} {:>5}",
        "schedule",
        "tok/s",
        "dec tok/s",
        "step ms",
        "pred tok/s",
        "pred ms",
        "mk/cp",
        "busy gpu/h2d/d2h/cpu/pin %",
        "gpu MiB",
        "pin MiB",
        "host MiB",
        "same"
    );
    for r in rows {
        if let Some(e) = &r.error {
            let _ = writeln!(out, "{:<w$} FAILED: {e}", r.schedule);
            continue;
        }
        let busy = r
            .busy
            .iter()
            .map(|(_, s)| format!("{:.0}", s * 100.0))
            .collect::<Vec<_>>()
            .join("/");
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let same = match r.identical {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "ref",
        };
        let _ = writeln!(
            out,
            "{:<w$} {:>9.1} {:>9.1} {:>9.2} {:>10} {:>9} {:>6.3}  {:<34} {:>9.1} {:>9.1} {:>9.1} {:>5}",
            r.schedule,
            r.tokens_per_s,
            r.decode_tokens_per_s,
            r.decode_step_seconds * 1e3,
            opt(r.predicted_tokens_per_s, 1.0),
            opt(r.predicted_step_seconds, 1e3),
            r.makespan_over_critical_path,
            busy,
            mib(r.arena_bytes[0]),
            mib(r.arena_bytes[1]),
            mib(r.arena_bytes[2]),
            same
        );
    }
    let _ = writeln!(
        out,
        "busy: share of the decode steps each engine was running, its streams summed (two copy-in streams can reach 200%)"
    );
    out
}

fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "schedule,error,tokens_per_s,decode_tokens_per_s,decode_step_seconds,predicted_tokens_per_s,predicted_step_seconds,makespan_over_critical_path,busy_gpu_compute,busy_gpu_copy_in,busy_gpu_copy_out,busy_cpu_compute,busy_cpu_copy,gpu_bytes,pinned_bytes,host_bytes,identical\n",
    );
    for r in rows {
        let busy: Vec<String> = r.busy.iter().map(|(_, s)| format!("{s:.4}")).collect();
        let busy = if busy.len() == 5 {
            busy.join(",")
        } else {
            ",,,,".into()
        };
        let err = r.error.as_deref().unwrap_or("").replace([',', '\n'], ";");
        out.push_str(&format!(
            "{},{},{:.3},{:.3},{:.6},{},{},{:.4},{},{},{},{},{}\n",
            r.schedule,
            err,
            r.tokens_per_s,
            r.decode_tokens_per_s,
            r.decode_step_seconds,
            r.predicted_tokens_per_s
                .map(|v| format!("{v:.3}"))
                .unwrap_or_default(),
            r.predicted_step_seconds
                .map(|v| format!("{v:.6}"))
                .unwrap_or_default(),
            r.makespan_over_critical_path,
            busy,
            r.arena_bytes[0],
            r.arena_bytes[1],
            r.arena_bytes[2],
            r.identical
                .map(|b| b.to_string())
                .unwrap_or_else(|| "reference".into())
        ));
    }
    out
}

/// Runs `moec ablate`.
pub fn run(args: &AblateArgs) -> ExitCode {
    let mut rows = Vec::new();
    let mut reference: Option<Vec<Vec<u32>>> = None;
    let bar = indicatif::ProgressBar::new(args.scheds.len() as u64);
    for sched in &args.scheds {
        bar.set_message(sched.display().to_string());
        let a = &args.run;
        let run_args = RunArgs {
            sched: sched.clone(),
            model: a.model.clone(),
            prompt: a.prompt.clone(),
            settings: a.settings.clone(),
            gen_len: a.gen_len,
            trace: None,
            json: false,
            temperature: 0.0,
            seed: 0,
            watchdog: 600.0,
            kill_task: None,
            test_drop_event: None,
            dump_logits: None,
            prefill_chunk: None,
            // Schedules are compared at their own params; the planner steps in only where
            // they do not fit (the run says so).
            fit: false,
        };
        let name = sched.display().to_string();
        match execute(&run_args, &mut |_, _| {}) {
            Ok(finished) => {
                // What the run API says of a schedule (a failed probe, params the planner
                // picked because the defaults did not fit) belongs beside its row.
                for note in &finished.notes {
                    bar.suspend(|| eprintln!("moec: {name}: {note}"));
                }
                rows.push(row(name, &finished, reference.as_ref()));
                if reference.is_none() {
                    reference = Some(finished.outputs);
                }
            }
            Err(Failure::Rendered(text)) => {
                let first = text
                    .lines()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("")
                    .trim()
                    .to_string();
                rows.push(Row {
                    error: Some(first),
                    ..empty_row(name)
                });
            }
            Err(Failure::Message(m)) => rows.push(Row {
                error: Some(m),
                ..empty_row(name)
            }),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    print!("{}", table(&rows));
    if let Some(prefix) = &args.out {
        let json = serde_json::to_string_pretty(&rows).unwrap_or_default();
        for (ext, text) in [("csv", csv(&rows)), ("json", json)] {
            // `--out exp.v2` writes exp.v2.csv and exp.v2.json (the prefix is kept whole).
            let mut name = prefix.as_os_str().to_owned();
            name.push(format!(".{ext}"));
            let path = std::path::PathBuf::from(name);
            if let Err(e) = write_atomic(&path, &text) {
                return fail(e);
            }
        }
    }
    let bad = rows
        .iter()
        .any(|r| r.error.is_some() || r.identical == Some(false));
    if bad {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn empty_row(schedule: String) -> Row {
    Row {
        schedule,
        error: None,
        tokens_per_s: 0.0,
        decode_tokens_per_s: 0.0,
        decode_step_seconds: 0.0,
        predicted_tokens_per_s: None,
        predicted_step_seconds: None,
        makespan_over_critical_path: 0.0,
        busy: Vec::new(),
        arena_bytes: [0; 3],
        identical: None,
    }
}

#[cfg(test)]
mod tests {
    use super::{table, Row};

    fn row(schedule: &str) -> Row {
        Row {
            schedule: schedule.to_string(),
            error: None,
            tokens_per_s: 12.5,
            decode_tokens_per_s: 20.0,
            decode_step_seconds: 0.05,
            predicted_tokens_per_s: Some(14.0),
            predicted_step_seconds: Some(0.045),
            makespan_over_critical_path: 1.1,
            busy: vec![("gpu.compute".into(), 0.9), ("gpu.copy_in".into(), 0.1)],
            arena_bytes: [1 << 20, 2 << 20, 3 << 20],
            identical: Some(true),
        }
    }

    /// A schedule given by a long absolute path keeps every row's columns where the
    /// header's are (each column ends at the same character).
    #[test]
    fn columns_stay_aligned_with_long_schedule_paths() {
        let rows = [
            row("schedules/cgopipe.sched"),
            row("/a/long/absolute/path/to/my/own/schedules/variant.sched"),
        ];
        let text = table(&rows);
        let lines: Vec<&str> = text.lines().take(3).collect();
        let ends = |line: &str| -> Vec<usize> {
            let chars: Vec<char> = line.chars().collect();
            (1..chars.len())
                .filter(|&i| chars[i] == ' ' && chars[i - 1] != ' ')
                .collect()
        };
        // Column 2 (tok/s) ends at the same place in the header and both rows.
        let second = |line: &str| ends(line)[1];
        assert_eq!(second(lines[1]), second(lines[2]), "{text}");
        assert_eq!(second(lines[0]), second(lines[1]), "{text}");
    }
}
