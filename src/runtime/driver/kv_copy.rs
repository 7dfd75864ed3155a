//! The bytes a copy of part of a KV cache moves (`SLICE.context()`, `SLICE.appended()`).
//!
//! Takes the cache layout every backend's attention uses (`math::kv_cache`:
//! per layer a K pool then a V pool of equal size, each `[block][kv_head][tile]`, keys
//! transposed inside a tile; the K pool alone when the values are read from the keys,
//! `KvLayout::values_in_keys`), its element width (4, or 2 for a half cache), the copied
//! slice's length and a micro-batch's sequences; gives the byte runs (offset from the
//! slice's start, length) that hold the wanted positions of every sequence, sorted and
//! merged where adjacent. Guarantees: every run lies inside the slice; the runs cover
//! exactly `positions x kv_heads x head_dim x pools x elem` bytes; a block table that does not reach a wanted position, or a block past the pool,
//! is an error, never a copy of someone else's bytes.

use crate::ir::KvPart;
use crate::model::vocab::KvLayout;
use crate::runtime::driver::state::SeqSlot;

/// A sequence whose block table cannot hold the positions a KV copy names.
#[derive(Debug, thiserror::Error)]
#[error("sequence {request}'s block table ({blocks} blocks of {block_size}, pool of {pool_blocks}) does not hold position {position}")]
pub struct KvCopyError {
    /// The request whose sequence it is.
    pub request: usize,
    /// Blocks in its table.
    pub blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in each pool of the slice.
    pub pool_blocks: usize,
    /// The position that has no block.
    pub position: usize,
}

