//! The metadata keys of a GGUF as llama.cpp's converter writes them: the hyper-parameters
//! (the `llama` architecture's from the card, the text families' from `config.json` as
//! `TextModel.set_gguf_parameters` and its subclasses read it, DeepSeek's MLA keys, YaRN's
//! rope scaling) and the SentencePiece-style `llama` vocabulary (`LlamaHfVocab`).
//!
//! Takes the [`Inputs`] of the file (the card, `config.json`, `tokenizer.json`,
//! `tokenizer_config.json`); gives the keys in the converter's order, or an error naming
//! the file and the field it cannot write. [`super::gpt2`] writes the byte-level BPE
//! vocabulary, [`super::dbrx`] and [`super::gpt_oss`] their families' extra keys.

use super::{ExportError, Inputs};
use crate::convert::write::MetaValue;
use crate::model::arch::ArchSpec;
use crate::model::family::facts::Family;
use crate::weights::gguf::families::{gguf_family, EpsRule};

/// `general.architecture` (`arch_name`), `general.type`, `general.name` and the shape keys
/// (`{arch_name}.block_count` to `attention.head_count_kv`) from the card, as the converters
/// of the `llama` and `dbrx` architectures write them.
pub(super) fn shape_metadata(
    arch_name: &str,
    arch: &ArchSpec,
    name: &str,
) -> Vec<(String, MetaValue)> {
    let u = |k: &str, v: usize| (format!("{arch_name}.{k}"), MetaValue::U32(v as u32));
    vec![
        (
            "general.architecture".into(),
            MetaValue::Str(arch_name.into()),
        ),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(name.into())),
        u("block_count", arch.layers),
        u("context_length", arch.max_positions),
        u("embedding_length", arch.hidden),
        u("feed_forward_length", arch.ffn),
        u("attention.head_count", arch.attn.heads),
        u("attention.head_count_kv", arch.attn.kv_heads),
    ]
}

/// The `llama` architecture's hyper-parameter keys, from the card.
pub(super) fn arch_metadata(
    arch: &ArchSpec,
    name: &str,
    file_type: u32,
) -> Vec<(String, MetaValue)> {
    let u = |k: &str, v: usize| (format!("llama.{k}"), MetaValue::U32(v as u32));
    let mut meta = shape_metadata("llama", arch, name);
    meta.extend([
        (
            "llama.rope.freq_base".into(),
            MetaValue::F32(arch.rope_theta as f32),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            MetaValue::F32(arch.norm_eps),
        ),
        u("expert_count", arch.experts),
        u("expert_used_count", arch.top_k),
        u("attention.key_length", arch.attn.head_dim),
        u("attention.value_length", arch.attn.head_dim),
        u("vocab_size", arch.vocab),
        u("rope.dimension_count", arch.attn.head_dim),
        ("general.quantization_version".into(), MetaValue::U32(2)),
        ("general.file_type".into(), MetaValue::U32(file_type)),
    ]);
    meta
}

