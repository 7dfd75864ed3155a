//! The host's copy pool: the threads that split a large host memcpy (a weight page relayed
//! from the checkpoint to pinned staging, a setup copy, the checkpoint read once into
//! page-locked memory), made once per run.
//!
//! Takes a thread count; gives [`CopyPool::fill`], which covers a destination with
//! disjoint page-aligned parts, one per thread, and returns when every part is done.
//! Guarantees: threads are created at most once per pool (on the first large copy, so a
//! run that never makes one creates none), never per copy; the queue is bounded by
//! construction, since each call submits at most one part per thread and waits for them
//! (so at most threads x copying streams parts are ever queued); no two threads write one
//! page. The pool is its own (not the compute pool of `--threads`): a copy never waits
//! behind a kernel's parallel loop, nor a kernel behind a copy's parts.

use rayon::prelude::*;
use std::sync::OnceLock;

/// Threads for large host copies, created on first use.
#[derive(Debug)]
pub struct CopyPool {
    threads: usize,
    pool: OnceLock<Option<rayon::ThreadPool>>,
}

impl CopyPool {
    /// A pool of `threads` (at least 1); no thread exists until the first split copy.
    pub fn new(threads: usize) -> Self {
        CopyPool {
            threads: threads.max(1),
            pool: OnceLock::new(),
        }
    }

    /// Threads a large copy is split over.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `work` on the pool's threads, so that rayon's parallel iterators inside it split
    /// over them (the load's repacking of quantised matrices into tiles); on the calling
    /// thread when the OS refused the threads.
    pub fn install<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        match self.pool() {
            Some(pool) => pool.install(work),
            None => work(),
        }
    }

    /// Whether the pool's threads exist (a copy at least the split size has run).
    pub fn started(&self) -> bool {
        self.pool.get().is_some_and(Option::is_some)
    }

    fn pool(&self) -> Option<&rayon::ThreadPool> {
        self.pool
            .get_or_init(|| {
                // When the OS refuses threads the copy still runs, in one part on the
                // calling thread: slower, never wrong.
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads)
                    .thread_name(|i| format!("moec-copy-{i}"))
                    .build()
                    .ok()
            })
            .as_ref()
    }

    /// Fills `dst` by calling `fill(offset, part)` on disjoint parts that cover it exactly
    /// once: one part per pool thread when `dst` is at least `min` bytes long, else one
    /// call on the calling thread. Parts are whole pages, so no two threads write one
    /// page. The first error (in part order) is returned after every part ran.
    pub fn fill<E: Send>(
        &self,
        dst: &mut [u8],
        min: usize,
        fill: impl Fn(usize, &mut [u8]) -> Result<(), E> + Sync,
    ) -> Result<(), E> {
        let parts = if dst.len() >= min { self.threads } else { 1 };
        if parts == 1 || dst.is_empty() {
            return fill(0, dst);
        }
        let Some(pool) = self.pool() else {
            return fill(0, dst);
        };
        let part = dst.len().div_ceil(parts).next_multiple_of(4096);
        let fill = &fill;
        let results: Vec<Result<(), E>> = pool.install(|| {
            dst.par_chunks_mut(part)
                .enumerate()
                .map(|(i, chunk)| fill(i * part, chunk))
                .collect()
        });
        results.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::CopyPool;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Each byte is written exactly once with the value its offset names (offset mod 251),
    /// whether the fill runs in one call or is split over 1..=5 threads, including lengths
    /// that are not a multiple of the page-sized parts and fewer pages than threads.
    #[test]
    fn fill_covers_every_byte_once() {
        for threads in 1..=5 {
            let pool = CopyPool::new(threads);
            for len in [0usize, 1, 4095, 4096, 10_000, 3 * 4096 + 7] {
                let mut dst = vec![0u8; len];
                let calls = AtomicUsize::new(0);
                pool.fill(&mut dst, 1, |at, part| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    for (i, b) in part.iter_mut().enumerate() {
                        assert_eq!(*b, 0, "byte {} written twice", at + i);
                        *b = ((at + i) % 251) as u8;
                    }
                    Ok::<(), ()>(())
                })
                .unwrap();
                let want: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                assert_eq!(dst, want, "{len} bytes over {threads} threads");
                let parts = calls.load(Ordering::Relaxed);
                assert!(parts >= 1 && parts <= threads, "{parts} parts");
            }
        }
    }

    /// Below the threshold the fill is one call on the whole range and no thread is made;
    /// an error of any part reaches the caller, the first in part order.
    #[test]
    fn fill_is_one_call_below_the_threshold_and_returns_errors() {
        let pool = CopyPool::new(3);
        let mut dst = vec![0u8; 10_000];
        let mut seen = Vec::new();
        let calls = std::sync::Mutex::new(&mut seen);
        pool.fill(&mut dst, 10_001, |at, part| {
            calls.lock().unwrap().push((at, part.len()));
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(seen, vec![(0, 10_000)]);
        assert!(!pool.started(), "a small copy made threads");
        let err = pool.fill(&mut dst, 1, |at, _| if at > 0 { Err(at) } else { Ok(()) });
        assert_eq!(err, Err(4096));
    }

    /// Threads are made once: many split copies run on the same named pool threads, never
    /// on fresh ones (the relay copies of issue 28 made 16 fresh threads per copy).
    #[test]
    fn split_copies_reuse_the_same_threads() {
        let pool = CopyPool::new(2);
        let names = std::sync::Mutex::new(std::collections::BTreeSet::new());
        for _ in 0..50 {
            let mut dst = vec![0u8; 4 * 4096];
            pool.fill(&mut dst, 1, |_, _| {
                let name = std::thread::current().name().map(str::to_string);
                names.lock().unwrap().insert(name);
                Ok::<(), ()>(())
            })
            .unwrap();
        }
        let names = names.into_inner().unwrap();
        assert!(pool.started());
        assert!(
            names.len() <= 2
                && names
                    .iter()
                    .all(|n| n.as_deref().is_some_and(|n| n.starts_with("moec-copy-"))),
            "{names:?}"
        );
    }
}
