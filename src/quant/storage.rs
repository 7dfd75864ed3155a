//! How a tensor's elements are stored: a float dtype ([`WeightDtype`]) or blocks of a
//! GGML format ([`Storage::Quant`]), and what that costs in bytes. The card, the layout and
//! every byte count of the compiler size tensors by these.
//!
//! [`GGML_TYPES`] is the one table of the ggml types moec reads and writes: type id, name,
//! storage, block geometry and the `general.file_type` of a file mostly in that type. The
//! GGUF reader, the GGUF writer, `moec quantize` and [`QuantFormat`]'s own geometry look
//! it up; nothing else spells a type id.

use crate::quant::QuantFormat;
use serde::{Deserialize, Serialize};

/// Element type of the weights as stored in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightDtype {
    /// bfloat16 (2 bytes); what the Hub checkpoints ship.
    Bf16,
    /// IEEE half (2 bytes).
    F16,
    /// IEEE single (4 bytes).
    F32,
}

impl WeightDtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            WeightDtype::Bf16 | WeightDtype::F16 => 2,
            WeightDtype::F32 => 4,
        }
    }
}

/// How a tensor's elements are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Storage {
    /// Plain floats.
    Float(WeightDtype),
    /// Blocks of a quantised format.
    Quant(QuantFormat),
}

impl Storage {
    /// Bytes of `elems` elements (`None` for a quantised count that is not whole blocks).
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        match self {
            Storage::Float(d) => elems.checked_mul(d.bytes()),
            Storage::Quant(f) => f.bytes_for(usize::try_from(elems).ok()?).map(|b| b as u64),
        }
    }

    /// Bytes of a `[rows, cols]` matrix (rows of whole blocks for a quantised format).
    pub fn matrix_bytes(self, rows: u64, cols: u64) -> Option<u64> {
        self.bytes_for(cols)?.checked_mul(rows)
    }

    /// The name ggml uses (`BF16`, `Q4_K`).
    pub fn name(self) -> &'static str {
        self.ggml().name
    }

    /// Its row of [`GGML_TYPES`]. A match, not a search: block geometry is asked for
    /// inside the products' loops, where this folds to a constant.
    pub fn ggml(self) -> &'static GgmlType {
        // The rows stand in this order (a unit test holds it).
        &GGML_TYPES[match self {
            Storage::Float(WeightDtype::F32) => 0,
            Storage::Float(WeightDtype::F16) => 1,
            Storage::Float(WeightDtype::Bf16) => 2,
            Storage::Quant(QuantFormat::Q4_0) => 3,
            Storage::Quant(QuantFormat::Q4_1) => 4,
            Storage::Quant(QuantFormat::Q5_0) => 5,
            Storage::Quant(QuantFormat::Q8_0) => 6,
            Storage::Quant(QuantFormat::Q4K) => 7,
            Storage::Quant(QuantFormat::Q5K) => 8,
            Storage::Quant(QuantFormat::Q6K) => 9,
            Storage::Quant(QuantFormat::Mxfp4) => 10,
        }]
    }

    /// The storage of ggml type id `id`, if moec computes with it.
    pub fn from_ggml_type(id: u32) -> Option<Storage> {
        GGML_TYPES.iter().find(|t| t.id == id).map(|t| t.storage)
    }

    /// The block format, for a quantised storage.
    pub fn quant(self) -> Option<QuantFormat> {
        match self {
            Storage::Quant(f) => Some(f),
            Storage::Float(_) => None,
        }
    }

    /// The float dtype the elements are read as (f32 for a quantised format: what its
    /// blocks decode to).
    pub fn dtype(self) -> WeightDtype {
        match self {
            Storage::Float(d) => d,
            Storage::Quant(_) => WeightDtype::F32,
        }
    }

    /// Parses `bf16`, `f16`, `f32`, `q4_0`, `q4_1`, `q5_0`, `q8_0`, `q4_k`, `q5_k`, `q6_k`, `mxfp4`
    /// (any case).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim().to_ascii_lowercase();
        Ok(match t.as_str() {
            "bf16" => Storage::Float(WeightDtype::Bf16),
            "f16" => Storage::Float(WeightDtype::F16),
            "f32" => Storage::Float(WeightDtype::F32),
            "q4_0" => Storage::Quant(QuantFormat::Q4_0),
            "q4_1" => Storage::Quant(QuantFormat::Q4_1),
            "q5_0" => Storage::Quant(QuantFormat::Q5_0),
            "q8_0" => Storage::Quant(QuantFormat::Q8_0),
            "q4_k" => Storage::Quant(QuantFormat::Q4K),
            "q5_k" => Storage::Quant(QuantFormat::Q5K),
            "q6_k" => Storage::Quant(QuantFormat::Q6K),
            "mxfp4" => Storage::Quant(QuantFormat::Mxfp4),
            _ => {
                return Err(format!(
                    "unknown weight format `{text}` (one of bf16, f16, f32, q4_0, q4_1, q5_0, q8_0, q4_k, q5_k, q6_k, mxfp4)"
                ))
            }
        })
    }
}

