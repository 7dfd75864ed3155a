//! Resolving what the user asked for (`--model CARD`, `--weights DIR`, both, or neither)
//! into a loaded model: checkpoint, card and tokenizer.
//!
//! Takes a [`ModelSource`]; gives a [`LoadedModel`]. With a weights folder the
//! architecture comes from its config.json (checked against the card when one is named).
//! Without one, a deterministic synthetic checkpoint of the card (default `mixtral-tiny`)
//! is generated on first use into the cache folder (`$MOEC_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/moec`, else `~/.cache/moec`), atomically, keyed by card contents,
//! seed, dtype and format version. Nothing is ever downloaded. Every command that takes a
//! model (`generate`, `run`, ...) should resolve it here.

use crate::model::card::ModelCard;
use crate::model::cards::CardError;
use crate::quant::storage::WeightDtype;
use crate::weights::checkpoint::{Checkpoint, CheckpointError};
use crate::weights::synth::{write_checkpoint, SynthError, SynthOptions};
use crate::weights::tokenizer::{TextTokenizer, TokenizerError};
use std::path::{Path, PathBuf};

/// The card used when neither `--model` nor `--weights` is given.
pub const DEFAULT_CARD: &str = "mixtral-tiny";

/// Bump when the synthetic writer's output changes, so stale caches are not reused.
pub const SYNTH_FORMAT_VERSION: u32 = 1;

/// Largest checkpoint moec will synthesize implicitly (bytes); real-size cards need
/// `--weights` (or an explicit `moec synth`).
pub const MAX_IMPLICIT_SYNTH_BYTES: u64 = 4 << 30;

/// What the user named.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelSource {
    /// `--model`: a built-in card name or a `.ron` path.
    pub card: Option<String>,
    /// `--weights`: a Hugging Face checkpoint folder.
    pub weights: Option<PathBuf>,
}

/// Problems resolving a model.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The card is unknown or malformed.
    #[error(transparent)]
    Card(#[from] CardError),
    /// The checkpoint is unusable.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Writing the synthetic checkpoint failed.
    #[error(transparent)]
    Synth(#[from] SynthError),
    /// The tokenizer could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The card is too large to synthesize implicitly.
    #[error("card `{card}` has {gib:.1} GiB of weights; pass --weights DIR with a downloaded checkpoint (or run `moec synth` explicitly)")]
    TooLarge {
        /// Card name.
        card: String,
        /// Its size.
        gib: f64,
    },
    /// No cache folder could be determined or created.
    #[error("cannot use cache folder {path}: {message}")]
    Cache {
        /// The folder.
        path: String,
        /// The underlying cause, as the library or the OS reported it.
        message: String,
    },
}

/// A model ready to run.
#[derive(Debug)]
pub struct LoadedModel {
    /// The memory-mapped checkpoint (its card is the architecture).
    pub checkpoint: Checkpoint,
    /// Text codec.
    pub tokenizer: TextTokenizer,
    /// True when the weights are a synthetic checkpoint from the cache.
    pub synthetic: bool,
    /// Wall seconds the checkpoint took to open (its index read, its files mapped, a
    /// synthetic one written first where the cache had none); the rest of
    /// [`load_model`] is the tokenizer.
    pub open_seconds: f64,
}

/// The cache folder for synthetic checkpoints.
pub fn cache_dir() -> Result<PathBuf, SourceError> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = env("MOEC_CACHE_DIR") {
        return Ok(dir);
    }
    if let Some(dir) = env("XDG_CACHE_HOME") {
        return Ok(dir.join("moec"));
    }
    if let Some(home) = env("HOME") {
        return Ok(home.join(".cache").join("moec"));
    }
    Err(SourceError::Cache {
        path: "~/.cache/moec".into(),
        message: "set MOEC_CACHE_DIR or HOME".into(),
    })
}

fn dtype_tag(d: WeightDtype) -> &'static str {
    match d {
        WeightDtype::Bf16 => "bf16",
        WeightDtype::F16 => "f16",
        WeightDtype::F32 => "f32",
    }
}

/// The synthetic checkpoint folder of `card` in the cache, generating it if needed.
pub fn ensure_synthetic(
    card: &ModelCard,
    seed: u64,
    dtype: WeightDtype,
) -> Result<PathBuf, SourceError> {
    let bytes = card.total_params() * dtype.bytes();
    if bytes > MAX_IMPLICIT_SYNTH_BYTES {
        return Err(SourceError::TooLarge {
            card: card.name.clone(),
            gib: bytes as f64 / (1u64 << 30) as f64,
        });
    }
    let ron = ron::to_string(card).unwrap_or_default();
    let digest = ron.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let key = format!(
        "{}-seed{seed}-{}-v{SYNTH_FORMAT_VERSION}-{:08x}",
        card.name,
        dtype_tag(dtype),
        digest as u32
    );
    let dir = cache_dir()?.join("synthetic").join(key);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let opts = SynthOptions {
        seed,
        dtype,
        ..SynthOptions::default()
    };
    match write_checkpoint(card, &dir, &opts) {
        Ok(()) => Ok(dir),
        // Another process won the race and renamed its copy into place first.
        Err(_) if dir.join("config.json").is_file() => Ok(dir),
        Err(e) => Err(e.into()),
    }
}

/// Loads the model `source` names.
pub fn load_model(source: &ModelSource) -> Result<LoadedModel, SourceError> {
    let opening = std::time::Instant::now();
    let mut card = source.card.as_deref().map(ModelCard::load).transpose()?;
    let (dir, synthetic): (PathBuf, bool) = match &source.weights {
        Some(dir) => (dir.clone(), false),
        None => {
            let chosen = match card.take() {
                Some(c) => c,
                None => ModelCard::load(DEFAULT_CARD)?,
            };
            let dir = ensure_synthetic(&chosen, 0, chosen.dtype)?;
            card = Some(chosen);
            (dir, true)
        }
    };
    // A `.gguf` file is llama.cpp's checkpoint; its tokenizer is the vocabulary it
    // carries where moec reads that kind, else the family's embedded one, which the
    // tokenizer's origin line says.
    let checkpoint = if dir.is_file() && dir.extension().is_some_and(|e| e == "gguf") {
        Checkpoint::open_gguf(&dir, card.as_ref())?
    } else {
        Checkpoint::open_with_card(&dir, card.as_ref())?
    };
    let open_seconds = opening.elapsed().as_secs_f64();
    let tokenizer = TextTokenizer::load(checkpoint.card(), Some(Path::new(&dir)))?;
    Ok(LoadedModel {
        checkpoint,
        tokenizer,
        synthetic,
        open_seconds,
    })
}
