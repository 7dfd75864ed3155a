//! Completion: the words the language accepts where the cursor is, from the compiler's
//! tables (`ir::catalog` for ops and size helpers, `elaborate::vocabulary` for functions,
//! methods, fields, symbols and words, the enums' `ALL` for engines, spaces, policies and
//! predictors) and the names the document declares. No list is copied here.
//!
//! Three places are told apart: after a `.` (a cache's methods after a cache name, an
//! engine's or hardware symbol's second half after `gpu` and friends, else a slice's
//! methods and fields), inside a string (eviction policies after `evict`, predictors
//! after `predict`), and elsewhere (everything a statement or expression may name).

use super::documents::Document;
use super::names::{declarations, DeclKind};
use super::settings::Setup;
use crate::elaborate::vocabulary;
use crate::ir::cache::{EvictPolicy, Predictor};
use crate::ir::catalog::{self, OPS};
use crate::ir::{Engine, Space};
use lsp_types::{CompletionItem, CompletionItemKind};

fn item(label: &str, kind: CompletionItemKind, detail: &str) -> CompletionItem {
    CompletionItem {
        label: label.to_string(),
        kind: Some(kind),
        detail: Some(detail.to_string()),
        ..CompletionItem::default()
    }
}

/// The completions at byte `offset` of the document.
pub fn completions(document: &Document, setup: &Setup, offset: usize) -> Vec<CompletionItem> {
    let text = &document.text;
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = &text[line_start..offset];
    // The part of the word already typed; the client filters by it.
    let typed = line
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    let before = &line[..typed];
    let declared = document
        .analysis
        .ast
        .as_ref()
        .map(declarations)
        .unwrap_or_default();
    // Inside a string: an odd number of quotes before the cursor on this line.
    if before.matches('"').count() % 2 == 1 {
        let opening = before.rfind('"').unwrap_or(0);
        let keyword = before[..opening].trim_end();
        let mut items = Vec::new();
        if !keyword.ends_with("predict") {
            items.extend(EvictPolicy::ALL.iter().map(|p| {
                item(
                    p.as_str(),
                    CompletionItemKind::ENUM_MEMBER,
                    "eviction policy",
                )
            }));
        }
        if !keyword.ends_with("evict") {
            items.extend(
                Predictor::ALL
                    .iter()
                    .map(|p| item(p.as_str(), CompletionItemKind::ENUM_MEMBER, "predictor")),
            );
        }
        return items;
    }
    if let Some(receiver_end) = before.strip_suffix('.').map(str::len) {
        let receiver_start = before[..receiver_end]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        return after_dot(&before[receiver_start..receiver_end], &declared, setup);
    }
    everywhere(&declared, setup)
}

/// After `RECEIVER.`.
fn after_dot(
    receiver: &str,
    declared: &[super::names::Decl],
    setup: &Setup,
) -> Vec<CompletionItem> {
    let is_cache = declared
        .iter()
        .any(|d| d.kind == DeclKind::Cache && d.name == receiver);
    if is_cache {
        return vocabulary::CACHE_METHODS
            .iter()
            .map(|m| item(m, CompletionItemKind::METHOD, "cache method"))
            .collect();
    }
    let prefix = format!("{receiver}.");
    let mut items: Vec<CompletionItem> = Engine::ALL
        .iter()
        .filter_map(|e| e.as_str().strip_prefix(&prefix))
        .map(|rest| item(rest, CompletionItemKind::ENUM_MEMBER, "engine"))
        .collect();
    items.extend(
        setup
            .options
            .hardware
            .keys()
            .filter_map(|name| name.strip_prefix(&prefix))
            .map(|rest| item(rest, CompletionItemKind::CONSTANT, "hardware symbol")),
    );
    let is_hardware = vocabulary::HARDWARE_PREFIXES.contains(&prefix.as_str());
    if !is_hardware && items.is_empty() {
        items.extend(
            vocabulary::SLICE_METHODS
                .iter()
                .map(|m| item(m, CompletionItemKind::METHOD, "slice method")),
        );
        // `experts` is both a method (`.experts(a, b)`) and a field: offered once.
        items.extend(
            vocabulary::FIELDS
                .iter()
                .filter(|f| !vocabulary::SLICE_METHODS.contains(f))
                .map(|f| item(f, CompletionItemKind::FIELD, "field of a layer slice")),
        );
    }
    items
}

/// Anywhere a statement or expression may start.
fn everywhere(declared: &[super::names::Decl], setup: &Setup) -> Vec<CompletionItem> {
    let mut items: Vec<CompletionItem> = OPS
        .iter()
        .filter(|d| d.form == catalog::OpForm::Call)
        .map(|d| item(d.name, CompletionItemKind::FUNCTION, d.summary))
        .collect();
    let words: [(&[&str], CompletionItemKind, &str); 5] = [
        (
            &vocabulary::FUNCTIONS,
            CompletionItemKind::FUNCTION,
            "built-in function",
        ),
        (
            &catalog::SIZE_HELPERS,
            CompletionItemKind::FUNCTION,
            "size helper",
        ),
        (
            &vocabulary::SYMBOLS,
            CompletionItemKind::CONSTANT,
            "model or workload symbol",
        ),
        (
            &vocabulary::WORDS,
            CompletionItemKind::ENUM_MEMBER,
            "op argument word",
        ),
        (
            &vocabulary::FIELDS,
            CompletionItemKind::FIELD,
            "field of a layer slice",
        ),
    ];
    for (list, kind, detail) in words {
        items.extend(list.iter().map(|w| item(w, kind, detail)));
    }
    items.extend(
        Space::ALL
            .iter()
            .map(|s| item(s.as_str(), CompletionItemKind::ENUM_MEMBER, "memory space")),
    );
    items.extend(
        Engine::ALL
            .iter()
            .map(|e| item(e.as_str(), CompletionItemKind::ENUM_MEMBER, "engine")),
    );
    items.extend(
        setup
            .options
            .hardware
            .keys()
            .map(|name| item(name, CompletionItemKind::CONSTANT, "hardware symbol")),
    );
    let mut seen = std::collections::HashSet::new();
    for decl in declared {
        if !seen.insert((decl.kind, decl.name.as_str())) {
            continue;
        }
        let kind = match decl.kind {
            DeclKind::Template => CompletionItemKind::FUNCTION,
            DeclKind::Param | DeclKind::Let => CompletionItemKind::VARIABLE,
            DeclKind::Buffer | DeclKind::Cache => CompletionItemKind::STRUCT,
            DeclKind::Stream => CompletionItemKind::MODULE,
            DeclKind::Label => CompletionItemKind::REFERENCE,
        };
        items.push(item(&decl.name, kind, decl.kind.as_str()));
    }
    items
}
