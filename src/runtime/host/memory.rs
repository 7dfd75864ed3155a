//! Host memory every backend uses: one arena per space, the weights image, and the weight
//! maps. The CPU backend computes on all of it; a device backend keeps `gpu` in device
//! memory and uses the `pinned` and `host` arenas and the image from here
//! ([`HostMemory::host_side`]).
//!
//! Takes a plan, a checkpoint and the backend options; gives a [`HostMemory`] that resolves
//! a task argument to bytes in exactly one arena (or the weights image), enforcing the
//! engine/space discipline at run time (a `gpu.compute` op only ever gets views into the
//! `gpu` arena), and copies bytes between arenas (with an optional link throttle so
//! transfers take the time a PCIe link would). The `gpu` arena has the plan's capacity;
//! the `pinned` arena is page-locked when the OS allows (reported by
//! [`HostMemory::pinned_locked`]). The weights image `W` is not allocated: it is a
//! read-only [`MappedImage`] over the checkpoint's memory maps (pageable), viewed one
//! tensor at a time and copied out of range by range.
//!
//! Weight copies ([`WeightCopies`]): the image is read-only and an arena range labelled
//! with tensor `T` holds exactly `T`'s image bytes (labels move only with copies of those
//! bytes and every other write clears them), so a kernel may read `T` from the image
//! instead. In `Bind` mode (the default) a copy therefore moves the labels of the weight
//! bytes it covers and copies only the unlabelled bytes (activations, KV, padding), and
//! [`HostMemory::find_weight`] answers with the image's bytes of a tensor found in an
//! arena. That is the copy engines of a GPU box: a DMA transfer takes link time (the
//! `--link-gbps` throttle still applies to the bytes the copy stands for) but neither
//! the compute cores nor their memory bandwidth, which a memcpy on the CPU backend's two
//! cores would take from the kernels. `Move` copies every byte (the CUDA backend's host
//! side starts so, and binds once its device reads the image's own page-locked memory:
//! [`HostMemory::bind_weight_copies`]).

use super::arena::{Arena, ArenaError};
use super::byte_runs::unlabelled_runs;
pub(crate) use super::byte_runs::{clip_to_runs, runs_span};
use super::copy_pool::CopyPool;
use super::disk::{DiskError, DiskReader, DiskTotals};
use super::image::{ImageViewError, MappedImage};
use super::weights::{image_layout, ImageError, ImageLayout, WeightMap, WeightTag};
use crate::ir::{Engine, Space};
use crate::lower::{ExecPlan, Placement, PlanArg, PlanTask};
use crate::math::qmatmul::tiles::TileMode;
use crate::records::load::{Laps, LoadPhase};
use crate::runtime::backend::{BackendOptions, CopyTotals, WeightCopies};
use crate::runtime::step::{sleep_in_step, SleepCut, StepContext};
use crate::runtime::sync::lock;
use crate::weights::checkpoint::Checkpoint;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Bytes in a GiB, for the set-up's details.
const GIB: f64 = (1u64 << 30) as f64;

/// Copies at least this long are split over the machine's cores. One thread's memcpy
/// stays well below the memory bandwidth (`moec probe` on the 2-core machine of
/// docs/performance.md: 5.2 GB/s one-thread memcpy against 12.5 GB/s streaming read on
/// two), and a copy stream otherwise leaves the other cores idle whenever compute waits on
/// it (every weight load of `baselines/sequential`, every setup copy).
pub const PARALLEL_COPY_MIN: usize = 8 << 20;

/// Where an argument's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    /// The weights image (`W`).
    Image,
    /// An arena.
    Arena(Space),
}

