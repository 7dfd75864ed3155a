//! What a run measured: every executed step with its micro-batch loads and task times.
//!
//! Takes nothing (the runtime's driver fills it); gives [`RunStats`], [`StepRecord`],
//! [`UbLoad`] and [`TaskRecord`], plain data that the run report, the trace writer and
//! the cost model's replay read. It sits apart from both `runtime` and `cost` so that
//! neither imports the other.

use crate::ir::{StepKind, StreamId, TaskId};

/// One executed task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TaskRecord {
    /// The task.
    pub task: TaskId,
    /// The stream.
    pub stream: StreamId,
    /// Start, seconds since the executor's origin.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
    /// False when its guard skipped it.
    pub ran: bool,
    /// A cache fetch that found its expert already in the cache: it ran (its readers go
    /// on to the slot) but copied nothing, so the replay charges it nothing.
    pub hit: bool,
}

/// What running one task did, as the executor records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskRun {
    /// Its guard was false (or a prefetch found nothing to do): it did nothing.
    Skipped,
    /// It ran.
    Ran,
    /// A cache fetch whose expert was resident: it holds the slot and copied nothing.
    Hit,
}

/// One executed step.
#[derive(Debug, Clone)]
pub struct StepRecord {
    /// The step's kind.
    pub kind: StepKind,
    /// Wall time start/end (seconds from the run's origin).
    pub start: f64,
    /// End, in the same unit and from the same origin as `start`.
    pub end: f64,
    /// Prompt tokens it processed.
    pub prefill_tokens: usize,
    /// Decode tokens it processed.
    pub decode_tokens: usize,
    /// What each micro-batch held (indexed by ub; empty for `setup`).
    pub ubs: Vec<UbLoad>,
    /// Its tasks.
    pub tasks: Vec<TaskRecord>,
    /// Where the step's time went, for a step the backend launched from its cached graph
    /// without running its tasks (`None` otherwise, and on a backend with no device).
    pub split: Option<StepSplit>,
}

/// Where a step launched from its cached device graph spent its time (seconds): the
/// graph on the device, timed by events recorded on its stream around the launch (read
/// when the step's tokens are read back, so timing adds no synchronisation), and the
/// backend's host calls for it, timed by the host clock.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepSplit {
    /// The graph's time on the device: from an event recorded just before its launch to
    /// one recorded right after it.
    pub device: f64,
    /// The device's idle time between the previous launched graph's end event and this
    /// graph's start event, for a step queued before the previous one finished (launched
    /// ahead): what the host functions and copies queued between the two graphs cost the
    /// stream. `None` when the step was not queued behind another.
    pub gap: Option<f64>,
    /// Host: the launch call (the staged inputs computed and written or queued, the
    /// graph launched, its events and host functions queued).
    pub launch: f64,
    /// Of `launch`, computing the step's shape and its staged inputs (positions, block
    /// tables, ids).
    pub staging: f64,
    /// Host functions queued on the stream for the step (a staged-input write behind a
    /// launch in flight, a copy of the read-backs out of staging), time inside them: the
    /// stream waits while they run.
    pub host_functions: f64,
    /// Host: waiting for the step's read-backs (its done event), then handing them over.
    pub wait: f64,
}

