//! DeepSeek's CUDA kernels (kernels/mla_attention.cu, kernels/deepseek_router.cu) through
//! the stand-in, each against the CPU kernel of `moec::math` it mirrors, on
//! random inputs: the router against `route_deepseek` (V2's greedy and group-limited
//! softmax routers, V3's sigmoid router with its correction bias, with and without
//! renormalisation, and V3's real 256 experts in 8 groups), the MLA projections against
//! `pre_attn` and `mla_o_proj_residual` on both tiny DeepSeek cards' geometry (from
//! `kv_b_proj` and from llama.cpp's split `attn_k_b`/`attn_v_b`), and the
//! latent attention against `attention` over the paged cache (prefill, continued prompt and
//! decode rows in one launch, query heads split over two blocks). The GEMMs around them are
//! the CPU's here (cuBLAS is checked on its own in standin.rs). Tolerances: routing choices
//! exact and weights to 1e-6; projections, norms and attention to 1e-4 absolute (tree
//! sums and a different summation order of the products).

use crate::standin::{
    cfg, cpu_attention_checking_appends, in_standin_child, max_abs_diff, paged_rows,
    run_under_standin, standin_context, Rng,
};
use cudarc::driver::PushKernelArg;
use half::bf16;
use moec::math::deepseek_route::route_deepseek;
use moec::math::isa::Kernels;
use moec::math::mla::{KvUp, MlaQuery, MlaWeights, LORA_NORM_EPS};
use moec::math::norm::normalize;
use moec::math::rope::RopeTable;
use moec::math::tensor::{Matrix, TypedSlice};
use moec::math::views::{DenseWeights, QkvWeights};
use moec::model::card::{DeepseekRouter, DeepseekTopk, ModelCard};
use moec::model::vocab::AttnShape;
use moec::model::vocab::KvLayout;
use moec::model::vocab::NormKind;
use moec::model::vocab::Orientation;
use moec::model::ArchSpec;
use moec::runtime::cuda::kernels::{compile_kernel, entry_names, KernelSource, DEFAULT_ARCH};

const MLA: KernelSource = KernelSource {
    file: "mla_attention.cu",
    source: include_str!("../../kernels/mla_attention.cu"),
    entries: &[
        "mla_rms_norm",
        "mla_head_linear",
        "mla_qkv_rows",
        "mla_paged_attention",
    ],
};

const ROUTER: KernelSource = KernelSource {
    file: "deepseek_router.cu",
    source: include_str!("../../kernels/deepseek_router.cu"),
    entries: &["deepseek_route", "deepseek_no_route"],
};

const PREFILL: KernelSource = KernelSource {
    file: "prefill_attention.cu",
    source: include_str!("../../kernels/prefill_attention.cu"),
    entries: &["paged_kv_append_rows", "paged_prefill_attention"],
};

/// Random bf16 weights (their f32 values, and their bits for the device).
fn bf16_weights(rng: &mut Rng, n: usize, scale: f32, offset: f32) -> (Vec<bf16>, Vec<u16>) {
    let values: Vec<bf16> = rng
        .vec(n, scale)
        .iter()
        .map(|v| bf16::from_f32(v + offset))
        .collect();
    let bits = values.iter().map(|v| v.to_bits()).collect();
    (values, bits)
}

fn matrix(data: &[bf16], rows: usize, cols: usize) -> Matrix<'_> {
    Matrix {
        data: TypedSlice::Bf16(data),
        rows,
        cols,
        orientation: Orientation::OutIn,
    }
}

