//! llama.cpp's GGUF tensors read as a moec checkpoint of one of its families (Mixtral from
//! the `llama` architecture, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss, DBRX).
//!
//! Takes an opened [`GgufFile`]; gives the model card (built from the GGUF metadata
//! through the same config reader as a Hugging Face `config.json`, so every card check
//! applies) and, for every tensor the Hub checkpoint names, where its bytes are in the
//! GGUF file: llama.cpp's names (`blk.{i}.attn_q.weight`, the merged
//! `blk.{i}.ffn_{gate,up,down}_exps.weight` whose expert `e` is a contiguous block of
//! rows), its storage, and whether its rows must be put back in the Hub's order (the
//! converter permutes `q_proj`/`k_proj` rows per head for llama.cpp's interleaved rotary
//! pairs; moec's rotary kernel uses the Hub's split halves). Metadata that contradicts the
//! tensors (a head count whose shapes disagree, an expert count the merged tensors do not
//! hold) is an error naming the tensor. gpt-oss's converter splits the Hub's interleaved
//! `gate_up_proj` (and its bias) into `ffn_gate_exps` and `ffn_up_exps`; moec's fused
//! gpt-oss expert reads them interleaved again, so each layer's pair is put back together
//! row by row at import (a copy in memory of those bytes, in their stored format), and the
//! experts are read out-in as stored (`ClampedSwiglu::experts_out_in`). DBRX's converter
//! views the Hub's fused `w1`/`v1`/`w2` (`[experts * ffn, hidden]`) as `[experts, ffn,
//! hidden]` and transposes each expert's `w2` to `[hidden, ffn]`: gate and up are the Hub's
//! rows as they are, and the down projection is read out-in as stored
//! (`ModelCard::expert_down_out_in`), so no bytes move at import.

use super::{GgufError, GgufFile, Storage};
use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::layout::LayerLayout;
use crate::model::segment::SegmentKind;
use crate::weights::names::{head_names, segment_source};
use std::ops::Range;

/// Where one Hub-named tensor's bytes are in the GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedTensor {
    /// The Hub name moec's readers ask for.
    pub name: String,
    /// Its Hub shape (outermost first).
    pub shape: Vec<usize>,
    /// How its elements are stored.
    pub storage: Storage,
    /// Its bytes inside its part's map.
    pub range: Range<usize>,
    /// Which part of a split GGUF holds it (0 for a single file).
    pub part: usize,
    /// For `q_proj`/`k_proj`: the head count whose per-head row interleaving the converter
    /// applied (rows must be un-interleaved before use).
    pub unpermute_heads: Option<usize>,
    /// The GGUF tensor it comes from (for messages).
    pub gguf_name: String,
    /// Bytes built at import rather than viewed in the map (DeepSeek's `kv_b_proj` from an
    /// older converter's single `attn_kv_b`, decoded to f32); `range` is then `0..len`.
    pub owned: Option<Vec<u8>>,
}

/// A GGUF file read as a checkpoint of one of moec's families.
#[derive(Debug, Clone)]
pub struct Imported {
    /// The architecture, from the metadata.
    pub card: ModelCard,
    /// Every tensor the family's Hub checkpoint has.
    pub tensors: Vec<ImportedTensor>,
}

/// Where a segment's bytes are in the GGUF file.
#[derive(Debug)]
pub(crate) enum Place {
    /// A whole GGUF tensor of the Hub shape (`unpermute`: the head count whose rotary
    /// row interleaving Mixtral's converter applied).
    Whole(String, Option<usize>),
    /// Expert `x`'s block of `rows` rows of a merged `[experts, rows, cols]` tensor.
    Expert(String, usize, usize, usize),
    /// A whole GGUF tensor of this shape (outermost first), read as the segment's
    /// `[rows, cols]` matrix: DeepSeek's per-head `attn_k_b` `[heads, kv_lora, qk_nope]`
    /// and `attn_v_b` `[heads, v, kv_lora]`, whose heads are blocks of rows.
    Stacked(String, Vec<usize>),
    /// DeepSeek's `kv_b_proj` as an older converter's single `attn_kv_b`, decoded to f32
    /// (see [`super::mla`]).
    KvB,
    /// gpt-oss's `gate_up_proj` (`bias`: its bias) interleaved again from the converter's
    /// `ffn_gate_exps` and `ffn_up_exps`.
    GateUp {
        /// The bias vectors rather than the weight matrices.
        bias: bool,
    },
}

