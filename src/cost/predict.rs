//! Predicts how fast a compiled program runs on a hardware profile.
//!
//! Takes a [`Program`] (the IR), each task's predecessors (the dependency analysis'
//! output), a [`HardwareProfile`] and [`CostSettings`]; gives each task's HRM time, the
//! simulated timeline of every step, time per decode step, tokens/s (decode-only and end
//! to end as the papers measure it: generated tokens over prefill + decode time), busy
//! share per stream and resource, and the analytical bounds for the same work.
//! Guarantees: task times come only from the catalog's [`Work`] and the
//! profile; at the declared load a guarded (routing-dependent) task is charged by its
//! expected activation ([`super::activation`]: the probability its guard holds, and for
//! an expert computation the expected share of its tokens under that guard), so a sparse
//! decode step costs the experts it is expected to run, and each load arm its expected
//! share; at a measured load (replay) the run's own routing decided, so tasks are charged
//! in full.

use super::activation::Activation;
use super::bounds::{self, LayerBound, Stage1Bound, Stage1Inputs};
use super::hardware::{ComputeDtype, HardwareProfile, KernelRates, Level, Processor};
use super::hrm::{compute_time, copy_time, ComputeLoad, Roof, TaskTime};
use super::sim::SimError;
use crate::ir::catalog::{self, ArgType, AttnPart, CopyWork, CostClass, Shape, ACT_BYTES};
use crate::ir::StepKind;
use crate::ir::{BufferKind, Engine, Layout, Op, Program, Role, Space, TaskId, Work};
use crate::records::timeline::Timeline;
use crate::records::UbLoad;
use serde::Serialize;
use std::collections::BTreeMap;

use super::step::*;
pub use super::step::{FixedCosts, PointCosts};

/// Which context length decode work assumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub enum DecodeContext {
    /// `prompt_len + gen_len / 2`: the mean over the generation, what throughput sees.
    #[default]
    Average,
    /// `prompt_len + gen_len`: the catalog's worst case, what the last step sees.
    WorstCase,
}

/// Knobs of the prediction.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct CostSettings {
    /// Context length assumed by decode attention.
    pub decode_context: DecodeContext,
}

/// The memory level a space lives in.
pub fn level_of(space: Space) -> Level {
    match space {
        Space::Gpu => Level::Gpu,
        Space::Pinned => Level::Pinned,
        Space::Host => Level::Host,
        Space::Disk => Level::Disk,
    }
}

/// The resource an engine's streams occupy. Copy streams in opposite directions share one
/// link unless the profile says the link is full duplex.
pub fn resource_of(engine: Engine, profile: &HardwareProfile) -> &'static str {
    match engine {
        // On the CPU backend both compute engines are one pool on the same cores.
        Engine::GpuCompute if profile.adjustments.shared_compute => "cpu",
        Engine::GpuCompute => "gpu",
        Engine::GpuCopyIn if profile.links.duplex => "link h2d",
        Engine::GpuCopyOut if profile.links.duplex => "link d2h",
        Engine::GpuCopyIn | Engine::GpuCopyOut => "link (half duplex)",
        Engine::CpuCompute => "cpu",
        // Relay copies and CPU kernels read and write the same DRAM; when the profile says
        // so they share one resource (each bandwidth-bound, so taking turns is sharing).
        Engine::CpuCopy if profile.adjustments.shared_host_dram => "cpu",
        Engine::CpuCopy => "cpu memcpy",
        // The drive is its own resource: reads overlap with compute and with the link.
        Engine::DiskRead => "disk",
    }
}

/// What a buffer holds, for labels and budget tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum BufferClass {
    /// Model weights (the checkpoint or a buffer passed as `w`).
    Weights,
    /// A KV cache (passed as `kv`).
    KvCache,
    /// Everything else: hidden states, QKV, routing, logits, tokens.
    Activations,
}

impl BufferClass {
    /// `weights`, `kv cache`, `activations`.
    pub fn name(self) -> &'static str {
        match self {
            BufferClass::Weights => "weights",
            BufferClass::KvCache => "kv cache",
            BufferClass::Activations => "activations",
        }
    }
}

/// Classifies every buffer by layout and by the roles tasks pass it as; a buffer only
/// ever copied takes the class of what is copied into or out of it.
pub fn buffer_classes(program: &Program) -> Vec<BufferClass> {
    let mut classes: Vec<Option<BufferClass>> = program
        .buffers
        .iter()
        .map(|b| match (b.kind, b.layout) {
            (BufferKind::Checkpoint | BufferKind::FormatCopy { .. }, _) => {
                Some(BufferClass::Weights)
            }
            (_, Layout::Layer | Layout::Dense | Layout::Experts { .. }) => {
                Some(BufferClass::Weights)
            }
            _ => None,
        })
        .collect();
    for task in &program.tasks {
        for arg in &task.args {
            // The argument's type in the op table says what the buffer holds; copies
            // (untyped bytes) carry whatever their other end holds, propagated below.
            let class = match task.op.def().arg(arg.role).map(|a| a.ty) {
                Some(ArgType::Weights) => BufferClass::Weights,
                Some(ArgType::KvCache) => BufferClass::KvCache,
                Some(ArgType::Bytes) | None => continue,
                Some(_) => BufferClass::Activations,
            };
            let slot = &mut classes[arg.slice.buffer.index()];
            if slot.is_none() {
                *slot = Some(class);
            }
        }
    }
    // Copies propagate classes both ways until nothing changes (relay buffers). Each
    // pass visits the copies' (source, destination) buffers in task order, gathered once
    // (a pass over every task was a pass over 10^5-10^6 of them per planner point); a
    // copy between the same buffers as the one before it changes nothing the first did
    // not, so it is left out.
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for task in program.tasks.iter().filter(|t| t.op == Op::Copy) {
        if let [src, dst] = task.args.as_slice() {
            let pair = (src.slice.buffer.index(), dst.slice.buffer.index());
            if pairs.last() != Some(&pair) {
                pairs.push(pair);
            }
        }
    }
    loop {
        let mut changed = false;
        for &(s, d) in &pairs {
            match (classes[s], classes[d]) {
                (Some(c), None) => {
                    classes[d] = Some(c);
                    changed = true;
                }
                (None, Some(c)) => {
                    classes[s] = Some(c);
                    changed = true;
                }
                _ => {}
            }
        }
        if !changed {
            break;
        }
    }
    classes
        .into_iter()
        .map(|c| c.unwrap_or(BufferClass::Activations))
        .collect()
}

