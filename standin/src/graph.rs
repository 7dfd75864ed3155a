//! CUDA graphs by stream capture: `cuStreamBeginCapture_v2` / `cuStreamEndCapture`,
//! `cuStreamIsCapturing`, `cuGraphInstantiateWithFlags`, `cuGraphLaunch`, `cuGraphUpload`,
//! `cuGraphDestroy` and `cuGraphExecDestroy`, exported unmangled for cudarc's loader.
//!
//! Takes the work a capturing stream is given (kernel launches with their copied parameter
//! bytes, pinned copies, memsets, cuBLAS GEMMs and host functions, each the same closure
//! the stream would have run) and the event records and waits between streams; gives a
//! graph that runs that work only when it is launched, as often as it is launched. As on a
//! real device, a stream that waits on an event recorded in a capture joins it (the
//! driver's fork), and every joined stream must be waited on again before the capture
//! ends (the join; else `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`). A launch replays the work
//! in capture order onto the launching stream and one helper stream per other joined
//! stream, with events for the captured waits, so branches of a graph run concurrently
//! and a dependency the capture did not see is a real race.
//!
//! Guarantees, with the real driver's error codes and a `moec-standin:` line: while a
//! stream captures, synchronising it or the context, a synchronous copy or memset (in
//! the global and thread-local capture modes), a copy to or from pageable host memory, a
//! stream-ordered allocation or free, and querying or synchronising an event last recorded
//! in a capture are refused (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, or
//! `CUDA_ERROR_CAPTURED_EVENT` for events); each refusal invalidates the capture (later
//! captured calls and `cuStreamEndCapture` return `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`)
//! and counts as `capture refused:<call>` in the call counters. A wait on an event recorded
//! outside the capture is `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`.
//!
//! Does not model graph memory nodes (stream-ordered allocation inside a capture is refused
//! with `CUDA_ERROR_NOT_SUPPORTED`), `cuGraphExecUpdate`, child graphs or launching a graph
//! into a capture.