/// The real contents of one micro-batch in one executed step: what the cost model needs
/// to predict the same step (the compiled program assumes its declared worst case).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UbLoad {
    /// Sequences running their prompt (or a re-prefill after preemption).
    pub prefill_seqs: usize,
    /// Their new tokens.
    pub prefill_tokens: usize,
    /// Sequences decoding one token.
    pub decode_seqs: usize,
    /// Sum over decoding sequences of the tokens they attend to (cached + the new one).
    pub decode_context: usize,
    /// Distinct experts this micro-batch's tokens were routed to, per layer, where the run
    /// saw the routing (a `gate` read back to the host, or a fused `post_attn`); empty, or
    /// 0 for a layer, where it did not (the cost model then uses its routing model).
    pub active_experts: Vec<u32>,
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct RunStats {
    /// Every step in order.
    pub steps: Vec<StepRecord>,
    /// Whole run, seconds.
    pub wall: f64,
    /// Whether the pinned arena was page-locked.
    pub pinned_locked: bool,
    /// Bytes of the gpu, pinned and host arenas, and of the weights image.
    pub arena_bytes: [u64; 3],
    /// Bytes of the weights image.
    pub image_bytes: u64,
    /// Bytes of the weights image whose page tables were populated before the first step.
    pub image_populated: u64,
    /// Bytes of the weights image held as Q4_K/Q6_K/Q8_0/Q4_0/MXFP4 tiles repacked at load (allocated).
    pub image_tiled: u64,
    /// Sequences preempted because KV blocks ran out (mixed steps; each is prefilled again).
    pub preemptions: usize,
    /// Sequence-passes skipped waiting for KV blocks (mixed steps).
    pub paused: usize,
    /// Expert caches' hits, misses, prefetches and evictions.
    pub caches: Vec<CacheReport>,
    /// Each predictor's accuracy over the run (lookahead gating, `hot(..)` copies, each
    /// cache's prefetches), whether or not the schedule has a cache.
    pub predictions: Vec<PredictionReport>,
    /// Bytes the run's copies bound and moved, when the backend binds weight copies
    /// (the CPU backend's default); `None` when every copy moved its bytes.
    pub copies: Option<CopyTotals>,
    /// What the run read from disk (`disk.read` copies); `None` when it read none.
    pub disk: Option<DiskTotals>,
    /// Expert computations that used a declared lossy substitute (a format copy of their
    /// expert), and all expert computations; `None` when the plan has no format copy.
    pub substituted_experts: Option<(u64, u64)>,
    /// The backend's own line for the run report: what ran the plan (the CPU backend's
    /// pools, or a device, its kernels and what the run did there).
    pub backend: String,
    /// How each step's device work was submitted, in step order, where the backend
    /// submits to a device (CUDA graphs); empty on the CPU backend.
    pub graph_steps: Vec<GraphStep>,
    /// Setting the backend up for the plan before its first step (arenas, the weights
    /// image, tiles), timed by `runtime::generate` with the parts the backend timed
    /// itself; `None` where the driver ran on a backend opened elsewhere.
    pub backend_open: Option<super::load::LoadPhase>,
}

/// How one step's device work reached the device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum GraphUse {
    /// A graph captured from an earlier step with the same launches was launched.
    Replayed,
    /// The step's launches were captured into a graph, which was then launched.
    Captured,
    /// The launches were submitted one by one, for this reason.
    Plain(String),
}

/// One step's [`GraphUse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphStep {
    /// The step's kind.
    pub kind: StepKind,
    /// How its device work was submitted.
    pub graph: GraphUse,
}

/// Totals of a run's disk reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskTotals {
    /// Bytes of the checkpoint read from its files.
    pub bytes: u64,
    /// Nanoseconds the copies spent reading (wall time of each copy, summed).
    pub read_ns: u64,
    /// Bytes a `disk.read` copy took from memory instead: tensors the checkpoint holds
    /// decoded or repacked in memory, and the padding between tensors.
    pub from_memory: u64,
    /// Whether every file was opened with `O_DIRECT` (false: the filesystem refused it and
    /// reads went through the page cache).
    pub direct: bool,
}

impl DiskTotals {
    /// Bytes per second the reads achieved while reading (0 before any read).
    pub fn bandwidth(&self) -> f64 {
        if self.read_ns == 0 {
            0.0
        } else {
            self.bytes as f64 / (self.read_ns as f64 * 1e-9)
        }
    }
}

/// Bytes the copies of a run covered, by how they were carried out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyTotals {
    /// Weight bytes whose labels moved without the bytes (kernels read them from the
    /// mapped checkpoint).
    pub bound: u64,
    /// Bytes copied (activations, KV and padding; every byte when nothing is bound).
    pub moved: u64,
}

/// One layer's cache events in a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LayerCacheStats {
    /// Fetches that found their expert resident.
    pub hits: u64,
    /// Fetches that copied it.
    pub misses: u64,
    /// Prefetch copies made.
    pub prefetched: u64,
    /// Prefetched experts a fetch then hit.
    pub prefetch_used: u64,
    /// Prefetched experts evicted (or left at the end) without being fetched.
    pub prefetch_wasted: u64,
    /// Prefetches skipped: resident already, no free slot, a fetch waiting, or the
    /// expert got no tokens once the layer's routing was known.
    pub prefetch_skipped: u64,
    /// Residents replaced by a fetch or a prefetch.
    pub evictions: u64,
}

impl LayerCacheStats {
    /// Adds another layer's (or run's) counts.
    pub fn add(&mut self, o: &LayerCacheStats) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.prefetched += o.prefetched;
        self.prefetch_used += o.prefetch_used;
        self.prefetch_wasted += o.prefetch_wasted;
        self.prefetch_skipped += o.prefetch_skipped;
        self.evictions += o.evictions;
    }

    /// Hits over fetches (0 without fetches).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// How well one predictor foresaw the experts the gates then chose, over a run: per
