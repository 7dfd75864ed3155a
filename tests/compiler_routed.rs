//! How `routed(l, e[, ub])` comparisons become guards: every comparison with a constant is
//! the atom "routed >= t", its negation, or a conjunction of the two, worked out by hand
//! for each operator and for the constant on either side; `>= 1` is `active`, `>= 0`
//! always holds (the task is unguarded) and `< 0` never does (nothing is issued).

use moec::compile::{ast_to_ir, source_to_ast, Options};
use moec::diag::Code;
use moec::ir::{ExpertRef, GuardAtom, GuardLit, Op};
use moec::model::card::ModelCard;

/// The guard of the one `experts` task of a schedule whose MoE block is
/// `if COND { experts(..) } else { experts(..) }` around expert 1 (the else arm is there
/// so the schedule covers expert 1 whatever the condition), as (then, else) literals.
fn guards(cond: &str) -> Vec<Vec<GuardLit>> {
    let program = elaborate(cond).unwrap_or_else(|d| panic!("`{cond}`: {}", d[0]));
    program
        .tasks
        .iter()
        .filter(|t| {
            matches!(
                t.op,
                Op::Experts {
                    set: moec::ir::ExpertSet::One(ExpertRef::Index(1)),
                    ..
                }
            )
        })
        .map(|t| t.guard.lits.clone())
        .collect()
}

/// Elaborates the schedule `guards` describes (elaboration only: the fragment samples
/// nothing, which the checker would report).
fn elaborate(cond: &str) -> Result<moec::ir::Program, Vec<moec::diag::Diagnostic>> {
    elaborate_with(cond, true)
}

/// [`elaborate`], with or without deciding comparisons from the step's ceiling
/// (`Options::routed_ceiling`).
fn elaborate_with(
    cond: &str,
    ceiling: bool,
) -> Result<moec::ir::Program, Vec<moec::diag::Diagnostic>> {
    let source = format!(
        r#"schedule routed_guard
microbatches 1 of 1
stream gpu: gpu.compute
stream h2d: gpu.copy_in
buffer emb: gpu = embed_weights()
buffer w: gpu = layer_weights()
buffer h: gpu = hidden(prompt_len)
buffer q: gpu = qkv(prompt_len)
buffer kv: gpu = kv_cache(prompt_len + gen_len)
buffer a: gpu = attn_out(prompt_len)
buffer r: gpu = routing(prompt_len)
buffer acc: gpu = expert_acc(prompt_len)
prefill {{
  copy W.embed -> emb on h2d
  copy W[0] -> w on h2d
  embed(ub = 0, w = emb, h = h) on gpu
  pre_attn(layer = 0, ub = 0, w = w, h = h, out = q) on gpu
  attn(layer = 0, ub = 0, part = prefill, qkv = q, kv = kv, out = a) on gpu
  o_proj(layer = 0, ub = 0, w = w, a = a, h = h) on gpu
  gate(layer = 0, ub = 0, w = w, h = h, route = r, acc = acc) on gpu
  experts(layer = 0, ub = 0, set = 0, w = w, route = r, acc = acc) on gpu
  if {cond} {{
    experts(layer = 0, ub = 0, set = 1, w = w, route = r, acc = acc) on gpu
  }} else {{
    experts(layer = 0, ub = 0, set = 1, w = w, route = r, acc = acc) on gpu
  }}
  experts(layer = 0, ub = 0, set = 2..experts, w = w, route = r, acc = acc) on gpu
  combine(layer = 0, ub = 0, route = r, acc = acc, h = h) on gpu
}}
"#
    );
    let mut options = Options::new(ModelCard::load("mixtral-tiny").expect("card"));
    options.routed_ceiling = ceiling;
    let ast = source_to_ast(&source)?;
    ast_to_ir(&ast, &options).map(|(program, _)| program)
}

fn at_least(t: u32, negated: bool) -> GuardLit {
    let (layer, expert, ub) = (0, ExpertRef::Index(1), None);
    let atom = if t == 1 {
        GuardAtom::Active { layer, expert, ub }
    } else {
        GuardAtom::Tokens {
            layer,
            expert,
            ub,
            at_least: t,
        }
    };
    GuardLit { atom, negated }
}

