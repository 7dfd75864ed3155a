//! Text <-> token ids with the `tokenizers` crate.
//!
//! Takes a card and optionally a checkpoint folder; gives a [`TextTokenizer`] from the
//! folder's own `tokenizer.json` when it has one, else from the family's file embedded in
//! the binary (so `moec` runs from any directory); for a GGUF file, from the vocabulary it
//! carries when moec reads that kind ([`TextTokenizer::load_gguf`]). Encoding adds the card's BOS exactly
//! once (Mixtral `<s>`; DBRX adds none); decoding skips special tokens.

use crate::model::card::ModelCard;
use crate::weights::tokenizer_json::parse;
use std::path::Path;
use tokenizers::Model;

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
                let t = std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| parse(&bytes).map_err(|e| e.to_string()))
                    .map_err(|message| TokenizerError::Load {
                        origin: origin.clone(),
                        message,
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
                let t = parse(embedded_tokenizer_json(card)).map_err(|e| TokenizerError::Load {
                    origin: origin.clone(),
                    message: e.to_string(),
                })?;
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
                let inner = parse(&json).map_err(|e| load_err(format!("its vocabulary: {e}")))?;
                Ok(TextTokenizer {
                    inner,
                    bos: card.bos_token_id,
                    origin,
                })
            }
            Err(reason) => {
                let origin = format!("embedded {} ({}: {reason})", card.tokenizer, path.display());
                let inner =
                    parse(embedded_tokenizer_json(card)).map_err(|e| TokenizerError::Load {
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
        continuation(&self.inner, prompt, generated)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        decode(&self.inner, ids)
    }

    /// The decoding half of this tokenizer: the same texts from the same ids, without
    /// what only encoding needs. A run drops its tokenizer once the prompts are encoded
    /// (it is as large as a small model's workspaces) and decodes at the end: loading
    /// cl100k's `tokenizer.json` again took ~0.5 s of every run, this takes milliseconds.
    pub fn into_decoder(self) -> TextDecoder {
        let mut inner = self.inner;
        // Decoding reads only the model's id -> token map (`TokenizerImpl::decode`: added
        // tokens first, then `Model::id_to_token`), so a word-level model over the same
        // vocabulary decodes every id to the same token, without BPE's merge table (most
        // of its memory) or a Unigram model's scores. Only when the vocabulary's tokens
        // are distinct is the map invertible that way; otherwise the model is kept whole.
        let vocab = inner.get_model().get_vocab();
        if vocab.len() == inner.get_model().get_vocab_size() {
            let words = tokenizers::models::wordlevel::WordLevel::builder()
                .vocab(vocab.into_iter().collect())
                .build();
            if let Ok(words) = words {
                inner.with_model(words);
            }
        }
        TextDecoder {
            inner,
            origin: self.origin,
        }
    }
}

/// Decodes what a [`TextTokenizer`] encoded ([`TextTokenizer::into_decoder`]).
pub struct TextDecoder {
    inner: tokenizers::Tokenizer,
    origin: String,
}

impl TextDecoder {
    /// Where the tokenizer came from (file path or "embedded ...").
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// [`TextTokenizer::decode_continuation`].
    pub fn decode_continuation(
        &self,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<String, TokenizerError> {
        continuation(&self.inner, prompt, generated)
    }

    /// [`TextTokenizer::decode`].
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        decode(&self.inner, ids)
    }
}

fn decode(inner: &tokenizers::Tokenizer, ids: &[u32]) -> Result<String, TokenizerError> {
    inner
        .decode(ids, true)
        .map_err(|e| TokenizerError::Codec(e.to_string()))
}

fn continuation(
    inner: &tokenizers::Tokenizer,
    prompt: &[u32],
    generated: &[u32],
) -> Result<String, TokenizerError> {
    let head = decode(inner, prompt)?;
    let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let full = decode(inner, &all)?;
    match full.strip_prefix(&head) {
        Some(rest) => Ok(rest.to_string()),
        None => decode(inner, generated),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The decoder gives the tokenizer's text for every single id (special and added
    /// tokens included) and for pseudo-random sequences and continuations, on both
    /// embedded tokenizers (Mixtral's SentencePiece-style BPE with byte fallback, and
    /// cl100k's byte-level BPE).
    #[test]
    fn the_decoder_decodes_every_id_as_the_tokenizer_does() {
        for json in [MIXTRAL_TOKENIZER_JSON, DBRX_TOKENIZER_JSON] {
            let inner = tokenizers::Tokenizer::from_bytes(json).unwrap();
            let n = inner.get_vocab_size(true) as u32;
            let full = TextTokenizer {
                inner,
                bos: None,
                origin: "test".into(),
            };
            let decoder = TextTokenizer {
                inner: tokenizers::Tokenizer::from_bytes(json).unwrap(),
                bos: None,
                origin: "test".into(),
            }
            .into_decoder();
            assert_eq!(
                decoder.inner.get_model().get_vocab_size(),
                full.inner.get_model().get_vocab_size()
            );
            assert!(matches!(
                decoder.inner.get_model(),
                tokenizers::models::ModelWrapper::WordLevel(_)
            ));
            for id in 0..n + 2 {
                assert_eq!(
                    decoder.decode(&[id]).ok(),
                    full.decode(&[id]).ok(),
                    "id {id}"
                );
            }
            let mut state = 0x2545_f491_4f6c_dd1du64;
            let mut next = |m: u32| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) % u64::from(m)) as u32
            };
            for _ in 0..300 {
                let ids: Vec<u32> = (0..1 + next(24)).map(|_| next(n)).collect();
                let cut = next(ids.len() as u32) as usize;
                assert_eq!(decoder.decode(&ids).unwrap(), full.decode(&ids).unwrap());
                assert_eq!(
                    decoder
                        .decode_continuation(&ids[..cut], &ids[cut..])
                        .unwrap(),
                    full.decode_continuation(&ids[..cut], &ids[cut..]).unwrap()
                );
            }
        }
    }
}