/// The GGUF tensor of segment `kind` of layer `layer` (`None` for a kind no llama.cpp
/// architecture of this family has).
pub(crate) fn place(arch: &ArchSpec, layer: usize, kind: SegmentKind) -> Option<Place> {
    let b = |t: &str| format!("blk.{layer}.{t}.weight");
    let bias = |t: &str| format!("blk.{layer}.{t}.bias");
    let whole = |t: &str| Some(Place::Whole(b(t), None));
    let (d, f) = (arch.hidden, arch.ffn);
    // Only Mixtral's converter permutes q/k rows (llama.cpp's `llama` rotates pairs);
    // Qwen, OLMoE and DeepSeek are written as the Hub stores them.
    let table = super::families::gguf_family(arch.family);
    let permuted = table.permuted_qk;
    let gpt_oss = table.gpt_oss_experts;
    match kind {
        SegmentKind::AttnNorm => whole("attn_norm"),
        SegmentKind::FfnNorm if gpt_oss => whole("post_attention_norm"),
        SegmentKind::FfnNorm if table.dbrx_layout => whole("attn_output_norm"),
        SegmentKind::FfnNorm => whole("ffn_norm"),
        SegmentKind::QProj => Some(Place::Whole(
            b("attn_q"),
            permuted.then_some(arch.attn.heads),
        )),
        SegmentKind::KProj => Some(Place::Whole(
            b("attn_k"),
            permuted.then_some(arch.attn.kv_heads),
        )),
        SegmentKind::VProj => whole("attn_v"),
        SegmentKind::QkvProj => whole("attn_qkv"),
        SegmentKind::QBias => Some(Place::Whole(bias("attn_q"), None)),
        SegmentKind::KBias => Some(Place::Whole(bias("attn_k"), None)),
        SegmentKind::VBias => Some(Place::Whole(bias("attn_v"), None)),
        SegmentKind::QNorm => whole("attn_q_norm"),
        SegmentKind::KNorm => whole("attn_k_norm"),
        SegmentKind::QAProj => whole("attn_q_a"),
        SegmentKind::QANorm => whole("attn_q_a_norm"),
        SegmentKind::QBProj => whole("attn_q_b"),
        SegmentKind::KvAProj => whole("attn_kv_a_mqa"),
        SegmentKind::KvANorm => whole("attn_kv_a_norm"),
        SegmentKind::KvB | SegmentKind::KvBOut => Some(Place::KvB),
        SegmentKind::KB | SegmentKind::VB => {
            let m = arch.mla?;
            let (heads, r) = (arch.attn.heads, m.kv_lora_rank as usize);
            let (nope, v) = (m.qk_nope_head_dim as usize, m.v_head_dim as usize);
            Some(if kind == SegmentKind::KB {
                Place::Stacked(b("attn_k_b"), vec![heads, r, nope])
            } else {
                Place::Stacked(b("attn_v_b"), vec![heads, v, r])
            })
        }
        SegmentKind::Sinks => whole("attn_sinks"),
        SegmentKind::OProj => whole("attn_output"),
        SegmentKind::OBias => Some(Place::Whole(bias("attn_output"), None)),
        SegmentKind::Router => whole("ffn_gate_inp"),
        SegmentKind::RouterBias if gpt_oss => Some(Place::Whole(bias("ffn_gate_inp"), None)),
        SegmentKind::RouterBias => Some(Place::Whole(bias("exp_probs_b"), None)),
        SegmentKind::SharedGate => whole("ffn_gate_shexp"),
        SegmentKind::SharedUp => whole("ffn_up_shexp"),
        SegmentKind::SharedDown => whole("ffn_down_shexp"),
        SegmentKind::SharedExpertGate => whole("ffn_gate_inp_shexp"),
        SegmentKind::DenseGate => whole("ffn_gate"),
        SegmentKind::DenseUp => whole("ffn_up"),
        SegmentKind::DenseDown => whole("ffn_down"),
        SegmentKind::ExpertGate(x) => Some(Place::Expert(b("ffn_gate_exps"), x, f, d)),
        SegmentKind::ExpertUp(x) => Some(Place::Expert(b("ffn_up_exps"), x, f, d)),
        SegmentKind::ExpertDown(x) => Some(Place::Expert(b("ffn_down_exps"), x, d, f)),
        SegmentKind::ExpertGateUp(_) => Some(Place::GateUp { bias: false }),
        SegmentKind::ExpertGateUpBias(_) => Some(Place::GateUp { bias: true }),
        SegmentKind::ExpertDownBias(x) => Some(Place::Expert(bias("ffn_down_exps"), x, 1, d)),
    }
}

