//! The spanned abstract syntax tree of a `.sched` file.
//!
//! Takes nothing (plain data built by `syntax::parse`); gives owned nodes that carry the
//! byte [`Span`] of the text they came from, so every later diagnostic can point at the
//! source. Nothing here is evaluated: names are unresolved and expressions unevaluated.
//!
//! # The language in one screen
//!
//! ```text
//! schedule NAME "description"                // header, once, first
//! param ubs: int in 1..=4096 = 32  // doc     // typed (int|float|bool), range, default;
//!                                            //   overridable with `--set ubs=64`
//! stream gpu: gpu.compute                    // an in-order queue bound to an engine
//! buffer w_gpu[2]: gpu = layer_weights()     // arrays (any rank, length 0 allowed) in a space
//! microbatches n_ub of ubs [tokens t]        // n_ub micro-batches of ubs sequences
//! let slots = 2                              // a constant (top level or in a block)
//! template load(i, s) { ... }                // reusable statements, called as `load(1, 0)`
//! setup { ... }                              // once, first: resident weights
//! prefill { ... }  decode { ... }  step { ... }   // step templates (step = mixed, VSLPipe)
//!
//! for i in 0..layers { ... }                 // unrolled; ranges `a..b`, `a..=b`
//! if i + 1 < layers { ... } else { ... }     // static: one branch is kept;
//! if active(i, e) { ... }                    // dynamic: the tasks are guarded
//! pre_attn(layer = i, ub = j, w = w_gpu[i % 2], h = h[j], out = qkv[j]) on gpu as pa[i, j]
//! copy W[i + 1].page(j, n_ub) -> w_gpu[(i + 1) % 2].page(j, n_ub) on h2d after pa[i, j - 1] if j > 0
//! ```
//!
//! Expressions: int and float literals, `true`/`false`, `+ - * / %`, comparisons,
//! `&& || !`, ranges, lists `[a, b]`, calls (`min max ceil floor bytes`, size helpers
//! `hidden(n) qkv(n) attn_out(n) kv_cache(t) routing(n) logits(s) tokens(s)
//! layer_weights() dense_weights() expert_weights(m) embed_weights() head_weights()
//! gpu_scratch(n, s, c)`, run-time `hot(layer, rank)` and `active(layer, expert[, ub])`), indexing `b[i]`,
//! hardware symbols `gpu.mem`. The checkpoint is the built-in buffer `W`: `W.embed`,
//! `W.head`, `W[i]` (a layer); layer slices have fields `.pre .o .gate .attn .post .dense
//! .experts` and methods `.expert(e) .experts(a, b)`; any slice has `.page(k, n)` and
//! `.share(a, b)`. Model (`layers experts top_k hidden ffn heads kv_heads head_dim vocab`)
//! and workload (`batch prompt_len gen_len`) symbols are in scope.

pub use crate::ir::{ParamType, StepKind};
pub use crate::span::Span;

/// A name with the span where it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ident {
    /// The name.
    pub name: String,
    /// Where it is written.
    pub span: Span,
}

/// A whole `.sched` file.
#[derive(Debug, Clone, PartialEq)]
pub struct File {
    /// `schedule NAME`.
    pub name: Ident,
    /// The optional description string after the name (quotes removed).
    pub description: Option<String>,
    /// Top-level items in textual order.
    pub items: Vec<Item>,
}

/// One top-level declaration.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// `param NAME: TYPE in RANGE = DEFAULT`.
    Param(ParamDecl),
    /// `stream NAME: ENGINE`.
    Stream(StreamDecl),
    /// `buffer NAME[D1][D2]: SPACE = SIZE`.
    Buffer(BufferDecl),
    /// `cache NAME[SLOTS]: SPACE evict POLICY predict PREDICTOR`.
    Cache(CacheDecl),
    /// `substitute CLASS FORMAT`.
    Substitute(SubstituteDecl),
    /// `microbatches COUNT of SIZE`.
    MicroBatches(MicroBatchDecl),
    /// `template NAME(PARAMS) { ... }`.
    Template(TemplateDecl),
    /// `prefill { ... }`, `decode { ... }` or `step { ... }`.
    Step(StepDecl),
    /// A top-level `let`, visible to everything after it.
    Let(LetStmt),
}

/// `param NAME: TYPE in RANGE = DEFAULT`; the doc comment is the trailing `//` comment.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDecl {
    /// The param's name.
    pub name: Ident,
    /// Its declared type.
    pub ty: ParamType,
    /// Where the type is written.
    pub ty_span: Span,
    /// The allowed range (`1..=4096`), if any.
    pub range: Option<Expr>,
    /// The default value.
    pub default: Expr,
    /// The `//` comment on the same line after the declaration, if any.
    pub doc: Option<String>,
    /// The whole declaration.
    pub span: Span,
}

