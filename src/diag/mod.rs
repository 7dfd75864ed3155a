//! Diagnostics: the one owned diagnostic type of the compiler, one constructor per code.
//!
//! Takes spans and facts from every stage; gives [`Diagnostic`] values that the CLI renders
//! with miette ([`render`]) in a fixed theme (no colour, fixed width) so snapshots are
//! stable. Codes are grouped by stage (`syntax::`, `elab::`, `structure::`, `values::`,
//! `lint::`); [`Code::ALL`] lists them all. Findings are collected, never thrown: one run
//! reports every independent problem.

mod codes;
mod render;

pub use codes::Code;
pub use render::{render, render_all};

use crate::span::Span;

/// Error or warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Severity {
    /// The schedule is rejected.
    Error,
    /// Reported; the schedule is still accepted.
    Warning,
}

/// A span with the text shown next to it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Label {
    /// Where it points in the source.
    pub span: Span,
    /// What to say there.
    pub text: String,
}

/// One finding about a schedule.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Diagnostic {
    /// Which check found it.
    pub code: Code,
    /// Error or warning (a code's default; a setting may change it).
    pub severity: Severity,
    /// One sentence.
    pub message: String,
    /// Labelled spans; the first is the primary one.
    pub labels: Vec<Label>,
    /// How to fix it, if there is something useful to say.
    pub help: Option<String>,
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for Diagnostic {}

impl Diagnostic {
    fn new(code: Code, message: impl Into<String>) -> Self {
        Diagnostic {
            code,
            severity: code.default_severity(),
            message: message.into(),
            labels: Vec::new(),
            help: None,
        }
    }

