//! A Hugging Face checkpoint written as llama.cpp's GGUF, each weight class in its own
//! format or by llama-quantize's K-quant mix rules (`moec quantize`).
//!
//! Takes an opened [`Checkpoint`] of a family llama.cpp converts (Mixtral as its `llama`
//! architecture, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2/V3 as `deepseek2`, gpt-oss with
//! its fused experts split as [`gpt_oss`] says, DBRX as [`dbrx`] says), the types
//! ([`Types`]: formats per class, or a [`Mix`]) and an output path; gives the file
//! llama.cpp's `convert_hf_to_gguf.py` + `llama-quantize` would write: the converter's
//! hyper-parameter keys, llama.cpp's tensor names (from the importer's own map,
//! [`crate::weights::gguf::llama::place`]) with the experts merged into `ffn_{gate,up,down}_exps`,
//! Mixtral's `q_proj`/`k_proj` rows interleaved per head (the inverse of
//! [`crate::weights::gguf::llama::unpermute_rows`]), DeepSeek's `kv_b_proj` split per head into
//! `attn_k_b`/`attn_v_b`, 1-D tensors in f32, the vocabulary from `tokenizer.json` as the
//! converter writes it (`LlamaHfVocab` for Mixtral, [`gpt2`] for the others), and each
//! matrix in its type (unnamed classes keep the checkpoint's float dtype, gpt-oss's Hub
//! MXFP4 experts their blocks; the router,
//! unless named, is f32 as llama-quantize keeps it). Guarantees: the plan (every tensor,
//! its type and size) is checked before a byte is written, so a row that is not whole
//! blocks of its format, a family, config or tokenizer it cannot write, or a missing
//! tensor is one error naming it; the file is written atomically ([`write`]).
//!
//! The plan (tensor table, types, metadata) is made from [`Inputs`], not from the
//! checkpoint's bytes: [`synth`] makes it from a card alone, the Hub config and tokenizer a
//! synthetic checkpoint of the card would hold, and writes random weights of each tensor's
//! type straight into the file, so `moec synth --gguf` and `moec quantize` of `moec
//! synth`'s folder give the same table by the same rules.

use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::formats::{WeightClass, WeightFormats, WeightTensor};
use crate::model::layout::LayerLayout;
use crate::model::segment::SegmentKind;
use crate::model::vocab::Orientation;
use crate::quant::encode::quantize_row;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::weights::checkpoint::Checkpoint;
use crate::weights::family::hub::Source;
use crate::weights::gguf::families::{gguf_family, GgufKeys};
use crate::weights::gguf::llama::{place, Place};
use crate::weights::names::{head_names, segment_source};
use rayon::prelude::*;
use std::path::Path;
use write::{write_gguf, MetaValue, TensorEntry, WriteError, GGML_F32};

mod dbrx;
mod gpt2;
mod gpt_oss;
mod metadata;
pub mod mix;
pub mod synth;
pub mod write;
pub use mix::Mix;

/// How [`export`] picks each tensor's type.
#[derive(Debug, Clone)]
pub enum Types {
    /// A format per weight class (unnamed classes keep the checkpoint's dtype).
    Classes(WeightFormats),
    /// llama-quantize's rules for one of its K-quant file types ([`mix::mix_types`]).
    Mix(Mix),
}