/// The byte runs of `part` of every sequence in `seqs`, in a cache slice of `slice_len`
/// bytes laid out as `layout` in elements of `elem` bytes (see the module header).
pub fn runs(
    layout: &KvLayout,
    elem: u64,
    slice_len: u64,
    seqs: &[SeqSlot],
    part: KvPart,
) -> Result<Vec<(u64, u64)>, KvCopyError> {
    let elem = elem.max(1);
    let block_elems = layout.block_elems().max(1) as u64;
    let pool_blocks = slice_len / elem / layout.pools() as u64 / block_elems;
    let has_values = layout.values_in_keys.is_none();
    let v_base = pool_blocks * block_elems * elem;
    let (bs, dim) = (layout.block_size.max(1), layout.head_dim);
    // Runs are gathered per block, K and V apart, each list ascending within its block
    // (a block's K tiles, head-major, then dimension-major inside a tile; its V rows
    // head-major); ordering the few blocks then gives every run in offset order without
    // sorting thousands of runs (a partial block is kv_heads x (head_dim + 1) of them).
    let mut keys: Vec<(u64, u64)> = Vec::new();
    let mut values: Vec<(u64, u64)> = Vec::new();
    // (block, its K runs, its V runs) as ranges of `keys` and `values`.
    let mut blocks: Vec<(u64, std::ops::Range<usize>, std::ops::Range<usize>)> = Vec::new();
    for seq in seqs {
        let (from, to) = match part {
            KvPart::Context => (0, seq.context_len),
            KvPart::Appended => (seq.context_len, seq.context_len + seq.new_tokens.len()),
        };
        let mut position = from;
        while position < to {
            let index = position / bs;
            let block = seq
                .block_table
                .get(index)
                .map(|&b| b as u64)
                .filter(|&b| b < pool_blocks)
                .ok_or(KvCopyError {
                    request: seq.request,
                    blocks: seq.block_table.len(),
                    block_size: bs,
                    pool_blocks: pool_blocks as usize,
                    position,
                })?;
            let lo = position - index * bs;
            let hi = to.min((index + 1) * bs) - index * bs;
            let (k0, v0) = (keys.len(), values.len());
            if lo == 0 && hi == bs {
                // A whole block: every head's K tile, then every head's V tile.
                let start = layout.tile(block as usize, 0) as u64 * elem;
                keys.push((start, block_elems * elem));
                if has_values {
                    values.push((v_base + start, block_elems * elem));
                }
            } else {
                let slots = (hi - lo) as u64;
                for head in 0..layout.kv_heads {
                    // Keys are transposed: each dimension holds the slots side by side.
                    for d in 0..dim {
                        let k = layout.key_offset(block as usize, head, lo, d) as u64;
                        keys.push((k * elem, slots * elem));
                    }
                    if has_values {
                        let v = layout.offset(block as usize, head, lo) as u64;
                        values.push((v_base + v * elem, slots * dim as u64 * elem));
                    }
                }
            }
            blocks.push((block, k0..keys.len(), v0..values.len()));
            position = (index + 1) * bs;
        }
    }
    blocks.sort_unstable_by_key(|b| (b.0, b.1.start));
    let ordered = blocks
        .iter()
        .flat_map(|b| keys[b.1.clone()].iter())
        .chain(blocks.iter().flat_map(|b| values[b.2.clone()].iter()));
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(keys.len() + values.len());
    out.extend(ordered);
    // A block named twice (no block table the runtime builds does that) breaks the order:
    // then the runs are sorted, so the result is the same either way.
    if !out.windows(2).all(|w| w[0] <= w[1]) {
        out.sort_unstable();
    }
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(out.len());
    for (start, len) in out {
        match merged.last_mut() {
            Some(last) if last.0 + last.1 >= start => {
                last.1 = last.1.max(start + len - last.0);
            }
            _ => merged.push((start, len)),
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of 4 slots, 2 KV heads of 3: a block's K (or V) is 2 x 4 x 3 = 24 elements,
    /// 96 bytes. A slice of 3 blocks per pool: 2 x 3 x 96 = 576 bytes, V from byte 288.
    const LAYOUT: KvLayout = KvLayout {
        block_size: 4,
        kv_heads: 2,
        head_dim: 3,
        values_in_keys: None,
    };
    const SLICE: u64 = 576;

    /// One sequence in blocks [1, 2] with 5 cached positions and 1 new token.
    fn seq() -> SeqSlot {
        SeqSlot {
            request: 0,
            context_len: 5,
            new_tokens: vec![7],
            block_table: vec![1, 2],
            prefill: false,
        }
    }

    #[test]
    fn appended_is_the_new_position_of_every_head_and_dimension() {
        // Position 5 = block 2, slot 1. K tile of (block 2, head h) starts at element
        // (2 * 2 + h) * 12: 48 and 60; key dim d of slot 1 at tile + 4d + 1. V row of slot 1
        // at tile + 3, 3 elements, after the K pool (288 bytes).
        let got = runs(&LAYOUT, 4, SLICE, &[seq()], KvPart::Appended).unwrap();
        let expected = vec![
            (196, 4),
            (212, 4),
            (228, 4),
            (244, 4),
            (260, 4),
            (276, 4),
            (288 + 51 * 4, 12),
            (288 + 63 * 4, 12),
        ];
        assert_eq!(got, expected);
        // One position: 2 heads x 3 dims x (K and V) x 4 bytes.
        assert_eq!(got.iter().map(|r| r.1).sum::<u64>(), 48);
    }

    #[test]
    fn context_is_whole_blocks_then_the_cached_slots_of_the_last() {
        // Positions 0..5: block 1 whole (K bytes 96..192, V 384..480), then slot 0 of
        // block 2 (K elements 48 + 4d and 60 + 4d; V rows at 48 and 60), merged where they
        // touch: K 96..196, V 384..492.
        let got = runs(&LAYOUT, 4, SLICE, &[seq()], KvPart::Context).unwrap();
        let expected = vec![
            (96, 100),
            (208, 4),
            (224, 4),
            (240, 4),
            (256, 4),
            (272, 4),
            (384, 108),
            (288 + 60 * 4, 12),
        ];
        assert_eq!(got, expected);
        assert_eq!(got.iter().map(|r| r.1).sum::<u64>(), 5 * 48);
    }

    /// A half cache (2-byte elements) in a slice of the same blocks, 288 bytes (V from
    /// byte 144): every run of the f32 case at half its offset and length.
    #[test]
    fn a_half_cache_moves_half_width_runs() {
        for part in [KvPart::Context, KvPart::Appended] {
            let wide = runs(&LAYOUT, 4, SLICE, &[seq()], part).unwrap();
            let half = runs(&LAYOUT, 2, SLICE / 2, &[seq()], part).unwrap();
            let halved: Vec<(u64, u64)> = wide.iter().map(|&(o, l)| (o / 2, l / 2)).collect();
            assert_eq!(half, halved, "{part:?}");
        }
    }

    #[test]
    fn a_table_that_misses_a_position_is_refused() {
        let mut s = seq();
        s.block_table = vec![1];
        let err = runs(&LAYOUT, 4, SLICE, &[s.clone()], KvPart::Appended).unwrap_err();
        assert_eq!(err.position, 5);
        // A block id past the pool (3 blocks) is refused too.
        s.block_table = vec![1, 3];
        assert!(runs(&LAYOUT, 4, SLICE, &[s], KvPart::Appended).is_err());
    }

    /// A cache whose values are read from the keys (MLA's latent once) is the K pool
    /// alone: in a slice of the same 3 blocks (288 bytes) every part moves exactly the K
    /// runs of the two-pool cache, and a slice of 2 blocks refuses block 2.
    #[test]
    fn a_cache_without_a_value_pool_moves_its_keys_only() {
        let lone = KvLayout {
            values_in_keys: Some(2),
            ..LAYOUT
        };
        for part in [KvPart::Context, KvPart::Appended] {
            let both = runs(&LAYOUT, 4, SLICE, &[seq()], part).unwrap();
            let keys: Vec<(u64, u64)> = both.into_iter().filter(|r| r.0 < SLICE / 2).collect();
            assert_eq!(runs(&lone, 4, SLICE / 2, &[seq()], part).unwrap(), keys);
        }
        assert!(runs(&lone, 4, SLICE / 3, &[seq()], KvPart::Appended).is_err());
    }

    /// Two sequences whose blocks are out of order in the pool (the second's block 0
    /// before the first's block 2): the runs come out in offset order, the same as
    /// sorting every run, K pool before V pool.
    #[test]
    fn runs_are_in_offset_order_across_sequences() {
        let mut other = seq();
        other.request = 1;
        other.block_table = vec![0];
        other.context_len = 2;
        let seqs = [seq(), other];
        for part in [KvPart::Context, KvPart::Appended] {
            let got = runs(&LAYOUT, 4, SLICE, &seqs, part).unwrap();
            let mut sorted = got.clone();
            sorted.sort_unstable();
            assert_eq!(got, sorted, "{part:?}");
            assert!(
                got.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
                "{part:?}"
            );
        }
        // Appended: position 5 of the first (block 2, slot 1) and position 2 of the
        // second (block 0, slot 2): 2 positions x 48 bytes.
        let appended = runs(&LAYOUT, 4, SLICE, &seqs, KvPart::Appended).unwrap();
        assert_eq!(appended.iter().map(|r| r.1).sum::<u64>(), 2 * 48);
        // Block 0's key runs (bytes 0..96) come first.
        assert_eq!(appended[0], (2 * 4, 4));
    }

    #[test]
    fn prefill_context_is_empty() {
        let mut s = seq();
        s.context_len = 0;
        s.new_tokens = vec![1; 5];
        assert!(runs(&LAYOUT, 4, SLICE, &[s], KvPart::Context)
            .unwrap()
            .is_empty());
    }
}
