use super::*;
use crate::math::isa::{Isa, Kernels};
use crate::math::tensor::{Matrix, TypedSlice};
use crate::model::vocab::Orientation;
use half::bf16;

/// xorshift64: reproducible data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A bf16 pattern: mostly normal values near 1 (either sign), some denormals (read as
    /// zero by the instruction) and some tiny normals whose products underflow.
    fn bf16_bits(&mut self) -> u16 {
        let r = self.next();
        let exp = match r % 8 {
            0 => 0,
            1 => 1 + (r >> 8) % 12,
            _ => 120 + (r >> 8) % 12,
        } as u16;
        (((r >> 20) & 1) as u16) << 15 | exp << 7 | ((r >> 30) & 0x7F) as u16
    }

    /// An f32 activation: a bf16 pattern's value with low bits that are random, exactly a
    /// tie (0x8000, rounds to even) or zero; denormal f32 values too.
    fn activation(&mut self) -> f32 {
        let hi = (self.bf16_bits() as u32) << 16;
        let r = self.next();
        let lo = match r % 4 {
            0 => 0x8000,
            1 => 0,
            _ => (r >> 8) as u32 & 0xFFFF,
        };
        f32::from_bits(hi | lo)
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Rounding by hand: ties go to the even neighbour, halves above round up, denormals and
/// zeros become signed zeros, infinities stay, NaN stays NaN (quiet).
#[test]
fn rounding_to_bf16_by_hand() {
    let r = |v: f32| f32::from_bits((round_to_bf16(v) as u32) << 16);
    // bf16 has 7 fraction bits: the step at 1 is 2^-7.
    assert_eq!(r(1.0 + 2f32.powi(-8)), 1.0);
    assert_eq!(r(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6));
    assert_eq!(r(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 1.0 + 2f32.powi(-7));
    assert_eq!(r(-1.5), -1.5);
    assert_eq!(round_to_bf16(1e-40), 0);
    assert_eq!(round_to_bf16(-1e-40), 0x8000);
    assert_eq!(round_to_bf16(-0.0), 0x8000);
    assert_eq!(r(f32::INFINITY), f32::INFINITY);
    assert_eq!(r(f32::MAX), f32::INFINITY);
    assert!(r(f32::NAN).is_nan());
    // Away from ties and denormals it is `half`'s rounding.
    for v in [0.1f32, -3.7, 65504.0, 1e-30, 7.0e30] {
        assert_eq!(round_to_bf16(v), bf16::from_f32(v).to_bits(), "{v}");
    }
}

/// On a CPU with AVX-512 BF16, the instructions themselves are the reference: the
/// rounding is `vcvtneps2bf16`'s and one lane step is `vdpbf16ps`'s, bit for bit, on random
/// data with denormals, ties, underflowing products and cancellations.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_emulation_is_the_instruction() {
    if !crate::math::isa::has_avx512_bf16() {
        println!("SKIPPED: this CPU lacks AVX-512 BF16");
        return;
    }
    let mut rng = Rng(0x5eed_bf16);
    for _ in 0..20_000 {
        let x: [f32; 16] = std::array::from_fn(|_| rng.activation());
        let a: [u16; 32] = std::array::from_fn(|_| rng.bf16_bits());
        let b: [u16; 32] = std::array::from_fn(|_| rng.bf16_bits());
        // Accumulators: zero, normal, tiny (denormal results flush) and normal values the
        // pairs can cancel.
        let acc: [f32; 16] = std::array::from_fn(|j| match rng.next() % 4 {
            0 => 0.0,
            1 => f32::from_bits((a[2 * j] as u32) << 16) * 1e-3,
            2 => -widen_daz(a[2 * j + 1]) * widen_daz(b[2 * j + 1]),
            _ => rng.activation(),
        });
        let acc = acc.map(ftz);
        // SAFETY: the CPU has AVX-512F/BW/VL and BF16 (checked above).
        let (hw_round, hw_dot) = unsafe { hardware(x, acc, a, b) };
        assert_eq!(hw_round, x.map(round_to_bf16), "rounding of {x:?}");
        for j in 0..16 {
            let want = step(acc[j], [a[2 * j], a[2 * j + 1]], [b[2 * j], b[2 * j + 1]]);
            assert_eq!(
                hw_dot[j].to_bits(),
                want.to_bits(),
                "lane {j}: acc {:e} a {:?} b {:?}",
                acc[j],
                [a[2 * j], a[2 * j + 1]],
                [b[2 * j], b[2 * j + 1]]
            );
        }
    }
}

/// `vcvtneps2bf16` of `x` and `vdpbf16ps(acc, a, b)`.
///
/// # Safety
/// AVX-512F/BW/VL and AVX-512 BF16 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn hardware(
    x: [f32; 16],
    acc: [f32; 16],
    a: [u16; 32],
    b: [u16; 32],
) -> ([u16; 16], [f32; 16]) {
    use std::arch::x86_64::*;
    // SAFETY: the arrays hold exactly the bytes each load reads and each store writes;
    // `__m256bh` and `__m512bh` are plain bits of the sizes transmuted.
    unsafe {
        let round = _mm512_cvtneps_pbh(_mm512_loadu_ps(x.as_ptr()));
        let round: [u16; 16] = std::mem::transmute::<__m256bh, [u16; 16]>(round);
        let va = std::mem::transmute::<[u16; 32], __m512bh>(a);
        let vb = std::mem::transmute::<[u16; 32], __m512bh>(b);
        let dot = _mm512_dpbf16_ps(_mm512_loadu_ps(acc.as_ptr()), va, vb);
        let mut out = [0.0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), dot);
        (round, out)
    }
}

