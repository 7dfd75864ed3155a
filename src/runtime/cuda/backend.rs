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

/// The plan's tasks on device streams.
fn device_tasks(plan: &ExecPlan) -> impl Iterator<Item = &PlanTask> {
    plan.tasks.iter().filter(|t| {
        plan.streams
            .get(t.stream.index())
            .is_some_and(|s| is_device(s.engine))
    })
}

/// Per plan stream, the scratch rules' bound over its device tasks (`super::scratch`),
/// the same as `moec check` counts (`cost::budget`).
fn scratch_bounds(plan: &ExecPlan) -> Vec<Option<StreamScratch>> {
    let mut rules = super::scratch::ScratchRules::new(&plan.model, &plan.workload);
    let tasks = device_tasks(plan).map(|t| {
        let facts = crate::ir::scratch::TaskFacts::new(
            t.op,
            t.shape,
            t.kv.map(|k| k.part),
            t.args.iter().map(|a| a.role),
        );
        (t.stream.index(), t.id, facts)
    });
    crate::ir::scratch::stream_bounds(&mut rules, plan.streams.len(), tasks)
        .into_iter()
        .enumerate()
        .map(|(s, bound)| {
            let (bytes, task) = bound?;
            Some(StreamScratch {
                stream: plan.streams[s].name.clone(),
                bound: bytes,
                task: plan
                    .tasks
                    .iter()
                    .find(|t| t.id == task)
                    .map_or_else(String::new, |t| t.name.clone()),
            })
        })
        .collect()
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

/// The shape of step `step` over `state` ([`graph::StepKey`]).
fn step_key(plan: &ExecPlan, step: usize, state: &dyn StepContext) -> graph::StepKey {
    let ubs = (0..plan.micro_batches.count)
        .map(|ub| {
            state.micro_batch(ub).map_or((0, Vec::new()), |mb| {
                let seqs = mb
                    .seqs
                    .iter()
                    .map(|s| (s.new_tokens.len(), s.block_table.len(), s.prefill))
                    .collect();
                (mb.block_size, seqs)
            })
        })
        .collect();
    graph::StepKey {
        step,
        logits: state.wants_logits(),
        ubs,
    }
}

/// Whether step `step` runs a task on a host stream (which a step launched without its
/// tasks would leave out).
fn runs_host_tasks(plan: &ExecPlan, step: usize) -> bool {
    plan.steps.get(step).is_none_or(|sp| {
        sp.programs.iter().enumerate().any(|(s, program)| {
            !plan.streams.get(s).is_some_and(|st| is_device(st.engine))
                && program
                    .iter()
                    .any(|i| matches!(i, crate::lower::Instr::Run(_)))
        })
    })
}

/// Whether `MOEC_CUDA_VERIFY_REPLAY=1` (read once): a test mode where a step that could
/// launch its graph without its ops runs them anyway, and the run fails if their commands
/// differ from the graph's ([`graph::Recorder::replay_plan`]'s argument, checked).
fn verify_replays() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEC_CUDA_VERIFY_REPLAY").as_deref() == Ok("1"))
}

/// The plan's format copies of the experts as (offset, bytes) in the `host` arena,
/// where lowering placed them.
fn format_copy_ranges(plan: &ExecPlan) -> Vec<(u64, u64)> {
    plan.format_copies
        .iter()
        .filter_map(|copy| plan.buffers.get(copy.buffer.index()))
        .filter_map(|slot| match slot.placement {
            crate::lower::Placement::Arena {
                space: crate::ir::Space::Host,
                offset,
            } => Some((offset, slot.bytes)),
            _ => None,
        })
        .collect()
}

fn is_device(engine: Engine) -> bool {
    matches!(
        engine,
        Engine::GpuCompute | Engine::GpuCopyIn | Engine::GpuCopyOut
    )
}

