//! The CUDA backend's checks that need no GPU: detection never panics and names what is
//! missing, `moec devices` and `moec run --backend cuda` report it in plain words, the
//! kernels compile through NVRTC when NVRTC is present, and (tests `standin_*`) the CUDA
//! path runs through cudarc against the stand-in driver (standin/, built by
//! `cargo test --workspace`): every kernel against the CPU kernels, streams and events,
//! cuBLAS, and what a driver refuses.
//!
//! `.ci/run` installs NVRTC (the `nvidia-cuda-nvrtc-cu12` wheel) so the real compile tests
//! run in CI; elsewhere, without NVRTC, they print why they did not compile and pass. To
//! run them locally: `pip install nvidia-cuda-nvrtc-cu12` and point `LD_LIBRARY_PATH` at
//! the wheel's `nvidia/cuda_nvrtc/lib`.

use moec::cuda::detect::{detect, libraries};
use moec::cuda::kernels::{compile_all, compile_kernel, KernelSource, DEFAULT_ARCH, KERNELS};
use moec::cuda::CudaError;
use std::process::Command;

fn moec(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moec"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("moec starts")
}

#[test]
fn detection_never_panics_and_names_a_missing_driver() {
    let status = detect();
    println!("{status:?}");
    assert_eq!(status.devices.is_some(), status.libraries.driver);
    if status.libraries.driver {
        // A driver with no usable device is still reported, as an error or an empty list.
        if let Some(Ok(devices)) = &status.devices {
            assert_eq!(status.missing().is_none(), !devices.is_empty());
        }
    } else {
        assert_eq!(
            status.missing().as_deref(),
            Some("no CUDA driver library (libcuda.so) found")
        );
    }
}

