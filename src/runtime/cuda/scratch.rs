//! The CUDA backend's scratch rules: the bytes one task takes from its stream's workspace
//! ([`super::launch::Workspace`]), from its op, its shape and the model's weights as stored.
//!
//! Takes a model card (and, per task, its op, shape and argument counts: the IR's
//! [`TaskFacts`]); gives [`ScratchRules::task_bytes`], an upper bound on the sum of the
//! 256-byte-aligned pieces the task's launches take (a workspace is reset per task and
//! hands its pieces out by bumping an offset, so a task's pieces add up), and [`CUDA`],
//! these rules behind the compiler's interface (`ir::scratch::DeviceScratch`), which the
//! backend registers (`Registration::scratch`). Both sides of the proof use these rules:
//! `cost::budget` counts, per device stream, the largest bound over the stream's tasks
//! (given them by the compile for this backend, never importing them), and the backend
//! reserves each stream's workspace at that size when it is set up and reports the
//! measured high-water mark against it (`BUDGET VIOLATION` past it).
//!
//! The rules follow the backend's code paths (`ops`, `attention`, `deepseek`, `moe`,
//! `launch`): where a path depends on what only the run knows, they take the larger side,
//! so a bound holds for any routing and any split of a micro-batch into sequences:
//! - a projection of few rows (decode) takes quantised activations or nothing; past
//!   [`GEMV_MAX_ROWS`] rows a quantised matrix is decoded whole to f32 and an f16 one
//!   widened whole (`out x in` floats), bf16 ones take the hi/lo pair and its products;
//! - prefill attention without tensor cores (MLA always) takes a score row per query row,
//!   head and key (`rows x heads x max_keys` floats, the keys the block tables hold, the
//!   context rounded up to the 16-token block);
//! - the grouped experts (at most [`GROUPED_MAX_ENTRIES`] routed entries) take the
//!   permutation and tile tables and a hidden row per routed entry; past that the host
//!   groups them and each routed expert takes its gathered rows, its gate/up values and
//!   its projections' scratch, handed out again to the next expert: counted for one
//!   expert routed every token (`tokens x (per-row bytes)`, its matrices decoded whole
//!   past 16 rows).
//!
//! What the rules cannot see: an `experts` task whose members' weights are not all in its
//! arguments groups on the host even under [`GROUPED_MAX_ENTRIES`] entries (the bound
//! counts the device path there); the run's report then says `BUDGET VIOLATION` if that
//! takes more. Step tables (`upload_step`) and constant tables (`upload_constant`) are
//! buffers of their own, not the workspace (a few KiB a micro-batch).
//!
//! Cheap enough for the planner: a rule's arithmetic runs once per distinct (op kind,
//! layer class, shape, argument counts) of a [`ScratchRules`] (memoised), and the layer
//! layouts once per distinct layer storage.

use super::launch::{act_format, int_product, linear_kernel, q8_folds, DevMatrix, GEMV_MAX_ROWS};
use super::moe::{max_tiles, ExpertKernels, GROUPED_MAX_ENTRIES, ROUTER_MAX_EXPERTS};
use super::tensor_cores::TensorCores;
use crate::ir::catalog::{AttnPart, ExpertSet, Op};
use crate::ir::scratch::{DeviceScratch, TaskFacts, TaskScratch};
use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::formats::WeightTensor;
use crate::model::layout::{LayerLayout, Segment};
use crate::model::segment::SegmentKind;
use crate::model::vocab::{NormKind, Orientation};
use crate::quant::storage::WeightDtype;

/// Alignment of every workspace piece (`launch::SCRATCH_ALIGN`).
const ALIGN: u64 = 256;

/// A piece of `bytes` as the workspace hands it out (0 stays 0).
fn piece(bytes: u64) -> u64 {
    bytes.next_multiple_of(ALIGN)
}

/// The choices of the process that change which kernels run (read once by the backend's
/// own code): quantised weights decoded to f32 (`MOEC_QUANT_PRODUCT=decoded`), the
/// tensor-core policy (`MOEC_TENSOR_CORES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Policy {
    decodes_quant: bool,
    tensor_cores: TensorCores,
}

/// A matrix as the kernels see it.
#[derive(Debug, Clone, Copy)]
struct Mat {
    dev: DevMatrix,
}

impl Mat {
    fn of(seg: &Segment) -> Self {
        Mat {
            dev: DevMatrix {
                // Weights in the image start on its segment alignment (a multiple of 16).
                ptr: 0,
                dtype: seg.dtype,
                quant: seg.quant,
                rows: seg.rows,
                cols: seg.cols,
                orientation: seg.orientation.unwrap_or(Orientation::OutIn),
            },
        }
    }

