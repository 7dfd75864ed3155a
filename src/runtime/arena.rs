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

    /// Bytes in the arena.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty arena.
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// Shared view of `len` bytes at `start`.
    ///
    /// The caller must hold the plan's ordering: no task that writes these bytes runs
    /// concurrently (true for any task's arguments once its waits have returned, because
    /// the checker derived a dependency for every overlapping read/write pair).
    pub fn bytes(&self, start: u64, len: u64) -> Result<&[u8], ArenaError> {
        let start = self.check(start, len)?;
        match &self.map {
            // SAFETY: bounds checked above; the map lives as long as `self`; the plan's
            // dependency edges exclude concurrent writers of these bytes (see above).
            Some(map) => {
                Ok(unsafe { std::slice::from_raw_parts(map.as_ptr().add(start), len as usize) })
            }
            None => Ok(&[]),
        }
    }

    /// Exclusive view of `len` bytes at `start`.
    ///
    /// Same contract as [`Arena::bytes`], and no other view of these bytes may be alive:
    /// the plan orders every task that reads or writes them before or after this one, and
    /// a task never passes overlapping slices as two arguments that it writes.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self, start: u64, len: u64) -> Result<&mut [u8], ArenaError> {
        let start = self.check(start, len)?;
        match &self.map {
            // SAFETY: bounds checked; the mapping is writable anonymous memory owned by
            // `self`; exclusivity of these bytes is the plan's guarantee stated above.
            Some(map) => Ok(unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(start), len as usize)
            }),
            None => Ok(&mut []),
        }
    }
}
