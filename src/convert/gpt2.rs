//! The vocabulary keys of a byte-level BPE tokenizer (`tokenizer.json`) as
//! `convert_hf_to_gguf.py`'s `_set_vocab_gpt2` writes them for Qwen2-MoE, Qwen3-MoE and
//! OLMoE: `tokenizer.ggml.model = gpt2`, every token in id order (ids the tokenizer lacks
//! up to the model's vocabulary are `[PADi]`, UNUSED), added tokens CONTROL when special
//! or when they look special (`<|..|>`, `<｜..｜>`, `<pad>`, `<mask>`, `<unused..>`, as the
//! converter's `does_token_look_special`), else USER_DEFINED, the rest NORMAL; the merges
//! (`[a, b]` pairs joined by a space, a space inside a part written as U+0120 as gguf-py's
//! `SpecialVocab` does); the special token ids (`tokenizer_config.json`'s, then
//! `config.json`'s `*_token_id`); `add_bos_token`/`add_eos_token` false for a ByteLevel
//! post-processor; the chat template.
//!
//! The converter names the pre-tokenizer (`tokenizer.ggml.pre`) by hashing how
//! transformers' `AutoTokenizer` (a class chosen by `model_type`) tokenises a fixed text,
//! which moec cannot reproduce (the same `tokenizer.json` gets `stablelm2`, `dbrx` or
//! `granite-docling` by family). moec names it by the pre-tokenizer's split regex instead:
//! the llama.cpp pre-tokenizer whose regex that is (`qwen2` for Qwen's, `dbrx` for the
//! cl100k one, `gpt-4o` for o200k, gpt-oss's); any other (GPT-NeoX's, which the real OLMoE uses, has no `Split` at all)
//! is an error, as an unknown hash is for the converter.

use super::metadata::{chat_template, pad_unused, read_tokenizer};
use super::{ExportError, Inputs};
use crate::convert::write::MetaValue;
use crate::weights::gguf::vocab;

/// llama.cpp's pre-tokenizer name for a `tokenizer.json` whose pre-tokenizer splits by
/// this regex (the byte-level BPE regexes of the families moec writes).
const PRE_BY_REGEX: [(&str, &str); 3] = [
    (vocab::QWEN2, "qwen2"),
    (vocab::CL100K, "dbrx"),
    // o200k (gpt-oss's o200k_harmony, GPT-4o): llama.cpp's `gpt-4o`.
    (vocab::O200K, "gpt-4o"),
];

/// The converter's `does_token_look_special`.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The split regexes of a `pre_tokenizer` (one `Split`, or inside a `Sequence`).
fn split_regexes(pre: &serde_json::Value) -> Vec<String> {
    match pre["type"].as_str() {
        Some("Split") => pre["pattern"]["Regex"]
            .as_str()
            .map(|r| vec![r.to_string()])
            .unwrap_or_default(),
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(split_regexes)
            .collect(),
        _ => Vec::new(),
    }
}

