//! Elaboration: AST + model card + workload + `--set` overrides to the IR.
//!
//! Takes a parsed [`File`] and [`Options`]; gives an [`ir::Program`] with params bound,
//! loops unrolled, templates expanded, names resolved, every task's slices as byte ranges,
//! and per-task work from the op catalog — or every independent error found. Guarantees the
//! invariants listed in [`crate::ir`]'s header. Declarations are processed in textual order
//! (a name must be declared before it is used), step blocks after all declarations.

mod calls;
mod decls;
pub mod evict;
mod guards;
mod labels;
mod scopes;
mod slices;
mod spare;
mod stmts;
pub mod value;
pub mod vocabulary;

use crate::diag::{Code, Diagnostic};
use crate::ir::{
    self, Buffer, BufferId, BufferKind, Layout, MicroBatches, Space, Stream, StreamId, Task,
    TaskId, Workload,
};
use crate::model::card::ModelCard;
use crate::syntax::ast::{File, Item, Span, StepDecl, TemplateDecl};
use std::collections::{BTreeMap, HashSet};
use value::{SliceVal, Val};

/// At most this many tasks after unrolling.
pub const MAX_TASKS: usize = 2_000_000;
/// At most this many loop iterations in total (empty loops included).
pub const MAX_ITERATIONS: u64 = 20_000_000;
/// At most this many template expansions in total (a real schedule expands about one per
/// task; 41 templates each calling the next twice would expand 2^41 times).
pub const MAX_EXPANSIONS: u64 = 2_000_000;
/// At most this many buffers (array elements).
pub const MAX_BUFFERS: u64 = 1_000_000;
/// Elaboration stops after this many errors.
const MAX_ERRORS: usize = 50;

/// What elaboration binds the schedule to.
#[derive(Debug, Clone)]
pub struct Options {
    /// The model card (`--model`).
    pub model: ModelCard,
    /// The workload (`--batch`, `--prompt-len`, `--gen-len`).
    pub workload: Workload,
    /// `--set name=value` overrides, in command-line order.
    pub sets: Vec<(String, String)>,
    /// Hardware symbols (`gpu.mem`, ...) from a profile; empty without `--hw`.
    pub hardware: BTreeMap<String, f64>,
    /// Bytes per activation element ([`crate::ir::catalog::ACT_BYTES`], f32, unless
    /// a cost study models another precision; the runtime always computes in f32).
    pub act_bytes: u64,
    /// Bytes per KV cache element: 4, or 2 for a half cache (`--kv-type f16`); sizes
    /// `kv_cache(..)` and every task's [`crate::ir::catalog::Shape::kv_bytes`]. `None`:
    /// the activations' `act_bytes`, as a cost study at another precision (`moec
    /// simulate --act-bytes 2`, `moec reproduce`'s fp16) models its cache.
    pub kv_bytes: Option<u64>,
    /// Unrolling limits (tasks, loop iterations); the defaults suit any real schedule.
    pub limits: Limits,
    /// The routing profile `rank(..)` and `rank_in_layer(..)` read (`--profile`); without
    /// one they rank as uniform routing would (ties: expert, then layer).
    pub profile: Option<std::sync::Arc<crate::ir::profile::RoutingProfile>>,
    /// Decide `routed(..) >= t` at compile time where t exceeds the tokens a micro-batch of
    /// the step can hold (`guards::routed_comparison`: the arm that can never run is not
    /// built, and the runtime holds the step to those tokens). `false` keeps every such
    /// comparison a run-time guard: the program the prune is compared with in tests.
    pub routed_ceiling: bool,
    /// Give each task its label's text (`Task::label`) and its arguments' source spans
    /// (`SpanTable::task_args`). `false` for a program that is only scored and dropped (a
    /// planner's point, `engine::fit_params`): nothing there reads them, and on a point of a
    /// million tasks they are a string and a vector per task to allocate and free. Labels
    /// still resolve `after` and are still checked for duplicates; the winners a planner
    /// prints are compiled again with this `true`.
    pub task_names: bool,
    /// The scratch rules of the backend the program is compiled for (its
    /// `runtime::Registration::scratch`): the budget's `scratch on <stream>` lines and the
    /// language's `gpu_scratch(n, s, c)`. `None` (a backend without device streams of its
    /// own, or no backend named): the op catalog's workspace, which the budget line and a
    /// `lint::catalog_scratch` warning on `gpu_scratch` say.
    pub scratch: Option<&'static dyn crate::ir::scratch::DeviceScratch>,
}