    fn label(mut self, span: Span, text: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            text: text.into(),
        });
        self
    }

    fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// The primary span (the first label's), if any.
    pub fn primary_span(&self) -> Option<Span> {
        self.labels.first().map(|l| l.span)
    }

    /// True for errors.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    // ---- syntax -------------------------------------------------------------------

    /// The parser met something it did not expect.
    pub fn unexpected_input(span: Span, found: String, expected: Vec<String>) -> Self {
        let found_text = match found.as_str() {
            "" => "the end of the file".to_string(),
            "\n" | "\r" => "the end of the line".to_string(),
            _ => format!("`{found}`"),
        };
        let expected_text = one_of(&expected);
        let label = if expected.is_empty() {
            "unexpected here".to_string()
        } else {
            format!("expected {expected_text}")
        };
        Diagnostic::new(Code::SyntaxUnexpected, format!("unexpected {found_text}"))
            .label(span, label)
    }

    /// A number literal that does not fit its type.
    pub fn bad_literal(span: Span, text: &str, kind: &str) -> Self {
        Diagnostic::new(
            Code::SyntaxBadLiteral,
            format!("`{text}` is not a valid {kind}"),
        )
        .label(span, format!("not a valid {kind}"))
        .help("integers are 64-bit signed; floats must be finite")
    }

    /// Brackets nested deeper than the parser allows.
    pub fn nesting_too_deep(span: Span, limit: usize) -> Self {
        Diagnostic::new(
            Code::SyntaxTooDeep,
            format!("nesting deeper than {limit} levels"),
        )
        .label(span, "too deep here")
        .help("split the expression with `let`")
    }

    /// An expression whose tree is deeper than the compiler walks (a long operator or
    /// postfix chain such as `1 + 1 + ... + 1`).
    pub fn expression_too_deep(span: Span, limit: usize) -> Self {
        Diagnostic::new(
            Code::SyntaxTooDeep,
            format!("an expression more than {limit} operators deep"),
        )
        .label(span, "too deep here")
        .help("split the expression with `let`")
    }

    /// An `if` with more `else if` branches than the compiler accepts.
    pub fn else_if_chain_too_long(span: Span, limit: usize) -> Self {
        Diagnostic::new(
            Code::SyntaxTooDeep,
            format!("an `if` with more than {limit} `else if` branches"),
        )
        .label(span, "one branch too many")
        .help("index a list or use a loop instead of a long `else if` chain")
    }

    /// The source file is too large to be a schedule.
    pub fn source_too_large(bytes: usize) -> Self {
        Diagnostic::new(
            Code::SyntaxTooDeep,
            format!("the schedule is {bytes} bytes; at most 64 MiB are accepted"),
        )
    }

    // ---- elaboration --------------------------------------------------------------

    /// A name that is not declared.
    pub fn unknown_name(span: Span, kind: &str, name: &str, candidates: &[&str]) -> Self {
        let d = Diagnostic::new(Code::ElabUnknownName, format!("unknown {kind} `{name}`")).label(
            span,
            if kind == "name" {
                "not declared".to_string()
            } else {
                format!("no {kind} named `{name}`")
            },
        );
        match closest(name, candidates) {
            Some(best) => d.help(format!("did you mean `{best}`?")),
            None if !candidates.is_empty() && candidates.len() <= 12 => d.help(format!(
                "known: {}",
                candidates
                    .iter()
                    .map(|c| format!("`{c}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            None => d,
        }
    }

    /// A name declared twice.
    pub fn duplicate_name(span: Span, first: Span, kind: &str, name: &str) -> Self {
        Diagnostic::new(
            Code::ElabDuplicate,
            format!("{kind} `{name}` is declared twice"),
        )
        .label(span, "declared again here")
        .label(first, "first declared here")
    }

    /// A value of the wrong type.
    pub fn type_mismatch(span: Span, expected: &str, found: &str) -> Self {
        Diagnostic::new(
            Code::ElabType,
            format!("expected {expected}, found {found}"),
        )
        .label(span, format!("this is {found}"))
    }

    /// An index, page or expert outside its range.
    pub fn out_of_range(span: Span, what: &str, value: i64, limit: &str) -> Self {
        Diagnostic::new(
            Code::ElabOutOfRange,
            format!("{what} {value} is out of range ({limit})"),
        )
        .label(span, format!("{what} {value}"))
    }

    /// A param's value (default or `--set`) outside its declared range.
    pub fn param_out_of_range(
        decl: Span,
        name: &str,
        value: &str,
        range: &str,
        from_set: bool,
    ) -> Self {
        let origin = if from_set { "--set value" } else { "default" };
        Diagnostic::new(
            Code::ElabParamValue,
            format!("param `{name}`: {origin} {value} is outside {range}"),
        )
        .label(decl, format!("`{name}` is declared in {range} here"))
    }

    /// A `--set` value of the wrong type or unparsable.
    pub fn param_bad_value(decl: Span, name: &str, ty: &str, value: &str) -> Self {
        Diagnostic::new(
            Code::ElabParamValue,
            format!("param `{name}` is {ty}, but --set gives `{value}`"),
        )
        .label(decl, format!("`{name}` is declared {ty} here"))
    }

    /// `--set NAME=...` for a param the schedule does not declare.
    pub fn unknown_param(name: &str, declared: &[&str]) -> Self {
        let d = Diagnostic::new(
            Code::ElabUnknownParam,
            format!("--set {name}: the schedule declares no param `{name}`"),
        );
        match closest(name, declared) {
            Some(best) => d.help(format!("did you mean `{best}`?")),
            None => d.help(format!(
                "declared params: {}",
                if declared.is_empty() {
                    "none".to_string()
                } else {
                    declared.join(", ")
                }
            )),
        }
    }

    /// `--set` text that is not `name=value`.
    pub fn malformed_set(text: &str) -> Self {
        Diagnostic::new(
            Code::ElabUnknownParam,
            format!("--set `{text}` is not of the form name=value"),
        )
    }

    /// Division by zero, overflow and similar.
    pub fn arithmetic(span: Span, what: &str) -> Self {
        Diagnostic::new(Code::ElabArithmetic, what.to_string()).label(span, what.to_string())
    }

    /// An op argument that the op does not take, or given twice.
    pub fn bad_argument(span: Span, op: &str, arg: &str, allowed: &[&str]) -> Self {
        Diagnostic::new(
            Code::ElabArgument,
            format!("`{op}` takes no argument `{arg}`"),
        )
        .label(span, "not an argument of this op")
        .help(format!("`{op}` takes: {}", allowed.join(", ")))
    }

    /// A required op argument missing.
    pub fn missing_argument(span: Span, op: &str, arg: &str) -> Self {
        Diagnostic::new(
            Code::ElabArgument,
            format!("`{op}` needs the argument `{arg}`"),
        )
        .label(span, format!("`{arg}` missing"))
    }

    /// Positional argument to an op, or wrong count for a template or function.
    pub fn arity(span: Span, what: &str, expected: usize, found: usize) -> Self {
        Diagnostic::new(
            Code::ElabArgument,
            format!("{what} takes {expected} argument(s), {found} given"),
        )
        .label(span, format!("{found} given"))
    }

    /// An op argument passed positionally.
    pub fn positional_op_argument(span: Span, op: &str) -> Self {
        Diagnostic::new(
            Code::ElabArgument,
            format!("arguments of `{op}` must be named"),
        )
        .label(span, "name this argument")
        .help("write `role = value`, e.g. `layer = i`")
    }

    /// A task without `on STREAM`, or a template call with a tail.
    pub fn missing_stream(span: Span, op: &str) -> Self {
        Diagnostic::new(
            Code::ElabStream,
            format!("task `{op}` is not issued on a stream"),
        )
        .label(span, "add `on STREAM`")
    }

    /// A template call with `on`/`as`/`after`.
    pub fn template_tail(span: Span, name: &str) -> Self {
        Diagnostic::new(
            Code::ElabStream,
            format!("template call `{name}` cannot take `on`, `as` or `after`"),
        )
        .label(span, "put these on the tasks inside the template")
    }

    /// A template that calls itself.
    pub fn recursive_template(span: Span, name: &str) -> Self {
        Diagnostic::new(
            Code::ElabTemplate,
            format!("template `{name}` calls itself"),
        )
        .label(span, "recursive call")
        .help("templates are expanded in place; use a loop instead")
    }

    /// Unrolling produced too many tasks.
    pub fn too_many_tasks(span: Span, limit: usize) -> Self {
        Diagnostic::new(
            Code::ElabLimit,
            format!("the schedule unrolls past its limit of {limit} (tasks, loop iterations or buffers)"),
        )
        .label(span, "while unrolling this")
        .help("check loop bounds and params")
    }

    /// Template expansion past its limit (templates calling each other several times grow
    /// exponentially with the depth of the calls).
    pub fn too_many_expansions(span: Span, limit: u64) -> Self {
        Diagnostic::new(
            Code::ElabLimit,
            format!("the schedule expands templates more than {limit} times"),
        )
        .label(span, "while expanding this")
        .help("a template that calls another several times doubles the work at each level; check the template calls")
    }

    /// An unknown engine or memory space.
    pub fn bad_engine(span: Span, text: &str, kind: &str, known: &[&str]) -> Self {
        Diagnostic::new(Code::ElabUnknownName, format!("unknown {kind} `{text}`"))
            .label(span, format!("not a {kind}"))
            .help(format!("known: {}", known.join(", ")))
    }

    /// A buffer or cache declared on `disk`, where only the checkpoint lives.
    pub fn disk_buffer(span: Span) -> Self {
        Diagnostic::new(Code::ElabUnknownName, "no buffer can be declared on `disk`")
            .label(span, "only the checkpoint `W` lives on disk")
            .help("declare a `disk.read` stream: `W` is then on disk, and copies on that stream read its slices into `host` or `pinned` buffers")
    }

    /// An `evict score(l, e) = ..` the runtime could not compute as it ranks residents:
    /// not linear in the run-time quantities, or reading another expert's routing.
    pub fn eviction_score(span: Span, what: &str, label: &str) -> Self {
        Diagnostic::new(Code::ElabDynamic, format!("an eviction score {what}"))
            .label(span, label.to_string())
            .help("a score is a constant times each of `score_max(l, e)`, `score_sum(l, e)` and `routed(l, e)` (the ranked expert's routing in the latest step that routed its layer), plus a constant; everything else is known at compile time")
    }

    /// A dynamic value (`hot`, `active`) where a compile-time value is required.
    pub fn dynamic_not_allowed(span: Span, what: &str) -> Self {
        Diagnostic::new(Code::ElabDynamic, format!("{what} must be known at compile time"))
            .label(span, "known only at run time")
            .help("dynamic expert identity is allowed for `set` and for slices of the checkpoint `W`; dynamic conditions guard tasks in `if`")
    }

    /// `else` after a dynamic condition that is not a single literal.
    pub fn dynamic_else(span: Span) -> Self {
        Diagnostic::new(
            Code::ElabDynamic,
            "`else` needs a dynamic condition of one `active(...)` (or its negation)",
        )
        .label(span, "the negation of this condition is not a conjunction")
    }

    /// `sync` inside a run-time guard: a barrier every later task waits on cannot exist
    /// only when routing says so.
    pub fn guarded_sync(span: Span) -> Self {
        Diagnostic::new(
            Code::ElabDynamic,
            "`sync` cannot be under a run-time condition",
        )
        .label(span, "inside an `if` on `active(..)` or `routed(..)`")
        .help("a barrier orders every later task of the step; move it out of the dynamic `if`")
    }

    /// `after` naming a task that does not exist.
    pub fn after_missing(span: Span, label: &str) -> Self {
        Diagnostic::new(
            Code::ElabAfter,
            format!("`after {label}`: no task has this label"),
        )
        .label(span, "no such task")
    }

    /// `after` naming a task issued later.
    pub fn after_later(span: Span, label: &str, target: Span) -> Self {
        Diagnostic::new(
            Code::ElabAfter,
            format!("`after {label}` names a task issued later"),
        )
        .label(span, "waits for a later task")
        .label(target, "issued here, after the waiting task")
        .help("tasks run in issue order; `after` can only name earlier tasks")
    }

    /// Two tasks with the same label.
    pub fn duplicate_label(span: Span, first: Span, label: &str) -> Self {
        Diagnostic::new(
            Code::ElabDuplicate,
            format!("label `{label}` is used by two tasks"),
        )
        .label(span, "second task")
        .label(first, "first task")
    }

    /// No `microbatches` declaration although ops need one.
    pub fn missing_microbatches(span: Span) -> Self {
        Diagnostic::new(
            Code::ElabMicroBatches,
            "the schedule has no `microbatches COUNT of SIZE` declaration",
        )
        .label(span, "this op works on a micro-batch")
    }

    /// A hardware symbol with no profile to read it from.
    pub fn missing_hardware(span: Span, name: &str) -> Self {
        Diagnostic::new(
            Code::ElabUnknownName,
            format!("hardware symbol `{name}` needs a hardware profile"),
        )
        .label(span, "no profile given")
        .help("pass `--hw PROFILE`")
    }

    // ---- structure ----------------------------------------------------------------

    /// An argument in a memory space the stream's engine cannot access.
    pub fn engine_space(
        arg_span: Span,
        stream_span: Span,
        engine: &str,
        buffer: &str,
        space: &str,
        allowed: &str,
    ) -> Self {
        Diagnostic::new(
            Code::StructEngineSpace,
            format!("`{buffer}` is in `{space}` memory, which `{engine}` cannot access"),
        )
        .label(arg_span, format!("`{buffer}` lives in `{space}`"))
        .label(stream_span, format!("this stream runs on `{engine}`"))
        .help(format!("`{engine}` accesses {allowed}"))
    }

    /// A compute op on a copy stream or a copy on a stream that cannot do it.
    pub fn op_engine(span: Span, stream_span: Span, op: &str, engine: &str) -> Self {
        Diagnostic::new(Code::StructOpEngine, format!("`{op}` cannot run on a `{engine}` stream"))
            .label(span, format!("`{op}` issued here"))
            .label(stream_span, format!("a `{engine}` stream"))
            .help(if op == "copy" {
                "copies run on gpu.copy_in (host -> gpu), gpu.copy_out (gpu -> host) or cpu.copy (host <-> pinned)"
            } else {
                "compute ops run on gpu.compute or cpu.compute streams"
            })
    }

    /// A copy whose source and destination differ in length.
    pub fn copy_size(span: Span, src: u64, dst: u64) -> Self {
        Diagnostic::new(Code::StructCopySize, format!("copy of {src} bytes into a {dst}-byte slice"))
            .label(span, format!("{src} bytes -> {dst} bytes"))
            .help("copy equal-length slices (pages with the same count, or whole buffers of the same size)")
    }

    /// An argument smaller than the op needs.
    pub fn buffer_too_small(span: Span, role: &str, have: u64, need: u64) -> Self {
        Diagnostic::new(Code::StructTooSmall, format!("argument `{role}` has {have} bytes; the op needs {need}"))
            .label(span, format!("{have} bytes, {need} needed"))
            .help("size the buffer for the micro-batch and step (prefill holds sequences x prompt_len tokens)")
    }

    /// A task whose written argument overlaps another of its arguments.
    #[allow(clippy::too_many_arguments)]
    pub fn overlapping_arguments(
        written: Span,
        other: Span,
        task: &str,
        buffer: &str,
        written_bytes: (u64, u64),
        other_bytes: (u64, u64),
        other_writes: bool,
    ) -> Self {
        let verb = if other_writes { "writes" } else { "reads" };
        Diagnostic::new(
            Code::StructOverlap,
            format!(
                "task {task} writes bytes {}..{} of `{buffer}` and {verb} bytes {}..{} of it through another argument",
                written_bytes.0, written_bytes.1, other_bytes.0, other_bytes.1
            ),
        )
        .label(written, "written here")
        .label(other, format!("overlapping argument ({verb})"))
        .help("an op's arguments must not alias when one of them is written: give the output its own buffer or a disjoint slice")
    }

    /// A write to the read-only checkpoint.
    pub fn write_checkpoint(span: Span) -> Self {
        Diagnostic::new(Code::StructReadOnly, "the checkpoint `W` is read-only")
            .label(span, "written here")
    }

    /// A slow pageable -> GPU copy (warning).
    pub fn pageable_copy(span: Span, buffer: &str) -> Self {
        Diagnostic::new(
            Code::LintPageableCopy,
            format!("copy from pageable `{buffer}` straight to the GPU"),
        )
        .label(span, "pageable source")
        .help("stage it through a `pinned` buffer with a `cpu.copy` stream for full link bandwidth")
    }

    /// A schedule with no step template.
    pub fn no_steps(span: Span) -> Self {
        Diagnostic::new(
            Code::StructNoSteps,
            "the schedule has no `prefill`, `decode` or `step` block",
        )
        .label(span, "nothing to run")
    }

    // ---- values -------------------------------------------------------------------

    /// A read that finds other contents than expected: `message` then ", written by task
    /// W" when the writer is known, a label on the argument and one on the writer.
    fn value_mismatch(
        code: Code,
        arg_span: Span,
        message: String,
        arg_label: String,
        writer_label: String,
        writer: Option<(String, Span)>,
    ) -> Self {
        let writer_text = writer
            .as_ref()
            .map(|(name, _)| format!(", written by task {name}"))
            .unwrap_or_default();
        let mut d =
            Diagnostic::new(code, format!("{message}{writer_text}")).label(arg_span, arg_label);
        if let Some((_, span)) = writer {
            d = d.label(span, writer_label);
        }
        d
    }

    /// An argument holds something other than what the op expects.
    pub fn wrong_value(
        arg_span: Span,
        task: &str,
        buffer: &str,
        expected: &str,
        held: &str,
        writer: Option<(String, Span)>,
    ) -> Self {
        Diagnostic::value_mismatch(
            Code::ValuesWrong,
            arg_span,
            format!("task {task} reads `{buffer}` expecting {expected}, but it holds {held}"),
            format!("expects {expected}"),
            format!("wrote {held}"),
            writer,
        )
    }

    /// An argument nobody wrote before the read.
    pub fn uninitialized(arg_span: Span, task: &str, buffer: &str, expected: &str) -> Self {
        Diagnostic::new(
            Code::ValuesUninitialized,
            format!("task {task} reads `{buffer}` before anything is written to it"),
        )
        .label(arg_span, format!("expects {expected}"))
        .help("copy or compute the value into this buffer earlier in issue order")
    }

    /// An argument whose value was written by a task that may be skipped at run time.
    pub fn maybe_stale(
        arg_span: Span,
        task: &str,
        buffer: &str,
        expected: &str,
        writer: (String, Span),
    ) -> Self {
        Diagnostic::new(
            Code::ValuesGuarded,
            format!("task {task} reads `{buffer}` expecting {expected}, but the write by task {} may be skipped at run time", writer.0),
        )
        .label(arg_span, "read under a weaker condition")
        .label(writer.1, "written only under a dynamic condition")
        .help("guard the reader with the same condition")
    }

    /// Experts of a layer and micro-batch not computed exactly once before `combine`.
    pub fn expert_coverage(span: Span, layer: u32, ub: u32, problem: &str) -> Self {
        Diagnostic::new(Code::ValuesExpertCoverage, format!("layer {layer}, ub {ub}: {problem}"))
            .label(span, "combined here")
            .help("each expert must be computed exactly once between `gate` and `combine`: `set = all`, ranges covering 0..experts, or `hot(i, r)` for every rank r")
    }

    /// A guard that reads the routing of a layer before any gate of that layer (and
    /// micro-batch) is ordered before its task.
    pub fn routing_unknown(span: Span, task: &str, layer: u32, ubs: &[u32], step: &str) -> Self {
        let which = ubs
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        Diagnostic::new(
            Code::ValuesRoutingUnknown,
            format!("task {task} is guarded by the routing of layer {layer}, but no gate of layer {layer} for micro-batch {which} is ordered before it in this `{step}` step"),
        )
        .label(span, "decided from routing that is not known yet")
        .help("order the task after the gate (a data dependency, or `after` naming the gate task) so its routing is read back to the host first")
    }

    /// A prefetch ranks by a lookahead prediction that no `pregate` ordered before it has
    /// produced.
    pub fn unpredicted(span: Span, task: &str, layer: u32, ubs: &[u32], step: &str) -> Self {
        let which = ubs
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        Diagnostic::new(
            Code::CacheUnpredicted,
            format!("task {task} prefetches by the lookahead prediction of layer {layer}, but no pregate of layer {layer} for micro-batch {which} is ordered before it in this `{step}` step"),
        )
        .label(span, "ranked by a prediction that is not made yet")
        .help(format!("issue `pregate(layer = {layer}, ..)` earlier and order the prefetch `after` it, so its routing is read back to the host first"))
    }

    /// A task guarded by a cache residency that a fetch or prefetch into the cache may
    /// change between the tasks that decide it (`cache::stale_guard`).
    pub fn stale_guard(
        span: Span,
        task: &str,
        guard: &str,
        changer: (String, Span),
        cache: &str,
    ) -> Self {
        Diagnostic::new(
            Code::CacheStaleGuard,
            format!("task {task} is guarded by `{guard}`, but task {} into `{cache}` may run between the tasks that decide that guard, so they can see different answers", changer.0),
        )
        .label(span, format!("decides `{guard}` here"))
        .label(changer.1, format!("may change what `{cache}` holds in between"))
        .help(format!("order every fetch and prefetch into `{cache}` before all the tasks guarded by `{guard}` or after all of them (`after`); a fetch of the same expert inside the guard is a hit and needs no order"))
    }

    /// The expected tensor, but the one of another step run (an earlier token's hidden
    /// state, a KV cache missing the last step's rows).
    #[allow(clippy::too_many_arguments)]
    pub fn stale_value(
        arg_span: Span,
        task: &str,
        buffer: &str,
        expected: &str,
        wanted_from: &str,
        held_from: &str,
        writer: Option<(String, Span)>,
    ) -> Self {
        Diagnostic::value_mismatch(
            Code::ValuesStale,
            arg_span,
            format!("task {task} reads `{buffer}` expecting {expected} {wanted_from}, but it holds the one of {held_from}"),
            format!("expects {expected} {wanted_from}"),
            format!("left the one of {held_from} here"),
            writer,
        )
        .help("compute or copy the value again in this step before it is read: what an earlier step left here is out of date")
    }

    /// A step run after which a micro-batch has no sampled token.
    pub fn unsampled(span: Span, run: &str, ub: u32, why: &str, label: &str) -> Self {
        Diagnostic::new(
            Code::ValuesSampling,
            format!("{run} never samples ub {ub}, so its sequences would get no token ({why})"),
        )
        .label(span, label)
        .help("every prefill, decode or mixed step must run `lm_head` and `sample` for every micro-batch once, after its last layer")
    }

    /// A step run that samples a micro-batch twice.
    pub fn sampled_twice(span: Span, first: Span, run: &str, ub: u32, task: &str) -> Self {
        Diagnostic::new(
            Code::ValuesSampling,
            format!("{run} samples ub {ub} twice (again in task {task}): each sequence gets one token per step"),
        )
        .label(span, "samples it again")
        .label(first, "first sample")
    }

    /// A `sample` under a run-time guard: the micro-batch may get no token.
    pub fn sample_guarded(span: Span, task: &str, ub: u32, guard: &str) -> Self {
        Diagnostic::new(
            Code::ValuesSampling,
            format!("task {task} runs only when `{guard}`: ub {ub} may get no token"),
        )
        .label(span, "guarded sample")
        .help("sample every micro-batch unconditionally")
    }

    /// A task reads an expert cache slot that no `fetch` of the same expert before it in
    /// the step makes resident (`fetch_guard`: the fetch exists but may be skipped when the
    /// read runs).
    pub fn cache_unfetched(
        span: Span,
        task: &str,
        slot: &str,
        fetch: Option<(String, Span, String)>,
        guard: &str,
    ) -> Self {
        match fetch {
            None => Diagnostic::new(
                Code::CacheUnfetched,
                format!("task {task} reads `{slot}`, but no `fetch` of that expert comes before it in this step"),
            )
            .label(span, "read here")
            .help("a cache keeps no promise across fetches: `fetch W[l].expert(e) -> CACHE.slot(l, e) on STREAM` earlier in the same step (a no-op when the expert is resident) holds the slot until this read ran"),
            Some((fetch, fetch_span, fetch_guard)) => Diagnostic::new(
                Code::CacheUnfetched,
                format!("task {task} reads `{slot}` when `{guard}`, but its fetch {fetch} runs only when `{fetch_guard}`"),
            )
            .label(span, "read here")
            .label(fetch_span, format!("fetched only when `{fetch_guard}`"))
            .help("guard the read by the fetch's condition (or fetch under a weaker one)"),
        }
    }

    /// More fetched experts may be held in a cache at once than it has slots.
    pub fn cache_deadlock(
        decl: Span,
        cache: &str,
        slots: u32,
        held: u64,
        fetch: (String, Span),
        step: &str,
    ) -> Self {
        let slots_text = if slots == 1 {
            "1 slot".to_string()
        } else {
            format!("{slots} slots")
        };
        Diagnostic::new(
            Code::CacheDeadlock,
            format!("cache `{cache}` has {slots_text}, but in {step} up to {held} fetched experts can be held at once (each until its readers ran): a fetch could wait forever for a free slot"),
        )
        .label(decl, slots_text)
        .label(fetch.1, format!("{} is one of {held} fetches that can hold slots together", fetch.0))
        .help("give the cache at least that many slots (decode holds up to min(experts, sequences x top_k) experts of a layer, prefill every expert of a layer), or order the fetches so fewer are held at once (`after` the previous expert's task)")
    }

    /// An `experts` task whose guard may skip it while its expert receives tokens.
    pub fn expert_guard(
        span: Span,
        task: &str,
        guard: &str,
        set: &str,
        layer: u32,
        ub: u32,
    ) -> Self {
        Diagnostic::new(
            Code::ValuesExpertGuard,
            format!("task {task} runs only when `{guard}`, which does not hold every time expert {set} of layer {layer} receives tokens from ub {ub}: its contribution would be lost"),
        )
        .label(span, format!("guarded by `{guard}`"))
        .help("guard a single expert's computation only by `active(layer, expert)` or `active(layer, expert, ub)` of that same expert (or not at all)")
    }

    /// A copy or op output over an expert accumulator destroys the output of an expert
    /// that `combine` has not read yet.
    #[allow(clippy::too_many_arguments)]
    pub fn lost_output(
        dst_span: Span,
        task: &str,
        buffer: &str,
        acc: &str,
        set: &str,
        computed_by: &str,
        computed_span: Span,
    ) -> Self {
        Diagnostic::new(
            Code::ValuesLostOutput,
            format!("task {task} overwrites `{buffer}`, which holds {acc} with the output of {set} computed by task {computed_by}, with a value that lacks it: `combine` would never add it"),
        )
        .label(dst_span, "overwritten here")
        .label(computed_span, format!("{set} computed into it here"))
        .help("give the two engines separate accumulators and pass both to `combine(.., acc = [acc_a, acc_b])`, which adds them; or copy the partial accumulator before the other engine's experts write theirs")
    }

    /// A task computes with a lossy format copy of a weight that no `substitute`
    /// declaration allows.
    pub fn undeclared_substitute(
        arg_span: Span,
        task: &str,
        buffer: &str,
        expected: &str,
        held: &str,
        format: &str,
    ) -> Self {
        Diagnostic::new(
            Code::ValuesUndeclaredSubstitute,
            format!("task {task} computes with {held} from `{buffer}` where it expects {expected}: a lossy substitute the schedule does not declare"),
        )
        .label(arg_span, format!("holds the {format} copy"))
        .help(format!("declare `substitute experts {format}` to compute with the {format} copies (the run's tokens are then compared with the oracle's by a bound, not exactly), or copy the checkpoint's expert"))
    }

    /// A `substitute` declaration or a `.format(..)` the card's weights cannot take.
    pub fn bad_weight_format(span: Span, problem: &str) -> Self {
        Diagnostic::new(Code::ElabType, problem.to_string()).label(span, "this format")
    }

    // ---- lints --------------------------------------------------------------------

    /// A declared buffer no task touches.
    pub fn unused_buffer(span: Span, name: &str) -> Self {
        Diagnostic::new(
            Code::LintUnusedBuffer,
            format!("buffer `{name}` is never used"),
        )
        .label(span, "declared here")
    }

    /// A declared stream no task is issued on.
    pub fn unused_stream(span: Span, name: &str) -> Self {
        Diagnostic::new(
            Code::LintUnusedStream,
            format!("stream `{name}` is never used"),
        )
        .label(span, "declared here")
    }

    /// `gpu_scratch(..)` evaluated without a backend's scratch rules: `bytes`, the op
    /// catalog's workspace of the largest task, stands in for what a device stream's
    /// workspace takes (warning).
    pub fn catalog_scratch(span: Span, bytes: u64) -> Self {
        Diagnostic::new(
            Code::LintCatalogScratch,
            "`gpu_scratch` is the op catalog's bound: no backend's scratch rules were given",
        )
        .label(span, format!("{bytes} B, the catalog's workspace of the largest task"))
        .help("compile for the backend that runs the schedule (`--backend cuda`): its rules count the scratch its kernels take, as its budget does")
    }

    /// A declared param no expression reads.
    pub fn unused_param(span: Span, name: &str) -> Self {
        Diagnostic::new(
            Code::LintUnusedParam,
            format!("param `{name}` is never used"),
        )
        .label(span, "declared here")
    }

    /// Reuse of a single buffer that serialises two streams.
    pub fn false_dependency(
        decl: Span,
        buffer: &str,
        streams: (&str, &str),
        count: usize,
        example: (Span, Span),
    ) -> Self {
        Diagnostic::new(
            Code::LintFalseDependency,
            format!("reusing `{buffer}` makes stream `{}` wait for stream `{}` {count} time(s) (write-after-read/write, not data)", streams.1, streams.0),
        )
        .label(example.1, "waits to overwrite")
        .label(example.0, "until this task is done with it")
        .label(decl, "a single buffer")
        .help("declare it as an array (`[2]`) and alternate elements so the streams overlap")
    }
}

fn one_of(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} or {}", init.join(", "), last),
    }
}

/// The closest candidate by edit distance, if close enough to be a likely typo.
fn closest<'a>(name: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|c| (edit_distance(name, c), *c))
        .filter(|(d, c)| *d <= (name.len().max(c.len()) / 3).max(1))
        .min()
        .map(|(_, c)| c)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
