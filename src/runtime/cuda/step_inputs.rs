//! A micro-batch's per-step inputs in one device buffer, copied once a step (issue 44,
//! point 3).
//!
//! Takes the step's [`MicroBatchState`] (the host's view of its sequences); gives the
//! device address of any of the small tables a step's kernels read of it: token ids,
//! positions, row -> sequence, block tables and each sequence's last row. All five are
//! laid out in one buffer ([`StepInputs`]) that the first op of the step on a stream to
//! ask for one of them uploads as one copy ([`super::launch::StreamCx::upload_step`]: one
//! copy node in a step's graph, at the same offsets every step); every later request of
//! the step on that stream reads its section there. Before, each table was a copy of its
//! own (positions, block tables and `lm_head`'s last rows: three copies a decode step on
//! `gpu_resident`, and DeepSeek's MLA copied its positions once a layer too).
//!
//! Every request passes the table its caller built, and gets the section only when the
//! bytes are equal; a table of the call's own (a prefill's scratch cache numbers its own
//! blocks) is uploaded by itself, once a step ([`GpuCx::step_input`]). So a kernel reads
//! exactly what it would have uploaded, whatever the pack holds.

use super::ops::GpuCx;
use crate::runtime::ops::{OpCx, OpError};
use crate::runtime::step::MicroBatchState;
use std::ops::Range;

/// One of the small tables a step's kernels read of its micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepInput {
    /// Token ids in row order (`embed`, when they are not where `sample` left them).
    Ids,
    /// Each row's position (rotary, KV append, attention).
    Positions,
    /// Each row's sequence (the row attention kernels).
    RowSeq,
    /// Every sequence's block table, padded with zeros to the longest
    /// ([`flat_block_tables`]).
    BlockTables,
    /// Each sequence's last row, the row whose logits it samples (`lm_head`'s gather).
    LastRows,
}

impl StepInput {
    /// The name of a table uploaded by itself (see [`GpuCx::step_input`]).
    fn name(self) -> &'static str {
        match self {
            StepInput::Ids => "token ids",
            StepInput::Positions => "positions",
            StepInput::RowSeq => "row_seq",
            StepInput::BlockTables => "block_tables",
            StepInput::LastRows => "last rows",
        }
    }
}

/// A micro-batch's step inputs as one buffer of 32-bit words: ids, positions, row ->
/// sequence, block tables, last rows, one after another (each a whole number of words, so
/// every section is as aligned as the buffer).
#[derive(Debug, PartialEq, Eq)]
pub struct StepInputs {
    words: Vec<u32>,
    /// Each input's words, indexed by the [`StepInput`] (the buffer's order).
    sections: [Range<usize>; 5],
}

impl StepInputs {
    /// The inputs of `mb`'s sequences this step.
    pub fn of(mb: &MicroBatchState) -> Self {
        let (tables, _) = flat_block_tables(mb.seqs.iter().map(|s| s.block_table.as_slice()));
        let (n, seqs) = (mb.n_tokens(), mb.seqs.len());
        let mut words = Vec::with_capacity(3 * n + tables.len() + seqs);
        // Where each section ends, in the buffer's order (`StepInput as usize`).
        let mut ends = [0usize; 5];
        words.extend(mb.seqs.iter().flat_map(|s| s.new_tokens.iter().copied()));
        ends[StepInput::Ids as usize] = words.len();
        // Positions are i32 on the device: the bits of the callers' `as i32`.
        for s in &mb.seqs {
            words.extend((0..s.new_tokens.len()).map(|j| (s.context_len + j) as i32 as u32));
        }
        ends[StepInput::Positions as usize] = words.len();
        for (i, s) in mb.seqs.iter().enumerate() {
            words.extend(std::iter::repeat_n(i as u32, s.new_tokens.len()));
        }
        ends[StepInput::RowSeq as usize] = words.len();
        words.extend_from_slice(&tables);
        ends[StepInput::BlockTables as usize] = words.len();
        let mut row = 0u32;
        for s in &mb.seqs {
            row += s.new_tokens.len() as u32;
            words.push(row.saturating_sub(1));
        }
        ends[StepInput::LastRows as usize] = words.len();
        let sections = std::array::from_fn(|i| if i == 0 { 0 } else { ends[i - 1] }..ends[i]);
        StepInputs { words, sections }
    }

    /// The words of input `which`.
    pub fn section(&self, which: StepInput) -> &[u32] {
        &self.words[self.sections[which as usize].clone()]
    }

