//! The op table: one [`OpDef`] per op, each followed by the functions it names (build,
//! value signature, flops, bytes, workspace).
//!
//! Takes nothing; gives [`OPS`], indexed by [`OpKind`]. Adding an op is one entry here
//! (plus its `Op` variant and `OpKind`) and one kernel per backend; the entry names its
//! [`CostClass`], which the cost model matches on exhaustively. The tests at the end pin
//! that the table is consistent with itself (kinds in order, unique names, signatures
//! that list exactly the declared arguments, builds that round-trip, cost classes that
//! fit the work formulas).

use super::table::{
    ArgDef, ArgType, CostClass, OpDef, OpForm, OpKind, RooflineReason, StaticParam, WorkDef,
};
use super::work::routed_tokens;
use super::{AttnPart, ExpertRef, ExpertSet, Op, RoleSig, Shape, ROUTE_ENTRY_BYTES, TOKEN_BYTES};
use crate::ir::value::{Point, Rows, Tensor};
use crate::ir::{Access, CheckpointLayout, Engine, Role};
use crate::model::card::ModelCard;
use crate::model::formats::WeightTensor;
use crate::model::segment::SegmentKind;

use Access::{Read, ReadWrite, Write};
use StaticParam::{Layer, Part, Set, Ub};

/// Compute ops run on either compute engine (the checker's engine/space rules then keep
/// their arguments in that engine's memory).
const COMPUTE: &[Engine] = &[Engine::GpuCompute, Engine::CpuCompute];

/// The op table, in [`OpKind::ALL`] order.
pub static OPS: [OpDef; OpKind::ALL.len()] = [
    EMBED, PRE_ATTN, ATTN, POST_ATTN, O_PROJ, GATE, PREGATE, EXPERTS, COMBINE, LM_HEAD, SAMPLE,
    COPY,
];

/// The shape and card dimensions as f64, for the formulas below.
struct Dims {
    n: f64,
    s: f64,
    c: f64,
    h: f64,
    q: f64,
    kv: f64,
    e: f64,
    k: f64,
    f: f64,
    /// Shared expert width (0 without one).
    fs: f64,
    /// Multiply-adds per token of the `pre_attn` projections (MLA: its own chain).
    pre_macs: f64,
    /// Multiply-adds per token of the output projection (MLA: `W_uv` then `o_proj`).
    o_macs: f64,
    /// 1 with a sigmoid-gated shared expert, else 0.
    sg: f64,
    a: f64,
    vocab: f64,
}

impl Dims {
    fn new(card: &ModelCard, shape: &Shape) -> Dims {
        Dims {
            n: shape.tokens as f64,
            s: shape.seqs as f64,
            c: shape.context as f64,
            h: card.hidden as f64,
            q: card.q_dim() as f64,
            kv: card.kv_dim() as f64,
            pre_macs: card.pre_attn_macs_per_token() as f64,
            o_macs: card.o_proj_macs_per_token() as f64,
            e: card.experts as f64,
            k: card.top_k as f64,
            f: card.ffn as f64,
            fs: card.shared_ffn as f64,
            sg: f64::from(u8::from(card.shared_gate)),
            a: shape.act_bytes as f64,
            vocab: card.vocab as f64,
        }
    }

    /// Flops of an RMS/Layer norm over the micro-batch's rows.
    fn norm(&self) -> f64 {
        4.0 * self.n * self.h
    }

    /// Flops of the experts' SwiGLU FFN over `routed` token-expert pairs.
    fn expert_flops(&self, routed: f64) -> f64 {
        2.0 * routed * 3.0 * self.h * self.f
    }

    /// Flops of the shared expert (every token, with its sigmoid gate); 0 without one.
    fn shared_flops(&self) -> f64 {
        2.0 * self.n * 3.0 * self.h * self.fs + self.sg * (2.0 * self.n * self.h + 4.0 * self.n)
    }

    /// Expert weights that can be active: at most one expert per routed (token, k).
    fn active_experts(&self, in_set: f64) -> f64 {
        in_set.min(self.n * self.k)
    }

    /// Bytes of one activation row block of `width` elements per token.
    fn rows(&self, width: f64) -> f64 {
        self.n * width * self.a
    }

    fn routing_bytes(&self) -> f64 {
        self.n * self.k * ROUTE_ENTRY_BYTES as f64
    }

    /// The dimensions of `op`'s layer: a leading dense layer has no router and no routed
    /// expert, and its SwiGLU of `dense_ffn` takes the shared expert's place (ungated).
    fn at_layer(mut self, op: &Op, card: &ModelCard) -> Dims {
        if dense_layer(op, card) {
            self.e = 0.0;
            self.fs = card.dense_ffn as f64;
            self.sg = 0.0;
        }
        self
    }
}