/// Bounds on unrolling, so a runaway loop is an error rather than a hang.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// At most this many tasks.
    pub max_tasks: usize,
    /// At most this many loop iterations in total.
    pub max_iterations: u64,
    /// At most this many template expansions in total.
    pub max_expansions: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_tasks: MAX_TASKS,
            max_iterations: MAX_ITERATIONS,
            max_expansions: MAX_EXPANSIONS,
        }
    }
}

impl Options {
    /// Options for a card with the default workload and no overrides.
    pub fn new(model: ModelCard) -> Self {
        Options {
            model,
            workload: Workload::default(),
            sets: Vec::new(),
            hardware: BTreeMap::new(),
            act_bytes: crate::ir::catalog::ACT_BYTES,
            kv_bytes: None,
            limits: Limits::default(),
            profile: None,
            routed_ceiling: true,
            task_names: true,
            scratch: None,
        }
    }
}

/// Result of a successful elaboration: the program and any warnings.
pub type Elaborated = (ir::Program, Vec<Diagnostic>);

/// Elaborates a parsed schedule.
pub fn elaborate(file: &File, options: &Options) -> Result<Elaborated, Vec<Diagnostic>> {
    let mut elab = Elaborator::new(file, options);
    // A lean elaboration (a planner's point) checks its labels for duplicates once, at the
    // end (`labels::Labels::seal`); where one is found it runs again with labels checked
    // as they come, which reports it as every elaboration does. Its tables start from
    // those the thread's last point left ([`Recycled`]): the same tasks, without fresh
    // pages for a million of them.
    if !options.task_names {
        let spare = spare::take();
        elab.labels = labels::Labels::deferred_in(spare.labels);
        elab.tasks = spare.tasks;
        elab.spans.tasks = spare.task_spans;
        elab.spans.task_args = spare.task_args;
        elab.spans.task_streams = spare.task_streams;
        elab.spans.task_after = spare.task_after;
    }
    elab.run(file);
    if !elab.labels.seal() {
        let mut elab = Elaborator::new(file, options);
        elab.run(file);
        return elab.finish(file);
    }
    if !options.task_names {
        spare::keep_labels(elab.labels.take_list());
    }
    elab.finish(file)
}

pub use spare::Recycled;

/// The buffers a schedule declares at `options` (params bound, top-level lets and buffer
/// declarations evaluated in order, as [`elaborate`] does before it runs any step), without
/// running its steps; `None` when the declarations do not elaborate without errors. The
/// buffers are the ones [`elaborate`] gives, with the same ids and bytes (steps add none):
/// what a budget's buffer lines sum, at a fraction of an elaboration's cost.
pub fn declared_buffers(file: &File, options: &Options) -> Option<Vec<Buffer>> {
    let mut elab = Elaborator::new(file, options);
    elab.run_declarations(file)?;
    if elab.diags.iter().any(Diagnostic::is_error) {
        return None;
    }
    Some(elab.buffers)
}

/// One declared buffer array.
#[derive(Debug, Clone)]
struct ArrayDecl {
    name: String,
    dims: Vec<u32>,
    first: BufferId,
    layout: Layout,
    span: Span,
}

/// A task waiting for its `after` labels to be resolved.
struct PendingAfter<'a> {
    task: TaskId,
    label: labels::LabelKey<'a>,
    span: Span,
}

