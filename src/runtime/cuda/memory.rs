//! The CUDA backend's memory: the `gpu` arena in device memory, the host side (the
//! `pinned` and `host` arenas and the memory-mapped weights image of `runtime::host`), and
//! copies between any two of them on a CUDA stream.
//!
//! Takes the plan's `gpu` arena size and the host side ([`HostMemory`]); gives device
//! pointers for views into `gpu` ([`DeviceMemory::ptr`]), the weight labels of the device
//! arena (so ops find their weights by tensor, as on the CPU), and [`DeviceMemory::copy`].
//! The `pinned` arena is registered with the driver (`cuMemHostRegister`), so copies from
//! and to it are asynchronous DMA; `host` stays pageable, and a copy that touches it is
//! synchronous (CUDA stages it), as `moec check` warns, except for the format copies of
//! the experts it holds (made at load, read-only), registered where the checkpoint is
//! ([`super::format_copies::HostCopies`]). The checkpoint is registered
//! read-only where the host can hold it ([`super::host_weights`]), so copies of weights
//! read it in place: a host copy of weights into pinned staging then moves only their
//! labels (`HostMemory::bind_weight_copies`) and the device copy out of staging reads the
//! registered tensors those labels name. Labels move at
//! submission: every reader of the destination is submitted after the copy (the driver's
//! host-side event order), so it finds the labels the copy will have written.

use super::device::Device;
use super::format_copies::HostCopies;
use super::graph::Command;
use super::host_weights::{HostWeights, Piece, WeightPath};
use crate::ir::Space;
use crate::runtime::host::memory::{
    clip_to_runs, runs_span, HostMemory, MemoryError, Region, View,
};
use crate::runtime::host::weights::{WeightMap, WeightTag};
use crate::runtime::sync::lock;
use cudarc::driver::{result, sys, CudaSlice, CudaStream, DevicePtr, DriverError, PushKernelArg};
use std::sync::{Arc, Mutex};

