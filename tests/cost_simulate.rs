//! The simulator and planner on the real schedules and the papers' settings.

use moec::compile::{compile, Options};
use moec::cost::hardware::HardwareProfile;
use moec::cost::predict::{predict, CostSettings, Prediction};
use moec::ir::{TaskId, Workload};
use moec::model::card::ModelCard;
use std::process::Command;

/// Predicts a schedule for Mixtral-8x7B with fp16 activations/KV (what the papers run).
fn predict_paper(
    schedule: &str,
    hw: &str,
    prompt: u64,
    gen: u64,
    sets: &[(&str, &str)],
) -> Prediction {
    let source = std::fs::read_to_string(format!("schedules/{schedule}.sched")).unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-8x7b").unwrap());
    options.act_bytes = 2;
    options.workload = Workload {
        batch: 64,
        prompt_len: prompt,
        gen_len: gen,
    };
    options.sets = sets
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{schedule}: {d:?}"));
    let deps: Vec<Vec<TaskId>> = (0..compiled.program.tasks.len())
        .map(|t| {
            compiled
                .info
                .dag
                .preds(TaskId::new(t))
                .iter()
                .map(|d| d.from)
                .collect()
        })
        .collect();
    let profile = HardwareProfile::load(hw).unwrap();
    predict(&compiled.program, &deps, &profile, &CostSettings::default()).unwrap()
}

/// MoE-Lightning Tab. 5 (MTBench on S1 = T4, generation 128, prompts padded to 418): with
/// the same policy (mu = 36, N = 504) CGOPipe measured 30.12 tokens/s and FlexGen 16.82.
/// The simulation must rank them the same way.
#[test]
fn cgopipe_beats_flexgen_on_t4_with_the_tab5_policy() {
    let cgopipe = predict_paper("cgopipe", "t4", 418, 128, &[("ubs", "36"), ("n_ub", "14")]);
    let flexgen = predict_paper(
        "flexgen",
        "t4",
        418,
        128,
        &[("bs", "36"), ("n_batch", "14")],
    );
    let (c, f) = (cgopipe.tokens_per_s.unwrap(), flexgen.tokens_per_s.unwrap());
    assert!(c > 1.3 * f, "cgopipe {c} vs flexgen {f}");
    // FlexGen moves the KV cache over the link every step; CGOPipe does not.
    let bound = |p: &Prediction| p.layer_bound.unwrap();
    assert!(bound(&flexgen).comm_seconds > bound(&cgopipe).comm_seconds);
}

/// MoE-Lightning Tab. 4 (synthetic reasoning, S2 = L4, prompts padded to 256, gen 50):
/// MoE-Lightning(p) at mu = 100, N/mu = 15 measured 105.29 tokens/s, FlexGen at 64 x 33
/// measured 50.14.
#[test]
fn cgopipe_beats_flexgen_on_l4_with_the_tab4_policies() {
    let cgopipe = predict_paper("cgopipe", "l4", 256, 50, &[("ubs", "100"), ("n_ub", "15")]);
    let flexgen = predict_paper("flexgen", "l4", 256, 50, &[("bs", "64"), ("n_batch", "33")]);
    let (c, f) = (cgopipe.tokens_per_s.unwrap(), flexgen.tokens_per_s.unwrap());
    assert!(c > 1.3 * f, "cgopipe {c} vs flexgen {f}");
}

fn moec(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moec"))
        .args(args)
        .output()
        .unwrap()
}

/// `simulate` writes a Gantt SVG and a Chrome trace and prints the documented JSON keys.
#[test]
fn simulate_writes_timeline_trace_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("t.svg");
    let trace = dir.path().join("t.json");
    let out = moec(&[
        "simulate",
        "schedules/cgopipe.sched",
        "--model",
        "mixtral-tiny",
        "--hw",
        "l4",
        "--timeline",
        svg.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["tokens_per_s", "step_seconds", "engine_busy", "peak_bytes"] {
        assert!(!json[key].is_null(), "missing {key}: {json}");
    }
    assert!(json["peak_bytes"]["gpu"].as_u64().unwrap() > 0);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("post_attn"));
    let trace_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace_json["traceEvents"].as_array().unwrap();
    assert!(events.iter().filter(|e| e["ph"] == "X").count() > 10);
    assert!(events.iter().any(|e| e["args"]["name"] == "h2d"));
}