/// `stream NAME: ENGINE.KIND`.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamDecl {
    /// The stream's name.
    pub name: Ident,
    /// The engine as written (`gpu.copy_in`), checked by elaboration.
    pub engine: Ident,
    /// The whole declaration.
    pub span: Span,
}

/// `buffer NAME[D1][D2]: SPACE = SIZE`.
#[derive(Debug, Clone, PartialEq)]
pub struct BufferDecl {
    /// The buffer (array) name.
    pub name: Ident,
    /// Array dimensions, outermost first; empty for a single buffer.
    pub dims: Vec<Expr>,
    /// Per dimension, the name its index takes in the size expression (`[layers as l]`):
    /// each element is then sized on its own (`dense_weights(l)`).
    pub index_names: Vec<Option<Ident>>,
    /// The memory space as written (`gpu`, `pinned`, `host`).
    pub space: Ident,
    /// The size expression (bytes, usually from a size helper such as `hidden(ubs)`).
    pub size: Expr,
    /// The whole declaration.
    pub span: Span,
}

/// `cache NAME[SLOTS]: SPACE evict POLICY [predict PREDICTOR]`: an expert cache of SLOTS
/// expert-sized slots whose contents the runtime chooses (see `ir::cache`).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheDecl {
    /// The cache's name.
    pub name: Ident,
    /// Number of slots.
    pub slots: Expr,
    /// The memory space as written.
    pub space: Ident,
    /// The eviction policy.
    pub evict: Evict,
    /// The predictor of `NAME.predicted(..)`: a string; `None`: co-occurrence.
    pub predict: Option<Expr>,
    /// The whole declaration.
    pub span: Span,
}

/// How a cache chooses the resident expert a miss replaces.
#[derive(Debug, Clone, PartialEq)]
pub enum Evict {
    /// A policy named by a string expression (`"lru"`, `select(p == 0, "lru", "lfu")`).
    Named(Expr),
    /// `score(l, e) = EXPR`: the resident with the lowest score leaves; `l` and `e` name
    /// the layer and expert it ranks inside `EXPR`.
    Score {
        /// The name of the layer.
        layer: Ident,
        /// The name of the expert.
        expert: Ident,
        /// The score.
        score: Expr,
    },
}

/// `substitute CLASS FORMAT` (`substitute experts q4_k`): tasks may compute with the
/// weights of CLASS in FORMAT (`W[l].expert(e).format(q4_k)`, a copy made at load) where
/// the checkpoint's are expected. Lossy, so never implicit: without the declaration such a
/// use is *values::undeclared_substitute*.
#[derive(Debug, Clone, PartialEq)]
pub struct SubstituteDecl {
    /// The weight class as written (`experts`).
    pub class: Ident,
    /// The format as written (`q4_k`).
    pub format: Ident,
    /// The whole declaration.
    pub span: Span,
}

/// `microbatches COUNT of SIZE`: the batch is split into COUNT micro-batches of SIZE
/// sequences each; `ub` arguments of ops index them.
#[derive(Debug, Clone, PartialEq)]
pub struct MicroBatchDecl {
    /// Number of micro-batches.
    pub count: Expr,
    /// Sequences per micro-batch.
    pub size: Expr,
    /// `tokens T`: new tokens of one micro-batch in a mixed step (worst case); default SIZE.
    pub tokens: Option<Expr>,
    /// The whole declaration.
    pub span: Span,
}

/// `template NAME(P1, P2) { ... }`: statements expanded in place at each call.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateDecl {
    /// The template's name.
    pub name: Ident,
    /// Parameter names, bound positionally at the call.
    pub params: Vec<Ident>,
    /// The statements.
    pub body: Block,
    /// The whole declaration.
    pub span: Span,
}

/// `prefill { ... }` and friends.
#[derive(Debug, Clone, PartialEq)]
pub struct StepDecl {
    /// Which step.
    pub kind: StepKind,
    /// The statements.
    pub body: Block,
    /// The whole declaration.
    pub span: Span,
}

/// `{ stmt* }`.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// The statements in order.
    pub stmts: Vec<Stmt>,
    /// From `{` to `}`.
    pub span: Span,
}

/// One statement.
#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    /// `let NAME = EXPR`.
    Let(LetStmt),
    /// `for VAR in RANGE { ... }`.
    For(ForStmt),
    /// `if COND { ... } else { ... }`.
    If(IfStmt),
    /// `copy SRC -> DST on STREAM ...`: a copy task.
    Copy(CopyStmt),
    /// `NAME(args) on STREAM ...`: an op task, or a template call (no tail allowed).
    Call(CallStmt),
    /// `sync`: a full barrier; the span is the keyword's.
    Sync(Span),
}

