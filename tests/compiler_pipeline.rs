//! The compiler end to end on the all-constructs fixture: canonical text and dot pinned by
//! snapshots, the dependency graph checked against an independent reachability oracle,
//! and the mutations each caught at the right span.

use moec::compile::{compile, Compiled, Options};
use moec::diag::Code;
use moec::ir::deps::{self, Reduction};
use moec::ir::emit;
use moec::ir::TaskId;
use moec::model::card::ModelCard;

mod import_graph;

const FIXTURE: &str = "tests/fixtures/all_constructs.sched";

fn source() -> String {
    std::fs::read_to_string(FIXTURE).unwrap()
}

fn options() -> Options {
    Options::new(ModelCard::load("mixtral-tiny").unwrap())
}

fn compiled(source: &str) -> Compiled {
    compile(source, &options())
        .unwrap_or_else(|d| panic!("{}", moec::diag::render_all(&d, FIXTURE, source)))
}

/// Compiles a mutated source and returns the errors (it must fail).
fn errors(source: &str) -> Vec<moec::diag::Diagnostic> {
    match compile(source, &options()) {
        Ok(_) => panic!("the mutation was not caught"),
        Err(diags) => diags.into_iter().filter(|d| d.is_error()).collect(),
    }
}

fn replace_once(source: &str, from: &str, to: &str) -> String {
    assert_eq!(source.matches(from).count(), 1, "`{from}` must occur once");
    source.replacen(from, to, 1)
}

#[test]
fn canonical_text_and_dot_are_pinned() {
    let c = compiled(&source());
    insta::assert_snapshot!(
        "all_constructs_text",
        emit::to_text(&c.program, &c.info.dag)
    );
    insta::assert_snapshot!("all_constructs_dot", emit::to_dot(&c.program, &c.info.dag));
}

#[test]
fn json_round_trips_through_serde() {
    let c = compiled(&source());
    let json = emit::to_json(&c.program, &c.info.dag).unwrap();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        value["program"]["tasks"].as_array().unwrap().len(),
        c.program.tasks.len()
    );
    assert_eq!(
        value["edges"].as_array().unwrap().len(),
        c.info.dag.edges.len()
    );
}

/// Reachability by plain DFS over an edge list: the oracle for the reduction.
fn closure(n: usize, preds: &[Vec<usize>]) -> Vec<Vec<bool>> {
    let mut reach = vec![vec![false; n]; n];
    for (v, row) in reach.iter_mut().enumerate() {
        let mut stack: Vec<usize> = preds[v].clone();
        while let Some(u) = stack.pop() {
            if !row[u] {
                row[u] = true;
                stack.extend(preds[u].iter().copied());
            }
        }
    }
    reach
}

/// The fixture and every schedule in `schedules/` that compiles on the tiny card.
fn programs() -> Vec<Compiled> {
    let mut out = vec![compiled(&source())];
    for dir in ["schedules", "schedules/baselines"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        paths.sort();
        for path in paths
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "sched"))
        {
            if let Ok(c) = compile(&std::fs::read_to_string(&path).unwrap(), &options()) {
                out.push(c);
            }
        }
    }
    out
}

#[test]
fn reduction_keeps_reachability_and_removes_every_redundant_edge() {
    for c in programs() {
        check_reduction(&c);
    }
}

fn check_reduction(c: &Compiled) {
    let program = &c.program;
    let n = program.tasks.len();
    let candidates = deps::candidate_edges(program);
    let all: Vec<Vec<usize>> = candidates
        .iter()
        .map(|p| p.iter().map(|e| e.0.index()).collect())
        .collect();
    let full = closure(n, &all);
    for reduction in [Reduction::Chains, Reduction::Bitsets] {
        let dag = deps::build_with(program, reduction);
        let kept: Vec<Vec<usize>> = (0..n)
            .map(|t| {
                dag.preds(TaskId::new(t))
                    .iter()
                    .map(|e| e.from.index())
                    .collect()
            })
            .collect();
        assert_eq!(
            closure(n, &kept),
            full,
            "{}: {reduction:?} changed reachability",
            program.name
        );
        // Irredundant: no kept edge u -> v is implied by another path from u to v.
        for (v, kept_v) in kept.iter().enumerate() {
            for &u in kept_v {
                let others: Vec<usize> = kept_v.iter().copied().filter(|&w| w != u).collect();
                let implied = others.iter().any(|&w| w == u || full[w][u]);
                assert!(
                    !implied,
                    "{}: {reduction:?}: edge t{u} -> t{v} is redundant",
                    program.name
                );
            }
        }
        assert_eq!(
            dag, c.info.dag,
            "{reduction:?} differs from the default build"
        );
    }
    assert!(!petgraph::algo::is_cyclic_directed(
        &c.info.dag.to_petgraph()
    ));
}

