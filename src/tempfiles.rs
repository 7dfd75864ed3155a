//! Temporary files and folders that moec writes beside an output before renaming it into
//! place (`synth`'s checkpoint folders, the implicit cache fill, `--trace`, `--out`).
//!
//! Takes the paths as writers create them; gives unique hidden names beside a target, a
//! registry of the paths being written, a clean-up on SIGINT/SIGTERM and a sweep of the
//! temporaries that dead processes left. Guarantees: a temporary name is
//! `.NAME.TAG-PID-NANOS-SEQ` in the target's folder (hidden, and unique per process, moment
//! and call, so it never collides with a user's file or a concurrent writer's); once
//! [`install_interrupt_cleanup`] ran, a SIGINT or SIGTERM removes every registered path
//! before the process dies of that signal; a temporary of a process that is gone (killed
//! with SIGKILL, or by a power cut) is removed by the next writer into the same folder,
//! with one line on stderr saying so. A leaf module: it imports nothing from the crate.
//!
//! `MOEC_HOLD_TEMP=1` is a test hook: a writer that registers a temporary then prints
//! `moec: holding temporary PATH` and waits for a signal, so a test can interrupt it at a
//! known point instead of racing a timer.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The paths being written, each with the id of the guard that registered it.
static REGISTRY: Mutex<Vec<(u64, PathBuf)>> = Mutex::new(Vec::new());
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A registered temporary path: removed by the interrupt handler while the guard lives.
/// Dropping it only unregisters the path: the writer has renamed or removed it by then.
#[derive(Debug)]
pub struct TempGuard {
    id: u64,
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Ok(mut paths) = REGISTRY.lock() {
            paths.retain(|(id, _)| *id != self.id);
        }
    }
}

/// Registers `path` (a file or a folder that now exists) for removal on interrupt.
pub fn register(path: &Path) -> TempGuard {
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Ok(mut paths) = REGISTRY.lock() {
        paths.push((id, path.to_path_buf()));
    }
    if std::env::var_os("MOEC_HOLD_TEMP").is_some_and(|v| v == "1") {
        eprintln!("moec: holding temporary {}", path.display());
        loop {
            std::thread::park();
        }
    }
    TempGuard { id }
}

/// `.NAME.TAG-PID-NANOS-SEQ` beside `target` (NAME its file name, or `output`).
pub fn temp_beside(target: &Path, tag: &str) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seq = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    target.with_file_name(format!(
        ".{name}.{tag}-{}-{nanos}-{seq}",
        std::process::id()
    ))
}

/// Removes the temporaries of `target` with `tag` (see [`temp_beside`]) whose writing
/// process is gone, saying so on stderr as `what` (e.g. "a partial checkpoint"); those of
/// live processes (a concurrent writer) are left alone.
pub fn remove_stale(target: &Path, tag: &str, what: &str) {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let prefix = format!(".{name}.{tag}-");
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file_name.strip_prefix(&prefix) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if alive {
            continue;
        }
        let path = entry.path();
        let removed = if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if removed.is_ok() {
            eprintln!(
                "moec: removed {}, {what} left by process {pid}, which is gone",
                path.display()
            );
        }
    }
}

/// Removes every registered path, saying which on stderr.
fn remove_registered() {
    let paths: Vec<PathBuf> = match REGISTRY.lock() {
        Ok(paths) => paths.iter().map(|(_, p)| p.clone()).collect(),
        Err(poisoned) => poisoned.get_ref().iter().map(|(_, p)| p.clone()).collect(),
    };
    for path in paths {
        // A writer thread may still add a file to a folder between the listing and the
        // removal (ENOTEMPTY): try again a few times.
        let mut removed = false;
        for _ in 0..5 {
            let result = if path.is_dir() && !path.is_symlink() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match result {
                Ok(()) => {
                    removed = true;
                    break;
                }
                // Renamed into place (or removed) by its writer a moment ago: nothing left.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(_) => {}
            }
        }
        if removed {
            eprintln!("moec: interrupted; removed {}", path.display());
        }
    }
}

/// What the first SIGINT/SIGTERM calls instead of ending the process, if set.
type InterruptHandler = Box<dyn FnOnce(libc::c_int) + Send>;
static ON_INTERRUPT: Mutex<Option<InterruptHandler>> = Mutex::new(None);

