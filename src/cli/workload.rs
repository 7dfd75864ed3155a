//! `--workload SPEC`, one spelling for every command: `run` draws the prompts a spec names,
//! `simulate` and `plan` cost the workload they amount to.
//!
//! Takes the spec text; gives the runtime's [`WorkloadSpec`] ([`parse_workload`], what
//! `run` draws prompts from) or the cost model's view of it ([`CostWorkload`]). A spec is
//! one of the runtime's (`mtbench[:COUNT]`, `count=N,mean=M,max=X[,min=A][,gen=G][,seed=S]`),
//! a paper preset with a count (`mtbench-GEN:COUNT`, which `run` draws as MT-Bench-shaped
//! prompts generating GEN tokens), or a paper preset alone (`mtbench-128`,
//! `synthetic-reasoning`, ...). Resolved here, in the CLI, because the runtime does not
//! import the cost model's presets (issue 10's layering).

use crate::cost::workloads::{self, WorkloadPreset};
use crate::ir::Workload;
use crate::runtime::driver::workload::WorkloadSpec;

/// Parses `--workload` as `run` takes it: the runtime's specs (`mtbench[:COUNT]`,
/// `count=...`) and the paper presets `simulate` and `plan` take, `mtbench-GEN[:COUNT]` (the
/// MT-Bench-shaped prompts, generating the preset's GEN tokens), so one spelling works in
/// every command.
pub fn parse_workload(text: &str) -> Result<WorkloadSpec, String> {
    let Some(tail) = text.strip_prefix("mtbench-") else {
        return WorkloadSpec::parse(text).map_err(|e| e.to_string());
    };
    let (gen, count) = match tail.split_once(':') {
        Some((gen, count)) => (gen, Some(count)),
        None => (tail, None),
    };
    let name = format!("mtbench-{gen}");
    let preset = workloads::preset(&name).ok_or_else(|| {
        format!(
            "bad --workload `{text}`: unknown preset `{name}` (known: {})",
            workloads::preset_names()
        )
    })?;
    let runtime_spec = match count {
        Some(count) => format!("mtbench:{count}"),
        None => "mtbench".to_string(),
    };
    let spec = WorkloadSpec::parse(&runtime_spec)
        .map_err(|e| format!("bad --workload `{text}`: {}", e.reason))?;
    Ok(WorkloadSpec {
        gen_len: Some(preset.gen_len as usize),
        ..spec
    })
}

/// What a `--workload` spec means to the cost model (`simulate`, `plan`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CostWorkload {
    /// A paper preset named alone (`mtbench-128`, `summarization`): the paper's average
    /// prompt and its generation length, as the papers' optimizers size their policies
    /// (`cost::workloads`); the batch stays the command's.
    Preset(&'static WorkloadPreset),
    /// The prompts a `run` with this spec draws: `count` sequences of at most `max` prompt
    /// tokens, generating `gen` (the command's generation length when the spec names none).
    Run(WorkloadSpec),
}

impl CostWorkload {
    /// Reads a spec: a preset's name first (so `mtbench-128` keeps the paper's meaning),
    /// then anything `run` takes.
    pub fn parse(text: &str) -> Result<CostWorkload, String> {
        if let Some(preset) = workloads::preset(text) {
            return Ok(CostWorkload::Preset(preset));
        }
        parse_workload(text).map(CostWorkload::Run).map_err(|e| {
            format!(
                "{e}; `simulate` and `plan` also take a paper preset alone: {}",
                workloads::preset_names()
            )
        })
    }

    /// Sets `workload`'s fields this spec fixes. A run's spec sizes the prompt by its
    /// `max`, not its `mean`: the runtime compiles the schedule for the longest prompt it
    /// drew (every buffer sized for it), which is at most `max`, so a plan that fits at
    /// `max` fits the run, where one sized for the mean may not.
    pub fn apply(&self, workload: &mut Workload) {
        match self {
            CostWorkload::Preset(preset) => {
                workload.prompt_len = preset.prompt_len;
                workload.gen_len = preset.gen_len;
            }
            CostWorkload::Run(spec) => {
                workload.batch = spec.count as u64;
                workload.prompt_len = spec.max as u64;
                if let Some(gen) = spec.gen_len {
                    workload.gen_len = gen as u64;
                }
            }
        }
    }
}

/// A `run` spec that draws exactly `workload`: `batch` prompts of `prompt_len` tokens each,
/// generating `gen_len` (for a workload no user spec names as is, e.g. a paper preset's
/// average prompt, or one that `--batch`/`--prompt-len`/`--gen-len` changed).
pub fn spec_for(workload: &Workload) -> String {
    let p = workload.prompt_len;
    format!(
        "count={},mean={p},max={p},min={p},gen={}",
        workload.batch, workload.gen_len
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run` takes the paper presets `simulate` and `plan` name, with an optional count, as
    /// well as its own `mtbench:COUNT`; unknown presets and empty counts are refused.
    #[test]
    fn workload_presets_are_spelled_as_simulate_spells_them() {
        let preset = parse_workload("mtbench-128").unwrap();
        assert_eq!((preset.count, preset.gen_len), (80, Some(128)));
        let preset = parse_workload("mtbench-32:5").unwrap();
        assert_eq!((preset.count, preset.gen_len), (5, Some(32)));
        assert_eq!(parse_workload("mtbench:7").unwrap().count, 7);
        assert!(parse_workload("mtbench-33")
            .unwrap_err()
            .contains("unknown preset `mtbench-33`"));
        assert!(parse_workload("mtbench-32:").is_err());
    }

    /// The cost model reads a preset as the paper's average prompt (MoE-Lightning Tab. 3:
    /// MTBench s_avg 77) and a run's spec as its count, longest prompt and generation;
    /// MT-Bench-shaped prompts are at most 418 tokens (`WorkloadSpec::parse`).
    #[test]
    fn cost_workloads_follow_presets_and_run_specs() {
        let cases = [
            ("mtbench-128", (64, 77, 128)),
            ("summarization", (64, 1693, 64)),
            ("count=16,mean=64,max=64,min=64,gen=32", (16, 64, 32)),
            ("count=3,mean=10,max=40", (3, 40, 32)),
            ("mtbench:5", (5, 418, 32)),
            ("mtbench-64:7", (7, 418, 64)),
        ];
        for (text, (batch, prompt_len, gen_len)) in cases {
            let mut workload = Workload::default();
            assert_eq!((workload.batch, workload.gen_len), (64, 32));
            CostWorkload::parse(text).unwrap().apply(&mut workload);
            let expected = Workload {
                batch,
                prompt_len,
                gen_len,
            };
            assert_eq!(workload, expected, "{text}");
        }
        let err = CostWorkload::parse("count=0,mean=4").unwrap_err();
        assert!(err.contains("bad --workload `count=0,mean=4`"), "{err}");
        assert!(
            err.contains("count must be") && err.contains("mtbench-128"),
            "{err}"
        );
    }

    /// The spec written for a planned workload draws exactly that workload.
    #[test]
    fn spec_for_a_workload_draws_it() {
        let workload = Workload {
            batch: 5,
            prompt_len: 77,
            gen_len: 128,
        };
        let spec = parse_workload(&spec_for(&workload)).unwrap();
        let prompts = spec.prompts(1000);
        assert_eq!(prompts.len(), 5);
        assert!(prompts.iter().all(|p| p.len() == 77));
        assert_eq!(spec.gen_len, Some(128));
    }
}
