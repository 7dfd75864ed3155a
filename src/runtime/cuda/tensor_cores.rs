//! Which kernels run on tensor cores (issue 44): the process's `MOEC_TENSOR_CORES` choice
//! (`auto`, `always`, `never`), the thresholds `auto` uses for the grouped expert products
//! (`super::moe`) and prefill attention (`super::attention`), and what the run report says
//! of it. An unknown value is an error naming it, never a silent default.

/// Mean routed rows per expert from which bf16 experts run on tensor cores
/// (`moe_grouped_mma`) instead of `moe_grouped_gemv` (issue 44: tensor-core tiles from 8
/// rows per expert; where the two cross on a GPU is still to be measured, docs/gpu.md's
/// "Tensor cores"). The host does not read the routing, so the mean is the call's routed
/// entries over the experts that can have any: `entries / min(members, entries)`.
pub(super) const MMA_MIN_ROWS: usize = 8;

/// When the grouped expert products of bf16 experts take the tensor-core kernel
/// (`MOEC_TENSOR_CORES`: `auto`, the default, from [`MMA_MIN_ROWS`] mean rows per expert;
/// `always`; `never`), to compare the two kernels on one machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorCores {
    /// From [`MMA_MIN_ROWS`] mean routed rows per expert.
    Auto,
    /// Whenever the experts are bf16 stored `[out, in]`.
    Always,
    /// Never (`moe_grouped_gemv` as before).
    Never,
}

impl TensorCores {
    /// The process's choice from `MOEC_TENSOR_CORES` (read once); an unknown value is an
    /// error naming it.
    pub fn process() -> Result<Self, String> {
        static POLICY: std::sync::OnceLock<Result<TensorCores, String>> =
            std::sync::OnceLock::new();
        POLICY
            .get_or_init(|| match std::env::var("MOEC_TENSOR_CORES") {
                Err(_) => Ok(TensorCores::Auto),
                Ok(v) => TensorCores::parse(&v),
            })
            .clone()
    }

    /// `auto`, `always` or `never`.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "auto" => Ok(TensorCores::Auto),
            "always" => Ok(TensorCores::Always),
            "never" => Ok(TensorCores::Never),
            other => Err(format!(
                "MOEC_TENSOR_CORES={other:?}: expected auto, always or never"
            )),
        }
    }

    /// Whether a grouped call of `entries` routed entries over `members` experts runs its
    /// bf16 products on tensor cores.
    pub fn chosen(self, entries: usize, members: usize) -> bool {
        self.chosen_rows(entries, entries.min(members), MMA_MIN_ROWS)
    }

    /// Whether `rows` rows over `groups` groups (experts, sequences) take a tensor-core
    /// kernel: under `auto`, from `min_rows` rows per group on average.
    pub fn chosen_rows(self, rows: usize, groups: usize, min_rows: usize) -> bool {
        match self {
            TensorCores::Auto => rows >= min_rows * groups.max(1),
            TensorCores::Always => true,
            TensorCores::Never => false,
        }
    }

    /// What the run report says of the expert kernels' tensor-core form.
    pub fn describe(self) -> String {
        let when = match self {
            TensorCores::Auto => format!("from {MMA_MIN_ROWS} mean routed rows per expert"),
            TensorCores::Always => "always (MOEC_TENSOR_CORES=always)".to_string(),
            TensorCores::Never => "never (MOEC_TENSOR_CORES=never)".to_string(),
        };
        let attn = match self {
            TensorCores::Auto => format!(
                "from {} mean new rows per sequence",
                super::attention::ATTN_MMA_MIN_ROWS
            ),
            TensorCores::Always => "always".to_string(),
            TensorCores::Never => "never".to_string(),
        };
        format!(
            "bf16 experts on tensor cores (moe_grouped_mma: wmma 16x16x16 bf16 tiles, \
             activations as bf16 hi+lo pairs, f32 accumulation) {when}; prefill attention \
             on tensor cores (paged_prefill_attention_mma: flash attention, Q.K^T and P.V \
             as bf16 pair tiles) {attn}, head_dim <= 128"
        )
    }
}

/// [`TensorCores::describe`] of the process's choice, or the error for a bad
/// `MOEC_TENSOR_CORES`; for the run report's kernel line (`ops::quant_kernels`).
pub(super) fn tensor_core_note() -> String {
    TensorCores::process().map_or_else(|e| format!("tensor cores: {e}"), TensorCores::describe)
}
