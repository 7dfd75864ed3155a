//! Memory budgets: peak bytes per memory space over the whole run, against a profile.
//!
//! Takes a [`Program`] and a [`HardwareProfile`] (or explicit `--gpu-mem` / `--host-mem`
//! overrides); gives a [`BudgetTable`]: for each space, what occupies it (grouped by
//! declared array, with its class and element count), the peak, the budget, and by how
//! much it is over. Buffers are allocated for the whole run, so the peak is their sum;
//! KV caches are sized by the schedule for the worst case (prompt + full generation), so
//! their line is the cache at the end of generation. The host space holds the pageable
//! buffers, the pinned buffers (page-locked host DRAM) and the memory-mapped checkpoint,
//! which must stay resident for the streamed weights to be read at DRAM speed; pinned
//! buffers are also checked against the profile's page-lock limit.
//! Guarantees: every byte of every declared buffer is counted exactly once per space it
//! occupies, and the table's totals are the sums of its lines.

use super::hardware::{HardwareProfile, Level, GB};
use super::predict::buffer_classes;
use crate::ir::catalog;
use crate::ir::scratch::{stream_bounds, DeviceScratch, TaskFacts};
use crate::ir::StepKind;
use crate::ir::{BufferKind, Engine, Program, Space, TaskId};
use serde::Serialize;
use std::fmt;

/// Explicit budgets that replace the profile's (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct BudgetOverrides {
    /// `--gpu-mem`: bytes of GPU memory the schedule may use.
    pub gpu_bytes: Option<f64>,
    /// `--host-mem`: bytes of host DRAM (pageable + pinned + checkpoint).
    pub host_bytes: Option<f64>,
}

/// One group of buffers in a space.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetLine {
    /// `gpu`, `pinned` (counted in host too) or `host`.
    pub space: &'static str,
    /// Array name (`w_gpu`, `kv`) or `W (checkpoint, memory-mapped)`.
    pub what: String,
    /// weights, kv cache or activations.
    pub class: &'static str,
    /// Buffers in the group (array elements).
    pub buffers: usize,
    /// Bytes of the group.
    pub bytes: u64,
}

/// Use against budget of one space.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpaceUse {
    /// `gpu`, `pinned` or `host`.
    pub space: &'static str,
    /// Peak bytes.
    pub peak: u64,
    /// Budget bytes.
    pub budget: f64,
    /// Where the budget came from (`t4: 16 GB x 0.86 usable` or `--gpu-mem`).
    pub budget_source: String,
}

impl SpaceUse {
    /// Bytes over budget (0 when it fits).
    pub fn over(&self) -> f64 {
        (self.peak as f64 - self.budget).max(0.0)
    }
}

/// What occupies each space, and whether it fits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BudgetTable {
    /// Groups of buffers, by space then size (largest first).
    pub lines: Vec<BudgetLine>,
    /// Per space: gpu, pinned, host.
    pub spaces: Vec<SpaceUse>,
}

impl BudgetTable {
    /// True when every space is within budget.
    pub fn fits(&self) -> bool {
        self.spaces.iter().all(|s| s.over() == 0.0)
    }

    /// Peak bytes of a space.
    pub fn peak(&self, space: &str) -> u64 {
        self.spaces
            .iter()
            .find(|s| s.space == space)
            .map_or(0, |s| s.peak)
    }
}

/// Over budget: the table says what occupies the space and by how much it is over.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[error("schedule `{schedule}` does not fit in memory: {summary}\n{table}")]
pub struct BudgetError {
    /// The schedule.
    pub schedule: String,
    /// `gpu over by 3.2 GB (19.0 GB used of 13.8 GB)`; one clause per space over.
    pub summary: String,
    /// The full table.
    pub table: BudgetTable,
}

fn gb(bytes: f64) -> String {
    if bytes.is_infinite() {
        "unlimited".to_string()
    } else if bytes.abs() < 1e3 {
        format!("{bytes:.0} B")
    } else if bytes.abs() >= 1e9 {
        format!("{:.2} GB", bytes / GB)
    } else if bytes.abs() >= 1e6 {
        format!("{:.2} MB", bytes / 1e6)
    } else {
        format!("{:.1} kB", bytes / 1e3)
    }
}

