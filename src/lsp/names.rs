//! The names a document declares, read from its syntax tree, and the word under the cursor.
//!
//! Templates, params, streams, buffers, caches and lets are declared once (elaboration
//! rejects a second); a label (`as load[i]`) is declared by every task statement that
//! writes it, so a label has as many declarations as such statements.

use crate::span::Span;
use crate::syntax::ast::{self, Item, Stmt};

/// What a declared name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeclKind {
    /// `param`.
    Param,
    /// `stream`.
    Stream,
    /// `buffer`.
    Buffer,
    /// `cache`.
    Cache,
    /// `template`.
    Template,
    /// `let` (top level or in a block).
    Let,
    /// `as LABEL` on a task.
    Label,
}

impl DeclKind {
    /// As a user says it.
    pub fn as_str(self) -> &'static str {
        match self {
            DeclKind::Param => "param",
            DeclKind::Stream => "stream",
            DeclKind::Buffer => "buffer",
            DeclKind::Cache => "cache",
            DeclKind::Template => "template",
            DeclKind::Let => "let",
            DeclKind::Label => "label",
        }
    }
}

/// One declaration of a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decl {
    /// The name.
    pub name: String,
    /// What it declares.
    pub kind: DeclKind,
    /// Where the name is written in the declaration.
    pub name_span: Span,
    /// The whole declaration (for a label: its task statement).
    pub span: Span,
}

/// Every declaration of a file, in source order.
pub fn declarations(file: &ast::File) -> Vec<Decl> {
    let mut decls = Vec::new();
    let push = |decls: &mut Vec<Decl>, kind, name: &ast::Ident, span| {
        decls.push(Decl {
            name: name.name.clone(),
            kind,
            name_span: name.span,
            span,
        })
    };
    let mut blocks: Vec<&ast::Block> = Vec::new();
    for item in &file.items {
        match item {
            Item::Param(p) => push(&mut decls, DeclKind::Param, &p.name, p.span),
            Item::Stream(s) => push(&mut decls, DeclKind::Stream, &s.name, s.span),
            Item::Buffer(b) => push(&mut decls, DeclKind::Buffer, &b.name, b.span),
            Item::Cache(c) => push(&mut decls, DeclKind::Cache, &c.name, c.span),
            Item::Template(t) => {
                push(&mut decls, DeclKind::Template, &t.name, t.span);
                blocks.push(&t.body);
            }
            Item::Step(s) => blocks.push(&s.body),
            Item::Let(l) => push(&mut decls, DeclKind::Let, &l.name, l.span),
            Item::MicroBatches(_) | Item::Substitute(_) => {}
        }
    }
    // Nested blocks with a work list, not recursion: nesting depth is the user's.
    while let Some(block) = blocks.pop() {
        for stmt in &block.stmts {
            let (tail, span) = match stmt {
                Stmt::Let(l) => {
                    push(&mut decls, DeclKind::Let, &l.name, l.span);
                    continue;
                }
                Stmt::For(f) => {
                    blocks.push(&f.body);
                    continue;
                }
                Stmt::If(i) => {
                    blocks.extend(i.branches.iter().map(|b| &b.block));
                    blocks.extend(i.otherwise.iter());
                    continue;
                }
                Stmt::Sync(_) => continue,
                Stmt::Copy(c) => (&c.tail, c.span),
                Stmt::Call(c) => (&c.tail, c.span),
            };
            if let Some(label) = &tail.label {
                push(&mut decls, DeclKind::Label, &label.name, span);
            }
        }
    }
    decls.sort_by_key(|d| d.name_span.start);
    decls
}

/// An identifier in the text: its span and text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Word<'a> {
    /// Where it is.
    pub span: Span,
    /// The identifier.
    pub text: &'a str,
    /// With a neighbour joined by a dot when there is one (`gpu.compute`, `lat.gpu`):
    /// engines and hardware symbols are written so.
    pub dotted: Option<&'a str>,
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifier at (or just before) byte `offset` of `text`.
pub fn word_at(text: &str, offset: usize) -> Option<Word<'_>> {
    let offset = offset.min(text.len());
    if !text.is_char_boundary(offset) {
        return None;
    }
    let start = text[..offset]
        .rfind(|c: char| !is_ident(c))
        .map_or(0, |i| i + 1);
    let end = text[offset..]
        .find(|c: char| !is_ident(c))
        .map_or(text.len(), |i| offset + i);
    if start == end {
        return None;
    }
    // Joined to the identifier before a leading dot, or after a trailing one.
    let dotted = if start > 0 && text[..start].ends_with('.') {
        let before = text[..start - 1]
            .rfind(|c: char| !is_ident(c))
            .map_or(0, |i| i + 1);
        (before < start - 1).then(|| &text[before..end])
    } else if text[end..].starts_with('.') {
        let after = text[end + 1..]
            .find(|c: char| !is_ident(c))
            .map_or(text.len(), |i| end + 1 + i);
        (after > end + 1).then(|| &text[start..after])
    } else {
        None
    };
    Some(Word {
        span: Span::new(start, end),
        text: &text[start..end],
        dotted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_dotted_names_around_the_cursor() {
        let text = "stream h2d: gpu.copy_in\nx";
        let at = |needle: &str| text.find(needle).unwrap();
        let w = word_at(text, at("h2d") + 1).unwrap();
        assert_eq!((w.text, w.dotted), ("h2d", None));
        let w = word_at(text, at("copy_in") + 2).unwrap();
        assert_eq!((w.text, w.dotted), ("copy_in", Some("gpu.copy_in")));
        let w = word_at(text, at("gpu")).unwrap();
        assert_eq!((w.text, w.dotted), ("gpu", Some("gpu.copy_in")));
        // Just after a word still names it; after punctuation, nothing does.
        assert_eq!(word_at(text, at("h2d") + 3).unwrap().text, "h2d");
        assert_eq!(word_at(text, at(": ") + 1), None);
        assert_eq!(word_at(text, text.len()).unwrap().text, "x");
    }
}
