//! Hugging Face checkpoint folders, memory-mapped.
//!
//! Takes a folder holding `config.json` and either `model.safetensors` or shards listed
//! by `model.safetensors.index.json`; gives the card (from config.json, or checked
//! against a chosen card), typed zero-copy views of every tensor (bf16, f16, f32), the
//! model's [`ModelWeights`] with each family's Hub names, and byte copies of a layer
//! into the canonical packed image ([`LayerLayout`]). A missing tensor, a wrong shape or
//! dtype, a layer tensor whose dtype differs from the other layers', a truncated or corrupt
//! file, or a bad config is an error naming the file and the tensor; nothing panics. One
//! validation for every reader: the oracle's typed views and the runtime's images accept
//! the same checkpoints (a tensor stored at an odd offset is copied aligned for both). A
//! gpt-oss checkpoint whose config says `quant_method: mxfp4` stores its expert tensors as
//! U8 `_blocks` / `_scales` pairs: both are checked at open, and the experts stay MXFP4:
//! every reader sees ggml's `block_mxfp4` rows (the same codes under the same exponents,
//! `mxfp4::repack_ggml`), stored out-in (`ClampedSwiglu::experts_out_in`), repacked once
//! per tensor on first use into an owned buffer that every reader shares, after which the
//! Hub's pages are released from the process's resident memory; the card's formats say the
//! experts are MXFP4, so budgets, images and the cost model count MXFP4's bytes, and
//! [`Checkpoint::storage_note`] and [`Checkpoint::decoded_bytes`] say so.

mod views;

use crate::model::arch::ArchSpec;
use crate::model::card::{HeldBytes, ModelCard};
use crate::model::formats::WeightTensor;
use crate::model::layout::{ImageBuffer, LayerLayout};
use crate::model::segment::SegmentKind;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::quant::QuantFormat;
use crate::weights::config::{self, ConfigError};
use crate::weights::family::hub::Source;
use crate::weights::gguf::GgufError;
use crate::weights::names::{head_names, segment_source};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensorError};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Problems opening or reading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// config.json is unreadable, malformed, or contradicts the card.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A GGUF file is unreadable, malformed, or holds what moec does not read.
    #[error(transparent)]
    Gguf(Box<crate::weights::gguf::GgufError>),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying cause, as the library or the OS reported it.
        source: std::io::Error,
    },
    /// Neither `model.safetensors` nor `model.safetensors.index.json` exists.
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoWeights {
        /// The folder.
        dir: String,
    },
    /// The shard index is malformed.
    #[error("{path}: bad shard index: {message}")]
    Index {
        /// The index file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A safetensors file is truncated or its header is corrupt.
    #[error("{path}: {message}")]
    Safetensors {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor the model needs is absent.
    #[error("{dir}: missing tensor `{tensor}`")]
    MissingTensor {
        /// The folder (or shard named by the index).
        dir: String,
        /// Tensor name.
        tensor: String,
    },
    /// A tensor has the wrong shape.
    #[error("{path}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The file.
        path: String,
        /// Tensor name.
        tensor: String,
        /// Shape the card implies.
        expected: Vec<usize>,
        /// Shape in the file.
        got: Vec<usize>,
    },
    /// A tensor has a dtype moec cannot compute with.
    #[error("{path}: tensor `{tensor}` has dtype {dtype}, expected BF16, F16 or F32")]
    Dtype {
        /// The file.
        path: String,
        /// Tensor name.
        tensor: String,
        /// Dtype in the file.
        dtype: String,
    },
    /// One layer stores a tensor in another dtype than the other layers store it. The
    /// oracle could compute with it, but the runtime's layer images share one layout across
    /// layers, so both refuse it (one rule for `generate`, `run` and `ablate`).
    #[error(
        "{path}: tensor `{tensor}` is {dtype:?} while the other layers store it as {expected:?}; \
         moec needs each layer tensor in one dtype across layers (convert the checkpoint)"
    )]
    MixedDtype {
        /// The file.
        path: String,
        /// The tensor whose dtype differs from the other layers'.
        tensor: String,
        /// Its dtype.
        dtype: WeightDtype,
        /// The dtype most layers use for it.
        expected: WeightDtype,
    },
    /// An MXFP4 blocks or scales tensor is not stored as U8.
    #[error("{path}: tensor `{tensor}` has dtype {dtype}, expected U8 (MXFP4 blocks and scales)")]
    PackedDtype {
        /// The file.
        path: String,
        /// Tensor name.
        tensor: String,
        /// Dtype in the file.
        dtype: String,
    },
    /// A destination buffer is too small for a layer image.
    #[error("layer image buffer has {got} bytes, layout needs {needed}")]
    ImageBuffer {
        /// Bytes the layer image layout needs.
        needed: usize,
        /// Bytes the destination buffer has.
        got: usize,
    },
    /// A layer index past the model.
    #[error("layer {layer} out of range (model has {layers})")]
    Layer {
        /// The layer asked for.
        layer: usize,
        /// Layers the model has.
        layers: usize,
    },
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