impl fmt::Display for BudgetTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .lines
            .iter()
            .map(|l| l.what.len())
            .max()
            .unwrap_or(6)
            .max(6);
        writeln!(
            f,
            "  {:<7} {:<width$} {:<12} {:>5} {:>12}",
            "space", "buffer", "class", "count", "bytes"
        )?;
        for line in &self.lines {
            writeln!(
                f,
                "  {:<7} {:<width$} {:<12} {:>5} {:>12}",
                line.space,
                line.what,
                line.class,
                line.buffers,
                gb(line.bytes as f64)
            )?;
        }
        for space in &self.spaces {
            let verdict = if space.over() > 0.0 {
                format!("OVER by {}", gb(space.over()))
            } else {
                format!("ok, {} free", gb(space.budget - space.peak as f64))
            };
            writeln!(
                f,
                "  {:<7} peak {:>10} of {:>10} ({})  {verdict}",
                space.space,
                gb(space.peak as f64),
                gb(space.budget),
                space.budget_source
            )?;
        }
        Ok(())
    }
}

/// Where the checkpoint's own bytes lie in its packed image: each layer's segments at the
/// bytes its own format takes in that layer ([`crate::model::formats::WeightFormats::layers`]),
/// without the room a slot keeps for the widest format any layer stores that tensor in and
/// without the alignment padding between segments. A GGUF's layers differ (Q4_K_M keeps
/// `ffn_down` in Q6_K in some layers, Q4_K in others) while the image gives every layer
/// the widest one's slot; the process holds the file's bytes (mapped, or tiled at the same
/// length), so what is resident is counted in these.
pub struct StoredImage {
    layout: crate::ir::CheckpointLayout,
    /// Per distinct layer image: its segments' offsets in the layer, their stored lengths,
    /// and the stored bytes before each.
    profiles: Vec<LayerProfile>,
    /// The profile of each layer.
    layer_profile: Vec<usize>,
    /// Stored bytes of the image before each layer (and before the head, last).
    before_layer: Vec<u64>,
}

struct LayerProfile {
    /// `(dense, the layer's own formats)`: layers with the same key have the same image.
    key: (bool, Option<crate::model::formats::LayerStorage>),
    starts: Vec<u64>,
    lens: Vec<u64>,
    before: Vec<u64>,
    total: u64,
}

impl StoredImage {
    /// The stored bytes of `card`'s checkpoint image.
    pub fn new(card: &crate::model::card::ModelCard) -> Self {
        use crate::model::formats::WeightTensor;
        let layout = crate::ir::CheckpointLayout::new(card);
        let arch = crate::model::arch::ArchSpec::from_card(card);
        let mut profiles: Vec<LayerProfile> = Vec::new();
        let mut layer_profile = Vec::with_capacity(layout.layers as usize);
        let mut before_layer = Vec::with_capacity(layout.layers as usize + 1);
        let mut at = layout.embed_bytes;
        for l in 0..layout.layers {
            let key = (layout.is_dense(l), card.formats.layers.get(&l).cloned());
            let index = match profiles.iter().position(|p| p.key == key) {
                Some(i) => i,
                None => {
                    let image = crate::model::layout::LayerLayout::with_storage(
                        &arch,
                        l as usize,
                        |k| card.storage(WeightTensor::layer(k)),
                        |k| {
                            card.formats
                                .layer_storage(card.dtype, l, WeightTensor::layer(k))
                        },
                    );
                    let mut before = Vec::with_capacity(image.segments.len());
                    let mut total = 0;
                    for seg in &image.segments {
                        before.push(total);
                        total += seg.len_bytes as u64;
                    }
                    profiles.push(LayerProfile {
                        key,
                        starts: image.segments.iter().map(|s| s.offset as u64).collect(),
                        lens: image.segments.iter().map(|s| s.len_bytes as u64).collect(),
                        before,
                        total,
                    });
                    profiles.len() - 1
                }
            };
            layer_profile.push(index);
            before_layer.push(at);
            at += profiles[index].total;
        }
        before_layer.push(at);
        StoredImage {
            layout,
            profiles,
            layer_profile,
            before_layer,
        }
    }

