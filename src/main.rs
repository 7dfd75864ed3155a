//! The `moec` command-line tool.

fn main() -> std::process::ExitCode {
    moec::cli::main()
}
