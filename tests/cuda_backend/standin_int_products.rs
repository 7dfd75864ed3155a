//! The integer products of block-quantised weights on 8-bit activations
//! (kernels/activations_q8.cu's `q8_quantize`, kernels/q8_products.cu's `linear_gemv_q8`
//! and `moe_grouped_gemv_q8`), the fused float expert kernel (`moe_grouped_gemv` mode 3),
//! the router writing the packed route and `combine_slots` reading it in place, each
//! through cudarc on the stand-in driver against the CPU kernels of `moec`.

use crate::standin::{
    cfg, function, group_entries, in_standin_child, kernel_entry, load_kernels, max_abs_diff,
    run_under_standin, standin_context, Grouped, Rng,
};
use crate::standin_kernels::{addr, bits, random_blocks, reference_product, stored};
use cudarc::driver::{CudaSlice, PushKernelArg};
use moec::math::qmatmul::{QuantKernels, QuantMatrix};
use moec::quant::q8::{ActFormat, Q8Rows};
use moec::quant::storage::WeightDtype;
use moec::quant::{dequantize_blocks, QuantFormat, QuantSlice};
use moec::runtime::cuda::detect::detect;
use moec::runtime::cuda::launch::storage_code;

/// `q8_quantize` gives the CPU's codes and scales (`Q8Rows::quantize`) bit for bit, from
/// rows with a stride; `linear_gemv_q8` over them agrees with the CPU's int8 product
/// (`QuantKernels::portable`, the reference body) within 4e-6 * sum |x w| per output, for
/// Q8_0, Q4_K, Q5_K and Q6_K weights, with a partial block of outputs (37), input widths
/// of 1, 2 and 3 super-blocks (so lanes left without a unit, and lanes with several),
/// 1, 3 and 16 rows, a warp and a quarter warp per output, and an accumulated strided
/// output; the row-generic kernel and the row-count-specialised `linear_gemv_q8_r1` (one
/// row a pass) and `linear_gemv_q8_r16` alike. The CPU computes each block's integers exactly and sums block values in order;
/// the kernel sums the same integers per unit of 16 or 32 weights and reduces across lanes,
/// so only f32 rounding of the sums differs.
#[test]
fn integer_products_match_the_cpu_int8_product() {
    const NAME: &str = "standin_int_products::integer_products_match_the_cpu_int8_product";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let quantize = function(&modules, "activations_q8.cu", "q8_quantize");
    let gemvs = ["linear_gemv_q8", "linear_gemv_q8_r1", "linear_gemv_q8_r16"]
        .map(|entry| (entry, kernel_entry(&modules, entry)));
    let mut rng = Rng(0x7a3c_1e55_0b1d_4f29);
    let formats = [
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
    ];
    for format in formats {
        let act = ActFormat::for_weights(format);
        let kind = i32::from(act != ActFormat::Q8K);
        let code = storage_code(WeightDtype::F32, Some(format));
        // (outputs, inputs, rows, lanes per output, accumulate)
        for (out, inp, n, group, accumulate) in [
            (37usize, 768usize, 3usize, 32i32, false),
            (37, 512, 1, 8, true),
            (9, 256, 16, 32, false),
        ] {
            let bytes = random_blocks(format, out * inp / format.block_elems(), &mut rng);
            let mut w = vec![0.0f32; out * inp];
            dequantize_blocks(format, &bytes, &mut w).expect("whole blocks");
            let w_dev = stream.clone_htod(&bytes).expect("htod");
            let x = rng.vec(n * inp, 2.0);
            // The rows 40 floats apart in memory (a strided input), the gaps NaN.
            let x_row = inp + 40;
            let mut strided = vec![f32::NAN; n * x_row];
            for (r, row) in x.chunks_exact(inp).enumerate() {
                strided[r * x_row..r * x_row + inp].copy_from_slice(row);
            }
            let x_dev = stream.clone_htod(&strided).expect("htod");
            let blocks = n * inp / act.block_elems();
            let mut codes_dev = stream.alloc_zeros::<i8>(n * inp).expect("alloc");
            let mut scales_dev = stream.alloc_zeros::<f32>(blocks).expect("alloc");
            let (x_row_i, inp_i, rows_i) = (x_row as i64, inp as i32, n as i64);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&quantize)
                    .arg(&x_dev)
                    .arg(&x_row_i)
                    .arg(&inp_i)
                    .arg(&rows_i)
                    .arg(&0u64)
                    .arg(&mut codes_dev)
                    .arg(&mut scales_dev)
                    .arg(&kind)
                    .launch(cfg((2, 1, 1), 64, 0))
            }
            .expect("launch");
            let want = Q8Rows::quantize(act, &x, n, inp);
            assert_eq!(
                stream.clone_dtoh(&codes_dev).expect("dtoh"),
                want.qs,
                "{format}: q8_quantize codes"
            );
            assert_eq!(
                bits(&stream.clone_dtoh(&scales_dev).expect("dtoh")),
                bits(&want.d),
                "{format}: q8_quantize scales"
            );

            let ldy = out + 3;
            let start: Vec<f32> = (0..n * ldy).map(|i| (i % 7) as f32 * 0.25).collect();
            // One row: also the kernel that quantises its row itself, from the strided floats
            // (shared memory: the codes, then the scales from a 16-byte boundary).
            let x1 = (n == 1).then(|| {
                let entry = "linear_gemv_q8_x1";
                (entry, kernel_entry(&modules, entry))
            });
            for (entry, gemv) in gemvs.iter().chain(x1.iter()) {
                let folded = *entry == "linear_gemv_q8_x1";
                let shared = if folded {
                    (inp.next_multiple_of(16) + 4 * blocks) as u32
                } else {
                    0
                };
                let mut y_dev = stream.clone_htod(&start).expect("htod");
                let (ni, outi, ldyi, acci) =
                    (n as i32, out as i32, ldy as i32, i32::from(accumulate));
                let per_block = 256 / group as usize;
                let mut builder = stream.launch_builder(gemv);
                if folded {
                    builder.arg(&x_dev).arg(&x_row_i).arg(&kind);
                } else {
                    builder.arg(&codes_dev).arg(&scales_dev);
                }
                // SAFETY: argument types and order match the kernel's signature.
                unsafe {
                    builder
                        .arg(&w_dev)
                        .arg(&mut y_dev)
                        .arg(&ni)
                        .arg(&inp_i)
                        .arg(&outi)
                        .arg(&code)
                        .arg(&ldyi)
                        .arg(&acci)
                        .arg(&group)
                        .launch(cfg((out.div_ceil(per_block) as u32, 1, 1), 256, shared))
                }
                .expect("launch");
                let y = stream.clone_dtoh(&y_dev).expect("dtoh");
                let matrix = QuantMatrix::new(
                    QuantSlice::new(&bytes, format, out * inp).expect("blocks"),
                    out,
                    inp,
                )
                .expect("matrix");
                let mut cpu = vec![0.0f32; n * out];
                QuantKernels::portable()
                    .quant_linear(&matrix, &x, n, &mut cpu)
                    .expect("CPU product");
                let (_, mag) = reference_product(&w, &want.dequantize(), n, inp);
                let mut worst = 0.0f64;
                for r in 0..n {
                    for o in 0..out {
                        let base = if accumulate { start[r * ldy + o] } else { 0.0 };
                        let got = f64::from(y[r * ldy + o]) - f64::from(base);
                        let err = (got - f64::from(cpu[r * out + o])).abs();
                        worst = worst.max(err / (4e-6 * mag[r * out + o] + 1e-30));
                    }
                    // The columns past `out` of each strided row are untouched.
                    for o in out..ldy {
                        assert_eq!(
                            y[r * ldy + o],
                            start[r * ldy + o],
                            "{format}: wrote past out"
                        );
                    }
                }
                println!(
                    "{format}: {entry} (out {out}, in {inp}, rows {n}, {group} lanes an \
                 output) error {worst:.3} of the bound"
                );
                assert!(worst <= 1.0, "{format}: {entry} {worst} x the bound");
            }
        }
    }
}

