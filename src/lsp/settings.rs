//! The server's settings: the card, hardware and workload every document is compiled for,
//! from the client's `initializationOptions`.
//!
//! `{"model": "mixtral-tiny", "hw": "t4"}` is the usual form; every key is optional and
//! each default is `moec check`'s (card `mixtral-tiny`, no hardware profile, batch 64,
//! prompt_len 128, gen_len 32, the default backend). Keys: `model`, `hw`, `weightFormat`,
//! `set` (a list of `NAME=VALUE`), `batch`, `promptLen`, `genLen`, `backend`.

use crate::compile::Options;
use crate::cost::hardware::HardwareProfile;
use crate::ir::Workload;
use crate::model::card::ModelCard;
use serde::Deserialize;

/// Loads a card by name, `.ron` or `.gguf` path, with `--weight-format`'s classes on top,
/// as the named backend runs it (the CLI's loader, handed in so this module does not
/// import the CLI).
pub type CardLoader =
    fn(&str, Option<&str>, &crate::runtime::Registration) -> Result<ModelCard, String>;

/// The card a document is compiled for when the client names none (`moec check`'s).
pub const DEFAULT_MODEL: &str = "mixtral-tiny";

/// `initializationOptions` as the client sends them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Settings {
    /// A built-in card, a `.ron` or a `.gguf` path (`--model`).
    pub model: Option<String>,
    /// A hardware profile (`--hw`): its symbols and the memory budgets.
    pub hw: Option<String>,
    /// Formats per weight class (`--weight-format`).
    pub weight_format: Option<String>,
    /// Param overrides `NAME=VALUE` (`--set`).
    pub set: Vec<String>,
    /// Sequences in the batch (`--batch`).
    pub batch: Option<u64>,
    /// Prompt tokens per sequence (`--prompt-len`).
    pub prompt_len: Option<u64>,
    /// Generated tokens per sequence (`--gen-len`).
    pub gen_len: Option<u64>,
    /// The backend whose scratch rules and KV layout the budget counts (`--backend`).
    pub backend: Option<String>,
}

/// What every document is compiled with.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The compiler's options (card, workload, sets, hardware symbols).
    pub options: Options,
    /// The hardware profile, when one is named: `check` then checks the memory budgets.
    pub hardware: Option<HardwareProfile>,
    /// The hardware profile's name as given (`t4`).
    pub hardware_name: Option<String>,
}

impl Setup {
    /// "mixtral-tiny on t4" or "mixtral-tiny, no hardware profile", for hovers.
    pub fn describe(&self) -> String {
        match &self.hardware_name {
            Some(hw) => format!("{} on {hw}", self.options.model.label()),
            None => format!("{}, no hardware profile", self.options.model.label()),
        }
    }
}

impl Settings {
    /// The keys `initializationOptions` may hold.
    pub const KEYS: [&'static str; 8] = [
        "model",
        "hw",
        "weightFormat",
        "set",
        "batch",
        "promptLen",
        "genLen",
        "backend",
    ];

    /// Reads `initializationOptions` (`null` or absent: the defaults). Unknown keys are
    /// left out and named in the second value, to be said to the user; the known ones
    /// still apply.
    pub fn from_json(value: Option<serde_json::Value>) -> Result<(Settings, Vec<String>), String> {
        let mut map = match value {
            None | Some(serde_json::Value::Null) => return Ok((Settings::default(), Vec::new())),
            Some(serde_json::Value::Object(map)) => map,
            Some(other) => return Err(format!("initializationOptions: {other} is not an object")),
        };
        let unknown: Vec<String> = map
            .keys()
            .filter(|k| !Settings::KEYS.contains(&k.as_str()))
            .cloned()
            .collect();
        for key in &unknown {
            map.remove(key);
        }
        let settings = serde_json::from_value(serde_json::Value::Object(map))
            .map_err(|e| format!("initializationOptions: {e}"))?;
        Ok((settings, unknown))
    }

    /// Loads the card and profile the settings name.
    pub fn resolve(&self, load_card: CardLoader) -> Result<Setup, String> {
        let model = self.model.as_deref().unwrap_or(DEFAULT_MODEL);
        // None named: `moec run`'s default backend, as every command naming none.
        let backend = match &self.backend {
            Some(name) => {
                crate::runtime::registry::find(name).map_err(|e| format!("backend: {e}"))?
            }
            None => crate::runtime::registry::default_backend(),
        };
        let card = load_card(model, self.weight_format.as_deref(), backend)?;
        let mut options = Options::new(card);
        options.scratch = backend.scratch;
        let defaults = Workload::default();
        options.workload = Workload {
            batch: self.batch.unwrap_or(defaults.batch),
            prompt_len: self.prompt_len.unwrap_or(defaults.prompt_len),
            gen_len: self.gen_len.unwrap_or(defaults.gen_len),
        };
        if options.workload.batch == 0 {
            return Err("batch: must be at least 1".to_string());
        }
        for set in &self.set {
            match set.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => options
                    .sets
                    .push((k.trim().to_string(), v.trim().to_string())),
                _ => return Err(format!("set: `{set}` is not NAME=VALUE")),
            }
        }
        let hardware = match &self.hw {
            Some(hw) => {
                let profile = HardwareProfile::load(hw).map_err(|e| format!("hw: {e}"))?;
                options.hardware = profile
                    .symbols()
                    .into_iter()
                    .map(|(name, value)| (name.to_string(), value))
                    .collect();
                Some(profile)
            }
            None => None,
        };
        Ok(Setup {
            options,
            hardware,
            hardware_name: self.hw.clone(),
        })
    }
}
