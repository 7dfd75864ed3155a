//! The reference forward pass ("the oracle"): a plain sequential composition of the
//! shared kernels, which every schedule's output must reproduce.
//!
//! Takes a checkpoint (or any [`ModelWeights`] views) and prompts as token ids; gives,
//! per prompt, the generated ids, each one's log-probability under the model and the
//! last prompt position's logits. All prompts are prefilled in one micro-batch and then
//! decoded together one token per step over a paged KV cache; each sequence has its own
//! seeded sampler, so results do not depend on how prompts are batched. The kernels run
//! with the process's instruction set ([`Kernels::process`], what the runtime uses too)
//! unless [`Oracle::with_kernels`] names another (tests compare portable and SIMD runs).

pub mod perplexity;

use crate::math::attention::AttnSeq;
use crate::math::head::embed;
use crate::math::isa::Kernels;
use crate::math::kv_cache::{KvError, PagedKvCache};
use crate::math::rope::RopeTable;
use crate::math::sampling::{log_prob, sample};
use crate::math::views::ModelWeights;
use crate::math::KernelError;
use crate::model::arch::ArchSpec;
use crate::model::card::ModelCard;
use crate::model::vocab::Sampling;
use crate::model::vocab::{KvLayout, KvType};
use crate::rng::Rng;
use crate::weights::checkpoint::{Checkpoint, CheckpointError};

/// Tokens per KV block in the oracle's cache.
pub const ORACLE_BLOCK_SIZE: usize = 16;

/// How to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate per prompt at most.
    pub max_new_tokens: usize,
    /// Greedy or seeded temperature/top-p.
    pub sampling: Sampling,
    /// Seed of the samplers (sequence `i` uses a stream derived from `seed` and `i`).
    pub seed: u64,
    /// Stop a sequence after it emits the card's end-of-sequence token (kept in the output).
    pub stop_at_eos: bool,
}

impl GenerateOptions {
    /// Greedy decoding of up to `max_new_tokens`, stopping at EOS.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerateOptions {
            max_new_tokens,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_at_eos: true,
        }
    }
}

/// The result for one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids (prompt excluded; the EOS that stopped it included).
    pub token_ids: Vec<u32>,
    /// Log-probability of each generated id under the model (unscaled softmax).
    pub logprobs: Vec<f32>,
    /// Logits at the last prompt position (full vocabulary).
    pub prompt_logits: Vec<f32>,
}

/// Why generation failed.
#[derive(Debug, thiserror::Error)]
pub enum OracleError {
    /// The checkpoint is unusable.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A kernel refused its inputs.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The KV cache ran out.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A prompt has no tokens.
    #[error("prompt {index} is empty")]
    EmptyPrompt {
        /// Prompt index.
        index: usize,
    },
    /// Prompt plus generation exceeds the model's positions.
    #[error("prompt {index}: {tokens} prompt + new tokens exceed the model's {max} positions")]
    TooLong {
        /// Prompt index.
        index: usize,
        /// Tokens needed.
        tokens: usize,
        /// Positions available.
        max: usize,
    },
}

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// Its KV blocks (covering `context_len + tokens.len()`).
    pub block_table: &'a [u32],
    /// Tokens already in the cache.
    pub context_len: usize,
    /// New tokens to run.
    pub tokens: &'a [u32],
}

/// The reference model over borrowed weights.
#[derive(Debug)]
pub struct Oracle<'a> {
    card: ModelCard,
    arch: ArchSpec,
    weights: ModelWeights<'a>,
    rope: RopeTable,
    kernels: Kernels,
    kv_type: KvType,
}

impl<'a> Oracle<'a> {
    /// The oracle over a checkpoint's memory-mapped tensors (all checked here).
    pub fn new(checkpoint: &'a Checkpoint) -> Result<Self, OracleError> {
        Ok(Self::from_weights(
            checkpoint.card(),
            checkpoint.model_weights()?,
        ))
    }