/// A decode-like MoE layer on the device against the CPU: 5 tokens at top-2 over 4
/// experts, expert 3 not a member of the task's set (its entries skipped, its slots left
/// zero: a partial expert set), Q4_K gate and up and a Q6_K down (Q4_K_M's mix).
/// `moe_group` over the grid `max_tiles` sizes; `moe_grouped_gemv_q8` mode 3 gives
/// silu(gate) * up of the CPU's int8 products per grouped position within 1e-5 relative;
/// `q8_quantize` with the live count writes only the grouped positions' codes (the rows
/// past it keep their bytes); mode 2 scatters weight * down into the slots within 1e-5 of
/// the largest slot value (3e-7 when written; a hidden value's f32 rounding could move one
/// of its 8-bit codes, which the margin allows). The
/// float kernel's mode 3 (gate, up and SwiGLU in one launch) equals modes 0 then 1 bit for
/// bit on bf16 experts. The router writes the packed route equal to its experts and
/// weights, and `combine_slots` reading experts from the route (stride 2) equals reading
/// them from an experts array.
#[test]
fn grouped_integer_experts_match_the_cpu_over_a_partial_set() {
    const NAME: &str =
        "standin_int_products::grouped_integer_experts_match_the_cpu_over_a_partial_set";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let (n, k, e, d, f) = (5usize, 2usize, 4usize, 256usize, 512usize);
    let members = [true, true, true, false];
    // Route: token t -> experts (t % 4, (t + 1) % 4), weights 0.6 / 0.4.
    let mut route = Vec::new();
    for t in 0..n {
        for (s, wgt) in [(0usize, 0.6f32), (1, 0.4)] {
            route.push(((t + s) % e) as u32);
            route.push(wgt.to_bits());
        }
    }
    let route_dev = stream.clone_htod(&route).expect("htod");
    let mut gate = Vec::new();
    let mut up = Vec::new();
    let mut down = Vec::new();
    for _ in 0..e {
        gate.push(random_blocks(QuantFormat::Q4K, f * d / 256, &mut rng));
        up.push(random_blocks(QuantFormat::Q4K, f * d / 256, &mut rng));
        down.push(random_blocks(QuantFormat::Q6K, d * f / 256, &mut rng));
    }
    let up_devs: Vec<_> = up
        .iter()
        .map(|b| stream.clone_htod(b).expect("htod"))
        .collect();
    let gate_devs: Vec<_> = gate
        .iter()
        .map(|b| stream.clone_htod(b).expect("htod"))
        .collect();
    let down_devs: Vec<_> = down
        .iter()
        .map(|b| stream.clone_htod(b).expect("htod"))
        .collect();
    let mut table = vec![0u64; 3 * e];
    for m in 0..e {
        if members[m] {
            table[m] = addr(&stream, &gate_devs[m]);
            table[e + m] = addr(&stream, &up_devs[m]);
            table[2 * e + m] = addr(&stream, &down_devs[m]);
        }
    }
    let table_dev = stream.clone_htod(&table).expect("htod");
    let table_at = |slot: usize| addr(&stream, &table_dev) + (slot * e * 8) as u64;
    let entries = n * k;
    let max_tiles = (entries + 15 * entries.min(3)).div_ceil(16);
    let down_table = table_at(2);
    let Grouped {
        perm_row,
        perm_slot,
        perm_weight,
        tiles,
    } = group_entries(
        &stream, &modules, &route_dev, down_table, entries, k, e, max_tiles,
    );
    let (k_i, e_i) = (k as i32, e as i32);
    let tiles_host = stream.clone_dtoh(&tiles).expect("dtoh");
    let live = tiles_host[1] as usize;
    // Expert 3 is routed by token 3 (slot 0) and token 2 (slot 1): 2 entries skipped.
    assert_eq!(live, entries - 2, "grouped positions");
    assert!(tiles_host[0] as usize <= max_tiles, "tiles within the grid");
    let rows_of = stream.clone_dtoh(&perm_row).expect("dtoh");
    let slots_of = stream.clone_dtoh(&perm_slot).expect("dtoh");

    let x = rng.vec(n * d, 1.5);
    let x_dev = stream.clone_htod(&x).expect("htod");
    let quantize = function(&modules, "activations_q8.cu", "q8_quantize");
    let mut codes = stream.alloc_zeros::<i8>(n * d).expect("alloc");
    let mut scales = stream.alloc_zeros::<f32>(n * d / 256).expect("alloc");
    let (d_i, f_i, n_l, kind) = (d as i32, f as i32, n as i64, 0i32);
    let d_l = d as i64;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&quantize)
            .arg(&x_dev)
            .arg(&d_l)
            .arg(&d_i)
            .arg(&n_l)
            .arg(&0u64)
            .arg(&mut codes)
            .arg(&mut scales)
            .arg(&kind)
            .launch(cfg((1, 1, 1), 64, 0))
    }
    .expect("launch");
    let grouped = kernel_entry(&modules, "moe_grouped_gemv_q8");
    let mut hidden = stream.alloc_zeros::<f32>(entries * f).expect("alloc");
    let (gather, mode3, code4, code6) = (1i32, 3i32, 4i32, 6i32);
    let (gate_table, up_table) = (table_at(0), table_at(1));
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&grouped)
            .arg(&codes)
            .arg(&scales)
            .arg(&perm_row)
            .arg(&perm_slot)
            .arg(&perm_weight)
            .arg(&tiles)
            .arg(&gate_table)
            .arg(&up_table)
            .arg(&mut hidden)
            .arg(&gather)
            .arg(&mode3)
            .arg(&d_i)
            .arg(&f_i)
            .arg(&code4)
            .arg(&k_i)
            .launch(cfg((max_tiles as u32, (f / 8) as u32, 1), 256, 0))
    }
    .expect("launch");
    let hidden_host = stream.clone_dtoh(&hidden).expect("dtoh");
    let cpu = QuantKernels::portable();
    let product = |bytes: &[u8], format, out: usize, inp: usize, x: &[f32]| {
        let m = QuantMatrix::new(
            QuantSlice::new(bytes, format, out * inp).expect("blocks"),
            out,
            inp,
        )
        .expect("matrix");
        let mut y = vec![0.0f32; out];
        cpu.quant_linear(&m, x, 1, &mut y).expect("CPU product");
        y
    };
    // Per output: |d(silu(g) u)| <= 1.1 |dg| |u| + |silu(g)| |du| with |dg|, |du| at most
    // 4e-6 * sum |x w| of their products (as in the test above), plus the final roundings.
    let decoded = |bytes: &[u8], format, len| {
        let mut w = vec![0.0f32; len];
        dequantize_blocks(format, bytes, &mut w).expect("whole blocks");
        w
    };
    let x_rt = Q8Rows::quantize(ActFormat::Q8K, &x, n, d).dequantize();
    let mut worst = 0.0f64;
    let mut cpu_hidden = vec![0.0f32; live * f];
    let mut hidden_bound = vec![0.0f64; live * f];
    for p in 0..live {
        let t = rows_of[p] as usize;
        let expert = route[2 * (t * k + slots_of[p] as usize)] as usize;
        assert!(members[expert], "position {p} of a non-member");
        let xr = &x[t * d..(t + 1) * d];
        let g = product(&gate[expert], QuantFormat::Q4K, f, d, xr);
        let u = product(&up[expert], QuantFormat::Q4K, f, d, xr);
        let xr_rt = &x_rt[t * d..(t + 1) * d];
        let (_, mag_g) = reference_product(
            &decoded(&gate[expert], QuantFormat::Q4K, f * d),
            xr_rt,
            1,
            d,
        );
        let (_, mag_u) =
            reference_product(&decoded(&up[expert], QuantFormat::Q4K, f * d), xr_rt, 1, d);
        for o in 0..f {
            let silu = g[o] / (1.0 + (-g[o]).exp());
            let want = silu * u[o];
            cpu_hidden[p * f + o] = want;
            let got = hidden_host[p * f + o];
            let bound = 1.1 * 4e-6 * mag_g[o] * f64::from(u[o].abs())
                + f64::from(silu.abs()) * 4e-6 * mag_u[o]
                + 1e-6 * f64::from(want.abs())
                + 1e-30;
            hidden_bound[p * f + o] = bound;
            worst = worst.max(f64::from((got - want).abs()) / bound);
        }
    }
    println!("moe_grouped_gemv_q8 gate+up+SwiGLU: error {worst:.3} of the bound");
    assert!(worst <= 1.0, "gate+up+SwiGLU {worst} x the bound");

    // The hidden rows quantised with the live count: rows past it keep their bytes (7).
    let mut hcodes = stream.clone_htod(&vec![7i8; entries * f]).expect("htod");
    let mut hscales = stream.alloc_zeros::<f32>(entries * f / 256).expect("alloc");
    let (f_l, entries_l) = (f as i64, entries as i64);
    let live_ptr = addr(&stream, &tiles) + 4;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&quantize)
            .arg(&hidden)
            .arg(&f_l)
            .arg(&f_i)
            .arg(&entries_l)
            .arg(&live_ptr)
            .arg(&mut hcodes)
            .arg(&mut hscales)
            .arg(&kind)
            .launch(cfg((2, 1, 1), 128, 0))
    }
    .expect("launch");
    let hcodes_host = stream.clone_dtoh(&hcodes).expect("dtoh");
    assert!(
        hcodes_host[live * f..].iter().all(|&c| c == 7),
        "q8_quantize wrote rows past the live count"
    );
    let mut slots = stream.alloc_zeros::<f32>(n * k * d).expect("alloc");
    let (gather0, mode2) = (0i32, 2i32);
    let no_table = 0u64;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&grouped)
            .arg(&hcodes)
            .arg(&hscales)
            .arg(&perm_row)
            .arg(&perm_slot)
            .arg(&perm_weight)
            .arg(&tiles)
            .arg(&down_table)
            .arg(&no_table)
            .arg(&mut slots)
            .arg(&gather0)
            .arg(&mode2)
            .arg(&f_i)
            .arg(&d_i)
            .arg(&code6)
            .arg(&k_i)
            .launch(cfg((max_tiles as u32, (d / 8) as u32, 1), 256, 0))
    }
    .expect("launch");
    let slots_host = stream.clone_dtoh(&slots).expect("dtoh");
    let mut want_slots = vec![0.0f32; n * k * d];
    for p in 0..live {
        let (t, s) = (rows_of[p] as usize, slots_of[p] as usize);
        let expert = route[2 * (t * k + s)] as usize;
        let wgt = f32::from_bits(route[2 * (t * k + s) + 1]);
        let y = product(
            &down[expert],
            QuantFormat::Q6K,
            d,
            f,
            &cpu_hidden[p * f..(p + 1) * f],
        );
        for o in 0..d {
            want_slots[(t * k + s) * d + o] = wgt * y[o];
        }
    }
    let largest = want_slots.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let err = max_abs_diff(&slots_host, &want_slots);
    println!("moe_grouped_gemv_q8 down (scatter): max abs diff {err:.3e} of largest {largest:.3e}");
    assert!(err <= 1e-5 * largest, "down: {err}");
    // The row-count-specialised kernels (one row a pass; up to 16), on the same tiles and
    // the same quantised hidden rows: the same bounds against the CPU.
    // `moe_grouped_gemv_q8_x1` quantises each row itself (a pass per tile row here: the
    // tiles hold several), from the floats: x, and the first kernel's hidden rows.
    for entry in [
        "moe_grouped_gemv_q8_r1",
        "moe_grouped_gemv_q8_r16",
        "moe_grouped_gemv_q8_x1",
    ] {
        let kernel = kernel_entry(&modules, entry);
        let folded = entry == "moe_grouped_gemv_q8_x1";
        let shared = |cols: usize| {
            if folded {
                (cols + 4 * cols / 256) as u32
            } else {
                0
            }
        };
        let mut hidden2 = stream.alloc_zeros::<f32>(entries * f).expect("alloc");
        let mut builder = stream.launch_builder(&kernel);
        if folded {
            builder.arg(&x_dev).arg(&d_l).arg(&kind);
        } else {
            builder.arg(&codes).arg(&scales);
        }
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            builder
                .arg(&perm_row)
                .arg(&perm_slot)
                .arg(&perm_weight)
                .arg(&tiles)
                .arg(&gate_table)
                .arg(&up_table)
                .arg(&mut hidden2)
                .arg(&gather)
                .arg(&mode3)
                .arg(&d_i)
                .arg(&f_i)
                .arg(&code4)
                .arg(&k_i)
                .launch(cfg((max_tiles as u32, (f / 8) as u32, 1), 256, shared(d)))
        }
        .expect("launch");
        let got = stream.clone_dtoh(&hidden2).expect("dtoh");
        let worst2 = (0..live * f)
            .map(|i| f64::from((got[i] - cpu_hidden[i]).abs()) / hidden_bound[i])
            .fold(0.0f64, f64::max);
        let mut slots2 = stream.alloc_zeros::<f32>(n * k * d).expect("alloc");
        let mut builder = stream.launch_builder(&kernel);
        if folded {
            builder.arg(&hidden).arg(&f_l).arg(&kind);
        } else {
            builder.arg(&hcodes).arg(&hscales);
        }
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            builder
                .arg(&perm_row)
                .arg(&perm_slot)
                .arg(&perm_weight)
                .arg(&tiles)
                .arg(&down_table)
                .arg(&no_table)
                .arg(&mut slots2)
                .arg(&gather0)
                .arg(&mode2)
                .arg(&f_i)
                .arg(&d_i)
                .arg(&code6)
                .arg(&k_i)
                .launch(cfg((max_tiles as u32, (d / 8) as u32, 1), 256, shared(f)))
        }
        .expect("launch");
        let slots2 = stream.clone_dtoh(&slots2).expect("dtoh");
        let err2 = max_abs_diff(&slots2, &want_slots);
        println!(
            "{entry}: gate+up+SwiGLU error {worst2:.3} of the bound, down max abs diff \
             {err2:.3e} of largest {largest:.3e}"
        );
        assert!(worst2 <= 1.0, "{entry} gate+up+SwiGLU {worst2} x the bound");
        assert!(err2 <= 1e-5 * largest, "{entry} down: {err2}");
        // Non-member slots stay zero.
        assert_eq!(
            slots2.iter().filter(|&&v| v != 0.0).count(),
            slots_host.iter().filter(|&&v| v != 0.0).count(),
            "{entry}: slots written"
        );
    }
    for t in 0..n {
        for s in 0..k {
            if !members[route[2 * (t * k + s)] as usize] {
                let at = (t * k + s) * d;
                assert!(
                    slots_host[at..at + d].iter().all(|&v| v == 0.0),
                    "non-member slot"
                );
            }
        }
    }

    // The float kernel: mode 3 against modes 0 then 1 on bf16 experts, same tiles.
    let bf = |len: usize, rng: &mut Rng| -> Vec<u8> { stored(&rng.vec(len, 0.1), 0).0 };
    let gate_bf: Vec<_> = (0..e)
        .map(|_| stream.clone_htod(&bf(f * d, &mut rng)).expect("htod"))
        .collect();
    let up_bf: Vec<_> = (0..e)
        .map(|_| stream.clone_htod(&bf(f * d, &mut rng)).expect("htod"))
        .collect();
    let mut table_bf = vec![0u64; 2 * e];
    for m in 0..e {
        if members[m] {
            table_bf[m] = addr(&stream, &gate_bf[m]);
            table_bf[e + m] = addr(&stream, &up_bf[m]);
        }
    }
    let table_bf_dev = stream.clone_htod(&table_bf).expect("htod");
    let gate_t = addr(&stream, &table_bf_dev);
    let up_t = gate_t + (e * 8) as u64;
    let float = kernel_entry(&modules, "moe_grouped_gemv");
    let run_float = |mode: i32, which: u64, second: u64, y: &mut CudaSlice<f32>| {
        let (out_in, bias_dtype, dtype) = (1i32, 2i32, 0i32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&float)
                .arg(&x_dev)
                .arg(&perm_row)
                .arg(&perm_slot)
                .arg(&perm_weight)
                .arg(&tiles)
                .arg(&which)
                .arg(&second)
                .arg(&no_table)
                .arg(y)
                .arg(&gather)
                .arg(&mode)
                .arg(&d_i)
                .arg(&f_i)
                .arg(&dtype)
                .arg(&out_in)
                .arg(&bias_dtype)
                .arg(&k_i)
                .launch(cfg((max_tiles as u32, (f / 8) as u32, 1), 256, 0))
        }
        .expect("launch");
    };
    let mut fused = stream.alloc_zeros::<f32>(entries * f).expect("alloc");
    let mut apart = stream.alloc_zeros::<f32>(entries * f).expect("alloc");
    run_float(3, gate_t, up_t, &mut fused);
    run_float(0, gate_t, 0, &mut apart);
    run_float(1, up_t, 0, &mut apart);
    let (fused, apart) = (
        stream.clone_dtoh(&fused).expect("dtoh"),
        stream.clone_dtoh(&apart).expect("dtoh"),
    );
    assert_eq!(
        bits(&fused[..live * f]),
        bits(&apart[..live * f]),
        "moe_grouped_gemv mode 3"
    );
    println!("moe_grouped_gemv mode 3: equal to modes 0 then 1");

    // The router writes the packed route; combine_slots reads it in place.
    let logits = rng.vec(n * e, 2.0);
    let logits_dev = stream.clone_htod(&logits).expect("htod");
    let mut experts_dev = stream.alloc_zeros::<u32>(n * k).expect("alloc");
    let mut weights_dev = stream.alloc_zeros::<f32>(n * k).expect("alloc");
    let mut packed = stream.alloc_zeros::<u32>(2 * n * k).expect("alloc");
    let (n_i, p) = (n as i32, 1.0f32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&function(&modules, "router_topk.cu", "router_topk"))
            .arg(&logits_dev)
            .arg(&mut experts_dev)
            .arg(&mut weights_dev)
            .arg(&n_i)
            .arg(&e_i)
            .arg(&k_i)
            .arg(&p)
            .arg(&mut packed)
            .launch(cfg((1, 1, 1), 64, 0))
    }
    .expect("launch");
    let (ex, wt, pk) = (
        stream.clone_dtoh(&experts_dev).expect("dtoh"),
        stream.clone_dtoh(&weights_dev).expect("dtoh"),
        stream.clone_dtoh(&packed).expect("dtoh"),
    );
    for i in 0..n * k {
        assert_eq!(
            (pk[2 * i], pk[2 * i + 1]),
            (ex[i], wt[i].to_bits()),
            "packed route {i}"
        );
    }
    let residual = rng.vec(n * d, 1.0);
    let combine = function(&modules, "ops.cu", "combine_slots");
    let mut outs = Vec::new();
    for (experts, stride) in [
        (addr(&stream, &experts_dev), 1i32),
        (addr(&stream, &packed), 2),
    ] {
        let mut res_dev = stream.clone_htod(&residual).expect("htod");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&combine)
                .arg(&slots)
                .arg(&experts)
                .arg(&no_table)
                .arg(&mut res_dev)
                .arg(&k_i)
                .arg(&d_i)
                .arg(&stride)
                .launch(cfg((n as u32, 1, 1), 64, 0))
        }
        .expect("launch");
        outs.push(stream.clone_dtoh(&res_dev).expect("dtoh"));
    }
    assert_eq!(
        bits(&outs[0]),
        bits(&outs[1]),
        "combine_slots from the packed route"
    );
    println!("router_topk packed route and combine_slots stride 2: equal");
}

