//! The backend interface: what the driver asks of a device (ggml's backend split).
//!
//! Takes nothing; gives the [`Backend`] trait that every executing backend implements,
//! its [`Capabilities`] (reported as data, as ggml's `caps`), the options every backend
//! understands ([`BackendOptions`]) and the errors a backend returns ([`BackendError`]).
//!
//! The driver owns the plan: it walks each stream's instructions on one host thread per
//! stream, keeps the host-side event table (a `Wait` blocks its thread until the matching
//! `Record` was *submitted*), decides guards from routing it read back, and assembles the
//! report. A backend only executes commands on a stream: run a task, copy a list of byte
//! runs (a KV-part copy, [`Backend::copy_runs`]), record or wait an event, read a gate's
//! routing back to the host, and say when a step's work is done.
//! On a synchronous backend (the CPU: capabilities all false) submission is completion,
//! so `record`/`wait` are no-ops and host timings are the task times; an asynchronous
//! backend (CUDA) maps `record`/`wait` to device events and reports device task times
//! after [`Backend::finish_step`].
//!
//! Guarantees a backend must keep: work submitted on one stream runs in submission
//! order; a task never starts before the work its stream waited for has finished;
//! `read_routing` returns only once the routing is in host memory; after `finish_step`
//! returns, every submitted task of the step has finished.

use super::step::StepContext;
use crate::ir::{Engine, StreamId, TaskId};
use crate::lower::{EventId, ExecPlan, PlanArg, PlanTask};
use crate::model::vocab::Routing;
use crate::records::GraphUse;

/// What a backend can do, as data (the driver and reports read it; nothing branches on
/// a backend's type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Submitting work returns before it finishes (device streams).
    pub asynchronous: bool,
    /// Cross-stream events are device objects (`record`/`wait` do real work).
    pub device_events: bool,
    /// The `pinned` space is page-locked host memory the device can copy from directly.
    pub pinned_host: bool,
    /// The checkpoint is used in place from its memory maps (never copied whole).
    pub maps_weights: bool,
}

/// Settings every backend understands (the driver passes them through untouched).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BackendOptions {
    /// Threads of each host compute pool (`gpu.compute` emulation and `cpu.compute`).
    pub threads: usize,
    /// Emulated host<->device link bandwidth in GB/s (`--link-gbps`); `None`: full speed.
    /// Only a backend without a real link honours it.
    pub link_gbps: Option<f64>,
    /// Device memory (`--gpu-mem` or the profile); `None`: what the plan needs.
    pub gpu_capacity: Option<u64>,
    /// How a backend that computes on host memory copies weights (`--weight-copies`); a
    /// device backend always moves the bytes.
    pub weight_copies: WeightCopies,
}

/// How a backend that computes on host memory carries out a copy of weight bytes
/// (`--weight-copies`; `runtime::host::memory` says why binding is sound).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightCopies {
    /// Move the labels of weight bytes, copy only the rest; kernels read weights from the
    /// mapped checkpoint (a DMA engine's copy: no compute core spent on it).
    #[default]
    Bind,
    /// Copy every byte with the copy stream's threads (memcpy at memory bandwidth).
    Move,
}

impl WeightCopies {
    /// The spelling of `--weight-copies`.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightCopies::Bind => "bind",
            WeightCopies::Move => "move",
        }
    }
}

/// Bytes the copies of a run bound (weights: labels moved) and moved (the rest).
pub use crate::records::run::CopyTotals;

/// Bytes a backend allocated for a plan.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// Bytes of the gpu, pinned and host arenas.
    pub arena_bytes: [u64; 3],
    /// Bytes of the weights image's tensors as the process holds them (mapped from the
    /// checkpoint, or repacked at the same length), without the image's padding or slots.
    pub image_bytes: u64,
    /// Whether the pinned arena is page-locked.
    pub pinned_locked: bool,
    /// Bytes the copies so far bound (weights) and moved, when the backend binds weight
    /// copies; `None` when every copy moves its bytes (device backends).
    pub copies: Option<CopyTotals>,
    /// Bytes of the weights image whose page tables were populated before the first step.
    pub populated: u64,
    /// Bytes of the weights image held as Q4_K/Q6_K/Q8_0/Q4_0/MXFP4 tiles repacked at load (allocated in place
    /// of the mapped blocks, see `math::qmatmul::tiles`).
    pub tiled: u64,
    /// Expert computations so far that read a format copy of their expert (a declared lossy
    /// substitute), and all of them; `None` when the plan has no format copy.
    pub substituted: Option<(u64, u64)>,
    /// What the plan's `disk.read` copies read so far; `None` without a `disk.read` stream.
    pub disk: Option<crate::records::run::DiskTotals>,
}