/// `deepseek_route` against `route_deepseek` for each router on 37 random tokens (logits
/// wide enough that groups and experts are decided by clear margins only by chance, as in
/// a real run), and `deepseek_no_route`'s dense-layer route.
#[test]
fn deepseek_router_matches_the_cpu() {
    const NAME: &str = "standin_deepseek::deepseek_router_matches_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    assert_eq!(entry_names(ROUTER.source), ROUTER.entries);
    let (ctx, stream) = standin_context();
    let module = ctx
        .load_module(compile_kernel(&ROUTER, DEFAULT_ARCH).expect("compiles"))
        .expect("module");
    let route_fn = module.load_function("deepseek_route").expect("entry");
    let mut rng = Rng(0xdeeb_5eec);
    let router = |topk, n_group, topk_group, scale, norm| DeepseekRouter {
        topk,
        n_group,
        topk_group,
        routed_scaling_factor: scale,
        norm_topk_prob: norm,
    };
    // (router, experts, top_k, with bias)
    let cases = [
        (
            router(DeepseekTopk::Greedy, 1, 1, 1.0, false),
            16usize,
            4usize,
            false,
        ),
        (
            router(DeepseekTopk::GroupLimitedGreedy, 4, 2, 1.0, false),
            16,
            4,
            false,
        ),
        (
            router(DeepseekTopk::GroupLimitedGreedy, 8, 3, 16.0, false),
            160,
            6,
            false,
        ),
        (router(DeepseekTopk::NoauxTc, 4, 2, 2.5, true), 16, 4, true),
        (router(DeepseekTopk::NoauxTc, 4, 2, 2.5, false), 16, 4, true),
        (router(DeepseekTopk::NoauxTc, 8, 4, 2.5, true), 256, 8, true),
    ];
    let n = 37usize;
    for (r, e, k, with_bias) in cases {
        let logits = rng.vec(n * e, 4.0);
        let bias = rng.vec(e, 0.5);
        let logits_dev = stream.clone_htod(&logits).expect("htod");
        let bias_dev = stream.clone_htod(&bias).expect("htod");
        let mut route_dev = stream.alloc_zeros::<u32>(n * k * 2).expect("alloc");
        let ints = [n, e, k].map(|v| v as i32);
        let mode = match r.topk {
            DeepseekTopk::Greedy => 0i32,
            DeepseekTopk::GroupLimitedGreedy => 1,
            DeepseekTopk::NoauxTc => 2,
        };
        let (n_group, topk_group) = (r.n_group as i32, r.topk_group as i32);
        let (norm, scale) = (i32::from(r.norm_topk_prob), r.routed_scaling_factor as f32);
        let null = 0u64;
        let mut launch = stream.launch_builder(&route_fn);
        launch.arg(&logits_dev);
        if with_bias {
            launch.arg(&bias_dev);
        } else {
            launch.arg(&null);
        }
        launch
            .arg(&mut route_dev)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&mode)
            .arg(&n_group)
            .arg(&topk_group)
            .arg(&norm)
            .arg(&scale);
        // SAFETY: argument types and order match the kernel's signature (a null bias
        // pointer as a zero address).
        unsafe { launch.launch(cfg((1, 1, 1), 64, 0)) }.expect("launch");
        let got = stream.clone_dtoh(&route_dev).expect("dtoh");
        let want = route_deepseek(&logits, e, k, &r, with_bias.then_some(&bias[..]));
        let experts: Vec<u32> = got.iter().step_by(2).copied().collect();
        let weights: Vec<f32> = got
            .iter()
            .skip(1)
            .step_by(2)
            .map(|&b| f32::from_bits(b))
            .collect();
        assert_eq!(experts, want.experts, "{r:?} over {e} experts: choices");
        let err = max_abs_diff(&weights, &want.weights);
        println!("deepseek_route {:?} ({e} experts, top-{k}, bias {with_bias}): choices equal, max weight diff {err:.3e}", r.topk);
        assert!(err < 1e-6, "{r:?}: weights differ by {err}");
    }
    let no_route = module.load_function("deepseek_no_route").expect("entry");
    let mut route_dev = stream.clone_htod(&vec![7u32; 24]).expect("htod");
    let entries = 12i64;
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&no_route)
            .arg(&mut route_dev)
            .arg(&entries)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("launch");
    let got = stream.clone_dtoh(&route_dev).expect("dtoh");
    let want: Vec<u32> = (0..12)
        .flat_map(|_| [moec::math::dense::NO_EXPERT, 0])
        .collect();
    assert_eq!(got, want, "a dense layer's route");
}

