//! Decode steps launched ahead (asynchronous scheduling): when the backend can launch a
//! step's cached graph without running its ops (`Backend::launch_replay`), step N+1 goes
//! to the device before step N's tokens are read back, and [`Ahead`] holds what its
//! collection needs. When that is allowed is argued on `Session::may_launch_ahead`.

use super::*;

/// A decode step launched by [`Backend::launch_replay`] and not yet collected.
#[derive(Debug)]
pub(super) struct Ahead {
    ticket: u64,
    step: usize,
    /// Its rows: (micro-batch, request), in each micro-batch's row order.
    rows: Vec<(usize, usize)>,
    /// When it was launched (seconds from the session's origin).
    start: f64,
    loads: Vec<UbLoad>,
}

impl<'a, B: Backend + ?Sized> Session<'a, B> {
    /// Whether the next decode step may be launched now without running its tasks, before
    /// the tokens of the step launched last are read (`pending`: that step is still in
    /// flight): a `generate` run of static batches (no admission, preemption or chunk can
    /// change the batch between two decode steps, and every sequence's blocks were
    /// reserved to its end), greedy and unconstrained (the device's argmax is the token,
    /// and `embed` reads it where `sample` left it), every sequence decoding, and none
    /// reaching its length at the step in flight (it would leave the batch; one that
    /// samples EOS there is only known later, and its row of the step launched ahead is
    /// discarded).
    pub(super) fn may_launch_ahead(&self, pending: bool) -> bool {
        // A synchronous backend (the CPU's) has nothing in flight to overlap: not tried.
        if self.mixed
            || self.on_demand
            || self.chunked_prefill
            || !self.record_steps
            || !self.backend.capabilities().asynchronous
        {
            return false;
        }
        if self.options.routing_profile.is_some()
            || self.options.kill_task.is_some()
            || !self.plan.caches.is_empty()
            || self.running.is_empty()
        {
            return false;
        }
        let constraints = lock(&self.state.constraints);
        self.running.iter().all(|s| {
            let Some(live) = self.slots.get(s.request).and_then(Option::as_ref) else {
                return false;
            };
            s.prompt_done
                && !s.paused
                && live.sampling == Sampling::Greedy
                && constraints.get(s.request).is_none_or(Option::is_none)
                && s.generated.len() + usize::from(pending) < live.max_new_tokens
        })
    }

    /// Builds the next decode step's state over the running sequences (`pending`: the step
    /// before it is in flight, so each sequence's context is one token longer than its
    /// generated tokens say and its new token is not on the host: a placeholder the
    /// graph does not read) and launches it without its tasks, if the backend can.
    pub(super) fn launch_ahead(&mut self, pending: bool) -> Result<Option<Ahead>, RunError> {
        let step = self.decode_step;
        let n_ubs = self.plan.micro_batches.count as usize;
        // Only the micro-batches and the read-backs: no task runs, so the rest of the step
        // state (routing, caches' step, bindings) stays as the last step left it until the
        // next step that runs its tasks resets it.
        lock(&self.state.sampled).clear();
        lock(&self.state.sampled_logits).clear();
        for ub in self.state.ubs.iter_mut() {
            *ub = MicroBatchState::default();
        }
        self.state.sampling = Sampling::Greedy;
        self.running.sort_by_key(|s| (s.ub, s.request));
        let mut loads = vec![UbLoad::default(); n_ubs];
        let mut rows = Vec::with_capacity(self.running.len());
        for s in &self.running {
            let Some(live) = self.slots.get(s.request).and_then(Option::as_ref) else {
                return Ok(None);
            };
            let prompt_len = live.prompt.len();
            let context_len = s.context_len(prompt_len) + usize::from(pending);
            let new_tokens = if pending {
                vec![0]
            } else {
                s.new_tokens(&live.prompt)
            };
            let load = &mut loads[s.ub];
            load.decode_seqs += 1;
            load.decode_context += context_len + 1;
            let mb = &mut self.state.ubs[s.ub];
            mb.block_size = self.pools[s.ub].block_size;
            mb.seqs.push(SeqSlot {
                request: s.request,
                context_len,
                new_tokens,
                block_table: s.block_table.clone(),
                prefill: false,
            });
            rows.push((s.ub, s.request));
        }
        let start = self.origin.elapsed().as_secs_f64();
        Ok(
            match self
                .backend
                .launch_replay(self.plan, step, &self.state, pending, true)?
            {
                Ok(ticket) => Some(Ahead {
                    ticket,
                    step,
                    rows,
                    start,
                    loads,
                }),
                Err(_) => None,
            },
        )
    }