/// One task's device-measured times, seconds from the step's start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceTime {
    /// The task.
    pub task: TaskId,
    /// Start, seconds from the step's start.
    pub start: f64,
    /// End, in the same unit and from the same origin as `start`.
    pub end: f64,
}

/// Why a backend command failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A task's kernel or copy failed (the backend's own error, kept as the source).
    #[error(transparent)]
    Task(Box<dyn std::error::Error + Send + Sync>),
    /// The test hook asked this task to fail.
    #[error("killed by the test hook")]
    Killed,
    /// A gate has no `route` argument to read back.
    #[error("routing of this gate cannot be read back: {0}")]
    Routing(String),
    /// A `route` slice too short for its tokens.
    #[error(transparent)]
    ShortRoute(#[from] ShortRoute),
    /// The backend cannot run here (missing driver, no device).
    #[error("{0}")]
    Unavailable(String),
    /// The backend could not be set up for the plan (memory, pools); the backend's own
    /// error is kept as the source.
    #[error(transparent)]
    Setup(Box<dyn std::error::Error + Send + Sync>),
}

/// An executing backend. Every method is called from the stream thread the driver runs
/// for `stream`, except [`Backend::finish_step`] (the driver's thread, after every
/// stream thread of the step has ended).
pub trait Backend: Sync + std::fmt::Debug {
    /// A short name for reports (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;

    /// What it allocated for the plan.
    fn memory(&self) -> MemoryReport;

    /// One line for the run report saying what runs the plan: the CPU backend's pools,
    /// or a device, where its kernels came from and what the run did there. The driver
    /// asks before the first step and again after the last.
    fn describe(&self) -> String;

    /// The parts of its own set-up it timed (the CPU backend: arenas, the weights image,
    /// tiles, page tables), in order, for the run report's load line; none by default
    /// (the set-up is then one phase, timed by its caller).
    fn setup_phases(&self) -> Vec<crate::records::load::LoadPhase> {
        Vec::new()
    }

    /// Runs (synchronous backend) or submits (asynchronous) `task` on `stream`, whose
    /// engine is `engine`. The driver has already decided the task's guard; `state` is
    /// the step's control plane (micro-batch contents, sampler, read-back routing).
    fn run(
        &self,
        stream: StreamId,
        engine: Engine,
        task: &PlanTask,
        state: &dyn StepContext,
    ) -> Result<(), BackendError>;

    /// Runs or submits, as one command on `stream`, a copy of `runs` of `task`'s `src`
    /// argument to the same offsets of its `dst` argument: each run is (offset from both
    /// arguments' starts, length), the runs sorted and disjoint (what a copy of part of a
    /// KV cache moves, as the driver's KV-copy expansion gives them). Bytes of `dst` outside the runs
    /// are left alone; weight labels move with the bytes inside them. A run outside
    /// either argument is an error, and so are runs whose source and destination overlap.
    /// It is one task of the run's timeline, however many runs it has.
    fn copy_runs(
        &self,
        stream: StreamId,
        engine: Engine,
        task: &PlanTask,
        runs: &[(u64, u64)],
        state: &dyn StepContext,
    ) -> Result<(), BackendError>;

    /// Marks `event` on `stream`: it completes when everything submitted before it on
    /// that stream has finished.
    fn record(&self, stream: StreamId, event: EventId) -> Result<(), BackendError>;

    /// Makes later work on `stream` wait for `event` (whose record the driver has already
    /// submitted).
    fn wait(&self, stream: StreamId, event: EventId) -> Result<(), BackendError>;

    /// Copies the routing `gate` wrote into its `route` argument back to the host
    /// (`tokens` rows of `top_k` slots); returns once it is in host memory.
    fn read_routing(
        &self,
        stream: StreamId,
        gate: &PlanTask,
        route: &PlanArg,
        tokens: usize,
        top_k: usize,
    ) -> Result<Routing, BackendError>;

    /// Waits until every task of the step has finished; gives device-measured task times
    /// when the backend has them (`None`: the driver's host timings are the task times).
    fn finish_step(&self) -> Result<Option<Vec<DeviceTime>>, BackendError>;

    /// Called by the driver before step `step` of `plan` runs over `state`: a device
    /// backend decides here whether the step's device work is recorded for a graph
    /// (CUDA graphs). Nothing to do on a backend that submits work as it comes.
    fn begin_step(
        &self,
        _plan: &ExecPlan,
        _step: usize,
        _state: &dyn StepContext,
    ) -> Result<(), BackendError> {
        Ok(())
    }

    /// Whether this backend runs `task` whatever its guard in the current step, because it
    /// computes nothing for it when the guard is false (the driver then runs it without
    /// the routing on the host). False by default.
    fn decides_guard_on_device(&self, _task: &PlanTask) -> bool {
        false
    }

    /// Whether the plan's read-back of `gate`'s routing is skipped in the current step
    /// (every guard it served is decided on the device). False by default.
    fn skips_read_back(&self, _gate: &PlanTask) -> bool {
        false
    }

