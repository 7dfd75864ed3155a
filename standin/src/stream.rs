//! CUDA streams and events: one OS thread per stream running its work in submission order,
//! and events with the driver's generation semantics.
//!
//! Takes work items (closures) submitted to a stream handle; gives tickets the host can
//! wait on. Guarantees: work on one stream runs in order, work on different streams runs
//! concurrently (nothing orders it but events and the legacy default stream's implicit
//! synchronisation), so a missing dependency is a real race. An event wait binds to the
//! record submitted before it; waiting on a never-recorded event does nothing; elapsed
//! time follows `cuEventElapsedTime`'s rules. Destroying a stream returns at once; its
//! thread finishes the queued work and exits.

use crate::driver::code;
use crate::graph::{self, capture_code, Capture};
use crate::{lock, log, Handles};
use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// A unit of stream work run once.
pub type Work = Box<dyn FnOnce() + Send>;

/// Stream work that a graph may run again: what a capturing stream records.
pub type Node = Arc<dyn Fn() + Send + Sync>;

struct Queue {
    work: VecDeque<Work>,
    submitted: u64,
    completed: u64,
    closed: bool,
}

/// One stream: a queue drained in order by its own thread.
pub struct Stream {
    /// `CU_STREAM_NON_BLOCKING` streams do not synchronise with the legacy default stream.
    pub non_blocking: bool,
    queue: Mutex<Queue>,
    changed: Condvar,
    /// The stream capture this stream takes part in (began it or joined it), if any.
    capture: Mutex<Option<Arc<Capture>>>,
}

impl Stream {
    /// The capture this stream records into, if it is capturing.
    pub fn capture(&self) -> Option<Arc<Capture>> {
        lock(&self.capture).clone()
    }

    /// Starts (`Some`) or ends (`None`) this stream's part in a capture.
    pub fn set_capture(&self, capture: Option<Arc<Capture>>) {
        *lock(&self.capture) = capture;
    }

    fn spawn(non_blocking: bool, name: String) -> Result<Arc<Stream>, u32> {
        let stream = Arc::new(Stream {
            non_blocking,
            queue: Mutex::new(Queue {
                work: VecDeque::new(),
                submitted: 0,
                completed: 0,
                closed: false,
            }),
            changed: Condvar::new(),
            capture: Mutex::new(None),
        });
        let worker = Arc::clone(&stream);
        std::thread::Builder::new()
            .name(name)
            .spawn(move || worker.run())
            .map_err(|e| {
                log(&format!("cannot start a stream thread: {e}"));
                code::OUT_OF_MEMORY
            })?;
        Ok(stream)
    }

