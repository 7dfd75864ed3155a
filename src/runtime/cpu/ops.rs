//! The CPU backend's ops: each catalog op applied to views of its arguments, by calling
//! the model's kernels (the same ones the oracle composes; no second copy of the math).
//! One kernel function per op kind, registered in the CPU kernel table (`CPU_KERNELS`, a
//! `runtime::ops::OpTable`), keyed by the op table's [`OpKind`].
//!
//! Takes a task, the step's state and the backend memory; gives the task's effect on its
//! output arguments (and on the step state: routing decisions, sampled tokens), or
//! an [`OpError`] naming what is wrong. Activations are f32 rows in the order of the
//! micro-batch's sequences; a KV cache slice is `[K pool | V pool]` in the model's paged
//! block layout; a routing slice is `(expert: u32, weight: f32)` per token and slot; an
//! `acc` slice is `[normalised rows | one output row per (token, k) | the shared expert's
//! rows, for families with one]` (`expert_acc`).
//!
//! The MoE ops follow the contract `model::vocab::ExpertGroups` states, in the stages the
//! CUDA backend's `moe` runs: the router ([`OpContext::route`]: norm, top-k, the shared
//! expert), grouping by expert (`ExpertGroups`), the expert products
//! ([`OpContext::routed_experts`]) and combine (`math::moe::combine_shared`); `gate`,
//! `experts` and `combine` each run one, the fused `post_attn` all of them, into scratch it
//! keeps ([`MoeScratch`]).

use crate::ir::catalog::OpKind;
use crate::ir::{AttnPart, Op, Role};
use crate::lower::PlanTask;
use crate::math::attention::{attention, attention_of, AttnSeq};
use crate::math::dense::{dense_block, dense_ffn_rows, no_expert_routing};
use crate::math::head::{embed, logits};
use crate::math::isa::Kernels;
use crate::math::kv_cache::KvBlocksMut;
use crate::math::mla::{KvUp, MlaWeights};
use crate::math::moe::{combine_shared, gate};
use crate::math::projection::{o_proj_residual, pre_attn};
use crate::math::rope::RopeTable;
use crate::math::tensor::{Matrix, TypedSlice};
use crate::math::views::{
    DenseWeights, ExpertWeights, FusedExpert, QkvWeights, SharedExpertWeights,
};
use crate::math::KernelError;
use crate::model::arch::ArchSpec;
use crate::model::segment::SegmentKind;
use crate::model::vocab::{ExpertGroups, KvLayout, KvType, Orientation, RoutedRow, Routing};
use crate::runtime::host::memory::{HostMemory, View};
use crate::runtime::host::weights::WeightTag;
use crate::runtime::ops::{run_task, sized, OpCx, OpError, OpTable, TaskArgs};
use crate::runtime::step::StepContext;
use std::cell::Cell;

// A CPU kernel's own input checks, in the kernel's words.
impl From<KernelError> for OpError {
    fn from(e: KernelError) -> Self {
        OpError::Backend(Box::new(e))
    }
}

/// What ops need besides memory and state.
#[derive(Debug)]
pub struct OpContext<'a> {
    /// Kernel-facing architecture.
    pub arch: &'a ArchSpec,
    /// Rotary tables.
    pub rope: &'a RopeTable,
    /// Backend memory.
    pub memory: &'a HostMemory<'a>,
    /// The step state.
    pub state: &'a dyn StepContext,
}

fn f32s<'a>(bytes: &'a [u8], role: &'static str) -> Result<&'a [f32], OpError> {
    bytemuck::try_cast_slice(bytes).map_err(|_| OpError::Align(role))
}

fn f32s_mut<'a>(bytes: &'a mut [u8], role: &'static str) -> Result<&'a mut [f32], OpError> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| OpError::Align(role))
}

impl OpCx for OpContext<'_> {
    const BACKEND: &'static str = "CPU";

    fn step(&self) -> &dyn StepContext {
        self.state
    }

    fn experts(&self) -> usize {
        self.arch.experts
    }
}

