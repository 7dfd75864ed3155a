//! Checks: a program in, a [`ScheduleInfo`] out (or every error found).
//!
//! Takes an elaborated [`Program`]; runs, in order, the structural checks
//! ([`structure`], [`overlap`]), dependency analysis ([`crate::ir::deps`]), value tracking ([`values`])
//! and the lints ([`lints`]). Errors stop the schedule; warnings travel with the result.
//! As in naga's `ModuleInfo`, a [`ScheduleInfo`] can only be made here, and lowering takes
//! one, so an unchecked program cannot be lowered.

pub mod arms;
pub mod cache;
mod cells;
mod epochs;
pub mod lints;
mod live;
pub mod overlap;
pub mod routing;
pub mod structure;
pub mod values;

use crate::diag::Diagnostic;
use crate::ir::deps::{self, Dag};
use crate::ir::{Program, Space};
use serde::Serialize;
use std::collections::HashSet;

pub use values::WeightLocation;

/// What checking proved about a program; required by lowering and the cost model.
#[derive(Debug, Clone, Serialize)]
#[allow(clippy::manual_non_exhaustive)]
pub struct ScheduleInfo {
    /// The reduced dependency graph.
    pub dag: Dag,
    /// Per task, where each weight tensor it reads sits inside its arguments.
    pub weight_locations: Vec<Vec<WeightLocation>>,
    /// Per task, for a copy of part of a KV cache (`.context()` / `.appended()`), the
    /// layer and micro-batch whose cache value tracking proved its source holds.
    pub kv_sources: Vec<Option<values::KvSource>>,
    /// Per task, for a copy whose source holds one activation of the running step in
    /// every run (`check::live`): the rows the runtime copies (the step's tokens' or
    /// sequences' rows of that micro-batch), not the whole slice.
    pub live_rows: Vec<Option<crate::ir::LiveRows>>,
    /// Warnings found (errors would have rejected the program).
    pub warnings: Vec<Diagnostic>,
    /// Private, so only `check` can build one (within the crate too, which
    /// `#[non_exhaustive]` would not ensure).
    #[serde(skip)]
    _sealed: (),
}

impl ScheduleInfo {
    /// Tasks per stream, in stream order.
    pub fn tasks_per_stream(&self, program: &Program) -> Vec<usize> {
        let mut counts = vec![0; program.streams.len()];
        for task in &program.tasks {
            counts[task.stream.index()] += 1;
        }
        counts
    }

    /// Declared buffers per space: (space, count, bytes).
    /// Expert computations that read an expert in another format than the checkpoint's (a
    /// declared lossy substitute, `Tensor::ExpertIn`), and every expert computation that
    /// reads a routed expert: (substituted, all), counted per weight location.
    pub fn substituted_experts(&self) -> (usize, usize) {
        use crate::ir::value::Tensor;
        let locations = self.weight_locations.iter().flatten();
        locations.fold((0, 0), |(sub, all), l| match l.tensor {
            Tensor::ExpertIn { .. } => (sub + 1, all + 1),
            Tensor::Expert { .. } => (sub, all + 1),
            _ => (sub, all),
        })
    }

    pub fn buffers_per_space(&self, program: &Program) -> Vec<(Space, usize, u64)> {
        Space::ALL
            .into_iter()
            .map(|space| {
                let declared = program
                    .buffers
                    .iter()
                    .filter(|b| b.kind == crate::ir::BufferKind::Declared && b.space == space);
                let (count, bytes) =
                    declared.fold((0, 0u64), |(c, s), b| (c + 1, s.saturating_add(b.bytes)));
                (space, count, bytes)
            })
            .collect()
    }
}

/// Checks a program. `Err` holds every diagnostic (errors and warnings) if any is an error.
pub fn check(program: &Program) -> Result<ScheduleInfo, Vec<Diagnostic>> {
    let mut diags = Vec::new();
    structure::check(program, &mut diags);
    overlap::check(program, &mut diags);
    if diags.iter().any(Diagnostic::is_error) {
        // Value tracking over ill-formed tasks would only repeat the same problems.
        return Err(dedupe(diags));
    }
    let dag = deps::build(program);
    let (value_diags, tracked) = values::check(program);
    diags.extend(value_diags);
    routing::check(program, &dag, &mut diags);
    cache::check(program, &dag, &mut diags);
    lints::check(program, &dag, &mut diags);
    let diags = dedupe(diags);
    if diags.iter().any(Diagnostic::is_error) {
        return Err(diags);
    }
    Ok(ScheduleInfo {
        dag,
        weight_locations: tracked.weight_locations,
        kv_sources: tracked.kv_sources,
        live_rows: tracked.live_rows,
        warnings: diags,
        _sealed: (),
    })
}

/// Keeps the first diagnostic per (code, primary span): loops repeat the same finding.
pub fn dedupe(diags: Vec<Diagnostic>) -> Vec<Diagnostic> {
    let mut seen = HashSet::new();
    diags
        .into_iter()
        .filter(|d| {
            let span = d.primary_span().unwrap_or_default();
            seen.insert((d.code, span.start, span.end))
        })
        .collect()
}
