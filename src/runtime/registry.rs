//! The backends a plan can run on, by name: the one place that picks a backend.
//!
//! Takes a `--backend` name; gives its [`Registration`] (`runtime::registration`: what the
//! backend is before it exists and how to set it up) from [`BACKENDS`], the list of every
//! backend. Nothing outside this module (and the backend's own) branches on which backend
//! runs: the run API (`crate::engine`), the CLI and the report ask the registration or the
//! [`Backend`] itself.
//!
//! This is the list on top of the interface, as ggml's `ggml-backend-reg.cpp` includes every
//! backend while backends include only `ggml-backend-impl.h`: a backend imports
//! `runtime::registration`, never this module. Adding a backend is a module
//! `runtime/<name>/` with a `REGISTRATION` constant and one line in [`BACKENDS`]. A device
//! backend is given a host engine ([`HostEngine`]) for its plan's `cpu.*` streams: [`open`]
//! hands it the CPU backend over the same host memory, so device backends sit beside the
//! CPU backend rather than on top of it.

use super::backend::{Backend, BackendError, BackendOptions};
use crate::lower::ExecPlan;
use crate::quant::QuantFormat;
use crate::weights::checkpoint::Checkpoint;

// Where the interface lived before it had its own module; the engine still names it here.
use super::registration::Registration;

/// Every backend, the default first.
pub const BACKENDS: &[&Registration] = &[&super::cpu::REGISTRATION, &super::cuda::REGISTRATION];

/// The default backend (the CPU's: always available).
pub fn default_backend() -> &'static Registration {
    BACKENDS[0]
}

/// A `--backend` name no backend has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend `{name}` (known: {known})")]
pub struct UnknownBackend {
    /// The name asked for.
    pub name: String,
    /// The names there are, comma separated.
    pub known: String,
}

/// The backend called `name`.
pub fn find(name: &str) -> Result<&'static Registration, UnknownBackend> {
    BACKENDS
        .iter()
        .copied()
        .find(|b| b.name == name)
        .ok_or_else(|| UnknownBackend {
            name: name.to_string(),
            known: names().join(", "),
        })
}

/// Every backend's name, the default first.
pub fn names() -> Vec<&'static str> {
    BACKENDS.iter().map(|b| b.name).collect()
}

/// Sets `backend` up for `plan` over `checkpoint`, giving a device backend the CPU
/// backend as its host engine. A backend is refused a checkpoint with a block-quantised
/// tensor in a format its kernels do not compute with ([`Registration::quant_formats`]),
/// naming the first such tensor and its format: it would read the blocks as something
/// else.
pub fn open<'c>(
    backend: &Registration,
    plan: &ExecPlan,
    checkpoint: &'c Checkpoint,
    options: &BackendOptions,
) -> Result<Box<dyn Backend + 'c>, BackendError> {
    if let Some(why) = quant_refusal(backend, checkpoint.quantised_tensors()) {
        return Err(BackendError::Unavailable(format!(
            "{}: {why}",
            checkpoint.dir().display()
        )));
    }
    // Only the CPU backend's expert products find an expert in a format copy
    // (`WeightTag::Converted`); a device backend would miss it mid-run, so it is refused
    // here, naming the copy.
    if let Some(copy) = plan.format_copies.first().filter(|_| backend.name != "cpu") {
        let name = plan
            .buffers
            .get(copy.buffer.index())
            .map_or("a format copy", |b| b.name.as_str());
        return Err(BackendError::Unavailable(format!(
            "the {} backend does not compute with format copies of the experts yet (`{name}`: experts in {}, named by `.format(..)`); run with --backend cpu",
            backend.name,
            copy.format.name()
        )));
    }
    (backend.open)(plan, checkpoint, options, super::cpu::host_engine)
}

/// Why `backend` cannot compute with `tensors` (name, block format), naming the first it
/// has no kernels for.
fn quant_refusal<'a>(
    backend: &Registration,
    mut tensors: impl Iterator<Item = (&'a str, QuantFormat)>,
) -> Option<String> {
    let (tensor, format) = tensors.find(|(_, f)| !backend.quant_formats.contains(f))?;
    let known: Vec<&str> = backend.quant_formats.iter().map(|f| f.name()).collect();
    Some(format!(
        "tensor `{tensor}` is stored as {format}; the {} backend computes with {} only; \
         run with --backend cpu",
        backend.name,
        if known.is_empty() {
            "float weights".to_string()
        } else {
            format!("float weights and {}", known.join(", "))
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found_and_unknown_names_list_the_known() {
        let all = names();
        let mut unique = all.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), all.len(), "{all:?}");
        for name in &all {
            assert_eq!(find(name).map(|b| b.name), Ok(*name));
        }
        assert_eq!(default_backend().name, "cpu");
        let err = find("tpu").expect_err("no such backend");
        assert_eq!(err.to_string(), "unknown backend `tpu` (known: cpu, cuda)");
    }

    /// Every backend computes with every block format moec reads (a GGUF's Q4_K_M runs on
    /// the CUDA backend too); a backend without a format's kernels is refused, naming the
    /// tensor and the format.
    #[test]
    fn quantised_tensors_are_refused_only_in_formats_a_backend_lacks() {
        let tensors = [
            ("blk.0.attn_q.weight", QuantFormat::Q4K),
            ("output.weight", QuantFormat::Q6K),
        ];
        for b in BACKENDS {
            assert_eq!(quant_refusal(b, tensors.into_iter()), None, "{}", b.name);
        }
        // The CUDA kernels have no Q5_0 decoder: the tensor and its format are named.
        let cuda = find("cuda").expect("cuda registered");
        let q5 = [("blk.0.attn_kv_a_mqa.weight", QuantFormat::Q5_0)];
        let why = quant_refusal(cuda, q5.into_iter()).expect("Q5_0 refused on cuda");
        assert!(
            why.starts_with("tensor `blk.0.attn_kv_a_mqa.weight` is stored as Q5_0; the cuda backend computes with"),
            "{why}"
        );
        assert!(
            !why.contains("Q5_0,") && why.ends_with("run with --backend cpu"),
            "{why}"
        );
        let cpu = find("cpu").expect("cpu registered");
        assert_eq!(quant_refusal(cpu, q5.into_iter()), None);
        let partial = Registration {
            name: "partial",
            quant_formats: &[QuantFormat::Q4K],
            ..*BACKENDS[1]
        };
        let why = quant_refusal(&partial, tensors.into_iter()).expect("Q6_K refused");
        assert!(
            why.starts_with("tensor `output.weight` is stored as Q6_K; the partial backend computes with float weights and Q4_K only"),
            "{why}"
        );
    }
}
