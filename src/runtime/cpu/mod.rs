//! The CPU backend: runs a plan's tasks on host memory with host thread pools.
//!
//! Takes a plan, the checkpoint and the [`BackendOptions`]; gives a [`CpuBackend`] that
//! implements [`Backend`]. Every memory space is a host arena ([`memory`]), the weights
//! image is the checkpoint's own memory maps (`runtime::host`, which device backends share),
//! and ops call the model's kernels ([`ops`]): the oracle's kernels, so no second copy of
//! the math. It is synchronous
//! (submission is completion): `record`/`wait` do nothing because the driver's host-side
//! event table already orders the stream threads, and task times are the driver's host
//! timings. `gpu.compute` and `cpu.compute` ops run in one shared rayon pool of `threads`
//! threads: on this backend both engines are the same cores, so two pools would put twice
//! as many busy threads as cores on them whenever both engines compute at once, and the
//! shared pool instead lets whichever engine has work use every core ([`pool_split`] says
//! so in the run report). Copies run on the calling stream thread.

pub(crate) mod ops;

use super::backend::{
    decode_routing, Backend, BackendError, BackendOptions, Capabilities, DeviceTime, MemoryReport,
    WeightCopies,
};
use super::host::memory::{HostMemory, MemoryError};
use super::registration::{DevicesReport, GpuSpace, HostEngine, Registration};
use super::step::StepContext;
use crate::ir::{Engine, StreamId};
use crate::lower::{EventId, ExecPlan, PlanArg, PlanTask};
use crate::math::rope::RopeTable;
use crate::model::arch::ArchSpec;
use crate::model::vocab::Routing;
use crate::records::load::{Laps, LoadPhase};
use crate::weights::checkpoint::Checkpoint;
use ops::OpContext;
use std::sync::Arc;

/// Why the CPU backend could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CpuSetupError {
    /// Arenas or the weights image.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A rayon pool could not be built.
    #[error("cannot build a thread pool: {0}")]
    Pool(String),
}

/// The CPU backend for one plan and checkpoint.
#[derive(Debug)]
pub struct CpuBackend<'c> {
    memory: Arc<HostMemory<'c>>,
    arch: ArchSpec,
    rope: RopeTable,
    /// The one compute pool both `gpu.compute` and `cpu.compute` ops run in.
    pool: rayon::ThreadPool,
    threads: usize,
    /// Its set-up, timed part by part (empty for a device backend's host engine, whose
    /// memory the device backend set up).
    setup: Vec<LoadPhase>,
}

/// The CPU backend's use of the cores, said plainly for the run report: one pool of
/// `threads` threads shared by the `gpu.compute` (emulated) and `cpu.compute` engines.
pub fn pool_split(threads: usize) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let note = if threads > cores {
        " (more threads than cores: oversubscribed)"
    } else {
        ""
    };
    format!(
        "compute pools: gpu.compute and cpu.compute share one pool of {threads} threads on this machine's {cores} cores{note}"
    )
}

/// The CPU backend's registration (listed by `runtime::registry`): the default, always
/// available; every space is host memory, so weight copies may bind.
pub const REGISTRATION: Registration = Registration {
    name: "cpu",
    about: "the CPU backend: every space in host memory, one compute pool for both engines",
    gpu_space: GpuSpace::Host,
    binds_weight_copies: true,
    quant_formats: &crate::quant::QuantFormat::ALL,
    kv_types: &[
        crate::model::vocab::KvType::F32,
        crate::model::vocab::KvType::F16,
    ],
    mla_values_in_keys: true,
    // Its `gpu` tasks compute on host memory: the budget keeps the op catalog's workspace.
    scratch: None,
    refusal: || None,
    open: open_cpu,
    link_libraries: || None,
    devices,
    probe: None,
};

/// What `moec devices` prints for the CPU backend: threads, the SIMD paths this CPU has,
/// and the CPU kernels chosen and why (`MOEC_KERNELS`).
fn devices() -> DevicesReport {
    use crate::math::isa::Isa;
    use crate::math::report::describe;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let has = |isa: Isa| if isa.is_supported() { "yes" } else { "no" };
    DevicesReport {
        lines: vec![
            format!(
                "cpu: available, {threads} threads, AVX-512: {}, AVX2+FMA: {}",
                has(Isa::Avx512),
                has(Isa::Avx2)
            ),
            format!("  {}", describe()),
        ],
        failure: None,
    }
}

fn setup_error(e: CpuSetupError) -> BackendError {
    BackendError::Setup(Box::new(e))
}

fn open_cpu<'c>(
    plan: &ExecPlan,
    checkpoint: &'c Checkpoint,
    options: &BackendOptions,
    _host: HostEngine,
) -> Result<Box<dyn Backend + 'c>, BackendError> {
    Ok(Box::new(
        CpuBackend::new(plan, checkpoint, options).map_err(setup_error)?,
    ))
}

/// The CPU backend as a device backend's host engine (`registration::HostEngine`): it runs the
/// plan's `cpu.*` streams over the host memory the device backend shares.
pub fn host_engine<'c>(
    plan: &ExecPlan,
    memory: Arc<HostMemory<'c>>,
    options: &BackendOptions,
) -> Result<Box<dyn Backend + 'c>, BackendError> {
    Ok(Box::new(
        CpuBackend::over(plan, memory, options).map_err(setup_error)?,
    ))
}

