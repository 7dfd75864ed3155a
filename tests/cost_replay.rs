//! The HRM replay of executed steps (`cost::replay`): per-micro-batch loads re-cost the
//! tasks, checked against times worked by hand from the catalog's formulas and the profile.

use moec::compile::{compile, Compiled, Options};
use moec::cost::hardware::{DispatchCosts, HardwareProfile, KernelRates, RowsRate};
use moec::cost::predict::{predict, CostSettings, DecodeContext};
use moec::cost::replay::{predict_run, predict_step_at};
use moec::ir::cache::CacheOp;
use moec::ir::{TaskId, Workload};
use moec::model::card::ModelCard;
use moec::records::{RunStats, StepRecord, TaskRecord, UbLoad};
use moec::syntax::ast::StepKind;

/// Two micro-batches of two sequences, every task on one CPU stream over host buffers, so
/// a step's makespan is the sum of its task times.
const ONE_STREAM: &str = r#"
schedule one_stream "every task on one CPU stream"

microbatches 2 of 2

stream cpu: cpu.compute

let ctx = prompt_len + gen_len
let pre = 2 * prompt_len

buffer h[2]:   host = hidden(pre)
buffer qkv:    host = qkv(pre)
buffer a:      host = attn_out(pre)
buffer logit:  host = logits(2)
buffer tok[2]: host = tokens(2)
buffer kv[layers][2]: host = kv_cache(2 * ctx)

template forward(part, dec) {
  for j in 0..2 {
    if dec == 1 {
      embed(ub = j, w = W.embed, tokens = tok[j], h = h[j]) on cpu
    } else {
      embed(ub = j, w = W.embed, h = h[j]) on cpu
    }
    for l in 0..layers {
      pre_attn(layer = l, ub = j, w = W[l], h = h[j], out = qkv) on cpu
      attn(layer = l, ub = j, part = part, qkv = qkv, kv = kv[l][j], out = a) on cpu
      post_attn(layer = l, ub = j, w = W[l], a = a, h = h[j]) on cpu
    }
    lm_head(ub = j, w = W.head, h = h[j], logits = logit) on cpu
    sample(ub = j, logits = logit, tokens = tok[j]) on cpu
  }
}

prefill { forward(prefill, 0) }
decode { forward(decode, 1) }
"#;

fn compiled(source: &str, prompt_len: u64, gen_len: u64) -> Compiled {
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.workload = Workload {
        batch: 4,
        prompt_len,
        gen_len,
    };
    compile(source, &options).unwrap_or_else(|d| panic!("{d:?}"))
}

fn deps(c: &Compiled) -> Vec<Vec<TaskId>> {
    (0..c.program.tasks.len())
        .map(|t| {
            c.info
                .dag
                .preds(TaskId::new(t))
                .iter()
                .map(|d| d.from)
                .collect()
        })
        .collect()
}

/// T4 with a slow CPU: 1 GFLOP/s f32, 1.5 GB/s DRAM (round numbers for hand work).
fn slow_cpu() -> HardwareProfile {
    let mut p = HardwareProfile::load("t4").unwrap();
    p.cpu.f32_tflops = 1e-3;
    p.cpu.half_tflops = 1e-3;
    p.cpu.mem_bw_gb_s = 1.5;
    p
}

fn step(c: &Compiled, kind: StepKind) -> usize {
    c.program.steps.iter().position(|s| s.kind == kind).unwrap()
}

fn decoding(seqs: usize, context_each: usize) -> UbLoad {
    UbLoad {
        decode_seqs: seqs,
        decode_context: seqs * context_each,
        ..UbLoad::default()
    }
}

/// mixtral-tiny: q = 4 heads x 32 = 128, kv = 2 x 32 = 64, f32 activations (4 bytes).
/// Decode attention of 2 sequences attending to 50 tokens each, on the CPU:
///   flops = 4 q n c = 4 * 128 * 2 * 50 = 51200 -> 51.2 us at 1 GFLOP/s;
///   bytes = qkv n (q + 2kv) 4 = 2048, kv append n 2kv 4 = 1024 + read s c 2kv 4 = 51200,
///           out n q 4 = 1024 -> 55296 B -> 36.864 us at 1.5 GB/s;
///   time = max = 51.2 us (compute bound), 4 layers -> 204.8 us. The empty ub costs 0.
/// Prefill attention of 2 prompts, 10 tokens (mean 5):
///   flops = 4 q s c (c + 1) / 2 = 4 * 128 * 2 * 15 = 15360 -> 15.36 us;
///   bytes = qkv 10 * 256 * 4 = 10240, kv append 10 * 128 * 4 = 5120 + read 2 * 5 * 128 * 4
///           = 5120, out 10 * 128 * 4 = 5120 -> 25600 B -> 17.0667 us (memory bound);
///   4 layers -> 68.2667 us.
/// lm_head of the 2 decoding sequences (vocab 32000, hidden 128, bf16 head):
///   flops = 4 s h + 2 s h vocab = 1024 + 16384000 -> 16.385024 ms (compute bound: bytes
///   = head (32000 * 128 + 128) * 2 + h 2 * 128 * 4 + logits 2 * 32000 * 4 = 8449280 B ->
///   5.63 ms); the empty micro-batch's lm_head costs 0.
#[test]
fn attention_at_a_measured_load_matches_the_hand_worked_roofline() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let profile = slow_cpu();
    let settings = CostSettings::default();
    let decode = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Decode),
        &profile,
        &settings,
        &[decoding(2, 50), UbLoad::default()],
    )
    .unwrap();
    let attn = decode.op_seconds["attn"].0;
    assert!((attn - 204.8e-6).abs() < 1e-9, "decode attn {attn}");
    assert_eq!(decode.op_seconds["attn"].1, "compute");
    let head = decode.op_seconds["lm_head"].0;
    assert!((head - 16.385024e-3).abs() < 1e-9, "lm_head {head}");

    let prefill_load = UbLoad {
        prefill_seqs: 2,
        prefill_tokens: 10,
        ..UbLoad::default()
    };
    let prefill = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Prefill),
        &profile,
        &settings,
        &[UbLoad::default(), prefill_load],
    )
    .unwrap();
    let attn = prefill.op_seconds["attn"].0;
    assert!(
        (attn - 4.0 * 25600.0 / 1.5e9).abs() < 1e-9,
        "prefill attn {attn}"
    );

    // One stream: the step takes the sum of its tasks' times.
    for p in [&decode, &prefill] {
        let sum: f64 = p.op_seconds.values().map(|v| v.0).sum();
        assert!((p.seconds - sum).abs() < 1e-12 * sum.max(1.0), "{p:?}");
    }
}