/// `let NAME = EXPR`.
#[derive(Debug, Clone, PartialEq)]
pub struct LetStmt {
    /// The bound name.
    pub name: Ident,
    /// The value.
    pub value: Expr,
    /// The whole statement.
    pub span: Span,
}

/// `for VAR in RANGE { ... }`.
#[derive(Debug, Clone, PartialEq)]
pub struct ForStmt {
    /// The loop variable.
    pub var: Ident,
    /// The range expression (`0..layers`).
    pub range: Expr,
    /// The body, unrolled once per value.
    pub body: Block,
    /// The whole statement.
    pub span: Span,
}

/// `if COND { ... } else if COND { ... } else { ... }`: the first branch whose condition
/// holds is taken. The `else if` chain is a flat list (not nested `IfStmt`s) so that a long
/// chain is walked, cloned and dropped without recursion.
#[derive(Debug, Clone, PartialEq)]
pub struct IfStmt {
    /// The `if` branch, then each `else if` branch, in source order (never empty).
    pub branches: Vec<IfBranch>,
    /// Taken when no condition holds, if present.
    pub otherwise: Option<Block>,
    /// The whole statement.
    pub span: Span,
}

/// One `if COND { ... }` or `else if COND { ... }` branch of an [`IfStmt`].
#[derive(Debug, Clone, PartialEq)]
pub struct IfBranch {
    /// The condition (static bool, or a dynamic condition such as `active(i, e)`).
    pub cond: Expr,
    /// Taken when the condition holds and no earlier one did.
    pub block: Block,
}

/// What follows a task: `on STREAM as LABEL after LABEL, LABEL if COND`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskTail {
    /// The stream the task is issued on.
    pub on: Option<Ident>,
    /// A name for `after` clauses to refer to.
    pub label: Option<Label>,
    /// Explicit orderings that are not data dependencies.
    pub after: Vec<AfterItem>,
}

/// `NAME` or `NAME[i, j]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Label {
    /// The name.
    pub name: Ident,
    /// Index expressions.
    pub indices: Vec<Expr>,
    /// The whole label.
    pub span: Span,
}

/// One entry of an `after` clause, with an optional static condition.
#[derive(Debug, Clone, PartialEq)]
pub struct AfterItem {
    /// The task referred to.
    pub label: Label,
    /// Only wait when this is true (`after load[i, j - 1] if j > 0`).
    pub condition: Option<Expr>,
    /// The whole item.
    pub span: Span,
}

/// Which statement a [`CopyStmt`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// `copy`: bytes from one slice to another.
    Copy,
    /// `fetch`: make an expert resident in a cache slot (no-op on a hit).
    Fetch,
    /// `prefetch`: copy a predicted expert into a free cache slot if one is free.
    Prefetch,
}

/// `copy SRC -> DST tail`, `fetch SRC -> CACHE.slot(..) tail`, `prefetch ...`.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyStmt {
    /// Which of the three statements.
    pub kind: CopyKind,
    /// The slice read.
    pub src: Expr,
    /// The slice written.
    pub dst: Expr,
    /// Stream, label, after.
    pub tail: TaskTail,
    /// The whole statement.
    pub span: Span,
}

/// `NAME(args) tail`: an op from the catalog, or a template call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallStmt {
    /// The op or template name.
    pub name: Ident,
    /// The arguments as written.
    pub args: Vec<Arg>,
    /// Stream, label, after (must be empty for a template call).
    pub tail: TaskTail,
    /// Where the tail is written, for "templates take no `on`".
    pub tail_span: Span,
    /// The whole statement.
    pub span: Span,
}

/// `name = expr` or a positional `expr`.
#[derive(Debug, Clone, PartialEq)]
pub struct Arg {
    /// The role name for named arguments.
    pub name: Option<Ident>,
    /// The value.
    pub value: Expr,
    /// The whole argument.
    pub span: Span,
}

