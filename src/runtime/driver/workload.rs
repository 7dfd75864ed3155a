//! Synthetic workloads: `--workload SPEC` to prompts of token ids, so benchmarks need no
//! data files.
//!
//! Takes a spec, `mtbench[:COUNT]` (MT-Bench-shaped prompts: mean 77, max 418 tokens) or
//! `count=N,mean=M,max=X[,min=A][,gen=G][,seed=S]`, and the vocabulary size; gives the
//! prompts (deterministic for a seed) and the generation length if the spec sets one.
//! Lengths are exponentially distributed around the mean (a long tail, like chat prompts)
//! and clipped to `[min, max]`; token ids avoid the first 3 ids (special tokens).

use crate::rng::Rng;

/// A parsed workload spec.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadSpec {
    /// Number of prompts to draw.
    pub count: usize,
    /// Mean prompt length before clipping.
    pub mean: f64,
    /// Shortest prompt.
    pub min: usize,
    /// Longest prompt.
    pub max: usize,
    /// Tokens to generate, if the spec says.
    pub gen_len: Option<usize>,
    /// Seed of the deterministic prompt generator (same seed, same prompts).
    pub seed: u64,
}

/// A malformed spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad --workload `{spec}`: {reason} (expected `mtbench[:COUNT]` or `count=N,mean=M,max=X[,min=A][,gen=G][,seed=S]`)")]
pub struct WorkloadError {
    /// The spec.
    pub spec: String,
    /// What is wrong.
    pub reason: String,
}

impl WorkloadSpec {
    /// Parses a spec.
    pub fn parse(spec: &str) -> Result<Self, WorkloadError> {
        let err = |reason: &str| WorkloadError {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let mtbench = WorkloadSpec {
            count: 80,
            mean: 77.0,
            min: 4,
            max: 418,
            gen_len: None,
            seed: 0,
        };
        if let Some(rest) = spec.strip_prefix("mtbench") {
            let count = match rest.strip_prefix(':') {
                Some(n) => n.parse().map_err(|_| err("COUNT is not a number"))?,
                None if rest.is_empty() => mtbench.count,
                None => return Err(err("unknown preset")),
            };
            if count == 0 || count > MAX_PROMPTS {
                return Err(err(&format!("COUNT must be 1..={MAX_PROMPTS}")));
            }
            return Ok(WorkloadSpec { count, ..mtbench });
        }
        let mut out = WorkloadSpec {
            count: 0,
            mean: 0.0,
            min: 1,
            max: 0,
            gen_len: None,
            seed: 0,
        };
        for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| err(&format!("`{part}` is not KEY=VALUE")))?;
            let int = || {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| err(&format!("`{k}` needs a whole number")))
            };
            match k.trim() {
                "count" => out.count = int()?,
                "mean" => out.mean = v.trim().parse().map_err(|_| err("`mean` needs a number"))?,
                "min" => out.min = int()?,
                "max" => out.max = int()?,
                "gen" => out.gen_len = Some(int()?),
                "seed" => out.seed = int()? as u64,
                other => return Err(err(&format!("unknown key `{other}`"))),
            }
        }
        if out.count == 0 || out.count > MAX_PROMPTS {
            return Err(err(&format!("count must be 1..={MAX_PROMPTS}")));
        }
        if out.max > MAX_PROMPT_TOKENS {
            return Err(err(&format!(
                "max must be at most {MAX_PROMPT_TOKENS} tokens"
            )));
        }
        if out.max == 0 {
            out.max = (out.mean * 4.0).ceil().max(1.0) as usize;
        }
        out.min = out.min.max(1);
        if !(out.mean >= 1.0 && out.mean.is_finite()) || out.min > out.max {
            return Err(err("need 1 <= mean and min <= max"));
        }
        if out.mean > out.max as f64 {
            return Err(err(&format!(
                "mean ({}) exceeds max ({}): every prompt would be cut to max",
                out.mean, out.max
            )));
        }
        Ok(out)
    }

    /// The prompts, as token ids below `vocab`. (`parse` caps the count and lengths, so
    /// this never asks for more than `MAX_PROMPTS * MAX_PROMPT_TOKENS` ids.)
    pub fn prompts(&self, vocab: u32) -> Vec<Vec<u32>> {
        let mut rng = Rng::new(self.seed ^ 0x5eed_1e57);
        let low = 3.min(vocab.saturating_sub(1));
        let span = u64::from(vocab.saturating_sub(low).max(1));
        (0..self.count)
            .map(|_| {
                let u = rng.next_f64().clamp(1e-12, 1.0);
                let len = (-u.ln() * self.mean).round() as usize;
                let len = len.clamp(self.min, self.max);
                (0..len)
                    .map(|_| low + (rng.next_u64() % span) as u32)
                    .collect()
            })
            .collect()
    }
}

/// Synthetic prompts one spec may ask for (a run of more is a typo, not a workload).
pub const MAX_PROMPTS: usize = 1_000_000;

/// Tokens one synthetic prompt may have at most.
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtbench_shape() {
        let spec = WorkloadSpec::parse("mtbench:400").unwrap();
        let prompts = spec.prompts(32000);
        assert_eq!(prompts.len(), 400);
        assert!(prompts.iter().all(|p| (4..=418).contains(&p.len())));
        let mean = prompts.iter().map(Vec::len).sum::<usize>() as f64 / 400.0;
        // Exponential with mean 77, clipped: the sample mean stays near 77.
        assert!((60.0..95.0).contains(&mean), "mean {mean}");
        assert!(prompts.iter().flatten().all(|&t| (3..32000).contains(&t)));
    }

    #[test]
    fn explicit_spec_and_errors() {
        let spec = WorkloadSpec::parse("count=3,mean=10,max=12,gen=5,seed=2").unwrap();
        assert_eq!((spec.count, spec.max, spec.gen_len), (3, 12, Some(5)));
        assert_eq!(spec.prompts(100), spec.prompts(100));
        assert!(WorkloadSpec::parse("count=0,mean=3").is_err());
        assert!(WorkloadSpec::parse("count=2,mean=x").is_err());
        assert!(WorkloadSpec::parse("count=2,mean=3,bogus=1").is_err());
        assert!(WorkloadSpec::parse("mtbench:x").is_err());
        // Issue 18: a count that would overflow the allocation, and a mean past max.
        assert!(WorkloadSpec::parse("count=18446744073709551615,mean=4,max=8").is_err());
        assert!(WorkloadSpec::parse("mtbench:18446744073709551615").is_err());
        assert!(WorkloadSpec::parse("count=2,mean=100,max=8").is_err());
    }
}
