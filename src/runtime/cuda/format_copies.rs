//! Format copies of the experts on the CUDA backend (issue 45: `W[l].expert(e).format(q8_0)`
//! under `substitute experts q8_0`): how the copies reach the device, and how many expert
//! computations on the device read one.
//!
//! Takes the plan's format copies (the host side made them at load in the `host` arena,
//! `runtime::host::format_copy`, labelled `WeightTag::Converted`) and whether the
//! checkpoint's own weights reach the device page-locked (`HostWeights::readable`); gives
//! [`HostCopies`], the copies registered with the driver where the checkpoint's weights
//! are (so a copy of an expert's slice into a gpu slot is DMA from them, and a command a
//! CUDA graph can hold), else pageable (the driver stages each copy), the way taken and
//! why in the run report's backend line; and [`ExpertSources`], a pair of device counters
//! per plan stream (expert computations, and those that read a format copy), which
//! `moe_count_experts` (kernels/moe_grouped.cu) adds to after each grouping on the device
//! and the backend reads after every step. So `moec run`'s `lossy substitute:` line counts
//! the device's expert computations as the CPU backend counts its own: one per expert that
//! got tokens in an `experts` or `post_attn` task. The ops find an expert that is only in
//! a copy by its `Converted` label (`GpuCx::segment_source`) and multiply with the
//! quantised kernels of its format; the list of backends refuses, before set-up, a plan
//! with a copy in a format those kernels do not decode, naming it.

use super::host_weights::{page, page_ranges};
use crate::ir::emit::human_bytes;
use crate::ir::Space;
use crate::runtime::host::memory::{HostMemory, Region, View};
use cudarc::driver::{result, sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The format copies' bytes in the `host` arena as the device reads them.
#[derive(Debug)]
pub struct HostCopies {
    /// The copies' `host` arena ranges (offset, bytes) when registered: bytes inside one
    /// are page-locked.
    registered: Vec<(u64, u64)>,
    /// Page-aligned addresses registered here, unregistered on drop.
    pages: Vec<usize>,
    /// The run report's clause (`None`: the plan has no format copy).
    described: Option<String>,
    ctx: Arc<CudaContext>,
}

impl HostCopies {
    /// Registers the copies at `ranges` (offset, bytes in the `host` arena) with the
    /// driver when `readable` (the checkpoint's weights are page-locked: the copies take
    /// the same way); leaves them pageable otherwise, or when the driver refuses, saying
    /// why. Never fails: a pageable copy is still copied, staged by the driver.
    pub fn new(
        host: &HostMemory<'_>,
        ranges: &[(u64, u64)],
        readable: bool,
        ctx: &Arc<CudaContext>,
    ) -> Self {
        let mut copies = HostCopies {
            registered: Vec::new(),
            pages: Vec::new(),
            described: None,
            ctx: Arc::clone(ctx),
        };
        let ranges: Vec<(u64, u64)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
        if ranges.is_empty() {
            return copies;
        }
        let bytes = human_bytes(ranges.iter().map(|r| r.1).sum());
        let described = if !readable {
            format!(
                "format copies of the experts ({bytes}): pageable, each copy to the device \
                 staged by the driver, as the checkpoint's weights are relayed"
            )
        } else {
            match copies.register(host, &ranges) {
                Ok(pages) => format!(
                    "format copies of the experts ({bytes}): registered with the driver \
                     (widened to whole pages: {}), copies to the device read them directly",
                    human_bytes(pages)
                ),
                Err(why) => format!(
                    "format copies of the experts ({bytes}): pageable, each copy to the device \
                     staged by the driver, because the driver refused to register them ({why})"
                ),
            }
        };
        copies.described = Some(described);
        copies
    }

    /// Registers `ranges` of the `host` arena, widened to whole pages; undoes what it did
    /// when the driver refuses one. Gives the bytes registered.
    fn register(&mut self, host: &HostMemory<'_>, ranges: &[(u64, u64)]) -> Result<u64, String> {
        let mut spans = Vec::with_capacity(ranges.len());
        for &(start, len) in ranges {
            let view = View {
                region: Region::Arena(Space::Host),
                start,
                len,
            };
            // SAFETY: set-up, before any task: nothing writes the `host` arena now (and
            // nothing ever writes a format copy after load); only the address is kept.
            let bytes = unsafe { host.bytes(view) }.map_err(|e| e.to_string())?;
            spans.push((bytes.as_ptr() as usize, bytes.len()));
        }
        let pages = page_ranges(&spans, page());
        for &(ptr, len) in &pages {
            // SAFETY: whole pages of the `host` arena's anonymous map (an arena is mapped in
            // whole pages, so widening a range to pages stays inside it), which outlives
            // the registration: the backend drops its device memory, and this with it,
            // before the host memory. Not read-only: the widened pages may hold other
            // host buffers a device copy writes.
            let registered = unsafe {
                sys::cuMemHostRegister_v2(
                    ptr as *mut std::ffi::c_void,
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            }
            .result();
            if let Err(e) = registered {
                self.unregister();
                return Err(format!("cuMemHostRegister: {e}"));
            }
            self.pages.push(ptr);
        }
        self.registered = ranges.to_vec();
        Ok(pages.iter().map(|p| p.1 as u64).sum())
    }

    fn unregister(&mut self) {
        for ptr in std::mem::take(&mut self.pages) {
            // A failure cannot be acted on (the memory is released right after).
            // SAFETY: `ptr` starts a range `register` registered, still mapped.
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) }.result();
        }
    }

    /// Whether `host` arena bytes `[start, start + len)` are page-locked (inside a
    /// registered copy).
    pub fn pinned(&self, start: u64, len: u64) -> bool {
        self.registered
            .iter()
            .any(|&(s, l)| start >= s && start.saturating_add(len) <= s + l)
    }

    /// The run report's clause on the copies; `None` without format copies.
    pub fn describe(&self) -> Option<&str> {
        self.described.as_deref()
    }
}