    /// Stored bytes of the image's bytes `0..offset` (the embedding and the head are
    /// stored as laid out; a layer's as its segments are).
    pub fn before(&self, offset: u64) -> u64 {
        let first = self.layout.embed_bytes;
        let head = self.layout.head_offset();
        if offset <= first {
            return offset;
        }
        if offset >= head {
            return self.before_layer[self.layout.layers as usize]
                + (offset - head).min(self.layout.head_bytes);
        }
        let Some(l) = self.layout.layer_at(offset) else {
            return self.before_layer[self.layout.layers as usize];
        };
        let rel = offset - self.layout.layer_offset(l);
        let p = &self.profiles[self.layer_profile[l as usize]];
        let within = match p.starts.partition_point(|&s| s <= rel) {
            0 => 0,
            i => p.before[i - 1] + (rel - p.starts[i - 1]).min(p.lens[i - 1]),
        };
        self.before_layer[l as usize] + within
    }

    /// Stored bytes of the image's bytes `start..end`.
    pub fn bytes_in(&self, start: u64, end: u64) -> u64 {
        self.before(end).saturating_sub(self.before(start))
    }

    /// Stored bytes of the whole checkpoint: the sum of its tensors' bytes.
    pub fn total(&self) -> u64 {
        self.before(self.layout.total_bytes())
    }
}

/// Bytes of the checkpoint that must stay resident: the union of the byte ranges tasks
/// read after the `setup` step, and what the loader holds in memory
/// ([`crate::model::card::HeldBytes`]: those bytes are not the file's pages, so no read
/// path lets them go). A memory-mapped file is paged in on demand and pages only
/// read while setting up (weights copied to a pinned or GPU home) can be evicted by the OS
/// afterwards, so they do not count against the host. A checkpoint on disk is read by
/// `disk.read` copies into buffers the table already counts (the reads go around the page
/// cache), so only what other tasks read of it in place, through its memory map, counts.
/// Ranges are counted in the bytes the checkpoint stores there ([`StoredImage`]): a slot's
/// room for a wider format than its layer's and the padding between segments are no
/// file pages.
pub fn checkpoint_resident_bytes(program: &Program) -> u64 {
    resident_bytes(program, &StoredImage::new(&program.model))
}

fn resident_bytes(program: &Program, stored: &StoredImage) -> u64 {
    let mut ranges: Vec<(u64, u64)> = program
        .steps
        .iter()
        .filter(|s| s.kind != StepKind::Setup)
        .flat_map(|step| step.task_ids())
        .filter(|&id| program.engine_of(id) != Engine::DiskRead)
        .flat_map(|id| program.task(id).args.iter())
        .filter(|a| a.slice.buffer.index() == 0 && a.access.reads())
        .map(|a| (a.slice.start, a.slice.end()))
        .collect();
    // Merged in image offsets first (one `before` per merged range), then mapped to the
    // stored offsets, which keep their order (`before` never decreases).
    ranges = merged(ranges)
        .into_iter()
        .map(|(start, end)| (stored.before(start), stored.before(end)))
        .collect();
    // What the loader holds in memory stays resident whoever reads it (setup's copies
    // included): restored q/k rows at the start of each layer's `pre` segment.
    let held = program.model.held;
    if held.attention > 0 || held.experts > 0 {
        let layout = &stored.layout;
        for l in 0..program.model.layers {
            let start = layout.layer_offset(l);
            let pre = stored.before(start);
            let pre_bytes = stored.bytes_in(start, start + layout.pre_bytes);
            ranges.push((pre, pre + held.attention.min(pre_bytes)));
            if !layout.is_dense(l) {
                let experts = start + layout.pre_bytes + layout.o_bytes + layout.gate_bytes;
                let all = stored.bytes_in(experts, experts + layout.experts * layout.expert_bytes);
                let at = stored.before(experts);
                ranges.push((at, at + held.experts.min(all)));
            }
        }
    }
    merged(ranges).iter().map(|(s, e)| e - s).sum::<u64>() + held.other
}