/// Every micro-batch full at the declared context is the declared worst case itself: the
/// replay and `predict` take the same path.
#[test]
fn a_full_load_at_the_declared_context_reproduces_the_worst_case() {
    for (source, name) in [
        (ONE_STREAM.to_string(), "one_stream"),
        (
            std::fs::read_to_string("schedules/cgopipe.sched").unwrap(),
            "cgopipe",
        ),
    ] {
        let c = compiled(&source, 24, 8);
        let deps = deps(&c);
        let profile = HardwareProfile::load("t4").unwrap();
        let settings = CostSettings {
            decode_context: DecodeContext::WorstCase,
        };
        let declared = predict(&c.program, &deps, &profile, &settings).unwrap();
        let mb = c.program.micro_batches;
        let full = vec![decoding(mb.size as usize, 24 + 8); mb.count as usize];
        let index = step(&c, StepKind::Decode);
        let replayed =
            predict_step_at(&c.program, &deps, index, &profile, &settings, &full).unwrap();
        let worst = declared.step_seconds.unwrap();
        assert!(
            (replayed.seconds - worst).abs() <= 1e-12 * worst,
            "{name}: replay {} vs declared {worst}",
            replayed.seconds
        );
    }
}

/// One sequence in one micro-batch, the others empty: less work than every micro-batch
/// full, so a shorter step, for the static and the mixed (VSLPipe) schedule.
#[test]
fn one_busy_micro_batch_predicts_less_than_the_declared_worst_case() {
    for (name, kind) in [
        ("cgopipe", StepKind::Decode),
        ("vslpipe", StepKind::Mixed),
        ("flexgen", StepKind::Decode),
    ] {
        let source = std::fs::read_to_string(format!("schedules/{name}.sched")).unwrap();
        let c = compiled(&source, 24, 8);
        let deps = deps(&c);
        let profile = HardwareProfile::load("t4").unwrap();
        let settings = CostSettings::default();
        let declared = predict(&c.program, &deps, &profile, &settings).unwrap();
        let mut loads = vec![UbLoad::default(); c.program.micro_batches.count as usize];
        loads[0] = decoding(1, 30);
        let index = step(&c, kind);
        let one = predict_step_at(&c.program, &deps, index, &profile, &settings, &loads).unwrap();
        // `predict` costs a mixed step at the scheduler's steady state, not its worst case;
        // the worst case is every micro-batch full of prompt tokens, replayed.
        let worst = if kind == StepKind::Mixed {
            let mb = c.program.micro_batches;
            let full = UbLoad {
                prefill_seqs: mb.size as usize,
                prefill_tokens: mb.mixed_tokens as usize,
                ..UbLoad::default()
            };
            let full = vec![full; mb.count as usize];
            predict_step_at(&c.program, &deps, index, &profile, &settings, &full)
                .unwrap()
                .seconds
        } else {
            declared.steps[index].seconds
        };
        assert!(
            one.seconds < worst,
            "{name}: one sequence {} vs worst case {worst}",
            one.seconds
        );
    }
}

fn record(kind: StepKind, seconds: f64, ubs: Vec<UbLoad>) -> StepRecord {
    StepRecord {
        kind,
        start: 0.0,
        end: seconds,
        prefill_tokens: ubs.iter().map(|u| u.prefill_tokens).sum(),
        decode_tokens: ubs.iter().map(|u| u.decode_seqs).sum(),
        ubs,
        tasks: Vec::new(),
        split: None,
    }
}

/// A run of prefill + three decode steps (two with identical loads): the run's predicted
/// seconds are the sum of its steps predicted one by one, tokens/s divides the generated
/// tokens by them, and identical loads are simulated once.
#[test]
fn a_run_is_the_sum_of_its_steps_at_their_own_loads() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let profile = slow_cpu();
    let settings = CostSettings::default();
    let prefill = vec![
        UbLoad {
            prefill_seqs: 2,
            prefill_tokens: 30,
            ..UbLoad::default()
        },
        UbLoad {
            prefill_seqs: 1,
            prefill_tokens: 7,
            ..UbLoad::default()
        },
    ];
    let d1 = vec![decoding(2, 16), decoding(1, 8)];
    let d2 = vec![decoding(2, 17), UbLoad::default()];
    let stats = RunStats {
        steps: vec![
            record(StepKind::Prefill, 0.5, prefill.clone()),
            record(StepKind::Decode, 0.25, d1.clone()),
            record(StepKind::Decode, 0.25, d1.clone()),
            record(StepKind::Decode, 0.125, d2.clone()),
        ],
        wall: 1.25,
        ..RunStats::default()
    };
    let generated = 3 + 3 + 3 + 2;
    let run = predict_run(&c.program, &deps, &profile, &settings, &stats, generated).unwrap();
    let at = |kind, loads: &[UbLoad]| {
        predict_step_at(
            &c.program,
            &deps,
            step(&c, kind),
            &profile,
            &settings,
            loads,
        )
        .unwrap()
        .seconds
    };
    let (p, a, b) = (
        at(StepKind::Prefill, &prefill),
        at(StepKind::Decode, &d1),
        at(StepKind::Decode, &d2),
    );
    let total = p + 2.0 * a + b;
    assert!((run.predicted_seconds - total).abs() < 1e-12 * total);
    assert_eq!(run.simulations, 3);
    assert!((run.predicted_tokens_per_s - generated as f64 / total).abs() < 1e-9);
    assert!((run.measured_tokens_per_s - generated as f64 / 1.25).abs() < 1e-12);
    let decode = run.decode_step.as_ref().unwrap();
    assert_eq!((decode.which.as_str(), decode.steps), ("decode", 3));
    assert!((decode.measured_seconds - 0.625 / 3.0).abs() < 1e-12);
    assert!((decode.predicted_seconds - (2.0 * a + b) / 3.0).abs() < 1e-12 * total);
    let kinds: Vec<(&str, usize)> = run
        .kinds
        .iter()
        .map(|k| (k.kind.as_str(), k.steps))
        .collect();
    assert_eq!(kinds, [("prefill", 1), ("decode", 3)]);
    // Fewer decoding sequences at a shorter context: a shorter step.
    assert!(b < a, "{b} vs {a}");
}