/// Bytes of MLA's `kv_b_proj` key rows (`W_uk`, heads x qk_nope) and value rows (`W_uv`,
/// heads x v_head_dim); (0, 0) without MLA. The packed layer holds the whole tensor in both
/// its `pre` and its `o` part (each op reads its part of `W` only), but `pre_attn` reads
/// only the key rows and `o_proj` only the value rows, so each is charged its own rows and
/// the tensor is counted once per layer. (0, 0) too where the checkpoint stores it split
/// (`Mla::kv_b_split`): `pre` then holds only `attn_k_b` and `o` only `attn_v_b`, each read
/// whole.
fn kv_b_rows_bytes(card: &ModelCard) -> (u64, u64) {
    card.mla.filter(|m| !m.kv_b_split).map_or((0, 0), |m| {
        let per_row = card
            .storage(WeightTensor::Layer(SegmentKind::KvB))
            .bytes_for(m.kv_lora_rank)
            .unwrap_or(0);
        (
            card.heads * m.qk_nope_head_dim * per_row,
            card.heads * m.v_head_dim * per_row,
        )
    })
}

/// Bytes of one `hidden`-wide row of `tensor` as the card stores it.
fn row_bytes(card: &ModelCard, tensor: WeightTensor) -> f64 {
    card.storage(tensor).bytes_for(card.hidden).unwrap_or(0) as f64
}

/// True when `op` works on one of the card's leading dense layers.
fn dense_layer(op: &Op, card: &ModelCard) -> bool {
    op.layer()
        .is_some_and(|l| card.is_dense_layer(u64::from(l)))
}

fn sig(role: Role, access: Access, expects: Vec<Tensor>, produces: Option<Tensor>) -> RoleSig {
    RoleSig {
        role,
        access,
        expects,
        may_be_empty: false,
        optional: false,
        produces,
    }
}

fn residual(ub: u32, layer: u32, point: Point) -> Tensor {
    Tensor::Residual { ub, layer, point }
}

fn no_workspace(_: &Op, _: &ModelCard, _: &Shape) -> u64 {
    0
}

// ---------------------------------------------------------------------------------------
// embed

const EMBED: OpDef = OpDef {
    kind: OpKind::Embed,
    name: "embed",
    summary: "token embedding of a micro-batch: the prompt, or the tokens sampled last step",
    form: OpForm::Call,
    params: &[Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        // `tokens` makes the dependency on the previous step's `sample` explicit; without
        // it the ids come from the runtime's batch (the prompt in prefill).
        ArgDef::new(Role::Tokens, ArgType::Tokens, Read).optional(),
        ArgDef::new(Role::H, ArgType::Hidden, Write),
    ],
    engines: COMPUTE,
    build: |s| Ok(Op::Embed { ub: s.ub()? }),
    signature: embed_signature,
    work: WorkDef {
        flops: |_, _, _| 0.0,
        bytes: embed_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::Roofline(RooflineReason::Gather),
};

fn embed_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let ub = op.ub().unwrap_or(0);
    vec![
        sig(Role::W, Read, vec![Tensor::Embedding], None),
        RoleSig {
            optional: true,
            ..sig(Role::Tokens, Read, vec![Tensor::Tokens { ub }], None)
        },
        sig(Role::H, Write, vec![], Some(residual(ub, 0, Point::In))),
    ]
}

fn embed_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    _: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        // One row of the table per token, in its stored format.
        Role::W => d.n * row_bytes(card, WeightTensor::Embed),
        Role::Tokens => d.s * TOKEN_BYTES as f64,
        Role::H => d.rows(d.h),
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// pre_attn

const PRE_ATTN: OpDef = OpDef {
    kind: OpKind::PreAttn,
    name: "pre_attn",
    summary: "input norm, QKV projection (DBRX: fused and clipped), rotary embedding",
    form: OpForm::Call,
    params: &[Layer, Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, Read),
        ArgDef::new(Role::Out, ArgType::Qkv, Write),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::PreAttn {
            layer: s.layer()?,
            ub: s.ub()?,
        })
    },
    signature: pre_attn_signature,
    work: WorkDef {
        flops: |_, card, shape| {
            let d = Dims::new(card, shape);
            d.norm() + 2.0 * d.n * d.pre_macs + 3.0 * d.n * (d.q + d.kv)
        },
        bytes: pre_attn_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::Linear,
};

fn pre_attn_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    vec![
        sig(Role::W, Read, vec![Tensor::Pre { layer }], None),
        sig(Role::H, Read, vec![residual(ub, layer, Point::In)], None),
        sig(Role::Out, Write, vec![], Some(Tensor::Qkv { layer, ub })),
    ]
}

fn pre_attn_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        // MLA: `pre` holds all of `kv_b_proj` but reads only its key rows (`W_uk`).
        Role::W => (layout.pre_bytes - kv_b_rows_bytes(card).1) as f64,
        Role::H => d.rows(d.h),
        Role::Out => d.n * card.qkv_width() as f64 * d.a,
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// attn

