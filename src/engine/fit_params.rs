//! Runs that fit: when a schedule's params do not fit the run's memory budgets (or the
//! caller asks, `--fit`), the planner searches them for the run's own workload and
//! budgets before anything is lowered, and the run uses the best candidate that fits.
//!
//! Takes the schedule, the compile options of the run (card, workload from the prompts,
//! the user's `--set`, which stay fixed), the replay profile and `--gpu-mem`; gives the
//! compiled program to run and, when the planner chose, the values it chose and a note
//! saying why and what. The search is `moec plan`'s (`cost::plan::{param_spaces,
//! search}`: elaborate and cost each point, then the full check on the winners), so a run
//! and `moec plan` pick the same params for the same workload and budget.

use super::RunFailure;
use crate::compile::{self, Compiled, Options};
use crate::cost::budget::{budget_table, declared_over_budget, BudgetOverrides};
use crate::cost::hardware::HardwareProfile;
use crate::cost::plan::{param_spaces, search_bounded, Candidate, Outcome, SearchOptions};
use crate::cost::predict::{CostSettings, PointCosts, Throughput};
use crate::ir::{deps, Program, Scalar, TaskId};
use crate::runtime::registration::GpuSpace;
use crate::syntax::ast::File;

/// What one point of a search is compiled and scored against: the schedule's syntax tree,
/// the compile options the searched values are added to (as `--set`s after the user's),
/// the profile and settings the prediction uses, the budgets.
pub struct PointTarget<'a> {
    /// The parsed schedule.
    pub file: &'a File,
    /// Card, workload, the user's `--set`s, hardware symbols.
    pub options: &'a Options,
    /// The profile the prediction divides by and whose budgets apply.
    pub profile: &'a HardwareProfile,
    /// The prediction's knobs.
    pub settings: CostSettings,
    /// Budgets that replace the profile's.
    pub overrides: BudgetOverrides,
    /// At most this many bytes of this machine's memory (`None`: no limit): a run's host
    /// arenas, plus the `gpu` space's when `gpu_in_host`.
    pub machine_bytes: Option<u64>,
    /// The `gpu` space lives in host memory (the CPU backend).
    pub gpu_in_host: bool,
    /// The share of a candidate's throughput the workload keeps, given the program and its
    /// sequence slots (1 when every slot carries tokens).
    pub slot_share: &'a (dyn Fn(&Program, u64) -> f64 + Sync),
    /// Call a point over budget when its declared buffers alone are, before unrolling its
    /// steps (exact: the same outcome, sooner; `false` elaborates every point in full).
    pub prune_declared: bool,
    /// Where each elaborated point's read params are recorded, for the caller to answer
    /// points with the same program without elaborating them (`moec plan`); `None`: none.
    pub same_program: Option<&'a crate::cost::plan::SamePrograms>,
}

/// Evaluates one point of the search (`values`: the searched params): elaborates the
/// schedule, checks its budgets (and the machine's memory when asked), then predicts its
/// throughput with [`crate::cost::predict::predict_throughput`], which gives `predict`'s figures. Of the
/// full check, only the expert caches' part runs here ([`Outcome::Refused`]: it depends on
/// the params the search moves); value tracking and lints do not (they do not change the
/// prediction, and the transitive reduction is the slow part of checking a large program):
/// the callers run the full check on the winners. An over-budget point is known before its
/// dependencies are built.
pub fn evaluate_point(target: &PointTarget<'_>, values: &[(String, Scalar)]) -> Outcome {
    evaluate_point_bounded(target, values, f64::NEG_INFINITY)
}

