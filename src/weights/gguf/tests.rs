//! The reader against hand-built files: well-formed ones, and every way a file can be
//! hostile (wrong magic, unknown version, truncation anywhere, absurd counts, unsupported
//! tensor types, metadata that contradicts the tensors), each one error, never a panic.

use super::*;
use crate::quant::QuantFormat;

/// A GGUF v3 file: `kvs` as (key, type id, value bytes), tensors as (name, dims, type,
/// data), data aligned to 32.
pub(crate) fn build(
    kvs: &[(&str, u32, Vec<u8>)],
    tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (key, ty, value) in kvs {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(ty.to_le_bytes());
        out.extend(value);
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        out.extend((name.len() as u64).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    for (_, _, _, data) in tensors {
        out.extend(data);
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
    }
    out
}

pub(crate) fn string_value(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend(s.as_bytes());
    v
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    GgufFile::open(&path)
}

fn sample() -> Vec<u8> {
    let q8 = crate::quant::random_blocks(QuantFormat::Q8_0, 2, 5);
    build(
        &[
            ("general.architecture", 8, string_value("llama")),
            ("llama.block_count", 4, 2u32.to_le_bytes().to_vec()),
            ("llama.rope.freq_base", 6, 10000f32.to_le_bytes().to_vec()),
        ],
        &[
            (
                "norm",
                vec![4],
                0,
                [1f32, 2., 3., 4.]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
            ),
            ("w", vec![32, 2], 8, q8),
        ],
    )
}

#[test]
fn reads_metadata_and_tensor_table() {
    let f = open_bytes(&sample()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(f.get_f64("llama.rope.freq_base").unwrap(), 10000.0);
    let (w, storage) = f.tensor("w", &[2, 32]).unwrap();
    assert_eq!(storage, Storage::Quant(QuantFormat::Q8_0));
    assert_eq!(w.range.len(), 68);
    let (norm, _) = f.tensor("norm", &[4]).unwrap();
    assert_eq!(&f.bytes()[norm.range.clone()][4..8], &2f32.to_le_bytes());
}

/// A Q5_0 tensor (type 6, 22 bytes per 32 weights; llama.cpp's Q4_K_M fallback) reads as
/// Q5_0 blocks, and its bytes decode.
#[test]
fn reads_q5_0_tensors() {
    let q5 = crate::quant::random_blocks(QuantFormat::Q5_0, 4, 9);
    let bytes = build(
        &[],
        &[("blk.0.ffn_down_exps.weight", vec![64, 2], 6, q5.clone())],
    );
    let f = open_bytes(&bytes).unwrap();
    let (w, storage) = f.tensor("blk.0.ffn_down_exps.weight", &[2, 64]).unwrap();
    assert_eq!(storage, Storage::Quant(QuantFormat::Q5_0));
    assert_eq!(&f.bytes()[w.range.clone()], &q5[..]);
    let mut x = vec![0f32; 128];
    crate::quant::dequantize_blocks(QuantFormat::Q5_0, &f.bytes()[w.range.clone()], &mut x)
        .unwrap();
    assert!(x.iter().all(|v| v.is_finite()));
}

#[test]
fn wrong_magic_and_version_are_named() {
    let mut bytes = sample();
    bytes[..4].copy_from_slice(b"GGML");
    let err = open_bytes(&bytes).unwrap_err().to_string();
    assert!(
        err.contains("not a GGUF file") && err.contains("GGML"),
        "{err}"
    );
    let mut bytes = sample();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let err = open_bytes(&bytes).unwrap_err().to_string();
    assert!(err.contains("GGUF version 1 is not supported"), "{err}");
}

/// Cut anywhere, the file is an error (truncation or a malformed header), never a panic;
/// cut inside the tensor data, it names the tensor.
#[test]
fn every_truncation_is_an_error() {
    let bytes = sample();
    for len in 0..bytes.len() - 28 {
        assert!(open_bytes(&bytes[..len]).is_err(), "cut at {len}");
    }
    let err = open_bytes(&bytes[..bytes.len() - 40])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("truncated GGUF file") && err.contains("tensor `w`"),
        "{err}"
    );
}

#[test]
fn absurd_counts_are_refused_before_allocating() {
    let mut bytes = sample();
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let err = open_bytes(&bytes).unwrap_err().to_string();
    assert!(err.contains("metadata count"), "{err}");
    let bytes = build(
        &[("tokens", 9, {
            let mut v = 8u32.to_le_bytes().to_vec();
            v.extend((1u64 << 40).to_le_bytes());
            v
        })],
        &[],
    );
    let err = open_bytes(&bytes).unwrap_err().to_string();
    assert!(err.contains("truncated") && err.contains("tokens"), "{err}");
}

#[test]
fn unsupported_types_and_contradicting_shapes_name_the_tensor() {
    let bytes = build(
        &[],
        // Q5_1 (type 7, 24 bytes per 32 weights): a format moec does not read.
        &[("blk.0.ffn_gate_exps.weight", vec![32, 1], 7, vec![0; 24])],
    );
    let f = open_bytes(&bytes).unwrap();
    let err = f
        .tensor("blk.0.ffn_gate_exps.weight", &[1, 32])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`blk.0.ffn_gate_exps.weight` is stored as Q5_1"),
        "{err}"
    );
    let f = open_bytes(&sample()).unwrap();
    let err = f.tensor("w", &[4, 32]).unwrap_err().to_string();
    assert!(
        err.contains("tensor `w`") && err.contains("[2, 32]"),
        "{err}"
    );
    assert!(f
        .tensor("absent", &[1])
        .unwrap_err()
        .to_string()
        .contains("missing"));
    let err = f.get_u64("general.architecture").unwrap_err().to_string();
    assert!(err.contains("not a non-negative integer"), "{err}");
}

#[test]
fn partial_quant_blocks_and_bad_value_types_are_malformed() {
    let bytes = build(&[], &[("w", vec![30, 1], 8, vec![0; 34])]);
    let err = open_bytes(&bytes).unwrap_err().to_string();
    assert!(err.contains("not whole Q8_0 blocks"), "{err}");
    let bytes = build(&[("k", 42, vec![0; 8])], &[]);
    let err = open_bytes(&bytes).unwrap_err().to_string();
    assert!(err.contains("unknown value type 42"), "{err}");
}

#[test]
fn unpermuting_restores_the_hub_row_order() {
    // One head of 4 rows (2 pairs) of 1 byte: the converter stores Hub rows 0, 2, 1, 3.
    assert_eq!(
        llama::unpermute_rows(&[0, 2, 1, 3], 1, 1),
        Some(vec![0, 1, 2, 3])
    );
    // Two heads, rows of 2 bytes.
    let stored = [0, 0, 2, 2, 1, 1, 3, 3, 4, 4, 6, 6, 5, 5, 7, 7];
    let hub: Vec<u8> = (0..8).flat_map(|r| [r, r]).collect();
    assert_eq!(llama::unpermute_rows(&stored, 2, 2), Some(hub));
    assert_eq!(llama::unpermute_rows(&[0, 1, 2], 1, 1), None);
}

/// A part of a split: `split.no`, `split.count` (u16, as llama-gguf-split writes them),
/// `split.tensors.count` on the first part, and one f32 tensor `name` holding `value`.
fn split_part(no: u16, count: u16, total: Option<i32>, name: &str, value: f32) -> Vec<u8> {
    let mut kvs = vec![
        ("split.no", 2, no.to_le_bytes().to_vec()),
        ("split.count", 2, count.to_le_bytes().to_vec()),
    ];
    if let Some(t) = total {
        kvs.push(("split.tensors.count", 5, t.to_le_bytes().to_vec()));
    }
    build(
        &kvs,
        &[(
            name,
            vec![4],
            0,
            [value; 4].iter().flat_map(|v| v.to_le_bytes()).collect(),
        )],
    )
}

#[test]
fn a_split_file_opens_from_its_first_part_with_every_part_s_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let p = |i: u16| dir.path().join(format!("m-{i:05}-of-00002.gguf"));
    std::fs::write(p(1), split_part(0, 2, Some(2), "a", 1.0)).unwrap();
    std::fs::write(p(2), split_part(1, 2, None, "b", 2.0)).unwrap();
    let f = GgufFile::open(&p(1)).unwrap();
    assert_eq!(f.part_count(), 2);
    let (a, _) = f.tensor("a", &[4]).unwrap();
    let (b, _) = f.tensor("b", &[4]).unwrap();
    assert_eq!((a.part, b.part), (0, 1));
    assert_eq!(&f.tensor_bytes(b)[..4], &2f32.to_le_bytes());
    assert_eq!(&f.tensor_bytes(a)[..4], &1f32.to_le_bytes());
    // A later part given as the model.
    let err = GgufFile::open(&p(2)).unwrap_err().to_string();
    assert!(err.contains("not the first part"), "{err}");
    // A part from another split (it says it is part 1).
    std::fs::write(p(2), split_part(0, 2, None, "b", 2.0)).unwrap();
    let err = GgufFile::open(&p(1)).unwrap_err().to_string();
    assert!(
        err.contains("m-00002-of-00002.gguf") && err.contains("says part 1 of 2"),
        "{err}"
    );
    // Fewer tensors than the first part promises.
    std::fs::write(p(2), split_part(1, 2, None, "b", 2.0)).unwrap();
    std::fs::write(p(1), split_part(0, 2, Some(3), "a", 1.0)).unwrap();
    let err = GgufFile::open(&p(1)).unwrap_err().to_string();
    assert!(
        err.contains("split.tensors.count") && err.contains("promises 3"),
        "{err}"
    );
    // A missing part, and a first part whose name does not give the others'.
    std::fs::remove_file(p(2)).unwrap();
    std::fs::write(p(1), split_part(0, 2, Some(2), "a", 1.0)).unwrap();
    let err = GgufFile::open(&p(1)).unwrap_err().to_string();
    assert!(
        err.contains("m-00002-of-00002.gguf") && err.contains("part 2 of 2: missing"),
        "{err}"
    );
    let odd = dir.path().join("renamed.gguf");
    std::fs::copy(p(1), &odd).unwrap();
    let err = GgufFile::open(&odd).unwrap_err().to_string();
    assert!(
        err.contains("does not end in `-00001-of-00002.gguf`"),
        "{err}"
    );
}

