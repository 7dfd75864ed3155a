//! GGUF files (llama.cpp's single-file checkpoints), memory-mapped.
//!
//! Takes a `.gguf` path; gives its metadata (typed key/value pairs) and its tensor table
//! (name, ggml dimensions, storage type, byte range inside the map). Guarantees: the
//! header is read from the map with every length and offset checked against the file
//! size before use, so a wrong magic, an unknown version, a truncated file, a tensor whose
//! bytes run past the end or overlap its alignment, or a hostile count (more entries than
//! the file has bytes for) is one [`GgufError`] naming the file and what is wrong; nothing
//! panics and no allocation is sized from an unchecked count. Tensor data are not copied.
//!
//! Why a hand-written reader: the format is a flat header (GGUF v2/v3: magic, version,
//! counts, key/value pairs, tensor infos, aligned data; about 250 lines here), and the
//! crates that read it either pull a whole inference framework (candle-core's
//! `quantized::gguf_file` brings candle's tensor types and its own dequantisers) or read
//! the file into owned buffers rather than a map; moec needs only the byte ranges.

pub mod families;
pub mod llama;
pub mod mla;
pub mod split;
pub mod vocab;

use memmap2::Mmap;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// `GGUF` as a little-endian u32.
const MAGIC: [u8; 4] = *b"GGUF";

/// The alignment of tensor data when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;

/// Deepest nesting of arrays accepted (llama.cpp writes at most arrays of strings).
const MAX_ARRAY_DEPTH: usize = 4;