fn random_matrix(rows: usize, cols: usize, seed: u64) -> Vec<bf16> {
    let mut rng = Rng(seed);
    (0..rows * cols)
        .map(|_| bf16::from_bits(rng.bf16_bits()))
        .collect()
}

/// Activation rows; every fifth row scaled to tiny values so whole lanes underflow and
/// their accumulators flush.
fn random_rows(n_rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n_rows * cols)
        .map(|i| {
            let v = rng.activation();
            if (i / cols) % 5 == 4 {
                v * 1e-30
            } else {
                v
            }
        })
        .collect()
}

/// Every body (`vdpbf16ps` where the CPU has it, the AVX2 emulation, portable) gives the
/// same bits, at every row count from 1 to past the largest register group, for widths
/// that are a single element, odd, not a multiple of 32 and a multiple of it, with panels
/// cut mid-block (70 rows), plain and gated; and each row alone gives its bits in the
/// batch (batch invariance).
#[test]
fn every_body_gives_the_portable_bits_and_rows_are_batch_invariant() {
    let silu = |v: f32| v / (1.0 + (-v).exp());
    for &(rows, cols) in &[(11usize, 1usize), (37, 29), (70, 300), (9, 64), (5, 33)] {
        let w = random_matrix(rows, cols, 17 + rows as u64);
        let mut u = w.clone();
        u.reverse();
        let m = Matrix::new(TypedSlice::Bf16(&w), rows, cols, Orientation::OutIn).unwrap();
        let um = Matrix::new(TypedSlice::Bf16(&u), rows, cols, Orientation::OutIn).unwrap();
        for n_rows in [1usize, 2, 3, 4, 5, 7, 9, 17] {
            let x = random_rows(n_rows, cols, 3 + n_rows as u64);
            let p = Kernels::portable().bf16_product();
            let mut want = vec![0.0; n_rows * rows];
            p.linear(&x, n_rows, &m, &mut want).unwrap();
            let mut want_gated = vec![0.0; n_rows * rows];
            p.linear_gated(&x, n_rows, &m, &um, silu, &mut want_gated)
                .unwrap();
            for isa in Isa::supported() {
                let k = Kernels::new(isa).unwrap().bf16_product();
                let what = format!("{:?} {n_rows}x{rows}x{cols}", Body::for_kernels(k));
                let mut got = vec![0.0; n_rows * rows];
                k.linear(&x, n_rows, &m, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{what}");
                k.linear_gated(&x, n_rows, &m, &um, silu, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want_gated), "gated {what}");
                for t in [0, n_rows - 1] {
                    let mut alone = vec![0.0; rows];
                    k.linear(&x[t * cols..(t + 1) * cols], 1, &m, &mut alone)
                        .unwrap();
                    assert_eq!(
                        bits(&alone),
                        bits(&want[t * rows..(t + 1) * rows]),
                        "row {t} alone, {what}"
                    );
                }
            }
        }
    }
}

/// The bound of the module doc against an f64 product of the unrounded activations:
/// `|y - Σ w x| <= (2^-8 + 1.01 * m * 2^-24) * Σ |w x| + m * 2^-126` with `m = 2 *
/// ceil(in / 32) + 4` roundings; and the bf16 product does differ from the f32 one (the
/// activations really are rounded).
#[test]
fn the_product_is_within_the_bf16_rounding_bound() {
    let (rows, cols, n_rows) = (24usize, 1000usize, 3usize);
    let w = random_matrix(rows, cols, 99);
    let mut rng = Rng(7);
    // Normal activations only: the bound's relative term is for them (a flushed
    // denormal activation moves a product by less than 2^-126 * |w|, covered by the
    // absolute term here since |w| < 2^6).
    let x: Vec<f32> = (0..n_rows * cols)
        .map(|_| f32::from_bits(((rng.next() as u32) & 0x3FFF_FFFF) | 0x3E00_0000) - 0.5)
        .collect();
    let m = Matrix::new(TypedSlice::Bf16(&w), rows, cols, Orientation::OutIn).unwrap();
    let k = Kernels::process().bf16_product();
    let mut got = vec![0.0; n_rows * rows];
    k.linear(&x, n_rows, &m, &mut got).unwrap();
    let mut f32_product = vec![0.0; n_rows * rows];
    Kernels::process()
        .linear(&x, n_rows, &m, &mut f32_product)
        .unwrap();
    assert_ne!(bits(&got), bits(&f32_product));
    let steps = (2 * cols.div_ceil(32) + 4) as f64;
    for t in 0..n_rows {
        for o in 0..rows {
            let (mut exact, mut abs) = (0.0f64, 0.0f64);
            for i in 0..cols {
                let p = w[o * cols + i].to_f64() * x[t * cols + i] as f64;
                exact += p;
                abs += p.abs();
            }
            let bound = (2f64.powi(-8) + 1.01 * steps * 2f64.powi(-24)) * abs
                + steps * 2f64.powi(-126) * 64.0 * cols as f64;
            let err = (got[t * rows + o] as f64 - exact).abs();
            assert!(
                err <= bound,
                "row {t} out {o}: error {err:e} over bound {bound:e}"
            );
        }
    }
}

/// The report line names the product and the body; the default names the f32 product.
#[test]
fn describe_names_the_product_and_body() {
    let p = Kernels::portable();
    assert!(describe(p).contains("f32 product"), "{}", describe(p));
    let line = describe(p.bf16_product());
    assert!(line.contains("MOEC_BF16_PRODUCT=bf16") && line.contains("portable emulation"));
    if let Ok(k) = Kernels::new(Isa::Avx512) {
        let want = if crate::math::isa::has_avx512_bf16() {
            "vdpbf16ps (AVX-512 BF16)"
        } else {
            "this CPU lacks AVX-512 BF16"
        };
        assert!(describe(k.bf16_product()).contains(want));
    }
}