impl<'c> CudaBackend<'c> {
    /// Opens the device, loads the kernels, allocates the `gpu` arena and creates one CUDA
    /// stream (and cuBLAS handle) per device stream of the plan. `host_memory` is the
    /// plan's host side (`HostMemory::host_side`: no `gpu` arena) and `host` the engine
    /// that runs the plan's `cpu.*` streams over it.
    pub fn new(
        plan: &ExecPlan,
        host_memory: Arc<HostMemory<'c>>,
        host: Box<dyn Backend + 'c>,
        options: &BackendOptions,
    ) -> Result<Self, CudaSetupError> {
        // The device kernels multiply bf16 weights with f32 activations; with the CPU's bf16
        // product selected the host-side tasks would compute another arithmetic than the
        // device's, and the run would leave the oracle's tokens: refused before any launch.
        if crate::math::isa::Kernels::process().bf16_dot() {
            return Err(CudaSetupError::Unsupported(
                "the bf16 product (MOEC_BF16_PRODUCT=bf16: its kernels keep f32 activations \
                 for bf16 weights; unset it for --backend cuda)"
                    .into(),
            ));
        }
        let device = Device::open()?;
        let call = |doing: &'static str| {
            move |e: DriverError| CudaSetupError::Call {
                doing,
                detail: e.to_string(),
            }
        };
        let arch = ArchSpec::from_card(&plan.model);
        if let Some(what) = super::ops::unsupported(&arch, &host_memory.layout().layer) {
            return Err(CudaSetupError::Unsupported(what));
        }
        let mut streams = Vec::with_capacity(plan.streams.len());
        for s in &plan.streams {
            if is_device(s.engine) {
                let stream = device.ctx.new_stream().map_err(call("creating a stream"))?;
                let blas =
                    CudaBlas::new(Arc::clone(&stream)).map_err(|e| CudaSetupError::Call {
                        doing: "creating a cuBLAS handle",
                        detail: format!("{e:?}"),
                    })?;
                streams.push(Some(DevStream {
                    stream,
                    blas: Arc::new(blas),
                    workspace: Workspace::default(),
                }));
            } else {
                streams.push(None);
            }
        }
        let setup_stream = match streams.iter().flatten().next() {
            Some(s) => Arc::clone(&s.stream),
            None => device.ctx.new_stream().map_err(call("creating a stream"))?,
        };
        let gpu_bytes = plan.arena(crate::ir::Space::Gpu).bytes;
        let memory = DeviceMemory::new(
            &device,
            &setup_stream,
            gpu_bytes,
            options.gpu_capacity,
            &host_memory,
            options.weight_copies,
            &format_copy_ranges(plan),
        )?;
        // Each device stream's scratch reserved at its budgeted bound: a run within the
        // budget never grows it (the report says when a task took more).
        let scratch = scratch_bounds(plan);
        for (dev, bound) in streams.iter().zip(&scratch) {
            if let (Some(dev), Some(b)) = (dev, bound) {
                dev.workspace
                    .reserve(&dev.stream, b.bound as usize)
                    .map_err(|e| CudaSetupError::Call {
                        doing: "reserving a stream's scratch",
                        detail: e.to_string(),
                    })?;
            }
        }
        let task_names = device_tasks(plan).map(|t| (t.id, t.name.clone())).collect();
        let expert_sources =
            ExpertSources::new(&setup_stream, streams.len(), !plan.format_copies.is_empty())
                .map_err(call("allocating the expert counters"))?;
        // The CPU's own tables (YaRN-scaled for gpt-oss), so rotary agrees bit for bit.
        let table = RopeTable::for_arch(&arch, arch.max_positions);
        let (cos, sin) = table.tables();
        let rope = (
            setup_stream
                .clone_htod(cos)
                .map_err(call("uploading the rotary tables"))?,
            setup_stream
                .clone_htod(sin)
                .map_err(call("uploading the rotary tables"))?,
        );
        let rope_ptrs = (
            rope.0.device_ptr(&setup_stream).0,
            rope.1.device_ptr(&setup_stream).0,
        );
        setup_stream
            .synchronize()
            .map_err(call("finishing set-up"))?;
        let n_events = plan.event_count();
        let events = (0..n_events)
            .map(|_| {
                Ok(PlanEvent {
                    event: Arc::new(
                        device
                            .ctx
                            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                            .map_err(call("creating an event"))?,
                    ),
                    recorded_on: AtomicU8::new(0),
                })
            })
            .collect::<Result<Vec<_>, CudaSetupError>>()?;
        // A host stream gets a host lane: the CUDA stream its tasks go to as host nodes
        // when it waits for device work inside a recorded step (`graph::HostRole`).
        let lanes = streams
            .iter()
            .map(|s| match s {
                Some(d) => Ok(Some(Lane {
                    stream: Arc::clone(&d.stream),
                    blas: Some(Arc::clone(&d.blas)),
                })),
                None => Ok(Some(Lane {
                    stream: device
                        .ctx
                        .new_stream()
                        .map_err(call("creating a host lane"))?,
                    blas: None,
                })),
            })
            .collect::<Result<Vec<_>, CudaSetupError>>()?;
        let fork_join = (0..=lanes.len())
            .map(|_| {
                device
                    .ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(call("creating an event"))
            })
            .collect::<Result<Vec<_>, CudaSetupError>>()?;
        // cuBLAS's start-up and its kernels' first loads, at load rather than in the
        // first prefill (`warmup`).
        let handles = streams
            .iter()
            .map(|d| d.as_ref().map(|d| (&d.stream, &d.blas)));
        let warm_up = super::warmup::for_plan(plan, &arch, handles);
        let recorder = Recorder::new(
            lanes,
            events.iter().map(|e| Arc::clone(&e.event)).collect(),
            fork_join,
        );
        Ok(CudaBackend {
            memory,
            recorder,
            step: AtomicUsize::new(0),
            recording_step: AtomicBool::new(false),
            device_guards: AtomicBool::new(false),
            host_roles: Mutex::default(),
            run_capacity: Mutex::default(),
            graphs: Mutex::default(),
            plan_reasons: Mutex::default(),
            events,
            timing: Mutex::default(),
            streams,
            _rope: rope,
            rope_ptrs,
            expert_sources,
            host,
            host_memory,
            dtype: plan.model.dtype,
            arch,
            routing_syncs: AtomicUsize::new(0),
            guard_readbacks: AtomicUsize::new(0),
            sampled_ids: SampledIds::default(),
            launched: Mutex::default(),
            next_ticket: AtomicUsize::new(0),
            ops_run: AtomicUsize::new(0),
            replays_without_ops: AtomicUsize::new(0),
            launched_ahead: AtomicUsize::new(0),
            verified: AtomicUsize::new(0),
            ran_ops_because: Mutex::default(),
            warm_up,
            scratch,
            task_names,
            device,
        })
    }

    /// What the backend found and did (device, kernels, routing syncs).
    pub fn report(&self) -> CudaReport {
        let (major, minor) = self.device.compute_capability;
        CudaReport {
            device: format!("{} (compute capability {major}.{minor})", self.device.name),
            arch: self.device.arch,
            ptx: self.device.ptx,
            routing_syncs: self.routing_syncs.load(Ordering::Relaxed),
            pinned_registered: self.memory.pinned_registered(),
            weights: self.memory.weight_path().clone(),
            relayed: self.host_memory.relayed(),
        }
    }

    /// The run report's scratch clauses: per device stream with tasks, `gpu scratch on
    /// <stream>: peak X B a task (<task>), arena Y B, budgeted Z B (<task>)`, and a
    /// `BUDGET VIOLATION` clause for a stream where a task took more than its bound.
    fn scratch_report(&self) -> String {
        let mut out = String::new();
        for (dev, budget) in self.streams.iter().zip(&self.scratch) {
            let (Some(dev), Some(budget)) = (dev, budget) else {
                continue;
            };
            let usage = dev.workspace.usage();
            let (arena, _) = dev.workspace.size();
            let name = |t: Option<TaskId>| {
                t.and_then(|t| self.task_names.get(&t))
                    .map_or("no task", String::as_str)
            };
            out += &format!(
                "; gpu scratch on {}: peak {} B a task ({}), arena {arena} B, budgeted {} B ({})",
                budget.stream,
                usage.peak,
                name(usage.peak_task),
                budget.bound,
                budget.task
            );
            if usage.over > 0 {
                out += &format!(
                    "; BUDGET VIOLATION: gpu scratch on {}: {} tasks took more than the \
                     budgeted {} B, the most {} B ({})",
                    budget.stream,
                    usage.over,
                    budget.bound,
                    usage.peak,
                    name(usage.peak_task)
                );
            }
        }
        out
    }

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

