//! The compiler front to back: text -> AST -> IR -> checked program.
//!
//! Takes source text and [`Options`]; gives a [`Compiled`] program (IR, [`ScheduleInfo`],
//! warnings) or every diagnostic found. One function per hop (prqlc style); `compile` only
//! chains them.

use crate::check::{self, ScheduleInfo};
use crate::diag::Diagnostic;
use crate::elaborate;
use crate::ir::Program;
use crate::syntax::{self, ast};

pub use crate::elaborate::Options;

/// A checked program.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The elaborated IR.
    pub program: Program,
    /// What checking proved (the DAG, weight locations, warnings).
    pub info: ScheduleInfo,
}

impl Compiled {
    /// Warnings from every stage.
    pub fn warnings(&self) -> &[Diagnostic] {
        &self.info.warnings
    }
}

/// Text to AST.
pub fn source_to_ast(source: &str) -> Result<ast::File, Vec<Diagnostic>> {
    syntax::parse_file(source).map_err(|d| vec![d])
}

/// AST to IR (with elaboration warnings).
pub fn ast_to_ir(
    file: &ast::File,
    options: &Options,
) -> Result<(Program, Vec<Diagnostic>), Vec<Diagnostic>> {
    elaborate::elaborate(file, options)
}

/// IR to a checked program.
pub fn ir_to_checked(
    program: Program,
    mut warnings: Vec<Diagnostic>,
) -> Result<Compiled, Vec<Diagnostic>> {
    match check::check(&program) {
        Ok(mut info) => {
            warnings.append(&mut info.warnings);
            info.warnings = check::dedupe(warnings);
            Ok(Compiled { program, info })
        }
        Err(mut diags) => {
            diags.extend(warnings);
            Err(check::dedupe(diags))
        }
    }
}

/// Compiles a schedule from source text to a checked program.
pub fn compile(source: &str, options: &Options) -> Result<Compiled, Vec<Diagnostic>> {
    let file = source_to_ast(source)?;
    let (program, warnings) = ast_to_ir(&file, options)?;
    ir_to_checked(program, warnings)
}
