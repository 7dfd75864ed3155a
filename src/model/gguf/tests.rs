//! The reader against hand-built files: well-formed ones, and every way a file can be
//! hostile (wrong magic, unknown version, truncation anywhere, absurd counts, unsupported
//! tensor types, metadata that contradicts the tensors), each one error, never a panic.

use super::*;

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
    let q8 = crate::model::quant::random_blocks(QuantFormat::Q8_0, 2, 5);
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
        &[("blk.0.ffn_gate_exps.weight", vec![32, 1], 2, vec![0; 18])],
    );
    let f = open_bytes(&bytes).unwrap();
    let err = f
        .tensor("blk.0.ffn_gate_exps.weight", &[1, 32])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`blk.0.ffn_gate_exps.weight` is stored as Q4_0"),
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