/// Context length decode attention assumes under `settings`.
pub fn decode_context_len(program: &Program, settings: &CostSettings) -> u64 {
    let w = program.workload;
    match settings.decode_context {
        DecodeContext::Average => w.prompt_len + w.gen_len.div_ceil(2),
        DecodeContext::WorstCase => w.prompt_len + w.gen_len,
    }
}

/// Which micro-batch contents the tasks are costed at.
#[derive(Debug, Clone, Copy, Default)]
pub enum Loads<'a> {
    /// The program's declared worst case: every micro-batch full, decode attention at the
    /// context [`CostSettings`] chooses.
    #[default]
    Declared,
    /// What each micro-batch really held in one executed step (indexed by `ub`): every
    /// per-micro-batch compute task is re-costed at that load (see [`measured_shape`]).
    Measured(&'a [UbLoad]),
    /// A mixed step's steady-state pass ([`steady_mixed_loads`]): compute re-costed as for
    /// `Measured`, and activation copies scaled to the rows the pass holds (the papers'
    /// systems copy the rows in use; the compiled buffers hold the worst case).
    Steady(&'a [UbLoad]),
}

/// The steady state of MoE-Lens's resource-aware scheduler (§6.2) for one micro-batch
/// group of `seqs` sequences: every sequence is prefilled once and then decodes, living
/// `gen_len` passes, so each pass admits `seqs / gen_len` new prompts (rounded up) while
/// the rest decode at the mean context `prompt_len + gen_len / 2`. A group whose pass
/// holds fewer new tokens than that (`microbatches .. tokens T`) admits only the `a`
/// prompts for which `a` prompts and the `a x (gen_len - 1)` sequences they keep decoding
/// fit in `T` (at least one), and has fewer sequences decoding. Likewise a group whose KV
/// cache holds fewer tokens than its sequences in flight need (`kv_pct` below 100): the
/// scheduler keeps only as many in flight as the cache holds, `a` prompts and `a x
/// (gen_len - 1)` sequences at the mean context (MoE-Lens eq. 8-13: the KV capacity
/// bounds the concurrency). A cache too small for even one prompt a pass (`a` would be 0)
/// keeps as many sequences in flight as it holds at the mean context (at least one), each
/// admitted when another ends: such a pass decodes them and prefills a prompt only every
/// `gen_len` passes or fewer, rounded to none.
pub fn steady_mixed_loads(program: &Program) -> Vec<UbLoad> {
    let w = program.workload;
    let seqs = program.micro_batches.size as usize;
    let gen = w.gen_len.max(1) as usize;
    let prompt = w.prompt_len as usize;
    let context = prompt + gen.div_ceil(2);
    let tokens = program.micro_batches.mixed_tokens as usize;
    let by_tokens = (tokens / (prompt + gen - 1).max(1)).max(1);
    let kv = kv_capacity_tokens(program);
    let by_kv = kv.map_or(usize::MAX, |kv| kv / (prompt + (gen - 1) * context).max(1));
    let (prefill_seqs, decode_seqs) = match kv {
        // Clamping `a` to one prompt a pass here would keep `gen_len - 1` sequences
        // decoding in a cache that holds fewer: the planner then ranked a `kv_pct = 1`
        // VSLPipe at 32x the tokens a pass its run gave (H200, 2026-11-30).
        Some(kv) if by_kv == 0 => {
            let in_flight = (kv / context.max(1)).clamp(1, seqs.max(1));
            let prefill = in_flight / gen;
            (prefill, in_flight - prefill)
        }
        _ => {
            let prefill = seqs.div_ceil(gen).min(by_tokens).min(by_kv).min(seqs);
            (prefill, (seqs - prefill).min(prefill * (gen - 1)))
        }
    };
    let load = UbLoad {
        prefill_seqs,
        prefill_tokens: prefill_seqs * prompt,
        decode_seqs,
        decode_context: decode_seqs * context,
        active_experts: Vec::new(),
    };
    vec![load; program.micro_batches.count as usize]
}

/// Tokens the smallest KV cache an attention task reads holds (its `kv` argument's bytes
/// over a token's K and V of one layer), as the runtime's scheduler sizes a micro-batch's
/// pool; `None` for a program whose attention reads no cache argument.
pub(super) fn kv_capacity_tokens(program: &Program) -> Option<usize> {
    let per_token = program.model.kv_elems_per_token_layer();
    program
        .tasks
        .iter()
        .filter(|t| matches!(t.op, Op::Attn { .. }))
        .flat_map(|t| {
            let bytes = (per_token * t.shape.kv_bytes).max(1);
            t.args
                .iter()
                .filter(|a| a.role == Role::Kv)
                .map(move |a| (a.slice.len / bytes) as usize)
        })
        .min()
}

/// The shape a per-micro-batch task has under a measured load. `attn(part = prefill)`
/// sees the prefill sequences at their mean prompt length; `attn(part = decode)` the
/// decoding sequences at their mean attended context; `attn(part = all)` every sequence at
/// the token-weighted mean context (so its FLOPs match the prefill rows' causal half plus
/// the decode rows' contexts); every other op the micro-batch's new tokens (prompt tokens
/// plus one per decoding sequence) and sequences.
pub fn measured_shape(op: &Op, declared: Shape, load: &UbLoad) -> Shape {
    let prefill_seqs = load.prefill_seqs as u64;
    let prefill_tokens = load.prefill_tokens as u64;
    let decode_seqs = load.decode_seqs as u64;
    let decode_context = load.decode_context as u64;
    // Rounded to nearest; nothing over no sequences.
    let mean = |total: u64, count: u64| (total + count / 2).checked_div(count).unwrap_or(0);
    let tokens = prefill_tokens + decode_seqs;
    let seqs = prefill_seqs + decode_seqs;
    match op {
        Op::Attn {
            part: AttnPart::Prefill,
            ..
        } => Shape {
            tokens: prefill_tokens,
            seqs: prefill_seqs,
            context: mean(prefill_tokens, prefill_seqs),
            ..declared
        },
        Op::Attn {
            part: AttnPart::Decode,
            ..
        } => Shape {
            tokens: decode_seqs,
            seqs: decode_seqs,
            context: mean(decode_context, decode_seqs),
            ..declared
        },
        Op::Attn {
            part: AttnPart::All,
            ..
        } => {
            // A prompt of p tokens attends to p(p+1)/2 keys in all; with only the sum of
            // prompt lengths known, each prompt counts at the mean length.
            let prompt = mean(prefill_tokens, prefill_seqs);
            let prefill_keys = prefill_seqs * prompt * (prompt + 1) / 2;
            Shape {
                tokens,
                seqs,
                context: mean(prefill_keys + decode_context, tokens),
                ..declared
            }
        }
        _ => Shape {
            tokens,
            seqs,
            ..declared
        },
    }
}

/// The shape a task is re-costed at, or `None` when its declared [`Work`] stands: copies
/// (the runtime copies whole declared slices), tasks without a micro-batch, and under
/// [`Loads::Declared`] everything but decode attention, which is re-costed at the context
/// `settings` chooses.
pub(super) fn recost_shape(
    program: &Program,
    id: TaskId,
    settings: &CostSettings,
    loads: Loads<'_>,
) -> Option<Shape> {
    let task = program.task(id);
    match loads {
        Loads::Declared => {
            let decode_like = matches!(
                task.op,
                Op::Attn {
                    part: AttnPart::Decode | AttnPart::All,
                    ..
                }
            );
            (decode_like && settings.decode_context != DecodeContext::WorstCase).then(|| Shape {
                context: decode_context_len(program, settings).min(task.shape.context),
                ..task.shape
            })
        }
        Loads::Measured(per_ub) | Loads::Steady(per_ub) => {
            let load = per_ub.get(task.op.ub()? as usize)?;
            Some(measured_shape(&task.op, task.shape, load))
        }
    }
}

/// The HRM load of a compute task at the shape [`recost_shape`] picks. A task whose
/// micro-batch holds nothing (no tokens, no sequences) does nothing: the kernels see zero
/// rows and touch no weights.
pub(super) fn compute_load(
    program: &Program,
    id: TaskId,
    settings: &CostSettings,
    loads: Loads<'_>,
) -> ComputeLoad {
    let task = program.task(id);
    let (_, work) = task_work(program, id, settings, loads);
    let processor = match program.engine_of(id) {
        Engine::GpuCompute => Processor::Gpu,
        _ => Processor::Cpu,
    };
    // The host's pinned and pageable memory are one DRAM: a CPU task's traffic in both
    // adds up on one bus.
    let mut per_level: BTreeMap<Level, f64> = BTreeMap::new();
    // An `experts(.., ub = all)` group reads its weights once, in its first task.
    let shares_weights = task.group.is_some_and(|head| head != id);
    for traffic in &work.mem {
        if shares_weights && traffic.class == catalog::DataClass::Weights {
            continue;
        }
        let mut level = level_of(traffic.space);
        if processor == Processor::Cpu && level == Level::Pinned {
            level = Level::Host;
        }
        *per_level.entry(level).or_default() += traffic.bytes;
    }
    ComputeLoad {
        processor,
        dtype: match processor {
            // GPU kernels run in the weights' half precision on tensor cores; the CPU
            // computes attention in f32 (MoE-Lightning §3.3 footnote 5).
            Processor::Gpu => ComputeDtype::Half,
            Processor::Cpu => ComputeDtype::F32,
        },
        flops: work.flops,
        bytes: per_level.into_iter().collect(),
    }
}

/// The shape a compute task runs at under `loads` and its catalog work there. A task whose
/// micro-batch holds nothing (no tokens, no sequences) does nothing: the kernels see zero
/// rows and touch no weights.
pub(super) fn task_work(
    program: &Program,
    id: TaskId,
    settings: &CostSettings,
    loads: Loads<'_>,
) -> (Shape, Work) {
    let task = program.task(id);
    // Experts computed from a format copy read the copy's bytes: the catalog's work on
    // the card whose experts are stored in that format.
    let copy_card = weight_copy_format(program, id)
        .and_then(|f| crate::model::layout::with_expert_storage(&program.model, f).ok());
    let card = copy_card.as_ref().unwrap_or(&program.model);
    let layout = copy_card
        .as_ref()
        .map_or_else(|| program.checkpoint(), crate::ir::CheckpointLayout::new);
    let args = || -> Vec<(Role, Space, u64)> {
        task.args
            .iter()
            .map(|a| (a.role, program.buffer(a.slice.buffer).space, a.slice.len))
            .collect()
    };
    match recost_shape(program, id, settings, loads) {
        Some(shape) if shape.tokens == 0 && shape.seqs == 0 => (shape, Work::default()),
        Some(shape) => {
            let mut work = catalog::work_in(&task.op, card, &layout, &shape, &args());
            if let Some(seen) = seen_active_experts(program, id, loads) {
                read_seen_experts(&mut work, &task.op, card, &layout, &shape, seen);
            }
            (shape, work)
        }
        None if copy_card.is_some() => (
            task.shape,
            catalog::work_in(&task.op, card, &layout, &task.shape, &args()),
        ),
        None => (task.shape, task.work.clone()),
    }
}

/// Bytes of weights the HRM charges compute task `id` at the declared load, every level
/// together, before its expected activation scales them (a format copy's at the copy's
/// format, [`weight_copy_format`]).
pub fn weight_bytes(program: &Program, id: TaskId, settings: &CostSettings) -> f64 {
    task_work(program, id, settings, Loads::Declared)
        .1
        .mem
        .iter()
        .filter(|m| m.class == catalog::DataClass::Weights)
        .map(|m| m.bytes)
        .sum()
}

/// The format of the expert weights an `experts` task computes with, when its `w`
/// argument holds a format copy (`W[l].expert(e).format(..)`): read in place, or brought
/// there by copies (fetches included) earlier in its step or in `setup`, followed back
/// through relay buffers. `None` for the checkpoint's own format. Only a program that
/// declares a substitute can read a copy (the checker's `values::undeclared_substitute`),
/// so any other returns at once.
///
/// Where a copy of `with_expert_storage` cannot be laid out the checker refuses the
/// schedule; a point the planner costs before checking is then costed at the
/// checkpoint's bytes (see [`task_work`]) and refused when checked.
pub fn weight_copy_format(program: &Program, id: TaskId) -> Option<crate::model::Storage> {
    if program.substitutes.is_empty() {
        return None;
    }
    let task = program.task(id);
    if !matches!(task.op, Op::Experts { .. }) {
        return None;
    }
    let w = task.args.iter().find(|a| a.role == Role::W)?;
    held_format(program, id, &w.slice, 8)
}

/// The format of what `slice` holds when task `before` runs (see [`weight_copy_format`]);
/// `depth` bounds the relay chain followed.
fn held_format(
    program: &Program,
    before: TaskId,
    slice: &crate::ir::Slice,
    depth: u32,
) -> Option<crate::model::Storage> {
    match program.buffer(slice.buffer).kind {
        BufferKind::FormatCopy { format } => return Some(format),
        BufferKind::Checkpoint => return None,
        BufferKind::Declared => {}
    }
    if depth == 0 {
        return None;
    }
    // The last writer before `before` in its own step, else in a setup step (each
    // searched from its end, in step order): found through the program's index of writers.
    let writers = program.writers();
    let own = program.task(before).step.index();
    let writer = writers
        .last_in(
            program,
            slice,
            program.steps[own].first as usize..before.index(),
        )
        .or_else(|| {
            program
                .steps
                .iter()
                .enumerate()
                .filter(|&(i, s)| i != own && s.kind == StepKind::Setup)
                .find_map(|(_, s)| {
                    writers.last_in(
                        program,
                        slice,
                        s.first as usize..(s.first + s.count) as usize,
                    )
                })
        })?;
    let t = program.task(writer);
    if t.op != Op::Copy {
        return None;
    }
    held_format(program, writer, &t.args.first()?.slice, depth - 1)
}

/// The distinct experts a measured step saw the routing of the task's (layer, micro-batch)
/// reach (`UbLoad::active_experts`), for a task that reads a whole layer's experts (a
/// fused `post_attn`, `experts(set = all)`); `None` where the run did not note it.
pub(super) fn seen_active_experts(program: &Program, id: TaskId, loads: Loads<'_>) -> Option<f64> {
    let op = &program.task(id).op;
    let whole = match op {
        Op::PostAttn { .. } => true,
        Op::Experts { set, .. } => set.len(program.model.experts) == program.model.experts,
        _ => false,
    };
    match (whole, loads, op.layer(), op.ub()) {
        (true, Loads::Measured(per_ub), Some(layer), Some(ub)) => per_ub
            .get(ub as usize)
            .and_then(|l| l.active_experts.get(layer as usize))
            .map(|&n| f64::from(n))
            .filter(|&n| n > 0.0),
        _ => None,
    }
}

/// The catalog charges a whole-layer expert read `min(experts, tokens x top_k)` experts
/// (every routed token on an expert of its own): with the routing seen, the weight traffic
/// holds the `seen` experts the tokens reached instead (the dense part unchanged), split
/// over the `w` arguments in the catalog's proportions.
pub(super) fn read_seen_experts(
    work: &mut Work,
    op: &Op,
    card: &crate::model::card::ModelCard,
    layout: &crate::ir::CheckpointLayout,
    shape: &Shape,
    seen: f64,
) {
    let expert_bytes = layout.expert_bytes as f64;
    let counted = (card.experts as f64).min(shape.tokens as f64 * card.top_k as f64);
    let is_weights = |m: &&mut catalog::MemTraffic| m.class == catalog::DataClass::Weights;
    let total: f64 = work
        .mem
        .iter_mut()
        .filter(is_weights)
        .map(|m| m.bytes)
        .sum();
    if total <= 0.0 || !matches!(op, Op::PostAttn { .. } | Op::Experts { .. }) {
        return;
    }
    let target = (total - counted * expert_bytes).max(0.0) + seen * expert_bytes;
    for m in work.mem.iter_mut().filter(is_weights) {
        m.bytes *= target / total;
    }
}

/// Time of a compute task at the measured rates of moec's own kernels for its op kind
/// ([`KernelRates`]): dense projections (`pre_attn`, `o_proj`, `gate`'s router, `lm_head`)
/// stream their weight bytes at the `linear` curve's rate for their rows (tokens; sequences
/// for `lm_head`); experts at the `expert_ffn` rate for the tokens routed to each active
/// expert (uniform independent routing: the expected distinct active experts, each at
/// the routed tokens over them; a whole-layer task of a measured step that noted its
/// routing: the experts it reached); `post_attn` is both, its expert
/// weights at the FFN rate and the rest at the dense one; attention is its catalog FLOPs
/// at the decode rate, or the prefill rate when it carries more tokens than sequences,
/// and at least one measured smallest call (`attn_call_us`); a decode attention task with
/// measured KV read rates is the roofline of the kernel as measured instead
/// ([`KernelRates::decode_attention_seconds`]: its KV bytes at the read rate of its cache's
/// element type, or its FLOPs at the wide-group rate, whichever is longer).
/// The op's [`catalog::CostClass`] picks the term; the roofline-only classes (embed,
/// combine, sample) have no measured kernel: 0, the roofline stands.
pub fn kernel_seconds(
    program: &Program,
    id: TaskId,
    settings: &CostSettings,
    loads: Loads<'_>,
    kernels: &KernelRates,
) -> f64 {
    let task = program.task(id);
    let class = task.op.def().cost;
    if task.work.copy.is_some() || class == CostClass::Copy {
        return 0.0;
    }
    let (shape, work) = task_work(program, id, settings, loads);
    let card = &program.model;
    // Every part of an `experts(.., ub = all)` group streams its expert's weights here:
    // moec's backends compute each micro-batch's part as a kernel call of its own (the
    // roofline above charges the group's read once, as the papers' fused kernel reads it).
    let weights: f64 = work
        .mem
        .iter()
        .filter(|m| m.class == catalog::DataClass::Weights)
        .map(|m| m.bytes)
        .sum();
    // Quantised weights at their formats' measured curves where the profile has them
    // (`rates::quant_product_seconds`; `experts` picks the task's expert weights).
    let at_of = |curve: &[super::hardware::RowsRate], bytes: f64, rows: f64, experts: bool| {
        if bytes <= 0.0 || rows <= 0.0 {
            return 0.0;
        }
        let op = &task.op;
        super::rates::quant_product_seconds(kernels, curve, card, op, experts, bytes, rows)
            .or_else(|| KernelRates::seconds_per_weight_byte(curve, rows).map(|s| s * bytes))
            .unwrap_or(0.0)
    };
    let at = |curve: &[super::hardware::RowsRate], bytes: f64, rows: f64| {
        at_of(curve, bytes, rows, false)
    };
    let tokens = shape.tokens as f64;
    // Under the routing model of `cost::activation` (each token picks a given expert with
    // probability q = top_k / experts, independently), an expert is active with
    // probability 1 - (1 - q)^tokens: the set's expected active experts, each meeting
    // the routed tokens over them (a task that ran meets that many given it ran). The
    // catalog's `min(experts, tokens x top_k)` counts every routed token on a distinct
    // expert, which 3 prompt tokens (6 routed, 4.6 distinct of 8 expected) are not.
    // A measured step that saw this micro-batch's routing in this layer knows how many
    // distinct experts its tokens reached: a whole-set task reads exactly those (its
    // weight traffic already holds them, `read_seen_experts`).
    let seen_active = seen_active_experts(program, id, loads);
    let routed_per_active = |set: &catalog::ExpertSet| {
        let routed = catalog::routed_tokens(set, card, &shape);
        let whole = set.len(card.experts) == card.experts;
        let active = match seen_active {
            Some(n) if whole => n,
            _ => {
                let q = (card.top_k as f64 / card.experts.max(1) as f64).min(1.0);
                set.len(card.experts) as f64 * (1.0 - (1.0 - q).powf(tokens))
            }
        };
        (active > 0.0).then(|| (active, routed / active))
    };
    // No wildcard: a new class must say here what it costs.
    match class {
        CostClass::Linear => at(&kernels.linear, weights, tokens),
        CostClass::LinearPerSequence => at(&kernels.linear, weights, shape.seqs as f64),
        CostClass::ExpertFfn => {
            let set = task.op.statics().set.unwrap_or(catalog::ExpertSet::All);
            match routed_per_active(&set) {
                Some((_, rows)) => at_of(&kernels.expert_ffn, weights, rows, true),
                None => 0.0,
            }
        }
        CostClass::FusedPostAttn => match routed_per_active(&catalog::ExpertSet::All) {
            Some((active, rows)) => {
                // The catalog's weight bytes hold min(experts, tokens x top_k) experts;
                // the rest is the dense part (o_proj, norms, router).
                let expert_bytes = program.checkpoint().expert_bytes as f64;
                let counted =
                    seen_active.unwrap_or((card.experts as f64).min(tokens * card.top_k as f64));
                let dense = weights - (counted * expert_bytes).min(weights);
                at(&kernels.linear, dense, tokens)
                    + at_of(&kernels.expert_ffn, active * expert_bytes, rows, true)
            }
            None => 0.0,
        },
        CostClass::Attention => {
            let prefill = shape.tokens > shape.seqs;
            let gflops = if prefill {
                kernels.attn_prefill_gflops
            } else {
                kernels.attn_decode_gflops
            };
            // Decode reads every cached K and V once per step: the bytes of the cache's
            // element type at the kernel's measured read rate, or its wide-group FLOP rate
            // where the group's arithmetic takes longer (`decode_attention_seconds`). The
            // FLOP rate alone (one GQA shape's) missed by the group: 4 query heads per kv
            // head do 4x the FLOPs per byte of OLMoE's one.
            let kv_bytes: f64 = work
                .mem
                .iter()
                .filter(|m| m.class == catalog::DataClass::KvCache)
                .map(|m| m.bytes)
                .sum();
            let measured_decode = (!prefill)
                .then(|| {
                    // The CPU backend's MLA attention reads the latent once (values in
                    // the keys): its own measured roof.
                    let latent = card.mla.is_some_and(|m| m.values_in_keys);
                    kernels.decode_attention_seconds(kv_bytes, shape.kv_bytes, work.flops, latent)
                })
                .flatten();
            let at_rate = if let Some(seconds) = measured_decode {
                seconds
            } else if gflops > 0.0 {
                work.flops / (gflops * 1e9)
            } else {
                0.0
            };
            // A call costs at least the probe's smallest one (its fixed work); the rate
            // points (16 sequences x 512 positions, 256 prompt tokens) are far above it.
            // An empty micro-batch makes no call.
            if work.flops > 0.0 {
                at_rate.max(kernels.attn_call_us * 1e-6)
            } else {
                0.0
            }
        }
        // Returned above: a copy is timed by its link (`copy_time`).
        CostClass::Copy => 0.0,
        // No measured kernel: the roofline of the catalog's work is the op's time.
        CostClass::Roofline(_) => 0.0,
    }
}

/// HRM time of one task on a profile at the program's declared work.
pub fn task_time(
    program: &Program,
    id: TaskId,
    profile: &HardwareProfile,
    settings: &CostSettings,
) -> TaskTime {
    task_time_at(program, id, profile, settings, Loads::Declared)
}

/// HRM time of one task charged by its expected activation: a copy's time scaled by the
/// probability it runs; a compute task's FLOPs by its expected work share and its bytes
/// (mostly weights, read only when it runs) by the probability it runs.
pub fn expected_task_time(
    program: &Program,
    id: TaskId,
    profile: &HardwareProfile,
    settings: &CostSettings,
    activation: Activation,
) -> TaskTime {
    let task = program.task(id);
    if activation == Activation::ALWAYS {
        return task_time(program, id, profile, settings);
    }
    if task.work.copy.is_some() || task.op == Op::Copy {
        let time = task_time(program, id, profile, settings);
        return TaskTime {
            seconds: time.seconds * activation.runs,
            roof: time.roof,
        };
    }
    let mut load = compute_load(program, id, settings, Loads::Declared);
    load.flops *= activation.work;
    for (_, bytes) in &mut load.bytes {
        *bytes *= activation.runs;
    }
    compute_time(profile, &load)
}

/// HRM time of one task on a profile with its micro-batch holding `loads`.
pub fn task_time_at(
    program: &Program,
    id: TaskId,
    profile: &HardwareProfile,
    settings: &CostSettings,
    loads: Loads<'_>,
) -> TaskTime {
    let task = program.task(id);
    if let Some(copy) = task.work.copy {
        return copy_time(
            profile,
            level_of(copy.src),
            level_of(copy.dst),
            copy_bytes_at(task, copy, loads),
        );
    }
    if task.op == Op::Copy {
        return TaskTime {
            seconds: 0.0,
            roof: Roof::Idle,
        };
    }
    compute_time(profile, &compute_load(program, id, settings, loads))
}

/// Bytes a copy moves at `loads`: a copy of an activation's live rows (`Task::live`)
/// moves the rows its micro-batch holds at a measured or steady load (none for a
/// micro-batch the load does not have), at most its declared bytes, which are those rows
/// at the declared shape; every other copy its declared bytes.
pub fn copy_bytes_at(task: &crate::ir::Task, copy: CopyWork, loads: Loads<'_>) -> f64 {
    match (task.live, loads) {
        (Some(live), Loads::Measured(per_ub) | Loads::Steady(per_ub)) => {
            per_ub.get(live.ub as usize).map_or(0.0, |load| {
                let tokens = load.prefill_tokens + load.decode_seqs;
                let seqs = load.prefill_seqs + load.decode_seqs;
                live.bytes(tokens as u64, seqs as u64).min(copy.bytes) as f64
            })
        }
        _ => copy.bytes as f64,
    }
}

/// The colour key of a task in timelines: the op name, copies by what they carry.
pub fn task_kind(program: &Program, id: TaskId, classes: &[BufferClass]) -> String {
    let task = program.task(id);
    match task.op {
        Op::Copy => {
            let class = task.args.first().map_or(BufferClass::Activations, |a| {
                classes[a.slice.buffer.index()]
            });
            let direction = match task.work.copy {
                Some(c) => format!("{}->{}", c.src.as_str(), c.dst.as_str()),
                None => String::new(),
            };
            format!("copy {} {direction}", class.name())
        }
        op => op.name().to_string(),
    }
}

/// A simulated step.
#[derive(Debug, Clone, Serialize)]
pub struct StepPrediction {
    /// prefill, decode or step.
    pub kind: String,
    /// Tasks simulated.
    pub tasks: usize,
    /// Makespan, seconds.
    pub seconds: f64,
    /// Busy share of each stream over the makespan, by stream name.
    pub stream_busy: BTreeMap<String, f64>,
    /// Busy share of each resource over the makespan.
    pub resource_busy: BTreeMap<String, f64>,
    /// Eq. 12-13 over this step's own tasks: each resource's serial work.
    pub resource_bound: LayerBound,
    /// Summed task seconds per op kind (the timeline's colour keys), with the roof that
    /// bounds most of that time.
    pub op_seconds: BTreeMap<String, (f64, String)>,
    /// Bytes the copies of each copy kind move over the step, as the times above charge
    /// them (KV parts at the context of the load, activations at its rows, guarded copies
    /// by expected activation at the declared load).
    pub copy_bytes: BTreeMap<String, f64>,
    /// Guarded tasks grouped by the kind of guard they have (see
    /// [`super::activation::arm_key`]), with how often they are expected to run; empty at
    /// a measured load, where the run's routing decided.
    pub arms: Vec<ArmShare>,
    /// The timeline.
    #[serde(skip)]
    pub timeline: Timeline,
}

/// The guarded tasks of one kind of guard in a step (one arm of a load branch, the
/// active-expert guards, ...) and their expected activation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmShare {
    /// `experts on cpu if active && routed < 9`.
    pub arm: String,
    /// Tasks with this guard kind.
    pub tasks: usize,
    /// Mean probability that one of them runs.
    pub expected_share: f64,
    /// Their expected seconds, summed.
    pub seconds: f64,
}

