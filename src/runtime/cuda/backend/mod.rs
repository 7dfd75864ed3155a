//! The CUDA backend: runs a plan's `gpu.*` streams as CUDA streams and its `cpu.*` streams
//! as host threads of the host engine it is given, with the plan's events as CUDA events.
//!
//! Takes a plan, the host memory, a host engine and the [`BackendOptions`]; gives a
//! [`CudaBackend`] that implements [`Backend`], or a [`CudaSetupError`] naming what is
//! missing (driver, device, NVRTC, cuBLAS) or what does not fit. Memory: `gpu` is one
//! device allocation, `pinned` the host memory's arena registered with the driver, `host`
//! pageable, the checkpoint registered read-only where the host can hold it
//! ([`super::host_weights`]; the run report's `weights:` clause says which way, and why). Ops are [`super::ops`]; tasks on
//! `cpu.compute`/`cpu.copy` run on the host engine over the same host memory (the
//! list of backends on top of both hands this backend the CPU backend's `over` that memory
//! as its `registration::HostEngine`: the two backends sit side by side, neither inside the
//! other).
//!
//! Cross-stream order, without spinning:
//! - CUDA stream waits for CUDA stream: `cuStreamWaitEvent` on the recorded event;
//! - host stream waits for CUDA stream: `cuEventSynchronize` (the host thread sleeps in
//!   the driver until the device reaches the event);
//! - anything waits for a host stream: nothing on the device. A host task has finished
//!   when its `Record` is submitted, and the driver lets a waiting stream submit only
//!   after that, so device work is never queued before the host work it depends on.
//!
//! Task times: each device task is bracketed by two timing events on its stream, measured
//! after the step against an origin event recorded before the step's first device task;
//! [`Backend::finish_step`] synchronises every stream and returns them.

use super::device::{Device, DeviceError, PtxSources};
use super::format_copies::{add_sources, ExpertSources};
use super::graph::{self, Command, Deferred, Lane, Recorder};
use super::launch::{Arg, StreamCx, Workspace};
use super::memory::{DeviceMemory, DeviceMemoryError};
use super::ops::{GpuCx, OpError, SampledIds};
use crate::ir::{Engine, StepKind, StreamId, TaskId};
use crate::lower::{EventId, ExecPlan, PlanArg, PlanTask};
use crate::math::rope::RopeTable;
use crate::model::arch::ArchSpec;
use crate::model::vocab::Routing;
use crate::model::vocab::Sampling;
use crate::quant::storage::WeightDtype;
use crate::records::run::{add_graph_step, render_graphs, GraphSummary};
use crate::records::GraphStep;
use crate::runtime::backend::{
    decode_routing, Backend, BackendError, BackendOptions, Capabilities, DeviceTime, MemoryReport,
    StepEnd,
};
use crate::runtime::host::HostMemory;
use crate::runtime::step::StepContext;
use crate::runtime::sync::lock;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

mod report;
mod setup;
mod step;

use step::{step_key, verify_replays};

/// Why the CUDA backend could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CudaSetupError {
    /// The device or its libraries.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Device memory.
    #[error(transparent)]
    Memory(#[from] DeviceMemoryError),
    /// What the CUDA kernels cannot run for this model (named before any launch).
    #[error("the CUDA kernels do not support {0}; run it with --backend cpu")]
    Unsupported(String),
    /// A driver or cuBLAS call during set-up.
    #[error("CUDA set-up failed while {doing}: {detail}")]
    Call {
        /// What was being done.
        doing: &'static str,
        /// The library's error.
        detail: String,
    },
}

/// Why a command of the CUDA backend failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaRunError {
    /// An op.
    #[error(transparent)]
    Op(#[from] OpError),
    /// An event or stream call.
    #[error("CUDA {call} failed: {source}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// An event of the plan past the events created for it.
    #[error("event {0} is not an event of this plan")]
    Event(u32),
    /// A host task run as a host node of the step failed (its first failure).
    #[error("{0}")]
    HostNode(String),
}

