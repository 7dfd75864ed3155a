//! Command-line inputs shared by the commands that run a model (`generate`, `run`,
//! `ablate`): which model, which prompts, and how a schedule is run. One definition, so the flags read and
//! behave the same everywhere.

use crate::model::source::ModelSource;
use std::path::{Path, PathBuf};

/// `--model` / `--weights`: where the model comes from.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model card (built-in name or .ron path); default mixtral-tiny when --weights is absent.
    #[arg(long)]
    pub model: Option<String>,
    /// Hugging Face checkpoint folder (config.json + safetensors).
    #[arg(long, value_name = "DIR")]
    pub weights: Option<PathBuf>,
}

impl ModelArgs {
    /// The model source these flags name (the embedded default when both are absent).
    pub fn source(&self) -> ModelSource {
        ModelSource {
            card: self.model.clone(),
            weights: self.weights.clone(),
        }
    }
}

/// How `run` and `ablate` execute a schedule: workload, param overrides, pools, the
/// emulated link and device memory, and the profile predictions are made for.
#[derive(Debug, Clone, clap::Args)]
pub struct RunSettings {
    /// Synthetic prompts: `mtbench[:COUNT]` or `count=N,mean=M,max=X[,min=A][,gen=G][,seed=S]`.
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
    #[arg(long, value_name = "GBPS")]
    pub link_gbps: Option<f64>,
    /// Device memory for the `gpu` arena, e.g. `64MB` (default: the profile's).
    #[arg(long, value_name = "BYTES")]
    pub gpu_mem: Option<String>,
    /// Hardware profile for the HRM prediction (name or .ron path); default: measure this
    /// machine quickly.
    #[arg(long, value_name = "PROFILE")]
    pub hw: Option<String>,
    /// Backend that executes the plan: `cpu`, or `cuda` (checked first; executing plans on
    /// CUDA is not built yet, so it fails naming what is missing).
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
}

/// Which backend executes a lowered plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The CPU backend (`runtime`).
    Cpu,
    /// The CUDA backend (detection and kernels only so far).
    Cuda,
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
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
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
