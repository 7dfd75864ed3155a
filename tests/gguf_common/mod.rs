//! Where the GGUF fixtures of `scripts/gguf_fixtures.sh` are: `$MOEC_GGUF_FIXTURES`, else
//! `~/.cache/moec-peer/gguf-fixtures`. Tests that need them say why they skip without.

use std::path::PathBuf;

/// The fixture folder, when it holds the Q4_K_M tiny Mixtral.
pub fn fixtures() -> Option<PathBuf> {
    let dir = std::env::var_os("MOEC_GGUF_FIXTURES")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/moec-peer/gguf-fixtures"))
        })?;
    dir.join("mixtral-q4-Q4_K_M.gguf").is_file().then_some(dir)
}
