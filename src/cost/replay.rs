//! Predicts the steps a run really executed, each at what its micro-batches held.
//!
//! Takes a [`Program`], its dependencies, a [`HardwareProfile`] and either one step's
//! per-micro-batch loads ([`UbLoad`], as the runtime records them) or a whole run's
//! [`RunStats`]; gives the HRM-simulated seconds of those steps, the mean decode (or
//! mixed) step, the run's seconds and tokens/s. Guarantees: every per-micro-batch compute
//! task is re-costed through the same path as the declared prediction
//! ([`crate::cost::predict::Loads::Measured`]), copies keep their declared bytes (the runtime copies
//! whole declared slices), and each distinct load vector is simulated once.

use super::hardware::HardwareProfile;
use super::predict::{
    buffer_classes, task_kind, CostSettings, Loads, PredictError, StepPrediction,
};
use super::step::{simulate_step, simulate_step_ran, ProgramTables};
use crate::ir::StepKind;
use crate::ir::{Program, TaskId};
use crate::records::{RunStats, UbLoad};
use serde::Serialize;
use std::collections::hash_map::Entry;
use std::collections::HashMap;

/// Measured and predicted seconds of the executed steps of one kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindReplay {
    /// `setup`, `prefill`, `decode` or `step`.
    pub kind: String,
    /// Steps of this kind the run executed.
    pub steps: usize,
    /// Their measured wall seconds, summed.
    pub measured_seconds: f64,
    /// Their predicted seconds, summed.
    pub predicted_seconds: f64,
    /// Per op kind over these steps' executed tasks, largest measured time first: where a
    /// step kind's measured and predicted times part ways (a batch-1 decode step's
    /// `lm_head` is hidden in the run-wide [`RunPrediction::ops`] by prefill's).
    pub ops: Vec<OpReplay>,
}

/// The mean of the run's decode steps, measured and predicted over the same steps.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MeanStep {
    /// Which steps: `decode` (decode or mixed steps with no prompt tokens, the steps the
    /// runtime's report calls decode steps) or `mixed` (every mixed step, when no step of
    /// the run was decode-only).
    pub which: String,
    /// How many.
    pub steps: usize,
    /// Mean measured wall seconds.
    pub measured_seconds: f64,
    /// Mean predicted seconds.
    pub predicted_seconds: f64,
}

/// Busy seconds of one op kind (the timeline's colour key: op name, copies by what they
/// carry) over the executed steps: measured task durations against the HRM times of the
/// same tasks at the same loads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpReplay {
    /// `attn`, `post_attn`, `copy weights host->pinned`, ...
    pub op: String,
    /// Task runs counted (guard-skipped ones excluded).
    pub runs: usize,
    /// Measured seconds, summed.
    pub measured_seconds: f64,
    /// Predicted seconds, summed.
    pub predicted_seconds: f64,
}

/// A whole run predicted step by step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunPrediction {
    /// Profile name.
    pub hardware: String,
    /// Per step kind, in the order the run first executed them.
    pub kinds: Vec<KindReplay>,
    /// The mean decode step, if the run had decode or mixed steps.
    pub decode_step: Option<MeanStep>,
    /// Measured wall seconds of the whole run (setup, every step, and the driver's work
    /// between steps).
    pub measured_seconds: f64,
    /// Predicted seconds of the whole run: the sum of its predicted steps.
    pub predicted_seconds: f64,
    /// Tokens the run generated.
    pub generated_tokens: usize,
    /// Generated tokens / measured seconds.
    pub measured_tokens_per_s: f64,
    /// Generated tokens / predicted seconds.
    pub predicted_tokens_per_s: f64,
    /// Per op kind over every executed task, largest measured time first.
    pub ops: Vec<OpReplay>,
    /// Distinct (step, load) pairs simulated.
    pub simulations: usize,
}

/// A step template, its micro-batches' loads as plain numbers (`UbLoad` is not `Hash`)
/// and which of its tasks ran (guards skip some).
type LoadKey = (usize, Vec<([usize; 4], Vec<u32>)>, Vec<bool>);

/// Index in `program.steps` of the step template the runtime runs for `kind` (the first
/// one of that kind, as the driver picks it).
fn step_index(program: &Program, kind: StepKind) -> Option<usize> {
    program.steps.iter().position(|s| s.kind == kind)
}

/// Predicts one step of the program with its micro-batches holding `loads` (indexed by
/// `ub`; a micro-batch past the end keeps its declared work), with the full description
/// `moec simulate` gives (busy shares, bounds, timeline).
pub fn predict_step_at(
    program: &Program,
    deps: &[Vec<TaskId>],
    step_index: usize,
    profile: &HardwareProfile,
    settings: &CostSettings,
    loads: &[UbLoad],
) -> Result<StepPrediction, PredictError> {
    check_deps(program, deps)?;
    let tables = ProgramTables::with_classes(buffer_classes(program));
    simulate_step(
        program,
        deps,
        step_index,
        profile,
        settings,
        &tables,
        Loads::Measured(loads),
    )
}

fn check_deps(program: &Program, deps: &[Vec<TaskId>]) -> Result<(), PredictError> {
    if deps.len() != program.tasks.len() {
        return Err(PredictError::DepsMismatch {
            got: deps.len(),
            tasks: program.tasks.len(),
        });
    }
    Ok(())
}

