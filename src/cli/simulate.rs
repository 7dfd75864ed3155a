//! `moec simulate SCHED --model CARD --hw PROFILE [--set k=v]...`: predicted time per step,
//! tokens/s, busy share per stream and resource, analytical bounds and the memory table;
//! `--timeline out.svg` (Gantt), `--trace out.json` (Chrome/Perfetto), `--json`.

use super::workload::CostWorkload;
use crate::cost::budget::{budget_table, parse_bytes, BudgetOverrides, BudgetTable};
use crate::cost::hardware::HardwareProfile;
use crate::cost::predict::{predict, CostSettings, DecodeContext, Prediction};
use crate::cost::rates::{at_rates, Rates};
use crate::elaborate::Options;
use crate::ir::{Program, TaskId, Workload};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Schedule, model, hardware and workload flags shared by `simulate` and `plan`.
#[derive(Debug, Args, Clone)]
pub struct CostTarget {
    /// The schedule (`.sched` file).
    pub schedule: PathBuf,
    /// Model card: built-in name, `.ron` path, or a llama.cpp `.gguf` file (its
    /// architecture and tensor formats, read from its header).
    #[arg(long, default_value = "mixtral-tiny")]
    pub model: String,
    /// Storage formats per weight class, on top of the card's dtype:
    /// `experts=q4_k,attention=q8_0` (classes experts, attention, shared, router, norms,
    /// embedding, head; formats bf16, f16, f32, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k, mxfp4).
    #[arg(long, value_name = "CLASS=FORMAT,..")]
    pub weight_format: Option<String>,
    /// Hardware profile: built-in name (see `moec hw`) or `.ron` path.
    #[arg(long, default_value = "t4")]
    pub hw: String,
    /// Routing profile (`moec profile` output) that `rank(..)` placement and the expected
    /// activation of guarded tasks read.
    #[arg(long = "profile", value_name = "FILE")]
    pub routing_profile: Option<PathBuf>,
    /// Override a schedule param: `--set ubs=32` (repeatable).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub sets: Vec<String>,
    /// The workload, as `run` takes it: a paper preset alone (`mtbench-32`, `mtbench-64`,
    /// `mtbench-128`, `mtbench-256`, `synthetic-reasoning`, `summarization`: the paper's
    /// average prompt and generation length), or the prompts a run draws
    /// (`mtbench[:COUNT]`, `mtbench-GEN:COUNT`, `count=N,mean=M,max=X[,min=A][,gen=G]`:
    /// N sequences of the longest prompt X). `--batch`, `--prompt-len` and `--gen-len`
    /// override it.
    #[arg(long, value_name = "SPEC")]
    pub workload: Option<String>,
    /// Sequences in the batch (the `batch` symbol).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: Option<u64>,
    /// Prompt tokens per sequence.
    #[arg(long)]
    pub prompt_len: Option<u64>,
    /// Generated tokens per sequence.
    #[arg(long)]
    pub gen_len: Option<u64>,
    /// GPU memory budget (e.g. 16GB), instead of the profile's.
    #[arg(long)]
    pub gpu_mem: Option<String>,
    /// Host memory budget (e.g. 192GB), instead of the profile's.
    #[arg(long)]
    pub host_mem: Option<String>,
    /// Bytes per activation and KV element: 4 (f32, what the runtime computes in) or 2
    /// (fp16/bf16, what the papers' systems use; pass it to compare with their numbers).
    #[arg(long, default_value_t = crate::ir::catalog::ACT_BYTES)]
    pub act_bytes: u64,
    /// Context decode attention assumes: `average` (prompt + gen/2) or `worst`.
    #[arg(long, default_value = "average")]
    pub context: String,
    /// Which rates the HRM divides by: `datasheet` (peaks), `effective` (the profile's
    /// fitted or measured rates, per-task overheads, shared host DRAM; see
    /// docs/cost-model.md) or `calibrated` (effective, with the prefill efficiency and
    /// task overhead `moec reproduce` fits on the papers' rows, reproduce/calibration.ron).
    /// Default: the best the profile has (calibrated, else effective, else datasheet); the
    /// output's `rates:` line says which.
    #[arg(long, value_name = "RATES")]
    pub rates: Option<String>,
    /// Backend the schedule is compiled and its memory budgets proved for, as `moec run
    /// --backend` runs it: `cuda` counts each device stream's workspace by the CUDA
    /// kernels' scratch rules (a `scratch on <stream>` budget line each; `gpu_scratch(..)`
    /// is their bound); `cpu` (the default, as `moec run`'s) the op catalog's workspace.
    #[arg(long, default_value = "cpu", value_parser = super::inputs::backend())]
    pub backend: &'static crate::runtime::Registration,
}