const ATTN: OpDef = OpDef {
    kind: OpKind::Attn,
    name: "attn",
    summary: "append K/V to the cache and run causal grouped-query attention",
    form: OpForm::Call,
    params: &[Layer, Ub, Part],
    args: &[
        ArgDef::new(Role::Qkv, ArgType::Qkv, Read),
        // Prefill writes a fresh cache and may go without one (attend over the new tokens
        // only); decode and mixed attention append to what is cached.
        ArgDef::new(Role::Kv, ArgType::KvCache, ReadWrite).optional(),
        ArgDef::new(Role::Out, ArgType::AttnOut, Write),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::Attn {
            layer: s.layer()?,
            ub: s.ub()?,
            part: s.part()?,
        })
    },
    signature: attn_signature,
    work: WorkDef {
        flops: |op, card, shape| {
            let d = Dims::new(card, shape);
            match attn_part(op) {
                // Causal over the prompt: half the square.
                AttnPart::Prefill => 4.0 * d.q * d.s * d.c * (d.c + 1.0) / 2.0,
                AttnPart::Decode | AttnPart::All => 4.0 * d.q * d.n * d.c,
            }
        },
        bytes: attn_bytes,
        // The scores of one key block (1024 keys) per query row and head.
        workspace: |_, card, shape| {
            shape.tokens * card.heads * shape.context.min(1024) * shape.act_bytes
        },
    },
    cost: CostClass::Attention,
};

fn attn_part(op: &Op) -> AttnPart {
    match op {
        Op::Attn { part, .. } => *part,
        _ => AttnPart::All,
    }
}

fn attn_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub, part) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0), attn_part(op));
    let prefill = part == AttnPart::Prefill;
    vec![
        sig(Role::Qkv, Read, vec![Tensor::Qkv { layer, ub }], None),
        // Prefill starts the sequences' caches afresh; decode and mixed attention append to
        // what is cached (a mixed step's first run has nothing cached yet: the checker
        // accepts an unwritten cache there).
        RoleSig {
            role: Role::Kv,
            access: if prefill { Write } else { ReadWrite },
            expects: if prefill {
                vec![]
            } else {
                vec![Tensor::KvCache { layer, ub }]
            },
            may_be_empty: part == AttnPart::All,
            optional: prefill,
            produces: Some(Tensor::KvCache { layer, ub }),
        },
        sig(
            Role::Out,
            Write,
            vec![],
            Some(Tensor::AttnOut {
                layer,
                ub,
                rows: part.rows(),
            }),
        ),
    ]
}

fn attn_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    _: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        // Every part appends the new tokens' K/V and reads each sequence's context.
        // At the cache's element width (`kv_bytes`: halves under `--kv-type f16`).
        Role::Kv => {
            let e = shape.kv_bytes as f64;
            d.n * 2.0 * d.kv * e + d.s * d.c * 2.0 * d.kv * e
        }
        Role::Qkv => d.n * card.qkv_width() as f64 * d.a,
        Role::Out => d.rows(d.q),
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// post_attn

const POST_ATTN: OpDef = OpDef {
    kind: OpKind::PostAttn,
    name: "post_attn",
    summary: "O projection + residual, gate, every routed expert, combine + residual",
    form: OpForm::Call,
    params: &[Layer, Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        // Two `a` slices (VSLPipe): the prefill sequences' rows and the decode ones'.
        ArgDef::new(Role::A, ArgType::AttnOut, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, ReadWrite),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::PostAttn {
            layer: s.layer()?,
            ub: s.ub()?,
        })
    },
    signature: post_attn_signature,
    work: WorkDef {
        flops: |op, card, shape| {
            let d = Dims::new(card, shape).at_layer(op, card);
            let routed = if dense_layer(op, card) {
                0.0
            } else {
                d.n * d.k
            };
            2.0 * d.n * d.o_macs
                + d.norm()
                + 2.0 * d.n * d.h * d.e
                + d.expert_flops(routed)
                + d.shared_flops()
                + 3.0 * d.n * d.h
        },
        bytes: post_attn_bytes,
        workspace: post_attn_workspace,
    },
    cost: CostClass::FusedPostAttn,
};

/// What the fused layer holds beside its arguments, as the CPU kernel allocates it: the
/// attention rows merged for the O projection (`q_dim` a token), then the MoE's normalised
/// rows, one slot per (token, k) and the shared expert's output (`hidden` each), and one
/// expert's gathered rows with their gate and up values (an expert meets each token at
/// most once); a dense layer's gate and up values instead. On an 8,192-token Qwen3-30B-A3B
/// prefill that is 856 MB, most of it the slots; it counted only gate/up values for every
/// (token, k) before (403 MB), where the kernel runs the experts one at a time.
fn post_attn_workspace(op: &Op, card: &ModelCard, shape: &Shape) -> u64 {
    let per_token = if dense_layer(op, card) {
        card.q_dim() + 2 * card.dense_ffn
    } else {
        let shared = if card.shared_ffn > 0 { card.hidden } else { 0 };
        card.q_dim() + (card.top_k + 1) * card.hidden + shared + card.hidden + 2 * card.ffn
    };
    shape.tokens * per_token * shape.act_bytes
}

fn post_attn_signature(op: &Op, card: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    let mut weights = vec![Tensor::O { layer }, Tensor::Gate { layer }];
    let routed = if dense_layer(op, card) {
        0
    } else {
        card.experts as u32
    };
    weights.extend((0..routed).map(|e| Tensor::Expert {
        layer,
        expert: ExpertRef::Index(e),
    }));
    vec![
        sig(Role::W, Read, weights, None),
        sig(Role::A, Read, vec![attn_out_all(layer, ub)], None),
        sig(
            Role::H,
            ReadWrite,
            vec![residual(ub, layer, Point::In)],
            Some(residual(ub, layer + 1, Point::In)),
        ),
    ]
}