/// Why a device memory operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceMemoryError {
    /// The host side refused (bounds, read-only image, space rules).
    #[error(transparent)]
    Host(#[from] MemoryError),
    /// A driver call failed.
    #[error("CUDA {call} failed: {source}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A view past the end of the device arena.
    #[error("bytes {start}..{end} are outside the {len}-byte gpu arena")]
    Bounds {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
        /// Arena bytes.
        len: u64,
    },
    /// A device pointer asked of a view that is not in the `gpu` arena.
    #[error("a device operand is in {0} memory, not the gpu arena")]
    NotDevice(&'static str),
    /// The plan's `gpu` arena does not fit the device.
    #[error("the gpu arena needs {needed} bytes but the device has {capacity} ({why})")]
    Capacity {
        /// Bytes the plan places in `gpu`.
        needed: u64,
        /// Bytes available.
        capacity: u64,
        /// Where the capacity comes from.
        why: &'static str,
    },
    /// A copy whose source and destination differ in length.
    #[error("copy of {src} bytes into {dst}")]
    Length {
        /// Source bytes.
        src: u64,
        /// Destination bytes.
        dst: u64,
    },
    /// A copy within the gpu arena whose ranges overlap.
    #[error("copy source and destination overlap ({len} bytes at {src} and {dst})")]
    Overlap {
        /// Source start.
        src: u64,
        /// Destination start.
        dst: u64,
        /// Length.
        len: u64,
    },
}

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> DeviceMemoryError {
    move |source| DeviceMemoryError::Driver { call, source }
}

/// The `gpu` arena and its weight labels, and the registration of the pinned arena.
#[derive(Debug)]
pub struct DeviceMemory {
    arena: Option<CudaSlice<u8>>,
    base: u64,
    len: u64,
    map: Mutex<WeightMap>,
    /// The registered pinned arena (address, bytes), unregistered on drop.
    pinned: Option<(usize, usize)>,
    /// The pinned arena's device address (it is registered device-mapped), for
    /// [`DeviceMemory::copy_runs`]' one-launch copies; 0 when not registered.
    pinned_device: u64,
    /// How the weights reach the device (registered, pinned copy, relay); dropped after
    /// the pinned arena's registration is undone, before the host memory.
    weights: HostWeights,
    /// The format copies of the experts in the `host` arena (registered where the
    /// weights are page-locked); dropped before the host memory.
    copies: HostCopies,
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl DeviceMemory {
    /// Allocates the `gpu` arena (`bytes`) on `stream`, registers the host side's pinned
    /// arena with the driver, and sets up the weights' way to the device
    /// ([`HostWeights`]; `weight_copies` `Move` keeps the relay) and the format copies'
    /// (`format_copies`: their offset and bytes in the `host` arena; [`HostCopies`]).
    pub fn new(
        device: &Device,
        stream: &Arc<CudaStream>,
        bytes: u64,
        capacity: Option<u64>,
        host: &HostMemory<'_>,
        weight_copies: crate::runtime::backend::WeightCopies,
        format_copies: &[(u64, u64)],
    ) -> Result<Self, DeviceMemoryError> {
        let (free, total) = result::mem_get_info().map_err(driver("cuMemGetInfo"))?;
        let (limit, why) = match capacity {
            Some(c) => (
                c.min(free as u64),
                "--gpu-mem or the profile, and free memory",
            ),
            None => (free as u64, "free device memory"),
        };
        if bytes > limit {
            return Err(DeviceMemoryError::Capacity {
                needed: bytes,
                capacity: limit.min(total as u64),
                why,
            });
        }
        let (arena, base) = if bytes == 0 {
            (None, 0)
        } else {
            let len = usize::try_from(bytes).map_err(|_| DeviceMemoryError::Capacity {
                needed: bytes,
                capacity: usize::MAX as u64,
                why: "the address space",
            })?;
            // SAFETY: the arena's bytes are written by the plan's tasks before they are
            // read (`moec check` proves every read follows a write); nothing reads them
            // as typed values here.
            let slice = unsafe { stream.alloc::<u8>(len) }.map_err(driver("cuMemAlloc"))?;
            let ptr = {
                let (ptr, _sync) = slice.device_ptr(stream);
                ptr
            };
            (Some(slice), ptr)
        };
        let pinned = register_pinned(host)?;
        let pinned_device = match pinned {
            Some((ptr, _)) => {
                let mut dev = 0u64;
                // SAFETY: `ptr` was registered device-mapped just above; the call writes
                // the device address of its first byte to `dev`.
                unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr as *mut _, 0) }
                    .result()
                    .map_err(driver("cuMemHostGetDevicePointer"))?;
                dev
            }
            None => 0,
        };
        let weights = HostWeights::new(host, &device.ctx, weight_copies);
        if weights.readable() {
            // The device reads weights from the image's page-locked bytes, so a host copy
            // of weights into staging need only move their labels.
            host.bind_weight_copies();
        }
        let copies = HostCopies::new(host, format_copies, weights.readable(), &device.ctx);
        Ok(DeviceMemory {
            arena,
            base,
            len: bytes,
            map: Mutex::default(),
            pinned,
            pinned_device,
            weights,
            copies,
            ctx: Arc::clone(&device.ctx),
        })
    }

    /// How the weights reach the device, and why.
    pub fn weight_path(&self) -> &WeightPath {
        self.weights.path()
    }

    /// How the format copies of the experts reach the device, for the run report
    /// (`None`: the plan has none).
    pub fn format_copies(&self) -> Option<&str> {
        self.copies.describe()
    }

    /// Host bytes `[start, start + len)` of `region` as the pieces a device copy reads: in
    /// the image, the tensors' own (registered or page-locked) bytes and zeros for
    /// padding; in an arena, its bytes, except that a weight label, when copies bind,
    /// stands for the image's bytes of that tensor (the arena never got them), or for a
    /// format copy's segment (`WeightTag::Converted`), for the copy's bytes in the `host`
    /// arena, made at load. Offsets are from `start`.
    ///
    /// # Safety
    ///
    /// The contract of [`HostMemory::bytes`] for the arena bytes: the calling copy's
    /// waits have returned, so no task writes them while the copy reads them.
    unsafe fn host_pieces<'a>(
        &'a self,
        host: &'a HostMemory<'_>,
        region: Region,
        start: u64,
        len: u64,
    ) -> Result<Vec<Piece<'a>>, DeviceMemoryError> {
        let image = |at: u64, n: u64| {
            self.weights
                .pieces(host, at, n)
                .map_err(|e| DeviceMemoryError::Host(e.into()))
        };
        let space = match region {
            Region::Image => return image(start, len),
            Region::Arena(space) => space,
        };
        // Page-locked host bytes: the registered pinned arena, and the format copies of
        // the `host` arena where they are registered.
        let locked = |space: Space, at: u64, n: u64| match space {
            Space::Pinned => self.pinned.is_some(),
            Space::Host => self.copies.pinned(at, n),
            Space::Gpu | Space::Disk => false,
        };
        let arena = |offset: u64, n: u64| -> Result<Piece<'a>, DeviceMemoryError> {
            let view = View {
                region,
                start: start + offset,
                len: n,
            };
            // SAFETY: forwarded to the caller (this fn's contract).
            let bytes = unsafe { host.bytes(view)? };
            Ok(Piece::Bytes {
                offset,
                bytes,
                pinned: locked(space, view.start, n),
            })
        };
        let labels = if host.binds() {
            host.labels_in(region, start, len)
        } else {
            Vec::new()
        };
        let mut pieces = Vec::with_capacity(2 * labels.len() + 1);
        let mut at = 0u64;
        for (offset, n, tag, tag_offset) in labels {
            if offset > at {
                pieces.push(arena(at, offset - at)?);
            }
            if let WeightTag::Converted { .. } = tag {
                // A format copy's segment: its bytes are the copy's, in the `host` arena.
                let from = host.converted_start(tag).ok_or(DeviceMemoryError::Host(
                    MemoryError::ImageView(
                        crate::runtime::host::image::ImageViewError::NotOneTensor {
                            start: start + offset,
                            end: start + offset + n,
                        },
                    ),
                ))? + tag_offset;
                let view = View {
                    region: Region::Arena(Space::Host),
                    start: from,
                    len: n,
                };
                // SAFETY: a format copy is written once, at load, before any task, and
                // never after (its buffer is read-only to the plan).
                let bytes = unsafe { host.bytes(view)? };
                pieces.push(Piece::Bytes {
                    offset,
                    bytes,
                    pinned: locked(Space::Host, from, n),
                });
                at = offset + n;
                continue;
            }
            let from =
                host.image_start(tag)
                    .ok_or(DeviceMemoryError::Host(MemoryError::ImageView(
                        crate::runtime::host::image::ImageViewError::NotOneTensor {
                            start: start + offset,
                            end: start + offset + n,
                        },
                    )))?
                    + tag_offset;
            for piece in image(from, n)? {
                pieces.push(match piece {
                    Piece::Bytes {
                        offset: o,
                        bytes,
                        pinned,
                    } => Piece::Bytes {
                        offset: offset + o,
                        bytes,
                        pinned,
                    },
                    Piece::Zeros { offset: o, len } => Piece::Zeros {
                        offset: offset + o,
                        len,
                    },
                });
            }
            at = offset + n;
        }
        if at < len {
            pieces.push(arena(at, len - at)?);
        }
        Ok(pieces)
    }

    /// Copies `pieces` (offsets from device address `dst`) on `stream`: bytes by
    /// `cuMemcpyHtoDAsync` (page-locked: asynchronous DMA; pageable: staged by the driver
    /// before the call returns), zeros by `cuMemsetD8Async`.
    fn put_pieces(
        stream: &CudaStream,
        dst: u64,
        pieces: &[Piece<'_>],
    ) -> Result<(), DeviceMemoryError> {
        for piece in pieces {
            match *piece {
                Piece::Bytes { offset, bytes, .. } => {
                    // SAFETY: `dst + offset` addresses `bytes.len()` bytes of the gpu
                    // arena (the pieces tile a view the caller checked with `ptr`);
                    // `bytes` stay valid and unwritten until the copy completes (the
                    // read-only image; pinned arena bytes: the plan's events; pageable:
                    // CUDA copies them before the call returns).
                    unsafe { result::memcpy_htod_async(dst + offset, bytes, stream.cu_stream()) }
                        .map_err(driver("cuMemcpyHtoDAsync"))?;
                }
                Piece::Zeros { offset, len } => {
                    // SAFETY: `dst + offset` addresses `len` bytes of the gpu arena, as
                    // above.
                    unsafe {
                        result::memset_d8_async(dst + offset, 0, len as usize, stream.cu_stream())
                    }
                    .map_err(driver("cuMemsetD8Async"))?;
                }
            }
        }
        Ok(())
    }

    /// Whether the pinned arena is registered (page-locked for the device's DMA).
    pub fn pinned_registered(&self) -> bool {
        self.pinned.is_some()
    }

    /// Bytes of the gpu arena.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the gpu arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of a view into the `gpu` arena, bounds-checked.
    pub fn ptr(&self, view: View) -> Result<u64, DeviceMemoryError> {
        match view.region {
            Region::Arena(Space::Gpu) => {}
            Region::Arena(space) => return Err(DeviceMemoryError::NotDevice(space.as_str())),
            Region::Image => return Err(DeviceMemoryError::NotDevice("checkpoint")),
        }
        let end = view.start.saturating_add(view.len);
        if end > self.len || self.arena.is_none() && view.len > 0 {
            return Err(DeviceMemoryError::Bounds {
                start: view.start,
                end,
                len: self.len,
            });
        }
        Ok(self.base + view.start)
    }

    /// Where `tag` (`tag_len` bytes) lies whole inside one of `views` of the gpu arena.
    pub fn find_weight(&self, views: &[View], tag: WeightTag, tag_len: u64) -> Option<View> {
        let map = lock(&self.map);
        views
            .iter()
            .filter(|v| v.region == Region::Arena(Space::Gpu))
            .find_map(|v| {
                map.find_whole(v.start, v.len, tag, tag_len)
                    .map(|start| View {
                        region: v.region,
                        start,
                        len: tag_len,
                    })
            })
    }

    /// Forgets the labels of gpu bytes an op overwrote with activations.
    pub fn clobber(&self, view: View) {
        if view.region == Region::Arena(Space::Gpu) {
            lock(&self.map).clear(view.start, view.start + view.len);
        }
    }

    fn labels_in(&self, host: &HostMemory<'_>, view: View) -> Vec<(u64, u64, WeightTag, u64)> {
        match view.region {
            Region::Arena(Space::Gpu) => lock(&self.map).labels_in(view.start, view.len),
            region => host.labels_in(region, view.start, view.len),
        }
    }

    fn relabel(&self, host: &HostMemory<'_>, view: View, labels: &[(u64, u64, WeightTag, u64)]) {
        match view.region {
            Region::Arena(Space::Gpu) => {
                let mut map = lock(&self.map);
                map.clear(view.start, view.start + view.len);
                for &(offset, len, tag, tag_offset) in labels {
                    map.insert(view.start + offset, len, tag, tag_offset);
                }
            }
            _ => host.relabel(view, labels),
        }
    }

    /// Copies `src` to `dst` on `stream` (device copies are asynchronous; a pageable host
    /// side makes the call return only when CUDA has staged or delivered the bytes) and
    /// moves the weight labels along. A copy between two host regions waits for the
    /// stream's earlier work, then copies on this thread.
    pub fn copy(
        &self,
        host: &HostMemory<'_>,
        stream: &CudaStream,
        src: View,
        dst: View,
    ) -> Result<(), DeviceMemoryError> {
        if src.len != dst.len {
            return Err(DeviceMemoryError::Length {
                src: src.len,
                dst: dst.len,
            });
        }
        let labels = self.labels_in(host, src);
        let on_device = |v: View| v.region == Region::Arena(Space::Gpu);
        let n = src.len as usize;
        match (on_device(src), on_device(dst)) {
            (true, true) => {
                let (s, d) = (self.ptr(src)?, self.ptr(dst)?);
                if src.start < dst.start + dst.len && dst.start < src.start + src.len && n > 0 {
                    return Err(DeviceMemoryError::Overlap {
                        src: src.start,
                        dst: dst.start,
                        len: src.len,
                    });
                }
                // SAFETY: both ranges are inside the arena (checked by `ptr`) and
                // disjoint; the plan orders every other user of them around this copy.
                unsafe { result::memcpy_dtod_async(d, s, n, stream.cu_stream()) }
                    .map_err(driver("cuMemcpyDtoDAsync"))?;
            }
            (false, true) => {
                let d = self.ptr(dst)?;
                // SAFETY: the copy task's waits have returned, so no task writes the
                // source now; the plan keeps writers away until this copy's event.
                let pieces = unsafe { self.host_pieces(host, src.region, src.start, src.len)? };
                Self::put_pieces(stream, d, &pieces)?;
            }
            (true, false) => {
                let s = self.ptr(src)?;
                // SAFETY: the copy task's waits have returned and the plan gives it the
                // destination alone until its event.
                let to = unsafe { host.bytes_mut(dst)? };
                // SAFETY: `s` addresses `n` arena bytes and `to` holds `n` bytes that no
                // one reads before this copy's event completes (host readers synchronise
                // on it; a pageable destination is complete when the call returns).
                unsafe { result::memcpy_dtoh_async(&mut to[..n], s, stream.cu_stream()) }
                    .map_err(driver("cuMemcpyDtoHAsync"))?;
            }
            (false, false) => {
                stream
                    .synchronize()
                    .map_err(driver("cuStreamSynchronize"))?;
                host.copy(crate::ir::Engine::CpuCopy, src, dst)?;
            }
        }
        self.relabel(host, dst, &labels);
        Ok(())
    }
}

