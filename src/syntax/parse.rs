//! From `.sched` text to the spanned AST.
//!
//! Takes source text; gives an [`ast::File`] or one syntax [`Diagnostic`] saying, in user
//! terms, what was expected where (line and column come from the span when rendered).
//! Follows pest_meta: pest parses, then one function per grammar rule builds the owned
//! AST. Never panics: every unexpected tree shape becomes a diagnostic.

use super::ast::*;
use crate::diag::Diagnostic;
use pest::iterators::Pair;
use pest::Parser as _;

#[derive(pest_derive::Parser)]
#[grammar = "../grammar/sched.pest"]
struct SchedParser;

type P<'i> = Pair<'i, Rule>;

/// Files longer than this are refused (spans are `u32`; nobody writes a 64 MiB schedule).
const MAX_SOURCE_BYTES: usize = 64 << 20;

/// Nesting deeper than this is refused so that deeply nested input cannot overflow the stack.
const MAX_NESTING: usize = 200;

/// Expression trees deeper than this are refused: elaboration walks them recursively, and a
/// 15,000-term `1 + 1 + ...` chain (a left-deep tree) would overflow the stack.
const MAX_EXPR_DEPTH: usize = 500;

/// An `if` with more `else if` branches than this is refused. The chain is a flat list, so
/// this is no stack bound; it bounds the guard each branch adds to the tasks after it.
const MAX_ELSE_IF: usize = 1000;

/// Parses a whole `.sched` file.
pub fn parse_file(source: &str) -> Result<File, Diagnostic> {
    if source.len() > MAX_SOURCE_BYTES {
        return Err(Diagnostic::source_too_large(source.len()));
    }
    if let Some(offset) = too_deep(source) {
        return Err(Diagnostic::nesting_too_deep(
            Span::new(offset, offset + 1),
            MAX_NESTING,
        ));
    }
    pest::set_error_detail(true);
    let mut pairs = SchedParser::parse(Rule::file, source).map_err(|e| syntax_error(source, e))?;
    let file = pairs.next().ok_or_else(|| internal(Span::default()))?;
    build_file(file, source)
}

/// Parses a single expression (used by `--set name=value`).
pub fn parse_expr(source: &str) -> Result<Expr, Diagnostic> {
    if let Some(offset) = too_deep(source) {
        return Err(Diagnostic::nesting_too_deep(
            Span::new(offset, offset + 1),
            MAX_NESTING,
        ));
    }
    pest::set_error_detail(true);
    let mut pairs = SchedParser::parse(Rule::expr, source).map_err(|e| syntax_error(source, e))?;
    let pair = pairs.next().ok_or_else(|| internal(Span::default()))?;
    let end = pair.as_span().end();
    if source[end..].trim().is_empty() {
        build_expr(pair)
    } else {
        let start = end + (source[end..].len() - source[end..].trim_start().len());
        Err(Diagnostic::unexpected_input(
            Span::new(start, start + 1),
            source[start..]
                .chars()
                .next()
                .map(String::from)
                .unwrap_or_default(),
            vec!["the end of the value".to_string()],
        ))
    }
}

/// Finds the first bracket nested deeper than [`MAX_NESTING`] (pest recurses per level).
fn too_deep(source: &str) -> Option<usize> {
    // Brackets and long prefix-operator chains (`!!!!...x`) both recurse in the parser;
    // comments and strings do not, so they are skipped.
    let bytes = source.as_bytes();
    let (mut depth, mut run, mut at) = (0usize, 0usize, 0usize);
    while at < bytes.len() {
        match bytes[at] {
            b'/' if bytes.get(at + 1) == Some(&b'/') => {
                while at < bytes.len() && bytes[at] != b'\n' {
                    at += 1;
                }
                continue;
            }
            b'"' => {
                at += 1;
                while at < bytes.len() && bytes[at] != b'"' && bytes[at] != b'\n' {
                    at += 1;
                }
                run = 0;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                run = 0;
                if depth > MAX_NESTING {
                    return Some(at);
                }
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                run = 0;
            }
            b'!' | b'-' => {
                run += 1;
                if run > MAX_NESTING {
                    return Some(at);
                }
            }
            b' ' | b'\t' | b'\n' | b'\r' => {}
            _ => run = 0,
        }
        at += 1;
    }
    None
}