/// `ranges` sorted and merged where they overlap or touch.
fn merged(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|(s, e)| e > s);
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// Scratch the tasks need beyond their arguments. The CPU's largest over its compute
/// tasks (gate/up intermediates of experts, attention score tiles): its attention keeps
/// one tile's scores per worker thread (`cpu_threads` of them), whatever the prompt's
/// length: counting the catalog's score block per query row and head there put 1.07 GB on
/// an 8,192-token Qwen3-30B-A3B prefill whose kernel holds 8 MiB. On the GPU, by the scratch
/// rules of the backend the program was compiled for ([`Program::scratch`], e.g. the CUDA
/// backend's, which gives each device stream a workspace of its own reserved at the
/// largest bound of the rules over the stream's tasks): one line per device stream, so the
/// streams' lines add up. Without rules, the op catalog's workspace of the largest
/// `gpu.compute` task, in a line that says so.
fn workspace_lines(program: &Program, cpu_threads: u64) -> Vec<BudgetLine> {
    let mut host: (u64, Option<TaskId>) = (0, None);
    let mut catalog_gpu: (u64, Option<TaskId>) = (0, None);
    for (index, task) in program.tasks.iter().enumerate() {
        let slot = match program.stream(task.stream).engine {
            Engine::CpuCompute => &mut host,
            Engine::GpuCompute if program.scratch.is_none() => &mut catalog_gpu,
            _ => continue,
        };
        let bytes = match task.op {
            crate::ir::Op::Attn { .. }
                if program.stream(task.stream).engine == Engine::CpuCompute =>
            {
                cpu_threads
                    * crate::model::vocab::attention_score_scratch_bytes(
                        program.model.heads,
                        task.shape.context,
                        task.shape.tokens.div_ceil(task.shape.seqs.max(1)),
                    )
            }
            _ => catalog::workspace_bytes(&task.op, &program.model, &task.shape),
        };
        if bytes > slot.0 {
            *slot = (bytes, Some(TaskId::new(index)));
        }
    }
    let mut lines = match (program.scratch, catalog_gpu) {
        (Some(rules), _) => gpu_scratch_lines(program, rules),
        (None, (bytes, Some(task))) => vec![BudgetLine {
            space: "gpu",
            what: format!(
                "op workspace (catalog: no backend scratch rules; max: {})",
                program.task_name(task)
            ),
            class: "activations",
            buffers: 1,
            bytes,
        }],
        (None, (_, None)) => Vec::new(),
    };
    if let (bytes, Some(task)) = host {
        lines.push(BudgetLine {
            space: "host",
            what: format!("op workspace (max: {})", program.task_name(task)),
            class: "activations",
            buffers: 1,
            bytes,
        });
    }
    lines
}

/// Whether an engine's tasks run on the GPU (a device backend's streams, each with its own
/// workspace).
fn on_device(engine: Engine) -> bool {
    matches!(
        engine,
        Engine::GpuCompute | Engine::GpuCopyIn | Engine::GpuCopyOut
    )
}

/// One `scratch on <stream>` line (space `gpu`) per device stream whose tasks take scratch: the
/// largest bound of `rules` over its tasks, naming the task that sets it.
fn gpu_scratch_lines(program: &Program, rules: &dyn DeviceScratch) -> Vec<BudgetLine> {
    let device: Vec<bool> = program
        .streams
        .iter()
        .map(|s| on_device(s.engine))
        .collect();
    if !device.contains(&true) {
        return Vec::new();
    }
    let mut rules = rules.rules(&program.model, &program.workload);
    let tasks = program
        .tasks
        .iter()
        .enumerate()
        .filter(|(_, t)| device.get(t.stream.index()).copied().unwrap_or(false))
        .map(|(index, t)| {
            let facts = TaskFacts::new(t.op, t.shape, t.kv, t.args.iter().map(|a| a.role));
            (t.stream.index(), TaskId::new(index), facts)
        });
    stream_bounds(rules.as_mut(), program.streams.len(), tasks)
        .into_iter()
        .enumerate()
        .filter_map(|(stream, bound)| {
            let (bytes, task) = bound.filter(|(bytes, _)| *bytes > 0)?;
            Some(BudgetLine {
                space: "gpu",
                what: format!(
                    "scratch on {} (max: {})",
                    program.streams[stream].name,
                    program.task_name(task)
                ),
                class: "activations",
                buffers: 1,
                bytes,
            })
        })
        .collect()
}

