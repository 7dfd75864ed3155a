//! Host nodes: a host stream's tasks inside a recorded step, as host functions
//! (`cuLaunchHostFunc`) on the stream's own CUDA stream, its host lane. Captured into a
//! graph they are the graph's host nodes, so a step whose host work waits for the device
//! (CGOPipe's CPU attention between its GPU halves) still replays as one graph launch.
//!
//! Takes the host engine and the step's state from the backend for the time the step's
//! work can run ([`HostCalls::open`] .. [`HostCalls::close`]); gives a function pointer and
//! a data pointer per (stream, task) that run the task over that state when the stream
//! reaches it. A task that fails there cannot fail the stream (the driver's callback
//! returns nothing): the first failure is kept and the backend returns it once the lanes
//! have finished ([`HostCalls::take_failure`]).

use crate::ir::{Engine, StreamId};
use crate::lower::PlanTask;
use crate::runtime::backend::Backend;
use crate::runtime::step::StepContext;
use crate::runtime::sync::lock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The host engine and the step's state, lifetimes erased: valid from
/// [`HostCalls::open`] until [`HostCalls::close`], which the backend calls only once no
/// host function of the step can still run.
#[derive(Clone, Copy)]
struct Open {
    host: *const (dyn Backend + 'static),
    state: *const (dyn StepContext + 'static),
}

// SAFETY: both point to `Sync` objects (`Backend: Sync`, `StepContext: Sync`) that the
// backend keeps alive while the pointers are set (the contract of `HostCalls::open`).
unsafe impl Send for Open {}

/// What the host functions of a backend run over, and their first failure.
#[derive(Default)]
pub struct HostCalls {
    open: Mutex<Option<Open>>,
    failure: Mutex<Option<String>>,
    ran: AtomicUsize,
}

impl std::fmt::Debug for HostCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCalls")
            .field("ran", &self.ran.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl HostCalls {
    /// Host functions run `host` over `state` from now on.
    ///
    /// # Safety
    ///
    /// `host` and `state` must stay alive and unmoved until [`HostCalls::close`], and the
    /// caller must not call `close` while a host function it submitted can still run
    /// (it synchronises every lane first).
    pub unsafe fn open(&self, host: &dyn Backend, state: &dyn StepContext) {
        // SAFETY: only the lifetimes change (same fat pointers); the caller keeps both
        // alive while they are set.
        let open = unsafe {
            Open {
                host: std::mem::transmute::<*const dyn Backend, *const (dyn Backend + 'static)>(
                    host,
                ),
                state: std::mem::transmute::<
                    *const dyn StepContext,
                    *const (dyn StepContext + 'static),
                >(state),
            }
        };
        *lock(&self.open) = Some(open);
    }

    /// Host functions find nothing to run over from now on (each one that still ran
    /// would record a failure).
    pub fn close(&self) {
        *lock(&self.open) = None;
    }

    /// The first failure of a host function since the last call, if any.
    pub fn take_failure(&self) -> Option<String> {
        lock(&self.failure).take()
    }

    /// Host functions run so far.
    pub fn ran(&self) -> usize {
        self.ran.load(Ordering::Relaxed)
    }

    fn fail(&self, why: String) {
        lock(&self.failure).get_or_insert(why);
    }

    fn run(&self, node: &HostNode) {
        self.ran.fetch_add(1, Ordering::Relaxed);
        let Some(open) = *lock(&self.open) else {
            self.fail(format!(
                "host node `{}` ran outside its step (no step state open)",
                node.task.name
            ));
            return;
        };
        // SAFETY: `open` is set only while its objects are alive (`HostCalls::open`'s
        // contract), and the backend closes it only after every lane that could call
        // this has finished, so the references do not outlive them.
        let (host, state) = unsafe { (&*open.host, &*open.state) };
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host.run(node.stream, node.engine, &node.task, state)
        }));
        match ran {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.fail(format!("host task `{}` failed: {e}", node.task.name)),
            Err(_) => self.fail(format!("host task `{}` panicked", node.task.name)),
        }
    }
}

/// One host task as a host function's data: the stream, engine and task it runs and the
/// calls it runs through. Kept alive by the commands (and graphs) that hold it.
#[derive(Debug)]
pub struct HostNode {
    calls: Arc<HostCalls>,
    /// The plan stream it belongs to.
    pub stream: StreamId,
    engine: Engine,
    /// The task.
    pub task: PlanTask,
}

impl HostNode {
    /// Task `task` of host stream `stream` as a host function over `calls`.
    pub fn new(calls: Arc<HostCalls>, stream: StreamId, task: &PlanTask) -> Self {
        HostNode {
            calls,
            stream,
            engine: task.engine,
            task: task.clone(),
        }
    }

    /// The function a host lane calls with [`HostNode::data`].
    pub fn function(&self) -> unsafe extern "C" fn(*mut std::ffi::c_void) {
        run_host_node
    }

    /// The data pointer for [`HostNode::function`]: this node, alive as long as the
    /// command or graph holding its `Arc`.
    pub fn data(self: &Arc<Self>) -> *mut std::ffi::c_void {
        Arc::as_ptr(self).cast_mut().cast()
    }
}

/// A host function: runs the [`HostNode`] at `data`.
///
/// # Safety
///
/// `data` is [`HostNode::data`] of a node that is still alive (the command or captured
/// graph that submitted it holds an `Arc` of it until the backend is dropped, after its
/// streams have finished).
unsafe extern "C" fn run_host_node(data: *mut std::ffi::c_void) {
    // SAFETY: the function's contract.
    let node = unsafe { &*(data as *const HostNode) };
    node.calls.run(node);
}