    fn elems(&self) -> u64 {
        (self.dev.rows * self.dev.cols) as u64
    }
}

/// Per-row and per-call parts of a projection's scratch, for the host-grouped experts
/// (where the rows per expert are unknown).
#[derive(Debug, Clone, Copy, Default)]
struct Split {
    /// Bytes per row, at most (whatever the kernel).
    per_row: u64,
    /// Bytes a call takes once rows pass [`GEMV_MAX_ROWS`] (a matrix decoded or widened
    /// whole).
    big: u64,
    /// Bytes a call takes whatever its rows (a matrix the few-row kernels do not take).
    always: u64,
    /// Pieces a call takes at most (each up to [`ALIGN`] - 1 bytes of padding).
    pieces: u64,
}

impl std::ops::Add for Split {
    type Output = Split;
    fn add(self, o: Split) -> Split {
        Split {
            per_row: self.per_row + o.per_row,
            big: self.big + o.big,
            always: self.always + o.always,
            pieces: self.pieces + o.pieces,
        }
    }
}

/// One layer's matrices and vectors as stored.
struct LayerMats {
    layout: LayerLayout,
}

impl LayerMats {
    fn mat(&self, kind: SegmentKind) -> Option<Mat> {
        self.layout.segment(kind).map(Mat::of)
    }

    fn has(&self, kind: SegmentKind) -> bool {
        self.layout.segment(kind).is_some()
    }

    /// A vector segment widened to f32 into scratch (`GpuCx::vector_f32`) unless stored
    /// f32.
    fn vector(&self, kind: SegmentKind) -> u64 {
        match self.layout.segment(kind) {
            Some(s) if s.dtype != WeightDtype::F32 => piece((s.rows * s.cols * 4) as u64),
            _ => 0,
        }
    }
}

/// Key of a memoised rule: the op's kind and static choices, the layer's class, the shape
/// and the argument counts.
type Key = (u8, u32, u32, u8, [u64; 3], (bool, usize, usize));

/// The scratch rules of one model: its layers' storage, built once, and the bounds found
/// so far.
pub struct ScratchRules {
    arch: ArchSpec,
    experts: u64,
    policy: Policy,
    /// Distinct layer storages.
    profiles: Vec<LayerMats>,
    /// Per layer: its profile.
    layer_profile: Vec<u32>,
    head: Mat,
    /// Tokens a sequence's KV blocks are allocated for (prompt and generation): what a
    /// block table holds from the prefill on.
    kv_tokens: usize,
    /// The KV cache's heads and head width as the runtime lays it out.
    kv_heads: usize,
    kv_head_dim: usize,
    memo: crate::ir::FastMap<Key, u64>,
}

impl ScratchRules {
    /// The rules for `card`'s weights as stored and `workload`'s sequences, under this
    /// process's kernel choices.
    pub fn new(card: &ModelCard, workload: &crate::ir::Workload) -> Self {
        let arch = ArchSpec::from_card(card);
        let mut keys: Vec<(bool, Option<crate::model::formats::LayerStorage>)> = Vec::new();
        let mut profiles = Vec::new();
        let mut layer_profile = Vec::with_capacity(arch.layers);
        for l in 0..arch.layers {
            let key = (
                arch.is_dense(l),
                card.formats.layers.get(&(l as u64)).cloned(),
            );
            let index = match keys.iter().position(|k| *k == key) {
                Some(i) => i,
                None => {
                    let layout = LayerLayout::with_storage(
                        &arch,
                        l,
                        |k| card.storage(WeightTensor::layer(k)),
                        |k| {
                            card.formats
                                .layer_storage(card.dtype, l as u64, WeightTensor::layer(k))
                        },
                    );
                    keys.push(key);
                    profiles.push(LayerMats { layout });
                    profiles.len() - 1
                }
            };
            layer_profile.push(index as u32);
        }
        let storage = card.storage(WeightTensor::LmHead);
        let head = Mat {
            dev: DevMatrix {
                ptr: 0,
                dtype: storage.dtype(),
                quant: storage.quant(),
                rows: arch.vocab,
                cols: arch.hidden,
                orientation: Orientation::OutIn,
            },
        };
        ScratchRules {
            experts: card.experts,
            policy: Policy {
                decodes_quant: crate::math::isa::Kernels::process().decodes_quant(),
                tensor_cores: TensorCores::process().unwrap_or(TensorCores::Auto),
            },
            arch,
            profiles,
            layer_profile,
            head,
            kv_heads: card.kv_heads as usize,
            kv_head_dim: card.head_dim as usize,
            kv_tokens: workload.prompt_len.saturating_add(workload.gen_len) as usize,
            memo: crate::ir::FastMap::default(),
        }
    }

