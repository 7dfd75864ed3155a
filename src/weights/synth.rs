//! Deterministic synthetic checkpoints in the Hugging Face Hub format.
//!
//! Takes a card, a seed, a dtype and a folder; writes `config.json` (the family's Hub
//! spelling), `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards plus
//! `model.safetensors.index.json` above [`DEFAULT_SHARD_BYTES`]) and the family's
//! `tokenizer.json`, into a temporary folder renamed into place at the end, so a reader
//! never sees half a checkpoint. Each tensor's values come from our own PRNG seeded by
//! (seed, tensor name), so the bytes never change with a crate upgrade or tensor order.
//! Scales keep activations O(1) through the layers and give the router and lm_head
//! enough spread that generation is not degenerate. With [`ExpertStorage::Mxfp4`] a gpt-oss
//! card's expert tensors are written as the Hub ships them: random MXFP4 codes under e8m0
//! scales sized to the same fan-in (`*_blocks` / `*_scales`, U8) and a `quantization_config`.

use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::layout::{ImageBuffer, LayerLayout};
use crate::quant::mxfp4;
use crate::quant::storage::WeightDtype;
use crate::rng::Rng;
use crate::tempfiles::{self, TempGuard};
use crate::weights::config::{config_for_card, MXFP4_UNCONVERTED};
use crate::weights::names::{checkpoint_tensors, segment_source};
use crate::weights::tokenizer::embedded_tokenizer_json;
use half::{bf16, f16};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Shard size above which the checkpoint is split (like the Hub's multi-file uploads).
pub const DEFAULT_SHARD_BYTES: u64 = 2 << 30;

/// What to write.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthOptions {
    /// PRNG seed.
    pub seed: u64,
    /// Stored dtype of every tensor.
    pub dtype: WeightDtype,
    /// Largest shard in bytes.
    pub max_shard_bytes: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            seed: 0,
            dtype: WeightDtype::Bf16,
            max_shard_bytes: DEFAULT_SHARD_BYTES,
        }
    }
}

/// How a synthetic checkpoint stores its routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertStorage {
    /// In the checkpoint's dtype, like every other tensor.
    #[default]
    Dense,
    /// gpt-oss only: MXFP4 blocks and scales, as the Hub's gpt-oss checkpoints.
    Mxfp4,
}

/// Problems writing a synthetic checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// MXFP4 experts were asked for a card that cannot store them.
    #[error("MXFP4 experts need a gpt-oss card with hidden and ffn multiples of 32; {0}")]
    Mxfp4(String),
    /// The destination already exists.
    #[error("{0} already exists; choose another --out or remove it")]
    Exists(String),
    /// The destination's file system has too little free space for the checkpoint.
    #[error("{dir} has {free} bytes free but the checkpoint needs {needed}; free space or choose another --out")]
    NoSpace {
        /// The folder written into.
        dir: String,
        /// Bytes free there.
        free: u64,
        /// Bytes the checkpoint needs.
        needed: u64,
    },
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying cause, as the library or the OS reported it.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// FNV-1a of a name: decorrelates tensor streams independently of write order.
pub(crate) fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// (centre, half-width) of the uniform distribution of a tensor's values.
pub(crate) fn distribution(a: &ArchSpec, name: &str, shape: &[usize]) -> (f32, f32) {
    let sqrt3 = 3f32.sqrt();
    let fan_in = |n: usize| sqrt3 / (n as f32).sqrt();
    let d = a.hidden;
    if name.ends_with(".bias") || name.ends_with("_bias") {
        return (0.0, 0.1); // small biases (q/k/v/o, router, gpt-oss experts)
    }
    if shape.len() == 1 {
        return (1.0, 0.1); // norm weights around 1
    }
    if name.contains("embed_tokens") || name.contains("wte") {
        (0.0, sqrt3) // unit variance embeddings
    } else if name == "lm_head.weight" {
        (0.0, 3.0 * fan_in(d)) // logits with std about 3
    } else if name.contains("gate.weight") || name.contains("router") {
        (0.0, 2.0 * fan_in(d)) // router logits with std about 2: clear but varied routing
    } else if name.ends_with("w2.weight") || name.ends_with("mlp.w2") {
        (0.0, fan_in(a.ffn))
    } else if name.ends_with("down_proj.weight") {
        (0.0, fan_in(shape[1])) // routed or shared expert: fan-in is its own width
    } else if name.ends_with("experts.down_proj") || name.ends_with("experts.gate_up_proj") {
        (0.0, fan_in(shape[shape.len() - 2])) // gpt-oss `[experts, in, out]`
    } else if name.contains("o_proj") || name.contains("out_proj") {
        (0.0, fan_in(a.q_dim()))
    } else {
        (0.0, fan_in(d))
    }
}