/// The vocabulary keys for the inputs' `tokenizer.json`, `vocab` tokens long.
pub(super) fn gpt2_vocab(
    inputs: &Inputs<'_>,
    vocab: usize,
) -> Result<Vec<(String, MetaValue)>, ExportError> {
    let (path, json) = read_tokenizer(inputs)?;
    let bad = |m: String| ExportError::Unsupported(format!("{path}: {m}"));
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(format!(
            "a `{}` tokenizer: moec quantize writes a byte-level BPE vocabulary for this family",
            model["type"].as_str().unwrap_or("?")
        )));
    }
    if !json["normalizer"].is_null() {
        return Err(bad(
            "a tokenizer with a normalizer: moec quantize writes byte-level BPE vocabularies \
             without one"
                .into(),
        ));
    }
    let regexes = split_regexes(&json["pre_tokenizer"]);
    let pre = match regexes.as_slice() {
        [one] => PRE_BY_REGEX
            .iter()
            .find(|(r, _)| r == one)
            .map(|(_, name)| *name)
            .ok_or_else(|| {
                bad(format!(
                    "pre-tokenizer regex `{one}` is not one moec knows llama.cpp's name for"
                ))
            })?,
        _ => {
            return Err(bad(format!(
                "{} split regexes in the pre-tokenizer: moec quantize names one",
                regexes.len()
            )))
        }
    };
    let mut tokens: Vec<Option<String>> = vec![None; vocab];
    let mut types = vec![1i32; vocab];
    let Some(entries) = model["vocab"].as_object() else {
        return Err(bad("`model.vocab` is not a map of tokens to ids".into()));
    };
    for (text, id) in entries {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("token `{text}`: its id is not a number")))?;
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            bad(format!(
                "token `{text}` has id {id}, past the model's vocabulary of {vocab}"
            ))
        })?;
        *slot = Some(text.clone());
    }
    let added = json["added_tokens"].as_array().cloned().unwrap_or_default();
    for a in &added {
        let (Some(id), Some(text)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(bad("an `added_tokens` entry without id or content".into()));
        };
        let i = id as usize;
        if i >= vocab {
            return Err(bad(format!(
                "added token `{text}` has id {id}, past the model's vocabulary of {vocab}"
            )));
        }
        let special = a["special"].as_bool().unwrap_or(false) || looks_special(text);
        tokens[i] = Some(if special {
            text.to_string()
        } else {
            text.replace('\u{2581}', " ")
        });
        types[i] = if special { 3 } else { 4 };
    }
    let tokens = pad_unused(tokens, &mut types);
    let merges: Vec<String> = match model["merges"].as_array() {
        None => Vec::new(),
        Some(list) => list
            .iter()
            .map(|m| match m {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(pair) => {
                    let parts: Option<Vec<String>> = pair
                        .iter()
                        .map(|p| p.as_str().map(|s| s.replace(' ', "\u{0120}")))
                        .collect();
                    parts
                        .filter(|p| p.len() == 2)
                        .map(|p| p.join(" "))
                        .ok_or_else(|| bad("a merge that is not a pair of strings".into()))
                }
                _ => Err(bad("a merge that is neither a string nor a pair".into())),
            })
            .collect::<Result<_, _>>()?,
    };
    let mut meta = vec![
        ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())),
        ("tokenizer.ggml.tokens".into(), MetaValue::Strs(tokens)),
        ("tokenizer.ggml.token_type".into(), MetaValue::I32s(types)),
        ("tokenizer.ggml.merges".into(), MetaValue::Strs(merges)),
    ];
    meta.extend(special_tokens(inputs, json, &added, vocab).map_err(bad)?);
    Ok(meta)
}

/// gguf-py's `SpecialVocab` without merges: the special ids, whether to add BOS/EOS, the
/// chat template.
fn special_tokens(
    inputs: &Inputs<'_>,
    tokenizer: &serde_json::Value,
    added: &[serde_json::Value],
    vocab: usize,
) -> Result<Vec<(String, MetaValue)>, String> {
    let tc = &inputs.tokenizer_config;
    let config = inputs.config.as_ref().unwrap_or(&serde_json::Value::Null);
    let mut add_special: Vec<(&str, bool)> = Vec::new();
    let post = &tokenizer["post_processor"];
    let processors: Vec<&serde_json::Value> = match post["processors"].as_array() {
        Some(list) => list.iter().collect(),
        None if post.is_null() => Vec::new(),
        None => vec![post],
    };
    for p in processors {
        match p["type"].as_str() {
            Some("ByteLevel") => {
                for typ in ["bos", "eos"] {
                    if !add_special.iter().any(|(t, _)| *t == typ) {
                        add_special.push((typ, false));
                    }
                }
            }
            other => {
                return Err(format!(
                    "a `{}` post-processor: moec quantize reads ByteLevel ones",
                    other.unwrap_or("?")
                ))
            }
        }
    }
    let types = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];
    let mut ids: Vec<(&str, u64)> = Vec::new();
    for typ in types {
        if let Some(add) = tc[format!("add_{typ}_token")].as_bool() {
            if !add_special.iter().any(|(t, _)| *t == typ) {
                add_special.push((typ, add));
            }
        }
        let entry = &tc[format!("{typ}_token")];
        let content = entry.as_str().or_else(|| entry["content"].as_str());
        if let Some(content) = content {
            let id = added
                .iter()
                .find(|a| a["content"].as_str() == Some(content))
                .and_then(|a| a["id"].as_u64());
            if let Some(id) = id.filter(|&id| (id as usize) < vocab) {
                ids.push((typ, id));
            }
        }
    }
    for typ in types {
        let id = config[format!("{typ}_token_id")].as_u64();
        if let Some(id) = id.filter(|&id| (id as usize) < vocab) {
            if !ids.iter().any(|(t, _)| *t == typ) {
                ids.push((typ, id));
            }
        }
    }
    let mut meta = Vec::new();
    for (typ, id) in ids {
        meta.push((
            format!("tokenizer.ggml.{typ}_token_id"),
            MetaValue::U32(id as u32),
        ));
    }
    for (typ, add) in add_special {
        meta.push((
            format!("tokenizer.ggml.add_{typ}_token"),
            MetaValue::Bool(add),
        ));
    }
    meta.extend(chat_template(tc));
    Ok(meta)
}
