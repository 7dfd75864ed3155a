//! moec: a compiler and runtime for mixture-of-experts CPU/GPU offload schedules.
//!
//! The crate is organised as a pipeline of stages, each handing the next a plain data
//! type (see `ARCHITECTURE.md`): `syntax` (text -> AST), `elaborate` (AST -> IR),
//! `check` (IR -> `ScheduleInfo`), `cost` (HRM, simulator, planner), `lower`
//! (checked IR -> execution plan) and `runtime` (plan -> real inference); `engine` is the
//! run API that chains them for a model and a backend. `model` holds
//! the model cards, checkpoints, tokenizers, kernels and the reference forward pass; it
//! knows nothing of the schedule language.

pub mod check;
pub mod cli;
pub mod compile;
pub mod convert;
pub mod cost;
pub mod diag;
pub mod elaborate;
pub mod engine;
pub mod ir;
pub mod lower;
pub mod lsp;
pub mod math;
pub mod model;
pub mod oracle;
pub mod quant;
pub mod records;
pub mod rng;
pub mod runtime;
pub mod serve;
pub mod span;
pub mod syntax;
pub mod sysmem;
pub mod tempfiles;
pub mod textfile;
pub mod weights;