struct Elaborator<'a> {
    options: &'a Options,
    card: ModelCard,
    checkpoint: ir::CheckpointLayout,
    /// Top-level lets and the nested scopes; template calls hide the caller's locals.
    scopes: scopes::Scopes<'a>,
    params: Vec<ir::Param>,
    param_spans: Vec<Span>,
    param_used: Vec<bool>,
    param_index: scopes::FastMap<String, usize>,
    streams: Vec<Stream>,
    stream_spans: Vec<Span>,
    stream_index: scopes::FastMap<String, StreamId>,
    arrays: Vec<ArrayDecl>,
    array_index: scopes::FastMap<String, usize>,
    buffers: Vec<Buffer>,
    buffer_spans: Vec<Span>,
    caches: Vec<ir::cache::Cache>,
    /// Format copies of the experts made so far: (format, buffer, one expert's bytes).
    format_copies: Vec<(crate::model::Storage, BufferId, u64)>,
    /// `substitute` declarations.
    substitutes: Vec<ir::Substitute>,
    /// Set while a `fetch` or `prefetch` statement issues its copy.
    cache_op: Option<ir::cache::CacheOp>,
    /// Set while a `copy` of `.context()` / `.appended()` issues its task.
    kv_part: Option<ir::KvPart>,
    /// Set while `experts(.., ub = all, ..)` issues its task for one micro-batch.
    group_ub: Option<u32>,
    /// Op calls whose argument names are known well formed (all named, none twice, each
    /// one the op takes), by the statement's address: the checks of those names, which
    /// depend on the text alone, are made once per statement, not once per task.
    clean_calls: scopes::FastMap<usize, bool>,
    /// Each op kind's roles (`calls::Elaborator::op_roles`).
    op_roles: scopes::FastMap<calls::OpRolesKey, calls::OpRoles>,
    templates: scopes::FastMap<String, &'a TemplateDecl>,
    template_stack: Vec<String>,
    micro: Option<MicroBatches>,
    tasks: Vec<Task>,
    spans: ir::SpanTable,
    labels: labels::Labels<'a>,
    pending_after: Vec<PendingAfter<'a>>,
    guard: Vec<ir::GuardLit>,
    step: Option<(crate::syntax::ast::StepKind, ir::StepId)>,
    /// The latest `sync` of the current step: the last task of each stream issued before
    /// it (every later task of the step is ordered after them), and the keyword's span.
    sync: Option<(Vec<TaskId>, Span)>,
    steps: Vec<ir::Step>,
    diags: Vec<Diagnostic>,
    seen: HashSet<(Code, u32, u32)>,
    iterations: u64,
    /// Template expansions so far (bounded by `Limits::max_expansions`).
    expansions: u64,
    /// Errors reported so far, repeats included: a loop stops at the first iteration that
    /// reports one (every later iteration would repeat it, up to the iteration limit).
    errors: u64,
    aborted: bool,
    /// `rank(l, e)` of every key, built at the first call (see `ranks_over_layers`).
    rank_table: Option<Vec<u64>>,
    /// Set while a cache's eviction score is evaluated (`evict::eviction_score`).
    linear_scores: bool,
    /// Whether the current step decided a `routed(..)` comparison from its ceiling
    /// (`value::Context::routed_ceiling`).
    ceiling_relied: bool,
}

impl<'a> Elaborator<'a> {
    fn new(_file: &File, options: &'a Options) -> Self {
        let card = options.model.clone();
        let checkpoint = ir::CheckpointLayout::new(&card);
        let mut elab = Elaborator {
            options,
            card,
            checkpoint,
            scopes: scopes::Scopes::new(),
            params: Vec::new(),
            param_spans: Vec::new(),
            param_used: Vec::new(),
            param_index: scopes::fast_map(),
            streams: Vec::new(),
            stream_spans: Vec::new(),
            stream_index: scopes::fast_map(),
            arrays: Vec::new(),
            array_index: scopes::fast_map(),
            buffers: Vec::new(),
            buffer_spans: Vec::new(),
            caches: Vec::new(),
            format_copies: Vec::new(),
            substitutes: Vec::new(),
            cache_op: None,
            kv_part: None,
            group_ub: None,
            clean_calls: scopes::fast_map(),
            op_roles: scopes::fast_map(),
            templates: scopes::fast_map(),
            template_stack: Vec::new(),
            micro: None,
            tasks: Vec::new(),
            spans: ir::SpanTable::default(),
            labels: labels::Labels::new(),
            pending_after: Vec::new(),
            guard: Vec::new(),
            step: None,
            sync: None,
            steps: Vec::new(),
            diags: Vec::new(),
            seen: HashSet::new(),
            iterations: 0,
            expansions: 0,
            errors: 0,
            aborted: false,
            rank_table: None,
            linear_scores: false,
            ceiling_relied: false,
        };
        // The checkpoint is buffer 0, read-only, in pageable host memory.
        elab.arrays.push(ArrayDecl {
            name: "W".to_string(),
            dims: Vec::new(),
            first: BufferId(0),
            layout: Layout::Checkpoint,
            span: Span::default(),
        });
        elab.array_index.insert("W".to_string(), 0);
        elab.buffers.push(Buffer {
            name: "W".to_string(),
            array: "W".to_string(),
            index: Vec::new(),
            space: Space::Host,
            bytes: elab.checkpoint.total_bytes(),
            layout: Layout::Checkpoint,
            kind: BufferKind::Checkpoint,
            layer: None,
        });
        elab.buffer_spans.push(Span::default());
        elab
    }