/// Why a checkpoint cannot be written as GGUF.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The family, tokenizer or a tensor cannot be written as asked.
    #[error("{0}")]
    Unsupported(String),
    /// Writing failed (the file system, or reading a source tensor).
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// Where one GGUF tensor's values come from.
#[derive(Debug, Clone)]
enum Origin {
    /// One Hub tensor; `permute_heads` for `q_proj`/`k_proj`.
    Whole {
        src: Source,
        permute_heads: Option<usize>,
    },
    /// Every expert's tensor of one kind, stacked (expert outermost).
    Stacked(Vec<Source>),
    /// As `Stacked`, each expert's in-out block transposed to out-in (DBRX's `w2`).
    StackedTransposed(Vec<Source>),
    /// DeepSeek's `kv_b_proj` `[heads * (nope + v), kv_lora]` split per head as the
    /// converter splits it: `key` gives `attn_k_b`, each head's `nope` key rows transposed
    /// (`[heads, kv_lora, nope]`); else `attn_v_b`, each head's `v` value rows
    /// (`[heads, v, kv_lora]`).
    KvBSplit {
        src: Source,
        heads: usize,
        nope: usize,
        key: bool,
    },
    /// gpt-oss's merged expert tensors, split from the Hub's fused ones ([`gpt_oss`]).
    GptOss(gpt_oss::Experts),
}

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSummary {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data per ggml type name (`Q4_K`, `BF16`, `F32`).
    pub bytes_by_type: Vec<(String, u64)>,
    /// The file's size.
    pub file_bytes: u64,
    /// Tensors whose stored blocks were copied rather than quantised from their values
    /// (a gpt-oss Hub checkpoint's MXFP4 experts written as MXFP4).
    pub copied: usize,
}

/// What a GGUF's tensor table and metadata are read from: a checkpoint folder's card,
/// `config.json`, `tokenizer.json` and `tokenizer_config.json` ([`Inputs::of_checkpoint`]),
/// or a card alone with the Hub config and tokenizer a synthetic checkpoint of it would
/// hold ([`synth`]). The plan and the keys depend on nothing else, so `moec quantize` and
/// `moec synth --gguf` give the same table for the same card and types.
#[derive(Debug, Clone)]
pub(crate) struct Inputs<'a> {
    /// Where the inputs came from, for messages (the folder, or the card).
    origin: String,
    /// The card (dtype, special tokens, stored formats).
    card: &'a ModelCard,
    /// Its architecture.
    arch: &'a ArchSpec,
    /// `config.json`, or why it could not be read (an error only for the families whose
    /// keys are read from it).
    config: Result<serde_json::Value, String>,
    /// Where `config.json` came from, for messages.
    config_origin: String,
    /// `tokenizer.json` (where it came from, and its JSON or why it could not be read),
    /// when there is one.
    tokenizer: Option<(String, Result<serde_json::Value, String>)>,
    /// `tokenizer_config.json` (null without one).
    tokenizer_config: serde_json::Value,
    /// Whether an `lm_head` is stored (else the embedding is tied to it).
    lm_head: bool,
    /// Write a byte-fallback BPE tokenizer as llama.cpp's `llama` vocabulary even for a
    /// family whose converter writes a byte-level (`gpt2`) one: the synthetic files of
    /// cards whose family's own tokenizer is not shipped use a SentencePiece stand-in.
    llama_vocab_stand_in: bool,
}

impl<'a> Inputs<'a> {
    /// The inputs of a checkpoint folder.
    fn of_checkpoint(ckpt: &'a Checkpoint) -> Self {
        let read = |name: &str| -> Option<serde_json::Value> {
            std::fs::read_to_string(ckpt.dir().join(name))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
        };
        let config_path = ckpt.dir().join("config.json");
        let config = std::fs::read_to_string(&config_path)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()));
        let tokenizer = ckpt.tokenizer_path().map(|path| {
            let json = std::fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()));
            (path, json)
        });
        Inputs {
            origin: ckpt.dir().display().to_string(),
            card: ckpt.card(),
            arch: ckpt.arch(),
            config,
            config_origin: config_path.display().to_string(),
            tokenizer: tokenizer.map(|(path, json)| (path.display().to_string(), json)),
            tokenizer_config: read("tokenizer_config.json").unwrap_or_default(),
            lm_head: ckpt.tensor_names().any(|n| n == "lm_head.weight"),
            llama_vocab_stand_in: false,
        }
    }
}

