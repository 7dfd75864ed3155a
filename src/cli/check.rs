//! `moec check SCHED`: compile a schedule and print a one-screen summary or its diagnostics.

use crate::compile::{self, Compiled, Options};
use crate::cost::budget::{check_budget, parse_bytes, BudgetOverrides};
use crate::cost::hardware::HardwareProfile;
use crate::diag::{self, Diagnostic};
use crate::ir::emit::human_bytes;
use crate::ir::Workload;
use crate::model::card::ModelCard;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments shared by every command that compiles a schedule.
#[derive(Debug, Clone, clap::Args)]
pub struct SchedArgs {
    /// The `.sched` file.
    pub sched: PathBuf,
    /// Model card: a built-in name, a `.ron` path, or a llama.cpp `.gguf` file (its
    /// architecture and tensor formats, read from its header).
    #[arg(long, default_value = "mixtral-tiny")]
    pub model: String,
    /// Storage formats per weight class, on top of the card's dtype:
    /// `experts=q4_k,attention=q8_0` (classes experts, attention, shared, router, norms,
    /// embedding, head; formats bf16, f16, f32, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k, mxfp4).
    #[arg(long, value_name = "CLASS=FORMAT,..")]
    pub weight_format: Option<String>,
    /// Override a param: `--set n_ub=8` (repeatable).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub sets: Vec<String>,
    /// Sequences in the batch (the `batch` symbol).
    #[arg(long, default_value_t = Workload::default().batch, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: u64,
    /// Prompt tokens per sequence, worst case (the `prompt_len` symbol).
    #[arg(long, default_value_t = Workload::default().prompt_len)]
    pub prompt_len: u64,
    /// Generated tokens per sequence (the `gen_len` symbol).
    #[arg(long, default_value_t = Workload::default().gen_len)]
    pub gen_len: u64,
    /// Hardware profile (see `moec hw`): defines `gpu.mem`, `host.mem`, ... for the
    /// schedule and, for `check`, the memory budgets.
    #[arg(long)]
    pub hw: Option<String>,
    /// Routing profile (`moec profile` output) that `rank(..)` placement and the cost
    /// model read.
    #[arg(long = "profile", value_name = "FILE")]
    pub routing_profile: Option<PathBuf>,
    /// KV cache element type the run will keep (`moec run --kv-type`): `f16` sizes the
    /// `kv_cache(..)` buffers and the KV traffic at 2 bytes an element; f32 if not given.
    #[arg(long, value_parser = super::inputs::kv_type)]
    pub kv_type: Option<crate::model::vocab::KvType>,
    /// Backend the schedule is compiled and its memory budgets proved for, as `moec run
    /// --backend` runs it: `cuda` counts each device stream's workspace by the CUDA
    /// kernels' scratch rules (a `scratch on <stream>` budget line each; `gpu_scratch(..)`
    /// is their bound); `cpu` (the default, as `moec run`'s) the op catalog's workspace.
    #[arg(long, default_value = "cpu", value_parser = super::inputs::backend())]
    pub backend: &'static crate::runtime::Registration,
}

/// Why a schedule could not be compiled, ready to print.
pub struct Failure {
    /// Rendered text for stderr.
    pub text: String,
}