impl OpContext<'_> {
    /// Runs one task: its op's kernel from the CPU kernel table, then marks what it wrote
    /// as no longer holding weights.
    pub fn run(&self, task: &PlanTask) -> Result<(), OpError> {
        let kernel = CPU_KERNELS.kernel(task.op.kind())?;
        run_task(
            self,
            self.memory,
            task,
            |args| kernel(self, task, args),
            |v| self.memory.clobber(v),
        )
    }

    fn bytes_sized(&self, view: View, role: &'static str, needed: usize) -> Result<&[u8], OpError> {
        let view = sized(view, role, needed)?;
        // SAFETY: the task's waits have returned, so every other task writing these bytes
        // is ordered before or after this one (the plan's dependencies), and `moec check`
        // rejects a task whose written argument overlaps another of its arguments, so
        // this task holds no exclusive view of these bytes.
        Ok(unsafe {
            self.memory.bytes(View {
                len: needed as u64,
                ..view
            })?
        })
    }

    #[allow(clippy::mut_from_ref)]
    fn bytes_mut_sized(
        &self,
        view: View,
        role: &'static str,
        needed: usize,
    ) -> Result<&mut [u8], OpError> {
        let view = sized(view, role, needed)?;
        // SAFETY: as in `bytes_sized`: other tasks are ordered by the plan, and no other
        // argument of this task overlaps a written one (checked by `moec check`).
        Ok(unsafe {
            self.memory.bytes_mut(View {
                len: needed as u64,
                ..view
            })?
        })
    }

    fn act(&self, view: View, role: &'static str, elems: usize) -> Result<&[f32], OpError> {
        f32s(self.bytes_sized(view, role, elems * 4)?, role)
    }

    #[allow(clippy::mut_from_ref)]
    fn act_mut(&self, view: View, role: &'static str, elems: usize) -> Result<&mut [f32], OpError> {
        f32s_mut(self.bytes_mut_sized(view, role, elems * 4)?, role)
    }

    fn write_routing(&self, view: View, routing: &Routing) -> Result<(), OpError> {
        let n = routing.experts.len();
        let out = self.bytes_mut_sized(view, "route", n * 8)?;
        let words: &mut [u32] =
            bytemuck::try_cast_slice_mut(out).map_err(|_| OpError::Align("route"))?;
        for (i, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            words[2 * i] = e;
            words[2 * i + 1] = w.to_bits();
        }
        Ok(())
    }

    fn read_routing(&self, view: View, n_tokens: usize) -> Result<Routing, OpError> {
        let top_k = self.arch.top_k;
        let bytes = self.bytes_sized(view, "route", n_tokens * top_k * 8)?;
        Ok(crate::runtime::backend::decode_routing(
            bytes, n_tokens, top_k,
        )?)
    }

    fn typed(&self, weights: &[View], tag: WeightTag) -> Result<TypedSlice<'_>, OpError> {
        let (tag, view) = self.find_weight(weights, tag)?;
        self.typed_view(tag, view)
    }

    /// The elements of tensor `tag` (as [`Self::find_weight`] found it) at `view`.
    fn typed_view(&self, tag: WeightTag, view: View) -> Result<TypedSlice<'_>, OpError> {
        // SAFETY: a weight found in the task's `w` arguments: the image is read-only, and
        // in an arena the plan orders every writer of these bytes before or after this
        // task (no task writes an argument another of its arguments overlaps).
        let bytes = unsafe { self.memory.bytes(view)? };
        // In the format the image stores `tag` in (a float dtype or quantised blocks).
        self.memory
            .layout()
            .typed(tag, bytes)
            .map_err(|_| OpError::Align("w"))
    }

    /// Where `tag` is in `weights`: itself, or for a routed expert's segment found only as
    /// a format copy (`WeightTag::Converted`), that copy: the checker proved the schedule
    /// declares the substitute wherever an `experts` task reads one.
    fn find_weight(&self, weights: &[View], tag: WeightTag) -> Result<(WeightTag, View), OpError> {
        if let Some(view) = self.memory.find_weight(weights, tag) {
            return Ok((tag, view));
        }
        if let WeightTag::Layer { layer, kind } = tag {
            if kind.expert().is_some() {
                for &format in self.memory.converted_formats() {
                    let converted = WeightTag::Converted {
                        layer,
                        kind,
                        format,
                    };
                    if let Some(view) = self.memory.find_weight(weights, converted) {
                        return Ok((converted, view));
                    }
                }
            }
        }
        Err(OpError::MissingWeight { tag })
    }

    /// True when expert `e` of `layer` is in `weights` only as a format copy.
    fn expert_is_converted(&self, weights: &[View], layer: u32, e: usize) -> bool {
        let tag = WeightTag::Layer {
            layer,
            kind: SegmentKind::ExpertDown(e),
        };
        matches!(
            self.find_weight(weights, tag),
            Ok((WeightTag::Converted { .. }, _))
        )
    }

    fn segment(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<Option<Matrix<'_>>, OpError> {
        let Some(seg) = self.memory.layout().layer_of(layer).segment(kind).cloned() else {
            return Ok(None);
        };
        let (found, view) = self.find_weight(weights, WeightTag::Layer { layer, kind })?;
        let data = self.typed_view(found, view)?;
        // A routed expert found only as a format copy is held `[out, in]` in the copy's
        // blocks, transposed where the checkpoint stores it `[in, out]`.
        let (rows, cols, orientation) = match found {
            WeightTag::Converted { .. } => seg.block_copy_shape(),
            _ => (
                seg.rows,
                seg.cols,
                seg.orientation.unwrap_or(Orientation::OutIn),
            ),
        };
        Ok(Matrix::new(data, rows, cols, orientation))
    }

    fn required(
        &self,
        weights: &[View],
        layer: u32,
        kind: SegmentKind,
    ) -> Result<Matrix<'_>, OpError> {
        self.segment(weights, layer, kind)?
            .ok_or(OpError::MissingWeight {
                tag: WeightTag::Layer { layer, kind },
            })
    }

    /// The dense weights an op reads; segments not in `needs` (and, for QKV, not needed
    /// either) are empty views, which the kernels called with these ops never read.
    fn dense(
        &self,
        weights: &[View],
        layer: u32,
        needs: &[SegmentKind],
    ) -> Result<DenseWeights<'_>, OpError> {
        let empty_matrix = Matrix {
            data: TypedSlice::F32(&[]),
            rows: 0,
            cols: 0,
            orientation: Orientation::OutIn,
        };
        let get = |kind: SegmentKind| -> Result<Matrix<'_>, OpError> {
            if needs.contains(&kind) {
                self.required(weights, layer, kind)
            } else {
                Ok(empty_matrix)
            }
        };
        let pre = needs.contains(&SegmentKind::AttnNorm);
        let qkv = if pre {
            // As the checkpoint's own views choose (`model::layout`): the family's spec
            // says whether q|k|v is one tensor, the layout whether attention is latent.
            let layout = self.memory.layout().layer_of(layer);
            let has = |kind| layout.segment(kind).is_some();
            match layout.family {
                f if f.facts().fused_qkv => {
                    QkvWeights::Fused(self.required(weights, layer, SegmentKind::QkvProj)?)
                }
                _ if has(SegmentKind::KvAProj) => QkvWeights::Mla(MlaWeights::build(
                    has(SegmentKind::QAProj),
                    has(SegmentKind::KB),
                    |kind| self.required(weights, layer, kind),
                )?),
                _ => QkvWeights::Separate {
                    q: self.required(weights, layer, SegmentKind::QProj)?,
                    k: self.required(weights, layer, SegmentKind::KProj)?,
                    v: self.required(weights, layer, SegmentKind::VProj)?,
                },
            }
        } else {
            QkvWeights::Fused(empty_matrix)
        };
        // The optional segments of the families that have them: q/k/v biases and q/k norms
        // with the pre-attention weights, the shared expert with the router's.
        let present =
            |kind: SegmentKind| self.memory.layout().layer_of(layer).segment(kind).is_some();
        let dense_layer = self.arch.is_dense(layer as usize);
        let vector = |kind: SegmentKind| -> Result<TypedSlice<'_>, OpError> {
            Ok(self.required(weights, layer, kind)?.data)
        };
        let qkv_bias = if pre && present(SegmentKind::QBias) {
            Some([
                vector(SegmentKind::QBias)?,
                vector(SegmentKind::KBias)?,
                vector(SegmentKind::VBias)?,
            ])
        } else {
            None
        };
        let qk_norm = if pre && present(SegmentKind::QNorm) {
            Some([vector(SegmentKind::QNorm)?, vector(SegmentKind::KNorm)?])
        } else {
            None
        };
        let shared = if needs.contains(&SegmentKind::Router) && dense_layer {
            // A dense layer's SwiGLU, which its gate computes where a shared expert would.
            Some(SharedExpertWeights {
                ffn: ExpertWeights {
                    gate: self.required(weights, layer, SegmentKind::DenseGate)?,
                    up: self.required(weights, layer, SegmentKind::DenseUp)?,
                    down: self.required(weights, layer, SegmentKind::DenseDown)?,
                    fused: None,
                },
                gate: None,
            })
        } else if needs.contains(&SegmentKind::Router) && present(SegmentKind::SharedGate) {
            Some(SharedExpertWeights {
                ffn: ExpertWeights {
                    gate: self.required(weights, layer, SegmentKind::SharedGate)?,
                    up: self.required(weights, layer, SegmentKind::SharedUp)?,
                    down: self.required(weights, layer, SegmentKind::SharedDown)?,
                    fused: None,
                },
                gate: if present(SegmentKind::SharedExpertGate) {
                    Some(self.required(weights, layer, SegmentKind::SharedExpertGate)?)
                } else {
                    None
                },
            })
        } else {
            None
        };
        let optional = |with: SegmentKind, kind: SegmentKind| -> Result<_, OpError> {
            if needs.contains(&with) && present(kind) {
                vector(kind).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(DenseWeights {
            attn_norm: get(SegmentKind::AttnNorm)?.data,
            qkv,
            qkv_bias,
            qk_norm,
            sinks: optional(SegmentKind::AttnNorm, SegmentKind::Sinks)?,
            o_proj: get(SegmentKind::OProj)?,
            o_bias: optional(SegmentKind::OProj, SegmentKind::OBias)?,
            ffn_norm: get(SegmentKind::FfnNorm)?.data,
            router: if dense_layer {
                empty_matrix
            } else {
                get(SegmentKind::Router)?
            },
            router_bias: optional(SegmentKind::Router, SegmentKind::RouterBias)?,
            shared,
            kv_b_out: if needs.contains(&SegmentKind::OProj)
                && (present(SegmentKind::KvBOut) || present(SegmentKind::VB))
            {
                Some(KvUp::values(present(SegmentKind::VB), |kind| {
                    self.required(weights, layer, kind)
                })?)
            } else {
                None
            },
        })
    }

    fn expert(&self, weights: &[View], layer: u32, e: usize) -> Result<ExpertWeights<'_>, OpError> {
        if self.arch.clamped_swiglu.is_some() {
            let vector = |kind| -> Result<TypedSlice<'_>, OpError> {
                Ok(self.required(weights, layer, kind)?.data)
            };
            return Ok(ExpertWeights {
                gate: Matrix::empty(),
                up: Matrix::empty(),
                down: self.required(weights, layer, SegmentKind::ExpertDown(e))?,
                fused: Some(FusedExpert {
                    gate_up: self.required(weights, layer, SegmentKind::ExpertGateUp(e))?,
                    gate_up_bias: vector(SegmentKind::ExpertGateUpBias(e))?,
                    down_bias: vector(SegmentKind::ExpertDownBias(e))?,
                }),
            });
        }
        Ok(ExpertWeights {
            gate: self.required(weights, layer, SegmentKind::ExpertGate(e))?,
            up: self.required(weights, layer, SegmentKind::ExpertUp(e))?,
            down: self.required(weights, layer, SegmentKind::ExpertDown(e))?,
            fused: None,
        })
    }

    /// The MoE contract's router stage, as `gate` and the fused `post_attn` run it: the
    /// post-attention norm of `h` into `x_norm`, the router's top-k (the experts it reached
    /// noted for the run report and the replay), and the shared expert's rows into
    /// `shared_out` (zeros for a layer without one, whose card keeps the row for its dense
    /// layers' SwiGLU).
    fn route(
        &self,
        (layer, ub): (u32, u32),
        dense: &DenseWeights<'_>,
        h: &[f32],
        x_norm: &mut [f32],
        shared_out: &mut [f32],
    ) -> Result<Routing, OpError> {
        let routing = gate(self.arch, dense, h, x_norm)?;
        self.state
            .note_active_experts(layer, ub, &routing, self.arch.experts);
        // The shared expert is part of the dense weights every token uses: computed here,
        // with the router, so schedules treat it like the gate's other weights.
        match &dense.shared {
            Some(shared) => {
                Kernels::process().shared_expert(self.arch, shared, x_norm, shared_out)?
            }
            None => shared_out.fill(0.0),
        }
        Ok(routing)
    }

    /// The MoE contract's expert stage on the CPU: each `(expert, rows)` of a grouping, its
    /// weights found in the task's `w` arguments, `weight * y` into each (row, slot) of
    /// `slots` (`[n, top_k, d]`) through `Kernels::experts_ffn` (a decode step's quantised
    /// experts in one parallel region; the same bits as one at a time).
    fn routed_experts<'g>(
        &self,
        weights: &[View],
        layer: u32,
        groups: impl Iterator<Item = (u32, &'g [RoutedRow])>,
        x_norm: &[f32],
        slots: &mut [f32],
    ) -> Result<(), OpError> {
        let jobs = groups
            .map(|(e, rows)| {
                let converted = self.expert_is_converted(weights, layer, e as usize);
                self.memory.note_expert_source(converted);
                Ok((self.expert(weights, layer, e as usize)?, rows))
            })
            .collect::<Result<Vec<_>, OpError>>()?;
        Kernels::process().experts_ffn(self.arch, &jobs, x_norm, slots)?;
        Ok(())
    }

    fn matrix(
        &self,
        weights: &[View],
        tag: WeightTag,
        rows: usize,
        cols: usize,
    ) -> Result<Matrix<'_>, OpError> {
        let data = self.typed(weights, tag)?;
        Matrix::new(data, rows, cols, Orientation::OutIn).ok_or(OpError::MissingWeight { tag })
    }

    fn vector(&self, weights: &[View], tag: WeightTag) -> Result<TypedSlice<'_>, OpError> {
        self.typed(weights, tag)
    }

    /// `post_attn`'s attention rows: one `a` argument holds all rows; two (VSLPipe) hold
    /// the prefill sequences' rows and the decode sequences' rows, each at its position.
    fn merge_attention_rows(&self, ub: u32, a_args: &[View]) -> Result<Vec<f32>, OpError> {
        let mb = self.ub(ub)?;
        let q = self.arch.q_dim();
        let n = mb.n_tokens();
        match a_args {
            [] => Err(OpError::MissingArg("a")),
            [one] => Ok(self.act(*one, "a", n * q)?.to_vec()),
            [prefill, decode, ..] => {
                let (p, d) = (
                    self.act(*prefill, "a", n * q)?,
                    self.act(*decode, "a", n * q)?,
                );
                let mut out = vec![0.0f32; n * q];
                let mut row = 0;
                for s in &mb.seqs {
                    let rows = row * q..(row + s.new_tokens.len()) * q;
                    let src = if s.prefill { p } else { d };
                    out[rows.clone()].copy_from_slice(&src[rows]);
                    row += s.new_tokens.len();
                }
                Ok(out)
            }
        }
    }

    /// Attention for the sequences `part` selects, writing their rows at their positions.
    /// With a `kv` argument every new token's K/V is appended (also of sequences not
    /// selected: VSLPipe's CPU task stores the prefill tokens' K/V while attending only the
    /// decode rows); without one (GPU prefill attention over whole prompts) a scratch cache
    /// holds the call's own K/V.
    #[allow(clippy::too_many_arguments)]
    fn attn(
        &self,
        layer: u32,
        ub: u32,
        part: AttnPart,
        kv_type: KvType,
        qkv: View,
        kv: Option<View>,
        out: View,
    ) -> Result<(), OpError> {
        let mb = self.ub(ub)?;
        let n = mb.n_tokens();
        // The layer's geometry: gpt-oss slides its window on even layers only.
        let shape = self.arch.attn_of(layer as usize);
        let (qw, ow) = (shape.qkv_width(), shape.q_width());
        let qkv = self.act(qkv, "qkv", n * qw)?;
        let out = self.act_mut(out, "out", n * ow)?;
        let wanted = |prefill: bool| match part {
            AttnPart::All => true,
            AttnPart::Prefill => prefill,
            AttnPart::Decode => !prefill,
        };
        if let Some(kv) = kv {
            let layout = KvLayout {
                block_size: mb.block_size.max(1),
                kv_heads: shape.kv_heads,
                head_dim: shape.head_dim,
                values_in_keys: self.arch.values_in_keys(),
            };
            // One pool (K, the values read from it: MLA's latent cached once) or two.
            let (elem, pools) = (kv_type.bytes() as usize, layout.pools());
            let pool_elems = (kv.len as usize / elem / pools / layout.block_elems().max(1))
                * layout.block_elems();
            let bytes = self.bytes_mut_sized(kv, "kv", pools * pool_elems * elem)?;
            let mut cache =
                KvBlocksMut::from_bytes(layout, kv_type, bytes).ok_or(OpError::Align("kv"))?;
            let seqs: Vec<AttnSeq<'_>> = mb
                .seqs
                .iter()
                .map(|s| AttnSeq {
                    block_table: &s.block_table,
                    context_len: s.context_len,
                    n_new: s.new_tokens.len(),
                })
                .collect();
            // Every sequence's K/V is stored; only the wanted part is attended.
            let attend = |i: usize| mb.seqs.get(i).is_some_and(|s| wanted(s.prefill));
            attention_of(&mut cache, &seqs, qkv, &shape, out, &attend)
                .map_err(KernelError::from)?;
            return Ok(());
        }
        // No cache argument: only whole-prompt (context 0) sequences can be attended.
        let block = 16;
        let layout = KvLayout {
            block_size: block,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            values_in_keys: self.arch.values_in_keys(),
        };
        let mut picked_rows = Vec::new();
        let mut tables = Vec::new();
        let mut next_block = 0u32;
        let mut row = 0;
        for s in &mb.seqs {
            let len = s.new_tokens.len();
            if wanted(s.prefill) {
                if s.context_len > 0 {
                    return Err(OpError::MissingArg(
                        "kv (a sequence with cached tokens needs its KV cache)",
                    ));
                }
                let blocks = layout.blocks_for(len) as u32;
                tables.push((next_block..next_block + blocks).collect::<Vec<u32>>());
                next_block += blocks;
                picked_rows.push(row..row + len);
            }
            row += len;
        }
        if picked_rows.is_empty() {
            return Ok(());
        }
        // The call's own K/V, rounded as the run's cache would store them.
        let mut scratch =
            crate::math::kv_cache::PagedKvCache::of_type(layout, 1, next_block as usize, kv_type);
        let mut cache = scratch.layer_mut(0);
        let seqs: Vec<AttnSeq<'_>> = picked_rows
            .iter()
            .zip(&tables)
            .map(|(r, t)| AttnSeq {
                block_table: t,
                context_len: 0,
                n_new: r.len(),
            })
            .collect();
        let picked: usize = picked_rows.iter().map(|r| r.len()).sum();
        let mut q_in = Vec::with_capacity(picked * qw);
        for r in &picked_rows {
            q_in.extend_from_slice(&qkv[r.start * qw..r.end * qw]);
        }
        let mut o = vec![0.0f32; picked * ow];
        attention(&mut cache, &seqs, &q_in, &shape, &mut o).map_err(KernelError::from)?;
        let mut at = 0;
        for r in &picked_rows {
            out[r.start * ow..r.end * ow].copy_from_slice(&o[at * ow..(at + r.len()) * ow]);
            at += r.len();
        }
        Ok(())
    }
}

