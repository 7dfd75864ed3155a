//! Reads of the checkpoint from disk, for the `disk.read` copies of a schedule whose `W`
//! lives on disk.
//!
//! Takes the checkpoint's files (opened once per run, with `O_DIRECT` where the filesystem
//! allows it) and, per copy, the file ranges of the image bytes it covers; gives the bytes
//! in the copy's destination and the totals the run report prints (bytes, seconds spent
//! reading, whether the page cache was bypassed). Guarantees: a read that returns fewer
//! bytes than asked (a file truncated while running) or fails is an error naming the file
//! and the offset, never zeros in the destination; nothing is read through the file's
//! memory map, so the page cache does not keep the model (under direct I/O).
//!
//! Direct I/O needs the file offset, the length and the memory address aligned to the
//! device's logical block (4096 covers every NVMe and SATA drive); tensors sit at any
//! offset of a safetensors file and buffers at 64-byte offsets of an arena, so each read
//! goes through a 4096-aligned staging buffer per reader thread and is copied into place:
//! one memcpy per byte read, which the machine's DRAM does several times faster than the
//! disk reads. Several reads are in flight at once: a copy is split over
//! [`READERS`] threads of its own pool (threads that wait for the disk, not the compute
//! cores), each reading [`CHUNK`]-byte pieces in turn. The `io-uring` crate would keep the
//! same number of reads in flight from one thread; it is not a dependency of moec and
//! this machine's sandbox may refuse `io_uring_setup`, so threads it is.

use super::copy_pool::CopyPool;
use std::cell::RefCell;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Alignment of a direct read's offset, length and memory.
pub const ALIGN: usize = 4096;

/// Bytes one reader asks the disk for at a time (several MiB reach an NVMe drive's
/// sequential bandwidth; `dd iflag=direct bs=4M` on the development machine reads 1.8 GB/s).
pub const CHUNK: usize = 4 << 20;

/// Reader threads of one copy: reads in flight at once.
pub const READERS: usize = 4;

/// Why a read from disk failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The file could not be opened.
    #[error("cannot open checkpoint file {path} for reading: {source}")]
    Open {
        /// The file.
        path: String,
        /// The OS's reason.
        source: std::io::Error,
    },
    /// A read failed or came back short.
    #[error("reading {len} bytes at offset {offset} of {path}: {cause}")]
    Read {
        /// The file.
        path: String,
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// What went wrong (the OS's error, or the end of the file).
        cause: String,
    },
}

/// One checkpoint file, opened for direct reads when the filesystem allows it.
#[derive(Debug)]
struct DiskFile {
    path: PathBuf,
    file: File,
    direct: bool,
}

pub use crate::records::run::DiskTotals;

/// The checkpoint's files, opened for the run's disk reads.
#[derive(Debug)]
pub struct DiskReader {
    files: Mutex<Vec<std::sync::Arc<DiskFile>>>,
    pool: CopyPool,
    bytes: AtomicU64,
    nanos: AtomicU64,
    from_memory: AtomicU64,
}

impl Default for DiskReader {
    fn default() -> Self {
        DiskReader {
            files: Mutex::new(Vec::new()),
            pool: CopyPool::new(READERS),
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            from_memory: AtomicU64::new(0),
        }
    }
}

/// A heap buffer aligned for direct reads ([`ALIGN`]).
pub struct Staging {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Staging {
    /// `len` bytes (non-zero) aligned to [`ALIGN`]; `None` when the allocation fails.
    pub fn new(len: usize) -> Option<Staging> {
        let layout = std::alloc::Layout::from_size_align(len, ALIGN).ok()?;
        if len == 0 {
            return None;
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc(layout) };
        (!ptr.is_null()).then_some(Staging { ptr, layout })
    }

    /// The whole buffer.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` was allocated with `layout` and is owned by this value alone;
        // the bytes are initialised or not, which `u8` tolerates for a read target
        // (`read_at` only writes them, and only what it wrote is read back).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

thread_local! {
    /// Each reader thread's staging buffer, made on its first read.
    static STAGING: RefCell<Option<Staging>> = const { RefCell::new(None) };
}

/// Opens `path` for reading with `O_DIRECT` (Linux); an error where the OS or the
/// filesystem refuses it.
#[cfg(target_os = "linux")]
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

/// Opens `path` for reading with `O_DIRECT`: not available off Linux.
#[cfg(not(target_os = "linux"))]
pub fn open_direct(path: &Path) -> std::io::Result<File> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!("no O_DIRECT on this OS: {}", path.display()),
    ))
}

impl DiskReader {
    /// A reader with no file open yet; files open on their first read.
    pub fn new() -> Self {
        Self::default()
    }

    /// The open file at `path`, opening it (direct where possible) on first use.
    fn file(&self, path: &Path) -> Result<std::sync::Arc<DiskFile>, DiskError> {
        let mut files = crate::runtime::sync::lock(&self.files);
        if let Some(file) = files.iter().find(|f| f.path == path) {
            return Ok(file.clone());
        }
        let (file, direct) = match open_direct(path) {
            Ok(file) => (file, true),
            // tmpfs and some network filesystems refuse O_DIRECT: read through the page
            // cache and say so in the report (`DiskTotals::direct`).
            Err(_) => (
                File::open(path).map_err(|source| DiskError::Open {
                    path: path.display().to_string(),
                    source,
                })?,
                false,
            ),
        };
        let file = std::sync::Arc::new(DiskFile {
            path: path.to_path_buf(),
            file,
            direct,
        });
        files.push(file.clone());
        Ok(file)
    }

