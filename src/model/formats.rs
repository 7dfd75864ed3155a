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
//! (`WeightFormats::check`, with the layout that knows each tensor's shape, names the
//! tensor otherwise).

use crate::model::segment::SegmentKind;
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
    /// Per layer, the tensors a GGUF checkpoint stores in another format than `tensors`
    /// gives (a narrower one: `tensors` holds the widest): llama.cpp's Q4_K_M keeps
    /// `ffn_down` and `attn_v` in Q6_K in some layers and Q4_K in the others. The image's
    /// geometry stays the slot's; these say what each layer really holds, so the host
    /// budget counts the file's bytes rather than the slots' (`cost::budget`). Set when a
    /// GGUF is opened; not part of a card file.
    #[serde(skip)]
    pub layers: BTreeMap<u64, LayerStorage>,
}

/// One layer's tensors stored in another format than the card's (`WeightFormats::layers`):
/// named here so the compiler's stages read them through the model's description.
pub type LayerStorage = BTreeMap<WeightTensor, Storage>;

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

    /// The storage of `tensor` in layer `layer`: the layer's own where a checkpoint stores
    /// it in another format than the others (`layers`), else [`WeightFormats::storage`].
    pub fn layer_storage(&self, dtype: WeightDtype, layer: u64, tensor: WeightTensor) -> Storage {
        let tensor = match tensor {
            WeightTensor::Layer(kind) => WeightTensor::layer(kind),
            other => other,
        };
        self.layers
            .get(&layer)
            .and_then(|own| own.get(&tensor))
            .copied()
            .unwrap_or_else(|| self.storage(dtype, tensor))
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
            ("experts=q5_1", "unknown weight format `q5_1`"),
            ("norms=q8_0", "stay in a float format"),
        ] {
            let e = f.parse_classes(spec).unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }
}
