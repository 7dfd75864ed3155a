//! The tensor-core kernels (kernels/tensor_core.cuh's `wmma` tiles, emulated by the
//! stand-in with every lane holding the whole tile: kernels/cpu_emulation/shim.h) through
//! cudarc on the stand-in driver against the CPU kernels of `moec`: `moe_grouped_mma`
//! (bf16 experts, many rows per expert) against the CPU backend's expert product.

use crate::standin::{
    cfg, function, in_standin_child, kernel_entry, load_kernels, max_abs_diff, run_under_standin,
    standin_context, Rng,
};
use crate::standin_kernels::{addr, reference_product};
use cudarc::driver::PushKernelArg;
use half::bf16;
use moec::math::linear::linear;
use moec::math::tensor::{Matrix, TypedSlice};
use moec::model::vocab::Orientation;
use moec::runtime::cuda::detect::detect;

/// `y = x . W^T` on the CPU backend (`moec::math::linear`, f32 activations times bf16
/// weights) for `n` rows of `x` and `w` stored `[out, in]`.
fn cpu_linear(w: &[bf16], out: usize, inp: usize, x: &[f32], n: usize) -> Vec<f32> {
    let m = Matrix::new(TypedSlice::Bf16(w), out, inp, Orientation::OutIn).expect("matrix");
    let mut y = vec![0.0f32; n * out];
    linear(x, n, &m, &mut y).expect("CPU product");
    y
}