/// Makes the first SIGINT or SIGTERM call `handler` (after the temporaries are removed)
/// instead of ending the process; a second one ends it as usual. For a process that
/// shuts down by itself (`moec serve` drains its requests and exits 0). Only with
/// [`install_interrupt_cleanup`], which owns the signals: without it nothing calls this.
pub fn on_first_interrupt(handler: impl FnOnce(libc::c_int) + Send + 'static) {
    let mut slot = match ON_INTERRUPT.lock() {
        Ok(h) => h,
        Err(poisoned) => poisoned.into_inner(),
    };
    *slot = Some(Box::new(handler));
}

/// Blocks SIGINT and SIGTERM in this thread (and so in every thread spawned after it) and
/// starts a thread that waits for them, removes the registered temporaries and lets the
/// signal end the process as it would have (exit status 130 or 143 in a shell).
///
/// Must be called first thing in `main`, before any other thread exists: a thread spawned
/// earlier would keep the default action and die mid-write without the clean-up. moec
/// spawns no child processes, which would inherit the blocked mask.
pub fn install_interrupt_cleanup() {
    // SAFETY: `sigset_t` is plain data that `sigemptyset` initialises; the calls only read
    // and write the local set, and `pthread_sigmask` changes this thread's mask alone.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return;
        }
        set
    };
    let spawned = std::thread::Builder::new()
        .name("moec-signals".into())
        .spawn(move || {
            let mut signal: libc::c_int = 0;
            // SAFETY: `set` is an initialised signal set owned by this closure and `signal`
            // a valid out-pointer; `sigwait` only reads the one and writes the other.
            if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                return;
            }
            remove_registered();
            // A process that shuts down by itself (`moec serve`) is told once; a second
            // signal ends it as usual.
            let handler = match ON_INTERRUPT.lock() {
                Ok(mut h) => h.take(),
                Err(poisoned) => poisoned.into_inner().take(),
            };
            if let Some(handler) = handler {
                handler(signal);
                // SAFETY: as above.
                if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                    return;
                }
                remove_registered();
            }
            // SAFETY: restoring the default action and unblocking the one signal in this
            // thread, then sending it to our own process: the process dies of it, as it
            // would have without this handler (the caller's shell sees 128 + signal).
            unsafe {
                libc::signal(signal, libc::SIG_DFL);
                let mut one: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut one);
                libc::sigaddset(&mut one, signal);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
                libc::kill(libc::getpid(), signal);
            }
            // The signal is delivered on return from `kill`; never reached in practice.
            std::process::exit(128 + signal);
        });
    if spawned.is_err() {
        // No watcher thread: restore the default actions rather than ignore the signals.
        // SAFETY: as above, this thread's mask only.
        unsafe {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_temporaries_of_dead_processes_go_and_live_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ckpt");
        // No process has pid 4,000,000,000 (Linux caps pids at 2^22).
        let dead = dir.path().join(".ckpt.tmp-4000000000-1");
        let live = dir
            .path()
            .join(format!(".ckpt.tmp-{}-2", std::process::id()));
        let other_tag = dir.path().join(".ckpt.moec-4000000000-1");
        let user = dir.path().join("ckpt.tmp-4000000000-1");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join("model.safetensors"), b"partial").unwrap();
        std::fs::create_dir(&live).unwrap();
        std::fs::write(&other_tag, b"x").unwrap();
        std::fs::write(&user, b"mine").unwrap();
        remove_stale(&target, "tmp", "a partial checkpoint");
        assert!(!dead.exists());
        assert!(live.exists() && other_tag.exists() && user.exists());
    }

    #[test]
    fn temporary_names_are_hidden_beside_the_target_and_unique() {
        let a = temp_beside(Path::new("out/trace.json"), "moec");
        let b = temp_beside(Path::new("out/trace.json"), "moec");
        assert_eq!(a.parent(), Some(Path::new("out")));
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        let prefix = format!(".trace.json.moec-{}-", std::process::id());
        assert!(name.starts_with(&prefix), "{name}");
        assert_ne!(a, b);
    }
}
