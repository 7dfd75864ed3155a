//! `moec lsp`: the language server, on stdin and stdout (see `crate::lsp`).

use std::process::ExitCode;

/// Arguments of `moec lsp` (none: the card and hardware come from the client's
/// `initializationOptions`).
#[derive(Debug, Clone, clap::Args)]
pub struct LspArgs {}

/// Runs the server until the client says `exit`: exit 0 after `shutdown`, else 1.
pub fn run(_args: &LspArgs) -> ExitCode {
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut output = std::io::stdout().lock();
    let mut log = std::io::stderr().lock();
    match crate::lsp::serve(
        &mut input,
        &mut output,
        &mut log,
        super::inputs::planning_card,
    ) {
        Ok(crate::lsp::Ending::Clean) => ExitCode::SUCCESS,
        Ok(crate::lsp::Ending::Abrupt) => ExitCode::from(1),
        Err(e) => {
            eprintln!("moec lsp: {e}");
            ExitCode::from(1)
        }
    }
}
