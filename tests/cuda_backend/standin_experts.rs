//! The grouped expert products' few-row staged form (`moe_grouped_gemv_rows`,
//! kernels/moe_grouped.cu) through cudarc on the stand-in driver, against the generic
//! `moe_grouped_gemv` (itself checked against the CPU in standin_int_products.rs) and an
//! f64 CPU MoE layer.

use crate::standin::{
    cfg, group_entries, in_standin_child, kernel_entry, load_kernels, max_abs_diff,
    run_under_standin, standin_context, Grouped, Rng,
};
use crate::standin_kernels::{addr, bits, stored};
use cudarc::driver::{CudaSlice, PushKernelArg};
use moec::runtime::cuda::detect::detect;

/// f64 dot product of f32 rows.
fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&p, &q)| f64::from(p) * f64::from(q))
        .sum()
}

/// `moe_grouped_gemv_rows` (2-16 rows per expert: rows staged, two stored rows a warp,
/// tiles walked by slot, split-K) gives `moe_grouped_gemv`'s bits with one warp an output,
/// and its values within 2e-6 of them split across 2, 4 or 8 warps; the layer's slots equal
/// an f64 CPU MoE (silu(x . gate) * (x . up), then weight * (h . down)) within 1e-5.
/// 21 tokens at top-2 over 4 experts grouped by `moe_group` into tiles of 16, 2, 10, 11
/// and 3 rows (R = 16 and R = 4 paths, full and partial); gate+up+SwiGLU (mode 3, in 136:
/// less than a 256-value step, out 264) then down scattered (mode 2, in 264, out 136:
/// an odd count of output pairs) on bf16; slots 1, 2 and 7 (7: more slots than tiles, so
/// blocks find none), split 1, 2 and 8. Then f16 weights over in 2064 (two chunks at
/// R = 4's 2048, five at R = 16's 512) to 5 outputs (a warp's second row past out_dim)
/// with biases: mode 0 (gate + bias) then mode 1 (silu(gate) * (up + bias)), split 1 and 4.
#[test]
fn the_staged_expert_kernel_equals_the_generic_one() {
    const NAME: &str = "standin_experts::the_staged_expert_kernel_equals_the_generic_one";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x5eed_0020_0016_0004);
    let (n, k, e) = (21usize, 2usize, 4usize);
    // Token t: expert 0 (t < 18) or 3, then expert 1 (t < 7 or t >= 18) or 2.
    let mut route = Vec::new();
    let mut routed = Vec::new();
    for t in 0..n {
        let (a, b) = if t < 18 {
            (0u32, if t < 7 { 1u32 } else { 2 })
        } else {
            (3, 1)
        };
        for (ex, w) in [(a, 0.625f32), (b, 0.375)] {
            route.push(ex);
            route.push(w.to_bits());
            routed.push((ex as usize, w));
        }
    }
    let route_dev = stream.clone_htod(&route).expect("htod");
    let entries = n * k;
    let max_tiles = (entries + 15 * entries.min(e)).div_ceil(16);
    let upload = |v: &[f32], code: i32| -> (CudaSlice<u8>, Vec<f32>) {
        let (bytes, decoded) = stored(v, code);
        (stream.clone_htod(&bytes).expect("htod"), decoded)
    };
    // Per expert (gate, up, down) as stored and as the CPU multiplies them.
    let (d, f) = (136usize, 264usize);
    let mats: Vec<Vec<(CudaSlice<u8>, Vec<f32>)>> = [(f, d), (f, d), (d, f)]
        .iter()
        .map(|&(o, i)| (0..e).map(|_| upload(&rng.vec(o * i, 0.3), 0)).collect())
        .collect();
    let table: Vec<u64> = mats
        .iter()
        .flat_map(|m| m.iter().map(|(s, _)| addr(&stream, s)))
        .collect();
    let table_dev = stream.clone_htod(&table).expect("htod");
    let at = |slot: usize| addr(&stream, &table_dev) + (slot * e * 8) as u64;
    let Grouped {
        perm_row,
        perm_slot,
        perm_weight,
        tiles,
    } = group_entries(
        &stream,
        &modules,
        &route_dev,
        at(2),
        entries,
        k,
        e,
        max_tiles,
    );
    let k_i = k as i32;
    let t = stream.clone_dtoh(&tiles).expect("dtoh");
    let rows: Vec<i32> = (0..t[0] as usize).map(|i| t[2 + 3 * i + 2]).collect();
    assert_eq!(rows, [16, 2, 10, 11, 3], "tiles");

    // One launch of `entry` (split: the staged form's, with its grid of output blocks x
    // slots; None: the generic form's grid of tiles x output blocks).
    let run = |entry: &str,
               xin: u64,
               gather: i32,
               mode: i32,
               (w, w2, b): (u64, u64, u64),
               y: u64,
               (inp, out, dtype): (usize, usize, i32),
               shape: Option<(usize, usize)>| {
        let (out_in, bias_dtype, inp_i, out_i) = (1i32, 2i32, inp as i32, out as i32);
        let per_warp = if mode == 3 { 1 } else { 2 };
        let (grid, split) = match shape {
            Some((slots, split)) => {
                let blocks = out.div_ceil(per_warp * 8 / split);
                ((blocks as u32, slots as u32, 1), split as i32)
            }
            None => ((max_tiles as u32, out.div_ceil(8) as u32, 1), 0),
        };
        let func = kernel_entry(&modules, entry);
        let mut launch = stream.launch_builder(&func);
        launch
            .arg(&xin)
            .arg(&perm_row)
            .arg(&perm_slot)
            .arg(&perm_weight)
            .arg(&tiles)
            .arg(&w)
            .arg(&w2)
            .arg(&b)
            .arg(&y)
            .arg(&gather)
            .arg(&mode)
            .arg(&inp_i)
            .arg(&out_i)
            .arg(&dtype)
            .arg(&out_in)
            .arg(&bias_dtype)
            .arg(&k_i);
        if shape.is_some() {
            launch.arg(&split);
        }
        // SAFETY: argument types and order match the kernel's signature; the tables hold
        // e addresses of matrices of out x inp stored values, x and y the rows they index.
        unsafe { launch.launch(cfg(grid, 256, 0)) }.expect("launch");
    };

    // bf16 gate+up+SwiGLU, then down into the slots.
    let x = rng.vec(n * d, 1.0);
    let x_dev = stream.clone_htod(&x).expect("htod");
    let layer = |shape: Option<(usize, usize)>| {
        let entry = if shape.is_some() {
            "moe_grouped_gemv_rows"
        } else {
            "moe_grouped_gemv"
        };
        let hidden = stream.alloc_zeros::<f32>(entries * f).expect("alloc");
        let slots = stream.alloc_zeros::<f32>(entries * d).expect("alloc");
        let (h, s) = (addr(&stream, &hidden), addr(&stream, &slots));
        let xp = addr(&stream, &x_dev);
        run(entry, xp, 1, 3, (at(0), at(1), 0), h, (d, f, 0), shape);
        run(entry, h, 0, 2, (at(2), 0, 0), s, (f, d, 0), shape);
        (
            stream.clone_dtoh(&hidden).expect("dtoh"),
            stream.clone_dtoh(&slots).expect("dtoh"),
        )
    };
    let generic = layer(None);
    // The f64 CPU layer, slot by slot (independent of the grouping order).
    let mut want = vec![0.0f32; entries * d];
    for (i, &(ex, w)) in routed.iter().enumerate() {
        let xr = &x[(i / k) * d..(i / k + 1) * d];
        let h: Vec<f32> = (0..f)
            .map(|o| {
                let g = dot(xr, &mats[0][ex].1[o * d..(o + 1) * d]);
                let u = dot(xr, &mats[1][ex].1[o * d..(o + 1) * d]);
                (g / (1.0 + (-g).exp()) * u) as f32
            })
            .collect();
        for o in 0..d {
            want[i * d + o] = (f64::from(w) * dot(&h, &mats[2][ex].1[o * f..(o + 1) * f])) as f32;
        }
    }
    let err = max_abs_diff(&generic.1, &want);
    assert!(err < 1e-5, "moe_grouped_gemv against the CPU: {err}");
    for (slots, split) in [(1usize, 1usize), (2, 2), (7, 8), (2, 1)] {
        let staged = layer(Some((slots, split)));
        let what = format!("moe_grouped_gemv_rows, {slots} slots, split {split}");
        if split == 1 {
            assert_eq!(bits(&staged.0), bits(&generic.0), "{what}: mode 3");
            assert_eq!(bits(&staged.1), bits(&generic.1), "{what}: mode 2");
        } else {
            let (eh, es) = (
                max_abs_diff(&staged.0, &generic.0),
                max_abs_diff(&staged.1, &generic.1),
            );
            assert!(eh < 2e-6 && es < 2e-6, "{what}: {eh} {es}");
        }
        let err = max_abs_diff(&staged.1, &want);
        assert!(err < 1e-5, "{what} against the CPU: {err}");
    }

    // f16, in 2064 to 5 outputs, biases: mode 0 (gate + bias) then mode 1.
    let (inp, out) = (2064usize, 5usize);
    let long: Vec<Vec<(CudaSlice<u8>, Vec<f32>)>> = (0..2)
        .map(|_| {
            (0..e)
                .map(|_| upload(&rng.vec(out * inp, 0.05), 1))
                .collect()
        })
        .collect();
    let biases: Vec<CudaSlice<f32>> = (0..2 * e)
        .map(|_| stream.clone_htod(&rng.vec(out, 0.5)).expect("htod"))
        .collect();
    let mut table: Vec<u64> = long
        .iter()
        .flat_map(|m| m.iter().map(|(s, _)| addr(&stream, s)))
        .collect();
    table.extend(biases.iter().map(|b| addr(&stream, b)));
    let long_dev = stream.clone_htod(&table).expect("htod");
    let lat = |slot: usize| addr(&stream, &long_dev) + (slot * e * 8) as u64;
    let x2 = stream.clone_htod(&rng.vec(n * inp, 1.0)).expect("htod");
    let two = |shape: Option<(usize, usize)>| {
        let entry = if shape.is_some() {
            "moe_grouped_gemv_rows"
        } else {
            "moe_grouped_gemv"
        };
        let y = stream.alloc_zeros::<f32>(entries * out).expect("alloc");
        let (yp, xp) = (addr(&stream, &y), addr(&stream, &x2));
        run(
            entry,
            xp,
            1,
            0,
            (lat(0), 0, lat(2)),
            yp,
            (inp, out, 1),
            shape,
        );
        run(
            entry,
            xp,
            1,
            1,
            (lat(1), 0, lat(3)),
            yp,
            (inp, out, 1),
            shape,
        );
        stream.clone_dtoh(&y).expect("dtoh")
    };
    let generic = two(None);
    assert!(
        generic.iter().all(|v| v.is_finite() && *v != 0.0),
        "written"
    );
    assert_eq!(
        bits(&two(Some((2, 1)))),
        bits(&generic),
        "f16, biases, split 1"
    );
    let err = max_abs_diff(&two(Some((5, 4))), &generic);
    assert!(err < 2e-6, "f16, biases, split 4: {err}");
    println!(
        "moe_grouped_gemv_rows: moe_grouped_gemv's bits (split 1), within 2e-6 (split 2-8), \
         the CPU's MoE within 1e-5"
    );
}

