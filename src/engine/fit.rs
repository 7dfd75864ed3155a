//! What a run refuses before it allocates anything, and how a run-time error with a
//! source span is shown.
//!
//! Takes the lowered plan, its program, the replay profile and the run's budgets; gives
//! `Ok` or a [`RunFailure`] with `check`'s budget table.

use super::RunFailure;
use crate::cost::hardware::HardwareProfile;
use crate::lower::ExecPlan;
use crate::runtime::registration::GpuSpace;

/// What [`refuse_what_does_not_fit`] needs to know of the run besides the plan.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    /// Sequences the run holds logits rows for.
    pub sequences: usize,
    /// `--gpu-mem`, in bytes.
    pub gpu_mem: Option<u64>,
    /// `--host-mem`, in bytes.
    pub host_mem: Option<u64>,
    /// The profile was named with `--hw` (not measured on this machine).
    pub chosen_profile: bool,
    /// Where the backend keeps the `gpu` space.
    pub gpu_space: GpuSpace,
}

/// Refuses, before any arena is allocated, a plan that does not fit: first the budgets the
/// run report prints (the hardware profile's, `--gpu-mem` for the `gpu` space), with the
/// table `check` prints; then the memory the machine has available, since a profile may
/// describe a larger machine than this one (issue 18: a schedule with `ctx x 10000` ran a
/// 2-token job at 10 GB RSS, and larger ones were stopped by the OS). A backend with the
/// `gpu` space on a device leaves it out of the machine's memory, and without `--hw` or
/// `--gpu-mem` (the measured profile knows no device) out of the budgets too.
pub(super) fn refuse_what_does_not_fit(
    plan: &ExecPlan,
    program: &crate::ir::Program,
    profile: Option<&HardwareProfile>,
    budget: Budget,
) -> Result<(), RunFailure> {
    use crate::cost::budget::{budget_table, check_budget, BudgetOverrides};
    let on_device = budget.gpu_space == GpuSpace::Device;
    let device_unknown = on_device && !budget.chosen_profile && budget.gpu_mem.is_none();
    let overrides = BudgetOverrides {
        gpu_bytes: match budget.gpu_mem {
            Some(bytes) => Some(bytes as f64),
            None if device_unknown => Some(f64::INFINITY),
            None => None,
        },
        host_bytes: budget.host_mem.map(|bytes| bytes as f64),
    };
    if let Err(e) = check_budget(program, profile, &overrides) {
        return Err(RunFailure::Rendered(format!(
            "error: this plan does not fit the run's memory budgets: {}; nothing was allocated \
             (pass --hw PROFILE, --gpu-mem or --host-mem for other budgets)\nmemory (peak per space over the run)\n{}",
            e.summary, e.table
        )));
    }
    let Some(available) = crate::sysmem::available_bytes() else {
        return Ok(());
    };
    let arenas: u64 = plan
        .arenas
        .iter()
        .filter(|a| !(on_device && a.space == crate::ir::Space::Gpu))
        .map(|a| a.bytes)
        .fold(0, u64::saturating_add);
    let logits = (budget.sequences as u64)
        .saturating_mul(program.model.vocab)
        .saturating_mul(4);
    let needed = arenas.saturating_add(logits);
    if needed <= available {
        return Ok(());
    }
    let table = budget_table(program, profile, &overrides);
    Err(RunFailure::Rendered(format!(
        "error: this plan needs {needed} bytes of memory ({arenas} in arenas, {logits} for logits) but the machine has {available} available (MemAvailable, /proc/meminfo); nothing was allocated\nmemory (peak per space over the run)\n{table}"
    )))
}

/// A run-time error at a task, rendered with the task's source span.
pub(super) fn render_span_error(
    message: &str,
    span: crate::syntax::ast::Span,
    name: &str,
    source: &str,
) -> String {
    let report = miette::miette!(
        labels = vec![miette::LabeledSpan::at(
            span.start as usize..span.end as usize,
            "this task"
        )],
        "{message}"
    )
    .with_source_code(miette::NamedSource::new(name, source.to_string()));
    let handler =
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor());
    let mut out = String::new();
    if handler.render_report(&mut out, report.as_ref()).is_err() {
        out = format!("error: {message}\n");
    }
    out
}