/// Everything `moec simulate` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    /// Profile name.
    pub hardware: String,
    /// Sequences per step (micro-batches x their size).
    pub sequences: u64,
    /// The steps, in declaration order.
    pub steps: Vec<StepPrediction>,
    /// Index in `steps` of the repeated step (decode, or VSLPipe's mixed step).
    pub repeated_step: Option<usize>,
    /// Seconds per decode step (the repeated step), if the schedule has one.
    pub step_seconds: Option<f64>,
    /// Decode tokens/s: sequences / step_seconds.
    pub decode_tokens_per_s: Option<f64>,
    /// Generation throughput as the papers measure it: sequences * gen_len tokens over
    /// prefill time + gen_len decode steps (a `setup` step, which loads resident weights
    /// once like model loading, is not counted).
    pub tokens_per_s: Option<f64>,
    /// MoE-Lightning eq. 12 per layer, from the decode step's tasks.
    pub layer_bound: Option<LayerBound>,
    /// Decode tokens/s the eq. 12 bound allows.
    pub layer_bound_tokens_per_s: Option<f64>,
    /// MoE-Lens stage-1 bound for the same workload and streamed bytes.
    pub stage1: Option<Stage1Bound>,
    /// Context length decode attention assumed.
    pub decode_context: u64,
    /// The pinned buffers exceed the profile's lockable memory, so pinned copies were
    /// costed at the pageable rate.
    pub pinned_fallback: bool,
}

