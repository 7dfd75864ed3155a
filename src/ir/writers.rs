//! Which tasks write what: per expert-cache key and per buffer, the tasks that write it,
//! in issue order.
//!
//! Takes a program; gives [`Writers`], so "the last task before `t` in a range of tasks
//! that writes this slice" is a binary search and a walk over that buffer's writers rather
//! than over every task in between (the cost model follows an `experts` task's weights
//! back through the copies that brought them, `cost::predict::weight_copy_format`: a scan
//! per task made that quadratic in a step's tasks, 60% of a HOBBIT plan's time).

use super::cache::CacheKey;
use super::{FastMap, Program, Slice, TaskId};

/// The writers of each cache key and buffer, in issue order.
#[derive(Debug, Clone, Default)]
pub struct Writers {
    /// Per cache key, the tasks with an argument that writes `CACHE.slot(key)`.
    by_key: FastMap<CacheKey, Vec<u32>>,
    /// Per buffer, the tasks with an argument that writes a plain (not cache-slot) slice
    /// of it; whether that slice overlaps a given one is asked per writer.
    by_buffer: Vec<Vec<u32>>,
}

impl Writers {
    /// The index of `program`'s tasks.
    pub fn of(program: &Program) -> Writers {
        let mut writers = Writers {
            by_key: FastMap::default(),
            by_buffer: vec![Vec::new(); program.buffers.len()],
        };
        for (index, task) in program.tasks.iter().enumerate() {
            let index = index as u32;
            for arg in task.args.iter().filter(|a| a.access.writes()) {
                let list = match arg.slice.cache_key {
                    Some(key) => writers.by_key.entry(key).or_default(),
                    None => match writers.by_buffer.get_mut(arg.slice.buffer.index()) {
                        Some(list) => list,
                        None => continue,
                    },
                };
                // Several written arguments of one task name it once.
                if list.last() != Some(&index) {
                    list.push(index);
                }
            }
        }
        writers
    }

    /// The last task in `range` (task indices) that writes bytes of `slice`: for a cache
    /// slot `CACHE.slot(key)`, a task writing that same key's slot; for a plain slice, a
    /// task writing a plain slice of the same buffer that overlaps it.
    pub fn last_in(
        &self,
        program: &Program,
        slice: &Slice,
        range: std::ops::Range<usize>,
    ) -> Option<TaskId> {
        let (list, overlap) = match slice.cache_key {
            Some(key) => (self.by_key.get(&key)?, false),
            None => (self.by_buffer.get(slice.buffer.index())?, true),
        };
        let end = list.partition_point(|&t| (t as usize) < range.end);
        list[..end]
            .iter()
            .rev()
            .take_while(|&&t| t as usize >= range.start)
            .find(|&&t| {
                !overlap
                    || program.tasks[t as usize].args.iter().any(|a| {
                        a.access.writes()
                            && a.slice.cache_key.is_none()
                            && a.slice.buffer == slice.buffer
                            && a.slice.start < slice.end()
                            && slice.start < a.slice.end()
                    })
            })
            .map(|&t| TaskId::new(t as usize))
    }
}