struct Entry {
    shard: usize,
    dtype: Result<WeightDtype, Dtype>,
    shape: Vec<usize>,
    range: Range<usize>,
    /// An aligned copy of the bytes, made on first typed use when the file stores the
    /// tensor at an offset its dtype cannot be read from (safetensors does not promise
    /// alignment). Zero-copy views stay zero-copy for every aligned tensor. For an MXFP4
    /// expert tensor, its ggml block rows, made on first use.
    aligned: OnceLock<ImageBuffer>,
    /// For a gpt-oss expert tensor the checkpoint stores as MXFP4, where its scales are: the
    /// entry's `shard` and `range` are then its Hub blocks, `quant` MXFP4 and `shape`
    /// `[experts, out, in]` (the rows ggml's blocks hold after the repack).
    mxfp4: Option<Mxfp4Scales>,
    /// For a tensor of a GGUF file stored block-quantised, its format (`dtype` is then
    /// f32, what it decodes to).
    quant: Option<QuantFormat>,
    /// For a GGUF `q_proj`/`k_proj`: the head count whose row interleaving the converter
    /// applied; the Hub's row order is restored once, on first use, into `aligned`.
    unpermute_heads: Option<usize>,
    /// The bytes were built at open (a GGUF DeepSeek `kv_b_proj`) and live in `aligned`;
    /// `range` is then only their length, not a place in the map.
    owned: bool,
}

impl Entry {
    /// Bytes of one stored row of `cols` elements in this entry's storage (`None` when a
    /// quantised row is not whole blocks).
    fn row_bytes(&self, cols: usize, dtype: WeightDtype) -> Option<usize> {
        match self.quant {
            Some(format) => format.bytes_for(cols),
            None => Some(cols * dtype.bytes() as usize),
        }
    }
}

/// The scales tensor of an MXFP4 expert tensor (its blocks are the entry's own bytes).
struct Mxfp4Scales {
    shard: usize,
    range: Range<usize>,
}

/// A tensor's bytes exactly as stored in the checkpoint file (inside its memory map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredTensor<'a> {
    /// The bytes (no alignment promised: safetensors normally aligns, but may not).
    pub bytes: &'a [u8],
    /// Stored dtype (f32 for a quantised tensor: what its blocks decode to).
    pub dtype: WeightDtype,
    /// The block format of a quantised tensor.
    pub quant: Option<QuantFormat>,
}

/// The stored bytes of the model's tensors outside the decoder layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadTensors<'a> {
    /// The embedding table `[vocab, hidden]`.
    pub embed: StoredTensor<'a>,
    /// The final norm weight `[hidden]`.
    pub final_norm: StoredTensor<'a>,
    /// The lm_head `[vocab, hidden]` (the embedding's bytes when the checkpoint ties them).
    pub lm_head: StoredTensor<'a>,
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    card: ModelCard,
    arch: ArchSpec,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, Entry>,
    /// The experts are stored as MXFP4 and kept so (repacked into ggml's block rows).
    mxfp4_experts: bool,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("card", &self.card.name)
            .finish()
    }
}

/// A safetensors file to open and, when an index lists them, the tensors it must hold.
type ShardPlan = (PathBuf, Option<BTreeSet<String>>);

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn weight_dtype(d: Dtype) -> Result<WeightDtype, Dtype> {
    match d {
        Dtype::BF16 => Ok(WeightDtype::Bf16),
        Dtype::F16 => Ok(WeightDtype::F16),
        Dtype::F32 => Ok(WeightDtype::F32),
        other => Err(other),
    }
}

fn describe(err: &SafeTensorError, len: usize) -> String {
    match err {
        SafeTensorError::MetadataIncompleteBuffer | SafeTensorError::InvalidHeaderLength => {
            format!(
                "truncated safetensors file ({len} bytes; the header describes more or less data)"
            )
        }
        SafeTensorError::HeaderTooSmall => {
            format!("truncated safetensors file ({len} bytes, no header)")
        }
        other => format!("corrupt safetensors header: {other}"),
    }
}

