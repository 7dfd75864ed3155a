//! The launch order of each mission schedule, per stream, against its paper: the expected
//! sequences below are worked out BY HAND from the papers' algorithms for a small case
//! (2 layers, 3 micro-batches or batches; VSLPipe's two groups), not generated from the
//! schedules. An op is written as moec's `op(layer=.., ub=..)`; a copy as `src->dst` with
//! buffer names (`W` is the checkpoint).

mod schedules_common;
use schedules_common as common;

use moec::ir::{Op, Program};
use moec::syntax::ast::StepKind;

/// The tasks of the first step of `kind` on `stream`, in issue order.
fn stream_order(program: &Program, kind: StepKind, stream: &str) -> Vec<String> {
    let step = program
        .steps
        .iter()
        .find(|s| s.kind == kind)
        .expect("step present");
    let stream_id = program
        .streams
        .iter()
        .position(|s| s.name == stream)
        .expect("stream present");
    step.task_ids()
        .map(|id| &program.tasks[id.index()])
        .filter(|task| task.stream.index() == stream_id)
        .map(|task| match task.op {
            Op::Copy => {
                let name = |i: usize| {
                    program.buffers[task.args[i].slice.buffer.index()]
                        .name
                        .clone()
                };
                format!("{}->{}", name(0), name(1))
            }
            op => op.describe(),
        })
        .collect()
}

fn compiled(schedule: &str) -> Program {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("schedules/{schedule}.sched"));
    let source = common::read(&path);
    match common::compile_small(&source) {
        Ok(c) => c.program,
        Err(d) => panic!(
            "{schedule}: {}",
            moec::diag::render_all(&d, schedule, &source)
        ),
    }
}

fn expect(program: &Program, kind: StepKind, stream: &str, expected: &[&str]) {
    let got = stream_order(program, kind, stream);
    assert_eq!(
        got,
        expected,
        "stream `{stream}` of the {} step",
        kind.as_str()
    );
}

/// MoE-Lightning Alg. 1 (0-indexed), L = 2, n_ub = 3. Prologue: PreAttn/CPUAttn of (0, 0)
/// and (0, 1). Iteration (i, j): LoadH(i, j), W_PinToG(i+1, j), PostAttn(i, j), then
/// PreAttn/OffloadQKV/CPUAttn two micro-batches ahead ((0,0)->(0,2), (0,1)->(1,0),
/// (0,2)->(1,1), (1,0)->(1,2), nothing past the last layer), W_CToPin two pages ahead.
#[test]
#[rustfmt::skip] // rows of the expected order follow the paper's iterations
fn cgopipe_follows_algorithm_1() {
    let p = compiled("cgopipe");
    let d = StepKind::Decode;
    expect(&p, d, "gpu", &[
        "pre_attn(layer=0, ub=0)",
        "pre_attn(layer=0, ub=1)",
        "post_attn(layer=0, ub=0)", "pre_attn(layer=0, ub=2)",
        "post_attn(layer=0, ub=1)", "pre_attn(layer=1, ub=0)",
        "post_attn(layer=0, ub=2)", "pre_attn(layer=1, ub=1)",
        "post_attn(layer=1, ub=0)", "lm_head(ub=0)", "sample(ub=0)", "pre_attn(layer=1, ub=2)",
        "post_attn(layer=1, ub=1)", "lm_head(ub=1)", "sample(ub=1)",
        "post_attn(layer=1, ub=2)", "lm_head(ub=2)", "sample(ub=2)",
    ]);
    expect(&p, d, "cpu", &[
        "embed(ub=0)", "attn(layer=0, ub=0, part=decode)",
        "embed(ub=1)", "attn(layer=0, ub=1, part=decode)",
        "embed(ub=2)", "attn(layer=0, ub=2, part=decode)",
        "attn(layer=1, ub=0, part=decode)",
        "attn(layer=1, ub=1, part=decode)",
        "attn(layer=1, ub=2, part=decode)",
    ]);
    // D2 (LoadH) and D3 (W_PinToG, page j of the next layer) interleave on one queue; the
    // next token's layer 0 goes to slot 0 during layer 1.
    expect(&p, d, "h2d", &[
        "e_c[0]->h[0]", "e_c[1]->h[1]",
        "a_c[0]->a_g[0]", "w_pin[1]->w_gpu[1]", "e_c[2]->h[2]",
        "a_c[1]->a_g[1]", "w_pin[1]->w_gpu[1]",
        "a_c[2]->a_g[2]", "w_pin[1]->w_gpu[1]",
        "a_c[0]->a_g[0]", "w_pin[0]->w_gpu[0]",
        "a_c[1]->a_g[1]", "w_pin[0]->w_gpu[0]",
        "a_c[2]->a_g[2]", "w_pin[0]->w_gpu[0]",
    ]);
    // W_CToPin: layer 1 pages 0, 1 (prologue), 2 (iteration (0,0)); next token's layer 0
    // pages 0, 1, 2 (iterations (0,1), (0,2), (1,0)); its layer 1 is the next prologue's.
    expect(&p, d, "pin", &[
        "W->w_pin[1]", "W->w_pin[1]", "W->w_pin[1]", "W->w_pin[0]", "W->w_pin[0]", "W->w_pin[0]",
    ]);
    expect(&p, d, "d2h", &[
        "qkv_g[0]->qkv_c[0]", "qkv_g[1]->qkv_c[1]", "qkv_g[2]->qkv_c[2]", "qkv_g[0]->qkv_c[0]",
        "qkv_g[1]->qkv_c[1]", "tok[0]->tok_c[0]", "qkv_g[2]->qkv_c[2]", "tok[1]->tok_c[1]",
        "tok[2]->tok_c[2]",
    ]);
}