/// The value stream of tensor `name` (endless; take `shape.iter().product()` values).
fn tensor_values(
    a: &ArchSpec,
    name: &str,
    shape: &[usize],
    seed: u64,
) -> impl Iterator<Item = f32> {
    let (centre, half) = distribution(a, name, shape);
    let mut rng = Rng::new(seed ^ fnv1a(name));
    std::iter::repeat_with(move || centre + half * rng.next_signed_f32())
}

/// Layer `layer` of the synthetic checkpoint of `card`, built directly as a packed image
/// (the same bytes `Checkpoint::copy_layer_image` would copy from the written files), for
/// benchmarks and tests that need one large layer without writing the whole model.
pub fn synthetic_layer_image(
    card: &ModelCard,
    layer: usize,
    opts: &SynthOptions,
) -> (LayerLayout, ImageBuffer) {
    let arch = ArchSpec::from_card(card);
    let layout = LayerLayout::uniform_for(&arch, layer, opts.dtype);
    let mut image = ImageBuffer::zeroed(layout.image_bytes);
    let bytes = image.as_bytes_mut();
    let mut buf = Vec::new();
    for seg in &layout.segments {
        let src = segment_source(&arch, layer, seg.kind);
        let skip = src.rows.start * seg.cols;
        buf.clear();
        for v in tensor_values(&arch, &src.name, &src.shape, opts.seed)
            .skip(skip)
            .take(seg.rows * seg.cols)
        {
            encode(v, opts.dtype, &mut buf);
        }
        bytes[seg.range()].copy_from_slice(&buf);
    }
    (layout, image)
}

/// Appends `v` stored as `dtype` (little-endian; bf16 and f16 rounded to nearest even).
pub(crate) fn encode(v: f32, dtype: WeightDtype, out: &mut Vec<u8>) {
    match dtype {
        WeightDtype::Bf16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
        WeightDtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
        WeightDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
    }
}

fn dtype_name(d: WeightDtype) -> &'static str {
    match d {
        WeightDtype::Bf16 => "BF16",
        WeightDtype::F16 => "F16",
        WeightDtype::F32 => "F32",
    }
}

/// Whether `name` is an MXFP4 `_blocks` / `_scales` tensor (stored as U8).
fn is_packed(name: &str) -> bool {
    name.ends_with("_proj_blocks") || name.ends_with("_proj_scales")
}

/// The bytes of MXFP4 tensor `name` (endless): uniformly random codes for `_blocks`; for
/// `_scales`, exponents one either side of the one that gives the dense tensor's variance
/// (uniform codes have mean square 68.5 / 8, so a scale of 1 / (2.93 sqrt(fan_in)) matches
/// the dense weights' 1 / sqrt(fan_in) root mean square). `shape` is the packed shape.
fn packed_bytes(name: &str, shape: &[usize], seed: u64) -> impl Iterator<Item = u8> {
    let mut rng = Rng::new(seed ^ fnv1a(name));
    let blocks = name.ends_with("_blocks");
    let fan_in = shape.get(2).copied().unwrap_or(1).max(1) * mxfp4::BLOCK;
    let centre = 127.0 - (2.93 * (fan_in as f64).sqrt()).log2().round();
    std::iter::repeat_with(move || {
        let r = rng.next_u64();
        if blocks {
            r as u8
        } else {
            (centre + (r % 3) as f64 - 1.0).clamp(0.0, 254.0) as u8
        }
    })
}