#[test]
fn each_comparison_is_a_threshold_atom() {
    // >= 5: atom 5; its else: not atom 5.
    assert_eq!(
        guards("routed(0, 1) >= 5"),
        vec![vec![at_least(5, false)], vec![at_least(5, true)]]
    );
    // > 4 is >= 5; < 5 is not >= 5; <= 4 is not >= 5.
    assert_eq!(guards("routed(0, 1) > 4")[0], vec![at_least(5, false)]);
    assert_eq!(guards("routed(0, 1) < 5")[0], vec![at_least(5, true)]);
    assert_eq!(guards("routed(0, 1) <= 4")[0], vec![at_least(5, true)]);
    // The constant on the left: 4 < routed is routed > 4.
    assert_eq!(guards("4 < routed(0, 1)")[0], vec![at_least(5, false)]);
    assert_eq!(guards("5 >= routed(0, 1)")[0], vec![at_least(6, true)]);
    // >= 1 is `active`, and > 0 too.
    assert_eq!(guards("routed(0, 1) >= 1")[0], vec![at_least(1, false)]);
    assert_eq!(guards("routed(0, 1) > 0")[0], vec![at_least(1, false)]);
}

#[test]
fn statically_decided_comparisons_keep_one_branch() {
    // >= 0 always holds: the then-branch is kept, unguarded.
    assert_eq!(guards("routed(0, 1) >= 0"), vec![Vec::<GuardLit>::new()]);
    // < 0 never holds: the else branch, unguarded.
    assert_eq!(guards("routed(0, 1) < 0"), vec![Vec::<GuardLit>::new()]);
}

/// The fragment's one micro-batch of one sequence holds at most `prompt_len` = 128 prompt
/// tokens in its prefill (the default workload), and a token routes to expert 1 at most
/// once, so `routed(0, 1) >= 129` can never hold: it is decided at compile time (only the
/// `else` arm is built, unguarded) and the step records the 128 tokens the runtime then
/// holds each micro-batch to. `>= 128` can hold and stays a run-time guard; so does `>=
/// 129` when the ceiling is not used.
#[test]
fn a_threshold_above_the_steps_tokens_never_holds() {
    let none = vec![Vec::<GuardLit>::new()];
    assert_eq!(guards("routed(0, 1) >= 129"), none);
    assert_eq!(guards("routed(0, 1, 0) > 128"), none);
    assert_eq!(guards("129 <= routed(0, 1, 0)"), none);
    // Its negation always holds: the then-branch, unguarded.
    assert_eq!(guards("routed(0, 1) < 129"), none);
    assert_eq!(guards("routed(0, 1) <= 1000000"), none);
    assert_eq!(
        guards("routed(0, 1) >= 128"),
        vec![vec![at_least(128, false)], vec![at_least(128, true)]]
    );
    // `== 128` is `>= 128 && < 129`, whose second literal always holds: one literal left,
    // so the `else` is its negation.
    assert_eq!(
        guards("routed(0, 1) == 128"),
        vec![vec![at_least(128, false)], vec![at_least(128, true)]]
    );
    let ceiling = |cond: &str, on: bool| {
        let program = elaborate_with(cond, on).unwrap_or_else(|d| panic!("`{cond}`: {}", d[0]));
        program.steps[0].routed_ceiling
    };
    assert_eq!(ceiling("routed(0, 1) >= 129", true), Some(128));
    assert_eq!(ceiling("routed(0, 1) >= 128", true), None);
    assert_eq!(ceiling("routed(0, 1) >= 129", false), None);
    let program = elaborate_with("routed(0, 1) >= 129", false).expect("elaborates");
    let expert_1 = |t: &&moec::ir::Task| {
        matches!(
            t.op,
            Op::Experts {
                set: moec::ir::ExpertSet::One(ExpertRef::Index(1)),
                ..
            }
        )
    };
    let guards: Vec<_> = program
        .tasks
        .iter()
        .filter(expert_1)
        .map(|t| t.guard.lits.clone())
        .collect();
    assert_eq!(
        guards,
        vec![vec![at_least(129, false)], vec![at_least(129, true)]]
    );
}

#[test]
fn equality_is_a_conjunction_and_has_no_else() {
    // `== 3` is `>= 3 && !(>= 4)`: a conjunction, whose `else` a guard cannot express.
    let errors = elaborate("routed(0, 1) == 3").expect_err("an else of a conjunction");
    assert_eq!(errors[0].code, Code::ElabDynamic, "{}", errors[0]);
    // `!=` is a disjunction: rejected whatever follows.
    let errors = elaborate("routed(0, 1) != 3").expect_err("a disjunction");
    assert_eq!(errors[0].code, Code::ElabDynamic, "{}", errors[0]);
    // Arithmetic on a count is rejected, naming the count.
    let errors = elaborate("routed(0, 1) * 2 >= 3").expect_err("arithmetic");
    assert_eq!(errors[0].code, Code::ElabDynamic, "{}", errors[0]);
}
