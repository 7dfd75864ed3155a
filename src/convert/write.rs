//! Writing GGUF files (version 3): typed metadata, a tensor table, aligned data.
//!
//! Takes the metadata, every tensor's name, ggml dimensions and type, and a function that
//! gives each tensor's bytes in table order; gives the file, written under a temporary
//! name beside the target and renamed into place only when every byte is written, so an
//! error or an interrupt leaves no half-written `.gguf`. Tensor data are produced one at a
//! time, so a checkpoint larger than memory can be written. Guarantees: the layout is the
//! one [`crate::weights::gguf::GgufFile`] reads back (and llama.cpp's `gguf_init_from_file`): little-endian
//! counts, length-prefixed strings, tensor offsets relative to the data section and
//! aligned to `general.alignment` (32), each tensor's bytes exactly its type's size for its
//! dimensions (checked before writing: a producer that gives another length is an error).

use crate::quant::storage::{Storage, GGML_TYPES};
use std::io::{BufWriter, Write};
use std::path::Path;

/// Tensor data alignment (ggml's default, `general.alignment` is not written).
pub const ALIGNMENT: u64 = 32;

/// ggml's type id of f32 tensors (the vectors every converter writes as f32).
pub const GGML_F32: u32 = GGML_TYPES[0].id;

/// A metadata value to write.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `UINT32`.
    U32(u32),
    /// `FLOAT32`.
    F32(f32),
    /// `BOOL`.
    Bool(bool),
    /// `STRING`.
    Str(String),
    /// An array of `STRING`.
    Strs(Vec<String>),
    /// An array of `FLOAT32`.
    F32s(Vec<f32>),
    /// An array of `INT32`.
    I32s(Vec<i32>),
}

/// One tensor of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its GGUF name.
    pub name: String,
    /// ggml dimensions, innermost (the row) first.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub ggml_type: u32,
}

impl TensorEntry {
    /// Bytes of its data, `None` when a row is not whole blocks or the type is unknown.
    pub fn bytes(&self) -> Option<u64> {
        let row = *self.dims.first()?;
        let rows: u64 = self.dims[1..].iter().product();
        let row_bytes = Storage::from_ggml_type(self.ggml_type)?.bytes_for(row)?;
        Some(row_bytes * rows)
    }
}

/// Problems writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The file system refused.
    #[error("{path}: {source}")]
    Io {
        /// The file being written.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A tensor's data would not be what its table entry says.
    #[error("tensor `{tensor}`: {message}")]
    Tensor {
        /// GGUF tensor name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The producer of a tensor's bytes failed (reading or quantising the source).
    #[error("{0}")]
    Source(String),
}

fn put_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn put_value(w: &mut impl Write, v: &MetaValue) -> std::io::Result<()> {
    // GGUF value type ids: UINT32 4, INT32 5, FLOAT32 6, BOOL 7, STRING 8, ARRAY 9.
    let ty = |w: &mut dyn Write, id: u32| w.write_all(&id.to_le_bytes());
    let array = |w: &mut dyn Write, elem: u32, n: usize| -> std::io::Result<()> {
        w.write_all(&9u32.to_le_bytes())?;
        w.write_all(&elem.to_le_bytes())?;
        w.write_all(&(n as u64).to_le_bytes())
    };
    match v {
        MetaValue::U32(x) => {
            ty(w, 4)?;
            w.write_all(&x.to_le_bytes())
        }
        MetaValue::F32(x) => {
            ty(w, 6)?;
            w.write_all(&x.to_le_bytes())
        }
        MetaValue::Bool(x) => {
            ty(w, 7)?;
            w.write_all(&[u8::from(*x)])
        }
        MetaValue::Str(s) => {
            ty(w, 8)?;
            put_str(w, s)
        }
        MetaValue::Strs(items) => {
            array(w, 8, items.len())?;
            items.iter().try_for_each(|s| put_str(w, s))
        }
        MetaValue::F32s(items) => {
            array(w, 6, items.len())?;
            items.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
        MetaValue::I32s(items) => {
            array(w, 5, items.len())?;
            items.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
        }
    }
}

fn pad(w: &mut impl Write, written: u64) -> std::io::Result<u64> {
    let n = written.next_multiple_of(ALIGNMENT) - written;
    w.write_all(&vec![0u8; n as usize])?;
    Ok(n)
}

/// Counts the bytes written through it (for the padding before the data section).
struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `path`: `metadata` in order, then `tensors`' table, then each tensor's bytes as
/// `produce(i)` gives them. Atomic: the file appears only complete.
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorEntry],
    mut produce: impl FnMut(usize) -> Result<Vec<u8>, WriteError>,
) -> Result<(), WriteError> {
    write_gguf_streamed(path, metadata, tensors, |i, sink| sink(&produce(i)?))
}

