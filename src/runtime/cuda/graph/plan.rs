//! What the plan alone says about recording a step for a CUDA graph: whether a step's
//! guards can be decided on the device, whether it holds a host decision, and how each
//! of its host streams takes part in a recorded step (host nodes, or label moves made
//! while recording).

use crate::ir::{Engine, ExpertRef, ExpertSet, GuardAtom, Op, StepKind};
use crate::lower::{ExecPlan, Instr, Placement, PlanTask};

/// Whether the device computes nothing for `task` when its guard is false, so the task
/// may run whatever its guard and its routing need not come to the host: an `experts`
/// task of one fixed expert on a device stream whose every literal is `active` of that
/// expert in its own layer and micro-batch (Fiddler's resident arm). Its kernels group the
/// routed tokens on the device ([`super::super::ops`]' `moe_group`): for an expert no token was
/// routed to they find no rows and write nothing, which is what skipping it leaves.
pub fn guard_decided_on_device(task: &PlanTask, on_device: impl Fn(usize) -> bool) -> bool {
    if task.guard.is_always() || task.cache.is_some() || !on_device(task.stream.index()) {
        return false;
    }
    let Op::Experts {
        layer,
        ub,
        set: ExpertSet::One(ExpertRef::Index(e)),
    } = task.op
    else {
        return false;
    };
    task.guard.lits.iter().all(|lit| {
        !lit.negated
            && lit.atom
                == GuardAtom::Active {
                    layer,
                    expert: ExpertRef::Index(e),
                    ub: Some(ub),
                }
    })
}

/// How a host stream (`cpu.compute`, `cpu.copy`) takes part in a recorded step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostRole {
    /// Its tasks become host nodes of the step's graph: each task is recorded as a host
    /// function on the stream's own CUDA stream (its host lane), its waits for device
    /// work as event waits there and its records as events the device streams wait on,
    /// so the graph runs the host work where the plan puts it and nothing on the host
    /// waits inside the step. A task runs when the graph reaches it, over the step's
    /// state (the backend keeps the step's state for the host functions until every lane
    /// has finished).
    Nodes,
    /// Every task is a weight copy out of the checkpoint into a host arena while copies
    /// bind: it moves labels only, which the device copies recorded after it resolve
    /// into addresses of the registered checkpoint while they are recorded. So its tasks
    /// run while the step is recorded, in the plan's order, and its waits for device
    /// work are not kept: a label move touches no byte a device task reads (the bytes no
    /// label covers, the checkpoint's padding between tensors, are copied as well and no
    /// kernel reads them as weights).
    Labels,
}

/// What the plan alone says about recording a step for a graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlanGraph {
    /// Why the step cannot be recorded (`None`: it can).
    pub reason: Option<String>,
    /// Its guards are all [`guard_decided_on_device`]: the routing read-backs it has for
    /// them are skipped and the guarded tasks run.
    pub device_guards: bool,
    /// Per plan stream, the role of a host stream with tasks in the step (`None` for
    /// device streams and idle host streams).
    pub host_roles: Vec<Option<HostRole>>,
}

/// Whether a task only moves weight labels when copies bind: a plain copy (no KV part,
/// live rows or cache slot) from the checkpoint into a host arena.
fn moves_labels(plan: &ExecPlan, task: &PlanTask) -> bool {
    let placement = |i: usize| {
        task.args
            .get(i)
            .and_then(|a| plan.buffers.get(a.buffer.index()))
            .map(|b| &b.placement)
    };
    task.op == Op::Copy
        && task.kv.is_none()
        && task.live.is_none()
        && task.cache.is_none()
        && matches!(placement(0), Some(Placement::Checkpoint))
        && matches!(
            placement(1),
            Some(Placement::Arena {
                space: crate::ir::Space::Pinned | crate::ir::Space::Host,
                ..
            })
        )
}

/// The role of host stream `s` in step `sp`, or why it has none. `binds`: the host
/// memory's weight copies bind (`HostMemory::binds`).
fn host_role(
    plan: &ExecPlan,
    sp: &crate::lower::StepPlan,
    s: usize,
    binds: bool,
) -> Result<Option<HostRole>, String> {
    let name = &plan.streams[s].name;
    let tasks: Vec<&PlanTask> = sp.programs[s]
        .iter()
        .filter_map(|i| match *i {
            Instr::Run(t) => plan.tasks.get(t.index()),
            _ => None,
        })
        .collect();
    if tasks.is_empty() {
        return Ok(None);
    }
    if let Some(t) = tasks
        .iter()
        .find(|t| !t.guard.is_always() || t.kv.is_some() || t.live.is_some())
    {
        return Err(format!(
            "host stream `{name}` runs `{}`, a guarded task or a KV-part or live-row copy,              which a host node does not hold",
            t.name
        ));
    }
    // A host copy moves the weight labels of what it copies, and the device copies
    // recorded after it read them while they are recorded: only a copy that moves labels
    // alone (binding, out of the checkpoint) can run then; one that copies bytes cannot,
    // and as a host node it would move its labels too late.
    let copies = tasks.iter().filter(|t| t.op == Op::Copy).count();
    let labels = tasks
        .iter()
        .filter(|t| binds && moves_labels(plan, t))
        .count();
    if labels == tasks.len() {
        return Ok(Some(HostRole::Labels));
    }
    if copies > 0 {
        return Err(format!(
            "host stream `{name}` copies bytes ({copies} copies, {labels} of them weight-label \
             moves), whose labels the device copies recorded after them read"
        ));
    }
    Ok(Some(HostRole::Nodes))
}

