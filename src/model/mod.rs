//! What a model is: cards, family facts and the packed layer layout.
//!
//! Takes a card name or a card file (a checkpoint's `config.json` is read into a card on
//! the weights floor, `weights::config`); gives [`ModelCard`],
//! [`ArchSpec`] (the math the kernels follow) and [`LayerLayout`] (where each tensor sits in
//! a layer's packed image and how many bytes it takes). The bottom of the model stack: it
//! imports only the block formats' table ([`crate::quant`]); the compiler imports nothing
//! else of the model. Knows nothing of the schedule language.

pub mod arch;
pub mod card;
pub mod cards;
pub mod family;
pub mod formats;
pub mod layout;
pub mod segment;
pub mod vocab;

/// How a tensor is stored (a float dtype or a block format), as the compiler names it
/// (`.format(q8_0)`, `substitute experts q8_0`).
pub use crate::quant::storage::Storage;
pub use crate::quant::storage::WeightDtype;
pub use arch::ArchSpec;
pub use card::{ClampedSwiglu, DeepseekRouter, DeepseekTopk, Mla, ModelCard, QkNorm, Yarn};
pub use cards::CardError;
pub use family::facts::Family;
pub use layout::{LayerLayout, Segment};
pub use segment::SegmentKind;