/// A GGUF's plan: its metadata, its tensor table with each tensor's type (by the one set
/// of rules: the classes' formats or a [`Mix`], [`plan`] and [`apply_mix`]), and where
/// each tensor's values come from.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// The metadata keys in order.
    metadata: Vec<(String, MetaValue)>,
    /// The tensor table in order.
    entries: Vec<TensorEntry>,
    /// Each entry's origin.
    origins: Vec<Origin>,
}

/// The plan of the GGUF of `inputs` with `types`, `name` its `general.name`: every tensor's
/// name, dims and type, checked to be whole blocks, and the metadata.
fn layout(inputs: &Inputs<'_>, types: &Types, name: &str) -> Result<Layout, ExportError> {
    let arch = inputs.arch;
    let card = inputs.card;
    let table = gguf_family(arch.family);
    let arch_name = table.arch;
    let floats = WeightFormats::default();
    let formats = match types {
        Types::Classes(formats) => formats,
        Types::Mix(_) => &floats,
    };
    let stored;
    let formats = if table.gpt_oss_experts {
        stored = gpt_oss::keep_stored_experts(card, formats);
        &stored
    } else {
        formats
    };
    // gpt-oss's experts are written out-in whatever the Hub's order ([`gpt_oss`]), and
    // so is DBRX's down projection ([`dbrx::as_stored`]).
    let mut written = dbrx::as_stored(arch);
    written.experts_out_in |= table.gpt_oss_experts;
    if let Err(e) = formats.check(&written, card.dtype) {
        return Err(ExportError::Unsupported(e));
    }
    let (mut entries, origins) = plan(inputs, formats)?;
    let file_type = match types {
        Types::Classes(_) if table.gpt_oss_experts => gpt_oss::file_type(formats, card.dtype),
        Types::Classes(formats) => {
            file_type(formats.storage(card.dtype, WeightTensor::layer(SegmentKind::ExpertGate(0))))
        }
        Types::Mix(mix) => {
            apply_mix(arch, *mix, &mut entries)?;
            mix.file_type()
        }
    };
    check_blocks(&entries)?;
    let llama_vocab = |inputs: &Inputs<'_>| {
        inputs.llama_vocab_stand_in
            && inputs
                .tokenizer
                .as_ref()
                .and_then(|(_, json)| json.as_ref().ok())
                .is_some_and(|json| json["model"]["byte_fallback"].as_bool() == Some(true))
    };
    let vocab = |inputs: &Inputs<'_>| {
        if llama_vocab(inputs) {
            metadata::vocab_metadata(inputs, arch.vocab)
        } else {
            gpt2::gpt2_vocab(inputs, arch.vocab)
        }
    };
    let metadata = match table.keys {
        GgufKeys::Llama => {
            let mut m = metadata::arch_metadata(arch, name, file_type);
            m.extend(metadata::vocab_metadata(inputs, arch.vocab)?);
            m
        }
        GgufKeys::Dbrx => {
            let mut m = dbrx::metadata(arch, name, file_type)?;
            m.extend(vocab(inputs)?);
            m
        }
        GgufKeys::Text => {
            let mut m = metadata::text_metadata(inputs, arch_name, arch.family, name, file_type)?;
            m.extend(vocab(inputs)?);
            m
        }
    };
    Ok(Layout {
        metadata,
        entries,
        origins,
    })
}

/// Bytes per ggml type name over `entries`, in the order the types first appear.
fn bytes_by_type(entries: &[TensorEntry]) -> Vec<(String, u64)> {
    let mut by_type: Vec<(String, u64)> = Vec::new();
    for entry in entries {
        let ty = type_name(entry.ggml_type);
        let bytes = entry.bytes().unwrap_or(0);
        match by_type.iter_mut().find(|(t, _)| *t == ty) {
            Some((_, b)) => *b += bytes,
            None => by_type.push((ty, bytes)),
        }
    }
    by_type
}

