//! Hover: what a name under the cursor is, with its bytes for the chosen card and
//! hardware when it is a buffer, cache or task label, and the op table's entry for an op.
//!
//! Every description comes from the compiler's own tables: the elaborated program for
//! sizes, spaces and streams, `ir::catalog` for ops, `elaborate::vocabulary` and the
//! enums' `ALL` for the language's words.

use super::documents::Document;
use super::names::{declarations, word_at, DeclKind};
use super::settings::Setup;
use crate::elaborate::vocabulary;
use crate::ir::cache::{EvictPolicy, Predictor};
use crate::ir::catalog::{self, OpDef};
use crate::ir::emit::human_bytes;
use crate::ir::{Access, BufferKind, Engine, Program, Space};
use crate::span::Span;

/// The hover text (Markdown) for the word at byte `offset`, and the word's span.
pub fn hover(document: &Document, setup: &Setup, offset: usize) -> Option<(String, Span)> {
    let word = word_at(&document.text, offset)?;
    let program = document.program();
    // Sizes are the last elaborated program's; say so when the text changed since.
    let origin = match program {
        Some((_, true)) => format!(
            "\n\n_{}; sizes from the last version that elaborated_",
            setup.describe()
        ),
        _ => format!("\n\n_{}_", setup.describe()),
    };
    let declared = document
        .analysis
        .ast
        .as_ref()
        .map(declarations)
        .unwrap_or_default();
    let kind = declared
        .iter()
        .find(|d| d.name == word.text)
        .map(|d| d.kind);
    let program = program.map(|(p, _)| p);
    // An engine or hardware symbol (`gpu.compute`, `gpu.mem`) before a stream named `gpu`.
    if let Some(text) = word.dotted.and_then(builtin_text) {
        return Some((text, word.span));
    }
    let text = match (kind, program) {
        (Some(DeclKind::Buffer), Some(p)) => buffer_text(p, word.text)? + &origin,
        (Some(DeclKind::Cache), Some(p)) => cache_text(p, word.text)? + &origin,
        (Some(DeclKind::Label), Some(p)) => label_text(p, word.text)? + &origin,
        (Some(DeclKind::Stream), Some(p)) => {
            let stream = p.streams.iter().find(|s| s.name == word.text)?;
            format!(
                "**stream** `{}` on `{}`",
                stream.name,
                stream.engine.as_str()
            )
        }
        (Some(DeclKind::Param), Some(p)) => {
            let param = p.params.iter().find(|q| q.name == word.text)?;
            let doc = param
                .doc
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default();
            format!(
                "**param** `{}`: {} = {} (default {}){doc}",
                param.name,
                param.ty.as_str(),
                param.value,
                param.default
            ) + &origin
        }
        (Some(kind), program) => {
            let decl = declared.iter().find(|d| d.name == word.text)?;
            let line = first_line(&document.text, decl.span);
            let sized = matches!(
                kind,
                DeclKind::Buffer | DeclKind::Cache | DeclKind::Label | DeclKind::Param
            );
            // Said rather than left out: sizes need a program that elaborated.
            let missing = if sized && program.is_none() {
                "\n\nno sizes: no version of this file has elaborated yet (see its diagnostics)"
            } else {
                ""
            };
            format!(
                "**{}** `{}`\n\n```sched\n{line}\n```{missing}",
                kind.as_str(),
                word.text
            )
        }
        (None, Some(p)) if word.text == "W" => buffer_text(p, "W")? + &origin,
        (None, _) => builtin_text(word.text)?,
    };
    Some((text, word.span))
}

/// The first line of a declaration, for hovers on names without sizes.
fn first_line(text: &str, span: Span) -> &str {
    let start = (span.start as usize).min(text.len());
    let end = (span.end as usize).clamp(start, text.len());
    text.get(start..end)
        .and_then(|s| s.lines().next())
        .unwrap_or("")
}

/// Bytes as `1.50 MiB (1572864 bytes)`.
fn bytes_text(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{} ({bytes} bytes)", human_bytes(bytes))
    }
}

/// A buffer array: its elements' shape, space and sizes.
fn buffer_text(program: &Program, name: &str) -> Option<String> {
    let elements: Vec<_> = program.buffers.iter().filter(|b| b.array == name).collect();
    let first = elements.first()?;
    let rank = first.index.len();
    let mut shape = vec![0u32; rank];
    for element in &elements {
        for (d, i) in element.index.iter().enumerate().take(rank) {
            shape[d] = shape[d].max(i + 1);
        }
    }
    let dims: String = shape.iter().map(|n| format!("[{n}]")).collect();
    let total: u64 = elements.iter().map(|b| b.bytes).sum();
    let (min, max) = elements.iter().fold((u64::MAX, 0), |(lo, hi), b| {
        (lo.min(b.bytes), hi.max(b.bytes))
    });
    let what = if first.kind == BufferKind::Checkpoint {
        "checkpoint"
    } else {
        "buffer"
    };
    let space = first.space.as_str();
    let sizes = if elements.len() == 1 {
        bytes_text(total)
    } else if min == max {
        format!(
            "{} buffers of {} each, {} in all",
            elements.len(),
            bytes_text(min),
            human_bytes(total)
        )
    } else {
        format!(
            "{} buffers of {} to {}, {} in all",
            elements.len(),
            bytes_text(min),
            bytes_text(max),
            human_bytes(total)
        )
    };
    Some(format!("**{what}** `{name}{dims}` in `{space}`: {sizes}"))
}

