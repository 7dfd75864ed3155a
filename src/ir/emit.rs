//! Printing a checked program: canonical text, Graphviz dot and JSON.
//!
//! Takes a program and its DAG; gives strings. The text form is canonical and stable (tasks
//! in issue order with stream, op, arguments, guard, label and reduced dependencies), so
//! snapshot tests can pin it; dot draws one cluster per stream; JSON is serde's view of
//! the program plus the edges.

use super::deps::Dag;
use super::{Access, BufferKind, Program, Slice};
use std::fmt::Write as _;

/// Bytes as a short human string (`1.5 MiB`), exact below 1 KiB.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

fn slice_text(program: &Program, slice: &Slice) -> String {
    let buffer = program.buffer(slice.buffer);
    if let Some(key) = slice.cache_key {
        return format!("{}.slot({}, {})", buffer.name, key.layer, key.expert);
    }
    if let Some(expert) = slice.dynamic_expert {
        if buffer.kind != BufferKind::Checkpoint {
            return format!("{}.expert({expert})", buffer.name);
        }
        let layer = program
            .checkpoint()
            .layer_at(slice.start)
            .unwrap_or_default();
        return format!("{}[{layer}].expert({expert})", buffer.name);
    }
    if slice.start == 0 && slice.len == buffer.bytes {
        buffer.name.clone()
    } else {
        format!("{}[{}..{}]", buffer.name, slice.start, slice.end())
    }
}

/// The canonical text form.
pub fn to_text(program: &Program, dag: &Dag) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "schedule {} \"{}\"", program.name, program.description);
    let w = program.workload;
    let _ = writeln!(
        out,
        "model {} · batch {} · prompt_len {} · gen_len {} · microbatches {}",
        program.model.name, w.batch, w.prompt_len, w.gen_len, program.micro_batches
    );
    let _ = writeln!(out, "params");
    for p in &program.params {
        let _ = writeln!(out, "  {}: {} = {}", p.name, p.ty.as_str(), p.value);
    }
    let _ = writeln!(out, "streams");
    for (i, s) in program.streams.iter().enumerate() {
        let _ = writeln!(out, "  s{i} {}: {}", s.name, s.engine.as_str());
    }
    let _ = writeln!(out, "buffers");
    for (i, b) in program.buffers.iter().enumerate() {
        let kind = match (b.kind, b.layer) {
            (BufferKind::Checkpoint, _) => " (checkpoint, read-only)".to_string(),
            (BufferKind::FormatCopy { .. }, _) => {
                " (experts in another format, made at load, read-only)".to_string()
            }
            (_, Some(l)) => format!(" of layer {l}"),
            (_, None) => String::new(),
        };
        let _ = writeln!(
            out,
            "  b{i} {}: {} {} bytes {:?}{kind}",
            b.name,
            b.space.as_str(),
            b.bytes,
            b.layout
        );
    }
    let name_width = program
        .streams
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(0);
    for step in &program.steps {
        let _ = writeln!(
            out,
            "{} {{  // tasks {}..{}",
            step.kind.as_str(),
            step.first,
            step.first + step.count
        );
        for id in step.task_ids() {
            let task = program.task(id);
            let mut line = format!(
                "  {id:<6} {:<name_width$}  {}",
                program.stream(task.stream).name,
                copy_word(task).unwrap_or_else(|| task.op.describe())
            );
            for arg in &task.args {
                let mark = match arg.access {
                    Access::Read => "",
                    Access::Write => "→",
                    Access::ReadWrite => "↔",
                };
                let _ = write!(
                    line,
                    " {}={mark}{}",
                    arg.role.as_str(),
                    slice_text(program, &arg.slice)
                );
            }
            if !task.guard.is_always() {
                let _ = write!(line, " if {}", task.guard.text(&program.caches));
            }
            if let Some(label) = &task.label {
                let _ = write!(line, " as {label}");
            }
            if let Some(head) = task.group {
                let _ = write!(line, " group={head}");
            }
            let preds = dag.preds(id);
            if !preds.is_empty() {
                let deps: Vec<String> = preds
                    .iter()
                    .map(|d| format!("{}:{}", d.from, d.kinds.describe()))
                    .collect();
                let _ = write!(line, "  <- {}", deps.join(" "));
            }
            let _ = writeln!(out, "{line}");
        }
        let _ = writeln!(out, "}}");
    }
    let _ = writeln!(
        out,
        "// {} tasks, {} edges ({} before reduction)",
        program.tasks.len(),
        dag.edges.len(),
        dag.edges_before_reduction
    );
    out
}

fn dot_escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Graphviz dot: one cluster per stream, edges styled by reason.
pub fn to_dot(program: &Program, dag: &Dag) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", dot_escape(&program.name));
    let _ = writeln!(out, "  rankdir=LR;\n  node [shape=box, fontsize=10];");
    for (s, stream) in program.streams.iter().enumerate() {
        let _ = writeln!(out, "  subgraph cluster_s{s} {{");
        let _ = writeln!(
            out,
            "    label=\"{} ({})\";",
            dot_escape(&stream.name),
            stream.engine.as_str()
        );
        for (i, task) in program.tasks.iter().enumerate() {
            if task.stream.index() != s {
                continue;
            }
            let mut label = format!("t{i} {}", task.op.describe());
            if task.op == super::Op::Copy {
                if let [src, dst] = task.args.as_slice() {
                    label = format!(
                        "t{i} {}\\n{} -> {}",
                        copy_word(task).unwrap_or_else(|| "copy".to_string()),
                        slice_text(program, &src.slice),
                        slice_text(program, &dst.slice)
                    );
                }
            }
            let style = if task.guard.is_always() {
                ""
            } else {
                ", style=dashed"
            };
            let _ = writeln!(
                out,
                "    t{i} [label=\"{}\"{style}];",
                dot_escape(&label).replace("\\\\n", "\\n")
            );
        }
        let _ = writeln!(out, "  }}");
    }
    for e in &dag.edges {
        use super::deps::DepKinds as K;
        let style = if e.kinds.has(K::RAW) {
            "color=black"
        } else if e.kinds.has(K::AFTER) {
            "color=blue"
        } else if e.kinds.has(K::WAR) || e.kinds.has(K::WAW) {
            "color=red, style=dotted"
        } else {
            "color=gray, style=dashed"
        };
        let _ = writeln!(out, "  {} -> {} [{style}];", e.from, e.to);
    }
    let _ = writeln!(out, "}}");
    out
}

/// JSON: the program (without spans) and the reduced edges.
pub fn to_json(program: &Program, dag: &Dag) -> Result<String, serde_json::Error> {
    #[derive(serde::Serialize)]
    struct View<'a> {
        program: &'a Program,
        edges: &'a [super::deps::Dep],
    }
    serde_json::to_string_pretty(&View {
        program,
        edges: &dag.edges,
    })
}

/// How a copy is named in the text and dot forms: `fetch`/`prefetch` for an expert cache,
/// `copy .context()` / `copy .appended()` for part of a KV cache, `copy rows(ub=J, B
/// B/token)` for the live rows of an activation (what the checker inferred); `None` for a
/// plain copy or any other op.
fn copy_word(task: &super::Task) -> Option<String> {
    if let Some(c) = task.cache_op {
        return Some(c.as_str().to_string());
    }
    if let Some(live) = task.live {
        let unit = match live.unit {
            super::RowUnit::Token => "token",
            super::RowUnit::Sequence => "sequence",
        };
        return Some(format!(
            "copy rows(ub={}, {} B/{unit})",
            live.ub, live.row_bytes
        ));
    }
    task.kv.map(|p| format!("copy .{}()", p.as_str()))
}