/// MoE-Lens Fig. 9 with L = 2 (alpha = ub 0, beta = ub 1): prologue GA_0(a), GA_0(b) |
/// C_0(a); stage 0: GB_0(a) GA_1(a) | C_0(b), then GB_0(b) GA_1(b) | C_1(a); epilogue
/// H(a) | C_1(b), then H(b).
#[test]
#[rustfmt::skip] // rows of the expected order follow the paper's iterations
fn vslpipe_follows_figure_9() {
    let p = compiled("vslpipe");
    let s = StepKind::Mixed;
    expect(&p, s, "gpu", &[
        "pre_attn(layer=0, ub=0)", "attn(layer=0, ub=0, part=prefill)",
        "pre_attn(layer=0, ub=1)", "attn(layer=0, ub=1, part=prefill)",
        "post_attn(layer=0, ub=0)", "pre_attn(layer=1, ub=0)", "attn(layer=1, ub=0, part=prefill)",
        "post_attn(layer=0, ub=1)", "pre_attn(layer=1, ub=1)", "attn(layer=1, ub=1, part=prefill)",
        "post_attn(layer=1, ub=0)", "lm_head(ub=0)", "sample(ub=0)",
        "post_attn(layer=1, ub=1)", "lm_head(ub=1)", "sample(ub=1)",
    ]);
    expect(&p, s, "cpu", &[
        "embed(ub=0)", "embed(ub=1)",
        "attn(layer=0, ub=0, part=decode)", // C_0(a), prologue
        "attn(layer=0, ub=1, part=decode)", // C_0(b), stage 0 phase 1
        "attn(layer=1, ub=0, part=decode)", // C_1(a), stage 0 phase 2
        "attn(layer=1, ub=1, part=decode)", // C_1(b), epilogue
    ]);
    // Data mover: prologue loads layer 0's post part (2 packets of 1 MiB here) and layer 1's
    // pre part; stage 0 loads layer 1's post part and the next pass's layer-0 pre part.
    expect(&p, s, "mover", &[
        "w_home[0]->wb[0]", "w_home[0]->wb[0]", "w_home[1]->wb[1]",
        "w_home[1]->wb[1]", "w_home[1]->wb[1]", "w_home[0]->wb[0]",
    ]);
}

