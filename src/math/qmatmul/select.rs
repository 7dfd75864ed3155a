//! Which body runs the quantised matrix products, derived from the process's CPU kernel
//! choice ([`Kernels`], `MOEC_KERNELS`) and the CPU's integer dot-product instructions.
//!
//! Takes a [`Kernels`] value (which instruction set the f32 kernels run); gives a
//! [`QuantKernels`] value naming the quantised body. Guarantees: a [`QuantKernels`] value
//! only names a body this CPU can run (its constructor checks the features), so the
//! `unsafe` SIMD bodies behind it are sound; the mapping from the f32 choice is fixed and
//! stated in [`describe`] (AVX-512 without VNNI runs the AVX2 body and says so); every
//! body gives the portable body's bits, so the choice never changes a result.

use crate::math::isa::{Isa, Kernels};
use std::fmt;

/// A body of the quantised products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantBody {
    /// AVX-512 with VNNI (`vpdpbusd`): 64 codes per instruction.
    Avx512Vnni,
    /// AVX2 (`vpmaddubsw` + `vpmaddwd`): 32 codes per instruction pair.
    Avx2,
    /// Plain Rust loops (the reference).
    Portable,
}

impl QuantBody {
    /// Every body, fastest first.
    pub const ALL: [QuantBody; 3] = [QuantBody::Avx512Vnni, QuantBody::Avx2, QuantBody::Portable];

    /// The name reports print.
    pub fn name(self) -> &'static str {
        match self {
            QuantBody::Avx512Vnni => "avx512-vnni",
            QuantBody::Avx2 => "avx2",
            QuantBody::Portable => "portable",
        }
    }

    /// True when this CPU can run the body.
    pub fn is_supported(self) -> bool {
        match self {
            QuantBody::Avx512Vnni => {
                Isa::Avx512.is_supported() && Isa::Avx2.is_supported() && has_vnni()
            }
            QuantBody::Avx2 => Isa::Avx2.is_supported(),
            QuantBody::Portable => true,
        }
    }

    /// Every body this CPU can run, fastest first (always ends with portable).
    pub fn supported() -> Vec<QuantBody> {
        Self::ALL.into_iter().filter(|b| b.is_supported()).collect()
    }
}

impl fmt::Display for QuantBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A body this CPU cannot run was asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("quantised products: this CPU cannot run the {body} body")]
pub struct UnsupportedBody {
    /// The body asked for.
    pub body: QuantBody,
}

/// The quantised-product context: which body a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantKernels {
    body: QuantBody,
    /// Whether the AVX2 body unpacks a Q6_K tile row once for every activation row of a
    /// product with many rows (`super::tiles_unpacked_x86`); `false` keeps the passes that
    /// unpack each tile in every pass of four rows (benches compare the two; the bits are
    /// the same).
    unpacked: bool,
    /// Whether the AVX2 body runs its few-row passes (`super::tiles_b32_x86::pass_avx2_few`)
    /// over Q8_0, Q4_0 and MXFP4 tiles at up to four activation rows; `false` keeps the
    /// eight-row pass at every row count (benches compare the two; the bits are the same).
    few: bool,
    /// Whether the Q6_K tile passes prefetch two tiles ahead at one activation row (at more
    /// rows they always do); `false` leaves one row to the hardware prefetcher, as the
    /// Q4_K pass at one row always does. By default on for the AVX2 body and off for the
    /// AVX-512 VNNI one ([`row_prefetch_default`]; benches compare the two, the bits are
    /// the same).
    q6k_row_prefetch: bool,
    /// From how many activation rows a product from a matrix in the row layout packs its
    /// panels into tiles as it runs (`super::pack`). The process's [`super::tiles::mode`]
    /// sets it ([`PackRows::default_for_mode`]).
    pack: PackRows,
}