/// The buffers the MoE stages hand each other in the fused `post_attn` (and the grouping of
/// `experts`), kept per stream thread so a decode step allocates none of them: taken for a
/// task and put back after it ([`with_moe_scratch`]).
#[derive(Debug, Default)]
struct MoeScratch {
    /// Normalised rows, `[n, d]`.
    x_norm: Vec<f32>,
    /// One slot per (token, k), `[n, top_k, d]`.
    slots: Vec<f32>,
    /// The shared expert's rows, `[n, d]` (empty for a family without one).
    shared: Vec<f32>,
    /// The routing grouped by expert.
    groups: ExpertGroups,
}

/// Scratch past this many bytes is freed after its task rather than kept: a prefill's rows
/// would otherwise stay resident on the stream thread for the whole run, and a prefill's
/// allocation is small beside its work.
const MOE_SCRATCH_KEPT_BYTES: usize = 16 << 20;

impl MoeScratch {
    fn bytes(&self) -> usize {
        // The grouping's buffers (12 bytes per routed entry) are left out: a tenth of the
        // slots' at most.
        4 * (self.x_norm.capacity() + self.slots.capacity() + self.shared.capacity())
    }
}

thread_local! {
    static MOE_SCRATCH: Cell<MoeScratch> = Cell::new(MoeScratch::default());
}

