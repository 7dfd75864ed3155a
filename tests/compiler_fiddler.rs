//! What `moec check` proves about load-dependent arms and partial accumulators, shown on
//! edits of `schedules/fiddler.sched` (the small configuration: 2 layers, 3 micro-batches,
//! 6 resident experts): the two schedules issue 13 found passing the checker and then
//! running wrong are rejected, and so are a missing or a doubled arm and an arm decided
//! from routing nothing has read back. Each rendered diagnostic is pinned by a snapshot.

mod schedules_common;
use schedules_common as common;

use moec::diag::{render_all, Code};

fn source() -> String {
    common::read(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/fiddler.sched"))
}

/// `source` with `from` replaced by `to` (which must occur).
fn edit(source: &str, from: &str, to: &str) -> String {
    assert!(
        source.contains(from),
        "fiddler.sched no longer contains {from:?}"
    );
    source.replacen(from, to, 1)
}

/// The errors of an edited schedule: their codes and their rendering.
fn errors(name: &str, text: &str) -> (Vec<Code>, String) {
    let diags = match common::compile_small(text) {
        Ok(_) => panic!("{name}: the edited schedule passed the checker"),
        Err(diags) => diags,
    };
    let errors: Vec<_> = diags.into_iter().filter(|d| d.is_error()).collect();
    let codes = errors.iter().map(|d| d.code).collect();
    (codes, render_all(&errors, name, text))
}

#[test]
fn the_unedited_schedule_checks() {
    common::compile_small(&source()).unwrap_or_else(|d| panic!("{}", d[0]));
}

/// Issue 13's first schedule: the CPU accumulator copied over the GPU one after the GPU
/// experts wrote it. The tokens differed from the oracle's; now the copy is rejected,
/// naming the copy and the GPU expert whose output it destroys.
#[test]
fn a_cpu_accumulator_copied_over_the_gpu_one_is_rejected() {
    let text = edit(
        &source(),
        "copy acc_c[j] -> acc_cg[j] on h2d\n  combine(layer = l, ub = j, route = route[j], acc = [acc[j], acc_cg[j]], h = h[j]) on gpu",
        "copy acc_c[j] -> acc[j] on h2d\n  combine(layer = l, ub = j, route = route[j], acc = acc[j], h = h[j]) on gpu",
    );
    let (codes, rendered) = errors("fiddler_acc_copied_over", &text);
    assert!(codes.contains(&Code::ValuesLostOutput), "{rendered}");
    insta::assert_snapshot!(rendered);
}

/// Issue 13's second schedule: `hot(..)` used in `setup` to place experts. The run
/// failed with a missing weight; now elaboration rejects the run-time ranking.
#[test]
fn a_run_time_ranking_in_setup_is_rejected() {
    let text = edit(
        &source(),
        "copy d_pin[l % 2].expert(e) -> w_res[rank(l, e)] on h2d",
        "copy W[l].expert(hot(l, e)) -> w_res[rank(l, e)] on h2d",
    );
    let (codes, rendered) = errors("fiddler_hot_in_setup", &text);
    assert_eq!(codes, vec![Code::ElabDynamic], "{rendered}");
    insta::assert_snapshot!(rendered);
}

/// Without `after gated[l, j]` nothing orders the copy arm's weight copy after the gate
/// whose token count decides it: a compile error, never "unknown means run".
#[test]
fn an_arm_decided_before_its_gate_is_rejected() {
    let text = edit(&source(), " on pin after gated[l, j]", " on pin");
    let (codes, rendered) = errors("fiddler_arm_before_gate", &text);
    assert!(
        codes.iter().all(|c| *c == Code::ValuesRoutingUnknown),
        "{rendered}"
    );
    insta::assert_snapshot!(rendered);
}

/// Dropping the CPU arm leaves every non-resident expert with fewer tokens than the
/// threshold uncomputed; the diagnostic names the routed counts where that happens.
#[test]
fn a_missing_arm_is_rejected() {
    let text = edit(
        &source(),
        "experts(layer = l, ub = j, set = e, w = W[l].expert(e), route = route_c[j], acc = acc_c[j]) on cpu as on_cpu[l, j, e]",
        "",
    );
    let (codes, rendered) = errors("fiddler_missing_arm", &text);
    assert!(codes.contains(&Code::ValuesExpertCoverage), "{rendered}");
    assert!(rendered.contains("routed(0, 3, 0) is 1..=8"), "{rendered}");
    insta::assert_snapshot!(rendered);
}

/// Arms that overlap (`>= t` and an unconditional CPU run) compute an expert twice.
#[test]
fn overlapping_arms_are_rejected() {
    let text = edit(
        &source(),
        "      } else {\n        experts(",
        "      }\n      if true {\n        experts(",
    );
    let (codes, rendered) = errors("fiddler_overlapping_arms", &text);
    assert!(codes.contains(&Code::ValuesExpertCoverage), "{rendered}");
    assert!(rendered.contains("computed 2 times"), "{rendered}");
    insta::assert_snapshot!(rendered);
}

/// `!=` on a routed count is a disjunction, which a guard cannot express.
#[test]
fn a_not_equal_guard_is_rejected() {
    let text = edit(
        &source(),
        "if routed(l, e, j) >= t {",
        "if routed(l, e, j) != t {",
    );
    let (codes, rendered) = errors("fiddler_not_equal", &text);
    assert_eq!(codes, vec![Code::ElabDynamic], "{rendered}");
}

/// `buffer w_dense[layers as l]: gpu = dense_weights(l)`: on a card with a leading dense
/// layer (deepseek-v2-tiny: layer 0 dense) each slot is its own layer's `[pre | o | gate]`,
/// worked from the checkpoint layout: layer 0's gate holds the dense SwiGLU, the others
/// the router and shared expert, so the slots differ in size and the dense one is the
/// `dense_weights()` slot that holds any layer.
#[test]
fn per_layer_dense_slots_are_each_layers_own_size() {
    let card = moec::model::card::ModelCard::load("deepseek-v2-tiny").expect("card");
    let layout = moec::ir::CheckpointLayout::new(&card);
    assert!(layout.is_dense(0) && !layout.is_dense(1));
    let compiled = moec::compile::compile(&source(), &common::small_options(&source(), card))
        .unwrap_or_else(|d| panic!("{}", d[0]));
    let slots: Vec<_> = compiled
        .program
        .buffers
        .iter()
        .filter(|b| b.array == "w_dense")
        .collect();
    assert_eq!(slots.len() as u64, layout.layers);
    for (l, b) in slots.iter().enumerate() {
        assert_eq!(b.layer, Some(l as u32), "{}", b.name);
        assert_eq!(b.bytes, layout.dense_bytes_of(l as u64), "{}", b.name);
    }
    assert_eq!(slots[0].bytes, layout.slot_dense_bytes());
    assert!(slots[1].bytes < slots[0].bytes);
    let text = moec::ir::emit::to_text(&compiled.program, &compiled.info.dag);
    assert!(
        text.contains("w_dense[1]: gpu") && text.contains("Dense of layer 1"),
        "{text}"
    );
}

/// `dense_weights(l)` names a layer of the model; a layer past the last is an error at
/// the argument.
#[test]
fn a_dense_slot_of_a_layer_the_model_lacks_is_rejected() {
    let text = edit(
        &source(),
        "= dense_weights(l)",
        "= dense_weights(l + layers)",
    );
    let (codes, rendered) = errors("fiddler_dense_slot_layer", &text);
    // The first error is at the declaration (the uses of the undeclared array follow).
    assert_eq!(codes.first(), Some(&Code::ElabOutOfRange), "{rendered}");
    assert!(
        rendered.contains("layer 2 is out of range (0..2, the model's layers)"),
        "{rendered}"
    );
}