/// DeepSeek's `kv_b_proj` as llama.cpp's converter splits it, on numbered elements (the
/// converter's `view`, `split` and `transpose(1, 2)` done by hand): the `KB` segment reads
/// `attn_k_b` (ggml ne `[qk_nope, kv_lora, heads]`) as `[heads * kv_lora, qk_nope]`, whose
/// row `h * kv_lora + c` holds the Hub's `kv_b[h][0..qk_nope][c]` (head `h`'s `W_uk`
/// transposed), and `VB` reads `attn_v_b` (ne `[kv_lora, v, heads]`) as
/// `[heads * v, kv_lora]`, row `h * v + j` being the Hub's `kv_b[h][qk_nope + j]`. An older
/// converter's single `attn_kv_b` is the Hub tensor, decoded to f32 (`mla::kv_b`); a
/// missing one is an error naming it.
#[test]
fn mla_kv_b_halves_are_read_as_stored() {
    use crate::model::layout::LayerLayout;
    use crate::model::segment::SegmentKind;
    let (heads, rank, nope, v) = (2usize, 3usize, 2usize, 1usize);
    // Hub kv_b[h][r][c] = 100 h + 10 r + c.
    let hub = |h: usize, r: usize, c: usize| (100 * h + 10 * r + c) as f32;
    let mut k_b = Vec::new(); // [heads, rank, nope]
    let mut v_b = Vec::new(); // [heads, v, rank]
    for h in 0..heads {
        for c in 0..rank {
            for r in 0..nope {
                k_b.push(hub(h, r, c));
            }
        }
        for r in 0..v {
            for c in 0..rank {
                v_b.push(hub(h, nope + r, c));
            }
        }
    }
    let want: Vec<f32> = (0..heads)
        .flat_map(|h| (0..nope + v).flat_map(move |r| (0..rank).map(move |c| hub(h, r, c))))
        .collect();
    let f32s = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let bytes = build(
        &[],
        &[
            (
                "blk.1.attn_k_b.weight",
                vec![nope as u64, rank as u64, heads as u64],
                0,
                f32s(&k_b),
            ),
            (
                "blk.1.attn_v_b.weight",
                vec![rank as u64, v as u64, heads as u64],
                0,
                f32s(&v_b),
            ),
            (
                "blk.2.attn_kv_b.weight",
                vec![rank as u64, (heads * (nope + v)) as u64],
                0,
                f32s(&want),
            ),
        ],
    );
    let f = open_bytes(&bytes).unwrap();
    let mut card = crate::model::card::ModelCard::load("deepseek-v2-tiny").unwrap();
    card.heads = heads as u64;
    if let Some(m) = card.mla.as_mut() {
        (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim) = (rank as u64, nope as u64, v as u64);
        m.kv_b_split = true;
    }
    let arch = crate::model::arch::ArchSpec::from_card(&card);
    let read = |kind: SegmentKind| -> (Vec<usize>, Vec<f32>) {
        let Some(llama::Place::Stacked(name, shape)) = llama::place(&arch, 1, kind) else {
            panic!("{kind:?} is not a stacked GGUF tensor");
        };
        let (info, storage) = f.tensor(&name, &shape).unwrap();
        let elems = shape.iter().product();
        let values = mla::decode_f32(f.tensor_bytes(info), storage, elems).unwrap();
        let (rows, cols, _) = LayerLayout::shape_of(&arch, kind);
        assert_eq!(rows * cols, elems, "{kind:?}");
        (vec![rows, cols], values)
    };
    let (k_shape, k) = read(SegmentKind::KB);
    assert_eq!(k_shape, [heads * rank, nope]);
    let (v_shape, vb) = read(SegmentKind::VB);
    assert_eq!(v_shape, [heads * v, rank]);
    for h in 0..heads {
        for c in 0..rank {
            for r in 0..nope {
                assert_eq!(
                    k[(h * rank + c) * nope + r],
                    hub(h, r, c),
                    "k_b {h} {c} {r}"
                );
            }
        }
        for j in 0..v {
            for c in 0..rank {
                assert_eq!(
                    vb[(h * v + j) * rank + c],
                    hub(h, nope + j, c),
                    "v_b {h} {j}"
                );
            }
        }
    }
    assert_eq!(mla::kv_b(&f, &arch, 2).unwrap(), f32s(&want));
    let err = mla::kv_b(&f, &arch, 0).unwrap_err().to_string();
    assert!(
        err.contains("blk.0.attn_kv_b.weight") && err.contains("missing"),
        "{err}"
    );
}

