//! `moec reproduce [TABLE...] [--json]`: every published row moec models (the checked-in
//! `reproduce/*.ron`), predicted on the paper's machine with the paper's policy, against
//! the published throughput.
//!
//! Takes table names (default: all) and prints, per row: the predicted generation
//! throughput held out (the calibration fitted on every other row) and fitted on (fitted on
//! every row), each with its ratio to the published value, the prefill/decode split, the
//! decode step's binding resource (MoE-Lightning eq. 12) and whether the policy fits the
//! memory budget; then the error of both columns and the paired rankings the papers report.
//! Guarantees: a row's held-out figure never used its own published value.

use crate::cost::budget::budget_table;
use crate::cost::hardware::HardwareProfile;
use crate::cost::predict::{predict, CostSettings};
use crate::cost::reproduce::{
    calibrated, error_summary, grid, leave_one_out, tables, Calibration, PublishedRow, ACT_BYTES,
    MODEL,
};
use crate::elaborate::Options;
use crate::ir::{Program, TaskId, Workload};
use crate::model::card::ModelCard;
use clap::Args;
use serde::Serialize;
use std::process::ExitCode;

/// Arguments of `moec reproduce`.
#[derive(Debug, Args)]
pub struct ReproduceArgs {
    /// Tables to reproduce (`moe-lightning`); all when none is named.
    tables: Vec<String>,
    /// Print the rows and the fit as one JSON object.
    #[arg(long)]
    json: bool,
}

/// The schedules rows name, embedded so the command runs from any directory.
const SCHEDULES: &[(&str, &str)] = &[
    ("cgopipe", include_str!("../../schedules/cgopipe.sched")),
    ("flexgen", include_str!("../../schedules/flexgen.sched")),
    (
        "flexgen_cpu_attn",
        include_str!("../../schedules/baselines/flexgen_cpu_attn.sched"),
    ),
    (
        "moe_lightning_s2",
        include_str!("../../schedules/baselines/moe_lightning_s2.sched"),
    ),
    ("klotski", include_str!("../../schedules/klotski.sched")),
    ("vslpipe", include_str!("../../schedules/vslpipe.sched")),
];

/// One row's prediction at one calibration point.
#[derive(Debug, Clone, Copy, Serialize)]
struct Point {
    tokens_per_s: f64,
    prefill_s: f64,
    decode_step_s: f64,
}

/// One row's result.
#[derive(Debug, Serialize)]
struct RowReport {
    table: String,
    row: PublishedRow,
    held_out: Option<Point>,
    held_out_calibration: Calibration,
    /// Alone on its machine: the held-out figure is not held out.
    held_out_alone: bool,
    fitted_on: Option<Point>,
    /// Binding resource of the decode step (eq. 12) at the fitted-on point.
    bound: String,
    /// Spaces over budget ("fits" when none).
    budget: String,
    /// Why the row could not be predicted.
    error: Option<String>,
}

fn compiled(
    row: &PublishedRow,
    model: &ModelCard,
    profile: &HardwareProfile,
) -> Result<(Program, Vec<Vec<TaskId>>), String> {
    let source = SCHEDULES
        .iter()
        .find(|(name, _)| *name == row.schedule)
        .map(|(_, text)| *text)
        .ok_or_else(|| format!("unknown schedule `{}`", row.schedule))?;
    let mut options = Options::new(model.clone());
    // `moec run`'s default backend, as every command that names none (its scratch rules,
    // if it has any: the papers' rows are costed, not run).
    options.scratch = crate::runtime::registry::default_backend().scratch;
    options.act_bytes = ACT_BYTES;
    options.workload = Workload {
        batch: 1,
        prompt_len: row.prompt_len,
        gen_len: row.gen_len,
    };
    options.sets = row
        .sets
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    options.hardware = profile
        .symbols()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    super::simulate::compile_for_cost(source, &row.schedule, &options)
}

/// Predictions of one row at every grid point (None where the simulation failed).
fn row_points(
    program: &Program,
    deps: &[Vec<TaskId>],
    profile: &HardwareProfile,
    points: &[Calibration],
) -> Vec<Option<Point>> {
    points
        .iter()
        .map(|&c| {
            let prediction = predict(
                program,
                deps,
                &calibrated(profile, c),
                &CostSettings::default(),
            )
            .ok()?;
            let prefill_s = prediction
                .steps
                .iter()
                .filter(|s| s.kind == "prefill")
                .map(|s| s.seconds)
                .sum();
            Some(Point {
                tokens_per_s: prediction.tokens_per_s?,
                prefill_s,
                decode_step_s: prediction.step_seconds?,
            })
        })
        .collect()
}