    /// The oracle over any weight views (e.g. layer images in other buffers).
    pub fn from_weights(card: &ModelCard, weights: ModelWeights<'a>) -> Self {
        let arch = ArchSpec::from_card(card);
        // A config may claim any context length; tables past 2^20 positions would only
        // waste memory (longer sequences are then a clean position error).
        let rope = RopeTable::for_arch(&arch, arch.max_positions.min(1 << 20));
        Oracle {
            card: card.clone(),
            arch,
            weights,
            rope,
            kernels: Kernels::process(),
            kv_type: KvType::F32,
        }
    }

    /// The same oracle running `kernels` instead of the process's choice. Only for
    /// comparing instruction sets: schedule invariance holds between an oracle and a run
    /// that use the same kernels.
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// The same oracle storing its KV cache in `kv_type`: under [`KvType::F16`] every key
    /// and value is rounded to a half when stored, as a run with `--kv-type f16` stores
    /// them, so the two give the same tokens.
    pub fn with_kv_type(mut self, kv_type: KvType) -> Self {
        self.kv_type = kv_type;
        self
    }

    /// The kernels every step runs.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// The card.
    pub fn card(&self) -> &ModelCard {
        &self.card
    }

    /// Kernel-facing architecture.
    pub fn arch(&self) -> &ArchSpec {
        &self.arch
    }

