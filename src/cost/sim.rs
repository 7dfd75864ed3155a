//! Discrete-event simulation of a task DAG on in-order streams and shared resources.
//!
//! Takes tasks in issue order, each with a stream, a duration (from the HRM) and the
//! tasks it waits for; streams are in-order queues and each stream is bound to a resource
//! (an engine or a link) that runs one task at a time, so two streams on one link share
//! it. Gives every task's start and end, the makespan and each stream's and resource's
//! busy time. Guarantees: a task starts only after its stream predecessor and all its
//! dependencies have ended and its resource is free; among tasks that could start, the
//! one that can start earliest goes first (ties by issue order), so the result is
//! deterministic. A dependency on a task that can never run first (a cycle through stream
//! order) is reported, never looped on.

use serde::Serialize;
use std::collections::BTreeMap;

/// A task's dependencies, inline up to four.
pub type SimDeps = smallvec::SmallVec<[usize; 4]>;

/// One task to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct SimTask {
    /// Index of its stream in [`SimInput::streams`].
    pub stream: usize,
    /// Duration in seconds.
    pub seconds: f64,
    /// Indices of tasks that must end before this one starts (inline: a task waits for a
    /// handful, and a step simulates up to a million tasks).
    pub deps: SimDeps,
}

/// A stream: an in-order queue bound to a resource.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimStream {
    /// Stream name from the schedule.
    pub name: String,
    /// Resource it runs on; streams with equal resource names share it.
    pub resource: String,
}

/// What to simulate.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SimInput {
    /// The streams.
    pub streams: Vec<SimStream>,
    /// Tasks in issue order.
    pub tasks: Vec<SimTask>,
    /// Seconds a stream loses when it blocks on a task of another stream: a task whose
    /// latest cross-stream dependency ends after its stream became free starts this much
    /// after that dependency's end (the waiting thread's wake-up); 0: none.
    pub wake_seconds: f64,
}

/// The simulated timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    /// Start of each task, seconds.
    pub start: Vec<f64>,
    /// End of each task, seconds.
    pub end: Vec<f64>,
    /// Time from the first start to the last end, seconds.
    pub makespan: f64,
    /// Busy seconds per stream (same order as the input streams).
    pub stream_busy: Vec<f64>,
    /// Busy seconds per resource, by name.
    pub resource_busy: BTreeMap<String, f64>,
}

/// Errors from a simulation.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SimError {
    /// A task names a stream that does not exist.
    #[error("task {task} is on stream {stream}, but only {streams} streams exist")]
    UnknownStream {
        /// Task index.
        task: usize,
        /// Its stream index.
        stream: usize,
        /// Number of streams.
        streams: usize,
    },
    /// A task depends on itself or a task index out of range.
    #[error("task {task} depends on task {dep}, which does not exist or is itself")]
    BadDependency {
        /// Task index.
        task: usize,
        /// The bad dependency.
        dep: usize,
    },
    /// A duration is negative or not a number.
    #[error("task {task} has an invalid duration {seconds}")]
    BadDuration {
        /// Task index.
        task: usize,
        /// The duration.
        seconds: f64,
    },
    /// No stream head can start: dependencies and stream order form a cycle.
    #[error("deadlock: {remaining} tasks can never start; task {blocked} (head of stream `{stream}`) waits for task {waits_for}, which is queued behind it")]
    Deadlock {
        /// Tasks not run.
        remaining: usize,
        /// One blocked head.
        blocked: usize,
        /// Its stream.
        stream: String,
        /// A dependency of it that has not run.
        waits_for: usize,
    },
}

