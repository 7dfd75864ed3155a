//! The AVX-512 VNNI body of the quantised products: a weight block's codes widened to
//! unsigned bytes once, 64 per register (two Q4_K/Q5_K sub-blocks, four Q6_K ones; Q4_K
//! and Q5_K as the low and the high nibbles of one 64-byte load, sub-blocks two apart, the
//! activations laid out to match: [`super::x86::CodeOrder::SubBlockPairs`]), then
//! per activation row VNNI's `vpdpbusd` (code × activation, four products per 32-bit
//! lane), the four registers' lanes packed pairwise to 16 bits (`vpackssdw`) and scaled
//! by the sub-block scales with VNNI's `vpdpwssd`: six multiplying instructions per 256
//! codes, against eight for `vpmaddubsw` + `vpdpwssd` per register. Q8_0 blocks (32
//! signed codes, one scale) take one `vpdpbusd` of the unsigned codes `w + 128` with the
//! activation (no intermediate saturation, unlike `vpmaddubsw`), and the `128 · Σ a`
//! this adds is taken off eight rows' totals at once. Q4_0/Q4_1 blocks take one
//! `vpdpbusd` of their nibbles 0..15 (Q4_0's `8 · Σ a` is taken off likewise). The 16 lanes are folded to 8 (integer adds) and handed to the loop of
//! [`super::x86`].
//!
//! Guarantees: the integer sums are exact and everything after them is [`super::x86`]'s,
//! so the results are the portable body's bits.

use super::x86::{panel_body, Side};
use std::arch::x86_64::*;

/// A decoded weight block.
pub(super) struct Dec {
    /// Codes as unsigned bytes, 64 per register, in weight order.
    codes: [__m512i; 4],
    /// The 16-bit scale of each 16-bit lane of the two packs of `dot` (the first two).
    scales: [__m512i; 4],
    /// Q8_0: `|w|` and `w`.
    q8: [__m256i; 2],
}

/// 16-bit lanes `0..16` = `lo`, `16..32` = `hi`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn halves16(lo: i16, hi: i16) -> __m512i {
    _mm512_mask_blend_epi16(0xFFFF_0000, _mm512_set1_epi16(lo), _mm512_set1_epi16(hi))
}

