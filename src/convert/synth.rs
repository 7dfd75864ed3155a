//! A card's synthetic checkpoint written straight into a llama.cpp GGUF (`moec synth
//! --gguf`), at full size, without a Hub checkpoint on disk first.
//!
//! Takes a card, the types ([`Types`], as `moec quantize` takes them), a seed, the file's
//! name and the path to write; gives the file and what it holds ([`SynthGguf`]). The
//! tensor table, every tensor's type and the metadata come from the same plan `moec
//! quantize` makes ([`super::layout`]) of the Hub checkpoint `moec synth` would write of
//! the card (its `config.json` and tokenizer, the card's embedded one): one set of rules
//! decides each tensor's type. Only the bytes differ: a quantised tensor's blocks are drawn
//! directly ([`crate::quant::random`]: random codes under scales sized to the spread
//! [`crate::weights::synth`] gives that tensor), a float tensor's values from the same
//! distributions, so the file is written at about the disk's speed rather than a
//! quantiser's. Guarantees: the bytes depend only on the card, the types and the seed
//! (each piece of about 1 MB of a tensor has its own generator, seeded by the seed, the
//! tensor's name and the piece's index, and pieces are drawn in parallel and written in
//! order); memory holds one window of pieces (64 MB), never a tensor's values in f32; the
//! file is written under a temporary name and renamed at the end ([`super::write`]), and
//! a file system without room for it is an error before a byte is written. The vocabulary
//! is the card's tokenizer padded with unused `[PADi]` tokens to the card's vocabulary,
//! written as the family's converter writes its own; a SentencePiece tokenizer standing in
//! for a family whose converter writes byte-level BPE is written as llama.cpp's `llama`
//! vocabulary ([`SynthGguf::vocabulary`] says which).

use super::write::{write_gguf_streamed, MetaValue, Sink, TensorEntry, WriteError};
use super::Types;
use super::{bytes_by_type, gpt_oss, layout, ExportError, ExportSummary, Inputs, Layout, Origin};
use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::quant::random::random_blocks;
use crate::quant::storage::{Storage, WeightDtype};
use crate::quant::QuantError;
use crate::rng::Rng;
use crate::weights::config::config_for_card;
use crate::weights::family::hub::Source;
use crate::weights::names::checkpoint_tensors;
use crate::weights::synth::{distribution, fnv1a, free_bytes};
use crate::weights::tokenizer::embedded_tokenizer_json;
use half::{bf16, f16};
use rayon::prelude::*;
use std::path::Path;

/// Bytes of one piece (a whole number of rows, at least one): the unit with its own
/// generator.
const PIECE_BYTES: usize = 1 << 20;
/// Pieces drawn in parallel before they are written.
const WINDOW_PIECES: usize = 64;

/// What [`synth_gguf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthGguf {
    /// Tensors, bytes per type, the file's size.
    pub summary: ExportSummary,
    /// Which vocabulary the file holds, in words (the tokenizer, its own token count, the
    /// padding to the card's vocabulary, and the vocabulary type written).
    pub vocabulary: String,
}

/// The inputs of the Hub checkpoint `moec synth` writes of `card`: its `config.json` and
/// its embedded tokenizer, no `tokenizer_config.json`.
fn inputs_of_card<'a>(card: &'a ModelCard, arch: &'a ArchSpec) -> Inputs<'a> {
    let origin = format!("the card `{}`", card.name);
    let tokenizer =
        serde_json::from_slice(embedded_tokenizer_json(card)).map_err(|e| e.to_string());
    Inputs {
        origin: origin.clone(),
        card,
        arch,
        config: Ok(config_for_card(card, card.dtype)),
        config_origin: format!("{origin}'s config.json"),
        tokenizer: Some((format!("embedded {}", card.tokenizer), tokenizer)),
        tokenizer_config: serde_json::Value::Null,
        lm_head: checkpoint_tensors(arch)
            .iter()
            .any(|(name, _)| name == "lm_head.weight"),
        llama_vocab_stand_in: true,
    }
}

/// The vocabulary the metadata holds, in words.
fn describe_vocabulary(card: &ModelCard, metadata: &[(String, MetaValue)]) -> String {
    let get = |key: &str| metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    let model = match get("tokenizer.ggml.model") {
        Some(MetaValue::Str(m)) => m.clone(),
        _ => "?".into(),
    };
    let (own, total) = match get("tokenizer.ggml.token_type") {
        // Type 5 is UNUSED: the `[PADi]` padding.
        Some(MetaValue::I32s(types)) => (types.iter().filter(|&&t| t != 5).count(), types.len()),
        _ => (0, 0),
    };
    let padding = if own < total {
        format!(
            ", padded with {} unused [PADi] tokens to the card's {total}",
            total - own
        )
    } else {
        String::new()
    };
    format!(
        "{} ({own} tokens{padding}), written as llama.cpp's `{model}` vocabulary",
        card.tokenizer
    )
}

/// The Hub tensor `origin` reads (for its values' spread).
fn hub_source(arch: &ArchSpec, origin: &Origin) -> Option<Source> {
    match origin {
        Origin::Whole { src, .. } | Origin::KvBSplit { src, .. } => Some(src.clone()),
        // A stack is never empty: the plan makes one per expert kind it meets.
        Origin::Stacked(sources) | Origin::StackedTransposed(sources) => sources.first().cloned(),
        Origin::GptOss(experts) => Some(gpt_oss::hub_source(arch, experts)),
    }
}