/// [`evaluate_point`] for [`crate::cost::plan::search_bounded`]: a point that fits and
/// whose throughput is bounded strictly under `below` tokens/s by its costed tasks alone
/// ([`PointCosts::throughput_bound`]: each step at least its busiest resource's summed
/// task times) is [`Outcome::Below`], without its dependencies or simulation; one whose
/// predicted throughput is under `below` is `Below` that figure, without the cache check
/// (it could not rank). Otherwise the same outcome as [`evaluate_point`].
pub fn evaluate_point_bounded(
    target: &PointTarget<'_>,
    values: &[(String, Scalar)],
    below: f64,
) -> Outcome {
    let mut options = target.options.clone();
    // The point is scored and dropped: no label text or argument spans (the winners are
    // compiled again in full).
    options.task_names = false;
    options.sets.extend(
        values
            .iter()
            .map(|(name, value)| (name.clone(), value.to_string())),
    );
    // Declared buffers alone over a budget: over budget whatever the steps unroll to,
    // known without unrolling them (`declared_over_budget` says why this is exact).
    if target.prune_declared {
        let declared = crate::elaborate::declared_buffers(target.file, &options);
        if declared.is_some_and(|buffers| {
            declared_over_budget(
                &buffers,
                Some(target.profile),
                &target.overrides,
                target.machine_bytes,
                target.gpu_in_host,
            )
        }) {
            return Outcome::OverBudget;
        }
    }
    let program = match compile::ast_to_ir(target.file, &options) {
        Ok((program, _)) => program,
        Err(diagnostics) => {
            let first = diagnostics
                .iter()
                .find(|d| d.is_error())
                .or(diagnostics.first());
            let message = first.map_or_else(String::new, |d| d.message.clone());
            return match first.map(|d| d.code) {
                Some(crate::diag::Code::ElabLimit) => Outcome::TooLarge(message),
                _ => Outcome::Invalid(message),
            };
        }
    };
    // Its tables go back to this thread's next point when it is dropped.
    let program = crate::elaborate::Recycled::new(program);
    if let Some(same) = target.same_program {
        same.elaborated(values, &program);
    }
    let table = budget_table(&program, Some(target.profile), &target.overrides);
    if !table.fits() {
        return Outcome::OverBudget;
    }
    // The run happens on this machine whatever the profile says it has: a candidate whose
    // host arenas exceed the memory available here would be refused (or killed) after the
    // search chose it.
    let here = table.peak("host")
        + if target.gpu_in_host {
            table.peak("gpu")
        } else {
            0
        };
    if target.machine_bytes.is_some_and(|a| here > a) {
        return Outcome::OverBudget;
    }
    let costs = PointCosts::new(
        &program,
        target.profile,
        &target.settings,
        table.peak("pinned"),
    );
    // Its best possible throughput, as the candidate's would be scored: strictly under
    // `below`, it cannot matter to the search (which passes `below` only where it holds).
    if below > f64::NEG_INFINITY {
        let bound = costs.throughput_bound();
        if let Some(Throughput {
            tokens_per_s: Some(total),
            decode_tokens_per_s: Some(_),
            sequences,
            ..
        }) = bound
        {
            let bound = total * (target.slot_share)(&program, sequences);
            if bound < below {
                return Outcome::Below(bound);
            }
        }
    }
    let deps: Vec<Vec<TaskId>> = deps::candidate_preds(&program);
    let predicted = costs.throughput(&deps);
    match predicted {
        Ok(p) => match (p.tokens_per_s, p.decode_tokens_per_s) {
            (Some(total), Some(decode)) => {
                let used = (target.slot_share)(&program, p.sequences);
                let tokens_per_s = total * used;
                // Under `below` it cannot rank (the search passes `below` only where that
                // holds), so the full check's cache part is not asked of it: only a point
                // that could rank is checked (docs/cost-model.md "The full check's cache
                // part, on the points that could rank").
                if tokens_per_s < below {
                    return Outcome::Below(tokens_per_s);
                }
                if let Some(reason) = cache_refusal(&program, &deps) {
                    return Outcome::Refused {
                        reason,
                        tokens_per_s,
                    };
                }
                Outcome::Fits(Candidate {
                    values: values.to_vec(),
                    tokens_per_s,
                    decode_tokens_per_s: decode * used,
                    gpu_bytes: table.peak("gpu"),
                    pinned_bytes: table.peak("pinned"),
                    host_bytes: table.peak("host"),
                })
            }
            _ => Outcome::Invalid("the schedule has no decode step".into()),
        },
        Err(e) => Outcome::Invalid(e.to_string()),
    }
}