impl SchedArgs {
    /// Reads the file and compiles it; on failure gives the rendered diagnostics.
    pub fn compile(&self) -> Result<(Compiled, String, String), Failure> {
        let name = self.sched.display().to_string();
        let source = crate::textfile::read_capped(&self.sched, crate::textfile::SOURCE_LIMIT)
            .map_err(|e| Failure {
                text: format!("error: cannot read {name}: {e}\n"),
            })?;
        let model =
            super::inputs::planning_card(&self.model, self.weight_format.as_deref(), self.backend)
                .map_err(|e| Failure {
                    text: format!("error: {e}\n"),
                })?;
        let mut options = Options::new(model);
        options.scratch = self.backend.scratch;
        options.kv_bytes = self.kv_type.map(|kv| kv.bytes());
        if let Some(path) = &self.routing_profile {
            options.profile = Some(
                super::inputs::load_routing_profile(path, &options.model).map_err(|e| Failure {
                    text: format!("error: {e}\n"),
                })?,
            );
        }
        if let Some(hw) = &self.hw {
            let profile = HardwareProfile::load(hw).map_err(|e| Failure {
                text: format!("error: {e}\n"),
            })?;
            options.hardware = profile
                .symbols()
                .into_iter()
                .map(|(name, value)| (name.to_string(), value))
                .collect();
        }
        options.workload = Workload {
            batch: self.batch,
            prompt_len: self.prompt_len,
            gen_len: self.gen_len,
        };
        for set in &self.sets {
            match set.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => options
                    .sets
                    .push((k.trim().to_string(), v.trim().to_string())),
                _ => {
                    let d = Diagnostic::malformed_set(set);
                    return Err(Failure {
                        text: diag::render(&d, &name, &source),
                    });
                }
            }
        }
        match compile::compile(&source, &options) {
            Ok(compiled) => Ok((compiled, name, source)),
            Err(diags) => {
                let errors = diags.iter().filter(|d| d.is_error()).count();
                let mut text = diag::render_all(&diags, &name, &source);
                text.push_str(&format!(
                    "\n{name}: {errors} error(s); the schedule was rejected\n"
                ));
                Err(Failure { text })
            }
        }
    }
}

/// Arguments of `moec check`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    sched: SchedArgs,
    /// GPU memory budget (e.g. 16GB); checks budgets even without `--hw`.
    #[arg(long)]
    gpu_mem: Option<String>,
    /// Host memory budget (e.g. 192GB); checks budgets even without `--hw`.
    #[arg(long)]
    host_mem: Option<String>,
}

/// Checks memory budgets when `--hw`, `--gpu-mem` or `--host-mem` is given; `Err` is the
/// text to print (over budget, or a bad flag).
fn check_memory(args: &CheckArgs, compiled: &Compiled) -> Result<Option<String>, String> {
    if args.sched.hw.is_none() && args.gpu_mem.is_none() && args.host_mem.is_none() {
        return Ok(None);
    }
    let profile = match &args.sched.hw {
        Some(hw) => Some(HardwareProfile::load(hw).map_err(|e| format!("error: {e}"))?),
        None => None,
    };
    let overrides = BudgetOverrides {
        gpu_bytes: args
            .gpu_mem
            .as_deref()
            .map(parse_bytes)
            .transpose()
            .map_err(|e| format!("error: --gpu-mem: {e}"))?,
        host_bytes: args
            .host_mem
            .as_deref()
            .map(parse_bytes)
            .transpose()
            .map_err(|e| format!("error: --host-mem: {e}"))?,
    };
    match check_budget(&compiled.program, profile.as_ref(), &overrides) {
        Ok(table) => Ok(Some(format!(
            "memory (peak per space over the run)\n{table}"
        ))),
        Err(over) => Err(format!("error[memory::over_budget]: {over}")),
    }
}