/// Builds the table of what occupies each space. Without a profile, spaces without an
/// override have no limit.
pub fn budget_table(
    program: &Program,
    profile: Option<&HardwareProfile>,
    overrides: &BudgetOverrides,
) -> BudgetTable {
    let classes = buffer_classes(program);
    let stored = StoredImage::new(&program.model);
    let checkpoint_resident = resident_bytes(program, &stored);
    // The checkpoint's lines name its size as the file stores it, not the image's slots.
    let checkpoint_bytes = stored.total();
    let mut lines: Vec<BudgetLine> = Vec::new();
    for (index, buffer) in program.buffers.iter().enumerate() {
        let (space, what, bytes) = match buffer.kind {
            BufferKind::Checkpoint if buffer.space == Space::Disk => (
                "host",
                format!(
                    "{} (checkpoint on disk, part read in place of {})",
                    buffer.name,
                    gb(checkpoint_bytes as f64)
                ),
                checkpoint_resident,
            ),
            BufferKind::Checkpoint => (
                "host",
                format!(
                    "{} (checkpoint mmap, resident part of {})",
                    buffer.name,
                    gb(checkpoint_bytes as f64)
                ),
                checkpoint_resident,
            ),
            BufferKind::Declared => (buffer.space.as_str(), buffer.array.clone(), buffer.bytes),
            // Made at load into host memory the process keeps for the whole run.
            BufferKind::FormatCopy { .. } => (
                "host",
                format!("{} (experts converted at load)", buffer.name),
                buffer.bytes,
            ),
        };
        let class = classes[index].name();
        match lines
            .iter_mut()
            .find(|l| l.space == space && l.what == what)
        {
            Some(line) => {
                line.buffers += 1;
                line.bytes += bytes;
            }
            None => lines.push(BudgetLine {
                space,
                what,
                class,
                buffers: 1,
                bytes,
            }),
        }
    }
    // The probed (or named) machine's cores: the CPU pool's threads when `--threads` is
    // not given, and at least one scratch without a profile.
    let cpu_threads = profile.map_or(1, |p| u64::from(p.cpu.cores.max(1)));
    lines.extend(workspace_lines(program, cpu_threads));
    let order = |s: &str| match s {
        "gpu" => 0,
        "pinned" => 1,
        _ => 2,
    };
    lines.sort_by(|a, b| {
        order(a.space)
            .cmp(&order(b.space))
            .then(b.bytes.cmp(&a.bytes))
    });
    let sum = |space: &str| -> u64 {
        lines
            .iter()
            .filter(|l| l.space == space)
            .map(|l| l.bytes)
            .sum()
    };
    let gpu_peak = sum(Space::Gpu.as_str());
    let pinned_peak = sum(Space::Pinned.as_str());
    let host_peak = sum(Space::Host.as_str()) + pinned_peak;
    let [(gpu_budget, gpu_source), (pinned_budget, pinned_source), (host_budget, host_source)] =
        space_budgets(profile, overrides);
    let spaces = vec![
        SpaceUse {
            space: "gpu",
            peak: gpu_peak,
            budget: gpu_budget,
            budget_source: gpu_source,
        },
        SpaceUse {
            space: "pinned",
            peak: pinned_peak,
            budget: pinned_budget,
            budget_source: pinned_source,
        },
        SpaceUse {
            space: "host",
            peak: host_peak,
            budget: host_budget,
            budget_source: format!("{host_source}; includes pinned"),
        },
    ];
    BudgetTable { lines, spaces }
}

/// The budget of the gpu, pinned and host spaces (bytes, and where it came from): the
/// overrides', else the profile's usable share; without either, unlimited.
fn space_budgets(
    profile: Option<&HardwareProfile>,
    overrides: &BudgetOverrides,
) -> [(f64, String); 3] {
    let from_profile = |level: Level| -> (f64, String) {
        match profile {
            Some(profile) => {
                let fraction = match level {
                    Level::Gpu => profile.gpu.usable_fraction,
                    _ => profile.cpu.usable_fraction,
                };
                (
                    profile.budget_bytes(level),
                    format!(
                        "{}: {} x {} usable",
                        profile.name,
                        gb(profile.capacity_bytes(level)),
                        fraction
                    ),
                )
            }
            None => (f64::INFINITY, "no limit without --hw".to_string()),
        }
    };
    let (gpu_budget, gpu_source) = match overrides.gpu_bytes {
        Some(bytes) => (bytes, "--gpu-mem".to_string()),
        None => from_profile(Level::Gpu),
    };
    let (host_budget, host_source) = match overrides.host_bytes {
        Some(bytes) => (bytes, "--host-mem".to_string()),
        None => from_profile(Level::Host),
    };
    let (pinned_budget, pinned_source) = match (overrides.host_bytes, profile) {
        (Some(bytes), Some(profile)) => (
            bytes.min(profile.capacity_bytes(Level::Pinned)),
            "--host-mem, within the profile's page-lock limit".to_string(),
        ),
        (Some(bytes), None) => (bytes, "--host-mem".to_string()),
        (None, _) => from_profile(Level::Pinned),
    };
    [
        (gpu_budget, gpu_source),
        (pinned_budget, pinned_source),
        (host_budget, host_source),
    ]
}