/// Problems reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying cause, as the OS reported it.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("{path}: not a GGUF file (starts with {found:?}, expected \"GGUF\")")]
    Magic {
        /// The file.
        path: String,
        /// The bytes found, lossily as text.
        found: String,
    },
    /// A GGUF version moec does not read.
    #[error("{path}: GGUF version {version} is not supported (moec reads versions 2 and 3)")]
    Version {
        /// The file.
        path: String,
        /// The version in the header.
        version: u32,
    },
    /// The header or a tensor's data runs past the end of the file.
    #[error("{path}: truncated GGUF file: {what} needs bytes up to {needed}, the file has {len}")]
    Truncated {
        /// The file.
        path: String,
        /// What was being read.
        what: String,
        /// The end offset it needs.
        needed: u64,
        /// The file's length.
        len: u64,
    },
    /// The header is malformed (bad value type, invalid UTF-8, misaligned tensor).
    #[error("{path}: malformed GGUF header: {message}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor moec needs is stored in a type it does not compute with.
    #[error(
        "{path}: tensor `{tensor}` is stored as {type_name}, which moec does not compute with \
         (supported: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)"
    )]
    UnsupportedType {
        /// The file.
        path: String,
        /// Tensor name.
        tensor: String,
        /// ggml's name of its type.
        type_name: String,
    },
    /// A metadata key is missing, of the wrong type, or contradicts the tensors.
    #[error("{path}: metadata `{key}`: {message}")]
    Metadata {
        /// The file.
        path: String,
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A part of a split GGUF (`-0000i-of-0000N.gguf`) is absent or does not belong.
    #[error("{path}: split GGUF part {part} of {count}: {message}")]
    Split {
        /// The part's file (the one expected, when it is missing).
        path: String,
        /// Its number, from 1.
        part: u64,
        /// How many parts the first one says there are.
        count: u64,
        /// What is wrong.
        message: String,
    },
    /// A tensor the model needs is absent or has the wrong shape or type.
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        /// The file.
        path: String,
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type (u8, u16, u32, u64), widened.
    Uint(u64),
    /// Any signed integer type (i8, i16, i32, i64), widened.
    Int(i64),
    /// f32 or f64, widened.
    Float(f64),
    /// A bool.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array (of one element type).
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Uint(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::Uint(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

pub use crate::quant::storage::Storage;

/// ggml's name of type id `id` (for messages about types moec does not read).
pub fn ggml_type_name(id: u32) -> String {
    const NAMES: [&str; 40] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
    ];
    NAMES
        .get(id as usize)
        .map(|n| n.to_string())
        .unwrap_or_else(|| format!("ggml type {id}"))
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// ggml dimensions, innermost first (`ne[0]` is the row width).
    pub dims: Vec<u64>,
    /// ggml type id.
    pub ggml_type: u32,
    /// Byte range inside its part's file (checked to lie inside it, for types moec reads).
    pub range: Range<usize>,
    /// Which part of a split GGUF holds it (0 for a single file).
    pub part: usize,
}

impl TensorInfo {
    /// Elements in the tensor.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape outermost first, as PyTorch writes it (`[rows, cols]`).
    pub fn torch_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened GGUF file, or all parts of a split one (metadata from the first part,
/// tensors from all).
pub struct GgufFile {
    path: PathBuf,
    /// Each part's path and map (one for a single file).
    parts: Vec<(PathBuf, Mmap)>,
    /// The header's version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked reader over the header bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn truncated(&self, what: &str, needed: usize) -> GgufError {
        GgufError::Truncated {
            path: self.path.display().to_string(),
            what: what.to_string(),
            needed: needed as u64,
            len: self.bytes.len() as u64,
        }
    }

    fn malformed(&self, message: String) -> GgufError {
        GgufError::Malformed {
            path: self.path.display().to_string(),
            message,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.truncated(what, self.at.saturating_add(n)))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_item_bytes` each: refused when the rest of the
    /// file could not hold them, so no allocation is sized from a hostile count.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let rest = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(min_item_bytes as u64) > rest {
            return Err(self.truncated(
                &format!("{what} ({n} entries)"),
                self.at
                    .saturating_add(n.saturating_mul(min_item_bytes as u64) as usize),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let n = self.count(what, 1)?;
        let raw = self.take(n, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.malformed(format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::Uint(u64::from(self.array::<1>(key)?[0])),
            1 => Value::Int(i64::from(self.array::<1>(key)?[0] as i8)),
            2 => Value::Uint(u64::from(u16::from_le_bytes(self.array(key)?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.array(key)?))),
            4 => Value::Uint(u64::from(self.u32(key)?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.array(key)?))),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.array(key)?))),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.malformed(format!("`{key}`: bool byte {b}"))),
            },
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.malformed(format!("`{key}`: arrays nested too deep")));
                }
                let item = self.u32(key)?;
                let min = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                let n = self.count(key, min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::Uint(self.u64(key)?),
            11 => Value::Int(i64::from_le_bytes(self.array(key)?)),
            12 => Value::Float(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.malformed(format!("`{key}`: unknown value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Opens and maps `path`, reading and checking the whole header. When its metadata
    /// says it is part 1 of a split GGUF (`split.count` > 1, as `llama-gguf-split
    /// --split` writes), the other parts are found beside it by name
    /// (`-00002-of-0000N.gguf`, ...) and opened too; a missing or foreign part is an error
    /// naming the file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let (mmap, (version, metadata, mut tensors)) = Self::map_and_parse(path, 0)?;
        let mut parts = vec![(path.to_path_buf(), mmap)];
        let count = split::count(path, &metadata)?;
        for (i, part_path) in split::sibling_paths(path, count)?
            .into_iter()
            .enumerate()
            .skip(1)
        {
            let (map, (_, part_meta, part_tensors)) = Self::map_and_parse(&part_path, i)
                .map_err(|e| split::missing(e, &part_path, i, count))?;
            split::check_part(&part_path, &part_meta, i, count)?;
            for (name, info) in part_tensors {
                if tensors.contains_key(&name) {
                    return Err(GgufError::Malformed {
                        path: part_path.display().to_string(),
                        message: format!("tensor `{name}` is also in an earlier part"),
                    });
                }
                tensors.insert(name, info);
            }
            parts.push((part_path, map));
        }
        split::check_total(path, &metadata, tensors.len())?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            parts,
            version,
            metadata,
            tensors,
        })
    }

    /// Maps one file and parses its header, its tensors marked as part `part`.
    #[allow(clippy::type_complexity)]
    fn map_and_parse(
        path: &Path,
        part: usize,
    ) -> Result<
        (
            Mmap,
            (u32, BTreeMap<String, Value>, BTreeMap<String, TensorInfo>),
        ),
        GgufError,
    > {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; moec never writes a
        // GGUF file while it is open. Another process truncating it concurrently is outside
        // what any mmap reader can defend against (as for safetensors checkpoints).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let mut parsed = Self::parse(path, &mmap)?;
        for info in parsed.2.values_mut() {
            info.part = part;
        }
        Ok((mmap, parsed))
    }

    #[allow(clippy::type_complexity)]
    fn parse(
        path: &Path,
        bytes: &[u8],
    ) -> Result<(u32, BTreeMap<String, Value>, BTreeMap<String, TensorInfo>), GgufError> {
        let mut c = Cursor { bytes, at: 0, path };
        let magic: [u8; 4] = c.array("the magic")?;
        if magic != MAGIC {
            return Err(GgufError::Magic {
                path: path.display().to_string(),
                found: String::from_utf8_lossy(&magic).into_owned(),
            });
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version {
                path: path.display().to_string(),
                version,
            });
        }
        // A tensor info is at least 8 (name length) + 4 (dims) + 4 (type) + 8 (offset)
        // bytes; a key/value pair at least 8 + 4 + 1.
        let n_tensors = c.count("the tensor count", 24)?;
        let n_kv = c.count("the metadata count", 13)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Metadata {
                        path: path.display().to_string(),
                        key: "general.alignment".into(),
                        message: format!("{v:?} is not a power of two"),
                    })
                }
            },
        };
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32(&name)? as usize;
            if n_dims > 4 {
                return Err(c.malformed(format!(
                    "tensor `{name}` has {n_dims} dimensions (ggml has at most 4)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let ggml_type = c.u32(&name)?;
            let offset = c.u64(&name)?;
            infos.push((name, dims, ggml_type, offset));
        }
        let data_start = (c.at as u64).div_ceil(alignment) * alignment;
        let mut tensors = BTreeMap::new();
        for (name, dims, ggml_type, offset) in infos {
            if offset % alignment != 0 {
                return Err(c.malformed(format!(
                    "tensor `{name}` starts at data offset {offset}, not a multiple of the alignment {alignment}"
                )));
            }
            let elems = dims.iter().try_fold(1u64, |p, &d| p.checked_mul(d));
            // Types moec does not read have no size it can check; they are refused by name
            // only if the model needs them.
            let len = match (Storage::from_ggml_type(ggml_type), elems) {
                (Some(storage), Some(elems)) => storage.bytes_for(elems).ok_or_else(|| {
                    c.malformed(format!(
                        "tensor `{name}` of {elems} elements is not whole {} blocks",
                        storage.name()
                    ))
                })?,
                (None, _) => 0,
                (_, None) => {
                    return Err(c.malformed(format!("tensor `{name}` dimensions {dims:?} overflow")))
                }
            };
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(len));
            let range = match (start, end) {
                (Some(s), Some(e)) if e <= bytes.len() as u64 => s as usize..e as usize,
                _ => {
                    return Err(c.truncated(
                        &format!("tensor `{name}` ({} bytes)", len),
                        end.unwrap_or(u64::MAX) as usize,
                    ))
                }
            };
            if tensors.contains_key(&name) {
                return Err(c.malformed(format!("tensor `{name}` is listed twice")));
            }
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    ggml_type,
                    range,
                    part: 0,
                },
            );
        }
        Ok((version, metadata, tensors))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The first part's whole map (the ranges of its tensors index into it).
    pub fn bytes(&self) -> &[u8] {
        &self.parts[0].1
    }

    /// A tensor's bytes, from whichever part holds it.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        self.parts
            .get(info.part)
            .and_then(|(_, map)| map.get(info.range.clone()))
            .unwrap_or(&[])
    }

    /// How many files the model is in (1 unless split).
    pub fn part_count(&self) -> usize {
        self.parts.len()
    }

    /// Each part's path and memory map, in part order, for a reader that keeps the
    /// tensor ranges (a tensor's `part` indexes this list).
    pub fn into_maps(self) -> Vec<(PathBuf, Mmap)> {
        self.parts
    }

    fn meta_err(&self, key: &str, message: String) -> GgufError {
        GgufError::Metadata {
            path: self.path.display().to_string(),
            key: key.into(),
            message,
        }
    }

    /// Metadata `key`, required.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| self.meta_err(key, "missing".into()))
    }

    /// Metadata `key` as an unsigned integer, required.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.as_u64()
            .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a non-negative integer")))
    }

    /// Metadata `key` as a float, required.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key)?;
        v.as_f64()
            .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a number")))
    }

    /// Metadata `key` as a string, required.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.get(key)?;
        v.as_str()
            .ok_or_else(|| self.meta_err(key, format!("{v:?} is not a string")))
    }

    /// Tensor `name` with its storage, checked to have torch shape `shape`; a missing
    /// tensor, another shape, or a type moec does not compute with is an error naming it.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<(&TensorInfo, Storage), GgufError> {
        let err = |message: String| GgufError::Tensor {
            path: self.path.display().to_string(),
            tensor: name.into(),
            message,
        };
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| err("missing".into()))?;
        let storage =
            Storage::from_ggml_type(info.ggml_type).ok_or_else(|| GgufError::UnsupportedType {
                path: self.path.display().to_string(),
                tensor: name.into(),
                type_name: ggml_type_name(info.ggml_type),
            })?;
        if info.torch_shape() != shape {
            return Err(err(format!(
                "has shape {:?} (outermost first), the metadata implies {shape:?}",
                info.torch_shape()
            )));
        }
        Ok((info, storage))
    }
}

#[cfg(test)]
pub(crate) mod tests;
