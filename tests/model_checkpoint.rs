//! Checkpoint loading: synthetic checkpoints round-trip through the Hub format (single
//! file and sharded, bf16/f16/f32), are deterministic, the packed layer image views give
//! the same numbers as the memory-mapped tensors, gpt-oss MXFP4 experts stay MXFP4 and
//! decode to exactly their bf16 values (repacked once, the Hub's bytes then released), and
//! every malformed case is an error naming the file and tensor.

use moec::math::isa::Kernels;
use moec::math::moe::expert_ffn;
use moec::math::projection::pre_attn;
use moec::math::rope::RopeTable;
use moec::math::views::LayerWeights;
use moec::model::vocab::RoutedRow;
use moec::model::{ModelCard, SegmentKind, WeightDtype};
use moec::oracle::{GenerateOptions, Oracle};
use moec::quant::{dequantize_blocks, QuantFormat};
use moec::weights::checkpoint::Checkpoint;
use moec::weights::checkpoint::CheckpointError;
use moec::weights::synth::{
    synthetic_layer_image, write_checkpoint, write_checkpoint_as, ExpertStorage, SynthOptions,
};
use safetensors::tensor::{Dtype, TensorView};
use std::path::{Path, PathBuf};

/// moec against llama.cpp on GGUF files llama.cpp made (skips, saying why, without them).
#[path = "gguf_common/mod.rs"]
mod gguf_common;
#[path = "model_checkpoint/gguf_parity.rs"]
mod gguf_parity;

/// A small Mixtral card (vocab 512) so rewriting checkpoints in tests is cheap.
fn small_card(family: &str) -> ModelCard {
    let mut card = ModelCard::load(family).unwrap();
    card.vocab = 512;
    card.layers = 2;
    card.name = format!("{family}-small");
    card
}

fn synth(dir: &Path, card: &ModelCard, opts: SynthOptions) -> PathBuf {
    let out = dir.join(format!(
        "{}-{:?}-{}",
        card.name, opts.dtype, opts.max_shard_bytes
    ));
    write_checkpoint(card, &out, &opts).unwrap();
    out
}

#[test]
fn synthetic_checkpoints_load_in_every_dtype_and_when_sharded() {
    let tmp = tempfile::tempdir().unwrap();
    let card = small_card("mixtral-tiny");
    let reference = synth(tmp.path(), &card, SynthOptions::default());
    let ref_ck = Checkpoint::open(&reference).unwrap();
    let ref_out = Oracle::new(&ref_ck)
        .unwrap()
        .generate(&[vec![1, 5, 9]], &GenerateOptions::greedy(6))
        .unwrap();
    for (dtype, shard) in [
        (WeightDtype::F32, u64::MAX),
        (WeightDtype::F16, u64::MAX),
        (WeightDtype::Bf16, 1 << 20),
    ] {
        let opts = SynthOptions {
            dtype,
            max_shard_bytes: shard,
            ..SynthOptions::default()
        };
        let dir = synth(tmp.path(), &card, opts);
        if shard < u64::MAX {
            assert!(dir.join("model.safetensors.index.json").is_file());
            let shards = std::fs::read_dir(&dir)
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .unwrap()
                        .file_name()
                        .to_string_lossy()
                        .starts_with("model-0000")
                })
                .count();
            assert!(shards >= 2, "{shards} shards");
        }
        let ck = Checkpoint::open_with_card(&dir, Some(&card)).unwrap();
        assert_eq!(ck.card().dtype, dtype);
        let out = Oracle::new(&ck)
            .unwrap()
            .generate(&[vec![1, 5, 9]], &GenerateOptions::greedy(6))
            .unwrap();
        if dtype == WeightDtype::Bf16 {
            // Same bytes, only split across files: identical results.
            assert_eq!(out, ref_out);
        } else {
            assert_eq!(out[0].token_ids.len(), 6);
        }
    }
}

#[test]
fn synthesis_is_deterministic_and_seeded() {
    let tmp = tempfile::tempdir().unwrap();
    let card = small_card("dbrx-tiny");
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let c = tmp.path().join("c");
    write_checkpoint(&card, &a, &SynthOptions::default()).unwrap();
    write_checkpoint(&card, &b, &SynthOptions::default()).unwrap();
    write_checkpoint(
        &card,
        &c,
        &SynthOptions {
            seed: 1,
            ..SynthOptions::default()
        },
    )
    .unwrap();
    let read = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
    // Nothing half-written is left next to the outputs.
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    assert!(
        write_checkpoint(&card, &a, &SynthOptions::default()).is_err(),
        "refuses to overwrite"
    );
}

/// The layer image (byte copies into the canonical layout) computes exactly what the
/// memory-mapped tensors compute, for both families.
#[test]
fn layer_image_views_compute_the_same_as_mapped_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    for family in [
        "mixtral-tiny",
        "dbrx-tiny",
        "qwen3-moe-tiny",
        "olmoe-tiny",
        "qwen2-moe-tiny",
        "gpt-oss-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
    ] {
        let card = small_card(family);
        let dir = synth(tmp.path(), &card, SynthOptions::default());
        let ck = Checkpoint::open(&dir).unwrap();
        let arch = ck.arch().clone();
        let (layout, image) = ck.layer_image(1).unwrap();
        assert_eq!(layout.image_bytes % 64, 0);
        let e3 = layout.expert_range(3);
        assert_eq!(e3.len() % 64, 0);
        assert!(layout.attention_range().end <= layout.router_range().start);
        assert!(layout.router_range().end <= layout.expert_range(0).start);
        let from_image = LayerWeights::from_image(image.as_bytes(), &layout).unwrap();
        let mapped = ck.layer_weights(1).unwrap();
        let d = arch.hidden;
        let n = 5;
        let x: Vec<f32> = (0..n * d)
            .map(|i| ((i * 17) % 23) as f32 / 11.0 - 1.0)
            .collect();
        let rope = RopeTable::new(arch.rope_theta, arch.attn.head_dim, 64);
        let positions: Vec<usize> = (0..n).collect();
        let run = |w: &LayerWeights<'_>| {
            let mut scratch = vec![0.0; n * d];
            let mut qkv = vec![0.0; n * arch.attn.qkv_width()];
            pre_attn(
                &arch,
                &w.dense,
                &rope,
                &x,
                &positions,
                &mut scratch,
                &mut qkv,
            )
            .unwrap();
            let mut moe = vec![0.0; n * arch.top_k * d];
            let rows = [
                RoutedRow {
                    row: 0,
                    slot: 1,
                    weight: 0.5,
                },
                RoutedRow {
                    row: 4,
                    slot: 0,
                    weight: 0.25,
                },
            ];
            expert_ffn(&arch, &w.experts[3], &x, &rows, &mut moe).unwrap();
            // The shared expert (Qwen2-MoE) is read from the image's dense part too.
            let mut shared = vec![0.0; n * d];
            if let Some(s) = &w.dense.shared {
                Kernels::process()
                    .shared_expert(&arch, s, &x, &mut shared)
                    .unwrap();
            }
            (qkv, moe, shared)
        };
        assert_eq!(run(&from_image), run(&mapped), "{family}");
        // Too short or misaligned buffers are errors, not panics.
        assert!(
            LayerWeights::from_image(&image.as_bytes()[..layout.image_bytes - 1], &layout).is_err()
        );
        let mut shifted = vec![0u8; layout.image_bytes + 1];
        shifted[1..].copy_from_slice(image.as_bytes());
        let shifted = &shifted[1..];
        if (shifted.as_ptr() as usize) % 2 == 1 {
            assert!(LayerWeights::from_image(shifted, &layout).is_err());
        }
    }
}