/// Whether `buffers` (a program's declared buffers, [`crate::elaborate::declared_buffers`])
/// alone exceed a budget, so the program is over budget whatever its tasks: a space's peak
/// in [`budget_table`] is the sum of its declared buffers plus what is never negative (the
/// scratch and op workspace lines, the checkpoint's resident part), so a sum over its budget is a peak
/// over it. Also true when their host and pinned bytes, plus the gpu bytes where
/// `gpu_in_host`, exceed `machine_bytes`, which a program's peaks then exceed too.
pub fn declared_over_budget(
    buffers: &[crate::ir::Buffer],
    profile: Option<&HardwareProfile>,
    overrides: &BudgetOverrides,
    machine_bytes: Option<u64>,
    gpu_in_host: bool,
) -> bool {
    let sum = |space: Space| -> u64 {
        buffers
            .iter()
            .filter(|b| b.kind == BufferKind::Declared && b.space == space)
            .map(|b| b.bytes)
            .sum()
    };
    let gpu = sum(Space::Gpu);
    let pinned = sum(Space::Pinned);
    let host = sum(Space::Host) + pinned;
    let [(gpu_budget, _), (pinned_budget, _), (host_budget, _)] = space_budgets(profile, overrides);
    let over = |peak: u64, budget: f64| peak as f64 - budget > 0.0;
    let here = host + if gpu_in_host { gpu } else { 0 };
    over(gpu, gpu_budget)
        || over(pinned, pinned_budget)
        || over(host, host_budget)
        || machine_bytes.is_some_and(|m| here > m)
}

/// The table if the program fits, else a [`BudgetError`] carrying it. This is the hook
/// `moec check` calls.
pub fn check_budget(
    program: &Program,
    profile: Option<&HardwareProfile>,
    overrides: &BudgetOverrides,
) -> Result<BudgetTable, BudgetError> {
    let table = budget_table(program, profile, overrides);
    if table.fits() {
        return Ok(table);
    }
    let summary = table
        .spaces
        .iter()
        .filter(|s| s.over() > 0.0)
        .map(|s| {
            format!(
                "{} over by {} ({} used of {})",
                s.space,
                gb(s.over()),
                gb(s.peak as f64),
                gb(s.budget)
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    Err(BudgetError {
        schedule: program.name.clone(),
        summary,
        table,
    })
}

/// Parses `16GB`, `1.5 GiB`, `512MB`, `2e9` (bytes) into bytes.
pub fn parse_bytes(text: &str) -> Result<f64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| c.is_ascii_alphabetic() && c != 'e' && c != 'E')
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a size (try 16GB, 1.5GiB, 512MB)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0f64.powi(4),
        other => return Err(format!("unknown size unit `{other}` in `{text}`")),
    };
    if !(value.is_finite() && value > 0.0) {
        return Err(format!("`{text}` must be a positive size"));
    }
    Ok(value * scale)
}

/// Where a program with a disk tier keeps the model's weights: what host memory holds
/// (weight buffers, pageable or pinned, and any part of the checkpoint read in place) and
/// what only the disk holds, with the host peak against its budget. `moec plan` prints it
/// for the policy it picked, so the split it chose under `--host-mem` is never implicit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskSplit {
    /// Bytes of the checkpoint (every tensor of the model).
    pub checkpoint_bytes: u64,
    /// Weight lines of the host and pinned spaces: `(buffer, count, bytes)`, largest first.
    pub in_host: Vec<(String, usize, u64)>,
    /// Their sum: the model's bytes host memory holds at the peak.
    pub in_host_bytes: u64,
    /// `checkpoint_bytes - in_host_bytes` (0 when host holds it all): bytes that are only
    /// ever on disk at any one time, read with `disk.read` copies when a step needs them.
    pub disk_only_bytes: u64,
    /// Peak host bytes (pinned included), everything counted.
    pub host_peak: u64,
    /// The host budget (bytes; infinite when none applies).
    pub host_budget: f64,
}

