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
use crate::model::card::ModelCard;
use crate::quant::storage::Storage;
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
/// else; and, for the same reason, a plan with a format copy of the experts
/// (`W[l].expert(e).format(..)`) in such a format, naming the copy.
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
    let plan_kv = plan
        .tasks
        .iter()
        .find(|t| matches!(t.op, crate::ir::Op::Attn { .. }))
        .map_or(4, |t| t.shape.kv_bytes);
    let kv_type = crate::model::vocab::KvType::of_bytes(plan_kv);
    if let Some(why) = kv_type.map_or_else(
        || {
            Some(format!(
                "the plan's KV cache has {plan_kv}-byte elements, which no backend stores"
            ))
        },
        |kv| kv_type_refusal(backend, kv),
    ) {
        return Err(BackendError::Unavailable(why));
    }
    if let Some(why) = mla_layout_refusal(backend, &plan.model) {
        return Err(BackendError::Unavailable(why));
    }
    let copies = plan.format_copies.iter().map(|copy| {
        let name = plan
            .buffers
            .get(copy.buffer.index())
            .map_or("a format copy", |b| b.name.as_str());
        (name, copy.format)
    });
    if let Some(why) = format_copy_refusal(backend, copies) {
        return Err(BackendError::Unavailable(why));
    }
    (backend.open)(plan, checkpoint, options, super::cpu::host_engine)
}

/// `card` as a run on `backend` compiles it: an MLA card's cache keeps the latent once
/// (V a view of K) where the backend's attention reads it so, else K and V pools
/// (`card::Mla::values_in_keys`). The plan's `kv_cache` sizes, KV copies and memory budget
/// then count the bytes that backend's attention stores.
pub fn card_for(backend: &Registration, card: &ModelCard) -> ModelCard {
    let mut card = card.clone();
    if let Some(m) = card.mla.as_mut() {
        m.values_in_keys = backend.mla_values_in_keys;
    }
    card
}

/// Why `backend` cannot run a plan for `card`'s KV layout, in one line: an MLA cache with
/// no V pool on a backend whose attention reads one. `None` when it can.
fn mla_layout_refusal(backend: &Registration, card: &ModelCard) -> Option<String> {
    let lone = card.mla.is_some_and(|m| m.values_in_keys);
    (lone && !backend.mla_values_in_keys).then(|| {
        format!(
            "the plan's MLA KV cache keeps the latent once (V read from K); the {} backend's \
             attention reads a V pool: compile the card for it (`registry::card_for`)",
            backend.name
        )
    })
}

/// Why `backend` cannot keep its KV cache in `kv_type` (`--kv-type`), in one line; `None`
/// when it can. Asked before anything is loaded, and again when a plan is opened: a
/// backend never runs a cache type other than the one asked for.
pub fn kv_type_refusal(
    backend: &Registration,
    kv_type: crate::model::vocab::KvType,
) -> Option<String> {
    if backend.kv_types.contains(&kv_type) {
        return None;
    }
    let known: Vec<&str> = backend.kv_types.iter().map(|t| t.name()).collect();
    Some(format!(
        "`--kv-type {}`: the {} backend's attention keeps its KV cache in {} only; run with \
         --kv-type {} or --backend cpu",
        kv_type.name(),
        backend.name,
        known.join(", "),
        known.first().copied().unwrap_or("f32"),
    ))
}

