//! What the CUDA backend tells the run report: the device and kernels it used, and each
//! device stream's scratch against its budget.

use super::*;

impl CudaBackend<'_> {
    /// What the backend found and did (device, kernels, routing syncs).
    pub fn report(&self) -> CudaReport {
        let (major, minor) = self.device.compute_capability;
        CudaReport {
            device: format!("{} (compute capability {major}.{minor})", self.device.name),
            arch: self.device.arch,
            ptx: self.device.ptx,
            routing_syncs: self.routing_syncs.load(Ordering::Relaxed),
            pinned_registered: self.memory.pinned_registered(),
            weights: self.memory.weight_path().clone(),
            relayed: self.host_memory.relayed(),
        }
    }

    /// The run report's scratch clauses: per device stream with tasks, `gpu scratch on
    /// <stream>: peak X B a task (<task>), arena Y B, budgeted Z B (<task>)`, and a
    /// `BUDGET VIOLATION` clause for a stream where a task took more than its bound.
    pub(super) fn scratch_report(&self) -> String {
        let mut out = String::new();
        for (dev, budget) in self.streams.iter().zip(&self.scratch) {
            let (Some(dev), Some(budget)) = (dev, budget) else {
                continue;
            };
            let usage = dev.workspace.usage();
            let (arena, _) = dev.workspace.size();
            let name = |t: Option<TaskId>| {
                t.and_then(|t| self.task_names.get(&t))
                    .map_or("no task", String::as_str)
            };
            out += &format!(
                "; gpu scratch on {}: peak {} B a task ({}), arena {arena} B, budgeted {} B ({})",
                budget.stream,
                usage.peak,
                name(usage.peak_task),
                budget.bound,
                budget.task
            );
            if usage.over > 0 {
                out += &format!(
                    "; BUDGET VIOLATION: gpu scratch on {}: {} tasks took more than the \
                     budgeted {} B, the most {} B ({})",
                    budget.stream,
                    usage.over,
                    budget.bound,
                    usage.peak,
                    name(usage.peak_task)
                );
            }
        }
        out
    }
}