/// Errors from predicting.
#[derive(Debug, thiserror::Error)]
pub enum PredictError {
    /// The dependency table does not match the program.
    #[error("dependency table has {got} rows for {tasks} tasks")]
    DepsMismatch {
        /// Rows given.
        got: usize,
        /// Tasks in the program.
        tasks: usize,
    },
    /// The simulation failed.
    #[error("simulating the {step} step: {source}")]
    Sim {
        /// Which step.
        step: String,
        /// The underlying cause, as the library or the OS reported it.
        source: SimError,
    },
}

/// What the plan's `ReadRouting` after a device gate costs: its `route` bytes over the
/// device-to-host link (the gate's stream waits for them). A gate on a CPU engine reads
/// its routing in place, for free.
pub(super) fn readback_seconds(program: &Program, id: TaskId, profile: &HardwareProfile) -> f64 {
    let task = program.task(id);
    if program.stream(task.stream).engine != Engine::GpuCompute {
        return 0.0;
    }
    let bytes = task
        .args
        .iter()
        .filter(|a| a.role == crate::ir::Role::Route)
        .map(|a| a.slice.len)
        .sum::<u64>();
    copy_time(profile, Level::Gpu, Level::Pinned, bytes as f64).seconds
}

/// The throughput figures of a prediction alone, what the planner ranks candidates by.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Throughput {
    /// Sequences per repeated step, as [`Prediction::sequences`].
    pub sequences: u64,
    /// As [`Prediction::repeated_step`].
    pub repeated_step: Option<usize>,
    /// As [`Prediction::step_seconds`].
    pub step_seconds: Option<f64>,
    /// As [`Prediction::decode_tokens_per_s`].
    pub decode_tokens_per_s: Option<f64>,
    /// As [`Prediction::tokens_per_s`].
    pub tokens_per_s: Option<f64>,
}