/// Runs `f` with this thread's MoE scratch, which it may grow. Taken out of its cell for
/// the call, so a nested call (which no op makes) starts from empty buffers rather than
/// sharing them.
fn with_moe_scratch<T>(f: impl FnOnce(&mut MoeScratch) -> T) -> T {
    let mut scratch = MOE_SCRATCH.with(Cell::take);
    let out = f(&mut scratch);
    if scratch.bytes() <= MOE_SCRATCH_KEPT_BYTES {
        MOE_SCRATCH.with(|cell| cell.set(scratch));
    }
    out
}

/// `v` as `len` zeros, reusing its allocation.
fn zeroed(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    v.clear();
    v.resize(len, 0.0);
    v
}

/// A CPU kernel: applies one task of its op kind to the views of the task's arguments
/// (and to the step state: routing decisions, sampled tokens).
pub(crate) type CpuKernel = fn(&OpContext<'_>, &PlanTask, &TaskArgs) -> Result<(), OpError>;

/// The CPU backend's kernel per op kind. An op of the table without a row here is a
/// failing test (`every_op_has_a_signature_work_and_a_cpu_kernel`), not a user's run.
static CPU_KERNELS: OpTable<CpuKernel> = OpTable::new(
    "CPU",
    &[
        (OpKind::Embed, embed_kernel),
        (OpKind::PreAttn, pre_attn_kernel),
        (OpKind::Attn, attn_kernel),
        (OpKind::PostAttn, post_attn_kernel),
        (OpKind::OProj, o_proj_kernel),
        (OpKind::Gate, gate_kernel),
        (OpKind::Pregate, pregate_kernel),
        (OpKind::Experts, experts_kernel),
        (OpKind::Combine, combine_kernel),
        (OpKind::LmHead, lm_head_kernel),
        (OpKind::Sample, sample_kernel),
        (OpKind::Copy, copy_kernel),
    ],
);

fn copy_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let (src, dst) = (args.need(Role::Src)?, args.need(Role::Dst)?);
    if src.len != dst.len {
        return Err(OpError::CopyLength {
            src: src.len,
            dst: dst.len,
        });
    }
    cx.memory.copy(task.engine, src, dst)?;
    Ok(())
}

