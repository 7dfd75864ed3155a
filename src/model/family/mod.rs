//! What a model family is to the model: its math facts as a const table
//! ([`facts::FACTS`], one row per family, in the style of llama.cpp's `llama-arch.cpp`) and
//! the rules its cards must satisfy beyond the shared ones ([`checks`]).
//!
//! How a family's checkpoints spell a card and name their tensors (Hugging Face and GGUF)
//! is the weights floor's: one module per family under `weights::family`. Nothing else in
//! `model` matches on a [`Family`]; it reads the facts (`family.facts()`).

pub mod checks;
pub mod facts;

pub use facts::{Family, FamilyFacts, FAMILIES, MXFP4_UNCONVERTED};