/// The ggml type a tensor of `storage` is written as (vectors always f32, as the converter
/// writes norms).
fn ggml_type(storage: Storage, vector: bool) -> u32 {
    if vector {
        GGML_F32
    } else {
        storage.ggml().id
    }
}

fn type_name(id: u32) -> String {
    Storage::from_ggml_type(id).map_or_else(|| format!("type {id}"), |s| s.name().to_string())
}

/// llama.cpp's `general.file_type` (`llama_ftype`) for a file whose experts are stored as
/// `storage`: the "mostly" type its largest class has.
fn file_type(storage: Storage) -> u32 {
    storage.ggml().file_type
}

/// The converter's row order for `q_proj`/`k_proj` (rows of `cols` values), by
/// [`crate::weights::gguf::llama::converter_row_order`], the order the reader undoes.
fn permute_rows(values: &[f32], heads: usize, cols: usize) -> Option<Vec<f32>> {
    let rows = values.len().checked_div(cols)?;
    let mut out = vec![0.0; values.len()];
    for (hub, stored) in crate::weights::gguf::llama::converter_row_order(rows, heads)? {
        out[stored * cols..(stored + 1) * cols]
            .copy_from_slice(&values[hub * cols..(hub + 1) * cols]);
    }
    Some(out)
}

/// The tensor table and each tensor's origin, in the converter's order (head tensors, then
/// each layer's).
fn plan(
    inputs: &Inputs<'_>,
    formats: &WeightFormats,
) -> Result<(Vec<TensorEntry>, Vec<Origin>), ExportError> {
    let arch = inputs.arch;
    let dtype = inputs.card.dtype;
    let (d, e, vocab) = (arch.hidden, arch.experts, arch.vocab);
    let mut entries = Vec::new();
    let mut origins = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, tensor: WeightTensor, origin: Origin| {
        // llama-quantize keeps the router in f32 unless told otherwise: routing is where a
        // rounding error changes which experts run.
        let storage = match tensor.class() {
            WeightClass::Router if !formats.classes.contains_key(&WeightClass::Router) => {
                Storage::Float(WeightDtype::F32)
            }
            _ => formats.storage(dtype, tensor),
        };
        // A 1-D tensor is f32 whatever its class: the converter writes them so and
        // llama-quantize quantises only matrices.
        let vector = tensor.is_vector() || dims.len() == 1;
        entries.push(TensorEntry {
            ggml_type: ggml_type(storage, vector),
            name,
            dims,
        });
        origins.push(origin);
        Ok::<(), ExportError>(())
    };
    let whole = |name: &str, shape: Vec<usize>| Origin::Whole {
        src: Source {
            name: name.into(),
            rows: 0..shape.first().copied().unwrap_or(1),
            shape,
        },
        permute_heads: None,
    };
    let (embed, norm) = head_names(arch.family);
    add(
        "token_embd.weight".into(),
        vec![d as u64, vocab as u64],
        WeightTensor::Embed,
        whole(embed, vec![vocab, d]),
    )?;
    add(
        "output_norm.weight".into(),
        vec![d as u64],
        WeightTensor::FinalNorm,
        whole(norm, vec![d]),
    )?;
    if inputs.lm_head {
        add(
            "output.weight".into(),
            vec![d as u64, vocab as u64],
            WeightTensor::LmHead,
            whole("lm_head.weight", vec![vocab, d]),
        )?;
    }
    for layer in 0..arch.layers {
        // Merged expert tensors in the order their first expert appears, each expert's
        // rows at its index.
        let mut stacks: Vec<(String, SegmentKind, Vec<Option<Source>>)> = Vec::new();
        for kind in LayerLayout::kinds(arch, layer) {
            let src = segment_source(arch, layer, kind);
            let dims: Vec<u64> = src.shape.iter().rev().map(|&x| x as u64).collect();
            let tensor = WeightTensor::layer(kind);
            if let Some(merged) = gpt_oss_experts(arch, layer, kind) {
                for (name, dims, origin) in merged {
                    add(name, dims, tensor, origin)?;
                }
                continue;
            }
            match place(arch, layer, kind) {
                Some(Place::Whole(name, permute_heads)) => {
                    // The converter squeezes Qwen2-MoE's `[1, hidden]` shared-expert gate
                    // to a vector.
                    let dims = if kind == SegmentKind::SharedExpertGate {
                        dims.into_iter().filter(|&x| x != 1).collect()
                    } else {
                        dims
                    };
                    add(name, dims, tensor, Origin::Whole { src, permute_heads })?;
                }
                Some(Place::Expert(name, x, _, _)) => {
                    let at = match stacks.iter().position(|(n, _, _)| *n == name) {
                        Some(at) => at,
                        None => {
                            stacks.push((name, kind, vec![None; e]));
                            stacks.len() - 1
                        }
                    };
                    if let Some(slot) = stacks[at].2.get_mut(x) {
                        *slot = Some(src);
                    }
                }
                Some(Place::KvB) => {
                    let Some(m) = arch.mla else {
                        return Err(ExportError::Unsupported(format!(
                            "layer {layer}: a `kv_b_proj` without MLA hyper-parameters"
                        )));
                    };
                    let (heads, r) = (arch.attn.heads, m.kv_lora_rank as usize);
                    let (nope, v) = (m.qk_nope_head_dim as usize, m.v_head_dim as usize);
                    let key = kind == SegmentKind::KvB;
                    let (name, dims) = if key {
                        (format!("blk.{layer}.attn_k_b.weight"), [nope, r, heads])
                    } else {
                        (format!("blk.{layer}.attn_v_b.weight"), [r, v, heads])
                    };
                    let origin = Origin::KvBSplit {
                        src,
                        heads,
                        nope,
                        key,
                    };
                    add(name, dims.map(|x| x as u64).to_vec(), tensor, origin)?;
                }
                _ => {
                    return Err(ExportError::Unsupported(format!(
                        "layer {layer}: moec quantize does not write the {kind:?} segment as \
                         llama.cpp's converter does"
                    )))
                }
            }
        }
        for (name, kind, sources) in stacks {
            let sources: Option<Vec<Source>> = sources.into_iter().collect();
            let Some(sources) = sources else {
                return Err(ExportError::Unsupported(format!(
                    "layer {layer}: `{name}` lacks some of the card's {e} experts"
                )));
            };
            // An expert's block of rows (DBRX's of a fused tensor), out-in in the file.
            let (_, cols, orientation) = LayerLayout::shape_of(arch, kind);
            let rows = sources[0].rows.len();
            let (dims, origin) = if orientation == Some(Orientation::InOut) {
                (vec![rows, cols, e], Origin::StackedTransposed(sources))
            } else {
                (vec![cols, rows, e], Origin::Stacked(sources))
            };
            let dims = dims.into_iter().map(|x| x as u64).collect();
            add(name, dims, WeightTensor::layer(kind), origin)?;
        }
    }
    Ok((entries, origins))
}