/// A GGUF array value of `elem_type` (GGUF type id) holding `items` already encoded.
fn array_value(elem_type: u32, items: impl IntoIterator<Item = Vec<u8>>) -> Vec<u8> {
    let items: Vec<Vec<u8>> = items.into_iter().collect();
    let mut v = elem_type.to_le_bytes().to_vec();
    v.extend((items.len() as u64).to_le_bytes());
    v.extend(items.into_iter().flatten());
    v
}

/// Mixtral's vocabulary as a `llama` GGUF vocabulary (as `convert_hf_to_gguf.py` writes
/// one from `tokenizer.model`: NORMAL pieces scored by falling rank, or from
/// `tokenizer.json`: every score -1000) gives a tokenizer that encodes and decodes as the
/// Hub's `tokenizer.json` does: SentencePiece's best-score-first merges are the Hub file's
/// BPE ranks, byte fallback included.
#[test]
fn a_sentencepiece_vocabulary_encodes_as_the_hub_tokenizer() {
    let hub_json: serde_json::Value = serde_json::from_slice(include_bytes!(
        "../../../models/tokenizers/mixtral/tokenizer.json"
    ))
    .unwrap();
    let vocab = hub_json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    // llama.cpp's types: 2 unknown, 3 control, 6 byte, 1 normal.
    let types: Vec<i32> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| match id {
            0 => 2,
            1 | 2 => 3,
            _ if t.starts_with("<0x") && t.len() == 6 => 6,
            _ => 1,
        })
        .collect();
    let hub = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&hub_json).unwrap()).unwrap();
    let ranked: Vec<f32> = types
        .iter()
        .enumerate()
        .map(|(id, &ty)| if ty == 1 { -(id as f32) } else { 0.0 })
        .collect();
    for scores in [ranked, vec![-1000.0; tokens.len()]] {
        let bytes = build(
            &[
                ("general.architecture", 8, string_value("llama")),
                ("tokenizer.ggml.model", 8, string_value("llama")),
                (
                    "tokenizer.ggml.tokens",
                    9,
                    array_value(8, tokens.iter().map(|t| string_value(t))),
                ),
                (
                    "tokenizer.ggml.scores",
                    9,
                    array_value(6, scores.iter().map(|s| s.to_le_bytes().to_vec())),
                ),
                (
                    "tokenizer.ggml.token_type",
                    9,
                    array_value(5, types.iter().map(|t| t.to_le_bytes().to_vec())),
                ),
                (
                    "tokenizer.ggml.unknown_token_id",
                    4,
                    0u32.to_le_bytes().to_vec(),
                ),
            ],
            &[],
        );
        let file = open_bytes(&bytes).unwrap();
        let (json, description) = vocab::tokenizer_json(&file).unwrap().unwrap();
        assert!(description.contains("SentencePiece"), "{description}");
        let ours = tokenizers::Tokenizer::from_bytes(&json).unwrap();
        for text in [
            "The capital of France is",
            "I'm sure they'll say it's twelve or pi, won't they?",
            "Hello,   world!\n\n\tindented\r\n  two  spaces   ",
            "émigré café naïve — “quotes” 日本語のテキスト 😀 ꙮ",
            "def f(x):\n    return x**2  # square 1234567890\n",
            " leading space and trailing ",
        ] {
            let want = hub.encode(text, false).unwrap().get_ids().to_vec();
            let got = ours.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(got, want, "{text:?} ({description})");
            assert_eq!(
                ours.decode(&want, true).unwrap(),
                hub.decode(&want, true).unwrap(),
                "{text:?}"
            );
        }
    }
}

