//! moec's CUDA kernels run through cudarc on the stand-in driver (see standin.rs), each
//! against the CPU kernel of `moec::math` it mirrors.

use crate::standin::{
    cfg, cpu_attention_checking_appends, function, in_standin_child, kernel_entry, load_kernels,
    max_abs_diff, paged_rows, run_under_standin, standin_context, Rng,
};
use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};
use half::bf16;
use moec::runtime::cuda::detect::detect;
use moec::runtime::cuda::kernels::{compile_kernel, KernelSource, DEFAULT_ARCH};

/// Every kernel of kernels/*.cu, compiled by the stand-in NVRTC and launched through
/// cudarc, against the CPU kernels of `moec::math`. Tolerances: the GPU kernels
/// reduce sums as trees where the CPU sums in order, so norms and attention agree to 1e-4
/// absolute on O(1) values; rotary, SwiGLU and routing weights to 1e-5; routing choices and
/// the KV cache appends exactly.
#[test]
fn every_kernel_runs_like_the_cpu_kernels() {
    const NAME: &str = "standin_kernels::every_kernel_runs_like_the_cpu_kernels";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::math::attention::{attention, AttnSeq};
    use moec::math::kv_cache::KvBlocksMut;
    use moec::math::moe::route;
    use moec::math::norm::normalize;
    use moec::math::rope::RopeTable;
    use moec::math::tensor::TypedSlice;
    use moec::model::vocab::AttnShape;
    use moec::model::vocab::KvLayout;
    use moec::model::vocab::NormKind;

    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);

    // Norms: 5 rows of 200, bf16 weight; 64 threads for RMS, 96 for LayerNorm.
    let (rows, d) = (5usize, 200usize);
    let x: Vec<f32> = rng.vec(rows * d, 3.0).iter().map(|v| v + 0.5).collect();
    let w: Vec<bf16> = rng
        .vec(d, 0.5)
        .iter()
        .map(|v| bf16::from_f32(v + 1.0))
        .collect();
    let w_bits: Vec<u16> = w.iter().map(|v| v.to_bits()).collect();
    // The same weights as f32, as a GGUF stores norms (dtype code 2).
    let w32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let x_dev = stream.clone_htod(&x).expect("htod");
    let w_dev = stream.clone_htod(&w_bits).expect("htod");
    let w32_dev = stream.clone_htod(&w32).expect("htod");
    for (entry, kind, threads) in [
        ("rms_norm", NormKind::Rms, 64),
        ("layer_norm", NormKind::LayerNoBias, 96),
    ] {
        for code in [0i32, 2] {
            let f = function(&modules, "rms_norm.cu", entry);
            let mut out_dev = stream.alloc_zeros::<f32>(rows * d).expect("alloc");
            let (dim, eps) = (d as i32, 1e-5f32);
            let mut launch = stream.launch_builder(&f);
            launch.arg(&x_dev);
            if code == 0 {
                launch.arg(&w_dev);
            } else {
                launch.arg(&w32_dev);
            }
            launch.arg(&mut out_dev).arg(&dim).arg(&eps).arg(&code);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe { launch.launch(cfg((rows as u32, 1, 1), threads, 0)) }.expect("launch");
            let got = stream.clone_dtoh(&out_dev).expect("dtoh");
            let mut want = vec![0.0f32; rows * d];
            normalize(kind, &x, TypedSlice::Bf16(&w), eps, &mut want);
            let err = max_abs_diff(&got, &want);
            println!("{entry} (weights code {code}): max abs diff vs CPU {err:.3e}");
            assert!(err < 1e-4, "{entry} code {code}: {err}");
        }
    }

    // Rotary: 4 tokens, 8 q heads + 2 kv heads of 16, positions up to 63.
    let (nt, h, kvh, hd, max_pos, theta) = (4usize, 8usize, 2usize, 16usize, 64usize, 1e6f64);
    let width = (h + 2 * kvh) * hd;
    let qkv = rng.vec(nt * width, 1.0);
    let positions = [0i32, 7, 33, 63];
    // The tables as RopeTable::new builds them (the kernel's header contract).
    let half_dim = hd / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..max_pos {
        for i in 0..half_dim {
            let inv = 1.0 / (theta as f32).powf((2 * i) as f32 / hd as f32);
            let angle = pos as f32 * inv;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let mut qkv_dev = stream.clone_htod(&qkv).expect("htod");
    let pos_dev = stream.clone_htod(&positions).expect("htod");
    let cos_dev = stream.clone_htod(&cos).expect("htod");
    let sin_dev = stream.clone_htod(&sin).expect("htod");
    let f = function(&modules, "rope.cu", "rope_neox");
    let (w_i, rot_i, hd_i) = (width as i32, (h + kvh) as i32, hd as i32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f)
            .arg(&mut qkv_dev)
            .arg(&pos_dev)
            .arg(&cos_dev)
            .arg(&sin_dev)
            .arg(&w_i)
            .arg(&rot_i)
            .arg(&hd_i)
            .launch(cfg((nt as u32, (h + kvh) as u32, 1), 32, 0))
    }
    .expect("launch");
    let got = stream.clone_dtoh(&qkv_dev).expect("dtoh");
    let table = RopeTable::new(theta, hd, max_pos);
    let mut want = qkv.clone();
    for (t, &p) in positions.iter().enumerate() {
        for head in 0..h + kvh {
            let at = t * width + head * hd;
            table.rotate(&mut want[at..at + hd], p as usize);
        }
    }
    let err = max_abs_diff(&got, &want);
    println!("rope_neox: max abs diff vs CPU {err:.3e}");
    assert!(err < 1e-5, "rope: {err}");

    // SwiGLU over 300 elements, 3 blocks of 32 threads (grid-stride loop).
    let g = rng.vec(300, 4.0);
    let u = rng.vec(300, 1.0);
    let mut g_dev = stream.clone_htod(&g).expect("htod");
    let u_dev = stream.clone_htod(&u).expect("htod");
    let f = function(&modules, "swiglu.cu", "swiglu");
    let n = 300i32;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f)
            .arg(&mut g_dev)
            .arg(&u_dev)
            .arg(&n)
            .launch(cfg((3, 1, 1), 32, 0))
    }
    .expect("launch");
    let got = stream.clone_dtoh(&g_dev).expect("dtoh");
    // silu(x) * u, the definition expert_ffn applies.
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&x, &up)| x / (1.0 + (-x).exp()) * up)
        .collect();
    let err = max_abs_diff(&got, &want);
    println!("swiglu: max abs diff {err:.3e}");
    assert!(err < 1e-5, "swiglu: {err}");

    // Router: 70 tokens, 16 experts, top 4, renormalised (p = 1); row 3 all ties.
    let (rn, ne, tk) = (70usize, 16usize, 4usize);
    let mut logits = rng.vec(rn * ne, 2.0);
    logits[3 * ne..4 * ne].fill(0.0);
    let logits_dev = stream.clone_htod(&logits).expect("htod");
    let mut experts_dev = stream.alloc_zeros::<u32>(rn * tk).expect("alloc");
    let mut weights_dev = stream.alloc_zeros::<f32>(rn * tk).expect("alloc");
    let f = function(&modules, "router_topk.cu", "router_topk");
    let (rn_i, ne_i, tk_i, p) = (rn as i32, ne as i32, tk as i32, 1.0f32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f)
            .arg(&logits_dev)
            .arg(&mut experts_dev)
            .arg(&mut weights_dev)
            .arg(&rn_i)
            .arg(&ne_i)
            .arg(&tk_i)
            .arg(&p)
            .arg(&0u64)
            .launch(cfg((rn.div_ceil(32) as u32, 1, 1), 32, 0))
    }
    .expect("launch");
    let want = route(&logits, ne, tk, Some(1.0));
    assert_eq!(stream.clone_dtoh(&experts_dev).expect("dtoh"), want.experts);
    let err = max_abs_diff(
        &stream.clone_dtoh(&weights_dev).expect("dtoh"),
        &want.weights,
    );
    println!("router_topk: experts equal, max weight diff {err:.3e}");
    assert!(err < 1e-6, "router: {err}");

    // Decode attention over a paged cache: 3 sequences with 0, 17 and 40 cached tokens,
    // 8 q heads, 2 kv heads of 32, blocks of 16, without and with a sliding window of 20.
    // The last case carries gpt-oss's sinks (one logit per head after q | k | v).
    for (window, sinks) in [(None, false), (Some(20usize), false), (Some(20), true)] {
        let (ns, ah, akvh, ahd, bs, n_blocks, mb) =
            (3usize, 8usize, 2usize, 32usize, 16usize, 20usize, 6usize);
        let layout = KvLayout {
            block_size: bs,
            kv_heads: akvh,
            head_dim: ahd,
            values_in_keys: None,
        };
        let ctx_lens = [0i32, 17, 40];
        let mut tables = vec![0u32; ns * mb];
        let mut next = 0u32;
        for (s, &c) in ctx_lens.iter().enumerate() {
            for b in 0..(c as usize + 1).div_ceil(bs) {
                // A scattered but deterministic block order (7 is coprime with 20).
                tables[s * mb + b] = (next * 7 + 3) % n_blocks as u32;
                next += 1;
            }
        }
        let pool_len = n_blocks * layout.block_elems();
        let k_pool = rng.vec(pool_len, 1.0);
        let v_pool = rng.vec(pool_len, 1.0);
        let shape = AttnShape {
            heads: ah,
            kv_heads: akvh,
            head_dim: ahd,
            sliding_window: window,
            sinks,
        };
        let qkv = rng.vec(ns * shape.qkv_width(), 1.0);
        let max_keys = 41usize;
        let qkv_dev = stream.clone_htod(&qkv).expect("htod");
        let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
        let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
        let tables_dev = stream.clone_htod(&tables).expect("htod");
        let ctx_dev = stream.clone_htod(&ctx_lens).expect("htod");
        // Unused with one split: any device pointer.
        let mut scores_dev = stream.alloc_zeros::<f32>(1).expect("alloc");
        let mut out_dev = stream.alloc_zeros::<f32>(ns * ah * ahd).expect("alloc");
        let ints = [ah, akvh, ahd, bs, mb].map(|v| v as i32);
        let row_width = shape.qkv_width() as i32;
        let sink_col = if sinks {
            ((ah + 2 * akvh) * ahd) as i32
        } else {
            -1
        };
        let append = function(&modules, "decode_attention.cu", "paged_kv_append");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&append)
                .arg(&qkv_dev)
                .arg(&mut k_dev)
                .arg(&mut v_dev)
                .arg(&tables_dev)
                .arg(&ctx_dev)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&ints[4])
                .arg(&row_width)
                .launch(cfg((ns as u32, akvh as u32, 1), 32, 0))
        }
        .expect("launch");
        let decode = function(&modules, "decode_attention.cu", "paged_decode_attention");
        let (mk, win, scale) = (
            max_keys as i32,
            window.unwrap_or(0) as i32,
            1.0 / (ahd as f32).sqrt(),
        );
        // One split of every key (split-KV splits: split_kv_decode_attention_matches_the_cpu),
        // appending again what paged_kv_append wrote (append = 1).
        let shared = decode_shared(ah / akvh, ahd);
        let append_too = 1i32;
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&decode)
                .arg(&qkv_dev)
                .arg(&mut k_dev)
                .arg(&mut v_dev)
                .arg(&tables_dev)
                .arg(&ctx_dev)
                .arg(&mut scores_dev)
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
                .arg(&append_too)
                .launch(cfg((ns as u32, akvh as u32, 1), DECODE_THREADS, shared))
        }
        .expect("launch");
        let got = stream.clone_dtoh(&out_dev).expect("dtoh");
        let (mut k_cpu, mut v_cpu) = (k_pool.clone(), v_pool.clone());
        let mut want = vec![0.0f32; ns * ah * ahd];
        let seqs: Vec<AttnSeq<'_>> = (0..ns)
            .map(|s| AttnSeq {
                block_table: &tables[s * mb..(s + 1) * mb],
                context_len: ctx_lens[s] as usize,
                n_new: 1,
            })
            .collect();
        let mut cache = KvBlocksMut::f32(layout, &mut k_cpu, &mut v_cpu);
        attention(&mut cache, &seqs, &qkv, &shape, &mut want).expect("CPU attention");
        assert_eq!(
            stream.clone_dtoh(&k_dev).expect("dtoh"),
            k_cpu,
            "appended K"
        );
        assert_eq!(
            stream.clone_dtoh(&v_dev).expect("dtoh"),
            v_cpu,
            "appended V"
        );
        let err = max_abs_diff(&got, &want);
        println!("paged_decode_attention (window {window:?}, sinks {sinks}): max abs diff vs CPU {err:.3e}");
        assert!(err < 1e-4, "attention: {err}");
    }

    // The few-row projection: y[r] (=|+=) x[r] . W^T for weights stored [out, in] in each
    // dtype, against an f64 sum of the same decoded weights. 64 inputs take the 16-byte
    // path, 36 the one-element path; 1, 5 and 16 rows; y rows wider than out (ldy), and
    // accumulation onto what is there. Tolerance 1e-5 on sums of O(1) terms: f32
    // accumulation in another order than the f64 reference.
    let f = kernel_entry(&modules, "linear_gemv");
    for (in_dim, out_dim, n) in [(64usize, 19usize, 1usize), (64, 40, 5), (36, 9, 16)] {
        let x = rng.vec(n * in_dim, 1.0);
        let w = rng.vec(out_dim * in_dim, 0.5);
        let ldy = out_dim + 3;
        let y0 = rng.vec(n * ldy, 1.0);
        let x_dev = stream.clone_htod(&x).expect("htod");
        for (dtype, accumulate) in [(0i32, 0i32), (1, 1), (2, 0)] {
            // The weights as stored, and their decoded values for the reference.
            let (bytes, decoded) = stored(&w, dtype);
            let w_dev: CudaSlice<u8> = stream.clone_htod(&bytes).expect("htod");
            let mut y_dev = stream.clone_htod(&y0).expect("htod");
            let (n_i, in_i, out_i, ldy_i) = (n as i32, in_dim as i32, out_dim as i32, ldy as i32);
            // SAFETY: argument types and order match the kernel's signature; x holds n x
            // in floats, w out x in stored values, y n rows of ldy floats.
            unsafe {
                stream
                    .launch_builder(&f)
                    .arg(&x_dev)
                    .arg(&w_dev)
                    .arg(&mut y_dev)
                    .arg(&n_i)
                    .arg(&in_i)
                    .arg(&out_i)
                    .arg(&dtype)
                    .arg(&ldy_i)
                    .arg(&accumulate)
                    .launch(cfg((out_dim.div_ceil(8) as u32, 1, 1), 256, 0))
            }
            .expect("launch");
            let got = stream.clone_dtoh(&y_dev).expect("dtoh");
            let mut want = y0.clone();
            for r in 0..n {
                for o in 0..out_dim {
                    let dot: f64 = (0..in_dim)
                        .map(|k| f64::from(x[r * in_dim + k]) * f64::from(decoded[o * in_dim + k]))
                        .sum();
                    let base = if accumulate == 1 {
                        f64::from(y0[r * ldy + o])
                    } else {
                        0.0
                    };
                    want[r * ldy + o] = (base + dot) as f32;
                }
            }
            let err = max_abs_diff(&got, &want);
            println!("linear_gemv (in {in_dim}, out {out_dim}, rows {n}, dtype {dtype}): max abs diff {err:.3e}");
            assert!(err < 1e-5, "linear_gemv: {err}");
        }
    }
}