/// Writes one safetensors file holding `tensors`, values generated on the fly.
fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>)],
    a: &ArchSpec,
    opts: &SynthOptions,
) -> Result<(), SynthError> {
    let elem_of = |name: &str| {
        if is_packed(name) {
            1
        } else {
            opts.dtype.bytes() as usize
        }
    };
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * elem_of(name);
        let dtype = if is_packed(name) {
            "U8"
        } else {
            dtype_name(opts.dtype)
        };
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::Value::Object(header).to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(io(path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io(path))?;
    w.write_all(&text).map_err(io(path))?;
    let mut buf = Vec::with_capacity(1 << 20);
    for (name, shape) in tensors {
        let n: usize = shape.iter().product();
        if is_packed(name) {
            let mut bytes = packed_bytes(name, shape, opts.seed);
            let mut left = n;
            while left > 0 {
                let chunk = left.min(1 << 20);
                buf.clear();
                buf.extend(bytes.by_ref().take(chunk));
                w.write_all(&buf).map_err(io(path))?;
                left -= chunk;
            }
            continue;
        }
        let elem = elem_of(name);
        let mut values = tensor_values(a, name, shape, opts.seed);
        let mut left = n;
        while left > 0 {
            let chunk = left.min((1 << 20) / elem);
            buf.clear();
            for v in values.by_ref().take(chunk) {
                encode(v, opts.dtype, &mut buf);
            }
            w.write_all(&buf).map_err(io(path))?;
            left -= chunk;
        }
    }
    w.flush().map_err(io(path))?;
    Ok(())
}

/// A fresh temporary folder next to `out` (same file system, so the rename is atomic),
/// registered for removal if the process is interrupted; partial folders that killed
/// writers left beside `out` are removed first.
fn temp_dir_for(out: &Path) -> Result<(PathBuf, TempGuard), SynthError> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let out = match out.file_name() {
        Some(_) => out.to_path_buf(),
        None => parent.join("checkpoint"),
    };
    tempfiles::remove_stale(&out, "tmp", "a partial checkpoint");
    let tmp = tempfiles::temp_beside(&out, "tmp");
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    let guard = tempfiles::register(&tmp);
    Ok((tmp, guard))
}

