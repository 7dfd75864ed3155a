//! Value tracking: which logical tensor every byte of every buffer holds, from which step
//! run, in issue order.
//!
//! Takes a program; gives diagnostics and, per task, where each weight tensor it reads
//! sits inside its arguments (lowering needs this to find tensors in buffers). Runs the
//! steps in the order of `epochs::plan` (setup; prefill, prefill, decode, decode,
//! prefill, decode; a mixed step three times), so state a step leaves for its own next
//! run or for the next batch (prefetched weights, KV caches) is checked as well. Every
//! value carries the run it belongs to. Invariants checked:
//! - every argument an op reads holds the tensor the catalog says it expects (weights: each
//!   one whole and contiguous somewhere in the argument; activations: from the argument's
//!   start over the bytes the op needs); otherwise say what it holds and who wrote it;
//! - activations (embeddings, hidden states, Q/K/V, attention outputs, routing, expert
//!   sums, logits) and run-time chosen experts (`hot(..)`) are the ones of the current
//!   run; a KV cache is the one the previous run left (or this run already updated); the
//!   tokens `embed` reads are the previous run's samples (else `values::stale`);
//! - nothing is read (by an op or a copy) before anything was written to it;
//! - a `.context()` / `.appended()` copy moves one layer and micro-batch's whole KV cache
//!   value (recorded per task for the runtime, which follows that micro-batch's
//!   sequences): after `.context()` the destination holds the cache as the previous run
//!   left it; `.appended()` needs a source this run updated and, outside prefill, a
//!   destination already holding the same cache as the previous run left it, so no
//!   position is read that nobody wrote;
//! - a value written under a run-time guard is read only under a guard implying it,
//!   decided in the same run;
//! - every expert accumulator carries the expert outputs it holds (task, experts, guard),
//!   moved by copies; a write that replaces outputs of this run's accumulator with a value
//!   of the same accumulator lacking them is `values::lost_output`, naming both tasks;
//! - the outputs reaching each `combine` (through every accumulator it adds) compute each
//!   expert exactly once per layer and ub whenever it receives tokens (a leading dense
//!   layer has no routed expert; its `gate` computes its SwiGLU): literal by literal
//!   for `active` guards (`values::expert_guard`, `values::expert_coverage`), and for
//!   load arms on `routed(..)` over every interval of the counts they read (`arms`);
//! - every prefill, decode or mixed run samples every micro-batch exactly once, by an
//!   unguarded `sample` (`values::sampling`); with the rules above, the logits it reads
//!   come from this run's `lm_head` over this run's hidden state after the last layer.

use super::arms::{self, Output};
use super::cells::{
    combined_guard_epoch, implies, new_cells, runs, runs_when_active, union, write, Cell, Cells,
    Runs,
};
use super::epochs::{self, StepRun};
use crate::diag::Diagnostic;
use crate::ir::catalog::{self, ExpertRef, ExpertSet, Op};
use crate::ir::value::{checkpoint_pieces, Piece, Rows, Tensor};
use crate::ir::StepKind;
use crate::ir::{Access, BufferKind, CheckpointLayout, Guard, GuardAtom, Program, TaskId};
use crate::span::Span;
use serde::Serialize;
use std::rc::Rc;

mod copies;

/// Where a weight tensor a task reads sits: argument `arg`, `offset` bytes into its slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WeightLocation {
    /// The tensor.
    pub tensor: Tensor,
    /// Index into the task's `args`.
    pub arg: u32,
    /// Byte offset inside that argument's slice.
    pub offset: u64,
}

/// A run of bytes [`Tracker::expect_run`] checks.
struct RunCheck<'a> {
    cell: &'a Cell,
    /// Its byte range in the buffer.
    run: (u64, u64),
    /// The tensor expected there.
    tensor: &'a Tensor,
    /// Where byte 0 of the tensor sits in the buffer.
    origin: u64,
    /// The argument's slice (start, len), for describing what the run holds instead.
    slice: (u64, u64),
    /// The expected tensor as the diagnostic names it.
    label: &'a str,
}

struct Tracker<'p> {
    program: &'p Program,
    layout: CheckpointLayout,
    cells: Vec<Option<Cells>>,
    diags: Vec<Diagnostic>,
    locations: Vec<Vec<WeightLocation>>,
    pass_note: &'static str,
    /// The step runs, in order (`epochs::plan`).
    plan: Vec<StepRun>,
    /// The current run (index into `plan`).
    epoch: u32,
    /// Whether the current run is its step's first (a mixed step starts without cache).
    first_run: bool,
    /// Per micro-batch, the `sample` tasks of the current run.
    samples: Vec<Vec<TaskId>>,
    /// Per micro-batch, the last compute task of the current run that worked on it.
    last_of_ub: Vec<Option<TaskId>>,
    /// `values::sampling` findings of the current run, reported only if nothing else was
    /// wrong.
    sampling: Vec<Diagnostic>,
    /// Per task, for a copy of part of a KV cache: whose cache its source holds.
    kv_sources: Vec<Option<KvSource>>,
    /// Per task, for a copy: the activation rows every run found its source holding.
    live: Vec<super::live::Seen>,
}

/// The cache a `.context()` / `.appended()` copy moves: the runtime copies the positions
/// of this micro-batch's sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvSource {
    /// The layer whose cache it is.
    pub layer: u32,
    /// The micro-batch whose sequences' positions are copied.
    pub ub: u32,
}