/// Arguments of `moec simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    target: CostTarget,
    /// Write the repeated step's timeline as an SVG Gantt chart.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Write every step's timeline as a Chrome/Perfetto trace (JSON).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Which step the Gantt chart shows: decode (default), prefill or step (needs
    /// `--timeline`; alone it would be silently ignored).
    #[arg(long, requires = "timeline")]
    timeline_step: Option<String>,
    /// Zoom the Gantt chart to a time window in ms, `FROM:TO` (e.g. `0:150`).
    #[arg(long, value_name = "FROM:TO")]
    timeline_window: Option<String>,
    /// Print the figures as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Everything resolved from a [`CostTarget`] except the schedule's compilation.
pub(crate) struct Resolved {
    pub source: String,
    pub origin: String,
    pub options: Options,
    pub profile: HardwareProfile,
    /// Which rates the profile carries, in words (the output says so: no silent choice).
    pub rates: String,
    /// The `--workload` spec as read, if one was given.
    pub workload: Option<CostWorkload>,
    pub overrides: BudgetOverrides,
    pub settings: CostSettings,
}

pub(crate) fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("{:?}", miette::Report::msg(message.to_string()));
    ExitCode::FAILURE
}

/// Resolves model, profile, workload and budgets; errors are user-facing messages.
pub(crate) fn resolve(target: &CostTarget) -> Result<Resolved, String> {
    let source = crate::textfile::read_capped(&target.schedule, crate::textfile::SOURCE_LIMIT)
        .map_err(|e| format!("cannot read {}: {e}", target.schedule.display()))?;
    let model = super::inputs::planning_card(
        &target.model,
        target.weight_format.as_deref(),
        target.backend,
    )?;
    let profile = HardwareProfile::load(&target.hw).map_err(|e| e.to_string())?;
    // The schedule sees the profile's own numbers (`gpu.mem`, `link.h2d`, ...), as `check`
    // and `run` with `--hw` show them, whatever rates the prediction divides by: a planned
    // policy then elaborates to the same program in all three.
    let symbols: std::collections::BTreeMap<String, f64> = profile
        .symbols()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let requested = target.rates.as_deref().map(Rates::parse).transpose()?;
    let rated = at_rates(profile, requested)?;
    let (profile, rates) = (rated.profile, rated.description);
    let mut workload = Workload::default();
    let spec = target
        .workload
        .as_deref()
        .map(CostWorkload::parse)
        .transpose()?;
    if let Some(spec) = &spec {
        spec.apply(&mut workload);
    }
    if let Some(batch) = target.batch {
        workload.batch = batch;
    }
    if let Some(prompt_len) = target.prompt_len {
        workload.prompt_len = prompt_len;
    }
    if let Some(gen_len) = target.gen_len {
        workload.gen_len = gen_len;
    }
    let mut sets = Vec::new();
    for set in &target.sets {
        let (name, value) = set
            .split_once('=')
            .ok_or_else(|| format!("`--set {set}`: expected NAME=VALUE"))?;
        sets.push((name.trim().to_string(), value.trim().to_string()));
    }
    let overrides = BudgetOverrides {
        gpu_bytes: target.gpu_mem.as_deref().map(parse_bytes).transpose()?,
        host_bytes: target.host_mem.as_deref().map(parse_bytes).transpose()?,
    };
    let decode_context = match target.context.as_str() {
        "average" => DecodeContext::Average,
        "worst" => DecodeContext::WorstCase,
        other => {
            return Err(format!(
                "`--context {other}`: expected `average` or `worst`"
            ))
        }
    };
    if !matches!(target.act_bytes, 1 | 2 | 4 | 8) {
        return Err(format!(
            "`--act-bytes {}`: expected 1, 2, 4 or 8",
            target.act_bytes
        ));
    }
    let mut options = Options::new(model);
    // The planner's points and winners alike are budgeted for the backend's scratch.
    options.scratch = target.backend.scratch;
    if let Some(path) = &target.routing_profile {
        options.profile = Some(super::inputs::load_routing_profile(path, &options.model)?);
    }
    options.act_bytes = target.act_bytes;
    options.workload = workload;
    options.sets = sets;
    options.hardware = symbols;
    Ok(Resolved {
        source,
        origin: target.schedule.display().to_string(),
        options,
        profile,
        rates,
        workload: spec,
        overrides,
        settings: CostSettings { decode_context },
    })
}