fn attn_out_all(layer: u32, ub: u32) -> Tensor {
    Tensor::AttnOut {
        layer,
        ub,
        rows: Rows::All,
    }
}

fn post_attn_bytes(
    op: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape).at_layer(op, card);
    let layer = u64::from(op.layer().unwrap_or(0));
    match role {
        Role::W => {
            (layout.o_bytes - kv_b_rows_bytes(card).0 + layout.gate_bytes_of(layer)) as f64
                + d.active_experts(d.e) * layout.expert_bytes as f64
        }
        Role::A => d.rows(d.q),
        Role::H => 2.0 * d.rows(d.h),
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// o_proj

const O_PROJ: OpDef = OpDef {
    kind: OpKind::OProj,
    name: "o_proj",
    summary: "O projection + residual (the first part of post_attn)",
    form: OpForm::Call,
    params: &[Layer, Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        ArgDef::new(Role::A, ArgType::AttnOut, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, ReadWrite),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::OProj {
            layer: s.layer()?,
            ub: s.ub()?,
        })
    },
    signature: o_proj_signature,
    work: WorkDef {
        flops: |_, card, shape| {
            let d = Dims::new(card, shape);
            2.0 * d.n * d.o_macs + d.n * d.h
        },
        bytes: o_proj_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::Linear,
};

fn o_proj_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    vec![
        sig(Role::W, Read, vec![Tensor::O { layer }], None),
        sig(Role::A, Read, vec![attn_out_all(layer, ub)], None),
        sig(
            Role::H,
            ReadWrite,
            vec![residual(ub, layer, Point::In)],
            Some(residual(ub, layer, Point::Mid)),
        ),
    ]
}

fn o_proj_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        // MLA: `o` holds all of `kv_b_proj` but reads only its value rows (`W_uv`).
        Role::W => (layout.o_bytes - kv_b_rows_bytes(card).0) as f64,
        Role::A => d.rows(d.q),
        Role::H => 2.0 * d.rows(d.h),
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// gate

const GATE: OpDef = OpDef {
    kind: OpKind::Gate,
    name: "gate",
    summary: "post-attention norm, router softmax, top-k; zeroes the expert accumulator",
    form: OpForm::Call,
    params: &[Layer, Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, Read),
        ArgDef::new(Role::Route, ArgType::Routing, Write),
        ArgDef::new(Role::Acc, ArgType::ExpertAcc, Write),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::Gate {
            layer: s.layer()?,
            ub: s.ub()?,
        })
    },
    signature: gate_signature,
    work: WorkDef {
        flops: |op, card, shape| {
            let d = Dims::new(card, shape).at_layer(op, card);
            d.norm() + 2.0 * d.n * d.h * d.e + 5.0 * d.n * d.e + d.shared_flops()
        },
        bytes: gate_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::Linear,
};

fn gate_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    vec![
        sig(Role::W, Read, vec![Tensor::Gate { layer }], None),
        sig(Role::H, Read, vec![residual(ub, layer, Point::Mid)], None),
        sig(
            Role::Route,
            Write,
            vec![],
            Some(Tensor::Routing { layer, ub }),
        ),
        sig(
            Role::Acc,
            Write,
            vec![],
            Some(Tensor::ExpertAcc { layer, ub }),
        ),
    ]
}

fn gate_bytes(
    op: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    let layer = u64::from(op.layer().unwrap_or(0));
    match role {
        Role::W => layout.gate_bytes_of(layer) as f64,
        Role::H => d.rows(d.h),
        Role::Route => d.routing_bytes(),
        // The gate writes the normalised rows, zeroes every (token, k) slot and writes the
        // shared expert's rows (families with one).
        Role::Acc => d.n * card.acc_rows_per_token() as f64 * d.h * d.a,
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// pregate

const PREGATE: OpDef = OpDef {
    kind: OpKind::Pregate,
    name: "pregate",
    summary:
        "lookahead gating: layer l's router over the hidden state entering layer l - 1's MoE block",
    form: OpForm::Call,
    params: &[Layer, Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, Read),
        ArgDef::new(Role::Route, ArgType::Routing, Write),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::Pregate {
            layer: s.layer()?,
            ub: s.ub()?,
        })
    },
    signature: pregate_signature,
    work: WorkDef {
        // The norm and the router only (no shared expert, no accumulator).
        flops: |op, card, shape| {
            let d = Dims::new(card, shape).at_layer(op, card);
            d.norm() + 2.0 * d.n * d.h * d.e + 5.0 * d.n * d.e
        },
        bytes: pregate_bytes,
        // The normalised rows, on the side.
        workspace: |_, card, shape| shape.tokens * card.hidden * shape.act_bytes,
    },
    cost: CostClass::Linear,
};

/// Reads layer `layer`'s router (its `gate` part) and the hidden state `gate(layer - 1)`
/// reads; writes the lookahead routing of layer `layer`. Layer 0 (nothing before it) is
/// rejected at elaboration.
fn pregate_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    vec![
        sig(Role::W, Read, vec![Tensor::Gate { layer }], None),
        sig(
            Role::H,
            Read,
            vec![residual(ub, layer.saturating_sub(1), Point::Mid)],
            None,
        ),
        sig(
            Role::Route,
            Write,
            vec![],
            Some(Tensor::Lookahead { layer, ub }),
        ),
    ]
}

