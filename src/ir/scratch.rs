//! The interface a backend's scratch rules plug into: how many bytes of a device stream's
//! workspace one GPU task takes, as plain IR data.
//!
//! Takes nothing; gives [`DeviceScratch`] (a backend's rules, registered with it and handed
//! to the compiler in `elaborate::Options::scratch`), [`TaskFacts`] (what a task's scratch
//! depends on besides the model: its op, shape and argument counts), [`TaskScratch`] (the
//! rules for one model and workload, asked per task) and [`stream_bounds`] (per stream,
//! the largest bound over its tasks). The rules themselves follow a backend's own kernel
//! choices and live with it (`runtime::cuda::scratch`, the one source of truth): the budget
//! (`cost::budget`), the language's `gpu_scratch(n, s, c)` and the backend's workspace
//! reservation all ask the same rules, and neither the compiler nor the cost model imports
//! the runtime (the dependency points from the backend to this interface, as
//! `Registration::mla_values_in_keys` hands the compiler a backend's KV layout).

use super::catalog::{Op, Shape};
use super::{KvPart, Role, TaskId, Workload};
use crate::model::card::ModelCard;

/// What a task's scratch depends on besides the model: its op, shape and arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskFacts {
    /// The op.
    pub op: Op,
    /// Its shape (tokens, sequences, context).
    pub shape: Shape,
    /// An `attn` task with a `kv` argument (without one it attends over a scratch cache of
    /// this call's K/V).
    pub kv_arg: bool,
    /// `a` arguments (`post_attn`: two merge prefill and decode rows into scratch).
    pub a_args: usize,
    /// `acc` arguments (`combine`: two or more are summed into scratch).
    pub acc_args: usize,
    /// A copy of part of a KV cache (a recorded step uploads its table of byte runs).
    pub kv_copy: Option<KvPart>,
}

impl TaskFacts {
    /// The facts of a task with `op`, `shape`, a KV-part copy's part and arguments of
    /// `roles`.
    pub fn new(
        op: Op,
        shape: Shape,
        kv_copy: Option<KvPart>,
        roles: impl Iterator<Item = Role>,
    ) -> Self {
        let (mut kv_arg, mut a_args, mut acc_args) = (false, 0, 0);
        for role in roles {
            match role {
                Role::Kv => kv_arg = true,
                Role::A => a_args += 1,
                Role::Acc => acc_args += 1,
                _ => {}
            }
        }
        TaskFacts {
            op,
            shape,
            kv_arg,
            a_args,
            acc_args,
            kv_copy,
        }
    }
}

/// A backend's scratch rules for one model and workload.
pub trait TaskScratch {
    /// Bytes of workspace a task of `facts` takes at most (the sum of its pieces).
    fn task_bytes(&mut self, facts: &TaskFacts) -> u64;
}

/// A backend's scratch rules, as the compiler asks them: registered by a backend whose
/// device streams each keep a workspace of their own (`runtime::Registration::scratch`).
/// Shared by every compile (`Sync`) and kept in `Options`, which a panic boundary may
/// cross (`RefUnwindSafe`).
pub trait DeviceScratch: Sync + std::panic::RefUnwindSafe + std::fmt::Debug {
    /// The backend's name, for the budget and the diagnostics.
    fn backend(&self) -> &'static str;
    /// The rules for `card`'s weights as stored and `workload`'s sequences.
    fn rules(&self, card: &ModelCard, workload: &Workload) -> Box<dyn TaskScratch>;
    /// The most scratch one GPU task of a micro-batch of `tokens` new tokens over `seqs`
    /// sequences, each attending to `context` tokens, takes on `card` (every op, every
    /// layer, all experts): the language's `gpu_scratch(n, s, c)`.
    fn max_task_bytes(&self, card: &ModelCard, tokens: u64, seqs: u64, context: u64) -> u64;
}

/// Per stream (of `streams`), the largest bound of `rules` over its tasks in `tasks`
/// (stream index, task, facts) and the first task that takes it; `None` for a stream
/// without tasks there. One workspace per device stream, so the budget counts each of
/// these and the backend reserves each.
pub fn stream_bounds(
    rules: &mut dyn TaskScratch,
    streams: usize,
    tasks: impl IntoIterator<Item = (usize, TaskId, TaskFacts)>,
) -> Vec<Option<(u64, TaskId)>> {
    let mut out: Vec<Option<(u64, TaskId)>> = vec![None; streams];
    for (stream, task, facts) in tasks {
        let bytes = rules.task_bytes(&facts);
        if let Some(slot) = out.get_mut(stream) {
            if slot.is_none_or(|(best, _)| bytes > best) {
                *slot = Some((bytes, task));
            }
        }
    }
    out
}

/// The GPU-side ops of one layer a micro-batch runs, with every expert and a KV argument:
/// what `gpu_scratch(n, s, c)` takes the largest task over (the head and sampling once).
pub fn max_task_ops(layers: u32) -> impl Iterator<Item = Op> {
    use super::catalog::{AttnPart, ExpertSet};
    let ub = 0;
    [Op::LmHead { ub }, Op::Sample { ub }]
        .into_iter()
        .chain((0..layers).flat_map(move |layer| {
            [
                Op::PreAttn { layer, ub },
                Op::Attn {
                    layer,
                    ub,
                    part: AttnPart::All,
                },
                Op::PostAttn { layer, ub },
                Op::OProj { layer, ub },
                Op::Gate { layer, ub },
                Op::Pregate { layer, ub },
                Op::Experts {
                    layer,
                    ub,
                    set: ExpertSet::All,
                },
            ]
        }))
}

/// The facts of a `gpu_scratch` task: `op` over `shape`, a KV cache argument, one `a` and
/// one `acc` argument.
pub fn max_task_facts(op: Op, shape: Shape) -> TaskFacts {
    TaskFacts {
        op,
        shape,
        kv_arg: true,
        a_args: 1,
        acc_args: 1,
        kv_copy: None,
    }
}

/// The shape of a `gpu_scratch(tokens, seqs, context)` task: f32 activations and cache, as
/// the runtime computes.
pub fn max_task_shape(tokens: u64, seqs: u64, context: u64) -> Shape {
    Shape {
        tokens,
        seqs,
        context,
        act_bytes: super::catalog::ACT_BYTES,
        kv_bytes: super::catalog::ACT_BYTES,
    }
}

/// `gpu_scratch(n, s, c)` without a backend's rules: the op catalog's workspace
/// ([`super::catalog::workspace_bytes`]) of the largest task of `shape`, what the budget
/// counts for GPU tasks then.
pub fn catalog_max_task_bytes(card: &ModelCard, shape: &Shape) -> u64 {
    max_task_ops(card.layers as u32)
        .map(|op| super::catalog::workspace_bytes(&op, card, shape))
        .max()
        .unwrap_or(0)
}
