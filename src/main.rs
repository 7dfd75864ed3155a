//! The `moec` command-line tool.

fn main() -> std::process::ExitCode {
    // Rust ignores SIGPIPE, so `moec compile X | head -1` would panic on the closed pipe.
    // A command-line tool should end quietly there, as every Unix tool does: restore the
    // default action.
    // SAFETY: called first thing in `main`, before any thread exists or any output is
    // written; `signal` with `SIG_DFL` installs no handler of ours.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Before any thread exists (see its doc): SIGINT/SIGTERM remove the temporary files and
    // folders being written, then end the process as the signal would have.
    moec::tempfiles::install_interrupt_cleanup();
    moec::cli::main()
}