impl Checkpoint {
    /// Opens `dir`; the architecture comes from its config.json.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        Self::open_with_card(dir, None)
    }

    /// Opens `dir`; with `card`, config.json must describe the same architecture.
    pub fn open_with_card(dir: &Path, card: Option<&ModelCard>) -> Result<Self, CheckpointError> {
        let config_path = dir.join("config.json");
        let text = crate::textfile::read_capped(&config_path, crate::textfile::CONFIG_LIMIT)
            .map_err(io_err(&config_path))?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "checkpoint".into());
        let config_name = config_path.display().to_string();
        let from_config = config::card_from_config(&text, &config_name, &name)?;
        let mut card = match card {
            Some(card) => {
                config::check_agreement(&from_config, card, &config_name)?;
                let mut chosen = card.clone();
                chosen.bos_token_id = from_config.bos_token_id.or(card.bos_token_id);
                chosen.eos_token_id = from_config.eos_token_id;
                chosen.sliding_window = from_config.sliding_window;
                chosen
            }
            None => from_config,
        };
        let shard_paths = Self::shard_paths(dir)?;
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (path, expected) in shard_paths {
            let file = std::fs::File::open(&path).map_err(io_err(&path))?;
            // SAFETY: the map is read-only and private to this process; moec never writes
            // checkpoint files while they are open. Another process truncating or rewriting
            // the file concurrently is outside what we can defend against (as for any mmap
            // reader, e.g. the safetensors crate's own examples).
            let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| {
                    CheckpointError::Safetensors {
                        path: path.display().to_string(),
                        message: describe(&e, mmap.len()),
                    }
                })?;
            let data_start = 8 + header_len;
            for (name, info) in meta.tensors() {
                if let Some(wanted) = &expected {
                    if !wanted.contains(&name) {
                        continue;
                    }
                }
                let (s, e) = info.data_offsets;
                tensors.insert(
                    name,
                    Entry {
                        shard: shards.len(),
                        dtype: weight_dtype(info.dtype),
                        shape: info.shape.clone(),
                        range: data_start + s..data_start + e,
                        aligned: OnceLock::new(),
                        mxfp4: None,
                        quant: None,
                        unpermute_heads: None,
                        owned: false,
                    },
                );
            }
            if let Some(wanted) = expected {
                if let Some(absent) = wanted.iter().find(|n| !tensors.contains_key(*n)) {
                    return Err(CheckpointError::MissingTensor {
                        dir: path.display().to_string(),
                        tensor: absent.clone(),
                    });
                }
            }
            shards.push(Shard { path, mmap });
        }
        let (embed_name, _) = head_names(card.family);
        if let Some(Ok(dtype)) = tensors.get(embed_name).map(|e| e.dtype) {
            card.dtype = dtype;
        }
        let mxfp4_experts = config::experts_in_mxfp4(&text);
        if mxfp4_experts {
            keep_mxfp4(&mut card).map_err(|message| {
                CheckpointError::Config(ConfigError::Invalid {
                    path: config_name.clone(),
                    field: "quantization_config".into(),
                    message: format!("cannot be kept: {message}"),
                })
            })?;
        }
        let arch = ArchSpec::from_card(&card);
        if mxfp4_experts {
            mxfp4_entries(dir, &arch, &shards, &mut tensors)?;
        }
        card.held = held_bytes(&tensors, &card);
        let checkpoint = Checkpoint {
            dir: dir.to_path_buf(),
            card,
            arch,
            shards,
            tensors,
            mxfp4_experts,
        };
        checkpoint.check_layer_dtypes()?;
        Ok(checkpoint)
    }

    /// Opens a llama.cpp GGUF file (`--weights model.gguf`): the architecture from its
    /// metadata, every tensor the family's Hub checkpoint names mapped to its bytes in the
    /// file (merged expert tensors split by rows, `q`/`k` rows put back in the Hub's order
    /// once on first use), quantised tensors viewed as [`TypedSlice::Quant`]. Only the
    /// families [`crate::weights::gguf::llama::import`] reads are accepted; with `card`, the
    /// metadata must describe the same architecture.
    pub fn open_gguf(path: &Path, card: Option<&ModelCard>) -> Result<Self, CheckpointError> {
        let gguf_err = |e: crate::weights::gguf::GgufError| CheckpointError::Gguf(Box::new(e));
        let file = crate::weights::gguf::GgufFile::open(path).map_err(gguf_err)?;
        let name = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "gguf".into());
        let imported = crate::weights::gguf::llama::import(&file, &name).map_err(gguf_err)?;
        let mut chosen = imported.card;
        if let Some(card) = card {
            config::check_agreement(&chosen, card, &path.display().to_string())?;
            let mut c = card.clone();
            c.bos_token_id = chosen.bos_token_id.or(card.bos_token_id);
            c.eos_token_id = chosen.eos_token_id;
            // How the file stores gpt-oss's experts is the file's, not the card's.
            if let (Some(file), Some(chosen)) = (chosen.clamped_swiglu, c.clamped_swiglu.as_mut()) {
                chosen.experts_out_in = file.experts_out_in;
            }
            c.expert_down_out_in = chosen.expert_down_out_in;
            chosen = c;
        }
        let mut tensors = BTreeMap::new();
        for t in imported.tensors {
            let (dtype, quant) = match t.storage {
                Storage::Float(d) => (d, None),
                Storage::Quant(f) => (WeightDtype::F32, Some(f)),
            };
            if let Some(heads) = t.unpermute_heads {
                let rows = t.shape.first().copied().unwrap_or(0);
                if heads == 0 || rows % (2 * heads) != 0 {
                    return Err(CheckpointError::Shape {
                        path: path.display().to_string(),
                        tensor: t.gguf_name,
                        expected: vec![2 * heads, rows / (2 * heads).max(1)],
                        got: t.shape,
                    });
                }
            }
            let owned = t.owned.is_some();
            let aligned = OnceLock::new();
            if let Some(bytes) = t.owned {
                let mut buf = ImageBuffer::zeroed(bytes.len());
                buf.as_bytes_mut().copy_from_slice(&bytes);
                let _ = aligned.set(buf);
            }
            tensors.insert(
                t.name,
                Entry {
                    shard: t.part,
                    dtype: Ok(dtype),
                    shape: t.shape,
                    range: t.range,
                    aligned,
                    mxfp4: None,
                    quant,
                    unpermute_heads: t.unpermute_heads,
                    owned,
                },
            );
        }
        // The card's dtype is what the head computes in: the embedding's float dtype, f32
        // when the embedding is quantised.
        let (embed_name, _) = head_names(chosen.family);
        if let Some(Ok(dtype)) = tensors.get(embed_name).map(|e| e.dtype) {
            chosen.dtype = dtype;
        }
        let arch = ArchSpec::from_card(&chosen);
        chosen.formats = gguf_formats(&arch, chosen.dtype, &tensors);
        chosen
            .formats
            .check(&arch, chosen.dtype)
            .map_err(|message| {
                CheckpointError::Gguf(Box::new(GgufError::Tensor {
                    path: path.display().to_string(),
                    tensor: "(formats)".into(),
                    message,
                }))
            })?;
        let shards: Vec<Shard> = file
            .into_maps()
            .into_iter()
            .map(|(path, mmap)| Shard { path, mmap })
            .collect();
        // The import read some tensors of the map only to build owned copies (gpt-oss's
        // gate and up, put back together): their pages would stay in this process's
        // resident memory beside the copies (6.8 GB of gpt-oss-20b's gate/up, and the
        // CPU backend's tiles of the copies on top). Dropped here (`release_pages`: the
        // bytes stay the file's); whatever is read later faults back in from the page cache.
        for shard in &shards {
            release_pages(&shard.mmap, 0..shard.mmap.len());
        }
        chosen.held = held_bytes(&tensors, &chosen);
        Ok(Checkpoint {
            dir: path.to_path_buf(),
            card: chosen,
            arch,
            shards,
            tensors,
            mxfp4_experts: false,
        })
    }

    /// Refuses a checkpoint where some layer stores a tensor in another dtype than the other
    /// layers do (an f16 `q_proj` among bf16 ones), naming that layer's tensor: the one that
    /// differs from the most common dtype, ties going to the embedding's dtype. Checked at
    /// open so every command that reads weights gives the same answer. Tensors absent or in
    /// dtypes moec cannot compute with are left to the per-tensor errors.
    fn check_layer_dtypes(&self) -> Result<(), CheckpointError> {
        // Every kind some layer has (a dense layer's FFN, a MoE layer's router and
        // experts); a layer without the kind has no tensor of its name.
        let mut kinds = LayerLayout::kinds(&self.arch, 0);
        for kind in LayerLayout::kinds(&self.arch, self.arch.dense_layers) {
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        for kind in kinds {
            let stored: Vec<(Source, WeightDtype, usize)> = (0..self.arch.layers)
                .filter_map(|layer| {
                    let src = self.source(layer, kind);
                    let entry = self.tensors.get(&src.name)?;
                    let dtype = entry.dtype.ok()?;
                    Some((src, dtype, entry.shard))
                })
                .collect();
            let count = |d: WeightDtype| stored.iter().filter(|(_, x, _)| *x == d).count();
            let Some(expected) = stored
                .iter()
                .map(|(_, d, _)| *d)
                .max_by_key(|d| (count(*d), *d == self.card.dtype))
            else {
                continue;
            };
            if let Some((src, dtype, shard)) = stored.iter().find(|(_, d, _)| *d != expected) {
                return Err(CheckpointError::MixedDtype {
                    path: self.shards[*shard].path.display().to_string(),
                    tensor: src.name.clone(),
                    dtype: *dtype,
                    expected,
                });
            }
        }
        Ok(())
    }

    /// The safetensors files and, when sharded, which tensors each must hold.
    fn shard_paths(dir: &Path) -> Result<Vec<ShardPlan>, CheckpointError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = crate::textfile::read_capped(&index, crate::textfile::CONFIG_LIMIT)
                .map_err(io_err(&index))?;
            let bad = |message: String| CheckpointError::Index {
                path: index.display().to_string(),
                message,
            };
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let map = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| bad("no `weight_map` object".into()))?;
            let mut files: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for (tensor, file) in map {
                let file = file
                    .as_str()
                    .ok_or_else(|| bad(format!("`{tensor}` maps to a non-string")))?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(bad(format!(
                        "shard name `{file}` must be a plain file name"
                    )));
                }
                files
                    .entry(file.to_string())
                    .or_default()
                    .insert(tensor.clone());
            }
            Ok(files
                .into_iter()
                .map(|(f, t)| (dir.join(f), Some(t)))
                .collect())
        } else if single.exists() {
            Ok(vec![(single, None)])
        } else {
            Err(CheckpointError::NoWeights {
                dir: dir.display().to_string(),
            })
        }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The architecture (from config.json, or the agreeing card).
    pub fn card(&self) -> &ModelCard {
        &self.card
    }

    /// Kernel-facing architecture.
    pub fn arch(&self) -> &ArchSpec {
        &self.arch
    }

    /// What a user should be told about how the weights were read: for a gpt-oss Hub
    /// checkpoint, that its MXFP4 experts are kept MXFP4 (repacked once, on first use).
    pub fn storage_note(&self) -> Option<&'static str> {
        self.mxfp4_experts
            .then_some(crate::model::family::facts::MXFP4_NOTE)
    }

    /// Bytes of ggml MXFP4 blocks the checkpoint's Hub MXFP4 expert tensors are repacked
    /// into: memory the process allocates (once per tensor, on first use) rather than
    /// maps. 0 without MXFP4 experts.
    pub fn decoded_bytes(&self) -> u64 {
        self.tensors
            .values()
            .filter(|e| e.mxfp4.is_some())
            .filter_map(|e| QuantFormat::Mxfp4.bytes_for(e.shape.iter().product()))
            .map(|b| b as u64)
            .sum()
    }

    /// Whether the bytes of segment `kind` of layer `layer` are a repacking held in memory
    /// (an MXFP4 expert tensor) rather than the file's own bytes in its memory map.
    pub fn segment_is_decoded(&self, layer: usize, kind: SegmentKind) -> bool {
        let name = self.source(layer, kind).name;
        self.tensors.get(&name).is_some_and(|e| e.mxfp4.is_some())
    }

    /// The folder's own `tokenizer.json`, if it has one.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        p.is_file().then_some(p)
    }

    /// The first tensor (by name) stored block-quantised, with its format; `None` for a
    /// checkpoint of plain floats.
    pub fn quantised_tensor(&self) -> Option<(&str, QuantFormat)> {
        self.quantised_tensors().next()
    }

    /// Every tensor stored block-quantised (by name), with its format.
    pub fn quantised_tensors(&self) -> impl Iterator<Item = (&str, QuantFormat)> {
        self.tensors
            .iter()
            .filter_map(|(name, e)| e.quant.map(|f| (name.as_str(), f)))
    }

    /// Bytes of the model's tensors per storage format (`BF16`, `Q4_K`, ...), for what a
    /// GGUF checkpoint holds.
    pub fn bytes_by_format(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for e in self.tensors.values() {
            let name = match (e.quant, e.dtype) {
                (Some(f), _) => f.name().to_string(),
                (None, Ok(d)) => format!("{d:?}").to_uppercase(),
                (None, Err(d)) => format!("{d:?}"),
            };
            *out.entry(name).or_insert(0) += e.range.len() as u64;
        }
        out
    }

    /// The values of `src` as f32 (bf16/f16 widened, quantised blocks decoded), checked
    /// against its shape: what `moec quantize` reads.
    pub fn source_f32(&self, src: &Source) -> Result<Vec<f32>, CheckpointError> {
        let (view, _) = self.view(src)?;
        Ok(view.to_f32_vec())
    }

    /// Drops the mapped pages of `src`'s whole tensor from this process
    /// ([`Self::release_mapped`]): `moec quantize` reads each tensor once.
    pub fn release_source(&self, src: &Source) {
        if let Ok((bytes, _, _)) = self.checked(&src.name, &src.shape) {
            self.release_mapped(bytes);
        }
    }

    /// Names of all tensors.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Bytes (an MXFP4 tensor's ggml blocks), dtype and file of a tensor, with the shape
    /// checked against `shape`.
    fn checked(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&[u8], WeightDtype, &Path), CheckpointError> {
        let (entry, dtype, path) = self.checked_entry(name, shape)?;
        Ok((self.entry_bytes(entry), dtype, path))
    }

    /// The bytes `entry` holds: its memory-mapped range, or for an MXFP4 expert tensor its
    /// ggml block rows, made once on first use (open checked both lengths, so it succeeds).
    fn entry_bytes<'a>(&'a self, entry: &'a Entry) -> &'a [u8] {
        if entry.owned {
            return entry.aligned.get().map_or(&[], ImageBuffer::as_bytes);
        }
        let stored = &self.shards[entry.shard].mmap[entry.range.clone()];
        if let Some(heads) = entry.unpermute_heads {
            return entry
                .aligned
                .get_or_init(|| {
                    let rows = entry.shape.first().copied().unwrap_or(0).max(1);
                    // `open_gguf` checked that the rows split into whole heads of pairs.
                    let mut out = ImageBuffer::zeroed(stored.len());
                    if crate::weights::gguf::llama::unpermute_rows_into(
                        stored,
                        heads,
                        stored.len() / rows,
                        out.as_bytes_mut(),
                    )
                    .is_none()
                    {
                        return ImageBuffer::zeroed(0);
                    }
                    // Every reader now takes the restored rows: the file's pages of them
                    // would otherwise stay resident beside the copy (the Mixtral GGUF's
                    // 445 MB of q/k rows, counted twice in the process's RSS).
                    release_pages(&self.shards[entry.shard].mmap, entry.range.clone());
                    out
                })
                .as_bytes();
        }
        let Some(scales) = &entry.mxfp4 else {
            return stored;
        };
        entry
            .aligned
            .get_or_init(|| {
                let [experts, outputs, inputs] = entry.shape[..] else {
                    return ImageBuffer::zeroed(0);
                };
                let scale_bytes = &self.shards[scales.shard].mmap[scales.range.clone()];
                // `mxfp4_entries` checked the blocks and scales shapes against this one.
                let rows =
                    crate::quant::mxfp4::repack_ggml(stored, scale_bytes, experts, inputs, outputs)
                        .unwrap_or_default();
                let mut out = ImageBuffer::zeroed(rows.len());
                out.as_bytes_mut().copy_from_slice(&rows);
                // Every reader now takes the repacking: the Hub's bytes were read once.
                release_pages(&self.shards[entry.shard].mmap, entry.range.clone());
                release_pages(&self.shards[scales.shard].mmap, scales.range.clone());
                out
            })
            .as_bytes()
    }

    /// The entry, dtype and file of a tensor, with the shape checked against `shape`.
    fn checked_entry(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&Entry, WeightDtype, &Path), CheckpointError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor {
                dir: self.dir.display().to_string(),
                tensor: name.to_string(),
            })?;
        let shard = &self.shards[entry.shard];
        let path = shard.path.display().to_string();
        let dtype = entry.dtype.map_err(|d| CheckpointError::Dtype {
            path: path.clone(),
            tensor: name.into(),
            dtype: format!("{d:?}"),
        })?;
        if entry.shape != shape {
            return Err(CheckpointError::Shape {
                path,
                tensor: name.into(),
                expected: shape.to_vec(),
                got: entry.shape.clone(),
            });
        }
        Ok((entry, dtype, &shard.path))
    }

    /// The bytes of a checked tensor at an address its dtype can be read from: the memory
    /// map itself, or for a tensor stored at an odd offset an aligned copy (made once).
    fn aligned_bytes<'a>(&'a self, name: &str, bytes: &'a [u8], dtype: WeightDtype) -> &'a [u8] {
        let aligned = (bytes.as_ptr() as usize).is_multiple_of(dtype.bytes() as usize);
        match self.tensors.get(name) {
            Some(entry) if !aligned => entry
                .aligned
                .get_or_init(|| {
                    let mut copy = ImageBuffer::zeroed(bytes.len());
                    copy.as_bytes_mut().copy_from_slice(bytes);
                    copy
                })
                .as_bytes(),
            _ => bytes,
        }
    }
}

