//! The quantised products against an independent reference: gguf-py's dequantisation
//! (the decoders of `blocks.rs`, tested bit-exact against it) multiplied in f64 with the
//! activations, and every SIMD body against the portable one.

use super::matmul::{QuantMatmulError, QuantMatrix};
use super::select::{QuantBody, QuantKernels};
use crate::quant::q8::{ActFormat, Q8Rows};
use crate::quant::{random_blocks, QuantFormat, QuantSlice};
use crate::rng::Rng;
use half::f16;

/// Byte offsets of a block's f16 scales (`d`, and `dmin` for Q4_K/Q5_K).
fn f16_fields(format: QuantFormat) -> &'static [usize] {
    match format {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
        QuantFormat::Mxfp4 => &[],
    }
}

fn set_f16(bytes: &mut [u8], format: QuantFormat, pick: impl Fn(usize, usize) -> f32) {
    let bb = format.block_bytes();
    for (b, block) in bytes.chunks_exact_mut(bb).enumerate() {
        for (i, &at) in f16_fields(format).iter().enumerate() {
            block[at..at + 2].copy_from_slice(&f16::from_f32(pick(b, i)).to_le_bytes());
        }
    }
}

/// `bytes` as a `[rows, cols]` matrix of `format`.
fn view(bytes: &[u8], format: QuantFormat, rows: usize, cols: usize) -> QuantMatrix<'_> {
    QuantMatrix::new(
        QuantSlice::new(bytes, format, rows * cols).unwrap(),
        rows,
        cols,
    )
    .unwrap()
}

fn decoded(w: &QuantMatrix<'_>) -> Vec<f32> {
    let mut out = vec![0.0f32; w.rows * w.cols];
    w.data.dequantize_into(&mut out).unwrap();
    out
}

/// `Σ_k W[o, k] · x[r, k]` in f64, `[n_rows, rows]`.
fn reference(wf: &[f32], rows: usize, cols: usize, x: &[f32], n_rows: usize) -> Vec<f64> {
    let mut y = vec![0.0f64; n_rows * rows];
    for r in 0..n_rows {
        for o in 0..rows {
            y[r * rows + o] = (0..cols)
                .map(|k| f64::from(wf[o * cols + k]) * f64::from(x[r * cols + k]))
                .sum();
        }
    }
    y
}

/// Activations `2^-3 · q`: per activation block (32 or 256 values) the first code is
/// `±127` and the rest lie in `-3..=3`, so Q8_K and Q8_0 represent them exactly (scale
/// `2^-3`, `iscale` a power of two) and every integer sum stays far below `2^24`.
fn representable(format: ActFormat, n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n)
        .map(|k| {
            let q = if k % format.block_elems() == 0 {
                if rng.next_u64() & 1 == 0 {
                    127
                } else {
                    -127
                }
            } else {
                (rng.next_u64() % 7) as i32 - 3
            };
            q as f32 / 8.0
        })
        .collect()
}

fn random_acts(n: usize, scale: f32, rng: &mut Rng) -> Vec<f32> {
    (0..n)
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
        .collect()
}

fn product(k: QuantKernels, w: &QuantMatrix<'_>, x: &[f32], n_rows: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; n_rows * w.rows];
    k.quant_linear(w, x, n_rows, &mut y).unwrap();
    y
}

/// Asserts that every supported body's product of `tested` with the `n_rows` rows `xs`
/// has the bits of the portable body's product of `reference` (the same matrix, or its
/// row layout when `tested` is tiled).
fn assert_bodies_give(
    portable: QuantKernels,
    reference: &QuantMatrix<'_>,
    tested: &QuantMatrix<'_>,
    xs: &[f32],
    n_rows: usize,
    what: impl Fn() -> String,
) {
    let want = product(portable, reference, xs, n_rows);
    for body in QuantBody::supported() {
        // With and without the unpacked-tile passes, the few-row passes and the Q6_K
        // passes' one-row prefetch, the row layout read in place and packed into tiles as
        // the product runs at every row count (the same bits every way).
        let pf = super::select::row_prefetch_default(body);
        for (unpacked, few, pf, pack) in [
            (true, true, pf, None),
            (false, true, pf, None),
            (true, false, pf, None),
            (true, true, !pf, None),
            (true, true, pf, Some(1)),
        ] {
            let k = QuantKernels::new(body)
                .unwrap()
                .with_unpacked_tiles(unpacked)
                .with_few_row_passes(few)
                .with_q6k_row_prefetch(pf)
                .with_pack_rows(pack);
            let got = product(k, tested, xs, n_rows);
            let same = got
                .iter()
                .zip(&want)
                .all(|(g, e)| g.to_bits() == e.to_bits());
            assert!(
                same,
                "{body} (unpacked tiles {unpacked}, few-row passes {few}, Q6_K one-row prefetch {pf}, packed from {pack:?} rows): {}",
                what()
            );
        }
    }
}