/// User words for grammar rules, used in "expected ..." messages.
fn rule_words(rule: Rule) -> Option<&'static str> {
    Some(match rule {
        Rule::ident | Rule::keyword => "a name",
        Rule::expr | Rule::term | Rule::float | Rule::int | Rule::boolean | Rule::call | Rule::list
        | Rule::paren | Rule::string => "an expression",
        Rule::ty => "a type (`int`, `float` or `bool`)",
        Rule::engine => "an engine such as `gpu.compute`",
        Rule::header => "`schedule NAME`",
        Rule::param_decl | Rule::stream_decl | Rule::buffer_decl | Rule::cache_decl
        | Rule::substitute_decl | Rule::substitute_kw | Rule::micro_decl | Rule::template_decl | Rule::step_decl | Rule::step_kind => {
            "a declaration (`param`, `stream`, `buffer`, `cache`, `substitute`, `microbatches`, `let`, `template`, `setup`, `prefill`, `decode`, `step`)"
        }
        Rule::block => "a block `{ ... }`",
        Rule::let_stmt | Rule::for_stmt | Rule::if_stmt | Rule::copy_stmt | Rule::fetch_stmt
        | Rule::fetch_kind | Rule::sync_stmt | Rule::sync_kw | Rule::call_stmt => {
            "a statement (`let`, `for`, `if`, `copy`, `fetch`, `prefetch`, `sync` or a task)"
        }
        Rule::else_if | Rule::else_part => "`else`",
        Rule::arg => "an argument",
        Rule::task_tail | Rule::on_clause => "`on STREAM`",
        Rule::as_clause => "`as LABEL`",
        Rule::after_clause | Rule::after_item => "`after LABEL`",
        Rule::label => "a task label",
        Rule::range_incl | Rule::range_excl | Rule::or | Rule::and | Rule::eq | Rule::ne
        | Rule::le | Rule::ge | Rule::lt | Rule::gt | Rule::add | Rule::sub | Rule::mul
        | Rule::div | Rule::rem => "an operator",
        Rule::neg | Rule::not => "an expression",
        Rule::index | Rule::method | Rule::field => "`[`, `.` or an operator",
        Rule::dim => "`[SIZE]`",
        Rule::evict_score | Rule::score_kw => {
            "an eviction policy (a string such as `\"lru\"`, or `score(l, e) = EXPR`)"
        }
        Rule::buffer_dim => "`[SIZE]` or `[SIZE as NAME]`",
        Rule::EOI => "the end of the file",
        _ => return None,
    })
}

fn syntax_error(source: &str, error: pest::error::Error<Rule>) -> Diagnostic {
    let offset = match error.location {
        pest::error::InputLocation::Pos(p) => p,
        pest::error::InputLocation::Span((s, _)) => s,
    };
    let mut expected: Vec<String> = Vec::new();
    fn push_unique(expected: &mut Vec<String>, s: String) {
        if !expected.contains(&s) {
            expected.push(s);
        }
    }
    let mut offset = offset;
    if let Some(attempts) = error.parse_attempts() {
        offset = attempts.max_position.max(offset).min(source.len());
        for token in attempts.expected_tokens() {
            // Only literal tokens are worth showing; built-ins and char ranges are not.
            let token = token.to_string();
            let is_range = token.chars().count() == 4 && token.get(1..3) == Some("..");
            if !token.trim().is_empty()
                && token != "//"
                && token != "_"
                && token != "BUILTIN_RULE"
                && !is_range
            {
                push_unique(&mut expected, format!("`{token}`"));
            }
        }
        for stack in attempts.call_stacks() {
            let rule = stack.deepest.get_rule().copied();
            if let Some(words) = rule.and_then(rule_words) {
                push_unique(&mut expected, words.to_string());
            }
        }
    }
    let fallback = expected.is_empty();
    if fallback {
        if let pest::error::ErrorVariant::ParsingError { positives, .. } = &error.variant {
            for rule in positives {
                if let Some(words) = rule_words(*rule) {
                    push_unique(&mut expected, words.to_string());
                }
            }
        }
    }
    // Identify what was found: a word, a symbol or the end of the file.
    let rest = &source[offset.min(source.len())..];
    let found_len = if rest.is_empty() {
        0
    } else if rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
        rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len())
    } else {
        rest.chars().next().map_or(0, char::len_utf8)
    };
    let found = rest[..found_len].to_string();
    let span = Span::new(
        offset,
        offset + found_len.max(if rest.is_empty() { 0 } else { 1 }),
    );
    expected.sort_by_key(|s| (!s.starts_with('`'), s.clone()));
    Diagnostic::unexpected_input(span, found, expected)
}

