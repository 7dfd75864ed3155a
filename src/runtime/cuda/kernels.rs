//! moec's CUDA kernels (`kernels/*.cu`, embedded at build time) and their compilation to
//! PTX through NVRTC.
//!
//! Takes a target architecture (e.g. `sm_80`); gives one PTX module per kernel file. Each
//! file's header comment states its memory layout, which is the CPU backend's
//! (`math`), so a plan lowered once can run on either backend. NVRTC is only
//! called after its library was found to load ([`CudaError::NvrtcMissing`] otherwise), and
//! a rejected source is an error naming the file and carrying NVRTC's log.

use super::detect::libraries;
use super::CudaError;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

/// The architecture kernels are compiled for when none is asked for (A100 and newer run it).
pub const DEFAULT_ARCH: &str = "sm_80";

/// One kernel source file and the entry points the backend loads from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    /// CUDA C source text.
    pub source: &'static str,
    /// `extern "C" __global__` functions the module must export.
    pub entries: &'static [&'static str],
}

/// Every kernel file, in the order of a layer's forward pass.
pub const KERNELS: [KernelSource; 16] = [
    KernelSource {
        file: "rms_norm.cu",
        source: include_str!("../../../kernels/rms_norm.cu"),
        entries: &["rms_norm", "layer_norm", "qk_rms_norm_f32"],
    },
    KernelSource {
        file: "rope.cu",
        source: include_str!("../../../kernels/rope.cu"),
        entries: &["rope_neox"],
    },
    KernelSource {
        file: "decode_attention.cu",
        source: include_str!("../../../kernels/decode_attention.cu"),
        entries: &[
            "paged_kv_append",
            "paged_decode_attention",
            "paged_decode_combine",
        ],
    },
    KernelSource {
        file: "router_topk.cu",
        source: include_str!("../../../kernels/router_topk.cu"),
        entries: &["router_topk", "router_topk_softmax"],
    },
    KernelSource {
        file: "swiglu.cu",
        source: include_str!("../../../kernels/swiglu.cu"),
        entries: &["swiglu"],
    },
    KernelSource {
        file: "prefill_attention.cu",
        source: include_str!("../../../kernels/prefill_attention.cu"),
        entries: &[
            "paged_kv_append_rows",
            "paged_prefill_attention",
            "paged_prefill_attention_mma",
        ],
    },
    KernelSource {
        file: "families.cu",
        source: include_str!("../../../kernels/families.cu"),
        entries: &["bias_rows", "sigmoid_scale_rows", "clamped_swiglu"],
    },
    KernelSource {
        file: "ops.cu",
        source: include_str!("../../../kernels/ops.cu"),
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
    },
    KernelSource {
        file: "moe_grouped.cu",
        source: include_str!("../../../kernels/moe_grouped.cu"),
        entries: &[
            "moe_group_block",
            "moe_count_experts",
            "moe_grouped_linear",
            "moe_grouped_gemv",
            "moe_grouped_mma",
            "moe_grouped_gemv_1",
            "moe_grouped_gemv_rows",
            "moe_gate_route_block",
            "moe_gate_route",
            "moe_group",
        ],
    },
    KernelSource {
        file: "linear_gemv.cu",
        source: include_str!("../../../kernels/linear_gemv.cu"),
        entries: &[
            "linear_gemv",
            "linear_gemv3",
            "linear_gemv_1",
            "linear_gemv3_1",
            "linear_gemv_r4",
            "linear_gemv_r16",
            "linear_gemv3_r4",
            "linear_gemv3_r16",
        ],
    },
    KernelSource {
        file: "q8_products.cu",
        source: include_str!("../../../kernels/q8_products.cu"),
        entries: &["linear_gemv_q8", "moe_grouped_gemv_q8", "linear_gemv3_q8"],
    },
    KernelSource {
        file: "q8_products_rows.cu",
        source: include_str!("../../../kernels/q8_products_rows.cu"),
        entries: &[
            "linear_gemv_q8_r1",
            "linear_gemv3_q8_r1",
            "moe_grouped_gemv_q8_r1",
            "linear_gemv_q8_r16",
            "linear_gemv3_q8_r16",
            "moe_grouped_gemv_q8_r16",
            "linear_gemv_q8_x1",
            "linear_gemv3_q8_x1",
            "moe_grouped_gemv_q8_x1",
        ],
    },
    KernelSource {
        file: "mla_attention.cu",
        source: include_str!("../../../kernels/mla_attention.cu"),
        entries: &[
            "mla_rms_norm",
            "mla_head_linear",
            "mla_qkv_rows",
            "mla_paged_attention",
        ],
    },
    KernelSource {
        file: "deepseek_router.cu",
        source: include_str!("../../../kernels/deepseek_router.cu"),
        entries: &["deepseek_route", "deepseek_no_route"],
    },
    KernelSource {
        file: "quant.cu",
        source: include_str!("../../../kernels/quant.cu"),
        entries: &["dequant_f32", "embed_quant"],
    },
    KernelSource {
        file: "activations_q8.cu",
        source: include_str!("../../../kernels/activations_q8.cu"),
        entries: &["q8_roundtrip", "q8_quantize"],
    },
];