/// Free bytes of the file system holding `dir`, if the OS says.
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is zero-initialisable plain data; the call only writes into it and
    // reads the NUL-terminated path, which outlives the call.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; both pointers are valid for the call.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) };
    (rc == 0).then(|| (stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Writes the checkpoint of `card` to `out` (which must not exist).
pub fn write_checkpoint(
    card: &ModelCard,
    out: &Path,
    opts: &SynthOptions,
) -> Result<(), SynthError> {
    write_checkpoint_as(card, out, opts, ExpertStorage::Dense)
}

/// Writes the checkpoint of `card` to `out` (which must not exist), its routed experts
/// stored as `experts` says.
pub fn write_checkpoint_as(
    card: &ModelCard,
    out: &Path,
    opts: &SynthOptions,
    experts: ExpertStorage,
) -> Result<(), SynthError> {
    let block = mxfp4::BLOCK as u64;
    if experts == ExpertStorage::Mxfp4
        && (card.family.facts().mxfp4_unconverted.is_none()
            || !card.hidden.is_multiple_of(block)
            || !card.ffn.is_multiple_of(block))
    {
        return Err(SynthError::Mxfp4(format!(
            "`{}` is {:?} with hidden {} and ffn {}",
            card.name, card.family, card.hidden, card.ffn
        )));
    }
    if out.exists() {
        return Err(SynthError::Exists(out.display().to_string()));
    }
    let (tmp, _guard) = temp_dir_for(out)?;
    // The whole checkpoint in the written dtype, plus config and tokenizer files.
    let needed = (card.total_params() * opts.dtype.bytes()).saturating_add(64 << 20);
    if let Some(free) = free_bytes(&tmp).filter(|&free| free < needed) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(SynthError::NoSpace {
            dir: tmp
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .map_or_else(|| ".".into(), |p| p.display().to_string()),
            free,
            needed,
        });
    }
    let result = write_into(card, &tmp, opts, experts)
        .and_then(|()| std::fs::rename(&tmp, out).map_err(io(out)));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_into(
    card: &ModelCard,
    dir: &Path,
    opts: &SynthOptions,
    experts: ExpertStorage,
) -> Result<(), SynthError> {
    let arch = ArchSpec::from_card(card);
    let mut config_card = card.clone();
    config_card.dtype = opts.dtype;
    let mut config = config_for_card(&config_card, opts.dtype);
    if let (ExpertStorage::Mxfp4, Some(fields)) = (experts, config.as_object_mut()) {
        fields.insert(
            "quantization_config".into(),
            serde_json::json!({"modules_to_not_convert": MXFP4_UNCONVERTED, "quant_method": "mxfp4"}),
        );
    }
    let config = serde_json::to_string_pretty(&config).unwrap_or_default();
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, config + "\n").map_err(io(&config_path))?;
    let tok_path = dir.join("tokenizer.json");
    std::fs::write(&tok_path, embedded_tokenizer_json(card)).map_err(io(&tok_path))?;
    let mut tensors = checkpoint_tensors(&arch);
    if experts == ExpertStorage::Mxfp4 {
        tensors = tensors.into_iter().flat_map(packed_pair).collect();
    }
    let size = |t: &(String, Vec<usize>)| {
        let elem = if is_packed(&t.0) {
            1
        } else {
            opts.dtype.bytes()
        };
        t.1.iter().product::<usize>() as u64 * elem
    };
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut current = 0u64;
    for t in tensors {
        let bytes = size(&t);
        if current > 0 && current + bytes > opts.max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += bytes;
        if let Some(last) = shards.last_mut() {
            last.push(t);
        }
    }
    if shards.len() == 1 {
        write_safetensors(&dir.join("model.safetensors"), &shards[0], &arch, opts)?;
        return Ok(());
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_safetensors(&dir.join(&file), shard, &arch, opts)?;
        for t in shard {
            total += size(t);
            weight_map.insert(t.0.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index_path,
        serde_json::to_string_pretty(&index).unwrap_or_default(),
    )
    .map_err(io(&index_path))?;
    Ok(())
}

/// A gpt-oss expert tensor `[experts, in, out]` as its MXFP4 `_blocks` and `_scales`
/// (every other tensor as it is).
fn packed_pair((name, shape): (String, Vec<usize>)) -> Vec<(String, Vec<usize>)> {
    match shape[..] {
        [experts, inputs, outputs]
            if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") =>
        {
            let (blocks, scales) = mxfp4::packed_shapes(experts, inputs, outputs);
            vec![
                (format!("{name}_blocks"), blocks),
                (format!("{name}_scales"), scales),
            ]
        }
        _ => vec![(name, shape)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partial checkpoint left by a killed writer (its PID gone) is removed when the
    /// next write into the same folder starts; one of a live process is kept.
    #[test]
    fn stale_partial_checkpoints_of_dead_writers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        // PIDs are below 2^22 on Linux, so this one is never alive.
        let stale = dir.path().join(".ckpt.tmp-4000000000-1");
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("model.safetensors"), b"partial").unwrap();
        let live = dir
            .path()
            .join(format!(".ckpt.tmp-{}-2", std::process::id()));
        std::fs::create_dir(&live).unwrap();
        let card = ModelCard::load("mixtral-tiny").unwrap();
        write_checkpoint(&card, &dir.path().join("ckpt"), &SynthOptions::default()).unwrap();
        assert!(!stale.exists(), "the dead writer's folder is removed");
        assert!(live.exists(), "a live writer's folder is kept");
        assert!(dir.path().join("ckpt").join("config.json").exists());
    }
}