impl DeviceMemory {
    /// The copy of `src` to `dst` as device commands (none for zero bytes) when neither
    /// side is pageable, i.e. both are in the gpu arena or one is and the other in the
    /// registered pinned arena, with the weight labels moved as [`DeviceMemory::copy`]
    /// moves them; `None` (nothing done) when a side is pageable host memory or the
    /// checkpoint: such a copy is a host call, not a command a graph can hold.
    pub fn copy_commands(
        &self,
        host: &HostMemory<'_>,
        src: View,
        dst: View,
    ) -> Result<Option<Vec<Command>>, DeviceMemoryError> {
        if src.len != dst.len {
            return Err(DeviceMemoryError::Length {
                src: src.len,
                dst: dst.len,
            });
        }
        let on_device = |v: View| v.region == Region::Arena(Space::Gpu);
        let pinned = |v: View| self.pinned.is_some() && v.region == Region::Arena(Space::Pinned);
        let n = src.len as usize;
        let command = match (on_device(src), on_device(dst)) {
            (true, true) => {
                if src.start < dst.start + dst.len && dst.start < src.start + src.len && n > 0 {
                    return Err(DeviceMemoryError::Overlap {
                        src: src.start,
                        dst: dst.start,
                        len: src.len,
                    });
                }
                Command::DtoD {
                    dst: self.ptr(dst)?,
                    src: self.ptr(src)?,
                    bytes: n,
                }
            }
            (false, true) => {
                // SAFETY: only the addresses are taken; the plan keeps writers of the source
                // away until this copy's event, which follows the copy on its stream.
                let pieces = unsafe { self.host_pieces(host, src.region, src.start, src.len)? };
                if pieces
                    .iter()
                    .any(|p| matches!(p, Piece::Bytes { pinned: false, .. }))
                {
                    return Ok(None);
                }
                let d = self.ptr(dst)?;
                let commands = pieces
                    .iter()
                    .map(|p| match *p {
                        Piece::Bytes { offset, bytes, .. } => Command::HtoD {
                            dst: d + offset,
                            src: bytes.as_ptr() as usize,
                            bytes: bytes.len(),
                        },
                        Piece::Zeros { offset, len } => Command::Zero {
                            dst: d + offset,
                            bytes: len as usize,
                        },
                    })
                    .filter(|c| {
                        !matches!(
                            c,
                            Command::HtoD { bytes: 0, .. } | Command::Zero { bytes: 0, .. }
                        )
                    })
                    .collect();
                let labels = self.labels_in(host, src);
                self.relabel(host, dst, &labels);
                return Ok(Some(commands));
            }
            (true, false) if pinned(dst) => {
                // SAFETY: only the address is taken; the plan gives the copy the
                // destination alone until its event.
                let to = unsafe { host.bytes_mut(dst)? };
                Command::DtoH {
                    dst: to.as_mut_ptr() as usize,
                    src: self.ptr(src)?,
                    bytes: n,
                }
            }
            _ => return Ok(None),
        };
        let labels = self.labels_in(host, src);
        self.relabel(host, dst, &labels);
        Ok(Some(if n == 0 { Vec::new() } else { vec![command] }))
    }