/// gpt-oss's merged expert tensors for segment `kind` ([`gpt_oss::expert_tensors`]);
/// `None` for the other families and kinds.
fn gpt_oss_experts(
    arch: &ArchSpec,
    layer: usize,
    kind: SegmentKind,
) -> Option<Vec<(String, Vec<u64>, Origin)>> {
    gguf_family(arch.family)
        .gpt_oss_experts
        .then(|| gpt_oss::expert_tensors(arch, layer, kind))
        .flatten()
}

/// Every entry's size, or an error naming the first whose rows are not whole blocks of
/// its type.
fn check_blocks(entries: &[TensorEntry]) -> Result<(), ExportError> {
    match entries.iter().find(|e| e.bytes().is_none()) {
        None => Ok(()),
        Some(entry) => Err(ExportError::Unsupported(format!(
            "tensor `{}`: rows of {} values are not whole {} blocks; keep its class in a \
             float format",
            entry.name,
            entry.dims.first().copied().unwrap_or(0),
            type_name(entry.ggml_type)
        ))),
    }
}

/// Retypes `entries` by `mix`'s rules (the tensors llama-quantize does not quantise keep
/// theirs).
fn apply_mix(arch: &ArchSpec, mix: Mix, entries: &mut [TensorEntry]) -> Result<(), ExportError> {
    let table: Vec<(&str, &[u64])> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.dims.as_slice()))
        .collect();
    let model = mix::MixModel {
        experts: arch.experts,
        layers: arch.layers,
    };
    let types = mix::mix_types(mix, model, &table).map_err(ExportError::Unsupported)?;
    for (entry, ty) in entries.iter_mut().zip(types) {
        if let Some(storage) = ty {
            entry.ggml_type = ggml_type(storage, false);
        }
    }
    Ok(())
}