/// The formats of a GGUF checkpoint's card: for the embedding, final norm, lm_head and
/// every layer tensor kind, the widest storage any layer holds it in (by bytes per row),
/// where that is not the card's `dtype`. Each layer's image reserves that much room for
/// the tensor, so layers whose formats differ (llama.cpp's Q4_K_M keeps `attn_v` and
/// `ffn_down` in Q6_K on some layers) share one geometry.
fn gguf_formats(
    arch: &ArchSpec,
    dtype: WeightDtype,
    tensors: &BTreeMap<String, Entry>,
) -> crate::model::formats::WeightFormats {
    let storage_of = |name: &str| {
        let e = tensors.get(name)?;
        match (e.quant, e.dtype) {
            (Some(f), _) => Some(Storage::Quant(f)),
            (None, Ok(d)) => Some(Storage::Float(d)),
            (None, Err(_)) => None,
        }
    };
    let mut widest: BTreeMap<WeightTensor, (u64, Storage)> = BTreeMap::new();
    let mut note = |tensor: WeightTensor, cols: usize, storage: Option<Storage>| {
        let Some(storage) = storage else { return };
        let bytes = storage.bytes_for(cols as u64).unwrap_or(0);
        let slot = widest.entry(tensor).or_insert((bytes, storage));
        if bytes > slot.0 {
            *slot = (bytes, storage);
        }
    };
    let (embed, norm) = head_names(arch.family);
    note(WeightTensor::Embed, arch.hidden, storage_of(embed));
    note(WeightTensor::FinalNorm, arch.hidden, storage_of(norm));
    note(
        WeightTensor::LmHead,
        arch.hidden,
        storage_of("lm_head.weight"),
    );
    for layer in 0..arch.layers {
        for kind in LayerLayout::kinds(arch, layer) {
            let (_, cols, _) = LayerLayout::shape_of(arch, kind);
            let src = segment_source(arch, layer, kind);
            note(WeightTensor::layer(kind), cols, storage_of(&src.name));
        }
    }
    let mut formats = crate::model::formats::WeightFormats {
        classes: BTreeMap::new(),
        tensors: widest
            .into_iter()
            .filter(|(_, (_, s))| *s != Storage::Float(dtype))
            .map(|(t, (_, s))| (t, s))
            .collect(),
        layers: BTreeMap::new(),
    };
    // Each layer's own format where it is not the slot's, so what counts a layer's bytes
    // (the host budget) counts the file's rather than the widest layer's.
    let mut layers: BTreeMap<u64, BTreeMap<WeightTensor, Storage>> = BTreeMap::new();
    for layer in 0..arch.layers {
        for kind in LayerLayout::kinds(arch, layer) {
            let tensor = WeightTensor::layer(kind);
            let src = segment_source(arch, layer, kind);
            match storage_of(&src.name) {
                Some(own) if own != formats.storage(dtype, tensor) => {
                    layers.entry(layer as u64).or_default().insert(tensor, own);
                }
                _ => {}
            }
        }
    }
    formats.layers = layers;
    formats
}