/// One `mla_head_linear` launch (see kernels/mla_attention.cu for the operands).
#[allow(clippy::too_many_arguments)]
fn head_linear(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    f: &cudarc::driver::CudaFunction,
    x: &cudarc::driver::CudaSlice<f32>,
    x_layout: [usize; 2],
    w: &cudarc::driver::CudaSlice<u16>,
    w_layout: [usize; 3],
    out_in: bool,
    y: &mut cudarc::driver::CudaSlice<f32>,
    y_layout: [usize; 2],
    dims: [usize; 4],
    scale: f32,
) {
    let [heads, n, in_dim, out_dim] = dims;
    let ints = [
        x_layout[0],
        x_layout[1],
        0,
        0,
        w_layout[0],
        w_layout[1],
        w_layout[2],
        usize::from(out_in),
        y_layout[0],
        y_layout[1],
        0,
        n,
        in_dim,
        out_dim,
    ]
    .map(|v| v as i32);
    // ints: x row, x head, x offset | dtype, w columns, rows per head, row offset, out_in |
    // y row, y head, y offset, tokens, in, out.
    let mut launch = stream.launch_builder(f);
    launch.arg(x);
    for v in &ints[..3] {
        launch.arg(v);
    }
    launch.arg(w);
    for v in &ints[3..8] {
        launch.arg(v);
    }
    launch.arg(y);
    for v in &ints[8..] {
        launch.arg(v);
    }
    launch.arg(&scale);
    let grid = (
        n.div_ceil(16) as u32,
        heads as u32,
        out_dim.div_ceil(64) as u32,
    );
    // SAFETY: argument types and order match the kernel's signature: x, its row and head
    // strides and offset, w, dtype (0: bf16), columns, rows per head, row offset, out_in,
    // y, its row and head strides and offset, tokens, in, out, scale.
    unsafe { launch.launch(cfg(grid, 256, 0)) }.expect("launch");
}

