//! `moec probe`'s disk figures: direct-read bandwidth and latency of the drive holding a
//! folder, at the read sizes disk schedules use.
//!
//! Takes a folder and a size; writes a file of that size there (a temporary, removed
//! after, and on SIGINT/SIGTERM), flushed to the drive, and reads it back with `O_DIRECT`
//! (no page cache, so the drive and not DRAM is measured): sequentially with one read of
//! [`CHUNK`] bytes in flight, through [`DiskReader`] (the runtime's reads: [`READERS`]
//! in flight), in 64 KiB pages from [`READERS`] threads, and 4 KiB reads one at a time at
//! spread offsets (latency). Gives a [`DiskSpec`] for the profile (the figures the HRM
//! charges, `docs/cost-model.md`) and the figures themselves for the report. Where the
//! filesystem refuses `O_DIRECT` (tmpfs) the probe fails and says so rather than timing the
//! page cache.

use crate::cost::hardware::{DiskSpec, GB};
use crate::runtime::host::disk::{open_direct, DiskReader, Staging, ALIGN, CHUNK, READERS};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

/// Size of a page read (the small-read figure).
pub const PAGE: usize = 64 << 10;

/// What the disk probe measured, bytes per second and seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskFigures {
    /// Bytes of the file read in each pass.
    pub file_bytes: u64,
    /// One [`CHUNK`]-byte read in flight at a time.
    pub sequential: f64,
    /// [`READERS`] readers of [`CHUNK`]-byte pieces (the runtime's reader).
    pub parallel: f64,
    /// [`READERS`] threads reading [`PAGE`]-byte pages at spread offsets.
    pub pages: f64,
    /// Mean time of one 4 KiB read with nothing else in flight, seconds.
    pub latency: f64,
}

/// Measures the drive holding `dir` with a temporary file of `bytes` (rounded up to
/// [`CHUNK`]s); the file is removed whatever happens.
pub fn measure(dir: &Path, bytes: u64) -> Result<(DiskFigures, DiskSpec), String> {
    let chunks = bytes.div_ceil(CHUNK as u64).max(2) as usize;
    let target = dir.join("moec-disk-probe");
    let path = crate::tempfiles::temp_beside(&target, "probe");
    let _guard = crate::tempfiles::register(&path);
    let result = measure_file(&path, chunks);
    let _ = std::fs::remove_file(&path);
    result
}

fn measure_file(path: &Path, chunks: usize) -> Result<(DiskFigures, DiskSpec), String> {
    let io = |what: &str, e: std::io::Error| format!("disk probe: {what} {}: {e}", path.display());
    {
        let mut file = std::fs::File::create(path).map_err(|e| io("cannot create", e))?;
        // Bytes that do not compress or repeat, so no layer below can shortcut the reads.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut block = vec![0u8; CHUNK];
        for _ in 0..chunks {
            for word in block.chunks_mut(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                word.copy_from_slice(&state.to_le_bytes()[..word.len()]);
            }
            file.write_all(&block).map_err(|e| io("cannot write", e))?;
        }
        file.sync_all().map_err(|e| io("cannot flush", e))?;
    }
    let direct = open_direct(path).map_err(|e| {
        format!(
            "disk probe: the filesystem of {} refuses direct reads ({e}); probe a folder on the checkpoint's drive (--disk-dir)",
            path.display()
        )
    })?;
    let file_bytes = (chunks * CHUNK) as u64;
    let mut staging =
        Staging::new(CHUNK).ok_or_else(|| "disk probe: cannot allocate a buffer".to_string())?;

    // Sequential: one read in flight.
    let started = Instant::now();
    for k in 0..chunks {
        read_exact(&direct, staging.bytes_mut(), (k * CHUNK) as u64).map_err(|e| io("read", e))?;
    }
    let sequential = file_bytes as f64 / started.elapsed().as_secs_f64();

    // Parallel: the runtime's reader over the whole file.
    // Pieces of 16 chunks (64 MiB), each split over the readers as a copy would be.
    let reader = DiskReader::new();
    let piece = 16 * CHUNK;
    let mut buffer = vec![0u8; piece.min(chunks * CHUNK)];
    let started = Instant::now();
    let mut at = 0usize;
    while at < chunks * CHUNK {
        let len = piece.min(chunks * CHUNK - at);
        reader
            .read(path, at as u64, &mut buffer[..len])
            .map_err(|e| format!("disk probe: {e}"))?;
        at += len;
    }
    let parallel = file_bytes as f64 / started.elapsed().as_secs_f64();
    drop(buffer);

    // Pages: READERS threads, each reading PAGE-byte pages at offsets spread by a stride
    // prime to the file's page count, so no two reads are adjacent.
    let page_count = file_bytes as usize / PAGE;
    let per_thread = page_count / READERS;
    let started = Instant::now();
    let results: Vec<Result<(), std::io::Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..READERS)
            .map(|t| {
                let direct = &direct;
                scope.spawn(move || {
                    let mut buffer = Staging::new(PAGE).ok_or_else(|| {
                        std::io::Error::new(std::io::ErrorKind::OutOfMemory, "page buffer")
                    })?;
                    for k in 0..per_thread {
                        let page = (t * per_thread + k) * 7919 % page_count;
                        read_exact(direct, buffer.bytes_mut(), (page * PAGE) as u64)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a reader thread panicked")))
            })
            .collect()
    });
    for result in results {
        result.map_err(|e| io("read", e))?;
    }
    let pages = (per_thread * READERS * PAGE) as f64 / started.elapsed().as_secs_f64();

    // Latency: 4 KiB reads one at a time.
    let reads = 256usize;
    let blocks = file_bytes as usize / ALIGN;
    let started = Instant::now();
    for k in 0..reads {
        let block = (k * 104_729) % blocks;
        read_exact(
            &direct,
            &mut staging.bytes_mut()[..ALIGN],
            (block * ALIGN) as u64,
        )
        .map_err(|e| io("read", e))?;
    }
    let latency = started.elapsed().as_secs_f64() / reads as f64;

    let figures = DiskFigures {
        file_bytes,
        sequential,
        parallel,
        pages,
        latency,
    };
    let spec = DiskSpec {
        model: format!(
            "measured by `moec probe` with direct reads of a {} MiB file",
            file_bytes >> 20
        ),
        read_gb_s: parallel / GB,
        small_read_gb_s: pages / GB,
        latency_us: latency * 1e6,
        sequential_read_gb_s: Some(sequential / GB),
    };
    Ok((figures, spec))
}

fn read_exact(file: &std::fs::File, buffer: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut got = 0;
    while got < buffer.len() {
        match file.read_at(&mut buffer[got..], offset + got as u64) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
