//! Writing a command's output files (`--trace`, `--out`, `--dump-logits`, profiles) without
//! harming what is already there.
//!
//! Takes a path and the text; gives the file written whole, or one line saying why not.
//! Guarantees: a regular file (or a new one) is replaced atomically: the text goes to a
//! temporary file beside it, created exclusively under a name no user file can have
//! (`.NAME.moec-PID-NANOS-SEQ`, see [`crate::tempfiles`]), then renamed over it; the
//! temporary file is removed on failure and on SIGINT/SIGTERM, and one a killed process
//! left is removed by the next write of the same output; a symbolic link is refused (moec never replaces a link or writes through one
//! silently: name its target instead); a special file (`/dev/null`, a FIFO) is written
//! through, never replaced; a directory is refused.

use crate::tempfiles;
use std::io::Write as _;
use std::path::Path;

/// Writes `text` to `path` as the module doc says; the error names the path.
pub fn write_output(path: &Path, text: &str) -> Result<(), String> {
    let fail = |what: &str| format!("cannot write {}: {what}", path.display());
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => return Err(fail(
            "it is a symbolic link (moec does not replace or write through links; give its target)",
        )),
        Ok(meta) if meta.is_dir() => return Err(fail("it is a directory")),
        Ok(meta) if !meta.is_file() => {
            // A device or FIFO: write through it; renaming over it would replace the node.
            return std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|e| fail(&e.to_string()));
        }
        _ => {}
    }
    tempfiles::remove_stale(path, "moec", "a partial output");
    let tmp = tempfiles::temp_beside(path, "moec");
    let mut _guard = None;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            _guard = Some(tempfiles::register(&tmp));
            f.write_all(text.as_bytes())?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(&e.to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_regular_files_refuses_links_and_writes_through_devices() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("trace.json");
        std::fs::write(&file, "old").unwrap();
        // A user file with the old fixed temporary name is never touched.
        let old_tmp = dir.path().join("trace.tmp-moec");
        std::fs::write(&old_tmp, "mine").unwrap();
        write_output(&file, "new").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(&old_tmp).unwrap(), "mine");
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let err = write_output(&link, "x").unwrap_err();
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        assert!(write_output(dir.path(), "x")
            .unwrap_err()
            .contains("directory"));
        write_output(Path::new("/dev/null"), "through").unwrap();
        assert!(std::fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device_like());
        // Nothing but the files above is left in the folder.
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["link.json", "trace.json", "trace.tmp-moec"]);
    }

    trait CharDeviceLike {
        fn is_char_device_like(&self) -> bool;
    }

    impl CharDeviceLike for std::fs::FileType {
        fn is_char_device_like(&self) -> bool {
            use std::os::unix::fs::FileTypeExt;
            self.is_char_device()
        }
    }
}