fn pregate_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    _: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        // The norm and router rows of the layer's gate part (not a shared expert's).
        Role::W => {
            row_bytes(card, WeightTensor::Layer(SegmentKind::FfnNorm))
                + row_bytes(card, WeightTensor::Layer(SegmentKind::Router)) * d.e
        }
        Role::H => d.rows(d.h),
        Role::Route => d.routing_bytes(),
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// experts

const EXPERTS: OpDef = OpDef {
    kind: OpKind::Experts,
    name: "experts",
    summary: "some experts over the tokens routed to them, into the accumulator's slots",
    form: OpForm::Call,
    params: &[Layer, Ub, Set],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        ArgDef::new(Role::Route, ArgType::Routing, Read),
        ArgDef::new(Role::Acc, ArgType::ExpertAcc, ReadWrite),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::Experts {
            layer: s.layer()?,
            ub: s.ub()?,
            set: s.set()?,
        })
    },
    signature: experts_signature,
    work: WorkDef {
        flops: |op, card, shape| {
            Dims::new(card, shape).expert_flops(layer_routed_tokens(op, card, shape))
        },
        bytes: experts_bytes,
        // The gate/up intermediates of the routed tokens, at most one row per token.
        workspace: |op, card, shape| {
            let routed = layer_routed_tokens(op, card, shape).ceil() as u64;
            routed.min(shape.tokens) * card.ffn * 2 * shape.act_bytes
        },
    },
    cost: CostClass::ExpertFfn,
};

fn expert_set(op: &Op) -> ExpertSet {
    match op {
        Op::Experts { set, .. } => *set,
        _ => ExpertSet::All,
    }
}

/// Token-expert pairs an `experts` task computes on average; none on a dense layer.
fn layer_routed_tokens(op: &Op, card: &ModelCard, shape: &Shape) -> f64 {
    if dense_layer(op, card) {
        0.0
    } else {
        routed_tokens(&expert_set(op), card, shape)
    }
}

fn experts_signature(op: &Op, card: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    // A dense layer routes no token to any expert: the task reads no expert's weights.
    let members = if dense_layer(op, card) {
        Vec::new()
    } else {
        expert_set(op).members(card.experts)
    };
    let weights = members
        .into_iter()
        .map(|expert| Tensor::Expert { layer, expert })
        .collect();
    // The normalised rows the experts read are in `acc` (the gate put them there), so
    // `experts` needs no `h`: the residual may move on meanwhile.
    vec![
        sig(Role::W, Read, weights, None),
        sig(Role::Route, Read, vec![Tensor::Routing { layer, ub }], None),
        sig(
            Role::Acc,
            ReadWrite,
            vec![Tensor::ExpertAcc { layer, ub }],
            Some(Tensor::ExpertAcc { layer, ub }),
        ),
    ]
}

