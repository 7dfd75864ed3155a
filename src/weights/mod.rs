//! Weight I/O: checkpoint maps (safetensors folders and GGUF files), the GGUF reader,
//! tokenizers, synthetic checkpoints, resolving what the user asked for into a loaded
//! model, and how each family's checkpoints spell it (one module per family in
//! [`family`]: its Hub config and tensor names, its GGUF row; [`config`] and [`names`]
//! dispatch to them).
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
pub mod tokenizer_json;
