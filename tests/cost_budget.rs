//! Memory budgets of a compiled schedule: hand-computed bytes for one small configuration,
//! and over-budget schedules failing with the table of what occupies the space.

use moec::cost::budget::{budget_table, check_budget, BudgetOverrides};
use moec::cost::hardware::HardwareProfile;
use moec::elaborate::Options;
use moec::ir::Program;
use moec::model::card::ModelCard;

/// The CUDA backend's scratch rules, as a compile for it carries them.
fn cuda_scratch() -> Option<&'static dyn moec::ir::scratch::DeviceScratch> {
    let rules = moec::runtime::registry::find("cuda").unwrap().scratch;
    assert!(
        rules.is_some(),
        "the CUDA backend registers its scratch rules"
    );
    rules
}

/// `path` compiled on mixtral-tiny for the CUDA backend (its scratch rules).
fn compile(path: &str) -> Program {
    compile_with(path, cuda_scratch())
}

fn compile_with(
    path: &str,
    scratch: Option<&'static dyn moec::ir::scratch::DeviceScratch>,
) -> Program {
    let source = std::fs::read_to_string(path).unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.scratch = scratch;
    match moec::compile::compile(&source, &options) {
        Ok(compiled) => compiled.program,
        Err(diagnostics) => panic!("{path} does not compile: {diagnostics:?}"),
    }
}

/// The budget fixture's table on `t4`, compiled with `scratch` rules.
fn fixture_table(
    scratch: Option<&'static dyn moec::ir::scratch::DeviceScratch>,
) -> moec::cost::budget::BudgetTable {
    let program = compile_with("tests/fixtures/cost/budget.sched", scratch);
    let profile = HardwareProfile::load("t4").unwrap();
    budget_table(&program, Some(&profile), &BudgetOverrides::default())
}

