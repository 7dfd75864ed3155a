//! Model cards, checkpoints, tokenizers, kernels and the reference forward pass.
pub mod card;
pub use card::{CardError, Family, ModelCard, WeightDtype};
