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

use crate::model::arch::ArchSpec;
use crate::model::family::facts::Family;
use crate::model::family::hub::Source;
use crate::model::formats::{WeightClass, WeightFormats, WeightTensor};
use crate::model::layout::LayerLayout;
use crate::model::names::{head_names, segment_source};
use crate::model::segment::SegmentKind;
use crate::model::vocab::Orientation;
use crate::quant::encode::quantize_row;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use crate::weights::checkpoint::Checkpoint;
use crate::weights::gguf::families::{gguf_family, EpsRule, GgufKeys};
use crate::weights::gguf::llama::{place, Place};
use std::path::Path;
use write::{write_gguf, MetaValue, TensorEntry, WriteError, GGML_F32};

mod dbrx;
mod gpt2;
mod gpt_oss;
pub mod mix;
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

/// `general.architecture` (`arch_name`), `general.type`, `general.name` and the shape keys
/// (`{arch_name}.block_count` to `attention.head_count_kv`) from the card, as the converters
/// of the `llama` and `dbrx` architectures write them.
fn shape_metadata(arch_name: &str, arch: &ArchSpec, name: &str) -> Vec<(String, MetaValue)> {
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
fn arch_metadata(arch: &ArchSpec, name: &str, file_type: u32) -> Vec<(String, MetaValue)> {
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
fn text_metadata(
    ckpt: &Checkpoint,
    arch_name: &str,
    family: Family,
    name: &str,
    file_type: u32,
) -> Result<Vec<(String, MetaValue)>, ExportError> {
    let path = ckpt.dir().join("config.json");
    let bad = |m: String| ExportError::Unsupported(format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
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
        meta.extend(deepseek_metadata(&config, arch_name).map_err(bad)?);
    }
    if table.gpt_oss_experts {
        meta.extend(gpt_oss::metadata(&config, arch_name).map_err(bad)?);
    }
    for key in ["rope_scaling", "sliding_window_pattern"] {
        if find(&[key]).is_some() && !(table.gpt_oss_experts && key == "rope_scaling") {
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
fn deepseek_metadata(
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
    Ok(meta)
}

/// `ckpt`'s `tokenizer.json`, its path and its JSON.
fn read_tokenizer(
    ckpt: &Checkpoint,
) -> Result<(std::path::PathBuf, serde_json::Value), ExportError> {
    let path = ckpt.tokenizer_path().ok_or_else(|| {
        ExportError::Unsupported(format!(
            "{}: no tokenizer.json: llama.cpp needs the vocabulary inside the GGUF",
            ckpt.dir().display()
        ))
    })?;
    let bad = |m: String| ExportError::Unsupported(format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
    let json = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    Ok((path, json))
}

/// The token list with the ids the tokenizer lacks named `[PADi]` and typed UNUSED (5),
/// as both of the converter's vocabularies write them.
fn pad_unused(tokens: Vec<Option<String>>, types: &mut [i32]) -> Vec<String> {
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
fn vocab_metadata(
    ckpt: &Checkpoint,
    vocab: usize,
) -> Result<Vec<(String, MetaValue)>, ExportError> {
    let (path, json) = read_tokenizer(ckpt)?;
    let bad = |m: String| ExportError::Unsupported(format!("{}: {m}", path.display()));
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
    let config_path = ckpt.dir().join("tokenizer_config.json");
    let config: serde_json::Value = std::fs::read_to_string(&config_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
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
    let card = ckpt.card();
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
    meta.extend(chat_template(&config));
    Ok(meta)
}

/// `tokenizer.chat_template` from `tokenizer_config.json`, when it has one.
fn chat_template(config: &serde_json::Value) -> Option<(String, MetaValue)> {
    let template = config["chat_template"].as_str()?;
    Some((
        "tokenizer.chat_template".into(),
        MetaValue::Str(template.into()),
    ))
}

/// The tensor table and each tensor's origin, in the converter's order (head tensors, then
/// each layer's).
fn plan(
    ckpt: &Checkpoint,
    formats: &WeightFormats,
) -> Result<(Vec<TensorEntry>, Vec<Origin>), ExportError> {
    let arch = ckpt.arch();
    let dtype = ckpt.card().dtype;
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
    if ckpt.tensor_names().any(|n| n == "lm_head.weight") {
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
                    dbrx::transpose(&v, rows, cols).ok_or_else(|| WriteError::Tensor {
                        tensor: name.into(),
                        message: format!("`{}` is not {rows} whole rows", src.name),
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
    quantize_row(format, values).map_err(|e| WriteError::Tensor {
        tensor: name.into(),
        message: e.to_string(),
    })
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
    let arch = ckpt.arch();
    let arch_name = arch.family.facts().gguf_arch;
    let floats = WeightFormats::default();
    let formats = match types {
        Types::Classes(formats) => formats,
        Types::Mix(_) => &floats,
    };
    let stored;
    let table = gguf_family(arch.family);
    let formats = if table.gpt_oss_experts {
        stored = gpt_oss::keep_stored_experts(ckpt, formats);
        &stored
    } else {
        formats
    };
    // gpt-oss's experts are written out-in whatever the Hub's order ([`gpt_oss`]), and
    // so is DBRX's down projection ([`dbrx::as_stored`]).
    let mut written = dbrx::as_stored(arch);
    written.experts_out_in |= table.gpt_oss_experts;
    if let Err(e) = formats.check(&written, ckpt.card().dtype) {
        return Err(ExportError::Unsupported(e));
    }
    let (mut entries, origins) = plan(ckpt, formats)?;
    let file_type = match types {
        Types::Classes(_) if table.gpt_oss_experts => {
            gpt_oss::file_type(formats, ckpt.card().dtype)
        }
        Types::Classes(formats) => file_type(formats.storage(
            ckpt.card().dtype,
            WeightTensor::layer(SegmentKind::ExpertGate(0)),
        )),
        Types::Mix(mix) => {
            apply_mix(arch, *mix, &mut entries)?;
            mix.file_type()
        }
    };
    check_blocks(&entries)?;
    let metadata = match table.keys {
        GgufKeys::Llama => {
            let mut m = arch_metadata(arch, name, file_type);
            m.extend(vocab_metadata(ckpt, arch.vocab)?);
            m
        }
        GgufKeys::Dbrx => {
            let mut m = dbrx::metadata(arch, name, file_type)?;
            m.extend(gpt2::gpt2_vocab(ckpt, arch.vocab)?);
            m
        }
        GgufKeys::Text => {
            let mut m = text_metadata(ckpt, arch_name, arch.family, name, file_type)?;
            m.extend(gpt2::gpt2_vocab(ckpt, arch.vocab)?);
            m
        }
    };
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
        encode(&v, entry.ggml_type, &entry.name)
    })?;
    let mut by_type: Vec<(String, u64)> = Vec::new();
    for entry in &entries {
        let ty = type_name(entry.ggml_type);
        let bytes = entry.bytes().unwrap_or(0);
        match by_type.iter_mut().find(|(t, _)| *t == ty) {
            Some((_, b)) => *b += bytes,
            None => by_type.push((ty, bytes)),
        }
    }
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
