//! What every family's config.json reader shares: the error type and a typed reader of
//! dotted fields that names the file and field in every error.

use crate::quant::storage::WeightDtype;
use serde_json::{Map, Value};

/// Problems with a `config.json`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or not an object.
    #[error("{path}: not a valid config.json: {message}")]
    Json {
        /// The file.
        path: String,
        /// Parser message.
        message: String,
    },
    /// `model_type` names no family moec implements.
    #[error("{path}: model_type `{model_type}` is not supported (expected one of mixtral, dbrx, qwen2_moe, qwen3_moe, olmoe, gpt_oss, deepseek_v2, deepseek_v3)")]
    ModelType {
        /// The file.
        path: String,
        /// What it says.
        model_type: String,
    },
    /// A required field is absent.
    #[error("{path}: missing field `{field}`")]
    Missing {
        /// The file.
        path: String,
        /// Dotted field name.
        field: String,
    },
    /// A field has an unusable value.
    #[error("{path}: field `{field}` {message}")]
    Invalid {
        /// The file.
        path: String,
        /// Dotted field name.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The config contradicts the card chosen with `--model`.
    #[error("{path}: `{field}` is {config_value} but card `{card}` has {card_value}")]
    Mismatch {
        /// The file.
        path: String,
        /// Card name.
        card: String,
        /// config.json field name.
        field: String,
        /// Value in config.json.
        config_value: String,
        /// Value in the card.
        card_value: String,
    },
}

/// The top-level object of one config.json, read by dotted field name (`attn_config.
/// rope_theta`); a JSON `null` reads as absent, as transformers treats it.
pub struct Fields<'a> {
    path: &'a str,
    root: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// Reads `root`; `path` names the file in errors.
    pub fn new(path: &'a str, root: &'a Map<String, Value>) -> Self {
        Fields { path, root }
    }

    /// The file's name, as errors give it.
    pub fn path(&self) -> &'a str {
        self.path
    }

    /// A top-level field as written, `null` included (where null and absent differ).
    pub fn raw(&self, field: &str) -> Option<&'a Value> {
        self.root.get(field)
    }

    /// The value at a dotted path; `None` if absent or null.
    pub fn get(&self, dotted: &str) -> Option<&'a Value> {
        let mut cur = self.root;
        let mut parts = dotted.split('.').peekable();
        while let Some(p) = parts.next() {
            let v = cur.get(p)?;
            if parts.peek().is_none() {
                return (!v.is_null()).then_some(v);
            }
            cur = v.as_object()?;
        }
        None
    }

    /// A string field; `None` if absent, null or not a string.
    pub fn str(&self, field: &str) -> Option<&'a str> {
        self.get(field).and_then(Value::as_str)
    }

    /// The error for a field with an unusable value.
    pub fn invalid(&self, field: &str, message: &str) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_string(),
            field: field.to_string(),
            message: message.to_string(),
        }
    }

    /// The error for a required field that is absent.
    pub fn missing(&self, field: &str) -> ConfigError {
        ConfigError::Missing {
            path: self.path.to_string(),
            field: field.to_string(),
        }
    }

    /// A non-negative integer, if present.
    pub fn opt_uint(&self, field: &str) -> Result<Option<u64>, ConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.invalid(field, "must be a non-negative integer")),
        }
    }

    /// A required non-negative integer.
    pub fn uint(&self, field: &str) -> Result<u64, ConfigError> {
        self.opt_uint(field)?.ok_or_else(|| self.missing(field))
    }

    /// A required positive integer (a count other dimensions are divided by: heads).
    pub fn positive_uint(&self, field: &str) -> Result<u64, ConfigError> {
        match self.uint(field)? {
            0 => Err(self.invalid(field, "must be positive")),
            v => Ok(v),
        }
    }

    /// A number, if present.
    pub fn opt_float(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.invalid(field, "must be a number")),
        }
    }

    /// A boolean, `default` if absent.
    pub fn flag(&self, field: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.invalid(field, "must be true or false")),
        }
    }

    /// An id that may be written as an integer or a list of integers (first wins).
    pub fn opt_token(&self, field: &str) -> Result<Option<u32>, ConfigError> {
        let v = match self.get(field) {
            None => return Ok(None),
            Some(Value::Array(a)) => match a.first() {
                None => return Ok(None),
                Some(v) => v,
            },
            Some(v) => v,
        };
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| self.invalid(field, "must be a token id"))
    }

    /// The rotary base in the Llama-style spellings: top-level `rope_theta`, else
    /// `rope_parameters.rope_theta` (transformers 5).
    pub fn rope_theta(&self) -> Result<Option<f64>, ConfigError> {
        match self.opt_float("rope_theta")? {
            Some(t) => Ok(Some(t)),
            None => self.opt_float("rope_parameters.rope_theta"),
        }
    }
}

/// The `torch_dtype` spelling of a weight dtype.
pub fn torch_dtype(dtype: WeightDtype) -> &'static str {
    match dtype {
        WeightDtype::Bf16 => "bfloat16",
        WeightDtype::F16 => "float16",
        WeightDtype::F32 => "float32",
    }
}