/// Decodes block `b` of format `FMT` (ggml type id) whose scalars are `side`.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI available; `b` is one whole block of the format.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn decode<const FMT: u32>(b: &[u8], side: &Side) -> Dec {
    let z = _mm512_setzero_si512();
    let mut d = Dec {
        codes: [z; 4],
        scales: [z; 4],
        q8: [_mm256_setzero_si256(); 2],
    };
    let m4 = _mm512_set1_epi8(0x0f);
    let p = b.as_ptr();
    // SAFETY (loads): every offset below lies inside the block, whose size the format fixes.
    match FMT {
        12 | 13 => {
            let sc = side.sc;
            let sc16 = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_set1_epi64x(sc as i64)));
            let qs_at = if FMT == 13 { 48 } else { 16 };
            let qh =
                _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(p.add(16) as *const __m256i) });
            for h in 0..2 {
                // 64 bytes: the low nibbles are sub-blocks 4h and 4h + 2, the high ones
                // 4h + 1 and 4h + 3 (the activations' `CodeOrder::SubBlockPairs`).
                let raw = unsafe { _mm512_loadu_si512(p.add(qs_at + 64 * h) as *const __m512i) };
                let lo = _mm512_and_si512(raw, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                for (c, mut codes) in [(2 * h, lo), (2 * h + 1, hi)] {
                    if FMT == 13 {
                        let s = (4 * (c / 2) + c % 2) as i16;
                        let bit = _mm512_and_si512(
                            _mm512_srlv_epi16(qh, halves16(s, s + 2)),
                            _mm512_set1_epi8(1),
                        );
                        codes = _mm512_or_si512(codes, _mm512_slli_epi16::<4>(bit));
                    }
                    d.codes[c] = codes;
                }
            }
            // See `dot`: pack P's 16-bit lane t (128-bit lane k = t / 8, second four `hi`)
            // holds sums of sub-block 4P + 2 (k / 2) + hi.
            let t = lane_index();
            let k = _mm512_srli_epi16::<3>(t);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<2>(t), _mm512_set1_epi16(1));
            let base = _mm512_add_epi16(_mm512_slli_epi16::<1>(_mm512_srli_epi16::<1>(k)), hi);
            for (pk, sv) in d.scales.iter_mut().take(2).enumerate() {
                let idx = _mm512_add_epi16(base, _mm512_set1_epi16(4 * pk as i16));
                *sv = _mm512_permutexvar_epi16(idx, sc16);
            }
        }
        14 => {
            let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(unsafe {
                _mm_loadu_si128(p.add(192) as *const __m128i)
            }));
            for c in 0..4 {
                // Weights 64c..64c + 64: half c / 2, quarters 2 (c % 2) and 2 (c % 2) + 1.
                let (half, s0) = (c / 2, 2 * (c % 2));
                let ql = unsafe { _mm512_loadu_si512(p.add(64 * half) as *const __m512i) };
                let low = _mm512_and_si512(
                    _mm512_srl_epi16(ql, _mm_cvtsi32_si128(4 * (c % 2) as i32)),
                    m4,
                );
                let qh = _mm512_broadcast_i64x4(unsafe {
                    _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i)
                });
                let shift = halves16(2 * s0 as i16, 2 * s0 as i16 + 2);
                let high = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
                d.codes[c] = _mm512_or_si512(low, _mm512_slli_epi16::<4>(high));
            }
            // See `dot`: pack P's 16-bit lane t (128-bit lane k = t / 8, second four `hi`)
            // holds sums of sub-block 8P + 4 hi + k.
            let t = lane_index();
            let k = _mm512_srli_epi16::<3>(t);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<2>(t), _mm512_set1_epi16(1));
            let base = _mm512_add_epi16(_mm512_slli_epi16::<2>(hi), k);
            for (pk, sv) in d.scales.iter_mut().take(2).enumerate() {
                let idx = _mm512_add_epi16(base, _mm512_set1_epi16(8 * pk as i16));
                *sv = _mm512_permutexvar_epi16(idx, sc16);
            }
        }
        2 | 3 => {
            let raw =
                unsafe { _mm_loadu_si128(p.add(if FMT == 2 { 2 } else { 4 }) as *const __m128i) };
            d.q8[0] = super::dot_avx2::q4_codes(raw);
        }
        39 => {
            // The signed table values as Q8_0's codes: unsigned `w + 128`, `128 · Σ a` off.
            let raw = unsafe { _mm_loadu_si128(p.add(1) as *const __m128i) };
            let w = super::dot_avx2::mxfp4_values(raw);
            d.q8 = [_mm256_xor_si256(w, _mm256_set1_epi8(-128)), w];
        }
        _ => {
            let w = unsafe { _mm256_loadu_si256(p.add(2) as *const __m256i) };
            // Unsigned codes `w + 128` (the top bit flipped); the `128 · Σ a` this adds is
            // taken off the totals (`Q8_0_OFFSET` of `panel_body!`).
            d.q8 = [_mm256_xor_si256(w, _mm256_set1_epi8(-128)), w];
        }
    }
    d
}

/// 16-bit lanes `0, 1, .., 31`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn lane_index() -> __m512i {
    _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
        8, 7, 6, 5, 4, 3, 2, 1, 0,
    )
}

/// Eight lanes of partial integer sums of block `d` with the activation codes at `a`.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI available; `a` points at a whole activation block of the
/// format's activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn dot<const FMT: u32>(d: &Dec, a: *const i8) -> __m256i {
    // SAFETY (loads): 64-byte parts of a 256-code block, or the 32 codes of a Q8_0 block.
    match FMT {
        12..=14 => {
            let mut r = [_mm512_setzero_si512(); 4];
            for (i, ri) in r.iter_mut().enumerate() {
                let x = unsafe { _mm512_loadu_si512(a.add(64 * i) as *const __m512i) };
                *ri = _mm512_dpbusd_epi32(_mm512_setzero_si512(), d.codes[i], x);
            }
            // Each 32-bit lane sums four code x activation products: |sum| <= 4 · 63 · 128
            // = 32256, so packing to 16 bits never saturates; the packs interleave per
            // 128-bit lane (four lanes of the first operand, four of the second), which
            // `decode`'s scale vectors follow.
            let p01 = _mm512_packs_epi32(r[0], r[1]);
            let p23 = _mm512_packs_epi32(r[2], r[3]);
            let acc = _mm512_dpwssd_epi32(_mm512_setzero_si512(), p01, d.scales[0]);
            let acc = _mm512_dpwssd_epi32(acc, p23, d.scales[1]);
            _mm256_add_epi32(
                _mm512_castsi512_si256(acc),
                _mm512_extracti64x4_epi64::<1>(acc),
            )
        }
        _ => {
            let x = unsafe { _mm256_loadu_si256(a as *const __m256i) };
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), d.q8[0], x)
        }
    }
}

panel_body!(
    panel,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    Dec,
    decode,
    dot,
    true
);
