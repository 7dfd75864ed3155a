//! Where the GGUF fixtures of `scripts/gguf_fixtures.sh` are: `$MOEC_GGUF_FIXTURES`, else
//! `~/.cache/moec-peer/gguf-fixtures` (tiny Mixtral), and `$MOEC_GGUF_FAMILY_FIXTURES`,
//! else `~/.cache/moec-peer/gguf-fixtures-families` (Qwen3-MoE, DeepSeek-V2, Qwen2-MoE,
//! OLMoE). Tests that need them say why they skip without.

use std::path::PathBuf;

/// The fixture folder, when it holds the Q4_K_M tiny Mixtral.
pub fn fixtures() -> Option<PathBuf> {
    folder(
        "MOEC_GGUF_FIXTURES",
        "gguf-fixtures",
        "mixtral-q4-Q4_K_M.gguf",
    )
}

/// The family fixture folder, when it holds the Q4_K_M tiny DeepSeek-V2.
// Not every test binary that includes this module runs the family fixtures.
#[allow(dead_code)]
pub fn family_fixtures() -> Option<PathBuf> {
    folder(
        "MOEC_GGUF_FAMILY_FIXTURES",
        "gguf-fixtures-families",
        "deepseek-v2-q4-Q4_K_M.gguf",
    )
}

/// `$var`, else `~/.cache/moec-peer/{default}`, when it holds `probe`.
fn folder(var: &str, default: &str, probe: &str) -> Option<PathBuf> {
    let dir = std::env::var_os(var).map(PathBuf::from).or_else(|| {
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/moec-peer").join(default))
    })?;
    dir.join(probe).is_file().then_some(dir)
}
