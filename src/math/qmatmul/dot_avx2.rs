//! The AVX2 body of the quantised products: a weight block's codes widened to unsigned
//! bytes once, then per activation row `vpmaddubsw` (code × activation, adjacent pairs to
//! 16 bits: at most 2 · 63 · 127 = 16002, so never saturating) and `vpmaddwd` with the
//! sub-block scale (pairs to 32 bits), summed into eight 32-bit lanes. Q8_0 codes are
//! signed: `|w|` times the activation with `w`'s sign (`vpsignb`), as ggml does. Q4_0 and
//! Q4_1 codes are the stored nibbles 0..15 (Q4_0's `−8` comes off the totals as `8 · Σ a`,
//! see `x86::offset_shift`); Q5_0's are 0..31, the fifth bit from `qh` (its `−16` off as
//! `16 · Σ a`). MXFP4 codes become their signed table values (a byte shuffle)
//! and are dotted as Q8_0's are.
//!
//! Guarantees: the integer sums are exact, and the loop, the reduction and the f32 block
//! values are those of [`super::x86`], so the results are the portable body's bits.

use super::x86::{panel_body, Side};
use std::arch::x86_64::*;

/// A decoded weight block.
pub(super) struct Dec {
    /// Codes as unsigned bytes, 32 per register, in weight order (Q8_0: `|w|`, then `w`).
    codes: [__m256i; 8],
    /// The 16-bit scale of each code pair of `codes[i]`.
    scales: [__m256i; 8],
}

/// Decodes block `b` of format `FMT` (ggml type id) whose scalars are `side`.
///
/// # Safety
/// AVX2 available; `b` is one whole block of the format.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn decode<const FMT: u32>(b: &[u8], side: &Side) -> Dec {
    let z = _mm256_setzero_si256();
    let mut d = Dec {
        codes: [z; 8],
        scales: [z; 8],
    };
    let m4 = _mm256_set1_epi8(0x0f);
    // SAFETY (loads): every offset below lies inside the block, whose size the format fixes.
    match FMT {
        12 | 13 => {
            let sc = side.sc;
            let sc16 = _mm256_cvtepu8_epi16(_mm_set1_epi64x(sc as i64));
            // Both halves hold the eight 16-bit scales; a byte shuffle broadcasts one.
            let dup = _mm256_permute2x128_si256::<0x00>(sc16, sc16);
            let qs_at = if FMT == 13 { 48 } else { 16 };
            let qh = unsafe { _mm256_loadu_si256(b.as_ptr().add(16) as *const __m256i) };
            for i in 0..4 {
                let raw =
                    unsafe { _mm256_loadu_si256(b.as_ptr().add(qs_at + 32 * i) as *const __m256i) };
                d.codes[2 * i] = _mm256_and_si256(raw, m4);
                d.codes[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
            }
            for j in 0..8 {
                let sel = (2 * j as i16) | ((2 * j as i16 + 1) << 8);
                d.scales[j] = _mm256_shuffle_epi8(dup, _mm256_set1_epi16(sel));
                if FMT == 13 {
                    // Bit j of high byte l is the fifth bit of weight l of sub-block j.
                    let bit = _mm256_and_si256(
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32)),
                        _mm256_set1_epi8(1),
                    );
                    d.codes[j] = _mm256_or_si256(d.codes[j], _mm256_slli_epi16::<4>(bit));
                }
            }
        }
        14 => {
            let sc = unsafe { _mm_loadu_si128(b.as_ptr().add(192) as *const __m128i) };
            let dup = _mm256_set_m128i(sc, sc);
            for c in 0..8 {
                let (half, s) = (c / 4, c % 4);
                let ql = unsafe {
                    _mm256_loadu_si256(b.as_ptr().add(64 * half + 32 * (s % 2)) as *const __m256i)
                };
                let qh = unsafe {
                    _mm256_loadu_si256(b.as_ptr().add(128 + 32 * half) as *const __m256i)
                };
                let low = _mm256_and_si256(
                    _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (s / 2) as i32)),
                    m4,
                );
                let high = _mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s as i32)),
                    _mm256_set1_epi8(3),
                );
                d.codes[c] = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                // Sub-blocks 2c (low half) and 2c + 1 (high half): the signed scale byte
                // into the high byte of each 16-bit lane, then shifted down with its sign.
                let lo_sel = ((2 * c as i16) << 8) | 0x80;
                let hi_sel = ((2 * c as i16 + 1) << 8) | 0x80;
                let sel = _mm256_set_m128i(_mm_set1_epi16(hi_sel), _mm_set1_epi16(lo_sel));
                d.scales[c] = _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(dup, sel));
            }
        }
        2 | 3 => {
            let raw = unsafe {
                _mm_loadu_si128(b.as_ptr().add(if FMT == 2 { 2 } else { 4 }) as *const __m128i)
            };
            d.codes[0] = q4_codes(raw);
        }
        6 => {
            // Q5_0: Q4_0's nibbles with each weight's fifth bit (bit l of `qh`) as 0x10.
            let raw = unsafe { _mm_loadu_si128(b.as_ptr().add(6) as *const __m128i) };
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            d.codes[0] = _mm256_or_si256(q4_codes(raw), q5_high_bits(qh));
        }
        39 => {
            // Signed table values, then dotted as Q8_0's signed codes are.
            let raw = unsafe { _mm_loadu_si128(b.as_ptr().add(1) as *const __m128i) };
            let w = mxfp4_values(raw);
            d.codes[0] = _mm256_abs_epi8(w);
            d.codes[1] = w;
        }
        _ => {
            let w = unsafe { _mm256_loadu_si256(b.as_ptr().add(2) as *const __m256i) };
            d.codes[0] = _mm256_abs_epi8(w);
            d.codes[1] = w;
        }
    }
    d
}

