//! Figures of a measured run: throughput, per-stream busy share, decode makespan vs the
//! critical path of the same step's measured task durations, and the measured timeline.
//!
//! Takes the plan and a run's [`RunStats`]; gives a [`RunReport`] (plain data, serde) and a
//! [`Timeline`] in the simulator's format. The critical path of a step is the longest
//! chain of measured task durations through the plan's dependencies plus each stream's
//! issue order, so `makespan / critical path` is the executor's overhead and idle time,
//! with 1.0 the ideal.

use crate::ir::StepKind;
use crate::ir::{Op, StreamId, TaskId};
use crate::lower::ExecPlan;
pub use crate::records::run::{
    add_graph_step, graph_summary, render_graphs, GraphSummary, PlainReason,
};
use crate::records::timeline::{Span as TimelineSpan, Timeline};
use crate::records::{RunStats, StepRecord};
use serde::Serialize;

/// One stream's share of the decode steps' wall time spent running tasks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamBusy {
    /// Stream name.
    pub stream: String,
    /// Its engine.
    pub engine: &'static str,
    /// Busy seconds over all decode steps.
    pub busy_seconds: f64,
    /// Busy seconds / decode wall seconds.
    pub share: f64,
}

/// What a run measured, summarised.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// Prompt tokens processed.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Whole run, seconds.
    pub seconds: f64,
    /// Generated tokens / whole run.
    pub tokens_per_s: f64,
    /// Prompt tokens / time in prefill steps.
    pub prefill_tokens_per_s: f64,
    /// Decode tokens / time in decode steps.
    pub decode_tokens_per_s: f64,
    /// Decode steps run.
    pub decode_steps: usize,
    /// Mean wall seconds of a decode step.
    pub decode_step_seconds: f64,
    /// Mean critical path of the decode steps from their measured task durations.
    pub decode_critical_path_seconds: f64,
    /// Sum of decode makespans / sum of their critical paths (1.0 = no overhead).
    pub makespan_over_critical_path: f64,
    /// Busy share per stream over the decode steps.
    pub streams: Vec<StreamBusy>,
    /// Tasks executed and skipped by guards.
    pub tasks_run: usize,
    /// Tasks skipped by their guards.
    pub tasks_skipped: usize,
    /// Sequences preempted because KV blocks ran out (each was prefilled again).
    pub preemptions: usize,
    /// Sequence-passes skipped waiting for KV blocks.
    pub paused_passes: usize,
    /// Per step kind, how its device work reached the device (CUDA graphs); empty on a
    /// backend with no device.
    pub graphs: Vec<GraphSummary>,
    /// Where the decode steps launched from their graph spent their time (device time
    /// by CUDA events beside the wall time, and the host's calls); `None` when no decode
    /// step was launched that way.
    pub decode_split: Option<DecodeSplit>,
    /// The time to first token, phase by phase, where the caller timed the run's start
    /// (`engine::run` does: the checkpoint opened, the plan set up, the backend opened,
    /// the first prefill); `None` from [`summarize`] alone.
    pub load: Option<crate::records::load::LoadBreakdown>,
}

/// Means per step over the decode steps launched from their cached graph without running
/// their tasks ([`crate::records::StepSplit`]), in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecodeSplit {
    /// Decode steps averaged over.
    pub steps: usize,
    /// Their mean wall time (as `decode_step_seconds`, over these steps only).
    pub wall: f64,
    /// The graph on the device (events around its launch).
    pub device: f64,
    /// The device idle between the previous graph's end and this one's start, over the
    /// steps queued behind another (`None`: no step was).
    pub gap: Option<f64>,
    /// Host: the launch call.
    pub launch: f64,
    /// Host, of `launch`: computing the step's shape and staged inputs.
    pub staging: f64,
    /// Host functions queued on the stream for the step (the stream waits while they
    /// run).
    pub host_functions: f64,
    /// Host: waiting for the step's read-backs and handing them over.
    pub wait: f64,
}

/// The mean [`DecodeSplit`] of `steps` ((wall seconds, split) per step).
fn decode_split(steps: &[(f64, crate::records::StepSplit)]) -> Option<DecodeSplit> {
    if steps.is_empty() {
        return None;
    }
    let n = steps.len() as f64;
    let mean =
        |f: fn(&crate::records::StepSplit) -> f64| steps.iter().map(|s| f(&s.1)).sum::<f64>() / n;
    let gaps: Vec<f64> = steps.iter().filter_map(|s| s.1.gap).collect();
    Some(DecodeSplit {
        steps: steps.len(),
        wall: steps.iter().map(|s| s.0).sum::<f64>() / n,
        device: mean(|s| s.device),
        gap: (!gaps.is_empty()).then(|| gaps.iter().sum::<f64>() / gaps.len() as f64),
        launch: mean(|s| s.launch),
        staging: mean(|s| s.staging),
        host_functions: mean(|s| s.host_functions),
        wait: mean(|s| s.wait),
    })
}

/// The longest chain of measured durations through a step's tasks (seconds).
pub fn critical_path(plan: &ExecPlan, step: &StepRecord) -> f64 {
    let mut finish: std::collections::HashMap<TaskId, f64> = std::collections::HashMap::new();
    let mut last_on_stream: std::collections::HashMap<StreamId, f64> =
        std::collections::HashMap::new();
    let mut records = step.tasks.clone();
    records.sort_by_key(|r| r.task);
    let mut best: f64 = 0.0;
    for r in &records {
        let duration = (r.end - r.start).max(0.0);
        let mut ready = last_on_stream.get(&r.stream).copied().unwrap_or(0.0);
        if let Some(preds) = plan.preds.get(r.task.index()) {
            for p in preds {
                if let Some(f) = finish.get(p) {
                    ready = ready.max(*f);
                }
            }
        }
        let end = ready + duration;
        finish.insert(r.task, end);
        last_on_stream.insert(r.stream, end);
        best = best.max(end);
    }
    best
}

