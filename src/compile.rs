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

/// IR to a checked program. The copies the checker proved may move only the rows of
/// the step's tokens ([`ScheduleInfo::live_rows`]) say so in the IR (`Task::live`) and
/// count those rows at the declared shape, as `.context()` / `.appended()` copies do, so
/// the cost model and every report see the bytes the runtime moves.
pub fn ir_to_checked(
    mut program: Program,
    mut warnings: Vec<Diagnostic>,
) -> Result<Compiled, Vec<Diagnostic>> {
    match check::check(&program) {
        Ok(mut info) => {
            warnings.append(&mut info.warnings);
            info.warnings = check::dedupe(warnings);
            mark_live_copies(&mut program, &info);
            Ok(Compiled { program, info })
        }
        Err(mut diags) => {
            diags.extend(warnings);
            Err(check::dedupe(diags))
        }
    }
}

/// Sets `Task::live` and trims `work.copy.bytes` to the live rows at the task's declared
/// shape (the worst case of the step: every token of a full micro-batch).
fn mark_live_copies(program: &mut Program, info: &ScheduleInfo) {
    for (task, rows) in program.tasks.iter_mut().zip(&info.live_rows) {
        let (Some(rows), Some(copy)) = (rows, task.work.copy.as_mut()) else {
            continue;
        };
        task.live = Some(*rows);
        copy.bytes = copy
            .bytes
            .min(rows.bytes(task.shape.tokens, task.shape.seqs));
    }
}

/// Compiles a schedule from source text to a checked program.
pub fn compile(source: &str, options: &Options) -> Result<Compiled, Vec<Diagnostic>> {
    let file = source_to_ast(source)?;
    let (program, warnings) = ast_to_ir(&file, options)?;
    ir_to_checked(program, warnings)
}