/// The throughput figures from each step's simulated seconds (`seconds[i]` for
/// `program.steps[i]`) and the mixed step's steady loads.
pub(super) fn throughput_of(program: &Program, steady: &[UbLoad], seconds: &[f64]) -> Throughput {
    let sequences = u64::from(program.micro_batches.count) * program.micro_batches.size;
    let sequences = if sequences == 0 {
        program.workload.batch
    } else {
        sequences
    };
    let gen_len = program.workload.gen_len as f64;
    let repeated = program
        .steps
        .iter()
        .position(|s| matches!(s.kind, StepKind::Decode | StepKind::Mixed));
    let prefill_seconds: f64 = program
        .steps
        .iter()
        .zip(seconds)
        .filter(|(s, _)| s.kind == StepKind::Prefill)
        .map(|(_, &p)| p)
        .sum();
    // A mixed pass gives a token to each sequence it holds in the scheduler's steady state
    // (fewer than the group's slots when its tokens or KV cache bound it).
    let sequences = match repeated.map(|i| program.steps[i].kind) {
        Some(StepKind::Mixed) => steady
            .iter()
            .map(|l| (l.prefill_seqs + l.decode_seqs) as u64)
            .sum(),
        _ => sequences,
    };
    let step_seconds = repeated.map(|i| seconds[i]);
    let decode_tokens_per_s = step_seconds.map(|s| sequences as f64 / s);
    let tokens_per_s =
        step_seconds.map(|s| sequences as f64 * gen_len / (prefill_seconds + gen_len * s));
    Throughput {
        sequences,
        repeated_step: repeated,
        step_seconds,
        decode_tokens_per_s,
        tokens_per_s,
    }
}

