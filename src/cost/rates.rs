//! Which rates the HRM divides by: a profile's datasheet peaks, its effective (fitted or
//! measured) rates, or those calibrated on the papers' rows.
//!
//! Takes a hardware profile and the rates asked for, if any; gives the profile to predict
//! on and a line saying which rates it holds. Without a request the best the profile has is
//! used (calibrated, else effective, else datasheet): peaks are what a machine never
//! sustains, and a user should not need a flag to get the closer prediction (issue 27: on
//! MoE-Lightning's T4 workload the datasheet planner predicted 10.1x the published
//! throughput, the calibrated one 1.09x).

use super::hardware::{HardwareProfile, KernelRates, RowsRate};
use super::reproduce::{calibrated, fitted_points};
use crate::ir::Op;
use crate::model::card::ModelCard;
use crate::model::formats::WeightTensor;

/// The rates a prediction divides by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rates {
    /// The profile's datasheet (or probed) peaks.
    Datasheet,
    /// The profile's `effective` section: fitted or measured rates, per-task overheads,
    /// shared host DRAM (docs/cost-model.md).
    Effective,
    /// The effective rates with the prefill efficiency and task overhead `moec reproduce`
    /// fits on the papers' rows of this machine (reproduce/calibration.ron).
    Calibrated,
}

impl Rates {
    /// Reads `--rates`.
    pub fn parse(text: &str) -> Result<Rates, String> {
        match text {
            "datasheet" => Ok(Rates::Datasheet),
            "effective" => Ok(Rates::Effective),
            "calibrated" => Ok(Rates::Calibrated),
            other => Err(format!(
                "`--rates {other}`: expected `datasheet`, `effective` or `calibrated`"
            )),
        }
    }

    /// As written in `--rates`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rates::Datasheet => "datasheet",
            Rates::Effective => "effective",
            Rates::Calibrated => "calibrated",
        }
    }

    /// The best rates `profile` carries: calibrated where `moec reproduce` fitted a point
    /// for it (and it has effective rates to calibrate), else effective where it has them,
    /// else its datasheet.
    pub fn best_for(profile: &HardwareProfile) -> Rates {
        let fitted = fitted_points().is_ok_and(|points| points.contains_key(&profile.name));
        match (profile.effective.is_some(), fitted) {
            (true, true) => Rates::Calibrated,
            (true, false) => Rates::Effective,
            (false, _) => Rates::Datasheet,
        }
    }
}

/// A profile at the rates a prediction uses.
#[derive(Debug, Clone)]
pub struct RatedProfile {
    /// The profile to predict on.
    pub profile: HardwareProfile,
    /// Which rates it holds.
    pub rates: Rates,
    /// The rates in words, with where they come from and whether they were asked for (the
    /// output prints it: no silent choice).
    pub description: String,
}

/// `profile` at the `requested` rates, or at the best it has ([`Rates::best_for`]) when
/// none is requested. Asking for rates the profile lacks is an error naming what is missing.
pub fn at_rates(
    profile: HardwareProfile,
    requested: Option<Rates>,
) -> Result<RatedProfile, String> {
    let rates = requested.unwrap_or_else(|| Rates::best_for(&profile));
    let how = match (requested, rates) {
        (Some(_), _) => String::new(),
        (None, Rates::Datasheet) => {
            format!(" [default: `{}` has no effective rates]", profile.name)
        }
        (None, _) => format!(
            " [default: the best `{}` has; `--rates datasheet` for peaks]",
            profile.name
        ),
    };
    let (rated, words) = match rates {
        Rates::Datasheet => (profile, "datasheet peaks".to_string()),
        Rates::Effective => {
            let Some(effective) = &profile.effective else {
                return Err(format!(
                    "`--rates effective`: hardware profile `{}` has no `effective` section",
                    profile.name
                ));
            };
            let words = format!("effective ({})", effective.source);
            (profile.effective(), words)
        }
        Rates::Calibrated => {
            let points = fitted_points()?;
            let (Some(point), true) = (points.get(&profile.name), profile.effective.is_some())
            else {
                let known: Vec<&str> = points.keys().map(String::as_str).collect();
                return Err(format!(
                    "`--rates calibrated`: hardware profile `{}` has no calibration point (fitted by `moec reproduce` for: {})",
                    profile.name,
                    known.join(", ")
                ));
            };
            let words = format!(
                "calibrated: effective, prefill efficiency {}, task overhead {} us (fitted by `moec reproduce` on the papers' {} rows, reproduce/calibration.ron)",
                point.prefill_efficiency, point.task_overhead_us, profile.name
            );
            (calibrated(&profile, *point), words)
        }
    };
    Ok(RatedProfile {
        profile: rated,
        rates,
        description: format!("{words}{how}"),
    })
}

