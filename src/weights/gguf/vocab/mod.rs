//! The tokenizer a GGUF file carries (`tokenizer.ggml.*`), as a Hugging Face
//! `tokenizer.json` the `tokenizers` crate loads.
//!
//! Takes an opened [`GgufFile`]; gives the JSON and a line saying what it is, or the reason
//! moec does not build one from this vocabulary (the caller then uses the family's embedded
//! tokenizer and says so). Built: llama.cpp's `gpt2` vocabularies (byte-level BPE: `tokens`
//! in the GPT-2 byte-to-unicode spelling, `merges` as `"a b"`, `token_type`) whose
//! pre-tokenizer `pre` is one whose split expression Hugging Face's own files spell as
//! below (cl100k, Qwen2's, o200k as `gpt-4o`, gpt-oss's, and GPT-2's as `granite-docling`,
//! the label llama.cpp's converter gives a DBRX folder's cl100k vocabulary). Control (3)
//! and user-defined (4) tokens become added tokens, matched whole; BOS
//! is left to the card (`TextTokenizer` adds it). Not built: SentencePiece `llama`
//! vocabularies (they carry scores, not merges; Mixtral's card keeps its shipped file) and
//! other pre-tokenizers (DeepSeek-V3's, GPT-2's under other labels), each named in the
//! reason. A vocabulary that contradicts itself (lengths that differ, a token spelled
//! twice) is an error naming the key.

use super::{GgufError, GgufFile, Value};
use serde_json::json;

/// cl100k's split expression (DBRX, Llama 3), as its `tokenizer.json` spells it.
pub(crate) const CL100K: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
/// o200k's (gpt-oss's o200k_harmony, GPT-4o), as its `tokenizer.json` spells it.
pub(crate) const O200K: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's.
pub(crate) const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Split expressions by `tokenizer.ggml.pre`, as Hugging Face's `tokenizer.json` files of
/// those families write them (the `Split` pre-tokenizer before `ByteLevel`), with whether
/// the BPE model ignores merges for whole-vocabulary words (`ignore_merges`, set in the
/// Llama-3/cl100k files).
fn split_of(pre: &str) -> Option<(&'static str, bool)> {
    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    match pre {
        "dbrx" | "llama3" | "llama-bpe" | "smaug-bpe" => Some((CL100K, true)),
        // llama.cpp gives `stablelm2` Qwen2's expression; its converter also labels cl100k
        // itself so (the two files encode its hash text alike).
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => Some((QWEN2, false)),
        // o200k (gpt-oss, GPT-4o): the expression as llama-vocab.cpp quotes it from the
        // Hub's tokenizer.json; llama.cpp keeps merges for whole words.
        "gpt-4o" => Some((O200K, false)),
        // GPT-2's expression (llama.cpp's custom GPT-2 splitter, trailing whitespace run
        // included). llama.cpp's converter labels cl100k itself so when the file comes from a
        // DBRX folder (`DbrxForCausalLM`): its hash text encodes alike.
        "granite-docling" => Some((GPT2, false)),
        _ => None,
    }
}

mod spm;

fn meta_err(file: &GgufFile, key: &str, message: String) -> GgufError {
    GgufError::Metadata {
        path: file.path().display().to_string(),
        key: key.into(),
        message,
    }
}

/// The strings of array `key`.
fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, GgufError> {
    match file.get(key)? {
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| meta_err(file, key, format!("holds {v:?}, not a string")))
            })
            .collect(),
        other => Err(meta_err(file, key, format!("{other:?} is not an array"))),
    }
}

/// llama.cpp's token type of each token (`tokenizer.ggml.token_type`; NORMAL, 1, when the
/// key is absent), one per token or an error naming the key. The tokens the metadata names
/// as BOS, EOS, unknown or padding are CONTROL (3) whatever their type: a converter run
/// without `tokenizer_config.json` writes them NORMAL, yet they are the Hub file's special
/// tokens, matched whole and left out of decoded text.
fn token_types(file: &GgufFile, n_tokens: usize) -> Result<Vec<u64>, GgufError> {
    let mut types: Vec<u64> = match file.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => items.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; n_tokens],
    };
    if types.len() != n_tokens {
        return Err(meta_err(
            file,
            "tokenizer.ggml.token_type",
            format!("has {} entries for {n_tokens} tokens", types.len()),
        ));
    }
    for key in ["bos", "eos", "unknown", "padding"] {
        let id = file
            .metadata
            .get(&format!("tokenizer.ggml.{key}_token_id"))
            .and_then(Value::as_u64)
            .and_then(|id| usize::try_from(id).ok());
        if let Some(ty) = id.and_then(|id| types.get_mut(id)) {
            *ty = 3;
        }
    }
    Ok(types)
}