/// The one-screen summary of a checked program.
pub fn summary(compiled: &Compiled) -> String {
    let program = &compiled.program;
    let info = &compiled.info;
    let mut out = String::new();
    let w = program.workload;
    out.push_str(&format!(
        "{}: ok — {} tasks, {} edges ({} before reduction), {} step(s)\n",
        program.name,
        program.tasks.len(),
        info.dag.edges.len(),
        info.dag.edges_before_reduction,
        program.steps.len()
    ));
    // The batch the schedule runs is its `microbatches` line (often its own params), not
    // the symbol `batch` (`--batch`), which only schedules that name it follow.
    let mb = program.micro_batches;
    out.push_str(&format!(
        "  model {} · batch {} (microbatches {mb}) · prompt_len {} · gen_len {}\n",
        program.model.label(),
        u64::from(mb.count) * mb.size,
        w.prompt_len,
        w.gen_len,
    ));
    if w.batch != u64::from(mb.count) * mb.size && mb.mixed_tokens == mb.size {
        out.push_str(&format!(
            "  note: the symbol `batch` is {}; this schedule's batch is set by its params (--set)\n",
            w.batch
        ));
    }
    if !program.params.is_empty() {
        let params: Vec<String> = program
            .params
            .iter()
            .map(|p| format!("{}={}", p.name, p.value))
            .collect();
        out.push_str(&format!("  params {}\n", params.join(" ")));
    }
    out.push_str("streams\n");
    let counts = info.tasks_per_stream(program);
    for (stream, count) in program.streams.iter().zip(counts) {
        out.push_str(&format!(
            "  {:<12} {:<13} {count:>7} tasks\n",
            stream.name,
            stream.engine.as_str()
        ));
    }
    out.push_str("buffers\n");
    for (space, count, bytes) in info.buffers_per_space(program) {
        out.push_str(&format!(
            "  {:<12} {count:>5} buffers {:>12}\n",
            space.as_str(),
            human_bytes(bytes)
        ));
    }
    let checkpoint = &program.buffers[0];
    out.push_str(&format!(
        "  {:<12}  checkpoint {:>12} ({})\n",
        checkpoint.space.as_str(),
        human_bytes(checkpoint.bytes),
        if checkpoint.space == crate::ir::Space::Disk {
            "on disk, read by `disk.read` copies"
        } else {
            "memory-mapped, read-only"
        }
    ));
    for copy in program
        .buffers
        .iter()
        .filter(|b| matches!(b.kind, crate::ir::BufferKind::FormatCopy { .. }))
    {
        out.push_str(&format!(
            "  {:<12} format copy {:>12} (`{}`: the experts converted at load, read-only)\n",
            copy.space.as_str(),
            human_bytes(copy.bytes),
            copy.name
        ));
    }
    out.push_str(&weights_text(&program.model));
    if !program.substitutes.is_empty() {
        let formats: Vec<String> = program
            .substitutes
            .iter()
            .map(|s| format!("experts in {}", s.format.name().to_ascii_lowercase()))
            .collect();
        let (substituted, all) = info.substituted_experts();
        let effect = if substituted == 0 {
            "this plan does not use it: its tokens are the oracle's"
        } else {
            "tokens are compared with the oracle within a bound, not exactly"
        };
        out.push_str(&format!(
            "lossy substitute: {} (declared); {substituted} of {all} expert weight reads in the plan use it; {effect}\n",
            formats.join(", ")
        ));
    }
    out.push_str(&format!("warnings: {}\n", info.warnings.len()));
    out
}

/// The checkpoint's bytes per weight class, with the formats each holds.
pub fn weights_text(card: &ModelCard) -> String {
    let mut out = String::from("weights (bytes per class in the checkpoint buffer W)\n");
    for (class, bytes, formats) in crate::model::layout::bytes_by_class(card) {
        let names: Vec<&str> = formats.iter().map(|f| f.name()).collect();
        out.push_str(&format!(
            "  {:<12} {:>12}  {}\n",
            class.name(),
            human_bytes(bytes),
            names.join(" ")
        ));
    }
    out
}

/// Runs `moec check`.
pub fn run(args: &CheckArgs) -> ExitCode {
    match args.sched.compile() {
        Ok((compiled, name, source)) => {
            let memory = match check_memory(args, &compiled) {
                Ok(memory) => memory,
                Err(text) => {
                    eprintln!("{text}");
                    return ExitCode::from(1);
                }
            };
            print!("{}", summary(&compiled));
            if let Some(memory) = memory {
                print!("{memory}");
            }
            if !compiled.warnings().is_empty() {
                eprint!("{}", diag::render_all(compiled.warnings(), &name, &source));
            }
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprint!("{}", failure.text);
            ExitCode::from(1)
        }
    }
}
