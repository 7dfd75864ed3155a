//! Which instruction set the CPU kernels use, chosen once per process, and the kernel
//! context ([`Kernels`]) that carries that choice into every kernel call.
//!
//! Takes the CPU's features (detected once) and the `MOEC_KERNELS` environment variable
//! (`auto`, `avx512`, `avx2` or `portable`; unset means `auto`); gives the [`Selection`]
//! every kernel of the process uses unless a caller passes another [`Kernels`] value
//! explicitly (tests compare the portable and SIMD paths that way). Guarantees: a
//! [`Kernels`] value only ever names an instruction set this CPU has (its constructor
//! refuses the others), so the `unsafe` SIMD bodies behind it are always sound; a forced
//! setting the CPU lacks is an error, never a silent fallback; `auto` on a CPU without
//! AVX2+FMA says in [`describe`] that it fell back to the portable kernels and why.

use std::fmt;
use std::sync::OnceLock;

/// Environment variable that forces a kernel instruction set.
pub const ENV_VAR: &str = "MOEC_KERNELS";

/// The environment variable that picks the product of block-quantised weights:
/// `int8` (the default: activations quantised to 8 bits as ggml does) or `decoded`
/// (weights decoded to f32 per panel, activations kept in f32: the CUDA backend's
/// arithmetic).
pub const QUANT_PRODUCT_VAR: &str = "MOEC_QUANT_PRODUCT";

/// The environment variable that picks the product of bf16 weights: `f32` (the default:
/// weights widened to f32, activations kept in f32) or `bf16` (activations rounded to
/// bf16 and pairs multiplied and summed as AVX-512 BF16's `vdpbf16ps` does, llama.cpp's
/// arithmetic for bf16 weights; see `kernels::bf16_dot`).
pub const BF16_PRODUCT_VAR: &str = "MOEC_BF16_PRODUCT";

/// An instruction set the CPU kernels have bodies for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F/BW/VL: 16 f32 lanes, masked loads and stores.
    Avx512,
    /// AVX2 with FMA: 8 f32 lanes (what most x86-64 machines without AVX-512 have).
    Avx2,
    /// Plain Rust loops with the same summation order as the SIMD bodies.
    Portable,
}

impl Isa {
    /// Every instruction set, fastest first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// The name `MOEC_KERNELS` accepts and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }

    /// The CPU features this instruction set needs, in words.
    pub fn features(self) -> &'static str {
        match self {
            Isa::Avx512 => "AVX-512F, AVX-512BW and AVX-512VL",
            Isa::Avx2 => "AVX2, FMA and F16C",
            Isa::Portable => "nothing",
        }
    }

    /// True when this CPU can run the instruction set's kernels (detected once).
    pub fn is_supported(self) -> bool {
        let caps = cpu_caps();
        match self {
            Isa::Avx512 => caps.avx512,
            Isa::Avx2 => caps.avx2_fma,
            Isa::Portable => true,
        }
    }

    /// The fastest instruction set this CPU supports.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Portable)
    }

    /// Every instruction set this CPU supports, fastest first (always ends with portable).
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a kernel setting cannot be honoured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    /// The setting names no instruction set.
    #[error("{ENV_VAR}={value:?} is not a kernel choice: use auto, avx512, avx2 or portable")]
    Unknown {
        /// The value given.
        value: String,
    },
    /// `MOEC_QUANT_PRODUCT` names no product.
    #[error("{QUANT_PRODUCT_VAR}={value:?} is not a quantised product: use int8 or decoded")]
    UnknownQuantProduct {
        /// The value given.
        value: String,
    },
    /// `MOEC_BF16_PRODUCT` names no product.
    #[error("{BF16_PRODUCT_VAR}={value:?} is not a bf16 product: use f32 or bf16")]
    UnknownBf16Product {
        /// The value given.
        value: String,
    },
    /// The setting names an instruction set this CPU lacks.
    #[error("{ENV_VAR}={isa}: this CPU lacks {} (it supports: {})", isa.features(), supported_names())]
    Unsupported {
        /// The instruction set asked for.
        isa: Isa,
    },
}

