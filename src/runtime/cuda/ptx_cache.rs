//! The on-disk PTX cache: every kernel file compiled once per (source, architecture, NVRTC
//! version, device), shared by `moec devices`, `moec run --backend cuda` and every process
//! that runs at the same time.
//!
//! Takes the kernel files, the architecture, NVRTC's version and the device's name; gives
//! each file's PTX in [`KERNELS`] order and how many were compiled now or read from
//! `<cache>/cuda-kernels/`. Files are compiled on all cores (NVRTC compiles separate
//! programs concurrently; the four largest files take most of a minute each on one core),
//! and a file is compiled under an exclusive lock on its cache entry, so processes that
//! start together (the test suite runs several) compile each file once between them and
//! never read a half-written file.

use super::kernels::{compile_kernel, KernelSource, KERNELS};
use super::CudaError;
use cudarc::nvrtc::Ptx;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where the PTX of each kernel file came from in this process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PtxSources {
    /// Files compiled by NVRTC now (and written to the cache).
    pub compiled: usize,
    /// Files read from the on-disk cache.
    pub cached: usize,
}

/// What is asked of the cache: the compile's target and the key parts besides the source.
#[derive(Debug, Clone, Copy)]
pub struct PtxKey<'a> {
    /// `sm_XY`.
    pub arch: &'static str,
    /// NVRTC's version, when it loads (PTX of another NVRTC is never reused).
    pub nvrtc: Option<(i32, i32)>,
    /// The device's name, so PTX made by the test stand-in (whose "PTX" names a host object)
    /// is never loaded on a real device, nor the reverse.
    pub device: &'a str,
    /// Whether NVRTC loads: a file missing from the cache is then compiled, otherwise it is
    /// [`CudaError::NvrtcMissing`].
    pub nvrtc_loads: bool,
}

/// The cache folder of moec's PTX (`<cache>/cuda-kernels`), if moec has a cache folder.
pub fn default_dir() -> Option<PathBuf> {
    crate::weights::source::cache_dir()
        .ok()
        .map(|dir| dir.join("cuda-kernels"))
}

/// Every kernel file's PTX for `key`, in [`KERNELS`] order, from the cache in `dir` where
/// it holds the file and compiled (and written there) otherwise; `dir: None` compiles all.
/// Fails with the first file (in [`KERNELS`] order) that does not compile.
pub fn load_or_compile_all(
    dir: Option<&Path>,
    key: PtxKey<'_>,
) -> Result<(Vec<Ptx>, PtxSources), CudaError> {
    // Largest first, so the last file a worker takes is a short one.
    let mut order: Vec<usize> = (0..KERNELS.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(KERNELS[i].source.len()));
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(KERNELS.len());
    let mut results: Vec<Option<Result<(Ptx, bool), CudaError>>> =
        (0..KERNELS.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let path = dir.map(|d| entry_path(d, &KERNELS[i], key));
                        done.push((i, load_or_compile(path.as_deref(), &KERNELS[i], key)));
                    }
                    done
                })
            })
            .collect();
        for handle in handles {
            // A worker only panics if NVRTC's binding does; pass that on as it is.
            let done = handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (i, result) in done {
                results[i] = Some(result);
            }
        }
    });
    let mut sources = PtxSources::default();
    let mut ptx = Vec::with_capacity(KERNELS.len());
    for result in results {
        // Every index was taken by exactly one worker.
        let (p, cached) = result.ok_or(CudaError::NvrtcMissing)??;
        if cached {
            sources.cached += 1;
        } else {
            sources.compiled += 1;
        }
        ptx.push(p);
    }
    Ok((ptx, sources))
}

/// The cache file of one kernel file's PTX. The key covers what NVRTC compiles (the prelude
/// and included headers with the file, so a change to any of them misses the cache), the
/// architecture, the NVRTC version and the device's name.
fn entry_path(dir: &Path, kernel: &KernelSource, key: PtxKey<'_>) -> PathBuf {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (
        super::kernels::full_source(kernel),
        key.arch,
        key.nvrtc,
        key.device,
    )
        .hash(&mut hasher);
    dir.join(format!(
        "{}-{}-{:016x}.ptx",
        kernel.file.trim_end_matches(".cu"),
        key.arch,
        hasher.finish()
    ))
}

/// A cache file holds PTX only if it names a target or an entry (a file cut short by a
/// crash before the rename cannot exist, but an empty or foreign file can).
fn read_cached(path: &Path) -> Option<Ptx> {
    std::fs::read_to_string(path)
        .ok()
        .filter(|text| text.contains(".entry") || text.contains(".target"))
        .map(Ptx::from_src)
}

/// One file's PTX and whether it came from the cache. With a cache entry, the compile runs
/// under an exclusive lock on `<entry>.lock`: a process that finds the lock held waits, then
/// reads what the holder wrote instead of compiling the same file again. A cache that
/// cannot be read, locked or written only costs a compile.
fn load_or_compile(
    path: Option<&Path>,
    kernel: &KernelSource,
    key: PtxKey<'_>,
) -> Result<(Ptx, bool), CudaError> {
    if let Some(ptx) = path.and_then(read_cached) {
        return Ok((ptx, true));
    }
    let lock = path.and_then(|p| {
        std::fs::create_dir_all(p.parent()?).ok()?;
        let file = std::fs::File::create(p.with_extension("ptx.lock")).ok()?;
        file.lock().ok()?;
        Some(file)
    });
    if lock.is_some() {
        if let Some(ptx) = path.and_then(read_cached) {
            return Ok((ptx, true));
        }
    }
    if !key.nvrtc_loads {
        return Err(CudaError::NvrtcMissing);
    }
    let ptx = compile_kernel(kernel, key.arch)?;
    if let Some(p) = path {
        let _ = write_whole(p, &ptx.to_src());
    }
    // The lock is released when `lock` drops, after the file is in place.
    drop(lock);
    Ok((ptx, false))
}

/// Writes a cache file through a temporary file of this process renamed into place:
/// processes sharing the cache then read either no file or the whole PTX, never the prefix
/// a plain write shows while it is under way.
fn write_whole(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension(format!(
        "ptx.{}.{:?}.tmp",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_entry_is_read_and_a_foreign_file_is_not() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let key = PtxKey {
            arch: "sm_80",
            nvrtc: Some((12, 9)),
            device: "",
            nvrtc_loads: false,
        };
        let kernel = &KERNELS[0];
        let path = entry_path(dir.path(), kernel, key);
        // Without NVRTC and without an entry: NVRTC is missing.
        assert_eq!(
            load_or_compile(Some(&path), kernel, key).err(),
            Some(CudaError::NvrtcMissing)
        );
        std::fs::write(&path, "not ptx").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            load_or_compile(Some(&path), kernel, key).err(),
            Some(CudaError::NvrtcMissing)
        );
        write_whole(&path, ".version 8.0\n.target sm_80\n").unwrap_or_else(|e| panic!("{e}"));
        let (ptx, cached) =
            load_or_compile(Some(&path), kernel, key).unwrap_or_else(|e| panic!("{e}"));
        assert!(cached);
        assert!(ptx.to_src().contains(".target sm_80"));
        // Another device or NVRTC is another entry.
        for other in [
            PtxKey {
                device: "NVIDIA H200",
                ..key
            },
            PtxKey {
                nvrtc: Some((13, 0)),
                ..key
            },
            PtxKey {
                arch: "sm_90",
                ..key
            },
        ] {
            assert_ne!(entry_path(dir.path(), kernel, other), path);
        }
    }
}