/// Rewrites `dir/model.safetensors` with the reference `safetensors` writer after `edit`.
fn rewrite(
    dir: &Path,
    edit: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(t) = edit(
            &name,
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        ) {
            kept.push((name, t));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = kept
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn broken(
    edit: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(
        tmp.path(),
        &small_card("mixtral-tiny"),
        SynthOptions::default(),
    );
    rewrite(&dir, edit);
    (tmp, dir)
}

fn load_err(dir: &Path) -> String {
    let ck = match Checkpoint::open(dir) {
        Ok(ck) => ck,
        Err(e) => return e.to_string(),
    };
    match Oracle::new(&ck) {
        Ok(_) => panic!("{} loaded although it is malformed", dir.display()),
        Err(e) => e.to_string(),
    }
}

const VICTIM: &str = "model.layers.1.block_sparse_moe.experts.5.w3.weight";

#[test]
fn missing_tensor_is_named() {
    let (_tmp, dir) = broken(|n, d, s, b| (n != VICTIM).then_some((d, s, b)));
    let msg = load_err(&dir);
    assert!(
        msg.contains("missing tensor") && msg.contains(VICTIM),
        "{msg}"
    );
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let (_tmp, dir) = broken(|n, d, s, b| {
        if n == VICTIM {
            let half = b.len() / 2;
            Some((d, vec![s[0] / 2, s[1]], b[..half].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    let msg = load_err(&dir);
    assert!(
        msg.contains(VICTIM) && msg.contains("[128, 128]") && msg.contains("[256, 128]"),
        "{msg}"
    );
    assert!(msg.contains("model.safetensors"), "names the file: {msg}");
}

#[test]
fn wrong_dtype_is_named() {
    let (_tmp, dir) = broken(|n, d, s, b| {
        if n == VICTIM {
            Some((Dtype::I16, s, b))
        } else {
            Some((d, s, b))
        }
    });
    let msg = load_err(&dir);
    assert!(msg.contains(VICTIM) && msg.contains("I16"), "{msg}");
}

#[test]
fn truncated_file_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(
        tmp.path(),
        &small_card("mixtral-tiny"),
        SynthOptions::default(),
    );
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let err = Checkpoint::open(&dir).unwrap_err();
    assert!(matches!(err, CheckpointError::Safetensors { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("truncated") && msg.contains("model.safetensors"),
        "{msg}"
    );
}

#[test]
fn bad_config_json_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(
        tmp.path(),
        &small_card("mixtral-tiny"),
        SynthOptions::default(),
    );
    std::fs::write(
        dir.join("config.json"),
        "{\"model_type\": \"mixtral\", \"hidden_size\": 64",
    )
    .unwrap();
    let msg = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("config.json") && msg.contains("not a valid config.json"),
        "{msg}"
    );
    std::fs::write(
        dir.join("config.json"),
        "{\"model_type\": \"mixtral\", \"hidden_size\": 64}",
    )
    .unwrap();
    let msg = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("missing field"), "{msg}");
}

/// Values that used to reach the kernels and panic there (issue 18): a zero sliding
/// window, a non-positive DBRX `clip_qkv`, a non-finite rope theta. Each is refused when
/// config.json is read, naming the field.
#[test]
fn config_values_the_kernels_cannot_take_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, key, value, field) in [
        ("mixtral-tiny", "sliding_window", "0", "sliding_window"),
        ("mixtral-tiny", "rope_theta", "-10000.0", "rope_theta"),
        ("dbrx-tiny", "clip_qkv", "-1.0", "clip_qkv"),
        ("dbrx-tiny", "clip_qkv", "0.0", "clip_qkv"),
    ] {
        let dir = synth(
            &tmp.path().join(format!("{family}-{key}-{value}")),
            &small_card(family),
            SynthOptions::default(),
        );
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let slot = if key == "clip_qkv" {
            &mut config["attn_config"][key]
        } else {
            &mut config[key]
        };
        // Written as text so the value reaches moec exactly as typed.
        *slot = serde_json::Value::String(String::new());
        let text = config
            .to_string()
            .replace(&format!("\"{key}\":\"\""), &format!("\"{key}\":{value}"));
        std::fs::write(&path, text).unwrap();
        let msg = Checkpoint::open(&dir).unwrap_err().to_string();
        // The field is named in the message itself, not only in the folder's name.
        let (file, said) = msg.split_once("config.json:").expect("names config.json");
        assert!(
            !file.is_empty() && said.contains(field),
            "{key} = {value}: {msg}"
        );
        println!("{key} = {value}: {msg}");
    }
}

#[test]
fn config_contradicting_the_card_names_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(
        tmp.path(),
        &small_card("mixtral-tiny"),
        SynthOptions::default(),
    );
    let msg = Checkpoint::open_with_card(&dir, Some(&ModelCard::load("mixtral-tiny").unwrap()))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("num_hidden_layers") && msg.contains("mixtral-tiny"),
        "{msg}"
    );
}

/// The in-memory synthetic layer image equals the image copied from the written files.
#[test]
fn synthetic_layer_image_matches_the_written_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    for family in [
        "mixtral-tiny",
        "dbrx-tiny",
        "qwen3-moe-tiny",
        "olmoe-tiny",
        "qwen2-moe-tiny",
        "gpt-oss-tiny",
        "deepseek-v2-tiny",
        "deepseek-v3-tiny",
    ] {
        let card = small_card(family);
        let dir = synth(tmp.path(), &card, SynthOptions::default());
        let ck = Checkpoint::open(&dir).unwrap();
        // Layer 0 of the DeepSeek cards is dense (norm + SwiGLU, no experts).
        for layer in [0, 1] {
            let (layout, image) = ck.layer_image(layer).unwrap();
            let (mem_layout, mem_image) =
                synthetic_layer_image(&card, layer, &SynthOptions::default());
            assert_eq!(layout, mem_layout);
            assert!(image.as_bytes() == mem_image.as_bytes(), "{family}");
        }
    }
}

/// DeepSeek's leading dense layer is read under its Hub names (`mlp.gate_proj`, `up_proj`,
/// `down_proj`, no router, no experts); a missing or misshapen one is named.
#[test]
fn dense_layer_tensors_are_read_by_their_hub_names_and_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let card = small_card("deepseek-v2-tiny");
    assert_eq!((card.dense_layers, card.dense_ffn), (1, 192));
    let dir = synth(tmp.path(), &card, SynthOptions::default());
    let ck = Checkpoint::open(&dir).unwrap();
    let names: Vec<&str> = ck.tensor_names().collect();
    for name in ["gate_proj", "up_proj", "down_proj"] {
        assert!(names.contains(&format!("model.layers.0.mlp.{name}.weight").as_str()));
        assert!(!names.contains(&format!("model.layers.1.mlp.{name}.weight").as_str()));
    }
    assert!(!names
        .iter()
        .any(|n| n.starts_with("model.layers.0.mlp.experts")
            || n.starts_with("model.layers.0.mlp.gate.")
            || n.starts_with("model.layers.0.mlp.shared_experts")));
    let weights = ck.layer_weights(0).unwrap();
    assert!(weights.experts.is_empty());
    let ffn = weights.dense.shared.expect("the dense SwiGLU").ffn;
    assert_eq!((ffn.gate.out_dim(), ffn.down.out_dim()), (192, 128));
    drop(ck);
    let victim = "model.layers.0.mlp.up_proj.weight";
    rewrite(&dir, |n, d, s, b| {
        if n == victim {
            Some((d, vec![s[0] / 2, s[1]], b[..b.len() / 2].to_vec()))
        } else {
            Some((d, s, b))
        }
    });
    let msg = load_err(&dir);
    assert!(
        msg.contains(victim) && msg.contains("[192, 128]") && msg.contains("[96, 128]"),
        "{msg}"
    );
    let victim = "model.layers.0.mlp.down_proj.weight";
    let tmp = tempfile::tempdir().unwrap();
    let dir = synth(tmp.path(), &card, SynthOptions::default());
    rewrite(&dir, |n, d, s, b| (n != victim).then_some((d, s, b)));
    let msg = load_err(&dir);
    assert!(
        msg.contains("missing tensor") && msg.contains(victim),
        "{msg}"
    );
}