/// (layer, micro-batch) it predicted and whose routing the host read back, the distinct
/// experts it named against the distinct experts with tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PredictionReport {
    /// The predictor: `lookahead` (the `pregate` tasks' routing), `hot` (experts copied
    /// by a `hot(..)` slice before their layer's routing was read back), or
    /// `cache NAME (PREDICTOR)` (a cache's prefetches).
    pub predictor: String,
    /// Predicted experts that got tokens (a cache: prefetched experts a fetch then hit).
    pub hits: u64,
    /// Experts with tokens it did not predict (a cache: fetches that had to copy).
    pub misses: u64,
    /// Predicted experts that got no tokens (a cache: prefetches evicted or left unused).
    pub wasted: u64,
}

impl PredictionReport {
    /// Adds one prediction: the distinct experts named against those with tokens.
    pub fn tally(&mut self, predicted: &[u32], routed: &[u32]) {
        let hits = predicted.iter().filter(|e| routed.contains(e)).count() as u64;
        self.hits += hits;
        self.wasted += predicted.len() as u64 - hits;
        self.misses += routed.len() as u64 - hits;
    }

    /// Hits over the experts with tokens (0 when none were measured).
    pub fn recall(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

/// A cache's counts over a run, for the report.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CacheReport {
    /// The cache's name.
    pub name: String,
    /// Slots.
    pub slots: u32,
    /// Eviction policy.
    pub policy: &'static str,
    /// Predictor.
    pub predictor: &'static str,
    /// Per layer.
    pub layers: Vec<LayerCacheStats>,
    /// Summed over layers.
    pub total: LayerCacheStats,
}

/// How the steps of one kind reached the device over a run: replaying a captured CUDA
/// graph, capturing one, or launch by launch (with why).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GraphSummary {
    /// The step kind (`decode`, `prefill`, ...).
    pub step: &'static str,
    /// Steps that launched a graph captured from an earlier step.
    pub replayed: usize,
    /// Steps captured into a graph (then launched).
    pub captured: usize,
    /// Steps launched kernel by kernel.
    pub plain: usize,
    /// Why steps were launched plainly, with how many steps each.
    pub plain_reasons: Vec<PlainReason>,
}

/// The summaries as one clause per step kind, e.g. `decode: 5 replayed a graph, 1
/// captured one, 1 launched plainly (1: why)`; empty when there are none.
pub fn render_graphs(summaries: &[GraphSummary]) -> String {
    summaries
        .iter()
        .map(|g| {
            let mut text = format!(
                "{}: {} replayed a graph, {} captured one, {} launched plainly",
                g.step, g.replayed, g.captured, g.plain
            );
            if !g.plain_reasons.is_empty() {
                let list: Vec<String> = g
                    .plain_reasons
                    .iter()
                    .map(|r| format!("{}: {}", r.steps, r.reason))
                    .collect();
                text.push_str(&format!(" ({})", list.join("; ")));
            }
            text
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One reason steps were launched without a graph.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlainReason {
    /// Why.
    pub reason: String,
    /// Steps it applied to.
    pub steps: usize,
}

/// The per-kind [`GraphSummary`] of a run's steps, in order of first appearance.
pub fn graph_summary(steps: &[GraphStep]) -> Vec<GraphSummary> {
    let mut out = Vec::new();
    for g in steps {
        add_graph_step(&mut out, g);
    }
    out
}

/// Counts one more step into per-kind summaries (a long-lived session keeps these
/// instead of every step).
pub fn add_graph_step(summaries: &mut Vec<GraphSummary>, g: &GraphStep) {
    let step = g.kind.as_str();
    let at = match summaries.iter().position(|s| s.step == step) {
        Some(at) => at,
        None => {
            summaries.push(GraphSummary {
                step,
                replayed: 0,
                captured: 0,
                plain: 0,
                plain_reasons: Vec::new(),
            });
            summaries.len() - 1
        }
    };
    let row = &mut summaries[at];
    match &g.graph {
        GraphUse::Replayed => row.replayed += 1,
        GraphUse::Captured => row.captured += 1,
        GraphUse::Plain(why) => {
            row.plain += 1;
            match row.plain_reasons.iter_mut().find(|r| &r.reason == why) {
                Some(r) => r.steps += 1,
                None => row.plain_reasons.push(PlainReason {
                    reason: why.clone(),
                    steps: 1,
                }),
            }
        }
    }
}
