//! The interface a backend registers through: what it is before it exists.
//!
//! Takes nothing; gives [`Registration`], one constant per backend (`runtime::cpu`,
//! `runtime::cuda`): its name, where its `gpu` space lives, whether weight copies bind, the
//! block formats its kernels compute with, why it cannot run on this machine, how it is set
//! up for a plan ([`Open`], given a [`HostEngine`] for the plan's host streams), and what
//! the machine-facing commands ask of it: `moec devices` ([`Registration::devices`], after
//! [`Registration::link_libraries`]) and `moec probe` ([`Registration::probe`]). A backend
//! imports this module and never `runtime::registry`, the list of backends on top, so the
//! interface sits below every backend and the list above them (ggml's
//! `ggml-backend-impl.h` and `ggml-backend-reg.cpp`). Guarantees: every entry is a plain
//! function or value, callable without the backend's libraries present (a missing library
//! is a line of text, never a panic).

use super::backend::{Backend, BackendError, BackendOptions};
use super::host::HostMemory;
use super::probe::{GpuProbe, GpuProbeSizes};
use crate::lower::ExecPlan;
use crate::quant::QuantFormat;
use crate::weights::checkpoint::Checkpoint;
use std::sync::Arc;

/// Where a backend keeps the plan's `gpu` space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuSpace {
    /// In host memory (an emulated device): it counts against the machine's memory, and
    /// without a profile or `--gpu-mem` its budget is the profile's.
    Host,
    /// On a device: the machine's memory does not hold it, and without a profile or
    /// `--gpu-mem` its budget is what the device has (found at set-up).
    Device,
}

/// Sets a backend up for a plan: `(plan, checkpoint, options, host engine)`.
pub type Open = for<'c> fn(
    &ExecPlan,
    &'c Checkpoint,
    &BackendOptions,
    HostEngine,
) -> Result<Box<dyn Backend + 'c>, BackendError>;

/// Builds the engine that runs a device backend's host streams (`cpu.compute`,
/// `cpu.copy`) over host memory the device backend shares.
pub type HostEngine = for<'c> fn(
    &ExecPlan,
    Arc<HostMemory<'c>>,
    &BackendOptions,
) -> Result<Box<dyn Backend + 'c>, BackendError>;

/// One backend, as the registry knows it before it is set up.
pub struct Registration {
    /// The `--backend` value.
    pub name: &'static str,
    /// One line for `--help` and `moec devices`.
    pub about: &'static str,
    /// Where the plan's `gpu` space lives.
    pub gpu_space: GpuSpace,
    /// Whether `--weight-copies bind` takes effect (a backend computing on host memory
    /// can read a bound weight from the mapped checkpoint; a device must get the bytes).
    pub binds_weight_copies: bool,
    /// The ggml block formats its kernels compute with; a checkpoint holding a tensor in
    /// any other, or a plan with a format copy of the experts in any other, is refused
    /// before set-up, naming the tensor or the copy and its format.
    pub quant_formats: &'static [QuantFormat],
    /// The KV cache element types (`--kv-type`) its attention reads and writes; a run
    /// asking for another is refused before set-up, never run in a type it did not ask.
    pub kv_types: &'static [crate::model::vocab::KvType],
    /// Its attention reads DeepSeek MLA's values as a view of the keys (the latent cached
    /// once, `card::Mla::values_in_keys`); a run compiles an MLA card that way for it
    /// (`registry::card_for`). A backend without it keeps a V pool, and is refused a plan
    /// whose cache has none.
    pub mla_values_in_keys: bool,
    /// The scratch its device streams' tasks take ([`crate::ir::scratch::DeviceScratch`]):
    /// a compile for this backend carries them (`elaborate::Options::scratch`), so the
    /// budget counts each device stream's workspace as the backend reserves it and the
    /// language's `gpu_scratch(n, s, c)` is its bound. `None`: the op catalog's workspace
    /// (the CPU backend, whose `gpu` tasks compute on host memory), which the budget line
    /// says.
    pub scratch: Option<&'static dyn crate::ir::scratch::DeviceScratch>,
    /// Why the backend cannot run on this machine, in one line, asked before anything is
    /// loaded (`None`: it may).
    pub refusal: fn() -> Option<String>,
    /// Sets it up for a plan.
    pub open: Open,
    /// Makes the backend's libraries loadable before anything is printed or loaded for
    /// good (it may re-run the process, which the loader reads its path in only at
    /// start-up); gives a line to warn with when that failed.
    pub link_libraries: fn() -> Option<String>,
    /// What `moec devices` prints for it: whether it runs here and on what.
    pub devices: fn() -> DevicesReport,
    /// Its GPU probe, for a backend with a device (`None`: the CPU probe is all there is).
    pub probe: Option<Probe>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("name", &self.name)
            .field("gpu_space", &self.gpu_space)
            .field("binds_weight_copies", &self.binds_weight_copies)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Registration {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

/// What `moec devices` prints for one backend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevicesReport {
    /// Lines to print in order: the backend's status line first, indented details after.
    pub lines: Vec<String>,
    /// Why the command fails (exit 1) for this backend: its kernels do not build with the
    /// compiler found here (a bug in moec's kernels, with the compiler's log).
    pub failure: Option<String>,
}

/// Times the backend's own kernels and copies on its device 0 (`moec probe --backend
/// <name>`); the error is one line for a person.
pub type Probe = fn(GpuProbeSizes) -> Result<GpuProbe, String>;
