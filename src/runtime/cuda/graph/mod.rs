//! CUDA graphs for steps with no host decision inside them: a step's device commands are
//! recorded as data while its tasks run, then submitted at the step's end as one graph.
//!
//! Takes the commands the ops issue through [`super::launch::StreamCx`] (kernel launches
//! with their arguments, GEMMs, copies, memsets) and the plan's cross-stream event records
//! and waits, in the order the stream threads issue them; gives, at [`Recorder::finish`],
//! the step's work on the device and how it got there ([`GraphUse`]). A step whose
//! commands equal, argument for argument, those of a captured graph replays that graph
//! (`cuGraphLaunch`); a step whose commands equal the previous plain step's is captured
//! (`cuStreamBeginCapture` on the first stream, the others forked from it and joined back,
//! the commands replayed into the capture, `cuStreamEndCapture`, instantiate) and launched;
//! otherwise the commands are submitted one by one, as without graphs. The key is the
//! commands themselves, so a replay computes exactly what the launches would: every
//! pointer, size and scalar is compared, and a step whose scratch or staging addresses
//! moved is not replayed. Data that changes per step (token ids, positions, block tables)
//! is written by the host into pinned staging at the same offsets every step and copied to
//! the device by a captured copy, so the graph reads the new step's values. Read-backs the
//! step needs (sampled ids, logits) are captured copies into pinned staging, handed to the
//! step state after the graph has run ([`Deferred`]).
//!
//! Guarantees: no command is lost or reordered: when an op needs the host inside a
//! recording step (a routing read-back, a pageable copy), [`Recorder::flush`] submits
//! every command recorded so far in issue order and the rest of the step runs plainly,
//! and the step is reported as launched plainly with that reason (never a silent
//! fallback). Staging buffers live as long as the backend (graphs hold their addresses).

use super::launch::{Arg, LaunchError};
use crate::records::GraphUse;
use crate::runtime::sync::lock;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    result, sys, CudaEvent, CudaFunction, CudaGraph, CudaStream, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;

mod host;
mod plan;
mod replay;
pub use host::{HostCalls, HostNode};
pub use plan::{guard_decided_on_device, plan_graph, HostRole, StepPlanGraph};
pub use replay::{replay_io_by_host_functions, Launched, ReplayPlan, SeqShape, StepKey};
use std::sync::{Arc, Mutex};

/// A GEMM as the ops issue it: bf16 weights times a bf16 pair into f32 (`cublasGemmEx`), or
/// f32 throughout (`cublasSgemm`); column-major, B never transposed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// `cublasGemmEx` with bf16 A and B and f32 C; else `cublasSgemm`.
    pub bf16: bool,
    /// A transposed.
    pub transa: bool,
    /// Rows of C.
    pub m: i32,
    /// Columns of C.
    pub n: i32,
    /// Inner dimension.
    pub k: i32,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C before adding.
    pub beta: f32,
    /// A and its leading dimension.
    pub a: (u64, i32),
    /// B and its leading dimension.
    pub b: (u64, i32),
    /// C and its leading dimension.
    pub c: (u64, i32),
}

/// One device command of a step.
#[derive(Debug, Clone)]
pub enum Command {
    /// A kernel launch.
    Launch {
        /// The kernel's entry name.
        entry: &'static str,
        /// The loaded function.
        func: CudaFunction,
        /// Grid.
        grid: (u32, u32, u32),
        /// Threads per block.
        block: u32,
        /// Dynamic shared memory bytes.
        shared: u32,
        /// Arguments in the kernel's order.
        args: Vec<Arg>,
    },
    /// A cuBLAS GEMM on the stream's handle.
    Gemm(Gemm),
    /// Pinned host to device.
    HtoD {
        /// Device destination.
        dst: u64,
        /// Pinned host source.
        src: usize,
        /// Bytes.
        bytes: usize,
    },
    /// Device to pinned host.
    DtoH {
        /// Pinned host destination.
        dst: usize,
        /// Device source.
        src: u64,
        /// Bytes.
        bytes: usize,
    },
    /// Device to device.
    DtoD {
        /// Destination.
        dst: u64,
        /// Source.
        src: u64,
        /// Bytes.
        bytes: usize,
    },
    /// Zero bytes.
    Zero {
        /// Destination.
        dst: u64,
        /// Bytes.
        bytes: usize,
    },
    /// Fill bytes with 0xFF (an f32 NaN): scratch handed out under
    /// `MOEC_CUDA_POISON_SCRATCH` ([`super::launch::StreamCx::scratch`]).
    Poison {
        /// Destination.
        dst: u64,
        /// Bytes.
        bytes: usize,
    },
    /// Record a plan event.
    Record(usize),
    /// Wait for a plan event.
    Wait(usize),
    /// A host stream's task as a host function on its host lane (a host node of a
    /// captured graph, [`HostNode`]).
    Host(Arc<HostNode>),
}

