//! Which rates the HRM divides by: a profile's datasheet peaks, its effective (fitted or
//! measured) rates, or those calibrated on the papers' rows.
//!
//! Takes a hardware profile and the rates asked for, if any; gives the profile to predict
//! on and a line saying which rates it holds. Without a request the best the profile has is
//! used (calibrated, else effective, else datasheet): peaks are what a machine never
//! sustains, and a user should not need a flag to get the closer prediction (issue 27: on
//! MoE-Lightning's T4 workload the datasheet planner predicted 10.1x the published
//! throughput, the calibrated one 1.09x).

use super::hardware::HardwareProfile;
use super::reproduce::{calibrated, fitted_points};

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

#[cfg(test)]
mod tests {
    use super::*;

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