fn embed_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Embed { ub } = task.op else {
        return Err(cx.wrong_op(OpKind::Embed, task));
    };
    let mb = cx.ub(ub)?;
    let ids = mb.token_ids();
    let weights = args.all(Role::W);
    let table = cx.matrix(&weights, WeightTag::Embed, cx.arch.vocab, cx.arch.hidden)?;
    let h = cx.act_mut(args.need(Role::H)?, "h", ids.len() * cx.arch.hidden)?;
    embed(&table, &ids, h)?;
    Ok(())
}

fn pre_attn_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::PreAttn { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::PreAttn, task));
    };
    let mb = cx.ub(ub)?;
    let positions = mb.positions();
    let n = positions.len();
    let dense = cx.dense(&args.all(Role::W), layer, &[SegmentKind::AttnNorm])?;
    let x = cx.act(args.need(Role::H)?, "h", n * cx.arch.hidden)?;
    let out = cx.act_mut(args.need(Role::Out)?, "out", n * cx.arch.attn.qkv_width())?;
    let mut x_norm = vec![0.0f32; n * cx.arch.hidden];
    pre_attn(cx.arch, &dense, cx.rope, x, &positions, &mut x_norm, out)?;
    Ok(())
}

fn attn_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Attn { layer, ub, part } = task.op else {
        return Err(cx.wrong_op(OpKind::Attn, task));
    };
    // The cache's element type is the plan's (`--kv-type`), which sized its slice.
    let kv_type = KvType::of_bytes(task.shape.kv_bytes).ok_or(OpError::MissingArg(
        "kv (a KV element width other than 4 or 2 bytes)",
    ))?;
    cx.attn(
        layer,
        ub,
        part,
        kv_type,
        args.need(Role::Qkv)?,
        args.get(Role::Kv),
        args.need(Role::Out)?,
    )
}

