//! The size helpers of the language (`hidden(n)`, `expert_acc(n)`, `layer_weights()`, ...):
//! buffer sizes in bytes, and the layout a weights-shaped buffer implies.

use super::{ROUTE_ENTRY_BYTES, TOKEN_BYTES};
use crate::model::card::ModelCard;

/// A size helper's result: bytes and the layout they imply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelperSize {
    /// Length in bytes.
    pub bytes: u64,
    /// Layout (see [`crate::ir::Layout`]).
    pub layout: crate::ir::Layout,
    /// The layer a layer-shaped slot is sized for (`dense_weights(l)`); `None`: any layer.
    pub layer: Option<u32>,
}

/// Names of the size helpers, for "unknown function" suggestions.
pub const SIZE_HELPERS: [&str; 14] = [
    "hidden",
    "expert_acc",
    "qkv",
    "attn_out",
    "kv_cache",
    "routing",
    "logits",
    "tokens",
    "layer_weights",
    "dense_weights",
    "expert_weights",
    "embed_weights",
    "head_weights",
    "gpu_scratch",
];

/// Evaluates a size helper on integer arguments: `hidden(n)`, `qkv(n)`, `attn_out(n)` (n
/// tokens), `kv_cache(t)` (t tokens of one layer), `routing(n)`, `expert_acc(n)` (n tokens: the
/// gate's normalised rows and top_k output slots each), `logits(s)` and
/// `tokens(s)` (s sequences), `layer_weights()`, `dense_weights()` (or `dense_weights(l)`:
/// layer l's own), `expert_weights(m)`,
/// `embed_weights()`, `head_weights()`, `gpu_scratch(n, s, c)` (the most scratch one GPU
/// task of a micro-batch of n tokens over s sequences of context c takes: a device stream's
/// workspace by `scratch`, the rules of the backend compiled for
/// ([`crate::ir::scratch::DeviceScratch::max_task_bytes`]); without rules, the op catalog's
/// workspace of that task, which the caller says in a warning). `Err` carries the expected
/// argument count.
pub fn size_helper(
    name: &str,
    args: &[u64],
    card: &ModelCard,
    act_bytes: u64,
    kv_bytes: u64,
    scratch: Option<&dyn crate::ir::scratch::DeviceScratch>,
) -> Option<Result<HelperSize, usize>> {
    use crate::ir::Layout;
    let a = act_bytes;
    let raw = |bytes| HelperSize {
        bytes,
        layout: Layout::Raw,
        layer: None,
    };
    let one = |f: &dyn Fn(u64) -> HelperSize| match args {
        [n] => Ok(f(*n)),
        _ => Err(1),
    };
    let none = |size: HelperSize| if args.is_empty() { Ok(size) } else { Err(0) };
    let layout = crate::ir::CheckpointLayout::new(card);
    Some(match name {
        "hidden" => one(&|n| raw(n.saturating_mul(card.hidden * a))),
        "qkv" => one(&|n| raw(n.saturating_mul(card.qkv_width() * a))),
        "attn_out" => one(&|n| raw(n.saturating_mul(card.q_dim() * a))),
        "kv_cache" => one(&|t| raw(t.saturating_mul(card.kv_elems_per_token_layer() * kv_bytes))),
        "routing" => one(&|n| raw(n.saturating_mul(card.top_k * ROUTE_ENTRY_BYTES))),
        // The gate's normalised rows, then one slot per (token, k): expert outputs kept
        // apart so the sum order is fixed.
        "expert_acc" => {
            one(&|n| raw(n.saturating_mul(card.acc_rows_per_token() * card.hidden * a)))
        }
        "logits" => one(&|s| raw(s.saturating_mul(card.vocab * a))),
        "tokens" => one(&|s| raw(s.saturating_mul(TOKEN_BYTES))),
        "layer_weights" => none(HelperSize {
            bytes: layout.slot_layer_bytes(),
            layout: Layout::Layer,
            layer: None,
        }),
        // With a layer, the slot of that layer's own `[pre | o | gate]` (a MoE layer's
        // `gate` is not sized for a dense layer's SwiGLU); without, a slot for any layer.
        "dense_weights" => match args {
            [] => Ok(HelperSize {
                bytes: layout.slot_dense_bytes(),
                layout: Layout::Dense,
                layer: None,
            }),
            [l] => Ok(HelperSize {
                bytes: layout.dense_bytes_of(*l),
                layout: Layout::Dense,
                layer: Some(u32::try_from(*l).unwrap_or(u32::MAX)),
            }),
            _ => Err(1),
        },
        "expert_weights" => one(&|m| HelperSize {
            bytes: m.saturating_mul(layout.expert_bytes),
            layout: Layout::Experts {
                slots: u32::try_from(m).unwrap_or(u32::MAX),
            },
            layer: None,
        }),
        "embed_weights" => none(raw(layout.embed_bytes)),
        "head_weights" => none(raw(layout.head_bytes)),
        "gpu_scratch" => match args {
            [n, s, c] => Ok(raw(match scratch {
                Some(rules) => rules.max_task_bytes(card, *n, *s, *c),
                None => crate::ir::scratch::catalog_max_task_bytes(
                    card,
                    &crate::ir::catalog::Shape {
                        act_bytes: a,
                        kv_bytes,
                        ..crate::ir::scratch::max_task_shape(*n, *s, *c)
                    },
                ),
            })),
            _ => Err(3),
        },
        _ => return None,
    })
}
