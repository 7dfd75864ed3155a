//! What every backend's ops share: the op table's plumbing, the error an op fails with, and
//! the step lookups every kernel makes.
//!
//! Takes a backend's kernels (one per [`OpKind`], in an [`OpTable`]) and its context (an
//! [`OpCx`]: the step state and the model's expert count); gives the run of one task
//! ([`run_task`]: arguments resolved to host-memory views, the kernel, then every written
//! view handed back so weight labels are forgotten), the micro-batch and expert lookups,
//! [`OpError`], the one error type of both backends' ops. (The MoE layer's contract and its
//! host-side grouping, `ExpertGroups`, are model vocabulary: `model::vocab`.) Guarantees:
//! the words of an error are the same whichever backend reports it; what only one backend
//! can refuse (a CPU kernel's shape check, a CUDA launch) travels inside
//! [`OpError::Backend`] with its own words.

use crate::ir::catalog::OpKind;
use crate::ir::{ExpertRef, ExpertSet};
use crate::lower::PlanTask;
use crate::runtime::args::MissingArg;
use crate::runtime::backend::ShortRoute;
use crate::runtime::host::memory::{HostMemory, MemoryError, View};
use crate::runtime::host::weights::WeightTag;
use crate::runtime::step::{MicroBatchState, StepContext};

/// A task's arguments as views of host memory (a device backend turns them into device
/// addresses itself).
pub type TaskArgs = crate::runtime::args::TaskArgs<View>;

/// Why an op failed.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// A view could not be made.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A `route` argument shorter than its micro-batch's routing.
    #[error(transparent)]
    Route(#[from] ShortRoute),
    /// A weight the op needs is not wholly inside its `w` arguments.
    #[error("{tag} is not (wholly) in the task's `w` argument(s)")]
    MissingWeight {
        /// The tensor.
        tag: WeightTag,
    },
    /// An argument the op needs is absent.
    #[error("missing `{0}` argument")]
    MissingArg(&'static str),
    /// An activation argument too small for the micro-batch.
    #[error("`{role}` holds {got} bytes but this micro-batch needs {needed}")]
    TooSmall {
        /// The argument.
        role: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        got: u64,
    },
    /// Bytes that are not whole f32s/u32s at an aligned address.
    #[error("`{0}` is not 4-byte aligned")]
    Align(&'static str),
    /// A copy between slices of different lengths.
    #[error("copy of {src} bytes into {dst}")]
    CopyLength {
        /// Source bytes.
        src: u64,
        /// Destination bytes.
        dst: u64,
    },
    /// A micro-batch index past the step's micro-batches.
    #[error("micro-batch {0} does not exist in this run")]
    Ub(u32),
    /// What a backend's kernels do not take (named, never run wrong).
    #[error("the {backend} kernels do not support {what}")]
    Unsupported {
        /// The backend (`CPU`, `CUDA`).
        backend: &'static str,
        /// What is not supported.
        what: String,
    },
    /// A KV block table that does not cover a token, or a block past the cache.
    #[error("KV cache: {0}")]
    Kv(String),
    /// An op of the table a backend has no kernel for (a failing test, not a user's run).
    #[error("the {backend} backend has no kernel for `{op}`")]
    NoKernel {
        /// The backend.
        backend: &'static str,
        /// The op.
        op: &'static str,
    },
    /// A kernel table row that pairs an op kind with another op's kernel.
    #[error("the {backend} kernel of `{kernel}` was given a `{op}` task")]
    WrongKernel {
        /// The backend.
        backend: &'static str,
        /// The op the kernel implements.
        kernel: &'static str,
        /// The task's op.
        op: &'static str,
    },
    /// What only one backend refuses, in its own words (a CPU kernel's input check, a
    /// device allocation, launch or copy).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
}

impl From<MissingArg> for OpError {
    fn from(e: MissingArg) -> Self {
        OpError::MissingArg(e.0)
    }
}

/// `view` if it holds at least `needed` bytes, else the error naming its role.
pub fn sized(view: View, role: &'static str, needed: usize) -> Result<View, OpError> {
    if needed as u64 > view.len {
        return Err(OpError::TooSmall {
            role,
            needed: needed as u64,
            got: view.len,
        });
    }
    Ok(view)
}

/// One backend's kernel per op kind: `K` is its kernel function type. An op of the table
/// without a row is a failing test ([`OpTable::gaps`]), not a user's run.
#[derive(Debug)]
pub struct OpTable<K: 'static> {
    /// The backend, as its errors name it (`CPU`, `CUDA`).
    pub backend: &'static str,
    rows: &'static [(OpKind, K)],
}

impl<K: Copy> OpTable<K> {
    /// The table of `backend` with these rows.
    pub const fn new(backend: &'static str, rows: &'static [(OpKind, K)]) -> Self {
        OpTable { backend, rows }
    }

    /// The kernel of `kind`, if the backend implements it.
    pub fn get(&self, kind: OpKind) -> Option<K> {
        self.rows
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, kernel)| *kernel)
    }

    /// The kernel of `kind`, or the error naming the op the backend lacks.
    pub fn kernel(&self, kind: OpKind) -> Result<K, OpError> {
        self.get(kind).ok_or(OpError::NoKernel {
            backend: self.backend,
            op: kind.name(),
        })
    }

    /// Every op kind of the catalog with no row or more than one, with its row count: empty
    /// for a complete table (the lookup would silently take the first of two).
    pub fn gaps(&self) -> Vec<(OpKind, usize)> {
        OpKind::ALL
            .into_iter()
            .map(|kind| (kind, self.rows.iter().filter(|(k, _)| *k == kind).count()))
            .filter(|&(_, rows)| rows != 1)
            .collect()
    }
}