    /// Bytes of workspace a task of `facts` takes at most (the sum of its pieces).
    pub fn task_bytes(&mut self, facts: &TaskFacts) -> u64 {
        let (kind, layer, members, part) = match facts.op {
            Op::Embed { .. } => return 0,
            Op::Copy => match facts.kv_copy {
                Some(part) => (11, 0, 0, part as u8),
                None => return 0,
            },
            Op::PreAttn { layer, .. } => (1, layer, 0, 0),
            Op::Attn { layer, part, .. } => (2, layer, 0, part as u8),
            Op::PostAttn { layer, .. } => (3, layer, 0, 0),
            Op::OProj { layer, .. } => (4, layer, 0, 0),
            Op::Gate { layer, .. } => (5, layer, 0, 0),
            Op::Pregate { layer, .. } => (6, layer, 0, 0),
            Op::Experts { layer, set, .. } => (7, layer, self.members(set), 0),
            Op::Combine { layer, .. } => (8, layer, 0, 0),
            Op::LmHead { .. } => (9, 0, 0, 0),
            Op::Sample { .. } => (10, 0, 0, 0),
        };
        let l = (layer as usize).min(self.arch.layers.saturating_sub(1));
        // Layers alike in storage, density and window take alike.
        let class = self.layer_profile.get(l).copied().unwrap_or(0) * 2
            + u32::from(self.arch.attn_of(l).sliding_window.is_some());
        let s = &facts.shape;
        let key: Key = (
            kind,
            class,
            members,
            part,
            [s.tokens, s.seqs, s.context],
            (facts.kv_arg, facts.a_args.min(2), facts.acc_args.min(2)),
        );
        if let Some(&bytes) = self.memo.get(&key) {
            return bytes;
        }
        let bytes = self.compute(facts, l, members);
        self.memo.insert(key, bytes);
        bytes
    }

    fn members(&self, set: ExpertSet) -> u32 {
        set.len(self.experts).min(self.experts) as u32
    }

    fn compute(&self, facts: &TaskFacts, l: usize, members: u32) -> u64 {
        let s = &facts.shape;
        let (n, seqs) = (s.tokens as usize, (s.seqs as usize).max(1));
        let Some(mats) = self
            .layer_profile
            .get(l)
            .map(|&p| &self.profiles[p as usize])
        else {
            return 0;
        };
        let a = &self.arch;
        let (d, k) = (a.hidden as u64, a.top_k as u64);
        let n64 = n as u64;
        match facts.op {
            Op::Embed { .. } => 0,
            Op::Copy => self.kv_copy(n, seqs, s.context as usize, facts.kv_copy),
            Op::PreAttn { .. } => self.pre_attn(mats, n),
            Op::Attn { part, .. } => self.attn(l, n, seqs, s.context as usize, part, facts.kv_arg),
            Op::OProj { .. } => self.o_proj(mats, n),
            Op::PostAttn { .. } => {
                let merged = if facts.a_args >= 2 {
                    piece(n64 * a.q_dim() as u64 * 4)
                } else {
                    0
                };
                let ffn = if a.is_dense(l) {
                    2 * piece(n64 * d * 4) + self.dense_swiglu(mats, n)
                } else {
                    piece(n64 * d * 4)
                        + piece(n64 * k * 8)
                        + piece(n64 * k * d * 4)
                        + self.gate_route(mats, n)
                        + self.routed(mats, n, a.experts as u32)
                        + if a.shared_ffn > 0 {
                            piece(n64 * d * 4) + self.shared_expert(mats, n)
                        } else {
                            0
                        }
                };
                merged + self.o_proj(mats, n) + ffn
            }
            Op::Gate { .. } => {
                if a.is_dense(l) {
                    return self.dense_swiglu(mats, n);
                }
                self.gate_route(mats, n)
                    + if a.shared_ffn > 0 {
                        self.shared_expert(mats, n)
                    } else {
                        0
                    }
            }
            Op::Pregate { .. } => piece(n64 * d * 4) + self.route(mats, n),
            Op::Experts { .. } => {
                if a.is_dense(l) {
                    0
                } else {
                    self.routed(mats, n, members)
                }
            }
            Op::Combine { .. } => {
                if facts.acc_args >= 2 {
                    piece(n64 * k * d * 4)
                } else {
                    0
                }
            }
            Op::LmHead { .. } => 2 * piece(seqs as u64 * d * 4) + self.linear(seqs, &self.head),
            // Temperature sampling uploads the sampled ids.
            Op::Sample { .. } => piece(seqs as u64 * 4),
        }
    }