fn internal(span: Span) -> Diagnostic {
    Diagnostic::unexpected_input(
        span,
        String::new(),
        vec!["a well-formed schedule".to_string()],
    )
}

fn span_of(pair: &P) -> Span {
    let start = pair.as_span().start();
    Span::new(start, start + trimmed_len(pair.as_str()))
}

/// Length of `text` without the whitespace and `//` comments pest lets a rule end with
/// when its last part is optional (`copy a -> b` followed by an empty task tail).
fn trimmed_len(text: &str) -> usize {
    let mut text = text.trim_end();
    loop {
        let line_start = text.rfind('\n').map_or(0, |i| i + 1);
        let line = &text[line_start..];
        match comment_start(line) {
            Some(at) => text = text[..line_start + at].trim_end(),
            None => return text.len(),
        }
    }
}

/// Byte offset of a `//` comment in one line, ignoring `//` inside string literals.
fn comment_start(line: &str) -> Option<usize> {
    let mut in_string = false;
    let bytes = line.as_bytes();
    for i in 0..bytes.len() {
        match bytes[i] {
            b'"' => in_string = !in_string,
            b'/' if !in_string && bytes.get(i + 1) == Some(&b'/') => return Some(i),
            _ => {}
        }
    }
    None
}

fn next<'i>(it: &mut pest::iterators::Pairs<'i, Rule>, span: Span) -> Result<P<'i>, Diagnostic> {
    it.next().ok_or_else(|| internal(span))
}

fn build_ident(pair: P) -> Ident {
    Ident {
        name: pair.as_str().to_string(),
        span: span_of(&pair),
    }
}

fn build_file(pair: P, source: &str) -> Result<File, Diagnostic> {
    let span = span_of(&pair);
    let mut inner = pair.into_inner();
    let header = next(&mut inner, span)?;
    let mut header_inner = header.into_inner();
    let name = build_ident(next(&mut header_inner, span)?);
    let description = header_inner.next().map(|s| unquote(s.as_str()));
    let mut items = Vec::new();
    for item in inner {
        let item_span = span_of(&item);
        items.push(match item.as_rule() {
            Rule::param_decl => Item::Param(build_param(item, source)?),
            Rule::stream_decl => {
                let mut it = item.into_inner();
                let name = build_ident(next(&mut it, item_span)?);
                let engine_pair = next(&mut it, item_span)?;
                let engine = Ident {
                    name: engine_pair.as_str().split_whitespace().collect::<String>(),
                    span: span_of(&engine_pair),
                };
                Item::Stream(StreamDecl {
                    name,
                    engine,
                    span: item_span,
                })
            }
            Rule::buffer_decl => {
                let mut it = item.into_inner().peekable();
                let name = build_ident(next_peek(&mut it, item_span)?);
                let mut dims = Vec::new();
                let mut index_names = Vec::new();
                while it.peek().is_some_and(|p| p.as_rule() == Rule::buffer_dim) {
                    let dim = next_peek(&mut it, item_span)?;
                    let dim_span = span_of(&dim);
                    let mut parts = dim.into_inner();
                    dims.push(build_expr(next(&mut parts, dim_span)?)?);
                    index_names.push(parts.next().map(build_ident));
                }
                let space = build_ident(next_peek(&mut it, item_span)?);
                let size = build_expr(next_peek(&mut it, item_span)?)?;
                Item::Buffer(BufferDecl {
                    name,
                    dims,
                    index_names,
                    space,
                    size,
                    span: item_span,
                })
            }
            Rule::cache_decl => {
                let mut it = item.into_inner();
                let name = build_ident(next(&mut it, item_span)?);
                let dim = next(&mut it, item_span)?;
                let dim_span = span_of(&dim);
                let slots = build_expr(next(&mut dim.into_inner(), dim_span)?)?;
                let space = build_ident(next(&mut it, item_span)?);
                let policy = next(&mut it, item_span)?;
                let evict = if policy.as_rule() == Rule::evict_score {
                    let policy_span = span_of(&policy);
                    let mut parts = policy.into_inner();
                    next(&mut parts, policy_span)?; // the keyword
                    let layer = build_ident(next(&mut parts, policy_span)?);
                    let expert = build_ident(next(&mut parts, policy_span)?);
                    let score = build_expr(next(&mut parts, policy_span)?)?;
                    Evict::Score {
                        layer,
                        expert,
                        score,
                    }
                } else {
                    Evict::Named(build_expr(policy)?)
                };
                let predict = it.next().map(build_expr).transpose()?;
                Item::Cache(CacheDecl {
                    name,
                    slots,
                    space,
                    evict,
                    predict,
                    span: item_span,
                })
            }
            Rule::substitute_decl => {
                let mut it = item.into_inner();
                next(&mut it, item_span)?; // the keyword
                let class = build_ident(next(&mut it, item_span)?);
                let format = build_ident(next(&mut it, item_span)?);
                Item::Substitute(SubstituteDecl {
                    class,
                    format,
                    span: item_span,
                })
            }
            Rule::micro_decl => {
                let mut it = item.into_inner();
                let count = build_expr(next(&mut it, item_span)?)?;
                let size = build_expr(next(&mut it, item_span)?)?;
                let tokens = it.next().map(build_expr).transpose()?;
                Item::MicroBatches(MicroBatchDecl {
                    tokens,
                    count,
                    size,
                    span: item_span,
                })
            }
            Rule::template_decl => {
                let mut params = Vec::new();
                let mut name = None;
                let mut body = None;
                for part in item.into_inner() {
                    match part.as_rule() {
                        Rule::ident if name.is_none() => name = Some(build_ident(part)),
                        Rule::ident => params.push(build_ident(part)),
                        Rule::block => body = Some(build_block(part)?),
                        _ => return Err(internal(item_span)),
                    }
                }
                let (Some(name), Some(body)) = (name, body) else {
                    return Err(internal(item_span));
                };
                Item::Template(TemplateDecl {
                    name,
                    params,
                    body,
                    span: item_span,
                })
            }
            Rule::step_decl => {
                let mut it = item.into_inner();
                let kind_pair = next(&mut it, item_span)?;
                let kind = match kind_pair.as_str().trim() {
                    "setup" => StepKind::Setup,
                    "prefill" => StepKind::Prefill,
                    "decode" => StepKind::Decode,
                    _ => StepKind::Mixed,
                };
                let body = build_block(next(&mut it, item_span)?)?;
                Item::Step(StepDecl {
                    kind,
                    body,
                    span: item_span,
                })
            }
            Rule::let_stmt => Item::Let(build_let(item)?),
            Rule::EOI => continue,
            _ => return Err(internal(item_span)),
        });
    }
    Ok(File {
        name,
        description,
        items,
    })
}

