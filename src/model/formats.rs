//! The storage format of each weight tensor: a float dtype or a block-quantised format.
//!
//! Takes what a model card says about its weights beyond its one `dtype`: per weight class
//! (`--weight-format experts=q4_k,attention=q8_0` when planning from a card) or per tensor
//! (what a GGUF file holds, read at open); gives [`Storage`] of every tensor, which the
//! packed layer image, the checkpoint buffer `W`, the op catalog's byte counts, the budgets
//! and the HRM all size by. Guarantees: a tensor no entry names is stored in the card's
//! dtype (so a card without entries sizes everything as before); vectors (norm weights,
//! biases, sinks) never take a class's quantised format; a quantised format is accepted
//! only for matrices stored `[out, in]` whose rows are whole blocks
//! ([`WeightFormats::check`] names the tensor otherwise).

use crate::model::arch::ArchSpec;
use crate::model::layout::{LayerLayout, SegmentKind};
use crate::model::vocab::Orientation;
use crate::quant::storage::Storage;
use crate::quant::storage::WeightDtype;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One weight tensor of a model, as the formats name it: the embedding, the final norm,
/// the lm_head, or a segment kind of the layer image (an expert's kind with expert 0
/// standing for every expert: one format per projection, as a GGUF's merged expert
/// tensors store them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum WeightTensor {
    /// The embedding table.
    Embed,
    /// The final norm weight.
    FinalNorm,
    /// The lm_head matrix.
    LmHead,
    /// A segment of every layer's packed image.
    Layer(SegmentKind),
}

impl WeightTensor {
    /// The tensor of segment `kind` (every expert's maps to expert 0's).
    pub fn layer(kind: SegmentKind) -> Self {
        WeightTensor::Layer(match kind {
            SegmentKind::ExpertGate(_) => SegmentKind::ExpertGate(0),
            SegmentKind::ExpertUp(_) => SegmentKind::ExpertUp(0),
            SegmentKind::ExpertDown(_) => SegmentKind::ExpertDown(0),
            SegmentKind::ExpertGateUp(_) => SegmentKind::ExpertGateUp(0),
            SegmentKind::ExpertGateUpBias(_) => SegmentKind::ExpertGateUpBias(0),
            SegmentKind::ExpertDownBias(_) => SegmentKind::ExpertDownBias(0),
            other => other,
        })
    }

    /// True for a vector (norm weight, bias, sinks): never block-quantised.
    pub fn is_vector(self) -> bool {
        match self {
            WeightTensor::Embed | WeightTensor::LmHead => false,
            WeightTensor::FinalNorm => true,
            WeightTensor::Layer(kind) => matches!(
                kind,
                SegmentKind::AttnNorm
                    | SegmentKind::FfnNorm
                    | SegmentKind::QNorm
                    | SegmentKind::KNorm
                    | SegmentKind::QANorm
                    | SegmentKind::KvANorm
                    | SegmentKind::QBias
                    | SegmentKind::KBias
                    | SegmentKind::VBias
                    | SegmentKind::OBias
                    | SegmentKind::RouterBias
                    | SegmentKind::Sinks
                    | SegmentKind::ExpertGateUpBias(_)
                    | SegmentKind::ExpertDownBias(_)
            ),
        }
    }

    /// The class this tensor is counted in.
    pub fn class(self) -> WeightClass {
        let kind = match self {
            WeightTensor::Embed => return WeightClass::Embedding,
            WeightTensor::LmHead => return WeightClass::Head,
            WeightTensor::FinalNorm => return WeightClass::Norms,
            WeightTensor::Layer(kind) => kind,
        };
        match kind {
            _ if kind.expert().is_some() => WeightClass::Experts,
            _ if self.is_vector() => WeightClass::Norms,
            SegmentKind::Router => WeightClass::Router,
            SegmentKind::SharedGate
            | SegmentKind::SharedUp
            | SegmentKind::SharedDown
            | SegmentKind::SharedExpertGate
            | SegmentKind::DenseGate
            | SegmentKind::DenseUp
            | SegmentKind::DenseDown => WeightClass::Shared,
            _ => WeightClass::Attention,
        }
    }
}

impl std::fmt::Display for WeightTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightTensor::Embed => f.write_str("embedding"),
            WeightTensor::FinalNorm => f.write_str("final norm"),
            WeightTensor::LmHead => f.write_str("lm_head"),
            WeightTensor::Layer(kind) if kind.expert().is_some() => {
                let name = format!("{kind:?}");
                write!(f, "{}", name.split('(').next().unwrap_or(&name))
            }
            WeightTensor::Layer(kind) => write!(f, "{kind:?}"),
        }
    }
}