/// With power-of-two block scales (one per format, MXFP4's always) and activations Q8 represents exactly, every step of
/// the quantised product is exact, so it equals the f64 product of gguf-py's weights
/// with the activations exactly, for every format and body.
#[test]
fn representable_activations_give_the_exact_product() {
    let mut rng = Rng::new(29);
    for format in QuantFormat::ALL {
        let (rows, cols, n_rows) = (5, 2 * format.block_elems().max(256), 3);
        let mut bytes = random_blocks(format, rows * cols / format.block_elems(), 7);
        // d = ±2^-4, dmin = 2^-5.
        set_f16(&mut bytes, format, |b, i| {
            if i == 1 {
                1.0 / 32.0
            } else if b % 2 == 0 {
                1.0 / 16.0
            } else {
                -1.0 / 16.0
            }
        });
        if format == QuantFormat::Mxfp4 {
            // Half scale 2^-4 in every block (e8m0 exponent 124).
            bytes.chunks_exact_mut(17).for_each(|b| b[0] = 124);
        }
        let w = view(&bytes, format, rows, cols);
        let x = representable(ActFormat::for_weights(format), n_rows * cols, &mut rng);
        let want = reference(&decoded(&w), rows, cols, &x, n_rows);
        for body in QuantBody::supported() {
            let got = product(QuantKernels::new(body).unwrap(), &w, &x, n_rows);
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                assert_eq!(f64::from(*g), *e, "{format} {body} output {i}");
            }
        }
    }
}

/// The rounding bound of the quantised product against the f64 product of the dequantised
/// weights with the Q8-rounded activations `xq`: each block value has at most 4 rounded
/// operations relative to the terms `|dx·sc·q|`, `|dmin·m|` (plus gguf-py's own 2 when
/// dequantising), and the f32 sum over `nb` blocks adds `nb` more, so per output
/// `(nb + 8) · 2^-24 · Σ_k (|W_k| + 2·63·|dmin_block|) · |xq_k|` bounds the difference
/// (`63·|dmin|` is the largest min term a K-quant weight subtracts; 0 for Q6_K and Q8_0).
/// Q4_1 adds the rounding of its activation sum: `s = f16(d32 · Σ a)` against the
/// reference's `dy · Σ a` (`dy = f16(d32)`) differs by at most `2^-10` (two f16 roundings)
/// of `|dy · Σ a| <= Σ |xq|`, times the block's `|m|` (with 1% margin).
fn tolerance(
    format: QuantFormat,
    w: &QuantMatrix<'_>,
    wf: &[f32],
    xq: &[f32],
    n_rows: usize,
) -> Vec<f64> {
    let (bb, be) = (format.block_bytes(), format.block_elems());
    let nb = w.cols / be;
    let eps = f64::from(f32::EPSILON) / 2.0;
    let mut tol = vec![0.0f64; n_rows * w.rows];
    for r in 0..n_rows {
        for o in 0..w.rows {
            let mut s = 0.0f64;
            let mut extra = 0.0f64;
            for k in 0..w.cols {
                let b = (o * w.cols + k) / be;
                if format == QuantFormat::Q4_1 {
                    extra +=
                        block_m(w, b) * 2f64.powi(-10) * 1.01 * f64::from(xq[r * w.cols + k].abs());
                }
                let min = match format {
                    QuantFormat::Q4K | QuantFormat::Q5K => {
                        let at = b * bb + 2;
                        126.0
                            * f64::from(
                                f16::from_le_bytes([w.data.bytes[at], w.data.bytes[at + 1]])
                                    .to_f32()
                                    .abs(),
                            )
                    }
                    _ => 0.0,
                };
                s += (f64::from(wf[o * w.cols + k].abs()) + min)
                    * f64::from(xq[r * w.cols + k].abs());
            }
            tol[r * w.rows + o] = (nb as f64 + 8.0) * eps * s + extra;
        }
    }
    tol
}

