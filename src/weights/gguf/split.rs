//! Split GGUF files, as `llama-gguf-split --split` writes them: `NAME-00001-of-0000N.gguf`
//! holds all metadata plus `split.no` (0), `split.count` (N) and `split.tensors.count`;
//! parts 2..N hold `split.*` and their own tensors, each part a complete GGUF file whose
//! tensor offsets are relative to its own data section.
//!
//! Takes the first part's path and metadata; gives the other parts' paths (llama.cpp's
//! own naming, `llama_split_path`: `%s-%05d-of-%05d.gguf`), and checks each part and the
//! total tensor count. A part that is missing, numbered otherwise, or from another split,
//! and a later part passed as the model, are each an error naming the file.

use super::{GgufError, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn split_err(path: &Path, part: u64, count: u64, message: String) -> GgufError {
    GgufError::Split {
        path: path.display().to_string(),
        part,
        count,
        message,
    }
}

fn meta_u64(meta: &BTreeMap<String, Value>, key: &str) -> Option<u64> {
    meta.get(key).and_then(Value::as_u64)
}

/// How many parts the model is in (1 without `split.count`); refuses a later part given
/// as the model.
pub fn count(path: &Path, meta: &BTreeMap<String, Value>) -> Result<u64, GgufError> {
    let count = meta_u64(meta, "split.count").unwrap_or(1).max(1);
    match meta_u64(meta, "split.no") {
        Some(no) if no != 0 && count > 1 => Err(split_err(
            path,
            no + 1,
            count,
            "this is not the first part: pass the `-00001-of-...` file (the metadata is there)"
                .into(),
        )),
        _ => Ok(count),
    }
}

/// The paths of all `count` parts, the first being `first` itself.
pub fn sibling_paths(first: &Path, count: u64) -> Result<Vec<PathBuf>, GgufError> {
    if count <= 1 {
        return Ok(vec![first.to_path_buf()]);
    }
    let name = first
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let suffix = format!("-00001-of-{count:05}.gguf");
    let Some(prefix) = name.strip_suffix(&suffix) else {
        return Err(split_err(
            first,
            1,
            count,
            format!(
                "its metadata says it is part 1 of {count}, but its name does not end in \
                 `{suffix}`, so the other parts cannot be found"
            ),
        ));
    };
    let dir = first.parent().unwrap_or(Path::new(""));
    Ok((1..=count)
        .map(|i| dir.join(format!("{prefix}-{i:05}-of-{count:05}.gguf")))
        .collect())
}

/// `err` opening part `index` (from 0), said as a missing part when the file is not there.
pub fn missing(err: GgufError, path: &Path, index: usize, count: u64) -> GgufError {
    match err {
        GgufError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => split_err(
            path,
            index as u64 + 1,
            count,
            "missing (every part must be in the first part's folder)".into(),
        ),
        other => other,
    }
}

/// Part `index` (from 0) says it is that part of a split of `count`.
pub fn check_part(
    path: &Path,
    meta: &BTreeMap<String, Value>,
    index: usize,
    count: u64,
) -> Result<(), GgufError> {
    let (no, its_count) = (meta_u64(meta, "split.no"), meta_u64(meta, "split.count"));
    if no != Some(index as u64) || its_count != Some(count) {
        return Err(split_err(
            path,
            index as u64 + 1,
            count,
            format!(
                "its metadata says part {} of {} (split.no {no:?}, split.count {its_count:?})",
                no.map_or("?".into(), |n| (n + 1).to_string()),
                its_count.map_or("?".into(), |c| c.to_string()),
            ),
        ));
    }
    Ok(())
}

/// All parts together hold the `split.tensors.count` the first part promises.
pub fn check_total(
    first: &Path,
    meta: &BTreeMap<String, Value>,
    found: usize,
) -> Result<(), GgufError> {
    match meta_u64(meta, "split.tensors.count") {
        Some(want) if want != found as u64 => Err(GgufError::Metadata {
            path: first.display().to_string(),
            key: "split.tensors.count".into(),
            message: format!("promises {want} tensors, the parts hold {found}"),
        }),
        _ => Ok(()),
    }
}
