//! A deterministic synthetic checkpoint of a model card, written in the Hub format.
//!
//! Takes a [`SynthRequest`] (the card, the folder to create, the seed, the stored dtype,
//! whether the experts are MXFP4 as the Hub's gpt-oss checkpoints store them); gives a
//! [`SynthResult`] (the card's name, the dtype, the weight bytes and the time taken) or a
//! one-line message. `weights::synth` writes the folder atomically (a temporary folder
//! renamed at the end). `moec synth` calls [`synth`]; nothing here prints.

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