/// The step's tasks as the runtime records them: each ran and took `each` seconds.
fn ran_tasks(c: &moec::compile::Compiled, kind: StepKind, each: f64) -> Vec<TaskRecord> {
    let s = &c.program.steps[step(c, kind)];
    (s.first..s.first + s.count)
        .enumerate()
        .map(|(k, t)| {
            let task = TaskId::new(t as usize);
            TaskRecord {
                task,
                stream: c.program.task(task).stream,
                start: k as f64 * each,
                end: (k + 1) as f64 * each,
                ran: true,
                hit: false,
            }
        })
        .collect()
}

/// Each step kind carries its own per-op breakdown (what a user reads to see where a
/// batch-1 decode step's time goes, which the run-wide one mixes with prefill's). One
/// prefill (2 prompts of 5 tokens in micro-batch 1) and two decode steps (2 sequences at
/// context 50 in micro-batch 0); each task measured 1 ms in prefill and 2 ms in decode.
/// Per kind: attention ran 2 micro-batches x 4 layers = 8 times per step, so prefill
/// 8 runs measured 8 ms, decode 16 runs measured 32 ms; predicted prefill 4 x 25600 B /
/// 1.5 GB/s = 68.2667 us and decode 2 x 204.8 us (the hand-worked roofline above; empty
/// micro-batches cost nothing). The run-wide line is their sum: 24 runs, 40 ms.
#[test]
fn each_step_kind_has_its_own_op_breakdown_by_hand() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let profile = slow_cpu();
    let prefill_load = UbLoad {
        prefill_seqs: 2,
        prefill_tokens: 10,
        ..UbLoad::default()
    };
    let with_tasks = |kind, each, ubs| StepRecord {
        tasks: ran_tasks(&c, kind, each),
        ..record(kind, 1.0, ubs)
    };
    let decode_loads = vec![decoding(2, 50), UbLoad::default()];
    let stats = RunStats {
        steps: vec![
            with_tasks(
                StepKind::Prefill,
                1e-3,
                vec![UbLoad::default(), prefill_load],
            ),
            with_tasks(StepKind::Decode, 2e-3, decode_loads.clone()),
            with_tasks(StepKind::Decode, 2e-3, decode_loads),
        ],
        wall: 3.0,
        ..RunStats::default()
    };
    let run = predict_run(
        &c.program,
        &deps,
        &profile,
        &CostSettings::default(),
        &stats,
        4,
    )
    .unwrap();
    let attn = |ops: &[moec::cost::replay::OpReplay]| {
        let o = ops.iter().find(|o| o.op == "attn").unwrap().clone();
        (o.runs, o.measured_seconds, o.predicted_seconds)
    };
    let close = |got: f64, want: f64| (got - want).abs() < 1e-9 * want.max(1e-6);
    let (prefill, decode) = (&run.kinds[0], &run.kinds[1]);
    assert_eq!(
        (prefill.kind.as_str(), decode.kind.as_str()),
        ("prefill", "decode")
    );
    let (runs, measured, predicted) = attn(&prefill.ops);
    assert_eq!(runs, 8);
    assert!(close(measured, 8e-3) && close(predicted, 4.0 * 25600.0 / 1.5e9));
    let (runs, measured, predicted) = attn(&decode.ops);
    assert_eq!(runs, 16);
    assert!(
        close(measured, 32e-3) && close(predicted, 2.0 * 204.8e-6),
        "{predicted}"
    );
    let (runs, measured, _) = attn(&run.ops);
    assert_eq!(runs, 24);
    assert!(close(measured, 40e-3));
    // Every op of every kind adds up to the run-wide line, largest measured time first.
    for o in &run.ops {
        let sum: f64 = run
            .kinds
            .iter()
            .flat_map(|k| k.ops.iter().filter(|p| p.op == o.op))
            .map(|p| p.predicted_seconds)
            .sum();
        assert!(close(sum, o.predicted_seconds), "{}", o.op);
    }
    for k in &run.kinds {
        assert!(k
            .ops
            .windows(2)
            .all(|w| w[0].measured_seconds >= w[1].measured_seconds));
    }
}

