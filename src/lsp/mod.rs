//! `moec lsp`: a language server for `.sched` files over stdio.
//!
//! Takes JSON-RPC messages (the Language Server Protocol) and the card loader of the CLI;
//! gives diagnostics as the user types (the same pipeline as `moec check`: parse ->
//! elaborate -> check -> memory budgets), hovers with a buffer's, cache's or task label's
//! bytes and space for the chosen card and hardware and an op's table entry, go to
//! definition of templates, labels, buffers and every other declared name, and completion
//! of ops, functions, methods, fields, symbols, engines, spaces, policies and predictors.
//! The card and hardware come from the client's `initializationOptions`
//! ([`settings::Settings`]).
//!
//! - `protocol`: the message loop, framing and dispatch (never panics on bad input).
//! - `documents`: open documents and the pipeline's result on each.
//! - `positions`: byte offsets to LSP positions (UTF-16 columns) and back.
//! - `names`: the declarations of a syntax tree, the word under the cursor.
//! - `hover`, `definition`, `completion`: the features.
//! - `settings`: `initializationOptions` to compiler options.

pub mod completion;
pub mod definition;
pub mod documents;
pub mod hover;
pub mod names;
pub mod positions;
pub mod protocol;
pub mod settings;

pub use protocol::{serve, Ending};
pub use settings::{CardLoader, Settings};