/// Takes the whole pages inside `range` of `map` out of this process's resident memory
/// (`MADV_DONTNEED`): the packed MXFP4 bytes there were just decoded, and without this
/// they would stay resident beside their bf16 decoding until the process ends. The bytes
/// stay valid (a later read faults the same file bytes back in from the page cache or the
/// disk), so this is only about memory; where the OS refuses, the pages simply stay.
impl Checkpoint {
    /// The file and offset in it that hold `bytes`, when `bytes` lies inside one of the
    /// checkpoint's file maps (a `disk.read` copy reads them from there); `None` for bytes
    /// the checkpoint holds in memory (restored, decoded or repacked tensors).
    pub fn file_of(&self, bytes: &[u8]) -> Option<(&Path, u64)> {
        let at = bytes.as_ptr() as usize;
        self.shards.iter().find_map(|shard| {
            let base = shard.mmap.as_ptr() as usize;
            (at >= base && at + bytes.len() <= base + shard.mmap.len())
                .then(|| (shard.path.as_path(), (at - base) as u64))
        })
    }

    /// Drops from this process the whole pages of the file maps that `bytes` covers, when
    /// `bytes` lies inside one of them (a reader that no longer needs them, such as the
    /// CPU backend once it has repacked a tensor); bytes the checkpoint holds in memory
    /// (restored or decoded tensors) are left alone, as dropping those would zero them.
    ///
    /// The pages are first marked cold (`MADV_COLD`): this reader is done with them, so
    /// under memory pressure the page cache gives them up before the file's pages it has
    /// yet to read (the CPU backend's tiles of DeepSeek-V2-Lite, 13 GiB from a 14 GB file
    /// on a 23 GiB machine, make the kernel evict file pages while the load still reads
    /// them). They stay in the page cache for the next run until memory is short.
    pub fn release_mapped(&self, bytes: &[u8]) {
        let at = bytes.as_ptr() as usize;
        for shard in &self.shards {
            let base = shard.mmap.as_ptr() as usize;
            if at >= base && at + bytes.len() <= base + shard.mmap.len() {
                let range = at - base..at - base + bytes.len();
                mark_cold(&shard.mmap, range.clone());
                release_pages(&shard.mmap, range);
                return;
            }
        }
    }
}