fn arg_bits(a: &Arg) -> (u8, u64) {
    match *a {
        Arg::Ptr(p) => (0, p),
        Arg::I32(v) => (1, v as u32 as u64),
        Arg::I64(v) => (2, v as u64),
        Arg::F32(v) => (3, u64::from(v.to_bits())),
    }
}

impl Command {
    /// Whether two commands do exactly the same (floats compared by bits).
    fn same(&self, other: &Command) -> bool {
        use Command as C;
        match (self, other) {
            (
                C::Launch {
                    entry: e1,
                    grid: g1,
                    block: b1,
                    shared: s1,
                    args: a1,
                    ..
                },
                C::Launch {
                    entry: e2,
                    grid: g2,
                    block: b2,
                    shared: s2,
                    args: a2,
                    ..
                },
            ) => {
                e1 == e2
                    && g1 == g2
                    && b1 == b2
                    && s1 == s2
                    && a1.len() == a2.len()
                    && a1.iter().zip(a2).all(|(x, y)| arg_bits(x) == arg_bits(y))
            }
            (C::Gemm(x), C::Gemm(y)) => {
                x.alpha.to_bits() == y.alpha.to_bits()
                    && x.beta.to_bits() == y.beta.to_bits()
                    && x == y
            }
            (
                C::HtoD { dst, src, bytes },
                C::HtoD {
                    dst: d,
                    src: s,
                    bytes: b,
                },
            ) => (dst, src, bytes) == (d, s, b),
            (
                C::DtoH { dst, src, bytes },
                C::DtoH {
                    dst: d,
                    src: s,
                    bytes: b,
                },
            ) => (dst, src, bytes) == (d, s, b),
            (
                C::DtoD { dst, src, bytes },
                C::DtoD {
                    dst: d,
                    src: s,
                    bytes: b,
                },
            ) => (dst, src, bytes) == (d, s, b),
            (C::Zero { dst, bytes }, C::Zero { dst: d, bytes: b })
            | (C::Poison { dst, bytes }, C::Poison { dst: d, bytes: b }) => (dst, bytes) == (d, b),
            (C::Record(a), C::Record(b)) | (C::Wait(a), C::Wait(b)) => a == b,
            (C::Host(a), C::Host(b)) => a.stream == b.stream && a.task.id == b.task.id,
            _ => false,
        }
    }

    /// Submits the command on `stream` (its cuBLAS handle `blas`, none on a host lane;
    /// `events`: the plan's).
    pub fn submit(
        &self,
        stream: &Arc<CudaStream>,
        blas: Option<&CudaBlas>,
        events: &[Arc<CudaEvent>],
    ) -> Result<(), LaunchError> {
        let driver = |call| move |source| LaunchError::Driver { call, source };
        let cu = stream.cu_stream();
        match self {
            Command::Launch {
                entry,
                func,
                grid,
                block,
                shared,
                args,
            } => {
                let mut builder = stream.launch_builder(func);
                for a in args {
                    match a {
                        Arg::Ptr(p) => builder.arg(p),
                        Arg::I32(v) => builder.arg(v),
                        Arg::I64(v) => builder.arg(v),
                        Arg::F32(v) => builder.arg(v),
                    };
                }
                let cfg = LaunchConfig {
                    grid_dim: *grid,
                    block_dim: (*block, 1, 1),
                    shared_mem_bytes: *shared,
                };
                // SAFETY: each op issues the arguments of the kernel's signature in order
                // (pointers as 8-byte device addresses, ints and floats by value), with
                // pointers to buffers at least as large as the launch touches (sizes
                // checked by the op); the buffers outlive the step (arenas, the stream's
                // workspace, kept until the step's end).
                unsafe { builder.launch(cfg) }
                    .map(|_| ())
                    .map_err(driver(entry))
            }
            Command::Gemm(g) => match blas {
                Some(blas) => gemm(blas, g),
                None => Err(LaunchError::Capture("a GEMM on a host lane")),
            },
            // SAFETY (the four copies): the op checked every range against its buffer;
            // pinned sources and destinations are staging or arena bytes that live until
            // the step's work has finished.
            Command::HtoD { dst, src, bytes } => unsafe {
                sys::cuMemcpyHtoDAsync_v2(*dst, *src as *const std::ffi::c_void, *bytes, cu)
                    .result()
                    .map_err(driver("cuMemcpyHtoDAsync"))
            },
            Command::DtoH { dst, src, bytes } => unsafe {
                sys::cuMemcpyDtoHAsync_v2(*dst as *mut std::ffi::c_void, *src, *bytes, cu)
                    .result()
                    .map_err(driver("cuMemcpyDtoHAsync"))
            },
            Command::DtoD { dst, src, bytes } => unsafe {
                result::memcpy_dtod_async(*dst, *src, *bytes, cu)
                    .map_err(driver("cuMemcpyDtoDAsync"))
            },
            Command::Zero { dst, bytes } => unsafe {
                result::memset_d8_async(*dst, 0, *bytes, cu).map_err(driver("cuMemsetD8Async"))
            },
            Command::Poison { dst, bytes } => unsafe {
                result::memset_d8_async(*dst, 0xFF, *bytes, cu).map_err(driver("cuMemsetD8Async"))
            },
            Command::Record(e) => match events.get(*e) {
                Some(ev) => ev.record(stream).map_err(driver("cuEventRecord")),
                None => Ok(()),
            },
            Command::Wait(e) => match events.get(*e) {
                Some(ev) => stream.wait(ev).map_err(driver("cuStreamWaitEvent")),
                None => Ok(()),
            },
            // SAFETY: the function runs the node at `data` (its contract), which lives as
            // long as the recorder that interned it (`Recorder::host_node`), and the
            // backend synchronises every lane before dropping the recorder.
            Command::Host(node) => unsafe {
                sys::cuLaunchHostFunc(cu, Some(node.function()), node.data())
                    .result()
                    .map_err(driver("cuLaunchHostFunc"))
            },
        }
    }
}