/// The planner on CGOPipe / Mixtral-8x7B / T4 (MTBench, gen 128) picks a micro-batch of the
/// order MoE-Lightning uses there (36 in Tab. 5, 132-324 on L4 in its artifact logs): tens
/// to a few hundred sequences, and a batch N in the hundreds to thousands.
#[test]
fn plan_picks_paper_sized_micro_batches() {
    let out = moec(&[
        "plan",
        "schedules/cgopipe.sched",
        "--model",
        "mixtral-8x7b",
        "--hw",
        "t4",
        "--workload",
        "mtbench-128",
        "--act-bytes",
        "2",
        "--set",
        "r_w=0.0",
        "--max-grid",
        "40",
        "--top",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let best = &json["result"]["top"][0]["values"];
    let value = |name: &str| -> i64 {
        let pair = best
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p[0] == name)
            .unwrap();
        pair[1]["Int"].as_i64().unwrap()
    };
    let (ubs, n_ub) = (value("ubs"), value("n_ub"));
    assert!((16..=512).contains(&ubs), "ubs {ubs}");
    assert!((100..=10_000).contains(&(ubs * n_ub)), "N {}", ubs * n_ub);
}

#[test]
fn bad_inputs_fail_cleanly() {
    let out = moec(&["simulate", "schedules/cgopipe.sched", "--hw", "tpu-v9"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown hardware profile"));
    let out = moec(&["simulate", "schedules/cgopipe.sched", "--set", "ubs"]);
    assert_eq!(out.status.code(), Some(1));
    let out = moec(&["simulate", "schedules/cgopipe.sched", "--gpu-mem", "lots"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a size"));
    let out = moec(&[
        "plan",
        "schedules/cgopipe.sched",
        "--model",
        "mixtral-8x7b",
        "--gpu-mem",
        "1MB",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no parameter setting fits"));
    let out = moec(&["check", "schedules/cgopipe.sched", "--gpu-mem", "1MB"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gpu over by") && err.contains("w_gpu"),
        "{err}"
    );
}

/// Klotski's `experts(.., ub = all)` (§4: an expert's weights serve every batch of the
/// group) reads each expert's weights once: the group's first task is charged the read
/// (at least one Mixtral-8x7B expert, 3 x 4096 x 14336 x 2 B = 352,321,536 B, over the
/// GPU's memory bandwidth), the other batches' parts are charged no weight bytes (each
/// takes less than that read alone), and the decode step holds one group per (layer, rank).
#[test]
fn klotski_reads_each_expert_once_per_batch_group() {
    use moec::cost::hardware::Level;
    use moec::cost::predict::task_time;
    use moec::ir::Op;
    let source = std::fs::read_to_string("schedules/klotski.sched").unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-8x7b").unwrap());
    options.act_bytes = 2;
    options.workload = Workload {
        batch: 64,
        prompt_len: 512,
        gen_len: 32,
    };
    options.sets = vec![("bs".into(), "16".into()), ("n_batch".into(), "4".into())];
    let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("klotski: {d:?}"));
    let program = &compiled.program;
    let profile = HardwareProfile::load("rtx3090").unwrap();
    let expert_read = 352_321_536.0 / profile.level_bandwidth(Level::Gpu);
    let decode = program
        .steps
        .iter()
        .find(|s| s.kind == moec::ir::StepKind::Decode)
        .unwrap();
    let (mut heads, mut members) = (0, 0);
    for id in decode.task_ids() {
        let task = program.task(id);
        if !matches!(task.op, Op::Experts { .. }) {
            continue;
        }
        let head = task.group.expect("every klotski expert task is in a group");
        let seconds = task_time(program, id, &profile, &CostSettings::default()).seconds;
        if head == id {
            heads += 1;
            assert!(
                seconds >= expert_read,
                "{id}: {seconds} s < one expert read"
            );
        } else {
            members += 1;
            assert!(
                seconds < expert_read,
                "{id}: {seconds} s charges the weights again"
            );
        }
    }
    // 32 layers x 8 ranks groups of 4 batches.
    assert_eq!((heads, members), (32 * 8, 32 * 8 * 3));
}

/// `moec plan` takes the workload specs `moec run` takes (issue 27): for 16 prompts of 64
/// tokens generating 32, on the mid card under a 600 MB GPU budget, it plans that run
/// (batch 16, prompt 64, gen 32), keeps its best policy inside the budget, and prints a
/// `moec run` line with the same card, profile, budget, spec and every param, and a
/// `moec check` line that the checker accepts under the same budget.
#[test]
fn plan_for_a_run_spec_prints_commands_that_check_accepts() {
    let spec = "count=16,mean=64,max=64,min=64,gen=32";
    let out = moec(&[
        "plan",
        "schedules/cgopipe.sched",
        "--model",
        "mixtral-mid",
        "--hw",
        "h200",
        "--gpu-mem",
        "600MB",
        "--workload",
        spec,
        "--top",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        json["workload"],
        serde_json::json!({"batch": 16, "prompt_len": 64, "gen_len": 32})
    );
    let best = &json["result"]["top"][0];
    assert!(best["gpu_bytes"].as_u64().unwrap() <= 600_000_000, "{best}");
    let run = json["run_command"].as_str().unwrap();
    let prefix = format!(
        "moec run schedules/cgopipe.sched --model mixtral-mid --hw h200 --gpu-mem 600MB --workload {spec} --set "
    );
    assert!(run.starts_with(&prefix), "{run}");
    for name in ["ubs", "n_ub", "r_w"] {
        assert!(run.contains(&format!(" --set {name}=")), "{run}");
    }
    let check = json["check_command"].as_str().unwrap();
    assert!(
        check.contains("--gpu-mem 600MB --batch 16 --prompt-len 64 --gen-len 32 --set "),
        "{check}"
    );
    // Every word is plain (no quoting), so splitting on spaces gives the arguments.
    let words: Vec<&str> = check.split(' ').collect();
    assert_eq!(words[..2], ["moec", "check"]);
    let out = moec(&words[1..]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{check}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("cgopipe: ok"), "{stdout}");
    let gpu = stdout
        .lines()
        .find(|l| l.contains("(--gpu-mem)"))
        .unwrap_or_default();
    assert!(gpu.contains("600.00 MB") && gpu.contains(" ok"), "{stdout}");
}

/// The planner's search with its prunes (declared buffers over budget before unrolling,
/// points above one past the unroll limit skipped, arms whose `routed(..) >= t` can never
/// hold left out, the lean throughput prediction, and, as `moec plan` runs it, points whose
/// costed tasks bound them under the candidates they would have to beat left unsimulated:
/// the same answer and counts with and without that bound) picks
/// the same policies, with the same predicted throughput, as the unpruned search that
/// elaborates every point in full and ranks it by the full `predict` (the evaluation `moec
/// plan` ran before the prunes), on the mid cards, for every schedule whose params it
/// searches, under a GPU budget tight enough that many points are over it.
#[test]
fn pruned_plan_search_picks_the_exhaustive_searchs_policy_on_the_mid_cards() {
    use moec::compile::ast_to_ir;
    use moec::cost::budget::{budget_table, BudgetOverrides};
    use moec::cost::plan::{search, search_bounded, Candidate, Outcome, SearchOptions};
    use moec::engine::fit_params::{evaluate_point, evaluate_point_bounded, PointTarget};
    use moec::ir::deps;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let profile = HardwareProfile::load("t4").unwrap();
    let settings = CostSettings::default();
    let overrides = BudgetOverrides {
        gpu_bytes: Some(600e6),
        host_bytes: None,
    };
    let share = |_: &moec::ir::Program, _: u64| 1.0;
    // Fiddler with 8 resident experts, as its users fix the placement.
    let cases = [
        ("cgopipe", "qwen3-moe-mid", &[][..]),
        ("fiddler", "mixtral-mid", &[("n_gpu", "8")][..]),
        ("klotski", "olmoe-mid", &[]),
        ("flexgen", "dbrx-mid", &[]),
        ("baselines/resident", "gpt-oss-mid", &[]),
    ];
    let mut over_budget = 0;
    let below_answers = AtomicUsize::new(0);
    for (schedule, card, sets) in cases {
        let workload = Workload {
            batch: 8,
            prompt_len: 32,
            gen_len: 8,
        };
        let (file, options, spaces) = plan_setup(&profile, schedule, card, workload, sets);
        let search_options = |limits_grow| SearchOptions {
            max_grid: 12,
            refine_from: 1,
            top: 3,
            limits_grow,
            walk_ahead: true,
        };
        let target = PointTarget {
            file: &file,
            options: &options,
            profile: &profile,
            settings,
            overrides,
            machine_bytes: None,
            gpu_in_host: false,
            slot_share: &share,
            prune_declared: true,
            same_program: None,
        };
        let pruned = search(&spaces, &search_options(true), |values| {
            evaluate_point(&target, values)
        });
        // With the throughput bound (`moec plan`'s search): points bounded under the
        // candidates they would have to beat are not simulated; the answer and every
        // count are the same.
        let bounded = search_bounded(&spaces, &search_options(true), |values, below| {
            let outcome = evaluate_point_bounded(&target, values, below);
            if matches!(outcome, Outcome::Below(_)) {
                below_answers.fetch_add(1, Ordering::Relaxed);
            }
            outcome
        });
        assert_eq!(bounded, pruned, "{schedule} on {card}: with the bound");
        // The search before the prunes: every point elaborated, its budget checked on the
        // whole program, ranked by `predict`.
        let exhaustive = search(&spaces, &search_options(false), |values| {
            let mut o = options.clone();
            o.sets
                .extend(values.iter().map(|(n, v)| (n.clone(), v.to_string())));
            // Every arm built, those that can never run included.
            o.routed_ceiling = false;
            let program = match ast_to_ir(&file, &o) {
                Ok((program, _)) => program,
                Err(d) => return Outcome::Invalid(d[0].message.clone()),
            };
            let deps: Vec<Vec<TaskId>> = deps::candidate_edges(&program)
                .into_iter()
                .map(|preds| preds.into_iter().map(|(from, _, _)| from).collect())
                .collect();
            let table = budget_table(&program, Some(&profile), &overrides);
            if !table.fits() {
                return Outcome::OverBudget;
            }
            match predict(&program, &deps, &profile, &settings) {
                Ok(p) => match (p.tokens_per_s, p.decode_tokens_per_s) {
                    (Some(total), Some(decode)) => Outcome::Fits(Candidate {
                        values: values.to_vec(),
                        tokens_per_s: total,
                        decode_tokens_per_s: decode,
                        gpu_bytes: table.peak("gpu"),
                        pinned_bytes: table.peak("pinned"),
                        host_bytes: table.peak("host"),
                    }),
                    _ => Outcome::Invalid("no decode step".into()),
                },
                Err(e) => Outcome::Invalid(e.to_string()),
            }
        });
        assert!(
            !exhaustive.top.is_empty(),
            "{schedule} on {card}: {exhaustive:?}"
        );
        over_budget += exhaustive.over_budget;
        assert_eq!(pruned.top, exhaustive.top, "{schedule} on {card}");
        // A point both over budget and invalid may count as either.
        assert_eq!(
            (
                pruned.evaluated,
                pruned.feasible,
                pruned.over_budget + pruned.invalid
            ),
            (
                exhaustive.evaluated,
                exhaustive.feasible,
                exhaustive.over_budget + exhaustive.invalid
            ),
            "{schedule} on {card}"
        );
    }
    // The budget bites: the declared-buffer prune had points to prune.
    assert!(over_budget > 0);
    // And the bound had points to drop.
    assert!(below_answers.into_inner() > 0);
}

/// The bound the planner skips a point by (`PointCosts::throughput_bound`: each step at
/// least its busiest resource's summed task times) is never under the point's exact
/// figures (`PointCosts::throughput`, `predict`'s) on the mid cards, at every point of each
/// schedule's coarse grid that fits: so a point the search answers `Below` for could not
/// have ranked, and the bounded search's pick is the exhaustive one's (compared in
/// `pruned_plan_search_picks_the_exhaustive_searchs_policy_on_the_mid_cards`). And with
/// three refinement starts, the walks run ahead side by side (`SearchOptions::walk_ahead`)
/// give the answer and every count of the walks run one by one.
#[test]
fn the_bound_never_undercuts_a_point_and_walks_run_ahead_answer_as_one_by_one() {
    use moec::compile::ast_to_ir;
    use moec::cost::budget::{budget_table, BudgetOverrides};
    use moec::cost::plan::{search, search_bounded, Outcome, SearchOptions};
    use moec::cost::predict::PointCosts;
    use moec::engine::fit_params::{evaluate_point_bounded, PointTarget};
    use moec::ir::deps;
    let profile = HardwareProfile::load("t4").unwrap();
    let settings = CostSettings::default();
    let overrides = BudgetOverrides {
        gpu_bytes: Some(600e6),
        host_bytes: None,
    };
    let share = |_: &moec::ir::Program, _: u64| 1.0;
    let cases = [
        ("cgopipe", "qwen3-moe-mid", &[][..]),
        ("fiddler", "mixtral-mid", &[("n_gpu", "8")][..]),
        ("klotski", "olmoe-mid", &[]),
    ];
    // Each fitting point's bound over its figure.
    let margins = std::sync::Mutex::new(Vec::new());
    for (schedule, card, sets) in cases {
        let workload = Workload {
            batch: 8,
            prompt_len: 32,
            gen_len: 8,
        };
        let (file, options, spaces) = plan_setup(&profile, schedule, card, workload, sets);
        // Every point of the coarse grid (no refinement): its bound against its figures.
        let grid = SearchOptions {
            max_grid: 12,
            refine_from: 0,
            top: 100,
            ..SearchOptions::default()
        };
        search(&spaces, &grid, |values| {
            let mut o = options.clone();
            o.sets
                .extend(values.iter().map(|(n, v)| (n.clone(), v.to_string())));
            let Ok((program, _)) = ast_to_ir(&file, &o) else {
                return Outcome::Invalid(String::new());
            };
            let table = budget_table(&program, Some(&profile), &overrides);
            if !table.fits() {
                return Outcome::OverBudget;
            }
            let costs = PointCosts::new(&program, &profile, &settings, table.peak("pinned"));
            let bound = costs.throughput_bound().expect("a bound on finite costs");
            let deps: Vec<Vec<TaskId>> = deps::candidate_preds(&program);
            let exact = costs.throughput(&deps).unwrap();
            let [bound_total, bound_decode, total, decode] = [
                bound.tokens_per_s,
                bound.decode_tokens_per_s,
                exact.tokens_per_s,
                exact.decode_tokens_per_s,
            ]
            .map(Option::unwrap);
            assert!(
                bound_total >= total && bound_decode >= decode,
                "{schedule} on {card} at {values:?}: bound {bound_total} / {bound_decode} under {total} / {decode}"
            );
            margins.lock().unwrap().push(bound_total / total);
            Outcome::Invalid(String::new())
        });
        // The search as `moec plan` runs it, three walks: run ahead, or one by one.
        let target = PointTarget {
            file: &file,
            options: &options,
            profile: &profile,
            settings,
            overrides,
            machine_bytes: None,
            gpu_in_host: false,
            slot_share: &share,
            prune_declared: true,
            same_program: None,
        };
        let walks = |walk_ahead| SearchOptions {
            max_grid: 12,
            refine_from: 3,
            top: 3,
            walk_ahead,
            ..SearchOptions::default()
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let run = |walk_ahead| {
            pool.install(|| {
                search_bounded(&spaces, &walks(walk_ahead), |values, below| {
                    evaluate_point_bounded(&target, values, below)
                })
            })
        };
        let one_by_one = run(false);
        assert!(one_by_one.evaluated > 12, "{schedule}: no refinement");
        assert_eq!(run(true), one_by_one, "{schedule} on {card}");
    }
    let margins = margins.into_inner().unwrap();
    assert!(margins.len() >= 8, "only {} fitting points", margins.len());
    // The bound is a bound, not the figure: some points' bound is well above it.
    assert!(margins.iter().any(|&m| m > 1.05), "{margins:?}");
}

/// A point whose program is an elaborated point's, because it differs only in params
/// that elaboration never read, is answered from that point's outcome
/// (`cost::plan::SamePrograms`, as `moec plan` does): MoE-Infinity with `code = 1` reads
/// neither `policy` nor `predictor` (`select` evaluates the branch it gives). The search
/// gives the answer and every count of the search that elaborates every point, and some
/// points were answered without elaborating.
#[test]
fn points_with_the_same_program_are_answered_as_elaborated_ones() {
    use moec::cost::plan::{search_bounded, SamePrograms, SearchOptions};
    use moec::engine::fit_params::evaluate_point_bounded;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let profile = HardwareProfile::load("t4").unwrap();
    let sets = [
        ("bs", "2"),
        ("n_cache", "-1"),
        ("n_pf", "2"),
        ("lookahead", "1"),
        ("home", "-1"),
    ];
    let workload = Workload {
        batch: 4,
        prompt_len: 16,
        gen_len: 4,
    };
    let (file, options, spaces) =
        plan_setup(&profile, "moe_infinity", "qwen3-moe-mid", workload, &sets);
    assert_eq!(spaces.len(), 3, "{spaces:?}");
    let share = |_: &moec::ir::Program, _: u64| 1.0;
    let same = SamePrograms::default();
    let target = |same_program| default_target(&file, &options, &profile, &share, same_program);
    let search_options = SearchOptions {
        max_grid: 12,
        refine_from: 2,
        top: 4,
        ..SearchOptions::default()
    };
    let every = target(None);
    let plain = search_bounded(&spaces, &search_options, |values, below| {
        evaluate_point_bounded(&every, values, below)
    });
    let recording = target(Some(&same));
    let answered = AtomicUsize::new(0);
    let reused = search_bounded(&spaces, &search_options, |values, below| {
        if let Some(outcome) = same.known(values, below) {
            answered.fetch_add(1, Ordering::Relaxed);
            return outcome;
        }
        let outcome = evaluate_point_bounded(&recording, values, below);
        same.evaluated(values, &outcome);
        outcome
    });
    assert_eq!(reused, plain);
    assert!(plain.feasible > 4, "{plain:?}");
    assert!(answered.into_inner() > 0, "no point answered from another");
}

/// Fiddler's copy arm `if routed(l, e, j) >= t` can never run where t exceeds a
/// micro-batch's tokens (decode: `ubs`; prefill: `ubs x prompt_len`); the elaborator then
/// leaves it out (`Options::routed_ceiling`). Left out or built, the prediction is the
/// same, on the T4's effective rates whose decode GEMM cap used to charge a never-running
/// GPU task its full flops: with no resident expert (ktransformers' split, `t_copy =
/// 1000000`, every arm dead in both steps; and the latency rule's t = 7 on the T4, dead in
/// decode at `ubs` <= 6 only) every figure is equal. The programs differ only by tasks that
/// never run: fewer tasks, same edges among the others' streams.
#[test]
fn never_running_arms_left_out_predict_what_building_them_predicts() {
    use moec::ir::deps;
    let profile = HardwareProfile::load("t4").unwrap().effective();
    let settings = CostSettings::default();
    let source = std::fs::read_to_string("schedules/fiddler.sched").unwrap();
    let predict_at = |sets: &[(&str, String)], ceiling: bool| {
        let sets: Vec<(&str, &str)> = sets.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut options = options_with_profile(&profile, "mixtral-mid", &sets);
        options.routed_ceiling = ceiling;
        let program = moec::compile::compile(&source, &options)
            .unwrap_or_else(|d| panic!("{sets:?}: {}", d[0]))
            .program;
        let deps: Vec<Vec<TaskId>> = deps::candidate_edges(&program)
            .into_iter()
            .map(|preds| preds.into_iter().map(|(from, _, _)| from).collect())
            .collect();
        let p = predict(&program, &deps, &profile, &settings).unwrap();
        (
            program.tasks.len(),
            p.tokens_per_s.unwrap(),
            p.decode_tokens_per_s.unwrap(),
        )
    };
    for t_copy in ["1000000", "0"] {
        for (ubs, n_ub) in [(1, 1), (2, 2), (4, 1)] {
            let sets = [
                ("n_gpu", "0".to_string()),
                ("t_copy", t_copy.to_string()),
                ("ubs", ubs.to_string()),
                ("n_ub", n_ub.to_string()),
            ];
            let (left_out, total, decode) = predict_at(&sets, true);
            let (built, total_built, decode_built) = predict_at(&sets, false);
            assert!(left_out < built, "{sets:?}: {left_out} vs {built} tasks");
            assert_eq!((total, decode), (total_built, decode_built), "{sets:?}");
        }
    }
}

/// A planner's point is elaborated without names (`Options::task_names = false`: no label
/// text, no argument spans) and its dependencies taken as predecessors alone
/// (`deps::candidate_preds`): the same tasks, field by field but the label, and the same
/// predecessors in the same order as the full elaboration's `candidate_edges`, on Fiddler
/// (labels and `after`-free arms) and Klotski (`after` on labels) over two mid cards, with
/// a schedule whose labels repeat still refused either way.
#[test]
fn a_point_elaborated_without_names_is_the_full_program_less_its_names() {
    use moec::compile::{ast_to_ir, source_to_ast};
    use moec::ir::deps;
    for (schedule, card, sets) in [
        ("fiddler", "mixtral-mid", &[("ubs", "2"), ("n_ub", "2")][..]),
        ("klotski", "olmoe-mid", &[]),
    ] {
        let source = std::fs::read_to_string(format!("schedules/{schedule}.sched")).unwrap();
        let file = source_to_ast(&source).unwrap();
        let mut options = Options::new(ModelCard::load(card).unwrap());
        options.workload = Workload {
            batch: 8,
            prompt_len: 32,
            gen_len: 8,
        };
        options.sets = sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (full, _) = ast_to_ir(&file, &options).unwrap();
        options.task_names = false;
        let (lean, _) = ast_to_ir(&file, &options).unwrap();
        assert_eq!(full.tasks.len(), lean.tasks.len(), "{schedule}");
        assert!(full.tasks.iter().any(|t| t.label.is_some()), "{schedule}");
        assert!(lean.tasks.iter().all(|t| t.label.is_none()), "{schedule}");
        assert!(lean.spans.task_args.iter().all(Vec::is_empty), "{schedule}");
        for (a, b) in full.tasks.iter().zip(&lean.tasks) {
            let mut a = a.clone();
            a.label = None;
            assert_eq!(&a, b, "{schedule}");
        }
        let edges: Vec<Vec<TaskId>> = deps::candidate_edges(&full)
            .into_iter()
            .map(|preds| preds.into_iter().map(|(from, _, _)| from).collect())
            .collect();
        assert_eq!(edges, deps::candidate_preds(&lean), "{schedule}");
        assert!(edges.iter().any(|p| p.len() > 1), "{schedule}");
    }
    // A label issued twice is an error without names too, with the same message.
    let twice = "schedule twice\nmicrobatches 1 of 1\nstream gpu: gpu.compute\n\
        buffer h: gpu = hidden(1)\n\
        decode {\n  for i in 0..2 { embed(ub = 0, w = W.embed, h = h) on gpu as e[0] }\n}\n";
    let file = source_to_ast(twice).unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    let full = ast_to_ir(&file, &options).unwrap_err();
    options.task_names = false;
    let lean = ast_to_ir(&file, &options).unwrap_err();
    assert_eq!(full[0].message, lean[0].message);
    assert!(full[0].message.contains("e[0]"), "{}", full[0].message);
}

/// `moec plan` under `--host-mem` (issue 43) on Mixtral-8x7B bf16 (plan only, nothing is
/// synthesised): `moe_infinity_disk` fits 16 GB and prints the split it picked, whose
/// figures are the card's sizes worked by hand: an expert is 3 x 4096 x 14336 x 2 B =
/// 352,321,536 B; a layer's dense part is attention (4096 x 4096 q and o, 4096 x 1024 k
/// and v) + router 4096 x 8 + two norms of 4096 = 41,984,000 params = 83,968,000 B, so
/// `w_dense` is 32 x that = 2,686,976,000 B; the checkpoint is 32 x (83,968,000 + 8 x
/// 352,321,536) + embedding and head 2 x 32000 x 4096 x 2 + the final norm 4096 x 2 =
/// 93,405,585,408 B. The cache `rc` holds `slots` experts, the schedule's formula
/// (`n_cache`, or min(8, bs x 2) + 2 for -1). `moe_infinity` cannot fit, and the plan says
/// why: on the T4 its checkpoint is memory-mapped and its 32 x 8 experts read in place
/// (90,194,313,216 B = 90.19 GB); on the H200 its defaults pin a copy of every weight
/// (the whole checkpoint, 93,405,585,408 B: 77.41 GB over 16 GB).
#[test]
fn plan_picks_the_disk_split_for_mixtral_8x7b_under_a_16gb_host_budget() {
    const EXPERT: u64 = 352_321_536;
    const CHECKPOINT: u64 = 93_405_585_408;
    let out = moec(&[
        "plan",
        "schedules/moe_infinity_disk.sched",
        "--model",
        "mixtral-8x7b",
        "--hw",
        "h200",
        "--host-mem",
        "16GB",
        "--top",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let best = &json["result"]["top"][0];
    let value = |name: &str| -> i64 {
        let pairs = best["values"].as_array().unwrap();
        let pair = pairs.iter().find(|p| p[0] == name).unwrap();
        pair[1]["Int"].as_i64().unwrap()
    };
    let (bs, n_cache) = (value("bs"), value("n_cache"));
    let slots = if n_cache < 0 {
        (bs * 2).min(8) as u64 + 2
    } else {
        n_cache.max(1) as u64
    };
    assert!(
        best["host_bytes"].as_u64().unwrap() <= 16_000_000_000,
        "{best}"
    );
    let split = &json["disk_split"];
    assert_eq!(split["checkpoint_bytes"], CHECKPOINT, "{split}");
    let line = |name: &str| -> u64 {
        let lines = split["in_host"].as_array().unwrap();
        let line = lines.iter().find(|l| l[0] == name).unwrap();
        line[2].as_u64().unwrap()
    };
    assert_eq!(line("w_dense"), 2_686_976_000, "{split}");
    assert_eq!(line("rc"), slots * EXPERT, "{split}");
    let in_host = split["in_host_bytes"].as_u64().unwrap();
    assert_eq!(
        split["disk_only_bytes"].as_u64().unwrap(),
        CHECKPOINT - in_host
    );
    assert_eq!(split["host_peak"], best["host_bytes"]);
    assert_eq!(split["host_budget"].as_f64(), Some(16e9));
    let run = json["run_command"].as_str().unwrap();
    assert!(
        run.starts_with(
            "moec run schedules/moe_infinity_disk.sched --model mixtral-8x7b --hw h200 --host-mem 16GB "
        ) && run.contains(&format!(" --set n_cache={n_cache} ")),
        "{run}"
    );
    let not_fitting = |hw: &str| {
        let out = moec(&[
            "plan",
            "schedules/moe_infinity.sched",
            "--model",
            "mixtral-8x7b",
            "--hw",
            hw,
            "--host-mem",
            "16GB",
        ]);
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("no parameter setting fits"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let t4 = not_fitting("t4");
    assert!(
        t4.contains("does not fit: `moe_infinity` memory-maps the checkpoint and reads 90.19 GB of it in place")
            && t4.contains("moe_infinity_disk.sched"),
        "{t4}"
    );
    let h200 = not_fitting("h200");
    assert!(
        h200.contains("does not fit: with the schedule's own params, pinned over by 77.41 GB"),
        "{h200}"
    );
}

/// On mixtral-tiny (an expert 3 x 128 x 256 x 2 B = 196,608 B) under `--host-mem 20MB`,
/// `moec plan` fills the budget with the expert cache (one slot more would not fit: for 2
/// prompts the prediction gains from every expert read it saves) and its printed `moec
/// run` line runs, reading experts from disk; `moec run --fit` under the same budget picks
/// the same params, says so with the host peak against the budget, and stays in it.
#[test]
fn a_planned_disk_split_on_the_tiny_card_runs_and_fit_sizes_the_cache_to_the_host_budget() {
    const EXPERT: u64 = 196_608;
    const BUDGET: u64 = 20_000_000;
    let cache = tempfile::tempdir().unwrap();
    let moec_here = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_moec"))
            .env("MOEC_CACHE_DIR", cache.path())
            .args(args)
            .output()
            .unwrap()
    };
    let spec = "count=2,mean=6,max=6,min=6,gen=4";
    let common = [
        "schedules/moe_infinity_disk.sched",
        "--model",
        "mixtral-tiny",
        "--hw",
        "h200",
        "--host-mem",
        "20MB",
        "--workload",
        spec,
    ];
    let mut plan = vec!["plan"];
    plan.extend(common);
    plan.extend(["--top", "1", "--json"]);
    let out = moec_here(&plan);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let best = &json["result"]["top"][0];
    let n_cache = best["values"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p[0] == "n_cache")
        .unwrap()[1]["Int"]
        .as_i64()
        .unwrap();
    let host = best["host_bytes"].as_u64().unwrap();
    assert!(n_cache > 0, "{best}");
    assert!(host <= BUDGET && host + EXPERT > BUDGET, "{best}");
    let rc = json["disk_split"]["in_host"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l[0] == "rc")
        .unwrap()[2]
        .as_u64()
        .unwrap();
    assert_eq!(rc, n_cache as u64 * EXPERT);
    // The printed line, as printed (every word plain: no quoting to undo).
    let run = json["run_command"].as_str().unwrap();
    let words: Vec<&str> = run.split(' ').collect();
    assert_eq!(words[..2], ["moec", "run"]);
    let out = moec_here(&words[1..]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{run}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("read from the checkpoint's files"),
        "{stdout}"
    );
    let mut fit = vec!["run"];
    fit.extend(common);
    fit.extend(["--fit", "--json"]);
    let out = moec_here(&fit);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--fit: the planner picked")
            && stderr.contains(&format!("n_cache={n_cache} "))
            && stderr.contains(&format!("host peak {host} B of --host-mem {BUDGET} B")),
        "{stderr}"
    );
    // Held to a host budget, big freed blocks leave the process (said, not silent).
    assert!(
        stderr.contains("allocator: blocks of 1 MiB or more are mapped on their own"),
        "{stderr}"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        report["fitted_params"]["n_cache"],
        serde_json::json!(n_cache.to_string())
    );
    let memory = &report["memory"];
    let used = memory["host_bytes"].as_u64().unwrap() + memory["pinned_bytes"].as_u64().unwrap();
    assert!(used <= BUDGET, "{memory}");
}

/// An `experts` task computing from a format copy is charged the copy's bytes, as the
/// copy that brought it was: `tests/fixtures/formats/substitute.sched` on the tiny
/// Mixtral (hidden 128, FFN 256: one expert is 3 x 128 x 256 = 98,304 weights, 196,608
/// bytes in bf16 and 98,304 / 32 x 34 = 104,448 in q8_0, ggml's 34-byte `block_q8_0`).
/// In the fixture the GPU slot is exactly one q8_0 expert; the variant copies the expert
/// into the first half of a two-expert slot and computes from the whole slot, where the
/// checkpoint's bytes (196,608, less than the slot's 208,896) used to be charged.
#[test]
fn experts_computed_from_a_format_copy_are_charged_the_formats_bytes() {
    use moec::cost::predict::{weight_bytes, weight_copy_format};
    use moec::ir::{Op, StepKind};
    let base = std::fs::read_to_string("tests/fixtures/formats/substitute.sched").unwrap();
    let halves = base
        .replacen(
            "buffer lo[2]:      gpu = W[0].expert(0).format(q8_0)",
            "buffer lo[2]:      gpu = 2 * bytes(W[0].expert(0).format(q8_0))",
            1,
        )
        .replacen("-> lo[e % 2] on h2d", "-> lo[e % 2].page(0, 2) on h2d", 1);
    assert_ne!(halves, base);
    let options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    for (name, source) in [("fixture", &base), ("half a slot", &halves)] {
        let compiled = compile(source, &options).unwrap_or_else(|d| panic!("{name}: {d:?}"));
        let program = &compiled.program;
        let decode = program
            .steps
            .iter()
            .position(|s| s.kind == StepKind::Decode)
            .expect("a decode step");
        let mut experts = 0;
        for id in program.steps[decode].task_ids() {
            let task = program.task(id);
            let from_copy = task.args.first().is_some_and(|a| {
                matches!(
                    program.buffer(a.slice.buffer).kind,
                    moec::ir::BufferKind::FormatCopy { .. }
                )
            });
            if let (Some(copy), true) = (task.work.copy, from_copy) {
                assert_eq!(copy.bytes, 104_448, "{name}: {}", program.task_name(id));
            }
            if let Op::Experts { .. } = task.op {
                experts += 1;
                let q8 = moec::model::Storage::parse("q8_0").expect("a format");
                assert_eq!(weight_copy_format(program, id), Some(q8), "{name}");
                let bytes = weight_bytes(program, id, &CostSettings::default());
                assert_eq!(bytes, 104_448.0, "{name}: {}", program.task_name(id));
            }
        }
        // 4 layers x 8 experts.
        assert_eq!(experts, 32, "{name}");
    }
}

/// The format an `experts` task computes from (`weight_copy_format`, found through the
/// program's index of writers) is the one a plain backward scan finds: the last task
/// before it in its step (else in `setup`, from its end) that writes its weights' bytes,
/// followed through copies to a format copy or the checkpoint. HOBBIT with its q8_0 path
/// on (`lowbit = 1`), on two mid cards: decode steps compute some experts from the cache
/// (brought by a fetch from the pinned home, itself copied in `setup` from the
/// checkpoint) and some from a q8_0 staging slot (copied from `W.q8_0`).
#[test]
fn weight_copy_formats_equal_a_backward_scan_on_the_mid_cards() {
    use moec::cost::predict::weight_copy_format;
    use moec::ir::{BufferKind, Op, Program, Slice, StepKind};
    /// The reference: every task before `before` scanned, no index.
    fn scanned(program: &Program, before: TaskId, slice: &Slice, depth: u32) -> Option<String> {
        match program.buffer(slice.buffer).kind {
            BufferKind::FormatCopy { format } => return Some(format.to_string()),
            BufferKind::Checkpoint => return None,
            BufferKind::Declared => {}
        }
        if depth == 0 {
            return None;
        }
        let writes = |t: TaskId| {
            program.task(t).args.iter().any(|a| {
                a.access.writes()
                    && match slice.cache_key {
                        Some(key) => a.slice.cache_key == Some(key),
                        None => {
                            a.slice.cache_key.is_none()
                                && a.slice.buffer == slice.buffer
                                && a.slice.start < slice.end()
                                && slice.start < a.slice.end()
                        }
                    }
            })
        };
        let own = program.task(before).step.index();
        let setup = program
            .steps
            .iter()
            .enumerate()
            .filter(|&(i, s)| i != own && s.kind == StepKind::Setup)
            .flat_map(|(_, s)| (s.first..s.first + s.count).rev())
            .map(|t| TaskId::new(t as usize));
        let writer = (program.steps[own].first as usize..before.index())
            .rev()
            .map(TaskId::new)
            .chain(setup)
            .find(|&t| writes(t))?;
        let t = program.task(writer);
        if t.op != Op::Copy {
            return None;
        }
        scanned(program, writer, &t.args.first()?.slice, depth - 1)
    }
    let source = std::fs::read_to_string("schedules/hobbit.sched").unwrap();
    // As `moec check --hw t4` compiles it: the cache gets the slots a T4 holds.
    let profile = HardwareProfile::load("t4").unwrap();
    for card in ["mixtral-mid", "qwen3-moe-mid"] {
        let mut options = Options::new(ModelCard::load(card).unwrap());
        options.hardware = profile
            .symbols()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        options.workload = Workload {
            batch: 4,
            prompt_len: 16,
            gen_len: 4,
        };
        options.sets = [("lowbit", "1"), ("bs", "4"), ("thr", "0.3")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let compiled = compile(&source, &options).unwrap_or_else(|d| panic!("{card}: {d:?}"));
        let program = &compiled.program;
        let (mut from_copy, mut from_checkpoint) = (0, 0);
        for (index, task) in program.tasks.iter().enumerate() {
            let id = TaskId::new(index);
            if !matches!(task.op, Op::Experts { .. }) {
                continue;
            }
            let w = task
                .args
                .iter()
                .find(|a| a.role == moec::ir::Role::W)
                .expect("an experts task has weights");
            let want = scanned(program, id, &w.slice, 8);
            let got = weight_copy_format(program, id).map(|f| f.to_string());
            assert_eq!(got, want, "{card}: {}", program.task_name(id));
            match got {
                Some(_) => from_copy += 1,
                None => from_checkpoint += 1,
            }
        }
        // Both paths are exercised.
        assert!(
            from_copy > 0 && from_checkpoint > 0,
            "{card}: {from_copy} / {from_checkpoint}"
        );
    }
}

/// HOBBIT on Qwen3-30B-A3B (header-only card) on the calibrated T4, as `moec plan` rates
/// one point: main's pick (`bs=6 thr=0.0 lowbit=0`, 0.92 gen tok/s) stays ahead of
/// `bs=6 thr=0.5 lowbit=1`, which main predicts at 0.39. The important-expert arm
/// (`score_max >= 0.5`, above 1 / top_k = 1/8) gets activation exactly 0 from the routing
/// model, yet it can run: only a task proven never to run (`routed >= t` above the
/// micro-batch's tokens) is charged nothing, so this arm keeps the GPU cap and the 800 us
/// task overhead main charges it (charged nothing, it made `lowbit = 1` 0.93 and the pick).
#[test]
fn hobbit_on_qwen3_t4_keeps_mains_pick() {
    let gen_tok_s = |thr: &str, lowbit: &str| -> f64 {
        let sets = [
            "bs=6",
            &format!("thr={thr}"),
            &format!("lowbit={lowbit}"),
            "n_cache=-1",
            "home=-1",
        ];
        let mut args = vec![
            "plan",
            "schedules/hobbit.sched",
            "--model",
            "qwen3-30b-a3b",
            "--hw",
            "t4",
        ];
        for s in &sets {
            args.extend(["--set", s]);
        }
        let out = moec(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("rates: calibrated"), "{stdout}");
        // The one ranked line: rank, then gen tok/s (no params: all were fixed).
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("1 "))
            .unwrap_or_else(|| panic!("{stdout}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let main_pick = gen_tok_s("0.0", "0");
    let low_bit = gen_tok_s("0.5", "1");
    assert!((main_pick - 0.92).abs() < 0.006, "{main_pick}");
    assert!((low_bit - 0.39).abs() < 0.006, "{low_bit}");
}

/// A planner point's target with the default settings and the profile's budgets, every
/// slot counted, declared buffers pruned.
fn default_target<'a>(
    file: &'a moec::syntax::ast::File,
    options: &'a Options,
    profile: &'a HardwareProfile,
    share: &'a (dyn Fn(&moec::ir::Program, u64) -> f64 + Sync),
    same_program: Option<&'a moec::cost::plan::SamePrograms>,
) -> moec::engine::fit_params::PointTarget<'a> {
    moec::engine::fit_params::PointTarget {
        file,
        options,
        profile,
        settings: CostSettings::default(),
        overrides: moec::cost::budget::BudgetOverrides::default(),
        machine_bytes: None,
        gpu_in_host: false,
        slot_share: share,
        prune_declared: true,
        same_program,
    }
}

/// Options for `card` at 8 sequences of 32 + 8 tokens, the profile's symbols and `sets`.
fn options_with_profile(profile: &HardwareProfile, card: &str, sets: &[(&str, &str)]) -> Options {
    let mut options = Options::new(ModelCard::load(card).unwrap());
    options.workload = Workload {
        batch: 8,
        prompt_len: 32,
        gen_len: 8,
    };
    options.hardware = profile
        .symbols()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    options.sets = sets
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    options
}

/// A planner test's point of departure: `schedule` parsed, its options for `card` at
/// `workload` on `profile` with `sets` fixed, and the param spaces the search walks.
fn plan_setup(
    profile: &HardwareProfile,
    schedule: &str,
    card: &str,
    workload: Workload,
    sets: &[(&str, &str)],
) -> (
    moec::syntax::ast::File,
    Options,
    Vec<moec::cost::plan::ParamSpace>,
) {
    let source = std::fs::read_to_string(format!("schedules/{schedule}.sched")).unwrap();
    let file = moec::compile::source_to_ast(&source).unwrap();
    let mut options = options_with_profile(profile, card, sets);
    options.workload = workload;
    let fixed: Vec<String> = sets.iter().map(|(k, _)| k.to_string()).collect();
    let (defaults, _) = moec::compile::ast_to_ir(&file, &options).unwrap();
    let spaces = moec::cost::plan::param_spaces(&defaults.params, &fixed);
    (file, options, spaces)
}

/// A point the planner's lean evaluation accepts must not be one the full compile refuses:
/// hobbit with a fill rule that forgets what a decode step holds (a mutation: its cache
/// keeps 4 slots whatever the batch, as session 24's scratch-aware fill gave past
/// `bs=131` on qwen3-30b-a3b `t4`) has more fetched experts held at once than slots from
/// `bs=3` on mixtral-tiny (8 experts, top 2), which the full check refuses
/// (`cache::deadlock`) while its budget fits. The lean evaluation refuses those points
/// too, so the search's best points all pass the full compile (before, the largest
/// batches ranked first and were all dropped after the search).
#[test]
fn the_plan_search_skips_points_whose_expert_cache_the_full_check_refuses() {
    use moec::cost::budget::{budget_table, BudgetOverrides};
    use moec::cost::plan::{param_spaces, search, search_bounded, Outcome, SearchOptions};
    use moec::engine::fit_params::{evaluate_point, evaluate_point_bounded};
    let fill = "max(fit, min(experts, bs * top_k) + top_k)";
    let source = std::fs::read_to_string("schedules/hobbit.sched").unwrap();
    assert_eq!(source.matches(fill).count(), 1, "hobbit's fill rule moved");
    let mutated = source.replacen(fill, "4", 1);
    let file = moec::compile::source_to_ast(&mutated).unwrap();
    let profile = HardwareProfile::load("t4").unwrap();
    let fixed = [
        ("thr", "0.4"),
        ("lowbit", "0"),
        ("n_cache", "-1"),
        ("home", "-1"),
    ];
    let options = options_with_profile(&profile, "mixtral-tiny", &fixed);
    let with = |bs: i64| {
        let mut o = options.clone();
        o.sets.push(("bs".to_string(), bs.to_string()));
        o
    };
    // bs = 8: the lean path's budget fits, the full compile refuses the cache, and the
    // point's evaluation now says so.
    let (lean, _) = moec::compile::ast_to_ir(&file, &with(8)).unwrap();
    assert!(
        budget_table(&lean, Some(&profile), &BudgetOverrides::default()).fits(),
        "the mutation must fit the budget, or the budget refuses it already"
    );
    let refused = compile(&mutated, &with(8)).expect_err("the full compile refuses bs=8");
    assert!(
        refused
            .iter()
            .any(|d| d.code == moec::diag::Code::CacheDeadlock),
        "{refused:?}"
    );
    let share = |_: &moec::ir::Program, _: u64| 1.0;
    let target = default_target(&file, &options, &profile, &share, None);
    let point = |bs: i64| vec![("bs".to_string(), moec::ir::Scalar::Int(bs))];
    match evaluate_point(&target, &point(8)) {
        Outcome::Refused { reason, .. } => {
            assert!(reason.starts_with("cache::deadlock: "), "{reason}")
        }
        other => panic!("bs=8 evaluated as {other:?}"),
    }
    assert!(matches!(
        evaluate_point(&target, &point(2)),
        Outcome::Fits(_)
    ));
    // The search over `bs`: every best point compiles in full, and the refused ones are
    // counted as invalid with the check's reason. The planner's bounded search (which asks
    // the check only of points that could rank) answers and counts as the plain one.
    let spaces = param_spaces(&lean.params, &fixed.map(|(k, _)| k.to_string()));
    assert_eq!(spaces.len(), 1, "only bs is searched");
    let search_options = SearchOptions {
        max_grid: 12,
        refine_from: 1,
        top: 3,
        ..SearchOptions::default()
    };
    let result = search(&spaces, &search_options, |values| {
        evaluate_point(&target, values)
    });
    let bounded = search_bounded(&spaces, &search_options, |values, below| {
        evaluate_point_bounded(&target, values, below)
    });
    assert_eq!(bounded, result);
    assert!(!result.top.is_empty(), "{result:?}");
    assert!(result.invalid > 0, "{result:?}");
    assert!(
        result
            .invalid_reasons
            .iter()
            .any(|r| r.starts_with("cache::deadlock: ")),
        "{result:?}"
    );
    for candidate in &result.top {
        let mut o = options.clone();
        o.sets.extend(
            candidate
                .values
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string())),
        );
        assert!(
            compile(&mutated, &o).is_ok(),
            "{:?} passed the lean evaluation but not the full compile",
            candidate.values
        );
    }
}
