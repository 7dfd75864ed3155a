//! `moec plan SCHED --model CARD --hw PROFILE [--gpu-mem X] [--workload SPEC]`: searches
//! the schedule's declared params for the best predicted throughput within the memory
//! budgets, prints the top candidates (`--json` for machines) and the `moec run` and
//! `moec check` command lines of the best, for the same workload and budgets.

use super::simulate::{fail, resolve, CostTarget, Resolved};
use super::workload::{spec_for, CostWorkload};
use crate::compile;
use crate::cost::budget::{
    budget_table, check_budget, disk_split, mapped_checkpoint_over_host, DiskSplit,
};
use crate::cost::hardware::GB;
use crate::cost::plan::{
    param_spaces, search_bounded, share_of_slots_used, SamePrograms, SearchOptions,
};
use crate::engine::fit_params::{evaluate_point_bounded, PointTarget};
use crate::ir::{Scalar, StepKind};
use clap::Args;
use rayon::prelude::*;
use std::process::ExitCode;
use std::time::Instant;

/// Arguments of `moec plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    target: CostTarget,
    /// Candidates to print.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Most points in the coarse grid (bisection refines the best three afterwards).
    #[arg(long, default_value_t = 120)]
    max_grid: usize,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Runs `moec plan`.
pub fn run(args: PlanArgs) -> ExitCode {
    let started = Instant::now();
    keep_freed_memory();
    let resolved = match resolve(&args.target) {
        Ok(r) => r,
        Err(message) => return fail(message),
    };
    // Elaborate once with the defaults (and the user's --set) to learn the params; an
    // elaboration error is shown as `check` shows it. The checks run on the winners.
    let Ok(file) = compile::source_to_ast(&resolved.source).map_err(|diagnostics| {
        eprintln!(
            "{}",
            crate::diag::render_all(&diagnostics, &resolved.origin, &resolved.source)
        )
    }) else {
        return ExitCode::FAILURE;
    };
    let program = match compile::ast_to_ir(&file, &resolved.options) {
        Ok((program, _)) => program,
        Err(diagnostics) => {
            eprintln!(
                "{}",
                crate::diag::render_all(&diagnostics, &resolved.origin, &resolved.source)
            );
            return ExitCode::FAILURE;
        }
    };
    let fixed: Vec<String> = resolved
        .options
        .sets
        .iter()
        .map(|(name, _)| name.clone())
        .collect();
    let spaces = param_spaces(&program.params, &fixed);
    // A run's spec fixes how many prompts there are: slots beyond them earn nothing, so a
    // candidate is scored by the share of its slots the run fills.
    let prompts = match resolved.workload {
        Some(CostWorkload::Run(_)) => Some(resolved.options.workload.batch),
        _ => None,
    };
    let wanted = args.top.max(1);
    // Extra candidates in case the full check rejects some of the best ones.
    let options = SearchOptions {
        max_grid: args.max_grid,
        refine_from: 3,
        top: wanted + 5,
        ..SearchOptions::default()
    };
    // Per point: elaborate, check the budgets and predict (`evaluate_point`); value
    // tracking and lints run on the winners below.
    let share = move |program: &crate::ir::Program, sequences: u64| {
        let continuous = program.steps.iter().any(|s| s.kind == StepKind::Mixed);
        prompts.map_or(1.0, |p| share_of_slots_used(p, sequences, continuous))
    };
    let same_programs = SamePrograms::default();
    let target = PointTarget {
        file: &file,
        options: &resolved.options,
        profile: &resolved.profile,
        settings: resolved.settings,
        overrides: resolved.overrides,
        machine_bytes: None,
        gpu_in_host: false,
        slot_share: &share,
        prune_declared: true,
        same_program: Some(&same_programs),
    };
    // A point whose costed tasks alone bound it under the candidates it would have to
    // beat is not simulated, and a point whose program is an evaluated point's (it differs
    // only in params that point's elaboration never read) is answered from that one's
    // outcome (`search_bounded`, `SamePrograms`: the same answer and counts).
    let mut result = search_bounded(&spaces, &options, |values, below| {
        if let Some(outcome) = same_programs.known(values, below) {
            return outcome;
        }
        let outcome = evaluate_point_bounded(&target, values, below);
        same_programs.evaluated(values, &outcome);
        outcome
    });
    // `MOEC_PLAN_TRACE=1`: when the search ended and when the winners were checked, from
    // the command's start (the phases of its wall time; each point's line is the search's).
    let trace = std::env::var_os("MOEC_PLAN_TRACE").is_some();
    if trace {
        eprintln!(
            "plan-trace search done at {:.2} s",
            started.elapsed().as_secs_f64()
        );
    }
    // The full compiler check on the winners, best first.
    let mut rejected = 0;
    let mut checked = Vec::new();
    let mut best_slots = resolved.options.workload.batch;
    // The best's split of the weights between host memory and disk (disk schedules).
    let mut best_split: Option<DiskSplit> = None;
    // Every candidate still wanted at once, each checked on its own (rayon's threads take
    // them as they free up: no round waits for its slowest before the next starts); the
    // results are taken in rank order, so the outcome is the sequential one.
    let ranked = std::mem::take(&mut result.top);
    let mut next = 0;
    while next < ranked.len() && checked.len() < wanted {
        // No more at once than are still wanted: when every one passes (the usual case),
        // none is compiled for nothing.
        let take = wanted - checked.len();
        let chunk = &ranked[next..(next + take).min(ranked.len())];
        next += chunk.len();
        let outcomes: Vec<Option<(u64, Option<DiskSplit>)>> = chunk
            .par_iter()
            .map(|candidate| {
                let mut compile_options = resolved.options.clone();
                compile_options.sets.extend(
                    candidate
                        .values
                        .iter()
                        .map(|(name, value)| (name.clone(), value.to_string())),
                );
                compile::compile(&resolved.source, &compile_options)
                    .ok()
                    .map(|compiled| {
                        let table = budget_table(
                            &compiled.program,
                            Some(&resolved.profile),
                            &resolved.overrides,
                        );
                        (
                            sequence_slots(&compiled.program),
                            disk_split(&compiled.program, &table),
                        )
                    })
            })
            .collect();
        for (candidate, slots) in chunk.iter().zip(outcomes) {
            if checked.len() == wanted {
                break;
            }
            match slots {
                Some((slots, split)) => {
                    if checked.is_empty() {
                        best_slots = slots;
                        best_split = split;
                    }
                    checked.push(candidate.clone());
                }
                None => rejected += 1,
            }
        }
    }
    result.top = checked;
    let elapsed = started.elapsed().as_secs_f64();
    if trace {
        eprintln!("plan-trace winners checked at {elapsed:.2} s");
    }
    // Nothing fits: say why. When it is the memory-mapped checkpoint itself, no params of a
    // schedule without a disk tier can fit (it names the disk schedules); otherwise what
    // the schedule's own params (defaults and `--set`) put over which budget.
    let not_fitting = result.top.is_empty().then(|| {
        let table = budget_table(&program, Some(&resolved.profile), &resolved.overrides);
        mapped_checkpoint_over_host(&program, &table).or_else(|| {
            check_budget(&program, Some(&resolved.profile), &resolved.overrides)
                .err()
                .map(|e| format!("with the schedule's own params, {}", e.summary))
        })
    });
    let not_fitting = not_fitting.flatten();
    let commands = result
        .top
        .first()
        .map(|best| commands_for(&args.target, &resolved, &best.values, best_slots));
    if args.json {
        let value = serde_json::json!({
            "schedule": program.name,
            "model": program.model.name,
            "hardware": resolved.profile.name,
            "rates": resolved.rates,
            "workload": program.workload,
            "seconds": elapsed,
            "rejected_by_check": rejected,
            "result": result,
            "disk_split": best_split,
            "does_not_fit": not_fitting,
            "run_command": commands.as_ref().map(|c| &c.run),
            "check_command": commands.as_ref().map(|c| &c.check),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    let names: Vec<&str> = spaces.iter().map(|s| s.name()).collect();
    println!(
        "plan for {} on {} ({}), prompt {} + gen {}: searched {} ({} points: {} fit, {} over budget, {} invalid) in {:.2} s",
        program.name,
        resolved.profile.name,
        program.model.label(),
        program.workload.prompt_len,
        program.workload.gen_len,
        if names.is_empty() { "nothing".to_string() } else { names.join(", ") },
        result.evaluated,
        result.feasible,
        result.over_budget,
        result.invalid,
        elapsed
    );
    println!("  rates: {}", resolved.rates);
    if result.skipped_too_large > 0 {
        println!(
            "  skipped {} points whose integer params are all at least those of a point past the unroll limit (assumed past it too)",
            result.skipped_too_large
        );
    }
    for reason in &result.invalid_reasons {
        println!("  invalid: {reason}");
    }
    if rejected > 0 {
        println!("  {rejected} of the best points failed the full check and were dropped");
    }
    if let Some(reason) = &not_fitting {
        println!("  does not fit: {reason}");
    }
    if result.top.is_empty() {
        return fail("no parameter setting fits the memory budget; try a bigger --gpu-mem/--host-mem or another schedule");
    }
    println!(
        "  {:>4}  {:<36} {:>12} {:>12} {:>9} {:>9} {:>9}",
        "rank", "params", "gen tok/s", "decode tok/s", "gpu GB", "pinned GB", "host GB"
    );
    for (rank, candidate) in result.top.iter().enumerate() {
        let params = candidate
            .values
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join(" ");
        println!(
            "  {:>4}  {:<36} {:>12.2} {:>12.2} {:>9.2} {:>9.2} {:>9.2}",
            rank + 1,
            params,
            candidate.tokens_per_s,
            candidate.decode_tokens_per_s,
            candidate.gpu_bytes as f64 / GB,
            candidate.pinned_bytes as f64 / GB,
            candidate.host_bytes as f64 / GB
        );
    }
    if let Some(commands) = &commands {
        if prompts.is_some() {
            println!(
                "  (throughput counts only the slots the run's {} prompts fill)",
                resolved.options.workload.batch
            );
        }
        if let Some(split) = &best_split {
            println!("disk split of the best: {split}");
        }
        println!("run the best:\n  {}", commands.run);
        println!("check it under the same budgets:\n  {}", commands.check);
        if let Some(note) = &commands.note {
            println!("  note: {note}");
        }
    }
    ExitCode::SUCCESS
}

/// Asks glibc's allocator to keep what a point frees for the next point instead of handing
/// it back to the kernel: a search builds and drops programs of up to a million tasks per
/// point on each thread, and trimming the heaps after each one made the next point fault
/// its pages in again (zeroed by the kernel). A bounded cost: the process keeps at most the
/// largest points' memory, which it held at their peak anyway. 8% less CPU on a DeepSeek-V3
/// search (docs/cost-model.md); other C libraries keep their own policy.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets allocator parameters (it takes the arena locks itself);
    // both values are in range for their parameters, and a refusal (return 0) leaves the
    // defaults, which are correct, only slower.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 << 20);
    }
}

/// The command lines that run and check a planned policy.
struct Commands {
    /// `moec run ...`: the schedule at the policy, on the planned workload and budgets.
    run: String,
    /// `moec check ...`: the same compile under the same budgets.
    check: String,
    /// What `run` cannot reproduce of the plan, if anything.
    note: Option<String>,
}

/// Sequences a program holds at once (micro-batches x their size; the `batch` symbol
/// without micro-batches), as the prediction counts them.
fn sequence_slots(program: &crate::ir::Program) -> u64 {
    match u64::from(program.micro_batches.count) * program.micro_batches.size {
        0 => program.workload.batch,
        slots => slots,
    }
}

/// The `moec run` and `moec check` lines for `values` (the searched params; the user's own
/// `--set`s come first), whose program holds `slots` sequences. The workload is the user's
/// spec when it is one `run` draws and no flag changed it; else a spec that draws exactly
/// what was predicted: one prompt per slot (the prediction fills every slot), each of the
/// planned length, so the run compiles the schedule for what was planned.
fn commands_for(
    target: &CostTarget,
    resolved: &Resolved,
    values: &[(String, Scalar)],
    slots: u64,
) -> Commands {
    let mut workload = resolved.options.workload;
    let flags_changed =
        target.batch.is_some() || target.prompt_len.is_some() || target.gen_len.is_some();
    let (spec, gen_flag) = match (&resolved.workload, &target.workload) {
        (Some(CostWorkload::Run(spec)), Some(text)) if !flags_changed => {
            // `run`'s own default generation length applies when the spec names none: say
            // the planned one.
            let gen = spec.gen_len.is_none().then_some(workload.gen_len);
            (text.clone(), gen)
        }
        (Some(CostWorkload::Run(_)), _) => (spec_for(&workload), None),
        _ => {
            workload.batch = slots;
            (spec_for(&workload), None)
        }
    };
    let schedule = target.schedule.display().to_string();
    let mut common = vec![
        schedule,
        "--model".to_string(),
        target.model.clone(),
        "--hw".to_string(),
        target.hw.clone(),
    ];
    if let Some(gpu_mem) = &target.gpu_mem {
        common.extend(["--gpu-mem".to_string(), gpu_mem.clone()]);
    }
    // `run` and `check` budget the same backend's scratch.
    if target.backend != crate::runtime::registry::default_backend() {
        common.extend(["--backend".to_string(), target.backend.name.to_string()]);
    }
    // `run` and `check` refuse a plan over the same host budget.
    if let Some(host_mem) = &target.host_mem {
        common.extend(["--host-mem".to_string(), host_mem.clone()]);
    }
    if let Some(path) = &target.routing_profile {
        common.extend(["--profile".to_string(), path.display().to_string()]);
    }
    let sets = resolved
        .options
        .sets
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .chain(values.iter().map(|(name, value)| format!("{name}={value}")))
        .flat_map(|set| ["--set".to_string(), set]);
    let mut run = vec!["moec".to_string(), "run".to_string()];
    run.extend(common.iter().cloned());
    run.extend(["--workload".to_string(), spec]);
    if let Some(gen) = gen_flag {
        run.extend(["--gen-len".to_string(), gen.to_string()]);
    }
    run.extend(sets.clone());
    let mut check = vec!["moec".to_string(), "check".to_string()];
    check.extend(common);
    check.extend([
        "--batch".to_string(),
        workload.batch.to_string(),
        "--prompt-len".to_string(),
        workload.prompt_len.to_string(),
        "--gen-len".to_string(),
        workload.gen_len.to_string(),
    ]);
    check.extend(sets);
    let mut notes = Vec::new();
    if target.act_bytes != crate::ir::catalog::ACT_BYTES {
        notes.push(format!(
            "planned with --act-bytes {}; `run` and `check` size activations at {} bytes, so their buffers are larger",
            target.act_bytes,
            crate::ir::catalog::ACT_BYTES
        ));
    }
    Commands {
        run: shell_words(&run),
        check: shell_words(&check),
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    }
}

/// `words` as one shell command line, quoting the words a shell would split or expand.
fn shell_words(words: &[String]) -> String {
    words
        .iter()
        .map(|w| {
            let plain = !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-./=,:+@%".contains(c));
            if plain {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