fn gemm(handle: &CudaBlas, g: &Gemm) -> Result<(), LaunchError> {
    let h = *handle.handle();
    let transa = if g.transa {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    };
    let n_op = cublasOperation_t::CUBLAS_OP_N;
    let err = |call| move |source| LaunchError::Blas { call, source };
    if g.bf16 {
        // SAFETY: A is m x k bf16 (lda as stored), B k x n bf16, C m x n f32, all inside
        // their buffers (the op sized them); the scalars are host f32 (the handle's
        // default pointer mode) as CUBLAS_COMPUTE_32F requires.
        unsafe {
            blas::gemm_ex(
                h,
                transa,
                n_op,
                g.m,
                g.n,
                g.k,
                (&g.alpha as *const f32).cast(),
                g.a.0 as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                g.a.1,
                g.b.0 as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                g.b.1,
                (&g.beta as *const f32).cast(),
                g.c.0 as *mut std::ffi::c_void,
                cudaDataType_t::CUDA_R_32F,
                g.c.1,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(err("cublasGemmEx"))
    } else {
        // SAFETY: A is m x k f32, B k x n f32, C m x n f32 with their leading dimensions,
        // inside their buffers; scalars are host f32.
        unsafe {
            blas::sgemm(
                h,
                transa,
                n_op,
                g.m,
                g.n,
                g.k,
                &g.alpha,
                g.a.0 as *const f32,
                g.a.1,
                g.b.0 as *const f32,
                g.b.1,
                &g.beta,
                g.c.0 as *mut f32,
                g.c.1,
            )
        }
        .map_err(err("cublasSgemm"))
    }
}

/// A read-back of a recorded step, handed to the step state after its work has run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deferred {
    /// `count` sampled ids (u32) of micro-batch `ub` at staging address `at`.
    Sampled {
        /// Micro-batch.
        ub: u32,
        /// Pinned address.
        at: usize,
        /// Ids.
        count: usize,
        /// The device tokens buffer they were sampled into.
        dst: u64,
    },
    /// `count` logits (f32) of micro-batch `ub` at staging address `at`.
    Logits {
        /// Micro-batch.
        ub: u32,
        /// Pinned address.
        at: usize,
        /// Floats.
        count: usize,
    },
}

impl Deferred {
    /// The staging bytes it reads: (address, length).
    pub fn range(&self) -> (usize, usize) {
        match *self {
            Deferred::Sampled { at, count, .. } | Deferred::Logits { at, count, .. } => {
                (at, 4 * count)
            }
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
#[derive(Debug)]
struct Pinned {
    ptr: usize,
    len: usize,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed once; the backend synchronised
        // its streams (every copy from or to it finished) before dropping the recorder.
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Bump-allocated pinned staging, reset per step; grown buffers are kept (graphs read
/// their addresses). Every step walks the buffers from the first, in order, moving to the
/// next when a piece does not fit the rest of the current one, so a step that takes the
/// same sizes in the same order as an earlier step gets the same addresses, including
/// the step that grew the staging (its last buffer is where the next step finds it).
/// Bumping only in the newest buffer instead would give the step after a growth other
/// addresses than the step that grew it (its first pieces moved from the old buffer to
/// the new), so that pair of steps never matched: with `--dump-logits` (a read-back of
/// the vocabulary's logits, larger than the first buffer) the first two decode steps
/// were both plain and a 4-token run captured a graph but never replayed one.
#[derive(Debug, Default)]
struct Staging {
    buffers: Vec<Pinned>,
    /// The buffer pieces are taken from now.
    current: usize,
    /// Bytes of `buffers[current]` taken this step.
    used: usize,
}

const STAGING_ALIGN: usize = 64;

impl Staging {
    /// Starts a step: pieces come from the first buffer again.
    fn reset(&mut self) {
        self.current = 0;
        self.used = 0;
    }

    fn take(&mut self, bytes: usize) -> Result<usize, LaunchError> {
        let bytes = bytes.max(1).next_multiple_of(STAGING_ALIGN);
        loop {
            match self.buffers.get(self.current) {
                Some(b) if self.used + bytes <= b.len => {
                    let at = b.ptr + self.used;
                    self.used += bytes;
                    return Ok(at);
                }
                Some(_) if self.current + 1 < self.buffers.len() => {
                    self.current += 1;
                    self.used = 0;
                }
                _ => break,
            }
        }
        let len = (2 * self.buffers.last().map_or(0, |b| b.len))
            .max(bytes)
            .max(64 << 10);
        // SAFETY: a plain page-locked allocation; freed by `Pinned::drop`.
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(|source| LaunchError::Driver {
            call: "cuMemHostAlloc",
            source,
        })?;
        self.buffers.push(Pinned {
            ptr: ptr as usize,
            len,
        });
        self.current = self.buffers.len() - 1;
        self.used = bytes;
        Ok(ptr as usize)
    }
}

/// How the current step submits its device work.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// As issued (not a graph step), for this reason.
    Plain(String),
    /// Recorded for a graph.
    Recording,
    /// Recording stopped: everything recorded was submitted, the rest goes as issued.
    Flushed(String),
}

/// A captured graph and the commands it was captured from.
struct Cached {
    commands: Vec<(usize, Command)>,
    graph: CudaGraph,
    /// What a step needs of the host to launch this graph without running its ops
    /// ([`Recorder::replay_plan`]), from the last step that ran its ops into exactly these
    /// commands.
    replay: ReplayPlan,
}

/// The graphs of a backend, newest last.
#[derive(Default)]
struct Graphs(Vec<Cached>);

// SAFETY: a `CudaGraph` is not internally synchronised; it is only touched under the
// recorder's mutex (`Recorder::finish`), one thread at a time.
unsafe impl Send for Graphs {}

/// Most graphs kept: a decode step's shape changes when sequences end, and each shape is
/// one graph.
const MAX_GRAPHS: usize = 16;

struct State {
    mode: Mode,
    commands: Vec<(usize, Command)>,
    /// The shape of the current step, when the backend gave one.
    key: Option<StepKey>,
    /// Counts steps that ran their ops into commands no cached graph holds (plain,
    /// flushed or captured): such a step may have grown and freed a workspace buffer an
    /// older graph reads, so a graph is launched without its ops only while the epoch is
    /// the one its commands were last produced in.
    epoch: u64,
    /// Per lane, the micro-batch whose step-inputs pack the lane's next staging is.
    pack_notes: HashMap<usize, u32>,
    /// This step's staged packs (address, micro-batch, bytes) and other staged pieces.
    packs: Vec<(usize, u32, usize)>,
    other_stages: usize,
    /// This step's `embed` reads of sampled ids on the device.
    device_ids: Vec<(u32, u64)>,
    /// Graph launches whose read-backs are not collected yet.
    in_flight: usize,
    /// What launches without ops keep between steps (staging words, read-back ring).
    replay: replay::ReplayState,
    /// The step must issue its graph's commands (`MOEC_CUDA_VERIFY_REPLAY`).
    verify: bool,
    /// Per stream (lane): each stream's staging offsets follow its own commands only, so
    /// they do not depend on how the stream threads interleave.
    staging: Vec<Staging>,
    deferred: Vec<Deferred>,
    graphs: Graphs,
    /// Per step index, the commands of its last plain step (a repeat is captured).
    last_plain: HashMap<usize, Vec<(usize, Command)>>,
}

impl State {
    fn staging_of(&mut self, lane: usize) -> &mut Staging {
        if self.staging.len() <= lane {
            self.staging.resize_with(lane + 1, Staging::default);
        }
        &mut self.staging[lane]
    }
}

/// A stream as the recorder submits to it: a device stream, or a host stream's host lane
/// (the CUDA stream its host nodes and their event waits and records go to).
#[derive(Debug, Clone)]
pub struct Lane {
    /// The stream.
    pub stream: Arc<CudaStream>,
    /// Its cuBLAS handle (`None` on a host lane).
    pub blas: Option<Arc<CudaBlas>>,
}

/// The step recorder of one backend (see the module doc).
pub struct Recorder {
    state: Mutex<State>,
    /// By plan stream index: device streams, and host streams' host lanes.
    lanes: Vec<Option<Lane>>,
    /// The plan's events.
    events: Vec<Arc<CudaEvent>>,
    /// Fork (index 0) and one join per lane, for captures over several streams.
    fork_join: Vec<CudaEvent>,
    /// What host nodes run over.
    host_calls: Arc<HostCalls>,
    /// Every host node made, by (stream, task): a submitted host function's data lives
    /// as long as the recorder.
    host_nodes: Mutex<HashMap<(usize, usize), Arc<HostNode>>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("lanes", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

impl Recorder {
    /// A recorder over the plan's device streams and events; `fork_join` holds at least
    /// one event per stream plus one.
    pub fn new(
        lanes: Vec<Option<Lane>>,
        events: Vec<Arc<CudaEvent>>,
        fork_join: Vec<CudaEvent>,
    ) -> Self {
        Recorder {
            state: Mutex::new(State {
                mode: Mode::Plain(String::new()),
                commands: Vec::new(),
                staging: Vec::new(),
                deferred: Vec::new(),
                graphs: Graphs::default(),
                last_plain: HashMap::new(),
                key: None,
                epoch: 0,
                pack_notes: HashMap::new(),
                packs: Vec::new(),
                other_stages: 0,
                device_ids: Vec::new(),
                in_flight: 0,
                replay: replay::ReplayState::default(),
                verify: false,
            }),
            lanes,
            events,
            fork_join,
            host_calls: Arc::default(),
            host_nodes: Mutex::default(),
        }
    }

    /// What the host nodes run over.
    pub fn host_calls(&self) -> &HostCalls {
        &self.host_calls
    }

    /// Task `task` of host stream `stream` as a host node (made once, kept as long as the
    /// recorder).
    pub fn host_node(
        &self,
        stream: crate::ir::StreamId,
        task: &crate::lower::PlanTask,
    ) -> Arc<HostNode> {
        let mut nodes = lock(&self.host_nodes);
        Arc::clone(
            nodes
                .entry((stream.index(), task.id.index()))
                .or_insert_with(|| {
                    Arc::new(HostNode::new(Arc::clone(&self.host_calls), stream, task))
                }),
        )
    }

    /// Waits for every lane's work (device streams and host lanes).
    pub fn synchronize(&self) -> Result<(), LaunchError> {
        for lane in self.lanes.iter().flatten() {
            lane.stream
                .synchronize()
                .map_err(|source| LaunchError::Driver {
                    call: "cuStreamSynchronize",
                    source,
                })?;
        }
        Ok(())
    }

    /// Starts a step: recorded for a graph (`None`) or submitted as issued, for a reason;
    /// `key`: its shape, when known.
    pub fn begin(&self, plain: Option<String>, key: Option<StepKey>) {
        let mut s = lock(&self.state);
        s.mode = match plain {
            Some(why) => Mode::Plain(why),
            None => Mode::Recording,
        };
        s.key = key;
        s.verify = false;
        s.commands.clear();
        s.deferred.clear();
        s.pack_notes.clear();
        s.packs.clear();
        s.other_stages = 0;
        s.device_ids.clear();
        s.replay.forget_staging();
        for st in &mut s.staging {
            st.reset();
        }
    }

    /// Whether the step is being recorded.
    pub fn recording(&self) -> bool {
        lock(&self.state).mode == Mode::Recording
    }

    /// Records `command` on `lane` if the step is being recorded; gives it back otherwise
    /// (the caller submits it now).
    pub fn record(&self, lane: usize, command: Command) -> Option<Command> {
        let mut s = lock(&self.state);
        if s.mode != Mode::Recording {
            return Some(command);
        }
        s.commands.push((lane, command));
        None
    }

    /// `data` copied into `lane`'s pinned staging, when the step is being recorded: its
    /// address.
    pub fn stage(&self, lane: usize, data: &[u8]) -> Result<Option<usize>, LaunchError> {
        let mut s = lock(&self.state);
        if s.mode != Mode::Recording {
            return Ok(None);
        }
        let at = s.staging_of(lane).take(data.len())?;
        match s.pack_notes.remove(&lane) {
            Some(ub) => s.packs.push((at, ub, data.len())),
            None => s.other_stages += 1,
        }
        // SAFETY: `at` starts `data.len()` bytes of a live pinned buffer that no queued
        // work touches: the previous step's work finished at its end (or, for a step
        // launched ahead, its graph and the host function that read its staging are
        // ordered before this step's submission, `launch_replay`), and this step's copies
        // from it are submitted after this write.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at as *mut u8, data.len()) };
        Ok(Some(at))
    }

    /// The next bytes `lane` stages, if any before [`Recorder::end_pack`], are micro-batch
    /// `ub`'s step-inputs pack (`StepInputs::of` its state), which a replay can write again.
    pub fn begin_pack(&self, lane: usize, ub: u32) {
        lock(&self.state).pack_notes.insert(lane, ub);
    }

    /// Ends [`Recorder::begin_pack`] (the pack was already on the device: nothing staged).
    pub fn end_pack(&self, lane: usize) {
        lock(&self.state).pack_notes.remove(&lane);
    }

    /// This step could launch its shape's graph without its ops: its commands must be the
    /// graph's, or [`Recorder::finish`] fails (`MOEC_CUDA_VERIFY_REPLAY`).
    pub fn verify_step(&self) {
        lock(&self.state).verify = true;
    }

    /// `embed` of micro-batch `ub` reads its ids in device buffer `at`, where the last
    /// `sample` left them (a replay needs them there again).
    pub fn note_device_ids(&self, ub: u32, at: u64) {
        let mut s = lock(&self.state);
        if s.mode == Mode::Recording {
            s.device_ids.push((ub, at));
        }
    }

    /// Pinned staging of `bytes` for a read-back, when the step is being recorded; the
    /// caller records the copy into it and `then` is handed to the state at the step's end.
    pub fn read_back(
        &self,
        lane: usize,
        bytes: usize,
        then: impl FnOnce(usize) -> Deferred,
    ) -> Result<Option<usize>, LaunchError> {
        let mut s = lock(&self.state);
        if s.mode != Mode::Recording {
            return Ok(None);
        }
        let at = s.staging_of(lane).take(bytes)?;
        s.deferred.push(then(at));
        Ok(Some(at))
    }

    /// Stops recording: submits every recorded command in issue order; the rest of the
    /// step goes as issued, and the step is reported plain because of `why`.
    pub fn flush(&self, why: &str) -> Result<(), LaunchError> {
        let mut s = lock(&self.state);
        if s.mode != Mode::Recording {
            return Ok(());
        }
        let commands = std::mem::take(&mut s.commands);
        s.mode = Mode::Flushed(why.to_string());
        self.submit_all(&commands)?;
        if commands.iter().any(|c| matches!(c.1, Command::Host(_))) {
            // The rest of the step runs its host tasks on the host: the host nodes
            // submitted here run first, and within this call (the step's state is open
            // to them only while the step is).
            self.synchronize()?;
        }
        Ok(())
    }

    fn lane(&self, lane: usize) -> Option<&Lane> {
        self.lanes.get(lane).and_then(Option::as_ref)
    }

    fn submit_all(&self, commands: &[(usize, Command)]) -> Result<(), LaunchError> {
        for (lane, c) in commands {
            if let Some(l) = self.lane(*lane) {
                c.submit(&l.stream, l.blas.as_deref(), &self.events)?;
            }
        }
        Ok(())
    }

    /// Ends step `step`: submits what it recorded (replaying, capturing or one by one)
    /// and gives how, with the read-backs to hand over once the streams are synchronised.
    /// Called on the driver's thread after every stream thread of the step has ended.
    /// The flag is whether the step was checked against its graph
    /// ([`Recorder::verify_step`]).
    pub fn finish(&self, step: usize) -> Result<(GraphUse, Vec<Deferred>, bool), LaunchError> {
        let mut s = lock(&self.state);
        let deferred = std::mem::take(&mut s.deferred);
        let verify = std::mem::take(&mut s.verify);
        if verify {
            let key = s.key.clone();
            let epoch = s.epoch;
            let graph = s.graphs.0.iter().rev().find(|c| {
                c.replay.key.is_some()
                    && c.replay.key == key
                    && c.replay.epoch == epoch
                    && c.replay.other_stages == 0
            });
            match graph {
                Some(c) if same_work(&c.commands, &s.commands) => {}
                _ => {
                    return Err(LaunchError::Capture(
                        "MOEC_CUDA_VERIFY_REPLAY: a step of a captured graph's shape issued \
                         other commands than the graph (the step key misses an input)",
                    ))
                }
            }
        }
        let (graph, deferred) = self.finish_mode(&mut s, step, deferred)?;
        Ok((graph, deferred, verify))
    }

    fn finish_mode(
        &self,
        s: &mut State,
        step: usize,
        deferred: Vec<Deferred>,
    ) -> Result<(GraphUse, Vec<Deferred>), LaunchError> {
        let mode = std::mem::replace(&mut s.mode, Mode::Plain(String::new()));
        match mode {
            Mode::Plain(why) | Mode::Flushed(why) => {
                s.epoch += 1;
                Ok((GraphUse::Plain(why), deferred))
            }
            Mode::Recording => {
                let commands = std::mem::take(&mut s.commands);
                self.submit_recorded(s, step, commands, deferred)
            }
        }
    }

    fn submit_recorded(
        &self,
        s: &mut State,
        step: usize,
        commands: Vec<(usize, Command)>,
        deferred: Vec<Deferred>,
    ) -> Result<(GraphUse, Vec<Deferred>), LaunchError> {
        let equal = |a: &[(usize, Command)], b: &[(usize, Command)]| same_work(a, b);
        if commands.is_empty() {
            s.epoch += 1;
            return Ok((GraphUse::Plain("no device work".into()), deferred));
        }
        let replay = ReplayPlan {
            key: s.key.clone(),
            epoch: s.epoch,
            packs: std::mem::take(&mut s.packs),
            other_stages: s.other_stages,
            sources: deferred
                .iter()
                .map(|d| {
                    commands.iter().find_map(|(_, c)| match c {
                        Command::DtoH { dst, src, .. } if *dst == d.range().0 => Some(*src),
                        _ => None,
                    })
                })
                .collect(),
            deferred: deferred.clone(),
            device_ids: std::mem::take(&mut s.device_ids),
            origin: commands.first().map_or(0, |c| c.0),
        };
        if let Some(c) = s
            .graphs
            .0
            .iter_mut()
            .find(|c| equal(&c.commands, &commands))
        {
            c.graph.launch().map_err(|source| LaunchError::Driver {
                call: "cuGraphLaunch",
                source,
            })?;
            // This step's ops produced exactly the graph's commands now: the plan for
            // launching it without them is this step's (same addresses, this epoch).
            c.replay = replay;
            return Ok((GraphUse::Replayed, deferred));
        }
        s.epoch += 1;
        let repeat = s
            .last_plain
            .get(&step)
            .is_some_and(|last| equal(last, &commands));
        if !repeat {
            self.submit_all(&commands)?;
            let why = match s.last_plain.get(&step) {
                None => {
                    "the first step with these launches (a graph is captured when the next step repeats them)"
                        .to_string()
                }
                Some(last) => format!(
                    "its launches differ from the previous step's ({})",
                    first_difference(last, &commands)
                ),
            };
            s.last_plain.insert(step, commands);
            return Ok((GraphUse::Plain(why), deferred));
        }
        match self.capture(&commands) {
            Ok(graph) => {
                graph.launch().map_err(|source| LaunchError::Driver {
                    call: "cuGraphLaunch",
                    source,
                })?;
                if s.graphs.0.len() >= MAX_GRAPHS {
                    s.graphs.0.remove(0);
                }
                s.graphs.0.push(Cached {
                    commands,
                    graph,
                    replay: ReplayPlan {
                        epoch: s.epoch,
                        ..replay
                    },
                });
                s.last_plain.remove(&step);
                Ok((GraphUse::Captured, deferred))
            }
            Err(e) => {
                // Nothing of a failed capture ran: the commands go one by one.
                self.submit_all(&commands)?;
                Ok((
                    GraphUse::Plain(format!("capturing its graph failed: {e}")),
                    deferred,
                ))
            }
        }
    }

    /// Captures `commands` into a graph: the first command's stream begins the capture,
    /// every other stream used forks from it and joins back at the end.
    fn capture(&self, commands: &[(usize, Command)]) -> Result<CudaGraph, LaunchError> {
        let driver = |call| move |source| LaunchError::Driver { call, source };
        let origin_lane = commands.first().map_or(0, |c| c.0);
        let origin = self.lane(origin_lane).ok_or(LaunchError::Capture(
            "its first command is on no device stream",
        ))?;
        let mut others: Vec<usize> = commands
            .iter()
            .map(|c| c.0)
            .filter(|&l| l != origin_lane)
            .collect();
        others.sort_unstable();
        others.dedup();
        let fork = self
            .fork_join
            .first()
            .ok_or(LaunchError::Capture("no fork event"))?;
        origin
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("cuStreamBeginCapture"))?;
        let body = || -> Result<(), LaunchError> {
            fork.record(&origin.stream)
                .map_err(driver("cuEventRecord"))?;
            for &l in &others {
                if let Some(lane) = self.lane(l) {
                    lane.stream
                        .wait(fork)
                        .map_err(driver("cuStreamWaitEvent"))?;
                }
            }
            self.submit_all(commands)?;
            for (i, &l) in others.iter().enumerate() {
                let (Some(lane), Some(join)) = (self.lane(l), self.fork_join.get(1 + i)) else {
                    return Err(LaunchError::Capture("no join event for a stream"));
                };
                join.record(&lane.stream).map_err(driver("cuEventRecord"))?;
                origin
                    .stream
                    .wait(join)
                    .map_err(driver("cuStreamWaitEvent"))?;
            }
            Ok(())
        };
        let recorded = body();
        // The capture is ended whatever happened, so the streams leave capture mode.
        let ended = origin
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("cuStreamEndCapture"));
        recorded?;
        ended?.ok_or(LaunchError::Capture("the capture was empty"))
    }
}

/// Each stream's commands, in issue order, by stream index.
fn by_lane(commands: &[(usize, Command)]) -> Vec<Vec<&Command>> {
    let mut lanes: Vec<Vec<&Command>> = Vec::new();
    for (lane, c) in commands {
        if lanes.len() <= *lane {
            lanes.resize_with(lane + 1, Vec::new);
        }
        lanes[*lane].push(c);
    }
    lanes
}

/// Whether two steps' commands do the same work: each stream's commands equal in order.
/// How the stream threads interleaved them does not matter: a plan event is recorded once
/// per step, so each wait binds to the same record whatever the interleaving (and every
/// submission keeps its own step's order, in which each record precedes its waits).
fn same_work(a: &[(usize, Command)], b: &[(usize, Command)]) -> bool {
    let (a, b) = (by_lane(a), by_lane(b));
    let empty = Vec::new();
    (0..a.len().max(b.len())).all(|l| {
        let (x, y) = (a.get(l).unwrap_or(&empty), b.get(l).unwrap_or(&empty));
        x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.same(q))
    })
}

/// Where two steps' commands first differ, in words (which stream, which command and its
/// kernel or kind).
fn first_difference(a: &[(usize, Command)], b: &[(usize, Command)]) -> String {
    let (a, b) = (by_lane(a), by_lane(b));
    let empty = Vec::new();
    for l in 0..a.len().max(b.len()) {
        let (x, y) = (a.get(l).unwrap_or(&empty), b.get(l).unwrap_or(&empty));
        if let Some(at) = x.iter().zip(y).position(|(p, q)| !p.same(q)) {
            return format!("stream {l}, command {at}, {}", describe(y[at]));
        }
        if x.len() != y.len() {
            return format!("stream {l}: {} commands against {}", y.len(), x.len());
        }
    }
    "none".into()
}

fn describe(c: &Command) -> String {
    match c {
        Command::Launch { entry, .. } => format!("`{entry}`"),
        Command::Gemm(_) => "a GEMM".into(),
        Command::HtoD { .. } | Command::DtoH { .. } | Command::DtoD { .. } => "a copy".into(),
        Command::Zero { .. } | Command::Poison { .. } => "a memset".into(),
        Command::Record(_) | Command::Wait(_) => "an event".into(),
        Command::Host(node) => format!("host node `{}`", node.task.name),
    }
}

/// Native-endian `u32`s of `bytes` (sampled ids read back).
pub fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Native-endian `f32`s of `bytes` (logits read back).
pub fn floats(bytes: &[u8]) -> Vec<f32> {
    words(bytes).into_iter().map(f32::from_bits).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(m: i32) -> Command {
        Command::Gemm(Gemm {
            bf16: true,
            transa: true,
            m,
            n: 2,
            k: 8,
            alpha: 1.0,
            beta: 0.0,
            a: (0x1000, 8),
            b: (0x2000, 8),
            c: (0x3000, m),
        })
    }

    /// Two steps whose streams issued the same commands match however the stream threads
    /// interleaved them; one changed argument breaks the match, and the difference is
    /// named by stream, position and kind.
    #[test]
    fn steps_match_stream_by_stream_and_a_difference_is_named() {
        let copy = Command::HtoD {
            dst: 0x4000,
            src: 0x5000,
            bytes: 64,
        };
        let a = vec![
            (0, gemm(4)),
            (1, Command::Wait(0)),
            (0, Command::Record(0)),
            (1, copy.clone()),
        ];
        let b = vec![
            (0, gemm(4)),
            (0, Command::Record(0)),
            (1, Command::Wait(0)),
            (1, copy.clone()),
        ];
        assert!(same_work(&a, &b));
        let c = vec![
            (0, gemm(4)),
            (0, Command::Record(0)),
            (1, Command::Wait(0)),
            (
                1,
                Command::HtoD {
                    dst: 0x4000,
                    src: 0x5040,
                    bytes: 64,
                },
            ),
        ];
        assert!(!same_work(&a, &c));
        assert_eq!(first_difference(&a, &c), "stream 1, command 1, a copy");
        let d = vec![(0, gemm(8)), (0, Command::Record(0))];
        assert!(!same_work(&a, &d));
        assert_eq!(first_difference(&a, &d), "stream 0, command 0, a GEMM");
        assert!(!same_work(&a, &a[..3]));
    }

    /// Read-backs decode as native-endian words.
    #[test]
    fn read_backs_decode_as_native_words() {
        let bytes: Vec<u8> = [7u32, 1.5f32.to_bits()]
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .collect();
        assert_eq!(words(&bytes), vec![7, 1.5f32.to_bits()]);
        assert_eq!(floats(&bytes)[1], 1.5);
    }
}