/// MLA's projections on both tiny DeepSeek cards: `mla_rms_norm` (q_a_layernorm, V3),
/// `mla_head_linear` (query absorption) and `mla_qkv_rows` give `pre_attn`'s `qkv` rows
/// from the same projected q and latent; `mla_head_linear` (value expansion) gives the
/// values `mla_o_proj_residual` projects.
#[test]
fn mla_projections_match_the_cpu() {
    const NAME: &str = "standin_deepseek::mla_projections_match_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    assert_eq!(entry_names(MLA.source), MLA.entries);
    let (ctx, stream) = standin_context();
    let module = ctx
        .load_module(compile_kernel(&MLA, DEFAULT_ARCH).expect("compiles"))
        .expect("module");
    let linear_fn = module.load_function("mla_head_linear").expect("entry");
    let kernels = Kernels::process();
    let mut rng = Rng(0x3141_5926);
    for card in ["deepseek-v3-tiny", "deepseek-v2-tiny"] {
        let arch = ArchSpec::from_card(&ModelCard::load(card).expect("card"));
        let m = arch.mla.expect("an MLA card");
        let (d, heads, hd) = (arch.hidden, arch.attn.heads, arch.attn.head_dim);
        let (r, nope, rope, v) = (
            m.kv_lora_rank as usize,
            m.qk_nope_head_dim as usize,
            m.qk_rope_head_dim as usize,
            m.v_head_dim as usize,
        );
        let (qk, width) = (nope + rope, arch.attn.qkv_width());
        let positions = [0usize, 3, 17, 40, 63, 5];
        let n = positions.len();
        let x = rng.vec(n * d, 2.0);
        let (attn_norm, _) = bf16_weights(&mut rng, d, 0.3, 1.0);
        let q_rank = m.q_lora_rank.map_or(0, |q| q as usize);
        let (q_a, _) = bf16_weights(&mut rng, q_rank * d, 0.1, 0.0);
        let (q_a_norm, q_a_norm_bits) = bf16_weights(&mut rng, q_rank, 0.3, 1.0);
        let q_in = if q_rank > 0 { q_rank } else { d };
        let (q_b, _) = bf16_weights(&mut rng, heads * qk * q_in, 0.1, 0.0);
        let (kv_a, _) = bf16_weights(&mut rng, (r + rope) * d, 0.1, 0.0);
        let (kv_a_norm, kv_a_norm_bits) = bf16_weights(&mut rng, r, 0.3, 1.0);
        let (kv_b, kv_b_bits) = bf16_weights(&mut rng, heads * (nope + v) * r, 0.1, 0.0);
        let (o_proj, _) = bf16_weights(&mut rng, d * heads * v, 0.1, 0.0);
        let q = if q_rank > 0 {
            MlaQuery::Lora {
                a: matrix(&q_a, q_rank, d),
                norm: TypedSlice::Bf16(&q_a_norm),
                b: matrix(&q_b, heads * qk, q_rank),
            }
        } else {
            MlaQuery::Direct(matrix(&q_b, heads * qk, d))
        };
        let mla = MlaWeights {
            q,
            kv_a: matrix(&kv_a, r + rope, d),
            kv_a_norm: TypedSlice::Bf16(&kv_a_norm),
            kv_b: KvUp::Merged(matrix(&kv_b, heads * (nope + v), r)),
        };
        let dense = DenseWeights {
            attn_norm: TypedSlice::Bf16(&attn_norm),
            qkv: QkvWeights::Mla(mla),
            qkv_bias: None,
            qk_norm: None,
            sinks: None,
            o_proj: Matrix::empty(),
            o_bias: None,
            ffn_norm: TypedSlice::F32(&[]),
            router: Matrix::empty(),
            router_bias: None,
            shared: None,
            kv_b_out: None,
        };
        let table = RopeTable::for_arch(&arch, 64);
        // The CPU's `pre_attn`: the normalised input and the qkv rows.
        let cpu_pre_attn = |dense: &DenseWeights<'_>| {
            let mut x_norm = vec![0.0f32; n * d];
            let mut qkv = vec![0.0f32; n * width];
            kernels
                .pre_attn(&arch, dense, &table, &x, &positions, &mut x_norm, &mut qkv)
                .expect("CPU pre_attn");
            (x_norm, qkv)
        };
        let (x_norm, want) = cpu_pre_attn(&dense);
        // The projections around the kernels, as the CPU computes them.
        let mut q_rows = vec![0.0f32; n * heads * qk];
        if let MlaQuery::Lora { a, norm, b } = &mla.q {
            let mut qa = vec![0.0f32; n * q_rank];
            kernels.linear(&x_norm, n, a, &mut qa).expect("q_a_proj");
            let qa_dev = stream.clone_htod(&qa).expect("htod");
            let norm_dev = stream.clone_htod(&q_a_norm_bits).expect("htod");
            let mut qa_norm_dev = stream.alloc_zeros::<f32>(n * q_rank).expect("alloc");
            let f = module.load_function("mla_rms_norm").expect("entry");
            let (rank_i, dtype, eps) = (q_rank as i32, 0i32, LORA_NORM_EPS);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe {
                stream
                    .launch_builder(&f)
                    .arg(&qa_dev)
                    .arg(&norm_dev)
                    .arg(&mut qa_norm_dev)
                    .arg(&rank_i)
                    .arg(&dtype)
                    .arg(&eps)
                    .launch(cfg((n as u32, 1, 1), 32, 0))
            }
            .expect("launch");
            let qa_norm = stream.clone_dtoh(&qa_norm_dev).expect("dtoh");
            let mut qa_norm_cpu = vec![0.0f32; n * q_rank];
            normalize(NormKind::Rms, &qa, *norm, LORA_NORM_EPS, &mut qa_norm_cpu);
            let err = max_abs_diff(&qa_norm, &qa_norm_cpu);
            println!("mla_rms_norm ({card}): max abs diff vs CPU {err:.3e}");
            assert!(err < 1e-5, "mla_rms_norm: {err}");
            kernels
                .linear(&qa_norm, n, b, &mut q_rows)
                .expect("q_b_proj");
        } else if let MlaQuery::Direct(w) = &mla.q {
            kernels.linear(&x_norm, n, w, &mut q_rows).expect("q_proj");
        }
        let mut ckv = vec![0.0f32; n * (r + rope)];
        kernels
            .linear(&x_norm, n, &mla.kv_a, &mut ckv)
            .expect("kv_a_proj");
        let q_dev = stream.clone_htod(&q_rows).expect("htod");
        let ckv_dev = stream.clone_htod(&ckv).expect("htod");
        let kv_b_dev = stream.clone_htod(&kv_b_bits).expect("htod");
        let norm_dev = stream.clone_htod(&kv_a_norm_bits).expect("htod");
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let pos_dev = stream.clone_htod(&pos).expect("htod");
        let (cos, sin) = table.tables();
        let cos_dev = stream.clone_htod(cos).expect("htod");
        let sin_dev = stream.clone_htod(sin).expect("htod");
        let mut qkv_dev = stream.alloc_zeros::<f32>(n * width).expect("alloc");
        let q_scale = (m.softmax_mscale * (hd as f64).sqrt() / (qk as f64).sqrt()) as f32;
        head_linear(
            &stream,
            &linear_fn,
            &q_dev,
            [heads * qk, qk],
            &kv_b_dev,
            [r, nope + v, 0],
            false,
            &mut qkv_dev,
            [width, hd],
            [heads, n, nope, r],
            q_scale,
        );
        let f = module.load_function("mla_qkv_rows").expect("entry");
        let ints = [0, heads, nope, rope, r, usize::from(m.rope_interleave)].map(|v| v as i32);
        let eps = LORA_NORM_EPS;
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&q_dev)
                .arg(&ckv_dev)
                .arg(&norm_dev)
                .arg(&ints[0])
                .arg(&pos_dev)
                .arg(&cos_dev)
                .arg(&sin_dev)
                .arg(&mut qkv_dev)
                .arg(&ints[1])
                .arg(&ints[2])
                .arg(&ints[3])
                .arg(&ints[4])
                .arg(&ints[5])
                .arg(&q_scale)
                .arg(&eps)
                .launch(cfg((n as u32, (heads + 1) as u32, 1), 64, 0))
        }
        .expect("launch");
        let got = stream.clone_dtoh(&qkv_dev).expect("dtoh");
        let err = max_abs_diff(&got, &want);
        println!("mla_head_linear + mla_qkv_rows ({card}): max abs diff vs pre_attn {err:.3e}");
        assert!(err < 1e-4, "{card}: MLA qkv rows differ by {err}");

        // The value expansion with `w` (laid out `w_layout`: columns, rows per head, row
        // offset), then o_proj and the residual on the CPU, against the CPU's
        // `mla_o_proj_residual` with `up`: their largest difference.
        let attn_out = rng.vec(n * heads * hd, 1.0);
        let a_dev = stream.clone_htod(&attn_out).expect("htod");
        let o = matrix(&o_proj, d, heads * v);
        let residual = rng.vec(n * d, 1.0);
        let o_proj_diff = |w: &cudarc::driver::CudaSlice<u16>, w_layout, up: &KvUp<'_>| {
            let mut values_dev = stream.alloc_zeros::<f32>(n * heads * v).expect("alloc");
            head_linear(
                &stream,
                &linear_fn,
                &a_dev,
                [heads * hd, hd],
                w,
                w_layout,
                true,
                &mut values_dev,
                [heads * v, v],
                [heads, n, r, v],
                1.0,
            );
            let values = stream.clone_dtoh(&values_dev).expect("dtoh");
            let mut got = vec![0.0f32; n * d];
            kernels.linear(&values, n, &o, &mut got).expect("o_proj");
            for (g, x) in got.iter_mut().zip(&residual) {
                *g += x;
            }
            let mut want = residual.clone();
            kernels
                .mla_o_proj_residual(&arch, up, &o, &attn_out, &mut want)
                .expect("CPU o_proj");
            max_abs_diff(&got, &want)
        };
        let err = o_proj_diff(&kv_b_dev, [r, nope + v, nope], &mla.kv_b);
        println!("mla_head_linear (values, {card}): max abs diff after o_proj vs CPU {err:.3e}");
        assert!(err < 1e-4, "{card}: MLA o_proj differs by {err}");

        // The same weights split as llama.cpp's converter stores them (`attn_k_b[h][c][i] =
        // kv_b[h][i][c]` over the qk_nope key rows, `attn_v_b[h][j] = kv_b[h][qk_nope + j]`),
        // which both backends read as stored (out-in; the kernel's out_in 1, row offset 0).
        let mut k_b_bits = Vec::with_capacity(heads * r * nope);
        let mut v_b_bits = Vec::with_capacity(heads * v * r);
        for h in 0..heads {
            let row = |i: usize| &kv_b_bits[(h * (nope + v) + i) * r..(h * (nope + v) + i + 1) * r];
            for c in 0..r {
                k_b_bits.extend((0..nope).map(|i| row(i)[c]));
            }
            for j in 0..v {
                v_b_bits.extend_from_slice(row(nope + j));
            }
        }
        let k_b: Vec<bf16> = k_b_bits.iter().map(|&b| bf16::from_bits(b)).collect();
        let v_b: Vec<bf16> = v_b_bits.iter().map(|&b| bf16::from_bits(b)).collect();
        let (_, want) = cpu_pre_attn(&DenseWeights {
            qkv: QkvWeights::Mla(MlaWeights {
                kv_b: KvUp::Split(matrix(&k_b, heads * r, nope)),
                ..mla
            }),
            ..dense
        });
        let k_b_dev = stream.clone_htod(&k_b_bits).expect("htod");
        let mut q_abs_dev = stream.alloc_zeros::<f32>(n * width).expect("alloc");
        head_linear(
            &stream,
            &linear_fn,
            &q_dev,
            [heads * qk, qk],
            &k_b_dev,
            [nope, r, 0],
            true,
            &mut q_abs_dev,
            [width, hd],
            [heads, n, nope, r],
            q_scale,
        );
        // The absorbed query columns `mla_head_linear` writes: each head's first r.
        let got = stream.clone_dtoh(&q_abs_dev).expect("dtoh");
        let absorbed = |rows: &[f32]| -> Vec<f32> {
            (0..n * heads)
                .flat_map(|i| {
                    let at = (i / heads) * width + (i % heads) * hd;
                    rows[at..at + r].to_vec()
                })
                .collect()
        };
        let err = max_abs_diff(&absorbed(&got), &absorbed(&want));
        println!("mla_head_linear (attn_k_b, {card}): max abs diff vs pre_attn {err:.3e}");
        assert!(
            err < 1e-4,
            "{card}: absorbed queries from attn_k_b differ by {err}"
        );
        let v_b_dev = stream.clone_htod(&v_b_bits).expect("htod");
        let split = KvUp::Split(matrix(&v_b, heads * v, r));
        let err = o_proj_diff(&v_b_dev, [r, v, 0], &split);
        println!("mla_head_linear (attn_v_b, {card}): max abs diff after o_proj vs CPU {err:.3e}");
        assert!(
            err < 1e-4,
            "{card}: MLA o_proj from attn_v_b differs by {err}"
        );
    }
}