fn o_proj_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::OProj { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::OProj, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let dense = cx.dense(&args.all(Role::W), layer, &[SegmentKind::OProj])?;
    let a = cx.act(args.need(Role::A)?, "a", n * cx.arch.q_dim())?;
    let h = cx.act_mut(args.need(Role::H)?, "h", n * cx.arch.hidden)?;
    o_proj_residual(cx.arch, &dense, a, h)?;
    Ok(())
}

fn gate_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Gate { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::Gate, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let dense = cx.dense(
        &args.all(Role::W),
        layer,
        &[SegmentKind::FfnNorm, SegmentKind::Router],
    )?;
    let h = cx.act(args.need(Role::H)?, "h", n * d)?;
    // `acc` = [normalised rows | one slot per (token, k) | shared rows], see `expert_acc`.
    let acc = cx.act_mut(args.need(Role::Acc)?, "acc", n * cx.arch.acc_rows() * d)?;
    let (x_norm, rest) = acc.split_at_mut(n * d);
    let (slots, shared_out) = rest.split_at_mut(n * cx.arch.top_k * d);
    slots.fill(0.0);
    let routing = if cx.arch.is_dense(layer as usize) {
        // A dense layer: its SwiGLU into the shared row, a routing that chooses no expert.
        dense_ffn_rows(Kernels::process(), cx.arch, &dense, h, x_norm, shared_out)?;
        no_expert_routing(n, cx.arch.top_k)
    } else {
        cx.route((layer, ub), &dense, h, x_norm, shared_out)?
    };
    // The host learns this routing only through the plan's `ReadRouting` instruction, as
    // it would from a device.
    cx.write_routing(args.need(Role::Route)?, &routing)?;
    Ok(())
}

