//! The paired rankings MoE-Lightning reports (Tab. 4 and 5: CGOPipe faster than FlexGen
//! with the same policy or FlexGen's own, FlexGen faster than FlexGen with CPU attention)
//! hold in the prediction of the checked-in rows (`reproduce/moe_lightning.ron`) on each
//! profile's effective rates, before anything is fitted to the rows (prefill efficiency 1,
//! no task overhead): the ordering comes from the schedules and the sourced constants, not
//! from the calibration. The published values only decide which pairs to compare.

use moec::compile::{compile, Options};
use moec::cost::hardware::HardwareProfile;
use moec::cost::predict::{predict, CostSettings};
use moec::cost::reproduce::{
    calibrated, fitted_points, grid, tables, Calibration, PublishedRow, ACT_BYTES, MODEL,
};
use moec::ir::{TaskId, Workload};
use moec::model::card::ModelCard;

fn schedule_path(name: &str) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules");
    let top = root.join(format!("{name}.sched"));
    if top.exists() {
        top
    } else {
        root.join("baselines").join(format!("{name}.sched"))
    }
}

/// `source` compiled with `options` (a failure panics with its rendered diagnostics) and
/// each task's predecessors, as `predict` takes them.
fn compiled_with_deps(
    name: &str,
    source: &str,
    options: &Options,
) -> (moec::compile::Compiled, Vec<Vec<TaskId>>) {
    let compiled = compile(source, options)
        .unwrap_or_else(|d| panic!("{name}: {}", moec::diag::render_all(&d, name, source)));
    let dag = &compiled.info.dag;
    let deps = (0..compiled.program.tasks.len())
        .map(|t| dag.preds(TaskId::new(t)).iter().map(|d| d.from).collect())
        .collect();
    (compiled, deps)
}

/// Generation tokens/s of a row on its profile's effective rates, unfitted.
fn predicted(row: &PublishedRow, card: &ModelCard) -> f64 {
    let unfitted = Calibration {
        prefill_efficiency: 1.0,
        task_overhead_us: 0.0,
    };
    predicted_at(row, card, &[unfitted])[0]
}

/// Generation tokens/s of a row at each calibration point (compiled once).
fn predicted_at(row: &PublishedRow, card: &ModelCard, points: &[Calibration]) -> Vec<f64> {
    let source = std::fs::read_to_string(schedule_path(&row.schedule)).expect("schedule");
    let profile = row.profile(&HardwareProfile::load(&row.hw).expect("profile"));
    let mut options = Options::new(card.clone());
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
    let (compiled, deps) = compiled_with_deps(&row.schedule, &source, &options);
    points
        .iter()
        .map(|&point| {
            predict(
                &compiled.program,
                &deps,
                &calibrated(&profile, point),
                &CostSettings::default(),
            )
            .expect("prediction")
            .tokens_per_s
            .expect("a decode step")
        })
        .collect()
}

#[test]
fn moe_lightning_rankings_hold_before_any_fit() {
    let card = ModelCard::load(MODEL).expect("card");
    let rows: Vec<PublishedRow> = tables()
        .expect("tables parse")
        .into_iter()
        .flat_map(|(_, rows)| rows)
        .collect();
    let tokens: Vec<f64> = rows.iter().map(|r| predicted(r, &card)).collect();
    let same_setting = |a: &PublishedRow, b: &PublishedRow| {
        a.table == b.table && a.hw == b.hw && a.prompt_len == b.prompt_len && a.gen_len == b.gen_len
    };
    let mut pairs = 0;
    for (faster, slower) in [("cgopipe", "flexgen"), ("flexgen", "flexgen_cpu_attn")] {
        for (i, a) in rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.schedule == faster)
        {
            for (j, b) in rows
                .iter()
                .enumerate()
                .filter(|(_, r)| r.schedule == slower && same_setting(r, a))
            {
                assert!(
                    a.published > b.published,
                    "the table itself ranks {} above {}",
                    a.row,
                    b.row
                );
                assert!(
                    tokens[i] > tokens[j],
                    "{} predicted {:.2} tok/s, not above {} at {:.2}",
                    a.row,
                    tokens[i],
                    b.row,
                    tokens[j]
                );
                pairs += 1;
            }
        }
    }
    // Tab. 4: 4 settings x (CGOPipe/FlexGen, FlexGen/FlexGen(c)); Tab. 5: CGOPipe against
    // three FlexGen policies.
    assert_eq!(pairs, 11);
}

