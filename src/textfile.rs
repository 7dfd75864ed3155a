//! Reading a text file that moec parses whole (schedules, model cards, config.json,
//! hardware profiles, prompt files) with a size cap.
//!
//! Takes a path and the most bytes the file may have; gives its text, or an I/O error of
//! kind `InvalidData` saying the file is larger than the cap. Guarantees that at most
//! `limit + 1` bytes are read, so `/dev/zero` or a mistyped multi-gigabyte path is refused
//! at once instead of filling memory.

use std::io::Read as _;
use std::path::Path;

/// Schedules, model cards and hardware profiles: far above any real one.
pub const SOURCE_LIMIT: u64 = 16 << 20;

/// `config.json` and `model.safetensors.index.json`.
pub const CONFIG_LIMIT: u64 = 64 << 20;

/// Prompt files (JSON lines).
pub const PROMPTS_LIMIT: u64 = 1 << 30;

/// The text of `path`, refused when it has more than `limit` bytes.
pub fn read_capped(path: &Path, limit: u64) -> std::io::Result<String> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes, the most moec reads from such a file"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endless_and_oversized_inputs_are_refused_after_the_cap() {
        let err = read_capped(Path::new("/dev/zero"), 1024).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("larger than 1024 bytes"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("s.sched");
        std::fs::write(&f, "abc").unwrap();
        assert_eq!(read_capped(&f, 3).unwrap(), "abc");
        assert!(read_capped(&f, 2).is_err());
    }
}
