//! Launching a step's cached graph without running its ops: the host side a graph needs
//! ([`ReplayPlan`], keyed by the step's shape, [`StepKey`]), the launch that writes the
//! step's staged inputs behind a launch in flight and copies its read-backs out before
//! the next graph overwrites them ([`Recorder::launch_replay`]), and the hand-over of a
//! launched step's read-backs ([`Recorder::collect`]). Why a step of a cached shape may
//! skip its ops is argued on [`Recorder::replay_plan`].
//!
//! Between two queued graphs the stream runs no host function: the staged words that
//! changed since the last step are written into pinned staging by stream memory
//! operations (`cuStreamWriteValue32`, the values given at the launch call), and the
//! read-backs are copied by the copy engine from their device buffers into a ring of
//! pinned slots (`cuMemcpyDtoHAsync`). A host function (`cuLaunchHostFunc`) stalls the
//! stream until a driver thread has been woken to run it, twice a step;
//! `MOEC_CUDA_REPLAY_IO=host-functions` brings them back, for an A/B on a real device,
//! and the run report says which ran.

use super::*;
use crate::records::StepSplit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A graph launched without its ops ([`Recorder::launch_replay`]), its read-backs not yet
/// handed over.
#[derive(Debug)]
pub struct Launched {
    /// Recorded after the graph (and the copy of its read-backs).
    done: CudaEvent,
    /// Timing events recorded on the stream right before and right after the graph.
    around: (Arc<CudaEvent>, Arc<CudaEvent>),
    /// The end event of the graph launched before this one, when this one was queued
    /// behind it (the device's idle time between the two is the step's `gap`).
    behind: Option<Arc<CudaEvent>>,
    /// Nanoseconds spent inside this step's host functions.
    host_ns: Arc<AtomicU64>,
    /// Host seconds of the launch call and, of them, of staging (set by the caller,
    /// [`Launched::host_times`]).
    launch: f64,
    staging: f64,
    /// Where its read-backs are once it has run.
    copied: Copied,
    /// Its read-backs.
    deferred: Vec<Deferred>,
}

/// A collected step: each read-back with its bytes, and where the step's time went.
pub type Collected = (Vec<(Deferred, Vec<u8>)>, StepSplit);

/// Where a launched step's read-backs are once its done event has completed.
#[derive(Debug)]
enum Copied {
    /// In the graph's staging (nothing launched after it can overwrite them).
    Staging,
    /// Copied out of staging by a host function right after the graph.
    Host(Arc<Mutex<Vec<Vec<u8>>>>),
    /// Copied by the copy engine from their device buffers into ring slot `slot`, at
    /// (offset, bytes) each.
    Ring {
        slot: usize,
        at: Vec<(usize, usize)>,
    },
}

/// Read-back ring slots. The driver has at most two launches in flight (it launches one
/// step ahead), so a slot is collected long before the ring comes back to it; a slot
/// still busy makes that launch copy its read-backs by a host function instead.
const RING_SLOTS: usize = 4;

/// Most changed staging words a launch writes by stream memory operations; a step that
/// changes more (a new block table row for many sequences at once) writes its inputs by
/// one host function instead.
const MAX_STREAM_WRITES: usize = 256;

/// What launches without ops keep between steps.
#[derive(Default)]
pub(super) struct ReplayState {
    /// The end timing event of the last graph launched without its ops.
    last_end: Option<Arc<CudaEvent>>,
    /// What each staging piece written by a launch holds once the stream has run the
    /// writes queued so far (the words a later launch must change); cleared when a step
    /// runs its ops (they write staging themselves).
    staged: HashMap<usize, Vec<u8>>,
    /// Read-back slots (page-locked) and whether a launch in flight copies into each.
    ring: Vec<Option<Pinned>>,
    busy: [bool; RING_SLOTS],
    next: usize,
    /// Counts for the report: staged words written by stream memory operations,
    /// read-backs copied by the copy engine, host functions queued.
    pub(super) words_written: usize,
    pub(super) copies: usize,
    pub(super) host_functions: usize,
}

impl ReplayState {
    /// A step ran its ops: what staging holds is no longer known here.
    pub(super) fn forget_staging(&mut self) {
        self.staged.clear();
    }

