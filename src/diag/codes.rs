//! Diagnostic codes, grouped by the stage that reports them.

use super::Severity;

/// Every diagnostic code. `as_str` gives the stable `stage::name` shown to users.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Code {
    /// Unexpected token or end of file.
    SyntaxUnexpected,
    /// A number literal out of range.
    SyntaxBadLiteral,
    /// Input nested too deeply (or too large).
    SyntaxTooDeep,
    /// Unknown name (variable, buffer, stream, op, function, engine, space, symbol).
    ElabUnknownName,
    /// A name or label declared twice.
    ElabDuplicate,
    /// A value of the wrong type.
    ElabType,
    /// An index, page, layer, ub or expert out of range.
    ElabOutOfRange,
    /// A param default or `--set` value out of range or of the wrong type.
    ElabParamValue,
    /// `--set` for an undeclared param.
    ElabUnknownParam,
    /// Division by zero, overflow.
    ElabArithmetic,
    /// Unknown, missing, duplicate or positional op arguments; wrong arity.
    ElabArgument,
    /// A task without a stream, or a template call with a task tail.
    ElabStream,
    /// A recursive template.
    ElabTemplate,
    /// Unrolling limit exceeded.
    ElabLimit,
    /// A run-time value where a compile-time one is needed.
    ElabDynamic,
    /// `after` naming a missing or later task.
    ElabAfter,
    /// No `microbatches` declaration.
    ElabMicroBatches,
    /// An argument in a space the engine cannot access.
    StructEngineSpace,
    /// An op on the wrong kind of stream.
    StructOpEngine,
    /// Copy between slices of different lengths.
    StructCopySize,
    /// An argument smaller than the op needs.
    StructTooSmall,
    /// A write to the checkpoint.
    StructReadOnly,
    /// No step template.
    StructNoSteps,
    /// A written argument overlapping another argument of the same task.
    StructOverlap,
    /// An argument holds the wrong tensor.
    ValuesWrong,
    /// An argument read before any write.
    ValuesUninitialized,
    /// An argument whose writer may be skipped at run time.
    ValuesGuarded,
    /// Experts not computed exactly once per layer and micro-batch.
    ValuesExpertCoverage,
    /// A guard reads routing that no gate ordered before its task has produced.
    ValuesRoutingUnknown,
    /// The right tensor, but from another step run than the one the reader needs.
    ValuesStale,
    /// A step run that leaves a micro-batch without a token, or samples it twice.
    ValuesSampling,
    /// An expert computation that may be skipped while its expert receives tokens.
    ValuesExpertGuard,
    /// A write over an expert accumulator that destroys expert outputs `combine` needs.
    ValuesLostOutput,
    /// A task computes with a lossy copy of a weight (`W[l].expert(e).format(q4_k)`) that
    /// no `substitute` declaration allows.
    ValuesUndeclaredSubstitute,
    /// A read of an expert cache slot with no `fetch` of that expert before it in the step,
    /// or one that may run when the fetch was skipped.
    CacheUnfetched,
    /// More fetched experts can be held at once than the cache has slots: a fetch could
    /// wait forever for a free slot.
    CacheDeadlock,
    /// A prefetch of a `lookahead` cache's prediction with no `pregate` of that layer
    /// ordered before it: the prediction would be read before it is written.
    CacheUnpredicted,
    /// A `CACHE.resident(..)` guard that a fetch or prefetch into the cache can change
    /// between the tasks that decide it.
    CacheStaleGuard,
    /// A buffer never used (warning).
    LintUnusedBuffer,
    /// A stream never used (warning).
    LintUnusedStream,
    /// A param never read (warning).
    LintUnusedParam,
    /// A single buffer reused across streams serialises them (warning).
    LintFalseDependency,
    /// A pageable -> GPU copy (warning).
    LintPageableCopy,
    /// `gpu_scratch(..)` compiled without a backend's scratch rules: the op catalog's
    /// bound stands in (warning).
    LintCatalogScratch,
}