/// What every backend's op context answers: the step a task reads and the model's expert
/// count, and from them the lookups every kernel makes.
pub trait OpCx {
    /// The backend, as its errors name it (`CPU`, `CUDA`).
    const BACKEND: &'static str;

    /// The step the task runs in.
    fn step(&self) -> &dyn StepContext;

    /// Routed experts per layer.
    fn experts(&self) -> usize;

    /// Micro-batch `ub` of the step.
    fn ub(&self, ub: u32) -> Result<&MicroBatchState, OpError> {
        self.step().micro_batch(ub).ok_or(OpError::Ub(ub))
    }

    /// An expert of an op's set (predictions never name one: elaboration refuses them).
    fn resolve_expert(&self, expert: ExpertRef) -> u32 {
        self.step().resolve_expert(expert, self.experts() as u32)
    }

    /// The experts of an op's set, run-time ones resolved now.
    fn members(&self, set: ExpertSet) -> Vec<u32> {
        set.members(self.experts() as u64)
            .into_iter()
            .map(|e| self.resolve_expert(e))
            .collect()
    }

    /// The error for a kernel handed another op's task (the table pairs them by kind, so
    /// only a wrong table row gets here).
    fn wrong_op(&self, kernel: OpKind, task: &PlanTask) -> OpError {
        OpError::WrongKernel {
            backend: Self::BACKEND,
            kernel: kernel.name(),
            op: task.op.name(),
        }
    }
}

/// Runs one task: resolves its arguments to views of `memory` (a run-time expert of a layer,
/// or the slot of a cache, resolved now), runs `kernel` on them, then hands `clobber` every
/// view the task wrote. A copy moves the weight labels with its bytes; every other op's
/// writes leave activations where weights may have been, so their labels must go.
pub fn run_task<C: OpCx>(
    cx: &C,
    memory: &HostMemory<'_>,
    task: &PlanTask,
    kernel: impl FnOnce(&TaskArgs) -> Result<(), OpError>,
    clobber: impl Fn(View),
) -> Result<(), OpError> {
    let views = task
        .args
        .iter()
        .map(|a| {
            let expert = cx.step().arg_index(task.id, a, cx.experts() as u32);
            Ok((*a, memory.view(task, a, expert)?))
        })
        .collect::<Result<Vec<_>, OpError>>()?;
    let args = TaskArgs::new(views);
    kernel(&args)?;
    if task.op.kind() != OpKind::Copy {
        for (a, v) in args.iter() {
            if a.access.writes() {
                clobber(*v);
            }
        }
    }
    Ok(())
}