fn is_decode(kind: StepKind) -> bool {
    matches!(kind, StepKind::Decode | StepKind::Mixed)
}

/// Summarises a run.
pub fn summarize(
    plan: &ExecPlan,
    stats: &RunStats,
    prompt_tokens: usize,
    generated_tokens: usize,
) -> RunReport {
    let mut prefill = (0usize, 0.0f64);
    let mut decode = (0usize, 0.0f64, 0usize);
    let mut critical = 0.0;
    let mut busy = vec![0.0f64; plan.streams.len()];
    let (mut run, mut skipped) = (0, 0);
    let mut splits = Vec::new();
    for step in &stats.steps {
        let wall = step.end - step.start;
        for r in &step.tasks {
            if r.ran {
                run += 1;
            } else {
                skipped += 1;
            }
        }
        match step.kind {
            StepKind::Prefill => {
                prefill.0 += step.prefill_tokens;
                prefill.1 += wall;
            }
            kind if is_decode(kind) && step.decode_tokens > 0 && step.prefill_tokens == 0 => {
                decode.0 += step.decode_tokens;
                decode.1 += wall;
                decode.2 += 1;
                if let Some(split) = step.split {
                    splits.push((wall, split));
                }
                critical += critical_path(plan, step);
                for r in &step.tasks {
                    if let Some(b) = busy.get_mut(r.stream.index()) {
                        *b += r.end - r.start;
                    }
                }
            }
            StepKind::Mixed => {
                prefill.0 += step.prefill_tokens;
                prefill.1 += wall;
            }
            _ => {}
        }
    }
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let streams = plan
        .streams
        .iter()
        .zip(&busy)
        .map(|(s, &b)| StreamBusy {
            stream: s.name.clone(),
            engine: s.engine.as_str(),
            busy_seconds: b,
            share: if decode.1 > 0.0 { b / decode.1 } else { 0.0 },
        })
        .collect();
    RunReport {
        prompt_tokens,
        generated_tokens,
        seconds: stats.wall,
        tokens_per_s: rate(generated_tokens, stats.wall),
        prefill_tokens_per_s: rate(prefill.0, prefill.1),
        decode_tokens_per_s: rate(decode.0, decode.1),
        decode_steps: decode.2,
        decode_step_seconds: if decode.2 > 0 {
            decode.1 / decode.2 as f64
        } else {
            0.0
        },
        decode_critical_path_seconds: if decode.2 > 0 {
            critical / decode.2 as f64
        } else {
            0.0
        },
        makespan_over_critical_path: if critical > 0.0 {
            decode.1 / critical
        } else {
            0.0
        },
        streams,
        tasks_run: run,
        tasks_skipped: skipped,
        preemptions: stats.preemptions,
        paused_passes: stats.paused,
        graphs: graph_summary(&stats.graph_steps),
        decode_split: decode_split(&splits),
        load: None,
    }
}

/// The measured timeline of every executed task, in the simulator's format.
pub fn timeline(plan: &ExecPlan, stats: &RunStats, title: &str) -> Timeline {
    let mut spans = Vec::new();
    for step in &stats.steps {
        for r in step.tasks.iter().filter(|r| r.ran) {
            let task = &plan.tasks[r.task.index()];
            let op = match task.op {
                // Fetches and prefetches apart from other copies.
                Op::Copy => format!(
                    "{} {}",
                    task.cache.map_or("copy", |c| c.op.as_str()),
                    task.engine.as_str()
                ),
                op => op.name().to_string(),
            };
            spans.push(TimelineSpan {
                stream: r.stream.index(),
                name: task.name.clone(),
                op,
                start: r.start,
                end: r.end,
            });
        }
    }
    spans.sort_by(|a, b| a.start.total_cmp(&b.start));
    Timeline {
        title: title.to_string(),
        streams: plan.streams.iter().map(|s| s.name.clone()).collect(),
        spans,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{GraphStep, GraphUse};

    /// Steps are counted per kind in order of first appearance, plain ones with their
    /// reasons, and rendered one clause per kind.
    #[test]
    fn graph_use_is_summarised_per_step_kind() {
        let step = |kind, graph| GraphStep { kind, graph };
        let plain = |why: &str| GraphUse::Plain(why.to_string());
        let steps = [
            step(StepKind::Prefill, plain("once per batch")),
            step(StepKind::Decode, plain("first")),
            step(StepKind::Decode, GraphUse::Captured),
            step(StepKind::Decode, GraphUse::Replayed),
            step(StepKind::Decode, GraphUse::Replayed),
            step(StepKind::Decode, plain("first")),
        ];
        let s = graph_summary(&steps);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].step, s[0].plain), ("prefill", 1));
        assert_eq!(
            (s[1].step, s[1].replayed, s[1].captured, s[1].plain),
            ("decode", 2, 1, 2)
        );
        assert_eq!(
            s[1].plain_reasons,
            vec![PlainReason {
                reason: "first".into(),
                steps: 2
            }]
        );
        assert_eq!(
            render_graphs(&s),
            "prefill: 0 replayed a graph, 0 captured one, 1 launched plainly (1: once per batch); \
             decode: 2 replayed a graph, 1 captured one, 2 launched plainly (2: first)"
        );
        assert_eq!(render_graphs(&[]), "");
    }
}