/// A pass bounded to fewer new tokens, or a KV cache smaller, than the steady state
/// wants admits fewer prompts:
/// VSLPipe with 32 sequences per group, prompts of 24, 8 generated tokens and `tok_pct =
/// 10` holds max(32 + 24 + 8, 32 x 24 x 10 / 100) = 76 new tokens per pass. The unbounded
/// steady state would admit ceil(32 / 8) = 4 prompts; a admitted prompts keep a x 7
/// sequences decoding, and a x (24 + 7) <= 76 gives a = 2: 48 prompt tokens, 14 sequences
/// decoding at 24 + 8 / 2 = 28 (392 attended tokens), 62 tokens in all.
#[test]
fn vslpipe_pass_token_and_kv_budgets_cap_the_steady_state_by_hand() {
    let source = std::fs::read_to_string("schedules/vslpipe.sched").unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.workload = Workload {
        batch: 4,
        prompt_len: 24,
        gen_len: 8,
    };
    options.sets = vec![("tok_pct".to_string(), "10".to_string())];
    let c = compile(&source, &options).unwrap_or_else(|d| panic!("{d:?}"));
    assert_eq!(c.program.micro_batches.mixed_tokens, 76);
    let steady = moec::cost::predict::steady_mixed_loads(&c.program);
    let expected = UbLoad {
        prefill_seqs: 2,
        prefill_tokens: 48,
        decode_seqs: 14,
        decode_context: 392,
        active_experts: Vec::new(),
    };
    assert_eq!(steady, vec![expected; 2]);
    // A KV cache of `kv_pct = 25`: max(32, 32 x 32 x 25 / 100) = 256 tokens per layer and
    // group. A prompt in flight holds 24 of them and each of the 7 sequences it keeps
    // decoding 28 on average: 220 per admitted prompt, so 1 prompt per pass, 7 decoding
    // (196 attended tokens).
    options.sets = vec![("kv_pct".to_string(), "25".to_string())];
    let c = compile(&source, &options).unwrap_or_else(|d| panic!("{d:?}"));
    let steady = moec::cost::predict::steady_mixed_loads(&c.program);
    let expected = UbLoad {
        prefill_seqs: 1,
        prefill_tokens: 24,
        decode_seqs: 7,
        decode_context: 196,
        active_experts: Vec::new(),
    };
    assert_eq!(steady, vec![expected; 2]);
    // `kv_pct = 5`: max(32, 32 x 32 x 5 / 100) = 51 tokens, under the 220 one admitted
    // prompt keeps in use: the cache holds 51 / 28 = 1 sequence at the mean context, so a
    // pass decodes that one (its prompt is 1 pass in 8: rounded to none). The CPU backend
    // run of this setting (64 prompts of 24, 8 new) took 224 decode passes for 512 tokens,
    // about one token a pass per group, where the clamp to one prompt a pass had predicted 8.
    options.sets = vec![("kv_pct".to_string(), "5".to_string())];
    let c = compile(&source, &options).unwrap_or_else(|d| panic!("{d:?}"));
    let steady = moec::cost::predict::steady_mixed_loads(&c.program);
    let expected = UbLoad {
        prefill_seqs: 0,
        prefill_tokens: 0,
        decode_seqs: 1,
        decode_context: 28,
        active_experts: Vec::new(),
    };
    assert_eq!(steady, vec![expected; 2]);
}

/// `predict` costs VSLPipe's mixed step at MoE-Lens's steady state (§6.2): with 32
/// sequences per group (the default `seqs`), prompts of 24 and 8 generated tokens, each
/// sequence lives 8 passes, so a pass admits ceil(32 / 8) = 4 prompts (96 prompt tokens)
/// while the other 28 decode at the mean context 24 + 8 / 2 = 28 (784 attended tokens in
/// all), and that step equals the replay of exactly that load.
#[test]
fn vslpipe_pass_is_costed_at_the_steady_state_mix() {
    let source = std::fs::read_to_string("schedules/vslpipe.sched").unwrap();
    let c = compiled(&source, 24, 8);
    let steady = moec::cost::predict::steady_mixed_loads(&c.program);
    let expected = UbLoad {
        prefill_seqs: 4,
        prefill_tokens: 96,
        decode_seqs: 28,
        decode_context: 784,
        active_experts: Vec::new(),
    };
    assert_eq!(steady, vec![expected; 2]);
    let deps = deps(&c);
    let profile = HardwareProfile::load("t4").unwrap();
    let declared = predict(&c.program, &deps, &profile, &CostSettings::default()).unwrap();
    let index = step(&c, StepKind::Mixed);
    let replay = predict_step_at(
        &c.program,
        &deps,
        index,
        &profile,
        &CostSettings::default(),
        &steady,
    )
    .unwrap();
    // The replay copies whole declared rows (what the CPU backend does); the steady
    // prediction only the rows in use, so it is at most the replay.
    assert!(declared.steps[index].seconds <= replay.seconds);
}

/// `slow_cpu` with measured kernel rates far below its roofline (round numbers for hand
/// work): `linear` 0.1 GB/s at 1 row and 0.05 GB/s at 4 rows (1e-8 and 2e-8 s per weight
/// byte), `expert_ffn` 0.2 GB/s at 1 row and 0.05 GB/s at 16, attention 0.01 GFLOP/s in
/// decode and 0.02 in prefill.
fn measured_kernels() -> HardwareProfile {
    let mut p = slow_cpu();
    let point = |rows, weight_gb_s| RowsRate { rows, weight_gb_s };
    p.kernels = Some(KernelRates {
        source: "hand-made for the test".to_string(),
        linear: vec![point(1, 0.1), point(4, 0.05)],
        expert_ffn: vec![point(1, 0.2), point(16, 0.05)],
        attn_decode_gflops: 0.01,
        attn_prefill_gflops: 0.02,
        attn_call_us: 0.0,
        ..KernelRates::default()
    });
    p.validate().unwrap();
    p
}