/// The figures of [`predict`] the planner ranks by ([`Throughput`]), equal to its
/// `sequences`, `step_seconds`, `decode_tokens_per_s` and `tokens_per_s`, without what
/// only a report shows (timelines, busy shares, per-op sums, bounds): each step's tasks
/// are costed and simulated exactly as [`predict`] does, the steps in parallel.
/// `pinned_peak` is the program's peak pinned bytes ([`super::budget::BudgetTable::peak`]),
/// which decides the pageable fallback as in [`predict`].
pub fn predict_throughput(
    program: &Program,
    deps: &[Vec<TaskId>],
    profile: &HardwareProfile,
    settings: &CostSettings,
    pinned_peak: u64,
) -> Result<Throughput, PredictError> {
    if deps.len() != program.tasks.len() {
        return Err(PredictError::DepsMismatch {
            got: deps.len(),
            tasks: program.tasks.len(),
        });
    }
    PointCosts::new(program, profile, settings, pinned_peak).throughput(deps)
}

/// Predicts every step and the throughput figures.
pub fn predict(
    program: &Program,
    deps: &[Vec<TaskId>],
    profile: &HardwareProfile,
    settings: &CostSettings,
) -> Result<Prediction, PredictError> {
    if deps.len() != program.tasks.len() {
        return Err(PredictError::DepsMismatch {
            got: deps.len(),
            tasks: program.tasks.len(),
        });
    }
    let tables = ProgramTables::with_classes(buffer_classes(program));
    let classes = tables.classes(program);
    // Pinned buffers beyond what the host can lock (its capacity, not the planning
    // share: a policy the paper ran may use more than the planner would) fall back to
    // pageable memory, and every copy through them to the pageable rate.
    let table = super::budget::budget_table(program, Some(profile), &Default::default());
    let pinned_fallback = table.peak("pinned") as f64 > profile.capacity_bytes(Level::Pinned);
    let fallback;
    let profile = if pinned_fallback {
        fallback = profile.pageable_fallback();
        &fallback
    } else {
        profile
    };
    let mut steps = Vec::with_capacity(program.steps.len());
    let steady = steady_mixed_loads(program);
    for index in 0..program.steps.len() {
        // A mixed step is declared at its worst case (every prompt token in the pass); its
        // throughput is the scheduler's steady state.
        let loads = if program.steps[index].kind == StepKind::Mixed {
            Loads::Steady(&steady)
        } else {
            Loads::Declared
        };
        steps.push(simulate_step(
            program, deps, index, profile, settings, &tables, loads,
        )?);
    }
    let seconds: Vec<f64> = steps.iter().map(|s| s.seconds).collect();
    let Throughput {
        sequences,
        repeated_step: repeated,
        step_seconds,
        decode_tokens_per_s,
        tokens_per_s,
    } = throughput_of(program, &steady, &seconds);
    let layers = program.model.layers.max(1) as f64;
    let layer_bound = repeated.map(|i| {
        let b = steps[i].resource_bound;
        LayerBound {
            comm_seconds: b.comm_seconds / layers,
            comm_out_seconds: b.comm_out_seconds / layers,
            disk_seconds: b.disk_seconds / layers,
            cpu_seconds: b.cpu_seconds / layers,
            gpu_seconds: b.gpu_seconds / layers,
            layer_seconds: b.layer_seconds / layers,
            bottleneck: b.bottleneck,
        }
    });
    let layer_bound_tokens_per_s =
        layer_bound.map(|b| sequences as f64 / (b.layer_seconds * layers).max(1e-30));
    let stage1 = repeated.map(|i| {
        let ids: Vec<TaskId> = program.steps[i].task_ids().collect();
        stage1_for(program, &ids, classes, profile)
    });
    Ok(Prediction {
        hardware: profile.name.clone(),
        sequences,
        steps,
        repeated_step: repeated,
        step_seconds,
        decode_tokens_per_s,
        tokens_per_s,
        layer_bound,
        layer_bound_tokens_per_s,
        stage1,
        decode_context: decode_context_len(program, settings),
        pinned_fallback,
    })
}