/// A checkpoint folder's own tokenizer.json wins over the card's embedded one.
#[test]
fn folder_tokenizer_wins_over_the_embedded_one() {
    use moec::weights::tokenizer::{TextTokenizer, DBRX_TOKENIZER_JSON};
    let tmp = tempfile::tempdir().unwrap();
    let card = small_card("mixtral-tiny");
    let dir = synth(tmp.path(), &card, SynthOptions::default());
    let embedded = TextTokenizer::load(&card, None).unwrap();
    let from_folder = TextTokenizer::load(&card, Some(&dir)).unwrap();
    assert!(
        from_folder.origin().ends_with("tokenizer.json")
            && !from_folder.origin().starts_with("embedded")
    );
    let text = "Tokenizers differ between families.";
    assert_eq!(
        embedded.encode(text).unwrap(),
        from_folder.encode(text).unwrap()
    );
    std::fs::write(dir.join("tokenizer.json"), DBRX_TOKENIZER_JSON).unwrap();
    let swapped = TextTokenizer::load(&card, Some(&dir)).unwrap();
    assert_ne!(
        embedded.encode(text).unwrap(),
        swapped.encode(text).unwrap()
    );
    // Mixtral prepends <s> = 1 exactly once.
    assert_eq!(embedded.encode(text).unwrap()[0], 1);
    assert_ne!(embedded.encode(text).unwrap()[1], 1);
}

/// A layout of another architecture is refused with an error, never a panic, both when
/// copying a layer into it and when viewing bytes through it.
#[test]
fn foreign_layouts_are_errors() {
    use moec::model::layout::ImageBuffer;
    use moec::model::{ArchSpec, LayerLayout};
    let tmp = tempfile::tempdir().unwrap();
    let card = small_card("mixtral-tiny");
    let dir = synth(tmp.path(), &card, SynthOptions::default());
    let ck = Checkpoint::open(&dir).unwrap();
    let mut other = card.clone();
    other.ffn = 64;
    let layout = LayerLayout::uniform(&ArchSpec::from_card(&other), WeightDtype::Bf16);
    let mut buf = ImageBuffer::zeroed(layout.image_bytes);
    let err = ck
        .copy_layer_image(0, &layout, buf.as_bytes_mut())
        .unwrap_err()
        .to_string();
    assert!(err.contains("experts.0.w1.weight"), "{err}");
    let (real_layout, image) = ck.layer_image(0).unwrap();
    let mut shrunk = real_layout.clone();
    shrunk.image_bytes = 64;
    assert!(LayerWeights::from_image(&image.as_bytes()[..64], &shrunk).is_err());
}

/// transformers' `_convert_moe_packed_tensors` (integrations/mxfp4.py) for one `_blocks` /
/// `_scales` pair, step by step as its Python does, as the independent reference for
/// moec's decoder: rows of 16 bytes, the low nibble at even and the high nibble at odd
/// positions through `FP4_VALUES`, `ldexp` by `scale - 127`, the `[experts, out, in]`
/// result transposed to `[experts, in, out]`, stored as bf16.
fn transformers_dequantize(blocks: &[u8], scales: &[u8], shape: &[usize]) -> Vec<u8> {
    const FP4_VALUES: [f64; 16] = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ];
    let [experts, outputs, groups, 16] = shape[..] else {
        panic!("blocks shape {shape:?}");
    };
    let inputs = groups * 32;
    let mut rows = vec![0f64; experts * outputs * inputs];
    for (r, row) in rows.chunks_exact_mut(32).enumerate() {
        let exp = i32::from(scales[r]) - 127;
        for b in 0..16 {
            let byte = blocks[r * 16 + b];
            row[2 * b] = FP4_VALUES[usize::from(byte & 0x0f)] * 2f64.powi(exp);
            row[2 * b + 1] = FP4_VALUES[usize::from(byte >> 4)] * 2f64.powi(exp);
        }
    }
    let mut out = Vec::with_capacity(rows.len() * 2);
    for e in 0..experts {
        for i in 0..inputs {
            for o in 0..outputs {
                let v = rows[(e * outputs + o) * inputs + i];
                out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes());
            }
        }
    }
    out
}