#[test]
fn stream_order_and_data_hazards_are_edges() {
    let c = compiled(&source());
    let program = &c.program;
    let reach = {
        let n = program.tasks.len();
        let preds: Vec<Vec<usize>> = c
            .info
            .dag
            .pred_ids()
            .iter()
            .map(|p| p.iter().map(|t| t.index()).collect())
            .collect();
        closure(n, &preds)
    };
    // Every pair of tasks on one stream is ordered; every RAW pair on a buffer is ordered.
    let mut last_on_stream: Vec<Option<usize>> = vec![None; program.streams.len()];
    for (i, task) in program.tasks.iter().enumerate() {
        if let Some(prev) = last_on_stream[task.stream.index()] {
            assert!(
                reach[i][prev],
                "t{i} does not wait for t{prev} on its stream"
            );
        }
        last_on_stream[task.stream.index()] = Some(i);
    }
    for (j, later) in program.tasks.iter().enumerate() {
        for (i, earlier) in program.tasks.iter().enumerate().take(j) {
            let conflict = earlier.args.iter().any(|a| {
                later.args.iter().any(|b| {
                    a.slice.buffer == b.slice.buffer
                        && a.slice.buffer.0 != 0
                        && (a.access.writes() || b.access.writes())
                        && a.slice.start < b.slice.end()
                        && b.slice.start < a.slice.end()
                })
            });
            if conflict {
                assert!(
                    reach[j][i],
                    "t{j} touches what t{i} touched (one writes) but does not wait for it"
                );
            }
        }
    }
}

#[test]
fn every_task_has_work_and_weight_locations() {
    let c = compiled(&source());
    for (i, task) in c.program.tasks.iter().enumerate() {
        if task.op != moec::ir::Op::Copy {
            assert!(
                task.work.flops > 0.0 || matches!(task.op, moec::ir::Op::Embed { .. }),
                "t{i} has no flops"
            );
        } else {
            assert!(task.work.copy.is_some());
        }
        let weights = moec::ir::catalog::signature(&task.op, &c.program.model)
            .iter()
            .filter(|s| s.role == moec::ir::Role::W)
            .map(|s| s.expects.len())
            .sum::<usize>();
        assert_eq!(c.info.weight_locations[i].len(), weights, "t{i}");
    }
}

// ---- the mutations --------------------------------------------------------------

#[test]
fn reading_the_other_weight_slot_is_caught_at_the_argument() {
    let mutated = replace_once(
        &source(),
        "pre_attn(layer = i, ub = j, w = w_gpu[s]",
        "pre_attn(layer = i, ub = j, w = w_gpu[(s + 1) % 2]",
    );
    let errors = errors(&mutated);
    let d = errors
        .iter()
        .find(|d| d.code == Code::ValuesWrong)
        .expect("a values::wrong error");
    let span = d.primary_span().unwrap();
    assert_eq!(
        &mutated[span.start as usize..span.end as usize],
        "w_gpu[(s + 1) % 2]"
    );
    assert!(
        d.message
            .contains("expecting W[1].pre, but it holds W[0].pre"),
        "{}",
        d.message
    );
}

#[test]
fn dropping_one_page_copy_is_caught() {
    // The first page of every prefetched layer holds its attention weights.
    let mutated = replace_once(
        &source(),
        "          if p < pages {",
        "          if p < pages && p != 0 {",
    );
    let errors = errors(&mutated);
    let d = errors
        .iter()
        .find(|d| d.code == Code::ValuesWrong)
        .expect("a values::wrong error");
    assert!(d.message.contains("expecting W[1].pre"), "{}", d.message);
    let span = d.primary_span().unwrap();
    assert_eq!(&mutated[span.start as usize..span.end as usize], "w_gpu[s]");
}