    /// Rotary tables (shared with callers that run layers themselves).
    pub fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// The weights.
    pub fn weights(&self) -> &ModelWeights<'a> {
        &self.weights
    }

    /// A KV cache with room for `tokens` tokens per entry of `seq_tokens`.
    pub fn new_cache(&self, seq_tokens: &[usize]) -> PagedKvCache {
        let layout = KvLayout {
            block_size: ORACLE_BLOCK_SIZE,
            kv_heads: self.arch.attn.kv_heads,
            head_dim: self.arch.attn.head_dim,
            values_in_keys: self.arch.values_in_keys(),
        };
        let blocks = seq_tokens.iter().map(|&t| layout.blocks_for(t)).sum();
        PagedKvCache::of_type(layout, self.arch.layers, blocks, self.kv_type)
    }

    /// Runs every layer over a micro-batch and returns the logits of each sequence's
    /// last new token (`[seqs.len(), vocab]`).
    pub fn step(
        &self,
        cache: &mut PagedKvCache,
        seqs: &[StepSeq<'_>],
    ) -> Result<Vec<f32>, OracleError> {
        let a = &self.arch;
        let k = self.kernels;
        let d = a.hidden;
        let ids: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let positions: Vec<usize> = seqs
            .iter()
            .flat_map(|s| (0..s.tokens.len()).map(move |j| s.context_len + j))
            .collect();
        let n = ids.len();
        let mut x = vec![0.0f32; n * d];
        embed(&self.weights.embed, &ids, &mut x)?;
        let mut x_norm = vec![0.0f32; n * d];
        let mut qkv = vec![0.0f32; n * a.attn.qkv_width()];
        let mut attn_out = vec![0.0f32; n * a.q_dim()];
        let attn_seqs: Vec<AttnSeq<'_>> = seqs
            .iter()
            .map(|s| AttnSeq {
                block_table: s.block_table,
                context_len: s.context_len,
                n_new: s.tokens.len(),
            })
            .collect();
        for (layer_idx, layer) in self.weights.layers.iter().enumerate() {
            k.pre_attn(
                a,
                &layer.dense,
                &self.rope,
                &x,
                &positions,
                &mut x_norm,
                &mut qkv,
            )?;
            k.attention(
                &mut cache.layer_mut(layer_idx),
                &attn_seqs,
                &qkv,
                &a.attn_of(layer_idx),
                &mut attn_out,
            )
            .map_err(KernelError::from)?;
            k.o_proj_residual(a, &layer.dense, &attn_out, &mut x)?;
            if a.is_dense(layer_idx) {
                crate::math::dense::dense_block(k, a, &layer.dense, &mut x)?;
                continue;
            }
            k.moe_block(a, &layer.dense, &mut x, |e| {
                layer.experts.get(e).cloned().ok_or(KernelError::Shape {
                    what: "expert index",
                    expected: layer.experts.len(),
                    got: e,
                })
            })?;
        }
        let mut last = Vec::with_capacity(seqs.len() * d);
        let mut row = 0;
        for s in seqs {
            row += s.tokens.len();
            last.extend_from_slice(&x[(row - 1) * d..row * d]);
        }
        let mut out = vec![0.0f32; seqs.len() * self.weights.lm_head.out_dim()];
        k.logits(
            a,
            self.weights.final_norm,
            &self.weights.lm_head,
            &last,
            &mut out,
        )?;
        Ok(out)
    }

    /// Prefills every prompt in one step, then decodes them together.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
    ) -> Result<Vec<Generation>, OracleError> {
        let max = self.rope.max_positions();
        for (index, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(OracleError::EmptyPrompt { index });
            }
            let tokens = p.len().saturating_add(options.max_new_tokens);
            if tokens > max {
                return Err(OracleError::TooLong { index, tokens, max });
            }
        }
        let budgets: Vec<usize> = prompts
            .iter()
            .map(|p| p.len() + options.max_new_tokens)
            .collect();
        let mut cache = self.new_cache(&budgets);
        let layout = cache.layout();
        let mut tables: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        for (t, &b) in tables.iter_mut().zip(&budgets) {
            cache.allocator.grow(&layout, t, b)?;
        }
        let mut rngs: Vec<Rng> = (0..prompts.len())
            .map(|i| Rng::new(options.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            .collect();
        let mut out: Vec<Generation> = prompts
            .iter()
            .map(|_| Generation {
                token_ids: Vec::new(),
                logprobs: Vec::new(),
                prompt_logits: Vec::new(),
            })
            .collect();
        if prompts.is_empty() || options.max_new_tokens == 0 {
            if !prompts.is_empty() {
                let seqs = self.prefill_seqs(prompts, &tables);
                let logits = self.step(&mut cache, &seqs)?;
                let vocab = logits.len() / prompts.len();
                for (i, g) in out.iter_mut().enumerate() {
                    g.prompt_logits = logits[i * vocab..(i + 1) * vocab].to_vec();
                }
            }
            return Ok(out);
        }
        let seqs = self.prefill_seqs(prompts, &tables);
        let logits = self.step(&mut cache, &seqs)?;
        let vocab = logits.len() / prompts.len();
        let mut active = Vec::new();
        for (i, g) in out.iter_mut().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            g.prompt_logits = row.to_vec();
            if self.push_token(g, row, options, &mut rngs[i]) {
                active.push(i);
            }
        }
        while !active.is_empty() {
            let last: Vec<[u32; 1]> = active
                .iter()
                .map(|&i| [*out[i].token_ids.last().unwrap_or(&0)])
                .collect();
            let seqs: Vec<StepSeq<'_>> = active
                .iter()
                .zip(&last)
                .map(|(&i, tok)| StepSeq {
                    block_table: &tables[i],
                    context_len: prompts[i].len() + out[i].token_ids.len() - 1,
                    tokens: tok,
                })
                .collect();
            let logits = self.step(&mut cache, &seqs)?;
            let mut still = Vec::new();
            for (k, &i) in active.iter().enumerate() {
                if self.push_token(
                    &mut out[i],
                    &logits[k * vocab..(k + 1) * vocab],
                    options,
                    &mut rngs[i],
                ) {
                    still.push(i);
                }
            }
            active = still;
        }
        Ok(out)
    }

    fn prefill_seqs<'s>(
        &self,
        prompts: &'s [Vec<u32>],
        tables: &'s [Vec<u32>],
    ) -> Vec<StepSeq<'s>> {
        prompts
            .iter()
            .zip(tables)
            .map(|(p, t)| StepSeq {
                block_table: t,
                context_len: 0,
                tokens: p,
            })
            .collect()
    }

    /// Samples and records one token; true if the sequence continues.
    fn push_token(
        &self,
        g: &mut Generation,
        logits: &[f32],
        options: &GenerateOptions,
        rng: &mut Rng,
    ) -> bool {
        let token = sample(logits, &options.sampling, rng);
        g.token_ids.push(token);
        g.logprobs.push(log_prob(logits, token));
        let eos = options.stop_at_eos && token == self.card.eos_token_id;
        !eos && g.token_ids.len() < options.max_new_tokens
    }
}
