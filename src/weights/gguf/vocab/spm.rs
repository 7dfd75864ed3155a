//! llama.cpp's SentencePiece (`llama`) vocabularies as a Hugging Face BPE `tokenizer.json`.
//!
//! Takes the tokens, scores and types of a GGUF whose `tokenizer.ggml.model` is `llama`
//! (Mixtral's and Llama-2's); gives the `tokenizer.json` of the same tokenizer as the
//! Hub ships it: `Metaspace` (spaces become `▁`, one prepended unless
//! `tokenizer.ggml.add_space_prefix` is false), BPE with byte fallback, and merges made
//! from the scores the way transformers' `SentencePieceExtractor` makes them (every pair of
//! pieces whose concatenation is a piece, ranked by that piece's score, best first; pairs
//! of one piece by the ids of their halves). SentencePiece's BPE merges the best-scoring
//! adjacent pair first, so a BPE with those ranks splits text as it does.
//!
//! Scores all equal are the converter's placeholder for a vocabulary it read from a
//! `tokenizer.json` (`LlamaHfVocab` writes -1000 for every token): those files lost the
//! ranks, so the merges are ranked by token id, the order a SentencePiece BPE model
//! assigns its pieces in (its score of piece `i` falls with `i`). The description says so:
//! llama.cpp itself merges leftmost-first on such a file and may split text differently.

use super::{bpe, document, meta_err, strings, token_types, vocab_map};
use crate::weights::gguf::{GgufError, GgufFile, Value};
use serde_json::json;
use std::collections::HashMap;

/// llama.cpp's NORMAL token type: the only pieces merges make or take.
const NORMAL: u64 = 1;

/// Per-token score, `None` when the file has none or they are all equal.
fn scores(file: &GgufFile, n_tokens: usize) -> Result<Option<Vec<f64>>, GgufError> {
    let key = "tokenizer.ggml.scores";
    let Some(value) = file.metadata.get(key) else {
        return Ok(None);
    };
    let Value::Array(items) = value else {
        return Err(meta_err(file, key, format!("{value:?} is not an array")));
    };
    let scores = items
        .iter()
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| meta_err(file, key, format!("holds {v:?}, not a number")))
        })
        .collect::<Result<Vec<f64>, _>>()?;
    if scores.len() != n_tokens {
        return Err(meta_err(
            file,
            key,
            format!("has {} entries for {n_tokens} tokens", scores.len()),
        ));
    }
    let all_equal = scores.windows(2).all(|w| w[0] == w[1]);
    Ok((!all_equal).then_some(scores))
}

/// The merges, best first: `(left, right)` for every pair of NORMAL pieces whose
/// concatenation is a NORMAL piece, ranked by `rank` of that piece (higher first; a stable
/// sort, so ties keep id order), pairs making one piece ordered by their halves' ids.
fn merges<'a>(tokens: &[&'a str], types: &[u64], rank: impl Fn(usize) -> f64) -> Vec<[&'a str; 2]> {
    let normal: HashMap<&str, usize> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == NORMAL)
        .map(|(id, (&t, _))| (t, id))
        .collect();
    let mut found: Vec<(f64, usize, usize, [&'a str; 2])> = Vec::new();
    for (id, &piece) in tokens.iter().enumerate() {
        if types[id] != NORMAL {
            continue;
        }
        let mut local: Vec<(usize, usize, [&'a str; 2])> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*normal.get(l)?, *normal.get(r)?, [l, r]))
            })
            .collect();
        local.sort_by_key(|&(l, r, _)| (l, r));
        found.extend(local.into_iter().map(|(l, r, pair)| (rank(id), l, r, pair)));
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0));
    found.into_iter().map(|(.., pair)| pair).collect()
}

/// `tokenizer.json` bytes and a description for a `llama` vocabulary.
pub fn tokenizer_json(file: &GgufFile) -> Result<(Vec<u8>, String), GgufError> {
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let types = token_types(file, tokens.len())?;
    let (vocab, added) = vocab_map(file, &tokens, &types)?;
    let scores = scores(file, tokens.len())?;
    let (merges, ranked_by) = match &scores {
        Some(s) => (merges(&tokens, &types, |id| s[id]), "by the file's scores"),
        None => (
            merges(&tokens, &types, |id| -(id as f64)),
            "by token id: the file's scores are all equal (the converter's placeholder for \
             a tokenizer.json vocabulary; llama.cpp merges leftmost-first on it)",
        ),
    };
    let prefix = file
        .metadata
        .get("tokenizer.ggml.add_space_prefix")
        .is_none_or(|v| !matches!(v, Value::Bool(false)));
    let unk = file
        .metadata
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(Value::as_u64)
        .and_then(|id| tokens.get(usize::try_from(id).ok()?).copied());
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let pre_tokenizer = json!({
        "type": "Metaspace", "replacement": "\u{2581}",
        "prepend_scheme": if prefix { "always" } else { "never" }, "split": false,
    });
    let decoder = json!({"type": "Sequence", "decoders": decoders});
    let text = document(
        added,
        pre_tokenizer,
        decoder,
        bpe(vocab, json!(merges), unk, true, false),
    );
    let description = format!(
        "the GGUF vocabulary of {} (SentencePiece BPE with byte fallback, {} tokens, {} merges \
         ranked {ranked_by})",
        file.path().display(),
        tokens.len(),
        merges.len()
    );
    Ok((text, description))
}
