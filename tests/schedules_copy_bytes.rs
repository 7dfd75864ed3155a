//! The bytes every schedule copies per step, by class (weights, activations, KV cache) and
//! direction (host -> GPU, GPU -> host, host -> host), against hand arithmetic from each
//! paper's transfer formulas on the tiny Mixtral card cut to 2 layers (the small
//! configuration of the snapshot tests: 3 micro-batches or batches of 2 sequences, 8-token
//! prompts, 4 generated tokens). A mis-sized buffer (a decode step moving prompt-sized
//! hidden states, a KV cache copied twice) changes a total and fails here, where the
//! per-stream issue order of `schedules_paper_order.rs` would still pass.
//!
//! The sizes are worked out by hand from the card (`models/mixtral-tiny.ron`: hidden 128,
//! ffn 256, 4 heads and 2 KV heads of 32, 8 experts, bf16 weights) and the catalog's f32
//! activations (4 bytes per element), never read back from the compiler:
//!
//! - an expert is w1, w3 (ffn x hidden) and w2 (hidden x ffn): 3 * 256 * 128 * 2 = 196,608 B;
//! - a layer's dense part is `pre` (input norm 128 * 2 = 256, Q 128 * 128 * 2 = 32,768,
//!   K and V 64 * 128 * 2 = 16,384 each: 65,792) + `o` (128 * 128 * 2 = 32,768) + `gate`
//!   (norm 256 + router 8 * 128 * 2 = 2,048: 2,304) = 100,864 B (every segment is already a
//!   multiple of 64, the image's alignment);
//! - a whole layer: 100,864 + 8 * 196,608 = 1,673,728 B;
//! - per token: hidden 128 * 4 = 512 B, QKV (128 + 2 * 64) * 4 = 1,024 B, attention output
//!   128 * 4 = 512 B, KV cache of one layer 2 * 64 * 4 = 512 B; routing top_k 2 entries
//!   of 8 B (expert id and weight) = 16 B; expert sums (`expert_acc`: the normalised row
//!   and one output row per (token, k), no shared row on Mixtral) (1 + 2) * 128 * 4 =
//!   1,536 B; a sampled token 4 B.
//!
//! An activation copy moves the rows of the step's tokens (`ir::LiveRows`): a decode step
//! of 2 sequences moves 2 rows of a buffer declared for the 16 prompt tokens of a prefill
//! (Fiddler's `acc`, `route`), so the totals are per token of the step, whatever the
//! buffer's declared size.

mod schedules_common;
use schedules_common as common;

use moec::cost::predict::{buffer_classes, BufferClass};
use moec::ir::{Program, Space};
use moec::syntax::ast::StepKind;
use std::collections::BTreeMap;

const EXPERT: u64 = 196_608;
const EXPERTS: u64 = 8;
const LAYER: u64 = 1_673_728;
const DENSE: u64 = 100_864;
const PRE: u64 = 65_792;
const O_PROJ: u64 = 32_768;
const GATE: u64 = 2_304;
const HIDDEN_TOKEN: u64 = 512;
const QKV_TOKEN: u64 = 1_024;
const ATTN_OUT_TOKEN: u64 = 512;
const KV_TOKEN: u64 = 512;
const ROUTE_TOKEN: u64 = 16;
const ACC_TOKEN: u64 = 1_536;
const SAMPLED_TOKEN: u64 = 4;

/// The small configuration (tests/schedules_common).
const L: u64 = 2;
const N_UB: u64 = 3;
const UBS: u64 = 2;
const PROMPT: u64 = 8;
const CTX: u64 = 8 + 4;

/// One line of a step's copy totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Dir {
    /// Host (pinned or pageable) -> GPU.
    ToGpu,
    /// GPU -> host.
    FromGpu,
    /// Pageable <-> pinned, on the CPU.
    Host,
    /// Disk -> host (a `disk.read` copy of the checkpoint).
    FromDisk,
}