    /// Records a diagnostic once per (code, span); stops elaboration after too many errors.
    fn report(&mut self, diagnostic: Diagnostic) {
        let span = diagnostic.primary_span().unwrap_or_default();
        if diagnostic.is_error() {
            self.errors += 1;
        }
        if self.seen.insert((diagnostic.code, span.start, span.end)) {
            self.diags.push(diagnostic);
        }
        if self.diags.iter().filter(|d| d.is_error()).count() >= MAX_ERRORS {
            self.aborted = true;
        }
    }

    fn run(&mut self, file: &'a File) {
        let Some(steps) = self.run_declarations(file) else {
            return;
        };
        if steps.is_empty() {
            self.report(Diagnostic::no_steps(file.name.span));
        }
        for decl in steps {
            if self.aborted {
                return;
            }
            self.run_step(decl);
        }
        // Deferred labels given twice: `elaborate` runs again with eager ones.
        if !self.labels.seal() {
            return;
        }
        self.resolve_after();
    }

    /// Declares every top-level item in order and gives the steps to run after them
    /// (`None` when elaboration aborted).
    fn run_declarations(&mut self, file: &'a File) -> Option<Vec<&'a StepDecl>> {
        let mut steps: Vec<&'a StepDecl> = Vec::new();
        for item in &file.items {
            if self.aborted {
                return None;
            }
            match item {
                Item::Param(decl) => self.declare_param(decl),
                Item::Stream(decl) => self.declare_stream(decl),
                Item::Buffer(decl) => self.declare_buffer(decl),
                Item::Cache(decl) => self.declare_cache(decl),
                Item::Substitute(decl) => self.declare_substitute(decl),
                Item::MicroBatches(decl) => self.declare_micro_batches(decl),
                Item::Template(decl) => self.declare_template(decl),
                Item::Let(stmt) => {
                    if let Err(d) = self.exec_let(stmt) {
                        self.report(d);
                    }
                }
                Item::Step(decl) => steps.push(decl),
            }
        }
        self.check_unknown_sets();
        Some(steps)
    }

    fn finish(self, file: &File) -> Result<Elaborated, Vec<Diagnostic>> {
        let mut diags = self.diags;
        // Used means named anywhere in the text: a param read only in a branch the other
        // params' current values drop is still the schedule's knob.
        let mentioned = file.mentioned_names();
        for (i, used) in self.param_used.iter().enumerate() {
            if !used && !mentioned.contains(self.params[i].name.as_str()) {
                diags.push(Diagnostic::unused_param(
                    self.param_spans[i],
                    &self.params[i].name,
                ));
            }
        }
        if diags.iter().any(Diagnostic::is_error) {
            return Err(diags);
        }
        let mut spans = self.spans;
        spans.buffers = self.buffer_spans;
        spans.streams = self.stream_spans;
        spans.params = self.param_spans;
        let card = &self.card;
        let expert_shares = self.options.profile.as_deref().map(|p| {
            (0..card.layers as u32)
                .map(|l| {
                    (0..card.experts as u32)
                        .map(|e| {
                            crate::ir::profile::expected_share(
                                Some(p),
                                card.top_k,
                                card.experts,
                                l,
                                e,
                            )
                        })
                        .collect()
                })
                .collect()
        });
        let program = ir::Program {
            name: file.name.name.clone(),
            description: file.description.clone().unwrap_or_default(),
            model: self.card,
            workload: self.options.workload,
            micro_batches: self.micro.unwrap_or(MicroBatches {
                count: 0,
                size: 0,
                mixed_tokens: 0,
            }),
            params: self.params,
            params_read: self.param_used,
            streams: self.streams,
            buffers: self.buffers,
            tasks: self.tasks,
            steps: self.steps,
            expert_shares,
            caches: self.caches,
            substitutes: self.substitutes,
            scratch: self.options.scratch,
            spans,
            layout: self.checkpoint,
            writers: std::sync::OnceLock::new(),
        };
        Ok((program, diags))
    }

    fn resolve_after(&mut self) {
        let pending = std::mem::take(&mut self.pending_after);
        for p in pending {
            match self.labels.get(&p.label) {
                None => self.report(Diagnostic::after_missing(p.span, &p.label.text())),
                Some(target) if target >= p.task => {
                    let target_span = self.spans.tasks[target.index()];
                    self.report(Diagnostic::after_later(
                        p.span,
                        &p.label.text(),
                        target_span,
                    ));
                }
                Some(target) => {
                    let task = &mut self.tasks[p.task.index()];
                    if !task.after.contains(&target) {
                        task.after.push(target);
                        self.spans.task_after[p.task.index()].push(p.span);
                    }
                }
            }
        }
    }

    fn lookup_name(&mut self, name: &str) -> Option<Val> {
        if let Some(v) = self.scopes.get(name) {
            return Some(v.clone());
        }
        if let Some(&i) = self.param_index.get(name) {
            self.param_used[i] = true;
            return Some(match self.params[i].value {
                ir::Scalar::Int(v) => Val::Int(v),
                ir::Scalar::Float(v) => Val::Float(v),
                ir::Scalar::Bool(v) => Val::Bool(v),
            });
        }
        if let Some(&decl) = self.array_index.get(name) {
            let array = &self.arrays[decl];
            if array.dims.is_empty() {
                let buffer = &self.buffers[array.first.index()];
                return Some(Val::Slice(SliceVal::of_buffer(
                    array.first,
                    buffer,
                    array.layout,
                )));
            }
            return Some(Val::Array {
                decl,
                indices: value::ArrayIndices::new(),
            });
        }
        let card = &self.card;
        let w = &self.options.workload;
        let symbol = match name {
            "layers" => card.layers,
            "dense_layers" => card.dense_layers.min(card.layers),
            "experts" => card.experts,
            "top_k" => card.top_k,
            "hidden" => card.hidden,
            "ffn" => card.ffn,
            "heads" => card.heads,
            "kv_heads" => card.kv_heads,
            "head_dim" => card.head_dim,
            "vocab" => card.vocab,
            "batch" => w.batch,
            "prompt_len" => w.prompt_len,
            "gen_len" => w.gen_len,
            _ => return None,
        };
        Some(Val::Int(i64::try_from(symbol).unwrap_or(i64::MAX)))
    }

    fn all_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.scopes.names().map(String::from).collect();
        names.extend(self.param_index.keys().cloned());
        names.extend(self.array_index.keys().cloned());
        names.extend(vocabulary::SYMBOLS.map(String::from));
        names.sort();
        names.dedup();
        names
    }