fn task_error(e: impl Into<CudaRunError>) -> BackendError {
    BackendError::Task(Box::new(e.into()))
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> BackendError {
    move |source| task_error(CudaRunError::Driver { call, source })
}

/// A CUDA stream of the plan with its cuBLAS handle.
#[derive(Debug)]
struct DevStream {
    stream: Arc<CudaStream>,
    blas: Arc<CudaBlas>,
    workspace: Workspace,
}

/// A device stream's budgeted scratch: the bound its workspace was reserved at and the
/// task that sets it.
#[derive(Debug, Clone)]
struct StreamScratch {
    stream: String,
    bound: u64,
    task: String,
}

/// Where an event was last recorded (0: never, 1: host stream, 2: CUDA stream).
const ON_HOST: u8 = 1;
const ON_DEVICE: u8 = 2;

#[derive(Debug)]
struct PlanEvent {
    event: Arc<CudaEvent>,
    recorded_on: AtomicU8,
}

#[derive(Debug, Default)]
struct Timing {
    origin: Option<CudaEvent>,
    tasks: Vec<(TaskId, CudaEvent, CudaEvent)>,
}

/// What the CUDA backend found and did, for `moec run`'s report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaReport {
    /// Device name and compute capability.
    pub device: String,
    /// Architecture the kernels target.
    pub arch: &'static str,
    /// Where the kernels' PTX came from.
    pub ptx: PtxSources,
    /// Routing read back by `experts`/`post_attn` themselves (no plan read-back).
    pub routing_syncs: usize,
    /// Whether the pinned arena is registered with the driver.
    pub pinned_registered: bool,
    /// How the weights reach the device (registered, pinned copy, relay) and why.
    pub weights: super::host_weights::WeightPath,
    /// Bytes of the weights image copied by host memcpys so far (relayed into pinned
    /// staging, or staged for a device copy).
    pub relayed: u64,
}

/// The CUDA backend for one plan and checkpoint.
#[derive(Debug)]
pub struct CudaBackend<'c> {
    // Field order is drop order: device memory (unregisters the pinned arena) before the
    // host side (whose memory unmaps it); events and streams before the context.
    memory: DeviceMemory,
    /// Records decode steps for CUDA graphs (holds the streams, events and graphs, so it
    /// drops before them).
    recorder: Recorder,
    /// The step being run (its index in the plan) and whether it is recorded.
    step: AtomicUsize,
    recording_step: AtomicBool,
    /// How the steps so far reached the device, per step kind.
    graphs: Mutex<Vec<GraphSummary>>,
    /// Per step index, why the plan alone keeps it from a graph (`None`: it does not).
    plan_reasons: Mutex<std::collections::HashMap<usize, (StepKind, graph::StepPlanGraph)>>,
    /// Per KV-part copy task, the run-table capacity of its recorded launches.
    run_capacity: Mutex<std::collections::HashMap<TaskId, usize>>,
    /// The current step's guards are decided on the device (its read-backs skipped).
    device_guards: AtomicBool,
    /// The current step's host streams' roles while it is recorded (`graph::HostRole`).
    host_roles: Mutex<Vec<Option<graph::HostRole>>>,
    /// What the first-use warm-up did at load (`super::warmup`).
    warm_up: super::warmup::WarmUp,
    /// Per plan stream, its budgeted scratch (`super::scratch`) that its workspace was
    /// reserved at, for the run report.
    scratch: Vec<Option<StreamScratch>>,
    /// The names of the device streams' tasks (the report's peak task).
    task_names: std::collections::HashMap<TaskId, String>,
    events: Vec<PlanEvent>,
    timing: Mutex<Timing>,
    streams: Vec<Option<DevStream>>,
    /// Keeps the rotary tables alive; ops use `rope_ptrs`.
    _rope: (CudaSlice<f32>, CudaSlice<f32>),
    rope_ptrs: (u64, u64),
    /// The device's count of expert computations and of those that read a format copy
    /// (a plan with format copies only), read after each step.
    expert_sources: ExpertSources,
    /// Runs the plan's host-stream tasks over `host_memory`.
    host: Box<dyn Backend + 'c>,
    host_memory: Arc<HostMemory<'c>>,
    arch: ArchSpec,
    dtype: WeightDtype,
    routing_syncs: AtomicUsize,
    /// Routing read-backs for the plan's guards (`Instr::ReadRouting` on a device stream).
    guard_readbacks: AtomicUsize,
    /// The ids each device tokens buffer holds from its last `sample` ([`SampledIds`]).
    sampled_ids: SampledIds,
    /// Steps launched without running their ops, not collected yet, by ticket.
    launched: Mutex<std::collections::HashMap<u64, (usize, graph::Launched)>>,
    next_ticket: AtomicUsize,
    /// Counts for the report: device tasks whose ops ran on the host (recording or
    /// submitting their commands); steps launched without their ops; of those, launched
    /// before the previous step's read-back; steps checked by `MOEC_CUDA_VERIFY_REPLAY`.
    ops_run: AtomicUsize,
    replays_without_ops: AtomicUsize,
    launched_ahead: AtomicUsize,
    verified: AtomicUsize,
    /// Why decode steps a graph could hold ran their ops (each reason, how many steps).
    ran_ops_because: Mutex<std::collections::BTreeMap<String, usize>>,
    device: Device,
}