/// gpt-oss's `gate_up_proj` put back together from the converter's halves: its
/// `GptOssModel.modify_tensors` / `generate_extra_tensors` write Hub row `2i` (gate) to
/// `ffn_gate_exps` row `i` and row `2i + 1` (up) to `ffn_up_exps` row `i`, per expert, and
/// the bias values alike; reading interleaves them back, whole MXFP4 rows moved as stored.
/// Halves in different formats are refused naming the tensor.
#[test]
fn gpt_oss_gate_and_up_halves_interleave_back_into_the_hub_rows() {
    let (experts, f, d) = (2usize, 3usize, 64usize);
    let row = QuantFormat::Mxfp4.bytes_for(d).unwrap();
    let gate = crate::quant::random_blocks(QuantFormat::Mxfp4, experts * f * d / 32, 7);
    let up = crate::quant::random_blocks(QuantFormat::Mxfp4, experts * f * d / 32, 8);
    let f32s = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let gate_bias: Vec<f32> = (0..experts * f).map(|i| i as f32).collect();
    let up_bias: Vec<f32> = (0..experts * f).map(|i| -(i as f32) - 0.5).collect();
    let dims = vec![d as u64, f as u64, experts as u64];
    let bias_dims = vec![f as u64, experts as u64];
    let bytes = build(
        &[],
        &[
            ("blk.0.ffn_gate_exps.weight", dims.clone(), 39, gate.clone()),
            ("blk.0.ffn_up_exps.weight", dims.clone(), 39, up.clone()),
            (
                "blk.0.ffn_gate_exps.bias",
                bias_dims.clone(),
                0,
                f32s(&gate_bias),
            ),
            (
                "blk.0.ffn_up_exps.bias",
                bias_dims.clone(),
                0,
                f32s(&up_bias),
            ),
            ("blk.1.ffn_gate_exps.weight", dims.clone(), 39, gate.clone()),
            (
                "blk.1.ffn_up_exps.weight",
                dims,
                8,
                vec![0; experts * f * d / 32 * 34],
            ),
        ],
    );
    let file = open_bytes(&bytes).unwrap();
    let mut card = crate::model::card::ModelCard::load("gpt-oss-tiny").unwrap();
    (card.experts, card.ffn, card.hidden) = (experts as u64, f as u64, d as u64);
    let arch = crate::model::arch::ArchSpec::from_card(&card);
    let (weights, storage, _) = llama::gate_up(&file, &arch, 0, false).unwrap();
    assert_eq!(storage, Storage::Quant(QuantFormat::Mxfp4));
    assert_eq!(weights.len(), 2 * gate.len());
    for e in 0..experts {
        for i in 0..f {
            let hub = |r: usize| &weights[((e * 2 * f) + r) * row..][..row];
            let half = |h: &[u8]| h[(e * f + i) * row..][..row].to_vec();
            assert_eq!(hub(2 * i), half(&gate), "expert {e} gate row {i}");
            assert_eq!(hub(2 * i + 1), half(&up), "expert {e} up row {i}");
        }
    }
    let (bias, storage, _) = llama::gate_up(&file, &arch, 0, true).unwrap();
    assert_eq!(
        storage,
        Storage::Float(crate::quant::storage::WeightDtype::F32)
    );
    let hub_bias: Vec<f32> = (0..experts * f)
        .flat_map(|i| [gate_bias[i], up_bias[i]])
        .collect();
    assert_eq!(bias, f32s(&hub_bias));
    let err = llama::gate_up(&file, &arch, 1, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("blk.1.ffn_up_exps.weight") && err.contains("Q8_0"),
        "{err}"
    );
}