    fn eval(&mut self, expr: &crate::syntax::ast::Expr) -> Result<Val, Diagnostic> {
        value::eval(expr, self)
    }
}

impl value::Context for Elaborator<'_> {
    fn lookup(&mut self, name: &str, _span: Span) -> Result<Option<Val>, Diagnostic> {
        Ok(self.lookup_name(name))
    }

    fn hardware(&mut self, name: &str, span: Span) -> Result<Option<Val>, Diagnostic> {
        if self.options.hardware.is_empty() {
            if vocabulary::HARDWARE_PREFIXES
                .iter()
                .any(|p| name.starts_with(p))
            {
                return Err(Diagnostic::missing_hardware(span, name));
            }
            return Ok(None);
        }
        match self.options.hardware.get(name) {
            Some(&v) if v.fract() == 0.0 && v.abs() < 9.0e18 => Ok(Some(Val::Int(v as i64))),
            Some(&v) => Ok(Some(Val::Float(v))),
            None => {
                let known: Vec<&str> = self.options.hardware.keys().map(String::as_str).collect();
                Err(Diagnostic::unknown_name(
                    span,
                    "hardware symbol",
                    name,
                    &known,
                ))
            }
        }
    }

    fn names(&self) -> Vec<String> {
        self.all_names()
    }

    fn index_array(
        &mut self,
        decl: usize,
        mut indices: value::ArrayIndices,
        index: i64,
        span: Span,
    ) -> Result<Val, Diagnostic> {
        let array = &self.arrays[decl];
        let Some(&dim) = array.dims.get(indices.len()) else {
            return Err(Diagnostic::type_mismatch(
                span,
                "no more indices",
                "an index",
            ));
        };
        // The message's text only for an index out of range (this runs per task).
        if index < 0 || index as u64 >= u64::from(dim) {
            value::check_index(
                index,
                u64::from(dim),
                &format!("`{}` index", array.name),
                span,
            )?;
        }
        indices.push(index as u32);
        if indices.len() < array.dims.len() {
            return Ok(Val::Array { decl, indices });
        }
        let mut flat = 0u64;
        for (k, &ix) in indices.iter().enumerate() {
            flat = flat * u64::from(array.dims[k]) + u64::from(ix);
        }
        let id = BufferId(array.first.0 + flat as u32);
        let buffer = &self.buffers[id.index()];
        Ok(Val::Slice(SliceVal::of_buffer(id, buffer, array.layout)))
    }

    fn checkpoint(&self) -> ir::CheckpointLayout {
        self.checkpoint
    }

    fn card(&self) -> &ModelCard {
        &self.card
    }

    fn has_hardware(&self) -> bool {
        !self.options.hardware.is_empty()
    }

    fn profile(&self) -> Option<&crate::ir::profile::RoutingProfile> {
        self.options.profile.as_deref()
    }

    fn linear_scores(&self) -> bool {
        self.linear_scores
    }

    fn rank_over_layers(&mut self, layer: u32, expert: u32) -> u64 {
        let card = &self.card;
        let (layers, experts) = (card.layers as u32, card.experts as u32);
        let profile = self.options.profile.as_deref();
        let table = self.rank_table.get_or_insert_with(|| {
            let dense = card.dense_layers.min(card.layers) as u32;
            crate::ir::profile::ranks_over_layers(profile, layers, experts, dense)
        });
        // `rank` checked both indices against the card.
        table[layer as usize * experts as usize + expert as usize]
    }

    fn is_checkpoint(&self, buffer: BufferId) -> bool {
        buffer == BufferId(0)
    }

    fn format_copy(&mut self, format: crate::model::Storage) -> Result<(BufferId, u64), String> {
        if let Some((id, bytes)) = self
            .format_copies
            .iter()
            .find(|c| c.0 == format)
            .map(|c| (c.1, c.2))
        {
            return Ok((id, bytes));
        }
        let expert_bytes = format_expert_bytes(&self.card, format)?;
        let slots = self
            .checkpoint
            .layers
            .saturating_sub(self.checkpoint.dense_layers)
            * self.checkpoint.experts;
        let id = BufferId(self.buffers.len() as u32);
        let name = format!("W.{}", format.name().to_ascii_lowercase());
        self.buffers.push(Buffer {
            name: name.clone(),
            array: name,
            index: Vec::new(),
            space: Space::Host,
            bytes: slots * expert_bytes,
            layout: Layout::Experts {
                slots: slots as u32,
            },
            kind: BufferKind::FormatCopy { format },
            layer: None,
        });
        self.buffer_spans.push(Span::default());
        self.format_copies.push((format, id, expert_bytes));
        Ok((id, expert_bytes))
    }

    fn cache_of(&self, buffer: BufferId) -> Option<u32> {
        self.caches
            .iter()
            .position(|c| c.buffer == buffer)
            .map(|i| i as u32)
    }

    fn act_bytes(&self) -> u64 {
        self.options.act_bytes.max(1)
    }

    fn scratch(&self) -> Option<&'static dyn crate::ir::scratch::DeviceScratch> {
        self.options.scratch
    }

    fn catalog_scratch(&mut self, span: Span, bytes: u64) {
        // Once a program: every call stands in the same way.
        if !self
            .diags
            .iter()
            .any(|d| d.code == Code::LintCatalogScratch)
        {
            self.report(Diagnostic::catalog_scratch(span, bytes));
        }
    }

    fn routed_ceiling(&self, ub: Option<u32>) -> Option<u64> {
        use crate::ir::StepKind;
        if !self.options.routed_ceiling {
            return None;
        }
        let micro = self.micro.filter(|m| m.count > 0)?;
        // The step's tokens per micro-batch (`step_shape`): a decode micro-batch holds at
        // most `size` sequences of one new token each (the runtime's sequence cap); a
        // prefill or mixed one the declared tokens, which the runtime then enforces
        // (`ir::Step::routed_ceiling`).
        match self.step {
            Some((StepKind::Prefill | StepKind::Decode | StepKind::Mixed, _)) => {}
            _ => return None,
        }
        let tokens = self.step_shape().tokens;
        Some(match ub {
            Some(_) => tokens,
            None => tokens.saturating_mul(u64::from(micro.count)),
        })
    }

    fn ceiling_relied_on(&mut self) {
        self.ceiling_relied = true;
    }

    fn kv_bytes(&self) -> u64 {
        self.options
            .kv_bytes
            .unwrap_or(self.options.act_bytes)
            .max(1)
    }
}

/// One expert's bytes (padding included) when the card's experts are stored in `format`
/// (`model::layout::with_expert_storage`).
pub(crate) fn format_expert_bytes(
    card: &ModelCard,
    format: crate::model::Storage,
) -> Result<u64, String> {
    let card = crate::model::layout::with_expert_storage(card, format)?;
    Ok(ir::CheckpointLayout::new(&card).expert_bytes)
}
