//! Host memory, shared by every backend: the arenas of the host spaces, the weights image
//! over the checkpoint's memory maps, the labels that say which weight a range of bytes
//! holds, and copies between them.
//!
//! Takes a plan, a checkpoint and the backend options; gives a [`HostMemory`]. The CPU
//! backend computes on all of it (its `gpu` arena is host memory too); a device backend
//! takes [`HostMemory::host_side`] (no `gpu` arena: that space is on the device),
//! registers its `pinned` arena with its driver and copies between it and the device.
//! Neither backend owns what the other needs: both hold the same `HostMemory`.

pub mod arena;
mod byte_runs;
pub mod copy_pool;
pub mod disk;
mod format_copy;
pub mod image;
pub mod memory;
pub mod weights;

pub use memory::{HostMemory, MemoryError, Region, View};
pub use weights::WeightTag;