    /// Reads `dst.len()` bytes at `offset` of the file at `path` into `dst`, split over
    /// the reader threads.
    pub fn read(&self, path: &Path, offset: u64, dst: &mut [u8]) -> Result<(), DiskError> {
        let file = self.file(path)?;
        let started = Instant::now();
        self.pool.fill(dst, 2 * CHUNK, |at, part| {
            for (k, piece) in part.chunks_mut(CHUNK).enumerate() {
                read_piece(&file, offset + (at + k * CHUNK) as u64, piece)?;
            }
            Ok(())
        })?;
        self.bytes.fetch_add(dst.len() as u64, Ordering::Relaxed);
        self.nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Counts bytes a disk copy took from memory (see [`DiskTotals::from_memory`]).
    pub fn note_from_memory(&self, bytes: u64) {
        self.from_memory.fetch_add(bytes, Ordering::Relaxed);
    }

    /// What the run read so far; `direct` is true only if every opened file is direct.
    pub fn totals(&self) -> DiskTotals {
        let files = crate::runtime::sync::lock(&self.files);
        DiskTotals {
            bytes: self.bytes.load(Ordering::Relaxed),
            read_ns: self.nanos.load(Ordering::Relaxed),
            from_memory: self.from_memory.load(Ordering::Relaxed),
            direct: !files.is_empty() && files.iter().all(|f| f.direct),
        }
    }
}

/// Reads `dst.len()` (at most [`CHUNK`]) bytes at `offset` of `file` into `dst`: the
/// aligned range around them into this thread's staging buffer, then the wanted part.
fn read_piece(file: &DiskFile, offset: u64, dst: &mut [u8]) -> Result<(), DiskError> {
    use std::os::unix::fs::FileExt;
    let want = dst.len() as u64;
    let fail = |cause: String| DiskError::Read {
        path: file.path.display().to_string(),
        offset,
        len: want,
        cause,
    };
    let start = offset - offset % ALIGN as u64;
    let head = (offset - start) as usize;
    let span = (head + dst.len()).next_multiple_of(ALIGN);
    STAGING.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            *cell = Staging::new(CHUNK + 2 * ALIGN);
        }
        let Some(staging) = cell.as_mut() else {
            return Err(fail(
                "cannot allocate the aligned staging buffer".to_string(),
            ));
        };
        let buffer = &mut staging.bytes_mut()[..span];
        let mut got = 0;
        // A direct read may return less than asked at the end of the file (the aligned
        // span runs past it) or when interrupted; loop until the wanted bytes are in.
        while got < head + dst.len() {
            match file.file.read_at(&mut buffer[got..], start + got as u64) {
                Ok(0) => {
                    return Err(fail(format!(
                        "the file ends at byte {} (truncated?)",
                        start + got as u64
                    )))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(fail(e.to_string())),
            }
            // A direct read past the end returns a partial block; the next one returns 0.
            if got % ALIGN != 0 && got < head + dst.len() && file.direct {
                return Err(fail(format!(
                    "the file ends at byte {} (truncated?)",
                    start + got as u64
                )));
            }
        }
        dst.copy_from_slice(&buffer[head..head + dst.len()]);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    /// Unaligned offsets and lengths, pieces across chunk boundaries and the file's end:
    /// every byte is the file's.
    #[test]
    fn reads_any_range_exactly() {
        let data: Vec<u8> = (0..(3 * CHUNK + 5000)).map(|i| (i % 251) as u8).collect();
        let (_dir, path) = file_with(&data);
        let reader = DiskReader::new();
        for (offset, len) in [
            (0usize, 10usize),
            (4095, 2),
            (12345, 2 * CHUNK + 777),
            (data.len() - 100, 100),
            (1, data.len() - 1),
        ] {
            let mut dst = vec![0u8; len];
            reader.read(&path, offset as u64, &mut dst).unwrap();
            assert!(dst == data[offset..offset + len], "{offset} +{len}");
        }
        let totals = reader.totals();
        assert_eq!(
            totals.bytes,
            (10 + 2 + 2 * CHUNK + 777 + 100 + data.len() - 1) as u64
        );
    }

    /// A range past the end (a file shrunk after the checkpoint was opened) is an error
    /// naming the file and the offset, not zeros.
    #[test]
    fn a_short_file_is_an_error() {
        let (_dir, path) = file_with(&[7u8; 10_000]);
        let reader = DiskReader::new();
        let mut dst = vec![0u8; 4000];
        let err = reader.read(&path, 8_000, &mut dst).unwrap_err().to_string();
        assert!(
            err.contains("data.bin") && err.contains("offset 8000"),
            "{err}"
        );
        assert!(err.contains("the file ends at byte 10000"), "{err}");
    }
}