/// `linear_gemv3` and `linear_gemv3_q8` (q | k | v of one input in one launch) give the
/// bits of three `linear_gemv` / `linear_gemv_q8` launches into the same strided row: 3
/// rows of 512 inputs, outputs 37 | 8 | 8 (the first a partial block of warps), bf16 |
/// bf16 | f32 for the float kernel and Q4_K | Q4_K | Q6_K (Q4_K_M's q, k, v) for the
/// integer one (also as `linear_gemv3_q8_r1`, `_r16` and `_x1`, which quantises its rows
/// itself), with the two-product form (third output count 0) too.
#[test]
fn three_products_in_one_launch_equal_three_launches() {
    const NAME: &str = "standin_int_products::three_products_in_one_launch_equal_three_launches";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x0bad_cafe_f00d_0001);
    let (n, inp) = (3usize, 512usize);
    let outs = [37usize, 8, 8];
    let width = outs.iter().sum::<usize>() + 5;
    let cols = [0usize, outs[0], outs[0] + outs[1]];
    let x = rng.vec(n * inp, 1.0);
    let x_dev = stream.clone_htod(&x).expect("htod");
    let (n_i, inp_i, ldy) = (n as i32, inp as i32, width as i32);
    let single = kernel_entry(&modules, "linear_gemv");
    let single_q8 = kernel_entry(&modules, "linear_gemv_q8");
    for int in [false, true] {
        for parts in [3usize, 2] {
            let mut ws: Vec<CudaSlice<u8>> = Vec::new();
            let mut codes_of = Vec::new();
            for (i, &out) in outs.iter().enumerate() {
                let (bytes, code) = if int {
                    let format = if i == 2 {
                        QuantFormat::Q6K
                    } else {
                        QuantFormat::Q4K
                    };
                    let code = storage_code(WeightDtype::F32, Some(format));
                    (random_blocks(format, out * inp / 256, &mut rng), code)
                } else {
                    let code = if i == 2 { 2 } else { 0 };
                    (stored(&rng.vec(out * inp, 0.1), code).0, code)
                };
                ws.push(stream.clone_htod(&bytes).expect("htod"));
                codes_of.push(code);
            }
            // Activations for the integer kernels: one q8_quantize (Q8_K).
            let mut codes = stream.alloc_zeros::<i8>(n * inp).expect("alloc");
            let mut scales = stream.alloc_zeros::<f32>(n * inp / 256).expect("alloc");
            if int {
                let (row, rows, kind) = (inp as i64, n as i64, 0i32);
                // SAFETY: argument types and order match the kernel's signature.
                unsafe {
                    stream
                        .launch_builder(&function(&modules, "activations_q8.cu", "q8_quantize"))
                        .arg(&x_dev)
                        .arg(&row)
                        .arg(&inp_i)
                        .arg(&rows)
                        .arg(&0u64)
                        .arg(&mut codes)
                        .arg(&mut scales)
                        .arg(&kind)
                        .launch(cfg((1, 1, 1), 64, 0))
                }
                .expect("launch");
            }
            // Three launches, each into its columns.
            let apart = stream.alloc_zeros::<f32>(n * width).expect("alloc");
            let base = addr(&stream, &apart);
            for i in 0..parts {
                let (out_i, code) = (outs[i] as i32, codes_of[i]);
                let y = base + (cols[i] * 4) as u64;
                let (acc, group) = (0i32, 32i32);
                let mut launch = stream.launch_builder(if int { &single_q8 } else { &single });
                if int {
                    launch.arg(&codes).arg(&scales);
                } else {
                    launch.arg(&x_dev);
                }
                launch
                    .arg(&ws[i])
                    .arg(&y)
                    .arg(&n_i)
                    .arg(&inp_i)
                    .arg(&out_i)
                    .arg(&code)
                    .arg(&ldy)
                    .arg(&acc);
                if int {
                    launch.arg(&group);
                }
                // SAFETY: argument types and order match the kernel's signature.
                unsafe { launch.launch(cfg((outs[i].div_ceil(8) as u32, 1, 1), 256, 0)) }
                    .expect("launch");
            }
            let out3 = if parts == 3 { outs[2] as i32 } else { 0 };
            let (o0, o1) = (outs[0] as i32, outs[1] as i32);
            let (c1, c2) = (cols[1] as i32, cols[2] as i32);
            let total = outs[0] + outs[1] + out3 as usize;
            // The integer kernel in all its forms: row-generic, R = 1 and 16 (the same
            // per-unit arithmetic and lane order: the same bits), and quantising its rows
            // itself (one row a pass, from the floats: the same codes).
            let entries: &[&str] = if int {
                &[
                    "linear_gemv3_q8",
                    "linear_gemv3_q8_r1",
                    "linear_gemv3_q8_r16",
                    "linear_gemv3_q8_x1",
                ]
            } else {
                &["linear_gemv3"]
            };
            for &entry in entries {
                let mut fused = stream.alloc_zeros::<f32>(n * width).expect("alloc");
                let f = kernel_entry(&modules, entry);
                let mut launch = stream.launch_builder(&f);
                let (x_row, kind) = (inp as i64, 0i32);
                let shared = if entry == "linear_gemv3_q8_x1" {
                    launch.arg(&x_dev).arg(&x_row).arg(&kind);
                    (inp + 4 * inp / 256) as u32
                } else if int {
                    launch.arg(&codes).arg(&scales);
                    0
                } else {
                    launch.arg(&x_dev);
                    0
                };
                launch
                    .arg(&ws[0])
                    .arg(&ws[1])
                    .arg(&ws[2])
                    .arg(&o0)
                    .arg(&o1)
                    .arg(&out3)
                    .arg(&codes_of[0])
                    .arg(&codes_of[1])
                    .arg(&codes_of[2])
                    .arg(&mut fused)
                    .arg(&n_i)
                    .arg(&inp_i)
                    .arg(&ldy)
                    .arg(&c1)
                    .arg(&c2);
                // The float kernel's optional norm: none.
                let (no_norm, no_code, no_eps, no_threads) = (0u64, 0i32, 0f32, 0i32);
                if !int {
                    launch
                        .arg(&no_norm)
                        .arg(&no_code)
                        .arg(&no_eps)
                        .arg(&no_threads);
                }
                // SAFETY: argument types and order match the kernel's signature.
                unsafe { launch.launch(cfg((total.div_ceil(8) as u32, 1, 1), 256, shared)) }
                    .expect("launch");
                let (a, b) = (
                    stream.clone_dtoh(&apart).expect("dtoh"),
                    stream.clone_dtoh(&fused).expect("dtoh"),
                );
                assert_eq!(bits(&a), bits(&b), "{entry} with {parts} products");
                println!("{entry} with {parts} products: equal to {parts} launches");
            }
        }
    }
}