/// The line of `table` in `space` whose text starts with `prefix`.
fn line<'t>(
    table: &'t moec::cost::budget::BudgetTable,
    space: &str,
    prefix: &str,
) -> &'t moec::cost::budget::BudgetLine {
    table
        .lines
        .iter()
        .find(|l| l.space == space && l.what.starts_with(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in {space}: {table}"))
}

// tests/fixtures/cost/budget.sched on mixtral-tiny (hidden 128, ffn 256, 4 heads of 32,
// 2 KV heads, 8 experts, vocab 32000, 4 layers, bf16), defaults ubs = 4, n_ub = 2,
// slack = 0.25, workload prompt 128 + gen 32. Activations and KV are f32 (4 B).
// - layer_weights(): attention 128 * (128 + 2 * 64) + 128 * 128 + 2 * 128 = 49,408;
//   router 8 * 128 = 1,024; experts 8 * 3 * 128 * 256 = 786,432; total 836,864 params =
//   1,673,728 B. expert_weights(1) = 3 * 128 * 256 * 2 = 196,608 B. head_weights() =
//   (32000 * 128 + 128) * 2 = 8,192,256 B.
// - tok_max = min(4 * 128, 10^6) = 512 tokens: hidden(512) = 512 * 128 * 4 = 262,144;
//   qkv(512) = 512 * 256 * 4 = 524,288; attn_out(512) = 262,144; routing(512) = 512 * 2 *
//   8 = 8,192; h = hidden(ceil(512 * 1.25) = 640) = 327,680; logits(4) = 4 * 32000 * 4 =
//   512,000; tokens(4) = 16.
// - gpu = 2 * 1,673,728 + 2 * 196,608 + 8,192,256 + 2 * 327,680 + 2 * 524,288
//   + 2 * 262,144 (a_g) + 2 * 8,192 + 2 * 786,432 (acc = expert_acc(512): normalised
//   rows + 2 slots per token, 512 * 3 * 128 * 4) + 2 * 512,000 + 2 * 16
//   = 16,774,432 B of buffers, plus the gpu stream's scratch (the CUDA backend's
//   workspace, `runtime::cuda::scratch`; the copy streams take none): its largest task is
//   a prefill post_attn over 512 tokens of 4 sequences, each piece 256-aligned (these
//   are): o_proj's bf16 GEMM, the hi/lo pair 2 * 512 * 128 * 2 = 262,144 and the products
//   128 * 2 * 512 * 4 = 524,288; the normalised rows 512 * 128 * 4 = 262,144, the route
//   512 * 2 * 8 = 8,192 and the slots 512 * 2 * 128 * 4 = 524,288; the router's logits
//   512 * 8 * 4 = 16,384, its pair 262,144 and products 8 * 2 * 512 * 4 = 32,768 (512
//   rows: no fused gate); the grouped experts (1,024 routed entries, on the device):
//   3 permutation tables of 1,024 * 4 = 4,096, the tiles (2 + 3 * 72) * 4 = 872 -> 1,024
//   (72 tiles: (1,024 + 15 * 8) / 16 rounded up) and the hidden rows 1,024 * 256 * 4 =
//   1,048,576 (bf16 gate and up in one launch: no rounded activations). Sum 2,954,240 B
//   (pre_attn takes 2,097,152, lm_head 1,030,144); total 19,728,672 B.
// - pinned = 2 * 1,673,728 + 2 * 196,608 + 2 * 327,680 (h_c, h_tokens = 640) + 2 * 524,288
//   + 2 * 262,144 = 5,968,896 B.
// - host = kv: 4 layers * 2 ub * kv_cache(4 * 160 = 640 tokens) = 8 * 640 * 128 * 4 =
//   2,621,440 B; plus the memory-mapped checkpoint (4 * 836,864 + 2 * 32000 * 128 + 128)
//   * 2 = 23,079,168 B (all of it is read after setup); plus the pinned buffers; plus
//   the largest CPU op workspace, prefill attention's score tiles: each of t4's 24 cores
//   keeps one tile of 16 new tokens * 4 heads * 128 keys * 4 = 32,768 B (a tile takes 16
//   rows while they are under 2^20 scores), 786,432 B: 32,455,936 B.
#[test]
fn budget_arithmetic_matches_hand_computed_bytes() {
    let table = fixture_table(cuda_scratch());
    assert_eq!(table.peak("gpu"), 19_728_672, "{table}");
    let scratch = line(&table, "gpu", "scratch on gpu (max: ");
    assert_eq!(
        (scratch.space, scratch.bytes),
        ("gpu", 2_954_240),
        "{table}"
    );
    assert!(
        !table
            .lines
            .iter()
            .any(|l| l.what.starts_with("scratch on h2d") || l.what.starts_with("scratch on d2h")),
        "copies take no scratch: {table}"
    );
    assert_eq!(table.peak("pinned"), 5_968_896, "{table}");
    assert_eq!(table.peak("host"), 32_455_936, "{table}");
    let kv = table.lines.iter().find(|l| l.what == "kv").unwrap();
    assert_eq!((kv.class, kv.buffers, kv.bytes), ("kv cache", 8, 2_621_440));
    let w_gpu = table.lines.iter().find(|l| l.what == "w_gpu").unwrap();
    assert_eq!(
        (w_gpu.space, w_gpu.class, w_gpu.bytes),
        ("gpu", "weights", 3_347_456)
    );
    assert!(table.fits());
}

/// Under `--kv-type f16` the KV cache counts 2 bytes per element: the same schedule's `kv`
/// buffers are half of the f32 ones above (8 x 640 tokens x 128 x 2 = 1,310,720 B), the
/// host peak falls by as much, and a host budget between the two peaks fits the half
/// cache and refuses the f32 one.
#[test]
fn a_half_kv_cache_counts_two_bytes_per_element() {
    let source = std::fs::read_to_string("tests/fixtures/cost/budget.sched").unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    options.scratch = cuda_scratch();
    options.kv_bytes = Some(2);
    let half = moec::compile::compile(&source, &options).unwrap().program;
    let full = compile("tests/fixtures/cost/budget.sched");
    let profile = HardwareProfile::load("t4").unwrap();
    let table = budget_table(&half, Some(&profile), &BudgetOverrides::default());
    let kv = table.lines.iter().find(|l| l.what == "kv").unwrap();
    assert_eq!((kv.class, kv.buffers, kv.bytes), ("kv cache", 8, 1_310_720));
    assert_eq!(table.peak("host"), 32_455_936 - 1_310_720, "{table}");
    let between = BudgetOverrides {
        gpu_bytes: None,
        host_bytes: Some(32_000_000.0),
    };
    assert!(check_budget(&half, Some(&profile), &between).is_ok());
    let err = check_budget(&full, Some(&profile), &between).unwrap_err();
    assert!(err.summary.starts_with("host over by"), "{}", err.summary);
}

/// One byte less GPU memory than the peak: `check` fails and the table says by how much.
#[test]
fn over_budget_by_one_byte_is_an_error_with_the_table() {
    let program = compile("tests/fixtures/cost/budget.sched");
    let profile = HardwareProfile::load("t4").unwrap();
    let overrides = BudgetOverrides {
        gpu_bytes: Some(19_728_671.0),
        host_bytes: None,
    };
    let err = check_budget(&program, Some(&profile), &overrides).unwrap_err();
    assert!(err.summary.starts_with("gpu over by"), "{}", err.summary);
    let gpu = err.table.spaces.iter().find(|s| s.space == "gpu").unwrap();
    assert_eq!(gpu.over(), 1.0);
    let text = err.to_string();
    assert!(
        text.contains("w_gpu") && text.contains("head") && text.contains("OVER by"),
        "{text}"
    );
}

/// Mixtral-8x7B does not fit a T4 when a schedule keeps two whole layers plus the head on
/// the GPU at a large micro-batch: the host side holds the 93 GB checkpoint, and the GPU
/// side exceeds 16 GB x 0.86.
#[test]
fn full_size_model_over_gpu_budget_names_the_biggest_buffers() {
    let source = std::fs::read_to_string("tests/fixtures/cost/budget.sched").unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-8x7b").unwrap());
    options.sets.push(("ubs".into(), "4096".into()));
    options.sets.push(("n_ub".into(), "8".into()));
    let program = moec::compile::compile(&source, &options).unwrap().program;
    let profile = HardwareProfile::load("t4").unwrap();
    let err = check_budget(&program, Some(&profile), &BudgetOverrides::default()).unwrap_err();
    assert!(err.summary.contains("gpu over by"), "{}", err.summary);
    let gpu: Vec<u64> = err
        .table
        .lines
        .iter()
        .filter(|l| l.space == "gpu")
        .map(|l| l.bytes)
        .collect();
    assert!(
        gpu.windows(2).all(|w| w[0] >= w[1]),
        "largest gpu group first: {}",
        err.table
    );
    // qkv_g: 8 x qkv(4096 * 128 = 524,288 tokens) = 8 * 524,288 * 6144 * 4 B = 103 GB.
    let qkv = err.table.lines.iter().find(|l| l.what == "qkv_g").unwrap();
    assert_eq!(qkv.bytes, 8 * 524_288 * 6144 * 4);
}

/// A GGUF whose layers store a tensor in different formats (llama.cpp's Q4_K_M keeps
/// `ffn_down` and `attn_v` in Q6_K in the last layer of two, Q4_K in the first): the
/// packed image gives both layers the Q6_K slot, but the process holds the file's bytes,
/// so the host budget counts the resident checkpoint (all of it, for `resident`) at
/// exactly the sum of the file's tensor sizes (the independent reference: the GGUF
/// tensor table's byte ranges), below the slots' total. One byte less host budget than
/// the peak is still refused.
#[test]
fn a_gguf_with_mixed_layer_formats_counts_the_file_s_bytes() {
    use moec::engine::{QuantizeFormats, SynthGgufRequest};
    use moec::weights::gguf::GgufFile;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("q.gguf");
    moec::engine::synth_gguf(
        &SynthGgufRequest {
            card: "tests/fixtures/gguf/qwen3-moe-q4-tiny.ron".into(),
            out: path.clone(),
            seed: 3,
            dtype: None,
            formats: QuantizeFormats::Mix("q4_k_m".into()),
            name: None,
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    let file = GgufFile::open(&path).unwrap();
    let file_bytes: u64 = file.tensors.values().map(|t| t.range.len() as u64).sum();
    let down_types: Vec<u32> = (0..2)
        .map(|l| file.tensors[&format!("blk.{l}.ffn_down_exps.weight")].ggml_type)
        .collect();
    assert_ne!(down_types[0], down_types[1], "the mix differs per layer");
    drop(file);
    let card = moec::weights::checkpoint::Checkpoint::open_gguf(&path, None)
        .unwrap()
        .card()
        .clone();
    let slots = moec::ir::CheckpointLayout::new(&card).total_bytes();
    assert!(slots > file_bytes + 100_000, "{slots} vs {file_bytes}");
    let source = std::fs::read_to_string("schedules/baselines/resident.sched").unwrap();
    let options = Options::new(card);
    let program = moec::compile::compile(&source, &options).unwrap().program;
    let table = budget_table(&program, None, &BudgetOverrides::default());
    let w = table
        .lines
        .iter()
        .find(|l| l.what.contains("(checkpoint mmap"))
        .unwrap();
    assert_eq!(w.bytes, file_bytes, "{table}");
    assert_eq!(
        moec::cost::budget::StoredImage::new(&program.model).total(),
        file_bytes
    );
    let peak = table.peak("host") as f64;
    let at = |host: f64| BudgetOverrides {
        gpu_bytes: None,
        host_bytes: Some(host),
    };
    assert!(check_budget(&program, None, &at(peak)).is_ok());
    let err = check_budget(&program, None, &at(peak - 1.0)).unwrap_err();
    assert!(
        err.summary.starts_with("host over by 1 B"),
        "{}",
        err.summary
    );
}

/// DeepSeek-V2-Lite (27 layers; MLA's latent 512 + rotary key 64 = 576) under `resident`,
/// 8 sequences of 512 + 128 tokens, half cache, compiled as a run compiles it for each
/// backend (`registry::card_for`). For the CPU, whose attention reads V as a view of K,
/// the KV line is the latent once: 27 x 8 x 640 positions x 576 x 2 B = 159,252,480 B;
/// for the CUDA backend (a V pool) twice that. And the CPU attention's pools over each
/// `kv` buffer (`KvBlocksMut::from_bytes`, as the CPU `attn` op builds them) take every
/// byte of it, and hold its 8 x 640 positions: the cache's bytes are the budget's line.
#[test]
fn an_mla_cache_counts_what_each_backend_stores() {
    use moec::math::kv_cache::KvBlocksMut;
    use moec::model::arch::ArchSpec;
    use moec::model::vocab::{KvLayout, KvType};
    use moec::runtime::registry::{card_for, find};
    let source = std::fs::read_to_string("schedules/baselines/resident.sched").unwrap();
    let lite = ModelCard::load("deepseek-v2-lite").unwrap();
    let kv_line = |backend: &str| {
        let card = card_for(find(backend).unwrap(), &lite);
        let mut options = Options::new(card.clone());
        options.kv_bytes = Some(2);
        options.sets = vec![("ubs".into(), "8".into())];
        options.workload = moec::ir::Workload {
            batch: 8,
            prompt_len: 512,
            gen_len: 128,
        };
        let program = moec::compile::compile(&source, &options).unwrap().program;
        let table = budget_table(&program, None, &BudgetOverrides::default());
        let kv = table.lines.iter().find(|l| l.what == "kv").unwrap().clone();
        (card, kv)
    };
    let (cpu_card, cpu) = kv_line("cpu");
    let (_, cuda) = kv_line("cuda");
    assert_eq!((cpu.class, cpu.buffers), ("kv cache", 27));
    assert_eq!(cpu.bytes, 27 * 8 * 640 * 576 * 2);
    assert_eq!(cpu.bytes, 159_252_480);
    assert_eq!(cuda.bytes, 2 * cpu.bytes);
    let arch = ArchSpec::from_card(&cpu_card);
    let layout = KvLayout {
        block_size: 16,
        kv_heads: arch.attn.kv_heads,
        head_dim: arch.attn.head_dim,
        values_in_keys: arch.values_in_keys(),
    };
    assert_eq!(layout.values_in_keys, Some(512));
    let mut buffer = vec![0u16; (cpu.bytes / 27 / 2) as usize];
    let pools = KvBlocksMut::from_bytes(layout, KvType::F16, bytemuck::cast_slice_mut(&mut buffer))
        .unwrap();
    assert_eq!(pools.bytes() as u64 * 27, cpu.bytes);
    assert_eq!(pools.n_blocks() * layout.block_size, 8 * 640);
}

/// The CUDA backend's scratch rules (`runtime::cuda::scratch`, what the budget's `scratch
/// on <stream>` lines count) at real sizes, by hand: DeepSeek-V2-Lite's 8,192-token
/// prefill attention (MLA: no tensor cores) takes a score per query row, head and key,
/// 8192 x 16 x 8192 x 4 = 4,294,967,296 B (the catalog counted 536,870,912; the lost
/// branch measured 4,294,967,808 on the stand-in with the call's other pieces); the
/// same task again is the memoised answer.
#[test]
fn mla_prefill_scores_are_counted_per_row_head_and_key() {
    use moec::ir::scratch::TaskFacts;
    use moec::ir::{AttnPart, Op, Shape};
    use moec::runtime::cuda::scratch::ScratchRules;
    let card = ModelCard::load("deepseek-v2-lite").unwrap();
    let workload = moec::ir::Workload {
        batch: 1,
        prompt_len: 8192,
        gen_len: 0,
    };
    let mut rules = ScratchRules::new(&card, &workload);
    let facts = TaskFacts {
        op: Op::Attn {
            layer: 1,
            ub: 0,
            part: AttnPart::All,
        },
        shape: Shape {
            tokens: 8192,
            seqs: 1,
            context: 8192,
            act_bytes: 4,
            kv_bytes: 4,
        },
        kv_arg: true,
        a_args: 1,
        acc_args: 1,
        kv_copy: None,
    };
    assert_eq!(rules.task_bytes(&facts), 8192 * 16 * 8192 * 4);
    assert_eq!(rules.task_bytes(&facts), 8192 * 16 * 8192 * 4);
}

/// The schedule language's `gpu_scratch(n, s, c)` is the rules' largest task over every op
/// and layer: on the budget fixture's card at its prefill shape (512 tokens of 4
/// sequences, context 160) it is the post_attn the budget table names, 2,954,240 B (worked
/// in the hand arithmetic above), and a decode step's (4 tokens) takes less.
#[test]
fn gpu_scratch_helper_is_the_largest_task_of_a_micro_batch() {
    use moec::runtime::cuda::scratch::max_task_bytes;
    let card = ModelCard::load("mixtral-tiny").unwrap();
    assert_eq!(max_task_bytes(&card, 512, 4, 160), 2_954_240);
    assert!(max_task_bytes(&card, 4, 4, 160) < 2_954_240);
}

/// Compiled without a backend's scratch rules (the CPU backend registers none: its `gpu`
/// tasks compute on host memory), the GPU keeps the op catalog's workspace of its largest
/// `gpu.compute` task, in a line that says so: the budget fixture's prefill post_attn over
/// 512 tokens, per token the merged attention row (4 * 32 = 128), the normalised row and 2
/// slots (3 * 128), one expert's gathered row (128) and its gate and up values (2 * 256):
/// 1,152 floats, 512 * 1,152 * 4 = 2,359,296 B (the peak 16,774,432 + 2,359,296 =
/// 19,133,728 B, as before the rules existed). `gpu_scratch(..)` is then the catalog's
/// bound of its task, and a `lint::catalog_scratch` warning says so once a program.
#[test]
fn without_scratch_rules_the_gpu_keeps_the_catalog_workspace_and_says_so() {
    let cpu = moec::runtime::registry::find("cpu").unwrap();
    assert!(cpu.scratch.is_none());
    let table = fixture_table(cpu.scratch);
    assert_eq!(table.peak("gpu"), 19_133_728, "{table}");
    let line = line(&table, "gpu", "op workspace");
    assert_eq!(line.bytes, 2_359_296, "{table}");
    assert!(
        line.what
            .starts_with("op workspace (catalog: no backend scratch rules; max: "),
        "{}",
        line.what
    );
    assert!(
        !table.lines.iter().any(|l| l.what.starts_with("scratch on")),
        "{table}"
    );
    // The language's helper: the rules' bound with them, the catalog's without.
    let source = "schedule s\nbuffer x: gpu = gpu_scratch(512, 4, 160)\n\
                  buffer y: gpu = gpu_scratch(4, 4, 160)\nprefill { }\n";
    let file = moec::compile::source_to_ast(source).unwrap();
    let mut options = Options::new(ModelCard::load("mixtral-tiny").unwrap());
    let sizes = |p: &Program| p.buffers.iter().find(|b| b.name == "x").unwrap().bytes;
    let lints = |warnings: &[moec::diag::Diagnostic]| {
        warnings
            .iter()
            .filter(|d| d.code == moec::diag::Code::LintCatalogScratch)
            .count()
    };
    // The budget line's task (prefill post_attn over 512 tokens) is the largest: the same
    // 2,359,296 B; one warning for the two calls.
    let (program, warnings) = moec::compile::ast_to_ir(&file, &options).unwrap();
    assert_eq!(sizes(&program), 2_359_296);
    assert_eq!(lints(&warnings), 1, "{warnings:?}");
    options.scratch = cuda_scratch();
    let (program, warnings) = moec::compile::ast_to_ir(&file, &options).unwrap();
    assert_eq!(sizes(&program), 2_954_240);
    assert_eq!(lints(&warnings), 0, "{warnings:?}");
}