/// The weight classes `--weight-format` and `moec check` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum WeightClass {
    /// Routed experts' projections (and their biases).
    Experts,
    /// Attention projections (q/k/v/o, fused qkv, MLA's).
    Attention,
    /// Shared experts and the leading dense layers' FFN.
    Shared,
    /// The router.
    Router,
    /// Norm weights, attention biases and sinks (vectors, never quantised).
    Norms,
    /// The embedding table.
    Embedding,
    /// The lm_head.
    Head,
}

impl WeightClass {
    /// Every class, in the order `moec check` prints them.
    pub const ALL: [WeightClass; 7] = [
        WeightClass::Experts,
        WeightClass::Attention,
        WeightClass::Shared,
        WeightClass::Router,
        WeightClass::Norms,
        WeightClass::Embedding,
        WeightClass::Head,
    ];

    /// The name on the command line (`experts`).
    pub fn name(self) -> &'static str {
        match self {
            WeightClass::Experts => "experts",
            WeightClass::Attention => "attention",
            WeightClass::Shared => "shared",
            WeightClass::Router => "router",
            WeightClass::Norms => "norms",
            WeightClass::Embedding => "embedding",
            WeightClass::Head => "head",
        }
    }

    /// The class named `name`.
    pub fn parse(name: &str) -> Result<Self, String> {
        let t = name.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|c| c.name() == t)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|c| c.name()).collect();
                format!(
                    "unknown weight class `{name}` (one of {})",
                    names.join(", ")
                )
            })
    }
}

/// The formats of a card's weights beyond its `dtype`: per class, and per tensor (which
/// wins). Empty: every tensor in the card's dtype.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFormats {
    /// Storage of every matrix of a class (vectors keep the card's dtype).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub classes: BTreeMap<WeightClass, Storage>,
    /// Storage of one tensor (every layer's and every expert's of that kind): for a GGUF
    /// checkpoint, the widest format any layer stores it in (each layer's image reserves
    /// that much room; see `LayerLayout::with_storage`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tensors: BTreeMap<WeightTensor, Storage>,
}

impl WeightFormats {
    /// True when no entry is set.
    pub fn is_empty(&self) -> bool {
        self.classes.is_empty() && self.tensors.is_empty()
    }

    /// The storage of `tensor` for a card whose dtype is `dtype`.
    pub fn storage(&self, dtype: WeightDtype, tensor: WeightTensor) -> Storage {
        let tensor = match tensor {
            WeightTensor::Layer(kind) => WeightTensor::layer(kind),
            other => other,
        };
        if let Some(s) = self.tensors.get(&tensor) {
            return *s;
        }
        match self.classes.get(&tensor.class()) {
            Some(s) if !tensor.is_vector() || s.quant().is_none() => *s,
            _ => Storage::Float(dtype),
        }
    }

    /// The formats other than `dtype`, per class (`experts Q4_K Q6_K, head Q6_K`);
    /// `None` when every tensor is in `dtype`.
    pub fn summary(&self, dtype: WeightDtype) -> Option<String> {
        let mut by_class: BTreeMap<WeightClass, Vec<&'static str>> = BTreeMap::new();
        let entries = self
            .classes
            .iter()
            .map(|(c, s)| (*c, *s))
            .chain(self.tensors.iter().map(|(t, s)| (t.class(), *s)));
        for (class, storage) in entries {
            let names = by_class.entry(class).or_default();
            if storage != Storage::Float(dtype) && !names.contains(&storage.name()) {
                names.push(storage.name());
            }
        }
        let parts: Vec<String> = by_class
            .into_iter()
            .filter(|(_, names)| !names.is_empty())
            .map(|(c, names)| format!("{} {}", c.name(), names.join(" ")))
            .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }

    /// Reads `experts=q4_k,attention=q8_0` (classes as [`WeightClass::name`], formats as
    /// [`Storage::parse`]) into the class entries.
    pub fn parse_classes(&mut self, spec: &str) -> Result<(), String> {
        for part in spec.split(',').filter(|p| !p.trim().is_empty()) {
            let Some((class, format)) = part.split_once('=') else {
                return Err(format!(
                    "`{part}`: expected CLASS=FORMAT, e.g. experts=q4_k"
                ));
            };
            let class = WeightClass::parse(class)?;
            let storage = Storage::parse(format)?;
            if class == WeightClass::Norms && storage.quant().is_some() {
                return Err(format!(
                    "norms={}: norm weights, biases and sinks are vectors and stay in a float format",
                    storage.name()
                ));
            }
            self.classes.insert(class, storage);
        }
        Ok(())
    }