/// Where a tensor's bytes go, piece by piece, in [`write_gguf_streamed`].
pub type Sink<'a> = dyn FnMut(&[u8]) -> Result<(), WriteError> + 'a;

/// Bytes written between two hand-overs of the written file's pages to the kernel (see
/// [`PageRelease`]).
const RELEASE_WINDOW: u64 = 256 << 20;

/// Keeps the written file's pages from filling the page cache: every
/// [`RELEASE_WINDOW`] bytes it starts the write-back of the window just written and
/// waits for the one before it, then drops that one's cached pages
/// (`sync_file_range` + `posix_fadvise(DONTNEED)`). A 20 GB GGUF would otherwise leave
/// 20 GB of dirty and then cached pages behind, pushing other processes' memory out on a
/// machine it shares; the kernel's write-back also starts sooner, so the final `fsync`
/// has little left to do. Advice the kernel refuses changes nothing but the cache.
struct PageRelease {
    fd: std::os::fd::RawFd,
    /// Where the data not yet handed over starts.
    done: u64,
    /// The window whose write-back was started last (start, length).
    pending: Option<(u64, u64)>,
}

impl PageRelease {
    /// Hands over whole windows below `written` (every byte below it is in the file).
    fn advance(&mut self, written: u64) {
        while written - self.done >= RELEASE_WINDOW {
            let window = (self.done, RELEASE_WINDOW);
            // SAFETY: plain system calls on an open file descriptor with in-range
            // offsets; they only schedule write-back and drop clean cached pages.
            unsafe {
                libc::sync_file_range(
                    self.fd,
                    window.0 as i64,
                    window.1 as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
                if let Some((start, len)) = self.pending {
                    libc::sync_file_range(
                        self.fd,
                        start as i64,
                        len as i64,
                        libc::SYNC_FILE_RANGE_WAIT_BEFORE
                            | libc::SYNC_FILE_RANGE_WRITE
                            | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                    );
                    libc::posix_fadvise(
                        self.fd,
                        start as i64,
                        len as i64,
                        libc::POSIX_FADV_DONTNEED,
                    );
                }
            }
            self.pending = Some(window);
            self.done += RELEASE_WINDOW;
        }
    }
}

/// As [`write_gguf`], each tensor's bytes given piece by piece: `produce(i, sink)` calls
/// `sink` with consecutive pieces of tensor `i` (any sizes), so a producer holds one piece
/// at a time rather than the whole tensor. The pieces must add up to the entry's size.
pub fn write_gguf_streamed(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorEntry],
    mut produce: impl FnMut(usize, &mut Sink<'_>) -> Result<(), WriteError>,
) -> Result<(), WriteError> {
    use std::os::fd::AsRawFd;
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        sizes.push(t.bytes().ok_or_else(|| WriteError::Tensor {
            tensor: t.name.clone(),
            message: format!(
                "dimensions {:?} are not whole blocks of ggml type {}",
                t.dims, t.ggml_type
            ),
        })?);
    }
    let tmp = crate::tempfiles::temp_beside(path, "gguf");
    let io = |e: std::io::Error| WriteError::Io {
        path: path.display().to_string(),
        source: e,
    };
    let file = std::fs::File::create(&tmp).map_err(io)?;
    let guard = crate::tempfiles::register(&tmp);
    let mut release = PageRelease {
        fd: file.as_raw_fd(),
        done: 0,
        pending: None,
    };
    let result = (|| -> Result<(), WriteError> {
        let mut w = Counting {
            inner: BufWriter::with_capacity(1 << 20, file),
            n: 0,
        };
        w.write_all(b"GGUF").map_err(io)?;
        w.write_all(&3u32.to_le_bytes()).map_err(io)?;
        w.write_all(&(tensors.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&(metadata.len() as u64).to_le_bytes())
            .map_err(io)?;
        for (key, value) in metadata {
            put_str(&mut w, key).map_err(io)?;
            put_value(&mut w, value).map_err(io)?;
        }
        let mut offset = 0u64;
        for (t, size) in tensors.iter().zip(&sizes) {
            put_str(&mut w, &t.name).map_err(io)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())
                .map_err(io)?;
            for d in &t.dims {
                w.write_all(&d.to_le_bytes()).map_err(io)?;
            }
            w.write_all(&t.ggml_type.to_le_bytes()).map_err(io)?;
            w.write_all(&offset.to_le_bytes()).map_err(io)?;
            offset = (offset + size).next_multiple_of(ALIGNMENT);
        }
        let n = w.n;
        pad(&mut w, n).map_err(io)?;
        for (i, (t, size)) in tensors.iter().zip(&sizes).enumerate() {
            let mut given = 0u64;
            produce(i, &mut |piece: &[u8]| {
                given += piece.len() as u64;
                if given > *size {
                    return Err(WriteError::Tensor {
                        tensor: t.name.clone(),
                        message: format!("more than the {size} bytes its table entry needs"),
                    });
                }
                w.write_all(piece).map_err(io)?;
                // The pages below what the buffer still holds are in the file.
                release.advance(w.n - w.inner.buffer().len() as u64);
                Ok(())
            })?;
            if given != *size {
                return Err(WriteError::Tensor {
                    tensor: t.name.clone(),
                    message: format!("{given} bytes given, its table entry needs {size}"),
                });
            }
            pad(&mut w, *size).map_err(io)?;
        }
        let file = w.inner.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        // SAFETY: as in `PageRelease::advance`: advice on the open descriptor, dropping
        // the last windows' clean pages now that everything is on disk.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
        Ok(())
    })();
    match result {
        Ok(()) => {
            std::fs::rename(&tmp, path).map_err(io)?;
            drop(guard);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            drop(guard);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QuantFormat;
    use crate::weights::gguf::{GgufFile, Value};

    #[test]
    fn what_it_writes_reads_back_with_offsets_aligned() {
        let dir = std::env::temp_dir().join(format!("moec-gguf-write-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.gguf");
        let meta = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("llama".into()),
            ),
            ("llama.block_count".to_string(), MetaValue::U32(2)),
            (
                "tokenizer.ggml.scores".to_string(),
                MetaValue::F32s(vec![-1.0, 0.5]),
            ),
            (
                "tokenizer.ggml.add_bos_token".to_string(),
                MetaValue::Bool(true),
            ),
        ];
        let tensors = vec![
            TensorEntry {
                name: "a".into(),
                dims: vec![3],
                ggml_type: GGML_F32,
            },
            TensorEntry {
                name: "b".into(),
                dims: vec![32, 2],
                ggml_type: QuantFormat::Q8_0.ggml_type(),
            },
        ];
        write_gguf(&path, &meta, &tensors, |i| {
            Ok(vec![i as u8 + 1; tensors[i].bytes().unwrap() as usize])
        })
        .unwrap();
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(file.get_u64("llama.block_count").unwrap(), 2);
        assert_eq!(
            file.metadata.get("tokenizer.ggml.add_bos_token"),
            Some(&Value::Bool(true))
        );
        let b = &file.tensors["b"];
        assert_eq!(b.range.start % ALIGNMENT as usize, 0);
        assert_eq!(b.range.len(), 68);
        assert!(file.bytes()[b.range.clone()].iter().all(|&x| x == 2));
        // A producer that gives the wrong length leaves nothing behind.
        let bad = dir.join("bad.gguf");
        let err = write_gguf(&bad, &meta, &tensors, |_| Ok(vec![0u8; 5])).unwrap_err();
        assert!(err.to_string().contains("tensor `a`"), "{err}");
        assert!(!bad.exists());
        let leftovers = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(leftovers, 1, "only t.gguf remains");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
