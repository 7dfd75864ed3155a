//! Hub tensor names and shapes of every tensor of a checkpoint.
//!
//! Takes an [`ArchSpec`]; gives the full list `(name, shape)` that a Hugging Face
//! checkpoint of that architecture holds, asking the family's module (`weights::family`)
//! where each segment of the layer layout lives. Used to write synthetic checkpoints; the
//! reader resolves the same names segment by segment.

use crate::model::arch::ArchSpec;
use crate::model::family::facts::Family;
use crate::model::layout::LayerLayout;
use crate::model::segment::SegmentKind;
use crate::weights::family::hub::{SegmentTensor, Source};

/// Names of the embedding table and the final norm.
pub fn head_names(family: Family) -> (&'static str, &'static str) {
    crate::weights::family::spec(family).head_names()
}

/// Every tensor of a checkpoint, embedding first, then layer by layer (in the layer
/// image's segment order, each tensor once), then the final norm and the head.
pub fn checkpoint_tensors(a: &ArchSpec) -> Vec<(String, Vec<usize>)> {
    let (embed, norm) = head_names(a.family);
    let mut out = vec![(embed.to_string(), vec![a.vocab, a.hidden])];
    for l in 0..a.layers {
        let first = out.len();
        for kind in LayerLayout::kinds(a, l) {
            let src = segment_source(a, l, kind);
            // DBRX's fused expert tensors hold every expert: list them once.
            if !out[first..].iter().any(|(n, _)| *n == src.name) {
                out.push((src.name, src.shape));
            }
        }
    }
    out.push((norm.to_string(), vec![a.hidden]));
    out.push(("lm_head.weight".to_string(), vec![a.vocab, a.hidden]));
    out
}

/// Where segment `kind` of layer `layer` lives in a checkpoint: tensor name, its full
/// shape, and the row range the segment takes (all rows except fused expert blocks).
pub fn segment_source(a: &ArchSpec, layer: usize, kind: SegmentKind) -> Source {
    match crate::weights::family::spec(a.family).segment_tensor(a, layer, kind) {
        SegmentTensor::Rows(source) => source,
        SegmentTensor::Whole(name) => {
            let (rows, cols, orientation) = LayerLayout::shape_of(a, kind);
            Source {
                shape: if orientation.is_none() {
                    vec![cols]
                } else {
                    vec![rows, cols]
                },
                rows: 0..rows,
                name,
            }
        }
    }
}