/// The hyper-parameter keys `convert_hf_to_gguf.py`'s `TextModel.set_gguf_parameters`
/// (and the Qwen2-MoE/Qwen3-MoE and OLMoE subclasses) write from `config.json`: each key
/// from the first of the config names the converter tries, written only when the config
/// has it. Rope scaling and expert scoring functions, which these families' configs do
/// not set, are an error rather than left out.
pub(super) fn text_metadata(
    inputs: &Inputs<'_>,
    arch_name: &str,
    family: Family,
    name: &str,
    file_type: u32,
) -> Result<Vec<(String, MetaValue)>, ExportError> {
    let origin = &inputs.config_origin;
    let bad = |m: String| ExportError::Unsupported(format!("{origin}: {m}"));
    let config = inputs.config.as_ref().map_err(|e| bad(e.clone()))?;
    let find = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| config.get(*k).filter(|v| !v.is_null()))
    };
    let mut meta: Vec<(String, MetaValue)> = vec![
        (
            "general.architecture".into(),
            MetaValue::Str(arch_name.into()),
        ),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(name.into())),
    ];
    let table = gguf_family(family);
    let deepseek = table.mla_keys;
    let mut u = |key: &str, keys: &[&str]| -> Result<(), ExportError> {
        if let Some(v) = find(keys) {
            let v = v
                .as_u64()
                .ok_or_else(|| bad(format!("`{}` is not a count", keys[0])))?;
            meta.push((format!("{arch_name}.{key}"), MetaValue::U32(v as u32)));
        }
        Ok(())
    };
    u(
        "block_count",
        &["num_hidden_layers", "n_layers", "n_layer", "num_layers"],
    )?;
    u(
        "context_length",
        &[
            "max_position_embeddings",
            "n_ctx",
            "n_positions",
            "max_length",
            "max_sequence_length",
            "model_max_length",
        ],
    )?;
    u("embedding_length", &["hidden_size", "n_embd", "dim"])?;
    u(
        "feed_forward_length",
        &[
            "prefix_dense_intermediate_size",
            "dense_intermediate_size",
            "intermediate_size",
            "n_inner",
            "hidden_dim",
        ],
    )?;
    u(
        "attention.head_count",
        &["num_attention_heads", "n_head", "n_heads"],
    )?;
    // DeepSeek's is written with its other MLA keys.
    if !deepseek {
        u(
            "attention.head_count_kv",
            &["num_key_value_heads", "n_kv_heads"],
        )?;
    }
    u(
        "expert_count",
        &["num_local_experts", "num_experts", "n_routed_experts"],
    )?;
    u(
        "expert_used_count",
        &[
            "num_experts_per_tok",
            "num_experts_per_token",
            "top_k_experts",
        ],
    )?;
    u("expert_group_count", &["n_group"])?;
    u("expert_group_used_count", &["topk_group"])?;
    if !deepseek {
        u("attention.key_length", &["head_dim"])?;
        u("attention.value_length", &["head_dim"])?;
    }
    if table.expert_width_keys {
        u("expert_feed_forward_length", &["moe_intermediate_size"])?;
        u(
            "expert_shared_feed_forward_length",
            &["shared_expert_intermediate_size"],
        )?;
    }
    if let Some(func) = find(&["score_function", "scoring_func", "score_func"]) {
        let id = match func.as_str() {
            Some("softmax") => 1,
            Some("sigmoid") => 2,
            _ => {
                return Err(bad(format!(
                    "expert scoring function {func} is not written"
                )))
            }
        };
        meta.push((
            format!("{arch_name}.expert_gating_func"),
            MetaValue::U32(id),
        ));
    }
    if deepseek {
        meta.extend(deepseek_metadata(config, arch_name).map_err(bad)?);
    }
    if table.gpt_oss_experts {
        meta.extend(super::gpt_oss::metadata(config, arch_name).map_err(bad)?);
    }
    for key in ["rope_scaling", "sliding_window_pattern"] {
        if find(&[key]).is_some() && !((table.gpt_oss_experts || deepseek) && key == "rope_scaling")
        {
            return Err(bad(format!(
                "`{key}` is set: moec quantize does not write its llama.cpp keys"
            )));
        }
    }
    let f = |keys: &[&str]| find(keys).and_then(serde_json::Value::as_f64);
    let theta = f(&["rope_theta"]).or_else(|| config["rope_parameters"]["rope_theta"].as_f64());
    if let Some(theta) = theta {
        meta.push((
            format!("{arch_name}.rope.freq_base"),
            MetaValue::F32(theta as f32),
        ));
    }
    // OLMoE's converter writes 1e-5 whatever the config says; DeepSeek's 1e-6 when the
    // config has none.
    let eps = match table.eps {
        EpsRule::Fixed(eps) => Some(eps),
        EpsRule::ConfigOr(eps) => f(&["rms_norm_eps", "norm_eps"]).or(Some(eps)),
        EpsRule::Config => f(&["rms_norm_eps", "norm_eps"]),
    };
    if let Some(eps) = eps {
        meta.push((
            format!("{arch_name}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(eps as f32),
        ));
    }
    meta.push(("general.file_type".into(), MetaValue::U32(file_type)));
    meta.push(("general.quantization_version".into(), MetaValue::U32(2)));
    Ok(meta)
}