/// MoE-Lens eq. 3-4 for this program: M = KV slots that fit in the host budget after the
/// checkpoint and the other host buffers; delta = weights the decode step streams over the
/// link; T_GPU = the GPU's peak over the decode step's GPU FLOPs per token.
pub(super) fn stage1_for(
    program: &Program,
    ids: &[TaskId],
    classes: &[BufferClass],
    profile: &HardwareProfile,
) -> Stage1Bound {
    let card = &program.model;
    let elem_bytes = program
        .tasks
        .first()
        .map_or(ACT_BYTES, |t| t.shape.kv_bytes);
    let kv_bytes_per_token = (card.layers * card.kv_elems_per_token_layer() * elem_bytes) as f64;
    // KV slots = the host budget minus everything in host DRAM that is not KV cache.
    let table = super::budget::budget_table(program, Some(profile), &Default::default());
    let kv_bytes: u64 = table
        .lines
        .iter()
        .filter(|l| l.class == BufferClass::KvCache.name() && l.space != "gpu")
        .map(|l| l.bytes)
        .sum();
    let host_free =
        profile.budget_bytes(Level::Host) - (table.peak("host") as f64 - kv_bytes as f64);
    let sequences = (u64::from(program.micro_batches.count) * program.micro_batches.size).max(1);
    let gpu_flops_per_token: f64 = ids
        .iter()
        .filter(|&&id| program.engine_of(id) == Engine::GpuCompute)
        .map(|&id| program.task(id).work.flops)
        .sum::<f64>()
        / sequences as f64;
    bounds::moe_lens_stage1(&Stage1Inputs {
        prompt_len: program.workload.prompt_len as f64,
        gen_len: program.workload.gen_len.max(1) as f64,
        streamed_weight_bytes: streamed_weight_bytes(program, ids, classes).max(1.0),
        kv_capacity_tokens: (host_free / kv_bytes_per_token).max(0.0),
        link_bandwidth: profile.link_bandwidth(Level::Pinned, Level::Gpu),
        gpu_tokens_per_s: profile.peak_flops(Processor::Gpu, ComputeDtype::Half)
            / gpu_flops_per_token.max(1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::card::ModelCard;

    /// mixtral-tiny (8 experts, top-2, an expert 3 x 128 x 256 x 2 = 196,608 B): a fused
    /// `post_attn` of 3 tokens is charged min(8, 3 x 2) = 6 experts (1,179,648 B) plus its
    /// dense 35,072 B, split 1:3 over two `w` arguments. The run saw 4 experts: 35,072 +
    /// 4 x 196,608 = 821,504 B, split 205,376 / 616,128; activations untouched.
    #[test]
    fn seen_experts_replace_the_catalogs_count_in_the_weight_traffic_by_hand() {
        let card = ModelCard::load("mixtral-tiny").unwrap();
        assert_eq!(
            crate::ir::CheckpointLayout::new(&card).expert_bytes,
            196_608
        );
        let traffic = |class, bytes| catalog::MemTraffic {
            space: Space::Gpu,
            class,
            bytes,
        };
        let mut work = Work {
            flops: 1.0,
            mem: vec![
                traffic(catalog::DataClass::Weights, 303_680.0),
                traffic(catalog::DataClass::Weights, 911_040.0),
                traffic(catalog::DataClass::Activations, 1_000.0),
            ],
            copy: None,
        };
        let shape = Shape {
            tokens: 3,
            seqs: 1,
            context: 3,
            act_bytes: 4,
            kv_bytes: 4,
        };
        let op = Op::PostAttn { layer: 0, ub: 0 };
        let layout = crate::ir::CheckpointLayout::new(&card);
        read_seen_experts(&mut work, &op, &card, &layout, &shape, 4.0);
        let bytes: Vec<f64> = work.mem.iter().map(|m| m.bytes).collect();
        assert!((bytes[0] - 205_376.0).abs() < 1e-6, "{bytes:?}");
        assert!((bytes[1] - 616_128.0).abs() < 1e-6, "{bytes:?}");
        assert_eq!(bytes[2], 1_000.0);
    }
}
