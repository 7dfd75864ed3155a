//! A deterministic synthetic checkpoint of a model card, written in the Hub format.
//!
//! Takes a [`SynthRequest`] (the card, the folder to create, the seed, the stored dtype,
//! whether the experts are MXFP4 as the Hub's gpt-oss checkpoints store them); gives a
//! [`SynthResult`] (the card's name, the dtype, the weight bytes and the time taken) or a
//! one-line message. `weights::synth` writes the folder atomically (a temporary folder
//! renamed at the end). [`synth_gguf`] writes the card's synthetic weights straight into
//! a llama.cpp GGUF instead ([`crate::convert::synth`]), each tensor in the type `moec
//! quantize` would give it for the same formats. `moec synth` calls both; nothing here
//! prints.

use super::quantize::{types, QuantizeFormats};
use crate::convert::synth::synth_gguf as write_gguf;
use crate::convert::ExportSummary;
use crate::model::{ModelCard, WeightDtype};
use crate::weights::synth::{write_checkpoint_as, ExpertStorage, SynthOptions};
use std::path::PathBuf;

/// What `moec synth` asks for.
#[derive(Debug, Clone)]
pub struct SynthRequest {
    /// Model card (built-in name or .ron path).
    pub card: String,
    /// Folder to create (must not exist).
    pub out: PathBuf,
    /// PRNG seed.
    pub seed: u64,
    /// Stored dtype; `None`: the card's.
    pub dtype: Option<WeightDtype>,
    /// Store the routed experts as MXFP4 blocks and scales (gpt-oss cards only).
    pub mxfp4: bool,
}

/// What a synthesis wrote.
#[derive(Debug, Clone)]
pub struct SynthResult {
    /// The card's name.
    pub model: String,
    /// The dtype the weights were stored in.
    pub dtype: WeightDtype,
    /// Bytes of the weights written.
    pub bytes: u64,
    /// Wall time of the writing.
    pub seconds: f64,
}

/// Loads the card and writes its synthetic checkpoint.
pub fn synth(request: &SynthRequest) -> Result<SynthResult, String> {
    let card = ModelCard::load(&request.card).map_err(|e| e.to_string())?;
    let dtype = request.dtype.unwrap_or(card.dtype);
    let opts = SynthOptions {
        seed: request.seed,
        dtype,
        ..SynthOptions::default()
    };
    let start = std::time::Instant::now();
    let experts = if request.mxfp4 {
        ExpertStorage::Mxfp4
    } else {
        ExpertStorage::Dense
    };
    write_checkpoint_as(&card, &request.out, &opts, experts).map_err(|e| e.to_string())?;
    // MXFP4 stores 32 four-bit codes and one byte of scale per block: 4.25 bits a weight.
    let bytes = match experts {
        ExpertStorage::Dense => card.total_params() * dtype.bytes(),
        ExpertStorage::Mxfp4 => {
            // The expert matrices only: their biases stay in the dtype.
            let packed = card.layers * card.experts * 3 * card.hidden * card.ffn;
            (card.total_params() - packed) * dtype.bytes() + packed * 17 / 32
        }
    };
    Ok(SynthResult {
        model: card.name.clone(),
        dtype,
        bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// What `moec synth --gguf` asks for.
#[derive(Debug, Clone)]
pub struct SynthGgufRequest {
    /// Model card (built-in name or .ron path).
    pub card: String,
    /// The GGUF file to write (must not exist).
    pub out: PathBuf,
    /// PRNG seed.
    pub seed: u64,
    /// The dtype of the tensors left in floats; `None`: the card's.
    pub dtype: Option<WeightDtype>,
    /// The formats, as `moec quantize` takes them.
    pub formats: QuantizeFormats,
    /// `general.name`; `None`: the card's name.
    pub name: Option<String>,
}

/// What `moec synth --gguf` wrote.
#[derive(Debug, Clone)]
pub struct SynthGgufResult {
    /// The card's name.
    pub model: String,
    /// Tensors, bytes per type, the file's size.
    pub summary: ExportSummary,
    /// The vocabulary written, in words.
    pub vocabulary: String,
    /// Wall time of the writing.
    pub seconds: f64,
}

/// Loads the card, parses the formats for its family and writes its synthetic GGUF;
/// `progress` hears (tensors written, tensors in all, the tensor being written).
pub fn synth_gguf(
    request: &SynthGgufRequest,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<SynthGgufResult, String> {
    let mut card = ModelCard::load(&request.card).map_err(|e| e.to_string())?;
    if let Some(dtype) = request.dtype {
        card.dtype = dtype;
    }
    let types = types(&request.formats, card.family)?;
    let name = request.name.clone().unwrap_or_else(|| card.name.clone());
    let start = std::time::Instant::now();
    let written = write_gguf(
        &card,
        &types,
        request.seed,
        &name,
        &request.out,
        |i, n, t| progress(i, n, t),
    )
    .map_err(|e| e.to_string())?;
    Ok(SynthGgufResult {
        model: card.name.clone(),
        summary: written.summary,
        vocabulary: written.vocabulary,
        seconds: start.elapsed().as_secs_f64(),
    })
}
