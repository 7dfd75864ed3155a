//! `tokenizer.json` read into a [`tokenizers::Tokenizer`] in one pass over the text.
//!
//! Takes the file's bytes; gives the tokenizer `Tokenizer::from_bytes` gives (the same
//! model, vocabulary, merge ranks, added tokens, normalizer, pre-tokenizer, post-processor
//! and decoder). The library reads a BPE model's vocabulary and merges through serde's
//! buffered `Content` twice (its model is an untagged enum, and so are its merges), which
//! made cl100k's 100k-token file ~0.5 s of every run's start; here the document is parsed
//! once into JSON values and a BPE model is built from them with `BpeBuilder`, the way the
//! library's own BPE visitor builds it. Any model or field shape this reader does not
//! recognise is handed to the library's deserializer as it stands, so its result (or its
//! error) is the library's.

use serde_json::{Map, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::models::ModelWrapper;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PaddingParams, PostProcessorWrapper,
    PreTokenizerWrapper, Tokenizer, TokenizerBuilder, TruncationParams,
};

/// The tokenizer of a `tokenizer.json` text.
pub fn parse(bytes: &[u8]) -> tokenizers::Result<Tokenizer> {
    let mut doc: Map<String, Value> = serde_json::from_slice(bytes)?;
    if let Some(v) = doc.get("version") {
        if v.as_str() != Some("1.0") {
            return Err(format!("Unknown tokenizer version '{v}'").into());
        }
    }
    let model = match doc.remove("model") {
        Some(m) => model(m)?,
        None => return Err("missing field `model`".into()),
    };
    let field = |doc: &mut Map<String, Value>, key: &str| doc.remove(key).unwrap_or(Value::Null);
    let normalizer: Option<NormalizerWrapper> =
        serde_json::from_value(field(&mut doc, "normalizer"))?;
    let pre_tokenizer: Option<PreTokenizerWrapper> =
        serde_json::from_value(field(&mut doc, "pre_tokenizer"))?;
    let post_processor: Option<PostProcessorWrapper> =
        serde_json::from_value(field(&mut doc, "post_processor"))?;
    let decoder: Option<DecoderWrapper> = serde_json::from_value(field(&mut doc, "decoder"))?;
    let truncation: Option<TruncationParams> =
        serde_json::from_value(field(&mut doc, "truncation"))?;
    let padding: Option<PaddingParams> = serde_json::from_value(field(&mut doc, "padding"))?;
    let added: Option<Vec<AddedToken>> = serde_json::from_value(field(&mut doc, "added_tokens"))?;
    let mut tokenizer: Tokenizer = TokenizerBuilder::new()
        .with_model(model)
        .with_normalizer(normalizer)
        .with_pre_tokenizer(pre_tokenizer)
        .with_post_processor(post_processor)
        .with_decoder(decoder)
        .with_truncation(truncation)
        .with_padding(padding)
        .build()?
        .into();
    // As the library's visitor: every added token in the file's order, special or not
    // (`AddedToken::special` decides), each given its id by the model or appended.
    tokenizer.add_tokens(added.unwrap_or_default())?;
    Ok(tokenizer)
}

/// A BPE model built from its JSON values, or whatever the library makes of `value`.
fn model(value: Value) -> tokenizers::Result<ModelWrapper> {
    if !plain_bpe(&value) {
        return Ok(serde_json::from_value(value)?);
    }
    let Value::Object(mut m) = value else {
        unreachable!("plain_bpe checked an object")
    };
    let Some(Value::Object(vocab)) = m.remove("vocab") else {
        unreachable!("plain_bpe checked the vocabulary")
    };
    let Some(Value::Array(merges)) = m.remove("merges") else {
        unreachable!("plain_bpe checked the merges")
    };
    let vocab: Vocab = vocab
        .into_iter()
        .filter_map(|(token, id)| Some((token, u32::try_from(id.as_u64()?).ok()?)))
        .collect();
    let mut pairs = Vec::with_capacity(merges.len());
    for (rank, merge) in merges.into_iter().enumerate() {
        pairs.push(match merge {
            // The legacy form "a b": exactly one space, as the library requires.
            Value::String(line) => {
                let mut parts = line.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => (a.to_string(), b.to_string()),
                    _ => {
                        return Err(format!("Merges text file invalid at line {}", rank + 1).into())
                    }
                }
            }
            Value::Array(pair) => {
                let mut pair = pair.into_iter();
                match (pair.next(), pair.next()) {
                    (Some(Value::String(a)), Some(Value::String(b))) => (a, b),
                    _ => unreachable!("plain_bpe checked every pair"),
                }
            }
            _ => unreachable!("plain_bpe checked every merge"),
        });
    }
    let text = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_string);
    let flag = |key: &str| m.get(key).and_then(Value::as_bool);
    let mut builder = BPE::builder().vocab_and_merges(vocab, pairs);
    if let Some(dropout) = m.get("dropout").and_then(Value::as_f64) {
        builder = builder.dropout(dropout as f32);
    }
    if let Some(unk) = text("unk_token") {
        builder = builder.unk_token(unk);
    }
    if let Some(prefix) = text("continuing_subword_prefix") {
        builder = builder.continuing_subword_prefix(prefix);
    }
    if let Some(suffix) = text("end_of_word_suffix") {
        builder = builder.end_of_word_suffix(suffix);
    }
    if let Some(fuse) = flag("fuse_unk") {
        builder = builder.fuse_unk(fuse);
    }
    if let Some(fallback) = flag("byte_fallback") {
        builder = builder.byte_fallback(fallback);
    }
    if let Some(ignore) = flag("ignore_merges") {
        builder = builder.ignore_merges(ignore);
    }
    Ok(builder.build()?.into())
}