fn next_peek<'i>(
    it: &mut std::iter::Peekable<pest::iterators::Pairs<'i, Rule>>,
    span: Span,
) -> Result<P<'i>, Diagnostic> {
    it.next().ok_or_else(|| internal(span))
}

fn unquote(s: &str) -> String {
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s)
        .to_string()
}

/// The `//` comment on the rest of the line after `end`, if any: a param's documentation.
fn trailing_comment(source: &str, end: usize) -> Option<String> {
    let rest = source.get(end..)?;
    let line = rest.split('\n').next()?;
    let comment = line.trim_start().strip_prefix("//")?;
    Some(comment.trim().to_string()).filter(|c| !c.is_empty())
}

fn build_param(pair: P, source: &str) -> Result<ParamDecl, Diagnostic> {
    let span = span_of(&pair);
    let mut it = pair.into_inner();
    let name = build_ident(next(&mut it, span)?);
    let ty_pair = next(&mut it, span)?;
    let ty = match ty_pair.as_str() {
        "int" => ParamType::Int,
        "float" => ParamType::Float,
        _ => ParamType::Bool,
    };
    let ty_span = span_of(&ty_pair);
    let first = build_expr(next(&mut it, span)?)?;
    let (range, default) = match it.next() {
        Some(second) => (Some(first), build_expr(second)?),
        None => (None, first),
    };
    let doc = trailing_comment(source, span.end as usize);
    Ok(ParamDecl {
        name,
        ty,
        ty_span,
        range,
        default,
        doc,
        span,
    })
}

fn build_block(pair: P) -> Result<Block, Diagnostic> {
    let span = span_of(&pair);
    let stmts = pair
        .into_inner()
        .map(build_stmt)
        .collect::<Result<_, _>>()?;
    Ok(Block { stmts, span })
}