/// Runs `moec reproduce`.
pub fn run(args: &ReproduceArgs) -> ExitCode {
    let all = match tables() {
        Ok(t) => t,
        Err(e) => return super::simulate::fail(e),
    };
    let known: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(bad) = args.tables.iter().find(|t| !known.contains(&t.as_str())) {
        return super::simulate::fail(format!(
            "unknown table `{bad}` (known: {})",
            known.join(", ")
        ));
    }
    let model = match ModelCard::load(MODEL) {
        Ok(m) => m,
        Err(e) => return super::simulate::fail(e),
    };
    let points = grid();
    let mut rows: Vec<(String, PublishedRow)> = Vec::new();
    for (name, table) in all {
        if args.tables.is_empty() || args.tables.contains(&name) {
            rows.extend(table.into_iter().map(|r| (name.clone(), r)));
        }
    }
    let mut per_row: Vec<Vec<Option<Point>>> = Vec::new();
    let mut extra: Vec<(String, String, Option<String>)> = Vec::new();
    for (_, row) in &rows {
        let profile = match HardwareProfile::load(&row.hw) {
            Ok(p) => row.profile(&p),
            Err(e) => return super::simulate::fail(e),
        };
        match compiled(row, &model, &profile) {
            Ok((program, deps)) => {
                per_row.push(row_points(&program, &deps, &profile, &points));
                let table = budget_table(&program, Some(&profile), &Default::default());
                let over: Vec<&str> = ["gpu", "pinned", "host"]
                    .into_iter()
                    .filter(|s| table.peak(s) as f64 > budget_of(&profile, s))
                    .collect();
                let budget = if over.is_empty() {
                    "fits".to_string()
                } else {
                    format!("over: {}", over.join(","))
                };
                extra.push((bound_of(&program, &deps, &profile), budget, None));
            }
            Err(e) => {
                per_row.push(vec![None; points.len()]);
                extra.push((String::new(), String::new(), Some(e)));
            }
        }
    }
    let tokens: Vec<Vec<Option<f64>>> = per_row
        .iter()
        .map(|r| r.iter().map(|p| p.map(|p| p.tokens_per_s)).collect())
        .collect();
    let published: Vec<f64> = rows.iter().map(|(_, r)| r.published).collect();
    let mut machines: Vec<String> = Vec::new();
    let group: Vec<usize> = rows
        .iter()
        .map(|(_, r)| match machines.iter().position(|m| *m == r.hw) {
            Some(g) => g,
            None => {
                machines.push(r.hw.clone());
                machines.len() - 1
            }
        })
        .collect();
    let fits = leave_one_out(&tokens, &published, &group);
    let fitted_points: Vec<(String, Calibration)> = machines
        .iter()
        .enumerate()
        .filter_map(|(g, m)| {
            let row = group.iter().position(|&x| x == g)?;
            Some((m.clone(), points[fits[row].fitted_point]))
        })
        .collect();
    let reports: Vec<RowReport> = rows
        .into_iter()
        .zip(fits.iter())
        .zip(per_row.iter())
        .zip(extra)
        .map(
            |((((table, row), fit), points_of_row), (bound, budget, error))| RowReport {
                table,
                row,
                held_out: points_of_row[fit.held_out_point],
                held_out_calibration: points[fit.held_out_point],
                held_out_alone: fit.held_out_alone,
                fitted_on: points_of_row[fit.fitted_point],
                bound,
                budget,
                error,
            },
        )
        .collect();
    let ratio = |p: Option<Point>, r: &PublishedRow| p.map(|p| p.tokens_per_s / r.published);
    let held = error_summary(reports.iter().filter_map(|r| ratio(r.held_out, &r.row)));
    let fitted = error_summary(reports.iter().filter_map(|r| ratio(r.fitted_on, &r.row)));
    let rankings = rankings(&reports);
    if args.json {
        let value = serde_json::json!({
            "rows": reports,
            "fitted_per_machine": fitted_points,
            "held_out_error": { "geomean": held.0, "max": held.1 },
            "fitted_on_error": { "geomean": fitted.0, "max": fitted.1 },
            "rankings": rankings,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    let machines_line = fitted_points
        .iter()
        .map(|(m, c)| {
            format!(
                "{m}: prefill efficiency {:.1}, task overhead {} us",
                c.prefill_efficiency, c.task_overhead_us
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    println!(
        "model {MODEL}, fp16 activations and KV; each profile's effective rates, calibrated per\n\
         machine on its rows: prefill efficiency x task overhead ({} grid points); held out =\n\
         fitted on the machine's other rows, fitted = fitted on all its rows ({machines_line})\n",
        points.len(),
    );
    println!("| table | row | schedule | hw | policy | published tok/s | held-out tok/s (ratio) | fitted tok/s (ratio) | prefill s / decode step s | eq.12 bound | budget |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &reports {
        let policy = r
            .row
            .sets
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let alone = if r.held_out_alone {
            " (alone: not held out)"
        } else {
            ""
        };
        let cell = |p: Option<Point>| match p {
            Some(p) => format!(
                "{:.2} ({:.2}x)",
                p.tokens_per_s,
                p.tokens_per_s / r.row.published
            ),
            None => "-".to_string(),
        };
        let held_cell = format!("{}{alone}", cell(r.held_out));
        let split = r.fitted_on.map_or("-".to_string(), |p| {
            format!("{:.0} / {:.2}", p.prefill_s, p.decode_step_s)
        });
        println!(
            "| {} | {} | {} | {} | {} | {}{} | {} | {} | {} | {} | {} |",
            r.row.table,
            r.row.row,
            r.row.schedule,
            r.row.hw,
            policy,
            r.row.published,
            if r.row.from_figure { " (fig.)" } else { "" },
            held_cell,
            cell(r.fitted_on),
            split,
            r.bound,
            r.error.as_deref().unwrap_or(&r.budget)
        );
    }
    println!(
        "\nheld-out error: geometric mean {:.2}x, worst {:.2}x; fitted-on error: geometric mean {:.2}x, worst {:.2}x",
        held.0, held.1, fitted.0, fitted.1
    );
    for line in &rankings {
        println!("{line}");
    }
    ExitCode::SUCCESS
}

fn budget_of(profile: &HardwareProfile, space: &str) -> f64 {
    use crate::cost::hardware::Level;
    match space {
        "gpu" => profile.budget_bytes(Level::Gpu),
        "pinned" => profile.budget_bytes(Level::Pinned),
        _ => profile.budget_bytes(Level::Host),
    }
}

/// The decode step's binding resource (eq. 12) on the effective profile.
fn bound_of(program: &Program, deps: &[Vec<TaskId>], profile: &HardwareProfile) -> String {
    predict(
        program,
        deps,
        &profile.effective(),
        &CostSettings::default(),
    )
    .ok()
    .and_then(|p| p.layer_bound)
    .map_or("-".to_string(), |b| {
        format!("{:?}", b.bottleneck)
            .trim_matches('"')
            .to_lowercase()
    })
}

/// The paired rankings the papers report, checked on the held-out predictions: in every
/// (table, setting) where CGOPipe and FlexGen both have a row, CGOPipe is faster (MoE-
/// Lightning Tab. 4/5), and FlexGen is faster than FlexGen(c) (Tab. 4).
fn rankings(reports: &[RowReport]) -> Vec<String> {
    let setting = |r: &RowReport| {
        (
            r.row.table.clone(),
            r.row.hw.clone(),
            r.row.prompt_len,
            r.row.gen_len,
        )
    };
    let mut lines = Vec::new();
    for (faster, slower) in [("cgopipe", "flexgen"), ("flexgen", "flexgen_cpu_attn")] {
        for a in reports.iter().filter(|r| r.row.schedule == faster) {
            for b in reports
                .iter()
                .filter(|r| r.row.schedule == slower && setting(r) == setting(a))
            {
                let (Some(pa), Some(pb)) = (a.held_out, b.held_out) else {
                    continue;
                };
                let holds = pa.tokens_per_s > pb.tokens_per_s;
                lines.push(format!(
                    "{} {faster} > {slower} ({} / {}): predicted {:.2}x, published {:.2}x: {}",
                    a.row.table,
                    a.row.row,
                    b.row.row,
                    pa.tokens_per_s / pb.tokens_per_s,
                    a.row.published / b.row.published,
                    if holds { "holds" } else { "REVERSED" }
                ));
            }
        }
    }
    lines
}