/// Compiles every kernel file to PTX for `arch` (e.g. `"sm_80"`), in [`KERNELS`] order, on
/// all cores and without the on-disk cache ([`super::ptx_cache`] is the cached form).
/// Fails with [`CudaError::NvrtcMissing`] when NVRTC does not load, or with the first
/// file NVRTC rejects.
pub fn compile_all(arch: &'static str) -> Result<Vec<(&'static str, Ptx)>, CudaError> {
    if !libraries().nvrtc {
        return Err(CudaError::NvrtcMissing);
    }
    let key = super::ptx_cache::PtxKey {
        arch,
        nvrtc: None,
        device: "",
        nvrtc_loads: true,
    };
    let (ptx, _) = super::ptx_cache::load_or_compile_all(None, key)?;
    Ok(KERNELS.iter().map(|k| k.file).zip(ptx).collect())
}

/// Device functions every kernel file may call (kernels/prelude.cuh: the stored weight
/// formats decoded to f32), put before each file's source when it is compiled, so the
/// files share one copy instead of each keeping its own.
pub const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");

/// The headers a kernel file may `#include "<name>"` (besides the prelude every file
/// gets), embedded like the files: [`full_source`] puts a header's text where it is
/// included, so NVRTC needs no include path and a moec binary no kernels folder.
pub const HEADERS: [(&str, &str); 7] = [
    (
        "moe_tiles.cuh",
        include_str!("../../../kernels/moe_tiles.cuh"),
    ),
    (
        "paged_attention.cuh",
        include_str!("../../../kernels/paged_attention.cuh"),
    ),
    (
        "q8_block.cuh",
        include_str!("../../../kernels/q8_block.cuh"),
    ),
    (
        "q8_units.cuh",
        include_str!("../../../kernels/q8_units.cuh"),
    ),
    ("router.cuh", include_str!("../../../kernels/router.cuh")),
    (
        "tensor_core.cuh",
        include_str!("../../../kernels/tensor_core.cuh"),
    ),
    (
        "warp_dot.cuh",
        include_str!("../../../kernels/warp_dot.cuh"),
    ),
];

