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
