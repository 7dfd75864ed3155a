//! The papers' published rows and the calibration scored against them (`moec reproduce`).
//!
//! Takes the checked-in tables (`reproduce/*.ron`, embedded) and, from the caller, one
//! prediction per (row, calibration point); gives the rows, the calibration grid, the
//! profile a calibration point turns a hardware profile into, and the leave-one-out fit:
//! for every row, the point fitted on all the OTHER rows (its held-out prediction) and the
//! point fitted on all rows (its fitted-on prediction). Guarantees: a held-out prediction
//! never uses its own row's published value; the fit minimises the sum of squared log
//! ratios, so over- and under-prediction weigh the same. Compiling and simulating are the
//! caller's (the CLI's) business: this module only knows numbers.

use super::hardware::HardwareProfile;
use serde::{Deserialize, Serialize};

/// One published row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishedRow {
    /// The paper.
    pub paper: String,
    /// Table or figure (`Tab. 4`).
    pub table: String,
    /// The row as the paper names it, with its setting.
    pub row: String,
    /// Built-in schedule name (`cgopipe`, `flexgen`, `flexgen_cpu_attn`, ...).
    pub schedule: String,
    /// Hardware profile name.
    pub hw: String,
    /// Prompt tokens per sequence (the padding rule is in the file's header).
    pub prompt_len: u64,
    /// Generated tokens per sequence.
    pub gen_len: u64,
    /// The published policy as schedule params.
    pub sets: Vec<(String, i64)>,
    /// Published generation throughput, tokens/s.
    pub published: f64,
    /// The value was read off a figure, not a table.
    #[serde(default)]
    pub from_figure: bool,
    /// The system's own CPU attention rate, TFLOPS, when it differs from the machine's
    /// (FlexGen(c) computes attention in PyTorch on fp16 tensors, far below the rate of
    /// MoE-Lightning's kernel), with its source in the file.
    #[serde(default)]
    pub cpu_attn_tflops: Option<f64>,
}

impl PublishedRow {
    /// The row's hardware profile with the system's own rates (`cpu_attn_tflops`) in its
    /// effective section.
    pub fn profile(&self, profile: &HardwareProfile) -> HardwareProfile {
        let mut out = profile.clone();
        if let (Some(rate), Some(effective)) = (self.cpu_attn_tflops, out.effective.as_mut()) {
            effective.cpu_tflops = Some(rate);
        }
        out
    }
}

/// The model card every row uses (the papers' Mixtral-8x7B).
pub const MODEL: &str = "mixtral-8x7b";
/// Bytes per activation and KV element in the papers' systems (fp16).
pub const ACT_BYTES: u64 = 2;

const TABLES: &[(&str, &str)] = &[(
    "moe-lightning",
    include_str!("../../reproduce/moe_lightning.ron"),
)];

/// The checked-in tables by name, parsed.
pub fn tables() -> Result<Vec<(String, Vec<PublishedRow>)>, String> {
    TABLES
        .iter()
        .map(|(name, text)| {
            ron::from_str::<Vec<PublishedRow>>(text)
                .map(|rows| (name.to_string(), rows))
                .map_err(|e| format!("reproduce/{name}.ron: {e}"))
        })
        .collect()
}

/// One calibration point: what the effective profile does not know and the rows fit, one
/// point per machine (a T4's sustained tensor rate is not an L4's).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct Calibration {
    /// Share of the profile's effective prefill GPU rates (GEMM and attention) the
    /// papers' prefill reaches (FlexGen fitted its prefill rates on OPT's dense layers;
    /// an MoE layer's prefill runs one GEMM per expert).
    pub prefill_efficiency: f64,
    /// Fixed cost per task, microseconds (kernel launches, Python dispatch).
    pub task_overhead_us: f64,
}

/// The checked-in fitted point of every machine (`reproduce/calibration.ron`).
pub fn fitted_points() -> Result<std::collections::BTreeMap<String, Calibration>, String> {
    ron::from_str(include_str!("../../reproduce/calibration.ron"))
        .map_err(|e| format!("reproduce/calibration.ron: {e}"))
}

/// The grid the fit searches: prefill efficiency in 0.1 steps, task overhead on a
/// doubling ladder.
pub fn grid() -> Vec<Calibration> {
    let mut points = Vec::new();
    for e in 1..=10 {
        for overhead in [0.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0] {
            points.push(Calibration {
                prefill_efficiency: f64::from(e) / 10.0,
                task_overhead_us: overhead,
            });
        }
    }
    points
}

/// The profile a row is predicted on at a calibration point: the profile's effective
/// rates with the prefill GPU rates scaled and the task overhead set.
pub fn calibrated(profile: &HardwareProfile, point: Calibration) -> HardwareProfile {
    let mut out = profile.effective();
    out.gpu.half_tflops *= point.prefill_efficiency;
    out.adjustments.gpu_prefill_attn_flops *= point.prefill_efficiency;
    out.adjustments.task_s = point.task_overhead_us * 1e-6;
    out
}

