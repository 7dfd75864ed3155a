//! Model cards, checkpoints, tokenizers, kernels and the reference forward pass.
//!
//! Takes a card name and/or a Hugging Face checkpoint folder; gives typed weight views,
//! the kernels the runtime shares, and the oracle every schedule is checked against.
//! Knows nothing of the schedule language.

pub mod arch;
pub mod card;
pub mod checkpoint;
pub mod config;
pub mod dense;
pub mod family;
pub mod formats;
pub mod gguf;
pub mod kernels;
pub mod layout;
pub mod mxfp4;
pub mod names;
pub mod oracle;
pub mod perplexity;
pub mod quant;
pub mod rng;
pub mod source;
pub mod synth;
pub mod tensor;
pub mod tokenizer;
pub mod weights;

pub use arch::ArchSpec;
pub use card::{
    CardError, ClampedSwiglu, DeepseekRouter, DeepseekTopk, Family, Mla, ModelCard, QkNorm,
    WeightDtype, Yarn,
};
pub use checkpoint::{Checkpoint, CheckpointError};
pub use kernels::sampling::Sampling;
pub use layout::{LayerLayout, Segment, SegmentKind};
pub use oracle::{GenerateOptions, Generation, Oracle, OracleError};
pub use tensor::{Matrix, Orientation, TypedSlice};
pub use weights::{
    DenseWeights, ExpertWeights, FusedExpert, LayerWeights, ModelWeights, QkvWeights,
    SharedExpertWeights,
};