fn build_let(pair: P) -> Result<LetStmt, Diagnostic> {
    let span = span_of(&pair);
    let mut it = pair.into_inner();
    let name = build_ident(next(&mut it, span)?);
    let value = build_expr(next(&mut it, span)?)?;
    Ok(LetStmt { name, value, span })
}

fn build_stmt(pair: P) -> Result<Stmt, Diagnostic> {
    let span = span_of(&pair);
    Ok(match pair.as_rule() {
        Rule::let_stmt => Stmt::Let(build_let(pair)?),
        Rule::for_stmt => {
            let mut it = pair.into_inner();
            let var = build_ident(next(&mut it, span)?);
            let range = build_expr(next(&mut it, span)?)?;
            let body = build_block(next(&mut it, span)?)?;
            Stmt::For(ForStmt {
                var,
                range,
                body,
                span,
            })
        }
        Rule::if_stmt => Stmt::If(build_if(pair)?),
        Rule::sync_stmt => Stmt::Sync(span),
        Rule::copy_stmt | Rule::fetch_stmt => {
            let fetch = pair.as_rule() == Rule::fetch_stmt;
            let mut it = pair.into_inner();
            let kind = if fetch {
                match next(&mut it, span)?.as_str() {
                    "prefetch" => CopyKind::Prefetch,
                    _ => CopyKind::Fetch,
                }
            } else {
                CopyKind::Copy
            };
            let src = build_expr(next(&mut it, span)?)?;
            let dst = build_expr(next(&mut it, span)?)?;
            let tail = build_tail(next(&mut it, span)?)?;
            Stmt::Copy(CopyStmt {
                kind,
                src,
                dst,
                tail,
                span,
            })
        }
        Rule::call_stmt => {
            let mut name = None;
            let mut args = Vec::new();
            let mut tail = TaskTail::default();
            let mut tail_span = Span::new(span.end as usize, span.end as usize);
            for part in pair.into_inner() {
                match part.as_rule() {
                    Rule::ident => name = Some(build_ident(part)),
                    Rule::arg => args.push(build_arg(part)?),
                    Rule::task_tail => {
                        tail_span = span_of(&part);
                        tail = build_tail(part)?;
                    }
                    _ => return Err(internal(span)),
                }
            }
            let name = name.ok_or_else(|| internal(span))?;
            Stmt::Call(CallStmt {
                name,
                args,
                tail,
                tail_span,
                span,
            })
        }
        _ => return Err(internal(span)),
    })
}

fn build_if(pair: P) -> Result<IfStmt, Diagnostic> {
    let span = span_of(&pair);
    let mut branches = Vec::new();
    let mut otherwise = None;
    let mut it = pair.into_inner();
    let cond = build_expr(next(&mut it, span)?)?;
    let block = build_block(next(&mut it, span)?)?;
    branches.push(IfBranch { cond, block });
    for part in it {
        let part_span = span_of(&part);
        match part.as_rule() {
            Rule::else_if => {
                if branches.len() > MAX_ELSE_IF {
                    return Err(Diagnostic::else_if_chain_too_long(part_span, MAX_ELSE_IF));
                }
                let mut inner = part.into_inner();
                let cond = build_expr(next(&mut inner, part_span)?)?;
                let block = build_block(next(&mut inner, part_span)?)?;
                branches.push(IfBranch { cond, block });
            }
            Rule::else_part => {
                otherwise = Some(build_block(next(&mut part.into_inner(), part_span)?)?);
            }
            _ => return Err(internal(part_span)),
        }
    }
    Ok(IfStmt {
        branches,
        otherwise,
        span,
    })
}

fn build_arg(pair: P) -> Result<Arg, Diagnostic> {
    let span = span_of(&pair);
    let mut it = pair.into_inner();
    let first = next(&mut it, span)?;
    match it.next() {
        Some(value) => Ok(Arg {
            name: Some(build_ident(first)),
            value: build_expr(value)?,
            span,
        }),
        None => Ok(Arg {
            name: None,
            value: build_expr(first)?,
            span,
        }),
    }
}

fn build_label(pair: P) -> Result<Label, Diagnostic> {
    let span = span_of(&pair);
    let mut it = pair.into_inner();
    let name = build_ident(next(&mut it, span)?);
    let indices = it.map(build_expr).collect::<Result<_, _>>()?;
    Ok(Label {
        name,
        indices,
        span,
    })
}