fn is_device(engine: Engine) -> bool {
    matches!(
        engine,
        Engine::GpuCompute | Engine::GpuCopyIn | Engine::GpuCopyOut
    )
}

impl CudaBackend<'_> {
    fn stream(&self, stream: StreamId) -> Option<&DevStream> {
        self.streams.get(stream.index()).and_then(Option::as_ref)
    }

    /// Host stream `stream`'s role in the current recorded step, if it has one.
    fn host_role(&self, stream: StreamId) -> Option<graph::HostRole> {
        lock(&self.host_roles)
            .get(stream.index())
            .copied()
            .flatten()
    }

    fn bind(&self) -> Result<(), BackendError> {
        self.device
            .ctx
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))
    }

    fn event(&self, event: EventId) -> Result<&PlanEvent, BackendError> {
        self.events
            .get(event.0 as usize)
            .ok_or_else(|| task_error(CudaRunError::Event(event.0)))
    }

    fn timing_event(&self) -> Result<CudaEvent, BackendError> {
        self.device
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("cuEventCreate"))
    }

    /// A KV-part copy of a recorded step as one `copy_runs` launch whose arguments do not
    /// change from step to step: the run table (staged, so each step writes its own runs
    /// at the same address) holds `capacity` entries, the unused ones empty, where
    /// `capacity` is the most runs this task has had, rounded up to a power of two (a
    /// context grows by a run now and then; the capacity, and so the graph, changes only
    /// when it doubles).
    fn record_copy_runs(
        &self,
        stream: StreamId,
        dev: &DevStream,
        task: &PlanTask,
        (src, dst): (u64, u64),
        runs: &[(u64, u64)],
    ) -> Result<(), BackendError> {
        let capacity = {
            let mut caps = lock(&self.run_capacity);
            let cap = caps.entry(task.id).or_insert(16);
            *cap = (*cap).max(runs.len().next_power_of_two());
            *cap
        };
        let mut table = vec![0u64; 2 * capacity];
        for (slot, &(at, len)) in table.chunks_exact_mut(2).zip(runs) {
            slot[0] = at;
            slot[1] = len;
        }
        dev.workspace.begin_task(true, task.id);
        let s = self.stream_cx(stream, dev);
        let table = s.upload(&table).map_err(|e| task_error(OpError::from(e)))?;
        // copy_runs(const u64* runs, long long n, const char* src, char* dst): n (offset,
        // length) pairs; empty pairs copy nothing. The ends were checked by
        // `copy_runs_ends` (every run inside both views).
        s.launch(
            "copy_runs",
            (super::memory::copy_runs_grid(capacity), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(table.ptr()),
                Arg::I64(capacity as i64),
                Arg::Ptr(src),
                Arg::Ptr(dst),
            ],
        )
        .map_err(|e| task_error(OpError::from(e)))
    }

    /// What an op needs of device stream `stream` (`dev`).
    fn stream_cx<'a>(&'a self, stream: StreamId, dev: &'a DevStream) -> StreamCx<'a> {
        StreamCx {
            device: &self.device,
            stream: &dev.stream,
            blas: &dev.blas,
            workspace: &dev.workspace,
            recorder: &self.recorder,
            lane: stream.index(),
        }
    }

    /// Records a task's end event after its work (when it was timed) and keeps the pair.
    fn end_timing(
        &self,
        stream: &CudaStream,
        task: &PlanTask,
        timing: Option<(CudaEvent, CudaEvent)>,
    ) -> Result<(), BackendError> {
        if let Some((start, end)) = timing {
            end.record(stream).map_err(driver("cuEventRecord"))?;
            lock(&self.timing).tasks.push((task.id, start, end));
        }
        Ok(())
    }

    /// A task's start and end events on `stream`, the start recorded (and the step's
    /// origin, on its first task); the caller records the end after the task's work.
    fn start_timing(&self, stream: &CudaStream) -> Result<(CudaEvent, CudaEvent), BackendError> {
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        {
            let mut timing = lock(&self.timing);
            if timing.origin.is_none() {
                // Every stream is idle at a step's start (the last step was finished), so
                // this event completes before any of the step's device work.
                let origin = self.timing_event()?;
                origin.record(stream).map_err(driver("cuEventRecord"))?;
                timing.origin = Some(origin);
            }
        }
        start.record(stream).map_err(driver("cuEventRecord"))?;
        Ok((start, end))
    }
}