/// `|m|` of Q4_1 block `b` of `w`.
fn block_m(w: &QuantMatrix<'_>, b: usize) -> f64 {
    let at = b * QuantFormat::Q4_1.block_bytes() + 2;
    f64::from(
        f16::from_le_bytes([w.data.bytes[at], w.data.bytes[at + 1]])
            .to_f32()
            .abs(),
    )
}

/// How many outputs of `got` fall outside the rounding bound around the f64 product of
/// gguf-py's weights `wf` with the Q8-rounded activations.
fn outside_bound(
    format: QuantFormat,
    w: &QuantMatrix<'_>,
    wf: &[f32],
    x: &[f32],
    n_rows: usize,
    got: &[f32],
) -> usize {
    let xq = Q8Rows::quantize(ActFormat::for_weights(format), x, n_rows, w.cols).dequantize();
    let want = reference(wf, w.rows, w.cols, &xq, n_rows);
    let tol = tolerance(format, w, wf, &xq, n_rows);
    got.iter()
        .zip(&want)
        .zip(&tol)
        .filter(|((g, e), t)| {
            // A NaN difference counts as outside.
            let d = (f64::from(**g) - **e).abs();
            d.is_nan() || d > **t
        })
        .count()
}

/// Random blocks and activations: the product is within the rounding bound of the f64
/// product of gguf-py's weights with the Q8-rounded activations, and within the
/// activation rounding bound (half a quantisation step per value, plus the f16 rounding
/// of Q8_0's scale) of the product with the activations themselves.
#[test]
fn random_products_are_within_the_stated_bounds() {
    let mut rng = Rng::new(3);
    for format in QuantFormat::ALL {
        let be = format.block_elems();
        let (rows, cols, n_rows) = (7, 4 * be.max(256) / be * be, 4);
        let bytes = random_blocks(format, rows * cols / be, 11);
        let w = view(&bytes, format, rows, cols);
        let wf = decoded(&w);
        let x = random_acts(n_rows * cols, 4.0, &mut rng);
        let got = product(QuantKernels::process(), &w, &x, n_rows);
        assert_eq!(
            outside_bound(format, &w, &wf, &x, n_rows, &got),
            0,
            "{format}"
        );
        // Against the unrounded activations: |x - xq| <= amax/254 per value for Q8_K;
        // Q8_0's f16 scale adds up to 127 · amax/127 · 2^-11 per value.
        let exact = reference(&wf, rows, cols, &x, n_rows);
        let act = ActFormat::for_weights(format);
        let q8_0_scale = act != ActFormat::Q8K;
        for r in 0..n_rows {
            for o in 0..rows {
                let mut bound = 0.0f64;
                for (blk, xs) in x[r * cols..(r + 1) * cols]
                    .chunks_exact(act.block_elems())
                    .enumerate()
                {
                    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                    let step = amax / 254.0 * 1.001 + if q8_0_scale { amax / 2048.0 } else { 0.0 };
                    let k0 = blk * act.block_elems();
                    bound += step
                        * (k0..k0 + act.block_elems())
                            .map(|k| f64::from(wf[o * cols + k].abs()))
                            .sum::<f64>();
                    if format == QuantFormat::Q4_1 {
                        // Q8_1's f16 sum (see `tolerance`): 2^-10 of Σ |xq| <= 32 · amax.
                        bound += block_m(&w, (o * cols + k0) / 32) * 2f64.powi(-10) * 32.0 * amax;
                    }
                }
                let i = r * rows + o;
                assert!(
                    (f64::from(got[i]) - exact[i]).abs() <= bound * 1.01 + 1e-6,
                    "{format} {i}: {} vs {} (bound {bound})",
                    got[i],
                    exact[i]
                );
            }
        }
    }
}