/// What value tracking gives besides its diagnostics.
pub struct Tracked {
    /// Per task, where each weight tensor it reads sits inside its arguments.
    pub weight_locations: Vec<Vec<WeightLocation>>,
    /// Per task, for a copy of part of a KV cache, whose cache it moves.
    pub kv_sources: Vec<Option<KvSource>>,
    /// Per task, for a copy that may move only the rows of the step's tokens, which.
    pub live_rows: Vec<Option<crate::ir::LiveRows>>,
}

/// Runs value tracking; returns diagnostics and what lowering needs to find tensors.
pub fn check(program: &Program) -> (Vec<Diagnostic>, Tracked) {
    let ubs = program.micro_batches.count as usize;
    let mut tracker = Tracker {
        program,
        layout: program.checkpoint(),
        cells: vec![None; program.buffers.len()],
        diags: Vec::new(),
        locations: vec![Vec::new(); program.tasks.len()],
        pass_note: "",
        plan: epochs::plan(program),
        epoch: 0,
        first_run: true,
        samples: Vec::new(),
        last_of_ub: Vec::new(),
        sampling: Vec::new(),
        kv_sources: vec![None; program.tasks.len()],
        live: vec![super::live::Seen::Unseen; program.tasks.len()],
    };
    for epoch in 0..tracker.plan.len() {
        let run = &tracker.plan[epoch];
        let (step, kind, note) = (run.step, run.kind, run.note);
        tracker.epoch = epoch as u32;
        tracker.pass_note = note;
        tracker.first_run = note.is_empty();
        tracker.samples = vec![Vec::new(); ubs];
        tracker.last_of_ub = vec![None; ubs];
        for id in program.steps[step].task_ids() {
            tracker.task(id);
        }
        if kind != StepKind::Setup {
            tracker.check_sampling();
            // A run whose dataflow is already broken explains a missing token by itself
            // (and diagnostic fixtures are fragments that sample nothing): sampling is
            // reported only while everything else holds, at the run that fails it (a
            // later run would read the tokens it did not sample as stale).
            if !tracker.diags.iter().any(Diagnostic::is_error) {
                tracker.diags.append(&mut tracker.sampling);
            }
            tracker.sampling.clear();
        }
    }
    let tracked = Tracked {
        weight_locations: tracker.locations,
        kv_sources: tracker.kv_sources,
        live_rows: tracker.live.iter().map(|s| s.rows()).collect(),
    };
    (tracker.diags, tracked)
}

