//! Launching a step's cached graph without running its ops: the host side a graph needs
//! ([`ReplayPlan`], keyed by the step's shape, [`StepKey`]), the launch that writes the
//! step's staged inputs and the read-backs' copies as host functions on the stream
//! ([`Recorder::launch_replay`]), and the hand-over of a launched step's read-backs
//! ([`Recorder::collect`]). Why a step of a cached shape may skip its ops is argued on
//! [`Recorder::replay_plan`].

use super::*;

/// A graph launched without its ops ([`Recorder::launch_replay`]), its read-backs not yet
/// handed over.
#[derive(Debug)]
pub struct Launched {
    /// Recorded after the graph (and the copy of its read-backs).
    done: CudaEvent,
    /// The read-backs' bytes as a host function copied them out of staging right after
    /// the graph (a launch that another may follow before it is collected).
    copied: Option<Arc<Mutex<Vec<Vec<u8>>>>>,
    /// Its read-backs.
    deferred: Vec<Deferred>,
}

/// Queues `f(data)` on stream `cu` (`cuLaunchHostFunc`): it runs on a driver thread once
/// the stream's earlier work has finished, and the stream's later work waits for it.
fn host_call<T>(
    cu: sys::CUstream,
    f: unsafe extern "C" fn(*mut std::ffi::c_void),
    data: Box<T>,
) -> Result<(), LaunchError> {
    let raw = Box::into_raw(data).cast::<std::ffi::c_void>();
    // SAFETY: `f` takes back ownership of `raw` (a `Box<T>` of the matching type) when it
    // runs, once; if the call is refused it never runs, so the box is reclaimed here.
    let r = unsafe { sys::cuLaunchHostFunc(cu, Some(f), raw) }.result();
    if let Err(source) = r {
        // SAFETY: the driver refused the call: `raw` is still ours, from `Box::into_raw`.
        drop(unsafe { Box::from_raw(raw.cast::<T>()) });
        return Err(LaunchError::Driver {
            call: "cuLaunchHostFunc",
            source,
        });
    }
    Ok(())
}

/// Host function: writes a launched-ahead step's inputs into pinned staging.
unsafe extern "C" fn write_staging(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `Box<Vec<(usize, Vec<u8>)>>` `launch_replay` gave `host_call`,
    // passed once.
    let inputs = unsafe { Box::from_raw(data.cast::<Vec<(usize, Vec<u8>)>>()) };
    for (at, bytes) in inputs.iter() {
        // SAFETY: each address starts a live staging piece of at least this many bytes;
        // the stream ran every earlier launch, whose graphs read it, before this call, and
        // runs the graph that reads the new bytes after it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *at as *mut u8, bytes.len()) };
    }
}

/// What [`copy_read_backs`] copies: staging ranges, and where their bytes go.
type ReadBackJob = (Vec<(usize, usize)>, Arc<Mutex<Vec<Vec<u8>>>>);

/// Host function: copies a step's read-backs out of pinned staging before the next
/// step's graph writes it again.
unsafe extern "C" fn copy_read_backs(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `Box<ReadBackJob>` `launch_replay` gave `host_call`, once.
    let job = unsafe { Box::from_raw(data.cast::<ReadBackJob>()) };
    let (ranges, slot) = *job;
    let bytes = ranges
        .iter()
        // SAFETY: each range is staging the step's graph copied into; the graph has run
        // (stream order) and the next launch's writes come after this call.
        .map(|&(at, len)| unsafe { std::slice::from_raw_parts(at as *const u8, len) }.to_vec())
        .collect();
    *lock(&slot) = bytes;
}

/// The host side of a cached graph: everything a step of the same shape must write or
/// read so that launching the graph alone does what running its ops would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayPlan {
    /// The step shape it was last recorded for ([`StepKey`]).
    pub key: Option<StepKey>,
    /// The recorder's epoch when its ops last produced these commands (see
    /// [`Recorder::replay_plan`]).
    pub(super) epoch: u64,
    /// Pinned staging the graph copies to the device: (address, micro-batch, bytes), each
    /// a micro-batch's step-inputs pack ([`super::step_inputs::StepInputs`]).
    pub packs: Vec<(usize, u32, usize)>,
    /// Staged bytes of any other origin: a graph with any is never launched without its
    /// ops (their values are known only to the op that wrote them).
    pub other_stages: usize,
    /// Read-backs into pinned staging, handed over after the graph has run.
    pub deferred: Vec<Deferred>,
    /// (micro-batch, device tokens buffer) whose ids `embed` read where `sample` left them.
    pub device_ids: Vec<(u32, u64)>,
    /// The stream the graph is launched on.
    pub origin: usize,
}

/// The shape of a step: everything of the step's host state that its ops turn into launch
/// arguments, grids, sizes or the choice of kernels, apart from the values staged in the
/// step-inputs pack. Two steps with equal keys issue equal commands (see
/// [`Recorder::replay_plan`] for why), so the second need not run its ops.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StepKey {
    /// The plan step.
    pub step: usize,
    /// Logits are read back (`--dump-logits`).
    pub logits: bool,
    /// Per micro-batch: its block size and its sequences' shapes.
    pub ubs: Vec<(usize, Vec<SeqShape>)>,
}

/// A sequence's part of a [`StepKey`]: (new tokens, block-table length, prefill).
pub type SeqShape = (usize, usize, bool);