/// The host streams' roles in step `sp`, or why they cannot be recorded: each host stream
/// with tasks gets one ([`host_role`]), and no host-node task may read a buffer a label
/// stream writes (its labels move while the step is recorded, before the node runs).
fn host_roles(
    plan: &ExecPlan,
    sp: &crate::lower::StepPlan,
    on_device: impl Fn(usize) -> bool,
    binds: bool,
) -> Result<Vec<Option<HostRole>>, String> {
    let mut roles = vec![None; plan.streams.len()];
    for (s, role) in roles.iter_mut().enumerate() {
        if !on_device(s) && s < sp.programs.len() {
            *role = host_role(plan, sp, s, binds)?;
        }
    }
    let tasks_of = |role: HostRole| {
        let roles = &roles;
        sp.programs.iter().enumerate().flat_map(move |(s, p)| {
            p.iter().filter_map(move |i| match *i {
                Instr::Run(t) if roles[s] == Some(role) => plan.tasks.get(t.index()),
                _ => None,
            })
        })
    };
    let labelled: Vec<_> = tasks_of(HostRole::Labels)
        .filter_map(|t| t.args.get(1).map(|a| a.buffer))
        .collect();
    if let Some(t) = tasks_of(HostRole::Nodes).find(|t| {
        t.args
            .iter()
            .any(|a| a.access.reads() && labelled.contains(&a.buffer))
    }) {
        return Err(format!(
            "host task `{}` reads a buffer whose weight labels another host stream moves \
             while the step is recorded",
            t.name
        ));
    }
    Ok(roles)
}

/// Whether host nodes are switched off (`MOEC_CUDA_HOST_NODES=off`, read once): a step
/// with a host stream waiting for device work is launched plainly, as before host nodes.
/// A test hook: the counts before and after (tests/cuda_executor.rs).
pub fn host_nodes_switched_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("MOEC_CUDA_HOST_NODES").as_deref() == Ok("off"))
}

/// Whether step `step` of `plan` can be recorded for a graph, judged from the plan alone:
/// not when it is neither a decode nor a mixed step (the others do not repeat), or holds
/// a host decision (a routing read-back for guards the device cannot decide, an expert
/// cache's fetch, a host stream whose tasks can be neither host nodes nor label moves,
/// [`HostRole`]).
/// `binds`: the host memory's weight copies bind.
pub fn plan_graph(plan: &ExecPlan, step: usize, binds: bool) -> StepPlanGraph {
    let no = |why: String| StepPlanGraph {
        reason: Some(why),
        device_guards: false,
        host_roles: Vec::new(),
    };
    let Some(sp) = plan.steps.get(step) else {
        return no("not a step of the plan".into());
    };
    // A mixed step (VSLPipe's `step`: prefill and decode rows in one pass) repeats its
    // commands once its passes hold only decoding sequences of unchanged shape, so it is
    // recorded like a decode step: one whose commands differ from every graph's (a pass
    // admitting a prompt) is submitted plainly and reported so, and one that repeats the
    // previous pass is captured, then replayed.
    if !matches!(sp.kind, StepKind::Decode | StepKind::Mixed) {
        return no(format!(
            "{} steps do not repeat within a batch; graphs are for decode and mixed steps",
            sp.kind.as_str()
        ));
    }
    let on_device = |s: usize| {
        plan.streams.get(s).is_some_and(|s| {
            matches!(
                s.engine,
                Engine::GpuCompute | Engine::GpuCopyIn | Engine::GpuCopyOut
            )
        })
    };
    let task = |t: crate::ir::TaskId| plan.tasks.get(t.index());
    let (mut readbacks, mut caches, mut host_guards, mut hot) = (0, 0, 0, 0);
    let mut host_wait = None;
    for (s, program) in sp.programs.iter().enumerate() {
        for instr in program {
            match *instr {
                Instr::ReadRouting(_) => readbacks += 1,
                Instr::Run(t) => {
                    if let Some(t) = task(t) {
                        caches += usize::from(t.cache.is_some());
                        host_guards += usize::from(
                            !t.guard.is_always() && !guard_decided_on_device(t, on_device),
                        );
                        let hot_set = matches!(
                            t.op,
                            Op::Experts {
                                set: ExpertSet::One(ExpertRef::Hot { .. }),
                                ..
                            }
                        );
                        let hot_arg = t
                            .args
                            .iter()
                            .any(|a| matches!(a.dynamic_expert, Some(ExpertRef::Hot { .. })));
                        hot += usize::from(hot_set || hot_arg);
                    }
                }
                Instr::Wait(e) if !on_device(s) && host_wait.is_none() => {
                    let recorder = sp.events.get(e.0 as usize).and_then(|&t| task(t));
                    if let Some(r) = recorder.filter(|r| on_device(r.stream.index())) {
                        host_wait = Some(format!(
                            "a host stream (`{}`) waits for device task `{}` inside the step",
                            plan.streams[s].name, r.name
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    if readbacks > 0 && (host_guards > 0 || hot > 0) {
        return no(format!(
            "the routing of {readbacks} gates is read back to the host for {} tasks' guards \
             or hot() experts, which the host decides",
            host_guards + hot
        ));
    }
    if caches > 0 {
        return no(format!(
            "{caches} expert-cache fetches pick their slots on the host"
        ));
    }
    let host_roles = match (host_wait, host_nodes_switched_off()) {
        // No host stream waits for the device: its tasks run on the host while the
        // step is recorded, as before host nodes.
        (None, _) => Vec::new(),
        (Some(why), true) => return no(format!("{why} (MOEC_CUDA_HOST_NODES=off)")),
        (Some(why), false) => match host_roles(plan, sp, on_device, binds) {
            Ok(roles) => roles,
            Err(not) => return no(format!("{why}, and {not}")),
        },
    };
    StepPlanGraph {
        reason: None,
        device_guards: readbacks > 0,
        host_roles,
    }
}