    fn run(&self) {
        loop {
            let item = {
                let mut queue = lock(&self.queue);
                loop {
                    if let Some(item) = queue.work.pop_front() {
                        break item;
                    }
                    if queue.closed {
                        return;
                    }
                    queue = self
                        .changed
                        .wait(queue)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
            };
            crate::guard("stream work", (), item);
            lock(&self.queue).completed += 1;
            self.changed.notify_all();
        }
    }

    /// Appends `work`; returns its ticket (the stream's submission count after it).
    fn push(&self, work: Work) -> u64 {
        let mut queue = lock(&self.queue);
        queue.work.push_back(work);
        queue.submitted += 1;
        let ticket = queue.submitted;
        drop(queue);
        self.changed.notify_all();
        ticket
    }

    /// Blocks until the work with `ticket` (and everything before it) has run.
    pub fn wait_for(&self, ticket: u64) {
        let mut queue = lock(&self.queue);
        while queue.completed < ticket {
            queue = self
                .changed
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Work submitted so far.
    fn submitted(&self) -> u64 {
        lock(&self.queue).submitted
    }

    /// Whether every submitted item has run.
    pub fn idle(&self) -> bool {
        let queue = lock(&self.queue);
        queue.completed == queue.submitted
    }

    fn close(&self) {
        lock(&self.queue).closed = true;
        self.changed.notify_all();
    }
}

static STREAMS: Handles<Stream> = Handles::new(0x5000_0000);
static LEGACY: Mutex<Option<Arc<Stream>>> = Mutex::new(None);

thread_local! {
    static PER_THREAD: std::cell::RefCell<Option<Arc<Stream>>> = const { std::cell::RefCell::new(None) };
}

/// `CU_STREAM_LEGACY`.
pub const LEGACY_HANDLE: usize = 0x1;
/// `CU_STREAM_PER_THREAD`.
pub const PER_THREAD_HANDLE: usize = 0x2;

fn legacy() -> Result<Arc<Stream>, u32> {
    let mut slot = lock(&LEGACY);
    if let Some(stream) = slot.as_ref() {
        return Ok(Arc::clone(stream));
    }
    let stream = Stream::spawn(false, "standin-legacy".into())?;
    *slot = Some(Arc::clone(&stream));
    Ok(stream)
}

/// Creates a stream; returns its handle.
pub fn create(flags: u32) -> Result<usize, u32> {
    let non_blocking = flags & 1 != 0;
    let stream = Stream::spawn(non_blocking, "standin-stream".into())?;
    Ok(STREAMS.insert(stream))
}

/// Destroys a stream: returns at once; queued work still runs.
pub fn destroy(handle: usize) -> Result<(), u32> {
    match STREAMS.remove(handle) {
        Some(stream) => {
            stream.close();
            Ok(())
        }
        None => {
            log(&format!(
                "cuStreamDestroy({handle:#x}) refused: unknown stream"
            ));
            Err(code::INVALID_HANDLE)
        }
    }
}

/// The stream behind a handle, including NULL/legacy (0x0, 0x1) and per-thread (0x2).
pub fn resolve(handle: usize, call: &str) -> Result<Arc<Stream>, u32> {
    match handle {
        0 | LEGACY_HANDLE => legacy(),
        PER_THREAD_HANDLE => PER_THREAD.with(|slot| {
            let mut slot = slot.borrow_mut();
            if let Some(stream) = slot.as_ref() {
                return Ok(Arc::clone(stream));
            }
            let stream = Stream::spawn(false, "standin-per-thread".into())?;
            *slot = Some(Arc::clone(&stream));
            Ok(stream)
        }),
        _ => STREAMS.get(handle).ok_or_else(|| {
            log(&format!(
                "{call} refused: unknown or destroyed stream {handle:#x}"
            ));
            code::INVALID_HANDLE
        }),
    }
}

/// Submits `work` to the stream behind `handle`; on a capturing stream it is recorded
/// into the capture instead (run only when the graph is launched) and the ticket is 0.
/// See [`submit_plain`] for the order it runs in.
pub fn submit(handle: usize, call: &str, work: Node) -> Result<(Arc<Stream>, u64), u32> {
    let stream = resolve(handle, call)?;
    if let Some(capture) = stream.capture() {
        capture.add_node(handle, work, call)?;
        return Ok((stream, 0));
    }
    submit_plain(handle, call, Box::new(move || work()))
}

/// Submits `work` to the stream behind `handle` for one run, after the legacy default
/// stream's implicit synchronisation: work on the legacy stream waits for all earlier work
/// of blocking streams, and work on a blocking stream waits for earlier legacy work.
/// Returns the stream and the work's ticket. Capture is not consulted: callers refuse
/// what cannot be captured first.
pub fn submit_plain(handle: usize, call: &str, work: Work) -> Result<(Arc<Stream>, u64), u32> {
    let stream = resolve(handle, call)?;
    let legacy_stream = legacy()?;
    if Arc::ptr_eq(&stream, &legacy_stream) {
        for other in STREAMS.all() {
            if !other.non_blocking {
                let ticket = other.submitted();
                stream.push(Box::new(move || other.wait_for(ticket)));
            }
        }
    } else if !stream.non_blocking {
        let ticket = legacy_stream.submitted();
        if ticket > 0 {
            stream.push(Box::new(move || legacy_stream.wait_for(ticket)));
        }
    }
    let ticket = stream.push(work);
    Ok((stream, ticket))
}

/// Blocks until all work submitted to the stream so far has run.
pub fn synchronize(handle: usize) -> Result<(), u32> {
    let stream = resolve(handle, "cuStreamSynchronize")?;
    graph::refuse_on(&stream, "cuStreamSynchronize", "synchronising it")?;
    let ticket = stream.submitted();
    stream.wait_for(ticket);
    Ok(())
}

/// `cuStreamQuery`: whether all submitted work has run.
pub fn query(handle: usize) -> Result<bool, u32> {
    Ok(resolve(handle, "cuStreamQuery")?.idle())
}

/// Blocks until every stream has run everything submitted so far.
pub fn synchronize_all() {
    let mut streams = STREAMS.all();
    if let Some(stream) = lock(&LEGACY).as_ref() {
        streams.push(Arc::clone(stream));
    }
    for stream in streams {
        let ticket = stream.submitted();
        stream.wait_for(ticket);
    }
}

struct EventState {
    /// Records submitted.
    recorded: u64,
    /// Every record up to this generation has run.
    done_upto: u64,
    /// Records above `done_upto` that have run (records on different streams finish in
    /// any order, and a wait is bound to one record, not to "a later one finished").
    done_above: BTreeSet<u64>,
    /// When the latest record ran (set only if it was still the latest when it ran).
    at: Option<Instant>,
    /// The latest record was made in a capture: (capture id, record id within it).
    captured: Option<(u64, usize)>,
}

impl EventState {
    fn is_done(&self, generation: u64) -> bool {
        generation <= self.done_upto || self.done_above.contains(&generation)
    }

    fn complete(&mut self, generation: u64) {
        self.done_above.insert(generation);
        while self.done_above.remove(&(self.done_upto + 1)) {
            self.done_upto += 1;
        }
        if generation == self.recorded {
            self.at = Some(Instant::now());
        }
    }
}

/// A CUDA event.
pub struct Event {
    timing: bool,
    state: Mutex<EventState>,
    changed: Condvar,
}

impl Event {
    fn wait_generation(&self, generation: u64) {
        let mut state = lock(&self.state);
        while !state.is_done(generation) {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

static EVENTS: Handles<Event> = Handles::new(0x6000_0000);

/// `CU_EVENT_DISABLE_TIMING`.
const DISABLE_TIMING: u32 = 2;

/// Creates an event.
pub fn event_create(flags: u32) -> usize {
    EVENTS.insert(Arc::new(Event {
        timing: flags & DISABLE_TIMING == 0,
        state: Mutex::new(EventState {
            recorded: 0,
            done_upto: 0,
            done_above: BTreeSet::new(),
            at: None,
            captured: None,
        }),
        changed: Condvar::new(),
    }))
}

fn event(handle: usize, call: &str) -> Result<Arc<Event>, u32> {
    EVENTS.get(handle).ok_or_else(|| {
        log(&format!(
            "{call} refused: unknown or destroyed event {handle:#x}"
        ));
        code::INVALID_HANDLE
    })
}

/// Destroys an event (pending records and waits still complete).
pub fn event_destroy(handle: usize) -> Result<(), u32> {
    EVENTS.remove(handle).map(drop).ok_or_else(|| {
        log(&format!(
            "cuEventDestroy({handle:#x}) refused: unknown event"
        ));
        code::INVALID_HANDLE
    })
}

/// Records the event on a stream: it completes when the stream reaches this point. On a
/// capturing stream the record is part of the capture (a later wait on it is a captured
/// dependency, or makes the waiting stream join the capture).
pub fn event_record(handle: usize, stream: usize) -> Result<(), u32> {
    let event = event(handle, "cuEventRecord")?;
    let target = resolve(stream, "cuEventRecord")?;
    if let Some(capture) = target.capture() {
        let id = capture.add_record(stream, "cuEventRecord")?;
        lock(&event.state).captured = Some((capture.id(), id));
        return Ok(());
    }
    let generation = {
        let mut state = lock(&event.state);
        state.recorded += 1;
        state.captured = None;
        state.recorded
    };
    let target = Arc::clone(&event);
    submit_plain(
        stream,
        "cuEventRecord",
        Box::new(move || {
            lock(&target.state).complete(generation);
            target.changed.notify_all();
        }),
    )?;
    Ok(())
}

/// The capture in progress that the event's latest record belongs to, if any.
fn captured_in(event: &Event) -> Option<(Arc<Capture>, usize)> {
    let (capture, id) = lock(&event.state).captured?;
    graph::active_capture(capture).map(|c| (c, id))
}

/// Refuses querying or synchronising an event last recorded in a capture in progress
/// (`CUDA_ERROR_CAPTURED_EVENT`), invalidating that capture.
fn refuse_captured(event: &Event, call: &str) -> Result<(), u32> {
    if let Some((capture, _)) = captured_in(event) {
        capture.invalidate(call, "the event was last recorded in a capturing stream");
        log(&format!(
            "{call} refused: the event was last recorded in a capturing stream (CUDA_ERROR_CAPTURED_EVENT)"
        ));
        return Err(capture_code::CAPTURED_EVENT);
    }
    Ok(())
}

/// Makes later work on `stream` wait for the event's latest record submitted before this
/// call (a never-recorded event imposes no wait). A record made in a capture makes the
/// wait part of that capture, and a stream not capturing joins it; a capturing stream
/// waiting on a record made outside its capture is refused
/// (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`).
pub fn stream_wait_event(stream: usize, handle: usize) -> Result<(), u32> {
    const CALL: &str = "cuStreamWaitEvent";
    let event = event(handle, CALL)?;
    let waiting = resolve(stream, CALL)?;
    let mine = waiting.capture();
    if let Some((capture, id)) = captured_in(&event) {
        match &mine {
            Some(c) if c.id() != capture.id() => {
                log(&format!(
                    "{CALL} refused: the stream captures into another capture (CUDA_ERROR_STREAM_CAPTURE_MERGE)"
                ));
                return Err(capture_code::MERGE);
            }
            Some(_) => {}
            None => waiting.set_capture(Some(Arc::clone(&capture))),
        }
        return capture.add_wait(stream, &waiting, id, CALL);
    }
    let generation = lock(&event.state).recorded;
    if let Some(capture) = mine {
        if generation == 0 {
            return Ok(());
        }
        capture.invalidate(CALL, "the event was recorded outside the capture");
        log(&format!(
            "{CALL} refused: a capturing stream waits on an event recorded outside its capture \
             (CUDA_ERROR_STREAM_CAPTURE_ISOLATION)"
        ));
        return Err(capture_code::ISOLATION);
    }
    submit_plain(
        stream,
        CALL,
        Box::new(move || event.wait_generation(generation)),
    )?;
    Ok(())
}

/// Whether the event's latest record has run.
pub fn event_query(handle: usize) -> Result<bool, u32> {
    let event = event(handle, "cuEventQuery")?;
    refuse_captured(&event, "cuEventQuery")?;
    let state = lock(&event.state);
    Ok(state.is_done(state.recorded))
}

/// Blocks until the event's latest record (as of this call) has run.
pub fn event_synchronize(handle: usize) -> Result<(), u32> {
    let event = event(handle, "cuEventSynchronize")?;
    refuse_captured(&event, "cuEventSynchronize")?;
    let generation = lock(&event.state).recorded;
    event.wait_generation(generation);
    Ok(())
}

/// Milliseconds between two completed records, with the driver's errors: an event created
/// with timing disabled or never recorded is `CUDA_ERROR_INVALID_HANDLE`; a record still
/// pending is `CUDA_ERROR_NOT_READY`.
pub fn event_elapsed(start: usize, end: usize) -> Result<f32, u32> {
    let mut times = [None; 2];
    for (slot, handle) in times.iter_mut().zip([start, end]) {
        let event = event(handle, "cuEventElapsedTime")?;
        refuse_captured(&event, "cuEventElapsedTime")?;
        let state = lock(&event.state);
        if !event.timing || state.recorded == 0 {
            log(&format!(
                "cuEventElapsedTime refused: event {handle:#x} {}",
                if event.timing {
                    "was never recorded"
                } else {
                    "was created with CU_EVENT_DISABLE_TIMING"
                }
            ));
            return Err(code::INVALID_HANDLE);
        }
        if !state.is_done(state.recorded) {
            return Err(code::NOT_READY);
        }
        *slot = state.at;
    }
    match times {
        [Some(a), Some(b)] => Ok(if b >= a {
            (b - a).as_secs_f32() * 1e3
        } else {
            -((a - b).as_secs_f32() * 1e3)
        }),
        _ => Err(code::INVALID_HANDLE),
    }
}