    /// A free ring slot of at least `bytes`, or `None` when the next one is busy.
    fn take_slot(&mut self, bytes: usize) -> Result<Option<(usize, usize)>, LaunchError> {
        let i = self.next % RING_SLOTS;
        if self.busy[i] {
            return Ok(None);
        }
        if self.ring.len() < RING_SLOTS {
            self.ring.resize_with(RING_SLOTS, || None);
        }
        if self.ring[i].as_ref().is_none_or(|p| p.len < bytes) {
            // Not busy: no queued copy writes the old slot, which is freed here.
            self.ring[i] = None;
            let len = bytes.max(4 << 10);
            // SAFETY: a plain page-locked allocation; freed by `Pinned::drop`.
            let ptr =
                unsafe { result::malloc_host(len, 0) }.map_err(|source| LaunchError::Driver {
                    call: "cuMemHostAlloc",
                    source,
                })?;
            self.ring[i] = Some(Pinned {
                ptr: ptr as usize,
                len,
            });
        }
        self.next += 1;
        self.busy[i] = true;
        Ok(self.ring[i].as_ref().map(|p| (i, p.ptr)))
    }
}

/// Whether `MOEC_CUDA_REPLAY_IO=host-functions` (read once): launches without ops write
/// their staged inputs and copy their read-backs by host functions, as before stream
/// writes were used (an A/B switch for a real device).
pub fn replay_io_by_host_functions() -> bool {
    static HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HOST.get_or_init(|| std::env::var("MOEC_CUDA_REPLAY_IO").as_deref() == Ok("host-functions"))
}