impl Code {
    /// Every code, in documentation order.
    pub const ALL: [Code; 44] = [
        Code::SyntaxUnexpected,
        Code::SyntaxBadLiteral,
        Code::SyntaxTooDeep,
        Code::ElabUnknownName,
        Code::ElabDuplicate,
        Code::ElabType,
        Code::ElabOutOfRange,
        Code::ElabParamValue,
        Code::ElabUnknownParam,
        Code::ElabArithmetic,
        Code::ElabArgument,
        Code::ElabStream,
        Code::ElabTemplate,
        Code::ElabLimit,
        Code::ElabDynamic,
        Code::ElabAfter,
        Code::ElabMicroBatches,
        Code::StructEngineSpace,
        Code::StructOpEngine,
        Code::StructCopySize,
        Code::StructTooSmall,
        Code::StructReadOnly,
        Code::StructNoSteps,
        Code::StructOverlap,
        Code::ValuesWrong,
        Code::ValuesUninitialized,
        Code::ValuesGuarded,
        Code::ValuesExpertCoverage,
        Code::ValuesRoutingUnknown,
        Code::ValuesStale,
        Code::ValuesSampling,
        Code::ValuesExpertGuard,
        Code::ValuesLostOutput,
        Code::ValuesUndeclaredSubstitute,
        Code::CacheUnfetched,
        Code::CacheDeadlock,
        Code::CacheUnpredicted,
        Code::CacheStaleGuard,
        Code::LintUnusedBuffer,
        Code::LintUnusedStream,
        Code::LintUnusedParam,
        Code::LintFalseDependency,
        Code::LintPageableCopy,
        Code::LintCatalogScratch,
    ];

    /// The stable name shown to users.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::SyntaxUnexpected => "syntax::unexpected",
            Code::SyntaxBadLiteral => "syntax::bad_literal",
            Code::SyntaxTooDeep => "syntax::too_deep",
            Code::ElabUnknownName => "elab::unknown_name",
            Code::ElabDuplicate => "elab::duplicate",
            Code::ElabType => "elab::type",
            Code::ElabOutOfRange => "elab::out_of_range",
            Code::ElabParamValue => "elab::param_value",
            Code::ElabUnknownParam => "elab::unknown_param",
            Code::ElabArithmetic => "elab::arithmetic",
            Code::ElabArgument => "elab::argument",
            Code::ElabStream => "elab::stream",
            Code::ElabTemplate => "elab::template",
            Code::ElabLimit => "elab::limit",
            Code::ElabDynamic => "elab::dynamic",
            Code::ElabAfter => "elab::after",
            Code::ElabMicroBatches => "elab::microbatches",
            Code::StructEngineSpace => "structure::engine_space",
            Code::StructOpEngine => "structure::op_engine",
            Code::StructCopySize => "structure::copy_size",
            Code::StructTooSmall => "structure::too_small",
            Code::StructReadOnly => "structure::read_only",
            Code::StructNoSteps => "structure::no_steps",
            Code::StructOverlap => "structure::overlap",
            Code::ValuesWrong => "values::wrong",
            Code::ValuesUninitialized => "values::uninitialized",
            Code::ValuesGuarded => "values::guarded",
            Code::ValuesExpertCoverage => "values::expert_coverage",
            Code::ValuesRoutingUnknown => "values::routing_unknown",
            Code::ValuesStale => "values::stale",
            Code::ValuesSampling => "values::sampling",
            Code::ValuesExpertGuard => "values::expert_guard",
            Code::ValuesLostOutput => "values::lost_output",
            Code::ValuesUndeclaredSubstitute => "values::undeclared_substitute",
            Code::CacheUnfetched => "cache::unfetched",
            Code::CacheDeadlock => "cache::deadlock",
            Code::CacheUnpredicted => "cache::unpredicted",
            Code::CacheStaleGuard => "cache::stale_guard",
            Code::LintUnusedBuffer => "lint::unused_buffer",
            Code::LintUnusedStream => "lint::unused_stream",
            Code::LintUnusedParam => "lint::unused_param",
            Code::LintFalseDependency => "lint::false_dependency",
            Code::LintPageableCopy => "lint::pageable_copy",
            Code::LintCatalogScratch => "lint::catalog_scratch",
        }
    }

    /// Whether the code is an error or a warning by default.
    pub fn default_severity(self) -> Severity {
        if self.as_str().starts_with("lint::") {
            Severity::Warning
        } else {
            Severity::Error
        }
    }
}