/// `moe_grouped_mma` (gate, up and SwiGLU in one launch: mode 3; then down scattered
/// with the routing weights into the slots: mode 2) over `moe_group`'s tiles, against the
/// CPU backend's expert product per routed (token, slot): `weight * down(silu(gate x) *
/// up x)` with `moec::math::linear` (f32 activations, bf16 weights). Shapes with tails: 45
/// tokens at top-2 over 5 experts (odd; expert 3 not a member, its slots stay zero),
/// hidden 136 and ffn 200 (multiples of 8, not of the 16-wide tiles or the 64 inputs
/// staged per step, so partial tiles of rows, inputs and outputs), and 7 tokens over 3
/// experts with hidden 100 and ffn 72 (not multiples of 8: the element-wise weight loads).
/// Tolerance: the kernel multiplies activations split into bf16 pairs (hi + lo, relative
/// error <= 2^-17) by the exact bf16 weights with f32 accumulation, so a product is
/// within 2e-5 * sum |x w| of the CPU's f32 product (each side's f32 rounding of a sum of
/// at most 200 terms, ~1.2e-5, plus the pair's 7.6e-6); the SwiGLU'd value within the
/// bound that carries through silu(g) * u; the scattered down product, on the CPU's hidden
/// rows, within 2e-5 * sum |h w| plus the hidden rows' own error times |w|. The
/// kernels' epilogue positions, tile tails and the non-member's zero slots are checked
/// exactly.
#[test]
fn tensor_core_experts_match_the_cpu_expert_product() {
    const NAME: &str = "standin_tensor_cores::tensor_core_experts_match_the_cpu_expert_product";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let group = kernel_entry(&modules, "moe_group");
    let mma = kernel_entry(&modules, "moe_grouped_mma");
    let mut rng = Rng(0x7e45_07c0_8e11_0001);
    for (n, e, d, f, non_member) in [
        (45usize, 5usize, 136usize, 200usize, Some(3usize)),
        (7, 3, 100, 72, None),
    ] {
        let k = 2usize;
        let members: Vec<bool> = (0..e).map(|m| Some(m) != non_member).collect();
        // Route: each token two distinct experts from the generator, weights that sum to 1.
        let mut route = Vec::new();
        for _ in 0..n {
            let a = ((rng.next_f32() * 0.5 + 0.5) * e as f32) as usize % e;
            let b =
                (a + 1 + ((rng.next_f32() * 0.5 + 0.5) * (e - 1) as f32) as usize % (e - 1)) % e;
            let wa = 0.5 + 0.4 * rng.next_f32();
            for (expert, wgt) in [(a, wa), (b, 1.0 - wa)] {
                route.push(expert as u32);
                route.push(wgt.to_bits());
            }
        }
        let route_dev = stream.clone_htod(&route).expect("htod");
        let bf = |len: usize, scale: f32, rng: &mut Rng| -> Vec<bf16> {
            rng.vec(len, scale)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect()
        };
        let gate: Vec<Vec<bf16>> = (0..e).map(|_| bf(f * d, 0.2, &mut rng)).collect();
        let up: Vec<Vec<bf16>> = (0..e).map(|_| bf(f * d, 0.2, &mut rng)).collect();
        let down: Vec<Vec<bf16>> = (0..e).map(|_| bf(d * f, 0.2, &mut rng)).collect();
        let upload = |w: &Vec<bf16>| {
            let bits: Vec<u16> = w.iter().map(|v| v.to_bits()).collect();
            stream.clone_htod(&bits).expect("htod")
        };
        let devs: Vec<_> = [&gate, &up, &down]
            .iter()
            .map(|ws| ws.iter().map(upload).collect::<Vec<_>>())
            .collect();
        let mut table = vec![0u64; 3 * e];
        for m in 0..e {
            if members[m] {
                for (which, dev) in devs.iter().enumerate() {
                    table[which * e + m] = addr(&stream, &dev[m]);
                }
            }
        }
        let table_dev = stream.clone_htod(&table).expect("htod");
        let table_at = |which: usize| addr(&stream, &table_dev) + (which * e * 8) as u64;
        let entries = n * k;
        let member_count = members.iter().filter(|&&m| m).count();
        let max_tiles = (entries + 15 * entries.min(member_count)).div_ceil(16);
        let mut perm_row = stream.alloc_zeros::<u32>(entries).expect("alloc");
        let mut perm_slot = stream.alloc_zeros::<u32>(entries).expect("alloc");
        let mut perm_weight = stream.alloc_zeros::<f32>(entries).expect("alloc");
        let mut tiles = stream.alloc_zeros::<i32>(2 + 3 * max_tiles).expect("alloc");
        let (entries_i, k_i, e_i) = (entries as i64, k as i32, e as i32);
        let down_table = table_at(2);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&group)
                .arg(&route_dev)
                .arg(&down_table)
                .arg(&mut perm_row)
                .arg(&mut perm_slot)
                .arg(&mut perm_weight)
                .arg(&mut tiles)
                .arg(&entries_i)
                .arg(&k_i)
                .arg(&e_i)
                .launch(cfg((1, 1, 1), 256, 0))
        }
        .expect("launch");
        let tiles_host = stream.clone_dtoh(&tiles).expect("dtoh");
        let live = tiles_host[1] as usize;
        let rows_of = stream.clone_dtoh(&perm_row).expect("dtoh");
        let slots_of = stream.clone_dtoh(&perm_slot).expect("dtoh");
        let partial = (0..tiles_host[0] as usize)
            .filter(|t| tiles_host[2 + 3 * t + 2] < 16)
            .count();
        assert!(tiles_host[0] as usize <= max_tiles, "tiles within the grid");

        let x = rng.vec(n * d, 1.5);
        let x_dev = stream.clone_htod(&x).expect("htod");
        let launch_mma = |x: &cudarc::driver::CudaSlice<f32>,
                          y: &mut cudarc::driver::CudaSlice<f32>,
                          (gather, mode, which, second): (i32, i32, usize, u64),
                          (in_dim, out_dim): (usize, usize)| {
            let (first_table, no_bias, dtype, out_in, bias_dtype) =
                (table_at(which), 0u64, 0i32, 1i32, 2i32);
            let (in_i, out_i) = (in_dim as i32, out_dim as i32);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&mma)
                    .arg(x)
                    .arg(&perm_row)
                    .arg(&perm_slot)
                    .arg(&perm_weight)
                    .arg(&tiles)
                    .arg(&first_table)
                    .arg(&second)
                    .arg(&no_bias)
                    .arg(y)
                    .arg(&gather)
                    .arg(&mode)
                    .arg(&in_i)
                    .arg(&out_i)
                    .arg(&dtype)
                    .arg(&out_in)
                    .arg(&bias_dtype)
                    .arg(&k_i)
                    .launch(cfg(
                        (max_tiles as u32, out_dim.div_ceil(64) as u32, 1),
                        128,
                        0,
                    ))
            }
            .expect("launch");
        };
        // Gate, up and SwiGLU (mode 3) into the grouped hidden rows; rows past the live
        // count keep their values (poison: 7.0).
        let mut hidden = stream.clone_htod(&vec![7.0f32; entries * f]).expect("htod");
        launch_mma(&x_dev, &mut hidden, (1, 3, 0, table_at(1)), (d, f));
        let hidden_host = stream.clone_dtoh(&hidden).expect("dtoh");
        assert!(
            hidden_host[live * f..].iter().all(|&v| v == 7.0),
            "wrote past the live positions"
        );
        let decoded = |w: &[bf16]| w.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let mut cpu_hidden = vec![0.0f32; live * f];
        let mut hidden_bound = vec![0.0f64; live * f];
        let (mut worst, mut max_diff) = (0.0f64, 0.0f32);
        for p in 0..live {
            let t = rows_of[p] as usize;
            let expert = route[2 * (t * k + slots_of[p] as usize)] as usize;
            assert!(members[expert], "position {p} of a non-member");
            let xr = &x[t * d..(t + 1) * d];
            let g = cpu_linear(&gate[expert], f, d, xr, 1);
            let u = cpu_linear(&up[expert], f, d, xr, 1);
            let (_, mag_g) = reference_product(&decoded(&gate[expert]), xr, 1, d);
            let (_, mag_u) = reference_product(&decoded(&up[expert]), xr, 1, d);
            for o in 0..f {
                let silu = g[o] / (1.0 + (-g[o]).exp());
                let want = silu * u[o];
                cpu_hidden[p * f + o] = want;
                let got = hidden_host[p * f + o];
                let bound = 1.1 * 2e-5 * mag_g[o] * f64::from(u[o].abs())
                    + f64::from(silu.abs()) * 2e-5 * mag_u[o]
                    + 1e-6 * f64::from(want.abs())
                    + 1e-30;
                hidden_bound[p * f + o] = bound;
                worst = worst.max(f64::from((got - want).abs()) / bound);
                max_diff = max_diff.max((got - want).abs());
            }
        }
        println!(
            "moe_grouped_mma gate+up+SwiGLU, {n} tokens x top-{k} over {e} experts, hidden {d}, \
             ffn {f} ({} tiles, {partial} partial): max abs diff vs CPU {max_diff:.3e}, \
             {worst:.3} of the bound",
            tiles_host[0]
        );
        assert!(worst <= 1.0, "gate+up+SwiGLU {worst} x the bound");

        // Down, scattered with the routing weights into the slots (mode 2).
        let mut slots = stream.alloc_zeros::<f32>(n * k * d).expect("alloc");
        launch_mma(&hidden, &mut slots, (0, 2, 2, 0), (f, d));
        let slots_host = stream.clone_dtoh(&slots).expect("dtoh");
        let mut want_slots = vec![0.0f32; n * k * d];
        let mut worst = 0.0f64;
        for p in 0..live {
            let (t, s) = (rows_of[p] as usize, slots_of[p] as usize);
            let expert = route[2 * (t * k + s)] as usize;
            let wgt = f32::from_bits(route[2 * (t * k + s) + 1]);
            let h = &cpu_hidden[p * f..(p + 1) * f];
            let y = cpu_linear(&down[expert], d, f, h, 1);
            let w_down = decoded(&down[expert]);
            let (_, mag) = reference_product(&w_down, h, 1, f);
            for o in 0..d {
                let want = wgt * y[o];
                want_slots[(t * k + s) * d + o] = want;
                // The hidden rows' own error carried through the down row.
                let carried: f64 = (0..f)
                    .map(|i| hidden_bound[p * f + i] * f64::from(w_down[o * f + i].abs()))
                    .sum();
                let bound = f64::from(wgt) * (2e-5 * mag[o] + carried)
                    + 1e-6 * f64::from(want.abs())
                    + 1e-30;
                let got = slots_host[(t * k + s) * d + o];
                worst = worst.max(f64::from((got - want).abs()) / bound);
            }
        }
        let err = max_abs_diff(&slots_host, &want_slots);
        println!(
            "moe_grouped_mma down (scatter): max abs diff vs CPU {err:.3e}, {worst:.3} of the bound"
        );
        assert!(worst <= 1.0, "down {worst} x the bound");
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
    }
}