impl Backend for CudaBackend<'_> {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            asynchronous: true,
            device_events: true,
            pinned_host: self.memory.pinned_registered(),
            maps_weights: true,
        }
    }

    fn describe(&self) -> String {
        let r = self.report();
        format!(
            "backend: cuda on {}; kernels for {} ({} compiled by NVRTC, {} from the cache); \
             pinned arena {}; {}; host relay memcpy of weights: {} bytes; \
             {} routing read-backs by experts/post_attn (grouping tokens per expert); \
             {} routing read-backs for the plan's guards; \
             CUDA graphs: {}; {} steps launched their graph without running their ops \
             ({} of them launched ahead of the previous step's read-back; {}{}){}; \
             {} device tasks run on the host; {} host tasks run as host nodes of recorded steps",
            r.device,
            r.arch,
            r.ptx.compiled,
            r.ptx.cached,
            if r.pinned_registered {
                "registered with the driver"
            } else {
                "empty or pageable"
            },
            r.weights.describe(),
            r.relayed,
            r.routing_syncs,
            self.guard_readbacks.load(Ordering::Relaxed),
            match render_graphs(&lock(&self.graphs)) {
                t if t.is_empty() => "no step run yet".to_string(),
                t => t,
            },
            self.replays_without_ops.load(Ordering::Relaxed),
            self.launched_ahead.load(Ordering::Relaxed),
            self.recorder.replay_io(),
            match self.verified.load(Ordering::Relaxed) {
                0 => String::new(),
                n => format!(
                    "; {n} steps recorded anyway and found equal to their graph \
                     (MOEC_CUDA_VERIFY_REPLAY)"
                ),
            },
            {
                let why = lock(&self.ran_ops_because);
                if why.is_empty() {
                    String::new()
                } else {
                    let list: Vec<String> = why.iter().map(|(w, n)| format!("{n}: {w}")).collect();
                    format!(
                        "; decode and mixed steps that ran their ops although graphs were on: {}",
                        list.join("; ")
                    )
                }
            },
            self.ops_run.load(Ordering::Relaxed),
            self.recorder.host_calls().ran(),
        ) + &super::ops::quant_kernels(self.host_memory.layout())
            .map_or(String::new(), |q| format!("; {q}"))
            + &self
                .memory
                .format_copies()
                .map_or(String::new(), |c| format!("; {c}"))
            + "; "
            + &self.warm_up.describe()
            + &self.scratch_report()
    }

    fn memory(&self) -> MemoryReport {
        let host = self.host.memory();
        MemoryReport {
            arena_bytes: [self.memory.len(), host.arena_bytes[1], host.arena_bytes[2]],
            image_bytes: host.image_bytes,
            pinned_locked: self.memory.pinned_registered(),
            copies: None,
            populated: host.populated,
            tiled: host.tiled,
            disk: self.host_memory.disk_totals(),
            // Expert computations on the host engine's streams and on the device.
            substituted: add_sources(host.substituted, self.expert_sources.totals()),
        }
    }

    fn run(
        &self,
        stream: StreamId,
        engine: Engine,
        task: &PlanTask,
        state: &dyn StepContext,
    ) -> Result<(), BackendError> {
        let Some(dev) = self.stream(stream) else {
            if self.host_role(stream) == Some(graph::HostRole::Nodes) {
                let node = Command::Host(self.recorder.host_node(stream, task));
                if self.recorder.record(stream.index(), node).is_none() {
                    return Ok(()); // a host node of the step's graph
                }
            }
            // A host stream: the host engine over the same host memory.
            return self.host.run(stream, engine, task, state);
        };
        self.bind()?;
        self.ops_run.fetch_add(1, Ordering::Relaxed);
        let recorded = self.recording_step.load(Ordering::Acquire);
        let timing = if recorded {
            None
        } else {
            Some(self.start_timing(&dev.stream)?)
        };
        dev.workspace.begin_task(recorded, task.id);
        let cx = GpuCx {
            s: self.stream_cx(stream, dev),
            mem: &self.memory,
            host: &self.host_memory,
            arch: &self.arch,
            rope: self.rope_ptrs,
            state,
            dtype: self.dtype,
            routing_syncs: &self.routing_syncs,
            sampled_ids: &self.sampled_ids,
            expert_counts: self.expert_sources.pair(stream.index()),
        };
        cx.run(task).map_err(task_error)?;
        self.end_timing(&dev.stream, task, timing)
    }

    fn copy_runs(
        &self,
        stream: StreamId,
        engine: Engine,
        task: &PlanTask,
        runs: &[(u64, u64)],
        state: &dyn StepContext,
    ) -> Result<(), BackendError> {
        let Some(dev) = self.stream(stream) else {
            return self.host.copy_runs(stream, engine, task, runs, state);
        };
        let (src, dst) = self
            .host_memory
            .copy_views(task, state, self.arch.experts as u32)
            .map_err(|e| task_error(OpError::from(e)))?;
        self.bind()?;
        self.ops_run.fetch_add(1, Ordering::Relaxed);
        if self.recording_step.load(Ordering::Acquire) {
            if let Some(ends) = self
                .memory
                .copy_runs_ends(&self.host_memory, src, dst, runs)
                .map_err(|e| task_error(OpError::from(e)))?
            {
                return self.record_copy_runs(stream, dev, task, ends, runs);
            }
        }
        // Not a copy a graph can hold: submitted as it is, after what was recorded.
        self.recorder
            .flush("a KV-part copy touches pageable host memory")
            .map_err(|e| task_error(OpError::from(e)))?;
        let timing = if self.recording_step.load(Ordering::Acquire) {
            None
        } else {
            Some(self.start_timing(&dev.stream)?)
        };
        self.memory
            .copy_runs(&self.device, &self.host_memory, &dev.stream, src, dst, runs)
            .map_err(|e| task_error(OpError::from(e)))?;
        self.end_timing(&dev.stream, task, timing)
    }

    fn record(&self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        let ev = self.event(event)?;
        match self.stream(stream) {
            Some(dev) => {
                self.bind()?;
                if self
                    .recorder
                    .record(stream.index(), Command::Record(event.0 as usize))
                    .is_some()
                {
                    ev.event
                        .record(&dev.stream)
                        .map_err(driver("cuEventRecord"))?;
                }
                ev.recorded_on.store(ON_DEVICE, Ordering::Release);
            }
            None => {
                let nodes = self.host_role(stream) == Some(graph::HostRole::Nodes);
                if nodes
                    && self
                        .recorder
                        .record(stream.index(), Command::Record(event.0 as usize))
                        .is_none()
                {
                    // Recorded on the host lane after the stream's host nodes: device
                    // streams wait for it on the device.
                    ev.recorded_on.store(ON_DEVICE, Ordering::Release);
                } else {
                    // Host work before this point has finished: nothing to mark on the
                    // device.
                    ev.recorded_on.store(ON_HOST, Ordering::Release);
                }
            }
        }
        Ok(())
    }

    fn wait(&self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        let ev = self.event(event)?;
        if ev.recorded_on.load(Ordering::Acquire) != ON_DEVICE {
            // Recorded on a host stream: finished when its record was submitted, which
            // the driver waited for before calling this.
            return Ok(());
        }
        self.bind()?;
        match self.stream(stream) {
            Some(dev) => {
                if self
                    .recorder
                    .record(stream.index(), Command::Wait(event.0 as usize))
                    .is_none()
                {
                    return Ok(());
                }
                dev.stream
                    .wait(&ev.event)
                    .map_err(driver("cuStreamWaitEvent"))
            }
            None => {
                match self.host_role(stream) {
                    // Label moves touch nothing the device reads (`graph::HostRole`).
                    Some(graph::HostRole::Labels) if self.recorder.recording() => return Ok(()),
                    Some(graph::HostRole::Nodes)
                        if self
                            .recorder
                            .record(stream.index(), Command::Wait(event.0 as usize))
                            .is_none() =>
                    {
                        return Ok(()); // the host lane waits, on the device
                    }
                    _ => {}
                }
                self.recorder
                    .flush("a host stream waits for device work inside the step")
                    .map_err(|e| task_error(OpError::from(e)))?;
                ev.event.synchronize().map_err(driver("cuEventSynchronize"))
            }
        }
    }

    fn read_routing(
        &self,
        stream: StreamId,
        gate: &PlanTask,
        route: &PlanArg,
        tokens: usize,
        top_k: usize,
    ) -> Result<Routing, BackendError> {
        let Some(dev) = self.stream(stream) else {
            return self.host.read_routing(stream, gate, route, tokens, top_k);
        };
        self.bind()?;
        self.guard_readbacks.fetch_add(1, Ordering::Relaxed);
        self.recorder
            .flush("the routing of a gate is read back for the plan's guards")
            .map_err(|e| task_error(OpError::from(e)))?;
        let view = self
            .host_memory
            .view(gate, route, None)
            .map_err(|e| task_error(OpError::from(e)))?;
        let ptr = self
            .memory
            .ptr(view)
            .map_err(|e| task_error(OpError::from(e)))?;
        let needed = tokens * top_k * crate::ir::catalog::ROUTE_ENTRY_BYTES as usize;
        let mut bytes = vec![0u8; needed.min(view.len as usize)];
        // A device-to-host copy after the gate on its stream, then an event the host waits
        // on: only this stream's thread (and the guards behind it) waits.
        // SAFETY: `ptr` addresses `view.len >= bytes.len()` bytes of the gpu arena.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut bytes, ptr, dev.stream.cu_stream())
        }
        .map_err(driver("cuMemcpyDtoHAsync"))?;
        let done = dev
            .stream
            .record_event(None)
            .map_err(driver("cuEventRecord"))?;
        done.synchronize().map_err(driver("cuEventSynchronize"))?;
        Ok(decode_routing(&bytes, tokens, top_k)?)
    }

    fn finish_step(&self) -> Result<Option<Vec<DeviceTime>>, BackendError> {
        self.bind()?;
        // Device streams and host lanes.
        self.recorder
            .synchronize()
            .map_err(|e| task_error(OpError::from(e)))?;
        self.expert_sources
            .read()
            .map_err(driver("cuMemcpyDtoH (expert counters)"))?;
        let timing = std::mem::take(&mut *lock(&self.timing));
        for ev in &self.events {
            ev.recorded_on.store(0, Ordering::Release);
        }
        let Some(origin) = timing.origin else {
            return Ok(None);
        };
        let mut times = Vec::with_capacity(timing.tasks.len());
        for (task, start, end) in &timing.tasks {
            let s = origin
                .elapsed_ms(start)
                .map_err(driver("cuEventElapsedTime"))?;
            let e = origin
                .elapsed_ms(end)
                .map_err(driver("cuEventElapsedTime"))?;
            times.push(DeviceTime {
                task: *task,
                start: f64::from(s) / 1e3,
                end: f64::from(e) / 1e3,
            });
        }
        Ok(Some(times))
    }

    fn begin_step(
        &self,
        plan: &ExecPlan,
        step: usize,
        state: &dyn StepContext,
    ) -> Result<(), BackendError> {
        let (_, planned) = lock(&self.plan_reasons)
            .entry(step)
            .or_insert_with(|| {
                let kind = plan.steps.get(step).map_or(StepKind::Decode, |s| s.kind);
                (
                    kind,
                    graph::plan_graph(plan, step, self.host_memory.binds()),
                )
            })
            .clone();
        let reason = planned
            .reason
            .or_else(|| {
                (!matches!(state.sampling(), Sampling::Greedy))
                    .then(|| "temperature sampling reads the logits back to the host".to_string())
            })
            .or_else(|| {
                graphs_switched_off()
                    .then(|| "CUDA graphs are switched off (MOEC_CUDA_GRAPHS=off)".to_string())
            });
        self.step.store(step, Ordering::Release);
        self.recording_step
            .store(reason.is_none(), Ordering::Release);
        *lock(&self.host_roles) = if reason.is_none() {
            planned.host_roles.clone()
        } else {
            Vec::new()
        };
        // SAFETY: the driver keeps `state` alive from this call to `end_step`, and host
        // nodes run only inside this step's calls: a flush synchronises every lane before
        // it returns, and `end_step` does before it closes the calls.
        unsafe { self.recorder.host_calls().open(&*self.host, state) };
        self.device_guards
            .store(reason.is_none() && planned.device_guards, Ordering::Release);
        let key = reason.is_none().then(|| step_key(plan, step, state));
        // Under MOEC_CUDA_VERIFY_REPLAY a step that could have skipped its ops is
        // recorded, and its commands must be its graph's.
        let verify = verify_replays()
            && key
                .as_ref()
                .is_some_and(|k| self.replay_inputs(plan, step, state, k, false).is_ok());
        self.recorder.begin(reason, key);
        if verify {
            self.recorder.verify_step();
        }
        for dev in self.streams.iter().flatten() {
            dev.workspace.begin_step();
        }
        Ok(())
    }

    fn end_step(&self, state: &dyn StepContext) -> Result<StepEnd, BackendError> {
        self.bind()?;
        // SAFETY: `state` outlives this call, and the calls are closed below only after
        // every lane has finished (on success by `finish_step`, else synchronised here).
        unsafe { self.recorder.host_calls().open(&*self.host, state) };
        let ended = self.end_recorded_step(state);
        if ended.is_err() {
            // Nothing may run over the state once the call returns.
            let _ = self.recorder.synchronize();
        }
        self.recorder.host_calls().close();
        lock(&self.host_roles).clear();
        let ended = ended?;
        match self.recorder.host_calls().take_failure() {
            Some(why) => Err(task_error(CudaRunError::HostNode(why))),
            None => Ok(ended),
        }
    }

    fn launch_replay(
        &self,
        plan: &ExecPlan,
        step: usize,
        state: &dyn StepContext,
        ids_on_device: bool,
        ahead: bool,
    ) -> Result<Result<u64, String>, BackendError> {
        if verify_replays() {
            return Ok(Err(
                "MOEC_CUDA_VERIFY_REPLAY records every step to check its graph".into(),
            ));
        }
        let began = std::time::Instant::now();
        let key = step_key(plan, step, state);
        let inputs = match self.replay_inputs(plan, step, state, &key, ids_on_device) {
            Ok(inputs) => inputs,
            Err(why) => {
                let graphable = lock(&self.plan_reasons)
                    .get(&step)
                    .is_some_and(|(_, p)| p.reason.is_none());
                if graphable && !ahead {
                    *lock(&self.ran_ops_because).entry(why.clone()).or_default() += 1;
                }
                return Ok(Err(why));
            }
        };
        let staging = began.elapsed().as_secs_f64();
        self.bind()?;
        let mut launched = self
            .recorder
            .launch_replay(&key, inputs, ahead)
            .map_err(|e| task_error(OpError::from(e)))?;
        // Staging: the inputs computed here plus their write, when it was not queued
        // (the recorder writes them before the launch with nothing in flight).
        launched.host_times(began.elapsed().as_secs_f64(), staging);
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed) as u64;
        lock(&self.launched).insert(ticket, (step, launched));
        self.replays_without_ops.fetch_add(1, Ordering::Relaxed);
        if ids_on_device {
            self.launched_ahead.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Ok(ticket))
    }

    fn collect_replay(
        &self,
        ticket: u64,
        state: &dyn StepContext,
    ) -> Result<StepEnd, BackendError> {
        let Some((step, launched)) = lock(&self.launched).remove(&ticket) else {
            return Err(task_error(OpError::from(
                super::launch::LaunchError::Capture("no such launched step"),
            )));
        };
        let began = std::time::Instant::now();
        self.bind()?;
        let (reads, mut split) = self
            .recorder
            .collect(launched)
            .map_err(|e| task_error(OpError::from(e)))?;
        for (d, bytes) in reads {
            match d {
                Deferred::Sampled { ub, dst, .. } => {
                    let ids = graph::words(&bytes);
                    self.sampled_ids.wrote(dst, &ids);
                    state.put_sampled(ub, ids);
                }
                Deferred::Logits { ub, .. } => state.put_logits(ub, graph::floats(&bytes)),
            }
        }
        if self.recorder.in_flight() == 0 {
            // Every launch has finished: the counters hold every step's counts.
            self.expert_sources
                .read()
                .map_err(driver("cuMemcpyDtoH (expert counters)"))?;
        }
        let graph = crate::records::GraphUse::Replayed;
        if let Some((kind, _)) = lock(&self.plan_reasons).get(&step) {
            add_graph_step(
                &mut lock(&self.graphs),
                &GraphStep {
                    kind: *kind,
                    graph: graph.clone(),
                },
            );
        }
        split.wait = began.elapsed().as_secs_f64();
        Ok(StepEnd {
            times: None,
            graph: Some(graph),
            split: Some(split),
        })
    }

    fn decides_guard_on_device(&self, task: &PlanTask) -> bool {
        self.device_guards.load(Ordering::Acquire)
            && graph::guard_decided_on_device(task, |s| self.stream(StreamId::new(s)).is_some())
    }

    fn skips_read_back(&self, _gate: &PlanTask) -> bool {
        self.device_guards.load(Ordering::Acquire)
    }
}

/// Whether `MOEC_CUDA_GRAPHS=off` (read once): every step is submitted as issued, never
/// captured or replayed, and the run report says why. A test hook: it gives the plain
/// launches' results to compare a replayed step's with
/// (tests/cuda_executor.rs, `decode_steps_replay_with_dumped_logits_equal_to_plain_steps`).
fn graphs_switched_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("MOEC_CUDA_GRAPHS").as_deref() == Ok("off"))
}