/// The catalog's non-GEMM ops in kernels/ops.cu, through the stand-in, against the CPU
/// kernels: embedding (bf16/f16/f32 tables) against `head::embed`, widening against
/// `half`, bf16 narrowing against `half::bf16::from_f32` (round to nearest even), expert
/// gather/scatter/combine against `moe::combine` on the scattered slots, greedy sampling
/// against `sampling::argmax`. All are exact (data movement, the same summation order).
#[test]
fn op_kernels_run_like_the_cpu() {
    const NAME: &str = "standin_kernels::op_kernels_run_like_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use half::f16;
    use moec::math::head::embed;
    use moec::math::moe::combine;
    use moec::math::sampling::argmax;
    use moec::math::tensor::{Matrix, TypedSlice};
    use moec::model::vocab::Orientation;
    use moec::model::vocab::Routing;
    const OPS: KernelSource = KernelSource {
        file: "ops.cu",
        source: include_str!("../../kernels/ops.cu"),
        entries: &[
            "embed_bf16",
            "embed_f16",
            "embed_f32",
            "widen_bf16",
            "widen_f16",
            "narrow_bf16",
            "add_in_place",
            "clamp_in_place",
            "gather_rows",
            "scatter_weighted",
            "route_pack",
            "route_experts",
            "split_bf16",
            "sum_halves",
            "combine_slots",
            "argmax_rows",
            "copy_runs",
        ],
    };
    assert_eq!(
        moec::runtime::cuda::kernels::entry_names(OPS.source),
        OPS.entries
    );
    let (ctx, stream) = standin_context();
    let module = ctx
        .load_module(compile_kernel(&OPS, DEFAULT_ARCH).expect("ops.cu compiles"))
        .expect("module");
    let f = |name: &str| module.load_function(name).expect("entry");
    let mut rng = Rng(7);

    // Embedding: 20 x 48 table, 6 ids (repeats allowed), in each stored dtype.
    let (vocab, hidden) = (20usize, 48usize);
    let ids = [3u32, 0, 19, 3, 7, 11];
    let values = rng.vec(vocab * hidden, 2.0);
    let as_bf16: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    let mut as_f16: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
    // Subnormal, infinite and negative-zero halves exercise the exact conversion.
    as_f16[3 * hidden] = f16::from_bits(0x0001);
    as_f16[3 * hidden + 1] = f16::from_bits(0x83ff);
    as_f16[3 * hidden + 2] = f16::INFINITY;
    as_f16[3 * hidden + 3] = f16::NEG_ZERO;
    let ids_dev = stream.clone_htod(&ids).expect("htod");
    let hidden_i = hidden as i32;
    let tables: [(&str, TypedSlice<'_>, CudaSlice<u8>); 3] = [
        (
            "embed_bf16",
            TypedSlice::Bf16(&as_bf16),
            stream.clone_htod(bytemuck_bytes(&as_bf16)).expect("htod"),
        ),
        (
            "embed_f16",
            TypedSlice::F16(&as_f16),
            stream.clone_htod(bytemuck_bytes(&as_f16)).expect("htod"),
        ),
        (
            "embed_f32",
            TypedSlice::F32(&values),
            stream.clone_htod(bytemuck_bytes(&values)).expect("htod"),
        ),
    ];
    for (entry, typed, table_dev) in &tables {
        let mut out_dev = stream
            .alloc_zeros::<f32>(ids.len() * hidden)
            .expect("alloc");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f(entry))
                .arg(table_dev)
                .arg(&ids_dev)
                .arg(&mut out_dev)
                .arg(&hidden_i)
                .launch(cfg((ids.len() as u32, 1, 1), 32, 0))
        }
        .expect("launch");
        let matrix = Matrix::new(*typed, vocab, hidden, Orientation::OutIn).expect("matrix");
        let mut want = vec![0.0f32; ids.len() * hidden];
        embed(&matrix, &ids, &mut want).expect("CPU embed");
        let got = stream.clone_dtoh(&out_dev).expect("dtoh");
        assert_eq!(bits(&got), bits(&want), "{entry}");
        println!("{entry}: equal to head::embed");
    }

    // Widening and narrowing, 1000 elements on 2 blocks of 64 (grid-stride).
    let n = 1000usize;
    let n_ll = n as i64;
    let src: Vec<f32> = rng.vec(n, 100.0);
    let wide_bf16: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
    let wide_dev = stream.clone_htod(bytemuck_bytes(&wide_bf16)).expect("htod");
    let mut out_dev = stream.alloc_zeros::<f32>(n).expect("alloc");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("widen_bf16"))
            .arg(&wide_dev)
            .arg(&mut out_dev)
            .arg(&n_ll)
            .launch(cfg((2, 1, 1), 64, 0))
    }
    .expect("launch");
    let want: Vec<f32> = wide_bf16.iter().map(|v| v.to_f32()).collect();
    assert_eq!(
        bits(&stream.clone_dtoh(&out_dev).expect("dtoh")),
        bits(&want),
        "widen_bf16"
    );
    let mut narrow_src = src.clone();
    // Ties (0x3f808000 is halfway between two bf16 values), NaN and infinity.
    narrow_src[0] = f32::from_bits(0x3f80_8000);
    narrow_src[1] = f32::from_bits(0x3f81_8000);
    narrow_src[2] = f32::NAN;
    narrow_src[3] = f32::NEG_INFINITY;
    let narrow_dev = stream.clone_htod(&narrow_src).expect("htod");
    let mut narrowed_dev = stream.alloc_zeros::<u16>(n).expect("alloc");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("narrow_bf16"))
            .arg(&narrow_dev)
            .arg(&mut narrowed_dev)
            .arg(&n_ll)
            .launch(cfg((2, 1, 1), 64, 0))
    }
    .expect("launch");
    let want: Vec<u16> = narrow_src
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    assert_eq!(
        stream.clone_dtoh(&narrowed_dev).expect("dtoh"),
        want,
        "narrow_bf16"
    );
    println!("widen_bf16, narrow_bf16: equal to half's conversions");

    // Mixture of experts: 5 tokens, top 2 of 4 experts, width 24. Each expert's rows are
    // gathered, "processed" (y = 10 * expert + x, a stand-in for its FFN), scattered with
    // their weights, then combined into the residual; the CPU combines the same slots.
    let (tokens, top_k, width, n_experts) = (5usize, 2usize, 24usize, 4usize);
    let routing = Routing {
        top_k,
        experts: vec![2, 0, 1, 3, 3, 1, 0, 2, 1, 0],
        weights: rng.vec(tokens * top_k, 1.0),
    };
    let x_norm = rng.vec(tokens * width, 1.0);
    let residual = rng.vec(tokens * width, 1.0);
    let x_dev = stream.clone_htod(&x_norm).expect("htod");
    let mut slots_dev = stream
        .alloc_zeros::<f32>(tokens * top_k * width)
        .expect("alloc");
    let mut slots_cpu = vec![0.0f32; tokens * top_k * width];
    let (k_i, w_i) = (top_k as i32, width as i32);
    for (e, rows) in moec::model::vocab::ExpertGroups::new(&routing, n_experts).routed() {
        if rows.is_empty() {
            continue;
        }
        let row_ids: Vec<u32> = rows.iter().map(|r| r.row).collect();
        let slot_ids: Vec<u32> = rows.iter().map(|r| r.slot).collect();
        let weights: Vec<f32> = rows.iter().map(|r| r.weight).collect();
        let rows_dev = stream.clone_htod(&row_ids).expect("htod");
        let mut gathered_dev = stream
            .alloc_zeros::<f32>(rows.len() * width)
            .expect("alloc");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f("gather_rows"))
                .arg(&x_dev)
                .arg(&rows_dev)
                .arg(&mut gathered_dev)
                .arg(&w_i)
                .launch(cfg((rows.len() as u32, 1, 1), 32, 0))
        }
        .expect("launch");
        let gathered = stream.clone_dtoh(&gathered_dev).expect("dtoh");
        for (i, r) in rows.iter().enumerate() {
            let at = r.row as usize * width;
            assert_eq!(
                gathered[i * width..(i + 1) * width],
                x_norm[at..at + width],
                "gather"
            );
        }
        let y: Vec<f32> = gathered.iter().map(|v| v + 10.0 * e as f32).collect();
        for (i, r) in rows.iter().enumerate() {
            let at = (r.row as usize * top_k + r.slot as usize) * width;
            for d in 0..width {
                slots_cpu[at + d] = r.weight * y[i * width + d];
            }
        }
        let y_dev = stream.clone_htod(&y).expect("htod");
        let slot_dev = stream.clone_htod(&slot_ids).expect("htod");
        let weights_dev = stream.clone_htod(&weights).expect("htod");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f("scatter_weighted"))
                .arg(&y_dev)
                .arg(&rows_dev)
                .arg(&slot_dev)
                .arg(&weights_dev)
                .arg(&mut slots_dev)
                .arg(&k_i)
                .arg(&w_i)
                .launch(cfg((rows.len() as u32, 1, 1), 32, 0))
        }
        .expect("launch");
    }
    assert_eq!(
        bits(&stream.clone_dtoh(&slots_dev).expect("dtoh")),
        bits(&slots_cpu),
        "scatter"
    );
    let experts_dev = stream.clone_htod(&routing.experts).expect("htod");
    let mut residual_dev = stream.clone_htod(&residual).expect("htod");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("combine_slots"))
            .arg(&slots_dev)
            .arg(&experts_dev)
            .arg(&0u64)
            .arg(&mut residual_dev)
            .arg(&k_i)
            .arg(&w_i)
            .arg(&1i32)
            .launch(cfg((tokens as u32, 1, 1), 32, 0))
    }
    .expect("launch");
    let mut want = residual.clone();
    combine(&routing, &slots_cpu, &mut want).expect("CPU combine");
    assert_eq!(
        bits(&stream.clone_dtoh(&residual_dev).expect("dtoh")),
        bits(&want),
        "combine"
    );
    // Blocks along y splitting each row (as moe.rs launches it): 2 blocks of 8 threads
    // over 24 values, so threads also stride (16) and the last stride is partial.
    let mut residual_dev = stream.clone_htod(&residual).expect("htod");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("combine_slots"))
            .arg(&slots_dev)
            .arg(&experts_dev)
            .arg(&0u64)
            .arg(&mut residual_dev)
            .arg(&k_i)
            .arg(&w_i)
            .arg(&1i32)
            .launch(cfg((tokens as u32, 2, 1), 8, 0))
    }
    .expect("launch");
    assert_eq!(
        bits(&stream.clone_dtoh(&residual_dev).expect("dtoh")),
        bits(&want),
        "combine, rows split over blocks"
    );
    println!("gather_rows, scatter_weighted, combine_slots: equal to moe::combine");

    // Residual add.
    let a = rng.vec(n, 1.0);
    let b = rng.vec(n, 1.0);
    let mut a_dev = stream.clone_htod(&a).expect("htod");
    let b_dev = stream.clone_htod(&b).expect("htod");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("add_in_place"))
            .arg(&mut a_dev)
            .arg(&b_dev)
            .arg(&n_ll)
            .launch(cfg((3, 1, 1), 128, 0))
    }
    .expect("launch");
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(
        bits(&stream.clone_dtoh(&a_dev).expect("dtoh")),
        bits(&want),
        "add_in_place"
    );

    // DBRX's clip_qkv, NaN and infinities included, against f32::clamp (pre_attn's clip).
    let mut x = rng.vec(n, 20.0);
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[2] = f32::NEG_INFINITY;
    let mut x_dev = stream.clone_htod(&x).expect("htod");
    let limit = 8.0f32;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("clamp_in_place"))
            .arg(&mut x_dev)
            .arg(&limit)
            .arg(&n_ll)
            .launch(cfg((2, 1, 1), 64, 0))
    }
    .expect("launch");
    let want: Vec<f32> = x.iter().map(|v| v.clamp(-limit, limit)).collect();
    assert_eq!(
        bits(&stream.clone_dtoh(&x_dev).expect("dtoh")),
        bits(&want),
        "clamp_in_place"
    );
    println!("add_in_place, clamp_in_place: equal to the CPU's arithmetic");

    // Greedy sampling: 4 rows of 300 logits, with a tie (the lower index wins) and a row
    // whose maximum is the last element.
    let vocab = 300usize;
    let mut logits = rng.vec(4 * vocab, 5.0);
    logits[17] = 50.0;
    logits[250] = 50.0;
    logits[2 * vocab - 1] = 60.0;
    let logits_dev = stream.clone_htod(&logits).expect("htod");
    let mut picks_dev = stream.alloc_zeros::<u32>(4).expect("alloc");
    let vocab_i = vocab as i32;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("argmax_rows"))
            .arg(&logits_dev)
            .arg(&mut picks_dev)
            .arg(&vocab_i)
            .launch(cfg((4, 1, 1), 128, 0))
    }
    .expect("launch");
    let want: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
    assert_eq!(want[..2], [17, vocab as u32 - 1]);
    assert_eq!(stream.clone_dtoh(&picks_dev).expect("dtoh"), want, "argmax");
    // 5 rows of 301 logits (rows 1-4 start off 16 bytes: the one-float loop; row 0 has
    // 75 16-byte loads and a one-float tail), at 1024 threads (the host's) and 96: a tie
    // between the vector part and the tail, NaN (never at index 0, where the CPU's scan
    // keeps it) and -inf entries, an all-NaN row (0), a maximum at the last element.
    let vocab = 301usize;
    let mut logits = rng.vec(5 * vocab, 5.0);
    logits[3] = f32::NAN;
    logits[10] = 70.0;
    logits[300] = 70.0;
    logits[vocab + 5] = f32::NAN;
    logits[vocab + 6] = f32::NEG_INFINITY;
    logits[2 * vocab - 1] = 80.0;
    logits[2 * vocab..3 * vocab].fill(f32::NAN);
    logits[4 * vocab - 1] = 90.0;
    let logits_dev = stream.clone_htod(&logits).expect("htod");
    let want: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
    assert_eq!(want[..4], [10, vocab as u32 - 1, 0, vocab as u32 - 1]);
    for threads in [1024u32, 96] {
        let mut picks_dev = stream.alloc_zeros::<u32>(5).expect("alloc");
        let vocab_i = vocab as i32;
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f("argmax_rows"))
                .arg(&logits_dev)
                .arg(&mut picks_dev)
                .arg(&vocab_i)
                .launch(cfg((5, 1, 1), threads, 0))
        }
        .expect("launch");
        assert_eq!(
            stream.clone_dtoh(&picks_dev).expect("dtoh"),
            want,
            "argmax of 301 at {threads} threads"
        );
    }
    println!("argmax_rows: equal to sampling::argmax");

    // Many runs in one launch: 16-byte, 4-byte and byte-aligned runs (offset, length) of a
    // source copied to the same offsets of the destination, nothing else touched. Runs of
    // at most 512 bytes are copied by a warp each, longer ones (the 16-byte run of 1,552
    // bytes: four loads a thread in flight and a tail; the byte-aligned one of 1,001) by
    // the whole block; 2 warps a block, so the 9 runs make 5 groups over 4 blocks.
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let runs: [(u64, u64); 9] = [
        (0, 16),
        (32, 48),
        (100, 3),
        (203, 17),
        (400, 256),
        (1020, 4),
        (1024, 1552),
        (2577, 1001),
        (3584, 512),
    ];
    let table: Vec<u64> = runs.iter().flat_map(|&(at, len)| [at, len]).collect();
    let (src_dev, table_dev) = (
        stream.clone_htod(&src).expect("htod"),
        stream.clone_htod(&table).expect("htod"),
    );
    let mut dst_dev = stream.alloc_zeros::<u8>(src.len()).expect("alloc");
    let n_runs = runs.len() as i64;
    // SAFETY: argument types and order match the kernel's signature; every run lies inside
    // both buffers.
    unsafe {
        stream
            .launch_builder(&f("copy_runs"))
            .arg(&table_dev)
            .arg(&n_runs)
            .arg(&src_dev)
            .arg(&mut dst_dev)
            .launch(cfg((4, 1, 1), 64, 0))
    }
    .expect("launch");
    let mut want = vec![0u8; src.len()];
    for &(at, len) in &runs {
        let r = at as usize..(at + len) as usize;
        want[r.clone()].copy_from_slice(&src[r]);
    }
    assert_eq!(
        stream.clone_dtoh(&dst_dev).expect("dtoh"),
        want,
        "copy_runs"
    );
    println!("copy_runs: each run copied, nothing else written");

    // The route layout: pack (expert, weight) pairs, then read the experts back; both
    // against backend::decode_routing, the layout's one decoder.
    let (experts, weights) = ([3u32, 1, 0, 7, 5, 2], [0.25f32, 0.75, 0.5, 0.5, 1.0, -0.0]);
    let (e_dev, w_dev) = (
        stream.clone_htod(&experts).expect("htod"),
        stream.clone_htod(&weights).expect("htod"),
    );
    let mut route_dev = stream.alloc_zeros::<u32>(12).expect("alloc");
    let n6 = 6i64;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("route_pack"))
            .arg(&e_dev)
            .arg(&w_dev)
            .arg(&mut route_dev)
            .arg(&n6)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("launch");
    let words = stream.clone_dtoh(&route_dev).expect("dtoh");
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let decoded = moec::runtime::backend::decode_routing(&bytes, 3, 2).expect("decodes");
    assert_eq!(decoded.experts, experts);
    assert_eq!(bits(&decoded.weights), bits(&weights));
    let mut back_dev = stream.alloc_zeros::<u32>(6).expect("alloc");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("route_experts"))
            .arg(&route_dev)
            .arg(&mut back_dev)
            .arg(&n6)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("launch");
    assert_eq!(stream.clone_dtoh(&back_dev).expect("dtoh"), experts);
    println!("route_pack, route_experts: the layout decode_routing reads");

    // The bf16 pair: hi = bf16(x), lo = bf16(x - hi), each rounded as half::bf16::from_f32;
    // hi + lo is within 2^-16 of x (relative), and exact for values bf16 holds.
    let x = [
        1.0f32,
        1.0 + 1.0 / 256.0 + 1.0 / 65536.0,
        -2.718_281_7,
        1e-30,
        65504.5,
        0.0,
    ];
    let x_dev = stream.clone_htod(&x).expect("htod");
    let mut pair_dev = stream.alloc_zeros::<u16>(12).expect("alloc");
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("split_bf16"))
            .arg(&x_dev)
            .arg(&mut pair_dev)
            .arg(&n6)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("launch");
    let pair = stream.clone_dtoh(&pair_dev).expect("dtoh");
    for (i, &v) in x.iter().enumerate() {
        let hi = bf16::from_f32(v);
        let lo = bf16::from_f32(v - hi.to_f32());
        assert_eq!(
            (pair[i], pair[6 + i]),
            (hi.to_bits(), lo.to_bits()),
            "x = {v}"
        );
        let back = hi.to_f32() + lo.to_f32();
        assert!(
            (back - v).abs() <= v.abs() * 2f32.powi(-16),
            "x = {v}: {back}"
        );
    }
    assert_eq!(
        (pair[0], pair[6]),
        (bf16::ONE.to_bits(), 0),
        "1.0 is exact in bf16"
    );

    // sum_halves: a column-major [rows = 3, 2 * cols = 4] product; column t of the output
    // (row stride 5) gets c[t] + c[cols + t], added to what is there when accumulating.
    let c: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let c_dev = stream.clone_htod(&c).expect("htod");
    for accumulate in [0i32, 1] {
        let start: Vec<f32> = (0..10).map(|i| 100.0 * i as f32).collect();
        let mut dst_dev = stream.clone_htod(&start).expect("htod");
        let (rows, cols, ldd) = (3i32, 2i32, 5i32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f("sum_halves"))
                .arg(&c_dev)
                .arg(&mut dst_dev)
                .arg(&rows)
                .arg(&cols)
                .arg(&ldd)
                .arg(&accumulate)
                .launch(cfg((2, 1, 1), 32, 0))
        }
        .expect("launch");
        let mut want = start.clone();
        for t in 0..2 {
            for i in 0..3 {
                let v = c[t * 3 + i] + c[(2 + t) * 3 + i];
                want[t * 5 + i] = if accumulate == 1 {
                    want[t * 5 + i] + v
                } else {
                    v
                };
            }
        }
        // By hand, column 0 row 0: c[0] + c[6] = 6 (its start value is 0); column 1 row 2
        // (index 7): c[5] + c[11] = 16, plus 700 when accumulating.
        assert_eq!(want[0], 6.0);
        assert_eq!(want[7], if accumulate == 1 { 716.0 } else { 16.0 });
        assert_eq!(
            stream.clone_dtoh(&dst_dev).expect("dtoh"),
            want,
            "accumulate {accumulate}"
        );
    }
    println!("split_bf16, sum_halves: the bf16 pair and its summed products");
}