/// Q4_K read with the nibbles of each code byte swapped, or with the two high bits of
/// the packed 6-bit scales dropped (plausible slips): the bound test rejects both.
#[test]
fn broken_decoders_fail_the_bound_test() {
    let format = QuantFormat::Q4K;
    let (rows, cols, n_rows) = (6, 1024, 2);
    let bytes = random_blocks(format, rows * cols / 256, 13);
    let w = view(&bytes, format, rows, cols);
    let wf = decoded(&w);
    let x = random_acts(n_rows * cols, 2.0, &mut Rng::new(5));
    type Break = fn(&mut [u8]);
    let breaks: [(&str, Break); 2] = [
        ("swapped nibbles", |b| {
            b[16..].iter_mut().for_each(|q| *q = q.rotate_left(4))
        }),
        ("scale high bits dropped", |b| {
            b[4..12].iter_mut().for_each(|s| *s &= 0x3f)
        }),
    ];
    for (what, brk) in breaks {
        let mut broken = bytes.clone();
        broken.chunks_exact_mut(144).for_each(brk);
        let bw = view(&broken, format, rows, cols);
        let got = product(QuantKernels::process(), &bw, &x, n_rows);
        let bad = outside_bound(format, &w, &wf, &x, n_rows, &got);
        assert!(
            bad >= rows * n_rows - 1,
            "{what}: only {bad} of {} outputs fail",
            rows * n_rows
        );
    }
}

/// Blocks with extreme f16 scales: the largest finite, subnormal, negative and zero.
fn extreme_blocks(format: QuantFormat, n: usize, seed: u64) -> Vec<u8> {
    let mut bytes = random_blocks(format, n, seed);
    let picks = [65504.0f32, -65504.0, 6.0e-8, -3.0e-5, 0.0, 1.0, -0.125];
    set_f16(&mut bytes, format, |b, i| {
        picks[(b * 3 + i * 5 + seed as usize) % picks.len()]
    });
    if format == QuantFormat::Mxfp4 {
        // The exponent's subnormal scales (0, 1), the first normal one and large ones.
        let exps = [0u8, 1, 2, 100, 127, 160, 200];
        for (b, block) in bytes.chunks_exact_mut(17).enumerate() {
            block[0] = exps[(b * 3 + seed as usize) % exps.len()];
        }
    }
    bytes
}

/// Every SIMD body gives the portable body's bits: every format, 1 to 16 rows, several
/// shapes (output rows not a multiple of any register block, one and many blocks per
/// row, rows long enough to be cut into several k-chunks), random and extreme-scale blocks, activations of very different magnitudes.
#[test]
fn every_body_gives_the_portable_bits() {
    let portable = QuantKernels::portable();
    let mut rng = Rng::new(17);
    for format in QuantFormat::ALL {
        let be = format.block_elems();
        for &(rows, blocks) in &[(1usize, 1usize), (5, 2), (67, 3), (130, 1), (3, 36)] {
            let cols = blocks * be.max(256) / be * be;
            for extreme in [false, true] {
                let n = rows * cols / be;
                let bytes = if extreme {
                    extreme_blocks(format, n, rows as u64)
                } else {
                    random_blocks(format, n, rows as u64)
                };
                let w = view(&bytes, format, rows, cols);
                let scale = if extreme { 3.0e4 } else { 1.0 };
                let x = random_acts(16 * cols, scale, &mut rng);
                for n_rows in 1..=16 {
                    assert_bodies_give(portable, &w, &w, &x[..n_rows * cols], n_rows, || {
                        format!("{format} [{rows}, {cols}] x {n_rows} rows (extreme {extreme})")
                    });
                }
            }
        }
    }
}

/// Shapes that are not whole blocks or lengths that disagree are errors, not panics.
#[test]
fn bad_shapes_are_errors() {
    let bytes = random_blocks(QuantFormat::Q4K, 4, 1);
    let q = QuantSlice::new(&bytes, QuantFormat::Q4K, 1024).unwrap();
    assert!(matches!(
        QuantMatrix::new(q, 8, 128),
        Err(QuantMatmulError::Layout { .. })
    ));
    assert!(matches!(
        QuantMatrix::new(q, 3, 256),
        Err(QuantMatmulError::Layout { .. })
    ));
    let w = QuantMatrix::new(q, 2, 512).unwrap();
    let k = QuantKernels::process();
    let mut y = vec![0.0; 2];
    assert!(matches!(
        k.quant_linear(&w, &[0.0; 511], 1, &mut y),
        Err(QuantMatmulError::Shape { what: "input", .. })
    ));
    assert!(matches!(
        k.quant_linear(&w, &[0.0; 512], 1, &mut y[..1]),
        Err(QuantMatmulError::Shape { what: "output", .. })
    ));
    // A matrix whose public fields were edited into a partial-block shape.
    let bad = QuantMatrix {
        data: q,
        rows: 8,
        cols: 128,
    };
    assert!(k.quant_linear(&bad, &[0.0; 128], 1, &mut [0.0; 8]).is_err());
    // Zero rows: nothing to compute.
    assert!(k.quant_linear(&w, &[], 0, &mut []).is_ok());
}