/// The weight formats a task of `op` multiplies by and each one's bytes in one layer (or
/// one expert), for [`KernelRates::seconds_by_format`]: `experts` picks the routed
/// experts' segments (`experts`, and the expert part of `post_attn`); otherwise pre_attn
/// reads its layer's `pre` part (Q/K/V or MLA's projections), o_proj its O projection,
/// gate and pregate the `gate` part (router, shared experts), post_attn's dense part O and
/// gate, lm_head the head matrix. Each segment in the format the card stores that layer's
/// tensor in (`None` for floats). Empty for an op with no weights of these.
pub fn weight_segments(
    card: &ModelCard,
    op: &Op,
    experts: bool,
) -> Vec<(Option<&'static str>, f64)> {
    use crate::model::arch::ArchSpec;
    use crate::model::layout::LayerLayout;
    let (layer, parts): (u64, &[usize]) = match (op, experts) {
        (Op::LmHead { .. }, _) => {
            let head = card.storage(WeightTensor::LmHead);
            let bytes = head.matrix_bytes(card.vocab, card.hidden).unwrap_or(0);
            return vec![(head.quant().map(|f| f.name()), bytes as f64)];
        }
        (Op::Experts { layer, .. } | Op::PostAttn { layer, .. }, true) => (u64::from(*layer), &[3]),
        (Op::PostAttn { layer, .. }, false) => (u64::from(*layer), &[1, 2]),
        (Op::PreAttn { layer, .. }, false) => (u64::from(*layer), &[0]),
        (Op::OProj { layer, .. }, false) => (u64::from(*layer), &[1]),
        (Op::Gate { layer, .. } | Op::Pregate { layer, .. }, false) => (u64::from(*layer), &[2]),
        _ => return Vec::new(),
    };
    let arch = ArchSpec::from_card(card);
    let storage = |k| {
        card.formats
            .layer_storage(card.dtype, layer, WeightTensor::layer(k))
    };
    let bytes = LayerLayout::part_bytes(&arch, storage);
    let [pre, o, gate] = LayerLayout::dense_parts(&arch, false);
    let kinds = [pre, o, gate, LayerLayout::expert_kinds(&arch, 0)];
    parts
        .iter()
        .flat_map(|&p| {
            kinds[p]
                .iter()
                .zip(&bytes[p])
                .map(|(&k, &b)| (storage(k).quant().map(|f| f.name()), b as f64))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Seconds of `bytes` of weight traffic of `op` (its experts' when `experts`) at `rows`
/// rows per weight, when `kernels` has a measured curve for a format those weights are
/// stored in ([`KernelRates::seconds_by_format`], the rest at `fallback`, the op kind's
/// bf16 curve); `None` otherwise (the caller charges `fallback` alone, as before the
/// curves existed).
pub fn quant_product_seconds(
    kernels: &KernelRates,
    fallback: &[RowsRate],
    card: &ModelCard,
    op: &Op,
    experts: bool,
    bytes: f64,
    rows: f64,
) -> Option<f64> {
    if kernels.quant.is_empty() || bytes <= 0.0 || rows <= 0.0 {
        return None;
    }
    kernels.seconds_by_format(fallback, &weight_segments(card, op, experts), bytes, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: a profile whose `linear` curve is 1 GB/s at 1 row (1e-9 s per byte,
    /// times the rows above it), `expert_ffn` 2 GB/s, and a Q8_0 curve of 0.5 GB/s at 16
    /// rows and 0.25 at 64 (2e-9 and 4e-9 s/B). mixtral-tiny (hidden 128, ffn 256) with
    /// Q8_0 experts: each of gate, up [256, 128] and down [128, 256] is 1,024 blocks of
    /// 34 B = 34,816 B. At 32 rows the Q8_0 curve gives 2e-9 + (16/48) 2e-9 = 8/3 e-9 s/B:
    /// 104,448 B take 278.528 us, where the bf16 `expert_ffn` curve alone (5e-10 x 32 =
    /// 1.6e-8 s/B) gave 1.671 ms. Its attention stays bf16, so pre_attn has no curve of
    /// its own (`None`: the caller keeps the bf16 curve). A mix of 3 MB of Q8_0 and 1 MB
    /// of floats at 32 rows: 0.75 x 8/3e-9 + 0.25 x 3.2e-8 = 1e-8 s/B, 40 ms for 4 MB.
    #[test]
    fn quantised_weights_take_their_formats_curves() {
        use crate::cost::hardware::QuantRates;
        use crate::ir::catalog::ExpertSet;
        let point = |rows, weight_gb_s| RowsRate { rows, weight_gb_s };
        let kernels = KernelRates {
            linear: vec![point(1, 1.0)],
            expert_ffn: vec![point(1, 2.0)],
            quant: vec![QuantRates {
                format: "Q8_0".to_string(),
                points: vec![point(16, 0.5), point(64, 0.25)],
            }],
            ..KernelRates::default()
        };
        let mut card = ModelCard::load("mixtral-tiny").unwrap();
        card.formats.parse_classes("experts=q8_0").unwrap();
        let experts = Op::Experts {
            layer: 1,
            ub: 0,
            set: ExpertSet::All,
        };
        let segments = weight_segments(&card, &experts, true);
        assert_eq!(segments, vec![(Some("Q8_0"), 34_816.0); 3]);
        let fallback = &kernels.expert_ffn;
        let s = quant_product_seconds(&kernels, fallback, &card, &experts, true, 104_448.0, 32.0);
        assert!((s.unwrap() - 278.528e-6).abs() < 1e-12, "{s:?}");
        let post = Op::PostAttn { layer: 1, ub: 0 };
        let s = quant_product_seconds(&kernels, fallback, &card, &post, true, 104_448.0, 32.0);
        assert!((s.unwrap() - 278.528e-6).abs() < 1e-12, "{s:?}");
        let pre = Op::PreAttn { layer: 1, ub: 0 };
        assert!(weight_segments(&card, &pre, false)
            .iter()
            .all(|s| s.0.is_none()));
        assert_eq!(
            quant_product_seconds(&kernels, &kernels.linear, &card, &pre, false, 1e6, 32.0),
            None
        );
        let mix = [(Some("Q8_0"), 3e6), (None, 1e6)];
        let s = kernels
            .seconds_by_format(&kernels.linear, &mix, 4e6, 32.0)
            .unwrap();
        assert!((s - 0.04).abs() < 1e-12, "{s}");
        // No curves at all: the caller's bf16 curve, as before.
        let bf16_only = KernelRates {
            quant: Vec::new(),
            ..kernels.clone()
        };
        let s = quant_product_seconds(&bf16_only, fallback, &card, &experts, true, 1e5, 32.0);
        assert_eq!(s, None);
    }

    /// Hand-worked: gpt-oss's MXFP4 experts take the MXFP4 curve, their bf16 biases the
    /// op kind's bf16 curve. gpt-oss-tiny (hidden 128, ffn 64) with `experts=mxfp4`: the
    /// fused gate_up `[128, 128]` is 512 blocks of 17 B = 8,704 B, its bias 128 bf16 =
    /// 256 B, down `[128, 64]` 256 blocks = 4,352 B, its bias 256 B (13,568 B in all).
    /// MXFP4 curve 8 GB/s at 1 row and 5 at 2 (1.25e-10 and 2e-10 s/B), so 1.625e-10 s/B
    /// at 1.5 rows; `expert_ffn` 2 GB/s at 1 row, 7.5e-10 s/B at 1.5 rows. The expert at
    /// 1.5 rows: 13,056 x 1.625e-10 + 512 x 7.5e-10 = 2.1216 + 0.384 = 2.5056 us, where
    /// without an MXFP4 curve (a profile with Q4_K's only) all of it took the bf16 curve:
    /// 13,568 x 7.5e-10 = 10.176 us.
    #[test]
    fn mxfp4_experts_take_their_own_curve() {
        use crate::cost::hardware::QuantRates;
        use crate::ir::catalog::ExpertSet;
        let point = |rows, weight_gb_s| RowsRate { rows, weight_gb_s };
        let curve = |format: &str, points| QuantRates {
            format: format.to_string(),
            points,
        };
        let kernels = KernelRates {
            linear: vec![point(1, 1.0)],
            expert_ffn: vec![point(1, 2.0)],
            quant: vec![
                curve("Q4_K", vec![point(1, 20.0)]),
                curve("MXFP4", vec![point(1, 8.0), point(2, 5.0)]),
            ],
            ..KernelRates::default()
        };
        let mut card = ModelCard::load("gpt-oss-tiny").unwrap();
        card.formats.parse_classes("experts=mxfp4").unwrap();
        let experts = Op::Experts {
            layer: 0,
            ub: 0,
            set: ExpertSet::All,
        };
        let segments = weight_segments(&card, &experts, true);
        let mx = Some("MXFP4");
        assert_eq!(
            segments,
            vec![(mx, 8_704.0), (None, 256.0), (mx, 4_352.0), (None, 256.0)]
        );
        let fallback = &kernels.expert_ffn;
        let s = quant_product_seconds(&kernels, fallback, &card, &experts, true, 13_568.0, 1.5);
        assert!((s.unwrap() - 2.5056e-6).abs() < 1e-15, "{s:?}");
        let q4k_only = KernelRates {
            quant: kernels.quant[..1].to_vec(),
            ..kernels.clone()
        };
        let s = quant_product_seconds(&q4k_only, fallback, &card, &experts, true, 13_568.0, 1.5);
        assert_eq!(s, None);
        let bf16 = KernelRates::seconds_per_weight_byte(fallback, 1.5).unwrap() * 13_568.0;
        assert!((bf16 - 10.176e-6).abs() < 1e-15, "{bf16}");
    }

    /// The checked-in profiles: T4 and L4 carry effective rates and a calibration point
    /// (reproduce/calibration.ron), the H200 only its datasheet.
    #[test]
    fn the_default_is_the_best_rates_a_profile_has() {
        for (name, best) in [
            ("t4", Rates::Calibrated),
            ("l4", Rates::Calibrated),
            ("h200", Rates::Datasheet),
        ] {
            let profile = HardwareProfile::load(name).unwrap();
            let rated = at_rates(profile, None).unwrap();
            assert_eq!(rated.rates, best, "{name}");
            assert!(rated.description.contains("[default"), "{name}");
        }
        let mut no_fit = HardwareProfile::load("t4").unwrap();
        no_fit.name = "t4-unfitted".to_string();
        assert_eq!(Rates::best_for(&no_fit), Rates::Effective);
        let h200 = HardwareProfile::load("h200").unwrap();
        let err = at_rates(h200, Some(Rates::Effective)).unwrap_err();
        assert!(err.contains("no `effective` section"), "{err}");
        let t4 = HardwareProfile::load("t4").unwrap();
        let asked = at_rates(t4, Some(Rates::Datasheet)).unwrap();
        assert_eq!(asked.description, "datasheet peaks");
        assert!(Rates::parse("peak").is_err());
    }
}
