//! `moec plan SCHED --model CARD --hw PROFILE [--workload ...]`: searches the schedule's
//! declared params for the best predicted throughput within the memory budgets and prints
//! the top candidates (`--json` for machines).

use super::simulate::{compile_for_cost, fail, resolve, CostTarget};
use crate::compile;
use crate::cost::budget::budget_table;
use crate::cost::hardware::GB;
use crate::cost::plan::{param_spaces, search, Candidate, Outcome, SearchOptions};
use crate::cost::predict::predict;
use crate::ir::{deps, TaskId};
use clap::Args;
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
    let resolved = match resolve(&args.target) {
        Ok(r) => r,
        Err(message) => return fail(message),
    };
    // Elaborate once with the defaults (and the user's --set) to learn the params.
    let (program, _) = match compile_for_cost(&resolved.source, &resolved.origin, &resolved.options)
    {
        Ok(x) => x,
        Err(rendered) => {
            eprintln!("{rendered}");
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
    let Ok(file) = compile::source_to_ast(&resolved.source) else {
        return fail("the schedule stopped parsing between two reads");
    };
    let wanted = args.top.max(1);
    // Extra candidates in case the full check rejects some of the best ones.
    let options = SearchOptions {
        max_grid: args.max_grid,
        refine_from: 3,
        top: wanted + 5,
    };
    // Per point: elaborate and cost only. Value tracking and lints run on the winners below
    // (they do not change the prediction, and the transitive reduction is the slow part of
    // checking large programs; the simulator does not need it).
    let mut result = search(&spaces, &options, |values| {
        let mut compile_options = resolved.options.clone();
        compile_options.sets.extend(
            values
                .iter()
                .map(|(name, value)| (name.clone(), value.to_string())),
        );
        let program = match compile::ast_to_ir(&file, &compile_options) {
            Ok((program, _)) => program,
            Err(diagnostics) => {
                let first = diagnostics
                    .iter()
                    .find(|d| d.is_error())
                    .or(diagnostics.first());
                return Outcome::Invalid(first.map_or_else(String::new, |d| d.message.clone()));
            }
        };
        let deps: Vec<Vec<TaskId>> = deps::candidate_edges(&program)
            .into_iter()
            .map(|preds| preds.into_iter().map(|(from, _, _)| from).collect())
            .collect();
        let table = budget_table(&program, Some(&resolved.profile), &resolved.overrides);
        if !table.fits() {
            return Outcome::OverBudget;
        }
        match predict(&program, &deps, &resolved.profile, &resolved.settings) {
            Ok(prediction) => match (prediction.tokens_per_s, prediction.decode_tokens_per_s) {
                (Some(total), Some(decode)) => Outcome::Fits(Candidate {
                    values: values.to_vec(),
                    tokens_per_s: total,
                    decode_tokens_per_s: decode,
                    gpu_bytes: table.peak("gpu"),
                    pinned_bytes: table.peak("pinned"),
                    host_bytes: table.peak("host"),
                }),
                _ => Outcome::Invalid("the schedule has no decode step".to_string()),
            },
            Err(e) => Outcome::Invalid(e.to_string()),
        }
    });
    // The full compiler check on the winners, best first.
    let mut rejected = 0;
    let mut checked = Vec::new();
    for candidate in std::mem::take(&mut result.top) {
        if checked.len() == wanted {
            break;
        }
        let mut compile_options = resolved.options.clone();
        compile_options.sets.extend(
            candidate
                .values
                .iter()
                .map(|(name, value)| (name.clone(), value.to_string())),
        );
        if compile::compile(&resolved.source, &compile_options).is_ok() {
            checked.push(candidate);
        } else {
            rejected += 1;
        }
    }
    result.top = checked;
    let elapsed = started.elapsed().as_secs_f64();
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
        program.model.name,
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
    for reason in &result.invalid_reasons {
        println!("  invalid: {reason}");
    }
    if rejected > 0 {
        println!("  {rejected} of the best points failed the full check and were dropped");
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
    ExitCode::SUCCESS
}