/// Why the full check refuses `program`'s expert caches, if it does (`check::cache`: more
/// fetched experts held at once than a cache has slots, a read of an unfetched slot, a
/// stale residency guard), as its first error's code and message. The point's other checks
/// are left to the winners' full check, but these depend on the params the search moves
/// (a fill rule's slots against the batch a decode step holds): a point they refuse would
/// otherwise rank first and be dropped after the search, taking a winner's place (session
/// 24: hobbit and moe_infinity past `bs=131` on qwen3-30b-a3b `t4` found no plan). Asked
/// of the unreduced predecessors the prediction was built from: the same order as the
/// full check's reduced graph (a reduction removes only implied edges).
fn cache_refusal(program: &Program, deps: &[Vec<TaskId>]) -> Option<String> {
    if program.caches.is_empty() {
        return None;
    }
    let mut diags = Vec::new();
    crate::check::cache::check(program, deps, &mut diags);
    let first = diags.into_iter().find(crate::diag::Diagnostic::is_error)?;
    Some(format!("{}: {}", first.code.as_str(), first.message))
}

/// Points of the coarse grid (`moec plan`'s default): bisection refines the best three.
const MAX_GRID: usize = 120;

/// Candidates kept in case the full check rejects the best ones.
const KEEP: usize = 6;

/// When the planner picks the params.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitMode {
    /// Only when the schedule's params (defaults and `--set`) do not fit; the note says so.
    WhenOver,
    /// Always (`--fit`): the best predicted params that fit, even when the defaults fit.
    Always,
}

/// What the planner chose.
#[derive(Debug, Clone, PartialEq)]
pub struct FittedParams {
    /// `(name, value)` of every searched param, as `--set` would spell them.
    pub values: Vec<(String, String)>,
    /// The planner's predicted tokens/s for them on the replay profile.
    pub predicted_tokens_per_s: f64,
}

/// The run's budgets as `refuse_what_does_not_fit` counts them: `--gpu-mem` for the `gpu`
/// space, unlimited for a device whose memory no profile or flag names; `--host-mem` for
/// the host (arenas, caches and what is read of the checkpoint in place), so the planner
/// sizes host caches to it instead of choosing params the run then refuses.
fn overrides(
    gpu_mem: Option<u64>,
    host_mem: Option<u64>,
    chosen_profile: bool,
    gpu_space: GpuSpace,
) -> BudgetOverrides {
    let device_unknown = gpu_space == GpuSpace::Device && !chosen_profile && gpu_mem.is_none();
    BudgetOverrides {
        gpu_bytes: match gpu_mem {
            Some(bytes) => Some(bytes as f64),
            None if device_unknown => Some(f64::INFINITY),
            None => None,
        },
        host_bytes: host_mem.map(|bytes| bytes as f64),
    }
}

/// The share of a candidate's full-batch throughput the run's `prompts` get: the run
/// takes `ceil(prompts / sequences)` passes of `sequences` slots each, so slots past the
/// workload carry no tokens (without this, 2 prompts would pick the 4096-slot batch that
/// a full workload would want, with its memory).
fn workload_share(prompts: u64, sequences: u64) -> f64 {
    if prompts == 0 || sequences == 0 {
        return 1.0;
    }
    prompts as f64 / (sequences * prompts.div_ceil(sequences)) as f64
}

/// The run's budgets and how to fit them.
#[derive(Debug, Clone, Copy)]
pub struct FitBudget<'a> {
    /// The replay profile (its budgets); without one nothing can be planned.
    pub profile: Option<&'a HardwareProfile>,
    /// `--gpu-mem`, bytes.
    pub gpu_mem: Option<u64>,
    /// `--host-mem`, bytes: the host budget the search fits (as the run refuses against).
    pub host_mem: Option<u64>,
    /// The profile was named (`--hw`), not measured here.
    pub chosen_profile: bool,
    /// Where the backend keeps the `gpu` space.
    pub gpu_space: GpuSpace,
    /// When to plan.
    pub mode: FitMode,
}

