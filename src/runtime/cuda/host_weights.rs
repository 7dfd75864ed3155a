//! How the checkpoint's weights reach the device: read in place from memory the driver
//! has page-locked, or relayed through host memcpys.
//!
//! Takes the host side ([`HostMemory`]: the weights image over the checkpoint's maps);
//! gives a [`HostWeights`] that says which of three ways the run uses, and why
//! ([`WeightPath`], in the run report), and, for the first two, where any byte range of
//! the image is in page-locked memory ([`HostWeights::pieces`]), so a copy of weights to
//! the device is DMA straight from those bytes:
//! - **registered**: every tensor's memory (the checkpoint's file maps, and the decoded or
//!   realigned tensors the image owns) registered with `cuMemHostRegister` as
//!   `CU_MEMHOSTREGISTER_READ_ONLY` in page-aligned ranges: nothing is copied on the host,
//!   and the device may never write them;
//! - **pinned copy**: where the driver refuses that (a device without
//!   `READ_ONLY_HOST_REGISTER_SUPPORTED`, a file system whose pages cannot be pinned), the
//!   image read once into an anonymous buffer registered with the driver;
//! - **relay**: where the host cannot hold the weights (the image is over half the
//!   memory available, the criterion `runtime::host` uses to populate it), or
//!   `--weight-copies move` or `MOEC_HOST_WEIGHTS=relay` asks for it (to measure the
//!   relay): the image stays
//!   pageable, a schedule's `cpu.copy` relays pages into its pinned staging with host
//!   memcpys (on the run's copy pool) and a direct copy is staged by the driver.
//!
//! `MOEC_HOST_WEIGHTS=pinned-copy` skips the registration (to measure that path).
//! Guarantees: registrations are undone when this is dropped (before the host memory that
//! holds the image); nothing here chooses silently: [`WeightPath::describe`] names the path
//! and the reason for every fallback.

use crate::ir::emit::human_bytes;
use crate::runtime::backend::WeightCopies;
use crate::runtime::host::arena::Arena;
use crate::runtime::host::image::{ImagePiece, ImageViewError};
use crate::runtime::host::memory::PARALLEL_COPY_MIN;
use crate::runtime::host::HostMemory;
use cudarc::driver::{sys, CudaContext, DriverError};
use std::sync::Arc;

/// Which way the weights reach the device, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightPath {
    /// The image's own memory registered read-only with the driver.
    Registered {
        /// Page-aligned ranges registered.
        ranges: usize,
        /// Bytes registered.
        bytes: u64,
    },
    /// The image read once into page-locked memory.
    PinnedCopy {
        /// Bytes of the copy.
        bytes: u64,
        /// Why the image itself was not registered.
        why: String,
    },
    /// Pageable: copies relay through host memcpys.
    Relay {
        /// Why neither page-locked path was taken.
        why: String,
    },
}

impl WeightPath {
    /// One clause for the run report.
    pub fn describe(&self) -> String {
        match self {
            WeightPath::Registered { ranges, bytes } => format!(
                "weights: the checkpoint registered read-only with the driver in place ({} in \
                 {ranges} page-aligned ranges): copies to the device read it directly, no host relay",
                human_bytes(*bytes)
            ),
            WeightPath::PinnedCopy { bytes, why } => format!(
                "weights: read once into page-locked memory ({}), because {why}: copies to the \
                 device read it directly, no host relay",
                human_bytes(*bytes)
            ),
            WeightPath::Relay { why } => format!(
                "weights: pageable, relayed through host memcpys (pinned staging or the \
                 driver's), because {why}"
            ),
        }
    }

    /// Short name: `registered`, `pinned copy` or `relay`.
    pub fn name(&self) -> &'static str {
        match self {
            WeightPath::Registered { .. } => "registered",
            WeightPath::PinnedCopy { .. } => "pinned copy",
            WeightPath::Relay { .. } => "relay",
        }
    }
}

