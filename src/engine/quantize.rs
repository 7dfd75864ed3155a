//! A Hugging Face checkpoint written as a quantised llama.cpp GGUF.
//!
//! Takes a [`QuantizeRequest`] (the checkpoint folder, the file to write, the formats as
//! the user spelled them, the file's name); gives the export's [`ExportSummary`] (tensors,
//! bytes per type, blocks copied rather than quantised again) with the time taken, or a
//! one-line message. The formats are parsed here, after the checkpoint is open, because
//! the default depends on its family (gpt-oss ships MXFP4 experts). `convert` writes the
//! file atomically, so nothing is left behind on an error or an interrupt. `moec
//! quantize` calls [`quantize`]; nothing here prints.

use crate::convert::{export, ExportSummary, Mix, Types};
use crate::model::family::facts::Family;
use crate::model::formats::{WeightClass, WeightFormats};
use crate::quant::storage::Storage;
use crate::weights::checkpoint::Checkpoint;
use std::path::PathBuf;

/// The formats asked for, as spelled on the command line (parsed by [`quantize`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantizeFormats {
    /// Nothing asked: the experts in Q4_K (gpt-oss's in MXFP4, the format it ships and
    /// llama.cpp's converter keeps).
    Default,
    /// Formats per weight class (`experts=q4_k,attention=q8_0`).
    Classes(String),
    /// Every linear weight in one format; the router stays f32, as llama-quantize keeps it.
    All(String),
    /// One of llama-quantize's mixes (`q4_k_m`, ..., `mxfp4_moe`).
    Mix(String),
}

/// What `moec quantize` asks for.
#[derive(Debug, Clone)]
pub struct QuantizeRequest {
    /// The Hugging Face checkpoint folder.
    pub weights: PathBuf,
    /// The GGUF file to write (must not exist).
    pub out: PathBuf,
    /// The formats.
    pub formats: QuantizeFormats,
    /// `general.name` in the file; `None`: the folder's name (the card's without one).
    pub name: Option<String>,
}

/// What a quantisation wrote.
#[derive(Debug, Clone)]
pub struct QuantizeResult {
    /// Tensors, file bytes, bytes per type, blocks copied.
    pub summary: ExportSummary,
    /// Wall time of the export.
    pub seconds: f64,
}

/// Opens the checkpoint, parses the formats for its family and writes the GGUF;
/// `progress` hears (tensors written, tensors in all, the tensor being written).
pub fn quantize(
    request: &QuantizeRequest,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<QuantizeResult, String> {
    if request.out.exists() {
        return Err(format!(
            "{}: already exists; moec quantize does not overwrite a file",
            request.out.display()
        ));
    }
    let ckpt = Checkpoint::open(&request.weights).map_err(|e| e.to_string())?;
    let types = types(&request.formats, ckpt.arch().family)?;
    let name = request.name.clone().unwrap_or_else(|| {
        request
            .weights
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| ckpt.card().name.clone())
    });
    let start = std::time::Instant::now();
    let summary = export(&ckpt, &types, &name, &request.out, |i, total, tensor| {
        progress(i, total, tensor)
    })
    .map_err(|e| e.to_string())?;
    Ok(QuantizeResult {
        summary,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The types `formats` asks for in a checkpoint of `family`; errors name the flag.
pub(super) fn types(formats: &QuantizeFormats, family: Family) -> Result<Types, String> {
    let mut classes = WeightFormats::default();
    match formats {
        QuantizeFormats::Mix(mix) => {
            return Mix::parse(mix)
                .map(Types::Mix)
                .map_err(|e| format!("--mix: {e}"));
        }
        QuantizeFormats::All(all) => {
            let storage = Storage::parse(all).map_err(|e| format!("--all: {e}"))?;
            for class in [
                WeightClass::Experts,
                WeightClass::Attention,
                WeightClass::Shared,
                WeightClass::Embedding,
                WeightClass::Head,
            ] {
                classes.classes.insert(class, storage);
            }
        }
        QuantizeFormats::Classes(spec) => classes
            .parse_classes(spec)
            .map_err(|e| format!("--weight-format: {e}"))?,
        QuantizeFormats::Default => classes
            .parse_classes(if family.facts().mxfp4_unconverted.is_some() {
                "experts=mxfp4"
            } else {
                "experts=q4_k"
            })
            .map_err(|e| format!("--weight-format: {e}"))?,
    }
    Ok(Types::Classes(classes))
}
