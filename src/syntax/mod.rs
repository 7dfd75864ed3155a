//! Syntax: `.sched` text to a spanned AST.
//!
//! Takes source text; gives [`ast::File`] (owned, every node spanned) or one syntax
//! diagnostic. The grammar is `grammar/sched.pest`; the language is summarised in the
//! [`ast`] module docs.

pub mod ast;
mod parse;

pub use ast::Span;
pub use parse::{parse_expr, parse_file};