/// A consecutive piece of a range of host bytes a device copy reads.
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    /// Bytes, where they are in memory; `pinned`: page-locked (registered) memory.
    Bytes {
        /// Offset from the range's start.
        offset: u64,
        /// The bytes.
        bytes: &'a [u8],
        /// Whether the driver can DMA them without staging.
        pinned: bool,
    },
    /// Zeros (padding between the image's tensors).
    Zeros {
        /// Offset from the range's start.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

/// The weights' way to the device for one run.
#[derive(Debug)]
pub struct HostWeights {
    path: WeightPath,
    /// Addresses registered here, unregistered on drop.
    registered: Vec<usize>,
    /// The page-locked copy of the image (pinned copy path).
    copy: Option<Arena>,
    ctx: Arc<CudaContext>,
}

/// `MOEC_HOST_WEIGHTS`: `relay` or `pinned-copy` force that path (to measure it); anything
/// else, or unset, picks the best the machine allows.
fn forced() -> Option<&'static str> {
    match std::env::var("MOEC_HOST_WEIGHTS").ok()?.trim() {
        "relay" => Some("relay"),
        "pinned-copy" => Some("pinned-copy"),
        _ => None,
    }
}

pub(super) fn page() -> usize {
    // SAFETY: sysconf with a valid name has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(4096)
}

/// `ranges` (address, length) widened to whole pages and merged where they meet: the
/// ranges to register (the driver pins whole pages, and a page registered twice is an
/// error). A range widened stays inside its mapping: file maps and heap allocations are
/// whole pages.
pub fn page_ranges(ranges: &[(usize, usize)], page: usize) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|r| r.1 > 0)
        .map(|&(at, len)| {
            let lo = at - at % page;
            (lo, (at + len).next_multiple_of(page))
        })
        .collect();
    spans.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    for (lo, hi) in spans {
        match merged.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    merged.into_iter().map(|(lo, hi)| (lo, hi - lo)).collect()
}

fn register(ptr: usize, len: usize, flags: u32) -> Result<(), DriverError> {
    // SAFETY: `ptr..ptr + len` is whole pages of live mappings (the checkpoint's maps or
    // the image's own buffers, or the arena made for the copy), which outlive the
    // registration: `HostWeights` unregisters them on drop, before the host memory (and
    // the checkpoint it borrows) is dropped.
    unsafe { sys::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, len, flags) }.result()
}

fn unregister(ptrs: &[usize]) {
    for &ptr in ptrs {
        // A failure cannot be acted on (the memory is released right after); the
        // registration was made by `register` above.
        // SAFETY: `ptr` starts a range registered by this module and still mapped.
        let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) }.result();
    }
}

impl HostWeights {
    /// Picks the path for `host`'s image and sets it up (registrations, or the copy); never
    /// fails: a refused step falls back to the next path, with the reason kept.
    pub fn new(host: &HostMemory<'_>, ctx: &Arc<CudaContext>, weight_copies: WeightCopies) -> Self {
        let mut weights = HostWeights {
            path: WeightPath::Relay { why: String::new() },
            registered: Vec::new(),
            copy: None,
            ctx: Arc::clone(ctx),
        };
        let image = host.image().len();
        let available = crate::sysmem::available_bytes();
        weights.path = match forced() {
            _ if weight_copies == WeightCopies::Move => WeightPath::Relay {
                why: "--weight-copies move asks for every byte to be copied".to_string(),
            },
            Some("relay") => WeightPath::Relay {
                why: "MOEC_HOST_WEIGHTS=relay asks for it".to_string(),
            },
            _ if available.is_none_or(|a| image > a / 2) => WeightPath::Relay {
                why: match available {
                    Some(a) => format!(
                        "the weights ({}) are more than half the memory available ({})",
                        human_bytes(image),
                        human_bytes(a)
                    ),
                    None => "the memory available is unknown (no /proc/meminfo)".to_string(),
                },
            },
            Some(_) => weights.pinned_copy(host, "MOEC_HOST_WEIGHTS=pinned-copy asks for it"),
            None => match weights.register_image(host) {
                Ok(path) => path,
                Err(e) => weights.pinned_copy(
                    host,
                    &format!("the driver refused to register the checkpoint read-only (cuMemHostRegister with CU_MEMHOSTREGISTER_READ_ONLY: {e})"),
                ),
            },
        };
        weights
    }

    /// Registers every tensor's memory read-only, in page-aligned ranges; undoes what it
    /// did when the driver refuses one.
    fn register_image(&mut self, host: &HostMemory<'_>) -> Result<WeightPath, DriverError> {
        let ranges = page_ranges(&host.image().host_ranges(), page());
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY;
        for &(ptr, len) in &ranges {
            if let Err(e) = register(ptr, len, flags) {
                unregister(&std::mem::take(&mut self.registered));
                return Err(e);
            }
            self.registered.push(ptr);
        }
        Ok(WeightPath::Registered {
            ranges: ranges.len(),
            bytes: ranges.iter().map(|r| r.1 as u64).sum(),
        })
    }

