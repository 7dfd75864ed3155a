//! A decode step's graph: the key a step's shape is recorded under, and a recorded step's
//! end (its graph launched, lanes synchronised, read-backs handed over) and replay inputs.

use super::*;

/// The shape of step `step` over `state` ([`graph::StepKey`]).
pub(super) fn step_key(plan: &ExecPlan, step: usize, state: &dyn StepContext) -> graph::StepKey {
    let ubs = (0..plan.micro_batches.count)
        .map(|ub| {
            state.micro_batch(ub).map_or((0, Vec::new()), |mb| {
                let seqs = mb
                    .seqs
                    .iter()
                    .map(|s| (s.new_tokens.len(), s.block_table.len(), s.prefill))
                    .collect();
                (mb.block_size, seqs)
            })
        })
        .collect();
    graph::StepKey {
        step,
        logits: state.wants_logits(),
        ubs,
    }
}

/// Whether step `step` runs a task on a host stream (which a step launched without its
/// tasks would leave out).
pub(super) fn runs_host_tasks(plan: &ExecPlan, step: usize) -> bool {
    plan.steps.get(step).is_none_or(|sp| {
        sp.programs.iter().enumerate().any(|(s, program)| {
            !plan.streams.get(s).is_some_and(|st| is_device(st.engine))
                && program
                    .iter()
                    .any(|i| matches!(i, crate::lower::Instr::Run(_)))
        })
    })
}

/// Whether `MOEC_CUDA_VERIFY_REPLAY=1` (read once): a test mode where a step that could
/// launch its graph without its ops runs them anyway, and the run fails if their commands
/// differ from the graph's ([`graph::Recorder::replay_plan`]'s argument, checked).
pub(super) fn verify_replays() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEC_CUDA_VERIFY_REPLAY").as_deref() == Ok("1"))
}

impl CudaBackend<'_> {
    /// The end of a step as it was recorded or submitted: its graph launched (or its
    /// commands submitted), every lane synchronised, its read-backs handed to `state`.
    pub(super) fn end_recorded_step(
        &self,
        state: &dyn StepContext,
    ) -> Result<StepEnd, BackendError> {
        let step = self.step.load(Ordering::Acquire);
        let (graph, deferred, verified) = self
            .recorder
            .finish(step)
            .map_err(|e| task_error(OpError::from(e)))?;
        if verified {
            self.verified.fetch_add(1, Ordering::Relaxed);
        }
        let times = self.finish_step()?;
        self.recording_step.store(false, Ordering::Release);
        self.device_guards.store(false, Ordering::Release);
        for dev in self.streams.iter().flatten() {
            dev.workspace.release_retired();
        }
        for d in deferred {
            // SAFETY: each address starts the staging bytes a recorded copy filled; every
            // stream was synchronised above, so the copies have finished.
            let bytes = |at: usize, count: usize| unsafe {
                std::slice::from_raw_parts(at as *const u8, count * 4)
            };
            match d {
                Deferred::Sampled { ub, at, count, dst } => {
                    let ids = graph::words(bytes(at, count));
                    self.sampled_ids.wrote(dst, &ids);
                    state.put_sampled(ub, ids);
                }
                Deferred::Logits { ub, at, count } => {
                    state.put_logits(ub, graph::floats(bytes(at, count)));
                }
            }
        }
        if let Some((kind, _)) = lock(&self.plan_reasons).get(&step) {
            let step = GraphStep {
                kind: *kind,
                graph: graph.clone(),
            };
            add_graph_step(&mut lock(&self.graphs), &step);
        }
        Ok(StepEnd {
            times,
            graph: Some(graph),
            split: None,
        })
    }

    /// The staged inputs ((address, bytes)) of step `step` of shape `key` over `state` for
    /// launching its cached graph without its ops, or why it cannot be.
    pub(super) fn replay_inputs(
        &self,
        plan: &ExecPlan,
        step: usize,
        state: &dyn StepContext,
        key: &graph::StepKey,
        ids_on_device: bool,
    ) -> Result<Vec<(usize, Vec<u8>)>, String> {
        let planned = lock(&self.plan_reasons)
            .get(&step)
            .map(|(_, p)| p.clone())
            .ok_or("the step has not run its ops yet")?;
        if let Some(why) = planned.reason {
            return Err(why);
        }
        if !matches!(state.sampling(), Sampling::Greedy) {
            return Err("temperature sampling reads the logits back to the host".into());
        }
        if graphs_switched_off() {
            return Err("CUDA graphs are switched off (MOEC_CUDA_GRAPHS=off)".into());
        }
        if runs_host_tasks(plan, step) {
            return Err("the step runs tasks on host streams".into());
        }
        let replay = self.recorder.replay_plan(key).map_err(str::to_string)?;
        let ub = |u: u32| {
            state
                .micro_batch(u)
                .ok_or("a micro-batch beyond the plan's")
        };
        if ids_on_device {
            // The ids on the host are not known: every micro-batch with rows must read
            // them where the last step's `sample` left them.
            for u in 0..plan.micro_batches.count {
                if ub(u)?.n_tokens() > 0 && !replay.device_ids.iter().any(|d| d.0 == u) {
                    return Err(format!(
                        "micro-batch {u}'s `embed` reads its ids from the host in this graph"
                    ));
                }
            }
        } else {
            for &(u, at) in &replay.device_ids {
                if !self.sampled_ids.holds(at, &ub(u)?.token_ids()) {
                    return Err(format!(
                        "micro-batch {u}'s ids are not those its last `sample` left on the device"
                    ));
                }
            }
        }
        let mut inputs = Vec::with_capacity(replay.packs.len());
        for &(at, u, len) in &replay.packs {
            let pack = crate::runtime::cuda::step_inputs::StepInputs::of(ub(u)?);
            let bytes: Vec<u8> = bytemuck::cast_slice(pack.words()).to_vec();
            if bytes.len() != len {
                return Err(format!("micro-batch {u}'s step inputs changed size"));
            }
            inputs.push((at, bytes));
        }
        Ok(inputs)
    }
}
