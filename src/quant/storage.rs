//! How a tensor's elements are stored: a float dtype ([`WeightDtype`]) or blocks of a
//! GGML format ([`Storage::Quant`]), and what that costs in bytes. The card, the layout and
//! every byte count of the compiler size tensors by these.

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
        match self {
            Storage::Float(WeightDtype::F32) => "F32",
            Storage::Float(WeightDtype::F16) => "F16",
            Storage::Float(WeightDtype::Bf16) => "BF16",
            Storage::Quant(f) => f.name(),
        }
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

    /// Parses `bf16`, `f16`, `f32`, `q4_0`, `q4_1`, `q8_0`, `q4_k`, `q5_k`, `q6_k`, `mxfp4`
    /// (any case).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim().to_ascii_lowercase();
        Ok(match t.as_str() {
            "bf16" => Storage::Float(WeightDtype::Bf16),
            "f16" => Storage::Float(WeightDtype::F16),
            "f32" => Storage::Float(WeightDtype::F32),
            "q4_0" => Storage::Quant(QuantFormat::Q4_0),
            "q4_1" => Storage::Quant(QuantFormat::Q4_1),
            "q8_0" => Storage::Quant(QuantFormat::Q8_0),
            "q4_k" => Storage::Quant(QuantFormat::Q4K),
            "q5_k" => Storage::Quant(QuantFormat::Q5K),
            "q6_k" => Storage::Quant(QuantFormat::Q6K),
            "mxfp4" => Storage::Quant(QuantFormat::Mxfp4),
            _ => {
                return Err(format!(
                    "unknown weight format `{text}` (one of bf16, f16, f32, q4_0, q4_1, q8_0, q4_k, q5_k, q6_k, mxfp4)"
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