/// Q4_K, Q6_K, Q8_0, Q4_0 and MXFP4 matrices tiled at load give the row layout's bits in
/// every body, for every row count (passes of four rows and their remainders), several
/// panels and extreme blocks, and for the 32-weight formats rows that end in a partial
/// column of 1 to 7 blocks (gpt-oss's 2,880: 11 columns and 2 blocks; 96: the partial
/// column alone); the portable body on tiles is also held to the row layout's portable
/// bits, and untiling gives the row layout's bytes back.
#[test]
fn tiled_matrices_give_the_row_layouts_bits() {
    use super::tiles::{tile, untile};
    let portable = QuantKernels::portable();
    let mut rng = Rng::new(29);
    let shapes = [(8usize, 256usize), (72, 512), (136, 1024)];
    // Partial last columns of 2, 3, 1 and 7 blocks (odd tile counts, several panels).
    let partial = [(24usize, 2880usize), (8, 96), (72, 800), (40, 480)];
    let formats = [
        QuantFormat::Q4K,
        QuantFormat::Q6K,
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Mxfp4,
    ];
    for (format, &(rows, cols)) in formats.into_iter().flat_map(|f| {
        let b32 = f.block_elems() == 32;
        shapes
            .iter()
            .chain(partial.iter().filter(move |_| b32))
            .map(move |s| (f, s))
    }) {
        for extreme in [false, true] {
            let n = rows * cols / format.block_elems();
            let bytes = if extreme {
                extreme_blocks(format, n, rows as u64)
            } else {
                random_blocks(format, n, rows as u64)
            };
            let w = view(&bytes, format, rows, cols);
            let mut tiled = vec![0u8; bytes.len()];
            assert!(tile(format, &bytes, rows, cols, &mut tiled));
            assert_eq!(untile(format, &tiled, rows, cols).unwrap(), bytes);
            let tq = QuantSlice::tiled(&tiled, format, rows * cols, cols).unwrap();
            let tw = QuantMatrix::new(tq, rows, cols).unwrap();
            let scale = if extreme { 3.0e4 } else { 1.0 };
            let x = random_acts(9 * cols, scale, &mut rng);
            for n_rows in 1..=9 {
                assert_bodies_give(portable, &w, &tw, &x[..n_rows * cols], n_rows, || {
                    format!("{format} tiled [{rows}, {cols}] x {n_rows} rows (extreme {extreme})")
                });
            }
            let mut dq = vec![0.0f32; rows * cols];
            tq.dequantize_into(&mut dq).unwrap();
            assert_eq!(dq, decoded(&w));
        }
    }
    // Whole tiles slice; a part of a tile does not, nor does a shape that does not tile.
    let format = QuantFormat::Q4K;
    let bytes = random_blocks(format, 16, 3);
    let mut tiled = vec![0u8; bytes.len()];
    assert!(tile(format, &bytes, 16, 256, &mut tiled));
    let tq = QuantSlice::tiled(&tiled, format, 16 * 256, 256).unwrap();
    assert_eq!(
        tq.slice(8 * 256..16 * 256).unwrap().bytes,
        &tiled[8 * 144..]
    );
    assert!(tq.slice(0..256).is_none());
    assert!(QuantSlice::tiled(&tiled, format, 16 * 256, 1024).is_err());
    let q5k = random_blocks(QuantFormat::Q5K, 16, 3);
    assert!(QuantSlice::tiled(&q5k, QuantFormat::Q5K, 16 * 256, 256).is_err());
    assert!(QuantMatrix::new(tq, 8, 512).is_err());
    // A partial column: a tile row is its eight rows' plain bytes, so whole tile rows
    // slice at the plain rows' offsets; rows that are not whole tiles do not tile.
    let format = QuantFormat::Mxfp4;
    let (rows, cols) = (16, 2880);
    let bytes = random_blocks(format, rows * cols / 32, 5);
    let mut tiled = vec![0u8; bytes.len()];
    assert!(tile(format, &bytes, rows, cols, &mut tiled));
    let tq = QuantSlice::tiled(&tiled, format, rows * cols, cols).unwrap();
    let row_bytes = cols / 32 * 17;
    assert_eq!(
        tq.slice(8 * cols..16 * cols).unwrap().bytes,
        &tiled[8 * row_bytes..]
    );
    assert!(!tile(
        format,
        &bytes[..12 * row_bytes],
        12,
        cols,
        &mut tiled[..12 * row_bytes]
    ));
    assert!(QuantSlice::tiled(&bytes[..12 * row_bytes], format, 12 * cols, cols).is_err());
}