/// `mla_paged_attention` against the CPU's `attention` on MLA's cache geometry (one kv head
/// of 80 = 64 latent + 16 rotary, V's rotary columns zero) with 20 query heads, so a row's
/// heads are split over two blocks: a prompt from scratch, a prompt continuing 17 cached
/// tokens and a decode token, in one launch after `paged_kv_append_rows`.
#[test]
fn mla_attention_matches_the_cpu() {
    const NAME: &str = "standin_deepseek::mla_attention_matches_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let (ctx, stream) = standin_context();
    let mla = ctx
        .load_module(compile_kernel(&MLA, DEFAULT_ARCH).expect("compiles"))
        .expect("module");
    let prefill = ctx
        .load_module(compile_kernel(&PREFILL, DEFAULT_ARCH).expect("compiles"))
        .expect("module");
    let mut rng = Rng(0x2718_2818);
    let (heads, r, rope, bs, n_blocks, mb) = (20usize, 64usize, 16usize, 16usize, 24usize, 6usize);
    let hd = r + rope;
    let layout = KvLayout {
        block_size: bs,
        kv_heads: 1,
        head_dim: hd,
        values_in_keys: None,
    };
    let shape = AttnShape {
        heads,
        kv_heads: 1,
        head_dim: hd,
        sliding_window: None,
        sinks: false,
    };
    let seqs_spec = [(0usize, 9usize), (17, 5), (40, 1)];
    let rows = paged_rows(&seqs_spec, bs, n_blocks, mb);
    let n_rows = rows.row_seq.len();
    let pool_len = n_blocks * layout.block_elems();
    let k_pool = rng.vec(pool_len, 1.0);
    // V = [c | 0]: zero rotary columns in the cache (values per slot, head_dim apart) and in
    // each new row's V.
    let mut v_pool = rng.vec(pool_len, 1.0);
    for (i, value) in v_pool.iter_mut().enumerate() {
        if i % hd >= r {
            *value = 0.0;
        }
    }
    let width = shape.qkv_width();
    let mut qkv = rng.vec(n_rows * width, 1.0);
    for row in qkv.chunks_exact_mut(width) {
        row[(heads + 1) * hd + r..].fill(0.0);
    }
    let max_keys = 41usize;
    let qkv_dev = stream.clone_htod(&qkv).expect("htod");
    let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
    let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
    let tables_dev = stream.clone_htod(&rows.tables).expect("htod");
    let seq_dev = stream.clone_htod(&rows.row_seq).expect("htod");
    let pos_dev = stream.clone_htod(&rows.row_pos).expect("htod");
    let mut scores_dev = stream
        .alloc_zeros::<f32>(n_rows * heads * max_keys)
        .expect("alloc");
    let mut out_dev = stream
        .clone_htod(&vec![f32::NAN; n_rows * heads * hd])
        .expect("htod");
    let ints = [heads, 1, hd, bs, mb].map(|v| v as i32);
    let row_width = width as i32;
    let append = prefill
        .load_function("paged_kv_append_rows")
        .expect("entry");
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
            .launch(cfg((n_rows as u32, 1, 1), 32, 0))
    }
    .expect("launch");
    let f = mla.load_function("mla_paged_attention").expect("entry");
    let (mk, win, scale, sink_col, value_dim) = (
        max_keys as i32,
        0i32,
        1.0 / (hd as f32).sqrt(),
        -1i32,
        r as i32,
    );
    // Two groups of 10 heads (at most 16 per block).
    let (groups, shared) = (2u32, (10 * hd * 4) as u32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        stream
            .launch_builder(&f)
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
            .arg(&value_dim)
            .launch(cfg((n_rows as u32, groups, 1), 128, shared))
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
    println!("mla_paged_attention ({n_rows} rows, {heads} heads in {groups} groups): max abs diff vs CPU {err:.3e}");
    assert!(err < 1e-4, "MLA attention: {err}");
}