    /// A KV-part copy in a recorded step: one `copy_runs` launch whose table of (offset,
    /// length) runs is uploaded, `16 x capacity` bytes, the capacity the most runs rounded
    /// up to a power of two (at least 16). Runs (`driver::kv_copy::runs`): two a whole
    /// block (K and V), `kv_heads x (head_dim + 1)` a partial one, at most two partial
    /// blocks a sequence; a block a position at most.
    fn kv_copy(
        &self,
        n: usize,
        seqs: usize,
        context: usize,
        part: Option<crate::ir::KvPart>,
    ) -> u64 {
        let Some(part) = part else { return 0 };
        let positions = match part {
            crate::ir::KvPart::Appended => n,
            crate::ir::KvPart::Context => seqs * context.max(self.kv_tokens),
        };
        let (kvh, hd) = (self.kv_heads, self.kv_head_dim);
        let runs = 2 * seqs * kvh * (hd + 1) + 2 * positions;
        piece(16 * runs.next_power_of_two().max(16) as u64)
    }

    /// `StreamCx::linear` of `n` rows: quantised activations for a few-row integer product
    /// (none when its one row is quantised inside the launch); else the activations
    /// rounded through 8 bits for quantised weights, and past the few-row kernels the
    /// matrix decoded (quantised) or widened (f16) whole, or bf16's hi/lo pair and
    /// products.
    fn linear(&self, n: usize, m: &Mat) -> u64 {
        if n == 0 {
            return 0;
        }
        let w = &m.dev;
        let (kin, out) = (w.in_dim() as u64, w.out_dim() as u64);
        let n64 = n as u64;
        let kernel = linear_kernel(w, n);
        if kernel == "q8_quantize + linear_gemv_q8" {
            return self.quantize(n, w.in_dim(), w.quant);
        }
        let rounded = self.rounded(n64 * kin, w.quant);
        rounded
            + match kernel {
                "linear_gemv" => 0,
                "dequant_f32 + cublasSgemm" | "widen_f16 + cublasSgemm" => piece(m.elems() * 4),
                "cublasGemmEx (bf16 pair)" => piece(2 * n64 * kin * 2) + piece(out * 2 * n64 * 4),
                _ => 0,
            }
    }

    /// `q8_quantize` of `rows` rows of `cols` values for weights of `quant` (codes and
    /// scales), or nothing when one row is quantised inside the launch.
    fn quantize(&self, rows: usize, cols: usize, quant: Option<crate::quant::QuantFormat>) -> u64 {
        let format = act_format(quant);
        if q8_folds(rows, cols, format) {
            return 0;
        }
        let elems = (rows * cols) as u64;
        piece(elems) + piece(elems / format.block_elems() as u64 * 4)
    }

    /// `quant_activations`: `elems` values rounded through 8 bits into scratch for
    /// quantised weights (not when the process decodes them).
    fn rounded(&self, elems: u64, quant: Option<crate::quant::QuantFormat>) -> u64 {
        if quant.is_some() && !self.policy.decodes_quant && elems > 0 {
            piece(elems * 4)
        } else {
            0
        }
    }

    /// `StreamCx::linear_shared` of `n` rows through `mats`: one launch for two or three
    /// few-row products of one kernel (integer: one `q8_quantize`), else each as
    /// [`ScratchRules::linear`] with integer products sharing their quantised rows.
    fn linear_shared(&self, n: usize, mats: &[Mat]) -> u64 {
        if n == 0 || mats.is_empty() {
            return 0;
        }
        let int = |m: &Mat| linear_kernel(&m.dev, n) == "q8_quantize + linear_gemv_q8";
        let float = |m: &Mat| linear_kernel(&m.dev, n) == "linear_gemv" && m.dev.quant.is_none();
        let k = mats[0].dev.in_dim();
        let same_in = mats.iter().all(|m| m.dev.in_dim() == k);
        let fmt = act_format(mats[0].dev.quant);
        if (2..=3).contains(&mats.len()) && n <= GEMV_MAX_ROWS && same_in {
            if mats.iter().all(float) {
                return 0;
            }
            if mats
                .iter()
                .all(|m| int(m) && act_format(m.dev.quant) == fmt)
            {
                return self.quantize(n, k, mats[0].dev.quant);
            }
        }
        let mut formats: Vec<(crate::quant::q8::ActFormat, usize)> = Vec::new();
        let mut bytes = 0;
        for m in mats {
            let (kin, f) = (m.dev.in_dim(), act_format(m.dev.quant));
            if int(m) && !q8_folds(n, kin, f) {
                if !formats.contains(&(f, kin)) {
                    formats.push((f, kin));
                    bytes += self.quantize(n, kin, m.dev.quant);
                }
            } else {
                bytes += self.linear(n, m);
            }
        }
        bytes
    }