/// The one-row forms (`linear_gemv_1`, `moe_grouped_gemv_1`: a batch-1 decode step's
/// products with bf16/f16 weights) give the generic kernels' bits: `linear_gemv` at one
/// row over 37 outputs and inputs of 1024, 3584 (a partial 4-load step) and 520 (a width
/// that is not whole 256-value steps), accumulating; and the grouped kernel's modes 3
/// (gate+up+SwiGLU) and 2 (scatter) over one token routed to two of three experts.
#[test]
fn one_row_kernels_equal_the_generic_kernels() {
    const NAME: &str = "standin_int_products::one_row_kernels_equal_the_generic_kernels";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x5eed_0000_1111_2222);
    let half_bits = |v: &[f32], code: i32| -> Vec<u8> { stored(v, code).0 };
    let generic = kernel_entry(&modules, "linear_gemv");
    let one = kernel_entry(&modules, "linear_gemv_1");
    for code in [0i32, 1] {
        for inp in [1024usize, 3584, 520] {
            let out = 37usize;
            let w = stream
                .clone_htod(&half_bits(&rng.vec(out * inp, 0.5), code))
                .expect("htod");
            let x = stream.clone_htod(&rng.vec(inp, 1.0)).expect("htod");
            let start = rng.vec(out, 1.0);
            let mut results = Vec::new();
            for f in [&generic, &one] {
                let mut y = stream.clone_htod(&start).expect("htod");
                let (n, inp_i, out_i, ldy, acc) = (1i32, inp as i32, out as i32, out as i32, 1i32);
                // SAFETY: argument types and order match the kernel's signature.
                unsafe {
                    stream
                        .launch_builder(f)
                        .arg(&x)
                        .arg(&w)
                        .arg(&mut y)
                        .arg(&n)
                        .arg(&inp_i)
                        .arg(&out_i)
                        .arg(&code)
                        .arg(&ldy)
                        .arg(&acc)
                        .launch(cfg((out.div_ceil(8) as u32, 1, 1), 256, 0))
                }
                .expect("launch");
                results.push(stream.clone_dtoh(&y).expect("dtoh"));
            }
            assert_eq!(
                bits(&results[0]),
                bits(&results[1]),
                "linear_gemv_1 code {code} in {inp}"
            );
        }
    }
    println!("linear_gemv_1: equal to linear_gemv at one row");

    // One token to experts 2 and 0 of 3 (weights 0.7, 0.3), bf16, d 264, f 520.
    let (e, d, f, k) = (3usize, 264usize, 520usize, 2usize);
    let route: Vec<u32> = vec![2, 0.7f32.to_bits(), 0, 0.3f32.to_bits()];
    let route_dev = stream.clone_htod(&route).expect("htod");
    let mats: Vec<Vec<CudaSlice<u8>>> = [(f, d), (f, d), (d, f)]
        .iter()
        .map(|&(o, i)| {
            (0..e)
                .map(|_| {
                    stream
                        .clone_htod(&half_bits(&rng.vec(o * i, 0.3), 0))
                        .expect("htod")
                })
                .collect()
        })
        .collect();
    let table: Vec<u64> = mats
        .iter()
        .flat_map(|m| m.iter().map(|s| addr(&stream, s)))
        .collect();
    let table_dev = stream.clone_htod(&table).expect("htod");
    let at = |slot: usize| addr(&stream, &table_dev) + (slot * e * 8) as u64;
    let down = at(2);
    let Grouped {
        perm_row,
        perm_slot,
        perm_weight,
        tiles,
    } = group_entries(&stream, &modules, &route_dev, down, k, k, e, 2);
    let k_i = k as i32;
    let x = stream.clone_htod(&rng.vec(d, 1.0)).expect("htod");
    let (d_i, f_i, no) = (d as i32, f as i32, 0u64);
    let run =
        |entry: &str, xin: u64, gather: i32, mode: i32, w: u64, w2: u64, y: u64, i: i32, o: i32| {
            let (dtype, out_in, bias_dtype) = (0i32, 1i32, 2i32);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&kernel_entry(&modules, entry))
                    .arg(&xin)
                    .arg(&perm_row)
                    .arg(&perm_slot)
                    .arg(&perm_weight)
                    .arg(&tiles)
                    .arg(&w)
                    .arg(&w2)
                    .arg(&no)
                    .arg(&y)
                    .arg(&gather)
                    .arg(&mode)
                    .arg(&i)
                    .arg(&o)
                    .arg(&dtype)
                    .arg(&out_in)
                    .arg(&bias_dtype)
                    .arg(&k_i)
                    .launch(cfg((2, (o as u32).div_ceil(8), 1), 256, 0))
            }
            .expect("launch");
        };
    let mut outs = Vec::new();
    for entry in ["moe_grouped_gemv", "moe_grouped_gemv_1"] {
        let hidden = stream.alloc_zeros::<f32>(k * f).expect("alloc");
        let slots = stream.alloc_zeros::<f32>(k * d).expect("alloc");
        let (h, s) = (addr(&stream, &hidden), addr(&stream, &slots));
        run(entry, addr(&stream, &x), 1, 3, at(0), at(1), h, d_i, f_i);
        run(entry, h, 0, 2, down, 0, s, f_i, d_i);
        outs.push((
            stream.clone_dtoh(&hidden).expect("dtoh"),
            stream.clone_dtoh(&slots).expect("dtoh"),
        ));
    }
    assert_eq!(
        bits(&outs[0].0),
        bits(&outs[1].0),
        "moe_grouped_gemv_1 mode 3"
    );
    assert_eq!(
        bits(&outs[0].1),
        bits(&outs[1].1),
        "moe_grouped_gemv_1 mode 2"
    );
    assert!(
        outs[1].1.iter().any(|&v| v != 0.0),
        "the slots were written"
    );
    println!("moe_grouped_gemv_1: equal to moe_grouped_gemv at one row (modes 3 and 2)");
}