/// Runs the simulation.
pub fn simulate(input: &SimInput) -> Result<SimResult, SimError> {
    let n_tasks = input.tasks.len();
    let n_streams = input.streams.len();
    let mut queues: Vec<Vec<usize>> = vec![Vec::new(); n_streams];
    let mut waiting: Vec<usize> = vec![0; n_tasks];
    // Each task's dependents, in task order, as one table: `dependents[first[t]..first[t
    // + 1]]` (no vector per task).
    let mut first: Vec<usize> = vec![0; n_tasks + 1];
    for (index, task) in input.tasks.iter().enumerate() {
        if task.stream >= n_streams {
            return Err(SimError::UnknownStream {
                task: index,
                stream: task.stream,
                streams: n_streams,
            });
        }
        if !(task.seconds >= 0.0 && task.seconds.is_finite()) {
            return Err(SimError::BadDuration {
                task: index,
                seconds: task.seconds,
            });
        }
        queues[task.stream].push(index);
        for &dep in &task.deps {
            if dep >= n_tasks || dep == index {
                return Err(SimError::BadDependency { task: index, dep });
            }
            first[dep + 1] += 1;
            waiting[index] += 1;
        }
    }
    for t in 0..n_tasks {
        first[t + 1] += first[t];
    }
    let mut dependents: Vec<usize> = vec![0; first[n_tasks]];
    let mut filled: Vec<usize> = first[..n_tasks].to_vec();
    for (index, task) in input.tasks.iter().enumerate() {
        for &dep in &task.deps {
            dependents[filled[dep]] = index;
            filled[dep] += 1;
        }
    }
    drop(filled);
    let mut resource_of_stream: Vec<usize> = Vec::with_capacity(n_streams);
    let mut resource_names: Vec<String> = Vec::new();
    for stream in &input.streams {
        let index = match resource_names.iter().position(|r| *r == stream.resource) {
            Some(index) => index,
            None => {
                resource_names.push(stream.resource.clone());
                resource_names.len() - 1
            }
        };
        resource_of_stream.push(index);
    }
    let mut resource_free = vec![0.0f64; resource_names.len()];
    let mut resource_busy = vec![0.0f64; resource_names.len()];
    let mut stream_free = vec![0.0f64; n_streams];
    let mut stream_busy = vec![0.0f64; n_streams];
    let mut heads = vec![0usize; n_streams];
    // Latest end among a task's finished dependencies, and among those on other streams.
    let mut deps_ready = vec![0.0f64; n_tasks];
    let mut cross_ready = vec![0.0f64; n_tasks];
    let wake = if input.wake_seconds.is_finite() {
        input.wake_seconds.max(0.0)
    } else {
        0.0
    };
    let mut start = vec![0.0f64; n_tasks];
    let mut end = vec![0.0f64; n_tasks];
    let mut done = 0usize;

    while done < n_tasks {
        let mut best: Option<(f64, usize, usize)> = None; // (start, task, stream)
        for stream in 0..n_streams {
            let Some(&task) = queues[stream].get(heads[stream]) else {
                continue;
            };
            if waiting[task] > 0 {
                continue;
            }
            // A stream that ran out of work before the event it waits for was recorded
            // has blocked, and runs again only after its wake-up.
            let blocked = cross_ready[task] > stream_free[stream];
            let woken = if blocked {
                cross_ready[task] + wake
            } else {
                0.0
            };
            let can_start = deps_ready[task]
                .max(woken)
                .max(stream_free[stream])
                .max(resource_free[resource_of_stream[stream]]);
            if best.is_none_or(|(s, t, _)| can_start < s || (can_start == s && task < t)) {
                best = Some((can_start, task, stream));
            }
        }
        let Some((task_start, task, stream)) = best else {
            return Err(deadlock(input, &queues, &heads, &waiting, n_tasks - done));
        };
        let seconds = input.tasks[task].seconds;
        let task_end = task_start + seconds;
        start[task] = task_start;
        end[task] = task_end;
        stream_free[stream] = task_end;
        stream_busy[stream] += seconds;
        let resource = resource_of_stream[stream];
        resource_free[resource] = task_end;
        resource_busy[resource] += seconds;
        heads[stream] += 1;
        done += 1;
        for &next in &dependents[first[task]..first[task + 1]] {
            waiting[next] -= 1;
            deps_ready[next] = deps_ready[next].max(task_end);
            if input.tasks[next].stream != stream {
                cross_ready[next] = cross_ready[next].max(task_end);
            }
        }
    }
    let first = start.iter().copied().fold(f64::INFINITY, f64::min);
    let last = end.iter().copied().fold(0.0f64, f64::max);
    Ok(SimResult {
        makespan: if n_tasks == 0 { 0.0 } else { last - first },
        start,
        end,
        stream_busy,
        resource_busy: resource_names.into_iter().zip(resource_busy).collect(),
    })
}