/// The 32 signed `kvalues_mxfp4` of an MXFP4 block's 16 code bytes, in weight order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn mxfp4_values(raw: __m128i) -> __m256i {
    let table = _mm256_setr_epi8(
        0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1,
        -2, -3, -4, -6, -8, -12,
    );
    _mm256_shuffle_epi8(table, q4_codes(raw))
}

/// Byte `l` of the result is 0x10 when bit `l` of `qh` is set, else 0 (ggml's
/// `bytes_from_bits_32`: each byte takes its bit's source byte, every other bit forced
/// on, then compared with all ones).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn q5_high_bits(qh: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The 32 codes of a Q4_0/Q4_1 block in weight order from its 16 code bytes: the low
/// nibbles are weights 0..16, the high nibbles weights 16..32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn q4_codes(raw: __m128i) -> __m256i {
    let m4 = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), m4);
    _mm256_set_m128i(hi, lo)
}

/// The eight lanes of partial integer sums of block `d` with the activation codes at `a`
/// (one whole activation block).
///
/// # Safety
/// AVX2 available; `a` points at a whole activation block of the format's activations.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn dot<const FMT: u32>(d: &Dec, a: *const i8) -> __m256i {
    // SAFETY (loads): 32-byte parts of the activation block (8 of them for Q8_K, 1 for Q8_0).
    match FMT {
        12..=14 => {
            let mut acc = _mm256_setzero_si256();
            for i in 0..8 {
                let x = unsafe { _mm256_loadu_si256(a.add(32 * i) as *const __m256i) };
                let p = _mm256_maddubs_epi16(d.codes[i], x);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, d.scales[i]));
            }
            acc
        }
        2 | 3 | 6 => {
            // Unsigned codes 0..15 (Q5_0: 0..31) times signed activations: pairs stay
            // below 2^15.
            let x = unsafe { _mm256_loadu_si256(a as *const __m256i) };
            let p = _mm256_maddubs_epi16(d.codes[0], x);
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
        _ => {
            let x = unsafe { _mm256_loadu_si256(a as *const __m256i) };
            let p = _mm256_maddubs_epi16(d.codes[0], _mm256_sign_epi8(x, d.codes[1]));
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
    }
}

panel_body!(panel, "avx2,fma,f16c", Dec, decode, dot, false);