/// The norm folded into the projection that consumes it: `linear_gemv3` with a norm
/// weight (q | k | v of a layer's RMSNorm'd residual in one launch) gives the bits of
/// `rms_norm` (launched at `row_block(d)` threads) then `linear_gemv3` without one, and
/// agrees with the CPU's `normalize` then an f64 product; over 1, 3 and 16 rows, inputs of
/// 512 (16-byte loads) and 200 (a width that is not whole 8-value steps: the scalar
/// loop), outputs 37 | 8 | 5 (partial blocks of warps), bf16 | bf16 | f32 weights, and bf16
/// and f32 norm weights.
#[test]
fn a_projection_that_normalises_its_rows_equals_rms_norm_then_the_projection() {
    const NAME: &str = "standin_int_products::a_projection_that_normalises_its_rows_equals_rms_norm_then_the_projection";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::math::norm::normalize;
    use moec::math::tensor::TypedSlice;
    use moec::model::vocab::NormKind;
    use moec::runtime::cuda::launch::row_block;
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x0f01_d0a5_5eed_0044);
    let norm = function(&modules, "rms_norm.cu", "rms_norm");
    let gemv3 = kernel_entry(&modules, "linear_gemv3");
    let outs = [37usize, 8, 5];
    let total = outs.iter().sum::<usize>();
    let cols = [0usize, outs[0], outs[0] + outs[1]];
    let eps = 1e-5f32;
    for (n, inp) in [(1usize, 512usize), (3, 200), (16, 512)] {
        for norm_code in [0i32, 2] {
            let x: Vec<f32> = rng.vec(n * inp, 2.0).iter().map(|v| v + 0.25).collect();
            let nw: Vec<f32> = rng.vec(inp, 0.5).iter().map(|v| v + 1.0).collect();
            let (nw_bytes, nw_f) = stored(&nw, norm_code);
            let nw_dev = stream.clone_htod(&nw_bytes).expect("htod");
            // Weights: bf16, bf16, f32; their f32 values for the CPU.
            let codes = [0i32, 0, 2];
            let (mut ws, mut w_f) = (Vec::new(), Vec::new());
            for (&out, &code) in outs.iter().zip(&codes) {
                let (bytes, values) = stored(&rng.vec(out * inp, 0.2), code);
                ws.push(stream.clone_htod(&bytes).expect("htod"));
                w_f.push(values);
            }
            let x_dev = stream.clone_htod(&x).expect("htod");
            let (n_i, inp_i, ldy) = (n as i32, inp as i32, total as i32);
            let (o0, o1, o2) = (outs[0] as i32, outs[1] as i32, outs[2] as i32);
            let (c1, c2) = (cols[1] as i32, cols[2] as i32);
            let threads = row_block(inp);
            let launch3 = |x: &CudaSlice<f32>, y: &mut CudaSlice<f32>, with_norm: bool| {
                let (nw_ptr, threads_i) = if with_norm {
                    (addr(&stream, &nw_dev), threads as i32)
                } else {
                    (0u64, 0i32)
                };
                // SAFETY: argument types and order match the kernel's signature.
                unsafe {
                    stream
                        .launch_builder(&gemv3)
                        .arg(x)
                        .arg(&ws[0])
                        .arg(&ws[1])
                        .arg(&ws[2])
                        .arg(&o0)
                        .arg(&o1)
                        .arg(&o2)
                        .arg(&codes[0])
                        .arg(&codes[1])
                        .arg(&codes[2])
                        .arg(y)
                        .arg(&n_i)
                        .arg(&inp_i)
                        .arg(&ldy)
                        .arg(&c1)
                        .arg(&c2)
                        .arg(&nw_ptr)
                        .arg(&norm_code)
                        .arg(&eps)
                        .arg(&threads_i)
                        .launch(cfg((total.div_ceil(8) as u32, 1, 1), 256, 0))
                }
                .expect("launch");
            };
            // Unfused: rms_norm into a buffer, then the plain projection.
            let mut normed = stream.alloc_zeros::<f32>(n * inp).expect("alloc");
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&norm)
                    .arg(&x_dev)
                    .arg(&nw_dev)
                    .arg(&mut normed)
                    .arg(&inp_i)
                    .arg(&eps)
                    .arg(&norm_code)
                    .launch(cfg((n as u32, 1, 1), threads, 0))
            }
            .expect("launch");
            let mut apart = stream.alloc_zeros::<f32>(n * total).expect("alloc");
            launch3(&normed, &mut apart, false);
            let mut fused = stream.alloc_zeros::<f32>(n * total).expect("alloc");
            launch3(&x_dev, &mut fused, true);
            let (a, b) = (
                stream.clone_dtoh(&apart).expect("dtoh"),
                stream.clone_dtoh(&fused).expect("dtoh"),
            );
            assert_eq!(
                bits(&a),
                bits(&b),
                "{n} rows of {inp}, norm code {norm_code}"
            );
            // Against the CPU: its norm, then each output in f64.
            // The norm weight's stored values (exact in f32 either way).
            let mut cpu_norm = vec![0.0f32; n * inp];
            normalize(
                NormKind::Rms,
                &x,
                TypedSlice::F32(&nw_f),
                eps,
                &mut cpu_norm,
            );
            let mut want = vec![0.0f32; n * total];
            for r in 0..n {
                for (i, &out) in outs.iter().enumerate() {
                    for o in 0..out {
                        let dot: f64 = (0..inp)
                            .map(|k| {
                                f64::from(w_f[i][o * inp + k]) * f64::from(cpu_norm[r * inp + k])
                            })
                            .sum();
                        want[r * total + cols[i] + o] = dot as f32;
                    }
                }
            }
            let err = max_abs_diff(&b, &want);
            println!(
                "linear_gemv3 normalising {n} rows of {inp} (norm code {norm_code}): the unfused bits, max abs diff vs CPU {err:.3e}"
            );
            assert!(err < 1e-4, "{n} x {inp}: {err}");
        }
    }
}