/// The MLA and MoE keys `DeepseekV2Model.set_gguf_parameters` adds (and the one KV head
/// it sets for MLA's shared latent).
pub(super) fn deepseek_metadata(
    config: &serde_json::Value,
    arch_name: &str,
) -> Result<Vec<(String, MetaValue)>, String> {
    let get = |k: &str| config.get(k).filter(|v| !v.is_null());
    let count = |k: &str| -> Result<u32, String> {
        get(k)
            .and_then(serde_json::Value::as_u64)
            .map(|v| v as u32)
            .ok_or_else(|| format!("`{k}` is missing or not a count"))
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let layers = count("num_hidden_layers")?;
    let has_moe = get("n_routed_experts").is_some();
    let leading = match get("first_k_dense_replace").and_then(serde_json::Value::as_u64) {
        Some(k) => k as u32,
        None if has_moe => 0,
        None => layers,
    };
    let kv_lora = match get("kv_lora_rank") {
        Some(_) => count("kv_lora_rank")?,
        None => 512,
    };
    let (rope, nope, v) = (
        count("qk_rope_head_dim")?,
        count("qk_nope_head_dim")?,
        count("v_head_dim")?,
    );
    let mut meta = vec![
        (key("attention.head_count_kv"), MetaValue::U32(1)),
        (key("leading_dense_block_count"), MetaValue::U32(leading)),
        (key("vocab_size"), MetaValue::U32(count("vocab_size")?)),
    ];
    if get("q_lora_rank").is_some() {
        meta.push((
            key("attention.q_lora_rank"),
            MetaValue::U32(count("q_lora_rank")?),
        ));
    }
    meta.extend([
        (key("attention.kv_lora_rank"), MetaValue::U32(kv_lora)),
        (key("attention.key_length"), MetaValue::U32(kv_lora + rope)),
        (key("attention.value_length"), MetaValue::U32(kv_lora)),
        (key("attention.key_length_mla"), MetaValue::U32(nope + rope)),
        (key("attention.value_length_mla"), MetaValue::U32(v)),
    ]);
    let expert_ffn = match get("moe_intermediate_size") {
        Some(_) => count("moe_intermediate_size")?,
        None => count("intermediate_size")?,
    };
    meta.push((
        key("expert_feed_forward_length"),
        MetaValue::U32(expert_ffn),
    ));
    let shared = match get("n_shared_experts") {
        Some(_) => count("n_shared_experts")?,
        None => 0,
    };
    meta.push((key("expert_shared_count"), MetaValue::U32(shared)));
    if let Some(scale) = get("routed_scaling_factor").and_then(serde_json::Value::as_f64) {
        meta.push((key("expert_weights_scale"), MetaValue::F32(scale as f32)));
    }
    if get("norm_topk_prob").and_then(serde_json::Value::as_bool) == Some(true) {
        meta.push((key("expert_weights_norm"), MetaValue::Bool(true)));
    }
    meta.push((key("rope.dimension_count"), MetaValue::U32(rope)));
    // `TextModel` writes YaRN's keys; `DeepseekV2Model` adds the log multiplier from
    // `mscale_all_dim` (0.1 times it, llama.cpp's legacy spelling for this family).
    meta.extend(yarn_metadata(config, arch_name, "DeepSeek")?);
    let scaling = config
        .get("rope_parameters")
        .or_else(|| config.get("rope_scaling"))
        .filter(|v| !v.is_null());
    if let Some(all) = scaling.and_then(|r| r["mscale_all_dim"].as_f64()) {
        meta.push((
            key("rope.scaling.yarn_log_multiplier"),
            MetaValue::F32((0.1 * all) as f32),
        ));
    }
    Ok(meta)
}

/// YaRN's rope-scaling keys as `TextModel.set_gguf_parameters` writes them from
/// `rope_parameters` (or `rope_scaling`): type, factor, original context, and the
/// extrapolation and attention factors and both betas where the config has them. No
/// scaling writes nothing; another scaling type is an error naming `family`.
pub(super) fn yarn_metadata(
    config: &serde_json::Value,
    arch_name: &str,
    family: &str,
) -> Result<Vec<(String, MetaValue)>, String> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let mut meta = Vec::new();
    let rope = config
        .get("rope_parameters")
        .or_else(|| config.get("rope_scaling"))
        .filter(|v| !v.is_null());
    let Some(rope) = rope else {
        return Ok(meta);
    };
    let kind = rope["rope_type"].as_str().or_else(|| rope["type"].as_str());
    let factor = rope["factor"].as_f64();
    match (kind, factor) {
        (None, _) => {}
        (Some("yarn"), Some(factor)) => {
            let original = rope["original_max_position_embeddings"]
                .as_u64()
                .ok_or("YaRN `rope_scaling` without `original_max_position_embeddings`")?;
            meta.push((key("rope.scaling.type"), MetaValue::Str("yarn".into())));
            meta.push((key("rope.scaling.factor"), MetaValue::F32(factor as f32)));
            meta.push((
                key("rope.scaling.original_context_length"),
                MetaValue::U32(original as u32),
            ));
            for (hf, gguf) in [
                ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
                ("attention_factor", "rope.scaling.yarn_attn_factor"),
                ("beta_fast", "rope.scaling.yarn_beta_fast"),
                ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ] {
                if let Some(v) = rope[hf].as_f64() {
                    meta.push((key(gguf), MetaValue::F32(v as f32)));
                }
            }
        }
        (Some(other), _) => {
            return Err(format!(
                "rope scaling `{other}`: moec quantize writes {family}'s YaRN keys only"
            ))
        }
    }
    Ok(meta)
}