/// A resolved argument: region and absolute byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    /// The region.
    pub region: Region,
    /// First byte in the region.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Problems of host memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// A copy task without its `src` or `dst` argument (the catalog gives every copy both).
    #[error("the copy has no `{0}` argument")]
    MissingArg(&'static str),
    /// An arena could not be allocated or viewed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// The weights image could not be built.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// Bytes of the weights image could not be served.
    #[error(transparent)]
    ImageView(#[from] ImageViewError),
    /// A write into the weights image (`W` is the read-only checkpoint).
    #[error("weights image: bytes {start}..{end} are read-only (the image is the memory-mapped checkpoint)")]
    ReadOnlyImage {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
    },
    /// An op got a view into a space its engine may not touch.
    #[error("a {engine} task got its `{role}` argument in {space} memory")]
    Space {
        /// The engine.
        engine: &'static str,
        /// The argument.
        role: &'static str,
        /// Where it was.
        space: &'static str,
    },
    /// The emulated link (`--link-gbps`) would hold a copy past the watchdog.
    #[error("at the emulated link's {gbps} GB/s (--link-gbps) this copy of {bytes} bytes takes {secs:.3e} s, past the {watchdog} s watchdog")]
    Throttled {
        /// Bytes copied.
        bytes: u64,
        /// The emulated link bandwidth.
        gbps: f64,
        /// Seconds the throttle would sleep in all.
        secs: f64,
        /// The watchdog's period in seconds.
        watchdog: f64,
    },
    /// A run of a copy that lies past the end of the source or destination view.
    #[error("copy run of {len} bytes at offset {offset} lies outside the {view}-byte views")]
    RunOutside {
        /// Offset of the run from the views' starts.
        offset: u64,
        /// Its length.
        len: u64,
        /// Bytes of the shorter view.
        view: u64,
    },
    /// A copy whose source and destination bytes overlap.
    #[error("copy source and destination overlap ({len} bytes at {src} and {dst})")]
    Overlap {
        /// Source start.
        src: u64,
        /// Destination start.
        dst: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A read of the checkpoint from disk failed (the file shrank or became unreadable
    /// while running).
    #[error("reading {tensor} from disk: {source}")]
    Disk {
        /// The tensor whose bytes were being read.
        tensor: String,
        /// What failed.
        source: DiskError,
    },
    /// A format copy of the experts (`W.q8_0`) could not be made at load.
    #[error("making the format copies of the experts: {0}")]
    FormatCopy(String),
    /// The `gpu` arena exceeds the configured device memory.
    #[error("the gpu arena needs {needed} bytes but the device has {capacity}")]
    GpuCapacity {
        /// Bytes the plan places in `gpu`.
        needed: u64,
        /// Configured capacity.
        capacity: u64,
    },
}

/// Arenas, image and weight maps; the image borrows the checkpoint's memory maps.
#[derive(Debug)]
pub struct HostMemory<'c> {
    arenas: [Arena; 3],
    image: MappedImage<'c>,
    layout: ImageLayout,
    maps: [Mutex<WeightMap>; 3],
    image_map: WeightMap,
    /// Emulated link bandwidth in GB/s for host<->device copies, if throttled.
    link_gbps: Option<f64>,
    /// Byte offset of each buffer within its region.
    buffer_base: Vec<(Region, u64)>,
    /// Whether weight copies bind (`WeightCopies::Bind`): set at construction, or by a
    /// device backend before the first task once its device reads the image's own
    /// memory ([`HostMemory::bind_weight_copies`]).
    bind: AtomicBool,
    /// Where each tensor starts in the image (what a bound weight is read from).
    image_starts: HashMap<WeightTag, u64>,
    /// Bytes bound and moved so far.
    bound: AtomicU64,
    moved: AtomicU64,
    /// Bytes of the image whose page tables were populated before the first step.
    populated: u64,
    /// Bytes of Q4_K matrices repacked into tiles at load.
    tiled: u64,
    /// Bytes of the image copied by a host memcpy (to an arena, or staged for a device
    /// copy): the relay a device that reads the image's own memory does without.
    relayed: AtomicU64,
    /// The threads a large copy is split over, made once per run: the machine's cores,
    /// asked once (the query reads cgroup files: tens of microseconds, and a step makes
    /// hundreds of copies).
    copy_pool: CopyPool,
    /// The checkpoint whose files `disk.read` copies read.
    checkpoint: &'c Checkpoint,
    /// The plan's disk reads, when it has a `disk.read` stream (its checkpoint is on disk).
    disk: Option<DiskReader>,
    /// Where each converted segment of a format copy starts in the `host` arena (what a
    /// bound converted weight is read from, as `image_starts` for the image's tensors).
    converted_starts: HashMap<WeightTag, u64>,
    /// The formats the plan's format copies hold.
    converted_formats: Vec<crate::quant::QuantFormat>,
    /// Expert computations that read a converted expert, and all of them.
    substituted: [AtomicU64; 2],
    /// Its set-up, timed part by part ([`HostMemory::setup_phases`]).
    setup: Vec<LoadPhase>,
}

fn space_index(space: Space) -> usize {
    match space {
        Space::Gpu => 0,
        Space::Pinned => 1,
        Space::Host => 2,
        // Nothing of the disk is in an arena; a view of `W` is `Region::Image`.
        Space::Disk => 2,
    }
}

impl<'c> HostMemory<'c> {
    /// Allocates the arenas of `plan` and maps the weights image onto `checkpoint`.
    pub fn new(
        plan: &ExecPlan,
        checkpoint: &'c Checkpoint,
        options: &BackendOptions,
    ) -> Result<Self, MemoryError> {
        let gpu = plan.arena(Space::Gpu);
        if let Some(capacity) = options.gpu_capacity.filter(|&c| gpu.bytes > c) {
            return Err(MemoryError::GpuCapacity {
                needed: gpu.bytes,
                capacity,
            });
        }
        // Which formats are tiled here follows the tile mode (`tiles::tiled_at_load`: by
        // default Q4_K only; the other formats' many-row products pack as they run).
        let tile_quant = crate::math::qmatmul::tiles::mode() != TileMode::Off
            && !crate::math::isa::Kernels::process().decodes_quant();
        Self::build(
            plan,
            checkpoint,
            options,
            gpu.bytes,
            options.weight_copies,
            tile_quant,
        )
    }

    /// The host side only: the `pinned` and `host` arenas and the weights image, with an
    /// empty `gpu` arena (a device backend keeps `gpu` in device memory; a view into it
    /// still resolves, to an offset the device backend owns). Copies move every byte
    /// until the device backend binds them ([`HostMemory::bind_weight_copies`]).
    pub fn host_side(
        plan: &ExecPlan,
        checkpoint: &'c Checkpoint,
        options: &BackendOptions,
    ) -> Result<Self, MemoryError> {
        Self::build(plan, checkpoint, options, 0, WeightCopies::Move, false)
    }

    fn build(
        plan: &ExecPlan,
        checkpoint: &'c Checkpoint,
        options: &BackendOptions,
        gpu_bytes: u64,
        weight_copies: WeightCopies,
        tile_quant: bool,
    ) -> Result<Self, MemoryError> {
        // A checkpoint on disk is read by `disk.read` copies into arenas, where the kernels
        // read it: labels must stand for bytes really there (no binding), no tiles are made
        // from the file at load and nothing is faulted in ahead.
        let reads_disk = plan.streams.iter().any(|s| s.engine == Engine::DiskRead);
        let weight_copies = if reads_disk {
            WeightCopies::Move
        } else {
            weight_copies
        };
        let tile_quant = tile_quant && !reads_disk;
        let mut laps = Laps::start();
        let arenas = [
            Arena::new("gpu", gpu_bytes, false)?,
            Arena::new("pinned", plan.arena(Space::Pinned).bytes, true)?,
            Arena::new("host", plan.arena(Space::Host).bytes, false)?,
        ];
        laps.lap("arenas");
        let mut layout = image_layout(checkpoint, plan.checkpoint)?;
        let mut image = MappedImage::new(checkpoint, &layout)?;
        laps.lap("weights image mapped");
        // The CPU backend's own products read Q4_K in tiles of eight rows, repacked here
        // once in place of the blocks; a device backend (`host_side`) reads the file's
        // layout, and so do the f32 products of decoded weights.
        let copy_pool = CopyPool::new(std::thread::available_parallelism().map_or(1, |t| t.get()));
        let tiled = if tile_quant {
            let at_load: Vec<_> = layout
                .tileable()
                .into_iter()
                .filter(|&(_, format, _, _)| crate::math::qmatmul::tiles::tiled_at_load(format))
                .collect();
            let (tags, bytes) = image.tile(checkpoint, &at_load, &copy_pool, &mut laps)?;
            layout.tiled = tags.into_iter().collect();
            bytes
        } else {
            0
        };
        // Fault the weights in now rather than a page at a time inside the first step's
        // kernels, unless they would crowd out half of what the machine has left (a
        // checkpoint larger than memory is streamed from disk by the OS as it is read).
        let fits = crate::sysmem::available_bytes().is_some_and(|a| image.len() <= a / 2);
        let populated = if fits && !reads_disk {
            image.populate()
        } else {
            0
        };
        laps.lap("page tables populated").detail = Some(if populated > 0 {
            format!("{:.2} GiB", populated as f64 / GIB)
        } else if reads_disk {
            "none: the plan reads the checkpoint from disk".to_string()
        } else if !fits {
            "none: the image is over half the memory available".to_string()
        } else {
            "none: the OS refused MADV_POPULATE_READ".to_string()
        });
        // The format copies of the experts, made once here, before the first step.
        let converted = super::format_copy::make_format_copies(plan, &image, &layout, &arenas[2])
            .map_err(MemoryError::FormatCopy)?;
        if !converted.is_empty() {
            laps.lap("format copies");
        }
        let maps: [Mutex<WeightMap>; 3] = Default::default();
        {
            let mut host = lock(&maps[space_index(Space::Host)]);
            for c in &converted {
                host.insert(c.start, c.len, c.tag, 0);
            }
        }
        let converted_starts = converted
            .iter()
            .map(|c| (c.tag, c.start))
            .collect::<HashMap<_, _>>();
        let mut converted_formats: Vec<crate::quant::QuantFormat> = Vec::new();
        for format in plan.format_copies.iter().filter_map(|c| c.format.quant()) {
            if !converted_formats.contains(&format) {
                converted_formats.push(format);
            }
        }
        let image_map = layout.map();
        let image_starts = layout
            .tags()
            .into_iter()
            .map(|(start, _, tag)| (tag, start))
            .collect();
        let buffer_base = plan
            .buffers
            .iter()
            .map(|b| match b.placement {
                Placement::Checkpoint => (Region::Image, 0),
                Placement::Arena { space, offset } => (Region::Arena(space), offset),
            })
            .collect();
        Ok(HostMemory {
            arenas,
            image,
            layout,
            maps,
            image_map,
            link_gbps: options.link_gbps,
            buffer_base,
            bind: AtomicBool::new(weight_copies == WeightCopies::Bind),
            image_starts,
            bound: AtomicU64::new(0),
            moved: AtomicU64::new(0),
            populated,
            tiled,
            relayed: AtomicU64::new(0),
            copy_pool,
            checkpoint,
            disk: reads_disk.then(DiskReader::new),
            converted_starts,
            converted_formats,
            substituted: Default::default(),
            setup: laps.into_phases(),
        })
    }

    /// The parts of this memory's set-up, timed in order: arenas, the weights image
    /// mapped, the tiles' arena and their repacking, page tables populated, format copies
    /// (each only where it ran).
    pub fn setup_phases(&self) -> &[LoadPhase] {
        &self.setup
    }

    /// The formats of the plan's format copies of the experts (empty: none).
    pub fn converted_formats(&self) -> &[crate::quant::QuantFormat] {
        &self.converted_formats
    }

    /// Counts one expert computation, `substituted` when it read a converted copy.
    pub fn note_expert_source(&self, substituted: bool) {
        self.substituted[usize::from(substituted)].fetch_add(1, Ordering::Relaxed);
    }

    /// Expert computations so far that read a converted copy, and all of them.
    pub fn substituted_experts(&self) -> (u64, u64) {
        let (full, sub) = (
            self.substituted[0].load(Ordering::Relaxed),
            self.substituted[1].load(Ordering::Relaxed),
        );
        (sub, full + sub)
    }

    /// What the run's `disk.read` copies read so far; `None` when the plan reads no disk.
    pub fn disk_totals(&self) -> Option<DiskTotals> {
        self.disk.as_ref().map(DiskReader::totals)
    }

    /// Bytes of the image whose page tables were populated before the first step (0: the
    /// image was larger than half the available memory, or the OS refused).
    pub fn populated(&self) -> u64 {
        self.populated
    }

    /// Bytes of Q4_K matrices repacked into tiles at load.
    pub fn tiled_bytes(&self) -> u64 {
        self.tiled
    }

    /// The run report's words on tiles (Q4_K, Q6_K, Q8_0, Q4_0, MXFP4): how many matrices
    /// and bytes were repacked at load, or where the products get their tiles instead;
    /// `None` when the image has no matrix to tile.
    pub fn tiling(&self) -> Option<String> {
        use crate::math::qmatmul::tiles::{mode, pack_thresholds};
        const FORMATS: &str = "Q4_K/Q6_K/Q8_0/Q4_0/MXFP4 matrices";
        let n = self.layout.tiled.len();
        let mib = self.tiled as f64 / (1u64 << 20) as f64;
        let packs = format!(
            "products of >= {} activation rows pack each panel into tiles as they run",
            pack_thresholds()
        );
        if n > 0 && mode() == TileMode::Load {
            return Some(format!(
                "{FORMATS} in tiles of eight rows: {n} ({mib:.1} MiB, repacked at load in \
                 place of their blocks, MOEC_QUANT_TILES=load)"
            ));
        }
        if n > 0 {
            return Some(format!(
                "Q4_K matrices in tiles of eight rows: {n} ({mib:.1} MiB, repacked at load in \
                 place of their blocks: its decode reads tiles faster); the other formats in \
                 ggml's row layout, read in place: {packs} (MOEC_QUANT_TILES=pack)"
            ));
        }
        if self.layout.tileable().is_empty() {
            return None;
        }
        let decoded = crate::math::isa::Kernels::process().decodes_quant();
        Some(match mode() {
            _ if decoded => format!("{FORMATS} in ggml's row layout (decoded products)"),
            TileMode::Pack => format!(
                "{FORMATS} in ggml's row layout, read in place, none repacked at load: \
                 {packs} (MOEC_QUANT_TILES=pack)"
            ),
            TileMode::Off => format!("{FORMATS} in ggml's row layout (MOEC_QUANT_TILES=off)"),
            TileMode::Load => format!(
                "{FORMATS} in ggml's row layout (MOEC_QUANT_TILES=load, but none tiled: \
                 a backend that reads the file's layout, or a checkpoint read from disk)"
            ),
        })
    }

    /// How weight bytes are copied.
    pub fn weight_copies(&self) -> WeightCopies {
        if self.bind.load(Ordering::Acquire) {
            WeightCopies::Bind
        } else {
            WeightCopies::Move
        }
    }

    /// Makes weight copies bind from now on: a copy moves the labels of weight bytes and
    /// copies only the rest, and a bound arena range is read from the image. A device
    /// backend calls this during set-up, before any task, once its device copies from the
    /// image's own memory (registered or page-locked), so a weight never needs its bytes
    /// in an arena on the host.
    pub fn bind_weight_copies(&self) {
        // A plan reading its checkpoint from disk copies real bytes into its arenas.
        if self.disk.is_some() {
            return;
        }
        self.bind.store(true, Ordering::Release);
    }

    /// Whether a weight label in an arena stands for bytes that are only in the image.
    pub fn binds(&self) -> bool {
        self.bind.load(Ordering::Acquire)
    }

    /// Where tensor `tag` starts in the image (what a bound arena label stands for).
    pub fn image_start(&self, tag: WeightTag) -> Option<u64> {
        self.image_starts.get(&tag).copied()
    }

    /// Where converted segment `tag` of a format copy starts in the `host` arena: what a
    /// bound `WeightTag::Converted` label stands for, as [`HostMemory::image_start`] is for
    /// the image's tensors (a device backend reads the copy's bytes there).
    pub fn converted_start(&self, tag: WeightTag) -> Option<u64> {
        self.converted_starts.get(&tag).copied()
    }

    /// Bytes of the image relayed by a host memcpy so far (into an arena, or staged for a
    /// device copy).
    pub fn relayed(&self) -> u64 {
        self.relayed.load(Ordering::Relaxed)
    }

    /// Counts `bytes` of the image a device backend staged through a host buffer.
    pub fn count_relayed(&self, bytes: u64) {
        self.relayed.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The run's copy pool (threads made once, on the first large copy).
    pub fn copy_pool(&self) -> &CopyPool {
        &self.copy_pool
    }

    /// Bytes the copies so far bound and moved.
    pub fn copy_totals(&self) -> CopyTotals {
        CopyTotals {
            bound: self.bound.load(Ordering::Relaxed),
            moved: self.moved.load(Ordering::Relaxed),
        }
    }

    /// Whether the pinned arena is page-locked (false when the OS refused or it is empty).
    pub fn pinned_locked(&self) -> bool {
        self.arenas[1].is_locked()
    }

    /// The weights image geometry.
    pub fn layout(&self) -> &ImageLayout {
        &self.layout
    }

    /// Bytes allocated per space (gpu, pinned, host), and of the weights image's tensors
    /// as held (mapped from the checkpoint or tiled; [`MappedImage::tensor_bytes`]).
    pub fn sizes(&self) -> ([u64; 3], u64) {
        (
            [
                self.arenas[0].len() as u64,
                self.arenas[1].len() as u64,
                self.arenas[2].len() as u64,
            ],
            self.image.tensor_bytes(),
        )
    }

    /// The weights image.
    pub fn image(&self) -> &MappedImage<'c> {
        &self.image
    }

    /// Resolves an argument (with its dynamic expert, if any, already chosen).
    pub fn view(
        &self,
        task: &PlanTask,
        arg: &PlanArg,
        expert: Option<u32>,
    ) -> Result<View, MemoryError> {
        let (region, base) = self
            .buffer_base
            .get(arg.buffer.index())
            .copied()
            .unwrap_or((Region::Image, 0));
        let start = base + arg.start + expert.map_or(0, |e| u64::from(e) * arg.len);
        let view = View {
            region,
            start,
            len: arg.len,
        };
        let space = match region {
            Region::Image => Space::Host,
            Region::Arena(s) => s,
        };
        let allowed = match task.engine {
            Engine::GpuCompute => space == Space::Gpu,
            Engine::CpuCompute | Engine::CpuCopy => space != Space::Gpu,
            Engine::DiskRead => match arg.role {
                crate::ir::Role::Src => region == Region::Image,
                _ => space != Space::Gpu,
            },
            Engine::GpuCopyIn | Engine::GpuCopyOut => true,
        };
        if !allowed {
            return Err(MemoryError::Space {
                engine: task.engine.as_str(),
                role: arg.role.as_str(),
                space: space.as_str(),
            });
        }
        Ok(view)
    }

    /// The resolved `src` and `dst` arguments of a copy task (a run-time expert or cache
    /// slot resolved through the step).
    pub fn copy_views(
        &self,
        task: &PlanTask,
        step: &dyn StepContext,
        experts: u32,
    ) -> Result<(View, View), MemoryError> {
        let view = |role: crate::ir::Role| {
            let arg = task
                .args
                .iter()
                .find(|a| a.role == role)
                .ok_or(MemoryError::MissingArg(role.as_str()))?;
            self.view(task, arg, step.arg_index(task.id, arg, experts))
        };
        Ok((view(crate::ir::Role::Src)?, view(crate::ir::Role::Dst)?))
    }

    /// Shared bytes of a view; a view of the image must lie inside one tensor (what
    /// [`HostMemory::find_weight`] returns).
    ///
    /// # Safety
    ///
    /// The contract of [`Arena::bytes`]: no exclusive view of these bytes is alive (the
    /// calling task's waits have returned, so every writer of these bytes is ordered
    /// before or after it). The read-only image needs nothing.
    pub unsafe fn bytes(&self, view: View) -> Result<&[u8], MemoryError> {
        match view.region {
            Region::Image => Ok(self.image.view(view.start, view.len)?),
            // SAFETY: forwarded to the caller (this fn's contract is the arena's).
            Region::Arena(space) => {
                Ok(unsafe { self.arenas[space_index(space)].bytes(view.start, view.len)? })
            }
        }
    }

    /// Exclusive bytes of a view; the image is read-only (an error).
    ///
    /// # Safety
    ///
    /// The contract of [`Arena::bytes_mut`]: no other view of these bytes is alive while
    /// the returned slice is.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, view: View) -> Result<&mut [u8], MemoryError> {
        match view.region {
            Region::Image => Err(MemoryError::ReadOnlyImage {
                start: view.start,
                end: view.start.saturating_add(view.len),
            }),
            // SAFETY: forwarded to the caller (this fn's contract is the arena's).
            Region::Arena(space) => {
                Ok(unsafe { self.arenas[space_index(space)].bytes_mut(view.start, view.len)? })
            }
        }
    }

    /// Where `tag` lies whole inside one of `views`: that view's region and absolute
    /// start. In `Bind` mode a tensor found in an arena is answered with its image bytes
    /// (the labels vouch that the arena range stands for exactly those bytes).
    pub fn find_weight(&self, views: &[View], tag: WeightTag) -> Option<View> {
        let len = self.layout.tag_len(tag);
        for v in views {
            let found = match v.region {
                Region::Image => self.image_map.find_whole(v.start, v.len, tag, len),
                Region::Arena(space) => {
                    lock(&self.maps[space_index(space)]).find_whole(v.start, v.len, tag, len)
                }
            };
            if let Some(start) = found {
                let bound = self.binds() && matches!(v.region, Region::Arena(_));
                if !bound {
                    return Some(View {
                        region: v.region,
                        start,
                        len,
                    });
                }
                // A bound arena range holds no bytes: only the image's own copy of the
                // tensor may answer (labels come only from image tensors, so it exists;
                // if not, the tensor is missing, never the arena's stale bytes).
                if let Some(&start) = self.converted_starts.get(&tag) {
                    return Some(View {
                        region: Region::Arena(Space::Host),
                        start,
                        len,
                    });
                }
                return self.image_starts.get(&tag).map(|&image_start| View {
                    region: Region::Image,
                    start: image_start,
                    len,
                });
            }
        }
        None
    }

    /// Copies `src` to `dst` (equal lengths), throttled to the link for host<->device
    /// engines, and moves the weight labels along.
    pub fn copy(&self, engine: Engine, src: View, dst: View) -> Result<(), MemoryError> {
        self.copy_runs(engine, src, dst, &[(0, src.len)])
    }

    /// Copies `runs` of `src` to the same offsets of `dst` as one copy, throttled to the
    /// link for host<->device engines, and moves the weight labels of those bytes along;
    /// bytes of `dst` outside the runs, and their labels, are left alone. Each run is
    /// (offset from both views' starts, length); runs are sorted and disjoint (what
    /// the driver's KV-copy expansion gives). One command however many runs: one
    /// overlap check over the span they cover, each label map locked once, one throttle
    /// sleep for their total bytes, and the bytes copied directly (a run of at least
    /// [`PARALLEL_COPY_MIN`] bytes split over the cores, a shorter one by this thread).
    pub fn copy_runs(
        &self,
        engine: Engine,
        src: View,
        dst: View,
        runs: &[(u64, u64)],
    ) -> Result<(), MemoryError> {
        let started = Instant::now();
        let Some((first, end)) = runs_span(runs, src, dst)? else {
            return Ok(());
        };
        // The runs sit at the same offsets in both views, so they are disjoint exactly
        // when the spans they cover are (conservatively: a gap inside the span could let
        // interleaved runs pass, and no plan copies that way).
        let overlap = src.region == dst.region
            && src.start + first < dst.start + end
            && dst.start + first < src.start + end;
        if overlap && end > first {
            return Err(MemoryError::Overlap {
                src: src.start + first,
                dst: dst.start + first,
                len: end - first,
            });
        }
        // The labels of the span, clipped to the runs, as offsets from the views' starts.
        let span = self.labels_in(src.region, src.start + first, end - first);
        let labels = clip_to_runs(&span, first, runs);
        let total: u64 = runs.iter().map(|r| r.1).sum();
        let bind = self.binds() && matches!(dst.region, Region::Arena(_));
        // The byte ranges to copy: the runs, or (binding) their parts no weight label covers.
        let ranges = if bind {
            unlabelled_runs(&labels, runs)
        } else {
            runs.iter().map(|&(at, len)| (at, at + len)).collect()
        };
        // Only the spans the runs cover are viewed: the views themselves may overlap
        // outside them.
        let span_of = |v: View| View {
            start: v.start + first,
            len: end - first,
            ..v
        };
        // SAFETY: the two spans do not overlap (checked above), and the copy task's waits
        // have returned, so no other task touches either now (the plan's dependencies);
        // `from` below is the only other view alive.
        let to = unsafe { self.bytes_mut(span_of(dst))? };
        let from = match src.region {
            Region::Image => None,
            // SAFETY: as for `to`.
            Region::Arena(_) => Some(unsafe { self.bytes(span_of(src))? }),
        };
        let pool = &self.copy_pool;
        let mut moved = 0u64;
        for (lo, hi) in ranges {
            moved += hi - lo;
            let (lo, hi) = ((lo - first) as usize, (hi - first) as usize);
            let part = &mut to[lo..hi];
            if let (Some(disk), None) = (&self.disk, from) {
                self.read_disk(disk, src.start + first + lo as u64, part)?;
                continue;
            }
            match from {
                // Any range of W (several tensors and the padding between them): assembled
                // from the maps.
                None => {
                    self.relayed.fetch_add(part.len() as u64, Ordering::Relaxed);
                    pool.fill(part, PARALLEL_COPY_MIN, |at, piece| {
                        self.image
                            .copy_to(src.start + first + (lo + at) as u64, piece)
                    })?
                }
                Some(from) => {
                    let from = &from[lo..hi];
                    if part.len() < PARALLEL_COPY_MIN {
                        part.copy_from_slice(from);
                    } else {
                        pool.fill(part, PARALLEL_COPY_MIN, |at, piece| {
                            piece.copy_from_slice(&from[at..at + piece.len()]);
                            Ok::<(), std::convert::Infallible>(())
                        })
                        .unwrap_or_else(|never| match never {});
                    }
                }
            }
        }
        self.moved.fetch_add(moved, Ordering::Relaxed);
        self.bound.fetch_add(total - moved, Ordering::Relaxed);
        self.relabel_runs(dst, runs, &labels);
        let crosses_link = matches!(engine, Engine::GpuCopyIn | Engine::GpuCopyOut);
        if let (true, Some(gbps)) = (crosses_link, self.link_gbps.filter(|g| *g > 0.0)) {
            let target = Duration::from_secs_f64(total as f64 / (gbps * 1e9));
            let spent = started.elapsed();
            if target > spent {
                // Watched: at 1e-6 GB/s one copy would sleep for hours; a failed task ends
                // the sleep (the bytes are copied already), and so does the watchdog.
                match sleep_in_step(target - spent) {
                    Ok(()) | Err(SleepCut::Aborted) => {}
                    Err(SleepCut::Watchdog(watchdog)) => {
                        return Err(MemoryError::Throttled {
                            bytes: total,
                            gbps,
                            secs: target.as_secs_f64(),
                            watchdog: watchdog.as_secs_f64(),
                        })
                    }
                }
            }
        }
        Ok(())
    }

    /// Fills `dst` with the image's bytes at `start` for a copy out of a checkpoint on
    /// disk: each tensor's bytes read from its file; padding, and tensors the checkpoint
    /// holds in memory (decoded or restored), from memory (counted apart in the totals).
    fn read_disk(&self, disk: &DiskReader, start: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        for piece in self.image.pieces(start, dst.len() as u64)? {
            match piece {
                super::image::ImagePiece::Zeros { offset, len } => {
                    dst[offset as usize..(offset + len) as usize].fill(0);
                    disk.note_from_memory(len);
                }
                super::image::ImagePiece::Bytes { offset, bytes } => {
                    let part = &mut dst[offset as usize..offset as usize + bytes.len()];
                    match self.checkpoint.file_of(bytes) {
                        Some((path, at)) => disk.read(path, at, part).map_err(|source| {
                            let tensor = self
                                .image_map
                                .labels_in(start + offset, bytes.len() as u64)
                                .first()
                                .map_or_else(
                                    || format!("bytes {}.. of W", start + offset),
                                    |label| label.2.to_string(),
                                );
                            MemoryError::Disk { tensor, source }
                        })?,
                        None => {
                            part.copy_from_slice(bytes);
                            disk.note_from_memory(bytes.len() as u64);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The weight labels of `len` bytes at `start` of `region`, as (offset from `start`,
    /// length, tensor, offset in the tensor): what a copy of those bytes carries along.
    pub(crate) fn labels_in(
        &self,
        region: Region,
        start: u64,
        len: u64,
    ) -> Vec<(u64, u64, WeightTag, u64)> {
        match region {
            Region::Image => self.image_map.labels_in(start, len),
            Region::Arena(space) => lock(&self.maps[space_index(space)]).labels_in(start, len),
        }
    }

    /// Replaces the labels of an arena view by `labels` (offsets from the view's start):
    /// the bytes a device copy wrote there now hold those tensors.
    pub(crate) fn relabel(&self, view: View, labels: &[(u64, u64, WeightTag, u64)]) {
        if let Region::Arena(space) = view.region {
            let mut map = lock(&self.maps[space_index(space)]);
            map.clear(view.start, view.start + view.len);
            for &(offset, len, tag, tag_offset) in labels {
                map.insert(view.start + offset, len, tag, tag_offset);
            }
        }
    }

    /// Replaces the labels of `runs` of an arena view (offset from its start, length) by
    /// `labels` (offsets from the view's start, inside the runs), under one lock: the
    /// bytes a copy of those runs wrote now hold those tensors; labels outside the runs
    /// stay.
    pub(crate) fn relabel_runs(
        &self,
        view: View,
        runs: &[(u64, u64)],
        labels: &[(u64, u64, WeightTag, u64)],
    ) {
        let (Region::Arena(space), Some(&(first, _)), Some(end)) = (
            view.region,
            runs.first(),
            runs.iter().map(|r| r.0 + r.1).max(),
        ) else {
            return;
        };
        let mut map = lock(&self.maps[space_index(space)]);
        // Nothing to clear or insert (a KV cache: thousands of runs, never a weight).
        if labels.is_empty() && map.labels_in(view.start + first, end - first).is_empty() {
            return;
        }
        for &(at, len) in runs {
            map.clear(view.start + at, view.start + at + len);
        }
        for &(offset, len, tag, tag_offset) in labels {
            map.insert(view.start + offset, len, tag, tag_offset);
        }
    }

    /// Forgets weight labels of bytes an op overwrote with activations.
    pub fn clobber(&self, view: View) {
        if let Region::Arena(space) = view.region {
            lock(&self.maps[space_index(space)]).clear(view.start, view.start + view.len);
        }
    }
}

#[cfg(test)]
mod tests {
    /// A [`HostMemory`](super::HostMemory) of the tiny Mixtral checkpoint with 4 KiB `gpu`
    /// and `pinned` arenas, default options (weight copies bound).
    mod runs {
        use super::super::{HostMemory, MemoryError, Region, View, WeightCopies};
        use crate::ir::{Engine, Space};
        use crate::lower::{ArenaPlan, ExecPlan};
        use crate::model::card::ModelCard;
        use crate::runtime::backend::BackendOptions;
        use crate::runtime::host::weights::WeightTag;
        use crate::weights::checkpoint::Checkpoint;
        use crate::weights::synth::{write_checkpoint, SynthOptions};

        const ARENA: u64 = 4096;

        fn checkpoint(dir: &std::path::Path) -> Checkpoint {
            let card = ModelCard::load("mixtral-tiny").expect("built-in card");
            write_checkpoint(
                &card,
                dir,
                &SynthOptions {
                    seed: 3,
                    dtype: card.dtype,
                    max_shard_bytes: u64::MAX,
                },
            )
            .expect("synthetic checkpoint");
            Checkpoint::open(dir).expect("opens")
        }

        fn plan(card: &ModelCard) -> ExecPlan {
            let arena = |space| ArenaPlan {
                space,
                bytes: ARENA,
                capacity: None,
            };
            ExecPlan {
                name: "copy-runs".to_string(),
                checkpoint: crate::ir::CheckpointLayout::new(card),
                model: card.clone(),
                micro_batches: crate::ir::MicroBatches {
                    count: 1,
                    size: 1,
                    mixed_tokens: 1,
                },
                workload: Default::default(),
                streams: Vec::new(),
                tasks: Vec::new(),
                buffers: Vec::new(),
                arenas: vec![arena(Space::Gpu), arena(Space::Pinned)],
                steps: Vec::new(),
                preds: Vec::new(),
                caches: Vec::new(),
                format_copies: Vec::new(),
            }
        }

        fn whole(space: Space) -> View {
            View {
                region: Region::Arena(space),
                start: 0,
                len: ARENA,
            }
        }

        fn fill(memory: &HostMemory<'_>, space: Space, byte: impl Fn(usize) -> u8) {
            // SAFETY: the test holds no other view of the arena.
            let bytes = unsafe { memory.bytes_mut(whole(space)) }.expect("arena");
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = byte(i);
            }
        }

        fn bytes(memory: &HostMemory<'_>, space: Space) -> Vec<u8> {
            // SAFETY: the test holds no other view of the arena.
            unsafe { memory.bytes(whole(space)) }
                .expect("arena")
                .to_vec()
        }

        /// Runs 0..100, 500..600 and 2000..2100 of `pinned` copied to `gpu`: the source's
        /// labels inside the runs move (0..100 and 500..600 of an embedding label over
        /// 0..1000, each with its own offset into the tensor); a destination label outside
        /// every run (300..400) stays; a destination label inside a run whose source bytes
        /// are unlabelled (2000..2100) is cleared and those bytes are copied; bytes outside
        /// the runs are untouched. Only the unlabelled 100 bytes move; 200 are bound.
        #[test]
        fn labels_inside_the_runs_move_and_labels_outside_stay() {
            let dir = tempfile::tempdir().expect("temporary directory");
            let ck = checkpoint(&dir.path().join("ck"));
            let plan = plan(ck.card());
            let memory = HostMemory::new(&plan, &ck, &BackendOptions::default()).expect("memory");
            assert_eq!(memory.weight_copies(), WeightCopies::Bind);
            let (pinned, gpu) = (whole(Space::Pinned), whole(Space::Gpu));
            fill(&memory, Space::Pinned, |i| (i % 251) as u8);
            fill(&memory, Space::Gpu, |_| 0xEE);
            memory.relabel(pinned, &[(0, 1000, WeightTag::Embed, 0)]);
            memory.relabel(
                gpu,
                &[
                    (300, 100, WeightTag::LmHead, 0),
                    (2000, 100, WeightTag::FinalNorm, 0),
                ],
            );
            let runs = [(0, 100), (500, 100), (2000, 100)];
            memory
                .copy_runs(Engine::GpuCopyIn, pinned, gpu, &runs)
                .expect("copies");
            assert_eq!(
                memory.labels_in(gpu.region, 0, ARENA),
                vec![
                    (0, 100, WeightTag::Embed, 0),
                    (300, 100, WeightTag::LmHead, 0),
                    (500, 100, WeightTag::Embed, 500),
                ]
            );
            let got = bytes(&memory, Space::Gpu);
            for (i, &b) in got.iter().enumerate() {
                let want = if (2000..2100).contains(&i) {
                    (i % 251) as u8
                } else {
                    0xEE // outside the runs, or a bound (labelled) run: not written
                };
                assert_eq!(b, want, "gpu byte {i}");
            }
            let totals = memory.copy_totals();
            assert_eq!((totals.moved, totals.bound), (100, 200));
            // The source keeps its labels.
            assert_eq!(
                memory.labels_in(pinned.region, 0, ARENA),
                vec![(0, 1000, WeightTag::Embed, 0)]
            );
        }

        /// Two views of one arena whose runs' spans overlap are refused (nothing copied),
        /// as is a run past the end of a view; views that overlap only outside the runs'
        /// span copy.
        #[test]
        fn overlapping_or_outside_runs_are_refused() {
            let dir = tempfile::tempdir().expect("temporary directory");
            let ck = checkpoint(&dir.path().join("ck"));
            let plan = plan(ck.card());
            let memory = HostMemory::new(&plan, &ck, &BackendOptions::default()).expect("memory");
            fill(&memory, Space::Pinned, |i| (i % 251) as u8);
            let before = bytes(&memory, Space::Pinned);
            let view = |start| View {
                region: Region::Arena(Space::Pinned),
                start,
                len: 1024,
            };
            // Runs 0..10 and 300..310 of views at 0 and 200: source span 0..310 meets
            // destination span 200..510.
            let err = memory
                .copy_runs(Engine::CpuCopy, view(0), view(200), &[(0, 10), (300, 10)])
                .expect_err("overlap");
            assert!(
                matches!(
                    err,
                    MemoryError::Overlap {
                        src: 0,
                        dst: 200,
                        len: 310
                    }
                ),
                "{err}"
            );
            let err = memory
                .copy_runs(Engine::CpuCopy, view(0), view(2048), &[(1000, 100)])
                .expect_err("outside");
            assert!(
                matches!(
                    err,
                    MemoryError::RunOutside {
                        offset: 1000,
                        len: 100,
                        view: 1024
                    }
                ),
                "{err}"
            );
            assert_eq!(bytes(&memory, Space::Pinned), before, "nothing copied");
            // Views 0..1024 and 200..1224 overlap, but the runs' spans (0..100 and
            // 200..300) do not.
            memory
                .copy_runs(Engine::CpuCopy, view(0), view(200), &[(0, 100)])
                .expect("disjoint runs copy");
            let after = bytes(&memory, Space::Pinned);
            assert_eq!(after[200..300], before[0..100]);
            assert_eq!(after[300..], before[300..]);
        }
    }
}