/// `linear_gemv3_1` (a batch-1 step's q | k | v with bf16/f16 weights, each warp taking
/// the row's RMSNorm scale itself, its weights loaded first) gives `linear_gemv3`'s bits
/// at one row, with and without the norm (bf16 and f32 norm weights): inputs of 1024 (one
/// 4-load chunk a lane), 3584 (a partial last chunk) and 520 (not whole 256-value steps),
/// outputs 37 | 8 | 5 (partial blocks of warps), bf16 | f16 | bf16 weights.
#[test]
fn the_one_row_qkv_kernel_equals_linear_gemv3() {
    const NAME: &str = "standin_int_products::the_one_row_qkv_kernel_equals_linear_gemv3";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::runtime::cuda::launch::row_block;
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x0e1f_0000_3333_0001);
    let outs = [37usize, 8, 5];
    let total = outs.iter().sum::<usize>();
    let codes = [0i32, 1, 0];
    let eps = 1e-5f32;
    for inp in [1024usize, 3584, 520] {
        let ws: Vec<CudaSlice<u8>> = outs
            .iter()
            .zip(&codes)
            .map(|(&out, &code)| {
                stream
                    .clone_htod(&stored(&rng.vec(out * inp, 0.2), code).0)
                    .expect("htod")
            })
            .collect();
        let x: Vec<f32> = rng.vec(inp, 2.0).iter().map(|v| v + 0.25).collect();
        let x_dev = stream.clone_htod(&x).expect("htod");
        let nw: Vec<f32> = rng.vec(inp, 0.5).iter().map(|v| v + 1.0).collect();
        for norm_code in [-1i32, 0, 2] {
            let nw_dev = stream
                .clone_htod(&stored(&nw, norm_code.max(0)).0)
                .expect("htod");
            let (nw_ptr, threads) = if norm_code < 0 {
                (0u64, 0i32)
            } else {
                (addr(&stream, &nw_dev), row_block(inp) as i32)
            };
            let code = norm_code.max(0);
            let (n_i, inp_i, ldy) = (1i32, inp as i32, total as i32);
            let (o0, o1, o2) = (outs[0] as i32, outs[1] as i32, outs[2] as i32);
            let (c1, c2) = (outs[0] as i32, (outs[0] + outs[1]) as i32);
            let mut got = Vec::new();
            for entry in ["linear_gemv3", "linear_gemv3_1"] {
                let mut y = stream.alloc_zeros::<f32>(total).expect("alloc");
                // SAFETY: argument types and order match the kernel's signature.
                unsafe {
                    stream
                        .launch_builder(&kernel_entry(&modules, entry))
                        .arg(&x_dev)
                        .arg(&ws[0])
                        .arg(&ws[1])
                        .arg(&ws[2])
                        .arg(&o0)
                        .arg(&o1)
                        .arg(&o2)
                        .arg(&codes[0])
                        .arg(&codes[1])
                        .arg(&codes[2])
                        .arg(&mut y)
                        .arg(&n_i)
                        .arg(&inp_i)
                        .arg(&ldy)
                        .arg(&c1)
                        .arg(&c2)
                        .arg(&nw_ptr)
                        .arg(&code)
                        .arg(&eps)
                        .arg(&threads)
                        .launch(cfg((total.div_ceil(8) as u32, 1, 1), 256, 0))
                }
                .expect("launch");
                got.push(stream.clone_dtoh(&y).expect("dtoh"));
            }
            assert!(got[0].iter().all(|v| v.is_finite() && *v != 0.0), "{inp}");
            assert_eq!(
                bits(&got[0]),
                bits(&got[1]),
                "linear_gemv3_1 in {inp}, norm code {norm_code}"
            );
        }
    }
    println!("linear_gemv3_1: linear_gemv3's bits at one row, with and without the norm");
}