impl QuantKernels {
    /// The `body` kernels, refused when this CPU cannot run them.
    pub fn new(body: QuantBody) -> Result<Self, UnsupportedBody> {
        if body.is_supported() {
            Ok(QuantKernels {
                body,
                unpacked: true,
                few: true,
                q6k_row_prefetch: row_prefetch_default(body),
                pack: PackRows::default_for_mode(),
            })
        } else {
            Err(UnsupportedBody { body })
        }
    }

    /// The portable body (every CPU runs it).
    pub fn portable() -> Self {
        QuantKernels {
            body: QuantBody::Portable,
            unpacked: true,
            few: true,
            q6k_row_prefetch: true,
            pack: PackRows::default_for_mode(),
        }
    }

    /// The body for an f32 kernel choice: AVX-512 runs the VNNI body when the CPU has
    /// VNNI and the AVX2 body otherwise; AVX2 runs AVX2; portable runs portable.
    pub fn for_kernels(k: Kernels) -> Self {
        let body = match k.isa() {
            Isa::Avx512 if QuantBody::Avx512Vnni.is_supported() => QuantBody::Avx512Vnni,
            Isa::Avx512 | Isa::Avx2 if QuantBody::Avx2.is_supported() => QuantBody::Avx2,
            _ => QuantBody::Portable,
        };
        QuantKernels {
            body,
            unpacked: true,
            few: true,
            q6k_row_prefetch: row_prefetch_default(body),
            pack: PackRows::default_for_mode(),
        }
    }

    /// The body for the process's kernel choice ([`Kernels::process`]).
    pub fn process() -> Self {
        Self::for_kernels(Kernels::process())
    }

    /// The body these kernels run.
    pub fn body(self) -> QuantBody {
        self.body
    }

    /// These kernels with the AVX2 body's unpacked-tile passes on (the default) or off:
    /// off, a product from Q6_K tiles at many rows runs the passes that unpack each tile
    /// again for every four activation rows, as before the unpacked passes existed. For
    /// comparing the two in one process (`cargo bench --bench quant`); both give the same
    /// bits.
    pub fn with_unpacked_tiles(self, on: bool) -> Self {
        QuantKernels {
            unpacked: on,
            ..self
        }
    }

    /// Whether the unpacked-tile passes are on ([`Self::with_unpacked_tiles`]).
    pub fn unpacked_tiles(self) -> bool {
        self.unpacked
    }

    /// These kernels with the AVX2 body's few-row passes over Q8_0, Q4_0 and MXFP4 tiles on
    /// (the default) or off: off, a product of up to four activation rows runs the
    /// eight-row pass, as before the few-row passes existed. For comparing the two in one
    /// process (`cargo bench --bench quant`, `QUANT_BENCH_FEW=1`); both give the same bits.
    pub fn with_few_row_passes(self, on: bool) -> Self {
        QuantKernels { few: on, ..self }
    }

    /// Whether the few-row passes are on ([`Self::with_few_row_passes`]).
    pub fn few_row_passes(self) -> bool {
        self.few
    }

    /// These kernels with the Q6_K tile passes' software prefetch at one activation row on
    /// or off (the default: [`row_prefetch_default`]). For comparing the two in one process
    /// (`cargo bench --bench quant`, `QUANT_BENCH_DECODE=1`: a batch-1 decode step's
    /// products); both give the same bits.
    pub fn with_q6k_row_prefetch(self, on: bool) -> Self {
        QuantKernels {
            q6k_row_prefetch: on,
            ..self
        }
    }

    /// Whether the Q6_K passes prefetch at one row ([`Self::with_q6k_row_prefetch`]).
    pub fn q6k_row_prefetch(self) -> bool {
        self.q6k_row_prefetch
    }

    /// These kernels packing the row layout's panels into tiles as a product runs from
    /// `rows` activation rows (`Some(1)`: every product; `None`: never, the row layout's
    /// own bodies at every row count). For comparing the two in one process (tests,
    /// `cargo bench --bench quant`); both give the same bits.
    pub fn with_pack_rows(self, rows: Option<usize>) -> Self {
        QuantKernels {
            pack: rows.map_or(PackRows::Never, PackRows::From),
            ..self
        }
    }