/// The raw bytes of a slice of plain numbers (for uploading bf16/f16 tables).
fn bytemuck_bytes<T: bytemuck::Pod>(values: &[T]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// Bit patterns, so exact comparisons also distinguish -0.0 and NaN payloads.
pub(crate) fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// `values` stored in the kernels' float format `code` (0 bf16, 1 f16, 2 f32): the bytes to
/// upload and the f32 values they hold (what a CPU reference multiplies).
pub(crate) fn stored(values: &[f32], code: i32) -> (Vec<u8>, Vec<f32>) {
    match code {
        0 => {
            let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
            (
                v.iter().flat_map(|b| b.to_bits().to_le_bytes()).collect(),
                v.iter().map(|b| b.to_f32()).collect(),
            )
        }
        1 => {
            let v: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
            (
                v.iter().flat_map(|b| b.to_bits().to_le_bytes()).collect(),
                v.iter().map(|b| b.to_f32()).collect(),
            )
        }
        _ => (
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            values.to_vec(),
        ),
    }
}

/// Device address of a buffer (for tables of addresses and pointer arguments).
pub(crate) fn addr<T>(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    s: &CudaSlice<T>,
) -> u64 {
    s.device_ptr(stream).0
}

/// kernels/prefill_attention.cu through the stand-in against the CPU's `attention` with
/// several new tokens per sequence (a prompt from scratch, a prompt continuing a cached
/// sequence, and a decode token in the same launch), without and with a sliding window.
/// Tolerance 1e-4 absolute (tree-reduced softmax, as for decode); K/V appends exact.
#[test]
fn prefill_attention_matches_the_cpu() {
    const NAME: &str = "standin_kernels::prefill_attention_matches_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::model::vocab::AttnShape;
    use moec::model::vocab::KvLayout;
    const PREFILL: KernelSource = KernelSource {
        file: "prefill_attention.cu",
        source: include_str!("../../kernels/prefill_attention.cu"),
        entries: &[
            "paged_kv_append_rows",
            "paged_prefill_attention",
            "paged_prefill_attention_mma",
        ],
    };
    assert_eq!(
        moec::runtime::cuda::kernels::entry_names(PREFILL.source),
        PREFILL.entries
    );
    let (ctx, stream) = standin_context();
    let module = ctx
        .load_module(compile_kernel(&PREFILL, DEFAULT_ARCH).expect("compiles"))
        .expect("module");
    let mut rng = Rng(99);
    let (ah, akvh, ahd, bs, n_blocks, mb) = (8usize, 2usize, 32usize, 16usize, 24usize, 6usize);
    let layout = KvLayout {
        block_size: bs,
        kv_heads: akvh,
        head_dim: ahd,
        values_in_keys: None,
    };
    // (cached tokens, new tokens) per sequence.
    let seqs_spec = [(0usize, 9usize), (17, 5), (40, 1)];
    let rows = paged_rows(&seqs_spec, bs, n_blocks, mb);
    let n_rows = rows.row_seq.len();
    // The last case carries gpt-oss's sinks (one logit per head after q | k | v).
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
        let max_keys = 41usize;
        let qkv_dev = stream.clone_htod(&qkv).expect("htod");
        let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
        let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
        let tables_dev = stream.clone_htod(&rows.tables).expect("htod");
        let seq_dev = stream.clone_htod(&rows.row_seq).expect("htod");
        let pos_dev = stream.clone_htod(&rows.row_pos).expect("htod");
        let mut scores_dev = stream
            .alloc_zeros::<f32>(n_rows * ah * max_keys)
            .expect("alloc");
        let mut out_dev = stream.alloc_zeros::<f32>(n_rows * ah * ahd).expect("alloc");
        let ints = [ah, akvh, ahd, bs, mb].map(|v| v as i32);
        let row_width = shape.qkv_width() as i32;
        let sink_col = if sinks {
            ((ah + 2 * akvh) * ahd) as i32
        } else {
            -1
        };
        let append = module.load_function("paged_kv_append_rows").expect("entry");
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
        let prefill = module
            .load_function("paged_prefill_attention")
            .expect("entry");
        let (mk, win, scale) = (
            max_keys as i32,
            window.unwrap_or(0) as i32,
            1.0 / (ahd as f32).sqrt(),
        );
        let shared = ((ah / akvh) * ahd * 4) as u32;
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&prefill)
                .arg(&qkv_dev)
                .arg(&k_dev)
                .arg(&v_dev)
                .arg(&tables_dev)
                .arg(&seq_dev)
                .arg(&pos_dev)
                .arg(&mut scores_dev)
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
                .launch(cfg((n_rows as u32, akvh as u32, 1), 64, shared))
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
        println!("paged_prefill_attention ({n_rows} rows, window {window:?}, sinks {sinks}): max abs diff vs CPU {err:.3e}");
        assert!(err < 1e-4, "prefill attention: {err}");
    }
}