/// What the checkpoint's loader holds in memory rather than mapped, split as the host
/// budget places it: restored `q`/`k` rows and repacked MXFP4 experts by layer (every layer
/// alike), the rest whole.
fn held_bytes(tensors: &BTreeMap<String, Entry>, card: &ModelCard) -> HeldBytes {
    let (mut restored, mut repacked, mut other) = (0u64, 0u64, 0u64);
    for entry in tensors.values() {
        if entry.unpermute_heads.is_some() {
            restored += entry.range.len() as u64;
        } else if entry.owned {
            other += entry.range.len() as u64;
        } else if entry.mxfp4.is_some() {
            repacked += QuantFormat::Mxfp4
                .bytes_for(entry.shape.iter().product())
                .unwrap_or(0) as u64;
        }
    }
    let layers = card.layers.max(1);
    let moe_layers = card.layers.saturating_sub(card.dense_layers).max(1);
    HeldBytes {
        attention: restored / layers,
        experts: repacked / moe_layers,
        other: other + restored % layers + repacked % moe_layers,
    }
}

/// Marks the whole pages of `range` in `map` as the first the page cache gives up under
/// memory pressure (`MADV_COLD`, Linux 5.4+; a hint: refused, nothing changes). Only
/// this process's page-table entries are read: pages other processes map stay as they
/// are.
fn mark_cold(map: &Mmap, range: Range<usize>) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let base = map.as_ptr() as usize;
        let start = (base + range.start).next_multiple_of(PAGE);
        let end = (base + range.end) / PAGE * PAGE;
        if start < end {
            // SAFETY: [start, end) is whole pages inside `map`, a live read-only file
            // mapping of this checkpoint; MADV_COLD only moves those pages to the inactive
            // list (non-destructive: every byte reads the same afterwards).
            let _ =
                unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_COLD) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (map, range);
}