    /// Copies `runs` of `src` to the same offsets of `dst` on `stream` as one command
    /// (each run (offset from both views' starts, length); sorted and disjoint) and
    /// moves the weight labels of those bytes along. A device side submits one
    /// asynchronous copy per run back to back, with no host work between them: the
    /// views are resolved, bounds and overlap checked and the labels moved once for the
    /// whole copy; with [`KERNEL_COPY_MIN_RUNS`] runs or more between the gpu arena and the
    /// (device-mapped) pinned arena, one `copy_runs` kernel moves them all instead.
    /// (`cuMemcpyBatchAsync`, which cudarc binds, needs a CUDA 12.8 driver
    /// and the stand-in driver the tests run under does not implement it;
    /// `cuMemcpy2DAsync` needs one pitch, and the runs of a KV cache's transposed keys
    /// are not evenly spaced across blocks.) A pageable host
    /// side makes each run's call return only when CUDA has staged or delivered it. A
    /// copy between two host regions waits for the stream's earlier work, then is the
    /// host side's one copy of the runs.
    pub fn copy_runs(
        &self,
        device: &Device,
        host: &HostMemory<'_>,
        stream: &Arc<CudaStream>,
        src: View,
        dst: View,
        runs: &[(u64, u64)],
    ) -> Result<(), DeviceMemoryError> {
        let on_device = |v: View| v.region == Region::Arena(Space::Gpu);
        if !on_device(src) && !on_device(dst) {
            stream
                .synchronize()
                .map_err(driver("cuStreamSynchronize"))?;
            host.copy_runs(crate::ir::Engine::CpuCopy, src, dst, runs)?;
            return Ok(());
        }
        let Some((first, end)) = runs_span(runs, src, dst)? else {
            return Ok(());
        };
        let span = View {
            start: src.start + first,
            len: end - first,
            ..src
        };
        let labels = clip_to_runs(&self.labels_in(host, span), first, runs);
        // A bound weight label in the pinned source stands for the image's bytes, which
        // the kernel cannot see through the arena's mapping.
        let bound_source = host.binds() && !on_device(src) && !labels.is_empty();
        if let (Some(ends), true, false) = (
            self.kernel_ends(src, dst),
            runs.len() >= KERNEL_COPY_MIN_RUNS,
            bound_source,
        ) {
            let (s, d) = ends?;
            copy_runs_kernel(device, stream, s, d, runs)?;
            self.move_run_labels(host, dst, runs, &labels);
            return Ok(());
        }
        match (on_device(src), on_device(dst)) {
            (true, true) => {
                let (s, d) = (self.ptr(src)?, self.ptr(dst)?);
                if src.start + first < dst.start + end && dst.start + first < src.start + end {
                    return Err(DeviceMemoryError::Overlap {
                        src: src.start + first,
                        dst: dst.start + first,
                        len: end - first,
                    });
                }
                for &(at, len) in runs {
                    // SAFETY: both runs are inside the arena (`ptr` checked the views, the
                    // runs lie inside both) and disjoint (the spans do not meet); the plan
                    // orders every other user of them around this copy.
                    unsafe {
                        result::memcpy_dtod_async(d + at, s + at, len as usize, stream.cu_stream())
                    }
                    .map_err(driver("cuMemcpyDtoDAsync"))?;
                }
            }
            (false, _) => {
                let d = self.ptr(dst)?;
                for &(at, len) in runs {
                    // SAFETY: the copy task's waits have returned, so no task writes the
                    // source now; the plan keeps writers away until this copy's event.
                    let pieces =
                        unsafe { self.host_pieces(host, src.region, src.start + at, len)? };
                    Self::put_pieces(stream, d + at, &pieces)?;
                }
            }
            (true, false) => {
                let s = self.ptr(src)?;
                // SAFETY: the copy task's waits have returned and the plan gives it the
                // destination alone until its event.
                let to = unsafe { host.bytes_mut(dst)? };
                for &(at, len) in runs {
                    let part = &mut to[at as usize..(at + len) as usize];
                    // SAFETY: `s + at` addresses `len` arena bytes and `part` holds `len`
                    // bytes that no one reads before this copy's event completes (host
                    // readers synchronise on it; a pageable destination is complete when
                    // the call returns).
                    unsafe { result::memcpy_dtoh_async(part, s + at, stream.cu_stream()) }
                        .map_err(driver("cuMemcpyDtoHAsync"))?;
                }
            }
        }
        self.move_run_labels(host, dst, runs, &labels);
        Ok(())
    }