    /// Whether a product of `n_rows` activation rows from a `cols`-wide matrix of
    /// `format` in the row layout packs its panels into tiles: a SIMD body (the portable
    /// one reads the row layout), enough rows ([`PackRows`]), a format with tiles and rows
    /// of whole blocks.
    pub fn packs(self, format: crate::quant::QuantFormat, cols: usize, n_rows: usize) -> bool {
        let from = match self.pack {
            PackRows::Never => return false,
            PackRows::PerFormat => super::tiles::pack_min_rows(format),
            PackRows::From(rows) => rows,
        };
        self.body != QuantBody::Portable
            && n_rows >= from
            && super::tiles::tileable(format, super::tiles::TILE_ROWS, cols)
    }
}

/// From how many activation rows products from the row layout pack their panels into
/// tiles ([`QuantKernels::packs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PackRows {
    /// Never: the row layout's bodies at every row count.
    Never,
    /// From [`super::tiles::pack_min_rows`] of the matrix's format.
    PerFormat,
    /// From this many rows, whatever the format (tests and benches).
    From(usize),
}

impl PackRows {
    /// [`PackRows::PerFormat`] when the process packs ([`super::tiles::TileMode::Pack`]),
    /// [`PackRows::Never`] otherwise.
    pub fn default_for_mode() -> Self {
        match super::tiles::mode() {
            super::tiles::TileMode::Pack => PackRows::PerFormat,
            super::tiles::TileMode::Load | super::tiles::TileMode::Off => PackRows::Never,
        }
    }
}

/// Whether `body`'s Q6_K tile passes prefetch at one activation row by default: not the
/// AVX-512 VNNI body, whose one-row products from Q6_K took 3-22% less time without it on a
/// Zen 4 (the `lm_head` and the Q6_K expert downs of OLMoE's batch-1 decode, one thread
/// timed by its CPU time, and the interleaved steps of a real run; docs/performance.md,
/// session 24);
/// the AVX2 body keeps it (mixed there: the experts' downs faster without, the head slower).
pub fn row_prefetch_default(body: QuantBody) -> bool {
    body != QuantBody::Avx512Vnni
}

/// One line naming the quantised-product body an f32 kernel choice runs, and why, for
/// `moec devices` and the run report (`describe(Kernels::process())`).
pub fn describe(k: Kernels) -> String {
    if k.decodes_quant() {
        return "quantised products: weights decoded to f32 per panel with ggml's reference \
                decoder, activations in f32 (MOEC_QUANT_PRODUCT=decoded, the CUDA backend's \
                arithmetic)"
            .to_string();
    }
    let body = QuantKernels::for_kernels(k).body();
    let why = match (k.isa(), body) {
        (Isa::Avx512, QuantBody::Avx512Vnni) => "AVX-512 kernels and this CPU has VNNI",
        (Isa::Avx512, _) => "AVX-512 kernels but this CPU lacks AVX-512 VNNI",
        (Isa::Avx2, _) => "AVX2 kernels",
        (Isa::Portable, _) => "portable kernels",
    };
    format!(
        "quantised products: {} ({why}); activations quantised to Q8_K (K-quants), Q8_0 \
         (Q8_0, Q4_0, MXFP4 weights) or Q8_1 (Q4_1 weights), integer block dot products, f32 \
         accumulation over blocks; {}",
        body.name(),
        super::tiles::describe_mode()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_follow_the_kernel_choice_and_the_cpu() {
        assert_eq!(
            QuantKernels::for_kernels(Kernels::portable()).body(),
            QuantBody::Portable
        );
        for isa in Isa::supported() {
            let k = Kernels::new(isa).unwrap();
            let body = QuantKernels::for_kernels(k).body();
            assert!(body.is_supported(), "{isa} -> {body}");
            assert!(describe(k).contains(body.name()));
        }
        for body in QuantBody::ALL {
            assert_eq!(QuantKernels::new(body).is_ok(), body.is_supported());
        }
        assert_eq!(QuantBody::supported().last(), Some(&QuantBody::Portable));
    }
}