fn deadlock(
    input: &SimInput,
    queues: &[Vec<usize>],
    heads: &[usize],
    waiting: &[usize],
    remaining: usize,
) -> SimError {
    for (stream, queue) in queues.iter().enumerate() {
        let Some(&task) = queue.get(heads[stream]) else {
            continue;
        };
        if waiting[task] == 0 {
            continue;
        }
        // A dependency not yet run: it sits behind some stream's head.
        if let Some(&dep) = input.tasks[task].deps.iter().find(|&&dep| {
            let dep_stream = input.tasks[dep].stream;
            queues[dep_stream][heads[dep_stream]..].contains(&dep)
        }) {
            return SimError::Deadlock {
                remaining,
                blocked: task,
                stream: input.streams[stream].name.clone(),
                waits_for: dep,
            };
        }
    }
    SimError::Deadlock {
        remaining,
        blocked: 0,
        stream: String::new(),
        waits_for: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(name: &str, resource: &str) -> SimStream {
        SimStream {
            name: name.to_string(),
            resource: resource.to_string(),
        }
    }

    fn task(stream: usize, seconds: f64, deps: &[usize]) -> SimTask {
        SimTask {
            stream,
            seconds,
            deps: deps.iter().copied().collect(),
        }
    }

    /// Copy/compute overlap by hand: copy0 (2 s) -> compute0 (3 s); copy1 (2 s) runs during
    /// compute0 and compute1 (3 s) waits for both. Copies end at 2 and 4; computes run
    /// 2-5 and 5-8: makespan 8, copy link busy 4 of 8, gpu busy 6.
    #[test]
    fn double_buffered_copies_overlap_compute() {
        let input = SimInput {
            streams: vec![stream("h2d", "link:h2d"), stream("gpu", "gpu")],
            tasks: vec![
                task(0, 2.0, &[]),
                task(1, 3.0, &[0]),
                task(0, 2.0, &[]),
                task(1, 3.0, &[2]),
            ],
            wake_seconds: 0.0,
        };
        let result = simulate(&input).unwrap();
        assert_eq!(result.start, vec![0.0, 2.0, 2.0, 5.0]);
        assert_eq!(result.makespan, 8.0);
        assert_eq!(result.resource_busy["link:h2d"], 4.0);
        assert_eq!(result.stream_busy, vec![4.0, 6.0]);
    }

    /// Two streams on one link share it: the second copy waits for the first.
    #[test]
    fn streams_on_one_resource_serialise() {
        let input = SimInput {
            streams: vec![stream("a", "link"), stream("b", "link")],
            tasks: vec![task(0, 1.0, &[]), task(1, 1.0, &[])],
            wake_seconds: 0.0,
        };
        let result = simulate(&input).unwrap();
        assert_eq!(result.end, vec![1.0, 2.0]);
    }

    #[test]
    fn cycle_through_stream_order_is_a_deadlock() {
        // Task 0 (stream a) waits for task 2, which is queued behind task 1 on stream b,
        // and task 1 waits for task 0.
        let input = SimInput {
            streams: vec![stream("a", "x"), stream("b", "y")],
            tasks: vec![task(0, 1.0, &[2]), task(1, 1.0, &[0]), task(1, 1.0, &[])],
            wake_seconds: 0.0,
        };
        let err = simulate(&input).unwrap_err();
        assert!(
            matches!(err, SimError::Deadlock { remaining: 3, .. }),
            "{err}"
        );
    }

    #[test]
    fn bad_inputs_are_errors() {
        let bad_stream = SimInput {
            streams: vec![],
            tasks: vec![task(0, 1.0, &[])],
            wake_seconds: 0.0,
        };
        assert!(matches!(
            simulate(&bad_stream),
            Err(SimError::UnknownStream { .. })
        ));
        let bad_time = SimInput {
            streams: vec![stream("a", "x")],
            tasks: vec![task(0, f64::NAN, &[])],
            wake_seconds: 0.0,
        };
        assert!(matches!(
            simulate(&bad_time),
            Err(SimError::BadDuration { .. })
        ));
        let self_dep = SimInput {
            streams: vec![stream("a", "x")],
            tasks: vec![task(0, 1.0, &[0])],
            wake_seconds: 0.0,
        };
        assert!(matches!(
            simulate(&self_dep),
            Err(SimError::BadDependency { .. })
        ));
    }

    /// A blocked stream loses its wake-up, a stream that arrives late does not. Task 1 on
    /// `b` waits for task 0 (`a`, 0-2 s) with `b` idle: it starts at 2 + 0.5 = 2.5 and
    /// ends at 3.5. Task 3 on `b` waits for task 2 (`a`, 2-2.5 s), but `b` is busy until
    /// 3.5, after that event: no wake-up, it starts at 3.5 and ends at 4.5.
    #[test]
    fn a_blocked_stream_starts_after_its_wake_up() {
        let input = SimInput {
            streams: vec![stream("a", "x"), stream("b", "y")],
            tasks: vec![
                task(0, 2.0, &[]),
                task(1, 1.0, &[0]),
                task(0, 0.5, &[]),
                task(1, 1.0, &[2]),
            ],
            wake_seconds: 0.5,
        };
        let result = simulate(&input).unwrap();
        assert_eq!(result.start, vec![0.0, 2.5, 2.0, 3.5]);
        assert_eq!(result.makespan, 4.5);
    }
}