/// Dynamic shared memory of a `paged_decode_attention` block (kernels/decode_attention.cu:
/// up to 8 query heads of a group per block; a chunk of 4096 / head_dim keys, 2048 /
/// head_dim past 128 dims, at most 128, a multiple of 4: its K and V, the heads' queries,
/// probabilities and outputs, three floats a head).
fn decode_shared(group: usize, head_dim: usize) -> u32 {
    let g = group.min(8);
    let budget = if head_dim > 128 { 2048 } else { 4096 };
    let chunk = (budget / head_dim).min(128) & !3;
    ((2 * chunk * head_dim + 2 * g * head_dim + g * chunk + 3 * g) * 4) as u32
}

/// Threads of a `paged_decode_attention` block (`MOEC_DECODE_THREADS`).
const DECODE_THREADS: u32 = 256;

/// The split-KV decode kernel (`paged_decode_attention` then `paged_decode_combine`)
/// against the CPU's `attention` on random inputs: sequences whose spans end mid-tile and
/// mid-block (odd lengths 1, 2, 33, 100, 129 keys), split sizes that are not multiples of
/// a tile and leave some sequences' last splits empty, one split (no combine) and many,
/// groups of 1, 4 and 12 query heads (two head chunks), head widths 16, 64, 128 and 48
/// (the vector loads and the masked columns), a sliding window and gpt-oss's sinks. The
/// kernel appends the new K/V itself: the pools must equal the CPU's exactly. Tolerance
/// 1e-4 absolute (online softmax and tree sums).
#[test]
fn split_kv_decode_attention_matches_the_cpu() {
    const NAME: &str = "standin_kernels::split_kv_decode_attention_matches_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::model::vocab::AttnShape;
    use moec::model::vocab::KvLayout;
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let decode = function(&modules, "decode_attention.cu", "paged_decode_attention");
    let combine = function(&modules, "decode_attention.cu", "paged_decode_combine");
    let mut rng = Rng(4242);
    // (heads, kv heads, head_dim, block size, window, sinks, split keys)
    let cases = [
        (8usize, 2usize, 16usize, 16usize, None, false, 1000usize),
        (8, 2, 64, 16, None, false, 37),
        (12, 1, 128, 8, None, true, 64),
        (4, 4, 48, 16, Some(40usize), false, 13),
        (8, 2, 16, 4, Some(33), true, 9),
    ];
    for (ah, akvh, ahd, bs, window, sinks, split) in cases {
        // (cached, new): spans of 1, 2, 33, 100 and 129 keys.
        let seqs_spec = [(0usize, 1usize), (1, 1), (32, 1), (99, 1), (128, 1)];
        let ns = seqs_spec.len();
        let mb = 129usize.div_ceil(bs);
        // paged_rows spreads blocks by a stride of 5: a count prime to it keeps every
        // sequence's blocks its own.
        let n_blocks = (ns * mb + 1..).find(|n| n % 5 != 0).expect("a count");
        let rows = paged_rows(&seqs_spec, bs, n_blocks, mb);
        let layout = KvLayout {
            block_size: bs,
            kv_heads: akvh,
            head_dim: ahd,
            values_in_keys: None,
        };
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
        let qkv = rng.vec(ns * shape.qkv_width(), 1.5);
        let max_keys = window.map_or(mb * bs, |w| w.min(mb * bs));
        let n_splits = max_keys.div_ceil(split);
        let qkv_dev = stream.clone_htod(&qkv).expect("htod");
        let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
        let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
        let tables_dev = stream.clone_htod(&rows.tables).expect("htod");
        let ctx_dev = stream.clone_htod(&rows.row_pos).expect("htod");
        let mut partials = stream
            .alloc_zeros::<f32>(ns * ah * n_splits * (2 + ahd))
            .expect("alloc");
        let mut out_dev = stream.alloc_zeros::<f32>(ns * ah * ahd).expect("alloc");
        let ints = [ah, akvh, ahd, bs, mb].map(|v| v as i32);
        let row_width = shape.qkv_width() as i32;
        let sink_col = if sinks {
            ((ah + 2 * akvh) * ahd) as i32
        } else {
            -1
        };
        let (split_keys, win, scale, append) = (
            split as i32,
            window.unwrap_or(0) as i32,
            1.0 / (ahd as f32).sqrt(),
            1i32,
        );
        let chunks = (ah / akvh).div_ceil(8);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&decode)
                .arg(&qkv_dev)
                .arg(&mut k_dev)
                .arg(&mut v_dev)
                .arg(&tables_dev)
                .arg(&ctx_dev)
                .arg(&mut partials)
                .arg(&mut out_dev)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&ints[4])
                .arg(&split_keys)
                .arg(&win)
                .arg(&scale)
                .arg(&row_width)
                .arg(&sink_col)
                .arg(&append)
                .launch(cfg(
                    (ns as u32, (akvh * chunks) as u32, n_splits as u32),
                    DECODE_THREADS,
                    decode_shared(ah / akvh, ahd),
                ))
        }
        .expect("launch");
        if n_splits > 1 {
            let (heads, head_dim, splits) = (ah as i32, ahd as i32, n_splits as i32);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&combine)
                    .arg(&qkv_dev)
                    .arg(&partials)
                    .arg(&mut out_dev)
                    .arg(&heads)
                    .arg(&head_dim)
                    .arg(&splits)
                    .arg(&row_width)
                    .arg(&sink_col)
                    .launch(cfg((ns as u32, ah as u32, 1), 64, 0))
            }
            .expect("launch");
        }
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
            "paged_decode_attention (heads {ah}/{akvh} x {ahd}, blocks of {bs}, window {window:?}, \
             sinks {sinks}, {n_splits} splits of {split}): max abs diff vs CPU {err:.3e}"
        );
        assert!(err < 1e-4, "split-KV decode attention: {err}");
    }
}