fn supported_names() -> String {
    Isa::supported()
        .iter()
        .map(|i| i.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The instruction set chosen for a process, and why, in words for reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The kernels every default kernel call uses.
    pub kernels: Kernels,
    /// Why these: forced by the setting, or the best the CPU has (and what it lacks).
    pub reason: String,
}

/// Chooses the kernels for a `MOEC_KERNELS` value (`None` = unset = `auto`). A forced
/// instruction set the CPU lacks is an error; `auto` takes the fastest one it has.
pub fn select(setting: Option<&str>) -> Result<Selection, IsaError> {
    let value = setting.map(str::trim).unwrap_or("");
    let forced = match value.to_ascii_lowercase().as_str() {
        "" | "auto" => None,
        "avx512" | "avx-512" => Some(Isa::Avx512),
        "avx2" => Some(Isa::Avx2),
        "portable" => Some(Isa::Portable),
        _ => {
            return Err(IsaError::Unknown {
                value: value.to_string(),
            })
        }
    };
    match forced {
        Some(isa) => Ok(Selection {
            kernels: Kernels::new(isa)?,
            reason: format!("forced by {ENV_VAR}={}", isa.name()),
        }),
        None => {
            let isa = Isa::best();
            let reason = match isa {
                Isa::Avx512 => "auto: the best this CPU has".to_string(),
                Isa::Avx2 => "auto: this CPU has AVX2 and FMA but not AVX-512".to_string(),
                Isa::Portable => {
                    "auto: falling back to the portable kernels, this CPU has neither \
                     AVX-512 nor AVX2+FMA"
                        .to_string()
                }
            };
            Ok(Selection {
                kernels: Kernels {
                    isa,
                    few_rows: true,
                    quant_decoded: false,
                    bf16_dot: false,
                },
                reason,
            })
        }
    }
}

/// The process's selection from `MOEC_KERNELS`, read and checked once (the first call
/// decides; later changes of the variable have no effect). Commands call this at start-up
/// and refuse to run on an error.
pub fn selection() -> Result<&'static Selection, &'static IsaError> {
    static SELECTION: OnceLock<Result<Selection, IsaError>> = OnceLock::new();
    SELECTION
        .get_or_init(|| {
            let mut s = select(std::env::var(ENV_VAR).ok().as_deref())?;
            let product = std::env::var(QUANT_PRODUCT_VAR).ok();
            match product.as_deref().map(str::trim) {
                None | Some("") | Some("int8") => {}
                Some("decoded") => s.kernels.quant_decoded = true,
                Some(other) => {
                    return Err(IsaError::UnknownQuantProduct {
                        value: other.to_string(),
                    })
                }
            }
            s.kernels.bf16_dot =
                parse_bf16_product(std::env::var(BF16_PRODUCT_VAR).ok().as_deref())?;
            Ok(s)
        })
        .as_ref()
}

/// Whether a `MOEC_BF16_PRODUCT` value (`None` = unset = `f32`) asks for the bf16
/// product; an unknown value is an error, never a silent default.
pub fn parse_bf16_product(setting: Option<&str>) -> Result<bool, IsaError> {
    match setting.map(str::trim).unwrap_or("") {
        "" | "f32" => Ok(false),
        "bf16" => Ok(true),
        other => Err(IsaError::UnknownBf16Product {
            value: other.to_string(),
        }),
    }
}

/// The kernel context: which instruction set's bodies a kernel call runs.
///
/// Every SIMD kernel has an `impl Kernels` method; the free functions of the same name use
/// [`Kernels::process`]. The oracle and the runtime must use the same value for the same
/// run so that schedule invariance stays bit-exact. A value can only be made for an
/// instruction set the CPU supports, which is what makes the SIMD dispatch sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kernels {
    isa: Isa,
    /// Whether bf16 products at few rows take the instruction set's few-row body (the
    /// default); off, every row count runs the general register blocks (same bits).
    few_rows: bool,
    /// Whether block-quantised weights are decoded to f32 and multiplied in f32
    /// (`MOEC_QUANT_PRODUCT=decoded`) instead of with 8-bit activations.
    quant_decoded: bool,
    /// Whether bf16 weights multiply bf16-rounded activations as `vdpbf16ps` does
    /// (`MOEC_BF16_PRODUCT=bf16`) instead of f32 activations.
    bf16_dot: bool,
}

impl Kernels {
    /// Kernels for `isa`, refused when this CPU lacks it.
    pub fn new(isa: Isa) -> Result<Self, IsaError> {
        if isa.is_supported() {
            Ok(Kernels {
                isa,
                few_rows: true,
                quant_decoded: false,
                bf16_dot: false,
            })
        } else {
            Err(IsaError::Unsupported { isa })
        }
    }

    /// The portable kernels (every CPU runs them).
    pub fn portable() -> Self {
        Kernels {
            isa: Isa::Portable,
            few_rows: true,
            quant_decoded: false,
            bf16_dot: false,
        }
    }

    /// These kernels with every row count through the general register blocks, never
    /// the few-row bodies: the same bits (every body sums in one order), for benches that
    /// compare the two bodies in one run.
    pub fn general_blocks(self) -> Self {
        Kernels {
            few_rows: false,
            ..self
        }
    }