    /// Reads the image once into an anonymous buffer and registers it; relay when either
    /// step fails.
    fn pinned_copy(&mut self, host: &HostMemory<'_>, why: &str) -> WeightPath {
        let image = host.image();
        let arena = match Arena::new("weights copy", image.len(), false) {
            Ok(a) => a,
            Err(e) => {
                return WeightPath::Relay {
                    why: format!("{why}, and the page-locked copy could not be allocated ({e})"),
                }
            }
        };
        // SAFETY: the arena was just made and nothing else views it.
        let filled = unsafe { arena.bytes_mut(0, image.len()) }
            .map_err(|e| e.to_string())
            .and_then(|bytes| {
                host.copy_pool()
                    .fill(bytes, PARALLEL_COPY_MIN, |at, part| {
                        image.copy_to(at as u64, part)
                    })
                    .map_err(|e| e.to_string())
                    .map(|()| bytes.as_ptr() as usize)
            });
        let registered = filled.and_then(|ptr| {
            if image.is_empty() {
                return Ok(None);
            }
            register(ptr, image.len() as usize, sys::CU_MEMHOSTREGISTER_PORTABLE)
                .map(|()| Some(ptr))
                .map_err(|e| format!("cuMemHostRegister: {e}"))
        });
        match registered {
            Ok(ptr) => {
                self.registered.extend(ptr);
                self.copy = Some(arena);
                WeightPath::PinnedCopy {
                    bytes: image.len(),
                    why: why.to_string(),
                }
            }
            Err(e) => WeightPath::Relay {
                why: format!("{why}, and the page-locked copy failed ({e})"),
            },
        }
    }

    /// The path taken.
    pub fn path(&self) -> &WeightPath {
        &self.path
    }

    /// Whether the device reads the image's bytes from page-locked memory (registered or
    /// the pinned copy), so no weight needs its bytes in a host arena.
    pub fn readable(&self) -> bool {
        !matches!(self.path, WeightPath::Relay { .. })
    }

    /// Image bytes `[start, start + len)` as pieces a device copy reads directly: the
    /// tensors' registered bytes and zeros for padding, or one piece of the page-locked
    /// copy; on the relay path the tensors' pageable bytes (the driver stages them).
    pub fn pieces<'a>(
        &'a self,
        host: &'a HostMemory<'_>,
        start: u64,
        len: u64,
    ) -> Result<Vec<Piece<'a>>, ImageViewError> {
        if let Some(copy) = &self.copy {
            let end = start
                .checked_add(len)
                .filter(|&e| e <= copy.len() as u64)
                .ok_or(ImageViewError::OutOfBounds {
                    start,
                    end: start.saturating_add(len),
                    len: copy.len() as u64,
                })?;
            // SAFETY: the copy is written once, before any task, and only read after.
            let bytes = unsafe { copy.bytes(start, end - start) }.map_err(|_| {
                ImageViewError::OutOfBounds {
                    start,
                    end,
                    len: copy.len() as u64,
                }
            })?;
            return Ok(vec![Piece::Bytes {
                offset: 0,
                bytes,
                pinned: true,
            }]);
        }
        let pinned = self.readable();
        Ok(host
            .image()
            .pieces(start, len)?
            .into_iter()
            .map(|p| match p {
                ImagePiece::Bytes { offset, bytes } => Piece::Bytes {
                    offset,
                    bytes,
                    pinned,
                },
                ImagePiece::Zeros { offset, len } => Piece::Zeros { offset, len },
            })
            .collect())
    }
}

impl Drop for HostWeights {
    fn drop(&mut self) {
        if !self.registered.is_empty() {
            let _ = self.ctx.bind_to_thread();
            unregister(&std::mem::take(&mut self.registered));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::page_ranges;

    /// Ranges widen to whole 4 KiB pages and merge where they meet or share a page:
    /// tensors at 100..300 and 4000..4200 share page 0 and touch page 1 (one range of two
    /// pages); one at 12288..12289 is a page of its own; an empty range registers nothing.
    #[test]
    fn ranges_widen_to_pages_and_merge() {
        let got = page_ranges(&[(4000, 200), (100, 200), (12288, 1), (20000, 0)], 4096);
        assert_eq!(got, vec![(0, 8192), (12288, 4096)]);
        assert_eq!(
            page_ranges(&[(8192, 4096), (4096, 4096)], 4096),
            vec![(4096, 8192)]
        );
    }
}