impl Tracker<'_> {
    fn cells_of(&mut self, buffer: crate::ir::BufferId) -> &mut Cells {
        let bytes = self.program.buffer(buffer).bytes;
        self.cells[buffer.index()].get_or_insert_with(|| new_cells(bytes))
    }

    /// The runs an argument's slice holds now (checkpoint reads give the weights).
    fn read_runs(&mut self, slice: &crate::ir::Slice) -> Vec<(u64, u64, Cell)> {
        let buffer = self.program.buffer(slice.buffer);
        if buffer.kind.is_weights() {
            let pieces = match buffer.kind {
                BufferKind::FormatCopy { format } => {
                    let slots = match buffer.layout {
                        crate::ir::Layout::Experts { slots } => u64::from(slots.max(1)),
                        _ => 1,
                    };
                    crate::ir::value::format_copy_pieces(
                        &self.layout,
                        format.ggml().id,
                        buffer.bytes / slots,
                        slice.start,
                        slice.len,
                    )
                }
                _ => checkpoint_pieces(&self.layout, slice.start, slice.len, slice.dynamic_expert),
            };
            return pieces
                .into_iter()
                .map(|(off, len, piece)| {
                    let lo = slice.start + off;
                    (
                        lo,
                        lo + len,
                        Cell {
                            end: lo + len,
                            piece: Some(piece),
                            writer: None,
                            guard: Guard::default(),
                            // `hot(..)` names the expert this run's routing ranks there.
                            epoch: is_run_time_expert(&piece.tensor).then_some(self.epoch),
                            guard_epoch: self.epoch,
                            outputs: Rc::default(),
                        },
                    )
                })
                .collect();
        }
        if let Some(expert) = slice.dynamic_expert {
            return self.dynamic_expert_runs(slice, expert);
        }
        if let Some(key) = slice.cache_key {
            // A cache slot holds the expert it is named by once fetched; that a fetch of
            // it precedes the read, under a guard the read implies, is `check::cache`'s.
            let tensor = Tensor::Expert {
                layer: key.layer,
                expert: key.expert,
            };
            let cell = Cell {
                end: slice.end(),
                epoch: is_run_time_expert(&tensor).then_some(self.epoch),
                piece: Some(Piece { tensor, offset: 0 }),
                writer: None,
                guard: Guard::default(),
                guard_epoch: self.epoch,
                outputs: Rc::default(),
            };
            return vec![(slice.start, slice.end(), cell)];
        }
        let (start, end) = (slice.start, slice.end());
        let cells = self.cells_of(slice.buffer);
        runs(cells, start, end)
    }

    /// A run-time-chosen expert of a buffer holding a whole layer: if its experts region
    /// holds every expert of one layer L in order, the slice holds `W[L].expert(hot(..))`;
    /// otherwise what the region holds is reported as is.
    fn dynamic_expert_runs(
        &mut self,
        slice: &crate::ir::Slice,
        expert: ExpertRef,
    ) -> Vec<(u64, u64, Cell)> {
        let experts = self.layout.experts;
        let stride = slice.len;
        let region = runs(
            self.cells_of(slice.buffer),
            slice.start,
            slice.start + stride * experts,
        );
        let mut layer = None;
        let mut guard = Guard::default();
        let now = self.epoch;
        let guard_epoch =
            combined_guard_epoch(region.iter().map(|r| (&r.2.guard, r.2.guard_epoch)), now);
        let whole = (0..experts).all(|e| {
            let lo = slice.start + e * stride;
            region
                .iter()
                .filter(|r| r.0 < lo + stride && lo < r.1)
                .all(|(r_lo, _, cell)| match &cell.piece {
                    Some(Piece {
                        tensor:
                            Tensor::Expert {
                                layer: l,
                                expert: ExpertRef::Index(x),
                            },
                        offset,
                    }) => {
                        guard = union(&guard, &cell.guard);
                        let at = (*r_lo).max(lo);
                        *layer.get_or_insert(*l) == *l
                            && u64::from(*x) == e
                            && offset + (at - r_lo) == at - lo
                    }
                    _ => false,
                })
        });
        match (whole, layer) {
            (true, Some(layer)) => {
                let cell = Cell {
                    end: slice.end(),
                    piece: Some(Piece {
                        tensor: Tensor::Expert { layer, expert },
                        offset: 0,
                    }),
                    writer: region.first().and_then(|r| r.2.writer),
                    guard,
                    epoch: Some(now),
                    guard_epoch,
                    outputs: Rc::default(),
                };
                vec![(slice.start, slice.end(), cell)]
            }
            _ => runs(self.cells_of(slice.buffer), slice.start, slice.end()),
        }
    }

    fn emit(&mut self, mut d: Diagnostic) {
        d.message.push_str(self.pass_note);
        self.diags.push(d);
    }

    fn writer_of(&self, cell: &Cell) -> Option<(String, Span)> {
        cell.writer
            .map(|w| (self.program.task_name(w), self.program.task_span(w)))
    }

    fn describe(
        &self,
        cell: &Cell,
        run_start: u64,
        run_end: u64,
        slice_start: u64,
        slice_len: u64,
    ) -> String {
        let what = match &cell.piece {
            None => "nothing written yet".to_string(),
            Some(p) => p.tensor.to_string(),
        };
        if run_start == slice_start && run_end == slice_start + slice_len {
            what
        } else {
            format!(
                "{what} in bytes {}..{} of it",
                run_start - slice_start,
                run_end - slice_start
            )
        }
    }

    fn task(&mut self, id: TaskId) {
        let program = self.program;
        let task = program.task(id);
        let index = id.index();
        let arg_spans: &[Span] = program
            .spans
            .task_args
            .get(index)
            .map_or(&[], Vec::as_slice);
        let span = program.task_span(id);
        if task.op == Op::Copy {
            return self.copy(id, arg_spans, span);
        }
        if let Some(ub) = task.op.ub() {
            if let Some(last) = self.last_of_ub.get_mut(ub as usize) {
                *last = Some(id);
            }
        }
        if let Op::Sample { ub } = task.op {
            if !task.guard.is_always() {
                let d = Diagnostic::sample_guarded(
                    span,
                    &program.task_name(id),
                    ub,
                    &task.guard.text(&program.caches),
                );
                self.emit(d);
            } else if let Some(samples) = self.samples.get_mut(ub as usize) {
                samples.push(id);
            }
        }
        let signature = catalog::signature(&task.op, &program.model);
        let mut locations = Vec::new();
        for sig in &signature {
            if sig.expects.is_empty() || !sig.access.reads() {
                continue;
            }
            let step_kind = program.steps.get(task.step.index()).map(|s| s.kind);
            if sig.role == crate::ir::Role::Tokens
                && matches!(step_kind, Some(StepKind::Prefill | StepKind::Setup))
            {
                continue; // the prompt: provided by the runtime
            }
            let args: Vec<(usize, &crate::ir::Arg)> = task
                .args
                .iter()
                .enumerate()
                .filter(|(_, a)| a.role == sig.role)
                .collect();
            let Some(&(first_index, first)) = args.first() else {
                continue;
            };
            let first_span = arg_spans.get(first_index).copied().unwrap_or(span);
            let buffer_name = program.buffer(first.slice.buffer).name.clone();
            if sig.expects[0].is_weight() {
                // Index every tensor start across the argument slices.
                let mut all_runs: Vec<(usize, Runs)> = Vec::new();
                for &(k, arg) in &args {
                    all_runs.push((k, self.read_runs(&arg.slice)));
                }
                for expected in &sig.expects {
                    if let Err(d) = self.find_weight(
                        expected,
                        &args,
                        &all_runs,
                        arg_spans,
                        span,
                        id,
                        &task.guard,
                        &mut locations,
                    ) {
                        self.emit(d);
                        break;
                    }
                }
            } else if let Tensor::AttnOut {
                layer,
                ub,
                rows: Rows::All,
            } = sig.expects[0]
            {
                let step_kind = program.steps.get(task.step.index()).map(|s| s.kind);
                let mut found = Vec::new();
                for &(k, arg) in &args {
                    let arg_span = arg_spans.get(k).copied().unwrap_or(span);
                    let name = program.buffer(arg.slice.buffer).name.clone();
                    let need =
                        catalog::required_bytes(&task.op, sig.role, &program.model, &task.shape)
                            .unwrap_or(arg.slice.len)
                            .min(arg.slice.len);
                    let runs = self.read_runs(&arg.slice);
                    let mut result = Err(None);
                    for rows in [Rows::All, Rows::Prefill, Rows::Decode] {
                        let candidate = Tensor::AttnOut { layer, ub, rows };
                        let check = self.expect_activation(
                            candidate,
                            &runs,
                            arg.slice.start,
                            need,
                            arg.slice.len,
                            arg_span,
                            id,
                            &name,
                            &task.guard,
                        );
                        match check {
                            Ok(()) => {
                                result = Ok(rows);
                                break;
                            }
                            Err(d) if rows == Rows::All => result = Err(Some(d)),
                            Err(_) => {}
                        }
                    }
                    match result {
                        Ok(rows) => found.push(rows),
                        Err(Some(d)) => self.emit(d),
                        Err(None) => {}
                    }
                }
                let complete = found.contains(&Rows::All)
                    || (found.contains(&Rows::Prefill) && found.contains(&Rows::Decode))
                    || (step_kind == Some(StepKind::Prefill) && found.contains(&Rows::Prefill))
                    || (step_kind == Some(StepKind::Decode) && found.contains(&Rows::Decode));
                if !complete && found.len() == args.len() {
                    let held: Vec<String> = found
                        .iter()
                        .map(|r| {
                            Tensor::AttnOut {
                                layer,
                                ub,
                                rows: *r,
                            }
                            .to_string()
                        })
                        .collect();
                    self.emit(Diagnostic::wrong_value(
                        first_span,
                        &program.task_name(id),
                        &buffer_name,
                        &format!(
                            "{} (all rows)",
                            Tensor::AttnOut {
                                layer,
                                ub,
                                rows: Rows::All
                            }
                        ),
                        &held.join(" and "),
                        None,
                    ));
                }
            } else {
                // Each slice of a list (`combine(acc = [acc_g, acc_c])`) must hold the value.
                for &(k, arg) in &args {
                    let first = arg;
                    let first_span = arg_spans.get(k).copied().unwrap_or(span);
                    let buffer_name = program.buffer(arg.slice.buffer).name.clone();
                    let expected = sig.expects[0];
                    let need =
                        catalog::required_bytes(&task.op, sig.role, &program.model, &task.shape)
                            .unwrap_or(first.slice.len)
                            .min(first.slice.len);
                    let runs = self.read_runs(&first.slice);
                    let untouched = runs.iter().all(|r| r.2.piece.is_none());
                    let mixed = program
                        .steps
                        .get(task.step.index())
                        .is_some_and(|s| s.kind == StepKind::Mixed);
                    // A mixed step's first run has no cache and no sampled tokens yet.
                    let first_run_empty = mixed
                        && self.first_run
                        && matches!(sig.role, crate::ir::Role::Kv | crate::ir::Role::Tokens);
                    if untouched && (sig.may_be_empty || first_run_empty) {
                        break;
                    }
                    if let Err(d) = self.expect_activation(
                        expected,
                        &runs,
                        first.slice.start,
                        need,
                        first.slice.len,
                        first_span,
                        id,
                        &buffer_name,
                        &task.guard,
                    ) {
                        self.emit(d);
                    }
                }
            }
        }
        self.locations[index] = locations;
        self.track_experts(id, span);
        // Writes.
        for sig in &signature {
            let Some(produced) = sig.produces else {
                continue;
            };
            for arg in task
                .args
                .iter()
                .filter(|a| a.role == sig.role && a.access.writes())
            {
                if program.buffer(arg.slice.buffer).kind.is_weights() {
                    continue;
                }
                let (start, end) = (arg.slice.start, arg.slice.end());
                // An in-place update that keeps the tensor's identity (the expert sum) stays
                // valid when the task is skipped: keep the guard the value already had.
                // (`values::expert_guard` makes sure such a task is skipped only when it
                // would add nothing.)
                let now = self.epoch;
                let outputs = self.outputs_after(id, arg, produced, sig.expects.first());
                let (guard, guard_epoch) =
                    if arg.access == Access::ReadWrite && sig.expects.first() == Some(&produced) {
                        let before = self.read_runs(&arg.slice);
                        let guard = before
                            .iter()
                            .fold(Guard::default(), |g, r| union(&g, &r.2.guard));
                        let epoch = combined_guard_epoch(
                            before.iter().map(|r| (&r.2.guard, r.2.guard_epoch)),
                            now,
                        );
                        (guard, epoch)
                    } else {
                        (task.guard.clone(), now)
                    };
                let cell = Cell {
                    end,
                    piece: Some(Piece {
                        tensor: produced,
                        offset: 0,
                    }),
                    writer: Some(id),
                    guard,
                    epoch: Some(now),
                    guard_epoch,
                    outputs: Rc::new(outputs),
                };
                let incoming = [(start, end, cell)];
                self.check_lost_outputs(
                    id,
                    arg_spans.get(arg_index(task, arg)).copied().unwrap_or(span),
                    &arg.slice,
                    &incoming,
                );
                let [incoming] = incoming;
                let cells = self.cells_of(arg.slice.buffer);
                write(cells, start, vec![incoming]);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn find_weight(
        &self,
        expected: &Tensor,
        args: &[(usize, &crate::ir::Arg)],
        all_runs: &[(usize, Runs)],
        arg_spans: &[Span],
        span: Span,
        task_id: TaskId,
        guard: &Guard,
        locations: &mut Vec<WeightLocation>,
    ) -> Result<(), Diagnostic> {
        let need = expected.weight_bytes(&self.layout).unwrap_or(0);
        for (k, runs) in all_runs {
            let Some(pos) = runs.iter().position(|r| {
                r.2.piece
                    .as_ref()
                    .is_some_and(|p| p.tensor == *expected && p.offset == 0)
            }) else {
                continue;
            };
            let start = runs[pos].0;
            let arg = args.iter().find(|(i, _)| i == k).map(|(_, a)| *a);
            let arg_span = arg_spans.get(*k).copied().unwrap_or(span);
            let Some(arg) = arg else { continue };
            let buffer_name = &self.program.buffer(arg.slice.buffer).name;
            // The tensor must continue, byte for byte, for its whole length.
            let mut covered = 0u64;
            for (lo, hi, cell) in &runs[pos..] {
                if covered >= need {
                    break;
                }
                self.expect_run(
                    RunCheck {
                        cell,
                        run: (*lo, *hi),
                        tensor: expected,
                        origin: start,
                        slice: (arg.slice.start, arg.slice.len),
                        label: &format!("{expected} (all of it)"),
                    },
                    arg_span,
                    task_id,
                    buffer_name,
                    guard,
                )?;
                covered += hi - lo;
            }
            if covered < need {
                return Err(Diagnostic::wrong_value(
                    arg_span,
                    &self.program.task_name(task_id),
                    buffer_name,
                    &format!("{expected} (all of it)"),
                    &format!("only its first {covered} of {need} bytes"),
                    None,
                ));
            }
            locations.push(WeightLocation {
                tensor: *expected,
                arg: *k as u32,
                offset: start - arg.slice.start,
            });
            return Ok(());
        }
        // An expert the arguments hold only in another format (`.format(q4_k)`): a lossy
        // substitute, accepted only where the schedule declares it.
        if let Tensor::Expert { layer, expert } = *expected {
            let substitute = all_runs.iter().find_map(|(k, runs)| {
                runs.iter().find_map(|r| match r.2.piece {
                    Some(Piece {
                        tensor:
                            t @ Tensor::ExpertIn {
                                layer: l,
                                expert: e,
                                ..
                            },
                        offset: 0,
                    }) if l == layer && e == expert => Some((*k, t)),
                    _ => None,
                })
            });
            if let Some((k, tensor @ Tensor::ExpertIn { format, .. })) = substitute {
                let declared = self
                    .program
                    .substitutes
                    .iter()
                    .any(|s| s.format.ggml().id == format);
                if declared {
                    return self.find_weight(
                        &tensor, args, all_runs, arg_spans, span, task_id, guard, locations,
                    );
                }
                let buffer = args
                    .iter()
                    .find(|(i, _)| *i == k)
                    .map(|(_, a)| self.program.buffer(a.slice.buffer).name.clone())
                    .unwrap_or_default();
                return Err(Diagnostic::undeclared_substitute(
                    arg_spans.get(k).copied().unwrap_or(span),
                    &self.program.task_name(task_id),
                    &buffer,
                    &expected.to_string(),
                    &tensor.to_string(),
                    &crate::ir::value::format_name(format),
                ));
            }
        }
        // Not found anywhere. Evidence, best first: where a later part of the tensor sits,
        // the bytes before it that should hold its start; a run of the same part of
        // another layer (the stale occupant of a slot); a run of the same kind of tensor
        // (another expert); else the first argument that holds anything; else nothing was
        // written at all.
        let same_kind =
            |p: &Piece| std::mem::discriminant(&p.tensor) == std::mem::discriminant(expected);
        let same_part = |p: &Piece| match (&p.tensor, expected) {
            (Tensor::Expert { expert: a, .. }, Tensor::Expert { expert: b, .. }) => a == b,
            _ => same_kind(p),
        };
        let partial = all_runs.iter().enumerate().find_map(|(n, (k, runs))| {
            let arg = args.iter().find(|(i, _)| i == k)?.1;
            let (lo, piece) = runs.iter().find_map(|r| {
                let p = r.2.piece.as_ref()?;
                (p.tensor == *expected && p.offset > 0).then_some((r.0, p))
            })?;
            // The tensor would start at `t0`; the bytes from there (inside the argument) up
            // to `lo` should hold its beginning.
            let t0 = lo.checked_sub(piece.offset)?;
            let from = t0.max(arg.slice.start);
            runs.iter()
                .find(|(r_lo, r_hi, cell)| {
                    let right = cell
                        .piece
                        .as_ref()
                        .is_some_and(|p| p.tensor == *expected && p.offset + t0 == *r_lo);
                    *r_hi > from && *r_lo < lo && !right
                })
                .map(|r| (n, r))
        });
        let pick = partial
            .or_else(|| {
                all_runs.iter().enumerate().find_map(|(n, (_, runs))| {
                    runs.iter()
                        .find(|r| r.2.piece.as_ref().is_some_and(same_part))
                        .map(|r| (n, r))
                })
            })
            .or_else(|| {
                all_runs.iter().enumerate().find_map(|(n, (_, runs))| {
                    runs.iter()
                        .find(|r| r.2.piece.as_ref().is_some_and(same_kind))
                        .map(|r| (n, r))
                })
            })
            .or_else(|| {
                all_runs.iter().enumerate().find_map(|(n, (_, runs))| {
                    runs.iter().find(|r| r.2.piece.is_some()).map(|r| (n, r))
                })
            });
        let Some((n, (lo, hi, cell))) = pick else {
            let arg = args[0].1;
            let arg_span = arg_spans.get(all_runs[0].0).copied().unwrap_or(span);
            let buffer_name = &self.program.buffer(arg.slice.buffer).name;
            return Err(Diagnostic::uninitialized(
                arg_span,
                &self.program.task_name(task_id),
                buffer_name,
                &expected.to_string(),
            ));
        };
        let (k, _) = &all_runs[n];
        let arg = args
            .iter()
            .find(|(i, _)| i == k)
            .map_or(args[0].1, |(_, a)| *a);
        let arg_span = arg_spans.get(*k).copied().unwrap_or(span);
        let buffer_name = &self.program.buffer(arg.slice.buffer).name;
        let held = self.describe(cell, *lo, *hi, arg.slice.start, arg.slice.len);
        Err(Diagnostic::wrong_value(
            arg_span,
            &self.program.task_name(task_id),
            buffer_name,
            &expected.to_string(),
            &held,
            self.writer_of(cell),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn expect_activation(
        &self,
        expected: Tensor,
        runs: &[(u64, u64, Cell)],
        start: u64,
        need: u64,
        len: u64,
        arg_span: Span,
        task_id: TaskId,
        buffer_name: &str,
        guard: &Guard,
    ) -> Result<(), Diagnostic> {
        if runs.iter().all(|r| r.2.piece.is_none()) {
            return Err(Diagnostic::uninitialized(
                arg_span,
                &self.program.task_name(task_id),
                buffer_name,
                &expected.to_string(),
            ));
        }
        for (lo, hi, cell) in runs {
            if lo - start >= need {
                break;
            }
            self.expect_run(
                RunCheck {
                    cell,
                    run: (*lo, *hi),
                    tensor: &expected,
                    origin: start,
                    slice: (start, len),
                    label: &expected.to_string(),
                },
                arg_span,
                task_id,
                buffer_name,
                guard,
            )?;
        }
        Ok(())
    }

    /// One run of bytes an op reads must hold `tensor` at its offset from `origin`
    /// (else `values::wrong`), written under a guard the reader's implies (else
    /// `values::maybe_stale`).
    fn expect_run(
        &self,
        c: RunCheck<'_>,
        arg_span: Span,
        task_id: TaskId,
        buffer_name: &str,
        guard: &Guard,
    ) -> Result<(), Diagnostic> {
        let (lo, hi) = c.run;
        let ok = c
            .cell
            .piece
            .as_ref()
            .is_some_and(|p| p.tensor == *c.tensor && p.offset == lo - c.origin);
        if !ok {
            let held = self.describe(c.cell, lo, hi, c.slice.0, c.slice.1);
            return Err(Diagnostic::wrong_value(
                arg_span,
                &self.program.task_name(task_id),
                buffer_name,
                c.label,
                &held,
                self.writer_of(c.cell),
            ));
        }
        if let Some(d) = self.stale_check(&c, arg_span, task_id, buffer_name) {
            return Err(d);
        }
        let guard_now = c.cell.guard.is_always() || c.cell.guard_epoch == self.epoch;
        if !guard_now || !implies(guard, &c.cell.guard) {
            let writer = self.writer_of(c.cell).unwrap_or_default();
            return Err(Diagnostic::maybe_stale(
                arg_span,
                &self.program.task_name(task_id),
                buffer_name,
                &c.tensor.to_string(),
                writer,
            ));
        }
        Ok(())
    }

    /// `values::stale` when the run of bytes holds the expected tensor but from a run
    /// other than the one the reader needs (see the module header for which).
    fn stale_check(
        &self,
        c: &RunCheck<'_>,
        arg_span: Span,
        task_id: TaskId,
        buffer_name: &str,
    ) -> Option<Diagnostic> {
        let held = c.cell.epoch?;
        let now = self.epoch;
        let previous = now.checked_sub(1);
        let (ok, wanted) = match c.tensor {
            t if t.is_weight() && !is_run_time_expert(t) => return None,
            Tensor::Tokens { .. } => (
                Some(held) == previous,
                format!("sampled in {}", self.run_name(previous)),
            ),
            Tensor::KvCache { .. } => (
                held == now || Some(held) == previous,
                format!(
                    "as {} left it (or as {} updated it)",
                    self.run_name(previous),
                    self.run_name(Some(now))
                ),
            ),
            _ => (held == now, format!("of {}", self.run_name(Some(now)))),
        };
        if ok {
            return None;
        }
        Some(Diagnostic::stale_value(
            arg_span,
            &self.program.task_name(task_id),
            buffer_name,
            &c.tensor.to_string(),
            &wanted,
            &self.run_name(Some(held)),
            self.writer_of(c.cell),
        ))
    }

    /// `prefill run 1`, `decode run 2`; `no earlier run` before the first.
    fn run_name(&self, epoch: Option<u32>) -> String {
        epoch
            .and_then(|e| self.plan.get(e as usize))
            .map_or_else(|| "no earlier run".to_string(), |r| r.name.clone())
    }

    /// After a prefill, decode or mixed run: every micro-batch sampled exactly once.
    fn check_sampling(&mut self) {
        let run = self.plan[self.epoch as usize].name.clone();
        let step = &self.program.steps[self.plan[self.epoch as usize].step];
        let last_task = step.task_ids().last();
        for ub in 0..self.samples.len() {
            match self.samples[ub].as_slice() {
                [] => {
                    // Point at the run's last task on the ub; in a step that never touches
                    // it, at a `sample` of it in another step.
                    let program = self.program;
                    let elsewhere = (0..program.tasks.len())
                        .map(TaskId::new)
                        .find(|&t| program.task(t).op == Op::Sample { ub: ub as u32 });
                    let (at, what, label) = match (self.last_of_ub[ub], elsewhere) {
                        (Some(t), _) => (
                            Some(t),
                            format!("its last task in the run is {}", program.task_name(t)),
                            format!("ub {ub} is never sampled after this"),
                        ),
                        (None, Some(t)) => (
                            Some(t),
                            format!(
                                "no task of the step works on it; task {} samples it in another step",
                                program.task_name(t)
                            ),
                            format!("samples ub {ub}, but not in {run}"),
                        ),
                        (None, None) => (
                            last_task,
                            "no task works on it".to_string(),
                            format!("ub {ub} is never sampled"),
                        ),
                    };
                    let span = at.map(|t| program.task_span(t)).unwrap_or_default();
                    let d = Diagnostic::unsampled(span, &run, ub as u32, &what, &label);
                    self.sampling.push(d);
                }
                [_] => {}
                [first, second, ..] => {
                    let (first, second) = (*first, *second);
                    let d = Diagnostic::sampled_twice(
                        self.program.task_span(second),
                        self.program.task_span(first),
                        &run,
                        ub as u32,
                        &self.program.task_name(second),
                    );
                    self.sampling.push(d);
                }
            }
        }
    }

    fn track_experts(&mut self, id: TaskId, span: Span) {
        let program = self.program;
        let experts = program.model.experts;
        let task = program.task(id);
        match task.op {
            Op::Experts { layer, ub, set } => {
                let guard = &task.guard;
                // A guard on a token count is one arm of a choice: `combine` proves the
                // arms together (`arms`). Otherwise the task alone must run whenever its
                // expert has tokens.
                let load_arm = guard
                    .lits
                    .iter()
                    .any(|l| !matches!(l.atom, GuardAtom::Active { .. }));
                let sound = load_arm
                    || guard.is_always()
                    || matches!(set, ExpertSet::One(e) if runs_when_active(guard, layer, e, ub));
                if !sound {
                    let d = Diagnostic::expert_guard(
                        span,
                        &program.task_name(id),
                        &guard.text(&program.caches),
                        &set.to_string(),
                        layer,
                        ub,
                    );
                    self.emit(d);
                }
            }
            // A dense layer routes no token to any expert: nothing to cover.
            Op::Combine { layer, .. } if program.model.is_dense_layer(u64::from(layer)) => {}
            Op::Combine { layer, ub } => {
                // The outputs that reach this combine, through every accumulator it reads.
                let mut outputs: Vec<Output> = Vec::new();
                for arg in task.args.iter().filter(|a| a.role == crate::ir::Role::Acc) {
                    let runs = self.read_runs(&arg.slice);
                    let mut held: Vec<Output> = Vec::new();
                    for (_, _, cell) in &runs {
                        let ours = matches!(
                            cell.piece,
                            Some(Piece { tensor: Tensor::ExpertAcc { layer: l, ub: u }, .. })
                                if l == layer && u == ub
                        );
                        if !ours || cell.epoch != Some(self.epoch) {
                            continue; // reported as a wrong or stale value already
                        }
                        for o in cell.outputs.iter() {
                            if !held.iter().any(|h| h.task == o.task) {
                                held.push(o.clone());
                            }
                        }
                    }
                    outputs.extend(held);
                }
                let sets: Vec<ExpertSet> = outputs.iter().map(|o| o.set).collect();
                let problem = if arms::has_load_guard(&outputs) {
                    arms::check(
                        &outputs,
                        layer,
                        ub,
                        experts,
                        &|t| program.task_name(t),
                        &program.caches,
                    )
                } else {
                    coverage_problem(&sets, layer, experts)
                };
                if let Some(problem) = problem {
                    self.emit(Diagnostic::expert_coverage(span, layer, ub, &problem));
                }
            }
            _ => {}
        }
    }

    /// The expert outputs an accumulator holds after task `id` writes `arg`: a `gate`
    /// starts an empty one; an `experts` task adds its own to what the bytes held.
    fn outputs_after(
        &mut self,
        id: TaskId,
        arg: &crate::ir::Arg,
        produced: Tensor,
        expected: Option<&Tensor>,
    ) -> Vec<Output> {
        let task = self.program.task(id);
        if !matches!(produced, Tensor::ExpertAcc { .. })
            || arg.access != Access::ReadWrite
            || expected != Some(&produced)
        {
            return Vec::new();
        }
        let held: Vec<Cell> = self
            .read_runs(&arg.slice)
            .into_iter()
            .filter(|(_, _, cell)| {
                cell.piece.is_some_and(|p| p.tensor == produced) && cell.epoch == Some(self.epoch)
            })
            .map(|(_, _, cell)| cell)
            .collect();
        let mut outputs: Vec<Output> = match held.as_slice() {
            // One run (the accumulator written whole, the usual case): its outputs as they
            // are, each task once already.
            [one] => one.outputs.as_ref().clone(),
            _ => {
                // Tasks already in `outputs` (a layer's accumulator holds hundreds of
                // outputs: a scan of `outputs` per output was quadratic in them).
                let mut seen: std::collections::HashSet<TaskId> = std::collections::HashSet::new();
                let mut outputs = Vec::new();
                for cell in &held {
                    for o in cell.outputs.iter() {
                        if seen.insert(o.task) {
                            outputs.push(o.clone());
                        }
                    }
                }
                outputs
            }
        };
        if let Op::Experts { set, .. } = task.op {
            outputs.push(Output {
                task: id,
                set,
                guard: Rc::new(task.guard.clone()),
            });
        }
        outputs
    }

    /// `values::lost_output`: a write (a copy, or an op's output) over an accumulator of
    /// this run that holds expert outputs the incoming value of the same accumulator does
    /// not: `combine` would never see them (Fiddler's CPU accumulator copied over the one
    /// the GPU experts already wrote).
    fn check_lost_outputs(
        &mut self,
        id: TaskId,
        dst_span: Span,
        dst: &crate::ir::Slice,
        incoming: &[(u64, u64, Cell)],
    ) {
        let now = self.epoch;
        let before = runs(self.cells_of(dst.buffer), dst.start, dst.end());
        for (lo, hi, cell) in &before {
            let Some(Piece {
                tensor: held @ Tensor::ExpertAcc { .. },
                ..
            }) = cell.piece
            else {
                continue;
            };
            if cell.epoch != Some(now) || cell.outputs.is_empty() {
                continue;
            }
            for (in_lo, in_hi, new) in incoming {
                let same = new.piece.is_some_and(|p| p.tensor == held);
                if !same || in_hi <= lo || hi <= in_lo {
                    continue;
                }
                // The incoming value usually extends the held one (an `experts` task adds
                // its output to the accumulator's): nothing lost, no set to build.
                let extends = new.outputs.len() >= cell.outputs.len()
                    && cell
                        .outputs
                        .iter()
                        .zip(new.outputs.iter())
                        .all(|(h, n)| h.task == n.task);
                if extends {
                    continue;
                }
                // The first held output the incoming value lacks (one set of the incoming
                // tasks, not a scan of them per held output).
                let incoming_tasks: std::collections::HashSet<TaskId> =
                    new.outputs.iter().map(|n| n.task).collect();
                let lost = cell
                    .outputs
                    .iter()
                    .find(|o| !incoming_tasks.contains(&o.task));
                if let Some(lost) = lost {
                    let d = Diagnostic::lost_output(
                        dst_span,
                        &self.program.task_name(id),
                        &self.program.buffer(dst.buffer).name,
                        &held.to_string(),
                        &match lost.set {
                            ExpertSet::One(e) => format!("expert {e}"),
                            set => format!("experts {set}"),
                        },
                        &self.program.task_name(lost.task),
                        self.program.task_span(lost.task),
                    );
                    self.emit(d);
                    return;
                }
            }
        }
    }
}

/// Index of `arg` in its task's arguments (for its span).
fn arg_index(task: &crate::ir::Task, arg: &crate::ir::Arg) -> usize {
    task.args
        .iter()
        .position(|a| std::ptr::eq(a, arg))
        .unwrap_or(usize::MAX)
}

/// An expert named by its run-time rank (`hot(l, r)`): which one it is depends on the
/// run's routing, so such a value belongs to the run that chose it.
fn is_run_time_expert(tensor: &Tensor) -> bool {
    matches!(tensor, Tensor::Expert { expert, .. } if expert.is_run_time())
}

/// Checks that `sets` name every expert exactly once: all fixed, or all run-time ranks.
fn coverage_problem(sets: &[ExpertSet], layer: u32, experts: u64) -> Option<String> {
    let mut fixed = vec![0u32; experts as usize];
    let mut ranks = vec![0u32; experts as usize];
    let mut any_rank = false;
    let mut any_fixed = false;
    for set in sets {
        match set {
            ExpertSet::One(ExpertRef::Hot { layer: l, rank }) => {
                if *l != layer {
                    return Some(format!(
                        "`hot({l}, {rank})` names an expert of layer {l}, not {layer}"
                    ));
                }
                any_rank = true;
                ranks[*rank as usize] += 1;
            }
            other => {
                any_fixed = true;
                for e in other.members(experts) {
                    if let ExpertRef::Index(e) = e {
                        fixed[e as usize] += 1;
                    }
                }
            }
        }
    }
    if any_rank && any_fixed {
        return Some(
            "mixes run-time ranks `hot(i, r)` with fixed experts; coverage cannot be proven"
                .to_string(),
        );
    }
    let (counts, what) = if any_rank {
        (&ranks, "rank")
    } else {
        (&fixed, "expert")
    };
    if let Some(e) = counts.iter().position(|&c| c == 0) {
        return Some(format!("{what} {e} is never computed before `combine`"));
    }
    if let Some(e) = counts.iter().position(|&c| c > 1) {
        return Some(format!(
            "{what} {e} is computed {} times before `combine`",
            counts[e]
        ));
    }
    None
}