/// The values of one tensor in GGUF order (stacked, rows permuted where the converter
/// permutes them).
fn values(ckpt: &Checkpoint, origin: &Origin, name: &str) -> Result<Vec<f32>, WriteError> {
    let read = |src: &Source| {
        ckpt.source_f32(src)
            .map_err(|e| WriteError::Source(format!("reading `{}` for `{name}`: {e}", src.name)))
    };
    match origin {
        Origin::Whole { src, permute_heads } => {
            let v = read(src)?;
            match permute_heads {
                None => Ok(v),
                Some(heads) => {
                    let cols = src.shape.last().copied().unwrap_or(1);
                    permute_rows(&v, *heads, cols).ok_or_else(|| WriteError::Tensor {
                        tensor: name.into(),
                        message: format!("its rows do not split into {heads} heads of pairs"),
                    })
                }
            }
        }
        Origin::Stacked(sources) => {
            let mut out = Vec::new();
            for src in sources {
                out.extend(read(src)?);
            }
            Ok(out)
        }
        Origin::StackedTransposed(sources) => {
            let mut out = Vec::new();
            for src in sources {
                let (rows, v) = (src.rows.len(), read(src)?);
                let cols = v.len().checked_div(rows).unwrap_or(0);
                out.extend(
                    crate::model::layout::transpose(&v, rows, cols).ok_or_else(|| {
                        WriteError::Tensor {
                            tensor: name.into(),
                            message: format!("`{}` is not {rows} whole rows", src.name),
                        }
                    })?,
                );
            }
            Ok(out)
        }
        Origin::KvBSplit {
            src,
            heads,
            nope,
            key,
        } => {
            let kv = read(src)?;
            let (rows, cols) = (src.shape[0], src.shape.get(1).copied().unwrap_or(1));
            let per_head = rows / heads.max(&1);
            let v = per_head.saturating_sub(*nope);
            if per_head * heads != rows || kv.len() != rows * cols {
                return Err(WriteError::Tensor {
                    tensor: name.into(),
                    message: format!(
                        "`{}`'s {rows} rows do not split into {heads} heads",
                        src.name
                    ),
                });
            }
            let mut out = Vec::with_capacity(kv.len());
            for h in 0..*heads {
                let head = &kv[h * per_head * cols..(h + 1) * per_head * cols];
                if *key {
                    for c in 0..cols {
                        out.extend((0..*nope).map(|r| head[r * cols + c]));
                    }
                } else {
                    out.extend_from_slice(&head[nope * cols..(nope + v) * cols]);
                }
            }
            Ok(out)
        }
        Origin::GptOss(experts) => gpt_oss::values(ckpt, experts, name),
    }
}

