//! Command-line inputs shared by the commands that run a model (`generate`, `run`,
//! `ablate`): which model, which prompts, and how a schedule is run. One definition, so the flags read and
//! behave the same everywhere.

use crate::weights::source::ModelSource;
use std::path::{Path, PathBuf};

/// `--model` / `--weights`: where the model comes from.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model card (built-in name or .ron path), or a llama.cpp `.gguf` file (the checkpoint,
    /// its header the card, as the planning commands and `moec plan`'s printed run line
    /// take it); default mixtral-tiny when --weights is absent.
    #[arg(long)]
    pub model: Option<String>,
    /// Hugging Face checkpoint folder (config.json + safetensors), or a llama.cpp `.gguf`
    /// file (its quantised tensors run as stored, see README "Quantised weights").
    #[arg(long, value_name = "DIR")]
    pub weights: Option<PathBuf>,
}

impl ModelArgs {
    /// The model source these flags name (the embedded default when both are absent).
    pub fn source(&self) -> ModelSource {
        match (&self.model, &self.weights) {
            // `--model FILE.gguf` alone: `check`, `simulate` and `plan` read a GGUF's header
            // as the card, and `plan` prints its `moec run` line with the same `--model`;
            // the file is the checkpoint, and the card comes from it as with `--weights`.
            (Some(model), None) if is_gguf(Path::new(model)) => ModelSource {
                card: None,
                weights: Some(PathBuf::from(model)),
            },
            _ => ModelSource {
                card: self.model.clone(),
                weights: self.weights.clone(),
            },
        }
    }
}

/// Whether a `--model` value names a llama.cpp GGUF file rather than a card.
fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gguf")
}

/// The card a planning command (`check`, `compile`, `simulate`, `plan`) compiles for:
/// `--model` names a built-in card, a `.ron` path or a llama.cpp `.gguf` file (its
/// architecture and each tensor's format come from its header; no weights are read), and
/// `--weight-format` (`experts=q4_k,attention=q8_0`) sets classes' formats on top. The card
/// is the one `backend` runs (`registry::card_for`: an MLA cache with or without a V pool),
/// so a planning command budgets the KV bytes `moec run --backend` on it holds.
pub fn planning_card(
    model: &str,
    weight_format: Option<&str>,
    backend: &crate::runtime::Registration,
) -> Result<crate::model::card::ModelCard, String> {
    let path = Path::new(model);
    let mut card = if is_gguf(path) {
        crate::weights::checkpoint::Checkpoint::open_gguf(path, None)
            .map_err(|e| e.to_string())?
            .card()
            .clone()
    } else {
        crate::model::card::ModelCard::load(model).map_err(|e| e.to_string())?
    };
    if let Some(spec) = weight_format {
        card.formats
            .parse_classes(spec)
            .map_err(|e| format!("--weight-format: {e}"))?;
        let arch = crate::model::ArchSpec::from_card(&card);
        card.formats
            .check(&arch, card.dtype)
            .map_err(|e| format!("--weight-format: {}: {e}", card.name))?;
    }
    Ok(crate::runtime::registry::card_for(backend, &card))
}

/// A flag value that must be a positive finite number (`--link-gbps`, `--watchdog`).
pub fn positive_finite(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a positive finite number")),
        Err(_) => Err(format!("`{text}` is not a number")),
    }
}

/// A flag value that must be a finite number >= 0 (`--temperature`).
pub fn non_negative_finite(text: &str) -> Result<f32, String> {
    match text.trim().parse::<f32>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number >= 0")),
        Err(_) => Err(format!("`{text}` is not a number")),
    }
}

/// Seconds a watchdog may be set to: positive, finite, and at most a year (a `Duration`
/// holds it; a longer wait is no watchdog).
pub fn watchdog_seconds(text: &str) -> Result<f64, String> {
    let v = positive_finite(text)?;
    if v > 365.0 * 86400.0 {
        return Err(format!("{v} s is more than a year"));
    }
    Ok(v)
}