#[test]
fn a_cpu_op_on_a_gpu_stream_is_caught_at_its_arguments() {
    let mutated = replace_once(
        &source(),
        "kv = kv[i][j], out = a_c[j]) on cpu",
        "kv = kv[i][j], out = a_c[j]) on gpu",
    );
    let errors = errors(&mutated);
    assert!(errors.iter().all(|d| d.code == Code::StructEngineSpace));
    let spans: Vec<&str> = errors
        .iter()
        .map(|d| d.primary_span().unwrap())
        .map(|s| &mutated[s.start as usize..s.end as usize])
        .collect();
    assert_eq!(spans, ["qkv_c[j]", "kv[i][j]", "a_c[j]"]);
}

#[test]
fn reading_a_buffer_before_it_is_written_is_caught() {
    let mutated = replace_once(&source(), "  copy qkv_g[j] -> qkv_c[j] on d2h\n", "");
    let errors = errors(&mutated);
    let d = errors
        .iter()
        .find(|d| d.code == Code::ValuesUninitialized)
        .expect("values::uninitialized");
    let span = d.primary_span().unwrap();
    assert_eq!(&mutated[span.start as usize..span.end as usize], "qkv_c[j]");
}

#[test]
fn an_after_naming_a_missing_task_is_an_error() {
    let mutated = replace_once(
        &source(),
        "after page[i, p], gate[i, j - 1] if j > 0",
        "after page[i, p + 1]",
    );
    let errors = errors(&mutated);
    assert!(
        errors.iter().any(|d| d.code == Code::ElabAfter),
        "{errors:?}"
    );
}

/// Whether every task of `c`'s step that holds task `at`, issued from `boundary` on, is
/// ordered (transitively, in the checked DAG) after every task of that step issued before it.
fn barrier_holds(c: &Compiled, at: usize, boundary: usize) -> bool {
    let program = &c.program;
    let n = program.tasks.len();
    let preds: Vec<Vec<usize>> = (0..n)
        .map(|t| {
            c.info
                .dag
                .preds(TaskId::new(t))
                .iter()
                .map(|e| e.from.index())
                .collect()
        })
        .collect();
    let reach = closure(n, &preds);
    let step = program
        .steps
        .iter()
        .find(|s| (s.first as usize..(s.first + s.count) as usize).contains(&at))
        .unwrap();
    let (first, end) = (step.first as usize, (step.first + step.count) as usize);
    (boundary..end).all(|b| (first..boundary).all(|a| reach[b][a]))
}

#[test]
fn a_sync_orders_every_later_task_of_the_step_after_every_earlier_one() {
    // A barrier after the first layer's attention and gates in decode: nothing of the
    // experts, combines or later layers may start before all of it has finished.
    let anchor = "    // Experts in run-time order (predicted hot first)";
    let synced = replace_once(
        &source(),
        anchor,
        &format!("    if i == 0 {{ sync }}\n{anchor}"),
    );
    let offset = synced.find("if i == 0 { sync }").unwrap() as u32;
    let with = compiled(&synced);
    let without = compiled(&source());
    assert_eq!(with.program.tasks.len(), without.program.tasks.len());
    // The first task issued after the `sync` (spans are in source order within a step).
    let decode = with
        .program
        .steps
        .iter()
        .find(|s| s.kind == moec::ir::StepKind::Decode)
        .unwrap();
    let boundary = (decode.first as usize..(decode.first + decode.count) as usize)
        .find(|&t| with.program.spans.tasks[t].start > offset)
        .unwrap();
    assert!(barrier_holds(&with, boundary, boundary));
    // Without it the data dependencies alone leave some pair unordered, so the test bites.
    assert!(!barrier_holds(&without, boundary, boundary));
    check_reduction(&with);
}

#[test]
fn a_sync_under_a_runtime_condition_is_an_error() {
    let anchor = "        copy e_pin[r % 2] -> e_gpu[r % 2] on h2d\n";
    let mutated = replace_once(&source(), anchor, &format!("{anchor}        sync\n"));
    let errors = errors(&mutated);
    let d = errors
        .iter()
        .find(|d| d.code == Code::ElabDynamic)
        .expect("elab::dynamic");
    let span = d.primary_span().unwrap();
    assert_eq!(&mutated[span.start as usize..span.end as usize], "sync");
}

#[test]
fn sync_is_not_a_keyword() {
    // A template or param may still be called `sync`; `sync(..)` is a call.
    let renamed = source().replace("finish(", "sync(");
    assert!(renamed.contains("template sync("));
    compiled(&renamed);
}

/// Every `.rs` file under `src/<dir>`, with its text.
fn sources_under(dir: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(dir)];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                found.push((path.display().to_string(), text));
            }
        }
    }
    assert!(!found.is_empty(), "no sources under src/{dir}");
    found
}