/// The inputs' `tokenizer.json` (where it came from, and its JSON).
pub(super) fn read_tokenizer<'a>(
    inputs: &'a Inputs<'_>,
) -> Result<(&'a str, &'a serde_json::Value), ExportError> {
    match &inputs.tokenizer {
        Some((origin, Ok(json))) => Ok((origin, json)),
        Some((origin, Err(e))) => Err(ExportError::Unsupported(format!("{origin}: {e}"))),
        None => Err(ExportError::Unsupported(format!(
            "{}: no tokenizer.json: llama.cpp needs the vocabulary inside the GGUF",
            inputs.origin
        ))),
    }
}

/// The token list with the ids the tokenizer lacks named `[PADi]` and typed UNUSED (5),
/// as both of the converter's vocabularies write them.
pub(super) fn pad_unused(tokens: Vec<Option<String>>, types: &mut [i32]) -> Vec<String> {
    tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = 5;
                format!("[PAD{i}]")
            })
        })
        .collect()
}

/// The vocabulary keys as the converter's `LlamaHfVocab` writes them from `tokenizer.json`
/// (a BPE tokenizer with byte fallback): every token in id order, score -1000, type BYTE
/// for `<0xXX>`, CONTROL for the special tokens `tokenizer_config.json` names, USER_DEFINED
/// for other added tokens past the base vocabulary, NORMAL otherwise; ids past the
/// tokenizer's up to the model's vocabulary are `[PADi]`, UNUSED.
pub(super) fn vocab_metadata(
    inputs: &Inputs<'_>,
    vocab: usize,
) -> Result<Vec<(String, MetaValue)>, ExportError> {
    let (path, json) = read_tokenizer(inputs)?;
    let bad = |m: String| ExportError::Unsupported(format!("{path}: {m}"));
    let model = &json["model"];
    let kind = model["type"].as_str().unwrap_or("?");
    if kind != "BPE" || model["byte_fallback"].as_bool() != Some(true) {
        return Err(bad(format!(
            "a `{kind}` tokenizer{}: moec quantize writes llama.cpp's `llama` vocabulary, a BPE \
             tokenizer with byte fallback (Mixtral's)",
            if kind == "BPE" {
                " without byte fallback"
            } else {
                ""
            }
        )));
    }
    // Which tokens are special is what `tokenizer_config.json` names (transformers'
    // `all_special_ids`, what the converter asks): none without that file.
    let config = &inputs.tokenizer_config;
    let token_text = |v: &serde_json::Value| -> Option<String> {
        v.as_str()
            .or_else(|| v["content"].as_str())
            .map(str::to_string)
    };
    let mut special: Vec<String> = ["bos", "eos", "unk", "pad", "sep", "cls", "mask"]
        .iter()
        .filter_map(|k| token_text(&config[format!("{k}_token")]))
        .collect();
    special.extend(
        config["additional_special_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(token_text),
    );
    let mut tokens: Vec<Option<String>> = vec![None; vocab];
    let mut types = vec![1i32; vocab];
    let mut place = |id: u64, text: &str, ty: i32| -> Result<(), ExportError> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            bad(format!(
                "token `{text}` has id {id}, past the model's vocabulary of {vocab}"
            ))
        })?;
        *slot = Some(text.to_string());
        types[id as usize] = ty;
        Ok(())
    };
    let Some(entries) = model["vocab"].as_object() else {
        return Err(bad("`model.vocab` is not a map of tokens to ids".into()));
    };
    let mut base = 0u64;
    for (text, id) in entries {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("token `{text}`: its id is not a number")))?;
        let is_byte = text.len() == 6
            && text.starts_with("<0x")
            && text.ends_with('>')
            && text[3..5].chars().all(|c| c.is_ascii_hexdigit());
        let ty = if is_byte {
            6
        } else if special.contains(text) {
            3
        } else {
            1
        };
        place(id, text, ty)?;
        base = base.max(id + 1);
    }
    // Added tokens inside the base vocabulary are already there; those past it are
    // CONTROL when special, USER_DEFINED otherwise.
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(text)) = (added["id"].as_u64(), added["content"].as_str()) else {
            return Err(bad("an `added_tokens` entry without id or content".into()));
        };
        if id >= base {
            place(
                id,
                text,
                if special.iter().any(|s| s == text) {
                    3
                } else {
                    4
                },
            )?;
        }
    }
    let tokens = pad_unused(tokens, &mut types);
    let card = inputs.card;
    let mut meta = vec![
        (
            "tokenizer.ggml.model".into(),
            MetaValue::Str("llama".into()),
        ),
        (
            "tokenizer.ggml.pre".into(),
            MetaValue::Str("default".into()),
        ),
        ("tokenizer.ggml.tokens".into(), MetaValue::Strs(tokens)),
        (
            "tokenizer.ggml.scores".into(),
            MetaValue::F32s(vec![-1000.0; vocab]),
        ),
        ("tokenizer.ggml.token_type".into(), MetaValue::I32s(types)),
    ];
    if let Some(bos) = card.bos_token_id {
        meta.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(bos)));
    }
    meta.push((
        "tokenizer.ggml.eos_token_id".into(),
        MetaValue::U32(card.eos_token_id),
    ));
    let add_bos = config["add_bos_token"].as_bool().unwrap_or(true);
    meta.push((
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(add_bos),
    ));
    meta.push((
        "tokenizer.ggml.add_sep_token".into(),
        MetaValue::Bool(false),
    ));
    meta.extend(chat_template(config));
    Ok(meta)
}

/// `tokenizer.chat_template` from `tokenizer_config.json`, when it has one.
pub(super) fn chat_template(config: &serde_json::Value) -> Option<(String, MetaValue)> {
    let template = config["chat_template"].as_str()?;
    Some((
        "tokenizer.chat_template".into(),
        MetaValue::Str(template.into()),
    ))
}