fn release_pages(map: &Mmap, range: Range<usize>) {
    const PAGE: usize = 4096;
    let base = map.as_ptr() as usize;
    let start = (base + range.start).next_multiple_of(PAGE) - base;
    let end = (base + range.end) / PAGE * PAGE - base;
    if start >= end {
        return;
    }
    #[cfg(unix)]
    // SAFETY: `map` is a read-only `MAP_SHARED` mapping of a checkpoint file that moec never
    // writes (the same assumption as the mapping itself, see `Checkpoint::open_with_card`),
    // and `start..end` lies inside it. MADV_DONTNEED on a shared file mapping only drops
    // page-table entries: the next access reads the file's unchanged bytes again, so every
    // slice into the map (including ones other readers hold) keeps seeing the same values.
    let _ = unsafe {
        map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
    };
}

/// Marks `card` (a gpt-oss card whose checkpoint stores its experts as MXFP4) as keeping
/// them so: stored out-in, both expert projections MXFP4 in its formats (what images,
/// budgets, the op catalog and `moec check` count), the description saying so. Refuses,
/// naming the tensor, widths that are not whole 32-weight blocks.
fn keep_mxfp4(card: &mut ModelCard) -> Result<(), String> {
    if let Some(c) = card.clamped_swiglu.as_mut() {
        c.experts_out_in = true;
    }
    for kind in [SegmentKind::ExpertGateUp(0), SegmentKind::ExpertDown(0)] {
        card.formats.tensors.insert(
            WeightTensor::layer(kind),
            Storage::Quant(QuantFormat::Mxfp4),
        );
    }
    card.formats.check(&ArchSpec::from_card(card), card.dtype)?;
    if !card
        .description
        .contains(crate::model::family::facts::MXFP4_NOTE)
    {
        card.description = format!(
            "{}; {}",
            card.description,
            crate::model::family::facts::MXFP4_NOTE
        );
    }
    Ok(())
}