/// The kernels of the newer families (kernels/families.cu and `router_topk_softmax`), each
/// against the CPU math it mirrors: q/k RMSNorm per head (Qwen3) and over a whole
/// projection (OLMoE) against `norm::normalize` on the same strided columns, biases and
/// sinks into strided rows, the shared expert's sigmoid gate, gpt-oss's clamped SwiGLU
/// (the formula of `Kernels::expert_ffn`'s fused arm, with gates past the limit) and its
/// top-k-then-softmax routing against `moe::route_topk_softmax`. Tolerances: 1e-5 (tree
/// sums in the norm), element-wise kernels within 2 ulp-scale 1e-6 of O(1) values,
/// routing choices exactly.
#[test]
fn family_kernels_run_like_the_cpu() {
    const NAME: &str = "standin_kernels::family_kernels_run_like_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::math::moe::{route, route_topk_softmax};
    use moec::math::norm::normalize;
    use moec::math::tensor::TypedSlice;
    use moec::model::vocab::NormKind;

    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let f = |name: &str| function(&modules, "families.cu", name);
    let mut rng = Rng(0x51ed_2701_a3c4_9e11);

    // q/k norms on rows of [q (4 heads of 16) | k (2 heads of 16) | v | 3 extra]: per head
    // with 16 weights, and over the whole q with 64.
    let (rows, q, kv, hd) = (3usize, 64usize, 32usize, 16usize);
    let ld = q + 2 * kv + 3;
    let x = rng.vec(rows * ld, 2.0);
    for (chunk, col, cols) in [(hd, 0, q), (hd, q, kv), (q, 0, q)] {
        let w: Vec<f32> = rng.vec(chunk, 0.5).iter().map(|v| v + 1.0).collect();
        let mut x_dev = stream.clone_htod(&x).expect("htod");
        let w_dev = stream.clone_htod(&w).expect("htod");
        let (ld_i, col_i, chunk_i, eps) = (ld as i32, col as i32, chunk as i32, 1e-6f32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&function(&modules, "rms_norm.cu", "qk_rms_norm_f32"))
                .arg(&mut x_dev)
                .arg(&w_dev)
                .arg(&ld_i)
                .arg(&col_i)
                .arg(&chunk_i)
                .arg(&eps)
                .launch(cfg((rows as u32, (cols / chunk) as u32, 1), 32, 0))
        }
        .expect("launch");
        let got = stream.clone_dtoh(&x_dev).expect("dtoh");
        let mut want = x.clone();
        for row in want.chunks_exact_mut(ld) {
            let part = &mut row[col..col + cols];
            let mut out = vec![0.0f32; cols];
            normalize(NormKind::Rms, part, TypedSlice::F32(&w), eps, &mut out);
            part.copy_from_slice(&out);
        }
        let err = max_abs_diff(&got, &want);
        println!(
            "qk_rms_norm_f32 (runs of {chunk} at column {col}): max abs diff vs CPU {err:.3e}"
        );
        assert!(err < 1e-5, "qk norm: {err}");
    }

    // Biases added into columns 5..12 of rows 20 wide; sinks copied into the last 3.
    let (rows, ld) = (4usize, 20usize);
    let x = rng.vec(rows * ld, 1.0);
    let bias = rng.vec(7, 1.0);
    let sinks = rng.vec(3, 1.0);
    let mut x_dev = stream.clone_htod(&x).expect("htod");
    for (v, col, accumulate) in [(&bias, 5usize, 1i32), (&sinks, 17, 0)] {
        let v_dev = stream.clone_htod(v).expect("htod");
        let (ld_i, col_i, cols_i) = (ld as i32, col as i32, v.len() as i32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f("bias_rows"))
                .arg(&mut x_dev)
                .arg(&v_dev)
                .arg(&ld_i)
                .arg(&col_i)
                .arg(&cols_i)
                .arg(&accumulate)
                .launch(cfg((rows as u32, 1, 1), 32, 0))
        }
        .expect("launch");
    }
    let mut want = x.clone();
    for row in want.chunks_exact_mut(ld) {
        for (o, b) in row[5..12].iter_mut().zip(&bias) {
            *o += b;
        }
        row[17..].copy_from_slice(&sinks);
    }
    assert_eq!(
        bits(&stream.clone_dtoh(&x_dev).expect("dtoh")),
        bits(&want),
        "bias_rows"
    );

    // The shared expert's gate: each row times sigmoid(its logit).
    let (rows, d) = (3usize, 40usize);
    let x = rng.vec(rows * d, 1.0);
    let logits = [-2.0f32, 0.0, 3.5];
    let mut x_dev = stream.clone_htod(&x).expect("htod");
    let l_dev = stream.clone_htod(&logits).expect("htod");
    let d_i = d as i32;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("sigmoid_scale_rows"))
            .arg(&mut x_dev)
            .arg(&l_dev)
            .arg(&d_i)
            .launch(cfg((rows as u32, 1, 1), 32, 0))
    }
    .expect("launch");
    let want: Vec<f32> = x
        .chunks_exact(d)
        .zip(logits)
        .flat_map(|(row, l)| {
            let s = 1.0 / (1.0 + (-l).exp());
            row.iter().map(move |v| v * s)
        })
        .collect();
    let err = max_abs_diff(&stream.clone_dtoh(&x_dev).expect("dtoh"), &want);
    println!("sigmoid_scale_rows: max abs diff vs CPU {err:.3e}");
    assert!(err < 1e-6, "sigmoid gate: {err}");

    // gpt-oss's clamped SwiGLU over interleaved gate/up, values up to +-12 so the limit
    // of 7 clamps both.
    let (rows, ffn, alpha, limit) = (3usize, 24usize, 1.702f32, 7.0f32);
    let gate_up = rng.vec(rows * 2 * ffn, 12.0);
    let gu_dev = stream.clone_htod(&gate_up).expect("htod");
    let mut out_dev = stream.alloc_zeros::<f32>(rows * ffn).expect("alloc");
    let ffn_i = ffn as i32;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f("clamped_swiglu"))
            .arg(&gu_dev)
            .arg(&mut out_dev)
            .arg(&ffn_i)
            .arg(&alpha)
            .arg(&limit)
            .arg(&0u64)
            .launch(cfg((rows as u32, 1, 1), 32, 0))
    }
    .expect("launch");
    let want: Vec<f32> = gate_up
        .chunks_exact(2)
        .map(|p| {
            let g = p[0].min(limit);
            let u = p[1].clamp(-limit, limit);
            (u + 1.0) * (g * (1.0 / (1.0 + (-(g * alpha)).exp())))
        })
        .collect();
    let err = max_abs_diff(&stream.clone_dtoh(&out_dev).expect("dtoh"), &want);
    println!("clamped_swiglu: max abs diff vs CPU {err:.3e}");
    assert!(err < 1e-5, "clamped swiglu: {err}");

    // Top-k of 16 and of 128 raw logits (Qwen3-30B-A3B and gpt-oss-120b have 128
    // experts), softmax over the k, with a tie between experts 3 and 9; and the softmax-
    // first router over 128 experts (Qwen3: no renormalisation) against `moe::route`.
    for (experts, top_k) in [(16usize, 4usize), (128, 8)] {
        let tokens = 5usize;
        let mut logits = rng.vec(tokens * experts, 3.0);
        logits[3] = 5.0;
        logits[9] = 5.0;
        let l_dev = stream.clone_htod(&logits).expect("htod");
        let ints = [tokens, experts, top_k].map(|v| v as i32);
        for softmax_first in [false, true] {
            let mut e_dev = stream.alloc_zeros::<u32>(tokens * top_k).expect("alloc");
            let mut w_dev = stream.alloc_zeros::<f32>(tokens * top_k).expect("alloc");
            let entry = if softmax_first {
                "router_topk"
            } else {
                "router_topk_softmax"
            };
            let router = function(&modules, "router_topk.cu", entry);
            let norm_p = 0.0f32;
            let mut launch = stream.launch_builder(&router);
            launch
                .arg(&l_dev)
                .arg(&mut e_dev)
                .arg(&mut w_dev)
                .arg(&ints[0])
                .arg(&ints[1])
                .arg(&ints[2]);
            if softmax_first {
                launch.arg(&norm_p);
            }
            launch.arg(&0u64);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe { launch.launch(cfg((1, 1, 1), 64, 0)) }.expect("launch");
            let want = if softmax_first {
                route(&logits, experts, top_k, None)
            } else {
                route_topk_softmax(&logits, experts, top_k)
            };
            assert_eq!(
                stream.clone_dtoh(&e_dev).expect("dtoh"),
                want.experts,
                "{entry}, {experts} experts"
            );
            let err = max_abs_diff(&stream.clone_dtoh(&w_dev).expect("dtoh"), &want.weights);
            println!("{entry} ({experts} experts, top-{top_k}): experts equal, max weight diff {err:.3e}");
            assert!(err < 1e-6, "{entry}: routing weights {err}");
        }
    }
}

