//! Weight I/O: checkpoint maps (safetensors folders and GGUF files), the GGUF reader,
//! tokenizers, synthetic checkpoints, and resolving what the user asked for into a loaded
//! model.
//!
//! Takes paths and model cards; gives [`checkpoint::Checkpoint`] (typed weight views over
//! memory maps) and tokenizers. Knows nothing of the schedule language.

pub mod checkpoint;
pub mod config;
pub mod family;
pub mod gguf;
pub mod names;
pub mod source;
pub mod synth;
pub mod tokenizer;