/// Registers, for every layer of an MXFP4 gpt-oss checkpoint (`arch` out-in), an entry
/// under each expert tensor's Hub name (`mlp.experts.gate_up_proj`, `down_proj`) that
/// repacks its `_blocks` / `_scales` pair into ggml block rows, after checking both are U8
/// of the shapes the card implies.
fn mxfp4_entries(
    dir: &Path,
    arch: &ArchSpec,
    shards: &[Shard],
    tensors: &mut BTreeMap<String, Entry>,
) -> Result<(), CheckpointError> {
    // The shard and byte range of packed tensor `name`, checked to be U8 of `shape`.
    let packed = |tensors: &BTreeMap<String, Entry>, name: String, shape: Vec<usize>| {
        let Some(entry) = tensors.get(&name) else {
            return Err(CheckpointError::MissingTensor {
                dir: dir.display().to_string(),
                tensor: name,
            });
        };
        let path = shards[entry.shard].path.display().to_string();
        let dtype = match entry.dtype {
            Err(Dtype::U8) => None,
            Ok(d) => Some(format!("{d:?}")),
            Err(d) => Some(format!("{d:?}")),
        };
        if let Some(dtype) = dtype {
            return Err(CheckpointError::PackedDtype {
                path,
                tensor: name,
                dtype,
            });
        }
        if entry.shape != shape {
            return Err(CheckpointError::Shape {
                path,
                tensor: name,
                expected: shape,
                got: entry.shape.clone(),
            });
        }
        Ok((entry.shard, entry.range.clone()))
    };
    for layer in 0..arch.layers {
        for kind in [SegmentKind::ExpertGateUp(0), SegmentKind::ExpertDown(0)] {
            let src = segment_source(arch, layer, kind);
            let [experts, outputs, inputs] = src.shape[..] else {
                continue;
            };
            let (blocks_shape, scales_shape) =
                crate::quant::mxfp4::packed_shapes(experts, inputs, outputs);
            let (shard, blocks) = packed(tensors, format!("{}_blocks", src.name), blocks_shape)?;
            let (scales_shard, scales) =
                packed(tensors, format!("{}_scales", src.name), scales_shape)?;
            tensors.insert(
                src.name,
                Entry {
                    shard,
                    dtype: Ok(WeightDtype::F32),
                    shape: src.shape,
                    range: blocks,
                    aligned: OnceLock::new(),
                    mxfp4: Some(Mxfp4Scales {
                        shard: scales_shard,
                        range: scales,
                    }),
                    quant: Some(QuantFormat::Mxfp4),
                    unpermute_heads: None,
                    owned: false,
                },
            );
        }
    }
    Ok(())
}