/// A profile with measured kernel rates charges each task its weight bytes over the rate
/// of its op kind at its rows, when that is slower than the roofline. Decode of 2
/// sequences at context 50 on mixtral-tiny (hidden 128, ffn 256, 8 experts, top-2, bf16):
/// - lm_head: head weights (32000 * 128 + 128 norm) * 2 = 8,192,256 B at 2 rows: between
///   the linear points 1 (1e-8 s/B) and 4 (2e-8 s/B), 1e-8 + (1/3) 1e-8 = 1.3333e-8 s/B
///   -> 109.23008 ms (the roofline gave 16.385024 ms, see above).
/// - attn: 4 q n c = 51,200 FLOPs per layer at 0.01 GFLOP/s = 5.12 ms, 4 layers 20.48 ms.
/// - post_attn: o_proj 128 * 128 * 2 = 32,768 B + gate (norm 256 B + router 8 * 128 * 2 =
///   2,048 B) = 35,072 B dense at 2 rows (1.3333e-8 s/B) = 467.627 us; experts: 2 tokens
///   x top-2 routed independently (each picks an expert with q = 2/8), so an expert is
///   active with probability 1 - 0.75^2 = 0.4375: 3.5 of 8 expected, each meeting 4 / 3.5
///   = 8/7 rows; 3.5 * 3 * 128 * 256 * 2 = 688,128 B at 8/7 rows (5e-9 + (1/7)/15 x
///   1.5e-8 = 36/7 x 1e-9 s/B) = 3.538944 ms; 4.006571 ms per layer, 16.026283 ms for 4
///   layers (counting 4 distinct experts at one row, as the catalog does, gave 17.599 ms).
///
/// Prefill of 2 prompts of 5 tokens: attention 4 q s c (c + 1) / 2 = 15,360 FLOPs per
/// layer at 0.02 GFLOP/s = 768 us, 3.072 ms for 4; lm_head (2 rows) as in decode.
#[test]
fn measured_kernel_rates_charge_bytes_over_the_rate_of_the_op_kind() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let profile = measured_kernels();
    let settings = CostSettings::default();
    let decode = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Decode),
        &profile,
        &settings,
        &[decoding(2, 50), UbLoad::default()],
    )
    .unwrap();
    let close = |got: f64, want: f64| (got - want).abs() < 1e-9 * want.max(1e-3);
    let head = &decode.op_seconds["lm_head"];
    assert!(close(head.0, 8_192_256.0 * 4.0 / 3.0 * 1e-8), "{head:?}");
    assert_eq!(head.1, "kernel");
    let attn = &decode.op_seconds["attn"];
    assert!(close(attn.0, 20.48e-3), "{attn:?}");
    assert_eq!(attn.1, "kernel");
    let post = decode.op_seconds["post_attn"].0;
    let per_layer = 35_072.0 * 4.0 / 3.0 * 1e-8 + 688_128.0 * 36.0 / 7.0 * 1e-9;
    assert!(close(post, 4.0 * per_layer), "post_attn {post}");

    let prefill = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Prefill),
        &profile,
        &settings,
        &[
            UbLoad::default(),
            UbLoad {
                prefill_seqs: 2,
                prefill_tokens: 10,
                ..UbLoad::default()
            },
        ],
    )
    .unwrap();
    let attn = prefill.op_seconds["attn"].0;
    assert!(close(attn, 4.0 * 15_360.0 / 0.02e9), "prefill attn {attn}");
    let head = prefill.op_seconds["lm_head"].0;
    assert!(
        close(head, 8_192_256.0 * 4.0 / 3.0 * 1e-8),
        "prefill lm_head {head}"
    );

    // Without the measured rates the same decode step is the roofline's (first test).
    let roofline = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Decode),
        &slow_cpu(),
        &settings,
        &[decoding(2, 50), UbLoad::default()],
    )
    .unwrap();
    assert!((roofline.op_seconds["lm_head"].0 - 16.385024e-3).abs() < 1e-9);
}

/// An attention call costs at least the probe's smallest one (`attn_call_us`), and an
/// empty micro-batch makes no call. With a 1 ms floor on the profile above: decode of 2
/// sequences at context 50 stays 5.12 ms per layer (51,200 FLOPs at 0.01 GFLOP/s, above
/// the floor), 20.48 ms for 4 layers; prefill of 2 prompts of 5 tokens rises from 768 us
/// (15,360 FLOPs at 0.02 GFLOP/s) to the 1 ms floor per layer, 4 ms for 4 layers; the
/// empty micro-batch's 4 attention tasks add nothing to either.
#[test]
fn an_attention_call_costs_at_least_the_smallest_measured_call_by_hand() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let mut profile = measured_kernels();
    if let Some(k) = profile.kernels.as_mut() {
        k.attn_call_us = 1000.0;
    }
    profile.validate().unwrap();
    let settings = CostSettings::default();
    let at = |kind, loads: &[UbLoad]| {
        predict_step_at(
            &c.program,
            &deps,
            step(&c, kind),
            &profile,
            &settings,
            loads,
        )
        .unwrap()
        .op_seconds["attn"]
            .0
    };
    let decode = at(StepKind::Decode, &[decoding(2, 50), UbLoad::default()]);
    assert!((decode - 20.48e-3).abs() < 1e-12, "decode attn {decode}");
    let prefill_load = UbLoad {
        prefill_seqs: 2,
        prefill_tokens: 10,
        ..UbLoad::default()
    };
    let prefill = at(StepKind::Prefill, &[UbLoad::default(), prefill_load]);
    assert!((prefill - 4e-3).abs() < 1e-12, "prefill attn {prefill}");
    // A negative floor is refused by name.
    if let Some(k) = profile.kernels.as_mut() {
        k.attn_call_us = -1.0;
    }
    let err = profile.validate().unwrap_err().to_string();
    assert!(err.contains("attn_call_us"), "{err}");
}