    /// The device addresses the `copy_runs` kernel copies between when one of `src` and
    /// `dst` is in the gpu arena and the other in the registered pinned arena (through
    /// its device mapping); `None` for any other pair.
    fn kernel_ends(&self, src: View, dst: View) -> Option<Result<(u64, u64), DeviceMemoryError>> {
        let on_device = |v: View| v.region == Region::Arena(Space::Gpu);
        let mapped = |v: View| {
            (self.pinned_device != 0 && v.region == Region::Arena(Space::Pinned))
                .then(|| self.pinned_device + v.start)
        };
        let ends = (
            on_device(src).then(|| self.ptr(src)),
            on_device(dst).then(|| self.ptr(dst)),
        );
        match ends {
            (Some(s), None) => mapped(dst).map(|d| s.map(|s| (s, d))),
            (None, Some(d)) => mapped(src).map(|s| d.map(|d| (s, d))),
            _ => None,
        }
    }

    /// For a copy of `runs` that a graph can hold (one side in the gpu arena, the other in
    /// the registered pinned arena): the addresses the `copy_runs` kernel copies between,
    /// with the weight labels of the runs moved as [`DeviceMemory::copy_runs`] moves
    /// them; `None` (nothing done) for any other pair or no runs.
    pub fn copy_runs_ends(
        &self,
        host: &HostMemory<'_>,
        src: View,
        dst: View,
        runs: &[(u64, u64)],
    ) -> Result<Option<(u64, u64)>, DeviceMemoryError> {
        let Some(ends) = self.kernel_ends(src, dst) else {
            return Ok(None);
        };
        let Some((first, end)) = runs_span(runs, src, dst)? else {
            return Ok(None);
        };
        let ends = ends?;
        let span = View {
            start: src.start + first,
            len: end - first,
            ..src
        };
        let labels = clip_to_runs(&self.labels_in(host, span), first, runs);
        if host.binds() && src.region != Region::Arena(Space::Gpu) && !labels.is_empty() {
            // Bound weights in the pinned source: their bytes are in the image, which
            // the kernel cannot see through the arena's mapping.
            return Ok(None);
        }
        self.move_run_labels(host, dst, runs, &labels);
        Ok(Some(ends))
    }

