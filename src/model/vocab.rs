//! The plain data types every floor of the model stack and the runtime share: a layer's
//! attention geometry ([`AttnShape`]) and KV cache layout ([`KvLayout`]), its norm
//! ([`NormKind`]), how a matrix is stored ([`Orientation`]), a router's decision
//! ([`Routing`], [`RoutedRow`]) and its entries grouped by expert ([`ExpertGroups`], whose
//! doc states the MoE layer's contract every backend follows), and how the next token is
//! picked ([`Sampling`]).
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
/// `block_size * head_dim` elements (f32 or half, [`KvType`]) per (block, head): values are stored row per slot
/// (`[slot][head_dim]`, see [`KvLayout::offset`]) and keys transposed (`[head_dim][slot]`,
/// see [`KvLayout::key_offset`]), so decode attention scores 16 keys per vector with no
/// horizontal reductions. Only the attention kernel reads or writes inside a tile. With
/// [`KvLayout::values_in_keys`] there is no V pool: the values are read from the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Token slots per block.
    pub block_size: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// `Some(w)`: the cache is the K pool alone, and a slot's value is its key's first `w`
    /// components followed by `head_dim - w` zeros (DeepSeek MLA's `V = [c | 0]` with
    /// `K = [c | k_pe]`: the latent cached once, `card::Mla::values_in_keys`). `None`: a V
    /// pool of the K pool's size follows it.
    pub values_in_keys: Option<usize>,
}

impl KvLayout {
    /// Elements of K (or of V) in one block.
    pub fn block_elems(&self) -> usize {
        self.kv_heads * self.block_size * self.head_dim
    }

    /// Pools the cache holds: 1 (K alone, [`KvLayout::values_in_keys`]) or 2 (K then V).
    pub fn pools(&self) -> usize {
        if self.values_in_keys.is_some() {
            1
        } else {
            2
        }
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

/// The element type of a KV cache (`--kv-type`, as llama.cpp's `--cache-type-k/v`).
/// Attention always computes in f32: a half cache stores each key and value rounded to
/// IEEE binary16 (round to nearest even) and widens it exactly on read, so a run with
/// `F16` gives the bits of an f32 run whose cache held those rounded values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum KvType {
    /// 4 bytes per element (the default).
    #[default]
    F32,
    /// 2 bytes per element, IEEE half bits.
    F16,
}

impl KvType {
    /// Bytes per cached element.
    pub fn bytes(self) -> u64 {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    /// The type of `bytes`-wide elements (`None` for a width no cache has).
    pub fn of_bytes(bytes: u64) -> Option<KvType> {
        match bytes {
            4 => Some(KvType::F32),
            2 => Some(KvType::F16),
            _ => None,
        }
    }

    /// As written in `--kv-type`.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }

    /// Reads `--kv-type`.
    pub fn parse(text: &str) -> Result<KvType, String> {
        match text {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            other => Err(format!("`--kv-type {other}`: expected `f32` or `f16`")),
        }
    }
}

/// Most new tokens one CPU attention task takes: a tile's rows share each key block read.
pub const ATTENTION_QUERY_TILE: usize = 16;

/// Bound on one CPU attention task's score scratch, in floats (4 MiB): a tile takes fewer
/// rows when its rows' scores (`group x keys` each) would pass it, down to one row.
pub const ATTENTION_SCRATCH_FLOATS: usize = 1 << 20;

/// New tokens of one CPU attention task whose rows attend up to `longest` keys with
/// `group` query heads a kv head: as many as fit [`ATTENTION_SCRATCH_FLOATS`], from one
/// to [`ATTENTION_QUERY_TILE`].
pub fn attention_tile_rows(group: usize, longest: usize) -> usize {
    (ATTENTION_SCRATCH_FLOATS / (group * longest).max(1)).clamp(1, ATTENTION_QUERY_TILE)
}

/// Most bytes of scores one CPU worker thread keeps for attention (the kernel's score
/// scratch, kept between tasks) over `keys` positions with `new` tokens a sequence: one
/// tile's rows of `heads x keys` scores. `heads` bounds any GQA group: a wider group
/// takes fewer rows a tile but never fewer scores. The memory budget counts this per
/// thread.
pub fn attention_score_scratch_bytes(heads: u64, keys: u64, new: u64) -> u64 {
    let (group, keys) = (heads.max(1) as usize, keys.max(1) as usize);
    let rows = attention_tile_rows(group, keys).min(new.max(1) as usize);
    (rows as u64) * (group as u64) * (keys as u64) * 4
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
}

/// The MoE layer's group-by-expert stage on the host: the routed (token, slot) entries of a
/// [`Routing`] grouped by expert, rows ascending within an expert.
///
/// The MoE layer is one contract on every backend, staged as vLLM's `fused_moe` stages it:
/// 1. router: the post-attention norm of the residual and the router's top-k, giving a
///    [`Routing`] (on a device, the packed route: `(expert: u32, weight: f32)` per token
///    and slot) and the normalised rows (`math::moe::gate`; `acc`'s first rows);
/// 2. group by expert: the routing's entries per expert, as here;
/// 3. expert products: each expert over its group, `weight * y` into its entry's slot
///    (`[n_tokens, top_k, hidden]`; `math::moe::Kernels::experts_ffn` on the CPU);
/// 4. combine: each token's slots summed in ascending expert index, plus the shared
///    expert's row, into the residual (`math::moe::combine_shared`).
///
/// Only stages 2 and 3 are backend code: the CPU backend and the oracle group here and
/// multiply with `math::moe`; the CUDA backend groups on the device (`moe_group`, the same
/// count, prefix sum and stable permutation as [`ExpertGroups::regroup`]) and multiplies
/// with its grouped kernels, grouping here only when it has read the routing back.
///
/// A value is reusable: [`ExpertGroups::regroup`] keeps its buffers, so a backend that
/// regroups every layer allocates only while its largest batch grows.
#[derive(Debug, Clone, Default)]
pub struct ExpertGroups {
    /// `starts[e]..starts[e + 1]` are expert `e`'s entries of `rows`.
    starts: Vec<u32>,
    /// Every routed entry, grouped by expert.
    rows: Vec<RoutedRow>,
}

impl ExpertGroups {
    /// `routing`'s entries grouped by expert among `experts` experts.
    pub fn new(routing: &Routing, experts: usize) -> Self {
        let mut groups = ExpertGroups::default();
        groups.regroup(routing, experts);
        groups
    }