/// Compiles a schedule and returns the program with each task's predecessors, or the
/// rendered diagnostics.
pub(crate) fn compile_for_cost(
    source: &str,
    origin: &str,
    options: &Options,
) -> Result<(Program, Vec<Vec<TaskId>>), String> {
    match crate::compile::compile(source, options) {
        Ok(compiled) => {
            let dag = &compiled.info.dag;
            let deps = (0..compiled.program.tasks.len())
                .map(|t| dag.preds(TaskId::new(t)).iter().map(|d| d.from).collect())
                .collect();
            Ok((compiled.program, deps))
        }
        Err(diagnostics) => Err(crate::diag::render_all(&diagnostics, origin, source)),
    }
}

fn write_file(path: &Path, text: &str) -> Result<(), String> {
    crate::cli::probe::write_atomically(path, text)
}

/// Runs `moec simulate`.
pub fn run(args: SimulateArgs) -> ExitCode {
    let resolved = match resolve(&args.target) {
        Ok(r) => r,
        Err(message) => return fail(message),
    };
    let (program, deps) =
        match compile_for_cost(&resolved.source, &resolved.origin, &resolved.options) {
            Ok(x) => x,
            Err(rendered) => {
                eprintln!("{rendered}");
                return ExitCode::FAILURE;
            }
        };
    let prediction = match predict(&program, &deps, &resolved.profile, &resolved.settings) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let table = budget_table(&program, Some(&resolved.profile), &resolved.overrides);
    if let Some(path) = &args.timeline {
        let wanted = args.timeline_step.as_deref();
        let step = prediction
            .steps
            .iter()
            .enumerate()
            .find(|(i, s)| match wanted {
                Some(w) => s.kind == w,
                None => Some(*i) == prediction.repeated_step,
            })
            .map(|(_, s)| s);
        if let (Some(w), None) = (wanted, step) {
            let kinds: Vec<&str> = prediction.steps.iter().map(|s| s.kind.as_ref()).collect();
            return fail(format!(
                "--timeline-step `{w}`: the schedule has no such step (its steps: {})",
                kinds.join(", ")
            ));
        }
        let step = step.or_else(|| prediction.steps.last());
        let Some(step) = step else {
            return fail("the schedule has no steps to draw");
        };
        let mut timeline = step.timeline.clone();
        if let Some(window) = &args.timeline_window {
            let parsed = window.split_once(':').and_then(|(a, b)| {
                Some((a.trim().parse::<f64>().ok()?, b.trim().parse::<f64>().ok()?))
            });
            match parsed {
                Some((from, to)) if from >= 0.0 && to > from => {
                    timeline = timeline.window(from / 1e3, to / 1e3);
                    timeline.title = format!("{} (window {from}-{to} ms)", timeline.title);
                }
                _ => {
                    return fail(format!(
                        "`--timeline-window {window}`: expected FROM:TO in ms, FROM < TO"
                    ))
                }
            }
        }
        if let Err(e) = write_file(path, &timeline.to_svg(1400.0)) {
            return fail(e);
        }
    }
    if let Some(path) = &args.trace {
        let mut events = Vec::new();
        let mut offset = 0.0;
        for (index, step) in prediction.steps.iter().enumerate() {
            let mut trace = step.timeline.clone();
            for span in &mut trace.spans {
                span.start += offset;
                span.end += offset;
            }
            offset += step.seconds;
            if let Some(list) = trace.to_chrome_trace()["traceEvents"].as_array() {
                events.extend(
                    list.iter()
                        .filter(|e| index == 0 || e["ph"] == "X")
                        .cloned(),
                );
            }
        }
        let trace = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        if let Err(e) = write_file(path, &serde_json::to_string(&trace).unwrap_or_default()) {
            return fail(e);
        }
    }
    if args.json {
        let value = serde_json::json!({
            "schedule": program.name,
            "model": program.model.name,
            "hardware": resolved.profile.name,
            "rates": resolved.rates,
            "workload": program.workload,
            "params": program.params.iter().map(|p| (p.name.clone(), p.value.to_string())).collect::<std::collections::BTreeMap<_, _>>(),
            "tokens_per_s": prediction.tokens_per_s,
            "decode_tokens_per_s": prediction.decode_tokens_per_s,
            "step_seconds": prediction.step_seconds,
            "engine_busy": prediction.repeated_step.map(|i| prediction.steps[i].resource_busy.clone()),
            "peak_bytes": { "gpu": table.peak("gpu"), "pinned": table.peak("pinned"), "host": table.peak("host") },
            "fits": table.fits(),
            "prediction": prediction,
            "memory": table,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
    } else {
        if let Some(batch) = args.target.batch.filter(|&b| b != prediction.sequences) {
            // `--batch` binds the symbol `batch`; a schedule whose `microbatches` line is
            // written in its own params (n_ub x ubs) keeps its size. Said, not silently.
            eprintln!(
                "note: --batch {batch} sets the symbol `batch`; {} runs {} sequences as its \
                 params size it (microbatches {}): set them with --set",
                program.name, prediction.sequences, program.micro_batches
            );
        }
        print_report(&program, &resolved, &prediction, &table);
    }
    ExitCode::SUCCESS
}

fn pct(x: f64) -> String {
    format!("{:>5.1}%", x * 100.0)
}

fn print_report(
    program: &Program,
    resolved: &Resolved,
    prediction: &Prediction,
    table: &BudgetTable,
) {
    let params = program
        .params
        .iter()
        .map(|p| format!("{}={}", p.name, p.value))
        .collect::<Vec<_>>()
        .join(" ");
    let w = program.workload;
    println!(
        "{} on {} ({}), {params}; {} sequences, prompt {} + gen {} (decode context {})",
        program.name,
        resolved.profile.name,
        program.model.label(),
        prediction.sequences,
        w.prompt_len,
        w.gen_len,
        prediction.decode_context
    );
    println!("  step      tasks        time");
    for step in &prediction.steps {
        println!(
            "  {:<8} {:>6} {:>11}",
            step.kind,
            step.tasks,
            seconds(step.seconds)
        );
    }
    if !table.fits() {
        // A speed for a plan that cannot run must not read like one that can.
        let over: Vec<String> = table
            .spaces
            .iter()
            .filter(|s| s.over() > 0.0)
            .map(|s| format!("{} over by {:.2} GB", s.space, s.over() / 1e9))
            .collect();
        println!(
            "does not fit: {} (memory below); the figures are what it would do with the memory",
            over.join(", ")
        );
    }
    match (prediction.decode_tokens_per_s, prediction.tokens_per_s) {
        (Some(decode), Some(total)) => println!(
            "throughput: decode {decode:.2} tokens/s; generation {total:.2} tokens/s ({} x {} tokens over prefill + {} steps)",
            prediction.sequences, w.gen_len, w.gen_len
        ),
        _ => println!("throughput: the schedule has no decode step"),
    }
    if let Some(step) = prediction.repeated_step.map(|i| &prediction.steps[i]) {
        let step_name = if step.kind == "step" {
            "mixed"
        } else {
            step.kind.as_str()
        };
        println!("busy share over the {step_name} step:");
        for stream in &program.streams {
            let busy = step.stream_busy.get(&stream.name).copied().unwrap_or(0.0);
            println!(
                "  stream {:<10} {:<13} {}",
                stream.name,
                stream.engine.as_str(),
                pct(busy)
            );
        }
        for (resource, busy) in &step.resource_busy {
            println!("  resource {:<20} {}", resource, pct(*busy));
        }
        println!("task time per kind over the {step_name} step (sum over tasks, binding roof):");
        let mut ops: Vec<_> = step.op_seconds.iter().collect();
        ops.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        for (op, (total, roof)) in ops {
            match step.copy_bytes.get(op) {
                Some(bytes) => println!(
                    "  {:<36} {:>11}  {} ({} moved)",
                    op,
                    seconds(*total),
                    roof,
                    crate::ir::emit::human_bytes(*bytes as u64)
                ),
                None => println!("  {:<36} {:>11}  {}", op, seconds(*total), roof),
            }
        }
    }
    for step in &prediction.steps {
        if step.arms.is_empty() {
            continue;
        }
        println!(
            "guarded tasks of the {} step, charged by expected activation ({}):",
            step.kind,
            if program.expert_shares.is_some() {
                "routing from the profile"
            } else {
                "uniform routing, top_k / experts"
            }
        );
        for arm in &step.arms {
            println!(
                "  {:<48} {:>5} tasks  runs {:>6}  {:>11}",
                arm.arm,
                arm.tasks,
                pct(arm.expected_share),
                seconds(arm.seconds)
            );
        }
    }
    print_cache_hits(program);
    if let (Some(bound), Some(tps)) = (prediction.layer_bound, prediction.layer_bound_tokens_per_s)
    {
        println!(
            "bound, MoE-Lightning eq. 12 per layer: comm {} (d2h {}), cpu {}, gpu {} -> T = {} ({}) = {tps:.2} decode tokens/s",
            seconds(bound.comm_seconds),
            seconds(bound.comm_out_seconds),
            seconds(bound.cpu_seconds),
            seconds(bound.gpu_seconds),
            seconds(bound.layer_seconds),
            bound.bottleneck
        );
        if let Some(decode) = prediction.decode_tokens_per_s {
            println!(
                "  simulated decode reaches {:.1}% of it",
                decode / tps * 100.0
            );
        }
    }
    if let Some(stage1) = prediction.stage1 {
        println!(
            "bound, MoE-Lens stage 1 (eq. 3-4): PME {:.5}, delta {} per pass -> min({:.1}, T_GPU {:.1}) = {:.1} tokens/s ({})",
            stage1.pme,
            seconds(stage1.delta_seconds),
            stage1.memory_bound_tokens_per_s,
            stage1.gpu_bound_tokens_per_s,
            stage1.tokens_per_s,
            stage1.bottleneck
        );
    }
    // Last but the memory table, so the figures above keep their lines (docs quote them).
    println!("rates: {}", resolved.rates);
    println!("memory:");
    print!("{table}");
}

/// Each expert cache's predicted decode hit rate (the rate fetches and prefetches were
/// charged by).
fn print_cache_hits(program: &Program) {
    for (i, c) in program.caches.iter().enumerate() {
        let tokens = program.micro_batches.size;
        let hits = crate::cost::activation::cache_hits(program, i as u32, tokens);
        println!(
            "expert cache `{}` ({} slots, evict {}): predicted decode hit rate {} ({}); fetches are charged a copy only on a miss",
            c.name,
            c.slots,
            c.policy.as_str(),
            pct(hits.rate).trim(),
            if program.expert_shares.is_some() {
                "routing from the profile"
            } else {
                "uniform routing"
            }
        );
        if let Some(credit) = crate::cost::prefetch::decode_credit(program, i as u32, tokens) {
            let plan = &credit.plan;
            println!(
                "  {} prefetches: {} per layer into {} layers, ranked {}; a fetch of an expert not otherwise resident finds it prefetched {} (room for {} of them in {} slots, {} layer{} ahead); predicted decode hit rate with them {} (`moec run` reports the measured accuracy)",
                c.predictor.as_str(),
                plan.per_layer,
                credit.layers,
                plan.ranking,
                pct(credit.accuracy).trim(),
                pct(plan.room).trim(),
                c.slots,
                plan.distance,
                if plan.distance == 1 { "" } else { "s" },
                pct(credit.rate).trim()
            );
        }
        if c.predictor == crate::ir::cache::Predictor::Lookahead {
            println!(
                "  lookahead: a fetch of a layer the pregates predicted is charged as a hit (the pregate taken to select the gate's experts: an upper bound; `moec run` reports the measured accuracy)"
            );
        }
    }
}

fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}