/// `reproduce/calibration.ron` (what `--rates calibrated` predicts with) holds, for each
/// machine, a point where the fit's error over that machine's rows (summed squared log
/// ratio, as `moec reproduce` fits) is no higher than at any neighbouring grid point: a
/// schedule or model change that moves the fit fails here instead of leaving a stale point.
/// (The whole grid is `moec reproduce`'s job; the neighbours keep this test short.) At
/// that point every row's prediction stays within the fitted-on error reached so far.
#[test]
fn checked_in_calibration_is_where_the_fit_is_lowest_locally() {
    let card = ModelCard::load(MODEL).expect("card");
    let rows: Vec<PublishedRow> = tables()
        .expect("tables parse")
        .into_iter()
        .flat_map(|(_, rows)| rows)
        .collect();
    let grid = grid();
    let efficiencies: Vec<f64> = {
        let mut v: Vec<f64> = grid.iter().map(|p| p.prefill_efficiency).collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    };
    let overheads: Vec<f64> = {
        let mut v: Vec<f64> = grid.iter().map(|p| p.task_overhead_us).collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    };
    let neighbours = |values: &[f64], x: f64| -> Vec<f64> {
        let i = values
            .iter()
            .position(|v| (v - x).abs() < 1e-9)
            .unwrap_or_else(|| panic!("{x} is not on the fit's grid"));
        [
            i.checked_sub(1),
            Some(i),
            Some(i + 1).filter(|&j| j < values.len()),
        ]
        .into_iter()
        .flatten()
        .map(|j| values[j])
        .collect()
    };
    let points = fitted_points().expect("calibration.ron parses");
    assert_eq!(
        points.keys().collect::<Vec<_>>(),
        ["l4", "t4"],
        "one point per machine of the rows"
    );
    let mut fitted_on: Vec<(String, f64)> = Vec::new();
    for (machine, stored) in &points {
        let mut candidates = vec![*stored];
        for e in neighbours(&efficiencies, stored.prefill_efficiency) {
            for o in neighbours(&overheads, stored.task_overhead_us) {
                if (e, o) != (stored.prefill_efficiency, stored.task_overhead_us) {
                    candidates.push(Calibration {
                        prefill_efficiency: e,
                        task_overhead_us: o,
                    });
                }
            }
        }
        let mut error = vec![0.0; candidates.len()];
        for row in rows.iter().filter(|r| &r.hw == machine) {
            for (i, tokens) in predicted_at(row, &card, &candidates)
                .into_iter()
                .enumerate()
            {
                error[i] += (tokens / row.published).ln().powi(2);
                if i == 0 {
                    fitted_on.push((row.row.clone(), tokens / row.published));
                }
            }
        }
        for (point, e) in candidates.iter().zip(&error).skip(1) {
            assert!(
                error[0] <= *e,
                "{machine}: the checked-in point {stored:?} has error {:.4}, {point:?} has {e:.4}",
                error[0]
            );
        }
    }
    // The fitted-on error against the published values (moec reproduce's "fitted" column):
    // a guard against the model drifting from the papers, at the level reached (geometric
    // mean 1.19x, worst 1.70x, docs/reproduce.md), not the band (1.15x / 1.3x),
    // which is not reached.
    assert_eq!(
        fitted_on.len(),
        rows.len(),
        "every row is on a fitted machine"
    );
    let logs: Vec<f64> = fitted_on.iter().map(|(_, r)| r.ln().abs()).collect();
    let geomean = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
    println!(
        "fitted-on error: geometric mean {geomean:.3}x over {} rows",
        logs.len()
    );
    assert!(
        geomean <= 1.21,
        "fitted-on geometric mean error {geomean:.3}x"
    );
    for (row, ratio) in &fitted_on {
        assert!(
            (1.0 / 1.75..=1.75).contains(ratio),
            "{row}: predicted / published {ratio:.3}"
        );
    }
}