/// A gpt-oss checkpoint with MXFP4 experts (`moec synth --mxfp4`) and its twin storing the
/// same experts as their exact bf16 values (decoded by the reference above). The MXFP4
/// experts stay packed: the layer image holds ggml block rows `[out, in]` (0.53 bytes a
/// weight) that decode to exactly the twin's bf16 values, transposed. Multiplied decoded
/// (`MOEC_QUANT_PRODUCT=decoded`) they give the twin's tokens and logprobs within 2e-5:
/// every weight is an e2m1 code times a power of two, exact in bf16 and f32 alike, and the
/// activations stay f32 in both, so only the order of the f32 sums differs (the bf16 twin
/// runs the in-out body, the blocks the out-in panel); the bf16 rounding the decoded path
/// skips is nil for these values. The default product (8-bit activations) is held to
/// llama.cpp's on the same weights by the GGUF tests.
#[test]
fn mxfp4_experts_stay_packed_and_decode_to_their_bf16_values() {
    let tmp = tempfile::tempdir().unwrap();
    let card = small_card("gpt-oss-tiny");
    let packed = tmp.path().join("mxfp4");
    write_checkpoint_as(
        &card,
        &packed,
        &SynthOptions::default(),
        ExpertStorage::Mxfp4,
    )
    .unwrap();
    let dense = tmp.path().join("bf16");
    std::fs::create_dir(&dense).unwrap();
    std::fs::copy(packed.join("tokenizer.json"), dense.join("tokenizer.json")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(packed.join("config.json")).unwrap()).unwrap();
    let quant = config
        .as_object_mut()
        .unwrap()
        .remove("quantization_config")
        .unwrap();
    assert_eq!(quant["quant_method"], "mxfp4");
    std::fs::write(dense.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(packed.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut pairs = 0;
    for (name, view) in st.tensors() {
        if name.ends_with("_scales") {
            continue;
        }
        let Some(base) = name.strip_suffix("_blocks") else {
            tensors.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
            continue;
        };
        pairs += 1;
        let scales = st.tensor(&format!("{base}_scales")).unwrap();
        assert_eq!((view.dtype(), scales.dtype()), (Dtype::U8, Dtype::U8));
        let s = view.shape();
        let shape = vec![s[0], s[2] * 32, s[1]];
        let values = transformers_dequantize(view.data(), scales.data(), s);
        tensors.push((base.to_string(), Dtype::BF16, shape, values));
    }
    assert_eq!(
        pairs,
        2 * card.layers as usize,
        "gate_up and down per layer"
    );
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dense.join("model.safetensors")).unwrap();

    let packed_ck = Checkpoint::open(&packed).unwrap();
    let dense_ck = Checkpoint::open(&dense).unwrap();
    assert!(packed_ck.card().description.contains("kept MXFP4"));
    assert!(packed_ck.storage_note().unwrap().contains("kept MXFP4"));
    assert!(dense_ck.storage_note().is_none());
    let prompts = vec![vec![1, 20, 300, 40, 5], vec![1, 7]];
    let opts = GenerateOptions {
        stop_at_eos: false,
        ..GenerateOptions::greedy(8)
    };
    let kernels = Kernels::process();
    let from_packed = Oracle::new(&packed_ck)
        .unwrap()
        .with_kernels(kernels.quant_decoded())
        .generate(&prompts, &opts)
        .unwrap();
    let from_dense = Oracle::new(&dense_ck)
        .unwrap()
        .with_kernels(kernels)
        .generate(&prompts, &opts)
        .unwrap();
    let mut worst = 0f32;
    for (p, d) in from_packed.iter().zip(&from_dense) {
        assert_eq!(p.token_ids, d.token_ids);
        for (a, b) in p.logprobs.iter().zip(&d.logprobs) {
            worst = worst.max((a - b).abs());
        }
    }
    println!("packed (decoded product) vs bf16 twin: max |logprob diff| {worst:.2e}");
    assert!(worst <= 2e-5, "{worst}");
    // Not a degenerate model: greedy decoding moves between tokens.
    let distinct: std::collections::BTreeSet<_> = from_packed[0].token_ids.iter().collect();
    assert!(distinct.len() > 2, "{:?}", from_packed[0].token_ids);

    let (d, f) = (card.hidden as usize, card.ffn as usize);
    let bf16_at = |bytes: &[u8], i: usize| {
        half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
    };
    for layer in 0..card.layers as usize {
        let (layout, image) = packed_ck.layer_image(layer).unwrap();
        let (dense_layout, dense_image) = dense_ck.layer_image(layer).unwrap();
        for (kind, rows, cols) in [
            (SegmentKind::ExpertGateUp(1), 2 * f, d),
            (SegmentKind::ExpertDown(2), d, f),
        ] {
            let seg = layout.segment(kind).unwrap();
            let twin = dense_layout.segment(kind).unwrap();
            assert_eq!(seg.quant, Some(QuantFormat::Mxfp4));
            assert_eq!((seg.rows, seg.cols), (rows, cols));
            assert_eq!((twin.rows, twin.cols), (cols, rows));
            assert_eq!(seg.len_bytes, rows * cols / 32 * 17, "MXFP4's bytes");
            let mut values = vec![0f32; rows * cols];
            dequantize_blocks(
                QuantFormat::Mxfp4,
                &image.as_bytes()[seg.range()],
                &mut values,
            )
            .unwrap();
            let twin_bytes = &dense_image.as_bytes()[twin.range()];
            for r in 0..rows {
                for c in 0..cols {
                    let want = bf16_at(twin_bytes, c * rows + r);
                    assert_eq!(
                        values[r * cols + c],
                        want,
                        "layer {layer} {kind:?} [{r}, {c}]"
                    );
                }
            }
        }
        // Everything but the experts is the same bytes in both.
        let dense_part = layout.dense_range();
        assert_eq!(dense_part, dense_layout.dense_range());
        assert!(image.as_bytes()[dense_part.clone()] == dense_image.as_bytes()[dense_part]);
        assert!(layout.image_bytes < dense_layout.image_bytes);
    }
}

/// Resident bytes (`Rss`) of this process's mappings of `file`, from /proc/self/smaps.
fn resident_bytes_of_mapping(file: &Path) -> u64 {
    let file = file.canonicalize().unwrap();
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            inside = line.ends_with(file.to_str().unwrap());
        } else if inside && first == "Rss:" {
            kib += line
                .split_whitespace()
                .nth(1)
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    kib * 1024
}

/// Repacked MXFP4 experts live once: every reader (the oracle's typed views, the layer
/// image's segment bytes) gets the one copy of ggml block rows, and once repacked the
/// Hub's blocks and scales are no longer resident in the process. Widths of 512 make the packed
/// tensors (13 MB) far larger than what may legitimately stay mapped: the header, the
/// partial pages at each tensor's ends and the kernel's fault-around (up to 64 KiB around
/// each fault) into the neighbouring tensors.
#[test]
fn repacked_mxfp4_experts_are_held_once_and_the_hub_bytes_released() {
    let tmp = tempfile::tempdir().unwrap();
    let mut card = small_card("gpt-oss-tiny");
    (card.hidden, card.ffn) = (512, 512);
    let dir = tmp.path().join("mxfp4");
    write_checkpoint_as(&card, &dir, &SynthOptions::default(), ExpertStorage::Mxfp4).unwrap();
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let packed: u64 = st
        .tensors()
        .iter()
        .filter(|(name, _)| name.ends_with("_blocks") || name.ends_with("_scales"))
        .map(|(_, view)| view.data().len() as u64)
        .sum();
    drop(st);
    drop(bytes);

    let ck = Checkpoint::open(&dir).unwrap();
    let layers = card.layers as usize;
    assert_eq!(
        ck.decoded_bytes(),
        card.layers * card.experts * 3 * card.hidden * card.ffn / 32 * 17
    );
    assert!(ck.segment_is_decoded(0, SegmentKind::ExpertGateUp(3)));
    assert!(ck.segment_is_decoded(1, SegmentKind::ExpertDown(0)));
    assert!(!ck.segment_is_decoded(0, SegmentKind::OProj));
    assert!(!ck.segment_is_decoded(0, SegmentKind::ExpertGateUpBias(0)));

    // The typed views repack every expert tensor (each from all of its blocks and scales).
    for layer in 0..layers {
        let layout = ck.layer_layout(layer).unwrap();
        let weights = ck.layer_weights(layer).unwrap();
        for expert in [0, card.experts as usize - 1] {
            let seg = layout.segment(SegmentKind::ExpertDown(expert)).unwrap();
            let image_bytes = ck.segment_bytes(layer, seg).unwrap();
            let moec::math::tensor::TypedSlice::Quant(typed) = weights.experts[expert].down.data
            else {
                panic!("MXFP4 experts stay quantised");
            };
            assert_eq!(typed.format, QuantFormat::Mxfp4);
            assert_eq!(image_bytes.as_ptr(), typed.bytes.as_ptr(), "one repacking");
        }
    }
    let resident = resident_bytes_of_mapping(&file);
    assert!(
        resident < packed / 4,
        "{resident} bytes of the checkpoint resident after repacking {packed} bytes of MXFP4 \
         blocks and scales"
    );
}

/// An MXFP4 checkpoint whose blocks or scales are missing, not U8, or misshapen is an
/// error naming the tensor, at open.
#[test]
fn malformed_mxfp4_experts_are_named() {
    const SCALES: &str = "model.layers.1.mlp.experts.down_proj_scales";
    const BLOCKS: &str = "model.layers.0.mlp.experts.gate_up_proj_blocks";
    type Edit = fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>;
    let cases: [(Edit, &str, &str); 3] = [
        (
            |n, d, s, b| (n != BLOCKS).then_some((d, s, b)),
            BLOCKS,
            "missing tensor",
        ),
        (
            |n, d, s, b| Some((if n == SCALES { Dtype::I8 } else { d }, s, b)),
            SCALES,
            "expected U8",
        ),
        (
            |n, d, mut s, b| {
                if n == SCALES {
                    s.swap(1, 2);
                }
                Some((d, s, b))
            },
            SCALES,
            "shape",
        ),
    ];
    let card = small_card("gpt-oss-tiny");
    for (edit, tensor, what) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ck");
        write_checkpoint_as(&card, &dir, &SynthOptions::default(), ExpertStorage::Mxfp4).unwrap();
        rewrite(&dir, edit);
        let msg = load_err(&dir);
        assert!(msg.contains(tensor) && msg.contains(what), "{msg}");
    }
    // MXFP4 is for gpt-oss experts only.
    let tmp = tempfile::tempdir().unwrap();
    let err = write_checkpoint_as(
        &small_card("mixtral-tiny"),
        &tmp.path().join("m"),
        &SynthOptions::default(),
        ExpertStorage::Mxfp4,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("gpt-oss"), "{err}");
}

// ---- GGUF import of the other families, split files (helper gguf-families, issue 29) ----

/// llama.cpp's first-step logits on `file`, as the harness wrote them.
fn llama_first_logits(path: &Path) -> Option<Vec<f32>> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(
        v["first_logits"]
            .as_array()?
            .iter()
            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
            .collect(),
    )
}

/// How far `ours` is from `theirs` (max |difference|, and their spread).
fn logit_distance(ours: &[f32], theirs: &[f32]) -> (f32, f32) {
    let max_diff = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let spread = theirs.iter().fold(f32::MIN, |a, &b| a.max(b))
        - theirs.iter().fold(f32::MAX, |a, &b| a.min(b));
    (max_diff, spread)
}