/// The AVX2 passes over Q8_0, Q4_0 and MXFP4 tiles at a few rows (1, 2, 4: the few-row
/// passes) and at batch sizes past one pass (11 to 33 activation rows, none a multiple of
/// eight: passes of eight and their remainders, 1 and 3 of them few-row passes), on whole
/// and partial columns, give the row layout's portable bits; and so
/// it does at the largest integer sums its 16-bit lanes hold (every code the largest
/// unsigned nibble or table value, or the most negative Q8_0 code, against activations all
/// `+max` or all `−max`), where a lane that saturated or wrapped would change the bits.
#[test]
fn tiled_32_weight_formats_give_the_row_bits_at_many_rows_and_largest_sums() {
    use super::tiles::tile;
    let portable = QuantKernels::portable();
    let mut rng = Rng::new(41);
    let formats = [QuantFormat::Q8_0, QuantFormat::Q4_0, QuantFormat::Mxfp4];
    let row_counts = [1usize, 2, 4, 11, 15, 17, 23, 33];
    for format in formats {
        for (rows, cols) in [(16usize, 2880usize), (8, 512)] {
            let bb = format.block_bytes();
            let n = rows * cols / 32;
            // Random blocks, then every code at its extreme (Q4_0: nibble 15 = +7 stored
            // 15; MXFP4: nibble 7 = +12, the table's 24 after the offset; Q8_0: -128).
            let mut extreme = random_blocks(format, n, 3);
            let code = match format {
                QuantFormat::Q8_0 => 0x80u8,
                QuantFormat::Q4_0 => 0xff,
                _ => 0x77,
            };
            for block in extreme.chunks_exact_mut(bb) {
                let first = bb - if format == QuantFormat::Q8_0 { 32 } else { 16 };
                block[first..].fill(code);
            }
            for bytes in [random_blocks(format, n, 2), extreme] {
                let w = view(&bytes, format, rows, cols);
                let mut tiled = vec![0u8; bytes.len()];
                assert!(tile(format, &bytes, rows, cols, &mut tiled));
                let tq = QuantSlice::tiled(&tiled, format, rows * cols, cols).unwrap();
                let tw = QuantMatrix::new(tq, rows, cols).unwrap();
                let random = random_acts(33 * cols, 1.0, &mut rng);
                let plus = vec![0.5f32; 33 * cols];
                let minus = vec![-0.5f32; 33 * cols];
                for x in [&random, &plus, &minus] {
                    for &n_rows in &row_counts {
                        assert_bodies_give(portable, &w, &tw, &x[..n_rows * cols], n_rows, || {
                            format!("{format} tiled [{rows}, {cols}] x {n_rows} rows")
                        });
                    }
                }
            }
        }
    }
}

