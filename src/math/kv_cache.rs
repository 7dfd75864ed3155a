//! A paged KV cache: fixed-size blocks of f32 keys and values, handed out to sequences
//! through per-sequence block tables.
//!
//! Takes a [`KvLayout`] (block size, kv heads, head width) and a block count; gives
//! per-layer pools that the attention kernel reads through [`KvBlocksMut`] views, and a
//! [`BlockAllocator`] whose tables always cover the tokens they were grown for. Running out
//! of blocks is an error, never a panic.

use crate::model::vocab::KvLayout;
/// Mutable view of one layer's K and V pools (e.g. into a runtime arena).
#[derive(Debug)]
pub struct KvBlocksMut<'a> {
    /// Pool shape.
    pub layout: KvLayout,
    /// Keys, `n_blocks * layout.block_elems()` elements.
    pub k: &'a mut [f32],
    /// Values, same length as `k`.
    pub v: &'a mut [f32],
}

impl KvBlocksMut<'_> {
    /// Blocks in this pool.
    pub fn n_blocks(&self) -> usize {
        self.k.len().min(self.v.len()) / self.layout.block_elems().max(1)
    }
}

/// Errors of block management.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// No free block left.
    #[error("KV cache is full: {needed} more blocks needed, {free} free")]
    OutOfBlocks {
        /// Blocks asked for.
        needed: usize,
        /// Blocks available.
        free: usize,
    },
}

/// Free-list allocator of block ids shared by all layers (a sequence uses the same block
/// ids in every layer's pool).
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
}

impl BlockAllocator {
    /// All `n_blocks` blocks free.
    pub fn new(n_blocks: usize) -> Self {
        BlockAllocator {
            free: (0..n_blocks as u32).rev().collect(),
        }
    }

    /// Free blocks.
    pub fn n_free(&self) -> usize {
        self.free.len()
    }

    /// Grows `table` so it covers `tokens` tokens.
    pub fn grow(
        &mut self,
        layout: &KvLayout,
        table: &mut Vec<u32>,
        tokens: usize,
    ) -> Result<(), KvError> {
        let needed = layout.blocks_for(tokens).saturating_sub(table.len());
        if needed > self.free.len() {
            return Err(KvError::OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            // The length check above guarantees the pop succeeds.
            if let Some(b) = self.free.pop() {
                table.push(b);
            }
        }
        Ok(())
    }

    /// Returns a finished sequence's blocks.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.extend(table.drain(..).rev());
    }
}

/// An owned cache: one K and one V pool per layer, plus the allocator.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    layout: KvLayout,
    n_blocks: usize,
    pools: Vec<(Vec<f32>, Vec<f32>)>,
    /// Hands out block ids for all layers at once.
    pub allocator: BlockAllocator,
}

impl PagedKvCache {
    /// Zeroed pools of `n_blocks` blocks for `layers` layers.
    pub fn new(layout: KvLayout, layers: usize, n_blocks: usize) -> Self {
        let elems = n_blocks * layout.block_elems();
        PagedKvCache {
            layout,
            n_blocks,
            pools: (0..layers)
                .map(|_| (vec![0.0; elems], vec![0.0; elems]))
                .collect(),
            allocator: BlockAllocator::new(n_blocks),
        }
    }

    /// Pool shape.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Blocks per layer.
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    /// View of layer `layer_idx`'s pools (caller keeps `layer_idx` < layers).
    pub fn layer_mut(&mut self, layer_idx: usize) -> KvBlocksMut<'_> {
        let (k, v) = &mut self.pools[layer_idx];
        KvBlocksMut {
            layout: self.layout,
            k,
            v,
        }
    }
}
