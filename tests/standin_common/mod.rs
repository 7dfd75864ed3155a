//! What every test that runs moec under the stand-in CUDA driver (standin/) needs: the
//! library, and a directory of symlinks that puts it first on the loader path under the
//! names cudarc looks for, and a test re-run as a child process under it (the loader path
//! is read at process start, hence the child). Included by tests/cuda_backend.rs,
//! tests/cuda_executor.rs and tests/runtime_invariance.rs.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The names cudarc 0.19 (cuda-12080) tries first for each library.
pub const STANDIN_NAMES: [&str; 6] = [
    "libcuda.so",
    "libcuda.so.1",
    "libcublas.so",
    "libcublas.so.12",
    "libnvrtc.so",
    "libnvrtc.so.12",
];

/// The stand-in cdylib next to this test binary (`cargo test --workspace` builds it).
pub fn standin_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps directory");
    let candidates = [
        deps.join("libmoec_standin.so"),
        deps.join("../libmoec_standin.so"),
    ];
    let library = candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "the stand-in CUDA driver is not built ({} missing): run `cargo test --workspace` \
                 (it builds the moec-standin cdylib the CUDA tests load)",
                candidates[0].display()
            )
        });
    // `cargo test --test cuda_backend` does not rebuild the stand-in: refuse a library older
    // than its sources (or the emulation shim it embeds) instead of testing stale code.
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut sources = vec![root.join("kernels/cpu_emulation/shim.h")];
    if let Ok(dir) = std::fs::read_dir(root.join("standin/src")) {
        sources.extend(dir.filter_map(|e| e.ok()).map(|e| e.path()));
    }
    if let (Some(built), Some(newest)) = (
        modified(&library),
        sources.iter().filter_map(|p| modified(p)).max(),
    ) {
        assert!(
            built >= newest,
            "{} is older than its sources: run `cargo test --workspace` to rebuild it",
            library.display()
        );
    }
    library
}

/// A temporary directory of symlinks to the stand-in under every CUDA library name; put it
/// first on `LD_LIBRARY_PATH` of a child process ([`loader_path`]).
pub fn standin_dir() -> tempfile::TempDir {
    let library = standin_library();
    let dir = tempfile::tempdir().expect("temp dir");
    for link in STANDIN_NAMES {
        std::os::unix::fs::symlink(&library, dir.path().join(link)).expect("symlink");
    }
    dir
}

/// `LD_LIBRARY_PATH` with `dir` first.
pub fn loader_path(dir: &Path) -> String {
    match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", dir.display(), old.to_string_lossy()),
        None => dir.display().to_string(),
    }
}

/// Where the stand-in caches its compiled kernel objects (next to the build, so reruns do
/// not recompile).
pub fn standin_cache() -> PathBuf {
    standin_library()
        .parent()
        .expect("library directory")
        .join("moec-standin-kernels")
}

/// The variable naming the test a child process runs under the stand-in.
pub const STANDIN_CHILD: &str = "MOEC_STANDIN_TEST_CHILD";

/// True in the child process of test `name` ([`standin_child`]).
pub fn in_standin_child(name: &str) -> bool {
    std::env::var(STANDIN_CHILD).as_deref() == Ok(name)
}

/// Runs test `name` of this test binary in a child process whose CUDA libraries are the
/// stand-in (the symlinks first on its LD_LIBRARY_PATH, kernel objects cached next to
/// the build so reruns do not recompile), with `env` set too; gives its output.
pub fn standin_child(name: &str, env: &[(&str, &std::ffi::OsStr)]) -> std::process::Output {
    let dir = standin_dir();
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(STANDIN_CHILD, name)
        .env("LD_LIBRARY_PATH", loader_path(dir.path()))
        .env("MOEC_STANDIN_CACHE", standin_cache())
        .envs(env.iter().copied())
        .output()
        .expect("child test starts")
}
