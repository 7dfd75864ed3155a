//! The IR's leaf enums that the front end also names: a step template's kind and a
//! param's declared type.
//!
//! Takes nothing; gives [`StepKind`] and [`ParamType`]. They live in `ir` (not in the
//! parser's AST) so that lowering, the runtime and the cost model name them without
//! importing `syntax`.

/// The declared type of a param.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ParamType {
    /// 64-bit signed integer.
    Int,
    /// 64-bit float.
    Float,
    /// `true` / `false`.
    Bool,
}

impl ParamType {
    /// The keyword as written.
    pub fn as_str(self) -> &'static str {
        match self {
            ParamType::Int => "int",
            ParamType::Float => "float",
            ParamType::Bool => "bool",
        }
    }
}

/// Which step a step template describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum StepKind {
    /// Runs once before everything else (resident weights, tables).
    Setup,
    /// Runs once over the prompts.
    Prefill,
    /// Runs once per generated token.
    Decode,
    /// One mixed prefill+decode step, repeated (VSLPipe).
    Mixed,
}

impl StepKind {
    /// The keyword as written.
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Setup => "setup",
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
            StepKind::Mixed => "step",
        }
    }
}
