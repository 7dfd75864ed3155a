//! Text <-> token ids with the `tokenizers` crate.
//!
//! Takes a card and optionally a checkpoint folder; gives a [`TextTokenizer`] from the
//! folder's own `tokenizer.json` when it has one, else from the family's file embedded in
//! the binary (so `moec` runs from any directory); for a GGUF file, from the vocabulary it
//! carries when moec reads that kind ([`TextTokenizer::load_gguf`]). Encoding adds the card's BOS exactly
//! once (Mixtral `<s>`; DBRX adds none); decoding skips special tokens.

use crate::model::card::ModelCard;
use std::path::Path;

/// The Mixtral tokenizer shipped in `models/tokenizers/mixtral/` (see PROVENANCE.md).
pub const MIXTRAL_TOKENIZER_JSON: &[u8] =
    include_bytes!("../../models/tokenizers/mixtral/tokenizer.json");
/// The DBRX (cl100k_base) tokenizer shipped in `models/tokenizers/dbrx/`.
pub const DBRX_TOKENIZER_JSON: &[u8] =
    include_bytes!("../../models/tokenizers/dbrx/tokenizer.json");

/// Problems loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file could not be parsed as a tokenizer.
    #[error("{origin}: cannot load tokenizer: {message}")]
    Load {
        /// File or embedded name.
        origin: String,
        /// Library message.
        message: String,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
}

/// A loaded tokenizer plus the card's BOS rule.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    origin: String,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("origin", &self.origin)
            .finish()
    }
}

/// The embedded tokenizer.json bytes for a card: the one its `tokenizer` path names,
/// else its family's stand-in (`FamilyFacts::tokenizer`; a checkpoint folder's own
/// tokenizer.json always wins, see `TextTokenizer::load`).
pub fn embedded_tokenizer_json(card: &ModelCard) -> &'static [u8] {
    let shipped = |path: &str| {
        if path.contains("dbrx") {
            Some(DBRX_TOKENIZER_JSON)
        } else if path.contains("mixtral") {
            Some(MIXTRAL_TOKENIZER_JSON)
        } else {
            None
        }
    };
    shipped(&card.tokenizer)
        .or_else(|| shipped(card.family.facts().tokenizer))
        .unwrap_or(DBRX_TOKENIZER_JSON)
}

impl TextTokenizer {
    /// The folder's `tokenizer.json` if present, else the card's embedded one; for a
    /// `.gguf` file in place of a folder, [`TextTokenizer::load_gguf`].
    pub fn load(card: &ModelCard, dir: Option<&Path>) -> Result<Self, TokenizerError> {
        if let Some(file) =
            dir.filter(|d| d.is_file() && d.extension().is_some_and(|e| e == "gguf"))
        {
            return Self::load_gguf(card, file);
        }
        let own = dir
            .map(|d| d.join("tokenizer.json"))
            .filter(|p| p.is_file());
        let (inner, origin) = match own {
            Some(path) => {
                let origin = path.display().to_string();
                let t =
                    tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
                        origin: origin.clone(),
                        message: e.to_string(),
                    })?;
                (t, origin)
            }
            None => {
                let origin = match dir {
                    Some(d) => format!(
                        "embedded {} ({} has no tokenizer.json)",
                        card.tokenizer,
                        d.display()
                    ),
                    None => format!("embedded {}", card.tokenizer),
                };
                let t = tokenizers::Tokenizer::from_bytes(embedded_tokenizer_json(card)).map_err(
                    |e| TokenizerError::Load {
                        origin: origin.clone(),
                        message: e.to_string(),
                    },
                )?;
                (t, origin)
            }
        };
        Ok(TextTokenizer {
            inner,
            bos: card.bos_token_id,
            origin,
        })
    }

    /// The tokenizer of a llama.cpp GGUF file: its own vocabulary when moec builds one from
    /// it (see [`crate::weights::gguf::vocab`]), else the card's embedded one, the origin
    /// saying which and why. A vocabulary that contradicts itself is an error.
    pub fn load_gguf(card: &ModelCard, path: &Path) -> Result<Self, TokenizerError> {
        let load_err = |message: String| TokenizerError::Load {
            origin: path.display().to_string(),
            message,
        };
        let file =
            crate::weights::gguf::GgufFile::open(path).map_err(|e| load_err(e.to_string()))?;
        match crate::weights::gguf::vocab::tokenizer_json(&file)
            .map_err(|e| load_err(e.to_string()))?
        {
            Ok((json, origin)) => {
                let inner = tokenizers::Tokenizer::from_bytes(&json)
                    .map_err(|e| load_err(format!("its vocabulary: {e}")))?;
                Ok(TextTokenizer {
                    inner,
                    bos: card.bos_token_id,
                    origin,
                })
            }
            Err(reason) => {
                let origin = format!("embedded {} ({}: {reason})", card.tokenizer, path.display());
                let inner = tokenizers::Tokenizer::from_bytes(embedded_tokenizer_json(card))
                    .map_err(|e| TokenizerError::Load {
                        origin: origin.clone(),
                        message: e.to_string(),
                    })?;
                Ok(TextTokenizer {
                    inner,
                    bos: card.bos_token_id,
                    origin,
                })
            }
        }
    }

    /// The tokenizer as `tokenizer.json` text (a grammar-constrained sampler reads each
    /// token's bytes from it).
    pub fn to_json(&self) -> Result<String, String> {
        self.inner.to_string(false).map_err(|e| e.to_string())
    }

    /// Where the tokenizer came from (file path or "embedded ...").
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Token ids of `text`, with the BOS token first when the card uses one.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if let Some(bos) = self.bos {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Text that `generated` adds after `prompt` (decoded in context, so a leading space
    /// that SentencePiece would drop at the start of a text is kept).
    pub fn decode_continuation(
        &self,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<String, TokenizerError> {
        let head = self.decode(prompt)?;
        let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
        let full = self.decode(&all)?;
        match full.strip_prefix(&head) {
            Some(rest) => Ok(rest.to_string()),
            None => self.decode(generated),
        }
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }
}