impl std::fmt::Display for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One ggml type moec reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    /// The type id (`GGML_TYPE_*` in `ggml.h`).
    pub id: u32,
    /// The name ggml prints (`Q4_K`).
    pub name: &'static str,
    /// What moec stores it as.
    pub storage: Storage,
    /// Elements per block (1 for the float types).
    pub block_elems: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// llama.cpp's `general.file_type` (`llama_ftype`) of a file mostly in this type.
    pub file_type: u32,
}

/// Super-block width of the K formats (`QK_K`).
const K: usize = crate::quant::QK_K;

/// Every ggml type moec reads and writes, from ggml's `ggml.h` (type ids), its
/// `ggml-common.h` block structs (geometry) and llama.cpp's `llama_ftype` (file types).
pub const GGML_TYPES: [GgmlType; 11] = [
    float(0, "F32", WeightDtype::F32, 4, 0),
    float(1, "F16", WeightDtype::F16, 2, 1),
    float(30, "BF16", WeightDtype::Bf16, 2, 32),
    block(2, "Q4_0", QuantFormat::Q4_0, 32, 2 + 16, 2),
    block(3, "Q4_1", QuantFormat::Q4_1, 32, 2 + 2 + 16, 3),
    block(6, "Q5_0", QuantFormat::Q5_0, 32, 2 + 4 + 16, 8),
    block(8, "Q8_0", QuantFormat::Q8_0, 32, 2 + 32, 7),
    block(12, "Q4_K", QuantFormat::Q4K, K, 2 + 2 + 12 + K / 2, 14),
    block(
        13,
        "Q5_K",
        QuantFormat::Q5K,
        K,
        2 + 2 + 12 + K / 8 + K / 2,
        16,
    ),
    block(
        14,
        "Q6_K",
        QuantFormat::Q6K,
        K,
        K / 2 + K / 4 + K / 16 + 2,
        18,
    ),
    block(39, "MXFP4", QuantFormat::Mxfp4, 32, 1 + 16, 38),
];

const fn float(id: u32, name: &'static str, d: WeightDtype, bytes: usize, ft: u32) -> GgmlType {
    GgmlType {
        id,
        name,
        storage: Storage::Float(d),
        block_elems: 1,
        block_bytes: bytes,
        file_type: ft,
    }
}

const fn block(
    id: u32,
    name: &'static str,
    f: QuantFormat,
    elems: usize,
    bytes: usize,
    ft: u32,
) -> GgmlType {
    GgmlType {
        id,
        name,
        storage: Storage::Quant(f),
        block_elems: elems,
        block_bytes: bytes,
        file_type: ft,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each storage has exactly one row and each id names one type; the float rows agree
    /// with the dtypes' sizes.
    #[test]
    fn the_table_lists_every_storage_once() {
        let mut all: Vec<Storage> = [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16]
            .map(Storage::Float)
            .to_vec();
        all.extend(QuantFormat::ALL.map(Storage::Quant));
        assert_eq!(all.len(), GGML_TYPES.len());
        for s in all {
            assert_eq!(
                GGML_TYPES.iter().filter(|t| t.storage == s).count(),
                1,
                "{s}"
            );
            assert_eq!(Storage::from_ggml_type(s.ggml().id), Some(s));
            if let Storage::Float(d) = s {
                assert_eq!(s.ggml().block_bytes as u64, d.bytes());
            }
        }
        assert_eq!(Storage::from_ggml_type(99), None);
    }
}