    /// A pass with a step in flight: launches the step after it when nothing can change
    /// the batch in between, then reads the in-flight step's tokens (the host's work on
    /// them overlaps the next step on the device). When a sequence ended at the step read,
    /// the step launched after it is collected at once, that sequence's row discarded, so
    /// nothing is in flight when the batch changes.
    pub(super) fn pass_in_flight(&mut self, ahead: Ahead) -> Result<Vec<SeqEvent>, RunError> {
        let next = if self.may_launch_ahead(true) {
            self.launch_ahead(true)?
        } else {
            None
        };
        let mut events = self.collect_ahead(ahead)?;
        if let Some(next) = next {
            let still = |r: &(usize, usize)| self.running.iter().any(|s| s.request == r.1);
            if next.rows.iter().all(still) {
                self.ahead = Some(next);
            } else {
                events.extend(self.collect_ahead(next)?);
            }
        }
        Ok(events)
    }

    /// Waits for a launched step and hands its tokens to its rows' sequences; a row whose
    /// sequence ended before (EOS at the step before it) is discarded, never emitted.
    fn collect_ahead(&mut self, ahead: Ahead) -> Result<Vec<SeqEvent>, RunError> {
        lock(&self.state.sampled).clear();
        lock(&self.state.sampled_logits).clear();
        let ended = self.backend.collect_replay(ahead.ticket, &self.state)?;
        let end = self.origin.elapsed().as_secs_f64();
        // A step launched ahead overlapped the step before it until that one was
        // collected: from its launch it would count that overlap twice (once in each
        // step), so it starts where the step before it ended. Launch to collection (the
        // step's latency) is about two device steps in a steady pipeline.
        let start = match self.stats.steps.last() {
            Some(last) if last.end > ahead.start => last.end.min(end),
            _ => ahead.start,
        };
        let kind = self.plan.steps[ahead.step].kind;
        if let Some(graph) = ended.graph {
            self.stats.graph_steps.push(GraphStep { kind, graph });
        }
        let g = &self.gauges;
        g.steps.fetch_add(1, Ordering::Relaxed);
        g.last_step_seconds
            .store((end - start).to_bits(), Ordering::Relaxed);
        let total = Gauges::seconds(&g.step_seconds_total) + (end - start);
        g.step_seconds_total
            .store(total.to_bits(), Ordering::Relaxed);
        self.stats.steps.push(StepRecord {
            kind,
            start,
            end,
            prefill_tokens: 0,
            decode_tokens: ahead.rows.len(),
            ubs: ahead.loads,
            // No task ran on the host: the step's device work is its graph.
            tasks: Vec::new(),
            split: ended.split,
        });
        let sampled = std::mem::take(&mut *lock(&self.state.sampled));
        let sampled_logits = std::mem::take(&mut *lock(&self.state.sampled_logits));
        let mut events = Vec::new();
        let mut row_in_ub = vec![0usize; self.plan.micro_batches.count as usize];
        for (ub, request) in ahead.rows {
            let Some(k) = row_in_ub.get_mut(ub).map(|k| {
                *k += 1;
                *k - 1
            }) else {
                continue;
            };
            let Some(at) = self.running.iter().position(|s| s.request == request) else {
                continue; // ended at the step before: this row's token is discarded
            };
            let Some(token) = sampled.get(&(ub as u32)).and_then(|t| t.get(k)).copied() else {
                return Err(RunError::Exec(ExecError::NoToken {
                    ub: ub as u32,
                    row: k,
                }));
            };
            let s = self.running.remove(at);
            if let Some(s) = self.accept_token(s, k, token, &sampled_logits, &mut events) {
                self.running.insert(at, s);
            }
        }
        Ok(events)
    }
}
