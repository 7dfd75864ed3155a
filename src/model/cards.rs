//! Finding, reading and checking model cards: the built-in cards embedded in the binary,
//! cards from `.ron` files, and the checks every card passes before anything sizes by it
//! (the shared rules, then the family's own, `model::family::checks`).
//!
//! Apart from [`super::card`] (the card as data and what it derives) because the checks
//! dispatch to the families, which are built on the card.

use crate::model::card::ModelCard;
use crate::model::family::facts::Family;
use std::path::Path;

/// The cards shipped with moec, embedded so the binary needs no files at run time.
const BUILTIN_CARDS: &[(&str, &str)] = &[
    (
        "mixtral-8x7b",
        include_str!("../../models/mixtral-8x7b.ron"),
    ),
    (
        "mixtral-8x22b",
        include_str!("../../models/mixtral-8x22b.ron"),
    ),
    ("dbrx", include_str!("../../models/dbrx.ron")),
    ("mixtral-mid", include_str!("../../models/mixtral-mid.ron")),
    ("dbrx-mid", include_str!("../../models/dbrx-mid.ron")),
    (
        "mixtral-tiny",
        include_str!("../../models/mixtral-tiny.ron"),
    ),
    ("dbrx-tiny", include_str!("../../models/dbrx-tiny.ron")),
    (
        "qwen3-30b-a3b",
        include_str!("../../models/qwen3-30b-a3b.ron"),
    ),
    (
        "qwen3-235b-a22b",
        include_str!("../../models/qwen3-235b-a22b.ron"),
    ),
    (
        "qwen3-moe-mid",
        include_str!("../../models/qwen3-moe-mid.ron"),
    ),
    (
        "qwen3-moe-tiny",
        include_str!("../../models/qwen3-moe-tiny.ron"),
    ),
    (
        "qwen2-57b-a14b",
        include_str!("../../models/qwen2-57b-a14b.ron"),
    ),
    (
        "qwen2-moe-mid",
        include_str!("../../models/qwen2-moe-mid.ron"),
    ),
    (
        "qwen2-moe-tiny",
        include_str!("../../models/qwen2-moe-tiny.ron"),
    ),
    ("olmoe-1b-7b", include_str!("../../models/olmoe-1b-7b.ron")),
    ("olmoe-mid", include_str!("../../models/olmoe-mid.ron")),
    ("olmoe-tiny", include_str!("../../models/olmoe-tiny.ron")),
    ("gpt-oss-20b", include_str!("../../models/gpt-oss-20b.ron")),
    (
        "gpt-oss-120b",
        include_str!("../../models/gpt-oss-120b.ron"),
    ),
    ("gpt-oss-mid", include_str!("../../models/gpt-oss-mid.ron")),
    (
        "gpt-oss-tiny",
        include_str!("../../models/gpt-oss-tiny.ron"),
    ),
    (
        "deepseek-v2-lite",
        include_str!("../../models/deepseek-v2-lite.ron"),
    ),
    ("deepseek-v3", include_str!("../../models/deepseek-v3.ron")),
    (
        "deepseek-v2-tiny",
        include_str!("../../models/deepseek-v2-tiny.ron"),
    ),
    (
        "deepseek-v3-tiny",
        include_str!("../../models/deepseek-v3-tiny.ron"),
    ),
];

/// Errors from finding or reading a model card.
#[derive(Debug, thiserror::Error)]
pub enum CardError {
    /// The name is neither a built-in card nor a readable `.ron` file.
    #[error("unknown model card `{name}` (known: {known}); pass a built-in name or a path to a .ron card")]
    Unknown {
        /// What the user asked for.
        name: String,
        /// Comma-separated built-in names.
        known: String,
    },
    /// The card file could not be read.
    #[error("cannot read model card {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying cause, as the library or the OS reported it.
        source: std::io::Error,
    },
    /// The card is not valid RON for a [`ModelCard`].
    #[error("model card {origin} is malformed: {message}")]
    Parse {
        /// File or built-in name.
        origin: String,
        /// The RON error.
        message: String,
    },
    /// The card parsed but its dimensions are inconsistent.
    #[error("model card {origin} is inconsistent: {message}")]
    Invalid {
        /// File or built-in name.
        origin: String,
        /// What is wrong.
        message: String,
    },
}