/// Why `backend` cannot compute with the format copies `copies` (buffer name, format),
/// naming the first in a block format its kernels do not decode: an expert found only in
/// that copy would be multiplied as something else. (A copy in a float format is refused
/// by every backend when the host side makes the copies, `runtime::host::format_copy`.)
fn format_copy_refusal<'a>(
    backend: &Registration,
    mut copies: impl Iterator<Item = (&'a str, Storage)>,
) -> Option<String> {
    let (name, format) = copies.find(|(_, f)| {
        f.quant()
            .is_some_and(|q| !backend.quant_formats.contains(&q))
    })?;
    let known: Vec<&str> = backend.quant_formats.iter().map(|f| f.name()).collect();
    Some(format!(
        "`{name}` holds the experts in {} (a format copy named by `.format(..)`), which the \
         {} backend's kernels do not compute with (they decode {}); run with --backend cpu",
        format.name(),
        backend.name,
        if known.is_empty() {
            "no block format".to_string()
        } else {
            known.join(", ")
        }
    ))
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

    /// A run compiles an MLA card with the latent cached once for the CPU backend and with
    /// a V pool for the CUDA one (576 and 1,152 elements a token and layer on
    /// DeepSeek-V2-Lite); the CUDA backend refuses a plan whose cache has no V pool, in one
    /// line naming it, the CPU backend reads either; a card without MLA is left as it is.
    #[test]
    fn mla_cards_are_compiled_for_the_backend_s_kv_layout() {
        let (cpu, cuda) = (find("cpu").unwrap(), find("cuda").unwrap());
        let lite = ModelCard::load("deepseek-v2-lite").unwrap();
        let (on_cpu, on_cuda) = (card_for(cpu, &lite), card_for(cuda, &lite));
        assert_eq!(on_cpu.kv_elems_per_token_layer(), 576);
        assert_eq!(on_cuda.kv_elems_per_token_layer(), 1152);
        assert_eq!(mla_layout_refusal(cpu, &on_cpu), None);
        assert_eq!(mla_layout_refusal(cpu, &on_cuda), None);
        assert_eq!(mla_layout_refusal(cuda, &on_cuda), None);
        let why = mla_layout_refusal(cuda, &on_cpu).expect("refused");
        assert!(
            why.contains("the cuda backend's attention reads a V pool"),
            "{why}"
        );
        let mixtral = ModelCard::load("mixtral-tiny").unwrap();
        assert_eq!(card_for(cpu, &mixtral), mixtral);
    }

    /// `--kv-type f16` runs on the CPU backend and is refused by the CUDA one in one line
    /// that names the flag, the backend and the type it keeps; f32 runs on both.
    #[test]
    fn a_half_kv_cache_is_refused_where_the_attention_keeps_f32_only() {
        use crate::model::vocab::KvType;
        let cpu = find("cpu").expect("cpu registered");
        let cuda = find("cuda").expect("cuda registered");
        assert_eq!(kv_type_refusal(cpu, KvType::F16), None);
        assert_eq!(kv_type_refusal(cpu, KvType::F32), None);
        assert_eq!(kv_type_refusal(cuda, KvType::F32), None);
        let why = kv_type_refusal(cuda, KvType::F16).expect("f16 refused on cuda");
        assert!(
            why.starts_with(
                "`--kv-type f16`: the cuda backend's attention keeps its KV cache in f32 only"
            ),
            "{why}"
        );
    }

    /// A format copy of the experts runs on every backend whose kernels decode its format
    /// (q8_0, q4_k, q6_k: the CUDA backend's quantised expert kernels); one in a format a
    /// backend lacks (the CUDA kernels have no Q5_0 decoder) is refused before set-up,
    /// naming the copy's buffer and format, the first such copy of several.
    #[test]
    fn format_copies_are_refused_only_in_formats_a_backend_lacks() {
        let copies = [
            ("W.q8_0", Storage::Quant(QuantFormat::Q8_0)),
            ("W.q4_k", Storage::Quant(QuantFormat::Q4K)),
            ("W.q6_k", Storage::Quant(QuantFormat::Q6K)),
        ];
        for b in BACKENDS {
            assert_eq!(
                format_copy_refusal(b, copies.into_iter()),
                None,
                "{}",
                b.name
            );
        }
        let with_q5 = [
            ("W.q8_0", Storage::Quant(QuantFormat::Q8_0)),
            ("W.q5_0", Storage::Quant(QuantFormat::Q5_0)),
        ];
        let cuda = find("cuda").expect("cuda registered");
        let why = format_copy_refusal(cuda, with_q5.into_iter()).expect("Q5_0 refused on cuda");
        assert!(
            why.starts_with("`W.q5_0` holds the experts in Q5_0 (a format copy named by `.format(..)`), which the cuda backend's kernels do not compute with (they decode "),
            "{why}"
        );
        assert!(
            !why.contains("Q5_0,") && why.ends_with("; run with --backend cpu"),
            "{why}"
        );
        let cpu = find("cpu").expect("cpu registered");
        assert_eq!(format_copy_refusal(cpu, with_q5.into_iter()), None);
    }
}