/// Random blocks of `format`: every code and scale byte random (every bit position
/// exercised), the f16 super-block scales set to small normal values so products stay
/// finite. ggml's layouts: Q4_0/Q8_0 `d` at 0; Q4_1 `d`, `m` and Q4_K/Q5_K `d`, `dmin` at 0
/// and 2; Q6_K `d` at 208.
pub(crate) fn random_blocks(
    format: moec::quant::QuantFormat,
    blocks: usize,
    rng: &mut Rng,
) -> Vec<u8> {
    use moec::quant::QuantFormat;
    let bb = format.block_bytes();
    let mut out = Vec::with_capacity(blocks * bb);
    for _ in 0..blocks {
        let mut block: Vec<u8> = (0..bb)
            .map(|_| (rng.next_f32() * 128.0 + 128.0) as u8)
            .collect();
        let scale =
            |rng: &mut Rng| half::f16::from_f32(0.004 + 0.002 * rng.next_f32()).to_le_bytes();
        match format {
            QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => {
                block[..2].copy_from_slice(&scale(rng))
            }
            QuantFormat::Q4_1 | QuantFormat::Q4K | QuantFormat::Q5K => {
                block[..2].copy_from_slice(&scale(rng));
                block[2..4].copy_from_slice(&scale(rng));
            }
            QuantFormat::Q6K => block[208..210].copy_from_slice(&scale(rng)),
            // e8m0 exponent: half scales 2^-9 .. 2^-6.
            QuantFormat::Mxfp4 => block[0] = 119 + (rng.next_f32() * 4.0) as u8,
        }
        out.extend(block);
    }
    out
}