/// A measured step that saw a micro-batch's routing charges a whole-layer expert task
/// (fused `post_attn`) the experts its tokens reached, each at the routed tokens over
/// them, instead of the routing model's expectation. Decode of 2 sequences (4 routed
/// tokens per layer) on mixtral-tiny, expert curve 1 row 5e-9 s/B and 16 rows 2e-8 s/B,
/// an expert 3 x 128 x 256 x 2 = 196,608 B; the run saw 2, 4 and 1 distinct experts in
/// layers 0-2 and nothing in layer 3:
/// - layer 0: 2 experts at 2 rows, 5e-9 + 1/15 x 1.5e-8 = 6e-9 s/B: 393,216 B -> 2.359296 ms
/// - layer 1: 4 at 1 row, 5e-9: 786,432 B -> 3.93216 ms
/// - layer 2: 1 at 4 rows, 8e-9: 196,608 B -> 1.572864 ms
/// - layer 3: the routing model's 3.5 at 8/7 rows, 3.538944 ms (as in
///   `measured_kernel_rates_charge_bytes_over_the_rate_of_the_op_kind`)
///
/// plus each layer's dense 35,072 B at 2 rows (1.3333e-8 s/B) = 467.627 us.
#[test]
fn a_seen_routing_sets_the_experts_a_fused_post_attn_reads_by_hand() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let mut load = decoding(2, 50);
    load.active_experts = vec![2, 4, 1, 0];
    let decode = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Decode),
        &measured_kernels(),
        &CostSettings::default(),
        &[load, UbLoad::default()],
    )
    .unwrap();
    let (post, roof) = &decode.op_seconds["post_attn"];
    let dense = 35_072.0 * 4.0 / 3.0 * 1e-8;
    let experts =
        393_216.0 * 6e-9 + 786_432.0 * 5e-9 + 196_608.0 * 8e-9 + 688_128.0 * 36.0 / 7.0 * 1e-9;
    let want = 4.0 * dense + experts;
    assert!((post - want).abs() < 1e-9 * want, "{post} vs {want}");
    assert!((experts - 11.403264e-3).abs() < 1e-12, "{experts}");
    assert_eq!(roof, "kernel");
}

/// One micro-batch, every expert its own task, on one CPU stream.
const PER_EXPERT: &str = r#"
schedule per_expert "one task per expert on one CPU stream"

microbatches 1 of 4

stream cpu: cpu.compute

let ctx = prompt_len + gen_len
let n = 4
let pre = n * prompt_len

buffer h:      host = hidden(pre)
buffer qkv:    host = qkv(pre)
buffer a:      host = attn_out(pre)
buffer route:  host = routing(pre)
buffer acc:    host = expert_acc(pre)
buffer logit:  host = logits(n)
buffer tok:    host = tokens(n)
buffer kv[layers]: host = kv_cache(n * ctx)

template forward(part, dec) {
  if dec == 1 {
    embed(ub = 0, w = W.embed, tokens = tok, h = h) on cpu
  } else {
    embed(ub = 0, w = W.embed, h = h) on cpu
  }
  for l in 0..layers {
    pre_attn(layer = l, ub = 0, w = W[l], h = h, out = qkv) on cpu
    attn(layer = l, ub = 0, part = part, qkv = qkv, kv = kv[l], out = a) on cpu
    o_proj(layer = l, ub = 0, w = W[l], a = a, h = h) on cpu
    gate(layer = l, ub = 0, w = W[l], h = h, route = route, acc = acc) on cpu
    for e in 0..experts {
      experts(layer = l, ub = 0, set = e, w = W[l].expert(e), route = route, acc = acc) on cpu
    }
    combine(layer = l, ub = 0, route = route, acc = acc, h = h) on cpu
  }
  lm_head(ub = 0, w = W.head, h = h, logits = logit) on cpu
  sample(ub = 0, logits = logit, tokens = tok) on cpu
}

prefill { forward(prefill, 0) }
decode { forward(decode, 1) }
"#;

/// An expert task that runs meets the tokens routed to it given that it is active, under
/// the routing model of `cost::activation`. Decode of 3 sequences on mixtral-tiny (8
/// experts, top-2): each token picks a given expert with q = 2/8, so it is active with
/// probability 1 - 0.75^3 = 0.578125 and meets 3 x 2/8 = 0.75 routed tokens on average,
/// 0.75 / 0.578125 = 1.297297 given it runs. On the expert curve (1 row 5e-9 s/B, 16 rows
/// 2e-8) that is 5e-9 + 0.297297 / 15 x 1.5e-8 = 5.297297e-9 s/B, times the expert's
/// 3 x 128 x 256 x 2 = 196,608 B = 1.041492 ms per task (the catalog's 0.75 rows, below
/// the first point, gave 0.98304 ms), 8 experts x 4 layers = 33.327713 ms.
#[test]
fn an_expert_task_meets_its_routed_tokens_given_it_is_active_by_hand() {
    let c = compiled(PER_EXPERT, 64, 16);
    let deps = deps(&c);
    let decode = predict_step_at(
        &c.program,
        &deps,
        step(&c, StepKind::Decode),
        &measured_kernels(),
        &CostSettings::default(),
        &[decoding(3, 40)],
    )
    .unwrap();
    let (seconds, roof) = &decode.op_seconds["experts"];
    let rows = 0.75 / (1.0 - 0.75f64.powi(3));
    let per_byte = 5e-9 + (rows - 1.0) / 15.0 * 1.5e-8;
    let want = 32.0 * 196_608.0 * per_byte;
    assert!((seconds - want).abs() < 1e-9 * want, "{seconds} vs {want}");
    assert!((want - 33.327713e-3).abs() < 1e-9, "{want}");
    assert_eq!(roof, "kernel");
}