fn encode(values: &[f32], ggml_type: u32, name: &str) -> Result<Vec<u8>, WriteError> {
    let storage = Storage::from_ggml_type(ggml_type).ok_or_else(|| WriteError::Tensor {
        tensor: name.into(),
        message: format!("ggml type {ggml_type} is not one moec writes"),
    })?;
    let format = match storage {
        Storage::Float(dtype) => {
            let mut out = Vec::with_capacity(values.len() * dtype.bytes() as usize);
            for &v in values {
                crate::weights::synth::encode(v, dtype, &mut out);
            }
            return Ok(out);
        }
        Storage::Quant(format) => format,
    };
    // Blocks are quantised independently: pieces of whole blocks are encoded on every core
    // and joined in order, the same bytes as one pass gives.
    let piece = format.block_elems() * ENCODE_PIECE_BLOCKS;
    let pieces: Vec<Vec<u8>> = values
        .par_chunks(piece)
        .map(|chunk| quantize_row(format, chunk))
        .collect::<Result<_, _>>()
        .map_err(|e| WriteError::Tensor {
            tensor: name.into(),
            message: e.to_string(),
        })?;
    Ok(pieces.concat())
}

/// Blocks per piece encoded on one core (a few hundred kB of f32 in, enough to keep each
/// task's start-up negligible).
const ENCODE_PIECE_BLOCKS: usize = 512;

/// Drops the mapped pages of the checkpoint tensors `origin` read from this process's
/// resident memory ([`Checkpoint::release_source`]), once its GGUF tensor is written: a
/// checkpoint is read once, front to back, so without this `moec quantize` would end up
/// holding the whole mapped checkpoint resident (14.1 GB for 12.1 GB of bf16 input).
fn release(ckpt: &Checkpoint, origin: &Origin) {
    match origin {
        Origin::Whole { src, .. } | Origin::KvBSplit { src, .. } => ckpt.release_source(src),
        Origin::Stacked(sources) | Origin::StackedTransposed(sources) => {
            sources.iter().for_each(|src| ckpt.release_source(src));
        }
        Origin::GptOss(experts) => ckpt.release_source(&gpt_oss::hub_source(ckpt.arch(), experts)),
    }
}

/// Writes `ckpt` to `out` as a llama.cpp GGUF with `formats` per class; `progress` hears
/// each tensor's name as it is written.
pub fn export(
    ckpt: &Checkpoint,
    types: &Types,
    name: &str,
    out: &Path,
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<ExportSummary, ExportError> {
    let Layout {
        metadata,
        entries,
        origins,
    } = layout(&Inputs::of_checkpoint(ckpt), types, name)?;
    let total = entries.len();
    let mut copied = 0;
    write_gguf(out, &metadata, &entries, |i| {
        let entry = &entries[i];
        progress(i, total, &entry.name);
        if let Origin::GptOss(experts) = &origins[i] {
            if let Some(blocks) = gpt_oss::packed(ckpt, experts, entry.ggml_type, &entry.name)? {
                copied += 1;
                return Ok(blocks);
            }
        }
        let v = values(ckpt, &origins[i], &entry.name)?;
        release(ckpt, &origins[i]);
        encode(&v, entry.ggml_type, &entry.name)
    })?;
    let by_type = bytes_by_type(&entries);
    let file_bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(ExportSummary {
        tensors: total,
        bytes_by_type: by_type,
        file_bytes,
        copied,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_is_the_inverse_of_the_readers_unpermute() {
        let (heads, rows, cols) = (2usize, 8usize, 3usize);
        let v: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let p = permute_rows(&v, heads, cols).unwrap();
        let bytes: Vec<u8> = p.iter().flat_map(|x| x.to_le_bytes()).collect();
        let back = crate::weights::gguf::llama::unpermute_rows(&bytes, heads, cols * 4).unwrap();
        let back: Vec<f32> = back
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, v);
        // Head 0's rows are [0, 1, 2, 3] (half 0: 0, 1; half 1: 2, 3): stored 0, 2, 1, 3.
        assert_eq!(
            &p[..cols * 4],
            &[0., 1., 2., 6., 7., 8., 3., 4., 5., 9., 10., 11.]
        );
    }
}
