//! Structural checks: engines and memory spaces, copy lengths, argument sizes, read-only `W`.
//!
//! Takes a program; gives diagnostics. Invariants checked, per task:
//! - each op runs on an engine its op-table entry lists (compute ops on `gpu.compute` or
//!   `cpu.compute`; copies on an engine whose spaces fit);
//! - `gpu.compute` touches only `gpu`; `cpu.compute` only `pinned`/`host` (and reads the
//!   checkpoint on `disk` in place, through its memory map); `gpu.copy_in`
//!   copies `pinned`/`host` -> `gpu` (pageable source: warning); `gpu.copy_out` `gpu` ->
//!   `pinned`/`host`; `cpu.copy` between `pinned`/`host`; `disk.read` copies the
//!   checkpoint on `disk` -> `pinned`/`host`, and nothing else reaches the disk;
//! - copies move equal lengths; activation arguments are at least as large as the op needs;
//! - nothing writes the checkpoint.

use crate::diag::Diagnostic;
use crate::ir::catalog::{self, Op};
use crate::ir::{Engine, Program, Role, Space, TaskId};

fn allowed(engine: Engine, role: Role) -> (&'static [Space], &'static str) {
    const GPU: &[Space] = &[Space::Gpu];
    const HOST: &[Space] = &[Space::Pinned, Space::Host];
    const HOST_OR_DISK: &[Space] = &[Space::Pinned, Space::Host, Space::Disk];
    const DISK: &[Space] = &[Space::Disk];
    match (engine, role) {
        (Engine::GpuCompute, _) => (GPU, "only `gpu` memory"),
        // A compute op may read `W` in place from disk (its pages are mapped on demand and
        // charged to host memory); writing it is refused below as for any checkpoint.
        (Engine::CpuCompute, _) => (
            HOST_OR_DISK,
            "only `pinned` and `host` memory (and `W` in place)",
        ),
        (Engine::CpuCopy, _) => (HOST, "only `pinned` and `host` memory"),
        (Engine::DiskRead, Role::Src) => (DISK, "`disk` sources and `pinned`/`host` destinations"),
        (Engine::DiskRead, _) => (HOST, "`disk` sources and `pinned`/`host` destinations"),
        (Engine::GpuCopyIn, Role::Dst) => (GPU, "`pinned`/`host` sources and `gpu` destinations"),
        (Engine::GpuCopyIn, _) => (HOST, "`pinned`/`host` sources and `gpu` destinations"),
        (Engine::GpuCopyOut, Role::Src) => (GPU, "`gpu` sources and `pinned`/`host` destinations"),
        (Engine::GpuCopyOut, _) => (HOST, "`gpu` sources and `pinned`/`host` destinations"),
    }
}

/// Runs the structural checks over every task.
pub fn check(program: &Program, diags: &mut Vec<Diagnostic>) {
    for (index, task) in program.tasks.iter().enumerate() {
        let id = TaskId::new(index);
        let stream = program.stream(task.stream);
        let span = program.task_span(id);
        let stream_span = program
            .spans
            .streams
            .get(task.stream.index())
            .copied()
            .unwrap_or_default();
        let arg_spans = program
            .spans
            .task_args
            .get(index)
            .cloned()
            .unwrap_or_default();
        let is_copy = task.op == Op::Copy;
        let step_kind = program
            .steps
            .get(task.step.index())
            .map_or(crate::ir::StepKind::Decode, |s| s.kind);
        if !task.op.def().runs_on(stream.engine) {
            diags.push(Diagnostic::op_engine(
                span,
                stream_span,
                task.op.name(),
                stream.engine.as_str(),
            ));
            continue;
        }
        for (k, arg) in task.args.iter().enumerate() {
            let buffer = program.buffer(arg.slice.buffer);
            let arg_span = arg_spans.get(k).copied().unwrap_or(span);
            let (spaces, text) = allowed(stream.engine, arg.role);
            if !spaces.contains(&buffer.space) {
                diags.push(Diagnostic::engine_space(
                    arg_span,
                    stream_span,
                    stream.engine.as_str(),
                    &buffer.name,
                    buffer.space.as_str(),
                    text,
                ));
            }
            if arg.access.writes() && buffer.kind.is_weights() {
                diags.push(Diagnostic::write_checkpoint(arg_span));
            }
            if arg.access.writes() && arg.slice.dynamic_expert.is_some() {
                diags.push(Diagnostic::dynamic_not_allowed(
                    arg_span,
                    "the slot a task writes",
                ));
            }
            if let Some(need) = catalog::required_bytes_in_step(
                &task.op,
                arg.role,
                &program.model,
                &task.shape,
                step_kind,
            ) {
                if arg.slice.len < need {
                    diags.push(Diagnostic::buffer_too_small(
                        arg_span,
                        arg.role.as_str(),
                        arg.slice.len,
                        need,
                    ));
                }
            }
        }
        if is_copy {
            if let [src, dst] = task.args.as_slice() {
                if src.slice.len != dst.slice.len {
                    diags.push(Diagnostic::copy_size(span, src.slice.len, dst.slice.len));
                }
                let src_buffer = program.buffer(src.slice.buffer);
                if stream.engine == Engine::GpuCopyIn && src_buffer.space == Space::Host {
                    diags.push(Diagnostic::pageable_copy(
                        arg_spans.first().copied().unwrap_or(span),
                        &src_buffer.name,
                    ));
                }
            }
        }
    }
}