/// Between measured points the time per weight byte is linear in rows; past the last one
/// it grows with the rows (the last point's FLOP/s); below the first it is the first's.
/// Points 1 row at 0.1 GB/s (1e-8 s/B) and 4 rows at 0.05 GB/s (2e-8 s/B):
/// 2.5 rows -> 1.5e-8; 8 rows -> 2e-8 * 8 / 4 = 4e-8; 0.5 rows -> 1e-8.
#[test]
fn kernel_rate_interpolation_by_hand() {
    let profile = measured_kernels();
    let curve = &profile.kernels.as_ref().unwrap().linear;
    let at = |rows| KernelRates::seconds_per_weight_byte(curve, rows).unwrap();
    assert!((at(2.5) - 1.5e-8).abs() < 1e-20);
    assert!((at(8.0) - 4e-8).abs() < 1e-20);
    assert!((at(0.5) - 1e-8).abs() < 1e-20);
    assert!(KernelRates::seconds_per_weight_byte(&[], 3.0).is_none());
    // A profile file without `kernels` keeps today's behaviour; one with them round-trips,
    // and rows that do not ascend are refused.
    let again = HardwareProfile::from_ron(&profile.to_ron(), "round trip").unwrap();
    assert_eq!(again, profile);
    let mut bad = profile.clone();
    if let Some(k) = bad.kernels.as_mut() {
        k.linear.reverse();
    }
    let err = HardwareProfile::from_ron(&bad.to_ron(), "bad")
        .unwrap_err()
        .to_string();
    assert!(err.contains("ascend"), "{err}");
}

/// `slow_cpu` with the runtime's fixed costs (round numbers for hand work): 100 us per
/// task, 50 us per blocking wait, 1 ms per stream thread of a step.
fn with_dispatch(task_us: f64, wake_us: f64, stream_thread_us: f64) -> HardwareProfile {
    let mut p = slow_cpu();
    p.dispatch = Some(DispatchCosts {
        source: "hand-made for the test".to_string(),
        task_us,
        wake_us,
        stream_thread_us,
    });
    p.validate().unwrap();
    p
}

/// Per task and per stream thread, by hand: the one-stream decode step runs 2 micro-batches
/// x (embed + 4 layers x (pre_attn, attn, post_attn) + lm_head + sample) = 2 x 15 = 30
/// tasks in a chain on one stream, the second micro-batch empty (its tasks do no work but
/// the runtime still dispatches them). With 100 us per task and 1 ms per stream thread the
/// step is 30 x 100 us + 1 x 1 ms = 4 ms longer than without fixed costs, whatever the
/// tasks' own times; a profile file carrying the costs round-trips.
#[test]
fn dispatch_costs_add_per_task_and_per_stream_thread_by_hand() {
    let c = compiled(ONE_STREAM, 64, 16);
    let deps = deps(&c);
    let settings = CostSettings::default();
    let decode = step(&c, StepKind::Decode);
    assert_eq!(c.program.steps[decode].count, 30);
    let loads = [decoding(2, 50), UbLoad::default()];
    let at = |profile: &HardwareProfile| {
        predict_step_at(&c.program, &deps, decode, profile, &settings, &loads)
            .unwrap()
            .seconds
    };
    let without = at(&slow_cpu());
    let with = at(&with_dispatch(100.0, 50.0, 1000.0));
    assert!(
        ((with - without) - 4e-3).abs() < 1e-12,
        "{with} - {without}"
    );
    let profile = with_dispatch(100.0, 50.0, 1000.0);
    let again = HardwareProfile::from_ron(&profile.to_ron(), "round trip").unwrap();
    assert_eq!(again, profile);
    let mut bad = profile;
    if let Some(d) = bad.dispatch.as_mut() {
        d.wake_us = -1.0;
    }
    let err = HardwareProfile::from_ron(&bad.to_ron(), "bad")
        .unwrap_err()
        .to_string();
    assert!(err.contains("dispatch.wake_us"), "{err}");
}

/// ONE_STREAM with attention on a second CPU stream: every layer hands the micro-batch to
/// the other stream and back, and both streams take turns on the one `cpu` resource.
fn two_streams() -> String {
    let source = ONE_STREAM
        .replace(
            r#"schedule one_stream "every task on one CPU stream""#,
            r#"schedule two_streams "attention on a second CPU stream""#,
        )
        .replace(
            "stream cpu: cpu.compute\n",
            "stream cpu: cpu.compute\nstream att: cpu.compute\n",
        )
        .replace("out = a) on cpu", "out = a) on att");
    assert!(source.contains("on att") && source.contains("stream att"));
    source
}

/// Per blocking wait, by hand: with both micro-batches decoding, the step is one chain
/// that crosses streams twice per layer and micro-batch (pre_attn -> attn, attn ->
/// post_attn), each time onto a stream that is idle waiting for it: 2 x 4 x 2 = 16
/// wake-ups, so 50 us per blocking wait adds exactly 16 x 50 us = 0.8 ms.
#[test]
fn a_blocking_cross_stream_wait_costs_one_wake_up_by_hand() {
    let c = compiled(&two_streams(), 64, 16);
    let deps = deps(&c);
    let settings = CostSettings::default();
    let decode = step(&c, StepKind::Decode);
    let loads = [decoding(2, 50), decoding(2, 50)];
    let at = |profile: &HardwareProfile| {
        predict_step_at(&c.program, &deps, decode, profile, &settings, &loads)
            .unwrap()
            .seconds
    };
    let without = at(&slow_cpu());
    let with = at(&with_dispatch(0.0, 50.0, 0.0));
    assert!(
        ((with - without) - 16.0 * 50e-6).abs() < 1e-12,
        "{with} - {without}"
    );
}

