//! Parser tests: every fixture parses; syntax errors say what was expected where.

use moec::syntax::parse_file;

#[test]
fn the_all_constructs_fixture_parses() {
    let source = std::fs::read_to_string("tests/fixtures/all_constructs.sched").unwrap();
    let file = parse_file(&source).unwrap_or_else(|d| panic!("{d}: {:?}", d.labels));
    assert_eq!(file.name.name, "all_constructs");
    assert!(file.items.len() > 20);
}

#[test]
fn comment_rulers_and_strings_are_not_nesting() {
    let source = format!(
        "schedule s \"{}\"\n// {}\nprefill {{ }}\n",
        "(".repeat(300),
        "-".repeat(300)
    );
    parse_file(&source).unwrap_or_else(|d| panic!("{d}"));
}

#[test]
fn an_unclosed_block_says_what_is_missing_at_the_end() {
    let source = "schedule s\nprefill {\n  for i in 0..2 {\n";
    let d = parse_file(source).unwrap_err();
    assert!(d.message.contains("end of the file"), "{}", d.message);
    assert!(d.labels[0].text.contains("`}`"), "{:?}", d.labels);
    assert_eq!(d.labels[0].span.start as usize, source.len());
}

#[test]
fn operators_bind_by_precedence_and_associate_left() {
    use moec::syntax::ast::{BinOp, ExprKind};
    let expr = moec::syntax::parse_expr("1 + 2 * 3 - 4 .. 10 - 1").unwrap();
    let ExprKind::Binary(BinOp::RangeExclusive, lhs, rhs) = expr.kind else {
        panic!("range at the top: {expr:?}")
    };
    let ExprKind::Binary(BinOp::Sub, sum, _) = lhs.kind else {
        panic!("left-assoc subtraction: {lhs:?}")
    };
    let ExprKind::Binary(BinOp::Add, _, product) = sum.kind else {
        panic!("{sum:?}")
    };
    assert!(matches!(product.kind, ExprKind::Binary(BinOp::Mul, _, _)));
    assert!(matches!(rhs.kind, ExprKind::Binary(BinOp::Sub, _, _)));
    assert!(moec::syntax::parse_expr("a && !b || c >= 2").is_ok());
    assert!(moec::syntax::parse_expr("1 +").is_err());
}

#[test]
fn spans_exclude_trailing_comments() {
    let source = "schedule s\nstream h2d: gpu.copy_in\nbuffer w: gpu = layer_weights()\nprefill {\n  copy W[0] -> w on h2d   // load\n}\n";
    let file = parse_file(source).unwrap();
    let moec::syntax::ast::Item::Step(step) = &file.items[2] else {
        panic!()
    };
    let moec::syntax::ast::Stmt::Copy(copy) = &step.body.stmts[0] else {
        panic!()
    };
    assert_eq!(
        &source[copy.span.start as usize..copy.span.end as usize],
        "copy W[0] -> w on h2d"
    );
}

/// Long operator and postfix chains build left-deep trees: each is refused at a fixed depth
/// with a `syntax::too_deep` diagnostic pointing into the chain (they overflowed the stack).
#[test]
fn long_operator_and_postfix_chains_are_refused_not_overflowing() {
    let cases = [
        format!("2{}", " + 0".repeat(15_000)),
        format!("true{}", " && true".repeat(30_000)),
        format!("x{}", ".a".repeat(15_000)),
        format!("x{}", "[0]".repeat(15_000)),
        format!("f(1{})", " * 2".repeat(15_000)),
    ];
    for expr in &cases {
        let source = format!("schedule s\nlet la = {expr}\ndecode {{ }}\n");
        let d = parse_file(&source).unwrap_err();
        assert_eq!(d.code.as_str(), "syntax::too_deep", "{}", d.message);
        assert!(d.message.contains("500"), "{}", d.message);
        let at = d.labels[0].span.start as usize;
        assert!(
            at > "schedule s\nlet la = ".len() && at < source.len(),
            "{at}"
        );
        // The same expression through `--set` is refused the same way.
        let d = moec::syntax::parse_expr(expr).unwrap_err();
        assert_eq!(d.code.as_str(), "syntax::too_deep");
    }
    // A chain within the limit still parses, left-associated.
    let ok = format!("2{}", " + 1".repeat(400));
    moec::syntax::parse_expr(&ok).unwrap_or_else(|d| panic!("{d}"));
}

/// `else if` is a flat list of branches: a chain of a thousand parses into one `IfStmt`
/// (10,000 nested ones overflowed the stack); past the limit it is refused.
#[test]
fn else_if_chains_are_flat_and_bounded() {
    use moec::syntax::ast::{Item, Stmt};
    let chain = |n: usize| {
        format!(
            "schedule s\ndecode {{\n if a {{ }}{} else {{ }}\n}}\n",
            " else if a { }".repeat(n)
        )
    };
    let file = parse_file(&chain(1000)).unwrap_or_else(|d| panic!("{d}"));
    let Some(Item::Step(step)) = file.items.last() else {
        panic!("a step: {:?}", file.items.last())
    };
    let [Stmt::If(stmt)] = step.body.stmts.as_slice() else {
        panic!("one if: {:?}", step.body.stmts)
    };
    assert_eq!(stmt.branches.len(), 1001);
    assert!(stmt.otherwise.is_some());
    let d = parse_file(&chain(10_000)).unwrap_err();
    assert_eq!(d.code.as_str(), "syntax::too_deep");
    assert!(d.message.contains("`else if`"), "{}", d.message);
}
