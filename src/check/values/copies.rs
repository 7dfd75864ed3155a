//! The copy rules of the value-tracking proof (`check::values`): what a `copy` task moves
//! from source to destination (weights, activations, expert outputs, format copies), a KV
//! cache copy (`.context()` / `.appended()`: one layer and micro-batch's whole cache, as
//! the previous run left it or as this run updated it), and a fetch into an expert cache's
//! slot. Split from values.rs by job: the rest of the tracker reads and checks what these
//! rules write.

use super::*;

impl Tracker<'_> {
    pub(super) fn copy(&mut self, id: TaskId, arg_spans: &[Span], span: Span) {
        let program = self.program;
        let task = program.task(id);
        let [src, dst] = task.args.as_slice() else {
            return;
        };
        if src.access != Access::Read || program.buffer(dst.slice.buffer).kind.is_weights() {
            return;
        }
        let runs_in = self.read_runs(&src.slice);
        if let Some(key) = dst.slice.cache_key {
            return self.cache_fill(id, key, &src.slice, &runs_in, arg_spans, span);
        }
        if let Some(part) = task.kv {
            return self.kv_copy(id, part, &runs_in, arg_spans, span);
        }
        // Copying bytes nobody wrote is an error, unless the destination holds nothing
        // either: then the copy changes nothing (a relay slot of a dense layer's experts,
        // which the layer does not have, copied on before anything was staged in it).
        let mut changes_nothing = || {
            runs(
                self.cells_of(dst.slice.buffer),
                dst.slice.start,
                dst.slice.end(),
            )
            .iter()
            .all(|r| r.2.piece.is_none())
        };
        if runs_in.iter().all(|r| r.2.piece.is_none()) && !changes_nothing() {
            let name = program.buffer(src.slice.buffer).name.clone();
            let d = Diagnostic::uninitialized(
                arg_spans.first().copied().unwrap_or(span),
                &self.program.task_name(id),
                &name,
                "anything to copy",
            );
            self.emit(d);
        }
        let len = src.slice.len.min(dst.slice.len);
        let now = self.epoch;
        let rows =
            crate::check::live::held_rows(program, task, &runs_in, src.slice.start, len, now);
        self.live[id.index()] = self.live[id.index()].join(rows);
        let shift = |pos: u64| pos - src.slice.start + dst.slice.start;
        let moved: Vec<(u64, u64, Cell)> = runs_in
            .into_iter()
            .filter(|(lo, _, _)| lo - src.slice.start < len)
            .map(|(lo, hi, cell)| {
                let hi = hi.min(src.slice.start + len);
                let guard = union(&task.guard, &cell.guard);
                let guard_epoch = combined_guard_epoch([(&cell.guard, cell.guard_epoch)], now);
                // A run-time chosen expert copied from a whole layer is this run's choice.
                let epoch = match (&cell.piece, cell.epoch) {
                    (Some(p), None) if is_run_time_expert(&p.tensor) => Some(now),
                    (_, epoch) => epoch,
                };
                // The copy is what put the bytes here; the original writer stays findable
                // through the copy's own inputs.
                let new = Cell {
                    end: shift(hi),
                    piece: cell.piece,
                    writer: Some(id),
                    guard,
                    epoch,
                    guard_epoch,
                    outputs: cell.outputs.clone(),
                };
                (shift(lo), shift(hi), new)
            })
            .collect();
        let dst_span = arg_spans.get(1).copied().unwrap_or(span);
        self.check_lost_outputs(id, dst_span, &dst.slice, &moved);
        let cells = self.cells_of(dst.slice.buffer);
        write(cells, dst.slice.start, moved);
    }

    /// A copy of part of a KV cache. The source must hold one layer and micro-batch's
    /// cache, whole. `.context()` moves the positions cached before this run's new tokens:
    /// the destination then holds the cache as the previous run left it (even when the
    /// source was already updated by this run). `.appended()` moves only this run's new
    /// positions: the source must have been updated by this run, and the destination must
    /// already hold the same cache as the previous run left it (a prefill step, whose
    /// new positions are the whole cache, or a mixed step's first run, excepted), so that
    /// every position a later read finds was written by someone.
    fn kv_copy(
        &mut self,
        id: TaskId,
        part: crate::ir::KvPart,
        runs_in: &[(u64, u64, Cell)],
        arg_spans: &[Span],
        span: Span,
    ) {
        let program = self.program;
        let task = program.task(id);
        let [src, dst] = task.args.as_slice() else {
            return;
        };
        let (now, previous) = (self.epoch, self.epoch.checked_sub(1));
        let name = program.task_name(id);
        let src_span = arg_spans.first().copied().unwrap_or(span);
        let dst_span = arg_spans.get(1).copied().unwrap_or(span);
        let src_name = &program.buffer(src.slice.buffer).name;
        let method = part.as_str();
        let held = match runs_in {
            [(lo, hi, cell)] if *lo == src.slice.start && *hi == src.slice.end() => {
                match (&cell.piece, cell.epoch) {
                    (
                        Some(Piece {
                            tensor: tensor @ Tensor::KvCache { .. },
                            offset: 0,
                        }),
                        Some(epoch),
                    ) => Some((*tensor, epoch, cell)),
                    _ => None,
                }
            }
            _ => None,
        };
        let Some((tensor, epoch, cell)) = held else {
            let what = runs_in
                .iter()
                .map(|(lo, hi, c)| self.describe(c, *lo, *hi, src.slice.start, src.slice.len))
                .collect::<Vec<_>>()
                .join(", ");
            let writer = runs_in.first().and_then(|r| self.writer_of(&r.2));
            let d = Diagnostic::wrong_value(
                src_span,
                &name,
                src_name,
                &format!("one layer and micro-batch's KV cache, whole (what `.{method}()` copies)"),
                &what,
                writer,
            );
            return self.emit(d);
        };
        let Tensor::KvCache { layer, ub } = tensor else {
            return;
        };
        let source = KvSource { layer, ub };
        match self.kv_sources[id.index()] {
            Some(seen) if seen != source => {
                let d = Diagnostic::wrong_value(
                    src_span,
                    &name,
                    src_name,
                    &format!(
                        "kv cache of layer {}, ub {} (as in an earlier run)",
                        seen.layer, seen.ub
                    ),
                    &tensor.to_string(),
                    self.writer_of(cell),
                );
                return self.emit(d);
            }
            _ => self.kv_sources[id.index()] = Some(source),
        }
        let stale = |wanted: &str| {
            Diagnostic::stale_value(
                src_span,
                &name,
                src_name,
                &tensor.to_string(),
                wanted,
                &self.run_name(Some(epoch)),
                self.writer_of(cell),
            )
        };
        let moved_epoch = match part {
            crate::ir::KvPart::Context => {
                if epoch != now && Some(epoch) != previous {
                    let wanted = format!(
                        "as {} left it (or as {} updated it)",
                        self.run_name(previous),
                        self.run_name(Some(now))
                    );
                    return self.emit(stale(&wanted));
                }
                previous.unwrap_or(epoch).min(epoch)
            }
            crate::ir::KvPart::Appended => {
                if epoch != now {
                    let wanted = format!("as {} updated it", self.run_name(Some(now)));
                    return self.emit(stale(&wanted));
                }
                let kind = program.steps.get(task.step.index()).map(|s| s.kind);
                let before = self.read_runs(&dst.slice);
                let untouched = before.iter().all(|r| r.2.piece.is_none());
                let whole_new = kind == Some(StepKind::Prefill)
                    || (kind == Some(StepKind::Mixed) && self.first_run && untouched);
                let ready = matches!(
                    before.as_slice(),
                    [(lo, hi, c)] if *lo == dst.slice.start && *hi == dst.slice.end()
                        && c.piece.is_some_and(|p| p.tensor == tensor && p.offset == 0)
                        && (c.epoch == previous || c.epoch == Some(now))
                );
                if !whole_new && !ready {
                    let held = before
                        .iter()
                        .map(|(lo, hi, c)| {
                            self.describe(c, *lo, *hi, dst.slice.start, dst.slice.len)
                        })
                        .collect::<Vec<_>>()
                        .join(", ");
                    let d = Diagnostic::wrong_value(
                        dst_span,
                        &name,
                        &program.buffer(dst.slice.buffer).name,
                        &format!(
                            "{tensor} as {} left it (`.appended()` writes only the new positions)",
                            self.run_name(previous)
                        ),
                        &held,
                        before.first().and_then(|r| self.writer_of(&r.2)),
                    );
                    return self.emit(d);
                }
                now
            }
        };
        let new = Cell {
            end: dst.slice.end(),
            piece: Some(Piece { tensor, offset: 0 }),
            writer: Some(id),
            guard: union(&task.guard, &cell.guard),
            epoch: Some(moved_epoch),
            guard_epoch: combined_guard_epoch([(&cell.guard, cell.guard_epoch)], now),
            outputs: Rc::default(),
        };
        let cells = self.cells_of(dst.slice.buffer);
        write(
            cells,
            dst.slice.start,
            vec![(dst.slice.start, dst.slice.end(), new)],
        );
    }

    /// A `fetch` or `prefetch` into `key`'s slot: its source must hold exactly that
    /// expert's weights, whole (what readers of the slot are then given).
    fn cache_fill(
        &mut self,
        id: TaskId,
        key: crate::ir::cache::CacheKey,
        src: &crate::ir::Slice,
        runs_in: &[(u64, u64, Cell)],
        arg_spans: &[Span],
        span: Span,
    ) {
        let expected = Tensor::Expert {
            layer: key.layer,
            expert: key.expert,
        };
        let whole = matches!(
            runs_in,
            [(lo, hi, Cell { piece: Some(Piece { tensor, offset: 0 }), .. })]
                if *lo == src.start && *hi == src.end() && *tensor == expected
        );
        if whole {
            return;
        }
        let held = runs_in
            .iter()
            .map(|(lo, hi, cell)| self.describe(cell, *lo, *hi, src.start, src.len))
            .collect::<Vec<_>>()
            .join(", ");
        let writer = runs_in.first().and_then(|r| self.writer_of(&r.2));
        let d = Diagnostic::wrong_value(
            arg_spans.first().copied().unwrap_or(span),
            &self.program.task_name(id),
            &self.program.buffer(src.buffer).name,
            &format!("{expected} (the expert of the slot it fills)"),
            &held,
            writer,
        );
        self.emit(d);
    }
}