#[test]
fn devices_command_names_the_cpu_and_cuda_status() {
    let out = moec(&["devices"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        lines[0].starts_with(&format!("cpu: available, {threads} threads, AVX-512: ")),
        "{stdout}"
    );
    let cuda = lines.get(1).copied().unwrap_or_default();
    let libs = libraries();
    if !libs.driver {
        assert!(
            cuda.starts_with("cuda: not available (no CUDA driver library (libcuda.so) found); "),
            "{cuda}"
        );
    }
    if libs.nvrtc {
        assert!(
            cuda.contains(&format!(
                ": found, {} kernels compile for {DEFAULT_ARCH}",
                KERNELS.len()
            )),
            "{cuda}"
        );
    } else {
        assert!(cuda.contains("; NVRTC: not found;"), "{cuda}");
    }
    let cublas = if libs.cublas {
        "cuBLAS: found"
    } else {
        "cuBLAS: not found"
    };
    assert!(cuda.ends_with(cublas), "{cuda}");
}

#[test]
fn run_on_cuda_fails_with_one_clear_line() {
    let out = moec(&[
        "run",
        "schedules/cgopipe.sched",
        "--model",
        "mixtral-tiny",
        "--backend",
        "cuda",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty());
    let text: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(text.len(), 1, "{stderr}");
    let want = if libraries().driver {
        "cannot run on the CUDA backend: "
    } else {
        "cannot run on the CUDA backend: no CUDA driver library (libcuda.so) found"
    };
    assert!(text[0].contains(want), "{stderr}");
}

#[test]
fn an_unknown_backend_is_rejected_by_the_parser() {
    let out = moec(&["run", "schedules/cgopipe.sched", "--backend", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("possible values: cpu, cuda"));
}

/// True when NVRTC loads; otherwise says why a compile test is skipped.
fn nvrtc_present(test: &str) -> bool {
    let present = libraries().nvrtc;
    if !present {
        println!(
            "{test}: NVRTC not found (no libnvrtc.so on the loader path), so the kernels were \
             not compiled; install nvidia-cuda-nvrtc-cu12 and set LD_LIBRARY_PATH to check"
        );
    }
    present
}

#[test]
fn every_kernel_compiles_through_nvrtc_and_exports_its_entries() {
    if !nvrtc_present("every_kernel_compiles_through_nvrtc_and_exports_its_entries") {
        assert_eq!(
            compile_all(DEFAULT_ARCH).err(),
            Some(CudaError::NvrtcMissing)
        );
        return;
    }
    let modules = match compile_all(DEFAULT_ARCH) {
        Ok(modules) => modules,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(modules.len(), KERNELS.len());
    for ((file, ptx), kernel) in modules.iter().zip(&KERNELS) {
        assert_eq!(*file, kernel.file);
        let text = ptx.to_src();
        assert!(text.contains(&format!(".target {DEFAULT_ARCH}")), "{file}");
        for entry in kernel.entries {
            assert!(
                text.contains(&format!(".entry {entry}(")),
                "kernels/{file}: no PTX entry {entry}"
            );
        }
        println!("kernels/{file}: {} bytes of PTX", text.len());
    }
}

#[test]
fn a_rejected_source_names_its_file_and_carries_the_nvrtc_log() {
    if !nvrtc_present("a_rejected_source_names_its_file_and_carries_the_nvrtc_log") {
        return;
    }
    let broken = KernelSource {
        file: "broken.cu",
        source: "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }",
        entries: &["broken"],
    };
    match compile_kernel(&broken, DEFAULT_ARCH) {
        Err(e @ CudaError::Compile { .. }) => {
            let message = e.to_string();
            assert!(message.starts_with("kernels/broken.cu: NVRTC failed to compile it for sm_80"));
            assert!(message.contains("undeclared_name"), "{message}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// The stand-in driver (standin/, a test tool): the CUDA path through cudarc, with no GPU.
//
// Each test below re-runs this test binary as a child process with a private directory of
// symlinks to libmoec_standin.so (named as cudarc's loader looks for the driver, cuBLAS
// and NVRTC) first on LD_LIBRARY_PATH; the child (STANDIN_CHILD names which test) calls
// cudarc exactly as the backend would and checks the results. The loader path is read at
// process start, hence the child.

use cudarc::driver::sys::{self as cu, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;
use std::path::PathBuf;
use std::sync::Arc;

const STANDIN_CHILD: &str = "MOEC_STANDIN_TEST_CHILD";

/// The names cudarc 0.19 (cuda-12080) tries first for each library.
const STANDIN_NAMES: [&str; 6] = [
    "libcuda.so",
    "libcuda.so.1",
    "libcublas.so",
    "libcublas.so.12",
    "libnvrtc.so",
    "libnvrtc.so.12",
];

/// The stand-in cdylib next to this test binary (`cargo test --workspace` builds it).
fn standin_library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps directory");
    let candidates = [
        deps.join("libmoec_standin.so"),
        deps.join("../libmoec_standin.so"),
    ];
    let library = candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "the stand-in CUDA driver is not built ({} missing): run `cargo test --workspace` \
                 (it builds the moec-standin cdylib the CUDA tests load)",
                candidates[0].display()
            )
        });
    // `cargo test --test cuda_backend` does not rebuild the stand-in: refuse a library older
    // than its sources (or the emulation shim it embeds) instead of testing stale code.
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut sources = vec![root.join("kernels/cpu_emulation/shim.h")];
    if let Ok(dir) = std::fs::read_dir(root.join("standin/src")) {
        sources.extend(dir.filter_map(|e| e.ok()).map(|e| e.path()));
    }
    if let (Some(built), Some(newest)) = (
        modified(&library),
        sources.iter().filter_map(|p| modified(p)).max(),
    ) {
        assert!(
            built >= newest,
            "{} is older than its sources: run `cargo test --workspace` to rebuild it",
            library.display()
        );
    }
    library
}

/// Runs test `name` of this binary in a child whose CUDA libraries are the stand-in: the
/// symlinks first on its LD_LIBRARY_PATH, kernel objects cached next to the build so
/// reruns do not recompile.
fn standin_child(name: &str) -> std::process::Output {
    let library = standin_library();
    let dir = tempfile::tempdir().expect("temp dir");
    for link in STANDIN_NAMES {
        std::os::unix::fs::symlink(&library, dir.path().join(link)).expect("symlink");
    }
    let deps = library.parent().expect("library directory");
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => format!("{}:{}", dir.path().display(), old.to_string_lossy()),
        None => dir.path().display().to_string(),
    };
    Command::new(std::env::current_exe().expect("test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(STANDIN_CHILD, name)
        .env("LD_LIBRARY_PATH", path)
        .env("MOEC_STANDIN_CACHE", deps.join("moec-standin-kernels"))
        .output()
        .expect("child test starts")
}

/// Runs test `name` under the stand-in (see [`standin_child`]) and returns the child's
/// stderr after asserting it passed.
fn run_under_standin(name: &str) -> String {
    let out = standin_child(name);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}");
    assert!(
        out.status.success(),
        "the child test {name} failed under the stand-in"
    );
    assert!(stdout.contains("1 passed"), "the child did not run {name}");
    stderr.into_owned()
}

/// Runs test `name` under the stand-in and returns its exit status and stderr (for tests
/// whose child must die).
fn run_under_standin_status(name: &str) -> (std::process::ExitStatus, String) {
    let out = standin_child(name);
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// True in the child process of test `name`.
fn in_standin_child(name: &str) -> bool {
    std::env::var(STANDIN_CHILD).as_deref() == Ok(name)
}

/// xorshift64*: reproducible test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn standin_context() -> (Arc<CudaContext>, Arc<CudaStream>) {
    let ctx = CudaContext::new(0).expect("stand-in context");
    // SAFETY: called before any allocation, as cudarc requires; the backend runs with event
    // tracking off and orders streams with its own events.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("stream");
    (ctx, stream)
}

fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// Loads every kernel file compiled by the (stand-in) NVRTC; by file name.
fn load_kernels(ctx: &Arc<CudaContext>) -> Vec<(&'static str, Arc<cudarc::driver::CudaModule>)> {
    compile_all(DEFAULT_ARCH)
        .expect("stand-in NVRTC compiles every kernel")
        .into_iter()
        .map(|(file, ptx)| {
            let text = ptx.to_src();
            assert!(text.contains(&format!(".target {DEFAULT_ARCH}")), "{file}");
            (file, ctx.load_module(ptx).expect("module loads"))
        })
        .collect()
}

fn function(
    modules: &[(&'static str, Arc<cudarc::driver::CudaModule>)],
    file: &str,
    name: &str,
) -> cudarc::driver::CudaFunction {
    let module = &modules
        .iter()
        .find(|(f, _)| *f == file)
        .expect("kernel file")
        .1;
    module.load_function(name).expect("kernel entry")
}

/// Every kernel of kernels/*.cu, compiled by the stand-in NVRTC and launched through
/// cudarc, against the CPU kernels of `moec::model::kernels`. Tolerances: the GPU kernels
/// reduce sums as trees where the CPU sums in order, so norms and attention agree to 1e-4
/// absolute on O(1) values; rotary, SwiGLU and routing weights to 1e-5; routing choices and
/// the KV cache appends exactly.
#[test]
fn standin_runs_every_kernel_like_the_cpu_kernels() {
    const NAME: &str = "standin_runs_every_kernel_like_the_cpu_kernels";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::model::kernels::attention::{attention, AttnSeq, AttnShape};
    use moec::model::kernels::kv_cache::{KvBlocksMut, KvLayout};
    use moec::model::kernels::moe::route;
    use moec::model::kernels::norm::{normalize, NormKind};
    use moec::model::kernels::rope::RopeTable;
    use moec::model::TypedSlice;

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
    let x_dev = stream.clone_htod(&x).expect("htod");
    let w_dev = stream.clone_htod(&w_bits).expect("htod");
    for (entry, kind, threads) in [
        ("rms_norm_bf16", NormKind::Rms, 64),
        ("layer_norm_bf16", NormKind::LayerNoBias, 96),
    ] {
        let f = function(&modules, "rms_norm.cu", entry);
        let mut out_dev = stream.alloc_zeros::<f32>(rows * d).expect("alloc");
        let (dim, eps) = (d as i32, 1e-5f32);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&f)
                .arg(&x_dev)
                .arg(&w_dev)
                .arg(&mut out_dev)
                .arg(&dim)
                .arg(&eps)
                .launch(cfg((rows as u32, 1, 1), threads, 0))
        }
        .expect("launch");
        let got = stream.clone_dtoh(&out_dev).expect("dtoh");
        let mut want = vec![0.0f32; rows * d];
        normalize(kind, &x, TypedSlice::Bf16(&w), eps, &mut want);
        let err = max_abs_diff(&got, &want);
        println!("{entry}: max abs diff vs CPU {err:.3e}");
        assert!(err < 1e-4, "{entry}: {err}");
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
    for window in [None, Some(20usize)] {
        let (ns, ah, akvh, ahd, bs, n_blocks, mb) =
            (3usize, 8usize, 2usize, 32usize, 16usize, 20usize, 6usize);
        let layout = KvLayout {
            block_size: bs,
            kv_heads: akvh,
            head_dim: ahd,
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
        };
        let qkv = rng.vec(ns * shape.qkv_width(), 1.0);
        let max_keys = 41usize;
        let qkv_dev = stream.clone_htod(&qkv).expect("htod");
        let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
        let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
        let tables_dev = stream.clone_htod(&tables).expect("htod");
        let ctx_dev = stream.clone_htod(&ctx_lens).expect("htod");
        let mut scores_dev = stream
            .alloc_zeros::<f32>(ns * ah * max_keys)
            .expect("alloc");
        let mut out_dev = stream.alloc_zeros::<f32>(ns * ah * ahd).expect("alloc");
        let ints = [ah, akvh, ahd, bs, mb].map(|v| v as i32);
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
                .launch(cfg((ns as u32, akvh as u32, 1), 32, 0))
        }
        .expect("launch");
        let decode = function(&modules, "decode_attention.cu", "paged_decode_attention");
        let (mk, win, scale) = (
            max_keys as i32,
            window.unwrap_or(0) as i32,
            1.0 / (ahd as f32).sqrt(),
        );
        let shared = ((ah / akvh) * ahd * 4) as u32;
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            stream
                .launch_builder(&decode)
                .arg(&qkv_dev)
                .arg(&k_dev)
                .arg(&v_dev)
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
                .launch(cfg((ns as u32, akvh as u32, 1), 64, shared))
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
        let mut cache = KvBlocksMut {
            layout,
            k: &mut k_cpu,
            v: &mut v_cpu,
        };
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
        println!("paged_decode_attention (window {window:?}): max abs diff vs CPU {err:.3e}");
        assert!(err < 1e-4, "attention: {err}");
    }
}

/// Blocks a stream until the test sends on the channel (a host-held gate: the only way to
/// make one stream's work certainly wait while another stream's runs).
unsafe extern "C" fn wait_for_release(data: *mut std::ffi::c_void) {
    // SAFETY: `gate` passed ownership of a boxed receiver; this callback runs once.
    let receiver = unsafe { Box::from_raw(data.cast::<std::sync::mpsc::Receiver<()>>()) };
    let _ = receiver.recv();
}

/// Holds `stream` at this point until the returned sender is used (or dropped).
fn gate(stream: &CudaStream) -> std::sync::mpsc::Sender<()> {
    let (release, receiver) = std::sync::mpsc::channel::<()>();
    let data = Box::into_raw(Box::new(receiver));
    // SAFETY: the callback takes ownership of `data` and makes no CUDA calls.
    unsafe {
        cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            wait_for_release,
            data.cast(),
        )
    }
    .expect("cuLaunchHostFunc");
    release
}

/// Two streams ordered by an event give the right result; without the event the consumer
/// runs while the producer is still held, and reads the input instead of the result (a
/// race the stand-in shows every time, never hides by luck). Also the event rules:
/// pending events are NOT_READY, elapsed time needs timing events that were recorded.
#[test]
fn standin_streams_run_concurrently_and_events_order_them() {
    const NAME: &str = "standin_streams_run_concurrently_and_events_order_them";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    let (ctx, producer) = standin_context();
    let consumer = ctx.new_stream().expect("stream");
    let modules = load_kernels(&ctx);
    let swiglu = function(&modules, "swiglu.cu", "swiglu");
    let g: Vec<f32> = (0..64).map(|i| i as f32 / 8.0 - 4.0).collect();
    let u = vec![2.0f32; 64];
    let want: Vec<f32> = g.iter().map(|&x| x / (1.0 + (-x).exp()) * 2.0).collect();
    let n = 64i32;
    let run = |with_event: bool| -> Vec<f32> {
        let mut g_dev = producer.clone_htod(&g).expect("htod");
        let u_dev = producer.clone_htod(&u).expect("htod");
        producer.synchronize().expect("sync");
        let release = gate(&producer);
        // SAFETY: argument types and order match the kernel's signature.
        unsafe {
            producer
                .launch_builder(&swiglu)
                .arg(&mut g_dev)
                .arg(&u_dev)
                .arg(&n)
                .launch(cfg((1, 1, 1), 64, 0))
        }
        .expect("launch");
        let done = ctx
            .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
            .expect("event");
        done.record(&producer).expect("record");
        assert!(!done.is_complete(), "the producer is held");
        let got = if with_event {
            consumer.wait(&done).expect("wait");
            release.send(()).expect("release");
            consumer.clone_dtoh(&g_dev).expect("dtoh")
        } else {
            // The pageable read-back returns when the consumer stream did it: before the
            // producer, still held, ran the kernel.
            let got = consumer.clone_dtoh(&g_dev).expect("dtoh");
            release.send(()).expect("release");
            got
        };
        producer.synchronize().expect("sync");
        got
    };
    assert_eq!(run(true), want, "ordered by the event: the kernel's result");
    let raced = run(false);
    assert_eq!(raced, g, "without the event the consumer read the input");
    println!(
        "without the event the consumer read {} stale values of 64",
        raced.iter().zip(&want).filter(|(a, b)| a != b).count()
    );

    // Captured at call time: a pageable source (the driver stages it) and the launch's
    // parameter bytes, both changed by the host while the stream is still held.
    let release = gate(&producer);
    let mut host = vec![1.0f32; 8];
    let mut staged_dev = producer.clone_htod(&host).expect("htod");
    host.fill(5.0);
    let ones_dev = producer.clone_htod(&[1.0f32; 8]).expect("htod");
    let mut count = Box::new(4i32);
    // SAFETY: argument types and order match the kernel's signature.
    unsafe {
        producer
            .launch_builder(&swiglu)
            .arg(&mut staged_dev)
            .arg(&ones_dev)
            .arg(&*count)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("launch");
    *count = 8;
    drop(count);
    release.send(()).expect("release");
    let silu_one = 1.0 / (1.0 + (-1.0f32).exp());
    assert_eq!(
        producer.clone_dtoh(&staged_dev).expect("dtoh"),
        [silu_one, silu_one, silu_one, silu_one, 1.0, 1.0, 1.0, 1.0],
        "the copy read the source and the launch its n when they were called"
    );

    // A wait binds to the record submitted before it: recording the event again on an
    // idle stream does not release a consumer waiting on the earlier (held) record.
    let third = ctx.new_stream().expect("stream");
    let again = ctx.new_event(None).expect("event");
    let release = gate(&producer);
    again.record(&producer).expect("record");
    consumer.wait(&again).expect("wait");
    let marker = ctx.new_event(None).expect("event");
    marker.record(&consumer).expect("record");
    again.record(&third).expect("record");
    third.synchronize().expect("sync");
    assert!(again.is_complete(), "the latest record has run");
    assert!(
        !marker.is_complete(),
        "the consumer still waits for the first record"
    );
    release.send(()).expect("release");
    marker.synchronize().expect("sync");

    // Event rules through the raw driver calls.
    let timed = ctx
        .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let untimed = ctx.new_event(None).expect("event");
    let never = ctx
        .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    assert!(never.is_complete(), "a never-recorded event is complete");
    let release = gate(&producer);
    timed.record(&producer).expect("record");
    untimed.record(&producer).expect("record");
    let elapsed = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| {
        let mut ms = 0.0f32;
        // SAFETY: two live events and a live float.
        unsafe { cu::cuEventElapsedTime(&mut ms, a.cu_event(), b.cu_event()) }
    };
    assert_eq!(elapsed(&timed, &timed), CUresult::CUDA_ERROR_NOT_READY);
    // SAFETY: a live event.
    assert_eq!(
        unsafe { cu::cuEventQuery(timed.cu_event()) },
        CUresult::CUDA_ERROR_NOT_READY
    );
    // A wait binds to the record before it: recording `never` later does not matter.
    consumer.wait(&never).expect("wait");
    consumer
        .synchronize()
        .expect("a wait on a never-recorded event does not block");
    release.send(()).expect("release");
    producer.synchronize().expect("sync");
    assert_eq!(
        elapsed(&timed, &untimed),
        CUresult::CUDA_ERROR_INVALID_HANDLE
    );
    assert_eq!(elapsed(&timed, &never), CUresult::CUDA_ERROR_INVALID_HANDLE);
    assert_eq!(elapsed(&timed, &timed), CUresult::CUDA_SUCCESS);
}

/// cuBLAS through cudarc: f32 GEMM against a hand-computed 2x2 product and a row-major
/// reference, strided batched f32, and bf16 GEMM with f32 accumulation against the
/// widened operands (the output rounds once, so it is exact up to that rounding: 1 bf16
/// ulp, 2^-8 relative).
#[test]
fn standin_cublas_gemms_match_references() {
    const NAME: &str = "standin_cublas_gemms_match_references";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
    let (_ctx, stream) = standin_context();
    let blas = CudaBlas::new(Arc::clone(&stream)).expect("cuBLAS handle");

    // Column-major A = [[1, 2], [3, 4]], B = [[5, 6], [7, 8]]: A*B = [[19, 22], [43, 50]].
    let a = stream.clone_htod(&[1.0f32, 3.0, 2.0, 4.0]).expect("htod");
    let b = stream.clone_htod(&[5.0f32, 7.0, 6.0, 8.0]).expect("htod");
    let mut c = stream.alloc_zeros::<f32>(4).expect("alloc");
    let config = GemmConfig {
        transa: CUBLAS_OP_N,
        transb: CUBLAS_OP_N,
        m: 2,
        n: 2,
        k: 2,
        alpha: 1.0f32,
        lda: 2,
        ldb: 2,
        beta: 0.0,
        ldc: 2,
    };
    // SAFETY: the operands hold m*k, k*n and m*n elements.
    unsafe { blas.gemm(config, &a, &b, &mut c) }.expect("sgemm");
    assert_eq!(
        stream.clone_dtoh(&c).expect("dtoh"),
        [19.0, 43.0, 22.0, 50.0]
    );

    // The backend's use: y[rows, out] = x[rows, in] * W[out, in]^T with row-major x and W,
    // i.e. column-major y^T = W * x^T: transa = T on W stored [in, out] column-major.
    let mut rng = Rng(42);
    let (rows, inp, out) = (3usize, 40usize, 24usize);
    let x = rng.vec(rows * inp, 1.0);
    let w = rng.vec(out * inp, 1.0);
    let mut want = vec![0.0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            want[r * out + o] = (0..inp).map(|i| x[r * inp + i] * w[o * inp + i]).sum();
        }
    }
    let x_dev = stream.clone_htod(&x).expect("htod");
    let w_dev = stream.clone_htod(&w).expect("htod");
    let mut y_dev = stream.alloc_zeros::<f32>(rows * out).expect("alloc");
    let linear = GemmConfig {
        transa: CUBLAS_OP_T,
        transb: CUBLAS_OP_N,
        m: out as i32,
        n: rows as i32,
        k: inp as i32,
        alpha: 1.0f32,
        lda: inp as i32,
        ldb: inp as i32,
        beta: 0.0,
        ldc: out as i32,
    };
    // SAFETY: shapes as configured.
    unsafe { blas.gemm(linear, &w_dev, &x_dev, &mut y_dev) }.expect("sgemm");
    let err = max_abs_diff(&stream.clone_dtoh(&y_dev).expect("dtoh"), &want);
    println!("sgemm linear: max abs diff {err:.3e}");
    assert!(err < 1e-5, "{err}");

    // Strided batched: two independent 2x2 products in one call.
    let a2 = stream
        .clone_htod(&[1.0f32, 3.0, 2.0, 4.0, 1.0, 0.0, 0.0, 1.0])
        .expect("htod");
    let b2 = stream
        .clone_htod(&[5.0f32, 7.0, 6.0, 8.0, 9.0, 10.0, 11.0, 12.0])
        .expect("htod");
    let mut c2 = stream.alloc_zeros::<f32>(8).expect("alloc");
    let batched = StridedBatchedConfig {
        gemm: config,
        batch_size: 2,
        stride_a: 4,
        stride_b: 4,
        stride_c: 4,
    };
    // SAFETY: two batches of 4 elements each.
    unsafe { blas.gemm_strided_batched(batched, &a2, &b2, &mut c2) }.expect("batched");
    assert_eq!(
        stream.clone_dtoh(&c2).expect("dtoh"),
        [19.0, 43.0, 22.0, 50.0, 9.0, 10.0, 11.0, 12.0]
    );

    // bf16 storage, f32 compute (cublasGemmEx), the same linear layer.
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let xb_dev = stream.clone_htod(&xb).expect("htod");
    let wb_dev = stream.clone_htod(&wb).expect("htod");
    let mut yb_dev = stream.alloc_zeros::<bf16>(rows * out).expect("alloc");
    let linear_bf16 = GemmConfig {
        alpha: bf16::ONE,
        beta: bf16::ZERO,
        transa: linear.transa,
        transb: linear.transb,
        m: linear.m,
        n: linear.n,
        k: linear.k,
        lda: linear.lda,
        ldb: linear.ldb,
        ldc: linear.ldc,
    };
    // SAFETY: shapes as configured.
    unsafe { blas.gemm(linear_bf16, &wb_dev, &xb_dev, &mut yb_dev) }.expect("gemm_ex");
    let got = stream.clone_dtoh(&yb_dev).expect("dtoh");
    for r in 0..rows {
        for o in 0..out {
            let exact: f32 = (0..inp)
                .map(|i| xb[r * inp + i].to_f32() * wb[o * inp + i].to_f32())
                .sum();
            let g = got[r * out + o].to_f32();
            assert!(
                (g - exact).abs() <= exact.abs() / 256.0 + 1e-6,
                "bf16 gemm [{r}, {o}]: {g} vs {exact}"
            );
        }
    }
    println!("gemm_ex bf16: within 1 bf16 ulp of the f32-accumulated product");
}

/// What a real driver refuses, the stand-in refuses with the driver's code (and a
/// `moec-standin:` line on stderr, checked by the parent).
#[test]
fn standin_refuses_what_a_driver_refuses() {
    const NAME: &str = "standin_refuses_what_a_driver_refuses";
    if !in_standin_child(NAME) {
        let stderr = run_under_standin(NAME);
        for line in [
            "cuMemcpyHtoDAsync_v2 refused: destination",
            "runs past the end of the device allocation",
            "cuMemcpyDtoHAsync_v2 refused: source",
            "cuLaunchKernel(swiglu) refused: pointer parameter 0",
            "use after free",
            "cuModuleGetFunction refused: unknown kernel",
            "never registered",
            "cuModuleLoadData refused: the image is not a moec-standin module",
        ] {
            assert!(stderr.contains(line), "no log line `{line}` in:\n{stderr}");
        }
        return;
    }
    use CUresult::*;
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let s = stream.cu_stream();
    let buf: CudaSlice<f32> = stream.alloc_zeros(16).expect("alloc");
    let (dev, _sync) = cudarc::driver::DevicePtr::device_ptr(&buf, &stream);
    let host = [0.0f32; 32];
    let mut back = vec![0.0f32; 32];
    // SAFETY (every raw call below): live host buffers of 32 floats, a live stream; the
    // device ranges are what is being tested.
    unsafe {
        // Out-of-bounds copies: 32 floats into/out of a 16-float allocation.
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(dev, host.as_ptr().cast(), 128, s),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cu::cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), dev + 32, 64, s),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            cu::cuMemcpyHtoDAsync_v2(dev, host.as_ptr().cast(), 64, s),
            CUDA_SUCCESS
        );
        // A host buffer used as pinned that was never registered.
        assert_eq!(
            cu::cuMemHostUnregister(back.as_mut_ptr().cast()),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        let mut mapped = 0u64;
        assert_eq!(
            cu::cuMemHostGetDevicePointer_v2(&mut mapped, back.as_mut_ptr().cast(), 0),
            CUDA_ERROR_INVALID_VALUE
        );
        // Registered, it is accepted, and unregistering works once.
        assert_eq!(
            cu::cuMemHostRegister_v2(back.as_mut_ptr().cast(), 128, 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            cu::cuMemHostGetDevicePointer_v2(&mut mapped, back.as_mut_ptr().cast(), 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            cu::cuMemHostUnregister(back.as_mut_ptr().cast()),
            CUDA_SUCCESS
        );
    }
    // A launch whose pointer argument is host memory the driver never saw.
    let swiglu = function(&modules, "swiglu.cu", "swiglu");
    let host_ptr = host.as_ptr() as u64;
    let n = 16i32;
    // SAFETY: argument types match; the pointer is what is being tested.
    let launch = unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&host_ptr)
            .arg(&buf)
            .arg(&n)
            .launch(cfg((1, 1, 1), 32, 0))
    };
    assert_eq!(
        launch.map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_ILLEGAL_ADDRESS)
    );
    // Use after free: a freed allocation in a copy and in a launch.
    let freed = {
        let victim: CudaSlice<f32> = stream.alloc_zeros(16).expect("alloc");
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&victim, &stream);
        ptr
    };
    stream.synchronize().expect("sync");
    // SAFETY: live host buffer; the freed device pointer is what is being tested.
    assert_eq!(
        unsafe { cu::cuMemcpyHtoDAsync_v2(freed, host.as_ptr().cast(), 64, s) },
        CUDA_ERROR_INVALID_VALUE
    );
    // SAFETY: as above.
    let launch = unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&freed)
            .arg(&buf)
            .arg(&n)
            .launch(cfg((1, 1, 1), 32, 0))
    };
    assert_eq!(
        launch.map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_ILLEGAL_ADDRESS)
    );
    // Unknown kernel.
    let module = &modules
        .iter()
        .find(|(f, _)| *f == "swiglu.cu")
        .expect("module")
        .1;
    assert_eq!(
        module
            .load_function("no_such_kernel")
            .map(drop)
            .map_err(|e| e.0),
        Err(CUDA_ERROR_NOT_FOUND)
    );
    // Real PTX cannot run on the stand-in.
    let ptx = cudarc::nvrtc::Ptx::from_src(".version 8.0\n.target sm_80\n.address_size 64\n");
    assert_eq!(
        ctx.load_module(ptx).map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_INVALID_IMAGE)
    );
    // Blocks larger than a GPU allows.
    // SAFETY: argument types match.
    let launch = unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&buf)
            .arg(&buf)
            .arg(&n)
            .launch(cfg((1, 1, 1), 2048, 0))
    };
    assert_eq!(
        launch.map(drop).map_err(|e| e.0),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    stream.synchronize().expect("the valid work still ran");
}