fn build_tail(pair: P) -> Result<TaskTail, Diagnostic> {
    let mut tail = TaskTail::default();
    for clause in pair.into_inner() {
        let span = span_of(&clause);
        match clause.as_rule() {
            Rule::on_clause => tail.on = Some(build_ident(next(&mut clause.into_inner(), span)?)),
            Rule::as_clause => {
                tail.label = Some(build_label(next(&mut clause.into_inner(), span)?)?)
            }
            Rule::after_clause => {
                for item in clause.into_inner() {
                    let item_span = span_of(&item);
                    let mut it = item.into_inner();
                    let label = build_label(next(&mut it, item_span)?)?;
                    let condition = it.next().map(build_expr).transpose()?;
                    tail.after.push(AfterItem {
                        label,
                        condition,
                        span: item_span,
                    });
                }
            }
            _ => return Err(internal(span)),
        }
    }
    Ok(tail)
}

fn binop(rule: Rule) -> Option<(BinOp, u8)> {
    // Higher binds tighter; all binary operators are left-associative.
    Some(match rule {
        Rule::range_excl => (BinOp::RangeExclusive, 1),
        Rule::range_incl => (BinOp::RangeInclusive, 1),
        Rule::or => (BinOp::Or, 2),
        Rule::and => (BinOp::And, 3),
        Rule::eq => (BinOp::Eq, 4),
        Rule::ne => (BinOp::Ne, 4),
        Rule::lt => (BinOp::Lt, 4),
        Rule::le => (BinOp::Le, 4),
        Rule::gt => (BinOp::Gt, 4),
        Rule::ge => (BinOp::Ge, 4),
        Rule::add => (BinOp::Add, 5),
        Rule::sub => (BinOp::Sub, 5),
        Rule::mul => (BinOp::Mul, 6),
        Rule::div => (BinOp::Div, 6),
        Rule::rem => (BinOp::Rem, 6),
        _ => return None,
    })
}

/// Builds an `expr` pair (a whole expression; its depth is checked on the way).
fn build_expr(pair: P) -> Result<Expr, Diagnostic> {
    build_expr_depth(pair).map(|(expr, _)| expr)
}

/// `depth`, or the too-deep diagnostic at `span` when it exceeds [`MAX_EXPR_DEPTH`]. Checked
/// as each node is built, so no tree deeper than the limit ever exists (dropping one would
/// recurse as deep as building it).
fn within_depth(depth: usize, span: Span) -> Result<usize, Diagnostic> {
    if depth > MAX_EXPR_DEPTH {
        Err(Diagnostic::expression_too_deep(span, MAX_EXPR_DEPTH))
    } else {
        Ok(depth)
    }
}

/// Builds an `expr` pair by precedence climbing over its flat `term (op term)*` children;
/// gives the expression and its tree depth.
fn build_expr_depth(pair: P) -> Result<(Expr, usize), Diagnostic> {
    let span = span_of(&pair);
    match pair.as_rule() {
        Rule::expr => {}
        Rule::term => return build_term(pair),
        _ => return Err(internal(span)),
    }
    let mut operands: Vec<(Expr, usize)> = Vec::new();
    let mut operators: Vec<(BinOp, u8, Span)> = Vec::new();
    fn reduce(
        operands: &mut Vec<(Expr, usize)>,
        op: BinOp,
        op_span: Span,
        span: Span,
    ) -> Result<(), Diagnostic> {
        let (rhs, rhs_depth) = operands.pop().ok_or_else(|| internal(span))?;
        let (lhs, lhs_depth) = operands.pop().ok_or_else(|| internal(span))?;
        let depth = within_depth(1 + lhs_depth.max(rhs_depth), op_span)?;
        let span = lhs.span.join(rhs.span);
        operands.push((
            Expr {
                kind: ExprKind::Binary(op, Box::new(lhs), Box::new(rhs)),
                span,
            },
            depth,
        ));
        Ok(())
    }
    for part in pair.into_inner() {
        if let Some((op, prec)) = binop(part.as_rule()) {
            while let Some(&(top, top_prec, top_span)) = operators.last() {
                if top_prec >= prec {
                    operators.pop();
                    reduce(&mut operands, top, top_span, span)?;
                } else {
                    break;
                }
            }
            operators.push((op, prec, span_of(&part)));
        } else {
            operands.push(build_term(part)?);
        }
    }
    while let Some((op, _, op_span)) = operators.pop() {
        reduce(&mut operands, op, op_span, span)?;
    }
    match (operands.pop(), operands.is_empty()) {
        (Some(built), true) => Ok(built),
        _ => Err(internal(span)),
    }
}