/// `paged_prefill_attention_mma` (flash attention on tensor-core tiles) against the CPU's
/// `attention` after `paged_kv_append_rows`: 4 sequences in one launch, (cached, new) =
/// (0, 37), (17, 5), (40, 1), (3, 20), so 16-row tiles that straddle sequences (one pass
/// per sequence in a tile), a partial last tile, a continuing prompt and a decode row;
/// head_dim 32 with 8 heads over 2 kv heads and head_dim 40 (not a multiple of the 16-wide
/// tiles: zero-padded) with 6 heads over 3; without and with a sliding window of 12, and
/// with gpt-oss's sinks. Tolerance: 1e-4 absolute, paged_prefill_attention's
/// (prefill_attention_matches_the_cpu): the bf16-pair products keep ~1e-5 relative.
#[test]
fn tensor_core_prefill_attention_matches_the_cpu() {
    const NAME: &str = "standin_tensor_cores::tensor_core_prefill_attention_matches_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use crate::standin::{cpu_attention_checking_appends, paged_rows};
    use moec::model::vocab::{AttnShape, KvLayout};
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let append = function(&modules, "prefill_attention.cu", "paged_kv_append_rows");
    let mma = function(
        &modules,
        "prefill_attention.cu",
        "paged_prefill_attention_mma",
    );
    let mut rng = Rng(0x7e45_07c0_8e11_0002);
    let (bs, n_blocks, mb) = (16usize, 24usize, 6usize);
    let seqs_spec = [(0usize, 37usize), (17, 5), (40, 1), (3, 20)];
    let rows = paged_rows(&seqs_spec, bs, n_blocks, mb);
    let n_rows = rows.row_seq.len();
    for (ah, akvh, ahd) in [(8usize, 2usize, 32usize), (6, 3, 40)] {
        let layout = KvLayout {
            block_size: bs,
            kv_heads: akvh,
            head_dim: ahd,
            values_in_keys: None,
        };
        for (window, sinks) in [(None, false), (Some(12usize), false), (None, true)] {
            let shape = AttnShape {
                heads: ah,
                kv_heads: akvh,
                head_dim: ahd,
                sliding_window: window,
                sinks,
            };
            let pool_len = n_blocks * layout.block_elems();
            let k_pool = rng.vec(pool_len, 1.0);
            let v_pool = rng.vec(pool_len, 1.0);
            let qkv = rng.vec(n_rows * shape.qkv_width(), 1.0);
            let qkv_dev = stream.clone_htod(&qkv).expect("htod");
            let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
            let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
            let tables_dev = stream.clone_htod(&rows.tables).expect("htod");
            let seq_dev = stream.clone_htod(&rows.row_seq).expect("htod");
            let pos_dev = stream.clone_htod(&rows.row_pos).expect("htod");
            let mut out_dev = stream.alloc_zeros::<f32>(n_rows * ah * ahd).expect("alloc");
            let ints = [ah, akvh, ahd, bs, mb].map(|v| v as i32);
            let row_width = shape.qkv_width() as i32;
            let sink_col = if sinks {
                ((ah + 2 * akvh) * ahd) as i32
            } else {
                -1
            };
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&append)
                    .arg(&qkv_dev)
                    .arg(&mut k_dev)
                    .arg(&mut v_dev)
                    .arg(&tables_dev)
                    .arg(&seq_dev)
                    .arg(&pos_dev)
                    .arg(&ints[0])
                    .arg(&ints[1])
                    .arg(&ints[2])
                    .arg(&ints[3])
                    .arg(&ints[4])
                    .arg(&row_width)
                    .launch(cfg((n_rows as u32, akvh as u32, 1), 32, 0))
            }
            .expect("launch");
            let (mk, win, scale, no_scores, n_rows_i) = (
                41i32,
                window.unwrap_or(0) as i32,
                1.0 / (ahd as f32).sqrt(),
                0u64,
                n_rows as i32,
            );
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&mma)
                    .arg(&qkv_dev)
                    .arg(&k_dev)
                    .arg(&v_dev)
                    .arg(&tables_dev)
                    .arg(&seq_dev)
                    .arg(&pos_dev)
                    .arg(&no_scores)
                    .arg(&mut out_dev)
                    .arg(&ints[0])
                    .arg(&ints[1])
                    .arg(&ints[2])
                    .arg(&ints[3])
                    .arg(&ints[4])
                    .arg(&mk)
                    .arg(&win)
                    .arg(&scale)
                    .arg(&row_width)
                    .arg(&sink_col)
                    .arg(&n_rows_i)
                    .launch(cfg((n_rows.div_ceil(16) as u32, ah as u32, 1), 32, 0))
            }
            .expect("launch");
            let got = stream.clone_dtoh(&out_dev).expect("dtoh");
            let want = cpu_attention_checking_appends(
                &stream,
                layout,
                &shape,
                &rows,
                &seqs_spec,
                mb,
                &qkv,
                (&k_pool, &v_pool),
                (&k_dev, &v_dev),
            );
            let err = max_abs_diff(&got, &want);
            println!(
                "paged_prefill_attention_mma ({n_rows} rows, {ah} heads / {akvh} kv heads of \
                 {ahd}, window {window:?}, sinks {sinks}): max abs diff vs CPU {err:.3e}"
            );
            assert!(err < 1e-4, "tensor-core prefill attention: {err}");
        }
    }
}