/// A binary operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    /// `..`
    RangeExclusive,
    /// `..=`
    RangeInclusive,
    /// `||`
    Or,
    /// `&&`
    And,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/` (integer division on ints, rounding toward zero)
    Div,
    /// `%` (remainder, always non-negative for positive divisors)
    Rem,
}

impl BinOp {
    /// The operator as written.
    pub fn as_str(self) -> &'static str {
        match self {
            BinOp::RangeExclusive => "..",
            BinOp::RangeInclusive => "..=",
            BinOp::Or => "||",
            BinOp::And => "&&",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
        }
    }
}

/// A prefix operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnOp {
    /// `-x`
    Neg,
    /// `!x`
    Not,
}

/// An expression with its span.
#[derive(Debug, Clone, PartialEq)]
pub struct Expr {
    /// What kind of expression.
    pub kind: ExprKind,
    /// Where it is written.
    pub span: Span,
}

/// The expression forms.
#[derive(Debug, Clone, PartialEq)]
pub enum ExprKind {
    /// An integer literal.
    Int(i64),
    /// A float literal.
    Float(f64),
    /// `true` / `false`.
    Bool(bool),
    /// A string literal (quotes removed).
    Str(String),
    /// A name: a let, loop variable, param, buffer, or model/workload symbol.
    Name(String),
    /// `[a, b, c]`.
    List(Vec<Expr>),
    /// `f(a, b)`: a built-in function (min, max, ceil, floor, hidden, hot, active, ...).
    Call(Ident, Vec<Expr>),
    /// `a OP b`.
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// `-a`, `!a`.
    Unary(UnOp, Box<Expr>),
    /// `a[i]`.
    Index(Box<Expr>, Box<Expr>),
    /// `a.name`.
    Field(Box<Expr>, Ident),
    /// `a.name(args)`.
    Method(Box<Expr>, Ident, Vec<Expr>),
}

impl File {
    /// Every name an expression of the file mentions (`ExprKind::Name`), wherever it
    /// stands: in a branch elaboration keeps or drops, behind `&&` or an `after ... if`.
    /// "Is this param used" is a question about the text, not about which branches the
    /// current values of the other params take.
    pub fn mentioned_names(&self) -> std::collections::HashSet<&str> {
        let mut names = std::collections::HashSet::new();
        for item in &self.items {
            match item {
                Item::Param(d) => {
                    d.range.iter().for_each(|e| e.collect_names(&mut names));
                    d.default.collect_names(&mut names);
                }
                Item::Stream(_) => {}
                Item::Buffer(d) => {
                    d.dims.iter().for_each(|e| e.collect_names(&mut names));
                    d.size.collect_names(&mut names);
                }
                Item::Cache(d) => {
                    d.slots.collect_names(&mut names);
                    match &d.evict {
                        Evict::Named(e) => e.collect_names(&mut names),
                        Evict::Score { score, .. } => score.collect_names(&mut names),
                    }
                    d.predict.iter().for_each(|e| e.collect_names(&mut names));
                }
                Item::Substitute(_) => {}
                Item::MicroBatches(d) => {
                    d.count.collect_names(&mut names);
                    d.size.collect_names(&mut names);
                    d.tokens.iter().for_each(|e| e.collect_names(&mut names));
                }
                Item::Template(d) => d.body.collect_names(&mut names),
                Item::Step(d) => d.body.collect_names(&mut names),
                Item::Let(s) => s.value.collect_names(&mut names),
            }
        }
        names
    }
}

impl Block {
    fn collect_names<'a>(&'a self, names: &mut std::collections::HashSet<&'a str>) {
        for stmt in &self.stmts {
            match stmt {
                Stmt::Let(s) => s.value.collect_names(names),
                Stmt::For(s) => {
                    s.range.collect_names(names);
                    s.body.collect_names(names);
                }
                Stmt::If(s) => {
                    for b in &s.branches {
                        b.cond.collect_names(names);
                        b.block.collect_names(names);
                    }
                    s.otherwise.iter().for_each(|b| b.collect_names(names));
                }
                Stmt::Copy(s) => {
                    s.src.collect_names(names);
                    s.dst.collect_names(names);
                    s.tail.collect_names(names);
                }
                Stmt::Call(s) => {
                    s.args.iter().for_each(|a| a.value.collect_names(names));
                    s.tail.collect_names(names);
                }
                Stmt::Sync(_) => {}
            }
        }
    }
}

impl TaskTail {
    fn collect_names<'a>(&'a self, names: &mut std::collections::HashSet<&'a str>) {
        let labels = self.label.iter().chain(self.after.iter().map(|a| &a.label));
        labels
            .flat_map(|l| &l.indices)
            .for_each(|e| e.collect_names(names));
        self.after
            .iter()
            .filter_map(|a| a.condition.as_ref())
            .for_each(|e| e.collect_names(names));
    }
}

impl Expr {
    fn collect_names<'a>(&'a self, names: &mut std::collections::HashSet<&'a str>) {
        match &self.kind {
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Bool(_) | ExprKind::Str(_) => {}
            ExprKind::Name(n) => {
                names.insert(n.as_str());
            }
            ExprKind::List(items) | ExprKind::Call(_, items) => {
                items.iter().for_each(|e| e.collect_names(names));
            }
            ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => {
                a.collect_names(names);
                b.collect_names(names);
            }
            ExprKind::Unary(_, a) | ExprKind::Field(a, _) => a.collect_names(names),
            ExprKind::Method(a, _, args) => {
                a.collect_names(names);
                args.iter().for_each(|e| e.collect_names(names));
            }
        }
    }
}