/// `y[r, o] = x[r] . w[o]` in f64 over a decoded `[out, in]` matrix, and `sum |x w|` per
/// output (what bounds f32 rounding of the sum).
pub(crate) fn reference_product(
    w: &[f32],
    x: &[f32],
    n: usize,
    inp: usize,
) -> (Vec<f64>, Vec<f64>) {
    let out = w.len() / inp;
    let (mut y, mut mag) = (vec![0.0; n * out], vec![0.0; n * out]);
    for r in 0..n {
        for o in 0..out {
            for i in 0..inp {
                let p = f64::from(x[r * inp + i]) * f64::from(w[o * inp + i]);
                y[r * out + o] += p;
                mag[r * out + o] += p.abs();
            }
        }
    }
    (y, mag)
}

/// The quantised-weight kernels (`linear_gemv` decoding blocks inside the product,
/// `dequant_f32` for the cuBLAS path, `embed_quant`) on random blocks of every format,
/// against the CPU's f32 decoding of the same blocks (`moec::quant`, checked bit
/// for bit against gguf-py in its unit tests). `dequant_f32` and `embed_quant` give the
/// CPU's bits exactly (the kernels round each product and difference as the CPU does);
/// the GEMV's sums agree within 2e-6 * sum |x w| per output (f32 rounding of a 512-term
/// sum split over 32 lanes: at most ~21 roundings of 2^-24 each, plus margin). The
/// reference from a deliberately broken decoder (Q4_K's nibbles swapped, or its 6-bit
/// scales' high bits dropped) misses that bound, so the comparison would catch a kernel
/// making either mistake.
#[test]
fn quantised_weight_kernels_match_the_cpu_decoded_product() {
    const NAME: &str = "standin_kernels::quantised_weight_kernels_match_the_cpu_decoded_product";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::quant::storage::WeightDtype;
    use moec::quant::{dequantize_blocks, QuantFormat};
    use moec::runtime::cuda::launch::storage_code;

    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x5151_2929_7f4a_7c15);
    // 37 outputs (a partial block of 8 warps), 512 inputs (2 super-blocks, 16 Q8_0 blocks)
    // and 3 activation rows.
    let (out, inp, n) = (37usize, 512usize, 3usize);
    let x = rng.vec(n * inp, 1.0);
    let x_dev = stream.clone_htod(&x).expect("htod");
    let bound_of = |mag: f64| 2e-6 * mag;
    // Every format the CUDA backend accepts (Q5_0 has no kernels: the registry refuses it).
    for format in moec::runtime::cuda::ops::QUANT_FORMATS {
        let code = storage_code(WeightDtype::F32, Some(format));
        let bytes = random_blocks(format, out * inp / format.block_elems(), &mut rng);
        let mut w = vec![0.0f32; out * inp];
        dequantize_blocks(format, &bytes, &mut w).expect("whole blocks");
        let w_dev = stream.clone_htod(&bytes).expect("htod");

        // dequant_f32: the CPU's decoded bits.
        let groups = (out * inp / 8) as i64;
        let mut dec_dev = stream.alloc_zeros::<f32>(out * inp).expect("alloc");
        let f = function(&modules, "quant.cu", "dequant_f32");
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&w_dev)
                .arg(&mut dec_dev)
                .arg(&groups)
                .arg(&code)
                .launch(cfg((8, 1, 1), 256, 0))
        }
        .expect("launch");
        let dec = stream.clone_dtoh(&dec_dev).expect("dtoh");
        assert_eq!(
            bits(&dec),
            bits(&w),
            "{format}: dequant_f32 differs from the CPU decode"
        );

        // embed_quant: rows 5, 0 and 36 of the matrix as a table.
        let ids = [5u32, 0, 36];
        let ids_dev = stream.clone_htod(&ids).expect("htod");
        let mut emb_dev = stream.alloc_zeros::<f32>(ids.len() * inp).expect("alloc");
        let f = function(&modules, "quant.cu", "embed_quant");
        let hidden = inp as i32;
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&w_dev)
                .arg(&ids_dev)
                .arg(&mut emb_dev)
                .arg(&hidden)
                .arg(&code)
                .launch(cfg((ids.len() as u32, 1, 1), 32, 0))
        }
        .expect("launch");
        let emb = stream.clone_dtoh(&emb_dev).expect("dtoh");
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| w[i as usize * inp..(i as usize + 1) * inp].to_vec())
            .collect();
        assert_eq!(
            bits(&emb),
            bits(&want),
            "{format}: embed_quant differs from the CPU decode"
        );

        // linear_gemv: blocks decoded inside the product.
        let mut y_dev = stream.alloc_zeros::<f32>(n * out).expect("alloc");
        let f = kernel_entry(&modules, "linear_gemv");
        let (ni, ini, outi, ldy, acc) = (n as i32, inp as i32, out as i32, out as i32, 0i32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&x_dev)
                .arg(&w_dev)
                .arg(&mut y_dev)
                .arg(&ni)
                .arg(&ini)
                .arg(&outi)
                .arg(&code)
                .arg(&ldy)
                .arg(&acc)
                .launch(cfg((out.div_ceil(8) as u32, 1, 1), 256, 0))
        }
        .expect("launch");
        let y = stream.clone_dtoh(&y_dev).expect("dtoh");
        let (want, mag) = reference_product(&w, &x, n, inp);
        let worst = y
            .iter()
            .zip(&want)
            .zip(&mag)
            .map(|((g, e), m)| (f64::from(*g) - e).abs() / bound_of(*m))
            .fold(0.0, f64::max);
        println!("{format}: linear_gemv error {worst:.3} of the bound");
        assert!(worst <= 1.0, "{format}: linear_gemv {worst} x the bound");

        if format == QuantFormat::Q4K {
            // Broken decoders: the nibbles of each code byte swapped; the scale bytes'
            // top two bits (bits 4-5 of sub-blocks 4-7's scales and mins) dropped.
            type Break = fn(&mut [u8]);
            let swap: Break = |b| b[16..].iter_mut().for_each(|q| *q = q.rotate_left(4));
            let low: Break = |b| b[4..12].iter_mut().for_each(|s| *s &= 0x3f);
            for (what, broken) in [("swapped nibbles", swap), ("scale high bits dropped", low)] {
                let mut bad = bytes.clone();
                bad.chunks_exact_mut(144).for_each(broken);
                let mut wb = vec![0.0f32; out * inp];
                dequantize_blocks(format, &bad, &mut wb).expect("whole blocks");
                let (bad_want, _) = reference_product(&wb, &x, n, inp);
                let misses = y
                    .iter()
                    .zip(&bad_want)
                    .zip(&mag)
                    .filter(|((g, e), m)| (f64::from(**g) - **e).abs() > bound_of(**m))
                    .count();
                println!(
                    "{format} {what}: {misses} of {} outputs outside the bound",
                    n * out
                );
                assert!(misses > n * out / 2, "{what}: only {misses} outputs differ");
            }
        }
    }
    // q8_roundtrip: activation rows rounded through Q8_K, Q8_0 and Q8_1 give the values the CPU's
    // 8-bit product multiplies (`Q8Rows::quantize(..).dequantize()`), bit for bit: random
    // rows, a block of zeros, blocks whose largest magnitude comes first as -m then as +m
    // (the sign of Q8_K's scale follows the first; in one lane and across lanes of the
    // kernel's warp per block), halves that round to even, and a block
    // whose Q8_0 scale is an f16 subnormal.
    use moec::quant::q8::{ActFormat, Q8Rows};
    let f = function(&modules, "activations_q8.cu", "q8_roundtrip");
    // Q8_1 (Q4_1 weights' activations) has Q8_0's codes and scale: the same kernel kind.
    for (act, kind) in [
        (ActFormat::Q8K, 0i32),
        (ActFormat::Q8_0, 1),
        (ActFormat::Q8_1, 1),
    ] {
        let cols = 512usize;
        let mut x = rng.vec(4 * cols, 3.0);
        x[cols..2 * cols].fill(0.0);
        x[2 * cols] = -2.0;
        x[2 * cols + 7] = 2.0;
        // The same tie across two lanes of the kernel's warp (values 9 and 200 of a Q8_K block).
        x[2 * cols + 256 + 9] = -5.0;
        x[2 * cols + 256 + 200] = 5.0;
        for (i, v) in x[2 * cols + 8..2 * cols + 40].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) / 127.0 * 2.0 + 1.0 / 127.0;
        }
        x[3 * cols..].iter_mut().for_each(|v| *v *= 1e-6);
        let want = Q8Rows::quantize(act, &x, 4, cols).dequantize();
        // The four slices as 2 rows x 2 heads with gaps (MLA's per-head inputs): row
        // stride 2 cols + 64, head stride cols + 32; the output is them packed.
        let (row, head) = (2 * cols + 64, cols + 32);
        let mut strided = vec![f32::NAN; 2 * row];
        for (i, slice) in x.chunks_exact(cols).enumerate() {
            let at = (i / 2) * row + (i % 2) * head;
            strided[at..at + cols].copy_from_slice(slice);
        }
        let x_dev = stream.clone_htod(&strided).expect("htod");
        let mut y_dev = stream.alloc_zeros::<f32>(x.len()).expect("alloc");
        let blocks = (x.len() / act.block_elems()) as i64;
        let (row, head, heads, width) = (row as i64, head as i64, 2i32, cols as i32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&x_dev)
                .arg(&row)
                .arg(&head)
                .arg(&heads)
                .arg(&width)
                .arg(&mut y_dev)
                .arg(&blocks)
                .arg(&kind)
                .arg(&0u64)
                .launch(cfg((2, 1, 1), 64, 0))
        }
        .expect("launch");
        let y = stream.clone_dtoh(&y_dev).expect("dtoh");
        let first = bits(&y).iter().zip(bits(&want)).position(|(a, b)| *a != b);
        assert_eq!(
            first.map(|i| (i, y[i], want[i])),
            None,
            "{act:?}: q8_roundtrip differs from the CPU (index, device, CPU)"
        );
    }
}