/// The 32-bit words of `new` that differ from `old` (same length), as (byte offset, word),
/// or `None` when the lengths differ or are not whole words.
fn changed_words(old: &[u8], new: &[u8]) -> Option<Vec<(usize, u32)>> {
    if old.len() != new.len() || !new.len().is_multiple_of(4) {
        return None;
    }
    Some(
        old.chunks_exact(4)
            .zip(new.chunks_exact(4))
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, (_, b))| (4 * i, u32::from_ne_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
    )
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

/// What [`write_staging`] writes: (staging address, bytes), and where it adds the
/// nanoseconds it ran.
type StagingJob = (Vec<(usize, Vec<u8>)>, Arc<AtomicU64>);

/// Host function: writes a launched-ahead step's inputs into pinned staging.
unsafe extern "C" fn write_staging(data: *mut std::ffi::c_void) {
    let t = Instant::now();
    // SAFETY: `data` is the `Box<StagingJob>` `launch_replay` gave `host_call`, passed
    // once.
    let job = unsafe { Box::from_raw(data.cast::<StagingJob>()) };
    let (inputs, host_ns) = *job;
    for (at, bytes) in inputs.iter() {
        // SAFETY: each address starts a live staging piece of at least this many bytes;
        // the stream ran every earlier launch, whose graphs read it, before this call, and
        // runs the graph that reads the new bytes after it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *at as *mut u8, bytes.len()) };
    }
    host_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// What [`copy_read_backs`] copies: staging ranges, where their bytes go, and where it
/// adds the nanoseconds it ran.
type ReadBackJob = (
    Vec<(usize, usize)>,
    Arc<Mutex<Vec<Vec<u8>>>>,
    Arc<AtomicU64>,
);

/// Host function: copies a step's read-backs out of pinned staging before the next
/// step's graph writes it again.
unsafe extern "C" fn copy_read_backs(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `Box<ReadBackJob>` `launch_replay` gave `host_call`, once.
    let t = Instant::now();
    let job = unsafe { Box::from_raw(data.cast::<ReadBackJob>()) };
    let (ranges, slot, host_ns) = *job;
    let bytes = ranges
        .iter()
        // SAFETY: each range is staging the step's graph copied into; the graph has run
        // (stream order) and the next launch's writes come after this call.
        .map(|&(at, len)| unsafe { std::slice::from_raw_parts(at as *const u8, len) }.to_vec())
        .collect();
    *lock(&slot) = bytes;
    host_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

impl Launched {
    /// Sets the host seconds of the launch call that made it and, of them, of
    /// computing and writing its staged inputs (the caller's timers).
    pub fn host_times(&mut self, launch: f64, staging: f64) {
        self.launch = launch;
        self.staging = staging;
    }
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
    /// Per read-back, the device address the graph copies it from (its `DtoH` command's
    /// source), so a launch can copy it again out of the device buffer.
    pub sources: Vec<Option<u64>>,
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
        let host_ns = Arc::new(AtomicU64::new(0));
        let timing = || {
            lane.stream
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map(Arc::new)
                .map_err(driver("cuEventCreate"))
        };
        let around = (timing()?, timing()?);
        let queued = s.in_flight > 0;
        let behind = if queued {
            // Only the words that changed, by stream writes, when the last bytes of
            // every piece are known and few changed; else one host function.
            let writes: Option<Vec<(usize, u32)>> = if replay_io_by_host_functions() {
                None
            } else {
                inputs
                    .iter()
                    .map(|(at, bytes)| {
                        let old = s.replay.staged.get(at)?;
                        Some(
                            changed_words(old, bytes)?
                                .into_iter()
                                .map(|(o, w)| (at + o, w))
                                .collect::<Vec<_>>(),
                        )
                    })
                    .collect::<Option<Vec<_>>>()
                    .map(|v| v.concat())
                    .filter(|w| w.len() <= MAX_STREAM_WRITES)
            };
            match writes {
                Some(words) => {
                    for &(at, word) in &words {
                        // SAFETY: `at` is inside a live pinned staging piece (cuMemHostAlloc
                        // memory, whose device address is its host address under unified
                        // addressing); the write runs when the stream reaches it, after
                        // the graph in flight that reads the same staging.
                        unsafe { sys::cuStreamWriteValue32_v2(cu, at as u64, word, 0) }
                            .result()
                            .map_err(driver("cuStreamWriteValue32"))?;
                    }
                    s.replay.words_written += words.len();
                    for (at, bytes) in inputs {
                        s.replay.staged.insert(at, bytes);
                    }
                }
                None => {
                    for (at, bytes) in &inputs {
                        s.replay.staged.insert(*at, bytes.clone());
                    }
                    host_call(cu, write_staging, Box::new((inputs, Arc::clone(&host_ns))))?;
                    s.replay.host_functions += 1;
                }
            }
            s.replay.last_end.clone()
        } else {
            for (at, bytes) in &inputs {
                // SAFETY: `at` starts `bytes.len()` bytes of a live pinned staging buffer
                // (the graph's own copy source); nothing is in flight, so no queued work
                // reads or writes it.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), *at as *mut u8, bytes.len())
                };
            }
            for (at, bytes) in inputs {
                s.replay.staged.insert(at, bytes);
            }
            None
        };
        let Some(c) = s
            .graphs
            .0
            .iter()
            .rev()
            .find(|c| c.replay.key.as_ref() == Some(key))
        else {
            return Err(LaunchError::Capture("no graph for the step's shape"));
        };
        around
            .0
            .record(&lane.stream)
            .map_err(driver("cuEventRecord"))?;
        c.graph.launch().map_err(driver("cuGraphLaunch"))?;
        around
            .1
            .record(&lane.stream)
            .map_err(driver("cuEventRecord"))?;
        let deferred = c.replay.deferred.clone();
        let sources = c.replay.sources.clone();
        let copied = if !ahead {
            Copied::Staging
        } else {
            let mut at = Vec::with_capacity(deferred.len());
            let mut need = 0;
            for d in &deferred {
                let len = d.range().1;
                at.push((need, len));
                need += len.next_multiple_of(STAGING_ALIGN);
            }
            let slot = if replay_io_by_host_functions() || sources.iter().any(Option::is_none) {
                None
            } else {
                s.replay.take_slot(need)?
            };
            match slot {
                Some((slot, base)) => {
                    for (&(off, len), src) in at.iter().zip(&sources) {
                        let src = src.unwrap_or_default();
                        // SAFETY: the slot holds `need` bytes from `base`, so each piece
                        // fits; the source is the device buffer the graph's own read-back
                        // copies from, whose bytes stay until the next graph (after this
                        // copy in stream order) overwrites them.
                        unsafe {
                            sys::cuMemcpyDtoHAsync_v2(
                                (base + off) as *mut std::ffi::c_void,
                                src,
                                len,
                                cu,
                            )
                        }
                        .result()
                        .map_err(driver("cuMemcpyDtoHAsync"))?;
                    }
                    s.replay.copies += at.len();
                    Copied::Ring { slot, at }
                }
                None => {
                    let slot = Arc::new(Mutex::new(Vec::new()));
                    let ranges: Vec<(usize, usize)> =
                        deferred.iter().map(Deferred::range).collect();
                    let job: ReadBackJob = (ranges, Arc::clone(&slot), Arc::clone(&host_ns));
                    host_call(cu, copy_read_backs, Box::new(job))?;
                    s.replay.host_functions += 1;
                    Copied::Host(slot)
                }
            }
        };
        let done = lane
            .stream
            .record_event(None)
            .map_err(driver("cuEventRecord"))?;
        s.in_flight += 1;
        s.replay.last_end = Some(Arc::clone(&around.1));
        Ok(Launched {
            done,
            around,
            behind,
            host_ns,
            launch: 0.0,
            staging: 0.0,
            copied,
            deferred,
        })
    }

    /// Waits for `launched` and gives each of its read-backs with its bytes, and where its
    /// time went (`wait` left for the caller, who times the whole collection).
    pub fn collect(&self, launched: Launched) -> Result<Collected, LaunchError> {
        let ring_slot = match &launched.copied {
            Copied::Ring { slot, .. } => Some(*slot),
            _ => None,
        };
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
        let read = waited.and_then(|()| self.read_out(launched));
        if let Some(slot) = ring_slot {
            // Read out (or the wait failed and nothing more is read from it): free for a
            // later launch.
            if let Some(b) = lock(&self.state).replay.busy.get_mut(slot) {
                *b = false;
            }
        }
        read
    }

    /// The read-backs of a launched step whose done event has completed, with where its
    /// time went.
    fn read_out(&self, launched: Launched) -> Result<Collected, LaunchError> {
        // Both events completed before the done event this step waited for (recorded
        // after them on the same stream), so no further synchronisation is needed
        // (`CudaEvent::elapsed_ms` would synchronise each again).
        let elapsed = |a: &CudaEvent, b: &CudaEvent| {
            // SAFETY: two live timing events of this context, both recorded and complete.
            unsafe { result::event::elapsed(a.cu_event(), b.cu_event()) }
                .map(|ms| f64::from(ms) / 1e3)
                .map_err(|source| LaunchError::Driver {
                    call: "cuEventElapsedTime",
                    source,
                })
        };
        let (start, end) = &launched.around;
        let split = StepSplit {
            device: elapsed(start, end)?,
            gap: match &launched.behind {
                Some(before) => Some(elapsed(before, start)?.max(0.0)),
                None => None,
            },
            launch: launched.launch,
            staging: launched.staging,
            host_functions: launched.host_ns.load(Ordering::Relaxed) as f64 / 1e9,
            wait: 0.0,
        };
        let (copied, ring) = match launched.copied {
            Copied::Host(slot) => (Some(std::mem::take(&mut *lock(&slot))), None),
            Copied::Ring { slot, at } => {
                let base = lock(&self.state)
                    .replay
                    .ring
                    .get(slot)
                    .and_then(Option::as_ref)
                    .map(|p| p.ptr)
                    .ok_or(LaunchError::Capture("a read-back slot was freed in flight"))?;
                (None, Some((base, at)))
            }
            Copied::Staging => (None, None),
        };
        let mut out = Vec::with_capacity(launched.deferred.len());
        for (i, d) in launched.deferred.into_iter().enumerate() {
            let bytes = match (&copied, &ring) {
                (Some(c), _) => c.get(i).cloned().ok_or(LaunchError::Capture(
                    "a read-back was not copied out of staging",
                ))?,
                (None, Some((base, at))) => {
                    let &(off, len) = at.get(i).ok_or(LaunchError::Capture(
                        "a read-back was not copied into its slot",
                    ))?;
                    // SAFETY: the copy-engine copy into the slot finished (the done event,
                    // recorded after it); the slot stays busy, so no launch writes it,
                    // until this read-out has returned.
                    unsafe { std::slice::from_raw_parts((base + off) as *const u8, len) }.to_vec()
                }
                (None, None) => {
                    let (at, len) = d.range();
                    // SAFETY: the graph's copy into this staging finished (the event
                    // above); nothing launched since writes it (no launch was ahead).
                    unsafe { std::slice::from_raw_parts(at as *const u8, len) }.to_vec()
                }
            };
            out.push((d, bytes));
        }
        Ok((out, split))
    }

    /// How launches without ops queued their inputs and read-backs so far, in words.
    pub fn replay_io(&self) -> String {
        let s = lock(&self.state);
        let r = &s.replay;
        format!(
            "{} staged words written by stream writes, {} read-backs copied by the copy \
             engine, {} host functions ({})",
            r.words_written,
            r.copies,
            r.host_functions,
            if replay_io_by_host_functions() {
                "MOEC_CUDA_REPLAY_IO=host-functions"
            } else {
                "host functions only where stream writes cannot: MOEC_CUDA_REPLAY_IO=host-functions for all"
            }
        )
    }

    /// Graph launches whose read-backs are not collected yet.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).in_flight
    }
}