    /// Whether products at few rows take the few-row body (see [`Kernels::general_blocks`]).
    pub fn few_rows(self) -> bool {
        self.few_rows
    }

    /// These kernels with block-quantised weights decoded to f32 per panel and multiplied
    /// in f32 (`MOEC_QUANT_PRODUCT=decoded`), the CUDA backend's arithmetic.
    pub fn quant_decoded(self) -> Self {
        Kernels {
            quant_decoded: true,
            ..self
        }
    }

    /// Whether block-quantised weights are decoded to f32 rather than multiplied with 8-bit
    /// activations.
    pub fn decodes_quant(self) -> bool {
        self.quant_decoded
    }

    /// These kernels with bf16 weights multiplied by bf16-rounded activations as
    /// `vdpbf16ps` does (`MOEC_BF16_PRODUCT=bf16`, see `kernels::bf16_dot`).
    pub fn bf16_product(self) -> Self {
        Kernels {
            bf16_dot: true,
            ..self
        }
    }

    /// Whether bf16 weights take the bf16 product rather than the f32 one.
    pub fn bf16_dot(self) -> bool {
        self.bf16_dot
    }

    /// The kernels chosen for this process ([`selection`]). When `MOEC_KERNELS` is
    /// invalid (commands refuse that at start-up; a library caller may not have checked)
    /// this warns once on stderr and uses the portable kernels.
    pub fn process() -> Self {
        static CHOSEN: OnceLock<Kernels> = OnceLock::new();
        *CHOSEN.get_or_init(|| match selection() {
            Ok(s) => s.kernels,
            Err(e) => {
                eprintln!("warning: {e}; using the portable kernels");
                Kernels::portable()
            }
        })
    }

    /// The instruction set these kernels run.
    pub fn isa(self) -> Isa {
        self.isa
    }
}

/// What this CPU has, detected once.
#[derive(Debug, Clone, Copy)]
struct CpuCaps {
    avx512: bool,
    avx2_fma: bool,
    avx512_bf16: bool,
}

/// Whether this CPU has AVX-512 BF16 (`vdpbf16ps`) on top of the AVX-512 kernels'
/// features (detected once).
pub fn has_avx512_bf16() -> bool {
    cpu_caps().avx512_bf16
}

fn cpu_caps() -> CpuCaps {
    static CAPS: OnceLock<CpuCaps> = OnceLock::new();
    *CAPS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            CpuCaps {
                avx512: is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl"),
                avx2_fma: is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c"),
                avx512_bf16: is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512bf16"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            CpuCaps {
                avx512: false,
                avx2_fma: false,
                avx512_bf16: false,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_unknown_values_are_refused() {
        assert_eq!(
            select(Some("portable")).unwrap().kernels.isa(),
            Isa::Portable
        );
        assert_eq!(select(None).unwrap().kernels.isa(), Isa::best());
        assert_eq!(select(Some(" AUTO ")).unwrap().kernels.isa(), Isa::best());
        let err = select(Some("sse9")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "MOEC_KERNELS=\"sse9\" is not a kernel choice: use auto, avx512, avx2 or portable"
        );
    }

    /// `MOEC_BF16_PRODUCT`: unset and `f32` keep the f32 product, `bf16` picks the bf16
    /// one, anything else is refused with the accepted values.
    #[test]
    fn bf16_product_settings_parse_and_unknown_values_are_refused() {
        assert_eq!(parse_bf16_product(None), Ok(false));
        assert_eq!(parse_bf16_product(Some(" f32 ")), Ok(false));
        assert_eq!(parse_bf16_product(Some("bf16")), Ok(true));
        let err = parse_bf16_product(Some("fp8")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "MOEC_BF16_PRODUCT=\"fp8\" is not a bf16 product: use f32 or bf16"
        );
        assert!(Kernels::portable().bf16_product().bf16_dot());
        assert!(!Kernels::portable().bf16_dot());
    }

    /// Forcing an instruction set works exactly when the CPU has it; otherwise the error
    /// names what is missing (no silent fallback).
    #[test]
    fn forcing_an_isa_the_cpu_lacks_is_an_error() {
        for isa in Isa::ALL {
            let got = select(Some(isa.name()));
            if isa.is_supported() {
                let s = got.unwrap();
                assert_eq!(s.kernels.isa(), isa);
                assert!(s.reason.contains("forced"), "{}", s.reason);
            } else {
                let msg = got.unwrap_err().to_string();
                assert!(msg.contains("this CPU lacks"), "{msg}");
                assert!(Kernels::new(isa).is_err());
            }
        }
        assert_eq!(Isa::supported().last(), Some(&Isa::Portable));
    }
}