/// moec on llama.cpp's own Qwen3-MoE, DeepSeek-V2, Qwen2-MoE, OLMoE, gpt-oss and DBRX GGUFs
/// (`convert_hf_to_gguf.py` and `llama-quantize` on moec's synthetic checkpoints of
/// `tests/fixtures/gguf/{qwen3-moe,deepseek-v2,qwen2-moe,olmoe}-q4-tiny.ron`; f32, Q8_0 and
/// Q4_K_M, which mixes Q4_K, Q5_K, Q6_K and Q8_0 tensors; gpt-oss from
/// `gpt-oss-q4-tiny.ron`: f32 from its bf16 checkpoint, and from its MXFP4 one (`--mxfp4`,
/// as the Hub ships gpt-oss) the converter's own MXFP4 experts beside f32 (`MXFP4`) or
/// Q8_0 (`Q8_0`) other weights; DBRX from `dbrx-q4-tiny.ron`, whose converter transposes
/// each expert's `w2`, and whose `ffn` differs from `hidden` so a down projection read in
/// the Hub's in-out orientation fails on shape), against llama.cpp as
/// `gguf_parity` compares Mixtral: llama.cpp run with f32 attention
/// (`LLAMA_GREEDY_ATTN=f32`, moec's arithmetic; `tests/fixtures/gguf/llama_attn_f32_families.json`,
/// written by `scripts/gguf_parity_golden.sh`) must give the same greedy tokens for at least
/// 95% of positions (issue 29's bar) and first-step logits within [`ATTN_F32_BOUND`]; its
/// default run (f16 flash attention) must be within its own spread from that run plus the
/// same bound (the triangle inequality). A wrong mapping (an unpermuted or swapped head,
/// `attn_k_b`/`attn_v_b` read with the wrong rows per head, a wrong expert block) or a wrong
/// block decoder
/// moves logits by whole units. Agreement with llama.cpp's default run and with its run on
/// its own f32 dequantisation (`greedy_dequantized`) is printed: the 8-bit activations of
/// the quantised product alone move the dequantised run 4.16 from the quantised one on the
/// Qwen3-MoE Q4_K_M file.
///
/// Without the fixtures the test says why and passes.
#[test]
fn gguf_families_greedy_tokens_match_llama_cpp() {
    let Some(dir) = gguf_common::family_fixtures() else {
        eprintln!(
            "gguf_families: skipped: no family GGUF fixtures (run scripts/gguf_fixtures.sh, or \
             set MOEC_GGUF_FAMILY_FIXTURES)"
        );
        return;
    };
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf/llama_greedy_families.json")).unwrap();
    let attn: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf/llama_attn_f32_families.json")).unwrap();
    let attn = &attn["families"];
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut failures = Vec::new();
    let k_quants = ["f32", "Q8_0", "Q4_K_M"];
    let families = [
        ("qwen3-moe", k_quants),
        ("deepseek-v2", k_quants),
        ("qwen2-moe", k_quants),
        ("olmoe", k_quants),
        ("gpt-oss", ["f32", "Q8_0", "MXFP4"]),
        ("dbrx", k_quants),
    ];
    for (fam, types) in families {
        // Fixture folders made before gpt-oss (or DBRX) joined `scripts/gguf_fixtures.sh` lack its files.
        if !dir.join(format!("{fam}-q4-{}.gguf", types[0])).is_file() {
            eprintln!(
                "gguf_families: {fam} skipped: no {fam} fixtures in {}",
                dir.display()
            );
            continue;
        }
        let prompt = ids(&golden[fam]["prompt_ids"]);
        for ty in types {
            let ck = Checkpoint::open_gguf(&dir.join(format!("{fam}-q4-{ty}.gguf")), None).unwrap();
            let mut opts = GenerateOptions::greedy(16);
            opts.stop_at_eos = false;
            let got = Oracle::new(&ck)
                .unwrap()
                .generate(std::slice::from_ref(&prompt), &opts)
                .unwrap();
            let (tokens, logits) = (&got[0].token_ids, &got[0].prompt_logits);
            // Printed, not asserted: llama.cpp's default run (f16 flash attention) and its
            // run on its own f32 dequantisation.
            let mut shown = vec![(
                "llama.cpp (default attention)",
                ids(&golden[fam]["greedy"][ty]),
                format!("llama-{fam}-{ty}.json"),
            )];
            if ty != "f32" {
                shown.push((
                    "llama.cpp on its f32 dequantisation",
                    ids(&golden[fam]["greedy_dequantized"][ty]),
                    format!("llama-{fam}-{ty}-deq.json"),
                ));
            }
            for (name, want, logits_file) in shown {
                let agree = tokens.iter().zip(&want).filter(|(a, b)| a == b).count();
                let distance = llama_first_logits(&dir.join(&logits_file))
                    .map(|theirs| logit_distance(logits, &theirs));
                eprintln!(
                    "gguf_families: {fam} {ty} vs {name}: {agree} of {} greedy tokens equal; \
                     first-step logits (max |diff|, their spread): {distance:?}",
                    want.len()
                );
            }
            // Asserted: llama.cpp with f32 attention, moec's arithmetic.
            let g = &attn[fam][ty];
            let want = ids(&g["tokens_attn_f32"]);
            let agree = tokens.iter().zip(&want).filter(|(a, b)| a == b).count();
            let at = |key: &str| -> f32 {
                g["ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .zip(g[key].as_array().unwrap())
                    .map(|(i, v)| {
                        (logits[i.as_u64().unwrap() as usize] - v.as_f64().unwrap() as f32).abs()
                    })
                    .fold(0.0, f32::max)
            };
            let (d_f32, d_default) = (at("logits_attn_f32"), at("logits_default"));
            let spread = g["spread"].as_f64().unwrap() as f32;
            let bound = ATTN_F32_BOUND;
            eprintln!(
                "gguf_families: {fam} {ty} vs llama.cpp with f32 attention: {agree} of {} greedy \
                 tokens equal; first-step logits {d_f32:.2e} apart (bound {bound:.0e}); {d_default:.4} \
                 from its default run (its own spread {spread:.4})",
                want.len()
            );
            if agree * 100 < 95 * want.len() {
                failures.push(format!(
                    "{fam} {ty} vs llama.cpp (f32 attention): {agree} of {} tokens agree\n  moec  \
                     {tokens:?}\n  llama {want:?}",
                    want.len()
                ));
            }
            if d_f32 > bound || d_default > spread + bound {
                failures.push(format!(
                    "{fam} {ty}: first-step logits {d_f32} from llama.cpp's f32-attention run \
                     (bound {bound}), {d_default} from its default run (bound {})",
                    spread + bound
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// How far moec's first-step logits may be from llama.cpp's f32-attention run of the same
/// file: both compute the same codes and integer block sums (8-bit activations against the
/// stored blocks, DeepSeek-V2's `attn_k_b`/`attn_v_b` included, which both multiply as
/// stored) and differ only in f32 rounding order, measured 4.8e-6 to 6.7e-6 here (as
/// `gguf_parity` measures on Mixtral); 1e-4 leaves room for another instruction set's order
/// while a wrong mapping or decoder moves logits by whole units.
const ATTN_F32_BOUND: f32 = 1e-4;

/// A GGUF that `llama-gguf-split --split` cut into parts opens from its first part and
/// reads exactly as the unsplit file llama.cpp made it from: the same card, every layer
/// image byte for byte, the same head tensors. A missing part is one error naming that
/// part's file.
#[test]
fn a_split_gguf_reads_as_the_whole_file() {
    let Some(dir) = gguf_common::family_fixtures() else {
        eprintln!("gguf_families: skipped: no family GGUF fixtures (run scripts/gguf_fixtures.sh)");
        return;
    };
    let parts: Vec<PathBuf> = {
        let mut p: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("qwen3-moe-q4-Q8_0-split-"))
            })
            .collect();
        p.sort();
        p
    };
    assert!(
        parts.len() >= 2,
        "the split fixture has {} parts",
        parts.len()
    );
    let whole = Checkpoint::open_gguf(&dir.join("qwen3-moe-q4-Q8_0.gguf"), None).unwrap();
    let split = Checkpoint::open_gguf(&parts[0], None).unwrap();
    let (a, b) = (whole.card(), split.card());
    assert_eq!(
        (a.layers, a.hidden, a.experts, a.vocab, &a.formats),
        (b.layers, b.hidden, b.experts, b.vocab, &b.formats)
    );
    for layer in 0..a.layers as usize {
        let (la, ia) = whole.layer_image(layer).unwrap();
        let (lb, ib) = split.layer_image(layer).unwrap();
        assert_eq!(la, lb, "layer {layer} layout");
        assert!(ia.as_bytes() == ib.as_bytes(), "layer {layer} image");
    }
    assert_eq!(whole.head_tensors().unwrap(), split.head_tensors().unwrap());
    // Without its last part.
    let tmp = tempfile::tempdir().unwrap();
    for p in &parts[..parts.len() - 1] {
        std::fs::copy(p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let first = tmp.path().join(parts[0].file_name().unwrap());
    let err = Checkpoint::open_gguf(&first, None).unwrap_err().to_string();
    let last = parts[parts.len() - 1]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(err.contains(&last) && err.contains("missing"), "{err}");
    // A later part given as the model.
    let err = Checkpoint::open_gguf(&parts[1], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not the first part"), "{err}");
}

/// A lone Qwen3-MoE `.gguf` brings its own tokenizer: `moec` builds it from the vocabulary
/// llama.cpp's converter wrote (`tokenizer.ggml.model` `gpt2`, `pre` `dbrx`, tokens,
/// merges, token types), and it encodes texts to the same ids as the Hugging Face
/// `tokenizer.json` the checkpoint was converted from (`models/tokenizers/dbrx/`, cl100k):
/// the fixture's parity prompt (whose ids `llama_greedy_families.json` holds, so llama.cpp
/// and moec start from the same ids), and texts that exercise the split expression
/// (contractions, digit runs, whitespace runs and newlines, accents, CJK, a special token).
#[test]
fn a_gguf_tokenizer_encodes_as_the_hugging_face_file_it_came_from() {
    let Some((ours, hf)) = cl100k_fixture_tokenizer("qwen3-moe", &["GGUF vocabulary"]) else {
        return;
    };
    encodes_as_the_hub_file(
        &ours,
        &hf,
        &[
            "The capital of France is",
            "I'm sure they'll say it's twelve or pi, won't they?",
            "Hello,   world!\n\n\tindented\r\n  two  spaces   ",
            "émigré café naïve — “quotes” 日本語のテキスト 😀",
            "<|endoftext|> after a special token",
            "def f(x):\n    return x**2  # square\n",
        ],
    );
    // Digit runs are where the file says otherwise: llama.cpp's converter labels cl100k
    // `stablelm2` (their hash texts encode alike), and llama.cpp splits `stablelm2` text with
    // Qwen2's expression, one digit per piece (`\p{N}`), where cl100k takes up to three
    // (`\p{N}{1,3}`). moec reads the file as llama.cpp does.
    assert_eq!(ours.encode("12345").unwrap(), vec![16, 17, 18, 19, 20]);
    assert_eq!(hf.encode("12345", true).unwrap().get_ids(), &[4513, 1774]);
}

/// A Mixtral `.gguf` made by llama.cpp's converter brings its SentencePiece (`llama`)
/// vocabulary, which moec reads instead of falling back to the card's file: it encodes the
/// parity prompt to the ids llama.cpp gave it (`llama_greedy.json`) and texts that exercise
/// byte fallback, whitespace runs and newlines to the Hub `tokenizer.json`'s ids. The
/// converter wrote this vocabulary from that `tokenizer.json` (scores all -1000), and the
/// run report says the merges are ranked by token id for that reason.
#[test]
fn a_mixtral_gguf_brings_its_sentencepiece_vocabulary() {
    let Some(dir) = gguf_common::fixtures() else {
        eprintln!("gguf: skipped: no Mixtral GGUF fixtures (run scripts/gguf_fixtures.sh)");
        return;
    };
    let path = dir.join("mixtral-q4-Q4_K_M.gguf");
    let ours = gguf_tokenizer(&path, &["SentencePiece", "by token id"]);
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf/llama_greedy.json")).unwrap();
    assert_eq!(
        ours.encode("The capital of France is").unwrap(),
        gguf_parity::ids(&golden["prompt_ids"])
    );
    let hub = tokenizers::Tokenizer::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/tokenizers/mixtral/tokenizer.json"
    ))
    .unwrap();
    encodes_as_the_hub_file(
        &ours,
        &hub,
        &[
            "Hello,   world!\n\n\tindented\r\n  two  spaces   ",
            "émigré café naïve — “quotes” 日本語のテキスト 😀",
            "def f(x):\n    return x**2  # square 1234567890\n",
        ],
    );
}

/// o200k (`tokenizer.ggml.pre` `gpt-4o`, gpt-oss's pre-tokenizer) splits text as
/// llama.cpp's does: over the tiny gpt-oss's cl100k vocabulary relabelled `gpt-4o`
/// (`scripts/o200k_golden.py`; no o200k vocabulary is at hand offline), moec's tokenizer gives
/// llama.cpp's own ids (`llama_tokenize`) for each of `fixtures/gguf/o200k_texts.json`'s
/// texts, and some of those texts (CamelCase, lower-to-upper runs like `iPhone`) tokenise
/// otherwise under cl100k's split, so they tell the two expressions apart.
#[test]
fn gguf_o200k_pre_tokenizer_splits_as_llama_cpp() {
    let Some(dir) = gguf_common::family_fixtures() else {
        eprintln!("skipped: no family GGUF fixtures (run scripts/gguf_fixtures.sh)");
        return;
    };
    let (vocab, golden) = (
        dir.join("gpt-oss-o200k-vocab.gguf"),
        dir.join("llama-o200k-tokens.json"),
    );
    if !vocab.is_file() || !golden.is_file() {
        eprintln!(
            "skipped: no o200k golden in {} (rerun scripts/gguf_fixtures.sh)",
            dir.display()
        );
        return;
    }
    let ck = Checkpoint::open_gguf(&dir.join("gpt-oss-q4-f32.gguf"), None).unwrap();
    let ours = moec::weights::tokenizer::TextTokenizer::load_gguf(ck.card(), &vocab).unwrap();
    assert!(
        ours.origin().contains("GGUF vocabulary"),
        "{}",
        ours.origin()
    );
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&golden).unwrap()).unwrap();
    let texts: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf/o200k_texts.json")).unwrap();
    assert_eq!(
        golden["texts"], texts["texts"],
        "rerun scripts/gguf_fixtures.sh"
    );
    let mut apart = 0;
    for (i, text) in texts["texts"].as_array().unwrap().iter().enumerate() {
        let text = text.as_str().unwrap();
        let want = gguf_parity::ids(&golden["gpt-4o"][i]);
        assert_eq!(ours.encode(text).unwrap(), want, "{text:?}");
        apart += usize::from(want != gguf_parity::ids(&golden["dbrx"][i]));
    }
    assert!(apart >= 3, "only {apart} texts tell o200k from cl100k");
}

/// llama.cpp's converter labels the cl100k vocabulary of a DBRX folder `granite-docling`
/// (the hash of its fixed text), and llama.cpp splits `granite-docling` text with GPT-2's
/// expression (`llama-vocab.cpp`; `unicode.cpp`'s GPT-2 splitter): moec reads the file so.
/// Where GPT-2's split and cl100k's agree (plain words and punctuation) the ids are the Hub
/// `tokenizer.json`'s; where they differ (GPT-2's contractions are lower-case only, so
/// `I'M` splits as `I`, `'`, `M` where cl100k keeps `'M`) they are the Hub file's ids of
/// GPT-2's pieces; and the ids llama.cpp's `llama_tokenize` gives on the file.
#[test]
fn a_dbrx_gguf_tokenizer_splits_as_llama_cpp_reads_its_label() {
    let Some((ours, hf)) =
        cl100k_fixture_tokenizer("dbrx", &["GGUF vocabulary", "granite-docling"])
    else {
        return;
    };
    encodes_as_the_hub_file(
        &ours,
        &hf,
        &[
            "The capital of France is",
            "Hello, world! Commas; and: colons.",
        ],
    );
    let pieces: Vec<u32> = ["I", "'", "M"]
        .iter()
        .flat_map(|p| hf.encode(*p, false).unwrap().get_ids().to_vec())
        .collect();
    assert_eq!(ours.encode("I'M").unwrap(), pieces);
    assert_ne!(hf.encode("I'M", false).unwrap().get_ids(), &pieces[..]);
    // llama.cpp's own `llama_tokenize` on this file (0.3.36, no BOS, no special parsing).
    for (text, ids) in [
        ("I'M", &[40u32, 6, 44][..]),
        ("12345", &[4513, 1774]),
        ("a  b   ", &[64, 220, 293, 262]),
    ] {
        assert_eq!(ours.encode(text).unwrap(), ids, "{text:?}");
    }
}

/// The tokenizer a `.gguf` brings, whose origin line names each of `origin`.
/// The GGUF tokenizer of `{family}-q4-Q4_K_M.gguf` (a family fixture converted from
/// `models/tokenizers/dbrx/`, cl100k; its origin line naming each of `origin`) and that Hub
/// file, once the fixture's parity prompt encodes to the ids `llama_greedy_families.json`
/// holds (so llama.cpp and moec start from the same ids); `None`, saying why, without the
/// fixture.
fn cl100k_fixture_tokenizer(
    family: &str,
    origin: &[&str],
) -> Option<(
    moec::weights::tokenizer::TextTokenizer,
    tokenizers::Tokenizer,
)> {
    let file = format!("{family}-q4-Q4_K_M.gguf");
    let Some(path) = gguf_common::family_fixtures()
        .map(|d| d.join(&file))
        .filter(|p| p.is_file())
    else {
        eprintln!("gguf_families: skipped: no {file} (run scripts/gguf_fixtures.sh)");
        return None;
    };
    let ours = gguf_tokenizer(&path, origin);
    let hf = tokenizers::Tokenizer::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/models/tokenizers/dbrx/tokenizer.json"
    ))
    .unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf/llama_greedy_families.json")).unwrap();
    assert_eq!(
        ours.encode("The capital of France is").unwrap(),
        gguf_parity::ids(&golden[family]["prompt_ids"])
    );
    Some((ours, hf))
}

fn gguf_tokenizer(
    path: &std::path::Path,
    origin: &[&str],
) -> moec::weights::tokenizer::TextTokenizer {
    let ck = Checkpoint::open_gguf(path, None).unwrap();
    let ours = moec::weights::tokenizer::TextTokenizer::load_gguf(ck.card(), path).unwrap();
    for part in origin {
        assert!(ours.origin().contains(part), "{}", ours.origin());
    }
    ours
}

/// Each of `texts` encodes (with the BOS the Hub file's post-processor adds, which
/// `TextTokenizer` adds from the card) to `hub`'s ids, and those ids decode to `hub`'s text.
fn encodes_as_the_hub_file(
    ours: &moec::weights::tokenizer::TextTokenizer,
    hub: &tokenizers::Tokenizer,
    texts: &[&str],
) {
    for text in texts {
        let want = hub.encode(*text, true).unwrap().get_ids().to_vec();
        assert_eq!(ours.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(
            ours.decode(&want).unwrap(),
            hub.decode(&want, true).unwrap(),
            "{text:?}"
        );
    }
}

/// llama.cpp's own DeepSeek-V3 GGUFs (`scripts/gguf_deepseek_v3.sh`: its converter and
/// `llama-quantize` on moec's synthetic checkpoint of
/// `tests/fixtures/gguf/deepseek-v3-q4-tiny.ron`: noaux_tc sigmoid routing with the
/// correction bias, routed scaling 2.5, renormalised top-k, MLA from split
/// `attn_k_b`/`attn_v_b`). The f32 file must give Hugging Face transformers' first-step
/// logits (f32 on the Hub folder, `deepseek_v3_references.json`) within [`ATTN_F32_BOUND`]
/// (the same f32 arithmetic in another order) and its 16 greedy tokens, which are also
/// llama.cpp's with f32 attention. The quantised files are printed against llama.cpp, not
/// asserted: on this model llama.cpp's own f32 run is 3.5e-3 from transformers (its V3
/// arithmetic; moec is 7.6e-6 from it), and the first token of its Q8_0 run is a near tie
/// (0.015 between its two best logits) that such a difference decides.
#[test]
fn a_deepseek_v3_gguf_computes_as_transformers() {
    let Some(dir) =
        gguf_common::family_fixtures().filter(|d| d.join("deepseek-v3-q4-f32.gguf").is_file())
    else {
        eprintln!("gguf_deepseek_v3: skipped: no DeepSeek-V3 GGUF fixtures (run scripts/gguf_deepseek_v3.sh)");
        return;
    };
    let refs: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gguf/deepseek_v3_references.json")).unwrap();
    let prompt = gguf_parity::ids(&refs["prompt_ids"]);
    for ty in ["f32", "Q8_0", "Q4_K_M"] {
        let ck =
            Checkpoint::open_gguf(&dir.join(format!("deepseek-v3-q4-{ty}.gguf")), None).unwrap();
        let mut opts = GenerateOptions::greedy(16);
        opts.stop_at_eos = false;
        let got = Oracle::new(&ck)
            .unwrap()
            .generate(std::slice::from_ref(&prompt), &opts)
            .unwrap();
        let (tokens, logits) = (&got[0].token_ids, &got[0].prompt_logits);
        let llama = gguf_parity::ids(&refs["llama_attn_f32"][ty]);
        let agree = tokens.iter().zip(&llama).filter(|(a, b)| a == b).count();
        eprintln!(
            "gguf_deepseek_v3: {ty}: {agree} of {} greedy tokens equal llama.cpp's (f32 attention)",
            llama.len()
        );
        if ty != "f32" {
            continue;
        }
        let hf = &refs["hf"];
        let worst = gguf_parity::ids(&hf["ids"])
            .iter()
            .zip(hf["logits"].as_array().unwrap())
            .map(|(&i, v)| (logits[i as usize] - v.as_f64().unwrap() as f32).abs())
            .fold(0.0, f32::max);
        eprintln!("gguf_deepseek_v3: f32: first-step logits {worst:.2e} from transformers");
        assert!(worst <= ATTN_F32_BOUND, "{worst} from transformers");
        assert_eq!(
            tokens,
            &gguf_parity::ids(&hf["tokens"]),
            "transformers' greedy tokens"
        );
        assert_eq!(tokens, &llama, "llama.cpp's greedy tokens (f32 attention)");
    }
}

// ---- `moec synth --gguf`: a card's synthetic weights straight into a GGUF (issue 42) ----

/// `moec synth --gguf` writes, tensor by tensor, the names, dims, types and offsets, and
/// the metadata, that `moec quantize` writes from the Hub checkpoint `moec synth` makes of
/// the same card, for the same types (Q4_K_M on Qwen3-MoE and DeepSeek-V2, whose mixes
/// mix Q4_K, Q6_K and Q8_0; MXFP4_MOE on gpt-oss; `--all q8_0` on OLMoE), with only the
/// weights' bytes differing; the same seed gives the same bytes. The file opens in moec
/// and greedy generation gives finite logits; OLMoE's tiny card, whose SentencePiece
/// stand-in tokenizer its family's byte-level converter cannot write, gets llama.cpp's
/// `llama` vocabulary. When `MOEC_LLAMA_BIN` names a folder holding llama.cpp's
/// `llama-batched-bench`, llama.cpp loads and runs each file too (else that part says
/// why it is skipped).
#[test]
fn synthetic_gguf_matches_moec_quantize_and_loads() {
    use moec::engine::{QuantizeFormats, QuantizeRequest, SynthGgufRequest, SynthRequest};
    use moec::weights::gguf::{GgufFile, Value};
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gguf/");
    let tmp = tempfile::tempdir().unwrap();
    let llama = std::env::var_os("MOEC_LLAMA_BIN").map(PathBuf::from);
    if llama.is_none() {
        eprintln!("synth_gguf: llama.cpp part skipped: MOEC_LLAMA_BIN is not set");
    }
    let cases = [
        (
            "qwen3-moe-q4-tiny.ron",
            QuantizeFormats::Mix("q4_k_m".into()),
        ),
        (
            "deepseek-v2-q4-tiny.ron",
            QuantizeFormats::Mix("q4_k_m".into()),
        ),
        (
            "gpt-oss-q4-tiny.ron",
            QuantizeFormats::Mix("mxfp4_moe".into()),
        ),
        ("olmoe-q4-tiny.ron", QuantizeFormats::All("q8_0".into())),
    ];
    let mut files = Vec::new();
    for (ron, formats) in cases {
        let card = format!("{fixtures}{ron}");
        let stem = ron.trim_end_matches(".ron");
        let gguf = |seed: u64, file: &str| {
            let out = tmp.path().join(file);
            moec::engine::synth_gguf(
                &SynthGgufRequest {
                    card: card.clone(),
                    out: out.clone(),
                    seed,
                    dtype: None,
                    formats: formats.clone(),
                    name: Some(stem.into()),
                },
                &mut |_, _, _| {},
            )
            .unwrap();
            out
        };
        let direct = gguf(5, &format!("{stem}-direct.gguf"));
        let hub = tmp.path().join(format!("{stem}-hf"));
        moec::engine::synth(&SynthRequest {
            card: card.clone(),
            out: hub.clone(),
            seed: 5,
            dtype: None,
            mxfp4: false,
        })
        .unwrap();
        let quantized = tmp.path().join(format!("{stem}-quantized.gguf"));
        moec::engine::quantize(
            &QuantizeRequest {
                weights: hub.clone(),
                out: quantized.clone(),
                formats: formats.clone(),
                name: Some(stem.into()),
            },
            &mut |_, _, _| {},
        )
        .unwrap();
        std::fs::remove_dir_all(&hub).unwrap();
        let (a, b) = (
            GgufFile::open(&direct).unwrap(),
            GgufFile::open(&quantized).unwrap(),
        );
        let table = |f: &GgufFile| -> Vec<(String, Vec<u64>, u32, std::ops::Range<usize>)> {
            let mut t: Vec<_> = f
                .tensors
                .values()
                .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type, t.range.clone()))
                .collect();
            t.sort_by_key(|x| x.3.start);
            t
        };
        assert_eq!(table(&a), table(&b), "{stem}: tensor table");
        assert_eq!(a.metadata, b.metadata, "{stem}: metadata");
        let types: std::collections::BTreeSet<u32> =
            a.tensors.values().map(|t| t.ggml_type).collect();
        eprintln!(
            "synth_gguf: {stem}: {} tensors of ggml types {types:?}, as moec quantize",
            a.tensors.len()
        );
        // Deterministic from the seed; another seed changes the weights.
        let again = gguf(5, &format!("{stem}-again.gguf"));
        assert!(
            std::fs::read(&again).unwrap() == std::fs::read(&direct).unwrap(),
            "{stem}: same seed"
        );
        std::fs::remove_file(&again).unwrap();
        std::fs::remove_file(&quantized).unwrap();
        files.push(direct);
    }
    // OLMoE's tiny card: the Mixtral SentencePiece stand-in, written as a `llama` vocabulary.
    let olmoe = tmp.path().join("olmoe-tiny.gguf");
    let written = moec::engine::synth_gguf(
        &SynthGgufRequest {
            card: "olmoe-tiny".into(),
            out: olmoe.clone(),
            seed: 0,
            dtype: None,
            formats: QuantizeFormats::All("q8_0".into()),
            name: None,
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    assert!(
        written.vocabulary.contains("`llama` vocabulary"),
        "{}",
        written.vocabulary
    );
    let f = GgufFile::open(&olmoe).unwrap();
    assert_eq!(
        f.metadata.get("tokenizer.ggml.model"),
        Some(&Value::Str("llama".into()))
    );
    files.push(olmoe);
    // DeepSeek-V2's tiny card under Q4_K_M: its rows are not whole 256-weight blocks, so
    // llama-quantize's fallbacks apply (Q4_K to Q5_0, Q6_K to Q8_0), as at real size for
    // DeepSeek-V2-Lite's experts (rows of 1408).
    let ds = tmp.path().join("deepseek-v2-tiny.gguf");
    moec::engine::synth_gguf(
        &SynthGgufRequest {
            card: "deepseek-v2-tiny".into(),
            out: ds.clone(),
            seed: 0,
            dtype: None,
            formats: QuantizeFormats::Mix("q4_k_m".into()),
            name: None,
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    let f = GgufFile::open(&ds).unwrap();
    let q5_0 = f.tensors.values().filter(|t| t.ggml_type == 6).count();
    assert!(
        q5_0 > 0 && f.tensors.values().any(|t| t.ggml_type == 8),
        "deepseek-v2-tiny Q4_K_M: {q5_0} Q5_0 tensors"
    );
    files.push(ds);
    for file in &files {
        let ck = Checkpoint::open_gguf(file, None).unwrap();
        let mut opts = GenerateOptions::greedy(4);
        opts.stop_at_eos = false;
        let got = Oracle::new(&ck)
            .unwrap()
            .generate(&[vec![1, 2, 3, 4]], &opts)
            .unwrap();
        assert!(
            got[0].prompt_logits.iter().all(|x| x.is_finite()),
            "{}: logits not finite",
            file.display()
        );
        let Some(bin) = &llama else { continue };
        let run = std::process::Command::new(bin.join("llama-batched-bench"))
            .args([
                "-c", "64", "-npp", "8", "-ntg", "2", "-npl", "1", "-t", "1", "-m",
            ])
            .arg(file)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "llama.cpp on {}: {}",
            file.display(),
            String::from_utf8_lossy(&run.stderr)
        );
        eprintln!("synth_gguf: llama.cpp loads and runs {}", file.display());
    }
}

/// A llama.cpp GGUF stores Llama-family `q`/`k` rows permuted; the loader puts them back
/// in the Hub's order into memory it holds for the whole run. The card says how much (the
/// file's own q and k tensor bytes, every layer), once restored the file's pages of them
/// are no longer resident (they would be counted twice in the process), and the host
/// budget of a schedule that copies the attention out of a checkpoint on disk counts them
/// on the checkpoint's line: nothing else reads `W` in place there, so that line is
/// exactly the restored rows. Widths of 1024 make q and k (1.4 MB a layer in Q8_0) far
/// larger than what may stay mapped around them (partial pages, fault-around).
#[test]
fn restored_gguf_rows_are_held_once_and_counted_in_the_host_budget() {
    use moec::compile::{compile, Options};
    use moec::cost::budget::{budget_table, BudgetOverrides};
    use moec::engine::{QuantizeFormats, SynthGgufRequest};
    use moec::weights::gguf::GgufFile;
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ron = std::fs::read_to_string(root.join("models/mixtral-tiny.ron"))
        .unwrap()
        .replace("hidden: 128,", "hidden: 1024,")
        .replace("heads: 4,", "heads: 8,")
        .replace("head_dim: 32,", "head_dim: 128,");
    let card_path = tmp.path().join("mixtral-wide.ron");
    std::fs::write(&card_path, ron).unwrap();
    let file = tmp.path().join("mixtral-wide.gguf");
    moec::engine::synth_gguf(
        &SynthGgufRequest {
            card: card_path.display().to_string(),
            out: file.clone(),
            seed: 0,
            dtype: None,
            formats: QuantizeFormats::All("q8_0".into()),
            name: None,
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    let qk: u64 = GgufFile::open(&file)
        .unwrap()
        .tensors
        .values()
        .filter(|t| t.name.ends_with("attn_q.weight") || t.name.ends_with("attn_k.weight"))
        .map(|t| t.range.len() as u64)
        .sum();
    let ck = Checkpoint::open_gguf(&file, None).unwrap();
    let card = ck.card().clone();
    assert_eq!(
        (
            card.hidden,
            card.held.attention * card.layers,
            card.held.experts
        ),
        (1024, qk, 0)
    );
    assert_eq!(
        qk,
        card.layers * (1024 + 256) * 1024 / 32 * 34,
        "q8_0 q and k"
    );
    let before = resident_bytes_of_mapping(&file);
    for layer in 0..card.layers as usize {
        ck.layer_weights(layer).unwrap();
    }
    let after = resident_bytes_of_mapping(&file);
    assert!(
        after < before + qk / 4,
        "{before} -> {after} bytes of the file resident after restoring {qk} bytes of q/k rows"
    );
    let source = std::fs::read_to_string(root.join("schedules/moe_infinity_disk.sched")).unwrap();
    let compiled = compile(&source, &Options::new(card)).unwrap_or_else(|d| panic!("{d:?}"));
    let table = budget_table(&compiled.program, None, &BudgetOverrides::default());
    let w = table
        .lines
        .iter()
        .find(|l| l.what.contains("checkpoint on disk"))
        .expect("the checkpoint's line");
    assert_eq!((w.space, w.bytes), ("host", qk), "{w:?}");
}