use crate::driver::{code, entry, put, CuResult};
use crate::stream::{self, Node, Stream};
use crate::{lock, log, Handles};
use std::ffi::{c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// CUresult values of stream capture.
pub mod capture_code {
    /// CUDA_ERROR_ILLEGAL_STATE.
    pub const ILLEGAL_STATE: u32 = 401;
    /// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED.
    pub const UNSUPPORTED: u32 = 900;
    /// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.
    pub const INVALIDATED: u32 = 901;
    /// CUDA_ERROR_STREAM_CAPTURE_MERGE.
    pub const MERGE: u32 = 902;
    /// CUDA_ERROR_STREAM_CAPTURE_UNMATCHED.
    pub const UNMATCHED: u32 = 903;
    /// CUDA_ERROR_STREAM_CAPTURE_UNJOINED.
    pub const UNJOINED: u32 = 904;
    /// CUDA_ERROR_STREAM_CAPTURE_ISOLATION.
    pub const ISOLATION: u32 = 905;
    /// CUDA_ERROR_CAPTURED_EVENT.
    pub const CAPTURED_EVENT: u32 = 907;
}

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`, `_THREAD_LOCAL` and `_RELAXED`.
const MODE_GLOBAL: u32 = 0;
const MODE_THREAD_LOCAL: u32 = 1;
const MODE_RELAXED: u32 = 2;

/// One captured operation, on the lane (stream handle) it was captured on.
#[derive(Clone)]
enum Op {
    /// Work the stream would have run.
    Node(Node),
    /// An event record inside the capture (its id within the capture).
    Record(usize),
    /// A wait for a record of this capture.
    Wait(usize),
}

struct CaptureState {
    ops: Vec<(usize, Op)>,
    /// Joined streams, the origin first.
    lanes: Vec<(usize, Arc<Stream>)>,
    records: usize,
    invalidated: Option<String>,
}

/// A stream capture in progress: what its streams were given, in submission order.
pub struct Capture {
    id: u64,
    origin: usize,
    mode: u32,
    thread: std::thread::ThreadId,
    state: Mutex<CaptureState>,
}

impl Capture {
    /// The capture's id (events remember the capture their record belongs to).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn check_valid(&self, call: &str) -> Result<(), u32> {
        match &lock(&self.state).invalidated {
            Some(why) => {
                log(&format!(
                    "{call} refused: the stream capture was invalidated earlier ({why})"
                ));
                Err(capture_code::INVALIDATED)
            }
            None => Ok(()),
        }
    }

    /// Appends `node` to `lane`'s work.
    pub fn add_node(&self, lane: usize, node: Node, call: &str) -> Result<(), u32> {
        self.check_valid(call)?;
        // What graphs hold, by the call that made each node (`captured:cuLaunchKernel`,
        // `captured:cuLaunchHostFunc`, ...): the counters test reads nodes per layer.
        crate::counters::count(&format!("captured:{call}"));
        lock(&self.state).ops.push((lane, Op::Node(node)));
        Ok(())
    }

    /// An event record on `lane`; gives its id within the capture.
    pub fn add_record(&self, lane: usize, call: &str) -> Result<usize, u32> {
        self.check_valid(call)?;
        let mut state = lock(&self.state);
        let id = state.records;
        state.records += 1;
        state.ops.push((lane, Op::Record(id)));
        Ok(id)
    }

    /// `lane` (joining the capture if it is not in it yet) waits for record `id`.
    pub fn add_wait(
        &self,
        lane: usize,
        stream: &Arc<Stream>,
        id: usize,
        call: &str,
    ) -> Result<(), u32> {
        self.check_valid(call)?;
        let mut state = lock(&self.state);
        if !state.lanes.iter().any(|(h, _)| *h == lane) {
            state.lanes.push((lane, Arc::clone(stream)));
        }
        state.ops.push((lane, Op::Wait(id)));
        Ok(())
    }

    /// Marks the capture invalid (a refused call), counted under `capture refused:<call>`.
    pub fn invalidate(&self, call: &str, why: &str) {
        crate::counters::count(&format!("capture refused:{call}"));
        let mut state = lock(&self.state);
        if state.invalidated.is_none() {
            state.invalidated = Some(format!("{call}: {why}"));
        }
    }

    /// Whether a potentially unsafe call (a synchronous copy, memset or free) made on this
    /// thread is refused under the capture's mode.
    fn forbids_unsafe_calls_here(&self) -> bool {
        match self.mode {
            MODE_GLOBAL => true,
            MODE_THREAD_LOCAL => self.thread == std::thread::current().id(),
            _ => false,
        }
    }
}

static NEXT_CAPTURE: AtomicU64 = AtomicU64::new(1);
static ACTIVE: Mutex<Vec<Arc<Capture>>> = Mutex::new(Vec::new());

/// Every capture in progress.
fn active() -> Vec<Arc<Capture>> {
    lock(&ACTIVE).clone()
}

/// The capture an event's latest record belongs to, if it is still in progress.
pub fn active_capture(id: u64) -> Option<Arc<Capture>> {
    active().into_iter().find(|c| c.id == id)
}

/// Refuses `call` (a synchronisation of the whole context) while any capture is in
/// progress, invalidating them all.
pub fn refuse_context_sync(call: &str) -> Result<(), u32> {
    let captures = active();
    if captures.is_empty() {
        return Ok(());
    }
    for c in &captures {
        c.invalidate(call, "the context was synchronised while a stream captures");
    }
    log(&format!(
        "{call} refused: a stream is capturing (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)"
    ));
    Err(capture_code::UNSUPPORTED)
}

/// Refuses a potentially unsafe call (synchronous copy, memset or free) while a capture
/// whose mode forbids it from this thread is in progress.
pub fn refuse_unsafe_call(call: &str) -> Result<(), u32> {
    let forbidding: Vec<_> = active()
        .into_iter()
        .filter(|c| c.forbids_unsafe_calls_here())
        .collect();
    if forbidding.is_empty() {
        return Ok(());
    }
    for c in &forbidding {
        c.invalidate(call, "a synchronous call was made while a stream captures");
    }
    log(&format!(
        "{call} refused: not permitted while a stream captures in the global or this thread's \
         mode (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)"
    ));
    Err(capture_code::UNSUPPORTED)
}

/// Refuses `call` on a capturing stream (`why` says what it would have done), invalidating
/// the capture.
pub fn refuse_on(stream: &Stream, call: &str, why: &str) -> Result<(), u32> {
    match stream.capture() {
        Some(c) => {
            c.invalidate(call, why);
            log(&format!(
                "{call} refused: {why} while the stream captures (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)"
            ));
            Err(capture_code::UNSUPPORTED)
        }
        None => Ok(()),
    }
}

/// A captured graph.
struct Graph {
    ops: Vec<(usize, Op)>,
    lanes: Vec<usize>,
    records: usize,
}

static GRAPHS: Handles<Graph> = Handles::new(0xc000_0000);

/// An instantiated graph: its work, a helper stream per joined stream but the origin, and
/// an event per captured record plus the fork and join events.
struct Exec {
    ops: Vec<(usize, Op)>,
    /// Lane handle -> helper stream handle (the origin lane maps to the launch stream).
    helpers: Vec<(usize, usize)>,
    origin: usize,
    records: Vec<usize>,
    fork: usize,
    joins: Vec<usize>,
}

static EXECS: Handles<Exec> = Handles::new(0xd000_0000);

#[no_mangle]
extern "C" fn cuStreamBeginCapture_v2(handle: *mut c_void, mode: c_uint) -> CuResult {
    entry("cuStreamBeginCapture_v2", || {
        let handle = handle as usize;
        if handle == 0 || handle == stream::LEGACY_HANDLE || handle == stream::PER_THREAD_HANDLE {
            log("cuStreamBeginCapture_v2 refused: the legacy and per-thread default streams cannot be captured");
            return Err(capture_code::UNSUPPORTED);
        }
        if !matches!(mode, MODE_GLOBAL | MODE_THREAD_LOCAL | MODE_RELAXED) {
            log(&format!(
                "cuStreamBeginCapture_v2 refused: unknown capture mode {mode}"
            ));
            return Err(code::INVALID_VALUE);
        }
        let stream = stream::resolve(handle, "cuStreamBeginCapture_v2")?;
        if stream.capture().is_some() {
            log("cuStreamBeginCapture_v2 refused: the stream is already capturing");
            return Err(capture_code::ILLEGAL_STATE);
        }
        let capture = Arc::new(Capture {
            id: NEXT_CAPTURE.fetch_add(1, Ordering::Relaxed),
            origin: handle,
            mode,
            thread: std::thread::current().id(),
            state: Mutex::new(CaptureState {
                ops: Vec::new(),
                lanes: vec![(handle, Arc::clone(&stream))],
                records: 0,
                invalidated: None,
            }),
        });
        stream.set_capture(Some(Arc::clone(&capture)));
        lock(&ACTIVE).push(capture);
        Ok(())
    })
}

/// Whether every joined stream but the origin ends with a record that another lane
/// waited for afterwards (the join the driver requires).
fn unjoined(state: &CaptureState, origin: usize) -> Option<usize> {
    for &(lane, _) in &state.lanes {
        if lane == origin {
            continue;
        }
        let last = state.ops.iter().rposition(|(l, _)| *l == lane);
        let joined = last.is_some_and(|at| match &state.ops[at].1 {
            Op::Record(id) => state.ops[at..]
                .iter()
                .any(|(l, op)| *l != lane && matches!(op, Op::Wait(w) if w == id)),
            _ => false,
        });
        if !joined {
            return Some(lane);
        }
    }
    None
}

#[no_mangle]
unsafe extern "C" fn cuStreamEndCapture(handle: *mut c_void, graph: *mut *mut c_void) -> CuResult {
    entry("cuStreamEndCapture", || {
        let handle = handle as usize;
        let stream = stream::resolve(handle, "cuStreamEndCapture")?;
        let Some(capture) = stream.capture() else {
            log("cuStreamEndCapture refused: the stream is not capturing");
            return Err(capture_code::ILLEGAL_STATE);
        };
        if capture.origin != handle {
            log("cuStreamEndCapture refused: the stream joined a capture another stream began");
            return Err(capture_code::UNMATCHED);
        }
        lock(&ACTIVE).retain(|c| c.id != capture.id);
        let state = std::mem::replace(
            &mut *lock(&capture.state),
            CaptureState {
                ops: Vec::new(),
                lanes: Vec::new(),
                records: 0,
                invalidated: None,
            },
        );
        for (_, s) in &state.lanes {
            s.set_capture(None);
        }
        // SAFETY: cudarc passes a live CUgraph slot; null it first so a refusal leaves none.
        unsafe { put(graph, std::ptr::null_mut(), "cuStreamEndCapture") }?;
        if let Some(why) = &state.invalidated {
            log(&format!(
                "cuStreamEndCapture: the capture was invalidated ({why}); no graph"
            ));
            return Err(capture_code::INVALIDATED);
        }
        if let Some(lane) = unjoined(&state, handle) {
            log(&format!(
                "cuStreamEndCapture refused: stream {lane:#x} joined the capture and was not \
                 joined back into the origin stream"
            ));
            return Err(capture_code::UNJOINED);
        }
        let made = GRAPHS.insert(Arc::new(Graph {
            lanes: state.lanes.iter().map(|(h, _)| *h).collect(),
            ops: state.ops,
            records: state.records,
        }));
        // SAFETY: as above.
        unsafe { put(graph, made as *mut c_void, "cuStreamEndCapture") }
    })
}

#[no_mangle]
unsafe extern "C" fn cuStreamIsCapturing(handle: *mut c_void, status: *mut c_uint) -> CuResult {
    entry("cuStreamIsCapturing", || {
        let stream = stream::resolve(handle as usize, "cuStreamIsCapturing")?;
        // CU_STREAM_CAPTURE_STATUS_NONE, _ACTIVE, _INVALIDATED.
        let value = match stream.capture() {
            None => 0,
            Some(c) if lock(&c.state).invalidated.is_some() => 2,
            Some(_) => 1,
        };
        // SAFETY: cudarc passes a live status slot.
        unsafe { put(status, value, "cuStreamIsCapturing") }
    })
}

fn graph(handle: usize, call: &str) -> Result<Arc<Graph>, u32> {
    GRAPHS.get(handle).ok_or_else(|| {
        log(&format!(
            "{call} refused: unknown or destroyed graph {handle:#x}"
        ));
        code::INVALID_HANDLE
    })
}

fn exec(handle: usize, call: &str) -> Result<Arc<Exec>, u32> {
    EXECS.get(handle).ok_or_else(|| {
        log(&format!(
            "{call} refused: unknown or destroyed graph exec {handle:#x}"
        ));
        code::INVALID_HANDLE
    })
}

#[no_mangle]
unsafe extern "C" fn cuGraphInstantiateWithFlags(
    out: *mut *mut c_void,
    graph_handle: *mut c_void,
    flags: c_ulonglong,
) -> CuResult {
    entry("cuGraphInstantiateWithFlags", || {
        let g = graph(graph_handle as usize, "cuGraphInstantiateWithFlags")?;
        // AUTO_FREE_ON_LAUNCH (1) concerns graph memory nodes, which are never captured
        // here; USE_NODE_PRIORITY (8) changes no emulated order. Others are refused.
        if flags & !(1 | 8) != 0 {
            log(&format!(
                "cuGraphInstantiateWithFlags refused: flags {flags:#x} are not modelled"
            ));
            return Err(code::INVALID_VALUE);
        }
        let origin = g.lanes.first().copied().unwrap_or(0);
        let mut helpers = Vec::new();
        for &lane in g.lanes.iter().skip(1) {
            helpers.push((lane, stream::create(1)?));
        }
        let records = (0..g.records).map(|_| stream::event_create(2)).collect();
        let joins = helpers.iter().map(|_| stream::event_create(2)).collect();
        let made = EXECS.insert(Arc::new(Exec {
            ops: g.ops.clone(),
            helpers,
            origin,
            records,
            fork: stream::event_create(2),
            joins,
        }));
        // SAFETY: cudarc passes a live CUgraphExec slot.
        unsafe { put(out, made as *mut c_void, "cuGraphInstantiateWithFlags") }
    })
}

impl Exec {
    fn lane(&self, lane: usize, launch: usize) -> usize {
        if lane == self.origin {
            return launch;
        }
        self.helpers
            .iter()
            .find(|(l, _)| *l == lane)
            .map_or(launch, |(_, h)| *h)
    }

    /// Replays the work onto `launch` and the helper streams: fork, the ops in capture
    /// order, join.
    fn launch(&self, launch: usize) -> Result<(), u32> {
        const CALL: &str = "cuGraphLaunch";
        stream::event_record(self.fork, launch)?;
        for &(_, helper) in &self.helpers {
            stream::stream_wait_event(helper, self.fork)?;
        }
        for (lane, op) in &self.ops {
            let target = self.lane(*lane, launch);
            match op {
                Op::Node(node) => {
                    let node = Arc::clone(node);
                    stream::submit_plain(target, CALL, Box::new(move || node()))?;
                }
                Op::Record(id) => stream::event_record(self.records[*id], target)?,
                Op::Wait(id) => stream::stream_wait_event(target, self.records[*id])?,
            }
        }
        for (&(_, helper), &join) in self.helpers.iter().zip(&self.joins) {
            stream::event_record(join, helper)?;
            stream::stream_wait_event(launch, join)?;
        }
        Ok(())
    }
}

#[no_mangle]
extern "C" fn cuGraphLaunch(exec_handle: *mut c_void, handle: *mut c_void) -> CuResult {
    entry("cuGraphLaunch", || {
        let e = exec(exec_handle as usize, "cuGraphLaunch")?;
        let launch = handle as usize;
        let stream = stream::resolve(launch, "cuGraphLaunch")?;
        if stream.capture().is_some() {
            log("cuGraphLaunch refused: launching a graph into a capture (a child graph) is not modelled by the stand-in");
            return Err(code::NOT_SUPPORTED);
        }
        e.launch(launch)
    })
}

#[no_mangle]
extern "C" fn cuGraphUpload(exec_handle: *mut c_void, handle: *mut c_void) -> CuResult {
    entry("cuGraphUpload", || {
        exec(exec_handle as usize, "cuGraphUpload")?;
        stream::resolve(handle as usize, "cuGraphUpload").map(drop)
    })
}

#[no_mangle]
extern "C" fn cuGraphExecDestroy(exec_handle: *mut c_void) -> CuResult {
    entry("cuGraphExecDestroy", || {
        let Some(e) = EXECS.remove(exec_handle as usize) else {
            log(&format!(
                "cuGraphExecDestroy refused: unknown graph exec {:#x}",
                exec_handle as usize
            ));
            return Err(code::INVALID_HANDLE);
        };
        // Queued launches still run: a destroyed stream finishes its work, and events
        // destroyed with records pending still complete.
        for &(_, helper) in &e.helpers {
            stream::destroy(helper)?;
        }
        for &ev in e.records.iter().chain(&e.joins).chain([&e.fork]) {
            stream::event_destroy(ev)?;
        }
        Ok(())
    })
}

#[no_mangle]
extern "C" fn cuGraphDestroy(graph_handle: *mut c_void) -> CuResult {
    entry("cuGraphDestroy", || {
        GRAPHS
            .remove(graph_handle as usize)
            .map(drop)
            .ok_or_else(|| {
                log(&format!(
                    "cuGraphDestroy refused: unknown graph {:#x}",
                    graph_handle as usize
                ));
                code::INVALID_HANDLE
            })
    })
}