impl ModelCard {
    /// Names of the built-in cards, in listing order.
    pub fn builtin_names() -> impl Iterator<Item = &'static str> {
        BUILTIN_CARDS.iter().map(|(name, _)| *name)
    }

    /// All built-in cards.
    pub fn builtins() -> Vec<ModelCard> {
        BUILTIN_CARDS
            .iter()
            .map(|(name, text)| {
                Self::from_ron(text, name).unwrap_or_else(|e| panic!("built-in card {name}: {e}"))
            })
            .collect()
    }

    /// Finds a card by built-in name, or reads it from a `.ron` path.
    pub fn load(name_or_path: &str) -> Result<ModelCard, CardError> {
        if let Some((name, text)) = BUILTIN_CARDS.iter().find(|(n, _)| *n == name_or_path) {
            return Self::from_ron(text, name);
        }
        let path = Path::new(name_or_path);
        if path.extension().is_some_and(|e| e == "ron") || path.exists() {
            let text = crate::textfile::read_capped(path, crate::textfile::SOURCE_LIMIT).map_err(
                |source| CardError::Io {
                    path: path.display().to_string(),
                    source,
                },
            )?;
            return Self::from_ron(&text, &path.display().to_string());
        }
        Err(CardError::Unknown {
            name: name_or_path.to_string(),
            known: Self::builtin_names().collect::<Vec<_>>().join(", "),
        })
    }

    /// Parses and validates a card from RON text; `origin` names it in errors.
    pub fn from_ron(text: &str, origin: &str) -> Result<ModelCard, CardError> {
        let card: ModelCard = ron::from_str(text).map_err(|e| CardError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        card.validate().map_err(|message| CardError::Invalid {
            origin: origin.to_string(),
            message,
        })?;
        Ok(card)
    }

    /// Checks the dimensions are usable: non-zero, heads divisible, top-k within experts.
    pub fn validate(&self) -> Result<(), String> {
        let dims = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("ffn", self.ffn),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("vocab", self.vocab),
            ("max_positions", self.max_positions),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return Err(format!("`{name}` must be positive"));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "heads ({}) must be a multiple of kv_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim
            ));
        }
        if self.top_k > self.experts {
            return Err(format!(
                "top_k ({}) exceeds experts ({})",
                self.top_k, self.experts
            ));
        }
        let positive_finite = |v: f64| v.is_finite() && v > 0.0;
        if !(positive_finite(self.rope_theta) && positive_finite(self.norm_eps)) {
            return Err("rope_theta and norm_eps must be positive and finite".to_string());
        }
        if self.sliding_window == Some(0) {
            return Err(
                "sliding_window must be at least 1 (or null for full attention)".to_string(),
            );
        }
        if let Some(y) = self.yarn {
            let ok = y.factor.is_finite()
                && y.factor >= 1.0
                && y.beta_fast.is_finite()
                && y.beta_slow.is_finite()
                && y.beta_fast > 0.0
                && y.beta_slow > 0.0
                && y.original_max_positions > 0;
            if !ok {
                return Err(format!("yarn rope scaling {y:?} is not usable"));
            }
        }
        if self.alternate_sliding && self.sliding_window.is_none() {
            return Err("alternate_sliding needs a sliding_window".to_string());
        }
        if let Some(c) = self.clamped_swiglu {
            if !(c.alpha.is_finite() && c.limit.is_finite() && c.limit > 0.0) {
                return Err(format!("clamped_swiglu {c:?} is not usable"));
            }
        }
        if (self.family == Family::GptOss) != self.clamped_swiglu.is_some() {
            return Err("clamped_swiglu is set exactly for the GptOss family".to_string());
        }
        if self.shared_gate && self.shared_ffn == 0 {
            return Err("shared_gate needs a shared expert (shared_ffn > 0)".to_string());
        }
        self.validate_family_fields()?;
        crate::model::family::checks::check_card(self)?;
        if let Some(clip) = self.clip_qkv.filter(|c| !(c.is_finite() && *c > 0.0)) {
            return Err(format!(
                "clip_qkv ({clip}) must be a positive finite bound (or null for none)"
            ));
        }
        Ok(())
    }

    /// DeepSeek's fields are set exactly for the DeepSeek families (what they must then
    /// satisfy is the family's own check).
    fn validate_family_fields(&self) -> Result<(), String> {
        let deepseek = matches!(self.family, Family::DeepseekV2 | Family::DeepseekV3);
        if deepseek != (self.mla.is_some() && self.deepseek_router.is_some()) {
            return Err("mla and deepseek_router are set exactly for the DeepSeek families".into());
        }
        if !deepseek && (self.dense_layers > 0 || self.dense_ffn > 0) {
            return Err("dense_layers / dense_ffn are DeepSeek fields".into());
        }
        Ok(())
    }
}
