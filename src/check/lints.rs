//! Warnings: unused buffers and streams, and false dependencies.
//!
//! Takes a program and its DAG; gives warnings. A false dependency is a kept edge between
//! two streams that exists only because a single (non-array) buffer is reused (WAR/WAW, no
//! data flow): an array of two would let the streams overlap. One warning per buffer and
//! stream pair, with a count and one example.

use crate::diag::Diagnostic;
use crate::ir::deps::Dag;
use crate::ir::{BufferKind, Program};
use std::collections::BTreeMap;

/// Runs the lints.
pub fn check(program: &Program, dag: &Dag, diags: &mut Vec<Diagnostic>) {
    let mut buffer_used = vec![false; program.buffers.len()];
    let mut stream_used = vec![false; program.streams.len()];
    for task in &program.tasks {
        stream_used[task.stream.index()] = true;
        for arg in &task.args {
            buffer_used[arg.slice.buffer.index()] = true;
        }
    }
    let mut arrays: BTreeMap<&str, (bool, usize)> = BTreeMap::new();
    for (i, buffer) in program.buffers.iter().enumerate() {
        if buffer.kind != BufferKind::Declared {
            continue;
        }
        let entry = arrays.entry(buffer.array.as_str()).or_insert((false, i));
        entry.0 |= buffer_used[i];
    }
    for (name, (used, first)) in &arrays {
        if !used {
            let span = program
                .spans
                .buffers
                .get(*first)
                .copied()
                .unwrap_or_default();
            diags.push(Diagnostic::unused_buffer(span, name));
        }
    }
    for (i, stream) in program.streams.iter().enumerate() {
        if !stream_used[i] {
            let span = program.spans.streams.get(i).copied().unwrap_or_default();
            diags.push(Diagnostic::unused_stream(span, &stream.name));
        }
    }
    // (buffer, from stream, to stream) -> (count, first example (from task, to task))
    type Example = (usize, (u32, u32));
    let mut found: BTreeMap<(u32, u32, u32), Example> = BTreeMap::new();
    for edge in &dag.edges {
        let Some(buffer) = edge.buffer else { continue };
        let from = program.task(edge.from).stream;
        let to = program.task(edge.to).stream;
        let b = program.buffer(buffer);
        if from == to
            || !edge.kinds.is_reuse_only()
            || !b.index.is_empty()
            || b.kind != BufferKind::Declared
        {
            continue;
        }
        let entry = found
            .entry((buffer.0, from.0, to.0))
            .or_insert((0, (edge.from.0, edge.to.0)));
        entry.0 += 1;
    }
    for ((buffer, from, to), (count, (a, b))) in found {
        let buffer = crate::ir::BufferId(buffer);
        let decl = program
            .spans
            .buffers
            .get(buffer.index())
            .copied()
            .unwrap_or_default();
        let streams = (
            program.streams[from as usize].name.as_str(),
            program.streams[to as usize].name.as_str(),
        );
        let example = (
            program.task_span(crate::ir::TaskId(a)),
            program.task_span(crate::ir::TaskId(b)),
        );
        diags.push(Diagnostic::false_dependency(
            decl,
            &program.buffer(buffer).name,
            streams,
            count,
            example,
        ));
    }
}