/// Reads `file` as a moec checkpoint of the family its `general.architecture` names
/// (llama.cpp's `llama` with experts, `qwen3moe`, `qwen2moe`, `olmoe`, `deepseek2`,
/// `gpt-oss`, `dbrx`);
/// any other architecture is an error naming it.
pub fn import(file: &GgufFile, name: &str) -> Result<Imported, GgufError> {
    let family = super::families::family_of(file)?;
    let meta_err = |key: &str, message: String| GgufError::Metadata {
        path: file.path().display().to_string(),
        key: key.into(),
        message,
    };
    let config = super::families::config(file, family)?;
    let path = file.path().display().to_string();
    let mut card = crate::weights::config::card_from_config(&config.to_string(), &path, name)
        .map_err(|e| meta_err("(hyper-parameters)", e.to_string()))?;
    card.description = format!("{family:?}-family GGUF `{name}` (from its metadata)");
    if let Some(m) = card.mla.as_mut() {
        // llama.cpp's converter splits `kv_b_proj` into `attn_k_b`/`attn_v_b`; an older
        // one wrote it whole as `attn_kv_b`.
        m.kv_b_split = !file.tensors.contains_key("blk.0.attn_kv_b.weight");
    }
    if let Some(c) = card.clamped_swiglu.as_mut() {
        // llama.cpp stores every expert matrix out-in, whatever its format.
        c.experts_out_in = true;
    }
    if super::families::gguf_family(family).dbrx_layout {
        // The converter transposes each expert's `w2` to `[hidden, ffn]` (out-in).
        card.expert_down_out_in = true;
        card.norm_eps = super::families::dbrx_norm_eps(file)?;
    }
    let arch = ArchSpec::from_card(&card);
    let mut tensors: Vec<ImportedTensor> = Vec::new();
    let mut add = |name: String,
                   shape: Vec<usize>,
                   gguf: &str,
                   gguf_shape: Vec<usize>,
                   rows: Option<Range<usize>>,
                   unpermute_heads: Option<usize>|
     -> Result<(), GgufError> {
        // Dimensions of 1 are the writer's choice (llama-quantize drops the leading 1 of
        // Qwen2-MoE's `[1, hidden]` shared-expert gate): compare the others.
        let squeezed = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        let gguf_shape = match file.tensors.get(gguf) {
            Some(info) if squeezed(&info.torch_shape()) == squeezed(&gguf_shape) => {
                info.torch_shape()
            }
            _ => gguf_shape,
        };
        let (info, storage) = file.tensor(gguf, &gguf_shape)?;
        let cols = *gguf_shape.last().unwrap_or(&1);
        let row_bytes = storage
            .bytes_for(cols as u64)
            .ok_or_else(|| GgufError::Tensor {
                path: path.clone(),
                tensor: gguf.into(),
                message: format!("rows of {cols} are not whole {} blocks", storage.name()),
            })? as usize;
        let range = match rows {
            Some(r) => info.range.start + r.start * row_bytes..info.range.start + r.end * row_bytes,
            None => info.range.clone(),
        };
        tensors.push(ImportedTensor {
            name,
            shape,
            storage,
            range,
            part: info.part,
            unpermute_heads,
            gguf_name: gguf.into(),
            owned: None,
        });
        Ok(())
    };
    let (d, vocab) = (arch.hidden, arch.vocab);
    let (embed_name, norm_name) = head_names(family);
    add(
        embed_name.into(),
        vec![vocab, d],
        "token_embd.weight",
        vec![vocab, d],
        None,
        None,
    )?;
    add(
        norm_name.into(),
        vec![d],
        "output_norm.weight",
        vec![d],
        None,
        None,
    )?;
    let head = if file.tensors.contains_key("output.weight") {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    add(
        "lm_head.weight".into(),
        vec![vocab, d],
        head,
        vec![vocab, d],
        None,
        None,
    )?;
    let mut assembled = Vec::new();
    let mut merged: Vec<String> = Vec::new();
    let mut built = Vec::new();
    for layer in 0..arch.layers {
        for kind in LayerLayout::kinds(&arch, layer) {
            let src = segment_source(&arch, layer, kind);
            match place(&arch, layer, kind) {
                Some(Place::Whole(gguf, heads)) => {
                    add(src.name, src.shape.clone(), &gguf, src.shape, None, heads)?
                }
                Some(Place::Stacked(gguf, gguf_shape)) => {
                    add(src.name, src.shape, &gguf, gguf_shape, None, None)?
                }
                Some(Place::Expert(gguf, x, rows, cols)) => {
                    let leading: usize = src.shape.iter().rev().skip(1).product();
                    if src.rows.len() == leading {
                        // A Hub tensor of the expert's own: its rows of the merged tensor.
                        add(
                            src.name,
                            src.shape,
                            &gguf,
                            vec![arch.experts, rows, cols],
                            Some(x * rows..(x + 1) * rows),
                            None,
                        )?
                    } else if !merged.contains(&src.name) {
                        // gpt-oss's Hub tensor holds every expert, as the merged one does:
                        // all of it, once (each expert's segment takes its rows).
                        merged.push(src.name.clone());
                        add(
                            src.name,
                            src.shape,
                            &gguf,
                            vec![arch.experts, rows, cols],
                            None,
                            None,
                        )?
                    }
                }
                // Every expert's segment views the same interleaved tensor: build it once.
                Some(Place::GateUp { bias }) if assembled.contains(&(layer, kind_tag(bias))) => {}
                Some(Place::GateUp { bias }) => {
                    assembled.push((layer, kind_tag(bias)));
                    let (bytes, storage, gguf_name) = gate_up(file, &arch, layer, bias)?;
                    built.push(ImportedTensor {
                        name: src.name,
                        shape: src.shape,
                        storage,
                        range: 0..bytes.len(),
                        part: 0,
                        unpermute_heads: None,
                        gguf_name,
                        owned: Some(bytes),
                    });
                }
                // `pre` and `o` view the same tensor: put it together once.
                Some(Place::KvB) if assembled.contains(&(layer, 0)) => {}
                Some(Place::KvB) => {
                    assembled.push((layer, 0));
                    let bytes = super::mla::kv_b(file, &arch, layer)?;
                    built.push(ImportedTensor {
                        name: src.name,
                        shape: src.shape,
                        storage: Storage::Float(crate::quant::storage::WeightDtype::F32),
                        range: 0..bytes.len(),
                        part: 0,
                        unpermute_heads: None,
                        gguf_name: format!("blk.{layer}.attn_kv_b.weight"),
                        owned: Some(bytes),
                    });
                }
                None => {
                    return Err(meta_err(
                        "general.architecture",
                        format!(
                            "the {family:?} layout has a {kind:?} segment moec cannot map to a \
                             GGUF tensor"
                        ),
                    ))
                }
            }
        }
    }
    tensors.extend(built);
    Ok(Imported { card, tensors })
}

/// Which tensor of a layer `assembled` records: 0 `kv_b_proj`, 1 `gate_up_proj`, 2 its bias.
fn kind_tag(bias: bool) -> u8 {
    if bias {
        2
    } else {
        1
    }
}

/// gpt-oss's `gate_up_proj` of layer `layer` (`bias`: `gate_up_proj_bias`) as the Hub
/// interleaves it, from the converter's `ffn_gate_exps` and `ffn_up_exps` (`.bias`):
/// per expert, gate row (or value) `i` then up row `i`, for every `i`, rows moved whole in
/// their stored format (both must share it). Gives the bytes, their storage and the GGUF
/// names (for messages).
pub(super) fn gate_up(
    file: &GgufFile,
    arch: &ArchSpec,
    layer: usize,
    bias: bool,
) -> Result<(Vec<u8>, Storage, String), GgufError> {
    let (experts, d, f) = (arch.experts, arch.hidden, arch.ffn);
    let suffix = if bias { "bias" } else { "weight" };
    let gate_name = format!("blk.{layer}.ffn_gate_exps.{suffix}");
    let up_name = format!("blk.{layer}.ffn_up_exps.{suffix}");
    let shape = if bias {
        vec![experts, f]
    } else {
        vec![experts, f, d]
    };
    let (gate, storage) = file.tensor(&gate_name, &shape)?;
    let (up, up_storage) = file.tensor(&up_name, &shape)?;
    let bad = |message: String| GgufError::Tensor {
        path: file.path().display().to_string(),
        tensor: up_name.clone(),
        message,
    };
    if up_storage != storage {
        return Err(bad(format!(
            "is {} while {gate_name} is {}: moec reads gpt-oss's gate and up as one matrix",
            up_storage.name(),
            storage.name()
        )));
    }
    // A bias is `f` values of one element each; a weight `f` rows of `d`.
    let unit = storage
        .bytes_for(if bias { 1 } else { d as u64 })
        .ok_or_else(|| {
            bad(format!(
                "rows of {d} are not whole {} blocks",
                storage.name()
            ))
        })? as usize;
    let (gate, up) = (file.tensor_bytes(gate), file.tensor_bytes(up));
    let len = experts * f * unit;
    if gate.len() != len || up.len() != len {
        return Err(bad(format!("holds {} bytes, expected {len}", up.len())));
    }
    let mut out = Vec::with_capacity(2 * len);
    for (g, u) in gate.chunks_exact(unit).zip(up.chunks_exact(unit)) {
        out.extend_from_slice(g);
        out.extend_from_slice(u);
    }
    Ok((out, storage, format!("{gate_name} + {up_name}")))
}

/// Puts back the Hub's row order of a `q_proj`/`k_proj` matrix that `convert_hf_to_gguf.py`
/// permuted for `heads` heads: within each head of `2h` rows, the converter stores Hub row
/// `p * h + i` (half `p`, pair `i`) at position `2i + p`. Rows are moved whole (`row_bytes`
/// each), so this works for every storage. `None` when the sizes do not divide.
pub fn unpermute_rows(bytes: &[u8], heads: usize, row_bytes: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; bytes.len()];
    unpermute_rows_into(bytes, heads, row_bytes, &mut out)?;
    Some(out)
}