/// The catalog's non-GEMM ops in kernels/ops.cu, through the stand-in, against the CPU
/// kernels: embedding (bf16/f16/f32 tables) against `head::embed`, widening against
/// `half`, bf16 narrowing against `half::bf16::from_f32` (round to nearest even), expert
/// gather/scatter/combine against `moe::combine` on the scattered slots, greedy sampling
/// against `sampling::argmax`. All are exact (data movement, the same summation order).
#[test]
fn standin_runs_the_op_kernels_like_the_cpu() {
    const NAME: &str = "standin_runs_the_op_kernels_like_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use half::f16;
    use moec::model::kernels::head::embed;
    use moec::model::kernels::moe::{combine, Routing};
    use moec::model::kernels::sampling::argmax;
    use moec::model::{Matrix, Orientation, TypedSlice};
    const OPS: KernelSource = KernelSource {
        file: "ops.cu",
        source: include_str!("../kernels/ops.cu"),
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
            "combine_slots",
            "argmax_rows",
        ],
    };
    assert_eq!(moec::cuda::kernels::entry_names(OPS.source), OPS.entries);
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
    for (e, rows) in routing.by_expert(n_experts).iter().enumerate() {
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
            .arg(&mut residual_dev)
            .arg(&k_i)
            .arg(&w_i)
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
    println!("argmax_rows: equal to sampling::argmax");
}