/// `moe_group` (warp scans of the route) groups as `moe_group_block` (a thread per expert
/// walking the route): the same counts, tiles and permutation, word for word; over 2
/// entries of 8 experts (a batch-1 step at top-2), 300 entries of 40 experts with 5
/// non-members and entries of no expert (past a warp's 32 experts and 32 entries, partial
/// chunks), and 0 entries.
#[test]
fn the_warp_grouping_equals_the_per_expert_grouping() {
    const NAME: &str = "standin_int_products::the_warp_grouping_equals_the_per_expert_grouping";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x9209_0000_5555_0003);
    for (entries, top_k, experts) in [(2usize, 2usize, 8usize), (300, 3, 40), (0, 2, 8)] {
        let mut route = Vec::with_capacity(2 * entries);
        for i in 0..entries {
            // Random experts from the rng's values; every 17th entry routed to no expert.
            let r = rng.vec(1, 1.0)[0].abs();
            let e = if i % 17 == 16 {
                u32::MAX
            } else {
                ((r * 1e4) as usize % experts) as u32
            };
            route.push(e);
            route.push((0.25f32 + i as f32).to_bits());
        }
        if route.is_empty() {
            // A buffer the kernels never read (0 entries): the driver takes no empty copy.
            route.extend([u32::MAX, 0]);
        }
        let route_dev = stream.clone_htod(&route).expect("htod");
        let members: Vec<u64> = (0..experts)
            .map(|e| {
                if experts > 8 && e % 8 == 3 {
                    0
                } else {
                    4096 + e as u64
                }
            })
            .collect();
        let members_dev = stream.clone_htod(&members).expect("htod");
        let max_tiles = entries + experts;
        let mut got = Vec::new();
        for entry in ["moe_group_block", "moe_group"] {
            let mut perm_row = stream.alloc_zeros::<u32>(entries.max(1)).expect("alloc");
            let mut perm_slot = stream.alloc_zeros::<u32>(entries.max(1)).expect("alloc");
            let mut perm_weight = stream.alloc_zeros::<f32>(entries.max(1)).expect("alloc");
            let mut tiles = stream.alloc_zeros::<i32>(2 + 3 * max_tiles).expect("alloc");
            let (n_ll, k_i, e_i) = (entries as i64, top_k as i32, experts as i32);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&kernel_entry(&modules, entry))
                    .arg(&route_dev)
                    .arg(&members_dev)
                    .arg(&mut perm_row)
                    .arg(&mut perm_slot)
                    .arg(&mut perm_weight)
                    .arg(&mut tiles)
                    .arg(&n_ll)
                    .arg(&k_i)
                    .arg(&e_i)
                    .launch(cfg((1, 1, 1), 256, 0))
            }
            .expect("launch");
            got.push((
                stream.clone_dtoh(&tiles).expect("dtoh"),
                stream.clone_dtoh(&perm_row).expect("dtoh"),
                stream.clone_dtoh(&perm_slot).expect("dtoh"),
                bits(&stream.clone_dtoh(&perm_weight).expect("dtoh")),
            ));
        }
        let (a, b) = (&got[0], &got[1]);
        let (n_tiles, positions) = (a.0[0] as usize, a.0[1] as usize);
        let what = format!("{entries} entries of {experts} experts");
        assert_eq!(
            a.0[..2 + 3 * n_tiles],
            b.0[..2 + 3 * n_tiles],
            "tiles, {what}"
        );
        assert_eq!(a.1[..positions], b.1[..positions], "rows, {what}");
        assert_eq!(a.2[..positions], b.2[..positions], "slots, {what}");
        assert_eq!(a.3[..positions], b.3[..positions], "weights, {what}");
        if entries == 300 {
            assert!(
                positions > 200 && positions < 300 && n_tiles >= 35,
                "{what}: {positions} {n_tiles}"
            );
        }
        println!("moe_group ({what}): moe_group_block's {positions} positions in {n_tiles} tiles");
    }
}