    /// `pre_attn`: the normalised rows (unless q|k|v's float launch normalises them
    /// itself) and q/k/v's products; biases and norm weights widened; MLA's own path.
    fn pre_attn(&self, mats: &LayerMats, n: usize) -> u64 {
        let a = &self.arch;
        let n64 = n as u64;
        let d = a.hidden as u64;
        if n == 0 {
            return 0;
        }
        if let Some(m) = &a.mla {
            let (heads, r, rope, nope) = (
                a.attn.heads as u64,
                m.kv_lora_rank,
                m.qk_rope_head_dim,
                m.qk_nope_head_dim,
            );
            let qk = nope + rope;
            let mut bytes = piece(n64 * d * 4) + piece(n64 * heads * qk * 4);
            match (mats.mat(SegmentKind::QAProj), mats.mat(SegmentKind::QBProj)) {
                (Some(qa), Some(qb)) if m.q_lora_rank.is_some() => {
                    let rank = qa.dev.out_dim() as u64;
                    bytes += 2 * piece(n64 * rank * 4) + self.linear(n, &qa) + self.linear(n, &qb);
                }
                _ => {
                    bytes += mats
                        .mat(SegmentKind::QProj)
                        .map_or(0, |q| self.linear(n, &q))
                }
            }
            bytes += piece(n64 * (r + rope) * 4)
                + mats
                    .mat(SegmentKind::KvAProj)
                    .map_or(0, |w| self.linear(n, &w));
            let (key_kind, _) = LayerLayout::mla_up_kinds(m);
            let key_quant = mats.mat(key_kind).and_then(|w| w.dev.quant);
            return bytes + self.rounded(n64 * heads * nope, key_quant);
        }
        let mut bytes = match mats.mat(SegmentKind::QkvProj) {
            Some(qkv) => piece(n64 * d * 4) + self.linear(n, &qkv),
            None => {
                let qkv: Vec<Mat> = [SegmentKind::QProj, SegmentKind::KProj, SegmentKind::VProj]
                    .into_iter()
                    .filter_map(|kind| mats.mat(kind))
                    .collect();
                let float_folds = a.norm == NormKind::Rms
                    && (2..=3).contains(&qkv.len())
                    && n <= GEMV_MAX_ROWS
                    && qkv.iter().all(|m| {
                        m.dev.quant.is_none() && linear_kernel(&m.dev, n) == "linear_gemv"
                    });
                if float_folds {
                    0
                } else {
                    piece(n64 * d * 4) + self.linear_shared(n, &qkv)
                }
            }
        };
        if mats.has(SegmentKind::QBias) {
            bytes += [SegmentKind::QBias, SegmentKind::KBias, SegmentKind::VBias]
                .into_iter()
                .map(|kind| mats.vector(kind))
                .sum::<u64>();
        }
        if mats.has(SegmentKind::QNorm) {
            bytes += mats.vector(SegmentKind::QNorm) + mats.vector(SegmentKind::KNorm);
        }
        if a.attn.sinks {
            bytes += mats.vector(SegmentKind::Sinks);
        }
        bytes
    }