impl<'c> CpuBackend<'c> {
    /// Allocates the plan's arenas, maps the weights image onto `checkpoint` and builds
    /// the compute pool.
    pub fn new(
        plan: &ExecPlan,
        checkpoint: &'c Checkpoint,
        options: &BackendOptions,
    ) -> Result<Self, CpuSetupError> {
        let memory = HostMemory::new(plan, checkpoint, options)?;
        let mut laps = Laps::start();
        let mut backend = Self::over(plan, Arc::new(memory), options)?;
        laps.lap("rope table and compute pool");
        backend.setup = backend.memory.setup_phases().to_vec();
        backend.setup.extend(laps.into_phases());
        Ok(backend)
    }

    /// The CPU backend over host memory another backend shares: a device backend's host
    /// side, running its plan's `cpu.compute` and `cpu.copy` tasks (`runtime::registry`
    /// wires it in; with [`HostMemory::host_side`] there is no `gpu` arena here).
    pub fn over(
        plan: &ExecPlan,
        memory: Arc<HostMemory<'c>>,
        options: &BackendOptions,
    ) -> Result<Self, CpuSetupError> {
        let arch = ArchSpec::from_card(&plan.model);
        let rope = RopeTable::for_arch(&arch, arch.max_positions);
        let threads = options.threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("moec-compute-{i}"))
            .build()
            .map_err(|e| CpuSetupError::Pool(e.to_string()))?;
        Ok(CpuBackend {
            memory,
            arch,
            rope,
            pool,
            threads,
            setup: Vec::new(),
        })
    }

    /// Threads of the shared compute pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn ops<'s>(&'s self, state: &'s dyn StepContext) -> OpContext<'s> {
        OpContext {
            arch: &self.arch,
            rope: &self.rope,
            memory: &self.memory,
            state,
        }
    }
}

fn task_error(e: impl std::error::Error + Send + Sync + 'static) -> BackendError {
    BackendError::Task(Box::new(e))
}

impl Backend for CpuBackend<'_> {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            asynchronous: false,
            device_events: false,
            pinned_host: self.memory.pinned_locked(),
            maps_weights: true,
        }
    }

    fn describe(&self) -> String {
        match self.memory.tiling() {
            Some(tiles) => format!("{}; {tiles}", pool_split(self.threads)),
            None => pool_split(self.threads),
        }
    }

    fn setup_phases(&self) -> Vec<LoadPhase> {
        self.setup.clone()
    }

    fn memory(&self) -> MemoryReport {
        let (arena_bytes, image_bytes) = self.memory.sizes();
        MemoryReport {
            arena_bytes,
            image_bytes,
            pinned_locked: self.memory.pinned_locked(),
            copies: (self.memory.weight_copies() == WeightCopies::Bind)
                .then(|| self.memory.copy_totals()),
            populated: self.memory.populated(),
            tiled: self.memory.tiled_bytes(),
            disk: self.memory.disk_totals(),
            substituted: (!self.memory.converted_formats().is_empty())
                .then(|| self.memory.substituted_experts()),
        }
    }

    fn run(
        &self,
        _stream: StreamId,
        engine: Engine,
        task: &PlanTask,
        state: &dyn StepContext,
    ) -> Result<(), BackendError> {
        let ops = self.ops(state);
        let run = || ops.run(task).map_err(task_error);
        match engine {
            Engine::GpuCompute | Engine::CpuCompute => self.pool.install(run),
            Engine::GpuCopyIn | Engine::GpuCopyOut | Engine::CpuCopy | Engine::DiskRead => run(),
        }
    }

    fn copy_runs(
        &self,
        _stream: StreamId,
        engine: Engine,
        task: &PlanTask,
        runs: &[(u64, u64)],
        state: &dyn StepContext,
    ) -> Result<(), BackendError> {
        let (src, dst) = self
            .memory
            .copy_views(task, state, self.arch.experts as u32)
            .map_err(task_error)?;
        // On the calling stream thread, as every copy (module docs).
        self.memory
            .copy_runs(engine, src, dst, runs)
            .map_err(task_error)
    }

    fn record(&self, _stream: StreamId, _event: EventId) -> Result<(), BackendError> {
        Ok(())
    }

    fn wait(&self, _stream: StreamId, _event: EventId) -> Result<(), BackendError> {
        Ok(())
    }

    fn read_routing(
        &self,
        _stream: StreamId,
        gate: &PlanTask,
        route: &PlanArg,
        tokens: usize,
        top_k: usize,
    ) -> Result<Routing, BackendError> {
        let view = self.memory.view(gate, route, None).map_err(task_error)?;
        // SAFETY: the read-back runs on the gate's stream right after the gate, before
        // any event that would let another task overwrite `route`; nothing writes these
        // bytes concurrently.
        let bytes = unsafe { self.memory.bytes(view) }.map_err(task_error)?;
        Ok(decode_routing(bytes, tokens, top_k)?)
    }

    fn finish_step(&self) -> Result<Option<Vec<DeviceTime>>, BackendError> {
        Ok(None)
    }
}