/// Fills `out` (one piece: whole rows of `storage`) with random values of a tensor whose
/// values spread as `(centre, half)`.
fn fill_piece(
    storage: Storage,
    (centre, half): (f32, f32),
    rng: &mut Rng,
    out: &mut [u8],
) -> Result<(), QuantError> {
    match storage {
        Storage::Quant(format) => {
            // A uniform distribution of half-width `half` around `centre`.
            let rms = (centre * centre + half * half / 3.0).sqrt();
            random_blocks(format, rms, rng, out)
        }
        Storage::Float(dtype) => {
            let mut next = || centre + half * rng.next_signed_f32();
            match dtype {
                WeightDtype::F32 => out
                    .chunks_exact_mut(4)
                    .for_each(|c| c.copy_from_slice(&next().to_le_bytes())),
                WeightDtype::Bf16 => out
                    .chunks_exact_mut(2)
                    .for_each(|c| c.copy_from_slice(&bf16::from_f32(next()).to_le_bytes())),
                WeightDtype::F16 => out
                    .chunks_exact_mut(2)
                    .for_each(|c| c.copy_from_slice(&f16::from_f32(next()).to_le_bytes())),
            }
            Ok(())
        }
    }
}

/// Streams tensor `entry`'s bytes into `sink`: pieces of whole rows, each from its own
/// generator, drawn a window at a time in parallel.
fn produce(
    entry: &TensorEntry,
    spread: (f32, f32),
    seed: u64,
    sink: &mut Sink<'_>,
) -> Result<(), WriteError> {
    let storage = Storage::from_ggml_type(entry.ggml_type).ok_or_else(|| WriteError::Tensor {
        tensor: entry.name.clone(),
        message: format!("ggml type {} is not one moec writes", entry.ggml_type),
    })?;
    let total = entry.bytes().unwrap_or(0) as usize;
    let rows: u64 = entry.dims[1..].iter().product();
    let row_bytes = total / (rows.max(1) as usize);
    let piece = (PIECE_BYTES / row_bytes.max(1)).max(1) * row_bytes.max(1);
    let base = seed ^ fnv1a(&entry.name);
    let mut buf = vec![0u8; total.min(piece * WINDOW_PIECES)];
    let mut at = 0usize;
    while at < total {
        let len = (total - at).min(buf.len());
        let first = at / piece;
        buf[..len]
            .par_chunks_mut(piece)
            .enumerate()
            .try_for_each(|(i, out)| {
                let index = (first + i) as u64;
                let mut rng = Rng::new(base ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                fill_piece(storage, spread, &mut rng, out)
            })
            .map_err(|e| WriteError::Tensor {
                tensor: entry.name.clone(),
                message: e.to_string(),
            })?;
        sink(&buf[..len])?;
        at += len;
    }
    Ok(())
}

/// Writes the synthetic GGUF of `card` with `types` to `out` (which must not exist);
/// `progress` hears (tensors written, tensors in all, the tensor being written).
pub fn synth_gguf(
    card: &ModelCard,
    types: &Types,
    seed: u64,
    name: &str,
    out: &Path,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<SynthGguf, ExportError> {
    if out.exists() {
        return Err(ExportError::Unsupported(format!(
            "{}: already exists; moec synth does not overwrite a file",
            out.display()
        )));
    }
    let arch = ArchSpec::from_card(card);
    let inputs = inputs_of_card(card, &arch);
    let Layout {
        metadata,
        entries,
        origins,
    } = layout(&inputs, types, name)?;
    let data: u64 = entries
        .iter()
        .map(|e| {
            e.bytes()
                .unwrap_or(0)
                .next_multiple_of(super::write::ALIGNMENT)
        })
        .sum();
    // The tensor data and 64 MB for the metadata (a 200k-token vocabulary is ~5 MB).
    let needed = data + (64 << 20);
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Some(free) = free_bytes(parent).filter(|&free| free < needed) {
        return Err(ExportError::Unsupported(format!(
            "{} has {free} bytes free but the file needs {needed}; free space or choose \
             another --out",
            parent.display()
        )));
    }
    crate::tempfiles::remove_stale(out, "gguf", "a partial GGUF");
    let spreads: Vec<(f32, f32)> = entries
        .iter()
        .zip(&origins)
        .map(|(entry, origin)| match hub_source(&arch, origin) {
            Some(src) => distribution(&arch, &src.name, &src.shape),
            None => distribution(&arch, &entry.name, &[]),
        })
        .collect();
    let total = entries.len();
    write_gguf_streamed(out, &metadata, &entries, |i, sink| {
        progress(i, total, &entries[i].name);
        produce(&entries[i], spreads[i], seed, sink)
    })?;
    let file_bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(SynthGguf {
        summary: ExportSummary {
            tensors: total,
            bytes_by_type: bytes_by_type(&entries),
            file_bytes,
            copied: 0,
        },
        vocabulary: describe_vocabulary(card, &metadata),
    })
}