/// The `model.vocab` map (token to id) and the `added_tokens` entries (control and
/// user-defined tokens, matched whole) of a `tokenizer.json`; a token spelled twice is an
/// error naming the key.
fn vocab_map(
    file: &GgufFile,
    tokens: &[&str],
    types: &[u64],
) -> Result<
    (
        serde_json::Map<String, serde_json::Value>,
        Vec<serde_json::Value>,
    ),
    GgufError,
> {
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&token, &ty)) in tokens.iter().zip(types).enumerate() {
        if vocab.insert(token.to_string(), json!(id)).is_some() {
            return Err(meta_err(
                file,
                "tokenizer.ggml.tokens",
                format!("token {token:?} is listed twice (the second time as id {id})"),
            ));
        }
        // llama.cpp's token types: 3 control, 4 user-defined.
        if ty == 3 || ty == 4 {
            added.push(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == 3,
            }));
        }
    }
    Ok((vocab, added))
}

/// A `tokenizer.json` BPE model; byte fallback goes with fused unknowns, as the Hub's
/// SentencePiece files have it.
fn bpe(
    vocab: serde_json::Map<String, serde_json::Value>,
    merges: serde_json::Value,
    unk: Option<&str>,
    byte_fallback: bool,
    ignore_merges: bool,
) -> serde_json::Value {
    json!({
        "type": "BPE", "dropout": null, "unk_token": unk,
        "continuing_subword_prefix": null, "end_of_word_suffix": null,
        "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
        "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
    })
}

/// The bytes of a `tokenizer.json` of these parts (no normalizer or post-processor: BOS is
/// the card's to add).
fn document(
    added: Vec<serde_json::Value>,
    pre_tokenizer: serde_json::Value,
    decoder: serde_json::Value,
    model: serde_json::Value,
) -> Vec<u8> {
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
        "decoder": decoder, "model": model,
    })
    .to_string()
    .into_bytes()
}

/// `tokenizer.json` bytes for `file`'s vocabulary and a description of it, or `Err` of
/// the reason none is built (`Ok(Err(reason))`); a vocabulary that contradicts itself is
/// the outer error.
pub fn tokenizer_json(file: &GgufFile) -> Result<Result<(Vec<u8>, String), String>, GgufError> {
    let Some(model) = file.metadata.get("tokenizer.ggml.model") else {
        return Ok(Err(
            "it carries no vocabulary (`tokenizer.ggml.model`)".into()
        ));
    };
    let model = model.as_str().unwrap_or("");
    if model == "llama" {
        return spm::tokenizer_json(file).map(Ok);
    }
    if model != "gpt2" {
        return Ok(Err(format!(
            "its `{model}` vocabulary is not read (moec builds llama.cpp's `gpt2` byte-level \
             BPE and `llama` SentencePiece vocabularies)"
        )));
    }
    let pre = file
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let Some((split, ignore_merges)) = split_of(pre) else {
        return Ok(Err(format!(
            "its pre-tokenizer `{pre}` is not read (moec knows dbrx, llama3, llama-bpe, \
             smaug-bpe, qwen2, stablelm2, gpt-4o, granite-docling)"
        )));
    };
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let types = token_types(file, tokens.len())?;
    let (vocab, added) = vocab_map(file, &tokens, &types)?;
    let pre_tokenizer = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    let model = bpe(vocab, json!(merges), None, false, ignore_merges);
    let text = document(added, pre_tokenizer, decoder, model);
    let description = format!(
        "the GGUF vocabulary of {} (byte-level BPE, pre-tokenizer `{pre}`, {} tokens, {} merges)",
        file.path().display(),
        tokens.len(),
        merges.len()
    );
    Ok(Ok((text, description)))
}