/// A hand-built DBRX GGUF with llama.cpp's `dbrx` names and the shapes its `dbrx.cpp`
/// creates (`ffn_down_exps` `{n_ff, n_embd, n_expert}`: each expert's `w2` transposed to
/// out-in by the converter), `down_dims` the ggml dims written for `ffn_down_exps`.
fn dbrx_file(down_dims: Vec<u64>) -> Vec<u8> {
    let (d, f, e, vocab) = (4u64, 2u64, 2u64, 8u64);
    let f32s = |n: u64| {
        (0..n)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let u = |v: u32| v.to_le_bytes().to_vec();
    let fl = |v: f32| v.to_le_bytes().to_vec();
    let tokens = array_value(8, (0..vocab).map(|i| string_value(&format!("t{i}"))));
    build(
        &[
            ("general.architecture", 8, string_value("dbrx")),
            ("dbrx.block_count", 4, u(1)),
            ("dbrx.context_length", 4, u(16)),
            ("dbrx.embedding_length", 4, u(d as u32)),
            ("dbrx.feed_forward_length", 4, u(f as u32)),
            ("dbrx.attention.head_count", 4, u(2)),
            ("dbrx.attention.head_count_kv", 4, u(1)),
            ("dbrx.rope.freq_base", 6, fl(500000.0)),
            ("dbrx.attention.clamp_kqv", 6, fl(8.0)),
            ("dbrx.expert_count", 4, u(e as u32)),
            ("dbrx.expert_used_count", 4, u(1)),
            ("dbrx.attention.layer_norm_epsilon", 6, fl(2e-5)),
            ("tokenizer.ggml.tokens", 9, tokens),
        ],
        &[
            ("token_embd.weight", vec![d, vocab], 0, f32s(d * vocab)),
            ("output_norm.weight", vec![d], 0, f32s(d)),
            ("output.weight", vec![d, vocab], 0, f32s(d * vocab)),
            ("blk.0.attn_norm.weight", vec![d], 0, f32s(d)),
            ("blk.0.attn_qkv.weight", vec![d, d + 2 * 2], 0, f32s(d * 8)),
            ("blk.0.attn_output.weight", vec![d, d], 0, f32s(d * d)),
            ("blk.0.attn_output_norm.weight", vec![d], 0, f32s(d)),
            ("blk.0.ffn_gate_inp.weight", vec![d, e], 0, f32s(d * e)),
            (
                "blk.0.ffn_gate_exps.weight",
                vec![d, f, e],
                0,
                f32s(d * f * e),
            ),
            (
                "blk.0.ffn_up_exps.weight",
                vec![d, f, e],
                0,
                f32s(d * f * e),
            ),
            ("blk.0.ffn_down_exps.weight", down_dims, 0, f32s(d * f * e)),
        ],
    )
}

/// llama.cpp's `dbrx` architecture reads as moec's DBRX: hyper-parameters from the `dbrx.*`
/// keys the converter writes (the LayerNorm epsilon and `clamp_kqv` included), the second
/// norm from `attn_output_norm`, the fused `attn_qkv`, and each expert's down projection
/// `[hidden, ffn]` out-in as stored (expert 1's rows are the second half of the merged
/// tensor). The Hub's in-out shape in `ffn_down_exps` is refused, naming the tensor.
#[test]
fn a_dbrx_gguf_reads_its_expert_down_out_in_and_names_a_wrong_shape() {
    let file = open_bytes(&dbrx_file(vec![2, 4, 2])).unwrap();
    let imported = llama::import(&file, "m").unwrap();
    let card = &imported.card;
    assert_eq!(card.family.model_type(), "dbrx");
    assert!(card.expert_down_out_in);
    assert_eq!((card.norm_eps as f32, card.clip_qkv), (2e-5, Some(8.0)));
    assert_eq!((card.hidden, card.ffn, card.kv_heads), (4, 2, 1));
    let by_gguf = |name: &str| {
        imported
            .tensors
            .iter()
            .find(|t| t.gguf_name == name)
            .unwrap_or_else(|| panic!("{name} not read"))
    };
    let down = by_gguf("blk.0.ffn_down_exps.weight");
    assert_eq!(down.shape, [2 * 4, 2]);
    by_gguf("blk.0.attn_qkv.weight");
    by_gguf("blk.0.attn_output_norm.weight");
    let arch = crate::model::arch::ArchSpec::from_card(card);
    let src = crate::weights::names::segment_source(
        &arch,
        0,
        crate::model::segment::SegmentKind::ExpertDown(1),
    );
    assert_eq!((src.shape, src.rows), (vec![8, 2], 4..8));
    let wrong = open_bytes(&dbrx_file(vec![4, 2, 2])).unwrap();
    let err = llama::import(&wrong, "m").unwrap_err().to_string();
    assert!(err.contains("blk.0.ffn_down_exps.weight"), "{err}");
}