/// `pregate`: layer `layer`'s norm and router over the hidden rows `h` (those entering
/// the previous layer's MoE block), the routing into `route`; the normalised rows are
/// scratch, no accumulator and no shared expert (a prediction computes no expert).
fn pregate_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Pregate { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::Pregate, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let dense = cx.dense(
        &args.all(Role::W),
        layer,
        &[SegmentKind::FfnNorm, SegmentKind::Router],
    )?;
    let h = cx.act(args.need(Role::H)?, "h", n * d)?;
    let mut x_norm = vec![0.0f32; n * d];
    let routing = gate(cx.arch, &dense, h, &mut x_norm)?;
    cx.write_routing(args.need(Role::Route)?, &routing)?;
    Ok(())
}

fn experts_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Experts { layer, ub, set } = task.op else {
        return Err(cx.wrong_op(OpKind::Experts, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let routing = cx.read_routing(args.need(Role::Route)?, n)?;
    let acc = cx.act_mut(args.need(Role::Acc)?, "acc", n * (1 + cx.arch.top_k) * d)?;
    let (x_norm, slots) = acc.split_at_mut(n * d);
    let weights = args.all(Role::W);
    let members = cx.members(set);
    with_moe_scratch(|s| {
        s.groups.regroup(&routing, cx.arch.experts);
        cx.routed_experts(&weights, layer, s.groups.of(&members), x_norm, slots)
    })
}

fn combine_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Combine { ub, .. } = task.op else {
        return Err(cx.wrong_op(OpKind::Combine, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let routing = cx.read_routing(args.need(Role::Route)?, n)?;
    let accs = args.all(Role::Acc);
    let k = cx.arch.top_k;
    let acc_elems = n * cx.arch.acc_rows() * d;
    let slots_end = n * (1 + k) * d;
    let has_shared = cx.arch.acc_rows() > 1 + k;
    let h = cx.act_mut(args.need(Role::H)?, "h", n * d)?;
    let first = cx.act(
        *accs.first().ok_or(OpError::MissingArg("acc"))?,
        "acc",
        acc_elems,
    )?;
    // The gate wrote the shared expert's rows into the accumulator it initialised; a partial
    // accumulator copied from it holds the same rows, so they are taken from the first one.
    let shared = has_shared.then(|| &first[slots_end..]);
    if let [one] = accs.as_slice() {
        let acc = cx.act(*one, "acc", acc_elems)?;
        combine_shared(&routing, &acc[n * d..slots_end], shared, h)?;
        return Ok(());
    }
    // Partial accumulators (`acc = [a, b]`): each (token, k) slot was written by one
    // expert into one of them and is zero (from the gate) in the others, so adding them
    // gives exactly that expert's output (x + 0 = x), and the sum below is bit-identical
    // to the single-accumulator one.
    let mut slots = vec![0.0f32; n * k * d];
    for view in accs {
        let acc = cx.act(view, "acc", acc_elems)?;
        for (s, v) in slots.iter_mut().zip(&acc[n * d..slots_end]) {
            *s += v;
        }
    }
    combine_shared(&routing, &slots, shared, h)?;
    Ok(())
}

fn post_attn_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::PostAttn { layer, ub } = task.op else {
        return Err(cx.wrong_op(OpKind::PostAttn, task));
    };
    let n = cx.ub(ub)?.n_tokens();
    let d = cx.arch.hidden;
    let weights = args.all(Role::W);
    let dense = cx.dense(
        &weights,
        layer,
        &[
            SegmentKind::OProj,
            SegmentKind::FfnNorm,
            SegmentKind::Router,
        ],
    )?;
    let merged = cx.merge_attention_rows(ub, &args.all(Role::A))?;
    let h = cx.act_mut(args.need(Role::H)?, "h", n * d)?;
    o_proj_residual(cx.arch, &dense, &merged, h)?;
    if cx.arch.is_dense(layer as usize) {
        dense_block(Kernels::process(), cx.arch, &dense, h)?;
        return Ok(());
    }
    // The MoE layer in the contract's stages, as `gate`, `experts` and `combine` run them
    // one task each: router, group by expert, the expert products, combine.
    let k = cx.arch.top_k;
    with_moe_scratch(|s| {
        let x_norm = zeroed(&mut s.x_norm, n * d);
        let shared_rows = if dense.shared.is_some() { n * d } else { 0 };
        let shared = zeroed(&mut s.shared, shared_rows);
        let routing = cx.route((layer, ub), &dense, h, x_norm, shared)?;
        s.groups.regroup(&routing, cx.arch.experts);
        let slots = zeroed(&mut s.slots, n * k * d);
        cx.routed_experts(&weights, layer, s.groups.routed(), &s.x_norm, slots)?;
        let shared = dense.shared.is_some().then_some(s.shared.as_slice());
        combine_shared(&routing, &s.slots, shared, h)?;
        Ok(())
    })
}

fn lm_head_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::LmHead { ub } = task.op else {
        return Err(cx.wrong_op(OpKind::LmHead, task));
    };
    let mb = cx.ub(ub)?;
    let d = cx.arch.hidden;
    let h = cx.act(args.need(Role::H)?, "h", mb.n_tokens() * d)?;
    let mut last = Vec::with_capacity(mb.seqs.len() * d);
    let mut row = 0;
    for s in &mb.seqs {
        row += s.new_tokens.len();
        last.extend_from_slice(&h[(row - 1) * d..row * d]);
    }
    let weights = args.all(Role::W);
    let norm = cx.vector(&weights, WeightTag::FinalNorm)?;
    let head = cx.matrix(&weights, WeightTag::LmHead, cx.arch.vocab, d)?;
    let out = cx.act_mut(
        args.need(Role::Logits)?,
        "logits",
        mb.seqs.len() * cx.arch.vocab,
    )?;
    logits(cx.arch, norm, &head, &last, out)?;
    Ok(())
}

fn sample_kernel(cx: &OpContext<'_>, task: &PlanTask, args: &TaskArgs) -> Result<(), OpError> {
    let Op::Sample { ub } = task.op else {
        return Err(cx.wrong_op(OpKind::Sample, task));
    };
    let mb = cx.ub(ub)?;
    let vocab = cx.arch.vocab;
    let l = cx.act(args.need(Role::Logits)?, "logits", mb.seqs.len() * vocab)?;
    let out = cx.bytes_mut_sized(args.need(Role::Tokens)?, "tokens", mb.seqs.len() * 4)?;
    let ids: &mut [u32] =
        bytemuck::try_cast_slice_mut(out).map_err(|_| OpError::Align("tokens"))?;
    let tokens = cx.state.sample_rows(mb, l, vocab);
    ids[..tokens.len()].copy_from_slice(&tokens);
    cx.state.put_sampled(ub, tokens);
    if cx.state.wants_logits() {
        cx.state.put_logits(ub, l.to_vec());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::catalog::signature;
    use crate::ir::{ExpertRef, ExpertSet, Shape};
    use crate::model::card::ModelCard;

    /// Every op of the table can be elaborated (a signature that names its declared
    /// arguments), costed (finite, non-negative flops and bytes) and run on the CPU (a
    /// kernel in the table). Removing a kernel row fails here, not in a user's run.
    #[test]
    fn every_op_has_a_signature_work_and_a_cpu_kernel() {
        let card = ModelCard::load("mixtral-tiny").unwrap();
        let shape = Shape {
            tokens: 4,
            seqs: 2,
            context: 8,
            act_bytes: 4,
            kv_bytes: 4,
        };
        let statics = crate::ir::catalog::StaticArgs {
            layer: Some(0),
            ub: Some(0),
            part: Some(AttnPart::Decode),
            set: Some(ExpertSet::One(ExpertRef::Index(1))),
        };
        for kind in OpKind::ALL {
            let def = kind.def();
            let op = (def.build)(&statics).unwrap();
            assert_eq!(op.kind(), kind);
            let roles: Vec<Role> = signature(&op, &card).iter().map(|s| s.role).collect();
            let declared: Vec<Role> = def.args.iter().map(|a| a.role).collect();
            assert!(!roles.is_empty(), "{}: no signature", def.name);
            assert_eq!(roles, declared, "{}", def.name);
            let flops = (def.work.flops)(&op, &card, &shape);
            assert!(
                flops.is_finite() && flops >= 0.0,
                "{}: flops {flops}",
                def.name
            );
            for arg in def.args {
                let bytes = crate::ir::catalog::role_traffic(&op, arg.role, &card, &shape, 64).1;
                assert!(
                    bytes.is_finite() && bytes > 0.0,
                    "{}: bytes {bytes}",
                    def.name
                );
            }
            assert!(
                CPU_KERNELS.get(kind).is_some(),
                "{}: no CPU kernel",
                def.name
            );
        }
        // No kind without a row, none with two (the lookup would silently take the first).
        assert_eq!(CPU_KERNELS.gaps(), vec![], "one kernel row per op");
    }
}