    /// Checks every quantised tensor of `arch` (whose card dtype is `dtype`): a matrix
    /// stored `[out, in]` whose rows are whole blocks of its format. The error names the
    /// tensor, its format and what is wrong.
    pub fn check(&self, arch: &ArchSpec, dtype: WeightDtype) -> Result<(), String> {
        let mut tensors: Vec<(WeightTensor, usize, Option<Orientation>)> = vec![
            (WeightTensor::Embed, arch.hidden, Some(Orientation::OutIn)),
            (WeightTensor::LmHead, arch.hidden, Some(Orientation::OutIn)),
            (WeightTensor::FinalNorm, arch.hidden, None),
        ];
        for layer in [0, arch.dense_layers.min(arch.layers.saturating_sub(1))] {
            for kind in LayerLayout::kinds(arch, layer) {
                let (rows, cols, orientation) = LayerLayout::shape_of(arch, kind);
                if rows * cols > 0 {
                    tensors.push((WeightTensor::layer(kind), cols, orientation));
                }
            }
        }
        for (tensor, cols, orientation) in tensors {
            let Storage::Quant(format) = self.storage(dtype, tensor) else {
                continue;
            };
            if tensor.is_vector() || orientation != Some(Orientation::OutIn) {
                return Err(format!(
                    "{tensor} as {format}: moec quantises only matrices stored [out, in] \
                     ({} stores it {})",
                    arch.family.model_type(),
                    if tensor.is_vector() {
                        "as a vector"
                    } else {
                        "[in, out]"
                    }
                ));
            }
            if format.bytes_for(cols).is_none() {
                return Err(format!(
                    "{tensor} as {format}: rows of {cols} weights are not whole {}-weight blocks",
                    format.block_elems()
                ));
            }
        }
        Ok(())
    }
}