type Totals = BTreeMap<(&'static str, Dir), u64>;

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

/// Bytes copied in the first step of `kind` at its declared (worst-case) shape, by (class,
/// direction): KV parts and activations at the positions and rows of a full micro-batch's
/// tokens, everything else its whole slice. Guarded copies count in full.
fn copy_totals(program: &Program, kind: StepKind) -> Totals {
    let classes = buffer_classes(program);
    let step = program
        .steps
        .iter()
        .find(|s| s.kind == kind)
        .expect("step present");
    let mut totals = Totals::new();
    for id in step.task_ids() {
        let task = &program.tasks[id.index()];
        let Some(copy) = task.work.copy else { continue };
        let class = match classes[task.args[0].slice.buffer.index()] {
            BufferClass::Weights => "weights",
            BufferClass::KvCache => "kv",
            BufferClass::Activations => "activations",
        };
        let dir = match (copy.src, copy.dst) {
            (Space::Gpu, Space::Gpu) => panic!("GPU-to-GPU copy in {}", program.name),
            (Space::Disk, _) => Dir::FromDisk,
            (_, Space::Gpu) => Dir::ToGpu,
            (Space::Gpu, _) => Dir::FromGpu,
            _ => Dir::Host,
        };
        *totals.entry((class, dir)).or_default() += copy.bytes;
    }
    totals
}

fn expect(schedule: &str, kind: StepKind, expected: &[((&'static str, Dir), u64)]) {
    let program = compiled(schedule);
    let got = copy_totals(&program, kind);
    let expected: Totals = expected.iter().copied().filter(|(_, b)| *b > 0).collect();
    assert_eq!(
        got,
        expected,
        "{schedule}, {} step: copied bytes by (class, direction)",
        kind.as_str()
    );
}

use Dir::{FromDisk, FromGpu, Host, ToGpu};

/// FlexGen's decode (MoE-Lightning §4, Klotski §3.2, FlexGen's `generation_loop`): per
/// token, every layer's weights once (n_batch batches share each loaded layer); per
/// (layer, batch) the batch's hidden state of ONE new token per sequence in
/// (`load_hidden`) and, but at the last layer, out (`store_hidden`); the batch's KV cache
/// in (`load_cache`: `kv.context()`, the positions cached before the new token) and back
/// (`store_cache`: `kv_g.appended()`, FlexGen's `k_new`, one position per sequence). At
/// the declared worst case (the step whose context, new token included, is prompt + gen)
/// a load moves `prompt + gen - 1` positions per sequence.
#[test]
fn flexgen_decode_moves_one_token_of_hidden_state_per_sequence() {
    let n = L * N_UB; // (layer, batch) steps
    let hidden = UBS * HIDDEN_TOKEN; // one new token per sequence
    let (kv_in, kv_out) = (UBS * (CTX - 1) * KV_TOKEN, UBS * KV_TOKEN);
    expect(
        "flexgen",
        StepKind::Decode,
        &[
            (("weights", ToGpu), L * LAYER),
            (("activations", ToGpu), n * hidden),
            // Stores skip the last layer (its state goes to lm_head); the sampled tokens.
            (
                ("activations", FromGpu),
                (L - 1) * N_UB * hidden + N_UB * UBS * SAMPLED_TOKEN,
            ),
            (("kv", ToGpu), n * kv_in),
            (("kv", FromGpu), n * kv_out),
        ],
    );
}

/// FlexGen's prefill: the same zigzag with every prompt token in the hidden state, and no
/// KV to load (the cache is being made); the store moves the prompt's positions only
/// (`appended()`), not the line declared for prompt + gen.
#[test]
fn flexgen_prefill_moves_every_prompt_token() {
    let n = L * N_UB;
    let hidden = UBS * PROMPT * HIDDEN_TOKEN;
    expect(
        "flexgen",
        StepKind::Prefill,
        &[
            (("weights", ToGpu), L * LAYER),
            (("activations", ToGpu), n * hidden),
            (
                ("activations", FromGpu),
                (L - 1) * N_UB * hidden + N_UB * UBS * SAMPLED_TOKEN,
            ),
            (("kv", FromGpu), n * UBS * PROMPT * KV_TOKEN),
        ],
    );
}

/// MoE-Lightning's S3 (FlexGen with CPU attention): FlexGen's weight and hidden traffic
/// plus, per (layer, batch), the QKV of one token per sequence to the CPU and its attention
/// output back; the KV cache never moves.
#[test]
fn flexgen_cpu_attn_decode_moves_qkv_and_attention_rows() {
    let n = L * N_UB;
    expect(
        "baselines/flexgen_cpu_attn",
        StepKind::Decode,
        &[
            (("weights", ToGpu), L * LAYER),
            (
                ("activations", ToGpu),
                n * UBS * (HIDDEN_TOKEN + ATTN_OUT_TOKEN),
            ),
            (
                ("activations", FromGpu),
                (L - 1) * N_UB * UBS * HIDDEN_TOKEN
                    + n * UBS * QKV_TOKEN
                    + N_UB * UBS * SAMPLED_TOKEN,
            ),
        ],
    );
}

/// FlexGen(c)'s prefill: attention on the GPU (`cpu_cache_compute` moves only the
/// generation phase's attention), so FlexGen's prefill hidden traffic plus every batch's
/// new KV lines (the prompt's positions: `appended()`) to the CPU home; no QKV or attention
/// rows cross the link.
#[test]
fn flexgen_cpu_attn_prefill_stores_the_new_kv_lines() {
    let n = L * N_UB;
    let hidden = UBS * PROMPT * HIDDEN_TOKEN;
    expect(
        "baselines/flexgen_cpu_attn",
        StepKind::Prefill,
        &[
            (("weights", ToGpu), L * LAYER),
            (("activations", ToGpu), n * hidden),
            (
                ("activations", FromGpu),
                (L - 1) * N_UB * hidden + N_UB * UBS * SAMPLED_TOKEN,
            ),
            (("kv", FromGpu), n * UBS * PROMPT * KV_TOKEN),
        ],
    );
}

/// CGOPipe decode (MoE-Lightning §4.1, App. A.1): only experts stream, each byte once over
/// the link and once through the pinned relay (3 h1 h2 E per layer); per micro-batch the
/// embedding in, per (layer, micro-batch) the QKV out (D1) and the attention output in
/// (D2), one token per sequence.
#[test]
fn cgopipe_decode_streams_experts_and_one_token_rows() {
    let n = L * N_UB;
    let experts = L * EXPERTS * EXPERT;
    expect(
        "cgopipe",
        StepKind::Decode,
        &[
            (("weights", ToGpu), experts),
            (("weights", Host), experts),
            (
                ("activations", ToGpu),
                N_UB * UBS * HIDDEN_TOKEN + n * UBS * ATTN_OUT_TOKEN,
            ),
            (
                ("activations", FromGpu),
                n * UBS * QKV_TOKEN + N_UB * UBS * SAMPLED_TOKEN,
            ),
        ],
    );
}

/// MoE-Lightning S2: CGOPipe's traffic, whole layers of experts instead of pages.
#[test]
fn moe_lightning_s2_decode_streams_the_same_bytes_as_cgopipe() {
    let n = L * N_UB;
    let experts = L * EXPERTS * EXPERT;
    expect(
        "baselines/moe_lightning_s2",
        StepKind::Decode,
        &[
            (("weights", ToGpu), experts),
            (("weights", Host), experts),
            (
                ("activations", ToGpu),
                N_UB * UBS * HIDDEN_TOKEN + n * UBS * ATTN_OUT_TOKEN,
            ),
            (
                ("activations", FromGpu),
                n * UBS * QKV_TOKEN + N_UB * UBS * SAMPLED_TOKEN,
            ),
        ],
    );
}

/// Klotski decode (Alg. 1): per layer the gate, every expert (hot ones before the gate,
/// cold ones after it: the declared worst case has all of them active) and the next
/// layer's attention weights; the batches' embeddings (one token per sequence) once; per
/// (layer, batch) its cached positions in (`context()`) and the new token's out
/// (`appended()`), as in FlexGen's zigzag it builds on.
#[test]
fn klotski_decode_moves_each_layer_once_per_group() {
    let n = L * N_UB;
    let (kv_in, kv_out) = (UBS * (CTX - 1) * KV_TOKEN, UBS * KV_TOKEN);
    expect(
        "klotski",
        StepKind::Decode,
        &[
            (
                ("weights", ToGpu),
                L * (GATE + EXPERTS * EXPERT + PRE + O_PROJ),
            ),
            (("activations", ToGpu), N_UB * UBS * HIDDEN_TOKEN),
            (("activations", FromGpu), N_UB * UBS * SAMPLED_TOKEN),
            (("kv", ToGpu), n * kv_in),
            (("kv", FromGpu), n * kv_out),
        ],
    );
}

/// VSLPipe's mixed pass (MoE-Lens §6.4-6.5) at its declared worst case, every prompt token
/// of both groups in the pass: each layer's weights once through the data mover; per group
/// the embeddings in; per (layer, group) the fresh QKV out and the decode attention rows
/// in. (The steady-state mix of prefill and decode tokens is the cost model's business.)
#[test]
fn vslpipe_pass_moves_each_layer_once() {
    let groups = 2;
    let tok = UBS * PROMPT; // seqs * prompt_len per group
    expect(
        "vslpipe",
        StepKind::Mixed,
        &[
            (("weights", ToGpu), L * LAYER),
            (
                ("activations", ToGpu),
                groups * tok * HIDDEN_TOKEN + L * groups * tok * ATTN_OUT_TOKEN,
            ),
            (
                ("activations", FromGpu),
                L * groups * tok * QKV_TOKEN + groups * UBS * SAMPLED_TOKEN,
            ),
        ],
    );
}

/// The sequential baseline: every layer through the pinned relay and over the link, one
/// token per sequence of hidden state in, QKV out and attention output in per (layer,
/// micro-batch).
#[test]
fn sequential_decode_moves_one_token_rows() {
    let n = L * N_UB;
    expect(
        "baselines/sequential",
        StepKind::Decode,
        &[
            (("weights", ToGpu), L * LAYER),
            (("weights", Host), L * LAYER),
            (
                ("activations", ToGpu),
                N_UB * UBS * HIDDEN_TOKEN + n * UBS * ATTN_OUT_TOKEN,
            ),
            (
                ("activations", FromGpu),
                n * UBS * QKV_TOKEN + N_UB * UBS * SAMPLED_TOKEN,
            ),
        ],
    );
}

/// Fiddler (§3.3, Alg. 1) with 6 of the 16 experts resident (the small configuration's
/// `n_gpu`; ranked by expert then layer without a profile: experts 0-2 of both layers), so
/// 5 experts per layer are not: each may be copied (checkpoint -> pinned -> the staging
/// slot, counted in full as guarded copies are) where a micro-batch can reach the
/// threshold (9 tokens without a profile): in prefill (16 tokens), not in decode (2
/// tokens), where the copy arm is never built (`routed(..) >= 9` is decided false from
/// the step's tokens, elaborate::guards). Per (layer, micro-batch) the CPU arm's
/// inputs go out (`route[j] -> route_c[j]`, `acc[j] -> acc_c[j]`) and its outputs come
/// back (`acc_c[j] -> acc_cg[j]`): the rows of the step's tokens, 2 in decode, not the 16
/// prompt tokens `expert_acc(pre)` and `routing(pre)` are declared for (issue 28: 8x
/// fewer activation bytes per decode step here); every prompt token's row in prefill (the
/// buffers' whole declared size). The KV cache stays on the GPU.
#[test]
fn fiddler_moves_the_rows_of_its_tokens() {
    let n = L * N_UB;
    for (kind, tok, staged) in [
        (StepKind::Decode, UBS, 0),
        (StepKind::Prefill, UBS * PROMPT, n * 5 * EXPERT),
    ] {
        expect(
            "fiddler",
            kind,
            &[
                (("weights", Host), staged),
                (("weights", ToGpu), staged),
                (
                    ("activations", FromGpu),
                    n * tok * (ROUTE_TOKEN + ACC_TOKEN),
                ),
                (("activations", ToGpu), n * tok * ACC_TOKEN),
            ],
        );
    }
}

/// MoE-Infinity's decode (Alg. 1, §4.6): no activation or KV copy at all (everything but
/// experts is resident); per layer every expert may be fetched from its pinned home into
/// the cache (8 guarded fetches), and each layer but the last prefetches `n_pf = 2`
/// experts of the next (`lookahead = 1`).
#[test]
fn moe_infinity_decode_moves_only_experts() {
    expect(
        "moe_infinity",
        StepKind::Decode,
        &[(("weights", ToGpu), (L * EXPERTS + (L - 1) * 2) * EXPERT)],
    );
}

/// Pre-gated MoE's decode (Hwang et al. §4): everything but experts is resident, so no
/// activation or KV copy; per layer every expert may be fetched on demand from its pinned
/// home (8 guarded fetches), and each layer with a next MoE layer prefetches the next
/// layer's lookahead-selected experts: `sel = min(experts, bs * top_k)` = min(8, 2 * 2) = 4
/// of them (one layer here: layer 1 is the last).
#[test]
fn pregated_decode_moves_only_experts() {
    let sel = EXPERTS.min(2 * 2);
    expect(
        "pregated",
        StepKind::Decode,
        &[(("weights", ToGpu), (L * EXPERTS + (L - 1) * sel) * EXPERT)],
    );
}

/// FlexGen's zigzag with its disk tier (`e_d = -1`: every expert on disk): load_weight moves
/// each layer whole to the GPU as flexgen.sched does (its dense part from the pinned home,
/// its experts from staging), and every expert of each layer is read from disk first; the
/// activation and KV traffic is flexgen.sched's.
#[test]
fn flexgen_disk_decode_reads_every_expert_from_disk_once_per_layer() {
    let n = L * N_UB;
    let hidden = UBS * HIDDEN_TOKEN;
    let (kv_in, kv_out) = (UBS * (CTX - 1) * KV_TOKEN, UBS * KV_TOKEN);
    expect(
        "flexgen_disk",
        StepKind::Decode,
        &[
            (("weights", FromDisk), L * EXPERTS * EXPERT),
            (("weights", ToGpu), L * LAYER),
            (("activations", ToGpu), n * hidden),
            (
                ("activations", FromGpu),
                (L - 1) * N_UB * hidden + N_UB * UBS * SAMPLED_TOKEN,
            ),
            (("kv", ToGpu), n * kv_in),
            (("kv", FromGpu), n * kv_out),
        ],
    );
}

/// HOBBIT's decode (Tang et al. 2024): everything but experts is resident. With its
/// substitute off (`lowbit = 0`, the default) every expert may be fetched in bf16 into the
/// cache (8 guarded fetches per layer). With it on, every guarded copy counts in full: per
/// layer, the important experts' bf16 fetches (8, each guarded by its routing weight), then
/// per expert the hit arm's bf16 fetch (8, a no-op on a hit at run time, still a copy task)
/// and the miss arm's q8_0 copy (8, 34 bytes per 32 weights: 3 * 256 * 128 / 32 * 34 =
/// 104,448 B an expert, against bf16's 196,608).
#[test]
fn hobbit_decode_moves_experts_in_the_precision_their_weight_and_residency_give() {
    expect(
        "hobbit",
        StepKind::Decode,
        &[(("weights", ToGpu), L * EXPERTS * EXPERT)],
    );
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/hobbit.sched");
    let source = common::read(&path);
    let from = "param lowbit:  int in 0..=1        = 0";
    assert!(
        source.contains(from),
        "hobbit.sched declares lowbit as expected"
    );
    let source = source.replacen(from, "param lowbit:  int in 0..=1        = 1", 1);
    let program = common::compile_small(&source)
        .unwrap_or_else(|d| panic!("{}", moec::diag::render_all(&d, "hobbit", &source)))
        .program;
    let q8_expert = 3 * 256 * 128 / 32 * 34;
    assert_eq!(q8_expert, 104_448);
    let expected: Totals = [(
        ("weights", ToGpu),
        L * (EXPERTS * EXPERT + EXPERTS * EXPERT + EXPERTS * q8_expert),
    )]
    .into_iter()
    .collect();
    assert_eq!(copy_totals(&program, StepKind::Decode), expected);
    // Prefill loads every active expert in full precision either way.
    assert_eq!(
        copy_totals(&program, StepKind::Prefill),
        copy_totals(&compiled("hobbit"), StepKind::Prefill)
    );
}

/// MoE-Infinity over disk: the same fetches and prefetches as moe_infinity.sched (8
/// guarded fetches per layer, `n_pf = 2` prefetches of the next layer), read from disk into
/// the host cache; compute is on the CPU, so nothing else moves.
#[test]
fn moe_infinity_disk_decode_reads_only_experts_from_disk() {
    expect(
        "moe_infinity_disk",
        StepKind::Decode,
        &[(("weights", FromDisk), (L * EXPERTS + (L - 1) * 2) * EXPERT)],
    );
}

/// The resident baselines copy nothing after setup.
#[test]
fn resident_baselines_copy_nothing_per_step() {
    for schedule in ["baselines/gpu_resident", "baselines/resident"] {
        for kind in [StepKind::Prefill, StepKind::Decode] {
            expect(schedule, kind, &[]);
        }
    }
}

/// Every schedule of `schedules/` has its per-step copies worked out above, so a new one
/// (or one that starts copying activations) cannot go unchecked.
#[test]
fn every_schedule_is_covered() {
    const COVERED: &[&str] = &[
        "cgopipe",
        "fiddler",
        "flexgen",
        "klotski",
        "moe_infinity",
        "vslpipe",
        "flexgen_disk",
        "moe_infinity_disk",
        "pregated",
        "hobbit",
        "baselines/flexgen_cpu_attn",
        "baselines/gpu_resident",
        "baselines/moe_lightning_s2",
        "baselines/resident",
        "baselines/sequential",
    ];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules");
    let mut found = Vec::new();
    for dir in ["", "baselines/"] {
        for entry in std::fs::read_dir(root.join(dir)).expect("schedules folder") {
            let path = entry.expect("entry").path();
            if path.extension().is_some_and(|e| e == "sched") {
                let stem = path.file_stem().expect("stem").to_string_lossy();
                found.push(format!("{dir}{stem}"));
            }
        }
    }
    found.sort();
    let mut covered: Vec<String> = COVERED.iter().map(|s| s.to_string()).collect();
    covered.sort();
    assert_eq!(found, covered, "schedules without copy totals here");
}

#[test]
fn dense_part_is_pre_plus_o_plus_gate() {
    // The hand figures above agree with each other (guards the arithmetic, not the code).
    assert_eq!(PRE + O_PROJ + GATE, DENSE);
    assert_eq!(DENSE + EXPERTS * EXPERT, LAYER);
}

/// Counts the bytes the runtime really moves in KV-part copies (`.context()`,
/// `.appended()`) or in copies of activation rows (`LiveRows`), per step kind and
/// direction, around the CPU backend.
#[derive(Debug)]
struct CountingKv<'c> {
    inner: moec::runtime::cpu::CpuBackend<'c>,
    /// Count KV-part copies (else live-row copies).
    kv: bool,
    /// (step kind, direction) -> bytes.
    moved: std::sync::Mutex<BTreeMap<(&'static str, Dir), u64>>,
    kinds: Vec<StepKind>,
}

impl moec::runtime::backend::Backend for CountingKv<'_> {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn capabilities(&self) -> moec::runtime::backend::Capabilities {
        self.inner.capabilities()
    }
    fn memory(&self) -> moec::runtime::backend::MemoryReport {
        self.inner.memory()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn run(
        &self,
        stream: moec::ir::StreamId,
        engine: moec::ir::Engine,
        task: &moec::lower::PlanTask,
        state: &dyn moec::runtime::step::StepContext,
    ) -> Result<(), moec::runtime::backend::BackendError> {
        assert!(
            task.kv.is_none() && task.live.is_none(),
            "{}: a KV-part or live-row copy is one `copy_runs` command, never a whole-slice `run`",
            task.name
        );
        self.inner.run(stream, engine, task, state)
    }
    fn copy_runs(
        &self,
        stream: moec::ir::StreamId,
        engine: moec::ir::Engine,
        task: &moec::lower::PlanTask,
        runs: &[(u64, u64)],
        state: &dyn moec::runtime::step::StepContext,
    ) -> Result<(), moec::runtime::backend::BackendError> {
        if task.kv.is_some() == self.kv {
            let dir = match engine {
                moec::ir::Engine::GpuCopyIn => ToGpu,
                moec::ir::Engine::GpuCopyOut => FromGpu,
                _ => Host,
            };
            let kind = self.kinds[task.step.index()].as_str();
            *self
                .moved
                .lock()
                .expect("counter")
                .entry((kind, dir))
                .or_default() += runs.iter().map(|r| r.1).sum::<u64>();
        }
        self.inner.copy_runs(stream, engine, task, runs, state)
    }
    fn record(
        &self,
        stream: moec::ir::StreamId,
        event: moec::lower::EventId,
    ) -> Result<(), moec::runtime::backend::BackendError> {
        self.inner.record(stream, event)
    }
    fn wait(
        &self,
        stream: moec::ir::StreamId,
        event: moec::lower::EventId,
    ) -> Result<(), moec::runtime::backend::BackendError> {
        self.inner.wait(stream, event)
    }
    fn read_routing(
        &self,
        stream: moec::ir::StreamId,
        gate: &moec::lower::PlanTask,
        route: &moec::lower::PlanArg,
        tokens: usize,
        top_k: usize,
    ) -> Result<moec::model::vocab::Routing, moec::runtime::backend::BackendError> {
        self.inner.read_routing(stream, gate, route, tokens, top_k)
    }
    fn finish_step(
        &self,
    ) -> Result<Option<Vec<moec::runtime::backend::DeviceTime>>, moec::runtime::backend::BackendError>
    {
        self.inner.finish_step()
    }
}

/// Runs `schedule` on the small configuration over 6 prompts of exactly 8 tokens (3
/// batches of 2 sequences) and 4 generated tokens each, on the CPU backend behind a
/// counter of KV-part copies (`kv`) or live-row copies; checks the tokens are the
/// oracle's and gives the bytes counted per (step kind, direction).
fn counted_run(schedule: &str, kv: bool) -> BTreeMap<(&'static str, Dir), u64> {
    use moec::lower::{lower, LowerOptions};
    use moec::runtime::RunOptions;
    let dir = tempfile::tempdir().expect("temporary directory");
    let card = common::card_with_layers("mixtral-tiny", 2);
    let checkpoint = common::tiny_checkpoint(&card, dir.path());
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|p| (0..8u32).map(|t| 100 + 37 * p + 11 * t).collect())
        .collect();
    let expected = common::oracle_tokens(&checkpoint, &prompts, 4);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("schedules/{schedule}.sched"));
    let compiled = common::compile_small(&common::read(&path)).expect("compiles");
    let plan = lower(&compiled.program, &compiled.info, &LowerOptions::default()).expect("lowers");
    let mut run = RunOptions::greedy(4);
    run.stop_at_eos = false;
    run.backend.threads = 1;
    let backend = CountingKv {
        inner: moec::runtime::cpu::CpuBackend::new(&plan, &checkpoint, &run.backend)
            .expect("backend"),
        kv,
        moved: Default::default(),
        kinds: compiled.program.steps.iter().map(|s| s.kind).collect(),
    };
    let (outputs, _) =
        moec::runtime::driver::generate(&plan, &backend, &prompts, &run, &mut |_, _| {})
            .expect("runs");
    let got: Vec<Vec<u32>> = outputs.into_iter().map(|o| o.token_ids).collect();
    assert_eq!(got, expected, "{schedule}: the oracle's tokens");
    backend.moved.into_inner().expect("counter")
}

/// What the runtime copies for `.context()` / `.appended()`, counted at the backend over
/// [`counted_run`]: prefill stores the 8 prompt positions; the 3 decode steps load the 8,
/// 9 and 10 positions cached before their token and store 1 each; per (layer, batch), 2
/// sequences x 512 bytes per position.
#[test]
fn the_runtime_copies_only_the_cached_and_appended_positions() {
    let n = L * N_UB; // (layer, batch) pairs per step
    let per_pair = |positions: u64| UBS * positions * KV_TOKEN;
    for schedule in ["flexgen", "klotski"] {
        let want: BTreeMap<(&'static str, Dir), u64> = [
            (("prefill", FromGpu), n * per_pair(8)),
            (("decode", ToGpu), n * per_pair(8 + 9 + 10)),
            (("decode", FromGpu), 3 * n * per_pair(1)),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            counted_run(schedule, true),
            want,
            "{schedule}: KV bytes the runtime copied"
        );
    }
}

/// What the runtime copies of activations in Fiddler (`route`, `acc` out to the CPU arm,
/// `acc_c` back), counted at the backend over [`counted_run`] (3 micro-batches of 2
/// sequences): per (layer, micro-batch) the rows of the step's tokens, 16 prompt tokens in
/// prefill and 2 in each of the 3 decode steps, at 16 B of routing and 1,536 B of expert
/// sums out and 1,536 B back per token. Before issue 28's live-row copies every decode
/// step moved the 16 rows the buffers are declared for (8x these bytes).
#[test]
fn the_runtime_copies_only_the_rows_of_the_steps_tokens() {
    let n = L * N_UB;
    let (prefill, decode) = (UBS * PROMPT, 3 * UBS);
    let want: BTreeMap<(&'static str, Dir), u64> = [
        (
            ("prefill", FromGpu),
            n * prefill * (ROUTE_TOKEN + ACC_TOKEN),
        ),
        (("prefill", ToGpu), n * prefill * ACC_TOKEN),
        (("decode", FromGpu), n * decode * (ROUTE_TOKEN + ACC_TOKEN)),
        (("decode", ToGpu), n * decode * ACC_TOKEN),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        counted_run("fiddler", false),
        want,
        "fiddler: activation bytes the runtime copied"
    );
}

/// The replay charges a live-row copy at what its own micro-batch held in the measured
/// step (`cost::predict::copy_bytes_at`): Fiddler's decode `acc[0] -> acc_c[0]` copies of
/// micro-batch 0 with 1 decoding sequence are 1 row of 1,536 B, while micro-batch 1 held 2
/// (the declared worst case); a micro-batch the step did not have moves nothing. Copies
/// that are not live rows (weights, sampled tokens) stay at their declared bytes. With
/// `t_copy = 1` the decode step keeps Fiddler's copy-to-GPU arm, whose guard the default
/// latency rule puts above a decode micro-batch's tokens (so that arm is never built).
#[test]
fn the_replay_charges_each_micro_batchs_own_rows() {
    use moec::cost::predict::{copy_bytes_at, Loads};
    use moec::records::UbLoad;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schedules/fiddler.sched");
    let source = common::read(&path);
    let mut options = common::small_options(&source, common::card_with_layers("mixtral-tiny", 2));
    options.sets.push(("t_copy".to_string(), "1".to_string()));
    let program = moec::compile::compile(&source, &options)
        .unwrap_or_else(|d| panic!("{}", moec::diag::render_all(&d, "fiddler", &source)))
        .program;
    let decode = |seqs: usize| UbLoad {
        decode_seqs: seqs,
        decode_context: seqs * 9,
        ..UbLoad::default()
    };
    let loads = [decode(1), decode(2)];
    let step = program
        .steps
        .iter()
        .find(|s| s.kind == StepKind::Decode)
        .expect("decode step");
    let mut by_ub: BTreeMap<u32, (u64, f64)> = BTreeMap::new();
    let mut whole = 0;
    for id in step.task_ids() {
        let task = &program.tasks[id.index()];
        let Some(copy) = task.work.copy else { continue };
        let bytes = copy_bytes_at(task, copy, Loads::Measured(&loads));
        match task.live {
            Some(live) if live.row_bytes == ACC_TOKEN => {
                let entry = by_ub.entry(live.ub).or_default();
                entry.0 += 1;
                entry.1 += bytes;
            }
            Some(_) => {}
            None => {
                assert_eq!(bytes, copy.bytes as f64, "{}", program.task_name(id));
                whole += 1;
            }
        }
    }
    // Per micro-batch: `acc -> acc_c` and `acc_c -> acc_cg` in each of the 2 layers.
    let per_ub = |rows: f64| (2 * L, 2.0 * L as f64 * rows * ACC_TOKEN as f64);
    assert_eq!(by_ub.get(&0), Some(&per_ub(1.0)));
    assert_eq!(by_ub.get(&1), Some(&per_ub(2.0)));
    assert_eq!(by_ub.get(&2), Some(&per_ub(0.0)));
    assert!(whole > 0, "the staged expert copies are not live rows");
}