/// [`unpermute_rows`] into `out` (as long as `bytes`), so a caller that keeps the rows in
/// its own buffer never holds them twice, not even while restoring (Mixtral-8x7B's 32
/// layers of Q and K rows are 445 MB). `None`, and `out` untouched, when the shapes do not
/// fit.
pub fn unpermute_rows_into(
    bytes: &[u8],
    heads: usize,
    row_bytes: usize,
    out: &mut [u8],
) -> Option<()> {
    if row_bytes == 0 || !bytes.len().is_multiple_of(row_bytes) || out.len() != bytes.len() {
        return None;
    }
    for (hub, stored) in converter_row_order(bytes.len() / row_bytes, heads)? {
        out[hub * row_bytes..(hub + 1) * row_bytes]
            .copy_from_slice(&bytes[stored * row_bytes..(stored + 1) * row_bytes]);
    }
    Some(())
}

/// The converter's per-head row interleave of `rows` rows in `heads` heads, as
/// `(hub row, stored row)` pairs: within each head of `2h` rows, Hub row `p * h + i`
/// (half `p`, pair `i`) is stored at position `2i + p`. `None` when the rows do not split
/// into whole heads of pairs. Reading ([`unpermute_rows`]) and writing
/// (`gguf::export`) both move rows by it.
pub fn converter_row_order(rows: usize, heads: usize) -> Option<Vec<(usize, usize)>> {
    let per_head = rows.checked_div(heads)?;
    if per_head * heads != rows || !per_head.is_multiple_of(2) {
        return None;
    }
    let half = per_head / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..heads {
        for p in 0..2 {
            for i in 0..half {
                order.push((h * per_head + p * half + i, h * per_head + 2 * i + p));
            }
        }
    }
    Some(order)
}