impl Recorder {
    /// The host side of the cached graph recorded for a step of shape `key`, when a step
    /// of that shape may launch it without running its ops; why not otherwise.
    ///
    /// Why that is safe. A graph is keyed by its commands, and the commands a decode
    /// step's ops issue are a function of (a) the plan and the weights' places (fixed for
    /// the backend's life), (b) the step's host state, and (c) the addresses the stream
    /// workspaces, step tables and pinned staging hand out. Of (b) the ops turn only the
    /// step's shape into arguments, grids, sizes or the choice of kernels: micro-batch
    /// sizes, each sequence's new tokens, block-table length and prefill flag
    /// ([`StepKey`]), whether logits are read back, and, for `embed`, whether the ids are
    /// where the last `sample` left them (checked apart, `device_ids`). Positions, block
    /// tables, ids and last rows are values the kernels read from the step-inputs pack,
    /// staged at the same offsets every step, not arguments: attention sizes its splits
    /// and score strides from what the block tables can hold, not from the positions
    /// (`attention.rs`, `max_keys`), so steps of one batch keep their launches while the
    /// positions grow. (c) is the same for equal shapes as long as no buffer was grown
    /// and freed in between, which only a step that ran its ops into new commands can do
    /// (the epoch). A graph with staged bytes of any other origin (a KV-part copy's run
    /// table, an op's own upload) is refused: only its op knows those bytes. Guards,
    /// expert caches and host streams never reach here (`plan_graph` and the backend's
    /// `launch_replay` keep such steps plain). `MOEC_CUDA_VERIFY_REPLAY=1` checks the
    /// argument in a run: every step that could skip its ops records them anyway and fails
    /// when they differ from the graph's.
    pub fn replay_plan(&self, key: &StepKey) -> Result<ReplayPlan, &'static str> {
        let s = lock(&self.state);
        let Some(c) = s
            .graphs
            .0
            .iter()
            .rev()
            .find(|c| c.replay.key.as_ref() == Some(key))
        else {
            return Err("no graph was captured for this step's shape");
        };
        if c.replay.epoch != s.epoch {
            return Err(
                "a step ran its ops into other commands since the graph was recorded (its \
                 workspace may have moved)",
            );
        }
        if c.replay.other_stages > 0 {
            return Err("its graph copies staged bytes that only its ops can write");
        }
        Ok(c.replay.clone())
    }

    /// Launches the cached graph of shape `key` without running its ops: writes `inputs`
    /// ((staging address, bytes): the packs of [`Recorder::replay_plan`], recomputed for
    /// this step) and launches it on its stream. With another launch in flight the inputs
    /// are written by a host function ordered after that launch (whose graph reads the
    /// same staging); with `ahead` (the caller may launch the next step before collecting
    /// this one, whose graph writes the same read-back staging) the read-backs are copied
    /// out of staging by a host function ordered right after this graph.
    pub fn launch_replay(
        &self,
        key: &StepKey,
        inputs: Vec<(usize, Vec<u8>)>,
        ahead: bool,
    ) -> Result<Launched, LaunchError> {
        let driver = |call| move |source| LaunchError::Driver { call, source };
        let mut s = lock(&self.state);
        let Some(c) = s
            .graphs
            .0
            .iter()
            .rev()
            .find(|c| c.replay.key.as_ref() == Some(key))
        else {
            return Err(LaunchError::Capture("no graph for the step's shape"));
        };
        let lane = self
            .lane(c.replay.origin)
            .ok_or(LaunchError::Capture("its graph is on no device stream"))?;
        let cu = lane.stream.cu_stream();
        if s.in_flight > 0 {
            host_call(cu, write_staging, Box::new(inputs))?;
        } else {
            for (at, bytes) in &inputs {
                // SAFETY: `at` starts `bytes.len()` bytes of a live pinned staging buffer
                // (the graph's own copy source); nothing is in flight, so no queued work
                // reads or writes it.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), *at as *mut u8, bytes.len())
                };
            }
        }
        c.graph.launch().map_err(driver("cuGraphLaunch"))?;
        let deferred = c.replay.deferred.clone();
        let copied = if ahead {
            let slot = Arc::new(Mutex::new(Vec::new()));
            let ranges: Vec<(usize, usize)> = deferred.iter().map(Deferred::range).collect();
            host_call(cu, copy_read_backs, Box::new((ranges, Arc::clone(&slot))))?;
            Some(slot)
        } else {
            None
        };
        let done = lane
            .stream
            .record_event(None)
            .map_err(driver("cuEventRecord"))?;
        s.in_flight += 1;
        Ok(Launched {
            done,
            copied,
            deferred,
        })
    }

    /// Waits for `launched` and gives each of its read-backs with its bytes.
    pub fn collect(&self, launched: Launched) -> Result<Vec<(Deferred, Vec<u8>)>, LaunchError> {
        let waited = launched
            .done
            .synchronize()
            .map_err(|source| LaunchError::Driver {
                call: "cuEventSynchronize",
                source,
            });
        {
            let mut s = lock(&self.state);
            s.in_flight = s.in_flight.saturating_sub(1);
        }
        waited?;
        let copied = launched
            .copied
            .map(|slot| std::mem::take(&mut *lock(&slot)));
        let mut out = Vec::with_capacity(launched.deferred.len());
        for (i, d) in launched.deferred.into_iter().enumerate() {
            let bytes = match &copied {
                Some(c) => c.get(i).cloned().ok_or(LaunchError::Capture(
                    "a read-back was not copied out of staging",
                ))?,
                None => {
                    let (at, len) = d.range();
                    // SAFETY: the graph's copy into this staging finished (the event
                    // above); nothing launched since writes it (no launch was ahead).
                    unsafe { std::slice::from_raw_parts(at as *const u8, len) }.to_vec()
                }
            };
            out.push((d, bytes));
        }
        Ok(out)
    }

    /// Graph launches whose read-backs are not collected yet.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).in_flight
    }
}