/// The expressions of an argument or element list and the deepest one's depth.
fn build_expr_list<'i>(
    pairs: impl Iterator<Item = P<'i>>,
) -> Result<(Vec<Expr>, usize), Diagnostic> {
    let mut exprs = Vec::new();
    let mut depth = 0;
    for pair in pairs {
        let (expr, d) = build_expr_depth(pair)?;
        exprs.push(expr);
        depth = depth.max(d);
    }
    Ok((exprs, depth))
}

fn build_term(pair: P) -> Result<(Expr, usize), Diagnostic> {
    let span = span_of(&pair);
    let mut prefixes = Vec::new();
    let mut current: Option<(Expr, usize)> = None;
    for part in pair.into_inner() {
        let part_span = span_of(&part);
        match part.as_rule() {
            Rule::neg => prefixes.push((UnOp::Neg, part_span)),
            Rule::not => prefixes.push((UnOp::Not, part_span)),
            Rule::index | Rule::method | Rule::field => {
                let (base, base_depth) = current.take().ok_or_else(|| internal(span))?;
                let joined = base.span.join(part_span);
                let (kind, inner_depth) = match part.as_rule() {
                    Rule::index => {
                        let (index, d) =
                            build_expr_depth(next(&mut part.into_inner(), part_span)?)?;
                        (ExprKind::Index(Box::new(base), Box::new(index)), d)
                    }
                    Rule::method => {
                        let mut it = part.into_inner();
                        let name = build_ident(next(&mut it, part_span)?);
                        let (args, d) = build_expr_list(it)?;
                        (ExprKind::Method(Box::new(base), name, args), d)
                    }
                    _ => {
                        let name = build_ident(next(&mut part.into_inner(), part_span)?);
                        (ExprKind::Field(Box::new(base), name), 0)
                    }
                };
                let depth = within_depth(1 + base_depth.max(inner_depth), part_span)?;
                current = Some((Expr { kind, span: joined }, depth));
            }
            _ => current = Some(build_primary(part)?),
        }
    }
    let (mut expr, mut depth) = current.ok_or_else(|| internal(span))?;
    while let Some((op, op_span)) = prefixes.pop() {
        depth = within_depth(depth + 1, op_span)?;
        let joined = op_span.join(expr.span);
        expr = Expr {
            kind: ExprKind::Unary(op, Box::new(expr)),
            span: joined,
        };
    }
    Ok((expr, depth))
}

fn build_primary(pair: P) -> Result<(Expr, usize), Diagnostic> {
    let span = span_of(&pair);
    let text = pair.as_str();
    let (kind, inner_depth) = match pair.as_rule() {
        Rule::int => {
            let digits: String = text.chars().filter(|c| *c != '_').collect();
            let value = digits
                .parse()
                .map_err(|_| Diagnostic::bad_literal(span, text, "integer"))?;
            (ExprKind::Int(value), 0)
        }
        Rule::float => {
            let digits: String = text.chars().filter(|c| *c != '_').collect();
            let value: f64 = digits
                .parse()
                .map_err(|_| Diagnostic::bad_literal(span, text, "float"))?;
            if !value.is_finite() {
                return Err(Diagnostic::bad_literal(span, text, "float"));
            }
            (ExprKind::Float(value), 0)
        }
        Rule::boolean => (ExprKind::Bool(text == "true"), 0),
        Rule::string => (ExprKind::Str(unquote(text)), 0),
        Rule::ident => (ExprKind::Name(text.to_string()), 0),
        Rule::list => {
            let (items, d) = build_expr_list(pair.into_inner())?;
            (ExprKind::List(items), d)
        }
        Rule::paren => {
            let (inner, d) = build_expr_depth(next(&mut pair.into_inner(), span)?)?;
            return Ok((Expr { span, ..inner }, d));
        }
        Rule::call => {
            let mut it = pair.into_inner();
            let name = build_ident(next(&mut it, span)?);
            let (args, d) = build_expr_list(it)?;
            (ExprKind::Call(name, args), d)
        }
        _ => return Err(internal(span)),
    };
    let depth = within_depth(1 + inner_depth, span)?;
    Ok((Expr { kind, span }, depth))
}
