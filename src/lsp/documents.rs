//! The open documents and what the compiler made of each.
//!
//! Every change re-runs `moec check`'s pipeline on the whole text (parse -> elaborate ->
//! check, then the memory budgets when a hardware profile is set): a schedule is one
//! file and small, so incremental work would buy little. A document keeps the syntax
//! tree of its current text (for definitions and completion) and the last elaborated
//! program (for sizes in hovers), which may come from an earlier version while the user
//! is in the middle of an edit; hovers then say so.

use super::positions::LineIndex;
use super::settings::Setup;
use crate::compile;
use crate::cost::budget::{check_budget, BudgetOverrides};
use crate::diag::Diagnostic;
use crate::ir::Program;
use crate::syntax::ast;
use lsp_types::Uri;
use std::collections::HashMap;

/// What one run of the pipeline gave.
#[derive(Debug, Clone, Default)]
pub struct Analysis {
    /// The syntax tree, when the text parses.
    pub ast: Option<ast::File>,
    /// Every diagnostic, errors and warnings, as `moec check` reports them.
    pub diagnostics: Vec<Diagnostic>,
    /// The budget check's finding when the program is over a memory budget.
    pub over_budget: Option<String>,
}

/// Runs `moec check`'s pipeline on `text`; gives the analysis and the elaborated program,
/// when elaboration succeeded (checked or not).
pub fn analyse(text: &str, setup: &Setup) -> (Analysis, Option<Program>) {
    let file = match compile::source_to_ast(text) {
        Ok(file) => file,
        Err(diagnostics) => {
            let analysis = Analysis {
                diagnostics,
                ..Analysis::default()
            };
            return (analysis, None);
        }
    };
    let (program, warnings) = match compile::ast_to_ir(&file, &setup.options) {
        Ok(elaborated) => elaborated,
        Err(diagnostics) => {
            let analysis = Analysis {
                ast: Some(file),
                diagnostics,
                ..Analysis::default()
            };
            return (analysis, None);
        }
    };
    // The checker consumes the program; a copy stays for hovers when it is rejected.
    match compile::ir_to_checked(program.clone(), warnings) {
        Ok(compiled) => {
            let over_budget = setup.hardware.as_ref().and_then(|profile| {
                check_budget(
                    &compiled.program,
                    Some(profile),
                    &BudgetOverrides::default(),
                )
                .err()
                .map(|over| over.to_string())
            });
            let analysis = Analysis {
                ast: Some(file),
                diagnostics: compiled.info.warnings,
                over_budget,
            };
            (analysis, Some(compiled.program))
        }
        Err(diagnostics) => {
            let analysis = Analysis {
                ast: Some(file),
                diagnostics,
                over_budget: None,
            };
            (analysis, Some(program))
        }
    }
}

/// One open document.
#[derive(Debug, Clone)]
pub struct Document {
    /// The client's version of the text.
    pub version: i32,
    /// The full text.
    pub text: String,
    /// Its line starts.
    pub index: LineIndex,
    /// The pipeline's result on this text.
    pub analysis: Analysis,
    /// The last elaborated program and the version it came from (this one or older).
    pub program: Option<(Program, i32)>,
}

impl Document {
    /// The last elaborated program, and whether it is older than the current text.
    pub fn program(&self) -> Option<(&Program, bool)> {
        self.program
            .as_ref()
            .map(|(program, version)| (program, *version != self.version))
    }
}

/// The open documents by URI.
#[derive(Debug, Default)]
pub struct Documents {
    open: HashMap<Uri, Document>,
}

impl Documents {
    /// Opens a document or replaces its text, and analyses it.
    pub fn set(&mut self, uri: Uri, version: i32, text: String, setup: &Setup) -> &Document {
        let (analysis, program) = analyse(&text, setup);
        let previous = self.open.remove(&uri).and_then(|d| d.program);
        let program = program.map(|p| (p, version)).or(previous);
        let document = Document {
            version,
            index: LineIndex::new(&text),
            text,
            analysis,
            program,
        };
        self.open.entry(uri).or_insert(document)
    }

    /// The document at `uri`, if open.
    pub fn get(&self, uri: &Uri) -> Option<&Document> {
        self.open.get(uri)
    }

    /// Closes a document; false if it was not open.
    pub fn close(&mut self, uri: &Uri) -> bool {
        self.open.remove(uri).is_some()
    }
}