/// The staged row forms of the few-row float products (`linear_gemv_r4` / `_r16`,
/// `linear_gemv3_r4` / `_r16`: a chunk's weight loads in flight, the rows staged in shared
/// memory) give the generic kernels' bits (`linear_gemv`, `linear_gemv3`, themselves
/// checked against the CPU above and in standin_int_products.rs), and `linear_gemv_r*`
/// the f64 CPU product within 1e-5 (f32 sums of O(1) terms in another order). Inputs 72
/// (less than one 256-value step a warp), 520 (a partial last chunk at R = 16's 512 and
/// inside R = 4's 2048) and 1032; 2, 3, 4 rows on `_r4` and 5, 16 on `_r16`; 19 outputs
/// and 37 | 8 | 5 (partial blocks of warps, warps past the outputs in the barriers);
/// bf16 and f16 weights, accumulation onto y, and q|k|v with and without the norm.
#[test]
fn the_staged_row_kernels_equal_the_generic_ones() {
    const NAME: &str = "standin_kernels::the_staged_row_kernels_equal_the_generic_ones";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::runtime::cuda::launch::row_block;
    let status = detect();
    assert_eq!(status.missing(), None, "{status:?}");
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let mut rng = Rng(0x5eed_0019_0004_0016);
    let eps = 1e-5f32;
    for (inp, rows_list) in [
        (72usize, &[2usize, 16][..]),
        (520, &[3, 5][..]),
        (1032, &[4, 16][..]),
    ] {
        for &n in rows_list {
            let staged = if n <= 4 { "_r4" } else { "_r16" };
            let x: Vec<f32> = rng.vec(n * inp, 2.0).iter().map(|v| v + 0.25).collect();
            let x_dev = stream.clone_htod(&x).expect("htod");
            // linear_gemv: 19 outputs, y rows 22 floats apart, accumulating with f16.
            let (out, ldy) = (19usize, 22usize);
            for (code, accumulate) in [(0i32, 0i32), (1, 1)] {
                let (bytes, decoded) = stored(&rng.vec(out * inp, 0.3), code);
                let w_dev: CudaSlice<u8> = stream.clone_htod(&bytes).expect("htod");
                let y0 = rng.vec(n * ldy, 1.0);
                let (n_i, in_i, out_i, ldy_i) = (n as i32, inp as i32, out as i32, ldy as i32);
                let mut got = Vec::new();
                for entry in ["linear_gemv".to_string(), format!("linear_gemv{staged}")] {
                    let mut y = stream.clone_htod(&y0).expect("htod");
                    // SAFETY: argument types and order match the kernel's signature; x
                    // holds n x in floats, w out x in stored values, y n rows of ldy.
                    unsafe {
                        stream
                            .launch_builder(&kernel_entry(&modules, &entry))
                            .arg(&x_dev)
                            .arg(&w_dev)
                            .arg(&mut y)
                            .arg(&n_i)
                            .arg(&in_i)
                            .arg(&out_i)
                            .arg(&code)
                            .arg(&ldy_i)
                            .arg(&accumulate)
                            .launch(cfg((out.div_ceil(8) as u32, 1, 1), 256, 0))
                    }
                    .expect("launch");
                    got.push(stream.clone_dtoh(&y).expect("dtoh"));
                }
                assert_eq!(
                    bits(&got[0]),
                    bits(&got[1]),
                    "linear_gemv{staged} in {inp}, {n} rows"
                );
                let mut want = y0.clone();
                for r in 0..n {
                    for o in 0..out {
                        let dot: f64 = (0..inp)
                            .map(|k| f64::from(x[r * inp + k]) * f64::from(decoded[o * inp + k]))
                            .sum();
                        let base = if accumulate == 1 {
                            f64::from(y0[r * ldy + o])
                        } else {
                            0.0
                        };
                        want[r * ldy + o] = (base + dot) as f32;
                    }
                }
                let err = max_abs_diff(&got[1], &want);
                assert!(err < 1e-5, "linear_gemv{staged} in {inp}, {n} rows: {err}");
            }
            // linear_gemv3: q | k | v of 37 | 8 | 5 outputs, bf16 | f16 | bf16.
            let outs = [37usize, 8, 5];
            let total = outs.iter().sum::<usize>();
            let codes = [0i32, 1, 0];
            let ws: Vec<CudaSlice<u8>> = outs
                .iter()
                .zip(&codes)
                .map(|(&o, &c)| {
                    stream
                        .clone_htod(&stored(&rng.vec(o * inp, 0.2), c).0)
                        .expect("htod")
                })
                .collect();
            let nw: Vec<f32> = rng.vec(inp, 0.5).iter().map(|v| v + 1.0).collect();
            for norm_code in [-1i32, 0] {
                let nw_dev = stream
                    .clone_htod(&stored(&nw, norm_code.max(0)).0)
                    .expect("htod");
                let (nw_ptr, threads) = if norm_code < 0 {
                    (0u64, 0i32)
                } else {
                    (addr(&stream, &nw_dev), row_block(inp) as i32)
                };
                let code = norm_code.max(0);
                let (n_i, inp_i, ldy) = (n as i32, inp as i32, total as i32);
                let (o0, o1, o2) = (outs[0] as i32, outs[1] as i32, outs[2] as i32);
                let (c1, c2) = (outs[0] as i32, (outs[0] + outs[1]) as i32);
                let mut got = Vec::new();
                for entry in ["linear_gemv3".to_string(), format!("linear_gemv3{staged}")] {
                    let mut y = stream.alloc_zeros::<f32>(n * total).expect("alloc");
                    // SAFETY: argument types and order match the kernel's signature.
                    unsafe {
                        stream
                            .launch_builder(&kernel_entry(&modules, &entry))
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
                    "linear_gemv3{staged} in {inp}, {n} rows, norm code {norm_code}"
                );
            }
        }
    }
    println!("linear_gemv(3)_r4/_r16: the generic kernels' bits and the CPU's products");
}