/// Q6_K tiles at prefill's row counts (11 to 47 activation rows: the AVX2 body's four-row
/// passes below 32 rows, its unpacked passes of eight and their remainders of 0, 3 and 7
/// from 32, over several blocks and panels) give the row
/// layout's portable bits; and so they do at the largest sums its 16-bit lanes hold: every
/// code 0 (`q − 32` = −32) or 63 (+31), scales −128 and 127, against activations all
/// `+max` or all `−max` (eight products of 32 · 127 a lane, 32,512: a lane that wrapped
/// or saturated would change the bits).
#[test]
fn tiled_q6k_gives_the_row_bits_at_many_rows_and_largest_sums() {
    use super::tiles::tile;
    let portable = QuantKernels::portable();
    let mut rng = Rng::new(43);
    let format = QuantFormat::Q6K;
    let (rows, cols) = (72usize, 768usize);
    let n = rows * cols / 256;
    let mut blocks = vec![random_blocks(format, n, 5)];
    for (code, scale) in [(0x00u8, -128i8), (0xff, 127), (0x00, 127), (0xff, -128)] {
        let mut b = random_blocks(format, n, 6);
        for block in b.chunks_exact_mut(210) {
            block[..192].fill(code);
            block[192..208].fill(scale as u8);
        }
        blocks.push(b);
    }
    for bytes in &blocks {
        let w = view(bytes, format, rows, cols);
        let mut tiled = vec![0u8; bytes.len()];
        assert!(tile(format, bytes, rows, cols, &mut tiled));
        let tq = QuantSlice::tiled(&tiled, format, rows * cols, cols).unwrap();
        let tw = QuantMatrix::new(tq, rows, cols).unwrap();
        let random = random_acts(47 * cols, 1.0, &mut rng);
        let plus = vec![0.5f32; 47 * cols];
        let minus = vec![-0.5f32; 47 * cols];
        for x in [&random, &plus, &minus] {
            for n_rows in [11usize, 32, 35, 47] {
                assert_bodies_give(portable, &w, &tw, &x[..n_rows * cols], n_rows, || {
                    format!("{format} tiled [{rows}, {cols}] x {n_rows} rows")
                });
            }
        }
    }
}

/// A product that packs the row layout into tiles a panel at a time as it runs
/// (`super::pack`) gives the bits of the same matrix tiled at load and of the row layout
/// read in place, on random Q6_K, Q4_K and Q8_0 matrices (Q8_0 2,880 wide: a partial
/// tile column) of 72 output rows (whole tiles) and 77 and 131 (a last panel of 13 and 3
/// rows, packed with zero blocks after them to whole tiles), at 1, 16, 19 and 47
/// activation rows, in every SIMD body.
#[test]
fn packed_panels_give_the_bits_of_tiles_made_at_load() {
    use super::tiles::tile;
    let mut rng = Rng::new(47);
    let x = random_acts(47 * 2880, 1.0, &mut rng);
    for (format, cols) in [
        (QuantFormat::Q6K, 512usize),
        (QuantFormat::Q4K, 512),
        (QuantFormat::Q8_0, 2880),
    ] {
        for (seed, rows) in [(7u64, 72usize), (8, 77), (9, 131)] {
            let bytes = random_blocks(format, rows * cols / format.block_elems(), seed);
            let w = view(&bytes, format, rows, cols);
            // The whole tiles' rows tiled as a load does.
            let whole = rows / 8 * 8;
            let plain = &bytes[..whole * w.row_bytes()];
            let mut tiled = vec![0u8; plain.len()];
            assert!(tile(format, plain, whole, cols, &mut tiled));
            let tq = QuantSlice::tiled(&tiled, format, whole * cols, cols).unwrap();
            let tw = QuantMatrix::new(tq, whole, cols).unwrap();
            for body in QuantBody::supported() {
                let k = QuantKernels::new(body).unwrap();
                let (packed, in_place) = (k.with_pack_rows(Some(1)), k.with_pack_rows(None));
                for n_rows in [1usize, 16, 19, 47] {
                    let what = format!("{body} {format} [{rows}, {cols}] x {n_rows} rows");
                    assert_eq!(
                        packed.packs(format, cols, n_rows),
                        body != QuantBody::Portable
                    );
                    assert!(!in_place.packs(format, cols, n_rows));
                    let xs = &x[..n_rows * cols];
                    let got = product(packed, &w, xs, n_rows);
                    let rows_y = product(in_place, &w, xs, n_rows);
                    let tiles_y = product(in_place, &tw, xs, n_rows);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&rows_y), "{what}: packed vs row layout");
                    for r in 0..n_rows {
                        assert_eq!(
                            bits(&got[r * rows..r * rows + whole]),
                            bits(&tiles_y[r * whole..(r + 1) * whole]),
                            "{what}: packed vs tiled at load, activation row {r}"
                        );
                    }
                }
            }
        }
    }
}