fn experts_bytes(
    op: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    let set = expert_set(op);
    let in_set = if dense_layer(op, card) {
        0.0
    } else {
        set.len(card.experts) as f64
    };
    match role {
        Role::W => d.active_experts(in_set) * layout.expert_bytes as f64,
        Role::Route => d.routing_bytes(),
        Role::Acc => 2.0 * layer_routed_tokens(op, card, shape) * d.h * d.a,
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// combine

const COMBINE: OpDef = OpDef {
    kind: OpKind::Combine,
    name: "combine",
    summary: "adds the routing-weighted expert outputs to the residual stream",
    form: OpForm::Call,
    params: &[Layer, Ub],
    args: &[
        ArgDef::new(Role::Route, ArgType::Routing, Read),
        // A list when experts of one layer write partial accumulators on several engines
        // (Fiddler: GPU and CPU experts); their slots are added.
        ArgDef::new(Role::Acc, ArgType::ExpertAcc, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, ReadWrite),
    ],
    engines: COMPUTE,
    build: |s| {
        Ok(Op::Combine {
            layer: s.layer()?,
            ub: s.ub()?,
        })
    },
    signature: combine_signature,
    work: WorkDef {
        flops: |_, card, shape| {
            let d = Dims::new(card, shape);
            d.n * d.h
        },
        bytes: combine_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::Roofline(RooflineReason::Elementwise),
};

fn combine_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let (layer, ub) = (op.layer().unwrap_or(0), op.ub().unwrap_or(0));
    vec![
        sig(Role::Route, Read, vec![Tensor::Routing { layer, ub }], None),
        sig(Role::Acc, Read, vec![Tensor::ExpertAcc { layer, ub }], None),
        sig(
            Role::H,
            ReadWrite,
            vec![residual(ub, layer, Point::Mid)],
            Some(residual(ub, layer + 1, Point::In)),
        ),
    ]
}

fn combine_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    _: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        Role::Route => d.routing_bytes(),
        // Combine reads the top_k slots of every token.
        Role::Acc => d.n * d.k * d.h * d.a,
        Role::H => 2.0 * d.rows(d.h),
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// lm_head

const LM_HEAD: OpDef = OpDef {
    kind: OpKind::LmHead,
    name: "lm_head",
    summary: "final norm and logits of the last token of each sequence",
    form: OpForm::Call,
    params: &[Ub],
    args: &[
        ArgDef::new(Role::W, ArgType::Weights, Read).list(),
        ArgDef::new(Role::H, ArgType::Hidden, Read),
        ArgDef::new(Role::Logits, ArgType::Logits, Write),
    ],
    engines: COMPUTE,
    build: |s| Ok(Op::LmHead { ub: s.ub()? }),
    signature: lm_head_signature,
    work: WorkDef {
        flops: |_, card, shape| {
            let d = Dims::new(card, shape);
            4.0 * d.s * d.h + 2.0 * d.s * d.h * d.vocab
        },
        bytes: lm_head_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::LinearPerSequence,
};

fn lm_head_signature(op: &Op, card: &ModelCard) -> Vec<RoleSig> {
    let ub = op.ub().unwrap_or(0);
    vec![
        sig(Role::W, Read, vec![Tensor::Head], None),
        sig(
            Role::H,
            Read,
            vec![residual(ub, card.layers as u32, Point::In)],
            None,
        ),
        sig(Role::Logits, Write, vec![], Some(Tensor::Logits { ub })),
    ]
}

fn lm_head_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    layout: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        Role::W => layout.head_bytes as f64,
        // Only the last row of each sequence.
        Role::H => d.s * d.h * d.a,
        Role::Logits => d.s * d.vocab * d.a,
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// sample

const SAMPLE: OpDef = OpDef {
    kind: OpKind::Sample,
    name: "sample",
    summary: "picks the next token of each sequence (greedy or temperature)",
    form: OpForm::Call,
    params: &[Ub],
    args: &[
        ArgDef::new(Role::Logits, ArgType::Logits, Read),
        ArgDef::new(Role::Tokens, ArgType::Tokens, Write),
    ],
    engines: COMPUTE,
    build: |s| Ok(Op::Sample { ub: s.ub()? }),
    signature: sample_signature,
    work: WorkDef {
        flops: |_, card, shape| shape.seqs as f64 * card.vocab as f64,
        bytes: sample_bytes,
        workspace: no_workspace,
    },
    cost: CostClass::Roofline(RooflineReason::RowReduction),
};

fn sample_signature(op: &Op, _: &ModelCard) -> Vec<RoleSig> {
    let ub = op.ub().unwrap_or(0);
    vec![
        sig(Role::Logits, Read, vec![Tensor::Logits { ub }], None),
        sig(Role::Tokens, Write, vec![], Some(Tensor::Tokens { ub })),
    ]
}

fn sample_bytes(
    _: &Op,
    role: Role,
    card: &ModelCard,
    _: &CheckpointLayout,
    shape: &Shape,
    len: u64,
) -> f64 {
    let d = Dims::new(card, shape);
    match role {
        Role::Logits => d.s * d.vocab * d.a,
        Role::Tokens => d.s * TOKEN_BYTES as f64,
        _ => len as f64,
    }
}

// ---------------------------------------------------------------------------------------
// copy

const COPY: OpDef = OpDef {
    kind: OpKind::Copy,
    name: "copy",
    summary: "a byte copy between two slices of equal length",
    form: OpForm::CopyStatement,
    params: &[],
    args: &[
        ArgDef::new(Role::Src, ArgType::Bytes, Read),
        ArgDef::new(Role::Dst, ArgType::Bytes, Write),
    ],
    // Every engine can copy; the checker's engine/space rules decide which pairs of
    // spaces each may copy between.
    engines: &Engine::ALL,
    build: |_| Ok(Op::Copy),
    // No expectation: a copy's value is whatever its source holds.
    signature: |_, _| {
        vec![
            sig(Role::Src, Read, vec![], None),
            sig(Role::Dst, Write, vec![], None),
        ]
    },
    work: WorkDef {
        flops: |_, _, _| 0.0,
        bytes: |_, _, _, _, _, len| len as f64,
        workspace: no_workspace,
    },
    cost: CostClass::Copy,
};

#[cfg(test)]
mod tests {
    use super::super::StaticArgs;
    use super::*;

    /// One op of each kind, with static parameters that exercise its variants.
    fn samples(kind: OpKind) -> Vec<StaticArgs> {
        let base = StaticArgs {
            layer: Some(1),
            ub: Some(0),
            ..StaticArgs::default()
        };
        match kind {
            OpKind::Attn => [AttnPart::Prefill, AttnPart::Decode, AttnPart::All]
                .into_iter()
                .map(|part| StaticArgs {
                    part: Some(part),
                    ..base
                })
                .collect(),
            OpKind::Experts => [
                ExpertSet::All,
                ExpertSet::Range { start: 1, end: 3 },
                ExpertSet::One(ExpertRef::Hot { layer: 1, rank: 0 }),
            ]
            .into_iter()
            .map(|set| StaticArgs {
                set: Some(set),
                ..base
            })
            .collect(),
            _ => vec![base],
        }
    }

    /// DeepSeek-V2-Lite by hand: `kv_b_proj` is 16 heads x (128 + 128) rows x 512 x 2 bytes
    /// = 4,194,304 bytes, counted once over `pre_attn` (key rows) and `o_proj` (value
    /// rows); its dense layer 0 charges its own `gate` (norm + 3 x 2048 x 10944 x 2 bytes)
    /// and no expert, its MoE layer 1 the router, shared experts and its active experts.
    #[test]
    fn deepseek_weights_are_charged_once_and_per_layer() {
        let card = ModelCard::load("deepseek-v2-lite").unwrap();
        let layout = CheckpointLayout::new(&card);
        let shape = Shape {
            tokens: 1,
            seqs: 1,
            context: 0,
            act_bytes: 4,
            kv_bytes: 4,
        };
        let w = |op: Op| super::super::role_traffic(&op, Role::W, &card, &shape, u64::MAX).1;
        let pre = w(Op::PreAttn { layer: 1, ub: 0 });
        let o = w(Op::OProj { layer: 1, ub: 0 });
        let kv_b = 16 * 256 * 512 * 2;
        assert_eq!((pre + o) as u64, layout.pre_bytes + layout.o_bytes - kv_b);
        assert_eq!(layout.dense_gate_bytes, 2048 * 2 + 3 * 2048 * 10944 * 2);
        assert_eq!(
            w(Op::Gate { layer: 0, ub: 0 }) as u64,
            layout.dense_gate_bytes
        );
        assert_eq!(w(Op::Gate { layer: 1, ub: 0 }) as u64, layout.gate_bytes);
        let all = ExpertSet::All;
        assert_eq!(
            w(Op::Experts {
                layer: 0,
                ub: 0,
                set: all
            }),
            0.0
        );
        // One token: its top-6 experts.
        assert_eq!(
            w(Op::Experts {
                layer: 1,
                ub: 0,
                set: all
            }) as u64,
            6 * layout.expert_bytes
        );
        let flops = |op: Op| super::super::flops(&op, &card, &shape);
        assert_eq!(
            flops(Op::Experts {
                layer: 0,
                ub: 0,
                set: all
            }),
            0.0
        );
        // The dense SwiGLU of layer 0 (2 x 3 x 2048 x 10944) against the router, 6 experts
        // and 2 shared of width 1408 of layer 1.
        let gate0 = flops(Op::Gate { layer: 0, ub: 0 });
        assert!((gate0 - (4.0 * 2048.0 + 2.0 * 3.0 * 2048.0 * 10944.0)).abs() < 1.0);
    }

    #[test]
    fn table_is_indexed_by_kind_and_names_are_unique() {
        for (i, kind) in OpKind::ALL.iter().enumerate() {
            assert_eq!(OPS[i].kind, *kind, "OPS[{i}]");
            assert_eq!(kind.def().kind, *kind);
            assert_eq!(
                super::super::op_by_name(kind.name()).map(|d| d.kind),
                Some(*kind)
            );
        }
        let mut names: Vec<&str> = OPS.iter().map(|d| d.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), OPS.len());
    }

    /// The value signature lists exactly the declared arguments, in order, never with a
    /// wider access than declared, optional only where the table allows it; `build` and
    /// `Op::statics` are inverses; every declared static parameter is needed by `build`.
    #[test]
    fn every_entry_agrees_with_its_signature_and_build() {
        let card = ModelCard::load("mixtral-tiny").unwrap();
        for def in &OPS {
            for statics in samples(def.kind) {
                let op = (def.build)(&statics).unwrap();
                assert_eq!(op.kind(), def.kind);
                let kept = op.statics();
                for param in def.params {
                    let mut without = kept;
                    match param {
                        Layer => without.layer = None,
                        Ub => without.ub = None,
                        Part => without.part = None,
                        Set => without.set = None,
                    }
                    assert_eq!((def.build)(&without), Err(*param), "{}", def.name);
                }
                assert_eq!((def.build)(&kept), Ok(op));
                let signature = (def.signature)(&op, &card);
                let roles: Vec<Role> = signature.iter().map(|s| s.role).collect();
                let declared: Vec<Role> = def.args.iter().map(|a| a.role).collect();
                assert_eq!(roles, declared, "{}", op.describe());
                for (s, a) in signature.iter().zip(def.args) {
                    assert!(
                        a.access == s.access || a.access == ReadWrite,
                        "{}: {} is {:?}, declared {:?}",
                        op.describe(),
                        a.role.as_str(),
                        s.access,
                        a.access
                    );
                    assert!(a.optional || !s.optional, "{}", op.describe());
                }
            }
        }
    }

    /// Every entry's cost class fits its work formulas (Mixtral-8x7B, layer 1): an op that
    /// reads weights is timed by a kernel rate for them, unless it gathers one row per token
    /// (weights in proportion to the tokens); the dense classes stream whole matrices
    /// (weights that do not grow with the tokens, flops that do: with the tokens, or with
    /// the sequences for the per-sequence head); the expert classes read more experts, never
    /// fewer, as tokens grow; attention reads a KV cache and no weights, with flops that grow
    /// with the context; roofline-only ops without weights do at most one flop per byte
    /// moved (memory bound on any machine); and no op but a copy is free.
    #[test]
    fn cost_classes_agree_with_the_work_formulas() {
        let card = ModelCard::load("mixtral-8x7b").unwrap();
        let at = |tokens, seqs, context| Shape {
            tokens,
            seqs,
            context,
            act_bytes: 4,
            kv_bytes: 4,
        };
        let class_bytes = |op: &Op, shape: &Shape, class: super::super::DataClass| -> f64 {
            op.def()
                .args
                .iter()
                .map(|a| super::super::role_traffic(op, a.role, &card, shape, 0))
                .filter(|(c, _)| *c == class)
                .map(|(_, bytes)| bytes)
                .sum()
        };
        let weights =
            |op: &Op, shape: &Shape| class_bytes(op, shape, super::super::DataClass::Weights);
        let all_bytes = |op: &Op, shape: &Shape| {
            op.def()
                .args
                .iter()
                .map(|a| super::super::role_traffic(op, a.role, &card, shape, 0).1)
                .sum::<f64>()
        };
        let flops = |op: &Op, shape: &Shape| super::super::flops(op, &card, shape);
        let (one, many) = (at(1, 1, 64), at(64, 64, 64));
        for def in &OPS {
            for statics in samples(def.kind) {
                let op = (def.build)(&statics).unwrap();
                let name = op.describe();
                let class = def.cost;
                if class != CostClass::Copy {
                    assert!(
                        flops(&op, &many) + all_bytes(&op, &many) > 0.0,
                        "{name}: no work at all"
                    );
                }
                let reads_weights = weights(&op, &one) > 0.0 || weights(&op, &many) > 0.0;
                match class {
                    CostClass::Linear => {
                        assert!(reads_weights, "{name}");
                        assert_eq!(weights(&op, &one), weights(&op, &many), "{name}");
                        let ratio = flops(&op, &many) / flops(&op, &one);
                        assert!((ratio - 64.0).abs() < 1e-9, "{name}: flops x{ratio}");
                    }
                    CostClass::LinearPerSequence => {
                        assert!(reads_weights, "{name}");
                        assert_eq!(weights(&op, &one), weights(&op, &many), "{name}");
                        let (few_tokens, more_tokens) = (at(2, 2, 64), at(64, 2, 64));
                        assert!(flops(&op, &few_tokens) > 0.0, "{name}");
                        assert_eq!(
                            flops(&op, &few_tokens),
                            flops(&op, &more_tokens),
                            "{name}: flops follow the sequences, not the tokens"
                        );
                    }
                    CostClass::ExpertFfn | CostClass::FusedPostAttn => {
                        assert!(weights(&op, &one) > 0.0, "{name}");
                        assert!(weights(&op, &many) >= weights(&op, &one), "{name}");
                        assert!(flops(&op, &one) > 0.0, "{name}");
                    }
                    CostClass::Attention => {
                        assert!(!reads_weights, "{name}");
                        let kv = super::super::DataClass::KvCache;
                        assert!(class_bytes(&op, &many, kv) > 0.0, "{name}");
                        let longer = at(64, 64, 512);
                        assert!(flops(&op, &longer) > flops(&op, &many), "{name}");
                    }
                    CostClass::Copy => {
                        assert_eq!(def.form, OpForm::CopyStatement, "{name}");
                        assert!(!reads_weights && flops(&op, &many) == 0.0, "{name}");
                    }
                    CostClass::Roofline(RooflineReason::Gather) => {
                        assert!(weights(&op, &one) > 0.0, "{name}");
                        assert_eq!(weights(&op, &many), 64.0 * weights(&op, &one), "{name}");
                        assert_eq!(flops(&op, &many), 0.0, "{name}");
                    }
                    CostClass::Roofline(
                        RooflineReason::Elementwise | RooflineReason::RowReduction,
                    ) => {
                        assert!(!reads_weights, "{name}: reads weights but has no rate");
                        for shape in [one, many] {
                            assert!(
                                flops(&op, &shape) <= all_bytes(&op, &shape),
                                "{name}: more flops than bytes, not memory bound"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Hand arithmetic on mixtral-tiny for one decode token: the minimum sizes come from
    /// the argument types, the same formulas as the language's size helpers.
    #[test]
    fn argument_types_size_like_the_size_helpers() {
        let card = ModelCard::load("mixtral-tiny").unwrap();
        let shape = Shape {
            tokens: 3,
            seqs: 2,
            context: 5,
            act_bytes: 4,
            kv_bytes: 4,
        };
        let helper = |name: &str, n: u64| {
            super::super::size_helper(name, &[n], &card, 4, 4, None)
                .unwrap()
                .unwrap()
                .bytes
        };
        let cases = [
            (ArgType::Hidden, helper("hidden", 3)),
            (ArgType::Qkv, helper("qkv", 3)),
            (ArgType::AttnOut, helper("attn_out", 3)),
            (ArgType::KvCache, helper("kv_cache", 2 * 5)),
            (ArgType::Routing, helper("routing", 3)),
            (ArgType::ExpertAcc, helper("expert_acc", 3)),
            (ArgType::Logits, helper("logits", 2)),
            (ArgType::Tokens, helper("tokens", 2)),
        ];
        for (ty, bytes) in cases {
            assert_eq!(ty.min_bytes(&card, &shape), Some(bytes), "{ty:?}");
        }
        assert_eq!(ArgType::Weights.min_bytes(&card, &shape), None);
        assert_eq!(ArgType::Bytes.min_bytes(&card, &shape), None);
    }
}