    /// Groups `routing`'s entries by expert among `experts` experts, in place: counts per
    /// expert, prefix sums, then a stable placement (rows ascending within an expert). An
    /// entry whose expert is not below `experts` (a dense layer's `NO_EXPERT`) is left
    /// out.
    pub fn regroup(&mut self, routing: &Routing, experts: usize) {
        let k = routing.top_k.max(1);
        self.starts.clear();
        self.starts.resize(experts + 1, 0);
        for &e in &routing.experts {
            if (e as usize) < experts {
                self.starts[e as usize + 1] += 1;
            }
        }
        for e in 0..experts {
            self.starts[e + 1] += self.starts[e];
        }
        let empty = RoutedRow {
            row: 0,
            slot: 0,
            weight: 0.0,
        };
        self.rows.clear();
        self.rows.resize(self.starts[experts] as usize, empty);
        // Each expert's next free place: its start, advanced as its entries are placed; the
        // starts are restored by shifting back once every entry is placed.
        for (i, (&e, &weight)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            let e = e as usize;
            if e >= experts {
                continue;
            }
            let at = self.starts[e] as usize;
            self.rows[at] = RoutedRow {
                row: (i / k) as u32,
                slot: (i % k) as u32,
                weight,
            };
            self.starts[e] += 1;
        }
        // starts[e] is now expert e's end, which is expert e + 1's start.
        for e in (0..experts).rev() {
            self.starts[e + 1] = self.starts[e];
        }
        if let Some(first) = self.starts.first_mut() {
            *first = 0;
        }
    }

    /// The rows routed to `expert` (empty for an expert past the grouped ones).
    pub fn rows_of(&self, expert: u32) -> &[RoutedRow] {
        let e = expert as usize;
        match (self.starts.get(e), self.starts.get(e + 1)) {
            (Some(&start), Some(&end)) => &self.rows[start as usize..end as usize],
            _ => &[],
        }
    }

    /// Every expert something was routed to, ascending, with its rows.
    pub fn routed(&self) -> impl Iterator<Item = (u32, &[RoutedRow])> {
        (0..self.starts.len().saturating_sub(1) as u32)
            .map(|e| (e, self.rows_of(e)))
            .filter(|(_, rows)| !rows.is_empty())
    }

    /// Each of `members`, in their order, with the rows routed to it; an expert nothing was
    /// routed to is left out (it has no product to compute).
    pub fn of<'g>(&'g self, members: &'g [u32]) -> impl Iterator<Item = (u32, &'g [RoutedRow])> {
        members
            .iter()
            .map(|&e| (e, self.rows_of(e)))
            .filter(|(_, rows)| !rows.is_empty())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Three tokens at top-2 over 4 experts, the middle token a dense layer's (no expert in
    /// either slot): expert 2 gets (0, 0) then (2, 1), expert 0 gets (0, 1), expert 3
    /// (2, 0), expert 1 nothing; regrouping a smaller routing reuses the value.
    #[test]
    fn expert_groups_place_entries_by_expert_rows_ascending() {
        let routing = Routing {
            top_k: 2,
            experts: vec![2, 0, u32::MAX, u32::MAX, 3, 2],
            weights: vec![0.6, 0.4, 0.0, 0.0, 0.3, 0.7],
        };
        let mut groups = ExpertGroups::new(&routing, 4);
        let pairs = |rows: &[RoutedRow]| -> Vec<(u32, u32, f32)> {
            rows.iter().map(|r| (r.row, r.slot, r.weight)).collect()
        };
        assert_eq!(pairs(groups.rows_of(2)), vec![(0, 0, 0.6), (2, 1, 0.7)]);
        assert_eq!(pairs(groups.rows_of(0)), vec![(0, 1, 0.4)]);
        assert_eq!(pairs(groups.rows_of(3)), vec![(2, 0, 0.3)]);
        assert!(groups.rows_of(1).is_empty() && groups.rows_of(9).is_empty());
        let routed: Vec<u32> = groups.routed().map(|(e, _)| e).collect();
        assert_eq!(routed, vec![0, 2, 3]);
        let members: Vec<u32> = groups.of(&[3, 1, 2]).map(|(e, _)| e).collect();
        assert_eq!(members, vec![3, 2]);
        let one = Routing {
            top_k: 1,
            experts: vec![1],
            weights: vec![1.0],
        };
        groups.regroup(&one, 4);
        assert_eq!(pairs(groups.rows_of(1)), vec![(0, 0, 1.0)]);
        assert_eq!(groups.routed().count(), 1);
    }
}