    /// Called by the driver after every stream thread of the step has ended, in place of
    /// [`Backend::finish_step`]: submits what the step recorded (a graph launch), waits
    /// for it, hands the step's read-backs (sampled tokens, logits) to `state`, and says
    /// how the device work was submitted. The default is `finish_step` with no graph.
    fn end_step(&self, _state: &dyn StepContext) -> Result<StepEnd, BackendError> {
        Ok(StepEnd {
            times: self.finish_step()?,
            graph: None,
            split: None,
        })
    }

    /// Launches step `step` over `state` without running its tasks, where the backend holds
    /// the device work of exactly this step's shape (a CUDA graph whose staged inputs it
    /// writes for `state`); collected by [`Backend::collect_replay`]. `ids_on_device`: the
    /// driver vouches that every micro-batch's token ids are, row for row, those the last
    /// launched step sampled into its device tokens buffer (a step launched before that
    /// one was collected, whose ids on the host are not known yet). `ahead`: the driver
    /// may launch another step before collecting this one. Gives why not when it cannot
    /// (the driver then runs the step's tasks); never by default.
    fn launch_replay(
        &self,
        _plan: &ExecPlan,
        _step: usize,
        _state: &dyn StepContext,
        _ids_on_device: bool,
        _ahead: bool,
    ) -> Result<Result<u64, String>, BackendError> {
        Ok(Err(format!("the {} backend runs every task", self.name())))
    }

    /// Waits for launch `ticket` of [`Backend::launch_replay`] and hands its read-backs
    /// (sampled tokens, logits) to `state`.
    fn collect_replay(
        &self,
        _ticket: u64,
        _state: &dyn StepContext,
    ) -> Result<StepEnd, BackendError> {
        Err(BackendError::Unavailable(format!(
            "the {} backend launches no step without its tasks",
            self.name()
        )))
    }
}

/// What [`Backend::end_step`] gives.
#[derive(Debug, Clone, PartialEq)]
pub struct StepEnd {
    /// Device-measured task times (`None`: the driver's host timings are the task times).
    pub times: Option<Vec<DeviceTime>>,
    /// How the step's device work was submitted; `None` on a backend with no device.
    pub graph: Option<GraphUse>,
    /// Where the step's time went, for a step launched from its graph without its tasks
    /// ([`Backend::collect_replay`]); `None` otherwise.
    pub split: Option<crate::records::StepSplit>,
}

/// A `route` slice that holds fewer entries than its tokens need.
#[derive(Debug, thiserror::Error)]
#[error("`route` holds {have} bytes, fewer than {tokens} tokens x {top_k} slots")]
pub struct ShortRoute {
    /// Bytes the slice has.
    pub have: usize,
    /// Tokens it should cover.
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
}

/// Decodes a `route` slice: per token and slot, an expert index (`u32`) then its weight
/// (`f32` bits), native endian, `tokens * top_k` entries. This is the one layout `gate`
/// writes on every backend; the CPU ops and every read-back decode it here.
pub fn decode_routing(bytes: &[u8], tokens: usize, top_k: usize) -> Result<Routing, ShortRoute> {
    let entries = tokens.saturating_mul(top_k);
    let needed = entries.saturating_mul(crate::ir::catalog::ROUTE_ENTRY_BYTES as usize);
    let Some(bytes) = bytes.get(..needed) else {
        return Err(ShortRoute {
            have: bytes.len(),
            tokens,
            top_k,
        });
    };
    let mut experts = Vec::with_capacity(entries);
    let mut weights = Vec::with_capacity(entries);
    for entry in bytes.chunks_exact(8) {
        let (e, w) = entry.split_at(4);
        experts.push(u32::from_ne_bytes([e[0], e[1], e[2], e[3]]));
        weights.push(f32::from_bits(u32::from_ne_bytes([w[0], w[1], w[2], w[3]])));
    }
    Ok(Routing {
        top_k,
        experts,
        weights,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_decodes_expert_then_weight_per_slot_and_refuses_short_slices() {
        // One token, top-2: expert 3 with weight 0.25, expert 1 with weight 0.75.
        let mut bytes = Vec::new();
        for (e, w) in [(3u32, 0.25f32), (1, 0.75)] {
            bytes.extend_from_slice(&e.to_ne_bytes());
            bytes.extend_from_slice(&w.to_bits().to_ne_bytes());
        }
        let r = decode_routing(&bytes, 1, 2).expect("16 bytes hold 1 x 2 slots");
        assert_eq!(r.experts, vec![3, 1]);
        assert_eq!(r.weights, vec![0.25, 0.75]);
        let short = decode_routing(&bytes[..15], 1, 2).expect_err("15 bytes are short");
        assert_eq!((short.have, short.tokens, short.top_k), (15, 1, 2));
    }
}
