//! Named workloads from the papers' evaluations, for `--workload`.
//!
//! Takes a preset name; gives `(prompt_len, gen_len)`. The prompt length is the dataset's
//! average: MoE-Lightning's optimizer sizes its policy from `--avg-prompt-len` (notes/
//! peers.md), and its unpadded runs batch requests by length (Alg. 2), so the average is
//! what memory and attention see on the whole.

/// A workload preset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadPreset {
    /// Name for `--workload`.
    pub name: &'static str,
    /// Average prompt tokens.
    pub prompt_len: u64,
    /// Generated tokens.
    pub gen_len: u64,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// MoE-Lightning Table 3 (and MoE-Lens's MTBench runs).
pub const PRESETS: &[WorkloadPreset] = &[
    WorkloadPreset {
        name: "mtbench-32",
        prompt_len: 77,
        gen_len: 32,
        source: "MoE-Lightning Tab. 3: MTBench s_avg 77, l = 32",
    },
    WorkloadPreset {
        name: "mtbench-64",
        prompt_len: 77,
        gen_len: 64,
        source: "MoE-Lightning Tab. 3: MTBench s_avg 77, l = 64",
    },
    WorkloadPreset {
        name: "mtbench-128",
        prompt_len: 77,
        gen_len: 128,
        source: "MoE-Lightning Tab. 3: MTBench s_avg 77, l = 128",
    },
    WorkloadPreset {
        name: "mtbench-256",
        prompt_len: 77,
        gen_len: 256,
        source: "MoE-Lightning Tab. 3: MTBench s_avg 77, l = 256",
    },
    WorkloadPreset {
        name: "synthetic-reasoning",
        prompt_len: 242,
        gen_len: 50,
        source: "MoE-Lightning Tab. 3: HELM synthetic reasoning s_avg 242, l = 50",
    },
    WorkloadPreset {
        name: "summarization",
        prompt_len: 1693,
        gen_len: 64,
        source: "MoE-Lightning Tab. 3: HELM summarization s_avg 1693, l = 64",
    },
];

/// Finds a preset by name.
pub fn preset(name: &str) -> Option<&'static WorkloadPreset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// Preset names, comma-separated, for error messages.
pub fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}