/// How `run` and `ablate` execute a schedule: workload, param overrides, pools, the
/// emulated link and device memory, and the profile predictions are made for.
#[derive(Debug, Clone, clap::Args)]
pub struct RunSettings {
    /// Synthetic prompts: `mtbench[:COUNT]`, a paper preset `mtbench-GEN[:COUNT]` (GEN = 32,
    /// 64, 128 or 256 generated tokens, as `simulate` and `plan` name them) or
    /// `count=N,mean=M,max=X[,min=A][,gen=G][,seed=S]`.
    #[arg(long, value_name = "SPEC")]
    pub workload: Option<String>,
    /// Override a schedule param: `--set n_ub=8` (repeatable; ablate applies it to every
    /// schedule that declares the param).
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub sets: Vec<String>,
    /// Threads of the compute pool (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Emulated host<->GPU link bandwidth, GB/s (copy streams are throttled to it).
    #[arg(long, value_name = "GBPS", value_parser = positive_finite)]
    pub link_gbps: Option<f64>,
    /// Device memory for the `gpu` arena, e.g. `64MB` (default: the profile's).
    #[arg(long, value_name = "BYTES")]
    pub gpu_mem: Option<String>,
    /// Host memory the plan may use, e.g. `16GB`: arenas, caches and what is read of the
    /// checkpoint in place (its memory-mapped resident part); a plan over it is refused
    /// before anything is allocated (default: the profile's host budget).
    #[arg(long, value_name = "BYTES")]
    pub host_mem: Option<String>,
    /// Hardware profile for the HRM prediction (name or .ron path); default: measure this
    /// machine quickly.
    #[arg(long, value_name = "PROFILE")]
    pub hw: Option<String>,
    /// Routing profile (`moec profile` output) that `rank(..)` placement and the cost
    /// model read.
    #[arg(long = "profile", value_name = "FILE")]
    pub routing_profile: Option<std::path::PathBuf>,
    /// Backend that executes the plan: `cpu`, or `cuda` (needs a CUDA driver, a device,
    /// NVRTC and cuBLAS; without them one line names what is missing). The names are the
    /// registry's (`runtime::registry`).
    #[arg(long, default_value = "cpu", value_parser = backend())]
    pub backend: &'static crate::runtime::Registration,
    /// How the CPU backend copies weights: `bind` moves a weight's label and lets the
    /// kernels read it from the mapped checkpoint (a DMA engine's copy: no compute core
    /// or memory bandwidth spent; `--link-gbps` still times it), `move` memcpys every
    /// byte. Activations and KV are always copied. On `--backend cuda`, `bind` lets the
    /// device read weights from the checkpoint registered with the driver, and `move`
    /// keeps the host relay.
    #[arg(long, value_enum, default_value_t = WeightCopies::Bind)]
    pub weight_copies: WeightCopies,
    /// KV cache element type: `f32`, or `f16` (IEEE halves, as llama.cpp's default
    /// `--cache-type-k/v f16`: half the KV memory and traffic; attention still computes
    /// in f32). The CPU backend keeps either; `cuda` only f32 and refuses `f16`.
    #[arg(long, default_value = "f32", value_parser = kv_type)]
    pub kv_type: crate::model::vocab::KvType,
}

/// `--kv-type f32|f16`.
pub fn kv_type(text: &str) -> Result<crate::model::vocab::KvType, String> {
    crate::model::vocab::KvType::parse(text)
}

/// `--weight-copies` (the runtime's [`crate::runtime::WeightCopies`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightCopies {
    /// Move labels, read weights in place.
    Bind,
    /// Copy every byte.
    Move,
}

impl From<WeightCopies> for crate::runtime::WeightCopies {
    fn from(w: WeightCopies) -> Self {
        match w {
            WeightCopies::Bind => Self::Bind,
            WeightCopies::Move => Self::Move,
        }
    }
}

/// `--set NAME=VALUE` flags as (name, value) pairs, trimmed; an empty name or a missing
/// `=` is an error naming the flag.
pub fn parse_sets(sets: &[String]) -> Result<Vec<(String, String)>, String> {
    sets.iter()
        .map(|set| match set.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                Ok((k.trim().to_string(), v.trim().to_string()))
            }
            _ => Err(format!("--set `{set}`: expected NAME=VALUE")),
        })
        .collect()
}

/// `--backend NAME`: a backend of the registry (clap lists the registry's names as the
/// possible values).
pub fn backend(
) -> impl clap::builder::TypedValueParser<Value = &'static crate::runtime::Registration> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(crate::runtime::registry::names())
        .try_map(|name: String| crate::runtime::registry::find(&name))
}

/// `--prompt` / `--prompts`: prompt texts given on the command line or in a file.
#[derive(Debug, Clone, clap::Args)]
pub struct PromptArgs {
    /// A prompt (repeat for several).
    #[arg(long = "prompt", value_name = "TEXT")]
    pub prompts: Vec<String>,
    /// JSON-lines file of prompts: `{"prompt": "..."}` or a JSON string per line.
    #[arg(long = "prompts", value_name = "FILE.jsonl")]
    pub prompts_file: Option<PathBuf>,
}

impl PromptArgs {
    /// The `--prompt` texts followed by the file's, in order; errors name the file and line.
    pub fn texts(&self) -> Result<Vec<String>, String> {
        let mut texts = self.prompts.clone();
        if let Some(path) = &self.prompts_file {
            texts.extend(read_prompt_file(path)?);
        }
        Ok(texts)
    }
}

/// Reads a JSON-lines prompt file: each non-blank line a JSON string or an object with a
/// string field `prompt`.
fn read_prompt_file(path: &Path) -> Result<Vec<String>, String> {
    let text = crate::textfile::read_capped(path, crate::textfile::PROMPTS_LIMIT)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |m: &str| format!("{}:{}: {m}", path.display(), i + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        match &value {
            serde_json::Value::String(s) => prompts.push(s.clone()),
            serde_json::Value::Object(o) => match o.get("prompt").and_then(|p| p.as_str()) {
                Some(p) => prompts.push(p.to_string()),
                None => return Err(bad("object has no string field `prompt`")),
            },
            _ => return Err(bad("expected a JSON string or an object with `prompt`")),
        }
    }
    Ok(prompts)
}

/// Reads a routing profile (`--profile FILE`, written by `moec profile`) and checks it
/// has the card's layers and experts.
pub fn load_routing_profile(
    path: &std::path::Path,
    card: &crate::model::card::ModelCard,
) -> Result<std::sync::Arc<crate::ir::profile::RoutingProfile>, String> {
    crate::ir::profile::load_for_card(path, card)
}