/// The raw bytes of a slice of plain numbers (for uploading bf16/f16 tables).
fn bytemuck_bytes<T: bytemuck::Pod>(values: &[T]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// Bit patterns, so exact comparisons also distinguish -0.0 and NaN payloads.
fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// kernels/prefill_attention.cu through the stand-in against the CPU's `attention` with
/// several new tokens per sequence (a prompt from scratch, a prompt continuing a cached
/// sequence, and a decode token in the same launch), without and with a sliding window.
/// Tolerance 1e-4 absolute (tree-reduced softmax, as for decode); K/V appends exact.
#[test]
fn standin_prefill_attention_matches_the_cpu() {
    const NAME: &str = "standin_prefill_attention_matches_the_cpu";
    if !in_standin_child(NAME) {
        run_under_standin(NAME);
        return;
    }
    use moec::model::kernels::attention::{attention, AttnSeq, AttnShape};
    use moec::model::kernels::kv_cache::{KvBlocksMut, KvLayout};
    const PREFILL: KernelSource = KernelSource {
        file: "prefill_attention.cu",
        source: include_str!("../kernels/prefill_attention.cu"),
        entries: &["paged_kv_append_rows", "paged_prefill_attention"],
    };
    assert_eq!(
        moec::cuda::kernels::entry_names(PREFILL.source),
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
    };
    // (cached tokens, new tokens) per sequence.
    let seqs_spec = [(0usize, 9usize), (17, 5), (40, 1)];
    let mut tables = vec![0u32; seqs_spec.len() * mb];
    let mut next = 0u32;
    for (s, &(cached, new)) in seqs_spec.iter().enumerate() {
        for b in 0..(cached + new).div_ceil(bs) {
            tables[s * mb + b] = (next * 5 + 1) % n_blocks as u32;
            next += 1;
        }
    }
    let (mut row_seq, mut row_pos) = (Vec::new(), Vec::new());
    for (s, &(cached, new)) in seqs_spec.iter().enumerate() {
        for j in 0..new {
            row_seq.push(s as u32);
            row_pos.push((cached + j) as i32);
        }
    }
    let n_rows = row_seq.len();
    for window in [None, Some(12usize)] {
        let shape = AttnShape {
            heads: ah,
            kv_heads: akvh,
            head_dim: ahd,
            sliding_window: window,
        };
        let pool_len = n_blocks * layout.block_elems();
        let k_pool = rng.vec(pool_len, 1.0);
        let v_pool = rng.vec(pool_len, 1.0);
        let qkv = rng.vec(n_rows * shape.qkv_width(), 1.0);
        let max_keys = 41usize;
        let qkv_dev = stream.clone_htod(&qkv).expect("htod");
        let mut k_dev = stream.clone_htod(&k_pool).expect("htod");
        let mut v_dev = stream.clone_htod(&v_pool).expect("htod");
        let tables_dev = stream.clone_htod(&tables).expect("htod");
        let seq_dev = stream.clone_htod(&row_seq).expect("htod");
        let pos_dev = stream.clone_htod(&row_pos).expect("htod");
        let mut scores_dev = stream
            .alloc_zeros::<f32>(n_rows * ah * max_keys)
            .expect("alloc");
        let mut out_dev = stream.alloc_zeros::<f32>(n_rows * ah * ahd).expect("alloc");
        let ints = [ah, akvh, ahd, bs, mb].map(|v| v as i32);
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
                .launch(cfg((n_rows as u32, akvh as u32, 1), 64, shared))
        }
        .expect("launch");
        let got = stream.clone_dtoh(&out_dev).expect("dtoh");
        let (mut k_cpu, mut v_cpu) = (k_pool.clone(), v_pool.clone());
        let mut want = vec![0.0f32; n_rows * ah * ahd];
        let seqs: Vec<AttnSeq<'_>> = seqs_spec
            .iter()
            .enumerate()
            .map(|(s, &(cached, new))| AttnSeq {
                block_table: &tables[s * mb..(s + 1) * mb],
                context_len: cached,
                n_new: new,
            })
            .collect();
        let mut cache = KvBlocksMut {
            layout,
            k: &mut k_cpu,
            v: &mut v_cpu,
        };
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
        println!("paged_prefill_attention ({n_rows} rows, window {window:?}): max abs diff vs CPU {err:.3e}");
        assert!(err < 1e-4, "prefill attention: {err}");
    }
}

