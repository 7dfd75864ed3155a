//! A paged KV cache: fixed-size blocks of keys and values (f32, or IEEE half bits under
//! [`KvType::F16`]), handed out to sequences through per-sequence block tables. A layout
//! whose values are read from the keys ([`KvLayout::values_in_keys`], DeepSeek MLA's
//! latent cached once) has an empty V pool.
//!
//! Takes a [`KvLayout`] (block size, kv heads, head width), an element type and a block
//! count; gives per-layer pools that the attention kernel reads through [`KvBlocksMut`]
//! views, and a [`BlockAllocator`] whose tables always cover the tokens they were grown
//! for. Running out of blocks is an error, never a panic.

use crate::model::vocab::{KvLayout, KvType};

/// One layer's K and V pools in their element type (equal lengths; V empty when the
/// layout reads the values from the keys).
#[derive(Debug)]
pub enum KvPools<'a> {
    /// f32 elements.
    F32 {
        /// Keys.
        k: &'a mut [f32],
        /// Values.
        v: &'a mut [f32],
    },
    /// IEEE half bits (`half::f16::to_bits`).
    F16 {
        /// Keys.
        k: &'a mut [u16],
        /// Values.
        v: &'a mut [u16],
    },
}

/// Mutable view of one layer's K and V pools (e.g. into a runtime arena).
#[derive(Debug)]
pub struct KvBlocksMut<'a> {
    /// Pool shape.
    pub layout: KvLayout,
    /// The pools, `n_blocks * layout.block_elems()` elements each.
    pub pools: KvPools<'a>,
}

impl<'a> KvBlocksMut<'a> {
    /// f32 pools.
    pub fn f32(layout: KvLayout, k: &'a mut [f32], v: &'a mut [f32]) -> Self {
        KvBlocksMut {
            layout,
            pools: KvPools::F32 { k, v },
        }
    }

    /// A K pool then a V pool of equal size (the K pool alone when the layout reads the
    /// values from the keys), as many whole blocks as `bytes` holds, in elements of
    /// `kv_type` (the runtime's `kv` arguments); `None` when the bytes are not aligned to
    /// the element.
    pub fn from_bytes(layout: KvLayout, kv_type: KvType, bytes: &'a mut [u8]) -> Option<Self> {
        let elem = kv_type.bytes() as usize;
        let block = layout.block_elems().max(1);
        let pools = layout.pools();
        let pool = bytes.len() / elem / pools / block * block;
        let bytes = &mut bytes[..pools * pool * elem];
        let pools = match kv_type {
            KvType::F32 => {
                let all: &mut [f32] = bytemuck::try_cast_slice_mut(bytes).ok()?;
                let (k, v) = all.split_at_mut(pool);
                KvPools::F32 { k, v }
            }
            KvType::F16 => {
                let all: &mut [u16] = bytemuck::try_cast_slice_mut(bytes).ok()?;
                let (k, v) = all.split_at_mut(pool);
                KvPools::F16 { k, v }
            }
        };
        Some(KvBlocksMut { layout, pools })
    }

    /// The element type.
    pub fn kv_type(&self) -> KvType {
        match self.pools {
            KvPools::F32 { .. } => KvType::F32,
            KvPools::F16 { .. } => KvType::F16,
        }
    }

    /// Blocks in this pool.
    pub fn n_blocks(&self) -> usize {
        let (k, v) = match &self.pools {
            KvPools::F32 { k, v } => (k.len(), v.len()),
            KvPools::F16 { k, v } => (k.len(), v.len()),
        };
        let elems = if self.layout.values_in_keys.is_some() {
            k
        } else {
            k.min(v)
        };
        elems / self.layout.block_elems().max(1)
    }

    /// Bytes the pools hold (what the runtime's `kv` slice gives them).
    pub fn bytes(&self) -> usize {
        match &self.pools {
            KvPools::F32 { k, v } => 4 * (k.len() + v.len()),
            KvPools::F16 { k, v } => 2 * (k.len() + v.len()),
        }
    }

    /// Both pools widened to f32 (tests and diagnostics).
    pub fn widened(&self) -> (Vec<f32>, Vec<f32>) {
        match &self.pools {
            KvPools::F32 { k, v } => (k.to_vec(), v.to_vec()),
            KvPools::F16 { k, v } => {
                let wide = |x: &[u16]| -> Vec<f32> {
                    x.iter()
                        .map(|&b| half::f16::from_bits(b).to_f32())
                        .collect()
                };
                (wide(k), wide(v))
            }
        }
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

/// Owned pools of one layer in their element type.
#[derive(Debug, Clone)]
enum OwnedPools {
    F32(Vec<f32>, Vec<f32>),
    F16(Vec<u16>, Vec<u16>),
}

/// An owned cache: one K and one V pool per layer (no V pool when the layout reads the
/// values from the keys), plus the allocator.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    layout: KvLayout,
    n_blocks: usize,
    pools: Vec<OwnedPools>,
    /// Hands out block ids for all layers at once.
    pub allocator: BlockAllocator,
}

impl PagedKvCache {
    /// Zeroed f32 pools of `n_blocks` blocks for `layers` layers.
    pub fn new(layout: KvLayout, layers: usize, n_blocks: usize) -> Self {
        Self::of_type(layout, layers, n_blocks, KvType::F32)
    }

    /// Zeroed pools of `kv_type` elements, `n_blocks` blocks for `layers` layers.
    pub fn of_type(layout: KvLayout, layers: usize, n_blocks: usize, kv_type: KvType) -> Self {
        let elems = n_blocks * layout.block_elems();
        let v_elems = if layout.values_in_keys.is_some() {
            0
        } else {
            elems
        };
        PagedKvCache {
            layout,
            n_blocks,
            pools: (0..layers)
                .map(|_| match kv_type {
                    KvType::F32 => OwnedPools::F32(vec![0.0; elems], vec![0.0; v_elems]),
                    KvType::F16 => OwnedPools::F16(vec![0; elems], vec![0; v_elems]),
                })
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
        let pools = match &mut self.pools[layer_idx] {
            OwnedPools::F32(k, v) => KvPools::F32 { k, v },
            OwnedPools::F16(k, v) => KvPools::F16 { k, v },
        };
        KvBlocksMut {
            layout: self.layout,
            pools,
        }
    }
}