/// Generation tokens/s of `schedule` on `hw` at the given params and host budget
/// (Mixtral-8x7B, fp16 activations, datasheet rates), as `moec plan` scores a candidate.
fn predicted_policy(
    schedule: &str,
    hw: &str,
    host_gb: f64,
    (prompt_len, gen_len): (u64, u64),
    sets: &[(&str, &str)],
) -> f64 {
    let card = ModelCard::load(MODEL).expect("card");
    let source = std::fs::read_to_string(schedule_path(schedule)).expect("schedule");
    let mut profile = HardwareProfile::load(hw).expect("profile");
    profile.cpu.mem_gb = host_gb;
    profile.cpu.pinned_gb = host_gb;
    let mut options = Options::new(card);
    options.act_bytes = ACT_BYTES;
    options.workload = Workload {
        batch: 1,
        prompt_len,
        gen_len,
    };
    options.sets = sets
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (compiled, deps) = compiled_with_deps(schedule, &source, &options);
    predict(&compiled.program, &deps, &profile, &CostSettings::default())
        .expect("prediction")
        .tokens_per_s
        .expect("a repeated step")
}

/// MoE-Lens (§7, Fig. 11) measures VSLPipe above MoE-Lightning on an A40 capped to 16 GB
/// with 70 and 210 GB of KV cache (3.2x and 6.4x on average), and the gap wider with more
/// cache. At the policies `moec plan` picks for each (docs/reproduce.md: MTBench prompt 98,
/// generation 128, host budget 94 GB of weights + the KV; `packet_mb` at the paper's 100
/// MB), VSLPipe's predicted throughput is above CGOPipe's on both budgets, and by more on
/// the larger one. The published values come from a figure, so only the order is checked.
#[test]
fn vslpipe_is_above_cgopipe_on_the_a40_and_more_so_with_more_kv() {
    let workload = (98, 128);
    let ratio = |host_gb: f64, cgopipe: &[(&str, &str)], vslpipe: &[(&str, &str)]| {
        let c = predicted_policy("cgopipe", "a40-16gb", host_gb, workload, cgopipe);
        let v = predicted_policy("vslpipe", "a40-16gb", host_gb, workload, vslpipe);
        println!("{host_gb} GB host: VSLPipe {v:.1} tok/s, CGOPipe {c:.1} tok/s");
        v / c
    };
    let small = ratio(
        164.0,
        &[("ubs", "126"), ("n_ub", "16"), ("r_w", "0.0")],
        &[
            ("seqs", "6861"),
            ("kv_pct", "16"),
            ("tok_pct", "5"),
            ("packet_mb", "100"),
        ],
    );
    let large = ratio(
        304.0,
        &[("ubs", "300"), ("n_ub", "16"), ("r_w", "0.0")],
        &[
            ("seqs", "21724"),
            ("kv_pct", "16"),
            ("tok_pct", "1"),
            ("packet_mb", "100"),
        ],
    );
    assert!(small > 1.0, "70 GB KV: VSLPipe / CGOPipe = {small:.3}");
    assert!(
        large > small,
        "210 GB KV: {large:.3}, not above 70 GB's {small:.3}"
    );
}

/// Without `--rates`, `moec plan` predicts on the best rates the T4 profile has (the
/// calibrated ones) and lands within 2x of MoE-Lightning's published T4 figure: Tab. 5,
/// MoE-Lightning(p), MTBench on S1 (a T4), generation 128: 30.12 tokens/s (prompts padded
/// to MTBench's longest, 418, fp16 activations: the row of reproduce/moe_lightning.ron).
/// (On datasheet peaks, the old default, it predicts several times that; issue 27.) `r_w`
/// is fixed at 0 and the grid kept coarse so the test stays cheap; the full search picks
/// the same policy (docs/reproduce.md, "The planner on the papers' settings").
#[test]
fn plan_without_rates_is_within_2x_of_the_published_t4_figure() {
    let published = 30.12;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moec"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "plan",
            "schedules/cgopipe.sched",
            "--model",
            MODEL,
            "--hw",
            "t4",
            "--prompt-len",
            "418",
            "--gen-len",
            "128",
            "--act-bytes",
            "2",
            "--set",
            "r_w=0.0",
            "--max-grid",
            "40",
            "--top",
            "1",
            "--json",
        ])
        .output()
        .expect("moec runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let rates = json["rates"].as_str().unwrap_or_default();
    assert!(rates.starts_with("calibrated"), "{rates}");
    let predicted = json["result"]["top"][0]["tokens_per_s"]
        .as_f64()
        .expect("a best candidate");
    let ratio = predicted / published;
    println!("planned {predicted:.2} tok/s, {ratio:.2}x the published {published}");
    assert!((0.5..=2.0).contains(&ratio), "{predicted} vs {published}");
}