/// What NVRTC compiles for `kernel`: [`PRELUDE`], then the file with each `#include` of a
/// [`HEADERS`] entry replaced by that header's text, lines numbered as in the file or
/// header they come from (`#line`), so NVRTC's messages point into them. Also the PTX
/// cache's key: a header's change recompiles every file that includes it.
pub fn full_source(kernel: &KernelSource) -> String {
    let mut out = format!("{PRELUDE}\n#line 1 \"{}\"\n", kernel.file);
    for (n, line) in kernel.source.lines().enumerate() {
        match included_header(line) {
            Some((name, text)) => {
                out.push_str(&format!("#line 1 \"{name}\"\n{text}\n"));
                out.push_str(&format!("#line {} \"{}\"\n", n + 2, kernel.file));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// The [`HEADERS`] entry a source line includes (`#include "name"`), if any.
fn included_header(line: &str) -> Option<(&'static str, &'static str)> {
    let name = line
        .trim()
        .strip_prefix("#include")?
        .trim()
        .strip_prefix('"')?
        .strip_suffix('"')?;
    HEADERS.iter().copied().find(|(header, _)| *header == name)
}

/// Compiles one source (after [`PRELUDE`]) to PTX for `arch`. Call only after NVRTC was
/// found to load (`detect::libraries().nvrtc`): cudarc panics on a call into a library it
/// cannot load. [`compile_all`] checks this first.
pub fn compile_kernel(kernel: &KernelSource, arch: &'static str) -> Result<Ptx, CudaError> {
    let options = CompileOptions {
        arch: Some(arch),
        name: Some(kernel.file.to_string()),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(full_source(kernel), options).map_err(|e| match e {
        CompileError::CompileError { nvrtc, log, .. } => CudaError::Compile {
            file: kernel.file,
            arch,
            status: format!("{nvrtc:?}"),
            log: log.to_string_lossy().trim_end().to_string(),
        },
        other => CudaError::Nvrtc {
            file: kernel.file,
            detail: format!("{other:?}"),
        },
    })
}

/// The names of the `extern "C" __global__` functions a CUDA source defines, in order.
pub fn entry_names(source: &str) -> Vec<&str> {
    const MARKER: &str = "extern \"C\" __global__";
    source
        .match_indices(MARKER)
        .filter_map(|(at, _)| {
            let rest = &source[at + MARKER.len()..];
            let before_paren = &rest[..rest.find('(')?];
            before_paren.split_whitespace().last()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(file: &str) -> &'static KernelSource {
        KERNELS
            .iter()
            .find(|k| k.file == file)
            .unwrap_or_else(|| panic!("{file} is not in KERNELS"))
    }

    /// The entries loaded from a file are exactly the `extern "C" __global__` functions its
    /// source defines (a renamed kernel would otherwise fail only at load time on a GPU).
    fn assert_entries_match(file: &str) {
        let k = kernel(file);
        assert_eq!(entry_names(k.source), k.entries, "kernels/{file}");
    }

    #[test]
    fn rms_norm_entries_match_the_source() {
        assert_entries_match("rms_norm.cu");
    }

    #[test]
    fn rope_entries_match_the_source() {
        assert_entries_match("rope.cu");
    }

    #[test]
    fn swiglu_entries_match_the_source() {
        assert_entries_match("swiglu.cu");
    }

    #[test]
    fn router_topk_entries_match_the_source() {
        assert_entries_match("router_topk.cu");
    }

    #[test]
    fn families_entries_match_the_source() {
        assert_entries_match("families.cu");
    }

    #[test]
    fn moe_grouped_entries_match_the_source() {
        assert_entries_match("moe_grouped.cu");
    }

    #[test]
    fn linear_gemv_entries_match_the_source() {
        assert_entries_match("linear_gemv.cu");
    }

    #[test]
    fn q8_products_entries_match_the_source() {
        assert_entries_match("q8_products.cu");
        assert_entries_match("q8_products_rows.cu");
    }

    #[test]
    fn quant_entries_match_the_source() {
        assert_entries_match("quant.cu");
    }

    #[test]
    fn decode_attention_entries_match_the_source() {
        assert_entries_match("decode_attention.cu");
    }

    #[test]
    fn prefill_attention_entries_match_the_source() {
        assert_entries_match("prefill_attention.cu");
    }

    /// Every file under `kernels/` is embedded, and no source holds a NUL byte (cudarc
    /// hands sources to NVRTC as C strings and would panic on one).
    #[test]
    fn every_kernel_file_is_embedded_and_c_string_safe() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = KERNELS.iter().map(|k| k.file.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
        assert!(KERNELS.iter().all(|k| !k.source.contains('\0')));
        assert!(!PRELUDE.contains('\0'));
        // Every header but the prelude (put before every file) is one a file may include.
        let mut headers: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".cuh") && name != "prelude.cuh")
            .collect();
        headers.sort();
        let embedded: Vec<&str> = HEADERS.iter().map(|(name, _)| *name).collect();
        assert_eq!(headers, embedded);
        assert!(HEADERS.iter().all(|(_, text)| !text.contains('\0')));
    }

    /// An included header's text stands where the file includes it, once, and the lines
    /// after it are numbered as in the file (NVRTC's messages point there).
    #[test]
    fn full_source_puts_included_headers_in_place() {
        let prefill = kernel("prefill_attention.cu");
        let full = full_source(prefill);
        let (_, header) = HEADERS
            .iter()
            .copied()
            .find(|(name, _)| *name == "paged_attention.cuh")
            .expect("paged_attention.cuh is a header");
        assert_eq!(full.matches(header).count(), 1);
        assert!(!full.contains("#include \"paged_attention.cuh\""));
        let include_line = prefill
            .source
            .lines()
            .position(|l| l.starts_with("#include"))
            .expect("prefill_attention.cu includes its header")
            + 1;
        assert!(full.contains(&format!(
            "#line {} \"prefill_attention.cu\"",
            include_line + 1
        )));
        assert_eq!(full_source(kernel("rope.cu")).matches("#line").count(), 1);
    }

    #[test]
    fn entry_names_reads_multi_line_signatures() {
        let source = "extern \"C\" __global__ void first(\n int n) {}\n__device__ void helper() {}\nextern \"C\" __global__ void second(float* x) {}";
        assert_eq!(entry_names(source), ["first", "second"]);
    }
}
