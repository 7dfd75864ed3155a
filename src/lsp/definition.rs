//! Go to definition: a template, buffer, cache, stream, param or let goes to its
//! declaration; a label to every task statement that declares it (`as load[i]`).

use super::documents::Document;
use super::names::{declarations, word_at};
use crate::span::Span;

/// The spans of the declarations of the name at byte `offset` (empty: not a declared name).
pub fn definitions(document: &Document, offset: usize) -> Vec<Span> {
    let (Some(word), Some(file)) = (
        word_at(&document.text, offset),
        document.analysis.ast.as_ref(),
    ) else {
        return Vec::new();
    };
    declarations(file)
        .into_iter()
        .filter(|d| d.name == word.text)
        .map(|d| d.name_span)
        .collect()
}