/// One source file under `src/`, as `(path, text)`.
fn source_of(file: &str) -> (String, String) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    (path.display().to_string(), text)
}

/// The files of `dir` that name `module` in a path (`crate::module` or `moec::module`).
fn importers(dir: &str, module: &str) -> Vec<String> {
    sources_under(dir)
        .into_iter()
        .filter(|(_, text)| {
            text.lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .any(|l| l.contains(&format!("crate::{module}")))
        })
        .map(|(path, _)| path)
        .collect()
}

/// Issue 10's layering: the back half of the compiler and the runtime never depend on the
/// parser, cost and runtime never import each other, and the driver names no backend;
/// issue 41's: backends import the registration interface, never the registry or each
/// other, the CUDA backend only the runtime's leaf modules, and the CLI and the engine no
/// backend's modules.
#[test]
fn stages_import_only_what_the_layering_allows() {
    for dir in ["lower", "runtime", "check", "cost"] {
        assert_eq!(
            importers(dir, "syntax"),
            Vec::<String>::new(),
            "src/{dir} imports syntax"
        );
    }
    assert_eq!(importers("cost", "runtime"), Vec::<String>::new());
    assert_eq!(importers("runtime", "cost"), Vec::<String>::new());
    for (path, text) in sources_under("runtime/driver") {
        for cpu_name in [
            "runtime::cpu",
            "super::cpu",
            "CpuBackend",
            "CpuMemory",
            "rayon::",
        ] {
            assert!(
                !text.contains(cpu_name),
                "{path} names the CPU backend ({cpu_name})"
            );
        }
    }
    // Issue 27: backends side by side. The interface (`runtime/backend.rs`) and the CUDA
    // backend name nothing of the CPU backend (host memory they share is `runtime::host`);
    // no module of the runtime outside the driver imports the driver (the step a task
    // reads is `runtime::step`). The runtime's root, which declares the driver and
    // re-exports its API, is the one exception.
    let mut cpu_namers = sources_under("runtime/cuda");
    cpu_namers.push(source_of("runtime/backend.rs"));
    for (path, text) in cpu_namers {
        for (n, line) in text.lines().enumerate() {
            assert!(
                !line.contains("cpu::") && !line.contains("CpuBackend"),
                "{path}:{}: names the CPU backend: {line}",
                n + 1
            );
        }
    }
    for (path, text) in sources_under("runtime") {
        if path.contains("runtime/driver/") || path.ends_with("src/runtime/mod.rs") {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            let imports_driver = ["runtime::driver", "super::driver", "super::super::driver"]
                .iter()
                .any(|p| line.contains(p));
            assert!(
                !imports_driver,
                "{path}:{}: the driver is imported outside it: {line}",
                n + 1
            );
        }
    }
    // The lines of a source that are not comments, numbered from 1.
    fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim_start().starts_with("//"))
            .map(|(n, l)| (n + 1, l))
    }
    // Issue 41: the interface below, the list on top. Backends import the interface
    // (`runtime::registration`), never the list (`runtime::registry`, which imports them),
    // so no import circle runs through the registry.
    for dir in ["runtime/cpu", "runtime/cuda"] {
        for (path, text) in sources_under(dir) {
            for (n, line) in code_lines(&text) {
                assert!(
                    !line.contains("registry"),
                    "{path}:{n}: a backend imports the registry: {line}"
                );
            }
        }
    }
    // The CUDA backend reaches the rest of the runtime only through its leaf modules: never
    // the CPU backend, the driver, the registry, or an item of the runtime's root
    // (`src/runtime/mod.rs`, which declares the driver and re-exports its API).
    let runtime_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/runtime");
    let leaves: Vec<String> = std::fs::read_dir(&runtime_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir() || p.extension().is_some_and(|e| e == "rs"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|name| !["mod", "cpu", "driver", "registry"].contains(&name.as_str()))
        .collect();
    for (path, text) in sources_under("runtime/cuda") {
        // From `cuda/mod.rs` the runtime's root is `super`; from a file beside it, `super::super`.
        let root_paths: &[&str] = if path.ends_with("cuda/mod.rs") {
            &["crate::runtime::", "super::"]
        } else {
            &["crate::runtime::", "super::super::"]
        };
        for (n, line) in code_lines(&text) {
            for root in root_paths {
                for (at, _) in line.match_indices(root) {
                    let rest = &line[at + root.len()..];
                    if *root == "super::" && rest.starts_with("super::") {
                        continue;
                    }
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    assert!(
                        leaves.contains(&name),
                        "{path}:{n}: the CUDA backend imports `{root}{name}` (only the runtime's leaf modules {leaves:?}): {line}"
                    );
                }
            }
        }
    }
    // The CLI and the engine ask the registry and its registrations, never a backend's
    // internals (what `moec devices` and `moec probe` need of CUDA is a registration entry).
    for dir in ["cli", "engine"] {
        for (path, text) in sources_under(dir) {
            for (n, line) in text.lines().enumerate() {
                assert!(
                    !line.contains("cuda::"),
                    "{path}:{}: names the CUDA backend's modules: {line}",
                    n + 1
                );
            }
        }
    }
    let cudarc_users: Vec<String> = sources_under("")
        .into_iter()
        .filter(|(path, text)| !path.contains("runtime/cuda") && text.contains("cudarc"))
        .map(|(path, _)| path)
        .collect();
    assert_eq!(
        cudarc_users,
        Vec::<String>::new(),
        "cudarc outside the CUDA backend"
    );
}