/// The split of `program`'s weights between host memory and disk under `table` (its
/// budget table), or `None` when the program has no `disk.read` stream (its checkpoint is
/// memory-mapped, not on disk).
pub fn disk_split(program: &Program, table: &BudgetTable) -> Option<DiskSplit> {
    if !program.streams.iter().any(|s| s.engine == Engine::DiskRead) {
        return None;
    }
    // As the file stores it (the image's slots may be wider: [`StoredImage`]).
    let checkpoint_bytes = StoredImage::new(&program.model).total();
    let in_host: Vec<(String, usize, u64)> = table
        .lines
        .iter()
        .filter(|l| (l.space == "host" || l.space == "pinned") && l.class == "weights")
        .filter(|l| l.bytes > 0)
        .map(|l| {
            // The checkpoint's line names its whole size; here only its part read in place.
            let what = if l.what.contains("(checkpoint") {
                "checkpoint read in place".to_string()
            } else {
                l.what.clone()
            };
            (what, l.buffers, l.bytes)
        })
        .collect();
    let in_host_bytes = in_host.iter().map(|(_, _, bytes)| bytes).sum();
    let host = table.spaces.iter().find(|s| s.space == "host");
    Some(DiskSplit {
        checkpoint_bytes,
        disk_only_bytes: checkpoint_bytes.saturating_sub(in_host_bytes),
        in_host,
        in_host_bytes,
        host_peak: host.map_or(0, |s| s.peak),
        host_budget: host.map_or(f64::INFINITY, |s| s.budget),
    })
}

impl fmt::Display for DiskSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .in_host
            .iter()
            .map(|(what, count, bytes)| format!("{what} [{count}] {}", gb(*bytes as f64)))
            .collect();
        write!(
            f,
            "host memory holds {} of the {} checkpoint ({}); {} stays on disk, read by disk.read copies; host peak {} of {}",
            gb(self.in_host_bytes as f64),
            gb(self.checkpoint_bytes as f64),
            if parts.is_empty() { "nothing".to_string() } else { parts.join(", ") },
            gb(self.disk_only_bytes as f64),
            gb(self.host_peak as f64),
            gb(self.host_budget)
        )
    }
}

/// Why a schedule whose checkpoint is memory-mapped cannot fit `overrides`' host budget
/// whatever its params: the part of the checkpoint its tasks read in place stays resident
/// (`checkpoint_resident_bytes`) and alone exceeds the budget. `None` when the program has
/// a disk tier, no host budget applies, or the mapped part fits.
pub fn mapped_checkpoint_over_host(program: &Program, table: &BudgetTable) -> Option<String> {
    if program.streams.iter().any(|s| s.engine == Engine::DiskRead) {
        return None;
    }
    let host = table.spaces.iter().find(|s| s.space == "host")?;
    let mapped = table
        .lines
        .iter()
        .filter(|l| l.space == "host" && l.what.contains("(checkpoint mmap"))
        .map(|l| l.bytes)
        .sum::<u64>();
    (mapped as f64 > host.budget).then(|| {
        format!(
            "`{}` memory-maps the checkpoint and reads {} of it in place, which must stay resident: more than the host budget of {} ({}) by itself; a schedule with a disk tier (a `disk.read` stream, e.g. schedules/moe_infinity_disk.sched or schedules/flexgen_disk.sched) keeps the checkpoint on disk",
            program.name,
            gb(mapped as f64),
            gb(host.budget),
            host.budget_source
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("16GB").unwrap(), 16e9);
        assert_eq!(
            parse_bytes("1.5 GiB").unwrap(),
            1.5 * 1024.0 * 1024.0 * 1024.0
        );
        assert_eq!(parse_bytes("2e9").unwrap(), 2e9);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-3GB").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }
}