/// Predicts every step `stats` recorded at its own loads (a `setup` step, which has no
/// micro-batches, at its declared work) and sums them into the run's figures.
/// `generated_tokens` is what the run produced (the numerator of both tokens/s).
pub fn predict_run(
    program: &Program,
    deps: &[Vec<TaskId>],
    profile: &HardwareProfile,
    settings: &CostSettings,
    stats: &RunStats,
    generated_tokens: usize,
) -> Result<RunPrediction, PredictError> {
    check_deps(program, deps)?;
    // Decode contexts grow every step, so loads rarely repeat exactly in a long run, but
    // static batches repeat whole prefill/decode sequences across batches.
    let mut cache: HashMap<LoadKey, (f64, Vec<f64>)> = HashMap::new();
    // Computed once for every executed step (each a pass over the whole program).
    let tables = ProgramTables::with_classes(buffer_classes(program));
    let classes = tables.classes(program);
    let op_of: Vec<String> = (0..program.tasks.len())
        .map(|t| task_kind(program, TaskId::new(t), classes))
        .collect();
    let mut ops: Vec<OpReplay> = Vec::new();
    let mut kinds: Vec<KindReplay> = Vec::new();
    let (mut decode, mut mixed) = (Vec::new(), Vec::new());
    let mut predicted_seconds = 0.0;
    for record in &stats.steps {
        let Some(index) = step_index(program, record.kind) else {
            continue;
        };
        let key: Vec<([usize; 4], Vec<u32>)> = record
            .ubs
            .iter()
            .map(|u| {
                (
                    [
                        u.prefill_seqs,
                        u.prefill_tokens,
                        u.decode_seqs,
                        u.decode_context,
                    ],
                    u.active_experts.clone(),
                )
            })
            .collect();
        let loads = if record.kind == StepKind::Setup {
            Loads::Declared
        } else {
            Loads::Measured(&record.ubs)
        };
        // A task the run's guards skipped costs nothing, and neither does a fetch that
        // found its expert in the cache: it copied nothing (tasks the record does not hold
        // count as run).
        let first = program.steps[index].first as usize;
        let mut ran = vec![true; program.steps[index].count as usize];
        for task in &record.tasks {
            if let Some(slot) = ran.get_mut(task.task.index().wrapping_sub(first)) {
                *slot = task.ran && !task.hit;
            }
        }
        let (predicted, times) = match cache.entry((index, key, ran.clone())) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let sim = simulate_step_ran(
                    program,
                    deps,
                    index,
                    profile,
                    settings,
                    loads,
                    Some(&ran),
                    &tables,
                )?;
                let times = sim.times.iter().map(|t| t.seconds).collect();
                e.insert((sim.result.makespan, times))
            }
        };
        let predicted = *predicted;
        let measured = (record.end - record.start).max(0.0);
        predicted_seconds += predicted;
        let name = record.kind.as_str();
        let at = match kinds.iter().position(|k| k.kind == name) {
            Some(at) => at,
            None => {
                kinds.push(KindReplay {
                    kind: name.to_string(),
                    steps: 0,
                    measured_seconds: 0.0,
                    predicted_seconds: 0.0,
                    ops: Vec::new(),
                });
                kinds.len() - 1
            }
        };
        let kind = &mut kinds[at];
        kind.steps += 1;
        kind.measured_seconds += measured;
        kind.predicted_seconds += predicted;
        for task in record.tasks.iter().filter(|t| t.ran) {
            let id = task.task.index();
            let (Some(op), Some(&time)) = (op_of.get(id), times.get(id.wrapping_sub(first))) else {
                continue;
            };
            let measured = (task.end - task.start).max(0.0);
            if task.hit {
                // Simulated as not run: its own line, so the fetches' line compares copies.
                let op = format!("{op} (hit)");
                add_op(&mut ops, &op, measured, 0.0);
                add_op(&mut kind.ops, &op, measured, 0.0);
            } else {
                add_op(&mut ops, op, measured, time);
                add_op(&mut kind.ops, op, measured, time);
            }
        }
        let decode_like = matches!(record.kind, StepKind::Decode | StepKind::Mixed);
        if decode_like && record.decode_tokens > 0 && record.prefill_tokens == 0 {
            decode.push((measured, predicted));
        }
        if record.kind == StepKind::Mixed {
            mixed.push((measured, predicted));
        }
    }
    let mean = |which: &str, pairs: &[(f64, f64)]| {
        (!pairs.is_empty()).then(|| MeanStep {
            which: which.to_string(),
            steps: pairs.len(),
            measured_seconds: pairs.iter().map(|p| p.0).sum::<f64>() / pairs.len() as f64,
            predicted_seconds: pairs.iter().map(|p| p.1).sum::<f64>() / pairs.len() as f64,
        })
    };
    let rate = |seconds: f64| {
        if seconds > 0.0 {
            generated_tokens as f64 / seconds
        } else {
            0.0
        }
    };
    ops.sort_by(|a, b| b.measured_seconds.total_cmp(&a.measured_seconds));
    for kind in &mut kinds {
        kind.ops
            .sort_by(|a, b| b.measured_seconds.total_cmp(&a.measured_seconds));
    }
    Ok(RunPrediction {
        hardware: profile.name.clone(),
        kinds,
        decode_step: mean("decode", &decode).or_else(|| mean("mixed", &mixed)),
        measured_seconds: stats.wall,
        predicted_seconds,
        generated_tokens,
        measured_tokens_per_s: rate(stats.wall),
        predicted_tokens_per_s: rate(predicted_seconds),
        ops,
        simulations: cache.len(),
    })
}

/// Counts one executed task of op kind `op` into `ops`.
fn add_op(ops: &mut Vec<OpReplay>, op: &str, measured: f64, predicted: f64) {
    match ops.iter_mut().find(|o| o.op == op) {
        Some(o) => {
            o.runs += 1;
            o.measured_seconds += measured;
            o.predicted_seconds += predicted;
        }
        None => ops.push(OpReplay {
            op: op.to_string(),
            runs: 1,
            measured_seconds: measured,
            predicted_seconds: predicted,
        }),
    }
}