/// Issue 41's stack, top to bottom: the reference forward pass, GGUF export, weight I/O,
/// the CPU math, the model description, the block formats. Each floor imports only floors
/// below it.
const MODEL_STACK: [&str; 6] = ["oracle", "convert", "weights", "math", "model", "quant"];

/// The compiler's stages: they see a model only through its description.
const COMPILER: [&str; 8] = [
    "syntax",
    "elaborate",
    "ir",
    "check",
    "cost",
    "lower",
    "compile",
    "diag",
];

/// Issue 41: no import circle spans two top-level modules of `src/` (a circle inside one
/// module's folder is that module's business), none at all under `model/`; the model stack
/// imports only downward and nothing of the compiler, the runtime or the front ends; the
/// compiler imports `model` alone of the stack.
#[test]
fn the_model_stack_imports_only_downward_and_no_circle_spans_modules() {
    let graph = import_graph::graph();
    let mut circles = Vec::new();
    for cycle in graph.cycles() {
        let modules: std::collections::BTreeSet<&str> =
            cycle.iter().map(|f| import_graph::top(f)).collect();
        if modules.len() > 1 || modules.contains("model") {
            circles.push(cycle);
        }
    }
    assert_eq!(
        circles,
        Vec::<Vec<String>>::new(),
        "import circles across modules or inside model/"
    );
    let mut wrong = Vec::new();
    for (i, floor) in MODEL_STACK.iter().enumerate() {
        for above in &MODEL_STACK[..i] {
            wrong.extend(graph.imports_between(floor, above));
        }
        for outside in COMPILER
            .iter()
            .chain(&["runtime", "engine", "cli", "serve"])
        {
            wrong.extend(graph.imports_between(floor, outside));
        }
    }
    for stage in COMPILER {
        for floor in MODEL_STACK.iter().filter(|f| **f != "model") {
            wrong.extend(graph.imports_between(stage, floor));
        }
    }
    assert_eq!(wrong, Vec::<String>::new(), "imports against the stack");
}

/// The import graph's reading of the text: `use` trees, inline paths, `super` from inside
/// an inline module, renames, and what comments and strings hide.
#[test]
fn the_import_graph_resolves_paths_as_rustc_would() {
    let graph = import_graph::graph();
    let imports = |from: &str, to: &str| graph.edges.get(from).is_some_and(|t| t.contains(to));
    // `use crate::math::qmatmul::{QuantKernels, QuantMatrix};` in a `use` tree.
    assert!(imports("math/linear/mod.rs", "math/qmatmul/mod.rs"));
    // `super::` from a file resolves to its parent module's file.
    assert!(imports(
        "math/qmatmul/tiles_x86.rs",
        "math/qmatmul/tiles.rs"
    ));
    // The facts table names only the vocabulary (mod.rs declaring it is no import), and the
    // card reads the facts, not the families' code.
    assert_eq!(
        graph.edges.get("model/family/facts.rs").map(|t| t.len()),
        Some(1),
        "{:?}",
        graph.edges.get("model/family/facts.rs")
    );
    assert!(imports("model/card.rs", "model/family/facts.rs"));
    assert!(!imports("model/card.rs", "model/family/mod.rs"));
    assert!(imports("weights/family/mod.rs", "weights/family/hub.rs"));
}