/// Whether `value` is a BPE model this reader builds itself: `"type": "BPE"`, a vocabulary
/// of ids that fit u32, merges all in one form ("a b" strings or [a, b] pairs), and every
/// other field it reads null or of the type the library reads.
fn plain_bpe(value: &Value) -> bool {
    let Some(m) = value.as_object() else {
        return false;
    };
    let kind = m.get("type").and_then(Value::as_str) == Some("BPE");
    let vocab = m.get("vocab").and_then(Value::as_object).is_some_and(|v| {
        v.values()
            .all(|id| id.as_u64().is_some_and(|id| u32::try_from(id).is_ok()))
    });
    let merges = m.get("merges").and_then(Value::as_array).is_some_and(|ms| {
        ms.iter().all(Value::is_string)
            || ms.iter().all(|p| {
                p.as_array()
                    .is_some_and(|p| p.len() == 2 && p.iter().all(Value::is_string))
            })
    });
    let typed = |key: &str, ok: fn(&Value) -> bool| m.get(key).is_none_or(|v| v.is_null() || ok(v));
    kind && vocab
        && merges
        && typed("dropout", Value::is_number)
        && typed("unk_token", Value::is_string)
        && typed("continuing_subword_prefix", Value::is_string)
        && typed("end_of_word_suffix", Value::is_string)
        && typed("fuse_unk", Value::is_boolean)
        && typed("byte_fallback", Value::is_boolean)
        && typed("ignore_merges", Value::is_boolean)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::tokenizer::{DBRX_TOKENIZER_JSON, MIXTRAL_TOKENIZER_JSON};

    /// Both embedded tokenizers (Mixtral's BPE with byte fallback and pair merges,
    /// cl100k's byte-level BPE) and a legacy "a b" merges file come out as the library
    /// makes them: the same serialisation (vocabulary, merge ranks, added tokens and every
    /// component) and the same encodings.
    #[test]
    fn parse_gives_the_librarys_tokenizer() {
        // Mixtral's merges in the other of the two forms the file format allows.
        let mut other: Value = serde_json::from_slice(MIXTRAL_TOKENIZER_JSON).unwrap();
        let merges = other["model"]["merges"].as_array().unwrap().clone();
        other["model"]["merges"] = Value::Array(
            merges
                .iter()
                .map(|m| match m {
                    Value::String(s) => {
                        let (a, b) = s.split_once(' ').unwrap();
                        serde_json::json!([a, b])
                    }
                    p => Value::String(format!(
                        "{} {}",
                        p[0].as_str().unwrap(),
                        p[1].as_str().unwrap()
                    )),
                })
                .collect(),
        );
        assert!(!merges.is_empty());
        let legacy = serde_json::to_vec(&other).unwrap();
        for json in [MIXTRAL_TOKENIZER_JSON, DBRX_TOKENIZER_JSON, &legacy[..]] {
            let want = Tokenizer::from_bytes(json).unwrap();
            let got = parse(json).unwrap();
            assert!(want.to_string(false).unwrap() == got.to_string(false).unwrap());
            for text in [
                "Hello, world!",
                " <s>[INST] tabs\tand\nlines 123456 ünïcödé 🙂</s>",
            ] {
                assert_eq!(
                    want.encode(text, true).unwrap().get_ids(),
                    got.encode(text, true).unwrap().get_ids()
                );
            }
        }
        assert!(parse(br#"{"version": "2.0", "model": {}}"#).is_err());
        assert!(parse(b"{").is_err());
    }
}