/// A kernel that runs past the end of its buffer (its pointer arguments are valid, so the
/// launch is accepted) hits the guard page after the allocation: the process dies with
/// SIGSEGV instead of silently reading or corrupting neighbouring memory.
#[test]
fn standin_kernel_overrun_faults_at_the_guard_page() {
    const NAME: &str = "standin_kernel_overrun_faults_at_the_guard_page";
    if !in_standin_child(NAME) {
        use std::os::unix::process::ExitStatusExt;
        let (status, stderr) = run_under_standin_status(NAME);
        println!("child: {status:?}\n{stderr}");
        assert_eq!(status.signal(), Some(libc_sigsegv()), "{stderr}");
        assert!(stderr.contains("launching the overrun"), "{stderr}");
        assert!(
            stderr.contains("moec-standin: memory fault at 0x")
                && stderr.contains("past an allocation's end"),
            "{stderr}"
        );
        return;
    }
    let (ctx, stream) = standin_context();
    let modules = load_kernels(&ctx);
    let swiglu = function(&modules, "swiglu.cu", "swiglu");
    // 64 floats = 256 bytes: the allocation ends exactly at its guard page.
    let mut g_dev = stream.alloc_zeros::<f32>(64).expect("alloc");
    let u_dev = stream.alloc_zeros::<f32>(64).expect("alloc");
    let n = 128i32;
    eprintln!("launching the overrun");
    // SAFETY: not safe on purpose: n runs past both buffers; the stand-in must fault.
    unsafe {
        stream
            .launch_builder(&swiglu)
            .arg(&mut g_dev)
            .arg(&u_dev)
            .arg(&n)
            .launch(cfg((1, 1, 1), 32, 0))
    }
    .expect("the launch itself is valid");
    stream.synchronize().expect("sync");
    panic!("the overrun did not fault");
}

/// SIGSEGV's number on Linux (no libc dependency in the tests for one constant).
fn libc_sigsegv() -> i32 {
    11
}