    fn move_run_labels(
        &self,
        host: &HostMemory<'_>,
        dst: View,
        runs: &[(u64, u64)],
        labels: &[(u64, u64, WeightTag, u64)],
    ) {
        match dst.region {
            Region::Arena(Space::Gpu) => {
                let mut map = lock(&self.map);
                for &(at, len) in runs {
                    map.clear(dst.start + at, dst.start + at + len);
                }
                for &(offset, len, tag, tag_offset) in labels {
                    map.insert(dst.start + offset, len, tag, tag_offset);
                }
            }
            _ => host.relabel_runs(dst, runs, labels),
        }
    }
}

/// Runs past which [`DeviceMemory::copy_runs`] moves the bytes between the gpu arena and
/// the device-mapped pinned arena with one `copy_runs` kernel instead of one
/// `cuMemcpyAsync` per run: a KV cache's context is a run per (sequence, head, block) or
/// per token for transposed keys, thousands per layer, and at a few microseconds of driver
/// time each the calls cost 90 ms of a 16-sequence decode step on an H200 where the bytes
/// take under 1 ms.
const KERNEL_COPY_MIN_RUNS: usize = 16;

/// Copies `runs` (offset from both starts, length) from device address `src` to `dst` on
/// `stream` with one launch of `copy_runs` (kernels/ops.cu); one side may be the mapped
/// pinned arena. The run table goes up from pageable memory (staged by the call) into a
/// stream-ordered allocation freed after the launch.
fn copy_runs_kernel(
    device: &Device,
    stream: &Arc<CudaStream>,
    src: u64,
    dst: u64,
    runs: &[(u64, u64)],
) -> Result<(), DeviceMemoryError> {
    let table: Vec<u64> = runs.iter().flat_map(|&(at, len)| [at, len]).collect();
    let table = stream
        .clone_htod(&table)
        .map_err(driver("cuMemcpyHtoDAsync"))?;
    let table_ptr = table.device_ptr(stream).0;
    let f = device
        .function("copy_runs")
        .ok_or(DeviceMemoryError::Driver {
            call: "copy_runs (kernel not loaded)",
            source: DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_FOUND),
        })?;
    let n = runs.len() as i64;
    let mut builder = stream.launch_builder(f);
    builder.arg(&table_ptr).arg(&n).arg(&src).arg(&dst);
    let blocks = copy_runs_grid(runs.len());
    // SAFETY: `copy_runs(const u64* runs, long long n, const char* src, char* dst)` reads
    // n (offset, length) pairs from the table (2n u64 uploaded above) and copies each
    // run's bytes from src + offset to dst + offset; the caller checked every run lies
    // inside both views (`runs_span`), which lie inside the gpu arena and the registered
    // pinned arena.
    unsafe {
        builder.launch(cudarc::driver::LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .map_err(driver("cuLaunchKernel(copy_runs)"))?;
    drop(table);
    Ok(())
}

/// The grid of a `copy_runs` launch over `runs` runs at 256 threads a block: a block
/// takes 8 consecutive runs (one a warp when short, kernels/ops.cu), so `runs / 8`
/// blocks, at least one and at most 65,535 (blocks stride over the rest).
pub fn copy_runs_grid(runs: usize) -> u32 {
    runs.div_ceil(8).clamp(1, 65_535) as u32
}

fn register_pinned(host: &HostMemory<'_>) -> Result<Option<(usize, usize)>, DeviceMemoryError> {
    let len = host.sizes().0[1] as usize;
    if len == 0 {
        return Ok(None);
    }
    let view = View {
        region: Region::Arena(Space::Pinned),
        start: 0,
        len: len as u64,
    };
    // SAFETY: set-up runs before any task; nothing else views the pinned arena now.
    let bytes = unsafe { host.bytes_mut(view)? };
    let ptr = bytes.as_mut_ptr();
    // SAFETY: `ptr` addresses `len` bytes of a live mapping that outlives the registration
    // (the host memory is held by the same backend and dropped after `DeviceMemory`).
    // Device-mapped, so a kernel can move many small runs in one launch (copy_runs).
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
        .result()
        .map_err(driver("cuMemHostRegister"))?;
    Ok(Some((ptr as usize, len)))
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let Some((ptr, _)) = self.pinned.take() {
            // A failure here cannot be acted on; the mapping is released right after.
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `ptr` was registered by `register_pinned` and is still mapped.
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) }.result();
        }
    }
}