/// FlexGen's generation_loop_overlap_multi_batch, L = 2, 3 batches: per (j, k) issue
/// load_weight(j+1) (k = 0 only), load_cache(k+1), store_hidden(k-1), load_hidden(k+1),
/// compute(k), store_cache(k-1); k+1 past the last batch is batch 0 of layer j+1, k-1 = -1
/// is the last batch of layer j-1; the last layer's hidden goes to lm_head, not home.
#[test]
#[rustfmt::skip] // rows of the expected order follow the paper's iterations
fn flexgen_follows_the_zigzag_loop() {
    let p = compiled("flexgen");
    let d = StepKind::Decode;
    expect(&p, d, "w_load", &["w_home[1]->w_gpu[1]", "w_home[0]->w_gpu[0]"]);
    expect(&p, d, "kv_load", &[
        "kv[0][0]->kv_g[0]", "hd_c[0]->hd_g[0]", // before the loop: batch 0 of layer 0
        "kv[0][1]->kv_g[1]", "hd_c[1]->hd_g[1]", // (0, 0)
        "kv[0][2]->kv_g[2]", "hd_c[2]->hd_g[2]", // (0, 1)
        "kv[1][0]->kv_g[0]", "hd_c[0]->hd_g[0]", // (0, 2): k + 1 wraps to layer 1
        "kv[1][1]->kv_g[1]", "hd_c[1]->hd_g[1]", // (1, 0)
        "kv[1][2]->kv_g[2]", "hd_c[2]->hd_g[2]", // (1, 1)
    ]);
    expect(&p, d, "kv_store", &[
        "hd_g[0]->hd_c[0]", "kv_g[0]->kv[0][0]", // (0, 1): store (0, 0)
        "hd_g[1]->hd_c[1]", "kv_g[1]->kv[0][1]", // (0, 2): store (0, 1)
        "hd_g[2]->hd_c[2]", "tok[0]->tok_c[0]", "kv_g[2]->kv[0][2]", // (1, 0): k - 1 = (0, 2)
        "tok[1]->tok_c[1]", "kv_g[0]->kv[1][0]", // (1, 1)
        "tok[2]->tok_c[2]", "kv_g[1]->kv[1][1]", // (1, 2)
        "kv_g[2]->kv[1][2]",                     // after the loop
    ]);
    let mut gpu = Vec::new();
    for (j, k) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)] {
        gpu.push(format!("pre_attn(layer={j}, ub={k})"));
        gpu.push(format!("attn(layer={j}, ub={k}, part=decode)"));
        gpu.push(format!("post_attn(layer={j}, ub={k})"));
        if j == 1 {
            gpu.push(format!("lm_head(ub={k})"));
            gpu.push(format!("sample(ub={k})"));
        }
    }
    let gpu: Vec<&str> = gpu.iter().map(String::as_str).collect();
    expect(&p, d, "gpu", &gpu);
}

/// Klotski Alg. 1 and Fig. 7(b), L = 2, 3 batches, Mixtral-tiny (8 experts, top-2):
/// per layer, attention for every batch; gate for every batch; then each expert over all
/// batches, in run-time rank order (hot first, then arrival), and the combine.
#[test]
#[rustfmt::skip] // rows of the expected order follow the paper's iterations
fn klotski_follows_algorithm_1() {
    let p = compiled("klotski");
    let d = StepKind::Decode;
    let mut gpu: Vec<String> = Vec::new();
    for l in 0..2 {
        for k in 0..3 {
            gpu.push(format!("pre_attn(layer={l}, ub={k})"));
            gpu.push(format!("attn(layer={l}, ub={k}, part=decode)"));
            gpu.push(format!("o_proj(layer={l}, ub={k})"));
        }
        for k in 0..3 {
            gpu.push(format!("gate(layer={l}, ub={k})"));
        }
        for rank in 0..8 {
            for k in 0..3 {
                gpu.push(format!("experts(layer={l}, ub={k}, set=hot({l}, {rank}))"));
            }
        }
        for k in 0..3 {
            gpu.push(format!("combine(layer={l}, ub={k})"));
        }
    }
    for k in 0..3 {
        gpu.push(format!("lm_head(ub={k})"));
        gpu.push(format!("sample(ub={k})"));
    }
    let gpu: Vec<&str> = gpu.iter().map(String::as_str).collect();
    expect(&p, d, "gpu", &gpu);
    // Weight prefetch stream: during Attention_l the gate and the K = 2 hot experts of layer
    // l (line 4); during Expert_l the next attention layer (the next token's layer 0 last).
    expect(&p, d, "w_load", &[
        "w_home[0]->w_dense[0]", "w_home[0]->w_exp[0]", "w_home[0]->w_exp[0]",
        "w_home[1]->w_dense[1]",
        "w_home[1]->w_dense[1]", "w_home[1]->w_exp[1]", "w_home[1]->w_exp[1]",
        "w_home[0]->w_dense[0]",
    ]);
    // Cold experts (ranks 2..8) after the gates, on their own stream.
    let cold: Vec<String> =
        (0..2).flat_map(|l| (2..8).map(move |_| format!("w_home[{l}]->w_exp[{l}]"))).collect();
    let cold: Vec<&str> = cold.iter().map(String::as_str).collect();
    expect(&p, d, "e_load", &cold);
}