/// Squared log ratio of a prediction to a published value (infinite when the prediction
/// is missing or not positive).
fn log_error(predicted: Option<f64>, published: f64) -> f64 {
    match predicted {
        Some(p) if p > 0.0 && published > 0.0 => (p / published).ln().powi(2),
        _ => f64::INFINITY,
    }
}

/// The index of the grid point minimising the summed squared log error over `rows`.
fn best_point(predictions: &[Vec<Option<f64>>], published: &[f64], rows: &[usize]) -> usize {
    let points = predictions.first().map_or(0, Vec::len);
    (0..points)
        .min_by(|&a, &b| {
            let cost = |p: usize| -> f64 {
                rows.iter()
                    .map(|&r| log_error(predictions[r][p], published[r]))
                    .sum()
            };
            cost(a).total_cmp(&cost(b))
        })
        .unwrap_or(0)
}

/// The fit for each row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RowFit {
    /// Grid index fitted on every other row.
    pub held_out_point: usize,
    /// Prediction at that point, tokens/s.
    pub held_out: Option<f64>,
    /// Grid index fitted on every row of the group (this one included).
    pub fitted_point: usize,
    /// Prediction at that point.
    pub fitted_on: Option<f64>,
    /// The row is alone in its group, so its "held-out" point was fitted on itself.
    pub held_out_alone: bool,
}

/// Leave-one-out over `predictions[row][point]` (tokens/s at each grid point) against
/// `published[row]`, fitting one point per group (`group[row]`: rows on one machine share
/// its calibration); also returns, per row, the point fitted on its whole group.
pub fn leave_one_out(
    predictions: &[Vec<Option<f64>>],
    published: &[f64],
    group: &[usize],
) -> Vec<RowFit> {
    let rows = published.len();
    (0..rows)
        .map(|held| {
            let same: Vec<usize> = (0..rows).filter(|&r| group[r] == group[held]).collect();
            let others: Vec<usize> = same.iter().copied().filter(|&r| r != held).collect();
            let global = best_point(predictions, published, &same);
            // A group of one has nothing to fit on: it keeps the whole group's point,
            // which is then NOT held out (`held_out_alone` says so).
            let point = if others.is_empty() {
                global
            } else {
                best_point(predictions, published, &others)
            };
            RowFit {
                held_out_point: point,
                held_out: predictions[held][point],
                fitted_point: global,
                fitted_on: predictions[held][global],
                held_out_alone: others.is_empty(),
            }
        })
        .collect()
}

/// Geometric mean of the ratios' distance from 1 (`exp(mean |ln r|)`) and the largest
/// distance (`max(r, 1/r)`), over the rows with a prediction.
pub fn error_summary(ratios: impl Iterator<Item = f64>) -> (f64, f64) {
    let logs: Vec<f64> = ratios
        .filter(|r| r.is_finite() && *r > 0.0)
        .map(|r| r.ln().abs())
        .collect();
    if logs.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mean = logs.iter().sum::<f64>() / logs.len() as f64;
    let max = logs.iter().copied().fold(0.0, f64::max);
    (mean.exp(), max.exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checked_in_tables_parse() {
        let tables = tables().unwrap();
        assert!(tables.iter().all(|(_, rows)| !rows.is_empty()));
    }

    #[test]
    fn a_held_out_row_never_fits_itself() {
        // Two points; rows 0 and 1 agree with point 0, row 2 only with point 1. Held out,
        // row 2 gets point 0 (its neighbours' choice); fitted on all, point 0 still wins
        // (two rows against one).
        let predictions = vec![
            vec![Some(10.0), Some(20.0)],
            vec![Some(5.0), Some(10.0)],
            vec![Some(4.0), Some(8.0)],
        ];
        let published = [10.0, 5.0, 8.0];
        let fits = leave_one_out(&predictions, &published, &[0, 0, 0]);
        assert_eq!(fits[2].fitted_point, 0);
        assert_eq!(fits[2].held_out_point, 0);
        assert_eq!(fits[2].held_out, Some(4.0));
        assert_eq!(fits[0].held_out_point, 0);
        // In separate groups, row 2 fits alone and is marked so.
        let fits = leave_one_out(&predictions, &published, &[0, 0, 1]);
        assert_eq!(fits[2].held_out_point, 1);
        assert!(fits[2].held_out_alone && !fits[0].held_out_alone);
    }

    #[test]
    fn error_summary_is_symmetric_in_over_and_under_prediction() {
        let (geo, max) = error_summary([2.0, 0.5].into_iter());
        assert!((geo - 2.0).abs() < 1e-12 && (max - 2.0).abs() < 1e-12);
    }
}
