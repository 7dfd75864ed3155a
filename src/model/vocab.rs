//! The plain data types every floor of the model stack and the runtime share: a layer's
//! attention geometry ([`AttnShape`]) and KV cache layout ([`KvLayout`]), its norm
//! ([`NormKind`]), how a matrix is stored ([`Orientation`]), a router's decision
//! ([`Routing`], [`RoutedRow`]) and how the next token is picked ([`Sampling`]).
//!
//! They sit here, below the kernels (`crate::math`), because the card's architecture
//! (`ArchSpec`), the layout and the backends' plans name them as data; the kernels only
//! compute with them. Nothing here computes more than an offset or a count.

/// Head geometry of the attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Attend only to the last this-many positions (Mixtral's `sliding_window`).
    pub sliding_window: Option<usize>,
    /// Each query head has a learned sink logit (gpt-oss). The attention op has no weight
    /// argument, so `pre_attn` appends the layer's `heads` sink values to every `qkv` row
    /// (`[q | k | v | sinks]`) and attention reads them from there.
    pub sinks: bool,
}

impl AttnShape {
    /// Width of one `qkv` row: `(heads + 2 * kv_heads) * head_dim`, plus `heads` sink
    /// values with sinks.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim + if self.sinks { self.heads } else { 0 }
    }

    /// Width of one output row: `heads * head_dim`.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Shape of one block pool. Both pools are `[block][kv_head][tile]` with one tile of
/// `block_size * head_dim` f32 per (block, head): values are stored row per slot
/// (`[slot][head_dim]`, see [`KvLayout::offset`]) and keys transposed (`[head_dim][slot]`,
/// see [`KvLayout::key_offset`]), so decode attention scores 16 keys per vector with no
/// horizontal reductions. Only the attention kernel reads or writes inside a tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Token slots per block.
    pub block_size: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

impl KvLayout {
    /// f32 elements of K (or of V) in one block.
    pub fn block_elems(&self) -> usize {
        self.kv_heads * self.block_size * self.head_dim
    }

    /// Element offset of the tile of (block, head) inside a pool.
    pub fn tile(&self, block: usize, head: usize) -> usize {
        (block * self.kv_heads + head) * self.block_size * self.head_dim
    }

    /// Element offset of the value row of (block, head, slot) inside the V pool.
    pub fn offset(&self, block: usize, head: usize, slot: usize) -> usize {
        self.tile(block, head) + slot * self.head_dim
    }

    /// Element offset of key component `dim` of (block, head, slot) inside the K pool.
    pub fn key_offset(&self, block: usize, head: usize, slot: usize, dim: usize) -> usize {
        self.tile(block, head) + dim * self.block_size + slot
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// Which normalisation a family uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// `x * rsqrt(mean(x²) + eps) * w`.
    Rms,
    /// `(x - mean) * rsqrt(var + eps) * w`, no bias.
    LayerNoBias,
}

/// How a matrix is stored in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Orientation {
    /// `[out, in]`, PyTorch `nn.Linear` layout: `y = x Wᵀ`.
    OutIn,
    /// `[in, out]`: `y = x W` (DBRX's expert `w2`).
    InOut,
}

/// The router's decision for a batch of rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per row.
    pub top_k: usize,
    /// `[n_tokens, top_k]` chosen experts, highest probability first.
    pub experts: Vec<u32>,
    /// `[n_tokens, top_k]` routing weights after renormalisation.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Tokens (rows) this routing covers.
    pub fn n_tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }

    /// The rows each expert must process, by expert index, rows ascending.
    pub fn by_expert(&self, n_experts: usize) -> Vec<Vec<RoutedRow>> {
        let mut groups = vec![Vec::new(); n_experts];
        let k = self.top_k.max(1);
        for (i, (&e, &weight)) in self.experts.iter().zip(&self.weights).enumerate() {
            if let Some(g) = groups.get_mut(e as usize) {
                g.push(RoutedRow {
                    row: (i / k) as u32,
                    slot: (i % k) as u32,
                    weight,
                });
            }
        }
        groups
    }
}

/// One row routed to an expert.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutedRow {
    /// Row (token) index in the call.
    pub row: u32,
    /// Which of the row's `top_k` choices this is (its slot in the slot buffer).
    pub slot: u32,
    /// Routing weight.
    pub weight: f32,
}

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (lowest id on ties, like `torch.argmax`).
    Greedy,
    /// Sample from `softmax(logits / temperature)` restricted to the smallest set of most
    /// likely tokens whose probability reaches `top_p`.
    Temperature {
        /// Softmax temperature (> 0).
        temperature: f32,
        /// Nucleus mass in (0, 1].
        top_p: f32,
    },
}
