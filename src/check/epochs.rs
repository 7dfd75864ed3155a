//! The order in which value tracking runs the step templates, as the runtime can run them.
//!
//! Takes a program; gives the plan of step runs: every `setup` once, then `prefill` and
//! `decode` as batches follow one another (a batch that generates one token goes from
//! prefill straight to the next prefill; a longer one decodes, decodes again, then the
//! next batch's prefill starts from what its last decode left), and a mixed `step` three
//! times. Each run is an epoch: values written in it belong to it, so a value a run
//! reads can be told apart from the same tensor left by an earlier run. Guarantees: every
//! transition the runtime can take between step kinds (prefill -> prefill, prefill ->
//! decode, decode -> decode, decode -> prefill, step -> step) occurs at least once.

use crate::ir::Program;
use crate::ir::StepKind;

/// One run of a step template.
pub(super) struct StepRun {
    /// Index into `Program::steps`.
    pub(super) step: usize,
    /// Its kind.
    pub(super) kind: StepKind,
    /// How diagnostics name it: `prefill run 1`, `decode run 2`.
    pub(super) name: String,
    /// Appended to the messages of diagnostics found in it: empty on a step's first run.
    pub(super) note: &'static str,
}

/// The runs, in order; a run's index is its epoch.
pub(super) fn plan(program: &Program) -> Vec<StepRun> {
    let of_kind = |kind: StepKind| -> Vec<usize> {
        (0..program.steps.len())
            .filter(|&i| program.steps[i].kind == kind)
            .collect()
    };
    let mut order: Vec<StepKind> = Vec::new();
    let has = |kind| !of_kind(kind).is_empty();
    order.extend(std::iter::repeat_n(
        StepKind::Setup,
        of_kind(StepKind::Setup).len().min(1),
    ));
    match (has(StepKind::Prefill), has(StepKind::Decode)) {
        (true, true) => order.extend([
            StepKind::Prefill,
            StepKind::Prefill,
            StepKind::Decode,
            StepKind::Decode,
            StepKind::Prefill,
            StepKind::Decode,
        ]),
        (true, false) => order.extend([StepKind::Prefill, StepKind::Prefill]),
        (false, true) => order.extend([StepKind::Decode, StepKind::Decode]),
        (false, false) => {}
    }
    if has(StepKind::Mixed) {
        order.extend([StepKind::Mixed; 3]);
    }
    let mut runs = Vec::new();
    let mut seen: Vec<(StepKind, u32)> = Vec::new();
    for kind in order {
        let count = match seen.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                seen.push((kind, 1));
                1
            }
        };
        for step in of_kind(kind) {
            runs.push(StepRun {
                step,
                kind,
                name: if kind == StepKind::Setup {
                    "setup".to_string()
                } else {
                    format!("{} run {count}", kind.as_str())
                },
                note: if count == 1 {
                    ""
                } else {
                    " (on the step's next run)"
                },
            });
        }
    }
    runs
}