impl Drop for HostCopies {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            let _ = self.ctx.bind_to_thread();
            self.unregister();
        }
    }
}

/// Device counters of expert computations: per plan stream, (all, from a format copy).
#[derive(Debug)]
pub struct ExpertSources {
    /// `[2 * streams]` counters, zeroed at set-up; `None` without format copies.
    counts: Option<CudaSlice<u64>>,
    base: u64,
    streams: usize,
    /// What the last [`ExpertSources::read`] found: (from a format copy, all).
    totals: [AtomicU64; 2],
}

impl ExpertSources {
    /// Zeroed counters for `streams` plan streams on `stream` when `counting` (the plan
    /// has a format copy); none otherwise (no launch counts anything).
    pub fn new(
        stream: &Arc<CudaStream>,
        streams: usize,
        counting: bool,
    ) -> Result<Self, DriverError> {
        let (counts, base) = if counting && streams > 0 {
            let counts = stream.alloc_zeros::<u64>(2 * streams)?;
            let base = counts.device_ptr(stream).0;
            (Some(counts), base)
        } else {
            (None, 0)
        };
        Ok(ExpertSources {
            counts,
            base,
            streams,
            totals: Default::default(),
        })
    }

    /// The device address of plan stream `lane`'s pair, `0` when nothing is counted.
    pub fn pair(&self, lane: usize) -> u64 {
        if self.counts.is_some() && lane < self.streams {
            self.base + 16 * lane as u64
        } else {
            0
        }
    }

    /// Reads every stream's pair into the totals. The caller has synchronised every
    /// stream (the end of a step), so no launch is adding to them.
    pub fn read(&self) -> Result<(), DriverError> {
        if self.counts.is_none() {
            return Ok(());
        }
        let mut pairs = vec![0u64; 2 * self.streams];
        // SAFETY: `base` addresses the `2 * streams` counters allocated in `new`, alive in
        // `counts`; every stream that writes them was synchronised by the caller.
        unsafe { result::memcpy_dtoh_sync(pairs.as_mut_slice(), self.base) }?;
        let (mut substituted, mut all) = (0u64, 0u64);
        for pair in pairs.chunks_exact(2) {
            all += pair[0];
            substituted += pair[1];
        }
        self.totals[0].store(substituted, Ordering::Relaxed);
        self.totals[1].store(all, Ordering::Relaxed);
        Ok(())
    }

    /// (from a format copy, all) expert computations on the device up to the last read;
    /// `None` when nothing is counted.
    pub fn totals(&self) -> Option<(u64, u64)> {
        self.counts.as_ref().map(|_| {
            (
                self.totals[0].load(Ordering::Relaxed),
                self.totals[1].load(Ordering::Relaxed),
            )
        })
    }
}

/// The host engine's counts and the device's, added: (from a format copy, all).
pub fn add_sources(host: Option<(u64, u64)>, device: Option<(u64, u64)>) -> Option<(u64, u64)> {
    match (host, device) {
        (Some((hs, ha)), Some((ds, da))) => Some((hs + ds, ha + da)),
        (one, None) | (None, one) => one,
    }
}