/// Bytes of each weight class in the checkpoint buffer `W` of `card` (padding excluded;
/// a tensor in the room its format takes there), with the formats the class holds, in
/// [`WeightClass::ALL`] order; classes the model lacks are left out.
pub fn bytes_by_class(
    card: &crate::model::card::ModelCard,
) -> Vec<(WeightClass, u64, Vec<Storage>)> {
    let arch = ArchSpec::from_card(card);
    let mut out: BTreeMap<WeightClass, (u64, Vec<Storage>)> = BTreeMap::new();
    let mut add = |tensor: WeightTensor, bytes: u64, times: u64| {
        let storage = card.storage(tensor);
        let entry = out.entry(tensor.class()).or_default();
        entry.0 += bytes * times;
        if !entry.1.contains(&storage) {
            entry.1.push(storage);
        }
    };
    let table = |t: WeightTensor| {
        card.storage(t)
            .matrix_bytes(card.vocab, card.hidden)
            .unwrap_or(0)
    };
    add(WeightTensor::Embed, table(WeightTensor::Embed), 1);
    add(WeightTensor::LmHead, table(WeightTensor::LmHead), 1);
    let norm = card.storage(WeightTensor::FinalNorm).bytes_for(card.hidden);
    add(WeightTensor::FinalNorm, norm.unwrap_or(0), 1);
    // Layers of one kind (dense, MoE) share their layout: one of each, times its count.
    let dense = card.dense_layers.min(card.layers);
    for (layer, count) in [(0, dense), (dense, card.layers - dense)] {
        if count == 0 {
            continue;
        }
        let layout = LayerLayout::for_card(card, &arch, layer as usize);
        for seg in &layout.segments {
            add(WeightTensor::layer(seg.kind), seg.len_bytes as u64, count);
        }
    }
    WeightClass::ALL
        .into_iter()
        .filter_map(|c| out.remove(&c).filter(|e| e.0 > 0).map(|(b, s)| (c, b, s)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QuantFormat;

    /// Bytes per weight as ggml's block structs give them: Q4_K 144 bytes per 256 weights
    /// (4.5 bits), Q6_K 210 (6.5625 bits), Q8_0 34 per 32 (8.5 bits).
    #[test]
    fn bytes_follow_the_block_structs() {
        let q4 = Storage::Quant(QuantFormat::Q4K);
        assert_eq!(q4.matrix_bytes(14336, 4096), Some(14336 * 16 * 144));
        assert_eq!(Storage::Quant(QuantFormat::Q6K).bytes_for(256), Some(210));
        assert_eq!(Storage::Quant(QuantFormat::Q8_0).bytes_for(64), Some(68));
        assert_eq!(q4.bytes_for(100), None);
        assert_eq!(Storage::Float(WeightDtype::Bf16).bytes_for(7), Some(14));
    }

    #[test]
    fn classes_apply_to_matrices_and_tensors_win() {
        let mut f = WeightFormats::default();
        f.parse_classes("experts=q4_k, attention=Q8_0").unwrap();
        let bf16 = WeightDtype::Bf16;
        let down = WeightTensor::layer(SegmentKind::ExpertDown(5));
        assert_eq!(f.storage(bf16, down), Storage::Quant(QuantFormat::Q4K));
        assert_eq!(
            f.storage(bf16, WeightTensor::Layer(SegmentKind::VProj)),
            Storage::Quant(QuantFormat::Q8_0)
        );
        assert_eq!(
            f.storage(bf16, WeightTensor::Layer(SegmentKind::AttnNorm)),
            Storage::Float(bf16)
        );
        assert_eq!(f.storage(bf16, WeightTensor::Embed), Storage::Float(bf16));
        f.tensors.insert(
            WeightTensor::Layer(SegmentKind::ExpertDown(0)),
            Storage::Quant(QuantFormat::Q6K),
        );
        assert_eq!(f.storage(bf16, down), Storage::Quant(QuantFormat::Q6K));
    }

    #[test]
    fn bad_specs_are_named() {
        let mut f = WeightFormats::default();
        for (spec, says) in [
            ("experts", "expected CLASS=FORMAT"),
            ("expert=q4_k", "unknown weight class `expert`"),
            ("experts=q5_0", "unknown weight format `q5_0`"),
            ("norms=q8_0", "stay in a float format"),
        ] {
            let e = f.parse_classes(spec).unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    /// A quantised format on rows that are not whole blocks, or on a matrix stored
    /// `[in, out]` (gpt-oss's experts), is refused naming the tensor.
    #[test]
    fn check_names_the_tensor_it_cannot_quantise() {
        let card = crate::model::card::ModelCard::load("mixtral-tiny").unwrap();
        let arch = ArchSpec::from_card(&card);
        let mut f = WeightFormats::default();
        f.parse_classes("experts=q4_k").unwrap();
        let e = f.check(&arch, card.dtype).unwrap_err();
        assert!(
            e.contains("ExpertGate as Q4_K") && e.contains("not whole 256"),
            "{e}"
        );
        let mut f = WeightFormats::default();
        f.parse_classes("experts=q8_0").unwrap();
        f.check(&arch, card.dtype).unwrap();
        let gpt = crate::model::card::ModelCard::load("gpt-oss-tiny").unwrap();
        let e = f.check(&ArchSpec::from_card(&gpt), gpt.dtype).unwrap_err();
        assert!(e.contains("[in, out]"), "{e}");
    }

    /// Mixtral-8x7B's expert bytes are its 45.1B expert weights at 2 bytes (bf16) or
    /// 144/256 bytes (Q4_K): the quantised experts take 4.5/16 of the bf16 bytes.
    #[test]
    fn class_bytes_follow_the_formats() {
        let card = crate::model::card::ModelCard::load("mixtral-8x7b").unwrap();
        let experts = |c: &crate::model::card::ModelCard| {
            bytes_by_class(c)
                .into_iter()
                .find(|(class, _, _)| *class == WeightClass::Experts)
                .unwrap()
        };
        let bf16 = experts(&card);
        assert_eq!(bf16.1, 32 * 8 * 3 * 4096 * 14336 * 2);
        let mut q = card.clone();
        q.formats.parse_classes("experts=q4_k").unwrap();
        let q4 = experts(&q);
        assert_eq!(q4.1 * 64, bf16.1 * 18);
        assert_eq!(q4.2, vec![Storage::Quant(QuantFormat::Q4K)]);
        let norms: u64 = bytes_by_class(&q)
            .iter()
            .filter(|(c, _, _)| *c == WeightClass::Norms)
            .map(|(_, b, _)| *b)
            .sum();
        assert_eq!(norms, (2 * 32 + 1) * 4096 * 2);
    }
}