/// `moe_grouped_gemv_rows`' grid: mixtral-mid's experts at a batch-16 decode step (32
/// entries over 8 experts) get two slots (top-2: at least two tiles) and no split (gate+up
/// 448 and down 64 output blocks a slot); batch 4 two slots as well; 64 tokens (128
/// entries) at least 8 tiles; mixtral-tiny's gate+up (256 outputs) splits 2 ways and its
/// down (128) 8 ways to reach 128 blocks; a call over part of the experts keeps a slot per
/// possible tile; never more slots than tiles can exist.
#[test]
fn the_staged_expert_grid_is_sized_from_the_routed_entries() {
    use moec::runtime::cuda::launch::grouped_rows_grid;
    assert_eq!(grouped_rows_grid(3584, true, 32, 2, true, 10), (448, 2, 1));
    assert_eq!(grouped_rows_grid(1024, false, 32, 2, true, 10), (64, 2, 1));
    assert_eq!(grouped_rows_grid(1024, false, 8, 2, true, 8), (64, 2, 1));
    assert_eq!(grouped_rows_grid(1024, false, 128, 2, true, 15), (64, 8, 1));
    assert_eq!(grouped_rows_grid(256, true, 8, 2, true, 8), (64, 2, 2));
    assert_eq!(grouped_rows_grid(128, false, 8, 2, true, 8), (64, 2, 8));
    assert_eq!(grouped_rows_grid(128, false, 8, 2, false, 5), (32, 5, 4));
    assert_eq!(grouped_rows_grid(3584, true, 4, 8, true, 2), (448, 2, 1));
}
