//! The CPU backend's memory: one arena per space, the weights image, and the weight maps.
//!
//! Takes a plan, a checkpoint and the backend options; gives a [`CpuMemory`] that resolves
//! a task argument to bytes in exactly one arena, enforcing the engine/space discipline at
//! run time (a `gpu.compute` op only ever gets views into the `gpu` arena), and copies
//! bytes between arenas (with an optional link throttle so transfers take the time a PCIe
//! link would). The `gpu` arena has the plan's capacity; the `pinned` arena is page-locked
//! when the OS allows (reported by [`CpuMemory::pinned_locked`]).

use super::arena::{Arena, ArenaError};
use super::state::lock;
use super::weights::{image_layout, write_image, ImageError, ImageLayout, WeightMap, WeightTag};
use crate::ir::{Engine, Space};
use crate::lower::{ExecPlan, Placement, PlanArg, PlanTask};
use crate::model::checkpoint::Checkpoint;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    /// Bytes.
    pub len: u64,
}

/// Problems of the CPU backend's memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// An arena could not be allocated or viewed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// The weights image could not be built.
    #[error(transparent)]
    Image(#[from] ImageError),
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
    /// The `gpu` arena exceeds the configured device memory.
    #[error("the gpu arena needs {needed} bytes but the device has {capacity}")]
    GpuCapacity {
        /// Bytes the plan places in `gpu`.
        needed: u64,
        /// Configured capacity.
        capacity: u64,
    },
}

/// Options of the CPU backend's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MemoryOptions {
    /// Emulated host<->device link bandwidth in GB/s (`--link-gbps`); `None`: memcpy speed.
    pub link_gbps: Option<f64>,
    /// Device memory (`--gpu-mem` or the profile); `None`: what the plan needs.
    pub gpu_capacity: Option<u64>,
}

/// Arenas, image and weight maps.
#[derive(Debug)]
pub struct CpuMemory {
    arenas: [Arena; 3],
    image: Arena,
    layout: ImageLayout,
    maps: [Mutex<WeightMap>; 3],
    image_map: WeightMap,
    options: MemoryOptions,
    /// Byte offset of each buffer within its region.
    buffer_base: Vec<(Region, u64)>,
}

fn space_index(space: Space) -> usize {
    match space {
        Space::Gpu => 0,
        Space::Pinned => 1,
        Space::Host => 2,
    }
}

impl CpuMemory {
    /// Allocates the arenas of `plan` and builds the weights image from `checkpoint`.
    pub fn new(
        plan: &ExecPlan,
        checkpoint: &Checkpoint,
        options: MemoryOptions,
    ) -> Result<Self, MemoryError> {
        let gpu = plan.arena(Space::Gpu);
        if let Some(capacity) = options.gpu_capacity.filter(|&c| gpu.bytes > c) {
            return Err(MemoryError::GpuCapacity {
                needed: gpu.bytes,
                capacity,
            });
        }
        let arenas = [
            Arena::new("gpu", gpu.bytes, false)?,
            Arena::new("pinned", plan.arena(Space::Pinned).bytes, true)?,
            Arena::new("host", plan.arena(Space::Host).bytes, false)?,
        ];
        let layout = image_layout(checkpoint, plan.program.checkpoint())?;
        let image = Arena::new("weights", layout.checkpoint.total_bytes(), false)?;
        write_image(checkpoint, &layout, image.bytes_mut(0, image.len() as u64)?)?;
        let image_map = layout.map();
        let buffer_base = plan
            .buffers
            .iter()
            .map(|b| match b.placement {
                Placement::Checkpoint => (Region::Image, 0),
                Placement::Arena { space, offset } => (Region::Arena(space), offset),
            })
            .collect();
        Ok(CpuMemory {
            arenas,
            image,
            layout,
            maps: Default::default(),
            image_map,
            options,
            buffer_base,
        })
    }

    /// Whether the pinned arena is page-locked (false when the OS refused or it is empty).
    pub fn pinned_locked(&self) -> bool {
        self.arenas[1].is_locked()
    }

    /// The weights image geometry.
    pub fn layout(&self) -> &ImageLayout {
        &self.layout
    }

    /// Bytes allocated per space (gpu, pinned, host), and of the weights image.
    pub fn sizes(&self) -> ([u64; 3], u64) {
        (
            [
                self.arenas[0].len() as u64,
                self.arenas[1].len() as u64,
                self.arenas[2].len() as u64,
            ],
            self.image.len() as u64,
        )
    }

    fn arena(&self, region: Region) -> &Arena {
        match region {
            Region::Image => &self.image,
            Region::Arena(space) => &self.arenas[space_index(space)],
        }
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

    /// Shared bytes of a view (ordering contract of [`Arena::bytes`]).
    pub fn bytes(&self, view: View) -> Result<&[u8], MemoryError> {
        Ok(self.arena(view.region).bytes(view.start, view.len)?)
    }

    /// Exclusive bytes of a view (ordering contract of [`Arena::bytes_mut`]).
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self, view: View) -> Result<&mut [u8], MemoryError> {
        Ok(self.arena(view.region).bytes_mut(view.start, view.len)?)
    }

    /// Where `tag` lies whole inside one of `views`: that view's region and absolute start.
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
                return Some(View {
                    region: v.region,
                    start,
                    len,
                });
            }
        }
        None
    }

    /// Copies `src` to `dst` (equal lengths), throttled to the link for host<->device
    /// engines, and moves the weight labels along.
    pub fn copy(&self, engine: Engine, src: View, dst: View) -> Result<(), MemoryError> {
        let started = Instant::now();
        let from = self.bytes(src)?;
        let to = self.bytes_mut(dst)?;
        let n = from.len().min(to.len());
        to[..n].copy_from_slice(&from[..n]);
        let labels = match src.region {
            Region::Image => self.image_map.labels_in(src.start, src.len),
            Region::Arena(space) => {
                lock(&self.maps[space_index(space)]).labels_in(src.start, src.len)
            }
        };
        if let Region::Arena(space) = dst.region {
            let mut map = lock(&self.maps[space_index(space)]);
            map.clear(dst.start, dst.start + dst.len);
            for (offset, len, tag, tag_offset) in labels {
                map.insert(dst.start + offset, len, tag, tag_offset);
            }
        }
        let crosses_link = matches!(engine, Engine::GpuCopyIn | Engine::GpuCopyOut);
        if let (true, Some(gbps)) = (crosses_link, self.options.link_gbps.filter(|g| *g > 0.0)) {
            let target = Duration::from_secs_f64(n as f64 / (gbps * 1e9));
            let spent = started.elapsed();
            if target > spent {
                std::thread::sleep(target - spent);
            }
        }
        Ok(())
    }

    /// Forgets weight labels of bytes an op overwrote with activations.
    pub fn clobber(&self, view: View) {
        if let Region::Arena(space) = view.region {
            lock(&self.maps[space_index(space)]).clear(view.start, view.start + view.len);
        }
    }
}