/// Gives the program to run: `compiled` itself when it fits and `--fit` was not asked,
/// otherwise the planner's best fitting params compiled (with a note in `notes` naming
/// them). When no params fit, the run is refused with the defaults' budget table, before
/// anything is allocated.
pub fn fit_params(
    source: &str,
    options: &Options,
    compiled: Compiled,
    budget: FitBudget<'_>,
    notes: &mut Vec<String>,
) -> Result<(Compiled, Option<FittedParams>), RunFailure> {
    let overrides = overrides(
        budget.gpu_mem,
        budget.host_mem,
        budget.chosen_profile,
        budget.gpu_space,
    );
    let defaults = budget_table(&compiled.program, budget.profile, &overrides);
    let why = match (budget.mode, defaults.fits()) {
        (FitMode::WhenOver, true) => return Ok((compiled, None)),
        (FitMode::Always, _) => "--fit".to_string(),
        (FitMode::WhenOver, false) => {
            let over: Vec<String> = defaults
                .spaces
                .iter()
                .filter(|s| s.over() > 0.0)
                .map(|s| {
                    format!(
                        "{} over by {}",
                        s.space,
                        crate::ir::emit::human_bytes(s.over() as u64)
                    )
                })
                .collect();
            format!("the schedule's params do not fit ({})", over.join(", "))
        }
    };
    let Some(profile) = budget.profile else {
        let text = format!(
            "{why}, and without a hardware profile the planner cannot search (pass --hw PROFILE)"
        );
        return match budget.mode {
            FitMode::Always => Err(RunFailure::Message(text)),
            FitMode::WhenOver => {
                notes.push(text);
                Ok((compiled, None))
            }
        };
    };
    let fixed: Vec<String> = options.sets.iter().map(|(name, _)| name.clone()).collect();
    let spaces = param_spaces(&compiled.program.params, &fixed);
    let file = compile::source_to_ast(source).map_err(|_| {
        RunFailure::Message("the schedule stopped parsing between two reads".into())
    })?;
    let prompts = options.workload.batch;
    let with = |values: &[(String, crate::ir::Scalar)]| {
        let mut o = options.clone();
        o.sets
            .extend(values.iter().map(|(n, v)| (n.clone(), v.to_string())));
        o
    };
    let share = move |_: &Program, sequences: u64| workload_share(prompts, sequences);
    let target = PointTarget {
        file: &file,
        options,
        profile,
        settings: CostSettings::default(),
        overrides,
        machine_bytes: crate::sysmem::available_bytes(),
        gpu_in_host: budget.gpu_space == GpuSpace::Host,
        slot_share: &share,
        prune_declared: true,
        same_program: None,
    };
    let searched = search_bounded(
        &spaces,
        &SearchOptions {
            max_grid: MAX_GRID,
            refine_from: 3,
            top: KEEP,
            ..SearchOptions::default()
        },
        |values, below| evaluate_point_bounded(&target, values, below),
    );
    // The full check on the winners, best first: the first that passes runs.
    for candidate in &searched.top {
        let Ok(chosen) = compile::compile(source, &with(&candidate.values)) else {
            continue;
        };
        let values: Vec<(String, String)> = candidate
            .values
            .iter()
            .map(|(n, v)| (n.clone(), v.to_string()))
            .collect();
        let spelled: Vec<String> = values.iter().map(|(n, v)| format!("{n}={v}")).collect();
        // The budgets it fitted, with what the pick uses of each: the choice is never
        // silent about the host budget it sized caches to.
        let host = match budget.host_mem {
            Some(limit) => format!(
                "; host peak {} B of --host-mem {limit} B",
                candidate.host_bytes
            ),
            None => String::new(),
        };
        notes.push(format!(
            "{why}: the planner picked {} for this workload and budget on `{}` ({:.1} tokens/s predicted; {} points searched, {} fit{host})",
            spelled.join(" "),
            profile.name,
            candidate.tokens_per_s,
            searched.evaluated,
            searched.feasible
        ));
        return Ok((
            chosen,
            Some(FittedParams {
                values,
                predicted_tokens_per_s: candidate.tokens_per_s,
            }),
        ));
    }
    // Nothing fits: the refusal names what the search saw and shows the defaults' table
    // (what the user would change by hand).
    Err(RunFailure::Rendered(format!(
        "error: {why}, and the planner found no params that fit ({} points searched: {} over budget, {} invalid); nothing was allocated\nmemory (peak per space over the run, the schedule's own params)\n{defaults}\n",
        searched.evaluated, searched.over_budget, searched.invalid
    )))
}

#[cfg(test)]
mod tests {
    use super::workload_share;

    #[test]
    fn slots_past_the_workload_carry_no_tokens() {
        // 2 prompts in one pass of 64 slots: 2 of the 64 slots generate.
        assert_eq!(workload_share(2, 64), 2.0 / 64.0);
        // 16 prompts in passes of 6: 3 passes, 18 slots, 16 used.
        assert_eq!(workload_share(16, 6), 16.0 / 18.0);
        assert_eq!(workload_share(64, 16), 1.0);
        assert_eq!(workload_share(0, 16), 1.0);
    }
}