/// `moe_gate_route` (a decode step's gate in one launch) gives the bits of the launches it
/// replaces: `rms_norm` / `layer_norm` into the normalised rows, the router's
/// `linear_gemv` logits, `router_topk`'s packed route, and zeroed slots; and the CPU's
/// routing (`math::norm::normalize`, an f64 router product, `math::moe::route`): the same
/// experts, weights within 1e-5. 1 and 5 rows; widths 256 (16-byte loads) and 200 (the
/// scalar loop, 256 threads with a partial last stride); 10 experts (not a multiple of
/// the block's warps) at top-3; RMSNorm with p = 1 renormalisation and LayerNorm without;
/// bf16 and f32 routers.
#[test]
fn the_fused_gate_equals_norm_router_and_top_k_launches_and_routes_as_the_cpu() {
    const NAME: &str = "standin_int_products::the_fused_gate_equals_norm_router_and_top_k_launches_and_routes_as_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::math::moe::route;
    use moec::math::norm::normalize;
    use moec::math::tensor::TypedSlice;
    use moec::model::vocab::NormKind;
    use moec::runtime::cuda::launch::row_block;
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x6a7e_0000_4444_0010);
    let gemv = kernel_entry(&modules, "linear_gemv");
    let topk = function(&modules, "router_topk.cu", "router_topk");
    let (tk, eps) = (3usize, 1e-5f32);
    for (n, d, kind, router_code, ne) in [
        (1usize, 256usize, NormKind::Rms, 0i32, 10usize),
        (5, 200, NormKind::Rms, 2, 10),
        (5, 256, NormKind::LayerNoBias, 0, 10),
        // moe_gate_route (warp form): a mixtral-mid-like row (one chunk of 1024 per lane), an f16
        // router past the shared-memory staging (4104 > 4096, read back from x_norm),
        // and 40 experts (past a warp's lanes: the one-thread top-k).
        (1, 1024, NormKind::Rms, 0, 8),
        (2, 4104, NormKind::Rms, 1, 10),
        (1, 256, NormKind::Rms, 0, 40),
    ] {
        let (norm_entry, layer_norm, norm_p) = match kind {
            NormKind::Rms => ("rms_norm", 0i32, 1.0f32),
            NormKind::LayerNoBias => ("layer_norm", 1, 0.0),
        };
        let x: Vec<f32> = rng.vec(n * d, 2.0).iter().map(|v| v + 0.25).collect();
        let nw: Vec<half::bf16> = rng
            .vec(d, 0.5)
            .iter()
            .map(|v| half::bf16::from_f32(v + 1.0))
            .collect();
        let nw_dev = stream
            .clone_htod(&nw.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
            .expect("htod");
        let (router_bytes, router_f) = stored(&rng.vec(ne * d, 0.3), router_code);
        let router_dev = stream.clone_htod(&router_bytes).expect("htod");
        let x_dev = stream.clone_htod(&x).expect("htod");
        let (d_i, ne_i, tk_i, n_i, nw_code) = (d as i32, ne as i32, tk as i32, n as i32, 0i32);
        let threads = row_block(d);
        // Unfused: the norm, the router product, top-k.
        let mut normed = stream.alloc_zeros::<f32>(n * d).expect("alloc");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&function(&modules, "rms_norm.cu", norm_entry))
                .arg(&x_dev)
                .arg(&nw_dev)
                .arg(&mut normed)
                .arg(&d_i)
                .arg(&eps)
                .arg(&nw_code)
                .launch(cfg((n as u32, 1, 1), threads, 0))
        }
        .expect("launch");
        let mut logits = stream.alloc_zeros::<f32>(n * ne).expect("alloc");
        let (ldy, acc) = (ne as i32, 0i32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&gemv)
                .arg(&normed)
                .arg(&router_dev)
                .arg(&mut logits)
                .arg(&n_i)
                .arg(&d_i)
                .arg(&ne_i)
                .arg(&router_code)
                .arg(&ldy)
                .arg(&acc)
                .launch(cfg((ne.div_ceil(8) as u32, 1, 1), 256, 0))
        }
        .expect("launch");
        let mut route_apart = stream.alloc_zeros::<u32>(n * tk * 2).expect("alloc");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&topk)
                .arg(&logits)
                .arg(&0u64)
                .arg(&0u64)
                .arg(&n_i)
                .arg(&ne_i)
                .arg(&tk_i)
                .arg(&norm_p)
                .arg(&mut route_apart)
                .launch(cfg((1, 1, 1), 64, 0))
        }
        .expect("launch");
        // Fused, over slots holding garbage: both forms (MOEC_FLOAT_KERNELS=block / warp).
        for entry in ["moe_gate_route_block", "moe_gate_route"] {
            let fused_f = kernel_entry(&modules, entry);
            let mut x_norm = stream.alloc_zeros::<f32>(n * d).expect("alloc");
            let mut slots = stream.clone_htod(&vec![7.5f32; n * tk * d]).expect("htod");
            let mut route_fused = stream.alloc_zeros::<u32>(n * tk * 2).expect("alloc");
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&fused_f)
                    .arg(&x_dev)
                    .arg(&nw_dev)
                    .arg(&nw_code)
                    .arg(&layer_norm)
                    .arg(&eps)
                    .arg(&router_dev)
                    .arg(&router_code)
                    .arg(&mut x_norm)
                    .arg(&mut slots)
                    .arg(&mut route_fused)
                    .arg(&d_i)
                    .arg(&ne_i)
                    .arg(&tk_i)
                    .arg(&norm_p)
                    .launch(cfg((n as u32, 1, 1), threads, 0))
            }
            .expect("launch");
            let what = format!("{entry}: {n} rows of {d}, {ne} experts, router code {router_code}");
            let got_norm = stream.clone_dtoh(&x_norm).expect("dtoh");
            assert_eq!(
                bits(&got_norm),
                bits(&stream.clone_dtoh(&normed).expect("dtoh")),
                "{what}"
            );
            let got_route = stream.clone_dtoh(&route_fused).expect("dtoh");
            assert_eq!(
                got_route,
                stream.clone_dtoh(&route_apart).expect("dtoh"),
                "{what}"
            );
            assert!(
                stream
                    .clone_dtoh(&slots)
                    .expect("dtoh")
                    .iter()
                    .all(|&v| v == 0.0),
                "{what}"
            );
            // Against the CPU.
            let mut cpu_norm = vec![0.0f32; n * d];
            normalize(kind, &x, TypedSlice::Bf16(&nw), eps, &mut cpu_norm);
            let cpu_logits: Vec<f32> = (0..n * ne)
                .map(|i| {
                    let (t, e) = (i / ne, i % ne);
                    (0..d)
                        .map(|k| f64::from(router_f[e * d + k]) * f64::from(cpu_norm[t * d + k]))
                        .sum::<f64>() as f32
                })
                .collect();
            let want = route(&cpu_logits, ne, tk, (norm_p > 0.0).then_some(1.0));
            let experts: Vec<u32> = got_route.iter().step_by(2).copied().collect();
            let weights: Vec<f32> = got_route
                .iter()
                .skip(1)
                .step_by(2)
                .map(|&b| f32::from_bits(b))
                .collect();
            assert_eq!(experts, want.experts, "{what}");
            let err = max_abs_diff(&weights, &want.weights);
            let norm_err = max_abs_diff(&got_norm, &cpu_norm);
            println!("{what}: the unfused bits; CPU experts equal, weights within {err:.1e}, norm within {norm_err:.1e}");
            assert!(err < 1e-5 && norm_err < 1e-4, "{what}: {err} {norm_err}");
        }
    }
}
