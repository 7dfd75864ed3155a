//! Arenas: one block of memory per memory space, shared by every stream thread.
//!
//! Takes a size (and for `pinned`, whether to page-lock it); gives an [`Arena`] of zeroed,
//! page-aligned anonymous memory and unchecked byte views into it. The plan's dependency
//! edges are what make concurrent views sound (see [`Arena::bytes_mut`]); this module only
//! checks bounds. Page-locking failure is reported, not fatal (the OS's `RLIMIT_MEMLOCK`
//! usually allows only a few MiB without privileges).

use memmap2::{MmapMut, MmapRaw};

/// Why an arena could not be made or viewed.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// The OS refused the allocation.
    #[error("cannot allocate a {bytes}-byte {space} arena: {source}")]
    Alloc {
        /// Space name.
        space: &'static str,
        /// Bytes asked for.
        bytes: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// A view past the end.
    #[error("{space} arena: bytes {start}..{end} are outside its {len} bytes")]
    OutOfBounds {
        /// Space name.
        space: &'static str,
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
        /// Arena size.
        len: u64,
    },
}

/// A block of memory for one space.
#[derive(Debug)]
pub struct Arena {
    space: &'static str,
    map: Option<MmapRaw>,
    len: usize,
    locked: bool,
}

impl Arena {
    /// A zeroed arena of `bytes`; with `lock`, tries to page-lock it.
    pub fn new(space: &'static str, bytes: u64, lock: bool) -> Result<Self, ArenaError> {
        let len = usize::try_from(bytes).map_err(|_| ArenaError::Alloc {
            space,
            bytes,
            source: std::io::Error::other("size exceeds the address space"),
        })?;
        if len == 0 {
            return Ok(Arena {
                space,
                map: None,
                len: 0,
                locked: false,
            });
        }
        let map = MmapMut::map_anon(len).map_err(|source| ArenaError::Alloc {
            space,
            bytes,
            source,
        })?;
        let map = MmapRaw::from(map);
        let locked = lock && map.lock().is_ok();
        Ok(Arena {
            space,
            map: Some(map),
            len,
            locked,
        })
    }

    /// Whether the arena holds no bytes (a space the plan does not use).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes in the arena.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the pages are locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    fn check(&self, start: u64, len: u64) -> Result<usize, ArenaError> {
        let end = start.saturating_add(len);
        if end > self.len as u64 {
            return Err(ArenaError::OutOfBounds {
                space: self.space,
                start,
                end,
                len: self.len as u64,
            });
        }
        Ok(start as usize)
    }

    /// Shared view of `len` bytes at `start` (bounds are checked).
    ///
    /// # Safety
    ///
    /// No exclusive view of any of these bytes may be alive while the returned slice is:
    /// the caller runs a task whose waits have returned, so every task that writes these
    /// bytes is ordered before or after it (the checker derived a dependency for every
    /// overlapping read/write pair of different tasks, and rejects a task whose written
    /// argument overlaps another of its own arguments).
    pub unsafe fn bytes(&self, start: u64, len: u64) -> Result<&[u8], ArenaError> {
        let start = self.check(start, len)?;
        match &self.map {
            // SAFETY: bounds checked above; the map lives as long as `self`; the caller
            // guarantees no concurrent exclusive view (this fn's contract).
            Some(map) => {
                Ok(unsafe { std::slice::from_raw_parts(map.as_ptr().add(start), len as usize) })
            }
            None => Ok(&[]),
        }
    }

    /// Exclusive view of `len` bytes at `start` (bounds are checked).
    ///
    /// # Safety
    ///
    /// No other view (shared or exclusive) of any of these bytes may be alive while the
    /// returned slice is: the plan orders every other task that reads or writes them
    /// before or after the calling task (the checker's dependencies), and `moec check`
    /// rejects a task whose written argument overlaps any other argument of the same task
    /// (`structure::overlapping_arguments`), so one task never holds two views of a byte
    /// it writes.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, start: u64, len: u64) -> Result<&mut [u8], ArenaError> {
        let start = self.check(start, len)?;
        match &self.map {
            // SAFETY: bounds checked; the mapping is writable anonymous memory owned by
            // `self`; exclusivity of these bytes is the caller's obligation (contract above).
            Some(map) => Ok(unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(start), len as usize)
            }),
            None => Ok(&mut []),
        }
    }
}