    /// `attn`: the scratch cache of a call without `kv`, then per run of rows the decode
    /// kernel's split partials, or the prefill kernel's scores (none on tensor cores).
    fn attn(
        &self,
        layer: usize,
        n: usize,
        seqs: usize,
        context: usize,
        part: AttnPart,
        kv_arg: bool,
    ) -> u64 {
        use super::attention::{decode_split_bound, ATTN_MMA_MAX_DIM, ATTN_MMA_MIN_ROWS};
        if n == 0 {
            return 0;
        }
        let shape = self.arch.attn_of(layer);
        let (heads, kvh, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let mla = self.arch.mla.is_some();
        // The keys a row's block table holds: its sequence's tokens (from the prefill on,
        // prompt and generation: blocks are allocated for both) rounded up to the 16-token
        // block (blocks of 8, 4, 2 or 1 round up to less), within the window.
        let held = if kv_arg {
            context.max(self.kv_tokens).max(1)
        } else {
            n.max(1)
        };
        let mut keys = held.next_multiple_of(16);
        if let Some(w) = shape.sliding_window.filter(|&w| w > 0) {
            keys = keys.min(w);
        }
        let pools = if kv_arg {
            0
        } else {
            let blocks = (n.div_ceil(16) + seqs) as u64;
            piece(2 * blocks * (16 * kvh * hd) as u64 * 4)
        };
        let scores = |rows: usize| piece((rows * heads * keys * 4) as u64);
        // One split writes no partials.
        let splits = decode_split_bound(keys);
        let partials = |rows: usize| {
            if splits > 1 {
                piece((rows * heads * splits * (2 + hd) * 4) as u64)
            } else {
                0
            }
        };
        let tc_kernel = !mla && kvh > 0 && heads.is_multiple_of(kvh) && hd <= ATTN_MMA_MAX_DIM;
        let attend = if n <= seqs {
            // One token a sequence: the decode kernel (MLA's kernel takes scores).
            if mla {
                scores(n)
            } else {
                partials(n)
            }
        } else if part == AttnPart::All && !tc_kernel {
            // One run of every row.
            scores(n)
        } else if !tc_kernel {
            // A run a stretch of the part's sequences, each its own piece.
            scores(n) + ALIGN * seqs as u64
        } else if part == AttnPart::All {
            // One run of every row.
            if self
                .policy
                .tensor_cores
                .chosen_rows(n, seqs, ATTN_MMA_MIN_ROWS)
            {
                0
            } else {
                scores(n)
            }
        } else {
            // Runs of the part's sequences: a run under the tensor cores' rows per
            // sequence takes scores (fewer than ATTN_MMA_MIN_ROWS rows per sequence of
            // it), a run of one token each the decode kernel.
            let short = match self.policy.tensor_cores {
                TensorCores::Always => 0,
                TensorCores::Never => n,
                TensorCores::Auto => n.min((ATTN_MMA_MIN_ROWS - 1) * seqs),
            };
            scores(short) + partials(seqs) + 2 * ALIGN * seqs as u64
        };
        pools + attend
    }

    /// `o_proj_residual`: the product into scratch first with a bias; MLA's values.
    fn o_proj(&self, mats: &LayerMats, n: usize) -> u64 {
        let a = &self.arch;
        let n64 = n as u64;
        if n == 0 {
            return 0;
        }
        let o = mats
            .mat(SegmentKind::OProj)
            .map_or(0, |w| self.linear(n, &w));
        if let Some(m) = &a.mla {
            let heads = a.attn.heads as u64;
            let (_, value_kind) = LayerLayout::mla_up_kinds(m);
            let quant = mats.mat(value_kind).and_then(|w| w.dev.quant);
            return piece(n64 * heads * m.v_head_dim * 4)
                + self.rounded(n64 * heads * m.kv_lora_rank, quant)
                + o;
        }
        if a.o_bias && mats.has(SegmentKind::OBias) {
            piece(n64 * a.hidden as u64 * 4) + o + mats.vector(SegmentKind::OBias)
        } else {
            o
        }
    }

    /// The gate's normalise-and-route: nothing when `moe_gate_route` does it in one launch
    /// (a few rows of a float `[out, in]` router, softmax-then-top-k), else the router's.
    fn gate_route(&self, mats: &LayerMats, n: usize) -> u64 {
        let a = &self.arch;
        let fused = n > 0
            && n <= GEMV_MAX_ROWS
            && a.deepseek_router.is_none()
            && !a.router_bias_topk_softmax
            && a.experts <= ROUTER_MAX_EXPERTS
            && a.top_k <= a.experts
            && mats
                .mat(SegmentKind::Router)
                .is_some_and(|r| r.dev.quant.is_none() && r.dev.orientation == Orientation::OutIn);
        if fused {
            0
        } else {
            self.route(mats, n)
        }
    }

    /// `GpuCx::route`: the router's logits and product, its bias widened.
    fn route(&self, mats: &LayerMats, n: usize) -> u64 {
        if n == 0 {
            return 0;
        }
        let a = &self.arch;
        let logits = piece((n * a.experts * 4) as u64);
        let product = mats
            .mat(SegmentKind::Router)
            .map_or(0, |r| self.linear(n, &r));
        let bias = if a.has_router_bias() && mats.has(SegmentKind::RouterBias) {
            mats.vector(SegmentKind::RouterBias)
        } else {
            0
        };
        logits + product + bias
    }

    /// `swiglu_mlp` of `n` rows over `[gate, up, down]`: gate and up values, their
    /// products, down's.
    fn swiglu(&self, n: usize, [gate, up, down]: [Option<Mat>; 3]) -> u64 {
        let (Some(gate), Some(up), Some(down)) = (gate, up, down) else {
            return 0;
        };
        if n == 0 {
            return 0;
        }
        let f = gate.dev.out_dim() as u64;
        2 * piece(n as u64 * f * 4) + self.linear_shared(n, &[gate, up]) + self.linear(n, &down)
    }

    fn dense_swiglu(&self, mats: &LayerMats, n: usize) -> u64 {
        self.swiglu(
            n,
            [
                mats.mat(SegmentKind::DenseGate),
                mats.mat(SegmentKind::DenseUp),
                mats.mat(SegmentKind::DenseDown),
            ],
        )
    }

    /// The shared expert: its SwiGLU, and its gate's logits and product.
    fn shared_expert(&self, mats: &LayerMats, n: usize) -> u64 {
        let mlp = self.swiglu(
            n,
            [
                mats.mat(SegmentKind::SharedGate),
                mats.mat(SegmentKind::SharedUp),
                mats.mat(SegmentKind::SharedDown),
            ],
        );
        let gate = match mats.mat(SegmentKind::SharedExpertGate) {
            Some(g) if n > 0 => piece(n as u64 * 4) + self.linear(n, &g),
            _ => 0,
        };
        mlp + gate
    }

    /// The routed experts of `members` over `n` tokens: grouped on the device up to
    /// [`GROUPED_MAX_ENTRIES`] routed entries, else grouped on the host.
    fn routed(&self, mats: &LayerMats, n: usize, members: u32) -> u64 {
        let a = &self.arch;
        let entries = n * a.top_k;
        if members == 0 || n == 0 {
            return 0;
        }
        let fused = a.clamped_swiglu.is_some();
        let (first, second) = if fused {
            let gu = mats.mat(SegmentKind::ExpertGateUp(0));
            (gu, gu)
        } else {
            (
                mats.mat(SegmentKind::ExpertGate(0)),
                mats.mat(SegmentKind::ExpertUp(0)),
            )
        };
        let (Some(first), Some(second), Some(down)) =
            (first, second, mats.mat(SegmentKind::ExpertDown(0)))
        else {
            return 0;
        };
        if a.experts <= super::moe::MOE_MAX_EXPERTS && entries <= GROUPED_MAX_ENTRIES {
            self.device_experts(n, members as usize, [first, second, down])
        } else {
            self.host_experts(mats, entries, [first, second, down])
        }
    }

    /// `grouped_experts`: the permutation and tiles, a hidden row per routed entry (and
    /// gpt-oss's gate/up pair), the activations each projection multiplies.
    fn device_experts(&self, n: usize, members: usize, mats: [Mat; 3]) -> u64 {
        let a = &self.arch;
        let (d, f) = (a.hidden, a.ffn);
        let entries = n * a.top_k;
        let e64 = entries as u64;
        let tables = 3 * piece(e64 * 4) + piece((2 + 3 * max_tiles(entries, members)) as u64 * 4);
        let shapes = mats.map(|m| (m.dev.code(), m.dev.orientation, m.dev.quant));
        let fused = a.clamped_swiglu.is_some();
        let hidden = piece(e64 * f as u64 * 4);
        let [q0, q1, q2] = shapes.map(|s| s.2);
        if ExpertKernels::choose(&shapes, fused, true) == ExpertKernels::Int {
            return tables
                + hidden
                + self.quantize(n, d, q0)
                + self.quantize_rows(entries, n, f, q2);
        }
        let x_in = self.rounded((n * d) as u64, q0);
        let down_in = self.rounded(e64 * f as u64, q2);
        if fused {
            tables + hidden + piece(e64 * 2 * f as u64 * 4) + x_in + down_in
        } else {
            let up_in = if q1 == q0 {
                0
            } else {
                self.rounded((n * d) as u64, q1)
            };
            tables + hidden + x_in + up_in + down_in
        }
    }

    /// `q8_quantize` of the grouped hidden rows (`rows` of them) for down, unless the call's
    /// `n` tokens are one (its tiles then quantise their row themselves).
    fn quantize_rows(
        &self,
        rows: usize,
        n: usize,
        cols: usize,
        quant: Option<crate::quant::QuantFormat>,
    ) -> u64 {
        let format = act_format(quant);
        if q8_folds(n, cols, format) {
            return 0;
        }
        let elems = (rows * cols) as u64;
        piece(elems) + piece(elems / format.block_elems() as u64 * 4)
    }

    /// `host_experts` over `entries` routed entries: per routed expert with m rows its
    /// uploads (3 tables), gathered and output rows, gate/up values and projections, handed
    /// out again to the next expert. The largest expert's, over any routing: as many rows
    /// as tokens, its matrices decoded whole past [`GEMV_MAX_ROWS`] rows.
    fn host_experts(&self, mats: &LayerMats, entries: usize, m: [Mat; 3]) -> u64 {
        let a = &self.arch;
        let (d, f) = (a.hidden as u64, a.ffn as u64);
        let mut per = Split {
            per_row: 3 * 4 + 2 * d * 4,
            pieces: 5,
            ..Split::default()
        };
        let [first, second, down] = m;
        per = per + self.linear_split(&down);
        if a.clamped_swiglu.is_some() {
            per =
                per + Split {
                    per_row: f * 4 + 2 * f * 4,
                    pieces: 2,
                    ..Split::default()
                } + self.linear_split(&first)
                    + Split {
                        always: mats.vector(SegmentKind::ExpertGateUpBias(0))
                            + mats.vector(SegmentKind::ExpertDownBias(0)),
                        pieces: 2,
                        ..Split::default()
                    };
        } else {
            per =
                per + Split {
                    per_row: 2 * f * 4,
                    pieces: 2,
                    ..Split::default()
                } + self.linear_split(&first)
                    + self.linear_split(&second);
        }
        // Each expert's pieces are handed out again to the next (a scope per expert): the
        // task takes its largest expert's. A token routes to an expert once, so an expert
        // has at most the tokens' rows.
        let rows = (entries / a.top_k.max(1)).min(entries) as u64;
        let big = if rows > GEMV_MAX_ROWS as u64 {
            per.big
        } else {
            0
        };
        rows * per.per_row + per.always + per.pieces * ALIGN + big
    }

    /// A projection's scratch over an unknown number of rows, split as [`Split`] says
    /// (the larger of the few-row and the many-row kernels' per-row bytes).
    fn linear_split(&self, m: &Mat) -> Split {
        let w = &m.dev;
        let (kin, out) = (w.in_dim() as u64, w.out_dim() as u64);
        let quantised = w.quant.is_some() && !self.policy.decodes_quant;
        let few_int = int_product(w.quant);
        // At GEMV_MAX_ROWS rows (the most the few-row kernels take): which kernel.
        let few_gemv = linear_kernel(w, GEMV_MAX_ROWS) == "linear_gemv";
        let many = linear_kernel(w, GEMV_MAX_ROWS + 1);
        // Quantised rows (codes and a scale a block of 32 or 256) at few rows, rounded
        // f32 rows otherwise.
        let mut per_row = 0;
        if few_int {
            per_row = kin + kin.div_ceil(8);
        }
        if quantised {
            per_row = per_row.max(kin * 4);
        }
        let (whole, pair) = match many {
            "dequant_f32 + cublasSgemm" | "widen_f16 + cublasSgemm" => (m.elems() * 4, 0),
            "cublasGemmEx (bf16 pair)" => (0, 2 * kin * 2 + out * 2 * 4),
            _ => (0, 0),
        };
        let (big, always) = if few_gemv || few_int {
            (whole, 0)
        } else {
            (0, whole)
        };
        Split {
            per_row: per_row + pair,
            big,
            always,
            pieces: 3,
        }
    }
}

/// The most scratch one GPU task of a micro-batch of `tokens` new tokens over `seqs`
/// sequences, each attending to `context` tokens, takes on `card` (every op, every layer,
/// all experts, a KV cache argument): the schedule language's `gpu_scratch(n, s, c)`, so a
/// fill rule that computes what fits in `gpu.mem` can leave room for each device
/// stream's workspace as the budget counts it.
pub fn max_task_bytes(card: &ModelCard, tokens: u64, seqs: u64, context: u64) -> u64 {
    let workload = crate::ir::Workload {
        batch: seqs,
        prompt_len: context,
        gen_len: 0,
    };
    let mut rules = ScratchRules::new(card, &workload);
    let shape = crate::ir::scratch::max_task_shape(tokens, seqs, context);
    crate::ir::scratch::max_task_ops(card.layers as u32)
        .map(|op| rules.task_bytes(&crate::ir::scratch::max_task_facts(op, shape)))
        .max()
        .unwrap_or(0)
}

impl TaskScratch for ScratchRules {
    fn task_bytes(&mut self, facts: &TaskFacts) -> u64 {
        ScratchRules::task_bytes(self, facts)
    }
}

/// The CUDA backend's scratch rules behind the compiler's interface.
#[derive(Debug)]
pub struct CudaScratch;

/// What the CUDA backend registers (`Registration::scratch`).
pub const CUDA: CudaScratch = CudaScratch;

impl DeviceScratch for CudaScratch {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn rules(&self, card: &ModelCard, workload: &crate::ir::Workload) -> Box<dyn TaskScratch> {
        Box::new(ScratchRules::new(card, workload))
    }

    fn max_task_bytes(&self, card: &ModelCard, tokens: u64, seqs: u64, context: u64) -> u64 {
        max_task_bytes(card, tokens, seqs, context)
    }
}