impl CudaBackend<'_> {
    /// The end of a step as it was recorded or submitted: its graph launched (or its
    /// commands submitted), every lane synchronised, its read-backs handed to `state`.
    fn end_recorded_step(&self, state: &dyn StepContext) -> Result<StepEnd, BackendError> {
        let step = self.step.load(Ordering::Acquire);
        let (graph, deferred, verified) = self
            .recorder
            .finish(step)
            .map_err(|e| task_error(OpError::from(e)))?;
        if verified {
            self.verified.fetch_add(1, Ordering::Relaxed);
        }
        let times = self.finish_step()?;
        self.recording_step.store(false, Ordering::Release);
        self.device_guards.store(false, Ordering::Release);
        for dev in self.streams.iter().flatten() {
            dev.workspace.release_retired();
        }
        for d in deferred {
            // SAFETY: each address starts the staging bytes a recorded copy filled; every
            // stream was synchronised above, so the copies have finished.
            let bytes = |at: usize, count: usize| unsafe {
                std::slice::from_raw_parts(at as *const u8, count * 4)
            };
            match d {
                Deferred::Sampled { ub, at, count, dst } => {
                    let ids = graph::words(bytes(at, count));
                    self.sampled_ids.wrote(dst, &ids);
                    state.put_sampled(ub, ids);
                }
                Deferred::Logits { ub, at, count } => {
                    state.put_logits(ub, graph::floats(bytes(at, count)));
                }
            }
        }
        if let Some((kind, _)) = lock(&self.plan_reasons).get(&step) {
            let step = GraphStep {
                kind: *kind,
                graph: graph.clone(),
            };
            add_graph_step(&mut lock(&self.graphs), &step);
        }
        Ok(StepEnd {
            times,
            graph: Some(graph),
            split: None,
        })
    }

    /// The staged inputs ((address, bytes)) of step `step` of shape `key` over `state` for
    /// launching its cached graph without its ops, or why it cannot be.
    fn replay_inputs(
        &self,
        plan: &ExecPlan,
        step: usize,
        state: &dyn StepContext,
        key: &graph::StepKey,
        ids_on_device: bool,
    ) -> Result<Vec<(usize, Vec<u8>)>, String> {
        let planned = lock(&self.plan_reasons)
            .get(&step)
            .map(|(_, p)| p.clone())
            .ok_or("the step has not run its ops yet")?;
        if let Some(why) = planned.reason {
            return Err(why);
        }
        if !matches!(state.sampling(), Sampling::Greedy) {
            return Err("temperature sampling reads the logits back to the host".into());
        }
        if graphs_switched_off() {
            return Err("CUDA graphs are switched off (MOEC_CUDA_GRAPHS=off)".into());
        }
        if runs_host_tasks(plan, step) {
            return Err("the step runs tasks on host streams".into());
        }
        let replay = self.recorder.replay_plan(key).map_err(str::to_string)?;
        let ub = |u: u32| {
            state
                .micro_batch(u)
                .ok_or("a micro-batch beyond the plan's")
        };
        if ids_on_device {
            // The ids on the host are not known: every micro-batch with rows must read
            // them where the last step's `sample` left them.
            for u in 0..plan.micro_batches.count {
                if ub(u)?.n_tokens() > 0 && !replay.device_ids.iter().any(|d| d.0 == u) {
                    return Err(format!(
                        "micro-batch {u}'s `embed` reads its ids from the host in this graph"
                    ));
                }
            }
        } else {
            for &(u, at) in &replay.device_ids {
                if !self.sampled_ids.holds(at, &ub(u)?.token_ids()) {
                    return Err(format!(
                        "micro-batch {u}'s ids are not those its last `sample` left on the device"
                    ));
                }
            }
        }
        let mut inputs = Vec::with_capacity(replay.packs.len());
        for &(at, u, len) in &replay.packs {
            let pack = super::step_inputs::StepInputs::of(ub(u)?);
            let bytes: Vec<u8> = bytemuck::cast_slice(pack.words()).to_vec();
            if bytes.len() != len {
                return Err(format!("micro-batch {u}'s step inputs changed size"));
            }
            inputs.push((at, bytes));
        }
        Ok(inputs)
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