/// An expert cache: slots, space, bytes, policy and predictor.
fn cache_text(program: &Program, name: &str) -> Option<String> {
    let cache = program.caches.iter().find(|c| c.name == name)?;
    let buffer = program.buffers.get(cache.buffer.index())?;
    Some(format!(
        "**cache** `{name}` in `{}`: {} slots, {}; evict `{}`, predict `{}`",
        buffer.space.as_str(),
        cache.slots,
        bytes_text(buffer.bytes),
        cache.policy.as_str(),
        cache.predictor.as_str()
    ))
}

/// A task label: how many tasks carry it, their ops and streams, and a copy's bytes.
fn label_text(program: &Program, name: &str) -> Option<String> {
    let tasks: Vec<_> = program
        .tasks
        .iter()
        .filter(|t| {
            t.label.as_deref().is_some_and(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('['))
            })
        })
        .collect();
    if tasks.is_empty() {
        return Some(format!(
            "**label** `{name}`: no task of the elaborated program carries it"
        ));
    }
    let mut ops: Vec<&str> = tasks.iter().map(|t| t.op.def().name).collect();
    ops.sort_unstable();
    ops.dedup();
    let mut streams: Vec<&str> = tasks
        .iter()
        .filter_map(|t| program.streams.get(t.stream.index()))
        .map(|s| s.name.as_str())
        .collect();
    streams.sort_unstable();
    streams.dedup();
    let mut text = format!(
        "**label** `{name}`: {} task(s), {} on {}",
        tasks.len(),
        ops.join(", "),
        streams.join(", ")
    );
    let copies: Vec<_> = tasks.iter().filter_map(|t| t.work.copy.as_ref()).collect();
    if let Some(first) = copies.first() {
        let (min, max) = copies.iter().fold((u64::MAX, 0), |(lo, hi), c| {
            (lo.min(c.bytes), hi.max(c.bytes))
        });
        let each = if min == max {
            bytes_text(min)
        } else {
            format!("{} to {}", bytes_text(min), bytes_text(max))
        };
        text.push_str(&format!(
            "; each copy moves {each} `{}` -> `{}`",
            first.src.as_str(),
            first.dst.as_str()
        ));
    }
    Some(text)
}

/// An op's table entry: summary, static parameters, buffer arguments, engines.
fn op_text(def: &OpDef) -> String {
    let mut text = format!("**op** `{}`: {}", def.name, def.summary);
    if !def.params.is_empty() {
        text.push_str("\n\nparameters:");
        for p in def.params {
            text.push_str(&format!("\n- `{}`: {}", p.name(), p.syntax()));
        }
    }
    if !def.args.is_empty() {
        text.push_str("\n\narguments:");
        for a in def.args {
            let optional = if a.optional { ", optional" } else { "" };
            let list = if a.list { ", a list" } else { "" };
            let access = match a.access {
                Access::Read => "read",
                Access::Write => "written",
                Access::ReadWrite => "read and written",
            };
            text.push_str(&format!(
                "\n- `{}`: {:?}, {access}{optional}{list}",
                a.role.as_str(),
                a.ty,
            ));
        }
    }
    let engines: Vec<String> = def
        .engines
        .iter()
        .map(|e| format!("`{}`", e.as_str()))
        .collect();
    text.push_str(&format!("\n\nruns on {}", engines.join(", ")));
    text
}

/// A word of the language: op, function, method, field, symbol, engine, space, ...
fn builtin_text(word: &str) -> Option<String> {
    if let Some(def) = catalog::op_by_name(word) {
        return Some(op_text(def));
    }
    if let Some(engine) = Engine::parse(word) {
        let runs = if engine.is_compute() {
            "compute ops"
        } else {
            "copies"
        };
        return Some(format!(
            "**engine** `{word}`: a stream kind that runs {runs}"
        ));
    }
    if Space::parse(word).is_some() {
        return Some(format!("**memory space** `{word}`"));
    }
    let kinds: [(&[&str], &str); 7] = [
        (&vocabulary::FUNCTIONS, "built-in function"),
        (&catalog::SIZE_HELPERS, "size helper (bytes for the card)"),
        (&vocabulary::SLICE_METHODS, "slice method"),
        (&vocabulary::CACHE_METHODS, "cache method"),
        (&vocabulary::FIELDS, "field of a layer slice of `W`"),
        (&vocabulary::SYMBOLS, "model or workload symbol"),
        (&vocabulary::WORDS, "word an op argument takes"),
    ];
    for (words, kind) in kinds {
        if words.contains(&word) {
            return Some(format!("**{kind}** `{word}`"));
        }
    }
    if EvictPolicy::ALL.iter().any(|p| p.as_str() == word) {
        return Some(format!("**eviction policy** `\"{word}\"`"));
    }
    if Predictor::ALL.iter().any(|p| p.as_str() == word) {
        return Some(format!("**predictor** `\"{word}\"`"));
    }
    if vocabulary::HARDWARE_PREFIXES
        .iter()
        .any(|p| word.starts_with(p))
    {
        return Some(format!(
            "**hardware symbol** `{word}` (from the hardware profile, `hw`)"
        ));
    }
    None
}
