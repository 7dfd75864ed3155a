//! Parser tests: every fixture parses; syntax errors say what was expected where.

use moec::syntax::parse_file;

#[test]
fn the_all_constructs_fixture_parses() {
    let source = std::fs::read_to_string("tests/fixtures/all_constructs.sched").unwrap();
    let file = parse_file(&source).unwrap_or_else(|d| panic!("{d}: {:?}", d.labels));
    assert_eq!(file.name.name, "all_constructs");
    assert!(file.items.len() > 20);
}