    /// The whole buffer, as uploaded.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Where input `which` starts in the buffer, in bytes.
    pub fn byte_offset(&self, which: StepInput) -> u64 {
        4 * self.sections[which as usize].start as u64
    }
}

/// Block tables as the paged kernels read them: one row of `max_blocks` ids per sequence
/// (the longest table's length, at least 1), shorter tables padded with zeros. Gives the
/// rows and `max_blocks`.
pub fn flat_block_tables<'t>(
    tables: impl ExactSizeIterator<Item = &'t [u32]> + Clone,
) -> (Vec<u32>, usize) {
    let max_blocks = tables.clone().map(<[u32]>::len).max().unwrap_or(0).max(1);
    let mut flat = vec![0u32; tables.len() * max_blocks];
    for (row, t) in flat.chunks_exact_mut(max_blocks).zip(tables) {
        row[..t.len()].copy_from_slice(t);
    }
    (flat, max_blocks)
}

impl GpuCx<'_> {
    /// The device address of `data`, micro-batch `ub`'s input `which` this step: its
    /// section of the step's [`StepInputs`] when the bytes are equal (the buffer uploaded
    /// at the stream's first request of the step, as one copy), else a copy of `data` by
    /// itself, once a step (a table of the call's own). `0` for no data. Valid until the
    /// stream's next step.
    pub fn step_input<T>(&self, ub: u32, which: StepInput, data: &[T]) -> Result<u64, OpError>
    where
        T: bytemuck::Pod + cudarc::driver::DeviceRepr,
    {
        if data.is_empty() {
            return Ok(0);
        }
        let inputs = StepInputs::of(self.ub(ub)?);
        let mine: &[u8] = bytemuck::cast_slice(data);
        let packed: &[u8] = bytemuck::cast_slice(inputs.section(which));
        let at = if mine == packed {
            // The pack is `StepInputs::of` the micro-batch: a graph launched without its
            // ops writes it again from the next step's state (`Recorder::replay_plan`).
            self.s.recorder.begin_pack(self.s.lane, ub);
            let uploaded = self.s.upload_step("step inputs", ub, inputs.words());
            self.s.recorder.end_pack(self.s.lane);
            uploaded? + inputs.byte_offset(which)
        } else {
            self.s.upload_step(which.name(), ub, data)?
        };
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::step::SeqSlot;

    fn seq(context_len: usize, new_tokens: &[u32], block_table: &[u32]) -> SeqSlot {
        SeqSlot {
            request: 0,
            context_len,
            new_tokens: new_tokens.to_vec(),
            block_table: block_table.to_vec(),
            prefill: context_len == 0,
        }
    }

    /// A prompt of 3 tokens (one block) beside a decode row at position 17 (two blocks of
    /// 16), laid out by hand: ids, positions, row -> sequence, the tables padded to two
    /// blocks, last rows; each section what the attention and `lm_head` code builds.
    #[test]
    fn a_micro_batch_s_inputs_lie_in_one_buffer_in_order() {
        let mb = MicroBatchState {
            seqs: vec![seq(0, &[11, 12, 13], &[5]), seq(17, &[99], &[2, 7])],
            block_size: 16,
        };
        let inputs = StepInputs::of(&mb);
        #[rustfmt::skip]
        let want = [
            11, 12, 13, 99,  // ids
            0, 1, 2, 17,     // positions
            0, 0, 0, 1,      // row -> sequence
            5, 0, 2, 7,      // block tables, 2 a sequence
            2, 3,            // last rows
        ];
        assert_eq!(inputs.words(), want);
        assert_eq!(inputs.section(StepInput::Positions), [0, 1, 2, 17]);
        assert_eq!(inputs.byte_offset(StepInput::BlockTables), 48);
        assert_eq!(inputs.section(StepInput::LastRows), [2, 3]);
        let positions: Vec<u32> = mb.positions().iter().map(|&p| p as u32).collect();
        assert_eq!(inputs.section(StepInput::Positions), positions);
        assert_eq!(inputs.section(StepInput::Ids), mb.token_ids());
    }

    /// No sequence, or only empty tables: still one (zero) block a sequence, as the
    /// kernels' `max_blocks` needs at least 1.
    #[test]
    fn empty_tables_flatten_to_one_block_a_sequence() {
        assert_eq!(flat_block_tables(std::iter::empty()), (vec![], 1));
        let empty: [&[u32]; 2] = [&[], &[]];
        assert_eq!(flat_block_tables(empty.into_iter()), (vec![0, 0], 1));
        let mb = MicroBatchState::default();
        assert!(StepInputs::of(&mb).words().is_empty());
    }
}