/// A cache fetch that found its expert resident copied nothing, so the replay charges it
/// as it charges a task its guard skipped, and reports it on a line of its own: the run
/// with every decode fetch a hit predicts exactly what the run with those fetches skipped
/// does, less than the run where each copied, and the hits' line predicts 0.
#[test]
fn a_cache_hit_is_charged_as_the_no_op_it_was() {
    let source = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/moe_infinity.sched"),
    )
    .unwrap();
    let c = compiled(&source, 16, 4);
    let deps = deps(&c);
    let profile = slow_cpu();
    let decode = step(&c, StepKind::Decode);
    let fetch = |t: TaskId| c.program.task(t).cache_op == Some(CacheOp::Fetch);
    let s = &c.program.steps[decode];
    let fetches = (s.first..s.first + s.count)
        .filter(|&t| fetch(TaskId::new(t as usize)))
        .count();
    assert!(fetches > 0, "moe_infinity's decode step fetches experts");
    let run_with = |mark: &dyn Fn(&mut TaskRecord)| {
        let mut tasks = ran_tasks(&c, StepKind::Decode, 1e-4);
        for t in tasks.iter_mut().filter(|t| fetch(t.task)) {
            mark(t);
        }
        let loads = vec![decoding(2, 20), decoding(2, 20)];
        let stats = RunStats {
            steps: vec![StepRecord {
                tasks,
                ..record(StepKind::Decode, 1.0, loads)
            }],
            wall: 1.0,
            ..RunStats::default()
        };
        predict_run(
            &c.program,
            &deps,
            &profile,
            &CostSettings::default(),
            &stats,
            4,
        )
        .unwrap()
    };
    let copied = run_with(&|_| {});
    let hits = run_with(&|t| t.hit = true);
    let skipped = run_with(&|t| t.ran = false);
    assert_eq!(hits.predicted_seconds, skipped.predicted_seconds);
    assert!(
        hits.predicted_seconds < copied.predicted_seconds,
        "{} against {}",
        hits.predicted_seconds,
        copied.predicted_seconds
    );
    let hit_lines: Vec<_> = hits
        .ops
        .iter()
        .filter(|o| o.op.ends_with(" (hit)"))
        .collect();
    assert_eq!(hit_lines.iter().map(|o| o.runs).sum::<usize>(), fetches);
    assert!(hit_lines.iter().all(|o| o.predicted_seconds == 0.0));
    assert!(!copied.ops.iter().any(|o| o.op.ends_with(" (hit)")));
}

/// ONE_STREAM with weight copies in its decode step: a layer's experts from the checkpoint
/// into pinned staging on `pin` (`cpu.copy`), from there to the GPU on `h2d`
/// (`gpu.copy_in`), and another layer's experts from the checkpoint straight to the GPU.
fn weight_copies() -> String {
    ONE_STREAM
        .replace(
            "stream cpu: cpu.compute",
            "stream cpu: cpu.compute\nstream pin: cpu.copy\nstream h2d: gpu.copy_in",
        )
        .replace(
            "buffer h[2]:",
            "buffer w_pin: pinned = W[0].experts(0, experts)\n\
             buffer w_gpu: gpu = W[0].experts(0, experts)\n\
             buffer w_dir: gpu = W[1].experts(0, experts)\n\
             buffer h[2]:",
        )
        .replace(
            "decode { forward(decode, 1) }",
            "decode {\n  forward(decode, 1)\n  \
             copy W[0].experts(0, experts) -> w_pin on pin\n  \
             copy w_pin -> w_gpu on h2d\n  \
             copy W[1].experts(0, experts) -> w_dir on h2d\n}",
        )
}

/// Issue 44 point 5: registered weights in the replay, by hand. mixtral-tiny's experts of
/// a layer are 8 x 196,608 = 1,572,864 B; on the T4 profile (16 GB/s pinned -> GPU,
/// 8 GB/s pageable -> GPU, 50 GB/s pageable -> pinned, no per-task costs):
/// - copies as copies (a paper's profile): checkpoint -> pinned 1,572,864 / 50e9 =
///   31.457 us, pinned -> GPU 1,572,864 / 16e9 = 98.304 us, checkpoint -> GPU
///   1,572,864 / 8e9 = 196.608 us (pageable);
/// - bound (the CPU backend: every weight copy moves labels, at 1e4 GB/s): each
///   1,572,864 / 1e13 = 0.157 us;
/// - registered (the CUDA backend over a registered checkpoint): the host copy moves labels
///   (0.157 us), and both device copies are DMA from page-locked memory at the pinned
///   rate, 98.304 us each: the copy straight from the checkpoint is no longer charged the
///   pageable rate, nor the staged one the bound rate.
#[test]
fn registered_weights_are_label_moves_on_the_host_and_pinned_dma_to_the_gpu_by_hand() {
    let c = compiled(&weight_copies(), 16, 4);
    let deps = deps(&c);
    let index = step(&c, StepKind::Decode);
    let settings = CostSettings::default();
    let times = |bound: bool, registered: bool| {
        let mut profile = HardwareProfile::load("t4").unwrap();
        if bound {
            profile.adjustments.weight_copy_bytes_per_s = 1e13;
        }
        profile.adjustments.registered_weights = registered;
        let p = predict_step_at(
            &c.program,
            &deps,
            index,
            &profile,
            &settings,
            &[decoding(2, 20), decoding(2, 20)],
        )
        .unwrap();
        let op = |name: &str| p.op_seconds[name].0;
        (
            op("copy weights host->pinned"),
            op("copy weights pinned->gpu"),
            op("copy weights host->gpu"),
        )
    };
    let bytes = 1_572_864.0;
    let close = |got: f64, want: f64| (got - want).abs() <= 1e-9 * want.max(1e-6);
    let (pin, staged, direct) = times(false, false);
    assert!(close(pin, bytes / 50e9), "copied: pin {pin}");
    assert!(close(staged, bytes / 16e9), "copied: pinned->gpu {staged}");
    assert!(
        close(direct, bytes / 8e9),
        "copied: checkpoint->gpu {direct}"
    );
    let (pin, staged, direct) = times(true, false);
    for t in [pin, staged, direct] {
        assert!(close(t, bytes / 1e13), "bound: {t}");
    }
    let (pin, staged, direct) = times(true, true);
    assert!(close(pin, bytes / 1e13), "registered: pin {pin}");
    assert!(close(staged, 98.304e-6), "registered: pinned->gpu {staged}");
    assert!(
        close(direct, 98.304e-6),
        "registered: checkpoint->gpu {direct}"
    );
}
